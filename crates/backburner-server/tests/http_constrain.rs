//! Constrained output through the HTTP server on the real engine: `response_format` (`json_schema`, as the SDK's
//! `parse()` sends it for a pydantic model; `json_object`), llama-server's `json_schema` and `grammar` (GBNF), each
//! request its own constraint in concurrent slots, and 400s naming the field for what cannot be compiled.

use crate::common;

use common::*;
use serde_json::{json, Value};

/// The schema pydantic writes for `class Person(BaseModel): name: str = Field(max_length=6); age: int = Field(ge=0,
/// le=120); kind: Literal["cat", "dog"]`, with OpenAI's strict additions (`additionalProperties: false`).
fn person() -> Value {
    json!({
        "properties": {
            "name": {"maxLength": 6, "title": "Name", "type": "string"},
            "age": {"maximum": 120, "minimum": 0, "title": "Age", "type": "integer"},
            "kind": {"enum": ["cat", "dog"], "title": "Kind", "type": "string"}
        },
        "required": ["name", "age", "kind"],
        "title": "Person",
        "type": "object",
        "additionalProperties": false
    })
}

fn assert_person(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
    let o = v.as_object().unwrap();
    assert_eq!(o.len(), 3, "{v}");
    assert!(o["name"].as_str().unwrap().chars().count() <= 6);
    assert!((0..=120).contains(&o["age"].as_i64().unwrap()));
    assert!(o["kind"] == "cat" || o["kind"] == "dog");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn response_format_json_schema_whole_and_streamed_as_parse_sends_it() {
    let s = Server::engine(Setup::default()).await;
    let body = json!({
        "messages": [{"role": "user", "content": "Describe a pet owner."}],
        "max_tokens": 200, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": false},
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "Person", "schema": person(), "strict": true}}
    });
    let r = s.post("/v1/chat/completions", &body).await.ok();
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "stop");
    let content = c["message"]["content"].as_str().unwrap().to_string();
    assert_person(&content);

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = s.stream("/v1/chat/completions", &sb).await;
    assert_eq!(st.delta_text("content"), content);
    assert_eq!(st.finish_reasons(), ["stop"]);

    // the same request unconstrained is not JSON
    let mut free = body.clone();
    free.as_object_mut().unwrap().remove("response_format");
    let r = s.post("/v1/chat/completions", &free).await.ok();
    let text = r["choices"][0]["message"]["content"].as_str().unwrap_or("");
    assert!(serde_json::from_str::<Value>(text).is_err(), "{text:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llama_server_grammar_and_json_schema_on_completions() {
    let s = Server::engine(Setup::default()).await;
    let gbnf = "root ::= answer \"!\" [0-9]\nanswer ::= \"yes\" | \"no\"\n";
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": "Is it?", "max_tokens": 20, "temperature": 0, "grammar": gbnf}),
        )
        .await
        .ok();
    let t = r["choices"][0]["text"].as_str().unwrap();
    let (w, d) = t.split_once('!').unwrap();
    assert!(w == "yes" || w == "no", "{t:?}");
    assert!(
        d.len() == 1 && d.chars().all(|c| c.is_ascii_digit()),
        "{t:?}"
    );
    assert_eq!(r["choices"][0]["finish_reason"], "stop");

    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": "A person:", "max_tokens": 200, "temperature": 0.8, "seed": 5,
                    "json_schema": person()}),
        )
        .await
        .ok();
    assert_person(r["choices"][0]["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_slots_each_keep_their_own_constraint() {
    let s = Server::engine(Setup {
        slots: 2,
        ..Setup::default()
    })
    .await;
    let a = json!({"prompt": "Is it?", "max_tokens": 20, "temperature": 0,
                   "grammar": "root ::= (\"yes\" | \"no\") \".\""});
    let b = json!({"prompt": "A person:", "max_tokens": 200, "temperature": 0, "json_schema": person()});
    let (ra, rb) = tokio::join!(s.post("/v1/completions", &a), s.post("/v1/completions", &b));
    let ta = ra.ok()["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(ta == "yes." || ta == "no.", "{ta:?}");
    assert_person(rb.ok()["choices"][0]["text"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_cannot_be_compiled_is_a_400_naming_the_field() {
    let s = Server::engine(Setup::default()).await;
    let chat = |k: &str, v: Value| {
        let mut b = chat_body("hi", 4);
        b[k] = v;
        b
    };
    let cases = [
        (
            chat(
                "response_format",
                json!({"type": "json_schema", "json_schema": {"name": "x",
            "schema": {"type": "no-such-type"}}}),
            ),
            "response_format",
        ),
        (
            chat("response_format", json!({"type": "xml"})),
            "response_format",
        ),
        (
            chat("response_format", json!({"type": "json_schema"})),
            "response_format",
        ),
        (chat("response_format", json!("json")), "response_format"),
        (chat("grammar", json!("root ::= \"a")), "grammar"),
        (chat("grammar", json!("start: (")), "grammar"),
        (chat("json_schema", json!({"type": 5})), "json_schema"),
    ];
    for (body, field) in cases {
        let r = s.post("/v1/chat/completions", &body).await;
        let (_, param, _, msg) = r.error(400);
        assert_eq!(param.as_deref(), Some(field), "{msg}");
    }
    // two constraints at once
    let mut b = chat("grammar", json!("root ::= \"a\""));
    b["response_format"] = json!({"type": "json_object"});
    let (_, param, _, msg) = s.post("/v1/chat/completions", &b).await.error(400);
    assert_eq!(param.as_deref(), Some("grammar"), "{msg}");
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "set_alarm", "parameters": {"type": "object",
            "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                           "loud": {"type": "boolean"},
                           "day": {"type": "string", "enum": ["mon", "tue"]}},
            "required": ["hour", "loud", "day"]}}},
        {"type": "function", "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}}}
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_required_or_named_is_enforced_with_typed_arguments() {
    let s = Server::engine(Setup::default()).await;
    let body = |choice: Value| {
        json!({"messages": [{"role": "user", "content": "Wake me up."}], "tools": tools(),
               "tool_choice": choice, "max_tokens": 120, "temperature": 0,
               "chat_template_kwargs": {"enable_thinking": false}})
    };
    // named: exactly that function, every required parameter typed by its schema
    let r = s
        .post(
            "/v1/chat/completions",
            &body(json!({"type": "function", "function": {"name": "set_alarm"}})),
        )
        .await
        .ok();
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{r}");
    let calls = c["message"]["tool_calls"].as_array().unwrap();
    assert!(!calls.is_empty());
    for call in calls {
        assert_eq!(call["function"]["name"], "set_alarm");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!((0..=23).contains(&args["hour"].as_i64().unwrap()), "{args}");
        assert!(args["loud"].is_boolean(), "{args}");
        assert!(args["day"] == "mon" || args["day"] == "tue", "{args}");
    }
    // required: some tool is called; the free answer (auto) calls none
    let r = s
        .post("/v1/chat/completions", &body(json!("required")))
        .await
        .ok();
    assert_eq!(r["choices"][0]["finish_reason"], "tool_calls", "{r}");
    let r = s
        .post("/v1/chat/completions", &body(json!("auto")))
        .await
        .ok();
    assert!(
        r["choices"][0]["message"].get("tool_calls").is_none(),
        "{r}"
    );
    // a name that is not a tool, or no tools
    let (_, p, _, m) = s
        .post(
            "/v1/chat/completions",
            &body(json!({"type": "function", "function": {"name": "nope"}})),
        )
        .await
        .error(400);
    assert_eq!(p.as_deref(), Some("tool_choice"), "{m}");
    let mut b = body(json!("required"));
    b.as_object_mut().unwrap().remove("tools");
    let (_, p, _, m) = s.post("/v1/chat/completions", &b).await.error(400);
    assert_eq!(p.as_deref(), Some("tool_choice"), "{m}");
}

/// An adversarial trial's findings: deep grammars crashed the server (stack overflow while compiling), grammars
/// that cannot produce anything were 500s, keys inside `response_format` were ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deep_unproductive_oversized_and_misspelled_constraints() {
    let s = Server::engine(Setup::default()).await;
    let cmpl = |k: &str, v: Value| {
        let mut b = json!({"prompt": "go", "max_tokens": 4, "temperature": 0});
        b[k] = v;
        b
    };
    // 2,000 chained GBNF rules (~30 KB) and a 1,000-deep `$ref` chain compile and run
    let mut chain = String::from("root ::= r0\n");
    for i in 0..2000 {
        chain.push_str(&format!("r{i} ::= r{}\n", i + 1));
    }
    chain.push_str("r2000 ::= \"y\"\n");
    let r = s
        .post("/v1/completions", &cmpl("grammar", json!(chain)))
        .await
        .ok();
    assert_eq!(r["choices"][0]["text"], "y");
    let mut defs = serde_json::Map::new();
    for i in 0..1000 {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert("d1000".into(), json!({"type": "boolean"}));
    let schema = json!({"$defs": defs, "$ref": "#/$defs/d0"});
    let r = s
        .post("/v1/completions", &cmpl("json_schema", schema))
        .await
        .ok();
    let t = r["choices"][0]["text"].as_str().unwrap();
    assert!(t == "true" || t == "false", "{t:?}");
    // unproductive, oversized, malformed: 400s naming the field; the server stays up
    let big = format!("root ::= \"{}\"", "a".repeat(130 << 10));
    let cycle = json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"});
    for (k, v) in [
        ("grammar", json!("root ::= root")),
        ("grammar", json!("root ::= a\na ::= b\nb ::= a")),
        ("grammar", json!(big)),
        ("json_schema", cycle),
        (
            "response_format",
            json!({"type": "json_object", "extra": 1}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
        ),
        (
            "response_format",
            json!({"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}),
        ),
        ("stream_options", json!({"include_usage": true, "bogus": 1})),
        ("repetition_penalty", json!(1e-39)),
    ] {
        let r = s.post("/v1/completions", &cmpl(k, v.clone())).await;
        let (_, p, _, m) = r.error(400);
        assert_eq!(p.as_deref(), Some(k), "{k}={v}: {m}");
        assert!(!m.contains("backtrace") && m.len() < 600, "{m}");
    }
    // llama-server's `{"type": "json_object", "schema": …}` is a schema; `response_format` on completions
    let r = s
        .post(
            "/v1/completions",
            &cmpl(
                "response_format",
                json!({"type": "json_object", "schema": {"enum": [7]}}),
            ),
        )
        .await
        .ok();
    assert_eq!(r["choices"][0]["text"], "7");
    s.get("/health").await.ok();
}

/// A newcomer's finding: with `strict: true`, a schema that does not say `additionalProperties` let the model add
/// keys; strict (and llama-server's `json_schema`) now close objects to their `properties`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_schemas_hold_only_their_properties() {
    let s = Server::engine(Setup::default()).await;
    let schema =
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]});
    for seed in 1..4 {
        let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 48, "seed": seed,
            "chat_template_kwargs": {"enable_thinking": false},
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "strict": true, "schema": schema}}});
        let r = s.post("/v1/chat/completions", &body).await.ok();
        let v: Value =
            serde_json::from_str(r["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
        assert!(v["ok"].is_boolean());
        let r = s
            .post(
                "/v1/completions",
                &json!({"prompt": "x", "max_tokens": 48, "seed": seed, "json_schema": schema}),
            )
            .await
            .ok();
        let v: Value = serde_json::from_str(r["choices"][0]["text"].as_str().unwrap()).unwrap();
        assert_eq!(v.as_object().unwrap().len(), 1, "{v}");
    }
}
