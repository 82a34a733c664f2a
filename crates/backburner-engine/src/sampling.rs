//! Token sampling: greedy, temperature, top-k, top-p (nucleus), min-p, with a seeded RNG.
//!
//! Order of the filters follows Hugging Face `generate` (temperature, then top-k, then top-p, then min-p, all on the
//! tempered distribution), so the same settings mean the same thing as in transformers.
//!
//! The filters are defined on the candidates in descending order of logit (ascending id on ties), with the softmax
//! normalizer summed in that order. Sorting the whole vocabulary (248k entries) every token is avoided:
//! - greedy (temperature 0) is one argmax pass;
//! - top-k selects the k best with `select_nth_unstable_by` and sorts only those;
//! - otherwise the candidates are split at `exp(v − max) < z / 2⁵⁷` into a *head*, which is sorted, and a *tail*
//!   whose every term provably leaves each floating-point sum of the filters and of the draw unchanged (checked per
//!   element at run time, so no assumption about `exp` is needed). Only when that check fails, or a filter or the
//!   draw reaches past the head, is everything sorted.
//!
//! The token chosen for any (logits, settings, seed) is therefore bit for bit the one of a full sort; the tests keep
//! the full-sort sampler as a reference and compare the two.

use std::cmp::Ordering;

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
    /// Subtracted from the logit of every id generated at least once (OpenAI's `presence_penalty`, −2 … 2; 0 = off;
    /// [`crate::picker`]).
    pub presence_penalty: f32,
    /// Times an id was generated, times this, is subtracted from its logit (OpenAI's `frequency_penalty`, −2 … 2).
    pub frequency_penalty: f32,
    /// Logits of ids in the prompt or the output are divided by this when positive, multiplied when not (Hugging
    /// Face's and vLLM's `repetition_penalty`, 0.01 … 100; 1 = off).
    pub repetition_penalty: f32,
    /// `(id, bias)` pairs added to the logits (OpenAI's `logit_bias`, −100 … 100).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks that every value has a meaning: temperature finite and ≥ 0, top-p in (0, 1], min-p in [0, 1], presence
    /// and frequency penalties in [−2, 2], a repetition penalty in [0.01, 100], biases in [−100, 100] (their ids are
    /// checked against the vocabulary by [`crate::Sequence::new`]).
    ///
    /// Errors: [`crate::EngineError::InvalidInput`] naming the value, as the CLI flag (`--temp`, `--top-p`,
    /// `--min-p`) and the API field (`temperature`, `top_p`, `min_p`) name it.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |m: String| Err(crate::EngineError::InvalidInput(m));
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature {} must be a finite number ≥ 0 (0 = greedy)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1] (1 = off)", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p {} must be in [0, 1] (0 = off)", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} {v} must be in [-2, 2] (0 = off)"));
            }
        }
        // bounded so that dividing a logit by it stays finite (1e-39 made every logit infinite)
        let r = self.repetition_penalty;
        if !(0.01..=100.0).contains(&r) {
            return bad(format!(
                "repetition_penalty {r} must be in [0.01, 100] (1 = off)"
            ));
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return bad(format!(
                "logit_bias {b} for token {id} must be in [-100, 100]"
            ));
        }
        Ok(())
    }
}

/// One candidate token: its id, its tempered logit `v = logit / T` (f64) and `e = exp(v − max v)`.
#[derive(Clone, Copy, Debug, Default)]
struct Cand {
    id: u32,
    v: f64,
    e: f64,
}

/// The order the filters walk: descending tempered logit, ascending id on ties (a total order: ids are unique).
fn order(a: &Cand, b: &Cand) -> Ordering {
    b.v.total_cmp(&a.v).then(a.id.cmp(&b.id))
}

/// An unsigned key whose ascending order is the descending [`f64::total_cmp`] order of `v`.
fn desc_key(v: f64) -> u64 {
    let b = v.to_bits();
    let ascending = if b >> 63 == 1 { !b } else { b | (1 << 63) };
    !ascending
}

