//! Causal attention with per-head sinks and optional sliding window, for one query position.

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
/// `kv(j) -> (k, v)`, each `[num_kv_heads * head_dim]`. The sink of head `h` joins the softmax as
/// an extra logit with no value. Query head `h` reads kv head `h / (num_heads / num_kv_heads)`.
pub fn attend<'a>(
    layout: HeadLayout,
    q: &[f32],
    keys: std::ops::RangeInclusive<usize>,
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    sinks: &[f32],
    scaling: f32,
    out: &mut [f32],
) {
    let group_width = layout.heads_per_kv_head() * layout.head_dim;
    for (g, out) in out
        .chunks_exact_mut(group_width)
        .enumerate()
        .take(layout.num_kv_heads)
    {
        attend_group(layout, g, q, keys.clone(), &kv, sinks, scaling, out);
    }
}

impl HeadLayout {
    /// Query heads that share one kv head.
    pub fn heads_per_kv_head(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }
}

/// Keys ahead of the one being read whose rows `attend_group` asks the cache for: a head's rows
/// lie a whole position apart, a stride the hardware prefetchers follow late.
const PREFETCH_KEYS: usize = 8;

/// The query heads of kv head `g` in `attend`: their outputs `out` (`heads_per_kv_head *
/// head_dim` values), from `q` and `sinks` of every head. The group's heads go together, so that
/// each key and value is read once for all of them (the cache a long context holds no longer
/// fits near the core: one head at a time read it once per head). Each head's values are the
/// ones it gets alone: its scores are dot products of the CPU tier's float kernel (the same
/// summation order for every position, batch and group), and its softmax and weighted sum run
/// over the keys in order.
#[allow(clippy::too_many_arguments)]
pub fn attend_group<'a>(
    layout: HeadLayout,
    g: usize,
    q: &[f32],
    keys: std::ops::RangeInclusive<usize>,
    kv: &impl Fn(usize) -> (&'a [f32], &'a [f32]),
    sinks: &[f32],
    scaling: f32,
    out: &mut [f32],
) {
    let (d, per_group) = (layout.head_dim, layout.heads_per_kv_head());
    let heads = g * per_group..(g + 1) * per_group;
    let queries: Vec<&[f32]> = heads.clone().map(|h| &q[h * d..(h + 1) * d]).collect();
    let dot_each = super::simd::float_dot_each(super::simd::kernels());
    // scores[j * per_group + i]: key j with head i of the group.
    let count = keys.clone().count();
    let mut scores = vec![0f32; count * per_group];
    let last = *keys.end();
    for (j, row) in keys.clone().zip(scores.chunks_exact_mut(per_group)) {
        if j + PREFETCH_KEYS <= last {
            super::simd::prefetch(&kv(j + PREFETCH_KEYS).0[g * d..(g + 1) * d]);
        }
        let kh = &kv(j).0[g * d..(g + 1) * d];
        dot_each(
            crate::weights::FloatFormat::F32,
            bytemuck::cast_slice(kh),
            &queries,
            row,
        );
        for s in row.iter_mut() {
            *s *= scaling;
        }
    }
    // Per head: the softmax with its sink, in key order.
    let mut denominators = Vec::with_capacity(per_group);
    for (i, h) in heads.enumerate() {
        let sink = sinks[h];
        let max = scores[i..]
            .iter()
            .step_by(per_group)
            .copied()
            .fold(sink, f32::max);
        let mut denominator = (sink - max).exp();
        for s in scores[i..].iter_mut().step_by(per_group) {
            let e = (*s - max).exp();
            denominator += e;
            *s = e;
        }
        denominators.push(denominator);
    }
    out.fill(0.0);
    for (j, weights) in keys.zip(scores.chunks_exact(per_group)) {
        if j + PREFETCH_KEYS <= last {
            super::simd::prefetch(&kv(j + PREFETCH_KEYS).1[g * d..(g + 1) * d]);
        }
        let vh = &kv(j).1[g * d..(g + 1) * d];
        for ((oh, e), denominator) in out.chunks_exact_mut(d).zip(weights).zip(&denominators) {
            let p = e / denominator;
            for (o, v) in oh.iter_mut().zip(vh) {
                *o += p * v;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Head `h` of `attend` computed alone, the way the CPU tier did before heads were grouped:
    /// the reference `attend_group` must match bit for bit.
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
        let dot = crate::cpu::simd::float_dot(crate::cpu::simd::kernels());
        let scores: Vec<f32> = keys
            .clone()
            .map(|j| {
                let kh = &kv(j).0[g * d..(g + 1) * d];
                dot(
                    crate::weights::FloatFormat::F32,
                    bytemuck::cast_slice(kh),
                    qh,
                ) * scaling
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
            &[0.5],
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
            &[-1e4],
            1.0,
            &mut out,
        );
        assert_eq!(out, [3.0, -1.0]);
    }

    #[test]
    fn a_group_of_heads_gives_each_head_its_own_values() {
        // GPT-OSS's grouping (8 query heads per kv head), keys from one to past the prefetch
        // distance, sinks that win and sinks that vanish.
        let layout = HeadLayout {
            num_heads: 16,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let kvd = layout.num_kv_heads * layout.head_dim;
        let value = |i: usize, seed: usize| ((i * seed + 11) % 97) as f32 * 0.02 - 0.97;
        let keys: Vec<f32> = (0..40 * kvd).map(|i| value(i, 31)).collect();
        let values: Vec<f32> = (0..40 * kvd).map(|i| value(i, 57)).collect();
        let q: Vec<f32> = (0..layout.num_heads * layout.head_dim)
            .map(|i| value(i, 13))
            .collect();
        let sinks: Vec<f32> = (0..layout.num_heads)
            .map(|h| [0.3, 5.0, -1e4, -0.7][h % 4])
            .collect();
        let kv = |j: usize| {
            (
                &keys[j * kvd..(j + 1) * kvd],
                &values[j * kvd..(j + 1) * kvd],
            )
        };
        for range in [0..=0, 3..=9, 0..=39] {
            let mut grouped = vec![0f32; layout.num_heads * layout.head_dim];
            attend(layout, &q, range.clone(), kv, &sinks, 0.125, &mut grouped);
            for (h, got) in grouped.chunks_exact(layout.head_dim).enumerate() {
                let mut alone = vec![0f32; layout.head_dim];
                attend_head(
                    layout,
                    h,
                    &q,
                    range.clone(),
                    &kv,
                    sinks[h],
                    0.125,
                    &mut alone,
                );
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&alone), "head {h}, keys {range:?}");
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
            &[-1e4; 4],
            1.0,
            &mut out,
        );
        assert_eq!(out, [10.0, 10.0, 20.0, 20.0]);
    }
}
