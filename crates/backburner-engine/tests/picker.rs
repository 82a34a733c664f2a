//! The adjustments and log-probabilities of a generation ([`backburner_engine::picker`]) on a real checkpoint:
//! each token is the argmax of the model's logits adjusted as the module says (replayed here from the kept logits),
//! and each reported log-probability is the log-softmax of those adjusted logits.

use crate::common;

use std::collections::{HashMap, HashSet};

use backburner_engine::picker::token_logprob;
use backburner_engine::{
    argmax, generate, EngineError, GenerateParams, Generation, SamplingParams, Session,
    SessionOptions,
};
use common::*;

/// The fixture's vocabulary.
fn vocab() -> usize {
    load_model("tiny-f32").config().vocab_size
}

fn run(params: SamplingParams, logprobs: Option<usize>) -> (Vec<u32>, Generation) {
    let r = Reference::load("tiny-f32");
    let prompt = r.ids("prompt_ids");
    let p = GenerateParams {
        max_tokens: 12,
        sampling: params,
        keep_logits: true,
        logprobs,
        ..Default::default()
    };
    let mut s = Session::new(load_model("tiny-f32"), SessionOptions::default()).unwrap();
    let g = generate(&mut s, &prompt, &p, None, |_, _| {}, |_| {}, |_| {}).unwrap();
    (prompt, g)
}

/// The module's stages 1–3, written out again: repetition over the prompt and the output so far, presence and
/// frequency over the output, then the bias.
fn adjusted(raw: &[f32], p: &SamplingParams, prompt: &[u32], out: &[u32]) -> Vec<f32> {
    let mut l = raw.to_vec();
    let seen: HashSet<u32> = prompt.iter().chain(out).copied().collect();
    if p.repetition_penalty != 1.0 {
        for &id in &seen {
            let x = &mut l[id as usize];
            *x = if *x > 0.0 {
                *x / p.repetition_penalty
            } else {
                *x * p.repetition_penalty
            };
        }
    }
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &id in out {
        *counts.entry(id).or_default() += 1;
    }
    for (&id, &c) in &counts {
        l[id as usize] -= p.presence_penalty + c as f32 * p.frequency_penalty;
    }
    for &(id, b) in &p.logit_bias {
        l[id as usize] += b;
    }
    l
}

#[test]
fn plain_greedy_logprobs_are_the_log_softmax_of_the_model_logits() {
    let (_, plain) = run(SamplingParams::default(), None);
    let (_, g) = run(SamplingParams::default(), Some(5));
    assert_eq!(
        g.tokens, plain.tokens,
        "asking for logprobs changes no token"
    );
    assert!(plain.logprobs.is_empty());
    assert_eq!(g.logprobs.len(), g.tokens.len());
    for (i, (lp, &id)) in g.logprobs.iter().zip(&g.tokens).enumerate() {
        let raw = &g.step_logits[i * vocab()..(i + 1) * vocab()];
        assert_eq!(*lp, token_logprob(raw, id, 5), "step {i}");
        assert_eq!(
            lp.top[0],
            (id, lp.logprob),
            "greedy picks the first alternative"
        );
        assert_eq!(lp.top.len(), 5);
        assert!(lp.logprob < 0.0 && lp.logprob > -20.0, "{}", lp.logprob);
    }
}

#[test]
fn penalties_and_bias_give_the_argmax_of_the_adjusted_logits_at_every_step() {
    let (_, plain) = run(SamplingParams::default(), None);
    let p = SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        frequency_penalty: 0.7,
        logit_bias: vec![(plain.tokens[1], -3.0), (17, 1.5)],
        ..Default::default()
    };
    let (prompt, g) = run(p.clone(), Some(3));
    assert_ne!(g.tokens, plain.tokens, "the adjustments change the output");
    for i in 0..g.tokens.len() {
        let raw = &g.step_logits[i * vocab()..(i + 1) * vocab()];
        let l = adjusted(raw, &p, &prompt, &g.tokens[..i]);
        assert_eq!(g.tokens[i], argmax(&l), "step {i}");
        assert_eq!(g.logprobs[i], token_logprob(&l, g.tokens[i], 3), "step {i}");
    }
}

#[test]
fn a_large_bias_forces_its_token_with_a_logprob_near_zero() {
    let (_, plain) = run(SamplingParams::default(), None);
    let forced = (0..vocab() as u32)
        .find(|t| !plain.tokens.contains(t))
        .unwrap();
    let p = SamplingParams {
        logit_bias: vec![(forced, 100.0)],
        ..Default::default()
    };
    let (_, g) = run(p, Some(0));
    assert_eq!(g.tokens, vec![forced; 12]);
    for lp in &g.logprobs {
        assert!(lp.logprob > -1e-6 && lp.logprob <= 0.0, "{}", lp.logprob);
        assert!(lp.top.is_empty());
    }
}

#[test]
fn values_without_a_meaning_are_refused_before_anything_runs() {
    let r = Reference::load("tiny-f32");
    let prompt = r.ids("prompt_ids");
    let mut s = Session::new(load_model("tiny-f32"), SessionOptions::default()).unwrap();
    let bad = [
        (
            SamplingParams {
                logit_bias: vec![(vocab() as u32, 1.0)],
                ..Default::default()
            },
            "logit_bias names token id",
        ),
        (
            SamplingParams {
                logit_bias: vec![(3, 101.0)],
                ..Default::default()
            },
            "logit_bias 101",
        ),
        (
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            "presence_penalty 2.5",
        ),
        (
            SamplingParams {
                frequency_penalty: -3.0,
                ..Default::default()
            },
            "frequency_penalty -3",
        ),
        (
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            "repetition_penalty 0",
        ),
    ];
    for (sampling, want) in bad {
        let p = GenerateParams {
            max_tokens: 4,
            sampling,
            ..Default::default()
        };
        match generate(&mut s, &prompt, &p, None, |_, _| {}, |_| {}, |_| {}) {
            Err(EngineError::InvalidInput(m)) => assert!(m.starts_with(want), "{m}"),
            other => panic!("{want}: {other:?}"),
        }
        assert!(s.tokens().is_empty(), "nothing ran");
    }
}
