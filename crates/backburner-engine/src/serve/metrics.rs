//! Counters the scheduler keeps for the server's `/metrics`: lock-free atomics updated on the scheduler's thread and
//! read from any thread, plus the slots' link statistics published after every step that may use a worker.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use crate::split::LinkStats;

/// The scheduler's counters (totals since start unless marked a gauge).
#[derive(Debug, Default)]
pub struct Metrics {
    /// Sequences taken by a slot (each choice of a request, `n` > 1: [`super::Job::siblings`], counts; a choice run
    /// again as a job of its own counts again).
    pub requests: AtomicU64,
    /// Requests (each counted once, whatever its `n`) whose choices all finished normally (eos, max tokens, stop
    /// string, full context). A request's outcome is the worst of its choices': failed, invalid, cancelled, ok.
    pub requests_ok: AtomicU64,
    /// Requests with a choice that failed in the engine (a prefill or decode error).
    pub requests_failed: AtomicU64,
    /// Requests refused by the engine's checks (invalid sampling values or token ids, a prompt over the context).
    pub requests_invalid: AtomicU64,
    /// Requests the HTTP server answered with a 400, whatever refused them (its parsing of the body and fields, or the
    /// engine's checks); counted by the server.
    pub bad_requests: AtomicU64,
    /// Requests with a choice cancelled (client gone, shutdown) and none failed.
    pub requests_cancelled: AtomicU64,
    /// Requests refused because the queue was full.
    pub requests_rejected: AtomicU64,
    /// Sequences (choices: a request counts `n`) that finished normally.
    pub sequences_ok: AtomicU64,
    /// Sequences that failed in the engine.
    pub sequences_failed: AtomicU64,
    /// Sequences refused by the engine's checks.
    pub sequences_invalid: AtomicU64,
    /// Sequences cancelled (client gone, shutdown), those still waiting for a slot included.
    pub sequences_cancelled: AtomicU64,
    /// Sequences of the requests refused because the queue was full.
    pub sequences_rejected: AtomicU64,
    /// Gauge: sequences of the queued requests (each counts its `n` choices); see [`Metrics::waiting`].
    pub queue_depth: AtomicU64,
    /// Gauge: choices of running requests waiting for a slot (published by the scheduler every turn); see
    /// [`Metrics::waiting`].
    pub choices_waiting: AtomicU64,
    /// Gauge: sequences in slots (each choice of a request takes one).
    pub active: AtomicU64,
    /// Prompt tokens of the requests (cached ones included).
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens computed (not taken from the cache).
    pub prefill_tokens: AtomicU64,
    /// Time spent in prefill steps (µs).
    pub prefill_us: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Decode steps (one batched forward each).
    pub decode_steps: AtomicU64,
    /// Sequences decoded over all decode steps (÷ `decode_steps` = mean batch).
    pub decode_rows: AtomicU64,
    /// Time spent in decode steps (µs), verify steps included.
    pub decode_us: AtomicU64,
    /// Speculative decoding: verify steps run (each decodes a sequence's pending token and its drafts).
    pub spec_steps: AtomicU64,
    /// Speculative decoding: draft tokens verified.
    pub spec_drafted: AtomicU64,
    /// Speculative decoding: draft tokens accepted (each a decode step saved).
    pub spec_accepted: AtomicU64,
    /// Requests that reused a cached prefix.
    pub cache_hits: AtomicU64,
    /// Prompt tokens reused from the cache.
    pub cached_tokens: AtomicU64,
    /// Link statistics summed over the slots' sessions (published after every prefill chunk and decode step).
    pub link: Mutex<LinkStats>,
    /// Gauge: workers attached to the slots (split prefill, KV offload and layer split; one per slot and worker)
    /// whose last exchange did not fail (or that were not tried yet).
    pub workers_available: AtomicU64,
    /// Gauge: workers attached to the slots (split prefill, KV offload and layer split; one per slot and worker).
    pub workers_attached: AtomicU64,
    /// Why the server cannot serve every request now: a worker it needs is unreachable (a layer-split worker, or
    /// every KV-offload worker of a slot with a KV budget); `None` while all is well. A split-prefill worker is
    /// never needed (the host falls back to local prefill).
    pub degraded: Mutex<Option<String>>,
    /// Gauge: the largest round trip of the idle health pings to the slots' workers (µs; 0 before any).
    pub link_rtt_us: AtomicU64,
    /// Idle health pings that failed.
    pub ping_failures: AtomicU64,
    /// Requests whose steps waited for a worker's backoff to end (KV offload: pages had to move and every worker
    /// that could take them was backing off after a failure); the other slots' steps went on meanwhile.
    pub requests_delayed: AtomicU64,
    /// What each slot is doing (published when a slot takes a request and after every scheduler turn).
    pub slots: super::SlotBoard,
}

impl Metrics {
    /// Adds `v` to counter `c`.
    pub fn add(c: &AtomicU64, v: u64) {
        c.fetch_add(v, Relaxed);
    }

    /// Reads counter `c`.
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Relaxed)
    }

    /// Sets gauge `c`.
    pub fn set(c: &AtomicU64, v: u64) {
        c.store(v, Relaxed);
    }

    /// Gauge: sequences waiting for a slot: every choice of the queued requests, and the choices of running requests
    /// not in a slot yet.
    pub fn waiting(&self) -> u64 {
        Self::get(&self.queue_depth) + Self::get(&self.choices_waiting)
    }

    /// Why the server is degraded, as last published ([`Metrics::degraded`]).
    pub fn degraded(&self) -> Option<String> {
        self.degraded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The slots' link statistics as last published.
    pub fn link_stats(&self) -> LinkStats {
        self.link.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}
