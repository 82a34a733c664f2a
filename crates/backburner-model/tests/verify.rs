//! Speculative decoding's verify step and rollback ([`Model::forward_verify`], [`Model::forward_layers_verify`],
//! [`ModelState::rollback_verify`]) against plain decoding: a verify of `T` tokens after a prefilled prompt gives,
//! bit for bit, the logits of `T` one-token decode steps; a rollback to any `m` accepted positions leaves the state
//! (position, Gated DeltaNet states, KV rows and pages) of `m` decode steps, and decoding on from it gives that
//! state's logits. On the f32, bf16, mixture-of-experts and Qwen3-Next-style fixtures and a quantized GGUF file
//! (whose products round activations to 8 bits, where any difference in the arithmetic shows), at 1 and 2 threads,
//! with KV pages of 4 positions (verifies cross page boundaries) in f16 and bf16.

use std::path::PathBuf;

use backburner_kernels::kv::KvDtype;
use backburner_model::model::verify::VerifyError;
use backburner_model::{KvOptions, LayerKind, Model, ModelState, StateSnapshot};

/// Verifies of 1..=T_MAX tokens (k = 0..8 drafts).
const T_MAX: usize = 9;
/// Prompt length: with pages of 4, a verify starts inside a page and crosses one or two page boundaries.
const PROMPT: usize = 13;

pub(crate) fn kv(dtype: KvDtype) -> KvOptions {
    KvOptions {
        page_size: 4,
        dtype,
    }
}

pub(crate) fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

pub(crate) fn ids(len: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| ((i + 1).wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % vocab as u32)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a pool")
}

/// A copy of `s` (its layers, KV settings and position).
pub(crate) fn fork(m: &Model, s: &ModelState) -> ModelState {
    let mut c = ModelState::new(m.config(), s.range(), s.kv_options());
    assert!(c.copy_from(s));
    c
}

/// Panics unless `a` and `b` hold the same position, Gated DeltaNet states (bits), KV rows (bits) and KV pages.
pub(crate) fn assert_same_state(m: &Model, a: &ModelState, b: &ModelState, what: &str) {
    assert_eq!(a.n_tokens(), b.n_tokens(), "{what}: position");
    assert_eq!(a.kv_bytes(), b.kv_bytes(), "{what}: KV pages");
    for i in a.range() {
        match m.config().layer_types[i] {
            LayerKind::LinearAttention => {
                let (la, lb) = (a.linear(i).unwrap(), b.linear(i).unwrap());
                assert_eq!(bits(&la.conv), bits(&lb.conv), "{what}: layer {i} conv");
                let (ra, rb) = (bits(&la.recurrent), bits(&lb.recurrent));
                assert!(ra == rb, "{what}: layer {i} recurrent state");
            }
            LayerKind::FullAttention => {
                let n = a.n_tokens();
                let (ka, va) = a.read_kv_rows(i, 0, n).unwrap();
                let (kb, vb) = b.read_kv_rows(i, 0, n).unwrap();
                assert!(bits(&ka) == bits(&kb), "{what}: layer {i} K rows");
                assert!(bits(&va) == bits(&vb), "{what}: layer {i} V rows");
            }
        }
    }
}

/// Plain decoding of `drafts` after the prefilled `base`: each step's logits and the state after each step.
pub(crate) fn decode_steps(
    m: &Model,
    base: &ModelState,
    drafts: &[u32],
) -> (Vec<Vec<f32>>, Vec<ModelState>) {
    let mut s = fork(m, base);
    let mut logits = Vec::new();
    let mut after = Vec::new();
    for &d in drafts {
        logits.push(m.forward_tokens(&[d], &mut s, Some(0..1)));
        after.push(fork(m, &s));
    }
    (logits, after)
}

