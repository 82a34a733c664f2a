//! Opt-in wall-clock accounting of the forward pass by operator class and phase (`backburner bench local
//! --profile`).
//!
//! The engine and model open a [`scope`] around each operator on the thread that drives the forward pass. Scopes
//! nest and time is *exclusive*: while an inner scope runs, its parent's clock is paused, so every nanosecond is
//! charged to exactly one [`Op`] and the classes of a phase add up to its wall time. The parallel helper
//! ([`crate::parallel`]) moves the time a parallel region spends waiting for its slowest task (wall time minus the
//! mean task time) from the enclosing operator to [`Op::Sync`].
//!
//! Disabled (the default), a scope costs one relaxed atomic load. Counters are process-wide; concurrent forwards
//! on several threads (a host and a worker in one process) add into the same counters.

use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

/// Operator classes of the forward pass and around it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Dense projections of the decoder layers (matrix × weight matrix).
    Matmul,
    /// The final norm and output head (vocabulary projection).
    Head,
    /// Embedding lookup.
    Embed,
    /// Gated DeltaNet causal depthwise convolution (+ SiLU).
    GdnConv,
    /// Gated DeltaNet chunked delta rule (prefill).
    DeltaChunked,
    /// Gated DeltaNet recurrence (decode). One token's step runs the conv, the q/k and gated norms with it in one
    /// parallel region (`gdn::delta_rule_decode_step`), so they are charged here, not to [`Op::GdnConv`] and
    /// [`Op::Norm`].
    DeltaRecurrent,
    /// Full attention over the KV pages (partials and their merge).
    Attention,
    /// Appending K/V rows to the paged KV cache (f16 conversion).
    KvAppend,
    /// RMSNorm, gated RMSNorm, l2 norm.
    Norm,
    /// Rotary position embedding.
    Rope,
    /// Element-wise activations and gates (SiLU, sigmoid, softplus, residual adds).
    Activation,
    /// Copies, gathers and layout changes of activations.
    Copy,
    /// Sampling the next token from the logits.
    Sampling,
    /// Waiting for the slowest task of a parallel region.
    Sync,
}

impl Op {
    /// Every class, in report order.
    pub const ALL: [Op; 14] = [
        Op::Matmul,
        Op::Head,
        Op::Embed,
        Op::GdnConv,
        Op::DeltaChunked,
        Op::DeltaRecurrent,
        Op::Attention,
        Op::KvAppend,
        Op::Norm,
        Op::Rope,
        Op::Activation,
        Op::Copy,
        Op::Sampling,
        Op::Sync,
    ];

    /// A short human-readable name.
    pub fn name(self) -> &'static str {
        match self {
            Op::Matmul => "dense matmuls",
            Op::Head => "output head",
            Op::Embed => "embedding",
            Op::GdnConv => "GDN conv",
            Op::DeltaChunked => "GDN chunked delta rule",
            Op::DeltaRecurrent => "GDN decode step",
            Op::Attention => "attention",
            Op::KvAppend => "KV append",
            Op::Norm => "norms",
            Op::Rope => "RoPE",
            Op::Activation => "activations, gates, adds",
            Op::Copy => "copies and conversions",
            Op::Sampling => "sampling",
            Op::Sync => "thread synchronisation",
        }
    }

    fn index(self) -> usize {
        Op::ALL.iter().position(|&o| o == self).expect("listed")
    }
}

/// Phase of the session the time belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Prompt ingestion (more than one token per call).
    Prefill,
    /// One token per call.
    Decode,
}

impl Phase {
    /// Both phases.
    pub const ALL: [Phase; 2] = [Phase::Prefill, Phase::Decode];

    /// `"prefill"` or `"decode"`.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
        }
    }
}

const N_OPS: usize = Op::ALL.len();

struct Counters {
    nanos: [AtomicU64; N_OPS],
    calls: [AtomicU64; N_OPS],
    flops: [AtomicU64; N_OPS],
    bytes: [AtomicU64; N_OPS],
}

impl Counters {
    const fn new() -> Self {
        Counters {
            nanos: [const { AtomicU64::new(0) }; N_OPS],
            calls: [const { AtomicU64::new(0) }; N_OPS],
            flops: [const { AtomicU64::new(0) }; N_OPS],
            bytes: [const { AtomicU64::new(0) }; N_OPS],
        }
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static PHASE: AtomicUsize = AtomicUsize::new(0);
static COUNTERS: [Counters; 2] = [Counters::new(), Counters::new()];

thread_local! {
    /// Open scopes of this thread: (class, when its clock last (re)started).
    static STACK: RefCell<Vec<(Op, Instant)>> = const { RefCell::new(Vec::new()) };
}

/// Turns accounting on or off (process-wide).
pub fn set_enabled(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// Whether accounting is on.
#[inline]
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Sets the phase later scopes are charged to.
pub fn set_phase(p: Phase) {
    PHASE.store(p as usize, Ordering::Relaxed);
}

fn counters() -> &'static Counters {
    &COUNTERS[PHASE.load(Ordering::Relaxed)]
}

fn charge(op: Op, ns: u64) {
    counters().nanos[op.index()].fetch_add(ns, Ordering::Relaxed);
}

/// An open accounting scope; time until it is dropped (minus nested scopes) is charged to its [`Op`].
#[must_use = "the scope measures until it is dropped"]
pub struct Scope {
    active: bool,
}

/// Opens a scope of class `op` on this thread (a no-op unless [`enabled`]).
#[inline]
pub fn scope(op: Op) -> Scope {
    if !enabled() {
        return Scope { active: false };
    }
    let now = Instant::now();
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        if let Some((parent, since)) = s.last_mut() {
            charge(*parent, nanos_between(*since, now));
            *since = now;
        }
        s.push((op, now));
    });
    counters().calls[op.index()].fetch_add(1, Ordering::Relaxed);
    Scope { active: true }
}

