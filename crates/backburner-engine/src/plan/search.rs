//! The placement search: local / split prefill, KV offload, and the layer split's chain of contiguous ranges.

use std::ops::Range;

use super::{min_context, DevicePlan, Mode, Plan, PlanError, PlanRequest, SPLIT_MIN_TOKENS};
use crate::memory::human;

/// The plan for `req`, or `None` when nothing fits (the caller explains).
pub(super) fn place(req: &PlanRequest) -> Result<Option<Plan>, PlanError> {
    if req.layer_split.is_some() {
        return Ok(layer_split(req));
    }
    let target = req.ctx.unwrap_or(req.costs.max_position_embeddings);
    let need = req.ctx.unwrap_or_else(|| min_context(req));
    let host_cap = local_capacity(req);
    if let Some(cap) = host_cap {
        if cap >= target || (cap >= need && req.worker_memory.is_empty()) {
            return Ok(Some(local_or_split_prefill(req, cap)));
        }
    }
    if !req.worker_memory.is_empty() {
        if let Some(p) = kv_offload(req, need) {
            if host_cap.is_none_or(|c| p.max_ctx > c) {
                return Ok(Some(p));
            }
        }
    }
    if let Some(cap) = host_cap.filter(|&c| c >= need) {
        return Ok(Some(local_or_split_prefill(req, cap)));
    }
    Ok(experts_or_layers(req, need, target))
}

/// For a mixture-of-experts model, experts on workers when that placement holds the context a layer split would
/// (or the target) — it keeps every mixer and the KV on the host and moves only what decode reads least — else a
/// layer split; the choice is explained in the plan's notes.
fn experts_or_layers(req: &PlanRequest, need: usize, target: usize) -> Option<Plan> {
    let layers = layer_split(req);
    let Some(mut e) = super::experts::expert_split(req, need) else {
        return layers;
    };
    match layers {
        Some(l) if e.max_ctx < l.max_ctx.min(target) => {
            let mut l = l;
            l.notes.push(format!(
                "experts on workers would hold a context of {} tokens only (the host keeps all the KV): layer split",
                e.max_ctx
            ));
            Some(l)
        }
        Some(l) => {
            e.notes.push(format!(
                "chosen over a layer split (context up to {} tokens), which would move whole layers — their mixers, state and KV — to the workers",
                l.max_ctx
            ));
            Some(e)
        }
        None => Some(e),
    }
}

/// Bytes a stage holds apart from KV: its layers' weights and state, the ends on the host, and its scratch.
pub(super) fn stage_fixed(req: &PlanRequest, r: Range<usize>, ends: bool) -> u64 {
    let c = &req.costs;
    let mut b = c
        .weight_bytes(r.clone())
        .saturating_add(c.state_bytes(r.clone()));
    if ends {
        b = b.saturating_add(c.ends.total());
    }
    b.saturating_add(c.scratch_bytes(req.ubatch, ends || !r.is_empty(), ends))
}

/// The most positions of KV for the attention layers in `r` that fit `mem` after `fixed`, at most the model's
/// context; `None` when even `fixed` does not fit.
pub(super) fn capacity(req: &PlanRequest, r: Range<usize>, fixed: u64, mem: u64) -> Option<usize> {
    let free = mem.checked_sub(fixed)?;
    let per = req.costs.kv_bytes(r, 1);
    let max = req.costs.max_position_embeddings;
    Some(match free.checked_div(per) {
        Some(p) => usize::try_from(p).unwrap_or(usize::MAX).min(max),
        None => max,
    })
}

/// Largest context the host holds with every layer and the ends, if the rest fits.
fn local_capacity(req: &PlanRequest) -> Option<usize> {
    let all = 0..req.costs.n_layers();
    capacity(
        req,
        all.clone(),
        stage_fixed(req, all, true),
        req.host_memory,
    )
}

