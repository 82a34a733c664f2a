//! The step plan ([`Session::plan_step`]): which executor runs a prefill, a decode step or a verify step in each
//! placement, and that the session runs what it says (the counters of the executor chosen move).

use crate::worker_common;

use backburner_engine::offload::KvBudget;
use backburner_engine::{Executor, Logits, Session, SessionOptions, StepKind};
use worker_common::*;

fn exec(s: &Session, n: usize, kind: StepKind, which: Logits) -> Executor {
    let p = s.plan_step(n, kind, which);
    assert_eq!(p.positions, s.tokens().len()..s.tokens().len() + n);
    p.executor
}

#[test]
fn each_placement_plans_its_executor() {
    use Executor::*;
    use StepKind::*;
    let f = model_with_layers(8, 41);
    let w = start_worker(f.dir.path(), None, None);

    let local = Session::new(f.model.clone(), opts()).unwrap();
    assert_eq!(exec(&local, 100, Prefill, Logits::Last), Local);
    assert_eq!(exec(&local, 4, Verify, Logits::All), Local);

    // split prefill: a long prompt whose last logits are wanted goes to the worker; the rest stays here
    let mut split = Session::new(f.model.clone(), opts()).unwrap();
    split.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert_eq!(exec(&split, 100, Prefill, Logits::Last), SplitPrefill);
    assert_eq!(exec(&split, 100, Prefill, Logits::All), Local);
    assert_eq!(exec(&split, 10, Prefill, Logits::Last), Local);
    split
        .prefill(&prompt(100, 1), Logits::Last, |_, _| {})
        .unwrap();
    assert!(split.link_stats().worker_tokens > 0, "it ran on the worker");
    assert_eq!(exec(&split, 1, Prefill, Logits::Last), Local);
    assert_eq!(exec(&split, 4, Verify, Logits::All), Local);

    // KV offload: under the budget here, past it the budget's path, for prefills and verify steps alike
    let w2 = start_worker(f.dir.path(), None, None);
    let budgeted = SessionOptions {
        kv_budget: Some(KvBudget::Positions(128)),
        ..opts()
    };
    let mut off = Session::new(f.model.clone(), budgeted).unwrap();
    off.attach_worker(client(f.dir.path(), &w2.addr, None, b""));
    off.prefill(&prompt(120, 2), Logits::Last, |_, _| {})
        .unwrap();
    assert_eq!(off.state().offloaded(), 0);
    assert_eq!(exec(&off, 8, Prefill, Logits::Last), Local);
    assert_eq!(exec(&off, 8, Verify, Logits::All), Local);
    assert_eq!(exec(&off, 9, Prefill, Logits::Last), KvOffload);
    assert_eq!(exec(&off, 9, Verify, Logits::All), KvOffload);
    off.prefill(&prompt(9, 3), Logits::Last, |_, _| {}).unwrap();
    assert!(off.state().offloaded() > 0, "the budget's path moved pages");
    assert_eq!(exec(&off, 1, Prefill, Logits::Last), KvOffload);
}
