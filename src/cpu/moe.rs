//! Routers' top-k and the experts' activations: GPT-OSS's top-k-then-softmax and clamped,
//! interleaved SwiGLU; Qwen3-MoE's softmax-then-top-k and plain SwiGLU over gate and up halves.

/// Experts chosen for one token: ids by descending router logit, and their softmax weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Top-k of the router logits (ties go to the lower id) and a softmax over the k selected.
pub fn route(logits: &[f32], k: usize) -> Routing {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    order.truncate(k);
    let max = logits[order[0]];
    let exps: Vec<f32> = order.iter().map(|&e| (logits[e] - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    Routing {
        weights: exps.iter().map(|x| x / sum).collect(),
        experts: order,
    }
}

/// A softmax over all the router logits (f32), then the k largest probabilities (ties to the
/// lower id), divided by their sum where `renormalize`, as transformers' Qwen3-MoE router.
pub fn route_softmax_first(logits: &[f32], k: usize, renormalize: bool) -> Routing {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    let probabilities: Vec<f32> = exps.iter().map(|e| e / sum).collect();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| {
        probabilities[b]
            .total_cmp(&probabilities[a])
            .then(a.cmp(&b))
    });
    order.truncate(k);
    let mut weights: Vec<f32> = order.iter().map(|&e| probabilities[e]).collect();
    if renormalize {
        let chosen: f32 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= chosen);
    }
    Routing {
        experts: order,
        weights,
    }
}

/// `silu(gate) * up` for each row of `rows` gate values then `rows` up values (`[n, 2 rows]`
/// in, `[n, rows]` out), with `silu(g) = g * sigmoid(g)`.
pub fn swiglu(gate_up: &[f32], rows: usize, out: &mut [f32]) {
    for (pair, y) in gate_up
        .chunks_exact(2 * rows)
        .zip(out.chunks_exact_mut(rows))
    {
        let (gate, up) = pair.split_at(rows);
        for ((y, g), u) in y.iter_mut().zip(gate).zip(up) {
            *y = g / (1.0 + (-g).exp()) * u;
        }
    }
}

/// `(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)` with `g = min(gate, l)`, over interleaved
/// `[gate0, up0, gate1, up1, ...]` rows.
pub fn clamped_swiglu(gate_up: &[f32], alpha: f32, limit: f32, out: &mut [f32]) {
    for (pair, y) in gate_up.chunks_exact(2).zip(out.iter_mut()) {
        let gate = pair[0].min(limit);
        let up = pair[1].clamp(-limit, limit);
        let glu = gate * (1.0 / (1.0 + (-(gate * alpha)).exp()));
        *y = (up + 1.0) * glu;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_is_sorted_and_softmaxed_over_the_selection() {
        let r = route(&[0.1, 3.0, -1.0, 2.0, 2.5], 3);
        assert_eq!(r.experts, vec![1, 4, 3]);
        let z: f64 = [3.0f64, 2.5, 2.0].iter().map(|x| x.exp()).sum();
        for (w, l) in r.weights.iter().zip([3.0f64, 2.5, 2.0]) {
            assert!((*w as f64 - l.exp() / z).abs() < 1e-7);
        }
    }

    #[test]
    fn softmax_first_selects_by_probability_and_renormalizes_where_asked() {
        let logits = [0.1f32, 3.0, -1.0, 2.0, 2.5];
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        let p = |l: f64| l.exp() / z;
        let raw = route_softmax_first(&logits, 3, false);
        assert_eq!(raw.experts, vec![1, 4, 3]);
        for (w, l) in raw.weights.iter().zip([3.0, 2.5, 2.0]) {
            assert!((*w as f64 - p(l)).abs() < 1e-7, "{w} vs {}", p(l));
        }
        let normed = route_softmax_first(&logits, 3, true);
        let top: f64 = [3.0, 2.5, 2.0].map(p).iter().sum();
        for (w, l) in normed.weights.iter().zip([3.0, 2.5, 2.0]) {
            assert!((*w as f64 - p(l) / top).abs() < 1e-7);
        }
        // Equal logits: the lower id first.
        assert_eq!(
            route_softmax_first(&[1.0, 2.0, 2.0], 1, true).experts,
            vec![1]
        );
    }

    #[test]
    fn plain_swiglu_takes_gate_then_up_halves() {
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let mut out = [0f32; 4];
        // Two tokens of two units: [gate0, gate1, up0, up1].
        swiglu(&[10.0, -1.0, 2.0, 3.0, 0.0, 1.0, 5.0, 7.0], 2, &mut out);
        let want = [
            10.0 * sig(10.0) * 2.0,
            -sig(-1.0) * 3.0,
            0.0,
            sig(1.0) * 7.0,
        ];
        for (got, want) in out.iter().zip(want) {
            assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "{out:?}");
        }
    }

    #[test]
    fn swiglu_clamps_gate_above_and_up_both_sides() {
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let mut out = [0f32; 3];
        clamped_swiglu(&[10.0, 10.0, -10.0, -10.0, 1.0, 0.5], 1.702, 7.0, &mut out);
        assert_eq!(out[0], (7.0 + 1.0) * 7.0 * sig(7.0 * 1.702)); // gate and up clamped to 7
        assert_eq!(out[1], (-7.0 + 1.0) * -10.0 * sig(-10.0 * 1.702)); // gate not clamped below
        assert_eq!(out[2], (0.5 + 1.0) * 1.0 * sig(1.702));
    }
}
