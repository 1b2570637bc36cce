//! The GPU tier's side of the decoder layer: each op of `block` recorded as plan steps (kernel
//! dispatches, copies, and the host sync that places a layer's experts when VRAM caches them).
//! Every output lands in the activation buffer of its kind, sized for the largest block.

use super::weights::ResidentExperts;
use super::{GpuModel, PlanStep, add, add_experts};
use crate::arch::{Activation, AttentionSpec, ExpertSpec, RouterSpec};
use crate::error::{Error, Result};
use crate::gpu::attention::{AttentionInputs, AttentionShape, QkvRows, prepare_attention};
use crate::gpu::kernels::{
    Output, RouterWeights, RoutingBuffers, RowNorm, RowView, prepare_add, prepare_combine,
    prepare_head_norm, prepare_rms_norm, prepare_route, prepare_route_normed, prepare_sort_pairs,
    prepare_swiglu,
};
use crate::model::block::{Norm, Projection, Tier};

/// An activation of a block on the GPU: `width` values per position, `stride` floats apart in
/// `buffer` from `offset` on (the queries, keys and values share the rows of one product).
#[derive(Clone)]
pub struct GpuAct {
    pub buffer: wgpu::Buffer,
    pub width: usize,
    pub offset: usize,
    pub stride: usize,
    /// The rotary embedding is still to be applied: the attention kernels apply it as they read.
    pub rotate: bool,
}

impl GpuAct {
    /// `[positions, width]` values packed in `buffer`.
    pub fn rows(buffer: &wgpu::Buffer, width: usize) -> GpuAct {
        GpuAct {
            buffer: buffer.clone(),
            width,
            offset: 0,
            stride: width,
            rotate: false,
        }
    }

    /// The buffer, for an op that reads packed rows with nothing pending.
    fn packed(&self, op: &str) -> Result<&wgpu::Buffer> {
        if self.offset != 0 || self.stride != self.width || self.rotate {
            return Err(Error::Gpu(format!(
                "{op}: the GPU tier reads this activation only in attention"
            )));
        }
        Ok(&self.buffer)
    }
}

/// A layer's routing on the GPU: each (position, slot)'s expert id and weight.
pub struct GpuRouting {
    ids: wgpu::Buffer,
    weights: wgpu::Buffer,
}

/// Pairs per expert (on average) from which a prompt block's experts run grouped by expert.
const GROUPED_PAIRS_PER_EXPERT: usize = 4;

/// An op held back so that the op after it can take it into its own kernel (llama.cpp's graph
/// fusions): every other op records it first.
enum Deferred {
    /// The output projection of `x`: an `add` of it into the residual accumulates it in place.
    Output { layer: usize, x: GpuAct },
    /// RMSNorm of `x`: a product or a `route` of it computes it in its own kernel.
    Norm { layer: usize, norm: Norm, x: GpuAct },
    /// The resident down projection of the activated experts: a `combine` of it runs the
    /// product and the weighted sum in one kernel, except for a prompt block grouped by expert.
    Down { layer: usize, grouped: bool },
}

/// Records a block of `n` positions into plan steps.
pub struct PlanRecorder<'g, 'm> {
    gpu: &'g GpuModel<'m>,
    n: usize,
    steps: Vec<PlanStep>,
    deferred: Option<Deferred>,
}

impl<'g, 'm> PlanRecorder<'g, 'm> {
    pub fn new(gpu: &'g GpuModel<'m>, n: usize, steps: Vec<PlanStep>) -> Self {
        PlanRecorder {
            gpu,
            n,
            steps,
            deferred: None,
        }
    }

    /// The steps recorded, a deferred op included.
    pub fn finish(mut self) -> Result<Vec<PlanStep>> {
        self.flush()?;
        Ok(self.steps)
    }

