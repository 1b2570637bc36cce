//! SIMD versions of the hot dot products, chosen at run time: AVX2 + FMA on x86_64. The scalar
//! kernels in `matmul.rs` stay the reference (tests compare the two) and the fallback elsewhere.
//! `PICCHIO_CPU_KERNELS=scalar` forces the scalar kernels.
//!
//! Each function sums in its own fixed order, the same for every row and token, so batching
//! still gives bit-identical results; against the scalar kernels they differ by rounding only.

use std::sync::OnceLock;

/// Which kernels the CPU tier runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernels {
    Scalar,
    /// x86_64 AVX2 with FMA.
    Avx2,
}

/// The kernels this CPU supports (detected once), unless `PICCHIO_CPU_KERNELS=scalar`.
pub fn kernels() -> CpuKernels {
    static CHOICE: OnceLock<CpuKernels> = OnceLock::new();
    *CHOICE.get_or_init(|| {
        if std::env::var("PICCHIO_CPU_KERNELS").is_ok_and(|v| v == "scalar") {
            return CpuKernels::Scalar;
        }
        detect()
    })
}

/// What the hardware supports, whatever the environment says.
pub fn detect() -> CpuKernels {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return CpuKernels::Avx2;
        }
    }
    CpuKernels::Scalar
}

/// Dot product of a float row (bf16, f16 or f32, little-endian) with `x` (AVX2 + FMA + F16C).
/// Every format sums in the same order, so widening a checkpoint's tensors changes nothing.
/// `None` when this CPU lacks the features.
pub fn dot_floats(format: crate::weights::FloatFormat, row: &[u8], x: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if detect() == CpuKernels::Avx2 {
            // Safety: the CPU supports AVX2, FMA and F16C (checked just above).
            return Some(unsafe { x86::dot_floats(format, row, x) });
        }
    }
    let _ = (format, row, x);
    None
}

/// `dot_floats` of a bf16 row.
pub fn dot_bf16(row: &[u8], x: &[f32]) -> Option<f32> {
    dot_floats(crate::weights::FloatFormat::Bf16, row, x)
}

