//! The gated delta rule in chunked WY/UT form (prefill path).

use rayon::prelude::*;

use super::flush::FlushSubnormals;
use super::linalg::{forward_subst, gemm_acc, gemm_acc_lower, gram_lower, View};
use super::{gather_head, scatter_heads, GdnDims};
use crate::simd::{dispatch, scale, Isa, Kernel};

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
/// `γ` is accumulated in f64 and every exponent is a difference of two such sums rounded once to f32: within a chunk
/// `γ` grows to tens, and f32 cumulative sums would lose their low bits exactly where `γ_i − γ_j` is small.
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
    d.check_delta_args(
        "delta_rule_chunked",
        Some(q),
        k,
        v,
        g,
        beta,
        state,
        Some(out),
    );
    if d.n_tokens == 0 {
        return;
    }
    let inputs = ChunkInputs { q, k, v, g, beta };
    let heads: Vec<Vec<f32>> = state
        .par_chunks_mut(d.d_k * d.d_v)
        .enumerate()
        .map(|(j, s)| {
            let _flush = FlushSubnormals::new();
            dispatch(HeadJob {
                d,
                chunk,
                j,
                hk: d.k_head(j),
                x: &inputs,
                s,
            })
        })
        .collect();
    scatter_heads(&heads, d.n_tokens, d.d_v, out);
}

/// One v head over the whole call, as a [`Kernel`] for [`dispatch`]; returns its `[n_tokens, d_v]` output.
struct HeadJob<'a> {
    d: GdnDims,
    chunk: usize,
    j: usize,
    hk: usize,
    x: &'a ChunkInputs<'a>,
    s: &'a mut [f32],
}

impl Kernel for HeadJob<'_> {
    type Out = Vec<f32>;

    #[inline(always)]
    fn run<I: Isa>(self, isa: I) -> Vec<f32> {
        let d = self.d;
        let mut ws = Workspace::new(self.chunk.min(d.n_tokens), d.d_k, d.d_v);
        let mut oh = vec![0.0f32; d.n_tokens * d.d_v];
        let mut t0 = 0;
        while t0 < d.n_tokens {
            let c = self.chunk.min(d.n_tokens - t0);
            ws.load(&d, self.j, self.hk, t0, c, self.x);
            ws.run(isa, self.s, &mut oh[t0 * d.d_v..(t0 + c) * d.d_v]);
            t0 += c;
        }
        oh
    }
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
    /// `[c, c]` −A (strict lower part), then (Q Kᵀ) ⊙ Γ (lower part with the diagonal).
    a: Vec<f32>,
    /// `[c, dk]` Q ⊙ exp(γ), then K ⊙ exp(γ_last − γ).
    qs: Vec<f32>,
    /// `[c]` γ (cumulative log-decay, f64) and β.
    gamma: Vec<f64>,
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
            qs: vec![0.0; chunk * dk],
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
        let mut acc = 0.0f64;
        for i in 0..c {
            let idx = (t0 + i) * d.n_v_heads + j;
            acc += f64::from(x.g[idx]);
            self.gamma[i] = acc;
            self.beta[i] = x.beta[idx];
        }
    }

    /// Runs the chunk on state `s` (`[dk, dv]`, updated) and writes its outputs `o` (`[c, dv]`).
    #[inline(always)]
    fn run<I: Isa>(&mut self, isa: I, s: &mut [f32], o: &mut [f32]) {
        let (c, dk, dv) = (self.c, self.dk, self.dv);
        let gamma = &self.gamma[..c];
        let beta = &self.beta[..c];

        // −A[i][j] = −β_i (k_i·k_j) exp(γ_i − γ_j) for j < i.
        let (k, q) = (&self.k[..c * dk], &self.q[..c * dk]);
        gram_lower(isa, k, k, c, dk, 0, &mut self.a);
        for i in 0..c {
            for j in 0..i {
                let aij = beta[i] * self.a[i * c + j] * ((gamma[i] - gamma[j]) as f32).exp();
                self.a[i * c + j] = -aij;
            }
        }
        let neg_a = View::new(&self.a[..c * c], c, 1);

        // U = M⁻¹ (B V) and W = M⁻¹ (B K ⊙ exp(γ)) by forward substitution (M unit lower-triangular).
        let u = &mut self.u[..c * dv];
        let w = &mut self.w[..c * dk];
        for i in 0..c {
            scale(&mut u[i * dv..(i + 1) * dv], beta[i]);
            let wi = &mut w[i * dk..(i + 1) * dk];
            wi.copy_from_slice(&k[i * dk..(i + 1) * dk]);
            scale(wi, beta[i] * (gamma[i] as f32).exp());
        }
        forward_subst(isa, u, c, dv, neg_a);
        forward_subst(isa, w, c, dk, neg_a);

        // V' = U − W S (in place in u).
        for x in w.iter_mut() {
            *x = -*x;
        }
        gemm_acc(isa, u, c, dv, View::new(w, dk, 1), s, dk);

        // O = (Q ⊙ exp(γ)) S + ((Q Kᵀ) ⊙ Γ) V'.
        let qs = &mut self.qs[..c * dk];
        for i in 0..c {
            let ei = (gamma[i] as f32).exp();
            for (dst, src) in qs[i * dk..(i + 1) * dk]
                .iter_mut()
                .zip(&q[i * dk..(i + 1) * dk])
            {
                *dst = ei * src;
            }
        }
        o.fill(0.0);
        gemm_acc(isa, o, c, dv, View::new(qs, dk, 1), s, dk);
        gram_lower(isa, q, k, c, dk, 1, &mut self.a);
        for i in 0..c {
            for j in 0..=i {
                self.a[i * c + j] *= ((gamma[i] - gamma[j]) as f32).exp();
            }
        }
        gemm_acc_lower(isa, o, c, dv, View::new(&self.a[..c * c], c, 1), u, 1);

        // S ← exp(γ_last) S + Σ_j exp(γ_last − γ_j) k_j ⊗ V'_j.
        let last = gamma[c - 1];
        scale(s, (last as f32).exp());
        let kc = &mut self.qs[..c * dk];
        for j in 0..c {
            let cj = ((last - gamma[j]) as f32).exp();
            for (dst, src) in kc[j * dk..(j + 1) * dk]
                .iter_mut()
                .zip(&k[j * dk..(j + 1) * dk])
            {
                *dst = cj * src;
            }
        }
        gemm_acc(isa, s, dk, dv, View::new(kc, 1, dk), u, c);
    }
}
