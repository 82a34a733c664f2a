//! Row-wise and element-wise ops of the Qwen3.5 layers: the two RMSNorms, the l2 norm, the MLP and attention-gate
//! activations and the residual add — vectorized and split over the pool's threads.
//!
//! Each names its Hugging Face counterpart in `transformers/models/qwen3_5/modeling_qwen3_5.py` (5.23). SiLU and the
//! sigmoid use libm's `exp`. The RMSNorms accumulate their sums of squares in f64 lanes in a fixed order; the l2 norm
//! of the Gated DeltaNet q/k heads sums in order in f32 (on the reference fixtures, whose large weights amplify
//! rounding, these choices keep prefill logits nearest the float64 truth). Every result is the same bits on every
//! instruction set and thread count.

use crate::parallel::{for_each_chunk_mut, rows_per_task};
use crate::simd::{dispatch, exp_rounded, Isa, Kernel};

/// Below this many elements an op runs on the calling thread.
const PAR_MIN: usize = 1 << 15;

/// RMSNorm (HF `Qwen3_5RMSNorm`): `out = x·rsqrt(mean(x²) + eps)·g` per row of `g.len()` elements, with the
/// effective gain `g = 1 + w` of the zero-centred checkpoint weight `w` (the loader computes it in f32, as
/// transformers does; llama.cpp's GGUF files store it so). x, out: `[n_rows, dim]` f32.
///
/// Panics if the lengths are not multiples of `w.len()` or differ.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let dim = w.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "rms_norm: x is not [n, {dim}]"
    );
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    let rows = rows_per_task(x.len() / dim, dim, PAR_MIN);
    for_each_chunk_mut(out, rows * dim, |i, o| {
        let src = &x[i * rows * dim..i * rows * dim + o.len()];
        dispatch(RmsNorm {
            x: src,
            w,
            eps,
            out: o,
        });
    });
}

/// [`rms_norm`] in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "rms_norm: x is not [n, {dim}]"
    );
    let rows = rows_per_task(x.len() / dim, dim, PAR_MIN);
    for_each_chunk_mut(x, rows * dim, |_, c| {
        dispatch(RmsNormInPlace { x: c, w, eps })
    });
}

/// Gated RMSNorm of the Gated DeltaNet output (HF `Qwen3_5RMSNormGated`): per head of `w.len()` dims,
/// `o ← w·(o·rsqrt(mean(o²) + eps))·silu(z)` with the plain weight w. o, z: `[n_rows·n_heads, dim]` f32.
///
/// Panics if the lengths differ or are not multiples of `w.len()`.
pub fn gated_rms_norm(o: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    let dim = w.len();
    assert!(
        dim > 0 && o.len().is_multiple_of(dim),
        "gated_rms_norm: o is not [n, {dim}]"
    );
    assert_eq!(o.len(), z.len(), "gated_rms_norm: o and z differ in length");
    let rows = rows_per_task(o.len() / dim, dim, PAR_MIN);
    for_each_chunk_mut(o, rows * dim, |i, c| {
        let zc = &z[i * rows * dim..i * rows * dim + c.len()];
        dispatch(GatedNorm {
            o: c,
            z: zc,
            w,
            eps,
        });
    });
}

/// L2 normalisation over rows of `dim` (HF `l2norm`, eps fixed at 1e-6): `x ← x·rsqrt(Σx² + 1e-6)·scale`.
///
/// Panics if `x.len()` is not a multiple of `dim`.
pub fn l2_norm_scaled(x: &mut [f32], dim: usize, scale: f32) {
    assert!(
        dim > 0 && x.len().is_multiple_of(dim),
        "l2_norm_scaled: x is not [n, {dim}]"
    );
    let rows = rows_per_task(x.len() / dim, dim, PAR_MIN);
    for_each_chunk_mut(x, rows * dim, |_, c| dispatch(L2Norm { x: c, dim, scale }));
}

