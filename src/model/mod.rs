//! The GPT-OSS forward pass on the CPU tier, the KV cache, token choice and the generation loop.

pub mod ab;
pub mod agreement;
pub mod block;
pub mod cpu_tier;
pub mod generate;
pub mod gpu_tier;
pub mod kv_cache;
pub mod sampler;
pub mod session;

use std::path::Path;

use rayon::prelude::*;

use crate::arch::{Activation, Gating};
use crate::config::Config;
use crate::cpu::matmul::{dense_matmul, expert_matmul_as};
use crate::cpu::moe::{Routing, clamped_swiglu, route, route_softmax_first, swiglu};
use crate::cpu::norm::rms_norm;
use crate::cpu::rope::RopeTable;
use crate::error::Result;
use crate::experts::{ExpertData, ExpertStore, RamBudget};
use crate::weights::{Checkpoint, ModelWeights};
pub use kv_cache::KvCache;

/// Values of one layer at every position of a block, for comparison with a reference.
#[derive(Debug, Clone)]
pub struct LayerTrace {
    /// Residual stream after the attention block, `[positions, hidden]`.
    pub after_attention: Vec<f32>,
    /// Router choice per position, by descending logit.
    pub routings: Vec<Routing>,
    /// Residual stream after the MoE block, `[positions, hidden]`.
    pub after_moe: Vec<f32>,
}

/// A loaded model: configuration, validated weights (mapped, not copied), the expert store the
/// CPU tier reads experts through, and RoPE tables.
pub struct Model {
    pub config: Config,
    pub checkpoint: Checkpoint,
    pub weights: ModelWeights,
    pub experts: ExpertStore,
    rope: RopeTable,
    /// What each decoder layer computes (the model family's description).
    pub layer_specs: Vec<crate::arch::LayerSpec>,
    /// Where the CPU tier's time went, for `--stats`.
    pub timings: CpuTimings,
    pub prefetch: PrefetchOptions,
    /// The dense weights quantized to 8 bits (`--dense-format q8`): the CPU tier reads these
    /// instead of the checkpoint's attention projections, LM head and embeddings.
    pub q8: Option<crate::cpu::q8::Q8Weights>,
    /// How the CPU tier multiplies MXFP4 experts with their inputs (`--expert-activations`).
    pub expert_activations: crate::cpu::q8_activations::ExpertActivations,
    /// Whether the weights a token reads were copied into memory (`MmapMode`).
    pub weights_in_memory: bool,
    /// How both tiers' KV caches hold keys and values (`--kv-cache`).
    pub kv_format: crate::formats::KvFormat,
    /// Per proxy (A, B): experts predicted right, and experts to predict.
    /// Per proxy and distance (1..=MAX_PREFETCH_DISTANCE layers ahead): actual experts the
    /// guesses named, and actual experts.
    prediction:
        [[(std::sync::atomic::AtomicU64, std::sync::atomic::AtomicU64); MAX_PREFETCH_DISTANCE]; 2],
}

/// What stands in for layer L+1's MoE input when guessing its experts during layer L.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum PrefetchProxy {
    /// L's normalized MoE input: known as soon as L routes (earliest).
    A,
    /// L's residual after its MoE, normalized with L+1's post-attention norm (closer, later):
    /// the default, the more accurate on every fixture and on the synthetic 20B.
    #[default]
    B,
}

impl PrefetchProxy {
    pub const ALL: [PrefetchProxy; 2] = [PrefetchProxy::A, PrefetchProxy::B];

    pub fn name(self) -> &'static str {
        match self {
            PrefetchProxy::A => "a",
            PrefetchProxy::B => "b",
        }
    }
}

impl std::str::FromStr for PrefetchProxy {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<PrefetchProxy, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "a" => Ok(PrefetchProxy::A),
            "b" => Ok(PrefetchProxy::B),
            _ => Err(format!("{text:?}: expected a or b")),
        }
    }
}

/// The farthest a guess looks ahead, in layers (and the distances `--stats` scores).
pub const MAX_PREFETCH_DISTANCE: usize = 3;

