//! The request fields that constrain an output to a grammar: OpenAI's `response_format` (`json_object`,
//! `json_schema`) and llama-server's `json_schema` (a schema) and `grammar` (GBNF, or Lark in llguidance's dialect
//! when it starts with `%llguidance` or uses `:` rules), turned into the engine's [`ConstraintSpec`].

use std::sync::Arc;

use backburner_engine::constraint::{ConstraintSpec, Grammar, Grammars};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::request::Body;
use crate::AppState;

/// The grammar a request asks for and the field that asked, if any (`tools`: the chat's tools, for an enforced
/// `tool_choice`; `markup`: the vocabulary has `<tool_call>` tokens). Errors: 400 naming the field for a
/// malformed value, or when more than one field asks.
fn requested(
    b: &Body,
    tools: Option<&[Value]>,
    markup: bool,
) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let mut found: Vec<(Grammar, &'static str)> = Vec::new();
    let choice = match b.get("tool_choice") {
        Some(Value::String(s)) if s == "required" => Some(None),
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::invalid(
                        Some("tool_choice"),
                        "`tool_choice` as an object must be {\"type\": \"function\", \"function\": {\"name\": …}}",
                    )
                })?;
            Some(Some(name))
        }
        _ => None,
    };
    if let Some(name) = choice {
        let lark = crate::tool_grammar::lark(tools.unwrap_or_default(), name, markup)
            .map_err(|m| ApiError::invalid(Some("tool_choice"), format!("`tool_choice`: {m}")))?;
        found.push((Grammar::Lark(lark), "tool_choice"));
    }
    if let Some(rf) = b.object("response_format")? {
        if let Some(g) = response_format(rf)? {
            found.push((g, "response_format"));
        }
    }
    if let Some(s) = b.object("json_schema")? {
        let mut s = Value::Object(s.clone());
        closed_objects(&mut s, 0); // llama-server's reading: no properties beyond those listed
        found.push((Grammar::JsonSchema(s), "json_schema"));
    }
    if let Some(g) = b.str("grammar")? {
        let lark = backburner_engine::gbnf::to_lark(g)
            .map_err(|m| ApiError::invalid(Some("grammar"), format!("`grammar`: {m}")))?;
        found.push((Grammar::Lark(lark), "grammar"));
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            Some(found[1].1),
            format!(
                "`{}` and `{}` both constrain the output: send one",
                found[0].1, found[1].1
            ),
        ));
    }
    Ok(found.pop())
}

/// Sets `additionalProperties: false` on every object schema with `properties` that does not say, through
/// `properties`, `items`, `prefixItems`, `anyOf`/`oneOf`/`allOf`, `$defs` and `definitions` (32 levels at most).
fn closed_objects(s: &mut Value, depth: usize) {
    let Some(o) = s.as_object_mut().filter(|_| depth < 32) else {
        return;
    };
    if o.contains_key("properties") && !o.contains_key("additionalProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "$defs", "definitions"] {
        if let Some(m) = o.get_mut(key).and_then(Value::as_object_mut) {
            m.values_mut().for_each(|v| closed_objects(v, depth + 1));
        }
    }
    for key in ["items", "additionalProperties"] {
        if let Some(v) = o.get_mut(key) {
            closed_objects(v, depth + 1);
        }
    }
    for key in ["prefixItems", "anyOf", "oneOf", "allOf"] {
        if let Some(a) = o.get_mut(key).and_then(Value::as_array_mut) {
            a.iter_mut().for_each(|v| closed_objects(v, depth + 1));
        }
    }
}

