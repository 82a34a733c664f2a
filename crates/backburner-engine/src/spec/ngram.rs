//! Prompt-lookup (n-gram) drafts: the tokens that followed the most recent earlier occurrence of the longest suffix
//! of the conversation (prompt and output), found through an index kept up to date as tokens come and go.
//!
//! Defaults: n from [`DEFAULT_MAX_NGRAM`] = 5 down to [`DEFAULT_MIN_NGRAM`] = 3. vLLM's prompt lookup uses
//! `prompt_lookup_min = prompt_lookup_max = 5` when neither is set (its source calls them "arbitrarily chosen"),
//! searching the longest match first; llama.cpp's `ngram-simple` keys on the last 12 tokens (48-token drafts, for
//! rewriting code) and `ngram-mod` on 24. We keep vLLM's longest key (5) and also accept 4- and 3-token matches,
//! which find repeats in chat and agent text that a 5-gram misses, but not 1- and 2-grams, which match common tokens
//! everywhere and mostly propose wrong continuations. Among occurrences of the same length the most recent one wins
//! (llama.cpp's "last n-gram in history"; vLLM takes the earliest), as recent text is the likelier to repeat.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::{Draft, DraftSource};
use crate::error::{EngineError, Result};

/// Default shortest suffix matched.
pub const DEFAULT_MIN_NGRAM: usize = 3;
/// Default longest suffix matched (vLLM's `prompt_lookup_max`).
pub const DEFAULT_MAX_NGRAM: usize = 5;
/// Longest n-gram size accepted (each size costs an index and a hash of n tokens per token).
pub const MAX_NGRAM: usize = 32;

/// No earlier occurrence.
const NONE: u32 = u32::MAX;
/// Occurrences with a colliding hash tried before giving up on a size (64-bit hashes: practically never more than 1).
const MAX_CHAIN: usize = 8;

/// A hasher that passes a `u64` key through: the keys are already well-mixed hashes.
#[derive(Default)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type Index = HashMap<u64, u32, BuildHasherDefault<PassThrough>>;

