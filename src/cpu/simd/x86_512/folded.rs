//! MXFP4 rows with each group's scale folded into the weight table (AVX-512 with VBMI).
//!
//! An E8M0 scale is a power of two, so `scale * table[nibble]` is exact: one 16-entry table per
//! scale byte (256 of them, 16 KiB) turns a nibble straight into its scaled weight, and a row's
//! products add up in running sums with no per-group multiply. A 64-byte run holds four groups;
//! one byte permute (VBMI) puts byte i of each group into 32-bit word i, so shifting the words by
//! 4k leaves nibble k of every word from one group (k / 2), and one table permute per shift gives
//! 16 weights of that group. Per 128 weights: 1 byte permute, 7 shifts, 8 table permutes (the
//! table read from memory) and 8 multiply-adds, against 26 vector instructions when the scales
//! are applied per run.
//!
//! Inputs are read per group as its 16 even inputs then its 16 odd ones
//! (`InputOrder::GroupHalves`), and each input's products go into two running sums, one for the
//! even inputs and one for the odd. Prefill's tiles take up to eight inputs per decoded weight
//! vector (16 sums in registers), or, over interleaved runs, two rows and up to four inputs
//! (each input vector loaded once for both rows: one load per two multiply-adds, where eight
//! inputs one row at a time take one per multiply-add); decode takes rows in pairs, which share
//! each input load.
//!
//! Rows with a scale of 253 or more (where a scaled table entry would overflow or be NaN while
//! the scaled sum might not) multiply each group's sum by its scale instead, in the same input
//! order.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::super::folding::{folds, scaled_bf16};
use super::super::x86::prefetch_ahead;
use super::super::{TILE_GROUPS, TILE_ROWS};
use crate::formats::{FP4_VALUES, e8m0_scale};

/// The 16 FP4 values times one scale, aligned for one vector load.
#[repr(C, align(64))]
struct ScaledTable([f32; 16]);

/// A `ScaledTable` as 16-bit words: the upper halves of its floats, which are the whole values (a
/// scaled FP4 value has at most one mantissa bit below its leading one, so the lower half of the
/// float is zero), the 16 twice: a word permute reads five index bits, and finds the value
/// whatever the fifth.
#[repr(C, align(64))]
struct WordTable([u16; 32]);

/// Both tables of every scale byte `s`: `FP4_VALUES * e8m0_scale(s)`.
struct Tables {
    floats: [ScaledTable; 256],
    words: [WordTable; 256],
}

fn scaled_tables() -> &'static Tables {
    static TABLES: OnceLock<Box<Tables>> = OnceLock::new();
    TABLES.get_or_init(|| {
        let floats: [ScaledTable; 256] = std::array::from_fn(|s| {
            let scale = e8m0_scale(s as u8);
            ScaledTable(std::array::from_fn(|n| FP4_VALUES[n] * scale))
        });
        let words = std::array::from_fn(|s| {
            WordTable(std::array::from_fn(|n| scaled_bf16(s as u8, n % 16)))
        });
        Box::new(Tables { floats, words })
    })
}

/// Byte p of a permuted run is byte p / 4 of group p % 4.
const RUN_TRANSPOSE: [u8; 64] = {
    let mut index = [0u8; 64];
    let mut p = 0;
    while p < 64 {
        index[p] = (16 * (p % 4) + p / 4) as u8;
        p += 1;
    }
    index
};

/// Two running sums per input: the even vectors of a run (a group's even inputs) go to the
/// first, the odd ones to the second. With up to eight inputs a tile pass keeps its 16 sums in
/// registers and decodes each weight vector once for all eight; decode pairs rows so that one
/// multiply-add does not wait on the one before.
type Sums<const T: usize> = [[__m512; 2]; T];

/// One packed row and what its kernel needs: bytes, scale bytes (one per 16 bytes: `Row::new`
/// checks it, and rows built field by field come from slices cut to that length), whether the
/// scales fold, and whether its whole runs are interleaved (`interleave_runs`: only rows that
/// fold are).
#[derive(Clone, Copy)]
struct Row<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    folds: bool,
    interleaved: bool,
}

