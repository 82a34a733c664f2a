//! Every mode on a mixture-of-experts model (`qwen3_5_moe_text`, and `qwen3_next`; random weights from the one tensor table): split
//! prefill, KV offload and a layer split, through the server's prompt cache, give for every answer of randomized
//! conversations the logits of a cold local run bit for bit, as on a dense model.

use crate::cache_exact::converse;
use crate::cache_modes::{budgeted, cold, layer_split_session, serve};
use crate::worker_common;

use std::sync::atomic::Ordering;

use backburner_engine::Session;
use worker_common::*;

#[test]
fn split_prefill_on_an_moe_model_is_exact() {
    let f = moe_with_layers(8, 61);
    let w = start_worker(f.dir.path(), None, None);
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let e = serve(vec![s]);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 31, 6, "MoE split prefill");
    assert!(reused >= 60, "only {reused} tokens came from the cache");
    let link = e.metrics().link.lock().unwrap().clone();
    assert!(link.split_calls > 0 && link.worker_tokens > 0, "{link:?}");
    assert_eq!(link.fallbacks, 0);
}

#[test]
fn kv_offload_on_an_moe_model_is_exact() {
    let f = moe_with_layers(8, 62);
    let w = start_worker(f.dir.path(), None, None);
    let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let e = serve(vec![s]);
    let vocab = f.model.config().vocab_size;
    converse(&e, &cold(&f.model), vocab, 32, 6, "MoE KV offload");
    assert!(e.metrics().link.lock().unwrap().pages_moved > 0);
    assert_eq!(e.metrics().requests_failed.load(Ordering::Relaxed), 0);
}

#[test]
fn a_layer_split_of_an_moe_model_is_exact() {
    let f = moe_with_layers(8, 63);
    let w = start_worker(f.dir.path(), None, None);
    let e = serve(vec![layer_split_session(f.dir.path(), &[(&w.addr, 4..8)])]);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 33, 6, "MoE layer split");
    assert!(reused >= 60, "only {reused} tokens came from the cache");
    assert_eq!(e.metrics().requests_failed.load(Ordering::Relaxed), 0);
}

#[test]
fn qwen3_next_through_a_layer_split_and_split_prefill_is_exact() {
    let f = with_config(&backburner_model::synthetic::tiny_next_config(8), 64);
    let w = start_worker(f.dir.path(), None, None);
    let e = serve(vec![layer_split_session(f.dir.path(), &[(&w.addr, 4..8)])]);
    let vocab = f.model.config().vocab_size;
    let reused = converse(&e, &cold(&f.model), vocab, 34, 5, "Qwen3-Next layer split");
    assert!(reused >= 60, "only {reused} tokens came from the cache");
    drop(e);
    let w2 = start_worker(f.dir.path(), None, None);
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &w2.addr, Some(4), b""));
    let e = serve(vec![s]);
    converse(
        &e,
        &cold(&f.model),
        vocab,
        35,
        4,
        "Qwen3-Next split prefill",
    );
    assert!(e.metrics().link.lock().unwrap().split_calls > 0);
}
