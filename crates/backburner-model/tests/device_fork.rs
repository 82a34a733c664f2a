//! Forking a sequence whose layers run on a device (`ModelState::copy_from`, the server's `n` > 1): the copy holds
//! the device's KV caches and Gated DeltaNet states, so both sequences continue with the bits of the original alone
//! (and of the plain model's), and the source is untouched by the copy's steps.

use std::sync::Arc;

use backburner_model::device::{top_k_row, Backend, CpuBackend};
use backburner_model::synthetic::{tiny_config, write_random_checkpoint};
use backburner_model::{KvOptions, Model, ModelState};

const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: backburner_kernels::kv::KvDtype::F16,
};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Logits of `steps` greedy decode steps from `first`, as bits.
fn decode(m: &Model, s: &mut ModelState, first: u32, steps: usize) -> Vec<Vec<u32>> {
    let mut next = first;
    (0..steps)
        .map(|_| {
            let l = m.forward_tokens(&[next], s, Some(0..1));
            next = top_k_row(&l, 1)[0].0;
            bits(&l)
        })
        .collect()
}

#[test]
fn a_fork_of_a_state_with_placed_layers_continues_with_the_originals_bits() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 31).unwrap();
    let plain = Model::load(dir.path()).unwrap();
    let mut m = Model::load(dir.path()).unwrap();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend);
    m.place_layers(0..3, cpu.clone()).unwrap();
    m.place_head(cpu).unwrap();
    let c = m.config().clone();
    // a prompt past a KV page (16) and a delta-rule chunk (64)
    let prompt: Vec<u32> = (0..70u32)
        .map(|i| (i * 37 + 5) % c.vocab_size as u32)
        .collect();

    let mut want_state = ModelState::new(&c, 0..4, KV);
    plain.forward_tokens(&prompt, &mut want_state, None);
    let want = decode(&plain, &mut want_state, 9, 6);

    let mut src = ModelState::new(&c, 0..4, KV);
    m.forward_tokens(&prompt, &mut src, None);
    // a fresh state and one that ran another prompt both take the copy
    let mut fresh = ModelState::new(&c, 0..4, KV);
    assert!(fresh.copy_from(&src));
    let mut used = ModelState::new(&c, 0..4, KV);
    m.forward_tokens(&[4, 4, 4], &mut used, None);
    assert!(used.copy_from(&src));
    assert_eq!(fresh.n_tokens(), 70);
    assert_eq!(decode(&m, &mut fresh, 9, 6), want, "the fresh copy");
    assert_eq!(decode(&m, &mut used, 9, 6), want, "the reused copy");
    assert_eq!(
        decode(&m, &mut src, 9, 6),
        want,
        "the source after its copies ran"
    );
    assert!(src.take_remote_error().is_none() && fresh.take_remote_error().is_none());
}

#[test]
fn a_state_of_other_placed_layers_takes_no_copy() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 31).unwrap();
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend);
    let mut a = Model::load(dir.path()).unwrap();
    a.place_layers(0..2, cpu.clone()).unwrap();
    let mut b = Model::load(dir.path()).unwrap();
    b.place_layers(0..3, cpu).unwrap();
    let c = a.config().clone();
    let mut sa = ModelState::new(&c, 0..4, KV);
    a.forward_tokens(&[1, 2, 3], &mut sa, None);
    let mut sb = ModelState::new(&c, 0..4, KV);
    b.forward_tokens(&[5, 6], &mut sb, None);
    assert!(!sb.copy_from(&sa), "device states of other layers");
    assert_eq!(sb.n_tokens(), 2, "nothing changed");
    let l = b.forward_tokens(&[7], &mut sb, Some(0..1));
    assert_eq!(l.len(), c.vocab_size);
}
