//! Experts on workers over loopback: a host loaded without the routed experts of some layers (all of them, or a
//! subset of ids; one or two workers) gives the bits of a local run in prefill, decode and the server's batched
//! decode with its prompt cache; a worker lost mid-request is reconnected once within the request, one that stays
//! gone fails it with the typed error and no wrong token, and a worker that cannot hold the experts says why.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::cache_exact::converse;
use crate::cache_modes::{cold, serve};
use crate::worker_common::*;

use backburner_engine::connection::{Connection, SessionShape};
use backburner_engine::experts::{ExpertHolder, LinkExperts};
use backburner_engine::{EngineError, Logits, Session, WorkerSettings};
use backburner_kernels::kv::KvDtype;
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig, RemoteExperts};

/// A host model of the checkpoint in `dir` without the experts `away` puts on the workers at its addresses.
pub fn expert_host(
    dir: &Path,
    away: &[(&str, Range<usize>, Vec<usize>)],
) -> (Arc<Model>, Arc<LinkExperts>) {
    let c = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let opts = LoadOptions {
        layers: 0..c.num_hidden_layers,
        ends: true,
    };
    let places: Vec<(Range<usize>, Vec<usize>)> = away
        .iter()
        .map(|(_, r, ids)| (r.clone(), ids.clone()))
        .collect();
    let elsewhere = |l: usize, e: usize| {
        places
            .iter()
            .any(|(r, ids)| r.contains(&l) && ids.contains(&e))
    };
    let model =
        Model::from_checkpoint_without(c.clone(), &ck, &opts, &elsewhere, |_, _| {}).unwrap();
    let holders = away
        .iter()
        .map(|(addr, r, ids)| {
            let mut st = WorkerSettings::new(*addr, 1);
            st.timeout = Duration::from_secs(20);
            let fp = backburner_engine::split::dir_fingerprint(dir.to_path_buf());
            ExpertHolder::new(Connection::new(st, fp), r.clone(), ids.clone())
        })
        .collect();
    let o = opts_shape();
    let rx = Arc::new(LinkExperts::new(c, o, holders));
    let dynrx: Arc<dyn RemoteExperts> = rx.clone();
    assert!(model.attach_remote_experts(dynrx));
    (Arc::new(model), rx)
}

fn opts_shape() -> SessionShape {
    let o = opts();
    SessionShape {
        kv: KvDtype::F16,
        page: o.kv.page_size,
        ubatch: o.ubatch,
    }
}

fn local_run(model: &Arc<Model>, p: &[u32], steps: usize) -> (Vec<Vec<u32>>, Vec<u32>) {
    run(&mut Session::new(model.clone(), opts()).unwrap(), p, steps)
}

#[test]
fn experts_on_workers_give_the_bits_of_a_local_run() {
    let f = moe_with_layers(8, 81);
    let (w1, w2) = (
        start_worker(f.dir.path(), None, None),
        start_worker(f.dir.path(), None, None),
    );
    let all: Vec<usize> = (0..8).collect();
    for away in [
        vec![(w1.addr.as_str(), 4..8, all.clone())],
        vec![(w1.addr.as_str(), 0..8, vec![1, 2, 6])],
        vec![
            (w1.addr.as_str(), 2..5, all.clone()),
            (w2.addr.as_str(), 5..8, vec![0, 3, 4, 7]),
        ],
    ] {
        let (host, rx) = expert_host(f.dir.path(), &away);
        let p = prompt(50, 7);
        let want = local_run(&f.model, &p, 8);
        let got = run(&mut Session::new(host.clone(), opts()).unwrap(), &p, 8);
        assert_eq!(got, want, "{away:?}");
        for (addr, _, _, st) in rx.stats() {
            assert!(st.bytes_sent > 0 && st.bytes_received > 0, "{addr}: {st:?}");
        }
        assert!(host.weight_bytes() < f.model.weight_bytes());
    }
}

