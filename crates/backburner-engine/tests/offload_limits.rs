//! KV offload at a worker's limits (found by an adversarial run): a worker full of pages still answers `Attend`
//! (a standing headroom), a put larger than its free memory is answered `PagesFull` and the session goes on, and a
//! later worker's per-page partials over many pages come in token chunks that fit its frame bound; the host's
//! output keeps the local bits throughout.

use crate::worker_common;

use backburner_engine::offload::KvBudget;
use backburner_engine::{EngineError, Logits, Session, SessionOptions};
use backburner_link::frame::Kind;
use backburner_link::message::{Attend, PagesPut};
use backburner_link::Conn;
use worker_common::*;

/// One page of one layer of the tiny model (2 KV heads × 32 dims × 64 positions × K,V × f16).
const PAGE: usize = 2 * 64 * 2 * 32 * 2;

fn connect(dir: &std::path::Path, addr: &str) -> Conn {
    raw_session(dir, addr, 64, Vec::new())
}

fn put(c: &mut Conn, first_pos: u64, n_pages: u32) -> Kind {
    let body = vec![0x3c; n_pages as usize * 2 * PAGE];
    c.writer
        .send(Kind::PagesPut, &PagesPut { first_pos, n_pages }, &body)
        .unwrap();
    c.reader.recv().unwrap().kind()
}

#[test]
fn a_put_larger_than_the_free_memory_is_answered_pages_full_and_the_session_goes_on() {
    let f = model_with_layers(8, 22);
    let w = start_worker_with(f.dir.path(), |o| {
        o.max_memory = (1 << 20) + tail_weights(f.dir.path(), 4)
    });
    let mut c = connect(f.dir.path(), &w.addr);
    // 1 MiB budget, 32 KiB per page over both layers
    assert_eq!(put(&mut c, 0, 10), Kind::PagesDone);
    // the pages do not fit; then the request buffer alone does not fit either: both PagesFull
    assert_eq!(put(&mut c, 640, 14), Kind::PagesFull);
    assert_eq!(put(&mut c, 640, 24), Kind::PagesFull);
    // the session and its pages are still there
    let a = Attend {
        layer: 3,
        q_pos0: 640,
        n_tokens: 16,
        n_heads: 4,
        scale: 0.1,
        per_page: false,
    };
    c.writer
        .send(Kind::Attend, &a, &vec![0; 16 * 4 * 32 * 4])
        .unwrap();
    assert_eq!(c.reader.recv().unwrap().kind(), Kind::Partials);
    assert_eq!(put(&mut c, 640, 1), Kind::PagesDone);
}

fn ubatch_128(budget: Option<usize>) -> SessionOptions {
    SessionOptions {
        ubatch: 128,
        kv_budget: budget.map(KvBudget::Positions),
        ..opts()
    }
}

/// Prefill, 70 decode steps, a second prefill, 5 decode steps: every step's logits bits.
fn two_turns(s: &mut Session) -> Result<Vec<Vec<u32>>, EngineError> {
    let mut out = vec![bits(&s.prefill(
        &prompt(600, 3),
        Logits::Last,
        |_, _| {},
    )?)];
    for t in 0..70u32 {
        out.push(bits(&s.decode(t % 300)?));
    }
    out.push(bits(&s.prefill(
        &prompt(700, 4),
        Logits::Last,
        |_, _| {},
    )?));
    for t in 0..5u32 {
        out.push(bits(&s.decode(t)?));
    }
    Ok(out)
}

#[test]
fn a_first_worker_full_of_pages_keeps_answering_and_the_next_takes_over_with_the_local_bits() {
    let f = model_with_layers(8, 25);
    let want = two_turns(&mut Session::new(f.model.clone(), ubatch_128(None)).unwrap()).unwrap();
    for mem in [500_000u64, 700_000, 900_000] {
        let w1 = start_worker_with(f.dir.path(), |o| {
            o.max_memory = mem + tail_weights(f.dir.path(), 4);
            o.max_ubatch = 256
        });
        let w2 = start_worker_with(f.dir.path(), |o| o.max_ubatch = 256);
        let mut s = Session::new(f.model.clone(), ubatch_128(Some(320))).unwrap();
        s.attach_worker(client(f.dir.path(), &w1.addr, Some(4), b""));
        s.attach_worker(client(f.dir.path(), &w2.addr, Some(4), b""));
        let got = two_turns(&mut s).unwrap();
        assert!(got == want, "mem {mem}: logits differ");
        let st = s.link_stats();
        assert_eq!((st.offload_failures, st.fallbacks), (0, 0), "mem {mem}");
        let runs = s.placement().runs().to_vec();
        assert_eq!(
            runs.iter().map(|r| r.worker).collect::<Vec<_>>(),
            [0, 1],
            "mem {mem}"
        );
    }
    // alone, the full worker refuses more pages: a typed budget error, not a lost worker
    let w1 = start_worker_with(f.dir.path(), |o| {
        o.max_memory = 700_000 + tail_weights(f.dir.path(), 4);
        o.max_ubatch = 256
    });
    let mut s = Session::new(f.model.clone(), ubatch_128(Some(320))).unwrap();
    s.attach_worker(client(f.dir.path(), &w1.addr, Some(4), b""));
    match two_turns(&mut s) {
        Err(EngineError::KvBudget {
            budget: 320, why, ..
        }) => assert!(why.contains("full"), "{why}"),
        other => panic!(
            "expected a KV budget error, got {:?}",
            other.map(|v| v.len())
        ),
    }
    assert_eq!(s.link_stats().offload_failures, 0);
}

