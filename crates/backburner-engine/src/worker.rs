//! The worker daemon: serves one host session at a time, running a tail layer range `[L, n)` on residual streams the
//! host sends, and keeping a mirror of those layers' state (KV rows and linear states) that the host syncs and
//! fetches. See docs/PROTOCOL.md.
//!
//! Threads: one accept loop; one thread per connection. A connection that arrives while a session is active gets a
//! `Busy` error. A malformed frame closes that connection with an error; the daemon keeps listening.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backburner_kernels::kv::KvDtype;
use backburner_link::frame::{bytes_f32, Kind};
use backburner_link::handshake::worker_handshake;
use backburner_link::message::{
    Empty, Fetch, FetchDone, LayersDone, RunLayers, SessionParams, Sync,
};
use backburner_link::{Conn, ErrorCode, LinkError};
use backburner_model::{
    fingerprint, Checkpoint, KvOptions, LoadOptions, Model, ModelConfig, ModelState,
};
use tracing::{info, warn};

use crate::compute::ComputePool;
use crate::wire;

/// Worker settings.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// Checkpoint directory (the worker reads only its layers' tensors).
    pub model_dir: PathBuf,
    /// Layer range to serve; `None` = whatever the first host asks for (loaded then, kept for later sessions).
    pub layers: Option<Range<usize>>,
    /// Compute threads: the worker's own [`ComputePool`] (reported to the host, which balances the split with it).
    pub threads: usize,
    /// Most bytes of state (KV rows + linear states) the mirror may hold; 0 = unlimited.
    pub max_memory: u64,
    /// Shared secret; `None` accepts any host (only allowed on loopback, enforced by the caller).
    pub secret: Option<Vec<u8>>,
    /// How long a session may sit idle waiting for the host's next frame.
    pub idle_timeout: Duration,
    /// Bound on a frame's tensor section after authentication (bytes); before it, frames carry no tensors and the
    /// bound is 0.
    pub max_frame: usize,
    /// Fault injection for tests: exit the whole process (as a crash would) on receiving this many session frames
    /// (1 = the first frame after the handshake). Never set in normal use.
    pub exit_after_frames: Option<usize>,
}

/// How long the worker waits for each handshake message (the host may be hashing a large checkpoint).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(120);

struct Loaded {
    model: Arc<Model>,
    range: Range<usize>,
    fingerprint: [u8; 32],
}

struct Shared {
    opts: WorkerOptions,
    config: ModelConfig,
    ckpt: Checkpoint,
    loaded: Mutex<Option<Arc<Loaded>>>,
    busy: AtomicBool,
    pool: ComputePool,
}

/// A running worker.
pub struct Worker {
    shared: Arc<Shared>,
    listener: TcpListener,
}

