//! Why a [`super::SessionRequest`] was refused. Each message names the `run`/`serve` flag its field comes from, so
//! the command line can print it as it is.

use std::path::PathBuf;

use backburner_model::{ModelError, RemoteError};

use crate::error::EngineError;
use crate::memory::OverMemory;
use crate::plan::PlanError;

/// `""` for one, `"s"` for any other count.
fn s(n: &usize) -> &'static str {
    if *n == 1 {
        ""
    } else {
        "s"
    }
}

/// A refused [`super::SessionRequest`]: a placement that does not fit or does not make sense for the model, or a
/// failure to load the weights or reach the workers that must hold a part of the model before a session exists.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The KV cache dtype cannot hold this model's attention rows (bf16 with an odd head_dim): the message of
    /// [`backburner_model::KvOptions::check`].
    #[error("{0}")]
    KvDtype(String),
    /// Worker memory was given for some workers but not all (`--worker-memory` once per `--worker`).
    #[error("--worker-memory is given {given} time{} for {workers} --worker{}: give it once per worker, in --worker order", s(.given), s(.workers))]
    WorkerMemoryCount {
        /// Worker memories given.
        given: usize,
        /// Workers given.
        workers: usize,
    },
    /// The model's costs could not be read for the planner.
    #[error("planning for {}", .dir.display())]
    Costs {
        /// The model.
        dir: PathBuf,
        /// Why.
        #[source]
        source: PlanError,
    },
    /// The planner found no placement (its explanation says what is needed against what is there).
    #[error(transparent)]
    Plan(PlanError),
    /// The host's share of a layer split ends past the model's layers.
    #[error("--layer-split {held} is past this {n}-layer model's last layer")]
    LayerSplitPastModel {
        /// The first worker layer L1 (the host holds `[0, L1)`).
        held: usize,
        /// The model's layers.
        n: usize,
    },
    /// A layer split with as many split points as workers is required.
    #[error("--layer-split gives {points} split point{} for {workers} --worker{}: one per worker, the first layer each holds", s(.points), s(.workers))]
    LayerSplitCount {
        /// Split points given.
        points: usize,
        /// Workers given.
        workers: usize,
    },
    /// Split points that do not increase, or reach the model's end.
    #[error("--layer-split {points} leaves worker {worker} no layers: split points must increase and stay below the model's {n} layers")]
    LayerSplitEmpty {
        /// The split points as given, comma-separated.
        points: String,
        /// The worker (1-based) left without layers.
        worker: usize,
        /// The model's layers.
        n: usize,
    },
    /// Split prefill at layer 0 (the host would hold no layers).
    #[error("--split-layer 0 leaves the host no layers: the host runs layers [0, L) and the worker [L, {n}); valid: {valid}")]
    SplitLayerZero {
        /// The model's layers.
        n: usize,
        /// The valid split layers, comma-separated.
        valid: String,
    },
    /// Split prefill at or past the model's end (the worker would hold no layers).
    #[error("--split-layer {layer} is the end of this {n}-layer model and leaves the worker no layers: the host runs layers [0, L) and the worker [L, {n}); valid: {valid}")]
    SplitLayerAtEnd {
        /// The layer given.
        layer: usize,
        /// The model's layers.
        n: usize,
        /// The valid split layers, comma-separated.
        valid: String,
    },
    /// Split prefill off the model's layer cycle.
    #[error("--split-layer {layer} is not on a {cycle}-layer cycle boundary of this {n}-layer model; valid: {valid}")]
    SplitLayerOffCycle {
        /// The layer given.
        layer: usize,
        /// The cycle (`full_attention_interval`).
        cycle: usize,
        /// The model's layers.
        n: usize,
        /// The valid split layers, comma-separated.
        valid: String,
    },
    /// The same worker twice (maybe under two names that resolve to the same address).
    #[error("--worker {addr} is given twice (as {before} before)")]
    WorkerTwice {
        /// The second name.
        addr: String,
        /// The first name.
        before: String,
    },
    /// Experts on workers for a dense model.
    #[error("--expert-split needs a mixture-of-experts model; this one ({model_type}) is dense")]
    NotMoe {
        /// The model's `model_type`.
        model_type: String,
    },
    /// Not one expert split point per worker.
    #[error(
        "--expert-split gives {given} first layer(s) for {workers} --worker(s): one per worker"
    )]
    ExpertSplitCount {
        /// Points given.
        given: usize,
        /// Workers given.
        workers: usize,
    },
    /// Expert split points that do not split the model into increasing, non-empty ranges
    /// ([`crate::experts::layer_ranges`]'s message).
    #[error("{0}")]
    ExpertSplit(String),
    /// An item of the expert id list that is not a number or a range `a-b`.
    #[error("--expert-ids: {item:?} is not an id or a range a-b")]
    ExpertIdParse {
        /// The item.
        item: String,
        /// Why it did not parse.
        #[source]
        source: std::num::ParseIntError,
    },
    /// An expert id range that is reversed or past the model's experts.
    #[error("--expert-ids: {item:?} is not within 0-{} (this model has {n} experts per layer)", .n.saturating_sub(1))]
    ExpertIdRange {
        /// The item.
        item: String,
        /// Experts per layer.
        n: usize,
    },
    /// An expert id list without an id.
    #[error("--expert-ids names no expert")]
    NoExpertIds,
    /// The experts' workers refused or could not be reached (another model, too little memory, a wrong secret).
    #[error("cannot use the experts' workers: {reason}{hint}")]
    ExpertsUnavailable {
        /// The first worker's refusal or link error.
        reason: RemoteError,
        /// What to change, when the refusal is the worker's memory (may be empty).
        hint: &'static str,
    },
    /// The model already has holders of its routed experts.
    #[error("the model already has holders of its experts")]
    ExpertsHeld,
    /// KV offload over workers whose pages are whole 64-position blocks, with pages of another size.
    #[error("--kv-page-size {page_size} must be a multiple of 64 for workers to hold KV pages (--kv-budget with --worker)")]
    PageSize {
        /// The page size given (positions).
        page_size: usize,
    },
    /// The weights, the KV cache, the states or the buffers do not fit a memory limit (the flag's or the OS's).
    #[error(transparent)]
    Memory(#[from] OverMemory),
    /// A memory sum overflows u64.
    #[error("the session's memory overflows u64")]
    Overflow,
    /// Layers on a device with workers that hold layers or routed experts (placed by the flags or the plan).
    #[error(
        "layers on {device} cannot run with the model's layers or experts split across workers (--layer-split, \
         --expert-split, or the plan's for a host memory limit): let the workers hold KV pages instead \
         (--kv-budget B), or run without workers or without the device (`backburner plan --device` sizes it)"
    )]
    DeviceWithSplit {
        /// The device asked for.
        device: backburner_model::device::DeviceId,
    },
    /// Loading the weights failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The session refused its settings.
    #[error(transparent)]
    Engine(#[from] EngineError),
}
