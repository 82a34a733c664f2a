//! Verify steps of speculative decoding through a layer split: the last accepted token and the drafts go through the
//! host's layers and every worker's as one ubatch (one round trip per worker for all of them, where decoding them
//! one by one pays one per token), each side keeping what rolling back to any prefix needs. The host's
//! [`Session::keep_verified`] rolls its own layers back at once; the workers' rollback rides on their next request
//! (`RunLayers.verify`, protocol version 8).

use super::StageError;
use crate::error::Result;
use crate::session::Session;

/// What a verify step through the workers returns: the logits of every row `[T, vocab]` and, when the MTP block
/// drafts, the final-normed hidden rows `[T, H]`.
pub(crate) type VerifyOut = (Vec<f32>, Option<Vec<f32>>);

impl Session {
    /// A verify step of validated `ids` (`T` ≤ the ubatch) through the layer split, re-ingesting the history first
    /// when the workers' state was lost, and retried once on fresh worker sessions as a prefill is
    /// ([`Session::prefill_chain`]). Errors: [`crate::EngineError::WorkerLost`] /
    /// [`crate::EngineError::WorkerUnavailable`]; the session keeps its tokens (without `ids`).
    pub(crate) fn verify_chain(&mut self, ids: &[u32]) -> Result<VerifyOut> {
        self.chain_retry(ids.len(), |s| s.chain_verify_attempt(ids))
    }

    fn chain_verify_attempt(&mut self, ids: &[u32]) -> std::result::Result<VerifyOut, StageError> {
        self.chain_sync()?;
        let t = ids.len();
        let (model, pool) = (&self.model, &self.opts.pool);
        let chain = self.chain.as_mut().expect("a layer-split session");
        let x = chain.verify(model, &mut self.state, ids, pool)?;
        let logits = pool
            .install(|| model.logits(&x, t))
            .expect("a layer-split host holds the head");
        let hidden = self.mtp.is_some().then(|| {
            pool.install(|| model.final_hidden(&x, t))
                .expect("a layer-split host holds the final norm")
        });
        // the workers' state is the host's again (a rebuild, if one was pending, ran in chain_sync)
        self.rebuild = false;
        Ok((logits, hidden))
    }
}