/// Router-guided prefetch of later layers' experts into the RAM cache's staging area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefetchOptions {
    pub enabled: bool,
    pub proxy: PrefetchProxy,
    /// How many layers ahead guesses are read (1: the next layer only; at most
    /// `MAX_PREFETCH_DISTANCE`).
    pub distance: usize,
    /// Guess with every proxy and score the guesses even where nothing is prefetched (what
    /// `--stats` reports). Otherwise only the proxy that prefetches guesses: the others' router
    /// products and norms cost decode time for a number nobody reads.
    pub measure_accuracy: bool,
}

impl Default for PrefetchOptions {
    fn default() -> Self {
        PrefetchOptions {
            enabled: false,
            proxy: PrefetchProxy::default(),
            distance: 1,
            measure_accuracy: false,
        }
    }
}

/// Microseconds the CPU forward pass spent per part (expert time includes waiting for reads;
/// the expert store reports that wait on its own).
#[derive(Debug, Default)]
pub struct CpuTimings {
    pub attention_us: std::sync::atomic::AtomicU64,
    pub experts_us: std::sync::atomic::AtomicU64,
    pub head_us: std::sync::atomic::AtomicU64,
}

impl CpuTimings {
    fn add(counter: &std::sync::atomic::AtomicU64, since: std::time::Instant) {
        counter.fetch_add(
            since.elapsed().as_micros() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// (attention, experts, head) in milliseconds.
    pub fn millis(&self) -> (f64, f64, f64) {
        let ms = |c: &std::sync::atomic::AtomicU64| {
            c.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1000.0
        };
        (
            ms(&self.attention_us),
            ms(&self.experts_us),
            ms(&self.head_us),
        )
    }
}

/// How a model is loaded.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// RAM the CPU tier's expert cache may hold.
    pub ram_budget: RamBudget,
    /// Threads reading experts from disk: the reads the disk has in flight.
    pub io_threads: usize,
    /// Largest read an IO thread makes at once (an expert is read in chunks side by side).
    pub read_chunk_bytes: usize,
    /// Pin the experts earlier runs used most (from the usage file, `usage_dir`), and let
    /// `save_usage` add this run's counts there. Off by default: runs stay independent.
    pub hot_experts: bool,
    /// Read a converted expert store past the page cache (O_DIRECT).
    pub direct_io: bool,
    pub prefetch: PrefetchOptions,
    /// How the CPU tier holds the dense weights (exact by default).
    pub dense_format: crate::cpu::q8::DenseFormat,
    /// How the CPU tier multiplies MXFP4 experts with their inputs (exact by default).
    pub expert_activations: crate::cpu::q8_activations::ExpertActivations,
    /// Whether the weights stay mapped from the checkpoint or are copied into memory.
    pub mmap: MmapMode,
    /// How the KV caches hold keys and values (f32, exact, by default).
    pub kv_format: crate::formats::KvFormat,
    /// Lay MXFP4 experts copied into memory out for the CPU tier's AVX-512 kernel, where it
    /// runs (`cpu::simd::interleave_mxfp4_runs`: the same results from fewer shuffles per
    /// weight). The GPU tier cannot read them then: for CPU-only runs, with exact expert inputs.
    pub interleave_experts: bool,
    /// Check each record of a converted store against its index's hash when first read (on by
    /// default: a damaged file is then an error, not different tokens).
    pub check_records: bool,
    /// Where usage files go (`hot_experts`); None: the user's cache directory
    /// (`experts::cache_dir`), or beside the model with `PICCHIO_USAGE_BESIDE_MODEL=1`.
    pub usage_dir: Option<std::path::PathBuf>,
}

/// Where the weights a decoded token reads live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum MmapMode {
    /// Copied into memory (huge pages, which read faster than the page cache's small pages)
    /// when every expert fits the RAM budget and the available memory, else mapped.
    #[default]
    Auto,
    /// Mapped from the checkpoint files (the OS page cache holds them).
    On,
    /// Always copied into memory (experts included, whatever the RAM budget).
    Off,
}

