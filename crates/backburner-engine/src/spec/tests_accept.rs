//! Tests of the accept rules: greedy equals argmax decoding, point-mass drafts equal plain sampling token for token,
//! shapes are checked, and the sampler's distribution is the one it draws from.

use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::picker::Picker;
use crate::sampling::{argmax, Distribution, Sampler, SamplingParams};

/// Logits of a toy model: a fixed pseudo-random function of the last three tokens and the length, values in
/// [−1.5, 1.5] (`quantum > 0`: rounded to multiples of it, so that ties occur).
pub(super) fn toy_logits(ctx: &[u32], vocab: usize, salt: u64, quantum: f32) -> Vec<f32> {
    let mix = |mut h: u64| {
        h = (h ^ (h >> 31)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h = (h ^ (h >> 29)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^ (h >> 32)
    };
    let mut h = mix(salt ^ (ctx.len() as u64).wrapping_mul(0x1000_0000_01b3));
    for &t in &ctx[ctx.len().saturating_sub(3)..] {
        h = mix(h ^ t as u64);
    }
    (0..vocab)
        .map(|i| {
            let x = (mix(h ^ (i as u64 + 1)) >> 11) as f64 / (1u64 << 53) as f64;
            let v = (x * 3.0 - 1.5) as f32;
            if quantum > 0.0 {
                (v / quantum).round() * quantum
            } else {
                v
            }
        })
        .collect()
}

/// The verify rows for `drafts` after `ctx`: `[drafts.len() + 1, vocab]`.
pub(super) fn rows_for(ctx: &[u32], drafts: &[u32], vocab: usize, salt: u64, q: f32) -> Vec<f32> {
    let mut c = ctx.to_vec();
    let mut rows = toy_logits(&c, vocab, salt, q);
    for &d in drafts {
        c.push(d);
        rows.extend(toy_logits(&c, vocab, salt, q));
    }
    rows
}

/// The reference: decode the rows one at a time with argmax, stopping at the first draft that differs.
fn greedy_reference(rows: &[f32], drafts: &[u32], vocab: usize) -> Accepted {
    for (i, row) in rows.chunks_exact(vocab).enumerate() {
        let t = argmax(row);
        if drafts.get(i) != Some(&t) {
            return Accepted {
                accepted: i,
                next: t,
            };
        }
    }
    unreachable!()
}

proptest! {
    #[test]
    fn greedy_accept_is_argmax_decoding_on_random_logits(
        seed in any::<u64>(),
        k in 0usize..7,
        vocab in 1usize..40,
        hit in 0.0f64..1.0,
    ) {
        let mut g = StdRng::seed_from_u64(seed);
        let coarse = g.random_bool(0.5);
        let rows: Vec<f32> = (0..(k + 1) * vocab)
            .map(|_| {
                let x = g.random_range(-3.0f32..3.0);
                if coarse { x.round() } else { x } // coarse: many ties
            })
            .collect();
        let drafts: Vec<u32> = rows
            .chunks_exact(vocab)
            .take(k)
            .map(|row| {
                if g.random_bool(hit) { argmax(row) } else { g.random_range(0..vocab as u32) }
            })
            .collect();
        let want = greedy_reference(&rows, &drafts, vocab);
        prop_assert_eq!(accept_greedy(&rows, &drafts).unwrap(), want);
        let mut s = Sampler::new(SamplingParams::default());
        prop_assert_eq!(accept(&mut s, &rows, &drafts, DraftProbs::PointMass).unwrap(), want);
        // a sampled q changes nothing under greedy settings
        let q = vec![1.0 / vocab as f32; k * vocab];
        prop_assert_eq!(accept(&mut s, &rows, &drafts, DraftProbs::Sampled(&q)).unwrap(), want);
        let mut pk = Picker::new(SamplingParams::default(), &[], None, None);
        let v = pk.verify(&rows, &drafts, DraftProbs::PointMass).unwrap();
        prop_assert_eq!((v.accepted, v.next), (want.accepted, want.next));
    }
}

/// Plain decoding of `n` tokens after `prompt` with a picker, and their log-probabilities.
fn plain(p: &SamplingParams, prompt: &[u32], n: usize, vocab: usize) -> (Vec<u32>, Vec<TokLp>) {
    let mut pk = Picker::new(p.clone(), prompt, Some(2), None);
    let mut ctx = prompt.to_vec();
    let mut lps = Vec::new();
    for _ in 0..n {
        let (id, lp) = pk.pick(&toy_logits(&ctx, vocab, 5, 0.25)).unwrap();
        ctx.push(id);
        lps.push(lp.unwrap());
    }
    (ctx[prompt.len()..].to_vec(), lps)
}

type TokLp = crate::picker::TokenLogprob;

/// Speculative decoding of at least `n` tokens with `source` and `control`, verified by a picker.
fn speculative(
    p: &SamplingParams,
    prompt: &[u32],
    n: usize,
    vocab: usize,
    source: &mut dyn DraftSource,
    control: &mut AdaptiveDraft,
) -> (Vec<u32>, Vec<TokLp>) {
    let mut pk = Picker::new(p.clone(), prompt, Some(2), None);
    let mut ctx = prompt.to_vec();
    let mut lps = Vec::new();
    let mut draft = Draft::default();
    while ctx.len() < prompt.len() + n {
        let k = control.next_k();
        draft.clear();
        if k > 0 {
            source.propose(&ctx, k, &mut draft).unwrap();
        }
        let rows = rows_for(&ctx, &draft.tokens, vocab, 5, 0.25);
        let v = pk.verify(&rows, &draft.tokens, draft.q()).unwrap();
        source.observe(v.accepted, v.next);
        control.observe(draft.tokens.len(), v.accepted);
        ctx.extend_from_slice(&draft.tokens[..v.accepted]);
        ctx.push(v.next);
        lps.extend(v.logprobs);
    }
    (ctx[prompt.len()..].to_vec(), lps)
}

fn settings() -> Vec<SamplingParams> {
    let greedy_penalized = SamplingParams {
        repetition_penalty: 1.3,
        presence_penalty: 0.4,
        frequency_penalty: 0.2,
        logit_bias: vec![(3, 0.3)],
        ..Default::default()
    };
    let filtered = SamplingParams {
        temperature: 0.8,
        top_k: 6,
        top_p: 0.9,
        min_p: 0.05,
        seed: 77,
        repetition_penalty: 1.2,
        presence_penalty: 0.3,
        frequency_penalty: 0.1,
        logit_bias: vec![(2, 0.5), (7, -1.0)],
    };
    let plain_t = SamplingParams {
        temperature: 1.1,
        seed: 3,
        ..Default::default()
    };
    vec![
        SamplingParams::default(),
        greedy_penalized,
        filtered,
        plain_t,
    ]
}

#[test]
fn deterministic_drafts_give_the_tokens_and_logprobs_of_plain_decoding_for_the_same_seed() {
    let vocab = 12;
    let prompt = [1u32, 4, 1, 4, 1];
    for p in settings() {
        let (want, want_lp) = plain(&p, &prompt, 60, vocab);
        let script: Vec<u32> = [&prompt[..], &want].concat();
        for err in [0.0, 0.3, 1.0] {
            let mut src = ScriptedDraft::new(script.clone(), vocab, err, 11).unwrap();
            let mut ctl = AdaptiveDraft::new(AdaptiveConfig::new(4)).unwrap();
            let (got, got_lp) = speculative(&p, &prompt, 60, vocab, &mut src, &mut ctl);
            assert_eq!(got[..60], want[..], "{p:?} error {err}");
            assert_eq!(got_lp[..60], want_lp[..]);
            if err == 0.0 {
                assert!(ctl.stats().accepted > 30, "{:?}", ctl.stats());
            }
        }
        let mut src = NgramDraft::new(1, 3).unwrap();
        let mut ctl = AdaptiveDraft::new(AdaptiveConfig::new(3)).unwrap();
        let (got, got_lp) = speculative(&p, &prompt, 60, vocab, &mut src, &mut ctl);
        assert_eq!(got[..60], want[..], "{p:?} n-gram");
        assert_eq!(got_lp[..60], want_lp[..]);
    }
}

#[test]
fn the_low_level_rule_on_pre_adjusted_rows_matches_the_picker() {
    // without penalties the rows need no adjustment: accept() and Picker::verify agree step for step
    let p = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 8,
        ..Default::default()
    };
    let vocab = 9;
    let mut g = StdRng::seed_from_u64(12);
    let mut s = Sampler::new(p.clone());
    let mut pk = Picker::new(p, &[], None, None);
    let mut ctx = vec![0u32];
    for _ in 0..200 {
        let k = g.random_range(0..5);
        let drafts: Vec<u32> = (0..k).map(|_| g.random_range(0..vocab as u32)).collect();
        let rows = rows_for(&ctx, &drafts, vocab, 9, 0.0);
        let a = accept(&mut s, &rows, &drafts, DraftProbs::PointMass).unwrap();
        let v = pk.verify(&rows, &drafts, DraftProbs::PointMass).unwrap();
        assert_eq!((a.accepted, a.next), (v.accepted, v.next));
        ctx.extend_from_slice(&drafts[..a.accepted]);
        ctx.push(a.next);
    }
}

#[test]
fn shapes_and_draft_probabilities_are_checked() {
    let rows = [0.0f32; 12];
    let bad = |r: Result<Accepted>| matches!(r, Err(crate::EngineError::InvalidInput(_)));
    assert!(bad(accept_greedy(&rows[..11], &[0, 1])));
    assert!(bad(accept_greedy(&[], &[])));
    assert!(bad(accept_greedy(&rows, &[0, 4]))); // vocab 4
    assert_eq!(accept_greedy(&rows, &[0, 0]).unwrap().accepted, 2);
    let mut s = Sampler::new(SamplingParams {
        temperature: 1.0,
        ..Default::default()
    });
    assert!(bad(accept(
        &mut s,
        &rows,
        &[0, 1],
        DraftProbs::Sampled(&[0.25; 7])
    )));
    let mut q = vec![0.25f32; 8];
    q[1] = 0.0; // the first draft, id 1, had q = 0
    assert!(bad(accept(&mut s, &rows, &[1, 1], DraftProbs::Sampled(&q))));
    let mut pk = Picker::new(SamplingParams::default(), &[], None, None);
    assert!(pk.verify(&rows[..5], &[0], DraftProbs::PointMass).is_err());
}

#[test]
fn the_distribution_is_the_one_the_sampler_draws_from() {
    let l: Vec<f32> = toy_logits(&[3, 1], 40, 1, 0.0);
    let cases = [
        SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
        SamplingParams {
            temperature: 0.6,
            top_k: 7,
            top_p: 0.8,
            ..Default::default()
        },
        SamplingParams {
            temperature: 1.4,
            min_p: 0.3,
            ..Default::default()
        },
    ];
    for p in cases {
        let mut s = Sampler::new(p.clone());
        let mut d = Distribution::default();
        s.distribution(&l, &mut d);
        assert!((d.probs().iter().sum::<f64>() - 1.0).abs() < 1e-12);
        let mut seen = vec![0usize; 40];
        let n = 200_000;
        for _ in 0..n {
            seen[s.sample(&l) as usize] += 1;
        }
        for id in 0..40u32 {
            let want = d.prob(id);
            let got = seen[id as usize] as f64 / n as f64;
            if want == 0.0 {
                assert_eq!(seen[id as usize], 0, "{p:?} id {id}");
            } else {
                let sd = (want * (1.0 - want) / n as f64).sqrt();
                assert!(
                    (got - want).abs() < 5.0 * sd + 1e-9,
                    "{p:?} id {id}: {got} vs {want}"
                );
            }
        }
        // it draws nothing: the next sample is the one a fresh sampler draws first
        let mut a = Sampler::new(p.clone());
        let mut b = Sampler::new(p.clone());
        a.distribution(&l, &mut d);
        assert_eq!(a.sample(&l), b.sample(&l));
    }
    // greedy: the argmax alone
    let mut s = Sampler::new(SamplingParams::default());
    let mut d = Distribution::default();
    s.distribution(&[0.5, 2.0, 2.0, -1.0], &mut d);
    assert_eq!((d.ids(), d.probs()), (&[1u32][..], &[1.0][..]));
}
