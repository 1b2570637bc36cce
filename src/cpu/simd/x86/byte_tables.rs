//! MXFP4 rows on AVX2 through byte tables, each group's scale folded into its weights' bf16
//! bytes.
//!
//! A scaled FP4 value is exact in bf16 (at most two significant bits), so one table of 16 low
//! bytes and one of 16 high bytes per scale byte turn a nibble into its scaled weight's bf16 with
//! two byte shuffles, and a row's products add up in one running sum per input with no
//! per-group multiply. A group's 16 bytes fill both 128-bit lanes; one variable shift and a
//! mask leave the low nibbles in the low lane and the high nibbles in the high one. Per group
//! of 32 weights: 2 byte shuffles through the tables, 2 byte unpacks that pair each weight's
//! bytes into a 16-bit word, 4 shifts or masks that widen the words to floats and 2 to pick the
//! nibbles (10 operations, none across lanes), against 4 sign extensions across lanes, 4
//! conversions and 4 other shuffles when each group's integers are converted and its sum scaled
//! (`GroupFormat::Mxfp4`).
//!
//! One running sum per row and input: decode takes four rows at a time (rows i and i + 1 of two
//! streams, four sums in flight, each multiply-add waiting on the same row's one before; with the
//! group's inputs and the sums in registers where all four fold, as in any checkpoint seen so
//! far: `four_folding_rows`). Prefill's tiles of four inputs or more decode two or three rows'
//! groups into a panel in L1 and multiply it by four inputs at a time (twelve sums in registers,
//! `panel_tile`); of one to three inputs, two rows at a time, each group decoded into registers
//! for all inputs (`few_inputs_tile`); tiles with a row that does not fold take eight inputs per
//! decoded group. The weights come out in an order of their own: inputs are read as
//! `InputOrder::GroupLanes` arranges them. Rows with a scale of 253 or more (where a scaled
//! weight would overflow while the scaled sum might not) decode the unscaled values and scale
//! each group's sum instead.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::super::folding::{Row, UNSCALED, rows_side_by_side, scaled_bf16};
use super::super::{TILE_GROUPS, TILE_ROWS, evenly, filled};
use super::prefetch_ahead;
use crate::formats::e8m0_scale;

/// A 16-byte table in both lanes of a 256-bit register, aligned for one load.
#[repr(C, align(32))]
struct LaneTable([u8; 32]);

/// The low bytes and the high bytes of the bf16 of `FP4_VALUES * e8m0_scale(s)`, per scale
/// byte `s`.
struct ByteTables {
    low: [LaneTable; 256],
    high: [LaneTable; 256],
}

fn byte_tables() -> &'static ByteTables {
    static TABLES: OnceLock<Box<ByteTables>> = OnceLock::new();
    TABLES.get_or_init(|| {
        let byte = |s: usize, i: usize, k: usize| scaled_bf16(s as u8, i % 16).to_le_bytes()[k];
        Box::new(ByteTables {
            low: std::array::from_fn(|s| LaneTable(std::array::from_fn(|i| byte(s, i, 0)))),
            high: std::array::from_fn(|s| LaneTable(std::array::from_fn(|i| byte(s, i, 1)))),
        })
    })
}

/// Group `g`'s 32 weights as 4 vectors of floats, scaled where the row folds (else unscaled):
/// vector v holds, in lane `l`, the weight `GroupLanes` pairs with input
/// `group_lane_input(v, l)`. The row's bytes ahead are prefetched at each cache line's first
/// group.
///
/// # Safety
/// AVX2; group g exists (`g < row.groups()`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group_weights(row: Row, g: usize, tables: &ByteTables) -> [__m256; 4] {
    let at = 16 * g;
    if at.is_multiple_of(64) {
        prefetch_ahead(row.packed().as_ptr().wrapping_add(at), 64);
    }
    // Safety: the caller's guarantees.
    let words = unsafe { group_words(row, g, tables) };
    widen(words, upper_words())
}

