//! A session: one sequence's token history and model state, with prefill in ubatches and decode.

use std::sync::Arc;

use backburner_kernels::profile::{self, Phase};
use backburner_model::{KvOptions, Model, ModelState, StateSnapshot};

use crate::compute::ComputePool;
use crate::error::{EngineError, Result};
use crate::grid::Grid;
use crate::history::History;
use crate::offload::{KvBudget, Placement, Workers};
use crate::split::{LinkStats, WorkerClient};
use crate::step_plan::{Executor, StepKind};

/// Session settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SessionOptions {
    /// Tokens per ubatch in prefill (default 512).
    pub ubatch: usize,
    /// KV cache page size and dtype.
    pub kv: KvOptions,
    /// Context length in tokens (default: the model's `max_position_embeddings`).
    pub context_length: Option<usize>,
    /// The threads the forward pass runs on (default: [`ComputePool::shared_default`], one per core).
    pub pool: ComputePool,
    /// Most KV cache the host holds (`--kv-budget`); past it the oldest pages move to the workers (KV offload).
    /// `None` = unlimited.
    pub kv_budget: Option<KvBudget>,
    /// With pages on workers, run each prefill ubatch of at least 128 tokens as two halves interleaved, so the host
    /// computes one half's layers while the workers attend for the other (same bits; default on).
    pub interleave: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            ubatch: 512,
            kv: KvOptions::default(),
            context_length: None,
            pool: ComputePool::shared_default(),
            kv_budget: None,
            interleave: true,
        }
    }
}

/// Which logits a prefill returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last token's `[vocab]`.
    Last,
    /// Every token's, `[n_tokens, vocab]` (perplexity, tests).
    All,
}

/// One sequence: its tokens, its model state, the options it runs with, and optionally workers for split prefill
/// (the first) and KV offload (all, in order).
#[derive(Debug)]
pub struct Session {
    pub(crate) model: Arc<Model>,
    pub(crate) state: ModelState,
    /// The token history and how it was computed. While `rebuild` is set the state is empty and these wait to be
    /// re-ingested (replaying the same calls: [`History::calls`]).
    pub(crate) history: History,
    /// Positions at which prefills keep exact checkpoints ([`Session::keep_checkpoints_at`]).
    pub(crate) marks: Vec<usize>,
    /// Checkpoints taken at `marks` and not yet collected.
    pub(crate) taken: Vec<StateSnapshot>,
    pub(crate) opts: SessionOptions,
    pub(crate) workers: Workers,
    /// Where the offloaded pages live.
    pub(crate) placement: Placement,
    /// The state was lost (a worker holding pages failed): the next prefill first re-ingests `tokens`.
    pub(crate) rebuild: bool,
    /// Offload counters kept by the session (the workers keep their own link counters).
    pub(crate) offload_stats: LinkStats,
    /// Layer split: the workers holding the layers past the host's (`None`: the host holds every layer).
    pub(crate) chain: Option<crate::chain::LayerSplit>,
    /// KV offload: the current request already waited once for a worker's backoff ([`Session::worker_wait`]).
    pub(crate) backoff_waited: bool,
    /// A verify step run and not yet settled ([`Session::verify`], [`Session::keep_verified`]).
    pub(crate) open_verify: Option<crate::session_verify::OpenVerify>,
    /// The MTP block's state, when it drafts for this session ([`Session::enable_mtp`]).
    pub(crate) mtp: Option<crate::session_mtp::MtpRun>,
    /// The open verify step's ids and hidden rows, for the MTP block.
    pub(crate) verify_rows: crate::session_verify::VerifyRows,
}

impl Session {
    /// A new empty session on `model` (which must hold every layer and its ends).
    ///
    /// Errors: [`EngineError::InvalidSetting`] for ubatch or page size 0, a KV dtype the model's attention rows do
    /// not fit ([`KvOptions::check`]: bf16 with an odd `head_dim`), or a model that does not hold every layer and the
    /// embedding and head.
    pub fn new(model: Arc<Model>, opts: SessionOptions) -> Result<Self> {
        let n = model.config().num_hidden_layers;
        Self::assemble(model, opts, n)
    }

