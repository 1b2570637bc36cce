//! The GPT-OSS forward pass on the GPU tier, with every weight resident in GPU memory.
//!
//! A block of tokens is one prepared plan (pipelines, bind groups, workgroup counts built once per
//! block size) recorded into one command encoder: routing stays on the device (the router's top-k
//! ids select the expert weights inside the expert kernels), and the head ends in an on-device
//! top-k, so a decoded token costs one submission and one readback of a few words.

use std::collections::HashMap;

use super::generate::{Step, validate_tokens};
use crate::config::Config;
use crate::cpu::rope::RopeTable;
use crate::error::{Error, Result};
use crate::gpu::GpuContext;
use crate::gpu::kernels::{
    AttentionShape, Dispatch, GpuExperts, GpuMatrix, MAX_GPU_TOP_LOGITS, prepare_add,
    prepare_attention, prepare_combine, prepare_kv_store, prepare_rms_norm, prepare_rope,
    prepare_route, prepare_swiglu, prepare_top_k,
};
use crate::weights::ModelWeights;

/// Options of the GPU tier.
#[derive(Debug, Clone)]
pub struct GpuTierOptions {
    /// Most positions the KV cache may hold.
    pub context: usize,
    /// Largest block of prompt tokens run at once (longer prompts run in blocks).
    pub max_block: usize,
    /// Largest logits read back per step (at least 2: the margin needs the runner-up).
    pub top_logits: usize,
}

/// Submissions and host readbacks, counted for the stats.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct GpuCounters {
    pub submits: u64,
    pub readbacks: u64,
}

struct GpuLayer {
    input_norm: wgpu::Buffer,
    post_attention_norm: wgpu::Buffer,
    q: GpuMatrix,
    k: GpuMatrix,
    v: GpuMatrix,
    o: GpuMatrix,
    q_bias: Option<wgpu::Buffer>,
    k_bias: Option<wgpu::Buffer>,
    v_bias: Option<wgpu::Buffer>,
    o_bias: Option<wgpu::Buffer>,
    sinks: wgpu::Buffer,
    router: GpuMatrix,
    router_bias: wgpu::Buffer,
    gate_up: GpuExperts,
    gate_up_bias: wgpu::Buffer,
    down: GpuExperts,
    down_bias: wgpu::Buffer,
}

/// Activation buffers, sized for `max_block` tokens.
struct Activations {
    step: wgpu::Buffer,
    tokens: wgpu::Buffer,
    cos: wgpu::Buffer,
    sin: wgpu::Buffer,
    hidden: wgpu::Buffer,
    normed: wgpu::Buffer,
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    attention: wgpu::Buffer,
    projected: wgpu::Buffer,
    router_logits: wgpu::Buffer,
    expert_ids: wgpu::Buffer,
    expert_weights: wgpu::Buffer,
    gate_up: wgpu::Buffer,
    activated: wgpu::Buffer,
    down: wgpu::Buffer,
    last: wgpu::Buffer,
    final_normed: wgpu::Buffer,
    logits: wgpu::Buffer,
    top: wgpu::Buffer,
    staging: wgpu::Buffer,
    dummy: wgpu::Buffer,
    /// Router ids of every layer for the prompt, when tracing (`[layers, block, top_k]`).
    routing_trace: Option<wgpu::Buffer>,
}

enum PlanStep {
    Dispatch(Dispatch),
    Copy {
        from: wgpu::Buffer,
        from_offset: u64,
        to: wgpu::Buffer,
        to_offset: u64,
        bytes: u64,
    },
}

struct KvBuffers {
    keys: wgpu::Buffer,
    values: wgpu::Buffer,
    capacity: usize,
}

/// A model resident on the GPU, with its KV cache.
pub struct GpuModel {
    pub ctx: GpuContext,
    config: Config,
    rope: RopeTable,
    options: GpuTierOptions,
    layers: Vec<GpuLayer>,
    embeddings: GpuMatrix,
    lm_head: GpuMatrix,
    final_norm: wgpu::Buffer,
    act: Activations,
    kv: Vec<KvBuffers>,
    /// Plans by (block size, runs the head).
    plans: HashMap<(usize, bool), Vec<PlanStep>>,
    len: usize,
    pub counters: GpuCounters,
    /// Submit and check every kernel on its own (`PICCHIO_GPU_DEBUG=1`).
    debug: bool,
}

