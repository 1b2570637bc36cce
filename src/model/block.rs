//! The decoder layer, written once. Each op goes to a [`Tier`]: the CPU tier executes it at once
//! (`cpu_tier`), the GPU tier records it into the plan it submits later (`gpu_tier`). Where each
//! op runs is the tier's and the planner's business; the op sequence is this file's.

use crate::arch::{AttentionSpec, ExpertSpec, LayerSpec, RouterSpec};
use crate::error::Result;

/// A layer's RMSNorm weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// Before attention.
    Input,
    /// Before the mixture of experts.
    PostAttention,
}

/// A layer's attention projections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Projection {
    Query,
    Key,
    Value,
    Output,
}

/// Points of a layer where a tier may look at the residual stream (traces, the next layer's
/// expert guess).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    AfterAttention,
    AfterExperts,
}

/// The ops a decoder layer is made of, over a block of positions. `Act` is a tier's handle to an
/// activation of the block (`[positions, width]`).
pub trait Tier {
    type Act;
    /// Each position's experts and their weights.
    type Routing;
    /// The experts' outputs, ready to be combined into the residual.
    type Experts;

    /// RMSNorm of every row of `x` with layer `layer`'s `norm` weights.
    fn rms_norm(&mut self, layer: usize, norm: Norm, x: &Self::Act) -> Result<Self::Act>;

    /// `x` times each of layer `layer`'s `projections`, each bias added where the checkpoint has
    /// one: one output per projection (a tier may run them as one product).
    fn project<const N: usize>(
        &mut self,
        layer: usize,
        projections: [Projection; N],
        x: &Self::Act,
    ) -> Result<[Self::Act; N]>;

    /// RMSNorm of each of the `heads` heads of every row of `x` with layer `layer`'s per-head
    /// weights of `projection` (Qwen3's `q_norm` and `k_norm`).
    fn head_norm(
        &mut self,
        layer: usize,
        projection: Projection,
        x: &mut Self::Act,
        heads: usize,
    ) -> Result<()>;

    /// Rotary embedding of every head of every row of `x`, at the block's positions.
    fn rope(&mut self, x: &mut Self::Act, heads: usize) -> Result<()>;

    /// Stores the block's keys and values in layer `layer`'s cache and attends every query to
    /// the keys it sees (sinks and window as `spec` says).
    fn attention(
        &mut self,
        layer: usize,
        spec: &AttentionSpec,
        queries: &Self::Act,
        keys: &Self::Act,
        values: &Self::Act,
    ) -> Result<Self::Act>;

    /// `into += delta`.
    fn add(&mut self, into: &mut Self::Act, delta: &Self::Act) -> Result<()>;

    /// Router `layer`'s choice of experts for every row of `x`.
    fn route(&mut self, layer: usize, spec: &RouterSpec, x: &Self::Act) -> Result<Self::Routing>;

    /// Every chosen expert of layer `layer` over the rows of `x` that chose it (placing, fetching
    /// and guessing the next layer's experts as the tier does).
    fn experts(
        &mut self,
        layer: usize,
        spec: &ExpertSpec,
        x: &Self::Act,
        routing: &Self::Routing,
    ) -> Result<Self::Experts>;

    /// `hidden += ` each row's experts' outputs times their weights, in ascending expert order.
    fn combine(
        &mut self,
        hidden: &mut Self::Act,
        routing: &Self::Routing,
        experts: Self::Experts,
    ) -> Result<()>;

    /// The residual stream of layer `layer` at `point`.
    fn observe(&mut self, layer: usize, point: Point, hidden: &Self::Act) -> Result<()> {
        let _ = (layer, point, hidden);
        Ok(())
    }
}

/// Decoder layer `layer` over the residual stream `hidden` of a block.
pub fn decoder_layer<T: Tier>(
    tier: &mut T,
    layer: usize,
    spec: &LayerSpec,
    hidden: &mut T::Act,
) -> Result<()> {
    let attention = &spec.attention;
    let normed = tier.rms_norm(layer, Norm::Input, hidden)?;
    let qkv = [Projection::Query, Projection::Key, Projection::Value];
    let [mut queries, mut keys, values] = tier.project(layer, qkv, &normed)?;
    if attention.head_norms {
        tier.head_norm(layer, Projection::Query, &mut queries, attention.heads)?;
        tier.head_norm(layer, Projection::Key, &mut keys, attention.kv_heads)?;
    }
    tier.rope(&mut queries, attention.heads)?;
    tier.rope(&mut keys, attention.kv_heads)?;
    let attended = tier.attention(layer, attention, &queries, &keys, &values)?;
    let [projected] = tier.project(layer, [Projection::Output], &attended)?;
    tier.add(hidden, &projected)?;
    tier.observe(layer, Point::AfterAttention, hidden)?;

    let normed = tier.rms_norm(layer, Norm::PostAttention, hidden)?;
    let routing = tier.route(layer, &spec.router, &normed)?;
    let experts = tier.experts(layer, &spec.experts, &normed, &routing)?;
    tier.combine(hidden, &routing, experts)?;
    tier.observe(layer, Point::AfterExperts, hidden)
}

