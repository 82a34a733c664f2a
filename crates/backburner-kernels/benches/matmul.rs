//! Criterion benches of the packed dense product at the bench model's shapes (hidden 1024, intermediate 3072):
//! prefill (512 rows, compute-bound: FLOP/s) and decode (1 row, bandwidth-bound: weight bytes/s), per weight dtype
//! and thread count. (`benches/matmul_vs_candle.rs` runs candle's f32 matmul on the same shapes.)
//!
//! `cargo bench -p backburner-kernels --bench matmul`.

use backburner_kernels::matmul::{matmul, PackedMatrix, WeightDtype};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;

fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

/// (name, n, k): the fused gate|up projection and the down projection.
const SHAPES: [(&str, usize, usize); 2] = [("gate_up", 6144, 1024), ("down", 1024, 3072)];

fn bench(c: &mut Criterion, rows: usize, label: &str) {
    let mut r = StdRng::seed_from_u64(3);
    let mut group = c.benchmark_group(label);
    group.sample_size(10);
    for (name, n, k) in SHAPES {
        let wf = uniform(&mut r, n * k);
        let x = uniform(&mut r, rows * k);
        let mut y = vec![0.0f32; rows * n];
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for dtype in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16] {
                let w = PackedMatrix::from_f32(n, k, &wf, dtype);
                group.throughput(if rows == 1 {
                    Throughput::Bytes((n * k * dtype.size_of()) as u64)
                } else {
                    Throughput::Elements((2 * rows * n * k) as u64)
                });
                let id = BenchmarkId::new(format!("{name}/{dtype}"), format!("t{threads}"));
                group.bench_function(id, |b| {
                    pool.install(|| b.iter(|| matmul(black_box(&x), rows, &w, &mut y)))
                });
            }
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

/// Decode as the model runs it: one row through a stack of matrices far larger than the caches (20 × the gate|up
/// shape, 252 MB in bf16), so the weights stream from memory: compare with `bench local`'s read bandwidth.
fn decode_stream(c: &mut Criterion) {
    let mut r = StdRng::seed_from_u64(5);
    let (n, k, count) = (6144, 1024, 20);
    let ws: Vec<PackedMatrix> = (0..count)
        .map(|_| PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), WeightDtype::Bf16))
        .collect();
    let x = uniform(&mut r, k);
    let mut y = vec![0.0f32; n];
    let mut group = c.benchmark_group("matmul_decode_stream");
    group.sample_size(10);
    group.throughput(Throughput::Bytes(ws.iter().map(|w| w.bytes() as u64).sum()));
    for threads in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        group.bench_function(BenchmarkId::new("bf16", format!("t{threads}")), |b| {
            pool.install(|| {
                b.iter(|| {
                    for w in &ws {
                        matmul(black_box(&x), 1, w, &mut y);
                    }
                })
            })
        });
    }
    group.finish();
}

criterion_group!(benches, prefill, decode, decode_stream);
criterion_main!(benches);