/// A device holding layers `r` (and the ends when `ends`) with KV for `kv_positions` positions.
fn device(
    req: &PlanRequest,
    name: String,
    mem: u64,
    r: Range<usize>,
    ends: bool,
    kv_positions: usize,
) -> DevicePlan {
    let c = &req.costs;
    let n = c.n_layers();
    if r.is_empty() && !ends {
        return DevicePlan::idle(name, mem, n);
    }
    let weights = c.weight_bytes(r.clone());
    DevicePlan {
        name,
        memory: mem,
        // a host without layers holds `[0, 0)`: its layers are always `[0, L1)`
        layers: match (r.is_empty(), ends) {
            (true, true) => 0..0,
            (true, false) => n..n,
            _ => r.clone(),
        },
        holds_ends: ends,
        weight_bytes: if ends {
            weights.saturating_add(c.ends.total())
        } else {
            weights
        },
        state_bytes: c.state_bytes(r.clone()),
        kv_positions,
        kv_bytes: c.kv_bytes(r.clone(), kv_positions),
        scratch_bytes: c.scratch_bytes(req.ubatch, ends || !r.is_empty(), ends),
    }
}

pub(super) fn worker_name(i: usize) -> String {
    format!("worker {}", i + 1)
}

pub(super) fn capped_note(req: &PlanRequest, max_ctx: usize, notes: &mut Vec<String>) {
    let max = req.costs.max_position_embeddings;
    if req.ctx.is_none() && max_ctx < max {
        notes.push(format!(
            "context capped at {max_ctx} tokens by memory (the model allows {max}); the default context is the largest that fits"
        ));
    }
}

pub(super) fn new_plan(
    req: &PlanRequest,
    mode: Mode,
    host: DevicePlan,
    workers: Vec<DevicePlan>,
    max_ctx: usize,
) -> Plan {
    Plan {
        mode,
        host,
        workers,
        ctx: req.ctx.unwrap_or(max_ctx),
        max_ctx,
        link: Default::default(),
        expected: None,
        notes: Vec::new(),
        weights: super::PlanWeights::of(&req.costs),
        device: None,
    }
}

/// Local, or split prefill when a worker can mirror a tail range for `max_ctx` positions.
fn local_or_split_prefill(req: &PlanRequest, max_ctx: usize) -> Plan {
    let n = req.costs.n_layers();
    let host = device(req, "host".into(), req.host_memory, 0..n, true, max_ctx);
    let idle: Vec<DevicePlan> = (0..req.worker_memory.len())
        .map(|i| DevicePlan::idle(worker_name(i), req.worker_memory[i], n))
        .collect();
    let mut p = new_plan(req, Mode::Local, host, idle, max_ctx);
    p.notes.push(format!(
        "everything fits the host ({} of {})",
        human(p.host.total_bytes()),
        human(req.host_memory)
    ));
    capped_note(req, max_ctx, &mut p.notes);
    let Some(&wmem) = req.worker_memory.first() else {
        return p;
    };
    let threads = req.calibration.as_ref().map(|c| {
        let w = c.workers.first().map_or(c.host.threads, |w| w.threads);
        (c.host.threads, w)
    });
    let (ht, wt) = threads.unwrap_or((1, 1));
    let Some(l0) = crate::balanced_split(&req.config, ht, wt) else {
        p.notes.push(
            "the model has no seam inside it: split prefill is off, the worker is unused".into(),
        );
        return p;
    };
    let step = req.costs.interval;
    let fits = (l0..n).step_by(step).find(|&l| {
        let fixed = stage_fixed(req, l..n, false);
        capacity(req, l..n, fixed, wmem).is_some_and(|c| c >= max_ctx)
    });
    let Some(l) = fits else {
        p.notes.push(format!(
            "worker 1 ({}) cannot mirror a tail range with KV for {max_ctx} tokens: split prefill is off",
            human(wmem)
        ));
        return p;
    };
    p.mode = Mode::SplitPrefill { split_layer: l };
    p.workers[0] = device(req, worker_name(0), wmem, l..n, false, max_ctx);
    p.notes.push(format!(
        "worker 1 mirrors layers {l}..{n}: split prefill engages for prompts of ≥ {SPLIT_MIN_TOKENS} tokens; shorter prompts and decode run on the host"
    ));
    let why = if threads.is_some() {
        "by the calibrated threads"
    } else {
        "equal threads assumed"
    };
    if l == l0 {
        p.notes
            .push(format!("split layer {l}: balanced_split ({why})"));
    } else {
        p.notes.push(format!(
            "split layer moved from {l0} ({why}) to {l} so the mirror fits worker 1"
        ));
    }
    if req.worker_memory.len() > 1 {
        p.notes
            .push("split prefill uses only the first worker; the others are unused".into());
    }
    p
}

