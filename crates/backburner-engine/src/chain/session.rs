//! A session in layer split: prefill and decode through the host's layers and the workers', rebuilding the
//! workers' state from the token history after a loss.

use std::sync::Arc;

use backburner_kernels::profile::{self, Phase};
use backburner_model::Model;

use super::{LayerSplit, StageError};
use crate::connection::SessionShape;
use crate::error::{EngineError, Result};
use crate::grid::Grid;
use crate::session::{Logits, Session, SessionOptions};

impl Session {
    /// A session whose layers past the host's run on workers (layer split): `model` holds layers `[0, L₁)`, the
    /// embedding, the final norm and the head, where L₁ is the first worker's first layer; the workers connect on
    /// the first prefill. Logits are bit-identical to a local session's with the same ubatch and page size.
    ///
    /// Errors: [`EngineError::InvalidSetting`] for a model that does not hold exactly `[0, L₁)` and the ends, a
    /// KV budget (KV offload and layer split do not combine yet), and the settings [`Session::new`] refuses.
    pub fn with_layer_split(
        model: Arc<Model>,
        opts: SessionOptions,
        chain: LayerSplit,
    ) -> Result<Self> {
        if opts.kv_budget.is_some() {
            return Err(EngineError::InvalidSetting(
                "--kv-budget (KV offload) does not combine with a layer split yet".into(),
            ));
        }
        let mut s = Session::assemble(model, opts, chain.host_end())?;
        s.chain = Some(chain);
        Ok(s)
    }

    /// The layer split's workers and their counters (`None` when the host holds every layer).
    pub fn layer_split(&self) -> Option<&LayerSplit> {
        self.chain.as_ref()
    }

    /// Prefill of validated ids through the layer split, re-ingesting the history first when the workers' state
    /// was lost or the session was rewound. A worker that loses the session it had — it evicted it for another
    /// host's memory, the connection dropped, a deadline passed — does not fail the request: every worker's session
    /// is re-established at once and the history re-ingested (replaying its own calls, so with the same bits), once
    /// per request. A worker that cannot be connected, or fails again, fails the request with a typed error.
    pub(crate) fn prefill_chain(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        profile::set_phase(if ids.len() == 1 {
            Phase::Decode
        } else {
            Phase::Prefill
        });
        self.chain_retry(ids.len(), |s| s.chain_attempt(ids, which, progress))
    }

    /// Runs `attempt` (a call of `n` new tokens through the workers), and once more on fresh worker sessions after a
    /// worker lost its session in it (see [`Session::prefill_chain`]); a failure to connect, or a second failure,
    /// is the request's typed error.
    pub(super) fn chain_retry<T>(
        &mut self,
        n: usize,
        mut attempt: impl FnMut(&mut Self) -> std::result::Result<T, StageError>,
    ) -> Result<T> {
        let first = match attempt(self) {
            Ok(logits) => return Ok(logits),
            Err(e) if e.connecting => return Err(self.chain_lost(e, None)),
            Err(e) => e,
        };
        let chain = self.chain.as_ref().expect("a layer-split session");
        let earlier = (
            chain.stages[first.stage.min(chain.stages.len() - 1)]
                .addr()
                .to_string(),
            first.error.to_string(),
        );
        let lost = self.chain_lost(first, None);
        tracing::warn!(
            "{lost}: re-establishing the workers' sessions and re-ingesting {} tokens of history, then the {} of \
             this step, within this request",
            self.history.len(),
            n
        );
        match attempt(self) {
            Ok(out) => {
                let chain = self.chain.as_mut().expect("a layer-split session");
                chain.stats.retries += 1;
                Ok(out)
            }
            Err(e) => Err(self.chain_lost(e, Some(earlier))),
        }
    }

    /// One try of [`Session::prefill_chain`]: connects the workers (rebuilding their state from the history when it
    /// is not the host's), then runs `ids`. On success the call is appended to the history.
    fn chain_attempt(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut dyn FnMut(usize, usize),
    ) -> std::result::Result<Vec<f32>, StageError> {
        // exact checkpoints: the host's layers here, the workers' on the workers (`RunLayers.keep`)
        let capture = self.capture_begin(ids.len());
        let keep: Vec<usize> = self.marks.clone();
        self.chain
            .as_mut()
            .expect("a layer-split session")
            .set_keep(&keep);
        let r = self
            .chain_sync()
            .and_then(|()| self.chain_run(ids, which, progress));
        match r {
            Ok(logits) => {
                let grid = Grid::new(self.opts.ubatch);
                let n0 = self.history.len();
                for r in grid.ubatches(n0, ids.len()) {
                    self.history.push_call(&ids[r.start - n0..r.end - n0], grid);
                }
                self.capture_end(capture);
                self.rebuild = false;
                Ok(logits)
            }
            Err(e) => {
                self.capture_discard(capture);
                Err(e)
            }
        }
    }

