// Matrix-vector / matrix-matrix products with f32 accumulation, one workgroup per output row.
//
// Entry `dense`: y[t][row_offset + r] = W[r] . x[t] + bias[row_offset + r] for a chunk of rows of a
//   dense [out, in] matrix stored as bf16 (BF16), f16 (F16) or f32 (F32) words; with `accumulate`,
//   y[t][row_offset + r] += that instead (the output projection adds into the residual).
// Entry `dense_rows` (DENSE_ROWS, BF16 or F16, `in` a multiple of 8): the same, ROWS rows per
//   workgroup, each read by WG / ROWS lanes in 16-byte words (8 values), so that neighbouring
//   lanes read neighbouring words and no load is half wasted; TOKENS tokens per workgroup share
//   each weight load; one dispatch reads up to four chunks of a split matrix. With NORMED, x[t] is RMSNorm'ed
//   (weights norm_weight, p.eps) on the way in: W[r] . (norm_weight * x[t]) times x[t]'s inverse
//   RMS, whose sum of squares the row's lanes gather from the values they read anyway, so the
//   norm costs no pass of its own.
// Entry `experts_unquantized`: the same for float experts stored [E, in, out] (transformers'
//   orientation, as save_pretrained writes unquantized GPT-OSS), BF16/F16/F32.
// Entry `experts_rows` (EXPERTS_ROWS): the same for float experts stored [E, out, in]
//   (Qwen3-MoE's), BF16/F16/F32.
// Entry `experts`: for every (token, slot) pair p, with e = ids[p] the routed expert,
//   y[p][r] = W[e][r] . x[p / x_div] + bias[e][r], for experts quantized as MXFP4 (MXFP4: E2M1
//   nibbles, low nibble first, one E8M0 scale byte per 32 inputs) or group-scaled INT4 (INT4: signed
//   nibbles q - 8, one f16 scale per 32 inputs). A chunk holds experts [expert_first,
//   expert_first + expert_count); pairs routed elsewhere are skipped.

const WG: u32 = 64u;