/// Every verify length and rollback point of one model, KV dtype and thread count.
fn check(name: &str, dtype: KvDtype, threads: usize) {
    let m = Model::load(&fixture(name)).unwrap();
    let vocab = m.config().vocab_size;
    let prompt = ids(PROMPT, 1, vocab);
    let drafts = ids(T_MAX, 2, vocab);
    // the tokens decoded after a rollback (the first stands for the correction of a rejected draft)
    let next = ids(3, 3, vocab);
    pool(threads).install(|| {
        let mut base = ModelState::new(m.config(), 0..m.config().num_hidden_layers, kv(dtype));
        m.forward_tokens(&prompt, &mut base, None);
        let (want, after) = decode_steps(&m, &base, &drafts);
        for t in 1..=T_MAX {
            let what = format!("{name}, {dtype:?} KV, {threads} threads, verify of {t}");
            let mut s = fork(&m, &base);
            let got = m.forward_verify(&drafts[..t], &mut s).unwrap();
            assert_eq!(got.len(), t * vocab, "{what}: [T, vocab]");
            for (i, w) in want[..t].iter().enumerate() {
                let row = &got[i * vocab..(i + 1) * vocab];
                assert!(bits(row) == bits(w), "{what}: logits row {i}");
            }
            assert_eq!(s.verify_span(), Some(PROMPT..PROMPT + t));
            assert_same_state(&m, &s, &after[t - 1], &what);
            for acc in 1..=t {
                let what = format!("{what}, rollback to {acc}");
                let mut r = fork(&m, &base);
                m.forward_verify(&drafts[..t], &mut r).unwrap();
                r.rollback_verify(acc).unwrap();
                assert_eq!(r.verify_span(), None, "{what}: closed");
                assert_same_state(&m, &r, &after[acc - 1], &what);
                let mut plain = fork(&m, &after[acc - 1]);
                for (j, &id) in next.iter().enumerate() {
                    let a = m.forward_tokens(&[id], &mut r, Some(0..1));
                    let b = m.forward_tokens(&[id], &mut plain, Some(0..1));
                    assert!(bits(&a) == bits(&b), "{what}: logits of step {j} after");
                }
            }
        }
    });
}

#[test]
fn verifies_equal_decode_steps_and_rollbacks_equal_fewer_steps_f32() {
    for threads in [1, 2] {
        check("tiny-f32", KvDtype::F16, threads);
    }
    check("tiny-f32", KvDtype::Bf16, 2);
}

#[test]
fn verifies_equal_decode_steps_and_rollbacks_equal_fewer_steps_bf16() {
    for threads in [1, 2] {
        check("tiny-bf16", KvDtype::Bf16, threads);
    }
}

#[test]
fn verifies_equal_decode_steps_and_rollbacks_equal_fewer_steps_moe() {
    for threads in [1, 2] {
        check("tiny-moe-f32", KvDtype::F16, threads);
    }
}

#[test]
fn verifies_equal_decode_steps_and_rollbacks_equal_fewer_steps_next() {
    for threads in [1, 2] {
        check("tiny-next-f32", KvDtype::F16, threads);
    }
}

#[test]
fn verifies_equal_decode_steps_and_rollbacks_equal_fewer_steps_quantized() {
    for threads in [1, 2] {
        check("gguf/tiny-q-q4_k.gguf", KvDtype::Bf16, threads);
    }
    check("gguf/tiny-q-q8_0.gguf", KvDtype::F16, 2);
}

#[test]
fn verifies_equal_decode_steps_with_128_wide_heads() {
    // the bench model's and Qwen3.5's Gated DeltaNet head size (the kernels' 128-wide step), on random weights
    let dir = tempfile::tempdir().unwrap();
    let mut c = backburner_model::synthetic::tiny_config(4);
    c["linear_key_head_dim"] = 128.into();
    c["linear_value_head_dim"] = 128.into();
    backburner_model::synthetic::write_random_checkpoint(dir.path(), &c, 37).unwrap();
    let name = dir.path().to_str().unwrap();
    check(name, KvDtype::F16, 2);
}

