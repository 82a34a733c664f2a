//! The exact prompt cache through the worker modes: randomized conversations served with split prefill, with KV
//! offload (pages on one or two workers, one of them lost mid-conversation: the re-ingest replays the history's own
//! calls) and with a layer split give, for every answer, the logits of a cold local run bit for bit.

use crate::cache_exact::converse;
use crate::worker_common;

use std::sync::atomic::Ordering;
use std::sync::Arc;

use backburner_engine::offload::KvBudget;
use backburner_engine::serve::{CacheLimits, Engine, ServeOptions};
use backburner_engine::{generate, GenerateParams, Generation, Session, SessionOptions};
use backburner_model::Model;
use worker_common::*;

pub fn serve(sessions: Vec<Session>) -> Engine {
    let o = ServeOptions {
        queue: 4,
        cache: CacheLimits::default(),
        ..Default::default()
    };
    Engine::start(sessions, None, o).unwrap()
}

pub fn cold(model: &Arc<Model>) -> impl Fn(&[u32], &GenerateParams) -> Generation {
    let model = model.clone();
    move |p, params| {
        let mut s = Session::new(model.clone(), opts()).unwrap();
        generate(&mut s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
    }
}

#[test]
fn split_prefill_keeps_the_cache_exact() {
    let f = model_with_layers(8, 41);
    let w = start_worker(f.dir.path(), None, None);
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let e = serve(vec![s]);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 7, 10, "split prefill");
    assert!(reused >= 100, "only {reused} tokens came from the cache");
    let link = e.metrics().link.lock().unwrap().clone();
    assert!(link.split_calls > 0 && link.worker_tokens > 0, "{link:?}");
    assert_eq!(link.fallbacks, 0);
}

pub fn budgeted(positions: usize) -> SessionOptions {
    SessionOptions {
        kv_budget: Some(KvBudget::Positions(positions)),
        ..opts()
    }
}

#[test]
fn kv_offload_keeps_the_cache_exact_and_a_lost_worker_is_replayed_exactly() {
    let f = model_with_layers(8, 43);
    let (a, b) = (
        start_worker(f.dir.path(), None, None),
        start_worker(f.dir.path(), None, None),
    );
    let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
    s.attach_worker(client(f.dir.path(), &a.addr, Some(4), b""));
    s.attach_worker(client(f.dir.path(), &b.addr, Some(4), b""));
    let e = serve(vec![s]);
    let vocab = f.model.config().vocab_size;
    let cold = cold(&f.model);
    let reused = converse(&e, &cold, vocab, 21, 10, "KV offload");
    assert!(reused >= 100, "only {reused} tokens came from the cache");
    let moved = e.metrics().link.lock().unwrap().pages_moved;
    assert!(moved > 0, "no page was offloaded");
    // the first worker goes away: the next requests re-ingest (replaying the same calls) onto the other
    a.stop_now();
    let reused = converse(&e, &cold, vocab, 22, 10, "KV offload after a loss");
    let m = e.metrics();
    assert_eq!(m.requests_failed.load(Ordering::Relaxed), 0);
    assert_eq!(
        m.workers_available.load(Ordering::Relaxed),
        1,
        "the loss was not seen"
    );
    let link = m.link.lock().unwrap().clone();
    assert!(
        link.pages_moved > moved,
        "no page moved after the loss: {link:?}"
    );
    assert!(
        reused >= 100,
        "only {reused} tokens came from the cache after the loss"
    );
    drop(b);
}

/// A host holding layers `0..4` and the ends, and workers at `stages` (address, layers) holding the rest.
pub fn layer_split_session(
    dir: &std::path::Path,
    stages: &[(&str, std::ops::Range<usize>)],
) -> Session {
    use backburner_engine::chain::LayerSplit;
    use backburner_engine::connection::Connection;
    use backburner_model::{Checkpoint, LoadOptions, ModelConfig};
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let held = LoadOptions {
        layers: 0..4,
        ends: true,
    };
    let host = Arc::new(Model::from_checkpoint(cfg, &ck, &held, |_, _| {}).unwrap());
    let parts = stages
        .iter()
        .map(|(addr, range)| {
            let mut s = backburner_engine::WorkerSettings::new(*addr, 1);
            s.timeout = std::time::Duration::from_secs(5);
            let fp = backburner_engine::split::dir_fingerprint(dir.to_path_buf());
            (Connection::new(s, fp), range.clone())
        })
        .collect();
    let chain = LayerSplit::from_parts(host.config(), parts).unwrap();
    Session::with_layer_split(host, opts(), chain).unwrap()
}

#[test]
fn a_layer_split_keeps_its_prompt_cache_on_the_workers_and_stays_exact() {
    let f = model_with_layers(8, 47);
    let w = start_worker(f.dir.path(), None, None);
    let e = serve(vec![layer_split_session(f.dir.path(), &[(&w.addr, 4..8)])]);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 11, 10, "layer split");
    assert!(reused >= 100, "only {reused} tokens came from the cache");
    let m = e.metrics();
    assert_eq!(m.requests_failed.load(Ordering::Relaxed), 0);
}

#[test]
fn a_worker_holding_only_attention_layers_keeps_the_cache_too() {
    // layers 4..7 are Gated DeltaNet, 7 is full attention: the second worker's state has no linear layer, and its
    // checkpoints are the positions it passed (truncating KV rows is exact anywhere)
    let f = model_with_layers(8, 48);
    let (a, b) = (
        start_worker(f.dir.path(), None, None),
        start_worker(f.dir.path(), None, None),
    );
    let stages = [(a.addr.as_str(), 4..7), (b.addr.as_str(), 7..8)];
    let e = serve(vec![layer_split_session(f.dir.path(), &stages)]);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 12, 8, "attention-only worker");
    assert!(reused >= 100, "only {reused} tokens came from the cache");
    assert_eq!(e.metrics().requests_failed.load(Ordering::Relaxed), 0);
}
