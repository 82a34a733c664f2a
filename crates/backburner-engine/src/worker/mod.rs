//! The worker daemon: serves several hosts' sessions at once. A split-prefill session runs a tail layer range
//! `[L, n)` on residual streams its host sends and keeps a mirror of those layers' state (KV rows and linear states)
//! that the host syncs and fetches; a layer-split session holds the only copy of any layer range and answers each
//! residual stream with the one leaving its last layer; any session may hold KV pages (offload). See
//! docs/PROTOCOL.md.
//!
//! Threads: one accept loop; one thread per connection, bounded: at most `max_pending` connections in their
//! handshake (the oldest is dropped for a new one, and each has `handshake_timeout` for the whole handshake) and at
//! most `max_sessions` sessions. A connection thread that cannot be started is refused, never a panic. A malformed
//! frame, a missed deadline or a refused request ends that session with a typed `Error` frame; the daemon keeps
//! listening.

mod accept;
mod budget;
mod checkpoints;
mod core;
mod experts;
mod packer;
mod page_requests;
pub mod pages;
mod registry;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backburner_link::frame::Kind;
use backburner_link::message::Empty;
use backburner_link::{Conn, ErrorCode, LinkError, Pace, Request};
use backburner_model::{Checkpoint, Model, ModelConfig};
use tracing::{info, warn};

pub use self::accept::valid_split_layers;
use self::accept::{check_range, handshake, load, Accepted};
pub use self::budget::{default_max_memory, MakeRoom, MemoryBudget, OverBudget, Reservation};
pub use self::core::{Fault, PageStats, Reply, SessionCore, SessionSpec};
pub use self::page_requests::attend_headroom;
use self::registry::{Registry, SessionGuard};
use crate::compute::ComputePool;

/// Worker settings.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Checkpoint directory (the worker reads only its layers' tensors).
    pub model_dir: PathBuf,
    /// Layer range to serve; `None` = whatever the first host asks for (loaded then, kept for later sessions).
    pub layers: Option<Range<usize>>,
    /// Compute threads: the worker's own [`ComputePool`] (reported to the host, which balances the split with it).
    pub threads: usize,
    /// Bytes the worker may hold: the weights of the layers it loads (reserved before they are loaded), and the
    /// session state (KV rows, linear states, offloaded pages) and request buffers of all sessions together
    /// (default: [`default_max_memory`]).
    pub max_memory: u64,
    /// Shared secret; `None` accepts any host (only allowed on loopback, enforced by the caller).
    pub secret: Option<Vec<u8>>,
    /// How long a session may wait for its host's next request.
    pub idle_timeout: Duration,
    /// Bound on a frame's tensor section after authentication (bytes); before it, frames carry no tensors.
    pub max_frame: usize,
    /// Most tokens per `RunLayers` (a host with a larger ubatch runs locally).
    pub max_ubatch: usize,
    /// Most sessions at once.
    pub max_sessions: usize,
    /// Most connections in their handshake at once (the oldest is dropped for a new one).
    pub max_pending: usize,
    /// The whole handshake must complete within this.
    pub handshake_timeout: Duration,
    /// Once a request's first byte has arrived, the rest of its header must arrive within `pace.base` and its body
    /// within `pace.allowance(body bytes)` of the header.
    pub pace: Pace,
    /// Re-lay the KV pages hosts offload here into the attention kernel's fastest layout, in a background thread
    /// per session (default on).
    pub pack_pages: bool,
    /// Fault injection for tests: exit the whole process (as a crash would) on receiving this many session frames
    /// (1 = the first frame after the handshake). Never set in normal use.
    pub exit_after_frames: Option<usize>,
    /// The arithmetic of products against bf16 weights ([`ModelConfig::precision`]); it must be the host's, which
    /// the fingerprint checks (default [`backburner_model::Precision::F32`]).
    pub precision: backburner_model::Precision,
}

impl WorkerOptions {
    /// The defaults for a model directory: layers from the host, all cores, half the RAM, 600 s idle timeout, 1 GiB
    /// frames, 4096-token ubatches, 8 sessions, 16 pending handshakes of at most 5 s, requests at ≥ 1 MiB/s after a
    /// 30 s allowance.
    pub fn new(model_dir: PathBuf) -> Self {
        WorkerOptions {
            model_dir,
            layers: None,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            max_memory: default_max_memory(),
            secret: None,
            idle_timeout: Duration::from_secs(600),
            max_frame: 1 << 30,
            max_ubatch: 4096,
            max_sessions: 8,
            max_pending: 16,
            handshake_timeout: Duration::from_secs(5),
            pace: Pace {
                base: Duration::from_secs(30),
                min_rate: 1 << 20,
            },
            exit_after_frames: None,
            pack_pages: true,
            precision: backburner_model::Precision::F32,
        }
    }
}

