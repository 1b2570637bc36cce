//! The GPT-OSS forward pass on the GPU tier: dense weights resident in GPU memory, experts either
//! all resident or held by a byte-budgeted VRAM cache (LRU) in front of the RAM/disk expert store.
//!
//! A block of tokens is one prepared plan (pipelines, bind groups, workgroup counts built once per
//! block size). With every expert resident the plan is recorded into one command encoder: routing
//! stays on the device (the router's top-k ids select the expert weights inside the expert
//! kernels), and the head ends in an on-device top-k, so a decoded token costs one submission and
//! one readback of a few words. With a VRAM cache, each layer's routing is read back (with the
//! MoE input) so the host can place that layer's experts: hits run on the GPU from their cache
//! slots, misses are uploaded into a slot or computed by the CPU tier from RAM (`MissPolicy`), and
//! the CPU's outputs join the GPU's before the same on-device combine, so placement never changes
//! the order of the sum.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

mod placement;
mod plan;
mod weights;

use placement::{CpuMisses, SlotTable};
use weights::catching_oom;
pub use weights::{GpuWeights, vram_bytes_per_expert};

use super::Model;
use super::generate::{Step, check_finite, validate_tokens};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::experts::{ExpertKey, VramBudget};
use crate::gpu::GpuContext;
use crate::gpu::attention::{MAX_SPLITS, partials_bytes};
use crate::gpu::kernels::{
    Dispatch, GpuExperts, MAX_GPU_TOP_LOGITS, Output, PairTiles, RowNorm, prepare_top_k,
};
use crate::gpu::profile::{GpuProfile, Profiler};

/// What the GPU tier does with an expert its VRAM cache does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MissPolicy {
    /// Upload in prompt blocks (many tokens share each expert), compute on the CPU in decode
    /// (one token: running a cold expert from RAM beats copying it); free slots always fill.
    #[default]
    Auto,
    /// Always upload, evicting the least recently used expert the layer is not using.
    Upload,
    /// Upload only into free slots; never evict, compute the rest on the CPU.
    Cpu,
}

impl std::str::FromStr for MissPolicy {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<MissPolicy, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(MissPolicy::Auto),
            "upload" => Ok(MissPolicy::Upload),
            "cpu" => Ok(MissPolicy::Cpu),
            _ => Err(format!("{text:?}: expected auto, upload or cpu")),
        }
    }
}

/// Options of the GPU tier.
#[derive(Debug, Clone)]
pub struct GpuTierOptions {
    /// Most positions the KV cache may hold.
    pub context: usize,
    /// Largest block of prompt tokens run at once (longer prompts run in blocks).
    pub max_block: usize,
    /// Largest logits read back per step (at least 2: the margin needs the runner-up).
    pub top_logits: usize,
    /// GPU memory for experts.
    pub vram_budget: VramBudget,
    pub miss_policy: MissPolicy,
    /// Decoder layers the GPU runs (the first ones; the rest, and then the head, run on the CPU
    /// tier). `None`: as many as the dense weights fit.
    pub gpu_layers: Option<usize>,
    /// Keep every position of sliding layers too (not a ring of the window), so that the cache
    /// can be cut back to any earlier length (`truncate`): what a chat session reusing a prefix
    /// needs.
    pub keep_all_positions: bool,
    /// Time every kernel with timestamp queries (`--profile`; an error where the adapter has
    /// none).
    pub profile: bool,
    /// Run a prompt block's resident experts grouped by expert (`experts.wgsl` GROUPED) where
    /// the block has several pairs per expert (each expert's weights are then read and decoded
    /// once per 32 of its pairs). `None`: on hardware adapters only (a software one computes
    /// rather than waits, and a tile's padding costs it arithmetic), unless
    /// `PICCHIO_GPU_GROUP_EXPERTS` says 0 or 1.
    pub group_prompt_experts: Option<bool>,
}

/// Forces grouping a prompt block's experts by expert on (1) or off (0), for comparisons.
pub const GROUP_EXPERTS_ENV: &str = "PICCHIO_GPU_GROUP_EXPERTS";

impl Default for GpuTierOptions {
    fn default() -> Self {
        GpuTierOptions {
            context: 4096,
            max_block: super::generate::DEFAULT_GPU_BLOCK,
            top_logits: 2,
            vram_budget: VramBudget::Auto,
            miss_policy: MissPolicy::Auto,
            gpu_layers: None,
            keep_all_positions: false,
            profile: false,
            group_prompt_experts: match std::env::var(GROUP_EXPERTS_ENV).as_deref() {
                Ok("0") => Some(false),
                Ok("1") => Some(true),
                _ => None,
            },
        }
    }
}

/// What a block's head leaves for the host to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum HeadOutput {
    /// The `top_logits` largest logits, chosen on the device (a few words to read back).
    Top,
    /// Every logit (a sampler's input: the vocabulary's size times 4 bytes to read back).
    Logits,
}

/// Where one layer ran, with the expert counts behind the choice (summed over the run).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LayerPlacement {
    pub layer: usize,
    pub attention: &'static str,
    /// "gpu", "cpu" or "gpu+cpu" (some experts on each).
    pub experts: &'static str,
    pub residual: &'static str,
    /// Experts the layer found in VRAM, uploaded, and computed on the CPU.
    pub vram_hits: u64,
    pub uploads: u64,
    pub cpu_experts: u64,
}

/// How loading a model onto the GPU went, for the stats.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct GpuLoad {
    pub seconds: f64,
    pub uploaded_bytes: u64,
    /// Most bytes of uploads queued at once: the host staging copies wgpu held.
    pub peak_staging_bytes: u64,
}

/// Submissions and host readbacks, counted for the stats.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct GpuCounters {
    pub submits: u64,
    /// Compute dispatches recorded (cache-slot chunks only where a slot of theirs was used).
    pub dispatches: u64,
    /// Buffer-to-buffer copies recorded.
    pub copies: u64,
    pub readbacks: u64,
    /// Microseconds the host spent computing the experts VRAM lacked (CPU tier), while the GPU
    /// ran the layer's other experts.
    pub cpu_expert_us: u64,
    /// Microseconds the host waited for readbacks (the GPU still working).
    pub readback_wait_us: u64,
    /// Submissions whose commands were recorded while the GPU ran the token before.
    pub prerecorded: u64,
}

