//! Float rows (bf16, f16, f32) on AVX2: one running sum per row and input, value `8 i + j` of a
//! row going into lane j, then the lanes added (`sum8`) and the values after the last whole
//! eight one by one.
//!
//! One sum per row and input lets a tile pass keep three rows times four inputs' sums in the
//! sixteen registers: each input vector is loaded once for three rows, each row vector decoded
//! once for four inputs. With four sums per row and input (the order before), a pass held one
//! row times three inputs, loading a fresh input vector for every multiply-add, so that the
//! loads, not the multiply-adds, set its pace. Decode takes four rows at a time so that four
//! sums are in flight (one row's chain of multiply-adds alone would run at their latency, below
//! what the memory gives a core).

use std::arch::x86_64::*;

use super::super::{TILE_ROWS, blocks, evenly, filled, float_tile_len};
use super::{BF16, F16, F32, format_of, load8, prefetch_ahead, sum8};
use crate::cpu::matmul::decode_at;
use crate::weights::FloatFormat;

/// Rows a tile pass takes, and inputs: their 12 sums fill the registers with three row vectors
/// and one input vector.
const PASS_ROWS: usize = 3;
const PASS_INPUTS: usize = 4;
/// Inputs whose sums a tile keeps in one stack array (8 KiB for 16 rows).
const TILE_INPUTS: usize = 16;
/// 8-value steps of every row a tile works through before the next ones: 512 values, four
/// inputs' slices (8 KiB) and the rows' (16 KiB for 16 bf16 rows) in L1. Smaller blocks load
/// and store each pass's sums more often; larger ones no longer fit L1.
const TILE_STEPS: usize = 64;
/// Rows decode takes at a time.
const DECODE_ROWS: usize = 4;

/// Adds the 8-value steps `steps` of `R` rows (in `FORMAT`) times `T` inputs to `sums[t][r0 +
/// r]`, through registers. Each row's bytes ahead are asked for, once per 32 values, where
/// `prefetch` (where they come from memory, not from a cache a pass before left them in).
///
/// # Safety
/// AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_steps<const R: usize, const T: usize, const FORMAT: u8>(
    rows: [&[u8]; R],
    xs: [&[f32]; T],
    steps: std::ops::Range<usize>,
    (sums, r0): (&mut [[__m256; TILE_ROWS]], usize),
    prefetch: bool,
) {
    let size = format_of::<FORMAT>().size();
    assert!(
        rows.iter().all(|r| r.len() >= size * 8 * steps.end)
            && xs.iter().all(|x| x.len() >= 8 * steps.end)
            && sums.len() == T
            && r0 + R <= TILE_ROWS,
        "rows, inputs and sums of a pass"
    );
    let mut acc = [[_mm256_setzero_ps(); R]; T];
    for (acc, sums) in acc.iter_mut().zip(sums.iter()) {
        acc.copy_from_slice(&sums[r0..r0 + R]);
    }
    for s in steps {
        let at = 8 * s;
        if prefetch && s.is_multiple_of(4) {
            for row in &rows {
                prefetch_ahead(row.as_ptr().wrapping_add(size * at), 32 * size);
            }
        }
        // Safety: at + 8 <= 8 * steps.end values of each row and input (asserted above).
        let w: [__m256; R] = std::array::from_fn(|r| unsafe {
            load8(format_of::<FORMAT>(), rows[r].as_ptr().add(size * at))
        });
        for (acc, x) in acc.iter_mut().zip(&xs) {
            // Safety: as above.
            let input = unsafe { _mm256_loadu_ps(x.as_ptr().add(at)) };
            for (a, w) in acc.iter_mut().zip(&w) {
                *a = _mm256_fmadd_ps(*w, input, *a);
            }
        }
    }
    for (acc, sums) in acc.iter().zip(sums.iter_mut()) {
        sums[r0..r0 + R].copy_from_slice(acc);
    }
}

