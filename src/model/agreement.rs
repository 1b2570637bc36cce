//! Top-1 agreement of a faster numeric mode (q8 dense weights, INT4 experts) with the exact
//! path, teacher-forced: both models read the exact path's greedy tokens, and each step counts
//! whether they would choose the same next token.

use serde::Serialize;

use super::Model;
use super::generate::validate_prompt;
use super::sampler::argmax;
use crate::error::Result;

#[derive(Debug, Clone, Serialize)]
pub struct Agreement {
    /// Steps compared: the prompt's next token, then one per exact-path token.
    pub steps: usize,
    /// Steps where both chose the same token.
    pub agreeing: usize,
    /// agreeing / steps.
    pub rate: f64,
    /// The first step that differs, if any.
    pub first_disagreement: Option<usize>,
    /// The exact path's greedy tokens (what both models were fed).
    pub exact_ids: Vec<u32>,
}

/// Compares `other` with `exact` (the same checkpoint loaded two ways) over `steps` steps after
/// `prompt`, one token at a time after the prompt.
pub fn top1_agreement(
    exact: &Model,
    other: &Model,
    prompt: &[u32],
    steps: usize,
) -> Result<Agreement> {
    let context = prompt.len() + steps;
    validate_prompt(&exact.config, prompt, context)?;
    let mut exact_cache = exact.new_cache(context);
    let mut other_cache = other.new_cache(context);
    let mut exact_logits = exact.forward(&mut exact_cache, prompt, None)?;
    let mut other_logits = other.forward(&mut other_cache, prompt, None)?;
    let mut agreeing = 0;
    let mut first_disagreement = None;
    let mut exact_ids = Vec::with_capacity(steps);
    for step in 0..steps {
        let (want, got) = (argmax(&exact_logits), argmax(&other_logits));
        if want == got {
            agreeing += 1;
        } else if first_disagreement.is_none() {
            first_disagreement = Some(step);
        }
        exact_ids.push(want);
        if step + 1 < steps {
            exact_logits = exact.forward(&mut exact_cache, &[want], None)?;
            other_logits = other.forward(&mut other_cache, &[want], None)?;
        }
    }
    Ok(Agreement {
        steps,
        agreeing,
        rate: agreeing as f64 / steps.max(1) as f64,
        first_disagreement,
        exact_ids,
    })
}
