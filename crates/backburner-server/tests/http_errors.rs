//! Every error a client can cause, over HTTP: its status and OpenAI's error shape
//! `{"error": {"message", "type", "param", "code"}}` naming the field at fault; the API key.

use crate::common;

use backburner_model::TextTokenizer;
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// A server over the real engine with a 64-token context.
async fn small() -> Server {
    Server::engine(Setup {
        context: Some(64),
        ..Setup::default()
    })
    .await
}

/// Asserts a 400 `invalid_request_error` naming `param` (and `code`).
fn bad_request(r: &Reply, param: Option<&str>, code: Option<&str>) -> String {
    let (kind, p, c, message) = r.error(400);
    assert_eq!(kind, "invalid_request_error", "{}", r.json);
    assert_eq!(p.as_deref(), param, "{}", r.json);
    assert_eq!(c.as_deref(), code, "{}", r.json);
    message
}

fn with(mut body: Value, field: &str, v: Value) -> Value {
    body[field] = v;
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_and_wrong_field_types_are_400s_naming_the_field() {
    let s = small().await;
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let m = bad_request(
            &s.post_bytes(path, b"{\"messages\": [".to_vec()).await,
            None,
            None,
        );
        assert!(m.contains("malformed JSON"), "{m}");
        for body in ["[1, 2]", "\"text\"", "null", "3"] {
            let r = s.post_bytes(path, body.as_bytes().to_vec()).await;
            let m = bad_request(&r, None, None);
            assert!(m.contains("JSON object"), "{m}");
        }
    }
    let chat = chat_body("hi", 4);
    let cases = [
        ("temperature", json!("hot")),
        ("top_p", json!([1])),
        ("messages", json!("x")),
        ("max_tokens", json!(-1)),
        ("max_tokens", json!(0)),
        ("max_tokens", json!(2.5)),
        ("max_completion_tokens", json!("9")),
        ("stop", json!(5)),
        ("stop", json!(["a", 5])),
        ("stream", json!("yes")),
        ("seed", json!("x")),
        ("model", json!(7)),
        ("top_k", json!(-3)),
        ("stream_options", json!(true)),
        ("tools", json!({"type": "function"})),
        ("tool_choice", json!(3)),
        ("chat_template_kwargs", json!([])),
        ("cache_prompt", json!(1)),
        ("n", json!(17)),
        ("n", json!(0)),
    ];
    for (field, v) in cases {
        let r = s
            .post(
                "/v1/chat/completions",
                &with(chat.clone(), field, v.clone()),
            )
            .await;
        let m = bad_request(&r, Some(field), None);
        assert!(
            m.contains(&format!("`{field}`")) || m.contains(field),
            "{field}: {m}"
        );
    }
    let nested = with(
        chat.clone(),
        "stream_options",
        json!({"include_usage": "yes"}),
    );
    bad_request(
        &s.post("/v1/chat/completions", &nested).await,
        Some("stream_options.include_usage"),
        None,
    );
    let empty = with(chat.clone(), "messages", json!([]));
    bad_request(
        &s.post("/v1/chat/completions", &empty).await,
        Some("messages"),
        None,
    );
    let missing = json!({"max_tokens": 4});
    bad_request(
        &s.post("/v1/chat/completions", &missing).await,
        Some("messages"),
        None,
    );
    // completions: the prompt's shapes
    for p in [
        json!(null),
        json!(5),
        json!([1, -2]),
        json!([1, "a"]),
        json!([[1, 2], [3]]),
        json!([[[1, 2]]]),
        json!([["hi"]]),
        json!({"a": 1}),
    ] {
        let body = json!({"prompt": p, "max_tokens": 2});
        bad_request(
            &s.post("/v1/completions", &body).await,
            Some("prompt"),
            None,
        );
    }
    let echo = json!({"prompt": "hi", "echo": true});
    bad_request(&s.post("/v1/completions", &echo).await, Some("echo"), None);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_paths_and_methods_answer_in_the_error_shape() {
    let s = small().await;
    let r = s.get("/v1/nope").await;
    let (kind, _, code, m) = r.error(404);
    assert_eq!(
        (kind.as_str(), code.as_deref()),
        ("invalid_request_error", Some("not_found"))
    );
    let has = "this server has POST /v1/chat/completions, POST /v1/completions, GET /v1/models, \
               GET /v1/models/{id}, POST /tokenize, POST /detokenize, GET /props, GET /slots, GET /health, \
               GET /metrics, GET /";
    assert_eq!(m, format!("no such endpoint: /v1/nope; {has}"));
    // what llama-server's, Ollama's and OpenAI's other endpoints are called here
    for (path, instead) in [
        (
            "/completion",
            "use /v1/completions (or /v1/chat/completions)",
        ),
        (
            "/api/generate",
            "use /v1/completions (or /v1/chat/completions)",
        ),
        ("/api/chat", "use /v1/chat/completions"),
        ("/chat/completions", "use /v1/chat/completions"),
        (
            "/v1/embeddings",
            "embeddings are not served (this server generates text)",
        ),
    ] {
        let r = s.post(path, &json!({"prompt": "x"})).await;
        let (_, _, code, m) = r.error(404);
        assert_eq!(code.as_deref(), Some("not_found"));
        assert_eq!(m, format!("no such endpoint: {path}; {instead}; {has}"));
    }
    // and what it lists is there
    for e in backburner_server::ENDPOINTS {
        let (method, path) = e.split_once(' ').unwrap();
        let url = s.url(&path.replace("{id}", MODEL_ID));
        let r = match method {
            "GET" => s.client.get(url).send().await.unwrap(),
            _ => s.client.post(url).json(&json!({})).send().await.unwrap(),
        };
        assert_ne!(r.status(), reqwest::StatusCode::NOT_FOUND, "{e}");
        assert_ne!(r.status(), reqwest::StatusCode::METHOD_NOT_ALLOWED, "{e}");
    }
    let r = s.get("/v1/chat/completions").await;
    let (_, _, code, _) = r.error(405);
    assert_eq!(code.as_deref(), Some("method_not_allowed"));
    let r = s.post("/v1/models", &json!({})).await;
    assert_eq!(r.error(405).2.as_deref(), Some("method_not_allowed"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_models_long_prompts_bad_sampling_values_and_ids() {
    let s = small().await;
    let r = s
        .post(
            "/v1/chat/completions",
            &with(chat_body("hi", 4), "model", json!("gpt-9")),
        )
        .await;
    let (kind, param, code, m) = r.error(404);
    assert_eq!(
        (kind.as_str(), param.as_deref(), code.as_deref()),
        (
            "invalid_request_error",
            Some("model"),
            Some("model_not_found")
        )
    );
    assert!(m.contains("gpt-9") && m.contains(MODEL_ID), "{m}");
    let r = s
        .post(
            "/v1/completions",
            &json!({"model": "gpt-9", "prompt": "hi"}),
        )
        .await;
    assert_eq!(r.error(404).2.as_deref(), Some("model_not_found"));
    // the model's own name and an empty one are fine
    for m in [MODEL_ID, ""] {
        s.post(
            "/v1/chat/completions",
            &with(chat_body("hi", 2), "model", json!(m)),
        )
        .await
        .ok();
    }
    // a prompt longer than the 64-token context
    let long = "a long prompt that goes on ".repeat(20);
    let r = s.post("/v1/chat/completions", &chat_body(&long, 4)).await;
    bad_request(&r, Some("messages"), Some("context_length_exceeded"));
    let r = s
        .post("/v1/completions", &json!({"prompt": long, "max_tokens": 4}))
        .await;
    bad_request(&r, Some("prompt"), Some("context_length_exceeded"));
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": vec![7u32; 64], "max_tokens": 4}),
        )
        .await;
    bad_request(&r, Some("prompt"), Some("context_length_exceeded"));
    // 63 tokens fit (one is left to generate)
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": vec![7u32; 63], "max_tokens": 4, "temperature": 0}),
        )
        .await
        .ok();
    assert_eq!(r["usage"]["completion_tokens"], 1);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    // sampling values the engine refuses
    for (field, v) in [
        ("temperature", json!(-1)),
        ("top_p", json!(0)),
        ("top_p", json!(1.5)),
        ("min_p", json!(2)),
        ("min_p", json!(-0.1)),
    ] {
        for (path, body) in [
            ("/v1/chat/completions", chat_body("hi", 2)),
            ("/v1/completions", json!({"prompt": "hi", "max_tokens": 2})),
        ] {
            let body = with(body, field, v.clone());
            let m = bad_request(&s.post(path, &body).await, Some(field), None);
            assert!(m.contains(field), "{m}");
        }
    }
    // ids outside the vocabulary (512), and one that is not a u32
    for p in [json!([1, 512]), json!([1, 4294967296u64])] {
        let r = s
            .post("/v1/completions", &json!({"prompt": p, "max_tokens": 2}))
            .await;
        bad_request(&r, Some("prompt"), None);
    }
    let r = s
        .post("/v1/completions", &json!({"prompt": [], "max_tokens": 2}))
        .await;
    bad_request(&r, Some("prompt"), None);
    let r = s
        .post("/v1/completions", &json!({"prompt": "", "max_tokens": 2}))
        .await;
    bad_request(&r, Some("prompt"), None);
    // nothing counted as failed work but the engine's refusals, nothing rejected
    let page = s.get_text("/metrics").await.1;
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"rejected\"}"),
        0.0
    );
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"cancelled\"}"),
        0.0
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_the_template_cannot_take_and_tool_calls_without_content() {
    let s = Server::engine(Setup::default()).await;
    let call = |args: Value| {
        json!({"messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null,
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ], "max_tokens": 2, "temperature": 0})
    };
    for args in [json!("{not json"), json!("[1, 2]"), json!(5)] {
        let r = s.post("/v1/chat/completions", &call(args)).await;
        bad_request(
            &r,
            Some("messages[1].tool_calls[0].function.arguments"),
            None,
        );
    }
    // content null with tool calls renders; arguments as a JSON string or an object
    for args in [
        json!("{\"city\": \"Bern\"}"),
        json!({"city": "Bern"}),
        json!(""),
    ] {
        let r = s.post("/v1/chat/completions", &call(args)).await.ok();
        assert_eq!(r["object"], "chat.completion");
    }
    for (messages, field) in [
        (json!([5]), "messages[0]"),
        (json!([{"content": "hi"}]), "messages[0].role"),
        (
            json!([{"role": "user", "content": 5}]),
            "messages[0].content",
        ),
    ] {
        let r = s
            .post(
                "/v1/chat/completions",
                &json!({"messages": messages, "max_tokens": 2}),
            )
            .await;
        bad_request(&r, Some(field), None);
    }
    // an unknown role, named (not the template's "No user query found in messages.")
    let r = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2}),
        )
        .await;
    bad_request(&r, Some("messages[0].role"), None);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_v1_but_not_health() {
    let mut s = Server::engine(Setup {
        api_key: Some("sekrit"),
        ..Setup::default()
    })
    .await;
    // with the key
    s.post("/v1/chat/completions", &chat_body("hi", 2))
        .await
        .ok();
    s.get("/v1/models").await.ok();
    // without, or with another
    for key in [None, Some("wrong"), Some("sekrit2"), Some("")] {
        s.key = key.map(str::to_string);
        for r in [
            s.post("/v1/chat/completions", &chat_body("hi", 2)).await,
            s.post("/v1/completions", &json!({"prompt": "hi"})).await,
            s.get("/v1/models").await,
        ] {
            let (kind, param, code, _) = r.error(401);
            assert_eq!(
                (kind.as_str(), param, code.as_deref()),
                ("authentication_error", None, Some("invalid_api_key"))
            );
            assert_eq!(r.headers["www-authenticate"], "Bearer");
        }
        // the key is checked before the body is read: a bad body still gets 401
        let r = s.post_bytes("/v1/completions", b"{nope".to_vec()).await;
        r.error(401);
        let h = s.get("/health").await.ok();
        assert_eq!(h["status"], "ok");
    }
    // a key in another scheme
    let r = s
        .client
        .get(s.url("/v1/models"))
        .header("authorization", "Basic sekrit")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    s.key = Some("sekrit".into());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_past_the_limits_are_400s_naming_the_limit() {
    let s = small().await;
    let at_limit: Vec<String> = (0..16).map(|i| format!("{i:0>256}")).collect();
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = if path == "/v1/completions" {
            json!({"prompt": "hi", "max_tokens": 2})
        } else {
            chat_body("hi", 2)
        };
        // 16 strings of 256 bytes are served
        let r = s
            .post(path, &with(body.clone(), "stop", json!(at_limit)))
            .await;
        assert_eq!(r.status, StatusCode::OK, "{}", r.json);
        let cases = [
            (
                json!(vec!["x"; 17]),
                "stop strings: at most 16 non-empty per request, got 17",
            ),
            (
                json!("y".repeat(257)),
                "stop strings: at most 256 bytes each (UTF-8), but string 0 has 257 bytes",
            ),
            (
                json!(["ok", "ü".repeat(129)]),
                "stop strings: at most 256 bytes each (UTF-8), but string 1 has 258 bytes",
            ),
        ];
        for (stop, want) in cases {
            let r = s.post(path, &with(body.clone(), "stop", stop)).await;
            assert_eq!(bad_request(&r, Some("stop"), None), want, "{path}");
        }
    }
    // refused while parsing: counted as 400s, not by the engine
    assert_eq!(s.metric("backburner_bad_requests_total").await, 6.0);
    assert_eq!(
        s.metric("backburner_requests_total{outcome=\"invalid\"}")
            .await,
        0.0
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_without_content_that_the_template_cannot_render_is_a_400_naming_it() {
    // the fixture's own minimal template concatenates `message['content']`, which a null content cannot take
    let model = model();
    let tok = TextTokenizer::from_dir(
        &fixture("tiny-hub"),
        model.config().vocab_size,
        &model.config().eos_token_ids,
    )
    .unwrap()
    .unwrap();
    let tok = std::sync::Arc::new(tok);
    let e = engine_with(1, 8, Some(64), Some(tok.clone()));
    let st = backburner_server::AppState::new(e, Some(tok), MODEL_ID.into(), 64, vec![], None);
    let s = Server::start(st, std::time::Duration::from_secs(5)).await;
    let conversation = |content: Value| {
        json!({"messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": content},
        ], "max_tokens": 2, "temperature": 0})
    };
    let r = s
        .post("/v1/chat/completions", &conversation(json!(null)))
        .await;
    let m = bad_request(&r, Some("messages[1].content"), None);
    assert!(
        m.starts_with(
            "invalid chat request: messages[1].content: the model's chat template cannot render this user \
             message without content (null or absent): "
        ) && m.ends_with("; send a string (\"\" for none)"),
        "{m}"
    );
    // absent is the same; an empty string renders
    let mut absent = conversation(json!(null));
    absent["messages"][1]
        .as_object_mut()
        .unwrap()
        .remove("content");
    let r = s.post("/v1/chat/completions", &absent).await;
    assert_eq!(bad_request(&r, Some("messages[1].content"), None), m);
    let r = s
        .post("/v1/chat/completions", &conversation(json!("")))
        .await;
    assert_eq!(r.ok()["object"], "chat.completion");
    // nothing counted as a server failure
    assert_eq!(
        s.metric("backburner_requests_total{outcome=\"failed\"}")
            .await,
        0.0
    );
    s.stop().await;
}
