//! A mixture-of-experts block with some routed experts held elsewhere ([`crate::remote_experts`]): the plan of which
//! pairs run here and which segments go to which holder, and the sum in the local order.

use super::moe::{run_groups, Groups, Route};
use super::scratch::{sized, RowBufs};
use super::{Model, MoeWeights};
use crate::remote::RemoteError;
use crate::remote_experts::{HolderAsk, RemoteExperts, Segment};

/// One addend of a token's sum, in its order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Item {
    /// A weighted output computed here: its slot.
    Here(usize),
    /// A holder's vector: (holder, segment).
    There(usize, usize),
}

/// Who computes what for one block call.
#[derive(Debug, Default)]
struct Plan {
    /// Per expert held here, its (token, weight, slot).
    local: Groups,
    /// Slots computed here.
    n_local: usize,
    /// Per holder, what it is asked.
    asks: Vec<HolderAsk>,
    /// Per token, its addends in ascending expert id.
    items: Vec<Vec<Item>>,
}

/// The plan of layer `idx`'s block for `routes`. Errors: an expert held neither here nor by a holder.
fn split_plan(
    idx: usize,
    w: &MoeWeights,
    routes: &[Route],
    rx: &dyn RemoteExperts,
) -> Result<Plan, RemoteError> {
    let here = |e: usize| w.experts[e].is_some();
    let holder = |e: usize| {
        rx.holder(idx, e).ok_or_else(|| {
            RemoteError(format!(
                "expert {e} of layer {idx} is held neither here nor by a holder"
            ))
        })
    };
    let mut plan = Plan {
        local: vec![Vec::new(); w.experts.len()],
        asks: vec![HolderAsk::default(); rx.holders()],
        ..Plan::default()
    };
    for (tok, route) in routes.iter().enumerate() {
        let mut pairs = route.clone();
        pairs.sort_unstable_by_key(|&(e, _)| e);
        let mut items = Vec::with_capacity(pairs.len());
        let mut i = 0;
        while i < pairs.len() {
            let (e, p) = pairs[i];
            i += 1;
            if here(e) {
                plan.local[e].push((tok, p, plan.n_local));
                items.push(Item::Here(plan.n_local));
                plan.n_local += 1;
                continue;
            }
            let k = holder(e)?;
            let mut seg = vec![(e as u32, p)];
            // the token's first run on one holder continues the fold from zero there
            if items.is_empty() {
                while i < pairs.len() && !here(pairs[i].0) && holder(pairs[i].0)? == k {
                    seg.push((pairs[i].0 as u32, pairs[i].1));
                    i += 1;
                }
            }
            let ask = &mut plan.asks[k];
            if ask.rows.last() != Some(&(tok as u32)) {
                ask.rows.push(tok as u32);
            }
            let row = (ask.rows.len() - 1) as u32;
            ask.segments.push(Segment { row, pairs: seg });
            items.push(Item::There(k, ask.segments.len() - 1));
        }
        plan.items.push(items);
    }
    Ok(plan)
}

impl Model {
    /// Some routed experts held elsewhere: their segments go to their holders (all at once) while this node runs its
    /// own, then each token's addends are summed in ascending expert id from zero into `r.moe.acc` (`[t, H]`), as
    /// the local block sums them: the same bits. A failure latches in `err` and leaves zeros.
    pub(super) fn routed_split(
        &self,
        idx: usize,
        w: &MoeWeights,
        routes: &[Route],
        r: &mut RowBufs,
        err: &mut Option<RemoteError>,
    ) {
        let h = self.config.hidden_size;
        sized(&mut r.moe.acc, routes.len() * h).fill(0.0);
        if err.is_some() {
            return;
        }
        let Some(rx) = self.remote_experts.get() else {
            *err = Some(RemoteError(format!(
                "layer {idx} has routed experts held elsewhere but no holder is attached"
            )));
            return;
        };
        let plan = match split_plan(idx, w, routes, rx.as_ref()) {
            Ok(p) => p,
            Err(e) => {
                *err = Some(e);
                return;
            }
        };
        let RowBufs { h: x, moe: m, .. } = r;
        let x: &[f32] = x;
        let mut mine = std::mem::take(&mut m.pairs);
        sized(&mut mine, plan.n_local * h);
        let reads = &self.expert_reads;
        let mut local = || {
            run_groups(&w.experts, h, x, &plan.local, m, reads, |_, p, slot, y| {
                for (d, &v) in mine[slot * h..(slot + 1) * h].iter_mut().zip(y) {
                    *d = v * p;
                }
            })
        };
        let answers = rx.run(idx, h, x, &plan.asks, &mut local);
        let answers = answers.and_then(|outs| {
            let fits = outs.len() == plan.asks.len()
                && outs
                    .iter()
                    .zip(&plan.asks)
                    .all(|(o, a)| o.len() == a.segments.len() * h);
            fits.then_some(outs).ok_or_else(|| {
                RemoteError(format!(
                    "layer {idx}: the holders' answers do not match the segments asked"
                ))
            })
        });
        match answers {
            Ok(outs) => {
                for (tok, items) in plan.items.iter().enumerate() {
                    let a = &mut m.acc[tok * h..(tok + 1) * h];
                    for &it in items {
                        let y = match it {
                            Item::Here(slot) => &mine[slot * h..(slot + 1) * h],
                            Item::There(k, s) => &outs[k][s * h..(s + 1) * h],
                        };
                        for (d, &v) in a.iter_mut().zip(y) {
                            *d += v;
                        }
                    }
                }
            }
            Err(e) => *err = Some(e),
        }
        m.pairs = mine;
    }
}
