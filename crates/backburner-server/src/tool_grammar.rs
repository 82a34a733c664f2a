//! `tool_choice: "required"` or a named function, enforced: a Lark grammar of the Qwen3.5 template's XML tool-call
//! format whose calls name the allowed tools and whose parameters follow each tool's JSON schema.
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=P>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! One call or more (several in one answer, as `parallel_tool_calls` allows), separated by a newline, after at most
//! two newlines (what follows `</think>`; unbounded whitespace let a trial's greedy model write 248 blanks and no
//! call); nothing else. Parameters come in the order of the schema's `properties`, the `required` ones always,
//! the others optionally. A value whose schema is a plain string is raw text up to `\n</parameter>\n` (as the
//! template writes strings); a string `enum` is one of its values; any other schema is JSON of that schema (llguidance's
//! `%json`), which the output parser reads back by the same schema. `<tool_call>` and `</tool_call>` are the
//! vocabulary's own tokens when it has them (Qwen3.5's), else their text.

use serde_json::{json, Value};

/// The Lark grammar of calls to `tools` (OpenAI's `tools` array) allowed by `choice` (`"required"`, or the name of
/// one function); `markup` tells whether the vocabulary has `<tool_call>` / `</tool_call>` tokens. Errors: a message
/// for a named function that is not among the tools, or no tools.
pub fn lark(tools: &[Value], choice: Option<&str>, markup: bool) -> Result<String, String> {
    let mut calls = Vec::new();
    let mut rules = String::new();
    for (i, t) in tools.iter().enumerate() {
        let f = t.get("function").unwrap_or(t);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            continue;
        };
        if choice.is_some_and(|c| c != name) {
            continue;
        }
        let params = f.get("parameters").cloned().unwrap_or(json!({}));
        calls.push(format!("call_{i}"));
        rules.push_str(&call_rule(i, name, &params));
    }
    if calls.is_empty() {
        return Err(match choice {
            Some(c) => format!("no tool named {c:?} in `tools`"),
            None => "`tools` has no function to call".into(),
        });
    }
    let (open, close) = if markup {
        ("<tool_call>", "</tool_call>")
    } else {
        ("\"<tool_call>\"", "\"</tool_call>\"")
    };
    Ok(format!(
        "start: /\\n{{0,2}}/ call (\"\\n\" call)*\ncall: {open} \"\\n\" ({}) \"</function>\\n\" {close}\n{rules}",
        calls.join(" | ")
    ))
}

/// `call_i: "<function=NAME>\n" params…` and the rules of its values.
fn call_rule(i: usize, name: &str, params: &Value) -> String {
    let lit = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut body = vec![lit(&format!("<function={name}>\n"))];
    let mut rules = String::new();
    if let Some(props) = params.get("properties").and_then(Value::as_object) {
        for (j, (p, schema)) in props.iter().enumerate() {
            let v = format!("v_{i}_{j}");
            let open = lit(&format!("<parameter={p}>\n"));
            let item = match value_rule(&v, schema, params) {
                ValueRule::Raw(rule) => {
                    rules.push_str(&rule);
                    format!("({open} {v})")
                }
                ValueRule::Then(rule) => {
                    rules.push_str(&rule);
                    format!("({open} {v} \"\\n</parameter>\\n\")")
                }
            };
            body.push(if required.contains(&p.as_str()) {
                item
            } else {
                format!("{item}?")
            });
        }
    }
    format!("call_{i}: {}\n{rules}", body.join(" "))
}

enum ValueRule {
    /// A rule that ends with the closing `\n</parameter>\n` itself.
    Raw(String),
    /// A rule the closing must follow.
    Then(String),
}

