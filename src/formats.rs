//! Decoding of the storage formats: bf16, f16, f32, MXFP4 (E2M1 values with E8M0 scales).

use crate::weights::FloatFormat;

#[inline(always)]
pub fn bf16_to_f32(lo: u8, hi: u8) -> f32 {
    f32::from_bits((u16::from_le_bytes([lo, hi]) as u32) << 16)
}

#[inline(always)]
pub fn f16_to_f32(lo: u8, hi: u8) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// Decodes a little-endian float tensor into f32 (exact for every format).
pub fn decode_floats(format: FloatFormat, bytes: &[u8]) -> Vec<f32> {
    match format {
        FloatFormat::Bf16 => bytes
            .chunks_exact(2)
            .map(|b| bf16_to_f32(b[0], b[1]))
            .collect(),
        FloatFormat::F16 => bytes
            .chunks_exact(2)
            .map(|b| f16_to_f32(b[0], b[1]))
            .collect(),
        FloatFormat::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    }
}

/// E2M1 values by 4-bit code; bit 3 is the sign (code 8 is -0).
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// The E8M0 scale `2^(byte - 127)`, exact for every byte (255 gives +inf, as `ldexp` does in f32).
#[inline(always)]
pub fn e8m0_scale(byte: u8) -> f32 {
    match byte {
        0 => f32::from_bits(0x0040_0000), // 2^-127 is subnormal
        255 => f32::INFINITY,
        b => f32::from_bits((b as u32) << 23),
    }
}

/// Dequantizes one MXFP4 row: 16 bytes and one scale per 32 values, low nibble first.
pub fn dequantize_mxfp4_row(blocks: &[u8], scales: &[u8], out: &mut [f32]) {
    for (g, (group, &scale)) in blocks.chunks_exact(16).zip(scales).enumerate() {
        let s = e8m0_scale(scale);
        for (j, &byte) in group.iter().enumerate() {
            out[g * 32 + 2 * j] = FP4_VALUES[(byte & 0x0F) as usize] * s;
            out[g * 32 + 2 * j + 1] = FP4_VALUES[(byte >> 4) as usize] * s;
        }
    }
}

/// Dequantizes one group-scaled INT4 row: 16 bytes and one f16 scale per 32 values, low nibble
/// first, value = nibble - 8.
pub fn dequantize_int4_row(qweight: &[u8], scales: &[u8], out: &mut [f32]) {
    for (g, (group, scale)) in qweight
        .chunks_exact(16)
        .zip(scales.chunks_exact(2))
        .enumerate()
    {
        let s = f16_to_f32(scale[0], scale[1]);
        for (j, &byte) in group.iter().enumerate() {
            out[g * 32 + 2 * j] = ((byte & 0x0F) as i32 - 8) as f32 * s;
            out[g * 32 + 2 * j + 1] = ((byte >> 4) as i32 - 8) as f32 * s;
        }
    }
}

/// How a KV cache holds keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum KvFormat {
    /// f32: exact, the default.
    #[default]
    F32,
    /// f16, rounded to nearest even as each key and value is stored: half the GPU cache's bytes
    /// and reads. The CPU tier rounds the same way (its cache stays f32), so both tiers see the
    /// same keys.
    F16,
}

impl KvFormat {
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::F32 => "f32",
            KvFormat::F16 => "f16",
        }
    }

    pub fn bytes_per_value(self) -> usize {
        match self {
            KvFormat::F32 => 4,
            KvFormat::F16 => 2,
        }
    }

    /// Each value as this format holds it.
    pub fn round(self, values: &mut [f32]) {
        if self == KvFormat::F16 {
            for v in values {
                *v = half::f16::from_f32(*v).to_f32();
            }
        }
    }
}

impl std::str::FromStr for KvFormat {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<KvFormat, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(KvFormat::F32),
            "f16" => Ok(KvFormat::F16),
            _ => Err(format!("{text:?}: expected f32 or f16")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_nibble_order_and_negative_zero() {
        // byte 0x8F: low nibble 15 (-6) comes first, high nibble 8 (-0) second.
        let blocks: Vec<u8> = std::iter::once(0x8F)
            .chain(std::iter::repeat_n(0x21, 15))
            .collect();
        let mut out = [f32::NAN; 32];
        dequantize_mxfp4_row(&blocks, &[128], &mut out);
        assert_eq!(out[0], -12.0);
        assert_eq!(out[1], 0.0);
        assert!(out[1].is_sign_negative(), "code 8 is -0");
        assert_eq!((out[2], out[3]), (1.0, 2.0)); // 0x21: low 1 (0.5), high 2 (1.0), times 2
    }

    #[test]
    fn int4_values_are_signed_nibbles_times_the_group_scale() {
        let q: Vec<u8> = std::iter::once(0xF0)
            .chain(std::iter::repeat_n(0x88, 15))
            .collect();
        let scale = half::f16::from_f32(0.25).to_le_bytes();
        let mut out = [f32::NAN; 32];
        dequantize_int4_row(&q, &scale, &mut out);
        assert_eq!((out[0], out[1]), (-2.0, 1.75)); // low nibble 0 -> -8, high 15 -> 7
        assert!(out[2..].iter().all(|v| *v == 0.0));
    }

    #[test]
    fn e8m0_scales_are_exact_powers_of_two() {
        assert_eq!(e8m0_scale(127), 1.0);
        assert_eq!(e8m0_scale(128), 2.0);
        assert_eq!(e8m0_scale(118), 2f32.powi(-9));
        assert_eq!(e8m0_scale(1), 2f32.powi(-126));
        assert_eq!(e8m0_scale(0), 2f32.powi(-127));
        assert_eq!(e8m0_scale(254), 2f32.powi(127));
    }

    #[test]
    fn float_formats_decode_exactly() {
        let x: f32 = -1.5;
        let bf = half::bf16::from_f32(x).to_le_bytes();
        let f = half::f16::from_f32(x).to_le_bytes();
        assert_eq!(decode_floats(FloatFormat::Bf16, &bf), vec![x]);
        assert_eq!(decode_floats(FloatFormat::F16, &f), vec![x]);
        assert_eq!(decode_floats(FloatFormat::F32, &x.to_le_bytes()), vec![x]);
    }
}
