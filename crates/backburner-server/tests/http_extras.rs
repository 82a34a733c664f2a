//! `GET /v1/models/{id}`, and llama-server's `/tokenize`, `/detokenize` and `/props`, on the real engine.

use crate::common;

use common::*;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_by_id_tokenize_detokenize_and_props() {
    let s = Server::engine(Setup::default()).await;
    let m = s.get(&format!("/v1/models/{MODEL_ID}")).await.ok();
    assert_eq!(m["id"], MODEL_ID);
    assert_eq!(m["object"], "model");
    assert_eq!(m["meta"], s.get("/v1/models").await.ok()["data"][0]["meta"]);
    let (_, p, code, _) = s.get("/v1/models/gpt-9").await.error(404);
    assert_eq!(
        (p.as_deref(), code.as_deref()),
        (Some("model"), Some("model_not_found"))
    );

    let text = "Hello slow cables<|im_end|> é";
    let want = tokenizer().encode(text).unwrap();
    let r = s.post("/tokenize", &json!({"content": text})).await.ok();
    assert_eq!(r["tokens"], json!(want));
    let r = s
        .post("/tokenize", &json!({"content": text, "with_pieces": true}))
        .await
        .ok();
    let pieces = r["tokens"].as_array().unwrap();
    assert_eq!(pieces.len(), want.len());
    let mut joined = Vec::new();
    for (p, &id) in pieces.iter().zip(&want) {
        assert_eq!(p["id"], id);
        match &p["piece"] {
            Value::String(s) => joined.extend_from_slice(s.as_bytes()),
            Value::Array(b) => joined.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
            other => panic!("{other}"),
        }
    }
    assert_eq!(joined, text.as_bytes());
    let r = s.post("/detokenize", &json!({"tokens": want})).await.ok();
    assert_eq!(r["content"], text);
    for bad in [
        json!({"tokens": [1, 99999]}),
        json!({"tokens": "x"}),
        json!({}),
    ] {
        let (_, p, _, _) = s.post("/detokenize", &bad).await.error(400);
        assert_eq!(p.as_deref(), Some("tokens"));
    }
    let (_, p, _, _) = s.post("/tokenize", &json!({"content": 5})).await.error(400);
    assert_eq!(p.as_deref(), Some("content"));
    // an unknown field, as /tokenize answers it
    let bad = json!({"tokens": [1], "with_pieces": true});
    let (_, p, _, m) = s.post("/detokenize", &bad).await.error(400);
    assert_eq!(
        (p.as_deref(), m.as_str()),
        (
            Some("with_pieces"),
            "unrecognized field `with_pieces` (known: tokens)"
        )
    );
    // every 400 of these endpoints counted
    assert_eq!(s.metric("backburner_bad_requests_total").await, 5.0);

    let p = s.get("/props").await.ok();
    assert_eq!(p["total_slots"], 1);
    assert_eq!(
        p["default_generation_settings"]["n_ctx"],
        s.state.context_length
    );
    assert!(p["chat_template"]
        .as_str()
        .unwrap()
        .contains("<|im_start|>"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_them() {
    let mut s = Server::engine(Setup {
        api_key: Some("k"),
        ..Setup::default()
    })
    .await;
    s.key = None;
    for path in [&format!("/v1/models/{MODEL_ID}")[..], "/props"] {
        assert_eq!(
            s.get(path).await.error(401).2.as_deref(),
            Some("invalid_api_key")
        );
    }
    for path in ["/tokenize", "/detokenize"] {
        let r = s.post(path, &json!({"content": "x", "tokens": [1]})).await;
        assert_eq!(r.error(401).2.as_deref(), Some("invalid_api_key"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_headers_only_for_the_allowed_origins() {
    let ctx = model().config().max_position_embeddings;
    let mut st = state(engine(1, 4, None), ctx, None);
    st.cors_origins = vec!["http://localhost:3000".into()];
    let s = Server::start(st, std::time::Duration::from_secs(1)).await;
    let acao = |r: &reqwest::Response| {
        r.headers()
            .get("access-control-allow-origin")
            .map(|v| v.to_str().unwrap().to_string())
    };
    // the preflight of a page's POST with an API key
    let r = s
        .client
        .request(reqwest::Method::OPTIONS, s.url("/v1/chat/completions"))
        .header("Origin", "http://localhost:3000")
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization, content-type",
        )
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(acao(&r).as_deref(), Some("http://localhost:3000"));
    let allowed = r.headers()["access-control-allow-headers"]
        .to_str()
        .unwrap()
        .to_lowercase();
    assert!(
        allowed.contains("authorization") && allowed.contains("content-type"),
        "{allowed}"
    );
    for (origin, want) in [
        ("http://localhost:3000", Some("http://localhost:3000")),
        ("http://evil.example", None),
    ] {
        let r = s
            .client
            .get(s.url("/v1/models"))
            .header("Origin", origin)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(acao(&r).as_deref(), want, "{origin}");
    }
    // without --cors-origin: no CORS headers at all
    let plain = Server::engine(Setup::default()).await;
    let r = plain
        .client
        .get(plain.url("/v1/models"))
        .header("Origin", "http://localhost:3000")
        .send()
        .await
        .unwrap();
    assert_eq!(acao(&r), None);
}

/// Fields nobody honours are 400s naming them, inside a chat request's messages and tools too, and in `/tokenize`;
/// `add_special` is accepted either way (no BOS for this family) and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_nested_fields_and_tokenize_options_are_named() {
    let s = Server::engine(Setup::default()).await;
    let chat = |messages: Value, extra: Value| {
        let mut b = json!({"messages": messages, "max_tokens": 2, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (body, want) in [
        (
            chat(json!([{"role": "user", "contnet": "hi"}]), json!({})),
            "messages[0].contnet",
        ),
        (
            chat(
                json!([{"role": "user", "content": "hi"}]),
                json!({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]}),
            ),
            "tools[0].function.paramters",
        ),
    ] {
        let (_, param, _, msg) = s.post("/v1/chat/completions", &body).await.error(400);
        assert_eq!(param.as_deref(), Some(want), "{msg}");
    }
    // an answer appended to the history as the SDK dumps it is fine
    let echoed = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo", "refusal": null, "annotations": [], "audio": null,
         "function_call": null, "tool_calls": null},
        {"role": "user", "content": "again"}]);
    s.post("/v1/chat/completions", &chat(echoed, json!({})))
        .await
        .ok();

    let text = "hi<|im_end|>";
    let want = json!({"tokens": tokenizer().encode(text).unwrap()});
    for extra in [
        json!({}),
        json!({"add_special": true}),
        json!({"add_special": false, "parse_special": true}),
    ] {
        let mut b = json!({"content": text});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        assert_eq!(s.post("/tokenize", &b).await.ok(), want);
    }
    for (b, want) in [
        (
            json!({"content": text, "parse_special": false}),
            "parse_special",
        ),
        (json!({"content": text, "with_piece": true}), "with_piece"),
    ] {
        let (_, param, _, _) = s.post("/tokenize", &b).await.error(400);
        assert_eq!(param.as_deref(), Some(want));
    }
    s.stop().await;
}
