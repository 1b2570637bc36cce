//! Causal attention with per-head sinks and optional sliding window, for one query position.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

/// Heads layout shared by the attention kernels.
#[derive(Debug, Clone, Copy)]
pub struct HeadLayout {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

/// The first key position a query at `position` may see: all of them, or the last `window`
/// (the query's own key included, i.e. `position - j < window`).
pub fn first_visible_key(position: usize, window: Option<usize>) -> usize {
    match window {
        Some(w) => (position + 1).saturating_sub(w),
        None => 0,
    }
}

/// Attention output of one query position, all heads.
///
/// `q` is `[num_heads * head_dim]`; keys and values of positions `first..=last` come from
/// `kv(j) -> (k, v)`, each `[num_kv_heads * head_dim]`. The sink of head `h`, where the model has
/// sinks, joins the softmax as an extra logit with no value. Query head `h` reads kv head
/// `h / (num_heads / num_kv_heads)`.
pub fn attend<'a>(
    layout: HeadLayout,
    q: &[f32],
    keys: std::ops::RangeInclusive<usize>,
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    sinks: Option<&[f32]>,
    scaling: f32,
    out: &mut [f32],
) {
    let group_width = layout.heads_per_kv_head() * layout.head_dim;
    for (g, out) in out
        .chunks_exact_mut(group_width)
        .enumerate()
        .take(layout.num_kv_heads)
    {
        let head = head_rows(&kv, g, layout.head_dim);
        attend_group(layout, g, q, keys.clone(), &head, sinks, scaling, out);
    }
}

impl HeadLayout {
    /// Query heads that share one kv head.
    pub fn heads_per_kv_head(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// Keys ahead of the one being read whose rows `attend_group` asks the cache for: the block's own
/// keys lie a whole position apart, and the cache's come in chunks of 64 positions, strides and
/// jumps the hardware prefetchers follow late.
const PREFETCH_KEYS: usize = 8;

/// Query heads scored side by side, one per lane: GPT-OSS and Qwen3-MoE have 8 per kv head (a
/// group with fewer leaves lanes idle; one with more takes several passes).
const HEAD_LANES: usize = 8;

/// The query heads of kv head `g` in `attend`: their outputs `out` (`heads_per_kv_head *
/// head_dim` values), from `q` and `sinks` of every head, and kv head g's key and value at each
/// position `j` of `keys` from `kv(j)` (`head_dim` values each). The group's heads go together,
/// so that each key and value is read once for all of them (the cache a long context holds no
/// longer fits near the core), with the heads in SIMD lanes: each key element times every head's
/// query element in one multiply-add, then the softmax of all heads' scores at once. Every
/// position, batch and group sums in the same order, so prefill and decode give the same bits.
#[allow(clippy::too_many_arguments)]
pub fn attend_group<'a>(
    layout: HeadLayout,
    g: usize,
    q: &[f32],
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    sinks: Option<&[f32]>,
    scaling: f32,
    out: &mut [f32],
) {
    let group = Group {
        layout,
        g,
        q,
        sinks,
        scaling,
    };
    attend_group_on(super::simd::kernels(), group, keys, kv, out)
}

/// `attend_group` with the kernels of `kernels` (the portable build where the CPU lacks them).
fn attend_group_on<'a>(
    kernels: super::simd::CpuKernels,
    group: Group,
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    match kernels.min(super::simd::detect()) {
        // Safety (each): `detect()` found the features the function enables.
        #[cfg(target_arch = "x86_64")]
        super::simd::CpuKernels::Avx512 => unsafe {
            if avx512::takes(group.layout.head_dim) && !keys.is_empty() {
                avx512::attend_group(group, keys, kv, out)
            } else {
                attend_group_avx512(group, keys, kv, out)
            }
        },
        #[cfg(target_arch = "x86_64")]
        super::simd::CpuKernels::Avx2 => unsafe {
            if avx2::takes(group.layout.head_dim) && !keys.is_empty() {
                avx2::attend_group(group, keys, kv, out)
            } else {
                attend_group_avx2(group, keys, kv, out)
            }
        },
        // NEON and fused multiply-adds are part of every aarch64 CPU: the portable build is
        // already vectorized.
        #[cfg(target_arch = "aarch64")]
        super::simd::CpuKernels::Neon => attend_group_with::<true>(group, keys, kv, out),
        _ => attend_group_with::<false>(group, keys, kv, out),
    }
}

