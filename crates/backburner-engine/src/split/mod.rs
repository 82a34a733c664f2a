//! Host side of split prefill: a client for one worker, and the pipelined prefill that uses it.
//!
//! For a batch of N new tokens in ubatches u₁…u_k (k ≥ 2), the host runs layers `[0, L)` of u₁…u_{k−1} and sends
//! each residual stream to the worker, which runs `[L, n)` on its mirror while the host computes the next ubatch (a
//! sender and a receiver thread keep the socket busy, so both sides compute at once). The host runs `[0, L)` of u_k
//! while the worker drains, fetches the worker's new KV rows and linear states of `[L, n)`, adopts them, and runs
//! `[L, n)` of u_k itself: logits never cross the link. The mirror then matches the host up to the watermark
//! `N − |u_k|` past the start; the next call first syncs rows past the watermark and the linear states.
//!
//! Any error undoes the call (the caller restores its snapshot and reruns locally) and the worker is retried later
//! with exponential backoff.

mod client;
mod pipeline;

pub(crate) use crate::connection::why;

use std::ops::Range;
use std::time::Duration;

use backburner_link::Shaper;
use backburner_model::ModelConfig;
use serde::Serialize;

pub use client::WorkerClient;

/// Most bytes of KV rows (plus linear states) the host puts in one `Sync` or asks for in one `Fetch`; longer ranges
/// travel in several frames. Below the worker's default frame bound (1 GiB).
pub const FRAME_BUDGET: usize = 256 << 20;

/// How to reach and use a worker.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// `host:port`.
    pub addr: String,
    /// Shared secret (empty = none).
    pub secret: Vec<u8>,
    /// First worker layer L; `None` = balance by the two sides' threads.
    pub split_layer: Option<usize>,
    /// Smallest batch (tokens) that goes through the worker (default 512).
    pub split_min_tokens: usize,
    /// The base of every deadline: connecting and the whole handshake get this; every request and reply gets this
    /// plus its transfer time at `min_rate` and the worker's expected compute (`--worker-timeout`).
    pub timeout: Duration,
    /// The host's compute threads (for the default split).
    pub host_threads: usize,
    /// Emulated link shaping (benchmarks).
    pub shaper: Option<Shaper>,
    /// Most bytes per `Sync`/`Fetch` frame (default [`FRAME_BUDGET`]; also bounded by the worker's frame limit).
    pub frame_budget: usize,
    /// Slowest transfer rate a deadline allows for (bytes per second; default 1 MiB/s): a message of `b` bytes gets
    /// `timeout + b / min_rate` plus the worker's expected compute.
    pub min_rate: u64,
}

impl WorkerSettings {
    /// Settings with the defaults: no secret, balanced split, 512-token minimum, 60 s timeout.
    pub fn new(addr: impl Into<String>, host_threads: usize) -> Self {
        WorkerSettings {
            addr: addr.into(),
            secret: Vec::new(),
            split_layer: None,
            split_min_tokens: 512,
            timeout: Duration::from_secs(60),
            host_threads,
            shaper: None,
            frame_budget: FRAME_BUDGET,
            min_rate: 1 << 20,
        }
    }
}

/// What went over the link, for the stats line and `--json`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct LinkStats {
    /// Tokens whose tail layers ran on the worker (split prefill), or through the workers' layers (layer split).
    pub worker_tokens: u64,
    /// Layer split: layers held (and run) by workers; 0 when the host holds every layer.
    pub worker_layers: u64,
    /// Bytes sent to the worker.
    pub bytes_sent: u64,
    /// Bytes received from the worker.
    pub bytes_received: u64,
    /// Split calls that failed and were rerun locally.
    pub fallbacks: u64,
    /// Split calls that succeeded.
    pub split_calls: u64,
    /// Worker compute time (µs) over all ubatches.
    pub worker_compute_us: u64,
    /// Worker idle time between ubatches (µs): the pipeline bubble.
    pub worker_idle_us: u64,
    /// KV offload: workers' compute time attending their pages (µs).
    pub offload_compute_us: u64,
    /// KV offload: pages held by workers now, over all full-attention layers.
    pub pages_on_workers: u64,
    /// KV offload: positions held by workers now (of every full-attention layer).
    pub positions_on_workers: u64,
    /// KV offload: pages that moved to workers so far (over all full-attention layers).
    pub pages_moved: u64,
    /// KV offload: decode steps that attended pages on workers.
    pub offload_decode_tokens: u64,
    /// KV offload: link bytes (both ways) of those decode steps.
    pub offload_decode_bytes: u64,
    /// KV offload: requests that failed on a worker and were recovered (re-ingested) or refused.
    pub offload_failures: u64,
    /// KV offload: prefill ubatches run as two interleaved halves.
    pub interleaved_ubatches: u64,
    /// KV offload: requests retried once on a fresh connection after a worker lost their session.
    pub offload_retries: u64,
    /// KV offload: requests that waited for a worker's backoff to end before moving pages (inside the call; the
    /// server defers such steps instead, see `Metrics::requests_delayed`).
    pub backoff_waits: u64,
}

