//! A connection to one worker, apart from what any executor does with it: connecting, the handshake (whose
//! session parameters the executor chooses), deadlines, failure and backoff, and byte counters.
//!
//! Executors own one [`Connection`] per worker they use: split prefill and KV offload through
//! [`crate::WorkerClient`] (a mirror of a tail range), layer split through [`crate::chain`] (a range the worker holds
//! the only copy of).

use std::ops::Range;
use std::time::{Duration, Instant};

use backburner_kernels::kv::KvDtype;
use backburner_link::handshake::host_handshake;
use backburner_link::message::{Challenge, SessionParams, Welcome, WorkerLimits};
use backburner_link::{Conn, LinkError, WireKvDtype};
use backburner_model::ModelConfig;
use tracing::{info, warn};

use crate::split::{FingerprintFn, LinkStats, WorkerSettings};

/// The longest a request waits for a worker's backoff to end (KV offload, when the pages must move and every worker
/// that could take them is backing off after a failure) before it is tried again. It holds the first three backoffs
/// (0.5, 1 and 2 s): a worker that is back within about 3.5 s of a fault serves the requests that arrive meanwhile,
/// and no request is held longer than this; past it the worker counts as gone and requests fail at once with the
/// typed error until its backoff ends.
pub const MAX_BACKOFF_WAIT: Duration = Duration::from_secs(2);

/// How long a reconnect right after a lost session waits for a worker that refuses connections to listen again (a
/// worker restarting: one started without `--layers` maps its file and listens within about 0.1–0.3 s), polling
/// every [`RECONNECT_POLL`].
pub const RECONNECT_PATIENCE: Duration = Duration::from_secs(1);
/// The longest an idle health check (connect, handshake and `Ping`) waits for a worker: a hung worker (stopped,
/// swapped out) is found within this, not within a request's `--worker-timeout`, and the scheduler, which pings
/// between requests, is not held longer by it.
pub const HEALTH_PING_TIMEOUT: Duration = Duration::from_secs(3);

/// The poll interval of [`RECONNECT_PATIENCE`].
const RECONNECT_POLL: Duration = Duration::from_millis(50);
/// How long after a lost session a refused reconnect is taken for a restart (and waited for) rather than a worker
/// that is gone.
const RESTART_WINDOW: Duration = Duration::from_secs(3);

/// The reason a send failed: the worker's `Error` frame if it sent one before closing (a refused request), else the
/// send's own error.
pub(crate) fn why(c: &mut Conn, e: LinkError) -> LinkError {
    c.reader.set_deadline(Some(Duration::from_millis(500)));
    match c.reader.recv() {
        Err(remote @ LinkError::Remote { .. }) => remote,
        _ => e,
    }
}

/// What a session on a worker is asked to be, besides its layer range: the KV layout and the largest ubatch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionShape {
    /// KV cache dtype.
    pub kv: KvDtype,
    /// KV page size (positions).
    pub page: usize,
    /// Largest ubatch the host sends (tokens).
    pub ubatch: usize,
}

/// One worker's connection (made lazily), its deadlines, backoff and byte counters.
pub struct Connection {
    pub(crate) settings: WorkerSettings,
    fingerprint: FingerprintFn,
    pub(crate) conn: Option<Conn>,
    /// What the worker accepts (from its `Welcome`).
    pub(crate) limits: Option<WorkerLimits>,
    /// The worker's compute threads (from its `Welcome`).
    pub(crate) worker_threads: usize,
    pub(crate) stats: LinkStats,
    retry_at: Option<Instant>,
    backoff: Duration,
    counted: (u64, u64),
    /// Sessions lost on an open connection (a failure after the handshake: evicted, dropped, a deadline, ...).
    sessions_lost: u64,
    /// When the last session was lost on an open connection (cleared by a success).
    lost_at: Option<Instant>,
    /// Experts on the worker: the expert ids its sessions hold (`SessionParams.experts`; empty otherwise).
    experts: Vec<u32>,
    /// Why the last exchange failed (cleared by a success), for `/health`.
    last_error: Option<String>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("addr", &self.settings.addr)
            .field("connected", &self.conn.is_some())
            .field("stats", &self.stats)
            .finish()
    }
}

impl Connection {
    /// A connection made on first use. `fingerprint(range)` computes the host's model fingerprint of a layer range
    /// (see `backburner_model::fingerprint`); it should answer from a cache once warmed (see
    /// [`crate::split::dir_fingerprint`]).
    pub fn new(
        settings: WorkerSettings,
        fingerprint: impl Fn(Range<usize>) -> Result<[u8; 32], String> + Send + 'static,
    ) -> Self {
        Connection {
            settings,
            fingerprint: Box::new(fingerprint),
            conn: None,
            limits: None,
            worker_threads: 1,
            stats: LinkStats::default(),
            retry_at: None,
            backoff: Duration::from_millis(500),
            counted: (0, 0),
            sessions_lost: 0,
            lost_at: None,
            experts: Vec::new(),
            last_error: None,
        }
    }

