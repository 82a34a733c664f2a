//! What `run` places where when memory is limited: with workers, a host memory limit (`--max-memory` or the
//! operating system's) and no explicit placement flag, the planner (`backburner plan`'s) decides the mode and the
//! split points, and `run` executes that plan.

use anyhow::{Context, Result};
use backburner_engine::memory::{host_limits, LimitSource};
use backburner_engine::offload::KvBudget;
use backburner_engine::plan::{self, Mode, ModelCosts, Plan, PlanRequest};

use crate::link_args::LinkArgs;
use crate::ModelArgs;

/// Bytes kept back from an operating-system limit for what the planner does not count (the tokenizer, thread
/// stacks, allocator slack).
const OS_RESERVE: u64 = 32 << 20;

/// Memory assumed for a worker whose `--worker-memory` is not given: as much as it takes (a worker that cannot
/// hold its layers refuses them in the handshake with a typed error).
const UNKNOWN_WORKER_MEMORY: u64 = 1 << 50;

/// The host's memory for planning: the tightest of `--max-memory` and the OS's limits (less what the process holds
/// already and [`OS_RESERVE`]); `None` without any limit.
fn host_memory(max_memory: Option<u64>) -> Option<u64> {
    host_limits(max_memory)
        .iter()
        .map(|l| match l.source {
            LimitSource::Flag => l.bytes,
            _ => l.bytes.saturating_sub(l.used).saturating_sub(OS_RESERVE),
        })
        .min()
}

/// Plans the placement when it is for the planner to decide (workers, a memory limit, no `--layer-split`,
/// `--kv-budget` or `--split-layer`) and rewrites `link` to carry it out; returns the plan. Errors: the planner's
/// (a model that does not fit, with the explanation), an unreadable model directory.
pub fn plan_run(
    args: &ModelArgs,
    dir: &std::path::Path,
    link: &mut LinkArgs,
    ctx: Option<usize>,
) -> Result<Option<Plan>> {
    let explicit =
        !link.layer_split.is_empty() || link.kv_budget.is_some() || link.split_layer.is_some();
    if link.worker.is_empty() || explicit {
        return Ok(None);
    }
    let Some(host) = host_memory(args.max_memory) else {
        return Ok(None);
    };
    let (config, costs) = ModelCosts::from_dir(dir, args.kv_dtype)
        .with_context(|| format!("planning for {}", dir.display()))?;
    let worker_memory = (0..link.worker.len())
        .map(|i| {
            link.worker_memory
                .get(i)
                .copied()
                .unwrap_or(UNKNOWN_WORKER_MEMORY)
        })
        .collect();
    let mut req = PlanRequest {
        config,
        costs,
        host_memory: host,
        worker_memory,
        ctx,
        ubatch: args.ubatch,
        page_size: args.kv_page_size,
        layer_split: None,
        calibration: None,
    };
    // placed for the context asked for (else one page), not the largest one: a run's context is what its prompt
    // and tokens need, and the session gets all the placement holds (`Plan::max_ctx`)
    req.ctx = Some(ctx.unwrap_or_else(|| plan::min_context(&req)));
    let p = plan::plan(&req).map_err(|e| anyhow::anyhow!("{e}"))?;
    apply(&p, link);
    Ok(Some(p))
}

/// Rewrites `link` to carry out `p`: a layer split's points (workers without layers dropped), KV offload's host
/// budget, split prefill's layer.
fn apply(p: &Plan, link: &mut LinkArgs) {
    match &p.mode {
        Mode::Local => {}
        Mode::SplitPrefill { split_layer } => link.split_layer = Some(*split_layer),
        Mode::KvOffload { host_kv_positions } => {
            link.kv_budget = Some(KvBudget::Positions(*host_kv_positions))
        }
        Mode::LayerSplit => {
            let used: Vec<usize> = (0..p.workers.len())
                .filter(|&i| !p.workers[i].layers.is_empty())
                .collect();
            link.layer_split = used.iter().map(|&i| p.workers[i].layers.start).collect();
            link.worker = used.iter().map(|&i| link.worker[i].clone()).collect();
        }
    }
}
