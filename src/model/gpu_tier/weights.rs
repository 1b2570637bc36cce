//! What every session on one device shares: the dense weights, uploaded once per process, and the
//! experts (every one resident, or a VRAM cache whose slot table the sessions take turns with).

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::placement::{ExpertPool, SlotTable};
use super::{GpuLoad, GpuTierOptions};
use crate::cpu::rope::RopeTable;
use crate::error::{Error, Result};
use crate::experts::VramBudget;
use crate::gpu::GpuContext;
use crate::gpu::kernels::{GpuExperts, GpuMatrix};
use crate::model::Model;

pub(super) struct GpuLayer {
    pub input_norm: wgpu::Buffer,
    pub post_attention_norm: wgpu::Buffer,
    /// q, k and v stacked by rows: one product gives a token's queries, keys and values.
    pub qkv: GpuMatrix,
    /// Rows of q, k and v in `qkv`.
    pub qkv_rows: [usize; 3],
    pub qkv_bias: Option<wgpu::Buffer>,
    pub o: GpuMatrix,
    pub o_bias: Option<wgpu::Buffer>,
    /// Per-head RMSNorm weights of the queries and keys (Qwen3-MoE).
    pub q_norm: Option<wgpu::Buffer>,
    pub k_norm: Option<wgpu::Buffer>,
    pub sinks: Option<wgpu::Buffer>,
    pub router: GpuMatrix,
    pub router_bias: Option<wgpu::Buffer>,
    /// The layer's experts, when every expert is resident (else the weights' `ExpertPool`).
    pub experts: Option<ResidentExperts>,
}

/// Every expert of a layer, with its biases (`[experts, rows]`) where it has them.
pub(super) struct ResidentExperts {
    pub gate_up: GpuExperts,
    pub gate_up_bias: Option<wgpu::Buffer>,
    pub down: GpuExperts,
    pub down_bias: Option<wgpu::Buffer>,
}

/// A model's weights on one device, shared by every session opened on them
/// (`GpuModel::on`).
pub struct GpuWeights<'m> {
    pub ctx: GpuContext,
    /// The CPU tier's model: the expert store that fills the VRAM cache, and the CPU's expert
    /// kernels for misses.
    pub(super) model: &'m Model,
    pub(super) layers: Vec<GpuLayer>,
    /// The head, when the GPU runs every layer and holds it.
    pub(super) lm_head: Option<GpuMatrix>,
    pub(super) final_norm: wgpu::Buffer,
    /// The VRAM expert cache, when not every expert is resident.
    pub(super) pool: Option<ExpertPool>,
    /// Serializes the sessions' blocks: a block places experts in the cache's slots and uses
    /// them until its last submission, so no other session may reassign them meanwhile.
    turn: Mutex<()>,
    pub(super) rope: RopeTable,
    load: GpuLoad,
}

/// Bytes one cached expert takes in VRAM: weights, scales and f32 biases of both projections.
pub fn vram_bytes_per_expert(model: &Model) -> u64 {
    let first = &model.weights.layers[0];
    let per = |m: &crate::weights::ExpertMatrices| m.bytes() / m.experts().max(1);
    (per(&first.gate_up) + per(&first.down) + model.weights.expert_bias_bytes()) as u64
}

pub(super) fn f32s(ctx: &GpuContext, label: &str, values: &[f32]) -> Result<wgpu::Buffer> {
    ctx.try_upload_f32(label, values)
}

/// `values` uploaded, where the layer has them (sinks, biases, head norms).
pub(super) fn optional_f32s(
    ctx: &GpuContext,
    label: &str,
    values: &Option<Vec<f32>>,
) -> Result<Option<wgpu::Buffer>> {
    values.as_ref().map(|v| f32s(ctx, label, v)).transpose()
}

/// Runs `operation` with out-of-memory errors caught; `what` names what did not fit.
pub(super) fn catching_oom<T>(
    device: &wgpu::Device,
    what: &str,
    operation: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let result = operation();
    match (pollster::block_on(scope.pop()), result) {
        (Some(error), _) => Err(Error::Gpu(format!(
            "{what} do not fit in GPU memory: {error}"
        ))),
        (None, result) => result,
    }
}

/// The dense weights a device took: the first layers, and the head when every layer fit. The
/// embeddings stay on the host, which gathers a block's rows (a few KB per token) and uploads
/// them with the block: no kernel, and no VRAM for a table as large as the head.
struct Dense {
    layers: Vec<GpuLayer>,
    lm_head: Option<GpuMatrix>,
}

