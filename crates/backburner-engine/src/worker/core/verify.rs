//! Verify steps of speculative decoding on a layer-split worker (protocol version 8, docs/PROTOCOL.md §5.16): a
//! `RunLayers` with `verify` set runs the worker's layers as a verify step (each row with a one-token ubatch's bits)
//! and leaves it open; the host's next `RunLayers` or `Rewind` names the position the host kept, and the worker first
//! rolls its layers back there ([`backburner_model::ModelState::rollback_verify`]). The accepted count thus rides on
//! the next request: a verify step costs one round trip per worker, as a decode step does.

use backburner_link::message::RunLayers;
use backburner_link::ErrorCode;
use backburner_model::state::{Back, BackError};

use super::{bad, Fault, SessionCore};
use crate::compute::ComputePool;

impl SessionCore {
    /// With a verify step open at `a..b` and `p` inside `(a, b)`: keeps its first `p − a` positions and drops the
    /// rest, so that the mirror is at `p` with the bits of `p − a` one-token steps (the state manager's
    /// [`backburner_model::ModelState::go_back`] with no checkpoint). True when it rolled back; false (nothing
    /// changed) otherwise: no open verify, `p` at the mirror's position or past it, or before the step (the request's
    /// own position check then refuses it).
    ///
    /// Errors: a `BadState` fault if the open verify refuses the rollback.
    pub(super) fn keep_verified_to(&mut self, p: u64, pool: &ComputePool) -> Result<bool, Fault> {
        let Ok(p) = usize::try_from(p) else {
            return Ok(false);
        };
        let mirror = &mut self.mirror;
        match pool.install(|| mirror.go_back(p, &[])) {
            Ok(Back::Verify) => {
                self.settle();
                Ok(true)
            }
            Ok(_) | Err(BackError::Ahead { .. } | BackError::NotKept { .. }) => Ok(false),
            Err(e @ BackError::Verify(_)) => Err(Fault::new(
                ErrorCode::BadState,
                format!("rolling the open verify step back to {p}: {e}"),
            )),
        }
    }

    /// Checks a `RunLayers` of `t` tokens with `verify` set (a layer-split session, no checkpoint positions) and
    /// returns the bytes its rollback data may take (0 for a plain `RunLayers`).
    pub(super) fn check_verify(&self, r: &RunLayers, t: usize) -> Result<u64, Fault> {
        if !r.verify {
            return Ok(0);
        }
        if !self.spec.layer_split {
            return Err(bad("a verify RunLayers needs a layer-split session"));
        }
        if !r.keep.is_empty() {
            return Err(bad(
                "a verify RunLayers keeps no checkpoint (keep must be empty)",
            ));
        }
        let keep = self.model.verify_keep_bytes(self.spec.range.clone(), t);
        Ok(keep as u64)
    }
}