impl Drop for Scope {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let now = Instant::now();
        STACK.with(|s| {
            let mut s = s.borrow_mut();
            if let Some((op, since)) = s.pop() {
                charge(op, nanos_between(since, now));
            }
            if let Some((_, since)) = s.last_mut() {
                *since = now;
            }
        });
    }
}

fn nanos_between(a: Instant, b: Instant) -> u64 {
    u64::try_from(b.saturating_duration_since(a).as_nanos()).unwrap_or(u64::MAX)
}

/// Records `flops` floating-point operations and `bytes` of weights read by an operator of class `op` (for the
/// GFLOP/s and GB/s columns). No-op unless [`enabled`].
#[inline]
pub fn add_work(op: Op, flops: u64, bytes: u64) {
    if enabled() {
        let c = counters();
        c.flops[op.index()].fetch_add(flops, Ordering::Relaxed);
        c.bytes[op.index()].fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Moves `ns` nanoseconds of the innermost open scope of this thread to [`Op::Sync`] (called by the parallel
/// helper after a region). No-op without an open scope.
pub(crate) fn charge_sync(ns: u64) {
    if ns == 0 || !enabled() {
        return;
    }
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        if let Some((_, since)) = s.last_mut() {
            // The parent's clock restarts `ns` later: that interval is charged to Sync instead.
            *since += std::time::Duration::from_nanos(ns);
            charge(Op::Sync, ns);
        }
    });
}

/// Accumulated figures of one class in one phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpStats {
    /// Exclusive wall time, nanoseconds.
    pub nanos: u64,
    /// Scopes opened.
    pub calls: u64,
    /// Floating-point operations recorded with [`add_work`].
    pub flops: u64,
    /// Weight bytes recorded with [`add_work`].
    pub bytes: u64,
}

/// A snapshot of all counters: `stats[phase][op]` in the order of [`Phase::ALL`] and [`Op::ALL`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Per phase, per class.
    pub stats: Vec<Vec<OpStats>>,
}

impl Report {
    /// The figures of `op` in `phase`.
    pub fn get(&self, phase: Phase, op: Op) -> OpStats {
        self.stats
            .get(phase as usize)
            .and_then(|p| p.get(op.index()))
            .copied()
            .unwrap_or_default()
    }

    /// Total accounted nanoseconds of a phase.
    pub fn total_nanos(&self, phase: Phase) -> u64 {
        Op::ALL.iter().map(|&o| self.get(phase, o).nanos).sum()
    }
}

/// Returns the counters and resets them to zero.
pub fn take() -> Report {
    let stats = COUNTERS
        .iter()
        .map(|c| {
            (0..N_OPS)
                .map(|i| OpStats {
                    nanos: c.nanos[i].swap(0, Ordering::Relaxed),
                    calls: c.calls[i].swap(0, Ordering::Relaxed),
                    flops: c.flops[i].swap(0, Ordering::Relaxed),
                    bytes: c.bytes[i].swap(0, Ordering::Relaxed),
                })
                .collect()
        })
        .collect();
    Report { stats }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_scopes_charge_exclusive_time_and_sync_moves_time() {
        // The counters are process-wide; this is the only test in the crate that enables them.
        set_enabled(true);
        set_phase(Phase::Decode);
        let _ = take();
        let t = std::time::Instant::now();
        {
            let _outer = scope(Op::Head);
            std::thread::sleep(std::time::Duration::from_millis(20));
            {
                let _inner = scope(Op::Matmul);
                std::thread::sleep(std::time::Duration::from_millis(30));
                charge_sync(10_000_000);
            }
        }
        let wall = t.elapsed().as_nanos() as u64;
        set_enabled(false);
        let r = take();
        let head = r.get(Phase::Decode, Op::Head);
        let mm = r.get(Phase::Decode, Op::Matmul);
        let sync = r.get(Phase::Decode, Op::Sync);
        assert_eq!((head.calls, mm.calls), (1, 1));
        assert_eq!(sync.nanos, 10_000_000);
        // 20 ms in the outer scope only, 30 ms in the inner of which 10 ms moved to Sync: each at least its sleep, and
        // together no more than the wall time (the inner time charged to the outer too would double count it). No
        // fixed upper bound: a loaded machine oversleeps.
        assert!(head.nanos >= 20_000_000, "{head:?}");
        assert!(mm.nanos >= 20_000_000, "{mm:?}");
        assert!(
            head.nanos + mm.nanos + sync.nanos <= wall,
            "{head:?} {mm:?} {sync:?} wall {wall}"
        );
        assert_eq!(r.get(Phase::Prefill, Op::Head), OpStats::default());
    }
}
