//! One session's state on the worker and the handling of its requests, free of sockets: a typed [`Request`] in, a
//! [`Reply`] or a typed fault out. Every size taken from a request is checked (no wrapping arithmetic, no
//! truncating casts) and every allocation is reserved against the worker's [`MemoryBudget`] first.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use backburner_kernels::kv::KvDtype;
use backburner_link::frame::bytes_f32;
use backburner_link::message::{
    FetchDone, LayersDone, PagesDone, PagesFull, Partials, Rewind, RewindDone, RunLayers,
};
use backburner_link::{ErrorCode, Request};
use backburner_model::state::BackError;
use backburner_model::{KvOptions, LayerKind, Model, ModelConfig, ModelState};

use super::budget::{MakeRoom, MemoryBudget, OverBudget, Reservation};
use super::checkpoints::{keep_positions, Checkpoints};
use super::page_requests::{self, PageLimits};
use super::pages::{PageShape, SessionPages};
use crate::compute::ComputePool;
use crate::wire;

/// A request the worker refuses: the code and message of the `Error` frame it sends before closing the session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The code.
    pub code: ErrorCode,
    /// What was wrong.
    pub message: String,
}

impl Fault {
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Fault {
            code,
            message: message.into(),
        }
    }
}

impl From<OverBudget> for Fault {
    fn from(e: OverBudget) -> Self {
        Fault::new(ErrorCode::OutOfMemory, e.to_string())
    }
}

/// The worker's answer to a request.
#[derive(Debug)]
pub enum Reply {
    /// The ping's payload.
    Pong(Vec<u8>),
    /// Sync applied.
    SyncDone,
    /// Layers run; in a layer-split session with the residual stream leaving the last layer (`[n_tokens, hidden]`
    /// f32 bytes, else empty) and the reservation that covers it until it is sent.
    LayersDone(LayersDone, Vec<u8>, Reservation),
    /// Rows and states, and the reservation that covers the payload until it is sent.
    FetchDone(FetchDone, Vec<u8>, Reservation),
    /// Mirror cleared.
    ResetDone,
    /// Pages stored or dropped.
    PagesDone(PagesDone),
    /// Pages that did not fit; nothing stored.
    PagesFull(PagesFull),
    /// Attention partials, and the reservation that covers them until they are sent.
    Partials(Partials, Vec<u8>, Reservation),
    /// Whether a rewind took place.
    RewindDone(RewindDone),
    /// The routed experts' vectors, and the reservation that covers them until they are sent.
    ExpertsDone(backburner_link::message::ExpertsDone, Vec<u8>, Reservation),
}

/// What a session's KV-offload requests did (for the worker's log).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageStats {
    /// Pages stored (over all layers).
    pub puts: u64,
    /// `Attend` requests answered.
    pub attends: u64,
    /// Time spent attending (µs).
    pub attend_us: u64,
}

/// What a session was agreed to be in the handshake.
#[derive(Clone, Debug)]
pub struct SessionSpec {
    /// The worker's layers.
    pub range: Range<usize>,
    /// KV page size and dtype.
    pub kv: KvOptions,
    /// Most tokens per `RunLayers`.
    pub ubatch: usize,
    /// Most positions the mirror may reach (the host's context length).
    pub max_positions: usize,
    /// Most tensor bytes per frame (a fetch must fit in one).
    pub max_frame: usize,
    /// Re-lay offloaded KV pages for the attention kernel in a background thread (the worker's `--no-pack-pages`
    /// turns it off).
    pub pack_pages: bool,
    /// Layer split: this worker holds the only copy of `range`, and every `RunLayers` is answered with the residual
    /// stream leaving its last layer.
    pub layer_split: bool,
}

/// One session's mirror and what it holds against the budget.
pub struct SessionCore {
    model: Arc<Model>,
    spec: SessionSpec,
    mirror: ModelState,
    held: Reservation,
    pub(super) budget: Arc<MemoryBudget>,
    room: Option<MakeRoom>,
    last_done: Instant,
    /// KV pages of every full-attention layer the host offloaded to this worker.
    pages: SessionPages,
    attn_layers: Vec<usize>,
    page_stats: PageStats,
    /// Exact checkpoints of the mirror (layer split) for `Rewind`.
    checkpoints: Checkpoints,
    /// Experts on the worker: the routed experts this session answers `Experts` requests with.
    pub(super) experts: Option<Arc<backburner_model::ExpertStore>>,
}

