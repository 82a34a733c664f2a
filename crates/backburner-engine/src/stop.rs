//! Stop strings: the limits a request's stop strings must keep, and the incremental matcher behind
//! [`crate::TextStream`], whose work per generated token is bounded by the new text, not by the text generated so far
//! or by the stop strings' length.
//!
//! Each stop string gets a Knuth–Morris–Pratt automaton whose state is the length of the longest suffix of the text
//! read so far that is a prefix of the string. The state of every string is kept between tokens, so a token costs
//! one step per new byte and stop string (amortized: a step may follow failure links, but the state never falls
//! further than it rose). The same states give the text to hold back (the longest suffix that may begin a stop
//! string) with no search. When the decoded text changes before its end (a tokenizer whose decoding of a window is
//! not prefix-stable), the states are rebuilt from the last `longest − 1` bytes before the change: a state never
//! exceeds that, since the text before the change holds no stop string.

use crate::error::{EngineError, Result};

/// Most stop strings one request may give. OpenAI's API allows 4; llama-server and vLLM take any number. 16 covers
/// the agent frameworks that pass one per tool or role marker, and keeps the per-token work small.
pub const MAX_STOP_STRINGS: usize = 16;

/// Most bytes (UTF-8) of one stop string. Stop strings in use are role markers, code fences and a few words; 256
/// bytes holds 64 characters of any script. The stream holds back at most this much text minus one byte.
pub const MAX_STOP_BYTES: usize = 256;

/// Checks stop strings against [`MAX_STOP_STRINGS`] and [`MAX_STOP_BYTES`]. Empty strings are ignored (they stop
/// nothing) and do not count.
///
/// Errors: [`EngineError::InvalidInput`] naming the limit passed (the message starts with `stop`).
pub fn check_stop_strings(stop: &[String]) -> Result<()> {
    let n = stop.iter().filter(|s| !s.is_empty()).count();
    if n > MAX_STOP_STRINGS {
        return Err(EngineError::InvalidInput(format!(
            "stop strings: at most {MAX_STOP_STRINGS} non-empty per request, got {n}"
        )));
    }
    if let Some((i, s)) = stop
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        return Err(EngineError::InvalidInput(format!(
            "stop strings: at most {MAX_STOP_BYTES} bytes each (UTF-8), but string {i} has {} bytes",
            s.len()
        )));
    }
    Ok(())
}

/// One stop string's automaton.
#[derive(Clone, Debug)]
struct Kmp {
    pat: Box<[u8]>,
    /// `border[i]`: length of the longest proper prefix of `pat[..=i]` that is also its suffix.
    border: Box<[usize]>,
}

impl Kmp {
    /// The automaton of a non-empty `pat`.
    fn new(pat: &[u8]) -> Self {
        let mut border = vec![0usize; pat.len()];
        let mut k = 0;
        for i in 1..pat.len() {
            while k > 0 && pat[i] != pat[k] {
                k = border[k - 1];
            }
            if pat[i] == pat[k] {
                k += 1;
            }
            border[i] = k;
        }
        Kmp {
            pat: pat.into(),
            border: border.into(),
        }
    }

    /// The state after reading `b` in state `q` (`q` = the pattern's length after a whole match).
    fn step(&self, mut q: usize, b: u8) -> usize {
        if q == self.pat.len() {
            q = self.border[q - 1];
        }
        loop {
            if self.pat[q] == b {
                return q + 1;
            }
            if q == 0 {
                return 0;
            }
            q = self.border[q - 1];
        }
    }
}

/// Finds stop strings in a growing text, reading each byte once (see the module documentation).
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<Kmp>,
    /// Each stop string's state after `text[..fed]`.
    states: Vec<usize>,
    /// Bytes of the text the states cover.
    fed: usize,
    /// Bytes of the longest stop string.
    longest: usize,
}

impl StopMatcher {
    /// A matcher of `stop` (empty strings are ignored). Memory: a word per byte of the stop strings.
    pub fn new(stop: &[String]) -> Self {
        let stops: Vec<Kmp> = stop
            .iter()
            .filter(|s| !s.is_empty())
            .map(|s| Kmp::new(s.as_bytes()))
            .collect();
        StopMatcher {
            states: vec![0; stops.len()],
            longest: stops.iter().map(|k| k.pat.len()).max().unwrap_or(0),
            stops,
            fed: 0,
        }
    }