    /// Records the deferred op, if any, as it would have been recorded at once.
    fn flush(&mut self) -> Result<()> {
        match self.deferred.take() {
            None => Ok(()),
            Some(Deferred::Output { layer, x }) => {
                let out = self.gpu.act.projected.clone();
                self.record_output(layer, &x, (&out, Output::Store))
            }
            Some(Deferred::Norm { layer, norm, x }) => self.record_norm(layer, norm, &x),
            Some(Deferred::Down { layer, grouped }) => self.record_down(layer, grouped),
        }
    }

    /// The resident experts of `layer`.
    fn resident(&self, layer: usize) -> Result<&'g ResidentExperts> {
        let gpu: &'g GpuModel<'m> = self.gpu;
        gpu.weights.layers[layer]
            .experts
            .as_ref()
            .ok_or_else(|| Error::Gpu(format!("layer {layer}: its experts are not resident")))
    }

    /// The resident down projection of every (token, slot) pair's activation into `down`, per
    /// pair or (`grouped`, a prompt block) grouped by expert.
    fn record_down(&mut self, layer: usize, grouped: bool) -> Result<()> {
        let (gpu, a) = (self.gpu, &self.gpu.act);
        let experts = self.resident(layer)?;
        let pairs = self.n * gpu.config.experts_per_token;
        let (ctx, bias) = (&gpu.weights.ctx, experts.down_bias.as_ref());
        if grouped {
            let input = (&a.activated, pairs);
            let down = experts.down.prepare_down_grouped(
                ctx,
                input,
                &a.pair_tiles(),
                bias,
                &a.down,
                &a.dummy,
            )?;
            if let Some(dispatch) = down {
                add(&mut self.steps, vec![dispatch]);
                return Ok(());
            }
        }
        let ids = &a.expert_ids;
        let dispatches =
            experts
                .down
                .prepare(ctx, &a.activated, 1, ids, pairs, bias, &a.down, &a.dummy)?;
        add(&mut self.steps, dispatches);
        Ok(())
    }

    /// A resident layer's gate_up and SwiGLU as one kernel (grouped by expert for a prompt block
    /// with several pairs per expert), its down projection deferred for `combine`; None where
    /// the layer's experts are cached or the fused kernels do not read their format or split.
    fn record_fused_experts(
        &mut self,
        layer: usize,
        spec: &ExpertSpec,
        x: &GpuAct,
        routing: &GpuRouting,
    ) -> Result<Option<GpuAct>> {
        let (gpu, a, n) = (self.gpu, &self.gpu.act, self.n);
        let Some(resident) = &gpu.weights.layers[layer].experts else {
            return Ok(None);
        };
        // The fused kernels apply GPT-OSS's SwiGLU to interleaved rows only.
        let Activation::ClampedSwiglu { alpha, limit } = spec.activation else {
            return Ok(None);
        };
        let (ctx, gate_up) = (&gpu.weights.ctx, &resident.gate_up);
        let input = (x.packed("experts")?, n, gpu.config.experts_per_token);
        let bias = resident.gate_up_bias.as_ref();
        // With few pairs per expert, most of a tile's pairs would be padding. Software adapters
        // compute rather than wait for the reads grouping saves, and a tile's padding costs them
        // arithmetic (the synthetic 20B's prompts ran slower grouped on lavapipe).
        let hardware = ctx.adapter.device_type != "Cpu";
        let grouped = gpu.options.group_prompt_experts.unwrap_or(hardware)
            && input.1 * input.2 >= GROUPED_PAIRS_PER_EXPERT * gate_up.experts;
        let (act, ids) = (&a.activated, &routing.ids);
        let (alpha_limit, dummy) = ((alpha, limit), &a.dummy);
        let tiles = a.pair_tiles();
        let fused = gate_up.prepare_gate_up_swiglu(
            ctx,
            input,
            ids,
            bias,
            alpha_limit,
            grouped.then_some(&tiles),
            act,
            dummy,
        )?;
        let Some(dispatch) = fused else {
            return Ok(None);
        };
        if grouped {
            let shape = (input.1, input.2, gate_up.experts);
            add(
                &mut self.steps,
                vec![prepare_sort_pairs(ctx, ids, shape, &tiles)?],
            );
        }
        add(&mut self.steps, vec![dispatch]);
        self.deferred = Some(Deferred::Down { layer, grouped });
        Ok(Some(Self::act(&a.down, spec.hidden)))
    }

    fn norm_weights(&self, layer: usize, norm: Norm) -> &wgpu::Buffer {
        let w = &self.gpu.weights.layers[layer];
        match norm {
            Norm::Input => &w.input_norm,
            Norm::PostAttention => &w.post_attention_norm,
        }
    }

    fn record_norm(&mut self, layer: usize, norm: Norm, x: &GpuAct) -> Result<()> {
        let (gpu, a) = (self.gpu, &self.gpu.act);
        let eps = gpu.config.rms_norm_eps;
        let weights = self.norm_weights(layer, norm);
        let (input, n) = (x.packed("rms_norm")?, self.n);
        let dispatch =
            prepare_rms_norm(&gpu.weights.ctx, input, weights, n, x.width, eps, &a.normed)?;
        add(&mut self.steps, vec![dispatch]);
        Ok(())
    }

    /// The output projection of `x` into `out`, stored or added to what `out` holds.
    fn record_output(
        &mut self,
        layer: usize,
        x: &GpuAct,
        out: (&wgpu::Buffer, Output),
    ) -> Result<()> {
        let (gpu, a) = (self.gpu, &self.gpu.act);
        let w = &gpu.weights.layers[layer];
        let input = (x.packed("project")?, self.n);
        let bias = w.o_bias.as_ref();
        let dispatches =
            w.o.prepare_product(&gpu.weights.ctx, input, None, bias, out, &a.dummy)?;
        add(&mut self.steps, dispatches);
        Ok(())
    }

    fn act(buffer: &wgpu::Buffer, width: usize) -> GpuAct {
        GpuAct::rows(buffer, width)
    }
}

