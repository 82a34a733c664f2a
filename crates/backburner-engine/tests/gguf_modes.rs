//! Every worker mode with GGUF models (fixtures/gguf) and in-process workers on loopback: split prefill, KV offload
//! and layer split give the bits of a local session, a worker holding another file is refused by the fingerprint and
//! its host falls back to the same bits, and a worker's memory budget counts the file's quantized bytes.
//!
//! `tiny-q-<fmt>.gguf` is one 4-layer cycle, which leaves no split point for split prefill (the only seam is the
//! model's end), so the split-prefill and KV-offload tests use it restacked to 8 layers (its blocks twice, bytes
//! unchanged) beside `tiny-f32.gguf`; layer split takes the fixture itself (any layer boundary), and so does KV offload
//! on a worker session that holds pages only.

use crate::worker_common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::offload::KvBudget;
use backburner_engine::{
    Session, SessionOptions, Worker, WorkerError, WorkerOptions, WorkerSettings,
};
use backburner_kernels::kv::KvDtype;
use backburner_link::{ErrorCode, LinkError};
use backburner_model::gguf::writer::restack_layers;
use backburner_model::{Checkpoint, GgufFile, LoadOptions, Model, ModelConfig};
use worker_common::*;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn gguf(name: &str) -> PathBuf {
    fixture("gguf").join(name)
}

/// `tiny-q-<fmt>.gguf` with its 4 blocks twice: 8 layers, a split point at 4.
fn stacked(fmt: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let src = GgufFile::open(&gguf(&format!("tiny-q-{fmt}.gguf"))).unwrap();
    let path = dir.path().join(format!("tiny-q-{fmt}-x2.gguf"));
    restack_layers(&src, &[0, 1, 2, 3, 0, 1, 2, 3])
        .unwrap()
        .write(&path)
        .unwrap();
    (dir, path)
}

fn load(path: &Path) -> Arc<Model> {
    Arc::new(Model::load(path).unwrap())
}

/// Bytes of the mirror's state the worker returns after a split call: `rows` KV rows of the attention layers in
/// `[4, 8)` (K and V, f16) and the three Gated DeltaNet layers' conv and recurrent states (f32).
fn mirror_bytes(cfg: &ModelConfig, rows: usize) -> usize {
    let kv_row = 2 * cfg.num_key_value_heads * cfg.head_dim * 2;
    let lin = 4
        * (cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1)
            + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim);
    rows * kv_row + 3 * lin
}

#[test]
fn split_prefill_with_a_gguf_worker_gives_the_local_bits() {
    let (_tmp, q4k) = stacked("q4_k");
    // every block type in one file (tiny-q-mix.gguf)
    let (_tmp2, mix) = stacked("mix");
    for path in [gguf("tiny-f32.gguf"), q4k, mix] {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let model = load(&path);
        let cfg = model.config().clone();
        assert_eq!(backburner_engine::valid_split_layers(&cfg), [4], "{name}");
        let w = start_worker(&path, None, None);
        let p = prompt(5 * UBATCH + 3, 1);
        let mut local = Session::new(model.clone(), opts()).unwrap();
        let want = run(&mut local, &p, 6);
        let mut split = Session::new(model.clone(), opts()).unwrap();
        split.attach_worker(client(&path, &w.addr, Some(4), b""));
        let got = run(&mut split, &p, 6);
        assert_eq!(got.1, want.1, "{name}: tokens");
        assert!(got.0 == want.0, "{name}: logits differ in bits");
        let st = split.link_stats();
        assert_eq!((st.fallbacks, st.split_calls), (0, 1), "{name}");
        // every ubatch but the last (5 of 16 tokens) ran its tail on the worker
        assert_eq!(st.worker_tokens, 5 * UBATCH as u64, "{name}");
        // out: the residuals entering layer 4 (f32) plus the handshake and frame headers; back: the mirror's new KV
        // rows and linear states
        let residuals = 5 * UBATCH * cfg.hidden_size * 4;
        let sent = st.bytes_sent as usize;
        assert!(
            (residuals..residuals + 1024).contains(&sent),
            "{name}: sent {sent}, residuals {residuals}"
        );
        let back = mirror_bytes(&cfg, 5 * UBATCH);
        let recv = st.bytes_received as usize;
        eprintln!("{name}: sent {sent} (residuals {residuals}), received {recv} (state {back})");
        assert!(
            (back..back + 1024).contains(&recv),
            "{name}: received {recv}, state {back}"
        );
    }
}

