//! A layer-split session's exact checkpoints on the worker: its layers' Gated DeltaNet states at positions the host
//! named in `RunLayers.keep`, taken inside the call ([`backburner_model::ModelState::request_checkpoints`]), so that a
//! `Rewind` to one of them returns the worker's layers to the state a prefill that never went past it would have,
//! bit for bit (the host's prompt cache, [`crate::serve`], then continues from there with a cold run's bits).
//!
//! Bounds: at most [`MAX_CHECKPOINTS`] per session, the oldest dropped first, each reserved against the worker's
//! memory budget; one that does not fit is not kept (never at another session's expense): the host learns it from
//! `RewindDone.restored = false` and rebuilds instead.

use backburner_link::message::{RunLayers, MAX_KEEP};
use backburner_link::ErrorCode;
use backburner_model::StateSnapshot;

use super::budget::{MemoryBudget, Reservation};
use super::core::Fault;

/// Most checkpoints a session keeps.
pub const MAX_CHECKPOINTS: usize = 16;

/// The checkpoints of one session, in increasing position, each with its reservation.
#[derive(Debug, Default)]
pub struct Checkpoints {
    list: Vec<(StateSnapshot, Reservation)>,
}

impl Checkpoints {
    /// Bytes held against the budget.
    pub fn bytes(&self) -> u64 {
        self.list.iter().map(|(_, r)| r.bytes()).sum()
    }

    /// Positions held, increasing.
    pub fn positions(&self) -> Vec<usize> {
        self.list.iter().map(|(c, _)| c.n_tokens()).collect()
    }

    /// Keeps `snaps` (taken at the session's latest positions), each if its bytes fit `budget`; drops the oldest past
    /// [`MAX_CHECKPOINTS`].
    pub fn keep(&mut self, snaps: Vec<StateSnapshot>, budget: &std::sync::Arc<MemoryBudget>) {
        for s in snaps {
            let n = s.n_tokens();
            self.list.retain(|(c, _)| c.n_tokens() < n);
            let Ok(r) = budget.reserve(s.bytes() as u64, "a checkpoint") else {
                continue;
            };
            self.list.push((s, r));
            if self.list.len() > MAX_CHECKPOINTS {
                self.list.remove(0);
            }
        }
    }

    /// The checkpoint at `pos`, if held.
    pub fn at(&self, pos: usize) -> Option<&StateSnapshot> {
        self.list
            .iter()
            .map(|(c, _)| c)
            .find(|c| c.n_tokens() == pos)
    }

    /// Drops the checkpoints past `pos` (the mirror went back there).
    pub fn truncate(&mut self, pos: usize) {
        self.list.retain(|(c, _)| c.n_tokens() <= pos);
    }

    /// Drops every checkpoint.
    pub fn clear(&mut self) {
        self.list.clear();
    }
}

/// Checks a `RunLayers.keep` list against the ubatch it comes with: at most [`MAX_KEEP`] positions, increasing,
/// inside `(pos, pos + n_tokens]`. Returns them as positions. Errors: a `Malformed` [`Fault`].
pub fn keep_positions(r: &RunLayers) -> Result<Vec<usize>, Fault> {
    let end = r.pos.saturating_add(u64::from(r.n_tokens));
    let ok = r.keep.len() <= MAX_KEEP
        && r.keep.windows(2).all(|w| w[0] < w[1])
        && r.keep.iter().all(|&p| p > r.pos && p <= end);
    if !ok {
        return Err(Fault::new(
            ErrorCode::Malformed,
            format!(
                "RunLayers keeps {} positions {:?}; at most {MAX_KEEP}, increasing, inside ({}, {end}]",
                r.keep.len(),
                &r.keep[..r.keep.len().min(4)],
                r.pos
            ),
        ));
    }
    // every one is ≤ end, which the caller checked against the session's context
    Ok(r.keep.iter().map(|&p| p as usize).collect())
}
