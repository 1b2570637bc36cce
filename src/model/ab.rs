//! A/B of the CPU and GPU tiers on the same input: tokens, logits, and the router's choices.

use std::collections::BTreeSet;

use serde::Serialize;

use super::Model;
use super::generate::{CpuSession, GenerateOptions, generate_with, validate_prompt};
use super::gpu_tier::{GpuModel, GpuTierOptions};
use crate::error::Result;
use crate::gpu::{GpuContext, GpuOptions};

/// Logits compared per step.
const TOP: usize = 10;

#[derive(Debug, Clone, Serialize)]
pub struct Divergence {
    pub step: usize,
    pub cpu_id: u32,
    pub gpu_id: u32,
    /// The CPU tier's top1 - top2 logit at that step.
    pub margin: f32,
}

#[derive(Debug, Clone, Serialize)]
pub struct RouterAgreement {
    pub layer: usize,
    pub positions: usize,
    /// Prompt positions where both tiers chose the same set of experts.
    pub agreeing: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct AbReport {
    pub adapter: String,
    pub adapter_backend: String,
    pub steps: usize,
    /// Length of the common prefix of the two greedy sequences.
    pub tokens_agreeing: usize,
    pub cpu_ids: Vec<u32>,
    pub gpu_ids: Vec<u32>,
    pub first_divergence: Option<Divergence>,
    /// Largest |cpu - gpu| over the top-10 logits (ids in both lists) of the steps up to the
    /// first divergence, where both tiers saw the same tokens.
    pub max_logit_difference: f32,
    pub router_agreement: Vec<RouterAgreement>,
}

impl AbReport {
    pub fn agree(&self) -> bool {
        self.first_divergence.is_none()
            && self
                .router_agreement
                .iter()
                .all(|r| r.agreeing == r.positions)
    }
}

/// Runs both tiers greedily for `max_new_tokens` (EOS ignored) and compares them; the GPU tier
/// runs with `gpu` (its context applies to both, its top-logits count is the report's).
pub fn compare_tiers(
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    gpu: &GpuTierOptions,
) -> Result<AbReport> {
    let context = gpu.context;
    validate_prompt(&model.config, prompt, context)?;
    let ctx = GpuContext::new(&GpuOptions::from_env())?;
    let adapter = ctx.adapter.clone();
    let options = GpuTierOptions {
        top_logits: TOP,
        ..gpu.clone()
    };
    let mut gpu = GpuModel::new(ctx, model, options)?;

    // Routing of every prompt position, layer by layer.
    let gpu_routing = gpu.trace_routing(prompt)?;
    gpu.reset();
    let mut cache = model.new_cache(context);
    let mut trace = Vec::new();
    model.forward(&mut cache, prompt, Some(&mut trace))?;
    let router_agreement = trace
        .iter()
        .zip(&gpu_routing)
        .enumerate()
        .map(|(layer, (cpu, gpu))| {
            let agreeing = cpu
                .routings
                .iter()
                .zip(gpu)
                .filter(|(c, g)| {
                    let c: BTreeSet<u32> = c.experts.iter().map(|e| *e as u32).collect();
                    let g: BTreeSet<u32> = g.iter().copied().collect();
                    c == g
                })
                .count();
            RouterAgreement {
                layer,
                positions: prompt.len(),
                agreeing,
            }
        })
        .collect();

    let generate_options = GenerateOptions {
        max_new_tokens,
        top_logits: TOP,
        stop_at_eos: false,
        context,
    };
    let cpu_run = generate_with(
        &mut CpuSession::new(model, context),
        &model.config,
        prompt,
        &generate_options,
    )?;
    let gpu_run = generate_with(&mut gpu, &model.config, prompt, &generate_options)?;

    let steps = cpu_run.steps.len().min(gpu_run.steps.len());
    let tokens_agreeing = (0..steps)
        .take_while(|&i| cpu_run.steps[i].id == gpu_run.steps[i].id)
        .count();
    let first_divergence = (tokens_agreeing < steps).then(|| Divergence {
        step: tokens_agreeing,
        cpu_id: cpu_run.steps[tokens_agreeing].id,
        gpu_id: gpu_run.steps[tokens_agreeing].id,
        margin: cpu_run.steps[tokens_agreeing].margin,
    });
    let mut max_logit_difference = 0f32;
    for i in 0..(tokens_agreeing + 1).min(steps) {
        for (id, cpu_logit) in &cpu_run.steps[i].top {
            if let Some((_, gpu_logit)) = gpu_run.steps[i].top.iter().find(|(g, _)| g == id) {
                max_logit_difference = max_logit_difference.max((cpu_logit - gpu_logit).abs());
            }
        }
    }
    Ok(AbReport {
        adapter: adapter.name,
        adapter_backend: adapter.backend,
        steps,
        tokens_agreeing,
        cpu_ids: cpu_run.generated_ids,
        gpu_ids: gpu_run.generated_ids,
        first_divergence,
        max_logit_difference,
        router_agreement,
    })
}
