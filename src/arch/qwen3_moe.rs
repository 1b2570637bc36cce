//! Qwen3-MoE (`model_type: qwen3_moe`): full attention (or a window on every layer where
//! `use_sliding_window` says so) with an RMSNorm over each query and key head before plain RoPE,
//! no sinks and no biases, a softmax-then-top-k router and bf16 experts with a plain SwiGLU
//! (../shared/SEMANTICS_QWEN3MOE.md).

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{Activation, AttentionSpec, ExpertSpec, Gating, LayerSpec, RouterSpec};
use crate::config::{Config, LayerType, TokenIds};
use crate::error::{Error, Result};
use crate::weights::{
    Checkpoint, ExpertMatrices, FloatFormat, LayerExperts, LayerWeights, RowExperts, TensorBytes,
    shared_layer,
};

/// Layer `l` of a Qwen3-MoE model.
pub fn layer(config: &Config, l: usize) -> LayerSpec {
    LayerSpec {
        attention: AttentionSpec::of(config, l, true),
        router: RouterSpec {
            experts: config.num_experts,
            top_k: config.experts_per_token,
            gating: Gating::SoftmaxThenTopK {
                renormalize: config.norm_topk_prob,
            },
        },
        experts: ExpertSpec {
            hidden: config.hidden_size,
            intermediate: config.intermediate_size,
            activation: Activation::Swiglu,
        },
    }
}

/// A Qwen3-MoE `config.json`, with transformers' `Qwen3MoeConfig` defaults for absent keys. Both
/// spellings are read: the hub's (transformers 4.51: `num_experts`, `rope_theta`) and what
/// transformers 5 writes (`num_local_experts`, `rope_parameters`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct RawConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub hidden_act: String,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub rope_parameters: Option<Map<String, Value>>,
    pub rope_scaling: Option<Map<String, Value>>,
    pub rope_theta: Option<f64>,
    pub attention_bias: bool,
    pub use_sliding_window: bool,
    pub sliding_window: Option<usize>,
    pub decoder_sparse_step: usize,
    pub moe_intermediate_size: usize,
    pub num_experts_per_tok: usize,
    pub num_experts: Option<usize>,
    pub num_local_experts: Option<usize>,
    pub norm_topk_prob: bool,
    pub mlp_only_layers: Option<Vec<usize>>,
    pub eos_token_id: Option<TokenIds>,
    pub pad_token_id: Option<u32>,
    pub quantization_config: Option<Value>,
}

impl Default for RawConfig {
    fn default() -> Self {
        RawConfig {
            vocab_size: 151936,
            hidden_size: 2048,
            num_hidden_layers: 24,
            num_attention_heads: 32,
            num_key_value_heads: Some(4),
            head_dim: None,
            hidden_act: "silu".into(),
            max_position_embeddings: 32768,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            rope_parameters: None,
            rope_scaling: None,
            rope_theta: None,
            attention_bias: false,
            use_sliding_window: false,
            sliding_window: Some(4096),
            decoder_sparse_step: 1,
            moe_intermediate_size: 768,
            num_experts_per_tok: 8,
            num_experts: None,
            num_local_experts: None,
            norm_topk_prob: false,
            mlp_only_layers: None,
            eos_token_id: None,
            pad_token_id: None,
            quantization_config: None,
        }
    }
}

