//! KV offload over real sockets (in-process worker threads on loopback): with a KV budget several times smaller
//! than the prompt, the oldest pages move to one or two workers and the logits of prefill and decode are the bits of
//! an unbounded local run; without a worker the budget is a typed error; a full worker hands over to the next; a
//! lost worker is recovered by re-ingesting.

use crate::worker_common;

use backburner_engine::offload::KvBudget;
use backburner_engine::{EngineError, Logits, Session};
use worker_common::*;

/// Page size 64 (the worker's block), ubatch 16: a 128-position budget holds two pages.
fn budgeted(budget: usize) -> backburner_engine::SessionOptions {
    backburner_engine::SessionOptions {
        kv_budget: Some(KvBudget::Positions(budget)),
        ..opts()
    }
}

#[test]
fn one_worker_holds_the_oldest_pages_and_the_logits_keep_their_bits() {
    let f = model_with_layers(8, 11);
    let w = start_worker(f.dir.path(), None, None);
    let p = prompt(7 * 64 + 5, 3);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 70);
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let got = run(&mut off, &p, 70);
    assert_eq!(got.1, want.1, "tokens");
    assert!(got.0 == want.0, "logits differ in bits");
    let st = off.link_stats();
    // 7·64 + 5 + 70 = 523 positions; at most 128 on the host, whole pages of 64 on the worker
    let n = p.len() + 70;
    let on_worker = st.positions_on_workers as usize;
    assert_eq!(on_worker % 64, 0);
    assert!(
        n - on_worker <= 128 && n - on_worker > 64,
        "{on_worker} of {n} on the worker"
    );
    // 2 full-attention layers in 8
    assert_eq!(st.pages_on_workers as usize, on_worker / 64 * 2);
    assert_eq!((st.fallbacks, st.offload_failures), (0, 0));
    assert!(st.offload_decode_tokens > 0 && st.bytes_per_decode_token() > 0);
}

/// The original's offload with the roles of host and phone: the host computes its layers on a device (here the CPU
/// backend, the only one this machine has) and a CPU worker holds the oldest KV pages; the device's caches send
/// their pages over the link and fold the worker's partials into their own, for the bits of an unbounded local run
/// on the CPU path.
#[test]
fn a_worker_holds_the_pages_of_layers_on_a_device_and_the_logits_keep_their_bits() {
    let f = model_with_layers(8, 11);
    let w = start_worker(f.dir.path(), None, None);
    let p = prompt(7 * 64 + 5, 3);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 70);
    let mut placed = backburner_model::Model::load(f.dir.path()).unwrap();
    let cpu = std::sync::Arc::new(backburner_model::device::CpuBackend);
    placed.place_layers(0..8, cpu.clone()).unwrap();
    placed.place_head(cpu).unwrap();
    let mut off = Session::new(std::sync::Arc::new(placed), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let got = run(&mut off, &p, 70);
    assert_eq!(got.1, want.1, "tokens");
    assert!(got.0 == want.0, "logits differ in bits");
    let st = off.link_stats();
    let on_worker = st.positions_on_workers as usize;
    assert!(p.len() + 70 - on_worker <= 128, "{on_worker} on the worker");
    assert_eq!(st.pages_on_workers as usize, on_worker / 64 * 2);
    assert_eq!((st.fallbacks, st.offload_failures), (0, 0));
    assert!(st.offload_decode_tokens > 0);
}

/// With layers on a device, a worker that would take split prefill (a prompt past `split_min_tokens`) is not asked
/// to: split prefill hands layer states through the CPU path's, so the host computes every ubatch and the logits are
/// the local run's.
#[test]
fn layers_on_a_device_take_no_split_prefill_from_a_worker() {
    let f = model_with_layers(8, 13);
    let w = start_worker(f.dir.path(), None, None);
    let p = prompt(9 * 64 + 5, 5);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 4);
    let mut placed = backburner_model::Model::load(f.dir.path()).unwrap();
    placed
        .place_layers(
            0..8,
            std::sync::Arc::new(backburner_model::device::CpuBackend),
        )
        .unwrap();
    let mut s = Session::new(std::sync::Arc::new(placed), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let got = run(&mut s, &p, 4);
    assert!(got == want, "logits differ in bits");
    assert_eq!(s.link_stats().split_calls, 0);
    // the same worker does split the plain model's prompt
    let mut plain = Session::new(f.model.clone(), opts()).unwrap();
    plain.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert!(run(&mut plain, &p, 4) == want);
    assert!(plain.link_stats().split_calls > 0);
}

