//! From one step's logits to the next token: the adjustments a request asks for, then the sampler, and the chosen
//! token's log-probability with the most likely alternatives when asked.
//!
//! The stages, in this order, on a copy of the logits (none is applied, and no copy made, when a request asks for
//! none of them, so that the logits sampled are the model's bits):
//! 1. **repetition penalty** (`repetition_penalty`, the CTRL / Hugging Face / vLLM meaning): every id that occurs in
//!    the prompt (cached prefix included) or the output so far has its logit divided by the penalty when positive,
//!    multiplied by it otherwise;
//! 2. **presence and frequency penalties** (OpenAI's meaning, as vLLM applies them): an id generated `c > 0` times
//!    so far loses `presence_penalty + c · frequency_penalty`; the prompt does not count;
//! 3. **logit bias**: each listed id gets its bias added (OpenAI's `logit_bias`, −100 … 100).
//!
//! The sampler ([`Sampler`]: temperature, top-k, top-p, min-p) then draws from the adjusted logits, and the
//! log-probabilities reported are those of the adjusted logits at temperature 1 (a log-softmax over the whole
//! vocabulary in f64, before temperature and truncation), so that a greedy pick is always the first alternative.
//! 4. **a grammar** ([`crate::constraint`]): tokens it does not allow get `-inf`.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

use crate::constraint::Constraint;
use crate::error::Result;
use crate::sampling::{Distribution, Sampler, SamplingParams};
use crate::spec::{DraftProbs, RowVerdict};

/// Most alternatives a step reports ([`TokenLogprob::top`]), as OpenAI's `top_logprobs` allows.
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probability of a sampled token and of the most likely tokens at its step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// The sampled id.
    pub id: u32,
    /// Its natural log-probability under the adjusted logits (≤ 0; `-inf` for a token of probability 0 in f64).
    pub logprob: f32,
    /// The most likely ids and their log-probabilities, most likely first (ties: lower id first); as many as asked.
    pub top: Vec<(u32, f32)>,
}

/// Picks each step's token for one sequence, remembering what it generated (for the penalties).
pub struct Picker {
    sampler: Sampler,
    /// Ids of the prompt and the output so far (the repetition penalty's set).
    seen: HashSet<u32>,
    /// How often each id was generated.
    counts: HashMap<u32, u32>,
    /// Alternatives to report per step (`None`: no log-probabilities).
    logprobs: Option<usize>,
    constraint: Option<Constraint>,
    adjusted: Vec<f32>,
}

impl std::fmt::Debug for Picker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Picker")
            .field("params", self.sampler.params())
            .field("logprobs", &self.logprobs)
            .finish_non_exhaustive()
    }
}

