//! The engine agrees with itself across ubatch sizes, KV page sizes and KV dtypes, and its generation loop and
//! perplexity behave as specified.

use crate::common;

use backburner_engine::{
    generate, perplexity, EngineError, GenerateParams, Logits, SamplingParams, Session,
    SessionOptions, StopReason,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, TextTokenizer};
use common::*;

fn opts(ubatch: usize, page_size: usize, dtype: KvDtype) -> SessionOptions {
    SessionOptions {
        ubatch,
        kv: KvOptions { page_size, dtype },
        context_length: None,
        ..SessionOptions::default()
    }
}

fn prefill_all(name: &str, o: SessionOptions) -> Vec<f32> {
    let r = Reference::load(name);
    let mut s = Session::new(load_model(name), o).unwrap();
    s.prefill(&r.ids("prompt_ids"), Logits::All, |_, _| {})
        .unwrap()
}

#[test]
fn ubatch_sizes_1_7_64_and_512_agree() {
    // ubatch 1 runs the token-by-token delta rule; the others the chunked one over different splits. Same math, other
    // summation order. The fixture's weights are deliberately large (so layout mistakes show), which amplifies f32
    // rounding: transformers itself differs by 4.0e-4 between token-by-token and one-shot prefill on this checkpoint
    // (reference.json `sanity_max_abs_diff`). We allow 1e-3; a real bug (wrong state carry, wrong position) moves
    // logits by O(1).
    let base = prefill_all("tiny-f32", opts(512, 4096, KvDtype::F32));
    for ub in [1, 7, 64] {
        let got = prefill_all("tiny-f32", opts(ub, 4096, KvDtype::F32));
        let d = max_abs_diff(&got, &base);
        assert!(d < 1e-3, "ubatch {ub} differs from 512 by {d}");
    }
}

#[test]
fn kv_page_sizes_16_and_64_agree_with_one_page() {
    // Page size 4096 holds the whole 336-token prompt in one page. Smaller pages change only the softmax's split into
    // LSE-merged partials: a few ulps of the attention output (the kernel tests bound that at 1e-6 relative), which
    // 8 layers of large random weights amplify to ~6e-5 on logits. We allow 2e-4.
    let one = prefill_all("tiny-f32", opts(64, 4096, KvDtype::F32));
    for ps in [16, 64] {
        let got = prefill_all("tiny-f32", opts(64, ps, KvDtype::F32));
        let d = max_abs_diff(&got, &one);
        assert!(d < 2e-4, "page size {ps} differs by {d}");
    }
}

#[test]
fn paged_runs_are_bit_reproducible() {
    let a = prefill_all("tiny-f32", opts(64, 16, KvDtype::F16));
    let b = prefill_all("tiny-f32", opts(64, 16, KvDtype::F16));
    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
}

#[test]
fn f16_kv_cache_keeps_greedy_tokens() {
    let r = Reference::load("tiny-f32");
    let want = r.ids("greedy_tokens");
    let model = load_model("tiny-f32");
    let mut s = Session::new(model, opts(512, 4096, KvDtype::F16)).unwrap();
    let g = generate(
        &mut s,
        &r.ids("prompt_ids"),
        &GenerateParams {
            max_tokens: 32,
            ..Default::default()
        },
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap();
    // f16 rounding of K and V moves logits by ~1e-3; the smallest top-2 gap on this path is larger.
    let same = g
        .tokens
        .iter()
        .zip(&want)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        same >= 16,
        "f16 KV diverged at step {same}: {:?} vs {:?}",
        g.tokens,
        want
    );
}

#[test]
fn generate_reproduces_the_reference_greedy_tokens_and_text() {
    let r = Reference::load("tiny-f32");
    let want = r.ids("greedy_tokens");
    let model = load_model("tiny-f32");
    let tok = TextTokenizer::from_dir(&fixture("tiny-f32"), 512, &[])
        .unwrap()
        .unwrap();
    let mut s = Session::new(model, opts(512, 4096, KvDtype::F32)).unwrap();
    let mut streamed = String::new();
    let g = generate(
        &mut s,
        &r.ids("prompt_ids"),
        &GenerateParams {
            max_tokens: 32,
            ..Default::default()
        },
        Some(&tok),
        |_, _| {},
        |_| {},
        |t| streamed.push_str(t),
    )
    .unwrap();
    assert_eq!(g.tokens, want);
    assert_eq!(g.stop_reason, StopReason::MaxTokens);
    assert_eq!(g.text, tok.decode(&want).unwrap());
    assert_eq!(streamed, g.text);
    assert_eq!(
        s.tokens().len(),
        r.ids("prompt_ids").len() + 31,
        "the last token is sampled, not decoded"
    );
}

