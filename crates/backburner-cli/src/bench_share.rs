//! The decode's share of the read bandwidth, measured in alternation with the bandwidth itself.
//!
//! The machines we bench on drift by ±20–30 % within minutes and, with two threads, a read pass moves between 26 and
//! 50 GB/s a few seconds apart; a share computed from one pass at the start of a run and a decode timed a minute
//! later mostly measures that drift. Here the decode and the read take turns: a read, a round of a few decode tokens,
//! a read, a round, …, a read. Each read is the best of [`PASS_REPEATS`] back-to-back plain reads (the widest vector
//! loads, each thread a contiguous share) of the model's own weight matrices: the very memory the products stream,
//! with its pages, its placement and whatever of it the last-level cache keeps between tokens, so none of these
//! favours either side. Each round's share is its bytes per second over the mean of the reads just before and after
//! it, and the report is the median over rounds, like every other ratio in docs/BENCHMARKS.md.

use std::time::Instant;

use anyhow::Result;
use backburner_engine::{argmax, ComputePool, Session};
use backburner_kernels::parallel::read_sum_slices;
use backburner_kernels::profile::{self, Op};
use backburner_model::Model;
use serde::Serialize;

/// Plain reads per pass, back to back; the pass reports the fastest.
pub const PASS_REPEATS: usize = 3;
/// Rounds of decode between passes (odd, so the median is one round's share).
pub const ROUNDS: usize = 7;
/// Decode tokens per round.
pub const TOKENS_PER_ROUND: usize = 8;

/// The paired measurement of one depth.
#[derive(Clone, Debug, Serialize)]
pub struct PairedShare {
    /// Rounds of decode, each between two passes.
    pub rounds: usize,
    /// Decode tokens per round.
    pub tokens_per_round: usize,
    /// Median of the passes' read bandwidth, GB/s (each the best of [`PASS_REPEATS`] reads of the weights with the
    /// run's threads).
    pub pass_gb_s: f64,
    /// Median over rounds of the bytes a decode step reads (weights, KV cache, states) per second, GB/s.
    pub decode_read_gb_s: f64,
    /// Median over rounds of the round's decode read GB/s over the mean of its two neighbouring passes (a fraction; a
    /// round can pass 1 when a read beside it ran at a slow moment).
    pub read_share: f64,
    /// The same for the weights' bytes alone (`read_share` × weight bytes ÷ all the bytes a step reads).
    pub weight_share: f64,
    /// Each round's share (all bytes), in the order run.
    pub round_shares: Vec<f64>,
}

impl PairedShare {
    /// One line for the text report.
    pub fn summary(&self) -> String {
        let (lo, hi) = self
            .round_shares
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(l, h), &x| (l.min(x), h.max(x)));
        format!(
            "in alternation with reads of the weights ({} rounds of {} tokens): decode with KV and state {:.1} GB/s, \
             reads {:.1} GB/s, share {:.0}% (weights alone {:.0}%; median; rounds {:.0}-{:.0}%)",
            self.rounds,
            self.tokens_per_round,
            self.decode_read_gb_s,
            self.pass_gb_s,
            100.0 * self.read_share,
            100.0 * self.weight_share,
            100.0 * lo,
            100.0 * hi
        )
    }
}

/// Plain reads of a model's weight matrices ([`Model::weight_storage`]).
pub struct WeightPass<'m> {
    slices: Vec<&'m [u8]>,
    bytes: usize,
}

impl<'m> WeightPass<'m> {
    /// Reads of `model`'s weight matrices.
    pub fn new(model: &'m Model) -> Self {
        let slices = model.weight_storage();
        let bytes = slices.iter().map(|s| s.len()).sum();
        WeightPass { slices, bytes }
    }

    /// The fastest of [`PASS_REPEATS`] back-to-back reads of every weight byte with `pool`'s threads (each reading
    /// a contiguous share of every matrix: [`read_sum_slices`]), bytes per second.
    pub fn pass(&self, pool: &ComputePool) -> f64 {
        crate::bench_report::fastest_rate(self.bytes, PASS_REPEATS, || {
            pool.install(|| read_sum_slices(&self.slices))
        })
    }
}

/// Runs [`ROUNDS`] rounds of `round` (which decodes [`TOKENS_PER_ROUND`] tokens and returns the seconds they took,
/// leaving the session as it found it) between calls of `pass` (one read pass, bytes/s, e.g. [`WeightPass::pass`]),
/// and returns the medians. `bytes_per_token` is what one decode step reads (weights, KV cache at this depth,
/// states), of which `weight_bytes_per_token` weights.
///
/// Errors: whatever `round` returns.
pub fn measure(
    mut pass: impl FnMut() -> f64,
    bytes_per_token: u64,
    weight_bytes_per_token: u64,
    mut round: impl FnMut(usize) -> Result<f64>,
) -> Result<PairedShare> {
    let mut passes = vec![pass()];
    let mut decode = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let secs = round(TOKENS_PER_ROUND)?;
        decode.push((TOKENS_PER_ROUND as f64 * bytes_per_token as f64) / secs.max(1e-9));
        passes.push(pass());
    }
    let mut p = summarize(&passes, &decode);
    p.weight_share =
        p.read_share * weight_bytes_per_token as f64 / (bytes_per_token as f64).max(1.0);
    Ok(p)
}

