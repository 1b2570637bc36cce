//! The CPU tier: executes each op of the decoder layer (`block`) at once on the host's cores,
//! reading experts through the RAM/disk expert store and guessing (and prefetching) the next
//! layer's experts while a layer's are computed.

use std::borrow::Cow;
use std::sync::Mutex;

use rayon::prelude::*;

use super::block::{Norm, Point, Projection, Tier};
use super::{KvCache, LayerTrace, Model, PrefetchProxy};
use crate::arch::{AttentionSpec, ExpertSpec, RouterSpec};
use crate::cpu::attention::{HeadLayout, attend_group, first_visible_key};
use crate::cpu::matmul::{add_into, dense_matmul};
use crate::cpu::moe::Routing;
use crate::cpu::norm::rms_norm;
use crate::error::Result;
use crate::formats::KvFormat;
use crate::weights::{DenseMatrix, LayerWeights};

/// One proxy's guess, made `distance` layers ahead, at layer `layer`'s experts per position.
struct Guess {
    proxy: PrefetchProxy,
    distance: usize,
    layer: usize,
    experts: Vec<Vec<usize>>,
}

/// An expert's output for a block: the positions that chose it with their routing weights for
/// it, and one output row for each.
type ExpertOutput = (Vec<(usize, f32)>, Vec<f32>);

/// The CPU tier over one block of positions placed at `cache.len()..` (the caller advances the
/// cache once every layer ran).
pub struct CpuTier<'a> {
    model: &'a Model,
    cache: &'a mut KvCache,
    /// Position of the block's first row.
    start: usize,
    /// The layer this run stops before: the layer before it guesses no next layer.
    end: usize,
    /// Guesses at later layers' experts, until those layers route.
    guesses: Vec<Guess>,
    trace: Option<&'a mut Vec<LayerTrace>>,
    /// The traced layer's residual after attention and its routing, until its experts are in.
    traced: (Option<Vec<f32>>, Option<Vec<Routing>>),
}

impl<'a> CpuTier<'a> {
    pub fn new(
        model: &'a Model,
        cache: &'a mut KvCache,
        end: usize,
        trace: Option<&'a mut Vec<LayerTrace>>,
    ) -> CpuTier<'a> {
        let start = cache.len();
        CpuTier {
            model,
            cache,
            start,
            end,
            guesses: Vec::new(),
            trace,
            traced: (None, None),
        }
    }

    /// Output values per position of `projection`.
    fn width(&self, projection: Projection) -> usize {
        let cfg = &self.model.config;
        match projection {
            Projection::Query => cfg.q_dim(),
            Projection::Key | Projection::Value => cfg.kv_dim(),
            Projection::Output => cfg.hidden_size,
        }
    }

    /// Input values per position of `projection`.
    fn input_width(&self, projection: Projection) -> usize {
        let cfg = &self.model.config;
        match projection {
            Projection::Query | Projection::Key | Projection::Value => cfg.hidden_size,
            Projection::Output => cfg.q_dim(),
        }
    }

    /// The projections' matrices stacked into one (rows one after the other), where the
    /// checkpoint's weights lie back to back (as copied into memory) and no q8 copy replaces
    /// them: one call then reads them at the bandwidth of one large matrix instead of two small
    /// ones after a large one. Each row's dot product is the same either way.
    fn stacked(&self, layer: usize, projections: &[Projection]) -> Option<DenseMatrix> {
        if projections.len() < 2 || self.model.q8.is_some() {
            return None;
        }
        let w = &self.model.weights.layers[layer];
        let parts: Vec<&DenseMatrix> = projections.iter().map(|&p| projection(w, p)).collect();
        DenseMatrix::stacked(&parts)
    }
}

/// Layer `w`'s matrix of `projection`.
fn projection(w: &LayerWeights, projection: Projection) -> &DenseMatrix {
    match projection {
        Projection::Query => &w.q,
        Projection::Key => &w.k,
        Projection::Value => &w.v,
        Projection::Output => &w.o,
    }
}

/// Layer `w`'s bias of `projection`, where the checkpoint has one.
fn projection_bias(w: &LayerWeights, projection: Projection) -> Option<&[f32]> {
    match projection {
        Projection::Query => w.q_bias.as_deref(),
        Projection::Key => w.k_bias.as_deref(),
        Projection::Value => w.v_bias.as_deref(),
        Projection::Output => w.o_bias.as_deref(),
    }
}

/// Where `Q8Weights` keeps a layer's `projection`.
fn q8_index(projection: Projection) -> usize {
    match projection {
        Projection::Query => 0,
        Projection::Key => 1,
        Projection::Value => 2,
        Projection::Output => 3,
    }
}

