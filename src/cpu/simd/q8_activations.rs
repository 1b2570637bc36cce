//! The MXFP4 x q8 kernels (`cpu::q8_activations`): AVX-512 VNNI and AVX2 on x86_64, NEON on
//! aarch64. Each sums a group's products in whole numbers, exactly as the scalar reference does,
//! and differs from it only in the order the groups' scaled totals are added.

use super::{CpuKernels, RowBytes};
#[cfg(target_arch = "x86_64")]
use crate::cpu::q8_activations::RUN_GROUPS;
use crate::cpu::q8_activations::{Q8Input, Q8Kernel};

/// The kernels of `kernels` on this CPU, None for the scalar reference.
pub(crate) fn kernel(kernels: CpuKernels) -> Option<Q8Kernel> {
    // A `Q8Kernel` from `$dots::<R, T>(rows, inputs)` (R rows times T inputs): one input per
    // row for `dot`, rows in pairs for `rows`, each row times blocks of inputs through
    // `$blocks` (a `for_blocks_of_*` macro) for `dot_each`. The caller guarantees what `$dots`
    // needs of the CPU. AVX2 takes four inputs at a time: with eight, its sixteen registers did
    // not hold the sums, the group's decoded weights and the constants, and the loop spilled.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    macro_rules! kernel_of {
        ($dots:path, $blocks:ident) => {
            Q8Kernel {
                dot: |packed, scales, x| unsafe { $dots([(packed, scales)], [x])[0][0] },
                dot_each: |packed, scales, xs, out| {
                    in_blocks!($blocks, xs, out, |block| unsafe {
                        $dots([(packed, scales)], block)[0]
                    })
                },
                rows: |runs, x, outs| {
                    in_pairs(
                        runs,
                        x,
                        outs,
                        |rows, x| unsafe { $dots(rows, [x]).map(|[y]| y) },
                        |row, x| unsafe { $dots([row], [x])[0][0] },
                    )
                },
            }
        };
    }
    match kernels.min(super::detect()) {
        // Safety (all): handed out only where `detect()` found AVX-512 F/BW/VL and AVX2, and
        // `has_vnni()` AVX-512 VNNI.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 if has_vnni() => Some(kernel_of!(x86::dots_vnni, for_blocks_of_eight)),
        // Safety (all): handed out only where `detect()` found AVX2 and FMA.
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 | CpuKernels::Avx2 => {
            Some(kernel_of!(x86::dots_avx2, for_blocks_of_four))
        }
        // Safety (all): handed out only where `detect()` found NEON.
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => Some(kernel_of!(neon::dots, for_blocks_of_eight)),
        _ => None,
    }
}

/// Whether this CPU has AVX-512 VNNI (byte dot products), detected once.
#[cfg(target_arch = "x86_64")]
fn has_vnni() -> bool {
    static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VNNI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vnni"))
}

/// A `Q8Rows` from a kernel of two rows side by side (row i of each run: two streams from
/// memory, each input vector loaded once for both) and its one-row form for the rows left over.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn in_pairs(
    runs: [RowBytes; 2],
    x: &Q8Input,
    outs: [&mut [f32]; 2],
    two: impl Fn([RowBytes; 2], &Q8Input) -> [f32; 2],
    one: impl Fn(RowBytes, &Q8Input) -> f32,
) {
    let groups = x.groups();
    for (k, (packed, scales)) in runs.iter().enumerate() {
        assert!(
            packed.len() == 16 * groups * outs[k].len() && scales.len() == groups * outs[k].len(),
            "consecutive MXFP4 rows hold 16 bytes and one scale per group of the input"
        );
    }
    let row = |k: usize, r: usize| {
        let (packed, scales) = runs[k];
        (
            &packed[16 * groups * r..16 * groups * (r + 1)],
            &scales[groups * r..groups * (r + 1)],
        )
    };
    let [first, second] = outs;
    let paired = first.len().min(second.len());
    for r in 0..paired {
        [first[r], second[r]] = two([row(0, r), row(1, r)], x);
    }
    for (k, out) in [first, second].into_iter().enumerate() {
        for (r, y) in out.iter_mut().enumerate().skip(paired) {
            *y = one(row(k, r), x);
        }
    }
}