struct Params {
    rows: u32,          // rows in this chunk (per expert for `experts`)
    cols: u32,          // inputs per row
    row_offset: u32,    // global index of the chunk's first row (dense)
    out_stride: u32,    // floats between consecutive outputs rows of y (t or p)
    x_stride: u32,      // floats between consecutive rows of x
    has_bias: u32,
    groups_x: u32,      // workgroups along x (rows = x + y * groups_x)
    expert_first: u32,
    expert_count: u32,
    x_div: u32,         // x row of pair p is p / x_div
    pairs: u32,         // pairs (experts); tokens (dense_rows)
    accumulate: u32,    // dense: add the row into y instead of storing it
    eps: f32,           // NORMED
    chunk_rows: u32,    // DENSE_ROWS: rows per weight binding
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
#if DENSE_ROWS
// With CHUNKED, up to four consecutive chunks of `chunk_rows` rows each (the adapter's binding
// limit splits large matrices; unused bindings repeat the first); else one.
@group(0) @binding(1) var<storage, read> w4_0: array<vec4<u32>>;
#if CHUNKED
@group(0) @binding(2) var<storage, read> w4_1: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w4_2: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> w4_3: array<vec4<u32>>;
#endif
@group(0) @binding(5) var<storage, read> x: array<f32>;
@group(0) @binding(6) var<storage, read> bias: array<f32>;
@group(0) @binding(7) var<storage, read_write> y: array<f32>;
#else
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
#endif
#if EXPERTS
@group(0) @binding(5) var<storage, read> scales: array<u32>;
@group(0) @binding(6) var<storage, read> ids: array<u32>;
#endif
#if EXPERTS_UNQUANTIZED
@group(0) @binding(5) var<storage, read> ids: array<u32>;
#endif
#if EXPERTS_ROWS
@group(0) @binding(5) var<storage, read> ids: array<u32>;
#endif

var<workgroup> routed: u32;

#include "reduce.wgsl"

fn reduce(lid: u32, value: f32) -> f32 {
    return reduce_lanes(lid, WG, value);
}

// Writes a dense row's dot product: y[t][row_offset + r] = total + bias[row_offset + r].
fn write_dense_row(t: u32, r: u32, total: f32) {
    let row = p.row_offset + r;
    var v = total;
    if (p.has_bias == 1u) {
        v = v + bias[row];
    }
    let at = t * p.out_stride + row;
    if (p.accumulate == 1u) {
        v = y[at] + v;
    }
    y[at] = v;
}

// Element i of a float weight array (one of BF16, F16, F32 is defined for float weights).
#if DENSE_ROWS
#else
#if BF16
fn weight(i: u32) -> f32 {
    let word = w[i >> 1u];
    return bitcast<f32>(select(word << 16u, word & 0xffff0000u, (i & 1u) == 1u));
}
#endif
#if F16
fn weight(i: u32) -> f32 {
    let pair = unpack2x16float(w[i >> 1u]);
    return select(pair.x, pair.y, (i & 1u) == 1u);
}
#endif
#if F32
fn weight(i: u32) -> f32 {
    return bitcast<f32>(w[i]);
}
#endif
#endif

#if DENSE

@compute @workgroup_size(64)
fn dense(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    let t = wg.z;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.cols;
    let xb = t * p.x_stride;
    var acc = 0.0;
    for (var c = lid; c < p.cols; c = c + WG) {
        acc = acc + weight(base + c) * x[xb + c];
    }
    let total = reduce(lid, acc);
    if (lid == 0u) {
        write_dense_row(t, r, total);
    }
}
#endif

#if DENSE_ROWS
const ROWS: u32 = 4u;
const LANES: u32 = WG / ROWS;
// With BATCHED, the tokens one workgroup multiplies each weight word with (a prompt block's
// tokens share each load); decode runs the plain variant, one token per workgroup.
#if BATCHED
const TOKENS: u32 = {{TOKENS}}u;
#endif

// The two values of one 32-bit word, low half first.
fn unpack_pair(word: u32) -> vec2<f32> {
#if BF16
    return vec2<f32>(bitcast<f32>(word << 16u), bitcast<f32>(word & 0xffff0000u));
#endif
#if F16
    return unpack2x16float(word);
#endif
}

// The eight weights of one 16-byte word.
fn unpack8(word: vec4<u32>) -> array<f32, 8> {
    var values: array<f32, 8>;
    for (var k = 0u; k < 4u; k = k + 1u) {
        let pair = unpack_pair(word[k]);
        values[2u * k] = pair.x;
        values[2u * k + 1u] = pair.y;
    }
    return values;
}

// Eight weights (one 16-byte word) times x[xb .. xb + 8].
fn dot8(word: vec4<u32>, xb: u32) -> f32 {
    var sum = 0.0;
    for (var k = 0u; k < 4u; k = k + 1u) {
        let pair = unpack_pair(word[k]);
        sum = sum + pair.x * x[xb + 2u * k] + pair.y * x[xb + 2u * k + 1u];
    }
    return sum;
}

#if NORMED
@group(0) @binding(8) var<storage, read> norm_weight: array<f32>;

// dot8 of norm_weight * x (columns c0 .. c0 + 8), and the sum of the x values' squares.
fn dot8_normed(word: vec4<u32>, xb: u32, c0: u32) -> vec2<f32> {
    var sum = 0.0;
    var squares = 0.0;
    for (var k = 0u; k < 8u; k = k + 1u) {
        let v = x[xb + k];
        squares = squares + v * v;
    }
    for (var k = 0u; k < 4u; k = k + 1u) {
        let pair = unpack_pair(word[k]);
        let c = c0 + 2u * k;
        sum = sum + pair.x * (norm_weight[c] * x[xb + 2u * k]) + pair.y * (norm_weight[c + 1u] * x[xb + 2u * k + 1u]);
    }
    return vec2<f32>(sum, squares);
}
#endif

// Word i of row r (counted from the dispatch's first row) in the chunk bindings.
fn row_word(r: u32, i: u32) -> vec4<u32> {
#if CHUNKED
    let at = (r % p.chunk_rows) * (p.cols / 8u) + i;
    switch r / p.chunk_rows {
        case 0u: { return w4_0[at]; }
        case 1u: { return w4_1[at]; }
        case 2u: { return w4_2[at]; }
        default: { return w4_3[at]; }
    }
#else
    return w4_0[r * (p.cols / 8u) + i];
#endif
}

#if BATCHED
@compute @workgroup_size(64)
fn dense_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let slot = lid / LANES;
    let lane = lid % LANES;
    let r = (wg.x + wg.y * p.groups_x) * ROWS + slot;
    let first = wg.z * TOKENS;
    let words = p.cols / 8u;
    // Per token of the workgroup's batch: the partial product, and (NORMED) of squares.
    var acc: array<f32, TOKENS>;
    var squares: array<f32, TOKENS>;
    if (r < p.rows) {
        for (var i = lane; i < words; i = i + LANES) {
            // One load and one unpacking of the word for every token of the batch.
            let weights = unpack8(row_word(r, i));
            for (var t = 0u; t < TOKENS; t = t + 1u) {
                if (first + t >= p.pairs) {
                    break;
                }
                let xb = (first + t) * p.x_stride + 8u * i;
                for (var k = 0u; k < 8u; k = k + 1u) {
                    let v = x[xb + k];
#if NORMED
                    acc[t] = acc[t] + weights[k] * (norm_weight[8u * i + k] * v);
                    squares[t] = squares[t] + v * v;
#else
                    acc[t] = acc[t] + weights[k] * v;
#endif
                }
            }
        }
    }
    // Each row's lanes sum their partial products (every lane reaches every barrier; each
    // reduction's sums are read before the next one reuses `partial`).
    for (var t = 0u; t < TOKENS; t = t + 1u) {
        var total = reduce_lanes(lid, LANES, acc[t]);
        workgroupBarrier();
#if NORMED
        let inv = 1.0 / sqrt(reduce_lanes(lid, LANES, squares[t]) / f32(p.cols) + p.eps);
        total = total * inv;
        workgroupBarrier();
#endif
        if (lane == 0u && r < p.rows && first + t < p.pairs) {
            write_dense_row(first + t, r, total);
        }
    }
}
#else
@compute @workgroup_size(64)
fn dense_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let slot = lid / LANES;
    let lane = lid % LANES;
    let r = (wg.x + wg.y * p.groups_x) * ROWS + slot;
    let t = wg.z;
    let words = p.cols / 8u;
    var acc = 0.0;
    var squares = 0.0;
    if (r < p.rows) {
        let xb = t * p.x_stride;
        for (var i = lane; i < words; i = i + LANES) {
#if NORMED
            let part = dot8_normed(row_word(r, i), xb + 8u * i, 8u * i);
            acc = acc + part.x;
            squares = squares + part.y;
#else
            acc = acc + dot8(row_word(r, i), xb + 8u * i);
#endif
        }
    }
    // Each row's lanes sum their partial products (every lane reaches every barrier).
    var total = reduce_lanes(lid, LANES, acc);