/// The MLP activation on fused rows `[gate | up]` (`[n_rows, 2·inter]`): `out = silu(gate) ⊙ up` (`[n_rows, inter]`),
/// `silu(g) = g / (1 + e^{−g})`.
///
/// Panics on mismatched lengths.
pub fn silu_mul_halves(gu: &[f32], inter: usize, out: &mut [f32]) {
    assert!(
        inter > 0 && gu.len().is_multiple_of(2 * inter),
        "silu_mul_halves: gu is not [n, 2·{inter}]"
    );
    assert_eq!(
        out.len() * 2,
        gu.len(),
        "silu_mul_halves: out is not [n, {inter}]"
    );
    let rows = rows_per_task(out.len() / inter, 2 * inter, PAR_MIN);
    for_each_chunk_mut(out, rows * inter, |i, o| {
        let src = &gu[i * rows * 2 * inter..i * rows * 2 * inter + 2 * o.len()];
        dispatch(SiluMul {
            gu: src,
            inter,
            out: o,
        });
    });
}

/// The attention output gate (HF: `attn_output * sigmoid(gate)`): `o ← o·σ(gate)` element-wise.
///
/// Panics if the lengths differ.
pub fn sigmoid_mul(o: &mut [f32], gate: &[f32]) {
    assert_eq!(
        o.len(),
        gate.len(),
        "sigmoid_mul: o and gate differ in length"
    );
    let chunk = rows_per_task(o.len(), 1, PAR_MIN);
    for_each_chunk_mut(o, chunk, |i, c| {
        let g = &gate[i * chunk..i * chunk + c.len()];
        dispatch(SigmoidMul { o: c, g });
    });
}

/// The residual add `x ← x + y`.
///
/// Panics if the lengths differ.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add_assign: lengths differ");
    let chunk = rows_per_task(x.len(), 1, PAR_MIN);
    for_each_chunk_mut(x, chunk, |i, c| {
        let src = &y[i * chunk..i * chunk + c.len()];
        for (a, b) in c.iter_mut().zip(src) {
            *a += b;
        }
    });
}

/// `x / (1 + e^{−x})` with the rounded `e^x` of [`exp_rounded`] (as accurate as libm's `expf`, but vectorized: the
/// 2-ulp `exp_fast` of the kernels moved the fixtures' KV caches by more than 1e-4 from transformers', so
/// activations keep an accurate one).
#[inline(always)]
pub(crate) fn silu_exact(x: f32) -> f32 {
    x / (1.0 + exp_rounded(-x))
}

/// `1 / (1 + e^{−x})` with [`exp_rounded`] (see [`silu_exact`]).
#[inline(always)]
fn sigmoid_exact(x: f32) -> f32 {
    1.0 / (1.0 + exp_rounded(-x))
}

/// `Σ x²` accumulated in f64 over 8 interleaved lanes (fixed order, vectorizable); callers round it once to f32.
/// Norms feed every layer and the Gated DeltaNet amplifies their rounding, so they are computed more accurately than
/// a plain f32 sum; the cost is one pass over the row.
#[inline(always)]
fn sum_sq(row: &[f32]) -> f64 {
    let mut acc = [0.0f64; 8];
    let mut c = row.chunks_exact(8);
    for v in &mut c {
        for l in 0..8 {
            acc[l] += f64::from(v[l]) * f64::from(v[l]);
        }
    }
    for (l, v) in c.remainder().iter().enumerate() {
        acc[l] += f64::from(*v) * f64::from(*v);
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// `rsqrt(Σ x² / dim + eps)`: from `Σ x²` rounded to f32, or, where that sum exceeds f32's range (above ~3.4e38, which
/// a broken checkpoint's hidden state can reach with finite values), in f64 and rounded once, so
/// that such a row is normalized instead of scaled to zeros (an f32 `rsqrt(inf)`). A NaN or an infinity in the row
/// still gives NaN outputs (`inf·0`), which the engine's non-finite check reports.
#[inline(always)]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let ss = sum_sq(row);
    let s = ss as f32;
    if s.is_finite() {
        1.0 / (s / row.len() as f32 + eps).sqrt()
    } else {
        (1.0 / (ss / row.len() as f64 + f64::from(eps)).sqrt()) as f32
    }
}

struct RmsNorm<'a> {
    x: &'a [f32],
    w: &'a [f32],
    eps: f32,
    out: &'a mut [f32],
}

