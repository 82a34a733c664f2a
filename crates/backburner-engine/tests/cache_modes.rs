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

fn serve(sessions: Vec<Session>) -> Engine {
    let o = ServeOptions {
        queue: 4,
        cache: CacheLimits::default(),
    };
    Engine::start(sessions, None, o).unwrap()
}

fn cold(model: &Arc<Model>) -> impl Fn(&[u32], &GenerateParams) -> Generation {
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

fn budgeted(positions: usize) -> SessionOptions {
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
    let reused = converse(&e, &cold, vocab, 9, 6, "KV offload");
    assert!(reused >= 100, "only {reused} tokens came from the cache");
    let link = e.metrics().link.lock().unwrap().clone();
    assert!(link.pages_on_workers > 0, "no page was offloaded: {link:?}");
    // the first worker goes away: the next requests re-ingest (replaying the same calls) onto the other
    a.stop_now();
    let reused = converse(&e, &cold, vocab, 10, 6, "KV offload after a loss");
    let m = e.metrics();
    assert_eq!(m.requests_failed.load(Ordering::Relaxed), 0);
    assert_eq!(m.workers_available.load(Ordering::Relaxed), 1, "the loss was not seen");
    let link = m.link.lock().unwrap().clone();
    assert!(link.pages_on_workers > 0, "no page on the worker left: {link:?}");
    assert!(reused >= 100, "only {reused} tokens came from the cache after the loss");
    drop(b);
}
