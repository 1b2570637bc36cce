//! The `picchio` command line: thin wrappers over the library.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Result, bail};
use clap::{Parser, Subcommand, ValueEnum};
use serde_json::json;

use picchio::Model;
use picchio::model::generate::{
    BackendChoice, GenerateOptions, Session, generate_streamed, open_session, validate_prompt,
};
use picchio::model::gpu_tier::GpuTierOptions;
use picchio::weights::{Checkpoint, tensor_format, tensor_role};

#[derive(Parser)]
#[command(
    name = "picchio",
    version,
    about = "Mixture-of-experts inference (GPT-OSS) on the hardware you have"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Threads of the CPU tier, for any command (default: the physical cores).
    #[arg(long, global = true, value_name = "N")]
    threads: Option<usize>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    /// The CPU tier (the reference implementation).
    Cpu,
    /// The GPU tier (wgpu: Vulkan, Metal, DX12); an error when there is no usable GPU.
    Gpu,
    /// A GPU when there is one and the model fits on it, else the CPU.
    Auto,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ShapeArg {
    /// GPT-OSS-20B's published config and tensors (13.8 GB).
    #[value(name = "gpt-oss-20b")]
    GptOss20b,
    /// GPT-OSS-120B's published config and tensors.
    #[value(name = "gpt-oss-120b")]
    GptOss120b,
    /// A tiny model with the real config keys (fixtures/tiny-single's config).
    Tiny,
    /// The tiny model with o200k_harmony's vocabulary (about 52 MB), for chat and serve.
    #[value(name = "tiny-harmony")]
    TinyHarmony,
    /// Qwen3-30B-A3B-Instruct-2507's config and hub layout (61 GB, bf16 experts).
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// Qwen3-235B-A22B-Instruct-2507's config and hub layout (470 GB).
    #[value(name = "qwen3-235b-a22b")]
    Qwen3_235bA22b,
}

impl From<Backend> for BackendChoice {
    fn from(b: Backend) -> BackendChoice {
        match b {
            Backend::Cpu => BackendChoice::Cpu,
            Backend::Gpu => BackendChoice::Gpu,
            Backend::Auto => BackendChoice::Auto,
        }
    }
}

/// The model and how it is loaded: shared by every command that runs one.
#[derive(clap::Args)]
struct ModelArgs {
    /// Checkpoint directory: config.json + safetensors as Hugging Face ships them, or a
    /// converted copy (picchio convert).
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// RAM for the CPU tier's expert cache: bytes with an optional K/M/G/T suffix (powers of
    /// 1024: 4G, 512M), N% of the model's expert bytes, or auto (available memory less the dense
    /// weights and 2 GiB). 0 streams every expert from disk.
    #[arg(long, default_value = "auto", value_name = "BYTES|N%|auto")]
    ram_budget: picchio::experts::RamBudget,
    /// Read experts past the page cache (O_DIRECT; F_NOCACHE on macOS): a converted expert store
    /// only (picchio convert). Off unless given.
    #[arg(long)]
    direct_io: bool,
    /// While a layer runs, guess the next layer's experts with its router and start reading
    /// them into the RAM cache, or into VRAM on the GPU tier (never changes tokens).
    #[arg(long, value_enum, default_value_t = OnOff::Off, value_name = "on|off")]
    prefetch: OnOff,
    /// What stands in for the next layer's MoE input: a (this layer's MoE input, earliest) or b
    /// (this layer's output through the next layer's norm, later, more accurate). The GPU tier
    /// uses a.
    #[arg(long, default_value = "b", value_name = "a|b")]
    prefetch_proxy: picchio::model::PrefetchProxy,
    /// How many layers ahead the CPU tier's prefetch guesses and reads (1 to 3): farther guesses
    /// keep the disk busy longer but name fewer of the experts used.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=3))]
    prefetch_distance: u8,
    /// How the CPU tier holds the dense weights: checkpoint (as stored, exact) or q8 (8 bits per
    /// weight with an f16 scale per 32 weights: faster decode, not exact; CPU tier only).
    #[arg(long, default_value = "checkpoint", value_name = "checkpoint|q8")]
    dense_format: picchio::cpu::q8::DenseFormat,
    /// How the CPU tier multiplies MXFP4 experts with their inputs: exact (f32) or q8 (inputs
    /// rounded to 8 bits per 32 values: faster, not exact; CPU tier only).
    #[arg(long, default_value = "exact", value_name = "exact|q8")]
    expert_activations: picchio::cpu::q8_activations::ExpertActivations,
    /// Where the weights a token reads live: auto (copied into memory, on huge pages, when every
    /// expert fits the RAM budget and the memory; else mapped), on (mapped from the checkpoint),
    /// off (always copied).
    #[arg(long, default_value = "auto", value_name = "auto|on|off")]
    mmap: picchio::model::MmapMode,
    /// How the KV cache holds keys and values: f32 (exact) or f16 (rounded to nearest even as
    /// they are stored: half the GPU cache's memory and reads; both tiers round alike, the CPU
    /// tier's cache stays f32 in memory).
    #[arg(long, default_value = "f32", value_name = "f32|f16")]
    kv_cache: picchio::formats::KvFormat,
    /// Check each record of a converted expert store against the hash in its index when it is
    /// first read (a damaged file is then an error, not different tokens); off skips the cost.
    #[arg(long, value_enum, default_value_t = OnOff::On, value_name = "on|off")]
    check_records: OnOff,
}

impl ModelArgs {
    /// `load` for chatting on `backend` with the model's chat format: Harmony for GPT-OSS, else
    /// the checkpoint's template and tokenizer, which the HTTP server and the terminal chat read.
    fn load_for_chat(
        &self,
        backend: Backend,
    ) -> Result<(Model, picchio::chat::format::ChatFormat)> {
        let config = self.checked_config()?;
        let format = picchio::chat::format::ChatFormat::for_model(&self.model, &config)?;
        Ok((self.load_for(backend.into())?, format))
    }

    /// `load` for `serve --stdio`, whose client renders and reads the conversation itself (ids
    /// in, ids out): no chat template is needed.
    fn load_for_ids(&self, backend: Backend) -> Result<Model> {
        self.checked_config()?;
        self.load_for(backend.into())
    }

    /// The checkpoint's config, checked for chatting: a GPT-OSS checkpoint's tokenizer.json, when
    /// it has one, must agree with o200k_harmony's special tokens (Harmony's stop ids).
    fn checked_config(&self) -> Result<picchio::config::Config> {
        let config = picchio::config::Config::load(&self.model)?;
        if config.family == picchio::arch::Family::GptOss {
            picchio::chat::tokenizer::Tokenizer::check_checkpoint(&self.model)?
        }
        Ok(config)
    }

    fn load(&self) -> Result<Model> {
        self.load_for(BackendChoice::Auto)
    }

    /// `load` for a session on `backend`: CPU-only runs get experts laid out for the CPU tier's
    /// kernel.
    fn load_for(&self, backend: BackendChoice) -> Result<Model> {
        let options = picchio::model::ModelOptions {
            ram_budget: self.ram_budget,
            hot_experts: true,
            direct_io: self.direct_io,
            prefetch: picchio::model::PrefetchOptions {
                enabled: self.prefetch == OnOff::On,
                proxy: self.prefetch_proxy,
                distance: self.prefetch_distance.into(),
                measure_accuracy: false,
            },
            dense_format: self.dense_format,
            expert_activations: self.expert_activations,
            mmap: self.mmap,
            kv_format: self.kv_cache,
            interleave_experts: backend == BackendChoice::Cpu,
            check_records: self.check_records == OnOff::On,
            ..Default::default()
        };
        // Load errors name the file and tensor already.
        Ok(Model::load_with(&self.model, &options)?)
    }
}

