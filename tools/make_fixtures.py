#!/usr/bin/env python3
"""Build tiny random GPT-OSS checkpoints in the real Hugging Face layout and dump what
transformers computes on them, as the L2 reference for picchio's tests.

    pip install torch transformers safetensors numpy accelerate
    python3 tools/make_fixtures.py --out fixtures

GPT-OSS fixtures go to OUT/, Qwen3-MoE ones (tools/qwen3_moe_fixtures.py) to OUT/qwen3-moe/.
Each fixture directory gets:
  config.json                      real-style GPT-OSS config (yarn rope_scaling, truncate=false,
                                   layer_types, quantization_config mxfp4)
  model.safetensors | shards+index MXFP4 experts (*_blocks U8 [E,R,G,16], *_scales U8 [E,R,G]),
                                   bf16 everything else
  reference.json                   transformers (float32, eager attention, eager experts):
                                   prompt ids, 32 greedy ids (EOS disabled), top-10 logits and
                                   the top1-top2 margin per step, and per-layer checkpoints at
                                   position 0 (residual after attention, router top-k ids and
                                   weights, residual after the MoE block), and the same at the
                                   last prompt position (`layers_last`).

The checkpoint is written first and then loaded back with `from_pretrained`, so transformers'
own MXFP4 loader interprets the layout: the reference does not depend on this script's reading
of the format.
"""

import argparse
import json
import math
import os
import shutil

import numpy as np
import safetensors.torch
import torch
import transformers
from transformers import GptOssForCausalLM

import qwen3_moe_fixtures as qwen3
from fixture_common import bf16, greedy, layer_checkpoints, save_checkpoint

FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP4_MEAN_SQUARE = float(np.mean(FP4**2))

# Each spec varies what a loader or a kernel could get wrong: sizes, head_dim vs hidden, window,
# layer types, sharding, EOS form, prompt length.
FIXTURES = [
    dict(
        name="tiny-single",
        seed=1,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=64,
        vocab_size=256,
        sliding_window=8,  # prompt 12 + 32 generated crosses it five times
        layer_types=None,  # alternate sliding/full like the real model
        eos_token_id=2,
        shards=1,
        prompt_len=12,
    ),
    dict(
        name="tiny-sharded",
        seed=2,
        hidden_size=96,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,  # NH * D = 192 != hidden 96, as in the real model (4096 vs 2880)
        num_local_experts=8,
        num_experts_per_tok=3,
        intermediate_size=96,
        vocab_size=384,
        sliding_window=16,
        layer_types=None,
        eos_token_id=[1, 3],
        shards=3,  # openai-style 0-based shard names with an index
        prompt_len=20,
    ),
    dict(
        name="tiny-long",
        seed=3,
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=4,
        intermediate_size=64,
        vocab_size=512,
        sliding_window=32,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        eos_token_id=7,
        shards=1,
        prompt_len=120,  # longer than 100 tokens; 152 positions cross the window several times
    ),
    dict(
        name="tiny-routed",
        seed=5,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=32,  # gpt-oss-20b's routing: top 4 of 32 (chance of a guess: 1/8)
        num_experts_per_tok=4,
        intermediate_size=32,
        vocab_size=256,
        sliding_window=16,
        layer_types=None,
        eos_token_id=2,
        shards=1,
        prompt_len=24,
    ),
    dict(
        name="tiny-unquantized",
        seed=4,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,  # NH * D = 128 > hidden 64
        num_local_experts=3,
        num_experts_per_tok=1,  # top-1: the softmax over one logit is 1
        intermediate_size=32,
        vocab_size=200,
        sliding_window=4,
        layer_types=None,
        eos_token_id=[5, 6],
        shards=2,
        shard_names="hf",  # transformers' own 1-based shard names
        prompt_len=40,
        # What save_pretrained writes for a model that is not quantized: bf16 experts
        # [E, in, out], no quantization_config; transformers 5 rope_parameters without truncate
        # (which then means truncate=true); f32 sinks.
        experts_format="bf16",
        rope_layout="rope_parameters",
        truncate=None,
        sinks_dtype="f32",
    ),
]


def ROUTER(layer):
    """A GPT-OSS layer's router module (its output is `(logits, weights, ids)`)."""
    return layer.mlp.router


