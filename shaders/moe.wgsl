// Mixture-of-experts glue around the expert matmuls (matmul.wgsl `experts`); the router is
// router.wgsl.
//
// Entry `swiglu`: act[p][i] = (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l),
//   over interleaved gate/up rows [p][2i], [p][2i + 1]; with PLAIN (Qwen3-MoE),
//   act[p][i] = silu(gate) * up over gate rows [p][i] then up rows [p][width + i].
// Entry `combine`: hidden[t] += sum over the token's experts, in ascending expert id (the order
//   transformers adds them), of weight * down[t * k + s].

struct Params {
    tokens: u32,
    experts: u32,       // router logits per token
    top_k: u32,
    width: u32,         // intermediate size (swiglu) or hidden size (combine)
    alpha: f32,
    limit: f32,
    groups_x: u32,      // workgroups along x (index = x + y * groups_x * 64)
    pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

#if SWIGLU
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<f32>;

#include "swiglu.wgsl"

@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>) {
    let index = gid.x + gid.y * p.groups_x * 64u;
    if (index >= p.tokens * p.width) {
        return;
    }
#if PLAIN
    let row = index / p.width;
    let gate = gate_up[index + row * p.width];
    let up = gate_up[index + (row + 1u) * p.width];
    act[index] = gate / (1.0 + exp(-gate)) * up;
#else
    act[index] = clamped_swiglu(gate_up[2u * index], gate_up[2u * index + 1u], p.alpha, p.limit);
#endif
}
#endif

#if COMBINE
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> weights: array<f32>;
@group(0) @binding(3) var<storage, read> down: array<f32>;
@group(0) @binding(4) var<storage, read_write> hidden: array<f32>;

#include "expert_order.wgsl"

@compute @workgroup_size(64)
fn combine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let index = gid.x + gid.y * p.groups_x * 64u;
    if (index >= p.tokens * p.width) {
        return;
    }
    let t = index / p.width;
    let c = index % p.width;
    var sum = 0.0;
    var previous = -1;
    for (var n = 0u; n < p.top_k; n = n + 1u) {
        let next = next_in_id_order(t, previous);
        let pair = t * p.top_k + u32(next.x);
        sum = sum + down[pair * p.width + c] * weights[pair];
        previous = next.y;
    }
    hidden[index] = hidden[index] + sum;
}
#endif
