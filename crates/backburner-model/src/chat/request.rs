//! OpenAI-shaped chat requests → the template's context, normalized as transformers (and vLLM / llama-server for
//! tool-call arguments) do before rendering, and validated so a malformed request fails with the field it got
//! wrong.

use serde_json::{Map, Value};

use crate::error::{ModelError, Result};

use super::ChatRequest;

/// Context keys a request sets itself; `chat_template_kwargs` may not set them (Python would refuse a second value).
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// Names a message's reasoning may come under; the first is the one Qwen templates read (transformers' aliases).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

fn bad(field: impl Into<String>, message: impl Into<String>) -> ModelError {
    ModelError::InvalidChatRequest {
        field: field.into(),
        message: message.into(),
    }
}

/// How a JSON value's type reads in an error message: "null", "a boolean", "a number", "a string", "an array",
/// "an object".
pub fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The template context for `req`: `messages`, `tools` (null when absent), `documents` (null),
/// `add_generation_prompt`, then `special_tokens` (e.g. `bos_token`), then the request's `kwargs`, which override
/// special tokens as in transformers.
pub(crate) fn build_context(
    req: &ChatRequest<'_>,
    special_tokens: &[(&str, &str)],
) -> Result<Value> {
    let mut ctx = Map::new();
    ctx.insert(
        "messages".into(),
        Value::Array(normalize_messages(req.messages)?),
    );
    let tools = match req.tools {
        Some(t) => Value::Array(normalize_tools(t)?),
        None => Value::Null,
    };
    ctx.insert("tools".into(), tools);
    ctx.insert("documents".into(), Value::Null);
    ctx.insert(
        "add_generation_prompt".into(),
        Value::Bool(req.add_generation_prompt),
    );
    for (k, v) in special_tokens {
        ctx.insert((*k).into(), Value::String((*v).into()));
    }
    for (k, v) in req.kwargs {
        if RESERVED.contains(&k.as_str()) {
            return Err(bad(
                format!("chat_template_kwargs.{k}"),
                "is set by the request itself and cannot be passed as a template argument",
            ));
        }
        ctx.insert(k.clone(), v.clone());
    }
    Ok(Value::Object(ctx))
}

/// Checks and normalizes OpenAI-shaped messages: keys whose value is null are dropped (transformers drops them;
/// templates treat them as missing), the reasoning under any of its names is aliased to `reasoning_content` and
/// `thinking`, and tool-call `function.arguments` given as a JSON string is parsed into an object.
///
/// Errors: [`ModelError::InvalidChatRequest`] naming the field (`messages[1].tool_calls[0].function.arguments`)
/// for a message that is not an object, a missing or non-string `role`, `content` that is not a string, null or an
/// array of `{"type": "text", "text": ...}` parts, tool calls that are not objects with a `function.name`, and
/// arguments that are neither an object nor a string holding a JSON object (an empty string counts as `{}`).
pub fn normalize_messages(messages: &[Value]) -> Result<Vec<Value>> {
    if messages.is_empty() {
        return Err(bad("messages", "must contain at least one message"));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| normalize_message(m, &format!("messages[{i}]")))
        .collect()
}

fn normalize_message(m: &Value, at: &str) -> Result<Value> {
    let Value::Object(obj) = m else {
        return Err(bad(at, format!("expected an object, got {}", json_kind(m))));
    };
    let mut out: Map<String, Value> = obj
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    match out.get("role") {
        Some(Value::String(_)) => {}
        Some(v) => {
            return Err(bad(
                format!("{at}.role"),
                format!("expected a string, got {}", json_kind(v)),
            ))
        }
        None => return Err(bad(format!("{at}.role"), "is required")),
    }
    let assistant = out.get("role").and_then(Value::as_str) == Some("assistant");
    if let Some(content) = out.get_mut("content") {
        normalize_content(content, assistant, &format!("{at}.content"))?;
    }
    for key in ["tool_call_id", "name"] {
        if let Some(v) = out.get(key).filter(|v| !v.is_string()) {
            return Err(bad(
                format!("{at}.{key}"),
                format!("expected a string, got {}", json_kind(v)),
            ));
        }
    }
    alias_reasoning(&mut out, at)?;
    if let Some(calls) = out.get_mut("tool_calls") {
        normalize_tool_calls(calls, &format!("{at}.tool_calls"))?;
    }
    Ok(Value::Object(out))
}

/// Checks a message's content; in an assistant message a refusal part (`{"type": "refusal", "refusal": text}`, the
/// OpenAI SDK's shape) becomes the text part `{"type": "text", "text": text}`, as vLLM renders it (templates know
/// text parts only).
fn normalize_content(content: &mut Value, assistant: bool, at: &str) -> Result<()> {
    let parts = match content {
        Value::String(_) => return Ok(()),
        Value::Array(parts) => parts,
        v => {
            return Err(bad(
                at,
                format!(
                    "expected a string, null or an array of content parts, got {}",
                    json_kind(v)
                ),
            ));
        }
    };
    for (j, part) in parts.iter_mut().enumerate() {
        let at = format!("{at}[{j}]");
        let Value::Object(p) = part else {
            return Err(bad(
                at,
                format!("expected a content part object, got {}", json_kind(part)),
            ));
        };
        if assistant && p.get("type").and_then(Value::as_str) == Some("refusal") {
            let text = match p.get("refusal") {
                Some(Value::String(t)) => t.clone(),
                Some(v) => {
                    return Err(bad(
                        format!("{at}.refusal"),
                        format!("expected a string, got {}", json_kind(v)),
                    ))
                }
                None => {
                    return Err(bad(
                        format!("{at}.refusal"),
                        "is required for a refusal part",
                    ))
                }
            };
            let mut text_part = Map::new();
            text_part.insert("type".into(), Value::String("text".into()));
            text_part.insert("text".into(), Value::String(text));
            *p = text_part;
            continue;
        }
        match p.get("type").and_then(Value::as_str) {
            Some("text") | None if p.contains_key("text") => {}
            Some("text") => return Err(bad(format!("{at}.text"), "is required for a text part")),
            Some(t) => {
                return Err(bad(
                    format!("{at}.type"),
                    format!("{t:?} parts are not supported: this model reads text only"),
                ))
            }
            None => return Err(bad(format!("{at}.type"), "is required")),
        }
        if let Some(v) = p.get("text").filter(|v| !v.is_string()) {
            return Err(bad(
                format!("{at}.text"),
                format!("expected a string, got {}", json_kind(v)),
            ));
        }
    }
    Ok(())
}

