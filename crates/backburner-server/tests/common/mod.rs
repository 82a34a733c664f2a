//! Shared helpers for the HTTP tests: a real server on an ephemeral port (over the real engine on the tiny fixture
//! model, or a scripted backend), a `reqwest` client, a small server-sent-events parser, and bounded waits (every
//! await goes through [`bounded`], so a bug fails the test instead of hanging the suite).
#![allow(dead_code)]

use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use backburner_engine::serve::{CacheLimits, Engine, EngineClient, ServeOptions};
use backburner_engine::{Session, SessionOptions};
use backburner_model::{Model, TextTokenizer};
use backburner_server::AppState;
use reqwest::header::HeaderMap;
use reqwest::StatusCode;
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The longest any single wait may take before the test fails.
pub const LIMIT: Duration = Duration::from_secs(120);

/// The model's name in the API in these tests.
pub const MODEL_ID: &str = "tiny";

/// Awaits `f`, failing the test (with `what`) if it takes longer than [`LIMIT`].
pub async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(LIMIT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {LIMIT:?}: {what}"),
    }
}

/// `fixtures/<name>` in the repository.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// The tiny fixture model (`fixtures/tiny-hub`, vocabulary 512), loaded once per test binary.
pub fn model() -> Arc<Model> {
    static M: OnceLock<Arc<Model>> = OnceLock::new();
    M.get_or_init(|| Arc::new(Model::load(&fixture("tiny-hub")).expect("tiny-hub loads")))
        .clone()
}

/// The tiny fixture's tokenizer (448 ids, eos `<|im_end|>` 447 and `<|endoftext|>` 445) with the real Qwen3.5 chat
/// template (`assets/qwen3.5/chat_template.jinja`: tools, tool calls, `<think>`): the fixture's own template is a
/// minimal one without them.
pub fn tokenizer() -> Arc<TextTokenizer> {
    static T: OnceLock<Arc<TextTokenizer>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let src = fixture("tiny-hub");
        for f in [
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            std::fs::copy(src.join(f), dir.path().join(f)).expect("copy tokenizer files");
        }
        std::fs::copy(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../assets/qwen3.5/chat_template.jinja"),
            dir.path().join("chat_template.jinja"),
        )
        .expect("copy the chat template");
        let m = model();
        let t =
            TextTokenizer::from_dir(dir.path(), m.config().vocab_size, &m.config().eos_token_ids)
                .expect("tokenizer loads")
                .expect("a tokenizer");
        Arc::new(t)
    })
    .clone()
}

/// Tokens per ubatch of the test slots: small, so that the short chats of the tests reuse exact checkpoints (every
/// multiple of 16 is a grid point; see `backburner_engine::grid`).
pub const UBATCH: usize = 16;

/// Session options of a slot: the defaults with ubatch [`UBATCH`], and `context` tokens of context when given.
pub fn session_options(context: Option<usize>) -> SessionOptions {
    SessionOptions {
        context_length: context,
        ubatch: UBATCH,
        ..SessionOptions::default()
    }
}

/// The tokens a slot whose history was prefilled from `prev` (a prompt of at most 16 ubatches: every ubatch end
/// is still a checkpoint) reuses for `next`: the largest ubatch end inside their common prefix and before `next`'s
/// last token.
pub fn exact_reuse(prev: &[u32], next: &[u32]) -> usize {
    let shared = prev
        .iter()
        .zip(next)
        .take_while(|(a, b)| a == b)
        .count()
        .min(next.len() - 1);
    assert!(
        prev.len() <= 16 * UBATCH,
        "a prompt past the checkpoints kept"
    );
    shared - shared % UBATCH
}

/// A serving engine on the tiny model: `slots` slots, `queue` places in the queue.
pub fn engine(slots: usize, queue: usize, context: Option<usize>) -> Arc<Engine> {
    engine_with(slots, queue, context, Some(tokenizer()))
}

