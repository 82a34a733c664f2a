//! The placement planner: a pure function from a model's costs and the devices' memory budgets to a [`Plan`]
//! (which mode runs, which layers and how much KV each device holds, the largest context that fits, what crosses
//! the link per token and, with a [`Calibration`], the expected speed). `backburner plan` prints it; `run` executes
//! it.
//!
//! Rules, in order (see [`plan`]):
//! 1. **Local** when everything (weights, recurrent state, KV for the context, scratch) fits the host. With a worker
//!    attached this becomes **split prefill**: the first worker mirrors the tail layers `[L, n)`, L from
//!    [`crate::balanced_split`] on a seam and moved towards the tail until the mirror fits the worker.
//! 2. **KV offload** when the weights fit the host but the context's KV does not and workers exist: the host keeps a
//!    budget of whole KV pages (at least a ubatch and two pages), the oldest pages go to the workers in chain order.
//! 3. **Layer split** otherwise: the host keeps the ends and layers `[0, L1)`, worker 1 `[L1, L2)`, …, the last
//!    worker up to `n`. Each device in chain order takes **as many layers as fit** after its fixed costs and the KV
//!    of its own attention layers for the context (the host is the one device that must compute anyway, and every
//!    layer kept earlier is a layer a slower worker does not run; a worker left with no layers drops out of the
//!    chain and saves a hop). Split points fall on seams (multiples of `full_attention_interval`) when any seam
//!    placement fits, else on any layer boundary, with a note.
//!
//! The context: `ctx` when given (the plan fails if it cannot hold it), else the largest context that fits up to
//! `max_position_embeddings`; a placement must hold at least [`min_context`] positions to count as fitting.

mod calib;
mod device;
mod device_plan;
mod experts;
mod explain;
pub(crate) mod memory;
pub mod moe;
mod search;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_device;
#[cfg(test)]
mod tests_experts;

use std::ops::Range;

use backburner_model::{ModelConfig, ModelError};
use serde::Serialize;

pub use calib::{Calibration, DecodeBreakdown, DeviceTimes, LinkTimes, Rates};
pub use device::{
    device_reserve, fit_layers, head_device_bytes, layer_device_bytes, DeviceBudget, DeviceFit,
    DeviceLoad, DevicePlacement, FitStop, DEVICE_RUNTIME_RESERVE,
};
pub use device_plan::plan_with_device;
pub use explain::summary;
pub use memory::{
    config_dtype_bytes, EndsBytes, ModelCosts, StoredType, WeightSource, WeightsFormat,
    SCRATCH_FACTOR,
};

/// Smallest batch (tokens) that split prefill sends through the worker (the session's default `split_min_tokens`).
pub const SPLIT_MIN_TOKENS: usize = 512;

/// A layer range as `[start, end]` in JSON (as `run --json` writes ranges).
fn range_pair<S: serde::Serializer>(r: &Range<usize>, s: S) -> Result<S::Ok, S::Error> {
    [r.start, r.end].serialize(s)
}

/// The memory to give a worker whose memory is not known (`run` without `--worker-memory`): as much as it takes
/// (the worker itself refuses layers its own budget cannot hold); explanations print it as "memory not given".
pub const UNKNOWN_MEMORY: u64 = 1 << 50;

/// What the planner is asked.
#[derive(Clone, Debug)]
pub struct PlanRequest {
    /// The model's config (layer kinds, seams, the split-prefill balance).
    pub config: ModelConfig,
    /// What each part costs ([`ModelCosts::from_dir`]).
    pub costs: ModelCosts,
    /// Bytes the host may use.
    pub host_memory: u64,
    /// Bytes each worker may use, in chain order.
    pub worker_memory: Vec<u64>,
    /// Context wanted (tokens); `None` = the largest that fits, up to `max_position_embeddings`.
    pub ctx: Option<usize>,
    /// Tokens per prefill ubatch (sizes the scratch).
    pub ubatch: usize,
    /// Positions per KV page (KV offload moves whole pages, so its budgets are whole pages).
    pub page_size: usize,
    /// Fixed first split points `L1 < L2 < …` (`--layer-split`): at most one per worker; forces layer split, and
    /// the planner places only the rest.
    pub layer_split: Option<Vec<usize>>,
    /// Measured speeds, for [`Plan::expected`].
    pub calibration: Option<Calibration>,
}