/// The model, the prompt and how far to go: shared by `generate` and `ab`.
#[derive(clap::Args)]
struct PromptArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt token ids, comma-separated (e.g. 1,2,3); this or --prompt is required.
    #[arg(
        long,
        value_name = "IDS",
        value_delimiter = ',',
        num_args = 1..,
        required_unless_present = "prompt",
        conflicts_with = "prompt"
    )]
    ids: Vec<u32>,
    /// The prompt as text instead of ids, encoded with o200k_harmony for GPT-OSS, with the
    /// checkpoint's tokenizer.json for other families (special-token names such as <|start|> or
    /// <|im_start|> become those tokens).
    #[arg(long, value_name = "TEXT")]
    prompt: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32, value_name = "N")]
    max_new_tokens: usize,
    /// Most positions (prompt + generated) the KV cache holds; default (and most): the model's
    /// max_position_embeddings.
    #[arg(long, value_name = "N")]
    context: Option<usize>,
    #[command(flatten)]
    gpu: GpuArgs,
}

/// How the GPU tier holds the model: shared by every command that runs a session.
#[derive(clap::Args)]
struct GpuArgs {
    /// GPU memory for the GPU tier's expert cache: bytes (K/M/G/T suffix), N% of the model's
    /// expert bytes, or auto (every expert if the adapter takes them, else as many as it does).
    /// 0 keeps no expert in VRAM: the GPU runs attention and the CPU tier every expert.
    #[arg(long, default_value = "auto", value_name = "BYTES|N%|auto")]
    vram_budget: picchio::experts::VramBudget,
    /// What the GPU tier does with an expert its VRAM cache lacks: auto (upload in prompt
    /// blocks, compute on the CPU in decode), upload (always, evicting the least recently used),
    /// cpu (compute on the CPU unless a slot is free).
    #[arg(long, default_value = "auto", value_name = "auto|upload|cpu")]
    miss_policy: picchio::model::gpu_tier::MissPolicy,
    /// Decoder layers the GPU runs (the first N; the CPU tier runs the rest and the head).
    /// Default: as many as the dense weights fit in GPU memory.
    #[arg(long, value_name = "N")]
    gpu_layers: Option<usize>,
}

impl GpuArgs {
    /// The GPU tier's options for a `context`-position run reporting `top_logits` logits.
    fn options(&self, context: usize, top_logits: usize) -> GpuTierOptions {
        GpuTierOptions {
            context,
            top_logits,
            vram_budget: self.vram_budget,
            miss_policy: self.miss_policy,
            gpu_layers: self.gpu_layers,
            ..Default::default()
        }
    }