impl Worker {
    /// Opens the checkpoint (and loads `opts.layers` if given) and binds `addr`.
    ///
    /// Errors: model loading errors, or the bind error.
    pub fn bind(addr: &str, opts: WorkerOptions) -> Result<Self, WorkerError> {
        let config = ModelConfig::from_dir(&opts.model_dir)?;
        let ckpt = Checkpoint::open(&opts.model_dir)?;
        let pool =
            ComputePool::new(opts.threads).map_err(|e| WorkerError::Threads(e.to_string()))?;
        let shared = Arc::new(Shared {
            opts: opts.clone(),
            config,
            ckpt,
            loaded: Mutex::new(None),
            busy: AtomicBool::new(false),
            pool,
        });
        if let Some(r) = &opts.layers {
            let c = &shared.config;
            check_range(c, r).map_err(|(_, m)| WorkerError::LayerRange(m))?;
            load(&shared, r.clone())?;
        }
        let listener = TcpListener::bind(addr).map_err(|source| WorkerError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        Ok(Worker { shared, listener })
    }

    /// The bound address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// Serves until `stop` is set (checked every 20 ms). Each connection runs on its own thread.
    pub fn serve(self, stop: Arc<AtomicBool>) {
        self.listener
            .set_nonblocking(true)
            .expect("nonblocking listener");
        info!(addr = %self.local_addr(), "worker listening");
        while !stop.load(Ordering::Relaxed) {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    let shared = self.shared.clone();
                    let stop = stop.clone();
                    std::thread::spawn(move || handle(shared, stream, peer, stop));
                }
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
}

fn check_range(c: &ModelConfig, r: &Range<usize>) -> Result<(), (ErrorCode, String)> {
    let cyc = c.full_attention_interval;
    if r.end != c.num_hidden_layers
        || r.start == 0
        || r.start >= r.end
        || !r.start.is_multiple_of(cyc)
    {
        return Err((
            ErrorCode::LayerRangeMismatch,
            format!(
                "layer range {}..{} is not a tail range on a {cyc}-layer cycle boundary of this {}-layer model (valid starts: {})",
                r.start,
                r.end,
                c.num_hidden_layers,
                valid_split_layers(c).iter().map(|l| l.to_string()).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    Ok(())
}

/// Split points a host may use: multiples of `full_attention_interval` strictly inside `(0, n_layers)`.
pub fn valid_split_layers(c: &ModelConfig) -> Vec<usize> {
    (1..c.num_hidden_layers)
        .filter(|l| l % c.full_attention_interval == 0)
        .collect()
}

fn load(shared: &Shared, range: Range<usize>) -> Result<Arc<Loaded>, WorkerError> {
    let mut g = shared.loaded.lock().expect("lock");
    if let Some(l) = g.as_ref() {
        if l.range == range {
            return Ok(l.clone());
        }
    }
    info!(?range, "loading layers");
    let model = shared.pool.install(|| {
        Model::from_checkpoint(
            shared.config.clone(),
            &shared.ckpt,
            &LoadOptions {
                layers: range.clone(),
                ends: false,
            },
            |_, _| {},
        )
    })?;
    let fp = fingerprint(&shared.ckpt, &shared.config, range.clone())?;
    let l = Arc::new(Loaded {
        model: Arc::new(model),
        range,
        fingerprint: fp,
    });
    *g = Some(l.clone());
    Ok(l)
}

struct BusyGuard<'a>(&'a AtomicBool);
impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

fn handle(shared: Arc<Shared>, stream: TcpStream, peer: SocketAddr, stop: Arc<AtomicBool>) {
    let _ = stream.set_nonblocking(false);
    // No handshake message carries a tensor section: until the host authenticates, any tensor bytes are refused.
    let mut conn = match Conn::new(stream, Some(HANDSHAKE_TIMEOUT), Some(0), None) {
        Ok(c) => c,
        Err(e) => return warn!(%peer, "connection setup failed: {e}"),
    };
    if shared
        .busy
        .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // Read the Hello so the host sees a clean error rather than a reset.
        let _ = conn.reader.recv();
        conn.writer
            .send_error(ErrorCode::Busy, "this worker is serving another host");
        info!(%peer, "refused: busy");
        return;
    }
    let _guard = BusyGuard(&shared.busy);
    match session(&shared, &mut conn, &stop) {
        Ok(()) | Err(LinkError::Closed) => info!(%peer, "host disconnected"),
        Err(e) => {
            // Tell the peer why, where it did not already get an Error frame.
            match &e {
                LinkError::VersionMismatch { .. } => conn
                    .writer
                    .send_error(ErrorCode::VersionMismatch, e.to_string()),
                LinkError::BadMagic(_)
                | LinkError::UnknownKind(_)
                | LinkError::FrameTooLarge { .. }
                | LinkError::Malformed(_)
                | LinkError::Unexpected { .. } => {
                    conn.writer.send_error(ErrorCode::Malformed, e.to_string())
                }
                _ => {}
            }
            warn!(%peer, "session ended: {e}");
        }
    }
    conn.shutdown();
}

fn session(shared: &Shared, conn: &mut Conn, stop: &AtomicBool) -> Result<(), LinkError> {
    let c = &shared.config;
    let mut loaded: Option<Arc<Loaded>> = None;
    let fixed = shared
        .opts
        .layers
        .as_ref()
        .map(|r| (r.start as u32, r.end as u32));
    let threads = shared.opts.threads as u32;
    let params: SessionParams = worker_handshake(
        conn,
        shared.opts.secret.as_deref(),
        threads,
        fixed,
        |p| {
            let range = p.layer_start as usize..p.layer_end as usize;
            if p.n_layers as usize != c.num_hidden_layers || p.hidden as usize != c.hidden_size {
                return Err((
                    ErrorCode::ModelMismatch,
                    format!(
                        "host model has {} layers / hidden {}, this worker's has {} / {}",
                        p.n_layers, p.hidden, c.num_hidden_layers, c.hidden_size
                    ),
                ));
            }
            check_range(c, &range)?;
            if let Some(fixed) = &shared.opts.layers {
                if *fixed != range {
                    return Err((
                        ErrorCode::LayerRangeMismatch,
                        format!(
                    "this worker serves layers {}..{} (--layers), the host asked for {}..{}",
                    fixed.start, fixed.end, range.start, range.end
                ),
                    ));
                }
            }
            if p.kv_dtype > 1 || p.kv_page_size == 0 || p.ubatch == 0 {
                return Err((
                    ErrorCode::ParamMismatch,
                    format!(
                        "unsupported session parameters: kv_dtype {}, kv_page_size {}, ubatch {}",
                        p.kv_dtype, p.kv_page_size, p.ubatch
                    ),
                ));
            }
            let l = load(shared, range).map_err(|e| (ErrorCode::Internal, e.to_string()))?;
            if l.fingerprint != p.fingerprint {
                return Err((ErrorCode::ModelMismatch, format!(
                "model fingerprint differs for layers {}..{}: the worker's checkpoint ({}) is not the host's",
                p.layer_start, p.layer_end, shared.opts.model_dir.display()
            )));
            }
            loaded = Some(l);
            Ok((shared.opts.threads as u32, shared.opts.max_memory))
        },
    )?;
    let l = loaded.expect("handshake loaded the layers");
    let range = l.range.clone();
    let kv = KvOptions {
        page_size: params.kv_page_size as usize,
        dtype: if params.kv_dtype == 0 {
            KvDtype::F16
        } else {
            KvDtype::F32
        },
    };
    let mut mirror = ModelState::new(c, range.clone(), kv);
    conn.reader.set_timeout(Some(shared.opts.idle_timeout))?;
    conn.reader.set_max_tensor(shared.opts.max_frame);
    info!(?range, "session started");
    let hidden = c.hidden_size;
    let mut last_done = Instant::now();
    let mut frames = 0usize;
    loop {
        if stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        let f = conn.reader.recv()?;
        let arrived = Instant::now();
        frames += 1;
        if shared.opts.exit_after_frames == Some(frames) {
            warn!(
                "fault injection: exiting on session frame {frames} ({:?})",
                f.kind
            );
            std::process::exit(101);
        }
        match f.kind {
            Kind::Ping => {
                conn.writer.send(Kind::Pong, &Empty {}, &f.tensor)?;
            }
            Kind::Reset => {
                mirror.clear();
                conn.writer.send(Kind::ResetDone, &Empty {}, &[])?;
            }
            Kind::Sync => {
                let s: Sync = f.control()?;
                let pos = mirror.n_tokens() as u64;
                // Linear states arrive with the last Sync of a series (a long range comes in several); until then the
                // mirror's linear states are stale, and the host sends no RunLayers before the series ends.
                if s.truncate_to > pos || s.pos_after < s.truncate_to {
                    return fail(
                        conn,
                        ErrorCode::BadState,
                        format!(
                            "sync truncate_to {} / pos_after {} does not fit a mirror at {pos}",
                            s.truncate_to, s.pos_after
                        ),
                    );
                }
                let n = (s.pos_after - s.truncate_to) as usize;
                if over_budget(shared, &mirror, c, &range, n) {
                    return fail(
                        conn,
                        ErrorCode::OutOfMemory,
                        format!(
                            "{} more positions exceed --max-memory {} bytes",
                            n, shared.opts.max_memory
                        ),
                    );
                }
                // A failed sync ends the session, and with it this mirror (each session starts a fresh one).
                wire::truncate_kv(&mut mirror, range.clone(), s.truncate_to as usize);
                if let Err(e) = wire::apply(&mut mirror, c, range.clone(), n, s.linear, &f.tensor) {
                    return fail(conn, ErrorCode::Malformed, e.to_string());
                }
                mirror.set_position(s.pos_after as usize);
                conn.writer.send(Kind::SyncDone, &Empty {}, &[])?;
            }
            Kind::RunLayers => {
                let r: RunLayers = f.control()?;
                let t = r.n_tokens as usize;
                if r.pos != mirror.n_tokens() as u64
                    || t == 0
                    || t > params.ubatch as usize
                    || f.tensor.len() != t * hidden * 4
                {
                    return fail(conn, ErrorCode::BadState, format!(
                        "RunLayers at {} for {t} tokens with {} bytes does not fit a mirror at {} (ubatch {}, hidden {hidden})",
                        r.pos, f.tensor.len(), mirror.n_tokens(), params.ubatch
                    ));
                }
                if over_budget(shared, &mirror, c, &range, t) {
                    return fail(
                        conn,
                        ErrorCode::OutOfMemory,
                        format!(
                            "{t} more positions exceed --max-memory {} bytes",
                            shared.opts.max_memory
                        ),
                    );
                }
                let idle = arrived.saturating_duration_since(last_done);
                let mut x = bytes_f32(&f.tensor)?;
                let t0 = Instant::now();
                let model = &l.model;
                shared.pool.install(|| {
                    backburner_kernels::profile::set_phase(
                        backburner_kernels::profile::Phase::Prefill,
                    );
                    model.forward_layers(range.clone(), &mut x, t, &mut mirror)
                });
                l.model.commit_tokens(&mut mirror, t);
                let compute = t0.elapsed();
                last_done = Instant::now();
                conn.writer.send(
                    Kind::LayersDone,
                    &LayersDone {
                        pos_after: mirror.n_tokens() as u64,
                        compute_us: compute.as_micros() as u64,
                        idle_us: idle.as_micros() as u64,
                    },
                    &[],
                )?;
            }
            Kind::Fetch => {
                let q: Fetch = f.control()?;
                let pos = mirror.n_tokens() as u64;
                if q.from_pos > q.to_pos || q.to_pos > pos {
                    return fail(
                        conn,
                        ErrorCode::BadState,
                        format!(
                            "fetch {}..{} outside the mirror's 0..{pos}",
                            q.from_pos, q.to_pos
                        ),
                    );
                }
                let (a, b) = (q.from_pos as usize, q.to_pos as usize);
                let payload = wire::encode(&mirror, c, range.clone(), a, b, q.linear);
                let done = FetchDone {
                    from_pos: q.from_pos,
                    to_pos: q.to_pos,
                };
                conn.writer.send(Kind::FetchDone, &done, &payload)?;
            }
            other => {
                return fail(
                    conn,
                    ErrorCode::Malformed,
                    format!("unexpected {other:?} in a session"),
                );
            }
        }
    }
}

fn over_budget(
    shared: &Shared,
    m: &ModelState,
    c: &ModelConfig,
    range: &Range<usize>,
    more: usize,
) -> bool {
    if shared.opts.max_memory == 0 {
        return false;
    }
    let extra = wire::payload_len(c, range.clone(), more, m.kv_options().dtype, false) as u64;
    m.bytes() as u64 + extra > shared.opts.max_memory
}

fn fail(conn: &mut Conn, code: ErrorCode, message: String) -> Result<(), LinkError> {
    conn.writer.send_error(code, message.clone());
    Err(LinkError::Remote { code, message })
}
