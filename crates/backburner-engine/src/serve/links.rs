//! The slots' workers as the scheduler sees them: idle health pings, and the link statistics and worker gauges it
//! publishes for `/metrics`.

use std::time::Duration;

use super::metrics::Metrics;
use super::Slot;

/// How often the workers get a health ping while no job runs.
pub(super) const PING_EVERY: Duration = Duration::from_secs(10);

/// Pings every slot's split-prefill / KV-offload workers (idle only, so no compute waits on it): the largest round
/// trip goes to `link_rtt_us`, failures mark the worker unavailable (its backoff) and count in `ping_failures`.
pub(super) fn ping_workers(slots: &mut [Slot], m: &Metrics) {
    let mut worst = None;
    for s in slots.iter_mut() {
        let session = s.session_mut();
        let (cfg, o) = (session.model().config().clone(), session.options().clone());
        for w in session.workers().iter_mut() {
            match w.probe(&cfg, o.kv.dtype, o.kv.page_size, o.ubatch) {
                Some(Ok(d)) => worst = worst.max(Some(d.as_micros() as u64)),
                Some(Err(e)) => {
                    tracing::warn!(worker = %w.settings().addr, error = %e, "worker health ping failed");
                    Metrics::add(&m.ping_failures, 1);
                }
                None => {}
            }
        }
    }
    if let Some(us) = worst {
        Metrics::set(&m.link_rtt_us, us);
    }
    publish_link(slots, m);
}

/// Publishes the slots' link statistics and worker gauges; called after every step that may use a worker (a
/// prefill chunk, a decode step) and before that step's events go out, so that what a client reads on `/metrics`
/// after its answer includes its request.
pub(super) fn publish_link(slots: &[Slot], m: &Metrics) {
    let mut sum = crate::split::LinkStats::default();
    let (mut attached, mut healthy) = (0, 0);
    for s in slots {
        sum.add(&s.session().link_stats());
        for w in s.session().workers().iter() {
            attached += 1;
            // not `available()`: that turns true again when a backoff runs out, with nobody having tried the worker
            healthy += !w.failing() as u64;
        }
    }
    *m.link.lock().unwrap_or_else(|p| p.into_inner()) = sum;
    Metrics::set(&m.workers_attached, attached);
    Metrics::set(&m.workers_available, healthy);
}
