//! Human words for plans: a one-line summary, and the explanation of a plan that does not fit.

use super::{min_context, search, DeviceBudget, Mode, Plan, PlanError, PlanRequest};
use crate::memory::human;

const GB: u64 = 1_000_000_000;

/// One line naming the mode, who holds which layers, and the largest context, e.g.
/// `layer split: host 0..24, worker 1 24..32, worker 2 32..64; context up to 262144 tokens`.
pub fn summary(p: &Plan) -> String {
    let n = p
        .host
        .layers
        .end
        .max(p.workers.iter().map(|w| w.layers.end).max().unwrap_or(0));
    let what = match &p.mode {
        Mode::Local => format!("local: the host holds all {n} layers"),
        Mode::SplitPrefill { split_layer } => {
            format!("split prefill: the host holds all {n} layers, worker 1 mirrors {split_layer}..{n}")
        }
        Mode::KvOffload { host_kv_positions } => format!(
            "KV offload: the host holds all {n} layers and the newest {host_kv_positions} positions, the workers the oldest pages"
        ),
        Mode::ExpertSplit => {
            let mut parts = vec![format!("the host holds all {n} layers")];
            parts.extend(
                p.workers
                    .iter()
                    .filter(|w| w.weight_bytes > 0)
                    .map(|w| format!("{} the routed experts of {:?}", w.name, w.layers)),
            );
            format!("experts on workers: {}", parts.join(", "))
        }
        Mode::LayerSplit => {
            let host = if p.host.layers.is_empty() {
                "host (ends only)".to_string()
            } else {
                format!("host {:?}", p.host.layers)
            };
            let mut parts = vec![host];
            parts.extend(
                p.workers
                    .iter()
                    .filter(|w| !w.layers.is_empty())
                    .map(|w| format!("{} {:?}", w.name, w.layers)),
            );
            format!("layer split: {}", parts.join(", "))
        }
    };
    let what = match &p.device {
        Some(d) if !d.layers.is_empty() => with_device(p, d, n),
        Some(d) => format!("{what}; no layer fits {}", d.device),
        None => what,
    };
    format!("{what}; context up to {} tokens", p.max_ctx)
}

/// The summary's words for a plan with layers on a device: `local: cuda:0 holds layers 0..31, the host 31..64 and
/// the embedding and head` (KV offload: and which positions each keeps).
fn with_device(p: &Plan, d: &super::DevicePlacement, n: usize) -> String {
    let dev = if d.layers.len() == n {
        format!("{} holds all {n} layers", d.device)
    } else {
        format!("{} holds layers {:?}", d.device, d.layers)
    };
    let host = if d.cpu_layers.is_empty() {
        "the host the embedding and head".to_string()
    } else {
        format!("the host {:?} and the embedding and head", d.cpu_layers)
    };
    match &p.mode {
        Mode::KvOffload { host_kv_positions } => format!(
            "KV offload: {dev}, {host}, each the newest {host_kv_positions} positions, the workers the oldest pages"
        ),
        _ => format!("local: {dev}, {host}"),
    }
}

fn ordinal(k: usize) -> String {
    match k {
        1 => "first".into(),
        2 => "second".into(),
        3 => "third".into(),
        4 => "fourth".into(),
        _ => format!("{k}th"),
    }
}

/// A worker's memory for people: its size, or `memory not given` for [`super::UNKNOWN_MEMORY`].
fn memory_of(m: u64) -> String {
    if m >= super::UNKNOWN_MEMORY {
        "(memory not given)".into()
    } else {
        human(m)
    }
}

/// `host 24 GB + worker 8 GB` (one worker) or `host 8 GB + worker 1 12 GB + worker 2 8 GB`.
fn devices(req: &PlanRequest) -> String {
    let mut s = format!("host {}", human(req.host_memory));
    let many = req.worker_memory.len() > 1;
    for (i, &m) in req.worker_memory.iter().enumerate() {
        if many {
            s += &format!(" + worker {} {}", i + 1, memory_of(m));
        } else {
            s += &format!(" + worker {}", memory_of(m));
        }
    }
    s
}

