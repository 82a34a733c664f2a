//! Speculative decoding is exact: a sequence decoding its pending token and k drafts in one verify step
//! ([`Sequence::spec_step`]) produces, token for token and logit for logit, what plain decoding produces — greedy
//! and sampled (same seed), with drafts all right, partly wrong or all wrong, for k = 1…8, and when the sequence
//! ends (eos, max tokens, a full context) inside a verify step.

use crate::common;

use std::sync::Arc;

use backburner_engine::{
    generate, GenerateParams, Generation, Phase, SamplingParams, Sequence, Session, SessionOptions,
    StopReason,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, Model};
use common::*;

fn opts(page_size: usize) -> SessionOptions {
    SessionOptions {
        ubatch: 32,
        kv: KvOptions {
            page_size,
            dtype: KvDtype::F32,
        },
        ..SessionOptions::default()
    }
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(99) >> 7) % vocab as u32)
        .collect()
}

fn plain(model: &Arc<Model>, prompt: &[u32], params: &GenerateParams, page: usize) -> Generation {
    let mut s = Session::new(model.clone(), opts(page)).unwrap();
    generate(&mut s, prompt, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

/// Drafts `k` tokens of `truth` from the position the sequence is at, replacing those whose absolute index `j`
/// has `wrong(j)` by another id.
fn drafts(
    truth: &[u32],
    at: usize,
    k: usize,
    vocab: u32,
    wrong: &dyn Fn(usize) -> bool,
) -> Vec<u32> {
    (at..(at + k).min(truth.len()))
        .map(|j| {
            if wrong(j) {
                (truth[j] + 1) % vocab
            } else {
                truth[j]
            }
        })
        .collect()
}

/// Generates with speculation; returns the generation and (drafted, accepted) counts.
fn speculative(
    model: &Arc<Model>,
    prompt: &[u32],
    params: &GenerateParams,
    page: usize,
    truth: &[u32],
    k: usize,
    wrong: &dyn Fn(usize) -> bool,
) -> (Generation, usize, usize) {
    let vocab = model.config().vocab_size as u32;
    let mut s = Session::new(model.clone(), opts(page)).unwrap();
    let mut seq = Sequence::new(&s, prompt.to_vec(), params.clone(), None).unwrap();
    seq.prefill_step(&mut s, prompt.len(), |_, _| {}).unwrap();
    let (mut drafted, mut accepted) = (0, 0);
    loop {
        match seq.phase() {
            Phase::Sample => {
                seq.sample_step(false).unwrap();
            }
            Phase::Decode => {
                // the pending token is tokens()[len − 1]; the drafts follow it
                let at = seq.tokens().len();
                let d = drafts(truth, at, k, vocab, wrong);
                let room = seq.draft_room(&s);
                drafted += d.len().min(room);
                let (_, a) = seq.spec_step(&mut s, &d, false).unwrap();
                accepted += a;
            }
            _ => break,
        }
    }
    // the session holds the prompt and every generated token but the last (never decoded)
    assert_eq!(s.tokens()[..prompt.len()], prompt[..], "session's prompt");
    assert_eq!(
        s.tokens()[prompt.len()..],
        seq.tokens()[..s.tokens().len() - prompt.len()],
        "session's tokens"
    );
    assert!(s.tokens().len() < prompt.len() + seq.tokens().len().max(1));
    (seq.finish(), drafted, accepted)
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        keep_logits: true,
        ..GenerateParams::default()
    }
}

fn sampled(max_tokens: usize, seed: u64) -> GenerateParams {
    GenerateParams {
        max_tokens,
        keep_logits: true,
        logprobs: Some(3),
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            seed,
            repetition_penalty: 1.1,
            presence_penalty: 0.3,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    }
}

fn assert_same(a: &Generation, b: &Generation, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.stop_reason, b.stop_reason, "{what}: stop reason");
    assert_eq!(
        a.step_logits.len(),
        b.step_logits.len(),
        "{what}: logits rows"
    );
    assert!(
        a.step_logits
            .iter()
            .zip(&b.step_logits)
            .all(|(x, y)| x.to_bits() == y.to_bits()),
        "{what}: logits differ"
    );
    assert_eq!(a.logprobs, b.logprobs, "{what}: logprobs");
}

