//! The worker's request handling without sockets: every size from the wire at 0, its maximum and past it gets a
//! typed error, never a panic or a wrapped size; random request sequences (a bounded fuzz run in CI) keep the
//! memory accounting exact and under the budget.

use std::sync::Arc;
use std::time::Instant;

use backburner_engine::worker::{MemoryBudget, Reply, SessionCore, SessionSpec};
use backburner_engine::ComputePool;
use backburner_kernels::kv::KvDtype;
use backburner_link::message::{Attend, Fetch, PagesDrop, PagesPut, RunLayers, Sync};
use backburner_link::{ErrorCode, Request};
use backburner_model::{synthetic, KvOptions, Model};
use proptest::prelude::*;

fn model(n_layers: usize, interval: usize) -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = synthetic::tiny_config(n_layers);
    cfg["full_attention_interval"] = interval.into();
    synthetic::write_random_checkpoint(dir.path(), &cfg, 3).unwrap();
    let m = Arc::new(Model::load(dir.path()).unwrap());
    (dir, m)
}

fn spec(n: usize) -> SessionSpec {
    SessionSpec {
        range: 4..n,
        kv: KvOptions {
            page_size: 64,
            dtype: KvDtype::F16,
        },
        ubatch: 16,
        max_positions: 1 << 40,
        max_frame: 1 << 20,
        pack_pages: true,
        layer_split: false,
    }
}

fn code(r: Result<Reply, backburner_engine::worker::Fault>) -> ErrorCode {
    match r {
        Ok(r) => panic!("accepted: {r:?}"),
        Err(f) => f.code,
    }
}

fn sync(t: u64, a: u64, payload: Vec<u8>) -> Request {
    Request::Sync(
        Sync {
            truncate_to: t,
            pos_after: a,
            linear: false,
        },
        payload,
    )
}

fn run(pos: u64, n: u32, bytes: usize) -> Request {
    Request::RunLayers(
        RunLayers {
            pos,
            n_tokens: n,
            keep: Vec::new(),
            verify: false,
        },
        vec![0; bytes],
    )
}

fn fetch(a: u64, b: u64) -> Request {
    Request::Fetch(Fetch {
        from_pos: a,
        to_pos: b,
        linear: true,
    })
}

#[test]
fn wire_values_at_their_extremes_get_typed_errors() {
    let (_d, m) = model(8, 4);
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    let mut core = SessionCore::new(m.clone(), spec(8), &budget).unwrap();
    let now = Instant::now();
    let mut h = |r: Request| core.handle(r, now, &pool);
    // 2^56 rows with an empty payload (their byte count used to wrap to 0 and pass): past the position bound
    for a in [1u64 << 56, u64::MAX] {
        assert_eq!(
            code(h(sync(0, a, vec![]))),
            ErrorCode::BadState,
            "pos_after {a}"
        );
    }
    // within the bound, the checked byte count does not match the empty payload
    for a in [1u64 << 39, 1] {
        assert_eq!(
            code(h(sync(0, a, vec![]))),
            ErrorCode::Malformed,
            "pos_after {a}"
        );
    }
    assert_eq!(
        code(h(sync(5, 5, vec![]))),
        ErrorCode::BadState,
        "truncate past the mirror"
    );
    assert_eq!(code(h(sync(0, u64::MAX, vec![0; 7]))), ErrorCode::BadState);
    // one row: 1 attention layer × K,V × 2 heads × 32 dims × f16
    assert!(matches!(h(sync(0, 1, vec![0; 256])), Ok(Reply::SyncDone)));
    for (pos, n, bytes) in [
        (1, u32::MAX, 64),
        (1, 17, 17 * 256),  // over the ubatch
        (1, 0, 0),          // empty
        (0, 1, 256),        // wrong position
        (u64::MAX, 1, 256), // position at the maximum
        (1, 2, 256),        // wrong byte count
    ] {
        assert_eq!(
            code(h(run(pos, n, bytes))),
            ErrorCode::BadState,
            "RunLayers {pos} {n} {bytes}"
        );
    }
    assert!(
        matches!(h(run(1, 2, 2 * 64 * 4)), Ok(Reply::LayersDone(d, x, _)) if d.pos_after == 3 && x.is_empty())
    );
    for (a, b) in [(0, 4), (2, 1), (0, u64::MAX), (u64::MAX, u64::MAX)] {
        assert_eq!(code(h(fetch(a, b))), ErrorCode::BadState, "fetch {a}..{b}");
    }
    assert!(
        matches!(h(fetch(0, 3)), Ok(Reply::FetchDone(f, p, _)) if f.to_pos == 3 && p.len() == 3 * 256 + 3 * 4 * (160 * 3 + 4 * 16 * 24))
    );
    assert!(matches!(h(Request::Reset), Ok(Reply::ResetDone)));
    assert_eq!(budget.used(), core.mirror().bytes() as u64);
}

