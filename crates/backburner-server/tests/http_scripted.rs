//! How the server presents given outputs: a scripted backend answers each job with fixed text pieces (split at
//! awkward places, inside `</think>` and `<tool_call>`), and the chat endpoint must split them into
//! `reasoning_content`, `content` and `tool_calls`, streamed or not, and never fail on malformed tool output.

use crate::common;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backburner_engine::serve::{EngineClient, Event, EventSink, Job, Metrics, SubmitError};
use backburner_engine::EngineError;
use backburner_engine::{Generation, StopReason, Timings, TokenLogprob};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// One scripted answer.
#[derive(Clone, Debug)]
struct Script {
    /// Sent as `Token` events, one per piece.
    pieces: Vec<&'static str>,
    /// Sent as `Done`'s `text` (held back until the end, as stop strings are), after an empty `Token`.
    tail: &'static str,
    end: StopReason,
    /// After `Started`, the job fails before any token (`Event::Failed`, a lost layer-split worker) instead.
    lost: bool,
}

impl From<Vec<&'static str>> for Script {
    fn from(pieces: Vec<&'static str>) -> Self {
        Script {
            pieces,
            tail: "",
            end: StopReason::Eos,
            lost: false,
        }
    }
}

impl Script {
    /// `pieces`, then a failed step (`StopReason::Error`).
    fn failing(pieces: Vec<&'static str>) -> Self {
        Script {
            end: StopReason::Error,
            ..pieces.into()
        }
    }

    /// A job that fails after `Started`, before any token, as one whose layer-split worker is lost.
    fn lost() -> Self {
        Script {
            lost: true,
            ..Vec::new().into()
        }
    }
}

/// Answers each job with the next script: `Started`, a `Token` per piece, `Done` with the whole text; each of its
/// siblings (`n` > 1) with the script after, on threads of their own.
#[derive(Default)]
struct Scripted {
    scripts: Mutex<VecDeque<Script>>,
    /// The prompts received, decoded.
    prompts: Mutex<Vec<String>>,
    metrics: Metrics,
    /// Set by `shutdown`: jobs are refused.
    stopping: AtomicBool,
    /// `shutdown` returns once this receives (or is dropped): the test holds the server in its shutdown.
    gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
}

impl Scripted {
    /// Scripts for the next jobs, in order.
    fn new(scripts: Vec<Script>) -> Self {
        Scripted {
            scripts: Mutex::new(scripts.into()),
            ..Scripted::default()
        }
    }
}