#[test]
fn generation_stops_at_eos_and_at_stop_strings() {
    let r = Reference::load("tiny-f32");
    let want = r.ids("greedy_tokens");
    let tok = TextTokenizer::from_dir(&fixture("tiny-f32"), 512, &[])
        .unwrap()
        .unwrap();
    let prompt = r.ids("prompt_ids");
    // eos: declare the 5th greedy token an eos id; the output is the 4 before it.
    let mut s = Session::new(load_model("tiny-f32"), opts(512, 4096, KvDtype::F32)).unwrap();
    let g = generate(
        &mut s,
        &prompt,
        &GenerateParams {
            max_tokens: 32,
            eos_ids: vec![want[4]],
            ..Default::default()
        },
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap();
    assert_eq!(g.stop_reason, StopReason::Eos);
    assert_eq!(
        g.tokens,
        want[..want.iter().position(|&t| t == want[4]).unwrap()].to_vec()
    );
    // stop string: a piece of the reference text; the output is cut before it and never streams it.
    let full = tok.decode(&want).unwrap();
    let stop = "writ".to_string();
    let cut = full
        .find(&stop)
        .expect("reference text contains the stop string");
    let mut s = Session::new(load_model("tiny-f32"), opts(512, 4096, KvDtype::F32)).unwrap();
    let mut streamed = String::new();
    let g = generate(
        &mut s,
        &prompt,
        &GenerateParams {
            max_tokens: 32,
            stop: vec![stop.clone()],
            ..Default::default()
        },
        Some(&tok),
        |_, _| {},
        |_| {},
        |t| streamed.push_str(t),
    )
    .unwrap();
    assert_eq!(g.stop_reason, StopReason::StopString);
    assert_eq!(g.text, full[..cut]);
    assert_eq!(streamed, g.text);
}

#[test]
fn a_cancelled_generation_stops_between_tokens_and_returns_what_it_made() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let r = Reference::load("tiny-f32");
    let want = r.ids("greedy_tokens");
    let tok = TextTokenizer::from_dir(&fixture("tiny-f32"), 512, &[])
        .unwrap()
        .unwrap();
    let prompt = r.ids("prompt_ids");
    let cancel = Arc::new(AtomicBool::new(false));
    let params = GenerateParams {
        max_tokens: 32,
        cancel: Some(cancel.clone()),
        ..Default::default()
    };
    // the flag goes up while the 5th token is handled (as a Ctrl-C would): the 5 tokens are kept, no 6th is sampled
    let mut s = Session::new(load_model("tiny-f32"), opts(512, 4096, KvDtype::F32)).unwrap();
    let mut n = 0;
    let mut streamed = String::new();
    let g = generate(
        &mut s,
        &prompt,
        &params,
        Some(&tok),
        |_, _| {},
        |_| {
            n += 1;
            if n == 5 {
                cancel.store(true, Ordering::Relaxed);
            }
        },
        |t| streamed.push_str(t),
    )
    .unwrap();
    assert_eq!(g.stop_reason, StopReason::Interrupted);
    assert_eq!(g.stop_reason.as_str(), "interrupted");
    assert_eq!(g.tokens, want[..5]);
    assert_eq!(g.text, tok.decode(&want[..5]).unwrap());
    assert_eq!(streamed, g.text);
    // already set: the prompt is processed, nothing is generated
    let mut s = Session::new(load_model("tiny-f32"), opts(512, 4096, KvDtype::F32)).unwrap();
    let g = generate(&mut s, &prompt, &params, None, |_, _| {}, |_| {}, |_| {}).unwrap();
    assert_eq!(g.stop_reason, StopReason::Interrupted);
    assert!(g.tokens.is_empty());
    assert_eq!(s.tokens(), &prompt[..]);
}

#[test]
fn seeded_sampling_is_reproducible_and_differs_from_greedy() {
    let r = Reference::load("tiny-f32");
    let prompt = r.ids("prompt_ids");
    let params = GenerateParams {
        max_tokens: 16,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.01,
            seed: 11,
            ..Default::default()
        },
        ..Default::default()
    };
    let run = || {
        let mut s = Session::new(load_model("tiny-f32"), opts(512, 4096, KvDtype::F32)).unwrap();
        generate(&mut s, &prompt, &params, None, |_, _| {}, |_| {}, |_| {})
            .unwrap()
            .tokens
    };
    let a = run();
    assert_eq!(a, run());
    assert_ne!(a, r.ids("greedy_tokens")[..16].to_vec());
}

