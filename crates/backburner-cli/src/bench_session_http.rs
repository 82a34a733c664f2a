//! The HTTP side of `backburner bench session`: an in-process `serve` instance on a loopback port (the same
//! [`backburner_server::serve`] over the same [`Engine`] as `backburner serve`), and a streaming chat client that
//! times the first answer of a request.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backburner_engine::serve::{Engine, ServeOptions};
use backburner_engine::Session;
use backburner_model::TextTokenizer;
use backburner_server::AppState;
use serde::Serialize;
use serde_json::Value;

/// A running in-process server: its chat URL, its engine (for the link statistics), and the means to stop it.
pub(crate) struct BenchServer {
    /// `http://127.0.0.1:PORT/v1/chat/completions`.
    pub url: String,
    /// The model's name in the API.
    pub model_id: String,
    /// The serving engine.
    pub engine: Arc<Engine>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl BenchServer {
    /// Starts the engine over `sessions` (one slot each) and serves it on `127.0.0.1:0`. Must run inside a Tokio
    /// runtime. Errors: an engine that does not start, a port that cannot be bound.
    pub async fn start(
        sessions: Vec<Session>,
        tokenizer: Arc<TextTokenizer>,
        model_id: &str,
    ) -> Result<BenchServer> {
        let context_length = sessions.first().context("no slot")?.context_length();
        let eos = tokenizer.eos_ids().to_vec();
        let engine = Arc::new(Engine::start(
            sessions,
            Some(tokenizer.clone()),
            ServeOptions::default(),
        )?);
        let state = Arc::new(AppState::new(
            engine.clone(),
            Some(tokenizer),
            model_id.to_string(),
            context_length,
            eos,
            None,
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding 127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        };
        let task = tokio::spawn(backburner_server::serve(
            listener,
            state,
            shutdown,
            Duration::from_secs(1),
        ));
        Ok(BenchServer {
            url: format!("http://{addr}/v1/chat/completions"),
            model_id: model_id.to_string(),
            engine,
            stop: Some(tx),
            task,
        })
    }

    /// Stops serving and waits until the engine and every connection are done.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        (&mut self.task)
            .await
            .context("the server task panicked")?
            .context("serving")
    }
}

/// One streamed chat request as the client saw it.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Reply {
    /// Seconds from sending the request to the first streamed content, reasoning or tool-call delta (the end of
    /// the stream when none came).
    pub first_answer_s: f64,
    /// Seconds from sending the request to the end of the stream.
    pub total_s: f64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: usize,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: usize,
    /// `usage.completion_tokens`.
    pub completion_tokens: usize,
    /// Whether any delta carried text (false: `first_answer_s` is the end of the stream).
    pub answered: bool,
    /// The streamed text (reasoning, content and tool calls, in order), to compare the modes' answers.
    #[serde(skip)]
    pub text: String,
}

/// What the stream has shown so far.
#[derive(Default)]
struct StreamState {
    first: Option<Duration>,
    text: String,
    usage: Option<Value>,
    done: bool,
}

impl StreamState {
    /// Takes one `data:` payload (a JSON chunk or `[DONE]`) that arrived `at` after the request was sent.
    fn take(&mut self, data: &str, at: Duration) -> Result<()> {
        if data == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let v: Value =
            serde_json::from_str(data).with_context(|| format!("a stream chunk: {data}"))?;
        if let Some(e) = v.get("error") {
            bail!("the server failed the request: {e}");
        }
        if let Some(d) = v.pointer("/choices/0/delta") {
            let mut piece = String::new();
            for k in ["reasoning_content", "content"] {
                piece += d.get(k).and_then(Value::as_str).unwrap_or("");
            }
            if let Some(calls) = d.get("tool_calls").and_then(Value::as_array) {
                if !calls.is_empty() {
                    piece += &Value::Array(calls.clone()).to_string();
                }
            }
            if !piece.is_empty() && self.first.is_none() {
                self.first = Some(at);
            }
            self.text += &piece;
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        Ok(())
    }
}

/// POSTs `body` (a chat request with `"stream": true` and `stream_options.include_usage`) to `url` and reads the
/// server-sent events to the end. Errors: a connection error, a status other than 200, an `error` chunk, a stream
/// that ends without `[DONE]` or without usage.
pub(crate) async fn chat_stream(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
) -> Result<Reply> {
    let t = Instant::now();
    let mut resp = client
        .post(url)
        .json(body)
        .send()
        .await
        .context("sending the request")?;
    if !resp.status().is_success() {
        let status = resp.status();
        bail!("HTTP {status}: {}", resp.text().await.unwrap_or_default());
    }
    let mut st = StreamState::default();
    let mut buf: Vec<u8> = Vec::new();
    while let Some(chunk) = resp.chunk().await.context("reading the stream")? {
        let at = t.elapsed();
        buf.extend_from_slice(&chunk);
        while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = buf.drain(..end + 2).collect();
            let event = std::str::from_utf8(&event).context("a stream event is not UTF-8")?;
            for line in event.lines() {
                if let Some(data) = line.strip_prefix("data:") {
                    st.take(data.trim(), at)?;
                }
            }
        }
    }
    let total = t.elapsed();
    if !st.done {
        bail!("the stream ended without [DONE]");
    }
    let u = st.usage.context("the stream carried no usage")?;
    let n = |p: &str| u.pointer(p).and_then(Value::as_u64).unwrap_or(0) as usize;
    Ok(Reply {
        first_answer_s: st.first.unwrap_or(total).as_secs_f64(),
        total_s: total.as_secs_f64(),
        prompt_tokens: n("/prompt_tokens"),
        cached_tokens: n("/prompt_tokens_details/cached_tokens"),
        completion_tokens: n("/completion_tokens"),
        answered: st.first.is_some(),
        text: st.text,
    })
}