/// What `attend_group` reads besides the keys and values.
#[derive(Clone, Copy)]
struct Group<'q> {
    layout: HeadLayout,
    g: usize,
    q: &'q [f32],
    sinks: Option<&'q [f32]>,
    scaling: f32,
}

impl Group<'_> {
    /// The head size, the group's heads, and the passes of `HEAD_LANES` heads they take.
    fn sizes(&self) -> (usize, usize, usize) {
        let per_group = self.layout.heads_per_kv_head();
        (
            self.layout.head_dim,
            per_group,
            per_group.div_ceil(HEAD_LANES),
        )
    }

    /// The sinks of pass p's heads, one per lane (zero in lanes past the group's heads). Without
    /// sinks, -inf: its exponential is exactly 0, and it never wins the max.
    fn pass_sinks(&self, p: usize) -> [f32; HEAD_LANES] {
        let (_, per_group, _) = self.sizes();
        std::array::from_fn(|l| {
            let i = p * HEAD_LANES + l;
            match self.sinks {
                _ if i >= per_group => 0.0,
                Some(sinks) => sinks[self.g * per_group + i],
                None => f32::NEG_INFINITY,
            }
        })
    }
}

/// Each head's output row of `out` (`d` values) divided by its softmax denominator (lane `h %
/// 8` of pass `h / 8`).
fn divide_by_denominators(out: &mut [f32], d: usize, denominators: &[[f32; HEAD_LANES]]) {
    for (i, o) in out.chunks_exact_mut(d).enumerate() {
        let denominator = denominators[i / HEAD_LANES][i % HEAD_LANES];
        for o in o {
            *o /= denominator;
        }
    }
}

/// Kv head g's rows (`d` values each) of a `kv` that gives every kv head's at a position.
fn head_rows<'a>(
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    g: usize,
    d: usize,
) -> impl Fn(usize) -> (&'a [f32], &'a [f32]) {
    move |j| {
        let (k, v) = kv(j);
        (&k[g * d..(g + 1) * d], &v[g * d..(g + 1) * d])
    }
}

/// `attend_group_with` compiled for AVX-512 (16 lanes a vector, fused multiply-adds).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn attend_group_avx512<'a>(
    group: Group,
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    attend_group_with::<true>(group, keys, kv, out)
}

/// `attend_group_with` compiled for AVX2 with FMA.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_group_avx2<'a>(
    group: Group,
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    attend_group_with::<true>(group, keys, kv, out)
}

/// The group's queries transposed, one lane per head: `query[p * d + c][l]` is element c of head
/// 8 p + l of the group (zero in lanes past the group's heads).
fn transposed_query(group: &Group) -> Vec<[f32; HEAD_LANES]> {
    let (d, per_group, passes) = group.sizes();
    let mut query = vec![[0f32; HEAD_LANES]; passes * d];
    for i in 0..per_group {
        let (p, l) = (i / HEAD_LANES, i % HEAD_LANES);
        let head = group.g * per_group + i;
        for (c, &x) in group.q[head * d..(head + 1) * d].iter().enumerate() {
            query[p * d + c][l] = x;
        }
    }
    query
}

/// `a * b + c`, rounded once where `FUSED` (the SIMD builds, which have the instruction), twice
/// in the portable build (where `mul_add` would be a slow library call).
#[inline(always)]
fn multiply_add<const FUSED: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FUSED { a.mul_add(b, c) } else { a * b + c }
}

