//! Greedy generation: batched prefill of the prompt, then one token at a time.

use std::sync::Arc;
use std::time::Instant;

use super::gpu_tier::{GpuCounters, GpuModel, GpuTierOptions, GpuWeights, LayerPlacement};
use super::sampler::{argmax, top_k};
use super::{KvCache, Model};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gpu::profile::GpuProfile;

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
    /// The caller stopped it (`generate_streamed`'s `on_token` said no more).
    Interrupted,
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
pub fn validate_prompt(config: &Config, prompt: &[u32], context: usize) -> Result<()> {
    validate_tokens(config, 0, prompt, context)
}

/// Checks `tokens` to be placed at positions `start..`: at least one, every id in the
/// vocabulary, and all of them within `context` positions.
pub fn validate_tokens(
    config: &Config,
    start: usize,
    tokens: &[u32],
    context: usize,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::EmptyPrompt);
    }
    let vocab_size = config.vocab_size;
    if let Some((i, &id)) = tokens
        .iter()
        .enumerate()
        .find(|(_, id)| **id as usize >= vocab_size)
    {
        return Err(Error::TokenOutOfRange {
            id,
            position: start + i,
            vocab_size,
        });
    }
    if start + tokens.len() > context {
        return Err(Error::PromptTooLong {
            prompt_len: start + tokens.len(),
            context,
        });
    }
    Ok(())
}

/// Fails when `logits` (after `positions` positions) hold NaN or infinity: greedy and sampled
/// choices from them would be garbage. Where they first appear is found later, only after such
/// a failure (`FallbackSession`).
pub fn check_finite(logits: &[f32], positions: usize) -> Result<()> {
    if logits.iter().all(|x| x.is_finite()) {
        return Ok(());
    }
    Err(Error::NonFinite {
        positions,
        origin: "the logits".into(),
    })
}

/// The next-token step from a full logits vector.
pub fn step_of(logits: &[f32], top_logits: usize) -> Step {
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

/// A model with its KV cache on one tier: feeds tokens, returns the next-token step.
pub trait Session {
    /// Runs `tokens` after what the session holds; returns the step chosen at the last position,
    /// with its `top_logits` largest logits.
    fn feed(&mut self, tokens: &[u32], top_logits: usize) -> Result<Step>;
    /// Runs `tokens` after what the session holds; returns every logit of the last position
    /// (what a sampler needs).
    fn feed_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>>;
    /// Forgets positions `keep..`; an error (changing nothing) where the session's cache cannot
    /// be cut back that far (sliding layers kept as rings).
    fn truncate(&mut self, keep: usize) -> Result<()>;
    /// Positions held.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Which tier runs now ("cpu" or "gpu").
    fn backend(&self) -> &'static str;
    /// GPU submissions and readbacks so far, when the GPU tier runs.
    fn gpu_counters(&self) -> Option<GpuCounters> {
        None
    }
    /// Per-kernel device time so far, when the GPU tier runs with a profile.
    fn gpu_profile(&self) -> Option<GpuProfile> {
        None
    }
    /// Where each layer ran, when the GPU tier runs.
    fn placement(&self) -> Option<Vec<LayerPlacement>> {
        None
    }
}

/// The CPU tier.
pub struct CpuSession<'a> {
    model: &'a Model,
    cache: KvCache,
}

