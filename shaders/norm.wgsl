// RMSNorm of each row: y = w * (x / sqrt(mean(x^2) + eps)), one workgroup per row.

const WG: u32 = 64u;

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

var<workgroup> partial: array<f32, WG>;

#include "rms.wgsl"

@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wg.x * p.cols;
    let inv = inverse_rms(lid, base, p.cols, p.eps);
    for (var c = lid; c < p.cols; c = c + WG) {
        y[base + c] = w[c] * (x[base + c] * inv);
    }
}
