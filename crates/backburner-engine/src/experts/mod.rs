//! Experts on workers (docs/EXPERTS.md): the host holds every layer but leaves out the routed experts of chosen
//! layers (all of a layer's experts, or a subset of ids), which workers hold; per MoE layer per step the host sends
//! each worker the rows routed to its experts, once per row, with the expert ids and weights, runs its own experts
//! meanwhile and adds the workers' weighted outputs in the local order: bit-identical to a local run
//! ([`backburner_model::remote_experts`]).
//!
//! A worker lost during a request (a dropped connection, an eviction, a deadline) does not fail it at once: the
//! session's state is dropped, the workers are reconnected at once and the history re-ingested (replaying its own
//! calls: the same bits), once per request. A worker that stays gone fails the request with
//! [`crate::EngineError::ExpertsLost`]; the session keeps its tokens, and no step that ran without an expert ever
//! reaches a sampler.

mod link;
pub(crate) mod wire;

use std::ops::Range;

pub use link::{ExpertHolder, LinkExperts};

use crate::error::{EngineError, Result};
use crate::offload::flow::Failure;
use crate::session::{Logits, Session};

/// Parses `--expert-split L1[,L2...]` for a model of `n_layers`: worker i holds every routed expert of layers
/// `[Li, Li+1)`, the last one up to the model's end. Errors: a message for an empty list, a layer past the model or
/// a list that does not increase.
pub fn layer_ranges(
    starts: &[usize],
    n_layers: usize,
) -> std::result::Result<Vec<Range<usize>>, String> {
    if starts.is_empty() {
        return Err("give the first layer each worker holds the experts of".into());
    }
    let mut out = Vec::with_capacity(starts.len());
    for (i, &a) in starts.iter().enumerate() {
        let b = starts.get(i + 1).copied().unwrap_or(n_layers);
        if a >= b || b > n_layers {
            return Err(format!(
                "--expert-split {} does not split this {n_layers}-layer model into increasing, non-empty ranges",
                starts.iter().map(|v| v.to_string()).collect::<Vec<_>>().join(",")
            ));
        }
        out.push(a..b);
    }
    Ok(out)
}

impl Session {
    /// Prefill of validated ids on a model with routed experts on workers: the budgeted flow's try (re-ingesting a
    /// dropped state first), once more on fresh connections after a worker's failure, then
    /// [`EngineError::ExpertsLost`].
    pub(crate) fn prefill_with_experts(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut impl FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        let mut retried = false;
        loop {
            match self.attempt_budgeted(ids, which, progress) {
                Ok(logits) => return Ok(logits),
                Err(Failure::Refused(e)) => return Err(e),
                Err(Failure::Lost(why)) if !retried => {
                    tracing::warn!(
                        "routed experts on a worker failed ({why}); reconnecting and re-ingesting {} tokens of \
                         history, then the {} of this step",
                        self.history.len(),
                        ids.len()
                    );
                    retried = true;
                    if let Some(rx) = self.model.remote_experts() {
                        rx.retry_now();
                    }
                }
                Err(Failure::Lost(why)) => {
                    return Err(EngineError::ExpertsLost {
                        reason: why,
                        kept: self.history.len(),
                    })
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn expert_split_ranges() {
        assert_eq!(super::layer_ranges(&[2], 4).unwrap()[0], 2..4);
        assert_eq!(super::layer_ranges(&[0, 3], 8), Ok(vec![0..3, 3..8]));
        for bad in [&[][..], &[4], &[3, 2], &[1, 1], &[9]] {
            assert!(super::layer_ranges(bad, 4).is_err(), "{bad:?}");
        }
    }
}