impl Kernel for RmsNorm<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        let dim = self.w.len();
        for (row, o) in self.x.chunks_exact(dim).zip(self.out.chunks_exact_mut(dim)) {
            let r = inv_rms(row, self.eps);
            for ((y, v), w) in o.iter_mut().zip(row).zip(self.w) {
                *y = (v * r) * w;
            }
        }
    }
}

struct RmsNormInPlace<'a> {
    x: &'a mut [f32],
    w: &'a [f32],
    eps: f32,
}

impl Kernel for RmsNormInPlace<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        let dim = self.w.len();
        for row in self.x.chunks_exact_mut(dim) {
            let r = inv_rms(row, self.eps);
            for (v, w) in row.iter_mut().zip(self.w) {
                *v = (*v * r) * w;
            }
        }
    }
}

struct GatedNorm<'a> {
    o: &'a mut [f32],
    z: &'a [f32],
    w: &'a [f32],
    eps: f32,
}

impl Kernel for GatedNorm<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        let dim = self.w.len();
        for (row, zr) in self.o.chunks_exact_mut(dim).zip(self.z.chunks_exact(dim)) {
            let r = inv_rms(row, self.eps);
            for ((v, w), z) in row.iter_mut().zip(self.w).zip(zr) {
                *v = (w * (*v * r)) * silu_exact(*z);
            }
        }
    }
}

struct L2Norm<'a> {
    x: &'a mut [f32],
    dim: usize,
    scale: f32,
}

impl Kernel for L2Norm<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        for row in self.x.chunks_exact_mut(self.dim) {
            let ss = row.iter().map(|v| v * v).sum::<f32>();
            // Past f32's range (Σ x² above ~3.4e38) the f32 sum is infinite and would scale the row to zeros:
            // normalize it from the f64 sum of `sum_sq` instead (rows in range keep their bits; NaN stays NaN).
            let r = if ss.is_finite() {
                1.0 / (ss + 1e-6).sqrt()
            } else {
                (1.0 / (sum_sq(row) + 1e-6).sqrt()) as f32
            };
            for v in row.iter_mut() {
                *v = *v * r * self.scale;
            }
        }
    }
}

/// `out = silu(g) ⊙ u` element-wise (the per-element operation of [`silu_mul_halves`], so the same bits).
///
/// Panics if the lengths differ.
pub(crate) fn silu_mul_into(g: &[f32], u: &[f32], out: &mut [f32]) {
    assert!(
        g.len() == out.len() && u.len() == out.len(),
        "silu_mul_into: lengths differ"
    );
    dispatch(SiluMulInto { g, u, out });
}

struct SiluMulInto<'a> {
    g: &'a [f32],
    u: &'a [f32],
    out: &'a mut [f32],
}

impl Kernel for SiluMulInto<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        for ((y, g), u) in self.out.iter_mut().zip(self.g).zip(self.u) {
            *y = silu_exact(*g) * u;
        }
    }
}

struct SiluMul<'a> {
    gu: &'a [f32],
    inter: usize,
    out: &'a mut [f32],
}

impl Kernel for SiluMul<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        for (row, o) in self
            .gu
            .chunks_exact(2 * self.inter)
            .zip(self.out.chunks_exact_mut(self.inter))
        {
            let (g, u) = row.split_at(self.inter);
            for ((y, g), u) in o.iter_mut().zip(g).zip(u) {
                *y = silu_exact(*g) * u;
            }
        }
    }
}

struct SigmoidMul<'a> {
    o: &'a mut [f32],
    g: &'a [f32],
}