/// `attend_group`'s body, written in lanes for the compiler to vectorize in each build.
#[inline(always)]
fn attend_group_with<'a, const FUSED: bool>(
    group: Group,
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    out: &mut [f32],
) {
    let (d, _, passes) = group.sizes();
    let scaling = group.scaling;
    let query = transposed_query(&group);
    // scores[j * passes + p][l]: key j with head 8 p + l.
    let count = keys.clone().count();
    let mut scores = vec![[0f32; HEAD_LANES]; count * passes];
    let last = *keys.end();
    for (j, row) in keys.clone().zip(scores.chunks_exact_mut(passes)) {
        if j + PREFETCH_KEYS <= last {
            super::simd::prefetch(kv(j + PREFETCH_KEYS).0);
        }
        let key = kv(j).0;
        for (scores, query) in row.iter_mut().zip(query.chunks_exact(d)) {
            // Running sums of elements c mod 8: enough independent multiply-adds in flight to
            // cover each one's latency.
            let mut sums = [[0f32; HEAD_LANES]; 8];
            let mut pairs = key.chunks_exact(8).zip(query.chunks_exact(8));
            for (k8, q8) in &mut pairs {
                for u in 0..8 {
                    for l in 0..HEAD_LANES {
                        sums[u][l] = multiply_add::<FUSED>(k8[u], q8[u][l], sums[u][l]);
                    }
                }
            }
            let tail = key.len() / 8 * 8;
            for (&k, q) in key[tail..].iter().zip(&query[tail..]) {
                for l in 0..HEAD_LANES {
                    sums[0][l] = multiply_add::<FUSED>(k, q[l], sums[0][l]);
                }
            }
            let [a, b, c, e, f, g, h, i] = sums;
            let add = |x: [f32; HEAD_LANES], y: [f32; HEAD_LANES]| -> [f32; HEAD_LANES] {
                std::array::from_fn(|l| x[l] + y[l])
            };
            let total = add(add(add(a, b), add(c, e)), add(add(f, g), add(h, i)));
            *scores = std::array::from_fn(|l| total[l] * scaling);
        }
    }
    // The softmax of each head with its sink, all heads in lanes: scores become exponentials.
    let mut denominators = vec![[0f32; HEAD_LANES]; passes];
    for (p, denominator) in denominators.iter_mut().enumerate() {
        let sink = group.pass_sinks(p);
        let mut max = sink;
        for row in scores.iter().skip(p).step_by(passes) {
            // NaN never wins, as with f32::max.
            max = std::array::from_fn(|l| if row[l] > max[l] { row[l] } else { max[l] });
        }
        let mut sum: [f32; HEAD_LANES] = std::array::from_fn(|l| exp(sink[l] - max[l]));
        for row in scores.iter_mut().skip(p).step_by(passes) {
            *row = std::array::from_fn(|l| exp(row[l] - max[l]));
            sum = std::array::from_fn(|l| sum[l] + row[l]);
        }
        *denominator = sum;
    }
    // Each head's exponential-weighted sum of the values, in key order, then one division.
    out.fill(0.0);
    for (j, row) in keys.zip(scores.chunks_exact(passes)) {
        if j + PREFETCH_KEYS <= last {
            super::simd::prefetch(kv(j + PREFETCH_KEYS).1);
        }
        let value = kv(j).1;
        for (i, o) in out.chunks_exact_mut(d).enumerate() {
            let e = row[i / HEAD_LANES][i % HEAD_LANES];
            for (o, &v) in o.iter_mut().zip(value) {
                *o = multiply_add::<FUSED>(e, v, *o);
            }
        }
    }
    divide_by_denominators(out, d, &denominators);
}

/// e^x within 1 ulp (0.98 at worst over the range, by test), branch-free so that loops of it
/// vectorize (libm's `expf` is a call per value): x = n ln 2 + r with |r| <= ln 2 / 2, e^r by a
/// degree-7 polynomial (Cephes' `expf` coefficients), 2^n put straight into the exponent bits.
/// Below ln 2^-126 the result would be subnormal and is 0; from 88.38 (of 88.72 where f32
/// overflows) it is infinite; NaN stays NaN.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let clamped = if x > EXP_HIGHEST { EXP_HIGHEST } else { x };
    let shifted = clamped * std::f32::consts::LOG2_E + EXP_ROUND;
    let n = shifted - EXP_ROUND;
    let r = (clamped - n * LN2_HIGH) - n * LN2_LOW;
    let mut p = EXP_POLYNOMIAL[0];
    for &c in &EXP_POLYNOMIAL[1..] {
        p = p * r + c;
    }
    let e_r = (p * r) * r + r + 1.0;
    let n_bits = shifted.to_bits().wrapping_sub(EXP_ROUND.to_bits());
    let e = e_r * f32::from_bits(n_bits.wrapping_add(127) << 23);
    let keep = if x < EXP_LOWEST { 0 } else { u32::MAX };
    f32::from_bits(e.to_bits() & keep)
}

