//! `/health` and the worker gauges of `/metrics` with workers the answers need: a layer-split worker or the only
//! KV-offload worker going away turns `/health` into a 503 `degraded` naming it (found by the idle health pings,
//! with no request needed), and its return turns it back to `ok`; a split-prefill worker is never needed (the
//! host prefills locally), so its loss leaves `/health` at `ok`. `--queue 0` refuses a request that would wait.

use crate::common;
use crate::serve_util;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use common::{fixture, worker_for};
use serve_util::{serve, Server};

/// The server's idle ping interval in these tests (seconds).
const PING: &str = "0.2";

fn request() -> Value {
    let prompt: Vec<u32> = (0..24u32).map(|i| (i * 37 + 11) % 440).collect();
    json!({"prompt": prompt, "max_tokens": 6, "temperature": 0})
}

/// `/health`'s status code and body.
fn health(s: &Server) -> (u16, Value) {
    let (code, body) = s.get("/health");
    (code, serde_json::from_str(&body).expect("/health is JSON"))
}

/// Polls `/health` until its status is `want` (bounded), returning the last body.
fn wait_health(s: &Server, want: &str) -> Value {
    let t = Instant::now();
    loop {
        let (code, body) = health(s);
        if body["status"] == want {
            assert_eq!(code, if want == "ok" { 200 } else { 503 }, "{body}");
            return body;
        }
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "/health stayed {body} instead of {want}; server log:\n{}",
            s.stderr()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn text(v: &Value) -> Value {
    v["choices"][0]["text"].clone()
}

#[test]
fn a_layer_split_worker_gone_makes_health_degraded_until_it_is_back() {
    let m = fixture("tiny-hub");
    let local = serve(&m, &[]);
    let want = text(&local.post_ok("/v1/completions", &request()));
    drop(local);

    let w = worker_for(&m, &[], &[]);
    let addr = w.addr.clone();
    let s = serve(
        &m,
        &[
            "--worker",
            &addr,
            "--layer-split",
            "4",
            "--worker-ping",
            PING,
        ],
    );
    // before the first request no connection exists yet: nothing is known to be wrong
    let (code, body) = health(&s);
    assert_eq!((code, &body["status"]), (200, &json!("ok")), "{body}");
    assert_eq!(body["workers_attached"], 1);
    assert_eq!(text(&s.post_ok("/v1/completions", &request())), want);
    assert_eq!(s.metric("workers_attached"), 1.0);
    assert_eq!(s.metric("workers_connected"), 1.0);

    // the worker killed while the server is idle: the pings find out
    drop(w);
    let body = wait_health(&s, "degraded");
    let reason = body["reason"].as_str().unwrap();
    assert!(
        reason.contains(&addr) && reason.contains("layers 4..8"),
        "{reason}"
    );
    assert_eq!(body["workers_connected"], 0);
    assert_eq!(s.metric("workers_connected"), 0.0);
    assert_eq!(s.metric("workers_attached"), 1.0);
    assert!(s.metric("worker_ping_failures_total") >= 1.0);
    // a request meanwhile gets the typed error, not a wrong answer
    let r = s.post("/v1/completions", &request());
    assert_eq!(r.status().as_u16(), 503, "{}", r.text().unwrap());

    // back on the same address: the pings reconnect, `/health` is ok, and the answer is the local one
    let w = worker_for(&m, &[], &["--listen", &addr]);
    wait_health(&s, "ok");
    assert_eq!(s.metric("workers_connected"), 1.0);
    assert_eq!(text(&s.post_ok("/v1/completions", &request())), want);

    // a hung worker (stopped, not gone: its connection stays open) is found by a ping's own short deadline, not by
    // the 60 s --worker-timeout of a request; resumed, it serves again
    signal(w.child.id(), libc::SIGSTOP);
    let t = std::time::Instant::now();
    let body = wait_health(&s, "degraded");
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "a hung worker took {:?} to notice",
        t.elapsed()
    );
    assert!(body["reason"].as_str().unwrap().contains(&addr), "{body}");
    signal(w.child.id(), libc::SIGCONT);
    wait_health(&s, "ok");
    assert_eq!(text(&s.post_ok("/v1/completions", &request())), want);
    drop(w);
}

/// Sends `sig` to `pid`.
fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) on a child's pid with a valid signal number has no memory effects here.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill -{sig} {pid}");
}

#[test]
fn the_only_offload_worker_gone_degrades_health_and_a_split_prefill_worker_does_not() {
    let m = fixture("tiny-hub");
    // KV offload: pages past 128 positions go to the worker
    let w = worker_for(&m, &[], &[]);
    let flags = [
        "--ubatch",
        "64",
        "--kv-page-size",
        "64",
        "--kv-budget",
        "128",
        "--worker",
        &w.addr,
        "--worker-ping",
        PING,
    ];
    let s = serve(&m, &flags);
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 37 + 11) % 440).collect();
    let first = s.post_ok(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4, "temperature": 0}),
    );
    assert_eq!(first["usage"]["prompt_tokens"], 200);
    assert!(
        s.metric("kv_pages_on_workers") > 0.0,
        "{}",
        s.get("/metrics").1
    );
    assert_eq!(health(&s).0, 200);
    drop(w);
    let body = wait_health(&s, "degraded");
    assert!(
        body["reason"].as_str().unwrap().contains("KV-offload"),
        "{body}"
    );
    drop(s);

    // split prefill only: the host can always prefill alone, so the worker's loss is not a health problem
    let w = worker_for(&m, &[], &[]);
    let s = serve(
        &m,
        &[
            "--ubatch",
            "8",
            "--split-min-tokens",
            "16",
            "--worker",
            &w.addr,
            "--worker-ping",
            PING,
        ],
    );
    s.post_ok("/v1/completions", &request());
    assert_eq!(s.metric("workers_connected"), 1.0);
    drop(w);
    let t = Instant::now();
    while s.metric("workers_connected") != 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the ping never failed"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, body) = health(&s);
    assert_eq!((code, &body["status"]), (200, &json!("ok")), "{body}");
}

#[test]
fn queue_zero_refuses_a_request_that_would_wait() {
    let m = fixture("tiny-hub");
    let s = serve(&m, &["--queue", "0"]);
    // a long generation holds the only slot
    let long =
        json!({"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0, "ignore_eos": true});
    let url = s.url("/v1/completions");
    let busy = std::thread::spawn(move || {
        serve_util::client()
            .post(url)
            .json(&long)
            .send()
            .map(|r| r.status().as_u16())
    });
    let t = Instant::now();
    while s.metric("requests_running") < 1.0 {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "the long request never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let r = s.post("/v1/completions", &request());
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body: Value = r.json().unwrap();
    assert!(
        body["error"]["message"].as_str().unwrap().contains("busy"),
        "{body}"
    );
    drop(s);
    let _ = busy.join();
}
