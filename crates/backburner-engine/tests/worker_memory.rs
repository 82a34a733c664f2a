//! A worker's `max_memory` counts the weights of the layers it loads: they are reserved before loading, and a range
//! whose weights do not fit is refused with an error naming them.

use crate::worker_common;

use backburner_engine::{Worker, WorkerError, WorkerOptions};
use worker_common::*;

#[test]
fn a_worker_whose_budget_cannot_hold_its_layers_weights_refuses_to_load_them() {
    let f = model_with_layers(8, 31);
    let w = tail_weights(f.dir.path(), 4);
    let mut o = WorkerOptions::new(f.dir.path().to_path_buf());
    o.threads = 1;
    o.layers = Some(4..8);
    o.max_memory = w - 1;
    match Worker::bind("127.0.0.1:0", o.clone()) {
        Err(e @ WorkerError::Memory { .. }) => {
            let m = e.to_string();
            assert!(
                m.contains("the weights of layers 4..8 need") && m.contains(&w.to_string()),
                "{m}"
            );
        }
        Err(e) => panic!("expected a memory error, got {e}"),
        Ok(_) => panic!("expected a memory error, got a worker"),
    }
    o.max_memory = w + (1 << 20);
    let ok = Worker::bind("127.0.0.1:0", o).unwrap();
    assert_eq!(ok.weight_bytes(), w);
}
