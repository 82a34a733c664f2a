//! The request fields that constrain an output to a grammar: OpenAI's `response_format` (`json_object`,
//! `json_schema`) and llama-server's `json_schema` (a schema) and `grammar` (GBNF, or Lark in llguidance's dialect
//! when it starts with `%llguidance` or uses `:` rules), turned into the engine's [`ConstraintSpec`].

use std::sync::Arc;

use backburner_engine::constraint::{ConstraintSpec, Grammar, Grammars};
use serde_json::Value;

use crate::error::ApiError;
use crate::request::Body;
use crate::AppState;

/// The grammar a request asks for and the field that asked, if any. Errors: 400 naming the field for a malformed
/// value, or when more than one field asks.
fn requested(b: &Body) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    let mut found: Vec<(Grammar, &'static str)> = Vec::new();
    if let Some(rf) = b.object("response_format")? {
        let bad = |m: &str| ApiError::invalid(Some("response_format"), m.to_string());
        match rf.get("type").and_then(Value::as_str) {
            Some("text") => {}
            Some("json_object") => found.push((Grammar::JsonObject, "response_format")),
            Some("json_schema") => {
                let js = rf
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .ok_or_else(|| {
                        bad("`response_format.json_schema` must be an object with the `schema`")
                    })?;
                let schema = match js.get("schema") {
                    None | Some(Value::Null) => Value::Object(Default::default()),
                    Some(s @ Value::Object(_)) => s.clone(),
                    Some(_) => {
                        return Err(bad(
                            "`response_format.json_schema.schema` must be an object",
                        ))
                    }
                };
                found.push((Grammar::JsonSchema(schema), "response_format"));
            }
            _ => {
                return Err(bad(
                    "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"",
                ))
            }
        }
    }
    if let Some(s) = b.object("json_schema")? {
        found.push((Grammar::JsonSchema(Value::Object(s.clone())), "json_schema"));
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

/// The constraint of a request (`None` without one), checked by compiling it once. `after`: the text after
/// which the grammar applies (`</think>` when the prompt opened a reasoning block). Errors: 400 naming the field
/// for a malformed value or a grammar the engine refuses; 400 for a model without a tokenizer.
pub async fn read(
    st: &Arc<AppState>,
    b: &Body<'_>,
    after: Option<String>,
) -> Result<Option<ConstraintSpec>, ApiError> {
    let Some((grammar, field)) = requested(b)? else {
        return Ok(None);
    };
    let grammars = grammars(st).await?;
    let spec = ConstraintSpec {
        grammars,
        grammar,
        after,
    };
    let check = spec.clone();
    tokio::task::spawn_blocking(move || check.start().map(drop))
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::invalid(Some(field), format!("`{field}`: {e}")))?;
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