#[test]
fn a_worker_holding_another_gguf_is_refused_by_fingerprint_and_the_host_falls_back() {
    let fp = |path: &Path, layers: std::ops::Range<usize>| {
        let cfg = ModelConfig::from_dir(path).unwrap();
        let ck = Checkpoint::open(path).unwrap();
        backburner_model::fingerprint(&ck, &cfg, layers).unwrap()
    };
    let (_a, q4k) = stacked("q4_k");
    let (_b, q8) = stacked("q8_0");
    // same architecture and config, other tensor types and bytes
    assert_eq!(
        ModelConfig::from_dir(&q4k).unwrap(),
        ModelConfig::from_dir(&q8).unwrap()
    );
    assert_ne!(fp(&q4k, 4..8), fp(&q8, 4..8));
    // the same model through another file: the converter stored 1 + w and −exp(A_log), so not the same bytes
    assert_ne!(
        fp(&gguf("tiny-f32.gguf"), 4..8),
        fp(&fixture("tiny-f32"), 4..8)
    );
    // a split set names the same model from either part
    assert_eq!(
        fp(&gguf("tiny-f16-split-00001-of-00002.gguf"), 4..8),
        fp(&gguf("tiny-f16-split-00002-of-00002.gguf"), 4..8)
    );

    let model = load(&q4k);
    let w = start_worker(&q8, None, None);
    let mut c = client(&q4k, &w.addr, Some(4), b"");
    match c.ping(model.config(), KvDtype::F16, 64, UBATCH, b"x") {
        Err(LinkError::Remote {
            code: ErrorCode::ModelMismatch,
            message,
        }) => assert!(
            message.contains("fingerprint differs for layers 4..8") && message.contains("x2.gguf"),
            "{message}"
        ),
        other => panic!("{other:?}"),
    }
    let p = prompt(5 * UBATCH + 3, 2);
    let mut local = Session::new(model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 4);
    let mut s = Session::new(model, opts()).unwrap();
    s.attach_worker(client(&q4k, &w.addr, Some(4), b""));
    assert!(run(&mut s, &p, 4) == want, "the fallback changed the bits");
    let st = s.link_stats();
    assert_eq!((st.fallbacks, st.worker_tokens), (1, 0));
}

#[test]
fn kv_offload_to_a_gguf_worker_keeps_the_local_bits() {
    let (_tmp, q4k) = stacked("q4_k");
    let (_tmp2, mix) = stacked("mix");
    for path in [gguf("tiny-f32.gguf"), q4k, mix] {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let model = load(&path);
        let w = start_worker(&path, None, None);
        let p = prompt(4 * 64 + 5, 3);
        let steps = 24;
        let mut local = Session::new(model.clone(), opts()).unwrap();
        let want = run(&mut local, &p, steps);
        let budgeted = SessionOptions {
            kv_budget: Some(KvBudget::Positions(128)),
            ..opts()
        };
        let mut off = Session::new(model.clone(), budgeted).unwrap();
        off.attach_worker(client(&path, &w.addr, Some(4), b""));
        let got = run(&mut off, &p, steps);
        assert_eq!(got.1, want.1, "{name}: tokens");
        assert!(got.0 == want.0, "{name}: logits differ in bits");
        let st = off.link_stats();
        let n = p.len() + steps;
        let held = st.positions_on_workers as usize;
        assert!(
            held.is_multiple_of(64) && n - held <= 128 && n - held > 64,
            "{name}: {held} of {n} positions on the worker"
        );
        // 2 attention layers in 8
        assert_eq!(st.pages_on_workers as usize, held / 64 * 2, "{name}");
        assert_eq!((st.fallbacks, st.offload_failures), (0, 0), "{name}");
        // a decode step with pages away: per attention layer, q out (f32 [heads, head_dim]) and the partial back
        // (output [heads, head_dim] and an LSE per head, f32), plus frame headers
        let cfg = model.config();
        let per_layer = 4 * cfg.num_attention_heads * (2 * cfg.head_dim + 1);
        let per_token = st.bytes_per_decode_token() as usize;
        eprintln!(
            "{name}: {per_token} bytes per decode token (payload {})",
            2 * per_layer
        );
        assert!(
            (2 * per_layer..2 * per_layer + 256).contains(&per_token),
            "{name}: {per_token} bytes per decode token, payload {}",
            2 * per_layer
        );
    }
}

