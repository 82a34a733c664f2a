//! `backburner serve` as a real process over HTTP: split prefill on a worker behind the server and the fallback
//! when the worker dies (same answers, counted on /metrics), a bounded load test against a full queue (only exact
//! answers or 503 + Retry-After; memory back near its baseline), the TOML config file, a streamed request from
//! curl, and SIGTERM during a stream.

use crate::common;
use crate::serve_util;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::{fixture, worker_for};
use serve_util::{assemble, serve, serve_args, sigterm, wait_exit, Server, Streamed};

/// The fixture the server runs: the hub layout with a tokenizer and the Qwen3.5 chat template.
fn tiny() -> std::path::PathBuf {
    fixture("tiny-hub")
}

/// 48 token ids of the tiny model's vocabulary (6 ubatches of 8).
fn prompt_ids() -> Vec<u32> {
    (0..48u32).map(|i| (i * 37 + 11) % 440).collect()
}

/// A greedy completion of [`prompt_ids`], computed from scratch (`cache_prompt: false`: no reuse of the slot's
/// history, so every request runs a whole prefill).
fn greedy_ids_request() -> Value {
    json!({"prompt": prompt_ids(), "max_tokens": 12, "temperature": 0, "cache_prompt": false})
}

/// The parts of a completion answer that must not change with placement: text, finish reason, token counts.
fn answer(v: &Value) -> Value {
    json!({
        "text": v["choices"][0]["text"],
        "finish_reason": v["choices"][0]["finish_reason"],
        "completion_tokens": v["usage"]["completion_tokens"],
        "prompt_tokens": v["usage"]["prompt_tokens"],
    })
}

