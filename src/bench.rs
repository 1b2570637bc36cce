//! `picchio bench`: prefill and decode speed, cache hit rates and bytes moved, swept over memory
//! budgets (every VRAM budget with every RAM budget), each run on a freshly loaded model.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::experts::{ExpertStats, RamBudget, VramBudget};
use crate::gpu::profile::{KernelRow, decode_profile};
use crate::model::generate::{BackendChoice, GenerateOptions, Runtime, Session, generate_observed};
use crate::model::gpu_tier::{GpuCounters, GpuTierOptions, MissPolicy, vram_bytes_per_expert};
use crate::model::{Model, ModelOptions};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub model: PathBuf,
    pub backend: BackendChoice,
    pub ram_budgets: Vec<RamBudget>,
    /// The GPU tier's expert cache budgets (ignored by CPU runs).
    pub vram_budgets: Vec<VramBudget>,
    pub miss_policy: MissPolicy,
    /// Read a converted store's experts with O_DIRECT.
    pub direct_io: bool,
    /// Prefetch settings to compare (each runs with every budget).
    pub prefetch: Vec<bool>,
    pub prefetch_proxy: crate::model::PrefetchProxy,
    /// Layers ahead the CPU tier prefetches, in runs with prefetch on.
    pub prefetch_distance: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub seed: u64,
    /// Measure the machine's read bandwidth and judge decode against it; also time the
    /// prefill of a 512-token prompt.
    pub roofline: bool,
    /// GPU runs: decode again with every kernel timed, for a per-kernel table (`BenchRun::profile`).
    pub profile: bool,
    /// How the CPU tier holds dense weights in every run.
    pub dense_format: crate::cpu::q8::DenseFormat,
    /// How the CPU tier multiplies MXFP4 experts with their inputs in every run.
    pub expert_activations: crate::cpu::q8_activations::ExpertActivations,
    /// Where the weights live in every run.
    pub mmap: crate::model::MmapMode,
    /// How the KV cache holds keys and values in every run.
    pub kv_format: crate::formats::KvFormat,
}

impl BenchOptions {
    /// `picchio bench --model MODEL`'s defaults: the CPU tier at RAM budget `auto`, prefetch
    /// off, a 64-token prompt then 32 decoded tokens, exact formats.
    pub fn new(model: PathBuf) -> BenchOptions {
        BenchOptions {
            model,
            backend: BackendChoice::Cpu,
            ram_budgets: vec![RamBudget::Auto],
            vram_budgets: vec![VramBudget::Auto],
            miss_policy: Default::default(),
            direct_io: false,
            prefetch: vec![false],
            prefetch_proxy: Default::default(),
            prefetch_distance: 1,
            prompt_tokens: 64,
            gen_tokens: 32,
            seed: 0,
            roofline: false,
            profile: false,
            dense_format: Default::default(),
            expert_activations: Default::default(),
            mmap: Default::default(),
            kv_format: Default::default(),
        }
    }
}

/// Prompt length of the second prefill measurement of a roofline bench.
pub const LONG_PROMPT_TOKENS: usize = 512;

/// Passes over the buffer each bandwidth measurement makes (the best one counts). Twenty, not
/// five: on a shared host the bandwidth a pass sees changes from one second to the next, and a
/// few short passes before and after the runs can all miss the fast moments, which judges a
/// decode against less than the memory gives. More passes find the machine's limit more often,
/// which can only lower a roofline fraction.
const BANDWIDTH_PASSES: usize = 20;

