// A token's routed experts with their epilogues fused, for quantized experts in up to four bindings:
//
// Entry `gate_up_swiglu` (SWIGLU): for each (token, slot) pair p, e = ids[p] its expert,
//   act[p][j] = swiglu(W[e][2j] . x[t] + b[e][2j], W[e][2j + 1] . x[t] + b[e][2j + 1]) with
//   t = p / top_k: GPT-OSS's interleaved gate/up rows and moe.wgsl's clamped SwiGLU.
// Entry `down_combine` (COMBINE): hidden[t][r] += the sum over t's slots, in ascending expert id
//   (moe.wgsl's combine order), of weight[p] * (W[e][r] . act[p] + b[e][r]).
// Entries `gate_up_swiglu_grouped` (SWIGLU, GROUPED) and `down_grouped` (DOWN, GROUPED, writing
//   y[p][r] = W[e][r] . act[p] + b[e][r] for moe.wgsl's combine): the same products for a prompt
//   block, its pairs grouped by expert (below).
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
@group(0) @binding(11) var<storage, read> ids: array<u32>;
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

// A group's dot product `sum` times the group's scale (index s into chunk c's row-major scales).
fn scaled(sum: f32, c: u32, s: u32) -> f32 {
#if MXFP4
    // E8M0: 2^(byte - 127), applied with ldexp so no subnormal scale is ever materialized.
    let byte = (scale_word(c, s >> 2u) >> (8u * (s & 3u))) & 0xffu;
    return ldexp(sum, i32(byte) - 127);
#endif
#if INT4
    let pair = unpack2x16float(scale_word(c, s >> 1u));
    return sum * select(pair.x, pair.y, (s & 1u) == 1u);
#endif
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

#if GROUPED
// A prompt block's pairs grouped by expert: one workgroup per (row block, expert) takes the
// block's pairs routed to its expert BATCH at a time, and each weight word is loaded and decoded
// once for the whole batch, so an expert's rows are read once per BATCH of its pairs, not once
// per pair.
const BATCH: u32 = 8u;
// The round's pairs, and how many there are.
var<workgroup> batch: array<u32, BATCH>;
var<workgroup> batch_count: u32;
// Each row's total for each pair of the round: sums[slot * BATCH + q].
var<workgroup> sums: array<f32, ROWS * BATCH>;

// Lane 0 collects the next (up to BATCH) pairs routed to expert e from *cursor on; every lane
// gets their count (0 when none is left).
fn next_batch(lid: u32, e: u32, cursor: ptr<function, u32>) -> u32 {
    if (lid == 0u) {
        var count = 0u;
        while (*cursor < p.pairs && count < BATCH) {
            if (ids[*cursor] == e) {
                batch[count] = *cursor;
                count = count + 1u;
            }
            *cursor = *cursor + 1u;
        }
        batch_count = count;
    }
    return workgroupUniformLoad(&batch_count);
}

// The round's products of expert e's row r (this lane's slot) into `sums`.
fn batch_products(lid: u32, e: u32, r: u32, count: u32) {
    let slot = lid / LANES;
    let lane = lid % LANES;
    let groups = p.cols / 32u;
    let c = e / p.per_chunk;
    let row = (e % p.per_chunk) * p.rows + r;
    var acc: array<f32, BATCH>;
    if (r < p.rows) {
        for (var g = lane; g < groups; g = g + LANES) {
            let word = weight_word(c, row * groups + g);
            var group_sums: array<f32, BATCH>;
            for (var k = 0u; k < 4u; k = k + 1u) {
                let low = low_nibbles(word[k]);
                let high = high_nibbles(word[k]);
                for (var q = 0u; q < count; q = q + 1u) {
                    let xg = (batch[q] / p.x_div) * (p.cols / 4u) + g * 8u + 2u * k;
                    group_sums[q] = group_sums[q] + dot(low, x[xg]) + dot(high, x[xg + 1u]);
                }
            }
            for (var q = 0u; q < count; q = q + 1u) {
                acc[q] = acc[q] + scaled(group_sums[q], c, row * groups + g);
            }
        }
    }
    // `count` is uniform (a workgroupUniformLoad): every lane reaches the same barriers.
    for (var q = 0u; q < count; q = q + 1u) {
        let total = reduce_lanes(lid, LANES, acc[q]);
        if (lane == 0u) {
            sums[slot * BATCH + q] = total;
        }
        workgroupBarrier();
    }
}

// Writes the round's outputs of expert e's row r (this lane's slot): the SwiGLU of each gate row
// and the up row beside it, or each down row.
fn finish_round(lid: u32, e: u32, r: u32, count: u32) {
    let slot = lid / LANES;
    if (lid % LANES != 0u) {
        return;
    }
#if SWIGLU
    // Even slots hold gate rows, the next slot the same unit's up row (ROWS is even).
    if (slot % 2u == 0u && r + 1u < p.rows) {
        for (var q = 0u; q < count; q = q + 1u) {
            let gate = with_bias(sums[slot * BATCH + q], e, r);
            let up = with_bias(sums[(slot + 1u) * BATCH + q], e, r + 1u);
            act[batch[q] * (p.rows / 2u) + r / 2u] = clamped_swiglu(gate, up, p.alpha, p.limit);
        }
    }
#endif
#if DOWN
    if (r < p.rows) {
        for (var q = 0u; q < count; q = q + 1u) {
            y[batch[q] * p.rows + r] = with_bias(sums[slot * BATCH + q], e, r);
        }
    }
#endif
}

// The rounds of one (row block, expert) workgroup over the block's pairs routed to its expert.
fn grouped_rounds(wg: vec3<u32>, lid: u32) {
    load_table(lid);
    let r = (wg.x + wg.y * p.groups_x) * ROWS + lid / LANES;
    let e = wg.z;
    var cursor = 0u;
    loop {
        let count = next_batch(lid, e, &cursor);
        if (count == 0u) {
            break;
        }
        batch_products(lid, e, r, count);
        finish_round(lid, e, r, count);
        // The next round refills `batch` and `sums`.
        workgroupBarrier();
    }
}

#if SWIGLU
@compute @workgroup_size(64)
fn gate_up_swiglu_grouped(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    grouped_rounds(wg, lid);
}
#endif

#if DOWN
@compute @workgroup_size(64)
fn down_grouped(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    grouped_rounds(wg, lid);
}
#endif
#endif
