//! Opening a session: one request (the model, the memory limit, the session's settings, the workers and any
//! placement the user fixed) in, a loaded host and ready sessions out, or a typed refusal ([`OpenError`]).
//!
//! What [`load`] decides, in order:
//! 1. **The placement.** For a run ([`SessionRequest::run`]) with workers, a host memory limit and no explicit
//!    placement, the planner ([`crate::plan::plan`]) chooses the mode (split prefill, KV offload, layer split,
//!    experts on workers) and the split points for the positions the run reaches; otherwise the request's
//!    placement stands as given.
//! 2. **The checks that need no weights:** KV dtype, layer-split points, expert splits and ids, split-prefill layer,
//!    workers given twice, KV page sizes the workers can hold.
//! 3. **The weights** of the host's share (layers `[0, L1)` with a layer split, every layer less the experts on
//!    workers with an expert split), after checking that they fit the memory limits; then the experts' workers
//!    are connected (a refusal comes before anything runs).
//!
//! [`Host::session`] then builds a session on the loaded model (for a run, after checking that its KV cache,
//! states and buffers fit beside the weights): one per server slot, each with its own workers' connections.

mod checks;
mod error;
mod load;
mod plan;
#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use backburner_model::device::LayerPlacement;
use backburner_model::{Model, ModelConfig};

pub use checks::{
    check_split_layer, experts_away, is_away, layer_ranges, parse_expert_ids, worker_settings, Away,
};
pub use error::OpenError;
pub use load::{load_weights, load_weights_placed};

use crate::connection::{Connection, SessionShape};
use crate::experts::LinkExperts;
use crate::memory::{self, MemoryNeed};
use crate::plan::Plan;
use crate::session::{Session, SessionOptions};
use crate::split::{WorkerClient, WorkerSettings};

/// What a one-shot run reaches: the planner places for it, and the session's memory is checked for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunNeed {
    /// Prompt tokens plus tokens to generate (saturating).
    pub positions: usize,
    /// Tokens of the largest prefill ubatch (at most the prompt; at least 1).
    pub ubatch: usize,
}

/// The workers and how to reach them (`--worker`, `--worker-memory`, `--secret-file`, `--worker-timeout`,
/// `--split-min-tokens`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Workers {
    /// `host:port` of each worker, in chain order (the first runs split prefill; with KV offload the first ones
    /// hold the oldest pages).
    pub addrs: Vec<String>,
    /// Bytes each worker may use, for the planner, in `addrs` order; empty = unknown (a worker then refuses what
    /// its own limit cannot hold). Given, it must have one entry per worker.
    pub memory: Vec<u64>,
    /// Shared secret of the link (empty = none).
    pub secret: Vec<u8>,
    /// Base of every deadline per worker request (at least 1 s is used).
    pub timeout: Duration,
    /// Smallest prompt (tokens) that split prefill sends through the worker.
    pub split_min_tokens: usize,
}

impl Workers {
    /// Keeps the workers at indices `keep` (ascending), with their memory when given.
    fn keep(&mut self, keep: &[usize]) {
        let given = self.memory.len() == self.addrs.len();
        self.addrs = keep.iter().map(|&i| self.addrs[i].clone()).collect();
        if given {
            self.memory = keep.iter().map(|&i| self.memory[i]).collect();
        }
    }
}

/// A placement the user fixed (`--split-layer`, `--layer-split`, `--expert-split`, `--expert-ids`; the KV budget
/// is [`SessionOptions::kv_budget`]). All empty: for the planner to decide when it can, else every layer on the
/// host with the workers (if any) running split prefill.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlacementFlags {
    /// Split prefill: the first layer the first worker mirrors (a multiple of the layer cycle); `None` balances
    /// the two sides' threads.
    pub split_layer: Option<usize>,
    /// Layer split: the first layer each worker holds, in worker order (`L1 < L2 < …`, one per worker); the host
    /// holds the ends and `[0, L1)`.
    pub layer_split: Vec<usize>,
    /// Experts on workers: the first layer whose routed experts each worker holds, in worker order.
    pub expert_split: Vec<usize>,
    /// With `expert_split`: the expert ids on the workers (`0-63,100`, see [`parse_expert_ids`]); `None` = all.
    pub expert_ids: Option<String>,
}