/// Records plan steps into `encoder`: consecutive dispatches share one compute pass, copies go
/// between passes.
fn record(encoder: &mut wgpu::CommandEncoder, steps: &[PlanStep]) {
    let mut pass: Option<wgpu::ComputePass<'static>> = None;
    for step in steps {
        match step {
            PlanStep::Dispatch(d) => {
                let p = pass.get_or_insert_with(|| {
                    encoder
                        .begin_compute_pass(&Default::default())
                        .forget_lifetime()
                });
                d.record(p);
            }
            PlanStep::Copy {
                from,
                from_offset,
                to,
                to_offset,
                bytes,
            } => {
                pass = None;
                encoder.copy_buffer_to_buffer(from, *from_offset, to, *to_offset, *bytes);
            }
        }
    }
}

fn add(steps: &mut Vec<PlanStep>, dispatches: Vec<Dispatch>) {
    steps.extend(dispatches.into_iter().map(PlanStep::Dispatch));
}

fn f32s(ctx: &GpuContext, label: &str, values: &[f32]) -> wgpu::Buffer {
    ctx.upload_f32(label, values)
}

impl GpuModel {
    /// Uploads every weight. Fails (without panicking) when the device cannot hold them.
    pub fn new(
        ctx: GpuContext,
        config: &Config,
        weights: &ModelWeights,
        options: GpuTierOptions,
    ) -> Result<GpuModel> {
        let scope = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let built = Self::build(ctx, config, weights, options);
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(Error::Gpu(format!(
                "the model does not fit in GPU memory: {error}"
            )));
        }
        built
    }

    fn build(
        ctx: GpuContext,
        cfg: &Config,
        weights: &ModelWeights,
        options: GpuTierOptions,
    ) -> Result<GpuModel> {
        ctx.check_fits(weights.bytes() as u64)?;
        if options.top_logits > MAX_GPU_TOP_LOGITS {
            return Err(Error::InvalidArgument(format!(
                "the GPU reports at most {MAX_GPU_TOP_LOGITS} logits per step ({} asked); use --backend cpu for more",
                options.top_logits
            )));
        }
        let options = GpuTierOptions {
            top_logits: options.top_logits.max(2).min(cfg.vocab_size),
            max_block: options.max_block.max(1),
            ..options
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (l, w) in weights.layers.iter().enumerate() {
            let name = |s: &str| format!("layer {l} {s}");
            let optional =
                |b: &Option<Vec<f32>>, s: &str| b.as_ref().map(|v| f32s(&ctx, &name(s), v));
            layers.push(GpuLayer {
                input_norm: f32s(&ctx, &name("input norm"), &w.input_norm),
                post_attention_norm: f32s(&ctx, &name("post norm"), &w.post_attention_norm),
                q: GpuMatrix::upload(&ctx, &name("q"), &w.q)?,
                k: GpuMatrix::upload(&ctx, &name("k"), &w.k)?,
                v: GpuMatrix::upload(&ctx, &name("v"), &w.v)?,
                o: GpuMatrix::upload(&ctx, &name("o"), &w.o)?,
                q_bias: optional(&w.q_bias, "q bias"),
                k_bias: optional(&w.k_bias, "k bias"),
                v_bias: optional(&w.v_bias, "v bias"),
                o_bias: optional(&w.o_bias, "o bias"),
                sinks: f32s(&ctx, &name("sinks"), &w.sinks),
                router: GpuMatrix::upload(&ctx, &name("router"), &w.router)?,
                router_bias: f32s(&ctx, &name("router bias"), &w.router_bias),
                gate_up: GpuExperts::upload(&ctx, &name("gate_up"), &w.gate_up)?,
                gate_up_bias: f32s(&ctx, &name("gate_up bias"), &w.gate_up_bias),
                down: GpuExperts::upload(&ctx, &name("down"), &w.down)?,
                down_bias: f32s(&ctx, &name("down bias"), &w.down_bias),
            });
        }
        let embeddings = GpuMatrix::upload(&ctx, "embeddings", &weights.embeddings)?;
        let lm_head = GpuMatrix::upload(&ctx, "lm_head", &weights.lm_head)?;
        let final_norm = f32s(&ctx, "final norm", &weights.final_norm);

        let b = options.max_block;
        let (h, i, k) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.experts_per_token,
        );
        let f = |n: usize| (n * 4) as u64;
        let zeroed = |label: &str, bytes: u64| ctx.zeroed(label, bytes);
        let top_bytes = f(2 * options.top_logits);
        let act = Activations {
            step: ctx.uniform("step", &[0u8; 16]),
            tokens: zeroed("tokens", f(b))?,
            cos: zeroed("cos", f(b * cfg.head_dim / 2))?,
            sin: zeroed("sin", f(b * cfg.head_dim / 2))?,
            hidden: zeroed("hidden", f(b * h))?,
            normed: zeroed("normed", f(b * h))?,
            q: zeroed("q", f(b * cfg.q_dim()))?,
            k: zeroed("k", f(b * cfg.kv_dim()))?,
            v: zeroed("v", f(b * cfg.kv_dim()))?,
            attention: zeroed("attention", f(b * cfg.q_dim()))?,
            projected: zeroed("projected", f(b * h))?,
            router_logits: zeroed("router logits", f(b * cfg.num_experts))?,
            expert_ids: zeroed("expert ids", f(b * k))?,
            expert_weights: zeroed("expert weights", f(b * k))?,
            gate_up: zeroed("gate_up", f(b * k * 2 * i))?,
            activated: zeroed("activated", f(b * k * i))?,
            down: zeroed("down", f(b * k * h))?,
            last: zeroed("last", f(h))?,
            final_normed: zeroed("final normed", f(h))?,
            logits: zeroed("logits", f(cfg.vocab_size))?,
            top: zeroed("top", top_bytes)?,
            staging: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("top staging"),
                size: top_bytes,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            dummy: zeroed("dummy", 4)?,
            routing_trace: None,
        };
        let mut model = GpuModel {
            rope: RopeTable::new(cfg),
            config: cfg.clone(),
            options,
            layers,
            embeddings,
            lm_head,
            final_norm,
            act,
            kv: Vec::new(),
            plans: HashMap::new(),
            len: 0,
            counters: GpuCounters::default(),
            debug: std::env::var("PICCHIO_GPU_DEBUG").is_ok_and(|v| v == "1"),
            ctx,
        };
        model.kv = (0..cfg.num_layers)
            .map(|l| model.new_kv(l, 0))
            .collect::<Result<_>>()?;
        Ok(model)
    }

    /// Most positions one KV buffer can bind on this device.
    fn max_kv_positions(&self) -> usize {
        (self.ctx.max_binding_bytes / (self.config.kv_dim() as u64 * 4)) as usize
    }

    /// KV buffers of layer `l` able to hold `needed` positions: a ring of window + block - 1 slots
    /// for sliding layers, every position (grown in steps) for full ones.
    fn new_kv(&self, l: usize, needed: usize) -> Result<KvBuffers> {
        // A sliding layer's ring must hold every key a block's queries read.
        let wanted = match self.config.window_of(l) {
            Some(w) => w + self.options.max_block - 1,
            None => needed.max(256).next_power_of_two(),
        }
        .min(self.options.context.max(1));
        let capacity = wanted.min(self.max_kv_positions());
        if self.config.window_of(l).is_some() && capacity < wanted {
            return Err(Error::Gpu(format!(
                "layer {l}: a ring of {wanted} key positions exceeds this GPU's binding limit ({capacity})"
            )));
        }
        let bytes = (capacity * self.config.kv_dim() * 4) as u64;
        Ok(KvBuffers {
            keys: self.ctx.zeroed(&format!("layer {l} keys"), bytes)?,
            values: self.ctx.zeroed(&format!("layer {l} values"), bytes)?,
            capacity,
        })
    }

    /// Makes every full-attention layer's cache hold `needed` positions (copying what it holds).
    fn ensure_kv(&mut self, needed: usize) -> Result<()> {
        let mut grown = false;
        for l in 0..self.kv.len() {
            if self.config.window_of(l).is_some() || self.kv[l].capacity >= needed {
                continue;
            }
            let bigger = self.new_kv(l, needed)?;
            if bigger.capacity < needed {
                return Err(Error::Gpu(format!(
                    "{needed} positions do not fit the GPU KV cache ({} at most with this GPU's binding limit); lower --context or use --backend cpu",
                    bigger.capacity
                )));
            }
            let old = &self.kv[l];
            let bytes = (old.capacity * self.config.kv_dim() * 4) as u64;
            let mut encoder = self.ctx.device.create_command_encoder(&Default::default());
            encoder.copy_buffer_to_buffer(&old.keys, 0, &bigger.keys, 0, bytes);
            encoder.copy_buffer_to_buffer(&old.values, 0, &bigger.values, 0, bytes);
            self.ctx.queue.submit([encoder.finish()]);
            self.counters.submits += 1;
            self.kv[l] = bigger;
            grown = true;
        }
        if grown {
            // Bind groups point at the old buffers.
            self.plans.clear();
        }
        Ok(())
    }

    fn shape(&self, l: usize) -> AttentionShape {
        AttentionShape {
            num_heads: self.config.num_heads,
            num_kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            capacity: self.kv[l].capacity,
            window: self.config.window_of(l),
        }
    }

    /// Every kernel of a block of `n` tokens, in order.
    fn build_plan(&self, n: usize, head: bool) -> Result<Vec<PlanStep>> {
        let cfg = &self.config;
        let ctx = &self.ctx;
        let a = &self.act;
        let (h, i, k) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.experts_per_token,
        );
        let mut steps: Vec<PlanStep> = Vec::new();

        add(
            &mut steps,
            self.embeddings
                .prepare_embed(ctx, &a.tokens, n, &a.hidden)?,
        );
        for (l, w) in self.layers.iter().enumerate() {
            let shape = self.shape(l);
            let kv = &self.kv[l];
            add(
                &mut steps,
                vec![prepare_rms_norm(
                    ctx,
                    &a.hidden,
                    &w.input_norm,
                    n,
                    h,
                    cfg.rms_norm_eps,
                    &a.normed,
                )?],
            );
            add(
                &mut steps,
                w.q.prepare(ctx, &a.normed, n, w.q_bias.as_ref(), &a.q, &a.dummy)?,
            );
            add(
                &mut steps,
                w.k.prepare(ctx, &a.normed, n, w.k_bias.as_ref(), &a.k, &a.dummy)?,
            );
            add(
                &mut steps,
                w.v.prepare(ctx, &a.normed, n, w.v_bias.as_ref(), &a.v, &a.dummy)?,
            );
            add(
                &mut steps,
                vec![
                    prepare_rope(ctx, &a.q, (n, cfg.num_heads, cfg.head_dim), &a.cos, &a.sin)?,
                    prepare_rope(
                        ctx,
                        &a.k,
                        (n, cfg.num_kv_heads, cfg.head_dim),
                        &a.cos,
                        &a.sin,
                    )?,
                    prepare_kv_store(ctx, shape, n, &a.step, &a.k, &a.v, &kv.keys, &kv.values)?,
                    prepare_attention(
                        ctx,
                        shape,
                        n,
                        &a.step,
                        &a.q,
                        &kv.keys,
                        &kv.values,
                        &w.sinks,
                        &a.attention,
                    )?,
                ],
            );
            add(
                &mut steps,
                w.o.prepare(
                    ctx,
                    &a.attention,
                    n,
                    w.o_bias.as_ref(),
                    &a.projected,
                    &a.dummy,
                )?,
            );
            add(
                &mut steps,
                vec![
                    prepare_add(ctx, &a.projected, &a.hidden, n * h)?,
                    prepare_rms_norm(
                        ctx,
                        &a.hidden,
                        &w.post_attention_norm,
                        n,
                        h,
                        cfg.rms_norm_eps,
                        &a.normed,
                    )?,
                ],
            );
            add(
                &mut steps,
                w.router.prepare(
                    ctx,
                    &a.normed,
                    n,
                    Some(&w.router_bias),
                    &a.router_logits,
                    &a.dummy,
                )?,
            );
            add(
                &mut steps,
                vec![prepare_route(
                    ctx,
                    &a.router_logits,
                    (n, cfg.num_experts, k),
                    &a.expert_ids,
                    &a.expert_weights,
                )?],
            );
            if let Some(trace) = &a.routing_trace {
                let bytes = (n * k * 4) as u64;
                steps.push(PlanStep::Copy {
                    from: a.expert_ids.clone(),
                    from_offset: 0,
                    to: trace.clone(),
                    to_offset: l as u64 * bytes,
                    bytes,
                });
            }
            let pairs = n * k;
            add(
                &mut steps,
                w.gate_up.prepare(
                    ctx,
                    &a.normed,
                    k,
                    &a.expert_ids,
                    pairs,
                    Some(&w.gate_up_bias),
                    &a.gate_up,
                    &a.dummy,
                )?,
            );
            add(
                &mut steps,
                vec![prepare_swiglu(
                    ctx,
                    &a.gate_up,
                    (pairs, i),
                    (cfg.swiglu_alpha, cfg.swiglu_limit),
                    &a.activated,
                )?],
            );
            add(
                &mut steps,
                w.down.prepare(
                    ctx,
                    &a.activated,
                    1,
                    &a.expert_ids,
                    pairs,
                    Some(&w.down_bias),
                    &a.down,
                    &a.dummy,
                )?,
            );
            add(
                &mut steps,
                vec![prepare_combine(
                    ctx,
                    (&a.expert_ids, &a.expert_weights, &a.down),
                    (n, k, h),
                    &a.hidden,
                )?],
            );
        }
        if head {
            steps.push(PlanStep::Copy {
                from: a.hidden.clone(),
                from_offset: ((n - 1) * h * 4) as u64,
                to: a.last.clone(),
                to_offset: 0,
                bytes: (h * 4) as u64,
            });
            add(
                &mut steps,
                vec![prepare_rms_norm(
                    ctx,
                    &a.last,
                    &self.final_norm,
                    1,
                    h,
                    cfg.rms_norm_eps,
                    &a.final_normed,
                )?],
            );
            add(
                &mut steps,
                self.lm_head
                    .prepare(ctx, &a.final_normed, 1, None, &a.logits, &a.dummy)?,
            );
            add(
                &mut steps,
                vec![prepare_top_k(
                    ctx,
                    &a.logits,
                    cfg.vocab_size,
                    self.options.top_logits,
                    &a.top,
                )?],
            );
            steps.push(PlanStep::Copy {
                from: a.top.clone(),
                from_offset: 0,
                to: a.staging.clone(),
                to_offset: 0,
                bytes: (8 * self.options.top_logits) as u64,
            });
        }
        Ok(steps)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Runs `tokens` after what the cache holds; returns the next-token step from the last
    /// position (the `top_logits` largest logits, read back from the device).
    pub fn feed(&mut self, tokens: &[u32], top_logits: usize) -> Result<Step> {
        validate_tokens(&self.config, self.len, tokens, self.options.context)?;
        let blocks: Vec<&[u32]> = tokens.chunks(self.options.max_block).collect();
        let last = blocks.len() - 1;
        for (b, block) in blocks.into_iter().enumerate() {
            self.run_block(block, b == last)?;
        }
        let top = self.read_top()?;
        let margin = if top.len() >= 2 {
            top[0].1 - top[1].1
        } else {
            f32::INFINITY
        };
        Ok(Step {
            id: top[0].0,
            top: top.into_iter().take(top_logits).collect(),
            margin,
        })
    }

    fn run_block(&mut self, tokens: &[u32], head: bool) -> Result<()> {
        let n = tokens.len();
        let needed = self.len + n;
        self.scoped(|model| model.ensure_kv(needed))?;
        let q = &self.ctx.queue;
        q.write_buffer(
            &self.act.step,
            0,
            bytemuck::cast_slice(&[self.len as u32, 0, 0, 0]),
        );
        q.write_buffer(&self.act.tokens, 0, bytemuck::cast_slice(tokens));
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for t in 0..n {
            let (c, s) = self.rope.cos_sin(self.len + t);
            cos.extend(c);
            sin.extend(s);
        }
        q.write_buffer(&self.act.cos, 0, bytemuck::cast_slice(&cos));
        q.write_buffer(&self.act.sin, 0, bytemuck::cast_slice(&sin));
        if !self.plans.contains_key(&(n, head)) {
            // Plans of odd block sizes (prompt remainders) are not worth keeping forever.
            if self.plans.len() >= 8 {
                self.plans.retain(|key, _| *key == (1, true));
            }
            let plan = self.scoped(|model| model.build_plan(n, head))?;
            self.plans.insert((n, head), plan);
        }
        if self.debug {
            return self.run_block_debug(n, head);
        }
        let plan = &self.plans[&(n, head)];
        self.ctx.guard(|| {
            let mut encoder = self.ctx.device.create_command_encoder(&Default::default());
            record(&mut encoder, plan);
            self.ctx.queue.submit([encoder.finish()]);
            Ok(())
        })?;
        self.counters.submits += 1;
        self.len += n;
        if self.ctx.is_lost() {
            return Err(Error::Gpu("the GPU device was lost".into()));
        }
        Ok(())
    }

    /// The debug mode (`PICCHIO_GPU_DEBUG=1`): one submission per kernel, each checked for
    /// validation errors and timed, in the log at debug level. Slow; the results are the same.
    fn run_block_debug(&mut self, n: usize, head: bool) -> Result<()> {
        let plan = &self.plans[&(n, head)];
        for (i, step) in plan.iter().enumerate() {
            let scope = self
                .ctx
                .device
                .push_error_scope(wgpu::ErrorFilter::Validation);
            let started = std::time::Instant::now();
            let mut encoder = self.ctx.device.create_command_encoder(&Default::default());
            record(&mut encoder, std::slice::from_ref(step));
            let label = match step {
                PlanStep::Dispatch(d) => d.label.as_str(),
                PlanStep::Copy { .. } => "copy",
            };
            self.ctx.queue.submit([encoder.finish()]);
            self.ctx.wait()?;
            if let Some(error) = pollster::block_on(scope.pop()) {
                return Err(Error::Gpu(format!(
                    "step {i} ({label}) of a {n}-token block: {error}"
                )));
            }
            log::debug!(
                "block of {n}, step {i:4}: {label:<32} {:8.3} ms",
                started.elapsed().as_secs_f64() * 1e3
            );
        }
        self.counters.submits += plan.len() as u64;
        self.len += n;
        Ok(())
    }

    /// Reads the on-device top-k of the last head run: `(id, logit)`, largest first.
    fn read_top(&mut self) -> Result<Vec<(u32, f32)>> {
        let bytes = (8 * self.options.top_logits) as u64;
        let staging = &self.act.staging;
        let (sender, receiver) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, ..bytes, move |r| {
            let _ = sender.send(r);
        });
        self.ctx.wait()?;
        receiver
            .recv()
            .map_err(|_| Error::Gpu("readback never completed".into()))?
            .map_err(|e| Error::Gpu(format!("readback failed: {e}")))?;
        let words: Vec<u32> = {
            let view = staging
                .get_mapped_range(..bytes)
                .map_err(|e| Error::Gpu(format!("readback mapping: {e}")))?;
            bytemuck::pod_collect_to_vec(&view[..])
        };
        staging.unmap();
        self.counters.readbacks += 1;
        if self.ctx.is_lost() {
            return Err(Error::Gpu("the GPU device was lost".into()));
        }
        Ok(words
            .chunks_exact(2)
            .map(|w| (w[0], f32::from_bits(w[1])))
            .collect())
    }

    /// Router top-k ids of every layer at every position of `prompt`, run from position 0 block
    /// by block, for A/B comparisons: `[layer][position][slot]`. Leaves the cache holding the prompt.
    pub fn trace_routing(&mut self, prompt: &[u32]) -> Result<Vec<Vec<Vec<u32>>>> {
        let (layers, k, block) = (
            self.config.num_layers,
            self.config.experts_per_token,
            self.options.max_block,
        );
        self.reset();
        let trace = self.scoped(|model| {
            model
                .ctx
                .zeroed("routing trace", (layers * block * k * 4) as u64)
        })?;
        self.act.routing_trace = Some(trace.clone());
        self.plans.clear();
        let mut routing: Vec<Vec<Vec<u32>>> = vec![Vec::new(); layers];
        let mut result = Ok(());
        for chunk in prompt.chunks(block) {
            result = self.run_block(chunk, false).and_then(|()| {
                let used = layers * chunk.len() * k;
                let ids: Vec<u32> =
                    bytemuck::pod_collect_to_vec(&self.ctx.read_back(&trace, (used * 4) as u64)?);
                for (l, layer) in ids.chunks(chunk.len() * k).enumerate() {
                    routing[l].extend(layer.chunks(k).map(|slots| slots.to_vec()));
                }
                Ok(())
            });
            if result.is_err() {
                break;
            }
        }
        self.act.routing_trace = None;
        self.plans.clear();
        result.map(|()| routing)
    }

    /// Runs `operation` with out-of-memory and validation errors caught as errors (wgpu would
    /// otherwise report them to its default handler, which panics).
    fn scoped<T>(&mut self, operation: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let oom = self
            .ctx
            .device
            .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self
            .ctx
            .device
            .push_error_scope(wgpu::ErrorFilter::Validation);
        let result = operation(self);
        let validation = pollster::block_on(validation.pop());
        let oom = pollster::block_on(oom.pop());
        match (result, validation.or(oom)) {
            (Ok(_), Some(error)) => Err(Error::Gpu(error.to_string())),
            (result, _) => result,
        }
    }

    /// Turns the debug mode (one checked submission per kernel) on or off.
    pub fn set_debug(&mut self, on: bool) {
        self.debug = on;
    }

    /// Forgets every position (the next feed starts at 0).
    pub fn reset(&mut self) {
        self.len = 0;
    }
}