/// 0xffff0000 in every 32-bit lane, through `opaque`: knowing the constant, the compiler turns
/// the mask into a blend with zeros, which takes the shuffle port on Intel client cores (as the
/// table lookups and unpacks do).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn upper_words() -> __m256i {
    opaque(_mm256_set1_epi32(0xffff_0000_u32 as i32))
}

/// Group `g`'s 32 weights as bf16 words, scaled where the row folds (else unscaled): word m of
/// each 128-bit lane of the first vector is the weight of code m of the lane's half (low
/// nibbles in the low lane, high nibbles in the high one), of the second code 8 + m.
///
/// # Safety
/// AVX2; group g exists (`g < row.groups()`).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn group_words(row: Row, g: usize, tables: &ByteTables) -> [__m256i; 2] {
    let scale = if row.folds() {
        row.scales()[g]
    } else {
        UNSCALED
    };
    let (low, high) = (&tables.low[scale as usize], &tables.high[scale as usize]);
    // Safety: the group's 16 bytes exist (the caller's guarantee); each table holds 32 bytes,
    // aligned to 32.
    unsafe {
        let bytes =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(row.packed().as_ptr().add(16 * g).cast()));
        // Byte k of the low lane: the low nibble of byte k (weight 2k); of the high lane: the
        // high nibble (weight 2k + 1).
        let codes = _mm256_and_si256(
            _mm256_srlv_epi32(bytes, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
            _mm256_set1_epi8(0x0f),
        );
        let low_bytes = _mm256_shuffle_epi8(_mm256_load_si256(low.0.as_ptr().cast()), codes);
        let high_bytes = _mm256_shuffle_epi8(_mm256_load_si256(high.0.as_ptr().cast()), codes);
        [
            _mm256_unpacklo_epi8(low_bytes, high_bytes),
            _mm256_unpackhi_epi8(low_bytes, high_bytes),
        ]
    }
}

/// A group's bf16 words (`group_words`) as its 4 vectors of floats: each 32-bit word's lower
/// word shifted up, its upper word masked in place (`upper` is 0xffff0000 in every lane).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen([first, second]: [__m256i; 2], upper: __m256i) -> [__m256; 4] {
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(first)),
        _mm256_castsi256_ps(_mm256_and_si256(first, upper)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(second)),
        _mm256_castsi256_ps(_mm256_and_si256(second, upper)),
    ]
}

/// Adds group `g` of a row times each of `T` inputs to that input's running sum: each product
/// straight into the sum where the row folds, else the group's products summed and scaled.
///
/// # Safety
/// AVX2 and FMA; group g exists; every input holds `32 * row.groups()` values in
/// `InputOrder::GroupLanes`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_group<const T: usize>(
    row: Row,
    g: usize,
    xs: [&[f32]; T],
    tables: &ByteTables,
    sums: &mut [__m256; T],
) {
    if row.folds() {
        // Safety: the caller's guarantees.
        unsafe { add_folding_group(row, g, xs, tables, sums) };
    } else {
        // Safety: the caller's guarantees.
        let w = unsafe { group_weights(row, g, tables) };
        let scale = _mm256_set1_ps(e8m0_scale(row.scales()[g]));
        for (sum, x) in sums.iter_mut().zip(xs) {
            // Safety (each): as above.
            let input = |v: usize| unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * g + 8 * v)) };
            let mut group = _mm256_mul_ps(w[0], input(0));
            for (v, w) in w.iter().enumerate().skip(1) {
                group = _mm256_fmadd_ps(*w, input(v), group);
            }
            *sum = _mm256_fmadd_ps(group, scale, *sum);
        }
    }
}

/// `add_group` of a row that folds: each product straight into the sum.
///
/// # Safety
/// As `add_group`. (The row must fold for the result to be the row's: weights are read from its
/// scales' tables.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_folding_group<const T: usize>(
    row: Row,
    g: usize,
    xs: [&[f32]; T],
    tables: &ByteTables,
    sums: &mut [__m256; T],
) {
    // Safety: the caller's guarantees.
    let w = unsafe { group_weights(row, g, tables) };
    for (sum, x) in sums.iter_mut().zip(xs) {
        for (v, w) in w.iter().enumerate() {
            // Safety: the group's 32 inputs are in bounds (the caller's guarantee).
            let input = unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * g + 8 * v)) };
            *sum = _mm256_fmadd_ps(*w, input, *sum);
        }
    }
}