impl PlacementFlags {
    /// Whether the user fixed a mode (not counting a KV budget).
    fn is_explicit(&self) -> bool {
        !self.layer_split.is_empty() || !self.expert_split.is_empty() || self.split_layer.is_some()
    }
}

/// Everything a session is opened from.
#[derive(Clone, Debug)]
pub struct SessionRequest {
    /// The checkpoint directory or GGUF file.
    pub dir: PathBuf,
    /// Its config as it is to be loaded (precision set, the MTP block's layers set to 0 when it stays on disk).
    pub config: ModelConfig,
    /// Most bytes the host may allocate for weights, KV, states and buffers (`--max-memory`); the OS's limits are
    /// checked whether or not it is given.
    pub max_memory: Option<u64>,
    /// The sessions' settings: ubatch, KV page size and dtype, context limit (`None` = the model's), compute pool,
    /// host KV budget (`--kv-budget`: KV offload to the workers), interleaving.
    pub options: SessionOptions,
    /// The workers (none: local).
    pub workers: Workers,
    /// The placement the user fixed.
    pub placement: PlacementFlags,
    /// A one-shot run's reach: enables the planner and the session memory check. `None` (a server, a chat): the
    /// placement is as given and sessions are not checked against the memory limits beyond the weights.
    pub run: Option<RunNeed>,
}

/// Hears what [`load`] decides and does, for a command line to print (every method defaults to nothing).
pub trait OpenObserver: Send {
    /// The planner chose `plan` (before anything loads).
    fn planned(&mut self, _plan: &Plan) {}
    /// `done` of `total` layers are loaded.
    fn loading(&mut self, _done: usize, _total: usize) {}
    /// Something works, but not as asked or not safely (a worker off this machine without a secret; workers
    /// ignored for a page size they cannot hold).
    fn warning(&mut self, _message: &str) {}
}

/// An observer that hears nothing.
impl OpenObserver for () {}

/// How the host's workers take part in each session.
#[derive(Clone, Debug)]
enum Parts {
    /// No workers (or none that can hold this page size).
    Local,
    /// Split prefill and KV offload: a client per worker.
    Clients(Vec<WorkerSettings>),
    /// Layer split: a chain stage per worker with its layer range.
    Chain(Vec<(WorkerSettings, std::ops::Range<usize>)>),
    /// Experts on workers: attached to the model, nothing per session.
    Experts,
}

/// The loaded host: its model, the plan it carries out and the holders of its experts; sessions come from
/// [`Host::session`].
pub struct Host {
    /// The model (the host's layers and the ends).
    pub model: Arc<Model>,
    /// The planner's placement, when it decided.
    pub plan: Option<Plan>,
    /// The workers holding routed experts (expert split).
    pub experts: Option<Arc<LinkExperts>>,
    /// The request as carried out (the plan's placement written in).
    pub request: SessionRequest,
    parts: Parts,
}

/// Plans (for a run), checks and loads what `req` asks: see the module docs. `obs` hears the plan, the loading and
/// any warnings. Errors: every [`OpenError`] but [`OpenError::Engine`] and the session memory checks.
pub fn load(req: SessionRequest, obs: &mut dyn OpenObserver) -> Result<Host, OpenError> {
    load_placed(req, None, obs)
}

