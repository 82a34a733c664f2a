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
}
