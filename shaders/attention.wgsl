// Causal attention with per-head sinks (SINKS: GPT-OSS; without, a plain softmax) and an optional
// sliding window, over a KV cache on the GPU.
//
// The block's queries, keys and values are rows of one buffer (the stacked q/k/v product): row t
// holds them at q_offset, k_offset and v_offset, row_stride floats apart. Where rotate_q/rotate_k
// say so, the rotary embedding (NeoX half-split, per-token cos/sin from the host, attention factor
// included) is applied as they are read, so it costs no pass of its own:
//   x'[i] = x[i] * cos[t][i] - x[i + D/2] * sin[t][i],  x'[i + D/2] = x[i + D/2] * cos[t][i] + x[i] * sin[t][i]
//
// Entry `attend`: one workgroup per (query token, KV head, split of the keys). It serves the
//   GROUP query heads that share the KV head from one read of each key and value (a tile of
//   TILE keys goes through workgroup memory, read in consecutive words). Keys are visited with an
//   online softmax per head (running max and sum, rescaled accumulators). Query position =
//   step.start + t; keys j with j <= position and position - j < window. The first split's
//   workgroup also stores its token's key (rotated) and value in the cache slot
//   position % capacity. The block's own keys and values are read from qkv, the earlier ones
//   from the cache, so no read waits on this dispatch's stores; and no store overwrites a key the
//   block reads: sliding layers keep a ring of at least window + block - 1 slots, the others one
//   slot per position.
//   Without SPLIT the one split covers every key and the sink joins as one more logit with no
//   value. With SPLIT (decode over long contexts: more workgroups than KV heads), split s takes
//   the s-th of `splits` equal shares of the keys its query sees and writes its running max, sum
//   and accumulators to `partials`; entry `merge` (MERGE) then combines the splits and the sink
//   per (token, head).
//
// KV_F16: the cache holds f16 pairs in u32 words, rounded to nearest even; the block's own keys
// and values are rounded the same way as they are read, so every key a query sees is the f16
// value the CPU tier's f16 cache holds.

const WG: u32 = 64u;
const HEAD_DIM: u32 = {{HEAD_DIM}}u;
const DIMS_PER_LANE: u32 = (HEAD_DIM + WG - 1u) / WG;
const NEG: f32 = -3.0e38;

struct Params {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    tokens: u32,
    capacity: u32,      // cache slots
    window: u32,        // keys a query sees (0 = all)
    scaling: f32,
    splits: u32,        // workgroups along the keys (1 without SPLIT)
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

// A split's record in `partials`: running max, running sum, then HEAD_DIM accumulators.
const RECORD: u32 = HEAD_DIM + 2u;

// Record of split s for (token t, head h).
fn record_at(t: u32, h: u32, s: u32) -> u32 {
    return ((t * p.num_heads + h) * p.splits + s) * RECORD;
}

#if ATTEND
const GROUP: u32 = {{GROUP}}u;      // query heads per KV head
const TILE: u32 = {{TILE}}u;        // keys per tile
const ROW: u32 = HEAD_DIM + 1u;     // a tile row, padded so lanes reading a column of keys miss no bank

@group(0) @binding(1) var<uniform> step: Step;
@group(0) @binding(2) var<storage, read> qkv: array<f32>;
@group(0) @binding(3) var<storage, read> cos_table: array<f32>;
@group(0) @binding(4) var<storage, read> sin_table: array<f32>;
#if KV_F16
@group(0) @binding(5) var<storage, read_write> k_cache: array<u32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<u32>;
#else
@group(0) @binding(5) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(6) var<storage, read_write> v_cache: array<f32>;
#endif
#if SINKS
@group(0) @binding(7) var<storage, read> sinks: array<f32>;
#endif
#if SPLIT
@group(0) @binding(8) var<storage, read_write> partials: array<f32>;
#else
@group(0) @binding(8) var<storage, read_write> out: array<f32>;
#endif

// Value i of the head starting at qkv[head], for token t: rotated when `rotate` is 1.
fn head_value(head: u32, i: u32, t: u32, rotate: u32) -> f32 {
    if (rotate == 0u) {
        return qkv[head + i];
    }
    let half = HEAD_DIM / 2u;
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

#if KV_F16
// The f16 bits nearest to x (ties to even; overflow to infinity), as the CPU tier rounds:
// computed in integers because WGSL leaves the rounding of f32 -> f16 conversions open.
fn f16_bits(x: f32) -> u32 {
    let bits = bitcast<u32>(x);
    let sign = (bits >> 16u) & 0x8000u;
    let magnitude = bits & 0x7fffffffu;
    if (magnitude > 0x7f800000u) {
        return sign | 0x7e00u;
    }
    let exponent = i32(magnitude >> 23u) - 112;
    if (exponent >= 31) {
        return sign | 0x7c00u;
    }
    var mantissa = magnitude & 0x7fffffu;
    var shift = 13u;
    var kept = 0u;
    if (exponent <= 0) {
        if (exponent < -10) {
            return sign;
        }
        mantissa = mantissa | 0x800000u;
        shift = u32(14 - exponent);
    } else {
        kept = u32(exponent) << 10u;
    }
    var rounded = kept | (mantissa >> shift);
    let rest = mantissa & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (rounded & 1u) == 1u)) {
        rounded = rounded + 1u;
    }
    return sign | rounded;
}

