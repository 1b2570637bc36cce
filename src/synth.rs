//! Random checkpoints in the real Hugging Face layout, for benchmarks: the published config.json;
//! for GPT-OSS, MXFP4 experts (random codes, E8M0 scales that keep activations sane) and bf16
//! dense weights, sharded like the published checkpoints (greedy cut at about 4.8 GB, openai's
//! 0-based shard names); for Qwen3-MoE, bf16 everything with the hub's per-expert tensors, cut
//! at about 4 GB into 1-based shards (`model-00001-of-00016.safetensors` for 30B-A3B) and its
//! generation_config.json. Sharded checkpoints get `model.safetensors.index.json`.
//!
//! The values are random, so routing is not what a trained model does: use these checkpoints for
//! speed and memory, never for quality.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::arch::{Family, gpt_oss};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::random::splitmix64;

/// Checkpoint shapes `synth` knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthShape {
    GptOss20b,
    GptOss120b,
    /// A tiny model with the real config keys, for tests.
    Tiny,
    /// The tiny model with o200k_harmony's vocabulary (201088 tokens, EOS `<|return|>`): what
    /// chat and serving tests run on (about 52 MB, so made by the tests, not committed).
    TinyHarmony,
    /// Qwen3-30B-A3B-Instruct-2507's config and hub layout (61 GB, bf16 experts).
    Qwen3_30bA3b,
    /// Qwen3-235B-A22B-Instruct-2507's config and hub layout (470 GB).
    Qwen3_235bA22b,
}

impl SynthShape {
    /// The config.json text, verbatim.
    pub fn config_text(self) -> &'static str {
        match self {
            SynthShape::GptOss20b => include_str!("../fixtures/configs/gpt-oss-20b.config.json"),
            SynthShape::GptOss120b => include_str!("../fixtures/configs/gpt-oss-120b.config.json"),
            SynthShape::Tiny => include_str!("../fixtures/tiny-single/config.json"),
            SynthShape::TinyHarmony => include_str!("../fixtures/configs/tiny-harmony.config.json"),
            SynthShape::Qwen3_30bA3b => {
                include_str!("../fixtures/configs/qwen3-30b-a3b.config.json")
            }
            SynthShape::Qwen3_235bA22b => {
                include_str!("../fixtures/configs/qwen3-235b-a22b.config.json")
            }
        }
    }

    /// The generation_config.json text where the published checkpoint's stop ids are not all
    /// in config.json (Qwen3's: `<|im_end|>` and `<|endoftext|>`; the 235B's are the same).
    pub fn generation_config_text(self) -> Option<&'static str> {
        match self {
            SynthShape::Qwen3_30bA3b | SynthShape::Qwen3_235bA22b => Some(include_str!(
                "../fixtures/configs/qwen3-30b-a3b.generation_config.json"
            )),
            _ => None,
        }
    }

    /// Where the published checkpoint cuts its shards.
    pub fn default_shard_bytes(self) -> u64 {
        match self {
            SynthShape::Qwen3_30bA3b | SynthShape::Qwen3_235bA22b => QWEN3_SHARD_BYTES,
            _ => DEFAULT_SHARD_BYTES,
        }
    }
}

/// What to write.
#[derive(Debug, Clone)]
pub struct SynthOptions {
    pub shape: SynthShape,
    pub out: PathBuf,
    pub seed: u64,
    /// A shard is closed before the tensor that would take it past this many bytes.
    pub shard_bytes: u64,
}

/// The published GPT-OSS checkpoints' shard size.
pub const DEFAULT_SHARD_BYTES: u64 = 4_800_000_000;
/// About where Qwen3-MoE's hub checkpoints cut (16 shards for 30B-A3B).
const QWEN3_SHARD_BYTES: u64 = 4_000_000_000;

/// How a tensor's bytes are made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    /// bf16, uniform with standard deviation 0.02.
    Weights,
    /// bf16 ones (norm weights).
    Ones,
    /// bf16 zeros (attention sinks).
    Zeros,
    /// Random bytes (MXFP4 codes).
    RandomBytes,
    /// E8M0 bytes 118..=121: dequantized weights with standard deviation of about 0.026.
    Scales,
}

#[derive(Debug, Clone)]
struct Planned {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    content: Content,
}

impl Planned {
    fn bytes(&self) -> u64 {
        let elements: usize = self.shape.iter().product();
        (elements * if self.dtype == "BF16" { 2 } else { 1 }) as u64
    }
}

/// Every tensor of a checkpoint for `cfg`, in checkpoint order.
fn plan(cfg: &Config) -> Vec<Planned> {
    match cfg.family {
        Family::GptOss => plan_gpt_oss(cfg),
        Family::Qwen3Moe => plan_qwen3_moe(cfg),
    }
}

