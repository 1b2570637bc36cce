//! A/B of the CPU and GPU tiers on the same input: tokens, logits, and the router's choices.

use std::collections::BTreeSet;

use serde::Serialize;

use std::sync::Arc;

use super::generate::{
    BackendChoice, CpuSession, GenerateOptions, Generation, Runtime, generate_with, validate_prompt,
};
use super::gpu_tier::{GpuModel, GpuTierOptions};
use super::{KvCache, LayerTrace, Model};
use crate::error::Result;

/// The tier under test's side: what it is, its routing of the prompt and its greedy run.
struct Tested {
    backend: &'static str,
    adapter: String,
    adapter_backend: String,
    /// `[layer][position][slot]` expert ids.
    routing: Vec<Vec<Vec<u32>>>,
    run: Generation,
}

/// One layer's routing of every position, as ids.
fn routing_ids(layer: &LayerTrace) -> Vec<Vec<u32>> {
    let ids = |r: &crate::cpu::moe::Routing| r.experts.iter().map(|&e| e as u32).collect();
    layer.routings.iter().map(ids).collect()
}

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

/// The CPU tier's reference run against the tier under test: `gpu_ids` and the GPU's side of
/// every comparison are that tier's, whichever it is (`backend`).
#[derive(Debug, Clone, Serialize)]
pub struct AbReport {
    /// The tier under test: "gpu", or "cpu" (the CPU tier as sessions run it).
    pub backend: &'static str,
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

/// Runs the CPU tier and the tier `choice` opens (`Runtime::open`) greedily for
/// `max_new_tokens` (EOS ignored) and compares them. The tier under test runs with `gpu` (its
/// context applies to both, its top-logits count is the report's); on the CPU tier it runs as
/// chat sessions do, its cache keeping every position, against the reference's ring cache.
pub fn compare_tiers(
    model: &Model,
    prompt: &[u32],
    max_new_tokens: usize,
    choice: BackendChoice,
    gpu: &GpuTierOptions,
) -> Result<AbReport> {
    let context = gpu.context;
    validate_prompt(&model.config, prompt, context)?;
    let options = GpuTierOptions {
        top_logits: TOP,
        ..gpu.clone()
    };
    let runtime = Runtime::open(model, choice, &options)?;
    let generate_options = GenerateOptions {
        max_new_tokens,
        top_logits: TOP,
        stop_at_eos: false,
        context,
    };
    let tested = match runtime.gpu() {
        Some(weights) => {
            let mut gpu = GpuModel::on(Arc::clone(weights), options)?;
            // Routing of every prompt position, layer by layer.
            let routing = gpu.trace_routing(prompt)?;
            gpu.reset();
            let run = generate_with(&mut gpu, &model.config, prompt, &generate_options)?;
            let adapter = &weights.ctx.adapter;
            Tested {
                backend: "gpu",
                adapter: adapter.name.clone(),
                adapter_backend: adapter.backend.clone(),
                routing,
                run,
            }
        }
        None => {
            let mut cache = KvCache::keeping_all(&model.config, context);
            let mut trace = Vec::new();
            model.forward(&mut cache, prompt, Some(&mut trace))?;
            let mut session = CpuSession::keeping_all(model, context);
            let run = generate_with(&mut session, &model.config, prompt, &generate_options)?;
            Tested {
                backend: "cpu",
                adapter: format!("CPU tier ({} kernels)", crate::cpu::simd::kernels().name()),
                adapter_backend: "cpu".into(),
                routing: trace.iter().map(routing_ids).collect(),
                run,
            }
        }
    };
    let mut cache = model.new_cache(context);
    let mut trace = Vec::new();
    model.forward(&mut cache, prompt, Some(&mut trace))?;
    let gpu_routing = &tested.routing;
    let router_agreement = trace
        .iter()
        .zip(gpu_routing)
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

    let cpu_run = generate_with(
        &mut CpuSession::new(model, context),
        &model.config,
        prompt,
        &generate_options,
    )?;
    let gpu_run = tested.run;

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
        backend: tested.backend,
        adapter: tested.adapter,
        adapter_backend: tested.adapter_backend,
        steps,
        tokens_agreeing,
        cpu_ids: cpu_run.generated_ids,
        gpu_ids: gpu_run.generated_ids,
        first_divergence,
        max_logit_difference,
        router_agreement,
    })
}