/// [`engine`] with the given tokenizer (`None`: a model that runs from token ids only).
pub fn engine_with(
    slots: usize,
    queue: usize,
    context: Option<usize>,
    tok: Option<Arc<TextTokenizer>>,
) -> Arc<Engine> {
    let sessions = (0..slots)
        .map(|_| Session::new(model(), session_options(context)).expect("session"))
        .collect();
    let opts = ServeOptions {
        queue,
        cache: CacheLimits::default(),
        ..Default::default()
    };
    Arc::new(Engine::start(sessions, tok, opts).expect("engine starts"))
}

/// The server's state over `backend`, with the tiny tokenizer.
pub fn state(backend: Arc<dyn EngineClient>, context: usize, api_key: Option<&str>) -> AppState {
    let tok = tokenizer();
    let eos = tok.eos_ids().to_vec();
    AppState::new(
        backend,
        Some(tok),
        MODEL_ID.into(),
        context,
        eos,
        api_key.map(str::to_string),
    )
}

/// Settings of a test server over the real engine.
#[derive(Clone, Debug)]
pub struct Setup {
    pub slots: usize,
    pub queue: usize,
    /// Context length per slot (`None`: the model's 4096).
    pub context: Option<usize>,
    pub api_key: Option<&'static str>,
    /// How long running requests get to finish at shutdown.
    pub grace: Duration,
}

impl Default for Setup {
    fn default() -> Self {
        Setup {
            slots: 1,
            queue: 8,
            context: None,
            api_key: None,
            grace: Duration::from_secs(5),
        }
    }
}

/// A server running in this test's runtime on `127.0.0.1:<ephemeral>`.
pub struct Server {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    pub client: reqwest::Client,
    pub state: Arc<AppState>,
    /// The key sent with every request (`Authorization: Bearer`), if any.
    pub key: Option<String>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Server {
    /// A server over the real engine on the tiny model.
    pub async fn engine(setup: Setup) -> Server {
        let ctx = setup
            .context
            .unwrap_or(model().config().max_position_embeddings);
        let e = engine(setup.slots, setup.queue, setup.context);
        let mut s = Server::start(state(e, ctx, setup.api_key), setup.grace).await;
        s.key = setup.api_key.map(str::to_string);
        s
    }

    /// Serves `state` on an ephemeral port.
    pub async fn start(state: AppState, grace: Duration) -> Server {
        let listener = bounded("bind", tokio::net::TcpListener::bind("127.0.0.1:0"))
            .await
            .expect("bind an ephemeral port");
        let addr = listener.local_addr().expect("local address");
        let state = Arc::new(state);
        let (tx, rx) = oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        };
        let task = tokio::spawn(backburner_server::serve(
            listener,
            state.clone(),
            shutdown,
            grace,
        ));
        Server {
            base: format!("http://{addr}"),
            client: reqwest::Client::builder()
                .timeout(LIMIT)
                .build()
                .expect("client"),
            state,
            key: None,
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Triggers the shutdown future (the serve future keeps running until its connections close).
    pub fn trigger_shutdown(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }

    /// Waits for the serve future to return (after [`Server::trigger_shutdown`]).
    pub async fn join(&mut self) -> std::io::Result<()> {
        let task = self.task.take().expect("not joined yet");
        bounded("the serve future to return", task)
            .await
            .expect("the serve task did not panic")
    }

    /// Shuts down and waits for the serve future.
    pub async fn stop(mut self) {
        self.trigger_shutdown();
        self.join().await.expect("serve returned Ok");
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn auth(&self, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.key {
            Some(k) => rb.bearer_auth(k),
            None => rb,
        }
    }

    /// POSTs raw bytes (content type JSON) and reads the JSON answer.
    pub async fn post_bytes(&self, path: &str, body: Vec<u8>) -> Reply {
        let rb = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body);
        Reply::read(bounded(path, self.auth(rb).send()).await.expect("send")).await
    }

    /// POSTs `body` as JSON and reads the JSON answer.
    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.post_bytes(path, serde_json::to_vec(body).unwrap())
            .await
    }

    /// POSTs `body` and returns the response unread (for streams).
    pub async fn post_response(&self, path: &str, body: &Value) -> reqwest::Response {
        let rb = self.client.post(self.url(path)).json(body);
        bounded(path, self.auth(rb).send()).await.expect("send")
    }

    /// POSTs a streaming request and reads the whole stream.
    pub async fn stream(&self, path: &str, body: &Value) -> Stream {
        let r = self.post_response(path, body).await;
        assert_eq!(r.status(), StatusCode::OK, "streaming {path}");
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "content type {ct}");
        let mut rd = SseReader::new(r);
        let mut s = Stream::default();
        while let Some(d) = rd.next().await {
            if d == "[DONE]" {
                s.done = true;
                assert!(rd.next().await.is_none(), "nothing after [DONE]");
                break;
            }
            s.chunks
                .push(serde_json::from_str(&d).unwrap_or_else(|e| panic!("chunk {d:?}: {e}")));
        }
        s
    }