impl std::str::FromStr for MmapMode {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<MmapMode, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(MmapMode::Auto),
            "on" => Ok(MmapMode::On),
            "off" => Ok(MmapMode::Off),
            _ => Err(format!("{text:?}: expected auto, on or off")),
        }
    }
}

/// Reads in flight by default, and the largest single read: see docs/performance for the
/// queue depths and read sizes measured on a virtual disk.
pub const DEFAULT_IO_THREADS: usize = 16;
pub const DEFAULT_READ_CHUNK_BYTES: usize = 2 << 20;

/// The staging area holds this many layers' worth of a decoded token's guessed experts (top-k
/// each): room for guesses a few layers ahead while the current layer's arrive.
const PREFETCH_STAGING_LAYERS: usize = 4;

/// Memory kept free beside weights copied into memory (`MmapMode::Auto`): KV cache, buffers, OS.
const COPY_RESERVE_BYTES: u64 = 4 << 30;

/// Whether `options` put `weights` in memory rather than mapped (see `MmapMode`).
fn copies_weights(options: &ModelOptions, weights: &ModelWeights) -> bool {
    match options.mmap {
        MmapMode::On => false,
        MmapMode::Off => true,
        MmapMode::Auto => {
            let experts: u64 = weights
                .layers
                .iter()
                .map(|l| (l.gate_up.bytes() + l.down.bytes()) as u64)
                .sum();
            let budget_covers = match options.ram_budget {
                RamBudget::Bytes(b) => b >= experts,
                RamBudget::Percent(p) => p >= 100.0,
                RamBudget::Auto => true,
            };
            let resident = (weights.bytes() - weights.embeddings.data.bytes().len()) as u64;
            budget_covers
                && weights.flat.is_none()
                && !options.direct_io
                && crate::experts::available_memory_bytes()
                    .is_some_and(|a| a >= resident + COPY_RESERVE_BYTES)
        }
    }
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            ram_budget: RamBudget::Auto,
            io_threads: DEFAULT_IO_THREADS,
            read_chunk_bytes: DEFAULT_READ_CHUNK_BYTES,
            hot_experts: false,
            direct_io: false,
            prefetch: PrefetchOptions::default(),
            dense_format: crate::cpu::q8::DenseFormat::default(),
            expert_activations: Default::default(),
            mmap: MmapMode::default(),
            kv_format: Default::default(),
            interleave_experts: false,
            check_records: true,
            usage_dir: None,
        }
    }
}

impl Model {
    /// Loads `DIR/config.json` and the checkpoint's safetensors, enforcing the L0 contract.
    pub fn load(dir: &Path) -> Result<Model> {
        Model::load_with(dir, &ModelOptions::default())
    }

