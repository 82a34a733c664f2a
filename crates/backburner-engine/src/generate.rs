//! The generation loop: prefill the prompt, then sample and decode until eos, `max_tokens`, a stop string, a full
//! context or a cancellation, streaming text as it becomes complete UTF-8.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use backburner_model::TextTokenizer;
use serde::Serialize;

use crate::error::Result;
use crate::picker::TokenLogprob;
use crate::sampling::SamplingParams;
use crate::sequence::{Phase, Sampled, Sequence};
use crate::session::Session;
use crate::stop::StopMatcher;

/// What to generate.
#[derive(Clone, Debug, Default)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Stop when one of these ids is sampled (it is not part of the output).
    pub eos_ids: Vec<u32>,
    /// Stop when the text contains one of these (cut before it; needs a tokenizer).
    pub stop: Vec<String>,
    /// Keep the logits of every sampling step in [`Generation::step_logits`].
    pub keep_logits: bool,
    /// Report each sampled token's log-probability with this many alternatives (`Some(0)`: the token's only; at
    /// most [`crate::picker::MAX_TOP_LOGPROBS`]) in [`Generation::logprobs`]; `None`: none.
    pub logprobs: Option<usize>,
    /// A grammar the output must follow ([`crate::constraint`]); `None`: free.
    pub constraint: Option<crate::constraint::ConstraintSpec>,
    /// Stop with [`StopReason::Interrupted`] once this flag is set (checked before each token is sampled, so the
    /// prompt is always processed; e.g. set by a Ctrl-C handler).
    pub cancel: Option<Arc<AtomicBool>>,
    /// Speculative decoding: draft tokens and verify them several at a time ([`crate::spec`]); the output is the
    /// same token for token. `None`: one token per decode step.
    pub spec: Option<crate::spec::SpecParams>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// An eos id was sampled.
    Eos,
    /// `max_tokens` reached.
    MaxTokens,
    /// A stop string appeared.
    StopString,
    /// The context window is full.
    ContextFull,
    /// Cancelled through [`GenerateParams::cancel`] (Ctrl-C in the CLI).
    Interrupted,
    /// A decode step failed after some tokens were generated ([`Generation::error`] says why); the tokens so far
    /// are returned.
    Error,
}

impl StopReason {
    /// The snake_case name used in JSON and the stats line.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::StopString => "stop_string",
            StopReason::ContextFull => "context_full",
            StopReason::Interrupted => "interrupted",
            StopReason::Error => "error",
        }
    }
}

/// Timings of one generation, milliseconds and tokens per second.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    /// Time to first token: prefill of the prompt plus sampling the first token (ms).
    pub ttft_ms: f64,
    /// Prompt tokens processed per second.
    pub prefill_tok_s: f64,
    /// Generated tokens per second after the first (0 with fewer than 2 tokens).
    pub decode_tok_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prefill wall time (ms).
    pub prefill_ms: f64,
    /// Decode wall time (ms) for the tokens after the first.
    pub decode_ms: f64,
}

/// The result of [`generate`].
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Generated ids (without a final eos).
    pub tokens: Vec<u32>,
    /// Generated text (empty without a tokenizer); cut before a stop string.
    pub text: String,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// Timings.
    pub timings: Timings,
    /// The logits each token was sampled from, `[steps, vocab]` f32 (empty unless `keep_logits`).
    #[serde(skip)]
    pub step_logits: Vec<f32>,
    /// Why a decode step failed ([`StopReason::Error`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Each generated token's log-probability and alternatives (empty unless [`GenerateParams::logprobs`]; one per
    /// id of `tokens`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logprobs: Vec<TokenLogprob>,
    /// What speculative decoding did ([`GenerateParams::spec`]; `None` without it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<crate::spec::SpecCounts>,
}

/// Incremental detokenizer for streaming: emits text only once it is complete UTF-8, and holds back text that might
/// be the start of a stop string.
///
/// Each [`TextStream::push`] decodes a short window of recent ids, not the whole output (the "prefix offset / read
/// offset" scheme of Hugging Face `TextStreamer` and TGI): `ids[prefix..read]` is the piece last taken into the text,
/// decoded again as context; the decoding of `ids[prefix..]` extends it, and the difference is the new text. `prefix`
/// always sits where the text so far ended in a complete character, so for byte-level BPE tokenizers (Qwen) the result
/// is exactly that of decoding every id each time; a window whose decoding does not extend its context falls back to
/// decoding everything. Stop strings are matched incrementally ([`StopMatcher`]): a token costs one step per new byte
/// and stop string, whatever the length of the text or of the stop strings.
pub struct TextStream<'a> {
    tok: &'a TextTokenizer,
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix: usize,
    /// Ids before this are in `text`.
    read: usize,
    text: String,
    emitted: usize,
    stop: StopMatcher,
}

impl<'a> TextStream<'a> {
    /// A stream decoding with `tok` that stops at the first of `stop` (empty strings are ignored).
    pub fn new(tok: &'a TextTokenizer, stop: &[String]) -> Self {
        TextStream {
            tok,
            ids: Vec::new(),
            prefix: 0,
            read: 0,
            text: String::new(),
            emitted: 0,
            stop: StopMatcher::new(stop),
        }
    }

    /// The text so far (cut before a stop string once one was hit).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The text so far, consuming the stream.
    pub fn into_text(self) -> String {
        self.text
    }

