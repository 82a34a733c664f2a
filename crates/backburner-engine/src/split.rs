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

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backburner_kernels::kv::KvDtype;
use backburner_link::frame::{f32_bytes, Kind};
use backburner_link::handshake::host_handshake;
use backburner_link::message::{
    Empty, Fetch, FetchDone, LayersDone, RunLayers, SessionParams, Sync,
};
use backburner_link::{Conn, LinkError, Shaper};
use backburner_model::{Model, ModelConfig, ModelState};
use serde::Serialize;
use tracing::{info, warn};

use crate::compute::ComputePool;
use crate::wire;

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
    /// Per-request timeout (connect, and each reply).
    pub timeout: Duration,
    /// The host's compute threads (for the default split).
    pub host_threads: usize,
    /// Emulated link shaping (benchmarks).
    pub shaper: Option<Shaper>,
    /// Most bytes per `Sync`/`Fetch` frame (default [`FRAME_BUDGET`]).
    pub frame_budget: usize,
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
        }
    }
}

/// What went over the link, for the stats line and `--json`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, Eq)]
pub struct LinkStats {
    /// Tokens whose tail layers ran on the worker.
    pub worker_tokens: u64,
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
}

/// Chooses L: layer times balance when L / host_threads = (n − L) / worker_threads; rounded to the cycle and kept
/// strictly inside `(0, n)`.
pub fn balanced_split(cfg: &ModelConfig, host_threads: usize, worker_threads: usize) -> usize {
    let n = cfg.num_hidden_layers as f64;
    let cyc = cfg.full_attention_interval;
    let ideal =
        n * host_threads.max(1) as f64 / (host_threads.max(1) + worker_threads.max(1)) as f64;
    let mut l = ((ideal / cyc as f64).round() as usize) * cyc;
    l = l.clamp(cyc, cfg.num_hidden_layers.saturating_sub(1) / cyc * cyc);
    l
}

/// Computes the host's model fingerprint of a layer range (see `backburner_model::fingerprint`).
pub type FingerprintFn = Box<dyn Fn(Range<usize>) -> Result<[u8; 32], String> + Send>;

/// The fingerprint function of a checkpoint directory: opens it on each call (the client caches results per split
/// layer, so that is once per layer range).
pub fn dir_fingerprint(
    dir: std::path::PathBuf,
) -> impl Fn(Range<usize>) -> Result<[u8; 32], String> + Send + 'static {
    move |r| {
        let cfg = backburner_model::ModelConfig::from_dir(&dir).map_err(|e| e.to_string())?;
        let ck = backburner_model::Checkpoint::open(&dir).map_err(|e| e.to_string())?;
        backburner_model::fingerprint(&ck, &cfg, r).map_err(|e| e.to_string())
    }
}

/// A connection to one worker plus what the host knows about its mirror.
pub struct WorkerClient {
    settings: WorkerSettings,
    fingerprint: FingerprintFn,
    fingerprints: std::collections::HashMap<usize, [u8; 32]>,
    conn: Option<Conn>,
    split: usize,
    /// KV rows the mirror holds that match the host (positions `[0, mirror_kv)`).
    mirror_kv: usize,
    /// Position the mirror's linear states correspond to (None = unknown).
    mirror_linear_at: Option<usize>,
    stats: LinkStats,
    retry_at: Option<Instant>,
    backoff: Duration,
    counted: (u64, u64),
}

impl std::fmt::Debug for WorkerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerClient")
            .field("addr", &self.settings.addr)
            .field("connected", &self.conn.is_some())
            .field("split", &self.split)
            .field("mirror_kv", &self.mirror_kv)
            .field("stats", &self.stats)
            .finish()
    }
}

impl WorkerClient {
    /// A client that connects lazily on first use. `fingerprint(range)` computes the host's model fingerprint of a
    /// layer range (see `backburner_model::fingerprint`).
    pub fn new(
        settings: WorkerSettings,
        fingerprint: impl Fn(Range<usize>) -> Result<[u8; 32], String> + Send + 'static,
    ) -> Self {
        WorkerClient {
            settings,
            fingerprint: Box::new(fingerprint),
            fingerprints: Default::default(),
            conn: None,
            split: 0,
            mirror_kv: 0,
            mirror_linear_at: None,
            stats: LinkStats::default(),
            retry_at: None,
            backoff: Duration::from_millis(500),
            counted: (0, 0),
        }
    }

