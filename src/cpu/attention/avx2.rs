//! `attend_group` in AVX2 intrinsics, and what the AVX-512 kernel shares with it (the rows and
//! scores of a call in per-thread scratch, the softmax).
//!
//! The same multiply-adds in the same order as the portable lanes code compiled for AVX2 (so the
//! same bits, by test; NaN payloads aside), with fewer loads and the value sums in registers. The
//! lanes code's scores took two loads per multiply-add (the key element's broadcast and the
//! query's, heads in lanes; on a core that does two loads a cycle, the loads set the pace), and
//! its value sums went through memory at every multiply-add.
//! Scores: elements in lanes instead, 32 of the key's values in registers meeting each head's
//! query (`key_scores`). Values: the sums of 4 heads by 16 dimensions (8 registers), their 2
//! value registers and one broadcast weight, over a block of keys whose value rows stay in L1; 6
//! loads for 8 multiply-adds.

use std::arch::x86_64::*;
use std::marker::PhantomData;

use super::{
    EXP_HIGHEST, EXP_LOWEST, EXP_POLYNOMIAL, EXP_ROUND, Group, HEAD_LANES, LN2_HIGH, LN2_LOW,
    PREFETCH_KEYS, divide_by_denominators,
};

/// Dimensions per value pass: two registers of sums per head.
const VALUE_WIDTH: usize = 16;

/// Heads per value pass: their 8 registers of sums leave room for the value rows' two and the
/// weight's broadcast among the 16.
const VALUE_HEADS: usize = 4;

/// Keys per block of the value loop: as its first pass starts, the value rows from 8 keys
/// (`PREFETCH_KEYS`) into the block to 8 past it are prefetched (the block before asked for the
/// first 8), and the passes over its other slices and heads find them in L1 (64 rows of 256 bytes
/// at head size 64: 16 KiB).
const VALUE_BLOCK: usize = 64;

/// Whether `attend_group` takes this shape: whole steps of 32 values (4 registers) for the scores
/// (and so
/// whole `VALUE_WIDTH` slices for the values; every head size of GPT-OSS and Qwen3-MoE).
pub(super) fn takes(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(32)
}

/// `super::attend_group_with` for a head size `takes` accepts and a non-empty key range.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend_group<'a>(
    group: Group,
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    let (d, per_group, passes) = group.sizes();
    let scaling = group.scaling;
    assert!(takes(d) && !keys.is_empty() && out.len() == per_group * d);
    let query = head_rows_query(&group);
    let mut call = CallScratch::gather(keys, kv, d, passes);
    let count = call.count();
    // scores[t * passes + p]: key first + t with the heads of pass p.
    for t in 0..count {
        if t + PREFETCH_KEYS < count {
            super::super::simd::prefetch(call.key(t + PREFETCH_KEYS));
        }
        let key = call.key(t);
        for (p, query) in query.chunks_exact(HEAD_LANES * d / 8).enumerate() {
            // Safety: the features are the caller's guarantee; key and query hold d values.
            call.scores[t * passes + p] = unsafe { key_scores(key, query, scaling) };
        }
    }
    let denominators = softmax(&group, &mut call.scores, passes);
    // Each head's exponential-weighted sum of the values, in key order, then one division.
    for block in (0..count).step_by(VALUE_BLOCK) {
        let block = block..(block + VALUE_BLOCK).min(count);
        for p in 0..passes {
            let pass_heads = (per_group - p * HEAD_LANES).min(HEAD_LANES);
            for quad in 0..pass_heads.div_ceil(VALUE_HEADS) {
                let heads = (pass_heads - quad * VALUE_HEADS).min(VALUE_HEADS);
                let first = p * HEAD_LANES + quad * VALUE_HEADS;
                for start in (0..d).step_by(VALUE_WIDTH) {
                    if p == 0 && quad == 0 && start == 0 {
                        for ahead in
                            block.start + PREFETCH_KEYS..(block.end + PREFETCH_KEYS).min(count)
                        {
                            super::super::simd::prefetch(call.value(ahead));
                        }
                    }
                    let rows = &out[first * d..];
                    // Safety: the features are the caller's; `out` holds `heads` rows of d
                    // values from head `first`'s, and start + 16 <= d.
                    let mut sums = if block.start == 0 {
                        [[_mm256_setzero_ps(); 2]; VALUE_HEADS]
                    } else {
                        unsafe { load_sums(rows, d, start, heads) }
                    };
                    // Quad's 4 weights of the block's first key; each next key's a stride on.
                    let weights = (block.start * passes + p) * HEAD_LANES + quad * VALUE_HEADS;
                    assert!(
                        weights + (block.len() - 1) * passes * HEAD_LANES + VALUE_HEADS
                            <= call.scores.len() * HEAD_LANES
                    );
                    // Safety: the features are the caller's; each value row holds d >= start +
                    // 16 values (checked in `gather`), and the weights are in bounds (asserted
                    // above) of the scores the pointer is taken from.
                    unsafe {
                        add_weighted_values(
                            &mut sums,
                            &call.rows[block.clone()],
                            start,
                            call.scores.as_ptr().cast::<f32>().add(weights),
                            passes * HEAD_LANES,
                        )
                    };
                    let rows = &mut out[first * d..];
                    // Safety: as for the load above.
                    unsafe { store_sums(&sums, rows, d, start, heads) };
                }
            }
        }
    }
    divide_by_denominators(out, d, &denominators);
}