/// The medians of `passes` (`ROUNDS + 1` pass rates, bytes/s) around `decode` (one rate per round, bytes/s): round
/// `i` lies between passes `i` and `i + 1`. `weight_share` is left NaN (the caller knows the weights' part).
fn summarize(passes: &[f64], decode: &[f64]) -> PairedShare {
    debug_assert_eq!(passes.len(), decode.len() + 1);
    let round_shares: Vec<f64> = decode
        .iter()
        .enumerate()
        .map(|(i, d)| d / ((passes[i] + passes[i + 1]) / 2.0))
        .collect();
    PairedShare {
        rounds: decode.len(),
        tokens_per_round: TOKENS_PER_ROUND,
        pass_gb_s: median(passes) / 1e9,
        decode_read_gb_s: median(decode) / 1e9,
        read_share: median(&round_shares),
        weight_share: f64::NAN,
        round_shares,
    }
}

/// The decode's bandwidth share at the session's depth, in alternation with `reads`
/// ([`measure`]) for a step reading `(all, weight)` bytes: each round decodes from `first` and rewinds to
/// `snap`. Not profiled.
pub fn decode_share(
    s: &mut Session,
    pool: &ComputePool,
    reads: &WeightPass<'_>,
    first: u32,
    snap: &backburner_model::StateSnapshot,
    (bytes_per_token, weight_bytes_per_token): (u64, u64),
) -> Result<PairedShare> {
    let was = profile::enabled();
    profile::set_enabled(false);
    let r = measure(
        || reads.pass(pool),
        bytes_per_token,
        weight_bytes_per_token,
        |n| {
            let secs = decode_greedy(s, first, n)?;
            s.rewind(snap);
            Ok(secs)
        },
    );
    profile::set_enabled(was);
    r
}

/// Decodes `n` greedy tokens from `first` on the session's compute pool (as `generate` runs the token loop) and
/// returns the seconds they took; the argmax is charged to [`Op::Sampling`] when profiling.
///
/// Errors: a decode step's.
pub fn decode_greedy(s: &mut Session, first: u32, n: usize) -> Result<f64> {
    let mut tok = first;
    let t = Instant::now();
    s.in_pool(|s| -> Result<()> {
        for _ in 0..n {
            let l = s.decode(tok)?;
            let _g = profile::scope(Op::Sampling);
            tok = argmax(&l);
        }
        Ok(())
    })?;
    Ok(t.elapsed().as_secs_f64())
}

/// Median of `xs` (the mean of the middle two for an even count; NaN for none).
fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_round_is_divided_by_the_mean_of_its_two_passes_and_the_median_is_reported() {
        // Passes 20, 30, 10, 40 GB/s around rounds of 20, 10, 30 GB/s: shares 20/25, 10/20, 30/25.
        let p = summarize(&[20e9, 30e9, 10e9, 40e9], &[20e9, 10e9, 30e9]);
        assert_eq!(p.rounds, 3);
        assert_eq!(p.round_shares, vec![0.8, 0.5, 1.2]);
        assert_eq!(p.read_share, 0.8);
        assert_eq!(p.pass_gb_s, 25.0);
        assert_eq!(p.decode_read_gb_s, 20.0);
    }

    #[test]
    fn median_of_odd_even_and_empty_lists() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn measure_alternates_passes_and_rounds_starting_and_ending_with_a_pass() {
        let log = std::cell::RefCell::new(String::new());
        let mut rate = 0.0;
        let p = measure(
            || {
                log.borrow_mut().push('P');
                rate += 10e9;
                rate
            },
            1_000_000_000,
            750_000_000,
            |n| {
                log.borrow_mut().push('R');
                assert_eq!(n, TOKENS_PER_ROUND);
                Ok(0.5)
            },
        )
        .unwrap();
        assert_eq!(log.into_inner(), format!("P{}", "RP".repeat(ROUNDS)));
        // 8 tokens × 1 GB in 0.5 s = 16 GB/s in every round; passes 10, 20, …, 80 GB/s: round i's share is
        // 16 / (10i + 15).
        assert_eq!(p.decode_read_gb_s, 16.0);
        assert_eq!(p.pass_gb_s, 45.0);
        let want: Vec<f64> = (0..ROUNDS)
            .map(|i| 16e9 / ((10e9 * i as f64) + 15e9))
            .collect();
        assert_eq!(p.round_shares, want);
        assert_eq!(p.read_share, want[ROUNDS / 2]);
        assert_eq!(p.weight_share, 0.75 * want[ROUNDS / 2]);
    }

    #[test]
    fn a_failing_round_is_the_error() {
        let e = measure(|| 1e9, 1, 1, |_| anyhow::bail!("worker gone")).unwrap_err();
        assert_eq!(e.to_string(), "worker gone");
    }
}
