//! Batched decode across sequences ([`Model::forward_decode_batch`]) against each sequence decoded alone
//! ([`Model::forward_tokens`]): the same logits and states, bit for bit, with sequences at different positions
//! (some past a KV page boundary), joining and leaving between steps; and its caller-bug panics.

use backburner_model::synthetic::{tiny_config, write_random_checkpoint};
use backburner_model::{KvOptions, LayerKind, Model, ModelState};

/// Small pages so that prompts and decode steps cross page boundaries.
const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: backburner_kernels::kv::KvDtype::F16,
};

fn model(n_layers: usize) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(n_layers), 17).unwrap();
    let m = Model::load(dir.path()).unwrap();
    (dir, m)
}

fn new_state(m: &Model) -> ModelState {
    ModelState::new(m.config(), 0..m.config().num_hidden_layers, KV)
}

/// A deterministic prompt of `len` ids for sequence `seed`.
fn prompt(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % vocab as u32)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Every layer's state of `a` and `b` is the same: position, linear states and KV rows (bits).
fn assert_same_state(m: &Model, a: &ModelState, b: &ModelState, what: &str) {
    assert_eq!(a.n_tokens(), b.n_tokens(), "{what}: positions");
    for (i, kind) in m.config().layer_types.iter().enumerate() {
        match kind {
            LayerKind::LinearAttention => {
                let (la, lb) = (a.linear(i).unwrap(), b.linear(i).unwrap());
                assert_eq!(bits(&la.conv), bits(&lb.conv), "{what}: layer {i} conv");
                assert_eq!(
                    bits(&la.recurrent),
                    bits(&lb.recurrent),
                    "{what}: layer {i} recurrent"
                );
            }
            LayerKind::FullAttention => {
                let (ka, va) = a.read_kv_rows(i, 0, a.n_tokens()).unwrap();
                let (kb, vb) = b.read_kv_rows(i, 0, b.n_tokens()).unwrap();
                assert_eq!(bits(&ka), bits(&kb), "{what}: layer {i} K");
                assert_eq!(bits(&va), bits(&vb), "{what}: layer {i} V");
            }
        }
    }
}

#[test]
fn batched_decode_equals_each_sequence_decoded_alone_bit_for_bit() {
    let (_dir, m) = model(8);
    let vocab = m.config().vocab_size;
    // positions 1, 15 (the next token opens page 2), 16, 31, 40 and 47
    let lens = [1usize, 15, 16, 31, 40, 47];
    let mut alone: Vec<ModelState> = lens.iter().map(|_| new_state(&m)).collect();
    let mut batched: Vec<ModelState> = lens.iter().map(|_| new_state(&m)).collect();
    let mut next = Vec::new();
    for (s, &len) in lens.iter().enumerate() {
        let p = prompt(len, s as u32, vocab);
        let la = m.forward_tokens(&p, &mut alone[s], Some(len - 1..len));
        let lb = m.forward_tokens(&p, &mut batched[s], Some(len - 1..len));
        assert_eq!(bits(&la), bits(&lb));
        next.push(argmax(&la));
    }
    // who decodes at each step: all, some joining and leaving, a batch of one, the order changed
    let steps: [&[usize]; 9] = [
        &[0, 1, 2, 3],
        &[0, 1, 2, 3, 4, 5],
        &[2],
        &[5, 1, 3],
        &[0, 1, 2, 3, 4, 5],
        &[4, 0],
        &[1, 2, 3, 4, 5, 0],
        &[3],
        &[0, 1, 2, 3, 4, 5],
    ];
    for (k, members) in steps.iter().enumerate() {
        let ids: Vec<u32> = members.iter().map(|&s| next[s]).collect();
        let want: Vec<Vec<f32>> = members
            .iter()
            .map(|&s| m.forward_tokens(&[next[s]], &mut alone[s], Some(0..1)))
            .collect();
        let mut slots: Vec<Option<&mut ModelState>> = batched.iter_mut().map(Some).collect();
        let mut ordered: Vec<&mut ModelState> =
            members.iter().map(|&s| slots[s].take().unwrap()).collect();
        let got = m.forward_decode_batch(&ids, &mut ordered);
        assert_eq!(got.len(), members.len() * vocab);
        for (row, (&s, w)) in members.iter().zip(&want).enumerate() {
            let g = &got[row * vocab..(row + 1) * vocab];
            assert_eq!(bits(g), bits(w), "step {k}: sequence {s} (row {row})");
            next[s] = argmax(w);
        }
    }
    for s in 0..lens.len() {
        assert_same_state(&m, &alone[s], &batched[s], &format!("sequence {s}"));
        let la = m.forward_tokens(&[next[s]], &mut alone[s], Some(0..1));
        let lb = m.forward_tokens(&[next[s]], &mut batched[s], Some(0..1));
        assert_eq!(bits(&la), bits(&lb), "sequence {s}: the step after");
    }
}

#[test]
fn a_batch_state_snapshot_restores_like_one_decoded_alone() {
    let (_dir, m) = model(4);
    let vocab = m.config().vocab_size;
    let (mut a, mut b, mut c) = (new_state(&m), new_state(&m), new_state(&m));
    m.forward_tokens(&prompt(20, 1, vocab), &mut a, None);
    m.forward_tokens(&prompt(20, 1, vocab), &mut c, None);
    m.forward_tokens(&prompt(5, 2, vocab), &mut b, None);
    let snap = a.snapshot();
    m.forward_decode_batch(&[7, 9], &mut [&mut a, &mut b]);
    m.forward_decode_batch(&[8, 10], &mut [&mut a, &mut b]);
    a.restore(&snap);
    assert_same_state(&m, &a, &c, "restored");
    let la = m.forward_decode_batch(&[3], &mut [&mut a]);
    let lc = m.forward_tokens(&[3], &mut c, Some(0..1));
    assert_eq!(bits(&la), bits(&lc));
}

#[test]
#[should_panic(expected = "empty batch")]
fn an_empty_batch_panics() {
    let (_dir, m) = model(4);
    m.forward_decode_batch(&[], &mut []);
}

#[test]
#[should_panic(expected = "2 ids for 1 states")]
fn ids_and_states_of_different_lengths_panic() {
    let (_dir, m) = model(4);
    let mut a = new_state(&m);
    m.forward_decode_batch(&[1, 2], &mut [&mut a]);
}

#[test]
#[should_panic(expected = "does not hold the whole model's layers")]
fn a_state_of_part_of_the_layers_panics() {
    let (_dir, m) = model(8);
    let (mut a, mut b) = (new_state(&m), ModelState::new(m.config(), 0..4, KV));
    m.forward_decode_batch(&[1, 2], &mut [&mut a, &mut b]);
}

#[test]
#[should_panic(expected = "has KV pages held elsewhere")]
fn a_state_with_offloaded_pages_panics() {
    let (_dir, m) = model(4);
    let (mut a, mut b) = (new_state(&m), new_state(&m));
    m.forward_tokens(&prompt(40, 3, m.config().vocab_size), &mut b, None);
    b.kv_cache_mut(3).unwrap().take_oldest(1).unwrap();
    m.forward_decode_batch(&[1, 2], &mut [&mut a, &mut b]);
}

#[test]
#[should_panic(expected = "out of range")]
fn an_id_out_of_range_panics() {
    let (_dir, m) = model(4);
    let (mut a, mut b) = (new_state(&m), new_state(&m));
    m.forward_decode_batch(&[1, 512], &mut [&mut a, &mut b]);
}
