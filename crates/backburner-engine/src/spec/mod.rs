//! Speculative decoding, the parts that do not depend on the model: draft sources, the draft length controller and
//! the rules that accept or reject drafted tokens against the logits of a verify step.
//!
//! # One speculative step
//! A sequence holds its tokens so far, the last of them decoded by the coming step (the *pending* token). A step:
//! 1. [`AdaptiveDraft::next_k`] chooses how many tokens to draft, `k` in `0..=draft_max` (0: a plain decode step);
//! 2. a [`DraftSource`] proposes up to `k` tokens `d_1..d_j` after the tokens ([`NgramDraft`] from the conversation
//!    itself, [`ScriptedDraft`] for benchmarks, the model's MTP block or a draft model elsewhere);
//! 3. the model runs one verify step over `T = j + 1` positions (the pending token, then the drafts) and returns
//!    logits `[T, vocab]`: row `i` is the distribution after `d_i` (row 0: after the pending token);
//! 4. the accept rule keeps a prefix `d_1..d_a` and gives the token after it: the correction at the first draft it
//!    rejects, or the bonus token of the last row when it keeps them all ([`crate::Picker::verify`], [`accept`],
//!    [`accept_greedy`]); the step thus emits `a + 1` tokens;
//! 5. the caller rolls the model's state back to the pending token and the kept drafts (positions past them are
//!    discarded), makes the emitted token the new pending one, and reports the outcome to the source
//!    ([`DraftSource::observe`]) and to the controller ([`AdaptiveDraft::observe`]).
//!
//! # Exactness
//! * Greedy: a draft is kept iff it is the argmax of its row (ties to the lowest id, as [`crate::argmax`]), and the
//!   emitted token is the argmax of the first row not matched, so the output is the one of plain greedy decoding.
//! * Sampling with deterministic drafts (n-gram, scripted, greedy MTP: `q` a point mass, [`DraftProbs::PointMass`]):
//!   the standard rule keeps `d` with probability `min(1, p(d) / 1) = p(d)` and on rejection draws from
//!   `normalize(max(0, p − δ_d))`, which is `p` without `d`. Drawing `x ~ p` with the sampler and keeping `d` iff
//!   `x = d` (else emitting `x`) realizes exactly that law, and it is what this module does: each row is picked as
//!   plain decoding picks it, with the same RNG draw, so speculative sampling with such drafts gives the same tokens
//!   as plain sampling for the same seed, not only the same distribution.
//! * Sampling with sampled drafts (a draft model drawing `d_i ~ q_i`, [`DraftProbs::Sampled`]): Leviathan et al.
//!   (2023) / Chen et al. (2023): keep `d` iff `u · q(d) < p(d)` with `u` uniform in [0, 1) from the sampler's
//!   seeded RNG, else draw from `normalize(max(0, p − q))` ([`verify_row`]). The output has the distribution of plain
//!   sampling; the tokens differ from a plain run's for the same seed (the RNG is used differently), and a run is
//!   reproducible for a seed.
//!
//! `p` is the distribution the sampler draws from at that row ([`crate::Sampler::distribution`]): temperature,
//! top-k, top-p and min-p on the logits after the penalties, the bias and a grammar's mask. The penalties at row `i`
//! count the drafts kept before it; a row is only consulted once every draft before it is kept, so the adjustments
//! of row `i` are those for the context ending with `d_i`.
//!
//! # Penalties and grammar masks
//! [`crate::Picker::verify`] takes the model's rows and applies the penalties, the bias and the grammar's mask to
//! each row when it reaches it, as [`crate::Picker::pick`] does, and records each kept token (penalty counts, the
//! grammar advancing past it) before it looks at the next row. The grammar therefore never takes a token that is
//! not kept and needs no rollback; a draft the grammar forbids has `p = 0` and is rejected. The lower-level
//! [`accept`] and [`verify_row`] take logits or distributions *after* whatever adjustment and masking the caller
//! applies: row `i` must already be adjusted for the context ending with `d_i` (a caller that masks rows ahead of
//! the decision must advance its grammar through the drafts and roll it back itself).

mod accept;
mod adaptive;
mod ngram;
mod params;
mod scripted;
#[cfg(test)]
mod tests_accept;
#[cfg(test)]
mod tests_stat;