/// `add_steps` of rows in whatever format they are, `rows.len()` of them (1 to `PASS_ROWS`,
/// or `DECODE_ROWS` for one input) times `xs.len()` inputs (1 to `PASS_INPUTS`).
///
/// # Safety
/// As `add_steps`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn add_steps_of(
    format: FloatFormat,
    rows: &[&[u8]],
    xs: &[&[f32]],
    steps: std::ops::Range<usize>,
    sums: (&mut [[__m256; TILE_ROWS]], usize),
    prefetch: bool,
) {
    macro_rules! pass {
        ($r:literal, $t:literal) => {{
            let rows: [&[u8]; $r] = rows.try_into().unwrap();
            let xs: [&[f32]; $t] = xs.try_into().unwrap();
            // Safety (each): the caller's guarantees.
            match format {
                FloatFormat::Bf16 => unsafe {
                    add_steps::<$r, $t, BF16>(rows, xs, steps, sums, prefetch)
                },
                FloatFormat::F16 => unsafe {
                    add_steps::<$r, $t, F16>(rows, xs, steps, sums, prefetch)
                },
                FloatFormat::F32 => unsafe {
                    add_steps::<$r, $t, F32>(rows, xs, steps, sums, prefetch)
                },
            }
        }};
    }
    match (rows.len(), xs.len()) {
        (1, 1) => pass!(1, 1),
        (1, 2) => pass!(1, 2),
        (1, 3) => pass!(1, 3),
        (1, 4) => pass!(1, 4),
        (2, 1) => pass!(2, 1),
        (2, 2) => pass!(2, 2),
        (2, 3) => pass!(2, 3),
        (2, 4) => pass!(2, 4),
        (3, 1) => pass!(3, 1),
        (3, 2) => pass!(3, 2),
        (3, 3) => pass!(3, 3),
        (3, 4) => pass!(3, 4),
        (4, 1) => pass!(4, 1),
        (r, t) => unreachable!("a pass of {r} rows and {t} inputs"),
    }
}

/// A row's dot product with an input from its running sum over the whole 8-value steps: the
/// lanes added, then the values after them one by one.
///
/// # Safety
/// AVX2; `row` holds as many values of `format` as `x`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn finish(format: FloatFormat, row: &[u8], x: &[f32], sum: __m256) -> f32 {
    let mut dot = sum8(sum);
    for (k, xk) in x.iter().enumerate().skip(8 * (x.len() / 8)) {
        dot += decode_at(format, row, k) * xk;
    }
    dot
}

/// `rows` (at most `DECODE_ROWS`, or `PASS_ROWS` rows times up to `PASS_INPUTS` inputs) times
/// `xs`, all their values: `dots[t][r]`.
///
/// # Safety
/// AVX2, FMA and F16C; every row holds as many values of `format` as every input.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn dots(format: FloatFormat, rows: &[&[u8]], xs: &[&[f32]]) -> [[f32; TILE_ROWS]; 4] {
    let n = xs.first().map_or(0, |x| x.len());
    assert!(rows.iter().all(|r| r.len() == format.size() * n) && xs.len() <= 4);
    let mut sums = [[_mm256_setzero_ps(); TILE_ROWS]; 4];
    // Safety: the caller's guarantees.
    unsafe { add_steps_of(format, rows, xs, 0..n / 8, (&mut sums[..xs.len()], 0), true) };
    let mut out = [[0f32; TILE_ROWS]; 4];
    for ((out, sums), x) in out.iter_mut().zip(&sums).zip(xs) {
        for ((o, &sum), row) in out.iter_mut().zip(sums).zip(rows) {
            // Safety: as above.
            *o = unsafe { finish(format, row, x, sum) };
        }
    }
    out
}

/// # Safety
/// The CPU must support AVX2, FMA and F16C; `row` holds `x.len()` values of `format`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_floats(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
    assert_eq!(row.len(), format.size() * x.len());
    // Safety: the caller's guarantees.
    unsafe { dots(format, &[row], &[x])[0][0] }
}

