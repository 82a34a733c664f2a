//! Verify steps through a layer split (protocol version 8): the rows of a verify step of T tokens have the bits of T
//! decode steps on the local session, the workers roll back to the prefix the host keeps (on their next request),
//! a worker lost before a verify step is replaced within it, and the prompt cache's rewind still restores exactly.

use crate::worker_common;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::{Executor, Logits, Session, StepKind, WorkerSettings};
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig};
use worker_common::*;

fn split_session(dir: &std::path::Path, stages: &[(&str, Range<usize>)]) -> Session {
    let cfg = ModelConfig::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let load = LoadOptions {
        layers: 0..stages[0].1.start,
        ends: true,
    };
    let host = Arc::new(Model::from_checkpoint(cfg, &ck, &load, |_, _| {}).unwrap());
    let parts = stages
        .iter()
        .map(|(a, r)| {
            let mut s = WorkerSettings::new(*a, 1);
            s.timeout = Duration::from_secs(5);
            let fp = backburner_engine::split::dir_fingerprint(dir.to_path_buf());
            (Connection::new(s, fp), r.clone())
        })
        .collect();
    let chain = LayerSplit::from_parts(host.config(), parts).unwrap();
    Session::with_layer_split(host, opts(), chain).unwrap()
}

/// The local reference: the logits after the prompt and after each of `n` greedy decode steps (bits), and the tokens.
pub(crate) fn reference(f: &Fixture, p: &[u32], n: usize) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    run(&mut local, p, n)
}

/// Speculates over `s` (prompt already prefilled, next token `toks[0]`) with drafts from the known continuation,
/// wrong at chosen places, checking every row of every verify against the local decode steps; returns the verify
/// steps run. `toks`/`want` as [`reference`] gives them.
pub(crate) fn verify_along(s: &mut Session, toks: &[u32], want: &[Vec<u32>]) -> usize {
    let (mut i, mut steps) = (0usize, 0usize);
    let end = toks.len() - 9;
    while i < end {
        let k = 1 + steps % 8;
        // the draft at `wrong` (if any) is replaced; the ones after it are right again but never accepted
        let wrong = [k, 0, k / 2, k, 1][steps % 5];
        let mut ids: Vec<u32> = toks[i..=i + k].to_vec();
        if wrong >= 1 && wrong <= k {
            ids[wrong] = (ids[wrong] + 7) % 500;
        }
        let rows = s.verify(&ids).unwrap();
        let vocab = rows.len() / ids.len();
        let m = ids
            .iter()
            .zip(&toks[i..])
            .take_while(|(a, b)| a == b)
            .count();
        for r in 0..m {
            assert_eq!(
                bits(&rows[r * vocab..(r + 1) * vocab]),
                want[i + r + 1],
                "step {steps}: row {r} of a verify of {} at token {i}",
                ids.len()
            );
        }
        s.keep_verified(m);
        i += m;
        steps += 1;
    }
    // plain decode steps after the last verify: the workers rolled back exactly
    for j in i..toks.len() {
        assert_eq!(
            bits(&s.decode(toks[j]).unwrap()),
            want[j + 1],
            "decode after verifies, token {j}"
        );
    }
    steps
}

#[test]
fn verify_steps_through_one_and_two_workers_have_the_local_decode_bits() {
    let f = model_with_layers(8, 31);
    let p = prompt(40, 5);
    let (want, toks) = reference(&f, &p, 30);
    let a = start_worker(f.dir.path(), None, None);
    let b = start_worker(f.dir.path(), None, None);
    let c = start_worker(f.dir.path(), None, None);
    let d = start_worker(f.dir.path(), None, None);
    let layouts: Vec<Vec<(&str, Range<usize>)>> = vec![
        vec![(a.addr.as_str(), 4..8)],
        vec![(b.addr.as_str(), 4..6), (c.addr.as_str(), 6..8)],
        // the host holds no layer: embedding and head only
        vec![(d.addr.as_str(), 0..8)],
    ];
    for stages in layouts {
        let mut s = split_session(f.dir.path(), &stages);
        let l = s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
        assert_eq!(bits(&l), want[0]);
        assert!(s.can_verify());
        for kind in [StepKind::Prefill, StepKind::Verify] {
            assert_eq!(
                s.plan_step(4, kind, Logits::All).executor,
                Executor::LayerSplit
            );
        }
        let steps = verify_along(&mut s, &toks, &want);
        let st = s.layer_split().unwrap().stats().clone();
        assert_eq!(st.verify_calls as usize, steps, "{stages:?}");
        assert_eq!(st.rebuilds, 0, "{stages:?}");
        assert_eq!(s.tokens().len(), p.len() + toks.len());
    }
}

