//! The state manager of a sequence: how it keeps what going back needs, and the one way it goes back.
//!
//! A sequence goes back to an earlier position for three reasons: a verify step of speculative decoding keeps only
//! its accepted prefix, the prompt cache resumes a request from a checkpoint, a regenerate or a rewind returns to the
//! end of a prompt. Two things make going back exact: what an open verify step keeps (the Gated DeltaNet states
//! from before it and its inputs: [`crate::Model::forward_layers_verify`]), and **checkpoints**
//! ([`StateSnapshot`]: a copy of every Gated DeltaNet state at a position, taken by [`ModelState::snapshot`] or
//! inside a prefill at chosen positions, [`ModelState::request_checkpoints`]). KV rows need neither: they are
//! truncated. [`ModelState::go_back`] is the one entry point every caller uses (the session's `keep_verified` and
//! `rewind`, the prompt cache through the latter, a layer-split worker's `Rewind` and its verify rollbacks): it
//! picks what the state keeps for the position asked, and says which it used.

use super::{LayerState, LinearState, ModelState};
use crate::model::verify::VerifyError;

/// A restorable copy of the state at a position: the linear layers' states (copied) and the position count (the
/// KV cache is restored by truncation, since its rows below the position never change).
#[derive(Clone, Debug)]
pub struct StateSnapshot {
    n_tokens: usize,
    linear: Vec<(usize, LinearState)>,
}

impl StateSnapshot {
    /// A snapshot at position `n_tokens` holding `linear` (layer index, state), increasing layer.
    pub(crate) fn from_parts(n_tokens: usize, linear: Vec<(usize, LinearState)>) -> Self {
        StateSnapshot { n_tokens, linear }
    }

    /// Positions covered by the snapshot.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// Bytes held: the linear layers' conv and recurrent states (f32).
    pub fn bytes(&self) -> usize {
        self.linear.iter().map(|(_, s)| s.bytes()).sum()
    }
}

/// How [`ModelState::go_back`] reached the position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Back {
    /// The state was there already.
    Here,
    /// The open verify step's rollback: KV rows truncated, Gated DeltaNet layers replayed over the kept positions.
    Verify,
    /// A checkpoint restored: KV rows truncated, Gated DeltaNet states copied back.
    Checkpoint,
}

/// Why [`ModelState::go_back`] could not reach a position (the state is unchanged).
#[derive(Debug, thiserror::Error)]
pub enum BackError {
    /// The position is past the state's.
    #[error("position {to} is past the state's {at}")]
    Ahead {
        /// The position asked for.
        to: usize,
        /// The state's position.
        at: usize,
    },
    /// Neither an open verify step nor a checkpoint covers the position: the caller rebuilds (re-ingests its
    /// tokens) instead.
    #[error("nothing kept to go back to position {to} (no open verify step over it, no checkpoint there)")]
    NotKept {
        /// The position asked for.
        to: usize,
    },
    /// The open verify step covers the position but refused (its rows are held elsewhere, a layer missing).
    #[error(transparent)]
    Verify(#[from] VerifyError),
}

impl ModelState {
    /// Goes back to position `to` (at most the state's position) with the bits the state had there, using what it
    /// keeps: the checkpoint at `to` among `kept` (taken on this state, or on one that ran the same calls; restored
    /// at the state's own position too, as [`ModelState::restore`] is); else the open verify step's rollback when
    /// `to` is inside it (`pos0 < to < pos0 + T`); else nothing to do at the state's own position. Runs on the current rayon pool (a verify rollback replays positions).
    ///
    /// Errors ([`BackError`], the state unchanged): `Ahead` for a position past the state's, `NotKept` when nothing
    /// covers it, `Verify` when the open verify step refuses (see [`ModelState::rollback_verify`]).
    pub fn go_back(&mut self, to: usize, kept: &[&StateSnapshot]) -> Result<Back, BackError> {
        let at = self.n_tokens();
        if to > at {
            return Err(BackError::Ahead { to, at });
        }
        if let Some(c) = kept.iter().find(|c| c.n_tokens() == to) {
            self.restore(c);
            return Ok(Back::Checkpoint);
        }
        if let Some(span) = self.verify_span() {
            if span.start < to && to < at && span.end == at {
                self.rollback_verify(to - span.start)?;
                return Ok(Back::Verify);
            }
        }
        match to == at {
            true => Ok(Back::Here),
            false => Err(BackError::NotKept { to }),
        }
    }

    /// Copies the linear states and records the position, for [`ModelState::restore`]. The states of layers
    /// placed on a device are copied from it.
    ///
    /// Panics if a device fails to copy them (its driver failed: the device is unusable).
    pub fn snapshot(&self) -> StateSnapshot {
        let on_device: Vec<(usize, LinearState)> = self
            .device
            .iter()
            .flatten()
            .flat_map(|d| {
                d.linear_states()
                    .unwrap_or_else(|e| panic!("snapshot: a device failed: {e}"))
            })
            .collect();
        let mut linear: Vec<(usize, LinearState)> = self
            .layers
            .iter()
            .enumerate()
            .filter(|(i, _)| !on_device.iter().any(|(k, _)| k == i))
            .filter_map(|(i, l)| match l {
                Some(LayerState::Linear(s)) => Some((i, s.clone())),
                _ => None,
            })
            .collect();
        linear.extend(on_device);
        linear.sort_by_key(|(i, _)| *i);
        StateSnapshot {
            n_tokens: self.n_tokens,
            linear,
        }
    }

    /// Returns to a snapshot taken earlier on this state: KV caches are truncated to the snapshot's position and the
    /// linear states copied back. Panics if the snapshot is ahead of the state (a caller bug).
    pub fn restore(&mut self, snap: &StateSnapshot) {
        assert!(
            snap.n_tokens <= self.n_tokens,
            "restore: snapshot at {} is ahead of the state at {}",
            snap.n_tokens,
            self.n_tokens
        );
        self.scratch.close_verify();
        for l in self.layers.iter_mut().flatten() {
            if let LayerState::Attention(c) = l {
                c.truncate(snap.n_tokens);
            }
        }
        for (i, s) in &snap.linear {
            if let Some(LayerState::Linear(dst)) = self.layers[*i].as_mut() {
                dst.clone_from(s);
            }
        }
        for d in self.device.iter_mut().flatten() {
            if let Err(e) = d.restore(snap.n_tokens, &snap.linear) {
                panic!("restore: a device failed: {e}");
            }
        }
        self.n_tokens = snap.n_tokens;
    }
}