/// The group's query rows, padded with zero heads to whole passes of 8 and aligned for loads:
/// `query[(8 p + l) * d / 8 + m]` holds elements 8 m.. 8 m + 8 of head 8 p + l of the group.
#[target_feature(enable = "avx")]
fn head_rows_query(group: &Group) -> Vec<__m256> {
    let (d, per_group, passes) = group.sizes();
    let first = group.g * per_group;
    let mut query = vec![_mm256_setzero_ps(); passes * HEAD_LANES * d / 8];
    for (i, row) in query.chunks_exact_mut(d / 8).take(per_group).enumerate() {
        let head = &group.q[(first + i) * d..(first + i + 1) * d];
        for (eight, values) in row.iter_mut().zip(head.chunks_exact(8)) {
            // Safety: 8 floats.
            *eight = unsafe { _mm256_loadu_ps(values.as_ptr()) };
        }
    }
    query
}

/// The scaled scores of one key with a pass's 8 heads (`query`: their rows of
/// `head_rows_query`), as the lanes code sums them. Elements in lanes: lane u of head h's register
/// sums the products of elements u, u + 8, .. in order, the lanes code's running sum u of head
/// h, and the lanes are then added pairwise in the lanes code's order. 32 of the key's values
/// stay in 4 registers while it meets the 8 heads: 9 loads for 8 multiply-adds, where
/// heads in lanes would take 2 per multiply-add (the key element's broadcast and the query's),
/// and 8 independent sums.
///
/// # Safety
/// AVX2 and FMA; the key holds a multiple of 32 values and the query 8 rows as long.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn key_scores(key: &[f32], query: &[__m256], scaling: f32) -> [f32; HEAD_LANES] {
    let steps = key.len() / 8;
    assert!(key.len().is_multiple_of(32) && query.len() == HEAD_LANES * steps);
    let mut sums = [_mm256_setzero_ps(); HEAD_LANES];
    for four in (0..steps).step_by(4) {
        // Safety: 8 values from each of 4 steps within the key (asserted above).
        let k: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(key[8 * (four + i)..].as_ptr()) });
        for (i, k) in k.iter().enumerate() {
            for (h, sum) in sums.iter_mut().enumerate() {
                // Safety: h < 8 and four + i < steps, within the query (asserted above);
                // unchecked, as 32 bounds checks per 4 steps cost as much as their products.
                let q = unsafe { *query.get_unchecked(h * steps + four + i) };
                *sum = _mm256_fmadd_ps(*k, q, *sum);
            }
        }
    }
    // Lane pairs added, two heads at a time: [s0 + s1, s2 + s3 of the first, the same of the
    // second | s4 + s5, s6 + s7 of the first, the same of the second]; then those pairs added,
    // four heads at a time: [(s0 + s1) + (s2 + s3) of each | (s4 + s5) + (s6 + s7) of each].
    let [a, b, c, e, f, g, h, i] = sums;
    let heads_0_to_3 = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, e));
    let heads_4_to_7 = _mm256_hadd_ps(_mm256_hadd_ps(f, g), _mm256_hadd_ps(h, i));
    // Each head's first half plus its second.
    let total = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(heads_0_to_3, heads_4_to_7),
        _mm256_permute2f128_ps::<0x31>(heads_0_to_3, heads_4_to_7),
    );
    let mut scores = [0f32; HEAD_LANES];
    // Safety: 8 floats.
    unsafe {
        _mm256_storeu_ps(
            scores.as_mut_ptr(),
            _mm256_mul_ps(total, _mm256_set1_ps(scaling)),
        )
    };
    scores
}

