//! Small row-wise ops of the Qwen3.5 layers (norms, activations, RoPE).
//!
//! Each op names its HF counterpart in `transformers/models/qwen3_5/modeling_qwen3_5.py` (5.23).

use rayon::prelude::*;

/// Rows per rayon task for row-wise ops; below this many rows the op runs on the calling thread.
const PAR_ROWS: usize = 16;

/// RMSNorm with a zero-centred weight (HF `Qwen3_5RMSNorm`): `y = x·rsqrt(mean(x²)+eps)·(1+w)`, in place over rows of
/// `w.len()`. x: `[n_rows, dim]` f32.
pub fn rms_norm_1p(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert_eq!(x.len() % dim, 0, "rms_norm_1p: x is not [n, {dim}]");
    let f = |row: &mut [f32]| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, wi) in row.iter_mut().zip(w) {
            *v = (*v * r) * (1.0 + wi);
        }
    };
    if x.len() / dim >= PAR_ROWS {
        x.par_chunks_mut(dim).for_each(f);
    } else {
        x.chunks_mut(dim).for_each(f);
    }
}

/// Gated RMSNorm of the Gated DeltaNet output (HF `Qwen3_5RMSNormGated`): per head of `w.len()` dims,
/// `y = w·(o·rsqrt(mean(o²)+eps))·silu(z)` with the plain weight w. o, z: `[n_rows·n_heads, dim]` f32; o is overwritten.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert_eq!(o.len(), z.len(), "gated_rms_norm: o and z differ in size");
    let f = |(row, zr): (&mut [f32], &[f32])| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for ((v, wi), zi) in row.iter_mut().zip(w).zip(zr) {
            *v = (wi * (*v * r)) * silu(*zi);
        }
    };
    if o.len() / dim >= PAR_ROWS {
        o.par_chunks_mut(dim).zip(z.par_chunks(dim)).for_each(f);
    } else {
        o.chunks_mut(dim).zip(z.chunks(dim)).for_each(f);
    }
}

/// L2 normalisation over rows of `dim` (HF `l2norm`, eps 1e-6 fixed): `x·rsqrt(Σx² + 1e-6)·scale`.
pub fn l2_norm_scaled(x: &mut [f32], dim: usize, scale: f32) {
    for row in x.chunks_mut(dim) {
        let ss = row.iter().map(|v| v * v).sum::<f32>();
        let r = 1.0 / (ss + 1e-6).sqrt();
        for v in row.iter_mut() {
            *v = *v * r * scale;
        }
    }
}

/// The MLP activation `silu(gate) ⊙ up` of fused `[n_rows, 2·inter]` rows `[gate | up]` → `[n_rows, inter]`.
pub fn silu_mul_halves(gu: &[f32], inter: usize) -> Vec<f32> {
    let mut act = Vec::with_capacity(gu.len() / 2);
    for row in gu.chunks(2 * inter) {
        let (g, u) = row.split_at(inter);
        act.extend(g.iter().zip(u).map(|(g, u)| silu(*g) * u));
    }
    act
}

/// The attention output gate: `o ⊙ σ(gate)` in place (`o`, `gate`: the same shape).
pub fn sigmoid_gate(o: &mut [f32], gate: &[f32]) {
    for (x, g) in o.iter_mut().zip(gate) {
        *x *= sigmoid(*g);
    }
}

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

/// Copies column block `[c0, c0+width)` of a `[n_rows, n_cols]` matrix into a new `[n_rows, width]` one.
pub fn take_cols(x: &[f32], n_cols: usize, c0: usize, width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len() / n_cols * width);
    for row in x.chunks(n_cols) {
        out.extend_from_slice(&row[c0..c0 + width]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_1p_matches_the_formula_on_a_known_row() {
        let mut x = vec![1.0f32, -2.0, 3.0, -4.0];
        let w = vec![0.0f32, 0.5, -0.5, 1.0];
        rms_norm_1p(&mut x, &w, 0.0);
        let r = (7.5f32).sqrt();
        let want = [1.0 / r, -2.0 / r * 1.5, 3.0 / r * 0.5, -4.0 / r * 2.0];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
    }

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
