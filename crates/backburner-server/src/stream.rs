//! Running a request on the engine from async code: submit, wait for the start (so errors still get their HTTP
//! status), then either collect the whole answer or forward it as server-sent events. A client that goes away
//! cancels its job: the guard held by the response sets the job's cancel flag when it is dropped, and the engine's
//! sink notices the closed channel at the next token.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use backburner_engine::serve::{Event, Job};
use backburner_engine::spec::SpecCounts;
use backburner_engine::{GenerateParams, Generation, StopReason, TokenLogprob};
use futures_util::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::error::ApiError;
use crate::request::GenSettings;
use crate::AppState;

/// Sets the job's cancel flag when dropped (the response is gone: finished, or the client disconnected).
pub struct CancelGuard(Arc<AtomicBool>);

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// A job that a slot took.
pub struct Running {
    /// The job's events after `Started`, each with its choice's index (`n` > 1: choices 1 … n−1 start later).
    pub rx: mpsc::UnboundedReceiver<(usize, Event)>,
    /// Choices asked for (`n`).
    pub choices: usize,
    /// Cancels the job when dropped.
    pub guard: CancelGuard,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, reused from the cache.
    pub cached_tokens: usize,
}

/// Submits `prompt` (ids `[n]`) with `gen`'s settings (`gen.n` choices: the engine prefills the prompt once and forks
/// it, choice `i` seeded `seed + i`) and waits until a slot takes it (choice 0). `prompt_field` is the
/// request field the prompt came from (`messages`, `prompt`): errors about the prompt name it.
///
/// Errors: 400 for a prompt that does not fit the context or values the engine refuses; 503 when the queue is full
/// or the server is shutting down; 500 otherwise.
pub async fn start(
    st: &AppState,
    id: &str,
    prompt: Vec<u32>,
    prompt_field: &str,
    stable_prefix: Option<usize>,
    gen: &GenSettings,
) -> Result<Running, ApiError> {
    if prompt.len() >= st.context_length {
        return Err(ApiError::invalid(
            Some(prompt_field),
            format!(
                "the prompt has {} tokens; this server's context is {} tokens, and at least one must be left to generate",
                prompt.len(),
                st.context_length
            ),
        )
        .with_code("context_length_exceeded"));
    }
    if gen.ignore_eos && gen.constraint.is_some() {
        return Err(ApiError::invalid(
            Some("ignore_eos"),
            "`ignore_eos` does not combine with constrained output (a grammar ends on the end-of-sequence token)",
        ));
    }
    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Event)>();
    let params = GenerateParams {
        max_tokens: gen.max_tokens.unwrap_or(usize::MAX),
        sampling: gen.sampling.clone(),
        eos_ids: if gen.ignore_eos {
            Vec::new()
        } else {
            st.eos_ids.clone()
        },
        stop: gen.stop.clone(),
        keep_logits: false,
        cancel: Some(cancel.clone()),
        logprobs: gen.logprobs,
        constraint: gen.constraint.clone(),
        spec: st.spec.clone(),
    };
    let prompt_tokens = prompt.len();
    // Once `/health` says shutting down, no request reaches the engine (its own shutdown may not have begun yet).
    if st.stopping.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(backburner_engine::serve::SubmitError::ShuttingDown.into());
    }
    let choices = gen.n.max(1);
    let sink = |i: usize| -> backburner_engine::serve::EventSink {
        let tx = tx.clone();
        Box::new(move |ev| tx.send((i, ev)).is_ok())
    };
    st.engine.submit(Job {
        id: id.to_string(),
        prompt,
        params,
        stable_prefix,
        cache_prompt: gen.cache_prompt,
        events: sink(0),
        siblings: (1..choices).map(sink).collect(),
    })?;
    drop(tx);
    let guard = CancelGuard(cancel);
    // choice 0 starts first (the others fork from its prefill)
    match rx.recv().await.map(|(_, ev)| ev) {
        Some(Event::Started { cached_tokens, .. }) => Ok(Running {
            rx,
            choices,
            guard,
            prompt_tokens,
            cached_tokens,
        }),
        Some(Event::Failed(e)) => {
            let mut e = ApiError::from(e);
            if matches!(e.param.as_deref(), Some("messages" | "prompt")) {
                e.param = Some(prompt_field.to_string());
            }
            Err(e)
        }
        _ => Err(ApiError::internal(
            "the engine stopped before taking the request",
        )),
    }
}

/// Every choice's whole generation (in choice order), and why one failed, if one did.
pub struct Choices {
    /// Choice `i`'s generation; a choice that failed before generating has none: an empty one ending in
    /// [`StopReason::Error`].
    pub gs: Vec<Generation>,
    /// The error of the first choice (by index) that ended in one.
    failure: Option<ApiError>,
}

