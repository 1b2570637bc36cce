//! `attend_group` in AVX-512 intrinsics: the same multiply-adds in the same order as the
//! portable lanes code (so the same bits, by test), with the sums in registers. The lanes code
//! compiled for AVX-512 sent its value sums through memory at every multiply-add, and its score
//! loop broadcast one key element per 8 products (the broadcasts, not the multiply-adds, set its
//! pace).
//!
//! Scores: pass p's 8 heads by two elements in the 16 lanes of a register (`paired_query`), a
//! 64-bit broadcast of a key's two elements per multiply-add, two keys at a time (each query
//! vector loaded once for both); lane 2 i + parity of register r holds head i's running sum of
//! the elements 2 r + parity mod 8, the lanes code's eight sums. Values: 16 dimensions in the
//! lanes of a register, the sums of 8 heads by 32 dimensions (16 registers) kept over a block of
//! keys whose value rows stay in L1. The scratch and the softmax are the AVX2 kernel's.

use std::arch::x86_64::*;

use super::avx2::{CallScratch, softmax};
use super::{Group, HEAD_LANES, PREFETCH_KEYS, divide_by_denominators, transposed_query};

/// Dimensions per value pass: two 512-bit registers of sums per head.
const VALUE_WIDTH: usize = 32;

/// Keys per block of the value loop: as its first slice's pass starts, the value rows from 8 keys
/// (`PREFETCH_KEYS`) into the block to 8 past it are prefetched (the block before asked for the
/// first 8), and the passes over its other slices (and over a group's other heads) find them in
/// L1 (64 rows of 256 bytes at head size 64: 16 KiB).
const VALUE_BLOCK: usize = 64;

/// Whether `attend_group` takes this shape: whole 8-element steps for the scores and whole
/// `VALUE_WIDTH` slices for the values (every head size of GPT-OSS and Qwen3-MoE).
pub(super) fn takes(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(VALUE_WIDTH)
}

/// `super::attend_group_with` for a head size `takes` accepts and a non-empty key range.
///
/// # Safety
/// The CPU has AVX-512 F and VL, AVX2 and FMA.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
pub(super) unsafe fn attend_group<'a>(
    group: Group,
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    let (d, per_group, passes) = group.sizes();
    let scaling = group.scaling;
    assert!(takes(d) && !keys.is_empty() && out.len() == per_group * d);
    let query = paired_query(&transposed_query(&group));
    let mut call = CallScratch::gather(keys, kv, d, passes);
    let count = call.count();
    // scores[t * passes + p]: key first + t with the heads of pass p.
    let mut t = 0;
    while t < count {
        let pair = t + 1 < count;
        for ahead in [t, t + 1].into_iter().take(1 + usize::from(pair)) {
            if ahead + PREFETCH_KEYS < count {
                super::super::simd::prefetch(call.key(ahead + PREFETCH_KEYS));
            }
        }
        for (p, query) in query.chunks_exact(d / 2).enumerate() {
            // Safety (each): the CPU features are the caller's guarantee; the keys and the
            // query hold d values each.
            if pair {
                let [a, b] = unsafe { key_scores([call.key(t), call.key(t + 1)], query, scaling) };
                call.scores[t * passes + p] = a;
                call.scores[(t + 1) * passes + p] = b;
            } else {
                call.scores[t * passes + p] =
                    unsafe { key_scores([call.key(t)], query, scaling) }[0];
            }
        }
        t += 1 + usize::from(pair);
    }
    let denominators = softmax(&group, &mut call.scores, passes);
    // Each head's exponential-weighted sum of the values, in key order, then one division.
    for block in (0..count).step_by(VALUE_BLOCK) {
        let block = block..(block + VALUE_BLOCK).min(count);
        for p in 0..passes {
            let heads = (per_group - p * HEAD_LANES).min(HEAD_LANES);
            for start in (0..d).step_by(VALUE_WIDTH) {
                if p == 0 && start == 0 {
                    for ahead in block.start + PREFETCH_KEYS..(block.end + PREFETCH_KEYS).min(count)
                    {
                        super::super::simd::prefetch(call.value(ahead));
                    }
                }
                let rows = &out[p * HEAD_LANES * d..];
                // Safety: the features are the caller's; `out` holds `heads` rows of d
                // values from pass p's first, each value row d, and start + 32 <= d.
                let mut sums = if block.start == 0 {
                    [[_mm512_setzero_ps(); 2]; HEAD_LANES]
                } else {
                    unsafe { load_sums(rows, d, start, heads) }
                };
                for t in block.clone() {
                    let v = call.value(t)[start..start + VALUE_WIDTH].as_ptr();
                    let e = &call.scores[t * passes + p];
                    // Safety: v holds 32 values.
                    let (v0, v1) = unsafe { (_mm512_loadu_ps(v), _mm512_loadu_ps(v.add(16))) };
                    for (sum, &e) in sums.iter_mut().zip(e) {
                        let e = _mm512_set1_ps(e);
                        sum[0] = _mm512_fmadd_ps(e, v0, sum[0]);
                        sum[1] = _mm512_fmadd_ps(e, v1, sum[1]);
                    }
                }
                let rows = &mut out[p * HEAD_LANES * d..];
                // Safety: as for the load above.
                unsafe { store_sums(&sums, rows, d, start, heads) };
            }
        }
    }
    divide_by_denominators(out, d, &denominators);
}

