//! Plans with a device (`plan --device cuda:0 --device-memory 80G`): the device takes the longest prefix of the
//! layers that fits it ([`fit_layers`]) and the host holds **only the other layers' weights and the ends** (the
//! embedding, final norm and head: the placed layers' weights are not kept on the host), each side the KV of its own
//! attention layers, so a host with little memory and a large device gets a plan.
//!
//! Rules, in order ([`plan_with_device`]):
//! 1. **Local** when the device and the host hold everything for the context (`ctx`, else the largest that fits).
//! 2. **KV offload** with workers when that holds more context: the device's layers and the host's keep the newest
//!    whole pages (`run --kv-budget`), the oldest go to the workers. Workers only ever hold KV pages beside a device:
//!    workers that compute layers (split prefill, a layer split, experts) cannot be combined with placed layers, so a
//!    plan with a device never uses them, and `--layer-split` with a device is refused.
//!
//! When nothing fits, the explanation suggests only what the command line accepts with a device: more device memory,
//! or a worker holding KV pages.

use super::device::{fit_layers, fit_notes, DeviceBudget, DeviceFit, DeviceLoad, DevicePlacement};
use super::search::{
    capacity, capped_note, largest, new_plan, offload_caps, offload_workers, stage_fixed,
    worker_name,
};
use super::{calib, explain, min_context, moe, DevicePlan, Mode, Plan, PlanError, PlanRequest};
use crate::memory::human;

/// The device's prefix for `positions` KV positions per attention layer (one sequence).
fn fit(req: &PlanRequest, dev: &DeviceBudget, positions: usize) -> DeviceFit {
    let load = DeviceLoad {
        config: &req.config,
        costs: &req.costs,
        memory: dev.memory,
        positions,
        sequences: 1,
        ubatch: req.ubatch,
    };
    fit_layers(&load, 0..req.costs.n_layers())
}

/// The host's share when the device holds layers `[0, end)`: layers `[end, n)`, the ends, their state, KV for
/// `kv_positions` and the scratch.
fn host_share(req: &PlanRequest, end: usize, kv_positions: usize) -> DevicePlan {
    let c = &req.costs;
    let r = end..c.n_layers();
    DevicePlan {
        name: "host".into(),
        memory: req.host_memory,
        layers: r.clone(),
        holds_ends: true,
        weight_bytes: c.weight_bytes(r.clone()).saturating_add(c.ends.total()),
        state_bytes: c.state_bytes(r.clone()),
        kv_positions,
        kv_bytes: c.kv_bytes(r, kv_positions),
        scratch_bytes: c.scratch_bytes(req.ubatch, true, true),
    }
}

/// Whether the device and the host hold everything at `positions` (monotone: true up to some context, then false).
fn fits(req: &PlanRequest, dev: &DeviceBudget, positions: usize) -> bool {
    let end = fit(req, dev, positions).layers.end;
    host_share(req, end, positions).total_bytes() <= req.host_memory
}

/// The largest context (at most the model's) the device and the host hold together; `None` when not even one
/// position fits.
fn local_capacity(req: &PlanRequest, dev: &DeviceBudget) -> Option<usize> {
    let max = req.costs.max_position_embeddings;
    fits(req, dev, 1).then(|| largest(1, max, |c| fits(req, dev, c)))
}

/// The most positions the device's layers of `fit` hold in its memory (at most the model's context).
fn device_capacity(req: &PlanRequest, dev: &DeviceBudget, fit: &DeviceFit) -> usize {
    let fixed = fit.reserve_bytes + fit.weight_bytes + fit.state_bytes;
    let per = req.costs.kv_bytes(fit.layers.clone(), 1);
    let max = req.costs.max_position_embeddings;
    match dev.memory.saturating_sub(fixed).checked_div(per) {
        Some(p) => usize::try_from(p).unwrap_or(usize::MAX).min(max),
        None => max,
    }
}

/// Everything on the device and the host, the device sized for `ctx` positions (which [`fits`]).
fn local(req: &PlanRequest, dev: &DeviceBudget, ctx: usize) -> Plan {
    let n = req.costs.n_layers();
    let f = fit(req, dev, ctx);
    let end = f.layers.end;
    let host_fixed = stage_fixed(req, end..n, true);
    let host_cap = capacity(req, end..n, host_fixed, req.host_memory).unwrap_or(ctx);
    let max_ctx = device_capacity(req, dev, &f).min(host_cap).max(ctx);
    let host = host_share(req, end, max_ctx);
    let idle = (0..req.worker_memory.len())
        .map(|i| DevicePlan::idle(worker_name(i), req.worker_memory[i], n))
        .collect();
    let mut p = new_plan(req, Mode::Local, host, idle, max_ctx);
    let d = DevicePlacement::of(dev, &f, ctx, n);
    if f.layers.is_empty() {
        p.notes.push(format!(
            "everything fits the host ({} of {})",
            human(p.host.total_bytes()),
            human(req.host_memory)
        ));
    } else {
        p.notes.push(format!(
            "everything fits: {} holds layers {}..{end} ({} of {}), the host {} and the embedding and head ({} of {})",
            dev.id,
            f.layers.start,
            human(d.total_bytes()),
            human(dev.memory),
            host_layers(end, n),
            human(p.host.total_bytes()),
            human(req.host_memory)
        ));
    }
    p.notes.extend(fit_notes(&f, &dev.id, dev.memory));
    if !f.layers.is_empty() {
        p.notes.push(format!(
            "{}'s layers are counted with their KV at {ctx} positions (the plan's context): a longer --ctx-size \
             leaves room for fewer",
            dev.id
        ));
    }
    capped_note(req, max_ctx, &mut p.notes);
    if !req.worker_memory.is_empty() {
        p.notes.push(
            "beside layers on a device, workers only hold KV pages (KV offload), and everything fits without them: \
             they are unused"
                .into(),
        );
    }
    p.device = Some(d);
    p
}

