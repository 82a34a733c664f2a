//! The delta rule of a speculative verify and of its rollback (docs/ENGINE_CORE.md, option B): a verify of `T`
//! positions reads the pre-verify state from one buffer and writes the advanced state to another, so the pre-verify
//! state is kept without a copy (double buffering); a rollback to `m < T` accepted positions replays them from the
//! kept state without computing outputs.
//!
//! Both run, per head and token, the operations of [`delta_rule_recurrent`](super::delta_rule_recurrent) in the
//! same order (the first token's second pass reads the source row and writes the destination row, the others run in
//! place on the destination), under the same subnormal flush: the same bits as the in-place recurrence and as the
//! fused decode step ([`delta_rule_decode_step`](super::delta_rule_decode_step)), whatever the thread count.

use rayon::prelude::*;

use super::flush::FlushSubnormals;
use super::recurrent::Step;
use super::{gather_head, scatter_heads, GdnDims};
use crate::simd::{axpy, dispatch, Isa, Kernel};

/// [`delta_rule_recurrent`](super::delta_rule_recurrent) out of place: reads the state from `src` (left unchanged)
/// and writes the state after the `d.n_tokens` tokens to `dst`, with the same bits as the in-place call on a copy of
/// `src`; the outputs are the in-place call's too.
///
/// * `q`: `[n_tokens, n_k_heads, d_k]` f32, l2-normalised and scaled by `d_k^-0.5`; `k`: `[n_tokens, n_k_heads, d_k]`
///   f32, l2-normalised;
/// * `v`: `[n_tokens, n_v_heads, d_v]` f32; `g`: `[n_tokens, n_v_heads]` f32 log-decay; `beta`:
///   `[n_tokens, n_v_heads]` f32;
/// * `src`: `[n_v_heads, d_k, d_v]` f32, the state before the tokens; `dst`: the same shape, written whole (its
///   previous contents are never read; with `n_tokens = 0` it becomes a copy of `src`);
/// * `out`: `[n_tokens, n_v_heads, d_v]` f32, written.
///
/// Panics if a slice length does not match `d`, or if `n_v_heads` is not a multiple of `n_k_heads`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_recurrent_from(
    d: GdnDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    src: &[f32],
    dst: &mut [f32],
    out: &mut [f32],
) {
    let what = "delta_rule_recurrent_from";
    d.check_delta_args(what, Some(q), k, v, g, beta, src, Some(out));
    check_dst(what, src, dst);
    let heads = run_heads::<true>(d, q, k, v, g, beta, src, dst);
    scatter_heads(&heads, d.n_tokens, d.d_v, out);
}

/// The state-only replay of a rollback: `dst` ← the state after the `d.n_tokens` tokens from `src`, with no output
/// (the bits of [`delta_rule_recurrent`](super::delta_rule_recurrent) on a copy of `src`, or of as many fused decode
/// steps). Shapes as [`delta_rule_recurrent_from`] (no `q`: the output is not computed); `src` is left unchanged,
/// `dst` written whole (a copy of `src` for `n_tokens = 0`).
///
/// Panics if a slice length does not match `d`, or if `n_v_heads` is not a multiple of `n_k_heads`.
pub fn delta_rule_replay(
    d: GdnDims,
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    src: &[f32],
    dst: &mut [f32],
) {
    let what = "delta_rule_replay";
    d.check_delta_args(what, None, k, v, g, beta, src, None);
    check_dst(what, src, dst);
    run_heads::<false>(d, &[], k, v, g, beta, src, dst);
}

fn check_dst(what: &str, src: &[f32], dst: &[f32]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "{what}: `dst` must have the shape of `src` ({} values), got {} values",
        src.len(),
        dst.len()
    );
}

/// Every v head in parallel from `src` into `dst`; each head's `[n_tokens, d_v]` output (empty without `OUT`).
#[allow(clippy::too_many_arguments)]
fn run_heads<const OUT: bool>(
    d: GdnDims,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    src: &[f32],
    dst: &mut [f32],
) -> Vec<Vec<f32>> {
    if d.n_tokens == 0 {
        dst.copy_from_slice(src);
        return Vec::new();
    }
    let hs = d.d_k * d.d_v;
    dst.par_chunks_mut(hs)
        .zip(src.par_chunks(hs))
        .enumerate()
        .map(|(j, (dst, head_src))| {
            let _flush = FlushSubnormals::new();
            dispatch(FromJob::<OUT> {
                d,
                j,
                q,
                k,
                v,
                g,
                beta,
                // the next head's source state, prefetched during the last token's second pass (a hint only: past
                // the last head it points outside, never dereferenced)
                next: src.as_ptr().wrapping_add((j + 1) * hs).cast(),
                src: head_src,
                dst,
            })
        })
        .collect()
}

