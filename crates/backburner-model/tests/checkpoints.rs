//! Exact checkpoints taken inside a forward call ([`ModelState::request_checkpoints`]): each equals, bit for bit, the
//! state of a call that ended at its position, and a call resumed from it gives the logits of the uninterrupted call;
//! positions that are not chunk boundaries of the call are not taken. On the f32 checkpoint and the quantized GGUF
//! fixtures (whose products round activations to 8 bits, where any difference in the arithmetic shows).

use std::path::PathBuf;

use backburner_model::{KvOptions, LayerState, Model, ModelState, StateSnapshot, GDN_CHUNK};

const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: backburner_kernels::kv::KvDtype::F16,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn prompt(len: usize, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab as u32)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn new_state(m: &Model) -> ModelState {
    ModelState::new(m.config(), 0..m.config().num_hidden_layers, KV)
}

/// Every Gated DeltaNet layer's conv and recurrent state, as bits.
fn linear_bits(m: &Model, s: &ModelState) -> Vec<Vec<u32>> {
    (0..m.config().num_hidden_layers)
        .filter_map(|i| match s.layer(i)? {
            LayerState::Linear(l) => Some([bits(&l.conv), bits(&l.recurrent)].concat()),
            LayerState::Attention(_) => None,
        })
        .collect()
}

/// One call over `ids` from an empty state, taking checkpoints at `at`; returns the state, the logits of every row
/// and the checkpoints.
fn call_with(m: &Model, ids: &[u32], at: &[usize]) -> (ModelState, Vec<f32>, Vec<StateSnapshot>) {
    let mut s = new_state(m);
    s.request_checkpoints(at);
    let logits = m.forward_tokens(ids, &mut s, Some(0..ids.len()));
    let cps = s.take_checkpoints();
    (s, logits, cps)
}

fn check_model(name: &str) {
    let m = Model::load(&fixture(name)).unwrap();
    let vocab = m.config().vocab_size;
    let ids = prompt(300, vocab);
    // 100 is not a chunk boundary (not taken); 300 is the call's end
    let at = [64, 100, 128, 256, 300];
    let (mut s, logits, cps) = call_with(&m, &ids, &at);
    let got: Vec<usize> = cps.iter().map(StateSnapshot::n_tokens).collect();
    assert_eq!(got, [64, 128, 256, 300], "{name}: positions taken");
    // a request does not change the call's own arithmetic
    let (_, plain, none) = call_with(&m, &ids, &[]);
    assert!(none.is_empty());
    assert_eq!(
        bits(&logits),
        bits(&plain),
        "{name}: logits with checkpoints"
    );
    let whole = linear_bits(&m, &s);
    for cp in &cps {
        let p = cp.n_tokens();
        // the checkpoint is the state of a call that ended at p
        let mut ended = new_state(&m);
        m.forward_tokens(&ids[..p], &mut ended, None);
        let mut restored = new_state(&m);
        m.forward_tokens(&ids, &mut restored, None);
        restored.restore(cp);
        assert_eq!(
            linear_bits(&m, &restored),
            linear_bits(&m, &ended),
            "{name}: state at {p}"
        );
        // and a call resumed from it gives the rest of the uninterrupted call's logits
        if p < ids.len() {
            let v = vocab;
            let rest = m.forward_tokens(&ids[p..], &mut restored, Some(0..ids.len() - p));
            assert_eq!(
                bits(&rest),
                bits(&logits[p * v..]),
                "{name}: resumed at {p}"
            );
        }
    }
    assert_eq!(linear_bits(&m, &s), whole);
    // the request is cleared once taken
    m.forward_tokens(&ids[..1], &mut s, None);
    assert!(s.take_checkpoints().is_empty());
}

#[test]
fn checkpoints_inside_a_call_equal_calls_that_end_there() {
    assert_eq!(GDN_CHUNK, 64, "the positions above assume chunks of 64");
    for name in [
        "tiny-f32",
        "gguf/tiny-q-q8_0.gguf",
        "gguf/tiny-q-q4_k.gguf",
        "gguf/tiny-q-iq4_xs.gguf",
    ] {
        check_model(name);
    }
}

#[test]
fn a_checkpoint_needs_a_chunk_boundary_of_the_call() {
    // a call starting at 10: its chunks start at 10, 74, ...; absolute 64 is inside a chunk, 74 and 138 are not
    let m = Model::load(&fixture("tiny-f32")).unwrap();
    let ids = prompt(200, m.config().vocab_size);
    let mut s = new_state(&m);
    m.forward_tokens(&ids[..10], &mut s, None);
    s.request_checkpoints(&[64, 74, 138, 200]);
    m.forward_tokens(&ids[10..], &mut s, None);
    let got: Vec<usize> = s
        .take_checkpoints()
        .iter()
        .map(StateSnapshot::n_tokens)
        .collect();
    assert_eq!(got, [74, 138, 200]);
}

#[test]
fn a_one_token_call_checkpoints_its_end() {
    let m = Model::load(&fixture("gguf/tiny-q-q8_0.gguf")).unwrap();
    let ids = prompt(70, m.config().vocab_size);
    let mut s = new_state(&m);
    m.forward_tokens(&ids[..69], &mut s, None);
    s.request_checkpoints(&[70]);
    m.forward_tokens(&ids[69..], &mut s, None);
    let cps = s.take_checkpoints();
    assert_eq!(cps.len(), 1);
    assert_eq!(cps[0].n_tokens(), 70);
    // the state after the one-token step (the decode step's arithmetic), restored over a different state
    let mut r = new_state(&m);
    m.forward_tokens(&ids, &mut r, None);
    r.restore(&cps[0]);
    assert_eq!(linear_bits(&m, &r), linear_bits(&m, &s));
}

#[test]
fn a_state_of_attention_layers_only_checkpoints_every_position_it_passed() {
    // a worker's range of attention layers only (layer 3 of the fixture): truncating the KV rows is exact at any
    // position, so every requested position the calls passed is a checkpoint
    let m = Model::load(&fixture("tiny-f32")).unwrap();
    let c = m.config().clone();
    let h = c.hidden_size;
    let x: Vec<f32> = (0..100 * h)
        .map(|i| ((i * 37) % 101) as f32 / 101.0 - 0.5)
        .collect();
    let mut s = ModelState::new(&c, 3..4, KV);
    s.request_checkpoints(&[5, 50, 99, 150]);
    let mut y = x.clone();
    m.forward_layers(3..4, &mut y, 100, &mut s);
    m.commit_tokens(&mut s, 100);
    let cps = s.take_checkpoints();
    let got: Vec<usize> = cps.iter().map(StateSnapshot::n_tokens).collect();
    assert_eq!(got, [5, 50, 99]);
    s.restore(&cps[1]);
    let mut z = x[50 * h..].to_vec();
    m.forward_layers(3..4, &mut z, 50, &mut s);
    assert_eq!(bits(&z), bits(&y[50 * h..]));
}