    /// GETs `path` (with the key) and returns the status and the body as text.
    pub async fn get_text(&self, path: &str) -> (StatusCode, String) {
        let rb = self.client.get(self.url(path));
        let r = bounded(path, self.auth(rb).send()).await.expect("send");
        let status = r.status();
        (status, bounded(path, r.text()).await.expect("body"))
    }

    /// GETs `path` and parses the JSON answer.
    pub async fn get(&self, path: &str) -> Reply {
        let rb = self.client.get(self.url(path));
        Reply::read(bounded(path, self.auth(rb).send()).await.expect("send")).await
    }

    /// The value of a sample on `/metrics` (e.g. `backburner_requests_total{outcome="ok"}`).
    pub async fn metric(&self, sample: &str) -> f64 {
        let (status, text) = self.get_text("/metrics").await;
        assert_eq!(status, StatusCode::OK);
        metric_value(&text, sample)
    }
}

/// The value of `sample` in a Prometheus text page.
pub fn metric_value(page: &str, sample: &str) -> f64 {
    page.lines()
        .find_map(|l| {
            l.strip_prefix(sample)
                .and_then(|r| r.strip_prefix(' '))
                .map(|v| v.trim().parse::<f64>().expect("a number"))
        })
        .unwrap_or_else(|| panic!("no sample {sample} in\n{page}"))
}

/// A non-streamed answer.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub json: Value,
}

impl Reply {
    async fn read(r: reqwest::Response) -> Reply {
        let status = r.status();
        let headers = r.headers().clone();
        let text = bounded("the body", r.text()).await.expect("body");
        let json = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("status {status}: body is not JSON ({e}): {text:?}"));
        Reply {
            status,
            headers,
            json,
        }
    }

    /// Asserts a 200 and returns the JSON.
    pub fn ok(self) -> Value {
        assert_eq!(self.status, StatusCode::OK, "{}", self.json);
        self.json
    }

    /// Asserts an error in OpenAI's shape with this status, and returns `(type, param, code, message)`.
    pub fn error(&self, status: u16) -> (String, Option<String>, Option<String>, String) {
        assert_eq!(self.status.as_u16(), status, "{}", self.json);
        let obj = self.json.as_object().expect("an object");
        assert_eq!(obj.len(), 1, "only `error`: {}", self.json);
        let e = self.json["error"]
            .as_object()
            .expect("`error` is an object");
        let mut keys: Vec<&str> = e.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["code", "message", "param", "type"], "{}", self.json);
        let s = |k: &str| e[k].as_str().map(str::to_string);
        assert!(
            e["param"].is_null() || e["param"].is_string(),
            "{}",
            self.json
        );
        assert!(
            e["code"].is_null() || e["code"].is_string(),
            "{}",
            self.json
        );
        let message = s("message").expect("a message");
        assert!(!message.is_empty());
        (s("type").expect("a type"), s("param"), s("code"), message)
    }
}

/// A whole server-sent-events stream: the JSON chunks, and whether `data: [DONE]` ended it.
#[derive(Debug, Default)]
pub struct Stream {
    pub chunks: Vec<Value>,
    pub done: bool,
}