    /// Where chat sessions run.
    fn tier(&self, backend: Backend) -> picchio::model::generate::SessionTier {
        picchio::model::generate::SessionTier {
            backend: backend.into(),
            // The context is each session's own (`ChatSession::open`).
            gpu: self.options(0, 2),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ReasoningArg {
    Low,
    Medium,
    High,
}

/// How tokens are chosen (greedy by default).
#[derive(clap::Args)]
struct SamplingArgs {
    /// Sampling temperature, 0 or more: 0 is greedy (argmax), else logits are divided by it.
    #[arg(long, default_value_t = 0.0, value_name = "T")]
    temperature: f32,
    /// Keep the smallest set of most likely tokens whose probability reaches P, in (0, 1];
    /// 1 keeps all.
    #[arg(long, default_value_t = 1.0, value_name = "P")]
    top_p: f32,
    /// Keep the K most likely tokens; 0 keeps every token.
    #[arg(long, default_value_t = 0, value_name = "K")]
    top_k: usize,
    /// Drop tokens less likely than P times the most likely one, in [0, 1]; 0 drops none.
    #[arg(long, default_value_t = 0.0, value_name = "P")]
    min_p: f32,
    /// Divide the positive logits (multiply the negative ones) of tokens already in the
    /// conversation by R, more than 0; 1 is off.
    #[arg(long, default_value_t = 1.0, value_name = "R")]
    repetition_penalty: f32,
    /// Seed of the random choice (each turn adds its number; the same seed and inputs choose the
    /// same tokens).
    #[arg(long, default_value_t = 0, value_name = "S")]
    seed: u64,
}

impl SamplingArgs {
    fn options(&self) -> Result<picchio::model::sampler::SamplingOptions> {
        let options = picchio::model::sampler::SamplingOptions {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
        };
        options.check().map_err(anyhow::Error::msg)?;
        Ok(options)
    }
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

impl PromptArgs {
    /// The prompt's ids: `--ids`, or `--prompt` encoded with the model's tokenizer
    /// (`ModelText`).
    fn prompt_ids(&self, config: &picchio::config::Config) -> Result<Vec<u32>> {
        match &self.prompt {
            Some(text) => ModelText::of(&self.model.model, config)?.encode(text),
            None => Ok(self.ids.clone()),
        }
    }

    /// The GPU tier's options for a `context`-position run reporting `top_logits` logits.
    fn gpu_options(&self, context: usize, top_logits: usize) -> GpuTierOptions {
        self.gpu.options(context, top_logits)
    }

    fn load(&self) -> Result<Model> {
        self.model.load()
    }

    fn load_for(&self, backend: BackendChoice) -> Result<Model> {
        self.model.load_for(backend)
    }
}

#[derive(Subcommand)]
enum Command {
    /// Generate tokens greedily from a prompt (token ids or text).
    Generate {
        #[command(flatten)]
        prompt: PromptArgs,
        /// Where the model runs.
        #[arg(long, value_enum, default_value_t = Backend::Auto)]
        backend: Backend,
        /// Add run statistics to the JSON object (with --json): GPU submissions and readbacks per
        /// token, expert cache counts, time per phase, per-layer placement, prefetch.
        #[arg(long)]
        stats: bool,
        /// Print one JSON object instead of the plain id list.
        #[arg(long)]
        json: bool,
        /// Report the K largest logits of every step (with --json; at most 64 on the GPU tier).
        #[arg(long, default_value_t = 0, value_name = "K")]
        top_logits: usize,
        /// Keep generating after an end-of-sequence token.
        #[arg(long)]
        ignore_eos: bool,
        /// Time every GPU kernel with timestamp queries: a per-kernel table of the decode phase
        /// on stderr (and "profile" in the JSON). Each kernel then runs in a pass of its own, so
        /// the run is slower; an error where the adapter has no timestamps.
        #[arg(long)]
        profile: bool,
    },
    /// Run the CPU and GPU tiers on the same input (greedy, end-of-sequence ignored) and compare
    /// tokens, logits and routing; exits non-zero on any disagreement.
    Ab {
        #[command(flatten)]
        prompt: PromptArgs,
        /// The tier compared with the CPU tier's reference run: gpu, auto (the GPU when there is
        /// one) or cpu (the CPU tier as chat sessions run it, its cache keeping every position).
        #[arg(long, value_enum, default_value_t = Backend::Auto)]
        backend: Backend,
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Write a random checkpoint in the real HF layout (the published config.json, MXFP4 experts,
    /// bf16 dense weights, sharded like the published files), for benchmarks.
    Synth {
        /// Which model's config.json and tensor shapes to write.
        #[arg(long, value_enum)]
        shape: ShapeArg,
        /// Directory to write (created if needed).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Seed of the random weights (the bytes depend only on it).
        #[arg(long, default_value_t = 0, value_name = "S")]
        seed: u64,
        /// Close a shard before it passes this many bytes (a plain number; default: where the
        /// published files cut, 4.8 GB for GPT-OSS, 4 GB for Qwen3-MoE).
        #[arg(long, value_name = "BYTES")]
        shard_bytes: Option<u64>,
    },
    /// Chat in the terminal: type a message, read the answer as it is generated.
    Chat {
        #[command(flatten)]
        model: ModelArgs,
        /// Where the session runs: auto (a hardware GPU when there is one, else the CPU tier;
        /// the choice is logged at start-up), gpu or cpu.
        #[arg(long, value_enum, default_value_t = Backend::Auto)]
        backend: Backend,
        #[command(flatten)]
        gpu: GpuArgs,
        /// Most positions the conversation holds (default: 4096, at most the model's
        /// max_position_embeddings).
        #[arg(long, value_name = "N")]
        context: Option<usize>,
        /// Most tokens per answer.
        #[arg(long, default_value_t = 1024, value_name = "N")]
        max_new_tokens: usize,
        /// Instructions for the model (Harmony's developer message; a template model's system
        /// message).
        #[arg(long, value_name = "TEXT")]
        system: Option<String>,
        /// How much the model reasons before answering (Harmony's "Reasoning:" line; GPT-OSS
        /// only).
        #[arg(long, default_value = "medium", value_name = "low|medium|high")]
        reasoning_effort: ReasoningArg,
        /// Show the model's reasoning (dimmed on a terminal) before its answer; hidden otherwise.
        #[arg(long)]
        show_reasoning: bool,
        #[command(flatten)]
        sampling: SamplingArgs,
    },
    /// Serve the model over OpenAI-compatible HTTP (or, with --stdio, a line protocol on
    /// stdin/stdout).
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        /// Where the session runs: auto (a hardware GPU when there is one, else the CPU tier;
        /// the choice is logged at start-up), gpu or cpu.
        #[arg(long, value_enum, default_value_t = Backend::Auto)]
        backend: Backend,
        #[command(flatten)]
        gpu: GpuArgs,
        /// Speak the line protocol on stdin/stdout instead of HTTP (see docs/cli.md).
        #[arg(long)]
        stdio: bool,
        /// Address to listen on (HTTP).
        #[arg(long, default_value = "127.0.0.1", value_name = "ADDRESS")]
        host: String,
        /// TCP port to listen on (HTTP; 0: any free port; the address is printed on stderr).
        #[arg(long, default_value_t = 8080, value_name = "PORT")]
        port: u16,
        /// The model's name in the API (default: the model directory's name).
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
        /// Most positions a session holds (default: 4096, at most the model's
        /// max_position_embeddings).
        #[arg(long, value_name = "N")]
        context: Option<usize>,
        /// Seed of the sampling with --stdio (each turn adds its number); HTTP requests carry
        /// their own "seed" (default 0).
        #[arg(long, default_value_t = 0, value_name = "S")]
        seed: u64,
        /// Most tokens one HTTP request generates: a larger max_tokens is cut to it.
        #[arg(long, default_value_t = 8192, value_name = "N")]
        max_tokens_limit: usize,
        /// Most HTTP requests waiting for the model; more get 503 with Retry-After.
        #[arg(long, default_value_t = 64, value_name = "N")]
        queue_limit: usize,
        /// Require "Authorization: Bearer KEY" on every route but /health (also from the
        /// PICCHIO_API_KEY environment variable, which keeps it out of the process list).
        #[arg(long, value_name = "KEY")]
        api_key: Option<String>,
        /// Most HTTP connections open at once; one more is answered 503 and closed.
        #[arg(long, default_value_t = 128, value_name = "N")]
        max_connections: usize,
        /// Largest HTTP request body in bytes; a larger one gets 413.
        #[arg(long, default_value_t = 8 << 20, value_name = "BYTES")]
        max_body_bytes: usize,
        /// Seconds a connection may take to send a request's head, idle time between
        /// requests included; then it is closed.
        #[arg(long, default_value_t = 15, value_name = "SECONDS")]
        header_timeout: u64,
        /// Seconds a request's body may take to arrive; then 408.
        #[arg(long, default_value_t = 30, value_name = "SECONDS")]
        body_timeout: u64,
        /// A Host name to serve besides localhost and loopback addresses (repeatable; "*"
        /// serves any). Bound to loopback, other names get 403 (DNS-rebinding protection);
        /// bound elsewhere, a list limits the names served.
        #[arg(long = "allowed-host", value_name = "NAME")]
        allowed_hosts: Vec<String>,
    },
    /// Encode text into o200k_harmony token ids (or, with --decode, ids into text).
    Tokenize {
        /// The text to encode; special-token names become their tokens unless --no-special.
        #[arg(
            long,
            value_name = "TEXT",
            required_unless_present = "decode",
            conflicts_with = "decode"
        )]
        text: Option<String>,
        /// Encode special-token names as plain text.
        #[arg(long)]
        no_special: bool,
        /// Token ids to decode into text, comma-separated (e.g. 200006,1428,200008).
        #[arg(long, value_delimiter = ',', num_args = 1.., value_name = "IDS")]
        decode: Vec<u32>,
    },
    /// Top-1 agreement of a faster numeric mode (--dense-format q8, --expert-activations q8) with
    /// the exact path, teacher-forced over the exact path's greedy tokens (CPU tier).
    Agree {
        #[command(flatten)]
        prompt: PromptArgs,
        /// Print one JSON object instead of a summary.
        #[arg(long)]
        json: bool,
    },
    /// Measure prefill and decode speed, hit rates and bytes moved for each VRAM budget, RAM
    /// budget and prefetch setting.
    Bench {
        /// Checkpoint directory (as for generate).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Where every run runs.
        #[arg(long, value_enum, default_value_t = Backend::Auto)]
        backend: Backend,
        /// RAM expert cache budgets to sweep, comma-separated: bytes (K/M/G/T suffix), N% of the
        /// expert bytes, or auto.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "auto",
            value_name = "LIST"
        )]
        ram_budgets: Vec<picchio::experts::RamBudget>,
        /// GPU expert cache budgets to sweep, comma-separated: bytes (K/M/G/T suffix), N% of the
        /// expert bytes, or auto; each runs with every RAM budget. CPU runs ignore them.
        #[arg(
            long,
            value_delimiter = ',',
            default_value = "auto",
            value_name = "LIST"
        )]
        vram_budgets: Vec<picchio::experts::VramBudget>,
        /// The GPU tier's miss policy for every run.
        #[arg(long, default_value = "auto", value_name = "auto|upload|cpu")]
        miss_policy: picchio::model::gpu_tier::MissPolicy,
        /// Read a converted expert store with O_DIRECT (no page cache). Off unless given.
        #[arg(long)]
        direct_io: bool,
        /// Prefetch settings to compare, comma-separated (on, off); each runs with every budget.
        #[arg(
            long,
            value_enum,
            value_delimiter = ',',
            default_value = "off",
            value_name = "LIST"
        )]
        prefetch: Vec<OnOff>,
        /// The prefetch proxy for every run.
        #[arg(long, default_value = "b", value_name = "a|b")]
        prefetch_proxy: picchio::model::PrefetchProxy,
        /// Layers ahead the CPU tier prefetches (1 to 3) in every run with prefetch on.
        #[arg(long, default_value_t = 1, value_name = "N", value_parser = clap::value_parser!(u8).range(1..=3))]
        prefetch_distance: u8,
        /// Tokens in each run's random prompt (the timed prefill).
        #[arg(long, default_value_t = 64, value_name = "N")]
        prompt_tokens: usize,
        /// Tokens each run decodes after the prompt (the timed decode).
        #[arg(long, default_value_t = 32, value_name = "N")]
        gen_tokens: usize,
        /// Seed of the random prompt.
        #[arg(long, default_value_t = 0, value_name = "S")]
        seed: u64,
        /// Also measure the read bandwidth and each run's decode against it (roofline fraction),
        /// time a 512-token prefill, and (CPU tier) decode in turns with reads of the LM head.
        #[arg(long)]
        roofline: bool,
        /// GPU runs: after each timed run, decode the same prompt again with every kernel timed
        /// (timestamp queries) and add its per-kernel table ("profile") to the run's results.
        /// The timed figures stay those of the unprofiled run.
        #[arg(long)]
        profile: bool,
        /// How the CPU tier holds the dense weights in every run: checkpoint (exact) or q8.
        #[arg(long, default_value = "checkpoint", value_name = "checkpoint|q8")]
        dense_format: picchio::cpu::q8::DenseFormat,
        /// How the CPU tier multiplies MXFP4 experts with their inputs in every run: exact or q8.
        #[arg(long, default_value = "exact", value_name = "exact|q8")]
        expert_activations: picchio::cpu::q8_activations::ExpertActivations,
        /// Where the weights live in every run: auto, on (mapped) or off (copied into memory).
        #[arg(long, default_value = "auto", value_name = "auto|on|off")]
        mmap: picchio::model::MmapMode,
        /// How the KV cache holds keys and values in every run: f32 (exact) or f16.
        #[arg(long, default_value = "f32", value_name = "f32|f16")]
        kv_cache: picchio::formats::KvFormat,
        /// Print one JSON object {"runs": [...]} instead of a table.
        #[arg(long)]
        json: bool,
        /// Also write the runs as CSV to this file.
        #[arg(long, value_name = "FILE")]
        csv: Option<PathBuf>,
        /// Also write an SVG plot of decode tokens/s and hit rate against the budget to this file.
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
    },
    /// Write a converted copy of a checkpoint: the dense tensors as model.safetensors and every
    /// expert as one 4 KiB-aligned record of experts.bin, indexed with hashes in experts.json.
    Convert {
        /// Checkpoint directory to convert.
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Directory to write (new or empty, unless --force).
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// Replace --out's contents once the conversion is complete.
        #[arg(long)]
        force: bool,
        /// mxfp4: the checkpoint's MXFP4 bytes, bit for bit, or float experts (Qwen3-MoE's bf16)
        /// quantized to MXFP4 (lossy); int4: group-scaled INT4 (32 inputs per f16 scale),
        /// quantized from the exact weights (lossy).
        #[arg(long, default_value = "mxfp4", value_name = "mxfp4|int4")]
        experts: picchio::flat_store::FlatFormat,
    },
    /// Check a converted expert store's records against the hashes of its index.
    Verify {
        /// Converted directory to check (picchio convert's --out).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
    },
    /// List the GPU adapters wgpu finds (best first), with backend, type, driver, limits and
    /// features.
    Devices {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the checkpoint's tensors (name, dtype, shape, bytes, format) and byte totals.
    Inspect {
        /// Checkpoint directory (or a converted copy).
        #[arg(long, value_name = "DIR")]
        model: PathBuf,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"))
        .target(env_logger::Target::Stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    let threads = picchio::cpu::machine::set_threads(cli.threads)?;
    log::debug!(
        "CPU tier: {threads} threads, {} kernels",
        picchio::cpu::simd::kernels().name()
    );
    match cli.command {
        Command::Generate {
            prompt,
            backend,
            stats,
            json,
            top_logits,
            ignore_eos,
            profile,
        } => {
            let mut loaded = prompt.load_for(backend.into())?;
            // `--stats` reports every proxy's accuracy: they guess even without prefetch.
            loaded.prefetch.measure_accuracy = stats;
            let prompt_ids = prompt.prompt_ids(&loaded.config)?;
            let (model, ids, max_new_tokens) =
                (&prompt.model.model, &prompt_ids, prompt.max_new_tokens);
            let context = resolve_context(&loaded, prompt.context)?;
            log::info!(
                "{}: {} layers, {} experts (top {})",
                model.display(),
                loaded.config.num_layers,
                loaded.config.num_experts,
                loaded.config.experts_per_token
            );
            validate_prompt(&loaded.config, ids, context)?;
            let gpu_options = GpuTierOptions {
                profile,
                ..prompt.gpu_options(context, top_logits)
            };
            let mut session = open_session(&loaded, backend.into(), &gpu_options)?;
            if profile && session.gpu().is_none() {
                log::warn!(
                    "--profile: the run is on the CPU tier, which has no GPU kernels to time"
                );
            }
            let adapter = session.gpu().map(|g| g.ctx().adapter.clone());
            let options = GenerateOptions {
                max_new_tokens,
                top_logits,
                stop_at_eos: !ignore_eos,
                context,
            };
            // GPU counters and profiles at the end of the prefill and of the run: the decode
            // phase's share.
            let mut marks = Vec::new();
            let mut profiles = Vec::new();
            // Plain ids go out as they come, so an interrupt loses none of them.
            interrupts::catch();
            let mut streamed = 0usize;
            let out = generate_streamed(
                &mut session,
                &loaded.config,
                ids,
                &options,
                &mut |s, _| {
                    marks.push(s.gpu_counters());
                    profiles.push(s.gpu_profile());
                },
                &mut |step| {
                    if !json {
                        use std::io::Write;
                        let mut stdout = std::io::stdout().lock();
                        let gap = if streamed > 0 { " " } else { "" };
                        let _ = write!(stdout, "{gap}{}", step.id).and_then(|()| stdout.flush());
                        streamed += 1;
                    }
                    !interrupts::happened()
                },
            )?;
            let interrupted = out.stop == picchio::model::generate::StopReason::Interrupted;
            let ran_on = session.backend();
            loaded.experts.save_usage();
            let kernel_times = picchio::gpu::profile::decode_profile(&profiles, out.decode_tokens);
            if let Some(rate) = out.decode_tokens_per_s() {
                log::info!(
                    "{ran_on}: prefill {:.1} ms, decode {rate:.2} tokens/s",
                    out.prefill_ms
                );
            }
            if json {
                let steps: Vec<_> = out
                    .steps
                    .iter()
                    .map(|s| {
                        let top: Vec<_> =
                            s.top.iter().map(|(id, logit)| json!([id, logit])).collect();
                        json!({"id": s.id, "top": top, "margin": s.margin})
                    })
                    .collect();
                let mut object = json!({
                    "prompt_ids": out.prompt_ids,
                    "generated_ids": out.generated_ids,
                    "steps": steps,
                    "backend": ran_on,
                    "adapter": adapter.as_ref().map(|a| a.name.clone()),
                    "prefill_ms": out.prefill_ms,
                    "decode_tokens_per_s": out.decode_tokens_per_s(),
                    "stop_reason": format!("{:?}", out.stop).to_lowercase(),
                    "interrupted": interrupted,
                    // The generated text, where the model's tokenizer is known.
                    "text": ModelText::of(model, &loaded.config)
                        .ok()
                        .and_then(|t| t.decode(&out.generated_ids)),
                });
                if let Some(rows) = &kernel_times {
                    object["profile"] = serde_json::to_value(rows)?;
                }
                if stats {
                    let load = session.gpu().map(|g| g.load_report());
                    let gpu = match (adapter, marks.as_slice()) {
                        (Some(a), [Some(prefill), Some(end)]) if ran_on == "gpu" => {
                            let per_token = |n: u64| {
                                (out.decode_tokens > 0).then(|| n as f64 / out.decode_tokens as f64)
                            };
                            let decode = end.since(prefill);
                            json!({
                                "adapter": a.name,
                                "backend": a.backend,
                                "device_type": a.device_type,
                                "submits_per_token": per_token(decode.submits),
                                "dispatches_per_token": per_token(decode.dispatches),
                                "copies_per_token": per_token(decode.copies),
                                "readbacks_per_token": per_token(decode.readbacks),
                                "prefill_submits": prefill.submits,
                                "prefill_dispatches": prefill.dispatches,
                                "prefill_readbacks": prefill.readbacks,
                                "cpu_expert_ms_per_token": per_token(decode.cpu_expert_us).map(|us| us / 1e3),
                                "readback_wait_ms_per_token": per_token(decode.readback_wait_us).map(|us| us / 1e3),
                                "prerecorded_share": per_token(decode.prerecorded),
                                "load": load,
                            })
                        }
                        _ => serde_json::Value::Null,
                    };
                    let experts = loaded.experts.stats();
                    let (attention_ms, experts_ms, head_ms) = loaded.timings.millis();
                    let vram_cached = session.gpu().map(|g| g.vram_experts());
                    let resident_layers = session.gpu().map(|g| g.weights().resident_layers());
                    // The GPU tier's per-layer choices, or one tier for every layer.
                    let placement = match session.placement() {
                        Some(layers) => serde_json::to_value(layers)?,
                        None => json!((0..loaded.config.num_layers)
                            .map(|layer| json!({"layer": layer, "attention": ran_on, "experts": ran_on, "residual": ran_on}))
                            .collect::<Vec<_>>()),
                    };
                    object["stats"] = json!({
                        "gpu": gpu,
                        "experts": {
                            "requests": experts.requests,
                            "vram_hits": experts.vram_hits,
                            "ram_hits": experts.ram_hits,
                            "disk_reads": experts.disk_reads,
                            "disk_bytes": experts.disk_bytes,
                            "upload_bytes": experts.upload_bytes,
                            "evictions": experts.evictions,
                            "vram_evictions": experts.vram_evictions,
                            "ram_budget_bytes": loaded.experts.budget(),
                            "vram_cached_experts": vram_cached,
                            "vram_resident_layers": resident_layers,
                            "expert_record_bytes": loaded.experts.expert_bytes(),
                        },
                        "reads": {
                            "io_threads": loaded.experts.read_shape().0,
                            "chunk_bytes": loaded.experts.read_shape().1,
                            "chunks": experts.reads.chunks,
                            "bytes": experts.reads.bytes,
                            "queue_depth": experts.reads.mean_depth(),
                            "bytes_in_flight": experts.reads.mean_bytes_in_flight(),
                            "layer_wait_ms": loaded.experts.layer_wait_ms(),
                        },
                        "time_ms": {
                            "attention": attention_ms,
                            "experts": experts_ms,
                            "io_wait": experts.io_wait_ms,
                            "upload": experts.upload_ms,
                            "head": head_ms,
                        },
                        "placement": placement,
                        "prefetch": {
                            "enabled": loaded.prefetch.enabled,
                            "proxy": loaded.prefetch_proxy_on(ran_on).name(),
                            "issued": experts.prefetch.issued,
                            "used": experts.prefetch.used,
                            "bytes": experts.prefetch.bytes,
                            "wasted_bytes": experts.prefetch.wasted_bytes,
                            "staged_hits": experts.prefetch.staged_hits,
                            "skipped": experts.prefetch.skipped,
                            "cancelled": experts.prefetch.cancelled,
                            "staging_experts": loaded.experts.staging_experts(),
                            "accuracy": loaded.prediction_accuracy(loaded.prefetch_proxy_on(ran_on)),
                            "distance": loaded.prefetch.distance,
                            "accuracy_by_distance": (1..=picchio::model::MAX_PREFETCH_DISTANCE)
                                .map(|d| loaded.prediction_accuracy_at(loaded.prefetch_proxy_on(ran_on), d))
                                .collect::<Vec<_>>(),
                            "accuracy_by_proxy": {
                                "a": loaded.prediction_accuracy(picchio::model::PrefetchProxy::A),
                                "b": loaded.prediction_accuracy(picchio::model::PrefetchProxy::B),
                            },
                        },
                    });
                }
                println!("{object}");
            } else {
                println!();
            }
            if let Some(rows) = &kernel_times {
                picchio::gpu::profile::print_profile(rows);
            }
            if interrupted {
                log::warn!("interrupted after {} tokens", out.generated_ids.len());
                std::process::exit(130);
            }
            Ok(())
        }
        Command::Ab {
            prompt,
            backend,
            json,
        } => ab(&prompt, backend, json),
        Command::Inspect { model, json } => inspect(&model, json),
        Command::Devices { json } => devices(json),
        Command::Bench {
            model,
            backend,
            ram_budgets,
            vram_budgets,
            miss_policy,
            direct_io,
            prefetch,
            prefetch_proxy,
            prefetch_distance,
            prompt_tokens,
            gen_tokens,
            seed,
            roofline,
            profile,
            dense_format,
            expert_activations,
            mmap,
            kv_cache,
            json,
            csv,
            plot,
        } => {
            let options = picchio::bench::BenchOptions {
                model,
                backend: backend.into(),
                ram_budgets,
                vram_budgets,
                miss_policy,
                direct_io,
                prefetch: prefetch.iter().map(|p| *p == OnOff::On).collect(),
                prefetch_proxy,
                prefetch_distance: prefetch_distance.into(),
                prompt_tokens,
                gen_tokens,
                seed,
                roofline,
                profile,
                dense_format,
                expert_activations,
                mmap,
                kv_format: kv_cache,
            };
            bench(&options, json, csv, plot)
        }
        Command::Chat {
            model,
            backend,
            gpu,
            context,
            max_new_tokens,
            system,
            reasoning_effort,
            show_reasoning,
            sampling,
        } => {
            use std::io::IsTerminal;
            let sampling = sampling.options()?;
            let (loaded, format) = model.load_for_chat(backend)?;
            let context = session_context(&loaded, context)?;
            let options = picchio::chat::terminal::ChatOptions {
                context,
                max_new_tokens,
                instructions: system,
                reasoning_effort: match reasoning_effort {
                    ReasoningArg::Low => picchio::chat::harmony::ReasoningEffort::Low,
                    ReasoningArg::Medium => picchio::chat::harmony::ReasoningEffort::Medium,
                    ReasoningArg::High => picchio::chat::harmony::ReasoningEffort::High,
                },
                show_reasoning,
                dim: std::io::stdout().is_terminal(),
                sampling,
                tier: gpu.tier(backend),
            };
            if std::io::stdin().is_terminal() {
                eprintln!("picchio chat: type a message; /reset starts over, /exit leaves");
            }
            // The output streams are locked per write, not for the session: log lines from the
            // CPU tier's workers (kernel choices, expert reads) go to stderr meanwhile, and a
            // session-long lock left them waiting for ever.
            picchio::chat::terminal::run(
                &loaded,
                &format,
                &options,
                std::io::stdin().lock(),
                std::io::stdout(),
                std::io::stderr(),
            )?;
            Ok(())
        }
        Command::Serve {
            model,
            backend,
            gpu,
            stdio,
            host,
            port,
            name,
            context,
            seed,
            max_tokens_limit,
            queue_limit,
            api_key,
            max_connections,
            max_body_bytes,
            header_timeout,
            body_timeout,
            allowed_hosts,
        } => {
            let at_least_one = [
                max_tokens_limit,
                queue_limit,
                max_connections,
                max_body_bytes,
            ];
            if at_least_one.contains(&0) || header_timeout == 0 || body_timeout == 0 {
                bail!(
                    "--max-tokens-limit, --queue-limit, --max-connections, --max-body-bytes, \
                     --header-timeout and --body-timeout must be at least 1"
                );
            }
            // Larger values are no limit at all, and overflow the timers and queues below.
            const MOST_WAITING: usize = 1 << 20;
            const MOST_SECONDS: u64 = 24 * 3600;
            if queue_limit > MOST_WAITING || max_connections > MOST_WAITING {
                bail!("--queue-limit and --max-connections must be at most {MOST_WAITING}");
            }
            if header_timeout > MOST_SECONDS || body_timeout > MOST_SECONDS {
                bail!("--header-timeout and --body-timeout must be at most {MOST_SECONDS} (a day)");
            }
            let api_key = api_key
                .or_else(|| std::env::var("PICCHIO_API_KEY").ok())
                .filter(|key| !key.is_empty());
            let limits = picchio::serve::ServeLimits {
                max_tokens: max_tokens_limit,
                queue: queue_limit,
                api_key,
                connections: max_connections,
                body_bytes: max_body_bytes,
                head_timeout: std::time::Duration::from_secs(header_timeout),
                body_timeout: std::time::Duration::from_secs(body_timeout),
                allowed_hosts,
            };
            let tier = gpu.tier(backend);
            if stdio {
                let loaded = model.load_for_ids(backend)?;
                let context = session_context(&loaded, context)?;
                picchio::chat::stdio::serve(
                    &loaded,
                    context,
                    &tier,
                    seed,
                    std::io::stdin().lock(),
                    std::io::stdout().lock(),
                )?;
                return Ok(());
            }
            let (loaded, format) = model.load_for_chat(backend)?;
            let context = session_context(&loaded, context)?;
            let name = name.unwrap_or_else(|| {
                model
                    .model
                    .canonicalize()
                    .ok()
                    .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                    .unwrap_or_else(|| "picchio".into())
            });
            let ready = |address| eprintln!("picchio: listening on http://{address}");
            picchio::serve::serve(
                loaded, format, name, context, tier, &host, port, limits, ready,
            )?;
            Ok(())
        }
        Command::Tokenize {
            text,
            no_special,
            decode,
        } => {
            let tokenizer = picchio::chat::tokenizer::Tokenizer::o200k_harmony();
            match text {
                Some(text) => {
                    let ids = if no_special {
                        tokenizer.encode(&text)
                    } else {
                        tokenizer.encode_with_special_tokens(&text)
                    };
                    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
                    println!("{}", ids.join(" "));
                }
                None => print!("{}", tokenizer.decode_lossy(&decode)?),
            }
            Ok(())
        }
        Command::Agree { prompt, json } => {
            if prompt.model.dense_format == picchio::cpu::q8::DenseFormat::Checkpoint
                && prompt.model.expert_activations
                    == picchio::cpu::q8_activations::ExpertActivations::Exact
            {
                bail!(
                    "agree compares a faster mode with the exact path: pass --dense-format q8, \
                     --expert-activations q8 or both"
                );
            }
            let other = prompt.load()?;
            let exact = Model::load_with(
                &prompt.model.model,
                &picchio::model::ModelOptions {
                    ram_budget: prompt.model.ram_budget,
                    mmap: prompt.model.mmap,
                    ..Default::default()
                },
            )?;
            let report = picchio::model::agreement::top1_agreement(
                &exact,
                &other,
                &prompt.prompt_ids(&exact.config)?,
                prompt.max_new_tokens,
            )?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                println!(
                    "top-1 agreement with the exact path: {} of {} steps ({:.1}%)",
                    report.agreeing,
                    report.steps,
                    report.rate * 100.0
                );
                match report.first_disagreement {
                    Some(step) => println!("first disagreement: step {step}"),
                    None => println!("first disagreement: none"),
                }
            }
            Ok(())
        }
        Command::Synth {
            shape,
            out,
            seed,
            shard_bytes,
        } => synth(shape, out, seed, shard_bytes),
        Command::Convert {
            model,
            out,
            experts,
            force,
        } => convert(&model, &out, experts, force),
        Command::Verify { model } => verify(&model),
    }
}

/// A model's tokenizer for text in and out: o200k_harmony for GPT-OSS (whose checkpoints all
/// use it), the checkpoint's `tokenizer.json` for the other families.
enum ModelText {
    Harmony { vocab_size: usize },
    Checkpoint(Box<picchio::chat::hf_tokenizer::HfTokenizer>),
}

impl ModelText {
    fn of(dir: &std::path::Path, config: &picchio::config::Config) -> Result<ModelText> {
        if config.family == picchio::arch::Family::GptOss {
            return Ok(ModelText::Harmony {
                vocab_size: config.vocab_size,
            });
        }
        let tokenizer = picchio::chat::hf_tokenizer::HfTokenizer::load(dir)?;
        let tokenizer = tokenizer.ok_or_else(|| {
            anyhow::anyhow!(
                "{} has no tokenizer.json to encode text with: pass token ids with --ids",
                dir.display()
            )
        })?;
        Ok(ModelText::Checkpoint(Box::new(tokenizer)))
    }

    /// Ids of `text`, special-token names included.
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(match self {
            ModelText::Harmony { .. } => picchio::chat::tokenizer::Tokenizer::o200k_harmony()
                .encode_with_special_tokens(text),
            ModelText::Checkpoint(tokenizer) => tokenizer.encode(text)?,
        })
    }

    /// `ids` as text (None where they do not decode, or a GPT-OSS-shaped test model's
    /// vocabulary is not o200k_harmony's).
    fn decode(&self, ids: &[u32]) -> Option<String> {
        match self {
            ModelText::Harmony { vocab_size } => (*vocab_size
                >= picchio::chat::tokenizer::HARMONY_VOCAB_SIZE)
                .then(|| {
                    picchio::chat::tokenizer::Tokenizer::o200k_harmony()
                        .decode_lossy(ids)
                        .ok()
                })
                .flatten(),
            ModelText::Checkpoint(tokenizer) => tokenizer.decode(ids).ok(),
        }
    }
}

