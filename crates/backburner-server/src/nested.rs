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

/// The roles a message may have (`developer` is taken as `system`).
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Keys a content part may carry (`cache_control`: a caching hint some clients add; the prompt cache here is
/// automatic).
const PART: &[&str] = &["type", "text", "cache_control"];

/// Keys of a refusal part (`{"type": "refusal", "refusal": …}`, the SDK's shape for an assistant message's refusal;
/// rendered as a text part, as vLLM does).
const REFUSAL_PART: &[&str] = &["type", "refusal"];

/// Content part types of inputs this text-only model cannot read, and what to call them.
const MEDIA_PARTS: &[(&str, &str)] = &[
    ("image_url", "image"),
    ("input_image", "image"),
    ("image", "image"),
    ("input_audio", "audio"),
    ("audio_url", "audio"),
    ("video_url", "video"),
    ("video", "video"),
    ("file", "file"),
    ("input_file", "file"),
];

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
    let Some(c) = choice else {
        return Ok(());
    };
    // OpenAI's `{"type": "allowed_tools", "allowed_tools": …}` and `{"type": "custom", …}`: say so, rather than
    // name their keys as unknown
    if let Some(kind) = c.get("type").filter(|v| *v != "function") {
        return Err(ApiError::invalid(
            Some("tool_choice.type"),
            format!(
                "`tool_choice` of type {kind} is not supported; an object `tool_choice` must be \
                 {{\"type\": \"function\", \"function\": {{\"name\": …}}}} (or send \"none\", \"auto\" or \"required\")"
            ),
        ));
    }
    object_and_function(c, CHOICE, CHOICE_FUNCTION, "tool_choice")
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
        let role = m.get("role").and_then(Value::as_str);
        if let Some(r) = role.filter(|r| !ROLES.contains(r)) {
            let why = match r {
                "function" => {
                    "; the deprecated `function` role is not supported: send tool results as `tool`"
                }
                _ => "",
            };
            return Err(ApiError::invalid(
                Some(&format!("{at}.role")),
                format!("unknown role {r:?} (accepted: {}){why}", ROLES.join(", ")),
            ));
        }
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
                    part(p, role == Some("assistant"), &format!("{at}.content[{j}]"))?;
                }
            }
        }
        if let Some(Value::Array(calls)) = m.get("tool_calls") {
            for (j, c) in calls.iter().enumerate() {
                object_and_function(c, CALL, CALL_FUNCTION, &format!("{at}.tool_calls[{j}]"))?;
            }
        }
    }
    let mut names: Vec<(&str, usize)> = Vec::new();
    for (i, t) in tools.into_iter().flatten().enumerate() {
        let at = format!("tools[{i}]");
        if let Some(kind) = t.get("type").filter(|v| *v != "function") {
            return Err(ApiError::invalid(
                Some(&format!("{at}.type")),
                format!("only \"function\" tools are supported; got {kind}"),
            ));
        }
        object_and_function(t, TOOL, TOOL_FUNCTION, &at)?;
        // a call names its function: two tools of one name would make it ambiguous
        let Some(name) = t.pointer("/function/name").and_then(Value::as_str) else {
            continue; // the tool's own check names it
        };
        if let Some((_, first)) = names.iter().find(|(n, _)| *n == name) {
            return Err(ApiError::invalid(
                Some(&format!("{at}.function.name")),
                format!("duplicate function name {name:?}: `tools[{first}]` has it too (tool names must be unique)"),
            ));
        }
        names.push((name, i));
    }
    Ok(())
}