def random_spec(index, seed):
    """A random tiny GPT-OSS shape, for checking picchio on checkpoints its tests never saw
    (`--random N`). Covers the config variants transformers accepts: both rope layouts, truncate
    on/off/absent, layer_types absent or arbitrary, no window, GQA ratios, EOS forms, sharding."""
    r = np.random.default_rng([seed, index])
    heads = int(r.choice([1, 2, 3, 4, 6, 8]))
    kv = int(r.choice([d for d in range(1, heads + 1) if heads % d == 0]))
    experts = int(r.integers(1, 11))
    layers = int(r.integers(1, 5))
    spec = dict(
        name=f"random-{seed}-{index}",
        seed=int(r.integers(1 << 30)),
        hidden_size=int(r.choice([32, 64, 96, 128, 160])),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=int(r.choice([8, 16, 32, 64])),
        num_local_experts=experts,
        num_experts_per_tok=int(r.integers(1, experts + 1)),
        intermediate_size=int(r.choice([32, 64, 96])),
        vocab_size=int(r.integers(50, 700)),
        # transformers needs a window even when no layer slides; sometimes wider than the text.
        sliding_window=4096 if r.random() < 0.15 else int(r.integers(1, 41)),
        layer_types=None
        if r.random() < 0.4
        else [str(r.choice(["sliding_attention", "full_attention"])) for _ in range(layers)],
        eos_token_id=[None, int(r.integers(0, 50)), [int(r.integers(0, 50)), int(r.integers(0, 50))]][
            int(r.integers(0, 3))
        ],
        shards=int(r.integers(1, 4)),
        shard_names=str(r.choice(["openai", "hf"])),
        prompt_len=int(r.integers(1, 150)),
        rope_layout=str(r.choice(["rope_scaling", "rope_parameters"])),
        truncate=[False, True, None][int(r.integers(0, 3))],
        sinks_dtype=str(r.choice(["bf16", "f32"])),
        # Unquantized experts as save_pretrained writes them: [E, in, out], no quantization_config.
        experts_format=str(r.choice(["mxfp4", "mxfp4", "bf16"])),
    )
    return spec


def make_config(spec):
    layers = spec["num_hidden_layers"]
    layer_types = spec["layer_types"] or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    config = {
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": True,
        "attention_dropout": 0.0,
        "eos_token_id": spec["eos_token_id"],
        "experts_per_token": spec["num_experts_per_tok"],
        "head_dim": spec["head_dim"],
        "hidden_act": "silu",
        "hidden_size": spec["hidden_size"],
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": spec["intermediate_size"],
        "layer_types": layer_types,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": spec["num_attention_heads"],
        "num_experts_per_tok": spec["num_experts_per_tok"],
        "num_hidden_layers": layers,
        "num_key_value_heads": spec["num_key_value_heads"],
        "num_local_experts": spec["num_local_experts"],
        "output_router_logits": False,
        "pad_token_id": 0,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": False,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": spec["sliding_window"],
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "transformers_version": "4.55.0.dev0",
        "use_cache": True,
        "vocab_size": spec["vocab_size"],
    }
    if spec.get("layer_types") is None and spec.get("name", "").startswith("random"):
        del config["layer_types"]  # transformers' default: even layers slide
    if spec.get("eos_token_id", 0) is None:
        del config["eos_token_id"]
    truncate = spec.get("truncate", False)
    if truncate is None:
        del config["rope_scaling"]["truncate"]  # absent means True to transformers
    else:
        config["rope_scaling"]["truncate"] = truncate
    if spec.get("experts_format") == "bf16":
        del config["quantization_config"]
    if spec.get("rope_layout") == "rope_parameters":
        # transformers 5.x layout: one dict that also carries rope_theta.
        params = config.pop("rope_scaling")
        params["rope_theta"] = config.pop("rope_theta")
        config["rope_parameters"] = params
    return config


def mxfp4(rng, experts, rows, cols, target_std):
    """Random codes with E8M0 scales chosen so that a dot with a unit-RMS input has about
    `target_std`; scales vary by +-1 per group so rows differ in magnitude."""
    groups = cols // 32
    blocks = rng.integers(0, 256, size=(experts, rows, groups, 16), dtype=np.uint8)
    per_weight = target_std / math.sqrt(cols * FP4_MEAN_SQUARE)
    base = 127 + int(round(math.log2(per_weight)))
    scales = (base + rng.integers(-1, 2, size=(experts, rows, groups))).astype(np.uint8)
    return torch.from_numpy(blocks), torch.from_numpy(scales)