/// Decoder layers `layers` (each with its spec in `specs`) over the residual stream `hidden`.
pub fn decoder_layers<T: Tier>(
    tier: &mut T,
    specs: &[LayerSpec],
    layers: std::ops::Range<usize>,
    hidden: &mut T::Act,
) -> Result<()> {
    for layer in layers {
        decoder_layer(tier, layer, &specs[layer], hidden)?;
    }
    Ok(())
}

/// One op as a tier was asked to run it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpRecord {
    pub layer: Option<usize>,
    pub op: String,
}

/// A tier that logs every op before passing it on: what shows that every tier runs the same op
/// sequence.
pub struct Recording<T> {
    pub inner: T,
    pub ops: Vec<OpRecord>,
}

impl<T> Recording<T> {
    pub fn new(inner: T) -> Recording<T> {
        Recording {
            inner,
            ops: Vec::new(),
        }
    }

    fn log(&mut self, layer: Option<usize>, op: String) {
        self.ops.push(OpRecord { layer, op });
    }
}

impl<T: Tier> Tier for Recording<T> {
    type Act = T::Act;
    type Routing = T::Routing;
    type Experts = T::Experts;

    fn rms_norm(&mut self, layer: usize, norm: Norm, x: &T::Act) -> Result<T::Act> {
        self.log(Some(layer), format!("rms_norm {norm:?}"));
        self.inner.rms_norm(layer, norm, x)
    }

    fn project<const N: usize>(
        &mut self,
        layer: usize,
        projections: [Projection; N],
        x: &T::Act,
    ) -> Result<[T::Act; N]> {
        self.log(Some(layer), format!("project {projections:?}"));
        self.inner.project(layer, projections, x)
    }

    fn head_norm(
        &mut self,
        layer: usize,
        projection: Projection,
        x: &mut T::Act,
        heads: usize,
    ) -> Result<()> {
        self.log(
            Some(layer),
            format!("head_norm {projection:?} {heads} heads"),
        );
        self.inner.head_norm(layer, projection, x, heads)
    }

    fn rope(&mut self, x: &mut T::Act, heads: usize) -> Result<()> {
        self.log(None, format!("rope {heads} heads"));
        self.inner.rope(x, heads)
    }

    fn attention(
        &mut self,
        layer: usize,
        spec: &AttentionSpec,
        queries: &T::Act,
        keys: &T::Act,
        values: &T::Act,
    ) -> Result<T::Act> {
        self.log(Some(layer), format!("attention window {:?}", spec.window));
        self.inner.attention(layer, spec, queries, keys, values)
    }

    fn add(&mut self, into: &mut T::Act, delta: &T::Act) -> Result<()> {
        self.log(None, "add".into());
        self.inner.add(into, delta)
    }

    fn route(&mut self, layer: usize, spec: &RouterSpec, x: &T::Act) -> Result<T::Routing> {
        self.log(
            Some(layer),
            format!("route {:?} top {}", spec.gating, spec.top_k),
        );
        self.inner.route(layer, spec, x)
    }

    fn experts(
        &mut self,
        layer: usize,
        spec: &ExpertSpec,
        x: &T::Act,
        routing: &T::Routing,
    ) -> Result<T::Experts> {
        self.log(Some(layer), format!("experts {:?}", spec.activation));
        self.inner.experts(layer, spec, x, routing)
    }

    fn combine(
        &mut self,
        hidden: &mut T::Act,
        routing: &T::Routing,
        experts: T::Experts,
    ) -> Result<()> {
        self.log(None, "combine".into());
        self.inner.combine(hidden, routing, experts)
    }

    fn observe(&mut self, layer: usize, point: Point, hidden: &T::Act) -> Result<()> {
        self.inner.observe(layer, point, hidden)
    }
}
