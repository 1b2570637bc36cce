//! NEON kernels (aarch64: Apple Silicon, Graviton, Ampere): 128-bit vectors, fused
//! multiply-adds. NEON is part of every aarch64 CPU, so these need no run-time check beyond the
//! target. Each sums in its own fixed order, the same for every row and token, and every float
//! format in the same one (widening a checkpoint's tensors changes nothing).

use std::arch::aarch64::*;

/// MXFP4 through byte tables with the scales folded in.
pub(super) mod byte_tables;

use super::{GroupFormat, TILE_GROUPS, TILE_ROWS};
use crate::cpu::matmul::decode_at;
use crate::formats::{e8m0_scale, f16_to_f32};
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

/// Four running sums per input, 4 lanes each: value `16 s + 4 k + j` of a float row goes into
/// lane j of sum k.
type FloatSums<const T: usize> = [[float32x4_t; 4]; T];

/// Adds the 16-value steps `steps` of `row` times `T` inputs to `sums`, each vector of the row
/// decoded once for all inputs.
#[inline(always)]
fn float_steps<const T: usize>(
    format: FloatFormat,
    row: &[u8],
    xs: [&[f32]; T],
    steps: std::ops::Range<usize>,
    sums: &mut FloatSums<T>,
) {
    let size = format.size();
    let n = row.len() / size;
    assert!(16 * steps.end <= n && xs.iter().all(|x| x.len() == n));
    let mut acc = *sums;
    for s in steps {
        for k in 0..4 {
            let at = 16 * s + 4 * k;
            // Safety: at + 4 <= n (asserted above): four values of the row and of each input.
            // NEON is part of the aarch64 target.
            unsafe {
                let w = load4(format, row.as_ptr().add(size * at));
                for (a, x) in acc.iter_mut().zip(&xs) {
                    a[k] = vfmaq_f32(a[k], w, vld1q_f32(x.as_ptr().add(at)));
                }
            }
        }
    }
    *sums = acc;
}

/// Each input's dot product with `row` from its sums over the whole 16-value steps: the 4-value
/// steps after them into sum 0, the four sums added pairwise, the last values one by one.
#[inline(always)]
fn float_finish<const T: usize>(
    format: FloatFormat,
    row: &[u8],
    xs: [&[f32]; T],
    sums: &FloatSums<T>,
) -> [f32; T] {
    let size = format.size();
    let n = row.len() / size;
    assert!(xs.iter().all(|x| x.len() == n));
    let mut dots = [0f32; T];
    for ((dot, &(mut acc)), x) in dots.iter_mut().zip(sums).zip(&xs) {
        let mut i = 16 * (n / 16);
        // Safety: each load reads four values at i with i + 4 <= n; NEON is part of the target.
        unsafe {
            while i + 4 <= n {
                let w = load4(format, row.as_ptr().add(size * i));
                acc[0] = vfmaq_f32(acc[0], w, vld1q_f32(x.as_ptr().add(i)));
                i += 4;
            }
            let total = vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3]));
            *dot = vaddvq_f32(total);
        }
        for (k, xk) in x.iter().enumerate().skip(i) {
            *dot += decode_at(format, row, k) * xk;
        }
    }
    dots
}

/// `row` times each of `T` inputs.
#[inline(always)]
fn dot_floats_tokens<const T: usize>(format: FloatFormat, row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    // Safety: NEON is part of the aarch64 target.
    let mut sums = [[unsafe { vdupq_n_f32(0.0) }; 4]; T];
    float_steps(
        format,
        row,
        xs,
        0..row.len() / format.size() / 16,
        &mut sums,
    );
    float_finish(format, row, xs, &sums)
}

/// `row . x` for a row of bf16, f16 or f32 values.
pub fn dot_floats(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
    assert_eq!(
        row.len(),
        format.size() * x.len(),
        "row and input of one length"
    );
    dot_floats_tokens(format, row, [x])[0]
}

/// `out[t] = row . xs[t]`, four inputs at a time (16 sums and 4 decoded vectors in registers).
pub fn dot_floats_each(format: FloatFormat, row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    assert!(xs.iter().all(|x| row.len() == format.size() * x.len()));
    in_blocks_of_four!(xs, out, |block| dot_floats_tokens(format, row, block));
}

/// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, `out[r * stride + t]`: 256 values of
/// every row before the next 256, so that the inputs' slices stay in L1 across the rows.
/// Bit-identical to `dot_floats`.
#[inline(always)]
fn float_tile<const T: usize>(
    format: FloatFormat,
    rows: &[&[u8]],
    xs: [&[f32]; T],
    (out, stride): (&mut [f32], usize),
) {
    let n = super::float_tile_len(format, rows, &xs);
    // Safety: NEON is part of the aarch64 target.
    let mut sums = [[[unsafe { vdupq_n_f32(0.0) }; 4]; T]; TILE_ROWS];
    for steps in super::blocks(n / 16, 16) {
        for (row, sums) in rows.iter().zip(sums.iter_mut()) {
            float_steps(format, row, xs, steps.clone(), sums);
        }
    }
    // By reference: iterating the array by value copies all of it (16 rows' sums) per tile.
    for (r, (row, sums)) in rows.iter().zip(&sums).enumerate() {
        out[r * stride..r * stride + T].copy_from_slice(&float_finish(format, row, xs, sums));
    }
}

/// Rows (at most `TILE_ROWS`) times every input, `out[r * xs.len() + t]`, four inputs at a time.
pub fn floats_tile(format: FloatFormat, rows: &[&[u8]], xs: &[&[f32]], out: &mut [f32]) {
    let stride = xs.len();
    for_blocks_of_four!(xs, |block, t| float_tile(
        format,
        rows,
        block,
        (&mut out[t..], stride)
    ));
}

/// What group `g`'s weights (as `group_weights` gives them) are multiplied by.
fn group_scale(format: GroupFormat, scales: &[u8], g: usize) -> f32 {
    match format {
        GroupFormat::Mxfp4 => 0.5 * e8m0_scale(scales[g]),
        _ => f16_to_f32(scales[2 * g], scales[2 * g + 1]),
    }
}

/// One row of a group format: its bytes and scale bytes, and for 4-bit codes their table.
#[derive(Clone, Copy)]
struct GroupRow<'a> {
    format: GroupFormat,
    small_integers: int8x16_t,
    bytes: &'a [u8],
    scales: &'a [u8],
}

impl<'a> GroupRow<'a> {
    fn new(format: GroupFormat, (bytes, scales): (&'a [u8], &'a [u8])) -> GroupRow<'a> {
        let groups = bytes.len() / format.bytes_per_group();
        assert!(
            bytes.len() == format.bytes_per_group() * groups
                && scales.len() >= groups * format.scale_bytes(),
            "a row holds whole groups of 32 weights and a scale per group"
        );
        // Safety: 16 bytes from a 16-byte array.
        let small_integers = unsafe { vld1q_s8(format.small_integers().as_ptr()) };
        GroupRow {
            format,
            small_integers,
            bytes,
            scales,
        }
    }

    fn groups(&self) -> usize {
        self.bytes.len() / self.format.bytes_per_group()
    }
}

/// 16 signed bytes widened to f32: four vectors of four, in order.
#[inline(always)]
fn widen16(values: int8x16_t) -> [float32x4_t; 4] {
    // Safety: register operations; NEON is part of the aarch64 target.
    unsafe {
        let wide = [vmovl_s8(vget_low_s8(values)), vmovl_high_s8(values)];
        let quad = |w: int16x8_t, high: bool| {
            vcvtq_f32_s32(if high {
                vmovl_high_s16(w)
            } else {
                vmovl_s16(vget_low_s16(w))
            })
        };
        [
            quad(wide[0], false),
            quad(wide[0], true),
            quad(wide[1], false),
            quad(wide[1], true),
        ]
    }
}