/// Server flags for split prefill on `addr`: ubatches of 8 tokens, so the 48-token prompt spans 6 of them and is
/// above `--split-min-tokens` (the engine splits a prefill of at least that many tokens and more than one ubatch).
fn split_flags(addr: &str) -> Vec<String> {
    [
        "--ubatch",
        "8",
        "--worker",
        addr,
        "--split-min-tokens",
        "16",
        "--worker-timeout",
        "10",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_page_size_workers_refuse_serves_locally_without_contacting_the_worker() {
    // Nothing listens at port 1: had a slot tried the worker, it would count a fallback.
    let m = tiny();
    let page = ["--kv-page-size", "100"];
    let local = serve(&m, &[&page[..], &["--ubatch", "8"]].concat());
    let want = answer(&local.post_ok("/v1/completions", &greedy_ids_request()));
    drop(local);
    let split = split_flags("127.0.0.1:1");
    let flags = [&page[..], &refs(&split), &["--parallel", "2"]].concat();
    let s = serve(&m, &flags);
    let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(got, want);
    assert_eq!(s.metric("workers_attached"), 0.0);
    assert_eq!(s.metric("fallbacks_total"), 0.0);
    let err = s.stderr();
    // Said once, not once per slot.
    assert_eq!(
        err.matches("--kv-page-size 100 is not a multiple of 64")
            .count(),
        1,
        "{err}"
    );
}

#[test]
fn a_worker_behind_the_server_gives_the_same_answers_and_its_loss_falls_back_to_local() {
    let m = tiny();
    let local = serve(&m, &["--ubatch", "8"]);
    let want = answer(&local.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(want["prompt_tokens"], 48);
    assert_eq!(local.metric("split_prefill_calls_total"), 0.0);
    drop(local);

    // a healthy worker: the prefill runs split, same answer
    let w = worker_for(&m, &[], &[]);
    let s = serve(&m, &refs(&split_flags(&w.addr)));
    let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(got, want, "split prefill changed the answer");
    assert!(s.metric("split_prefill_calls_total") >= 1.0);
    assert!(s.metric("worker_tokens_total") > 0.0);
    assert_eq!(s.metric("fallbacks_total"), 0.0);
    assert_eq!(s.metric("workers_attached"), 1.0);
    assert_eq!(s.metric("workers_connected"), 1.0);
    assert_eq!(s.metric("worker_ping_failures_total"), 0.0);
    assert!(s.metric("link_rtt_seconds") >= 0.0);
    let worker_tokens = s.metric("worker_tokens_total");

    // the worker killed between two requests: the next one finds its connection dead and runs locally
    let w_addr = w.addr.clone();
    drop(w);
    let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(got, want, "the fallback changed the answer");
    assert_eq!(s.metric("fallbacks_total"), 1.0, "{}", s.get("/metrics").1);
    assert_eq!(s.metric("worker_tokens_total"), worker_tokens);
    assert_eq!(s.metric("workers_connected"), 0.0);
    // and the server keeps answering, the same (trying the dead worker again or not, depending on its backoff)
    let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(got, want);
    assert_eq!(s.metric("workers_connected"), 0.0);

    // a worker back on the same address is used again once the backoff lets the server retry it (by a request or
    // an idle health ping)
    let w = worker_for(&m, &[], &["--listen", &w_addr]);
    let calls = s.metric("split_prefill_calls_total");
    let mut tries = 0;
    while s.metric("workers_connected") == 0.0 {
        tries += 1;
        assert!(tries <= 100, "the server never used the restarted worker");
        std::thread::sleep(Duration::from_millis(100));
        let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
        assert_eq!(got, want);
    }
    let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(got, want);
    assert!(s.metric("split_prefill_calls_total") > calls);
    assert_eq!(s.metric("workers_connected"), 1.0);
    drop((s, w));

    // a worker that dies in the middle of the request's prefill (it exits on the second frame after the
    // handshake: the host has sent ubatches and waits for the first one's result)
    let mut w = worker_for(&m, &[], &["--exit-after-frames", "2"]);
    let s = serve(&m, &refs(&split_flags(&w.addr)));
    let got = answer(&s.post_ok("/v1/completions", &greedy_ids_request()));
    assert_eq!(got, want, "the fallback mid-prefill changed the answer");
    let st = wait_exit(&mut w.child, Duration::from_secs(30)).expect("the worker should have died");
    assert_eq!(
        st.code(),
        Some(101),
        "the worker should have died on its frame"
    );
    assert_eq!(s.metric("fallbacks_total"), 1.0, "{}", s.get("/metrics").1);
    assert_eq!(s.metric("worker_tokens_total"), 0.0);
    assert_eq!(s.metric("workers_connected"), 0.0);
    assert_eq!(s.metric("requests_total{outcome=\"ok\"}"), 1.0);
}

/// A request of the load test and its expected outcome.
#[derive(Clone)]
struct Case {
    path: &'static str,
    body: Value,
    stream: bool,
    /// Non-streamed: the whole JSON answer's stable parts ([`stable`]); streamed: the assembled stream.
    want_json: Value,
    want_stream: Option<Streamed>,
}

/// The parts of an answer that are the same from one request to the next (no ids, timestamps, cache counts).
fn stable(path: &str, v: &Value) -> Value {
    let c = &v["choices"][0];
    if path.ends_with("chat/completions") {
        json!({"message": c["message"], "finish_reason": c["finish_reason"],
               "completion_tokens": v["usage"]["completion_tokens"]})
    } else {
        json!({"text": c["text"], "finish_reason": c["finish_reason"],
               "completion_tokens": v["usage"]["completion_tokens"]})
    }
}

/// The load test's requests: two completions and two chats, each streamed and not, answers computed one at a time
/// on `s` first.
fn load_cases(s: &Server) -> Vec<Case> {
    let bodies = [
        (
            "/v1/completions",
            json!({"prompt": "The old observatory stood on a hill", "max_tokens": 8, "temperature": 0}),
        ),
        (
            "/v1/completions",
            json!({"prompt": [5, 17, 99, 230, 7, 64, 301, 12], "max_tokens": 6, "temperature": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hello! Who are you?"}], "max_tokens": 8,
                   "temperature": 0}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "system", "content": "Answer briefly."},
                                {"role": "user", "content": "Name a planet."}],
                   "max_tokens": 10, "temperature": 0}),
        ),
    ];
    let mut cases = Vec::new();
    for (path, body) in bodies {
        let whole = s.post_ok(path, &body);
        let want_json = stable(path, &whole);
        cases.push(Case {
            path,
            body: body.clone(),
            stream: false,
            want_json: want_json.clone(),
            want_stream: None,
        });
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let r = s.post(path, &sb);
        assert_eq!(r.status(), 200);
        let streamed = assemble(&r.text().unwrap());
        // the stream says what the whole answer says
        let msg = &whole["choices"][0]["message"];
        let (text, reasoning) = if path.ends_with("chat/completions") {
            (
                msg["content"].as_str().unwrap_or("").to_string(),
                msg["reasoning_content"].as_str().unwrap_or("").to_string(),
            )
        } else {
            (
                whole["choices"][0]["text"].as_str().unwrap().to_string(),
                String::new(),
            )
        };
        let finish = whole["choices"][0]["finish_reason"]
            .as_str()
            .map(String::from);
        assert_eq!(
            streamed,
            Streamed {
                text,
                reasoning,
                finish_reason: finish,
                done: true,
                error: false
            },
            "{path} {body}: the stream differs from the whole answer"
        );
        cases.push(Case {
            path,
            body: sb,
            stream: true,
            want_json: Value::Null,
            want_stream: Some(streamed),
        });
    }
    cases
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    busy: AtomicU64,
    other: Mutex<BTreeMap<String, u64>>,
}