/// One v head over all tokens, out of place, as a [`Kernel`] for [`dispatch`]; returns its `[n_tokens, d_v]` output
/// (empty without `OUT`).
struct FromJob<'a, const OUT: bool> {
    d: GdnDims,
    j: usize,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    g: &'a [f32],
    beta: &'a [f32],
    next: *const u8,
    src: &'a [f32],
    dst: &'a mut [f32],
}

impl<const OUT: bool> Kernel for FromJob<'_, OUT> {
    type Out = Vec<f32>;

    #[inline(always)]
    fn run<I: Isa>(self, _isa: I) -> Vec<f32> {
        let (d, j) = (self.d, self.j);
        let (t_n, dk, dv, hk) = (d.n_tokens, d.d_k, d.d_v, d.k_head(j));
        let mut qh = vec![0.0f32; if OUT { t_n * dk } else { 0 }];
        let mut kh = vec![0.0f32; t_n * dk];
        let mut vh = vec![0.0f32; t_n * dv];
        if OUT {
            gather_head(self.q, d.n_k_heads, dk, hk, 0, t_n, &mut qh);
        }
        gather_head(self.k, d.n_k_heads, dk, hk, 0, t_n, &mut kh);
        gather_head(self.v, d.n_v_heads, dv, j, 0, t_n, &mut vh);
        let mut oh = vec![0.0f32; if OUT { t_n * dv } else { 0 }];
        let mut u = vec![0.0f32; if dv == 128 { 0 } else { dv }];
        for t in 0..t_n {
            let idx = t * d.n_v_heads + j;
            let step = Step {
                decay: self.g[idx].exp(),
                b: self.beta[idx],
                kt: &kh[t * dk..(t + 1) * dk],
                qt: if OUT { &qh[t * dk..(t + 1) * dk] } else { &[] },
                vt: &vh[t * dv..(t + 1) * dv],
                next: (t + 1 == t_n).then_some(self.next),
            };
            let o = if OUT {
                &mut oh[t * dv..(t + 1) * dv]
            } else {
                &mut []
            };
            match (t, dv == 128) {
                (0, true) => step.run_128_to::<OUT>(self.src, self.dst, o),
                (0, false) => step.run_to::<OUT>(self.src, self.dst, &mut u, o),
                (_, true) => step.run_128::<OUT>(self.dst, o),
                (_, false) => step.run::<OUT>(self.dst, &mut u, o),
            }
        }
        oh
    }
}

impl Step<'_> {
    /// [`Step::run`] out of place: the first pass reads `src`, the second writes `dst` row by row from `src`'s row
    /// (`dst = decay·src + k ⊗ δ`, as `scale_axpy` computes it in place); `o` is added into (it must start at 0).
    #[inline(always)]
    fn run_to<const OUT: bool>(&self, src: &[f32], dst: &mut [f32], u: &mut [f32], o: &mut [f32]) {
        let dv = u.len();
        u.fill(0.0);
        for (i, row) in src.chunks_exact(dv).enumerate() {
            axpy(u, self.kt[i], row);
        }
        self.delta(u);
        for (i, (d, s)) in dst
            .chunks_exact_mut(dv)
            .zip(src.chunks_exact(dv))
            .enumerate()
        {
            self.prefetch_row(i, dv);
            let a = self.kt[i];
            for ((di, &si), &ui) in d.iter_mut().zip(s).zip(u.iter()) {
                *di = self.decay * si + a * ui;
            }
            if OUT {
                axpy(o, self.qt[i], d);
            }
        }
    }

    /// [`Step::run_128`] out of place, as [`Step::run_to`]; `o` is written (with `OUT`).
    #[inline(always)]
    fn run_128_to<const OUT: bool>(&self, src: &[f32], dst: &mut [f32], o: &mut [f32]) {
        const DV: usize = 128;
        let mut u = [0.0f32; DV];
        for (i, row) in src.chunks_exact(DV).enumerate() {
            let (a, row): (f32, &[f32; DV]) = (self.kt[i], row.try_into().expect("a row of 128"));
            for c in 0..DV {
                u[c] += a * row[c];
            }
        }
        self.delta(&mut u);
        let mut acc = [0.0f32; DV];
        for (i, (d, s)) in dst
            .chunks_exact_mut(DV)
            .zip(src.chunks_exact(DV))
            .enumerate()
        {
            self.prefetch_row(i, DV);
            let (a, q) = (self.kt[i], if OUT { self.qt[i] } else { 0.0 });
            let d: &mut [f32; DV] = d.try_into().expect("a row of 128");
            let s: &[f32; DV] = s.try_into().expect("a row of 128");
            for c in 0..DV {
                d[c] = self.decay * s[c] + a * u[c];
                if OUT {
                    acc[c] += q * d[c];
                }
            }
        }
        if OUT {
            o.copy_from_slice(&acc);
        }
    }
}