mod transfer;
mod verify;

fn page_limits<'a>(
    model: &'a Model,
    spec: &SessionSpec,
    attn_layers: &'a [usize],
) -> PageLimits<'a> {
    PageLimits {
        cfg: model.config(),
        attn_layers,
        max_positions: spec.max_positions,
        max_ubatch: spec.ubatch,
        max_frame: spec.max_frame,
    }
}

fn bad(message: impl Into<String>) -> Fault {
    Fault::new(ErrorCode::BadState, message)
}

fn size(v: u64, what: &str) -> Result<usize, Fault> {
    usize::try_from(v).map_err(|_| {
        Fault::new(
            ErrorCode::Malformed,
            format!("{what} {v} does not fit this machine"),
        )
    })
}

impl SessionCore {
    /// A session with an empty mirror of `spec.range`. Errors: [`Fault`] with `OutOfMemory` if the mirror's linear
    /// states do not fit the budget.
    pub fn new(
        model: Arc<Model>,
        spec: SessionSpec,
        budget: &Arc<MemoryBudget>,
    ) -> Result<Self, Fault> {
        let cfg = model.config();
        let mirror = ModelState::new(cfg, spec.range.clone(), spec.kv);
        let held = budget.reserve(mirror.bytes() as u64, "a session's state")?;
        let shape = PageShape {
            page_size: spec.kv.page_size,
            n_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            dtype: spec.kv.dtype,
        };
        let headroom = page_requests::attend_headroom(cfg, spec.ubatch);
        let mut pages = SessionPages::new(shape, budget)?.with_headroom(headroom);
        if spec.pack_pages {
            pages = pages.pack_in_background();
        }
        let attn_layers = (0..cfg.num_hidden_layers)
            .filter(|&i| cfg.layer_types[i] == LayerKind::FullAttention)
            .collect();
        Ok(SessionCore {
            pages,
            attn_layers,
            page_stats: PageStats::default(),
            model,
            spec,
            mirror,
            held,
            budget: budget.clone(),
            room: None,
            last_done: Instant::now(),
            checkpoints: Checkpoints::default(),
            experts: None,
        })
    }

    /// Lets the session free memory held elsewhere (evict idle sessions) when a reservation does not fit.
    pub fn with_room(mut self, room: MakeRoom) -> Self {
        self.room = Some(room);
        self
    }

    /// Bytes the session's state, checkpoints and offloaded pages hold against the budget.
    pub fn held_bytes(&self) -> u64 {
        self.held
            .bytes()
            .saturating_add(self.pages.bytes())
            .saturating_add(self.checkpoints.bytes())
    }

    /// The positions of the exact checkpoints held (layer split).
    pub fn checkpoints(&self) -> Vec<usize> {
        self.checkpoints.positions()
    }

    /// What this session holds, in bytes: the weights of its layers (shared by every session of that range), the
    /// mirror's KV rows plus the KV pages hosts offloaded here, its Gated DeltaNet states and its activation
    /// buffers as grown so far.
    pub fn memory(&self) -> crate::memory::MemoryReport {
        let m = &self.mirror;
        crate::memory::MemoryReport {
            weights: self.model.host_weight_bytes() as u64,
            device_weights: 0,
            kv_pages: (m.kv_bytes() as u64).saturating_add(self.pages.bytes()),
            recurrent_state: m.linear_bytes() as u64,
            scratch: m.scratch_bytes() as u64,
        }
    }

    /// What the session's KV-offload requests did so far.
    pub fn page_stats(&self) -> PageStats {
        self.page_stats
    }

    /// Bytes to reserve for the buffers of a request of `kind` with a body of `body` bytes, once its header has
    /// been read: the body and, for a `Ping`, its echo (twice the body); once for a `PagesPut`, whose pages the
    /// store reserves; an `Attend`'s come out of the page store's headroom while it holds pages.
    pub fn request_buffers(&self, kind: backburner_link::Kind, body: usize) -> u64 {
        use backburner_link::Kind;
        let copies = if kind == Kind::PagesPut { 1 } else { 2 };
        let prepaid = match kind {
            Kind::Attend if self.pages.headroom() > 0 => {
                page_requests::attend_sizes(self.cfg(), self.spec.ubatch)
                    .map_or(0, |(_, q)| (q + page_requests::ATTEND_CONTROL) as u64 * 2)
            }
            _ => 0,
        };
        (body as u64).saturating_mul(copies).saturating_sub(prepaid)
    }