impl GpuCounters {
    /// Adds what `recorded` counted (a command buffer's dispatches and copies, once submitted).
    fn add_recorded(&mut self, recorded: &GpuCounters) {
        self.dispatches += recorded.dispatches;
        self.copies += recorded.copies;
    }

    /// What was counted since `earlier` (a snapshot of the same session's counters).
    pub fn since(&self, earlier: &GpuCounters) -> GpuCounters {
        GpuCounters {
            submits: self.submits - earlier.submits,
            dispatches: self.dispatches - earlier.dispatches,
            copies: self.copies - earlier.copies,
            readbacks: self.readbacks - earlier.readbacks,
            cpu_expert_us: self.cpu_expert_us - earlier.cpu_expert_us,
            readback_wait_us: self.readback_wait_us - earlier.readback_wait_us,
            prerecorded: self.prerecorded - earlier.prerecorded,
        }
    }
}

/// Activation buffers, sized for `max_block` tokens.
struct Activations {
    step: wgpu::Buffer,
    cos: wgpu::Buffer,
    sin: wgpu::Buffer,
    hidden: wgpu::Buffer,
    normed: wgpu::Buffer,
    /// The stacked q/k/v product: each token's queries, keys and values in one row.
    qkv: wgpu::Buffer,
    attention: wgpu::Buffer,
    attention_partials: wgpu::Buffer,
    /// A prompt block's pairs sorted into tiles by expert (`PairTiles`), for the grouped kernels.
    pair_order: wgpu::Buffer,
    pair_tiles: wgpu::Buffer,
    projected: wgpu::Buffer,
    router_logits: wgpu::Buffer,
    expert_ids: wgpu::Buffer,
    expert_weights: wgpu::Buffer,
    /// Cache slot of each (token, slot) pair, or `NO_SLOT` (VRAM cache only).
    slot_ids: wgpu::Buffer,
    /// A layer's routing ids (`[max_block, top_k]`) then its MoE input, read back to place its
    /// experts (VRAM cache only).
    routing_staging: wgpu::Buffer,
    gate_up: wgpu::Buffer,
    activated: wgpu::Buffer,
    down: wgpu::Buffer,
    last: wgpu::Buffer,
    final_normed: wgpu::Buffer,
    logits: wgpu::Buffer,
    top: wgpu::Buffer,
    staging: wgpu::Buffer,
    dummy: wgpu::Buffer,
    /// Router ids of every layer for the block (`[layers, block, top_k]`): always with every
    /// expert resident (read back with the head's top-k to count the experts used), else when
    /// tracing.
    routing_trace: Option<wgpu::Buffer>,
}

impl Activations {
    /// The buffers a prompt block's pairs are sorted into for the grouped expert kernels.
    fn pair_tiles(&self) -> PairTiles<'_> {
        PairTiles {
            order: &self.pair_order,
            tiles: &self.pair_tiles,
        }
    }
}

enum PlanStep {
    Dispatch(Dispatch),
    /// An expert kernel over one chunk of the VRAM cache's slots: recorded only when the layer
    /// placed an expert in one of them (the rest of its workgroups would only exit).
    SlotChunk {
        dispatch: Dispatch,
        slots: std::ops::Range<usize>,
    },
    /// Submit what came before, read back this layer's routing and place its experts.
    PlaceExperts {
        layer: usize,
    },
    /// Where the layer placed experts on the CPU tier: submit what came before (its GPU
    /// experts), then compute those on the host meanwhile.
    CpuExperts,
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

/// A session on the GPU: its KV cache, activations and plans over weights it may share with
/// the process's other sessions.
pub struct GpuModel<'m> {
    weights: Arc<GpuWeights<'m>>,
    /// The CPU tier's model: the expert store that fills the VRAM cache, and the CPU's expert
    /// kernels for misses.
    model: &'m Model,
    /// Cache slots the layer being run placed an expert in.
    used_slots: Vec<bool>,
    /// The next layer's experts as guessed from this layer's MoE input (VRAM cache only).
    guess: Option<Vec<Vec<usize>>>,
    /// Prefetches under way into the VRAM cache: each guessed expert's slot and its read.
    prefetching: Vec<(usize, ExpertKey, crate::experts::Pending)>,
    /// The experts the layer being run left to the CPU tier.
    cpu_misses: Option<CpuMisses>,
    placement: Vec<LayerPlacement>,
    config: Config,
    options: GpuTierOptions,
    act: Activations,
    /// KV cache of the layers the CPU tier runs after the GPU's, and the last position's
    /// residual for the CPU's head.
    cpu_cache: Option<super::KvCache>,
    cpu_last_hidden: Vec<f32>,
    kv: Vec<KvBuffers>,
    /// Plans by (block size, what its head leaves to read, if it runs the head).
    plans: HashMap<(usize, Option<HeadOutput>), Vec<PlanStep>>,
    len: usize,
    /// Tokens in the last block run.
    last_block: usize,
    pub counters: GpuCounters,
    /// Submit and check every kernel on its own (`PICCHIO_GPU_DEBUG=1`).
    debug: bool,
    /// Per-kernel device time (`GpuTierOptions::profile`).
    profiler: Option<Profiler>,
    /// The next decoded token's commands, recorded while the GPU ran the previous token.
    prepared: Option<PreparedDecode>,
}

/// A decode step's plan recorded ahead into a command buffer: its block key, and what recording
/// counted (added to the session's counters when it is submitted).
struct PreparedDecode {
    key: (usize, Option<HeadOutput>),
    commands: wgpu::CommandBuffer,
    counted: GpuCounters,
}

