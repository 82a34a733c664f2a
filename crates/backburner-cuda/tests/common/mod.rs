//! Helpers of the GPU tests: the device (or a skip), random data, comparisons.
#![allow(dead_code)]

use std::sync::Arc;

use backburner_cuda::{CudaBackend, CudaProvider};
use backburner_model::device::{Backend, Buf, CpuBackend, Provider};
use backburner_model::linear::{Linear, LinearFormat};

/// The first CUDA device, or `None` after printing one `skipped:` line when this machine has none.
/// Panics when a device exists but does not open (a real failure).
pub fn gpu(test: &str) -> Option<Arc<CudaBackend>> {
    if let Some(why) = CudaProvider.unavailable() {
        println!("skipped: {test}: no CUDA device ({why})");
        return None;
    }
    Some(Arc::new(
        CudaBackend::open(0).unwrap_or_else(|e| panic!("opening cuda:0: {e}")),
    ))
}

/// Deterministic values in `[-scale, scale)`.
pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// A buffer's contents on the host.
pub fn host(be: &dyn Backend, b: &Buf) -> Vec<f32> {
    let mut v = vec![0.0; b.len()];
    be.download(b, &mut v).unwrap();
    v
}

/// Uploads `v` to both backends.
pub fn both(g: &CudaBackend, v: &[f32]) -> (Buf, Buf) {
    (g.upload(v).unwrap(), CpuBackend.upload(v).unwrap())
}

/// Asserts `|got − want| ≤ atol + rtol·|want|` element-wise (equal lengths), naming the first failure.
pub fn close(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= atol + rtol * w.abs() || (g.is_nan() && w.is_nan()) || g == w;
        assert!(
            ok,
            "{what}[{i}]: got {g}, want {w} (rtol {rtol}, atol {atol})"
        );
    }
}

/// Asserts `max|got − want| ≤ rel·max|want|` (errors relative to the output's scale).
pub fn close_scaled(what: &str, got: &[f32], want: &[f32], rel: f32) {
    close(what, got, want, 0.0, rel * max_abs(want));
}

/// The largest absolute value.
pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Products of 1..=4 rows (GEMV) and of 9 and 70 rows (cuBLAS) for `w`, against the CPU.
pub fn check_products(g: &CudaBackend, w: &Linear, what: &str) {
    let c = CpuBackend;
    let (n, k) = (w.out_features(), w.in_features());
    let (wg, wc) = (g.upload_matrix(w).unwrap(), c.upload_matrix(w).unwrap());
    assert_eq!((wg.n, wg.k), (n, k));
    for rows in [1, 2, 3, 4, 9, 70] {
        let (x, xc) = both(g, &rand_vec(rows * k, rows as u64, 1.0));
        let (mut y, mut yc) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
        g.matmul(&x, rows, &wg, &mut y).unwrap();
        c.matmul(&xc, rows, &wc, &mut yc).unwrap();
        let want = host(&c, &yc);
        // GEMV in f32 (the CPU quantizes x to 8 bits for block formats); cuBLAS with x and weights in bf16
        let quant = !matches!(w.format(), LinearFormat::Dense(_));
        let rel = if rows <= 4 && !quant { 1e-3 } else { 2e-2 };
        close(
            &format!("{what} × {rows} rows"),
            &host(g, &y),
            &want,
            0.0,
            rel * max_abs(&want),
        );
    }
    let ids = [0u32, (n - 1) as u32, (n / 2) as u32, 0];
    let (mut e, mut ec) = (g.zeros(0).unwrap(), c.zeros(0).unwrap());
    g.embed(&wg, &ids, &mut e).unwrap();
    c.embed(&wc, &ids, &mut ec).unwrap();
    close(
        &format!("{what} embed"),
        &host(g, &e),
        &host(&c, &ec),
        0.0,
        0.0,
    );
}
