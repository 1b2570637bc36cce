//! GPT-OSS (`model_type: gpt_oss`): attention with learned sinks, sliding-window layers where
//! `layer_types` says so, biased q/k/v/o and router, top-k-then-softmax routing and the clamped,
//! interleaved SwiGLU experts (../shared/SEMANTICS.md).

use super::{Activation, AttentionSpec, ExpertSpec, Gating, LayerSpec, RouterSpec};
use crate::config::Config;

/// Layer `l` of a GPT-OSS model.
pub fn layer(config: &Config, l: usize) -> LayerSpec {
    LayerSpec {
        attention: AttentionSpec {
            heads: config.num_heads,
            kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            window: config.window_of(l),
            scaling: (config.head_dim as f64).powf(-0.5) as f32,
        },
        router: RouterSpec {
            experts: config.num_experts,
            top_k: config.experts_per_token,
            gating: Gating::TopKThenSoftmax,
        },
        experts: ExpertSpec {
            hidden: config.hidden_size,
            intermediate: config.intermediate_size,
            activation: Activation::ClampedSwiglu {
                alpha: config.swiglu_alpha,
                limit: config.swiglu_limit,
            },
        },
    }
}