#[test]
fn greedy_speculation_equals_plain_decoding() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let p = prompt(37, vocab);
    let params = greedy(40);
    let want = plain(&model, &p, &params, 16);
    assert_eq!(want.tokens.len(), 40);
    let patterns: [(&str, &dyn Fn(usize) -> bool); 4] = [
        ("all right", &|_| false),
        ("every third wrong", &|j| j % 3 == 2),
        ("every other wrong", &|j| j % 2 == 1),
        ("all wrong", &|_| true),
    ];
    for k in 1..=8 {
        for (name, wrong) in patterns {
            let (got, drafted, accepted) =
                speculative(&model, &p, &params, 16, &want.tokens, k, wrong);
            assert_same(&got, &want, &format!("k={k}, {name}"));
            if name == "all right" {
                assert_eq!(accepted, drafted, "k={k}: every right draft is accepted");
                // 39 tokens after the first: each step samples its accepted drafts and one more
                assert!(
                    accepted + 1 >= 39 * k / (k + 1),
                    "k={k}: {accepted} accepted"
                );
            }
            if name == "all wrong" {
                assert_eq!(accepted, 0, "k={k}");
            }
        }
    }
}

#[test]
fn sampled_speculation_equals_plain_sampling_with_the_same_seed() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let p = prompt(21, vocab);
    for seed in [1u64, 7, 1234] {
        let params = sampled(30, seed);
        let want = plain(&model, &p, &params, 4);
        for (k, wrong) in [
            (3usize, &(|j: usize| j % 4 == 1) as &dyn Fn(usize) -> bool),
            (6, &|_| false),
        ] {
            let (got, _, _) = speculative(&model, &p, &params, 4, &want.tokens, k, wrong);
            assert_same(&got, &want, &format!("seed {seed}, k={k}"));
        }
    }
}

#[test]
fn a_sequence_ending_inside_a_verify_step_keeps_only_what_it_decoded() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let p = prompt(19, vocab);
    let base = plain(&model, &p, &greedy(24), 16);
    // eos: the 10th greedy token is declared an eos id; max tokens 7 inside a k = 8 step
    let mut eos = greedy(24);
    eos.eos_ids = vec![base.tokens[9]];
    let first = base
        .tokens
        .iter()
        .position(|&t| t == base.tokens[9])
        .unwrap();
    for params in [eos, greedy(7)] {
        let want = plain(&model, &p, &params, 16);
        let (got, _, _) = speculative(&model, &p, &params, 16, &base.tokens, 8, &|_| false);
        assert_same(&got, &want, "end inside a step");
        if !params.eos_ids.is_empty() {
            assert_eq!(got.stop_reason, StopReason::Eos);
            assert_eq!(got.tokens.len(), first);
        }
    }
}

#[test]
fn a_full_context_inside_a_verify_step() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let p = prompt(19, vocab);
    let base = plain(&model, &p, &greedy(24), 16);
    let mut o = opts(16);
    o.context_length = Some(26);
    let mut want_s = Session::new(model.clone(), o.clone()).unwrap();
    let want = generate(
        &mut want_s,
        &p,
        &greedy(24),
        None,
        |_, _| {},
        |_| {},
        |_| {},
    )
    .unwrap();
    assert_eq!(want.stop_reason, StopReason::ContextFull);
    let mut s = Session::new(model.clone(), o).unwrap();
    let mut seq = Sequence::new(&s, p.clone(), greedy(24), None).unwrap();
    seq.prefill_step(&mut s, p.len(), |_, _| {}).unwrap();
    while seq.phase() != Phase::Done {
        if seq.phase() == Phase::Sample {
            seq.sample_step(false).unwrap();
            continue;
        }
        let at = seq.tokens().len();
        let d = drafts(&base.tokens, at, 8, vocab as u32, &|_| false);
        seq.spec_step(&mut s, &d, false).unwrap();
        assert!(s.tokens().len() <= 26);
    }
    assert_same(&seq.finish(), &want, "context full");
}