/// Positions a chat session holds: `--context`, else 4096 (at most what the model supports).
fn session_context(model: &Model, context: Option<usize>) -> Result<usize> {
    resolve_context(
        model,
        Some(context.unwrap_or(4096.min(model.config.max_position_embeddings))),
    )
}

/// `--context`, else the model's max_position_embeddings; a larger value is clamped to it (with
/// a warning): positions past it are outside what the model was trained for.
fn resolve_context(model: &Model, context: Option<usize>) -> Result<usize> {
    let most = model.config.max_position_embeddings;
    let context = context.unwrap_or(most);
    if context == 0 {
        bail!("--context must be at least 1");
    }
    if context > most {
        log::warn!(
            "--context {context} is beyond the model's max_position_embeddings; using {most}"
        );
        return Ok(most);
    }
    Ok(context)
}

/// `picchio ab`: both tiers on the same prompt; non-zero exit on any disagreement.
fn ab(prompt: &PromptArgs, backend: Backend, json: bool) -> Result<()> {
    let model = prompt.load_for(backend.into())?;
    let context = resolve_context(&model, prompt.context)?;
    let report = picchio::model::ab::compare_tiers(
        &model,
        &prompt.prompt_ids(&model.config)?,
        prompt.max_new_tokens,
        backend.into(),
        &prompt.gpu_options(context, 0),
    )?;
    if json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("tier under test: {}", report.backend);
        println!("adapter: {} ({})", report.adapter, report.adapter_backend);
        println!(
            "tokens agreeing: {} of {}",
            report.tokens_agreeing, report.steps
        );
        match &report.first_divergence {
            Some(d) => println!(
                "first divergence: step {}, cpu {} vs {} {} (cpu top1-top2 margin {})",
                d.step, d.cpu_id, report.backend, d.gpu_id, d.margin
            ),
            None => println!("first divergence: none"),
        }
        println!(
            "max |logit difference| (top-10, agreeing steps): {:e}",
            report.max_logit_difference
        );
        for (l, a) in report.router_agreement.iter().enumerate() {
            println!(
                "layer {l}: router top-k agrees at {} of {} prompt positions",
                a.agreeing, a.positions
            );
        }
    }
    if !report.agree() {
        bail!(
            "the CPU tier and the tier under test ({}) disagree",
            report.backend
        );
    }
    Ok(())
}

