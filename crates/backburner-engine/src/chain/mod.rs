//! Layer split ("zero-to-one" for weights): the host holds the embedding, layers `[0, L₁)`, the final norm and the
//! head; worker 1 holds the only copy of `[L₁, L₂)`, worker 2 of `[L₂, L₃)`, …, the last worker up to n. Each
//! ubatch's residual stream goes host → worker 1 → host → worker 2 → … → host: the host relays every hop (workers
//! never talk to each other, so each needs only the host's link and secret; the cost is one extra link crossing per
//! worker boundary: per token 2 × hidden × 4 bytes each way per worker, e.g. 8 KiB per worker for hidden 1024). The
//! final norm and head run on the host, so logits never cross.
//!
//! Prefill is pipelined: while a worker runs ubatch i, the host computes ubatch i+1's layers and the link carries
//! the others (one sender and one receiver thread per worker connection). Decode sends one residual row per worker
//! and gets one back.
//!
//! A worker holds the only copy of its layers' state. A worker that loses its session mid-request (evicted for
//! another host's memory, a dropped connection) is reconnected at once and the history re-ingested within the
//! request, once; a worker that cannot be reached, or fails again, fails the request with
//! [`crate::EngineError::WorkerLost`] (or [`crate::EngineError::WorkerUnavailable`]); the session keeps its tokens
//! and the next request re-ingests them through fresh worker sessions (once the worker is back).

pub mod calibrate;
mod health;
mod rewind;
mod run;
mod session;
mod verify;

pub(crate) use verify::VerifyOut;

use std::ops::Range;

use backburner_link::LinkError;
use backburner_model::ModelConfig;
use serde::Serialize;

use crate::connection::Connection;
use crate::split::LinkStats;

/// One worker of a layer split: its connection, the layers it holds, and how far its state matches the host's.
#[derive(Debug)]
pub struct Stage {
    pub(crate) link: Connection,
    pub(crate) range: Range<usize>,
    /// Positions the worker's session holds (those of the host); `None` after a failure (its state is gone).
    pub(crate) pos: Option<usize>,
    /// Observed worker compute per token and layer (µs), for deadlines.
    pub(crate) us_per_token_layer: Option<f64>,
    /// Calibration only: take the range a worker is pinned to (`--layers`) instead of refusing it.
    pub(crate) adopt_pinned: bool,
}

impl Stage {
    /// A worker that will hold `range` (connected on first use).
    pub fn new(link: Connection, range: Range<usize>) -> Self {
        Stage {
            link,
            range,
            pos: Some(0),
            us_per_token_layer: None,
            adopt_pinned: false,
        }
    }

    /// The layers this worker holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The worker's address.
    pub fn addr(&self) -> &str {
        &self.link.settings.addr
    }
}

/// Time spent per side in layer-split calls (µs), for the stats line and `bench layer-split`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct ChainStats {
    /// Calls (prefills and decode steps) that ran through the workers.
    pub calls: u64,
    /// Tokens those calls carried.
    pub tokens: u64,
    /// Host compute: embedding, its layers and the head (µs).
    pub host_us: u64,
    /// Worker compute reported by the workers, summed over workers (µs).
    pub worker_us: u64,
    /// Wall time of the calls (µs).
    pub wall_us: u64,
    /// Single-token calls (decode steps) among `calls`.
    pub decode_calls: u64,
    /// Host compute in decode steps (µs).
    pub decode_host_us: u64,
    /// Worker compute in decode steps, summed over workers (µs).
    pub decode_worker_us: u64,
    /// Wall time of decode steps (µs).
    pub decode_wall_us: u64,
    /// Verify steps of speculative decoding among `calls` (their tokens are in `tokens`).
    pub verify_calls: u64,
    /// Calls that failed because a worker was lost.
    pub failures: u64,
    /// Times the workers' state was rebuilt by re-ingesting the history.
    pub rebuilds: u64,
    /// Times the workers went back to a checkpoint they kept (the prompt cache).
    pub rewinds: u64,
    /// Requests served after a worker lost its session mid-request: every session re-established and the history
    /// re-ingested within the request.
    pub retries: u64,
}