#[test]
fn two_workers_share_the_pages_in_order_and_the_logits_keep_their_bits() {
    let f = model_with_layers(8, 12);
    // the first worker has room for a few pages of both attention layers (f16, 2 kv heads × 32 dims, 64 positions:
    // 16 KiB per page and layer) beside its session state; the second takes the rest
    let w1 = start_worker_with(f.dir.path(), |o| {
        o.max_memory = 220_000 + tail_weights(f.dir.path(), 4)
    });
    let w2 = start_worker(f.dir.path(), None, None);
    let p = prompt(9 * 64 + 7, 4);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 40);
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &w1.addr, Some(4), b""));
    off.attach_worker(client(f.dir.path(), &w2.addr, Some(4), b""));
    let got = run(&mut off, &p, 40);
    assert_eq!(got.1, want.1, "tokens");
    assert!(got.0 == want.0, "logits differ in bits");
    let runs = off.placement().runs().to_vec();
    assert_eq!(
        runs.iter().map(|r| r.worker).collect::<Vec<_>>(),
        [0, 1],
        "{runs:?}"
    );
    assert_eq!(
        (runs[0].start, runs[0].end % 64, runs[1].start),
        (0, 0, runs[0].end)
    );
    assert!(
        runs[0].end >= 2 * 64 && runs[1].end > runs[1].start + 64,
        "{runs:?}"
    );
}

#[test]
fn without_a_worker_a_prompt_past_the_budget_is_a_typed_error_and_the_session_is_unchanged() {
    let f = model_with_layers(8, 13);
    let mut s = Session::new(f.model.clone(), budgeted(128)).unwrap();
    s.prefill(&prompt(100, 1), Logits::Last, |_, _| {}).unwrap();
    let e = s
        .prefill(&prompt(300, 2), Logits::Last, |_, _| {})
        .unwrap_err();
    match e {
        EngineError::KvBudget { budget, .. } => assert_eq!(budget, 128),
        other => panic!("expected a KV budget error, got {other}"),
    }
    assert_eq!(s.tokens().len(), 100);
    assert_eq!(s.state().n_tokens(), 100);
    // and the session goes on exactly
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let a = local
        .prefill(&prompt(100, 1), Logits::Last, |_, _| {})
        .unwrap();
    let b = local.decode(7).unwrap();
    let _ = a;
    assert_eq!(bits(&s.decode(7).unwrap()), bits(&b));
}

#[test]
fn a_worker_lost_mid_decode_is_recovered_by_re_ingesting_on_the_next_worker_with_the_same_bits() {
    let f = model_with_layers(8, 14);
    let w1 = start_worker(f.dir.path(), None, None);
    let w2 = start_worker(f.dir.path(), None, None);
    let p = prompt(5 * 64 + 3, 5);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 30);
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &w1.addr, Some(4), b""));
    off.attach_worker(client(f.dir.path(), &w2.addr, Some(4), b""));
    let mut l = off.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    let mut toks = Vec::new();
    let mut all = Vec::new();
    for step in 0..30 {
        all.push(bits(&l));
        if step == 10 {
            w1.stop_now();
        }
        let t = backburner_engine::argmax(&l);
        toks.push(t);
        l = off.decode(t).unwrap();
    }
    all.push(bits(&l));
    // the same tokens and logits bit for bit, the loss included: the re-ingest replays the history's own calls
    // (the prompt's ubatches, then each decoded token as a decode step)
    assert_eq!(toks, want.1);
    assert!(all == want.0, "logits differ in bits");
    let st = off.link_stats();
    assert_eq!(st.offload_failures, 1);
    // the pages now live on the second worker only
    assert!(off.placement().runs().iter().all(|r| r.worker == 1));
}

#[test]
fn with_its_only_worker_gone_a_request_fails_typed_and_the_next_one_rebuilds_once_a_worker_is_back()
{
    let f = model_with_layers(8, 15);
    let w = start_worker(f.dir.path(), None, None);
    let addr = w.addr.clone();
    let p = prompt(4 * 64 + 9, 6);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 3);
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &addr, Some(4), b""));
    let l = off.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    assert_eq!(bits(&l), want.0[0]);
    drop(w); // stops and joins: the connection and the pages are gone
    let t0 = backburner_engine::argmax(&l);
    match off.decode(t0).unwrap_err() {
        EngineError::KvBudget { budget, .. } => assert_eq!(budget, 128),
        other => panic!("expected a KV budget error, got {other}"),
    }
    assert_eq!(
        off.tokens(),
        &p[..],
        "the history is kept, without the failed step's token"
    );
    assert_eq!(off.state().n_tokens(), 0, "the state waits for a rebuild");
    // a worker comes back on the same address during the client's backoff: the next request waits it out and
    // rebuilds
    let _w2 = start_worker_on(f.dir.path(), &addr);
    let l1 = off.decode(t0).unwrap();
    assert_eq!(off.link_stats().backoff_waits, 1);
    let t1 = backburner_engine::argmax(&l1);
    let l2 = off.decode(t1).unwrap();
    assert_eq!(
        [t0, t1, backburner_engine::argmax(&l2)],
        [want.1[0], want.1[1], want.1[2]]
    );
    assert_eq!(off.state().n_tokens(), p.len() + 2);
    assert!(off.link_stats().positions_on_workers > 0);
}