    /// Settings.
    pub fn settings(&self) -> &WorkerSettings {
        &self.settings
    }

    /// Link statistics so far.
    pub fn stats(&self) -> LinkStats {
        let mut s = self.stats.clone();
        if let Some(c) = &self.conn {
            s.bytes_sent += c.bytes_sent() - self.counted.0;
            s.bytes_received += c.bytes_received() - self.counted.1;
        }
        s
    }

    /// The split layer L of the current connection (0 before the first connection).
    pub fn split_layer(&self) -> usize {
        self.split
    }

    /// The watermark: positions of the mirror that match the host.
    pub fn watermark(&self) -> usize {
        self.mirror_kv
    }

    /// The host's history was cut to `len` positions: the mirror matches at most that far.
    pub fn on_truncate(&mut self, len: usize) {
        self.mirror_kv = self.mirror_kv.min(len);
    }

    /// Whether a batch of `n_tokens` should try the worker now.
    pub fn wants(&self, n_tokens: usize, ubatch: usize) -> bool {
        n_tokens >= self.settings.split_min_tokens.max(1)
            && n_tokens > ubatch
            && self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// Round trip of a `Ping` with `payload` bytes; connects first if needed.
    pub fn ping(
        &mut self,
        cfg: &ModelConfig,
        kv: KvDtype,
        page: usize,
        ubatch: usize,
        payload: &[u8],
    ) -> Result<Duration, LinkError> {
        self.ensure_connected(cfg, kv, page, ubatch)?;
        let c = self.conn.as_mut().expect("connected");
        let t = Instant::now();
        c.writer.send(Kind::Ping, &Empty {}, payload)?;
        let (_e, back): (Empty, _) = c.reader.expect(Kind::Pong, "Pong")?;
        let dt = t.elapsed();
        if back != payload {
            return Err(LinkError::Malformed(
                "pong payload differs from ping".into(),
            ));
        }
        Ok(dt)
    }

    fn ensure_connected(
        &mut self,
        cfg: &ModelConfig,
        kv: KvDtype,
        page: usize,
        ubatch: usize,
    ) -> Result<(), LinkError> {
        if self.conn.is_some() {
            return Ok(());
        }
        let mut conn = Conn::connect(
            &self.settings.addr,
            self.settings.timeout,
            self.settings.shaper,
        )?;
        let st = &self.settings;
        let fp = &self.fingerprint;
        let cache = &mut self.fingerprints;
        let mut chosen = 0;
        let (params, welcome) = host_handshake(&mut conn, &st.secret, |ch| {
            let cyc = cfg.full_attention_interval;
            let l = match (st.split_layer, ch.layers) {
                (Some(l), _) => l,
                (None, Some((a, _))) => a as usize,
                (None, None) => balanced_split(cfg, st.host_threads, ch.threads as usize),
            };
            if l == 0 || l >= cfg.num_hidden_layers || l % cyc != 0 {
                return Err(LinkError::Malformed(format!(
                    "split layer {l} is not on a {cyc}-layer cycle boundary strictly inside 0..{}",
                    cfg.num_hidden_layers
                )));
            }
            chosen = l;
            Ok(SessionParams {
                fingerprint: match cache.get(&l) {
                    Some(f) => *f,
                    None => {
                        let f = fp(l..cfg.num_hidden_layers).map_err(LinkError::Malformed)?;
                        cache.insert(l, f);
                        f
                    }
                },
                n_layers: cfg.num_hidden_layers as u32,
                layer_start: l as u32,
                layer_end: cfg.num_hidden_layers as u32,
                hidden: cfg.hidden_size as u32,
                kv_dtype: match kv {
                    KvDtype::F16 => 0,
                    KvDtype::F32 => 1,
                },
                kv_page_size: page as u32,
                ubatch: ubatch as u32,
            })
        })?;
        info!(addr = %st.addr, split = chosen, worker_threads = welcome.threads, "worker attached");
        let _ = params;
        self.split = chosen;
        self.counted = (conn.bytes_sent(), conn.bytes_received());
        self.stats.bytes_sent += conn.bytes_sent();
        self.stats.bytes_received += conn.bytes_received();
        self.conn = Some(conn);
        self.mirror_kv = 0;
        self.mirror_linear_at = Some(0);
        Ok(())
    }

    fn account(&mut self) {
        if let Some(c) = &self.conn {
            let (s, r) = (c.bytes_sent(), c.bytes_received());
            self.stats.bytes_sent += s - self.counted.0;
            self.stats.bytes_received += r - self.counted.1;
            self.counted = (s, r);
        }
    }

    /// Drops the connection after a failure and schedules a retry (backoff doubles up to 60 s).
    pub fn fail(&mut self, err: &LinkError) {
        self.account();
        if let Some(c) = self.conn.take() {
            c.shutdown();
        }
        self.stats.fallbacks += 1;
        self.mirror_kv = 0;
        self.mirror_linear_at = None;
        warn!(addr = %self.settings.addr, "worker failed ({err}); running locally, retry in {:?}", self.backoff);
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(Duration::from_secs(60));
    }

    fn succeeded(&mut self) {
        self.backoff = Duration::from_millis(500);
        self.retry_at = None;
        self.account();
    }

    /// Runs a split prefill of `ids` (≥ 2 ubatches) on `state`, returning the last token's logits `[vocab]`.
    /// On error the caller must restore `state` and rerun locally, then call [`WorkerClient::fail`].
    pub fn prefill(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        ids: &[u32],
        ubatch: usize,
        pool: &ComputePool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>, LinkError> {
        backburner_kernels::profile::set_phase(backburner_kernels::profile::Phase::Prefill);
        let cfg = model.config();
        let kv = state.kv_options();
        self.ensure_connected(cfg, kv.dtype, kv.page_size, ubatch)?;
        let (l, n) = (self.split, cfg.num_hidden_layers);
        let hidden = cfg.hidden_size;
        let p = state.n_tokens();
        let conn = self.conn.as_mut().expect("connected");

        // Long ranges of rows travel in several frames of at most `frame_budget` bytes each.
        let row_bytes = wire::payload_len(cfg, l..n, 1, kv.dtype, false).max(1);
        let lin_bytes = wire::payload_len(cfg, l..n, 0, kv.dtype, true);
        let max_rows = (self.settings.frame_budget.saturating_sub(lin_bytes) / row_bytes).max(1);

        // 1. Bring the mirror to the host's position: rows past the watermark, then the linear states.
        if self.mirror_kv != p || self.mirror_linear_at != Some(p) {
            let from = self.mirror_kv.min(p);
            let mut at = from;
            let mut first = true;
            loop {
                let to = (at + max_rows).min(p);
                let last = to == p;
                let payload = wire::encode(state, cfg, l..n, at, to, last);
                let msg = Sync {
                    truncate_to: at as u64,
                    pos_after: to as u64,
                    linear: last,
                };
                conn.writer.send(Kind::Sync, &msg, &payload)?;
                let _: (Empty, _) = conn.reader.expect(Kind::SyncDone, "SyncDone")?;
                debug_assert!(first || at > from);
                first = false;
                at = to;
                if last {
                    break;
                }
            }
            self.mirror_kv = p;
            self.mirror_linear_at = Some(p);
        }

        // 2. Pipeline: the host runs [0, L) of each ubatch but the last; a sender thread ships the residuals while
        //    a receiver thread collects the worker's acknowledgements, so the host never waits on the socket.
        let chunks: Vec<&[u32]> = ids.chunks(ubatch).collect();
        let k = chunks.len();
        debug_assert!(k >= 2);
        let pos_last = p + ids.len() - chunks[k - 1].len();
        let fetches: Vec<Fetch> = (p..pos_last)
            .step_by(max_rows)
            .map(|a| {
                let b = (a + max_rows).min(pos_last);
                Fetch {
                    from_pos: a as u64,
                    to_pos: b as u64,
                    linear: b == pos_last,
                }
            })
            .collect();
        let failed = AtomicBool::new(false);
        let (tx, rx) = mpsc::channel::<(RunLayers, Vec<u8>)>();
        let conn_w = &mut conn.writer;
        let conn_r = &mut conn.reader;
        type Fetched = (Vec<LayersDone>, Vec<(FetchDone, Vec<u8>)>);
        let last: Result<(Vec<f32>, usize), LinkError> = std::thread::scope(|s| {
            let failed_ref = &failed;
            let fetches_ref = &fetches;
            let sender = s.spawn(move || -> Result<(), LinkError> {
                let r = (|| {
                    for (msg, bytes) in rx {
                        conn_w.send(Kind::RunLayers, &msg, &bytes)?;
                    }
                    for f in fetches_ref {
                        conn_w.send(Kind::Fetch, f, &[])?;
                    }
                    Ok(())
                })();
                if r.is_err() {
                    failed_ref.store(true, Ordering::Relaxed);
                }
                r
            });
            let expected = k - 1;
            let receiver = s.spawn(move || -> Result<Fetched, LinkError> {
                let r = (|| {
                    let mut acks = Vec::with_capacity(expected);
                    for _ in 0..expected {
                        let (a, _): (LayersDone, _) =
                            conn_r.expect(Kind::LayersDone, "LayersDone")?;
                        acks.push(a);
                    }
                    let mut got = Vec::with_capacity(fetches_ref.len());
                    for _ in fetches_ref {
                        got.push(conn_r.expect::<FetchDone>(Kind::FetchDone, "FetchDone")?);
                    }
                    Ok((acks, got))
                })();
                if r.is_err() {
                    failed_ref.store(true, Ordering::Relaxed);
                }
                r
            });
            let mut pos = p;
            let mut out = None;
            for (ci, chunk) in chunks.iter().enumerate() {
                if failed.load(Ordering::Relaxed) {
                    break;
                }
                let t = chunk.len();
                let mut x = model
                    .embed(chunk)
                    .map_err(|e| LinkError::Malformed(e.to_string()))?;
                let st = &mut *state;
                pool.install(|| model.forward_layers_at(0..l, &mut x, t, pos, st));
                pos += t;
                if ci + 1 < k {
                    let _ = tx.send((
                        RunLayers {
                            pos: (pos - t) as u64,
                            n_tokens: t as u32,
                        },
                        f32_bytes(&x),
                    ));
                    progress(pos - p, ids.len());
                } else {
                    out = Some((x, t));
                }
            }
            drop(tx);
            let sent = sender.join().expect("sender thread");
            let got = receiver.join().expect("receiver thread");
            // The receiver's error first: it carries the worker's typed Error frame when there is one.
            let (acks, fetched) = got?;
            sent?;
            let (x, t) = out.ok_or_else(|| LinkError::Malformed("pipeline aborted".into()))?;
            for (i, a) in acks.iter().enumerate() {
                let want: usize = p + chunks[..=i].iter().map(|c| c.len()).sum::<usize>();
                if a.pos_after as usize != want {
                    return Err(LinkError::Malformed(format!(
                        "worker acknowledged position {}, expected {want}",
                        a.pos_after
                    )));
                }
            }
            for ((fd, _), want) in fetched.iter().zip(fetches.iter()) {
                if fd.from_pos != want.from_pos || fd.to_pos != want.to_pos {
                    return Err(LinkError::Malformed(format!(
                        "worker returned rows {}..{}, expected {}..{}",
                        fd.from_pos, fd.to_pos, want.from_pos, want.to_pos
                    )));
                }
            }
            // 3. Adopt the worker's rows and states, then run the tail of the last ubatch here.
            for ((fd, payload), f) in fetched.iter().zip(fetches.iter()) {
                let rows = (fd.to_pos - fd.from_pos) as usize;
                wire::apply(state, cfg, l..n, rows, f.linear, payload)?;
            }
            self.stats.worker_compute_us += acks.iter().map(|a| a.compute_us).sum::<u64>();
            self.stats.worker_idle_us += acks.iter().skip(1).map(|a| a.idle_us).sum::<u64>();
            Ok((x, t))
        });
        let (mut x, t) = last?;
        pool.install(|| model.forward_layers_at(l..n, &mut x, t, pos_last, state));
        state.set_position(pos_last + t);
        progress(ids.len(), ids.len());
        self.mirror_kv = pos_last;
        self.mirror_linear_at = Some(pos_last);
        self.stats.worker_tokens += (pos_last - p) as u64;
        self.stats.split_calls += 1;
        self.succeeded();
        let logits = pool
            .install(|| model.logits(&x[(t - 1) * hidden..], 1))
            .map_err(|e| LinkError::Malformed(e.to_string()))?;
        Ok(logits)
    }
}