impl EngineClient for Scripted {
    fn submit(&self, job: Job) -> Result<(), SubmitError> {
        if self.stopping.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let mut scripts = self.scripts.lock().unwrap();
        let mut next = || scripts.pop_front().expect("a script for each choice");
        self.prompts
            .lock()
            .unwrap()
            .push(tokenizer().decode(&job.prompt).unwrap());
        let (n, asked) = (job.prompt.len(), job.params.logprobs);
        let first = (job.events, next());
        let siblings: Vec<(EventSink, Script)> =
            job.siblings.into_iter().map(|s| (s, next())).collect();
        for (events, script) in std::iter::once(first).chain(siblings) {
            std::thread::spawn(move || play(events, script, n, asked));
        }
        Ok(())
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn slots(&self) -> usize {
        1
    }

    fn shutdown(&self, _grace: Duration) {
        self.stopping.store(true, Ordering::Relaxed);
        if let Some(gate) = self.gate.lock().unwrap().take() {
            let _ = gate.recv_timeout(LIMIT);
        }
    }
}

/// One choice's script on its sink (`prompt_tokens` in the prompt; `asked` log-probabilities per token).
fn play(mut events: EventSink, script: Script, prompt_tokens: usize, asked: Option<usize>) {
    let started = Event::Started {
        slot: 0,
        prompt_tokens,
        cached_tokens: 0,
        queue_ms: 0.0,
    };
    if !events(started) {
        return;
    }
    if script.lost {
        events(Event::Failed(EngineError::WorkerUnavailable {
            addr: "127.0.0.1:1".into(),
            layers: "1..2".into(),
            reason: "connection refused".into(),
        }));
        return;
    }
    let mut n = 0;
    let mut lps = Vec::new();
    for p in &script.pieces {
        let logprob = asked.map(|k| scripted_logprob(n, k));
        lps.extend(logprob.clone());
        let t = Event::Token {
            id: n,
            text: (*p).to_string(),
            logprob,
        };
        n += 1;
        if !events(t) {
            return;
        }
    }
    if !script.tail.is_empty() {
        let logprob = asked.map(|k| scripted_logprob(n, k));
        lps.extend(logprob.clone());
        let t = Event::Token {
            id: n,
            text: String::new(),
            logprob,
        };
        n += 1;
        if !events(t) {
            return;
        }
    }
    let generation = Generation {
        tokens: (0..n).collect(),
        text: script.pieces.concat() + script.tail,
        stop_reason: script.end,
        timings: Timings::default(),
        step_logits: Vec::new(),
        error: (script.end == StopReason::Error).then(|| "the scripted step failed".into()),
        logprobs: lps,
        speculative: None,
    };
    events(Event::Done {
        generation: Box::new(generation),
        text: script.tail.to_string(),
    });
}

/// The scripted log-probabilities of the `n`th token (id `n`): `-n / 4`, and `k` alternatives `n, n + 1, …` at
/// `-(n + j) / 4`.
fn scripted_logprob(n: u32, k: usize) -> TokenLogprob {
    let lp = |i: u32| -(i as f32) / 4.0;
    TokenLogprob {
        id: n,
        logprob: lp(n),
        top: (0..k as u32).map(|j| (n + j, lp(n + j))).collect(),
    }
}

/// A server over `scripts` (each used once, in order); returns it and the backend.
async fn scripted(scripts: Vec<impl Into<Script>>) -> (Server, Arc<Scripted>) {
    let b = Arc::new(Scripted::new(scripts.into_iter().map(Into::into).collect()));
    let st = state(b.clone(), 4096, None);
    (Server::start(st, Duration::from_secs(1)).await, b)
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather.",
         "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "run_code",
         "parameters": {"type": "object", "properties": {
            "code": {"type": "string"}, "opts": {"type": "object"}}}}}
    ])
}