impl<'a> CpuSession<'a> {
    pub fn new(model: &'a Model, context: usize) -> CpuSession<'a> {
        CpuSession::with_layout(model, context, false)
    }

    /// A session whose cache keeps every position, so that it can be cut back anywhere.
    pub fn keeping_all(model: &'a Model, context: usize) -> CpuSession<'a> {
        CpuSession::with_layout(model, context, true)
    }

    /// `keeping_all` when `keep_all`, else `new`.
    pub fn with_layout(model: &'a Model, context: usize, keep_all: bool) -> CpuSession<'a> {
        CpuSession {
            model,
            cache: KvCache::with_layout(&model.config, context, keep_all),
        }
    }
}

impl Session for CpuSession<'_> {
    fn feed(&mut self, tokens: &[u32], top_logits: usize) -> Result<Step> {
        let logits = self.feed_logits(tokens)?;
        Ok(step_of(&logits, top_logits))
    }

    fn feed_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        let logits = self.model.forward(&mut self.cache, tokens, None)?;
        check_finite(&logits, self.cache.len())?;
        Ok(logits)
    }

    fn truncate(&mut self, keep: usize) -> Result<()> {
        if self.cache.truncate(keep) {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "cannot cut the KV cache back to {keep} of {} positions",
                self.cache.len()
            )))
        }
    }

    fn len(&self) -> usize {
        self.cache.len()
    }

    fn backend(&self) -> &'static str {
        "cpu"
    }
}

impl Session for GpuModel<'_> {
    fn feed(&mut self, tokens: &[u32], top_logits: usize) -> Result<Step> {
        GpuModel::feed(self, tokens, top_logits)
    }

    fn feed_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        GpuModel::feed_logits(self, tokens)
    }

    fn truncate(&mut self, keep: usize) -> Result<()> {
        GpuModel::truncate(self, keep)
    }

    fn len(&self) -> usize {
        GpuModel::len(self)
    }

    fn backend(&self) -> &'static str {
        "gpu"
    }

    fn gpu_counters(&self) -> Option<GpuCounters> {
        Some(self.counters)
    }

    fn gpu_profile(&self) -> Option<GpuProfile> {
        self.profile().cloned()
    }

    fn placement(&self) -> Option<Vec<LayerPlacement>> {
        Some(GpuModel::placement(self).to_vec())
    }
}

/// The GPU tier while its device lives; if the device is lost, the CPU tier for the rest of the
/// run (it replays the tokens seen so far to rebuild its cache).
pub struct FallbackSession<'a> {
    model: &'a Model,
    context: usize,
    /// Whether the caches keep every position (so that the session can be cut back anywhere).
    keep_all: bool,
    gpu: Option<GpuModel<'a>>,
    cpu: Option<CpuSession<'a>>,
    history: Vec<u32>,
}

impl<'a> FallbackSession<'a> {
    pub fn new(model: &'a Model, gpu: GpuModel<'a>, context: usize) -> FallbackSession<'a> {
        FallbackSession {
            model,
            context,
            keep_all: gpu.keeps_all_positions(),
            gpu: Some(gpu),
            cpu: None,
            history: Vec::new(),
        }
    }

    /// The CPU tier only; with `keep_all`, a cache that can be cut back anywhere.
    pub fn cpu(model: &'a Model, context: usize, keep_all: bool) -> FallbackSession<'a> {
        FallbackSession {
            model,
            context,
            keep_all,
            gpu: None,
            cpu: Some(CpuSession::with_layout(model, context, keep_all)),
            history: Vec::new(),
        }
    }

    /// The GPU tier, while it runs.
    pub fn gpu(&self) -> Option<&GpuModel<'a>> {
        self.gpu.as_ref()
    }

    pub fn gpu_mut(&mut self) -> Option<&mut GpuModel<'a>> {
        self.gpu.as_mut()
    }
}

/// Where the model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Cpu,
    Gpu,
    /// A GPU when there is one and the model fits on it, else the CPU.
    Auto,
}

/// Where sessions run: the tier choice and the GPU tier's options (their `context` aside: each
/// session sets its own).
#[derive(Debug, Clone)]
pub struct SessionTier {
    pub backend: BackendChoice,
    pub gpu: GpuTierOptions,
}

impl SessionTier {
    /// The CPU tier.
    pub fn cpu() -> SessionTier {
        SessionTier {
            backend: BackendChoice::Cpu,
            gpu: GpuTierOptions::default(),
        }
    }
}