    /// Settings.
    pub fn settings(&self) -> &WorkerSettings {
        &self.settings
    }

    /// Sets the base timeout of connecting, the handshake and `Ping` (a health check caps it at
    /// [`HEALTH_PING_TIMEOUT`]), returning the one it replaces.
    pub(crate) fn swap_timeout(&mut self, t: Duration) -> Duration {
        std::mem::replace(&mut self.settings.timeout, t)
    }

    /// Whether a connection is open.
    pub fn is_connected(&self) -> bool {
        self.conn.is_some()
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

    /// Whether the worker may be tried now (not waiting out a backoff after a failure).
    pub fn available(&self) -> bool {
        self.retry_at.is_none_or(|t| Instant::now() >= t)
    }

    /// How long the backoff after the last failure still runs (`None`: the worker may be tried now).
    pub fn retry_in(&self) -> Option<Duration> {
        self.retry_at
            .and_then(|t| t.checked_duration_since(Instant::now()))
            .filter(|d| !d.is_zero())
    }

    /// Lets the next exchange reconnect at once instead of after the backoff (a request retried on a fresh
    /// connection). The backoff keeps its length, so a failure of that retry waits twice as long, and the worker
    /// stays [`Connection::failing`] until an exchange succeeds.
    pub(crate) fn retry_now(&mut self) {
        if self.retry_at.is_some() {
            self.retry_at = Some(Instant::now());
        }
    }

    /// Sessions lost on an open connection so far (failures after a handshake; a failed connect does not count).
    pub fn sessions_lost(&self) -> u64 {
        self.sessions_lost
    }

    /// Whether the last exchange with the worker failed (it is backing off, or was not tried again since); `false`
    /// before the first one. Unlike [`Connection::available`] this does not change with time alone.
    pub fn failing(&self) -> bool {
        self.retry_at.is_some()
    }

    /// Why the last exchange failed, while [`Connection::failing`].
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// The deadline budget of a message of `bytes` bytes whose reply also waits for `compute` on the worker.
    pub(crate) fn allowance(&self, bytes: usize, compute: Duration) -> Duration {
        let transfer = (bytes as f64 / self.settings.min_rate.max(1) as f64).min(1e9);
        self.settings
            .timeout
            .saturating_add(compute)
            .saturating_add(Duration::from_secs_f64(transfer))
    }

    /// The host's fingerprint of `range` (computed before connecting so that the handshake answers from a cache).
    pub(crate) fn fingerprint(&self, range: Range<usize>) -> Result<[u8; 32], LinkError> {
        (self.fingerprint)(range).map_err(LinkError::Refused)
    }

    /// The session parameters for `range` of `cfg` with `shape`.
    ///
    /// Errors: [`LinkError::Refused`] when a value does not fit its protocol field or there is no fingerprint.
    pub(crate) fn params(
        &self,
        cfg: &ModelConfig,
        range: Range<usize>,
        shape: SessionShape,
        layer_split: bool,
    ) -> Result<SessionParams, LinkError> {
        let too_big = |what: &str, v: usize| {
            LinkError::Refused(format!("{what} {v} does not fit the protocol's field"))
        };
        let n = cfg.num_hidden_layers;
        let u32_of = |what: &str, v: usize| u32::try_from(v).map_err(|_| too_big(what, v));
        Ok(SessionParams {
            fingerprint: self.fingerprint(range.clone())?,
            n_layers: u32_of("layers", n)?,
            layer_start: u32_of("first layer", range.start)?,
            layer_end: u32_of("last layer", range.end)?,
            hidden: u32_of("hidden", cfg.hidden_size)?,
            kv_dtype: match shape.kv {
                KvDtype::F16 => WireKvDtype::F16,
                KvDtype::F32 => WireKvDtype::F32,
                KvDtype::Bf16 => WireKvDtype::Bf16,
            },
            kv_page_size: u64::try_from(shape.page)
                .map_err(|_| too_big("page size", shape.page))?,
            ubatch: u32_of("ubatch", shape.ubatch)?,
            layer_split,
            experts: self.experts.clone(),
        })
    }

    /// Makes the sessions this connection opens hold the routed experts `ids` of their layer range (experts on the
    /// worker) instead of running layers.
    pub(crate) fn set_experts(&mut self, ids: Vec<u32>) {
        self.experts = ids;
    }

    /// Connects and runs the handshake for the session parameters of `range` (chosen from the worker's
    /// `Challenge`; it must not block: the worker bounds the whole handshake), as a layer-split session or a
    /// split-prefill mirror. Returns the worker's `Welcome`.
    ///
    /// Transient faults do not fail it: a handshake cut by the transport (reset or closed before the `Welcome`, on a
    /// connection the worker accepted, so it is up) is tried once more on a fresh connection, and within
    /// 3 s of a session lost on an open connection a refused connection is taken for a restarting worker and
    /// waited for, up to [`RECONNECT_PATIENCE`].
    ///
    /// Errors: the worker's typed errors ([`LinkError::Remote`]), `range`'s, [`LinkError::Refused`] for values the
    /// protocol cannot carry, transport errors and deadlines.
    pub(crate) fn connect_with(
        &mut self,
        cfg: &ModelConfig,
        shape: SessionShape,
        layer_split: bool,
        mut range: impl FnMut(&Challenge) -> Result<Range<usize>, LinkError>,
    ) -> Result<Welcome, LinkError> {
        if let Some(c) = self.conn.take() {
            c.shutdown();
        }
        let conn = self.dial()?;
        match self.handshake(conn, cfg, shape, layer_split, &mut range) {
            Err(e) if handshake_cut(&e) => {
                warn!(addr = %self.settings.addr, "the handshake was cut ({e}); trying once more on a fresh connection");
                let conn = self.dial()?;
                self.handshake(conn, cfg, shape, layer_split, &mut range)
            }
            r => r,
        }
    }

    /// A TCP connection to the worker; a refused one within [`RESTART_WINDOW`] of a lost session is tried again
    /// every [`RECONNECT_POLL`] for up to [`RECONNECT_PATIENCE`].
    fn dial(&self) -> Result<Conn, LinkError> {
        let st = &self.settings;
        let restarting = self.lost_at.is_some_and(|t| t.elapsed() < RESTART_WINDOW);
        let give_up = Instant::now() + RECONNECT_PATIENCE;
        loop {
            match Conn::connect(&st.addr, st.timeout, st.shaper) {
                Err(LinkError::Io(e))
                    if restarting
                        && e.kind() == std::io::ErrorKind::ConnectionRefused
                        && Instant::now() < give_up =>
                {
                    std::thread::sleep(RECONNECT_POLL);
                }
                r => return r,
            }
        }
    }

    /// The handshake on a fresh connection; on success the connection is kept.
    fn handshake(
        &mut self,
        mut conn: Conn,
        cfg: &ModelConfig,
        shape: SessionShape,
        layer_split: bool,
        range: &mut dyn FnMut(&Challenge) -> Result<Range<usize>, LinkError>,
    ) -> Result<Welcome, LinkError> {
        let this = &*self;
        let shaken = host_handshake(&mut conn, &this.settings.secret, |ch| {
            this.params(cfg, range(ch)?, shape, layer_split)
        });
        // what the handshake sent and received went over the link either way
        self.stats.bytes_sent += conn.bytes_sent();
        self.stats.bytes_received += conn.bytes_received();
        let (params, welcome) = shaken?;
        info!(addr = %self.settings.addr, layers = ?(params.layer_start..params.layer_end),
            layer_split, worker_threads = welcome.threads, session = welcome.session, "worker attached");
        self.limits = Some(welcome.limits);
        self.worker_threads = welcome.threads.max(1) as usize;
        self.counted = (conn.bytes_sent(), conn.bytes_received());
        self.conn = Some(conn);
        Ok(welcome)
    }

    /// Round trip of a `Ping` carrying `payload` on the open connection.
    ///
    /// Errors: [`LinkError::Refused`] without a connection; transport errors and deadlines; a `Pong` whose payload
    /// differs ([`LinkError::Malformed`]).
    pub fn ping(&mut self, payload: &[u8]) -> Result<Duration, LinkError> {
        use backburner_link::frame::Kind;
        use backburner_link::message::Empty;
        let d = self.allowance(2 * payload.len(), Duration::ZERO);
        let c = self
            .conn
            .as_mut()
            .ok_or_else(|| LinkError::Refused("not connected".into()))?;
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
        self.succeeded();
        Ok(dt)
    }

    /// Adds the open connection's bytes since the last count to the statistics.
    pub(crate) fn account(&mut self) {
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
            self.sessions_lost += 1;
            self.lost_at = Some(Instant::now());
        }
        warn!(addr = %self.settings.addr, "worker failed: {err}");
        self.last_error = Some(err.to_string());
        tracing::debug!(addr = %self.settings.addr, "next try in {:?} at the earliest", self.backoff);
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(Duration::from_secs(60));
    }

    /// Marks a successful exchange: the backoff resets and the byte counters catch up.
    pub(crate) fn succeeded(&mut self) {
        self.backoff = Duration::from_millis(500);
        self.retry_at = None;
        self.lost_at = None;
        self.last_error = None;
        self.account();
    }
}

/// Whether a failed handshake was cut by the transport (worth one more try on a fresh connection) rather than
/// refused or failed by the worker.
fn handshake_cut(e: &LinkError) -> bool {
    match e {
        LinkError::Closed | LinkError::Cut => true,
        LinkError::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::ConnectionAborted
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}
