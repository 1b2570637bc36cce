//! Choosing tokens from logits.

/// The index of the largest logit (the first one on ties, as torch.argmax). NaN never wins over a
/// number.
pub fn argmax(logits: &[f32]) -> u32 {
    // The largest value NaNs aside (`f32::max` skips them), then where it first occurs: two
    // plain passes, which vectorize, where one compare-and-branch loop over GPT-OSS's
    // vocabulary did not (and every decoded token asks for it).
    let max = logits.iter().copied().fold(f32::NAN, f32::max);
    if max.is_nan() {
        // Nothing but NaN: the last one, as the loop this replaced chose.
        return logits.len().saturating_sub(1) as u32;
    }
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The `k` largest logits as `(id, logit)`, largest first (lower id first on ties).
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    if k > FEW {
        return top_k_by_selection(logits, k);
    }
    // One pass keeping the best so far in order: every decoded token asks for its best two,
    // and selecting them from an index of the whole vocabulary costs far more than one pass.
    let ranks_before = |a: usize, b: usize| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)).is_gt();
    let mut best: Vec<usize> = Vec::with_capacity(k + 1);
    for i in 0..logits.len() {
        if best.len() == k && !ranks_before(i, best[k - 1]) {
            continue;
        }
        let at = best.partition_point(|&j| ranks_before(j, i));
        best.insert(at, i);
        best.truncate(k);
    }
    best.into_iter().map(|i| (i as u32, logits[i])).collect()
}

/// Largest `k` that `top_k` keeps in one pass rather than selecting from all ids.
const FEW: usize = 64;

/// `top_k` by selection over every id.
fn top_k_by_selection(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let order = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_by(order);
    ids.into_iter().map(|i| (i as u32, logits[i])).collect()
}

/// How the next token is chosen. The defaults are greedy: temperature 0.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingOptions {
    /// 0 is greedy (argmax); otherwise logits are divided by it before the softmax.
    pub temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches this (1: all).
    pub top_p: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Drop tokens less likely than this times the most likely one (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of tokens already seen by this (1: off).
    pub repetition_penalty: f32,
    /// Seed of the random choice (runs with the same seed and inputs choose the same tokens).
    pub seed: u64,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        SamplingOptions {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            seed: 0,
        }
    }
}

impl SamplingOptions {
    /// Why these options are invalid, if they are.
    pub fn check(&self) -> std::result::Result<(), String> {
        let finite = |v: f32| v.is_finite();
        if !finite(self.temperature) || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be 0 or more, not {}",
                self.temperature
            ));
        }
        if !finite(self.top_p) || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(format!("top_p must be in (0, 1], not {}", self.top_p));
        }
        if !finite(self.min_p) || !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], not {}", self.min_p));
        }
        if !finite(self.repetition_penalty) || self.repetition_penalty <= 0.0 {
            return Err(format!(
                "repetition_penalty must be more than 0, not {}",
                self.repetition_penalty
            ));
        }
        Ok(())
    }
}

/// Chooses tokens with `SamplingOptions`, drawing from its own seeded generator.
#[derive(Debug, Clone)]
pub struct Sampler {
    options: SamplingOptions,
    state: u64,
}

impl Sampler {
    pub fn new(options: SamplingOptions) -> Sampler {
        Sampler {
            options,
            state: options.seed,
        }
    }