/// Tail terms are below `z × TAIL_FRACTION` (2⁻⁵⁷): under half an ulp of any sum ≥ z / 8 they are added to.
const TAIL_FRACTION: f64 = 1.0 / (1u64 << 57) as f64;

/// Bits per radix digit (6 passes cover the 64-bit key).
const RADIX_BITS: u32 = 11;

/// Below this many candidates a comparison sort is cheaper than the radix sort.
const RADIX_MIN: usize = 4096;

/// Buffers reused across tokens (each up to `[vocab]`).
#[derive(Default)]
struct Scratch {
    tail: Vec<Cand>,
    buf: Vec<Cand>,
    probs: Vec<f64>,
    counts: Vec<u32>,
}

/// A sampler holding its RNG (and buffers of `[vocab]` candidates reused across tokens).
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    cand: Vec<Cand>,
    scratch: Scratch,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .finish_non_exhaustive()
    }
}

/// Index of the largest value; the lowest index wins ties (`-0.0` ties `+0.0`); NaN never wins; 0 when no value is
/// above `-inf` (an empty slice included).
///
/// Two passes: the maximum over 16 interleaved lanes (`f32::max` skips NaN; the loop vectorizes, where a running
/// index does not), then the first index holding it. Over a 32k vocabulary about twice as fast as one branchy scan
/// (`bench local --profile`, sampling 24–26 → 12–13 µs per token, 3 alternations); a one-pass form keeping each
/// lane's first index was no faster (13–17 µs).
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let mut chunks = logits.chunks_exact(LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    let top = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if top == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&v| v == top).unwrap_or(0) as u32
}

/// The finite logits as candidates, in ascending id order, tempered in f64 (a tiny temperature must sharpen towards
/// greedy, not overflow f32).
fn candidates(logits: &[f32], temp: f64, out: &mut Vec<Cand>) {
    out.clear();
    out.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| Cand {
                id: i as u32,
                v: v as f64 / temp,
                e: 0.0,
            }),
    );
}

impl Sampler {
    /// A sampler for `params`, seeded with `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler {
            params,
            rng,
            cand: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from logits `[vocab]` f32. Non-finite logits are never chosen unless all are (then it is
    /// the argmax). Draws one number from the RNG per call unless greedy.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let temp = p.temperature as f64;
        let cand = &mut self.cand;
        candidates(logits, temp, cand);
        if cand.is_empty() {
            return argmax(logits);
        }
        let u = self.rng.random::<f64>();
        let s = &mut self.scratch;
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
            cand.sort_unstable_by(order);
            return draw_sorted(cand, p, u, &mut s.probs);
        }
        if let Some(id) = draw_head(cand, p, u, s) {
            return id;
        }
        candidates(logits, temp, cand);
        radix_sort(cand, s);
        draw_sorted(cand, p, u, &mut s.probs)
    }

    /// The distribution [`Sampler::sample`] draws from for `logits` `[vocab]` f32, into `out`: every id it can
    /// return, in the order its draw walks them (descending tempered logit, ascending id on ties), with probabilities
    /// summing to 1 (f64; each id's share of the kept total, so equal to its chance up to the rounding of the walk).
    /// Greedy, or no finite logit: the argmax alone, with probability 1. Draws nothing from the RNG.
    pub fn distribution(&mut self, logits: &[f32], out: &mut Distribution) {
        out.ids.clear();
        out.probs.clear();
        let p = &self.params;
        let cand = &mut self.cand;
        if p.temperature > 0.0 {
            candidates(logits, p.temperature as f64, cand);
        } else {
            cand.clear();
        }
        if cand.is_empty() {
            out.ids.push(argmax(logits));
            out.probs.push(1.0);
            return;
        }
        let s = &mut self.scratch;
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, order);
            cand.truncate(p.top_k);
            cand.sort_unstable_by(order);
        } else {
            radix_sort(cand, s);
        }
        let keep = kept_sorted(cand, p, &mut s.probs);
        let total: f64 = s.probs[..keep].iter().sum();
        out.ids.extend(cand[..keep].iter().map(|c| c.id));
        out.probs.extend(s.probs[..keep].iter().map(|&q| q / total));
    }

    /// One uniform draw in [0, 1) from the sampler's seeded RNG (the accept/reject rule of [`crate::spec`]).
    pub(crate) fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }
}

