// The order a token's experts are added in, shared by moe.wgsl's combine and experts.wgsl's
// down_combine (the includer binds `ids` and has `p.top_k`): ascending expert id, as transformers
// adds them.

// Of token t's slots, the one whose expert id is the smallest above `previous` (-1 for the
// first), as (slot, expert id).
fn next_in_id_order(t: u32, previous: i32) -> vec2<i32> {
    var slot = 0u;
    var best = 0x7fffffff;
    for (var s = 0u; s < p.top_k; s = s + 1u) {
        let e = i32(ids[t * p.top_k + s]);
        if (e > previous && e < best) {
            best = e;
            slot = s;
        }
    }
    return vec2<i32>(i32(slot), best);
}