def dequantize(blocks, scales):
    """Reference decode used only to check transformers' loader read what we wrote."""
    b = blocks.numpy()
    values = np.empty(b.shape[:-1] + (32,), dtype=np.float32)
    values[..., 0::2] = FP4[b & 0x0F]
    values[..., 1::2] = FP4[b >> 4]
    values *= np.exp2(scales.numpy().astype(np.float32) - 127)[..., None]
    return torch.from_numpy(values.reshape(*b.shape[:-2], -1))


def make_tensors(spec, rng):
    h, i = spec["hidden_size"], spec["intermediate_size"]
    nh, kv, d = spec["num_attention_heads"], spec["num_key_value_heads"], spec["head_dim"]
    e, v = spec["num_local_experts"], spec["vocab_size"]
    t = {"model.embed_tokens.weight": bf16(rng, (v, h), 1.0)}
    for l in range(spec["num_hidden_layers"]):
        p = f"model.layers.{l}"
        t[f"{p}.input_layernorm.weight"] = bf16(rng, (h,), 0.1, 1.0)
        t[f"{p}.post_attention_layernorm.weight"] = bf16(rng, (h,), 0.1, 1.0)
        # Attention logits of a few units so the softmax is neither flat nor one-hot.
        t[f"{p}.self_attn.q_proj.weight"] = bf16(rng, (nh * d, h), 1.5 / math.sqrt(h))
        t[f"{p}.self_attn.q_proj.bias"] = bf16(rng, (nh * d,), 0.2)
        t[f"{p}.self_attn.k_proj.weight"] = bf16(rng, (kv * d, h), 1.5 / math.sqrt(h))
        t[f"{p}.self_attn.k_proj.bias"] = bf16(rng, (kv * d,), 0.2)
        t[f"{p}.self_attn.v_proj.weight"] = bf16(rng, (kv * d, h), 1.0 / math.sqrt(h))
        t[f"{p}.self_attn.v_proj.bias"] = bf16(rng, (kv * d,), 0.1)
        t[f"{p}.self_attn.o_proj.weight"] = bf16(rng, (h, nh * d), 1.0 / math.sqrt(nh * d))
        t[f"{p}.self_attn.o_proj.bias"] = bf16(rng, (h,), 0.1)
        t[f"{p}.self_attn.sinks"] = bf16(rng, (nh,), 1.0)
        if spec.get("sinks_dtype") == "f32":
            t[f"{p}.self_attn.sinks"] = t[f"{p}.self_attn.sinks"].float()
        # Uneven routing: strong router weights plus a per-expert bias.
        t[f"{p}.mlp.router.weight"] = bf16(rng, (e, h), 2.0 / math.sqrt(h))
        t[f"{p}.mlp.router.bias"] = bf16(rng, (e,), 1.0)
        # gate/up pre-activations with std ~3 (scales vary by 2x): a few percent pass the +-7 clamp.
        blocks, scales = mxfp4(rng, e, 2 * i, h, 2.5)
        t[f"{p}.mlp.experts.gate_up_proj_blocks"] = blocks
        t[f"{p}.mlp.experts.gate_up_proj_scales"] = scales
        t[f"{p}.mlp.experts.gate_up_proj_bias"] = bf16(rng, (e, 2 * i), 0.5)
        blocks, scales = mxfp4(rng, e, h, i, 0.15)
        t[f"{p}.mlp.experts.down_proj_blocks"] = blocks
        t[f"{p}.mlp.experts.down_proj_scales"] = scales
        t[f"{p}.mlp.experts.down_proj_bias"] = bf16(rng, (e, h), 0.1)
    t["model.norm.weight"] = bf16(rng, (h,), 0.1, 1.0)
    # Logits with a spread of several units, so greedy margins are not razor thin.
    t["lm_head.weight"] = bf16(rng, (v, h), 4.0 / math.sqrt(h))
    return t


def unquantize_experts(tensors):
    """MXFP4 experts -> bf16 `gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]` (exact: every
    MXFP4 value is a bf16 value)."""
    for name in [n for n in tensors if n.endswith("_blocks")]:
        prefix = name[: -len("_blocks")]
        dense = dequantize(tensors.pop(name), tensors.pop(prefix + "_scales"))  # [E, out, in]
        tensors[prefix] = dense.transpose(1, 2).contiguous().to(torch.bfloat16)
    return tensors