/// ln 2 in two parts (`exp`), the first with few enough bits that n times it is exact.
const LN2_HIGH: f32 = 0.693_359_4;
const LN2_LOW: f32 = -2.121_944_4e-4;
/// Adding 1.5 * 2^23 rounds to an integer, which the low bits of the sum then hold.
const EXP_ROUND: f32 = 12_582_912.0;
/// ln 2^-126: below it `exp` is 0.
const EXP_LOWEST: f32 = -87.336_55;
/// n = 128 past it: 2^n is infinite.
const EXP_HIGHEST: f32 = 88.5;
/// e^r - 1 - r = r^2 (c0 r^5 + c1 r^4 + ... + c5), Cephes' `expf` coefficients.
const EXP_POLYNOMIAL: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Head `h` of `attend` computed alone and plainly (libm's `exp`, a division per weight):
    /// the oracle `attend_group` is compared with.
    #[allow(clippy::too_many_arguments)]
    fn attend_head<'a>(
        layout: HeadLayout,
        h: usize,
        q: &[f32],
        keys: std::ops::RangeInclusive<usize>,
        kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
        sink: f32,
        scaling: f32,
        oh: &mut [f32],
    ) {
        let d = layout.head_dim;
        let g = h / layout.heads_per_kv_head();
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f32> = keys
            .clone()
            .map(|j| {
                let kh = &kv(j).0[g * d..(g + 1) * d];
                kh.iter().zip(qh).map(|(k, q)| k * q).sum::<f32>() * scaling
            })
            .collect();
        let max = scores.iter().copied().fold(sink, f32::max);
        let mut denominator = (sink - max).exp();
        let weights: Vec<f32> = scores
            .iter()
            .map(|s| {
                let e = (s - max).exp();
                denominator += e;
                e
            })
            .collect();
        oh.fill(0.0);
        for (e, j) in weights.iter().zip(keys) {
            let p = e / denominator;
            let vh = &kv(j).1[g * d..(g + 1) * d];
            for (o, v) in oh.iter_mut().zip(vh) {
                *o += p * v;
            }
        }
    }

    #[test]
    fn exp_is_within_one_ulp_of_the_exact_value() {
        let ulps = |x: f32| {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            // The spacing of f32 values at `want`.
            let ulp = (want as f32).next_up() as f64 - want as f32 as f64;
            (got - want).abs() / ulp
        };
        let mut worst = (0f64, 0f32);
        let mut x = -87.3f32;
        while x < 88.3 {
            let u = ulps(x);
            if u > worst.0 {
                worst = (u, x);
            }
            x += 1.3e-4;
        }
        assert!(worst.0 <= 1.0, "{} ulp at x = {}", worst.0, worst.1);
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-88.0), 0.0, "subnormal results are 0");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    #[test]
    fn window_holds_w_keys_including_the_query() {
        assert_eq!(first_visible_key(0, Some(4)), 0);
        assert_eq!(first_visible_key(3, Some(4)), 0);
        assert_eq!(first_visible_key(4, Some(4)), 1); // 4 - 0 = 4 is not < 4
        assert_eq!(first_visible_key(10, Some(4)), 7);
        assert_eq!(first_visible_key(10, None), 0);
    }

    #[test]
    fn sink_takes_its_share_of_the_softmax() {
        // One head, one key: weight = e^s / (e^s + e^sink).
        let layout = HeadLayout {
            num_heads: 1,
            num_kv_heads: 1,
            head_dim: 2,
        };
        let q = [1.0f32, 0.0];
        let k = [2.0f32, 0.0];
        let v = [3.0f32, -1.0];
        let mut out = [0f32; 2];
        attend(
            layout,
            &q,
            0..=0,
            |_| (&k[..], &v[..]),
            Some(&[0.5]),
            1.0,
            &mut out,
        );
        let w = (2.0f64.exp() / (2.0f64.exp() + 0.5f64.exp())) as f32;
        assert!(
            (out[0] - 3.0 * w).abs() < 1e-6 && (out[1] + w).abs() < 1e-6,
            "{out:?}"
        );
        // A very negative sink vanishes: plain softmax over keys.
        attend(
            layout,
            &q,
            0..=0,
            |_| (&k[..], &v[..]),
            Some(&[-1e4]),
            1.0,
            &mut out,
        );
        assert_eq!(out, [3.0, -1.0]);
        // No sinks (Qwen3): the plain softmax, exactly.
        out = [f32::NAN; 2];
        attend(layout, &q, 0..=0, |_| (&k[..], &v[..]), None, 1.0, &mut out);
        assert_eq!(out, [3.0, -1.0]);
    }

    #[test]
    #[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error must count as a failure
    fn every_kernel_build_of_a_group_matches_each_head_alone() {
        use crate::cpu::simd::{CpuKernels, detect};
        // GPT-OSS's grouping (8 query heads per kv head), one that fills part of the lanes and
        // one that takes two passes; keys from one to past the prefetch distance; sinks that
        // win and sinks that vanish; head sizes with and without a tail.
        for (num_heads, num_kv_heads, head_dim) in
            [(16, 2, 64), (6, 2, 12), (24, 1, 20), (12, 1, 32)]
        {
            let layout = HeadLayout {
                num_heads,
                num_kv_heads,
                head_dim,
            };
            let kvd = num_kv_heads * head_dim;
            let value = |i: usize, seed: usize| ((i * seed + 11) % 97) as f32 * 0.02 - 0.97;
            let keys: Vec<f32> = (0..150 * kvd).map(|i| value(i, 31)).collect();
            let values: Vec<f32> = (0..150 * kvd).map(|i| value(i, 57)).collect();
            let q: Vec<f32> = (0..num_heads * head_dim).map(|i| value(i, 13)).collect();
            let sinks: Vec<f32> = (0..num_heads)
                .map(|h| [0.3, 5.0, -1e4, -0.7][h % 4])
                .collect();
            let kv = |j: usize| {
                (
                    &keys[j * kvd..(j + 1) * kvd],
                    &values[j * kvd..(j + 1) * kvd],
                )
            };
            let levels = [
                CpuKernels::Scalar,
                CpuKernels::Avx2,
                CpuKernels::Avx512,
                CpuKernels::Neon,
            ];
            // The portable build and each SIMD build this CPU has.
            let has = |k: CpuKernels| {
                k == CpuKernels::Scalar
                    || k == detect()
                    || (k < detect() && detect() != CpuKernels::Neon)
            };
            let cases = levels
                .into_iter()
                .filter(|&k| has(k))
                .flat_map(|k| [(k, Some(&sinks[..])), (k, None)]);
            for (kernels, sinks) in cases {
                // Past one block of the AVX-512 kernel's value loop (64 keys) too.
                for range in [0..=0, 3..=9, 0..=39, 5..=149] {
                    let width = layout.heads_per_kv_head() * head_dim;
                    let mut grouped = vec![0f32; num_heads * head_dim];
                    for (g, out) in grouped.chunks_exact_mut(width).enumerate() {
                        let group = Group {
                            layout,
                            g,
                            q: &q,
                            sinks,
                            scaling: 0.125,
                        };
                        let head = head_rows(&kv, g, head_dim);
                        attend_group_on(kernels, group, range.clone(), &head, out);
                    }
                    let mut alone = vec![0f32; num_heads * head_dim];
                    for (h, oh) in alone.chunks_exact_mut(head_dim).enumerate() {
                        let sink = sinks.map_or(f32::NEG_INFINITY, |s| s[h]);
                        attend_head(layout, h, &q, range.clone(), &kv, sink, 0.125, oh);
                    }
                    // |got - want| <= atol + rtol |want|, every value; report the worst.
                    let (atol, rtol) = (2e-6, 1e-5);
                    let errors: Vec<f32> = grouped
                        .iter()
                        .zip(&alone)
                        .map(|(g, a)| (g - a).abs())
                        .collect();
                    let failures = errors
                        .iter()
                        .zip(&alone)
                        .filter(|(e, a)| !(**e <= atol + rtol * a.abs()))
                        .count();
                    let worst = (0..errors.len())
                        .max_by(|&a, &b| errors[a].total_cmp(&errors[b]))
                        .unwrap();
                    assert_eq!(
                        failures, 0,
                        "{kernels:?}, {layout:?}, keys {range:?}: max |error| {} at {worst} (got {}, \
                         want {})",
                        errors[worst], grouped[worst], alone[worst]
                    );
                }
            }
        }
    }

    /// Each intrinsics kernel adds the same products in the same order as the lanes code
    /// compiled for its CPU level, so every output has the same bits: GPT-OSS's grouping, groups
    /// of 12 heads (two passes, the second partly filled), of 4, of 6 (a partly filled quad of
    /// the AVX2 kernel's value loop) and of 14 (a second pass with a partly filled second quad);
    /// one key, an odd count, a second value block of one key, several value blocks.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_intrinsics_kernels_give_the_lanes_codes_bits() {
        use crate::cpu::simd::{CpuKernels, detect};
        let kernels: [(CpuKernels, Kernel, Kernel); 2] = [
            (
                CpuKernels::Avx2,
                |g, r, kv, o| unsafe { attend_group_avx2(g, r, &kv, o) },
                |g, r, kv, o| unsafe { avx2::attend_group(g, r, &kv, o) },
            ),
            (
                CpuKernels::Avx512,
                |g, r, kv, o| unsafe { attend_group_avx512(g, r, &kv, o) },
                |g, r, kv, o| unsafe { avx512::attend_group(g, r, &kv, o) },
            ),
        ];
        for (level, lanes_code, kernel) in kernels {
            if detect() < level {
                eprintln!("skipped {level:?}: this CPU lacks it");
                continue;
            }
            bits_of_lanes_code_and_kernel(level, lanes_code, kernel);
        }
    }

    /// One `attend_group` build, as the bits test calls it.
    #[cfg(target_arch = "x86_64")]
    type Kernel = for<'a, 'k> unsafe fn(
        Group,
        std::ops::RangeInclusive<usize>,
        &'k dyn Fn(usize) -> (&'a [f32], &'a [f32]),
        &mut [f32],
    );

    /// Every output of `kernel` has the bits of `lanes_code`'s, at `level` (which the CPU has).
    #[cfg(target_arch = "x86_64")]
    fn bits_of_lanes_code_and_kernel(
        level: crate::cpu::simd::CpuKernels,
        lanes_code: Kernel,
        kernel: Kernel,
    ) {
        for (num_heads, num_kv_heads, head_dim) in [
            (64, 8, 64),
            (12, 1, 32),
            (8, 2, 96),
            (4, 1, 32),
            (6, 1, 128),
            (14, 1, 64),
        ] {
            let layout = HeadLayout {
                num_heads,
                num_kv_heads,
                head_dim,
            };
            let kvd = num_kv_heads * head_dim;
            // Irregular values with a spread of magnitudes, so that summation order would show.
            let value = |i: usize, seed: u32| {
                let x = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                ((x >> 8) as f32 / 16_777_216.0 - 0.5) * (1 << (x % 5)) as f32
            };
            let positions = 200;
            let keys: Vec<f32> = (0..positions * kvd).map(|i| value(i, 3)).collect();
            let values: Vec<f32> = (0..positions * kvd).map(|i| value(i, 7)).collect();
            let q: Vec<f32> = (0..num_heads * head_dim).map(|i| value(i, 11)).collect();
            // Sinks that vanish and sinks that win (scores' exponentials below the range of
            // `exp`: 0) too.
            let sinks: Vec<f32> = (0..num_heads)
                .map(|h| [value(h, 13), -1e4, 1e4][h % 3])
                .collect();
            let kv = |j: usize| {
                (
                    &keys[j * kvd..(j + 1) * kvd],
                    &values[j * kvd..(j + 1) * kvd],
                )
            };
            let width = layout.heads_per_kv_head() * head_dim;
            let cases = [7..=7, 0..=8, 0..=64, 3..=199]
                .into_iter()
                .flat_map(|range| [(range.clone(), Some(&sinks[..])), (range, None)]);
            for (range, sinks) in cases {
                for g in 0..num_kv_heads {
                    let group = Group {
                        layout,
                        g,
                        q: &q,
                        sinks,
                        scaling: 0.125,
                    };
                    // The kernel's output starts as NaN: it must write every value before reading
                    // it back.
                    let (mut lanes, mut kernel_out) = (vec![0f32; width], vec![f32::NAN; width]);
                    let head = head_rows(&kv, g, head_dim);
                    // Safety (both): the CPU has the kernels' level (checked by the caller).
                    unsafe {
                        lanes_code(group, range.clone(), &head, &mut lanes);
                        kernel(group, range.clone(), &head, &mut kernel_out);
                    }
                    let differ = (0..width)
                        .filter(|&i| lanes[i].to_bits() != kernel_out[i].to_bits())
                        .collect::<Vec<_>>();
                    assert!(
                        differ.is_empty(),
                        "{level:?}, {layout:?}, group {g}, keys {range:?}: {} of {width} values \
                         differ, first at {} (lanes {}, kernel {})",
                        differ.len(),
                        differ[0],
                        lanes[differ[0]],
                        kernel_out[differ[0]]
                    );
                }
            }
        }
    }

    #[test]
    fn grouped_query_heads_read_their_kv_head() {
        let layout = HeadLayout {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 1,
        };
        let q = [1.0f32; 4];
        let k = [0.0f32, 0.0];
        let v = [10.0f32, 20.0];
        let mut out = [0f32; 4];
        attend(
            layout,
            &q,
            0..=0,
            |_| (&k[..], &v[..]),
            Some(&[-1e4; 4]),
            1.0,
            &mut out,
        );
        assert_eq!(out, [10.0, 10.0, 20.0, 20.0]);
    }
}