/// Adds groups `groups` of a row times `T` inputs to their running sums.
///
/// # Safety
/// As `add_group`, for every group of `groups`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_groups<const T: usize>(
    row: Row,
    xs: [&[f32]; T],
    groups: std::ops::Range<usize>,
    sums: &mut [__m256; T],
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

/// One row times `T` inputs.
///
/// # Safety
/// As `add_groups`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row_dots<const T: usize>(row: Row, xs: [&[f32]; T]) -> [f32; T] {
    let mut sums = [_mm256_setzero_ps(); T];
    // Safety: the caller's guarantees.
    unsafe { add_groups(row, xs, 0..row.groups(), &mut sums) };
    super::sums8(&sums)
}

/// `N` rows times one input, each bit-identical to `row_dots`: group by group, every row in
/// turn, so that `N` running sums are in flight.
///
/// # Safety
/// As `add_groups`, for every row; all rows as long.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn rows_dots<const N: usize>(rows: [Row; N], x: &[f32]) -> [f32; N] {
    let groups = rows[0].groups();
    assert!(rows.iter().all(|r| r.groups() == groups) && x.len() == 32 * groups);
    let tables = byte_tables();
    let mut sums = [_mm256_setzero_ps(); N];
    for g in 0..groups {
        for (sum, row) in sums.iter_mut().zip(rows) {
            // Safety: group g exists in every row; its inputs are in bounds (asserted above).
            unsafe { add_group(row, g, [x], tables, std::array::from_mut(sum)) };
        }
    }
    super::sums8(&sums)
}

/// `rows_dots` of four rows that all fold: per group, its inputs loaded into registers once and
/// each row decoded and multiplied into its one running sum in turn, the four sums in registers.
///
/// Written so that the compiler keeps the sums and inputs in the sixteen registers: eight rows
/// at a time (or four, each row's group through `add_folding_group`), it loaded every row's
/// tables at the top of each group, kept half the sums on the stack and reloaded rows' pointers
/// from it: work on top of the chains through the running sums, which bound this loop where
/// decode is compute-bound.
///
/// # Safety
/// As `rows_dots`; every row folds.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn four_folding_rows(rows: [Row; 4], x: &[f32]) -> [f32; 4] {
    let groups = rows[0].groups();
    assert!(
        rows.iter().all(|r| r.groups() == groups && r.folds()) && x.len() == 32 * groups,
        "four folding rows as long as the input"
    );
    let tables = byte_tables();
    let upper = upper_words();
    let mut sums = [_mm256_setzero_ps(); 4];
    for block in super::super::blocks(groups, 4) {
        for row in rows {
            prefetch_ahead(row.packed().as_ptr().wrapping_add(16 * block.start), 64);
        }
        for g in block {
            // Safety: group g's inputs are in bounds (asserted above).
            let x =
                [0, 1, 2, 3].map(|v| unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * g + 8 * v)) });
            let mut previous = sums[3];
            for (sum, row) in sums.iter_mut().zip(rows) {
                // Each row's tables read after the row before has its sum, as far as the
                // compiler knows: left free, it loaded all of them first (and ordered after the
                // row before's weights instead, it decoded all four rows first), either way
                // spilling sums to the stack.
                let tables = ordered_after(tables, previous);
                // Safety: group g exists in the row, which folds (asserted above).
                let w = widen(unsafe { group_words(row, g, tables) }, upper);
                for (w, x) in w.iter().zip(&x) {
                    *sum = _mm256_fmadd_ps(*w, *x, *sum);
                }
                previous = *sum;
            }
        }
    }
    super::sums8(&sums)
}