/// Where a process runs its sessions: the CPU tier, or the GPU with the model's weights
/// uploaded once and shared by every session opened here.
pub struct Runtime<'m> {
    model: &'m Model,
    /// The weights on the GPU, when sessions run there.
    gpu: Option<Arc<GpuWeights<'m>>>,
    choice: BackendChoice,
    /// The GPU tier's options for every session (each sets its own context and cache layout).
    options: GpuTierOptions,
}

impl<'m> Runtime<'m> {
    /// Uploads the model to the GPU when `choice` asks for it and says at start-up which tier
    /// runs. `Gpu` fails with a clear error when there is no usable adapter or the dense weights
    /// do not fit; `Auto` then runs on the CPU and says why in the log.
    pub fn open(model: &'m Model, choice: BackendChoice, options: &GpuTierOptions) -> Result<Self> {
        let cpu = || Runtime {
            model,
            gpu: None,
            choice,
            options: options.clone(),
        };
        if choice == BackendChoice::Cpu {
            return Ok(cpu());
        }
        if let Some(mode) = model.cpu_only_mode() {
            if choice == BackendChoice::Gpu {
                return Err(Error::InvalidArgument(format!(
                    "{mode} runs on the CPU tier only (use --backend cpu or auto)"
                )));
            }
            log::info!("running on the CPU tier ({mode} is CPU-only)");
            return Ok(cpu());
        }
        let weights = crate::gpu::GpuContext::new(&crate::gpu::GpuOptions::from_env())
            .and_then(|ctx| GpuWeights::load(ctx, model, options));
        match (weights, choice) {
            (Ok(weights), _) => {
                let adapter = &weights.ctx.adapter;
                log::info!("running on the GPU: {} ({})", adapter.name, adapter.backend);
                Ok(Runtime {
                    gpu: Some(Arc::new(weights)),
                    ..cpu()
                })
            }
            (Err(e), BackendChoice::Auto) => {
                log::info!("running on the CPU tier ({e})");
                Ok(cpu())
            }
            (Err(e), _) => Err(e),
        }
    }

    pub fn model(&self) -> &'m Model {
        self.model
    }

    /// The weights on the GPU, when sessions run there.
    pub fn gpu(&self) -> Option<&Arc<GpuWeights<'m>>> {
        self.gpu.as_ref()
    }

    /// A new empty session of at most `context` positions; with `keep_all`, caches that can be
    /// cut back anywhere. On the GPU it shares the weights with every other session of this
    /// runtime; a device lost since, or one without room for the session's own buffers, gives a
    /// CPU session unless the runtime was opened with `Gpu`.
    pub fn session(&self, context: usize, keep_all: bool) -> Result<FallbackSession<'m>> {
        self.session_with(context, keep_all, self.options.profile)
    }

    /// A session of this runtime's GPU whose every kernel is timed (`bench --profile`); an error
    /// where the runtime is not on the GPU or the adapter has no timestamps.
    pub fn profiled_session(&self, context: usize) -> Result<FallbackSession<'m>> {
        if self.gpu.is_none() {
            return Err(Error::InvalidArgument(
                "a profile times GPU kernels; this runtime is on the CPU tier".into(),
            ));
        }
        self.session_with(context, false, true)
    }

    fn session_with(
        &self,
        context: usize,
        keep_all: bool,
        profile: bool,
    ) -> Result<FallbackSession<'m>> {
        let Some(weights) = &self.gpu else {
            return Ok(FallbackSession::cpu(self.model, context, keep_all));
        };
        let options = GpuTierOptions {
            context,
            keep_all_positions: keep_all,
            profile,
            ..self.options.clone()
        };
        let gpu = if weights.ctx.is_lost() {
            Err(Error::Gpu("the GPU device was lost".into()))
        } else {
            GpuModel::on(Arc::clone(weights), options)
        };
        match (gpu, self.choice) {
            (Ok(gpu), _) => Ok(FallbackSession::new(self.model, gpu, context)),
            (Err(e), BackendChoice::Auto) => {
                log::warn!("GPU: {e}; this session runs on the CPU tier");
                Ok(FallbackSession::cpu(self.model, context, keep_all))
            }
            (Err(e), _) => Err(e),
        }
    }
}