impl<'a> Row<'a> {
    /// A row of a matrix whose folding rows have interleaved runs where `INTERLEAVED`, else in
    /// the checkpoint's layout.
    fn new<const INTERLEAVED: bool>(packed: &'a [u8], scales: &'a [u8]) -> Row<'a> {
        Row::folding_where::<INTERLEAVED>(packed, scales, folds(scales))
    }

    /// `new`, with whether the scales fold known already (`folds(scales)`, or true where every
    /// scale of a larger set that holds them folds).
    fn folding_where<const INTERLEAVED: bool>(
        packed: &'a [u8],
        scales: &'a [u8],
        folds: bool,
    ) -> Row<'a> {
        let groups = packed.len() / 16;
        assert!(
            packed.len() == 16 * groups && scales.len() == groups,
            "an MXFP4 row holds 16 bytes and one scale per group"
        );
        Row {
            packed,
            scales,
            folds,
            interleaved: INTERLEAVED && folds,
        }
    }

    fn groups(&self) -> usize {
        self.scales.len()
    }
}

/// The 128 weights of run `c` of a folding row as 8 vectors: vector k holds the 16 weights that
/// multiply inputs `128 c + 16 k ..` (group k / 2 of the run: its even inputs for even k).
/// `tables` is `scaled_tables()`, fetched once by the caller's loop: fetched here, its
/// initialization check and the registers it holds cost the loop spills.
///
/// # Safety
/// AVX-512 F/BW/VL and VBMI; run c exists (`c < row.groups() / 4`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn run_weights(row: Row, c: usize, tables: &Tables) -> [__m512; 8] {
    // Safety: the caller's guarantees.
    unsafe {
        if row.interleaved {
            interleaved_run_weights(row, c, &tables.words)
        } else {
            checkpoint_run_weights(row, c, &tables.floats)
        }
    }
}

/// `run_weights` of a run in the checkpoint's layout.
///
/// # Safety
/// As `run_weights`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn checkpoint_run_weights(row: Row, c: usize, tables: &[ScaledTable; 256]) -> [__m512; 8] {
    // Safety: run c exists (the caller's guarantee).
    let [t0, t1, t2, t3] = unsafe { run_tables(row, c, tables) }.map(|t| t.0.as_ptr());
    // Safety: RUN_TRANSPOSE holds 64 bytes; run c's 64 bytes exist (the caller's guarantee); each
    // table holds 16 floats.
    unsafe {
        let transpose = _mm512_loadu_si512(RUN_TRANSPOSE.as_ptr().cast());
        let words = _mm512_permutexvar_epi8(
            transpose,
            _mm512_loadu_si512(row.packed.as_ptr().add(64 * c).cast()),
        );
        let (t0, t1, t2, t3) = (
            _mm512_load_ps(t0),
            _mm512_load_ps(t1),
            _mm512_load_ps(t2),
            _mm512_load_ps(t3),
        );
        [
            _mm512_permutexvar_ps(words, t0),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(words), t0),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(words), t1),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(words), t1),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(words), t2),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(words), t2),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(words), t3),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(words), t3),
        ]
    }
}

/// `run_weights` of an interleaved run (`interleave_runs`): word w of the run holds weight w of
/// each of its four groups (nibble k: group k), so that shifting the words by 4k leaves group k's
/// nibbles in their low bits, and one word permute of its table gives its 32 weights as bf16.
/// Each word shifted up is a float (the group's even weights), each word masked in place another
/// (its odd ones): the vectors `run_weights` gives for the same run in the checkpoint's layout.
/// Per 128 weights: 4 word permutes against 9 float and byte permutes, which on some cores (AMD
/// Zen 5) share the pipes of the multiply-adds.
///
/// # Safety
/// As `run_weights`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn interleaved_run_weights(row: Row, c: usize, tables: &[WordTable; 256]) -> [__m512; 8] {
    // Safety: the caller's guarantees.
    let groups = unsafe { interleaved_run_groups(row, c, tables) };
    let mut weights = [_mm512_setzero_ps(); 8];
    for (k, g) in groups.into_iter().enumerate() {
        [weights[2 * k], weights[2 * k + 1]] = [even_weights(g), odd_weights(g)];
    }
    weights
}

/// Run `c` of an interleaved folding row as its four groups' weights in bf16: word w of vector k
/// is weight w of group k (`even_weights` and `odd_weights` make floats of them).
///
/// # Safety
/// As `run_weights`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn interleaved_run_groups(row: Row, c: usize, tables: &[WordTable; 256]) -> [__m512i; 4] {
    // Safety: run c exists (the caller's guarantee).
    let [t0, t1, t2, t3] = unsafe { run_tables(row, c, tables) }.map(|t| t.0.as_ptr().cast());
    // Safety: run c's 64 bytes exist (the caller's guarantee); each table holds 32 words.
    unsafe {
        let words = _mm512_loadu_si512(row.packed.as_ptr().add(64 * c).cast());
        [
            _mm512_permutexvar_epi16(words, _mm512_load_si512(t0)),
            _mm512_permutexvar_epi16(_mm512_srli_epi16::<4>(words), _mm512_load_si512(t1)),
            _mm512_permutexvar_epi16(_mm512_srli_epi16::<8>(words), _mm512_load_si512(t2)),
            _mm512_permutexvar_epi16(_mm512_srli_epi16::<12>(words), _mm512_load_si512(t3)),
        ]
    }
}