fn kv_round(x: f32) -> f32 {
    return unpack2x16float(f16_bits(x)).x;
}

fn kv_pack(low: f32, high: f32) -> u32 {
    return f16_bits(low) | (f16_bits(high) << 16u);
}

// Values i and i + 1 (i even) of a cached row starting at element `row`.
fn cached_pair(cache_is_keys: bool, row: u32, i: u32) -> vec2<f32> {
    if (cache_is_keys) {
        return unpack2x16float(k_cache[(row + i) / 2u]);
    }
    return unpack2x16float(v_cache[(row + i) / 2u]);
}
#else
fn kv_round(x: f32) -> f32 {
    return x;
}

fn cached_pair(cache_is_keys: bool, row: u32, i: u32) -> vec2<f32> {
    if (cache_is_keys) {
        return vec2<f32>(k_cache[row + i], k_cache[row + i + 1u]);
    }
    return vec2<f32>(v_cache[row + i], v_cache[row + i + 1u]);
}
#endif

// First element of KV head g's row of position j in the cache.
fn cache_row(j: u32, g: u32) -> u32 {
    return ((j % p.capacity) * p.num_kv_heads + g) * HEAD_DIM;
}

// Elements i and i + 1 (i even) of block token b's key of KV head g, rotated, as computed.
fn block_key(b: u32, g: u32, i: u32) -> vec2<f32> {
    let head = b * p.row_stride + p.k_offset + g * HEAD_DIM;
    return vec2<f32>(head_value(head, i, b, p.rotate_k), head_value(head, i + 1u, b, p.rotate_k));
}

// Element i of block token b's value of KV head g, as computed.
fn block_value(b: u32, g: u32, i: u32) -> f32 {
    return qkv[b * p.row_stride + p.v_offset + g * HEAD_DIM + i];
}

// Elements i and i + 1 (i even) of key j of KV head g, as the cache holds it.
fn key_pair(j: u32, g: u32, i: u32) -> vec2<f32> {
    if (j >= step.start) {
        let key = block_key(j - step.start, g, i);
        return vec2<f32>(kv_round(key.x), kv_round(key.y));
    }
    return cached_pair(true, cache_row(j, g), i);
}

// Element i of value j of KV head g, as the cache holds it.
fn value_at(j: u32, g: u32, i: u32) -> f32 {
    if (j >= step.start) {
        return kv_round(block_value(j - step.start, g, i));
    }
#if KV_F16
    let pair = cached_pair(false, cache_row(j, g), i & ~1u);
    return select(pair.x, pair.y, (i & 1u) == 1u);
#else
    return v_cache[cache_row(j, g) + i];
#endif
}

