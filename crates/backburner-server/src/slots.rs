//! llama-server's `GET /slots`: what each slot is doing, from the states the engine's scheduler publishes
//! ([`backburner_engine::serve::EngineClient::slot_states`]). Needs the API key when one is set; `serve --no-slots` turns
//! it off (501 `not_supported_error`, as llama-server answers).

use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use backburner_engine::serve::SlotInfo;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::AppState;

/// `GET /slots`: a JSON array with one object per slot, in llama-server's shape where a field has a meaning here:
///
/// - `id`: the slot's index; `n_ctx`: its context length (tokens); `speculative`: always `false`;
/// - `is_processing`: a request runs in it (one of its choices: each choice of an `n` > 1 request runs in a slot of
///   its own);
/// - `id_task`: the task's number, an integer as llama-server's: sequential from 0, one per choice taking a slot;
///   `-1` while idle;
/// - `id_request` (not in llama-server): the request's id, the `id` of its response (every choice of an `n` > 1
///   request shows the same); `null` while idle;
/// - `choice` (not in llama-server): the index of the choice it runs (0 … n−1); `null` while idle;
/// - `n_past`: tokens the slot holds (its history: the prompt and tokens decoded so far, or after a request what the
///   prompt cache may reuse);
/// - `n_prompt_tokens`, `n_prompt_tokens_cache` (reused from the slot's cache) and `n_prompt_tokens_processed`
///   (cached or prefilled so far) of the running request, 0 while idle;
/// - `next_token`: `has_next_token` (still generating), `n_decoded` (tokens generated), `n_remain` (tokens left
///   before `max_tokens`, `-1` when unbounded).
///
/// llama-server's `params` (sampling settings) and `prompt` text are not kept by the engine and left out. With
/// `?fail_on_no_slot=1` the answer is 503 when no slot is idle. Errors: 401 without the key; 501 with `--no-slots`.
pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    Query(q): Query<Vec<(String, String)>>,
) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    if !st.slots_endpoint {
        return ApiError {
            status: StatusCode::NOT_IMPLEMENTED,
            kind: "not_supported_error",
            message: "this server's /slots endpoint is off (started with --no-slots)".into(),
            param: None,
            code: Some("not_supported"),
        }
        .into_response();
    }
    let states = st.engine.slot_states();
    let fail = q
        .iter()
        .any(|(k, v)| k == "fail_on_no_slot" && !matches!(v.as_str(), "" | "0" | "false"));
    if fail && states.iter().all(|s| s.task.is_some()) {
        return ApiError::unavailable("no slot available").into_response();
    }
    let list: Vec<Value> = states
        .iter()
        .map(|s| slot_json(s, st.context_length, st.spec.is_some()))
        .collect();
    Json(Value::Array(list)).into_response()
}

/// One slot's object (see [`handle`]).
fn slot_json(s: &SlotInfo, n_ctx: usize, speculative: bool) -> Value {
    let t = s.task.as_ref();
    let id_task = t.map_or(json!(-1), |t| json!(t.task));
    let field = |f: fn(&backburner_engine::serve::SlotTask) -> usize| t.map_or(0, f);
    let remain = t.map_or(json!(0), |t| match t.max_tokens {
        usize::MAX => json!(-1),
        m => json!(m.saturating_sub(t.generated)),
    });
    json!({
        "id": s.id,
        "id_task": id_task,
        "id_request": t.map(|t| t.id.as_str()),
        "choice": t.map(|t| t.choice),
        "n_ctx": n_ctx,
        "speculative": speculative,
        "is_processing": t.is_some(),
        "n_past": s.n_past,
        "n_prompt_tokens": field(|t| t.prompt_tokens),
        "n_prompt_tokens_cache": field(|t| t.cached_tokens),
        "n_prompt_tokens_processed": field(|t| t.prompt_done),
        "next_token": {
            "has_next_token": t.is_some(),
            "n_decoded": field(|t| t.generated),
            "n_remain": remain,
        },
    })
}