#if NORMED
    // Every lane has read its sum before the second reduction reuses `partial`.
    workgroupBarrier();
    let inv = 1.0 / sqrt(reduce_lanes(lid, LANES, squares) / f32(p.cols) + p.eps);
    total = total * inv;
#endif
    if (lane == 0u && r < p.rows) {
        write_dense_row(t, r, total);
    }
}
#endif

#if TILED
// Entry `dense_tiled` (prompts): a tile of TILE_ROWS rows by TILE_TOKENS tokens per workgroup.
// Each step stages TILE_K columns of the tile's weights (unpacked once) and inputs in workgroup
// memory, read from global memory in consecutive words; each lane then keeps 8 rows x 4 tokens
// of sums in registers, so every weight is read once per TILE_TOKENS tokens and every staged
// value feeds several products. NORMED: the weights norm_weight are applied to the inputs as
// they are used and each token's sum of squares is gathered from the staged tiles.
const TILE_ROWS: u32 = 64u;
const TILE_TOKENS: u32 = 32u;
const TILE_K: u32 = 32u;
// Tile rows padded by one value, so that lanes reading down a column hit distinct banks.
const TILE_PAD: u32 = TILE_K + 1u;
const LANE_ROWS: u32 = 8u;
const LANE_TOKENS: u32 = 4u;

var<workgroup> x_tile: array<f32, TILE_TOKENS * TILE_PAD>;
var<workgroup> w_tile: array<f32, TILE_ROWS * TILE_PAD>;
var<workgroup> token_squares: array<f32, TILE_TOKENS>;

