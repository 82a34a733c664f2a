//! The accept rules over a verify step's logits (see the module documentation of [`crate::spec`]).

use super::{check_rows, DraftProbs};
use crate::error::{EngineError, Result};
use crate::sampling::{argmax, Distribution, Sampler};

/// What an accept rule kept of a draft.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accepted {
    /// How many drafts were kept (a prefix: `drafts[..accepted]`).
    pub accepted: usize,
    /// The token after them: the correction at the first draft not kept, or the bonus token of the last row when
    /// every draft was kept. The step emits `drafts[..accepted]` then `next`.
    pub next: u32,
}

/// The decision on one drafted token ([`verify_row`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowVerdict {
    /// The draft is kept.
    Accept,
    /// The draft is rejected; this token (drawn from the residual distribution) follows the kept ones instead.
    Reject(u32),
}

/// Greedy accept: keeps the longest prefix of `drafts` where `d_i` is the argmax of row `i − 1` of `rows`
/// (`[drafts.len() + 1, vocab]` f32, after any adjustment or mask; ties to the lowest id, as [`argmax`] and the
/// greedy sampler break them); `next` is the argmax of the first row not matched, or of the last row. The tokens
/// equal those of decoding the rows one at a time with argmax.
///
/// Errors: [`EngineError::InvalidInput`] when `rows` is not `drafts.len() + 1` rows of `vocab ≥ 1` values or a draft
/// is outside the vocabulary.
pub fn accept_greedy(rows: &[f32], drafts: &[u32]) -> Result<Accepted> {
    let vocab = check_rows(rows, drafts, DraftProbs::PointMass)?;
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let best = argmax(row);
        if drafts.get(i) != Some(&best) {
            return Ok(Accepted {
                accepted: i,
                next: best,
            });
        }
    }
    unreachable!("the last row has no draft")
}

/// The accept rule with `sampler`'s settings and seeded RNG, over `rows` (`[drafts.len() + 1, vocab]` f32) that the
/// caller has already adjusted and masked: row `i` for the context ending with `d_i` (see the module documentation).
/// Point-mass drafts, and greedy settings, use [`Sampler::sample`] on each row until a token differs from its draft
/// (the draws of plain sampling); sampled drafts use [`verify_row`]; the bonus row is sampled as plain decoding does.
///
/// Errors: [`EngineError::InvalidInput`] for shapes as in [`accept_greedy`], sampled `q` not `[drafts.len(), vocab]`,
/// or a sampled draft with `q = 0`.
pub fn accept(
    sampler: &mut Sampler,
    rows: &[f32],
    drafts: &[u32],
    q: DraftProbs<'_>,
) -> Result<Accepted> {
    let vocab = check_rows(rows, drafts, q)?;
    let point = matches!(q, DraftProbs::PointMass) || sampler.params().temperature <= 0.0;
    let mut dist = Distribution::default();
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let Some(&d) = drafts.get(i) else {
            return Ok(Accepted {
                accepted: i,
                next: sampler.sample(row),
            });
        };
        let id = match q.row(i, vocab) {
            Some(q_row) if !point => {
                sampler.distribution(row, &mut dist);
                match verify_row(sampler, &dist, d, q_row)? {
                    RowVerdict::Accept => d,
                    RowVerdict::Reject(x) => x,
                }
            }
            _ => sampler.sample(row),
        };
        if id != d {
            return Ok(Accepted {
                accepted: i,
                next: id,
            });
        }
    }
    unreachable!("the last row has no draft")
}

/// The standard speculative-sampling rule for one token `draft` drawn from `q` (`[vocab]` f32 probabilities), with
/// target distribution `p` ([`Sampler::distribution`] of the row, after the caller's adjustments and masks): keeps
/// it iff `u · q(draft) < p(draft)` (probability `min(1, p/q)`), `u` one uniform draw of the sampler's RNG; otherwise
/// draws the token from `normalize(max(0, p − q))` with a second draw (from `p` itself in the degenerate case where
/// rounding leaves no residual mass, which needs `p ≤ q` everywhere, so `p = q`).
///
/// Errors: [`EngineError::InvalidInput`] when `draft` is outside `q` or `q(draft)` is not a positive finite number
/// (a token drawn from `q` has `q > 0`).
pub fn verify_row(
    sampler: &mut Sampler,
    p: &Distribution,
    draft: u32,
    q: &[f32],
) -> Result<RowVerdict> {
    let qd = q.get(draft as usize).copied().unwrap_or(f32::NAN) as f64;
    if !(qd > 0.0 && qd.is_finite()) {
        return Err(EngineError::InvalidInput(format!(
            "draft token {draft} has draft probability {qd}: a sampled draft needs q > 0"
        )));
    }
    let pd = p.prob(draft);
    if sampler.uniform() * qd < pd {
        return Ok(RowVerdict::Accept);
    }
    let residual = |at: usize| {
        let qi = q.get(p.ids()[at] as usize).copied().unwrap_or(0.0) as f64;
        (p.probs()[at] - qi.max(0.0)).max(0.0)
    };
    let n = p.ids().len();
    let total: f64 = (0..n).map(residual).sum();
    let u = sampler.uniform();
    let id = if total > 0.0 {
        walk(p.ids(), (0..n).map(residual), u * total)
    } else {
        walk(p.ids(), p.probs().iter().copied(), u)
    };
    Ok(RowVerdict::Reject(id))
}

/// The first id whose running sum of `weights` reaches `r` (the last id with a positive weight if rounding leaves
/// `r` above the total).
fn walk(ids: &[u32], weights: impl Iterator<Item = f64>, mut r: f64) -> u32 {
    let mut last = ids[0];
    for (&id, w) in ids.iter().zip(weights) {
        if w <= 0.0 {
            continue;
        }
        last = id;
        r -= w;
        if r <= 0.0 {
            return id;
        }
    }
    last
}
