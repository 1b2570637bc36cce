//! RMSNorm as GPT-OSS uses it: `w * (x / sqrt(mean(x^2) + eps))`, weight applied directly.

use rayon::prelude::*;

/// Normalizes each `w.len()`-long row of `x` into `out`, rows in parallel (a block's rows are
/// independent; one at a time they left the other threads idle in a long prefill).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    assert_eq!(x.len(), out.len());
    let norm_row = |(xs, ys): (&[f32], &mut [f32])| {
        // Mean of squares accumulated in f64: within half an ulp of the exact f32 mean.
        let mean = (xs.iter().map(|v| (*v as f64) * (*v as f64)).sum::<f64>() / n as f64) as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((y, v), wi) in ys.iter_mut().zip(xs).zip(w) {
            *y = wi * (v * inv);
        }
    };
    if x.len() == n {
        norm_row((x, out)); // Decode: one row, no task to hand out.
    } else {
        x.par_chunks_exact(n)
            .zip(out.par_chunks_exact_mut(n))
            .for_each(norm_row);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, -2.0, 3.0, -4.0];
        let w = [1.0f32, 0.5, 2.0, -1.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &w, 1e-5, &mut out);
        let rms = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0 + 1e-5f64).sqrt();
        for k in 0..4 {
            let want = w[k] as f64 * x[k] as f64 / rms;
            assert!(
                (out[k] as f64 - want).abs() < 1e-6,
                "{k}: {} vs {want}",
                out[k]
            );
        }
    }

    #[test]
    fn rms_norm_of_zeros_is_zero_not_nan() {
        let mut out = [1f32; 8];
        rms_norm(&[0.0; 8], &[1.0; 8], 1e-5, &mut out);
        assert!(out.iter().all(|v| *v == 0.0));
    }
}
