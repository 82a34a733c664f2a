//! The gated delta rule one token at a time (decode path).

use rayon::prelude::*;

use super::flush::FlushSubnormals;
use super::{gather_head, scatter_heads, GdnDims};
use crate::simd::{axpy, dispatch, prefetch_l2, scale_axpy, Isa, Kernel};

/// One-token-at-a-time gated delta rule (decode path), looping over tokens.
///
/// Per v head `j` (reading q/k head `j / (n_v_heads / n_k_heads)`), state `S = state[j]` (`[d_k, d_v]`),
/// and each token `t` in order (Yang, Kautz, Hatamizadeh 2024, eq. for the gated delta rule; HF
/// `torch_recurrent_gated_delta_rule`):
///
/// ```text
/// S ← exp(g_t)·S;  u = Sᵀk_t;  δ = β_t·(v_t − u);  S ← S + k_t ⊗ δ;  o_t = Sᵀq_t
/// ```
///
/// Computed in f32 with two passes over `S` per token (the decay is folded into both passes).
///
/// * `q`: `[n_tokens, n_k_heads, d_k]` f32, already l2-normalized and scaled by `d_k^-0.5`;
/// * `k`: `[n_tokens, n_k_heads, d_k]` f32, l2-normalized;
/// * `v`: `[n_tokens, n_v_heads, d_v]` f32;
/// * `g`: `[n_tokens, n_v_heads]` f32 log-decay (natural log, `<= 0`);
/// * `beta`: `[n_tokens, n_v_heads]` f32 write strength in `(0, 1)`;
/// * `state`: `[n_v_heads, d_k, d_v]` f32, read and updated in place;
/// * `out`: `[n_tokens, n_v_heads, d_v]` f32, written.
///
/// Heads run in parallel (rayon); each head's arithmetic is sequential, so the result is deterministic.
/// Splitting the tokens over several calls gives bit-identical results.
///
/// Panics if a slice length does not match `d`, or if `n_v_heads` is not a multiple of `n_k_heads`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent(
    d: GdnDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    d.check_delta_args(
        "delta_rule_recurrent",
        Some(q),
        k,
        v,
        g,
        beta,
        state,
        Some(out),
    );
    let (t_n, dk, dv) = (d.n_tokens, d.d_k, d.d_v);
    if t_n == 0 {
        return;
    }
    let heads: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(j, s)| {
            let _flush = FlushSubnormals::new();
            dispatch(HeadJob {
                d,
                j,
                hk: d.k_head(j),
                q,
                k,
                v,
                g,
                beta,
                s,
            })
        })
        .collect();
    scatter_heads(&heads, t_n, dv, out);
}

/// One v head over all tokens, as a [`Kernel`] for [`dispatch`]; returns its `[n_tokens, d_v]` output.
struct HeadJob<'a> {
    d: GdnDims,
    j: usize,
    hk: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    s: &'a mut [f32],
}

impl Kernel for HeadJob<'_> {
    type Out = Vec<f32>;

    #[inline(always)]
    fn run<I: Isa>(self, _isa: I) -> Vec<f32> {
        let (d, j, s) = (self.d, self.j, self.s);
        let (t_n, dk, dv) = (d.n_tokens, d.d_k, d.d_v);
        let mut qh = vec![0.0f32; t_n * dk];
        let mut kh = vec![0.0f32; t_n * dk];
        let mut vh = vec![0.0f32; t_n * dv];
        gather_head(self.q, d.n_k_heads, dk, self.hk, 0, t_n, &mut qh);
        gather_head(self.k, d.n_k_heads, dk, self.hk, 0, t_n, &mut kh);
        gather_head(self.v, d.n_v_heads, dv, j, 0, t_n, &mut vh);
        let mut oh = vec![0.0f32; t_n * dv];
        let mut u = vec![0.0f32; dv];
        for t in 0..t_n {
            let idx = t * d.n_v_heads + j;
            let step = Step {
                decay: self.g[idx].exp(),
                b: self.beta[idx],
                kt: &kh[t * dk..(t + 1) * dk],
                qt: &qh[t * dk..(t + 1) * dk],
                vt: &vh[t * dv..(t + 1) * dv],
                // The second pass reads S from L2 (the first brought it there): meanwhile the next head's state,
                // which follows this one in `state` (a hint only: past the last head it points outside, never
                // dereferenced), comes into L2 from memory for its first pass.
                next: (t + 1 == t_n).then(|| s.as_ptr().wrapping_add(dk * dv).cast::<u8>()),
            };
            let o = &mut oh[t * dv..(t + 1) * dv];
            if dv == 128 {
                step.run_128::<true>(s, o);
            } else {
                step.run::<true>(s, &mut u, o);
            }
        }
        oh
    }
}

/// One token of one v head (the decode step of [`super::delta_rule_decode_step`]): the operations of
/// [`delta_rule_recurrent`] for that head and token, subnormals flushed likewise. `q`, `k`: `[Dk]` (normalised);
/// `v`: `[Dv]`; `decay = exp(g)`; `s`: `[Dk, Dv]` state, advanced; `o`: `[Dv]`, written; `next`: an address to
/// prefetch into L2 during the second pass (the next head's state; a hint only).
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_head(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    decay: f32,
    beta: f32,
    s: &mut [f32],
    o: &mut [f32],
    next: Option<*const u8>,
) {
    let _flush = FlushSubnormals::new();
    let step = Step {
        decay,
        b: beta,
        kt: k,
        qt: q,
        vt: v,
        next,
    };
    dispatch(OneStep { step, s, o });
}

/// [`decode_head`]'s step as a [`Kernel`] for [`dispatch`].
struct OneStep<'a> {
    step: Step<'a>,
    s: &'a mut [f32],
    o: &'a mut [f32],
}

