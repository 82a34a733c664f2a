//! The endpoints clients call besides the completions: `GET /v1/models/{id}` (OpenAI), and llama-server's
//! `POST /tokenize`, `POST /detokenize` and `GET /props`, in their shapes. All need the API key when one is set.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::{self, Body};
use crate::AppState;

/// `GET /v1/models/{id}`: the served model, or 404 `model_not_found`.
pub(crate) async fn model(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Response {
    let r = st.authorize(&headers).and_then(|_| {
        if id == st.model_id {
            Ok(Json(
                json!({"id": st.model_id, "object": "model", "created": st.created,
                       "owned_by": "backburner",
                       "meta": {"context_length": st.context_length, "slots": st.engine.slots()}}),
            ))
        } else {
            Err(ApiError {
                status: axum::http::StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                message: format!("no model {id:?}; this server serves {:?}", st.model_id),
                param: Some("model".into()),
                code: Some("model_not_found"),
            })
        }
    });
    r.into_response()
}

/// The fields `/tokenize` reads (llama-server's).
const TOKENIZE_FIELDS: &[&str] = &["content", "with_pieces", "add_special", "parse_special"];

/// The fields `/detokenize` reads (llama-server's).
const DETOKENIZE_FIELDS: &[&str] = &["tokens"];

/// A 400 naming the first field of `map` not in `known`.
fn known_fields(map: &serde_json::Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(
            Some(k),
            format!("unrecognized field `{k}` (known: {})", known.join(", ")),
        )),
        None => Ok(()),
    }
}

/// The response of `r`; a 400 counts in `backburner_bad_requests_total`, as the completions' do.
fn answer(st: &AppState, r: Result<Json<Value>, ApiError>) -> Response {
    if let Err(e) = &r {
        if e.status == axum::http::StatusCode::BAD_REQUEST {
            backburner_engine::serve::Metrics::add(&st.engine.metrics().bad_requests, 1);
        }
    }
    r.into_response()
}

/// `POST /tokenize` `{"content": text, "with_pieces": bool}` → `{"tokens": [ids]}`, or with pieces
/// `{"tokens": [{"id", "piece"}]}` (a piece is the token's text, or its bytes as a list when they are not UTF-8).
/// Special tokens written in the text map to their ids (llama-server's `parse_special` default; `false` is a 400);
/// `add_special` is accepted either way (a Qwen model adds no BOS). Another field is a 400 naming it.
pub(crate) async fn tokenize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        let map = request::parse(&body)?;
        let b = Body(&map);
        let text = b
            .str("content")?
            .ok_or_else(|| ApiError::invalid(Some("content"), "`content` (a string) is required"))?
            .to_string();
        known_fields(&map, TOKENIZE_FIELDS)?;
        // a Qwen tokenizer adds no BOS: `add_special` changes nothing, either way
        b.bool("add_special")?;
        if b.bool("parse_special")? == Some(false) {
            return Err(ApiError::invalid(
                Some("parse_special"),
                "`parse_special: false` (special tokens' text tokenized as plain text) is not supported",
            ));
        }
        let pieces = b.bool("with_pieces")?.unwrap_or(false);
        st.check_text_len(&text, "content")?;
        let tok = st.tokenizer()?;
        let out = tokio::task::spawn_blocking(move || -> Result<Value, ApiError> {
            let ids = tok
                .encode(&text)
                .map_err(|e| ApiError::invalid(Some("content"), e.to_string()))?;
            if !pieces {
                return Ok(json!({"tokens": ids}));
            }
            let list: Vec<Value> = ids
                .iter()
                .map(|&id| {
                    let b = tok.token_bytes(id).unwrap_or_default();
                    let piece = match String::from_utf8(b) {
                        Ok(s) => json!(s),
                        Err(e) => json!(e.into_bytes()),
                    };
                    json!({"id": id, "piece": piece})
                })
                .collect();
            Ok(json!({"tokens": list}))
        })
        .await
        .map_err(|e| ApiError::internal(e.to_string()))??;
        Ok::<_, ApiError>(Json(out))
    };
    answer(&st, r.await)
}

/// `POST /detokenize` `{"tokens": [ids]}` → `{"content": text}`. Errors: 400 naming `tokens` for a value that is
/// not an id of the vocabulary, or naming another field.
pub(crate) async fn detokenize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let r = async {
        st.authorize(&headers)?;
        let map = request::parse(&body)?;
        known_fields(&map, DETOKENIZE_FIELDS)?;
        let b = Body(&map);
        let tok = st.tokenizer()?;
        let ids: Vec<u32> = b
            .array("tokens")?
            .ok_or_else(|| {
                ApiError::invalid(Some("tokens"), "`tokens` (an array of ids) is required")
            })?
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|u| u32::try_from(u).ok())
                    .filter(|&u| (u as usize) < tok.vocab_size())
                    .ok_or_else(|| {
                        ApiError::invalid(
                            Some("tokens"),
                            format!("{v} is not a token id of this vocabulary"),
                        )
                    })
            })
            .collect::<Result<_, _>>()?;
        let content = tokio::task::spawn_blocking(move || tok.decode(&ids))
            .await
            .map_err(|e| ApiError::internal(e.to_string()))?
            .map_err(|e| ApiError::invalid(Some("tokens"), e.to_string()))?;
        Ok::<_, ApiError>(Json(json!({"content": content})))
    };
    answer(&st, r.await)
}

/// `GET /props`: llama-server's server properties, those this server has.
pub(crate) async fn props(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    if let Err(e) = st.authorize(&headers) {
        return e.into_response();
    }
    let template = st
        .tokenizer
        .as_ref()
        .and_then(|t| t.chat_template_source().map(str::to_string));
    Json(json!({
        "default_generation_settings": {"n_ctx": st.context_length, "params": {
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repeat_penalty": 1.0}},
        "total_slots": st.engine.slots(),
        "model_alias": st.model_id,
        "chat_template": template,
        "build_info": format!("backburner {}", env!("CARGO_PKG_VERSION")),
    }))
    .into_response()
}