impl Tally {
    fn odd(&self, what: String) {
        *self.other.lock().unwrap().entry(what).or_default() += 1;
    }
}

/// One request of the load test, classified.
fn one(s: &Server, c: &Case, t: &Tally) {
    let r = match s.client.post(s.url(c.path)).json(&c.body).send() {
        Ok(r) => r,
        Err(e) => return t.odd(format!("{}: transport error {e}", c.path)),
    };
    let status = r.status().as_u16();
    if status == 503 {
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap_or("").to_string());
        let body = r.text().unwrap_or_default();
        if retry
            .as_ref()
            .is_some_and(|v| v.parse::<u64>().is_ok_and(|n| n >= 1))
            && body.contains("busy")
        {
            t.busy.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(20));
        } else {
            t.odd(format!("503 without Retry-After or busy: {retry:?} {body}"));
        }
        return;
    }
    let text = match r.text() {
        Ok(x) => x,
        Err(e) => return t.odd(format!("{} {status}: body error {e}", c.path)),
    };
    if status != 200 {
        return t.odd(format!("{} {status}: {text}", c.path));
    }
    let good = if c.stream {
        Some(assemble(&text)) == c.want_stream
    } else {
        serde_json::from_str::<Value>(&text).is_ok_and(|v| stable(c.path, &v) == c.want_json)
    };
    if good {
        t.ok.fetch_add(1, Ordering::Relaxed);
    } else {
        t.odd(format!(
            "{} stream={}: wrong answer {text}",
            c.path, c.stream
        ));
    }
}