    /// A uniform number in [0, 1).
    fn uniform(&mut self) -> f64 {
        (crate::random::splitmix64(&mut self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token after `logits`, `seen` being the tokens so far (for the repetition
    /// penalty).
    pub fn sample(&mut self, logits: &[f32], seen: &[u32]) -> u32 {
        let o = self.options;
        let mut logits = logits.to_vec();
        if o.repetition_penalty != 1.0 {
            let mut penalized = seen.to_vec();
            penalized.sort_unstable();
            penalized.dedup();
            for id in penalized {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / o.repetition_penalty
                    } else {
                        *l * o.repetition_penalty
                    };
                }
            }
        }
        if o.temperature == 0.0 {
            return argmax(&logits);
        }
        // Candidates by descending logit (top-k first: the vocabulary is large).
        let k = if o.top_k == 0 { logits.len() } else { o.top_k };
        let candidates = top_k(&logits, k);
        let max = candidates[0].1;
        let mut weights: Vec<(u32, f64)> = candidates
            .iter()
            .map(|&(id, l)| (id, (((l - max) / o.temperature) as f64).exp()))
            .collect();
        // min-p against the most likely token, then top-p over what is left.
        if o.min_p > 0.0 {
            let floor = weights[0].1 * o.min_p as f64;
            weights.retain(|&(_, w)| w >= floor);
        }
        let total: f64 = weights.iter().map(|(_, w)| w).sum();
        if o.top_p < 1.0 {
            let mut kept = 0.0;
            let mut keep = weights.len();
            for (i, (_, w)) in weights.iter().enumerate() {
                kept += w / total;
                if kept >= o.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
            weights.truncate(keep);
        }
        let total: f64 = weights.iter().map(|(_, w)| w).sum();
        let mut target = self.uniform() * total;
        for &(id, w) in &weights {
            if target < w {
                return id;
            }
            target -= w;
        }
        weights.last().map_or(0, |(id, _)| *id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_sampling_is_argmax_and_penalties_apply() {
        let logits = [1.0, 3.0, 2.5, -1.0];
        let mut greedy = Sampler::new(SamplingOptions::default());
        assert_eq!(greedy.sample(&logits, &[]), 1);
        let mut penalized = Sampler::new(SamplingOptions {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        // 3.0 / 2 = 1.5 < 2.5: the seen token loses.
        assert_eq!(penalized.sample(&logits, &[1, 1]), 2);
    }

    #[test]
    fn sampling_is_seeded_and_respects_its_cuts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let options = SamplingOptions {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let draw = |o: SamplingOptions| {
            let mut s = Sampler::new(o);
            (0..200).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(options), draw(options));
        assert_ne!(draw(options), draw(SamplingOptions { seed: 8, ..options }));
        let top3: Vec<u32> = top_k(&logits, 3).iter().map(|(id, _)| *id).collect();
        for id in draw(SamplingOptions {
            top_k: 3,
            ..options
        }) {
            assert!(top3.contains(&id));
        }
        // top_p tiny: only the most likely token.
        let best = argmax(&logits);
        assert!(
            draw(SamplingOptions {
                top_p: 1e-6,
                ..options
            })
            .iter()
            .all(|&id| id == best)
        );
        // min_p 1: only tokens as likely as the best.
        assert!(
            draw(SamplingOptions {
                min_p: 1.0,
                ..options
            })
            .iter()
            .all(|&id| id == best)
        );
        // Several tokens come up at temperature 1.
        let mut distinct = draw(options);
        distinct.sort_unstable();
        distinct.dedup();
        assert!(distinct.len() > 5, "{distinct:?}");
    }

    #[test]
    fn bad_values_are_named() {
        for (o, needle) in [
            (
                SamplingOptions {
                    temperature: -1.0,
                    ..Default::default()
                },
                "temperature",
            ),
            (
                SamplingOptions {
                    top_p: 0.0,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingOptions {
                    top_p: f32::NAN,
                    ..Default::default()
                },
                "top_p",
            ),
            (
                SamplingOptions {
                    min_p: 2.0,
                    ..Default::default()
                },
                "min_p",
            ),
            (
                SamplingOptions {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
                "repetition_penalty",
            ),
        ] {
            assert!(o.check().unwrap_err().contains(needle));
        }
        assert!(SamplingOptions::default().check().is_ok());
    }

    #[test]
    fn argmax_takes_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.25]), 1);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0, 2.0]), 2);
        assert_eq!(argmax(&[-0.0, 0.0]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 1);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn top_k_is_sorted_descending() {
        let top = top_k(&[0.5, 2.0, -1.0, 2.0, 1.0], 3);
        assert_eq!(top, vec![(1, 2.0), (3, 2.0), (4, 1.0)]);
        assert_eq!(top_k(&[1.0, 2.0], 5).len(), 2);
        // The one-pass path and selection agree, ties (lower id first), NaN and infinities
        // included.
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| match i % 997 {
                3 => f32::NAN,
                5 => f32::INFINITY,
                7 => f32::NEG_INFINITY,
                _ => ((i.wrapping_mul(2654435761) >> 20) % 300) as f32 * 0.25 - 30.0,
            })
            .collect();
        for k in [1, 2, 3, 10, FEW] {
            let one_pass = top_k(&logits, k);
            let selected = top_k_by_selection(&logits, k);
            let bits =
                |v: &[(u32, f32)]| v.iter().map(|(i, l)| (*i, l.to_bits())).collect::<Vec<_>>();
            assert_eq!(bits(&one_pass), bits(&selected), "k = {k}");
        }
    }
}