    /// A session on `model`, which must hold layers `[0, held)` and the embedding and head.
    pub(crate) fn assemble(model: Arc<Model>, opts: SessionOptions, held: usize) -> Result<Self> {
        if model.layer_range() != (0..held) || !model.holds_ends() {
            return Err(EngineError::InvalidSetting(format!(
                "this session needs layers 0..{held} and the embedding and head; the model holds layers {:?}{}",
                model.layer_range(),
                if model.holds_ends() { "" } else { " without the ends" }
            )));
        }
        if opts.ubatch == 0 {
            return Err(EngineError::InvalidSetting("ubatch must be ≥ 1".into()));
        }
        if opts.kv.page_size == 0 {
            return Err(EngineError::InvalidSetting(
                "KV page size must be ≥ 1".into(),
            ));
        }
        let cfg = model.config();
        opts.kv.check(cfg).map_err(EngineError::InvalidSetting)?;
        let state = ModelState::new(cfg, 0..held, opts.kv);
        Ok(Session {
            model,
            state,
            history: History::default(),
            marks: Vec::new(),
            taken: Vec::new(),
            opts,
            workers: Default::default(),
            placement: Placement::default(),
            rebuild: false,
            offload_stats: LinkStats::default(),
            chain: None,
            backoff_waited: false,
            open_verify: None,
            mtp: None,
            verify_rows: Default::default(),
        })
    }

    /// Attaches a worker (call again for more, in order). The first runs split prefill: prefills of at least its
    /// `split_min_tokens` (and more than one ubatch) that ask only for the last logits run split while no page is
    /// offloaded; everything else, and any call where the worker fails, runs locally with the same result. With a
    /// KV budget every worker may take pages (KV offload), the first ones the oldest.
    pub fn attach_worker(&mut self, mut w: WorkerClient) {
        w.set_model(self.model.config());
        self.lock_workers().push(w);
    }