    /// The layers this session runs.
    pub fn range(&self) -> std::ops::Range<usize> {
        self.spec.range.clone()
    }

    /// The offloaded pages (tests, stats).
    pub fn pages(&self) -> &SessionPages {
        &self.pages
    }

    /// The mirror (tests).
    pub fn mirror(&self) -> &ModelState {
        &self.mirror
    }

    pub(super) fn cfg(&self) -> &ModelConfig {
        self.model.config()
    }

    fn dtype(&self) -> KvDtype {
        self.spec.kv.dtype
    }

    /// Bytes of KV rows for `rows` more positions plus the transient f32 copy of one layer's rows, checked.
    fn growth(&self, rows: usize) -> Result<u64, Fault> {
        let c = self.cfg();
        let kv = wire::payload_len(c, self.spec.range.clone(), rows, self.dtype(), false);
        let tmp = wire::layer_rows_f32_bytes(c, rows);
        kv.zip(tmp)
            .and_then(|(a, b)| a.checked_add(b))
            .and_then(|b| u64::try_from(b).ok())
            .ok_or_else(|| Fault::new(ErrorCode::Malformed, format!("{rows} rows overflow a size")))
    }

    fn reserve_growth(&mut self, rows: usize) -> Result<(), Fault> {
        self.reserve_growth_plus(rows, 0)
    }

    /// Reserves the mirror's growth by `rows` positions and `extra` bytes more (what a verify keeps).
    fn reserve_growth_plus(&mut self, rows: usize, extra: u64) -> Result<(), Fault> {
        let want = self
            .mirror_bytes()
            .saturating_add(self.growth(rows)?)
            .saturating_add(extra);
        Ok(self.held.resize_with(want, self.room.as_ref())?)
    }

    /// The mirror's bytes and what its verify steps keep for rollbacks.
    fn mirror_bytes(&self) -> u64 {
        (self.mirror.bytes() as u64).saturating_add(self.mirror.verify_bytes() as u64)
    }

    fn settle(&mut self) {
        // shrinking never fails
        let _ = self.held.resize(self.mirror_bytes());
    }

    fn check_positions(&self, end: u64) -> Result<(), Fault> {
        if end > self.spec.max_positions as u64 {
            return Err(bad(format!(
                "position {end} is past the session's context of {} positions",
                self.spec.max_positions
            )));
        }
        Ok(())
    }

    /// Handles one request. `arrived` is when it had been read completely (for the pipeline bubble). Errors: a
    /// [`Fault`] to send back; the session ends after it (its mirror may be partly changed).
    pub fn handle(
        &mut self,
        req: Request,
        arrived: Instant,
        pool: &ComputePool,
    ) -> Result<Reply, Fault> {
        if self.experts.is_some() && !matches!(req, Request::Ping(_) | Request::Experts(..)) {
            return Err(Fault::new(
                ErrorCode::BadState,
                "an experts session answers only Experts and Ping",
            ));
        }
        match req {
            Request::Ping(p) => Ok(Reply::Pong(p)),
            Request::Reset => {
                self.mirror.clear();
                self.checkpoints.clear();
                self.settle();
                Ok(Reply::ResetDone)
            }
            Request::Rewind(r) => self.rewind(r, pool),
            Request::Experts(e, bytes) => self.experts(e, &bytes, pool),
            Request::Sync(s, payload) => self.sync(s, &payload),
            Request::RunLayers(r, x) => self.run_layers(r, &x, arrived, pool),
            Request::Fetch(f) => self.fetch(f),
            Request::PagesPut(p, bytes) => {
                let lim = page_limits(&self.model, &self.spec, &self.attn_layers);
                let before = self.pages.pages();
                let r = page_requests::put(&mut self.pages, &lim, &self.budget, p, &bytes);
                self.page_stats.puts += (self.pages.pages() - before) as u64;
                r
            }
            Request::PagesDrop(d) => {
                let lim = page_limits(&self.model, &self.spec, &self.attn_layers);
                page_requests::drop_to(&mut self.pages, &lim, d)
            }
            Request::Attend(a, q) => {
                let lim = page_limits(&self.model, &self.spec, &self.attn_layers);
                let r = page_requests::attend(&self.pages, &lim, &self.budget, a, &q);
                if let Ok(Reply::Partials(p, ..)) = &r {
                    self.page_stats.attends += 1;
                    self.page_stats.attend_us += p.compute_us;
                }
                r
            }
        }
    }

