//! Scalar activations of the Gated DeltaNet gates and partial RoPE (the row-wise norms and vectorized activations
//! are in `backburner_kernels::rowops`).
//!
//! Each op names its HF counterpart in `transformers/models/qwen3_5/modeling_qwen3_5.py` (5.23).

use rayon::prelude::*;

/// Rows per rayon task for row-wise ops; below this many rows the op runs on the calling thread.
const PAR_ROWS: usize = 16;

/// SiLU `x·σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Logistic sigmoid.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Softplus as torch computes it (`beta = 1`, linear above `threshold = 20`).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Precomputed inverse frequencies for partial NeoX RoPE (HF `Qwen3_5TextRotaryEmbedding`):
/// `inv_freq[j] = θ^(-2j/R)` for `j < R/2`, R = rotary dims.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
    head_dim: usize,
}

impl Rope {
    /// Builds the table for `rotary_dim` (R, even) of `head_dim` and base `theta`.
    pub fn new(rotary_dim: usize, head_dim: usize, theta: f64) -> Self {
        let inv_freq = (0..rotary_dim / 2)
            .map(|j| (1.0 / theta.powf((2 * j) as f64 / rotary_dim as f64)) as f32)
            .collect();
        Rope {
            inv_freq,
            rotary_dim,
            head_dim,
        }
    }

    /// The inverse frequencies `θ^(-2j/R)`, `[R/2]` (for a compute backend that applies the rotation itself).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The head dimension the table is for (the rotation applies to the first `2·inv_freq().len()` of each head).
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rotates the first R dims of every head in place: `x_rot' = x_rot·cos + rotate_half(x_rot)·sin`,
    /// `rotate_half([a, b]) = [−b, a]`. x: `[n_tokens, n_heads, head_dim]`, token t at absolute position `pos0 + t`.
    pub fn apply(&self, x: &mut [f32], n_tokens: usize, n_heads: usize, pos0: usize) {
        let hd = self.head_dim;
        assert_eq!(x.len(), n_tokens * n_heads * hd, "rope: x is not [T, H, D]");
        let half = self.rotary_dim / 2;
        let f = |(t, tok): (usize, &mut [f32])| {
            let pos = (pos0 + t) as f32;
            let (cos, sin): (Vec<f32>, Vec<f32>) = self
                .inv_freq
                .iter()
                .map(|f| {
                    let a = pos * f;
                    (a.cos(), a.sin())
                })
                .unzip();
            for head in tok.chunks_mut(hd) {
                for j in 0..half {
                    let a = head[j];
                    let b = head[j + half];
                    head[j] = a * cos[j] - b * sin[j];
                    head[j + half] = b * cos[j] + a * sin[j];
                }
            }
        };
        if n_tokens >= PAR_ROWS {
            x.par_chunks_mut(n_heads * hd).enumerate().for_each(f);
        } else {
            x.chunks_mut(n_heads * hd).enumerate().for_each(f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_at_position_zero_is_identity_and_rotates_only_the_first_r_dims() {
        let rope = Rope::new(4, 8, 10_000.0);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 + 0.3).collect();
        let mut x = orig.clone();
        rope.apply(&mut x, 1, 2, 0);
        assert_eq!(x, orig);
        let mut y = orig.clone();
        rope.apply(&mut y, 1, 2, 7);
        // pass-through dims 4..8 of each head unchanged
        assert_eq!(&y[4..8], &orig[4..8]);
        assert_eq!(&y[12..16], &orig[12..16]);
        // dim 0/2 pair rotated by angle 7·θ^0 = 7 rad
        let (c, s) = (7.0f32.cos(), 7.0f32.sin());
        assert!((y[0] - (orig[0] * c - orig[2] * s)).abs() < 1e-6);
        assert!((y[2] - (orig[2] * c + orig[0] * s)).abs() < 1e-6);
    }

    #[test]
    fn softplus_matches_torch_threshold() {
        assert_eq!(softplus(25.0), 25.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
    }
}