#[test]
fn a_range_without_attention_layers_bounds_positions() {
    // full_attention_interval 16 on 8 layers: no attention layer, so a row costs 0 bytes and only the position
    // bound stops a huge sync (the host side refuses such a model for split: there is no split point)
    let (_d, m) = model(8, 16);
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    let mut core = SessionCore::new(m, spec(8), &budget).unwrap();
    let r = core.handle(sync(0, 1 << 56, vec![]), Instant::now(), &pool);
    assert_eq!(code(r), ErrorCode::BadState);
    assert!(backburner_engine::balanced_split(&synthetic_config(8, 16), 1, 1).is_none());
}

fn synthetic_config(n: usize, interval: usize) -> backburner_model::ModelConfig {
    let (_d, m) = model(n, interval);
    m.config().clone()
}

#[test]
fn the_budget_refuses_growth_before_allocating() {
    let (_d, m) = model(8, 4);
    let pool = ComputePool::new(1).unwrap();
    let base = SessionCore::new(m.clone(), spec(8), &MemoryBudget::new(1 << 30))
        .unwrap()
        .mirror()
        .bytes() as u64;
    // room for the linear states and 10 rows' growth, not for 16
    let budget = MemoryBudget::new(base + 10 * (256 + 512));
    let mut core = SessionCore::new(m, spec(8), &budget).unwrap();
    let r = core.handle(run(0, 16, 16 * 64 * 4), Instant::now(), &pool);
    assert_eq!(code(r), ErrorCode::OutOfMemory);
    assert_eq!(core.mirror().n_tokens(), 0);
    assert_eq!(budget.used(), base);
    assert!(matches!(
        core.handle(run(0, 4, 4 * 64 * 4), Instant::now(), &pool),
        Ok(Reply::LayersDone(..))
    ));
}

/// One page of both attention layers (3 and 7): 2 × (K, V) × 2 heads × 32 dims × 64 positions × f16.
const PAGE_PUT: usize = 2 * 2 * 2 * 32 * 64 * 2;

fn put(first: u64, n: u32, bytes: usize) -> Request {
    Request::PagesPut(
        PagesPut {
            first_pos: first,
            n_pages: n,
        },
        vec![0x3c; bytes],
    )
}

fn attend(
    layer: u32,
    pos: u64,
    t: u32,
    heads: u32,
    scale: f32,
    per_page: bool,
    bytes: usize,
) -> Request {
    Request::Attend(
        Attend {
            layer,
            q_pos0: pos,
            n_tokens: t,
            n_heads: heads,
            scale,
            per_page,
        },
        vec![0; bytes],
    )
}