/// Adds each key's value row (`rows[t][1]`, its values `start..start + 16`) times its weight
/// for each of 4 heads (`weights[t * stride + i]` for head i) to the heads' sums, in key order.
///
/// # Safety
/// AVX2 and FMA; each value row holds `start + 16` values or more, and `weights` holds `4 +
/// (rows.len() - 1) * stride` values.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn add_weighted_values(
    sums: &mut [[__m256; 2]; VALUE_HEADS],
    rows: &[[*const f32; 2]],
    start: usize,
    weights: *const f32,
    stride: usize,
) {
    let mut weights = weights;
    for row in rows {
        // Safety: the caller's bounds.
        unsafe {
            let v = row[1].add(start);
            let (v0, v1) = (_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(8)));
            for (i, sum) in sums.iter_mut().enumerate() {
                let e = _mm256_broadcast_ss(&*weights.add(i));
                sum[0] = _mm256_fmadd_ps(e, v0, sum[0]);
                sum[1] = _mm256_fmadd_ps(e, v1, sum[1]);
            }
            weights = weights.wrapping_add(stride);
        }
    }
}

/// A thread's scratch for one call: the scores, and where each key's row and value row of the
/// group start (asked of `kv` once per key). At 4096 keys 128 and 64 KiB, which a fresh
/// allocation per call would map and fault in anew.
#[derive(Default)]
struct Scratch {
    scores: Vec<[f32; HEAD_LANES]>,
    rows: Vec<[*const f32; 2]>,
}

std::thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
}

/// The thread's scratch filled for one call whose rows live for `'a`: taken out of the
/// thread's slot and put back when dropped (a call nested in `kv` finds an empty slot and
/// allocates its own).
pub(super) struct CallScratch<'a> {
    /// `scores[t * passes + p]`: key `first + t` with the heads of pass p (zero until written).
    pub(super) scores: Vec<[f32; HEAD_LANES]>,
    /// Where key `first + t`'s row and value row start.
    rows: Vec<[*const f32; 2]>,
    d: usize,
    _rows: PhantomData<&'a [f32]>,
}

impl<'a> CallScratch<'a> {
    /// The rows of `keys` from `kv` (each `d` values, checked) and room for their scores.
    pub(super) fn gather(
        keys: std::ops::RangeInclusive<usize>,
        kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
        d: usize,
        passes: usize,
    ) -> Self {
        let Scratch {
            mut scores,
            mut rows,
        } = SCRATCH.take();
        rows.clear();
        rows.extend(keys.map(|j| {
            let (k, v) = kv(j);
            assert!(
                k.len() == d && v.len() == d,
                "a head's key and value hold d values"
            );
            [k.as_ptr(), v.as_ptr()]
        }));
        scores.clear();
        scores.resize(rows.len() * passes, [0.0; HEAD_LANES]);
        CallScratch {
            scores,
            rows,
            d,
            _rows: PhantomData,
        }
    }

    pub(super) fn count(&self) -> usize {
        self.rows.len()
    }

    /// Key `first + t`'s row.
    pub(super) fn key(&self, t: usize) -> &'a [f32] {
        // Safety: the pointer starts a row of d values (checked in `gather`) that `kv` lent for
        // 'a, which this value cannot outlive.
        unsafe { std::slice::from_raw_parts(self.rows[t][0], self.d) }
    }

    /// Key `first + t`'s value row.
    pub(super) fn value(&self, t: usize) -> &'a [f32] {
        // Safety: as in `key`.
        unsafe { std::slice::from_raw_parts(self.rows[t][1], self.d) }
    }
}

impl Drop for CallScratch<'_> {
    fn drop(&mut self) {
        SCRATCH.set(Scratch {
            scores: std::mem::take(&mut self.scores),
            rows: std::mem::take(&mut self.rows),
        });
    }
}