/// `value`, which the compiler can no longer see is a constant.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn opaque(mut value: __m256i) -> __m256i {
    // Safety: an empty instruction sequence; `value` comes back unchanged.
    unsafe {
        std::arch::asm!(
            "/* {0} */",
            inout(ymm_reg) value,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    value
}

/// `tables`, which the compiler takes to depend on `sum`: loads through it are not scheduled
/// before `sum` is computed. (The processor sees no dependency: no instruction is emitted.)
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn ordered_after(tables: &ByteTables, sum: __m256) -> &ByteTables {
    let pointer: *const ByteTables = tables;
    let mut address = pointer.addr();
    // Safety: an empty instruction sequence; `address` comes back unchanged.
    unsafe {
        std::arch::asm!(
            "/* {0} {1} */",
            inout(reg) address,
            in(ymm_reg) sum,
            options(pure, nomem, nostack, preserves_flags)
        )
    };
    // Safety: `address` is `tables`' own, unchanged.
    unsafe { &*pointer.with_addr(address) }
}

/// # Safety
/// AVX2, FMA and F16C; `scales` holds one E8M0 byte per 16 bytes of `blocks` and `x` 32 inputs
/// per group in `InputOrder::GroupLanes`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    // Safety: the caller's guarantees.
    unsafe { row_dots(Row::new(blocks, scales), [x])[0] }
}

/// One row times every input, eight at a time.
///
/// # Safety
/// As `dot_mxfp4`, for every input.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_mxfp4_each(blocks: &[u8], scales: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    let row = Row::new(blocks, scales);
    // Safety: the caller's guarantees.
    in_blocks!(for_blocks_of_eight, xs, out, |block| unsafe {
        row_dots(row, block)
    });
}

/// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, block of groups by block of groups:
/// `out[r * stride + t]`. Bit-identical to `row_dots`.
///
/// # Safety
/// As `add_groups`, for every row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn tile_dots<const T: usize>(
    rows: &[Row],
    xs: [&[f32]; T],
    (out, stride): (&mut [f32], usize),
) {
    assert!(rows.len() <= TILE_ROWS);
    let mut sums = [[_mm256_setzero_ps(); T]; TILE_ROWS];
    let groups = rows.first().map_or(0, Row::groups);
    for block in super::super::blocks(groups, TILE_GROUPS) {
        for (row, sums) in rows.iter().zip(sums.iter_mut()) {
            // Safety: the caller's guarantees.
            unsafe { add_groups(*row, xs, block.clone(), sums) };
        }
    }
    for (r, sums) in sums.iter().take(rows.len()).enumerate() {
        out[r * stride..r * stride + T].copy_from_slice(&super::sums8(sums));
    }
}

/// Rows (packed bytes, scale bytes; at most `TILE_ROWS`, all as long) times every input:
/// `out[r * xs.len() + t]`. Where every row folds, through decoded panels (`panel_tile`); else
/// eight inputs at a time per row (eight sums and a group's four weight vectors in the sixteen
/// registers). Bit-identical to `dot_mxfp4` either way.
///
/// # Safety
/// As `dot_mxfp4`, for every row and input.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn mxfp4_tile(rows: &[(&[u8], &[u8])], xs: &[&[f32]], out: &mut [f32]) {
    assert!(rows.len() <= TILE_ROWS);
    let mut tile = [Row::folding_where(&[], &[], true); TILE_ROWS];
    for (slot, &(blocks, scales)) in tile.iter_mut().zip(rows) {
        *slot = Row::new(blocks, scales);
    }
    let rows = &tile[..rows.len()];
    assert!(rows.iter().all(|r| r.groups() == rows[0].groups()));
    assert!(
        xs.iter()
            .all(|x| x.len() == 32 * rows.first().map_or(0, Row::groups)),
        "each input holds 32 values per group of the rows"
    );
    let stride = xs.len();
    if rows.iter().all(Row::folds) {
        if xs.len() <= FEW_INPUTS {
            // Safety: the caller's guarantees; every row folds (checked above).
            unsafe { few_inputs_tile(rows, xs, out) };
        } else {
            // Safety: as above.
            unsafe { panel_tile(rows, xs, out) };
        }
        return;
    }
    // Safety: the caller's guarantees.
    for_blocks_of_eight!(xs, |block, t| unsafe {
        tile_dots(rows, block, (&mut out[t..], stride))
    });
}

