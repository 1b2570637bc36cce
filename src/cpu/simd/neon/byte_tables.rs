//! MXFP4 rows on NEON through byte tables, each group's scale folded into its weights' bf16
//! bytes (as AVX2's `x86::byte_tables`; see `folding`).
//!
//! Per scale byte, one 16-byte table holds the low bytes of the 16 scaled values' bf16 and one
//! the high bytes. A group's low nibbles (its even weights) and its high nibbles (its odd ones)
//! each go through both tables (`tbl`), two zips pair each weight's bytes into a 16-bit word,
//! and four widening shifts (`shll`) make floats of the words. Per group of 32 weights: 2 to
//! pick the nibbles, 4 lookups, 4 zips and 8 widenings (18 operations), against 24 (2 to pick
//! the nibbles, 2 lookups of small integers, 20 widenings and conversions) in the per-group
//! kernel (`GroupFormat::Mxfp4` in `neon`), which also adds and scales each group's sum for
//! each input. Inputs are read in `InputOrder::GroupHalves`, as the per-group kernel reads them.
//!
//! Two running sums per row and input (a group's even vectors into the first, its odd ones into
//! the second): decode takes four rows at a time (two of each run, eight sums in flight),
//! prefill's tiles eight inputs per decoded group (sixteen sums, eight weight vectors and the
//! tables in the 32 registers). Rows with a scale of 253 or more decode the unscaled values and
//! scale each group's sum instead.
//!
//! Not timed on an ARM CPU (CI runs this under qemu for its values): the case for it is the
//! count of operations per group above.

use std::arch::aarch64::*;
use std::sync::OnceLock;

use super::super::folding::{Row, UNSCALED, rows_side_by_side, scaled_bf16_bytes};
use super::super::{TILE_GROUPS, TILE_ROWS};
use crate::formats::e8m0_scale;

/// The low bytes and the high bytes of a scale's 16 scaled values (`scaled_bf16_bytes`), next
/// to each other.
#[repr(C, align(32))]
struct ScaleTables([[u8; 16]; 2]);

fn byte_tables() -> &'static [ScaleTables; 256] {
    static TABLES: OnceLock<Box<[ScaleTables; 256]>> = OnceLock::new();
    TABLES.get_or_init(|| {
        Box::new(std::array::from_fn(|s| {
            ScaleTables(scaled_bf16_bytes(s as u8))
        }))
    })
}

/// Two running sums of one row and input.
type Sums = [float32x4_t; 2];

/// Group `g`'s 32 weights as 8 vectors of floats, scaled where the row folds (else unscaled):
/// its 16 even weights in order, then its 16 odd ones (`InputOrder::GroupHalves`).
///
/// # Safety
/// Group g exists (`g < row.groups()`: `Row` holds 16 bytes per scale byte).
#[inline(always)]
unsafe fn group_weights(row: Row, g: usize, tables: &[ScaleTables; 256]) -> [float32x4_t; 8] {
    let scale = if row.folds() {
        row.scales()[g]
    } else {
        UNSCALED
    };
    let [low, high] = &tables[scale as usize].0;
    // Safety: the group's 16 bytes exist (the caller's guarantee); each table holds 16 bytes.
    // The rest are register operations (NEON is part of the aarch64 target).
    unsafe {
        let bytes = vld1q_u8(row.packed().as_ptr().add(16 * g));
        let (low, high) = (vld1q_u8(low.as_ptr()), vld1q_u8(high.as_ptr()));
        // The bf16 of each code, widened: word m of `first` is code m's, of `second` code 8 + m's.
        let floats = |codes: uint8x16_t| {
            let (low_bytes, high_bytes) = (vqtbl1q_u8(low, codes), vqtbl1q_u8(high, codes));
            let first = vreinterpretq_u16_u8(vzip1q_u8(low_bytes, high_bytes));
            let second = vreinterpretq_u16_u8(vzip2q_u8(low_bytes, high_bytes));
            [
                vshll_n_u16::<16>(vget_low_u16(first)),
                vshll_high_n_u16::<16>(first),
                vshll_n_u16::<16>(vget_low_u16(second)),
                vshll_high_n_u16::<16>(second),
            ]
            .map(|bits| vreinterpretq_f32_u32(bits))
        };
        let [e0, e1, e2, e3] = floats(vandq_u8(bytes, vdupq_n_u8(0x0f)));
        let [o0, o1, o2, o3] = floats(vshrq_n_u8::<4>(bytes));
        [e0, e1, e2, e3, o0, o1, o2, o3]
    }
}