#[test]
fn prefill_past_the_budget_interleaved_or_not_gives_the_local_bits() {
    let f = model_with_layers(8, 16);
    let w = start_worker_with(f.dir.path(), |o| o.max_ubatch = 256);
    let big = |budget: Option<usize>, interleave: bool| backburner_engine::SessionOptions {
        ubatch: 128,
        kv_budget: budget.map(KvBudget::Positions),
        interleave,
        ..opts()
    };
    // ubatches of 128 (halves of 64) and a last one of 100 (run whole: a half would be under the GDN chunk of 64)
    let p = prompt(8 * 128 + 100, 9);
    let mut local = Session::new(f.model.clone(), big(None, true)).unwrap();
    let want = local.prefill(&p, Logits::All, |_, _| {}).unwrap();
    let want_next = local.decode(5).unwrap();
    for interleave in [true, false] {
        let mut s = Session::new(f.model.clone(), big(Some(320), interleave)).unwrap();
        s.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
        let got = s.prefill(&p, Logits::All, |_, _| {}).unwrap();
        assert!(
            bits(&got) == bits(&want),
            "interleave {interleave}: prefill logits differ"
        );
        assert_eq!(
            bits(&s.decode(5).unwrap()),
            bits(&want_next),
            "interleave {interleave}"
        );
        let st = s.link_stats();
        // pages leave from the third ubatch on: 6 ubatches of 128 with pages on the worker
        let expect = if interleave { 6 } else { 0 };
        assert_eq!(st.interleaved_ubatches, expect, "interleave {interleave}");
        assert!(st.positions_on_workers >= 8 * 128 - 320);
    }
}

#[test]
fn a_checkpoint_at_a_page_boundary_below_the_offloaded_pages_restores_in_place() {
    let f = model_with_layers(8, 16);
    let w = start_worker(f.dir.path(), None, None);
    let p = prompt(5 * 64 + 10, 7);
    let mut off = Session::new(f.model.clone(), budgeted(128)).unwrap();
    off.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    off.keep_checkpoints_at(vec![100, 112, 128, 192]);
    off.prefill(&p, Logits::Last, |_, _| {}).unwrap();
    let cps = off.take_checkpoints();
    let at: Vec<usize> = cps.iter().map(|c| c.n_tokens()).collect();
    // 100 is inside a ubatch of 16 (not a chunk boundary of its call): not taken
    assert_eq!(at, [112, 128, 192]);
    assert_eq!(
        off.state().offloaded(),
        4 * 64,
        "pages on the worker past 192"
    );
    // 112 is below the offloaded pages and not a page boundary: only a rebuild could go there
    assert!(!off.rewinds_in_place(112));
    assert!(off.rewinds_in_place(128));
    assert!(off.rewind(&cps[1]));
    assert_eq!(off.link_stats().positions_on_workers, 128);
    assert_eq!(off.state().offloaded(), 128);
    // the rest of another prompt from there: the bits of a cold local run
    let q = [&p[..128], &prompt(90, 8)[..]].concat();
    let got = run_rest(&mut off, &q, 128, 5);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &q, 5);
    assert_eq!(got.1, want.1);
    assert!(got.0 == want.0, "logits differ in bits");
    // a snapshot past the host's pages restores as usual; one not a page boundary below them rebuilds
    assert!(!off.rewind(&cps[0]));
    assert_eq!(off.state().n_tokens(), 0, "the state waits for a rebuild");
    let again = run_rest(&mut off, &q, 112, 5);
    assert!(again.0 == want.0, "rebuilt logits differ in bits");
}

/// [`run`] of `q[from..]` on a session holding `q[..from]`.
fn run_rest(s: &mut Session, q: &[u32], from: usize, steps: usize) -> (Vec<Vec<u32>>, Vec<u32>) {
    assert_eq!(s.tokens(), &q[..from]);
    run(s, &q[from..], steps)
}
