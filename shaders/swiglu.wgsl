// GPT-OSS's clamped SwiGLU of one unit's gate and up values, shared by moe.wgsl and experts.wgsl:
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

fn clamped_swiglu(gate_value: f32, up_value: f32, alpha: f32, limit: f32) -> f32 {
    let gate = min(gate_value, limit);
    let up = clamp(up_value, -limit, limit);
    let glu = gate * (1.0 / (1.0 + exp(-(gate * alpha))));
    return (up + 1.0) * glu;
}