#[test]
fn a_bounded_load_gets_exact_answers_or_503_and_memory_returns_to_its_baseline() {
    let s = Arc::new(serve(&tiny(), &["--parallel", "4", "--queue", "8"]));
    let cases = Arc::new(load_cases(&s));
    // warm-up: every case a few times so that the slots, the allocator and the runtime reach their working size
    for c in cases.iter().chain(cases.iter()) {
        let t = Tally::default();
        one(&s, c, &t);
        assert_eq!(
            t.ok.load(Ordering::Relaxed),
            1,
            "{:?}",
            t.other.lock().unwrap()
        );
    }
    let baseline = s.rss();

    let tally = Arc::new(Tally::default());
    let until = Instant::now() + Duration::from_secs(8);
    let threads: Vec<_> = (0..32usize)
        .map(|i| {
            let (s, cases, tally) = (s.clone(), cases.clone(), tally.clone());
            std::thread::spawn(move || {
                let mut k = i;
                while Instant::now() < until {
                    one(&s, &cases[k % cases.len()], &tally);
                    k += 1;
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let ok = tally.ok.load(Ordering::Relaxed);
    let busy = tally.busy.load(Ordering::Relaxed);
    let other = tally.other.lock().unwrap().clone();
    eprintln!("load: {ok} complete answers, {busy} × 503 busy, others {other:?}");
    assert!(other.is_empty(), "unexpected outcomes: {other:#?}");
    assert!(ok >= 8, "only {ok} answers");
    // every 503 was counted by the server as a rejection, every answer as a finished request
    assert_eq!(
        s.metric("requests_total{outcome=\"rejected\"}"),
        busy as f64
    );
    assert_eq!(s.metric("queue_depth"), 0.0);

    std::thread::sleep(Duration::from_secs(2));
    let after = s.rss();
    eprintln!(
        "RSS: {} KiB after the warm-up, {} KiB after the load",
        baseline >> 10,
        after >> 10
    );
    // Margin: the four slots keep their KV pages (a 4096-position f16 page of the tiny model's 2 attention layers is
    // 2 MiB) and at most 16 small recurrent-state checkpoints each (kilobytes here); the runtime's blocking threads
    // (tokenization) and the allocator's per-thread arenas keep some pages. 64 MiB is far above all of that and far
    // below what a leak of the 32 clients' requests over 8 s (thousands of requests) would leave.
    let margin = 64 << 20;
    assert!(
        after <= baseline + margin,
        "RSS {} MiB after the load vs {} MiB before",
        after >> 20,
        baseline >> 20
    );
    // the server still answers exactly
    let t = Tally::default();
    one(&s, &cases[0], &t);
    assert_eq!(t.ok.load(Ordering::Relaxed), 1);
}

#[test]
fn a_toml_config_file_sets_the_options_and_flags_override_it() {
    let d = tempfile::tempdir().unwrap();
    let cfg = d.path().join("serve.toml");
    std::fs::write(
        &cfg,
        "port = 0\nparallel = 2\nalias = \"m\"\napi_key = \"k\"\nthreads = 1\n",
    )
    .unwrap();
    let m = tiny();
    let c = cfg.to_str().unwrap();
    let s = serve_args(&["--config", c, "--model", m.to_str().unwrap()]);
    assert_eq!(s.name, "m");
    let (st, body) = s.get("/v1/models");
    assert_eq!(st, 401, "{body}");
    let r = s
        .client
        .get(s.url("/v1/models"))
        .bearer_auth("k")
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["data"][0]["id"], "m");
    assert_eq!(v["data"][0]["meta"]["slots"], 2);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 2}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    drop(s);

    // a flag wins over the file
    let s = serve_args(&[
        "--config",
        c,
        "--model",
        m.to_str().unwrap(),
        "--alias",
        "n",
        "--parallel",
        "1",
    ]);
    assert_eq!(s.name, "n");
    let r = s
        .client
        .get(s.url("/v1/models"))
        .bearer_auth("k")
        .send()
        .unwrap();
    let v: Value = r.json().unwrap();
    assert_eq!(v["data"][0]["id"], "n");
    assert_eq!(v["data"][0]["meta"]["slots"], 1);
    drop(s);

    // a key file on the command line wins over the file's key (the two flags conflict with each other)
    let kf = d.path().join("key.txt");
    std::fs::write(&kf, "k2\n").unwrap();
    let s = serve_args(&[
        "--config",
        c,
        "--model",
        m.to_str().unwrap(),
        "--api-key-file",
        kf.to_str().unwrap(),
    ]);
    let status = |key: &str| {
        let r = s.client.get(s.url("/v1/models")).bearer_auth(key).send();
        r.unwrap().status().as_u16()
    };
    assert_eq!((status("k"), status("k2")), (401, 200));
    drop(s);

    // malformed TOML, an unknown key, a nested table: a non-zero exit that names the problem
    let cases = [
        ("port = \n", "not valid TOML"),
        ("alias = \"m\nparallel = 2\n", "not valid TOML"),
        ("prallel = 2\n", "--prallel"),
        ("[server]\nport = 1\n", "server"),
    ];
    for (text, says) in cases {
        std::fs::write(&cfg, text).unwrap();
        let mut child = std::process::Command::new(common::bin())
            .args(["serve", "--config", c, "--model", m.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let st = wait_exit(&mut child, Duration::from_secs(60));
        if st.is_none() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve with a bad config {text:?} kept running");
        }
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert!(!st.unwrap().success(), "{text:?}");
        assert!(err.contains(says), "{text:?}: {err}");
        assert!(
            err.contains("serve.toml") || says.starts_with("--"),
            "{text:?}: {err}"
        );
    }
}

#[test]
fn curl_streams_a_chat_answer_ending_with_done() {
    if std::process::Command::new("curl")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_err()
    {
        eprintln!("note: curl is not on PATH; skipping the curl test");
        return;
    }
    let s = serve(&tiny(), &[]);
    let body =
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0});
    let whole = s.post_ok("/v1/chat/completions", &body);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let mut child = std::process::Command::new("curl")
        .args([
            "-sN",
            "--max-time",
            "60",
            "-H",
            "Content-Type: application/json",
        ])
        .arg("-d")
        .arg(sb.to_string())
        .arg(s.url("/v1/chat/completions"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().unwrap(), &mut out).unwrap();
    let st = wait_exit(&mut child, Duration::from_secs(70)).expect("curl ended");
    assert!(st.success(), "curl: {st:?}");
    let data = serve_util::sse_data(&out);
    assert!(data.len() >= 3, "{out}");
    assert_eq!(data.last().unwrap(), "[DONE]", "{out}");
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    let got = assemble(&out);
    let msg = &whole["choices"][0]["message"];
    assert_eq!(got.text, msg["content"].as_str().unwrap_or(""));
    assert_eq!(
        got.reasoning,
        msg["reasoning_content"].as_str().unwrap_or("")
    );
    assert_eq!(
        got.finish_reason.as_deref(),
        whole["choices"][0]["finish_reason"].as_str()
    );
}

#[test]
fn sigterm_during_a_stream_ends_it_with_done_and_exits_zero() {
    // a 16k-token prompt prefilled one token per step: many seconds of work on any machine, so the request is still
    // running when the grace second is over and is cancelled then (between two steps)
    let mut s = serve(
        &tiny(),
        &["--grace", "1", "--ubatch", "1", "--ctx-size", "32768"],
    );
    let ids: Vec<u32> = (0..16_000u32).map(|i| (i * 37 + 11) % 440).collect();
    let body = json!({"prompt": ids, "max_tokens": 100000, "temperature": 0, "stream": true,
                      "stream_options": {"include_usage": true}});
    // the answer's headers come when a slot took the request, before its first token
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status(), 200);
    sigterm(s.child.id());
    let mut body = String::new();
    std::io::Read::read_to_string(&mut std::io::BufReader::new(r), &mut body).unwrap();
    let got = assemble(&body);
    let data = serve_util::sse_data(&body);
    let usage = data
        .iter()
        .rev()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find(|v| v["usage"].is_object())
        .map(|v| v["usage"].clone());
    eprintln!(
        "SIGTERM: {} chunks, finish_reason {:?}, usage {usage:?}",
        data.len(),
        got.finish_reason
    );
    assert!(got.done, "no [DONE] at the end: {body}");
    assert!(!got.error, "{body}");
    assert!(got.finish_reason.is_some(), "{body}");
    assert_eq!(usage.expect("a usage chunk")["prompt_tokens"], 16_000);
    let st = wait_exit(&mut s.child, Duration::from_secs(30)).expect("the server should exit");
    assert_eq!(st.code(), Some(0), "stderr:\n{}", s.stderr());
}

#[test]
fn a_second_signal_during_the_grace_exits_at_once() {
    // a long prefill (as above) and a long grace: the first SIGTERM starts draining, the second exits with 143
    let mut s = serve(
        &tiny(),
        &["--grace", "120", "--ubatch", "1", "--ctx-size", "32768"],
    );
    let ids: Vec<u32> = (0..16_000u32).map(|i| (i * 37 + 11) % 440).collect();
    let body = json!({"prompt": ids, "max_tokens": 100000, "temperature": 0, "stream": true});
    let r = s.post("/v1/completions", &body);
    assert_eq!(r.status(), 200);
    sigterm(s.child.id());
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        s.child.try_wait().unwrap().is_none(),
        "the first SIGTERM drains, within the 120 s grace"
    );
    sigterm(s.child.id());
    let st =
        wait_exit(&mut s.child, Duration::from_secs(10)).expect("the second SIGTERM exits at once");
    assert_eq!(st.code(), Some(143), "stderr:\n{}", s.stderr());
    let said = |s: &Server| {
        s.stderr()
            .contains("SIGTERM again: exiting without waiting")
    };
    let t0 = std::time::Instant::now();
    while !said(&s) && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20)); // the log reader may lag the exit
    }
    assert!(said(&s), "{}", s.stderr());
    drop(r);
}