/// The group's queries with element pairs in lanes: `query[p * d / 2 + c / 2]` holds elements c
/// and c + 1 (c even) of pass p's 8 heads, lane 2 i + c % 2 for head i (zero past the group's
/// heads). One 64-bit broadcast of a key's elements c and c + 1 then meets all 16 in one
/// multiply-add.
fn paired_query(query: &[[f32; HEAD_LANES]]) -> Vec<[f32; 2 * HEAD_LANES]> {
    query
        .chunks_exact(2)
        .map(|pair| std::array::from_fn(|lane| pair[lane % 2][lane / 2]))
        .collect()
}

/// The scaled scores of `KB` keys with a pass's 8 heads (`query`: that pass's `paired_query`),
/// as the portable `attend_group_with` sums them: eight running sums by element mod 8 (here sum
/// u in lane u % 2 of register u / 2), added pairwise, times `scaling`.
///
/// # Safety
/// AVX-512 F and VL, AVX2 and FMA; every key holds `2 * query.len()` values, a multiple of 8.
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
#[inline]
unsafe fn key_scores<const KB: usize>(
    keys: [&[f32]; KB],
    query: &[[f32; 2 * HEAD_LANES]],
    scaling: f32,
) -> [[f32; HEAD_LANES]; KB] {
    let d = 2 * query.len();
    assert!(d.is_multiple_of(8) && keys.iter().all(|k| k.len() == d));
    let mut sums = [[_mm512_setzero_ps(); 4]; KB];
    for (m, query) in query.chunks_exact(4).enumerate() {
        for (r, q) in query.iter().enumerate() {
            // Safety: 16 floats.
            let q = unsafe { _mm512_loadu_ps(q.as_ptr()) };
            for (sums, key) in sums.iter_mut().zip(&keys) {
                // Safety: elements 8 m + 2 r and the next are in bounds of every key (asserted
                // above); the load is unaligned.
                let pair = unsafe {
                    key.as_ptr()
                        .add(8 * m + 2 * r)
                        .cast::<f64>()
                        .read_unaligned()
                };
                sums[r] = _mm512_fmadd_ps(_mm512_castpd_ps(_mm512_set1_pd(pair)), q, sums[r]);
            }
        }
    }
    // Even lanes: 0, 2, .., 14.
    let evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    sums.map(|[a, b, c, e]| {
        // Each register's two sums added within their lane pair: (s0 + s1), (s2 + s3), ...
        let pairs = |x: __m512| _mm512_add_ps(x, _mm512_permute_ps::<0b1011_0001>(x));
        let total = _mm512_add_ps(
            _mm512_add_ps(pairs(a), pairs(b)),
            _mm512_add_ps(pairs(c), pairs(e)),
        );
        let scaled = _mm512_mul_ps(total, _mm512_set1_ps(scaling));
        let heads = _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, scaled));
        let mut scores = [0f32; HEAD_LANES];
        // Safety: 8 floats.
        unsafe { _mm256_storeu_ps(scores.as_mut_ptr(), heads) };
        scores
    })
}

/// The value sums of `heads` rows of `rows` (each `d` values) at dimensions `start..start + 32`.
///
/// # Safety
/// AVX-512 F; `rows` holds `heads` rows of `d` values and `start + 32 <= d`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load_sums(
    rows: &[f32],
    d: usize,
    start: usize,
    heads: usize,
) -> [[__m512; 2]; HEAD_LANES] {
    assert!(rows.len() >= heads * d && start + VALUE_WIDTH <= d);
    std::array::from_fn(|h| {
        if h < heads {
            let p = rows[h * d + start..].as_ptr();
            // Safety: 32 values from p are in bounds (asserted above).
            unsafe { [_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16))] }
        } else {
            [_mm512_setzero_ps(); 2]
        }
    })
}

/// Stores `load_sums`' registers back.
///
/// # Safety
/// As `load_sums`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn store_sums(
    sums: &[[__m512; 2]; HEAD_LANES],
    rows: &mut [f32],
    d: usize,
    start: usize,
    heads: usize,
) {
    assert!(rows.len() >= heads * d && start + VALUE_WIDTH <= d);
    for (h, [a, b]) in sums.iter().enumerate().take(heads) {
        let p = rows[h * d + start..].as_mut_ptr();
        // Safety: 32 values from p are in bounds (asserted above).
        unsafe {
            _mm512_storeu_ps(p, *a);
            _mm512_storeu_ps(p.add(16), *b);
        }
    }
}