impl RawConfig {
    /// The shared raw config, or why picchio cannot run this one: a dense-MLP layer, an
    /// activation other than SiLU, a quantized checkpoint.
    pub fn into_raw(self) -> std::result::Result<crate::config::RawConfig, String> {
        if self.hidden_act != "silu" {
            return Err(format!(
                "hidden_act is {:?}; Qwen3-MoE experts use \"silu\"",
                self.hidden_act
            ));
        }
        if let Some(method) = self
            .quantization_config
            .as_ref()
            .map(|q| q.get("quant_method").and_then(Value::as_str).unwrap_or("?"))
        {
            return Err(format!(
                "quantization_config.quant_method {method:?}: picchio reads Qwen3-MoE checkpoints in bf16, f16 or f32"
            ));
        }
        let experts = self.num_experts.or(self.num_local_experts).unwrap_or(128);
        if self.decoder_sparse_step == 0 {
            return Err("decoder_sparse_step must be positive".into());
        }
        let mlp_only = self.mlp_only_layers.unwrap_or_default();
        let dense: Vec<usize> = (0..self.num_hidden_layers)
            .filter(|l| {
                mlp_only.contains(l) || experts == 0 || (l + 1) % self.decoder_sparse_step != 0
            })
            .collect();
        if !dense.is_empty() {
            return Err(format!(
                "layers {dense:?} are dense MLP layers (mlp_only_layers, decoder_sparse_step); picchio runs Qwen3-MoE models whose every layer is a mixture of experts"
            ));
        }
        // transformers drops the window unless `use_sliding_window`, and then every layer
        // slides (`max_window_layers` is not read by its Qwen3-MoE code).
        let window = self.sliding_window.filter(|_| self.use_sliding_window);
        let layer_type = match window {
            Some(_) => LayerType::Sliding,
            None => LayerType::Full,
        };
        if self.use_sliding_window && window.is_none() {
            return Err("use_sliding_window is true but sliding_window is null".into());
        }
        Ok(crate::config::RawConfig {
            model_type: Some("qwen3_moe".into()),
            num_hidden_layers: self.num_hidden_layers,
            num_local_experts: experts,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.moe_intermediate_size,
            head_dim: self.head_dim,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            sliding_window: window,
            tie_word_embeddings: self.tie_word_embeddings,
            max_position_embeddings: self.max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps,
            rope_parameters: self.rope_parameters,
            rope_scaling: self.rope_scaling,
            rope_theta: self.rope_theta,
            num_experts_per_tok: self.num_experts_per_tok,
            layer_types: Some(vec![layer_type; self.num_hidden_layers]),
            pad_token_id: self.pad_token_id,
            eos_token_id: self.eos_token_id,
            attention_bias: self.attention_bias,
            norm_topk_prob: self.norm_topk_prob,
            ..Default::default()
        })
    }
}

/// The tensor names of decoder layer `l` beyond GPT-OSS's attention names
/// (`gpt_oss::layer_tensors` gives the norms and q/k/v/o, which the families share).
struct QwenTensors {
    q_norm: String,
    k_norm: String,
    router: String,
    /// The fused layout's `[E, 2I, H]` (gate rows, then up rows) and `[E, H, I]`.
    fused_gate_up: String,
    fused_down: String,
}

fn qwen_tensors(l: usize) -> QwenTensors {
    let layer = format!("model.layers.{l}");
    QwenTensors {
        q_norm: format!("{layer}.self_attn.q_norm.weight"),
        k_norm: format!("{layer}.self_attn.k_norm.weight"),
        router: format!("{layer}.mlp.gate.weight"),
        fused_gate_up: format!("{layer}.mlp.experts.gate_up_proj"),
        fused_down: format!("{layer}.mlp.experts.down_proj"),
    }
}

/// Whether `name` is an expert weight in either layout: the hub's
/// `mlp.experts.{e}.{gate,up,down}_proj.weight` or the fused `mlp.experts.{gate_up,down}_proj`.
pub fn is_expert_weight(name: &str) -> bool {
    let Some(rest) = name.split(".mlp.experts.").nth(1) else {
        return false;
    };
    if matches!(rest, "gate_up_proj" | "down_proj") {
        return true;
    }
    let Some((expert, projection)) = rest.split_once('.') else {
        return false;
    };
    expert.bytes().all(|b| b.is_ascii_digit())
        && !expert.is_empty()
        && matches!(
            projection,
            "gate_proj.weight" | "up_proj.weight" | "down_proj.weight"
        )
}