    pub fn load_with(dir: &Path, options: &ModelOptions) -> Result<Model> {
        crate::weights::require_dir(dir)?;
        let config = Config::load(dir)?;
        let checkpoint = Checkpoint::open(dir)?;
        let mut weights = ModelWeights::load(&checkpoint, &config)?;
        // q8 first: it reads the mapped dense weights and releases them, so copying them into
        // memory afterwards would only waste it.
        let q8 = match options.dense_format {
            crate::cpu::q8::DenseFormat::Checkpoint => None,
            crate::cpu::q8::DenseFormat::Q8 => {
                let started = std::time::Instant::now();
                let q8 = crate::cpu::q8::Q8Weights::quantize(&weights)?;
                log::info!(
                    "dense weights quantized to q8 ({:.2} GB) in {:.1} s",
                    q8.bytes() as f64 / 1e9,
                    started.elapsed().as_secs_f64()
                );
                Some(q8)
            }
        };
        if options.expert_activations == crate::cpu::q8_activations::ExpertActivations::Q8 {
            match weights.layers.first().map(|l| &l.gate_up) {
                Some(crate::weights::ExpertMatrices::Mxfp4(_)) => log::info!(
                    "MXFP4 experts' inputs rounded to 8 bits per 32 values on the CPU tier \
                     (--expert-activations q8): faster, not exact"
                ),
                _ => log::warn!(
                    "--expert-activations q8 applies to MXFP4 experts; this checkpoint's \
                     experts are not MXFP4 and stay exact"
                ),
            }
        }
        let mut ram_budget = options.ram_budget;
        let weights_in_memory = copies_weights(options, &weights);
        if weights_in_memory {
            let started = std::time::Instant::now();
            let interleave = options.interleave_experts
                && options.expert_activations
                    == crate::cpu::q8_activations::ExpertActivations::Exact;
            let relayout: Option<&crate::weights::ExpertRelayout> =
                interleave.then_some(&crate::cpu::layout::interleaved_copy);
            let bytes = weights.copy_to_memory(q8.is_none(), relayout)?;
            log::info!(
                "weights copied into memory ({:.2} GB) in {:.1} s{}",
                bytes as f64 / 1e9,
                started.elapsed().as_secs_f64(),
                if weights.experts_interleaved() {
                    ", MXFP4 experts laid out for the CPU tier's kernel"
                } else {
                    ""
                }
            );
            if weights.flat.is_none() {
                // Every expert is in memory now: the store keeps them all.
                ram_budget = RamBudget::Percent(100.0);
            }
        }
        if q8.is_none() {
            // Read a row per token: the OS fetches their pages in the background now, not one
            // new token's row at a time while decoding.
            weights.embeddings.data.read_ahead();
        }
        let experts = ExpertStore::open(
            &checkpoint,
            &weights,
            ram_budget,
            crate::experts::StoreOptions {
                io_threads: options.io_threads,
                read_chunk_bytes: options.read_chunk_bytes,
                staging_experts: PREFETCH_STAGING_LAYERS * config.experts_per_token,
                hot_experts: options.hot_experts,
                direct_io: options.direct_io,
                check_records: options.check_records,
                usage_dir: options.usage_dir.clone(),
            },
        )?;
        let rope = RopeTable::new(&config);
        let layer_specs = config.family.layers(&config);
        Ok(Model {
            config,
            checkpoint,
            weights,
            experts,
            rope,
            layer_specs,
            timings: CpuTimings::default(),
            prefetch: PrefetchOptions {
                distance: options.prefetch.distance.clamp(1, MAX_PREFETCH_DISTANCE),
                ..options.prefetch
            },
            q8,
            expert_activations: options.expert_activations,
            weights_in_memory,
            kv_format: options.kv_format,
            prediction: Default::default(),
        })
    }

