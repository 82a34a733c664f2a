//! Experts on the worker: loading the routed experts a host asks for (kept for later sessions, counted against
//! `--max-memory`), and answering `Experts` requests.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use backburner_link::message::{Experts, ExpertsDone};
use backburner_link::ErrorCode;
use backburner_model::{experts_bytes, fingerprint, ExpertStore};
use tracing::info;

use super::budget::Reservation;
use super::core::{Fault, Reply, SessionCore};
use super::{Shared, WorkerError};
use crate::compute::ComputePool;
use crate::experts::wire;

/// Routed experts loaded for hosts.
pub(super) struct LoadedExperts {
    pub store: Arc<ExpertStore>,
    pub fingerprint: [u8; 32],
    /// The weights' bytes, held against the memory budget while they are loaded.
    _weights: Reservation,
}

/// The experts `ids` of the MoE layers of `range`: the ones loaded if they are those, else loaded now (replacing
/// others no session uses). Errors: [`WorkerError::LayerRange`] when other experts serve sessions now or the model
/// has none, [`WorkerError::Memory`] past the budget, load errors.
pub(super) fn load(
    shared: &Shared,
    range: Range<usize>,
    ids: &[usize],
) -> Result<Arc<LoadedExperts>, WorkerError> {
    // layers loaded for earlier sessions that none uses now give their memory back (one lock at a time)
    super::accept::drop_idle_layers(shared);
    let mut g = shared.experts.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(l) = g.as_ref() {
        if l.store.layers() == range && l.store.ids() == ids {
            return Ok(l.clone());
        }
        if Arc::strong_count(l) > 1 {
            return Err(WorkerError::LayerRange(format!(
                "this worker serves other experts to other hosts now ({} experts of layers {:?}; this host asks for {} of {range:?})",
                l.store.ids().len(),
                l.store.layers(),
                ids.len()
            )));
        }
    }
    *g = None;
    let c = &shared.config;
    if c.moe.is_none() {
        return Err(WorkerError::LayerRange(
            "this worker's model has no routed experts".into(),
        ));
    }
    let need = experts_bytes(&shared.ckpt, c, range.clone(), ids)?;
    let weights = shared
        .budget
        .reserve(need, "the weights of its experts")
        .map_err(|e| WorkerError::Memory {
            layers: range.clone(),
            need,
            used: e.used,
            limit: e.limit,
        })?;
    info!(
        ?range,
        experts = ids.len(),
        weight_bytes = need,
        "loading routed experts"
    );
    let store = shared
        .pool
        .install(|| ExpertStore::load(c, &shared.ckpt, range.clone(), ids))?;
    let l = Arc::new(LoadedExperts {
        store: Arc::new(store),
        fingerprint: fingerprint(&shared.ckpt, c, range)?,
        _weights: weights,
    });
    *g = Some(l.clone());
    Ok(l)
}

/// Drops the experts loaded for earlier sessions if none uses them now (their memory goes back to the budget).
pub(super) fn drop_idle_experts(shared: &Shared) {
    let mut g = shared.experts.lock().unwrap_or_else(|p| p.into_inner());
    if g.as_ref().is_some_and(|l| Arc::strong_count(l) == 1) {
        *g = None;
    }
}

/// Bytes an `Experts` request of `segments` with `pairs` pairs in all needs beyond its body: the decoded segments,
/// each pair's weighted output `[H]`, and one expert's gathered rows, gate|up, activation and output for every pair
/// at most (`[pairs, 3H + 3I]` f32), with its answer twice (computed, then encoded).
fn work_bytes(hidden: usize, inter: usize, segments: usize, pairs: usize) -> u64 {
    let per_pair = 4u64.saturating_mul(3 * hidden as u64 + 3 * inter as u64 + 2);
    (segments as u64)
        .saturating_mul(64)
        .saturating_add((pairs as u64).saturating_mul(per_pair))
        .saturating_add((segments as u64).saturating_mul(8 * hidden as u64))
}

impl SessionCore {
    /// Answers an `Experts` request: the vectors of its segments, computed on `pool`.
    pub(super) fn experts(
        &mut self,
        e: Experts,
        bytes: &[u8],
        pool: &ComputePool,
    ) -> Result<Reply, Fault> {
        let bad = |m: String| Fault::new(ErrorCode::Malformed, m);
        let Some(store) = self.experts.clone() else {
            return Err(bad("Experts on a session that holds no experts".into()));
        };
        let hidden = self.cfg().hidden_size;
        let inter = self
            .cfg()
            .moe
            .as_ref()
            .map_or(0, |m| m.moe_intermediate_size);
        // the decoded segments first (at most one per 16 body bytes), then the work and the answer
        let at_most = (e.n_segments as usize).min(bytes.len() / 16);
        let decoding = self.budget.reserve(
            work_bytes(0, 0, at_most, 0),
            "an Experts request's segments",
        )?;
        let (rows, segs) = wire::decode(bytes, e.n_rows as usize, e.n_segments as usize, hidden)
            .map_err(|m| bad(format!("Experts: {m}")))?;
        let pairs: usize = segs.iter().map(|s| s.pairs.len()).sum();
        drop(decoding);
        let hold = self.budget.reserve(
            work_bytes(hidden, inter, segs.len(), pairs),
            "an Experts request's work and answer",
        )?;
        let t = Instant::now();
        let out = pool
            .install(|| store.run(e.layer as usize, &rows, e.n_rows as usize, &segs))
            .map_err(|m| bad(format!("Experts: {m}")))?;
        let compute_us = t.elapsed().as_micros() as u64;
        let payload = backburner_link::frame::f32_bytes(&out);
        let done = ExpertsDone {
            n_segments: e.n_segments,
            compute_us,
        };
        Ok(Reply::ExpertsDone(done, payload, hold))
    }
}
