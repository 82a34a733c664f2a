//! `POST /v1/completions`: a prompt given as text or token ids, continued as plain text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use backburner_engine::{Generation, TokenLogprob};
use backburner_model::TextTokenizer;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::logprobs::{Legacy, TokenNames};
use crate::request::{Body, GenSettings};
use crate::stream::{self, Chunker};
use crate::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    crate::handle_with(st, headers, body, ("cmpl", "completions"), run).await
}

async fn run(st: Arc<AppState>, map: Map<String, Value>, id: String) -> Result<Response, ApiError> {
    let b = Body(&map);
    crate::fields::check_completions(&b)?;
    let mut gen = GenSettings::read(&b)?;
    gen.logprobs = crate::request::legacy_logprobs(&b)?;
    gen.constraint = crate::constrain::read(&st, &b, None, None).await?;
    if !gen.stop.is_empty() && st.tokenizer.is_none() {
        // stop strings match the generated text, which a model without a tokenizer does not have (as `run --stop`)
        return Err(ApiError::invalid(
            Some("stop"),
            "`stop` needs a tokenizer, and this model has none",
        ));
    }
    // The generated ids, as vLLM's `return_token_ids` gives them; always for a model without a tokenizer, whose
    // text is empty.
    let token_ids = b.bool("return_token_ids")? == Some(true) || st.tokenizer.is_none();
    let prompt = prompt_ids(&st, b.get("prompt")).await?;
    let mut r = stream::start(&st, &id, prompt, "prompt", None, &gen).await?;
    let created = AppState::now();
    let mut metas: Vec<Meta> = (0..r.choices)
        .map(|_| Meta {
            id: id.clone(),
            created,
            model: st.model_id.clone(),
            include_usage: gen.include_usage,
            token_ids,
            tok: st.tokenizer.clone().filter(|_| gen.logprobs.is_some()),
            logprobs: gen.logprobs.map(|_| Legacy::default()),
        })
        .collect();
    if gen.stream {
        return Ok(stream::sse(r, metas).into_response());
    }
    let done = stream::collect(&mut r).await?;
    let gs = &done.gs;
    let choices: Vec<Value> = metas
        .iter_mut()
        .zip(gs)
        .enumerate()
        .map(|(i, (meta, g))| {
            let reason = stream::finish_reason(g.stop_reason, false);
            let mut choice =
                json!({"index": i, "text": g.text, "logprobs": null, "finish_reason": reason});
            if let Some(mut l) = meta.logprobs.take() {
                l.push(&TokenNames(meta.tok.as_deref()), &g.logprobs);
                choice["logprobs"] = l.take();
            }
            if meta.token_ids {
                choice["token_ids"] = json!(g.tokens);
            }
            choice
        })
        .collect();
    let completion = gs.iter().map(|g| g.tokens.len()).sum();
    let answer = json!({
        "id": id, "object": "text_completion", "created": created, "model": st.model_id,
        "choices": choices,
        "usage": stream::usage(&r, completion, gs.iter().fold(None, stream::add_spec)),
    });
    Ok(Json(done.with_failure(answer)).into_response())
}

/// The prompt as ids: a string (tokenized), an array of ids, or a one-element array of either.
async fn prompt_ids(st: &Arc<AppState>, v: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("prompt"),
            "`prompt` must be a string, an array of token ids, or a one-element array of either",
        )
    };
    match v {
        None => Err(ApiError::invalid(Some("prompt"), "`prompt` is required")),
        Some(Value::String(s)) => {
            let tok = st.tokenizer()?;
            st.check_text_len(s, "prompt")?;
            let s = s.clone();
            tokio::task::spawn_blocking(move || tok.encode(&s))
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?
                .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))
        }
        // one level only: `[[1, 2]]` or `["text"]`, not `[[[1, 2]]]`
        Some(Value::Array(a))
            if a.len() == 1
                && (a[0].is_string()
                    || a[0]
                        .as_array()
                        .is_some_and(|v| v.iter().all(Value::is_number))) =>
        {
            Box::pin(prompt_ids(st, Some(&a[0]))).await
        }
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|u| u32::try_from(u).ok())
                    .ok_or_else(bad)
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

/// What every chunk repeats.
struct Meta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    /// Whether each choice carries the generated `token_ids` (a stream: each chunk the ids it completes).
    token_ids: bool,
    /// The tokenizer, when log-probabilities were asked for.
    tok: Option<Arc<TextTokenizer>>,
    /// The log-probabilities not sent yet, when asked for.
    logprobs: Option<Legacy>,
}

impl Meta {
    fn chunk(&self, text: &str, finish: Option<&str>) -> Value {
        let mut c = json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
        });
        if self.token_ids {
            c["choices"][0]["token_ids"] = json!([]);
        }
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

impl Chunker for Meta {
    fn begin(&mut self) -> Vec<Value> {
        Vec::new()
    }

    fn text(&mut self, text: &str) -> Vec<Value> {
        vec![self.chunk(text, None)]
    }

    fn token(&mut self, id: u32, text: &str, logprob: Option<&TokenLogprob>) -> Vec<Value> {
        let lp = match (&mut self.logprobs, logprob) {
            (Some(l), Some(t)) => {
                l.push(&TokenNames(self.tok.as_deref()), std::slice::from_ref(t));
                Some(l.take())
            }
            _ => None,
        };
        if !self.token_ids && lp.is_none() {
            return if text.is_empty() {
                Vec::new()
            } else {
                self.text(text)
            };
        }
        let mut c = self.chunk(text, None);
        if self.token_ids {
            c["choices"][0]["token_ids"] = json!([id]);
        }
        if let Some(lp) = lp {
            c["choices"][0]["logprobs"] = lp;
        }
        vec![c]
    }

    fn done(&mut self, g: &Generation, tail: &str) -> Vec<Value> {
        vec![self.chunk(tail, Some(stream::finish_reason(g.stop_reason, false)))]
    }

    fn usage(&self, usage: Value) -> Option<Value> {
        self.include_usage.then(|| {
            json!({
                "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [], "usage": usage,
            })
        })
    }
}
