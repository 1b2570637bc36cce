// The inverse RMS of a row, shared by norm.wgsl and router.wgsl so both normalize with the same
// arithmetic (the includer defines WG, binds `x` and has a workgroup array `partial` of at least
// WG floats).

// 1 / sqrt(mean(x[row .. row + cols]^2) + eps), in every lane. Every lane must call it; `partial`
// may be reused only after a barrier.
fn inverse_rms(lid: u32, row: u32, cols: u32, eps: f32) -> f32 {
    var squares = 0.0;
    for (var c = lid; c < cols; c = c + WG) {
        let v = x[row + c];
        squares = squares + v * v;
    }
    partial[lid] = squares;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            partial[lid] = partial[lid] + partial[lid + stride];
        }
        workgroupBarrier();
    }
    return 1.0 / sqrt(partial[0] / f32(cols) + eps);
}
