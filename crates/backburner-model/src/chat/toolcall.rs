//! One Qwen3.5 tool call, the text between `<tool_call>` and `</tool_call>`:
//!
//! ```text
//! <function=NAME>
//! <parameter=P>
//! VALUE
//! </parameter>
//! </function>
//! ```
//!
//! parsed into a name and OpenAI `function.arguments` (a JSON object as a string).

use serde_json::{Map, Value};

const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// Parses a tool call body into `(name, arguments)`, or `None` when it is not exactly one well-formed function
/// block (surrounding whitespace allowed). `tools` (the request's OpenAI tool definitions) decide how parameter
/// values are typed ([`convert_value`]).
pub(crate) fn parse_tool_call(body: &str, tools: Option<&[Value]>) -> Option<(String, String)> {
    let rest = body.trim_start().strip_prefix(FUNCTION_OPEN)?;
    let (name, mut rest) = tag_name(rest)?;
    let props = tools.and_then(|t| parameter_schemas(t, name));
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(r) = rest.strip_prefix(PARAM_OPEN) {
            let (param, r) = tag_name(r)?;
            let end = r.find(PARAM_CLOSE)?;
            let raw = &r[..end];
            let raw = raw.strip_prefix('\n').unwrap_or(raw);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            let schema = props.and_then(|p| p.get(param));
            args.insert(param.to_string(), convert_value(raw, schema));
            rest = &r[end + PARAM_CLOSE.len()..];
        } else if let Some(r) = rest.strip_prefix(FUNCTION_CLOSE) {
            rest = r;
            break;
        } else {
            return None;
        }
    }
    if !rest.trim().is_empty() {
        return None;
    }
    let arguments = serde_json::to_string(&Value::Object(args)).ok()?;
    Some((name.to_string(), arguments))
}

/// `NAME>` at the start of `s` → (NAME trimmed, the text after `>`); `None` when NAME is empty or spans a line or
/// another tag.
fn tag_name(s: &str) -> Option<(&str, &str)> {
    let end = s.find('>')?;
    let name = s[..end].trim();
    if name.is_empty() || name.contains(['\n', '<']) {
        return None;
    }
    Some((name, &s[end + 1..]))
}

/// `parameters.properties` of the tool called `name` (OpenAI `{"function": {...}}` entries or bare schemas).
fn parameter_schemas<'t>(tools: &'t [Value], name: &str) -> Option<&'t Map<String, Value>> {
    tools
        .iter()
        .map(|t| t.get("function").unwrap_or(t))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))?
        .get("parameters")?
        .get("properties")?
        .as_object()
}

/// A parameter's value from its raw text. Without a declared type: the JSON value when the text parses as a
/// number, boolean, null, object or array, or is `True`/`False`/`None` (the template writes scalar arguments with
/// Python's `str()`, so the model does too), else the text as a string. With a declared `type` (a name or a list of
/// names): that value when it has one of the declared non-string types, else the text as a string when `string` is
/// declared, else as without a type.
pub(crate) fn convert_value(raw: &str, schema: Option<&Value>) -> Value {
    let parsed = match raw.trim() {
        "True" => Some(Value::Bool(true)),
        "False" => Some(Value::Bool(false)),
        "None" => Some(Value::Null),
        _ => serde_json::from_str::<Value>(raw).ok(),
    };
    let types: Vec<&str> = match schema.and_then(|s| s.get("type")) {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    };
    if !types.is_empty() {
        if let Some(v) = parsed
            .as_ref()
            .filter(|v| types.iter().any(|t| has_type(v, t)))
        {
            return v.clone();
        }
        if types.contains(&"string") {
            return Value::String(raw.to_string());
        }
    }
    match parsed {
        Some(v) if !v.is_string() => v,
        _ => Value::String(raw.to_string()),
    }
}

/// Whether `v` is of the JSON-schema type `t` (strings never match: a string parameter keeps its raw text).
fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => false,
    }
}
