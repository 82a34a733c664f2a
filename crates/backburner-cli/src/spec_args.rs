//! The speculative decoding flags of `run`, `serve` and `chat`: `--spec` picks the draft source, `--draft-max` the
//! most drafts per verify step (llama.cpp's `--spec-type` and `--draft-max` are accepted under their names).

use anyhow::Result;
use backburner_engine::spec::{
    SpecParams, SpecSource, DEFAULT_MAX_NGRAM, DEFAULT_MIN_NGRAM, MAX_DRAFT, MAX_NGRAM,
};
use clap::{Args, ValueEnum};

/// Draft sources.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SpecKind {
    /// No speculation: one token per decode step.
    None,
    /// Prompt lookup: draft the continuation of the longest recent n-gram that ends the context (no extra weights;
    /// strong when the output repeats its input: code edits, extraction, agents). llama.cpp's `ngram-simple`.
    #[value(alias = "ngram-simple")]
    Ngram,
    /// The checkpoint's own MTP (multi-token prediction) block drafts (Qwen3.5/3.6 `mtp.*`, GGUF `nextn`
    /// tensors): loaded only with this. llama.cpp's `draft-mtp`.
    #[value(alias = "draft-mtp")]
    Mtp,
}

/// Speculative decoding settings.
#[derive(Args, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: draft tokens and verify them several per step. The output is the same token for token
    /// (greedy or sampled with the same seed); it only changes the speed. llama.cpp's names work too: `ngram-simple`
    /// (= ngram), `draft-mtp` (= mtp). It runs locally and with workers (a verify step through a layer split is
    /// one round trip per worker for all the drafts; under --kv-budget it attends through the workers' pages); with
    /// --expert-split decoding stays one token per step.
    #[arg(long, visible_alias = "spec-type", value_enum, default_value_t = SpecKind::None)]
    pub spec: SpecKind,
    /// Most drafted tokens per verify step (1..=32); how many are drafted adapts to how many get accepted. The
    /// default keeps a verify step within the 8 rows the products stream the weights once for.
    #[arg(long, visible_aliases = ["draft", "draft-n"], default_value_t = 7,
          value_parser = clap::value_parser!(u64).range(1..=MAX_DRAFT as u64))]
    pub draft_max: u64,
    /// `--spec ngram`: shortest n-gram matched (1 ≤ min ≤ max ≤ 32).
    #[arg(long, visible_alias = "prompt-lookup-min", default_value_t = DEFAULT_MIN_NGRAM)]
    pub ngram_min: usize,
    /// `--spec ngram`: longest n-gram matched (1 ≤ min ≤ max ≤ 32).
    #[arg(long, visible_alias = "prompt-lookup-max", default_value_t = DEFAULT_MAX_NGRAM)]
    pub ngram_max: usize,
}

impl SpecArgs {
    /// Whether the model's MTP block must be loaded.
    pub fn wants_mtp(&self) -> bool {
        self.spec == SpecKind::Mtp
    }

    /// Turns the MTP block on in `session` for `--spec mtp`, and warns when the placement keeps the session from
    /// verifying (experts on workers). Errors: the model has no MTP block (naming the flag).
    pub fn enable(&self, session: &mut backburner_engine::Session) -> Result<()> {
        if self.spec != SpecKind::None && session.model().has_remote_experts() {
            eprintln!(
                "warning: --spec: speculative decoding does not run with experts on workers yet; decoding stays \
                 one token per step (the output is the same)"
            );
        }
        if self.wants_mtp() {
            session.enable_mtp().map_err(|e| {
                anyhow::anyhow!(
                    "--spec mtp: {e}; use --spec ngram, or a checkpoint with an MTP block"
                )
            })?;
        }
        Ok(())
    }

    /// The engine's settings (`None` for `--spec none`). Errors: n-gram sizes outside `1 ≤ min ≤ max ≤ 32`
    /// (checked whatever `--spec` is, as `--draft-max` is).
    pub fn params(&self) -> Result<Option<SpecParams>> {
        let (min, max) = (self.ngram_min, self.ngram_max);
        if !(1 <= min && min <= max && max <= MAX_NGRAM) {
            anyhow::bail!(
                "--ngram-min {min} / --ngram-max {max}: need 1 ≤ min ≤ max ≤ {MAX_NGRAM}"
            );
        }
        let source = match self.spec {
            SpecKind::None => return Ok(None),
            SpecKind::Ngram => SpecSource::Ngram { min, max },
            SpecKind::Mtp => SpecSource::Mtp,
        };
        Ok(Some(SpecParams {
            source,
            draft_max: self.draft_max as usize,
            fixed: false,
            cost: None,
        }))
    }
}

/// The stats line's part for speculative decoding (` | drafts A accepted of D in S verify steps`), summed over
/// `counts` (one per sequence; none speculated: empty).
pub fn stats_suffix<'a>(
    counts: impl IntoIterator<Item = &'a Option<backburner_engine::spec::SpecCounts>>,
) -> String {
    let mut sum: Option<(u64, u64, u64)> = None;
    for c in counts.into_iter().flatten() {
        let s = sum.get_or_insert((0, 0, 0));
        s.0 += c.accepted;
        s.1 += c.drafted;
        s.2 += c.steps;
    }
    sum.map_or(String::new(), |(a, d, n)| {
        format!(" | drafts {a} accepted of {d} in {n} verify steps")
    })
}
