"""Tiny random Qwen3-MoE checkpoints in the hub's layout and what transformers computes on them
(the Qwen3-MoE half of tools/make_fixtures.py; see ../shared/SEMANTICS_QWEN3MOE.md).

Each checkpoint is written first, then loaded back with `from_pretrained`, so transformers' own
loader (its per-expert -> fused WeightConverter) interprets the layout; the script checks that
the experts it loaded are the ones written.
"""

import json
import math
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import Qwen3MoeForCausalLM

import qwen3_chat_fixture as chat
from fixture_common import bf16, greedy, layer_checkpoints, save_checkpoint

# Each spec varies what a loader or a kernel could get wrong: head_dim vs hidden, expert count
# and top-k, norm_topk_prob, the config's spelling (4.51 hub vs transformers 5), shards, the
# fused layout, the sliding window, attention biases, tied embeddings, EOS form.
FIXTURES = [
    dict(
        name="tiny-qwen3-single",
        seed=11,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # NH * D = 128 != hidden 64, as in the real models (4096 vs 2048)
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=256,
        norm_topk_prob=True,
        rope_theta=1000000.0,
        eos_token_id=2,
        spelling="hub",
        layout="per_expert",
        shards=1,
        prompt_len=12,
    ),
    dict(
        name="tiny-qwen3-sharded",
        seed=12,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,  # NH * D = 96 == hidden
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=48,
        vocab_size=384,
        norm_topk_prob=False,  # raw softmax probabilities of the top k (sum < 1)
        rope_theta=10000000.0,
        eos_token_id=[1, 3],
        spelling="transformers5",
        layout="per_expert",
        shards=3,  # 1-based names; a layer's experts straddle two files
        prompt_len=20,
    ),
    dict(
        name="tiny-qwen3-routed",
        seed=13,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=64,  # top 8 of 64: the real models' k, half their expert count
        num_experts_per_tok=8,
        moe_intermediate_size=32,
        vocab_size=256,
        norm_topk_prob=True,
        rope_theta=10000000.0,
        eos_token_id=2,
        spelling="hub",
        layout="per_expert",
        shards=1,
        prompt_len=24,
    ),
    dict(
        name="tiny-qwen3-fused",
        seed=14,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,  # NH * D = 128 > hidden 64
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        vocab_size=200,
        norm_topk_prob=False,
        rope_theta=1000000.0,
        eos_token_id=[5, 6],
        spelling="transformers5",
        layout="fused",  # gate_up_proj [E, 2I, H] and down_proj [E, H, I], no .weight
        shards=2,
        prompt_len=30,
        use_sliding_window=True,  # then every layer slides (max_window_layers is not read)
        sliding_window=8,
        attention_bias=True,
        tie_word_embeddings=True,
    ),
]


# A checkpoint that chats: tools/qwen3_chat_fixture.py's tokenizer and template (its vocabulary
# size and stop ids replace the spec's).
FIXTURES.append(
    dict(
        name="tiny-qwen3-chat",
        seed=15,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        vocab_size=512,
        norm_topk_prob=True,
        rope_theta=10000000.0,
        eos_token_id=None,
        spelling="hub",
        layout="per_expert",
        shards=1,
        prompt_len=16,
        chat=True,
    )
)