/// KV offload: every weight on the host with a whole-page KV budget, the oldest pages on the workers in order.
fn kv_offload(req: &PlanRequest, need: usize) -> Option<Plan> {
    let c = &req.costs;
    let n = c.n_layers();
    let free = req.host_memory.checked_sub(stage_fixed(req, 0..n, true))?;
    let page_bytes = c.kv_bytes(0..n, req.page_size);
    let host_budget = usize::try_from(free.checked_div(page_bytes)?)
        .ok()?
        .saturating_mul(req.page_size);
    // The newest page stays on the host while a ubatch is appended: the budget must hold a ubatch and two pages.
    if host_budget < req.ubatch.saturating_add(2 * req.page_size) {
        return None;
    }
    let caps = offload_caps(req);
    let total = caps.iter().fold(host_budget, |a, &b| a.saturating_add(b));
    let max_ctx = total.min(c.max_position_embeddings);
    if max_ctx < need {
        return None;
    }
    let on_host = host_budget.min(max_ctx);
    let host = device(req, "host".into(), req.host_memory, 0..n, true, on_host);
    let workers = offload_workers(req, &caps, max_ctx - on_host);
    let mode = Mode::KvOffload {
        host_kv_positions: host_budget,
    };
    let mut p = new_plan(req, mode, host, workers, max_ctx);
    let want = req.ctx.unwrap_or(c.max_position_embeddings);
    p.notes.push(format!(
        "the weights fit the host but KV for {want} tokens ({}) does not: the host keeps the newest {host_budget} positions ({} pages), the oldest pages move to the workers in order",
        human(c.kv_bytes(0..n, want)),
        host_budget / req.page_size
    ));
    capped_note(req, max_ctx, &mut p.notes);
    Some(p)
}

/// The positions of KV pages (of every attention layer, whole pages) each worker holds in KV offload, in order.
pub(super) fn offload_caps(req: &PlanRequest) -> Vec<usize> {
    let c = &req.costs;
    let page_bytes = c.kv_bytes(0..c.n_layers(), req.page_size).max(1);
    req.worker_memory
        .iter()
        .map(|&m| {
            let pages = m.saturating_sub(c.offload_scratch_bytes(req.ubatch)) / page_bytes;
            usize::try_from(pages)
                .unwrap_or(usize::MAX)
                .saturating_mul(req.page_size)
        })
        .collect()
}

/// The workers of KV offload holding the `left` oldest positions, each up to its cap ([`offload_caps`]) in order.
pub(super) fn offload_workers(
    req: &PlanRequest,
    caps: &[usize],
    mut left: usize,
) -> Vec<DevicePlan> {
    let c = &req.costs;
    let n = c.n_layers();
    caps.iter()
        .enumerate()
        .map(|(i, &cap)| {
            let take = cap.min(left);
            left -= take;
            let mut d = DevicePlan::idle(worker_name(i), req.worker_memory[i], n);
            if take > 0 {
                d.kv_positions = take;
                d.kv_bytes = c.kv_bytes(0..n, take);
                d.scratch_bytes = c.offload_scratch_bytes(req.ubatch);
            }
            d
        })
        .collect()
}

/// Stage `i`'s end for a chain whose earlier stages end at `start`: fixed, the rest of the model (last stage), or
/// the furthest allowed boundary that fits.
fn stage_end(
    req: &PlanRequest,
    i: usize,
    mems: &[u64],
    start: usize,
    ctx: usize,
    seams: bool,
) -> usize {
    let n = req.costs.n_layers();
    if let Some(&e) = req.layer_split.as_ref().and_then(|f| f.get(i)) {
        return e;
    }
    if i + 1 == mems.len() {
        return n;
    }
    let mut best = start;
    for e in start + 1..=n {
        if seams && e % req.costs.interval != 0 && e != n {
            continue;
        }
        if !stage_fits(req, start..e, i == 0, ctx, mems[i]) {
            break;
        }
        best = e;
    }
    best
}

fn stage_fits(req: &PlanRequest, r: Range<usize>, ends: bool, ctx: usize, mem: u64) -> bool {
    let fixed = stage_fixed(req, r.clone(), ends);
    capacity(req, r, fixed, mem).is_some_and(|c| c >= ctx)
}

