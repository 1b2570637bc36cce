//! What the MXFP4 kernels that fold each group's scale into its weights share (AVX-512's folded
//! tables, the byte tables of AVX2 and NEON). An E8M0 scale is a power of two, so a scaled FP4
//! value is exact in f32, and in bf16 (it has at most two significant bits): a table per scale
//! byte turns a nibble straight into its scaled weight, and a row's products add up in running
//! sums with no per-group multiply. Rows with a scale too large for that decode the unscaled
//! values and scale each group's sum instead.

use crate::formats::{FP4_VALUES, e8m0_scale};

/// The smallest scale byte whose scaled weights are not all exact: 6 * 2^(253 - 127) overflows
/// f32 (and bf16), while a scaled sum might not.
pub(super) const FIRST_UNFOLDABLE_SCALE: u8 = 253;

/// The scale byte of the unscaled values (2^0): the table a row that does not fold reads.
pub(super) const UNSCALED: u8 = 127;

/// Whether every scale of a row folds into its tables exactly.
pub(super) fn folds(scales: &[u8]) -> bool {
    // The largest, not the first that does not fold: a loop the compiler vectorizes.
    scales.iter().fold(0u8, |m, &s| m.max(s)) < FIRST_UNFOLDABLE_SCALE
}

/// The bf16 of FP4 code `code` (0-15) times `e8m0_scale(scale)`: the upper half of the scaled
/// float, which is all of it where the scale folds.
pub(super) fn scaled_bf16(scale: u8, code: usize) -> u16 {
    ((FP4_VALUES[code] * e8m0_scale(scale)).to_bits() >> 16) as u16
}

/// The low bytes and the high bytes of the 16 `scaled_bf16` values of `scale`: what the byte
/// table kernels look a nibble up in.
#[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))] // x86 lays its tables out per lane
pub(super) fn scaled_bf16_bytes(scale: u8) -> [[u8; 16]; 2] {
    let word = |code: usize| scaled_bf16(scale, code).to_le_bytes();
    [
        std::array::from_fn(|code| word(code)[0]),
        std::array::from_fn(|code| word(code)[1]),
    ]
}

/// A row: packed bytes (16 per group), scale bytes, and whether the scales fold. Built only by
/// `folding_where` (the fields are private), which checks that the row holds 16 bytes per scale
/// byte: the kernels' loads of group g (`g < groups()`) rely on it.
#[derive(Clone, Copy)]
pub(super) struct Row<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    folds: bool,
}

impl<'a> Row<'a> {
    pub fn new(packed: &'a [u8], scales: &'a [u8]) -> Row<'a> {
        Row::folding_where(packed, scales, folds(scales))
    }

    /// A row whose scales fold where `folds` (which must be `folds(scales)`, or true where every
    /// scale of a larger set folds).
    pub fn folding_where(packed: &'a [u8], scales: &'a [u8], folds: bool) -> Row<'a> {
        let groups = scales.len();
        assert!(
            packed.len() == 16 * groups,
            "an MXFP4 row holds 16 bytes and one scale per group"
        );
        Row {
            packed,
            scales,
            folds,
        }
    }

    pub fn groups(&self) -> usize {
        self.scales.len()
    }

    /// The packed bytes: 16 per group.
    pub fn packed(&self) -> &'a [u8] {
        self.packed
    }

    /// The scale bytes: one per group.
    pub fn scales(&self) -> &'a [u8] {
        self.scales
    }

    /// Whether every scale folds (the kernels read the scaled tables), or some does not (they
    /// read the unscaled values and scale each group's sum).
    pub fn folds(&self) -> bool {
        self.folds
    }
}

/// Two runs of consecutive rows times one input (`PackedDot::rows`): `outs[k][i] = row i of run
/// k . x`. Rows go `N` at a time, `N / 2` of each run side by side (two streams from memory, `N`
/// rows' sums in flight) through `batch`, then the rows left in pairs across the runs through
/// `pair`, then the rows one run has beyond the other's one at a time through `one`. Each scans
/// its run's scales once: where all fold, no row scans its own.
pub(super) fn rows_side_by_side<'a, const N: usize>(
    runs: [(&'a [u8], &'a [u8]); 2],
    x: &[f32],
    outs: [&mut [f32]; 2],
    batch: impl Fn([Row<'a>; N]) -> [f32; N],
    pair: impl Fn([Row<'a>; 2]) -> [f32; 2],
    one: impl Fn(Row<'a>) -> f32,
) {
    const {
        assert!(
            N >= 2 && N.is_multiple_of(2),
            "batches take as many rows of each run"
        )
    };
    let groups = x.len() / 32;
    for k in 0..2 {
        assert!(
            runs[k].0.len() == 16 * groups * outs[k].len()
                && runs[k].1.len() == groups * outs[k].len(),
            "consecutive MXFP4 rows hold 16 bytes and one scale per group of the input"
        );
    }
    let all_fold = runs.map(|(_, scales)| folds(scales));
    let row = |k: usize, r: usize| {
        let (blocks, scales) = runs[k];
        let scales = &scales[groups * r..groups * (r + 1)];
        let packed = &blocks[16 * groups * r..16 * groups * (r + 1)];
        Row::folding_where(packed, scales, all_fold[k] || folds(scales))
    };
    let [first, second] = outs;
    let paired = first.len().min(second.len());
    let half = N / 2;
    let mut r = 0;
    while r + half <= paired {
        let dots = batch(std::array::from_fn(|i| row(i / half, r + i % half)));
        first[r..r + half].copy_from_slice(&dots[..half]);
        second[r..r + half].copy_from_slice(&dots[half..]);
        r += half;
    }
    for r in r..paired {
        [first[r], second[r]] = pair([row(0, r), row(1, r)]);
    }
    for (k, out) in [first, second].into_iter().enumerate() {
        for (r, y) in out.iter_mut().enumerate().skip(paired) {
            *y = one(row(k, r));
        }
    }
}
