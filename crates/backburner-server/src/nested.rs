//! Fields inside a chat request's objects: the keys of each message, content part, tool call and tool. A key this
//! server does not know (a typo like `contnet`, or a feature it lacks) is a 400 naming its path
//! (`messages[2].contnet`) — never silently dropped, as [`crate::fields`] does for the top level. Keys that only
//! echo an earlier answer back (`refusal`, `annotations`, an `audio` or `function_call` of null: what the OpenAI
//! SDK's `message.model_dump()` holds) are accepted, since agents append answers to the history as they got them.

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Keys a message may carry (OpenAI's, the reasoning under its three names, and the echoes of an answer).
const MESSAGE: &[&str] = &[
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "reasoning_content",
    "reasoning",
    "thinking",
    "refusal",
    "annotations",
    "audio",
    "function_call",
];

/// Keys a content part may carry (`cache_control`: a caching hint some clients add; the prompt cache here is
/// automatic).
const PART: &[&str] = &["type", "text", "cache_control"];

/// Keys of a tool call in an assistant message, and of its `function`.
const CALL: &[&str] = &["id", "type", "function", "index"];
const CALL_FUNCTION: &[&str] = &["name", "arguments"];

/// Keys of a tool, and of its `function`.
const TOOL: &[&str] = &["type", "function"];
const TOOL_FUNCTION: &[&str] = &["name", "description", "parameters", "strict"];

/// Keys of an object `tool_choice`, and of its `function`.
const CHOICE: &[&str] = &["type", "function"];
const CHOICE_FUNCTION: &[&str] = &["name"];

/// Checks the keys of an object `tool_choice` (`{"type": "function", "function": {"name": …}}`). Errors: 400 naming
/// the first unknown key's path.
pub fn check_tool_choice(choice: Option<&Value>) -> Result<(), ApiError> {
    match choice {
        Some(c) => object_and_function(c, CHOICE, CHOICE_FUNCTION, "tool_choice"),
        None => Ok(()),
    }
}

/// Checks the keys inside `messages` and `tools` (their values are checked where they are read). Errors: 400
/// naming the first unknown key's path, or an echo field that asks for something (`audio`, `function_call` not
/// null).
pub fn check(messages: Option<&Vec<Value>>, tools: Option<&Vec<Value>>) -> Result<(), ApiError> {
    for (i, m) in messages.into_iter().flatten().enumerate() {
        let at = format!("messages[{i}]");
        let Some(m) = m.as_object() else {
            continue; // the message's own check names it
        };
        keys(m, MESSAGE, &at)?;
        for k in ["audio", "function_call"] {
            if m.get(k).is_some_and(|v| !v.is_null()) {
                let why = match k {
                    "audio" => "audio is not supported: this model reads and writes text only",
                    _ => "the deprecated `function_call` is not supported: send `tool_calls`",
                };
                return Err(ApiError::invalid(Some(&format!("{at}.{k}")), why));
            }
        }
        if let Some(Value::Array(parts)) = m.get("content") {
            for (j, p) in parts.iter().enumerate() {
                if let Some(p) = p.as_object() {
                    keys(p, PART, &format!("{at}.content[{j}]"))?;
                }
            }
        }
        if let Some(Value::Array(calls)) = m.get("tool_calls") {
            for (j, c) in calls.iter().enumerate() {
                object_and_function(c, CALL, CALL_FUNCTION, &format!("{at}.tool_calls[{j}]"))?;
            }
        }
    }
    for (i, t) in tools.into_iter().flatten().enumerate() {
        let at = format!("tools[{i}]");
        if let Some(kind) = t.get("type").filter(|v| *v != "function") {
            return Err(ApiError::invalid(
                Some(&format!("{at}.type")),
                format!("only \"function\" tools are supported; got {kind}"),
            ));
        }
        object_and_function(t, TOOL, TOOL_FUNCTION, &at)?;
    }
    Ok(())
}

/// `v`'s keys among `outer`, and those of its `function` object among `inner`.
fn object_and_function(
    v: &Value,
    outer: &[&str],
    inner: &[&str],
    at: &str,
) -> Result<(), ApiError> {
    let Some(o) = v.as_object() else {
        return Ok(()); // the shape's own check names it
    };
    keys(o, outer, at)?;
    match o.get("function").and_then(Value::as_object) {
        Some(f) => keys(f, inner, &format!("{at}.function")),
        None => Ok(()),
    }
}

/// Every key of `o` is in `known`; else a 400 naming `at.key`.
fn keys(o: &Map<String, Value>, known: &[&str], at: &str) -> Result<(), ApiError> {
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(ApiError::invalid(
            Some(&format!("{at}.{k}")),
            format!(
                "unrecognized field `{k}` in `{at}` (known: {})",
                known.join(", ")
            ),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(messages: Value, tools: Value) -> Option<String> {
        let (m, t) = (messages.as_array().cloned(), tools.as_array().cloned());
        check(m.as_ref(), t.as_ref()).err().and_then(|e| e.param)
    }

    #[test]
    fn unknown_keys_inside_messages_and_tools_are_named_by_path() {
        let ok = json!([
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": null, "refusal": null, "annotations": [], "audio": null,
             "function_call": null, "reasoning_content": "r",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ]);
        let tools = json!([{"type": "function", "function": {"name": "f", "description": "d",
                             "parameters": {"type": "object"}, "strict": true}}]);
        assert_eq!(param(ok.clone(), tools.clone()), None);
        for (messages, tools, want) in [
            (
                json!([{"role": "user", "contnet": "hi"}]),
                json!([]),
                "messages[0].contnet",
            ),
            (
                json!([{"role": "user", "content": [{"type": "text", "txt": "hi"}]}]),
                json!([]),
                "messages[0].content[0].txt",
            ),
            (
                json!([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "args": "{}"}}]}]),
                json!([]),
                "messages[0].tool_calls[0].function.args",
            ),
            (
                json!([{"role": "assistant", "audio": {"id": "a"}}]),
                json!([]),
                "messages[0].audio",
            ),
            (
                json!([{"role": "assistant", "function_call": {"name": "f"}}]),
                json!([]),
                "messages[0].function_call",
            ),
            (
                ok.clone(),
                json!([{"type": "function", "function": {"name": "f", "paramters": {}}}]),
                "tools[0].function.paramters",
            ),
            (
                ok.clone(),
                json!([{"type": "function", "fn": {}}]),
                "tools[0].fn",
            ),
            (
                ok,
                json!([{"type": "custom", "custom": {"name": "f"}}]),
                "tools[0].type",
            ),
        ] {
            assert_eq!(param(messages, tools).as_deref(), Some(want));
        }
        let choice = |v: Value| check_tool_choice(Some(&v)).err().and_then(|e| e.param);
        assert_eq!(
            choice(json!({"type": "function", "function": {"name": "f"}})),
            None
        );
        assert_eq!(
            choice(json!({"type": "function", "function": {"nam": "f"}})).as_deref(),
            Some("tool_choice.function.nam")
        );
    }
}
