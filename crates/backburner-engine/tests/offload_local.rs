//! KV offload end to end in one process (no link yet): the oldest pages of every full-attention layer move out of
//! the host's cache into a worker page store, the forward pass attends them through `RemotePages`, and prefill and
//! decode logits stay bit-identical to the local run; a failing store is latched, never silently skipped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use backburner_engine::worker::pages::{page_bytes, PageShape, SessionPages};
use backburner_engine::worker::MemoryBudget;
use backburner_kernels::attention::Partial;
use backburner_kernels::kv::{KvDtype, KvPage};
use backburner_model::{
    synthetic, KvOptions, LayerKind, Model, ModelState, RemoteError, RemotePages,
};

/// The in-process "worker": a page store and the partial of the last `begin`.
struct InProcess {
    store: Arc<Mutex<SessionPages>>,
    pending: Option<(usize, Partial)>,
    fail: Arc<AtomicBool>,
}

impl RemotePages for InProcess {
    fn begin(
        &mut self,
        layer: usize,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Result<(), RemoteError> {
        if self.fail.load(Ordering::Relaxed) {
            return Err(RemoteError("the worker is gone".into()));
        }
        let p = self
            .store
            .lock()
            .unwrap()
            .attend(layer, q, n_tokens, n_heads, q_pos0, scale)
            .map_err(|f| RemoteError(f.message))?;
        self.pending = Some((layer, p));
        Ok(())
    }

    fn finish(&mut self, layer: usize) -> Result<Partial, RemoteError> {
        match self.pending.take() {
            Some((l, p)) if l == layer => Ok(p),
            _ => Err(RemoteError(format!("no partial pending for layer {layer}"))),
        }
    }
}

const PAGE: usize = 64;

fn kv() -> KvOptions {
    KvOptions {
        page_size: PAGE,
        dtype: KvDtype::F16,
    }
}

fn model() -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write_random_checkpoint(dir.path(), &synthetic::tiny_config(8), 21).unwrap();
    let m = Model::load(dir.path()).unwrap();
    (dir, m)
}

/// The worker-side store for this model's pages (f16, `PAGE` positions) under a `budget`-byte limit.
fn page_store(
    cfg: &backburner_model::ModelConfig,
    budget: u64,
) -> (PageShape, Arc<Mutex<SessionPages>>) {
    let shape = PageShape {
        page_size: PAGE,
        n_kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim,
        dtype: KvDtype::F16,
    };
    let store = SessionPages::new(shape, &MemoryBudget::new(budget)).unwrap();
    (shape, Arc::new(Mutex::new(store)))
}

fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 37 + salt * 11) % 500 + 3)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Prefill in ubatches of 64 (offloading `pages` pages per attention layer after `offload_after` tokens, if any),
/// then 4 greedy decode steps; every logits vector's bits.
fn run(
    m: &Model,
    prompt: &[u32],
    offload: Option<(usize, usize)>,
    fail: &Arc<AtomicBool>,
) -> Vec<Vec<u32>> {
    let cfg = m.config();
    let n = cfg.num_hidden_layers;
    let mut st = ModelState::new(cfg, 0..n, kv());
    let (shape, store) = page_store(cfg, 1 << 30);
    st.set_remote(Box::new(InProcess {
        store: store.clone(),
        pending: None,
        fail: fail.clone(),
    }));
    let attn: Vec<usize> = (0..n)
        .filter(|i| cfg.layer_types[*i] == LayerKind::FullAttention)
        .collect();
    let mut out = Vec::new();
    let mut last = Vec::new();
    let mut done = 0;
    for chunk in prompt.chunks(64) {
        if let Some((after, pages)) = offload {
            if done >= after && st.offloaded() == 0 {
                for &l in &attn {
                    let taken: Vec<KvPage> = st.take_oldest_pages(l, pages).unwrap();
                    let bytes: Vec<u8> = taken
                        .iter()
                        .flat_map(|p| page_bytes(p.view(), &shape))
                        .collect();
                    store.lock().unwrap().put(l, 0, pages, &bytes).unwrap();
                }
            }
        }
        let t = chunk.len();
        last = m.forward_tokens(chunk, &mut st, Some(t - 1..t));
        done += t;
        assert!(st.take_remote_error().is_none());
    }
    out.push(bits(&last));
    for _ in 0..4 {
        let next = backburner_engine::argmax(&last);
        last = m.forward_tokens(&[next], &mut st, Some(0..1));
        if let Some(e) = st.take_remote_error() {
            out.push(vec![u32::MAX]);
            eprintln!("latched: {e}");
            break;
        }
        out.push(bits(&last));
    }
    out
}

