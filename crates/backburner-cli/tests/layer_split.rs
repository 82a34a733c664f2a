//! Layer split with real processes: the host loads layers [0, L1) and the ends, one worker or a chain of two hold
//! the rest; tokens and logits equal the local run's. A stalled, cut or corrupting link is retried once on a fresh
//! connection (the local output again); a worker killed during prefill or decode, or a link that stays bad, fails
//! the request with a typed error within the deadlines (no hang), and a session that lost its worker re-ingests its
//! history once a worker is back on the same address.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::{argmax, EngineError, Logits, Session, SessionOptions, WorkerSettings};
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig};
use common::*;

#[test]
fn one_worker_and_a_chain_of_two_give_the_local_tokens_and_logits() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    let a = worker(&[]);
    let b = worker(&[]);
    let c = worker(&[]);
    for (name, flags) in [
        ("one", vec!["--worker", &a.addr, "--layer-split", "4"]),
        (
            "two",
            vec![
                "--worker",
                &b.addr,
                "--worker",
                &c.addr,
                "--layer-split",
                "4,6",
            ],
        ),
    ] {
        let f = d.path().join(format!("{name}.bin"));
        let out = host(&flags, &f);
        assert_eq!(out["tokens"], local["tokens"], "{name}");
        assert!(
            std::fs::read(&f).unwrap() == std::fs::read(d.path().join("local.bin")).unwrap(),
            "{name}: logits differ"
        );
        let link = &out["link"];
        assert_eq!(link["mode"], "layer_split");
        assert_eq!(link["worker_layers"], 4, "{link}");
        assert_eq!(link["host_layers"], serde_json::json!([0, 4]));
        assert_eq!(
            (&link["failures"], &link["retries"]),
            (&0.into(), &0.into())
        );
        // speculating through the workers: the same tokens and logits
        let f = d.path().join(format!("{name}-spec.bin"));
        let spec_flags = [
            "--spec",
            "ngram",
            "--draft-max",
            "4",
            "--ngram-min",
            "1",
            "--ngram-max",
            "2",
        ];
        let spec = host(&[&flags[..], &spec_flags].concat(), &f);
        assert_eq!(spec["tokens"], local["tokens"], "{name} --spec ngram");
        assert!(
            std::fs::read(&f).unwrap() == std::fs::read(d.path().join("local.bin")).unwrap(),
            "{name} --spec ngram: logits differ"
        );
        // 1- and 2-gram drafts: the fixture's greedy text repeats a token, so verify steps ran through the workers
        let c = &spec["speculative"];
        assert!(c["drafted"].as_u64().unwrap() > 0, "{name}: {c}");
        assert_eq!(spec["link"]["verify_calls"], c["steps"], "{name}");
    }
}

#[test]
fn bad_split_points_are_refused_before_any_worker_is_used() {
    for (flags, want) in [
        (
            vec!["--worker", "127.0.0.1:9", "--layer-split", "4,6"],
            "2 split points for 1 --worker",
        ),
        (
            vec!["--worker", "127.0.0.1:9", "--layer-split", "8"],
            "leaves worker 1 no layers",
        ),
        (
            vec![
                "--worker",
                "127.0.0.1:9",
                "--worker",
                "127.0.0.1:10",
                "--layer-split",
                "6,4",
            ],
            "must increase",
        ),
        (
            vec![
                "--worker",
                "127.0.0.1:9",
                "--worker",
                "localhost:9",
                "--layer-split",
                "4,6",
            ],
            "--worker localhost:9 is given twice (as 127.0.0.1:9 before)",
        ),
    ] {
        let o = run_tiny(&flags);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains(want), "{flags:?}: {err}");
    }
}

#[test]
fn a_worker_killed_during_prefill_or_decode_fails_the_request_without_a_hang() {
    // session frames: 336 prompt tokens in ubatches of 64 → 6 RunLayers; then one per decode step
    for (what, after) in [("prefill", "3"), ("decode", "9")] {
        let mut a = worker(&["--exit-after-frames", after]);
        let t = Instant::now();
        let o = run_tiny(&[
            "--worker",
            &a.addr,
            "--layer-split",
            "4",
            "--worker-timeout",
            "5",
        ]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(
            err.contains(&format!("worker {} holding layers 4..8 is lost", a.addr)),
            "{what}: {err}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{what}: took {:?}",
            t.elapsed()
        );
        assert_eq!(a.child.wait().unwrap().code(), Some(101), "{what}");
    }
}

fn prompt_ids() -> Vec<u32> {
    (0..150u32).map(|i| (i * 7919 + 13) % 500).collect()
}

fn opts() -> SessionOptions {
    SessionOptions {
        ubatch: 64,
        ..SessionOptions::default()
    }
}

/// Greedy tokens of the whole model, locally.
fn local_tokens(n: usize) -> Vec<u32> {
    let m = Arc::new(Model::load(&fixture("tiny-f32")).unwrap());
    let mut s = Session::new(m, opts()).unwrap();
    let mut l = s.prefill(&prompt_ids(), Logits::Last, |_, _| {}).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let t = argmax(&l);
        out.push(t);
        l = s.decode(t).unwrap();
    }
    out
}

fn split_session(addr: &str) -> Session {
    let dir = fixture("tiny-f32");
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let load = LoadOptions {
        layers: 0..4,
        ends: true,
    };
    let m = Arc::new(Model::from_checkpoint(cfg, &ck, &load, |_, _| {}).unwrap());
    let mut st = WorkerSettings::new(addr, 1);
    st.timeout = Duration::from_secs(5);
    let conn = Connection::new(st, backburner_engine::split::dir_fingerprint(dir));
    let chain = LayerSplit::from_parts(m.config(), vec![(conn, 4..8)]).unwrap();
    Session::with_layer_split(m, opts(), chain).unwrap()
}