// Stores block token t's key (rotated) and value of KV head g at its position's slot, rounded
// once from the computed values.
fn store(t: u32, g: u32, lid: u32) {
    let row = cache_row(step.start + t, g);
    for (var i = 2u * lid; i < HEAD_DIM; i = i + 2u * WG) {
        let key = block_key(t, g, i);
        let value = vec2<f32>(block_value(t, g, i), block_value(t, g, i + 1u));
#if KV_F16
        k_cache[(row + i) / 2u] = kv_pack(key.x, key.y);
        v_cache[(row + i) / 2u] = kv_pack(value.x, value.y);
#else
        k_cache[row + i] = key.x;
        k_cache[row + i + 1u] = key.y;
        v_cache[row + i] = value.x;
        v_cache[row + i + 1u] = value.y;
#endif
    }
}

var<workgroup> queries: array<f32, GROUP * HEAD_DIM>;
var<workgroup> key_tile: array<f32, TILE * ROW>;
// Scores of the tile, then their exponentials: [head][key].
var<workgroup> scores: array<f32, GROUP * TILE>;
var<workgroup> running_max: array<f32, GROUP>;
var<workgroup> running_sum: array<f32, GROUP>;
var<workgroup> rescale: array<f32, GROUP>;

// Keys [first, position] of token t's query, cut to this split's share: (lo, hi), hi exclusive.
// The splits share the keys the query sees, whatever the cache's size.
fn split_keys(position: u32, split: u32) -> vec2<u32> {
    var first = 0u;
    if (p.window > 0u && position + 1u > p.window) {
        first = position + 1u - p.window;
    }
    let share = (position + 1u - first + p.splits - 1u) / p.splits;
    let lo = min(position + 1u, first + split * share);
    let hi = min(position + 1u, lo + share);
    return vec2<u32>(lo, hi);
}

