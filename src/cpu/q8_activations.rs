//! MXFP4 experts times 8-bit activations: the CPU tier's optional faster numeric mode for the
//! experts (`--expert-activations q8`, never the default; llama.cpp multiplies MXFP4 experts the
//! same way). Each input row is cut into groups of 32 values, each quantized to signed bytes
//! with one f32 scale (max |x| / 127). The weights are not rounded: an FP4 value is a multiple of
//! 0.5, so twice it is a small whole number, and a group's 32 products add up exactly in 32-bit
//! integers; only each group's total is scaled and added in f32. Per 128 weights the AVX-512
//! kernel needs about half the vector instructions of the exact kernel, whose loop is what holds
//! an exact decode below the memory bandwidth on two cores.
//!
//! The exact path stays the default and the reference: `picchio agree --expert-activations q8`
//! reports how often this mode picks the same greedy token.

use super::simd::{CpuKernels, RowBytes};
use crate::formats::e8m0_scale;

/// How the CPU tier multiplies MXFP4 experts with their inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum ExpertActivations {
    /// f32 inputs: exact.
    #[default]
    Exact,
    /// Inputs quantized to 8 bits per 32 values (see the module documentation): faster, not
    /// exact. MXFP4 experts only: INT4 and unquantized experts stay exact.
    Q8,
}

impl ExpertActivations {
    pub fn name(self) -> &'static str {
        match self {
            ExpertActivations::Exact => "exact",
            ExpertActivations::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for ExpertActivations {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<ExpertActivations, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "exact" | "f32" => Ok(ExpertActivations::Exact),
            "q8" => Ok(ExpertActivations::Q8),
            _ => Err(format!("{text:?}: expected exact (f32) or q8")),
        }
    }
}

/// Twice each FP4 value (E2M1 code, sign in bit 3): whole numbers.
pub(crate) const FP4_DOUBLED: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// What the x86 kernels add to each doubled FP4 value to make it unsigned (their byte products
/// take one unsigned operand); `Q8Input` carries what that adds to each group's sum.
pub(crate) const FP4_OFFSET: i32 = 12;

/// Groups per run: the 64 packed bytes one AVX-512 vector holds.
pub(crate) const RUN_GROUPS: usize = 4;

/// One input row quantized for the MXFP4 x q8 kernels.
#[derive(Debug, Clone)]
pub struct Q8Input {
    groups: usize,
    /// Run by run (four groups; the last run may hold fewer): the 16 values at even positions
    /// of each of its groups, then the 16 at odd positions of each. A packed byte holds an even
    /// weight (low nibble) and the odd one after it, so one vector of bytes meets one vector of
    /// inputs.
    values: Vec<i8>,
    /// 16 per run, lane `4k + i` for group k of the run (zero past the last group): the group's
    /// scale over 2 (the weights are doubled).
    lane_scales: Vec<f32>,
    /// 16 per run, lane `4k` for group k of the run (the other lanes zero): `-FP4_OFFSET` times
    /// the sum of the group's values.
    lane_offsets: Vec<i32>,
}

impl Q8Input {
    /// Quantizes `x` (a whole number of groups of 32): scale = max |x| / 127 of each group,
    /// value = x / scale rounded to nearest, ties to even (a group of zeros has scale 0).
    pub fn quantize(x: &[f32]) -> Q8Input {
        assert!(
            x.len().is_multiple_of(32),
            "a q8 input holds whole groups of 32 values"
        );
        let groups = x.len() / 32;
        let runs = groups.div_ceil(RUN_GROUPS);
        let mut input = Q8Input {
            groups,
            values: vec![0; x.len()],
            lane_scales: vec![0.0; 16 * runs],
            lane_offsets: vec![0; 16 * runs],
        };
        for (g, group) in x.chunks_exact(32).enumerate() {
            let max = group.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = max / 127.0;
            let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let (even, odd) = input.group_offsets(g);
            let mut sum = 0i32;
            for (j, pair) in group.chunks_exact(2).enumerate() {
                let [a, b] = [pair[0], pair[1]].map(|v| round_to_i8(v * inverse));
                input.values[even + j] = a;
                input.values[odd + j] = b;
                sum += a as i32 + b as i32;
            }
            let (run, k) = (g / RUN_GROUPS, g % RUN_GROUPS);
            input.lane_scales[16 * run + 4 * k..16 * run + 4 * k + 4].fill(scale / 2.0);
            input.lane_offsets[16 * run + 4 * k] = -FP4_OFFSET * sum;
        }
        input
    }

