//! `GET /metrics`: the engine's counters in the Prometheus text exposition format (version 0.0.4).

use std::fmt::Write;

use backburner_engine::serve::Metrics;

/// One metric family: `# HELP`, `# TYPE`, then its samples (`labels` may be empty).
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(&str, f64)]) {
    let _ = writeln!(out, "# HELP backburner_{name} {help}");
    let _ = writeln!(out, "# TYPE backburner_{name} {kind}");
    for (labels, v) in samples {
        let _ = writeln!(out, "backburner_{name}{labels} {v}");
    }
}

/// The metrics page.
pub fn render(m: &Metrics, slots: usize) -> String {
    let g = |c: &std::sync::atomic::AtomicU64| Metrics::get(c) as f64;
    let mut o = String::new();
    family(
        &mut o,
        "requests_total",
        "counter",
        "Requests by outcome, each counted once whatever its n, when its last choice ends: the worst of its choices' \
         (failed, invalid, cancelled, ok; invalid: refused by the engine's checks; rejected: the queue was full).",
        &[
            ("{outcome=\"ok\"}", g(&m.requests_ok)),
            ("{outcome=\"invalid\"}", g(&m.requests_invalid)),
            ("{outcome=\"failed\"}", g(&m.requests_failed)),
            ("{outcome=\"cancelled\"}", g(&m.requests_cancelled)),
            ("{outcome=\"rejected\"}", g(&m.requests_rejected)),
        ],
    );
    family(
        &mut o,
        "sequences_total",
        "counter",
        "Sequences (choices: a request counts n) by outcome, as requests_total (cancelled: choices still waiting for \
         a slot included).",
        &[
            ("{outcome=\"ok\"}", g(&m.sequences_ok)),
            ("{outcome=\"invalid\"}", g(&m.sequences_invalid)),
            ("{outcome=\"failed\"}", g(&m.sequences_failed)),
            ("{outcome=\"cancelled\"}", g(&m.sequences_cancelled)),
            ("{outcome=\"rejected\"}", g(&m.sequences_rejected)),
        ],
    );
    family(
        &mut o,
        "bad_requests_total",
        "counter",
        "Requests answered 400, whatever refused them (the body's parsing and fields, or the engine's checks).",
        &[("", g(&m.bad_requests))],
    );
    family(
        &mut o,
        "requests_running",
        "gauge",
        "Sequences in slots (each choice of a request takes one).",
        &[("", g(&m.active))],
    );
    family(
        &mut o,
        "slots",
        "gauge",
        "Parallel slots.",
        &[("", slots as f64)],
    );
    family(
        &mut o,
        "queue_depth",
        "gauge",
        "Sequences waiting for a slot: every choice of the queued requests, and the choices of running requests not \
         in a slot yet.",
        &[("", m.waiting() as f64)],
    );
    family(
        &mut o,
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of the requests, cached ones included.",
        &[("", g(&m.prompt_tokens))],
    );
    family(
        &mut o,
        "prefill_tokens_total",
        "counter",
        "Prompt tokens computed (not from the cache).",
        &[("", g(&m.prefill_tokens))],
    );
    family(
        &mut o,
        "generated_tokens_total",
        "counter",
        "Tokens generated.",
        &[("", g(&m.generated_tokens))],
    );
    let (pre_s, dec_s) = (g(&m.prefill_us) / 1e6, g(&m.decode_us) / 1e6);
    family(
        &mut o,
        "prefill_seconds_total",
        "counter",
        "Time in prefill steps.",
        &[("", pre_s)],
    );
    family(
        &mut o,
        "decode_seconds_total",
        "counter",
        "Time in decode steps.",
        &[("", dec_s)],
    );
    let rate = |n: f64, s: f64| if s > 0.0 { n / s } else { 0.0 };
    family(
        &mut o,
        "prefill_tokens_per_second",
        "gauge",
        "Prefill throughput since start.",
        &[("", rate(g(&m.prefill_tokens), pre_s))],
    );
    family(
        &mut o,
        "decode_tokens_per_second",
        "gauge",
        "Aggregate decode throughput since start (all slots).",
        &[("", rate(g(&m.decode_rows), dec_s))],
    );
    family(
        &mut o,
        "decode_steps_total",
        "counter",
        "Batched decode steps.",
        &[("", g(&m.decode_steps))],
    );
    family(
        &mut o,
        "decode_rows_total",
        "counter",
        "Sequences decoded over all decode steps.",
        &[("", g(&m.decode_rows))],
    );
    family(
        &mut o,
        "spec_steps_total",
        "counter",
        "Speculative decoding: verify steps (a pending token and its drafts decoded in one step).",
        &[("", g(&m.spec_steps))],
    );
    family(
        &mut o,
        "spec_draft_tokens_total",
        "counter",
        "Speculative decoding: draft tokens verified.",
        &[("", g(&m.spec_drafted))],
    );
    family(
        &mut o,
        "spec_accepted_tokens_total",
        "counter",
        "Speculative decoding: draft tokens accepted (each a decode step saved).",
        &[("", g(&m.spec_accepted))],
    );
    family(
        &mut o,
        "cache_hits_total",
        "counter",
        "Requests that reused a cached prefix.",
        &[("", g(&m.cache_hits))],
    );
    family(
        &mut o,
        "cache_reused_tokens_total",
        "counter",
        "Prompt tokens reused from the cache.",
        &[("", g(&m.cached_tokens))],
    );
    let l = m.link_stats();
    family(
        &mut o,
        "workers_attached",
        "gauge",
        "Workers attached to the slots.",
        &[("", g(&m.workers_attached))],
    );
    family(
        &mut o,
        "workers_connected",
        "gauge",
        "Attached workers whose last exchange succeeded (or not tried yet); a failed one counts again once a retry succeeds.",
        &[("", g(&m.workers_available))],
    );
    family(
        &mut o,
        "link_rtt_seconds",
        "gauge",
        "Largest round trip of the last idle health pings to the workers (0 before the first).",
        &[("", g(&m.link_rtt_us) / 1e6)],
    );
    family(
        &mut o,
        "worker_ping_failures_total",
        "counter",
        "Idle health pings to a worker that failed.",
        &[("", g(&m.ping_failures))],
    );
    family(
        &mut o,
        "requests_delayed_total",
        "counter",
        "Requests that waited for a worker's backoff to end (KV offload) instead of failing.",
        &[("", g(&m.requests_delayed))],
    );
    family(
        &mut o,
        "split_prefill_calls_total",
        "counter",
        "Prefills run split with a worker.",
        &[("", l.split_calls as f64)],
    );
    family(
        &mut o,
        "worker_tokens_total",
        "counter",
        "Tokens whose tail layers ran on a worker.",
        &[("", l.worker_tokens as f64)],
    );
    family(
        &mut o,
        "fallbacks_total",
        "counter",
        "Split calls that failed on the worker and ran locally.",
        &[("", l.fallbacks as f64)],
    );
    family(
        &mut o,
        "offload_failures_total",
        "counter",
        "KV offload requests that failed on a worker.",
        &[("", l.offload_failures as f64)],
    );
    family(
        &mut o,
        "offload_retries_total",
        "counter",
        "KV offload requests retried once on a fresh connection after a worker lost their session.",
        &[("", l.offload_retries as f64)],
    );
    family(
        &mut o,
        "kv_pages_on_workers",
        "gauge",
        "KV pages held by workers.",
        &[("", l.pages_on_workers as f64)],
    );
    family(
        &mut o,
        "link_bytes_total",
        "counter",
        "Bytes over the links to workers.",
        &[
            ("{direction=\"sent\"}", l.bytes_sent as f64),
            ("{direction=\"received\"}", l.bytes_received as f64),
        ],
    );
    family(
        &mut o,
        "worker_compute_seconds_total",
        "counter",
        "Worker compute time reported by the workers.",
        &[("", l.worker_compute_us as f64 / 1e6)],
    );
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_health_ping_figures_are_on_the_page() {
        let m = Metrics::default();
        Metrics::set(&m.link_rtt_us, 1500);
        Metrics::add(&m.ping_failures, 2);
        Metrics::add(&m.requests_delayed, 3);
        let page = render(&m, 1);
        assert!(
            page.contains("\nbackburner_link_rtt_seconds 0.0015\n"),
            "{page}"
        );
        assert!(
            page.contains("\nbackburner_worker_ping_failures_total 2\n"),
            "{page}"
        );
        assert!(
            page.contains("\nbackburner_requests_delayed_total 3\n"),
            "{page}"
        );
    }

    #[test]
    fn sequences_have_their_own_family_and_the_queue_counts_waiting_choices() {
        let m = Metrics::default();
        Metrics::add(&m.requests_cancelled, 1);
        Metrics::add(&m.sequences_cancelled, 3);
        Metrics::set(&m.queue_depth, 2);
        Metrics::set(&m.choices_waiting, 4);
        let page = render(&m, 1);
        for line in [
            "backburner_requests_total{outcome=\"cancelled\"} 1",
            "backburner_sequences_total{outcome=\"cancelled\"} 3",
            "backburner_sequences_total{outcome=\"ok\"} 0",
            "# TYPE backburner_sequences_total counter",
            "backburner_queue_depth 6",
        ] {
            assert!(page.contains(&format!("\n{line}\n")), "{line}: {page}");
        }
    }
}