impl Kernel for OneStep<'_> {
    type Out = ();

    #[inline(always)]
    fn run<I: Isa>(self, _isa: I) {
        let dv = self.o.len();
        if dv == 128 {
            self.step.run_128::<true>(self.s, self.o);
        } else {
            // `run` adds into `o`, which starts at 0 as in `HeadJob`.
            self.o.fill(0.0);
            let mut u = vec![0.0f32; dv];
            self.step.run::<true>(self.s, &mut u, self.o);
        }
    }
}

/// One token of one head: `S ← decay·S;  u = Sᵀk;  δ = β(v − u);  S ← S + k ⊗ δ;  o = Sᵀq` (decay folded into both
/// passes). The in-place forms are here; the out-of-place ones (state read from one buffer, written to another) are
/// in `verify.rs`. With `OUT = false` the output is not computed (`o` is not touched): the state's bits do not
/// depend on it.
pub(super) struct Step<'a> {
    pub(super) decay: f32,
    pub(super) b: f32,
    pub(super) kt: &'a [f32],
    pub(super) qt: &'a [f32],
    pub(super) vt: &'a [f32],
    /// The next head's state, to prefetch during the second pass (the last token only).
    pub(super) next: Option<*const u8>,
}

impl Step<'_> {
    /// Any `d_v`: `u` and `o` in memory, updated row by row (`o` is added into: it must start at 0).
    #[inline(always)]
    pub(super) fn run<const OUT: bool>(&self, s: &mut [f32], u: &mut [f32], o: &mut [f32]) {
        let dv = u.len();
        // u = (decay·S)ᵀ k
        u.fill(0.0);
        for (i, row) in s.chunks_exact(dv).enumerate() {
            axpy(u, self.kt[i], row);
        }
        // δ = β (v − decay·u), stored in u.
        for (ui, vi) in u.iter_mut().zip(self.vt) {
            *ui = self.b * (vi - self.decay * *ui);
        }
        // S ← decay·S + k ⊗ δ ;  o = Sᵀ q
        for (i, row) in s.chunks_exact_mut(dv).enumerate() {
            self.prefetch_row(i, dv);
            scale_axpy(row, self.decay, self.kt[i], u);
            if OUT {
                axpy(o, self.qt[i], row);
            }
        }
    }

    /// `d_v = 128`: the same operations in the same order (so the same bits), with `u` and `o` in fixed-size arrays
    /// that the compiler keeps in registers across the rows, instead of a load and a store of each per row (the
    /// bench model's and Qwen3.5's head size).
    #[inline(always)]
    pub(super) fn run_128<const OUT: bool>(&self, s: &mut [f32], o: &mut [f32]) {
        const DV: usize = 128;
        let mut u = [0.0f32; DV];
        for (i, row) in s.chunks_exact(DV).enumerate() {
            let (a, row): (f32, &[f32; DV]) = (self.kt[i], row.try_into().expect("a row of 128"));
            for c in 0..DV {
                u[c] += a * row[c];
            }
        }
        for (ui, vi) in u.iter_mut().zip(self.vt) {
            *ui = self.b * (vi - self.decay * *ui);
        }
        let mut acc = [0.0f32; DV];
        for (i, row) in s.chunks_exact_mut(DV).enumerate() {
            self.prefetch_row(i, DV);
            // (`qt` may be empty without the output)
            let (a, q) = (self.kt[i], if OUT { self.qt[i] } else { 0.0 });
            let row: &mut [f32; DV] = row.try_into().expect("a row of 128");
            for c in 0..DV {
                row[c] = self.decay * row[c] + a * u[c];
                if OUT {
                    acc[c] += q * row[c];
                }
            }
        }
        if OUT {
            // o was 0: 0 + x is x, as the in-memory form's first add.
            o.copy_from_slice(&acc);
        }
    }

    /// `u ← β (v − decay·u)`: the first pass's `Sᵀk` turned into the update `δ` (the loop of [`Step::run`] and
    /// [`Step::run_128`], for the out-of-place forms).
    #[inline(always)]
    pub(super) fn delta(&self, u: &mut [f32]) {
        for (ui, vi) in u.iter_mut().zip(self.vt) {
            *ui = self.b * (vi - self.decay * *ui);
        }
    }

    /// Prefetches row `i` of the next head's state (`dv` f32), when this is the last token.
    #[inline(always)]
    pub(super) fn prefetch_row(&self, i: usize, dv: usize) {
        if let Some(next) = self.next {
            for line in (0..dv * 4).step_by(64) {
                prefetch_l2(next.wrapping_add(i * dv * 4 + line));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn the_128_wide_step_gives_the_bits_of_the_general_one() {
        let (dk, dv) = (64, 128);
        let mut r = StdRng::seed_from_u64(11);
        let mut v =
            |n: usize| -> Vec<f32> { (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect() };
        let (kt, qt, vt, s0) = (v(dk), v(dk), v(dv), v(dk * dv));
        for (decay, b) in [(0.97f32, 0.3f32), (1.0, 1.0), (1e-30, 0.999)] {
            let step = Step {
                decay,
                b,
                kt: &kt,
                qt: &qt,
                vt: &vt,
                next: None,
            };
            let (mut s1, mut o1, mut u) = (s0.clone(), vec![0.0f32; dv], vec![0.0f32; dv]);
            step.run::<true>(&mut s1, &mut u, &mut o1);
            let (mut s2, mut o2) = (s0.clone(), vec![f32::NAN; dv]);
            step.run_128::<true>(&mut s2, &mut o2);
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&s1), bits(&s2), "state, decay {decay}");
            assert_eq!(bits(&o1), bits(&o2), "output, decay {decay}");
            assert_ne!(bits(&s1), bits(&s0));
        }
    }
}
