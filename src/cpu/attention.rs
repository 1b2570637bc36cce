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
    let d = layout.head_dim;
    for (h, oh) in out.chunks_exact_mut(d).enumerate().take(layout.num_heads) {
        attend_head(layout, h, q, keys.clone(), &kv, sinks[h], scaling, oh);
    }
}

/// Head `h` of `attend`: its output `oh` (`head_dim` values). Scores are dot products of the
/// CPU tier's float kernel (the same summation order for every position and batch).
#[allow(clippy::too_many_arguments)]
pub fn attend_head<'a>(
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
    let g = h / (layout.num_heads / layout.num_kv_heads);
    let qh = &q[h * d..(h + 1) * d];
    let dot = super::simd::float_dot(super::simd::kernels());
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

#[cfg(test)]
mod tests {
    use super::*;

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
