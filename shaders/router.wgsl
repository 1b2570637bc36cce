// The router: the experts each token goes to, and their weights.
//
// Entry `route`: per token, top-k of the router logits (descending, ties to the lower id) and a
//   softmax over the k selected: ids[t * k + s], weights[t * k + s]. With SOFTMAX_FIRST
//   (Qwen3-MoE), the weights are the chosen experts' probabilities under a softmax over every
//   expert instead, divided by their sum with RENORMALIZE.
// Entry `route_normed` (NORMED, with BF16, F16 or F32 naming the router's weights): the whole
//   router of a token in one workgroup: RMSNorm of its residual row (written to `normed`, which
//   the experts read; rms.wgsl, as norm.wgsl), the router product with its bias into
//   `logits` (BIAS: the router has one), then `route`'s top-k and softmax. One dispatch instead of three; the router's
//   weights are small (experts x hidden), so one workgroup per token reads them fast enough.
// Entry `sort_pairs` (SORT): a prompt block's pairs listed by expert, in tiles (below).

const WG: u32 = 64u;
// Router rows one pass over the normed row computes (each lane keeps one partial sum per row).
const TILE: u32 = 8u;

struct Params {
    tokens: u32,
    experts: u32,       // router logits per token
    top_k: u32,
    cols: u32,          // hidden size (route_normed)
    eps: f32,
    groups_x: u32,      // workgroups along x of `route` (index = x + y * groups_x * 64)
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
#if NORMED
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;
#else
@group(0) @binding(1) var<storage, read> logits: array<f32>;
#endif
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> weights: array<f32>;

// Token t's top-k and softmax from its logits.
fn select_top_k(t: u32) {
    let base = t * p.experts;
    // Selection: the s-th pick is the best logit strictly below the previous pick (or equal with
    // a higher id), which reproduces a stable descending sort.
    var previous_value = 3.0e38;
    var previous_id = 0xffffffffu;
    for (var s = 0u; s < p.top_k; s = s + 1u) {
        var best_id = 0xffffffffu;
        var best_value = -3.0e38;
        for (var e = 0u; e < p.experts; e = e + 1u) {
            let v = logits[base + e];
            let after_previous = v < previous_value || (v == previous_value && (previous_id == 0xffffffffu || e > previous_id));
            if (after_previous && (best_id == 0xffffffffu || v > best_value)) {
                best_value = v;
                best_id = e;
            }
        }
        ids[t * p.top_k + s] = best_id;
        weights[t * p.top_k + s] = best_value;
        previous_value = best_value;
        previous_id = best_id;
    }
    // The first pick is the largest logit of all.
    let max_value = weights[t * p.top_k];
#if SOFTMAX_FIRST
    var all = 0.0;
    for (var e = 0u; e < p.experts; e = e + 1u) {
        all = all + exp(logits[base + e] - max_value);
    }
    var chosen = 0.0;
    for (var s = 0u; s < p.top_k; s = s + 1u) {
        let probability = exp(weights[t * p.top_k + s] - max_value) / all;
        weights[t * p.top_k + s] = probability;
        chosen = chosen + probability;
    }
#if RENORMALIZE
    for (var s = 0u; s < p.top_k; s = s + 1u) {
        weights[t * p.top_k + s] = weights[t * p.top_k + s] / chosen;
    }
#endif
#else
    var sum = 0.0;
    for (var s = 0u; s < p.top_k; s = s + 1u) {
        let e = exp(weights[t * p.top_k + s] - max_value);
        weights[t * p.top_k + s] = e;
        sum = sum + e;
    }
    for (var s = 0u; s < p.top_k; s = s + 1u) {
        weights[t * p.top_k + s] = weights[t * p.top_k + s] / sum;
    }
#endif
}

@compute @workgroup_size(64)
fn route(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x + gid.y * p.groups_x * 64u;
    if (t < p.tokens) {
        select_top_k(t);
    }
}

#if NORMED
@group(0) @binding(4) var<storage, read> x: array<f32>;
@group(0) @binding(5) var<storage, read> norm_weight: array<f32>;
@group(0) @binding(6) var<storage, read_write> normed: array<f32>;
@group(0) @binding(7) var<storage, read> w: array<u32>;
#if BIAS
@group(0) @binding(8) var<storage, read> bias: array<f32>;
#endif

// The router's bias of expert e (0 without one).
fn router_bias(e: u32) -> f32 {
#if BIAS
    return bias[e];
#else
    return 0.0;
#endif
}

var<workgroup> partial: array<f32, WG * TILE>;

#include "rms.wgsl"

// Element i of the router's weights.
fn weight(i: u32) -> f32 {
#if BF16
    let word = w[i >> 1u];
    return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (i & 1u) == 1u));