/// Adds group `g` of a row times each of `T` inputs to that input's sums: each product
/// straight into them where the row folds, else the group's products summed and scaled.
///
/// # Safety
/// Group g exists; every input holds `32 * row.groups()` values.
#[inline(always)]
unsafe fn add_group<const T: usize>(
    row: Row,
    g: usize,
    xs: [&[f32]; T],
    tables: &[ScaleTables; 256],
    sums: &mut [Sums; T],
) {
    if row.folds() {
        // Safety: the caller's guarantees.
        unsafe { add_folding_group(row, g, xs, tables, sums) };
        return;
    }
    // Safety: the caller's guarantees.
    let w = unsafe { group_weights(row, g, tables) };
    let scale = e8m0_scale(row.scales()[g]);
    for (sums, x) in sums.iter_mut().zip(xs) {
        // Safety (each): the group's 32 inputs are in bounds (the caller's guarantee).
        let input = |v: usize| unsafe { vld1q_f32(x.as_ptr().add(32 * g + 4 * v)) };
        // Safety: register operations.
        unsafe {
            let mut group = [vmulq_f32(w[0], input(0)), vmulq_f32(w[1], input(1))];
            for (v, w) in w.iter().enumerate().skip(2) {
                group[v % 2] = vfmaq_f32(group[v % 2], *w, input(v));
            }
            sums[0] = vfmaq_n_f32(sums[0], vaddq_f32(group[0], group[1]), scale);
        }
    }
}

/// `add_group` of a row that folds: each product straight into the sums.
///
/// # Safety
/// As `add_group`. (The row must fold for the result to be the row's: weights are read from its
/// scales' tables.)
#[inline(always)]
unsafe fn add_folding_group<const T: usize>(
    row: Row,
    g: usize,
    xs: [&[f32]; T],
    tables: &[ScaleTables; 256],
    sums: &mut [Sums; T],
) {
    // Safety: the caller's guarantees.
    let w = unsafe { group_weights(row, g, tables) };
    for (sums, x) in sums.iter_mut().zip(xs) {
        for (v, w) in w.iter().enumerate() {
            // Safety: the group's 32 inputs are in bounds (the caller's guarantee); the rest
            // are register operations.
            unsafe {
                let input = vld1q_f32(x.as_ptr().add(32 * g + 4 * v));
                sums[v % 2] = vfmaq_f32(sums[v % 2], *w, input);
            }
        }
    }
}

/// Adds groups `groups` of a row times `T` inputs to their sums.
#[inline(always)]
fn add_groups<const T: usize>(
    row: Row,
    xs: [&[f32]; T],
    groups: std::ops::Range<usize>,
    sums: &mut [Sums; T],
) {
    assert!(
        groups.end <= row.groups() && xs.iter().all(|x| x.len() == 32 * row.groups()),
        "each input holds 32 values per group of the row"
    );
    let tables = byte_tables();
    let mut acc = *sums;
    for g in groups {
        // Safety: group g exists and its inputs are in bounds (asserted above).
        unsafe { add_group(row, g, xs, tables, &mut acc) };
    }
    *sums = acc;
}

/// Each input's sums added up: its dot product with the row.
#[inline(always)]
fn reduce<const T: usize>(sums: &[Sums; T]) -> [f32; T] {
    // Safety: register operations.
    sums.map(|[even, odd]| unsafe { vaddvq_f32(vaddq_f32(even, odd)) })
}

fn zero_sums<const T: usize>() -> [Sums; T] {
    // Safety: a register operation.
    [[unsafe { vdupq_n_f32(0.0) }; 2]; T]
}

/// One row times `T` inputs.
#[inline(always)]
fn row_dots<const T: usize>(row: Row, xs: [&[f32]; T]) -> [f32; T] {
    let mut sums = zero_sums();
    add_groups(row, xs, 0..row.groups(), &mut sums);
    reduce(&sums)
}

