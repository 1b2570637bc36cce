"""What tools/make_fixtures.py's families share: random bf16 tensors, saving a checkpoint in the
hub's layout, greedy generation with top logits, and per-layer checkpoints."""

import json
import math
import os

import numpy as np
import safetensors.torch
import torch


def bf16(rng, shape, std, mean=0.0):
    return torch.from_numpy(rng.normal(mean, std, size=shape).astype(np.float32)).to(torch.bfloat16)


def save_checkpoint(tensors, out_dir, shards, shard_names="openai"):
    if shards == 1:
        safetensors.torch.save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    total = 0
    for s in range(shards):
        # openai's 0-based naming: model-00000-of-00002 ... model-00002-of-00002 for 3 files;
        # transformers' own: model-00001-of-00003 ... model-00003-of-00003.
        if shard_names == "openai":
            file = f"model-{s:05d}-of-{shards - 1:05d}.safetensors"
        else:
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s * per : (s + 1) * per]}
        safetensors.torch.save_file(part, os.path.join(out_dir, file), metadata={"format": "pt"})
        for n, x in part.items():
            weight_map[n] = file
            total += x.numel() * x.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)


@torch.no_grad()
def layer_checkpoints(model, prompt, position, router_of):
    """Per-layer values at one prompt position of a full (uncached) forward pass; `router_of(layer)`
    is the module whose output is `(logits, weights, ids)`."""
    records = []
    hooks = []
    for layer in model.model.layers:
        rec = {}
        records.append(rec)
        hooks.append(
            layer.post_attention_layernorm.register_forward_pre_hook(
                lambda m, args, rec=rec: rec.__setitem__("after_attention", args[0][0, position].tolist())
            )
        )

        def router_hook(m, args, out, rec=rec):
            _, scores, indices = out
            rec["router_ids"] = indices[position].tolist()
            rec["router_weights"] = scores[position].tolist()

        hooks.append(router_of(layer).register_forward_hook(router_hook))
        hooks.append(
            layer.register_forward_hook(
                lambda m, args, out, rec=rec: rec.__setitem__(
                    "after_moe", (out[0] if isinstance(out, tuple) else out)[0, position].tolist()
                )
            )
        )
    model(torch.tensor([prompt]), use_cache=False)
    for hk in hooks:
        hk.remove()
    return records


@torch.no_grad()
def greedy(model, prompt, new_tokens, top):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    ids = out.sequences[0, len(prompt) :].tolist()
    steps = []
    for logits in out.logits:
        row = logits[0].float()
        values, indices = torch.topk(row, top)
        steps.append(
            {
                "top": [[int(i), float(v)] for i, v in zip(indices, values)],
                "margin": float(values[0] - values[1]),
            }
        )
    return ids, steps
