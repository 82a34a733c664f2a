//! The HTTP server over the real serving engine on the tiny fixture model, with a real client on an ephemeral port:
//! what is served equals `generate` on a fresh session (streamed or not, alone or 4 at once), the OpenAI shapes of
//! answers and chunks, usage, the prompt cache, a full queue, cancellation on disconnect, metrics, shutdown.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::serve::{common_prefix, Metrics};
use backburner_engine::{Generation, SamplingParams};
use backburner_model::chat::{parse_output, ChatRequest};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Map, Value};

/// The prompt ids of a chat request as the server renders them: `(whole prompt, stable prefix)`.
fn chat_prompt(messages: &Value, kwargs: &Map<String, Value>) -> (Vec<u32>, usize) {
    let tok = tokenizer();
    let msgs = messages.as_array().unwrap();
    let mut req = ChatRequest {
        messages: msgs,
        tools: None,
        add_generation_prompt: true,
        kwargs,
    };
    let ids = tok.encode(&tok.render_chat(&req).unwrap()).unwrap();
    req.add_generation_prompt = false;
    let hist = tok.encode(&tok.render_chat(&req).unwrap()).unwrap();
    let stable = common_prefix(&ids, &hist);
    (ids, stable)
}

/// Greedy `generate` of `prompt` on a fresh session (the server's eos ids, the tokenizer for the text).
fn reference(prompt: &[u32], max_tokens: usize) -> Generation {
    generate_fresh(prompt, max_tokens, SamplingParams::default(), None)
}

/// OpenAI's finish reason of a reference generation.
fn finish(g: &Generation) -> &'static str {
    match g.stop_reason {
        backburner_engine::StopReason::MaxTokens => "length",
        backburner_engine::StopReason::Eos => "stop",
        r => panic!("unexpected stop reason {r:?}"),
    }
}

/// A prompt of `n` ids from a seed (deterministic, inside the tokenizer's 445 ordinary ids).
fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97 + 13) >> 7) % 445)
        .collect()
}

