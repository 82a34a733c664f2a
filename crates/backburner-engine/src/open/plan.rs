//! The planner's part of a request: with workers, a host memory limit and no explicit placement, the planner
//! ([`crate::plan::plan`], `backburner plan`'s) decides the mode and the split points for what a run reaches, and
//! the request is rewritten to carry them out.

use crate::memory::{host_limits, LimitSource};
use crate::offload::KvBudget;
use crate::plan::{self, Mode, ModelCosts, Plan, PlanRequest};

use super::{OpenError, RunNeed, SessionRequest};

/// The host's memory for planning: the tightest of `max_memory` and the OS's limits less what the process holds
/// already (the tokenizer is loaded by then), as the check before loading counts them; `None` without any limit.
fn host_memory(max_memory: Option<u64>) -> Option<u64> {
    host_limits(max_memory)
        .iter()
        .map(|l| match l.source {
            LimitSource::Flag => l.bytes,
            _ => l.bytes.saturating_sub(l.used),
        })
        .min()
}

/// Plans the placement of `req` for `need` when it is for the planner to decide (workers, a host memory limit, no
/// layer split, expert split, KV budget or split layer given) and rewrites `req` to carry it out; returns the plan
/// (`None` when the request's placement stands as given). Errors: [`OpenError::WorkerMemoryCount`],
/// [`OpenError::Costs`] for an unreadable model, [`OpenError::Plan`] for a model that does not fit (with the
/// planner's explanation).
pub(super) fn plan_for_run(
    req: &mut SessionRequest,
    need: RunNeed,
) -> Result<Option<Plan>, OpenError> {
    let w = &req.workers;
    if !w.memory.is_empty() && w.memory.len() != w.addrs.len() {
        return Err(OpenError::WorkerMemoryCount {
            given: w.memory.len(),
            workers: w.addrs.len(),
        });
    }
    if w.addrs.is_empty() || req.placement.is_explicit() || req.options.kv_budget.is_some() {
        return Ok(None);
    }
    let Some(host) = host_memory(req.max_memory) else {
        return Ok(None);
    };
    let (config, costs) =
        ModelCosts::from_dir(&req.dir, req.options.kv.dtype).map_err(|source| {
            OpenError::Costs {
                dir: req.dir.clone(),
                source,
            }
        })?;
    let worker_memory = (0..w.addrs.len())
        .map(|i| w.memory.get(i).copied().unwrap_or(plan::UNKNOWN_MEMORY))
        .collect();
    // placed for the positions this run reaches (within the context limit and the model), not the largest
    // context: the session then gets all that the placement holds (`Plan::max_ctx`), in whole blocks of 64
    // positions, as the KV cache allocates them
    let ctx = need
        .positions
        .div_ceil(64)
        .saturating_mul(64)
        .min(req.options.context_length.unwrap_or(usize::MAX))
        .min(config.max_position_embeddings)
        .max(1);
    let preq = PlanRequest {
        config,
        costs,
        host_memory: host,
        worker_memory,
        ctx: Some(ctx),
        ubatch: need.ubatch.max(1),
        page_size: req.options.kv.page_size,
        layer_split: None,
        calibration: None,
    };
    let p = plan::plan(&preq).map_err(OpenError::Plan)?;
    apply(&p, req);
    Ok(Some(p))
}

/// Rewrites `req` to carry out `p`: a layer split's or an expert split's points (workers without a share
/// dropped), KV offload's host budget, split prefill's layer.
fn apply(p: &Plan, req: &mut SessionRequest) {
    let used = |keep: &dyn Fn(usize) -> bool| -> Vec<usize> {
        (0..p.workers.len()).filter(|&i| keep(i)).collect()
    };
    match &p.mode {
        Mode::Local => {}
        Mode::SplitPrefill { split_layer } => req.placement.split_layer = Some(*split_layer),
        Mode::KvOffload { host_kv_positions } => {
            req.options.kv_budget = Some(KvBudget::Positions(*host_kv_positions))
        }
        Mode::LayerSplit => {
            let used = used(&|i| !p.workers[i].layers.is_empty());
            req.placement.layer_split = used.iter().map(|&i| p.workers[i].layers.start).collect();
            req.workers.keep(&used);
        }
        Mode::ExpertSplit => {
            let used = used(&|i| p.workers[i].weight_bytes > 0);
            req.placement.expert_split = used.iter().map(|&i| p.workers[i].layers.start).collect();
            req.workers.keep(&used);
        }
    }
}