/// Most positions a session may ask for (2⁴⁰): far beyond any context, small enough that position arithmetic
/// cannot overflow.
const MAX_POSITIONS: u64 = 1 << 40;

struct Loaded {
    model: Arc<Model>,
    range: Range<usize>,
    fingerprint: [u8; 32],
    /// The weights' bytes, held against the memory budget while they are loaded.
    _weights: Reservation,
}

struct Shared {
    opts: WorkerOptions,
    config: ModelConfig,
    ckpt: Checkpoint,
    loaded: Mutex<Option<Arc<Loaded>>>,
    experts: Mutex<Option<Arc<experts::LoadedExperts>>>,
    registry: Arc<Registry>,
    budget: Arc<MemoryBudget>,
    pool: ComputePool,
    /// Connection threads alive (handshakes, sessions, and ones still winding down after being closed).
    live: std::sync::atomic::AtomicUsize,
}

/// A running worker.
pub struct Worker {
    shared: Arc<Shared>,
    listener: TcpListener,
}

impl Worker {
    /// Opens the checkpoint (and loads `opts.layers` if given) and binds `addr`.
    ///
    /// Errors: model loading errors, a bad layer range or thread count, or the bind error.
    pub fn bind(addr: &str, opts: WorkerOptions) -> Result<Self, WorkerError> {
        let config = ModelConfig {
            precision: opts.precision,
            ..ModelConfig::from_dir(&opts.model_dir)?
        };
        let ckpt = Checkpoint::open(&opts.model_dir)?;
        let pool =
            ComputePool::new(opts.threads).map_err(|e| WorkerError::Threads(e.to_string()))?;
        let shared = Arc::new(Shared {
            registry: Registry::new(opts.max_pending, opts.max_sessions),
            budget: MemoryBudget::new(opts.max_memory),
            opts: opts.clone(),
            config,
            ckpt,
            loaded: Mutex::new(None),
            experts: Mutex::new(None),
            pool,
            live: Default::default(),
        });
        if let Some(r) = &opts.layers {
            check_range(&shared.config, r, true).map_err(|(_, m)| WorkerError::LayerRange(m))?;
            load(&shared, r.clone())?;
        }
        let listener = TcpListener::bind(addr).map_err(|source| WorkerError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        Ok(Worker { shared, listener })
    }

    /// Bytes of the weights loaded now (0 before a host's handshake chose the layers, without `--layers`).
    pub fn weight_bytes(&self) -> u64 {
        let g = self.shared.loaded.lock().unwrap_or_else(|p| p.into_inner());
        g.as_ref().map_or(0, |l| l.model.weight_bytes() as u64)
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Serves until `stop` is set (checked every 20 ms). Each connection runs on its own thread; a thread that
    /// cannot be created (a process or thread limit) refuses that connection, and accept errors (out of file
    /// descriptors) back off, so the daemon never exits on them.
    pub fn serve(self, stop: Arc<AtomicBool>) {
        if let Err(e) = self.listener.set_nonblocking(true) {
            return warn!("cannot make the listener non-blocking: {e}");
        }
        info!(addr = %self.local_addr(), "worker listening");
        while !stop.load(Ordering::Relaxed) {
            match self.listener.accept() {
                Ok((stream, peer)) => self.spawn_connection(stream, peer, &stop),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                Err(e) => {
                    warn!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        info!("worker stopped");
    }

    fn spawn_connection(&self, stream: TcpStream, peer: SocketAddr, stop: &Arc<AtomicBool>) {
        // a hard cap on connection threads: handshakes and sessions, plus a few closed ones still winding down
        let cap = self.shared.opts.max_pending + self.shared.opts.max_sessions + 8;
        if self.shared.live.load(Ordering::Acquire) >= cap {
            return tracing::debug!(%peer, "refused: {cap} connection threads alive");
        }
        let handle = match stream.try_clone() {
            Ok(h) => h,
            Err(e) => return warn!(%peer, "refused: cannot clone the socket ({e})"),
        };
        let pending = self.shared.registry.admit(handle);
        self.shared.live.fetch_add(1, Ordering::AcqRel);
        let (shared, stop) = (self.shared.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name("bb-worker-conn".into())
            .spawn(move || {
                let _live = LiveThread(&shared.live);
                let pending = pending;
                handle_connection(&shared, stream, peer, pending, stop)
            });
        if let Err(e) = spawned {
            // the closure (with the stream and the pending slot) was dropped: the connection is closed
            self.shared.live.fetch_sub(1, Ordering::AcqRel);
            warn!(%peer, "refused: cannot start a connection thread ({e})");
        }
    }
}

/// Counts a connection thread as alive until it ends.
struct LiveThread<'a>(&'a std::sync::atomic::AtomicUsize);

impl Drop for LiveThread<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Errors starting a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The checkpoint failed to open or load.
    #[error(transparent)]
    Model(#[from] backburner_model::ModelError),
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--layers` is not a valid tail range.
    #[error("{0}")]
    LayerRange(String),
    /// The compute threads could not be started (or `threads` is 0).
    #[error("{0}")]
    Threads(String),
    /// The weights of a layer range do not fit the memory budget beside what is held.
    #[error(
        "the weights of layers {}..{} need {} bytes; the worker holds {used} of its --max-memory {limit} bytes",
        layers.start, layers.end, need
    )]
    Memory {
        /// The layers.
        layers: Range<usize>,
        /// Bytes their weights need ([`backburner_model::load_bytes`]).
        need: u64,
        /// Bytes held when they were asked for.
        used: u64,
        /// The budget (`--max-memory`).
        limit: u64,
    },
}

fn handle_connection(
    shared: &Arc<Shared>,
    stream: TcpStream,
    peer: SocketAddr,
    pending: registry::PendingGuard,
    stop: Arc<AtomicBool>,
) {
    let _ = stream.set_nonblocking(false);
    // No handshake message carries a tensor section: until the host authenticates, any tensor bytes are refused.
    // The whole handshake (every read and write) has `handshake_timeout`.
    let setup = stream.try_clone().map_err(LinkError::Io).and_then(|h| {
        Ok((
            Conn::new(stream, Some(shared.opts.handshake_timeout), Some(0), None)?,
            h,
        ))
    });
    let (mut conn, handle) = match setup {
        Ok(v) => v,
        Err(e) => return warn!(%peer, "connection setup failed: {e}"),
    };
    let c = &mut conn;
    let r = handshake(shared, c, handle).and_then(
        |Accepted {
             loaded,
             experts,
             guard,
             core,
         }| {
            let _held = (loaded, experts);
            drop(pending);
            let (sessions, pending) = shared.registry.counts();
            info!(%peer, session = guard.id(), sessions, pending, "session started");
            serve_session(shared, c, core, &guard, &stop)
        },
    );
    match r {
        Ok(()) | Err(LinkError::Closed) => info!(%peer, "host disconnected"),
        Err(e) => {
            if let Some(code) = framing_code(&e) {
                c.writer.send_error(code, e.to_string());
                c.linger_close(16 << 20, Duration::from_secs(1));
            }
            warn!(%peer, "session ended: {e}");
        }
    }
    c.shutdown();
}

/// The error code a framing fault is answered with (None: the peer already got an `Error`, or cannot be told).
fn framing_code(e: &LinkError) -> Option<ErrorCode> {
    match e {
        LinkError::VersionMismatch { .. } => Some(ErrorCode::VersionMismatch),
        LinkError::BadMagic(_)
        | LinkError::UnknownKind(_)
        | LinkError::FrameTooLarge { .. }
        | LinkError::Malformed(_)
        | LinkError::Integrity(_)
        | LinkError::Unexpected { .. } => Some(ErrorCode::Malformed),
        LinkError::Timeout(_) => Some(ErrorCode::Deadline),
        _ => None,
    }
}

fn serve_session(
    shared: &Shared,
    conn: &mut Conn,
    core: SessionCore,
    me: &SessionGuard,
    stop: &AtomicBool,
) -> Result<(), LinkError> {
    let mut frames = 0usize;
    let reg = shared.registry.clone();
    let id = me.id();
    let budget = shared.budget.clone();
    let room: MakeRoom = Arc::new(move |need| reg.evict_idle_except(id, need, &budget));
    let mut core = core.with_room(room);
    let r = session_loop(shared, conn, &mut core, me, stop, &mut frames);
    let mem = core.memory();
    info!(
        session = id,
        frames,
        layers = ?core.range(),
        weight_bytes = mem.weights,
        kv_bytes = mem.kv_pages,
        state_bytes = mem.recurrent_state,
        scratch_bytes = mem.scratch,
        budget_used = shared.budget.used(),
        budget = shared.opts.max_memory,
        "session's memory"
    );
    let st = core.page_stats();
    if st.puts > 0 {
        info!(
            session = id,
            frames,
            pages_put = st.puts,
            pages_held = core.pages().pages(),
            bytes_held = core.pages().bytes(),
            attends = st.attends,
            attend_ms = st.attend_us / 1000,
            "session's KV offload"
        );
    }
    r
}

fn session_loop(
    shared: &Shared,
    conn: &mut Conn,
    core: &mut SessionCore,
    me: &SessionGuard,
    stop: &AtomicBool,
    frames: &mut usize,
) -> Result<(), LinkError> {
    let o = &shared.opts;
    me.set_bytes(core.held_bytes());
    loop {
        if stop.load(Ordering::Relaxed) {
            conn.writer
                .send_error(ErrorCode::Evicted, "the worker is shutting down");
            return Ok(());
        }
        me.set_idle(true);
        conn.reader.set_deadline(Some(o.idle_timeout));
        let h = conn.reader.recv_header();
        me.set_idle(false);
        if me.evicted() {
            conn.writer.send_error(
                ErrorCode::Evicted,
                "evicted: another session needed this worker's memory",
            );
            return Err(LinkError::Remote {
                code: ErrorCode::Evicted,
                message: "evicted to free memory".into(),
            });
        }
        let h = h?;
        // the received body (see `SessionCore::request_buffers`); not authenticated yet: its buffers never evict
        let need = core.request_buffers(h.kind, h.body_len());
        let hold = match shared.budget.reserve(need, "a request's buffers") {
            Ok(r) => r,
            Err(_) if h.kind == Kind::PagesPut => {
                // pages that do not fit: read past them (one frame, at most the frame bound, over the budget for
                // as long as it takes) and say so; the session and its pages go on
                conn.reader.recv_body(h)?;
                *frames += 1;
                let full = page_requests::full(core.pages(), &shared.budget, h.tensor_len as usize);
                send_reply(conn, o.pace, full)?;
                continue;
            }
            Err(e) => return refuse(conn, e.into()),
        };
        let f = conn.reader.recv_body(h)?;
        let arrived = Instant::now();
        *frames += 1;
        if o.exit_after_frames == Some(*frames) {
            warn!(
                "fault injection: exiting on session frame {frames} ({:?})",
                f.kind()
            );
            std::process::exit(101);
        }
        let req = Request::decode(f)?;
        let reply = core.handle(req, arrived, &shared.pool);
        drop(hold);
        let reply = match reply {
            Ok(r) => r,
            Err(fault) => return refuse(conn, fault),
        };
        send_reply(conn, o.pace, reply)?;
        me.set_bytes(core.held_bytes());
        me.set_holds_pages(core.pages().pages() > 0);
    }
}

fn send_reply(conn: &mut Conn, pace: Pace, reply: Reply) -> Result<(), LinkError> {
    let bytes = match &reply {
        Reply::Pong(p)
        | Reply::FetchDone(_, p, _)
        | Reply::Partials(_, p, _)
        | Reply::ExpertsDone(_, p, _)
        | Reply::LayersDone(_, p, _) => p.len(),
        _ => 0,
    };
    conn.writer.set_deadline(Some(pace.allowance(bytes)));
    match reply {
        Reply::Pong(p) => conn.writer.send(Kind::Pong, &Empty {}, &p),
        Reply::SyncDone => conn.writer.send(Kind::SyncDone, &Empty {}, &[]),
        Reply::LayersDone(d, x, _hold) => conn.writer.send(Kind::LayersDone, &d, &x),
        Reply::FetchDone(d, p, _hold) => conn.writer.send(Kind::FetchDone, &d, &p),
        Reply::ResetDone => conn.writer.send(Kind::ResetDone, &Empty {}, &[]),
        Reply::PagesDone(d) => conn.writer.send(Kind::PagesDone, &d, &[]),
        Reply::PagesFull(d) => conn.writer.send(Kind::PagesFull, &d, &[]),
        Reply::Partials(d, p, _hold) => conn.writer.send(Kind::Partials, &d, &p),
        Reply::RewindDone(d) => conn.writer.send(Kind::RewindDone, &d, &[]),
        Reply::ExpertsDone(d, p, _hold) => conn.writer.send(Kind::ExpertsDone, &d, &p),
    }
    .map(|_| ())
}

/// Answers a refused request with its `Error` frame and closes so that the host can read it (draining at most
/// 16 MiB of the request for at most 1 s).
fn refuse(conn: &mut Conn, f: Fault) -> Result<(), LinkError> {
    conn.writer.send_error(f.code, f.message.clone());
    conn.linger_close(16 << 20, Duration::from_secs(1));
    Err(LinkError::Remote {
        code: f.code,
        message: f.message,
    })
}