    /// Connects the workers that have no session; when their state is not the host's (a loss, a rewind they could
    /// not follow, a `clear`), closes every session first and re-ingests the history through fresh ones.
    pub(super) fn chain_sync(&mut self) -> std::result::Result<(), StageError> {
        let shape = SessionShape {
            kv: self.opts.kv.dtype,
            page: self.opts.kv.page_size,
            ubatch: self.opts.ubatch,
        };
        let pos = self.state.n_tokens();
        let chain = self.chain.as_mut().expect("a layer-split session");
        let rebuild = self.rebuild || !chain.in_step(pos) || pos != self.history.len();
        if !rebuild {
            return chain.connect(self.model.config(), shape);
        }
        chain.reset();
        self.state.clear();
        chain.connect(self.model.config(), shape)?;
        if self.history.is_empty() {
            return Ok(());
        }
        // the history's own calls again: the same bits as when they first ran
        let toks = self.history.tokens();
        let hist: Vec<&[u32]> = self
            .history
            .calls(Grid::new(self.opts.ubatch))
            .into_iter()
            .map(|r| &toks[r])
            .collect();
        chain.run(
            &self.model,
            &mut self.state,
            &hist,
            &self.opts.pool,
            &mut |_, _| {},
            &mut |_, _, _| {},
        )?;
        chain.stats.rebuilds += 1;
        Ok(())
    }

    /// Runs `ids` (on the grid from the history's end) through the host's layers and the workers, whose state is
    /// the host's, and returns the logits of `which`.
    fn chain_run(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut dyn FnMut(usize, usize),
    ) -> std::result::Result<Vec<f32>, StageError> {
        let grid = Grid::new(self.opts.ubatch);
        let n0 = self.history.len();
        let calls = grid.ubatches(n0, ids.len());
        let chunks: Vec<&[u32]> = calls
            .iter()
            .map(|r| &ids[r.start - n0..r.end - n0])
            .collect();
        let last = chunks.len() - 1;
        let (model, pool) = (&self.model, &self.opts.pool);
        let hidden = model.config().hidden_size;
        let mut logits = Vec::new();
        // the MTP block takes every position's final-normed hidden row
        let mut mtp_rows: Option<Vec<Vec<f32>>> = self.mtp.is_some().then(Vec::new);
        let chain = self.chain.as_mut().expect("a layer-split session");
        chain.run(
            model,
            &mut self.state,
            &chunks,
            pool,
            progress,
            &mut |k, x, t| {
                if let Some(rows) = mtp_rows.as_mut() {
                    rows.push(
                        pool.install(|| model.final_hidden(&x, t))
                            .expect("a layer-split host holds the final norm"),
                    );
                }
                let rows = match which {
                    Logits::All => 0..t,
                    Logits::Last if k == last => t - 1..t,
                    Logits::Last => return,
                };
                let n = rows.len();
                let part = &x[rows.start * hidden..rows.end * hidden];
                logits.extend(
                    pool.install(|| model.logits(part, n))
                        .expect("a layer-split host holds the head"),
                );
            },
        )?;
        for ((r, chunk), rows) in calls.iter().zip(&chunks).zip(mtp_rows.unwrap_or_default()) {
            self.mtp_feed(r.start, chunk, &rows);
        }
        Ok(logits)
    }

    /// After a worker failure ([`EngineError::WorkerLost`], or [`EngineError::WorkerUnavailable`] when it failed
    /// while connecting and nothing was lost in this request): the workers' sessions are closed, the host's state is
    /// dropped and the tokens kept for the next request's rebuild. `earlier`: the worker and reason of the failure
    /// this request was retried after (the error is then a loss, and says so).
    fn chain_lost(&mut self, e: StageError, earlier: Option<(String, String)>) -> EngineError {
        let chain = self.chain.as_mut().expect("a layer-split session");
        let stage = &chain.stages[e.stage.min(chain.stages.len() - 1)];
        let (addr, layers) = (stage.addr().to_string(), stage.range());
        chain.fail(&e);
        self.state.clear();
        self.rebuild = !self.history.is_empty();
        let layers = format!("{}..{}", layers.start, layers.end);
        let mut reason = e.error.to_string();
        if let Some((first_addr, first)) = &earlier {
            reason = if *first_addr == addr {
                format!("{reason}; retried once on a fresh session after: {first}")
            } else {
                format!(
                    "{reason}; retried once on fresh sessions after {first_addr} failed: {first}"
                )
            };
        }
        if e.connecting && earlier.is_none() {
            EngineError::WorkerUnavailable {
                addr,
                layers,
                reason,
            }
        } else {
            EngineError::WorkerLost {
                addr,
                layers,
                reason,
                kept: self.history.len(),
            }
        }
    }
}

impl LayerSplit {
    /// Builds a chain from worker layer ranges and their connections (see [`LayerSplit::new`]).
    pub fn from_parts(
        cfg: &backburner_model::ModelConfig,
        parts: Vec<(crate::connection::Connection, std::ops::Range<usize>)>,
    ) -> Result<Self> {
        LayerSplit::new(
            cfg,
            parts
                .into_iter()
                .map(|(c, r)| super::Stage::new(c, r))
                .collect(),
        )
    }
}
