//! OpenAI-shaped requests: what normalization accepts and changes, and the typed errors naming the field for what it
//! rejects.

use backburner_model::chat::{normalize_messages, normalize_tools};
use backburner_model::{ChatRequest, ChatTemplate, ModelError};
use serde_json::{json, Value};

fn field_of(r: backburner_model::Result<Vec<Value>>) -> (String, String) {
    match r {
        Err(ModelError::InvalidChatRequest { field, message }) => (field, message),
        other => panic!("expected InvalidChatRequest, got {other:?}"),
    }
}

#[test]
fn malformed_messages_fail_naming_the_field() {
    let cases = [
        (json!([]), "messages"),
        (json!(["hi"]), "messages[0]"),
        (json!([{"content": "x"}]), "messages[0].role"),
        (json!([{"role": 1, "content": "x"}]), "messages[0].role"),
        (
            json!([{"role": "user", "content": 5}]),
            "messages[0].content",
        ),
        (
            json!([{"role": "user", "content": {"text": "x"}}]),
            "messages[0].content",
        ),
        (
            json!([{"role": "user", "content": ["x"]}]),
            "messages[0].content[0]",
        ),
        (
            json!([{"role": "user", "content": [{"type": "text"}]}]),
            "messages[0].content[0].text",
        ),
        (
            json!([{"role": "user", "content": [{"type": "text", "text": 3}]}]),
            "messages[0].content[0].text",
        ),
        (
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages[0].content[0].type",
        ),
        (
            json!([{"role": "tool", "content": "x", "tool_call_id": 7}]),
            "messages[0].tool_call_id",
        ),
        (
            json!([{"role": "assistant", "reasoning_content": ["x"]}]),
            "messages[0].reasoning_content",
        ),
        (
            json!([{"role": "assistant", "tool_calls": {}}]),
            "messages[0].tool_calls",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [1]}]),
            "messages[0].tool_calls[0]",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"id": "a"}]}]),
            "messages[0].tool_calls[0].function",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
            "messages[0].tool_calls[0].function.name",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"a\": "}}]}]),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}]),
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]),
            "messages[0].tool_calls[0].function.arguments",
        ),
    ];
    for (messages, want) in cases {
        let (field, message) = field_of(normalize_messages(messages.as_array().unwrap()));
        assert_eq!(field, want, "{messages}: {message}");
        assert!(!message.is_empty());
    }
}

#[test]
fn malformed_tools_fail_naming_the_field() {
    for (tools, want) in [
        (json!(["f"]), "tools[0]"),
        (
            json!([{"type": "function", "function": "f"}]),
            "tools[0].function",
        ),
        (
            json!([{"type": "function", "function": {"description": "d"}}]),
            "tools[0].function.name",
        ),
        (
            json!([{"type": "function", "function": {"name": "f"}}, {"parameters": {}}]),
            "tools[1].name",
        ),
    ] {
        assert_eq!(
            field_of(normalize_tools(tools.as_array().unwrap())).0,
            want,
            "{tools}"
        );
    }
}

#[test]
fn normalization_drops_nulls_parses_arguments_and_aliases_reasoning() {
    let msgs = json!([
        {"role": "assistant", "content": null, "reasoning": "why", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"b\":1,\"a\":[true,null]}"}},
            {"id": "d", "type": "function", "function": {"name": "g", "arguments": ""}},
            {"id": "e", "type": "function", "function": {"name": "h", "arguments": {"z": 2}}},
        ]}
    ]);
    let out = normalize_messages(msgs.as_array().unwrap()).unwrap();
    let m = out[0].as_object().unwrap();
    assert!(!m.contains_key("content"));
    assert_eq!(m.keys().next().unwrap(), "thinking");
    assert_eq!(m["reasoning_content"], "why");
    let calls = m["tool_calls"].as_array().unwrap();
    let args0 = &calls[0]["function"]["arguments"];
    assert_eq!(args0, &json!({"b": 1, "a": [true, null]}));
    let keys: Vec<&String> = args0.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["b", "a"], "key order kept");
    assert_eq!(calls[1]["function"]["arguments"], json!({}));
    assert_eq!(calls[2]["function"]["arguments"], json!({"z": 2}));
}