impl Choices {
    /// A whole (non-streamed) answer with, when a choice failed (`finish_reason: "error"`), the `error` object a
    /// stream ends with beside its choices, so the client learns why.
    pub fn with_failure(&self, mut answer: Value) -> Value {
        if let Some(e) = &self.failure {
            answer["error"] = e.body()["error"].take();
        }
        answer
    }
}

/// The error a choice whose generation ended in [`StopReason::Error`] reports.
fn generation_failed(g: &Generation) -> ApiError {
    let why = g.error.clone().unwrap_or_default();
    ApiError::internal(format!("generation failed: {why}"))
}

/// The generation of a choice that failed before generating anything (`Event::Failed`): empty, ending in an error.
fn failed_generation(e: &ApiError) -> Generation {
    Generation {
        tokens: Vec::new(),
        text: String::new(),
        stop_reason: StopReason::Error,
        timings: Default::default(),
        step_logits: Vec::new(),
        error: Some(e.message.clone()),
        logprobs: Vec::new(),
        speculative: None,
    }
}

/// Waits for every choice's end. Each choice is answered as a request of `n` = 1 would be: one that failed after
/// some tokens keeps them (finish reason `error`), one that failed before any is empty (finish reason `error`); the
/// answer carries the first failure's error ([`Choices::with_failure`]). Errors, when no choice has anything to
/// show (every one failed before generating): the first choice's error, the status a request of `n` = 1 gets (500
/// for an engine failure, 503 `worker_unavailable` for a lost worker, …); 500 when the engine stopped.
pub async fn collect(r: &mut Running) -> Result<Choices, ApiError> {
    let mut out: Vec<Option<Generation>> = (0..r.choices).map(|_| None).collect();
    let mut errors: Vec<Option<ApiError>> = vec![None; r.choices];
    let mut left = r.choices;
    while let Some((i, ev)) = r.rx.recv().await {
        if out[i].is_some() {
            continue;
        }
        let g = match ev {
            Event::Done { generation, .. } => {
                if generation.stop_reason == StopReason::Error {
                    errors[i] = Some(generation_failed(&generation));
                }
                *generation
            }
            Event::Failed(e) => {
                let e = ApiError::from(e);
                let g = failed_generation(&e);
                errors[i] = Some(e);
                g
            }
            Event::Started { .. } | Event::Token { .. } => continue,
        };
        out[i] = Some(g);
        left -= 1;
        if left == 0 {
            let gs: Vec<Generation> = out.into_iter().flatten().collect();
            let failure = errors.into_iter().flatten().next();
            let answered = gs
                .iter()
                .any(|g| !g.tokens.is_empty() || g.stop_reason != StopReason::Error);
            return match failure {
                Some(e) if !answered => Err(e),
                failure => Ok(Choices { gs, failure }),
            };
        }
    }
    Err(ApiError::internal("the engine stopped during the request"))
}

/// OpenAI's `finish_reason` for a stop reason: `tool_calls` when the answer has complete tool calls, unless the
/// engine failed (`error`, which the client must see even after a complete call).
pub fn finish_reason(stop: StopReason, tool_calls: bool) -> &'static str {
    match stop {
        StopReason::Error => "error",
        _ if tool_calls => "tool_calls",
        StopReason::MaxTokens | StopReason::ContextFull => "length",
        StopReason::Eos | StopReason::StopString | StopReason::Interrupted => "stop",
    }
}