impl Tier for PlanRecorder<'_, '_> {
    type Act = GpuAct;
    type Routing = GpuRouting;
    type Experts = GpuAct;

    /// In place on the stacked q/k/v product's rows, before the attention kernels rotate them.
    fn head_norm(
        &mut self,
        layer: usize,
        projection: Projection,
        x: &mut GpuAct,
        heads: usize,
    ) -> Result<()> {
        self.flush()?;
        let gpu = self.gpu;
        let w = &gpu.weights.layers[layer];
        let weights = match projection {
            Projection::Query => w.q_norm.as_ref(),
            Projection::Key => w.k_norm.as_ref(),
            Projection::Value | Projection::Output => None,
        };
        let (Some(weights), false) = (weights, x.rotate) else {
            return Err(Error::Gpu(format!(
                "layer {layer}: no per-head norm of {projection:?}, or rotated already"
            )));
        };
        let view = RowView {
            buffer: &x.buffer,
            offset: x.offset,
            stride: x.stride,
        };
        let shape = (self.n, heads, x.width / heads);
        let eps = gpu.config.rms_norm_eps;
        let dispatch = prepare_head_norm(&gpu.weights.ctx, &view, weights, shape, eps)?;
        add(&mut self.steps, vec![dispatch]);
        Ok(())
    }

    /// Deferred: the product or the router after it may take it into its own kernel.
    fn rms_norm(&mut self, layer: usize, norm: Norm, x: &GpuAct) -> Result<GpuAct> {
        self.flush()?;
        x.packed("rms_norm")?;
        self.deferred = Some(Deferred::Norm {
            layer,
            norm,
            x: x.clone(),
        });
        Ok(Self::act(&self.gpu.act.normed, x.width))
    }