impl<'m> GpuWeights<'m> {
    /// Uploads the dense weights, then the experts: all of them, or a VRAM cache of as many as
    /// `options.vram_budget` allows. Fails (without panicking) when the dense weights do not fit.
    pub fn load(ctx: GpuContext, model: &'m Model, options: &GpuTierOptions) -> Result<Self> {
        if let Some(mode) = model.cpu_only_mode() {
            return Err(Error::InvalidArgument(format!(
                "{mode} runs on the CPU tier only"
            )));
        }
        let started = Instant::now();
        ctx.start_progress("uploading weights to the GPU", model.weights.bytes() as u64);
        let dense = catching_oom(&ctx.device, "the dense weights", || {
            upload_dense(&ctx, model, options)
        })?;
        let final_norm = f32s(&ctx, "final norm", &model.weights.final_norm)?;
        let mut weights = GpuWeights {
            model,
            layers: dense.layers,
            lm_head: dense.lm_head,
            final_norm,
            pool: None,
            turn: Mutex::new(()),
            rope: RopeTable::new(&model.config),
            load: GpuLoad::default(),
            ctx,
        };
        let placed = weights.place_experts_in_vram(options);
        weights.ctx.flush_uploads();
        weights.ctx.end_progress();
        placed?;
        let uploads = &weights.ctx.uploads;
        weights.load = GpuLoad {
            seconds: started.elapsed().as_secs_f64(),
            uploaded_bytes: uploads.total_bytes(),
            peak_staging_bytes: uploads.peak_staged_bytes(),
        };
        log::info!(
            "{:.2} GB uploaded to the GPU in {:.1} s (at most {} MiB staged at once)",
            weights.load.uploaded_bytes as f64 / 1e9,
            weights.load.seconds,
            weights.load.peak_staging_bytes >> 20
        );
        Ok(weights)
    }

    /// How loading onto the GPU went.
    pub fn load_report(&self) -> GpuLoad {
        self.load
    }

    /// Decoder layers the GPU runs (the first ones); the CPU tier runs the rest.
    pub fn gpu_layers(&self) -> usize {
        self.layers.len()
    }

    /// Experts in the VRAM cache's slots, when there is a cache (else every expert is resident).
    pub fn cached_experts(&self) -> Option<usize> {
        self.pool.as_ref().map(ExpertPool::slots)
    }

    /// Experts held in VRAM: every expert of the resident layers, and the cache's slots.
    pub fn vram_experts(&self) -> usize {
        self.resident_layers() * self.model.config.num_experts + self.cached_experts().unwrap_or(0)
    }

    /// Layers whose every expert is resident (the first ones): they run without a host sync.
    pub fn resident_layers(&self) -> usize {
        self.layers.iter().filter(|l| l.experts.is_some()).count()
    }

    /// Waits for this process's other sessions to finish their block on these weights, then
    /// holds the VRAM cache's slot table (when there is a cache) until the guard is dropped.
    pub(super) fn take_turn(&self) -> (MutexGuard<'_, ()>, Option<MutexGuard<'_, SlotTable>>) {
        // A session that panicked mid-block left nothing half-written the next one relies on:
        // a slot answers for its expert only once written.
        let turn = self.turn.lock().unwrap_or_else(PoisonError::into_inner);
        let table = self.pool.as_ref().map(ExpertPool::lock_table);
        (turn, table)
    }

