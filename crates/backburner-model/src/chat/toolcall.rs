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
    let params = tools.and_then(|t| parameters(t, name));
    let props = params
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object);
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
            let types = schema.map(|s| allowed_types(s, params.unwrap_or(s), 0));
            args.insert(param.to_string(), convert_value(raw, types.as_deref()));
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

/// `parameters` of the tool called `name` (OpenAI `{"function": {...}}` entries or bare schemas).
fn parameters<'t>(tools: &'t [Value], name: &str) -> Option<&'t Value> {
    tools
        .iter()
        .map(|t| t.get("function").unwrap_or(t))
        .find(|f| f.get("name").and_then(Value::as_str) == Some(name))?
        .get("parameters")
}

/// The JSON types a value of `schema` may have, as pydantic and zod write schemas: `type` (a name or a list),
/// the alternatives of `anyOf` / `oneOf` / `allOf`, a `$ref` into `root`'s `$defs` or `definitions`, the types of
/// an `enum`'s or a `const`'s values, OpenAPI's `nullable`, and `object` for a schema with `properties`. Empty
/// when the schema says nothing (then any value goes); `$ref`s nest at most 16 deep (a cycle says nothing).
pub fn allowed_types(schema: &Value, root: &Value, depth: usize) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    if depth > 16 {
        return out;
    }
    let name = |t: &str| -> Option<&'static str> {
        [
            "string", "integer", "number", "boolean", "null", "object", "array",
        ]
        .into_iter()
        .find(|n| *n == t)
    };
    let of_value = |v: &Value| -> &'static str {
        match v {
            Value::String(_) => "string",
            Value::Bool(_) => "boolean",
            Value::Null => "null",
            Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
            Value::Number(_) => "number",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        }
    };
    match schema.get("type") {
        Some(Value::String(t)) => out.extend(name(t)),
        Some(Value::Array(ts)) => out.extend(ts.iter().filter_map(Value::as_str).filter_map(name)),
        _ => {}
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        for alt in schema
            .get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            out.extend(allowed_types(alt, root, depth + 1));
        }
    }
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let target = r
            .strip_prefix("#/$defs/")
            .and_then(|n| root.get("$defs")?.get(n))
            .or_else(|| {
                r.strip_prefix("#/definitions/")
                    .and_then(|n| root.get("definitions")?.get(n))
            })
            .or_else(|| (r == "#").then_some(root));
        if let Some(t) = target {
            out.extend(allowed_types(t, root, depth + 1));
        }
    }
    for v in schema
        .get("enum")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        out.push(of_value(v));
    }
    if let Some(c) = schema.get("const") {
        out.push(of_value(c));
    }
    if schema.get("nullable") == Some(&Value::Bool(true)) {
        out.push("null");
    }
    if out.is_empty() && schema.get("properties").is_some() {
        out.push("object");
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// A parameter's value from its raw text. Without declared types: the JSON value when the text parses as a
/// number, boolean, null, object or array, or is `True`/`False`/`None` (the template writes scalar arguments with
/// Python's `str()`, so the model does too), else the text as a string. With declared types ([`allowed_types`]):
/// null for `null`/`None` when `null` is among them, else the text as a string when `string` is (any text is a
/// string: a value a string alternative allows stays a string), else the parsed value when it has one of them (an
/// integer is a number too), else as without.
pub(crate) fn convert_value(raw: &str, types: Option<&[&str]>) -> Value {
    let parsed = match raw.trim() {
        "True" => Some(Value::Bool(true)),
        "False" => Some(Value::Bool(false)),
        "None" => Some(Value::Null),
        _ => serde_json::from_str::<Value>(raw).ok(),
    };
    let types = types.unwrap_or_default();
    if types.contains(&"null") && parsed.as_ref().is_some_and(Value::is_null) {
        return Value::Null; // `null` / `None` where null is allowed, even beside a string
    }
    if types.contains(&"string") {
        return Value::String(raw.to_string());
    }
    if let Some(v) = parsed
        .as_ref()
        .filter(|v| types.iter().any(|t| has_type(v, t)))
    {
        // an integral number written with a sign or fraction (`-0`, `3.0`) where only an integer fits is that
        // integer: JSON parsers read `-0` as a float, which strict clients refuse for an integer parameter
        if types.contains(&"integer") && !types.contains(&"number") {
            if let Some(i) = integral(v) {
                return Value::from(i);
            }
        }
        return v.clone();
    }
    match parsed {
        Some(v) if !v.is_string() => v,
        _ => Value::String(raw.to_string()),
    }
}

/// `v` as an i64 when it is a float with no fractional part inside the i64 range (`-0.0`, `3.0`).
fn integral(v: &Value) -> Option<i64> {
    let f = v.as_f64().filter(|_| v.is_f64())?;
    // the range check keeps the cast exact: every integral f64 in [-2^63, 2^63) is an i64
    (f.fract() == 0.0 && (-9.223_372_036_854_776e18..9.223_372_036_854_776e18).contains(&f))
        .then_some(f as i64)
}

/// Whether `v` is of the JSON-schema type `t` (strings never match: a string parameter keeps its raw text; an
/// integral float such as `-0` counts as an integer, as JSON Schema says).
fn has_type(v: &Value, t: &str) -> bool {
    match t {
        "integer" => v.is_i64() || v.is_u64() || integral(v).is_some(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        _ => false,
    }
}
