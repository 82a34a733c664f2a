//! The statistical test of speculative sampling: on a 6-token vocabulary with fixed synthetic logits per context,
//! the distribution of the first three generated tokens with speculation (drafts from a deliberately different
//! distribution: deterministic, and sampled with their `q`) equals the exact distribution of plain sampling,
//! computed by enumeration from the picker's own distribution.
//!
//! Pearson's chi-square over the 216 sequences (cells expected below 5 pooled), 200,000 sequences per case, at
//! significance 0.001 (critical value by the Wilson–Hilferty approximation). The seeds are fixed, so the test is
//! deterministic: it cannot flake, and a change that moves the result is a change in behaviour. A power check
//! runs the same statistic on the drafts' own distribution, which it must reject by far.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::tests_accept::toy_logits;
use super::DraftProbs;
use crate::picker::Picker;
use crate::sampling::{argmax, Distribution, SamplingParams};

const V: usize = 6;
const LEN: usize = 3;
const PROMPT: [u32; 2] = [0, 3];
const N: usize = 200_000;
/// z of the one-sided 0.999 quantile of the standard normal (significance 0.001).
const Z_999: f64 = 3.090_232;

fn target(ctx: &[u32]) -> Vec<f32> {
    toy_logits(ctx, V, 21, 0.0)
}

/// The draft model's logits: another function of the context, sharper.
fn draft_logits(ctx: &[u32]) -> Vec<f32> {
    toy_logits(ctx, V, 99, 0.0)
        .iter()
        .map(|x| 2.0 * x)
        .collect()
}

fn softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = l.iter().map(|&x| ((x - m) as f64).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|x| (x / z) as f32).collect()
}

fn cell(seq: &[u32]) -> usize {
    seq.iter().fold(0, |c, &t| c * V + t as usize)
}

/// The exact probability of every `LEN`-token sequence under plain sampling with `p`.
fn exact(p: &SamplingParams) -> Vec<f64> {
    let mut probs = vec![0.0; V.pow(LEN as u32)];
    fn walk(p: &SamplingParams, prefix: &mut Vec<u32>, mass: f64, probs: &mut [f64]) {
        if prefix.len() == LEN {
            probs[cell(prefix)] += mass;
            return;
        }
        let mut pk = Picker::new(p.clone(), &PROMPT, None, None);
        for &t in prefix.iter() {
            pk.record(t).unwrap();
        }
        let ctx = [&PROMPT[..], prefix].concat();
        let mut d = Distribution::default();
        pk.distribution(&target(&ctx), &mut d).unwrap();
        for (&id, &q) in d.ids().iter().zip(d.probs()) {
            prefix.push(id);
            walk(p, prefix, mass * q, probs);
            prefix.pop();
        }
    }
    walk(p, &mut Vec::new(), 1.0, &mut probs);
    probs
}

/// Counts of the first `LEN` tokens of `N` speculative runs (seeds 0..N), `k` cycling through 1, 2, 3.
fn speculative_counts(p: &SamplingParams, sampled: bool) -> Vec<usize> {
    let mut counts = vec![0usize; V.pow(LEN as u32)];
    for s in 0..N {
        let params = SamplingParams {
            seed: s as u64,
            ..p.clone()
        };
        let mut pk = Picker::new(params, &PROMPT, None, None);
        let mut drng = StdRng::seed_from_u64(0xD0_0000 + s as u64);
        let mut ctx = PROMPT.to_vec();
        let mut step = 0;
        while ctx.len() < PROMPT.len() + LEN {
            let k = 1 + (s + step) % 3;
            step += 1;
            let (mut c, mut drafts, mut q, mut rows) =
                (ctx.clone(), Vec::new(), Vec::new(), target(&ctx));
            for _ in 0..k {
                let d = if sampled {
                    let qr = softmax(&draft_logits(&c));
                    let mut u = drng.random::<f32>();
                    let d = qr.iter().position(|&x| {
                        u -= x;
                        u < 0.0
                    });
                    q.extend_from_slice(&qr);
                    d.unwrap_or(V - 1) as u32
                } else {
                    argmax(&draft_logits(&c))
                };
                c.push(d);
                drafts.push(d);
                rows.extend(target(&c));
            }
            let qp = if sampled {
                DraftProbs::Sampled(&q)
            } else {
                DraftProbs::PointMass
            };
            let v = pk.verify(&rows, &drafts, qp).unwrap();
            ctx.extend_from_slice(&drafts[..v.accepted]);
            ctx.push(v.next);
        }
        counts[cell(&ctx[PROMPT.len()..PROMPT.len() + LEN])] += 1;
    }
    counts
}

/// Pearson's statistic and its degrees of freedom, cells expected below 5 pooled into one. Panics when a sequence
/// of probability 0 occurs.
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let (mut stat, mut cells) = (0.0, 0);
    let (mut pool_o, mut pool_e) = (0.0, 0.0);
    for (&o, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        assert!(
            p > 0.0 || o == 0,
            "a sequence of probability 0 occurred {o} times"
        );
        if p == 0.0 {
            continue;
        }
        if e < 5.0 {
            pool_o += o as f64;
            pool_e += e;
            continue;
        }
        stat += (o as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pool_e > 0.0 {
        stat += (pool_o - pool_e).powi(2) / pool_e;
        cells += 1;
    }
    (stat, cells - 1)
}

/// The upper `z`-quantile of chi-square with `df` degrees of freedom (Wilson–Hilferty).
fn critical(df: usize, z: f64) -> f64 {
    let d = df as f64;
    let c = 2.0 / (9.0 * d);
    d * (1.0 - c + z * c.sqrt()).powi(3)
}

fn cases() -> Vec<(&'static str, SamplingParams)> {
    vec![
        (
            "temperature 1",
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
        ),
        (
            "filters, penalties and a bias",
            SamplingParams {
                temperature: 0.8,
                top_k: 5,
                top_p: 0.9,
                min_p: 0.05,
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                repetition_penalty: 1.3,
                logit_bias: vec![(2, 0.7)],
                ..Default::default()
            },
        ),
    ]
}

#[test]
fn speculative_sampling_has_the_distribution_of_plain_sampling() {
    for (name, p) in cases() {
        let probs = exact(&p);
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        for sampled in [false, true] {
            let counts = speculative_counts(&p, sampled);
            let (stat, df) = chi_square(&counts, &probs);
            let crit = critical(df, Z_999);
            eprintln!(
                "{name}, sampled q {sampled}: chi-square {stat:.1} on {df} df (critical {crit:.1})"
            );
            assert!(
                stat < crit,
                "{name}, sampled q {sampled}: {stat} ≥ {crit} on {df} df"
            );
        }
    }
}

#[test]
fn the_test_rejects_the_drafts_own_distribution() {
    // sequences drawn from the draft model alone: the statistic must be far above the critical value
    let p = &cases()[0].1;
    let probs = exact(p);
    let mut counts = vec![0usize; V.pow(LEN as u32)];
    let mut g = StdRng::seed_from_u64(5);
    for _ in 0..N / 4 {
        let mut ctx = PROMPT.to_vec();
        for _ in 0..LEN {
            let q = softmax(&draft_logits(&ctx));
            let mut u = g.random::<f32>();
            let d = q.iter().position(|&x| {
                u -= x;
                u < 0.0
            });
            ctx.push(d.unwrap_or(V - 1) as u32);
        }
        counts[cell(&ctx[PROMPT.len()..])] += 1;
    }
    let (stat, df) = chi_square(&counts, &probs);
    assert!(stat > 10.0 * critical(df, Z_999), "{stat} on {df} df");
}
