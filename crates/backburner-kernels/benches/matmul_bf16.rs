//! The dense product at the 27B's MLP shapes (m = 512 rows; gate|up: k = 5120, n = 17408; down: k = 17408, n = 5120)
//! with bf16 weights, in the f32 arithmetic and in the bf16-activation one, at 1 and 2 threads. Runs alternate
//! (f32, bf16, f32, bf16, ...) so that both see the same machine state; each figure is the median of `REPS` runs, in
//! GFLOP/s (2·m·n·k per product).
//!
//! Decode (one row, bandwidth-bound) is reported too, as the weights' bytes read per second (the matrices are far
//! larger than the caches), from 8 products per run.
//!
//! `cargo bench -p backburner-kernels --bench matmul_bf16 [-- REPS [SHAPE]]` (SHAPE: `gate_up` or `down`).

use std::time::Instant;

use backburner_kernels::matmul::{
    bf16_kernel_isa, matmul, PackedMatrix, Precision, RowMajor, WeightDtype,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;

/// (name, n, k).
const SHAPES: [(&str, usize, usize); 2] = [("gate_up", 17408, 5120), ("down", 5120, 17408)];
const M: usize = 512;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let reps: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(5);
    let only = args.get(1).cloned();
    println!("bf16-activation kernel: {}", bf16_kernel_isa());
    let mut r = StdRng::seed_from_u64(3);
    for (name, n, k) in SHAPES {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let bytes = common::random_bf16(&mut r, n, k);
        let part = RowMajor {
            dtype: WeightDtype::Bf16,
            bytes: &bytes,
            rows: n,
        };
        let ws: Vec<PackedMatrix> = [Precision::F32, Precision::Bf16]
            .iter()
            .map(|&p| PackedMatrix::pack_with(k, &[part], WeightDtype::Bf16, p).unwrap())
            .collect();
        drop(bytes);
        let x: Vec<f32> = (0..M * k).map(|_| r.random_range(-1.0f32..1.0)).collect();
        let mut y = vec![0.0f32; M * n];
        let flop = 2.0 * (M * n * k) as f64;
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut times = [Vec::new(), Vec::new()];
            pool.install(|| {
                // one warm-up run each, then alternate
                for w in &ws {
                    matmul(&x, M, w, &mut y);
                }
                for _ in 0..reps {
                    for (t, w) in times.iter_mut().zip(&ws) {
                        let s = Instant::now();
                        matmul(&x, M, w, &mut y);
                        t.push(s.elapsed().as_secs_f64());
                    }
                }
            });
            let [a, b] = times.map(|t| flop / median(t) / 1e9);
            println!(
                "{name} m={M} n={n} k={k} t{threads}: f32 {a:.1} GFLOP/s, bf16-acts {b:.1} GFLOP/s, x{:.2}",
                b / a
            );
            let mut times = [Vec::new(), Vec::new()];
            pool.install(|| {
                for _ in 0..reps {
                    for (t, w) in times.iter_mut().zip(&ws) {
                        let s = Instant::now();
                        for _ in 0..8 {
                            matmul(&x[..k], 1, w, &mut y[..n]);
                        }
                        t.push(s.elapsed().as_secs_f64() / 8.0);
                    }
                }
            });
            let [a, b] = times.map(|t| (n * k * 2) as f64 / median(t) / 1e9);
            println!("{name} decode (1 row) t{threads}: f32 {a:.1} GB/s, bf16-acts {b:.1} GB/s");
        }
    }
}