// Scores of `count` keys from j0 against the GROUP queries, into `scores` (as exponentials of
// their distance to each head's new running max), updating the running max and sum.
fn softmax_tile(g: u32, j0: u32, count: u32, lid: u32) {
    for (var e = lid; e < count * (HEAD_DIM / 2u); e = e + WG) {
        let key = e / (HEAD_DIM / 2u);
        let i = 2u * (e % (HEAD_DIM / 2u));
        let pair = key_pair(j0 + key, g, i);
        key_tile[key * ROW + i] = pair.x;
        key_tile[key * ROW + i + 1u] = pair.y;
    }
    workgroupBarrier();
    for (var e = lid; e < GROUP * TILE; e = e + WG) {
        let h = e / TILE;
        let key = e % TILE;
        var s = NEG;
        if (key < count) {
            var dot = 0.0;
            for (var i = 0u; i < HEAD_DIM; i = i + 1u) {
                dot = dot + queries[h * HEAD_DIM + i] * key_tile[key * ROW + i];
            }
            s = dot * p.scaling;
        }
        scores[e] = s;
    }
    workgroupBarrier();
    for (var h = lid; h < GROUP; h = h + WG) {
        var tile_max = NEG;
        for (var key = 0u; key < count; key = key + 1u) {
            tile_max = max(tile_max, scores[h * TILE + key]);
        }
        let new_max = max(running_max[h], tile_max);
        rescale[h] = exp(running_max[h] - new_max);
        running_max[h] = new_max;
    }
    workgroupBarrier();
    for (var e = lid; e < GROUP * TILE; e = e + WG) {
        scores[e] = exp(scores[e] - running_max[e / TILE]);
    }
    workgroupBarrier();
    for (var h = lid; h < GROUP; h = h + WG) {
        var sum = running_sum[h] * rescale[h];
        for (var key = 0u; key < count; key = key + 1u) {
            sum = sum + scores[h * TILE + key];
        }
        running_sum[h] = sum;
    }
}

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x;
    let g = wg.y;
    let split = wg.z;
    let position = step.start + t;
    if (split == 0u) {
        store(t, g, lid);
    }
    for (var e = lid; e < GROUP * HEAD_DIM; e = e + WG) {
        let h = g * GROUP + e / HEAD_DIM;
        queries[e] = head_value(t * p.row_stride + p.q_offset + h * HEAD_DIM, e % HEAD_DIM, t, p.rotate_q);
    }
    for (var h = lid; h < GROUP; h = h + WG) {
        running_max[h] = NEG;
        running_sum[h] = 0.0;
    }
    workgroupBarrier();

    // Lane lid accumulates dims lid, lid + WG, ... of every head of the group.
    var acc: array<f32, GROUP * DIMS_PER_LANE>;
    for (var k = 0u; k < GROUP * DIMS_PER_LANE; k = k + 1u) {
        acc[k] = 0.0;
    }
    let keys = split_keys(position, split);
    for (var j0 = keys.x; j0 < keys.y; j0 = j0 + TILE) {
        let count = min(TILE, keys.y - j0);
        softmax_tile(g, j0, count, lid);
        for (var k = 0u; k < DIMS_PER_LANE; k = k + 1u) {
            let dim = lid + k * WG;
            if (dim >= HEAD_DIM) {
                break;
            }
            for (var h = 0u; h < GROUP; h = h + 1u) {
                acc[h * DIMS_PER_LANE + k] = acc[h * DIMS_PER_LANE + k] * rescale[h];
            }
            for (var key = 0u; key < count; key = key + 1u) {
                let v = value_at(j0 + key, g, dim);
                for (var h = 0u; h < GROUP; h = h + 1u) {
                    acc[h * DIMS_PER_LANE + k] = acc[h * DIMS_PER_LANE + k] + scores[h * TILE + key] * v;
                }
            }
        }
        workgroupBarrier();
    }

    for (var h = 0u; h < GROUP; h = h + 1u) {
        let head = g * GROUP + h;
        let m = running_max[h];
        let l = running_sum[h];
#if SPLIT
        let record = record_at(t, head, split);
        if (lid == 0u) {
            partials[record] = m;
            partials[record + 1u] = l;
        }
        for (var k = 0u; k < DIMS_PER_LANE; k = k + 1u) {
            let dim = lid + k * WG;
            if (dim < HEAD_DIM) {
                partials[record + 2u + dim] = acc[h * DIMS_PER_LANE + k];
            }
        }
#else
#if SINKS
        // The sink: one more logit, no value.
        let sink = sinks[head];
        let final_max = max(m, sink);
        let scale = exp(m - final_max);
        let denominator = l * scale + exp(sink - final_max);
#else
        let scale = 1.0;
        let denominator = l;
#endif
        for (var k = 0u; k < DIMS_PER_LANE; k = k + 1u) {
            let dim = lid + k * WG;
            if (dim < HEAD_DIM) {
                out[(t * p.num_heads + head) * HEAD_DIM + dim] = acc[h * DIMS_PER_LANE + k] * scale / denominator;
            }
        }
#endif
    }
}
#endif

#if MERGE
#if SINKS
@group(0) @binding(7) var<storage, read> sinks: array<f32>;
#endif
@group(0) @binding(8) var<storage, read_write> out: array<f32>;
@group(0) @binding(9) var<storage, read> partials: array<f32>;

// One workgroup per (token, head): the splits' running maxima, sums and accumulators rescaled to
// their common maximum, with the sink as one more logit with no value.
@compute @workgroup_size(64)
fn merge(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x;
    let head = wg.y;
#if SINKS
    let sink = sinks[head];
    var final_max = sink;
#else
    var final_max = partials[record_at(t, head, 0u)];
#endif
    for (var s = 0u; s < p.splits; s = s + 1u) {
        final_max = max(final_max, partials[record_at(t, head, s)]);
    }
#if SINKS
    var denominator = exp(sink - final_max);
#else
    var denominator = 0.0;
#endif
    for (var s = 0u; s < p.splits; s = s + 1u) {
        let record = record_at(t, head, s);
        denominator = denominator + partials[record + 1u] * exp(partials[record] - final_max);
    }
    for (var dim = lid; dim < HEAD_DIM; dim = dim + WG) {
        var sum = 0.0;
        for (var s = 0u; s < p.splits; s = s + 1u) {
            let record = record_at(t, head, s);
            sum = sum + partials[record + 2u + dim] * exp(partials[record] - final_max);
        }
        out[(t * p.num_heads + head) * HEAD_DIM + dim] = sum / denominator;
    }
}
#endif
