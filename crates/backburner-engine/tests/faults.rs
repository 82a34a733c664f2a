//! Transient worker faults do not fail requests that could be served: a layer-split worker that evicted the idle
//! session for another host is reconnected within the next request, and a KV-offload connection dropped mid-request
//! is retried once on a fresh connection; either way the answers keep the bits of a local run. A worker that is
//! really gone still fails each request once, with its typed error.

use crate::worker_common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::offload::KvBudget;
use backburner_engine::{EngineError, Session, SessionOptions, WorkerSettings};
use backburner_link::relay::{Dir, Fault, Relay};
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig};
use worker_common::*;

/// A model holding layers `[0, held)` and the ends (a layer-split host).
pub fn host_model(dir: &std::path::Path, held: usize) -> Arc<Model> {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let opts = LoadOptions {
        layers: 0..held,
        ends: true,
    };
    Arc::new(Model::from_checkpoint(cfg, &ck, &opts, |_, _| {}).unwrap())
}

/// A layer-split session on `host` with one worker at `addr` holding `range` (the rest of the model).
pub fn layer_split(
    dir: &std::path::Path,
    host: &Arc<Model>,
    addr: &str,
    range: Range<usize>,
) -> Session {
    let mut st = WorkerSettings::new(addr, 1);
    st.timeout = Duration::from_secs(5);
    let conn = Connection::new(
        st,
        backburner_engine::split::dir_fingerprint(dir.to_path_buf()),
    );
    let chain = LayerSplit::from_parts(host.config(), vec![(conn, range)]).unwrap();
    Session::with_layer_split(host.clone(), opts(), chain).unwrap()
}

/// Session options with a KV budget of `positions`.
pub fn budgeted(positions: usize) -> SessionOptions {
    SessionOptions {
        kv_budget: Some(KvBudget::Positions(positions)),
        ..opts()
    }
}

#[test]
fn a_layer_split_worker_that_evicted_the_idle_session_is_reconnected_within_the_next_request() {
    let f = model_with_layers(8, 51);
    // The worker holds layers 4..8 for two hosts: one attention layer (256 bytes a row) and three linear layers
    // (24 192 bytes of state). After a 320-token prompt and 2 decode steps a session holds about 106 KB, and a
    // 16-token RunLayers reserves about 29 KB more while it runs (KV growth, the f32 copy, the reply, the request's
    // buffers). 180 KB holds one session's peak beside the other's first state, not two idle sessions: the second
    // host's prompt evicts the first's idle session, and the first's rebuild evicts the second's.
    let w = start_worker_with(f.dir.path(), |o| {
        o.max_memory = 180_000 + tail_weights(f.dir.path(), 4)
    });
    let (pa, pb) = (prompt(20 * UBATCH, 1), prompt(20 * UBATCH, 2));
    let (more_a, more_b) = (prompt(2 * UBATCH + 5, 3), prompt(UBATCH + 7, 4));
    let mut la = Session::new(f.model.clone(), opts()).unwrap();
    let mut lb = Session::new(f.model.clone(), opts()).unwrap();
    let want_a = (run(&mut la, &pa, 2), run(&mut la, &more_a, 3));
    let want_b = (run(&mut lb, &pb, 2), run(&mut lb, &more_b, 3));

    let host = host_model(f.dir.path(), 4);
    let mut a = layer_split(f.dir.path(), &host, &w.addr, 4..8);
    let mut b = layer_split(f.dir.path(), &host, &w.addr, 4..8);
    assert!(run(&mut a, &pa, 2) == want_a.0);
    // b's prompt needs a's memory: a's idle session is evicted
    assert!(run(&mut b, &pb, 2) == want_b.0);
    // a's next request meets Error{Evicted}: it reconnects, re-ingests its history and answers with the local bits
    assert!(
        run(&mut a, &more_a, 3) == want_a.1,
        "a's answer after the eviction"
    );
    // and that rebuild evicted b's idle session in turn: the same for b
    assert!(
        run(&mut b, &more_b, 3) == want_b.1,
        "b's answer after the eviction"
    );
    for (name, s) in [("a", &a), ("b", &b)] {
        let st = s.layer_split().unwrap().stats();
        assert_eq!(
            (st.failures, st.rebuilds, st.retries),
            (1, 1, 1),
            "{name}: {st:?}"
        );
    }
}

/// Runs `p` and `steps` greedy decode steps through a budgeted session on one worker reached at `addr`; the bits of
/// every logits vector and the tokens, and the session.
fn offload_run(
    f: &Fixture,
    addr: &str,
    p: &[u32],
    steps: usize,
) -> ((Vec<Vec<u32>>, Vec<u32>), Session) {
    let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
    s.attach_worker(client(f.dir.path(), addr, Some(4), b""));
    let got = run(&mut s, p, steps);
    (got, s)
}

