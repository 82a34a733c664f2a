//! What a request asks of speculation ([`SpecParams`]) and the per-sequence [`Speculator`] built from it: the draft
//! source, the draft length controller and the counts a response reports.

use serde::Serialize;

use super::{
    AdaptiveConfig, AdaptiveDraft, CostModel, Draft, DraftSource, NgramDraft, ScriptedDraft,
};
use crate::error::Result;

/// Where drafts come from.
#[derive(Clone, Debug, PartialEq)]
pub enum SpecSource {
    /// Prompt lookup: the continuation of the longest recent n-gram (`min..=max` tokens) that ends the context.
    Ngram {
        /// Shortest n-gram matched (≥ 1).
        min: usize,
        /// Longest n-gram matched (≤ [`super::MAX_NGRAM`]).
        max: usize,
    },
    /// Benchmarks: a known continuation (`script`: the id of every position, prompt included) with each draft wrong
    /// with probability `error_rate` ([`ScriptedDraft`]).
    Scripted {
        /// Ids `[positions]`.
        script: Vec<u32>,
        /// In `[0, 1]`.
        error_rate: f64,
        /// The errors' RNG seed.
        seed: u64,
    },
    /// The checkpoint's MTP block, drafting greedily from the last position's hidden row (the session must have
    /// it on: [`crate::Session::enable_mtp`]; without it nothing is drafted).
    Mtp,
}

impl SpecSource {
    /// The source's name in flags, logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            SpecSource::Ngram { .. } => "ngram",
            SpecSource::Scripted { .. } => "scripted",
            SpecSource::Mtp => "mtp",
        }
    }
}

/// Speculative decoding settings of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecParams {
    /// The draft source.
    pub source: SpecSource,
    /// Most drafts per verify step (`--draft-max`, ≥ 1).
    pub draft_max: usize,
    /// Draft `draft_max` tokens at every step instead of adapting the length to the acceptance (benchmarks).
    pub fixed: bool,
    /// The cost of a verify step of `T` positions against a decode step ([`CostModel`]); `None`:
    /// [`DEFAULT_COST_PER_POSITION`] per position.
    pub cost: Option<CostModel>,
}

/// What speculation did for one sequence: verify steps, tokens drafted and drafts accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SpecCounts {
    /// Verify steps with at least one draft.
    pub steps: u64,
    /// Draft tokens verified.
    pub drafted: u64,
    /// Draft tokens accepted (each one a decode step saved).
    pub accepted: u64,
}

/// A sequence's speculation: its draft source, length controller and counts.
pub struct Speculator {
    /// A source over the tokens; `None`: the session's MTP block.
    source: Option<Box<dyn DraftSource + Send>>,
    ctl: AdaptiveDraft,
    fixed: bool,
    draft_max: usize,
    draft: Draft,
    /// The context handed to the source (the session's tokens and the pending one), reused.
    ctx: Vec<u32>,
    counts: SpecCounts,
}

impl std::fmt::Debug for Speculator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Speculator")
            .field("source", &self.source.as_ref().map_or("mtp", |s| s.name()))
            .field("counts", &self.counts)
            .finish()
    }
}

impl Speculator {
    /// The speculator `p` asks for, in a vocabulary of `vocab` ids.
    ///
    /// Errors: [`crate::EngineError::InvalidInput`] for `draft_max` 0 or above [`MAX_DRAFT`], n-gram sizes outside
    /// `1 ≤ min ≤ max ≤ MAX_NGRAM`, a script with ids outside the vocabulary or an error rate outside [0, 1].
    pub fn new(p: &SpecParams, vocab: usize) -> Result<Self> {
        if p.draft_max == 0 || p.draft_max > MAX_DRAFT {
            return Err(crate::EngineError::InvalidInput(format!(
                "draft_max must be in 1..={MAX_DRAFT} (got {})",
                p.draft_max
            )));
        }
        let source: Option<Box<dyn DraftSource + Send>> = match &p.source {
            SpecSource::Ngram { min, max } => Some(Box::new(NgramDraft::new(*min, *max)?)),
            SpecSource::Scripted {
                script,
                error_rate,
                seed,
            } => Some(Box::new(ScriptedDraft::new(
                script.clone(),
                vocab,
                *error_rate,
                *seed,
            )?)),
            SpecSource::Mtp => None,
        };
        let mut cfg = AdaptiveConfig::new(p.draft_max);
        cfg.cost = match &p.cost {
            Some(c) => c.clone(),
            // measured (docs/BENCHMARKS.md, "Speculative decoding"): of the linear models tried against the verify
            // costs of bf16 weights and of Q4_K_M at the 27B's shapes, this one loses least on both
            None => CostModel::linear(DEFAULT_COST_PER_POSITION, p.draft_max)?,
        };
        Ok(Speculator {
            source,
            ctl: AdaptiveDraft::new(cfg)?,
            fixed: p.fixed,
            draft_max: p.draft_max,
            draft: Draft::default(),
            ctx: Vec::new(),
            counts: SpecCounts::default(),
        })
    }

    /// Whether the drafts come from the session's MTP block (which must see every position: a step without drafts
    /// still runs on the session alone, not batched).
    pub fn uses_mtp(&self) -> bool {
        self.source.is_none()
    }

    /// Drafts for the next step after the session's tokens and `pending`, at most `room`: none when the controller
    /// holds off (then the step is a plain decode step, which it counts).
    pub(crate) fn propose(
        &mut self,
        session: &mut crate::Session,
        pending: u32,
        room: usize,
    ) -> Result<Vec<u32>> {
        let k = if self.fixed {
            self.draft_max
        } else {
            self.ctl.next_k()
        }
        .min(room);
        self.draft.clear();
        if k > 0 {
            match self.source.as_mut() {
                Some(source) => {
                    self.ctx.clear();
                    self.ctx.extend_from_slice(session.tokens());
                    self.ctx.push(pending);
                    source.propose(&self.ctx, k, &mut self.draft)?;
                }
                None => self.draft.tokens = session.mtp_draft(pending, k),
            }
            self.draft.tokens.truncate(k);
        }
        if self.draft.tokens.is_empty() {
            self.ctl.observe(0, 0);
        }
        Ok(std::mem::take(&mut self.draft.tokens))
    }

    /// The outcome of verifying `drafted` tokens: the first `accepted` kept, `next` sampled after them.
    pub(crate) fn observe(&mut self, drafted: usize, accepted: usize, next: Option<u32>) {
        self.ctl.observe(drafted, accepted);
        if let (Some(n), Some(s)) = (next, self.source.as_mut()) {
            s.observe(accepted, n);
        }
        self.counts.steps += 1;
        self.counts.drafted += drafted as u64;
        self.counts.accepted += accepted as u64;
    }

    /// Counts so far.
    pub fn counts(&self) -> SpecCounts {
        self.counts
    }
}

/// Most drafts per verify step.
pub const MAX_DRAFT: usize = 32;

/// The default cost of a verify step of `T` positions: `1 + 0.2 (T − 1)` decode steps ([`SpecParams::cost`]
/// `None`).
pub const DEFAULT_COST_PER_POSITION: f64 = 0.2;