    /// The attached workers (locked for the caller; do not hold the guard across a call to the session).
    pub fn workers(&self) -> std::sync::MutexGuard<'_, Vec<WorkerClient>> {
        self.lock_workers()
    }

    pub(crate) fn lock_workers(&self) -> std::sync::MutexGuard<'_, Vec<WorkerClient>> {
        self.workers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Where the pages held by workers live (KV offload).
    pub fn placement(&self) -> &crate::offload::Placement {
        &self.placement
    }

    /// Link statistics summed over the workers, with the session's offload counters (zeros without a worker).
    pub fn link_stats(&self) -> LinkStats {
        let mut s = self.offload_stats.clone();
        for w in self.lock_workers().iter() {
            s.add(&w.stats());
        }
        if let Some(c) = &self.chain {
            s.add(&c.link_stats());
        }
        let ps = self.opts.kv.page_size.max(1);
        let n_attn = crate::offload::attention_layers(self.model.config()).len();
        s.positions_on_workers = self.placement.end() as u64;
        s.pages_on_workers = (self.placement.end() / ps * n_attn) as u64;
        s
    }

    /// The model.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Tokens processed so far.
    pub fn tokens(&self) -> &[u32] {
        self.history.tokens()
    }

    /// The token history with how each position was computed (prefill calls or decode steps).
    pub fn history(&self) -> &History {
        &self.history
    }

    /// The prefill grid: where ubatches end and where a prefill may resume with the same bits ([`crate::grid`]).
    pub fn grid(&self) -> Grid {
        Grid::new(self.opts.ubatch)
    }

    /// The model state.
    pub fn state(&self) -> &ModelState {
        &self.state
    }

    /// The options.
    pub fn options(&self) -> &SessionOptions {
        &self.opts
    }

    /// Context length in tokens.
    pub fn context_length(&self) -> usize {
        self.opts
            .context_length
            .unwrap_or(self.model.config().max_position_embeddings)
    }

    /// Checks that `add` more tokens fit. Errors: [`EngineError::ContextOverflow`].
    pub fn check_fits(&self, add: usize) -> Result<()> {
        let limit = self.context_length();
        if self.history.len() + add > limit {
            return Err(EngineError::ContextOverflow {
                have: self.history.len(),
                add,
                limit,
            });
        }
        Ok(())
    }

    /// Runs `ids` through the model in ubatches that end at absolute multiples of `ubatch` ([`Grid::ubatches`]),
    /// appending them to the session, and returns the logits per `which` (`[vocab]` or `[ids.len(), vocab]`, f32).
    /// `progress(done, total)` is called after each ubatch. A call of one token is a decode step.
    ///
    /// Every input is checked before the state changes, and the local forward pass cannot fail after that, so an
    /// error leaves the session as it was. A split prefill that fails on the worker's side is undone (from a
    /// snapshot taken only for split calls) and rerun locally.
    ///
    /// Errors: [`EngineError::EmptyPrompt`], [`EngineError::ContextOverflow`], [`EngineError::Model`] for a token
    /// id outside the vocabulary.
    pub fn prefill(
        &mut self,
        ids: &[u32],
        which: Logits,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        self.settle_verify();
        self.check_fits(ids.len())?;
        self.model.check_ids(ids)?;
        let plan = self.plan_step(ids.len(), StepKind::Prefill, which);
        match plan.executor {
            Executor::LayerSplit => return self.prefill_chain(ids, which, &mut progress),
            Executor::RemoteExperts => return self.prefill_with_experts(ids, which, &mut progress),
            Executor::KvOffload => return self.prefill_budgeted(ids, which, &mut progress),
            Executor::SplitPrefill | Executor::Local => {}
        }
        if plan.executor == Executor::SplitPrefill {
            let workers = self.workers.clone();
            let mut ws = workers.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(w) = ws.first_mut() {
                if w.wants(ids.len(), self.opts.ubatch) {
                    let snap = self.state.snapshot();
                    let grid = self.grid();
                    let capture = self.capture_begin(ids.len());
                    match w.prefill(
                        &self.model,
                        &mut self.state,
                        ids,
                        grid,
                        &self.opts.pool,
                        &mut progress,
                    ) {
                        Ok(logits) => {
                            let pos = self.history.len();
                            for r in grid.ubatches(pos, ids.len()) {
                                self.history
                                    .push_call(&ids[r.start - pos..r.end - pos], grid);
                            }
                            self.capture_end(capture);
                            return Ok(logits);
                        }
                        Err(e) => {
                            // Undo whatever the split call changed, then run the batch here.
                            self.capture_discard(capture);
                            self.state.restore(&snap);
                            w.fail(&e);
                        }
                    }
                }
            }
        }
        Ok(self.prefill_local(ids, which, &mut progress))
    }

    /// The local forward pass over validated ids (in range, fitting the context).
    fn prefill_local(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut impl FnMut(usize, usize),
    ) -> Vec<f32> {
        profile::set_phase(if ids.len() == 1 {
            Phase::Decode
        } else {
            Phase::Prefill
        });
        let vocab = self.model.config().vocab_size;
        let pos = self.history.len();
        let mut out = Vec::new();
        for r in self.grid().ubatches(pos, ids.len()) {
            let chunk = &ids[r.start - pos..r.end - pos];
            let (t, done) = (chunk.len(), r.end - pos);
            let want = match which {
                Logits::All => Some(0..t),
                Logits::Last if done == ids.len() => Some(t - 1..t),
                Logits::Last => None,
            };
            let capture = self.capture_begin(t);
            let (model, state) = (&self.model, &mut self.state);
            let logits = if self.mtp.is_some() {
                // the MTP block takes every position's hidden row
                let p0 = self.history.len();
                let (logits, hidden) = self
                    .opts
                    .pool
                    .install(|| model.forward_tokens_hidden(chunk, state, want));
                self.mtp_feed(p0, chunk, &hidden);
                logits
            } else {
                self.opts
                    .pool
                    .install(|| model.forward_tokens(chunk, state, want))
            };
            out.extend(logits);
            self.history.push_call(chunk, self.grid());
            self.capture_end(capture);
            progress(done, ids.len());
        }
        debug_assert!(out.len() == vocab || out.len() == vocab * ids.len());
        out
    }

    /// Whether the whole state is on this host (no KV page on a worker or due to move there, no layer split, no
    /// pending rebuild), so a decode step may run batched with other sessions ([`crate::serve::decode_batch`]).
    pub fn batchable(&self) -> bool {
        self.chain.is_none() && !self.offload_needed(1)
    }

    /// Runs one token (decode) and returns its logits `[vocab]`.
    pub fn decode(&mut self, id: u32) -> Result<Vec<f32>> {
        self.prefill(&[id], Logits::Last, |_, _| {})
    }

    /// Runs `f(self)` on one of the session's compute threads, with the pool's other threads kept awake
    /// ([`ComputePool::install_hot`]), and returns its result; every [`Session::prefill`] or [`Session::decode`]
    /// inside then starts its work there directly. Called from outside the pool, each of those hands its work to a
    /// compute thread and sleeps until it is done: two thread wake-ups per call, about 0.3 ms per decode token
    /// (3–4 %) on a 2-vCPU VM at one thread, so a token loop belongs inside `in_pool`.
    ///
    /// `f` must not wait for another thread that runs work on the same pool (the session's own link threads do
    /// not). Results, errors and bits are those of calling `f(self)` directly.
    pub fn in_pool<R: Send>(&mut self, f: impl FnOnce(&mut Session) -> R + Send) -> R {
        let pool = self.opts.pool.clone();
        pool.install_hot(|| f(self))
    }

    /// Benchmarks only: appends `n` positions of synthetic K and V rows (uniform in `[-1, 1)` from `seed`) to every
    /// full-attention layer as if `n` tokens (id 0) had been processed, to decode at a depth without prefilling it;
    /// the linear layers' states stay as they are. Decode time at a depth depends on the number of rows, not their
    /// values; what the model outputs afterwards is meaningless. The KV budget is applied at the next step.
    ///
    /// Errors: [`EngineError::ContextOverflow`]; [`EngineError::InvalidSetting`] while a rebuild is pending.
    pub fn fill_synthetic(&mut self, n: usize, seed: u64) -> Result<()> {
        use rand::{Rng, SeedableRng};
        self.check_fits(n)?;
        if self.chain.is_some() {
            return Err(EngineError::InvalidSetting(
                "synthetic rows need every attention layer on the host (not a layer split)".into(),
            ));
        }
        if self.rebuild {
            return Err(EngineError::InvalidSetting(
                "the session's state is being rebuilt".into(),
            ));
        }
        let cfg = self.model.config().clone();
        let width = cfg.num_key_value_heads * cfg.head_dim;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let chunk = 1024;
        for l in crate::offload::attention_layers(&cfg) {
            let mut left = n;
            while left > 0 {
                let m = left.min(chunk);
                let k: Vec<f32> = (0..m * width)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let v: Vec<f32> = (0..m * width)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                self.state.append_kv_rows(l, &k, &v, m);
                left -= m;
            }
        }
        let end = self.state.n_tokens() + n;
        self.state.set_position(end);
        // as decode steps: no exact resume point inside
        for _ in 0..n {
            self.history.push_call(&[0], self.grid());
        }
        Ok(())
    }

    /// A restorable point (see [`Session::rewind`]).
    pub fn snapshot(&self) -> StateSnapshot {
        self.state.snapshot()
    }

    /// Goes back to a snapshot of this session (drops the tokens after it). Regenerating a reply rewinds to the
    /// snapshot taken after the prompt. Returns true when the state was restored in place; false when it was
    /// dropped instead and the next prefill re-ingests the tokens kept (replaying their calls, so with the same
    /// bits): going back below the positions held by workers (KV offload) elsewhere than at a page boundary, or a
    /// layer split whose workers do not all hold a checkpoint at the snapshot's position.
    pub fn rewind(&mut self, snap: &StateSnapshot) -> bool {
        self.settle_verify();
        let n = snap.n_tokens();
        self.taken.retain(|c| c.n_tokens() <= n);
        let from = self.history.len();
        let in_place = if self.rebuild {
            false
        } else if let Some(c) = self.chain.as_mut() {
            c.rewind(from, n)
        } else {
            n >= self.state.offloaded() || self.rewind_into_offload(snap)
        };
        if in_place {
            // the state manager's one way back: here the checkpoint
            let state = &mut self.state;
            self.opts
                .pool
                .install(|| state.go_back(n, &[snap]))
                .expect("a snapshot of this session at or below its position");
            self.history.truncate(n);
        } else {
            self.history.truncate(n);
            self.drop_state_for_rebuild();
            if let Some(c) = &mut self.chain {
                c.reset();
            }
        }
        for w in self.lock_workers().iter_mut() {
            w.on_truncate(n);
        }
        self.mtp_jump();
        in_place
    }

    /// Whether [`Session::rewind`] to a checkpoint at position `n` would restore the state in place (as far as the
    /// host can tell: a layer split's workers may have dropped the checkpoint for memory, which `rewind` then finds).
    pub fn rewinds_in_place(&self, n: usize) -> bool {
        let ps = self.opts.kv.page_size;
        !self.rebuild
            && n <= self.history.len()
            && self
                .chain
                .as_ref()
                .is_none_or(|c| c.in_step(self.history.len()))
            && (n >= self.state.offloaded() || n.is_multiple_of(ps))
    }

    /// Forgets every token (and the pages on workers).
    pub fn clear(&mut self) {
        self.open_verify = None;
        self.mtp_clear();
        self.drop_state_for_rebuild();
        self.rebuild = false;
        self.history.clear();
        self.taken.clear();
        if let Some(c) = &mut self.chain {
            c.reset();
        }
        for w in self.lock_workers().iter_mut() {
            w.on_truncate(0);
        }
    }
}
