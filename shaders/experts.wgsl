// A token's routed experts with their epilogues fused, for quantized experts in up to four bindings:
//
// Entry `gate_up_swiglu` (SWIGLU): for each (token, slot) pair p, e = ids[p] its expert,
//   act[p][j] = swiglu(W[e][2j] . x[t] + b[e][2j], W[e][2j + 1] . x[t] + b[e][2j + 1]) with
//   t = p / top_k: GPT-OSS's interleaved gate/up rows and moe.wgsl's clamped SwiGLU.
// Entry `down_combine` (COMBINE): hidden[t][r] += the sum over t's slots, in ascending expert id
//   (moe.wgsl's combine order), of weight[p] * (W[e][r] . act[p] + b[e][r]).
// Entries `gate_up_swiglu_grouped` (SWIGLU, GROUPED) and `down_grouped` (DOWN, GROUPED, writing
//   y[p][r] = W[e][r] . act[p] + b[e][r] for moe.wgsl's combine): the same products for a prompt
//   block, in tiles of its pairs grouped by expert (below), which router.wgsl's `sort_pairs`
//   lists.
//
// Weights are MXFP4 (MXFP4: E2M1 nibbles, low nibble first, one E8M0 scale byte per 32 inputs) or
// INT4 (INT4: nibbles q - 8, one f16 scale per 32 inputs), rows of 16-byte groups, over up to
// four bindings. ROWS rows per
// workgroup, LANES lanes per row: a row's lanes read consecutive 16-byte groups, and the E2M1
// values come from a table in workgroup memory (no per-lane lookup array).

const WG: u32 = 64u;
const ROWS: u32 = 8u;
const LANES: u32 = WG / ROWS;