#[test]
fn sigterm_lets_a_short_stream_finish_within_the_grace() {
    let mut s = serve(&tiny(), &["--grace", "10"]);
    let body = json!({"prompt": prompt_ids(), "max_tokens": 40, "temperature": 0});
    let whole = s.post_ok("/v1/completions", &body);
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let r = s.post("/v1/completions", &sb);
    assert_eq!(r.status(), 200);
    sigterm(s.child.id());
    let text = r.text().unwrap();
    let got = assemble(&text);
    assert_eq!(
        got,
        Streamed {
            text: whole["choices"][0]["text"].as_str().unwrap().into(),
            reasoning: String::new(),
            finish_reason: whole["choices"][0]["finish_reason"]
                .as_str()
                .map(String::from),
            done: true,
            error: false,
        },
        "{text}"
    );
    let st = wait_exit(&mut s.child, Duration::from_secs(30)).expect("the server should exit");
    assert_eq!(st.code(), Some(0), "stderr:\n{}", s.stderr());
}

#[test]
fn a_speculating_server_answers_as_a_plain_one_and_reports_its_drafts() {
    // a prompt that repeats, so that prompt lookup drafts; two slots, so speculating jobs run beside batched ones
    let ids: Vec<u32> = (0..40u32).map(|i| (i % 8) * 37 % 440).collect();
    let req = json!({"prompt": ids, "max_tokens": 24, "temperature": 0, "cache_prompt": false});
    let sampled = json!({"prompt": ids, "max_tokens": 24, "temperature": 0.9, "seed": 5, "cache_prompt": false});
    let plain = serve(&tiny(), &["--parallel", "2"]);
    let (want, want_s) = (
        plain.post_ok("/v1/completions", &req),
        plain.post_ok("/v1/completions", &sampled),
    );
    assert!(want["usage"].get("completion_tokens_details").is_none());
    let spec = serve(
        &tiny(),
        &["--parallel", "2", "--spec", "ngram", "--draft-max", "4"],
    );
    let got = spec.post_ok("/v1/completions", &req);
    let got_s = spec.post_ok("/v1/completions", &sampled);
    assert_eq!(answer(&got), answer(&want));
    assert_eq!(answer(&got_s), answer(&want_s));
    let d = &got["usage"]["completion_tokens_details"];
    let (acc, rej) = (
        d["accepted_prediction_tokens"].as_u64().unwrap(),
        d["rejected_prediction_tokens"].as_u64().unwrap(),
    );
    let drafted = spec.metric("spec_draft_tokens_total") as u64;
    let accepted = spec.metric("spec_accepted_tokens_total") as u64;
    let d_s = &got_s["usage"]["completion_tokens_details"];
    let acc_s = d_s["accepted_prediction_tokens"].as_u64().unwrap();
    let rej_s = d_s["rejected_prediction_tokens"].as_u64().unwrap();
    assert_eq!(
        accepted,
        acc + acc_s,
        "/metrics counts every response's accepted drafts"
    );
    assert_eq!(drafted, acc + rej + acc_s + rej_s);
    assert_eq!(spec.metric("generated_tokens_total") as u64, 48);
    // /slots says which server speculates (llama-server's field)
    for (server, on) in [(&spec, true), (&plain, false)] {
        let (code, body) = server.get("/slots");
        assert_eq!(code, 200);
        let slots: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(slots[0]["speculative"], on, "{body}");
    }
}