/// Records plan steps into `encoder`: consecutive dispatches share one compute pass (with a
/// `profiler`, each has a stamped pass of its own), copies go between passes; cache-slot chunks
/// only when a slot of theirs is `used`. Counts what it recorded into `counters`.
fn record(
    encoder: &mut wgpu::CommandEncoder,
    steps: &[PlanStep],
    used: &[bool],
    counters: &mut GpuCounters,
    mut profiler: Option<&mut Profiler>,
) {
    let mut pass: Option<wgpu::ComputePass<'static>> = None;
    for step in steps {
        let dispatch = match step {
            PlanStep::SlotChunk { dispatch, slots } if used[slots.clone()].contains(&true) => {
                Some(dispatch)
            }
            PlanStep::Dispatch(d) => Some(d),
            _ => None,
        };
        if let Some(dispatch) = dispatch {
            counters.dispatches += 1;
            if let Some(profiler) = profiler.as_deref_mut() {
                // A stamped pass of its own.
                pass = None;
                dispatch.record(&mut profiler.pass(encoder, (&dispatch.label, dispatch.bytes)));
            } else {
                let p = pass.get_or_insert_with(|| {
                    encoder
                        .begin_compute_pass(&Default::default())
                        .forget_lifetime()
                });
                dispatch.record(p);
            }
            continue;
        }
        match step {
            PlanStep::SlotChunk { .. } | PlanStep::Dispatch(_) => {}
            PlanStep::Copy {
                from,
                from_offset,
                to,
                to_offset,
                bytes,
            } => {
                pass = None;
                encoder.copy_buffer_to_buffer(from, *from_offset, to, *to_offset, *bytes);
                counters.copies += 1;
            }
            // Host actions: the plan is submitted up to them (where they have work).
            PlanStep::PlaceExperts { .. } | PlanStep::CpuExperts => {}
        }
    }
}

/// Records `steps` into a command buffer of their own (`record`), with the profiler's query
/// resolution at its end when there is one.
fn encode(
    ctx: &GpuContext,
    steps: &[PlanStep],
    used: &[bool],
    counters: &mut GpuCounters,
    mut profiler: Option<&mut Profiler>,
) -> wgpu::CommandBuffer {
    let mut encoder = ctx.device.create_command_encoder(&Default::default());
    record(&mut encoder, steps, used, counters, profiler.as_deref_mut());
    if let Some(profiler) = profiler {
        profiler.resolve(&mut encoder);
    }
    encoder.finish()
}

fn add(steps: &mut Vec<PlanStep>, dispatches: Vec<Dispatch>) {
    steps.extend(dispatches.into_iter().map(PlanStep::Dispatch));
}

/// Adds an expert kernel's per-chunk dispatches; for the VRAM cache, each tagged with its slots.
fn add_experts(
    steps: &mut Vec<PlanStep>,
    experts: &GpuExperts,
    cached: bool,
    dispatches: Vec<Dispatch>,
) {
    if !cached {
        return add(steps, dispatches);
    }
    for (dispatch, slots) in dispatches.into_iter().zip(experts.chunk_ranges()) {
        steps.push(PlanStep::SlotChunk { dispatch, slots });
    }
}

/// The VRAM cache's slot table, which a plan that places experts needs.
fn cache_table<'t>(table: &'t mut Option<&mut SlotTable>) -> Result<&'t mut SlotTable> {
    table
        .as_deref_mut()
        .ok_or_else(|| Error::Gpu("no VRAM expert cache".into()))
}