/// The tables of run `c`'s four scale bytes, the run's bytes ahead prefetched. The four bytes
/// come in one load, each picked out of the register: one load on the way from the scale bytes
/// to the tables instead of four.
///
/// # Safety
/// Run c's four scale bytes exist (`4 * c + 4 <= row.scales.len()`).
#[inline(always)]
unsafe fn run_tables<'t, T>(row: Row, c: usize, tables: &'t [T; 256]) -> [&'t T; 4] {
    prefetch_ahead(row.packed.as_ptr().wrapping_add(64 * c), 64);
    // Safety: the caller's guarantee.
    let four = unsafe {
        row.scales
            .as_ptr()
            .add(4 * c)
            .cast::<u32>()
            .read_unaligned()
    };
    [0, 1, 2, 3].map(|k| &tables[((four >> (8 * k)) & 0xff) as usize])
}

/// A group's even weights as floats: the lower words of its bf16 pairs, shifted up.
#[target_feature(enable = "avx512f")]
#[inline]
fn even_weights(group: __m512i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(group))
}

/// A group's odd weights as floats: the upper words of its bf16 pairs, in place.
#[target_feature(enable = "avx512f")]
#[inline]
fn odd_weights(group: __m512i) -> __m512 {
    _mm512_castsi512_ps(_mm512_and_si512(
        group,
        _mm512_set1_epi32(0xffff_0000_u32 as i32),
    ))
}

/// Where byte p of an interleaved run comes from, for the groups whose nibbles fill the low byte
/// of each word (0 and 1) and the high byte (2 and 3): byte p / 4 of group 2 (p % 2) + parity.
const INTERLEAVE_FROM: [[u8; 64]; 2] = {
    let mut index = [[0u8; 64]; 2];
    let mut p = 0;
    while p < 64 {
        let group = 2 * (p % 2);
        index[0][p] = (16 * group + p / 4) as u8;
        index[1][p] = (16 * (group + 1) + p / 4) as u8;
        p += 1;
    }
    index
};

/// Interleaves the whole runs of every row of `packed` (rows of `cols` weights, `scales` theirs)
/// whose scales fold, in place: word w of a run then holds weight w of each of its four groups,
/// nibble k from group k (the layout the interleaved entries read). Rows that do not fold, and the
/// groups after a row's last whole run, keep the checkpoint's layout.
///
/// # Safety
/// AVX-512 F/BW and VBMI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi")]
pub unsafe fn interleave_runs(packed: &mut [u8], scales: &[u8], cols: usize) {
    let groups = cols / 32;
    assert!(
        cols.is_multiple_of(32) && groups > 0,
        "MXFP4 rows hold whole groups"
    );
    assert!(
        packed.len().is_multiple_of(16 * groups) && scales.len() * 16 == packed.len(),
        "MXFP4 rows hold 16 bytes and one scale per group"
    );
    // Safety: the index tables hold 64 bytes each.
    let (from_low, from_high) = unsafe {
        (
            _mm512_loadu_si512(INTERLEAVE_FROM[0].as_ptr().cast()),
            _mm512_loadu_si512(INTERLEAVE_FROM[1].as_ptr().cast()),
        )
    };
    // Odd words take their bytes' high nibbles.
    let shifts = _mm512_set1_epi32(0x0004_0000);
    let nibbles = _mm512_set1_epi8(0x0f);
    for (row, scales) in packed
        .chunks_exact_mut(16 * groups)
        .zip(scales.chunks_exact(groups))
    {
        if !folds(scales) {
            continue;
        }
        for run in row.chunks_exact_mut(64) {
            // Safety: a run is 64 bytes.
            unsafe {
                let bytes = _mm512_loadu_si512(run.as_ptr().cast());
                let low = _mm512_srlv_epi16(_mm512_permutexvar_epi8(from_low, bytes), shifts);
                let high = _mm512_srlv_epi16(_mm512_permutexvar_epi8(from_high, bytes), shifts);
                let words = _mm512_or_si512(
                    _mm512_and_si512(low, nibbles),
                    _mm512_slli_epi16::<4>(_mm512_and_si512(high, nibbles)),
                );
                _mm512_storeu_si512(run.as_mut_ptr().cast(), words);
            }
        }
    }
}

