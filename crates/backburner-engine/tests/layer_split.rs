//! Layer split with in-process workers: the host holds layers [0, L₁) and the ends, one or two workers the rest;
//! logits bit-identical to a local session; a worker that is gone fails the request (after its one retry) with a
//! typed error, keeps the tokens and the next request rebuilds.

use crate::worker_common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::{argmax, EngineError, Logits, Session, WorkerSettings};
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig};
use worker_common::*;

fn host_model(dir: &std::path::Path, held: usize) -> Arc<Model> {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let opts = LoadOptions {
        layers: 0..held,
        ends: true,
    };
    Arc::new(Model::from_checkpoint(cfg, &ck, &opts, |_, _| {}).unwrap())
}

fn connection(dir: &std::path::Path, addr: &str) -> Connection {
    let mut s = WorkerSettings::new(addr, 1);
    s.timeout = Duration::from_secs(5);
    Connection::new(
        s,
        backburner_engine::split::dir_fingerprint(dir.to_path_buf()),
    )
}

/// A layer-split session: the host holds `[0, stages[0].1.start)`.
fn split_session(dir: &std::path::Path, stages: &[(&str, Range<usize>)]) -> Session {
    let host = host_model(dir, stages[0].1.start);
    let parts = stages
        .iter()
        .map(|(a, r)| (connection(dir, a), r.clone()))
        .collect();
    let chain = LayerSplit::from_parts(host.config(), parts).unwrap();
    Session::with_layer_split(host, opts(), chain).unwrap()
}

#[test]
fn one_and_two_workers_give_the_local_bits() {
    let f = model_with_layers(8, 31);
    let p = prompt(100, 3);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let (want, toks) = run(&mut local, &p, 12);
    let a = start_worker(f.dir.path(), None, None);
    let b = start_worker(f.dir.path(), None, None);
    let c = start_worker(f.dir.path(), None, None);
    let layouts: Vec<Vec<(&str, Range<usize>)>> = vec![
        vec![(a.addr.as_str(), 4..8)],
        vec![(b.addr.as_str(), 4..6), (c.addr.as_str(), 6..8)],
    ];
    for stages in layouts {
        let mut s = split_session(f.dir.path(), &stages);
        let (got, got_toks) = run(&mut s, &p, 12);
        assert_eq!(got_toks, toks, "{stages:?}");
        assert_eq!(got, want, "logit bits differ with {stages:?}");
        let ls = s.link_stats();
        assert_eq!(ls.worker_layers, 4);
        // every token went through the workers: the prompt then each decode step
        assert_eq!(ls.worker_tokens, 100 + 12);
        // per worker per token, hidden × 4 bytes each way, plus framing and the handshake
        let hidden = f.model.config().hidden_size as u64;
        let payload = 2 * stages.len() as u64 * 112 * hidden * 4;
        let total = ls.bytes_sent + ls.bytes_received;
        assert!(
            total >= payload && total < payload + 64 * 1024,
            "{total} vs {payload}"
        );
        let st = s.layer_split().unwrap().stats();
        assert_eq!((st.calls, st.decode_calls, st.failures), (13, 12, 0));
    }
}

#[test]
fn every_logit_row_and_a_host_without_layers() {
    let f = model_with_layers(8, 32);
    let p = prompt(70, 5);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = local.prefill(&p, Logits::All, |_, _| {}).unwrap();
    let a = start_worker(f.dir.path(), None, None);
    let b = start_worker(f.dir.path(), None, None);
    // the host keeps only the embedding and the head; a worker pinned to its range with --layers
    let pinned = start_worker(f.dir.path(), Some(0..5), None);
    for stages in [
        vec![(a.addr.as_str(), 2..8)],
        vec![(pinned.addr.as_str(), 0..5), (b.addr.as_str(), 5..8)],
    ] {
        let mut s = split_session(f.dir.path(), &stages);
        let got = s.prefill(&p, Logits::All, |_, _| {}).unwrap();
        assert_eq!(bits(&got), bits(&want), "{stages:?}");
    }
}

