//! The chat template renders as transformers renders it (Jinja2 in its sandboxed environment), on the references
//! recorded by scripts/chat_template_vectors.py in assets/qwen3.5/chat_template_vectors.json: probes of every
//! filter, method and test chat templates use, and the Qwen3.5 template on tool and reasoning conversations.

use std::path::PathBuf;

use backburner_model::{ChatRequest, ChatTemplate, ModelError};
use serde_json::Value;

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/qwen3.5")
}

fn vectors() -> Value {
    let text = std::fs::read_to_string(assets().join("chat_template_vectors.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn qwen35() -> ChatTemplate {
    ChatTemplate::new(&std::fs::read_to_string(assets().join("chat_template.jinja")).unwrap())
        .unwrap()
}

const SPECIAL: [(&str, &str); 2] = [("eos_token", "<|im_end|>"), ("pad_token", "<|endoftext|>")];

/// Renders `messages` of conversation `conv` with the options of one of its recorded renderings.
fn render(
    t: &ChatTemplate,
    messages: &Value,
    conv: &Value,
    r: &Value,
) -> backburner_model::Result<String> {
    let empty = serde_json::Map::new();
    let req = ChatRequest {
        messages: messages.as_array().unwrap(),
        tools: conv["tools"].as_array().map(Vec::as_slice),
        add_generation_prompt: r["add_generation_prompt"].as_bool().unwrap_or(true),
        kwargs: r["kwargs"].as_object().unwrap_or(&empty),
    };
    t.render(&req, &SPECIAL)
}

#[test]
fn filters_methods_and_tests_behave_as_jinja2_under_transformers() {
    let v = vectors();
    let cases = v["template_cases"].as_array().unwrap();
    assert!(cases.len() >= 15);
    let mut failed = Vec::new();
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let got = ChatTemplate::new(c["template"].as_str().unwrap())
            .and_then(|t| t.render_json(&c["context"]));
        match (c["text"].as_str(), got) {
            (Some(want), Ok(got)) if got == want => {}
            (None, Err(_)) => {}
            (want, got) => failed.push(format!("{name}:\n want {want:?}\n got  {got:?}")),
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn qwen35_conversations_render_like_transformers() {
    let v = vectors();
    let t = qwen35();
    let convs = v["chat_cases"].as_array().unwrap();
    assert!(convs.len() >= 12);
    let mut n = 0;
    for c in convs {
        for r in c["renders"].as_array().unwrap() {
            let name = format!(
                "{} agp={} kwargs={}",
                c["name"], r["add_generation_prompt"], r["kwargs"]
            );
            let want = r["text"].as_str().unwrap();
            assert_eq!(render(&t, &c["messages"], c, r).unwrap(), want, "{name}");
            n += 1;
        }
    }
    assert!(n >= 40, "{n}");
}

#[test]
fn openai_shaped_tool_calls_render_as_their_object_form() {
    // Arguments as JSON strings (what OpenAI clients send) and `content: null` give the same text as objects.
    let v = vectors();
    let t = qwen35();
    let mut n = 0;
    for c in v["chat_cases"].as_array().unwrap() {
        let Some(m) = c.get("openai_messages") else {
            continue;
        };
        for r in c["renders"].as_array().unwrap() {
            let want = r["text"].as_str().unwrap();
            assert_eq!(render(&t, m, c, r).unwrap(), want, "{}", c["name"]);
            n += 1;
        }
    }
    assert!(n >= 10, "{n}");
}

#[test]
fn conversations_the_template_rejects_are_invalid_requests_with_its_message() {
    let v = vectors();
    let t = qwen35();
    for c in v["error_cases"].as_array().unwrap() {
        match render(&t, &c["messages"], c, &Value::Null) {
            Err(ModelError::InvalidChatRequest { field, message }) => {
                assert_eq!(field, "messages");
                assert_eq!(message, c["error"].as_str().unwrap(), "{}", c["name"]);
            }
            other => panic!("{}: {other:?}", c["name"]),
        }
    }
}