#[test]
fn page_requests_at_their_extremes_get_typed_errors_and_a_full_worker_says_so() {
    let (_d, m) = model(8, 4);
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    let mut core = SessionCore::new(m.clone(), spec(8), &budget).unwrap();
    let now = Instant::now();
    let mut h = |r: Request| core.handle(r, now, &pool);
    for (first, n, bytes, want) in [
        (0, 0, 0, ErrorCode::Malformed),               // no page
        (0, 1, PAGE_PUT - 1, ErrorCode::Malformed),    // a byte short
        (0, 2, PAGE_PUT, ErrorCode::Malformed),        // half the bytes
        (0, u32::MAX, PAGE_PUT, ErrorCode::Malformed), // a count whose bytes overflow nothing but mismatch
        (32, 1, PAGE_PUT, ErrorCode::BadState),        // off a page boundary
        (u64::MAX, 1, PAGE_PUT, ErrorCode::BadState),  // past every position
        (1 << 40, 1, PAGE_PUT, ErrorCode::BadState),   // past the session's positions
    ] {
        assert_eq!(
            code(h(put(first, n, bytes))),
            want,
            "PagesPut {first} {n} {bytes}"
        );
    }
    assert!(
        matches!(h(put(64, 2, 2 * PAGE_PUT)), Ok(Reply::PagesDone(d)) if (d.first_pos, d.end_pos) == (64, 192))
    );
    assert_eq!(
        code(h(put(64, 1, PAGE_PUT))),
        ErrorCode::BadState,
        "not at the run's end"
    );
    let q = 4 * 32 * 4;
    for (layer, pos, t, heads, scale, bytes, want) in [
        (2, 192, 1, 4, 0.1, q, ErrorCode::Malformed), // a linear layer
        (8, 192, 1, 4, 0.1, q, ErrorCode::Malformed), // past the model
        (u32::MAX, 192, 1, 4, 0.1, q, ErrorCode::Malformed), //
        (3, 192, 1, 8, 0.1, 2 * q, ErrorCode::Malformed), // not the model's heads
        (3, 192, 1, 4, f32::NAN, q, ErrorCode::Malformed), // scale
        (3, 192, 1, 4, -1.0, q, ErrorCode::Malformed), //
        (3, 192, 1, 4, 0.1, q - 4, ErrorCode::Malformed), // q a value short
        (3, 100, 1, 4, 0.1, q, ErrorCode::BadState),  // queries inside the pages held
        (3, 192, 0, 4, 0.1, 0, ErrorCode::BadState),  // no query
        (3, 192, 17, 4, 0.1, 17 * q, ErrorCode::BadState), // over the ubatch
        (3, u64::MAX, 1, 4, 0.1, q, ErrorCode::BadState), // position overflow
        (3, 192, u32::MAX, 4, 0.1, q, ErrorCode::BadState), //
    ] {
        assert_eq!(
            code(h(attend(layer, pos, t, heads, scale, false, bytes))),
            want,
            "Attend {layer} {pos} {t} {heads} {scale} {bytes}"
        );
    }
    assert!(matches!(
        h(attend(7, 192, 2, 4, 0.1, false, 2 * q)),
        Ok(Reply::Partials(p, b, _)) if p.n_parts == 1 && b.len() == 2 * 4 * 33 * 4
    ));
    assert!(matches!(
        h(attend(7, 200, 1, 4, 0.1, true, q)),
        Ok(Reply::Partials(p, b, _)) if p.n_parts == 2 && b.len() == 2 * 4 * 33 * 4
    ));
    assert_eq!(
        code(h(Request::PagesDrop(PagesDrop { to_pos: 100 }))),
        ErrorCode::BadState
    );
    assert!(
        matches!(h(Request::PagesDrop(PagesDrop { to_pos: 128 })), Ok(Reply::PagesDone(d)) if d.end_pos == 128)
    );
    assert_eq!(budget.used(), core.held_bytes());
    // a worker without room answers PagesFull and keeps the session; the first put also needs the headroom for
    // answering an Attend of a 16-token ubatch (4 heads of 32: its partial three times, its queries twice)
    let small = MemoryBudget::new(core.mirror().bytes() as u64 + PAGE_PUT as u64 / 2);
    let mut core = SessionCore::new(m, spec(8), &small).unwrap();
    let full = core.handle(put(0, 1, PAGE_PUT), now, &pool);
    let headroom = 3 * 16 * 4 * 33 * 4 + 2 * (16 * 4 * 32 * 4 + 64);
    assert!(
        matches!(full, Ok(Reply::PagesFull(ref f))
            if f.needed == (PAGE_PUT + headroom) as u64 && f.free == PAGE_PUT as u64 / 2),
        "{full:?}"
    );
    assert_eq!(core.pages().pages(), 0);
    assert_eq!(small.used(), core.held_bytes());
}

