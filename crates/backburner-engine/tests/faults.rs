//! Transient worker faults do not fail requests that could be served: a layer-split worker that evicted the idle
//! session for another host is reconnected within the next request, and the answers keep the bits of a local run.

use crate::worker_common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::{Session, WorkerSettings};
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
