//! GPT-OSS (`model_type: gpt_oss`): attention with learned sinks, sliding-window layers where
//! `layer_types` says so, biased q/k/v/o and router, top-k-then-softmax routing and the clamped,
//! interleaved SwiGLU experts (../shared/SEMANTICS.md).

use super::{Activation, AttentionSpec, ExpertSpec, Gating, LayerSpec, RouterSpec};
use crate::config::Config;

/// Layer `l` of a GPT-OSS model.
pub fn layer(config: &Config, l: usize) -> LayerSpec {
    LayerSpec {
        attention: AttentionSpec::of(config, l, false),
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

/// Where a Hugging Face GPT-OSS checkpoint keeps the token embeddings, `[vocab, hidden]`.
pub const EMBEDDINGS: &str = "model.embed_tokens.weight";
/// The LM head, `[vocab, hidden]` (absent where `tie_word_embeddings` shares the embeddings).
pub const LM_HEAD: &str = "lm_head.weight";
/// The final RMSNorm's weights, `[hidden]`.
pub const FINAL_NORM: &str = "model.norm.weight";

/// The tensor names of one decoder layer. The experts' names are prefixes: MXFP4 experts as
/// published are `{prefix}_blocks` and `{prefix}_scales`, unquantized ones `{prefix}` itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerTensors {
    pub input_norm: String,
    pub post_attention_norm: String,
    pub q: String,
    pub k: String,
    pub v: String,
    pub o: String,
    pub q_bias: String,
    pub k_bias: String,
    pub v_bias: String,
    pub o_bias: String,
    pub sinks: String,
    pub router: String,
    pub router_bias: String,
    pub gate_up: String,
    pub gate_up_bias: String,
    pub down: String,
    pub down_bias: String,
}

/// The tensor names of decoder layer `l`.
pub fn layer_tensors(l: usize) -> LayerTensors {
    let layer = format!("model.layers.{l}");
    let attention = |name: &str| format!("{layer}.self_attn.{name}");
    let mlp = |name: &str| format!("{layer}.mlp.{name}");
    LayerTensors {
        input_norm: format!("{layer}.input_layernorm.weight"),
        post_attention_norm: format!("{layer}.post_attention_layernorm.weight"),
        q: attention("q_proj.weight"),
        k: attention("k_proj.weight"),
        v: attention("v_proj.weight"),
        o: attention("o_proj.weight"),
        q_bias: attention("q_proj.bias"),
        k_bias: attention("k_proj.bias"),
        v_bias: attention("v_proj.bias"),
        o_bias: attention("o_proj.bias"),
        sinks: attention("sinks"),
        router: mlp("router.weight"),
        router_bias: mlp("router.bias"),
        gate_up: mlp("experts.gate_up_proj"),
        gate_up_bias: mlp("experts.gate_up_proj_bias"),
        down: mlp("experts.down_proj"),
        down_bias: mlp("experts.down_proj_bias"),
    }
}

/// What a tensor of a GPT-OSS checkpoint is, by its name.
pub fn tensor_role(name: &str) -> crate::weights::TensorRole {
    use crate::weights::TensorRole;
    if name == EMBEDDINGS {
        TensorRole::Embedding
    } else if name == LM_HEAD {
        TensorRole::LmHead
    } else if name.contains(".mlp.experts.") {
        TensorRole::Expert
    } else if name.starts_with("model.layers.") || name == FINAL_NORM {
        TensorRole::Dense
    } else {
        TensorRole::Unknown
    }
}

/// Whether `name` holds expert weights (not their biases): what a converted store's records
/// take.
pub fn is_expert_weight(name: &str) -> bool {
    let Some(rest) = name.split(".mlp.experts.").nth(1) else {
        return false;
    };
    let projection = rest
        .strip_suffix("_blocks")
        .or_else(|| rest.strip_suffix("_scales"))
        .unwrap_or(rest);
    matches!(projection, "gate_up_proj" | "down_proj")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_weights_are_told_from_their_biases() {
        let names = layer_tensors(3);
        assert_eq!(names.gate_up, "model.layers.3.mlp.experts.gate_up_proj");
        for expert in [&names.gate_up, &names.down] {
            assert!(is_expert_weight(expert));
            assert!(is_expert_weight(&format!("{expert}_blocks")));
            assert!(is_expert_weight(&format!("{expert}_scales")));
        }
        assert!(!is_expert_weight(&names.gate_up_bias));
        assert!(!is_expert_weight(&names.router));
        assert!(!is_expert_weight(
            "model.layers.3.mlp.experts.gate_up_proj_blocks_x"
        ));
    }
}