/// Checks rows and inputs against each other (every row holds 16 bytes and one scale per group
/// of every input) and gives the number of groups.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn check_rows<const R: usize, const T: usize>(rows: &[RowBytes; R], xs: &[&Q8Input; T]) -> usize {
    let groups = xs.first().map_or(0, |x| x.groups());
    assert!(
        xs.iter().all(|x| x.groups() == groups)
            && rows
                .iter()
                .all(|(p, s)| p.len() == 16 * groups && s.len() == groups),
        "an MXFP4 row of {groups} groups"
    );
    groups
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::x86::prefetch_ahead;
    use super::{Q8Input, RUN_GROUPS, RowBytes, check_rows};
    use crate::cpu::q8_activations::{FP4_DOUBLED, FP4_OFFSET};

    /// Twice each FP4 value plus `FP4_OFFSET`: 0..=24, unsigned as the byte products need.
    const UNSIGNED_FP4: [u8; 16] = {
        let mut table = [0u8; 16];
        let mut n = 0;
        while n < 16 {
            table[n] = (FP4_DOUBLED[n] as i32 + FP4_OFFSET) as u8;
            n += 1;
        }
        table
    };

    /// A byte shuffle that puts scale byte k of a broadcast word, zero-extended, into every
    /// 32-bit lane of 128-bit lane k (the lanes of group k's sums); 0x80 zeroes a byte.
    const SCALE_SPREAD: [u8; 64] = {
        let mut index = [0x80u8; 64];
        let mut k = 0;
        while k < 4 {
            let mut j = 0;
            while j < 4 {
                index[16 * k + 4 * j] = k as u8;
                j += 1;
            }
            k += 1;
        }
        index
    };

    /// Scale bytes `first..first + n` of a row as one little-endian word (zeros past n).
    #[inline(always)]
    fn scale_word(scales: &[u8], first: usize, n: usize) -> i32 {
        if n == 4 {
            return i32::from_le_bytes(scales[first..first + 4].try_into().unwrap());
        }
        // Byte by byte, not a copy of n bytes: that is a library call, which would make the
        // loop keep its sums on the stack.
        (0..n).fold(0, |word, i| word | (scales[first + i] as i32) << (8 * i))
    }

    /// `R` rows times `T` inputs: `out[r][t] = rows[r] . xs[t]`, each result independent of the
    /// others (the same instructions whatever R and T). Each row's weights are decoded once for
    /// all inputs; full runs with plain loads and pointers (bounds checked once, above the loop),
    /// the last run, when it holds fewer than four groups, with masked loads.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and VNNI.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
    pub unsafe fn dots_vnni<const R: usize, const T: usize>(
        rows: [RowBytes; R],
        xs: [&Q8Input; T],
    ) -> [[f32; T]; R] {
        let groups = check_rows(&rows, &xs);
        let inputs = xs.map(Q8Input::pointers);
        // Safety: the tables hold 16 and 64 bytes; run `run` of an input holds 128 values and
        // 16 lanes of each kind, and of a row 64 bytes and 4 scales, when full (checked above,
        // and by `Q8Input`'s layout); the last run's loads are masked to its bytes, and a
        // masked load does not touch the bytes it leaves out.
        unsafe {
            let table = _mm512_broadcast_i32x4(_mm_loadu_si128(UNSIGNED_FP4.as_ptr().cast()));
            let spread = _mm512_loadu_si512(SCALE_SPREAD.as_ptr().cast());
            let nibble = _mm512_set1_epi8(0x0F);
            let mut totals = [[_mm512_setzero_ps(); T]; R];
            // One run of one row (`raw` its 64 packed bytes, `word` its 4 scale bytes) times
            // every input, `$load` giving an input's even values, odd values, lane scales and
            // lane offsets. Macros, not closures: the intrinsics need this function's target
            // features.
            macro_rules! run_times_inputs {
                ($totals:expr, $raw:expr, $word:expr, $load:ident) => {{
                    let raw = $raw;
                    let low = _mm512_shuffle_epi8(table, _mm512_and_si512(raw, nibble));
                    let high = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nibble);
                    let high = _mm512_shuffle_epi8(table, high);
                    let word = _mm512_set1_epi32($word);
                    let exponents = _mm512_slli_epi32::<23>(_mm512_shuffle_epi8(word, spread));
                    let exponents = _mm512_castsi512_ps(exponents);
                    for (total, &input) in $totals.iter_mut().zip(&inputs) {
                        let (even, odd, input_scales, offsets) = $load!(input);
                        let sums = _mm512_dpbusd_epi32(offsets, low, even);
                        let sums = _mm512_dpbusd_epi32(sums, high, odd);
                        let scale = _mm512_mul_ps(exponents, input_scales);
                        *total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, *total);
                    }
                }};
            }
            let full_runs = groups / RUN_GROUPS;
            for run in 0..full_runs {
                macro_rules! full {
                    ($input:expr) => {{
                        let (values, lane_scales, lane_offsets) = $input;
                        let v = values.add(128 * run);
                        (
                            _mm512_loadu_si512(v.cast()),
                            _mm512_loadu_si512(v.add(64).cast()),
                            _mm512_loadu_ps(lane_scales.add(16 * run)),
                            _mm512_loadu_si512(lane_offsets.add(16 * run).cast()),
                        )
                    }};
                }
                for (totals, (packed, scales)) in totals.iter_mut().zip(&rows) {
                    let p = packed.as_ptr().add(64 * run);
                    prefetch_ahead(p, 64);
                    let word = scales.as_ptr().add(4 * run).cast::<i32>().read_unaligned();
                    run_times_inputs!(totals, _mm512_loadu_si512(p.cast()), word, full);
                }
            }
            let n = groups - full_runs * RUN_GROUPS;
            if n > 0 {
                let (run, bytes) = (full_runs, u64::MAX >> (64 - 16 * n));
                macro_rules! last {
                    ($input:expr) => {{
                        let (values, lane_scales, lane_offsets) = $input;
                        let v = values.add(128 * run);
                        (
                            _mm512_maskz_loadu_epi8(bytes, v.cast()),
                            _mm512_maskz_loadu_epi8(bytes, v.add(16 * n).cast()),
                            _mm512_loadu_ps(lane_scales.add(16 * run)),
                            _mm512_loadu_si512(lane_offsets.add(16 * run).cast()),
                        )
                    }};
                }
                for (totals, (packed, scales)) in totals.iter_mut().zip(&rows) {
                    let raw = _mm512_maskz_loadu_epi8(bytes, packed.as_ptr().add(64 * run).cast());
                    let word = scale_word(scales, RUN_GROUPS * run, n);
                    run_times_inputs!(totals, raw, word, last);
                }
            }
            let mut out = [[0f32; T]; R];
            for (out, totals) in out.iter_mut().zip(&totals) {
                for (o, &t) in out.iter_mut().zip(totals) {
                    *o = _mm512_reduce_add_ps(t);
                }
            }
            out
        }
    }

    /// As `dots_vnni` with AVX2: two groups per step (one when a run has one left), the byte
    /// products through 16-bit pair sums (at most 2 * 24 * 127 each, no saturation).
    ///
    /// # Safety
    /// AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dots_avx2<const R: usize, const T: usize>(
        rows: [RowBytes; R],
        xs: [&Q8Input; T],
    ) -> [[f32; T]; R] {
        let groups = check_rows(&rows, &xs);
        let inputs = xs.map(Q8Input::pointers);
        // Safety: each load reads one or two groups' 16 bytes, or their lanes, that exist
        // (checked above, and by `Q8Input`'s layout); the tables hold 16 and 64 bytes.
        unsafe {
            let table = _mm256_broadcastsi128_si256(_mm_loadu_si128(UNSIGNED_FP4.as_ptr().cast()));
            let spread = _mm256_loadu_si256(SCALE_SPREAD.as_ptr().cast());
            let nibble = _mm256_set1_epi8(0x0F);
            let ones = _mm256_set1_epi16(1);
            let mut totals = [[_mm256_setzero_ps(); T]; R];
            for run in 0..groups.div_ceil(RUN_GROUPS) {
                let n = RUN_GROUPS.min(groups - run * RUN_GROUPS);
                let mut k = 0;
                while k < n {
                    let two = n - k >= 2;
                    // One group's 16 bytes (or lanes), or two groups' 32; a lone group's upper
                    // half is zero (weights 0 + offset times inputs 0, scales 0). A macro, not
                    // a closure: the intrinsics need this function's target features.
                    macro_rules! load {
                        ($p:expr) => {
                            if two {
                                _mm256_loadu_si256($p.cast())
                            } else {
                                _mm256_zextsi128_si256(_mm_loadu_si128($p.cast()))
                            }
                        };
                    }
                    for (totals, (packed, scales)) in totals.iter_mut().zip(&rows) {
                        let p = packed.as_ptr().add(64 * run + 16 * k);
                        prefetch_ahead(p, 32);
                        let raw = load!(p);
                        let low = _mm256_shuffle_epi8(table, _mm256_and_si256(raw, nibble));
                        let high = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nibble);
                        let high = _mm256_shuffle_epi8(table, high);
                        let word =
                            scale_word(scales, RUN_GROUPS * run + k, if two { 2 } else { 1 });
                        let exponents = _mm256_slli_epi32::<23>(_mm256_shuffle_epi8(
                            _mm256_set1_epi32(word),
                            spread,
                        ));
                        let exponents = _mm256_castsi256_ps(exponents);
                        for (total, &(values, lane_scales, lane_offsets)) in
                            totals.iter_mut().zip(&inputs)
                        {
                            let v = values.add(RUN_GROUPS * 32 * run);
                            let even = load!(v.add(16 * k));
                            let odd = load!(v.add(16 * n + 16 * k));
                            let lanes = 16 * run + 4 * k;
                            let input_scales = _mm256_castsi256_ps(load!(lane_scales.add(lanes)));
                            let offsets = load!(lane_offsets.add(lanes));
                            let pairs = _mm256_add_epi16(
                                _mm256_maddubs_epi16(low, even),
                                _mm256_maddubs_epi16(high, odd),
                            );
                            let sums = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), offsets);
                            let scale = _mm256_mul_ps(exponents, input_scales);
                            *total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, *total);
                        }
                    }
                    k += 2;
                }
            }
            let mut out = [[0f32; T]; R];
            for (out, totals) in out.iter_mut().zip(&totals) {
                for (o, &t) in out.iter_mut().zip(totals) {
                    let half = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t));
                    let pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
                    *o = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
                }
            }
            out
        }
    }
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use std::arch::aarch64::*;

    use super::{Q8Input, RowBytes, check_rows};
    use crate::cpu::q8_activations::{FP4_DOUBLED, e8m0_exponent_scale};

    /// `R` rows times `T` inputs as `dots_vnni` on x86, one group at a time: the signed
    /// doubled weights from a table lookup, byte products widened and added in 16 bits (at most
    /// 4 * 12 * 127 per lane), then 32.
    ///
    /// # Safety
    /// NEON.
    #[target_feature(enable = "neon")]
    pub unsafe fn dots<const R: usize, const T: usize>(
        rows: [RowBytes; R],
        xs: [&Q8Input; T],
    ) -> [[f32; T]; R] {
        let groups = check_rows(&rows, &xs);
        // Safety: every load reads a group's 16 bytes that exist (checked above); the table
        // holds 16.
        unsafe {
            let table = vld1q_s8(FP4_DOUBLED.as_ptr());
            let nibble = vdupq_n_u8(0x0F);
            let mut totals = [[vdupq_n_f32(0.0); T]; R];
            for g in 0..groups {
                for (totals, (packed, scales)) in totals.iter_mut().zip(&rows) {
                    let raw = vld1q_u8(packed.as_ptr().add(16 * g));
                    let low = vqtbl1q_s8(table, vandq_u8(raw, nibble));
                    let high = vqtbl1q_s8(table, vshrq_n_u8::<4>(raw));
                    let weight_scale = e8m0_exponent_scale(scales[g]);
                    for (total, x) in totals.iter_mut().zip(&xs) {
                        let (even, odd) = x.group_values(g);
                        let (even, odd) = (vld1q_s8(even.as_ptr()), vld1q_s8(odd.as_ptr()));
                        let mut products = vmull_s8(vget_low_s8(low), vget_low_s8(even));
                        products = vmlal_high_s8(products, low, even);
                        products = vmlal_s8(products, vget_low_s8(high), vget_low_s8(odd));
                        products = vmlal_high_s8(products, high, odd);
                        let sums = vcvtq_f32_s32(vpaddlq_s16(products));
                        *total = vfmaq_n_f32(*total, sums, x.half_scale(g) * weight_scale);
                    }
                }
            }
            let mut out = [[0f32; T]; R];
            for (out, totals) in out.iter_mut().zip(&totals) {
                for (o, &t) in out.iter_mut().zip(totals) {
                    *o = vaddvq_f32(t);
                }
            }
            out
        }
    }
}