    /// q, k and v as one product of the stacked matrix (the acts are views of its rows); the
    /// output projection deferred, for an `add` into the residual to accumulate in place.
    fn project<const N: usize>(
        &mut self,
        layer: usize,
        projections: [Projection; N],
        x: &GpuAct,
    ) -> Result<[GpuAct; N]> {
        let (gpu, a) = (self.gpu, &self.gpu.act);
        let w = &gpu.weights.layers[layer];
        let (matrix, bias, out) = match projections.as_slice() {
            [Projection::Query, Projection::Key, Projection::Value] => {
                (&w.qkv, &w.qkv_bias, &a.qkv)
            }
            [Projection::Output] => (&w.o, &w.o_bias, &a.projected),
            other => {
                return Err(Error::Gpu(format!(
                    "layer {layer}: the GPU tier projects q, k and v together or the output alone, not {other:?}"
                )));
            }
        };
        if matrix.cols != x.width {
            return Err(Error::Gpu(format!(
                "layer {layer} {projections:?}: {} inputs per position, the matrix takes {}",
                x.width, matrix.cols
            )));
        }
        if let [Projection::Output] = projections.as_slice() {
            self.flush()?;
            x.packed("project")?;
            self.deferred = Some(Deferred::Output {
                layer,
                x: x.clone(),
            });
        } else {
            // The deferred norm of the input, when it is `x`, taken into the product (or run
            // just before it, where the matrix cannot take it in).
            let (input, norm_weight) = match &self.deferred {
                Some(Deferred::Norm {
                    layer,
                    norm,
                    x: residual,
                }) if x.buffer == a.normed => {
                    let weight = self.norm_weights(*layer, *norm).clone();
                    (residual.clone(), Some(weight))
                }
                _ => {
                    self.flush()?;
                    (x.clone(), None)
                }
            };
            self.deferred = None;
            let eps = gpu.config.rms_norm_eps;
            let norm = norm_weight.as_ref().map(|weight| RowNorm {
                weight,
                eps,
                scratch: Some(&a.normed),
            });
            let dispatches = matrix.prepare_product(
                &gpu.weights.ctx,
                (input.packed("project")?, self.n),
                norm,
                bias.as_ref(),
                (out, Output::Store),
                &a.dummy,
            )?;
            add(&mut self.steps, dispatches);
        }
        let widths: [usize; N] = match projections.as_slice() {
            [Projection::Output] => [matrix.rows; N],
            _ => std::array::from_fn(|i| w.qkv_rows[i]),
        };
        let mut offset = 0;
        Ok(widths.map(|width| {
            let act = GpuAct {
                buffer: out.clone(),
                width,
                offset,
                stride: matrix.rows,
                rotate: false,
            };
            offset += width;
            act
        }))
    }

    /// Recorded as pending: the attention kernels rotate queries and keys as they read them.
    fn rope(&mut self, x: &mut GpuAct, heads: usize) -> Result<()> {
        self.flush()?;
        if x.rotate || heads == 0 || !x.width.is_multiple_of(2 * heads) {
            return Err(Error::Gpu(format!(
                "rope of {heads} heads over {} values (rotated already: {})",
                x.width, x.rotate
            )));
        }
        x.rotate = true;
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        spec: &AttentionSpec,
        queries: &GpuAct,
        keys: &GpuAct,
        values: &GpuAct,
    ) -> Result<GpuAct> {
        self.flush()?;
        let (gpu, a, n) = (self.gpu, &self.gpu.act, self.n);
        let kv = &gpu.kv[layer];
        let shape = AttentionShape {
            num_heads: spec.heads,
            num_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
            capacity: kv.capacity,
            window: spec.window,
            kv_format: gpu.kv_format(),
            splits: 1,
        };
        let shape = AttentionShape {
            splits: AttentionShape::splits_for(n, shape.most_visible_keys()),
            ..shape
        };
        let sinks = gpu.weights.layers[layer].sinks.as_ref();
        let ctx = &gpu.weights.ctx;
        let inputs = AttentionInputs {
            step: &a.step,
            rows: qkv_rows(queries, keys, values)?,
            cos: &a.cos,
            sin: &a.sin,
            keys: &kv.keys,
            values: &kv.values,
            partials: Some(&a.attention_partials),
        };
        let attend = prepare_attention(ctx, shape, n, &inputs, sinks, &a.attention)?;
        add(&mut self.steps, attend);
        Ok(Self::act(&a.attention, queries.width))
    }

