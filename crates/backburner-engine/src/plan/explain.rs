//! Human words for plans: a one-line summary, and the explanation of a plan that does not fit.

use super::{min_context, search, Mode, Plan, PlanError, PlanRequest};
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
    let on_device = match &p.device {
        Some(d) if !d.layers.is_empty() => format!(
            "; layers {}..{} on {}",
            d.layers.start, d.layers.end, d.device
        ),
        Some(d) => format!("; no layer fits {}", d.device),
        None => String::new(),
    };
    format!("{what}{on_device}; context up to {} tokens", p.max_ctx)
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

/// The least memory of one more worker that makes `req` fit, and the plan it gives: a whole number of
/// [`suggestion_step`]s (whole GB for a model of 10 GB or more, 100 MB from 1 GB, …).
fn extra_worker(req: &PlanRequest) -> Option<(u64, Plan)> {
    let c = &req.costs;
    let n = c.n_layers();
    let ctx = req.ctx.unwrap_or_else(|| min_context(req));
    let everything = c
        .total_weight_bytes()
        .saturating_add(c.state_bytes(0..n))
        .saturating_add(c.kv_bytes(0..n, ctx))
        .saturating_add(c.scratch_bytes(req.ubatch, true, true));
    let step = suggestion_step(everything);
    let with = |units: u64| {
        let mut r = req.clone();
        r.calibration = None;
        r.worker_memory.push(units.saturating_mul(step));
        search::place(&r).ok().flatten()
    };
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