/// Adds runs `runs` of a folding row times `T` inputs to `sums`.
///
/// # Safety
/// AVX-512 F/BW/VL and VBMI; every input holds 32 values per group of the row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn folded_runs<const T: usize>(
    row: Row,
    xs: [&[f32]; T],
    runs: std::ops::Range<usize>,
    sums: &mut Sums<T>,
) {
    assert!(runs.end <= row.groups() / 4 && xs.iter().all(|x| x.len() == 32 * row.groups()));
    let mut acc = *sums;
    let tables = scaled_tables();
    for c in runs {
        // Safety: run c exists (asserted above).
        let weights = unsafe { run_weights(row, c, tables) };
        for (k, w) in weights.into_iter().enumerate() {
            for (a, x) in acc.iter_mut().zip(&xs) {
                // Safety: run c's 128 inputs are in bounds (asserted above).
                let x = unsafe { _mm512_loadu_ps(x.as_ptr().add(128 * c + 16 * k)) };
                a[k % 2] = _mm512_fmadd_ps(w, x, a[k % 2]);
            }
        }
    }
    *sums = acc;
}

/// Group `g` of a row, in the checkpoint's layout, as its even and odd weights: scaled where the
/// row folds, else the plain FP4 values (the caller scales their sum).
///
/// # Safety
/// AVX-512 F/BW/VL and VBMI; group g exists (`g < row.groups()`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn single_group_weights(
    row: Row,
    g: usize,
    tables: &[ScaledTable; 256],
) -> (__m512, __m512) {
    // The unscaled values: the table of scale 2^0.
    let scale = if row.folds { row.scales[g] } else { 127 };
    // Safety: group g's 16 bytes exist (the caller's guarantee); the table holds 16 floats.
    unsafe {
        let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.packed.as_ptr().add(16 * g).cast()));
        let table = _mm512_load_ps(tables[scale as usize].0.as_ptr());
        (
            _mm512_permutexvar_ps(codes, table),
            _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes), table),
        )
    }
}

/// Adds groups `groups` of a row times `T` inputs to `sums`, one group at a time: through the
/// folded tables where the row folds, else through the plain table with the group's sum scaled.
///
/// # Safety
/// As `folded_runs`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn single_groups<const T: usize>(
    row: Row,
    xs: [&[f32]; T],
    groups: std::ops::Range<usize>,
    sums: &mut Sums<T>,
) {
    assert!(groups.end <= row.groups() && xs.iter().all(|x| x.len() == 32 * row.groups()));
    let tables = &scaled_tables().floats;
    for g in groups {
        let scale = row.scales[g];
        // Safety: group g exists (asserted above).
        let (low, high) = unsafe { single_group_weights(row, g, tables) };
        for (a, x) in sums.iter_mut().zip(&xs) {
            // Safety: group g's 32 inputs are in bounds (asserted above).
            let (even, odd) = unsafe {
                let x = x.as_ptr().add(32 * g);
                (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)))
            };
            if row.folds {
                a[0] = _mm512_fmadd_ps(low, even, a[0]);
                a[1] = _mm512_fmadd_ps(high, odd, a[1]);
            } else {
                let sum = _mm512_fmadd_ps(high, odd, _mm512_mul_ps(low, even));
                a[0] = _mm512_fmadd_ps(sum, _mm512_set1_ps(e8m0_scale(scale)), a[0]);
            }
        }
    }
}

/// Groups `groups` (starting at a multiple of 4) of a folding row of `row_groups` groups, split
/// into the whole runs among them (run indices) and the single groups after the last whole run.
fn runs_then_groups(
    row_groups: usize,
    groups: std::ops::Range<usize>,
) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    assert!(groups.start.is_multiple_of(4));
    let runs_end = groups.end.min(4 * (row_groups / 4)).max(groups.start);
    (groups.start / 4..runs_end / 4, runs_end..groups.end)
}