/// Dot product of an MXFP4 row with `x` (AVX2 + FMA). `None` when this CPU lacks them.
pub fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> Option<f32> {
    #[cfg(target_arch = "x86_64")]
    {
        if detect() == CpuKernels::Avx2 {
            // Safety: the CPU supports AVX2 and FMA (checked just above).
            return Some(unsafe { x86::dot_mxfp4(blocks, scales, x) });
        }
    }
    let _ = (blocks, scales, x);
    None
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::cpu::formats::{bf16_to_f32, e8m0_scale, f16_to_f32};
    use crate::weights::FloatFormat;

    #[target_feature(enable = "avx2,fma")]
    fn sum8(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Eight values of `format` at `p`, as f32.
    ///
    /// # Safety
    /// `p` must point to 8 readable values (16 bytes, or 32 for f32).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(format: FloatFormat, p: *const u8) -> __m256 {
        // Safety: the caller guarantees the bytes are readable; unaligned loads are allowed.
        unsafe {
            match format {
                FloatFormat::Bf16 => {
                    let raw = _mm_loadu_si128(p.cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
                }
                FloatFormat::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                FloatFormat::F32 => _mm256_loadu_ps(p.cast()),
            }
        }
    }

    fn scalar_at(format: FloatFormat, row: &[u8], k: usize) -> f32 {
        match format {
            FloatFormat::Bf16 => bf16_to_f32(row[2 * k], row[2 * k + 1]),
            FloatFormat::F16 => f16_to_f32(row[2 * k], row[2 * k + 1]),
            FloatFormat::F32 => {
                f32::from_le_bytes([row[4 * k], row[4 * k + 1], row[4 * k + 2], row[4 * k + 3]])
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `row` holds `x.len()` values of `format`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_floats(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
        let size = format.size();
        assert_eq!(row.len(), size * x.len());
        let n = x.len();
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let at = i + 8 * k;
                // Safety: at + 8 <= n, so 8 values of `row` and of `x` are in bounds.
                let (w, xv) = unsafe {
                    (
                        load8(format, row.as_ptr().add(size * at)),
                        _mm256_loadu_ps(x.as_ptr().add(at)),
                    )
                };
                *a = _mm256_fmadd_ps(w, xv, *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            // Safety: i + 8 <= n.
            let (w, xv) = unsafe {
                (
                    load8(format, row.as_ptr().add(size * i)),
                    _mm256_loadu_ps(x.as_ptr().add(i)),
                )
            };
            acc[0] = _mm256_fmadd_ps(w, xv, acc[0]);
            i += 8;
        }
        let total = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut sum = sum8(total);
        for (k, xk) in x.iter().enumerate().skip(i) {
            sum += scalar_at(format, row, k) * xk;
        }
        sum
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `blocks` holds 16 bytes and `scales` one byte per 32
    /// values of `x`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
        let groups = x.len() / 32;
        assert!(blocks.len() >= 16 * groups && scales.len() >= groups && x.len() == 32 * groups);
        // Twice the E2M1 values, as bytes (the halving goes into the scale: exact).
        let lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
        let low = _mm_set1_epi8(0x0F);
        let mut total = _mm256_setzero_ps();
        for (g, &scale) in scales.iter().enumerate().take(groups) {
            // Safety: 16 bytes of group g lie within `blocks` (asserted above).
            let bytes = unsafe { _mm_loadu_si128(blocks.as_ptr().add(16 * g).cast()) };
            let lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low));
            let hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16::<4>(bytes), low));
            // Element order: low nibble of byte j is value 2j, high nibble value 2j + 1.
            let first = _mm_unpacklo_epi8(lo, hi);
            let second = _mm_unpackhi_epi8(lo, hi);
            let xs = x.as_ptr();
            let base = 32 * g;
            let w = [
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(first))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(second))),
            ];
            // Safety: the 32 floats of group g lie within `x` (asserted above).
            let acc = unsafe {
                let a = _mm256_mul_ps(w[0], _mm256_loadu_ps(xs.add(base)));
                let a = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xs.add(base + 8)), a);
                let a = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xs.add(base + 16)), a);
                _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xs.add(base + 24)), a)
            };
            let scale = _mm256_set1_ps(0.5 * e8m0_scale(scale));
            total = _mm256_fmadd_ps(acc, scale, total);
        }
        sum8(total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::{dot_dense_scalar, dot_mxfp4_scalar};
    use crate::weights::FloatFormat;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
                (v % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// |simd - scalar| within a few ulps of the sum of |terms| (rounding of a different order).
    fn close(simd: f32, scalar: f32, magnitude: f32, what: &str) {
        let bound = 1e-6 * magnitude.max(1.0) * 8.0;
        assert!(
            (simd - scalar).abs() <= bound,
            "{what}: simd {simd} vs scalar {scalar} (bound {bound})"
        );
    }

    #[test]
    fn simd_dots_match_the_scalar_reference() {
        if detect() == CpuKernels::Scalar {
            eprintln!("no SIMD kernels on this CPU: nothing to compare");
            return;
        }
        for n in [32, 64, 96, 2880, 2880 + 32] {
            let x = values(n, 7);
            let w = values(n, 3);
            let row: Vec<u8> = w
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            let magnitude: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
            let simd = dot_bf16(&row, &x).unwrap();
            close(
                simd,
                dot_dense_scalar(FloatFormat::Bf16, &row, &x),
                magnitude,
                "bf16",
            );

            let blocks: Vec<u8> = (0..n / 2).map(|i| (i * 37 + 11) as u8).collect();
            // Scales around 2^0, plus the extremes of E8M0.
            let scales: Vec<u8> = (0..n / 32).map(|g| [127, 120, 130, 1][g % 4]).collect();
            let simd = dot_mxfp4(&blocks, &scales, &x).unwrap();
            let scalar = dot_mxfp4_scalar(&blocks, &scales, &x);
            close(
                simd,
                scalar,
                6.0 * 8.0 * x.iter().map(|v| v.abs()).sum::<f32>(),
                "mxfp4",
            );
        }
        // The same values stored as f32 or f16 sum in the same order: bit-identical.
        for n in [40, 2880] {
            let x = values(n, 5);
            let bf16: Vec<u8> = values(n, 9)
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            let widened: Vec<u8> = bf16
                .chunks_exact(2)
                .flat_map(|b| crate::cpu::formats::bf16_to_f32(b[0], b[1]).to_le_bytes())
                .collect();
            let as_f16: Vec<u8> = [0u8, 0x3c, 0x00, 0xc0].repeat(n / 2); // 1.0, -2.0, ...
            let as_f32: Vec<u8> = [1.0f32, -2.0]
                .repeat(n / 2)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(
                dot_floats(FloatFormat::Bf16, &bf16, &x),
                dot_floats(FloatFormat::F32, &widened, &x)
            );
            assert_eq!(
                dot_floats(FloatFormat::F16, &as_f16, &x),
                dot_floats(FloatFormat::F32, &as_f32, &x)
            );
        }
        // Odd lengths: the bf16 tail runs scalar.
        let x = values(13, 1);
        let row: Vec<u8> = values(13, 2)
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        close(
            dot_bf16(&row, &x).unwrap(),
            dot_dense_scalar(FloatFormat::Bf16, &row, &x),
            13.0,
            "bf16 tail",
        );
    }
}
