//! Verify steps under a KV budget with the oldest pages on workers: every row attends through the workers' pages
//! with the bits of the local decode steps, the rollback truncates host rows only, and a worker lost between verify
//! steps is recovered (the history re-ingested onto the worker left) with the same bits.

use crate::speculative_chain::{reference, verify_along};
use crate::worker_common;

use backburner_engine::offload::KvBudget;
use backburner_engine::{Logits, Session, SessionOptions};
use worker_common::*;

fn budgeted(pages: usize) -> SessionOptions {
    SessionOptions {
        kv_budget: Some(KvBudget::Positions(pages * 64)),
        ..opts()
    }
}

#[test]
fn verify_steps_through_offloaded_pages_have_the_local_decode_bits() {
    let f = model_with_layers(8, 23);
    let p = prompt(3 * 64 + 20, 4);
    let (want, toks) = reference(&f, &p, 60);
    let w = start_worker(f.dir.path(), None, None);
    // a budget of 2 pages: the prompt's oldest pages are on the worker before the first verify step
    let mut s = Session::new(f.model.clone(), budgeted(2)).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, None, b""));
    let l = s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    assert_eq!(bits(&l), want[0]);
    let off0 = s.state().offloaded();
    assert!(off0 >= 64, "pages moved in the prefill");
    assert!(s.can_verify() && s.verify_room() >= 9);
    let steps = verify_along(&mut s, &toks, &want);
    assert!(steps >= 6);
    assert!(
        s.state().offloaded() > off0,
        "more pages moved during the verify steps"
    );
    let st = s.link_stats();
    assert_eq!((st.offload_failures, st.fallbacks), (0, 0));
}

#[test]
fn a_worker_lost_between_verify_steps_is_recovered_with_the_same_bits() {
    let f = model_with_layers(8, 25);
    let p = prompt(3 * 64 + 20, 6);
    let (want, toks) = reference(&f, &p, 30);
    let a = start_worker(f.dir.path(), None, None);
    let b = start_worker(f.dir.path(), None, None);
    let mut s = Session::new(f.model.clone(), budgeted(2)).unwrap();
    s.attach_worker(client(f.dir.path(), &a.addr, None, b""));
    s.attach_worker(client(f.dir.path(), &b.addr, None, b""));
    s.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    let vocab = want[0].len();
    let mut i = 0;
    for step in 0..8 {
        if step == 2 {
            // the worker holding the oldest pages stops: its session refuses its next request and closes
            a.stop_now();
        }
        let rows = s.verify(&toks[i..i + 3]).unwrap();
        for r in 0..3 {
            let row = bits(&rows[r * vocab..(r + 1) * vocab]);
            assert_eq!(row, want[i + r + 1], "step {step}, row {r}");
        }
        s.keep_verified(3);
        i += 3;
    }
    assert!(
        s.link_stats().offload_failures >= 1,
        "the loss was met and recovered"
    );
    assert_eq!(bits(&s.decode(toks[i]).unwrap()), want[i + 1]);
}

/// Drafts longer than the ubatch under a KV budget: the verify steps are cut to a ubatch (the rows a worker attends
/// per request), and the output is the plain run's.
#[test]
fn drafts_longer_than_the_ubatch_are_cut_to_it_under_a_kv_budget() {
    use backburner_engine::spec::{SpecParams, SpecSource};
    use backburner_engine::{generate, GenerateParams};
    let f = model_with_layers(8, 27);
    let p = prompt(3 * 64 + 20, 8);
    let w = start_worker(f.dir.path(), None, None);
    let small = SessionOptions {
        ubatch: 4,
        ..budgeted(2)
    };
    let plain = GenerateParams {
        max_tokens: 40,
        keep_logits: true,
        ..GenerateParams::default()
    };
    let mut local = Session::new(
        f.model.clone(),
        SessionOptions {
            ubatch: 4,
            ..opts()
        },
    )
    .unwrap();
    let want = generate(&mut local, &p, &plain, None, |_, _| {}, |_| {}, |_| {}).unwrap();
    let spec = GenerateParams {
        spec: Some(SpecParams {
            source: SpecSource::Scripted {
                script: p.iter().chain(&want.tokens).copied().collect(),
                error_rate: 0.1,
                seed: 2,
            },
            draft_max: 7,
            fixed: true,
            cost: None,
        }),
        ..plain
    };
    let mut s = Session::new(f.model.clone(), small).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, None, b""));
    let got = generate(&mut s, &p, &spec, None, |_, _| {}, |_| {}, |_| {}).unwrap();
    assert_eq!(got.tokens, want.tokens);
    assert_eq!(bits(&got.step_logits), bits(&want.step_logits));
    assert!(s.state().offloaded() > 0);
    assert!(s.verify_room() <= 4);
    let c = got.speculative.unwrap();
    assert!(
        c.accepted > 0 && c.drafted <= 3 * c.steps,
        "at most 3 drafts a step: {c:?}"
    );
}