/// As [`load`], placing the layers of `place` on its device as they load ([`load_weights_placed`]: the host never
/// holds their weights). Errors: as [`load`]; [`OpenError::DeviceWithSplit`] if the placement (the flags' or the
/// plan's) splits the layers or the experts across workers; the device's refusals as [`OpenError::Model`].
pub fn load_placed(
    mut req: SessionRequest,
    place: Option<LayerPlacement>,
    obs: &mut dyn OpenObserver,
) -> Result<Host, OpenError> {
    req.options
        .kv
        .check(&req.config)
        .map_err(OpenError::KvDtype)?;
    let plan = match req.run {
        Some(need) => plan::plan_for_run(&mut req, need)?,
        None => None,
    };
    if let Some(p) = &plan {
        obs.planned(p);
    }
    let held = req.placement.layer_split.first().copied();
    let n_workers = req.workers.addrs.len();
    let flags = &req.placement;
    let away = experts_away(
        &flags.expert_split,
        flags.expert_ids.as_deref(),
        n_workers,
        &req.config,
    )?;
    if let Some(p) = place
        .as_ref()
        .filter(|_| held.is_some() || !away.is_empty())
    {
        return Err(OpenError::DeviceWithSplit {
            device: p.backend.info().id,
        });
    }
    let pool = req.options.pool.clone();
    let model = pool.install(|| {
        load_weights_placed(
            &req.dir,
            req.config.clone(),
            held,
            &away,
            place.as_ref(),
            req.max_memory,
            obs,
        )
    })?;
    let (parts, experts) = worker_parts(&req, &model, &away, obs)?;
    Ok(Host {
        model,
        plan,
        experts,
        request: req,
        parts,
    })
}

/// How the workers of `req` take part, for the loaded `model`: the experts' holders connected and attached (expert
/// split), the chain's stages (layer split), or a client per worker (split prefill, KV offload), after the checks of
/// each mode. Errors: as [`load`]'s for these checks.
fn worker_parts(
    req: &SessionRequest,
    model: &Model,
    away: &[(std::ops::Range<usize>, Vec<usize>)],
    obs: &mut dyn OpenObserver,
) -> Result<(Parts, Option<Arc<LinkExperts>>), OpenError> {
    let n_workers = req.workers.addrs.len();
    if n_workers == 0 {
        return Ok((Parts::Local, None));
    }
    let threads = req.options.pool.threads();
    let flags = &req.placement;
    if !away.is_empty() {
        let settings = worker_settings(&req.workers, flags.split_layer, threads, obs)?;
        let shape = SessionShape {
            kv: req.options.kv.dtype,
            page: req.options.kv.page_size,
            ubatch: req.options.ubatch,
        };
        let rx = load::attach_experts(&req.dir, model, away, settings, shape)?;
        return Ok((Parts::Experts, rx));
    }
    if !flags.layer_split.is_empty() {
        let n = model.config().num_hidden_layers;
        let ranges = layer_ranges(&flags.layer_split, n_workers, n)?;
        let settings = worker_settings(&req.workers, flags.split_layer, threads, obs)?;
        return Ok((
            Parts::Chain(settings.into_iter().zip(ranges).collect()),
            None,
        ));
    }
    check_split_layer(model.config(), flags.split_layer)?;
    let settings = worker_settings(&req.workers, flags.split_layer, threads, obs)?;
    Ok(match workers_take_pages(req, obs)? {
        true => (Parts::Clients(settings), None),
        false => (Parts::Local, None),
    })
}

/// Whether the workers of split prefill and KV offload can take pages of the request's page size (a worker's pages
/// are whole 64-position blocks). Otherwise: with a KV budget [`OpenError::PageSize`] (the budget needs the
/// workers); without, a warning and `false` (the prompt runs on this host alone instead of connecting, being refused
/// and counting a fallback on every request).
fn workers_take_pages(req: &SessionRequest, obs: &mut dyn OpenObserver) -> Result<bool, OpenError> {
    let page_size = req.options.kv.page_size;
    if page_size.is_multiple_of(64) {
        return Ok(true);
    }
    if req.options.kv_budget.is_some() {
        return Err(OpenError::PageSize { page_size });
    }
    obs.warning(&format!(
        "--kv-page-size {page_size} is not a multiple of 64, which workers require: the prompt runs on this host \
         alone (--worker is ignored)"
    ));
    Ok(false)
}

/// [`load`], then the first session ([`Host::session`]).
pub fn open(req: SessionRequest, obs: &mut dyn OpenObserver) -> Result<(Host, Session), OpenError> {
    let host = load(req, obs)?;
    let session = host.session()?;
    Ok((host, session))
}

