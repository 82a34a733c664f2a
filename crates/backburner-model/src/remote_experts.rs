//! Routed experts held elsewhere (experts on workers, docs/EXPERTS.md): the seam between a mixture-of-experts block
//! and whatever holds some of its routed experts (workers over the link, or an in-process store in tests).
//!
//! A node loaded without some experts ([`crate::Model::from_checkpoint_without`]) runs a block as follows. Each
//! token's k routes are taken in ascending expert id (the order the local sum adds them in, from zero). Its pairs on
//! this node are computed here; those of a holder go to that holder as [`Segment`]s: the token's first run of pairs
//! on one holder (a prefix of its list) as one segment, every later remote pair as a segment of its own. A holder
//! answers one vector per segment, its pairs' weighted outputs `p · expert(x)` (each product rounded to f32) folded
//! from +0 in order; the node adds the segments' vectors and its own weighted outputs in the token's order. Since a
//! fold from +0 never yields −0 and a prefix segment continues the fold from +0, every sum is the local sum's, bit
//! for bit. Every holder is asked at once (one round trip per MoE layer per step) and the node computes its own
//! experts meanwhile.
//!
//! A failure is latched in the sequence's state ([`crate::ModelState::take_remote_error`]) as for KV pages held
//! elsewhere: the step's output is meaningless and the caller discards it.

use std::sync::{Arc, OnceLock};

use crate::remote::RemoteError;

/// One vector a holder answers: a row and, in ascending expert id, its (expert, weight) pairs, whose weighted
/// outputs the holder folds from +0.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// Index into the rows sent to this holder ([`HolderAsk::rows`]).
    pub row: u32,
    /// (expert id, routing weight) in strictly ascending expert id; at least one.
    pub pairs: Vec<(u32, f32)>,
}

/// What one holder is asked in one MoE block call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HolderAsk {
    /// Rows of the block's input (`[t, H]`) to send, each once, in ascending order.
    pub rows: Vec<u32>,
    /// The segments, in the order the answer's vectors come.
    pub segments: Vec<Segment>,
}

/// Holders of the routed experts a node does not hold.
pub trait RemoteExperts: Send + Sync {
    /// Which holder (an index into the asks of [`RemoteExperts::run`]) has `expert` of `layer`; `None` if none.
    fn holder(&self, layer: usize, expert: usize) -> Option<usize>;

    /// Holders in all.
    fn holders(&self) -> usize;

    /// Lets the next call reconnect a failed holder at once instead of after its backoff (a request retried once
    /// on fresh connections).
    fn retry_now(&self) {}

    /// Sends `asks[k]` (rows of `x`, `[t, hidden]` f32) to holder k for every k with segments, runs `local` (this
    /// node's own experts) exactly once meanwhile, and returns each holder's answer: `[asks[k].segments.len(),
    /// hidden]` f32 (empty for a holder with no segment).
    ///
    /// Errors: [`RemoteError`] when a holder is unreachable, refuses or answers wrongly; `local` may then not have
    /// run.
    fn run(
        &self,
        layer: usize,
        hidden: usize,
        x: &[f32],
        asks: &[HolderAsk],
        local: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<f32>>, RemoteError>;
}

/// A model's attached holders (at most one set, for the model's lifetime).
#[derive(Default)]
pub(crate) struct Attached(OnceLock<Arc<dyn RemoteExperts>>);

impl Attached {
    pub(crate) fn get(&self) -> Option<&Arc<dyn RemoteExperts>> {
        self.0.get()
    }

    pub(crate) fn set(&self, r: Arc<dyn RemoteExperts>) -> bool {
        self.0.set(r).is_ok()
    }
}

impl std::fmt::Debug for Attached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Attached({})", self.0.get().is_some())
    }
}
