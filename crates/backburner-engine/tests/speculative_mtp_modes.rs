//! The MTP block with workers: through a layer split (the host holds the final norm, so every hidden row comes
//! back to it) and under a KV budget with the oldest pages on a worker, the session feeds the block every position
//! and drafts exactly what a local session drafts, through prefill, verify steps and their rollbacks.

use crate::{common, worker_common};

use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::offload::KvBudget;
use backburner_engine::{argmax, Logits, Session, SessionOptions, WorkerSettings};
use backburner_kernels::kv::KvDtype;
use backburner_model::{Checkpoint, KvOptions, LoadOptions, Model, ModelConfig};

fn opts() -> SessionOptions {
    SessionOptions {
        ubatch: 16,
        kv: KvOptions {
            page_size: 64,
            dtype: KvDtype::F32,
        },
        ..SessionOptions::default()
    }
}

/// Prefill, then verify steps of the block's own drafts (greedy acceptance, partial or whole); returns every draft
/// list and accepted token in order.
fn drafts_along(s: &mut Session, p: &[u32], vocab: usize) -> Vec<Vec<u32>> {
    s.enable_mtp().unwrap();
    let l = s.prefill(p, Logits::Last, |_, _| {}).unwrap();
    let mut x = argmax(&l);
    let mut out = Vec::new();
    for step in 0..8 {
        let mut d = s.mtp_draft(x, 3);
        if step % 3 == 1 && !d.is_empty() {
            // a wrong draft now and then: a rollback inside the step
            d[0] = (d[0] + 1) % vocab as u32;
        }
        out.push(d.clone());
        let ids: Vec<u32> = std::iter::once(x).chain(d.iter().copied()).collect();
        let rows = s.verify(&ids).unwrap();
        let row = |i: usize| argmax(&rows[i * vocab..(i + 1) * vocab]);
        let mut m = 1;
        while m < ids.len() && row(m - 1) == ids[m] {
            m += 1;
        }
        s.keep_verified(m);
        x = row(m - 1);
        out.push(vec![x]);
    }
    out
}

#[test]
fn the_block_drafts_the_local_drafts_through_a_layer_split_and_kv_offload() {
    let dir = common::fixture("tiny-mtp");
    let model = common::load_model("tiny-mtp");
    let vocab = model.config().vocab_size;
    let p: Vec<u32> = (0..150u32)
        .map(|i| (i * 7919 + 13) % vocab as u32)
        .collect();
    let want = drafts_along(&mut Session::new(model.clone(), opts()).unwrap(), &p, vocab);
    assert!(
        want.iter().step_by(2).any(|d| !d.is_empty()),
        "the block drafts"
    );

    // layer split: the host holds layers 0..2, the ends and the block; the worker 2..4
    let w = worker_common::start_worker(&dir, None, None);
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    let load = LoadOptions {
        layers: 0..2,
        ends: true,
    };
    let ck = Checkpoint::open(&dir).unwrap();
    let host = Arc::new(Model::from_checkpoint(cfg, &ck, &load, |_, _| {}).unwrap());
    assert!(host.mtp().is_some());
    let mut st = WorkerSettings::new(w.addr.as_str(), 1);
    st.timeout = Duration::from_secs(5);
    let fp = backburner_engine::split::dir_fingerprint(dir.clone());
    let chain =
        LayerSplit::from_parts(host.config(), vec![(Connection::new(st, fp), 2..4)]).unwrap();
    let mut split = Session::with_layer_split(host, opts(), chain).unwrap();
    assert_eq!(drafts_along(&mut split, &p, vocab), want, "layer split");

    // KV offload: a budget of 2 pages; the prompt's oldest page moves in the prefill
    let budgeted = SessionOptions {
        kv_budget: Some(KvBudget::Positions(128)),
        ..opts()
    };
    let w2 = worker_common::start_worker(&dir, None, None);
    let mut off = Session::new(model.clone(), budgeted).unwrap();
    off.attach_worker(worker_common::client(&dir, &w2.addr, None, b""));
    assert_eq!(drafts_along(&mut off, &p, vocab), want, "KV offload");
    assert!(off.state().offloaded() > 0);
}