/// The 64-bit hash of an n-gram (a multiply-rotate fold finished with SplitMix64's mixer).
fn hash(ngram: &[u32]) -> u64 {
    let mut h = ngram.len() as u64;
    for &t in ngram {
        h = (h.rotate_left(23) ^ t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94D0_49BB_1331_11EB);
    h ^ (h >> 31)
}

/// Prompt-lookup drafts ([`DraftSource`]).
///
/// For every size n in `min_n..=max_n` it indexes each n-gram that has a token after it: a hash map from the
/// n-gram's hash to the end of its latest occurrence, and per end the end of the previous occurrence with the same
/// hash (a chain, as in a compressor's match finder). Appending a token costs one hash of n tokens and one map
/// insert per size; removing a token (a rollback) undoes that through the chain. A proposal looks up the suffix of
/// each size, longest first, and checks the tokens (hash collisions cost nothing but a miss). Memory: about
/// 4 + (max_n − min_n + 1) × 28 bytes per token (tokens, chains, maps).
///
/// [`DraftSource::propose`] first brings the index to the tokens given: one comparison of their common prefix with
/// the copy it holds (a `memcmp`, ~400 KB at 100k tokens), then it removes the tokens past the first difference and
/// indexes the new ones.
#[derive(Clone, Debug)]
pub struct NgramDraft {
    min_n: usize,
    max_n: usize,
    tokens: Vec<u32>,
    /// Per size (index `n − min_n`): n-gram hash → end (exclusive) of its latest indexed occurrence.
    heads: Vec<Index>,
    /// Per size: for each end `e` (`[tokens.len()]`), the end of the previous indexed occurrence with the same hash,
    /// or [`NONE`] (also for `e < n`).
    prev: Vec<Vec<u32>>,
}

impl Default for NgramDraft {
    fn default() -> Self {
        Self::new(DEFAULT_MIN_NGRAM, DEFAULT_MAX_NGRAM).expect("valid defaults")
    }
}

impl NgramDraft {
    /// Drafts matching suffixes of `max_n` down to `min_n` tokens.
    ///
    /// Errors: [`EngineError::InvalidInput`] unless `1 ≤ min_n ≤ max_n ≤` [`MAX_NGRAM`].
    pub fn new(min_n: usize, max_n: usize) -> Result<Self> {
        if !(1 <= min_n && min_n <= max_n && max_n <= MAX_NGRAM) {
            return Err(EngineError::InvalidInput(format!(
                "n-gram sizes {min_n}..={max_n} must satisfy 1 ≤ min ≤ max ≤ {MAX_NGRAM}"
            )));
        }
        let sizes = max_n - min_n + 1;
        Ok(NgramDraft {
            min_n,
            max_n,
            tokens: Vec::new(),
            heads: vec![Index::default(); sizes],
            prev: vec![Vec::new(); sizes],
        })
    }

    /// The tokens indexed.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Brings the index to `tokens`: removes what follows their common prefix with the tokens indexed, then indexes
    /// the rest of `tokens`. Errors: [`EngineError::InvalidInput`] past `u32::MAX − 1` tokens.
    pub fn sync(&mut self, tokens: &[u32]) -> Result<()> {
        if tokens.len() >= NONE as usize {
            return Err(EngineError::InvalidInput(format!(
                "{} tokens are more than the n-gram index holds",
                tokens.len()
            )));
        }
        let common = common_prefix(&self.tokens, tokens);
        self.truncate(common);
        for &t in &tokens[common..] {
            self.push(t);
        }
        Ok(())
    }

    /// Appends one token: indexes the n-grams that end just before it (they now have a token after them).
    pub fn push(&mut self, t: u32) {
        let e = self.tokens.len();
        for (i, n) in (self.min_n..=self.max_n).enumerate() {
            let before = if e >= n {
                let h = hash(&self.tokens[e - n..e]);
                self.heads[i].insert(h, e as u32).unwrap_or(NONE)
            } else {
                NONE
            };
            self.prev[i].push(before);
        }
        self.tokens.push(t);
    }

    /// Keeps the first `len` tokens (no-op past the end), undoing the index entries of the others, last first.
    pub fn truncate(&mut self, len: usize) {
        for e in (len..self.tokens.len()).rev() {
            for (i, n) in (self.min_n..=self.max_n).enumerate() {
                if e < n {
                    continue;
                }
                let h = hash(&self.tokens[e - n..e]);
                match self.prev[i][e] {
                    NONE => self.heads[i].remove(&h),
                    before => self.heads[i].insert(h, before),
                };
            }
        }
        self.tokens.truncate(len);
        for p in &mut self.prev {
            p.truncate(len);
        }
    }

    /// The end (exclusive) of the most recent earlier occurrence of the longest indexed suffix, and its size.
    fn find(&self) -> Option<(usize, usize)> {
        let len = self.tokens.len();
        for n in (self.min_n..=self.max_n).rev() {
            let i = n - self.min_n;
            if len < n + 1 {
                continue;
            }
            let suffix = &self.tokens[len - n..];
            let mut at = self.heads[i].get(&hash(suffix)).copied().unwrap_or(NONE);
            for _ in 0..MAX_CHAIN {
                if at == NONE {
                    break;
                }
                let e = at as usize;
                if &self.tokens[e - n..e] == suffix {
                    return Some((e, n));
                }
                at = self.prev[i][e];
            }
        }
        None
    }

    /// Up to `max` drafts after the tokens indexed, into `out` (cleared first): the tokens that followed the match,
    /// continued periodically when they run into the suffix itself (a repeat of period `len − end`).
    pub fn draft(&self, max: usize, out: &mut Vec<u32>) {
        out.clear();
        let Some((end, _)) = self.find() else {
            return;
        };
        let len = self.tokens.len();
        let period = len - end;
        for j in 0..max {
            let t = if end + j < len {
                self.tokens[end + j]
            } else {
                out[j - period]
            };
            out.push(t);
        }
    }
}

/// Length of the common prefix of `a` and `b`: one slice comparison when one is a prefix of the other, else a
/// search by blocks.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    let n = a.len().min(b.len());
    if a[..n] == b[..n] {
        return n;
    }
    const BLOCK: usize = 1024;
    let mut at = 0;
    while at + BLOCK <= n && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..n]
        .iter()
        .zip(&b[at..n])
        .position(|(x, y)| x != y)
        .unwrap_or(n - at)
}

impl DraftSource for NgramDraft {
    fn propose(&mut self, tokens: &[u32], max: usize, draft: &mut Draft) -> Result<()> {
        draft.clear();
        self.sync(tokens)?;
        self.draft(max, &mut draft.tokens);
        Ok(())
    }