/// Adds groups `groups` (starting at a multiple of 4) of a row times `T` inputs to `sums`: whole
/// runs, then single groups. However a row's groups are split into calls, each sum sees the same
/// additions in the same order.
///
/// # Safety
/// As `folded_runs`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn row_groups<const T: usize>(
    row: Row,
    xs: [&[f32]; T],
    groups: std::ops::Range<usize>,
    sums: &mut Sums<T>,
) {
    let (runs, singles) = if row.folds {
        runs_then_groups(row.groups(), groups)
    } else {
        (0..0, groups)
    };
    // Safety: the caller's guarantees.
    unsafe {
        folded_runs(row, xs, runs, sums);
        single_groups(row, xs, singles, sums);
    }
}

/// Each input's sums added up: its dot product with the row.
#[target_feature(enable = "avx512f")]
fn reduce<const T: usize>(sums: &Sums<T>) -> [f32; T] {
    std::array::from_fn(|t| {
        let [even, odd] = sums[t];
        _mm512_reduce_add_ps(_mm512_add_ps(even, odd))
    })
}

/// One row times `T` inputs.
///
/// # Safety
/// As `folded_runs`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn row_dots<const T: usize>(row: Row, xs: [&[f32]; T]) -> [f32; T] {
    let mut sums = [[_mm512_setzero_ps(); 2]; T];
    // Safety: the caller's guarantees.
    unsafe { row_groups(row, xs, 0..row.groups(), &mut sums) };
    reduce(&sums)
}

/// `INTERLEAVED`: the row's whole runs are interleaved if it folds (`interleave_runs`), as in
/// every entry below.
///
/// # Safety
/// AVX-512 F/BW/VL and VBMI, AVX2, FMA and F16C; `scales` holds one E8M0 byte per 16 bytes of
/// `blocks` and `x` 32 inputs per group in `InputOrder::GroupHalves`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub unsafe fn dot_mxfp4<const INTERLEAVED: bool>(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    // Safety: the caller's guarantees.
    unsafe { row_dots(Row::new::<INTERLEAVED>(blocks, scales), [x])[0] }
}

/// # Safety
/// As `dot_mxfp4`, for every input.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub unsafe fn dot_mxfp4_each<const INTERLEAVED: bool>(
    blocks: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    out: &mut [f32],
) {
    let row = Row::new::<INTERLEAVED>(blocks, scales);
    // Safety: the caller's guarantees.
    in_blocks!(for_blocks_of_eight, xs, out, |block| unsafe {
        row_dots(row, block)
    });
}

/// Two runs of consecutive rows (each row `x.len() / 2` bytes and `x.len() / 32` scales) times
/// one input: `outs[k][i] = row i of run k . x`, bit-identical to `dot_mxfp4`. Decode's form:
/// one scan of each run's scales, then row i of both runs side by side through `rows_dots`
/// (two streams from memory), rows i and i + 1 in one pass, the rows one run has beyond the
/// other's one at a time.
///
/// # Safety
/// As `dot_mxfp4`, for every row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub unsafe fn dot_mxfp4_rows<const INTERLEAVED: bool>(
    runs: [(&[u8], &[u8]); 2],
    x: &[f32],
    outs: [&mut [f32]; 2],
) {
    let groups = x.len() / 32;
    let row_sets = [0, 1].map(|k| {
        let (blocks, scales) = runs[k];
        let rows = outs[k].len();
        assert!(
            blocks.len() == 16 * groups * rows && scales.len() == groups * rows,
            "consecutive MXFP4 rows hold 16 bytes and one scale per group of the input"
        );
        (blocks, scales, folds(scales))
    });
    let row = |k: usize, r: usize| {
        let (blocks, scales, all_fold) = row_sets[k];
        let scales = &scales[r * groups..(r + 1) * groups];
        let packed = &blocks[16 * r * groups..16 * (r + 1) * groups];
        Row::folding_where::<INTERLEAVED>(packed, scales, all_fold || folds(scales))
    };
    // Rows i and i + 1 of both runs per pass (two pairs: more independent work between one
    // run's loads and the next than one pair; three or four spill), then the last row of an odd
    // count as one pair.
    // Safety (each): the caller's guarantees.
    super::super::in_fours(
        outs,
        |r| {
            let pairs = [[row(0, r), row(1, r)], [row(0, r + 1), row(1, r + 1)]];
            let [[a, b], [c, d]] = unsafe { rows_dots::<2, INTERLEAVED>(pairs, x) };
            [a, b, c, d]
        },
        |r| unsafe { rows_dots::<1, INTERLEAVED>([[row(0, r), row(1, r)]], x)[0] },
        |k, r| unsafe { row_dots(row(k, r), [x])[0] },
    );
}