    /// Groups of 32 values.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Where group g's even-position values start in `values`, and its odd ones.
    fn group_offsets(&self, g: usize) -> (usize, usize) {
        let (run, k) = (g / RUN_GROUPS, g % RUN_GROUPS);
        let in_run = RUN_GROUPS.min(self.groups - run * RUN_GROUPS);
        let base = run * RUN_GROUPS * 32;
        (base + 16 * k, base + 16 * in_run + 16 * k)
    }

    /// Group g's 16 even-position values and its 16 odd ones.
    pub(crate) fn group_values(&self, g: usize) -> (&[i8], &[i8]) {
        let (even, odd) = self.group_offsets(g);
        (&self.values[even..even + 16], &self.values[odd..odd + 16])
    }

    /// Group g's scale over 2.
    pub(crate) fn half_scale(&self, g: usize) -> f32 {
        self.lane_scales[16 * (g / RUN_GROUPS) + 4 * (g % RUN_GROUPS)]
    }

    /// The values, lane scales and lane offsets, for kernels that index them run by run.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn pointers(&self) -> (*const i8, *const f32, *const i32) {
        (
            self.values.as_ptr(),
            self.lane_scales.as_ptr(),
            self.lane_offsets.as_ptr(),
        )
    }
}

/// `y` (at most 127.5 in magnitude) rounded to nearest, ties to even. Adding and subtracting
/// 1.5 * 2^23 leaves no fraction bits, so float addition's own rounding does it: two adds the
/// compiler vectorizes, where `f32::round` is a library call per value on baseline x86_64.
fn round_to_i8(y: f32) -> i8 {
    const SHIFT: f32 = 12_582_912.0;
    ((y + SHIFT) - SHIFT) as i8
}

/// The weight scale of an E8M0 byte as the kernels apply it: the exponent bits alone, so byte 0
/// (2^-127, subnormal) counts as 0; a group that small adds nothing a float sum would keep.
pub(crate) fn e8m0_exponent_scale(byte: u8) -> f32 {
    match byte {
        0 => 0.0,
        b => e8m0_scale(b),
    }
}

/// `row . x` for one MXFP4 row (16 bytes and a scale byte per group), in integers per group.
/// The reference the SIMD kernels are tested against.
pub fn dot_mxfp4_q8_scalar(packed: &[u8], scales: &[u8], x: &Q8Input) -> f32 {
    assert!(
        packed.len() == 16 * x.groups && scales.len() == x.groups,
        "an MXFP4 row of {} groups",
        x.groups
    );
    let mut total = 0f32;
    for (g, (bytes, &scale)) in packed.chunks_exact(16).zip(scales).enumerate() {
        let (even, odd) = x.group_values(g);
        let mut sum = 0i32;
        for ((&byte, &e), &o) in bytes.iter().zip(even).zip(odd) {
            sum += FP4_DOUBLED[(byte & 15) as usize] as i32 * e as i32;
            sum += FP4_DOUBLED[(byte >> 4) as usize] as i32 * o as i32;
        }
        total += sum as f32 * (x.half_scale(g) * e8m0_exponent_scale(scale));
    }
    total
}

/// A dot product of one MXFP4 row with a quantized input.
pub type Q8Dot = fn(&[u8], &[u8], &Q8Input) -> f32;

/// Two runs of consecutive MXFP4 rows times one quantized input (decode), as `PackedDot::rows`.
pub type Q8Rows = fn([RowBytes; 2], &Q8Input, [&mut [f32]; 2]);