/// Opens a session on the chosen tier (`gpu.context` and `gpu.top_logits` apply to both):
/// a runtime of its own (`Runtime::open`) with one session.
pub fn open_session<'a>(
    model: &'a Model,
    choice: BackendChoice,
    gpu: &GpuTierOptions,
) -> Result<FallbackSession<'a>> {
    Runtime::open(model, choice, gpu)?.session(gpu.context, gpu.keep_all_positions)
}

/// Prompt tokens the GPU tier runs per block.
pub const DEFAULT_GPU_BLOCK: usize = 128;

impl FallbackSession<'_> {
    /// Runs `tokens` through `run` on the GPU tier while it lives, else (or once it fails) on the
    /// CPU tier, which first replays the tokens fed so far. Non-finite logits are an error that
    /// says where they first appear.
    fn run<T>(
        &mut self,
        tokens: &[u32],
        run: impl Fn(&mut dyn Session, &[u32]) -> Result<T>,
    ) -> Result<T> {
        let result = self.run_on_a_tier(tokens, run);
        match result {
            Err(Error::NonFinite { positions, .. }) => Err(Error::NonFinite {
                positions,
                origin: self.locate_non_finite(tokens),
            }),
            result => result,
        }
    }

    /// Where the CPU tier first sees non-finite values when it runs every token fed so far and
    /// `tokens` from position 0 (the search after a failure: a whole prefill).
    fn locate_non_finite(&self, tokens: &[u32]) -> String {
        let all = [self.history.as_slice(), tokens].concat();
        match self.model.locate_non_finite(&all) {
            Ok(Some(origin)) => origin,
            Ok(None) => "the GPU tier only (the CPU tier's values are finite)".into(),
            Err(e) => format!("an unknown place (the search failed: {e})"),
        }
    }

    /// `run` on the GPU tier while it lives, else (or once it fails) on the CPU tier.
    fn run_on_a_tier<T>(
        &mut self,
        tokens: &[u32],
        run: impl Fn(&mut dyn Session, &[u32]) -> Result<T>,
    ) -> Result<T> {
        if let Some(gpu) = &mut self.gpu {
            match run(gpu, tokens) {
                Ok(out) => {
                    self.history.extend_from_slice(tokens);
                    return Ok(out);
                }
                // A lost device, or one that cannot go on (e.g. the KV cache outgrew it): the CPU
                // tier takes over, rebuilding its cache from the tokens fed so far.
                Err(Error::Gpu(message)) => {
                    log::warn!(
                        "GPU: {message}; continuing on the CPU tier for the rest of the run"
                    );
                    self.gpu = None;
                    let mut cpu = CpuSession::with_layout(self.model, self.context, self.keep_all);
                    if !self.history.is_empty() {
                        // On failure no CPU session is kept: every later feed fails too.
                        cpu.feed(&self.history, 0)?;
                    }
                    self.cpu = Some(cpu);
                }
                Err(e) => return Err(e),
            }
        }
        let cpu = self.cpu.as_mut().ok_or_else(|| {
            Error::InvalidArgument(
                "this session lost its GPU and could not rebuild its cache on the CPU".into(),
            )
        })?;
        let out = run(cpu, tokens)?;
        self.history.extend_from_slice(tokens);
        Ok(out)
    }
}