    fn run_layers(
        &mut self,
        r: RunLayers,
        x: &[u8],
        arrived: Instant,
        pool: &ComputePool,
    ) -> Result<Reply, Fault> {
        let t = size(u64::from(r.n_tokens), "n_tokens")?;
        let hidden = self.cfg().hidden_size;
        // an open verify step: the host kept the positions before `r.pos`
        self.keep_verified_to(r.pos, pool)?;
        let pos = self.mirror.n_tokens();
        let want = t.checked_mul(hidden).and_then(|v| v.checked_mul(4));
        if r.pos != pos as u64 || t == 0 || t > self.spec.ubatch || want != Some(x.len()) {
            return Err(bad(format!(
                "RunLayers at {} for {t} tokens with {} bytes does not fit a mirror at {pos} (ubatch {}, hidden {hidden})",
                r.pos, x.len(), self.spec.ubatch
            )));
        }
        self.check_positions(r.pos + u64::from(r.n_tokens))?;
        let keep = keep_positions(&r)?;
        let verify_keep = self.check_verify(&r, t)?;
        self.reserve_growth_plus(t, verify_keep)?;
        // a layer-split reply: the residual and its sealed copy in the frame buffer
        let reply_bytes = if self.spec.layer_split { x.len() } else { 0 };
        let hold = self.budget.reserve_with(
            (reply_bytes as u64).saturating_mul(2),
            "a RunLayers reply",
            self.room.as_ref(),
        )?;
        let idle = arrived.saturating_duration_since(self.last_done);
        let mut x = bytes_f32(x).map_err(|e| Fault::new(ErrorCode::Malformed, e.to_string()))?;
        let t0 = Instant::now();
        let (model, range, mirror) = (&self.model, self.spec.range.clone(), &mut self.mirror);
        if !keep.is_empty() {
            mirror.request_checkpoints(&keep);
        }
        let verify = r.verify;
        pool.install(|| {
            use backburner_kernels::profile::{set_phase, Phase};
            if verify {
                set_phase(Phase::Decode);
                return model.forward_layers_verify(range, &mut x, t, mirror);
            }
            set_phase(Phase::Prefill);
            model.forward_layers(range, &mut x, t, mirror);
            Ok(())
        })
        .map_err(|e| Fault::new(ErrorCode::BadState, format!("verify step: {e}")))?;
        self.model.commit_tokens(&mut self.mirror, t);
        if !keep.is_empty() {
            let got = self.mirror.take_checkpoints();
            self.checkpoints.keep(got, &self.budget);
        }
        self.settle();
        let compute = t0.elapsed();
        self.last_done = Instant::now();
        let out = if self.spec.layer_split {
            backburner_link::frame::f32_bytes(&x)
        } else {
            Vec::new()
        };
        let done = LayersDone {
            pos_after: self.mirror.n_tokens() as u64,
            compute_us: u64::try_from(compute.as_micros()).unwrap_or(u64::MAX),
            idle_us: u64::try_from(idle.as_micros()).unwrap_or(u64::MAX),
        };
        Ok(Reply::LayersDone(done, out, hold))
    }

    /// Goes back to `to_pos` from the checkpoint kept there (or stays, when the mirror is there). Errors: a
    /// `BadState` fault for a position past the mirror's.
    fn rewind(&mut self, r: Rewind, pool: &ComputePool) -> Result<Reply, Fault> {
        let pos = self.mirror.n_tokens();
        if r.to_pos > pos as u64 {
            return Err(bad(format!(
                "Rewind to {} is past the mirror's position {pos}",
                r.to_pos
            )));
        }
        // the state manager's one way back: a checkpoint kept there, else the open verify step's rollback
        let to = size(r.to_pos, "to_pos")?;
        let kept: Vec<_> = self.checkpoints.at(to).into_iter().collect();
        let mirror = &mut self.mirror;
        let restored = match pool.install(|| mirror.go_back(to, &kept)) {
            Ok(_) => true,
            Err(BackError::NotKept { .. }) => false,
            Err(e) => {
                return Err(Fault::new(
                    ErrorCode::BadState,
                    format!("Rewind to {to}: {e}"),
                ))
            }
        };
        if restored {
            self.checkpoints.truncate(to);
            self.settle();
        }
        let done = RewindDone {
            pos: self.mirror.n_tokens() as u64,
            restored,
        };
        Ok(Reply::RewindDone(done))
    }
}