fn inspect(dir: &std::path::Path, json: bool) -> Result<()> {
    // Validate the whole model first: inspect reports on a checkpoint picchio can run.
    let loaded = Model::load(dir)?;
    let ck: &Checkpoint = &loaded.checkpoint;
    let mut totals = [0usize; 5];
    let mut rows = Vec::new();
    for t in ck.tensors() {
        let bytes = t.range.len();
        let role = tensor_role(&t.name);
        totals[role as usize] += bytes;
        rows.push((
            t.name.clone(),
            format!("{:?}", t.dtype),
            t.shape.clone(),
            bytes,
            tensor_format(&t.name, t.dtype),
            role,
        ));
    }
    let [embedding, lm_head, dense, experts, unknown] = totals;
    if json {
        let tensors: Vec<_> = rows
            .iter()
            .map(|(name, dtype, shape, bytes, format, _)| {
                json!({"name": name, "dtype": dtype, "shape": shape, "bytes": bytes, "format": format})
            })
            .collect();
        println!(
            "{}",
            json!({
                "tensors": tensors,
                "totals": {"embedding_bytes": embedding, "lm_head_bytes": lm_head, "dense_bytes": dense,
                           "expert_bytes": experts, "other_bytes": unknown,
                           "all_bytes": embedding + lm_head + dense + experts + unknown},
            })
        );
        return Ok(());
    }
    let name_width = rows.iter().map(|r| r.0.len()).max().unwrap_or(6).max(6);
    println!(
        "{:<name_width$}  {:<7}  {:<22}  {:>14}  format",
        "tensor", "dtype", "shape", "bytes"
    );
    for (name, dtype, shape, bytes, format, _) in &rows {
        println!(
            "{name:<name_width$}  {dtype:<7}  {:<22}  {bytes:>14}  {format}",
            format!("{shape:?}")
        );
    }
    let cfg = &loaded.config;
    println!();
    println!(
        "tensors: {} in {} file(s)",
        rows.len(),
        ck.shard_paths().count()
    );
    println!(
        "dense (attention, norms, routers, excluding embeddings/head): {}",
        human(dense)
    );
    println!("experts (weights, scales, biases): {}", human(experts));
    println!(
        "embeddings: {}   lm_head: {}",
        human(embedding),
        human(lm_head)
    );
    if unknown > 0 {
        println!("other (not used by picchio): {}", human(unknown));
    }
    println!(
        "total: {}",
        human(embedding + lm_head + dense + experts + unknown)
    );
    println!(
        "config: {}, {} layers, hidden {}, {} heads x {} (kv {}), {} experts top-{}, intermediate {}, vocab {}",
        cfg.family.model_type(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.head_dim,
        cfg.num_kv_heads,
        cfg.num_experts,
        cfg.experts_per_token,
        cfg.intermediate_size,
        cfg.vocab_size
    );
    Ok(())
}

fn devices(json: bool) -> Result<()> {
    let adapters = picchio::gpu::list_adapters();
    if json {
        println!("{}", json!({ "adapters": adapters }));
        return Ok(());
    }
    if adapters.is_empty() {
        println!("no Vulkan, Metal or DX12 adapter found");
    }
    for (i, a) in adapters.iter().enumerate() {
        println!("[{i}] {} ({}, {})", a.name, a.backend, a.device_type);
        println!("    driver: {} {}", a.driver, a.driver_info);
        println!(
            "    max storage binding: {} MiB, max buffer: {} MiB, storage buffers per stage: {}",
            a.max_storage_buffer_binding_size >> 20,
            a.max_buffer_size >> 20,
            a.max_storage_buffers_per_shader_stage
        );
        println!(
            "    workgroup memory: {} KiB, invocations per workgroup: {}",
            a.max_compute_workgroup_storage_size >> 10,
            a.max_compute_invocations_per_workgroup
        );
        println!(
            "    SHADER_F16: {}, SUBGROUP: {} (sizes {}-{}), TIMESTAMP_QUERY: {}",
            a.shader_f16, a.subgroup, a.subgroup_sizes.0, a.subgroup_sizes.1, a.timestamp_query
        );
        if a.device_type == "Cpu" {
            println!(
                "    (software adapter: used only with {}=1)",
                picchio::gpu::context::ALLOW_SOFTWARE_ENV
            );
        }
    }
    Ok(())
}

fn synth(shape: ShapeArg, out: PathBuf, seed: u64, shard_bytes: Option<u64>) -> Result<()> {
    use picchio::synth::{SynthOptions, SynthShape, planned_bytes, synthesize};
    let shape = match shape {
        ShapeArg::GptOss20b => SynthShape::GptOss20b,
        ShapeArg::GptOss120b => SynthShape::GptOss120b,
        ShapeArg::Tiny => SynthShape::Tiny,
        ShapeArg::TinyHarmony => SynthShape::TinyHarmony,
        ShapeArg::Qwen3_30bA3b => SynthShape::Qwen3_30bA3b,
        ShapeArg::Qwen3_235bA22b => SynthShape::Qwen3_235bA22b,
    };
    let shard_bytes = shard_bytes.unwrap_or(shape.default_shard_bytes());
    if shard_bytes == 0 {
        bail!("--shard-bytes must be positive");
    }
    let bar = indicatif::ProgressBar::new(planned_bytes(shape)?);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("a valid template"),
    );
    let options = SynthOptions {
        shape,
        out: out.clone(),
        seed,
        shard_bytes,
    };
    let started = std::time::Instant::now();
    let report = synthesize(&options, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    log::info!(
        "wrote {} tensors, {} in {} file(s) to {} in {:.1} s",
        report.tensors,
        human(report.total_bytes as usize),
        report.shards.len(),
        out.display(),
        started.elapsed().as_secs_f64()
    );
    for (path, bytes) in &report.shards {
        println!("{}\t{bytes}", path.display());
    }
    Ok(())
}

fn convert(
    model: &std::path::Path,
    out: &std::path::Path,
    format: picchio::flat_store::FlatFormat,
    force: bool,
) -> Result<()> {
    let config = picchio::Config::load(model)?;
    let bar = indicatif::ProgressBar::new((config.num_layers * config.num_experts) as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} experts eta {eta}")
            .expect("a valid template"),
    );
    let started = std::time::Instant::now();
    let report = picchio::flat_store::convert(model, out, format, force, &|n| bar.inc(n))?;
    bar.finish_and_clear();
    log::info!(
        "wrote {} dense tensors ({}) and {} {:?} expert records of {} bytes ({}) to {} in {:.1} s",
        report.dense_tensors,
        human(report.dense_bytes as usize),
        report.index.hashes.len(),
        report.index.experts_format,
        report.index.record_stride,
        human(report.records_bytes as usize),
        out.display(),
        started.elapsed().as_secs_f64()
    );
    for name in ["model.safetensors", "experts.bin", "experts.json"] {
        println!("{}", out.join(name).display());
    }
    Ok(())
}

