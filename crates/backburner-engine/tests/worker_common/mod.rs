//! Helpers shared by the in-process worker tests: random checkpoints, a worker thread, clients, greedy runs.
#![allow(dead_code)]

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::{
    argmax, Logits, Session, SessionOptions, Worker, WorkerClient, WorkerOptions, WorkerSettings,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{synthetic, KvOptions, Model};

pub const UBATCH: usize = 16;

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub model: Arc<Model>,
}

pub fn model_with_layers(n: usize, seed: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_random_checkpoint(dir.path(), &synthetic::tiny_config(n), seed).unwrap();
    let model = Arc::new(Model::load(dir.path()).unwrap());
    Fixture { dir, model }
}

/// A random mixture-of-experts checkpoint of `n` layers ([`synthetic::tiny_moe_config`]).
pub fn moe_with_layers(n: usize, seed: u64) -> Fixture {
    with_config(&synthetic::tiny_moe_config(n), seed)
}

/// A random checkpoint of `config`.
pub fn with_config(config: &serde_json::Value, seed: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_random_checkpoint(dir.path(), config, seed).unwrap();
    let model = Arc::new(Model::load(dir.path()).unwrap());
    Fixture { dir, model }
}

/// Bytes of the weights a worker serving layers `start..n` of the checkpoint in `dir` loads: what its `max_memory`
/// holds beside session state (tests that size a worker's budget for its state add this).
pub fn tail_weights(dir: &Path, start: usize) -> u64 {
    let cfg = backburner_model::ModelConfig::from_dir(dir).unwrap();
    let ck = backburner_model::Checkpoint::open(dir).unwrap();
    let opts = backburner_model::LoadOptions {
        layers: start..cfg.num_hidden_layers,
        ends: false,
    };
    backburner_model::load_bytes(&ck, &cfg, &opts).unwrap()
}

pub struct RunningWorker {
    pub addr: String,
    pub stop: Arc<AtomicBool>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl RunningWorker {
    /// Asks the worker to stop: every session refuses its next request (`Error{Evicted}`) and closes.
    pub fn stop_now(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl Drop for RunningWorker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

pub fn start_worker(
    dir: &Path,
    layers: Option<std::ops::Range<usize>>,
    secret: Option<&[u8]>,
) -> RunningWorker {
    start_worker_with(dir, |o| {
        o.layers = layers;
        o.secret = secret.map(|s| s.to_vec());
    })
}

pub fn start_worker_with(dir: &Path, edit: impl FnOnce(&mut WorkerOptions)) -> RunningWorker {
    start_worker_at(dir, "127.0.0.1:0", edit)
}

/// A default worker on a given address (e.g. where an earlier one listened).
pub fn start_worker_on(dir: &Path, addr: &str) -> RunningWorker {
    start_worker_at(dir, addr, |_| {})
}

fn start_worker_at(dir: &Path, addr: &str, edit: impl FnOnce(&mut WorkerOptions)) -> RunningWorker {
    let mut o = WorkerOptions::new(dir.to_path_buf());
    o.threads = 1;
    o.idle_timeout = Duration::from_secs(30);
    edit(&mut o);
    let w = Worker::bind(addr, o).unwrap();
    let addr = w.local_addr().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let handle = std::thread::spawn(move || w.serve(s2));
    RunningWorker {
        addr,
        stop,
        handle: Some(handle),
    }
}

pub fn opts() -> SessionOptions {
    SessionOptions {
        ubatch: UBATCH,
        kv: KvOptions {
            page_size: 64,
            dtype: KvDtype::F16,
        },
        context_length: None,
        ..SessionOptions::default()
    }
}

pub fn client(dir: &Path, addr: &str, split: Option<usize>, secret: &[u8]) -> WorkerClient {
    client_with(
        dir,
        addr,
        split,
        secret,
        backburner_engine::split::FRAME_BUDGET,
    )
}

pub fn client_with(
    dir: &Path,
    addr: &str,
    split: Option<usize>,
    secret: &[u8],
    frame_budget: usize,
) -> WorkerClient {
    let mut s = WorkerSettings::new(addr, 1);
    s.frame_budget = frame_budget;
    s.split_layer = split;
    s.split_min_tokens = 32;
    s.secret = secret.to_vec();
    s.timeout = Duration::from_secs(20);
    WorkerClient::new(
        s,
        backburner_engine::split::dir_fingerprint(dir.to_path_buf()),
    )
}

pub fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(salt) >> 7) % 500)
        .collect()
}

pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Prefill then `steps` greedy decode steps; returns every logits vector's bits and the tokens.
pub fn run(s: &mut Session, p: &[u32], steps: usize) -> (Vec<Vec<u32>>, Vec<u32>) {
    let mut all = Vec::new();
    let mut l = s.prefill(p, Logits::Last, |_, _| {}).unwrap();
    let mut toks = Vec::new();
    for _ in 0..steps {
        all.push(bits(&l));
        let t = argmax(&l);
        toks.push(t);
        l = s.decode(t).unwrap();
    }
    all.push(bits(&l));
    (all, toks)
}

/// A raw host session on layers 4..8 of an 8-layer tiny model in `dir` (hidden 64, f16 KV, 16-token ubatches)
/// with the given page size and experts (`SessionParams.experts`; empty: a split-prefill mirror), for tests that
/// speak the protocol directly.
pub fn raw_session(dir: &Path, addr: &str, page: u64, experts: Vec<u32>) -> backburner_link::Conn {
    use backburner_link::handshake::host_handshake;
    use backburner_link::{Conn, SessionParams, WireKvDtype};
    let fp = backburner_engine::split::dir_fingerprint(dir.to_path_buf());
    let mut c = Conn::connect(addr, Duration::from_secs(10), None).unwrap();
    host_handshake(&mut c, b"", |_ch| {
        Ok(SessionParams {
            fingerprint: fp(4..8).unwrap(),
            n_layers: 8,
            layer_start: 4,
            layer_end: 8,
            hidden: 64,
            kv_dtype: WireKvDtype::F16,
            kv_page_size: page,
            ubatch: 16,
            layer_split: false,
            experts,
        })
    })
    .unwrap();
    c.reader.set_max_tensor(1 << 30);
    c.set_deadline(Some(Duration::from_secs(20)));
    c
}
