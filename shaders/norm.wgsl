// RMSNorm of each row: y = w * (x / sqrt(mean(x^2) + eps)), one workgroup per row.
// Entry `rms_norm`: packed rows of x into y.
// Entry `head_norm` (HEADS): in place, each of `heads` heads (`cols` values each) of each token's
//   row of a strided view (Qwen3's q_norm and k_norm on the stacked q/k/v product): token t's
//   head h starts at offset + t * stride + h * cols.

const WG: u32 = 64u;

#if HEADS
struct Params {
    cols: u32,
    eps: f32,
    heads: u32,
    offset: u32,
    stride: u32,
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
#else
struct Params {
    cols: u32,
    eps: f32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
#endif

var<workgroup> partial: array<f32, WG>;

#include "rms.wgsl"

#if HEADS
@compute @workgroup_size(64)
fn head_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = p.offset + wg.x * p.stride + wg.y * p.cols;
    let inv = inverse_rms(lid, base, p.cols, p.eps);
    // Each lane writes only the values it read for the sum: no barrier needed between.
    for (var c = lid; c < p.cols; c = c + WG) {
        x[base + c] = w[c] * (x[base + c] * inv);
    }
}
#else
@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wg.x * p.cols;
    let inv = inverse_rms(lid, base, p.cols, p.eps);
    for (var c = lid; c < p.cols; c = c + WG) {
        y[base + c] = w[c] * (x[base + c] * inv);
    }
}
#endif
