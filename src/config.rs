//! `config.json` of a checkpoint, mirrored with serde.
//!
//! Field names and defaults follow transformers' `GptOssConfig` and `Qwen3MoeConfig` (5.x), so a
//! key that is absent means what it means to transformers. Every dimension the engine uses comes
//! from here: 20B, 120B, 30B-A3B and tiny test models run the same code.

use std::path::Path;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::arch::Family;
use crate::error::{Error, Result};

/// Upper bound on every dimension read from config.json (GPT-OSS-120B's largest is 201088).
const MAX_DIMENSION: usize = 1 << 24;

/// Attention layer kind, from `layer_types`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub enum LayerType {
    #[serde(rename = "sliding_attention")]
    Sliding,
    #[serde(rename = "full_attention")]
    Full,
}

/// `eos_token_id` is an int, a list of ints, or null.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn flatten(ids: Option<TokenIds>) -> Vec<u32> {
        match ids {
            None => Vec::new(),
            Some(TokenIds::One(id)) => vec![id],
            Some(TokenIds::Many(ids)) => ids,
        }
    }
}

/// The raw `config.json`, with transformers' defaults for absent keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct RawConfig {
    pub model_type: Option<String>,
    pub num_hidden_layers: usize,
    pub num_local_experts: usize,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub head_dim: Option<usize>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub sliding_window: Option<usize>,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    /// transformers 5.x layout: one dict with `rope_type`, `rope_theta` and the scaling keys.
    pub rope_parameters: Option<Map<String, Value>>,
    /// transformers 4.x layout (what the published checkpoints carry); wins over `rope_parameters`.
    pub rope_scaling: Option<Map<String, Value>>,
    pub rope_theta: Option<f64>,
    /// Phi-3 style top-level key; when present transformers prefers it for YaRN.
    pub original_max_position_embeddings: Option<f64>,
    /// Top-level legacy key; transformers moves it into the rope parameters.
    pub partial_rotary_factor: Option<f64>,
    pub num_experts_per_tok: usize,
    pub swiglu_alpha: f64,
    pub swiglu_limit: f64,
    pub layer_types: Option<Vec<LayerType>>,
    pub pad_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    pub attention_bias: bool,
    pub quantization_config: Option<Value>,
    /// Not a GPT-OSS key: set from Qwen3-MoE's config (`arch::qwen3_moe::RawConfig`).
    #[serde(skip)]
    pub norm_topk_prob: bool,
}

/// `model_type` of a config.json's text (None where absent or null).
fn model_type_of(text: &str) -> serde_json::Result<Option<String>> {
    #[derive(Deserialize)]
    struct ModelType {
        #[serde(default)]
        model_type: Option<String>,
    }
    serde_json::from_str::<ModelType>(text).map(|m| m.model_type)
}

impl Default for RawConfig {
    fn default() -> Self {
        // transformers' GptOssConfig defaults.
        RawConfig {
            model_type: None,
            num_hidden_layers: 36,
            num_local_experts: 128,
            vocab_size: 201088,
            hidden_size: 2880,
            intermediate_size: 2880,
            // Absent means 64 and 8; an explicit null means hidden/heads and num_attention_heads.
            head_dim: Some(64),
            num_attention_heads: 64,
            num_key_value_heads: Some(8),
            sliding_window: Some(128),
            tie_word_embeddings: false,
            max_position_embeddings: 131072,
            rms_norm_eps: 1e-5,
            rope_parameters: None,
            rope_scaling: None,
            rope_theta: None,
            original_max_position_embeddings: None,
            partial_rotary_factor: None,
            num_experts_per_tok: 4,
            swiglu_alpha: 1.702,
            swiglu_limit: 7.0,
            layer_types: None,
            pad_token_id: None,
            eos_token_id: None,
            attention_bias: true,
            quantization_config: None,
            norm_topk_prob: false,
        }
    }
}

/// Rotary embedding parameters after transformers' standardisation.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeKind {
    /// Plain RoPE (`rope_type: "default"`).
    Default,
    /// YaRN; `low`/`high` are the correction range in rotary-dimension units.
    Yarn {
        factor: f64,
        low: f64,
        high: f64,
        attention_factor: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub kind: RopeKind,
}