/// One configuration's measurements. Rates over the decode phase unless named otherwise.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRun {
    pub backend: String,
    pub ram_budget: String,
    pub ram_budget_bytes: u64,
    pub vram_budget: String,
    pub prefetch: bool,
    /// Share of the next layer's experts the prefetch proxy guessed (decode phase and prompt;
    /// null without prefetch, where nothing guesses).
    pub prefetch_accuracy: Option<f64>,
    /// The same for guesses 1, 2 and 3 layers ahead (CPU tier; null entries where none ran).
    pub prefetch_accuracy_by_distance: Vec<Option<f64>>,
    /// Layers ahead the prefetch read (runs with prefetch on).
    pub prefetch_distance: usize,
    /// Prefetched experts the routing then used, per decoded token.
    pub prefetch_used_per_token: f64,
    /// Bytes of the experts the GPU holds (null on the CPU tier).
    pub vram_budget_bytes: Option<u64>,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// VRAM hits / expert requests in the decode phase (null on the CPU tier).
    pub vram_hit_rate: Option<f64>,
    /// RAM hits / expert requests in the decode phase (null when no expert was requested).
    pub ram_hit_rate: Option<f64>,
    /// Bytes read from disk per decoded token: reads requests waited for plus prefetch reads,
    /// the chunks read of cancelled guesses included.
    pub disk_bytes_per_token: f64,
    /// Of which prefetch reads.
    pub prefetch_bytes_per_token: f64,
    /// Bytes copied into the VRAM expert cache per decoded token.
    pub upload_bytes_per_token: f64,
    /// Share of decode time spent waiting for expert reads.
    pub io_wait_share: f64,
    pub expert_requests: u64,
    pub evictions: u64,
    /// Peak resident memory during this run (Linux; null elsewhere).
    pub peak_rss_bytes: Option<u64>,
    /// Threads of the CPU tier and the kernels it ran (avx512, avx2, scalar).
    pub threads: usize,
    pub cpu_kernels: String,
    /// Whether bf16 dense layers over several tokens (prompts) ran on AMX-BF16 tiles.
    pub amx_tiles: bool,
    /// checkpoint (exact) or q8.
    pub dense_format: String,
    /// How the KV cache held keys and values (`--kv-cache`).
    pub kv_cache: String,
    /// exact or q8 (MXFP4 experts' inputs on the CPU tier).
    pub expert_activations: String,
    /// Whether the weights a token reads were copied into memory (else mapped).
    pub weights_in_memory: bool,
    /// Seconds spent faulting in the mapped weights before timing (experts included when they
    /// all fit the RAM budget): what a first prompt would otherwise pay.
    pub warmup_s: f64,
    /// Bytes one decoded token reads: attention and router weights of every layer, the LM head,
    /// an embedding row, the experts it requested (measured) with their biases, and the KV
    /// cache positions its queries see.
    pub bytes_per_token: f64,
    /// bytes_per_token x decode tokens/s.
    pub achieved_bytes_per_s: f64,
    /// This machine's read bandwidth, measured in the same bench before and after the runs (the
    /// better of the two; roofline runs only), on the page size the run's weights live in.
    pub bandwidth_bytes_per_s: Option<f64>,
    /// Whether that was huge pages (weights copied into memory) or small ones (mapped).
    pub bandwidth_huge_pages: Option<bool>,
    /// Size of the buffer that measurement read: eight times the last-level cache, at least 2
    /// GiB (`cpu::machine::bandwidth_buffer_bytes`).
    pub bandwidth_buffer_bytes: Option<u64>,
    /// achieved / measured bandwidth (roofline runs only). On the GPU tier, against the
    /// adapter's own read bandwidth, and only where every expert the decode used was in VRAM
    /// (else part of the token ran on the CPU tier and no one limit applies).
    pub roofline_fraction: Option<f64>,
    /// What `bandwidth_bytes_per_s` measured: "host" (the CPU tier's memory) or "gpu" (the
    /// adapter's memory, read by a kernel).
    pub bandwidth_of: Option<String>,
    /// Per decoded token on the GPU tier: compute dispatches, submissions and blocking
    /// readbacks (null on the CPU tier).
    pub gpu_dispatches_per_token: Option<f64>,
    pub gpu_submits_per_token: Option<f64>,
    pub gpu_readbacks_per_token: Option<f64>,
    /// Prefill speed of a 512-token prompt (roofline runs only).
    pub prefill_512_tokens_per_s: Option<f64>,
    /// That prefill's speed over this run's decode speed: how much faster a 512-token prompt
    /// runs than 512 tokens decoded one at a time (roofline runs only).
    pub prefill_512_over_decode: Option<f64>,
    /// Where a decoded token's time went on the CPU tier, ms: attention (projections included),
    /// experts (router and MoE), head (final norm and LM head).
    pub decode_attention_ms_per_token: f64,
    pub decode_experts_ms_per_token: f64,
    pub decode_head_ms_per_token: f64,
    /// Roofline runs on the CPU tier: `--gen-tokens` more tokens decoded after the timed ones,
    /// each followed by one read of the LM head's weights (`interleaved_bandwidth_bytes_per_s`).
    /// Null where the head is under twice the last-level cache (a read of it would partly hit
    /// the cache).
    pub interleaved_decode_tokens_per_s: Option<f64>,
    /// The mean bandwidth of those reads: the memory's speed at the moments the tokens ran, on
    /// the pages the decode reads its weights from.
    pub interleaved_bandwidth_bytes_per_s: Option<f64>,
    /// Bytes per token x interleaved tokens/s / interleaved bandwidth. Where the host's memory
    /// bandwidth changes from one second to the next, the best pass before and after the runs
    /// and the decode in between can meet different conditions (runs minutes apart can then be
    /// far apart by `roofline_fraction`); each read here follows a token, so both see the same
    /// minutes.
    pub interleaved_roofline_fraction: Option<f64>,
    /// Per-kernel device time of the decode, from a second, profiled decode of the same prompt
    /// (`--profile`, GPU runs on adapters with timestamps).
    pub profile: Option<Vec<KernelRow>>,
    /// `--direct-io` runs: the store's read bandwidth measured just before and just after this
    /// run (the better of the two), reading random expert records as the engine does: at the
    /// engine's queue depth (`io_threads`) and at the best depth of a sweep before the first run's timing.
    pub disk_bandwidth_bytes_per_s: Option<f64>,
    pub disk_bandwidth_at_io_threads_bytes_per_s: Option<f64>,
    pub disk_best_depth: Option<usize>,
    /// IO threads (the reads in flight at most) and the largest read each makes.
    pub io_threads: usize,
    pub read_chunk_bytes: usize,
    /// Bytes per decoded token the RAM cache did not hold when asked: read on demand, or by a
    /// prefetch that the layer then used.
    pub missed_bytes_per_token: f64,
    /// Decode time per token without the waits for reads.
    pub compute_s_per_token: f64,
    /// The disk-bound limit per token: missed bytes / the best disk bandwidth, or the compute
    /// time where that is larger (`--direct-io` runs).
    pub disk_bound_s_per_token: Option<f64>,
    /// That limit over the measured time per token (1: as fast as the disk allows).
    pub disk_roofline_fraction: Option<f64>,
    /// Mean reads and bytes in flight as each read started, in the decode.
    pub read_queue_depth: Option<f64>,
    pub bytes_in_flight: Option<f64>,
    /// Prefetched experts the staging area holds at most, beside the RAM budget.
    pub prefetch_staging_experts: usize,
}