/// A distribution over token ids ([`Sampler::distribution`]): the ids with a chance above zero, most likely first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Distribution {
    ids: Vec<u32>,
    probs: Vec<f64>,
}

impl Distribution {
    /// The ids, in the sampler's order (descending tempered logit, ascending id on ties).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Their probabilities, aligned with [`Distribution::ids`] (f64, summing to 1 up to rounding).
    pub fn probs(&self) -> &[f64] {
        &self.probs
    }

    /// The probability of `id` (0 when it cannot be drawn); a linear search over the kept ids.
    pub fn prob(&self, id: u32) -> f64 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |at| self.probs[at])
    }
}

/// Sorts candidates given in ascending id order into [`order`]: a stable LSD radix sort on [`desc_key`], so ties keep
/// ascending ids; digits that all keys share are skipped. Small inputs use a comparison sort.
fn radix_sort(cand: &mut Vec<Cand>, s: &mut Scratch) {
    if cand.len() < RADIX_MIN {
        cand.sort_unstable_by(order);
        return;
    }
    let buckets = 1usize << RADIX_BITS;
    let passes = 64u32.div_ceil(RADIX_BITS) as usize;
    let digit =
        |c: &Cand, d: usize| ((desc_key(c.v) >> (d as u32 * RADIX_BITS)) as usize) & (buckets - 1);
    s.counts.clear();
    s.counts.resize(passes * buckets, 0);
    for c in cand.iter() {
        for d in 0..passes {
            s.counts[d * buckets + digit(c, d)] += 1;
        }
    }
    for d in 0..passes {
        let h = &mut s.counts[d * buckets..(d + 1) * buckets];
        if h.iter().any(|&n| n as usize == cand.len()) {
            continue; // every key has the same digit here
        }
        let mut at = 0;
        for n in h.iter_mut() {
            let c = *n;
            *n = at;
            at += c;
        }
        s.buf.clear();
        s.buf.resize(cand.len(), Cand::default());
        for c in cand.iter() {
            let b = digit(c, d);
            s.buf[h[b] as usize] = *c;
            h[b] += 1;
        }
        std::mem::swap(cand, &mut s.buf);
    }
}

/// The filters and the draw on candidates sorted by [`order`] (after any top-k cut), with uniform `u` in [0, 1).
fn draw_sorted(cand: &[Cand], p: &SamplingParams, u: f64, probs: &mut Vec<f64>) -> u32 {
    let keep = kept_sorted(cand, p, probs);
    let probs = &probs[..keep];
    let total: f64 = probs.iter().sum();
    let mut r = u * total;
    for (i, &q) in probs.iter().enumerate() {
        r -= q;
        if r <= 0.0 {
            return cand[i].id;
        }
    }
    cand[keep - 1].id
}

/// The softmax of candidates sorted by [`order`] into `probs` (normalized in that order) and how many of them the
/// top-p and min-p filters keep (≥ 1): the first stage of [`draw_sorted`].
fn kept_sorted(cand: &[Cand], p: &SamplingParams, probs: &mut Vec<f64>) -> usize {
    let m = cand[0].v;
    probs.clear();
    probs.extend(cand.iter().map(|c| (c.v - m).exp()));
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
    keep
}

