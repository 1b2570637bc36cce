// Whether subgroups are runs of consecutive lanes, as reduce.wgsl assumes, and shuffles work:
// ok[lid] = 1 where lane lid sits at lid % size in its subgroup and its xor-1 neighbour is lid ^ 1
// (else p.pad0, which the host sets to 0).

struct Params {
    pad0: u32,
    pad1: u32,
    pad2: u32,
    pad3: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> ok: array<u32>;

@compute @workgroup_size(64)
fn probe(@builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) id: u32, @builtin(subgroup_size) size: u32) {
    let neighbour = subgroupShuffleXor(lid, 1u);
    let consecutive = size > 1u && id == lid % size && neighbour == (lid ^ 1u);
    ok[lid] = select(p.pad0, 1u, consecutive);
}
