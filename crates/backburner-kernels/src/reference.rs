//! Slow, obvious float64 twins of the kernels, for tests (here and in the model crate).
//!
//! Each function takes the same f32 arguments as its fast twin, computes everything in f64 straight from
//! the defining equations (ARCH_SPEC.md), and rounds once to f32 at the end.

use crate::gdn::GdnDims;

/// Causal softmax attention over keys at positions `0..n_keys`, f64 inside.
///
/// * `q`: `[n_tokens, n_heads, head_dim]` f32 at absolute positions `q_pos0..q_pos0 + n_tokens`; a query at
///   position `p` sees keys `0..=min(p, n_keys - 1)`;
/// * `k_all`, `v_all`: `[n_keys, n_kv_heads, head_dim]` f32; query head `h` uses kv head
///   `h / (n_heads / n_kv_heads)`;
/// * `scale`: score multiplier.
///
/// Returns `[n_tokens, n_heads, head_dim]` f32 (0 for a query that sees no key).
/// Panics on inconsistent lengths or if `n_heads % n_kv_heads != 0`.
#[allow(clippy::too_many_arguments)]
pub fn attention_reference(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    k_all: &[f32],
    v_all: &[f32],
    n_kv_heads: usize,
    head_dim: usize,
    scale: f32,
) -> Vec<f32> {
    assert!(n_kv_heads > 0 && n_heads.is_multiple_of(n_kv_heads) && head_dim > 0);
    assert_eq!(
        q.len(),
        n_tokens * n_heads * head_dim,
        "attention_reference: q"
    );
    let row = n_kv_heads * head_dim;
    assert_eq!(k_all.len() % row, 0, "attention_reference: k_all");
    assert_eq!(k_all.len(), v_all.len(), "attention_reference: v_all");
    let n_keys = k_all.len() / row;
    let group = n_heads / n_kv_heads;
    let mut out = vec![0.0f32; q.len()];
    for t in 0..n_tokens {
        let n_vis = (q_pos0 + t + 1).min(n_keys);
        for h in 0..n_heads {
            let g = h / group;
            let qh = &q[(t * n_heads + h) * head_dim..][..head_dim];
            let s: Vec<f64> = (0..n_vis)
                .map(|j| {
                    let kj = &k_all[(j * n_kv_heads + g) * head_dim..][..head_dim];
                    let dot: f64 = qh.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum();
                    dot * scale as f64
                })
                .collect();
            if s.is_empty() {
                continue;
            }
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            let o = &mut out[(t * n_heads + h) * head_dim..][..head_dim];
            for (d, od) in o.iter_mut().enumerate() {
                let acc: f64 = (0..n_vis)
                    .map(|j| w[j] * v_all[(j * n_kv_heads + g) * head_dim + d] as f64)
                    .sum();
                *od = (acc / z) as f32;
            }
        }
    }
    out
}

/// The gated delta rule token by token, per head, per element, in f64 (same arguments as
/// [`delta_rule_recurrent`](crate::gdn::delta_rule_recurrent)):
///
/// ```text
/// S ← exp(g_t)·S;  u = Sᵀk_t;  δ = β_t·(v_t − u);  S ← S + k_t ⊗ δ;  o_t = Sᵀq_t
/// ```
///
/// `state` (`[n_v_heads, d_k, d_v]`) is widened to f64 on entry and rounded back on exit.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_reference(
    d: GdnDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    let (t_n, hk, hv, dk, dv) = (d.n_tokens, d.n_k_heads, d.n_v_heads, d.d_k, d.d_v);
    assert!(hk > 0 && hv.is_multiple_of(hk));
    assert_eq!(q.len(), t_n * hk * dk);
    assert_eq!(k.len(), t_n * hk * dk);
    assert_eq!(v.len(), t_n * hv * dv);
    assert_eq!(g.len(), t_n * hv);
    assert_eq!(beta.len(), t_n * hv);
    assert_eq!(state.len(), hv * dk * dv);
    assert_eq!(out.len(), t_n * hv * dv);
    for j in 0..hv {
        let mut s: Vec<f64> = state[j * dk * dv..(j + 1) * dk * dv]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let kh = d.k_head(j);
        for t in 0..t_n {
            let qt = &q[(t * hk + kh) * dk..][..dk];
            let kt = &k[(t * hk + kh) * dk..][..dk];
            let vt = &v[(t * hv + j) * dv..][..dv];
            let decay = (g[t * hv + j] as f64).exp();
            let b = beta[t * hv + j] as f64;
            for x in s.iter_mut() {
                *x *= decay;
            }
            for c in 0..dv {
                let u: f64 = (0..dk).map(|i| s[i * dv + c] * kt[i] as f64).sum();
                let delta = b * (vt[c] as f64 - u);
                for i in 0..dk {
                    s[i * dv + c] += kt[i] as f64 * delta;
                }
            }
            for c in 0..dv {
                let o: f64 = (0..dk).map(|i| s[i * dv + c] * qt[i] as f64).sum();
                out[(t * hv + j) * dv + c] = o as f32;
            }
        }
        for (dst, src) in state[j * dk * dv..(j + 1) * dk * dv].iter_mut().zip(&s) {
            *dst = *src as f32;
        }
    }
}

/// Causal depthwise conv1d + SiLU in f64 (same arguments and shapes as
/// [`causal_conv1d_silu`](crate::gdn::causal_conv1d_silu)): with `xe = state (oldest first) ++ x` per
/// channel, `out[t][c] = silu(Σ_j weight[c][j] · xe[t + j][c])`, and the new state is the last
/// `kernel - 1` entries of `xe`.
pub fn causal_conv1d_silu_reference(
    x: &[f32],
    n_tokens: usize,
    conv_dim: usize,
    kernel: usize,
    weight: &[f32],
    state: &mut [f32],
    out: &mut [f32],
) {
    assert!(kernel > 0);
    let h = kernel - 1;
    assert_eq!(x.len(), n_tokens * conv_dim);
    assert_eq!(weight.len(), conv_dim * kernel);
    assert_eq!(state.len(), conv_dim * h);
    assert_eq!(out.len(), n_tokens * conv_dim);
    for c in 0..conv_dim {
        let xe: Vec<f64> = state[c * h..(c + 1) * h]
            .iter()
            .copied()
            .chain((0..n_tokens).map(|t| x[t * conv_dim + c]))
            .map(|v| v as f64)
            .collect();
        for t in 0..n_tokens {
            let z: f64 = (0..kernel)
                .map(|j| weight[c * kernel + j] as f64 * xe[t + j])
                .sum();
            out[t * conv_dim + c] = (z / (1.0 + (-z).exp())) as f32;
        }
        for s in 0..h {
            state[c * h + s] = xe[n_tokens + s] as f32;
        }
    }
}
