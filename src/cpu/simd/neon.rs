//! NEON kernels (aarch64: Apple Silicon, Graviton, Ampere): 128-bit vectors, fused
//! multiply-adds. NEON is part of every aarch64 CPU, so these need no run-time check beyond the
//! target. Each sums in its own fixed order, the same for every row and token, and every float
//! format in the same one (widening a checkpoint's tensors changes nothing).

use std::arch::aarch64::*;

use crate::cpu::formats::{e8m0_scale, f16_to_f32};
use crate::cpu::matmul::decode_at;
use crate::weights::FloatFormat;

/// Four f32 values of `format` at `p`, exactly.
///
/// # Safety
/// `p` points to four readable values.
#[inline(always)]
unsafe fn load4(format: FloatFormat, p: *const u8) -> float32x4_t {
    // Safety: the caller's guarantee; NEON loads need no alignment.
    unsafe {
        match format {
            // A bf16 value is the high half of an f32: widen each 16 bits, shifted up by 16.
            FloatFormat::Bf16 => vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p.cast()))),
            FloatFormat::F16 => f16_to_f32x4(vmovl_u16(vld1_u16(p.cast()))),
            FloatFormat::F32 => vld1q_f32(p.cast()),
        }
    }
}

/// Four f16 values (in the low 16 bits of each lane) as f32, exactly: exponent and mantissa
/// moved into an f32's fields and rebiased by a multiply by 2^112 (which also makes f16
/// subnormals normal), infinities and NaNs given the all-ones exponent, the sign put back.
#[inline(always)]
fn f16_to_f32x4(halves: uint32x4_t) -> float32x4_t {
    // Safety: NEON is part of the aarch64 target; these are register operations.
    unsafe {
        let magnitude = vandq_u32(halves, vdupq_n_u32(0x7FFF));
        let sign = vshlq_n_u32::<16>(vandq_u32(halves, vdupq_n_u32(0x8000)));
        let moved = vshlq_n_u32::<13>(magnitude);
        let rebiased = vmulq_f32(vreinterpretq_f32_u32(moved), vdupq_n_f32(2f32.powi(112)));
        let special = vcgeq_u32(magnitude, vdupq_n_u32(0x7C00));
        let special_bits = vorrq_u32(moved, vdupq_n_u32(0x7F80_0000));
        let bits = vbslq_u32(special, special_bits, vreinterpretq_u32_f32(rebiased));
        vreinterpretq_f32_u32(vorrq_u32(bits, sign))
    }
}

/// `row . x` for a row of bf16, f16 or f32 values.
pub fn dot_floats(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
    let size = format.size();
    assert_eq!(row.len(), size * x.len(), "row and input of one length");
    let (n, w, xs) = (x.len(), row.as_ptr(), x.as_ptr());
    // Safety (all loads): each reads four values at an index i with i + 4 <= n, within `row`
    // (checked above) and `x`. NEON is part of the aarch64 target.
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let at = i + 4 * k;
                *a = vfmaq_f32(*a, load4(format, w.add(size * at)), vld1q_f32(xs.add(at)));
            }
            i += 16;
        }
        while i + 4 <= n {
            acc[0] = vfmaq_f32(acc[0], load4(format, w.add(size * i)), vld1q_f32(xs.add(i)));
            i += 4;
        }
        let total = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
        let mut sum = vaddvq_f32(total);
        for (k, xk) in x.iter().enumerate().skip(i) {
            sum += decode_at(format, row, k) * xk;
        }
        sum
    }
}

/// Adds 16 signed bytes, widened to f32, times the 16 inputs at `xs` into `sums`: each four
/// values in turn, alternating between the two sums.
///
/// # Safety
/// `xs` points to 16 readable f32 values.
#[inline(always)]
unsafe fn add_bytes_times_inputs(values: int8x16_t, xs: *const f32, sums: &mut [float32x4_t; 2]) {
    // Safety: the caller's guarantee covers the four 4-value loads; the rest are register
    // operations, and NEON is part of the aarch64 target.
    unsafe {
        let wide = [vmovl_s8(vget_low_s8(values)), vmovl_high_s8(values)];
        for (q, wide) in wide.into_iter().enumerate() {
            let quads = [vmovl_s16(vget_low_s16(wide)), vmovl_high_s16(wide)];
            for (r, quad) in quads.into_iter().enumerate() {
                let w = vcvtq_f32_s32(quad);
                sums[r] = vfmaq_f32(sums[r], w, vld1q_f32(xs.add(8 * q + 4 * r)));
            }
        }
    }
}