#[test]
fn after_a_kill_the_next_request_rebuilds_on_the_restarted_worker() {
    let want = local_tokens(8);
    // session frames: the first request's 100 tokens are 2 ubatches, the second's 50 one, then one per decode step
    for (what, after) in [("prefill", "3"), ("decode", "6")] {
        let mut a = worker(&["--exit-after-frames", after]);
        let addr = a.addr.clone();
        let mut s = split_session(&addr);
        // the prompt in two requests, then decode: the kill lands in the first or second part
        let p = prompt_ids();
        let mut fed = 0usize;
        let mut next = None;
        let mut err = None;
        for part in [&p[..100], &p[100..]] {
            match s.prefill(part, Logits::Last, |_, _| {}) {
                Ok(l) => {
                    fed += part.len();
                    next = Some(argmax(&l));
                }
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        let mut toks = Vec::new();
        while err.is_none() && toks.len() < 8 {
            let t = next.unwrap();
            toks.push(t);
            match s.decode(t) {
                Ok(l) => next = Some(argmax(&l)),
                Err(e) => err = Some(e),
            }
        }
        let err = err.unwrap_or_else(|| panic!("{what}: the worker was not lost"));
        assert!(
            matches!(err, EngineError::WorkerLost { .. }),
            "{what}: {err}"
        );
        assert_eq!(a.child.wait().unwrap().code(), Some(101));
        let kept = s.tokens().len();
        assert_eq!(kept, fed + toks.len().saturating_sub(1), "{what}");
        // a worker back on the same address: the next request re-ingests the history and goes on
        let port = addr.rsplit(':').next().unwrap();
        let _b = worker(&["--listen", &format!("127.0.0.1:{port}")]);
        if fed < p.len() {
            let l = s.prefill(&p[fed..], Logits::Last, |_, _| {}).unwrap();
            next = Some(argmax(&l));
        } else {
            // the failed decode step's token is fed again
            let l = s.decode(*toks.last().unwrap()).unwrap();
            next = Some(argmax(&l));
        }
        if fed < p.len() {
            toks.clear();
        }
        while toks.len() < 8 {
            let t = next.unwrap();
            toks.push(t);
            next = Some(argmax(&s.decode(t).unwrap()));
        }
        assert_eq!(toks, want, "{what}");
        assert_eq!(s.layer_split().unwrap().stats().rebuilds, 1, "{what}");
    }
}

/// Link faults for a layer split through a relay, each named.
fn bad_links() -> [(&'static str, backburner_link::relay::Fault); 5] {
    use backburner_link::relay::{Dir, Fault};
    // to the host: ~0.3 KB of handshake, 5 LayersDone of 16 KiB (64 tokens × hidden 64 × f32) and one of 4 KiB
    // (336 prompt tokens: ~86.5 KB before decode), then 256 B + framing per decode step: 88 000 is a few steps in
    [
        (
            "stalled worker in prefill",
            Fault::Stall {
                dir: Dir::ToHost,
                after: 30_000,
            },
        ),
        (
            "stalled worker in decode",
            Fault::Stall {
                dir: Dir::ToHost,
                after: 88_000,
            },
        ),
        (
            "stalled host in prefill",
            Fault::Stall {
                dir: Dir::ToWorker,
                after: 40_000,
            },
        ),
        (
            "flipped byte in a residual",
            Fault::FlipByte {
                dir: Dir::ToHost,
                at: 50_000,
            },
        ),
        (
            "cut connection",
            Fault::CloseAfter {
                dir: Dir::ToHost,
                after: 88_500,
            },
        ),
    ]
}

#[test]
fn a_bad_link_is_retried_once_and_one_that_stays_bad_fails_within_the_deadlines_with_a_typed_error()
{
    use backburner_link::relay::{Fault, Relay};
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    let w = worker(&[]);
    let upstream = w.addr.parse().unwrap();
    let flags = |addr: &str| -> Vec<String> {
        [
            "--worker",
            addr,
            "--layer-split",
            "4",
            "--worker-timeout",
            "2",
        ]
        .map(String::from)
        .to_vec()
    };
    for (i, (what, fault)) in bad_links().into_iter().enumerate() {
        // one bad connection: the request reconnects once, re-ingests and gives the local output, bit for bit
        let relay = Relay::start(upstream, fault, 1).unwrap();
        let f = d.path().join(format!("retried{i}.bin"));
        let out = host(&refs(&flags(&relay.addr().to_string())), &f);
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert!(
            std::fs::read(&f).unwrap() == std::fs::read(d.path().join("local.bin")).unwrap(),
            "{what}: logits differ"
        );
        let link = &out["link"];
        assert_eq!(
            (&link["failures"], &link["retries"]),
            (&1.into(), &1.into()),
            "{what}: {link}"
        );
        assert_eq!(relay.connections(), 2, "{what}");
        if !matches!(
            fault,
            Fault::Stall { after: 88_000, .. } | Fault::CloseAfter { .. }
        ) {
            continue;
        }
        // every connection bad: the retry fails too, and the request fails with the typed error
        let relay = Relay::start(upstream, fault, usize::MAX).unwrap();
        let t = Instant::now();
        let o = run_tiny(&refs(&flags(&relay.addr().to_string())));
        let took = t.elapsed();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{what}: {err}");
        assert!(err.contains("holding layers 4..8 is lost"), "{what}: {err}");
        assert!(
            err.contains("retried once on a fresh session"),
            "{what}: {err}"
        );
        assert_eq!(relay.connections(), 2, "{what}");
        // two tries, each within its deadline of 2 s plus transfer and compute allowances; never a hang
        assert!(took < Duration::from_secs(16), "{what}: took {took:?}");
    }
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