/// Computes `e` for every candidate (given in ascending id order), moves the tail (`e < z × 2⁻⁵⁷`, with z = Σ e in
/// any order) to `tail` and keeps the head in `cand`, both still in id order. `None` unless every head logit is above
/// every tail logit (so that the sorted head followed by the sorted tail is the full order; true when `exp` is
/// monotonic, checked rather than assumed).
fn split_head(cand: &mut Vec<Cand>, tail: &mut Vec<Cand>) -> Option<()> {
    let max = |a: f64, b: f64| if b.total_cmp(&a).is_gt() { b } else { a };
    let min = |a: f64, b: f64| if b.total_cmp(&a).is_lt() { b } else { a };
    // The first candidate in `order`, as the full sort finds it.
    let m = cand.iter().map(|c| c.v).fold(f64::NEG_INFINITY, max);
    let mut z = 0.0;
    for c in cand.iter_mut() {
        c.e = (c.v - m).exp();
        z += c.e;
    }
    let tau = z * TAIL_FRACTION;
    tail.clear();
    let mut nh = 0;
    for i in 0..cand.len() {
        let c = cand[i];
        if c.e >= tau {
            cand[nh] = c;
            nh += 1;
        } else {
            tail.push(c);
        }
    }
    cand.truncate(nh);
    let lowest_head = cand.iter().map(|c| c.v).reduce(min)?;
    match tail.iter().map(|c| c.v).reduce(max) {
        Some(t) if t.total_cmp(&lowest_head).is_ge() => None,
        _ => Some(()),
    }
}

/// [`draw_sorted`] on candidates in ascending id order, sorting only the head (see the module doc); leaves the sorted
/// head in `cand`. `None` when the tail could matter: the caller then sorts everything and calls [`draw_sorted`] with
/// the same `u`.
fn draw_head(cand: &mut Vec<Cand>, p: &SamplingParams, u: f64, s: &mut Scratch) -> Option<u32> {
    let mut tail = std::mem::take(&mut s.tail);
    let r = split_head(cand, &mut tail).and_then(|()| {
        radix_sort(cand, s);
        draw_split(cand, &tail, p, u, &mut s.probs)
    });
    s.tail = tail;
    r
}