#[test]
fn an_assistant_refusal_part_becomes_a_text_part() {
    let msgs = json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "text", "text": "sorry"}]}
    ]);
    let out = normalize_messages(msgs.as_array().unwrap()).unwrap();
    assert_eq!(
        out[1]["content"],
        json!([{"type": "text", "text": "no"}, {"type": "text", "text": "sorry"}])
    );
    // rendered as text by the Qwen3.5 template (which raises on any other part type)
    let src = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../assets/qwen3.5/chat_template.jinja"
    ))
    .unwrap();
    let t = ChatTemplate::new(&src).unwrap();
    let kwargs = serde_json::Map::new();
    let req = ChatRequest {
        messages: msgs.as_array().unwrap(),
        tools: None,
        add_generation_prompt: false,
        kwargs: &kwargs,
    };
    let text = t.render(&req, &[]).unwrap();
    assert!(
        text.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\nnosorry<|im_end|>\n"),
        "{text:?}"
    );
    // a refusal part elsewhere, or without its text, is refused naming the field
    for (messages, want) in [
        (
            json!([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]),
            "messages[0].content[0].type",
        ),
        (
            json!([{"role": "assistant", "content": [{"type": "refusal"}]}]),
            "messages[0].content[0].refusal",
        ),
        (
            json!([{"role": "assistant", "content": [{"type": "refusal", "refusal": 1}]}]),
            "messages[0].content[0].refusal",
        ),
    ] {
        assert_eq!(
            field_of(normalize_messages(messages.as_array().unwrap())).0,
            want
        );
    }
}

#[test]
fn template_kwargs_cannot_replace_the_request_itself() {
    let t = ChatTemplate::new("{{ messages|length }}").unwrap();
    let msgs = [json!({"role": "user", "content": "x"})];
    let kwargs = json!({"messages": []});
    let req = ChatRequest {
        messages: &msgs,
        tools: None,
        add_generation_prompt: true,
        kwargs: kwargs.as_object().unwrap(),
    };
    match t.render(&req, &[]) {
        Err(ModelError::InvalidChatRequest { field, .. }) => {
            assert_eq!(field, "chat_template_kwargs.messages")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_template_that_does_not_parse_is_a_template_error() {
    assert!(matches!(
        ChatTemplate::new("{% if %}"),
        Err(ModelError::ChatTemplate(_))
    ));
    let t = ChatTemplate::new("{{ 1 + }}");
    assert!(matches!(t, Err(ModelError::ChatTemplate(_))));
}

#[test]
fn text_parts_reach_a_string_only_template_joined_and_an_array_template_as_parts() {
    let render = |src: &str, msgs: &[Value]| {
        let kwargs = serde_json::Map::new();
        let req = ChatRequest {
            messages: msgs,
            tools: None,
            add_generation_prompt: false,
            kwargs: &kwargs,
        };
        ChatTemplate::new(src).unwrap().render(&req, &[])
    };
    let parts = [
        json!({"role": "system", "content": "s"}),
        json!({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}),
        json!({"role": "user", "content": []}),
    ];
    // `+` on a sequence fails: the template only takes strings
    let strings = "{% for m in messages %}[{{ m.role + ':' + m.content }}]{% endfor %}";
    assert_eq!(
        render(strings, &parts).unwrap(),
        "[system:s][user:a\nb][user:]"
    );
    // a template that iterates the parts itself sees them as sent
    let arrays = "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}\
                  {% for p in m.content %}<{{ p.text }}>{% endfor %}{% endif %}|{% endfor %}";
    assert_eq!(render(arrays, &parts).unwrap(), "s|<a><b>||");
}
