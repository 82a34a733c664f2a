//! The slots' workers as the scheduler sees them: idle health pings, and the link statistics, worker gauges and
//! health verdict it publishes for `/metrics` and `/health`.

use std::time::Duration;

use super::metrics::Metrics;
use super::Slot;
use crate::connection::SessionShape;
use crate::session::Session;

/// How often the workers get a health ping while no job runs (the default of [`super::ServeOptions::ping_every`]).
pub const PING_EVERY: Duration = Duration::from_secs(10);

/// Pings every slot's workers (idle only, so no compute waits on it): split-prefill / KV-offload workers, and
/// layer-split workers (reconnected once their backoff ends, see [`crate::chain::LayerSplit::probe`]). The
/// largest round trip goes to `link_rtt_us`; failures mark the worker failing (its backoff) and count in
/// `ping_failures`.
pub(super) fn ping_workers(slots: &mut [Slot], m: &Metrics) {
    let mut worst = None;
    for s in slots.iter_mut() {
        let session = s.session_mut();
        let mut results = ping_split_workers(session);
        results.extend(ping_chain(session));
        for (addr, r) in results {
            match r {
                Ok(d) => worst = worst.max(Some(d.as_micros() as u64)),
                Err(e) => {
                    tracing::warn!(worker = %addr, error = %e, "worker health ping failed");
                    Metrics::add(&m.ping_failures, 1);
                }
            }
        }
    }
    if let Some(us) = worst {
        Metrics::set(&m.link_rtt_us, us);
    }
    publish_link(slots, m);
}

/// Probes a session's split-prefill / KV-offload workers: `(address, round trip or error)` for those tried.
fn ping_split_workers(session: &mut Session) -> Vec<(String, Result<Duration, String>)> {
    let (cfg, o) = (session.model().config().clone(), session.options().clone());
    let mut out = Vec::new();
    for w in session.workers().iter_mut() {
        if let Some(r) = w.probe(&cfg, o.kv.dtype, o.kv.page_size, o.ubatch) {
            out.push((w.settings().addr.clone(), r.map_err(|e| e.to_string())));
        }
    }
    out
}

/// Probes a session's layer-split workers: `(address, round trip or error)` for those tried.
fn ping_chain(session: &mut Session) -> Vec<(String, Result<Duration, String>)> {
    let cfg = session.model().config().clone();
    let o = session.options();
    let shape = SessionShape {
        kv: o.kv.dtype,
        page: o.kv.page_size,
        ubatch: o.ubatch,
    };
    let Some(chain) = session.chain.as_mut() else {
        return Vec::new();
    };
    let addrs: Vec<String> = chain
        .stages()
        .iter()
        .map(|s| s.addr().to_string())
        .collect();
    let results = chain.probe(&cfg, shape);
    addrs
        .into_iter()
        .zip(results)
        .filter_map(|(a, r)| r.map(|r| (a, r)))
        .collect()
}

/// Publishes the slots' link statistics, worker gauges and health verdict; called after every step that may use a
/// worker (a prefill chunk, a decode step) and before that step's events go out, so that what a client reads on
/// `/metrics` after its answer includes its request.
pub(super) fn publish_link(slots: &[Slot], m: &Metrics) {
    let mut sum = crate::split::LinkStats::default();
    let (mut attached, mut healthy) = (0, 0);
    let mut degraded = None;
    for s in slots {
        let session = s.session();
        sum.add(&session.link_stats());
        let workers = session.workers();
        for w in workers.iter() {
            attached += 1;
            // not `available()`: that turns true again when a backoff runs out, with nobody having tried the worker
            healthy += !w.failing() as u64;
        }
        // KV offload needs a worker to take pages: every one of them failing is a problem, one of several is not
        let needed = session.options().kv_budget.is_some() && !workers.is_empty();
        if needed && degraded.is_none() && workers.iter().all(|w| w.failing()) {
            let why: Vec<String> = workers
                .iter()
                .map(|w| {
                    let e = w.last_error().unwrap_or("unreachable");
                    format!("{}: {e}", w.settings().addr)
                })
                .collect();
            degraded = Some(format!(
                "no KV-offload worker is reachable ({}): requests whose KV cache outgrows --kv-budget fail",
                why.join("; ")
            ));
        }
        drop(workers);
        if let Some(chain) = session.layer_split() {
            attached += chain.stages().len() as u64;
            let failing = chain.failing();
            healthy += (chain.stages().len() - failing.len()) as u64;
            if let (Some((addr, layers, why)), None) = (failing.first(), &degraded) {
                degraded = Some(format!(
                    "layer-split worker {addr} (layers {}..{}) is unreachable ({why}): requests fail until it is back",
                    layers.start, layers.end
                ));
            }
        }
    }
    *m.link.lock().unwrap_or_else(|p| p.into_inner()) = sum;
    *m.degraded.lock().unwrap_or_else(|p| p.into_inner()) = degraded;
    Metrics::set(&m.workers_attached, attached);
    Metrics::set(&m.workers_available, healthy);
}