impl Picker {
    /// A picker for `params` after `context` (the ids the session holds and the prompt still to come: the repetition
    /// penalty's starting set), reporting `logprobs` alternatives per step (`Some(0)`: the chosen token's only;
    /// clamped to [`MAX_TOP_LOGPROBS`]), the output following `constraint` when given.
    pub fn new(
        params: SamplingParams,
        context: &[u32],
        logprobs: Option<usize>,
        constraint: Option<Constraint>,
    ) -> Self {
        let seen = if params.repetition_penalty != 1.0 {
            context.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Picker {
            sampler: Sampler::new(params),
            seen,
            counts: HashMap::new(),
            logprobs: logprobs.map(|n| n.min(MAX_TOP_LOGPROBS)),
            constraint,
            adjusted: Vec::new(),
        }
    }

    /// The sampling settings.
    pub fn params(&self) -> &SamplingParams {
        self.sampler.params()
    }

    /// Picks the next token from `logits` `[vocab]` f32 (finite) and records it as generated; with log-probabilities
    /// asked, also returns the chosen token's and the alternatives'.
    ///
    /// Errors: [`crate::EngineError::Constraint`] when the grammar engine fails.
    pub fn pick(&mut self, logits: &[f32]) -> Result<(u32, Option<TokenLogprob>)> {
        let l: &[f32] = if self.prepare(logits)? {
            &self.adjusted
        } else {
            logits
        };
        let id = self.sampler.sample(l);
        let lp = self.logprobs.map(|n| token_logprob(l, id, n));
        self.record(id)?;
        Ok((id, lp))
    }

    /// The distribution the next [`Picker::pick`] draws from for `logits` `[vocab]` f32, into `out`: the penalties,
    /// the bias and the grammar's mask applied as `pick` applies them, then temperature, top-k, top-p and min-p
    /// ([`Sampler::distribution`]). Records nothing and draws nothing.
    ///
    /// Errors: [`crate::EngineError::Constraint`] when the grammar engine fails.
    pub fn distribution(&mut self, logits: &[f32], out: &mut Distribution) -> Result<()> {
        let l: &[f32] = if self.prepare(logits)? {
            &self.adjusted
        } else {
            logits
        };
        self.sampler.distribution(l, out);
        Ok(())
    }

    /// Applies the penalties, the bias and the grammar's mask to a copy of `logits` in `self.adjusted` when any
    /// applies; false (no copy) when none does.
    fn prepare(&mut self, logits: &[f32]) -> Result<bool> {
        let p = self.sampler.params();
        let masked = self.constraint.as_ref().is_some_and(Constraint::active);
        let active = p.repetition_penalty != 1.0
            || ((p.presence_penalty != 0.0 || p.frequency_penalty != 0.0)
                && !self.counts.is_empty())
            || !p.logit_bias.is_empty()
            || masked;
        if active {
            self.adjusted.clear();
            self.adjusted.extend_from_slice(logits);
            adjust(&mut self.adjusted, p, &self.seen, &self.counts);
            if let Some(c) = self.constraint.as_mut() {
                c.mask(&mut self.adjusted)?;
            }
        }
        Ok(active)
    }

    /// Records `id` as generated: the grammar advances past it, the penalties count it.
    pub(crate) fn record(&mut self, id: u32) -> Result<()> {
        if let Some(c) = self.constraint.as_mut() {
            c.accept(id)?;
        }
        *self.counts.entry(id).or_default() += 1;
        if self.sampler.params().repetition_penalty != 1.0 {
            self.seen.insert(id);
        }
        Ok(())
    }

    /// Verifies drafted tokens against the logits of a verify step and records the tokens it keeps (speculative
    /// decoding, [`crate::spec`]).
    ///
    /// `rows` is `[drafts.len() + 1, vocab]` f32 (finite), row 0 the logits after the sequence's last token and row
    /// `i` those after draft `i − 1` (the model's logits, before any penalty or mask: this applies them, row by row,
    /// as [`Picker::pick`] would after the drafts kept so far). `q` is how the drafts were drawn
    /// ([`DraftProbs`]). Returns the drafts kept, a prefix of `drafts`, and the token that follows them.
    ///
    /// With deterministic drafts ([`DraftProbs::PointMass`]), or greedy settings, this is [`Picker::pick`] on each
    /// row in turn until a pick differs from its draft: the tokens, their log-probabilities and the RNG's draws are
    /// those of picking them one by one, so the output equals plain decoding token for token for the same seed.
    /// With drafts sampled from `q`, the standard rule ([`crate::spec::verify_row`]) keeps the output's
    /// distribution.
    ///
    /// Errors: [`crate::EngineError::InvalidInput`] when `rows` or `q` does not have the shape above or a sampled draft
    /// has `q = 0`; [`crate::EngineError::Constraint`] when the grammar engine fails.
    pub fn verify(&mut self, rows: &[f32], drafts: &[u32], q: DraftProbs<'_>) -> Result<Verified> {
        let vocab = crate::spec::check_rows(rows, drafts, q)?;
        let point = matches!(q, DraftProbs::PointMass) || self.sampler.params().temperature <= 0.0;
        let mut out = Verified::default();
        let mut dist = Distribution::default();
        for (i, row) in rows.chunks_exact(vocab).enumerate() {
            let Some(&d) = drafts.get(i) else {
                let (id, lp) = self.pick(row)?;
                out.next = id;
                out.logprobs.extend(lp);
                break;
            };
            let (id, kept) = if point {
                let (id, lp) = self.pick(row)?;
                out.logprobs.extend(lp);
                (id, id == d)
            } else {
                let l: &[f32] = if self.prepare(row)? {
                    &self.adjusted
                } else {
                    row
                };
                self.sampler.distribution(l, &mut dist);
                let q_row = q.row(i, vocab).unwrap_or_default();
                let id = match crate::spec::verify_row(&mut self.sampler, &dist, d, q_row)? {
                    RowVerdict::Accept => d,
                    RowVerdict::Reject(x) => x,
                };
                out.logprobs
                    .extend(self.logprobs.map(|n| token_logprob(l, id, n)));
                self.record(id)?;
                (id, id == d)
            };
            if !kept {
                out.next = id;
                break;
            }
            out.accepted += 1;
        }
        Ok(out)
    }
}

/// What [`Picker::verify`] kept of a draft.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Verified {
    /// How many drafts were kept (a prefix of them: `drafts[..accepted]`).
    pub accepted: usize,
    /// The token after them: the correction at the first draft not kept, or the bonus token of the last row when
    /// every draft was kept.
    pub next: u32,
    /// With log-probabilities asked, those of the kept drafts and of `next`, in order (`accepted + 1` entries).
    pub logprobs: Vec<TokenLogprob>,
}