#[test]
fn a_lost_worker_fails_the_request_and_the_next_one_rebuilds() {
    let f = model_with_layers(8, 33);
    let p = prompt(60, 9);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let (_, toks) = run(&mut local, &p, 6);
    let a = start_worker(f.dir.path(), None, None);
    let addr = a.addr.clone();
    let mut s = split_session(f.dir.path(), &[(addr.as_str(), 4..8)]);
    let l = s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    let t0 = argmax(&l);
    assert_eq!(t0, toks[0]);
    // the worker stops: its session answers at most the request it is waiting for, then refuses and closes
    drop(a);
    let mut t = t0;
    let mut fed = Vec::new();
    let err = loop {
        match s.decode(t) {
            Ok(l) => {
                fed.push(t);
                t = argmax(&l);
                assert!(fed.len() < 3, "the stopped worker kept serving");
            }
            Err(e) => break e,
        }
    };
    let kept = 60 + fed.len();
    match &err {
        EngineError::WorkerLost {
            addr: e_addr,
            layers,
            kept: k,
            reason,
        } => {
            assert_eq!(
                (e_addr.as_str(), layers.as_str(), *k),
                (addr.as_str(), "4..8", kept)
            );
            // the request was retried once on a fresh session, which found nothing listening
            assert!(
                reason.contains("retried once on a fresh session after"),
                "{reason}"
            );
        }
        other => panic!("expected WorkerLost, got {other}"),
    }
    assert_eq!(s.tokens().len(), kept);
    assert_eq!(&s.tokens()[..60], &p[..]);
    // still down: it cannot be used (nothing listens there), and nothing is lost
    assert!(
        matches!(s.decode(t), Err(EngineError::WorkerUnavailable { ref addr, .. }) if *addr == e_addr_of(&err))
    );
    assert_eq!(s.tokens().len(), kept);
    let _back = start_worker_on(f.dir.path(), &addr);
    let mut got = fed.clone();
    while got.len() < 6 {
        let l = s.decode(t).unwrap();
        got.push(t);
        t = argmax(&l);
    }
    assert_eq!(got, toks);
    assert_eq!(s.layer_split().unwrap().stats().rebuilds, 1);
}

fn e_addr_of(e: &EngineError) -> String {
    match e {
        EngineError::WorkerLost { addr, .. } | EngineError::WorkerUnavailable { addr, .. } => {
            addr.clone()
        }
        other => panic!("not a worker error: {other}"),
    }
}

#[test]
fn chains_that_do_not_cover_the_model_are_refused() {
    let f = model_with_layers(8, 34);
    let cfg = f.model.config();
    let c = |r: Range<usize>| (connection(f.dir.path(), "127.0.0.1:9"), r);
    for parts in [
        vec![],
        vec![c(4..7)],
        vec![c(2..4), c(5..8)],
        vec![c(4..4), c(4..8)],
    ] {
        assert!(matches!(
            LayerSplit::from_parts(cfg, parts),
            Err(EngineError::InvalidSetting(_))
        ));
    }
    // a host model with more layers than the chain leaves it
    let chain = LayerSplit::from_parts(cfg, vec![c(4..8)]).unwrap();
    assert!(matches!(
        Session::with_layer_split(f.model.clone(), opts(), chain),
        Err(EngineError::InvalidSetting(_))
    ));
}

/// A speculating request over a layer split: its verify steps run through the worker (one round trip for the last
/// token and its drafts), and the output is the local plain run's, bit for bit, with drafts right or partly wrong.
#[test]
fn a_speculating_request_over_a_layer_split_verifies_through_the_worker_with_the_local_bits() {
    use backburner_engine::spec::{SpecParams, SpecSource};
    use backburner_engine::{generate, GenerateParams};
    let f = model_with_layers(8, 31);
    let p = prompt(60, 7);
    let plain = GenerateParams {
        max_tokens: 16,
        keep_logits: true,
        ..GenerateParams::default()
    };
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = generate(&mut local, &p, &plain, None, |_, _| {}, |_| {}, |_| {}).unwrap();
    let a = start_worker(f.dir.path(), None, None);
    for error_rate in [0.0, 0.4] {
        let spec = GenerateParams {
            spec: Some(SpecParams {
                source: SpecSource::Scripted {
                    script: p.iter().chain(&want.tokens).copied().collect(),
                    error_rate,
                    seed: 1,
                },
                draft_max: 3,
                fixed: true,
                cost: None,
            }),
            ..plain.clone()
        };
        let mut s = split_session(f.dir.path(), &[(a.addr.as_str(), 4..8)]);
        assert!(s.can_verify());
        let got = generate(&mut s, &p, &spec, None, |_, _| {}, |_| {}, |_| {}).unwrap();
        assert_eq!(got.tokens, want.tokens, "error rate {error_rate}");
        assert_eq!(bits(&got.step_logits), bits(&want.step_logits));
        let sc = got.speculative.unwrap();
        assert!(sc.drafted > 0);
        assert_eq!(sc.accepted == sc.drafted, error_rate == 0.0, "{sc:?}");
        let st = s.layer_split().unwrap().stats();
        assert_eq!(
            st.verify_calls, sc.steps,
            "every speculative step is one verify call"
        );
        assert!(
            st.verify_calls < 15,
            "fewer calls than tokens: {}",
            st.verify_calls
        );
    }
}
