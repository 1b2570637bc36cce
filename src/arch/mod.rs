//! Model families as data: what each decoder layer of a family computes, read from its
//! config.json. The decoder layer itself (`model::block`) is written once and reads these specs;
//! the tiers execute its ops. A second family is a second description here, not a second
//! forward pass.

pub mod gpt_oss;
pub mod qwen3_moe;

use crate::config::Config;

/// What one decoder layer computes, as plain data.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpec {
    pub attention: AttentionSpec,
    pub router: RouterSpec,
    pub experts: ExpertSpec,
}

/// Self-attention of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionSpec {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys a query sees, its own included (`None`: every earlier position).
    pub window: Option<usize>,
    /// Factor on every query-key product before the softmax.
    pub scaling: f32,
    /// An RMSNorm over each head of the queries and of the keys before the rotary embedding
    /// (Qwen3's `q_norm`/`k_norm`).
    pub head_norms: bool,
}

impl AttentionSpec {
    /// Layer `l`'s attention as `config` gives it: GQA heads, its window, `1/sqrt(head_dim)`.
    pub fn of(config: &Config, l: usize, head_norms: bool) -> AttentionSpec {
        AttentionSpec {
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            window: config.window_of(l),
            scaling: (config.head_dim as f64).powf(-0.5) as f32,
            head_norms,
        }
    }
}

/// How a router turns its logits into experts and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// The k largest logits (ties to the lower id), then a softmax over those k (GPT-OSS).
    TopKThenSoftmax,
    /// A softmax over every expert, then the k largest probabilities (ties to the lower id),
    /// divided by their sum where `renormalize` (Qwen3-MoE's `norm_topk_prob`).
    SoftmaxThenTopK { renormalize: bool },
}

/// The router of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSpec {
    pub experts: usize,
    pub top_k: usize,
    pub gating: Gating,
}

/// The activation between an expert's gate/up and down projections.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    /// GPT-OSS: gate and up interleaved by rows, both clamped at `limit` (gate from above only),
    /// `(up + 1) * gate * sigmoid(alpha * gate)`.
    ClampedSwiglu { alpha: f32, limit: f32 },
    /// Qwen3-MoE: gate rows first, up rows second, `silu(gate) * up` with no clamp.
    Swiglu,
}

/// The experts of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertSpec {
    pub hidden: usize,
    pub intermediate: usize,
    pub activation: Activation,
}

/// The model families picchio runs, by config.json's `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum Family {
    #[serde(rename = "gpt_oss")]
    GptOss,
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
}

impl Family {
    /// The family of a config.json's `model_type` (an absent one means GPT-OSS, which the first
    /// checkpoints picchio read left out).
    pub fn from_model_type(model_type: Option<&str>) -> Option<Family> {
        match model_type {
            None | Some("gpt_oss") => Some(Family::GptOss),
            Some("qwen3_moe") => Some(Family::Qwen3Moe),
            Some(_) => None,
        }
    }

    /// config.json's `model_type` of the family.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::GptOss => "gpt_oss",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Whether the checkpoint tensor `name` is an expert weight (what `convert` writes as expert
    /// records rather than copying with the dense tensors).
    pub fn is_expert_weight(self, name: &str) -> bool {
        match self {
            Family::GptOss => gpt_oss::is_expert_weight(name),
            Family::Qwen3Moe => qwen3_moe::is_expert_weight(name),
        }
    }

    /// Every decoder layer's spec, in order.
    pub fn layers(self, config: &Config) -> Vec<LayerSpec> {
        let layer = match self {
            Family::GptOss => gpt_oss::layer,
            Family::Qwen3Moe => qwen3_moe::layer,
        };
        (0..config.num_layers).map(|l| layer(config, l)).collect()
    }
}