fn verify(model: &std::path::Path) -> Result<()> {
    let config = picchio::Config::load(model)?;
    let Some(store) = picchio::flat_store::FlatExperts::open(model, &config)? else {
        bail!(
            "{} has no converted expert store ({}); picchio convert writes one",
            model.display(),
            picchio::flat_store::INDEX_FILE
        );
    };
    store.verify()?;
    println!("{} records match their hashes", store.index.hashes.len());
    Ok(())
}

fn bench(
    options: &picchio::bench::BenchOptions,
    json: bool,
    csv: Option<PathBuf>,
    plot: Option<PathBuf>,
) -> Result<()> {
    use picchio::bench::{plot_svg, run_bench, to_csv};
    let runs = run_bench(options, &mut |done, total| {
        log::info!("bench: {done}/{total} configurations done")
    })?;
    if let Some(path) = &csv {
        std::fs::write(path, to_csv(&runs))
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    }
    if let Some(path) = &plot {
        plot_svg(&runs, path)?;
    }
    if json {
        println!("{}", json!({ "runs": runs }));
        return Ok(());
    }
    println!(
        "{:<8} {:>11} {:>11} {:>8} {:>10} {:>10} {:>9} {:>9} {:>14} {:>14} {:>8} {:>10}",
        "backend",
        "vram budget",
        "ram budget",
        "prefetch",
        "prefill/s",
        "decode/s",
        "vram hits",
        "ram hits",
        "disk B/token",
        "upload B/tok",
        "io wait",
        "peak RSS"
    );
    let percent = |h: Option<f64>| h.map_or("-".to_string(), |h| format!("{:.1}%", h * 100.0));
    let roofline = runs.iter().any(|r| r.roofline_fraction.is_some());
    for r in &runs {
        println!(
            "{:<8} {:>11} {:>11} {:>8} {:>10.2} {:>10.2} {:>9} {:>9} {:>14.0} {:>14.0} {:>7.1}% {:>10}",
            r.backend,
            r.vram_budget_bytes.map_or("-".to_string(), human_short),
            human_short(r.ram_budget_bytes),
            if r.prefetch {
                percent(r.prefetch_accuracy)
            } else {
                "off".to_string()
            },
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s,
            percent(r.vram_hit_rate),
            percent(r.ram_hit_rate),
            r.disk_bytes_per_token,
            r.upload_bytes_per_token,
            r.io_wait_share * 100.0,
            r.peak_rss_bytes.map_or("-".to_string(), human_short),
        );
    }
    if roofline {
        println!();
        println!(
            "{:<8} {:>7} {:>10} {:>12} {:>9} {:>10} {:>9} {:>10} {:>13} {:>12}",
            "backend",
            "threads",
            "kernels",
            "bytes/token",
            "GB/s",
            "bandwidth",
            "roofline",
            "decode/s",
            "prefill512/s",
            "interleaved"
        );
        for r in &runs {
            println!(
                "{:<8} {:>7} {:>10} {:>12} {:>9.2} {:>10} {:>8.1}% {:>10.2} {:>13} {:>12}",
                r.backend,
                r.threads,
                format!("{}{}", r.cpu_kernels, if r.amx_tiles { "+amx" } else { "" }),
                human_short(r.bytes_per_token as u64),
                r.achieved_bytes_per_s / 1e9,
                r.bandwidth_bytes_per_s
                    .map_or("-".to_string(), |b| format!("{:.2} GB/s", b / 1e9)),
                r.roofline_fraction.unwrap_or(0.0) * 100.0,
                r.decode_tokens_per_s,
                r.prefill_512_tokens_per_s
                    .map_or("-".to_string(), |p| format!("{p:.2}")),
                r.interleaved_roofline_fraction
                    .map_or("-".to_string(), |f| format!("{:.1}%", f * 100.0)),
            );
        }
    }
    if runs.iter().any(|r| r.disk_roofline_fraction.is_some()) {
        print_disk_table(&runs);
    }
    Ok(())
}

