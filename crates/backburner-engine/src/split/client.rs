//! The host's split-prefill client of one worker: its connection and what it knows of the worker's mirror.

use std::ops::Range;
use std::time::{Duration, Instant};

use backburner_kernels::kv::KvDtype;
use backburner_link::frame::Kind;
use backburner_link::message::{Challenge, Empty};
use backburner_link::LinkError;
use backburner_model::ModelConfig;

use super::{balanced_split, LinkStats, WorkerSettings};
use crate::connection::{why, Connection, SessionShape};

/// A split-prefill client of one worker: its [`Connection`] plus what the host knows about the worker's mirror
/// of the tail layers `[L, n)`. KV offload uses the same connection.
pub struct WorkerClient {
    pub(crate) link: Connection,
    pub(super) split: usize,
    /// KV rows the mirror holds that match the host (positions `[0, mirror_kv)`).
    pub(super) mirror_kv: usize,
    /// Position the mirror's linear states correspond to (None = unknown).
    pub(super) mirror_linear_at: Option<usize>,
    /// The worker's observed compute time per token and layer (µs), for deadlines.
    pub(super) us_per_token_layer: Option<f64>,
    /// The model has a split point (false: the worker only holds KV pages, split prefill never runs).
    splittable: bool,
}

impl std::fmt::Debug for WorkerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerClient")
            .field("link", &self.link)
            .field("split", &self.split)
            .field("mirror_kv", &self.mirror_kv)
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
            link: Connection::new(settings, fingerprint),
            split: 0,
            mirror_kv: 0,
            mirror_linear_at: None,
            us_per_token_layer: None,
            splittable: true,
        }
    }

    /// Tells the client the host's model ([`crate::Session::attach_worker`] does): a model without a split point
    /// (its layer cycle is as long as the model, as in a 4-layer one) never runs split prefill, and its worker
    /// sessions hold KV pages only.
    pub fn set_model(&mut self, cfg: &ModelConfig) {
        self.splittable = balanced_split(cfg, 1, 1).is_some();
    }

    /// Settings.
    pub fn settings(&self) -> &WorkerSettings {
        self.link.settings()
    }

    /// Link statistics so far.
    pub fn stats(&self) -> LinkStats {
        self.link.stats()
    }

    /// The split layer L of the current connection (0 before the first connection; the model's layer count for a
    /// session that holds KV pages only).
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
        self.link.available()
    }

    /// Whether the last exchange with the worker failed ([`crate::connection::Connection::failing`]).
    pub fn failing(&self) -> bool {
        self.link.failing()
    }

    /// Why the last exchange failed, while [`WorkerClient::failing`].
    pub fn last_error(&self) -> Option<&str> {
        self.link.last_error()
    }

    /// How long the backoff after the last failure still runs ([`crate::connection::Connection::retry_in`]).
    pub fn retry_in(&self) -> Option<Duration> {
        self.link.retry_in()
    }

    /// Sessions lost on an open connection so far ([`crate::connection::Connection::sessions_lost`]).
    pub fn sessions_lost(&self) -> u64 {
        self.link.sessions_lost()
    }

    /// Whether a batch of `n_tokens` should try the worker now (never for a model without a split point).
    pub fn wants(&self, n_tokens: usize, ubatch: usize) -> bool {
        self.splittable
            && n_tokens >= self.link.settings.split_min_tokens.max(1)
            && n_tokens > ubatch
            && self.link.available()
    }

    /// The deadline budget of a message of `bytes` bytes whose reply also waits for `compute` on the worker.
    pub(crate) fn allowance(&self, bytes: usize, compute: Duration) -> Duration {
        self.link.allowance(bytes, compute)
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
        let c = self.link.conn.as_mut().expect("connected");
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

    /// Connects and runs the handshake if there is no connection: a mirror of the tail layers `[L, n)`, or, for a
    /// model without a split point, a session of no layers (`[n, n)`) that holds KV pages only.
    ///
    /// Errors: [`LinkError::Refused`] when this host cannot use the worker (a split layer given for a model without
    /// a split point, a ubatch above the worker's limit, no fingerprint), the worker's typed errors, and transport
    /// errors and deadlines.
    pub(crate) fn ensure_connected(
        &mut self,
        cfg: &ModelConfig,
        kv: KvDtype,
        page: usize,
        ubatch: usize,
    ) -> Result<(), LinkError> {
        if self.link.is_connected() {
            return Ok(());
        }
        let n = cfg.num_hidden_layers;
        let cyc = cfg.full_attention_interval.max(1);
        let Some(first) = balanced_split(cfg, 1, 1) else {
            return self.connect_pages_only(cfg, SessionShape { kv, page, ubatch });
        };
        // Warm the fingerprint cache before connecting, for every range the handshake may choose (from the given
        // split layer, or from the first split point): the worker bounds the whole handshake.
        let (fixed, host_threads) = (
            self.link.settings.split_layer,
            self.link.settings.host_threads,
        );
        let widest = fixed.unwrap_or(cyc).clamp(1, n - 1);
        self.link.fingerprint(widest..n)?;
        let shape = SessionShape { kv, page, ubatch };
        let mut chosen = 0;
        let link = &mut self.link;
        let params = |ch: &Challenge| {
            let l = match (fixed, ch.layers) {
                (Some(l), _) => l,
                (None, Some((a, _))) => a as usize,
                (None, None) => {
                    balanced_split(cfg, host_threads, ch.threads as usize).unwrap_or(first)
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
            Ok(l..n)
        };
        link.connect_with(cfg, shape, false, params)?;
        self.split = chosen;
        self.mirror_kv = 0;
        self.mirror_linear_at = Some(0);
        Ok(())
    }

    /// The session of a model without a split point: no layers, KV pages only (docs/PROTOCOL.md §5.1).
    fn connect_pages_only(
        &mut self,
        cfg: &ModelConfig,
        shape: SessionShape,
    ) -> Result<(), LinkError> {
        let n = cfg.num_hidden_layers;
        let cyc = cfg.full_attention_interval.max(1);
        if let Some(l) = self.link.settings.split_layer {
            return Err(LinkError::Refused(format!(
                "split layer {l} was given, but this {n}-layer model has no split point on its {cyc}-layer cycle"
            )));
        }
        self.link.fingerprint(n..n)?;
        let ubatch = shape.ubatch;
        self.link.connect_with(cfg, shape, false, |ch| {
            if ubatch as u64 > u64::from(ch.limits.max_ubatch) {
                return Err(LinkError::Refused(format!(
                    "the host's ubatch {ubatch} is above the worker's limit of {} tokens",
                    ch.limits.max_ubatch
                )));
            }
            Ok(n..n)
        })?;
        self.split = n;
        self.mirror_kv = 0;
        self.mirror_linear_at = Some(0);
        Ok(())
    }

    /// The connection failed while the worker held or took KV pages (not in a split prefill): backoff, and no
    /// split-prefill fallback is counted or reported.
    pub(crate) fn fail_offload(&mut self, err: &LinkError) {
        self.lost(err);
    }

    /// Drops the connection after a failure and schedules a retry (backoff doubles up to 60 s); the mirror is
    /// unknown from then on.
    pub fn fail(&mut self, err: &LinkError) {
        self.lost(err);
        self.link.stats.fallbacks += 1;
        tracing::warn!(
            "split prefill: the host computes this prompt's remaining layers itself (same output)"
        );
    }

    /// The connection failed outside a call (nothing to fall back from): backoff, and the mirror starts over.
    fn lost(&mut self, err: &LinkError) {
        self.link.fail(err);
        self.mirror_kv = 0;
        self.mirror_linear_at = None;
    }

    /// A health check while idle: the round trip of an empty `Ping` (connecting first if needed; each step waits at
    /// most [`crate::connection::HEALTH_PING_TIMEOUT`]), or the error,
    /// after which the worker counts as unavailable until its backoff ends (no fallback is counted: nothing ran).
    /// Skipped (`None`) while the backoff after an earlier failure runs.
    pub fn probe(
        &mut self,
        cfg: &ModelConfig,
        kv: KvDtype,
        page: usize,
        ubatch: usize,
    ) -> Option<Result<Duration, LinkError>> {
        if !self.available() {
            return None;
        }
        let cap = crate::connection::HEALTH_PING_TIMEOUT;
        let saved = self.link.swap_timeout(self.link.settings.timeout.min(cap));
        let r = self.ping(cfg, kv, page, ubatch, &[]);
        self.link.swap_timeout(saved);
        if let Err(e) = &r {
            self.lost(e);
        }
        Some(r)
    }

    pub(crate) fn succeeded(&mut self) {
        self.link.succeeded();
    }
}
