// Sums over runs of lanes, included by the matvec kernels (which define WG).
//
// reduce_lanes(lid, width, value): each lane gets the sum of `value` over its run of `width`
// consecutive lanes (a power of two dividing WG, the same in the whole workgroup). Every lane
// must call it: it has barriers. With SUBGROUPS, butterfly shuffles within runs of
// SUBGROUP_MIN lanes (the adapter's smallest subgroup: such runs never straddle two subgroups,
// which are consecutive lanes, as device creation checks), then one pass through workgroup
// memory over a run's subgroups; without, a tree in workgroup memory.

var<workgroup> partial: array<f32, WG>;

#if SUBGROUPS
const SUBGROUP_MIN: u32 = {{SUBGROUP_MIN}}u;

fn reduce_lanes(lid: u32, width: u32, value: f32) -> f32 {
    let within = min(width, SUBGROUP_MIN);
    var sum = value;
    for (var offset = within / 2u; offset > 0u; offset = offset / 2u) {
        sum = sum + subgroupShuffleXor(sum, offset);
    }
    partial[lid] = sum;
    workgroupBarrier();
    let first = lid - lid % width;
    var total = 0.0;
    for (var lane = first; lane < first + width; lane = lane + within) {
        total = total + partial[lane];
    }
    return total;
}
#else
fn reduce_lanes(lid: u32, width: u32, value: f32) -> f32 {
    partial[lid] = value;
    workgroupBarrier();
    let lane = lid % width;
    for (var stride = width / 2u; stride > 0u; stride = stride / 2u) {
        if (lane < stride) {
            partial[lid] = partial[lid] + partial[lid + stride];
        }
        workgroupBarrier();
    }
    return partial[lid - lane];
}
#endif