// Stages columns k0 .. k0 + TILE_K of the tile's inputs and weights (zeros past the edges).
fn load_tiles(row0: u32, token0: u32, k0: u32, lid: u32) {
    for (var e = lid; e < TILE_TOKENS * TILE_K; e = e + WG) {
        let t = e / TILE_K;
        let c = e % TILE_K;
        var v = 0.0;
        if (token0 + t < p.pairs) {
            v = x[(token0 + t) * p.x_stride + k0 + c];
        }
        x_tile[t * TILE_PAD + c] = v;
    }
    for (var e = lid; e < TILE_ROWS * (TILE_K / 8u); e = e + WG) {
        let r = e / (TILE_K / 8u);
        let word = e % (TILE_K / 8u);
        var values: array<f32, 8>;
        if (row0 + r < p.rows) {
            values = unpack8(row_word(row0 + r, k0 / 8u + word));
        }
        for (var q = 0u; q < 8u; q = q + 1u) {
            w_tile[r * TILE_PAD + 8u * word + q] = values[q];
        }
    }
}

@compute @workgroup_size(64)
fn dense_tiled(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row0 = (wg.x + wg.y * p.groups_x) * TILE_ROWS;
    let token0 = wg.z * TILE_TOKENS;
    // Lane lid sums rows row0 + lane_row + 8j and tokens token0 + lane_token + 8i.
    let lane_row = lid % LANE_ROWS;
    let lane_token = lid / LANE_ROWS;
    var acc: array<f32, 32>;   // [i * LANE_ROWS + j]
    var squares = 0.0;         // NORMED: of token lid (lanes below TILE_TOKENS)
    for (var k0 = 0u; k0 < p.cols; k0 = k0 + TILE_K) {
        load_tiles(row0, token0, k0, lid);
        workgroupBarrier();
        // This step's sums first, then into the totals: two levels keep long rows' rounding
        // error near the per-row kernels'.
        var step_sums: array<f32, 32>;
        for (var k = 0u; k < TILE_K; k = k + 1u) {
            var inputs: array<f32, 4>;
            for (var i = 0u; i < LANE_TOKENS; i = i + 1u) {
                inputs[i] = x_tile[(lane_token + 8u * i) * TILE_PAD + k];
#if NORMED
                inputs[i] = norm_weight[k0 + k] * inputs[i];
#endif
            }
            for (var j = 0u; j < LANE_ROWS; j = j + 1u) {
                let weight = w_tile[(lane_row + 8u * j) * TILE_PAD + k];
                for (var i = 0u; i < LANE_TOKENS; i = i + 1u) {
                    step_sums[i * LANE_ROWS + j] = step_sums[i * LANE_ROWS + j] + weight * inputs[i];
                }
            }
        }
        for (var n = 0u; n < 32u; n = n + 1u) {
            acc[n] = acc[n] + step_sums[n];
        }
#if NORMED
        if (lid < TILE_TOKENS) {
            for (var k = 0u; k < TILE_K; k = k + 1u) {
                let v = x_tile[lid * TILE_PAD + k];
                squares = squares + v * v;
            }
        }
#endif
        workgroupBarrier();
    }
    if (lid < TILE_TOKENS) {
        token_squares[lid] = squares;
    }
    workgroupBarrier();
    for (var i = 0u; i < LANE_TOKENS; i = i + 1u) {
        let t = lane_token + 8u * i;
        if (token0 + t >= p.pairs) {
            break;
        }
        var inv = 1.0;
#if NORMED
        inv = 1.0 / sqrt(token_squares[t] / f32(p.cols) + p.eps);
#endif
        for (var j = 0u; j < LANE_ROWS; j = j + 1u) {
            let r = row0 + lane_row + 8u * j;
            if (r < p.rows) {
                write_dense_row(token0 + t, r, acc[i * LANE_ROWS + j] * inv);
            }
        }
    }
}
#endif
#endif

#if EXPERT_PAIRS
// The expert that pair `pair` is routed to, the same value in the whole workgroup (so an early
// exit on it keeps the barriers in uniform control flow).
fn routed_expert(lid: u32, pair: u32) -> u32 {
    if (lid == 0u) {
        routed = ids[pair];
    }
    return workgroupUniformLoad(&routed);
}