#endif
#if F16
    let pair = unpack2x16float(w[i >> 1u]);
    return select(pair.x, pair.y, (i & 1u) == 1u);
#endif
#if F32
    return bitcast<f32>(w[i]);
#endif
}

// Sums each lane's TILE values over the workgroup (partial[i * WG] holds row i's sum after).
fn reduce_tile(lid: u32) {
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            for (var i = 0u; i < TILE; i = i + 1u) {
                partial[i * WG + lid] = partial[i * WG + lid] + partial[i * WG + lid + stride];
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(64)
fn route_normed(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x;
    let row = t * p.cols;
    let inv = inverse_rms(lid, row, p.cols, p.eps);
    // Every lane has read the sum before the tiles below reuse `partial`.
    workgroupBarrier();
    // Each lane writes, then reads back, only its own columns: no barrier is needed between.
    for (var c = lid; c < p.cols; c = c + WG) {
        normed[row + c] = norm_weight[c] * (x[row + c] * inv);
    }
    for (var first = 0u; first < p.experts; first = first + TILE) {
        var acc: array<f32, TILE>;
        for (var c = lid; c < p.cols; c = c + WG) {
            let v = normed[row + c];
            for (var i = 0u; i < TILE; i = i + 1u) {
                let e = min(first + i, p.experts - 1u);
                acc[i] = acc[i] + weight(e * p.cols + c) * v;
            }
        }
        // The previous tile's sums were read before its last barrier.
        for (var i = 0u; i < TILE; i = i + 1u) {
            partial[i * WG + lid] = acc[i];
        }
        reduce_tile(lid);
        if (lid < TILE && first + lid < p.experts) {
            logits[t * p.experts + first + lid] = partial[lid * WG] + router_bias(first + lid);
        }
        workgroupBarrier();
    }
    storageBarrier();
    if (lid == 0u) {
        select_top_k(t);
    }
}
#endif

#if SORT
@group(0) @binding(9) var<storage, read_write> sorted: array<u32>;
@group(0) @binding(10) var<storage, read_write> tile_list: array<u32>;
const SORT_EXPERTS: u32 = {{EXPERTS}}u;
const TILE_PAIRS: u32 = {{TILE_PAIRS}}u;
// Each expert's pair count, then where its pairs start in `sorted`.
var<workgroup> expert_start: array<u32, SORT_EXPERTS>;

// Entry `sort_pairs` (SORT, one workgroup): a prompt block's tokens * top_k (token, slot) pairs
// listed by expert (ascending pair index within each) into `sorted`, and the tiles of at most
// TILE_PAIRS pairs of one expert that experts.wgsl's grouped kernels take: tile_list[0] tiles,
// then (expert, first index into `sorted`, pairs) per tile. Pairs routed to no expert below
// SORT_EXPERTS are left out.
@compute @workgroup_size(64)
fn sort_pairs(@builtin(local_invocation_index) lid: u32) {
    for (var e = lid; e < SORT_EXPERTS; e = e + WG) {
        var count = 0u;
        for (var q = 0u; q < (p.tokens * p.top_k); q = q + 1u) {
            if (ids[q] == e) {
                count = count + 1u;
            }
        }
        expert_start[e] = count;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var running = 0u;
        var n = 0u;
        for (var e = 0u; e < SORT_EXPERTS; e = e + 1u) {
            let count = expert_start[e];
            expert_start[e] = running;
            for (var f = 0u; f < count; f = f + TILE_PAIRS) {
                tile_list[1u + 3u * n] = e;
                tile_list[2u + 3u * n] = running + f;
                tile_list[3u + 3u * n] = min(TILE_PAIRS, count - f);
                n = n + 1u;
            }
            running = running + count;
        }
        tile_list[0] = n;
    }
    workgroupBarrier();
    for (var e = lid; e < SORT_EXPERTS; e = e + WG) {
        var at = expert_start[e];
        for (var q = 0u; q < (p.tokens * p.top_k); q = q + 1u) {
            if (ids[q] == e) {
                sorted[at] = q;
                at = at + 1u;
            }
        }
    }
}
#endif