impl<'m> GpuModel<'m> {
    /// Uploads the model's weights (`GpuWeights::load`) and opens a session on them alone.
    pub fn new(ctx: GpuContext, model: &'m Model, options: GpuTierOptions) -> Result<GpuModel<'m>> {
        let weights = GpuWeights::load(ctx, model, &options)?;
        GpuModel::on(Arc::new(weights), options)
    }

    /// An empty session on `weights`, which it shares with every other session on them (their
    /// `vram_budget` and `gpu_layers` decided what they hold; `options` says the rest).
    pub fn on(weights: Arc<GpuWeights<'m>>, options: GpuTierOptions) -> Result<GpuModel<'m>> {
        let device = weights.ctx.device.clone();
        catching_oom(&device, "a session's activations and KV cache", || {
            Self::open(weights, options)
        })
    }

    /// The weights this session runs on.
    pub fn weights(&self) -> &Arc<GpuWeights<'m>> {
        &self.weights
    }

    /// The device this session runs on.
    pub fn ctx(&self) -> &GpuContext {
        &self.weights.ctx
    }

    /// How loading the weights onto the GPU went.
    pub fn load_report(&self) -> GpuLoad {
        self.weights.load_report()
    }

    fn open(weights: Arc<GpuWeights<'m>>, options: GpuTierOptions) -> Result<GpuModel<'m>> {
        let model = weights.model;
        let cfg = &model.config;
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
        let (ctx, layers) = (&weights.ctx, &weights.layers);
        let b = options.max_block;
        let (h, i, k) = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.experts_per_token,
        );
        let f = |n: usize| (n * 4) as u64;
        let zeroed = |label: &str, bytes: u64| ctx.zeroed(label, bytes);
        let top_bytes = f(2 * options.top_logits);
        let pair_bytes = PairTiles::bytes(b * k, cfg.num_experts);
        let act = Activations {
            step: ctx.uniform("step", &[0u8; 16]),
            cos: zeroed("cos", f(b * cfg.head_dim / 2))?,
            sin: zeroed("sin", f(b * cfg.head_dim / 2))?,
            hidden: zeroed("hidden", f(b * h))?,
            normed: zeroed("normed", f(b * h))?,
            qkv: zeroed("qkv", f(b * (cfg.q_dim() + 2 * cfg.kv_dim())))?,
            attention: zeroed("attention", f(b * cfg.q_dim()))?,
            // A decode's keys split across workgroups (flash-decoding) pass through here.
            attention_partials: zeroed(
                "attention partials",
                partials_bytes(cfg.num_heads, cfg.head_dim, 1, MAX_SPLITS),
            )?,
            projected: zeroed("projected", f(b * h))?,
            router_logits: zeroed("router logits", f(b * cfg.num_experts))?,
            expert_ids: zeroed("expert ids", f(b * k))?,
            expert_weights: zeroed("expert weights", f(b * k))?,
            slot_ids: zeroed("expert slots", f(b * k))?,
            routing_staging: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("routing staging"),
                size: f(b * k + b * h),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            pair_order: zeroed("pair order", pair_bytes.0)?,
            pair_tiles: zeroed("pair tiles", pair_bytes.1)?,
            gate_up: zeroed("gate_up", f(b * k * 2 * i))?,
            activated: zeroed("activated", f(b * k * i))?,
            down: zeroed("down", f(b * k * h))?,
            last: zeroed("last", f(h))?,
            final_normed: zeroed("final normed", f(h))?,
            logits: zeroed("logits", f(cfg.vocab_size))?,
            top: zeroed("top", top_bytes)?,
            staging: ctx.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("top staging"),
                // The top-k or every logit, then (every expert resident) every layer's routing ids.
                size: top_bytes.max(f(cfg.vocab_size)) + f(layers.len() * b * k),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
            dummy: zeroed("dummy", 4)?,
            routing_trace: None,
        };
        // Layers with every expert resident: their routing is read back with the head's output
        // (to count the experts they used).
        let routing_trace = if weights.resident_layers() > 0 {
            let bytes = layers.len() * options.max_block * cfg.experts_per_token * 4;
            Some(ctx.zeroed("routing trace", bytes as u64)?)
        } else {
            None
        };
        let act = Activations {
            routing_trace,
            ..act
        };
        let slots = weights.cached_experts().unwrap_or(0);
        let gpu_layers = layers.len();
        let mut gpu = GpuModel {
            model,
            used_slots: vec![false; slots],
            guess: None,
            prefetching: Vec::new(),
            cpu_misses: None,
            placement: (0..cfg.num_layers)
                .map(|layer| {
                    let tier = if layer < gpu_layers { "gpu" } else { "cpu" };
                    LayerPlacement {
                        layer,
                        attention: tier,
                        experts: tier,
                        residual: tier,
                        ..Default::default()
                    }
                })
                .collect(),
            cpu_cache: (gpu_layers < cfg.num_layers).then(|| {
                super::KvCache::with_layout(cfg, options.context, options.keep_all_positions)
            }),
            cpu_last_hidden: Vec::new(),
            config: cfg.clone(),
            options,
            act,
            kv: Vec::new(),
            plans: HashMap::new(),
            len: 0,
            last_block: 0,
            counters: GpuCounters::default(),
            debug: std::env::var("PICCHIO_GPU_DEBUG").is_ok_and(|v| v == "1"),
            profiler: None,
            prepared: None,
            weights,
        };
        if gpu.options.profile {
            gpu.profiler = Some(Profiler::new(&gpu.weights.ctx)?);
        }
        gpu.kv = (0..gpu_layers)
            .map(|l| gpu.new_kv(l, 0))
            .collect::<Result<_>>()?;
        Ok(gpu)
    }

    /// Counts the experts each layer with every expert resident used in the last block (`ids`:
    /// `[layers, n, top_k]`) as VRAM hits (the cache's layers count theirs as they place them).
    /// A router that chose no valid expert saw non-finite logits: the block is an error, which
    /// hands the session to the CPU tier (as a cached layer's placement does).
    fn count_resident_routing(&mut self, ids: &[u32]) -> Result<()> {
        let n = self.last_block;
        let k = self.config.experts_per_token;
        for (l, layer) in ids.chunks(n * k).enumerate() {
            if self.weights.layers[l].experts.is_none() {
                continue;
            }
            let mut used: Vec<usize> = layer.iter().map(|&e| e as usize).collect();
            used.sort_unstable();
            used.dedup();
            if let Some(&bad) = used.iter().find(|&&e| e >= self.config.num_experts) {
                return Err(Error::Gpu(format!(
                    "layer {l}: the router chose expert {bad} (non-finite router logits?)"
                )));
            }
            self.model.experts.count_vram_hits(l, &used);
            self.placement[l].vram_hits += used.len() as u64;
        }
        Ok(())
    }

    /// How this session's KV cache holds keys and values (`--kv-cache`).
    pub(super) fn kv_format(&self) -> crate::formats::KvFormat {
        self.model.kv_format
    }

    /// Bytes of one position's keys (or values) in a layer's KV buffer.
    fn kv_row_bytes(&self) -> u64 {
        (self.config.kv_dim() * self.kv_format().bytes_per_value()) as u64
    }

    /// Most positions one KV buffer can bind on this device.
    fn max_kv_positions(&self) -> usize {
        (self.weights.ctx.max_binding_bytes / self.kv_row_bytes()) as usize
    }

    /// KV buffers of layer `l` able to hold `needed` positions: a ring of window + block - 1 slots
    /// for sliding layers, every position (grown in steps) for full ones.
    fn new_kv(&self, l: usize, needed: usize) -> Result<KvBuffers> {
        // A sliding layer's ring must hold every key a block's queries read.
        let wanted = match self.config.window_of(l).filter(|_| self.rings(l)) {
            Some(w) => w + self.options.max_block - 1,
            None => needed.max(256).next_power_of_two(),
        }
        .min(self.options.context.max(1));
        let capacity = wanted.min(self.max_kv_positions());
        if self.rings(l) && capacity < wanted {
            return Err(Error::Gpu(format!(
                "layer {l}: a ring of {wanted} key positions exceeds this GPU's binding limit ({capacity})"
            )));
        }
        let bytes = capacity as u64 * self.kv_row_bytes();
        Ok(KvBuffers {
            keys: self.weights.ctx.zeroed(&format!("layer {l} keys"), bytes)?,
            values: self
                .weights
                .ctx
                .zeroed(&format!("layer {l} values"), bytes)?,
            capacity,
        })
    }

    /// Whether layer `l` keeps its keys in a ring (a sliding layer, unless the model keeps every
    /// position).
    fn rings(&self, l: usize) -> bool {
        self.config.window_of(l).is_some() && !self.options.keep_all_positions
    }

    /// Makes every cache but the rings hold `needed` positions (copying what it holds).
    fn ensure_kv(&mut self, needed: usize) -> Result<()> {
        let mut grown = false;
        for l in 0..self.kv.len() {
            if self.rings(l) || self.kv[l].capacity >= needed {
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
            let bytes = old.capacity as u64 * self.kv_row_bytes();
            let mut encoder = self
                .weights
                .ctx
                .device
                .create_command_encoder(&Default::default());
            encoder.copy_buffer_to_buffer(&old.keys, 0, &bigger.keys, 0, bytes);
            encoder.copy_buffer_to_buffer(&old.values, 0, &bigger.values, 0, bytes);
            self.weights.ctx.queue.submit([encoder.finish()]);
            self.counters.submits += 1;
            self.counters.copies += 2;
            self.kv[l] = bigger;
            grown = true;
        }
        if grown {
            // Bind groups point at the old buffers.
            self.plans.clear();
            self.prepared = None;
        }
        Ok(())
    }

    /// Experts in the VRAM cache's slots, when there is a cache (else every expert is resident).
    pub fn cached_experts(&self) -> Option<usize> {
        self.weights.cached_experts()
    }

    /// Experts held in VRAM: the cache's slots, or every expert of the GPU's layers.
    pub fn vram_experts(&self) -> usize {
        self.weights.vram_experts()
    }

    /// Where each layer ran so far.
    pub fn placement(&self) -> &[LayerPlacement] {
        &self.placement
    }

    /// Every kernel of a block of `n` tokens, in order.
    fn build_plan(&self, n: usize, head: Option<HeadOutput>) -> Result<Vec<PlanStep>> {
        let cfg = &self.config;
        let ctx = &self.weights.ctx;
        let a = &self.act;
        let (h, k) = (cfg.hidden_size, cfg.experts_per_token);
        let mut recorder = plan::PlanRecorder::new(self, n, Vec::new());
        self.record_layers(&mut recorder)?;
        let mut steps = recorder.finish()?;
        if let Some(output) = head {
            steps.push(PlanStep::Copy {
                from: a.hidden.clone(),
                from_offset: ((n - 1) * h * 4) as u64,
                to: a.last.clone(),
                to_offset: 0,
                bytes: (h * 4) as u64,
            });
            let lm_head = self
                .weights
                .lm_head
                .as_ref()
                .ok_or_else(|| Error::Gpu("the head is not on the GPU".into()))?;
            let eps = cfg.rms_norm_eps;
            let store = (&a.logits, Output::Store);
            // The final norm, taken into the head's product where its rows allow.
            let norm = Some(RowNorm {
                weight: &self.weights.final_norm,
                eps,
                scratch: Some(&a.final_normed),
            });
            let head = lm_head.prepare_product(ctx, (&a.last, 1), norm, None, store, &a.dummy)?;
            add(&mut steps, head);
            let read = match output {
                HeadOutput::Top => {
                    let top_k = self.options.top_logits;
                    let vocab = cfg.vocab_size;
                    add(
                        &mut steps,
                        vec![prepare_top_k(ctx, &a.logits, vocab, top_k, &a.top)?],
                    );
                    &a.top
                }
                HeadOutput::Logits => &a.logits,
            };
            let head_bytes = self.head_bytes(output);
            steps.push(PlanStep::Copy {
                from: read.clone(),
                from_offset: 0,
                to: a.staging.clone(),
                to_offset: 0,
                bytes: head_bytes,
            });
            if let Some(trace) = &a.routing_trace {
                steps.push(PlanStep::Copy {
                    from: trace.clone(),
                    from_offset: 0,
                    to: a.staging.clone(),
                    to_offset: head_bytes,
                    bytes: (self.weights.layers.len() * n * k * 4) as u64,
                });
            }
        }
        Ok(steps)
    }

    /// Bytes a head run leaves in the staging buffer before the routing ids.
    fn head_bytes(&self, output: HeadOutput) -> u64 {
        match output {
            HeadOutput::Top => 8 * self.options.top_logits as u64,
            HeadOutput::Logits => 4 * self.config.vocab_size as u64,
        }
    }

    /// Records the GPU's decoder layers over the block's residual stream into `tier`.
    fn record_layers<T: super::block::Tier<Act = plan::GpuAct>>(&self, tier: &mut T) -> Result<()> {
        let specs = &self.model.layer_specs;
        let mut hidden = plan::GpuAct::rows(&self.act.hidden, self.config.hidden_size);
        super::block::decoder_layers(tier, specs, 0..self.weights.layers.len(), &mut hidden)
    }

    /// The ops the GPU tier records for a block of `n` tokens through its layers, in order:
    /// what a test compares with the CPU tier's.
    pub fn layer_ops(&self, n: usize) -> Result<Vec<super::block::OpRecord>> {
        let mut tier = super::block::Recording::new(plan::PlanRecorder::new(self, n, Vec::new()));
        self.record_layers(&mut tier)?;
        Ok(tier.ops)
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
        if !self.run_tokens(tokens, HeadOutput::Top)? {
            let logits = self.model.head(&self.cpu_last_hidden);
            check_finite(&logits, self.len)?;
            return Ok(super::generate::step_of(&logits, top_logits));
        }
        self.prepare_decode_or_log(HeadOutput::Top);
        let top = self.read_top()?;
        // The device chose them: NaN in the logits leaves a non-finite value among the best two,
        // or no id at all (every comparison with NaN fails).
        let vocab = self.config.vocab_size;
        let best: Vec<f32> = (top.iter().take(2))
            .map(|&(id, logit)| {
                if id as usize >= vocab {
                    f32::NAN
                } else {
                    logit
                }
            })
            .collect();
        check_finite(&best, self.len)?;
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

    /// Runs `tokens` after what the cache holds; returns every logit of the last position (read
    /// back whole from the device, or computed by the CPU tier's head).
    pub fn feed_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let logits = if self.run_tokens(tokens, HeadOutput::Logits)? {
            self.prepare_decode_or_log(HeadOutput::Logits);
            bytemuck::pod_collect_to_vec(&self.read_head(HeadOutput::Logits)?)
        } else {
            self.model.head(&self.cpu_last_hidden)
        };
        check_finite(&logits, self.len)?;
        Ok(logits)
    }

    /// Builds the plans a prompt of `tokens` tokens and the decode after it record, which
    /// compiles their kernels: a timed run then measures the kernels, not their compilation
    /// (`bench`).
    pub fn prepare_plans(&mut self, tokens: usize) -> Result<()> {
        if tokens == 0 {
            return Ok(());
        }
        let gpu_head = self.weights.lm_head.is_some().then_some(HeadOutput::Top);
        let full = self.options.max_block;
        // The decode step, the prompt's full blocks (headless), its last block.
        let mut keys = vec![(1, gpu_head), ((tokens - 1) % full + 1, gpu_head)];
        if tokens > full {
            keys.push((full, None));
        }
        keys.into_iter().try_for_each(|key| self.ensure_plan(key))
    }

    /// Builds and keeps the plan of a block of `key.0` tokens whose head leaves `key.1`, unless
    /// it is kept already.
    fn ensure_plan(&mut self, key: (usize, Option<HeadOutput>)) -> Result<()> {
        if self.plans.contains_key(&key) {
            return Ok(());
        }
        // Plans of odd block sizes (prompt remainders) are not worth keeping forever.
        if self.plans.len() >= 8 {
            self.plans.retain(|key, _| key.0 == 1 && key.1.is_some());
        }
        let plan = self.scoped(|model| model.build_plan(key.0, key.1))?;
        self.plans.insert(key, plan);
        Ok(())
    }

    /// Runs `tokens` block by block, the last block through the GPU's head with `output` when
    /// the GPU holds the head (true), else leaving the last residual for the CPU's (false).
    fn run_tokens(&mut self, tokens: &[u32], output: HeadOutput) -> Result<bool> {
        validate_tokens(&self.config, self.len, tokens, self.options.context)?;
        let blocks: Vec<&[u32]> = tokens.chunks(self.options.max_block).collect();
        let last = blocks.len() - 1;
        let gpu_head = self.weights.lm_head.is_some();
        for (b, block) in blocks.into_iter().enumerate() {
            let head = (gpu_head && b == last).then_some(output);
            self.run_block(block, head, None)?;
        }
        Ok(gpu_head)
    }

    /// Forgets positions `keep..`. Fails (changing nothing) when a sliding layer's ring may have
    /// overwritten positions before `keep` that its queries would see: a model built with
    /// `keep_all_positions` can always be cut back.
    pub fn truncate(&mut self, keep: usize) -> Result<()> {
        if keep > self.len {
            return Err(Error::InvalidArgument(format!(
                "cannot keep {keep} positions of {}",
                self.len
            )));
        }
        let rings = (0..self.kv.len()).any(|l| self.rings(l));
        if keep < self.len && rings {
            return Err(Error::InvalidArgument(format!(
                "cannot cut the GPU KV cache back to {keep}: sliding layers keep a ring"
            )));
        }
        if let Some(cache) = &mut self.cpu_cache
            && !cache.truncate(keep)
        {
            return Err(Error::InvalidArgument(format!(
                "cannot cut the CPU tier's KV cache back to {keep}"
            )));
        }
        self.len = keep;
        Ok(())
    }

    /// Runs a block through the GPU's layers (and its head when `head` says what it leaves to
    /// read), then through the CPU tier's layers if it has some (recording them in `cpu_trace`).
    fn run_block(
        &mut self,
        tokens: &[u32],
        head: Option<HeadOutput>,
        cpu_trace: Option<&mut Vec<super::LayerTrace>>,
    ) -> Result<()> {
        let n = tokens.len();
        let needed = self.len + n;
        self.scoped(|model| model.ensure_kv(needed))?;
        let q = &self.weights.ctx.queue;
        q.write_buffer(
            &self.act.step,
            0,
            bytemuck::cast_slice(&[self.len as u32, 0, 0, 0]),
        );
        // The block's embedding rows, gathered on the host.
        let embedded = self.model.embed(tokens);
        q.write_buffer(&self.act.hidden, 0, bytemuck::cast_slice(&embedded));
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for t in 0..n {
            let (c, s) = self.weights.rope.cos_sin(self.len + t);
            cos.extend(c);
            sin.extend(s);
        }
        q.write_buffer(&self.act.cos, 0, bytemuck::cast_slice(&cos));
        q.write_buffer(&self.act.sin, 0, bytemuck::cast_slice(&sin));
        self.ensure_plan((n, head))?;
        // Out of the map while it runs: placing experts needs the model mutably.
        let plan = self.plans.remove(&(n, head)).unwrap_or_default();
        let weights = Arc::clone(&self.weights);
        let (turn, mut table) = weights.take_turn();
        let prepared = self.prepared.take().filter(|p| p.key == (n, head));
        let result = if self.debug {
            self.run_plan_debug(&plan, n, table.as_deref_mut())
        } else if let Some(prepared) = prepared {
            self.submit_prepared(prepared)
        } else {
            self.run_plan(&plan, n, table.as_deref_mut())
        };
        drop((turn, table));
        self.plans.insert((n, head), plan);
        result?;
        self.last_block = n;
        if let (Some(trace), None) = (&self.act.routing_trace, head) {
            // Blocks without a head have no readback of their own: count their routing here.
            let bytes = (self.weights.layers.len() * n * self.config.experts_per_token * 4) as u64;
            let ids: Vec<u32> =
                bytemuck::pod_collect_to_vec(&self.weights.ctx.read_back(trace, bytes)?);
            self.counters.readbacks += 1;
            self.count_resident_routing(&ids)?;
        }
        if self.weights.ctx.is_lost() {
            return Err(Error::Gpu("the GPU device was lost".into()));
        }
        if let Some(cache) = &mut self.cpu_cache {
            // The residual stream moves to the CPU for the layers the GPU does not hold.
            let h = self.config.hidden_size;
            let bytes = self
                .weights
                .ctx
                .read_back(&self.act.hidden, (n * h * 4) as u64)?;
            let mut hidden: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            self.counters.readbacks += 1;
            let layers = self.weights.layers.len()..self.config.num_layers;
            self.model
                .run_layers(cache, &mut hidden, layers, cpu_trace)?;
            cache.advance(n);
            self.cpu_last_hidden = hidden[(n - 1) * h..].to_vec();
        } else if self.weights.lm_head.is_none() {
            // Every layer ran here but the head did not fit: the CPU tier's head needs the last
            // position's residual.
            let h = self.config.hidden_size;
            let bytes = self
                .weights
                .ctx
                .read_back(&self.act.hidden, (n * h * 4) as u64)?;
            let hidden: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
            self.counters.readbacks += 1;
            self.cpu_last_hidden = hidden[(n - 1) * h..].to_vec();
        }
        // Only now: the CPU tier's layers, when there are some, hold the block too.
        self.len += n;
        Ok(())
    }

    /// Records the plan into one encoder per stretch between host actions: a placement (always:
    /// it reads the routing back) and CPU experts (when the layer left some to the CPU tier).
    fn run_plan(
        &mut self,
        plan: &[PlanStep],
        n: usize,
        mut table: Option<&mut SlotTable>,
    ) -> Result<()> {
        // Misses and a guess a failed block left are not this block's.
        self.cpu_misses = None;
        self.guess = None;
        let mut first = 0;
        for (i, step) in plan.iter().enumerate() {
            let acts = match step {
                PlanStep::PlaceExperts { .. } => true,
                PlanStep::CpuExperts => self.has_cpu_misses(),
                _ => false,
            };
            if !acts {
                continue;
            }
            self.submit(&plan[first..i])?;
            first = i + 1;
            match step {
                PlanStep::PlaceExperts { layer } => {
                    self.place_layer_experts(cache_table(&mut table)?, *layer, n)?
                }
                _ => self.run_cpu_misses()?,
            }
        }
        self.submit(&plan[first..])
    }

    /// Records `steps` into one encoder and submits it.
    fn submit(&mut self, steps: &[PlanStep]) -> Result<()> {
        let (counters, profiler) = (&mut self.counters, self.profiler.as_mut());
        let ctx = &self.weights.ctx;
        ctx.guard(|| {
            let commands = encode(ctx, steps, &self.used_slots, counters, profiler);
            ctx.queue.submit([commands]);
            Ok(())
        })?;
        self.counters.submits += 1;
        if let Some(profiler) = &mut self.profiler {
            profiler.collect(&self.weights.ctx)?;
        }
        Ok(())
    }

    /// Records the next single-token block's plan (head leaving `output`) while the GPU runs the
    /// block just submitted, so that decoding that token only writes its inputs and submits:
    /// where the plan submits once (every expert resident, no host action in between), and
    /// neither the debug mode nor a profiler records per kernel. The plan's inputs (embedding,
    /// position, rotary tables) are buffers written before the submission, so the same commands
    /// serve any token at any position.
    fn prepare_decode(&mut self, output: HeadOutput) -> Result<()> {
        self.prepared = None;
        let key = (1, Some(output));
        self.ensure_plan(key)?;
        let plan = &self.plans[&key];
        let acts =
            |step: &PlanStep| matches!(step, PlanStep::PlaceExperts { .. } | PlanStep::CpuExperts);
        if self.debug || self.profiler.is_some() || plan.iter().any(acts) {
            return Ok(());
        }
        let mut counted = GpuCounters::default();
        let ctx = &self.weights.ctx;
        let commands = ctx.guard(|| Ok(encode(ctx, plan, &self.used_slots, &mut counted, None)))?;
        self.prepared = Some(PreparedDecode {
            key,
            commands,
            counted,
        });
        Ok(())
    }

    /// `prepare_decode`, whose failure costs only the head start: the token just run stands, and
    /// the next one records its plan when it runs.
    fn prepare_decode_or_log(&mut self, output: HeadOutput) {
        if let Err(e) = self.prepare_decode(output) {
            self.prepared = None;
            log::warn!(
                "recording the next decode step ahead failed ({e}); it records when it runs"
            );
        }
    }

    /// Submits a decode step recorded ahead (`prepare_decode`).
    fn submit_prepared(&mut self, prepared: PreparedDecode) -> Result<()> {
        self.cpu_misses = None;
        self.guess = None;
        self.weights.ctx.guard(|| {
            self.weights.ctx.queue.submit([prepared.commands]);
            Ok(())
        })?;
        self.counters.submits += 1;
        self.counters.add_recorded(&prepared.counted);
        self.counters.prerecorded += 1;
        Ok(())
    }

    /// Per-kernel device time so far, when profiling.
    pub fn profile(&self) -> Option<&GpuProfile> {
        self.profiler.as_ref().map(|p| &p.profile)
    }

    /// The debug mode (`PICCHIO_GPU_DEBUG=1`): one submission per kernel, each checked for
    /// validation errors and timed, in the log at debug level. Slow; the results are the same.
    fn run_plan_debug(
        &mut self,
        plan: &[PlanStep],
        n: usize,
        mut table: Option<&mut SlotTable>,
    ) -> Result<()> {
        for (i, step) in plan.iter().enumerate() {
            match step {
                PlanStep::PlaceExperts { layer } => {
                    self.place_layer_experts(cache_table(&mut table)?, *layer, n)?;
                    continue;
                }
                PlanStep::CpuExperts => {
                    self.run_cpu_misses()?;
                    continue;
                }
                _ => {}
            }
            let scope = self
                .weights
                .ctx
                .device
                .push_error_scope(wgpu::ErrorFilter::Validation);
            let started = std::time::Instant::now();
            let mut encoder = self
                .weights
                .ctx
                .device
                .create_command_encoder(&Default::default());
            let (used, counters) = (&self.used_slots, &mut self.counters);
            record(
                &mut encoder,
                std::slice::from_ref(step),
                used,
                counters,
                None,
            );
            let label = match step {
                PlanStep::Dispatch(d) | PlanStep::SlotChunk { dispatch: d, .. } => d.label.as_str(),
                _ => "copy",
            };
            self.weights.ctx.queue.submit([encoder.finish()]);
            self.weights.ctx.wait()?;
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
        Ok(())
    }

    /// Maps `bytes` of `buffer` (a MAP_READ staging buffer the last submission filled) and
    /// copies them out.
    fn read_staging(&mut self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        let (sender, receiver) = std::sync::mpsc::channel();
        buffer.map_async(wgpu::MapMode::Read, ..bytes, move |r| {
            let _ = sender.send(r);
        });
        let started = Instant::now();
        self.weights.ctx.wait()?;
        self.counters.readback_wait_us += started.elapsed().as_micros() as u64;
        receiver
            .recv()
            .map_err(|_| Error::Gpu("readback never completed".into()))?
            .map_err(|e| Error::Gpu(format!("readback failed: {e}")))?;
        let out = buffer
            .get_mapped_range(..bytes)
            .map_err(|e| Error::Gpu(format!("readback mapping: {e}")))?
            .to_vec();
        buffer.unmap();
        self.counters.readbacks += 1;
        if self.weights.ctx.is_lost() {
            return Err(Error::Gpu("the GPU device was lost".into()));
        }
        Ok(out)
    }

    /// Reads the on-device top-k of the last head run: `(id, logit)`, largest first.
    fn read_top(&mut self) -> Result<Vec<(u32, f32)>> {
        let bytes = self.read_head(HeadOutput::Top)?;
        let words: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes);
        Ok(words
            .chunks_exact(2)
            .map(|w| (w[0], f32::from_bits(w[1])))
            .collect())
    }

    /// Reads what the last head run left (`output`), counting the block's routing where every
    /// expert is resident (read in the same mapping).
    fn read_head(&mut self, output: HeadOutput) -> Result<Vec<u8>> {
        let head_bytes = self.head_bytes(output) as usize;
        let counting = self.act.routing_trace.is_some();
        let routing_bytes = if counting {
            self.weights.layers.len() * self.last_block * self.config.experts_per_token * 4
        } else {
            0
        };
        let staging = self.act.staging.clone();
        let mut bytes = self.read_staging(&staging, (head_bytes + routing_bytes) as u64)?;
        if counting {
            let ids: Vec<u32> = bytemuck::pod_collect_to_vec(&bytes[head_bytes..]);
            self.count_resident_routing(&ids)?;
        }
        bytes.truncate(head_bytes);
        Ok(bytes)
    }

    /// Router top-k ids of every layer at every position of `prompt`, run from position 0 block
    /// by block, for A/B comparisons: `[layer][position][slot]`. Leaves the cache holding the prompt.
    pub fn trace_routing(&mut self, prompt: &[u32]) -> Result<Vec<Vec<Vec<u32>>>> {
        let (layers, k, block) = (
            self.weights.layers.len(),
            self.config.experts_per_token,
            self.options.max_block,
        );
        self.reset();
        // The host gathers the embedding rows: every id must name one.
        validate_tokens(&self.config, 0, prompt, self.options.context)?;
        let kept = self.act.routing_trace.clone();
        let trace = match &kept {
            Some(trace) => trace.clone(),
            None => self.scoped(|model| {
                model
                    .weights
                    .ctx
                    .zeroed("routing trace", (layers * block * k * 4) as u64)
            })?,
        };
        self.act.routing_trace = Some(trace.clone());
        self.plans.clear();
        let mut routing: Vec<Vec<Vec<u32>>> = vec![Vec::new(); self.config.num_layers];
        let mut result = Ok(());
        for chunk in prompt.chunks(block) {
            let mut cpu_layers = Vec::new();
            result =
                self.run_block(chunk, None, Some(&mut cpu_layers))
                    .and_then(|()| {
                        let used = layers * chunk.len() * k;
                        let ids: Vec<u32> = bytemuck::pod_collect_to_vec(
                            &self.weights.ctx.read_back(&trace, (used * 4) as u64)?,
                        );
                        for (l, layer) in ids.chunks(chunk.len() * k).enumerate() {
                            routing[l].extend(layer.chunks(k).map(|slots| slots.to_vec()));
                        }
                        // Layers the CPU tier ran: their routing, as ids.
                        for (trace, l) in cpu_layers.iter().zip(layers..) {
                            routing[l].extend(trace.routings.iter().map(|r| {
                                r.experts.iter().map(|&e| e as u32).collect::<Vec<u32>>()
                            }));
                        }
                        Ok(())
                    });
            if result.is_err() {
                break;
            }
        }
        self.act.routing_trace = kept;
        self.plans.clear();
        result.map(|()| routing)
    }

    /// Runs `operation` with out-of-memory and validation errors caught as errors (wgpu would
    /// otherwise report them to its default handler, which panics).
    fn scoped<T>(&mut self, operation: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let oom = self
            .weights
            .ctx
            .device
            .push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let validation = self
            .weights
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
        if let Some(cache) = &mut self.cpu_cache {
            *cache = super::KvCache::with_layout(
                &self.config,
                self.options.context,
                self.options.keep_all_positions,
            );
        }
    }

    /// Whether the KV cache keeps every position (`GpuTierOptions::keep_all_positions`).
    pub fn keeps_all_positions(&self) -> bool {
        self.options.keep_all_positions
    }

    /// Decoder layers the GPU runs (the first ones); the CPU tier runs the rest.
    pub fn gpu_layers(&self) -> usize {
        self.weights.layers.len()
    }
}
