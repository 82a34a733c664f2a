//! candle's f32 matmul (the `gemm` crate, what the model used before the packed kernels) at the shapes of
//! `benches/matmul.rs`, for a side-by-side comparison in one run:
//!
//! `cargo bench -p backburner-kernels --features compare-candle --bench matmul_vs_candle`
//! (candle's gemm sizes its threads from `RAYON_NUM_THREADS`, set here per thread count).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;

fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

const SHAPES: [(&str, usize, usize); 2] = [("gate_up", 6144, 1024), ("down", 1024, 3072)];

fn bench(c: &mut Criterion, rows: usize, label: &str) {
    let mut r = StdRng::seed_from_u64(3);
    let mut group = c.benchmark_group(label);
    group.sample_size(10);
    for (name, n, k) in SHAPES {
        let wf = uniform(&mut r, n * k);
        let x = uniform(&mut r, rows * k);
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let wt =
                candle_core::Tensor::from_slice(&wf, (n, k), &candle_core::Device::Cpu).unwrap();
            let xt =
                candle_core::Tensor::from_slice(&x, (rows, k), &candle_core::Device::Cpu).unwrap();
            group.throughput(if rows == 1 {
                Throughput::Bytes((n * k * 4) as u64)
            } else {
                Throughput::Elements((2 * rows * n * k) as u64)
            });
            std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
            let id = BenchmarkId::new(format!("{name}/candle-f32"), format!("t{threads}"));
            group.bench_function(id, |b| {
                pool.install(|| b.iter(|| black_box(xt.matmul(&wt.t().unwrap()).unwrap())))
            });
        }
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    bench(c, 512, "matmul_prefill_512");
}

fn decode(c: &mut Criterion) {
    bench(c, 1, "matmul_decode_1");
}

criterion_group!(benches, prefill, decode);
criterion_main!(benches);
