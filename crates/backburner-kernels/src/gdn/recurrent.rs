//! The gated delta rule one token at a time (decode path).

use rayon::prelude::*;

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
    d.check_delta_args("delta_rule_recurrent", q, k, v, g, beta, state, out);
    let (t_n, dk, dv) = (d.n_tokens, d.d_k, d.d_v);
    if t_n == 0 {
        return;
    }
    let heads: Vec<Vec<f32>> = state
        .par_chunks_mut(dk * dv)
        .enumerate()
        .map(|(j, s)| {
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
            let decay = self.g[idx].exp();
            let b = self.beta[idx];
            let kt = &kh[t * dk..(t + 1) * dk];
            let qt = &qh[t * dk..(t + 1) * dk];
            // u = (decay·S)ᵀ k
            u.fill(0.0);
            for (i, row) in s.chunks_exact(dv).enumerate() {
                axpy(&mut u, kt[i], row);
            }
            // δ = β (v − decay·u), stored in u.
            for (ui, vi) in u.iter_mut().zip(&vh[t * dv..(t + 1) * dv]) {
                *ui = b * (vi - decay * *ui);
            }
            // S ← decay·S + k ⊗ δ ;  o = Sᵀ q
            let o = &mut oh[t * dv..(t + 1) * dv];
            // This pass reads S from L2 (the first brought it there): meanwhile the next head's state, which follows
            // this one in `state` (a hint only: past the last head it points outside, never dereferenced), comes
            // into L2 from memory for its first pass.
            let next = s.as_ptr().wrapping_add(dk * dv).cast::<u8>();
            let prefetch = t + 1 == t_n;
            for (i, row) in s.chunks_exact_mut(dv).enumerate() {
                if prefetch {
                    for line in (0..dv * 4).step_by(64) {
                        prefetch_l2(next.wrapping_add(i * dv * 4 + line));
                    }
                }
                scale_axpy(row, decay, kt[i], &u);
                axpy(o, qt[i], row);
            }
        }
        oh
    }
}