    /// The CPU tier's own faster numeric mode this model was loaded with, if any, as its flag.
    /// The GPU tier computes exactly, so a model in such a mode runs on the CPU tier only:
    /// otherwise which experts sit in VRAM would change the tokens.
    pub fn cpu_only_mode(&self) -> Option<&'static str> {
        if self.q8.is_some() {
            Some("--dense-format q8")
        } else if self.expert_activations == crate::cpu::q8_activations::ExpertActivations::Q8 {
            Some("--expert-activations q8")
        } else if self.weights.experts_interleaved() {
            Some("a model loaded for the CPU tier (experts laid out for its kernel)")
        } else {
            None
        }
    }

    /// Faults in the mapped dense weights, and the experts when they all fit the RAM budget
    /// (`ExpertStore::warm_up`), or reads them once where they were copied into memory
    /// (`TensorBytes::warm`), so that timing starts with the model in memory.
    pub fn warm_up(&self) {
        // Not the embeddings: a prompt reads one row per token (the load asked the OS to read
        // them into its page cache).
        self.checkpoint_matrices_per_token()
            .par_iter()
            .for_each(|m| m.data.warm());
        self.experts.warm_up();
    }

    /// The checkpoint's dense matrices a decoded token reads whole: every layer's router and,
    /// unless q8 replaced them, its attention projections and the LM head.
    fn checkpoint_matrices_per_token(&self) -> Vec<&crate::weights::DenseMatrix> {
        let w = &self.weights;
        let mut dense = Vec::new();
        for l in &w.layers {
            dense.push(&l.router);
            if self.q8.is_none() {
                dense.extend([&l.q, &l.k, &l.v, &l.o]);
            }
        }
        if self.q8.is_none() {
            dense.push(&w.lm_head);
        }
        dense
    }

    /// The bytes the LM head's product reads on the CPU tier (its q8 copy where it holds one).
    pub fn head_weight_bytes(&self) -> Vec<&[u8]> {
        match &self.q8 {
            Some(q8) => vec![q8.lm_head.values.bytes(), q8.lm_head.scales.bytes()],
            None => vec![self.weights.lm_head.data.bytes()],
        }
    }

    /// Where non-finite values (NaN or infinity) first appear when the CPU tier runs `tokens`
    /// from position 0: the embeddings, a layer's attention, router or experts, or the head;
    /// None when every value is finite.
    pub fn locate_non_finite(&self, tokens: &[u32]) -> Result<Option<String>> {
        let finite = |values: &[f32]| values.iter().all(|x| x.is_finite());
        if !finite(&self.embed(tokens)) {
            return Ok(Some("the embeddings".into()));
        }
        let mut cache = KvCache::keeping_all(&self.config, tokens.len());
        let mut trace = Vec::new();
        let logits = self.forward(&mut cache, tokens, Some(&mut trace))?;
        for (l, layer) in trace.iter().enumerate() {
            let routed = layer.routings.iter().all(|r| finite(&r.weights));
            let place = match () {
                _ if !finite(&layer.after_attention) => "attention",
                _ if !routed => "router",
                _ if !finite(&layer.after_moe) => "experts",
                _ => continue,
            };
            return Ok(Some(format!("layer {l}'s {place}")));
        }
        Ok((!finite(&logits)).then(|| "the head (final norm and lm_head)".into()))
    }

    /// A KV cache for this model holding at most `context` positions.
    pub fn new_cache(&self, context: usize) -> KvCache {
        KvCache::new(&self.config, context)
    }

    /// Runs `tokens` (one or more, placed after what `cache` holds) through the model, all
    /// positions of a layer at once, and returns the logits of the last position. With `trace`,
    /// records every layer's values at every position of the block.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        trace: Option<&mut Vec<LayerTrace>>,
    ) -> Result<Vec<f32>> {
        let cfg = &self.config;
        let start = cache.len();
        generate::validate_tokens(cfg, start, tokens, cache.context())?;
        // On a worker of the CPU tier's pool: each parallel kernel then starts on this thread
        // at once, instead of waking the pool from outside and sleeping until it is done.
        rayon::scope(|_| {
            let mut hidden = self.embed(tokens);
            self.run_layers(cache, &mut hidden, 0..cfg.num_layers, trace)?;
            cache.advance(tokens.len());
            Ok(self.head(&hidden))
        })
    }

    /// Bytes of dense weights one decoded token reads: every layer's attention projections and
    /// router, the LM head and one embedding row, as the CPU tier holds them.
    pub fn dense_bytes_per_token(&self) -> usize {
        let checkpoint: usize = self
            .checkpoint_matrices_per_token()
            .iter()
            .map(|m| m.data.bytes().len())
            .sum();
        let w = &self.weights;
        match &self.q8 {
            Some(q8) => {
                let attention: usize = q8.layers.iter().flatten().map(|m| m.bytes()).sum();
                let embedding_row = q8.embeddings.bytes() / q8.embeddings.rows.max(1);
                checkpoint + attention + q8.lm_head.bytes() + embedding_row
            }
            None => checkpoint + w.embeddings.cols * w.embeddings.format.size(),
        }
    }

    /// Embedding rows of `tokens` (already validated), `[n, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> Vec<f32> {
        if let Some(q8) = &self.q8 {
            return tokens
                .iter()
                .flat_map(|&id| q8.embeddings.decode_row(id as usize))
                .collect();
        }
        let embeddings = &self.weights.embeddings;
        tokens
            .iter()
            .flat_map(|&id| {
                let row =
                    crate::formats::decode_floats(embeddings.format, embeddings.row(id as usize));
                // Where the table is a mapped file, drop the pages the row was read through: the
                // OS may map a whole 2 MiB folio of the page cache for one 6 KB row, and a long
                // prompt's rows, kept, would swell the process's resident memory. The rows stay
                // in the page cache.
                embeddings.data.release();
                row
            })
            .collect()
    }

    /// Runs decoder layers `layers` over the residual stream `hidden` of a block placed at
    /// `cache.len()..`, storing their keys and values (the caller advances the cache).
    pub fn run_layers(
        &self,
        cache: &mut KvCache,
        hidden: &mut Vec<f32>,
        layers: std::ops::Range<usize>,
        trace: Option<&mut Vec<LayerTrace>>,
    ) -> Result<()> {
        let end = layers.end.min(self.config.num_layers);
        let mut tier = cpu_tier::CpuTier::new(self, cache, end, trace);
        block::decoder_layers(&mut tier, &self.layer_specs, layers, hidden)
    }

    /// The ops the CPU tier runs for `tokens` through every layer, in order (run on a cache of
    /// its own): what a test compares with the GPU tier's.
    pub fn layer_ops(&self, tokens: &[u32]) -> Result<Vec<block::OpRecord>> {
        let mut cache = self.new_cache(tokens.len());
        generate::validate_tokens(&self.config, 0, tokens, tokens.len())?;
        let mut hidden = self.embed(tokens);
        let end = self.config.num_layers;
        let mut tier = block::Recording::new(cpu_tier::CpuTier::new(self, &mut cache, end, None));
        block::decoder_layers(&mut tier, &self.layer_specs, 0..end, &mut hidden)?;
        Ok(tier.ops)
    }

    /// Logits of the last position of `hidden`: final norm, then lm_head.
    pub fn head(&self, hidden: &[f32]) -> Vec<f32> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        let started = std::time::Instant::now();
        let last = &hidden[hidden.len() - h..];
        let mut final_hidden = vec![0f32; h];
        rms_norm(
            last,
            &self.weights.final_norm,
            cfg.rms_norm_eps,
            &mut final_hidden,
        );
        let mut logits = vec![0f32; cfg.vocab_size];
        match &self.q8 {
            Some(q8) => crate::cpu::q8::q8_matmul(&q8.lm_head, &final_hidden, None, &mut logits),
            None => dense_matmul(&self.weights.lm_head, &final_hidden, None, &mut logits),
        }
        CpuTimings::add(&self.timings.head_us, started);
        logits
    }

    /// Router `l`'s choice for each row of `x` (`[n, hidden]`).
    pub fn route_tokens(&self, l: usize, x: &[f32]) -> Vec<Routing> {
        let spec = &self.layer_specs[l].router;
        let layer = &self.weights.layers[l];
        let n = x.len() / self.config.hidden_size;
        let mut logits = vec![0f32; n * spec.experts];
        dense_matmul(&layer.router, x, layer.router_bias.as_deref(), &mut logits);
        let route_one = |l: &[f32]| match spec.gating {
            Gating::TopKThenSoftmax => route(l, spec.top_k),
            Gating::SoftmaxThenTopK { renormalize } => {
                route_softmax_first(l, spec.top_k, renormalize)
            }
        };
        logits.chunks_exact(spec.experts).map(route_one).collect()
    }

    /// Guesses layer `l`'s experts for each row of `proxy` (a stand-in for its MoE input; the
    /// guess is scored by `score_prediction` once `l` routes) and, with `prefetch`, starts
    /// reading the guessed experts into the RAM cache.
    pub fn predict_experts(
        &self,
        l: usize,
        proxy: &[f32],
        prefetch: bool,
    ) -> Result<Vec<Vec<usize>>> {
        let predicted: Vec<Vec<usize>> = self
            .route_tokens(l, proxy)
            .into_iter()
            .map(|r| r.experts)
            .collect();
        if prefetch {
            let mut union: Vec<usize> = predicted.iter().flatten().copied().collect();
            union.sort_unstable();
            union.dedup();
            self.experts.prefetch(l, &union)?;
        }
        Ok(predicted)
    }

    /// The proxy that guesses the next layer's experts on a tier: the chosen one on the CPU tier;
    /// proxy A on the GPU tier, whose host sees a layer's MoE input (read back to place its
    /// experts) but not its output.
    pub fn prefetch_proxy_on(&self, backend: &str) -> PrefetchProxy {
        match backend {
            "gpu" => PrefetchProxy::A,
            _ => self.prefetch.proxy,
        }
    }

    /// Whether the CPU tier prefetches with `which` proxy.
    pub fn prefetches_with(&self, which: PrefetchProxy) -> bool {
        self.prefetch.enabled && self.prefetch.proxy == which
    }

    /// Adds how many of each token's `actual` experts `predicted` named to the score of `which`
    /// proxy's guesses made `distance` layers ahead.
    pub fn score_prediction(
        &self,
        which: PrefetchProxy,
        distance: usize,
        predicted: &[Vec<usize>],
        actual: &[Routing],
    ) {
        let hits: usize = predicted
            .iter()
            .zip(actual)
            .map(|(p, a)| a.experts.iter().filter(|e| p.contains(e)).count())
            .sum();
        let slots: usize = actual.iter().map(|a| a.experts.len()).sum();
        let (h, s) = &self.prediction[which as usize][distance - 1];
        h.fetch_add(hits as u64, std::sync::atomic::Ordering::Relaxed);
        s.fetch_add(slots as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// Share of the actual experts each proxy predicted one layer ahead, over tokens and layers
    /// 1.. (None before any prediction was scored).
    pub fn prediction_accuracy(&self, which: PrefetchProxy) -> Option<f64> {
        self.prediction_accuracy_at(which, 1)
    }

    /// As `prediction_accuracy`, for guesses made `distance` layers ahead.
    pub fn prediction_accuracy_at(&self, which: PrefetchProxy, distance: usize) -> Option<f64> {
        let (h, s) = &self.prediction[which as usize][distance - 1];
        let (h, s) = (
            h.load(std::sync::atomic::Ordering::Relaxed),
            s.load(std::sync::atomic::Ordering::Relaxed),
        );
        (s > 0).then(|| h as f64 / s as f64)
    }

    /// How far ahead `which` proxy guesses on the CPU tier: the prefetch distance where it
    /// prefetches, every scored distance where accuracy is measured, else not at all (0).
    pub fn guess_distance(&self, which: PrefetchProxy) -> usize {
        if self.prefetch.measure_accuracy {
            MAX_PREFETCH_DISTANCE
        } else if self.prefetches_with(which) {
            self.prefetch.distance
        } else {
            0
        }
    }

    /// Expert `e` of layer `l` (weights in `expert`) applied to the rows of `xs`, bias included
    /// and routing weight not: `[rows, hidden]`.
    pub fn run_expert(&self, l: usize, e: usize, expert: &ExpertData, xs: &[f32]) -> Vec<f32> {
        let (layer, spec) = (&self.weights.layers[l], &self.layer_specs[l].experts);
        let (h, i) = (spec.hidden, spec.intermediate);
        let m = xs.len() / h;
        let mut gate_up = vec![0f32; m * 2 * i];
        let gate_up_bias = layer
            .gate_up_bias
            .as_deref()
            .map(|b| &b[e * 2 * i..][..2 * i]);
        let product = |m, xs: &[f32], bias, out: &mut [f32]| {
            expert_matmul_as(self.expert_activations, m, 0, xs, bias, out)
        };
        product(&expert.gate_up, xs, gate_up_bias, &mut gate_up);
        let mut activated = vec![0f32; m * i];
        match spec.activation {
            Activation::ClampedSwiglu { alpha, limit } => {
                clamped_swiglu(&gate_up, alpha, limit, &mut activated)
            }
            Activation::Swiglu => swiglu(&gate_up, i, &mut activated),
        }
        let mut down = vec![0f32; m * h];
        let down_bias = layer.down_bias.as_deref().map(|b| &b[e * h..][..h]);
        product(&expert.down, &activated, down_bias, &mut down);
        down
    }
}
