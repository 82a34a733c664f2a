//! Exact checkpoints of a session: snapshots taken by its prefills at grid points, from which a later prefill resumes
//! with the bits of a run from the start ([`crate::grid`]). The server's prompt cache keeps them per slot.

use backburner_model::StateSnapshot;

use crate::session::Session;

impl Session {
    /// Asks the coming prefills to keep exact checkpoints at `positions` (absolute; replaces the earlier request).
    /// A checkpoint is taken where a position is a chunk boundary of the call that passes it (every grid point is,
    /// for a prefill whose history was prefilled from position 0 in one run on the grid) or the call's end, and kept
    /// only where positions `[0, p)` were computed as a prefill from 0 computes them ([`crate::History::exact_to`]):
    /// never after decode steps. Collect them with [`Session::take_checkpoints`].
    ///
    /// A layer split takes none yet (its workers hold their layers' states); KV offload takes them as a local
    /// session does (the linear states are on the host).
    pub fn keep_checkpoints_at(&mut self, positions: Vec<usize>) {
        self.marks = positions;
    }

    /// The checkpoints taken since the last call, in increasing position. Each restores with [`Session::rewind`]
    /// to the exact state at its position.
    pub fn take_checkpoints(&mut self) -> Vec<StateSnapshot> {
        std::mem::take(&mut self.taken)
    }

    /// Before a forward call of `t` tokens at the end of the history: requests the marks inside it from the model
    /// state; true when there are any (then call [`Session::capture_end`] after the call).
    pub(crate) fn capture_begin(&mut self, t: usize) -> bool {
        let pos = self.history.len();
        let inside: Vec<usize> = self
            .marks
            .iter()
            .copied()
            .filter(|&p| p > pos && p - pos <= t)
            .collect();
        if inside.is_empty() {
            return false;
        }
        self.state.request_checkpoints(&inside);
        true
    }

    /// After a forward call begun with [`Session::capture_begin`] and appended to the history: keeps the checkpoints
    /// the call took at exact positions (`captured` false: nothing was requested).
    pub(crate) fn capture_end(&mut self, captured: bool) {
        if !captured {
            return;
        }
        let got = self.state.take_checkpoints();
        let exact = got
            .into_iter()
            .filter(|c| self.history.exact_to(c.n_tokens()));
        self.taken.extend(exact);
    }

    /// Drops what a failed call took.
    pub(crate) fn capture_discard(&mut self, captured: bool) {
        if captured {
            self.state.take_checkpoints();
        }
    }
}