/// The resolved model configuration used by every tier.
#[derive(Debug, Clone)]
pub struct Config {
    pub family: Family,
    pub hidden_size: usize,
    /// Each expert's intermediate size (Qwen3-MoE's `moe_intermediate_size`).
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    /// Keys a sliding layer sees, the current one included; `None` = sliding layers see everything.
    pub sliding_window: Option<usize>,
    pub layer_types: Vec<LayerType>,
    pub rope: Rope,
    pub swiglu_alpha: f32,
    pub swiglu_limit: f32,
    pub eos_token_ids: Vec<u32>,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub max_position_embeddings: usize,
    /// `quantization_config.quant_method`, when present (`"mxfp4"` for the published checkpoints).
    pub quant_method: Option<String>,
    /// Whether the chosen experts' router probabilities are divided by their sum (Qwen3-MoE).
    pub norm_topk_prob: bool,
}

impl Config {
    /// Reads `DIR/config.json`, and the stop tokens of `DIR/generation_config.json` when present
    /// (the published GPT-OSS checkpoints list `<|return|>`, `<|call|>` and `<|endoftext|>` there).
    pub fn load(model_dir: &Path) -> Result<Config> {
        let mut config = Config::load_file(&model_dir.join("config.json"))?;
        let generation = model_dir.join("generation_config.json");
        if generation.is_file() {
            #[derive(Deserialize)]
            struct GenerationConfig {
                #[serde(default)]
                eos_token_id: Option<TokenIds>,
            }
            let text =
                std::fs::read_to_string(&generation).map_err(|e| Error::io(&generation, e))?;
            let parsed: GenerationConfig =
                serde_json::from_str(&text).map_err(|e| Error::Config {
                    path: generation.clone(),
                    msg: e.to_string(),
                })?;
            let ids = TokenIds::flatten(parsed.eos_token_id);
            check_token_ids("eos_token_id", &ids, config.vocab_size).map_err(|msg| {
                Error::Config {
                    path: generation.clone(),
                    msg,
                }
            })?;
            for id in ids {
                if !config.eos_token_ids.contains(&id) {
                    config.eos_token_ids.push(id);
                }
            }
        }
        Ok(config)
    }

    /// Reads a config file by its path (tests, tools).
    pub fn load_file(path: &Path) -> Result<Config> {
        crate::weights::require_regular_file(path)?;
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Config::from_json(&text, path)
    }