/// Reasoning, content and two tool calls; the city `1234` is a string by the tool's schema.
const TOOL_PIECES: [&str; 10] = [
    "Let me th",
    "ink.\nI need the weather.\n\n</th",
    "ink>\n\nI'll check both.\n\n<tool",
    "_call>\n<function=get_",
    "weather>\n<parameter=city>\n12",
    "34\n</parameter>\n<parameter=days>\n3\n</para",
    "meter>\n</function>\n</tool_call>\n<tool_call>\n<function=run_code>\n<parameter=code>\nprint(1)\n",
    "print(2)\n</parameter>\n<parameter=opts>\n{\"fast\": true, \"n\": [1, 2.5, null]}\n</parameter>\n",
    "</function>\n</tool_",
    "call>",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_content_and_two_tool_calls_whole_and_streamed() {
    let (s, b) = scripted(vec![TOOL_PIECES.to_vec(), TOOL_PIECES.to_vec()]).await;
    let body = json!({"messages": [{"role": "user", "content": "Weather in 1234, and run code."}],
                      "tools": tools(), "max_tokens": 100});
    let r = s.post("/v1/chat/completions", &body).await.ok();
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls");
    let m = &c["message"];
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["reasoning_content"], "Let me think.\nI need the weather.");
    assert_eq!(m["content"], "I'll check both.");
    let calls = m["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    let ids: Vec<&str> = calls.iter().map(|t| t["id"].as_str().unwrap()).collect();
    let req = r["id"].as_str().unwrap().trim_start_matches("chatcmpl-");
    assert_eq!(ids, [format!("call_{req}_0"), format!("call_{req}_1")]);
    assert_eq!(
        calls[0],
        json!({"id": ids[0], "type": "function",
               "function": {"name": "get_weather", "arguments": r#"{"city":"1234","days":3}"#}})
    );
    assert_eq!(calls[1]["type"], "function");
    assert_eq!(calls[1]["function"]["name"], "run_code");
    let args: Value =
        serde_json::from_str(calls[1]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(
        args,
        json!({"code": "print(1)\nprint(2)", "opts": {"fast": true, "n": [1, 2.5, null]}})
    );
    assert_eq!(r["usage"]["completion_tokens"], TOOL_PIECES.len());
    // the prompt rendered the tools and opened a thinking block
    let prompt = b.prompts.lock().unwrap()[0].clone();
    assert!(prompt.contains("get_weather") && prompt.contains("run_code"));
    assert!(
        prompt.ends_with("<|im_start|>assistant\n<think>\n"),
        "{prompt:?}"
    );

    // streamed: the same, in deltas
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = s.stream("/v1/chat/completions", &sb).await;
    assert!(st.done);
    assert_eq!(
        st.chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(
        st.delta_text("reasoning_content"),
        "Let me think.\nI need the weather."
    );
    assert_eq!(st.delta_text("content"), "I'll check both.");
    // the reasoning came before the content, and before the whole text was out
    let first_content = st
        .choices()
        .position(|c| {
            c["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .unwrap();
    let choices: Vec<&Value> = st.choices().collect();
    let last_reasoning = choices
        .iter()
        .rposition(|c| c["delta"].get("reasoning_content").is_some())
        .unwrap();
    assert!(last_reasoning < first_content);
    assert!(
        st.choices()
            .filter(|c| c["delta"].get("reasoning_content").is_some())
            .count()
            >= 2
    );
    let deltas: Vec<&Value> = st
        .choices()
        .filter_map(|c| c["delta"].get("tool_calls"))
        .collect();
    assert_eq!(deltas.len(), 2, "one chunk per complete call");
    for (i, d) in deltas.iter().enumerate() {
        let d = d.as_array().unwrap();
        assert_eq!(d.len(), 1);
        let t = &d[0];
        assert_eq!(t["index"], i);
        assert_eq!(t["type"], "function");
        // unique across requests too
        let req = st.chunks[0]["id"]
            .as_str()
            .unwrap()
            .trim_start_matches("chatcmpl-");
        assert_eq!(t["id"], format!("call_{req}_{i}"));
        assert_ne!(t["id"], calls[i]["id"]);
        assert_eq!(t["function"]["name"], calls[i]["function"]["name"]);
        assert_eq!(
            t["function"]["arguments"],
            calls[i]["function"]["arguments"]
        );
    }
    assert_eq!(st.finish_reasons(), ["tool_calls"]);
    assert_eq!(st.chunks.last().unwrap()["choices"][0]["delta"], json!({}));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_tool_output_is_plain_content() {
    let cases: Vec<Vec<&'static str>> = vec![
        vec!["<tool_call>\n<function=x>"],
        vec![
            "Sure.\n<tool",
            "_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>",
        ],
        vec!["<tool_call>gar", "bage</tool_call>"],
        vec!["<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"],
        vec!["Text \n <tool_call>bad</tool_call> more <tool_", "call>"],
        vec!["<tool_"],
    ];
    let mut scripts = Vec::new();
    for c in &cases {
        scripts.push(c.clone());
        scripts.push(c.clone());
    }
    let (s, _) = scripted(scripts).await;
    for c in &cases {
        let text = c.concat();
        let body = json!({"messages": [{"role": "user", "content": "call x"}], "tools": tools(),
                          "chat_template_kwargs": {"enable_thinking": false}});
        let r = s.post("/v1/chat/completions", &body).await.ok();
        let ch = &r["choices"][0];
        assert_eq!(ch["finish_reason"], "stop", "{text:?}");
        assert_eq!(ch["message"]["content"], text.as_str());
        assert!(ch["message"].get("tool_calls").is_none(), "{text:?}");
        assert!(ch["message"].get("reasoning_content").is_none());
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let st = s.stream("/v1/chat/completions", &sb).await;
        assert!(st.done);
        assert_eq!(st.delta_text("content"), text, "{text:?}");
        assert!(st.choices().all(|c| c["delta"].get("tool_calls").is_none()));
        assert_eq!(st.finish_reasons(), ["stop"]);
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thinking_off_gives_no_reasoning_and_thinking_on_splits_it() {
    let answer = vec!["Just the ", "answer."];
    let thought = vec!["hmm\n</thi", "nk>\n\nYes."];
    let (s, b) = scripted(vec![
        answer.clone(),
        answer.clone(),
        thought.clone(),
        thought.clone(),
    ])
    .await;
    let off = json!({"messages": [{"role": "user", "content": "q"}],
                     "chat_template_kwargs": {"enable_thinking": false}});
    let r = s.post("/v1/chat/completions", &off).await.ok();
    assert_eq!(
        r["choices"][0]["message"],
        json!({"role": "assistant", "content": "Just the answer."})
    );
    let mut so = off.clone();
    so["stream"] = json!(true);
    let st = s.stream("/v1/chat/completions", &so).await;
    assert_eq!(st.delta_text("content"), "Just the answer.");
    assert!(st
        .choices()
        .all(|c| c["delta"].get("reasoning_content").is_none()));
    let on = json!({"messages": [{"role": "user", "content": "q"}]});
    let r = s.post("/v1/chat/completions", &on).await.ok();
    assert_eq!(
        r["choices"][0]["message"],
        json!({"role": "assistant", "content": "Yes.", "reasoning_content": "hmm"})
    );
    let mut so = on.clone();
    so["stream"] = json!(true);
    let st = s.stream("/v1/chat/completions", &so).await;
    assert_eq!(st.delta_text("reasoning_content"), "hmm");
    assert_eq!(st.delta_text("content"), "Yes.");
    assert_eq!(st.finish_reasons(), ["stop"]);
    let prompts = b.prompts.lock().unwrap().clone();
    assert!(prompts[0].ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
    assert!(prompts[2].ends_with("<|im_start|>assistant\n<think>\n"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_choice_none_hides_the_tools() {
    let call = vec!["<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"];
    let (s, b) = scripted(vec![call.clone()]).await;
    let body = json!({"messages": [{"role": "user", "content": "q"}], "tools": tools(),
                      "tool_choice": "none", "chat_template_kwargs": {"enable_thinking": false}});
    let r = s.post("/v1/chat/completions", &body).await.ok();
    assert_eq!(r["object"], "chat.completion");
    // the tools were not rendered
    let prompt = b.prompts.lock().unwrap()[0].clone();
    assert!(!prompt.contains("get_weather"), "{prompt:?}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_shutting_down_health_is_503_and_requests_are_refused() {
    let (release, gate) = std::sync::mpsc::channel();
    let b = Arc::new(Scripted::new(Vec::new()));
    *b.gate.lock().unwrap() = Some(gate);
    let mut s = Server::start(state(b.clone(), 4096, None), Duration::from_secs(1)).await;
    assert_eq!(s.get("/health").await.ok()["status"], "ok");
    s.trigger_shutdown();
    // the engine's shutdown is held open: the server still answers, refusing work
    bounded("/health to say shutting down", async {
        loop {
            let h = s.get("/health").await;
            if h.status == StatusCode::SERVICE_UNAVAILABLE {
                assert_eq!(h.json, json!({"status": "shutting down"}));
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let r = s.post("/v1/chat/completions", &chat_body("hi", 2)).await;
    let (kind, _, code, message) = r.error(503);
    assert_eq!(
        (kind.as_str(), code.as_deref()),
        ("server_error", Some("server_busy"))
    );
    assert!(message.contains("shutting down"), "{message}");
    assert_eq!(r.headers["retry-after"], "1");
    release.send(()).unwrap();
    s.join().await.expect("serve returns Ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_back_tails_ends_and_engine_errors() {
    let tail = |end| Script {
        pieces: vec!["<think>\nhm", "m\n</think>\n\nThe ans"],
        tail: "wer.\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        end,
        lost: false,
    };
    let failed = Script {
        pieces: vec![],
        tail: "",
        end: StopReason::Error,
        lost: false,
    };
    let (s, _) = scripted(vec![
        tail(StopReason::MaxTokens),
        tail(StopReason::MaxTokens),
        tail(StopReason::Error),
        tail(StopReason::Error),
        failed.clone(),
        failed,
    ])
    .await;
    // thinking off, but the output opens its own block; the tail holds the rest of the content and a call
    let body = json!({"messages": [{"role": "user", "content": "q"}],
                      "chat_template_kwargs": {"enable_thinking": false}});
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    for end in ["tool_calls", "error"] {
        let r = s.post("/v1/chat/completions", &body).await.ok();
        let m = &r["choices"][0]["message"];
        assert_eq!(m["reasoning_content"], "hmm");
        assert_eq!(m["content"], "The answer.");
        assert_eq!(m["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(r["choices"][0]["finish_reason"], end);
        assert_eq!(r["usage"]["completion_tokens"], 3);
        // a failure after some tokens says why beside them, as the stream's error event does
        if end == "error" {
            assert_eq!(r["error"]["type"], "server_error");
            let m = r["error"]["message"].as_str().unwrap();
            assert!(m.starts_with("generation failed: "), "{m}");
        } else {
            assert!(r.get("error").is_none(), "{r}");
        }
        let st = s.stream("/v1/chat/completions", &sb).await;
        assert!(st.done);
        // an engine error after some tokens: the finish chunk, the usage, then an error event
        let (errors, chunks): (Vec<Value>, Vec<Value>) = st
            .chunks
            .iter()
            .cloned()
            .partition(|c| c.get("error").is_some());
        if end == "error" {
            assert_eq!(errors.len(), 1);
            assert_eq!(errors[0]["error"]["type"], "server_error");
            assert!(st.chunks.last().unwrap().get("error").is_some());
        } else {
            assert!(errors.is_empty());
        }
        let st = Stream { chunks, done: true };
        assert_eq!(st.delta_text("reasoning_content"), "hmm");
        assert_eq!(st.delta_text("content"), "The answer.");
        let calls: Vec<&Value> = st
            .choices()
            .filter_map(|c| c["delta"].get("tool_calls"))
            .collect();
        assert_eq!(calls.len(), 1);
        assert_eq!(st.finish_reasons(), [end]);
        assert_eq!(st.chunks.last().unwrap()["usage"]["completion_tokens"], 3);
    }
    // an engine error before any token: 500 whole; streamed, an error event and [DONE]
    let r = s.post("/v1/chat/completions", &body).await;
    let (kind, _, _, m) = r.error(500);
    assert_eq!(kind, "server_error");
    assert!(m.contains("the scripted step failed"), "{m}");
    let st = s.stream("/v1/chat/completions", &sb).await;
    assert!(st.done);
    let err = st
        .chunks
        .iter()
        .find(|c| c.get("error").is_some())
        .expect("an error event");
    assert_eq!(err["error"]["type"], "server_error");
    s.stop().await;
}

/// The finish reasons of a stream by choice index, its error events, and its text.
fn by_choice(st: &Stream, n: usize) -> (Vec<Vec<String>>, Vec<Value>, String) {
    let (errors, chunks): (Vec<Value>, Vec<Value>) = st
        .chunks
        .iter()
        .cloned()
        .partition(|c| c.get("error").is_some());
    let st = Stream { chunks, done: true };
    let mut reasons = vec![Vec::new(); n];
    for c in st.choices() {
        if let Some(r) = c["finish_reason"].as_str() {
            reasons[c["index"].as_u64().unwrap() as usize].push(r.to_string());
        }
    }
    (reasons, errors, st.text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_choices_that_fail_are_answered_each_as_one_request_would_be() {
    // per request: choice 0, then choice 1
    let (s, _) = scripted(vec![
        // choice 0 fails after two tokens, choice 1 loses its worker before any: whole, then streamed
        Script::failing(vec!["Hel", "lo"]),
        Script::lost(),
        Script::failing(vec!["Hel", "lo"]),
        Script::lost(),
        // choice 0 finishes, choice 1 loses its worker
        vec!["Fine."].into(),
        Script::lost(),
        // both lose their worker before any token: whole, then streamed
        Script::lost(),
        Script::lost(),
        Script::lost(),
        Script::lost(),
    ])
    .await;
    let body = json!({"prompt": "q", "max_tokens": 10, "n": 2, "temperature": 0});
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});

    // 200 with choice 0's tokens, choice 1 empty, both `error`, and the first failure's error object
    let r = s.post("/v1/completions", &body).await.ok();
    let cs = r["choices"].as_array().unwrap();
    assert_eq!(cs.len(), 2, "{r}");
    assert_eq!(
        (&cs[0]["text"], &cs[0]["finish_reason"]),
        (&json!("Hello"), &json!("error"))
    );
    assert_eq!(
        (&cs[1]["text"], &cs[1]["finish_reason"]),
        (&json!(""), &json!("error"))
    );
    assert_eq!(r["usage"]["completion_tokens"], 2);
    assert_eq!(r["error"]["type"], "server_error");
    assert_eq!(
        r["error"]["message"],
        "generation failed: the scripted step failed"
    );
    // streamed: one finish chunk per choice, the usage, one error event, [DONE]
    let st = s.stream("/v1/completions", &sb).await;
    assert!(st.done);
    let (reasons, errors, text) = by_choice(&st, 2);
    assert_eq!(reasons, [["error"], ["error"]]);
    assert_eq!(text, "Hello");
    assert_eq!(errors.len(), 1, "{:?}", st.chunks);
    assert_eq!(
        errors[0]["error"]["message"],
        "generation failed: the scripted step failed"
    );
    let n = st.chunks.len();
    assert!(st.chunks[n - 1].get("error").is_some());
    assert_eq!(st.chunks[n - 2]["usage"]["completion_tokens"], 2);

    // choice 0 fine, choice 1 lost: 200, the lost worker's error beside the answer
    let r = s.post("/v1/completions", &body).await.ok();
    assert_eq!(r["choices"][0]["text"], "Fine.");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    assert_eq!(r["choices"][1]["finish_reason"], "error");
    assert_eq!(r["error"]["code"], "worker_unavailable");

    // nothing generated at all: the status a single request gets (503 worker_unavailable); streamed, each choice
    // still ends with `error` and one error event says why
    let r = s.post("/v1/completions", &body).await;
    let (kind, _, code, _) = r.error(503);
    assert_eq!(
        (kind.as_str(), code.as_deref()),
        ("server_error", Some("worker_unavailable"))
    );
    let st = s.stream("/v1/completions", &sb).await;
    assert!(st.done);
    let (reasons, errors, text) = by_choice(&st, 2);
    assert_eq!(reasons, [["error"], ["error"]]);
    assert_eq!(text, "");
    assert_eq!(errors.len(), 1, "{:?}", st.chunks);
    assert_eq!(errors[0]["error"]["code"], "worker_unavailable");
    assert_eq!(
        st.chunks.last().unwrap()["error"]["code"],
        "worker_unavailable"
    );
    s.stop().await;
}