/// Group `g`'s 32 weights (before scaling) as 8 vectors of 4, in the order the format reads its
/// inputs: a 4-bit group's 16 low nibbles (even inputs) then its 16 high ones, through the
/// table of small integers; a q8 group's bytes as they are.
///
/// # Safety
/// The group's bytes lie in the row.
#[inline(always)]
unsafe fn group_weights(row: GroupRow, g: usize) -> [float32x4_t; 8] {
    let at = row.format.bytes_per_group() * g;
    // Safety: the caller's guarantee covers the loads; NEON is part of the aarch64 target.
    let halves = unsafe {
        match row.format {
            GroupFormat::Q8 => [
                vld1q_s8(row.bytes.as_ptr().add(at).cast()),
                vld1q_s8(row.bytes.as_ptr().add(at + 16).cast()),
            ],
            _ => {
                let bytes = vld1q_u8(row.bytes.as_ptr().add(at));
                [
                    vqtbl1q_s8(row.small_integers, vandq_u8(bytes, vdupq_n_u8(0x0F))),
                    vqtbl1q_s8(row.small_integers, vshrq_n_u8::<4>(bytes)),
                ]
            }
        }
    };
    let [a, b] = halves.map(widen16);
    [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
}

/// Adds groups `groups` of a row times `T` inputs to `totals`: per input, a group's 32 products
/// summed into two running sums (vector i into sum i % 2), the two added and scaled into the
/// total. The group's weights are decoded once for all inputs, and each total sees the same
/// operations however many inputs and groups a call takes.
#[inline(always)]
fn row_groups<const T: usize>(
    row: GroupRow,
    xs: [&[f32]; T],
    groups: std::ops::Range<usize>,
    totals: &mut [float32x4_t; T],
) {
    assert!(
        groups.end <= row.groups() && xs.iter().all(|x| x.len() == 32 * row.groups()),
        "each input holds 32 values per group of the row"
    );
    let mut acc = *totals;
    for g in groups {
        // Safety: group g exists and its 32 inputs are in bounds (asserted above); NEON is part
        // of the aarch64 target.
        unsafe {
            let w = group_weights(row, g);
            let scale = group_scale(row.format, row.scales, g);
            for (total, x) in acc.iter_mut().zip(&xs) {
                let x = x.as_ptr().add(32 * g);
                let mut sums = [vdupq_n_f32(0.0); 2];
                for (i, w) in w.iter().enumerate() {
                    sums[i % 2] = vfmaq_f32(sums[i % 2], *w, vld1q_f32(x.add(4 * i)));
                }
                *total = vfmaq_n_f32(*total, vaddq_f32(sums[0], sums[1]), scale);
            }
        }
    }
    *totals = acc;
}

/// One row times `T` inputs.
#[inline(always)]
fn row_dots<const T: usize>(row: GroupRow, xs: [&[f32]; T]) -> [f32; T] {
    // Safety: NEON is part of the aarch64 target.
    let mut totals = [unsafe { vdupq_n_f32(0.0) }; T];
    row_groups(row, xs, 0..row.groups(), &mut totals);
    // Safety: as above.
    totals.map(|t| unsafe { vaddvq_f32(t) })
}

/// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, block of groups by block of groups:
/// `out[r * stride + t]`. Bit-identical to `row_dots`.
#[inline(always)]
fn tile_dots<const T: usize>(
    rows: &[GroupRow],
    xs: [&[f32]; T],
    (out, stride): (&mut [f32], usize),
) {
    assert!(rows.len() <= TILE_ROWS);
    // Safety: NEON is part of the aarch64 target.
    let mut totals = [[unsafe { vdupq_n_f32(0.0) }; T]; TILE_ROWS];
    let groups = rows.first().map_or(0, GroupRow::groups);
    for block in super::blocks(groups, TILE_GROUPS) {
        for (row, totals) in rows.iter().zip(totals.iter_mut()) {
            row_groups(*row, xs, block.clone(), totals);
        }
    }
    for (r, totals) in totals.iter().take(rows.len()).enumerate() {
        // Safety: as above.
        let dots = totals.map(|t| unsafe { vaddvq_f32(t) });
        out[r * stride..r * stride + T].copy_from_slice(&dots);
    }
}

/// `row . x` for a row of `format` (bytes and scale bytes).
pub(super) fn dot_row(format: GroupFormat, bytes: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    row_dots(GroupRow::new(format, (bytes, scales)), [x])[0]
}

/// `out[t] = row . xs[t]`, four inputs at a time.
pub(super) fn dot_row_each(
    format: GroupFormat,
    bytes: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let row = GroupRow::new(format, (bytes, scales));
    in_blocks_of_four!(xs, out, |block| row_dots(row, block));
}

/// Rows (bytes, scale bytes; at most `TILE_ROWS`, all as long) of `format` times every input:
/// `out[r * xs.len() + t]`, eight inputs at a time (eight decoded weight vectors, eight totals
/// and one input's two sums in registers; as the AVX2 tile, where eight measured faster than
/// four).
pub(super) fn rows_tile(
    format: GroupFormat,
    rows: &[(&[u8], &[u8])],
    xs: &[&[f32]],
    out: &mut [f32],
) {
    assert!(rows.len() <= TILE_ROWS);
    let mut tile = [GroupRow::new(format, (&[], &[])); TILE_ROWS];
    for (slot, &row) in tile.iter_mut().zip(rows) {
        *slot = GroupRow::new(format, row);
    }
    let rows = &tile[..rows.len()];
    assert!(rows.iter().all(|r| r.groups() == rows[0].groups()));
    let stride = xs.len();
    for_blocks_of_eight!(xs, |block, t| tile_dots(
        rows,
        block,
        (&mut out[t..], stride)
    ));
}