pub use crate::picker::Verified;
pub use accept::{accept, accept_greedy, verify_row, Accepted, RowVerdict};
pub use adaptive::{best_k, expected_tokens, AdaptiveConfig, AdaptiveDraft, CostModel, SpecStats};
pub use ngram::{NgramDraft, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, MAX_NGRAM};
pub use params::{SpecCounts, SpecParams, SpecSource, Speculator, MAX_DRAFT};
pub use scripted::ScriptedDraft;

use crate::error::{EngineError, Result};

/// Drafted tokens and how they were drawn, filled by [`DraftSource::propose`] (reused across steps).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    /// The drafted ids `d_1..d_j`, in order.
    pub tokens: Vec<u32>,
    /// Empty: every draft is deterministic (a point mass). Otherwise `[tokens.len(), vocab]` f32: row `i` the
    /// probabilities `q_i` of the distribution `tokens[i]` was drawn from (summing to 1).
    pub probs: Vec<f32>,
}

impl Draft {
    /// Empties both fields, keeping their buffers.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.probs.clear();
    }

    /// How the drafts were drawn, for the accept rules.
    pub fn q(&self) -> DraftProbs<'_> {
        if self.probs.is_empty() {
            DraftProbs::PointMass
        } else {
            DraftProbs::Sampled(&self.probs)
        }
    }
}

/// How drafted tokens were drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DraftProbs<'a> {
    /// Deterministically: `q_i` is a point mass at `d_i` (n-gram, scripted, greedy MTP drafts).
    PointMass,
    /// Sampled: `[k, vocab]` f32, row `i` the probabilities `q_i` that `d_i` was drawn from.
    Sampled(&'a [f32]),
}

impl<'a> DraftProbs<'a> {
    /// Row `i` of `[k, vocab]` sampled probabilities; `None` for point masses.
    pub(crate) fn row(&self, i: usize, vocab: usize) -> Option<&'a [f32]> {
        match *self {
            DraftProbs::PointMass => None,
            DraftProbs::Sampled(q) => q.get(i * vocab..(i + 1) * vocab),
        }
    }
}

/// Something that proposes tokens to verify.
pub trait DraftSource {
    /// Replaces `draft` with up to `max` tokens to follow `tokens` (prompt and output so far, ids `[n]`; the last is
    /// the pending token, which the verify step decodes first). Proposing none is allowed (the step is then a plain
    /// decode step). `tokens` may differ from an earlier call's beyond their common prefix (a rollback or a rewind):
    /// sources keep up by themselves.
    ///
    /// Errors: those of the source (a model's, for an MTP or draft-model source; [`EngineError::InvalidInput`] for
    /// tokens it cannot index).
    fn propose(&mut self, tokens: &[u32], max: usize, draft: &mut Draft) -> Result<()>;

    /// The outcome of verifying the last proposal: its first `accepted` tokens were kept and `next` followed them
    /// (for sources with a state of their own; the default ignores it).
    fn observe(&mut self, accepted: usize, next: u32) {
        let _ = (accepted, next);
    }

    /// A short name for logs and metrics (`ngram`, `scripted`, `mtp`).
    fn name(&self) -> &'static str;
}

/// Checks a verify step's shapes: `rows` `[drafts.len() + 1, vocab]` with `vocab ≥ 1`, drafts inside the
/// vocabulary, sampled `q` `[drafts.len(), vocab]`. Returns `vocab`. Errors: [`EngineError::InvalidInput`].
pub(crate) fn check_rows(rows: &[f32], drafts: &[u32], q: DraftProbs<'_>) -> Result<usize> {
    let t = drafts.len() + 1;
    let bad = |m: String| Err(EngineError::InvalidInput(m));
    if rows.is_empty() || !rows.len().is_multiple_of(t) {
        return bad(format!(
            "verify logits of {} values are not {t} rows (one per draft and one more)",
            rows.len()
        ));
    }
    let vocab = rows.len() / t;
    if let Some(d) = drafts.iter().find(|&&d| d as usize >= vocab) {
        return bad(format!(
            "draft token {d} is outside the vocabulary of {vocab}"
        ));
    }
    if let DraftProbs::Sampled(q) = q {
        if q.len() != drafts.len() * vocab {
            return bad(format!(
                "draft probabilities of {} values are not [{}, {vocab}]",
                q.len(),
                drafts.len()
            ));
        }
    }
    Ok(vocab)
}