/// transformers' `_alias_reasoning_fields`: the first non-null of `reasoning_content`, `thinking`, `reasoning`
/// becomes `reasoning_content` (last key, or in place) and, unless the message has its own, `thinking` (first key).
fn alias_reasoning(out: &mut Map<String, Value>, at: &str) -> Result<()> {
    let Some((key, reasoning)) = REASONING_FIELDS
        .iter()
        .find_map(|k| out.get(*k).map(|v| (*k, v.clone())))
    else {
        return Ok(());
    };
    if !reasoning.is_string() {
        return Err(bad(
            format!("{at}.{key}"),
            format!("expected a string, got {}", json_kind(&reasoning)),
        ));
    }
    // `{"thinking": r, **message, "reasoning_content": r}`: a `thinking` of the message's own wins.
    if !out.contains_key("thinking") {
        let rest = std::mem::take(out);
        out.insert("thinking".into(), reasoning.clone());
        out.extend(rest);
    }
    out.insert("reasoning_content".into(), reasoning);
    Ok(())
}

fn normalize_tool_calls(calls: &mut Value, at: &str) -> Result<()> {
    let Value::Array(list) = calls else {
        return Err(bad(
            at,
            format!("expected an array, got {}", json_kind(calls)),
        ));
    };
    for (j, call) in list.iter_mut().enumerate() {
        let at = format!("{at}[{j}]");
        let Value::Object(call) = call else {
            return Err(bad(
                at,
                format!("expected an object, got {}", json_kind(call)),
            ));
        };
        let f = match call.get_mut("function") {
            Some(Value::Object(f)) => f,
            Some(v) => {
                return Err(bad(
                    format!("{at}.function"),
                    format!("expected an object, got {}", json_kind(v)),
                ))
            }
            None => return Err(bad(format!("{at}.function"), "is required")),
        };
        match f.get("name") {
            Some(Value::String(n)) if !n.is_empty() => {}
            Some(Value::String(_)) => {
                return Err(bad(format!("{at}.function.name"), "must not be empty"))
            }
            Some(v) => {
                return Err(bad(
                    format!("{at}.function.name"),
                    format!("expected a string, got {}", json_kind(v)),
                ))
            }
            None => return Err(bad(format!("{at}.function.name"), "is required")),
        }
        if let Some(args) = f.get_mut("arguments") {
            *args = parse_arguments(args, &format!("{at}.function.arguments"))?;
        }
    }
    Ok(())
}

/// Tool-call arguments as the template wants them, an object: an object is kept, a string is parsed as JSON (an
/// empty or blank string is `{}`), null is `{}`.
fn parse_arguments(args: &Value, at: &str) -> Result<Value> {
    match args {
        Value::Object(_) => Ok(args.clone()),
        Value::Null => Ok(Value::Object(Map::new())),
        Value::String(s) if s.trim().is_empty() => Ok(Value::Object(Map::new())),
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ Value::Object(_)) => Ok(v),
            Ok(v) => Err(bad(
                at,
                format!("must encode a JSON object, got {}", json_kind(&v)),
            )),
            Err(e) => Err(bad(at, format!("is not valid JSON ({e})"))),
        },
        v => Err(bad(
            at,
            format!("expected an object or a JSON string, got {}", json_kind(v)),
        )),
    }
}

/// Checks the OpenAI `tools` array: every entry an object, with a `function` object that has a string `name` (or,
/// for a bare schema without `function`, a string `name`). Entries are passed to the template unchanged.
/// Errors: [`ModelError::InvalidChatRequest`] naming the field.
pub fn normalize_tools(tools: &[Value]) -> Result<Vec<Value>> {
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        let Value::Object(t) = tool else {
            return Err(bad(
                at,
                format!("expected an object, got {}", json_kind(tool)),
            ));
        };
        let (holder, path) = match t.get("function") {
            Some(Value::Object(f)) => (f, format!("{at}.function.name")),
            Some(v) => {
                return Err(bad(
                    format!("{at}.function"),
                    format!("expected an object, got {}", json_kind(v)),
                ))
            }
            None => (t, format!("{at}.name")),
        };
        match holder.get("name") {
            Some(Value::String(_)) => {}
            Some(v) => {
                return Err(bad(
                    path,
                    format!("expected a string, got {}", json_kind(v)),
                ))
            }
            None => return Err(bad(path, "is required")),
        }
    }
    Ok(tools.to_vec())
}
