//! Transient faults while a worker session opens: a handshake cut by the transport is tried once more on a fresh
//! connection (layer split and KV offload), and a worker that restarts right after losing a session (nothing
//! listening for a fraction of a second) is waited for within the request. Both keep the local run's bits.

use crate::faults::{budgeted, host_model, layer_split};
use crate::worker_common;

use std::time::Duration;

use backburner_engine::{argmax, Session};
use backburner_link::relay::{Dir, Fault, Relay};
use worker_common::*;

#[test]
fn a_handshake_cut_by_the_transport_is_tried_once_more() {
    let f = model_with_layers(8, 54);
    let w = start_worker(f.dir.path(), None, None);
    let upstream = w.addr.parse().unwrap();
    let p = prompt(3 * 64 + 5, 9);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 4);
    let host = host_model(f.dir.path(), 4);
    // the first connection closes after 8 bytes of either direction: inside the handshake
    for dir in [Dir::ToWorker, Dir::ToHost] {
        let cut = Fault::CloseAfter { dir, after: 8 };
        let relay = Relay::start(upstream, cut, 1).unwrap();
        let addr = relay.addr().to_string();
        let mut s = layer_split(f.dir.path(), &host, &addr, 4..8);
        assert!(run(&mut s, &p, 4) == want, "layer split, {dir:?}");
        assert_eq!(relay.connections(), 2, "layer split, {dir:?}");
        let relay = Relay::start(upstream, cut, 1).unwrap();
        let addr = relay.addr().to_string();
        let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
        s.attach_worker(client(f.dir.path(), &addr, Some(4), b""));
        assert!(run(&mut s, &p, 4) == want, "KV offload, {dir:?}");
        assert_eq!(relay.connections(), 2, "KV offload, {dir:?}");
        assert!(s.link_stats().positions_on_workers > 0);
    }
}

#[test]
fn a_worker_restarting_right_after_a_lost_session_is_waited_for() {
    let f = model_with_layers(8, 55);
    let w = start_worker(f.dir.path(), None, None);
    let addr = w.addr.clone();
    let p = prompt(2 * 64 + 9, 10);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let (want_logits, want) = run(&mut local, &p, 6);
    let host = host_model(f.dir.path(), 4);
    let mut s = layer_split(f.dir.path(), &host, &addr, 4..8);
    let (mut logits, mut toks) = run(&mut s, &p, 2);
    // the worker stops (nothing listens) and is back 300 ms later on the same address
    drop(w);
    let dir = f.dir.path().to_path_buf();
    let again = addr.clone();
    let back = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        start_worker_on(&dir, &again)
    });
    let mut last: Vec<f32> = logits[logits.len() - 1]
        .iter()
        .map(|&b| f32::from_bits(b))
        .collect();
    while toks.len() < 6 {
        let t = argmax(&last);
        toks.push(t);
        last = s.decode(t).unwrap();
        logits.push(bits(&last));
    }
    let _w = back.join().unwrap();
    assert_eq!(toks, want);
    assert!(logits == want_logits);
    assert_eq!(s.layer_split().unwrap().stats().retries, 1);
}
