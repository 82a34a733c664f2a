//! KV offload with real processes: a host whose `--kv-budget` is smaller than the prompt refuses without a worker
//! and gives the unbounded run's tokens and logits with one; a worker killed mid-prefill or mid-decode is replaced
//! by re-ingesting on the second worker (same tokens), or, with no worker left, fails with a typed error naming the
//! budget.

use crate::common;

use common::*;

const BUDGET: &[&str] = &["--kv-page-size", "64", "--kv-budget", "128"];

#[test]
fn a_prompt_past_the_budget_needs_a_worker_and_then_gives_the_local_bits() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&["--kv-page-size", "64"], &d.path().join("local.bin"));
    let n_prompt = local["prompt_tokens"].as_array().unwrap().len();
    assert!(
        n_prompt > 2 * 128,
        "the fixture prompt has {n_prompt} tokens"
    );
    // alone: a typed error naming the budget, before any compute
    let o = run_tiny(BUDGET);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--kv-budget allows 128") && err.contains(&format!("{n_prompt} positions")),
        "{err}"
    );
    // with a worker: the same tokens and logits, most of the cache on the worker
    let w = worker(&[]);
    let f = d.path().join("offload.bin");
    let out = host(&[BUDGET, &["--worker", &w.addr]].concat(), &f);
    assert_eq!(out["tokens"], local["tokens"]);
    assert!(
        std::fs::read(&f).unwrap() == std::fs::read(d.path().join("local.bin")).unwrap(),
        "logits differ"
    );
    let link = &out["link"];
    let total = n_prompt + 11;
    let held = link["positions_on_workers"].as_u64().unwrap() as usize;
    assert!(total - held <= 128 && held.is_multiple_of(64), "{link}");
    assert_eq!(
        link["pages_on_workers"].as_u64().unwrap() as usize,
        held / 64 * 2
    );
    assert!(link["bytes_per_decode_token"].as_u64().unwrap() > 0);
    assert_eq!(link["offload_failures"], 0);
    // the host's layers on a device (the device layer's CPU backend), the pages on the worker: the same bits
    let f = d.path().join("device.bin");
    let dev = ["--device", "cpu", "--device-cpu-backend"];
    let out = host(&[BUDGET, &dev, &["--worker", &w.addr]].concat(), &f);
    assert_eq!(out["tokens"], local["tokens"]);
    assert!(
        std::fs::read(&f).unwrap() == std::fs::read(d.path().join("local.bin")).unwrap(),
        "logits differ with layers on a device"
    );
    assert_eq!(out["link"]["pages_on_workers"], link["pages_on_workers"]);
}

#[test]
fn a_worker_killed_mid_prefill_or_mid_decode_is_replaced_by_the_next_with_the_same_tokens() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&["--kv-page-size", "64"], &d.path().join("local.bin"));
    // session frames to the first worker: from the third ubatch of 64 a PagesPut and an Attend per attention
    // layer (2) per ubatch, then 2 Attends per decode step: frame 2 is in prefill, frame 24 in decode
    for (what, after) in [("mid-prefill", "2"), ("mid-decode", "24")] {
        let mut a = worker(&["--exit-after-frames", after]);
        let b = worker(&[]);
        let f = d.path().join(format!("{what}.bin"));
        let out = host(
            &[
                BUDGET,
                &[
                    "--worker",
                    &a.addr,
                    "--worker",
                    &b.addr,
                    "--worker-timeout",
                    "10",
                ],
            ]
            .concat(),
            &f,
        );
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert_eq!(out["link"]["offload_failures"], 1, "{what}");
        let st = a.child.wait().unwrap();
        assert_eq!(
            st.code(),
            Some(101),
            "{what}: the first worker should have died"
        );
    }
}

#[test]
fn a_lone_worker_killed_mid_prefill_fails_the_request_with_the_budget_named() {
    let w = worker(&["--exit-after-frames", "2"]);
    let o = run_tiny(&[BUDGET, &["--worker", &w.addr, "--worker-timeout", "10"]].concat());
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--kv-budget allows 128"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn a_stalled_or_corrupting_worker_holding_pages_is_replaced_within_the_deadline() {
    use backburner_link::relay::{Dir, Fault, Relay};
    use std::time::{Duration, Instant};
    let d = tempfile::tempdir().unwrap();
    let local = host(&["--kv-page-size", "64"], &d.path().join("local.bin"));
    let a = worker(&[]);
    let b = worker(&[]);
    let upstream = a.addr.parse().unwrap();
    let through = |relay: &Relay, f: &str| {
        let r = relay.addr().to_string();
        let t = Instant::now();
        let out = host(
            &[
                BUDGET,
                &["--worker", &r, "--worker", &b.addr, "--worker-timeout", "2"],
            ]
            .concat(),
            &d.path().join(f),
        );
        (out, t.elapsed())
    };
    // a clean run through the relay: the bytes the host receives from the first worker
    let clean = Relay::start(upstream, Fault::None, 1).unwrap();
    let (out, _) = through(&clean, "clean.bin");
    assert_eq!(out["tokens"], local["tokens"]);
    let got = out["link"]["bytes_received"].as_u64().unwrap();
    // decode steps receive ~1.2 KB each (two partials of 4 heads × 33 f32 and their frames); prefill the rest
    let cases = [
        (
            "stalled mid-prefill",
            Fault::Stall {
                dir: Dir::ToHost,
                after: got / 3,
            },
        ),
        (
            "stalled mid-decode",
            Fault::Stall {
                dir: Dir::ToHost,
                after: got - 3_000,
            },
        ),
        (
            "a flipped byte in partials",
            Fault::FlipByte {
                dir: Dir::ToHost,
                at: got / 2,
            },
        ),
    ];
    for (what, fault) in cases {
        let relay = Relay::start(upstream, fault, 1).unwrap();
        let (out, took) = through(&relay, "faulty.bin");
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert_eq!(out["link"]["offload_failures"], 1, "{what}");
        assert!(took < Duration::from_secs(30), "{what}: took {took:?}");
    }
}

#[test]
fn a_lone_worker_killed_mid_decode_ends_the_run_with_the_tokens_so_far_and_the_error() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&["--kv-page-size", "64"], &d.path().join("local.bin"));
    let w = worker(&["--exit-after-frames", "24"]);
    let o = run_tiny(&[BUDGET, &["--worker", &w.addr, "--worker-timeout", "10"]].concat());
    assert_eq!(o.status.code(), Some(1));
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["stop_reason"], "error");
    let got = out["tokens"].as_array().unwrap();
    let want = local["tokens"].as_array().unwrap();
    assert!(
        !got.is_empty() && got.len() < want.len() && *got == want[..got.len()],
        "{out}"
    );
    assert!(
        out["error"]
            .as_str()
            .unwrap()
            .contains("--kv-budget allows 128"),
        "{out}"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&format!("generation stopped after {} tokens", got.len())),
        "{err}"
    );
}