/// The `usage` object.
pub fn usage(r: &Running, completion_tokens: usize, spec: Option<SpecCounts>) -> Value {
    let mut u = json!({
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": r.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    });
    // speculative decoding, in OpenAI's fields for predicted tokens: drafts the model accepted and rejected
    if let Some(s) = spec {
        u["completion_tokens_details"] = json!({
            "accepted_prediction_tokens": s.accepted,
            "rejected_prediction_tokens": s.drafted - s.accepted,
        });
    }
    u
}

/// The speculative counts of `g` added to `sum` (`None` while no choice speculated).
pub fn add_spec(sum: Option<SpecCounts>, g: &Generation) -> Option<SpecCounts> {
    match (sum, g.speculative) {
        (s, None) => s,
        (None, Some(c)) => Some(c),
        (Some(a), Some(b)) => Some(SpecCounts {
            steps: a.steps + b.steps,
            drafted: a.drafted + b.drafted,
            accepted: a.accepted + b.accepted,
        }),
    }
}

/// Turns a job's events into the JSON chunks of an endpoint's stream.
pub trait Chunker: Send + 'static {
    /// Chunks to send first (e.g. the assistant role).
    fn begin(&mut self) -> Vec<Value>;
    /// Chunks for a piece of generated text.
    fn text(&mut self, text: &str) -> Vec<Value>;
    /// Chunks for generated token `id`, the text it completed (may be empty: then none, unless the endpoint returns
    /// token ids or log-probabilities) and its log-probabilities when asked.
    fn token(&mut self, _id: u32, text: &str, _logprob: Option<&TokenLogprob>) -> Vec<Value> {
        if text.is_empty() {
            Vec::new()
        } else {
            self.text(text)
        }
    }
    /// The last chunks of a choice: the rest of the text and the finish reason.
    fn done(&mut self, g: &Generation, tail: &str) -> Vec<Value>;
    /// The chunk carrying the usage, sent once after every choice's last chunks, when asked (`include_usage`).
    fn usage(&self, usage: Value) -> Option<Value>;
}

/// Gives every choice of `chunk` the index `i` (the chunkers write choice 0).
fn stamp(mut chunk: Value, i: usize) -> Value {
    if let Some(cs) = chunk.get_mut("choices").and_then(Value::as_array_mut) {
        for c in cs {
            c["index"] = json!(i);
        }
    }
    chunk
}

/// Streams the job as server-sent events: each choice's chunks (from `chunkers[i]`, with `index` i; choices
/// interleave), each choice ending with one finish chunk (`finish_reason: "error"` for a choice that failed, with
/// or without tokens), the usage once after the last choice's end, then one `error` object (the first failed
/// choice's) if the engine failed mid-way, and `data: [DONE]`; keep-alive comments while a long prompt is
/// prefilled.
pub fn sse<C: Chunker>(
    mut r: Running,
    mut chunkers: Vec<C>,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
    let span = tracing::Span::current();
    tokio::spawn(
        async move {
            let send = |v: Value| {
                let tx = tx.clone();
                async move {
                    tx.send(Ok(SseEvent::default().data(v.to_string())))
                        .await
                        .is_ok()
                }
            };
            for (i, chunker) in chunkers.iter_mut().enumerate() {
                for c in chunker.begin() {
                    if !send(stamp(c, i)).await {
                        return;
                    }
                }
            }
            // tokens per choice, which choices ended, choices not ended yet, completion tokens of those ended, the
            // error of each choice that failed (the first one's is sent once, after every choice ended)
            let mut n = vec![0; chunkers.len()];
            let mut ended = vec![false; chunkers.len()];
            let (mut left, mut completion) = (chunkers.len(), 0);
            let mut spec = None;
            let mut errors: Vec<Option<ApiError>> = vec![None; chunkers.len()];
            while left > 0 {
                // a client gone while the prompt is ingested (no event for a while) is noticed here: the
                // response stream dropped its receiver, and dropping `r` cancels the job at the next step
                let ev = tokio::select! {
                    ev = r.rx.recv() => ev,
                    _ = tx.closed() => return,
                };
                let Some((i, ev)) = ev else { break };
                if ended[i] {
                    continue;
                }
                let chunker = &mut chunkers[i];
                // every choice ends with one finish chunk: its generation's, or an empty one ending in an error
                let (generation, tail) = match ev {
                    Event::Token { id, text, logprob } => {
                        n[i] += 1;
                        for c in chunker.token(id, &text, logprob.as_ref()) {
                            if !send(stamp(c, i)).await {
                                return; // the client is gone: dropping `r` cancels the job
                            }
                        }
                        continue;
                    }
                    Event::Done { generation, text } => {
                        if generation.stop_reason == StopReason::Error {
                            errors[i] = Some(generation_failed(&generation));
                        }
                        (*generation, text)
                    }
                    Event::Failed(e) => {
                        let e = ApiError::from(e);
                        let g = failed_generation(&e);
                        errors[i] = Some(e);
                        (g, String::new())
                    }
                    Event::Started { .. } => continue,
                };
                ended[i] = true;
                left -= 1;
                completion += generation.tokens.len().max(n[i]);
                spec = add_spec(spec, &generation);
                for c in chunker.done(&generation, &tail) {
                    if !send(stamp(c, i)).await {
                        return;
                    }
                }
            }
            if left == 0 {
                if let Some(u) = chunkers
                    .first()
                    .and_then(|c| c.usage(usage(&r, completion, spec)))
                {
                    if !send(u).await {
                        return;
                    }
                }
            }
            let failure = match errors.into_iter().flatten().next() {
                Some(e) => Some(e),
                None if left > 0 => {
                    Some(ApiError::internal("the engine stopped during the request"))
                }
                None => None,
            };
            if let Some(e) = failure {
                if !send(e.body()).await {
                    return;
                }
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        }
        .instrument(span),
    );
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
}
