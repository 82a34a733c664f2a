//! Verify steps for speculative decoding: a session runs the last accepted token and k drafts as one step of
//! `T = k + 1` positions, returns the logits of every position, then keeps the accepted prefix and drops the rest
//! (docs/ENGINE_CORE.md). The logits of a verify equal, bit for bit, those of decoding the same tokens one by one, so
//! what the caller samples from them is what plain decoding would have sampled.

use backburner_kernels::profile::{self, Phase};

use crate::error::{EngineError, Result};
use crate::session::{Logits, Session};
use crate::step_plan::{Executor, StepKind};

/// What an open verify step left to settle: where it started and how many positions it ran (the model state keeps
/// what its rollback needs: [`backburner_model::ModelState::rollback_verify`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpenVerify {
    pub(crate) pos0: usize,
    pub(crate) n: usize,
}

/// What the MTP block takes from an open verify step: its ids and final-normed hidden rows `[T, H]`.
#[derive(Debug, Default)]
pub(crate) struct VerifyRows {
    ids: Vec<u32>,
    hidden: Vec<f32>,
}

impl Session {
    /// Whether [`Session::verify`] can run a step of several positions here: locally or through a layer split's
    /// workers, with no KV page on a worker or due to move there and experts held here. Elsewhere a speculative
    /// caller drafts nothing and decodes one token per step.
    pub fn can_verify(&self) -> bool {
        !self.model.has_remote_experts()
    }

    /// The most positions one verify step may run now: with a KV budget, what the budget's path can make room for
    /// and at most one ubatch (the workers attend a ubatch of query rows at most); through a layer split at most one
    /// ubatch (a worker takes at most a ubatch per request); unbounded locally; 0 where [`Session::can_verify`] is
    /// false.
    pub fn verify_room(&self) -> usize {
        if !self.can_verify() {
            return 0;
        }
        let room = self.verify_budget_room().unwrap_or(usize::MAX);
        // a worker takes at most a ubatch of rows per request (a layer split's residual, KV offload's queries)
        match self.chain.is_some() || self.opts.kv_budget.is_some() {
            true => room.min(self.opts.ubatch),
            false => room,
        }
    }

    /// Runs `ids` (`[T]`: the last accepted token, then the drafts) at the next `T` positions and returns the logits
    /// of every position, `[T, vocab]` f32, equal bit for bit to `T` [`Session::decode`] calls. The step stays open
    /// until [`Session::keep_verified`] says how many positions to keep; until then the session holds all `T`.
    ///
    /// Errors: [`EngineError::EmptyPrompt`] for no ids, [`EngineError::ContextOverflow`], [`EngineError::Model`]
    /// for an id outside the vocabulary, [`EngineError::InvalidSetting`] for more ids than [`Session::verify_room`] or
    /// a verify step is still open: these leave the session as it was. Through a layer split, a worker's failure
    /// ([`EngineError::WorkerLost`], [`EngineError::WorkerUnavailable`]) after one retry on fresh worker sessions:
    /// the session keeps its tokens (without `ids`) and rebuilds the workers' state on its next call.
    pub fn verify(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let room = self.verify_room();
        if ids.len() > room {
            return Err(EngineError::InvalidSetting(format!(
                "a verify step of {} positions where {room} may run (Session::verify_room: experts on workers, the \
                 KV budget, a layer split's ubatch)",
                ids.len()
            )));
        }
        if self.open_verify.is_some() {
            return Err(EngineError::InvalidSetting(
                "the last verify step was not settled with keep_verified".into(),
            ));
        }
        self.check_fits(ids.len())?;
        self.model.check_ids(ids)?;
        profile::set_phase(Phase::Decode);
        let pos0 = self.history.len();
        let plan = self.plan_step(ids.len(), StepKind::Verify, Logits::All);
        let (logits, hidden) = if plan.executor == Executor::LayerSplit {
            self.verify_chain(ids)?
        } else if plan.executor == Executor::KvOffload {
            self.verify_budgeted(ids)?
        } else {
            let (model, state) = (&self.model, &mut self.state);
            let hidden = self.mtp.is_some();
            self.opts
                .pool
                .install(|| verify_rows(model, ids, state, hidden))
                .map_err(|e| EngineError::InvalidSetting(format!("verify step: {e}")))?
        };
        if let Some(hidden) = hidden {
            self.verify_rows = VerifyRows {
                ids: ids.to_vec(),
                hidden,
            };
        }
        // a verified position has the bits of a decode step: a rebuild replays it as one
        for &id in ids {
            self.history.push_call(&[id], self.grid());
        }
        self.open_verify = Some(OpenVerify { pos0, n: ids.len() });
        Ok(logits)
    }

    /// Settles the open verify step: keeps its first `m` positions (`1 ≤ m ≤ T`; the last accepted token and the
    /// `m − 1` drafts accepted) and drops the rest, as if only those `m` tokens had been decoded one by one.
    ///
    /// Panics (a caller bug) without an open verify step or with `m` outside `1..=T`.
    pub fn keep_verified(&mut self, m: usize) {
        let open = self
            .open_verify
            .take()
            .expect("keep_verified without an open verify step");
        let n = open.n;
        assert!((1..=n).contains(&m), "keep_verified({m}) outside 1..={n}");
        // the state manager's one way back: here the open verify step's rollback
        let (state, to) = (&mut self.state, open.pos0 + m);
        self.opts
            .pool
            .install(|| state.go_back(to, &[]))
            .expect("the session's open verify is the state's");
        self.history.truncate(open.pos0 + m);
        if let Some(chain) = self.chain.as_mut() {
            chain.kept_verified(open.pos0 + m);
        }
        if self.mtp.is_some() {
            let rows = std::mem::take(&mut self.verify_rows);
            let h = self.model.config().hidden_size;
            self.mtp_feed(open.pos0, &rows.ids[..m], &rows.hidden[..m * h]);
        }
    }

    /// Keeps every position of a verify step still open (a caller that moves on without settling it).
    pub(crate) fn settle_verify(&mut self) {
        if let Some(n) = self.open_verify.map(|o| o.n) {
            self.keep_verified(n);
        }
    }
}

/// [`backburner_model::Model::forward_verify`] on a node holding every layer, also returning the final-normed hidden
/// rows `[T, H]` (the MTP block's input) when `hidden`.
pub(crate) fn verify_rows(
    model: &backburner_model::Model,
    ids: &[u32],
    state: &mut backburner_model::ModelState,
    hidden: bool,
) -> std::result::Result<crate::chain::VerifyOut, String> {
    if !hidden {
        let logits = model
            .forward_verify(ids, state)
            .map_err(|e| e.to_string())?;
        return Ok((logits, None));
    }
    let t = ids.len();
    model.check_ids(ids).map_err(|e| e.to_string())?;
    let mut x = model.embed(ids).map_err(|e| e.to_string())?;
    let all = 0..model.config().num_hidden_layers;
    model
        .forward_layers_verify(all, &mut x, t, state)
        .map_err(|e| e.to_string())?;
    model.commit_tokens(state, t);
    let logits = model.logits(&x, t).map_err(|e| e.to_string())?;
    let hidden = model.final_hidden(&x, t).map_err(|e| e.to_string())?;
    Ok((logits, Some(hidden)))
}
