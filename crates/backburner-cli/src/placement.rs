//! What `run` places where when memory is limited: with workers, a host memory limit (`--max-memory` or the
//! operating system's) and no explicit placement flag, the planner (`backburner plan`'s) decides the mode and the
//! split points, and `run` executes that plan.

use anyhow::{Context, Result};
use backburner_engine::memory::{host_limits, LimitSource};
use backburner_engine::offload::KvBudget;
use backburner_engine::plan::{self, Mode, ModelCosts, Plan, PlanRequest};

use crate::link_args::LinkArgs;
use crate::ModelArgs;

/// The host's memory for planning: the tightest of `--max-memory` and the OS's limits less what the process holds
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

/// What a run needs: the positions it can reach (prompt and `--max-tokens`) and the largest ubatch it runs.
#[derive(Clone, Copy, Debug)]
pub struct RunNeed {
    /// Prompt tokens plus tokens to generate.
    pub positions: usize,
    /// Tokens per prefill ubatch (at most the prompt).
    pub ubatch: usize,
}

/// Plans the placement when it is for the planner to decide (workers, a memory limit, no `--layer-split`,
/// `--kv-budget` or `--split-layer`) and rewrites `link` to carry it out; returns the plan. Errors: the planner's
/// (a model that does not fit, with the explanation), an unreadable model directory.
pub fn plan_run(
    args: &ModelArgs,
    dir: &std::path::Path,
    link: &mut LinkArgs,
    need: RunNeed,
) -> Result<Option<Plan>> {
    if !link.worker_memory.is_empty() && link.worker_memory.len() != link.worker.len() {
        anyhow::bail!(
            "--worker-memory is given {} time{} for {} --worker{}: give it once per worker, in --worker order",
            link.worker_memory.len(),
            if link.worker_memory.len() == 1 { "" } else { "s" },
            link.worker.len(),
            if link.worker.len() == 1 { "" } else { "s" },
        );
    }
    let explicit = !link.layer_split.is_empty()
        || !link.expert_split.is_empty()
        || link.kv_budget.is_some()
        || link.split_layer.is_some();
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
                .unwrap_or(plan::UNKNOWN_MEMORY)
        })
        .collect();
    // placed for the positions this run reaches (within --ctx-size and the model), not the largest context: the
    // session then gets all that the placement holds (`Plan::max_ctx`)
    // (whole blocks of 64 positions, as the KV cache allocates them)
    let ctx = need
        .positions
        .div_ceil(64)
        .saturating_mul(64)
        .min(args.ctx_limit().unwrap_or(usize::MAX))
        .min(config.max_position_embeddings)
        .max(1);
    let req = PlanRequest {
        config,
        costs,
        host_memory: host,
        worker_memory,
        ctx: Some(ctx),
        ubatch: need.ubatch.max(1),
        page_size: args.kv_page_size,
        layer_split: None,
        calibration: None,
    };
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
        Mode::ExpertSplit => {
            let used: Vec<usize> = (0..p.workers.len())
                .filter(|&i| p.workers[i].weight_bytes > 0)
                .collect();
            link.expert_split = used.iter().map(|&i| p.workers[i].layers.start).collect();
            link.worker = used.iter().map(|&i| link.worker[i].clone()).collect();
        }
    }
}