def random_spec(index, seed):
    """A random tiny Qwen3-MoE shape, for checking picchio on checkpoints its tests never saw."""
    r = np.random.default_rng([seed, 1000 + index])
    heads = int(r.choice([1, 2, 3, 4, 6, 8]))
    kv = int(r.choice([d for d in range(1, heads + 1) if heads % d == 0]))
    experts = int(r.integers(1, 40))
    window = bool(r.random() < 0.25)
    return dict(
        name=f"random-qwen3-{seed}-{index}",
        seed=int(r.integers(1 << 30)),
        hidden_size=int(r.choice([32, 64, 96, 128])),
        num_hidden_layers=int(r.integers(1, 5)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=int(r.choice([8, 16, 32, 64])),
        num_experts=experts,
        num_experts_per_tok=int(r.integers(1, min(experts, 8) + 1)),
        moe_intermediate_size=int(r.choice([16, 32, 48, 64])),
        vocab_size=int(r.integers(50, 700)),
        norm_topk_prob=bool(r.random() < 0.6),
        rope_theta=float(r.choice([10000.0, 1000000.0, 10000000.0])),
        eos_token_id=[None, int(r.integers(0, 50)), [int(r.integers(0, 50)), int(r.integers(0, 50))]][
            int(r.integers(0, 3))
        ],
        spelling=str(r.choice(["hub", "transformers5"])),
        layout=str(r.choice(["per_expert", "per_expert", "fused"])),
        shards=int(r.integers(1, 4)),
        prompt_len=int(r.integers(1, 100)),
        use_sliding_window=window,
        # Not 1: transformers' sliding cache keeps `[-W + 1:]` keys, every key at W = 1, so its
        # cached generation there differs from its own uncached forward pass (and from picchio).
        sliding_window=int(r.integers(2, 33)) if window else None,
        attention_bias=bool(r.random() < 0.2),
        tie_word_embeddings=bool(r.random() < 0.2),
    )


def make_config(spec):
    layers = spec["num_hidden_layers"]
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": spec.get("attention_bias", False),
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "decoder_sparse_step": 1,
        "eos_token_id": spec["eos_token_id"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": 4 * spec["hidden_size"],  # dense-MLP width: unused, every layer is MoE
        "max_position_embeddings": 262144,
        "max_window_layers": layers,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": spec["moe_intermediate_size"],
        "norm_topk_prob": spec["norm_topk_prob"],
        "num_attention_heads": spec["num_attention_heads"],
        "num_experts": spec["num_experts"],
        "num_experts_per_tok": spec["num_experts_per_tok"],
        "num_hidden_layers": layers,
        "num_key_value_heads": spec["num_key_value_heads"],
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": spec["rope_theta"],
        "router_aux_loss_coef": 0.001,
        "sliding_window": spec.get("sliding_window"),
        "tie_word_embeddings": spec.get("tie_word_embeddings", False),
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": spec.get("use_sliding_window", False),
        "vocab_size": spec["vocab_size"],
    }
    if spec["eos_token_id"] is None:
        del config["eos_token_id"]
    if spec["spelling"] == "transformers5":
        # What transformers 5 writes when it re-saves a config (SEMANTICS_QWEN3MOE.md §1).
        config["num_local_experts"] = config.pop("num_experts")
        config["rope_parameters"] = {"rope_theta": config.pop("rope_theta"), "rope_type": "default"}
        del config["rope_scaling"]
        config["dtype"] = config.pop("torch_dtype")
        config["pad_token_id"] = None
        config["transformers_version"] = transformers.__version__
    return config


def make_tensors(spec, rng):
    """Per-expert hub names (`fuse_experts` makes the fused layout)."""
    h, i = spec["hidden_size"], spec["moe_intermediate_size"]
    nh, kv, d = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    e, v = spec["num_experts"], spec["vocab_size"]
    # Tied embeddings are also the LM head: smaller, so the logits do not just echo the input.
    t = {"model.embed_tokens.weight": bf16(rng, (v, h), 0.1 if spec.get("tie_word_embeddings") else 1.0)}
    for l in range(spec["num_hidden_layers"]):
        p = f"model.layers.{l}"
        t[f"{p}.input_layernorm.weight"] = bf16(rng, (h,), 0.1, 1.0)
        t[f"{p}.post_attention_layernorm.weight"] = bf16(rng, (h,), 0.1, 1.0)
        t[f"{p}.self_attn.q_proj.weight"] = bf16(rng, (nh * d, h), 1.0 / math.sqrt(h))
        t[f"{p}.self_attn.k_proj.weight"] = bf16(rng, (kv * d, h), 1.0 / math.sqrt(h))
        t[f"{p}.self_attn.v_proj.weight"] = bf16(rng, (kv * d, h), 1.0 / math.sqrt(h))
        t[f"{p}.self_attn.o_proj.weight"] = bf16(rng, (h, nh * d), 1.0 / math.sqrt(nh * d))
        if spec.get("attention_bias"):
            t[f"{p}.self_attn.q_proj.bias"] = bf16(rng, (nh * d,), 0.2)
            t[f"{p}.self_attn.k_proj.bias"] = bf16(rng, (kv * d,), 0.2)
            t[f"{p}.self_attn.v_proj.bias"] = bf16(rng, (kv * d,), 0.1)
            t[f"{p}.self_attn.o_proj.bias"] = bf16(rng, (h,), 0.1)
        # The per-head norms scale q.k: weights around 1.5 give attention logits of a few units.
        t[f"{p}.self_attn.q_norm.weight"] = bf16(rng, (d,), 0.3, 1.5)
        t[f"{p}.self_attn.k_norm.weight"] = bf16(rng, (d,), 0.3, 1.5)
        # Router logits with a spread of a few units: uneven routing, distinct top-k.
        t[f"{p}.mlp.gate.weight"] = bf16(rng, (e, h), 2.0 / math.sqrt(h))
        for x in range(e):
            q = f"{p}.mlp.experts.{x}"
            t[f"{q}.gate_proj.weight"] = bf16(rng, (i, h), 1.5 / math.sqrt(h))
            t[f"{q}.up_proj.weight"] = bf16(rng, (i, h), 1.5 / math.sqrt(h))
            t[f"{q}.down_proj.weight"] = bf16(rng, (h, i), 0.5 / math.sqrt(i))
    t["model.norm.weight"] = bf16(rng, (h,), 0.1, 1.0)
    if not spec.get("tie_word_embeddings"):
        t["lm_head.weight"] = bf16(rng, (v, h), 4.0 / math.sqrt(h))
    return t


def fuse_experts(tensors, spec):
    """The layout `save_pretrained(save_original_format=False)` writes: per layer
    `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows, then up rows) and `mlp.experts.down_proj
    [E, H, I]`."""
    for l in range(spec["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp.experts"
        experts = range(spec["num_experts"])
        gate_up = [
            torch.cat([tensors.pop(f"{p}.{x}.gate_proj.weight"), tensors.pop(f"{p}.{x}.up_proj.weight")])
            for x in experts
        ]
        down = [tensors.pop(f"{p}.{x}.down_proj.weight") for x in experts]
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{p}.down_proj"] = torch.stack(down).contiguous()
    return tensors


def router_of(layer):
    """A Qwen3-MoE layer's router (`mlp.gate`: its output is `(logits, weights, ids)`)."""
    return layer.mlp.gate


def load_reference_model(out_dir):
    model = Qwen3MoeForCausalLM.from_pretrained(
        out_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    model.generation_config.eos_token_id = None  # generate exactly N tokens
    model.generation_config.pad_token_id = 0
    return model


def check_loaded_experts(model, tensors, spec):
    """transformers must have read the experts as written, gate rows before up rows."""
    for l in range(spec["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp.experts"
        experts = model.model.layers[l].mlp.experts
        if f"{p}.gate_up_proj" in tensors:
            gate_up, down = tensors[f"{p}.gate_up_proj"], tensors[f"{p}.down_proj"]
        else:
            xs = range(spec["num_experts"])
            gate_up = torch.stack(
                [torch.cat([tensors[f"{p}.{x}.gate_proj.weight"], tensors[f"{p}.{x}.up_proj.weight"]]) for x in xs]
            )
            down = torch.stack([tensors[f"{p}.{x}.down_proj.weight"] for x in xs])
        assert torch.equal(gate_up.float(), experts.gate_up_proj.detach().float()), f"layer {l} gate_up"
        assert torch.equal(down.float(), experts.down_proj.detach().float()), f"layer {l} down"


def build(spec, out_root, new_tokens, top):
    out_dir = os.path.join(out_root, spec["name"])
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    rng = np.random.default_rng(spec["seed"])
    torch.manual_seed(spec["seed"])
    if spec.get("chat"):
        vocab, ids = chat.write_tokenizer(out_dir, spec["vocab_size"])
        chat.write_generation_config(out_dir, ids)
        spec = dict(spec, vocab_size=vocab, eos_token_id=ids["<|im_end|>"])
    config = make_config(spec)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tensors = make_tensors(spec, rng)
    if spec["layout"] == "fused":
        tensors = fuse_experts(tensors, spec)
    # 1-based shard names; a cut by tensor count lets a layer's experts straddle two files.
    save_checkpoint(tensors, out_dir, spec["shards"], "hf")

    model = load_reference_model(out_dir)
    check_loaded_experts(model, tensors, spec)
    prompt = [int(x) for x in rng.integers(10, spec["vocab_size"], size=spec["prompt_len"])]
    ids, steps = greedy(model, prompt, new_tokens, top)
    reference = {
        "generator": "tools/make_fixtures.py (qwen3_moe)",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {"dtype": "float32", "attn_implementation": "eager", "experts_implementation": "eager"},
        "prompt_ids": prompt,
        "generated_ids": ids,
        "steps": steps,
        "min_margin": min(s["margin"] for s in steps),
        "layers": layer_checkpoints(model, prompt, 0, router_of),
        "layers_last": layer_checkpoints(model, prompt, len(prompt) - 1, router_of),
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f)
    if spec.get("chat"):
        chat.write_chat_reference(out_dir)
    print(f"{spec['name']}: prompt {len(prompt)} ids, generated {ids[:8]}..., min margin {reference['min_margin']:.4f}")
