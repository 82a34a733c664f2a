//! Backburner's OpenAI-compatible HTTP server: `POST /v1/chat/completions`, `POST /v1/completions` (streamed as
//! server-sent events or not), `GET /v1/models`, `GET /health`, `GET /metrics`, `GET /slots`, a chat page at `GET /`,
//! over a serving [`Engine`](backburner_engine::serve::Engine) whose scheduler thread does the compute: handlers only
//! parse, render, tokenize (on the blocking pool), submit and forward.
#![warn(missing_docs)]

mod chat;
mod completions;
mod constrain;
pub mod error;
mod extras;
mod fields;
mod logprobs;
mod metrics;
mod nested;
mod page;
pub mod request;
mod slots;
pub mod stream;
mod tool_grammar;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use backburner_engine::serve::EngineClient;
use backburner_model::TextTokenizer;
use serde_json::json;

pub use error::ApiError;

/// Largest request body accepted (bytes): long agent conversations with tool results fit.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// What the handlers share.
pub struct AppState {
    /// The serving engine ([`backburner_engine::serve::Engine`], or a scripted one in tests).
    pub engine: Arc<dyn EngineClient>,
    /// The tokenizer and chat template (`None`: only `/v1/completions` with token ids works).
    pub tokenizer: Option<Arc<TextTokenizer>>,
    /// The model's name in the API (`model` fields, `/v1/models`).
    pub model_id: String,
    /// Context length of each slot (tokens).
    pub context_length: usize,
    /// Ids that end generation.
    pub eos_ids: Vec<u32>,
    /// `Authorization: Bearer` key every `/v1` request must carry (`None`: open).
    pub api_key: Option<String>,
    /// Server start (Unix seconds), the models' `created`.
    pub created: u64,
    /// Most bytes of text one token stands for (the longest token of the vocabulary): a prompt longer than the
    /// context times this cannot fit, and is refused before it is tokenized.
    pub max_token_bytes: usize,
    /// Request counter for ids.
    next_id: AtomicU64,
    /// Set while shutting down: `/health` answers 503.
    pub stopping: AtomicBool,
    /// The vocabulary's grammars for constrained output, built on first use (or why they could not be).
    pub grammars: std::sync::OnceLock<Result<Arc<backburner_engine::constraint::Grammars>, String>>,
    /// Origins a browser page may call this server from (`--cors-origin`; `*`: any); empty: no CORS headers.
    pub cors_origins: Vec<String>,
    /// Whether `GET /slots` answers (`serve --no-slots`: 501).
    pub slots_endpoint: bool,
    /// Speculative decoding for every request (`serve --spec`); `None`: off.
    pub spec: Option<backburner_engine::spec::SpecParams>,
}

impl AppState {
    /// State over a started engine.
    pub fn new(
        engine: Arc<dyn EngineClient>,
        tokenizer: Option<Arc<TextTokenizer>>,
        model_id: String,
        context_length: usize,
        eos_ids: Vec<u32>,
        api_key: Option<String>,
    ) -> Self {
        let max_token_bytes = tokenizer
            .as_ref()
            .map_or(usize::MAX, |t| t.max_token_bytes());
        AppState {
            max_token_bytes,
            engine,
            tokenizer,
            model_id,
            context_length,
            eos_ids,
            api_key,
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            next_id: AtomicU64::new(1),
            stopping: AtomicBool::new(false),
            grammars: std::sync::OnceLock::new(),
            cors_origins: Vec::new(),
            slots_endpoint: true,
            spec: None,
        }
    }

    /// Now, in Unix seconds (a response's `created`).
    pub fn now() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs())
    }

    /// Refuses (400 `context_length_exceeded` about `param`) a text that cannot fit the context whatever its
    /// tokenization, before tokenizing it.
    pub fn check_text_len(&self, text: &str, param: &str) -> Result<(), ApiError> {
        if text.len() / self.max_token_bytes.max(1) >= self.context_length {
            return Err(ApiError::invalid(
                Some(param),
                format!(
                    "the prompt has {} bytes, more than this server's context of {} tokens can hold",
                    text.len(),
                    self.context_length
                ),
            )
            .with_code("context_length_exceeded"));
        }
        Ok(())
    }

    /// A new request id with `prefix` (`chatcmpl`, `cmpl`).
    pub fn request_id(&self, prefix: &str) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{prefix}-{:08x}{n:06x}", self.created & 0xffff_ffff)
    }

    /// Checks the API key. Errors: 401.
    pub fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim());
        match given {
            Some(g) if constant_time_eq(g.as_bytes(), key.as_bytes()) => Ok(()),
            _ => Err(ApiError::unauthorized()),
        }
    }

    /// Checks a request's `model` field (absent or empty is this model). Errors: 404.
    pub fn check_model(&self, asked: Option<&str>) -> Result<(), ApiError> {
        match asked {
            None | Some("") => Ok(()),
            Some(m) if m == self.model_id => Ok(()),
            Some(m) => Err(ApiError::unknown_model(m, &self.model_id)),
        }
    }

    /// The tokenizer. Errors: 400 when the model directory has none.
    pub fn tokenizer(&self) -> Result<Arc<TextTokenizer>, ApiError> {
        self.tokenizer.clone().ok_or_else(|| {
            ApiError::invalid(
                None,
                "this model has no tokenizer: send token ids to /v1/completions",
            )
        })
    }
}