/// `N` rows times one input, each bit-identical to `row_dots`: group by group, every row in
/// turn, so that `2 N` running sums are in flight and the group's inputs are loaded once for all.
/// Where all rows fold, without a branch per row and group.
#[inline(always)]
fn rows_dots<const N: usize>(rows: [Row; N], x: &[f32]) -> [f32; N] {
    let groups = rows[0].groups();
    assert!(
        rows.iter().all(|r| r.groups() == groups) && x.len() == 32 * groups,
        "rows as long as the input"
    );
    let tables = byte_tables();
    let mut sums: [Sums; N] = zero_sums();
    if rows.iter().all(|r| r.folds()) {
        for g in 0..groups {
            for (sums, row) in sums.iter_mut().zip(rows) {
                // Safety: group g exists in every row, which folds; its inputs are in bounds
                // (asserted above).
                unsafe { add_folding_group(row, g, [x], tables, std::array::from_mut(sums)) };
            }
        }
    } else {
        for g in 0..groups {
            for (sums, row) in sums.iter_mut().zip(rows) {
                // Safety: group g exists in every row; its inputs are in bounds (asserted above).
                unsafe { add_group(row, g, [x], tables, std::array::from_mut(sums)) };
            }
        }
    }
    sums.map(|sums| reduce(&[sums])[0])
}

/// `row . x`: `scales` holds one E8M0 byte per 16 bytes of `blocks` and `x` 32 inputs per group
/// in `InputOrder::GroupHalves`.
pub fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    row_dots(Row::new(blocks, scales), [x])[0]
}

/// One row times every input, eight at a time.
pub fn dot_mxfp4_each(blocks: &[u8], scales: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    let row = Row::new(blocks, scales);
    in_blocks!(for_blocks_of_eight, xs, out, |block| row_dots(row, block));
}

/// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, block of groups by block of groups:
/// `out[r * stride + t]`. Bit-identical to `row_dots`.
#[inline(always)]
fn tile_dots<const T: usize>(rows: &[Row], xs: [&[f32]; T], (out, stride): (&mut [f32], usize)) {
    assert!(rows.len() <= TILE_ROWS);
    let mut sums = [zero_sums::<T>(); TILE_ROWS];
    let groups = rows.first().map_or(0, Row::groups);
    for block in super::super::blocks(groups, TILE_GROUPS) {
        for (row, sums) in rows.iter().zip(sums.iter_mut()) {
            add_groups(*row, xs, block.clone(), sums);
        }
    }
    for (r, sums) in sums.iter().take(rows.len()).enumerate() {
        out[r * stride..r * stride + T].copy_from_slice(&reduce(sums));
    }
}

/// Rows (packed bytes, scale bytes; at most `TILE_ROWS`, all as long) times every input:
/// `out[r * xs.len() + t]`, eight inputs at a time.
pub fn mxfp4_tile(rows: &[(&[u8], &[u8])], xs: &[&[f32]], out: &mut [f32]) {
    assert!(rows.len() <= TILE_ROWS);
    let mut tile = [Row::folding_where(&[], &[], true); TILE_ROWS];
    for (slot, &(blocks, scales)) in tile.iter_mut().zip(rows) {
        *slot = Row::new(blocks, scales);
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

/// Two runs of consecutive rows times one input: `outs[k][i] = row i of run k . x`,
/// bit-identical to `dot_mxfp4`. Decode's form: rows i and i + 1 of both runs side by side.
pub fn dot_mxfp4_rows(runs: [(&[u8], &[u8]); 2], x: &[f32], outs: [&mut [f32]; 2]) {
    rows_side_by_side::<4>(
        runs,
        x,
        outs,
        |rows| rows_dots(rows, x),
        |rows| rows_dots(rows, x),
        |row| row_dots(row, [x])[0],
    );
}

#[cfg(test)]
mod tests {
    use super::super::super::folding::FIRST_UNFOLDABLE_SCALE;
    use super::*;
    use crate::formats::FP4_VALUES;

    #[test]
    fn every_folding_scales_tables_hold_its_scaled_values_exactly() {
        let tables = byte_tables();
        for s in 0..FIRST_UNFOLDABLE_SCALE {
            let [low, high] = &tables[s as usize].0;
            for code in 0..16 {
                let word = u16::from_le_bytes([low[code], high[code]]);
                let widened = f32::from_bits(u32::from(word) << 16);
                let exact = FP4_VALUES[code] * e8m0_scale(s);
                assert_eq!(
                    widened.to_bits(),
                    exact.to_bits(),
                    "scale byte {s}, code {code}"
                );
            }
        }
    }
}