/// The execution mode a plan chose.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Everything on the host.
    Local,
    /// Everything on the host; worker 1 mirrors layers `[split_layer, n)` to prefill long prompts alongside.
    SplitPrefill {
        /// L: the first mirrored layer.
        split_layer: usize,
    },
    /// Every weight on the host; the oldest KV pages past `host_kv_positions` live on the workers.
    KvOffload {
        /// The host's KV budget in positions (whole pages) of every full-attention layer.
        host_kv_positions: usize,
    },
    /// Layers split over host and workers (`host.layers`, `workers[i].layers`); the host relays the residual.
    LayerSplit,
    /// Experts on workers (mixture-of-experts models): the host holds every layer but the routed experts of the
    /// workers' `layers`, which they hold.
    ExpertSplit,
}

/// What one device holds under a plan. Sizes are bytes; positions are tokens.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DevicePlan {
    /// `"host"`, `"worker 1"`, …
    pub name: String,
    /// Bytes this device may use.
    pub memory: u64,
    /// The decoder layers whose weights it holds (split prefill: the mirrored tail); empty = none (`0..0` for a
    /// host holding only the embedding and head, whose layers are always `[0, L1)`; `n..n` for an unused worker).
    #[serde(serialize_with = "range_pair")]
    pub layers: Range<usize>,
    /// Holds the embedding, final norm and head.
    pub holds_ends: bool,
    /// Weight bytes: its layers, plus the ends when it holds them.
    pub weight_bytes: u64,
    /// Recurrent + conv state bytes of its Gated DeltaNet layers.
    pub state_bytes: u64,
    /// KV positions it holds at `max_ctx` (of its own attention layers; KV offload workers: of every attention
    /// layer).
    pub kv_positions: usize,
    /// Bytes of those KV rows.
    pub kv_bytes: u64,
    /// Activation estimate for one ubatch ([`ModelCosts::scratch_bytes`]).
    pub scratch_bytes: u64,
}

impl DevicePlan {
    /// Everything it holds: weights + state + KV + scratch (saturating).
    pub fn total_bytes(&self) -> u64 {
        self.weight_bytes
            .saturating_add(self.state_bytes)
            .saturating_add(self.kv_bytes)
            .saturating_add(self.scratch_bytes)
    }

    /// A device that holds nothing (an unused worker).
    pub(crate) fn idle(name: String, memory: u64, n_layers: usize) -> Self {
        DevicePlan {
            name,
            memory,
            layers: n_layers..n_layers,
            holds_ends: false,
            weight_bytes: 0,
            state_bytes: 0,
            kv_positions: 0,
            kv_bytes: 0,
            scratch_bytes: 0,
        }
    }
}

/// Link traffic per token over the host's links, both ways together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LinkCost {
    /// Bytes per prompt token in prefill (steady state).
    pub prefill_bytes_per_token: u64,
    /// Bytes per generated token.
    pub decode_bytes_per_token: u64,
}

/// The weights a plan placed: what they are stored as and what each part costs once loaded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PlanWeights {
    /// The container (`gguf`, `safetensors`, or `config` when only config.json was read) and the stored types.
    pub format: WeightsFormat,
    /// Where the sizes came from: `"checkpoint"` (the tensor headers, as the load allocates) or the config's shapes.
    pub source: WeightSource,
    /// Bytes of each decoder layer.
    pub layer_bytes: Vec<u64>,
    /// Bytes of the embedding, final norm and head.
    pub ends: EndsBytes,
    /// Every layer and the ends.
    pub total_bytes: u64,
}

impl PlanWeights {
    /// The weights of `costs`.
    pub fn of(costs: &ModelCosts) -> Self {
        PlanWeights {
            format: costs.format.clone(),
            source: costs.source.clone(),
            layer_bytes: costs.layer_weight_bytes.clone(),
            ends: costs.ends,
            total_bytes: costs.total_weight_bytes(),
        }
    }

    /// One line for the user: `1.2 MB as loaded, from GGUF: Q4_K (32 tensors), F32 (23 tensors)`, or `53.8 GB from
    /// config.json shapes at 2 bytes per weight (no weights read)`.
    pub fn describe(&self) -> String {
        let how = match self.source {
            WeightSource::Checkpoint => " as loaded,",
            WeightSource::Config { .. } => "",
        };
        format!(
            "{}{how} from {}",
            crate::memory::human(self.total_bytes),
            self.format.describe(&self.source)
        )
    }
}

/// A placement: which mode, what each device holds, the context it was sized for, the link traffic and (with a
/// calibration) the expected speed.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Plan {
    /// The mode chosen.
    pub mode: Mode,
    /// The host's share.
    pub host: DevicePlan,
    /// Each worker's share, in chain order (one per budget given; unused workers hold nothing).
    pub workers: Vec<DevicePlan>,
    /// The context wanted (tokens): the request's, else `max_ctx`.
    pub ctx: usize,
    /// The largest context (tokens) this placement holds, at most `max_position_embeddings`.
    pub max_ctx: usize,
    /// Link bytes per token.
    pub link: LinkCost,
    /// Expected speed; `None` without a calibration (or one missing a device this plan uses).
    pub expected: Option<Rates>,
    /// Why this mode, and anything the user should know.
    pub notes: Vec<String>,
    /// The weights placed: their format and per-layer bytes.
    pub weights: PlanWeights,
    /// The first layers on a device (`plan --device`, [`plan_with_device`]; the host's row then holds the other
    /// layers and the ends only); absent from the JSON when none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<DevicePlacement>,
}

