//! Constrained decoding on the tiny checkpoint with its byte-level tokenizer: greedy output under a JSON schema,
//! any JSON object or a Lark grammar is what the grammar allows and ends at an eos id once the grammar is complete;
//! a constraint waiting for a token leaves the output before it untouched.

use crate::common;

use std::sync::Arc;

use backburner_engine::constraint::{ConstraintSpec, Grammar, Grammars};
use backburner_engine::{
    generate, EngineError, GenerateParams, Generation, Session, SessionOptions, StopReason,
};
use backburner_model::TextTokenizer;
use common::*;
use serde_json::{json, Value};

fn tokenizer() -> Arc<TextTokenizer> {
    let m = load_model("tiny-hub");
    let t = TextTokenizer::from_dir(
        &fixture("tiny-hub"),
        m.config().vocab_size,
        &m.config().eos_token_ids,
    )
    .unwrap()
    .unwrap();
    Arc::new(t)
}

fn grammars(tok: &Arc<TextTokenizer>) -> Arc<Grammars> {
    Arc::new(Grammars::new(tok, tok.vocab_size(), tok.eos_ids()).unwrap())
}

fn run(tok: &TextTokenizer, constraint: Option<ConstraintSpec>, max_tokens: usize) -> Generation {
    let prompt = tok.encode("Tell me about a person:").unwrap();
    let p = GenerateParams {
        max_tokens,
        eos_ids: tok.eos_ids().to_vec(),
        constraint,
        ..Default::default()
    };
    let mut s = Session::new(load_model("tiny-hub"), SessionOptions::default()).unwrap();
    generate(&mut s, &prompt, &p, Some(tok), |_, _| {}, |_| {}, |_| {}).unwrap()
}

#[test]
fn a_json_schema_gives_a_value_of_the_schema_ending_at_eos() {
    let tok = tokenizer();
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}
        },
        "required": ["name", "age", "kind", "tags"],
        "additionalProperties": false
    });
    let spec = ConstraintSpec {
        grammars: grammars(&tok),
        grammar: Grammar::JsonSchema(schema),
        after: None,
    };
    let free = run(&tok, None, 40);
    let g = run(&tok, Some(spec), 200);
    assert_ne!(g.text, free.text);
    assert_eq!(g.stop_reason, StopReason::Eos, "{:?}", g.text);
    let v: Value = serde_json::from_str(&g.text).unwrap_or_else(|e| panic!("{e}: {:?}", g.text));
    let o = v.as_object().unwrap();
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["age", "kind", "name", "tags"], "{v}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 6);
    assert!((0..=120).contains(&o["age"].as_i64().unwrap()));
    assert!(o["kind"] == "cat" || o["kind"] == "dog");
    assert!(o["tags"].as_array().unwrap().iter().all(Value::is_boolean));
    // compact separators: `", "` and `": "`, no other whitespace outside strings
    assert!(g.text.starts_with("{\"name\": \""), "{:?}", g.text);
}

#[test]
fn any_object_and_a_lark_grammar_are_followed() {
    let tok = tokenizer();
    let gr = grammars(&tok);
    let spec = |grammar| ConstraintSpec {
        grammars: gr.clone(),
        grammar,
        after: None,
    };
    // the random model stays inside the first key's string: still a JSON prefix, with no raw control character
    let g = run(&tok, Some(spec(Grammar::JsonObject)), 120);
    assert!(g.text.starts_with("{\""), "{:?}", g.text);
    assert!(!g.text.chars().any(|c| (c as u32) < 0x20), "{:?}", g.text);
    let free = run(&tok, None, 120);
    assert!(!free.text.starts_with('{'));
    let lark = Grammar::Lark("start: (\"yes\" | \"no\") \"!\" /[0-9]{2}/".into());
    let g = run(&tok, Some(spec(lark)), 50);
    assert_eq!(g.stop_reason, StopReason::Eos);
    let (word, num) = g.text.split_once('!').unwrap();
    assert!(word == "yes" || word == "no", "{:?}", g.text);
    assert!(
        num.len() == 2 && num.chars().all(|c| c.is_ascii_digit()),
        "{:?}",
        g.text
    );
}

#[test]
fn a_constraint_waiting_for_a_text_leaves_the_output_up_to_it_free() {
    let tok = tokenizer();
    // the marker: the text of the free run's tokens 1 and 2 (several tokens: matched on bytes)
    let free = run(&tok, None, 12);
    let marker = tok.decode(&free.tokens[1..3]).unwrap();
    let k = (0..free.tokens.len())
        .find(|&i| tok.decode(&free.tokens[..=i]).unwrap().ends_with(&marker))
        .unwrap();
    let spec = ConstraintSpec {
        grammars: grammars(&tok),
        grammar: Grammar::Lark("start: \"ok\"".into()),
        after: Some(marker),
    };
    let g = run(&tok, Some(spec), 40);
    assert_eq!(g.tokens[..=k], free.tokens[..=k]);
    assert_eq!(tok.decode(&g.tokens[k + 1..]).unwrap(), "ok");
    assert_eq!(g.stop_reason, StopReason::Eos);
}

#[test]
fn a_malformed_grammar_is_invalid_input_before_anything_runs() {
    let tok = tokenizer();
    let gr = grammars(&tok);
    for grammar in [
        Grammar::JsonSchema(json!({"type": "no-such-type"})),
        Grammar::Lark("start: (".into()),
    ] {
        let spec = ConstraintSpec {
            grammars: gr.clone(),
            grammar,
            after: None,
        };
        match spec.start() {
            Err(EngineError::InvalidInput(m)) => assert!(m.starts_with("grammar: "), "{m}"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("compiled"),
        }
    }
}