    /// Puts every expert in VRAM when the budget allows, else a cache of as many slots as it
    /// does. `Auto` tries every expert, then halves the cache until the device takes it.
    fn place_experts_in_vram(&mut self, options: &GpuTierOptions) -> Result<()> {
        let (cfg, weights) = (&self.model.config, &self.model.weights);
        let total = self.layers.len() * cfg.num_experts;
        let first = &weights.layers[0];
        // An empty pool tells whether these experts can be cached at all.
        let probe = (
            GpuExperts::pool(&self.ctx, "probe", &first.gate_up, 0),
            GpuExperts::pool(&self.ctx, "probe", &first.down, 0),
        );
        let per_slot = match &probe {
            (Ok(_), Ok(_)) => vram_bytes_per_expert(self.model),
            _ => u64::MAX, // experts a cache cannot hold: all resident or none
        };
        let slots_for = |bytes: f64| ((bytes / per_slot as f64).floor() as usize).min(total);
        let mut slots = match options.vram_budget {
            VramBudget::Bytes(b) => slots_for(b as f64),
            VramBudget::Percent(p) => slots_for(per_slot as f64 * total as f64 * p / 100.0),
            VramBudget::Auto => {
                // A software adapter's memory is the host's: leave half of what is available.
                let all = per_slot.saturating_mul(total as u64);
                match crate::experts::available_memory_bytes() {
                    Some(a) if self.ctx.adapter.device_type == "Cpu" && all > a / 2 => {
                        slots_for(a as f64 / 2.0)
                    }
                    _ => total,
                }
            }
        };
        let experts = cfg.num_experts;
        loop {
            let attempt = if slots >= total {
                self.upload_resident_experts(self.layers.len())
            } else {
                let whole = resident_layers(slots, experts);
                self.upload_resident_experts(whole)
                    .and_then(|()| self.make_pool(slots - whole * experts))
            };
            match attempt {
                Ok(()) => break,
                // Only a device short of memory is worth a smaller try.
                Err(e @ Error::Gpu(_)) if options.vram_budget == VramBudget::Auto && slots > 0 => {
                    log::info!("VRAM expert cache of {slots} experts: {e}; trying half");
                    for layer in &mut self.layers {
                        layer.experts = None;
                    }
                    self.pool = None;
                    slots = slots.min(total) / 2;
                }
                Err(e) => return Err(e),
            }
        }
        let held = self.vram_experts();
        let bytes = held as u64 * vram_bytes_per_expert(self.model);
        log::info!(
            "VRAM holds {held} of {total} experts ({:.2} GB){}",
            bytes as f64 / 1e9,
            match self.cached_experts() {
                Some(slots) => format!(
                    ": every expert of layers 0..{}, a cache of {slots} for the rest (misses: {})",
                    self.resident_layers(),
                    format!("{:?}", options.miss_policy).to_lowercase()
                ),
                None => String::new(),
            }
        );
        Ok(())
    }

    /// Uploads every expert of the first `count` layers (a converted store's records checked
    /// against their hashes first).
    fn upload_resident_experts(&mut self, count: usize) -> Result<()> {
        (0..count).try_for_each(|l| self.model.experts.check_layer_records(l))?;
        let weights = &self.model.weights;
        let (ctx, layers) = (&self.ctx, &mut self.layers);
        catching_oom(&ctx.device, "every expert", || {
            let pairs = layers.iter_mut().zip(&weights.layers).take(count);
            for (l, (layer, w)) in pairs.enumerate() {
                let name = |s: &str| format!("layer {l} {s}");
                layer.experts = Some(ResidentExperts {
                    gate_up: GpuExperts::upload(ctx, &name("gate_up"), &w.gate_up)?,
                    gate_up_bias: optional_f32s(ctx, &name("gate_up bias"), &w.gate_up_bias)?,
                    down: GpuExperts::upload(ctx, &name("down"), &w.down)?,
                    down_bias: optional_f32s(ctx, &name("down bias"), &w.down_bias)?,
                });
            }
            Ok(())
        })
    }

    fn make_pool(&mut self, slots: usize) -> Result<()> {
        let cfg = &self.model.config;
        let first = &self.model.weights.layers[0];
        let ctx = &self.ctx;
        let what = format!("{slots} cached experts");
        let pool = catching_oom(&ctx.device, &what, || {
            let f = |n: usize| (n.max(1) * 4) as u64;
            let biases = match first.down_bias {
                Some(_) => Some([
                    ctx.zeroed("cached gate_up bias", f(slots * 2 * cfg.intermediate_size))?,
                    ctx.zeroed("cached down bias", f(slots * cfg.hidden_size))?,
                ]),
                None => None,
            };
            Ok(ExpertPool::new(
                GpuExperts::pool(ctx, "cached gate_up", &first.gate_up, slots)?,
                GpuExperts::pool(ctx, "cached down", &first.down, slots)?,
                biases,
                slots,
            ))
        })?;
        self.pool = Some(pool);
        Ok(())
    }
}

/// How many whole layers of `experts` experts a VRAM budget of `slots` experts (less than every
/// layer's) holds resident, the rest of it caching the other layers' experts. A resident layer
/// needs no routing readback; under routing spread evenly over the experts, the misses of the
/// other layers are about the same whether the budget goes to whole layers or to cache slots,
/// so whole layers win on syncs. One layer's worth of slots stays in the cache so that a prompt
/// block can still upload every expert a layer chooses.
fn resident_layers(slots: usize, experts: usize) -> usize {
    slots.saturating_sub(experts) / experts.max(1)
}