impl Host {
    /// A new session on the host's model with its own connections to the workers (split prefill and KV offload:
    /// a client per worker; layer split: a chain); the workers connect on the first prefill. For a run, first
    /// checks that the KV cache of the positions it reaches, the recurrent states and the buffers fit beside the
    /// weights. The context is the request's limit, within what the plan holds.
    ///
    /// Errors: [`OpenError::Memory`] naming what does not fit, [`OpenError::Overflow`], [`OpenError::Engine`] for
    /// settings the session refuses.
    pub fn session(&self) -> Result<Session, OpenError> {
        let req = &self.request;
        if let Some(need) = req.run {
            self.check_session_memory(need)?;
        }
        let mut opts = req.options.clone();
        if let Some(p) = &self.plan {
            // the plan's memory holds this much context
            opts.context_length = Some(opts.context_length.unwrap_or(usize::MAX).min(p.max_ctx));
        }
        let precision = self.model.config().precision;
        let fp = || crate::split::dir_fingerprint_with(req.dir.clone(), precision);
        Ok(match &self.parts {
            Parts::Chain(stages) => {
                let parts = stages
                    .iter()
                    .map(|(st, r)| (Connection::new(st.clone(), fp()), r.clone()))
                    .collect();
                let chain = crate::chain::LayerSplit::from_parts(self.model.config(), parts)?;
                Session::with_layer_split(self.model.clone(), opts, chain)?
            }
            Parts::Clients(settings) => {
                let mut s = Session::new(self.model.clone(), opts)?;
                for st in settings {
                    s.attach_worker(WorkerClient::new(st.clone(), fp()));
                }
                s
            }
            Parts::Local | Parts::Experts => Session::new(self.model.clone(), opts)?,
        })
    }

    /// Checks, before a run's session allocates anything, that the KV cache of the positions it can reach (within
    /// the context and, with workers, the KV budget), the recurrent states and the forward pass's buffers (an
    /// estimate) fit the memory limit beside the loaded weights, and fit the OS's limits now.
    fn check_session_memory(&self, need: RunNeed) -> Result<(), OpenError> {
        let req = &self.request;
        let cfg = self.model.config();
        let kv = req.options.kv;
        let ctx = req
            .options
            .context_length
            .unwrap_or(cfg.max_position_embeddings);
        let mut positions = need.positions.min(ctx);
        if let (Some(b), false) = (req.options.kv_budget, req.workers.addrs.is_empty()) {
            positions = positions.min(b.positions(cfg, kv));
        }
        let held = self.model.layer_range();
        let over = || OpenError::Overflow;
        // the KV of layers placed on a device is held there (the host's caches of them stay empty); their
        // recurrent states on the host are allocated all the same, so they count
        let placed = self.model.placement();
        let on_host = held
            .clone()
            .filter(|i| !placed.iter().any(|(r, _)| r.contains(i)));
        let mut host_kv = 0u64;
        for i in on_host {
            let b = memory::kv_bytes(cfg, i..i + 1, kv, positions).ok_or_else(over)?;
            host_kv = host_kv.checked_add(b).ok_or_else(over)?;
        }
        let needs = [
            MemoryNeed::new(format!("the KV cache of {positions} positions"), host_kv),
            MemoryNeed::new(
                "the recurrent states",
                memory::recurrent_bytes(cfg, held.clone()).ok_or_else(over)?,
            ),
            MemoryNeed::new(
                format!("activation buffers for ubatches of {} tokens", need.ubatch),
                memory::scratch_estimate(cfg, need.ubatch).ok_or_else(over)?,
            ),
        ];
        // the weights are allocated already: they count against the flag's limit, and the OS's limits count them
        // as used (those on a device not: the host holds none of them)
        let weights = MemoryNeed::new(
            format!(
                "weights of layers {}..{} and the ends",
                held.start, held.end
            ),
            self.model.host_weight_bytes() as u64,
        );
        if let Some(m) = req.max_memory {
            let all: Vec<MemoryNeed> = std::iter::once(weights).chain(needs.clone()).collect();
            memory::check_fits(&all, &[memory::MemoryLimit::flag(m)])?;
        }
        memory::check_fits(&needs, &memory::os_limits())?;
        Ok(())
    }
}