fn opt_str(v: &Value) -> String {
    v.as_str().unwrap_or("").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_whole_and_streamed_equal_generate() {
    let s = Server::engine(Setup::default()).await;
    let body = chat_body("Tell me about slow cables.", 24);
    let (prompt, stable) = chat_prompt(&body["messages"], &Map::new());
    let want = reference(&prompt, 24);
    let parsed = parse_output(&want.text, true, None);

    let r = s.post("/v1/chat/completions", &body).await.ok();
    assert_eq!(r["object"], "chat.completion");
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"), "{r}");
    assert_eq!(r["model"], MODEL_ID);
    assert!(r["created"].as_u64().unwrap() > 0);
    let c = &r["choices"][0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["finish_reason"], finish(&want));
    assert_eq!(c["message"]["role"], "assistant");
    assert_eq!(c["message"]["content"].as_str(), parsed.content.as_deref());
    assert_eq!(
        c["message"]["reasoning_content"].as_str(),
        parsed.reasoning.as_deref()
    );
    assert!(c["message"].get("tool_calls").is_none());
    let n = want.tokens.len();
    assert_eq!(
        r["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": n, "total_tokens": prompt.len() + n,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );

    // streamed, with usage: the same answer in deltas
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let st = s.stream("/v1/chat/completions", &sb).await;
    assert!(st.done, "data: [DONE] ends the stream");
    let id = st.chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-") && id != r["id"].as_str().unwrap());
    for ch in &st.chunks {
        assert_eq!(ch["object"], "chat.completion.chunk", "{ch}");
        assert_eq!(ch["id"], id);
        assert_eq!(ch["model"], MODEL_ID);
    }
    assert_eq!(st.chunks[0]["choices"][0]["delta"]["role"], "assistant");
    // every chunk but the usage one carries usage null (include_usage)
    let (usage_chunk, rest) = st.chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    for ch in rest {
        assert!(ch["usage"].is_null(), "{ch}");
        assert_eq!(ch["choices"].as_array().unwrap().len(), 1);
    }
    let last = &rest.last().unwrap()["choices"][0];
    assert_eq!(last["finish_reason"], finish(&want));
    assert_eq!(
        st.finish_reasons(),
        [finish(&want)],
        "only the last has one"
    );
    assert_eq!(
        st.delta_text("content"),
        parsed.content.clone().unwrap_or_default()
    );
    assert_eq!(
        st.delta_text("reasoning_content"),
        parsed.reasoning.clone().unwrap_or_default()
    );
    assert_eq!(st.delta_text("content"), opt_str(&c["message"]["content"]));
    // the same chat again reuses the last exact checkpoint before its last token
    let cached = exact_reuse(&prompt, &prompt);
    assert!(cached >= stable - stable % UBATCH && cached > 0);
    assert_eq!(
        usage_chunk["usage"],
        json!({"prompt_tokens": prompt.len(), "completion_tokens": n, "total_tokens": prompt.len() + n,
               "prompt_tokens_details": {"cached_tokens": cached}})
    );
    assert!(stable > 0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_finish_counts_max_tokens_and_streams_without_usage() {
    let s = Server::engine(Setup::default()).await;
    // a prompt whose greedy answer does not reach an eos within 12 tokens
    let body = chat_body("Count to five.", 12);
    let (prompt, _) = chat_prompt(&body["messages"], &Map::new());
    let want = reference(&prompt, 12);
    assert_eq!(
        finish(&want),
        "length",
        "the fixture's answer runs to max_tokens"
    );
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = s.stream("/v1/chat/completions", &sb).await;
    assert!(st.done);
    // without include_usage: no usage key, no usage chunk
    for ch in &st.chunks {
        assert!(ch.get("usage").is_none(), "{ch}");
        assert_eq!(ch["choices"].as_array().unwrap().len(), 1);
    }
    assert_eq!(st.finish_reasons(), ["length"]);
    // max_completion_tokens wins over max_tokens
    let mut b2 = body.clone();
    b2["max_tokens"] = json!(3);
    b2["max_completion_tokens"] = json!(12);
    let r = s.post("/v1/chat/completions", &b2).await.ok();
    assert_eq!(r["usage"]["completion_tokens"], 12);
    assert_eq!(r["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_text_and_ids_equal_generate() {
    let s = Server::engine(Setup::default()).await;
    let text = "Once upon a time, a cable";
    let prompt = tokenizer().encode(text).unwrap();
    let want = reference(&prompt, 16);
    let n = want.tokens.len();
    let usage = json!({"prompt_tokens": prompt.len(), "completion_tokens": n,
                       "total_tokens": prompt.len() + n, "prompt_tokens_details": {"cached_tokens": 0}});
    let body = json!({"model": MODEL_ID, "prompt": text, "max_tokens": 16, "temperature": 0,
                      "cache_prompt": false});
    let r = s.post("/v1/completions", &body).await.ok();
    assert_eq!(r["object"], "text_completion");
    assert!(r["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(r["model"], MODEL_ID);
    assert_eq!(
        r["choices"],
        json!([{"index": 0, "text": want.text, "logprobs": null, "finish_reason": finish(&want)}])
    );
    assert_eq!(r["usage"], usage);
    // the same prompt as ids, and as a one-element array of a string
    for p in [json!(prompt), json!([text])] {
        let mut b = body.clone();
        b["prompt"] = p;
        let r2 = s.post("/v1/completions", &b).await.ok();
        assert_eq!(r2["choices"], r["choices"]);
        assert_eq!(r2["usage"], usage);
    }
    // the generated ids beside the text when asked (vLLM's `return_token_ids`), streamed or not
    let mut b = body.clone();
    b["return_token_ids"] = json!(true);
    let r2 = s.post("/v1/completions", &b).await.ok();
    assert_eq!(r2["choices"][0]["text"], want.text.as_str());
    assert_eq!(r2["choices"][0]["token_ids"], json!(want.tokens));
    b["stream"] = json!(true);
    let st = s.stream("/v1/completions", &b).await;
    assert_eq!(st.token_ids(), want.tokens);
    assert_eq!(st.text(), want.text);
    // the last token's chunk carries its text (and what was held back), not the finish chunk
    let last = st.choices().last().unwrap();
    assert_eq!(last["finish_reason"], finish(&want));
    assert_eq!(
        (last["text"].as_str(), &last["token_ids"]),
        (Some(""), &json!([]))
    );
    // streamed with usage
    let mut b = body.clone();
    b["stream"] = json!(true);
    b["stream_options"] = json!({"include_usage": true});
    let st = s.stream("/v1/completions", &b).await;
    assert!(st.done);
    for ch in &st.chunks {
        assert_eq!(ch["object"], "text_completion");
    }
    assert_eq!(st.text(), want.text);
    assert_eq!(st.finish_reasons(), [finish(&want)]);
    let u = st.chunks.last().unwrap();
    assert_eq!(u["choices"], json!([]));
    assert_eq!(u["usage"], usage);
    // a stop string: the text is cut before its first occurrence, streamed or not
    let chars: Vec<char> = want.text.chars().collect();
    let stop: String = (2..chars.len() - 1)
        .map(|i| chars[i..i + 2].iter().collect::<String>())
        .find(|w: &String| w.chars().all(|c| c.is_ascii_alphabetic()))
        .expect("two letters in the reference text");
    let cut = &want.text[..want.text.find(&stop).unwrap()];
    let mut b = body.clone();
    b["stop"] = json!([stop, "never appears"]);
    let r = s.post("/v1/completions", &b).await.ok();
    assert_eq!(r["choices"][0]["text"], cut, "stop {stop:?}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    b["stream"] = json!(true);
    let st = s.stream("/v1/completions", &b).await;
    assert_eq!(st.text(), cut);
    assert_eq!(st.finish_reasons(), ["stop"]);
    // max_completion_tokens over max_tokens; a bare max_tokens
    for (field, extra, k) in [
        ("max_completion_tokens", Some(("max_tokens", 9)), 5),
        ("max_tokens", None, 7),
    ] {
        let mut b = json!({"prompt": prompt, "temperature": 0});
        b[field] = json!(k);
        if let Some((f, v)) = extra {
            b[f] = json!(v);
        }
        let r = s.post("/v1/completions", &b).await.ok();
        let w = reference(&prompt, k);
        assert_eq!(r["choices"][0]["text"], w.text.as_str(), "{field}");
        assert_eq!(r["usage"]["completion_tokens"], w.tokens.len(), "{field}");
        assert_eq!(r["choices"][0]["finish_reason"], finish(&w));
    }
    s.stop().await;
}

/// Four greedy requests at once on four slots each get exactly what they get alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_requests_on_four_slots_equal_sequential() {
    let s = Arc::new(
        Server::engine(Setup {
            slots: 4,
            ..Setup::default()
        })
        .await,
    );
    let prompts: Vec<Vec<u32>> = [(1, 5), (2, 40), (3, 77), (4, 130)]
        .iter()
        .map(|&(seed, n)| ids(seed, n))
        .collect();
    let wants: Vec<Generation> = prompts.iter().map(|p| reference(p, 20)).collect();
    let tasks: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let s = s.clone();
            let body = json!({"prompt": p, "max_tokens": 20, "temperature": 0, "seed": i});
            // half of them streamed
            tokio::spawn(async move {
                if i % 2 == 0 {
                    let r = s.post("/v1/completions", &body).await.ok();
                    (
                        r["choices"][0]["text"].as_str().unwrap().to_string(),
                        r["usage"]["completion_tokens"].as_u64().unwrap() as usize,
                    )
                } else {
                    let mut b = body;
                    b["stream"] = json!(true);
                    b["stream_options"] = json!({"include_usage": true});
                    let st = s.stream("/v1/completions", &b).await;
                    let n = st.chunks.last().unwrap()["usage"]["completion_tokens"]
                        .as_u64()
                        .unwrap() as usize;
                    (st.text(), n)
                }
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let (text, n) = bounded("a concurrent request", t).await.unwrap();
        assert_eq!(text, wants[i].text, "request {i}");
        assert_eq!(n, wants[i].tokens.len(), "request {i}");
    }
    let m = s.state.engine.metrics();
    assert_eq!(Metrics::get(&m.requests_ok), 4);
    assert_eq!(Metrics::get(&m.requests_failed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prompt_cache_gives_the_tokens_of_a_fresh_server() {
    let s = Server::engine(Setup::default()).await;
    let first = json!([{"role": "system", "content": "You are terse."},
                       {"role": "user", "content": "Name a colour."}]);
    let body = |messages: &Value, cache: bool| json!({"messages": messages, "max_tokens": 10, "temperature": 0, "cache_prompt": cache});
    let (p1, stable1) = chat_prompt(&first, &Map::new());
    let a = s
        .post("/v1/chat/completions", &body(&first, true))
        .await
        .ok();
    assert_eq!(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(a["usage"]["prompt_tokens"], p1.len());
    // the same chat again: all but the prompt's last grid points' tail comes from the cache
    let b = s
        .post("/v1/chat/completions", &body(&first, true))
        .await
        .ok();
    let cached_b = exact_reuse(&p1, &p1);
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"],
        cached_b
    );
    assert!(stable1 > 0 && cached_b >= stable1 - stable1 % UBATCH);
    assert_eq!(b["choices"], a["choices"]);
    // extended by a turn
    let mut second = first.clone();
    let arr = second.as_array_mut().unwrap();
    arr.push(json!({"role": "assistant", "content": "Blue."}));
    arr.push(json!({"role": "user", "content": "Another one."}));
    let (p2, _) = chat_prompt(&second, &Map::new());
    assert_eq!(common_prefix(&p1[..stable1], &p2), stable1);
    let c = s
        .post("/v1/chat/completions", &body(&second, true))
        .await
        .ok();
    let cached = c["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as usize;
    // the history ended in decode steps: the checkpoints of the first prompt serve (its reply re-runs)
    assert_eq!(cached, exact_reuse(&p1, &p2));
    assert!(cached >= stable1 - stable1 % UBATCH);
    assert_eq!(c["usage"]["prompt_tokens"], p2.len());
    // a fresh server computes the whole prompt and answers the same
    let fresh = Server::engine(Setup::default()).await;
    let d = fresh
        .post("/v1/chat/completions", &body(&second, true))
        .await
        .ok();
    assert_eq!(d["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(d["choices"], c["choices"]);
    let want = reference(&p2, 10);
    let parsed = parse_output(&want.text, true, None);
    assert_eq!(
        c["choices"][0]["message"]["reasoning_content"].as_str(),
        parsed.reasoning.as_deref()
    );
    assert_eq!(c["usage"]["completion_tokens"], want.tokens.len());
    // cache_prompt false: nothing reused, the same answer
    let e = s
        .post("/v1/chat/completions", &body(&second, false))
        .await
        .ok();
    assert_eq!(e["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(e["choices"], c["choices"]);
    // the metrics count the two hits
    assert_eq!(s.metric("backburner_cache_hits_total").await, 2.0);
    assert_eq!(
        s.metric("backburner_cache_reused_tokens_total").await,
        (cached_b + cached) as f64
    );
    fresh.stop().await;
    s.stop().await;
}

/// A server whose requests never end on their own: no eos ids, a context far beyond what a test generates.
async fn endless(slots: usize, queue: usize, grace: Duration) -> Server {
    let ctx = 1 << 20;
    let e = engine(slots, queue, Some(ctx));
    let tok = tokenizer();
    let st = backburner_server::AppState::new(e, Some(tok), MODEL_ID.into(), ctx, Vec::new(), None);
    Server::start(st, grace).await
}

/// Polls `/health` until `pred` holds of it (bounded by [`LIMIT`]).
async fn wait_health(s: &Server, what: &str, pred: impl Fn(&Value) -> bool) {
    bounded(what, async {
        loop {
            let h = s.get("/health").await.ok();
            if pred(&h) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_answers_503_and_a_dropped_stream_cancels_and_frees_the_slot() {
    let s = Arc::new(endless(1, 1, Duration::from_secs(5)).await);
    let long = json!({"prompt": "Go on forever", "max_tokens": 1_000_000, "temperature": 0, "stream": true});
    // the answer's headers come once a slot took the job
    let resp = s.post_response("/v1/completions", &long).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut rd = SseReader::new(resp);
    let first = rd.next_json().await;
    assert_eq!(first["object"], "text_completion");
    // a second request waits in the queue
    let queued = {
        let s = s.clone();
        tokio::spawn(async move {
            s.post(
                "/v1/completions",
                &json!({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}),
            )
            .await
        })
    };
    // (the engine sets its slots-busy gauge at the end of a scheduler turn: wait for both gauges)
    wait_health(&s, "the second request to be queued", |h| {
        h["queue_depth"] == 1 && h["slots_busy"] == 1
    })
    .await;
    let h = s.get("/health").await.ok();
    assert_eq!(
        h,
        json!({"status": "ok", "slots": 1, "slots_busy": 1, "queue_depth": 1,
               "workers_attached": 0, "workers_connected": 0})
    );
    // the third finds the queue full
    let r = s
        .post("/v1/chat/completions", &chat_body("Are you busy?", 4))
        .await;
    let (kind, param, code, _) = r.error(503);
    assert_eq!(
        (kind.as_str(), param, code.as_deref()),
        ("server_error", None, Some("server_busy"))
    );
    assert_eq!(r.headers["retry-after"], "1");
    // the client goes away mid-stream: the job is cancelled and the queued one runs
    rd.next_json().await;
    drop(rd);
    let q = bounded("the queued request", queued).await.unwrap().ok();
    assert_eq!(q["usage"]["completion_tokens"], 4);
    assert_eq!(q["choices"][0]["finish_reason"], "length");
    // the scheduler updates its gauges after the step that finished the job
    wait_health(&s, "the slot to be free", |h| h["slots_busy"] == 0).await;
    let page = s.get_text("/metrics").await.1;
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"cancelled\"}"),
        1.0
    );
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"rejected\"}"),
        1.0
    );
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"ok\"}"),
        1.0
    );
    assert_eq!(metric_value(&page, "backburner_requests_running"), 0.0);
    assert_eq!(metric_value(&page, "backburner_queue_depth"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_a_running_stream_with_a_final_chunk_and_done() {
    let mut s = endless(1, 4, Duration::from_millis(200)).await;
    let body = json!({"messages": [{"role": "user", "content": "Talk forever."}], "max_tokens": 1_000_000,
                      "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let resp = s.post_response("/v1/chat/completions", &body).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut rd = SseReader::new(resp);
    let first = rd.next_json().await;
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    rd.next_json().await;
    s.trigger_shutdown();
    let mut chunks = Vec::new();
    let mut done = false;
    while let Some(d) = rd.next().await {
        if d == "[DONE]" {
            done = true;
            continue;
        }
        assert!(!done, "nothing after [DONE]");
        chunks.push(serde_json::from_str::<Value>(&d).unwrap());
    }
    assert!(done, "the stream ends with data: [DONE]");
    let usage = chunks.pop().unwrap();
    assert_eq!(usage["choices"], json!([]));
    let n = usage["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 0);
    let last = chunks.pop().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "stop", "{last}");
    assert_eq!(last["choices"][0]["delta"], json!({}));
    s.join().await.expect("serve returns Ok");
    let m = s.state.engine.metrics();
    assert_eq!(m.requests_cancelled.load(Ordering::Relaxed), 1);
    assert_eq!(m.generated_tokens.load(Ordering::Relaxed), n);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_metrics() {
    let s = Server::engine(Setup {
        slots: 2,
        ..Setup::default()
    })
    .await;
    let m = s.get("/v1/models").await.ok();
    assert_eq!(m["object"], "list");
    let d = &m["data"].as_array().unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(d[0]["id"], MODEL_ID);
    assert_eq!(d[0]["object"], "model");
    assert_eq!(d[0]["owned_by"], "backburner");
    assert_eq!(d[0]["created"], s.state.created);
    assert_eq!(d[0]["meta"], json!({"context_length": 4096, "slots": 2}));
    let h = s.get("/health").await.ok();
    assert_eq!(
        h,
        json!({"status": "ok", "slots": 2, "slots_busy": 0, "queue_depth": 0,
               "workers_attached": 0, "workers_connected": 0})
    );
    let (status, page) = s.get_text("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for l in page.lines() {
        assert!(
            l.starts_with("# HELP backburner_")
                || l.starts_with("# TYPE backburner_")
                || l.starts_with("backburner_"),
            "{l}"
        );
    }
    assert_eq!(metric_value(&page, "backburner_slots"), 2.0);
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"ok\"}"),
        0.0
    );
    assert_eq!(
        metric_value(&page, "backburner_generated_tokens_total"),
        0.0
    );
    // one request, then one extending it (a cache hit)
    let prompt = ids(5, 30);
    let want = reference(&prompt, 6);
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0}),
        )
        .await
        .ok();
    assert_eq!(r["choices"][0]["text"], want.text.as_str());
    let mut p2 = prompt.clone();
    p2.extend(&want.tokens);
    p2.extend(ids(6, 5));
    let want2 = reference(&p2, 6);
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": p2, "max_tokens": 6, "temperature": 0}),
        )
        .await
        .ok();
    assert_eq!(r["choices"][0]["text"], want2.text.as_str());
    let cached = r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap() as f64;
    // the first prompt's last grid point (a multiple of the ubatch of 16 inside its 30 tokens)
    assert_eq!(cached as usize, exact_reuse(&prompt, &p2));
    assert_eq!(cached, 16.0);
    let page = s.get_text("/metrics").await.1;
    let n = (want.tokens.len() + want2.tokens.len()) as f64;
    let total = (prompt.len() + p2.len()) as f64;
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"ok\"}"),
        2.0
    );
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"failed\"}"),
        0.0
    );
    assert_eq!(metric_value(&page, "backburner_generated_tokens_total"), n);
    assert_eq!(metric_value(&page, "backburner_prompt_tokens_total"), total);
    assert_eq!(metric_value(&page, "backburner_cache_hits_total"), 1.0);
    assert_eq!(
        metric_value(&page, "backburner_cache_reused_tokens_total"),
        cached
    );
    assert_eq!(
        metric_value(&page, "backburner_prefill_tokens_total"),
        total - cached
    );
    s.stop().await;
}

/// A server whose slots prefill one token per scheduler turn (ubatch 1), so a long prompt's ingest lasts seconds.
async fn slow_ingest(slots: usize) -> Server {
    let ctx = 1 << 20;
    let sessions = (0..slots)
        .map(|_| {
            let o = backburner_engine::SessionOptions {
                ubatch: 1,
                context_length: Some(ctx),
                ..backburner_engine::SessionOptions::default()
            };
            backburner_engine::Session::new(model(), o).expect("session")
        })
        .collect();
    let opts = backburner_engine::serve::ServeOptions {
        queue: 4,
        cache: backburner_engine::serve::CacheLimits::default(),
        ..Default::default()
    };
    let e = Arc::new(
        backburner_engine::serve::Engine::start(sessions, Some(tokenizer()), opts).expect("engine"),
    );
    let st = backburner_server::AppState::new(
        e,
        Some(tokenizer()),
        MODEL_ID.into(),
        ctx,
        Vec::new(),
        None,
    );
    Server::start(st, Duration::from_secs(5)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_prompt_is_not_held_behind_a_long_ingest_and_a_client_gone_mid_ingest_frees_its_slot(
) {
    let s = slow_ingest(2).await;
    let long_ids: Vec<u32> = (0..30_000u32).map(|i| 1 + i % 400).collect();
    let long = json!({"prompt": long_ids, "max_tokens": 4, "temperature": 0, "stream": true});
    let resp = s.post_response("/v1/completions", &long).await;
    assert_eq!(resp.status(), StatusCode::OK);
    // a short request in the other slot is answered while the long prompt is still being ingested
    let short = s
        .post(
            "/v1/completions",
            &json!({"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}),
        )
        .await
        .ok();
    assert_eq!(short["usage"]["completion_tokens"], 2);
    let page = s.get_text("/metrics").await.1;
    let ingested = metric_value(&page, "backburner_prefill_tokens_total");
    assert!(
        ingested < 30_000.0,
        "the short one waited for the whole long ingest ({ingested} tokens)"
    );
    // the long prompt's client goes away before any token: the job is cancelled mid-ingest
    drop(resp);
    wait_health(&s, "the slot to be freed", |h| h["slots_busy"] == 0).await;
    let page = s.get_text("/metrics").await.1;
    assert_eq!(
        metric_value(&page, "backburner_requests_total{outcome=\"cancelled\"}"),
        1.0
    );
    assert!(metric_value(&page, "backburner_prefill_tokens_total") < 30_003.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_without_a_tokenizer_completes_token_ids_and_returns_the_ids() {
    // A GGUF file with `tokenizer.ggml.model = none`: the text is empty, so the ids are the answer.
    let ctx = model().config().max_position_embeddings;
    let e = common::engine_with(1, 8, None, None);
    let eos = tokenizer().eos_ids().to_vec();
    let st = backburner_server::AppState::new(e, None, MODEL_ID.into(), ctx, eos, None);
    let s = Server::start(st, std::time::Duration::from_secs(5)).await;
    let prompt = tokenizer().encode("Once upon a time, a cable").unwrap();
    let want = reference(&prompt, 12);
    let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 0});
    let r = s.post("/v1/completions", &body).await.ok();
    assert_eq!(r["choices"][0]["text"], "");
    assert_eq!(r["choices"][0]["token_ids"], json!(want.tokens));
    assert_eq!(r["choices"][0]["finish_reason"], finish(&want));
    let mut b = body.clone();
    b["stream"] = json!(true);
    let st = s.stream("/v1/completions", &b).await;
    assert!(st.done);
    assert_eq!(st.token_ids(), want.tokens);
    // stop strings cannot match a text the model does not have
    let mut b = body.clone();
    b["stop"] = json!(["a"]);
    let (_, param, _, msg) = s.post("/v1/completions", &b).await.error(400);
    assert_eq!(param.as_deref(), Some("stop"));
    assert!(msg.contains("needs a tokenizer"), "{msg}");
    // a text prompt cannot be tokenized
    let (_, _, _, msg) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "hello", "max_tokens": 2}),
        )
        .await
        .error(400);
    assert!(msg.contains("no tokenizer"), "{msg}");
    s.stop().await;
}