    /// The deferred output projection, when `delta` is it, accumulates into `into` in place.
    fn add(&mut self, into: &mut GpuAct, delta: &GpuAct) -> Result<()> {
        if let Some(Deferred::Output { layer, x }) = &self.deferred
            && delta.buffer == self.gpu.act.projected
        {
            let (layer, x) = (*layer, x.clone());
            self.deferred = None;
            return self.record_output(layer, &x, (into.packed("add")?, Output::Accumulate));
        }
        self.flush()?;
        let dispatch = prepare_add(
            &self.gpu.weights.ctx,
            delta.packed("add")?,
            into.packed("add")?,
            self.n * into.width,
        )?;
        add(&mut self.steps, vec![dispatch]);
        Ok(())
    }

    /// One kernel for the deferred norm, when `x` is its output, the router and its top-k (where
    /// the router fits one binding), else the three kernels.
    fn route(&mut self, layer: usize, spec: &RouterSpec, x: &GpuAct) -> Result<GpuRouting> {
        let (gpu, a, n) = (self.gpu, &self.gpu.act, self.n);
        let w = &gpu.weights.layers[layer];
        let router = RouterWeights {
            matrix: &w.router,
            bias: w.router_bias.as_ref(),
            top_k: spec.top_k,
            gating: spec.gating,
        };
        let out = RoutingBuffers {
            logits: &a.router_logits,
            ids: &a.expert_ids,
            weights: &a.expert_weights,
        };
        let fused = match &self.deferred {
            Some(Deferred::Norm {
                layer,
                norm,
                x: residual,
            }) if x.buffer == a.normed => {
                let input = (residual.packed("route")?, n);
                let norm = (self.norm_weights(*layer, *norm), gpu.config.rms_norm_eps);
                let ctx = &gpu.weights.ctx;
                prepare_route_normed(ctx, input, norm, &a.normed, &router, &out)?
            }
            _ => None,
        };
        if let Some(dispatch) = fused {
            self.deferred = None;
            add(&mut self.steps, vec![dispatch]);
        } else {
            self.flush()?;
            let product = w.router.prepare(
                &gpu.weights.ctx,
                x.packed("route")?,
                n,
                w.router_bias.as_ref(),
                out.logits,
                &a.dummy,
            )?;
            add(&mut self.steps, product);
            let shape = (n, spec.experts, spec.top_k);
            let ctx = &gpu.weights.ctx;
            let route = prepare_route(ctx, out.logits, shape, spec.gating, out.ids, out.weights)?;
            add(&mut self.steps, vec![route]);
        }
        if let Some(trace) = &a.routing_trace {
            let bytes = (n * spec.top_k * 4) as u64;
            self.steps.push(PlanStep::Copy {
                from: a.expert_ids.clone(),
                from_offset: 0,
                to: trace.clone(),
                to_offset: layer as u64 * bytes,
                bytes,
            });
        }
        Ok(GpuRouting {
            ids: a.expert_ids.clone(),
            weights: a.expert_weights.clone(),
        })
    }