#[test]
fn attention_and_moe_rows_do_not_depend_on_the_other_rows_of_the_call() {
    // the MoE fixture's layer 3 (gated attention, then the mixture of experts) alone, on residual rows: T rows in
    // one call after a cache of PROMPT positions (pages of 4: rows see different numbers of pages) against T calls
    // of one row, bit for bit
    let m = Model::load(&fixture("tiny-moe-f32")).unwrap();
    let h = m.config().hidden_size;
    let x: Vec<f32> = (0..(PROMPT + T_MAX) * h)
        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
        .collect();
    for dtype in [KvDtype::F16, KvDtype::Bf16] {
        let mut a = ModelState::new(m.config(), 3..4, kv(dtype));
        let mut p = x[..PROMPT * h].to_vec();
        m.forward_layers(3..4, &mut p, PROMPT, &mut a);
        m.commit_tokens(&mut a, PROMPT);
        let mut b = fork(&m, &a);
        let mut rows = x[PROMPT * h..].to_vec();
        m.forward_layers(3..4, &mut rows, T_MAX, &mut a);
        for (i, want) in rows.chunks_exact(h).enumerate() {
            let mut one = x[(PROMPT + i) * h..][..h].to_vec();
            m.forward_layers(3..4, &mut one, 1, &mut b);
            m.commit_tokens(&mut b, 1);
            assert!(bits(&one) == bits(want), "{dtype:?} KV: row {i}");
        }
    }
}

/// The tiny f32 model, its prompt prefilled, and a few drafts.
fn prefilled(dtype: KvDtype) -> (Model, ModelState, Vec<u32>) {
    let m = Model::load(&fixture("tiny-f32")).unwrap();
    let vocab = m.config().vocab_size;
    let mut s = ModelState::new(m.config(), 0..m.config().num_hidden_layers, kv(dtype));
    m.forward_tokens(&ids(PROMPT, 1, vocab), &mut s, None);
    (m, s, ids(T_MAX, 2, vocab))
}

#[test]
fn speculative_cycles_equal_plain_decoding_of_the_accepted_tokens() {
    // verify, accept some, correct, verify again (other lengths: the kept buffers shrink and grow)
    let (m, base, drafts) = prefilled(KvDtype::F16);
    let mut spec = fork(&m, &base);
    let mut plain = fork(&m, &base);
    for (round, (t, acc)) in [(5, 2), (3, 3), (9, 1), (2, 1), (9, 7), (1, 1), (4, 4)]
        .into_iter()
        .enumerate()
    {
        let d = &drafts[..t];
        let got = m.forward_verify(d, &mut spec).unwrap();
        spec.rollback_verify(acc).unwrap();
        for (i, &id) in d[..acc].iter().enumerate() {
            let want = m.forward_tokens(&[id], &mut plain, Some(0..1));
            let row = &got[i * m.config().vocab_size..][..want.len()];
            assert!(bits(row) == bits(&want), "round {round}: row {i}");
        }
        assert_same_state(&m, &spec, &plain, &format!("round {round}"));
    }
}