/// Dot products of one MXFP4 row with each of several quantized inputs, `out[t] = row . xs[t]`.
pub type Q8DotEach = fn(&[u8], &[u8], &[&Q8Input], &mut [f32]);

/// The MXFP4 x q8 kernels of a kernel set.
#[derive(Clone, Copy)]
pub struct Q8Kernel {
    pub dot: Q8Dot,
    /// Each result bit-identical to `dot`'s (the row decoded once for several inputs).
    pub dot_each: Q8DotEach,
    /// Each row bit-identical to `dot`'s.
    pub rows: Q8Rows,
}

/// The MXFP4 x q8 kernels of `kernels` (the scalar reference where the CPU lacks them).
pub fn q8_kernel(kernels: CpuKernels) -> Q8Kernel {
    super::simd::q8_activations::kernel(kernels).unwrap_or(Q8Kernel {
        dot: dot_mxfp4_q8_scalar,
        dot_each: |packed, scales, xs, out| {
            for (y, x) in out.iter_mut().zip(xs) {
                *y = dot_mxfp4_q8_scalar(packed, scales, x);
            }
        },
        rows: |runs, x, outs| super::simd::rows_with(dot_mxfp4_q8_scalar, runs, x, outs),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::dequantize_mxfp4_row;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state % 20001) as f32 / 10000.0 - 1.0
            })
            .collect()
    }

    fn row(groups: usize, seed: u32) -> (Vec<u8>, Vec<u8>) {
        let bytes = values(16 * groups, seed)
            .iter()
            .map(|v| ((v + 1.0) * 127.9) as u8)
            .collect();
        let scales = values(groups, seed + 1)
            .iter()
            .map(|v| 120 + ((v + 1.0) * 4.0) as u8)
            .collect();
        (bytes, scales)
    }

    #[test]
    fn rounding_goes_to_the_nearest_whole_number_ties_to_even() {
        for (y, expected) in [
            (0.49999997, 0),
            (0.5, 0),
            (1.5, 2),
            (-2.5, -2),
            (126.6, 127),
            (-127.0, -127),
            (3.2, 3),
        ] {
            assert_eq!(round_to_i8(y), expected, "{y}");
        }
    }

    #[test]
    fn quantized_dot_stays_within_the_rounding_bound_of_the_exact_dot() {
        for groups in [1, 2, 3, 4, 5, 90] {
            let (packed, scales) = row(groups, groups as u32);
            let x = values(32 * groups, 7 + groups as u32);
            let mut w = vec![0f32; 32 * groups];
            dequantize_mxfp4_row(&packed, &scales, &mut w);
            let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
            // Each input moves by at most half its group's step (max |x| / 127 / 2).
            let bound: f64 = w
                .chunks_exact(32)
                .zip(x.chunks_exact(32))
                .map(|(w, x)| {
                    let step = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                    w.iter().map(|v| v.abs() as f64).sum::<f64>() * step / 2.0
                })
                .sum();
            let q8 = dot_mxfp4_q8_scalar(&packed, &scales, &Q8Input::quantize(&x)) as f64;
            assert!(
                (q8 - exact).abs() <= bound * 1.001 + 1e-6 * exact.abs(),
                "groups {groups}: q8 {q8} vs exact {exact}, bound {bound}"
            );
            assert!(bound > 0.0, "the test rows are not all zeros");
        }
    }

    /// The sum of |each group's scaled total| of a row: the scale of the rounding in adding them.
    fn scaled_group_totals(packed: &[u8], scales: &[u8], x: &Q8Input) -> f32 {
        (0..x.groups())
            .map(|g| {
                let group = (&packed[16 * g..16 * (g + 1)], &scales[g..g + 1]);
                let one = Q8Input {
                    groups: 1,
                    values: [x.group_values(g).0, x.group_values(g).1].concat(),
                    lane_scales: [x.half_scale(g); 16].to_vec(),
                    lane_offsets: vec![0; 16],
                };
                dot_mxfp4_q8_scalar(group.0, group.1, &one).abs()
            })
            .sum()
    }

    /// Every kernel set this CPU runs.
    fn kernel_sets() -> Vec<CpuKernels> {
        let detected = crate::cpu::simd::detect();
        [
            CpuKernels::Scalar,
            CpuKernels::Avx2,
            CpuKernels::Avx512,
            CpuKernels::Neon,
        ]
        .into_iter()
        .filter(|&k| {
            k == CpuKernels::Scalar
                || k == detected
                || (k < detected && detected != CpuKernels::Neon)
        })
        .collect()
    }

    #[test]
    fn every_kernel_set_matches_the_scalar_reference() {
        for kernels in kernel_sets() {
            let kernel = q8_kernel(kernels);
            for groups in [1, 2, 3, 4, 5, 6, 7, 90] {
                let rows = 5;
                let (packed, scales) = row(groups * rows, 3 * groups as u32);
                let x = Q8Input::quantize(&values(32 * groups, groups as u32));
                let reference: Vec<f32> = (0..rows)
                    .map(|r| {
                        dot_mxfp4_q8_scalar(
                            &packed[16 * groups * r..16 * groups * (r + 1)],
                            &scales[groups * r..groups * (r + 1)],
                            &x,
                        )
                    })
                    .collect();
                for (r, &expected) in reference.iter().enumerate() {
                    let got = (kernel.dot)(
                        &packed[16 * groups * r..16 * groups * (r + 1)],
                        &scales[groups * r..groups * (r + 1)],
                        &x,
                    );
                    // Whole-number group sums agree exactly; only the f32 adds over the
                    // groups' scaled totals run in another order.
                    let magnitude = scaled_group_totals(
                        &packed[16 * groups * r..16 * groups * (r + 1)],
                        &scales[groups * r..groups * (r + 1)],
                        &x,
                    );
                    assert!(
                        (got - expected).abs() <= 1e-5 * magnitude,
                        "{} groups {groups} row {r}: {got} vs scalar {expected}",
                        kernels.name()
                    );
                }
                // One row times many inputs (blocks of eight and the rest) gives each `dot`.
                let many: Vec<Q8Input> = (0..11)
                    .map(|t| Q8Input::quantize(&values(32 * groups, 100 + t)))
                    .collect();
                let many: Vec<&Q8Input> = many.iter().collect();
                let mut each = vec![0f32; many.len()];
                let (packed0, scales0) = (&packed[..16 * groups], &scales[..groups]);
                (kernel.dot_each)(packed0, scales0, &many, &mut each);
                for (t, (got, x)) in each.iter().zip(&many).enumerate() {
                    let one = (kernel.dot)(packed0, scales0, x);
                    assert_eq!(
                        got.to_bits(),
                        one.to_bits(),
                        "{} groups {groups} input {t}: dot_each {got} vs dot {one}",
                        kernels.name()
                    );
                }
                // Two runs (rows 0..2 and 2..5) side by side give each row's `dot` bit for bit.
                let (mut a, mut b) = (vec![0f32; 2], vec![0f32; 3]);
                let split = (16 * groups * 2, groups * 2);
                (kernel.rows)(
                    [
                        (&packed[..split.0], &scales[..split.1]),
                        (&packed[split.0..], &scales[split.1..]),
                    ],
                    &x,
                    [&mut a, &mut b],
                );
                for (r, got) in a.iter().chain(&b).enumerate() {
                    let one = (kernel.dot)(
                        &packed[16 * groups * r..16 * groups * (r + 1)],
                        &scales[groups * r..groups * (r + 1)],
                        &x,
                    );
                    assert_eq!(
                        got.to_bits(),
                        one.to_bits(),
                        "{} groups {groups} row {r}: rows kernel {got} vs dot {one}",
                        kernels.name()
                    );
                }
            }
        }
    }
}