/// `hidden += delta`, in parallel over blocks of 16 Ki values (a 512-token block's residual is
/// 1.5 M values; a decoded token's one block).
fn add_residual(hidden: &mut [f32], delta: &[f32]) {
    hidden
        .par_chunks_mut(1 << 14)
        .zip(delta.par_chunks(1 << 14))
        .for_each(|(h, d)| add_into(h, d));
}

/// Adds each of an expert's output rows (`down`, `h` values per user) times its user's routing
/// weight into the user's row of `out` (`[n, h]`).
fn add_weighted_rows(users: &[(usize, f32)], down: &[f32], h: usize, out: &mut [f32]) {
    for (&(t, w), d) in users.iter().zip(down.chunks_exact(h)) {
        for (o, d) in out[t * h..(t + 1) * h].iter_mut().zip(d) {
            *o += d * w;
        }
    }
}

impl Tier for CpuTier<'_> {
    type Act = Vec<f32>;
    type Routing = Vec<Routing>;
    /// The experts' weighted sum per position, already in ascending expert order.
    type Experts = Vec<f32>;

    fn rms_norm(&mut self, layer: usize, norm: Norm, x: &Vec<f32>) -> Result<Vec<f32>> {
        let w = &self.model.weights.layers[layer];
        let weights = match norm {
            Norm::Input => &w.input_norm,
            Norm::PostAttention => &w.post_attention_norm,
        };
        let mut out = vec![0f32; x.len()];
        rms_norm(x, weights, self.model.config.rms_norm_eps, &mut out);
        Ok(out)
    }

    fn project<const N: usize>(
        &mut self,
        layer: usize,
        projections: [Projection; N],
        x: &Vec<f32>,
    ) -> Result<[Vec<f32>; N]> {
        let started = std::time::Instant::now();
        let n = x.len() / self.input_width(projections[0]);
        let mut outs: [Vec<f32>; N] =
            std::array::from_fn(|p| vec![0f32; n * self.width(projections[p])]);
        let w = &self.model.weights.layers[layer];
        match self.stacked(layer, &projections) {
            Some(stacked) => {
                let mut all = vec![0f32; n * stacked.rows];
                dense_matmul(&stacked, x, None, &mut all);
                let mut first = 0;
                for (out, &p) in outs.iter_mut().zip(&projections) {
                    let rows = out.len() / n;
                    let bias = projection_bias(w, p);
                    for (t, out) in out.chunks_exact_mut(rows).enumerate() {
                        let part = &all[t * stacked.rows + first..][..rows];
                        match bias {
                            // As `dense_matmul` adds a bias: to each finished dot product.
                            Some(b) => {
                                for ((o, p), b) in out.iter_mut().zip(part).zip(b) {
                                    *o = p + b;
                                }
                            }
                            None => out.copy_from_slice(part),
                        }
                    }
                    first += rows;
                }
            }
            None => {
                for (out, &p) in outs.iter_mut().zip(&projections) {
                    let bias = projection_bias(w, p);
                    match &self.model.q8 {
                        Some(q8) => {
                            crate::cpu::q8::q8_matmul(&q8.layers[layer][q8_index(p)], x, bias, out)
                        }
                        None => dense_matmul(projection(w, p), x, bias, out),
                    }
                }
            }
        }
        super::CpuTimings::add(&self.model.timings.attention_us, started);
        Ok(outs)
    }

    fn head_norm(
        &mut self,
        layer: usize,
        projection: Projection,
        x: &mut Vec<f32>,
        _heads: usize,
    ) -> Result<()> {
        let w = &self.model.weights.layers[layer];
        let weights = match projection {
            Projection::Query => &w.q_norm,
            Projection::Key => &w.k_norm,
            Projection::Value | Projection::Output => &None,
        };
        let Some(weights) = weights else {
            return Err(crate::error::Error::Unsupported(format!(
                "layer {layer} has no per-head norm of {projection:?}"
            )));
        };
        // Each head is a row of `head_dim` values: the norm's weights are that long.
        let heads = x.clone();
        rms_norm(&heads, weights, self.model.config.rms_norm_eps, x);
        Ok(())
    }

    fn rope(&mut self, x: &mut Vec<f32>, heads: usize) -> Result<()> {
        let width = heads * self.model.config.head_dim;
        let rope = &self.model.rope;
        for (t, row) in x.chunks_exact_mut(width).enumerate() {
            let (cos, sin) = rope.cos_sin(self.start + t);
            rope.apply(row, &cos, &sin);
        }
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        spec: &AttentionSpec,
        queries: &Vec<f32>,
        keys: &Vec<f32>,
        values: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let started = std::time::Instant::now();
        let layout = HeadLayout {
            num_heads: spec.heads,
            num_kv_heads: spec.kv_heads,
            head_dim: spec.head_dim,
        };
        let (d, qd) = (spec.head_dim, spec.heads * spec.head_dim);
        let kvd = spec.kv_heads * d;
        let (start, n) = (self.start, queries.len() / qd);
        let sinks = self.model.weights.layers[layer].sinks.as_deref();
        let mut out = vec![0f32; n * qd];
        // Keys and values as the cache holds them, the block's own included.
        let rounded = match self.model.kv_format {
            KvFormat::F32 => None,
            format => Some([keys, values].map(|v| {
                let mut v = v.clone();
                format.round(&mut v);
                v
            })),
        };
        let (keys, values) = match &rounded {
            Some([keys, values]) => (keys, values),
            None => (keys, values),
        };
        {
            let cache = &*self.cache;
            // Kv head g's key and value at position j: from this block for its own positions,
            // from the cache for older ones (a sliding layer's ring may not hold the block's).
            let kv = |j: usize, g: usize| -> (&[f32], &[f32]) {
                if j >= start {
                    let at = (j - start) * kvd + g * d;
                    (&keys[at..at + d], &values[at..at + d])
                } else {
                    cache.get(layer, j, g)
                }
            };
            // One task per (position, kv head): decode has one position but several kv heads,
            // each read once for the query heads that share it.
            let group_width = layout.heads_per_kv_head() * d;
            out.par_chunks_mut(group_width)
                .enumerate()
                .for_each(|(i, out)| {
                    let (t, g) = (i / spec.kv_heads, i % spec.kv_heads);
                    let position = start + t;
                    let visible = first_visible_key(position, spec.window)..=position;
                    let query = &queries[t * qd..(t + 1) * qd];
                    let kv_of = |j| kv(j, g);
                    attend_group(layout, g, query, visible, &kv_of, sinks, spec.scaling, out);
                });
        }
        self.cache.store(layer, keys, values);
        super::CpuTimings::add(&self.model.timings.attention_us, started);
        Ok(out)
    }

    fn add(&mut self, into: &mut Vec<f32>, delta: &Vec<f32>) -> Result<()> {
        add_residual(into, delta);
        Ok(())
    }

    fn route(&mut self, layer: usize, spec: &RouterSpec, x: &Vec<f32>) -> Result<Vec<Routing>> {
        let started = std::time::Instant::now();
        debug_assert_eq!(*spec, self.model.layer_specs[layer].router);
        let routings = self.model.route_tokens(layer, x);
        super::CpuTimings::add(&self.model.timings.experts_us, started);
        Ok(routings)
    }

    /// Fetches the union of the block's choices (each expert once, from RAM or disk), guesses the
    /// next layer's experts behind those reads, and runs each expert over the positions that
    /// chose it; the weighted outputs are summed in ascending expert order, as transformers
    /// does, so the result does not depend on the block size or on when each expert arrived.
    fn experts(
        &mut self,
        layer: usize,
        spec: &ExpertSpec,
        x: &Vec<f32>,
        routings: &Vec<Routing>,
    ) -> Result<Vec<f32>> {
        let started = std::time::Instant::now();
        debug_assert_eq!(*spec, self.model.layer_specs[layer].experts);
        let model = self.model;
        let h = spec.hidden;
        let n = x.len() / h;
        let chosen: Vec<usize> = (0..model.config.num_experts)
            .filter(|e| routings.iter().any(|r| r.experts.contains(e)))
            .collect();
        // All reads start now; each expert is computed as soon as its bytes are in, while the
        // IO threads read the next ones.
        let requests = model.experts.request(layer, &chosen)?;
        // Behind this layer's reads in the IO queue: what the next layer will want.
        self.score_and_guess_a(layer, x, routings)?;
        // Experts run side by side (each also splits its rows over idle threads), so that one
        // expert's serial steps (input gathering, SwiGLU, reordering its outputs) overlap
        // another's matrix products. Outputs are added in ascending expert order as soon as every
        // lower expert's is in, so few wait in memory.
        let finished: Vec<Mutex<Option<ExpertOutput>>> =
            chosen.iter().map(|_| Mutex::new(None)).collect();
        // The next expert to add, and the sum so far.
        let sum = Mutex::new((0usize, vec![0f32; n * h]));
        let finish = |i: usize, output: ExpertOutput| {
            *finished[i].lock().unwrap() = Some(output);
            let mut sum = sum.lock().unwrap();
            let (next, out) = &mut *sum;
            while *next < chosen.len() {
                let Some((users, down)) = finished[*next].lock().unwrap().take() else {
                    break; // Its own task adds it (and what follows) when it finishes.
                };
                add_weighted_rows(&users, &down, h, out);
                *next += 1;
            }
        };
        // With one thread, each expert is computed in turn while the IO threads read ahead.
        let one_thread = rayon::current_num_threads() == 1;
        rayon::scope(|scope| -> Result<()> {
            for (i, (&e, request)) in chosen.iter().zip(requests).enumerate() {
                let expert = model.experts.wait(request)?;
                let finish = &finish;
                let task = move || {
                    let users: Vec<(usize, f32)> = routings
                        .iter()
                        .enumerate()
                        .filter_map(|(t, r)| {
                            let k = r.experts.iter().position(|&x| x == e)?;
                            Some((t, r.weights[k]))
                        })
                        .collect();
                    let mut xs = Vec::with_capacity(users.len() * h);
                    for &(t, _) in &users {
                        xs.extend_from_slice(&x[t * h..(t + 1) * h]);
                    }
                    let down = model.run_expert(layer, e, &expert, &xs);
                    finish(i, (users, down));
                };
                if one_thread {
                    task();
                } else {
                    scope.spawn(move |_| task());
                }
            }
            Ok(())
        })?;
        let (added, out) = sum.into_inner().unwrap();
        assert_eq!(
            added,
            chosen.len(),
            "every chosen expert's output was added"
        );
        if self.trace.is_some() {
            self.traced.1 = Some(routings.clone());
        }
        super::CpuTimings::add(&model.timings.experts_us, started);
        Ok(out)
    }

    fn combine(&mut self, hidden: &mut Vec<f32>, _: &Vec<Routing>, sum: Vec<f32>) -> Result<()> {
        add_residual(hidden, &sum);
        Ok(())
    }

    fn observe(&mut self, layer: usize, point: Point, hidden: &Vec<f32>) -> Result<()> {
        match point {
            Point::AfterAttention => {
                if self.trace.is_some() {
                    self.traced.0 = Some(hidden.clone());
                }
            }
            Point::AfterExperts => {
                self.guess_b(layer, hidden)?;
                if let (Some(trace), (Some(after_attention), Some(routings))) =
                    (self.trace.as_deref_mut(), std::mem::take(&mut self.traced))
                {
                    trace.push(LayerTrace {
                        after_attention,
                        routings,
                        after_moe: hidden.clone(),
                    });
                }
            }
        }
        Ok(())
    }
}

