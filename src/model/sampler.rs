//! Choosing tokens from logits.

/// The index of the largest logit (the first one on ties, as torch.argmax). NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest logits as `(id, logit)`, largest first (lower id first on ties).
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_by(order);
    ids.into_iter().map(|i| (i as u32, logits[i])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.25]), 1);
    }

    #[test]
    fn top_k_is_sorted_descending() {
        let top = top_k(&[0.5, 2.0, -1.0, 2.0, 1.0], 3);
        assert_eq!(top, vec![(1, 2.0), (3, 2.0), (4, 1.0)]);
        assert_eq!(top_k(&[1.0, 2.0], 5).len(), 2);
    }
}