#[test]
fn the_server_with_experts_on_a_worker_is_exact_through_its_cache_and_batched_decode() {
    let f = moe_with_layers(8, 82);
    let w = start_worker(f.dir.path(), None, None);
    let (host, _) = expert_host(f.dir.path(), &[(w.addr.as_str(), 2..8, (0..8).collect())]);
    let slots = (0..2)
        .map(|_| Session::new(host.clone(), opts()).unwrap())
        .collect();
    let e = serve(slots);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 41, 6, "experts on a worker");
    assert!(reused >= 60, "only {reused} tokens came from the cache");
    assert_eq!(
        e.metrics()
            .requests_failed
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

#[test]
fn a_lost_worker_is_retried_once_and_one_that_stays_gone_fails_the_request_with_its_typed_error() {
    let f = moe_with_layers(8, 83);
    let w = start_worker(f.dir.path(), None, None);
    let addr = w.addr.clone();
    let (host, _) = expert_host(f.dir.path(), &[(addr.as_str(), 4..8, (0..8).collect())]);
    let mut s = Session::new(host, opts()).unwrap();
    // a local session driven through the same calls (the same ubatches: the same bits)
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let p = prompt(40, 3);
    s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    local.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    // the worker restarts between two requests: the session it had is gone, the request reconnects and re-ingests
    drop(w);
    let w = start_worker_on(f.dir.path(), &addr);
    let got = s.prefill(&[9], Logits::Last, |_, _| {}).unwrap();
    assert_eq!(
        bits(&got),
        bits(&local.prefill(&[9], Logits::Last, |_, _| {}).unwrap())
    );
    let got = run(&mut s, &[10], 3);
    assert_eq!(got, run(&mut local, &[10], 3), "the logits after a restart");
    // the worker goes away for good: the request fails with the typed error, the session keeps its tokens
    drop(w);
    let kept = s.tokens().len();
    match s.decode(1) {
        Err(EngineError::ExpertsLost { reason, kept: k }) => {
            assert!(reason.contains(&addr), "{reason}");
            assert_eq!(k, kept);
        }
        other => panic!("expected ExpertsLost, got {other:?}"),
    }
    assert_eq!(s.tokens().len(), kept);
    // back again: the next request re-ingests the kept tokens (replaying their calls), with the local bits
    let _w = start_worker_on(f.dir.path(), &addr);
    std::thread::sleep(Duration::from_millis(1100)); // past the backoff
    let l = s.decode(5).unwrap();
    assert_eq!(bits(&l), bits(&local.decode(5).unwrap()));
}

#[test]
fn a_worker_that_cannot_hold_the_experts_says_why() {
    let f = moe_with_layers(8, 84);
    let small = start_worker_with(f.dir.path(), |o| o.max_memory = 4096);
    let (_, rx) = expert_host(
        f.dir.path(),
        &[(small.addr.as_str(), 4..8, (0..8).collect())],
    );
    let e = rx.connect_all().unwrap_err().to_string();
    assert!(e.contains("experts") && e.contains("max-memory"), "{e}");
    // a worker with another model
    let other = moe_with_layers(8, 85);
    let w = start_worker(other.dir.path(), None, None);
    let (_, rx) = expert_host(f.dir.path(), &[(w.addr.as_str(), 4..8, vec![1])]);
    let e = rx.connect_all().unwrap_err().to_string();
    assert!(e.contains("fingerprint"), "{e}");
    // a worker pinned to a layer range serves only that range
    let pinned = start_worker(f.dir.path(), Some(4..8), None);
    let (_, rx) = expert_host(f.dir.path(), &[(pinned.addr.as_str(), 4..8, vec![1])]);
    let e = rx.connect_all().unwrap_err().to_string();
    assert!(e.contains("--layers"), "{e}");
    // a dense worker
    let dense = model_with_layers(8, 86);
    let w = start_worker(dense.dir.path(), None, None);
    let (_, rx) = expert_host(f.dir.path(), &[(w.addr.as_str(), 4..8, vec![1])]);
    assert!(rx.connect_all().is_err());
}