#[test]
fn kv_offload_on_a_gguf_without_a_split_point_keeps_the_local_bits() {
    // one 4-layer cycle: no split point, so the worker's session holds KV pages only (layers 4..4)
    let path = gguf("tiny-q-q8_0.gguf");
    let model = load(&path);
    assert!(backburner_engine::valid_split_layers(model.config()).is_empty());
    let w = start_worker(&path, None, None);
    let p = prompt(5 * 64 + 7, 6);
    let steps = 20;
    let mut local = Session::new(model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, steps);
    let budgeted = SessionOptions {
        kv_budget: Some(KvBudget::Positions(192)),
        ..opts()
    };
    let mut off = Session::new(model.clone(), budgeted).unwrap();
    off.attach_worker(client(&path, &w.addr, None, b""));
    let got = run(&mut off, &p, steps);
    assert_eq!(got.1, want.1, "tokens");
    assert!(got.0 == want.0, "logits differ in bits");
    let st = off.link_stats();
    // 347 positions at the end, at most 192 on the host: 3 whole pages of 64 away, of the model's one attention
    // layer
    let n = p.len() + steps;
    assert_eq!(n, 347);
    assert_eq!(st.positions_on_workers, 192);
    assert_eq!(st.pages_on_workers, 3);
    // no split prefill ran or fell back (the prompt is 21 ubatches, past the client's 32-token minimum)
    assert_eq!(
        (
            st.fallbacks,
            st.offload_failures,
            st.split_calls,
            st.worker_tokens
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(off.workers()[0].split_layer(), 4, "a session of no layers");
}

fn host_model(path: &Path, held: usize) -> Arc<Model> {
    let cfg = ModelConfig::from_dir(path).unwrap();
    let ck = Checkpoint::open(path).unwrap();
    let opts = LoadOptions {
        layers: 0..held,
        ends: true,
    };
    Arc::new(Model::from_checkpoint(cfg, &ck, &opts, |_, _| {}).unwrap())
}

fn connection(path: &Path, addr: &str) -> Connection {
    let mut s = WorkerSettings::new(addr, 1);
    s.timeout = Duration::from_secs(5);
    Connection::new(
        s,
        backburner_engine::split::dir_fingerprint(path.to_path_buf()),
    )
}

#[test]
fn layer_split_over_gguf_workers_gives_the_local_bits() {
    // the fixtures themselves: 4 layers of Q4_K, and of every block type mixed, split at any layer boundary
    for name in ["tiny-q-q4_k.gguf", "tiny-q-mix.gguf"] {
        layer_split_over(&gguf(name));
    }
}

fn layer_split_over(path: &Path) {
    let path = path.to_path_buf();
    let model = load(&path);
    let p = prompt(50, 4);
    let steps = 8;
    let mut local = Session::new(model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, steps);
    let a = start_worker(&path, None, None);
    let b = start_worker(&path, None, None);
    let c = start_worker(&path, None, None);
    let layouts: Vec<Vec<(&str, std::ops::Range<usize>)>> = vec![
        vec![(a.addr.as_str(), 2..4)],
        vec![(b.addr.as_str(), 1..3), (c.addr.as_str(), 3..4)],
    ];
    for stages in layouts {
        let host = host_model(&path, stages[0].1.start);
        // the host holds only its layers and the ends, in their quantized bytes
        let ck = Checkpoint::open(&path).unwrap();
        let host_bytes = backburner_model::load_bytes(
            &ck,
            host.config(),
            &LoadOptions {
                layers: 0..stages[0].1.start,
                ends: true,
            },
        )
        .unwrap();
        assert_eq!(host.weight_bytes() as u64, host_bytes);
        assert!(host.weight_bytes() < model.weight_bytes());
        let parts = stages
            .iter()
            .map(|(addr, r)| (connection(&path, addr), r.clone()))
            .collect();
        let chain = LayerSplit::from_parts(host.config(), parts).unwrap();
        let mut s = Session::with_layer_split(host, opts(), chain).unwrap();
        let got = run(&mut s, &p, steps);
        assert_eq!(got.1, want.1, "{stages:?}: tokens");
        assert!(got.0 == want.0, "{stages:?}: logits differ in bits");
        let ls = s.link_stats();
        let moved = (p.len() + steps) as u64;
        assert_eq!(ls.worker_tokens, moved, "{stages:?}");
        // each token's residual (hidden f32) to every worker and back, plus framing and a handshake per worker
        let payload = 2 * stages.len() as u64 * moved * model.config().hidden_size as u64 * 4;
        let total = ls.bytes_sent + ls.bytes_received;
        eprintln!("{stages:?}: {total} bytes on the links (residuals {payload})");
        assert!(
            total >= payload && total < payload + 4096 * stages.len() as u64,
            "{stages:?}: {total} vs {payload}"
        );
        assert_eq!(s.layer_split().unwrap().stats().failures, 0);
    }
}

#[test]
fn a_gguf_workers_memory_budget_counts_the_quantized_bytes() {
    let (_tmp, q4k) = stacked("q4_k");
    let w = tail_weights(&q4k, 4);
    // what the same layers would take as f32: the quantized blocks are kept, not widened
    let cfg = ModelConfig::from_dir(&q4k).unwrap();
    let f32_bytes =
        backburner_engine::plan::ModelCosts::from_config(&cfg, 4, KvDtype::F16).weight_bytes(4..8);
    let ck = Checkpoint::open(&q4k).unwrap();
    let stored: u64 = ck
        .names()
        .iter()
        .filter(|n| {
            ["4", "5", "6", "7"]
                .iter()
                .any(|i| n.starts_with(&format!("model.layers.{i}.")))
        })
        .map(|n| ck.stored_bytes(n).unwrap() as u64)
        .sum();
    eprintln!("layers 4..8: load {w} bytes, stored {stored}, as f32 {f32_bytes}");
    assert!(
        w >= stored && w < stored + stored / 8,
        "{w} vs stored {stored}"
    );
    assert!(w * 5 < f32_bytes, "{w} vs f32 {f32_bytes}");

    let mut o = WorkerOptions::new(q4k.clone());
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
    drop(ok);

    // a worker whose budget holds the quantized tail and a session (but not the f32 tail) serves a split prefill
    assert!(w + (1 << 20) < f32_bytes);
    let model = load(&q4k);
    let srv = start_worker_with(&q4k, |o| o.max_memory = w + (1 << 20));
    let p = prompt(3 * UBATCH + 1, 5);
    let mut local = Session::new(model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 2);
    let mut s = Session::new(model, opts()).unwrap();
    s.attach_worker(client(&q4k, &srv.addr, Some(4), b""));
    assert!(run(&mut s, &p, 2) == want);
    let st = s.link_stats();
    assert_eq!((st.fallbacks, st.worker_tokens), (0, 3 * UBATCH as u64));
}