/// Run `run` of two folding rows in the checkpoint's layout times `x`, added to each row's two
/// sums: the row's even vectors to the first, its odd ones to the second, as `folded_runs` adds
/// them. Each input vector is loaded once for both rows.
///
/// # Safety
/// As `run_weights`, for both rows; `x` holds the rows' inputs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn pair_run(
    pair: [Row; 2],
    run: usize,
    x: &[f32],
    tables: &Tables,
    [first, second]: [&mut [__m512; 2]; 2],
) {
    // Safety: the caller's guarantees. (Not `map`: a closure would not inherit the target
    // features, and the weights would go through memory.)
    let (u, v) = unsafe {
        (
            checkpoint_run_weights(pair[0], run, &tables.floats),
            checkpoint_run_weights(pair[1], run, &tables.floats),
        )
    };
    let (mut first_sums, mut second_sums) = (*first, *second);
    for k in 0..8 {
        // Safety: run `run`'s 128 inputs are in bounds (the caller's guarantee).
        let input = unsafe { _mm512_loadu_ps(x.as_ptr().add(128 * run + 16 * k)) };
        first_sums[k % 2] = _mm512_fmadd_ps(u[k], input, first_sums[k % 2]);
        second_sums[k % 2] = _mm512_fmadd_ps(v[k], input, second_sums[k % 2]);
    }
    (*first, *second) = (first_sums, second_sums);
}

/// `N` interleaved folding rows times one input, each bit-identical to `row_dots`: the whole
/// runs as `folded_runs` adds them (each run's four groups of every row decoded first, then each
/// input vector loaded once and multiplied into every row), then the groups after them, then the
/// sums reduced. Four rows keep their 16 group vectors and 8 sums in registers: two pairs
/// decoded as floats one pair after the other, with each row's last groups and sum done apart
/// (the sums spilled to the stack), were slower.
///
/// # Safety
/// As `folded_runs`, for every row; every row folds and is interleaved.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn interleaved_dots<const N: usize>(rows: [Row; N], x: &[f32]) -> [f32; N] {
    let groups = rows[0].groups();
    assert!(rows.iter().all(|r| r.groups() == groups && r.interleaved) && x.len() == 32 * groups);
    let tables = &scaled_tables().words;
    let mut sums = [[_mm512_setzero_ps(); 2]; N];
    for run in 0..groups / 4 {
        let mut decoded = [[_mm512_setzero_si512(); 4]; N];
        for (d, row) in decoded.iter_mut().zip(rows) {
            // Safety: run `run` exists in every row (asserted above).
            *d = unsafe { interleaved_run_groups(row, run, tables) };
        }
        for g in 0..4 {
            // Safety: run `run`'s 128 inputs are in bounds (asserted above).
            let (even, odd) = unsafe {
                let x = x.as_ptr().add(128 * run + 32 * g);
                (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)))
            };
            for (s, d) in sums.iter_mut().zip(&decoded) {
                s[0] = _mm512_fmadd_ps(even_weights(d[g]), even, s[0]);
                s[1] = _mm512_fmadd_ps(odd_weights(d[g]), odd, s[1]);
            }
        }
    }
    // The groups after the last whole run, in the checkpoint's layout, as `single_groups` adds
    // them.
    let floats = &scaled_tables().floats;
    for g in 4 * (groups / 4)..groups {
        // Safety: group g's 32 inputs are in bounds (asserted above).
        let (even, odd) = unsafe {
            let x = x.as_ptr().add(32 * g);
            (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)))
        };
        for (s, row) in sums.iter_mut().zip(rows) {
            // Safety: group g exists in every row (asserted above).
            let (low, high) = unsafe { single_group_weights(row, g, floats) };
            s[0] = _mm512_fmadd_ps(low, even, s[0]);
            s[1] = _mm512_fmadd_ps(high, odd, s[1]);
        }
    }
    reduce(&sums)
}