/// The rule named `v` for a parameter of `schema` (`$ref`s resolve against `root`, the tool's parameters).
fn value_rule(v: &str, schema: &Value, root: &Value) -> ValueRule {
    let lit = |s: &str| serde_json::to_string(s).expect("a string serializes");
    let is_string = schema.get("type").and_then(Value::as_str) == Some("string");
    match schema.get("enum").and_then(Value::as_array) {
        Some(vals) if is_string || vals.iter().all(Value::is_string) => {
            let alts: Vec<String> = vals.iter().filter_map(Value::as_str).map(lit).collect();
            if !alts.is_empty() {
                return ValueRule::Then(format!("{v}: {}\n", alts.join(" | ")));
            }
        }
        _ => {}
    }
    // any text is a string: where the schema allows one, the value is raw text, as the output parser reads it
    // (`allowed_types`), e.g. `anyOf: [integer, string]`
    let string_ok = backburner_model::chat::allowed_types(schema, root, 0).contains(&"string");
    if (is_string || string_ok) && schema.get("pattern").is_none() && schema.get("format").is_none()
    {
        return ValueRule::Raw(format!("{v}[suffix=\"\\n</parameter>\\n\"]: /(?s:.*)/\n"));
    }
    // JSON of the schema, with the tool's definitions for its `$ref`s
    let mut s = schema.clone();
    if let (Some(o), Some(defs)) = (s.as_object_mut(), root.get("$defs")) {
        o.entry("$defs").or_insert_with(|| defs.clone());
    }
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    ValueRule::Then(format!("{v}: %json {s}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_function_gives_its_call_only_with_typed_parameters() {
        let tools = json!([
            {"type": "function", "function": {"name": "a", "parameters": {}}},
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                               "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"]}}}
        ]);
        let g = lark(tools.as_array().unwrap(), Some("get_weather"), true).unwrap();
        assert!(g.starts_with(
            "start: /\\n{0,2}/ call (\"\\n\" call)*\ncall: <tool_call> \"\\n\" (call_1) "
        ));
        assert!(
            g.contains("call_1: \"<function=get_weather>\\n\" (\"<parameter=city>\\n\" v_1_0) ")
        );
        assert!(g.contains("v_1_0[suffix=\"\\n</parameter>\\n\"]: /(?s:.*)/"));
        assert!(g.contains("v_1_1: %json {"));
        assert!(g.contains("v_1_2: \"c\" | \"f\""));
        assert!(g.contains("v_1_1 \"\\n</parameter>\\n\")?"));
        assert!(!g.contains("<function=a>"));
        let g = lark(tools.as_array().unwrap(), None, false).unwrap();
        assert!(g.contains("call: \"<tool_call>\" \"\\n\" (call_0 | call_1)"));
        assert!(lark(tools.as_array().unwrap(), Some("nope"), true)
            .unwrap_err()
            .contains("nope"));
        assert!(lark(&[], None, true).is_err());
    }

    /// The Qwen3.5 tokenizer (`assets/qwen3.5`), unpacked.
    fn qwen35() -> (tempfile::TempDir, backburner_model::TextTokenizer) {
        use std::io::Read;
        let assets =
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5");
        let d = tempfile::tempdir().unwrap();
        let gz = std::fs::read(assets.join("tokenizer.json.gz")).unwrap();
        let mut j = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut j)
            .unwrap();
        std::fs::write(d.path().join("tokenizer.json"), &j).unwrap();
        for f in ["tokenizer_config.json", "generation_config.json"] {
            std::fs::copy(assets.join(f), d.path().join(f)).unwrap();
        }
        let t = backburner_model::TextTokenizer::from_dir(d.path(), 248_320, &[])
            .unwrap()
            .unwrap();
        (d, t)
    }

    #[test]
    fn on_the_qwen35_vocabulary_a_call_is_its_tool_call_tokens_and_then_eos() {
        use backburner_engine::constraint::{ConstraintSpec, Grammar, Grammars};
        let (_d, tok) = qwen35();
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city", "days"]}}}]);
        let g = lark(tools.as_array().unwrap(), None, true).unwrap();
        let spec = ConstraintSpec {
            grammars: std::sync::Arc::new(Grammars::new(&tok, 248_320, tok.eos_ids()).unwrap()),
            grammar: Grammar::Lark(g),
            after: None,
        };
        let mut c = spec.start().unwrap();
        let text =
            "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n\
                    <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let ids = tok.encode(text).unwrap();
        let tc = tok
            .markup_tokens()
            .into_iter()
            .find(|(_, t)| t == "<tool_call>")
            .unwrap()
            .0;
        assert!(ids.contains(&tc), "<tool_call> is one token");
        let hello = tok.encode("Hello").unwrap()[0];
        let mut l = vec![0.0f32; 248_320];
        c.mask(&mut l).unwrap();
        assert!(l[tc as usize].is_finite() && l[hello as usize] == f32::NEG_INFINITY);
        for (k, &id) in ids.iter().enumerate() {
            let mut l = vec![0.0f32; 248_320];
            c.mask(&mut l).unwrap();
            assert!(
                l[id as usize].is_finite(),
                "token {id} {:?} after {:?}",
                tok.decode(&[id]),
                tok.decode(&ids[..k])
            );
            c.accept(id).unwrap();
        }
        // a second call may follow a newline; else only eos
        let mut l = vec![0.0f32; 248_320];
        c.mask(&mut l).unwrap();
        let allowed: Vec<usize> = (0..l.len()).filter(|&i| l[i].is_finite()).collect();
        assert!(
            allowed.iter().all(|&i| tok.eos_ids().contains(&(i as u32))
                || tok.decode(&[i as u32]).unwrap().starts_with('\n')),
            "{allowed:?}"
        );
        assert!(tok.eos_ids().iter().all(|&e| l[e as usize].is_finite()));
    }
}
