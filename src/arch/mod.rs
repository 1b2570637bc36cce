//! Model families as data: what each decoder layer of a family computes, read from its
//! config.json. The decoder layer itself (`model::block`) is written once and reads these specs;
//! the tiers execute its ops. A second family is a second description here, not a second
//! forward pass.

pub mod gpt_oss;

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
}

/// How a router turns its logits into experts and weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gating {
    /// The k largest logits (ties to the lower id), then a softmax over those k (GPT-OSS).
    TopKThenSoftmax,
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
}

/// The experts of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertSpec {
    pub hidden: usize,
    pub intermediate: usize,
    pub activation: Activation,
}

/// The model families picchio runs, by config.json's `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    GptOss,
}

impl Family {
    /// The family of a loaded config (`Config` accepts only the families listed here).
    pub fn of(_config: &Config) -> Family {
        Family::GptOss
    }

    /// Every decoder layer's spec, in order.
    pub fn layers(self, config: &Config) -> Vec<LayerSpec> {
        match self {
            Family::GptOss => (0..config.num_layers)
                .map(|l| gpt_oss::layer(config, l))
                .collect(),
        }
    }
}
