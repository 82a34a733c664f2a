//! Small portable vector helpers written so that LLVM auto-vectorizes them.
//!
//! Float addition is not associative, so the compiler never reorders a plain sequential sum; [`dot`] keeps
//! `LANES` independent partial sums (fixed order, so results are deterministic) which maps onto SIMD
//! registers. The others are element-wise and vectorize as written.

/// Number of independent accumulators in [`dot`] (two AVX registers of f32).
const LANES: usize = 16;

/// `Σ a[i]·b[i]` with `LANES` interleaved partial sums, reduced pairwise at the end.
///
/// Panics (debug) if the lengths differ; in release the shorter length is used.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    for (l, (x, y)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        acc[l] += x * y;
    }
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `Σ x[i]` with `LANES` interleaved partial sums (same reduction tree as [`dot`]).
#[inline]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut c = x.chunks_exact(LANES);
    for v in &mut c {
        for l in 0..LANES {
            acc[l] += v[l];
        }
    }
    for (l, v) in c.remainder().iter().enumerate() {
        acc[l] += v;
    }
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `max x[i]` (`-inf` for an empty slice), with `LANES` interleaved partial maxima. Exact whatever the
/// order (max is associative); the lanes only break the dependency chain.
#[inline]
pub(crate) fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut c = x.chunks_exact(LANES);
    for v in &mut c {
        for l in 0..LANES {
            acc[l] = acc[l].max(v[l]);
        }
    }
    for (l, v) in c.remainder().iter().enumerate() {
        acc[l] = acc[l].max(*v);
    }
    acc.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b))
}

/// `y[i] += a·x[i]`.
#[inline]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// `y[i] = s·y[i] + a·x[i]`.
#[inline]
pub(crate) fn scale_axpy(y: &mut [f32], s: f32, a: f32, x: &[f32]) {
    debug_assert_eq!(x.len(), y.len());
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = s * *yi + a * xi;
    }
}

/// `y[i] *= s`.
#[inline]
pub(crate) fn scale(y: &mut [f32], s: f32) {
    for yi in y.iter_mut() {
        *yi *= s;
    }
}

/// `e^x` in f32 from plain IEEE operations only (no libm call, no fused multiply-add), so that loops over
/// it vectorize and give the same bits at every vector width.
///
/// Cody–Waite reduction `x = n·ln2 + r`, `|r| <= ln2/2`, with the degree-6 minimax polynomial of Cephes
/// `expf` for `e^r` (relative error about 1e-7, i.e. within ~2 ulp of the correctly rounded value), then
/// scaling by `2^n` through the exponent bits. Accurate on `[-87.3, 88]`; returns exactly 0 for
/// `x < -87.3` (below the smallest normal result) and clamps `x > 88` to 88. The kernels only call it with
/// `x <= 0`. Not for NaN inputs (the result is unspecified).
#[inline(always)]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const MAGIC: f32 = 12_582_912.0; // 1.5·2^23: adding it rounds to an integer (ties to even).
    const LO: f32 = -87.336_55;
    const HI: f32 = 88.0;
    let xc = x.clamp(LO, HI);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.000_000_1e-1;
    let y = p * (r * r) + r + 1.0;
    // n is in [-126, 127] and t's low mantissa bits hold it (t's ulp is 1): 2^n from the exponent field.
    let ni = t.to_bits().wrapping_sub(MAGIC.to_bits());
    let e = f32::from_bits(ni.wrapping_add(127) << 23);
    let out = y * e;
    if x < LO {
        0.0
    } else {
        out
    }
}

/// Runs `f` compiled for the widest x86-64 vector extension the CPU has (AVX-512F, else AVX2, else the
/// baseline), by inlining it into a `#[target_feature]` function.
///
/// Only the vector width changes: Rust never fuses `a * b + c` into an FMA and never reorders float
/// operations, so every path gives bit-identical results.
#[inline(always)]
pub(crate) fn dispatch<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F (checked just above).
            return unsafe { with_avx512(f) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { with_avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn with_avx512<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// SiLU `x·σ(x) = x / (1 + e^{-x})` in f32.
#[inline]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_equals_the_plain_sum_for_small_integers() {
        let a: Vec<f32> = (0..37).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..37).map(|i| (i % 5) as f32).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert_eq!(dot(&a, &b), want);
        assert_eq!(dot(&[], &[]), 0.0);
        assert_eq!(sum(&b), b.iter().sum::<f32>());
        assert_eq!(max(&b), 4.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }

    #[test]
    fn axpy_and_scale_axpy_compute_elementwise() {
        let mut y = vec![1.0, 2.0, 3.0];
        axpy(&mut y, 2.0, &[1.0, 1.0, 0.5]);
        assert_eq!(y, vec![3.0, 4.0, 4.0]);
        scale_axpy(&mut y, 0.5, 1.0, &[1.0, 0.0, -1.0]);
        assert_eq!(y, vec![2.5, 2.0, 1.0]);
        scale(&mut y, 2.0);
        assert_eq!(y, vec![5.0, 4.0, 2.0]);
        assert_eq!(silu(0.0), 0.0);
    }

    #[test]
    fn exp_fast_is_within_two_ulp_of_the_exact_exponential() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = exp_fast(x) as f64;
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            assert!((got - want).abs() <= 2.0 * ulp, "exp({x}) = {got} vs {want}");
            x += 0.001_37;
        }
        assert_eq!(exp_fast(0.0), 1.0);
        assert_eq!(exp_fast(-100.0), 0.0);
        assert_eq!(exp_fast(f32::NEG_INFINITY), 0.0);
        assert!(exp_fast(88.0).is_finite());
    }

    #[test]
    fn dispatch_gives_the_same_bits_as_the_baseline_build() {
        let a: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.11).cos() - 0.5).collect();
        let run = || {
            let mut y = b.clone();
            scale_axpy(&mut y, 0.9, 1.3, &a);
            let e: Vec<f32> = a.iter().map(|x| exp_fast(x * 10.0)).collect();
            (dot(&a, &b).to_bits(), y, e)
        };
        let wide = dispatch(run);
        let base = run();
        assert_eq!(wide.0, base.0);
        assert_eq!(wide.1, base.1);
        assert_eq!(wide.2, base.2);
    }
}
