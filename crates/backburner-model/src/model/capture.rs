//! Exact checkpoints taken inside a forward call: the Gated DeltaNet layers' states at chosen positions of a
//! prefill ubatch, for a later prefill to resume from with the same bits as one that never stopped there.
//!
//! A Gated DeltaNet state cannot be rewound, and the chunked delta rule's arithmetic depends on where its chunks
//! start: a prefill resumed from position `p` computes what an uninterrupted one does only when `p` is a chunk
//! boundary of that one (the chunks after `p` are then the same chunks, and every other op of the layer is per row
//! or per position). So a checkpoint is taken at a row `r` of a call only where `r` is a multiple of
//! [`GDN_CHUNK`](super::GDN_CHUNK) (or the call's end): the delta rule runs as consecutive calls split at those rows
//! (bit-identical to one call: the chunks are the same) and the state is copied between them; the conv state at `r`
//! is the `kernel − 1` raw inputs before `r`, read from the call's raw projection (and the state the call began
//! with, where `r < kernel − 1`). Attention layers need nothing: their KV rows are truncated on restore.
//!
//! A speculative verify (`verify.rs`) takes no checkpoint: it runs its own Gated DeltaNet path, which never reads
//! the request, so positions inside a verify are not taken (a request stays pending for the next ordinary call),
//! and a rollback never leaves a checkpoint past the position it returns to (those taken before the verify are at
//! or below its first position).

use std::collections::BTreeMap;

use crate::state::{LinearState, ModelState, StateSnapshot};

/// The checkpoints requested of the coming forward calls of one sequence and the layer states taken so far.
#[derive(Debug, Default)]
pub(crate) struct Capture {
    /// Absolute positions, increasing.
    at: Vec<usize>,
    /// `(position, layer, state)` taken.
    taken: Vec<(usize, usize, LinearState)>,
}

impl Capture {
    /// The rows `r` of a call at positions `pos0..pos0 + t` where a checkpoint is requested and can be taken
    /// exactly: `pos0 + r` requested, `0 < r ≤ t`, and `r` a multiple of `chunk` or `t`. Increasing.
    pub(crate) fn rows(&self, pos0: usize, t: usize, chunk: usize) -> Vec<usize> {
        self.at
            .iter()
            .filter_map(|&p| p.checked_sub(pos0))
            .filter(|&r| r > 0 && r <= t && (r % chunk == 0 || r == t))
            .collect()
    }

    /// Keeps layer `layer`'s state at absolute position `pos`.
    pub(crate) fn keep(&mut self, pos: usize, layer: usize, state: LinearState) {
        self.taken.push((pos, layer, state));
    }
}

/// The conv state at row `r` of a call (`[conv_dim, kc]`, oldest first, as [`LinearState::conv`]): the raw inputs
/// of rows `r − kc .. r`, taken from `raw` (`[t, conv_dim]`, the call's raw `in_proj_qkv` rows) and, for rows
/// before the call, from `before` (the conv state the call began with).
pub(crate) fn conv_window(
    before: &[f32],
    raw: &[f32],
    conv_dim: usize,
    kc: usize,
    r: usize,
) -> Vec<f32> {
    let mut w = vec![0.0f32; conv_dim * kc];
    conv_window_into(before, raw, conv_dim, kc, r, &mut w);
    w
}

/// [`conv_window`] into `w` (`[conv_dim, kc]`, every value written).
pub(crate) fn conv_window_into(
    before: &[f32],
    raw: &[f32],
    conv_dim: usize,
    kc: usize,
    r: usize,
    w: &mut [f32],
) {
    debug_assert_eq!(
        before.len(),
        conv_dim * kc,
        "conv state is not [conv_dim, kc]"
    );
    assert_eq!(w.len(), conv_dim * kc, "conv window is not [conv_dim, kc]");
    for j in 0..kc {
        // input row r − kc + j of the call; negative rows come from the state (its slot kc + row)
        match (r + j).checked_sub(kc) {
            Some(row) => {
                let src = &raw[row * conv_dim..(row + 1) * conv_dim];
                for (c, &v) in src.iter().enumerate() {
                    w[c * kc + j] = v;
                }
            }
            None => {
                let slot = r + j;
                for c in 0..conv_dim {
                    w[c * kc + j] = before[c * kc + slot];
                }
            }
        }
    }
}

impl ModelState {
    /// Requests exact checkpoints at absolute `positions` of the coming forward calls (replacing earlier requests
    /// and dropping what was taken and not collected). A position is taken where it falls inside a call
    /// (`pos0 < p ≤ pos0 + t`) at a multiple of [`GDN_CHUNK`](super::GDN_CHUNK) rows from the call's start, or at
    /// its end; others are not taken. Collect them with [`ModelState::take_checkpoints`].
    pub fn request_checkpoints(&mut self, positions: &[usize]) {
        let mut at = positions.to_vec();
        at.sort_unstable();
        at.dedup();
        for s in self.scratches_mut() {
            s.capture.at.clone_from(&at);
            s.capture.taken.clear();
        }
    }

    /// The checkpoints taken since [`ModelState::request_checkpoints`] at which every Gated DeltaNet layer this
    /// state holds was copied, in increasing position; clears the request. Each restores with
    /// [`ModelState::restore`] to the state at its position. A state that holds no Gated DeltaNet layer (a
    /// worker's range of attention layers only) is exact at any position it has passed: its checkpoints are then
    /// the requested positions up to [`ModelState::n_tokens`] (call it after [`Model::commit_tokens`](super::Model::commit_tokens)).
    pub fn take_checkpoints(&mut self) -> Vec<StateSnapshot> {
        let mut taken = Vec::new();
        let mut requested = Vec::new();
        for s in self.scratches_mut() {
            requested = std::mem::take(&mut s.capture.at);
            taken.append(&mut s.capture.taken);
        }
        let layers: Vec<usize> = self.range().filter(|&i| self.linear(i).is_some()).collect();
        if layers.is_empty() {
            let n = self.n_tokens();
            return requested
                .into_iter()
                .filter(|&p| p <= n)
                .map(|p| StateSnapshot::from_parts(p, Vec::new()))
                .collect();
        }
        let mut by_pos: BTreeMap<usize, Vec<(usize, LinearState)>> = BTreeMap::new();
        for (p, l, st) in taken {
            by_pos.entry(p).or_default().push((l, st));
        }
        let mut out = Vec::new();
        for (p, mut linear) in by_pos {
            linear.sort_by_key(|(l, _)| *l);
            if linear.iter().map(|(l, _)| *l).eq(layers.iter().copied()) {
                out.push(StateSnapshot::from_parts(p, linear));
            }
        }
        out
    }
}
