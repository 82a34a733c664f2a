//! Transient worker faults through the serving engine: requests that arrive while a KV-offload worker waits out its
//! backoff are delayed (their slot only: the other slots go on decoding) and then served with the bits of a cold run;
//! a worker that is really gone fails each request once with its typed error, and no request hangs.

use crate::faults::{budgeted, host_model, layer_split};
use crate::worker_common;

use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use backburner_engine::serve::{CacheLimits, Engine, Event, Job, Metrics, ServeOptions};
use backburner_engine::{generate, GenerateParams, Generation, Session};
use backburner_model::Model;
use worker_common::*;

/// The events of every job, in the order the scheduler sent them: (job name, event).
type Log = Arc<Mutex<Vec<(String, String)>>>;

fn serve(sessions: Vec<Session>) -> Engine {
    let o = ServeOptions {
        queue: 8,
        cache: CacheLimits::default(),
        ..Default::default()
    };
    Engine::start(sessions, None, o).unwrap()
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        keep_logits: true,
        ..GenerateParams::default()
    }
}

/// Submits `prompt` as job `name`; its events go to the receiver and, by kind, to `log`.
fn submit(e: &Engine, log: &Log, name: &str, prompt: &[u32], max_tokens: usize) -> Receiver<Event> {
    let (tx, rx) = channel();
    let (log, name2) = (log.clone(), name.to_string());
    e.submit(Job {
        id: name.into(),
        prompt: prompt.to_vec(),
        params: greedy(max_tokens),
        stable_prefix: None,
        cache_prompt: true,
        siblings: Vec::new(),
        events: Box::new(move |ev| {
            let kind = match &ev {
                Event::Started { .. } => "started",
                Event::Token { .. } => "token",
                Event::Done { .. } => "done",
                Event::Failed(_) => "failed",
            };
            log.lock().unwrap().push((name2.clone(), kind.into()));
            tx.send(ev).is_ok()
        }),
    })
    .unwrap();
    rx
}

/// Every event of a job until its sink is dropped (its job left the scheduler); panics past a minute (a hang).
fn events(rx: Receiver<Event>) -> Vec<Event> {
    let mut out = Vec::new();
    loop {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(ev) => out.push(ev),
            Err(RecvTimeoutError::Disconnected) => return out,
            Err(RecvTimeoutError::Timeout) => panic!("a job hung; its events so far: {out:?}"),
        }
    }
}

/// The generation of a job that finished, checked against `want` (tokens and every logit's bits).
fn served(rx: Receiver<Event>, want: &Generation, what: &str) {
    let evs = events(rx);
    let Some(Event::Done { generation, .. }) = evs.last() else {
        panic!("{what}: not served: {evs:?}");
    };
    assert_eq!(generation.tokens, want.tokens, "{what}: tokens");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&generation.step_logits) == bits(&want.step_logits),
        "{what}: logits differ in bits"
    );
}

/// The error of a job that failed once: exactly `Started` then `Failed`.
fn failed(rx: Receiver<Event>, what: &str) -> backburner_engine::EngineError {
    let mut evs = events(rx);
    assert_eq!(evs.len(), 2, "{what}: {evs:?}");
    assert!(matches!(evs[0], Event::Started { .. }), "{what}: {evs:?}");
    match evs.pop() {
        Some(Event::Failed(e)) => e,
        other => panic!("{what}: expected one failure, got {other:?}"),
    }
}

