//! Token sampling: greedy, temperature, top-k, top-p (nucleus), min-p, with a seeded RNG.
//!
//! Order of the filters follows Hugging Face `generate` (temperature, then top-k, then top-p, then min-p, all on the
//! tempered distribution), so the same settings mean the same thing as in transformers.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings. `temperature == 0` means greedy (argmax; ties go to the lowest id).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability sums to ≥ top_p (1.0 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p ×` the top token's (0 = off).
    pub min_p: f32,
    /// RNG seed (the same seed and settings give the same tokens).
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

/// A sampler holding its RNG.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest value; the lowest index wins ties; NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    /// A sampler for `params`, seeded with `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from logits `[vocab]` f32.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        // Scale in f64: a tiny temperature must sharpen towards greedy, not overflow f32.
        let temp = p.temperature as f64;
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v as f64 / temp))
            .collect();
        if cand.is_empty() {
            return argmax(logits);
        }
        // Sort by descending logit, ascending id on ties: deterministic.
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.truncate(p.top_k);
        }
        let m = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|(_, v)| (v - m).exp()).collect();
        let z: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= z);
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, &q) in probs.iter().enumerate() {
                acc += q;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let thr = probs[0] * p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|&&q| q >= thr).count().max(1));
        }
        let probs = &probs[..keep];
        let total: f64 = probs.iter().sum();
        let mut r = self.rng.random::<f64>() * total;
        for (i, &q) in probs.iter().enumerate() {
            r -= q;
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_argmax_and_the_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 3.0, -1.0, 3.0]), 1);
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&[0.1, 0.2, 2.0, 1.9]), 2);
        }
    }

    #[test]
    fn min_p_removes_tokens_far_below_the_top() {
        // probs ∝ e^[0, -10, -0.1]: token 1 is ~4.5e-5 of the top, below min_p 0.05.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.05,
            seed: 7,
            ..Default::default()
        });
        for _ in 0..500 {
            assert_ne!(s.sample(&[0.0, -10.0, -0.1]), 1);
        }
    }

    #[test]
    fn top_p_keeps_the_smallest_nucleus() {
        // probs ≈ [0.84, 0.11, 0.04, 0.01]; top_p 0.9 keeps ids 0 and 1 only.
        let l = [3.0f32, 1.0, 0.0, -1.5];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: 3,
            ..Default::default()
        });
        let mut seen = [0usize; 4];
        for _ in 0..2000 {
            seen[s.sample(&l) as usize] += 1;
        }
        assert_eq!(seen[2] + seen[3], 0);
        assert!(seen[1] > 100, "{seen:?}");
    }

    #[test]
    fn a_tiny_temperature_is_greedy() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1e-40,
            seed: 1,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.5, 2.0, -3.0, 1.9]), 1);
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_tokens() {
        let l: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams {
            temperature: 0.8,
            seed: 42,
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..20).map(|_| s.sample(&l)).collect()
        };
        let mut s = Sampler::new(p);
        let b: Vec<u32> = (0..20).map(|_| s.sample(&l)).collect();
        assert_eq!(a, b);
        assert!(a.iter().any(|&t| t != a[0]), "sampling should vary: {a:?}");
    }
}
