//! The speculative step of a [`Sequence`]: its pending token and k drafted tokens run as one verify step
//! ([`Session::verify`]); then the rows are sampled in order exactly as plain decoding would sample them, and the
//! step stops at the first sampled token that differs from the draft in its place.
//!
//! Every draft source here is deterministic (a point mass on the drafted token: n-gram lookup, the MTP block drafting
//! greedily, a scripted source). For such a draft the standard speculative-sampling rule — accept `d` with
//! probability `p(d)`, on rejection sample from `p` without `d`, renormalized — gives each token the same distribution
//! as *sampling `x ~ p` and accepting iff `x = d`*, which is what this step does: each row is handed to the
//! sequence's own sampler ([`Sequence::sample_step`]: penalties, grammar, logprobs, stop conditions), whose draws
//! are those of plain decoding in the same order. So the output is not only distributed as without speculation: with
//! the same seed it is the same token sequence, greedy or sampled.

use super::{Phase, Sampled, Sequence};
use crate::error::Result;
use crate::session::Session;

impl Sequence<'_> {
    /// Whether this sequence speculates ([`crate::GenerateParams::spec`]).
    pub fn speculates(&self) -> bool {
        self.spec.is_some()
    }

    /// What speculation did so far (`None` when this sequence does not speculate).
    pub fn spec_counts(&self) -> Option<crate::spec::SpecCounts> {
        self.spec.as_ref().map(|s| s.counts())
    }

    /// One speculative step of a sequence that speculates, in phase [`Phase::Decode`], on a session that can
    /// verify: drafts from its source, then [`Sequence::spec_step`]. `None` when it does not apply or no draft was
    /// proposed this step: then the caller decodes the pending token plainly (alone or batched).
    ///
    /// Errors (inside the `Some`): the draft source's, and those of [`Sequence::sample_step`].
    pub fn speculate(
        &mut self,
        session: &mut Session,
        cancelled: bool,
    ) -> Option<Result<Vec<Sampled>>> {
        if self.phase != Phase::Decode || !session.can_verify() {
            return None;
        }
        let pending = self.pending?;
        let room = self.draft_room(session);
        let mut spec = self.spec.take()?;
        let drafts = match spec.propose(session, pending, room) {
            Ok(d) if d.is_empty() && spec.uses_mtp() => {
                // the MTP block must see this position: a decode step on this session alone
                self.spec = Some(spec);
                return Some(self.spec_step(session, &[], cancelled).map(|(s, _)| s));
            }
            Ok(d) if d.is_empty() => {
                self.spec = Some(spec);
                return None;
            }
            Ok(d) => d,
            Err(e) => {
                self.spec = Some(spec);
                return Some(Err(e));
            }
        };
        let r = self.spec_step(session, &drafts, cancelled);
        if let Ok((_, accepted)) = &r {
            spec.observe(drafts.len(), *accepted, self.pending);
        }
        self.spec = Some(spec);
        Some(r.map(|(steps, _)| steps))
    }

    /// The most drafts worth verifying now: a step samples at most `k + 1` tokens, so `k + 1` stays within the
    /// tokens left to `max_tokens`, and the pending token and `k` drafts within the context.
    pub fn draft_room(&self, session: &Session) -> usize {
        if self.phase != Phase::Decode {
            return 0;
        }
        // the pending token is counted in `tokens`; the step samples up to k + 1 more
        let by_max = self.params.max_tokens.saturating_sub(self.tokens.len() + 1);
        let by_ctx = session
            .context_length()
            .saturating_sub(session.tokens().len() + 1);
        // and the pending token and its drafts within the KV budget
        let by_budget = session.verify_room().saturating_sub(1);
        by_max.min(by_ctx).min(by_budget)
    }

    /// Decodes the pending token together with `drafts` in one verify step, then samples from each row in turn
    /// until a sampled token differs from the draft in its place, the sequence ends, or every draft is accepted
    /// (then the token sampled from the last row is the next pending one). Returns each sampling step, in order,
    /// and how many drafts were accepted. Drafts past [`Sequence::draft_room`] are ignored; with none left (or a
    /// session that cannot verify) this is one plain decode step.
    ///
    /// A failed verify ends the sequence as a failed decode step does ([`Sequence::accept_logits`]).
    /// Errors: those of [`Sequence::sample_step`].
    pub fn spec_step(
        &mut self,
        session: &mut Session,
        drafts: &[u32],
        cancelled: bool,
    ) -> Result<(Vec<Sampled>, usize)> {
        let pending = self.pending.expect("spec_step without a pending token");
        let k = drafts.len().min(self.draft_room(session));
        if k == 0 || !session.can_verify() {
            let mut out = Vec::new();
            match self.decode_step(session) {
                Some(end) => out.push(end),
                None => out.push(self.sample_step(cancelled)?),
            }
            return Ok((out, 0));
        }
        let ids: Vec<u32> = std::iter::once(pending)
            .chain(drafts[..k].iter().copied())
            .collect();
        let logits = match session.verify(&ids) {
            Ok(l) => l,
            Err(e) => return Ok((self.accept_logits(Err(e)).into_iter().collect(), 0)),
        };
        let vocab = logits.len() / ids.len();
        let mut out = Vec::with_capacity(ids.len());
        for (i, row) in logits.chunks_exact(vocab).enumerate() {
            self.pending = None;
            self.logits.clear();
            self.logits.extend_from_slice(row);
            self.phase = Phase::Sample;
            let step = match self.sample_step(cancelled) {
                Ok(s) => s,
                Err(e) => {
                    session.keep_verified(i + 1);
                    return Err(e);
                }
            };
            let token = step.token;
            out.push(step);
            let go_on = self.phase == Phase::Decode && i < k && token == Some(drafts[i]);
            if !go_on {
                session.keep_verified(i + 1);
                return Ok((out, i));
            }
        }
        unreachable!("the last row never goes on")
    }
}