/// `layers 31..64` or `no layers` (every layer on the device).
fn host_layers(end: usize, n: usize) -> String {
    if end < n {
        format!("layers {end}..{n}")
    } else {
        "no layers".into()
    }
}

/// KV offload beside a device: the device's layers and the host's keep the newest whole pages (a budget of at least
/// a ubatch and two pages, enough with the workers' pages for `target` where it fits, and then as large as fits
/// without giving up a device layer), the workers the oldest pages in order; `None` when that holds fewer than
/// `need` positions.
fn kv_offload(req: &PlanRequest, dev: &DeviceBudget, need: usize, target: usize) -> Option<Plan> {
    let c = &req.costs;
    let (n, page) = (c.n_layers(), req.page_size);
    let caps = offload_caps(req);
    let on_workers = caps.iter().fold(0usize, |a, &b| a.saturating_add(b));
    let ok = |k: usize| fits(req, dev, k.saturating_mul(page));
    let lo = req.ubatch.saturating_add(2 * page).div_ceil(page);
    let max_pages = c.max_position_embeddings.div_ceil(page).max(lo);
    if !ok(lo) {
        return None;
    }
    let want = target
        .saturating_sub(on_workers)
        .div_ceil(page)
        .clamp(lo, max_pages);
    let k0 = if ok(want) {
        want
    } else {
        largest(lo, want, ok)
    };
    let end0 = fit(req, dev, k0 * page).layers.end;
    let k = largest(k0, max_pages, |k| {
        ok(k) && fit(req, dev, k * page).layers.end == end0
    });
    let budget = k * page;
    let max_ctx = budget
        .saturating_add(on_workers)
        .min(c.max_position_embeddings);
    if max_ctx < need {
        return None;
    }
    let on_host = budget.min(max_ctx);
    let f = fit(req, dev, on_host);
    let host = host_share(req, f.layers.end, on_host);
    let workers = offload_workers(req, &caps, max_ctx - on_host);
    let mode = Mode::KvOffload {
        host_kv_positions: budget,
    };
    let mut p = new_plan(req, mode, host, workers, max_ctx);
    p.notes.push(format!(
        "the weights fit {} and the host but KV for {target} tokens ({}) does not: the layers of both keep the newest \
         {budget} positions ({} pages; run with --kv-budget {budget}), the oldest pages move to the workers in order \
         (they hold KV pages only: workers cannot compute layers beside a device)",
        dev.id,
        human(c.kv_bytes(0..n, target)),
        budget / page
    ));
    p.notes.extend(fit_notes(&f, &dev.id, dev.memory));
    capped_note(req, max_ctx, &mut p.notes);
    p.device = Some(DevicePlacement::of(dev, &f, on_host, n));
    Some(p)
}

/// The placement of `req` with `dev` (see the module docs), without the link costs and rates; `None` when nothing
/// fits.
pub(super) fn place(req: &PlanRequest, dev: &DeviceBudget) -> Option<Plan> {
    let target = req.ctx.unwrap_or(req.costs.max_position_embeddings);
    let need = req.ctx.unwrap_or_else(|| min_context(req));
    let cap = local_capacity(req, dev);
    let local_cap = cap.filter(|&c| c >= need);
    if let Some(c) = local_cap.filter(|&c| c >= target || req.worker_memory.is_empty()) {
        return Some(local(req, dev, req.ctx.unwrap_or(c)));
    }
    if !req.worker_memory.is_empty() {
        if let Some(p) = kv_offload(req, dev, need, target) {
            if cap.is_none_or(|c| p.max_ctx > c) {
                return Some(p);
            }
        }
    }
    local_cap.map(|c| local(req, dev, req.ctx.unwrap_or(c)))
}

/// The plan of `req` with the first layers on `dev` (see the module docs), in [`Plan::device`], with the notes
/// that say how it was shared and what limited it.
///
/// Errors: those of [`super::plan`]'s checks; [`PlanError::Invalid`] for `layer_split` (workers that compute
/// layers do not combine with layers on a device); [`PlanError::DoesNotFit`] when nothing fits, with what would.
pub fn plan_with_device(req: &PlanRequest, dev: &DeviceBudget) -> Result<Plan, PlanError> {
    super::validate(req)?;
    if req.layer_split.is_some() {
        return Err(PlanError::Invalid(format!(
            "--layer-split puts layers on workers, which does not combine with layers on --device {}: beside a \
             device, workers hold KV pages only (give --worker-memory without --layer-split)",
            dev.id
        )));
    }
    let Some(mut p) = place(req, dev) else {
        return Err(explain::does_not_fit_with_device(req, dev));
    };
    if let Some(d) = p.device.as_ref().filter(|d| !d.layers.is_empty()) {
        p.notes.push(format!(
            "the host does not keep the weights of layers {}..{} (they are on {} only): its row counts the weights \
             of the layers on the CPU and of the embedding and head",
            d.layers.start, d.layers.end, d.device
        ));
    }
    p.notes.extend(moe::note(req));
    p.link = calib::link_cost(req, &p);
    let on_device = p.device.as_ref().is_some_and(|d| !d.layers.is_empty());
    if let Some(c) = req.calibration.as_ref() {
        p.expected = (!on_device).then(|| calib::expected(req, &p, c)).flatten();
        if p.expected.is_none() {
            p.notes.push(format!(
                "the calibration has no numbers for {} (or for a device or link this plan uses): no expected rates",
                dev.id
            ));
        }
    }
    Ok(p)
}