/// Expert `e`'s projection `name` (`gate_proj`, `up_proj`, `down_proj`) in the hub's layout.
fn expert_tensor(l: usize, e: usize, name: &str) -> String {
    format!("model.layers.{l}.mlp.experts.{e}.{name}.weight")
}

/// Layer `l`'s experts, `(gate_up, down)`: from the hub's per-expert tensors, or from the fused
/// `[E, ...]` tensors where the checkpoint has those.
fn layer_experts(ck: &Checkpoint, cfg: &Config, l: usize) -> Result<(RowExperts, RowExperts)> {
    let (h, i, experts) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    let names = qwen_tensors(l);
    if ck.get(&names.fused_gate_up).is_some() {
        let fused = |name: &str, rows: usize, cols: usize| -> Result<RowExperts> {
            let entry = ck.require(name, &FloatFormat::DTYPES, &[experts, rows, cols])?;
            let (format, data) = (FloatFormat::of(entry.dtype), ck.bytes_of(entry));
            let bytes = rows * cols * format.size();
            let blocks = (0..experts)
                .map(|e| vec![data.slice(e * bytes..(e + 1) * bytes)])
                .collect();
            Ok(RowExperts::new((rows, cols), format, blocks))
        };
        return Ok((
            fused(&names.fused_gate_up, 2 * i, h)?,
            fused(&names.fused_down, h, i)?,
        ));
    }
    let mut gate_up = Vec::with_capacity(experts);
    let mut down = Vec::with_capacity(experts);
    let mut format = None;
    for e in 0..experts {
        let gate = ck.dense_matrix(&expert_tensor(l, e, "gate_proj"), i, h)?;
        let up = ck.dense_matrix(&expert_tensor(l, e, "up_proj"), i, h)?;
        let down_proj = ck.dense_matrix(&expert_tensor(l, e, "down_proj"), h, i)?;
        // Every expert in one format, so that a tier reads them all with one kernel.
        for m in [&gate, &up, &down_proj] {
            if *format.get_or_insert(m.format) != m.format {
                return Err(Error::Unsupported(format!(
                    "layer {l}: experts stored in both {:?} and {:?}",
                    format.unwrap(),
                    m.format
                )));
            }
        }
        gate_up.push(join_rows(gate.data, up.data));
        down.push(vec![down_proj.data]);
    }
    let format = format.unwrap_or(FloatFormat::Bf16);
    Ok((
        RowExperts::new((2 * i, h), format, gate_up),
        RowExperts::new((h, i), format, down),
    ))
}

/// Gate rows then up rows: one view where the checkpoint wrote them back to back (as
/// safetensors' name order does), else the two.
fn join_rows(gate: TensorBytes, up: TensorBytes) -> Vec<TensorBytes> {
    match gate.joined(&up) {
        Some(both) => vec![both],
        None => vec![gate, up],
    }
}