/// Why no plan came out.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// The model does not fit these budgets. `explanation` says what is needed against what is there and, where it
    /// can, how much more worker memory would make it fit.
    #[error("{explanation}")]
    DoesNotFit {
        /// The human explanation (sizes in GB = 10^9 bytes).
        explanation: String,
        /// Bytes of memory one more worker needs for a plan to fit, when one would help.
        extra_worker_bytes: Option<u64>,
    },
    /// A setting is out of range (ubatch 0, split points out of order, a context past the model's).
    #[error("{0}")]
    Invalid(String),
    /// The config or checkpoint could not be read.
    #[error(transparent)]
    Model(#[from] ModelError),
}

/// The least context (tokens) a placement must hold to count as fitting: one KV page, or the whole model context
/// when that is shorter.
pub fn min_context(req: &PlanRequest) -> usize {
    req.page_size.min(req.costs.max_position_embeddings).max(1)
}

/// Computes the placement for `req` (see the module docs for the rules).
///
/// Errors: [`PlanError::Invalid`] for ubatch or page size 0, a model without layers, `ctx` 0 or past
/// `max_position_embeddings`, or bad `layer_split` points (not strictly increasing inside `(0, n)`, more points
/// than workers, or given without workers); [`PlanError::DoesNotFit`] when no mode fits.
pub fn plan(req: &PlanRequest) -> Result<Plan, PlanError> {
    validate(req)?;
    let mut p = match search::place(req)? {
        Some(p) => p,
        None => return Err(explain::does_not_fit(req)),
    };
    p.notes.extend(moe::note(req));
    p.link = calib::link_cost(req, &p);
    p.expected = req
        .calibration
        .as_ref()
        .and_then(|c| calib::expected(req, &p, c));
    if req.calibration.is_some() && p.expected.is_none() {
        p.notes.push(
            "the calibration has no numbers for a device this plan uses (or no link numbers): no expected rates"
                .into(),
        );
    }
    Ok(p)
}

fn validate(req: &PlanRequest) -> Result<(), PlanError> {
    let bad = |m: String| Err(PlanError::Invalid(m));
    let n = req.costs.n_layers();
    if req.ubatch == 0 || req.page_size == 0 {
        return bad("ubatch and KV page size must be ≥ 1".into());
    }
    if n == 0 || req.config.num_hidden_layers != n {
        return bad("the model's costs and config disagree on the layer count".into());
    }
    if let Some(c) = &req.calibration {
        let (l, h) = (req.config.num_hidden_layers, req.config.hidden_size);
        if (c.layers != 0 && c.layers != l) || (c.hidden != 0 && c.hidden != h) {
            return bad(format!(
                "the calibration was measured on another model ({}: {} layers, hidden {}); this one has {l} layers, hidden {h}: run `backburner calibrate` on it",
                c.model, c.layers, c.hidden
            ));
        }
    }
    let max = req.costs.max_position_embeddings;
    match req.ctx {
        Some(0) => return bad("the context must be ≥ 1 token".into()),
        Some(c) if c > max => {
            return bad(format!(
                "context {c} is longer than the model's {max} tokens (max_position_embeddings)"
            ))
        }
        _ => {}
    }
    if let Some(pts) = &req.layer_split {
        if req.worker_memory.is_empty() {
            return bad("a layer split needs at least one worker".into());
        }
        if pts.is_empty() || pts.len() > req.worker_memory.len() {
            let w = req.worker_memory.len();
            return bad(format!(
                "{} split point{} for {w} worker{}: give at most one per worker, L1 < L2 < … (the first layer each holds)",
                pts.len(),
                if pts.len() == 1 { "" } else { "s" },
                if w == 1 { "" } else { "s" },
            ));
        }
        // L1 may be 0 (the host keeps only the embedding and head); each later point is past the one before
        let increasing = pts.windows(2).all(|w| w[0] < w[1]);
        if !increasing || pts.iter().any(|&l| l >= n) {
            return bad(format!(
                "split points {pts:?} must increase inside 0..{n} (the {n}-layer model's layer boundaries; 0 leaves the host only the embedding and head)"
            ));
        }
    }
    Ok(())
}
