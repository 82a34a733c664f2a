//! Log-probabilities, penalties and `logit_bias` through the HTTP server on the real engine: the values served
//! equal the engine's own ([`generate`] with the same settings), in OpenAI's shapes, streamed and not, on chat and
//! legacy completions; values without a meaning are 400s naming their field.

use crate::common;

use backburner_engine::{Generation, SamplingParams};
use common::*;
use serde_json::{json, Value};

/// A prompt of `n` ordinary ids.
fn prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 11) % 445).collect()
}

/// [`generate_fresh`] asking for `lp` alternatives.
fn reference(prompt: &[u32], max_tokens: usize, sampling: SamplingParams, lp: usize) -> Generation {
    generate_fresh(prompt, max_tokens, sampling, Some(lp))
}

/// The token string and bytes the API reports for `id` (`token_id:<id>` and null for an id of the model that the
/// tiny tokenizer lacks).
fn name(id: u32) -> (String, Value) {
    match tokenizer().token_bytes(id) {
        Some(b) => (String::from_utf8_lossy(&b).into_owned(), json!(b)),
        None => (format!("token_id:{id}"), Value::Null),
    }
}

/// Asserts that chat `content` entries are `want`'s, value for value.
fn assert_chat_entries(content: &[Value], want: &Generation, top: usize) {
    assert_eq!(content.len(), want.tokens.len());
    for (e, lp) in content.iter().zip(&want.logprobs) {
        let (tok, bytes) = name(lp.id);
        assert_eq!(e["token"], tok.as_str());
        assert_eq!(e["bytes"], bytes);
        assert_eq!(e["logprob"].as_f64().unwrap() as f32, lp.logprob);
        let alts = e["top_logprobs"].as_array().unwrap();
        assert_eq!(alts.len(), top);
        for (a, &(id, v)) in alts.iter().zip(&lp.top) {
            assert_eq!(a["token"], name(id).0.as_str());
            assert_eq!(a["bytes"], name(id).1);
            assert_eq!(a["logprob"].as_f64().unwrap() as f32, v);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_logprobs_whole_and_streamed_equal_the_engine() {
    let s = Server::engine(Setup::default()).await;
    let p = prompt(40);
    let want = reference(&p, 10, SamplingParams::default(), 3);
    assert!(!want.tokens.is_empty());
    let body = json!({"prompt": p, "max_tokens": 10, "temperature": 0, "logprobs": 3});
    let r = s.post("/v1/completions", &body).await.ok();
    let l = &r["choices"][0]["logprobs"];
    let names: Vec<String> = want.tokens.iter().map(|&t| name(t).0).collect();
    assert_eq!(l["tokens"], json!(names));
    let lps: Vec<f32> = l["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let want_lps: Vec<f32> = want.logprobs.iter().map(|t| t.logprob).collect();
    assert_eq!(lps, want_lps);
    let mut offset = 0;
    for (i, t) in want.logprobs.iter().enumerate() {
        let top = l["top_logprobs"][i].as_object().unwrap();
        let mut want_top = std::collections::BTreeMap::new();
        for &(id, v) in &t.top {
            want_top.entry(name(id).0).or_insert(v);
        }
        let got: std::collections::BTreeMap<String, f32> = top
            .iter()
            .map(|(k, v)| (k.clone(), v.as_f64().unwrap() as f32))
            .collect();
        assert_eq!(t.top.len(), 3);
        assert_eq!(got, want_top, "step {i}");
        assert_eq!(l["text_offset"][i], offset);
        offset += names[i].chars().count();
    }

    // streamed: each chunk carries its token's entries; together the same object
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = s.stream("/v1/completions", &sb).await;
    let streamed: Vec<Value> = st
        .choices()
        .filter(|c| !c["logprobs"].is_null())
        .flat_map(|c| c["logprobs"]["tokens"].as_array().unwrap().clone())
        .collect();
    assert_eq!(json!(streamed), json!(names));
    let streamed_lps: Vec<f32> = st
        .choices()
        .filter(|c| !c["logprobs"].is_null())
        .flat_map(|c| c["logprobs"]["token_logprobs"].as_array().unwrap().clone())
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(streamed_lps, want_lps);
    // without `logprobs`, null as before
    let r = s
        .post("/v1/completions", &json!({"prompt": p, "max_tokens": 2}))
        .await
        .ok();
    assert!(r["choices"][0]["logprobs"].is_null());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs_whole_and_streamed_equal_the_engine() {
    let s = Server::engine(Setup::default()).await;
    let body = json!({"messages": [{"role": "user", "content": "Tell me about slow cables."}],
                      "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let tok = tokenizer();
    let text = tok
        .render_chat(&backburner_model::chat::ChatRequest {
            messages: body["messages"].as_array().unwrap(),
            tools: None,
            add_generation_prompt: true,
            kwargs: &Default::default(),
        })
        .unwrap();
    let p = tok.encode(&text).unwrap();
    let want = reference(&p, 12, SamplingParams::default(), 2);
    let r = s.post("/v1/chat/completions", &body).await.ok();
    let l = &r["choices"][0]["logprobs"];
    assert!(l["refusal"].is_null());
    assert_chat_entries(l["content"].as_array().unwrap(), &want, 2);

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let st = s.stream("/v1/chat/completions", &sb).await;
    let entries: Vec<Value> = st
        .choices()
        .filter(|c| !c["logprobs"].is_null())
        .flat_map(|c| c["logprobs"]["content"].as_array().unwrap().clone())
        .collect();
    assert_chat_entries(&entries, &want, 2);

    // top_logprobs 0: the chosen token's only
    let mut b0 = body.clone();
    b0["top_logprobs"] = json!(0);
    let r = s.post("/v1/chat/completions", &b0).await.ok();
    let c = r["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(c.len(), want.tokens.len());
    assert!(c.iter().all(|e| e["top_logprobs"] == json!([])));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_logit_bias_equal_the_engine() {
    let s = Server::engine(Setup::default()).await;
    let p = prompt(30);
    let plain = reference(&p, 12, SamplingParams::default(), 0);
    let sampling = SamplingParams {
        presence_penalty: 0.6,
        frequency_penalty: 1.1,
        repetition_penalty: 1.25,
        logit_bias: vec![(plain.tokens[0], -50.0), (7, 2.0)],
        ..Default::default()
    };
    let want = reference(&p, 12, sampling, 0);
    assert_ne!(want.tokens, plain.tokens);
    let body = json!({"prompt": p, "max_tokens": 12, "temperature": 0, "return_token_ids": true,
                      "presence_penalty": 0.6, "frequency_penalty": 1.1, "repetition_penalty": 1.25,
                      "logit_bias": {plain.tokens[0].to_string(): -50, "7": 2.0}});
    let r = s.post("/v1/completions", &body).await.ok();
    assert_eq!(r["choices"][0]["token_ids"], json!(want.tokens));
    assert_eq!(r["choices"][0]["text"], want.text.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_without_a_meaning_are_400s_naming_the_field() {
    let s = Server::engine(Setup::default()).await;
    let chat = |extra: Value| {
        let mut b = chat_body("hi", 2);
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases = [
        (chat(json!({"top_logprobs": 2})), "top_logprobs"),
        (
            chat(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs",
        ),
        (chat(json!({"logprobs": 1})), "logprobs"),
        (chat(json!({"presence_penalty": 2.5})), "presence_penalty"),
        (
            chat(json!({"frequency_penalty": -2.1})),
            "frequency_penalty",
        ),
        (chat(json!({"repetition_penalty": 0})), "repetition_penalty"),
        (chat(json!({"logit_bias": {"x": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {" 5": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"+5": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"05": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": {"5": "high"}})), "logit_bias"),
        (chat(json!({"logit_bias": {"5": 101}})), "logit_bias"),
        (chat(json!({"logit_bias": {"99999999": 1}})), "logit_bias"),
        (chat(json!({"logit_bias": [1, 2]})), "logit_bias"),
    ];
    for (body, field) in cases {
        let (kind, param, _, msg) = s.post("/v1/chat/completions", &body).await.error(400);
        assert_eq!(kind, "invalid_request_error");
        assert_eq!(param.as_deref(), Some(field), "{msg}");
    }
    let (_, param, _, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": [1, 2], "logprobs": 21}),
        )
        .await
        .error(400);
    assert_eq!(param.as_deref(), Some("logprobs"));
}

/// Two slots decoding as one batch, and a second turn from the slot's cache, give the engine's fresh-session
/// tokens and log-probabilities with penalties and a bias.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_slots_and_the_prompt_cache_keep_the_adjusted_bits() {
    let s = Server::engine(Setup {
        slots: 2,
        ..Setup::default()
    })
    .await;
    let sampling = SamplingParams {
        presence_penalty: 0.4,
        frequency_penalty: 0.9,
        repetition_penalty: 1.2,
        logit_bias: vec![(7, 1.5)],
        ..Default::default()
    };
    let body = |p: &[u32]| {
        json!({"prompt": p, "max_tokens": 10, "temperature": 0, "return_token_ids": true, "logprobs": 2,
               "presence_penalty": 0.4, "frequency_penalty": 0.9, "repetition_penalty": 1.2,
               "logit_bias": {"7": 1.5}})
    };
    let (pa, pb) = (prompt(40), prompt(33));
    let (wa, wb) = (
        reference(&pa, 10, sampling.clone(), 2),
        reference(&pb, 10, sampling.clone(), 2),
    );
    let lps = |r: &Value| -> Vec<f32> {
        r["choices"][0]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    let want_lps = |g: &Generation| -> Vec<f32> { g.logprobs.iter().map(|t| t.logprob).collect() };
    for round in 0..2 {
        // round 1 reuses each slot's cached prompt; an answer reaches the client just before the scheduler frees
        // its slot, so wait until both are idle (a request finding its slot still busy takes the other one)
        if round == 1 {
            for _ in 0..500 {
                let v = s.get("/slots").await.ok();
                let idle = v
                    .as_array()
                    .is_some_and(|a| a.iter().all(|x| x["is_processing"] == false));
                if idle {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
        }
        let (ba, bb) = (body(&pa), body(&pb));
        let (ra, rb) = tokio::join!(
            s.post("/v1/completions", &ba),
            s.post("/v1/completions", &bb)
        );
        let (ra, rb) = (ra.ok(), rb.ok());
        assert_eq!(
            ra["choices"][0]["token_ids"],
            json!(wa.tokens),
            "round {round}"
        );
        assert_eq!(
            rb["choices"][0]["token_ids"],
            json!(wb.tokens),
            "round {round}"
        );
        assert_eq!(lps(&ra), want_lps(&wa), "round {round}");
        assert_eq!(lps(&rb), want_lps(&wb), "round {round}");
        if round == 1 {
            assert!(
                ra["usage"]["prompt_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
                    > 0
            );
        }
    }
}

/// `ignore_eos` (llama-server's and vLLM's): an end-of-sequence token no longer ends the generation, so a request
/// biased to eos runs to `max_tokens` ("length") instead of stopping at once; with a grammar it is a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ignore_eos_generates_past_eos_to_max_tokens() {
    let s = Server::engine(Setup::default()).await;
    let body = |ignore: bool| {
        json!({"prompt": prompt(8), "max_tokens": 7, "temperature": 0, "logit_bias": {"445": 100},
               "ignore_eos": ignore, "logprobs": 1})
    };
    let stopped = s.post("/v1/completions", &body(false)).await.ok();
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    // (the eos that ends a generation is not one of its tokens)
    assert_eq!(stopped["usage"]["completion_tokens"], 0);
    let long = s.post("/v1/completions", &body(true)).await.ok();
    assert_eq!(long["choices"][0]["finish_reason"], "length");
    assert_eq!(long["usage"]["completion_tokens"], 7);
    let toks = long["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
    assert_eq!(toks.len(), 7);
    assert!(toks.iter().all(|t| t == "<|endoftext|>"), "{toks:?}");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true,
                      "response_format": {"type": "json_object"}});
    let (_, param, _, _) = s.post("/v1/chat/completions", &chat).await.error(400);
    assert_eq!(param.as_deref(), Some("ignore_eos"));
    let (_, param, _, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "x", "ignore_eos": "yes"}),
        )
        .await
        .error(400);
    assert_eq!(param.as_deref(), Some("ignore_eos"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeds_past_2_63_stay_distinct_and_choices_wrap_in_u64() {
    let s = Server::engine(Setup::default()).await;
    let p = prompt(20);
    let max = 12;
    let seeds = [(1u64 << 63) - 1, 1 << 63, u64::MAX - 1, u64::MAX];
    let sampled = |seed: u64| {
        generate_fresh(
            &p,
            max,
            SamplingParams {
                temperature: 1.0,
                seed,
                ..SamplingParams::default()
            },
            None,
        )
        .tokens
    };
    let mut got = Vec::new();
    for seed in seeds {
        let body = json!({"prompt": p, "max_tokens": max, "temperature": 1.0, "seed": seed,
                          "return_token_ids": true});
        let r = s.post("/v1/completions", &body).await.ok();
        let ids: Vec<u32> = serde_json::from_value(r["choices"][0]["token_ids"].clone()).unwrap();
        // the engine's own answer with that very seed
        assert_eq!(ids, sampled(seed), "seed {seed}");
        got.push(ids);
    }
    for i in 0..got.len() {
        for j in i + 1..got.len() {
            assert_ne!(got[i], got[j], "seeds {} and {}", seeds[i], seeds[j]);
        }
    }
    // choice i samples with seed + i, wrapping: past 2^64 - 1 comes 0
    let body = json!({"prompt": p, "max_tokens": max, "temperature": 1.0, "seed": u64::MAX - 1, "n": 3,
                      "return_token_ids": true});
    let r = s.post("/v1/completions", &body).await.ok();
    for (i, seed) in [u64::MAX - 1, u64::MAX, 0].into_iter().enumerate() {
        let ids: Vec<u32> = serde_json::from_value(r["choices"][i]["token_ids"].clone()).unwrap();
        assert_eq!(ids, sampled(seed), "choice {i}");
    }
    // 2^64 and negatives other than -1: 400s naming `seed`
    for bad in ["18446744073709551616", "-2"] {
        let body = format!(r#"{{"prompt": "x", "max_tokens": 2, "seed": {bad}}}"#);
        let r = s.post_bytes("/v1/completions", body.into_bytes()).await;
        let (_, param, _, m) = r.error(400);
        assert_eq!(param.as_deref(), Some("seed"), "{bad}: {m}");
    }
}
