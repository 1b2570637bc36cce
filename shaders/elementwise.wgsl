// Small kernels over whole rows.
//
// Entry `add`: y += x.
// Entry `argmax`: the index of the largest of `count` values (the first on ties; NaN never wins),
//   one workgroup.
// Entry `top_k`: the `rows` (= k) largest of `count` values, largest first (lower index first on
//   ties, NaN skipped), as result[2s] = index, result[2s + 1] = bits of the value; one workgroup.
//   Greedy decoding reads back just these few words, not the vocabulary.

const WG: u32 = 256u;

struct Params {
    count: u32,         // elements (add), values (argmax, top_k)
    tokens: u32,
    row_first: u32,
    rows: u32,          // k (top_k)
    groups_x: u32,      // workgroups along x (index = x + y * groups_x * 256)
    pad0: u32,
    pad1: u32,
    pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;

#if ADD
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(256)
fn add(@builtin(global_invocation_id) gid: vec3<u32>) {
    let index = gid.x + gid.y * p.groups_x * 256u;
    if (index < p.count) {
        y[index] = y[index] + x[index];
    }
}
#endif

#if SELECT
@group(0) @binding(1) var<storage, read> values: array<f32>;
@group(0) @binding(2) var<storage, read_write> result: array<u32>;

var<workgroup> best_values: array<f32, WG>;
var<workgroup> best_ids: array<u32, WG>;

// a beats b: larger, or equal with a lower index; NaN never beats a number.
fn beats(va: f32, ia: u32, vb: f32, ib: u32) -> bool {
    if (ia == 0xffffffffu) {
        return false;
    }
    if (ib == 0xffffffffu) {
        return true;
    }
    return va > vb || (va == vb && ia < ib) || (vb != vb && va == va);
}

// Leaves the workgroup's best (value, index) in best_values[0], best_ids[0].
fn reduce_best(lid: u32, value: f32, index: u32) {
    best_values[lid] = value;
    best_ids[lid] = index;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride && beats(best_values[lid + stride], best_ids[lid + stride], best_values[lid], best_ids[lid])) {
            best_values[lid] = best_values[lid + stride];
            best_ids[lid] = best_ids[lid + stride];
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn argmax(@builtin(local_invocation_index) lid: u32) {
    var bv = 0.0;
    var bi = 0xffffffffu;
    for (var i = lid; i < p.count; i = i + WG) {
        let v = values[i];
        if (beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    reduce_best(lid, bv, bi);
    if (lid == 0u) {
        result[0] = select(best_ids[0], 0u, best_ids[0] == 0xffffffffu);
    }
}
var<workgroup> previous_value: f32;
var<workgroup> previous_id: u32;

// (va, ia) comes after (vb, ib) in the order: value descending, then index ascending.
fn after(va: f32, ia: u32, vb: f32, ib: u32) -> bool {
    return ib == 0xffffffffu || va < vb || (va == vb && ia > ib);
}

@compute @workgroup_size(256)
fn top_k(@builtin(local_invocation_index) lid: u32) {
    if (lid == 0u) {
        previous_value = 0.0;
        previous_id = 0xffffffffu;
    }
    workgroupBarrier();
    for (var s = 0u; s < p.rows; s = s + 1u) {
        let pv = previous_value;
        let pi = previous_id;
        var bv = 0.0;
        var bi = 0xffffffffu;
        for (var i = lid; i < p.count; i = i + WG) {
            let v = values[i];
            if (v == v && after(v, i, pv, pi) && beats(v, i, bv, bi)) {
                bv = v;
                bi = i;
            }
        }
        reduce_best(lid, bv, bi);
        if (lid == 0u) {
            result[2u * s] = best_ids[0];
            result[2u * s + 1u] = bitcast<u32>(best_values[0]);
            previous_value = best_values[0];
            previous_id = best_ids[0];
        }
        workgroupBarrier();
    }
}
#endif