impl Stream {
    /// The chunks that carry a choice (not the usage chunk).
    pub fn choices(&self) -> impl Iterator<Item = &Value> {
        self.chunks
            .iter()
            .filter(|c| !c["choices"].as_array().unwrap().is_empty())
            .map(|c| &c["choices"][0])
    }

    /// The concatenation of a string field of the chat deltas (`content`, `reasoning_content`).
    pub fn delta_text(&self, field: &str) -> String {
        self.choices()
            .filter_map(|c| c["delta"][field].as_str())
            .collect()
    }

    /// The concatenation of the completions' `token_ids` (`return_token_ids`).
    pub fn token_ids(&self) -> Vec<u32> {
        self.choices()
            .flat_map(|c| c["token_ids"].as_array().expect("token_ids").clone())
            .map(|v| u32::try_from(v.as_u64().expect("an id")).expect("a u32 id"))
            .collect()
    }

    /// The concatenation of the completions' `text`.
    pub fn text(&self) -> String {
        self.choices().filter_map(|c| c["text"].as_str()).collect()
    }

    /// The finish reasons given, in order (only the last chunk should have one).
    pub fn finish_reasons(&self) -> Vec<String> {
        self.choices()
            .filter_map(|c| c["finish_reason"].as_str().map(str::to_string))
            .collect()
    }
}

/// An incremental server-sent-events reader over a response body: events end at a blank line; an event's data is
/// its `data:` lines joined by newlines; comments (`:` keep-alives) and events without data are skipped.
pub struct SseReader {
    resp: reqwest::Response,
    buf: Vec<u8>,
    ended: bool,
}

impl SseReader {
    pub fn new(resp: reqwest::Response) -> Self {
        SseReader {
            resp,
            buf: Vec::new(),
            ended: false,
        }
    }

    /// The next event's data; `None` at the end of the body.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            // CRLF and LF line ends are both allowed (a chunk may split a CRLF or a character: search bytes)
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..end + 2).collect();
                let block = String::from_utf8(block).expect("UTF-8 events");
                let data: Vec<&str> = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue;
                }
                return Some(data.join("\n"));
            }
            if self.ended {
                assert!(
                    self.buf.iter().all(u8::is_ascii_whitespace),
                    "the stream ended inside an event: {:?}",
                    String::from_utf8_lossy(&self.buf)
                );
                return None;
            }
            match bounded("the next stream chunk", self.resp.chunk())
                .await
                .expect("reading the stream")
            {
                Some(b) => {
                    self.buf.extend_from_slice(&b);
                    // CRLF → LF once the pair is whole
                    let mut i = 0;
                    while i + 1 < self.buf.len() {
                        if self.buf[i] == b'\r' && self.buf[i + 1] == b'\n' {
                            self.buf.remove(i);
                        }
                        i += 1;
                    }
                }
                None => self.ended = true,
            }
        }
    }

    /// The next event's data parsed as JSON (panics at the end or on `[DONE]`).
    pub async fn next_json(&mut self) -> Value {
        let d = self.next().await.expect("another event");
        serde_json::from_str(&d).unwrap_or_else(|e| panic!("chunk {d:?}: {e}"))
    }
}

/// A chat request body: one user message, greedy.
pub fn chat_body(user: &str, max_tokens: usize) -> Value {
    serde_json::json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    })
}

/// `generate` of `prompt` on a fresh session with `sampling`, the server's eos ids, the tokenizer for the text and
/// `logprobs` alternatives per token: what the server must answer.
pub fn generate_fresh(
    prompt: &[u32],
    max_tokens: usize,
    sampling: backburner_engine::SamplingParams,
    logprobs: Option<usize>,
) -> backburner_engine::Generation {
    let mut s = Session::new(model(), session_options(None)).unwrap();
    let params = backburner_engine::GenerateParams {
        max_tokens,
        sampling,
        eos_ids: tokenizer().eos_ids().to_vec(),
        logprobs,
        ..Default::default()
    };
    let tok = tokenizer();
    backburner_engine::generate(
        &mut s,
        prompt,
        &params,
        Some(&tok),
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap()
}