/// A Qwen3-MoE checkpoint's tensors in the hub's layer order, bf16: per layer the norms, q/k/v/o,
/// the per-head q/k norms, the router and each expert's gate, up and down.
fn plan_qwen3_moe(cfg: &Config) -> Vec<Planned> {
    let (h, i, e, d) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_experts,
        cfg.head_dim,
    );
    let t = |name: String, shape: Vec<usize>, content| Planned {
        name,
        dtype: "BF16",
        shape,
        content,
    };
    let mut tensors = vec![t(
        gpt_oss::EMBEDDINGS.into(),
        vec![cfg.vocab_size, h],
        Content::Weights,
    )];
    for l in 0..cfg.num_layers {
        let names = gpt_oss::layer_tensors(l);
        let layer = format!("model.layers.{l}");
        tensors.push(t(names.input_norm.clone(), vec![h], Content::Ones));
        for (name, rows, cols) in [
            (&names.q, cfg.q_dim(), h),
            (&names.k, cfg.kv_dim(), h),
            (&names.v, cfg.kv_dim(), h),
            (&names.o, h, cfg.q_dim()),
        ] {
            tensors.push(t(name.clone(), vec![rows, cols], Content::Weights));
        }
        for norm in ["q_norm", "k_norm"] {
            let name = format!("{layer}.self_attn.{norm}.weight");
            tensors.push(t(name, vec![d], Content::Ones));
        }
        tensors.push(t(names.post_attention_norm.clone(), vec![h], Content::Ones));
        let router = format!("{layer}.mlp.gate.weight");
        tensors.push(t(router, vec![e, h], Content::Weights));
        for x in 0..e {
            for (projection, rows, cols) in
                [("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)]
            {
                let name = format!("{layer}.mlp.experts.{x}.{projection}.weight");
                tensors.push(t(name, vec![rows, cols], Content::Weights));
            }
        }
    }
    tensors.push(t(gpt_oss::FINAL_NORM.into(), vec![h], Content::Ones));
    tensors.push(t(
        gpt_oss::LM_HEAD.into(),
        vec![cfg.vocab_size, h],
        Content::Weights,
    ));
    tensors
}

/// Every tensor of a GPT-OSS checkpoint for `cfg`, in checkpoint order.
fn plan_gpt_oss(cfg: &Config) -> Vec<Planned> {
    let (h, i, e) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    let t = |name: String, dtype, shape: Vec<usize>, content| Planned {
        name,
        dtype,
        shape,
        content,
    };
    let mut tensors = vec![t(
        gpt_oss::EMBEDDINGS.into(),
        "BF16",
        vec![cfg.vocab_size, h],
        Content::Weights,
    )];
    for l in 0..cfg.num_layers {
        let names = gpt_oss::layer_tensors(l);
        tensors.push(t(names.input_norm.clone(), "BF16", vec![h], Content::Ones));
        for (weight, bias, rows, cols) in [
            (&names.q, &names.q_bias, cfg.q_dim(), h),
            (&names.k, &names.k_bias, cfg.kv_dim(), h),
            (&names.v, &names.v_bias, cfg.kv_dim(), h),
            (&names.o, &names.o_bias, h, cfg.q_dim()),
        ] {
            tensors.push(t(
                weight.clone(),
                "BF16",
                vec![rows, cols],
                Content::Weights,
            ));
            tensors.push(t(bias.clone(), "BF16", vec![rows], Content::Weights));
        }
        tensors.push(t(
            names.sinks.clone(),
            "BF16",
            vec![cfg.num_heads],
            Content::Zeros,
        ));
        tensors.push(t(
            names.post_attention_norm.clone(),
            "BF16",
            vec![h],
            Content::Ones,
        ));
        tensors.push(t(
            names.router.clone(),
            "BF16",
            vec![e, h],
            Content::Weights,
        ));
        tensors.push(t(
            names.router_bias.clone(),
            "BF16",
            vec![e],
            Content::Weights,
        ));
        for (prefix, bias, rows, cols) in [
            (&names.gate_up, &names.gate_up_bias, 2 * i, h),
            (&names.down, &names.down_bias, h, i),
        ] {
            tensors.push(t(
                format!("{prefix}_blocks"),
                "U8",
                vec![e, rows, cols / 32, 16],
                Content::RandomBytes,
            ));
            tensors.push(t(
                format!("{prefix}_scales"),
                "U8",
                vec![e, rows, cols / 32],
                Content::Scales,
            ));
            tensors.push(t(bias.clone(), "BF16", vec![e, rows], Content::Weights));
        }
    }
    tensors.push(t(
        gpt_oss::FINAL_NORM.into(),
        "BF16",
        vec![h],
        Content::Ones,
    ));
    tensors.push(t(
        gpt_oss::LM_HEAD.into(),
        "BF16",
        vec![cfg.vocab_size, h],
        Content::Weights,
    ));
    tensors
}

/// A greedy cut: each shard takes tensors in order until the next would pass `limit` bytes.
fn shard(tensors: &[Planned], limit: u64) -> Vec<Vec<Planned>> {
    let mut shards: Vec<Vec<Planned>> = vec![Vec::new()];
    let mut used = 0u64;
    for tensor in tensors {
        let bytes = tensor.bytes();
        if used + bytes > limit && !shards.last().unwrap().is_empty() {
            shards.push(Vec::new());
            used = 0;
        }
        used += bytes;
        shards.last_mut().unwrap().push(tensor.clone());
    }
    shards
}

/// Each 1 MiB block of a tensor gets its own SplitMix64 stream, so blocks are generated in
/// parallel and the output depends only on the seed.
const BLOCK: usize = 1 << 20;

fn fill(content: Content, seed: u64, out: &mut [u8]) {
    let mut state = seed;
    match content {
        Content::Ones => out
            .chunks_exact_mut(2)
            .for_each(|b| b.copy_from_slice(&0x3F80u16.to_le_bytes())),
        Content::Zeros => out.fill(0),
        Content::RandomBytes => out.chunks_mut(8).for_each(|b| {
            let r = splitmix64(&mut state).to_le_bytes();
            b.copy_from_slice(&r[..b.len()]);
        }),
        Content::Scales => out.chunks_mut(8).for_each(|b| {
            let r = splitmix64(&mut state).to_le_bytes();
            for (byte, random) in b.iter_mut().zip(r) {
                *byte = 118 + random % 4;
            }
        }),
        Content::Weights => out.chunks_mut(8).for_each(|b| {
            let r = splitmix64(&mut state);
            for (k, pair) in b.chunks_exact_mut(2).enumerate() {
                // Uniform on [-a, a] with a = 0.02 * sqrt(3): standard deviation 0.02.
                let unit = ((r >> (16 * k)) & 0xFFFF) as f32 / 65535.0;
                let value = (unit * 2.0 - 1.0) * 0.034_641;
                pair.copy_from_slice(&half::bf16::from_f32(value).to_le_bytes());
            }
        }),
    }
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

/// What was written.
#[derive(Debug, Clone)]
pub struct SynthReport {
    pub tensors: usize,
    pub total_bytes: u64,
    pub shards: Vec<(PathBuf, u64)>,
}

/// Bytes `options` will write (tensor data), for progress reporting.
pub fn planned_bytes(shape: SynthShape) -> Result<u64> {
    let cfg = Config::from_json(shape.config_text(), Path::new("config.json"))?;
    Ok(plan(&cfg).iter().map(Planned::bytes).sum())
}

/// Writes the checkpoint; `progress(bytes)` is called as tensor data is written.
/// Refuses an output directory that holds anything: old shards, an index or a usage file beside
/// new ones would mix two checkpoints.
pub fn require_empty_dir(out: &Path) -> Result<()> {
    if out
        .read_dir()
        .is_ok_and(|mut entries| entries.next().is_some())
    {
        return Err(Error::InvalidArgument(format!(
            "{} is not empty: write a new checkpoint into a new or empty directory",
            out.display()
        )));
    }
    Ok(())
}

pub fn synthesize(options: &SynthOptions, progress: &(dyn Fn(u64) + Sync)) -> Result<SynthReport> {
    let text = options.shape.config_text();
    let cfg = Config::from_json(text, Path::new("config.json"))?;
    let out = &options.out;
    require_empty_dir(out)?;
    std::fs::create_dir_all(out).map_err(io(out))?;
    let config_path = out.join("config.json");
    std::fs::write(&config_path, text).map_err(io(&config_path))?;
    if let Some(generation) = options.shape.generation_config_text() {
        let path = out.join("generation_config.json");
        std::fs::write(&path, generation).map_err(io(&path))?;
    }

    let tensors = plan(&cfg);
    let shards = shard(&tensors, options.shard_bytes);
    let count = shards.len();
    let names: Vec<String> = match cfg.family {
        _ if count == 1 => vec!["model.safetensors".into()],
        // openai's 0-based names: model-00000-of-00002 ... model-00002-of-00002 for 3 files.
        Family::GptOss => (0..count)
            .map(|s| format!("model-{s:05}-of-{:05}.safetensors", count - 1))
            .collect(),
        Family::Qwen3Moe => (1..=count)
            .map(|s| format!("model-{s:05}-of-{count:05}.safetensors"))
            .collect(),
    };
    let mut weight_map = serde_json::Map::new();
    let mut report = SynthReport {
        tensors: tensors.len(),
        total_bytes: 0,
        shards: Vec::new(),
    };
    let mut tensor_index = 0u64;
    for (tensors, name) in shards.iter().zip(&names) {
        let path = out.join(name);
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut offset = 0u64;
        for t in tensors {
            header.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [offset, offset + t.bytes()]}),
            );
            offset += t.bytes();
            weight_map.insert(t.name.clone(), name.clone().into());
        }
        let mut header = serde_json::Value::Object(header).to_string().into_bytes();
        header.resize(header.len().div_ceil(8) * 8, b' ');
        let file = File::create(&path).map_err(io(&path))?;
        let mut writer = BufWriter::with_capacity(8 << 20, file);
        writer
            .write_all(&(header.len() as u64).to_le_bytes())
            .map_err(io(&path))?;
        writer.write_all(&header).map_err(io(&path))?;
        let mut buffer = Vec::new();
        for t in tensors {
            tensor_index += 1;
            let tensor_seed = options.seed ^ tensor_index.wrapping_mul(0xD1B5_4A32_D192_ED03);
            let bytes = t.bytes() as usize;
            // 64 MiB at a time, filled in parallel 1 MiB blocks.
            for start in (0..bytes).step_by(64 * BLOCK) {
                let len = (bytes - start).min(64 * BLOCK);
                buffer.resize(len, 0);
                buffer
                    .par_chunks_mut(BLOCK)
                    .enumerate()
                    .for_each(|(b, chunk)| {
                        let block = (start / BLOCK + b) as u64;
                        fill(
                            t.content,
                            tensor_seed ^ block.wrapping_mul(0x2545_F491_4F6C_DD1D),
                            chunk,
                        );
                    });
                writer.write_all(&buffer).map_err(io(&path))?;
                progress(len as u64);
            }
        }
        writer.flush().map_err(io(&path))?;
        report.total_bytes += offset;
        report.shards.push((path, offset));
    }
    if names.len() > 1 {
        let index_path = out.join("model.safetensors.index.json");
        let index = serde_json::json!({"metadata": {"total_size": report.total_bytes}, "weight_map": weight_map});
        std::fs::write(&index_path, index.to_string()).map_err(io(&index_path))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_20b_layout_matches_the_published_checkpoint() {
        let cfg = Config::from_json(SynthShape::GptOss20b.config_text(), Path::new("c")).unwrap();
        let tensors = plan(&cfg);
        // The published gpt-oss-20b: 459 tensors, 13,761,264,768 bytes, three shards.
        assert_eq!(tensors.len(), 459);
        let total: u64 = tensors.iter().map(Planned::bytes).sum();
        assert_eq!(total, 13_761_264_768);
        let shards = shard(&tensors, DEFAULT_SHARD_BYTES);
        assert_eq!(shards.len(), 3);
        for s in &shards {
            let bytes: u64 = s.iter().map(Planned::bytes).sum();
            assert!(
                bytes <= DEFAULT_SHARD_BYTES && bytes > 4_000_000_000,
                "{bytes}"
            );
        }
    }

    #[test]
    fn real_qwen3_30b_a3b_layout() {
        let shape = SynthShape::Qwen3_30bA3b;
        let cfg = Config::from_json(shape.config_text(), Path::new("c")).unwrap();
        let tensors = plan(&cfg);
        // 3 E + 9 tensors per layer, plus embeddings, final norm and LM head.
        assert_eq!(tensors.len(), 48 * (3 * 128 + 9) + 3);
        let total: u64 = tensors.iter().map(Planned::bytes).sum();
        assert_eq!(total, 61_064_245_248);
        assert_eq!(shard(&tensors, shape.default_shard_bytes()).len(), 16);
        assert!(tensors.iter().any(|t| t.name
            == "model.layers.47.mlp.experts.127.down_proj.weight"
            && t.shape == [2048, 768]));
    }

    #[test]
    fn scales_and_weights_stay_in_their_ranges() {
        let mut scales = vec![0u8; 4096];
        fill(Content::Scales, 7, &mut scales);
        assert!(scales.iter().all(|b| (118..=121).contains(b)));
        let mut weights = vec![0u8; 8192];
        fill(Content::Weights, 7, &mut weights);
        let values: Vec<f32> = weights
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let std = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
        assert!((std - 0.02).abs() < 0.002, "std {std}");
        assert!(values.iter().all(|v| v.abs() <= 0.035));
    }
}