    /// The decoding of all ids, as (byte offset where it first differs from `self.text`, text from that offset).
    fn decode_all(&self) -> Result<(usize, String)> {
        let window = self.tok.decode(&self.ids[self.prefix..])?;
        let context = self.tok.decode(&self.ids[self.prefix..self.read])?;
        if let Some(new) = window.strip_prefix(context.as_str()) {
            return Ok((self.text.len(), new.to_string()));
        }
        // Not prefix-stable here: decode everything.
        let full = self.tok.decode(&self.ids)?;
        // The longest common prefix (a character boundary of both).
        let same = full
            .char_indices()
            .zip(self.text.chars())
            .find(|((_, a), b)| a != b)
            .map(|((i, _), _)| i)
            .unwrap_or(full.len().min(self.text.len()));
        Ok((same, full[same..].to_string()))
    }

    /// Adds one id; returns (new text to emit, whether a stop string was hit). Errors: the tokenizer's decode errors.
    pub fn push(&mut self, id: u32) -> Result<(String, bool)> {
        self.ids.push(id);
        let (from, new) = self.decode_all()?;
        let incomplete = if new.is_empty() {
            self.text[..from].ends_with('\u{FFFD}')
        } else {
            new.ends_with('\u{FFFD}')
        };
        if incomplete {
            return Ok((String::new(), false)); // an incomplete UTF-8 sequence: wait for more bytes
        }
        self.text.truncate(from);
        self.text.push_str(&new);
        self.prefix = self.read;
        self.read = self.ids.len();
        // The text before `from` held no stop string, so a new one ends after `from`: the matcher reads only the
        // new bytes (see `crate::stop`).
        if let Some(pos) = self.stop.advance(&self.text, from) {
            self.text.truncate(pos);
            let out = self.text.get(self.emitted..).unwrap_or("").to_string();
            self.emitted = self.text.len();
            return Ok((out, true));
        }
        // hold back the longest suffix that is a prefix of a stop string
        let hold = self.stop.held();
        let upto = self.text.len() - hold;
        let out = if upto > self.emitted && self.text.is_char_boundary(upto) {
            let o = self.text[self.emitted..upto].to_string();
            self.emitted = upto;
            o
        } else {
            String::new()
        };
        Ok((out, false))
    }

    /// The rest of the text, including a trailing incomplete UTF-8 sequence decoded lossily (as U+FFFD, like
    /// transformers' decode), which `push` held back. Errors: the tokenizer's decode errors.
    pub fn finish(&mut self) -> Result<String> {
        let (from, new) = self.decode_all()?;
        // Keep what was already taken unless the full decoding extends it.
        if from == self.text.len() {
            self.text.push_str(&new);
        }
        let o = self.text.get(self.emitted..).unwrap_or("").to_string();
        self.emitted = self.text.len();
        Ok(o)
    }
}

/// Generates a continuation of `prompt` in `session`: prefills the prompt (ubatched), then samples and decodes, one
/// [`Sequence`] driven to its end. `on_text` receives each complete piece of text as it is produced (nothing without a
/// tokenizer); `on_token` each id; `on_prefill(done, total)` prefill progress.
///
/// Errors: those of [`Sequence::new`] (sampling values, token ids, the prompt must fit the context) and of
/// [`Session::prefill`]; generation itself stops with [`StopReason::ContextFull`] when the context fills up, as
/// llama.cpp does, with [`StopReason::Interrupted`] when [`GenerateParams::cancel`] is set, and with
/// [`StopReason::Error`] (the error in [`Generation::error`]) when a decode step fails (for example
/// [`crate::EngineError::KvBudget`] once a worker holding KV pages is lost for good); what was generated until then
/// is returned in every case.
pub fn generate(
    session: &mut Session,
    prompt: &[u32],
    params: &GenerateParams,
    tokenizer: Option<&TextTokenizer>,
    mut on_prefill: impl FnMut(usize, usize),
    on_token: impl FnMut(u32) + Send,
    on_text: impl FnMut(&str) + Send,
) -> Result<Generation> {
    let mut seq = Sequence::new(session, prompt.to_vec(), params.clone(), tokenizer)?;
    // the whole prompt in one call: split prefill pipelines its ubatches across the worker
    seq.prefill_step(session, prompt.len(), &mut on_prefill)?;
    drive(session, &mut seq, params, on_token, on_text)?;
    Ok(seq.finish())
}

/// Samples and decodes `seq` (prefilled, in `session`) to its end, as [`generate`] does after the prompt.
pub(crate) fn drive(
    session: &mut Session,
    seq: &mut Sequence<'_>,
    params: &GenerateParams,
    mut on_token: impl FnMut(u32) + Send,
    mut on_text: impl FnMut(&str) + Send,
) -> Result<()> {
    let cancelled = || {
        params
            .cancel
            .as_ref()
            .is_some_and(|c| c.load(Ordering::Relaxed))
    };
    // the token loop on a compute thread: no hand-off to the pool per decode step
    session.in_pool(|session| -> Result<()> {
        loop {
            let mut step = match seq.phase() {
                Phase::Sample => seq.sample_step(cancelled())?,
                Phase::Decode => {
                    if let Some(steps) = seq.speculate(session, cancelled()) {
                        for mut step in steps? {
                            emit(&mut step, &mut on_token, &mut on_text);
                        }
                        continue;
                    }
                    match seq.decode_step(session) {
                        Some(end) => end,
                        None => continue,
                    }
                }
                Phase::Prefill | Phase::Done => return Ok(()),
            };
            emit(&mut step, &mut on_token, &mut on_text);
        }
    })
}

/// Hands a sampling step's token and text to the callbacks.
fn emit(step: &mut Sampled, on_token: &mut impl FnMut(u32), on_text: &mut impl FnMut(&str)) {
    if let Some(id) = step.token {
        on_token(id);
    }
    if !step.text.is_empty() {
        on_text(&std::mem::take(&mut step.text));
    }
}