/// Decode speed and memory bandwidth measured in turns: see
/// `BenchRun::interleaved_roofline_fraction`.
#[derive(Debug, Clone)]
struct Interleaved {
    tokens_per_s: f64,
    bandwidth_bytes_per_s: f64,
    roofline_fraction: f64,
    /// The tokens decoded (the tests check them against a plain decode).
    #[cfg_attr(not(test), expect(dead_code))]
    ids: Vec<u32>,
}

/// The smallest LM head an interleaved measurement reads: twice the last-level cache (64 MiB
/// where its size is unknown). The head is the last thing a token reads, so a read of it after
/// the token starts from the memory, and at twice the cache the head's end (still cached from
/// the token) is evicted again before the read reaches it.
fn interleaved_min_head_bytes() -> usize {
    crate::cpu::machine::last_level_cache_bytes().map_or(64 << 20, |c| 2 * c)
}

/// Decodes `tokens` tokens on `session` after `id` (its last token, not yet fed), reading the
/// LM head's weights once after each token. None where the head is under `min_head_bytes`.
fn interleaved_decode(
    model: &Model,
    session: &mut dyn Session,
    mut id: u32,
    tokens: usize,
    min_head_bytes: usize,
) -> Result<Option<Interleaved>> {
    if tokens == 0 {
        return Ok(None);
    }
    let head = model.head_weight_bytes();
    let head_bytes: usize = head.iter().map(|h| h.len()).sum();
    if head_bytes < min_head_bytes {
        log::info!(
            "no interleaved bandwidth readings: the LM head ({head_bytes} bytes) is under twice the last-level cache"
        );
        return Ok(None);
    }
    let first = session.len();
    let before = model.experts.stats();
    let (mut decode_s, mut bandwidth_sum) = (0f64, 0f64);
    let mut ids = Vec::with_capacity(tokens);
    for _ in 0..tokens {
        let started = Instant::now();
        id = session.feed(&[id], 0)?.id;
        decode_s += started.elapsed().as_secs_f64();
        ids.push(id);
        bandwidth_sum += crate::cpu::machine::read_bytes_per_s(&head);
    }
    let requests = model.experts.stats().since(&before).requests;
    let bytes_per_token = decode_bytes_per_token(
        model,
        requests as f64 / tokens as f64,
        first..first + tokens,
    );
    let tokens_per_s = tokens as f64 / decode_s.max(1e-9);
    let bandwidth_bytes_per_s = bandwidth_sum / tokens as f64;
    let measured = Interleaved {
        tokens_per_s,
        bandwidth_bytes_per_s,
        roofline_fraction: bytes_per_token * tokens_per_s / bandwidth_bytes_per_s,
        ids,
    };
    log::info!(
        "interleaved: decode {:.2} tokens/s ({:.2} GB/s), LM head read after each token at {:.2} GB/s on average: {:.1}%",
        tokens_per_s,
        bytes_per_token * tokens_per_s / 1e9,
        bandwidth_bytes_per_s / 1e9,
        measured.roofline_fraction * 100.0
    );
    Ok(Some(measured))
}

/// Bytes a decode step at each of `positions` reads, on average: see `BenchRun::bytes_per_token`.
pub fn decode_bytes_per_token(
    model: &Model,
    expert_requests_per_token: f64,
    positions: std::ops::Range<usize>,
) -> f64 {
    let cfg = &model.config;
    let floats = |v: &[f32]| (v.len() * 4) as f64;
    let small: f64 = model
        .weights
        .layers
        .iter()
        .map(|l| {
            [&l.router_bias, &l.sinks]
                .iter()
                .map(|v| v.as_deref().map_or(0.0, floats))
                .sum::<f64>()
        })
        .sum();
    let dense = model.dense_bytes_per_token() as f64 + small;
    let expert_biases = model.weights.expert_bias_bytes() as f64;
    let experts = expert_requests_per_token * (model.experts.expert_bytes() as f64 + expert_biases);
    // Keys and values (f32) of the positions each layer's queries see.
    let steps = positions.len().max(1) as f64;
    let kv: f64 = positions
        .map(|p| {
            (0..cfg.num_layers)
                .map(|l| {
                    let first = crate::cpu::attention::first_visible_key(p, cfg.window_of(l));
                    ((p + 1 - first) * cfg.kv_dim() * 2 * 4) as f64
                })
                .sum::<f64>()
        })
        .sum::<f64>()
        / steps;
    dense + experts + kv
}