/// `P` pairs of rows times one input, each row bit-identical to `row_dots`. Where all fold,
/// interleaved rows go through `interleaved_dots` all together; rows in the checkpoint's layout
/// go through each run pair by pair, a pair's two rows side by side (each input vector loaded
/// once for both, four sums in flight: one row's two would leave each multiply-add waiting on
/// the one before; decoding more than two rows' floats at once would spill them from registers).
///
/// # Safety
/// As `folded_runs`, for every row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn rows_dots<const P: usize, const INTERLEAVED: bool>(
    pairs: [[Row; 2]; P],
    x: &[f32],
) -> [[f32; 2]; P] {
    let mut dots = [[0f32; 2]; P];
    if !pairs.iter().flatten().all(|r| r.folds) {
        for (dots, pair) in dots.iter_mut().zip(pairs) {
            for (dot, row) in dots.iter_mut().zip(pair) {
                // Safety: the caller's guarantees.
                *dot = unsafe { row_dots(row, [x])[0] };
            }
        }
        return dots;
    }
    let groups = pairs[0][0].groups();
    assert!(pairs.iter().flatten().all(|r| r.groups() == groups) && x.len() == 32 * groups);
    const { assert!(P <= 2, "more than two pairs spill") };
    // Every row folds, so every row is interleaved where the matrix is: one loop per layout,
    // every sum in a register (an array of sums indexed by a loop over pairs went through memory
    // at every run; the interleaved loop's array is indexed by constants once its loops over
    // rows unroll).
    if INTERLEAVED {
        let [a, b] = pairs[0];
        let [c, d] = pairs[P - 1];
        // Safety: the caller's guarantees; every row folds, so is interleaved.
        let rows_dots = unsafe {
            if P == 2 {
                interleaved_dots([a, b, c, d], x)
            } else {
                let [a, b] = interleaved_dots([a, b], x);
                [a, b, a, b]
            }
        };
        dots[0] = [rows_dots[0], rows_dots[1]];
        dots[P - 1] = [rows_dots[2 * P - 2], rows_dots[2 * P - 1]];
        return dots;
    }
    let zero = [_mm512_setzero_ps(); 2];
    let sums = {
        let tables = scaled_tables();
        let (mut a, mut b, mut c, mut d) = (zero, zero, zero, zero);
        for run in 0..groups / 4 {
            // Safety: run `run` exists in every row (asserted above).
            unsafe {
                pair_run(pairs[0], run, x, tables, [&mut a, &mut b]);
                if P == 2 {
                    pair_run(pairs[P - 1], run, x, tables, [&mut c, &mut d]);
                }
            }
        }
        [a, b, c, d]
    };
    for (p, (dots, pair)) in dots.iter_mut().zip(pairs).enumerate() {
        for (j, (dot, row)) in dots.iter_mut().zip(pair).enumerate() {
            let mut row_sums = [sums[2 * p + j]];
            // Safety: the caller's guarantees.
            unsafe { single_groups(row, [x], 4 * (groups / 4)..groups, &mut row_sums) };
            *dot = reduce(&row_sums)[0];
        }
    }
    dots
}

/// Each row's sums reduced to its `T` dot products, row r's at `out[r * stride..]`.
#[target_feature(enable = "avx512f")]
fn store_dots<const T: usize>(sums: &[Sums<T>], (out, stride): (&mut [f32], usize)) {
    for (r, sums) in sums.iter().enumerate() {
        out[r * stride..r * stride + T].copy_from_slice(&reduce(sums));
    }
}

/// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, block of groups by block of groups:
/// `out[r * stride + t]`. Bit-identical to `row_dots`.
///
/// # Safety
/// As `folded_runs`, for every row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn tile_dots<const T: usize>(
    rows: &[Row],
    xs: [&[f32]; T],
    (out, stride): (&mut [f32], usize),
) {
    assert!(rows.len() <= TILE_ROWS);
    let mut sums = [[[_mm512_setzero_ps(); 2]; T]; TILE_ROWS];
    let groups = rows.first().map_or(0, Row::groups);
    for block in super::super::blocks(groups, TILE_GROUPS) {
        for (row, sums) in rows.iter().zip(sums.iter_mut()) {
            // Safety: the caller's guarantees.
            unsafe { row_groups(*row, xs, block.clone(), sums) };
        }
    }
    store_dots(&sums[..rows.len()], (out, stride));
}