/// Checks a content part of a message (`assistant`: of an assistant message): a text part's keys, a refusal part's
/// (assistant messages only), and a 400 naming its `type` for media this model cannot read or a type it does not
/// know.
fn part(p: &Map<String, Value>, assistant: bool, at: &str) -> Result<(), ApiError> {
    let kind = p.get("type").filter(|v| !v.is_null());
    if let Some(v) = kind.filter(|v| !v.is_string()) {
        return Err(ApiError::invalid(
            Some(&format!("{at}.type")),
            format!(
                "`{at}.type` must be a string, not {}",
                backburner_model::chat::json_kind(v)
            ),
        ));
    }
    match kind.and_then(Value::as_str) {
        // a part without `type` is read as text when it has `text` (the model's check says what is missing)
        Some("text") | None => keys(p, PART, at),
        Some("refusal") if assistant => keys(p, REFUSAL_PART, at),
        Some("refusal") => Err(ApiError::invalid(
            Some(&format!("{at}.type")),
            "a refusal part belongs to an assistant message (it echoes the model's refusal)",
        )),
        Some(t) => {
            let why = match MEDIA_PARTS.iter().find(|(k, _)| *k == t) {
                Some((_, what)) => format!(
                    "{what} inputs are not supported: this model reads text only (a part of type {t:?})"
                ),
                None => format!("unknown content part type {t:?} (supported: \"text\"; \"refusal\" in assistant messages)"),
            };
            Err(ApiError::invalid(Some(&format!("{at}.type")), why))
        }
    }
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

    /// The param and message of `check`'s error.
    fn error(messages: Value, tools: Value) -> (String, String) {
        let (m, t) = (messages.as_array().cloned(), tools.as_array().cloned());
        let e = check(m.as_ref(), t.as_ref()).unwrap_err();
        (e.param.unwrap(), e.message)
    }

    #[test]
    fn roles_parts_and_tool_names_are_refused_saying_why() {
        let user = |content: Value| json!([{"role": "user", "content": content}]);
        // what the SDK sends: a refusal part in an assistant message, every role
        let ok = json!([
            {"role": "developer", "content": "d"},
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": "t"}]},
            {"role": "tool", "content": "r", "tool_call_id": "c"}
        ]);
        assert_eq!(param(ok, json!([])), None);
        let accepted = "(accepted: system, developer, user, assistant, tool)";
        for (messages, tools, want, message) in [
            (
                json!([{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]),
                json!([]),
                "messages[1].role",
                format!("unknown role \"wizard\" {accepted}"),
            ),
            (
                json!([{"role": "function", "name": "f", "content": "42"}]),
                json!([]),
                "messages[0].role",
                format!(
                    "unknown role \"function\" {accepted}; the deprecated `function` role is not supported: send \
                     tool results as `tool`"
                ),
            ),
            (
                user(json!([{"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}])),
                json!([]),
                "messages[0].content[1].type",
                "image inputs are not supported: this model reads text only (a part of type \"image_url\")".into(),
            ),
            (
                user(json!([{"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}}])),
                json!([]),
                "messages[0].content[0].type",
                "audio inputs are not supported: this model reads text only (a part of type \"input_audio\")".into(),
            ),
            (
                user(json!([{"type": "refusal", "refusal": "no"}])),
                json!([]),
                "messages[0].content[0].type",
                "a refusal part belongs to an assistant message (it echoes the model's refusal)".into(),
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "refusal", "refusal": "no", "text": "x"}]}]),
                json!([]),
                "messages[0].content[0].text",
                "unrecognized field `text` in `messages[0].content[0]` (known: type, refusal)".into(),
            ),
            (
                user(json!([{"type": "hologram"}])),
                json!([]),
                "messages[0].content[0].type",
                "unknown content part type \"hologram\" (supported: \"text\"; \"refusal\" in assistant messages)"
                    .into(),
            ),
            (
                user(json!([{"type": 5, "text": "x"}])),
                json!([]),
                "messages[0].content[0].type",
                "`messages[0].content[0].type` must be a string, not a number".into(),
            ),
            (
                user(json!("hi")),
                json!([{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"name": "g"}},
                       {"type": "function", "function": {"name": "f", "description": "again"}}]),
                "tools[2].function.name",
                "duplicate function name \"f\": `tools[0]` has it too (tool names must be unique)".into(),
            ),
        ] {
            assert_eq!(error(messages, tools), (want.to_string(), message));
        }
        let choice = |v: Value| check_tool_choice(Some(&v)).unwrap_err();
        let e = choice(
            json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}),
        );
        assert_eq!(e.param.as_deref(), Some("tool_choice.type"));
        assert_eq!(
            e.message,
            "`tool_choice` of type \"allowed_tools\" is not supported; an object `tool_choice` must be \
             {\"type\": \"function\", \"function\": {\"name\": …}} (or send \"none\", \"auto\" or \"required\")"
        );
    }
}