/// Resets the kernel's peak-RSS mark so each run reports its own peak (Linux); false where it
/// cannot, and the peak would then be the process's.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// A deterministic prompt of `n` ids below `vocab`.
fn prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Runs every budget in turn; `progress(done, total)` after each.
pub fn run_bench(
    options: &BenchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<BenchRun>> {
    if options.prompt_tokens == 0 || options.gen_tokens < 2 {
        return Err(Error::InvalidArgument(
            "bench needs --prompt-tokens of at least 1 and --gen-tokens of at least 2".into(),
        ));
    }
    let vram_budgets = match options.backend {
        BackendChoice::Cpu => vec![VramBudget::Auto],
        _ => options.vram_budgets.clone(),
    };
    let prefetch = if options.prefetch.is_empty() {
        vec![false]
    } else {
        options.prefetch.clone()
    };
    let configurations: Vec<(VramBudget, RamBudget, bool)> = vram_budgets
        .iter()
        .flat_map(|&v| options.ram_budgets.iter().map(move |&r| (v, r)))
        .flat_map(|(v, r)| prefetch.iter().map(move |&p| (v, r, p)))
        .collect();
    // Each page size the weights may live in: small (mapped files), huge (copied into memory).
    let buffer_bytes = crate::cpu::machine::bandwidth_buffer_bytes();
    let measure_bandwidth = || {
        [false, true].map(|huge| {
            let b = crate::cpu::machine::measure_read_bandwidth(
                buffer_bytes,
                BANDWIDTH_PASSES,
                huge,
            );
            log::info!(
                "read bandwidth: {:.2} GB/s ({} pages, {} threads, {} MiB read {} times, best pass)",
                b.bytes_per_s / 1e9,
                if huge { "huge" } else { "small" },
                b.threads,
                b.buffer_bytes >> 20,
                b.passes
            );
            b
        })
    };
    let bandwidth = options.roofline.then(measure_bandwidth);
    let gpu_roofline = options.roofline && options.backend != BackendChoice::Cpu;
    let gpu_bandwidth = if gpu_roofline {
        measure_gpu_bandwidth()
    } else {
        None
    };
    // The disk's best queue depth, from a sweep over the first run's store.
    let mut best_depth: Option<usize> = None;
    let mut runs = Vec::new();
    for (done, &(vram_budget, budget, prefetch)) in configurations.iter().enumerate() {
        let peak_is_this_runs = reset_peak_rss();
        let model = Model::load_with(
            &options.model,
            &ModelOptions {
                ram_budget: budget,
                direct_io: options.direct_io,
                dense_format: options.dense_format,
                expert_activations: options.expert_activations,
                mmap: options.mmap,
                kv_format: options.kv_format,
                interleave_experts: options.backend == BackendChoice::Cpu,
                prefetch: crate::model::PrefetchOptions {
                    enabled: prefetch,
                    proxy: options.prefetch_proxy,
                    distance: options.prefetch_distance,
                    // Guesses scored at every distance: a few more router products per
                    // layer, small beside a token's.
                    measure_accuracy: prefetch,
                },
                ..Default::default()
            },
        )?;
        let warmup = Instant::now();
        model.warm_up();
        let warmup_s = warmup.elapsed().as_secs_f64();
        let ids = prompt(options.prompt_tokens, model.config.vocab_size, options.seed);
        // Room for the interleaved measurement's tokens after the timed ones.
        let decoded_tokens = options.gen_tokens * if options.roofline { 2 } else { 1 };
        let context = options.prompt_tokens + decoded_tokens;
        let gpu_options = GpuTierOptions {
            context,
            vram_budget,
            miss_policy: options.miss_policy,
            ..Default::default()
        };
        // One upload of the weights for this run's sessions (the long prefill opens its own).
        let runtime = Runtime::open(&model, options.backend, &gpu_options)?;
        let mut session = runtime.session(context, false)?;
        if let Some(gpu) = session.gpu_mut() {
            // Compile the kernels before the clock starts.
            gpu.prepare_plans(ids.len())?;
        }
        let generate_options = GenerateOptions {
            max_new_tokens: options.gen_tokens,
            top_logits: 0,
            stop_at_eos: false,
            context,
        };
        let mut marks: Vec<ExpertStats> = Vec::new();
        let mut gpu_marks: Vec<Option<GpuCounters>> = Vec::new();
        let mut times: Vec<(f64, f64, f64)> = vec![model.timings.millis()];
        if options.direct_io && options.backend == BackendChoice::Cpu && best_depth.is_none() {
            best_depth = Some(best_disk_depth(&model)?);
        }
        let disk_before = match best_depth {
            Some(best) => Some(probe_disk(&model, best, false)?),
            None => None,
        };
        let started = Instant::now();
        let out = generate_observed(
            &mut session,
            &model.config,
            &ids,
            &generate_options,
            &mut |session, _| {
                marks.push(model.experts.stats());
                gpu_marks.push(session.gpu_counters());
                times.push(model.timings.millis());
            },
        )?;
        log::debug!("run took {:.1} s", started.elapsed().as_secs_f64());
        // The better of before and after: what the disk could give in those minutes.
        let disk = match (disk_before, best_depth) {
            (Some(before), Some(best)) => Some(before.better(&probe_disk(&model, best, true)?)),
            _ => None,
        };
        let on_gpu = session.gpu().is_some();
        let backend = session.backend().to_string();
        let vram_budget_bytes = session
            .gpu()
            .map(|g| g.vram_experts() as u64 * vram_bytes_per_expert(&model));
        // times[0] before the prompt, times[1] after its first token, times[2] after the last.
        let prefill_split = (
            times[1].0 - times[0].0,
            times[1].1 - times[0].1,
            times[1].2 - times[0].2,
        );
        log::info!(
            "prefill of {} tokens: attention {:.1} ms, experts {:.1} ms, head {:.1} ms, in all {:.1} ms",
            options.prompt_tokens,
            prefill_split.0,
            prefill_split.1,
            prefill_split.2,
            out.prefill_ms
        );
        let decode = marks[1].since(&marks[0]);
        let decoded = out.decode_tokens.max(1) as f64;
        // Decode steps run at positions prompt..prompt + decoded (the first token comes from
        // the prompt's logits).
        let first_step = options.prompt_tokens;
        let bytes_per_token = decode_bytes_per_token(
            &model,
            decode.requests as f64 / decoded,
            first_step..first_step + out.decode_tokens,
        );
        let decode_tokens_per_s = out.decode_tokens_per_s().unwrap_or(0.0);
        let per_token = |of: fn(&(f64, f64, f64)) -> f64| (of(&times[2]) - of(&times[1])) / decoded;
        let split = (per_token(|t| t.0), per_token(|t| t.1), per_token(|t| t.2));
        log::info!(
            "decode per token: attention {:.1} ms, experts {:.1} ms, head {:.1} ms",
            split.0,
            split.1,
            split.2
        );
        let achieved_bytes_per_s = bytes_per_token * decode_tokens_per_s;
        let interleaved = match out.generated_ids.last() {
            Some(&last) if options.roofline && !on_gpu => {
                let min_head_bytes = interleaved_min_head_bytes();
                interleaved_decode(
                    &model,
                    &mut session,
                    last,
                    options.gen_tokens,
                    min_head_bytes,
                )?
            }
            _ => None,
        };
        drop(session);
        let profile = if options.profile && on_gpu {
            profiled_decode(&runtime, &model, &ids, &generate_options)?
        } else {
            None
        };
        // The limit of the memory this run's weights live in: the adapter's where every expert
        // the decode used was in VRAM, none where the CPU tier ran some.
        let all_in_vram = decode.vram_hits == decode.requests;
        let (limit, bandwidth_of) = match (on_gpu, gpu_bandwidth) {
            (true, Some(gpu)) if all_in_vram => (Some(gpu.bytes_per_s), Some("gpu")),
            (true, _) => (None, None),
            (false, _) => (
                bandwidth.map(|b| b[usize::from(model.weights_in_memory)].bytes_per_s),
                bandwidth.map(|_| "host"),
            ),
        };
        let gpu_decode = match gpu_marks.as_slice() {
            [Some(prefill), Some(end)] => Some(end.since(prefill)),
            _ => None,
        };
        let gpu_per_token =
            |of: fn(&GpuCounters) -> u64| gpu_decode.map(|d| of(&d) as f64 / decoded);
        let prefill_512_tokens_per_s = if options.roofline {
            Some(long_prefill_tokens_per_s(
                &runtime,
                model.config.vocab_size,
                options.seed,
            )?)
        } else {
            None
        };

        let (io_threads, read_chunk_bytes) = model.experts.read_shape();
        let missed_bytes_per_token =
            (decode.disk_bytes + decode.prefetch.used * model.experts.expert_bytes()) as f64
                / decoded;
        let compute_s_per_token = if decode_tokens_per_s > 0.0 {
            (1.0 / decode_tokens_per_s - decode.io_wait_ms / 1000.0 / decoded).max(0.0)
        } else {
            0.0
        };
        let disk_bound_s_per_token =
            disk.map(|d| (missed_bytes_per_token / d.best).max(compute_s_per_token));
        let rate = |hits: u64| (decode.requests > 0).then(|| hits as f64 / decode.requests as f64);
        let proxy = model.prefetch_proxy_on(&backend);
        let prefetch_accuracy = model.prediction_accuracy(proxy);
        runs.push(BenchRun {
            backend,
            ram_budget: format!("{budget:?}"),
            ram_budget_bytes: model.experts.budget(),
            vram_budget: format!("{vram_budget:?}"),
            vram_budget_bytes,
            vram_hit_rate: if on_gpu { rate(decode.vram_hits) } else { None },
            upload_bytes_per_token: decode.upload_bytes as f64 / decoded,
            prefetch,
            prefetch_accuracy,
            prefetch_accuracy_by_distance: (1..=crate::model::MAX_PREFETCH_DISTANCE)
                .map(|d| model.prediction_accuracy_at(proxy, d))
                .collect(),
            prefetch_distance: options.prefetch_distance,
            prefetch_used_per_token: decode.prefetch.used as f64 / decoded,
            prefetch_bytes_per_token: decode.prefetch.bytes as f64 / decoded,
            prefill_tokens_per_s: options.prompt_tokens as f64
                / (out.prefill_ms.max(1e-6) / 1000.0),
            decode_tokens_per_s,
            ram_hit_rate: rate(decode.ram_hits),
            // What the IO threads read, cancelled guesses' chunks included; a mapped store's
            // reads fault pages in instead and count as whole experts.
            disk_bytes_per_token: decode
                .reads
                .bytes
                .max(decode.disk_bytes + decode.prefetch.bytes)
                as f64
                / decoded,
            io_wait_share: if out.decode_ms > 0.0 {
                decode.io_wait_ms / out.decode_ms
            } else {
                0.0
            },
            expert_requests: decode.requests,
            evictions: decode.evictions,
            peak_rss_bytes: peak_is_this_runs.then(peak_rss_bytes).flatten(),
            threads: rayon::current_num_threads(),
            cpu_kernels: crate::cpu::simd::kernels().name().to_string(),
            amx_tiles: crate::cpu::simd::amx_tiles(),
            dense_format: options.dense_format.name().to_string(),
            kv_cache: options.kv_format.name().to_string(),
            expert_activations: options.expert_activations.name().to_string(),
            weights_in_memory: model.weights_in_memory,
            warmup_s,
            bytes_per_token,
            achieved_bytes_per_s,
            bandwidth_bytes_per_s: limit,
            bandwidth_huge_pages: (bandwidth_of == Some("host")).then_some(model.weights_in_memory),
            bandwidth_buffer_bytes: match bandwidth_of {
                Some("gpu") => gpu_bandwidth.map(|g| g.buffer_bytes),
                Some(_) => bandwidth.map(|b| b[0].buffer_bytes as u64),
                None => None,
            },
            roofline_fraction: limit.map(|b| achieved_bytes_per_s / b),
            disk_bandwidth_bytes_per_s: disk.map(|d| d.best),
            disk_bandwidth_at_io_threads_bytes_per_s: disk.map(|d| d.at_io_threads),
            disk_best_depth: best_depth,
            io_threads,
            read_chunk_bytes,
            missed_bytes_per_token,
            compute_s_per_token,
            disk_bound_s_per_token,
            disk_roofline_fraction: disk_bound_s_per_token
                .filter(|_| decode_tokens_per_s > 0.0)
                .map(|limit| limit * decode_tokens_per_s),
            read_queue_depth: decode.reads.mean_depth(),
            bytes_in_flight: decode.reads.mean_bytes_in_flight(),
            prefetch_staging_experts: model.experts.staging_experts(),
            bandwidth_of: bandwidth_of.map(str::to_string),
            gpu_dispatches_per_token: gpu_per_token(|c| c.dispatches),
            gpu_submits_per_token: gpu_per_token(|c| c.submits),
            gpu_readbacks_per_token: gpu_per_token(|c| c.readbacks),
            prefill_512_tokens_per_s,
            prefill_512_over_decode: prefill_512_tokens_per_s
                .filter(|_| decode_tokens_per_s > 0.0)
                .map(|prefill| prefill / decode_tokens_per_s),
            decode_attention_ms_per_token: split.0,
            decode_experts_ms_per_token: split.1,
            decode_head_ms_per_token: split.2,
            interleaved_decode_tokens_per_s: interleaved.as_ref().map(|i| i.tokens_per_s),
            interleaved_bandwidth_bytes_per_s: interleaved
                .as_ref()
                .map(|i| i.bandwidth_bytes_per_s),
            interleaved_roofline_fraction: interleaved.as_ref().map(|i| i.roofline_fraction),
            profile,
        });
        progress(done + 1, configurations.len());
    }
    if let Some(before) = gpu_bandwidth {
        // As for the host below: the better of two measurements.
        let best = measure_gpu_bandwidth().map_or(before.bytes_per_s, |after| {
            after.bytes_per_s.max(before.bytes_per_s)
        });
        for run in runs
            .iter_mut()
            .filter(|r| r.bandwidth_of.as_deref() == Some("gpu"))
        {
            run.bandwidth_bytes_per_s = Some(best);
            run.roofline_fraction = Some(run.achieved_bytes_per_s / best);
        }
    }
    if let Some(before) = bandwidth {
        // Measured again after the runs: on a shared machine a busy neighbour can take a large
        // share off one measurement. Each run is judged against the better of the two, which can
        // only lower its roofline fraction.
        let after = measure_bandwidth();
        for run in &mut runs {
            let Some(huge) = run.bandwidth_huge_pages else {
                continue;
            };
            let best = before[usize::from(huge)]
                .bytes_per_s
                .max(after[usize::from(huge)].bytes_per_s);
            run.bandwidth_bytes_per_s = Some(best);
            run.roofline_fraction = Some(run.achieved_bytes_per_s / best);
        }
    }
    Ok(runs)
}

/// Expert records each disk measurement reads (about a decoded token's worth at budget 0 on
/// gpt-oss-20b).
const DISK_PROBE_RECORDS: usize = 96;

/// Queue depths the disk sweep tries.
const DISK_DEPTHS: [usize; 6] = [1, 2, 4, 8, 16, 32];

/// The queue depth at which `model`'s store reads fastest now, from a sweep (logged per depth).
fn best_disk_depth(model: &Model) -> Result<usize> {
    let store = &model.experts;
    let (_, chunk) = store.read_shape();
    let mut best = (0.0, 1);
    for depth in DISK_DEPTHS {
        let keys = store.random_keys(DISK_PROBE_RECORDS, fresh_seed());
        let rate = store.measure_read_bandwidth(depth, chunk, &keys)?;
        log::info!(
            "disk read bandwidth at depth {depth}: {:.2} GB/s ({} KiB reads)",
            rate / 1e9,
            chunk >> 10
        );
        if rate > best.0 {
            best = (rate, depth);
        }
    }
    Ok(best.1)
}

/// A seed for picking records to read: different in each measurement and each bench, so no
/// measurement rereads records a cache below the OS (a virtual disk's host) may still hold.
fn fresh_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

/// The store's read bandwidth at one moment, bytes per second.
#[derive(Debug, Clone, Copy)]
struct DiskRates {
    /// With the engine's IO threads.
    at_io_threads: f64,
    /// At the sweep's best depth, or with the IO threads where that was faster.
    best: f64,
}

impl DiskRates {
    /// Each rate the better of `self`'s and `other`'s.
    fn better(&self, other: &DiskRates) -> DiskRates {
        DiskRates {
            at_io_threads: self.at_io_threads.max(other.at_io_threads),
            best: self.best.max(other.best),
        }
    }
}

/// The store's read bandwidth now. Before a run, over records picked at random; after it, over
/// records picked as often as the run read them, so that a cache below the OS serving the
/// records a decode rereads helps the measurement as much as the decode.
fn probe_disk(model: &Model, best_depth: usize, after_run: bool) -> Result<DiskRates> {
    let store = &model.experts;
    let (threads, chunk) = store.read_shape();
    let keys = || match after_run {
        true => store.keys_as_read(DISK_PROBE_RECORDS, fresh_seed()),
        false => store.random_keys(DISK_PROBE_RECORDS, fresh_seed()),
    };
    let at_io_threads = store.measure_read_bandwidth(threads, chunk, &keys())?;
    let at_best_depth = store.measure_read_bandwidth(best_depth, chunk, &keys())?;
    log::info!(
        "disk read bandwidth ({}): {:.2} GB/s at {threads} threads, {:.2} GB/s at depth {best_depth}",
        if after_run {
            "records as the run read them"
        } else {
            "records at random"
        },
        at_io_threads / 1e9,
        at_best_depth / 1e9
    );
    Ok(DiskRates {
        at_io_threads,
        best: at_best_depth.max(at_io_threads),
    })
}

/// The prompt decoded again in a session whose every kernel is timed: the decode's per-kernel
/// table (None where the adapter has no timestamps, with a warning).
fn profiled_decode(
    runtime: &Runtime,
    model: &Model,
    ids: &[u32],
    options: &GenerateOptions,
) -> Result<Option<Vec<KernelRow>>> {
    let mut session = match runtime.profiled_session(options.context) {
        Ok(session) => session,
        Err(e) => {
            log::warn!("--profile: {e}");
            return Ok(None);
        }
    };
    let mut profiles = Vec::new();
    let out = generate_observed(
        &mut session,
        &model.config,
        ids,
        options,
        &mut |session, _| {
            profiles.push(session.gpu_profile());
        },
    )?;
    Ok(decode_profile(&profiles, out.decode_tokens))
}

/// The GPU's read bandwidth, measured on a device of its own (dropped before the model loads);
/// None, with the reason in the log, where there is no usable adapter.
fn measure_gpu_bandwidth() -> Option<crate::gpu::bandwidth::GpuBandwidth> {
    let measured = crate::gpu::GpuContext::new(&crate::gpu::GpuOptions::from_env())
        .and_then(|ctx| crate::gpu::bandwidth::measure(&ctx));
    match measured {
        Ok(b) => {
            log::info!(
                "GPU read bandwidth: {:.2} GB/s ({} MiB read {} times per submission, best of {})",
                b.bytes_per_s / 1e9,
                b.buffer_bytes >> 20,
                crate::gpu::bandwidth::PASSES,
                crate::gpu::bandwidth::ROUNDS
            );
            Some(b)
        }
        Err(e) => {
            log::warn!("GPU read bandwidth not measured: {e}");
            None
        }
    }
}

/// Prefill speed of a `LONG_PROMPT_TOKENS` prompt (ids drawn from `seed`) on a fresh session of
/// `runtime` (its model already warm).
fn long_prefill_tokens_per_s(runtime: &Runtime, vocab: usize, seed: u64) -> Result<f64> {
    let ids = prompt(LONG_PROMPT_TOKENS, vocab, seed.wrapping_add(1));
    let context = LONG_PROMPT_TOKENS + 1;
    let mut session = runtime.session(context, false)?;
    if let Some(gpu) = session.gpu_mut() {
        gpu.prepare_plans(ids.len())?;
    }
    let out = generate_observed(
        &mut session,
        &runtime.model().config,
        &ids,
        &GenerateOptions {
            max_new_tokens: 1,
            top_logits: 0,
            stop_at_eos: false,
            context,
        },
        &mut |_, _| {},
    )?;
    Ok(LONG_PROMPT_TOKENS as f64 / (out.prefill_ms.max(1e-6) / 1000.0))
}

/// The runs as CSV, one row each.
pub fn to_csv(runs: &[BenchRun]) -> String {
    let mut out = String::from(
        "backend,vram_budget_bytes,ram_budget_bytes,prefetch,prefill_tokens_per_s,decode_tokens_per_s,vram_hit_rate,ram_hit_rate,disk_bytes_per_token,prefetch_bytes_per_token,upload_bytes_per_token,io_wait_share,peak_rss_bytes\n",
    );
    let rate = |h: Option<f64>| h.map_or(String::new(), |h| format!("{h:.4}"));
    for r in runs {
        out.push_str(&format!(
            "{},{},{},{},{:.4},{:.4},{},{},{:.0},{:.0},{:.0},{:.4},{}\n",
            r.backend,
            r.vram_budget_bytes.map_or(String::new(), |b| b.to_string()),
            r.ram_budget_bytes,
            r.prefetch,
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s,
            rate(r.vram_hit_rate),
            rate(r.ram_hit_rate),
            r.disk_bytes_per_token,
            r.prefetch_bytes_per_token,
            r.upload_bytes_per_token,
            r.io_wait_share,
            r.peak_rss_bytes.map_or(String::new(), |b| b.to_string()),
        ));
    }
    out
}

/// An SVG of decode tokens/s and hit rate against the budget the runs sweep: VRAM when they
/// sweep more than one VRAM budget, else RAM.
pub fn plot_svg(runs: &[BenchRun], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let fail = |e: &dyn std::fmt::Display| Error::io(path, std::io::Error::other(e.to_string()));
    let mut vram_budgets: Vec<u64> = runs.iter().filter_map(|r| r.vram_budget_bytes).collect();
    vram_budgets.sort_unstable();
    vram_budgets.dedup();
    let vram = vram_budgets.len() > 1;
    let tier = if vram { "VRAM" } else { "RAM" };
    let budget_of = |r: &BenchRun| {
        if vram {
            r.vram_budget_bytes.unwrap_or(0)
        } else {
            r.ram_budget_bytes
        }
    };
    let hit_rate_of = |r: &BenchRun| {
        if vram {
            r.vram_hit_rate
        } else {
            r.ram_hit_rate
        }
    };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let max_budget = runs
        .iter()
        .map(|r| gib(budget_of(r)))
        .fold(0.0, f64::max)
        .max(1e-9);
    let max_rate = runs
        .iter()
        .map(|r| r.decode_tokens_per_s)
        .fold(0.0, f64::max)
        .max(1e-3);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!("decode speed and {tier} hit rate vs {tier} budget"),
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .right_y_label_area_size(56)
        .build_cartesian_2d(0.0..max_budget * 1.05, 0.0..max_rate * 1.1)
        .map_err(|e| fail(&e))?
        .set_secondary_coord(0.0..max_budget * 1.05, 0.0..1.05);
    chart
        .configure_mesh()
        .x_desc(format!("{tier} budget (GiB)"))
        .y_desc("decode tokens/s")
        .draw()
        .map_err(|e| fail(&e))?;
    chart
        .configure_secondary_axes()
        .y_desc(format!("{tier} hit rate"))
        .draw()
        .map_err(|e| fail(&e))?;
    let mut runs: Vec<&BenchRun> = runs.iter().collect();
    runs.sort_by_key(|r| budget_of(r));
    let speed: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (gib(budget_of(r)), r.decode_tokens_per_s))
        .collect();
    // Runs without expert requests have no hit rate to draw.
    let hits: Vec<(f64, f64)> = runs
        .iter()
        .filter_map(|r| Some((gib(budget_of(r)), hit_rate_of(r)?)))
        .collect();
    chart
        .draw_series(LineSeries::new(speed, &BLUE))
        .map_err(|e| fail(&e))?
        .label("decode tokens/s")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
    chart
        .draw_secondary_series(LineSeries::new(hits, &RED))
        .map_err(|e| fail(&e))?
        .label(format!("{tier} hit rate"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_decode_continues_the_greedy_tokens_and_judges_them_against_its_reads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-single");
        let model = Model::load(&dir).unwrap();
        let (prompt, tokens) = ([1u32, 2, 3], 4);
        let options = |new_tokens| GenerateOptions {
            max_new_tokens: new_tokens,
            top_logits: 0,
            stop_at_eos: false,
            context: prompt.len() + 2 * tokens,
        };
        let gpu_options = GpuTierOptions {
            context: prompt.len() + 2 * tokens,
            ..Default::default()
        };
        let session = || {
            crate::model::generate::open_session(&model, BackendChoice::Cpu, &gpu_options).unwrap()
        };
        let whole = {
            let mut s = session();
            generate_observed(
                &mut s,
                &model.config,
                &prompt,
                &options(2 * tokens),
                &mut |_, _| {},
            )
            .unwrap()
        };
        let mut s = session();
        let first = generate_observed(
            &mut s,
            &model.config,
            &prompt,
            &options(tokens),
            &mut |_, _| {},
        )
        .unwrap();
        let last = *first.generated_ids.last().unwrap();
        // The tiny model's head is far under any cache: no readings by default.
        assert!(
            interleaved_decode(&model, &mut s, last, tokens, interleaved_min_head_bytes())
                .unwrap()
                .is_none()
        );
        let measured = interleaved_decode(&model, &mut s, last, tokens, 0)
            .unwrap()
            .unwrap();
        // Reading weights between tokens changes no token.
        assert_eq!(measured.ids, whole.generated_ids[tokens..]);
        let (rate, bandwidth) = (measured.tokens_per_s, measured.bandwidth_bytes_per_s);
        assert!(rate > 0.0 && rate.is_finite() && bandwidth > 0.0 && bandwidth.is_finite());
        let positions = prompt.len() + tokens..prompt.len() + 2 * tokens;
        let bytes = decode_bytes_per_token(&model, 0.0, positions.clone());
        let most = (model.config.num_layers * model.config.experts_per_token) as f64;
        let with_experts = decode_bytes_per_token(&model, most, positions);
        let fraction = measured.roofline_fraction * bandwidth / rate;
        assert!(
            (bytes..=with_experts).contains(&fraction),
            "{fraction} bytes per token outside {bytes}..={with_experts}"
        );
    }
}