fn any_request() -> impl Strategy<Value = Request> {
    let pos = prop_oneof![0u64..40, Just(u64::MAX), Just(1u64 << 56), any::<u64>()];
    prop_oneof![
        (pos.clone(), pos.clone(), 0usize..4, any::<bool>()).prop_map(|(t, a, rows, linear)| {
            let lin = if linear {
                3 * 4 * (160 * 3 + 4 * 16 * 24)
            } else {
                0
            };
            Request::Sync(
                Sync {
                    truncate_to: t,
                    pos_after: a,
                    linear,
                },
                vec![1; rows * 256 + lin],
            )
        }),
        (pos.clone(), 0u32..20, 0usize..20).prop_map(|(p, n, rows)| run(p, n, rows * 256)),
        (pos.clone(), pos.clone()).prop_map(|(a, b)| fetch(a, b)),
        proptest::collection::vec(any::<u8>(), 0..64).prop_map(Request::Ping),
        Just(Request::Reset),
        (pos.clone(), 0u32..4, 0usize..4).prop_map(|(p, n, k)| put(p / 64 * 64, n, k * PAGE_PUT)),
        pos.clone().prop_map(|p| Request::PagesDrop(PagesDrop {
            to_pos: p / 64 * 64
        })),
        (
            prop_oneof![Just(3u32), Just(7), any::<u32>()],
            pos,
            0u32..18,
            any::<bool>()
        )
            .prop_map(|(l, p, t, pp)| attend(l, p, t, 4, 0.1, pp, t as usize * 4 * 32 * 4)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_requests_never_panic_and_keep_the_accounting_exact(reqs in proptest::collection::vec(any_request(), 1..24)) {
        let (_d, m) = model(8, 4);
        let pool = ComputePool::new(1).unwrap();
        let budget = MemoryBudget::new(1 << 22);
        let mut core = SessionCore::new(m, spec(8), &budget).unwrap();
        for r in reqs {
            let out = core.handle(r, Instant::now(), &pool);
            if let Err(f) = &out {
                prop_assert!(matches!(f.code, ErrorCode::BadState | ErrorCode::Malformed | ErrorCode::OutOfMemory), "{f:?}");
            }
            drop(out);
            prop_assert_eq!(budget.used(), core.held_bytes());
            prop_assert!(budget.used() <= budget.limit());
        }
    }
}

#[test]
fn a_layer_split_session_returns_the_residual_of_any_range() {
    let (_d, m) = model(8, 4);
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    let mut sp = spec(8);
    sp.range = 2..5; // neither a tail nor on the 4-layer seam
    sp.layer_split = true;
    let mut core = SessionCore::new(m.clone(), sp.clone(), &budget).unwrap();
    let hidden = m.config().hidden_size;
    let x: Vec<f32> = (0..3 * hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
        .collect();
    let bytes = backburner_link::frame::f32_bytes(&x);
    let before = budget.used();
    let reply = core
        .handle(
            Request::RunLayers(
                RunLayers {
                    pos: 0,
                    n_tokens: 3,
                    keep: Vec::new(),
                    verify: false,
                },
                bytes.clone(),
            ),
            Instant::now(),
            &pool,
        )
        .unwrap();
    let Reply::LayersDone(d, back, hold) = reply else {
        panic!("expected LayersDone")
    };
    assert_eq!(d.pos_after, 3);
    // the reply and its sealed copy are reserved until sent
    assert_eq!(hold.bytes(), 2 * bytes.len() as u64);
    assert!(budget.used() >= before + hold.bytes());
    drop(hold);
    let mut want = x.clone();
    let mut st = backburner_model::ModelState::new(m.config(), 2..5, sp.kv);
    m.forward_layers(2..5, &mut want, 3, &mut st);
    let got = backburner_link::frame::bytes_f32(&back).unwrap();
    assert_eq!(
        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

/// A layer-split RunLayers of `t` rows at `pos` (a deterministic residual), keeping checkpoints at `keep`.
fn split_run(hidden: usize, pos: u64, t: u32, keep: Vec<u64>) -> Request {
    let x: Vec<f32> = (0..t as usize * hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
        .collect();
    let r = RunLayers {
        pos,
        n_tokens: t,
        keep,
        verify: false,
    };
    Request::RunLayers(r, backburner_link::frame::f32_bytes(&x))
}

#[test]
fn a_layer_split_worker_keeps_checkpoints_and_rewinds_to_them_exactly() {
    use backburner_link::message::{Rewind, MAX_KEEP};
    let (_d, m) = model(8, 4);
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    let mut sp = spec(8);
    sp.range = 4..8;
    sp.layer_split = true;
    sp.ubatch = 128;
    let hidden = m.config().hidden_size;
    let mut core = SessionCore::new(m.clone(), sp.clone(), &budget).unwrap();
    let mut h = |r: Request| core.handle(r, Instant::now(), &pool);
    // keep lists that are too long, unordered or outside the ubatch are refused
    let too_many: Vec<u64> = (1..=MAX_KEEP as u64 + 1).collect();
    for keep in [too_many, vec![64, 64], vec![0], vec![101]] {
        assert_eq!(
            code(h(split_run(hidden, 0, 100, keep.clone()))),
            ErrorCode::Malformed,
            "{keep:?}"
        );
    }
    // 100 rows keeping 64 (a chunk boundary of the call), 50 (not one: not kept) and 100 (its end)
    assert!(matches!(
        h(split_run(hidden, 0, 100, vec![50, 64, 100])),
        Ok(Reply::LayersDone(..))
    ));
    assert!(matches!(
        h(split_run(hidden, 100, 20, vec![])),
        Ok(Reply::LayersDone(..))
    ));
    let rewind = |to| Request::Rewind(Rewind { to_pos: to });
    // past the mirror: a fault; at the mirror: a no-op; where nothing is kept: refused, nothing changes
    assert_eq!(code(h(rewind(121))), ErrorCode::BadState);
    let done = |r: Result<Reply, _>| match r {
        Ok(Reply::RewindDone(d)) => (d.pos, d.restored),
        other => panic!("expected RewindDone, got {other:?}"),
    };
    assert_eq!(done(h(rewind(120))), (120, true));
    assert_eq!(done(h(rewind(50))), (120, false));
    assert_eq!(done(h(rewind(64))), (64, true));
    assert_eq!(
        core.checkpoints(),
        [64],
        "the later one is gone with the rewind"
    );
    // the state at 64 is that of a session that ran 64 rows of the same residual
    let mut fresh = SessionCore::new(m.clone(), sp.clone(), &budget).unwrap();
    fresh
        .handle(split_run(hidden, 0, 64, vec![]), Instant::now(), &pool)
        .unwrap();
    let lin = |c: &SessionCore| {
        (4..8)
            .filter_map(|i| {
                c.mirror()
                    .linear(i)
                    .map(|l| [l.conv.clone(), l.recurrent.clone()].concat())
            })
            .flat_map(|v| v.into_iter().map(f32::to_bits))
            .collect::<Vec<_>>()
    };
    assert_eq!(lin(&core), lin(&fresh));
    assert_eq!(core.mirror().n_tokens(), 64);
    // the checkpoints count against the budget and leave with the session
    let held = core.held_bytes();
    assert!(held > core.mirror().bytes() as u64);
    let used = budget.used();
    drop(core);
    assert!(budget.used() <= used - held);
}