struct Params {
    rows: u32,          // rows per expert
    cols: u32,          // inputs per row, a multiple of 32
    top_k: u32,         // slots per token
    has_bias: u32,
    alpha: f32,         // SwiGLU
    limit: f32,
    groups_x: u32,      // workgroups along x (row block = x + y * groups_x)
    per_chunk: u32,     // experts per binding
    pairs: u32,         // GROUPED: (token, slot) pairs of the block
    x_div: u32,         // GROUPED: pair q reads input row q / x_div
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The experts over up to four bindings of `per_chunk` experts each (the adapter's binding limit):
// weights and scales of chunk c at bindings 1 + 2c and 2 + 2c. CHUNKED reads several (unused
// ones repeat chunk 0's); without it, only chunk 0 is bound.
@group(0) @binding(1) var<storage, read> w0: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> scales0: array<u32>;
#if CHUNKED
@group(0) @binding(3) var<storage, read> w1: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> scales1: array<u32>;
@group(0) @binding(5) var<storage, read> w2: array<vec4<u32>>;
@group(0) @binding(6) var<storage, read> scales2: array<u32>;
@group(0) @binding(7) var<storage, read> w3: array<vec4<u32>>;
@group(0) @binding(8) var<storage, read> scales3: array<u32>;
#endif
@group(0) @binding(9) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(10) var<storage, read> bias: array<f32>;
#if GROUPED
#else
@group(0) @binding(11) var<storage, read> ids: array<u32>;
#endif
#if SWIGLU
@group(0) @binding(12) var<storage, read_write> act: array<f32>;

#include "swiglu.wgsl"
#endif
#if COMBINE
@group(0) @binding(12) var<storage, read> route_weights: array<f32>;
@group(0) @binding(13) var<storage, read_write> hidden: array<f32>;

#include "expert_order.wgsl"
#endif
#if DOWN
@group(0) @binding(12) var<storage, read_write> y: array<f32>;
#endif

// Word i of chunk c's weights (the chunk is the same in the whole workgroup).
fn weight_word(c: u32, i: u32) -> vec4<u32> {
#if CHUNKED
    switch c {
        case 0u: { return w0[i]; }
        case 1u: { return w1[i]; }
        case 2u: { return w2[i]; }
        default: { return w3[i]; }
    }
#else
    return w0[i];
#endif
}

// Word i of chunk c's scales.
fn scale_word(c: u32, i: u32) -> u32 {
#if CHUNKED
    switch c {
        case 0u: { return scales0[i]; }
        case 1u: { return scales1[i]; }
        case 2u: { return scales2[i]; }
        default: { return scales3[i]; }
    }
#else
    return scales0[i];
#endif
}

#include "reduce.wgsl"

#if MXFP4
// E2M1 values by code: bit 3 is the sign (code 8 is -0).
const FP4_VALUES = array<f32, 16>(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
var<workgroup> fp4: array<f32, 16>;
#endif

// Fills the workgroup's E2M1 table (every lane reaches the barrier).
fn load_table(lid: u32) {
#if MXFP4
    if (lid < 16u) {
        fp4[lid] = FP4_VALUES[lid];
    }
#endif
    workgroupBarrier();
}

fn nibble_value(n: u32) -> f32 {
#if MXFP4
    return fp4[n];
#endif
#if INT4
    return f32(i32(n) - 8);
#endif
}

// Group s's scale (index s into chunk c's row-major scales), and a value times it. MXFP4: the
// E8M0 byte's exponent, 2^(byte - 127) applied with ldexp so no subnormal scale is ever
// materialized; INT4: the f16 scale.
#if MXFP4
alias Scale = i32;

fn group_scale(c: u32, s: u32) -> Scale {
    return i32((scale_word(c, s >> 2u) >> (8u * (s & 3u))) & 0xffu) - 127;
}

fn apply_scale(v: f32, scale: Scale) -> f32 {
    return ldexp(v, scale);
}
#endif
#if INT4
alias Scale = f32;

fn group_scale(c: u32, s: u32) -> Scale {
    let pair = unpack2x16float(scale_word(c, s >> 1u));
    return select(pair.x, pair.y, (s & 1u) == 1u);
}

fn apply_scale(v: f32, scale: Scale) -> f32 {
    return v * scale;
}
#endif

// A group's dot product `sum` times the group's scale.
fn scaled(sum: f32, c: u32, s: u32) -> f32 {
    return apply_scale(sum, group_scale(c, s));
}

// The values of a word's four low nibbles (lowest first), and of its four high ones.
fn low_nibbles(bits: u32) -> vec4<f32> {
    return vec4<f32>(nibble_value(bits & 15u), nibble_value((bits >> 4u) & 15u),
                     nibble_value((bits >> 8u) & 15u), nibble_value((bits >> 12u) & 15u));
}

fn high_nibbles(bits: u32) -> vec4<f32> {
    return vec4<f32>(nibble_value((bits >> 16u) & 15u), nibble_value((bits >> 20u) & 15u),
                     nibble_value((bits >> 24u) & 15u), nibble_value(bits >> 28u));
}

// Eight nibbles (one 32-bit word, lowest first) times eight inputs.
fn dot_word(bits: u32, low: vec4<f32>, high: vec4<f32>) -> f32 {
    return dot(low_nibbles(bits), low) + dot(high_nibbles(bits), high);
}

// This lane's part of expert e's weight row r times the input starting at x[x4] (in vec4s):
// groups lane, lane + LANES, ...
fn row_partial(e: u32, r: u32, lane: u32, x4: u32) -> f32 {
    let groups = p.cols / 32u;
    let c = e / p.per_chunk;
    let row = (e % p.per_chunk) * p.rows + r;
    var acc = 0.0;
    for (var g = lane; g < groups; g = g + LANES) {
        let word = weight_word(c, row * groups + g);
        let xg = x4 + g * 8u;
        var sum = 0.0;
        for (var k = 0u; k < 4u; k = k + 1u) {
            sum = sum + dot_word(word[k], x[xg + 2u * k], x[xg + 2u * k + 1u]);
        }
        acc = acc + scaled(sum, c, row * groups + g);
    }
    return acc;
}

fn with_bias(total: f32, e: u32, r: u32) -> f32 {
    if (p.has_bias == 1u) {
        return total + bias[e * p.rows + r];
    }
    return total;
}

// The per-pair entries (a decode token's pairs, or a prompt block's without grouping).
#if GROUPED
#else
#if SWIGLU
// Each row's sum, for the gate row's lane to read its up row's.
var<workgroup> row_sums: array<f32, ROWS>;

@compute @workgroup_size(64)
fn gate_up_swiglu(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    load_table(lid);
    let slot = lid / LANES;
    let lane = lid % LANES;
    let r = (wg.x + wg.y * p.groups_x) * ROWS + slot;
    let pair = wg.z;
    let e = ids[pair];
    var acc = 0.0;
    if (r < p.rows) {
        acc = row_partial(e, r, lane, (pair / p.top_k) * (p.cols / 4u));
    }
    let total = reduce_lanes(lid, LANES, acc);
    if (lane == 0u) {
        row_sums[slot] = total;
    }
    workgroupBarrier();
    // Even slots hold gate rows, the next slot the same unit's up row (ROWS is even).
    if (lane == 0u && slot % 2u == 0u && r + 1u < p.rows) {
        let up = with_bias(row_sums[slot + 1u], e, r + 1u);
        act[pair * (p.rows / 2u) + r / 2u] = clamped_swiglu(with_bias(total, e, r), up, p.alpha, p.limit);
    }
}
#endif

#if COMBINE
@compute @workgroup_size(64)
fn down_combine(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    load_table(lid);
    let slot = lid / LANES;
    let lane = lid % LANES;
    let r = (wg.x + wg.y * p.groups_x) * ROWS + slot;
    let t = wg.z;
    var sum = 0.0;
    var previous = -1;
    for (var n = 0u; n < p.top_k; n = n + 1u) {
        let next = next_in_id_order(t, previous);
        let pair = t * p.top_k + u32(next.x);
        let e = u32(next.y);
        var acc = 0.0;
        if (r < p.rows) {
            acc = row_partial(e, r, lane, pair * (p.cols / 4u));
        }
        let total = reduce_lanes(lid, LANES, acc);
        if (r < p.rows) {
            sum = sum + with_bias(total, e, r) * route_weights[pair];
        }
        previous = next.y;
        // Every lane has read its row's sum before the next slot's reduction reuses `partial`.
        workgroupBarrier();
    }
    if (lane == 0u && r < p.rows) {
        hidden[t * p.rows + r] = hidden[t * p.rows + r] + sum;
    }
}
#endif
#endif

#if GROUPED
// A prompt block's pairs grouped by expert (router.wgsl's `sort_pairs` lists them): one
// workgroup per (tile of TILE_ROWS rows, tile of up to TILE_PAIRS pairs of one expert). Each step stages one 32-input
// group of the tile's weights, decoded and scaled once for every pair of the tile (the scale is
// a power of two for MXFP4, so the products are those of the per-pair kernels), and the pairs'
// inputs, in workgroup memory; each lane keeps 8 rows x 4 pairs of sums in registers. An
// expert's rows are read once per TILE_PAIRS of its pairs.
const TILE_ROWS: u32 = 64u;
// At most this many pairs of one expert per tile (router.wgsl's `sort_pairs` cuts them so).
const TILE_PAIRS: u32 = 32u;
// Tile rows padded by one value, so that lanes reading down a column hit distinct banks.
const TILE_PAD: u32 = 33u;
const LANE_ROWS: u32 = 8u;
const LANE_PAIRS: u32 = 4u;

@group(0) @binding(11) var<storage, read> order: array<u32>;
@group(0) @binding(13) var<storage, read> tiles: array<u32>;

var<workgroup> w_tile: array<f32, TILE_ROWS * TILE_PAD>;
var<workgroup> x_tile: array<f32, TILE_PAIRS * TILE_PAD>;
var<workgroup> tile_info: vec3<u32>;

// The workgroup's tile: (expert, first index into `order`, pairs); no pairs past the last tile.
fn tile_of(lid: u32, tile: u32) -> vec3<u32> {
    if (lid == 0u) {
        var info = vec3<u32>(0u, 0u, 0u);
        if (tile < tiles[0]) {
            info = vec3<u32>(tiles[1u + 3u * tile], tiles[2u + 3u * tile], tiles[3u + 3u * tile]);
        }
        tile_info = info;
    }
    return workgroupUniformLoad(&tile_info);
}

// The 32 weights of one group (its 16-byte word, lowest nibble first) times the group's scale
// (index s into chunk c's scales).
fn decode_group(word: vec4<u32>, c: u32, s: u32) -> array<f32, 32> {
    let scale = group_scale(c, s);
    var values: array<f32, 32>;
    for (var k = 0u; k < 4u; k = k + 1u) {
        for (var n = 0u; n < 8u; n = n + 1u) {
            values[8u * k + n] = apply_scale(nibble_value((word[k] >> (4u * n)) & 15u), scale);
        }
    }
    return values;
}

// Row (within the tile) of lane row `lane_row`'s j-th sum: a gate row and the up row after it
// in the same lane, so the SwiGLU needs no other lane's sums.
fn tile_row(lane_row: u32, j: u32) -> u32 {
    return 16u * (j / 2u) + 2u * lane_row + (j % 2u);
}

// Stages input group g of the tile: expert e's rows row0.. (decoded, scaled; zeros past the
// expert's rows) and the tile's pairs' inputs (zeros past its pairs).
fn stage_group(lid: u32, e: u32, row0: u32, info: vec3<u32>, g: u32) {
    let groups = p.cols / 32u;
    let c = e / p.per_chunk;
    let r = row0 + lid;
    var values: array<f32, 32>;
    if (r < p.rows) {
        let row = (e % p.per_chunk) * p.rows + r;
        values = decode_group(weight_word(c, row * groups + g), c, row * groups + g);
    }
    for (var k = 0u; k < 32u; k = k + 1u) {
        w_tile[lid * TILE_PAD + k] = values[k];
    }
    for (var e2 = lid; e2 < TILE_PAIRS * 32u; e2 = e2 + WG) {
        let q = e2 / 32u;
        let k = e2 % 32u;
        var v = 0.0;
        if (q < info.z) {
            let input = order[info.y + q] / p.x_div;
            v = x[input * (p.cols / 4u) + g * 8u + k / 4u][k % 4u];
        }
        x_tile[q * TILE_PAD + k] = v;
    }
}

// The rounds of one (row tile, pair tile) workgroup; writes each of its pairs' outputs.
fn grouped_tile(wg: vec3<u32>, lid: u32) {
    load_table(lid);
    let info = tile_of(lid, wg.z);
    if (info.z == 0u) {
        return;
    }
    let e = info.x;
    let row0 = (wg.x + wg.y * p.groups_x) * TILE_ROWS;
    let lane_row = lid % LANE_ROWS;
    let lane_pair = lid / LANE_ROWS;
    var acc: array<f32, 32>;   // [i * LANE_ROWS + j]
    for (var g = 0u; g < p.cols / 32u; g = g + 1u) {
        stage_group(lid, e, row0, info, g);
        workgroupBarrier();
        // This step's sums first, then into the totals: two levels keep long rows' rounding
        // error near the per-row kernels'.
        var step_sums: array<f32, 32>;
        for (var k = 0u; k < 32u; k = k + 1u) {
            var inputs: array<f32, 4>;
            for (var i = 0u; i < LANE_PAIRS; i = i + 1u) {
                inputs[i] = x_tile[(lane_pair + 8u * i) * TILE_PAD + k];
            }
            for (var j = 0u; j < LANE_ROWS; j = j + 1u) {
                let weight = w_tile[tile_row(lane_row, j) * TILE_PAD + k];
                for (var i = 0u; i < LANE_PAIRS; i = i + 1u) {
                    step_sums[i * LANE_ROWS + j] = step_sums[i * LANE_ROWS + j] + weight * inputs[i];
                }
            }
        }
        for (var n = 0u; n < 32u; n = n + 1u) {
            acc[n] = acc[n] + step_sums[n];
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < LANE_PAIRS; i = i + 1u) {
        let q = lane_pair + 8u * i;
        if (q >= info.z) {
            break;
        }
        let pair = order[info.y + q];
        for (var j = 0u; j < LANE_ROWS; j = j + 2u) {
            let r = row0 + tile_row(lane_row, j);
#if SWIGLU
            // r is a gate row, r + 1 its unit's up row (rows come in pairs).
            if (r + 1u < p.rows) {
                let gate = with_bias(acc[i * LANE_ROWS + j], e, r);
                let up = with_bias(acc[i * LANE_ROWS + j + 1u], e, r + 1u);
                act[pair * (p.rows / 2u) + r / 2u] = clamped_swiglu(gate, up, p.alpha, p.limit);
            }
#endif
#if DOWN
            if (r < p.rows) {
                y[pair * p.rows + r] = with_bias(acc[i * LANE_ROWS + j], e, r);
            }
            if (r + 1u < p.rows) {
                y[pair * p.rows + r + 1u] = with_bias(acc[i * LANE_ROWS + j + 1u], e, r + 1u);
            }
#endif
        }
    }
}

#if SWIGLU
@compute @workgroup_size(64)
fn gate_up_swiglu_grouped(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    grouped_tile(wg, lid);
}
#endif

#if DOWN
@compute @workgroup_size(64)
fn down_grouped(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    grouped_tile(wg, lid);
}
#endif
#endif