impl CpuTier<'_> {
    /// Scores the guesses made for this layer against `routings`, then guesses later layers'
    /// experts with proxy A (this layer's MoE input through their routers).
    fn score_and_guess_a(&mut self, layer: usize, x: &[f32], routings: &[Routing]) -> Result<()> {
        let model = self.model;
        let (now, later): (Vec<Guess>, Vec<Guess>) = std::mem::take(&mut self.guesses)
            .into_iter()
            .partition(|g| g.layer == layer);
        self.guesses = later;
        for g in now {
            model.score_prediction(g.proxy, g.distance, &g.experts, routings);
        }
        self.guess(PrefetchProxy::A, layer, |_| Cow::Borrowed(x))
    }

    /// Proxy B: the residual after this layer's experts, normalized as each later layer will.
    fn guess_b(&mut self, layer: usize, hidden: &[f32]) -> Result<()> {
        let model = self.model;
        self.guess(PrefetchProxy::B, layer, |target| {
            let mut proxy = vec![0f32; hidden.len()];
            let norm = &model.weights.layers[target].post_attention_norm;
            rms_norm(hidden, norm, model.config.rms_norm_eps, &mut proxy);
            Cow::Owned(proxy)
        })
    }

    /// Guesses the experts of the layers up to `which` proxy's distance after `layer`, each from
    /// `input(target)` through the target's router, and prefetches those within the prefetch
    /// distance when this proxy prefetches.
    fn guess<'x>(
        &mut self,
        which: PrefetchProxy,
        layer: usize,
        input: impl Fn(usize) -> Cow<'x, [f32]>,
    ) -> Result<()> {
        let model = self.model;
        let prefetches = model.prefetches_with(which);
        for distance in 1..=model.guess_distance(which) {
            let target = layer + distance;
            if target >= self.end {
                break;
            }
            let prefetch = prefetches && distance <= model.prefetch.distance;
            let experts = model.predict_experts(target, &input(target), prefetch)?;
            self.guesses.push(Guess {
                proxy: which,
                distance,
                layer: target,
                experts,
            });
        }
        Ok(())
    }
}