/// Applies the penalties and the bias of `p` to `l` in place (stages 1–3 of the module's list).
fn adjust(l: &mut [f32], p: &SamplingParams, seen: &HashSet<u32>, counts: &HashMap<u32, u32>) {
    if p.repetition_penalty != 1.0 {
        let r = p.repetition_penalty;
        for &id in seen {
            if let Some(x) = l.get_mut(id as usize) {
                *x = if *x > 0.0 { *x / r } else { *x * r };
            }
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        for (&id, &c) in counts {
            if let Some(x) = l.get_mut(id as usize) {
                *x -= p.presence_penalty + c as f32 * p.frequency_penalty;
            }
        }
    }
    for &(id, b) in &p.logit_bias {
        if let Some(x) = l.get_mut(id as usize) {
            *x += b;
        }
    }
}

/// The log-softmax of `l` at `id` and its `n` largest entries (ties: lower id first), summed in f64.
pub fn token_logprob(l: &[f32], id: u32, n: usize) -> TokenLogprob {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = l.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |x: f32| (x as f64 - lse) as f32;
    // the n best by a small insertion-sorted buffer: (logit desc, id asc)
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &x) in l.iter().enumerate() {
            if top.len() == n && x <= top[n - 1].1 {
                continue;
            }
            let at = top.partition_point(|&(_, y)| y >= x);
            top.insert(at, (i as u32, x));
            top.truncate(n);
        }
    }
    TokenLogprob {
        id,
        logprob: lp(l[id as usize]),
        top: top.into_iter().map(|(i, x)| (i, lp(x))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::default();
        f(&mut p);
        p
    }

    #[test]
    fn log_softmax_values_and_the_top_in_order_with_ties_by_id() {
        let l = [1.0f32, 3.0, 3.0, -2.0, 0.5];
        let t = token_logprob(&l, 4, 3);
        let lse = (l.iter().map(|&x| (x as f64).exp()).sum::<f64>()).ln();
        assert_eq!(t.logprob, (0.5 - lse) as f32);
        let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, [1, 2, 0]);
        assert_eq!(t.top[0].1, (3.0 - lse) as f32);
        assert_eq!(t.top[2].1, (1.0 - lse) as f32);
        assert!(token_logprob(&l, 0, 0).top.is_empty());
    }

    #[test]
    fn without_adjustments_the_sampler_sees_the_model_logits() {
        let l = [0.1f32, 2.0, 1.9];
        let mut pk = Picker::new(SamplingParams::default(), &[1, 1, 1], Some(1), None);
        let (id, lp) = pk.pick(&l).unwrap();
        assert_eq!(id, 1);
        let lp = lp.unwrap();
        assert_eq!(lp.top, vec![(1, lp.logprob)]);
        assert!(pk.adjusted.is_empty(), "no copy without adjustments");
    }

    #[test]
    fn repetition_divides_positive_and_multiplies_negative_logits_of_seen_ids() {
        let p = params(|p| p.repetition_penalty = 2.0);
        let mut l = vec![4.0f32, -1.0, 3.0, 1.0];
        let seen: HashSet<u32> = [0, 1].into();
        adjust(&mut l, &p, &seen, &HashMap::new());
        assert_eq!(l, [2.0, -2.0, 3.0, 1.0]);
        // greedy: id 0 (4.0) loses to id 2 (3.0) once the prompt holds it
        let mut pk = Picker::new(p, &[0], None, None);
        assert_eq!(pk.pick(&[4.0, -1.0, 3.0, 1.0]).unwrap().0, 2);
        // and id 2, generated now, is penalized at the next step too
        assert_eq!(pk.pick(&[4.0, -1.0, 3.0, 2.5]).unwrap().0, 3); // [2, -1, 1.5, 2.5]
    }

    #[test]
    fn presence_and_frequency_count_generated_ids_only() {
        let p = params(|p| {
            p.presence_penalty = 0.5;
            p.frequency_penalty = 0.25;
        });
        let mut pk = Picker::new(p, &[2, 2, 2], Some(0), None);
        let l = [1.0f32, 0.2, 0.9];
        // the prompt's three 2s do not count; each pick does: 0 (1.0), 2 (0 at 0.25), 0 (2 at 0.15), 1 (0 at 0.0)
        let ids: Vec<u32> = (0..4).map(|_| pk.pick(&l).unwrap().0).collect();
        assert_eq!(ids, [0, 2, 0, 1]);
    }

    #[test]
    fn logit_bias_adds_and_reported_logprobs_are_of_the_adjusted_logits() {
        let p = params(|p| p.logit_bias = vec![(2, 5.0), (0, -100.0)]);
        let mut pk = Picker::new(p, &[], Some(2), None);
        let (id, lp) = pk.pick(&[3.0, 1.0, -1.0]).unwrap();
        assert_eq!(id, 2);
        let lp = lp.unwrap();
        assert_eq!(lp, token_logprob(&[-97.0, 1.0, 4.0], 2, 2));
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), [2, 1]);
    }
}
