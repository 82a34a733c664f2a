//! The step plan: for each forward step of a session (a prefill, a decode step, a verify step), which positions it
//! covers and which **executor** runs it — every layer here, a split-prefill worker mirroring a tail of the layers,
//! the KV budget's path attending through the workers' pages, a layer split's chain of workers, or experts on the
//! workers. [`Session::plan_step`] is the one place that decides (docs/ENGINE_CORE.md, item 4); `prefill` and
//! `verify` run what it says.

use std::ops::Range;

use crate::session::{Logits, Session};

/// What kind of forward step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// A prefill or a decode step (a prefill of one token): ubatches on the grid.
    Prefill,
    /// A verify step of speculative decoding: one ubatch whose rows have one-token steps' bits, rolled back after.
    Verify,
}

/// Where a step runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Executor {
    /// Every layer on this host.
    Local,
    /// The tail of the layers on a split-prefill worker (prompts only; the host keeps the last ubatch).
    SplitPrefill,
    /// Here, attending through the oldest KV pages on workers (moving pages there first when the step passes the
    /// KV budget), recovering lost pages from the history.
    KvOffload,
    /// Through the layer split's workers, each holding the only copy of its layers.
    LayerSplit,
    /// Here, with the routed experts on workers.
    RemoteExperts,
}

/// One step: its positions, kind and executor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepPlan {
    /// The positions the step computes (`history.len()..history.len() + n`).
    pub positions: Range<usize>,
    /// Prefill or verify.
    pub kind: StepKind,
    /// Where it runs.
    pub executor: Executor,
}

impl Session {
    /// The plan of a step of `n` tokens of `kind` from the session's position (`which`: the logits a prefill
    /// returns; split prefill runs only when the last position's are wanted). Decides, in order: a layer split runs
    /// every step through its workers; experts on workers run prefills with them (verify steps do not run there:
    /// [`Session::verify_room`] is 0); the KV budget's path runs a step when pages are on workers, a rebuild is
    /// pending or the step passes the budget; a prompt long enough for the attached split-prefill worker goes to it;
    /// everything else runs here.
    pub fn plan_step(&self, n: usize, kind: StepKind, which: Logits) -> StepPlan {
        let pos = self.history.len();
        let executor = if self.chain.is_some() {
            Executor::LayerSplit
        } else if kind == StepKind::Verify {
            match self.verify_offloads(n) {
                true => Executor::KvOffload,
                false => Executor::Local,
            }
        } else if self.model.has_remote_experts() && self.opts.kv_budget.is_none() {
            Executor::RemoteExperts
        } else if self.offload_needed(n) {
            Executor::KvOffload
        } else if which == Logits::Last && self.split_prefill_wants(n) {
            Executor::SplitPrefill
        } else {
            Executor::Local
        };
        StepPlan {
            positions: pos..pos + n,
            kind,
            executor,
        }
    }

    /// Whether the first attached worker takes a prefill of `n` tokens (split prefill): never with layers placed on
    /// a device (split prefill hands layer states to and from the CPU path's; the workers then hold KV pages only).
    pub(crate) fn split_prefill_wants(&self, n: usize) -> bool {
        if !self.model.placement().is_empty() {
            return false;
        }
        let ws = self.lock_workers();
        ws.first().is_some_and(|w| w.wants(n, self.opts.ubatch))
    }
}