    /// Whether there is no (non-empty) stop string.
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Reads `text`, of which `text[..from]` is unchanged since the last call and holds no stop string (the first
    /// call: `from` = 0). Returns the byte offset where the leftmost stop string in `text` begins, if one ends after
    /// `from` (the first occurrence of each string, the smallest offset of those).
    ///
    /// Work: one step per byte of `text[from..]` and stop string; when `from` is not where the last call ended, also
    /// per byte of the `longest − 1` bytes before `from`.
    pub fn advance(&mut self, text: &str, from: usize) -> Option<usize> {
        let bytes = text.as_bytes();
        let from = from.min(bytes.len());
        if from != self.fed {
            // the text changed before its end: rebuild the states from far enough back to hold any of them
            self.states.fill(0);
            let start = from.saturating_sub(self.longest.saturating_sub(1));
            for &b in &bytes[start..from] {
                for (q, k) in self.states.iter_mut().zip(&self.stops) {
                    *q = k.step(*q, b);
                }
            }
        }
        let mut first: Option<usize> = None;
        for (i, &b) in bytes.iter().enumerate().skip(from) {
            for (q, k) in self.states.iter_mut().zip(&self.stops) {
                *q = k.step(*q, b);
                if *q == k.pat.len() {
                    let start = i + 1 - k.pat.len();
                    first = Some(first.map_or(start, |f| f.min(start)));
                }
            }
        }
        self.fed = bytes.len();
        first
    }

    /// Bytes at the end of the text last read that are a proper prefix of some stop string (0 when none): the text
    /// to hold back. Always whole characters of that text.
    pub fn held(&self) -> usize {
        self.states
            .iter()
            .zip(&self.stops)
            .map(|(&q, k)| if q == k.pat.len() { 0 } else { q })
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive_first(text: &str, stops: &[&str]) -> Option<usize> {
        stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| text.find(s))
            .min()
    }

    fn naive_held(text: &str, stops: &[&str]) -> usize {
        let mut hold = 0;
        for s in stops {
            for k in (1..s.len()).rev() {
                if k > hold && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                    hold = k;
                    break;
                }
            }
        }
        hold
    }

    #[test]
    fn borders_are_the_longest_proper_ones() {
        assert_eq!(&*Kmp::new(b"aabaaab").border, &[0, 1, 0, 1, 2, 2, 3]);
        assert_eq!(&*Kmp::new(b"abcabd").border, &[0, 0, 0, 1, 2, 0]);
    }

    #[test]
    fn piece_by_piece_matches_a_search_of_the_whole_text() {
        let stops = ["aab", "abab", "ba", "é€", "€x", "aaaaaaaaab", ""];
        let pieces = [
            "a", "a", "a", "ab", "é", "€", "b", "a", "ab", "a", "b", "aaaa", "aaaa", "a", "b",
        ];
        for n in 1..=stops.len() {
            let stops = &stops[..n];
            let owned: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
            let mut m = StopMatcher::new(&owned);
            let mut text = String::new();
            for p in pieces {
                let from = text.len();
                text.push_str(p);
                let got = m.advance(&text, from);
                let want = naive_first(&text, stops);
                assert_eq!(got, want, "{stops:?} after {text:?}");
                if got.is_some() {
                    break;
                }
                assert_eq!(m.held(), naive_held(&text, stops), "{stops:?} {text:?}");
            }
        }
    }

    #[test]
    fn a_rewritten_tail_rebuilds_the_states() {
        let owned = vec!["xyz".to_string(), "yq".to_string()];
        let mut m = StopMatcher::new(&owned);
        assert_eq!(m.advance("abcxy", 0), None);
        assert_eq!(m.held(), 2);
        // the last two bytes are decoded differently now: "abcx" + "q..."
        assert_eq!(m.advance("abcxqy", 4), None);
        assert_eq!(m.held(), 1);
        assert_eq!(m.advance("abcxqyq", 6), Some(5));
    }

    #[test]
    fn limits_name_what_they_limit() {
        let ok: Vec<String> = (0..MAX_STOP_STRINGS).map(|i| "s".repeat(i + 1)).collect();
        check_stop_strings(&ok).unwrap();
        check_stop_strings(&["é".repeat(MAX_STOP_BYTES / 2)]).unwrap();
        let many: Vec<String> = vec!["x".into(); MAX_STOP_STRINGS + 1];
        assert_eq!(
            check_stop_strings(&many).unwrap_err().to_string(),
            "invalid input: stop strings: at most 16 non-empty per request, got 17"
        );
        // empty strings stop nothing and do not count
        let mut with_empty = ok.clone();
        with_empty.extend(vec![String::new(); 20]);
        check_stop_strings(&with_empty).unwrap();
        let long = vec!["a".into(), "é".repeat(129)];
        assert_eq!(
            check_stop_strings(&long).unwrap_err().to_string(),
            "invalid input: stop strings: at most 256 bytes each (UTF-8), but string 1 has 258 bytes"
        );
    }
}