def load_reference_model(out_dir):
    model = GptOssForCausalLM.from_pretrained(
        out_dir,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    model.eval()
    # transformers' generation_config EOS wins over generate(eos_token_id=None): clear it.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def check_loaded_experts(model, tensors, spec):
    """transformers must have read our blocks/scales as we meant them (and as picchio reads them)."""
    for l in range(spec["num_hidden_layers"]):
        p = f"model.layers.{l}.mlp.experts"
        experts = model.model.layers[l].mlp.experts
        for proj in ("gate_up_proj", "down_proj"):
            if f"{p}.{proj}" in tensors:  # unquantized
                ours = tensors[f"{p}.{proj}"].float().transpose(1, 2)
            else:
                ours = dequantize(tensors[f"{p}.{proj}_blocks"], tensors[f"{p}.{proj}_scales"])  # [E, out, in]
            theirs = getattr(experts, proj).detach().float().transpose(1, 2)  # [E, in, out] -> [E, out, in]
            assert torch.equal(ours, theirs), f"layer {l} {proj}: transformers decoded MXFP4 differently"


def clamp_fraction(model, prompt, limit):
    """Fraction of gate/up pre-activations that the SwiGLU clamp changes (for the README)."""
    hit, total = 0, 0

    for layer in model.model.layers:
        original = layer.mlp.experts._apply_gate

        def counting(gate_up, original=original):
            nonlocal hit, total
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            hit += int((gate > limit).sum() + (up.abs() > limit).sum())
            total += gate_up.numel()
            return original(gate_up)

        layer.mlp.experts._apply_gate = counting
    with torch.no_grad():
        model(torch.tensor([prompt]), use_cache=False)
    for layer in model.model.layers:
        del layer.mlp.experts._apply_gate  # back to the class method
    return hit / max(total, 1)


def build(spec, out_root, new_tokens, top):
    out_dir = os.path.join(out_root, spec["name"])
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    rng = np.random.default_rng(spec["seed"])
    torch.manual_seed(spec["seed"])
    config = make_config(spec)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    tensors = make_tensors(spec, rng)
    if spec.get("experts_format") == "bf16":
        tensors = unquantize_experts(tensors)
    save_checkpoint(tensors, out_dir, spec["shards"], spec.get("shard_names", "openai"))

    model = load_reference_model(out_dir)
    check_loaded_experts(model, tensors, spec)
    # Avoid the EOS ids in the prompt so the prompt reads like text.
    prompt = [int(x) for x in rng.integers(10, spec["vocab_size"], size=spec["prompt_len"])]
    ids, steps = greedy(model, prompt, new_tokens, top)
    layers = layer_checkpoints(model, prompt, 0, ROUTER)
    # The last prompt position also exercises windows, sinks over many keys and rotation.
    layers_last = layer_checkpoints(model, prompt, len(prompt) - 1, ROUTER)
    reference = {
        "generator": "tools/make_fixtures.py",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "settings": {"dtype": "float32", "attn_implementation": "eager", "experts_implementation": "eager"},
        "prompt_ids": prompt,
        "generated_ids": ids,
        "steps": steps,
        "min_margin": min(s["margin"] for s in steps),
        "clamp_fraction": clamp_fraction(model, prompt, config["swiglu_limit"]),
        "layers": layers,
        "layers_last": layers_last,
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(reference, f)
    print(
        f"{spec['name']}: prompt {len(prompt)} ids, generated {ids[:8]}..., "
        f"min margin {reference['min_margin']:.4f}, clamp fraction {reference['clamp_fraction']:.3f}"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="fixtures")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--only", nargs="*", help="fixture names to build (default: all)")
    parser.add_argument("--random", type=int, default=0, help="build N random shapes instead of the fixtures")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random")
    parser.add_argument(
        "--family", choices=["gpt_oss", "qwen3_moe", "all"], default="all", help="which model family to build"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    families = []
    if args.family in ("gpt_oss", "all"):
        specs = [random_spec(i, args.seed) for i in range(args.random)] if args.random else FIXTURES
        families.append((specs, args.out, lambda spec, out: build(spec, out, args.new_tokens, args.top)))
    if args.family in ("qwen3_moe", "all"):
        specs = [qwen3.random_spec(i, args.seed) for i in range(args.random)] if args.random else qwen3.FIXTURES
        out = os.path.join(args.out, "qwen3-moe")
        families.append((specs, out, lambda spec, out: qwen3.build(spec, out, args.new_tokens, args.top)))
    for specs, out, build_one in families:
        for spec in specs:
            if args.only and spec["name"] not in args.only:
                continue
            build_one(spec, out)


if __name__ == "__main__":
    main()
