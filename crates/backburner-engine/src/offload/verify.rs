//! Verify steps of speculative decoding under a KV budget: before the step the oldest pages move to workers as a
//! decode step's would (whole pages, so the step's own rows stay on the host and its rollback only truncates host
//! rows), the step attends through the workers' pages (their partials for all T rows at once: one round trip per
//! worker and attention layer for the whole step), and a worker lost in it is recovered as a prefill's loss is:
//! the history is re-ingested with the workers left and the step runs again.

use super::flow::Failure;
use super::LinkPages;
use crate::chain::VerifyOut;
use crate::error::{EngineError, Result};
use crate::session::{Logits, Session};

impl Session {
    /// Whether a verify step of `t` positions takes the budgeted path: a KV budget with pages on workers, a pending
    /// rebuild, or a step that passes the budget.
    pub(crate) fn verify_offloads(&self, t: usize) -> bool {
        self.budget_positions().is_some() && (self.rebuild || self.offload_needed(t))
    }

    /// The most positions a verify step may run under the KV budget: with a worker attached, up to one page past
    /// what the host holds below the budget (at most one page moves for it, as for a decode step at the budget);
    /// without one, up to the budget. `None` without a budget.
    pub(crate) fn verify_budget_room(&self) -> Option<usize> {
        let b = self.budget_positions()?;
        let on_host = self.state.n_tokens() - self.state.offloaded();
        Some(match self.lock_workers().is_empty() {
            true => b.saturating_sub(self.history.len()),
            false => b.saturating_sub(on_host) + self.opts.kv.page_size,
        })
    }

    /// A verify step of validated `ids` under the KV budget: re-ingests the history first when a rebuild is
    /// pending, moves pages as needed, and runs the step attending through the workers' pages. A worker lost in it
    /// drops the state for a rebuild and the step runs again (at most once per worker).
    ///
    /// Errors: [`EngineError::KvBudget`] when the pages cannot move (no room on any worker, workers kept failing);
    /// the session keeps its tokens (without `ids`).
    pub(crate) fn verify_budgeted(&mut self, ids: &[u32]) -> Result<VerifyOut> {
        let n_workers = self.lock_workers().len();
        let mut losses = 0usize;
        loop {
            if self.rebuild {
                // re-ingest the history alone (the same calls, so the same bits)
                self.prefill_budgeted(&[], Logits::Last, &mut |_, _| {})?;
            }
            let why = match self.attempt_verify(ids) {
                Ok(out) => return Ok(out),
                Err(Failure::Refused(e)) => return Err(e),
                Err(Failure::Lost(why)) => why,
            };
            self.offload_stats.offload_failures += 1;
            tracing::warn!(
                "KV pages on a worker were lost in a verify step ({why}); re-ingesting {} tokens of history, then \
                 the step again",
                self.history.len()
            );
            self.drop_state_for_rebuild();
            losses += 1;
            if losses > n_workers {
                let need = self.history.len() + ids.len();
                return Err(self.budget_error(need, format!("workers kept failing ({why})")));
            }
        }
    }

    /// One try of [`Session::verify_budgeted`]: on `Lost` the state is partly changed (the caller drops it).
    fn attempt_verify(&mut self, ids: &[u32]) -> std::result::Result<VerifyOut, Failure> {
        self.make_room(ids.len())?;
        if self.state.offloaded() > 0 {
            let (head_dim, ps) = (self.model.config().head_dim, self.opts.kv.page_size);
            let lp = LinkPages::new(self.workers.clone(), self.placement.clone(), head_dim, ps);
            self.state.set_remote(Box::new(lp));
        }
        let hidden = self.mtp.is_some();
        let (model, state) = (&self.model, &mut self.state);
        let out = self
            .opts
            .pool
            .install(|| crate::session_verify::verify_rows(model, ids, state, hidden));
        self.state.take_remote();
        if let Some(e) = self.state.take_remote_error() {
            return Err(Failure::Lost(e.to_string()));
        }
        out.map_err(|e| Failure::Refused(EngineError::InvalidSetting(format!("verify step: {e}"))))
    }
}