/// Every weight of layer `l` of a Qwen3-MoE checkpoint (the experts from `converted` where a
/// converted store gives them).
pub fn load_layer(
    ck: &Checkpoint,
    cfg: &Config,
    l: usize,
    converted: Option<LayerExperts>,
) -> Result<LayerWeights> {
    let qwen = qwen_tensors(l);
    let experts = match converted {
        Some(experts) => experts,
        None => {
            let (gate_up, down) = layer_experts(ck, cfg, l)?;
            LayerExperts {
                gate_up: ExpertMatrices::Rows(gate_up),
                down: ExpertMatrices::Rows(down),
            }
        }
    };
    let d = cfg.head_dim;
    Ok(LayerWeights {
        q_norm: Some(ck.float_vector(&qwen.q_norm, &[d])?),
        k_norm: Some(ck.float_vector(&qwen.k_norm, &[d])?),
        ..shared_layer(ck, cfg, l, &qwen.router, experts)?
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn expert_weights_are_told_from_the_dense_tensors_in_both_layouts() {
        for name in [
            expert_tensor(3, 17, "gate_proj"),
            expert_tensor(0, 0, "up_proj"),
            expert_tensor(47, 127, "down_proj"),
            qwen_tensors(5).fused_gate_up,
            qwen_tensors(5).fused_down,
        ] {
            assert!(is_expert_weight(&name), "{name}");
        }
        for name in [
            qwen_tensors(5).router,
            qwen_tensors(5).q_norm,
            "model.layers.1.mlp.experts.x.gate_proj.weight".to_string(),
            "model.layers.1.mlp.experts.2.gate_proj.bias".to_string(),
            "model.embed_tokens.weight".to_string(),
        ] {
            assert!(!is_expert_weight(&name), "{name}");
        }
    }

    fn parse(text: &str) -> Result<Config> {
        Config::from_json(text, Path::new("config.json"))
    }

    #[test]
    fn real_30b_and_235b_configs_resolve() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs");
        let c = Config::load_file(&dir.join("qwen3-30b-a3b.config.json")).unwrap();
        assert_eq!(c.family, super::super::Family::Qwen3Moe);
        assert_eq!(
            (c.num_layers, c.num_experts, c.experts_per_token),
            (48, 128, 8)
        );
        assert_eq!((c.hidden_size, c.q_dim(), c.kv_dim()), (2048, 4096, 512));
        assert_eq!(c.intermediate_size, 768);
        assert_eq!(c.rope.theta, 10_000_000.0);
        assert_eq!(c.rope.kind, crate::config::RopeKind::Default);
        assert!(c.norm_topk_prob && !c.attention_bias && !c.tie_word_embeddings);
        assert!((0..48).all(|l| c.window_of(l).is_none()));
        assert_eq!(c.eos_token_ids, vec![151645]);
        let big = Config::load_file(&dir.join("qwen3-235b-a22b.config.json")).unwrap();
        assert_eq!(
            (big.num_layers, big.hidden_size, big.q_dim()),
            (94, 4096, 8192)
        );
    }

    #[test]
    fn both_spellings_and_the_window_switch() {
        let t5 = parse(
            r#"{"model_type": "qwen3_moe", "num_local_experts": 6, "num_experts_per_tok": 2,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
            "use_sliding_window": true, "sliding_window": 8}"#,
        )
        .unwrap();
        assert_eq!((t5.num_experts, t5.rope.theta), (6, 1_000_000.0));
        assert_eq!((t5.window_of(0), t5.window_of(1)), (Some(8), Some(8)));
        assert_eq!((t5.head_dim, t5.num_kv_heads), (16, 4));
        let off = parse(r#"{"model_type": "qwen3_moe", "sliding_window": 8}"#).unwrap();
        assert_eq!(
            off.window_of(0),
            None,
            "the window needs use_sliding_window"
        );
        assert_eq!(off.rope.theta, 10000.0);
        assert!(!off.norm_topk_prob, "transformers' default");
    }

    #[test]
    fn what_picchio_cannot_run_is_refused_by_name() {
        for (text, needle) in [
            (
                r#"{"model_type": "qwen3_moe", "mlp_only_layers": [1]}"#,
                "dense MLP",
            ),
            (
                r#"{"model_type": "qwen3_moe", "decoder_sparse_step": 2}"#,
                "[0, 2,",
            ),
            (
                r#"{"model_type": "qwen3_moe", "hidden_act": "gelu"}"#,
                "gelu",
            ),
            (
                r#"{"model_type": "qwen3_moe", "quantization_config": {"quant_method": "fp8"}}"#,
                "fp8",
            ),
            (
                r#"{"model_type": "qwen3_moe", "use_sliding_window": true, "sliding_window": null}"#,
                "sliding_window is null",
            ),
        ] {
            let msg = parse(text).unwrap_err().to_string();
            assert!(msg.contains(needle), "{text}: {msg}");
        }
    }
}
