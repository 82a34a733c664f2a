//! The mixture-of-experts feed-forward block (HF `Qwen3_5MoeSparseMoeBlock`, transformers 5.23): a softmax router
//! picks k experts per token and weighs them (renormalized to sum to 1), each expert is a SwiGLU MLP, and a shared
//! expert behind a per-token sigmoid gate is added.
//!
//! A ubatch's tokens are grouped by expert and each routed expert runs one product over its tokens (its weights read
//! once per call). A token's output sums its experts' weighted outputs in ascending expert id, from zero, then adds
//! the gated shared expert — the order of transformers' `index_add_` loop — so it depends on nothing but the token:
//! the same bits alone, in a ubatch, or in a batched decode step with other sequences.

use backburner_kernels::profile::{self, Op};

use std::sync::atomic::{AtomicU64, Ordering};

use super::scratch::{sized, MoeBufs, RowBufs};
use super::{Model, MoeWeights};
use crate::linear::Linear;
use crate::remote::RemoteError;

/// One token's route: (expert, weight), `k` of them.
pub(crate) type Route = Vec<(usize, f32)>;

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

/// Per expert (index = expert id), the rows routed to it in ascending row order: (row of `x`, weight, slot).
pub(crate) type Groups = Vec<Vec<(usize, f32, usize)>>;

/// Runs each expert of `groups` that has rows, in ascending expert id, on its rows of `x` (`[rows, H]`) gathered in
/// order (its weights read once), and hands every row's output to `sink(row, weight, slot, y)` (`y` `[H]`).
/// Counts the bytes of each expert run in `reads`. Panics if an expert with rows is not held (a caller bug).
pub(crate) fn run_groups(
    experts: &[Option<(Linear, Linear)>],
    h: usize,
    x: &[f32],
    groups: &Groups,
    m: &mut MoeBufs,
    reads: &AtomicU64,
    mut sink: impl FnMut(usize, f32, usize, &[f32]),
) {
    for (e, rows) in groups.iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let n = rows.len();
        let xs = sized(&mut m.x, n * h);
        for (dst, &(row, _, _)) in xs.chunks_exact_mut(h).zip(rows) {
            dst.copy_from_slice(&x[row * h..(row + 1) * h]);
        }
        let (gate_up, down) = experts[e].as_ref().expect("a routed expert is held");
        reads.fetch_add((gate_up.bytes() + down.bytes()) as u64, Ordering::Relaxed);
        gate_up.forward_swiglu(&m.x, n, &mut m.gu, &mut m.act);
        down.forward_into(&m.act, n, &mut m.y);
        let _p = profile::scope(Op::Activation);
        for (y, &(row, p, slot)) in m.y.chunks_exact(h).zip(rows) {
            sink(row, p, slot, y);
        }
    }
}

/// `acc += p · y`, element by element (the product rounded, then the sum: the order every path adds in).
fn add_weighted(acc: &mut [f32], y: &[f32], p: f32) {
    for (a, &v) in acc.iter_mut().zip(y) {
        *a += v * p;
    }
}

impl Model {
    /// The MoE block of layer `idx` on the `t` normed rows `r.h` (`[t, H]`), output in `r.out` (`[t, H]`). Routed
    /// experts held elsewhere run on their holders ([`crate::remote_experts`]); a failure there is latched in `err`
    /// (the output is then meaningless).
    pub(super) fn moe_ffn(
        &self,
        idx: usize,
        w: &MoeWeights,
        t: usize,
        r: &mut RowBufs,
        err: &mut Option<RemoteError>,
    ) {
        let h = self.config.hidden_size;
        let n_exp = w.experts.len();
        // the shared expert and its gate
        w.shared_gate_up
            .forward_swiglu(&r.h, t, &mut r.gu, &mut r.act);
        w.shared_down.forward_into(&r.act, t, &mut r.out);
        w.shared_gate.forward_into(&r.h, t, &mut r.moe.gate);
        w.router.forward_into(&r.h, t, &mut r.moe.logits);
        let routes: Vec<Route> = {
            let _p = profile::scope(Op::Activation);
            r.moe
                .logits
                .chunks_exact(n_exp)
                .map(|row| route(row, w.top_k, w.norm_topk_prob))
                .collect()
        };
        if w.experts.iter().all(Option::is_some) {
            self.routed_here(w, &routes, r);
        } else {
            self.routed_split(idx, w, &routes, r, err);
        }
        let _p = profile::scope(Op::Activation);
        for ((out, a), &g) in r
            .out
            .chunks_exact_mut(h)
            .zip(r.moe.acc.chunks_exact(h))
            .zip(&r.moe.gate)
        {
            let s = 1.0 / (1.0 + (-g).exp());
            for (o, &v) in out.iter_mut().zip(a) {
                *o = v + s * *o;
            }
        }
    }

    /// Every routed expert held here: each token's weighted outputs summed into `r.moe.acc` (`[t, H]`) in ascending
    /// expert id, from zero.
    fn routed_here(&self, w: &MoeWeights, routes: &[Route], r: &mut RowBufs) {
        let h = self.config.hidden_size;
        let mut groups: Groups = vec![Vec::new(); w.experts.len()];
        for (tok, route) in routes.iter().enumerate() {
            for &(e, p) in route {
                groups[e].push((tok, p, tok));
            }
        }
        let m = &mut r.moe;
        let mut acc = std::mem::take(&mut m.acc);
        sized(&mut acc, routes.len() * h).fill(0.0);
        run_groups(
            &w.experts,
            h,
            &r.h,
            &groups,
            m,
            &self.expert_reads,
            |tok, p, _, y| add_weighted(&mut acc[tok * h..(tok + 1) * h], y, p),
        );
        m.acc = acc;
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
