//! Greedy generation: batched prefill of the prompt, then one token at a time.

use std::time::Instant;

use super::Model;
use super::sampler::{argmax, top_k};
use crate::error::{Error, Result};

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// How many of the largest logits to report per step (0 = none).
    pub top_logits: usize,
    /// Stop after producing one of the config's EOS ids.
    pub stop_at_eos: bool,
    /// Most positions the KV cache may hold.
    pub context: usize,
}

/// One generated token and what the model thought of it.
#[derive(Debug, Clone)]
pub struct Step {
    pub id: u32,
    pub top: Vec<(u32, f32)>,
    /// Largest minus second-largest logit: how close the greedy choice was.
    pub margin: f32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    MaxNewTokens,
    Eos,
    ContextFull,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub steps: Vec<Step>,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Tokens run through the model one at a time after the prefill.
    pub decode_tokens: usize,
    pub stop: StopReason,
}

impl Generation {
    pub fn decode_tokens_per_s(&self) -> Option<f64> {
        (self.decode_tokens > 0 && self.decode_ms > 0.0)
            .then(|| self.decode_tokens as f64 / (self.decode_ms / 1000.0))
    }
}

/// Checks a prompt against the model and the context before any work is done.
pub fn validate_prompt(model: &Model, prompt: &[u32], context: usize) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let vocab_size = model.config.vocab_size;
    if let Some((position, &id)) = prompt
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab_size)
    {
        return Err(Error::TokenOutOfRange {
            id,
            position,
            vocab_size,
        });
    }
    if prompt.len() > context {
        return Err(Error::PromptTooLong {
            prompt_len: prompt.len(),
            context,
        });
    }
    Ok(())
}

fn step_of(logits: &[f32], top_logits: usize) -> Step {
    let best_two = top_k(logits, 2);
    let margin = match best_two.as_slice() {
        [a, b] => a.1 - b.1,
        _ => f32::INFINITY,
    };
    Step {
        id: argmax(logits),
        top: top_k(logits, top_logits),
        margin,
    }
}

/// Greedy decoding of up to `max_new_tokens` tokens after `prompt`.
pub fn generate(model: &Model, prompt: &[u32], options: &GenerateOptions) -> Result<Generation> {
    validate_prompt(model, prompt, options.context)?;
    let mut cache = model.new_cache(options.context);
    let mut generation = Generation {
        prompt_ids: prompt.to_vec(),
        generated_ids: Vec::new(),
        steps: Vec::new(),
        prefill_ms: 0.0,
        decode_ms: 0.0,
        decode_tokens: 0,
        stop: StopReason::MaxNewTokens,
    };
    if options.max_new_tokens == 0 {
        return Ok(generation);
    }

    let started = Instant::now();
    let mut logits = model.forward(&mut cache, prompt, None)?;
    generation.prefill_ms = started.elapsed().as_secs_f64() * 1000.0;

    let decode_started = Instant::now();
    loop {
        let step = step_of(&logits, options.top_logits);
        let id = step.id;
        generation.generated_ids.push(id);
        generation.steps.push(step);
        if options.stop_at_eos && model.config.eos_token_ids.contains(&id) {
            generation.stop = StopReason::Eos;
            break;
        }
        if generation.generated_ids.len() >= options.max_new_tokens {
            break;
        }
        if cache.len() >= cache.context() {
            log::warn!(
                "context of {} positions is full after {} generated tokens; stopping (raise --context)",
                cache.context(),
                generation.generated_ids.len()
            );
            generation.stop = StopReason::ContextFull;
            break;
        }
        logits = model.forward(&mut cache, &[id], None)?;
        generation.decode_tokens += 1;
    }
    generation.decode_ms = decode_started.elapsed().as_secs_f64() * 1000.0;
    Ok(generation)
}