    /// Resident experts are picked by the routing ids on the device. Cached ones by the slot ids
    /// the host writes after reading the routing (and the MoE input, for the CPU's misses) back.
    fn experts(
        &mut self,
        layer: usize,
        spec: &ExpertSpec,
        x: &GpuAct,
        routing: &GpuRouting,
    ) -> Result<GpuAct> {
        self.flush()?;
        if let Some(experts) = self.record_fused_experts(layer, spec, x, routing)? {
            return Ok(experts);
        }
        let (gpu, a, n) = (self.gpu, &self.gpu.act, self.n);
        let k = gpu.config.experts_per_token;
        let pairs = n * k;
        let w = &gpu.weights.layers[layer];
        let (gate_up, gate_up_bias, down, down_bias, selector) =
            match (&w.experts, &gpu.weights.pool) {
                (Some(r), _) => (
                    &r.gate_up,
                    r.gate_up_bias.as_ref(),
                    &r.down,
                    r.down_bias.as_ref(),
                    &routing.ids,
                ),
                (None, Some(pool)) => {
                    let ids_capacity = (gpu.options.max_block * k * 4) as u64;
                    let staged = [
                        (&routing.ids, 0, (pairs * 4) as u64),
                        (&x.buffer, ids_capacity, (n * x.width * 4) as u64),
                    ];
                    for (from, to_offset, bytes) in staged {
                        self.steps.push(PlanStep::Copy {
                            from: from.clone(),
                            from_offset: 0,
                            to: a.routing_staging.clone(),
                            to_offset,
                            bytes,
                        });
                    }
                    self.steps.push(PlanStep::PlaceExperts { layer });
                    (
                        &pool.gate_up,
                        pool.gate_up_bias.as_ref(),
                        &pool.down,
                        pool.down_bias.as_ref(),
                        &a.slot_ids,
                    )
                }
                (None, None) => {
                    return Err(Error::Gpu(format!("layer {layer}: no experts in VRAM")));
                }
            };
        let cached = w.experts.is_none();
        let ctx = &gpu.weights.ctx;
        let dispatches = gate_up.prepare(
            ctx,
            x.packed("experts")?,
            k,
            selector,
            pairs,
            gate_up_bias,
            &a.gate_up,
            &a.dummy,
        )?;
        add_experts(&mut self.steps, gate_up, cached, dispatches);
        let shape = (pairs, spec.intermediate);
        let swiglu = prepare_swiglu(ctx, &a.gate_up, shape, spec.activation, &a.activated)?;
        add(&mut self.steps, vec![swiglu]);
        let dispatches = down.prepare(
            ctx,
            &a.activated,
            1,
            selector,
            pairs,
            down_bias,
            &a.down,
            &a.dummy,
        )?;
        add_experts(&mut self.steps, down, cached, dispatches);
        if cached {
            self.steps.push(PlanStep::CpuExperts);
        }
        Ok(Self::act(&a.down, spec.hidden))
    }

    fn combine(
        &mut self,
        hidden: &mut GpuAct,
        routing: &GpuRouting,
        experts: GpuAct,
    ) -> Result<()> {
        if let Some(Deferred::Down {
            layer,
            grouped: false,
        }) = self.deferred
            && experts.buffer == self.gpu.act.down
        {
            let (gpu, a) = (self.gpu, &self.gpu.act);
            let resident = self.resident(layer)?;
            let input = (&a.activated, self.n, gpu.config.experts_per_token);
            let fused = resident.down.prepare_down_combine(
                &gpu.weights.ctx,
                input,
                (&routing.ids, &routing.weights),
                resident.down_bias.as_ref(),
                hidden.packed("combine")?,
                &a.dummy,
            )?;
            if let Some(dispatch) = fused {
                self.deferred = None;
                add(&mut self.steps, vec![dispatch]);
                return Ok(());
            }
        }
        self.flush()?;
        let k = self.gpu.config.experts_per_token;
        let buffers = (&routing.ids, &routing.weights, &experts.buffer);
        let shape = (self.n, k, hidden.width);
        let into = hidden.packed("combine")?;
        let dispatch = prepare_combine(&self.gpu.weights.ctx, buffers, shape, into)?;
        add(&mut self.steps, vec![dispatch]);
        Ok(())
    }
}

/// The rows the attention kernels read: queries, keys and values must be views of one product.
fn qkv_rows<'b>(queries: &'b GpuAct, keys: &GpuAct, values: &GpuAct) -> Result<QkvRows<'b>> {
    let same_rows = [keys, values]
        .iter()
        .all(|act| act.buffer == queries.buffer && act.stride == queries.stride);
    if !same_rows || values.rotate {
        return Err(Error::Gpu(
            "attention: queries, keys and values must be rows of one product, values unrotated"
                .into(),
        ));
    }
    Ok(QkvRows {
        buffer: &queries.buffer,
        stride: queries.stride,
        query: queries.offset,
        key: keys.offset,
        value: values.offset,
        rotate_query: queries.rotate,
        rotate_key: keys.rotate,
    })
}