/// Runs an endpoint in a tracing span with a new request id (`prefix-…`): checks the API key, parses the body as a
/// JSON object, checks its `model`, and hands the object to `run`; any error becomes the OpenAI error response.
pub(crate) async fn handle_with<F, Fut>(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
    (prefix, endpoint): (&str, &'static str),
    run: F,
) -> Response
where
    F: FnOnce(Arc<AppState>, serde_json::Map<String, serde_json::Value>, String) -> Fut,
    Fut: std::future::Future<Output = Result<Response, ApiError>>,
{
    use tracing::Instrument;
    let id = st.request_id(prefix);
    let span = tracing::info_span!("request", id = %id, endpoint);
    let engine = st.engine.clone();
    async move {
        st.authorize(&headers)?;
        let map = request::parse(&body)?;
        st.check_model(request::Body(&map).str("model")?)?;
        run(st, map, id).await
    }
    .instrument(span)
    .await
    .unwrap_or_else(|e| {
        if e.status == axum::http::StatusCode::BAD_REQUEST {
            backburner_engine::serve::Metrics::add(&engine.metrics().bad_requests, 1);
        }
        e.into_response()
    })
}

/// Compares without an early exit on the first differing byte.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The routes over `state`, with CORS headers for `state.cors_origins` (preflight `OPTIONS` answered; the
/// `Authorization` and `Content-Type` headers allowed, so a page can send the API key).
pub fn router(state: Arc<AppState>) -> Router {
    let cors = cors_layer(&state.cors_origins);
    let r = routes(state);
    match cors {
        Some(c) => r.layer(c),
        None => r,
    }
}

fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, Any, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| o.parse().ok()))
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
            .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE])
            .max_age(Duration::from_secs(600))
            .expose_headers(Any),
    )
}

fn routes(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat::handle))
        .route("/v1/completions", post(completions::handle))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(extras::model))
        .route("/tokenize", post(extras::tokenize))
        .route("/detokenize", post(extras::detokenize))
        .route("/props", get(extras::props))
        .route("/slots", get(slots::handle))
        .route("/", get(page::handle))
        .route("/health", get(health))
        .route("/metrics", get(metrics_page))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// The endpoints [`routes`] serves, as the 404 lists them.
pub const ENDPOINTS: &[&str] = &[
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "GET /v1/models",
    "GET /v1/models/{id}",
    "POST /tokenize",
    "POST /detokenize",
    "GET /props",
    "GET /slots",
    "GET /health",
    "GET /metrics",
    "GET /",
];

/// Unknown paths: 404 in OpenAI's error shape (clients parse it), not an empty body, listing what this server has
/// and, for the paths other servers use (llama-server's `/completion`, Ollama's `/api/…`), what to call instead.
async fn not_found(uri: axum::http::Uri) -> Response {
    let path = uri.path();
    let instead = match path.trim_end_matches('/') {
        "/completion" | "/completions" | "/v1/completion" | "/api/generate" => {
            "; use /v1/completions (or /v1/chat/completions)"
        }
        "/chat/completions" | "/v1/chat/completion" | "/api/chat" => "; use /v1/chat/completions",
        "/v1/embeddings" | "/embedding" | "/embeddings" | "/api/embed" | "/api/embeddings" => {
            "; embeddings are not served (this server generates text)"
        }
        "/models" | "/api/tags" => "; use /v1/models",
        _ => "",
    };
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "invalid_request_error",
        message: format!(
            "no such endpoint: {path}{instead}; this server has {}",
            ENDPOINTS.join(", ")
        ),
        param: None,
        code: Some("not_found"),
    }
    .into_response()
}

/// A known path with another method: 405 in OpenAI's error shape.
async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        kind: "invalid_request_error",
        message: format!("{} does not take {method}", uri.path()),
        param: None,
        code: Some("method_not_allowed"),
    }
    .into_response()
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    Json(json!({"object": "list", "data": [{
        "id": st.model_id, "object": "model", "created": st.created, "owned_by": "backburner",
        "meta": {"context_length": st.context_length, "slots": st.engine.slots()},
    }]}))
    .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.stopping.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting down"})),
        )
            .into_response();
    }
    let m = st.engine.metrics();
    use backburner_engine::serve::Metrics;
    let mut body = json!({
        "status": "ok",
        "slots": st.engine.slots(),
        "slots_busy": Metrics::get(&m.active),
        "queue_depth": m.waiting(),
        "workers_attached": Metrics::get(&m.workers_attached),
        "workers_connected": Metrics::get(&m.workers_available),
    });
    match m.degraded() {
        // a load balancer should send requests elsewhere while a worker the answers need is gone
        Some(reason) => {
            body["status"] = "degraded".into();
            body["reason"] = reason.into();
            (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
        }
        None => Json(body).into_response(),
    }
}

async fn metrics_page(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        metrics::render(st.engine.metrics(), st.engine.slots()),
    )
        .into_response()
}

/// Serves `state` on `listener` until `shutdown` resolves; then stops accepting, lets the engine finish running
/// requests for up to `grace` (cancelling the rest) and returns once every connection is closed.
///
/// Errors: the listener's I/O errors.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    grace: Duration,
) -> std::io::Result<()> {
    let st = state.clone();
    let signal = async move {
        shutdown.await;
        tracing::info!(grace_s = grace.as_secs_f64(), "shutting down");
        st.stopping.store(true, Ordering::Relaxed);
        let engine = st.engine.clone();
        // finishing the running requests ends their streams, so the connections can close
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(grace)).await;
    };
    axum::serve(listener, router(state))
        .with_graceful_shutdown(signal)
        .await
}
