//! Shared helpers of the integration tests: seeded random tensors and tolerance checks.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A seeded RNG, so every failure reproduces.
pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// `n` values uniform in `[lo, hi)`.
pub fn uniform(rng: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(lo..hi)).collect()
}

/// L2-normalizes every row of length `dim` in place and multiplies it by `scale`.
pub fn l2norm_rows(x: &mut [f32], dim: usize, scale: f32) {
    for row in x.chunks_exact_mut(dim) {
        let n = row.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
        for v in row.iter_mut() {
            *v *= scale / n;
        }
    }
}

/// Largest absolute value (at least `f32::MIN_POSITIVE`).
pub fn max_abs(x: &[f32]) -> f32 {
    x.iter().fold(f32::MIN_POSITIVE, |a, b| a.max(b.abs()))
}

/// Largest absolute difference.
pub fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Asserts `max |got − want| <= rel · max |want|` and returns the relative error seen.
pub fn assert_close_rel(what: &str, got: &[f32], want: &[f32], rel: f32) -> f32 {
    let err = max_diff(got, want) / max_abs(want);
    assert!(
        err <= rel,
        "{what}: max error {err:e} relative to the output scale exceeds {rel:e}"
    );
    err
}

/// Bit patterns, for exact comparisons that also distinguish -0.0 and NaN payloads.
pub fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}
