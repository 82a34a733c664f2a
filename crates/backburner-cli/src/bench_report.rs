//! What `bench local` reports beside throughput: the machine's measured read bandwidth, the process's resident memory,
//! and the `--profile` table of time per operator class and phase.

use std::time::Instant;

use backburner_engine::ComputePool;
use backburner_kernels::profile::{Op, Phase, Report};
use serde_json::{json, Value};

/// Bytes read per bandwidth pass: far beyond any last-level cache.
const BW_BYTES: usize = 1 << 30;

/// Read bandwidth of main memory with `pool`'s threads, bytes per second: the best of 5 passes over a 1 GiB buffer,
/// each thread summing a contiguous share (as the decode kernels stream their share of the weights).
pub fn read_bandwidth(pool: &ComputePool) -> f64 {
    let words = BW_BYTES / 8;
    let buf: Vec<u64> = (0..words as u64).collect();
    fastest_rate(BW_BYTES, 5, || {
        pool.install(|| backburner_kernels::parallel::read_sum(&buf))
    })
}

/// `bytes` over the fastest of `repeats` back-to-back timed runs of `read` (whose result is kept from the
/// optimizer), bytes per second.
pub fn fastest_rate(bytes: usize, repeats: usize, mut read: impl FnMut() -> u64) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        std::hint::black_box(read());
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best.max(1e-9)
}

/// Peak resident set size of this process so far (`VmHWM`, bytes), where the OS reports it (Linux).
pub fn peak_rss() -> Option<u64> {
    proc_status_kib("VmHWM:").map(|k| k * 1024)
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Tokens and wall time of one phase, to scale the profile.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseWork {
    /// Tokens processed in the phase.
    pub tokens: usize,
    /// Wall time of the phase (seconds).
    pub seconds: f64,
}

/// The profile table as text (per class: prefill ms, share, µs per token; decode ms per token, share), with matmul
/// GFLOP/s and weight GB/s.
pub fn profile_table(r: &Report, prefill: PhaseWork, decode: PhaseWork) -> String {
    let mut out = String::new();
    let (pt, dt) = (
        r.total_nanos(Phase::Prefill) as f64,
        r.total_nanos(Phase::Decode) as f64,
    );
    out.push_str(&format!(
        "{:<28} {:>11} {:>6} {:>9} | {:>11} {:>6}\n",
        "operator class", "prefill ms", "%", "µs/token", "decode ms/t", "%"
    ));
    for op in Op::ALL {
        let p = r.get(Phase::Prefill, op);
        let d = r.get(Phase::Decode, op);
        if p.nanos == 0 && d.nanos == 0 {
            continue;
        }
        out.push_str(&format!(
            "{:<28} {:>11.1} {:>5.1}% {:>9.1} | {:>11.3} {:>5.1}%\n",
            op.name(),
            p.nanos as f64 / 1e6,
            pct(p.nanos as f64, pt),
            p.nanos as f64 / 1e3 / prefill.tokens.max(1) as f64,
            d.nanos as f64 / 1e6 / decode.tokens.max(1) as f64,
            pct(d.nanos as f64, dt),
        ));
    }
    out.push_str(&format!(
        "{:<28} {:>11.1} {:>6} {:>9.1} | {:>11.3}\n",
        "accounted (wall)",
        pt / 1e6,
        format!("{:.0}%", pct(pt / 1e9, prefill.seconds)),
        pt / 1e3 / prefill.tokens.max(1) as f64,
        dt / 1e6 / decode.tokens.max(1) as f64,
    ));
    for (phase, name) in [(Phase::Prefill, "prefill"), (Phase::Decode, "decode")] {
        let m = r.get(phase, Op::Matmul);
        let h = r.get(phase, Op::Head);
        let (flops, bytes, ns) = (m.flops + h.flops, m.bytes + h.bytes, m.nanos + h.nanos);
        if ns > 0 {
            out.push_str(&format!(
                "{name}: matmuls + head {:.1} GFLOP/s, weights read at {:.1} GB/s\n",
                flops as f64 / ns as f64,
                bytes as f64 / ns as f64
            ));
        }
    }
    out
}

/// The profile as JSON: `{phase: {class: {ms, calls, gflop, gbytes}}}`.
pub fn profile_json(r: &Report) -> Value {
    let mut phases = serde_json::Map::new();
    for phase in Phase::ALL {
        let mut ops = serde_json::Map::new();
        for op in Op::ALL {
            let s = r.get(phase, op);
            if s.calls == 0 && s.nanos == 0 {
                continue;
            }
            ops.insert(
                op.name().to_string(),
                json!({
                    "ms": s.nanos as f64 / 1e6,
                    "calls": s.calls,
                    "gflop": s.flops as f64 / 1e9,
                    "gbytes": s.bytes as f64 / 1e9,
                }),
            );
        }
        phases.insert(phase.name().to_string(), Value::Object(ops));
    }
    Value::Object(phases)
}

fn pct(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        100.0 * part / whole
    } else {
        0.0
    }
}