/// q, k and v's biases stacked as their rows are, zeros standing in for a missing one; None when
/// none has a bias.
fn stacked_bias(
    ctx: &GpuContext,
    name: &str,
    w: &crate::weights::LayerWeights,
) -> Result<Option<wgpu::Buffer>> {
    let parts = [
        (&w.q_bias, w.q.rows),
        (&w.k_bias, w.k.rows),
        (&w.v_bias, w.v.rows),
    ];
    if parts.iter().all(|(bias, _)| bias.is_none()) {
        return Ok(None);
    }
    let mut stacked = Vec::new();
    for (bias, rows) in parts {
        match bias {
            Some(values) => stacked.extend_from_slice(values),
            None => stacked.resize(stacked.len() + rows, 0.0),
        }
    }
    f32s(ctx, name, &stacked).map(Some)
}

/// Uploads layer `l`'s dense weights (its experts come later).
fn upload_layer(ctx: &GpuContext, l: usize, w: &crate::weights::LayerWeights) -> Result<GpuLayer> {
    let name = |s: &str| format!("layer {l} {s}");
    let optional = |b: &Option<Vec<f32>>, s: &str| optional_f32s(ctx, &name(s), b);
    Ok(GpuLayer {
        input_norm: f32s(ctx, &name("input norm"), &w.input_norm)?,
        post_attention_norm: f32s(ctx, &name("post norm"), &w.post_attention_norm)?,
        qkv: GpuMatrix::upload_stacked(ctx, &name("q/k/v"), &[&w.q, &w.k, &w.v])?,
        qkv_rows: [w.q.rows, w.k.rows, w.v.rows],
        qkv_bias: stacked_bias(ctx, &name("q/k/v bias"), w)?,
        o: GpuMatrix::upload(ctx, &name("o"), &w.o)?,
        o_bias: optional(&w.o_bias, "o bias")?,
        q_norm: optional(&w.q_norm, "q norm")?,
        k_norm: optional(&w.k_norm, "k norm")?,
        sinks: optional(&w.sinks, "sinks")?,
        router: GpuMatrix::upload(ctx, &name("router"), &w.router)?,
        router_bias: optional(&w.router_bias, "router bias")?,
        experts: None,
    })
}

/// Uploads layer by layer while they fit (a software adapter's memory is
/// the host's: half of what is available; a GPU says when it is out of memory), then the head
/// if every layer fit.
fn upload_dense(ctx: &GpuContext, model: &Model, options: &GpuTierOptions) -> Result<Dense> {
    let (cfg, weights) = (&model.config, &model.weights);
    let dense_of = |w: &crate::weights::LayerWeights| -> u64 {
        [&w.q, &w.k, &w.v, &w.o, &w.router]
            .iter()
            .map(|m| m.data.bytes().len() as u64)
            .sum()
    };
    let mut room = match crate::experts::available_memory_bytes() {
        Some(a) if ctx.adapter.device_type == "Cpu" => a / 2,
        _ => u64::MAX,
    };
    let mut take = |bytes: u64| -> bool {
        let fits = bytes <= room;
        room = room.saturating_sub(bytes);
        fits
    };
    let wanted = options
        .gpu_layers
        .unwrap_or(cfg.num_layers)
        .min(cfg.num_layers);
    let mut layers = Vec::with_capacity(wanted);
    for (l, w) in weights.layers.iter().enumerate().take(wanted) {
        if options.gpu_layers.is_none() && !take(dense_of(w)) {
            break;
        }
        match catching_oom(&ctx.device, &format!("layer {l}"), || {
            upload_layer(ctx, l, w)
        }) {
            Ok(layer) => layers.push(layer),
            Err(e) if options.gpu_layers.is_none() => {
                log::info!("{e}: the CPU tier runs layers {l} and up");
                break;
            }
            Err(e) => return Err(e),
        }
    }
    if layers.is_empty() {
        return Err(Error::Gpu(if options.gpu_layers == Some(0) {
            "--gpu-layers 0 leaves the GPU nothing to run (use --backend cpu)".into()
        } else {
            "not even one layer's dense weights fit in GPU memory".into()
        }));
    }
    let lm_head =
        if layers.len() == cfg.num_layers && take(weights.lm_head.data.bytes().len() as u64) {
            catching_oom(&ctx.device, "lm_head", || {
                GpuMatrix::upload(ctx, "lm_head", &weights.lm_head)
            })
            .inspect_err(|e| log::info!("{e}: the CPU tier runs the head"))
            .ok()
        } else {
            None
        };
    if layers.len() < cfg.num_layers {
        log::info!(
            "the GPU runs layers 0..{}, the CPU tier layers {}..{} and the head",
            layers.len(),
            layers.len(),
            cfg.num_layers
        );
    }
    Ok(Dense { layers, lm_head })
}