/// `out[t] = row . xs[t]`, four inputs at a time.
///
/// # Safety
/// As `dot_floats`, for every input.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_floats_each(format: FloatFormat, row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
    assert!(xs.iter().all(|x| row.len() == format.size() * x.len()) && xs.len() == out.len());
    for pass in evenly(xs.len(), PASS_INPUTS) {
        // Safety: the caller's guarantees.
        let dots = unsafe { dots(format, &[row], &xs[pass.clone()]) };
        for (o, dots) in out[pass].iter_mut().zip(&dots) {
            *o = dots[0];
        }
    }
}

/// Consecutive rows (`rows`, `x.len()` values of `format` each) times `x`: `out[r] = row r .
/// x`, four rows at a time (decode; the rows left at the end together).
///
/// # Safety
/// As `dot_floats`, for every row.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_float_rows(format: FloatFormat, rows: &[u8], x: &[f32], out: &mut [f32]) {
    let width = format.size() * x.len();
    assert_eq!(rows.len(), width * out.len(), "one output per row");
    for pass in blocks(out.len(), DECODE_ROWS) {
        let mut these = [&[][..]; DECODE_ROWS];
        for (slot, r) in these.iter_mut().zip(pass.clone()) {
            *slot = &rows[r * width..(r + 1) * width];
        }
        // Safety: the caller's guarantees.
        let dots = unsafe { dots(format, &these[..pass.len()], &[x]) };
        out[pass.clone()].copy_from_slice(&dots[0][..pass.len()]);
    }
}

/// Rows (at most `TILE_ROWS`) times every input, `out[r * xs.len() + t]`, each bit-identical to
/// `dot_floats`: for each `TILE_INPUTS` inputs, `TILE_STEPS` steps of every row at a time, in
/// passes of up to three rows times four inputs. Only the first inputs' passes ask for the rows'
/// bytes ahead: the later ones find them in L2.
///
/// # Safety
/// As `dot_floats`, for every row and input.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn floats_tile(format: FloatFormat, rows: &[&[u8]], xs: &[&[f32]], out: &mut [f32]) {
    let n = float_tile_len(format, rows, xs);
    let stride = xs.len();
    // The passes' rows and inputs, worked out once (each range takes a division: per pass, they
    // cost a noticeable share of a tile).
    let mut row_passes: [_; TILE_ROWS.div_ceil(PASS_ROWS)] = std::array::from_fn(|_| 0..0);
    let row_passes = filled(&mut row_passes, evenly(rows.len(), PASS_ROWS));
    for chunk in evenly(xs.len(), TILE_INPUTS) {
        let mut quads: [_; TILE_INPUTS.div_ceil(PASS_INPUTS)] = std::array::from_fn(|_| 0..0);
        let quads = filled(&mut quads, evenly(chunk.len(), PASS_INPUTS));
        let mut sums = [[_mm256_setzero_ps(); TILE_ROWS]; TILE_INPUTS];
        for steps in blocks(n / 8, TILE_STEPS) {
            for (q, quad) in quads.iter().enumerate() {
                let prefetch = chunk.start == 0 && q == 0;
                let inputs = &xs[chunk.start + quad.start..chunk.start + quad.end];
                for pass in row_passes {
                    let sums = (&mut sums[quad.clone()], pass.start);
                    // Safety: the caller's guarantees; the lengths were checked above.
                    unsafe {
                        add_steps_of(
                            format,
                            &rows[pass.clone()],
                            inputs,
                            steps.clone(),
                            sums,
                            prefetch,
                        )
                    };
                }
            }
        }
        for (t, sums) in chunk.zip(&sums) {
            for (r, (row, &sum)) in rows.iter().zip(sums).enumerate() {
                // Safety: as above.
                out[r * stride + t] = unsafe { finish(format, row, xs[t], sum) };
            }
        }
    }
}
