//! Every parameter the official `openai` Python SDK (2.8.0, `chat.completions.create` and `completions.create`)
//! can send is honoured (200) or refused with a 400 naming it — none is silently ignored; fields the SDK does not
//! know and this server does not either are refused the same way, as OpenAI refuses them.

use crate::common;

use common::*;
use serde_json::{json, Value};

/// The SDK's `CompletionCreateParamsBase` fields for chat (`openai/types/chat/completion_create_params.py`), plus
/// `stream`, which the SDK adds per overload.
const SDK_CHAT: &[&str] = &[
    "messages",
    "model",
    "audio",
    "frequency_penalty",
    "function_call",
    "functions",
    "logit_bias",
    "logprobs",
    "max_completion_tokens",
    "max_tokens",
    "metadata",
    "modalities",
    "n",
    "parallel_tool_calls",
    "prediction",
    "presence_penalty",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning_effort",
    "response_format",
    "safety_identifier",
    "seed",
    "service_tier",
    "stop",
    "store",
    "stream_options",
    "temperature",
    "tool_choice",
    "tools",
    "top_logprobs",
    "top_p",
    "user",
    "verbosity",
    "web_search_options",
    "stream",
];

/// The same for legacy completions (`openai/types/completion_create_params.py`).
const SDK_COMPLETIONS: &[&str] = &[
    "model",
    "prompt",
    "best_of",
    "echo",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "max_tokens",
    "n",
    "presence_penalty",
    "seed",
    "stop",
    "stream_options",
    "suffix",
    "temperature",
    "top_p",
    "user",
    "stream",
];

fn tool() -> Value {
    json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}])
}

/// Values a client sends that this server honours.
fn honoured_chat() -> Vec<(&'static str, Value)> {
    vec![
        ("model", json!(MODEL_ID)),
        ("frequency_penalty", json!(0.5)),
        ("logit_bias", json!({"5": -1})),
        ("logprobs", json!(true)),
        ("max_completion_tokens", json!(2)),
        ("max_tokens", json!(2)),
        ("metadata", json!({"run": "a"})),
        ("modalities", json!(["text"])),
        ("n", json!(1)),
        ("parallel_tool_calls", json!(true)),
        ("presence_penalty", json!(0.5)),
        ("prompt_cache_key", json!("k")),
        ("prompt_cache_retention", json!("in-memory")),
        ("response_format", json!({"type": "text"})),
        ("response_format", json!({"type": "json_object"})),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        ),
        ("grammar", json!("root ::= \"a\"")),
        ("json_schema", json!({"type": "object"})),
        ("safety_identifier", json!("s")),
        ("seed", json!(7)),
        ("service_tier", json!("auto")),
        ("stop", json!(["zz"])),
        ("store", json!(false)),
        ("stream_options", json!({"include_usage": true})),
        (
            "stream_options",
            json!({"include_usage": true, "include_obfuscation": false}),
        ),
        ("stream_options", json!({"include_obfuscation": true})),
        ("temperature", json!(0.7)),
        ("tool_choice", json!("auto")),
        ("tools", tool()),
        ("top_logprobs", json!(2)),
        ("top_p", json!(0.9)),
        ("user", json!("u")),
        ("stream", json!(false)),
    ]
}

/// Values that ask for what this server does not do.
fn refused_chat() -> Vec<(&'static str, Value)> {
    vec![
        ("audio", json!({"voice": "alloy", "format": "wav"})),
        ("function_call", json!("auto")),
        ("functions", json!([{"name": "f", "parameters": {}}])),
        ("modalities", json!(["text", "audio"])),
        ("n", json!(17)),
        ("parallel_tool_calls", json!(false)),
        ("prediction", json!({"type": "content", "content": "x"})),
        ("prompt_cache_retention", json!("24h")),
        ("reasoning_effort", json!("low")),
        ("response_format", json!({"type": "xml"})),
        ("service_tier", json!("flex")),
        ("store", json!(true)),
        ("tool_choice", json!("required")),
        (
            "tool_choice",
            json!({"type": "function", "function": {"name": "f"}}),
        ),
        ("verbosity", json!("low")),
        ("web_search_options", json!({})),
        ("grammar", json!("root ::= \"a")),
        ("json_schema", json!(3)),
        ("no_such_field", json!(1)),
    ]
}

fn honoured_completions() -> Vec<(&'static str, Value)> {
    vec![
        ("model", json!(MODEL_ID)),
        ("best_of", json!(1)),
        ("echo", json!(false)),
        ("frequency_penalty", json!(-0.5)),
        ("logit_bias", json!({"5": 3})),
        ("logprobs", json!(2)),
        ("max_tokens", json!(2)),
        ("n", json!(1)),
        ("presence_penalty", json!(1)),
        ("seed", json!(1)),
        ("seed", json!(u64::MAX)),
        ("seed", json!(-1)),
        ("stop", json!("zz")),
        ("stream_options", json!({"include_usage": false})),
        ("suffix", json!("")),
        ("temperature", json!(0)),
        ("top_p", json!(1)),
        ("user", json!("u")),
        ("stream", json!(false)),
    ]
}

fn refused_completions() -> Vec<(&'static str, Value)> {
    vec![
        ("best_of", json!(3)),
        ("seed", json!(-2)),
        ("echo", json!(true)),
        ("n", json!(17)),
        ("suffix", json!("return x")),
        ("messages", json!([])),
        ("top_logprobs", json!(2)),
        ("no_such_field", json!(1)),
    ]
}