impl LinkStats {
    /// Adds `o`'s counters to these (the gauges `pages_on_workers` and `positions_on_workers` too).
    pub fn add(&mut self, o: &LinkStats) {
        self.worker_tokens += o.worker_tokens;
        self.worker_layers += o.worker_layers;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
        self.fallbacks += o.fallbacks;
        self.split_calls += o.split_calls;
        self.worker_compute_us += o.worker_compute_us;
        self.worker_idle_us += o.worker_idle_us;
        self.offload_compute_us += o.offload_compute_us;
        self.pages_on_workers += o.pages_on_workers;
        self.positions_on_workers += o.positions_on_workers;
        self.pages_moved += o.pages_moved;
        self.offload_decode_tokens += o.offload_decode_tokens;
        self.offload_decode_bytes += o.offload_decode_bytes;
        self.offload_failures += o.offload_failures;
        self.interleaved_ubatches += o.interleaved_ubatches;
        self.offload_retries += o.offload_retries;
        self.backoff_waits += o.backoff_waits;
    }

    /// Mean link bytes per decode step with pages on workers (0 when there was none).
    pub fn bytes_per_decode_token(&self) -> u64 {
        self.offload_decode_bytes
            .checked_div(self.offload_decode_tokens)
            .unwrap_or(0)
    }
}

/// Chooses L: layer times balance when L / host_threads = (n − L) / worker_threads; rounded to the cycle and kept
/// strictly inside `(0, n)`. `None` when the model has no such split point (its layer cycle is as long as the model).
pub fn balanced_split(
    cfg: &ModelConfig,
    host_threads: usize,
    worker_threads: usize,
) -> Option<usize> {
    let cyc = cfg.full_attention_interval.max(1);
    let hi = cfg.num_hidden_layers.saturating_sub(1) / cyc * cyc;
    if hi < cyc {
        return None;
    }
    let n = cfg.num_hidden_layers as f64;
    let ideal =
        n * host_threads.max(1) as f64 / (host_threads.max(1) + worker_threads.max(1)) as f64;
    let l = ((ideal / cyc as f64).round() as usize) * cyc;
    Some(l.clamp(cyc, hi))
}

/// Computes the host's model fingerprint of a layer range (see `backburner_model::fingerprint`).
pub type FingerprintFn = Box<dyn Fn(Range<usize>) -> Result<[u8; 32], String> + Send>;

/// The fingerprint function of a checkpoint directory. It keeps the checkpoint open and each layer's digest once
/// computed (one pass over that layer's weights), so the range chosen during a handshake is answered from the cache
/// once the client has asked for the widest range it may choose before connecting.
pub fn dir_fingerprint(
    dir: std::path::PathBuf,
) -> impl Fn(Range<usize>) -> Result<[u8; 32], String> + Send + 'static {
    dir_fingerprint_with(dir, backburner_model::Precision::F32)
}

/// As [`dir_fingerprint`], for a model computing bf16 weights in `precision` ([`ModelConfig::precision`], which the
/// fingerprint covers): what a host passes when it loaded its model with that precision.
pub fn dir_fingerprint_with(
    dir: std::path::PathBuf,
    precision: backburner_model::Precision,
) -> impl Fn(Range<usize>) -> Result<[u8; 32], String> + Send + 'static {
    type Cache = (
        Option<(ModelConfig, backburner_model::Checkpoint)>,
        std::collections::HashMap<usize, [u8; 32]>,
    );
    let cache: std::sync::Mutex<Cache> = Default::default();
    move |r| {
        let mut g = cache.lock().unwrap_or_else(|p| p.into_inner());
        let (opened, digests) = &mut *g;
        if opened.is_none() {
            let cfg = ModelConfig {
                precision,
                ..ModelConfig::from_dir(&dir).map_err(|e| e.to_string())?
            };
            let ck = backburner_model::Checkpoint::open(&dir).map_err(|e| e.to_string())?;
            *opened = Some((cfg, ck));
        }
        let (cfg, ck) = opened.as_ref().expect("opened above");
        if r.end > cfg.num_hidden_layers {
            return Err(format!(
                "layers {r:?} outside the {}-layer model",
                cfg.num_hidden_layers
            ));
        }
        let mut part = Vec::with_capacity(r.len());
        for i in r.clone() {
            let d = match digests.get(&i) {
                Some(d) => *d,
                None => {
                    let d = backburner_model::fingerprint::layer_digest(ck, cfg, i)
                        .map_err(|e| e.to_string())?;
                    digests.insert(i, d);
                    d
                }
            };
            part.push(d);
        }
        Ok(backburner_model::fingerprint::combine(cfg, r, &part))
    }
}