#[test]
fn a_node_verifies_its_layer_ranges_and_rolls_them_back() {
    // two states holding layers 0..4 and 4..8 (a host and a worker of a layer split), the first run in two calls:
    // together they give the whole model's verify, and each rolls back its own layers
    let (m, base, drafts) = prefilled(KvDtype::Bf16);
    let (t, acc) = (6, 4);
    let mut whole = fork(&m, &base);
    let want = m.forward_verify(&drafts[..t], &mut whole).unwrap();
    let mut head = ModelState::new(m.config(), 0..4, base.kv_options());
    let mut tail = ModelState::new(m.config(), 4..8, base.kv_options());
    let mut x = m.embed(&ids(PROMPT, 1, m.config().vocab_size)).unwrap();
    m.forward_layers(0..4, &mut x, PROMPT, &mut head);
    m.forward_layers(4..8, &mut x, PROMPT, &mut tail);
    m.commit_tokens(&mut head, PROMPT);
    m.commit_tokens(&mut tail, PROMPT);
    let mut x = m.embed(&drafts[..t]).unwrap();
    m.forward_layers_verify(0..2, &mut x, t, &mut head).unwrap();
    m.forward_layers_verify(2..4, &mut x, t, &mut head).unwrap();
    m.forward_layers_verify(4..8, &mut x, t, &mut tail).unwrap();
    m.commit_tokens(&mut head, t);
    m.commit_tokens(&mut tail, t);
    assert!(bits(&m.logits(&x, t).unwrap()) == bits(&want), "logits");
    whole.rollback_verify(acc).unwrap();
    head.rollback_verify(acc).unwrap();
    tail.rollback_verify(acc).unwrap();
    for part in [&head, &tail] {
        let mut w = ModelState::new(m.config(), part.range(), base.kv_options());
        for i in part.range() {
            if let Some(l) = whole.linear(i) {
                assert!(w.set_linear(i, l.clone()));
            } else {
                let (k, v) = whole.read_kv_rows(i, 0, whole.n_tokens()).unwrap();
                assert!(w.append_kv_rows(i, &k, &v, whole.n_tokens()));
            }
        }
        w.set_position(whole.n_tokens());
        assert_same_state(&m, part, &w, &format!("layers {:?}", part.range()));
    }
    // a layer held here that did not run refuses the rollback
    let mut x = m.embed(&drafts[..t]).unwrap();
    m.forward_layers_verify(0..3, &mut x, t, &mut head).unwrap();
    m.commit_tokens(&mut head, t);
    assert!(matches!(
        head.rollback_verify(1),
        Err(VerifyError::NotVerified(3))
    ));
}

#[test]
fn bad_verifies_and_rollbacks_are_typed_errors_that_change_nothing() {
    let (m, base, drafts) = prefilled(KvDtype::F16);
    let mut s = fork(&m, &base);
    assert!(matches!(s.rollback_verify(1), Err(VerifyError::NoVerify)));
    assert!(matches!(
        m.forward_verify(&[], &mut s),
        Err(VerifyError::Empty)
    ));
    let vocab = m.config().vocab_size as u32;
    let bad = m.forward_verify(&[1, vocab], &mut s);
    assert!(matches!(bad, Err(VerifyError::Model(_))), "{bad:?}");
    let mut part = ModelState::new(m.config(), 0..4, base.kv_options());
    let r = m.forward_verify(&drafts[..2], &mut part);
    assert!(matches!(r, Err(VerifyError::NotWholeModel)));
    let mut x = vec![0.0f32; 3];
    let r = m.forward_layers_verify(0..1, &mut x, 1, &mut s);
    assert!(matches!(r, Err(VerifyError::Shape { got: 3, want: 64 })));
    let mut x = vec![0.0f32; 64];
    let r = m.forward_layers_verify(3..5, &mut x, 1, &mut part);
    assert!(matches!(r, Err(VerifyError::LayerMissing(4))));
    assert_same_state(&m, &s, &base, "after refused verifies");

    m.forward_verify(&drafts[..4], &mut s).unwrap();
    let verified = fork(&m, &s);
    for bad in [0, 5] {
        let r = s.rollback_verify(bad);
        assert!(
            matches!(r, Err(VerifyError::Accepted { t: 4, .. })),
            "{r:?}"
        );
    }
    assert_same_state(&m, &s, &verified, "after refused rollbacks");
    // any other change of the state closes the verify
    m.forward_tokens(&drafts[4..5], &mut s, None);
    assert!(matches!(s.rollback_verify(2), Err(VerifyError::NoVerify)));
    let snap = s.snapshot();
    m.forward_verify(&drafts[..3], &mut s).unwrap();
    s.restore(&snap);
    assert!(matches!(s.rollback_verify(2), Err(VerifyError::NoVerify)));
    // the layers' tokens not committed yet
    let mut x = m.embed(&drafts[..3]).unwrap();
    m.forward_layers_verify(0..8, &mut x, 3, &mut s).unwrap();
    let r = s.rollback_verify(2);
    assert!(
        matches!(r, Err(VerifyError::Position { at: 18, .. })),
        "{r:?}"
    );
}

