//! The gated delta rule in chunked WY/UT form (prefill path).

use rayon::prelude::*;

use super::{gather_head, scatter_heads, GdnDims};
use crate::simd::{axpy, dot, scale};

/// Chunked gated delta rule (prefill path): the same arguments and result as
/// [`delta_rule_recurrent`](super::delta_rule_recurrent), up to float rounding, computed chunk by chunk.
///
/// Per v head and chunk of `c ≤ chunk` tokens, with `γ_i = Σ_{s≤i} g_s` (within the chunk),
/// `Γ_ij = exp(γ_i − γ_j)·[j ≤ i]`, `B = diag(β)` and `S` the state entering the chunk (ARCH_SPEC "Chunked
/// prefill", the WY/UT representation of Yang, Kautz, Hatamizadeh 2024 as in HF
/// `torch_chunk_gated_delta_rule`):
///
/// ```text
/// A  = strict_lower((B K) Kᵀ ⊙ Γ)          M = I + A (unit lower-triangular)
/// U  = M⁻¹ (B V)                           W = M⁻¹ (B K ⊙ exp(γ))      (forward substitution)
/// V' = U − W S
/// O  = (Q ⊙ exp(γ)) S + ((Q Kᵀ) ⊙ Γ) V'    (Γ with its diagonal)
/// S ← exp(γ_last) S + (K ⊙ exp(γ_last − γ))ᵀ V'
/// ```
///
/// Every exponent above is `<= 0`, so nothing overflows for any `g <= 0`. The last partial chunk is processed
/// at its real length; this equals HF's zero padding (padded tokens have `k = v = 0`, `g = 0`, which leaves
/// `S` untouched) without computing the padding.
///
/// * `chunk`: chunk length in tokens (64 in HF), `> 0`;
/// * `q`: `[n_tokens, n_k_heads, d_k]` f32, l2-normalized and scaled by `d_k^-0.5`;
/// * `k`: `[n_tokens, n_k_heads, d_k]` f32, l2-normalized;
/// * `v`: `[n_tokens, n_v_heads, d_v]` f32;
/// * `g`: `[n_tokens, n_v_heads]` f32 log-decay (`<= 0`); `beta`: `[n_tokens, n_v_heads]` f32;
/// * `state`: `[n_v_heads, d_k, d_v]` f32, the state before the first token, updated in place;
/// * `out`: `[n_tokens, n_v_heads, d_v]` f32, written.
///
/// v heads run in parallel (rayon); each head is sequential, so the result is deterministic.
///
/// Panics if `chunk == 0`, a slice length does not match `d`, or `n_v_heads % n_k_heads != 0`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_chunked(
    d: GdnDims,
    chunk: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(chunk > 0, "delta_rule_chunked: chunk must be positive");
    d.check_delta_args("delta_rule_chunked", q, k, v, g, beta, state, out);
    let r = d.ratio();
    if d.n_tokens == 0 {
        return;
    }
    let heads: Vec<Vec<f32>> = state
        .par_chunks_mut(d.d_k * d.d_v)
        .enumerate()
        .map(|(j, s)| {
            let mut ws = Workspace::new(chunk, d.d_k, d.d_v);
            let mut oh = vec![0.0f32; d.n_tokens * d.d_v];
            let mut t0 = 0;
            while t0 < d.n_tokens {
                let c = chunk.min(d.n_tokens - t0);
                let inputs = ChunkInputs { q, k, v, g, beta };
                ws.load(&d, j, j / r, t0, c, &inputs);
                ws.run(s, &mut oh[t0 * d.d_v..(t0 + c) * d.d_v]);
                t0 += c;
            }
            oh
        })
        .collect();
    scatter_heads(&heads, d.n_tokens, d.d_v, out);
}

/// The full input tensors of a call.
struct ChunkInputs<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
}

/// Per-head scratch for one chunk: `c` tokens of one v head and its q/k head.
struct Workspace {
    c: usize,
    dk: usize,
    dv: usize,
    /// `[c, dk]` queries.
    q: Vec<f32>,
    /// `[c, dk]` keys.
    k: Vec<f32>,
    /// `[c, dv]` values, turned into U then V' in place.
    u: Vec<f32>,
    /// `[c, dk]` W.
    w: Vec<f32>,
    /// `[c, c]` A (strict lower part used).
    a: Vec<f32>,
    /// `[c]` γ (cumulative log-decay) and β.
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

impl Workspace {
    fn new(chunk: usize, dk: usize, dv: usize) -> Self {
        Workspace {
            c: 0,
            dk,
            dv,
            q: vec![0.0; chunk * dk],
            k: vec![0.0; chunk * dk],
            u: vec![0.0; chunk * dv],
            w: vec![0.0; chunk * dk],
            a: vec![0.0; chunk * chunk],
            gamma: vec![0.0; chunk],
            beta: vec![0.0; chunk],
        }
    }