#[test]
fn offloaded_pages_give_the_local_bits_in_prefill_and_decode() {
    let (_d, m) = model();
    let prompt = ids(5 * 64 + 17, 1);
    let never = Arc::new(AtomicBool::new(false));
    let local = run(&m, &prompt, None, &never);
    // pages leave after the prompt's fourth ubatch: the fifth and sixth ubatches and every decode step attend them
    assert!(
        run(&m, &prompt, Some((4 * 64, 3)), &never) == local,
        "3 pages out mid-prefill"
    );
    assert!(
        run(&m, &prompt, Some((2 * 64, 1)), &never) == local,
        "1 page out early"
    );
    assert!(
        run(&m, &prompt, Some((5 * 64, 4)), &never) == local,
        "4 pages out before the last ubatch"
    );
}

/// The host's GPU with its oldest KV pages on a CPU worker, as the device layer runs it: layers placed on a backend
/// (here the CPU backend, the only one this machine has) move their device caches' pages to the worker's store and
/// fold the worker's partial into their own, giving the bits of the local run on the CPU path.
#[test]
fn offloaded_pages_of_layers_on_a_device_give_the_local_bits() {
    let (d, m) = model();
    let prompt = ids(5 * 64 + 17, 1);
    let never = Arc::new(AtomicBool::new(false));
    let local = run(&m, &prompt, None, &never);
    let n = m.config().num_hidden_layers;
    for ranges in [0..n, 2..6] {
        let mut placed = Model::load(d.path()).unwrap();
        placed
            .place_layers(
                ranges.clone(),
                Arc::new(backburner_model::device::CpuBackend),
            )
            .unwrap();
        assert!(
            run(&placed, &prompt, None, &never) == local,
            "{ranges:?} local"
        );
        assert!(
            run(&placed, &prompt, Some((4 * 64, 3)), &never) == local,
            "{ranges:?}: 3 pages out mid-prefill"
        );
        assert!(
            run(&placed, &prompt, Some((2 * 64, 1)), &never) == local,
            "{ranges:?}: 1 page out early"
        );
    }
    // pages off the device and no store to attend them: latched, not skipped
    let mut placed = Model::load(d.path()).unwrap();
    placed
        .place_layers(0..n, Arc::new(backburner_model::device::CpuBackend))
        .unwrap();
    let cfg = placed.config().clone();
    let mut st = ModelState::new(&cfg, 0..n, kv());
    placed.forward_tokens(&prompt[..3 * 64], &mut st, None);
    for l in (0..n).filter(|i| cfg.layer_types[*i] == LayerKind::FullAttention) {
        assert_eq!(st.movable_pages(l), Some(2));
        assert_eq!(st.take_oldest_pages(l, 1).unwrap().len(), 1);
    }
    assert_eq!(st.offloaded(), PAGE);
    assert!(
        st.take_oldest_pages(0, 1).is_err(),
        "a Gated DeltaNet layer"
    );
    placed.forward_tokens(&[5], &mut st, Some(0..1));
    let e = st.take_remote_error().unwrap();
    assert!(e.0.contains("no remote store"), "{e}");
}

#[test]
fn a_failing_store_is_latched_for_the_caller() {
    let (_d, m) = model();
    let prompt = ids(4 * 64 + 3, 2);
    let fail = Arc::new(AtomicBool::new(false));
    let cfg = m.config();
    let mut st = ModelState::new(cfg, 0..cfg.num_hidden_layers, kv());
    m.forward_tokens(&prompt, &mut st, None);
    for l in (0..cfg.num_hidden_layers).filter(|i| cfg.layer_types[*i] == LayerKind::FullAttention)
    {
        st.kv_cache_mut(l).unwrap().take_oldest(1).unwrap();
    }
    // no store attached: latched
    m.forward_tokens(&[5], &mut st, Some(0..1));
    let e = st.take_remote_error().unwrap();
    assert!(e.0.contains("no remote store"), "{e}");
    // a store that fails: latched with its message
    let (_, store) = page_store(cfg, 1 << 20);
    fail.store(true, Ordering::Relaxed);
    st.set_remote(Box::new(InProcess {
        store,
        pending: None,
        fail: fail.clone(),
    }));
    m.forward_tokens(&[6], &mut st, Some(0..1));
    assert_eq!(st.take_remote_error().unwrap().0, "the worker is gone");
    assert!(st.take_remote_error().is_none(), "taken once");
}
