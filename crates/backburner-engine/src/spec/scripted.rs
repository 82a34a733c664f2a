//! Scripted drafts for benchmarks and tests: the known continuation, with a chosen share of wrong tokens, so that a
//! random-weight model (whose MTP drafts are almost never right) can be measured at 100, 80 or 60 % acceptance.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{Draft, DraftSource};
use crate::error::{EngineError, Result};

/// Proposes `script[len..len + k]` after `len` tokens, each replaced by a wrong id with probability `error_rate`
/// ([`DraftSource`]).
///
/// `script` holds the token of every position (prompt, then the greedy continuation the model is known to produce,
/// as a plain greedy run records it). A wrong id is `(s + 1 + r) mod vocab` for the scripted `s` and `r` uniform in
/// `0..vocab − 1`, so it is never the scripted one. Each draft is right with probability `1 − error_rate`
/// independently: the per-position acceptance `a` of [`crate::spec::AdaptiveDraft`]'s model, so that greedy
/// verification keeps `j` drafts of `k` with probability `a^j (1 − a)` (`a^k` for all), and the share of drafted
/// tokens kept is `(a + … + a^k) / k`, below `a`.
///
/// Deterministic for a seed: the errors come from one RNG seeded with it, one draw per drafted token.
/// The tokens given must follow the script (only the last one is checked, against the script at its position):
/// past the script's end, or off it, nothing is proposed.
#[derive(Clone, Debug)]
pub struct ScriptedDraft {
    script: Vec<u32>,
    vocab: u32,
    error_rate: f64,
    rng: StdRng,
}

impl ScriptedDraft {
    /// A source following `script` (ids `[positions]`) in a vocabulary of `vocab` ids.
    ///
    /// Errors: [`EngineError::InvalidInput`] when `error_rate` is not in [0, 1], an id of `script` is outside the
    /// vocabulary, or `vocab < 2` with errors asked (no wrong id exists).
    pub fn new(script: Vec<u32>, vocab: usize, error_rate: f64, seed: u64) -> Result<Self> {
        let bad = |m: String| Err(EngineError::InvalidInput(m));
        if !(0.0..=1.0).contains(&error_rate) {
            return bad(format!("draft error rate {error_rate} must be in [0, 1]"));
        }
        let Ok(vocab32) = u32::try_from(vocab) else {
            return bad(format!("vocabulary of {vocab} ids"));
        };
        if error_rate > 0.0 && vocab < 2 {
            return bad(format!("no wrong draft exists in a vocabulary of {vocab}"));
        }
        if let Some(t) = script.iter().find(|&&t| t >= vocab32) {
            return bad(format!(
                "scripted token {t} is outside the vocabulary of {vocab}"
            ));
        }
        Ok(ScriptedDraft {
            script,
            vocab: vocab32,
            error_rate,
            rng: StdRng::seed_from_u64(seed),
        })
    }

    /// The script.
    pub fn script(&self) -> &[u32] {
        &self.script
    }
}

impl DraftSource for ScriptedDraft {
    fn propose(&mut self, tokens: &[u32], max: usize, draft: &mut Draft) -> Result<()> {
        draft.clear();
        let len = tokens.len();
        let on_script = len > 0 && self.script.get(len - 1) == tokens.last();
        if !on_script {
            return Ok(());
        }
        let end = self.script.len().min(len.saturating_add(max));
        for &s in &self.script[len.min(end)..end] {
            let t = if self.error_rate > 0.0 && self.rng.random_bool(self.error_rate) {
                let r = self.rng.random_range(0..self.vocab - 1);
                ((s as u64 + 1 + r as u64) % self.vocab as u64) as u32
            } else {
                s
            };
            draft.tokens.push(t);
        }
        Ok(())
    }

    fn name(&self) -> &'static str {
        "scripted"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(d: &mut ScriptedDraft, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut draft = Draft::default();
        d.propose(tokens, max, &mut draft).unwrap();
        draft.tokens
    }

    #[test]
    fn without_errors_it_proposes_the_script_and_nothing_off_it() {
        let script: Vec<u32> = vec![1, 2, 3, 4, 5, 6];
        let mut d = ScriptedDraft::new(script, 10, 0.0, 1).unwrap();
        assert_eq!(run(&mut d, &[1, 2], 3), [3, 4, 5]);
        assert_eq!(run(&mut d, &[1, 2, 3, 4, 5], 3), [6]);
        assert_eq!(run(&mut d, &[1, 2, 3, 4, 5, 6], 3), Vec::<u32>::new());
        assert_eq!(run(&mut d, &[1, 9], 3), Vec::<u32>::new()); // off the script
        assert_eq!(run(&mut d, &[], 3), Vec::<u32>::new());
        assert_eq!(run(&mut d, &[1, 2], 0), Vec::<u32>::new());
        assert_eq!(run(&mut d, &[1, 2], usize::MAX), [3, 4, 5, 6]);
    }

    #[test]
    fn errors_come_at_the_rate_asked_are_never_the_scripted_id_and_repeat_with_the_seed() {
        let script: Vec<u32> = (0..20_001).map(|i| (i * 7 % 5) as u32).collect();
        let tokens = &script[..1];
        for rate in [0.0, 0.2, 0.4, 1.0] {
            let mut d = ScriptedDraft::new(script.clone(), 5, rate, 9).unwrap();
            let got = run(&mut d, tokens, 20_000);
            let wrong = got.iter().zip(&script[1..]).filter(|(a, b)| a != b).count();
            let share = wrong as f64 / 20_000.0;
            // binomial sd at 20k draws is ≤ 0.0036: 5 sd
            assert!((share - rate).abs() < 0.018, "rate {rate}: {share}");
            assert!(got.iter().all(|&t| t < 5));
            let mut again = ScriptedDraft::new(script.clone(), 5, rate, 9).unwrap();
            assert_eq!(run(&mut again, tokens, 20_000), got);
        }
    }

    #[test]
    fn bad_settings_are_invalid_input() {
        for (script, vocab, rate) in [
            (vec![1], 4, -0.1),
            (vec![1], 4, 1.5),
            (vec![1], 4, f64::NAN),
            (vec![4], 4, 0.0),
            (vec![0], 1, 0.5),
        ] {
            assert!(matches!(
                ScriptedDraft::new(script, vocab, rate, 0),
                Err(EngineError::InvalidInput(_))
            ));
        }
        assert!(ScriptedDraft::new(vec![0], 1, 0.0, 0).is_ok());
    }
}