/// The [`PlanError::DoesNotFit`] for a request no mode fits: what is needed against what is there, and the least
/// memory (whole GB) one more worker at the end of the chain would need for a plan to fit, with that plan.
pub(super) fn does_not_fit(req: &PlanRequest) -> PlanError {
    let c = &req.costs;
    let n = c.n_layers();
    let ctx = req.ctx.unwrap_or_else(|| min_context(req));
    let weights = c.total_weight_bytes();
    let avail = req
        .worker_memory
        .iter()
        .fold(req.host_memory, |a, &b| a.saturating_add(b));
    let devs = devices(req);
    // a sum only when every device's memory is known (and there is more than the host)
    let total = if req.worker_memory.is_empty() || avail >= super::UNKNOWN_MEMORY {
        String::new()
    } else {
        format!(" = {}", human(avail))
    };
    let mut s = if weights > avail {
        format!(
            "weights need {}; {devs}{total}: does not fit",
            human(weights)
        )
    } else {
        let kv = c.kv_bytes(0..n, ctx);
        let state = c.state_bytes(0..n);
        format!(
            "weights {} + recurrent state {} + KV for {ctx} tokens {} + scratch; {devs}{total}: no placement of whole layers fits",
            human(weights),
            human(state),
            human(kv)
        )
    };
    let host_min = search::host_minimum(req);
    if req.host_memory < host_min {
        s += &format!(
            "; the host alone needs {} for the embedding, head and scratch",
            human(host_min)
        );
        return PlanError::DoesNotFit {
            explanation: s,
            extra_worker_bytes: None,
        };
    }
    let extra = extra_worker(req);
    if let Some((bytes, plan)) = &extra {
        s += &format!(
            "; with a {} worker of {} it fits as {}",
            ordinal(req.worker_memory.len() + 1),
            human(*bytes),
            super::summary(plan)
        );
    }
    PlanError::DoesNotFit {
        explanation: s,
        extra_worker_bytes: extra.map(|e| e.0),
    }
}

/// The [`PlanError::DoesNotFit`] for a request with a device that nothing fits: what is needed against what is
/// there, and what would fit that the command line accepts beside a device (workers that compute layers do not):
/// the least memory of the device, and the least memory of one more worker holding KV pages, each with its plan.
pub(super) fn does_not_fit_with_device(req: &PlanRequest, dev: &DeviceBudget) -> PlanError {
    let c = &req.costs;
    let n = c.n_layers();
    let ctx = req.ctx.unwrap_or_else(|| min_context(req));
    let weights = c.total_weight_bytes();
    let reserve = super::device_reserve(c, req.ubatch);
    let there = format!(
        "{} {} (keeping back {} for its runtime) + {}",
        dev.id,
        human(dev.memory),
        human(reserve),
        devices(req)
    );
    let room = req
        .worker_memory
        .iter()
        .fold(req.host_memory, |a, &b| a.saturating_add(b))
        .saturating_add(dev.memory.saturating_sub(reserve));
    let mut s = if weights > room {
        format!("weights need {}; {there}: does not fit", human(weights))
    } else {
        format!(
            "weights {} + recurrent state {} + KV for {ctx} tokens {} + scratch; {there}: no placement fits (the \
             device takes the first layers that fit, the host the rest and the embedding and head)",
            human(weights),
            human(c.state_bytes(0..n)),
            human(c.kv_bytes(0..n, ctx))
        )
    };
    let host_min = search::host_minimum(req);
    if req.host_memory < host_min {
        s += &format!(
            "; the host alone needs {} for the embedding, head and scratch (the host keeps them with layers on a device)",
            human(host_min)
        );
        return PlanError::DoesNotFit {
            explanation: s,
            extra_worker_bytes: None,
        };
    }
    let bigger = least_fitting(everything(req).saturating_add(reserve), |memory| {
        let d = DeviceBudget {
            id: dev.id.clone(),
            memory,
        };
        super::device_plan::place(req, &d)
    });
    if let Some((bytes, plan)) = &bigger {
        s += &format!(
            "; with {} on {} (--device-memory) it fits as {}",
            human(*bytes),
            dev.id,
            super::summary(plan)
        );
    }
    let worker = least_fitting(everything(req), |bytes| {
        let mut r = req.clone();
        r.calibration = None;
        r.worker_memory.push(bytes);
        super::device_plan::place(&r, dev)
    });
    if let Some((bytes, plan)) = &worker {
        s += &format!(
            "; {} a {} worker of {} holding KV pages (`run --worker ADDR --kv-budget N`: beside a device, workers \
             do not compute layers) it fits as {}",
            if bigger.is_some() { "or with" } else { "with" },
            ordinal(req.worker_memory.len() + 1),
            human(*bytes),
            super::summary(plan)
        );
    }
    PlanError::DoesNotFit {
        explanation: s,
        extra_worker_bytes: worker.map(|e| e.0),
    }
}

