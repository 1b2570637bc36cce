// Read-bandwidth probe: each invocation reads every `stride`-th 16-byte word of `data` from its
// own index on (consecutive lanes, consecutive words: coalesced) and writes the xor of what it
// read to `folded[lane]`, so no read can be optimised away. `stride` is the number of
// invocations in the grid.

struct Params {
    words: u32,     // 16-byte words in `data`
    groups_x: u32,  // workgroups along x (lane = x + y * groups_x * 256)
    stride: u32,    // invocations in the grid
    pad0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> data: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> folded: array<u32>;

@compute @workgroup_size(256)
fn read_all(@builtin(global_invocation_id) gid: vec3<u32>) {
    let lane = gid.x + gid.y * p.groups_x * 256u;
    if (lane >= p.stride) {
        return;
    }
    var acc = vec4<u32>(0u);
    for (var i = lane; i < p.words; i = i + p.stride) {
        acc = acc ^ data[i];
    }
    folded[lane] = acc.x ^ acc.y ^ acc.z ^ acc.w;
}