#[test]
fn a_too_long_request_is_a_context_overflow_and_changes_nothing() {
    let model = load_model("tiny-f32");
    let mut o = opts(512, 4096, KvDtype::F32);
    o.context_length = Some(100);
    let mut s = Session::new(model, o).unwrap();
    let e = s.prefill(&[1; 101], Logits::Last, |_, _| {}).unwrap_err();
    assert!(
        matches!(
            e,
            EngineError::ContextOverflow {
                have: 0,
                add: 101,
                limit: 100
            }
        ),
        "{e:?}"
    );
    assert_eq!(s.tokens().len(), 0);
    // generation stops when the context is full: 90 prompt tokens leave room for 10
    let g = generate(
        &mut s,
        &[1; 90],
        &GenerateParams {
            max_tokens: 20,
            ..Default::default()
        },
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap();
    assert_eq!(g.stop_reason, backburner_engine::StopReason::ContextFull);
    assert_eq!(g.tokens.len(), 10);
    assert!(s.tokens().len() <= 100);
    s.clear();
    assert!(matches!(
        s.prefill(&[], Logits::Last, |_, _| {}),
        Err(EngineError::EmptyPrompt)
    ));
    // an out-of-vocab id fails and rolls back
    let e = s
        .prefill(&[1, 2, 9999], Logits::Last, |_, _| {})
        .unwrap_err();
    assert!(matches!(e, EngineError::Model(_)), "{e:?}");
    assert_eq!(s.tokens().len(), 0);
    assert_eq!(s.state().n_tokens(), 0);
}

#[test]
fn rewinding_to_a_snapshot_regenerates_the_same_reply() {
    let r = Reference::load("tiny-f32");
    let prompt = r.ids("prompt_ids");
    let mut s = Session::new(load_model("tiny-f32"), opts(64, 64, KvDtype::F32)).unwrap();
    let logits0 = s.prefill(&prompt, Logits::Last, |_, _| {}).unwrap();
    let snap = s.snapshot();
    let mut first = Vec::new();
    let mut l = logits0.clone();
    for _ in 0..8 {
        let t = backburner_engine::argmax(&l);
        first.push(t);
        l = s.decode(t).unwrap();
    }
    s.rewind(&snap);
    assert_eq!(s.tokens().len(), prompt.len());
    let mut second = Vec::new();
    let mut l = logits0;
    for _ in 0..8 {
        let t = backburner_engine::argmax(&l);
        second.push(t);
        l = s.decode(t).unwrap();
    }
    assert_eq!(first, second);
    assert_eq!(first, r.ids("greedy_tokens")[..8].to_vec());
}

#[test]
fn perplexity_agrees_with_transformers() {
    // nll is a mean of per-token log-softmax values; our logits are within ~6e-4 of HF's, so nll is too.
    for name in ["tiny-f32", "tiny-bf16", "tiny-hub"] {
        let r = Reference::load(name);
        let ids: Vec<u32> = serde_json::from_value(r.json["ppl_ids"].clone()).unwrap();
        for (key, ctx) in [("ppl_full", ids.len()), ("ppl_ctx64", 64)] {
            let want = &r.json[key];
            let got = perplexity(
                load_model(name),
                &ids,
                ctx,
                opts(512, 4096, KvDtype::F32),
                |_, _| {},
            )
            .unwrap();
            assert_eq!(got.n_tokens, want["n_tokens"].as_u64().unwrap() as usize);
            assert_eq!(got.n_scored, want["n_predicted"].as_u64().unwrap() as usize);
            let dn = (got.nll - want["nll"].as_f64().unwrap()).abs();
            assert!(dn < 1e-3, "{name} {key}: nll differs by {dn}");
            let rel = (got.ppl / want["ppl"].as_f64().unwrap() - 1.0).abs();
            assert!(rel < 1e-3, "{name} {key}: ppl differs by {rel} relative");
        }
    }
}

#[test]
fn a_state_rebuilt_from_rows_and_linear_states_continues_identically() {
    // What split prefill will do: a second node computes some layers; the host adopts its KV rows and linear states.
    // Here: run the prompt on one state, copy its rows and linear states into a fresh one, and check that decoding
    // continues with bit-identical logits.
    let r = Reference::load("tiny-f32");
    let prompt = r.ids("prompt_ids");
    let model = load_model("tiny-f32");
    let cfg = model.config().clone();
    let o = opts(64, 64, KvDtype::F32);
    let mut a = backburner_model::ModelState::new(&cfg, 0..cfg.num_hidden_layers, o.kv);
    let mut x = model.embed(&prompt).unwrap();
    model.forward_layers(0..cfg.num_hidden_layers, &mut x, prompt.len(), &mut a);
    model.commit_tokens(&mut a, prompt.len());
    let mut b = backburner_model::ModelState::new(&cfg, 0..cfg.num_hidden_layers, o.kv);
    for i in 0..cfg.num_hidden_layers {
        if let Some((k, v)) = a.read_kv_rows(i, 0, prompt.len()) {
            assert!(b.append_kv_rows(i, &k, &v, prompt.len()));
        } else {
            assert!(b.set_linear(i, a.linear(i).unwrap().clone()));
        }
    }
    b.set_position(prompt.len());
    for st in [&mut a, &mut b] {
        let mut x = model.embed(&[42]).unwrap();
        model.forward_layers(0..cfg.num_hidden_layers, &mut x, 1, st);
        model.commit_tokens(st, 1);
    }
    let mut xa = model.embed(&[7]).unwrap();
    let mut xb = xa.clone();
    model.forward_layers(0..cfg.num_hidden_layers, &mut xa, 1, &mut a);
    model.forward_layers(0..cfg.num_hidden_layers, &mut xb, 1, &mut b);
    let (la, lb) = (model.logits(&xa, 1).unwrap(), model.logits(&xb, 1).unwrap());
    assert!(la.iter().zip(&lb).all(|(p, q)| p.to_bits() == q.to_bits()));
}

#[test]
fn nan_weights_give_a_typed_error_not_silent_tokens() {
    let d = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("tiny-f32")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), d.path().join(e.file_name())).unwrap();
    }
    // overwrite one f32 of lm_head with NaN, in place
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = header["lm_head.weight"]["data_offsets"][0]
        .as_u64()
        .unwrap() as usize;
    bytes[8 + n + off..8 + n + off + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&p, bytes).unwrap();
    let model = std::sync::Arc::new(backburner_model::Model::load(d.path()).unwrap());
    let mut s = Session::new(model.clone(), opts(64, 64, KvDtype::F32)).unwrap();
    let e = generate(
        &mut s,
        &[1, 2, 3],
        &GenerateParams {
            max_tokens: 4,
            ..Default::default()
        },
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap_err();
    assert!(matches!(e, EngineError::NonFinite), "{e:?}");
    let e = perplexity(
        model,
        &[1, 2, 3, 4],
        4,
        opts(2, 64, KvDtype::F32),
        |_, _| {},
    )
    .unwrap_err();
    assert!(matches!(e, EngineError::NonFinite), "{e:?}");
}

