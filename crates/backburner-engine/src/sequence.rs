//! The step API: one request's generation as a value a scheduler advances a step at a time — a prefill chunk, a
//! sampling step, a decode step — and may drop between any two steps (cancellation). [`crate::generate`] drives one
//! sequence to its end; the server's scheduler ([`crate::serve`]) interleaves many, batching their decode steps.
//!
//! A step never blocks on anything but compute (and the link of an attached worker), so the caller decides what runs
//! next: a long prompt is prefilled one chunk per scheduler turn while other sequences keep decoding.

use std::time::Instant;

use backburner_model::TextTokenizer;

use crate::error::{EngineError, Result};
use crate::generate::{GenerateParams, Generation, StopReason, TextStream, Timings};
use crate::picker::{Picker, TokenLogprob};
use crate::session::{Logits, Session};
use crate::spec::Speculator;

mod spec_step;

/// Checks that every id of `ids` is inside a vocabulary of `vocab` ids, as requests (the server's and `run`'s)
/// are checked before anything runs. Errors: [`EngineError::InvalidInput`] naming the first id out of range.
pub fn check_token_ids(ids: &[u32], vocab: usize) -> Result<()> {
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(bad) => Err(EngineError::InvalidInput(format!(
            "token id {bad} is out of range for the model's vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// Where a sequence is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Prompt tokens remain to be prefilled ([`Sequence::prefill_step`]).
    Prefill,
    /// Logits are ready: sample the next token ([`Sequence::sample_step`]).
    Sample,
    /// A sampled token waits to be decoded ([`Sequence::pending`], then [`Sequence::accept_logits`]).
    Decode,
    /// Finished ([`Sequence::stop_reason`]).
    Done,
}

/// What one sampling step produced.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Sampled {
    /// The token sampled (`None` when an eos id ended the sequence, or it ended before sampling).
    pub token: Option<u32>,
    /// Text that became complete with it (empty without a tokenizer, or while UTF-8 or a possible stop string is
    /// held back); the rest of the text when the sequence ended.
    pub text: String,
    /// Set when the sequence ended at this step.
    pub stop: Option<StopReason>,
    /// The token's log-probability and alternatives ([`GenerateParams::logprobs`]).
    pub logprob: Option<TokenLogprob>,
}

/// One request's generation, advanced step by step against a [`Session`] that the caller keeps with it.
///
/// The session may already hold tokens (a cached prefix): the prompt given is only the part still to be ingested.
pub struct Sequence<'t> {
    prompt: Vec<u32>,
    /// Prompt tokens already fed to the session.
    fed: usize,
    params: GenerateParams,
    picker: Picker,
    logprobs: Vec<TokenLogprob>,
    stream: Option<TextStream<'t>>,
    /// The tokenizer of `stream` (a fork starts its own stream).
    tok: Option<&'t TextTokenizer>,
    /// Tokens the session may still take (context room after the prompt).
    room: usize,
    logits: Vec<f32>,
    pending: Option<u32>,
    tokens: Vec<u32>,
    step_logits: Vec<f32>,
    phase: Phase,
    stop: Option<StopReason>,
    error: Option<String>,
    t_start: Option<Instant>,
    t_first: Option<Instant>,
    prefill_ms: f64,
    ttft_ms: f64,
    /// Speculative decoding ([`GenerateParams::spec`]).
    spec: Option<Speculator>,
}

impl<'t> Sequence<'t> {
    /// A sequence that will ingest `prompt` (token ids `[n]`) into `session` and generate per `params`, decoding text
    /// with `tokenizer` when given.
    ///
    /// Everything is checked before anything runs. Errors: [`EngineError::EmptyPrompt`]; [`EngineError::InvalidInput`]
    /// for sampling values without a meaning ([`crate::SamplingParams::validate`]), stop strings past the limits
    /// ([`crate::check_stop_strings`]) or a token id outside the vocabulary; [`EngineError::ContextOverflow`] if the prompt does not fit after the session's tokens.
    pub fn new(
        session: &Session,
        prompt: Vec<u32>,
        params: GenerateParams,
        tokenizer: Option<&'t TextTokenizer>,
    ) -> Result<Self> {
        let vocab = session.model().config().vocab_size;
        check_params(&params, vocab)?;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        check_token_ids(&prompt, vocab)?;
        session.check_fits(prompt.len())?;
        let room = session.context_length() - session.tokens().len() - prompt.len();
        let stream = tokenizer.map(|tok| TextStream::new(tok, &params.stop));
        let spec = speculator(&params, vocab)?;
        Ok(Sequence {
            spec,
            picker: Picker::new(
                params.sampling.clone(),
                // the repetition penalty's set; the rest needs no copy of a long context
                &if params.sampling.repetition_penalty != 1.0 {
                    [session.tokens(), &prompt[..]].concat()
                } else {
                    Vec::new()
                },
                params.logprobs,
                params.constraint.as_ref().map(|c| c.start()).transpose()?,
            ),
            logprobs: Vec::new(),
            prompt,
            fed: 0,
            params,
            stream,
            tok: tokenizer,
            room,
            logits: Vec::new(),
            pending: None,
            tokens: Vec::new(),
            step_logits: Vec::new(),
            phase: Phase::Prefill,
            stop: None,
            error: None,
            t_start: None,
            t_first: None,
            prefill_ms: 0.0,
            ttft_ms: 0.0,
        })
    }

    /// Another sequence from the same prompt, ready to sample its first token from this one's prompt logits with
    /// `params` (`n` > 1: one prompt, several choices; see [`crate::choice_params`]). `context` is the whole history
    /// the prompt left in the session (the cached prefix and the prompt: the repetition penalty's set). The fork has
    /// its own sampler, constraint and text stream; run it against a session holding the same state (a copy, or the
    /// same session rewound to the end of the prompt). Only before this sequence sampled anything (phase
    /// [`Phase::Sample`], no token yet); `None` otherwise.
    ///
    /// Errors: those of [`Sequence::new`] for `params` (sampling values, stop strings, `logit_bias` ids).
    pub fn fork(&self, context: &[u32], params: GenerateParams) -> Option<Result<Sequence<'t>>> {
        if self.phase != Phase::Sample || !self.tokens.is_empty() {
            return None;
        }
        Some(self.fork_checked(context, params))
    }

    fn fork_checked(&self, context: &[u32], params: GenerateParams) -> Result<Sequence<'t>> {
        check_params(&params, self.logits.len())?;
        let spec = speculator(&params, self.logits.len())?;
        let penalized: &[u32] = if params.sampling.repetition_penalty != 1.0 {
            context
        } else {
            &[]
        };
        Ok(Sequence {
            picker: Picker::new(
                params.sampling.clone(),
                penalized,
                params.logprobs,
                params.constraint.as_ref().map(|c| c.start()).transpose()?,
            ),
            logprobs: Vec::new(),
            prompt: self.prompt.clone(),
            fed: self.fed,
            stream: self.tok.map(|tok| TextStream::new(tok, &params.stop)),
            params,
            tok: self.tok,
            room: self.room,
            logits: self.logits.clone(),
            pending: None,
            tokens: Vec::new(),
            step_logits: Vec::new(),
            phase: Phase::Sample,
            stop: None,
            error: None,
            t_start: self.t_start,
            t_first: None,
            prefill_ms: self.prefill_ms,
            ttft_ms: 0.0,
            spec,
        })
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Prompt tokens not yet fed.
    pub fn prompt_left(&self) -> usize {
        self.prompt.len() - self.fed
    }

    /// Prompt tokens of this sequence (without a cached prefix).
    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    /// Tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The token waiting to be decoded (phase [`Phase::Decode`]).
    pub fn pending(&self) -> Option<u32> {
        self.pending
    }

    /// Why it ended (phase [`Phase::Done`]).
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop
    }

    /// Feeds up to `max_tokens` (≥ 1) more prompt tokens to `session` (one [`Session::prefill`] call, which runs them
    /// in ubatches, split with a worker when the session has one). After the last chunk the logits are ready (phase
    /// [`Phase::Sample`]). `progress(done, total)` is called per ubatch with counts over the whole prompt.
    ///
    /// Errors: those of [`Session::prefill`]; the session keeps what earlier chunks ingested.
    pub fn prefill_step(
        &mut self,
        session: &mut Session,
        max_tokens: usize,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<()> {
        assert_eq!(self.phase, Phase::Prefill, "prefill_step outside prefill");
        let t0 = *self.t_start.get_or_insert_with(Instant::now);
        let n = self.prompt_left().min(max_tokens.max(1));
        let chunk = &self.prompt[self.fed..self.fed + n];
        let last = self.fed + n == self.prompt.len();
        let (fed, total) = (self.fed, self.prompt.len());
        let which = Logits::Last;
        let logits = session.prefill(chunk, which, |d, _| progress(fed + d, total))?;
        self.fed += n;
        if last {
            self.prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
            self.logits = logits;
            self.phase = Phase::Sample;
        }
        Ok(())
    }

    /// Samples the next token from the ready logits and applies the stop conditions (cancellation, max tokens, full
    /// context, eos, stop strings). Unless the sequence ended, the token then waits to be decoded (phase
    /// [`Phase::Decode`]). `cancelled` ends the sequence with [`StopReason::Interrupted`] before sampling.
    ///
    /// Errors: [`EngineError::NonFinite`] logits; the tokenizer's decode errors.
    pub fn sample_step(&mut self, cancelled: bool) -> Result<Sampled> {
        assert_eq!(self.phase, Phase::Sample, "sample_step without logits");
        let early = if cancelled {
            Some(StopReason::Interrupted)
        } else if self.tokens.len() >= self.params.max_tokens {
            Some(StopReason::MaxTokens)
        } else if self.tokens.len() >= self.room {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        if let Some(r) = early {
            return self.end(r, None);
        }
        if self.logits.iter().any(|v| !v.is_finite()) {
            return Err(EngineError::NonFinite);
        }
        if self.params.keep_logits {
            self.step_logits.extend_from_slice(&self.logits);
        }
        let (id, logprob) = self.picker.pick(&self.logits)?;
        if self.tokens.is_empty() {
            let t0 = self.t_start.expect("prefilled");
            self.ttft_ms = t0.elapsed().as_secs_f64() * 1e3;
            self.t_first = Some(Instant::now());
        }
        if self.params.eos_ids.contains(&id) {
            return self.end(StopReason::Eos, None);
        }
        self.tokens.push(id);
        self.logprobs.extend(logprob.clone());
        let mut out = Sampled {
            token: Some(id),
            logprob,
            ..Default::default()
        };
        if let Some(s) = self.stream.as_mut() {
            let (piece, hit) = s.push(id)?;
            out.text = piece;
            if hit {
                self.phase = Phase::Done;
                self.stop = Some(StopReason::StopString);
                out.stop = self.stop;
                return Ok(out);
            }
        }
        if self.tokens.len() == self.params.max_tokens {
            let mut end = self.end(StopReason::MaxTokens, Some(id))?;
            out.text.push_str(&end.text);
            end.text = out.text;
            end.logprob = out.logprob;
            return Ok(end);
        }
        self.pending = Some(id);
        self.phase = Phase::Decode;
        Ok(out)
    }

    /// Ends the sequence: flushes the held-back text (unless a stop string ended it).
    fn end(&mut self, reason: StopReason, token: Option<u32>) -> Result<Sampled> {
        self.phase = Phase::Done;
        self.stop = Some(reason);
        self.pending = None;
        let text = match self.stream.as_mut() {
            Some(s) => s.finish()?,
            None => String::new(),
        };
        Ok(Sampled {
            token,
            text,
            stop: Some(reason),
            logprob: None,
        })
    }

    /// Decodes the pending token in `session` alone (a scheduler batching several sequences calls
    /// [`crate::serve::decode_batch`] and hands each its logits with [`Sequence::accept_logits`]). Returns what
    /// [`Sequence::accept_logits`] returns.
    pub fn decode_step(&mut self, session: &mut Session) -> Option<Sampled> {
        let id = self.pending.expect("decode_step without a pending token");
        let r = session.decode(id);
        self.accept_logits(r)
    }

    /// Takes the result of decoding the pending token: its logits `[vocab]` (phase [`Phase::Sample`] next; returns
    /// `None`), or the error, which ends the sequence with [`StopReason::Error`] keeping the tokens so far (returns
    /// the end step, with the text held back until then).
    pub fn accept_logits(&mut self, r: Result<Vec<f32>>) -> Option<Sampled> {
        assert_eq!(
            self.phase,
            Phase::Decode,
            "accept_logits without a pending token"
        );
        self.pending = None;
        match r {
            Ok(l) => {
                self.logits = l;
                self.phase = Phase::Sample;
                None
            }
            Err(e) => {
                self.error = Some(e.to_string());
                let end = self.end(StopReason::Error, None);
                // a tokenizer that decoded these ids once decodes them again; keep the stop if it does not
                Some(end.unwrap_or(Sampled {
                    stop: Some(StopReason::Error),
                    ..Default::default()
                }))
            }
        }
    }

    /// Why the last decode failed ([`StopReason::Error`]).
    pub fn error(&self) -> Option<&str> {
        self.error.as_deref()
    }

    /// Ends the sequence now with [`StopReason::Interrupted`] (a pending token is dropped, never decoded), unless it
    /// already ended; returns the end step with the text held back until then.
    pub fn cancel(&mut self) -> Sampled {
        if self.phase == Phase::Done {
            return Sampled {
                stop: self.stop,
                ..Default::default()
            };
        }
        self.end(StopReason::Interrupted, None).unwrap_or(Sampled {
            stop: Some(StopReason::Interrupted),
            ..Default::default()
        })
    }

    /// The result so far (complete once the phase is [`Phase::Done`]); the kept logits move into it.
    pub fn take_generation(&mut self) -> Generation {
        let logits = std::mem::take(&mut self.step_logits);
        let mut g = self.result(logits);
        g.text = self
            .stream
            .as_ref()
            .map(|s| s.text().to_string())
            .unwrap_or_default();
        g
    }

    /// The result, consuming the sequence.
    pub fn finish(mut self) -> Generation {
        let logits = std::mem::take(&mut self.step_logits);
        let mut g = self.result(logits);
        g.text = self.stream.map(TextStream::into_text).unwrap_or_default();
        g
    }

    /// The result with `step_logits` and no text.
    fn result(&self, step_logits: Vec<f32>) -> Generation {
        let decode_ms = match self.t_first {
            Some(t) if self.tokens.len() > 1 => t.elapsed().as_secs_f64() * 1e3,
            _ => 0.0,
        };
        let n_decoded = self.tokens.len().saturating_sub(1);
        let timings = Timings {
            ttft_ms: self.ttft_ms,
            prefill_tok_s: self.prompt.len() as f64 / (self.prefill_ms / 1e3).max(1e-9),
            decode_tok_s: if n_decoded > 0 {
                n_decoded as f64 / (decode_ms / 1e3).max(1e-9)
            } else {
                0.0
            },
            prompt_tokens: self.prompt.len(),
            prefill_ms: self.prefill_ms,
            decode_ms,
        };
        Generation {
            text: String::new(),
            tokens: self.tokens.clone(),
            stop_reason: self.stop.unwrap_or(StopReason::MaxTokens),
            timings,
            step_logits,
            error: self.error.clone(),
            logprobs: self.logprobs.clone(),
            speculative: self.spec.as_ref().map(Speculator::counts),
        }
    }
}

/// The speculator `params` asks for, if any (checked as [`Speculator::new`] checks it).
fn speculator(params: &GenerateParams, vocab: usize) -> Result<Option<Speculator>> {
    params
        .spec
        .as_ref()
        .map(|p| Speculator::new(p, vocab))
        .transpose()
}

/// The checks of a request's settings that need no session: sampling values, stop strings, and `logit_bias` ids
/// inside a vocabulary of `vocab`. Errors: [`EngineError::InvalidInput`] naming the value.
fn check_params(params: &GenerateParams, vocab: usize) -> Result<()> {
    params.sampling.validate()?;
    crate::stop::check_stop_strings(&params.stop)?;
    if let Some((id, _)) = params
        .sampling
        .logit_bias
        .iter()
        .find(|(id, _)| *id as usize >= vocab)
    {
        return Err(EngineError::InvalidInput(format!(
            "logit_bias names token id {id}, out of range for the model's vocabulary of {vocab}"
        )));
    }
    Ok(())
}
