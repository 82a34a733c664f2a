//! Verify steps on a layer-split worker without sockets (protocol version 8, docs/PROTOCOL.md §5.16): a verify
//! `RunLayers` returns the residual rows of one-token steps, the next request at a position inside it rolls the
//! worker back there with the bits of the kept steps, a `Rewind` inside it does too, and misuse gets a typed fault.

use std::sync::Arc;
use std::time::Instant;

use backburner_engine::worker::{MemoryBudget, Reply, SessionCore, SessionSpec};
use backburner_engine::ComputePool;
use backburner_kernels::kv::KvDtype;
use backburner_link::message::{Rewind, RunLayers};
use backburner_link::{ErrorCode, Request};
use backburner_model::{synthetic, KvOptions, Model};

fn model() -> (tempfile::TempDir, Arc<Model>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = synthetic::tiny_config(8);
    cfg["full_attention_interval"] = 4.into();
    synthetic::write_random_checkpoint(dir.path(), &cfg, 5).unwrap();
    let m = Arc::new(Model::load(dir.path()).unwrap());
    (dir, m)
}

fn spec(layer_split: bool) -> SessionSpec {
    SessionSpec {
        range: 4..8,
        kv: KvOptions {
            page_size: 16,
            dtype: KvDtype::F16,
        },
        ubatch: 32,
        max_positions: 1 << 20,
        max_frame: 1 << 24,
        pack_pages: true,
        layer_split,
    }
}

/// The residual rows `pos..pos + t` of a fixed stream (`[t, hidden]`).
fn rows(hidden: usize, pos: usize, t: usize) -> Vec<f32> {
    (pos * hidden..(pos + t) * hidden)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
        .collect()
}

fn req(hidden: usize, pos: usize, t: usize, keep: Vec<u64>, verify: bool) -> Request {
    let r = RunLayers {
        pos: pos as u64,
        n_tokens: t as u32,
        keep,
        verify,
    };
    Request::RunLayers(r, backburner_link::frame::f32_bytes(&rows(hidden, pos, t)))
}

/// Runs a request and returns the reply's position and residual bits.
fn go(core: &mut SessionCore, pool: &ComputePool, r: Request) -> (u64, Vec<u32>) {
    match core.handle(r, Instant::now(), pool) {
        Ok(Reply::LayersDone(d, x, _)) => (
            d.pos_after,
            backburner_link::frame::bytes_f32(&x)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect(),
        ),
        other => panic!("expected LayersDone, got {other:?}"),
    }
}

#[test]
fn a_verify_run_has_the_bits_of_one_token_runs_and_rolls_back_on_the_next_request() {
    let (_d, m) = model();
    let hidden = m.config().hidden_size;
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    // the reference: 20 rows, then one-token runs
    let mut plain = SessionCore::new(m.clone(), spec(true), &budget).unwrap();
    go(&mut plain, &pool, req(hidden, 0, 20, vec![], false));
    let one: Vec<Vec<u32>> = (20..26)
        .map(|p| go(&mut plain, &pool, req(hidden, p, 1, vec![], false)).1)
        .collect();
    for (accepted, next) in [(2usize, false), (5, false), (1, true), (3, true)] {
        let mut core = SessionCore::new(m.clone(), spec(true), &budget).unwrap();
        go(&mut core, &pool, req(hidden, 0, 20, vec![], false));
        let held = core.held_bytes();
        let (pos, x) = go(&mut core, &pool, req(hidden, 20, 5, vec![], true));
        assert_eq!(pos, 25);
        for r in 0..5 {
            assert_eq!(x[r * hidden..(r + 1) * hidden], one[r][..], "row {r}");
        }
        assert!(core.held_bytes() > held, "the rollback data is counted");
        let to = 20 + accepted;
        if next {
            // a Rewind inside the open step goes back to it
            let r = core.handle(
                Request::Rewind(Rewind { to_pos: to as u64 }),
                Instant::now(),
                &pool,
            );
            assert!(matches!(r, Ok(Reply::RewindDone(d)) if d.restored && d.pos == to as u64));
        }
        // the next one-token run at 20 + accepted has the reference's bits: the rollback kept exactly that much
        let (pos, x) = go(&mut core, &pool, req(hidden, to, 1, vec![], false));
        assert_eq!(pos, to as u64 + 1);
        assert_eq!(x, one[accepted], "accepted {accepted}, rewind {next}");
    }
}

#[test]
fn misused_verify_runs_get_typed_faults() {
    let (_d, m) = model();
    let hidden = m.config().hidden_size;
    let pool = ComputePool::new(1).unwrap();
    let budget = MemoryBudget::new(1 << 30);
    let code = |core: &mut SessionCore, r: Request| match core.handle(r, Instant::now(), &pool) {
        Err(f) => f.code,
        Ok(r) => panic!("accepted: {r:?}"),
    };
    // a split-prefill mirror has no verify steps
    let mut mirror = SessionCore::new(m.clone(), spec(false), &budget).unwrap();
    assert_eq!(
        code(&mut mirror, req(hidden, 0, 3, vec![], true)),
        ErrorCode::BadState
    );
    // a verify keeps no checkpoint
    let mut core = SessionCore::new(m.clone(), spec(true), &budget).unwrap();
    assert_eq!(
        code(&mut core, req(hidden, 0, 3, vec![3], true)),
        ErrorCode::BadState
    );
    // after a verify at 0..4, a request past its end is refused as any position mismatch is
    go(&mut core, &pool, req(hidden, 0, 4, vec![], true));
    assert_eq!(
        code(&mut core, req(hidden, 5, 1, vec![], false)),
        ErrorCode::BadState
    );
}

#[test]
fn a_verify_that_does_not_fit_the_budget_is_refused_before_it_runs() {
    let (_d, m) = model();
    let hidden = m.config().hidden_size;
    let pool = ComputePool::new(1).unwrap();
    let probe = MemoryBudget::new(1 << 30);
    let mut core = SessionCore::new(m.clone(), spec(true), &probe).unwrap();
    go(&mut core, &pool, req(hidden, 0, 8, vec![], false));
    // room for the 8 rows and a plain step's growth, not for what a verify of 16 keeps
    let keep = m.verify_keep_bytes(4..8, 16) as u64;
    assert!(keep > 0);
    let budget = MemoryBudget::new(core.held_bytes() + 2 * 16 * hidden as u64 * 4 + keep / 2);
    let mut core = SessionCore::new(m.clone(), spec(true), &budget).unwrap();
    go(&mut core, &pool, req(hidden, 0, 8, vec![], false));
    let r = core.handle(req(hidden, 8, 16, vec![], true), Instant::now(), &pool);
    assert!(
        matches!(r, Err(ref f) if f.code == ErrorCode::OutOfMemory),
        "{r:?}"
    );
    // nothing ran: a plain step continues at 8
    assert_eq!(go(&mut core, &pool, req(hidden, 8, 1, vec![], false)).0, 9);
}
