//! 8-bit dense weights: the CPU tier's optional faster numeric mode (`--dense-format q8`, never
//! the default). Each row is cut into groups of 32 values, each stored as 32 signed bytes and
//! one f16 scale (the value layout of llama.cpp's q8_0, in two arrays): 1.0625 bytes per weight
//! instead of bf16's 2, so a decoded token reads about a third fewer bytes on GPT-OSS-20B.
//! Activations stay f32: only the weights are rounded.

use rayon::prelude::*;

use super::matmul::decode_at;
use crate::error::{Error, Result};
use crate::formats::f16_to_f32;
use crate::weights::{DenseMatrix, TensorBytes};

/// A dense matrix quantized to 8 bits per weight, one f16 scale per 32 consecutive inputs.
#[derive(Debug, Clone)]
pub struct Q8Matrix {
    pub rows: usize,
    pub cols: usize,
    /// `[rows, cols]` signed bytes.
    pub values: TensorBytes,
    /// `[rows, cols / 32]` little-endian f16.
    pub scales: TensorBytes,
}

impl Q8Matrix {
    /// Quantizes `m` row by row (in parallel): scale = max|w| / 127 of the group (as f16), value
    /// = w / scale rounded to nearest. `name` is for the error when the rows are not whole groups.
    pub fn quantize(m: &DenseMatrix, name: &str) -> Result<Q8Matrix> {
        if !m.cols.is_multiple_of(32) {
            return Err(Error::Unsupported(format!(
                "{name}: rows of {} values cannot be quantized to q8 (groups of 32)",
                m.cols
            )));
        }
        let groups = m.cols / 32;
        let huge = |len| crate::weights::huge_buffer(len).map_err(|e| Error::io(name, e));
        let (mut values, mut scales) = (huge(m.rows * m.cols)?, huge(m.rows * groups * 2)?);
        values
            .par_chunks_mut(m.cols)
            .zip(scales.par_chunks_mut(groups * 2))
            .enumerate()
            .for_each(|(r, (values, scales))| quantize_row(m, r, values, scales));
        let freeze = |b| crate::weights::freeze(b).map_err(|e| Error::io(name, e));
        Ok(Q8Matrix {
            rows: m.rows,
            cols: m.cols,
            values: freeze(values)?,
            scales: freeze(scales)?,
        })
    }

    /// The values and scale bytes of row `r`.
    pub fn row(&self, r: usize) -> (&[u8], &[u8]) {
        self.rows(r..r + 1)
    }

    /// The values and scale bytes of rows `rows`, back to back.
    pub fn rows(&self, rows: std::ops::Range<usize>) -> (&[u8], &[u8]) {
        let scale_bytes = self.cols / 32 * 2;
        (
            &self.values.bytes()[rows.start * self.cols..rows.end * self.cols],
            &self.scales.bytes()[rows.start * scale_bytes..rows.end * scale_bytes],
        )
    }

    /// Row `r` as f32 (an embedding lookup).
    pub fn decode_row(&self, r: usize) -> Vec<f32> {
        let (values, scales) = self.row(r);
        values
            .chunks_exact(32)
            .zip(scales.chunks_exact(2))
            .flat_map(|(group, s)| {
                let scale = f16_to_f32(s[0], s[1]);
                group.iter().map(move |&v| v as i8 as f32 * scale)
            })
            .collect()
    }

    /// Bytes of values and scales.
    pub fn bytes(&self) -> usize {
        self.values.bytes().len() + self.scales.bytes().len()
    }
}

/// Quantizes row `r` of `m` into `values` and its group scales into `scales`.
fn quantize_row(m: &DenseMatrix, r: usize, values: &mut [u8], scales: &mut [u8]) {
    let row = m.row(r);
    let mut weights = [0f32; 32];
    for (g, (out, scale_out)) in values
        .chunks_exact_mut(32)
        .zip(scales.chunks_exact_mut(2))
        .enumerate()
    {
        for (k, w) in weights.iter_mut().enumerate() {
            *w = decode_at(m.format, row, 32 * g + k);
        }
        let max = weights.iter().fold(0f32, |a, w| a.max(w.abs()));
        // The scale as stored (f16), so values are rounded against the scale the kernels use.
        let scale = half::f16::from_f32(max / 127.0);
        let inverse = if scale.to_f32() > 0.0 {
            1.0 / scale.to_f32()
        } else {
            0.0
        };
        for (o, w) in out.iter_mut().zip(&weights) {
            *o = (w * inverse).round().clamp(-127.0, 127.0) as i8 as u8;
        }
        scale_out.copy_from_slice(&scale.to_le_bytes());
    }
}

/// The scalar reference q8 dot product: per group, the sum of value x input, times the scale.
pub fn dot_q8_scalar(values: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(values.len(), x.len());
    let mut total = 0f32;
    for ((group, s), xs) in values
        .chunks_exact(32)
        .zip(scales.chunks_exact(2))
        .zip(x.chunks_exact(32))
    {
        let mut acc = [0f32; 8];
        for (j, (&v, xj)) in group.iter().zip(xs).enumerate() {
            acc[j % 8] += v as i8 as f32 * xj;
        }
        let sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        total += sum * f16_to_f32(s[0], s[1]);
    }
    total
}