/// `--direct-io` runs against the disk they read from.
fn print_disk_table(runs: &[picchio::bench::BenchRun]) {
    println!();
    println!(
        "{:<11} {:>8} {:>10} {:>13} {:>11} {:>11} {:>10} {:>11} {:>9} {:>14}",
        "ram budget",
        "prefetch",
        "decode/s",
        "missed B/tok",
        "disk (io)",
        "disk (best)",
        "s/token",
        "bound s/tok",
        "of bound",
        "accuracy 1/2/3"
    );
    let gb = |b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.2} GB/s", b / 1e9));
    for r in runs {
        let accuracy: Vec<String> = (r.prefetch_accuracy_by_distance.iter())
            .map(|a| a.map_or("-".to_string(), |a| format!("{:.0}", a * 100.0)))
            .collect();
        println!(
            "{:<11} {:>8} {:>10.2} {:>13} {:>11} {:>11} {:>10.3} {:>11} {:>9} {:>14}",
            human_short(r.ram_budget_bytes),
            if r.prefetch {
                format!("on, {}", r.prefetch_distance)
            } else {
                "off".to_string()
            },
            r.decode_tokens_per_s,
            human_short(r.missed_bytes_per_token as u64),
            gb(r.disk_bandwidth_at_io_threads_bytes_per_s),
            gb(r.disk_bandwidth_bytes_per_s),
            1.0 / r.decode_tokens_per_s.max(1e-9),
            r.disk_bound_s_per_token
                .map_or("-".to_string(), |s| format!("{s:.3}")),
            r.disk_roofline_fraction
                .map_or("-".to_string(), |f| format!("{:.1}%", f * 100.0)),
            accuracy.join("/"),
        );
    }
}