#[test]
fn a_kv_offload_connection_dropped_mid_request_is_retried_once_on_a_fresh_one_with_the_local_bits()
{
    let f = model_with_layers(8, 52);
    let w = start_worker(f.dir.path(), None, None);
    let upstream = w.addr.parse().unwrap();
    let p = prompt(5 * 64 + 3, 7);
    let steps = 12;
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, steps);
    // a clean relay first: how many bytes each direction carries through the prompt, and through the whole run
    let clean = Relay::start(upstream, Fault::None, 0).unwrap();
    let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
    s.attach_worker(client(
        f.dir.path(),
        &clean.addr().to_string(),
        Some(4),
        b"",
    ));
    s.prefill(&p, backburner_engine::Logits::Last, |_, _| {})
        .unwrap();
    let after_prompt = [clean.bytes(Dir::ToWorker), clean.bytes(Dir::ToHost)];
    drop(s);
    let (got, _) = offload_run(&f, &clean.addr().to_string(), &p, steps);
    assert!(got == want, "the clean relay changed the output");
    let whole = [
        clean.bytes(Dir::ToWorker) - after_prompt[0],
        clean.bytes(Dir::ToHost) - after_prompt[1],
    ];
    for (i, dir) in [Dir::ToWorker, Dir::ToHost].into_iter().enumerate() {
        // the first connection closes halfway through the decode steps' traffic; the next one passes cleanly
        let after = after_prompt[i] + (whole[i] - after_prompt[i]) / 2;
        let relay = Relay::start(upstream, Fault::CloseAfter { dir, after }, 1).unwrap();
        let (got, s) = offload_run(&f, &relay.addr().to_string(), &p, steps);
        assert!(got == want, "{dir:?}: the output changed");
        let st = s.link_stats();
        assert_eq!(
            (st.offload_failures, st.offload_retries, st.backoff_waits),
            (1, 1, 0),
            "{dir:?}: {st:?}"
        );
        assert_eq!(
            st.fallbacks, 0,
            "{dir:?}: an offload failure is no split fallback"
        );
        assert_eq!(
            relay.connections(),
            2,
            "{dir:?}: one retry, on a fresh connection"
        );
        assert!(st.positions_on_workers > 0);
    }
}

#[test]
fn a_worker_that_is_really_gone_fails_each_request_once_with_its_typed_error() {
    let f = model_with_layers(8, 53);
    let w = start_worker(f.dir.path(), None, None);
    let addr = w.addr.clone();
    let p = prompt(5 * 64 + 3, 8);
    let host = host_model(f.dir.path(), 4);
    let mut split = layer_split(f.dir.path(), &host, &addr, 4..8);
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &addr, Some(4), b""));
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 1);
    assert!(run(&mut split, &p, 1) == want);
    assert!(run(&mut off, &p, 1) == want);
    // the worker stops for good: its sessions answer what they wait for, then refuse; nothing listens any more
    drop(w);
    let t = want.1[0];
    // the layer-split session was idle, waiting for a request: it answers that one
    let mut served = 0;
    let mut errors = vec![loop {
        match split.decode(t) {
            Ok(_) => served += 1,
            Err(e) => break e,
        }
        assert!(served < 2, "the stopped worker kept serving");
    }];
    for _ in 0..2 {
        errors.push(split.decode(t).unwrap_err());
    }
    // the first request lost the session and its one retry found nothing listening; the next ones cannot connect
    match &errors[0] {
        EngineError::WorkerLost {
            addr: a,
            layers,
            reason,
            kept,
        } => {
            let k = p.len() + 1 + served;
            assert_eq!(
                (a.as_str(), layers.as_str(), *kept),
                (addr.as_str(), "4..8", k)
            );
            assert!(
                reason.contains("retried once on a fresh session after"),
                "{reason}"
            );
        }
        other => panic!("expected WorkerLost, got {other}"),
    }
    for e in &errors[1..] {
        assert!(
            matches!(e, EngineError::WorkerUnavailable { addr: a, layers, .. } if *a == addr && layers == "4..8"),
            "{e}"
        );
    }
    assert_eq!(split.tokens().len(), p.len() + 1 + served);
    // KV offload: the request that lost the pages fails after its retry; the next one waits out the backoff
    // (1 s, within the 2 s a request waits), finds nothing listening and fails too
    for i in 0..2 {
        match off.decode(t).unwrap_err() {
            EngineError::KvBudget { budget, why, .. } => {
                assert_eq!(budget, 128);
                assert!(why.contains(&addr), "request {i}: {why}");
            }
            other => panic!("request {i}: expected a KV budget error, got {other}"),
        }
    }
    assert_eq!(
        off.tokens().len(),
        p.len() + 1,
        "the history is kept, without the failed steps' tokens"
    );
    let st = off.link_stats();
    assert_eq!(
        (st.offload_failures, st.offload_retries, st.backoff_waits),
        (1, 1, 1),
        "{st:?}"
    );
}