/// Bytes of everything `req` asks for at its context (or the least one): weights, state, KV and scratch.
fn everything(req: &PlanRequest) -> u64 {
    let c = &req.costs;
    let n = c.n_layers();
    let ctx = req.ctx.unwrap_or_else(|| min_context(req));
    c.total_weight_bytes()
        .saturating_add(c.state_bytes(0..n))
        .saturating_add(c.kv_bytes(0..n, ctx))
        .saturating_add(c.scratch_bytes(req.ubatch, true, true))
}

/// The least memory of one more worker that makes `req` fit, and the plan it gives: a whole number of
/// [`suggestion_step`]s (whole GB for a model of 10 GB or more, 100 MB from 1 GB, …).
fn extra_worker(req: &PlanRequest) -> Option<(u64, Plan)> {
    least_fitting(everything(req), |bytes| {
        let mut r = req.clone();
        r.calibration = None;
        r.worker_memory.push(bytes);
        search::place(&r).ok().flatten()
    })
}

/// The least whole number of [`suggestion_step`]s of `everything` bytes for which `with` gives a plan (at most
/// `everything` and a step), with that plan; `None` when even that does not fit. `with` must be monotone (a plan
/// for some bytes, then for every larger amount).
fn least_fitting(everything: u64, with: impl Fn(u64) -> Option<Plan>) -> Option<(u64, Plan)> {
    let step = suggestion_step(everything);
    let with = |units: u64| with(units.saturating_mul(step));
    let hi = everything.div_ceil(step).saturating_add(1);
    with(hi)?;
    let (mut lo, mut hi) = (1u64, hi);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if with(mid).is_some() {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    with(lo).map(|p| (lo.saturating_mul(step), p))
}

/// The rounding of a suggested worker memory for a model that needs `everything` bytes in all: a tenth of its
/// leading power of ten (1 GB for 10–99 GB, 100 MB for 1–9.9 GB, 10 MB for 100–999 MB), at most 1 GB and at least
/// 1 MB, so the suggestion is within about 10 % of the least that fits.
fn suggestion_step(everything: u64) -> u64 {
    let mut p = 1u64;
    // Checked: a sum that saturated at u64::MAX (an absurd --ubatch's scratch) has no power of ten above it.
    while let Some(next) = p.checked_mul(10).filter(|&n| n <= everything) {
        p = next;
    }
    (p / 10).clamp(1_000_000, GB)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suggestion_step_is_a_tenth_of_the_leading_power_of_ten_and_ends_at_the_top_of_u64() {
        assert_eq!(suggestion_step(0), 1_000_000);
        assert_eq!(suggestion_step(999_999_999), 10_000_000);
        assert_eq!(suggestion_step(1_000_000_000), 100_000_000);
        assert_eq!(suggestion_step(53_800_000_000), GB);
        // 10^19 is the largest power of ten in a u64; past it the loop used to wrap around forever.
        assert_eq!(suggestion_step(10_000_000_000_000_000_000), GB);
        assert_eq!(suggestion_step(u64::MAX), GB);
    }
}