    /// Gathers tokens `[t0, t0 + c)` of v head `j` (q/k head `hk`).
    fn load(&mut self, d: &GdnDims, j: usize, hk: usize, t0: usize, c: usize, x: &ChunkInputs) {
        self.c = c;
        gather_head(x.q, d.n_k_heads, self.dk, hk, t0, c, &mut self.q);
        gather_head(x.k, d.n_k_heads, self.dk, hk, t0, c, &mut self.k);
        gather_head(x.v, d.n_v_heads, self.dv, j, t0, c, &mut self.u);
        let mut acc = 0.0f32;
        for i in 0..c {
            let idx = (t0 + i) * d.n_v_heads + j;
            acc += x.g[idx];
            self.gamma[i] = acc;
            self.beta[i] = x.beta[idx];
        }
    }

    /// Runs the chunk on state `s` (`[dk, dv]`, updated) and writes its outputs `o` (`[c, dv]`).
    fn run(&mut self, s: &mut [f32], o: &mut [f32]) {
        let (c, dk, dv) = (self.c, self.dk, self.dv);
        let gamma = &self.gamma[..c];
        let beta = &self.beta[..c];

        // A[i][j] = β_i (k_i·k_j) exp(γ_i − γ_j) for j < i.
        for i in 0..c {
            let ki = &self.k[i * dk..(i + 1) * dk];
            for j in 0..i {
                let kj = &self.k[j * dk..(j + 1) * dk];
                self.a[i * c + j] = beta[i] * dot(ki, kj) * (gamma[i] - gamma[j]).exp();
            }
        }

        // U = M⁻¹ (B V), W = M⁻¹ (B K ⊙ exp(γ)) by forward substitution (M unit lower-triangular).
        for i in 0..c {
            let (done_w, rest_w) = self.w.split_at_mut(i * dk);
            let wi = &mut rest_w[..dk];
            wi.copy_from_slice(&self.k[i * dk..(i + 1) * dk]);
            scale(wi, beta[i] * gamma[i].exp());
            let (done_u, rest_u) = self.u.split_at_mut(i * dv);
            let ui = &mut rest_u[..dv];
            scale(ui, beta[i]);
            for j in 0..i {
                let aij = self.a[i * c + j];
                axpy(wi, -aij, &done_w[j * dk..(j + 1) * dk]);
                axpy(ui, -aij, &done_u[j * dv..(j + 1) * dv]);
            }
        }

        // V' = U − W S (in place in u) and the inter-chunk output O = (Q ⊙ exp(γ)) S, one pass over S.
        for i in 0..c {
            let ei = gamma[i].exp();
            let qi = &self.q[i * dk..(i + 1) * dk];
            let wi = &self.w[i * dk..(i + 1) * dk];
            let ui = &mut self.u[i * dv..(i + 1) * dv];
            let oi = &mut o[i * dv..(i + 1) * dv];
            oi.fill(0.0);
            for (x, srow) in s.chunks_exact(dv).enumerate() {
                axpy(ui, -wi[x], srow);
                axpy(oi, ei * qi[x], srow);
            }
        }

        // Intra-chunk output: O_i += Σ_{j≤i} (q_i·k_j) exp(γ_i − γ_j) V'_j.
        for i in 0..c {
            let qi = &self.q[i * dk..(i + 1) * dk];
            let oi = &mut o[i * dv..(i + 1) * dv];
            for j in 0..=i {
                let coef = dot(qi, &self.k[j * dk..(j + 1) * dk]) * (gamma[i] - gamma[j]).exp();
                axpy(oi, coef, &self.u[j * dv..(j + 1) * dv]);
            }
        }

        // S ← exp(γ_last) S + Σ_j exp(γ_last − γ_j) k_j ⊗ V'_j.
        let last = gamma[c - 1];
        let decay_last = last.exp();
        let coefs: Vec<f32> = gamma.iter().map(|gj| (last - gj).exp()).collect();
        for (x, srow) in s.chunks_exact_mut(dv).enumerate() {
            scale(srow, decay_last);
            for (j, cj) in coefs.iter().enumerate() {
                axpy(srow, cj * self.k[j * dk + x], &self.u[j * dv..(j + 1) * dv]);
            }
        }
    }
}