/// The softmax of each pass's heads with their sinks, over `scores` laid out as
/// `CallScratch::scores`: the scores become exponentials, and each pass's denominators are
/// returned (the lanes code's operations in its order).
#[target_feature(enable = "avx2,fma")]
pub(super) fn softmax(
    group: &Group,
    scores: &mut [[f32; HEAD_LANES]],
    passes: usize,
) -> Vec<[f32; HEAD_LANES]> {
    let mut denominators = vec![[0f32; HEAD_LANES]; passes];
    for (p, denominator) in denominators.iter_mut().enumerate() {
        let sink = group.pass_sinks(p);
        // Safety (each): the arrays hold 8 floats.
        let sink = unsafe { _mm256_loadu_ps(sink.as_ptr()) };
        let mut max = sink;
        for row in scores.iter().skip(p).step_by(passes) {
            // `row > max ? row : max`, as the portable code (NaN never wins).
            max = _mm256_max_ps(unsafe { _mm256_loadu_ps(row.as_ptr()) }, max);
        }
        let mut sum = exp8(_mm256_sub_ps(sink, max));
        for row in scores.iter_mut().skip(p).step_by(passes) {
            let e = exp8(_mm256_sub_ps(unsafe { _mm256_loadu_ps(row.as_ptr()) }, max));
            unsafe { _mm256_storeu_ps(row.as_mut_ptr(), e) };
            sum = _mm256_add_ps(sum, e);
        }
        unsafe { _mm256_storeu_ps(denominator.as_mut_ptr(), sum) };
    }
    denominators
}

/// `super::exp` on 8 lanes: the same operations in the same order.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8(x: __m256) -> __m256 {
    // `x > HIGHEST ? HIGHEST : x` (a NaN stays).
    let clamped = _mm256_min_ps(_mm256_set1_ps(EXP_HIGHEST), x);
    let round = _mm256_set1_ps(EXP_ROUND);
    let shifted = _mm256_add_ps(
        _mm256_mul_ps(clamped, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        round,
    );
    let n = _mm256_sub_ps(shifted, round);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(clamped, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HIGH))),
        _mm256_mul_ps(n, _mm256_set1_ps(LN2_LOW)),
    );
    let mut p = _mm256_set1_ps(EXP_POLYNOMIAL[0]);
    for &c in &EXP_POLYNOMIAL[1..] {
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    }
    let e_r = _mm256_add_ps(
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r),
        _mm256_set1_ps(1.0),
    );
    let n_bits = _mm256_sub_epi32(
        _mm256_castps_si256(shifted),
        _mm256_set1_epi32(EXP_ROUND.to_bits() as i32),
    );
    let two_n = _mm256_slli_epi32::<23>(_mm256_add_epi32(n_bits, _mm256_set1_epi32(127)));
    let e = _mm256_mul_ps(e_r, _mm256_castsi256_ps(two_n));
    // 0 below LOWEST (`x < LOWEST`: false for NaN).
    let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LOWEST));
    _mm256_andnot_ps(below, e)
}

/// The value sums of `heads` rows of `rows` (each `d` values) at dimensions `start..start + 16`
/// (zero for the quad's heads past them).
///
/// # Safety
/// AVX; `rows` holds `heads` rows of `d` values and `start + 16 <= d`.
#[target_feature(enable = "avx")]
#[inline]
unsafe fn load_sums(
    rows: &[f32],
    d: usize,
    start: usize,
    heads: usize,
) -> [[__m256; 2]; VALUE_HEADS] {
    assert!(rows.len() >= heads * d && start + VALUE_WIDTH <= d);
    std::array::from_fn(|h| {
        if h < heads {
            let p = rows[h * d + start..].as_ptr();
            // Safety: 16 values from p are in bounds (asserted above).
            unsafe { [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))] }
        } else {
            [_mm256_setzero_ps(); 2]
        }
    })
}

/// Stores `load_sums`' registers back.
///
/// # Safety
/// As `load_sums`.
#[target_feature(enable = "avx")]
#[inline]
unsafe fn store_sums(
    sums: &[[__m256; 2]; VALUE_HEADS],
    rows: &mut [f32],
    d: usize,
    start: usize,
    heads: usize,
) {
    assert!(rows.len() >= heads * d && start + VALUE_WIDTH <= d);
    for (h, [a, b]) in sums.iter().enumerate().take(heads) {
        let p = rows[h * d + start..].as_mut_ptr();
        // Safety: 16 values from p are in bounds (asserted above).
        unsafe {
            _mm256_storeu_ps(p, *a);
            _mm256_storeu_ps(p.add(8), *b);
        }
    }
}