    fn name(&self) -> &'static str {
        "ngram"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The definition, by brute force: longest n first, the latest end `e ≤ len − 1`, periodic continuation.
    fn reference(tokens: &[u32], min_n: usize, max_n: usize, max: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min_n..=max_n).rev() {
            if len < n + 1 {
                continue;
            }
            let suffix = &tokens[len - n..];
            if let Some(e) = (n..len).rev().find(|&e| &tokens[e - n..e] == suffix) {
                let mut out: Vec<u32> = Vec::new();
                for j in 0..max {
                    let t = if e + j < len {
                        tokens[e + j]
                    } else {
                        out[j - (len - e)]
                    };
                    out.push(t);
                }
                return out;
            }
        }
        Vec::new()
    }

    fn propose(d: &mut NgramDraft, tokens: &[u32], max: usize) -> Vec<u32> {
        let mut draft = Draft::default();
        d.propose(tokens, max, &mut draft).unwrap();
        assert!(draft.probs.is_empty());
        draft.tokens
    }

    #[test]
    fn the_longest_suffix_wins_then_the_most_recent_occurrence() {
        let mut d = NgramDraft::new(2, 4).unwrap();
        // "1 2 3 4" → 9 (4-gram), later "2 3 4" → 7 (3-gram, more recent); the suffix is "1 2 3 4"
        let t = [1, 2, 3, 4, 9, 8, 2, 3, 4, 7, 6, 1, 2, 3, 4];
        assert_eq!(propose(&mut d, &t, 3), [9, 8, 2]);
        // same length: the most recent occurrence
        let t = [5, 6, 1, 0, 5, 6, 2, 0, 5, 6];
        assert_eq!(propose(&mut d, &t, 2), [2, 0]);
        // nothing of length ≥ 2 repeats
        assert_eq!(propose(&mut d, &[1, 2, 3, 4, 5, 6], 4), Vec::<u32>::new());
        // max 0 proposes nothing
        assert_eq!(propose(&mut d, &t, 0), Vec::<u32>::new());
    }

    #[test]
    fn a_repeat_running_into_the_suffix_continues_periodically() {
        let mut d = NgramDraft::new(2, 5).unwrap();
        assert_eq!(propose(&mut d, &[5, 6, 5, 6, 5, 6], 5), [5, 6, 5, 6, 5]);
        assert_eq!(propose(&mut d, &[7, 7, 7], 4), [7, 7, 7, 7]);
        assert_eq!(
            propose(&mut d, &[1, 2, 3, 1, 2, 3], 7),
            [1, 2, 3, 1, 2, 3, 1]
        );
    }

    #[test]
    fn sizes_outside_the_limits_are_invalid_input() {
        for (a, b) in [(0, 3), (4, 3), (1, MAX_NGRAM + 1)] {
            assert!(matches!(
                NgramDraft::new(a, b),
                Err(EngineError::InvalidInput(_))
            ));
        }
        assert_eq!(NgramDraft::default().min_n, 3);
        assert_eq!(NgramDraft::default().max_n, 5);
    }

    #[test]
    fn the_index_follows_appends_rollbacks_and_rewinds_as_the_brute_force_finds() {
        let mut g = StdRng::seed_from_u64(37);
        for case in 0..60 {
            let (min_n, max_n) = [(1, 1), (1, 3), (2, 5), (3, 5), (4, 8)][case % 5];
            let alphabet = [2u32, 3, 5, 20][case % 4];
            let mut d = NgramDraft::new(min_n, max_n).unwrap();
            let mut tokens: Vec<u32> = Vec::new();
            for _ in 0..300 {
                match g.random_range(0..10) {
                    0 => {
                        let keep = g.random_range(0..=tokens.len());
                        tokens.truncate(keep); // rollback
                    }
                    1 if !tokens.is_empty() => {
                        let at = g.random_range(0..tokens.len());
                        tokens[at] = g.random_range(0..alphabet); // a rewind to a different history
                    }
                    _ => {
                        for _ in 0..g.random_range(1..4) {
                            tokens.push(g.random_range(0..alphabet));
                        }
                    }
                }
                let max = g.random_range(0..9);
                let want = reference(&tokens, min_n, max_n, max);
                assert_eq!(propose(&mut d, &tokens, max), want, "{tokens:?}");
                assert_eq!(d.tokens(), &tokens[..]);
            }
            // the index after all this equals one built from scratch
            let mut fresh = NgramDraft::new(min_n, max_n).unwrap();
            fresh.sync(&tokens).unwrap();
            assert_eq!(fresh.heads, d.heads);
            assert_eq!(fresh.prev, d.prev);
        }
    }

    #[test]
    fn common_prefix_finds_the_first_difference() {
        let a: Vec<u32> = (0..5000).collect();
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 5000);
        assert_eq!(common_prefix(&a, &b[..10]), 10);
        for at in [0, 1, 1023, 1024, 1025, 4999] {
            b[at] = 9_999_999;
            assert_eq!(common_prefix(&a, &b), at);
            b[at] = a[at];
        }
    }

    #[test]
    fn a_long_context_is_indexed_once_and_each_step_only_adds_its_tokens() {
        // 100k tokens of text-like noise with a repeat planted far back: one sync, then steps of one token.
        let mut g = StdRng::seed_from_u64(100);
        let mut tokens: Vec<u32> = (0..100_000).map(|_| g.random_range(0..50_000)).collect();
        let planted: Vec<u32> = tokens[1000..1010].to_vec();
        tokens.extend_from_slice(&planted[..5]);
        let mut d = NgramDraft::default();
        assert_eq!(propose(&mut d, &tokens, 4), planted[5..9]);
        let t0 = std::time::Instant::now();
        for i in 5..9 {
            tokens.push(planted[i]);
            assert_eq!(propose(&mut d, &tokens, 1), [planted[i + 1]]);
        }
        eprintln!(
            "n-gram step at 100k tokens: {:.1} µs",
            t0.elapsed().as_secs_f64() * 1e6 / 4.0
        );
    }
}
