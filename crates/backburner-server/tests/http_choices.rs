//! `n` > 1 through the HTTP server on the real engine: the prompt is prefilled once (`/metrics`), choice `i` is the
//! single request with seed `seed + i` token for token (against a fresh-session reference, and against `n` = 1
//! requests), with one slot (later choices resume from the slot's copy of the prompt) and with a slot per choice
//! (forked), streamed and not; a client that goes away cancels every choice.

use crate::common;

use backburner_engine::{Generation, SamplingParams};
use common::*;
use serde_json::{json, Value};

/// A prompt of `n` ordinary ids.
fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 53 + 7) % 445).collect()
}

fn sampling(seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 0.9,
        seed,
        ..SamplingParams::default()
    }
}

/// What choice `i` of a request with `seed` must be: a fresh session with seed `seed + i`.
fn reference(p: &[u32], max_tokens: usize, seed: u64, i: u64) -> Generation {
    generate_fresh(p, max_tokens, sampling(seed + i), Some(2))
}

fn logprob_values(lp: &Value) -> Vec<f32> {
    lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_choice_i_is_seed_plus_i_prefilled_once() {
    let p = prompt(45);
    let (seed, max) = (9000_u64, 10);
    let want: Vec<Generation> = (0..3).map(|i| reference(&p, max, seed, i)).collect();
    assert!(
        want.iter().any(|g| g.tokens != want[0].tokens),
        "the seeds differ"
    );
    for slots in [1, 3] {
        let s = Server::engine(Setup {
            slots,
            ..Setup::default()
        })
        .await;
        let body = json!({"prompt": p, "max_tokens": max, "temperature": 0.9, "seed": seed, "n": 3,
                          "logprobs": 2, "return_token_ids": true});
        let r = s.post("/v1/completions", &body).await.ok();
        let choices = r["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i, "{slots} slots");
            assert_eq!(
                c["token_ids"],
                json!(want[i].tokens),
                "{slots} slots, choice {i}"
            );
            assert_eq!(c["text"], want[i].text.as_str());
            let lps: Vec<f32> = want[i].logprobs.iter().map(|t| t.logprob).collect();
            assert_eq!(
                logprob_values(&c["logprobs"]),
                lps,
                "{slots} slots, choice {i}"
            );
            assert_eq!(c["finish_reason"], "length");
        }
        // completion tokens summed over the choices, the prompt counted once
        let completion: usize = want.iter().map(|g| g.tokens.len()).sum();
        assert_eq!(r["usage"]["prompt_tokens"], 45);
        assert_eq!(r["usage"]["completion_tokens"], completion);
        assert_eq!(r["usage"]["total_tokens"], 45 + completion);
        // the prompt was prefilled once, not three times
        assert_eq!(s.metric("backburner_prefill_tokens_total").await, 45.0);
        assert_eq!(
            s.metric("backburner_generated_tokens_total").await,
            completion as f64
        );
        // one request, three sequences
        assert_eq!(outcomes(&s, "requests").await, [("ok", 1.0)]);
        assert_eq!(outcomes(&s, "sequences").await, [("ok", 3.0)]);

        // streamed: the same tokens per index, one finish reason per choice, the usage once at the end
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let st = s.stream("/v1/completions", &sb).await;
        assert!(st.done);
        for (i, w) in want.iter().enumerate() {
            let mine: Vec<&Value> = st.choices().filter(|c| c["index"] == i).collect();
            let ids: Vec<u32> = mine
                .iter()
                .flat_map(|c| c["token_ids"].as_array().unwrap().clone())
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(ids, w.tokens, "{slots} slots, streamed choice {i}");
            let text: String = mine.iter().filter_map(|c| c["text"].as_str()).collect();
            assert_eq!(text, w.text);
            let lps: Vec<f32> = mine
                .iter()
                .filter(|c| !c["logprobs"].is_null())
                .flat_map(|c| logprob_values(&c["logprobs"]))
                .collect();
            assert_eq!(
                lps,
                w.logprobs.iter().map(|t| t.logprob).collect::<Vec<_>>()
            );
            let reasons: Vec<&Value> = mine
                .iter()
                .map(|c| &c["finish_reason"])
                .filter(|f| !f.is_null())
                .collect();
            assert_eq!(reasons, [&json!("length")]);
        }
        let usage: Vec<&Value> = st
            .chunks
            .iter()
            .filter(|c| !c["usage"].is_null())
            .map(|c| &c["usage"])
            .collect();
        assert_eq!(usage.len(), 1);
        assert_eq!(usage[0]["completion_tokens"], completion);
        assert_eq!(usage[0]["prompt_tokens"], 45);
        assert!(st.chunks.last().unwrap()["choices"]
            .as_array()
            .unwrap()
            .is_empty());
        // streamed with the slot's cache warm: still no prefill of the whole prompt per choice (at most the cached
        // prompt's tail once)
        let prefilled = s.metric("backburner_prefill_tokens_total").await;
        assert!(prefilled < 45.0 * 2.0, "{slots} slots: {prefilled}");
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_choices_equal_single_requests_with_seed_plus_i() {
    for slots in [1, 2] {
        let s = Server::engine(Setup {
            slots,
            ..Setup::default()
        })
        .await;
        let mut body = chat_body("Name three slow cables.", 8);
        body["temperature"] = json!(1.0);
        body["seed"] = json!(31);
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(1);
        let singles: Vec<Value> = {
            let mut v = Vec::new();
            for i in 0..3 {
                let mut b = body.clone();
                b["seed"] = json!(31 + i);
                v.push(s.post("/v1/chat/completions", &b).await.ok());
            }
            v
        };
        let mut nb = body.clone();
        nb["n"] = json!(3);
        let r = s.post("/v1/chat/completions", &nb).await.ok();
        let choices = r["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3);
        let mut completion = 0;
        for (i, (c, one)) in choices.iter().zip(&singles).enumerate() {
            let want = &one["choices"][0];
            assert_eq!(c["index"], i);
            assert_eq!(c["message"], want["message"], "{slots} slots, choice {i}");
            assert_eq!(c["logprobs"], want["logprobs"], "{slots} slots, choice {i}");
            assert_eq!(c["finish_reason"], want["finish_reason"]);
            completion += one["usage"]["completion_tokens"].as_u64().unwrap();
        }
        assert!(
            singles
                .iter()
                .any(|o| o["choices"][0]["message"] != singles[0]["choices"][0]["message"]),
            "the seeds give different answers"
        );
        assert_eq!(r["usage"]["completion_tokens"], completion);
        assert_eq!(
            r["usage"]["prompt_tokens"],
            singles[0]["usage"]["prompt_tokens"]
        );

        // streamed: each index's content deltas add up to its message
        let mut sb = nb.clone();
        sb["stream"] = json!(true);
        let st = s.stream("/v1/chat/completions", &sb).await;
        for (i, c) in choices.iter().enumerate() {
            let mine: Vec<&Value> = st.choices().filter(|x| x["index"] == i).collect();
            assert_eq!(mine[0]["delta"]["role"], "assistant");
            let content: String = mine
                .iter()
                .filter_map(|x| x["delta"]["content"].as_str())
                .collect();
            let reasoning: String = mine
                .iter()
                .filter_map(|x| x["delta"]["reasoning_content"].as_str())
                .collect();
            assert_eq!(content, c["message"]["content"].as_str().unwrap_or(""));
            assert_eq!(
                reasoning,
                c["message"]["reasoning_content"].as_str().unwrap_or("")
            );
            let reasons: Vec<&Value> = mine
                .iter()
                .map(|x| &x["finish_reason"])
                .filter(|f| !f.is_null())
                .collect();
            assert_eq!(reasons, [&c["finish_reason"]]);
        }
        s.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_choices_are_identical_and_n_is_bounded() {
    let s = Server::engine(Setup {
        slots: 2,
        ..Setup::default()
    })
    .await;
    let p = prompt(20);
    let want = generate_fresh(&p, 6, SamplingParams::default(), None);
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 6, "temperature": 0, "n": 4, "return_token_ids": true}),
        )
        .await
        .ok();
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for c in choices {
        assert_eq!(c["token_ids"], json!(want.tokens));
    }
    // without a seed the choices are seeded at random (and differ from each other, almost surely)
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": p, "max_tokens": 12, "temperature": 1.5, "n": 4, "return_token_ids": true}),
        )
        .await
        .ok();
    let ids: Vec<&Value> = r["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| &c["token_ids"])
        .collect();
    assert!(ids.iter().any(|t| *t != ids[0]), "{ids:?}");
    for n in [json!(0), json!(17), json!(-1)] {
        for (path, mut body) in [
            ("/v1/completions", json!({"prompt": p, "max_tokens": 2})),
            ("/v1/chat/completions", chat_body("hi", 2)),
        ] {
            body["n"] = n.clone();
            let r = s.post(path, &body).await;
            let (_, param, _, m) = r.error(400);
            assert_eq!(param.as_deref(), Some("n"), "{path} n={n}: {m}");
        }
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_cancels_every_choice() {
    // one slot: choice 0 runs while the two others wait for the slot
    let s = Server::engine(Setup {
        slots: 1,
        ..Setup::default()
    })
    .await;
    let body = json!({"prompt": prompt(10), "max_tokens": 3000, "temperature": 1.0, "n": 3, "stream": true,
                      "seed": 1, "logit_bias": {"445": -100, "447": -100}});
    let r = s.post_response("/v1/completions", &body).await;
    let mut rd = SseReader::new(r);
    for _ in 0..3 {
        rd.next_json().await;
    }
    // choice 0 in the slot, the two others waiting for it
    let t0 = std::time::Instant::now();
    while s.metric("backburner_queue_depth").await != 2.0 {
        assert!(t0.elapsed() < LIMIT, "the waiting choices never showed");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(s.metric("backburner_requests_running").await, 1.0);
    drop(rd);
    // the next request gets the slot soon: nothing of the request gone runs on
    let r = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt(12), "max_tokens": 2, "temperature": 0}),
        )
        .await
        .ok();
    assert_eq!(r["choices"].as_array().unwrap().len(), 1);
    // the request counts once; its three choices each once (the waiting two included)
    assert_eq!(
        outcomes(&s, "requests").await,
        [("ok", 1.0), ("cancelled", 1.0)]
    );
    assert_eq!(
        outcomes(&s, "sequences").await,
        [("ok", 1.0), ("cancelled", 3.0)]
    );
    assert_eq!(s.metric("backburner_queue_depth").await, 0.0);
    // the answer reaches the client inside the scheduler's step, the gauges are set at its end
    let t0 = std::time::Instant::now();
    while s.metric("backburner_requests_running").await != 0.0 {
        assert!(t0.elapsed() < LIMIT, "the finished request kept running");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // choice 0 stopped early, and the waiting choices never generated anything
    let generated = s.metric("backburner_generated_tokens_total").await;
    assert!(generated < 1000.0, "{generated}");
    s.stop().await;
}

/// The non-zero samples of `backburner_<family>_total` by outcome, in the page's order.
async fn outcomes(s: &Server, family: &str) -> Vec<(&'static str, f64)> {
    let (_, page) = s.get_text("/metrics").await;
    ["ok", "invalid", "failed", "cancelled", "rejected"]
        .into_iter()
        .map(|o| {
            let sample = format!("backburner_{family}_total{{outcome=\"{o}\"}}");
            (o, metric_value(&page, &sample))
        })
        .filter(|(_, v)| *v != 0.0)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_of_n_choices_counts_once_and_its_choices_each_once() {
    let s = Server::engine(Setup {
        slots: 2,
        ..Setup::default()
    })
    .await;
    let body =
        json!({"prompt": prompt(10), "max_tokens": 4, "temperature": 0.7, "seed": 3, "n": 3});
    let r = s.post("/v1/completions", &body).await.ok();
    assert_eq!(r["choices"].as_array().unwrap().len(), 3);
    assert_eq!(outcomes(&s, "requests").await, [("ok", 1.0)]);
    assert_eq!(outcomes(&s, "sequences").await, [("ok", 3.0)]);
    assert_eq!(s.metric("backburner_queue_depth").await, 0.0);
    s.stop().await;
}
