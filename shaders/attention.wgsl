// Causal attention with per-head sinks and an optional sliding window, over a KV cache on the GPU.
//
// The block's queries, keys and values are rows of one buffer (the stacked q/k/v product): row t
// holds them at q_offset, k_offset and v_offset, row_stride floats apart. Where rotate_q/rotate_k
// say so, the rotary embedding (NeoX half-split, per-token cos/sin from the host, attention factor
// included) is applied as they are read, so it costs no pass of its own:
//   x'[i] = x[i] * cos[t][i] - x[i + D/2] * sin[t][i],  x'[i + D/2] = x[i + D/2] * cos[t][i] + x[i] * sin[t][i]
//
// Entry `attend`: one workgroup per (query, head). The first query head of each KV head also
//   stores its token's key (rotated) and value in the cache slot position % capacity. Keys are
//   visited in tiles of 64 with an online softmax (running max and sum, rescaled accumulators);
//   the sink joins as one more logit with no value. Query position = step.start + t; keys j with
//   j <= position and position - j < window. The block's own keys and values are read from qkv,
//   the earlier ones from the cache, so no read waits on this dispatch's stores; and no store
//   overwrites a key the block reads: sliding layers keep a ring of at least
//   window + block - 1 slots, the others one slot per position.

const WG: u32 = 64u;
const MAX_HEAD_DIM: u32 = {{MAX_HEAD_DIM}}u;
const PER_THREAD: u32 = MAX_HEAD_DIM / WG;
const NEG: f32 = -3.0e38;

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    capacity: u32,      // cache slots
    window: u32,        // keys a query sees (0 = all)
    scaling: f32,
    groups_x: u32,      // workgroups along x of `store` (index = x + y * groups_x * 64)
    row_stride: u32,    // floats per row of qkv
    q_offset: u32,
    k_offset: u32,
    v_offset: u32,
    rotate_q: u32,
    rotate_k: u32,
    pad0: u32,
    pad1: u32,
}

// Per-step values written by the host before each submission.
struct Step {
    start: u32,         // position of the block's first token
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> cos_table: array<f32>;
@group(0) @binding(4) var<storage, read> sin_table: array<f32>;

// Value i of the head starting at qkv[head], for token t: rotated when `rotate` is 1.
fn head_value(head: u32, i: u32, t: u32, rotate: u32) -> f32 {
    if (rotate == 0u) {
        return qkv[head + i];
    }
    let half = p.head_dim / 2u;
    if (i < half) {
        let c = cos_table[t * half + i];
        let s = sin_table[t * half + i];
        return qkv[head + i] * c - qkv[head + i + half] * s;
    }
    let j = i - half;
    let c = cos_table[t * half + j];
    let s = sin_table[t * half + j];
    return qkv[head + i] * c + qkv[head + j] * s;
}

#if ATTEND
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(7) var<storage, read> sinks: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

// Element i of key j of KV head g (the block's keys rotated as they are read).
fn key_at(j: u32, g: u32, i: u32) -> f32 {
    let d = p.head_dim;
    if (j >= step.start) {
        let b = j - step.start;
        return head_value(b * p.row_stride + p.k_offset + g * d, i, b, p.rotate_k);
    }
    return k_cache[(j % p.capacity) * p.num_kv_heads * d + g * d + i];
}

// Element i of value j of KV head g.
fn value_at(j: u32, g: u32, i: u32) -> f32 {
    let d = p.head_dim;
    if (j >= step.start) {
        return qkv[(j - step.start) * p.row_stride + p.v_offset + g * d + i];
    }
    return v_cache[(j % p.capacity) * p.num_kv_heads * d + g * d + i];
}

var<workgroup> q_local: array<f32, MAX_HEAD_DIM>;
var<workgroup> scores: array<f32, WG>;

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x;
    let h = wg.y;
    let d = p.head_dim;
    let kv_dim = p.num_kv_heads * d;
    let g = h / (p.num_heads / p.num_kv_heads);
    let position = step.start + t;
    var first = 0u;
    if (p.window > 0u && position + 1u > p.window) {
        first = position + 1u - p.window;
    }
    if (h % (p.num_heads / p.num_kv_heads) == 0u) {
        let at = (position % p.capacity) * kv_dim + g * d;
        for (var i = lid; i < d; i = i + WG) {
            k_cache[at + i] = key_at(position, g, i);
            v_cache[at + i] = value_at(position, g, i);
        }
    }
    let query = t * p.row_stride + p.q_offset + h * d;
    for (var i = lid; i < d; i = i + WG) {
        q_local[i] = head_value(query, i, t, p.rotate_q);
    }
    workgroupBarrier();

    var m = NEG;            // running max
    var l = 0.0;            // running sum of exp(score - m)
    var acc: array<f32, PER_THREAD>;
    for (var k = 0u; k < PER_THREAD; k = k + 1u) {
        acc[k] = 0.0;
    }
    let tiles = (position + 1u - first + WG - 1u) / WG;
    for (var tile = 0u; tile < tiles; tile = tile + 1u) {
        let j0 = first + tile * WG;
        let j = j0 + lid;
        var s = NEG;
        if (j <= position) {
            var dot = 0.0;
            for (var i = 0u; i < d; i = i + 1u) {
                dot = dot + q_local[i] * key_at(j, g, i);
            }
            s = dot * p.scaling;
        }
        scores[lid] = s;
        workgroupBarrier();
        var tile_max = NEG;
        for (var i = 0u; i < WG; i = i + 1u) {
            tile_max = max(tile_max, scores[i]);
        }
        let new_m = max(m, tile_max);
        let rescale = exp(m - new_m);
        l = l * rescale;
        for (var k = 0u; k < PER_THREAD; k = k + 1u) {
            acc[k] = acc[k] * rescale;
        }
        let count = min(WG, position + 1u - j0);
        for (var i = 0u; i < count; i = i + 1u) {
            let e = exp(scores[i] - new_m);
            l = l + e;
            for (var k = 0u; k < PER_THREAD; k = k + 1u) {
                let dim = lid + k * WG;
                if (dim < d) {
                    acc[k] = acc[k] + e * value_at(j0 + i, g, dim);
                }
            }
        }
        m = new_m;
        workgroupBarrier();
    }
    // The sink: one more logit, no value.
    let sink = sinks[h];
    let final_m = max(m, sink);
    let rescale = exp(m - final_m);
    let denominator = l * rescale + exp(sink - final_m);
    for (var k = 0u; k < PER_THREAD; k = k + 1u) {
        let dim = lid + k * WG;
        if (dim < d) {
            out[(t * p.num_heads + h) * d + dim] = acc[k] * rescale / denominator;
        }
    }
}
#endif
