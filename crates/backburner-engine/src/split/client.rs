//! The host's client for one worker: connection, handshake, deadlines, backoff, and what it knows of the mirror.

use std::ops::Range;
use std::time::{Duration, Instant};

use backburner_kernels::kv::KvDtype;
use backburner_link::frame::Kind;
use backburner_link::handshake::host_handshake;
use backburner_link::message::{Empty, SessionParams, WorkerLimits};
use backburner_link::{Conn, LinkError, WireKvDtype};
use backburner_model::ModelConfig;
use tracing::{info, warn};

use super::{balanced_split, FingerprintFn, LinkStats, WorkerSettings};

/// The reason a send failed: the worker's `Error` frame if it sent one before closing (a refused request), else the
/// send's own error.
pub(crate) fn why(c: &mut Conn, e: LinkError) -> LinkError {
    c.reader.set_deadline(Some(Duration::from_millis(500)));
    match c.reader.recv() {
        Err(remote @ LinkError::Remote { .. }) => remote,
        _ => e,
    }
}

/// A connection to one worker plus what the host knows about its mirror.
pub struct WorkerClient {
    pub(crate) settings: WorkerSettings,
    fingerprint: FingerprintFn,
    pub(crate) conn: Option<Conn>,
    pub(super) split: usize,
    /// What the worker accepts (from its `Welcome`).
    pub(crate) limits: Option<WorkerLimits>,
    /// KV rows the mirror holds that match the host (positions `[0, mirror_kv)`).
    pub(super) mirror_kv: usize,
    /// Position the mirror's linear states correspond to (None = unknown).
    pub(super) mirror_linear_at: Option<usize>,
    /// The worker's observed compute time per token and layer (µs), for deadlines.
    pub(super) us_per_token_layer: Option<f64>,
    /// The worker's compute threads (from its `Welcome`).
    pub(super) worker_threads: usize,
    pub(crate) stats: LinkStats,
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
    /// layer range (see `backburner_model::fingerprint`); it is called once before connecting (so a slow first
    /// computation never runs inside the worker's handshake deadline) and again during the handshake, where it
    /// should answer from a cache (as [`super::dir_fingerprint`] does).
    pub fn new(
        settings: WorkerSettings,
        fingerprint: impl Fn(Range<usize>) -> Result<[u8; 32], String> + Send + 'static,
    ) -> Self {
        WorkerClient {
            settings,
            fingerprint: Box::new(fingerprint),
            conn: None,
            split: 0,
            limits: None,
            mirror_kv: 0,
            mirror_linear_at: None,
            us_per_token_layer: None,
            worker_threads: 1,
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

    /// Whether the worker may be tried now (not waiting out a backoff after a failure).
    pub fn available(&self) -> bool {
        self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// Whether a batch of `n_tokens` should try the worker now.
    pub fn wants(&self, n_tokens: usize, ubatch: usize) -> bool {
        n_tokens >= self.settings.split_min_tokens.max(1)
            && n_tokens > ubatch
            && self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// The deadline budget of a message of `bytes` bytes whose reply also waits for `compute` on the worker.
    pub(crate) fn allowance(&self, bytes: usize, compute: Duration) -> Duration {
        let transfer = (bytes as f64 / self.settings.min_rate.max(1) as f64).min(1e9);
        self.settings
            .timeout
            .saturating_add(compute)
            .saturating_add(Duration::from_secs_f64(transfer))
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
        let d = self.allowance(2 * payload.len(), Duration::ZERO);
        let c = self.conn.as_mut().expect("connected");
        c.set_deadline(Some(d));
        let t = Instant::now();
        if let Err(e) = c.writer.send(Kind::Ping, &Empty {}, payload) {
            return Err(why(c, e));
        }
        let (_e, back): (Empty, _) = c.reader.expect(Kind::Pong, "Pong")?;
        let dt = t.elapsed();
        if back != payload {
            return Err(LinkError::Malformed(
                "pong payload differs from ping".into(),
            ));
        }
        Ok(dt)
    }

    fn params(
        &self,
        cfg: &ModelConfig,
        l: usize,
        kv: KvDtype,
        page: usize,
        ubatch: usize,
    ) -> Result<SessionParams, LinkError> {
        let too_big = |what: &str, v: usize| {
            LinkError::Refused(format!("{what} {v} does not fit the protocol's field"))
        };
        let n = cfg.num_hidden_layers;
        Ok(SessionParams {
            fingerprint: (self.fingerprint)(l..n).map_err(LinkError::Refused)?,
            n_layers: u32::try_from(n).map_err(|_| too_big("layers", n))?,
            layer_start: u32::try_from(l).map_err(|_| too_big("split layer", l))?,
            layer_end: u32::try_from(n).map_err(|_| too_big("layers", n))?,
            hidden: u32::try_from(cfg.hidden_size)
                .map_err(|_| too_big("hidden", cfg.hidden_size))?,
            kv_dtype: match kv {
                KvDtype::F16 => WireKvDtype::F16,
                KvDtype::F32 => WireKvDtype::F32,
            },
            kv_page_size: u64::try_from(page).map_err(|_| too_big("page size", page))?,
            ubatch: u32::try_from(ubatch).map_err(|_| too_big("ubatch", ubatch))?,
        })
    }

    /// Connects and runs the handshake if there is no connection.
    ///
    /// Errors: [`LinkError::Refused`] when this host cannot use the worker (no split point, a ubatch above the
    /// worker's limit, no fingerprint), the worker's typed errors, and transport errors and deadlines.
    pub(crate) fn ensure_connected(
        &mut self,
        cfg: &ModelConfig,
        kv: KvDtype,
        page: usize,
        ubatch: usize,
    ) -> Result<(), LinkError> {
        if self.conn.is_some() {
            return Ok(());
        }
        let n = cfg.num_hidden_layers;
        let cyc = cfg.full_attention_interval.max(1);
        let Some(first) = balanced_split(cfg, 1, 1) else {
            return Err(LinkError::Refused(format!(
                "this {n}-layer model has no split point on its {cyc}-layer cycle"
            )));
        };
        // Warm the fingerprint cache before connecting, for every range the handshake may choose (from the given
        // split layer, or from the first split point): the worker bounds the whole handshake.
        let widest = self.settings.split_layer.unwrap_or(cyc).clamp(1, n - 1);
        (self.fingerprint)(widest..n).map_err(LinkError::Refused)?;
        let st = &self.settings;
        let mut conn = Conn::connect(&st.addr, st.timeout, st.shaper)?;
        let mut chosen = 0;
        let shaken = host_handshake(&mut conn, &st.secret, |ch| {
            let l = match (st.split_layer, ch.layers) {
                (Some(l), _) => l,
                (None, Some((a, _))) => a as usize,
                (None, None) => {
                    balanced_split(cfg, st.host_threads, ch.threads as usize).unwrap_or(first)
                }
            };
            if l == 0 || l >= n || l % cyc != 0 {
                return Err(LinkError::Refused(format!(
                    "split layer {l} is not on a {cyc}-layer cycle boundary strictly inside 0..{n}"
                )));
            }
            if ubatch as u64 > u64::from(ch.limits.max_ubatch) {
                return Err(LinkError::Refused(format!(
                    "the host's ubatch {ubatch} is above the worker's limit of {} tokens",
                    ch.limits.max_ubatch
                )));
            }
            chosen = l;
            self.params(cfg, l, kv, page, ubatch)
        });
        let welcome = match shaken {
            Ok((_, w)) => w,
            Err(e) => {
                // what a failed handshake sent and received still went over the link
                self.stats.bytes_sent += conn.bytes_sent();
                self.stats.bytes_received += conn.bytes_received();
                return Err(e);
            }
        };
        info!(addr = %st.addr, split = chosen, worker_threads = welcome.threads, session = welcome.session, "worker attached");
        self.split = chosen;
        self.limits = Some(welcome.limits);
        self.worker_threads = welcome.threads.max(1) as usize;
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

    pub(crate) fn succeeded(&mut self) {
        self.backoff = Duration::from_millis(500);
        self.retry_at = None;
        self.account();
    }
}