/// `sum over groups g of scale(g) * sum_j lut[nibble j] * x_j` for a packed 4-bit row with `x`
/// in natural order (the low nibble of byte j is value 2j, the high nibble value 2j + 1): the
/// nibbles index a 16-byte table of small integers, widened to f32.
#[inline(always)]
fn dot_nibbles(lut: int8x16_t, blocks: &[u8], x: &[f32], scale: impl Fn(usize) -> f32) -> f32 {
    let groups = x.len() / 32;
    assert!(
        blocks.len() >= 16 * groups && x.len() == 32 * groups,
        "16 bytes per group of 32 inputs"
    );
    // Safety (all loads): group g's 16 bytes and 32 inputs are in bounds (asserted above).
    unsafe {
        let mut total = vdupq_n_f32(0.0);
        for g in 0..groups {
            let bytes = vld1q_u8(blocks.as_ptr().add(16 * g));
            let low = vqtbl1q_s8(lut, vandq_u8(bytes, vdupq_n_u8(0x0F)));
            let high = vqtbl1q_s8(lut, vshrq_n_u8::<4>(bytes));
            // Values 0-15 and 16-31 in order: each byte's low nibble, then its high one.
            let halves = [vzip1q_s8(low, high), vzip2q_s8(low, high)];
            let xs = x.as_ptr().add(32 * g);
            let mut sums = [vdupq_n_f32(0.0); 2];
            for (h, values) in halves.into_iter().enumerate() {
                add_bytes_times_inputs(values, xs.add(16 * h), &mut sums);
            }
            total = vfmaq_n_f32(total, vaddq_f32(sums[0], sums[1]), scale(g));
        }
        vaddvq_f32(total)
    }
}

/// `row . x` for an MXFP4 row: 16 bytes and one E8M0 scale per 32 values of `x`.
pub fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    assert!(scales.len() >= x.len() / 32, "a scale per group");
    // Twice the E2M1 values, as bytes (the halving goes into the scale: exact).
    const TWICE_FP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    // Safety: 16 bytes from a 16-byte array.
    let lut = unsafe { vld1q_s8(TWICE_FP4.as_ptr()) };
    dot_nibbles(lut, blocks, x, |g| 0.5 * e8m0_scale(scales[g]))
}

/// `row . x` for a group-scaled INT4 row: 16 bytes and one little-endian f16 scale per 32 values
/// of `x`.
pub fn dot_int4(qweight: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    assert!(scales.len() >= 2 * (x.len() / 32), "a scale per group");
    const INT4: [i8; 16] = [-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7];
    // Safety: 16 bytes from a 16-byte array.
    let lut = unsafe { vld1q_s8(INT4.as_ptr()) };
    dot_nibbles(lut, qweight, x, |g| {
        f16_to_f32(scales[2 * g], scales[2 * g + 1])
    })
}

/// `row . x` for a q8 row: signed bytes and one little-endian f16 scale per 32 of them.
pub fn dot_q8(values: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let groups = x.len() / 32;
    assert!(
        values.len() == x.len() && x.len() == 32 * groups && scales.len() >= 2 * groups,
        "32 values and a scale per group of 32 inputs"
    );
    // Safety (all loads): group g's 32 values and inputs are in bounds (asserted above).
    unsafe {
        let mut total = vdupq_n_f32(0.0);
        for g in 0..groups {
            let xs = x.as_ptr().add(32 * g);
            let mut sums = [vdupq_n_f32(0.0); 2];
            for h in 0..2 {
                let bytes = vld1q_s8(values.as_ptr().add(32 * g + 16 * h).cast());
                add_bytes_times_inputs(bytes, xs.add(16 * h), &mut sums);
            }
            let scale = f16_to_f32(scales[2 * g], scales[2 * g + 1]);
            total = vfmaq_n_f32(total, vaddq_f32(sums[0], sums[1]), scale);
        }
        vaddvq_f32(total)
    }
}
