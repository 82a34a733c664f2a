//! Experts on workers for a mixture-of-experts model that does not fit the host: the host keeps every layer (mixers,
//! routers, shared experts, state and all the KV) and the routed experts of layers `[0, L1)`; worker i holds the
//! routed experts of `[Li, Li+1)`, the last one up to the model's end. The host keeps as many layers' experts as
//! leave it room for the context; each worker then takes as many layers' experts as fit, in chain order.

use std::ops::Range;

use super::search::{capacity, new_plan, stage_fixed};
use super::{DevicePlan, Mode, Plan, PlanRequest};
use crate::memory::human;

/// Bytes of the routed experts of layers `r`.
fn experts(req: &PlanRequest, r: Range<usize>) -> u64 {
    req.costs.layer_expert_bytes[r]
        .iter()
        .fold(0u64, |a, &b| a.saturating_add(b))
}

/// The host's largest context when the experts of `[l1, n)` are away.
fn host_capacity(req: &PlanRequest, l1: usize) -> Option<usize> {
    let n = req.costs.n_layers();
    let fixed = stage_fixed(req, 0..n, true).saturating_sub(experts(req, l1..n));
    capacity(req, 0..n, fixed, req.host_memory)
}

/// The bounds `[L1, …, n]` when the workers hold the experts of `[l1, n)`, each as many layers as fit.
fn fill_workers(req: &PlanRequest, l1: usize) -> Option<Vec<usize>> {
    let n = req.costs.n_layers();
    let mut bounds = vec![l1];
    let mut start = l1;
    for &mem in &req.worker_memory {
        let mut end = start;
        while end < n && experts(req, start..end + 1) <= mem {
            end += 1;
        }
        bounds.push(end);
        start = end;
    }
    (start == n).then_some(bounds)
}

/// The expert placement holding at least `need` positions (the request's context, or the largest up to it that the
/// host holds), or `None` for a dense model, no worker, or no placement that fits.
pub(super) fn expert_split(req: &PlanRequest, need: usize) -> Option<Plan> {
    let moe = req.config.moe.as_ref()?;
    let n = req.costs.n_layers();
    if req.worker_memory.is_empty() || experts(req, 0..n) == 0 {
        return None;
    }
    let target = req.ctx.unwrap_or(req.costs.max_position_embeddings);
    // the largest L1 that leaves the host the target context, else the needed one; workers hold the rest
    let l1 = [target, need].into_iter().find_map(|want| {
        (0..n).rev().find(|&l| {
            host_capacity(req, l).is_some_and(|c| c >= want) && fill_workers(req, l).is_some()
        })
    })?;
    let bounds = fill_workers(req, l1)?;
    let max_ctx = host_capacity(req, l1)?;
    let c = &req.costs;
    let away = experts(req, l1..n);
    let host = DevicePlan {
        name: "host".into(),
        memory: req.host_memory,
        layers: 0..n,
        holds_ends: true,
        weight_bytes: c.total_weight_bytes().saturating_sub(away),
        state_bytes: c.state_bytes(0..n),
        kv_positions: max_ctx,
        kv_bytes: c.kv_bytes(0..n, max_ctx),
        scratch_bytes: c.scratch_bytes(req.ubatch, true, true),
    };
    let workers: Vec<DevicePlan> = bounds
        .windows(2)
        .enumerate()
        .map(|(i, w)| DevicePlan {
            name: format!("worker {}", i + 1),
            memory: req.worker_memory[i],
            layers: if w[0] < w[1] { w[0]..w[1] } else { n..n },
            holds_ends: false,
            weight_bytes: experts(req, w[0]..w[1]),
            state_bytes: 0,
            kv_positions: 0,
            kv_bytes: 0,
            scratch_bytes: 0,
        })
        .collect();
    let moe_away = (l1..n).filter(|&i| c.layer_expert_bytes[i] > 0).count();
    let mut p = new_plan(req, Mode::ExpertSplit, host, workers, max_ctx);
    p.notes.push(format!(
        "the weights ({}) do not fit the host ({}) with room for context; the routed experts are {} of them, of which a \
         decode step reads {} of {} per MoE layer: experts on workers — the host keeps every layer, its mixers, routers, \
         shared experts and all the KV, and the workers hold the routed experts of layers {l1}..{n} ({})",
        human(c.total_weight_bytes()),
        human(req.host_memory),
        human(experts(req, 0..n)),
        moe.num_experts_per_tok,
        moe.num_experts,
        human(away),
    ));
    p.notes.push(format!(
        "decode makes one round trip per MoE layer whose experts are on a worker ({moe_away} per token), each the \
         routed rows out and one vector per row back"
    ));
    for w in p.workers.iter().filter(|w| w.weight_bytes == 0) {
        p.notes
            .push(format!("{} is not needed: no experts left for it", w.name));
    }
    Some(p)
}
