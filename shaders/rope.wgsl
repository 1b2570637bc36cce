// Rotary embeddings (NeoX half-split) of `tokens` rows of `heads` heads: for i < D/2,
//   x[i]       = x[i] * cos[t][i] - x[i + D/2] * sin[t][i]
//   x[i + D/2] = x[i + D/2] * cos[t][i] + x[i] * sin[t][i]
// cos/sin (attention factor included) come from the host, computed in f32 exactly as the CPU
// tier does: GPU sin/cos lose accuracy on the large angles of long contexts.

struct Params {
    head_dim: u32,
    heads: u32,
    tokens: u32,
    groups_x: u32,      // workgroups along x (index = x + y * groups_x * 64)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> cos_table: array<f32>;
@group(0) @binding(3) var<storage, read> sin_table: array<f32>;

@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half = p.head_dim / 2u;
    let index = gid.x + gid.y * p.groups_x * 64u;
    if (index >= p.tokens * p.heads * half) {
        return;
    }
    let i = index % half;
    let head = (index / half) % p.heads;
    let t = index / (half * p.heads);
    let base = (t * p.heads + head) * p.head_dim;
    let a = x[base + i];
    let b = x[base + i + half];
    let c = cos_table[t * half + i];
    let s = sin_table[t * half + i];
    x[base + i] = a * c - b * s;
    x[base + i + half] = b * c + a * s;
}