/// Inputs up to which a tile of rows that all fold goes two rows at a time, each row's group
/// decoded into registers once for all inputs, with no panel (`few_inputs_tile`): a panel's
/// decoded groups are stored and read back, worth it only for more inputs.
const FEW_INPUTS: usize = 3;

/// Rows that all fold (at most `TILE_ROWS`) times up to `FEW_INPUTS` inputs, `out[r *
/// xs.len() + t]`: two rows at a time through `row_pair_times_inputs` (a row left over alone).
/// Bit-identical to `dot_mxfp4`.
///
/// # Safety
/// As `panel_tile`, with at most `FEW_INPUTS` inputs.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn few_inputs_tile(rows: &[Row], xs: &[&[f32]], out: &mut [f32]) {
    let stride = xs.len();
    for pair in super::super::blocks(rows.len(), 2) {
        // Safety (each): the caller's guarantees; the rows fold.
        macro_rules! times {
            ($xs:expr) => {
                if pair.len() == 2 {
                    unsafe { row_pair_times_inputs([rows[pair.start], rows[pair.start + 1]], $xs) }
                } else {
                    unsafe { row_pair_times_inputs([rows[pair.start]], $xs) }
                }
            };
        }
        let dots = match *xs {
            [x] => times!([x]),
            [x, y] => times!([x, y]),
            [x, y, z] => times!([x, y, z]),
            _ => unreachable!("up to FEW_INPUTS inputs"),
        };
        for (r, dots) in pair.zip(dots) {
            out[r * stride..][..stride].copy_from_slice(&dots[..stride]);
        }
    }
}

/// `R` rows (one or two, that fold) times `T` inputs (up to `FEW_INPUTS`), `[row][input]`
/// padded with zeros: per group, each row decoded into registers once and multiplied into its
/// `T` sums. Bit-identical to `row_dots` for every row and input.
///
/// # Safety
/// As `add_groups`, for every row; every row folds.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn row_pair_times_inputs<const R: usize, const T: usize>(
    rows: [Row; R],
    xs: [&[f32]; T],
) -> [[f32; FEW_INPUTS]; 2] {
    let groups = rows[0].groups();
    assert!(
        rows.iter().all(|r| r.groups() == groups && r.folds())
            && xs.iter().all(|x| x.len() == 32 * groups),
        "folding rows as long as the inputs"
    );
    let tables = byte_tables();
    let upper = upper_words();
    let mut sums = [[_mm256_setzero_ps(); T]; R];
    for block in super::super::blocks(groups, 4) {
        for row in rows {
            prefetch_ahead(row.packed().as_ptr().wrapping_add(16 * block.start), 64);
        }
        for g in block {
            for (sums, row) in sums.iter_mut().zip(rows) {
                // Safety: group g exists in the row, which folds (asserted above).
                let w = widen(unsafe { group_words(row, g, tables) }, upper);
                for (v, w) in w.iter().enumerate() {
                    for (sum, x) in sums.iter_mut().zip(xs) {
                        // Safety: the group's inputs are in bounds (asserted above).
                        let input = unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * g + 8 * v)) };
                        *sum = _mm256_fmadd_ps(*w, input, *sum);
                    }
                }
            }
        }
    }
    let mut dots = [[0f32; FEW_INPUTS]; 2];
    for (dots, sums) in dots.iter_mut().zip(&sums) {
        dots[..T].copy_from_slice(&super::sums8(sums));
    }
    dots
}

/// Rows a decoded panel holds, groups of each, and inputs whose sums one pass over a panel keeps
/// in registers: three rows times four inputs, twelve sums. One sum per row and input, as in
/// decode, and each weight vector of the panel read once per four inputs: where the weights are
/// decoded in the loop that multiplies them (`tile_dots`), a group's four vectors and eight
/// inputs' sums fill the registers, and each sum's chain of four multiply-adds per group leaves
/// the FMA units waiting.
const PANEL_ROWS: usize = 3;
const PANEL_GROUPS: usize = 16;
const PANEL_INPUTS: usize = 4;
/// Inputs whose sums stay in one stack array (3 KiB) while a panel's rows are decoded block by
/// block: each row's groups are decoded once per this many inputs, so that decoding stays a small
/// share of a large tile.
const PANEL_CHUNK: usize = 32;

