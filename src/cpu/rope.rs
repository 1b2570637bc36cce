//! Rotary position embeddings (NeoX half-split) with YaRN, computed in f32 as transformers does.

use crate::config::{Config, RopeKind};

pub struct RopeTable {
    inv_freq: Vec<f32>,
    attention_factor: f32,
    head_dim: usize,
}

impl RopeTable {
    pub fn new(cfg: &Config) -> RopeTable {
        let dim = cfg.head_dim;
        let half = dim / 2;
        let theta = cfg.rope.theta as f32;
        // pos_freqs[i] = base^(2i/dim) in f32.
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| {
                let exponent = (2 * i) as f32 / dim as f32;
                (theta as f64).powf(exponent as f64) as f32
            })
            .collect();
        let (inv_freq, attention_factor) = match cfg.rope.kind {
            RopeKind::Default => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            RopeKind::Yarn {
                factor,
                low,
                mut high,
                attention_factor,
            } => {
                if low == high {
                    high += 0.001; // transformers avoids the singularity this way
                }
                let span = (high - low) as f32;
                let inv: Vec<f32> = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor as f32 * p);
                        let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor)
                            + extrapolation * extrapolation_factor
                    })
                    .collect();
                (inv, attention_factor as f32)
            }
        };
        RopeTable {
            inv_freq,
            attention_factor,
            head_dim: dim,
        }
    }

    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn attention_factor(&self) -> f32 {
        self.attention_factor
    }

    /// cos and sin (attention factor applied) for one position, `head_dim / 2` each.
    pub fn cos_sin(&self, position: usize) -> (Vec<f32>, Vec<f32>) {
        let p = position as f32;
        self.inv_freq
            .iter()
            .map(|f| {
                let angle = (p * f) as f64;
                // Correctly rounded cos/sin of the f32 angle.
                (
                    angle.cos() as f32 * self.attention_factor,
                    angle.sin() as f32 * self.attention_factor,
                )
            })
            .unzip()
    }

    /// Rotates every head of `x` (`n * head_dim` values) in place.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.head_dim / 2;
        for head in x.chunks_exact_mut(self.head_dim) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (a, b) = (x1[i], x2[i]);
                x1[i] = a * cos[i] - b * sin[i];
                x2[i] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[allow(clippy::excessive_precision)]
    /// Values from transformers' `_compute_yarn_parameters` for the real 20B config (SEMANTICS.md).
    const INV_FREQ_D64: [f32; 32] = [
        1.0,
        6.890443e-1,
        4.747821e-1,
        3.271459e-1,
        2.254180e-1,
        1.553230e-1,
        1.070244e-1,
        7.374457e-2,
        5.081327e-2,
        3.170570e-2,
        1.933500e-2,
        1.159205e-2,
        6.794959e-3,
        3.860359e-3,
        2.093792e-3,
        1.052602e-3,
        4.564839e-4,
        1.293187e-4,
        3.830881e-5,
        2.639647e-5,
        1.818834e-5,
        1.253257e-5,
        8.635496e-6,
        5.950239e-6,
        4.099978e-6,
        2.825067e-6,
        1.946596e-6,
        1.341291e-6,
        9.242090e-7,
        6.368209e-7,
        4.387978e-7,
        3.023511e-7,
    ];

    #[test]
    fn yarn_inv_freq_of_the_real_config() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/gpt-oss-20b.config.json");
        let cfg = Config::load_file(&path).unwrap();
        let rope = RopeTable::new(&cfg);
        for (i, (got, want)) in rope.inv_freq().iter().zip(INV_FREQ_D64).enumerate() {
            assert!(
                (got - want).abs() <= 2e-6 * want,
                "inv_freq[{i}]: {got} vs {want}"
            );
        }
        assert!((rope.attention_factor() - 1.3465736).abs() < 1e-6);
    }

    #[test]
    fn rotation_pairs_element_i_with_i_plus_half() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/gpt-oss-20b.config.json");
        let rope = RopeTable::new(&Config::load_file(&path).unwrap());
        let (cos, sin) = rope.cos_sin(5);
        // x = e_0: rotates into the first and the (D/2)-th elements: (cos, sin) at frequency 0.
        let mut x = vec![0f32; 64];
        x[0] = 1.0;
        rope.apply(&mut x, &cos, &sin);
        let m = rope.attention_factor();
        assert!(
            (x[0] - 5f32.cos() * m).abs() < 1e-6 && (x[32] - 5f32.sin() * m).abs() < 1e-6,
            "{x:?}"
        );
        assert!(
            x.iter()
                .enumerate()
                .all(|(i, v)| i == 0 || i == 32 || *v == 0.0)
        );
        // x = e_{D/2}: (-sin, cos).
        let mut y = vec![0f32; 64];
        y[32] = 1.0;
        rope.apply(&mut y, &cos, &sin);
        assert!((y[0] + 5f32.sin() * m).abs() < 1e-6 && (y[32] - 5f32.cos() * m).abs() < 1e-6);
    }

    #[test]
    fn rotation_at_position_zero_only_scales() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/configs/gpt-oss-20b.config.json");
        let rope = RopeTable::new(&Config::load_file(&path).unwrap());
        let (cos, sin) = rope.cos_sin(0);
        let mut x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        rope.apply(&mut x, &cos, &sin);
        for (i, v) in x.iter().enumerate() {
            assert_eq!(*v, i as f32 * rope.attention_factor());
        }
    }
}