/// The filters and the draw on the sorted `head`, with the unsorted `tail` consulted only through checks that hold in
/// any order (see [`draw_head`]).
fn draw_split(
    head: &[Cand],
    tail: &[Cand],
    p: &SamplingParams,
    u: f64,
    probs: &mut Vec<f64>,
) -> Option<u32> {
    let nh = head.len();
    // The normalizer in sorted order: the head's sum, then each tail term, which must leave it unchanged.
    probs.clear();
    probs.extend(head.iter().map(|c| c.e));
    let z: f64 = probs.iter().sum();
    if !tail.iter().all(|c| z + c.e == z) {
        return None;
    }
    probs.iter_mut().for_each(|x| *x /= z);
    let tail_p = |c: &Cand| c.e / z;
    let mut keep = nh + tail.len();
    if p.top_p < 1.0 {
        let mut acc = 0.0;
        let mut cut = false;
        for (i, &q) in probs.iter().enumerate() {
            acc += q;
            if acc >= p.top_p as f64 {
                keep = i + 1;
                cut = true;
                break;
            }
        }
        // Not reached in the head: it is never reached if no tail term moves the running sum.
        if !cut && !tail.iter().all(|c| acc + tail_p(c) == acc) {
            return None;
        }
    }
    if p.min_p > 0.0 {
        let thr = probs[0] * p.min_p as f64;
        let n = probs.iter().take_while(|&&q| q >= thr).count();
        // All of the head passes: the count goes on into the tail unless no tail term passes.
        if n == nh && tail.iter().any(|c| tail_p(c) >= thr) {
            return None;
        }
        keep = keep.min(n.max(1));
    }
    // keep ≤ nh, or keep = every candidate (no filter cut anything).
    let kh = keep.min(nh);
    let total: f64 = probs[..kh].iter().sum();
    if keep > nh && !tail.iter().all(|c| total + tail_p(c) == total) {
        return None;
    }
    let mut r = u * total;
    for (i, &q) in probs[..kh].iter().enumerate() {
        r -= q;
        if r <= 0.0 {
            return Some(head[i].id);
        }
    }
    if keep > nh {
        return None; // the draw goes on into the tail, which needs its order
    }
    Some(head[kh - 1].id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_values_without_a_meaning_are_invalid_input() {
        let p = |temperature: f32, top_p: f32, min_p: f32| SamplingParams {
            temperature,
            top_p,
            min_p,
            ..SamplingParams::default()
        };
        for ok in [p(0.0, 1.0, 0.0), p(2.5, 1e-6, 1.0), p(1e30, 0.5, 0.5)] {
            assert!(ok.validate().is_ok(), "{ok:?}");
        }
        for (bad, field) in [
            (p(f32::NAN, 1.0, 0.0), "temperature"),
            (p(-0.1, 1.0, 0.0), "temperature"),
            (p(f32::INFINITY, 1.0, 0.0), "temperature"),
            (p(1.0, 0.0, 0.0), "top_p"),
            (p(1.0, 1.01, 0.0), "top_p"),
            (p(1.0, f32::NAN, 0.0), "top_p"),
            (p(1.0, 1.0, -0.01), "min_p"),
            (p(1.0, 1.0, f32::NAN), "min_p"),
        ] {
            match bad.validate() {
                Err(crate::EngineError::InvalidInput(m)) => assert!(m.starts_with(field), "{m}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn greedy_takes_the_argmax_and_the_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 3.0, -1.0, 3.0]), 1);
    }

    /// The one-pass definition: the first index whose value is above every earlier one's.
    fn argmax_by_scan(logits: &[f32]) -> u32 {
        let (mut best, mut bv) = (0usize, f32::NEG_INFINITY);
        for (i, &v) in logits.iter().enumerate() {
            if v > bv {
                (best, bv) = (i, v);
            }
        }
        best as u32
    }

    #[test]
    fn argmax_matches_the_scan_on_ties_nan_infinities_signed_zeros_and_every_length() {
        let cases: Vec<Vec<f32>> = vec![
            vec![],
            vec![f32::NAN],
            vec![f32::NAN, f32::NEG_INFINITY, 2.0],
            vec![f32::NEG_INFINITY; 40],
            vec![-0.0, 0.0, -1.0],
            vec![0.0, -0.0],
            vec![1.0, f32::INFINITY, f32::NAN, f32::INFINITY],
        ];
        for c in &cases {
            assert_eq!(argmax(c), argmax_by_scan(c), "{c:?}");
        }
        // Every length around the 16 lanes, the maximum (repeated, with NaN around it) at every position.
        let mut r = StdRng::seed_from_u64(3);
        for n in 1..70usize {
            for at in 0..n {
                let mut v: Vec<f32> = (0..n).map(|_| r.random_range(-5.0f32..5.0)).collect();
                v[at] = 9.0;
                v[(at * 7 + 3) % n] = 9.0;
                v[(at * 5 + 1) % n] = f32::NAN;
                assert_eq!(argmax(&v), argmax_by_scan(&v), "n {n} at {at}");
            }
        }
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

    /// The sampler as it was before the partial sort (full sort every token), kept verbatim as the reference.
    fn full_sort_reference(p: &SamplingParams, rng: &mut StdRng, logits: &[f32]) -> u32 {
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
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
        let mut r = rng.random::<f64>() * total;
        for (i, &q) in probs.iter().enumerate() {
            r -= q;
            if r <= 0.0 {
                return cand[i].0;
            }
        }
        cand[keep - 1].0
    }

    /// Random logits of one of several shapes: flat, wide, peaked, coarsely quantized (many exact ties), all equal,
    /// with -inf, NaN, +inf and very negative entries mixed in.
    fn random_logits(g: &mut StdRng, n: usize) -> Vec<f32> {
        let scale = [0.01f32, 0.5, 3.0, 20.0, 200.0][g.random_range(0..5)];
        let shape = g.random_range(0..5);
        let mut l: Vec<f32> = (0..n)
            .map(|_| {
                let x = (g.random::<f32>() - 0.5) * 2.0 * scale;
                match shape {
                    1 => (x / scale).round() * scale.min(1.0), // ties
                    2 => 1.5,                                  // all equal
                    _ => x,
                }
            })
            .collect();
        if shape == 3 {
            for _ in 0..g.random_range(1..4) {
                l[g.random_range(0..n)] = scale * 4.0; // spikes
            }
        }
        if g.random_bool(0.4) {
            for _ in 0..g.random_range(1..=n.div_ceil(4)) {
                let i = g.random_range(0..n);
                l[i] = match g.random_range(0..6) {
                    0 => f32::NEG_INFINITY,
                    1 => f32::NAN,
                    2 => f32::INFINITY,
                    3 => -f32::MAX,
                    4 => -1e30,
                    _ => -60.0,
                };
            }
        }
        l
    }

    fn random_params(g: &mut StdRng, n: usize) -> SamplingParams {
        let top_ks = [0, 0, 0, 1, 2, 5, 40, n.saturating_sub(1), n, n + 3];
        SamplingParams {
            temperature: [1e-40, 1e-3, 0.3, 0.7, 1.0, 1.5, 10.0, 1e6][g.random_range(0..8)],
            top_k: top_ks[g.random_range(0..top_ks.len())],
            top_p: [1.0, 1.0, 0.999_999_94, 0.999, 0.95, 0.9, 0.5, 0.1, 1e-7][g.random_range(0..9)],
            min_p: [0.0, 0.0, 1e-30, 1e-12, 1e-3, 0.05, 0.5, 1.0][g.random_range(0..8)],
            seed: g.random(),
            ..Default::default()
        }
    }

    /// Eight draws of the sampler and of the reference from the same seed give the same tokens.
    fn assert_same_draws(p: &SamplingParams, l: &[f32]) {
        let mut s = Sampler::new(p.clone());
        let mut rng = StdRng::seed_from_u64(p.seed);
        let got: Vec<u32> = (0..8).map(|_| s.sample(l)).collect();
        let want: Vec<u32> = (0..8)
            .map(|_| full_sort_reference(p, &mut rng, l))
            .collect();
        assert_eq!(got, want, "{p:?} on {} logits", l.len());
    }

    #[test]
    fn the_partial_sort_picks_the_tokens_of_the_full_sort_on_random_logits_and_settings() {
        let mut g = StdRng::seed_from_u64(0x5eed);
        for case in 0..3000 {
            let n = [1, 2, 3, 7, 50, 300, 2000, 5000][case % 8];
            let l = random_logits(&mut g, n);
            let p = random_params(&mut g, n);
            assert_same_draws(&p, &l);
        }
    }

    #[test]
    fn the_partial_sort_picks_the_tokens_of_the_full_sort_on_a_full_vocabulary() {
        let mut g = StdRng::seed_from_u64(248_320);
        let n = 248_320;
        for _ in 0..12 {
            let l = random_logits(&mut g, n);
            for _ in 0..4 {
                assert_same_draws(&random_params(&mut g, n), &l);
            }
        }
    }

    #[test]
    fn ties_and_non_finite_logits_are_ordered_as_the_full_sort_orders_them() {
        let l = [
            f32::NEG_INFINITY,
            2.0,
            f32::NAN,
            2.0,
            -1e30,
            2.0,
            f32::INFINITY,
            1.0,
            -0.0,
            0.0,
        ];
        for (top_k, top_p, min_p) in [(0, 1.0, 0.0), (2, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.9)] {
            for seed in 0..50 {
                let p = SamplingParams {
                    temperature: 1.0,
                    top_k,
                    top_p,
                    min_p,
                    seed,
                    ..Default::default()
                };
                assert_same_draws(&p, &l);
            }
        }
        // only non-finite logits: the argmax, as before (+inf wins; NaN and -inf never beat the start, so id 0)
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[f32::NAN, f32::NEG_INFINITY, f32::INFINITY]), 2);
        assert_eq!(
            s.sample(&[f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY]),
            0
        );
        assert_same_draws(&s.params().clone(), &[f32::NAN, f32::NEG_INFINITY]);
    }

    fn cands(l: &[f32], temp: f64) -> Vec<Cand> {
        l.iter()
            .enumerate()
            .map(|(i, &v)| Cand {
                id: i as u32,
                v: v as f64 / temp,
                e: 0.0,
            })
            .collect()
    }

    #[test]
    fn a_peaked_distribution_sorts_only_its_head_and_decides_without_the_tail() {
        // one clear winner 60 nats above a flat bulk of 100k tokens: the bulk is tail
        let mut l = vec![0.0f32; 100_000];
        l[777] = 60.0;
        l[778] = 59.0;
        let mut c = cands(&l, 1.0);
        let mut tail = Vec::new();
        assert_eq!(split_head(&mut c, &mut tail), Some(()));
        assert_eq!((c.len(), tail.len()), (2, 99_998));
        let p = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            ..Default::default()
        };
        let mut c = cands(&l, 1.0);
        assert_eq!(
            draw_head(&mut c, &p, 0.5, &mut Scratch::default()),
            Some(777)
        );
        assert_same_draws(&p, &l);
        // no filter at all: the tail terms still leave the total unchanged
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut c = cands(&l, 1.0);
        assert_eq!(
            draw_head(&mut c, &p, 0.99, &mut Scratch::default()),
            Some(778)
        );
        assert_same_draws(&p, &l);
    }

    #[test]
    fn a_tail_that_could_matter_falls_back_to_the_full_sort() {
        let mut l = vec![0.0f32; 1000];
        l[3] = 60.0;
        // min-p so small that tail tokens pass it: the count would run into the tail
        let p = SamplingParams {
            temperature: 1.0,
            min_p: 1e-30,
            ..Default::default()
        };
        let mut c = cands(&l, 1.0);
        assert_eq!(draw_head(&mut c, &p, 0.5, &mut Scratch::default()), None);
        assert_same_draws(&p, &l);
        // a draw past the whole head needs the tail's order: with these four head logits and u just below 1 the
        // rounded running difference stays above 0 (found by search; 1.2e-17 is left)
        let mut l = vec![-60.0f32; 1000];
        l[3..7].copy_from_slice(&[0.0, -0.3, -1.6, -4.1]);
        let p = SamplingParams {
            temperature: 1.0,
            ..Default::default()
        };
        let mut c = cands(&l, 1.0);
        assert_eq!(split_head(&mut c, &mut Vec::new()), Some(()));
        assert_eq!(c.len(), 4);
        let mut c = cands(&l, 1.0);
        assert_eq!(
            draw_head(
                &mut c,
                &p,
                1.0 - f64::EPSILON / 2.0,
                &mut Scratch::default()
            ),
            None
        );
    }

    #[test]
    fn the_radix_sort_orders_like_the_comparison_sort() {
        let mut g = StdRng::seed_from_u64(9);
        let mut s = Scratch::default();
        for n in [RADIX_MIN, 20_000, 248_320] {
            for _ in 0..3 {
                let mut l = random_logits(&mut g, n);
                l[0] = -0.0;
                l[1] = 0.0;
                l[2] = f32::MAX;
                l[3] = -f32::MAX;
                let mut got = cands(&l, 0.7);
                got.retain(|c| c.v.is_finite());
                let mut want = got.clone();
                want.sort_unstable_by(order);
                radix_sort(&mut got, &mut s);
                let ids = |v: &[Cand]| v.iter().map(|c| c.id).collect::<Vec<_>>();
                assert_eq!(ids(&got), ids(&want));
            }
        }
    }
}