/// A worker gone before a verify step: the step re-establishes the worker's session, re-ingests the history and
/// runs within the same call, with the same bits.
#[test]
fn a_worker_lost_before_a_verify_step_is_replaced_within_it() {
    let f = model_with_layers(8, 33);
    let p = prompt(30, 2);
    let (want, toks) = reference(&f, &p, 24);
    let a = start_worker(f.dir.path(), None, None);
    let addr = a.addr.clone();
    let mut s = split_session(f.dir.path(), &[(addr.as_str(), 4..8)]);
    s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    let rows = s.verify(&toks[..4]).unwrap();
    s.keep_verified(2);
    let vocab = rows.len() / 4;
    assert_eq!(bits(&rows[vocab..2 * vocab]), want[2]);
    // the worker stops (its session answers at most the request it waits for, then refuses and closes) and a
    // fresh worker listens on the address: a verify step meets the loss, and runs on a fresh session
    drop(a);
    let _b = start_worker_on(f.dir.path(), &addr);
    let mut i = 2;
    while s.layer_split().unwrap().stats().retries == 0 {
        assert!(i < 12, "no verify step met the stopped worker");
        let rows = s.verify(&toks[i..i + 3]).unwrap();
        for r in 0..3 {
            let row = bits(&rows[r * vocab..(r + 1) * vocab]);
            assert_eq!(row, want[i + r + 1], "token {i}, row {r}");
        }
        s.keep_verified(3);
        i += 3;
    }
    let st = s.layer_split().unwrap().stats();
    assert_eq!((st.retries, st.rebuilds), (1, 1));
    // the workers are in step again: the next verify steps and decode steps rebuild nothing
    for _ in 0..3 {
        s.verify(&toks[i..i + 3]).unwrap();
        s.keep_verified(2);
        i += 2;
    }
    assert_eq!(bits(&s.decode(toks[i]).unwrap()), want[i + 1]);
    assert_eq!(
        s.layer_split().unwrap().stats().rebuilds,
        1,
        "one rebuild after the loss"
    );
}

/// The prompt cache through a layer split after verify steps that rolled back: the rewind to the prompt's
/// checkpoint restores host and workers in place, and decoding again gives the local bits.
#[test]
fn a_rewind_after_verify_steps_restores_the_checkpoint_exactly() {
    let f = model_with_layers(8, 35);
    let p = prompt(48, 9);
    let (want, toks) = reference(&f, &p, 20);
    let a = start_worker(f.dir.path(), None, None);
    let mut s = split_session(f.dir.path(), &[(a.addr.as_str(), 4..8)]);
    s.keep_checkpoints_at(vec![p.len()]);
    s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    let snap = s
        .take_checkpoints()
        .pop()
        .expect("a checkpoint at the prompt's end");
    for (ids, m) in [(&toks[..5], 3), (&toks[3..6], 1)] {
        s.verify(ids).unwrap();
        s.keep_verified(m);
    }
    assert!(
        s.rewind(&snap),
        "the worker kept its checkpoint at {}",
        p.len()
    );
    assert_eq!(s.tokens().len(), p.len());
    for j in 0..6 {
        assert_eq!(bits(&s.decode(toks[j]).unwrap()), want[j + 1], "token {j}");
    }
    assert_eq!(s.layer_split().unwrap().stats().rebuilds, 0);
}