#[test]
fn a_verify_takes_no_prompt_cache_checkpoint() {
    let (m, base, drafts) = prefilled(KvDtype::F16);
    let mut s = fork(&m, &base);
    s.request_checkpoints(&[PROMPT + 1, PROMPT + 4]);
    m.forward_verify(&drafts[..4], &mut s).unwrap();
    s.rollback_verify(2).unwrap();
    let taken: Vec<usize> = s
        .take_checkpoints()
        .iter()
        .map(StateSnapshot::n_tokens)
        .collect();
    assert!(taken.is_empty(), "{taken:?}");
    // a one-token verify neither
    s.request_checkpoints(&[PROMPT + 3]);
    m.forward_verify(&drafts[2..3], &mut s).unwrap();
    assert!(s.take_checkpoints().is_empty());
}

/// The median of `v`.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds `f` takes on `s` and its result; `s` is then restored to where it was.
fn timed<R>(s: &mut ModelState, f: impl FnOnce(&mut ModelState) -> R) -> (f64, R) {
    let snap = s.snapshot();
    let t0 = std::time::Instant::now();
    let r = f(s);
    let secs = t0.elapsed().as_secs_f64();
    s.restore(&snap);
    (secs, r)
}

#[test]
#[ignore = "timing example: run in release with --ignored --nocapture"]
fn verify_step_timing_on_the_bench_model() {
    // the bench model of docs/BENCHMARKS.md (~/.cache/backburner/bench-model-v1, as `backburner bench` writes it),
    // 2 threads, after a 256-token prompt; per T, alternating within each of 9 rounds: T decode steps, one verify
    // of T, and a rollback to T − 1 accepted positions (the worst case: T − 1 replayed) after an untimed verify
    let dir = std::env::var_os("HOME")
        .map(|h| PathBuf::from(h).join(".cache/backburner/bench-model-v1"))
        .filter(|d| d.join("complete").exists())
        .expect("the bench model: run `backburner bench` once to write it");
    let m = Model::load(&dir).unwrap();
    let vocab = m.config().vocab_size;
    pool(2).install(|| {
        let mut s = ModelState::new(m.config(), 0..8, KvOptions::default());
        m.forward_tokens(&ids(256, 1, vocab), &mut s, None);
        let drafts = ids(T_MAX, 2, vocab);
        m.forward_verify(&drafts, &mut s).unwrap(); // grows every buffer
        s.rollback_verify(1).unwrap();
        println!(
            "bench model, 2 threads, depth 257, medians of 9 alternating rounds (ms; rollback µs)"
        );
        println!("T  T decode steps  verify  ratio  rollback to T−1");
        for t in [1, 2, 3, 4, 5, 8, 9] {
            let d = &drafts[..t];
            let (mut dec, mut ver, mut rb) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..9 {
                dec.push(
                    timed(&mut s, |s| {
                        for &id in d {
                            m.forward_tokens(&[id], s, Some(0..1));
                        }
                    })
                    .0,
                );
                ver.push(timed(&mut s, |s| m.forward_verify(d, s).unwrap()).0);
                rb.push(
                    timed(&mut s, |s| {
                        m.forward_verify(d, s).unwrap();
                        let t0 = std::time::Instant::now();
                        s.rollback_verify(t.saturating_sub(1).max(1)).unwrap();
                        t0.elapsed().as_secs_f64()
                    })
                    .1,
                );
            }
            let (a, b) = (median(dec), median(ver));
            println!(
                "{t}  {:>14.2}  {:>6.2}  {:>5.2}  {:>15.0}",
                1e3 * a,
                1e3 * b,
                a / b,
                1e6 * median(rb)
            );
        }
    });
}