fn cold(model: &Arc<Model>, prompt: &[u32], max_tokens: usize) -> Generation {
    let mut s = Session::new(model.clone(), opts()).unwrap();
    generate(
        &mut s,
        prompt,
        &greedy(max_tokens),
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap()
}

#[test]
fn requests_arriving_during_a_backoff_wait_for_it_without_holding_the_other_slot_and_are_served() {
    let f = model_with_layers(8, 61);
    let w = start_worker(f.dir.path(), None, None);
    let addr = w.addr.clone();
    let slot = || {
        let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
        s.attach_worker(client(f.dir.path(), &addr, Some(4), b""));
        s
    };
    let e = serve(vec![slot(), slot()]);
    let log: Log = Default::default();
    let (p1, p3, p5) = (prompt(5 * 64 + 3, 1), prompt(4 * 64 + 9, 3), prompt(20, 5));
    served(
        submit(&e, &log, "r1", &p1, 4),
        &cold(&f.model, &p1, 4),
        "r1",
    );
    // the worker goes away: r2 continues r1's conversation, loses the pages, and its one retry finds nothing
    // listening: it fails with the typed error, and the connection backs off (1 s after two failures)
    drop(w);
    let p2 = [&p1[..], &prompt(9, 2)].concat();
    let err = failed(submit(&e, &log, "r2", &p2, 4), "r2");
    assert!(
        matches!(&err, backburner_engine::EngineError::KvBudget { why, .. } if why.contains(&addr)),
        "{err}"
    );
    // the worker is back during the backoff. r5 takes the other slot (it needs no worker: its 20 + 48 tokens fit the
    // budget), then r3 comes to r2's slot, where its pages can only go to the worker in backoff: it waits
    let _back = start_worker_on(f.dir.path(), &addr);
    let r5 = submit(&e, &log, "r5", &p5, 48);
    let r3 = submit(&e, &log, "r3", &p3, 6);
    served(r5, &cold(&f.model, &p5, 48), "r5");
    served(r3, &cold(&f.model, &p3, 6), "r3");
    // while r3 waited, r5 was served to its end: r3's wait held its own slot only
    let log = log.lock().unwrap().clone();
    let at = |job: &str, kind: &str| log.iter().position(|(j, k)| j == job && k == kind).unwrap();
    assert!(
        at("r5", "done") < at("r3", "token"),
        "r5 waited for r3's backoff: {log:?}"
    );
    let m = e.metrics();
    let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    assert_eq!(
        (
            count(&m.requests_ok),
            count(&m.requests_failed),
            count(&m.requests_delayed)
        ),
        (3, 1, 1)
    );
    let link = m.link_stats();
    assert_eq!(
        (link.offload_retries, link.backoff_waits),
        (1, 0),
        "{link:?}"
    );
    assert!(
        link.positions_on_workers > 0,
        "r3's pages are on the worker: {link:?}"
    );
}

#[test]
fn through_the_server_a_gone_worker_fails_each_request_once_with_its_typed_error() {
    let f = model_with_layers(8, 62);
    let w = start_worker(f.dir.path(), None, None);
    let addr = w.addr.clone();
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &addr, Some(4), b""));
    let host = host_model(f.dir.path(), 4);
    let offload = serve(vec![off]);
    let split = serve(vec![layer_split(f.dir.path(), &host, &addr, 4..8)]);
    let log: Log = Default::default();
    let p = prompt(5 * 64 + 3, 1);
    let want = cold(&f.model, &p, 3);
    served(submit(&offload, &log, "o", &p, 3), &want, "offload");
    served(submit(&split, &log, "s", &p, 3), &want, "layer split");
    drop(w);
    // KV offload, four requests queued at once: the first loses the pages and fails after its retry; the next two
    // wait out the backoff (1 s, then 2 s) and find nothing listening; the fourth meets a 4 s backoff, past the 2 s a
    // request waits, and fails at once
    let asks: Vec<_> = (0..4)
        .map(|i| {
            submit(
                &offload,
                &log,
                &format!("o{i}"),
                &prompt(4 * 64 + i, 10 + i as u32),
                2,
            )
        })
        .collect();
    for (i, rx) in asks.into_iter().enumerate() {
        match failed(rx, &format!("offload {i}")) {
            backburner_engine::EngineError::KvBudget { why, .. } => {
                assert!(why.contains(&addr), "offload {i}: {why}");
                if i == 3 {
                    assert!(why.contains("a request waits at most 2 s"), "{why}");
                }
            }
            other => panic!("offload {i}: expected a KV budget error, got {other}"),
        }
    }
    let m: &Metrics = offload.metrics();
    let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    assert_eq!(
        (
            count(&m.requests_ok),
            count(&m.requests_failed),
            count(&m.requests_delayed)
        ),
        (1, 4, 2)
    );
    // layer split: the session the worker was waiting with serves what it waited for, or the request fails after
    // its retry (WorkerLost); the later ones cannot connect (WorkerUnavailable); each fails once
    let mut kinds = Vec::new();
    for i in 0..4 {
        let rx = submit(
            &split,
            &log,
            &format!("s{i}"),
            &[&p[..], &prompt(5, 20 + i)].concat(),
            2,
        );
        let evs = events(rx);
        match evs.last() {
            Some(Event::Failed(e)) => {
                assert_eq!(evs.len(), 2, "{evs:?}");
                assert!(e.to_string().contains(&addr), "{e}");
                kinds.push(match e {
                    backburner_engine::EngineError::WorkerLost { .. } => "lost",
                    backburner_engine::EngineError::WorkerUnavailable { .. } => "unavailable",
                    other => panic!("layer split {i}: {other}"),
                });
            }
            // the first request may be answered by the session that was waiting for it, wholly, or up to the step
            // that found the worker gone (then its retry failed too: the tokens so far, with the WorkerLost error)
            Some(Event::Done { generation, .. }) if i == 0 => {
                kinds.push(match generation.stop_reason {
                    backburner_engine::StopReason::Error => {
                        let e = generation.error.as_ref().expect("an error stop says why");
                        assert!(e.to_string().contains("retried once"), "{e}");
                        "lost"
                    }
                    _ => "served",
                })
            }
            other => panic!("layer split {i}: {other:?}"),
        }
    }
    // before the unavailable ones: nothing (the host saw the worker gone before the first request ran: nothing
    // ran, a typed error), the first request lost after its retry, or served and then the next lost
    let first = kinds
        .iter()
        .position(|k| *k == "unavailable")
        .unwrap_or(kinds.len());
    assert!(
        kinds[first..].iter().all(|k| *k == "unavailable"),
        "{kinds:?}"
    );
    assert!(
        matches!(kinds[..first], [] | ["lost"] | ["served", "lost"]),
        "{kinds:?}"
    );
}
