//! `POST /v1/chat/completions`: OpenAI-shaped messages (tools, tool calls, tool results) rendered through the
//! model's chat template as transformers renders them, the answer split into `reasoning_content`, `content` and
//! `tool_calls` (also while streaming).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use backburner_engine::serve::common_prefix;
use backburner_engine::{Generation, TokenLogprob};
use backburner_model::chat::{
    prompt_opens_reasoning, ChatDelta, ChatOutputParser, ChatRequest, ParsedOutput, ToolCall,
};
use backburner_model::TextTokenizer;
use serde_json::{json, Map, Value};

use crate::error::ApiError;
use crate::logprobs::TokenNames;
use crate::request::{Body, GenSettings};
use crate::stream::{self, Chunker};
use crate::AppState;

pub(crate) async fn handle(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    crate::handle_with(st, headers, body, ("chatcmpl", "chat"), run).await
}

/// A rendered and tokenized conversation.
struct Prompt {
    ids: Vec<u32>,
    /// Tokens of the conversation before the generation prompt (the prompt cache keeps a checkpoint there).
    stable: usize,
    /// The prompt opened a `<think>` block: generation starts in reasoning.
    in_reasoning: bool,
}

async fn run(st: Arc<AppState>, map: Map<String, Value>, id: String) -> Result<Response, ApiError> {
    let b = Body(&map);
    crate::fields::check_chat(&b)?;
    let mut gen = GenSettings::read(&b)?;
    gen.logprobs = crate::request::chat_logprobs(&b)?;
    let messages = match b.array("messages")? {
        Some(m) if !m.is_empty() => m.iter().map(developer_as_system).collect(),
        _ => {
            return Err(ApiError::invalid(
                Some("messages"),
                "`messages` must be a non-empty array",
            ))
        }
    };
    // `tool_choice` "required" or a named function is enforced by a grammar (`constrain`)
    let tools = match b.get("tool_choice") {
        Some(Value::String(s)) if s == "none" => None,
        _ => b.array("tools")?.cloned(),
    };
    let kwargs = b
        .object("chat_template_kwargs")?
        .cloned()
        .unwrap_or_default();
    let p = render(&st, messages, tools.clone(), kwargs).await?;
    tracing::debug!(prompt_tokens = p.ids.len(), stable = p.stable, "rendered");
    // a constraint applies to the answer: after `</think>` when the prompt opened a reasoning block
    let after = p.in_reasoning.then(|| "</think>".to_string());
    gen.constraint = crate::constrain::read(&st, &b, after, tools.as_deref()).await?;
    let mut r = stream::start(&st, &id, p.ids, "messages", Some(p.stable), &gen).await?;
    // tool call ids unique across requests (`call_<request>_<index>`; choice i > 0: `call_<request>_c<i>_<index>`),
    // as clients that keep a conversation's calls by id need
    let req = id.trim_start_matches("chatcmpl-").to_string();
    let created = AppState::now();
    let mut cs: Vec<ChatChunks> = (0..r.choices)
        .map(|i| {
            let call_ids = match i {
                0 => format!("call_{req}_"),
                i => format!("call_{req}_c{i}_"),
            };
            ChatChunks {
                id: id.clone(),
                created,
                model: st.model_id.clone(),
                include_usage: gen.include_usage,
                parser: ChatOutputParser::new(p.in_reasoning, tools.as_deref())
                    .with_id_prefix(call_ids),
                tool_calls: false,
                tok: st.tokenizer.clone().filter(|_| gen.logprobs.is_some()),
            }
        })
        .collect();
    if gen.stream {
        return Ok(stream::sse(r, cs).into_response());
    }
    let done = stream::collect(&mut r).await?;
    let gs = &done.gs;
    let choices: Vec<Value> = cs
        .iter_mut()
        .zip(gs)
        .enumerate()
        .map(|(i, (c, g))| {
            let mut deltas = c.parser.push(&g.text);
            deltas.extend(c.parser.finish());
            let out = ParsedOutput::from_deltas(deltas);
            let mut message = json!({"role": "assistant", "content": out.content});
            if let Some(rc) = out.reasoning {
                message["reasoning_content"] = Value::String(rc);
            }
            if !out.tool_calls.is_empty() {
                message["tool_calls"] = out.tool_calls.iter().map(tool_call_json).collect();
            }
            let reason = stream::finish_reason(g.stop_reason, !out.tool_calls.is_empty());
            let logprobs = match gen.logprobs {
                Some(_) => TokenNames(c.tok.as_deref()).chat(&g.logprobs),
                None => Value::Null,
            };
            json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
        })
        .collect();
    let completion = gs.iter().map(|g| g.tokens.len()).sum();
    let answer = json!({
        "id": id, "object": "chat.completion", "created": created, "model": st.model_id,
        "choices": choices,
        "usage": stream::usage(&r, completion, gs.iter().fold(None, stream::add_spec)),
    });
    Ok(Json(done.with_failure(answer)).into_response())
}