/// Scaled weights of `PANEL_ROWS` rows, `PANEL_GROUPS` groups each, as `group_weights` gives them.
struct Panel([[[__m256; 4]; PANEL_GROUPS]; PANEL_ROWS]);

/// Rows that all fold (at most `TILE_ROWS`) times every input, `out[r * xs.len() + t]`: for
/// each panel of up to `PANEL_ROWS` rows and `PANEL_CHUNK` inputs, block by block of
/// `PANEL_GROUPS` groups, the rows' groups are decoded once into a panel (6 KiB, in L1) and
/// multiplied by the inputs four at a time. Every sum sees the products of `add_folding_group`
/// in the same order.
///
/// # Safety
/// AVX2, FMA and F16C; every row folds, all rows are as long, and every input holds 32 values
/// per group in `InputOrder::GroupLanes`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_tile(rows: &[Row], xs: &[&[f32]], out: &mut [f32]) {
    let tables = byte_tables();
    let groups = rows.first().map_or(0, Row::groups);
    let stride = xs.len();
    let mut panel = Panel([[[_mm256_setzero_ps(); 4]; PANEL_GROUPS]; PANEL_ROWS]);
    // Panels of two or three rows (16 rows: 3, 3, 3, 3, 2, 2): a pass over a one-row panel
    // keeps only four sums in flight, each multiply-add waiting on the one before.
    let mut panels: [_; TILE_ROWS.div_ceil(2)] = std::array::from_fn(|_| 0..0);
    // Each chunk's sums, zeroed as far as the chunk goes (zeroing all of them weighed on small
    // tiles).
    let mut sums = [[_mm256_setzero_ps(); PANEL_ROWS]; PANEL_CHUNK];
    for panel_range in filled(&mut panels, evenly(rows.len(), PANEL_ROWS)) {
        let panel_rows = &rows[panel_range.clone()];
        for chunk in evenly(xs.len(), PANEL_CHUNK) {
            let inputs = &xs[chunk.clone()];
            // The passes' inputs, worked out once for all blocks of groups.
            let mut passes: [_; PANEL_CHUNK.div_ceil(PANEL_INPUTS)] = std::array::from_fn(|_| 0..0);
            let passes = filled(&mut passes, evenly(inputs.len(), PANEL_INPUTS));
            let sums = &mut sums[..chunk.len()];
            sums.fill([_mm256_setzero_ps(); PANEL_ROWS]);
            for block in super::super::blocks(groups, PANEL_GROUPS) {
                for (slots, row) in panel.0.iter_mut().zip(panel_rows) {
                    for (slot, g) in slots.iter_mut().zip(block.clone()) {
                        // Safety: group g exists; the row folds (the caller's guarantee).
                        *slot = unsafe { group_weights(*row, g, tables) };
                    }
                }
                for pass in passes {
                    let (xs, sums) = (&inputs[pass.clone()], &mut sums[pass.clone()]);
                    let rows = panel_rows.len();
                    let block = block.clone();
                    // Safety (each): the panel holds `block` of the rows; the inputs are as long
                    // (asserted by the caller).
                    match *xs {
                        [a] => unsafe { panel_pass(&panel, rows, block, [a], sums) },
                        [a, b] => unsafe { panel_pass(&panel, rows, block, [a, b], sums) },
                        [a, b, c] => unsafe { panel_pass(&panel, rows, block, [a, b, c], sums) },
                        [a, b, c, d] => unsafe {
                            panel_pass(&panel, rows, block, [a, b, c, d], sums)
                        },
                        _ => unreachable!("passes of at most PANEL_INPUTS inputs"),
                    }
                }
            }
            for (t, sums) in chunk.zip(sums.iter()) {
                for (r, sum) in panel_range.clone().zip(sums) {
                    out[r * stride + t] = super::sum8(*sum);
                }
            }
        }
    }
}

