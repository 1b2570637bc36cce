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

@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wg.x * p.cols;
    var acc = 0.0;
    for (var c = lid; c < p.cols; c = c + WG) {
        let v = x[base + c];
        acc = acc + v * v;
    }
    partial[lid] = acc;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            partial[lid] = partial[lid] + partial[lid + stride];
        }
        workgroupBarrier();
    }
    let inv = 1.0 / sqrt(partial[0] / f32(p.cols) + p.eps);
    for (var c = lid; c < p.cols; c = c + WG) {
        y[base + c] = w[c] * (x[base + c] * inv);
    }
}
