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
    /// The job's events after `Started`.
    pub rx: mpsc::UnboundedReceiver<Event>,
    /// Cancels the job when dropped.
    pub guard: CancelGuard,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, reused from the cache.
    pub cached_tokens: usize,
}

/// Submits `prompt` (ids `[n]`) with `gen`'s settings and waits until a slot takes it. `prompt_field` is the
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
    let (tx, mut rx) = mpsc::unbounded_channel();
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
    };
    let prompt_tokens = prompt.len();
    // Once `/health` says shutting down, no request reaches the engine (its own shutdown may not have begun yet).
    if st.stopping.load(std::sync::atomic::Ordering::Relaxed) {
        return Err(backburner_engine::serve::SubmitError::ShuttingDown.into());
    }
    st.engine.submit(Job {
        id: id.to_string(),
        prompt,
        params,
        stable_prefix,
        cache_prompt: gen.cache_prompt,
        events: Box::new(move |ev| tx.send(ev).is_ok()),
        siblings: Vec::new(),
    })?;
    let guard = CancelGuard(cancel);
    match rx.recv().await {
        Some(Event::Started { cached_tokens, .. }) => Ok(Running {
            rx,
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

/// Waits for the whole generation. Errors: 500 when the engine failed mid-way with nothing to show, or stopped.
pub async fn collect(r: &mut Running) -> Result<Generation, ApiError> {
    while let Some(ev) = r.rx.recv().await {
        match ev {
            Event::Done { generation, .. } => {
                if generation.stop_reason == StopReason::Error && generation.tokens.is_empty() {
                    let why = generation.error.clone().unwrap_or_default();
                    return Err(ApiError::internal(format!("generation failed: {why}")));
                }
                return Ok(*generation);
            }
            Event::Failed(e) => return Err(e.into()),
            Event::Started { .. } | Event::Token { .. } => {}
        }
    }
    Err(ApiError::internal("the engine stopped during the request"))
}

/// A whole (non-streamed) answer with, when the engine failed after some tokens (`finish_reason: "error"`), the
/// `error` object a stream ends with beside its choices, so the client learns why.
pub fn with_failure(mut answer: Value, g: &Generation) -> Value {
    if g.stop_reason == StopReason::Error {
        let why = g.error.clone().unwrap_or_default();
        answer["error"] =
            ApiError::internal(format!("generation failed: {why}")).body()["error"].take();
    }
    answer
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
pub fn usage(r: &Running, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": r.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": r.cached_tokens},
    })
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
    /// The last chunks: the rest of the text, the finish reason, and the usage when asked.
    fn done(&mut self, g: &Generation, tail: &str, usage: Value) -> Vec<Value>;
}

/// Streams the job as server-sent events: the chunks, `data: [DONE]` at the end, an `error` object if the engine
/// failed mid-way; keep-alive comments while a long prompt is prefilled.
pub fn sse(
    mut r: Running,
    mut chunker: impl Chunker,
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
            for c in chunker.begin() {
                if !send(c).await {
                    return;
                }
            }
            let mut n = 0;
            loop {
                // a client gone while the prompt is ingested (no event for a while) is noticed here: the
                // response stream dropped its receiver, and dropping `r` cancels the job at the next step
                let ev = tokio::select! {
                    ev = r.rx.recv() => ev,
                    _ = tx.closed() => return,
                };
                let Some(ev) = ev else { break };
                let end = matches!(ev, Event::Done { .. } | Event::Failed(_));
                let chunks = match ev {
                    Event::Token { id, text, logprob } => {
                        n += 1;
                        chunker.token(id, &text, logprob.as_ref())
                    }
                    Event::Done { generation, text } => {
                        let u = usage(&r, generation.tokens.len().max(n));
                        let mut c = chunker.done(&generation, &text, u);
                        if generation.stop_reason == StopReason::Error {
                            let why = generation.error.clone().unwrap_or_default();
                            c.push(ApiError::internal(format!("generation failed: {why}")).body());
                        }
                        c
                    }
                    Event::Failed(e) => vec![ApiError::from(e).body()],
                    Event::Started { .. } => continue,
                };
                for c in chunks {
                    if !send(c).await {
                        return; // the client is gone: dropping `r` cancels the job
                    }
                }
                if end {
                    break;
                }
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        }
        .instrument(span),
    );
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(10)))
}
