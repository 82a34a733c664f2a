//! Loading the host's share of the weights (after checking that it fits) and connecting the workers that hold the
//! routed experts it leaves out.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use backburner_model::device::LayerPlacement;
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig, RemoteExperts};

use super::checks::is_away;
use super::{OpenError, OpenObserver};
use crate::connection::{Connection, SessionShape};
use crate::experts::{ExpertHolder, LinkExperts};
use crate::memory::{check_fits, host_limits, MemoryNeed};
use crate::split::WorkerSettings;

/// Loads layers `[0, held)` (default: every layer) and the ends (embedding, final norm, head) of `dir` with its
/// `config`, leaving out the routed experts `away` puts on workers, after checking that their bytes fit
/// `max_memory` (bytes) and the OS's limits; `obs` hears the layers loaded. Packs weights on the calling thread's
/// pool (call it inside [`crate::ComputePool::install`]).
///
/// Errors: [`OpenError::LayerSplitPastModel`] for `held` past the model's layers, [`OpenError::Memory`] naming the
/// weights that do not fit, [`OpenError::Model`] for every error of loading.
pub fn load_weights(
    dir: &Path,
    config: ModelConfig,
    held: Option<usize>,
    away: &[(Range<usize>, Vec<usize>)],
    max_memory: Option<u64>,
    obs: &mut dyn OpenObserver,
) -> Result<Arc<Model>, OpenError> {
    load_weights_placed(dir, config, held, away, None, max_memory, obs)
}

/// As [`load_weights`], placing the layers of `place` on its device as they load
/// ([`Model::from_checkpoint_placed`]): the host never holds their weights, and only the weights it keeps are
/// checked against `max_memory` and the OS's limits.
///
/// Errors: as [`load_weights`]; [`OpenError::Model`] with the device's error for a placement it refuses (layers
/// outside `[0, held)`, a mixture-of-experts layer, the device's memory).
pub fn load_weights_placed(
    dir: &Path,
    config: ModelConfig,
    held: Option<usize>,
    away: &[(Range<usize>, Vec<usize>)],
    place: Option<&LayerPlacement>,
    max_memory: Option<u64>,
    obs: &mut dyn OpenObserver,
) -> Result<Arc<Model>, OpenError> {
    let n = config.num_hidden_layers;
    let held = held.unwrap_or(n);
    if held > n {
        return Err(OpenError::LayerSplitPastModel { held, n });
    }
    let ckpt = Checkpoint::open(dir)?;
    let opts = LoadOptions {
        layers: 0..held,
        ends: true,
    };
    let elsewhere = |l: usize, e: usize| is_away(away, l, e);
    let mut weights = backburner_model::load_bytes_without(&ckpt, &config, &opts, &elsewhere)?;
    let mut what = match away.is_empty() {
        true => format!("weights of layers 0..{held} and the ends"),
        false => format!("weights of layers 0..{held} and the ends without the experts on workers"),
    };
    if let Some(p) = place.filter(|p| p.layers.end <= held) {
        let on_device = LoadOptions {
            layers: p.layers.clone(),
            ends: false,
        };
        let placed = backburner_model::load_bytes_without(&ckpt, &config, &on_device, &elsewhere)?;
        weights = weights.saturating_sub(placed);
        what += &format!(" less layers {:?} (on {})", p.layers, p.backend.info().id);
    }
    check_fits(&[MemoryNeed::new(what, weights)], &host_limits(max_memory))?;
    obs.loading(0, held);
    let model =
        Model::from_checkpoint_placed(config, &ckpt, &opts, &elsewhere, place, |done, total| {
            obs.loading(done, total)
        })?;
    Ok(Arc::new(model))
}

/// Attaches the workers of `away` (with their `settings`, in the same order) to `model` as the holders of its
/// missing experts and connects them, so a refusal (another model, too little memory, a wrong secret) comes before
/// anything runs. Returns the holders (`None` when `away` is empty).
///
/// Errors: [`OpenError::ExpertsUnavailable`] (with a hint when a worker is out of memory),
/// [`OpenError::ExpertsHeld`] when the model has holders already.
pub(super) fn attach_experts(
    dir: &Path,
    model: &Model,
    away: &[(Range<usize>, Vec<usize>)],
    settings: Vec<WorkerSettings>,
    shape: SessionShape,
) -> Result<Option<Arc<LinkExperts>>, OpenError> {
    if away.is_empty() {
        return Ok(None);
    }
    let precision = model.config().precision;
    let holders = settings
        .into_iter()
        .zip(away)
        .map(|(st, (r, ids))| {
            let fp = crate::split::dir_fingerprint_with(dir.to_path_buf(), precision);
            ExpertHolder::new(Connection::new(st, fp), r.clone(), ids.clone())
        })
        .collect();
    let rx = Arc::new(LinkExperts::new(model.config().clone(), shape, holders));
    rx.connect_all().map_err(|e| {
        let hint = if e.0.contains("OutOfMemory") {
            " (raise that worker's --max-memory, put fewer layers' experts on it with --expert-split, or fewer \
             experts with --expert-ids; with --worker-memory, `run` plans around what each worker holds)"
        } else {
            ""
        };
        OpenError::ExpertsUnavailable { reason: e, hint }
    })?;
    let dynrx: Arc<dyn RemoteExperts> = rx.clone();
    if !model.attach_remote_experts(dynrx) {
        return Err(OpenError::ExpertsHeld);
    }
    Ok(Some(rx))
}