// Whether this workgroup has a row to compute: an existing row of an expert held by this chunk.
fn expert_row_here(r: u32, e: u32) -> bool {
    return r < p.rows && e >= p.expert_first && e < p.expert_first + p.expert_count;
}

// Reduces the partial dot products and writes y[pair][r] = total + bias[e][r].
fn finish_expert_row(lid: u32, partial_sum: f32, e: u32, r: u32, pair: u32) {
    let total = reduce(lid, partial_sum);
    if (lid == 0u) {
        var v = total;
        if (p.has_bias == 1u) {
            v = v + bias[e * p.rows + r];
        }
        y[pair * p.out_stride + r] = v;
    }
}
#endif

#if EXPERTS
fn byte_at(words_index: u32, which: u32) -> u32 {
    return (words_index >> (8u * which)) & 0xffu;
}

// A group's dot product `sum` times the group's scale s (index into the row-major scales).
fn scaled(sum: f32, s: u32) -> f32 {
#if MXFP4
    // E8M0: 2^(byte - 127), applied with ldexp so no subnormal scale is ever materialized.
    let byte = (scales[s >> 2u] >> (8u * (s & 3u))) & 0xffu;
    return ldexp(sum, i32(byte) - 127);
#endif
#if INT4
    let pair = unpack2x16float(scales[s >> 1u]);
    return sum * select(pair.x, pair.y, (s & 1u) == 1u);
#endif
}

#if MXFP4
// E2M1 values by code: bit 3 is the sign (code 8 is -0).
const FP4_VALUES = array<f32, 16>(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0);
#endif

fn nibble_value(n: u32) -> f32 {
#if MXFP4
    return FP4_VALUES[n];
#endif
#if INT4
    return f32(i32(n) - 8);
#endif
}

@compute @workgroup_size(64)
fn experts(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    let pair = wg.z;
    let e = routed_expert(lid, pair);
    if (!expert_row_here(r, e)) {
        return;
    }
    let groups = p.cols / 32u;
    let row = (e - p.expert_first) * p.rows + r;
    let word0 = row * groups * 4u;   // 16 bytes = 4 words per group
    let scale0 = row * groups;
    let xb = (pair / p.x_div) * p.x_stride;
    var acc = 0.0;
    for (var g = lid; g < groups; g = g + WG) {
        var sum = 0.0;
        for (var k = 0u; k < 4u; k = k + 1u) {
            let word = w[word0 + g * 4u + k];
            let xk = xb + g * 32u + k * 8u;
            for (var b = 0u; b < 4u; b = b + 1u) {
                let byte = byte_at(word, b);
                sum = sum + nibble_value(byte & 15u) * x[xk + 2u * b] + nibble_value(byte >> 4u) * x[xk + 2u * b + 1u];
            }
        }
        acc = acc + scaled(sum, scale0 + g);
    }
    finish_expert_row(lid, acc, e, r, pair);
}
#endif

#if EXPERTS_UNQUANTIZED
@compute @workgroup_size(64)
fn experts_unquantized(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    let pair = wg.z;
    let e = routed_expert(lid, pair);
    if (!expert_row_here(r, e)) {
        return;
    }
    // Column r of expert e's [cols, rows] matrix.
    let base = (e - p.expert_first) * p.cols * p.rows + r;
    let xb = (pair / p.x_div) * p.x_stride;
    var acc = 0.0;
    for (var c = lid; c < p.cols; c = c + WG) {
        acc = acc + weight(base + c * p.rows) * x[xb + c];
    }
    finish_expert_row(lid, acc, e, r, pair);
}
#endif

#if EXPERTS_ROWS
@compute @workgroup_size(64)
fn experts_rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let r = wg.x + wg.y * p.groups_x;
    let pair = wg.z;
    let e = routed_expert(lid, pair);
    if (!expert_row_here(r, e)) {
        return;
    }
    // Row r of expert e's [rows, cols] matrix.
    let base = ((e - p.expert_first) * p.rows + r) * p.cols;
    let xb = (pair / p.x_div) * p.x_stride;
    var acc = 0.0;
    for (var c = lid; c < p.cols; c = c + WG) {
        acc = acc + weight(base + c) * x[xb + c];
    }
    finish_expert_row(lid, acc, e, r, pair);
}
#endif