/// A q8 linear layer over one or more tokens: `out[t][r] = row r . xs[t] + bias[r]`.
pub fn q8_matmul(m: &Q8Matrix, xs: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    let kernel = super::simd::q8_dot(super::simd::kernels());
    let shape = (m.rows, m.cols, m.cols + m.cols / 32 * 2);
    super::matmul::packed_matmul(kernel, shape, xs, bias, out, |rows| m.rows(rows));
}

/// The dense weights the CPU tier reads per token, quantized: attention projections of every
/// layer, the LM head and the embeddings (as rows). Routers stay exact: they are small and
/// their top-k choices are what a rounding error would change first.
pub struct Q8Weights {
    /// Per layer: q, k, v, o.
    pub layers: Vec<[Q8Matrix; 4]>,
    pub lm_head: Q8Matrix,
    pub embeddings: Q8Matrix,
}

impl Q8Weights {
    /// Quantizes `weights`' dense matrices, releasing each mapped original once its copy is
    /// made (the process keeps no page of it; the OS page cache may).
    pub fn quantize(weights: &crate::weights::ModelWeights) -> Result<Q8Weights> {
        let convert = |m: &DenseMatrix, name: String| -> Result<Q8Matrix> {
            let q = Q8Matrix::quantize(m, &name)?;
            m.data.release();
            Ok(q)
        };
        let layers = weights
            .layers
            .iter()
            .enumerate()
            .map(|(l, w)| {
                let names = crate::arch::gpt_oss::layer_tensors(l);
                Ok([
                    convert(&w.q, names.q)?,
                    convert(&w.k, names.k)?,
                    convert(&w.v, names.v)?,
                    convert(&w.o, names.o)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Q8Weights {
            layers,
            lm_head: convert(&weights.lm_head, crate::arch::gpt_oss::LM_HEAD.into())?,
            embeddings: convert(&weights.embeddings, crate::arch::gpt_oss::EMBEDDINGS.into())?,
        })
    }

    /// Bytes of every quantized matrix.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .chain([&self.lm_head, &self.embeddings])
            .map(Q8Matrix::bytes)
            .sum()
    }
}

/// How the CPU tier holds dense weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub enum DenseFormat {
    /// As the checkpoint stores them (bf16 for GPT-OSS): exact.
    #[default]
    Checkpoint,
    /// 8 bits per weight (see the module documentation): faster, not exact.
    Q8,
}

impl DenseFormat {
    pub fn name(self) -> &'static str {
        match self {
            DenseFormat::Checkpoint => "checkpoint",
            DenseFormat::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for DenseFormat {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<DenseFormat, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "checkpoint" | "bf16" => Ok(DenseFormat::Checkpoint),
            "q8" => Ok(DenseFormat::Q8),
            _ => Err(format!("{text:?}: expected checkpoint (bf16) or q8")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::FloatFormat;

    fn bf16_matrix(rows: usize, cols: usize) -> DenseMatrix {
        let values: Vec<f32> = (0..rows * cols)
            .map(|i| ((i as f32) * 0.7311).sin() * (1.0 + (i % 97) as f32 / 10.0))
            .collect();
        DenseMatrix {
            rows,
            cols,
            format: FloatFormat::Bf16,
            data: TensorBytes::from_vec(
                values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            ),
        }
    }

    #[test]
    fn quantized_weights_are_within_half_a_step_of_the_originals() {
        let m = bf16_matrix(5, 96);
        let q = Q8Matrix::quantize(&m, "test").unwrap();
        for r in 0..m.rows {
            let decoded = q.decode_row(r);
            let (_, scales) = q.row(r);
            for (k, d) in decoded.iter().enumerate() {
                let original = decode_at(m.format, m.row(r), k);
                let s = scales.chunks_exact(2).nth(k / 32).unwrap();
                let step = f16_to_f32(s[0], s[1]);
                assert!(
                    (d - original).abs() <= step * 0.5 + 1e-6,
                    "row {r} value {k}: {d} vs {original} (step {step})"
                );
            }
        }
    }

    #[test]
    fn rows_that_are_not_whole_groups_are_refused_by_name() {
        let err = Q8Matrix::quantize(&bf16_matrix(2, 40), "model.x.weight").unwrap_err();
        assert!(err.to_string().contains("model.x.weight"), "{err}");
    }

    #[test]
    fn matmul_matches_the_dequantized_weights() {
        let m = bf16_matrix(7, 64);
        let q = Q8Matrix::quantize(&m, "test").unwrap();
        let xs: Vec<f32> = (0..3 * 64).map(|i| ((i as f32) * 0.29).cos()).collect();
        let bias: Vec<f32> = (0..7).map(|r| r as f32).collect();
        // One token (decode: two streams of rows, the odd last row alone) and three (tiles).
        for tokens in [1, 3] {
            let xs = &xs[..tokens * 64];
            let mut out = vec![0f32; tokens * 7];
            q8_matmul(&q, xs, Some(&bias), &mut out);
            for t in 0..tokens {
                for r in 0..7 {
                    let w = q.decode_row(r);
                    let x = &xs[t * 64..(t + 1) * 64];
                    let exact: f64 = w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let got = out[t * 7 + r] as f64 - r as f64;
                    assert!((got - exact).abs() < 1e-4, "t {t} r {r}: {got} vs {exact}");
                }
            }
        }
    }
}