/// Renders the conversation (with and without the generation prompt) and tokenizes it, on the blocking pool.
async fn render(
    st: &Arc<AppState>,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    kwargs: Map<String, Value>,
) -> Result<Prompt, ApiError> {
    let tok = st.tokenizer()?;
    let st = st.clone();
    tokio::task::spawn_blocking(move || {
        let bad = |e: backburner_model::ModelError| match e {
            backburner_model::ModelError::InvalidChatRequest { ref field, .. } => {
                ApiError::invalid(Some(field.as_str()), e.to_string())
            }
            other => ApiError::internal(other.to_string()),
        };
        let mut req = ChatRequest {
            messages: &messages,
            tools: tools.as_deref(),
            add_generation_prompt: true,
            kwargs: &kwargs,
        };
        let text = tok.render_chat(&req).map_err(bad)?;
        st.check_text_len(&text, "messages")?;
        let ids = tok.encode(&text).map_err(bad)?;
        req.add_generation_prompt = false;
        // the history alone; a template that refuses it (e.g. it must end with a user turn) just gets no checkpoint
        let stable = tok
            .render_chat(&req)
            .and_then(|h| tok.encode(&h))
            .map_or(0, |h| common_prefix(&ids, &h));
        Ok(Prompt {
            in_reasoning: prompt_opens_reasoning(&text),
            ids,
            stable,
        })
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
}

/// Newer OpenAI clients send the system prompt as `role: "developer"`; chat templates know it as `system`.
fn developer_as_system(m: &Value) -> Value {
    let mut m = m.clone();
    if m.get("role").and_then(Value::as_str) == Some("developer") {
        m["role"] = Value::String("system".into());
    }
    m
}

fn tool_call_json(t: &ToolCall) -> Value {
    json!({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}})
}

/// The stream of one chat completion.
struct ChatChunks {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    parser: ChatOutputParser,
    tool_calls: bool,
    /// The tokenizer, when log-probabilities were asked for.
    tok: Option<Arc<TextTokenizer>>,
}

impl ChatChunks {
    fn chunk(&self, delta: Value, finish: Option<&str>) -> Value {
        let mut c = json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn deltas(&mut self, ds: Vec<ChatDelta>) -> Vec<Value> {
        ds.into_iter()
            .map(|d| {
                let delta = match d {
                    ChatDelta::Content(s) => json!({"content": s}),
                    ChatDelta::Reasoning(s) => json!({"reasoning_content": s}),
                    ChatDelta::ToolCall(t) => {
                        self.tool_calls = true;
                        let mut j = tool_call_json(&t);
                        j["index"] = json!(t.index);
                        json!({"tool_calls": [j]})
                    }
                };
                self.chunk(delta, None)
            })
            .collect()
    }
}

impl Chunker for ChatChunks {
    fn begin(&mut self) -> Vec<Value> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), None)]
    }

    fn text(&mut self, text: &str) -> Vec<Value> {
        let ds = self.parser.push(text);
        self.deltas(ds)
    }

    /// The token's text as deltas; its log-probabilities ride on the first of them, or on an empty delta when its
    /// text is held back or is markup the parser consumes.
    fn token(&mut self, _id: u32, text: &str, logprob: Option<&TokenLogprob>) -> Vec<Value> {
        let mut out = if text.is_empty() {
            Vec::new()
        } else {
            self.text(text)
        };
        if let Some(lp) = logprob {
            if out.is_empty() {
                out.push(self.chunk(json!({}), None));
            }
            out[0]["choices"][0]["logprobs"] =
                TokenNames(self.tok.as_deref()).chat(std::slice::from_ref(lp));
        }
        out
    }

    fn done(&mut self, g: &Generation, tail: &str) -> Vec<Value> {
        let mut ds = self.parser.push(tail);
        ds.extend(self.parser.finish());
        let mut out = self.deltas(ds);
        let reason = stream::finish_reason(g.stop_reason, self.tool_calls);
        out.push(self.chunk(json!({}), Some(reason)));
        out
    }

    fn usage(&self, usage: Value) -> Option<Value> {
        self.include_usage.then(|| {
            json!({
                "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage,
            })
        })
    }
}
