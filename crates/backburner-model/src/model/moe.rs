//! The mixture-of-experts feed-forward block (HF `Qwen3_5MoeSparseMoeBlock`, transformers 5.23): a softmax router
//! picks k experts per token and weighs them (renormalized to sum to 1), each expert is a SwiGLU MLP, and a shared
//! expert behind a per-token sigmoid gate is added.
//!
//! A ubatch's tokens are grouped by expert and each routed expert runs one product over its tokens (its weights read
//! once per call). A token's output sums its experts' weighted outputs in ascending expert id, from zero, then adds
//! the gated shared expert — the order of transformers' `index_add_` loop — so it depends on nothing but the token:
//! the same bits alone, in a ubatch, or in a batched decode step with other sequences.

use backburner_kernels::profile::{self, Op};

use super::scratch::{sized, RowBufs};
use super::{Model, MoeWeights};

/// One token's route: (expert, weight), `k` of them.
type Route = Vec<(usize, f32)>;

/// The top `k` of `logits` (`[E]`) by softmax probability, highest first, ties to the lower expert id (the softmax
/// is monotonic, so the logits decide), with their probabilities, renormalized to sum to 1 when `norm`.
/// The softmax is f32 over every expert with the maximum subtracted, as `torch.softmax(dtype=float)` computes it.
/// One pass keeps the k best in order (no sort of all E per token).
pub(crate) fn route(logits: &[f32], k: usize, norm: bool) -> Route {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    let mut top: Vec<(usize, f32)> = Vec::with_capacity(k + 1);
    for (e, &l) in logits.iter().enumerate() {
        // an equal logit does not displace an earlier (lower) id
        if top.len() == k && l <= top[k - 1].1 {
            continue;
        }
        let at = top.partition_point(|&(_, t)| t >= l);
        top.insert(at, (e, l));
        top.truncate(k);
    }
    let mut top: Route = top
        .into_iter()
        .map(|(e, l)| (e, (l - max).exp() / sum))
        .collect();
    if norm {
        let s: f32 = top.iter().map(|&(_, p)| p).sum();
        for (_, p) in &mut top {
            *p /= s;
        }
    }
    top
}

impl Model {
    /// The MoE block on the `t` normed rows `r.h` (`[t, H]`), output in `r.out` (`[t, H]`).
    pub(super) fn moe_ffn(&self, w: &MoeWeights, t: usize, r: &mut RowBufs) {
        let h = self.config.hidden_size;
        let n_exp = w.experts.len();
        // the shared expert and its gate
        w.shared_gate_up
            .forward_swiglu(&r.h, t, &mut r.gu, &mut r.act);
        w.shared_down.forward_into(&r.act, t, &mut r.out);
        let m = &mut r.moe;
        w.shared_gate.forward_into(&r.h, t, &mut m.gate);
        // routes, then each routed expert's tokens in ascending token order
        w.router.forward_into(&r.h, t, &mut m.logits);
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); n_exp];
        {
            let _p = profile::scope(Op::Activation);
            for (tok, row) in m.logits.chunks_exact(n_exp).enumerate() {
                for (e, p) in route(row, w.top_k, w.norm_topk_prob) {
                    by_expert[e].push((tok, p));
                }
            }
        }
        let acc = sized(&mut m.acc, t * h);
        acc.fill(0.0);
        for (e, toks) in by_expert.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let n = toks.len();
            let x = sized(&mut m.x, n * h);
            for (dst, &(tok, _)) in x.chunks_exact_mut(h).zip(toks) {
                dst.copy_from_slice(&r.h[tok * h..(tok + 1) * h]);
            }
            let (gate_up, down) = &w.experts[e];
            let read = (gate_up.bytes() + down.bytes()) as u64;
            self.expert_reads
                .fetch_add(read, std::sync::atomic::Ordering::Relaxed);
            gate_up.forward_swiglu(&m.x, n, &mut m.gu, &mut m.act);
            down.forward_into(&m.act, n, &mut m.y);
            let _p = profile::scope(Op::Activation);
            for (y, &(tok, p)) in m.y.chunks_exact(h).zip(toks) {
                for (a, &v) in acc[tok * h..(tok + 1) * h].iter_mut().zip(y) {
                    *a += v * p;
                }
            }
        }
        let _p = profile::scope(Op::Activation);
        for ((out, a), &g) in r
            .out
            .chunks_exact_mut(h)
            .zip(acc.chunks_exact(h))
            .zip(&m.gate)
        {
            let s = 1.0 / (1.0 + (-g).exp());
            for (o, &v) in out.iter_mut().zip(a) {
                *o = v + s * *o;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn the_router_takes_the_top_k_renormalized_and_breaks_ties_to_the_lower_id() {
        let r = route(&[0.0, 2.0, 1.0, 2.0], 2, true);
        assert_eq!(r.iter().map(|&(e, _)| e).collect::<Vec<_>>(), [1, 3]);
        assert_eq!((r[0].1, r[1].1), (0.5, 0.5));
        let r = route(&[1.0, 0.0, 3.0], 2, false);
        let z = (-2.0f32).exp() + (-3.0f32).exp() + 1.0;
        assert_eq!(r[0], (2, 1.0 / z));
        assert_eq!(r[1], (0, (-2.0f32).exp() / z));
    }

    #[test]
    fn the_one_pass_top_k_equals_a_stable_sort() {
        // logits with many ties (values from a small set), every k
        let mut x = 0x9E37_79B9u32;
        for round in 0..200 {
            let n = 1 + round % 40;
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    (x % 7) as f32 * 0.5 - 1.0
                })
                .collect();
            for k in 1..=n {
                let mut idx: Vec<usize> = (0..n).collect();
                idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                let got: Vec<usize> = route(&logits, k, true).iter().map(|&(e, _)| e).collect();
                assert_eq!(got, idx[..k], "{logits:?} k {k}");
            }
        }
    }
}