fn human_short(bytes: u64) -> String {
    match bytes {
        b if b >= 1_000_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b if b >= 1_000 => format!("{:.1} kB", b as f64 / 1e3),
        b => format!("{b} B"),
    }
}

fn human(bytes: usize) -> String {
    format!("{bytes} bytes ({:.3} GB)", bytes as f64 / 1e9)
}

/// Ctrl-C and SIGTERM during `generate`: the first stops generation after the current token
/// (what was generated is still printed); a second ends the process at once.
mod interrupts {
    use std::sync::atomic::{AtomicBool, Ordering};

    static HAPPENED: AtomicBool = AtomicBool::new(false);

    pub fn happened() -> bool {
        HAPPENED.load(Ordering::SeqCst)
    }

    #[cfg(unix)]
    extern "C" fn on_signal(_: libc::c_int) {
        if HAPPENED.swap(true, Ordering::SeqCst) {
            // Safety: _exit is async-signal-safe and touches no state of this process.
            unsafe { libc::_exit(130) };
        }
    }

    /// Installs the handler (Unix; elsewhere the default handling stays).
    pub fn catch() {
        #[cfg(unix)]
        for signal in [libc::SIGINT, libc::SIGTERM] {
            let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            // Safety: the handler only touches an atomic and calls _exit, both
            // async-signal-safe.
            unsafe { libc::signal(signal, handler) };
        }
    }
}