    /// Parses and validates the text of a `config.json`; `path` is only used in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Config> {
        let fail = |msg: String| Error::Config {
            path: path.to_path_buf(),
            msg,
        };
        // serde_path_to_error names the offending key (e.g. `hidden_size: invalid type ...`).
        let family = model_type_of(text)
            .map_err(|e| fail(e.to_string()))
            .and_then(|t| {
                Family::from_model_type(t.as_deref()).ok_or_else(|| {
                    fail(format!(
                        "model_type is {:?}; picchio runs \"gpt_oss\" and \"qwen3_moe\" models",
                        t.unwrap_or_default()
                    ))
                })
            })?;
        let mut de = serde_json::Deserializer::from_str(text);
        let raw = match family {
            Family::GptOss => serde_path_to_error::deserialize::<_, RawConfig>(&mut de).map(Ok),
            Family::Qwen3Moe => serde_path_to_error::deserialize(&mut de)
                .map(|q: crate::arch::qwen3_moe::RawConfig| q.into_raw()),
        }
        .map_err(|e| fail(e.to_string()))?;
        de.end().map_err(|e| fail(e.to_string()))?;
        let raw = raw.map_err(fail)?;
        Config::from_raw(raw, family).map_err(fail)
    }

    fn from_raw(raw: RawConfig, family: Family) -> std::result::Result<Config, String> {
        let num_heads = raw.num_attention_heads;
        let num_kv_heads = raw.num_key_value_heads.unwrap_or(num_heads);
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if num_heads > 0 => raw.hidden_size / num_heads,
            None => 0,
        };
        for (name, value) in [
            ("hidden_size", raw.hidden_size),
            ("intermediate_size", raw.intermediate_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", num_heads),
            ("num_key_value_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_local_experts", raw.num_local_experts),
            ("num_experts_per_tok", raw.num_experts_per_tok),
            ("vocab_size", raw.vocab_size),
            ("max_position_embeddings", raw.max_position_embeddings),
        ] {
            if value == 0 {
                return Err(format!("{name} must be positive"));
            }
            // Far above any real model, low enough that sizes derived from it cannot overflow.
            if value > MAX_DIMENSION {
                return Err(format!(
                    "{name} ({value}) is implausibly large (limit {MAX_DIMENSION})"
                ));
            }
        }
        if !num_heads.is_multiple_of(num_kv_heads) {
            return Err(format!(
                "num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
            ));
        }
        if head_dim % 2 != 0 {
            return Err(format!(
                "head_dim ({head_dim}) must be even for rotary embeddings"
            ));
        }
        if raw.num_experts_per_tok > raw.num_local_experts {
            return Err(format!(
                "num_experts_per_tok ({}) exceeds num_local_experts ({})",
                raw.num_experts_per_tok, raw.num_local_experts
            ));
        }
        if !(raw.rms_norm_eps.is_finite() && raw.rms_norm_eps >= 0.0) {
            return Err(format!(
                "rms_norm_eps ({}) must be a finite non-negative number",
                raw.rms_norm_eps
            ));
        }
        if raw.sliding_window == Some(0) {
            return Err("sliding_window must be positive".into());
        }
        if !(raw.swiglu_limit >= 0.0 && raw.swiglu_alpha.is_finite()) {
            return Err(format!(
                "swiglu_limit ({}) must be non-negative and swiglu_alpha ({}) finite",
                raw.swiglu_limit, raw.swiglu_alpha
            ));
        }
        // transformers: layer i is sliding iff i is even, when layer_types is absent.
        let layer_types = match raw.layer_types.clone() {
            Some(types) => {
                if types.len() != raw.num_hidden_layers {
                    return Err(format!(
                        "layer_types has {} entries but num_hidden_layers is {}",
                        types.len(),
                        raw.num_hidden_layers
                    ));
                }
                types
            }
            None => (0..raw.num_hidden_layers)
                .map(|i| {
                    if i % 2 == 0 {
                        LayerType::Sliding
                    } else {
                        LayerType::Full
                    }
                })
                .collect(),
        };
        if raw.sliding_window.is_none() && layer_types.contains(&LayerType::Sliding) {
            // transformers refuses this too: a sliding layer needs a window.
            return Err(
                "sliding_window is null but layer_types has sliding_attention layers".into(),
            );
        }
        let rope = resolve_rope(&raw, head_dim, family)?;
        let eos_token_ids = TokenIds::flatten(raw.eos_token_id.clone());
        check_token_ids("eos_token_id", &eos_token_ids, raw.vocab_size)?;
        let quant_method = raw
            .quantization_config
            .as_ref()
            .and_then(|q| q.get("quant_method"))
            .and_then(|m| m.as_str())
            .map(str::to_owned);
        Ok(Config {
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_layers: raw.num_hidden_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            num_experts: raw.num_local_experts,
            experts_per_token: raw.num_experts_per_tok,
            vocab_size: raw.vocab_size,
            rms_norm_eps: raw.rms_norm_eps as f32,
            sliding_window: raw.sliding_window,
            layer_types,
            rope,
            swiglu_alpha: raw.swiglu_alpha as f32,
            swiglu_limit: raw.swiglu_limit as f32,
            eos_token_ids,
            tie_word_embeddings: raw.tie_word_embeddings,
            attention_bias: raw.attention_bias,
            max_position_embeddings: raw.max_position_embeddings,
            quant_method,
            norm_topk_prob: raw.norm_topk_prob,
            family,
        })
    }

    /// The number of keys layer `layer` attends to at most (`None` = all previous positions).
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        match self.layer_types[layer] {
            LayerType::Sliding => self.sliding_window,
            LayerType::Full => None,
        }
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// Stop tokens must be ids of the vocabulary (else generation could never stop on them).
fn check_token_ids(key: &str, ids: &[u32], vocab_size: usize) -> std::result::Result<(), String> {
    match ids.iter().find(|&&id| id as usize >= vocab_size) {
        Some(id) => Err(format!(
            "{key} {id} is beyond the vocabulary (vocab_size {vocab_size})"
        )),
        None => Ok(()),
    }
}

fn number(map: &Map<String, Value>, key: &str) -> std::result::Result<Option<f64>, String> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("rope parameter {key} is not a number: {v}")),
    }
}