/// The workers of a layer split, in chain order, and what their calls cost.
#[derive(Debug)]
pub struct LayerSplit {
    pub(crate) stages: Vec<Stage>,
    pub(crate) stats: ChainStats,
    /// The host runs layers `[0, host_end)` (the first worker's first layer; fixed when the chain is made).
    pub(crate) host_end: usize,
    /// Positions at which the workers keep exact checkpoints in the coming calls.
    pub(crate) keep: Vec<usize>,
}

/// A stage's failure: which worker, and why.
#[derive(Debug)]
pub(crate) struct StageError {
    pub stage: usize,
    pub error: LinkError,
    /// It failed while connecting (unreachable, or refused in the handshake): nothing ran on it.
    pub connecting: bool,
}

impl LayerSplit {
    /// A chain over `stages` (in layer order). Errors: [`crate::EngineError::InvalidSetting`] unless the ranges
    /// are non-empty, contiguous and end at the model's last layer.
    pub fn new(cfg: &ModelConfig, stages: Vec<Stage>) -> crate::Result<Self> {
        let n = cfg.num_hidden_layers;
        let bad = |m: String| Err(crate::EngineError::InvalidSetting(m));
        let Some(first) = stages.first() else {
            return bad("a layer split needs at least one worker".into());
        };
        let mut at = first.range.start;
        for s in &stages {
            if s.range.start != at || s.range.end <= s.range.start {
                return bad(format!(
                    "worker layer ranges must be non-empty and contiguous: {} holds {:?} after layer {at}",
                    s.addr(),
                    s.range
                ));
            }
            at = s.range.end;
        }
        if at != n {
            return bad(format!(
                "the last worker's layers end at {at}, not at the model's {n} layers"
            ));
        }
        Ok(LayerSplit {
            host_end: stages[0].range.start,
            stages,
            stats: ChainStats::default(),
            keep: Vec::new(),
        })
    }

    /// The first layer a worker holds: the host holds `[0, host_end)`.
    pub fn host_end(&self) -> usize {
        self.host_end
    }

    /// The workers in chain order.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Layers held by workers.
    pub fn worker_layers(&self) -> usize {
        self.stages.iter().map(|s| s.range.len()).sum()
    }

    /// Time per side so far.
    pub fn stats(&self) -> &ChainStats {
        &self.stats
    }

    /// The workers' link counters summed, with `worker_layers` set.
    pub fn link_stats(&self) -> LinkStats {
        let mut s = LinkStats::default();
        for st in &self.stages {
            s.add(&st.link.stats());
        }
        s.worker_layers = self.worker_layers() as u64;
        s.worker_tokens = self.stats.tokens;
        s
    }

    /// Closes every worker session (their state is dropped; the next call starts fresh ones from position 0).
    pub(crate) fn reset(&mut self) {
        for s in &mut self.stages {
            if let Some(c) = s.link.conn.take() {
                c.shutdown();
            }
            s.pos = Some(0);
        }
    }

    /// Whether every worker's state matches the host's `pos` positions (else a rebuild is needed).
    pub(crate) fn in_step(&self, pos: usize) -> bool {
        self.stages.iter().all(|s| s.pos == Some(pos))
    }

    /// A worker failed: its connection is dropped (with backoff) and every other worker's session is closed too,
    /// since their states went on without it.
    pub(crate) fn fail(&mut self, e: &StageError) {
        for (i, s) in self.stages.iter_mut().enumerate() {
            if i == e.stage {
                s.link.fail(&e.error);
            } else if let Some(c) = s.link.conn.take() {
                c.shutdown();
            }
            s.pos = None;
        }
        self.stats.failures += 1;
    }
}

/// The slowest dense compute a worker is assumed to run a layer at before its speed is known (flop/s): a few
/// times below one plain core's, so that only a stalled worker misses the deadlines it sets.
pub const MIN_LAYER_FLOPS: f64 = 1e10;

/// A pessimistic time per token and layer (µs) when the host has no layer of its own to time: a layer's dense
/// products (about `2 × (3·hidden·intermediate + 4·hidden²)` flop per token) at [`MIN_LAYER_FLOPS`].
pub(crate) fn fallback_us_per_token_layer(cfg: &backburner_model::ModelConfig) -> f64 {
    let (h, i) = (cfg.hidden_size as f64, cfg.intermediate_size as f64);
    2.0 * (3.0 * h * i + 4.0 * h * h) / MIN_LAYER_FLOPS * 1e6
}