/// OpenAI's `response_format` (and llama-server's `{"type": "json_object", "schema": …}`), every key read.
fn response_format(rf: &serde_json::Map<String, Value>) -> Result<Option<Grammar>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("response_format"), m);
    let only_keys = |o: &serde_json::Map<String, Value>, what: &str, keys: &[&str]| match o
        .keys()
        .find(|k| !keys.contains(&k.as_str()))
    {
        Some(k) => Err(bad(format!("unrecognized field `{k}` in `{what}`"))),
        None => Ok(()),
    };
    let schema_of = |v: Option<&Value>, what: &str| match v {
        None | Some(Value::Null) => Ok(None),
        Some(s @ Value::Object(_)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("`{what}` must be an object"))),
    };
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => {
            only_keys(rf, "response_format", &["type"])?;
            Ok(None)
        }
        Some("json_object") => {
            only_keys(rf, "response_format", &["type", "schema"])?;
            Ok(Some(
                match schema_of(rf.get("schema"), "response_format.schema")? {
                    Some(mut s) => {
                        closed_objects(&mut s, 0); // llama-server's reading
                        Grammar::JsonSchema(s)
                    }
                    None => Grammar::JsonObject,
                },
            ))
        }
        Some("json_schema") => {
            only_keys(rf, "response_format", &["type", "json_schema"])?;
            let js = rf
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    bad("`response_format.json_schema` must be an object with the `schema`".into())
                })?;
            only_keys(
                js,
                "response_format.json_schema",
                &["name", "schema", "strict", "description"],
            )?;
            if js
                .get("strict")
                .is_some_and(|v| !v.is_boolean() && !v.is_null())
            {
                return Err(bad(
                    "`response_format.json_schema.strict` must be a boolean".into(),
                ));
            }
            // no `schema`: any JSON value, as OpenAI's field is optional; strict: objects hold only their
            // `properties` unless they say otherwise (OpenAI's strict mode, llama.cpp's and vLLM's default)
            let s = schema_of(js.get("schema"), "response_format.json_schema.schema")?;
            let mut s = s.unwrap_or_else(|| json!({}));
            if js.get("strict") == Some(&Value::Bool(true)) {
                closed_objects(&mut s, 0);
            }
            Ok(Some(Grammar::JsonSchema(s)))
        }
        _ => Err(bad(
            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"".into(),
        )),
    }
}

/// The constraint of a request (`None` without one), checked by compiling it once. `after`: the text after
/// which the grammar applies (`</think>` when the prompt opened a reasoning block). Errors: 400 naming the field
/// for a malformed value or a grammar the engine refuses; 400 for a model without a tokenizer.
pub async fn read(
    st: &Arc<AppState>,
    b: &Body<'_>,
    after: Option<String>,
    tools: Option<&[Value]>,
) -> Result<Option<ConstraintSpec>, ApiError> {
    let markup = st.tokenizer.as_ref().is_some_and(|t| {
        let m = t.markup_tokens();
        ["<tool_call>", "</tool_call>"]
            .iter()
            .all(|w| m.iter().any(|(_, c)| c == w))
    });
    let Some((grammar, field)) = requested(b, tools, markup)? else {
        return Ok(None);
    };
    let grammars = grammars(st).await?;
    let spec = ConstraintSpec {
        grammars,
        grammar,
        after,
    };
    let check = spec.clone();
    tokio::task::spawn_blocking(move || check.check())
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| {
            // a tool grammar fails on the tools' parameter schemas
            let f = if field == "tool_choice" {
                "tools"
            } else {
                field
            };
            ApiError::invalid(Some(f), format!("`{f}`: {e}"))
        })?;
    Ok(Some(spec))
}

/// The vocabulary's grammars, built on first use (a trie of every token; ~0.1–0.5 s for 248k tokens) on the
/// blocking pool.
async fn grammars(st: &Arc<AppState>) -> Result<Arc<Grammars>, ApiError> {
    let tok = st.tokenizer()?;
    let st2 = st.clone();
    tokio::task::spawn_blocking(move || {
        st2.grammars
            .get_or_init(|| {
                let vocab = tok.vocab_size();
                Grammars::new(&tok, vocab, &st2.eos_ids)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(ApiError::internal)
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?
}