/// Mirrors transformers' `convert_rope_params_to_dict` + `standardize_rope_params` +
/// `_compute_yarn_parameters` (the float64 part; the float32 part lives in `cpu::rope`).
fn resolve_rope(
    raw: &RawConfig,
    head_dim: usize,
    family: Family,
) -> std::result::Result<Rope, String> {
    // Legacy `rope_scaling` wins, then `rope_parameters`, then the family's default: GPT-OSS's
    // YaRN dict, plain RoPE for Qwen3-MoE.
    let params = match (&raw.rope_scaling, &raw.rope_parameters) {
        (Some(s), _) if !s.is_empty() => s.clone(),
        (_, Some(p)) => p.clone(),
        _ if family == Family::Qwen3Moe => Map::new(),
        _ => {
            let mut m = Map::new();
            m.insert("rope_type".into(), "yarn".into());
            m.insert("factor".into(), 32.0.into());
            m.insert("beta_fast".into(), 32.0.into());
            m.insert("beta_slow".into(), 1.0.into());
            m.insert("truncate".into(), false.into());
            m.insert("original_max_position_embeddings".into(), 4096.into());
            m
        }
    };
    let default_theta = match family {
        Family::GptOss => 150000.0,
        Family::Qwen3Moe => 10000.0,
    };
    let theta = number(&params, "rope_theta")?
        .or(raw.rope_theta)
        .unwrap_or(default_theta);
    if !(theta.is_finite() && theta > 1.0) {
        return Err(format!(
            "rope_theta ({theta}) must be a finite number above 1"
        ));
    }
    if let Some(p) = number(&params, "partial_rotary_factor")?.or(raw.partial_rotary_factor)
        && p != 1.0
    {
        return Err(format!("partial_rotary_factor {p} is not supported"));
    }
    let rope_type = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let kind = match rope_type {
        "default" => RopeKind::Default,
        "yarn" => {
            let original = match raw.original_max_position_embeddings {
                Some(o) => o,
                None => number(&params, "original_max_position_embeddings")?
                    .unwrap_or(raw.max_position_embeddings as f64),
            };
            if original.is_nan() || original <= 0.0 {
                return Err("original_max_position_embeddings must be positive".into());
            }
            let factor =
                number(&params, "factor")?.unwrap_or(raw.max_position_embeddings as f64 / original);
            // transformers divides by it: 0 or less gives infinite or negative frequencies.
            if !(factor.is_finite() && factor > 0.0) {
                return Err(format!("rope factor ({factor}) must be a positive number"));
            }
            let mscale_of = |scale: f64, mscale: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * mscale * scale.ln() + 1.0
                }
            };
            let attention_factor = match number(&params, "attention_factor")? {
                Some(a) => a,
                None => {
                    let mscale = number(&params, "mscale")?.filter(|m| *m != 0.0);
                    let mscale_all = number(&params, "mscale_all_dim")?.filter(|m| *m != 0.0);
                    match (mscale, mscale_all) {
                        (Some(m), Some(a)) => mscale_of(factor, m) / mscale_of(factor, a),
                        _ => mscale_of(factor, 1.0),
                    }
                }
            };
            if !(attention_factor.is_finite() && attention_factor > 0.0) {
                return Err(format!(
                    "rope attention_factor ({attention_factor}) must be a positive number"
                ));
            }
            // `or` in Python: 0 or absent falls back to the paper's defaults.
            let beta_fast = number(&params, "beta_fast")?
                .filter(|b| *b != 0.0)
                .unwrap_or(32.0);
            let beta_slow = number(&params, "beta_slow")?
                .filter(|b| *b != 0.0)
                .unwrap_or(1.0);
            let truncate = match params.get("truncate") {
                // `.get("truncate", True)`: absent means true, an explicit null is falsy.
                None => true,
                Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(format!("rope parameter truncate is not a bool: {v}")),
            };
            // transformers takes their logarithm (math.log raises below zero).
            if !(beta_fast.is_finite()
                && beta_slow.is_finite()
                && beta_fast > 0.0
                && beta_slow > 0.0)
            {
                return Err(format!(
                    "rope beta_fast ({beta_fast}) and beta_slow ({beta_slow}) must be positive numbers"
                ));
            }
            let dim = head_dim as f64;
            let correction_dim = |rotations: f64| {
                dim * (original / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * theta.ln())
            };
            let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            if truncate {
                low = low.floor();
                high = high.ceil();
            }
            let low = low.max(0.0);
            let high = high.min(dim - 1.0);
            RopeKind::Yarn {
                factor,
                low,
                high,
                attention_factor,
            }
        }
        other => {
            return Err(format!(
                "rope_type {other:?} is not supported (yarn or default)"
            ));
        }
    };
    Ok(Rope { theta, kind })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> std::result::Result<Config, Error> {
        Config::from_json(text, Path::new("config.json"))
    }

    #[test]
    fn real_20b_and_120b_configs_resolve() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs");
        let c20 = Config::load_file(&dir.join("gpt-oss-20b.config.json")).unwrap();
        assert_eq!(
            (c20.num_layers, c20.num_experts, c20.head_dim, c20.q_dim()),
            (24, 32, 64, 4096)
        );
        assert_eq!(c20.experts_per_token, 4);
        assert_eq!(c20.eos_token_ids, vec![200002]);
        assert_eq!(c20.layer_types[0], LayerType::Sliding);
        assert_eq!(c20.layer_types[1], LayerType::Full);
        assert_eq!(c20.window_of(0), Some(128));
        assert_eq!(c20.quant_method.as_deref(), Some("mxfp4"));
        match c20.rope.kind {
            RopeKind::Yarn {
                factor,
                low,
                high,
                attention_factor,
            } => {
                assert_eq!(factor, 32.0);
                assert!((low - 8.092779).abs() < 1e-5, "low {low}");
                assert!((high - 17.398025).abs() < 1e-5, "high {high}");
                assert!((attention_factor - 1.3465735903).abs() < 1e-9);
            }
            ref other => panic!("expected yarn, got {other:?}"),
        }
        let c120 = Config::load_file(&dir.join("gpt-oss-120b.config.json")).unwrap();
        assert_eq!((c120.num_layers, c120.num_experts), (36, 128));
    }

    #[test]
    fn defaults_follow_transformers() {
        let c = parse(
            r#"{"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 3,
            "num_local_experts": 4, "num_experts_per_tok": 2, "vocab_size": 10,
            "intermediate_size": 32, "rope_theta": 10000, "head_dim": null,
            "num_key_value_heads": null}"#,
        )
        .unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.num_kv_heads, 4);
        let absent = parse(r#"{"num_attention_heads": 16}"#).unwrap();
        assert_eq!(
            (absent.head_dim, absent.num_kv_heads, absent.sliding_window),
            (64, 8, Some(128))
        );
        assert_eq!(
            c.layer_types,
            vec![LayerType::Sliding, LayerType::Full, LayerType::Sliding]
        );
        assert_eq!(c.rope.theta, 10000.0);
        assert!(matches!(c.rope.kind, RopeKind::Yarn { .. }));
        assert_eq!(c.swiglu_alpha, 1.702);
        assert_eq!(c.swiglu_limit, 7.0);
    }

    #[test]
    fn transformers5_rope_parameters_and_truncate_default() {
        let c = parse(
            r#"{"head_dim": 64, "rope_parameters": {"rope_type": "yarn", "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
            "rope_theta": 150000}}"#,
        )
        .unwrap();
        // truncate absent means true in transformers: floor/ceil of the correction range.
        match c.rope.kind {
            RopeKind::Yarn { low, high, .. } => assert_eq!((low, high), (8.0, 18.0)),
            ref other => panic!("{other:?}"),
        }
        // An explicit null is falsy to transformers: no truncation.
        let c = parse(
            r#"{"rope_scaling": {"rope_type": "yarn", "factor": 32.0, "truncate": null,
            "original_max_position_embeddings": 4096}}"#,
        )
        .unwrap();
        match c.rope.kind {
            RopeKind::Yarn { low, .. } => assert!((low - 8.092779).abs() < 1e-5),
            ref other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_configs_are_rejected_with_reasons() {
        let cases = [
            ("{", "EOF"),
            (r#"{"hidden_size": "big"}"#, "hidden_size"),
            (
                r#"{"num_attention_heads": 6, "num_key_value_heads": 4}"#,
                "multiple",
            ),
            (
                r#"{"num_hidden_layers": 2, "layer_types": ["full_attention"]}"#,
                "layer_types",
            ),
            (r#"{"layer_types": ["global"]}"#, "global"),
            (r#"{"model_type": "llama"}"#, "llama"),
            (r#"{"rope_scaling": {"rope_type": "longrope"}}"#, "longrope"),
            (r#"{"num_experts_per_tok": 200}"#, "exceeds"),
            (r#"{"hidden_size": 0}"#, "hidden_size must be positive"),
            (r#"{"head_dim": 15}"#, "even"),
            (r#"{"sliding_window": 0}"#, "sliding_window"),
            (r#"{"sliding_window": null}"#, "sliding_window is null"),
            (r#"{"swiglu_limit": -1}"#, "swiglu_limit"),
            (
                r#"{"num_hidden_layers": 1000000000000000}"#,
                "implausibly large",
            ),
            (r#"{"partial_rotary_factor": 0.5}"#, "partial_rotary_factor"),
            (
                r#"{"rope_scaling": {"rope_type": "yarn", "truncate": 3}}"#,
                "truncate",
            ),
        ];
        for (text, needle) in cases {
            let msg = parse(text).unwrap_err().to_string();
            assert!(msg.contains(needle), "{text}: {msg}");
            assert!(msg.contains("config.json"), "{msg}");
        }
    }
}
