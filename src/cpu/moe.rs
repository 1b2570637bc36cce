//! Router top-k and the clamped SwiGLU of GPT-OSS experts.

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
    fn swiglu_clamps_gate_above_and_up_both_sides() {
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        let mut out = [0f32; 3];
        clamped_swiglu(&[10.0, 10.0, -10.0, -10.0, 1.0, 0.5], 1.702, 7.0, &mut out);
        assert_eq!(out[0], (7.0 + 1.0) * 7.0 * sig(7.0 * 1.702)); // gate and up clamped to 7
        assert_eq!(out[1], (-7.0 + 1.0) * -10.0 * sig(-10.0 * 1.702)); // gate not clamped below
        assert_eq!(out[2], (0.5 + 1.0) * 1.0 * sig(1.702));
    }
}