/// One pass of `panel_tile`: the panel's first `rows` rows times `T` inputs over `groups`, added
/// to `sums[t][r]` (through registers).
///
/// # Safety
/// AVX2 and FMA; the panel holds groups `groups` of its rows; every input holds them.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn panel_pass<const T: usize>(
    panel: &Panel,
    rows: usize,
    groups: std::ops::Range<usize>,
    xs: [&[f32]; T],
    sums: &mut [[__m256; PANEL_ROWS]],
) {
    // Safety (each): the caller's guarantees.
    match rows {
        1 => unsafe { panel_rows::<1, T>(panel, groups, xs, sums) },
        2 => unsafe { panel_rows::<2, T>(panel, groups, xs, sums) },
        _ => unsafe { panel_rows::<PANEL_ROWS, T>(panel, groups, xs, sums) },
    }
}

/// `panel_pass` of `R` rows.
///
/// # Safety
/// As `panel_pass`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn panel_rows<const R: usize, const T: usize>(
    panel: &Panel,
    groups: std::ops::Range<usize>,
    xs: [&[f32]; T],
    sums: &mut [[__m256; PANEL_ROWS]],
) {
    assert!(groups.end <= groups.start + PANEL_GROUPS && sums.len() == T);
    assert!(xs.iter().all(|x| x.len() >= 32 * groups.end));
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    for (acc, sums) in acc.iter_mut().zip(sums.iter()) {
        acc.copy_from_slice(&sums[..R]);
    }
    for (i, g) in groups.enumerate() {
        for v in 0..4 {
            for (acc, x) in acc.iter_mut().zip(xs) {
                // Safety: the group's inputs are in bounds (asserted above).
                let input = unsafe { _mm256_loadu_ps(x.as_ptr().add(32 * g + 8 * v)) };
                for (acc, slots) in acc.iter_mut().zip(&panel.0) {
                    *acc = _mm256_fmadd_ps(slots[i][v], input, *acc);
                }
            }
        }
    }
    for (acc, sums) in acc.iter().zip(sums.iter_mut()) {
        sums[..R].copy_from_slice(acc);
    }
}

/// Two runs of consecutive rows times one input: `outs[k][i] = row i of run k . x`,
/// bit-identical to `dot_mxfp4`. Decode's form: rows i and i + 1 of both runs side by side (two
/// streams from memory, four running sums in flight), then the rows left in pairs across the
/// runs, then the rows one run has beyond the other's one at a time.
///
/// # Safety
/// As `dot_mxfp4`, for every row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_mxfp4_rows(runs: [(&[u8], &[u8]); 2], x: &[f32], outs: [&mut [f32]; 2]) {
    // Safety (each): the caller's guarantees.
    rows_side_by_side::<4>(
        runs,
        x,
        outs,
        |rows| {
            if rows.iter().all(|r| r.folds()) {
                unsafe { four_folding_rows(rows, x) }
            } else {
                unsafe { rows_dots(rows, x) }
            }
        },
        |rows| unsafe { rows_dots(rows, x) },
        |row| unsafe { row_dots(row, [x])[0] },
    );
}

#[cfg(test)]
mod tests {
    use super::super::super::folding::FIRST_UNFOLDABLE_SCALE;
    use super::*;
    use crate::formats::FP4_VALUES;

    #[test]
    fn every_folding_scales_table_holds_its_scaled_values_exactly() {
        let tables = byte_tables();
        for s in 0..FIRST_UNFOLDABLE_SCALE {
            for i in 0..32 {
                let (low, high) = (tables.low[s as usize].0[i], tables.high[s as usize].0[i]);
                let widened = f32::from_bits(u32::from(u16::from_le_bytes([low, high])) << 16);
                let exact = FP4_VALUES[i % 16] * e8m0_scale(s);
                assert_eq!(
                    widened.to_bits(),
                    exact.to_bits(),
                    "scale byte {s}, code {}",
                    i % 16
                );
            }
        }
    }
}