/// Runs `runs` of two interleaved folding rows times `T` (at most 4) inputs, added to each row's
/// sums as `folded_runs` adds them: each input vector is loaded once for both rows.
///
/// # Safety
/// As `folded_runs`, for both rows; both are interleaved.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn interleaved_pair_runs<const T: usize>(
    pair: [Row; 2],
    xs: [&[f32]; T],
    runs: std::ops::Range<usize>,
    [first, second]: [&mut Sums<T>; 2],
) {
    let groups = pair[0].groups();
    assert!(
        runs.end <= groups / 4
            && pair.iter().all(|r| r.groups() == groups && r.interleaved)
            && xs.iter().all(|x| x.len() == 32 * groups)
    );
    let tables = &scaled_tables().words;
    let (mut a, mut b) = (*first, *second);
    for run in runs {
        // Safety: run `run` exists in both rows (asserted above).
        let (u, v) = unsafe {
            (
                interleaved_run_groups(pair[0], run, tables),
                interleaved_run_groups(pair[1], run, tables),
            )
        };
        for g in 0..4 {
            let (u_even, u_odd) = (even_weights(u[g]), odd_weights(u[g]));
            let (v_even, v_odd) = (even_weights(v[g]), odd_weights(v[g]));
            for t in 0..T {
                // Safety: run `run`'s 128 inputs are in bounds (asserted above).
                let (even, odd) = unsafe {
                    let x = xs[t].as_ptr().add(128 * run + 32 * g);
                    (_mm512_loadu_ps(x), _mm512_loadu_ps(x.add(16)))
                };
                a[t][0] = _mm512_fmadd_ps(u_even, even, a[t][0]);
                a[t][1] = _mm512_fmadd_ps(u_odd, odd, a[t][1]);
                b[t][0] = _mm512_fmadd_ps(v_even, even, b[t][0]);
                b[t][1] = _mm512_fmadd_ps(v_odd, odd, b[t][1]);
            }
        }
    }
    (*first, *second) = (a, b);
}

/// `tile_dots` of up to four inputs, rows two at a time where both are interleaved (each input
/// vector loaded once for the two: one load per multiply-add in `folded_runs`, one per two
/// here). Bit-identical to `row_dots`: each sum sees the same additions in the same order.
///
/// # Safety
/// As `folded_runs`, for every row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
#[inline]
unsafe fn paired_tile_dots<const T: usize>(
    rows: &[Row],
    xs: [&[f32]; T],
    (out, stride): (&mut [f32], usize),
) {
    const { assert!(T <= 4, "more than four inputs of a pair spill") };
    assert!(rows.len() <= TILE_ROWS);
    let mut sums = [[[_mm512_setzero_ps(); 2]; T]; TILE_ROWS];
    let groups = rows.first().map_or(0, Row::groups);
    for block in super::super::blocks(groups, TILE_GROUPS) {
        // Where both rows of a pair are interleaved, both fold: the same runs and single groups.
        let (runs, singles) = runs_then_groups(groups, block.clone());
        let mut r = 0;
        while r < rows.len() {
            if r + 1 < rows.len() && rows[r].interleaved && rows[r + 1].interleaved {
                let [first, second] = sums.get_disjoint_mut([r, r + 1]).expect("two rows");
                // Safety: the caller's guarantees; both rows are interleaved, so fold.
                unsafe {
                    interleaved_pair_runs(
                        [rows[r], rows[r + 1]],
                        xs,
                        runs.clone(),
                        [&mut *first, &mut *second],
                    );
                    single_groups(rows[r], xs, singles.clone(), first);
                    single_groups(rows[r + 1], xs, singles.clone(), second);
                }
                r += 2;
            } else {
                // Safety: the caller's guarantees.
                unsafe { row_groups(rows[r], xs, block.clone(), &mut sums[r]) };
                r += 1;
            }
        }
    }
    store_dots(&sums[..rows.len()], (out, stride));
}

/// Rows (packed bytes, scale bytes; at most `TILE_ROWS`, all as long) times every input:
/// `out[r * xs.len() + t]`.
///
/// # Safety
/// As `dot_mxfp4`, for every row and input.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma,f16c")]
pub unsafe fn mxfp4_tile<const INTERLEAVED: bool>(
    rows: &[(&[u8], &[u8])],
    xs: &[&[f32]],
    out: &mut [f32],
) {
    assert!(rows.len() <= TILE_ROWS);
    let mut tile = [Row::folding_where::<false>(&[], &[], true); TILE_ROWS];
    for (slot, &(packed, scales)) in tile.iter_mut().zip(rows) {
        *slot = Row::new::<INTERLEAVED>(packed, scales);
    }
    let rows = &tile[..rows.len()];
    assert!(rows.iter().all(|r| r.groups() == rows[0].groups()));
    let stride = xs.len();
    if INTERLEAVED {
        // Safety: the caller's guarantees.
        for_blocks_of_four!(xs, |block, t| unsafe {
            paired_tile_dots(rows, block, (&mut out[t..], stride))
        });
    } else {
        // Safety: the caller's guarantees.
        for_blocks_of_eight!(xs, |block, t| unsafe {
            tile_dots(rows, block, (&mut out[t..], stride))
        });
    }
}