#[test]
fn every_sdk_parameter_has_a_case() {
    let names = |v: Vec<(&'static str, Value)>| v.into_iter().map(|c| c.0).collect::<Vec<_>>();
    let mut chat = names(honoured_chat());
    chat.extend(names(refused_chat()));
    for p in SDK_CHAT.iter().filter(|p| **p != "messages") {
        assert!(chat.contains(p), "chat: {p}");
    }
    let mut cmpl = names(honoured_completions());
    cmpl.extend(names(refused_completions()));
    for p in SDK_COMPLETIONS.iter().filter(|p| **p != "prompt") {
        assert!(cmpl.contains(p), "completions: {p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_parameter_is_honoured_or_a_400_naming_it() {
    let s = Server::engine(Setup::default()).await;
    let base_chat = chat_body("hi", 2);
    let base_cmpl = json!({"prompt": [1, 2, 3], "max_tokens": 2});
    for (path, base, ok, bad) in [
        (
            "/v1/chat/completions",
            &base_chat,
            honoured_chat(),
            refused_chat(),
        ),
        (
            "/v1/completions",
            &base_cmpl,
            honoured_completions(),
            refused_completions(),
        ),
    ] {
        for (field, v) in ok {
            let mut b = base.clone();
            b[field] = v.clone();
            if field == "top_logprobs" {
                b["logprobs"] = json!(true);
            }
            let r = s.post(path, &b).await;
            assert_eq!(r.status.as_u16(), 200, "{path} {field}={v}: {}", r.json);
        }
        for (field, v) in bad {
            let mut b = base.clone();
            b[field] = v.clone();
            let r = s.post(path, &b).await;
            assert_eq!(r.status.as_u16(), 400, "{path} {field}={v}: {}", r.json);
            let (kind, param, _, msg) = r.error(400);
            assert_eq!(kind, "invalid_request_error");
            assert_eq!(param.as_deref(), Some(field), "{path} {field}={v}: {msg}");
            assert!(msg.contains(field), "{msg}");
        }
    }
    // all honoured values at once, as an SDK call with many arguments sends them
    let mut b = base_chat.clone();
    // (one constraint at most: `grammar` and `json_schema` would each be a second one)
    for (field, v) in honoured_chat() {
        if field != "grammar" && field != "json_schema" {
            b[field] = v;
        }
    }
    s.post("/v1/chat/completions", &b).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misplaced_or_llama_server_named_field_says_what_to_send() {
    let s = Server::engine(Setup::default()).await;
    for (path, field, want) in [
        ("/v1/chat/completions", "prompt", "/v1/completions"),
        ("/v1/completions", "messages", "/v1/chat/completions"),
        (
            "/v1/chat/completions",
            "repeat_penalty",
            "repetition_penalty",
        ),
        ("/v1/chat/completions", "n_predict", "max_tokens"),
        ("/v1/completions", "n_probs", "logprobs"),
    ] {
        let mut b = if path == "/v1/completions" {
            json!({"prompt": "x", "max_tokens": 2})
        } else {
            chat_body("x", 2)
        };
        b[field] = json!(1);
        let (_, p, _, m) = s.post(path, &b).await.error(400);
        assert_eq!(p.as_deref(), Some(field));
        assert!(m.contains(want), "{m}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn message_shapes_are_taken_or_refused_naming_their_path() {
    let s = Server::engine(Setup::default()).await;
    // an assistant message's refusal part (the SDK's shape) is taken, as text
    let history = json!([
        {"role": "user", "content": "Do a bad thing"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
        {"role": "user", "content": "OK"}
    ]);
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": history, "max_tokens": 2}),
        )
        .await
        .ok();
    assert_eq!(r["object"], "chat.completion");
    let user = |content: Value| json!([{"role": "user", "content": content}]);
    let f = |name: &str| json!({"type": "function", "function": {"name": name}});
    let accepted = "(accepted: system, developer, user, assistant, tool)";
    for (field, v, param, message) in [
        (
            "messages",
            json!([{"role": "wizard", "content": "hi"}]),
            "messages[0].role",
            format!("unknown role \"wizard\" {accepted}"),
        ),
        (
            "messages",
            json!([{"role": "user", "content": "hi"}, {"role": "function", "name": "f", "content": "1"}]),
            "messages[1].role",
            format!(
                "unknown role \"function\" {accepted}; the deprecated `function` role is not supported: send tool \
                 results as `tool`"
            ),
        ),
        (
            "messages",
            user(json!([{"type": "text", "text": "what is it?"},
                        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}])),
            "messages[0].content[1].type",
            "image inputs are not supported: this model reads text only (a part of type \"image_url\")".into(),
        ),
        (
            "tools",
            json!([f("get"), f("get")]),
            "tools[1].function.name",
            "duplicate function name \"get\": `tools[0]` has it too (tool names must be unique)".into(),
        ),
        (
            "tool_choice",
            json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [f("get")]}}),
            "tool_choice.type",
            "`tool_choice` of type \"allowed_tools\" is not supported; an object `tool_choice` must be \
             {\"type\": \"function\", \"function\": {\"name\": …}} (or send \"none\", \"auto\" or \"required\")"
                .into(),
        ),
    ] {
        let mut b = chat_body("hi", 2);
        b[field] = v;
        if field == "tool_choice" {
            b["tools"] = json!([f("get")]);
        }
        let (kind, p, _, m) = s.post("/v1/chat/completions", &b).await.error(400);
        assert_eq!(kind, "invalid_request_error");
        assert_eq!((p.as_deref(), m), (Some(param), message));
    }
    let b = json!({"prompt": "x", "max_tokens": 2, "best_of": 2});
    let (_, p, _, m) = s.post("/v1/completions", &b).await.error(400);
    assert_eq!(p.as_deref(), Some("best_of"));
    assert_eq!(
        m,
        "`best_of`: only 1 is supported (no server-side best-of selection); use `n` for several sequences; got 2"
    );
    // each of these 400s counted
    assert_eq!(s.metric("backburner_bad_requests_total").await, 6.0);
}