#[test]
fn a_token_loop_inside_the_pool_gives_the_same_bits_and_errors() {
    // `Session::in_pool` moves the loop onto a compute thread; the kernels must still split over the session's pool
    // (2 threads here, whatever the global pool is) and give the same logits as calls from outside it.
    let r = Reference::load("tiny-f32");
    let prompt = r.ids("prompt_ids");
    let pool = backburner_engine::ComputePool::new(2).unwrap();
    let o = SessionOptions {
        pool,
        ..opts(64, 16, KvDtype::F16)
    };
    let steps = |s: &mut Session| -> Vec<Vec<f32>> {
        let mut tok =
            backburner_engine::argmax(&s.prefill(&prompt, Logits::Last, |_, _| {}).unwrap());
        (0..6)
            .map(|_| {
                let l = s.decode(tok).unwrap();
                tok = backburner_engine::argmax(&l);
                l
            })
            .collect()
    };
    let mut outside = Session::new(load_model("tiny-f32"), o.clone()).unwrap();
    let want = steps(&mut outside);
    let mut inside = Session::new(load_model("tiny-f32"), o).unwrap();
    let (got, threads, name) = inside.in_pool(|s| {
        let name = std::thread::current().name().map(str::to_owned);
        (steps(s), rayon::current_num_threads(), name)
    });
    assert_eq!(threads, 2);
    assert!(name.is_some_and(|n| n.starts_with("bb-compute-")));
    for (step, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits()),
            "step {step} differs inside the pool"
        );
    }
    // an error inside comes back out, and leaves the session as it was
    let before = inside.tokens().len();
    let err = inside.in_pool(|s| s.decode(u32::MAX)).unwrap_err();
    assert!(matches!(err, EngineError::Model(_)), "{err}");
    assert_eq!(inside.tokens().len(), before);
}