/// The chain's boundaries `[0, L1, …, n]` (one range per device in `mems`, host first) when every stage fits with
/// KV for `ctx` positions; each stage takes as many layers as fit.
fn greedy(req: &PlanRequest, mems: &[u64], ctx: usize, seams: bool) -> Option<Vec<usize>> {
    let mut bounds = vec![0];
    let mut start = 0;
    for i in 0..mems.len() {
        let end = stage_end(req, i, mems, start, ctx, seams);
        if end < start || !stage_fits(req, start..end, i == 0, ctx, mems[i]) {
            return None;
        }
        bounds.push(end);
        start = end;
    }
    (start == req.costs.n_layers()).then_some(bounds)
}

/// Layer split over the host and every worker; seams first, then any boundary.
fn layer_split(req: &PlanRequest) -> Option<Plan> {
    let mems: Vec<u64> = std::iter::once(req.host_memory)
        .chain(req.worker_memory.iter().copied())
        .collect();
    if mems.len() < 2 {
        return None;
    }
    let need = req.ctx.unwrap_or_else(|| min_context(req));
    // Split points on seams when a placement there fits, else at any layer boundary (a layer split works at any).
    let seams = [true, false]
        .into_iter()
        .find(|&s| greedy(req, &mems, need, s).is_some())?;
    let ctx = match req.ctx {
        Some(c) => c,
        None => largest(need, req.costs.max_position_embeddings, |c| {
            greedy(req, &mems, c, seams).is_some()
        }),
    };
    let bounds = greedy(req, &mems, ctx, seams)?;
    Some(build_layer_split(req, &mems, &bounds, seams))
}

fn build_layer_split(req: &PlanRequest, mems: &[u64], bounds: &[usize], seams: bool) -> Plan {
    let n = req.costs.n_layers();
    let ranges: Vec<Range<usize>> = bounds.windows(2).map(|w| w[0]..w[1]).collect();
    let max_ctx = ranges
        .iter()
        .enumerate()
        .filter_map(|(i, r)| capacity(req, r.clone(), stage_fixed(req, r.clone(), i == 0), mems[i]))
        .min()
        .unwrap_or(0);
    let host = device(
        req,
        "host".into(),
        mems[0],
        ranges[0].clone(),
        true,
        max_ctx,
    );
    let workers = ranges[1..]
        .iter()
        .enumerate()
        .map(|(i, r)| device(req, worker_name(i), mems[i + 1], r.clone(), false, max_ctx))
        .collect();
    let mut p = new_plan(req, Mode::LayerSplit, host, workers, max_ctx);
    if let Some(pts) = &req.layer_split {
        p.notes
            .push(format!("layer split as asked: split points {pts:?}"));
    } else {
        p.notes.push(format!(
            "the weights ({}) do not fit the host ({}) with room for context: layer split, each device taking as many layers as fit in chain order",
            human(req.costs.total_weight_bytes()),
            human(req.host_memory)
        ));
    }
    let off_seam: Vec<usize> = bounds[1..bounds.len() - 1]
        .iter()
        .copied()
        .filter(|&b| b % req.costs.interval != 0 && b != n && b != 0)
        .collect();
    if !seams {
        p.notes.push(format!(
            "no placement on {}-layer seams fits (the model has {} seam(s) inside it for {} stages): split points at any layer boundary",
            req.costs.interval,
            (n - 1) / req.costs.interval,
            mems.len()
        ));
    } else if !off_seam.is_empty() {
        p.notes.push(format!(
            "split point(s) {off_seam:?} are not on {}-layer seams",
            req.costs.interval
        ));
    }
    for w in p.workers.iter().filter(|w| w.layers.is_empty()) {
        p.notes
            .push(format!("{} is not needed: no layers left for it", w.name));
    }
    p.notes.push(
        "decode sends the residual stream to each worker in the chain and back, relayed by the host".into(),
    );
    capped_note(req, max_ctx, &mut p.notes);
    p
}

/// The largest `x` in `[lo, hi]` with `ok(x)`, given `ok(lo)` and `ok` monotone (true, then false).
pub(super) fn largest(lo: usize, hi: usize, ok: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (lo, hi.max(lo));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if ok(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Re-export for the explanation: the fixed bytes of a stage.
pub(super) fn host_minimum(req: &PlanRequest) -> u64 {
    stage_fixed(req, 0..0, true)
}