impl Kernel for SigmoidMul<'_> {
    type Out = ();
    #[inline(always)]
    fn run<I: Isa>(self, _: I) {
        for (x, g) in self.o.iter_mut().zip(self.g) {
            *x *= sigmoid_exact(*g);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(n: usize, dim: usize) -> Vec<f32> {
        (0..n * dim)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.031)
            .collect()
    }

    #[test]
    fn rms_norm_matches_the_formula_in_f64() {
        let (n, dim) = (300, 70);
        let x = rows(n, dim);
        let w: Vec<f32> = (0..dim).map(|i| i as f32 * 0.01 + 0.7).collect();
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-6, &mut out);
        let mut inplace = x.clone();
        rms_norm_inplace(&mut inplace, &w, 1e-6);
        assert_eq!(out, inplace);
        for (row, o) in x.chunks(dim).zip(out.chunks(dim)) {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let r = 1.0 / (ms + 1e-6).sqrt();
            for ((v, w), y) in row.iter().zip(&w).zip(o) {
                let want = *v as f64 * r * *w as f64;
                assert!(
                    (*y as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "{y} vs {want}"
                );
            }
        }
    }

    #[test]
    fn norms_of_a_row_past_f32s_squares_normalize_it() {
        // Σ x² = 4 · 1e40 overflows f32; the norm still gives x / rms(x) = ±1 (times the weights), not zeros.
        let x = [1e20f32, -1e20, 1e20, -1e20];
        let w = [1.0f32, 2.0, 0.5, 1.0];
        let mut out = [0.0f32; 4];
        rms_norm(&x, &w, 1e-6, &mut out);
        assert_eq!(out, [1.0, -2.0, 0.5, -1.0]);
        // The same for the L2 norm of the delta rule's q and k.
        let mut z = [1e20f32, -1e20, 1e20, -1e20];
        l2_norm_scaled(&mut z, 4, 1.0);
        assert_eq!(z, [0.5, -0.5, 0.5, -0.5]);
        // An infinity still poisons the row (the engine's non-finite check then reports it).
        let mut y = [f32::INFINITY, 1.0, 2.0, 3.0];
        rms_norm_inplace(&mut y, &w, 1e-6);
        assert!(y[0].is_nan(), "{y:?}");
    }

    #[test]
    fn activations_match_their_libm_forms_within_a_few_ulp() {
        let inter = 40;
        let gu = rows(50, 2 * inter);
        let mut out = vec![0.0; 50 * inter];
        silu_mul_halves(&gu, inter, &mut out);
        for (row, o) in gu.chunks(2 * inter).zip(out.chunks(inter)) {
            for j in 0..inter {
                let (g, u) = (row[j] as f64, row[inter + j] as f64);
                let want = g / (1.0 + (-g).exp()) * u;
                assert!(
                    (o[j] as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-30
                );
            }
        }
        let mut o = rows(1, 5000);
        let gate = rows(1, 5000);
        let orig = o.clone();
        sigmoid_mul(&mut o, &gate);
        for ((y, x), g) in o.iter().zip(&orig).zip(&gate) {
            let want = *x as f64 / (1.0 + (-(*g as f64)).exp());
            assert!((*y as f64 - want).abs() <= 4.0 * f32::EPSILON as f64 * want.abs() + 1e-30);
        }
        let mut a = vec![1.0f32; 70_000];
        add_assign(&mut a, &vec![0.5; 70_000]);
        assert!(a.iter().all(|v| *v == 1.5));
    }

    #[test]
    fn gated_and_l2_norms_match_the_formulas() {
        let dim = 64;
        let mut o = rows(40, dim);
        let z = rows(40, dim);
        let w: Vec<f32> = (0..dim).map(|i| 1.0 + i as f32 * 0.01).collect();
        let orig = o.clone();
        gated_rms_norm(&mut o, &z, &w, 1e-6);
        for ((row, zr), got) in orig.chunks(dim).zip(z.chunks(dim)).zip(o.chunks(dim)) {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / dim as f64;
            let r = 1.0 / (ms + 1e-6).sqrt();
            for j in 0..dim {
                let zj = zr[j] as f64;
                let want = w[j] as f64 * row[j] as f64 * r * zj / (1.0 + (-zj).exp());
                assert!((got[j] as f64 - want).abs() <= 1e-5 * (1.0 + want.abs()));
            }
        }
        let mut x = rows(10, dim);
        l2_norm_scaled(&mut x, dim, 0.5);
        for row in x.chunks(dim) {
            let n = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>().sqrt();
            assert!((n - 0.5).abs() < 1e-5, "{n}");
        }
    }
}