#[test]
fn a_later_workers_per_page_partials_come_in_chunks_within_its_frame_bound() {
    let f = model_with_layers(8, 23);
    let p = prompt(40 * 64 + 9, 7);
    let mut local = Session::new(f.model.clone(), ubatch_128(None)).unwrap();
    let want = run(&mut local, &p, 4);
    // the first worker takes a few pages; the second, with 256 KiB frames, the next ~30: per-page partials of a
    // 128-token ubatch over 30 pages would be 2 MiB in one frame
    let w1 = start_worker_with(f.dir.path(), |o| {
        o.max_memory = 560_000 + tail_weights(f.dir.path(), 4);
        o.max_ubatch = 256
    });
    let w2 = start_worker_with(f.dir.path(), |o| {
        o.max_frame = 256 << 10;
        o.max_ubatch = 256
    });
    let mut s = Session::new(f.model.clone(), ubatch_128(Some(320))).unwrap();
    s.attach_worker(client_with(f.dir.path(), &w1.addr, Some(4), b"", 256 << 10));
    s.attach_worker(client_with(f.dir.path(), &w2.addr, Some(4), b"", 256 << 10));
    let got = run(&mut s, &p, 4);
    assert!(got == want, "logits differ");
    let st = s.link_stats();
    assert_eq!((st.offload_failures, st.fallbacks), (0, 0));
    let runs = s.placement().runs().to_vec();
    assert!(
        runs.len() == 2 && runs[1].end - runs[1].start >= 25 * 64,
        "{runs:?}"
    );
}

#[test]
fn a_worker_short_of_memory_evicts_an_idle_mirror_before_an_older_session_holding_pages() {
    let f = model_with_layers(8, 13);
    // as in split.rs: a split session's idle mirror holds ~102 KB after a 20-ubatch prompt and a split call peaks at
    // ~462 KB; a session holding 3 pages holds ~96 KB of pages, ~42 KB of headroom and ~24 KB of state. 680 KB holds
    // both idle sessions, but not a third one's peak beside them: one of the two is evicted.
    let w = start_worker_with(f.dir.path(), |o| {
        o.max_memory = 680_000 + tail_weights(f.dir.path(), 4)
    });
    let pages_prompt = prompt(5 * 64 + 3, 8);
    let mut lp = Session::new(f.model.clone(), opts()).unwrap();
    let want_p = run(&mut lp, &pages_prompt, 3);
    // the oldest: a session holding pages
    let budgeted = SessionOptions {
        kv_budget: Some(KvBudget::Positions(128)),
        ..opts()
    };
    let mut p = Session::new(f.model.clone(), budgeted).unwrap();
    p.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let l = p.prefill(&pages_prompt, Logits::Last, |_, _| {}).unwrap();
    assert_eq!(bits(&l), want_p.0[0]);
    assert!(p.link_stats().positions_on_workers >= 3 * 64);
    // then a split session whose mirror stays
    let mut a = Session::new(f.model.clone(), opts()).unwrap();
    a.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    run(&mut a, &prompt(20 * UBATCH, 1), 0);
    assert_eq!(a.link_stats().fallbacks, 0);
    // a third session needs room: the mirror goes, the pages stay
    let mut b = Session::new(f.model.clone(), opts()).unwrap();
    b.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    run(&mut b, &prompt(20 * UBATCH, 2), 0);
    assert_eq!(b.link_stats().fallbacks, 0, "b should have made room");
    let mut t = backburner_engine::argmax(&l);
    for (i, want) in want_p.0.iter().enumerate().skip(1) {
        let l = p.decode(t).unwrap();
        assert_eq!(&bits(&l), want, "step {i}");
        t = backburner_engine::argmax(&l);
    }
    assert_eq!(
        p.link_stats().offload_failures,
        0,
        "the session holding pages was evicted"
    );
    a.prefill(&prompt(2 * UBATCH, 3), Logits::Last, |_, _| {})
        .unwrap();
    assert_eq!(
        a.link_stats().fallbacks,
        1,
        "the idle mirror should have been evicted"
    );
}

#[test]
fn a_full_workers_message_counts_the_headroom_it_keeps_beside_the_pages() {
    // 4 layers (one cycle: a session of pages only, so nothing else holds the worker's memory); a budget below one
    // page (16 KiB of the model's one attention layer): its first put cannot even be received
    let f = model_with_layers(4, 31);
    let w = start_worker_with(f.dir.path(), |o| o.max_memory = 16_000);
    let mut s = Session::new(
        f.model.clone(),
        SessionOptions {
            kv_budget: Some(KvBudget::Positions(128)),
            ..opts()
        },
    )
    .unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, None, b""));
    let why = match s.prefill(&prompt(3 * 64 + 5, 9), Logits::Last, |_, _| {}) {
        Err(EngineError::KvBudget {
            budget: 128, why, ..
        }) => why,
        other => panic!(
            "expected a KV budget error, got {:?}",
            other.map(|l| l.len())
        ),
    };
    // the oldest page of the model's one attention layer; the headroom for an Attend of a 16-token ubatch over 4
    // heads of 32: its partial (output and an LSE per head, f32) three times, its queries twice (with 64 bytes of
    // control each)
    let (heads, d, t) = (4, 32, UBATCH);
    let headroom = 3 * (t * heads * (d + 1) * 4) + 2 * (t * heads * d * 4 + 64);
    assert_eq!(headroom, 41_856);
    assert_eq!(
        why,
        format!(
            "no worker took the oldest pages: {} is full ({} bytes needed: {PAGE} of pages and {headroom} it keeps \
             for answering attention; 16000 free)",
            w.addr,
            PAGE + headroom
        )
    );
    assert_eq!(s.link_stats().fallbacks, 0);
}