impl Session for FallbackSession<'_> {
    fn feed(&mut self, tokens: &[u32], top_logits: usize) -> Result<Step> {
        self.run(tokens, |session, tokens| session.feed(tokens, top_logits))
    }

    fn feed_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        self.run(tokens, |session, tokens| session.feed_logits(tokens))
    }

    fn truncate(&mut self, keep: usize) -> Result<()> {
        match (&mut self.gpu, &mut self.cpu) {
            (Some(gpu), _) => gpu.truncate(keep)?,
            (None, Some(cpu)) => cpu.truncate(keep)?,
            // The CPU tier could not take over (its replay failed): an empty session can start
            // again.
            (None, None) if keep == 0 => {
                self.cpu = Some(CpuSession::with_layout(
                    self.model,
                    self.context,
                    self.keep_all,
                ));
            }
            (None, None) => {}
        }
        self.history.truncate(keep);
        Ok(())
    }

    fn len(&self) -> usize {
        self.history.len()
    }

    fn backend(&self) -> &'static str {
        if self.gpu.is_some() { "gpu" } else { "cpu" }
    }

    fn gpu_counters(&self) -> Option<GpuCounters> {
        self.gpu.as_ref().map(|g| g.counters)
    }

    fn gpu_profile(&self) -> Option<GpuProfile> {
        self.gpu.as_ref().and_then(|g| g.profile().cloned())
    }

    fn placement(&self) -> Option<Vec<LayerPlacement>> {
        self.gpu.as_ref().map(|g| g.placement().to_vec())
    }
}

/// Greedy decoding of up to `max_new_tokens` tokens after `prompt` on the CPU tier.
pub fn generate(model: &Model, prompt: &[u32], options: &GenerateOptions) -> Result<Generation> {
    let mut session = CpuSession::new(model, options.context);
    generate_with(&mut session, &model.config, prompt, options)
}

/// Greedy decoding on any session.
pub fn generate_with(
    session: &mut dyn Session,
    config: &Config,
    prompt: &[u32],
    options: &GenerateOptions,
) -> Result<Generation> {
    generate_observed(session, config, prompt, options, &mut |_, _| {})
}

/// Like `generate_with`, calling `observe(session, phase_done)` after the prefill (`false`) and
/// at the end (`true`), so callers can read counters per phase.
pub fn generate_observed(
    session: &mut dyn Session,
    config: &Config,
    prompt: &[u32],
    options: &GenerateOptions,
    observe: &mut dyn FnMut(&dyn Session, bool),
) -> Result<Generation> {
    generate_streamed(session, config, prompt, options, observe, &mut |_| true)
}

/// Like `generate_observed`, calling `on_token` with each step as it is chosen; when it returns
/// false, generation stops there (`StopReason::Interrupted`), the step kept.
pub fn generate_streamed(
    session: &mut dyn Session,
    config: &Config,
    prompt: &[u32],
    options: &GenerateOptions,
    observe: &mut dyn FnMut(&dyn Session, bool),
    on_token: &mut dyn FnMut(&Step) -> bool,
) -> Result<Generation> {
    validate_prompt(config, prompt, options.context)?;
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
    let mut step = session.feed(prompt, options.top_logits)?;
    generation.prefill_ms = started.elapsed().as_secs_f64() * 1000.0;
    observe(&*session, false);

    let decode_started = Instant::now();
    loop {
        let id = step.id;
        let go_on = on_token(&step);
        generation.generated_ids.push(id);
        generation.steps.push(step);
        if !go_on {
            generation.stop = StopReason::Interrupted;
            break;
        }
        if options.stop_at_eos && config.eos_token_ids.contains(&id) {
            generation.stop = StopReason::Eos;
            break;
        }
        if generation.generated_ids.len() >= options.max_new_tokens {
            break;
        }
        if session.len() >= options.context {
            log::warn!(
                "context of {} positions is full after {} generated tokens; stopping (raise --context)",
                options.context,
                generation.generated_ids.len()
            );
            generation.stop = StopReason::ContextFull;
            break;
        }
        step = session.feed(&[id], options.top_logits)?;
        generation.decode_tokens += 1;
    }
    generation.decode_ms = decode_started.elapsed().as_secs_f64() * 1000.0;
    observe(&*session, true);
    Ok(generation)
}
