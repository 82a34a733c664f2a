//! Criterion benches of the quantized products at the bench model's shapes (up: [3072, 1024], down: [1024, 3072]):
//! decode (1 row, bandwidth-bound: GGUF weight bytes/s) and prefill (512 rows, compute-bound: 2·m·n·k "FLOP"/s),
//! each including the activation quantization, per format and thread count, beside the dense bf16 product of the
//! same shape; and decode over a stack of matrices larger than the L3 (weights streamed from memory), beside a plain sum
//! of as many bytes (`plain_sum`: the read bandwidth in the same run).
//!
//! `cargo bench -p backburner-kernels --bench qmatmul` (add `--features compare-candle` for candle's quantized
//! matmul on Q8_0 / Q4_K beside ours; candle quantizes the same shapes itself).

use backburner_kernels::matmul::{matmul, PackedMatrix, WeightDtype};
use backburner_kernels::parallel::read_sum;
use backburner_kernels::quant::{kernel_isa, qmatmul, QuantFormat, QuantMatrix, QuantizedActs};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;

mod common;
use common::random_gguf;

/// (name, n, k).
const SHAPES: [(&str, usize, usize); 2] = [("up", 3072, 1024), ("down", 1024, 3072)];
const FORMATS: [QuantFormat; 3] = [QuantFormat::Q8_0, QuantFormat::Q4K, QuantFormat::Iq4Xs];

fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

fn pools() -> Vec<(usize, rayon::ThreadPool)> {
    [1usize, 2]
        .into_iter()
        .map(|t| {
            (
                t,
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap(),
            )
        })
        .collect()
}

fn bench(c: &mut Criterion, rows: usize, label: &str) {
    eprintln!("quantized kernels: {}", kernel_isa());
    let mut r = StdRng::seed_from_u64(3);
    let mut group = c.benchmark_group(label);
    group.sample_size(10);
    for (name, n, k) in SHAPES {
        let x = uniform(&mut r, rows * k);
        let mut y = vec![0.0f32; rows * n];
        let mut xq = QuantizedActs::new();
        for (threads, pool) in pools() {
            for fmt in FORMATS {
                let gguf = fmt.row_bytes(k).unwrap() * n;
                let w = QuantMatrix::pack(fmt, k, &[(&random_gguf(&mut r, fmt, n, k), n)]).unwrap();
                group.throughput(if rows == 1 {
                    Throughput::Bytes(gguf as u64)
                } else {
                    Throughput::Elements((2 * rows * n * k) as u64)
                });
                let id = BenchmarkId::new(format!("{name}/{fmt}"), format!("t{threads}"));
                group.bench_function(id, |b| {
                    pool.install(|| {
                        b.iter(|| {
                            xq.quantize(black_box(&x), rows, k);
                            qmatmul(&xq, &w, &mut y, n);
                        })
                    })
                });
            }
            let wd = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), WeightDtype::Bf16);
            group.throughput(if rows == 1 {
                Throughput::Bytes((n * k * 2) as u64)
            } else {
                Throughput::Elements((2 * rows * n * k) as u64)
            });
            let id = BenchmarkId::new(format!("{name}/dense-bf16"), format!("t{threads}"));
            group.bench_function(id, |b| {
                pool.install(|| b.iter(|| matmul(black_box(&x), rows, &wd, &mut y)))
            });
            #[cfg(feature = "compare-candle")]
            candle_cmp::bench(&mut group, &mut r, name, n, k, rows, threads, &pool);
        }
    }
    group.finish();
}

fn prefill(c: &mut Criterion) {
    bench(c, 512, "qmatmul_prefill_512");
}

fn decode(c: &mut Criterion) {
    bench(c, 1, "qmatmul_decode_1");
}

/// Decode through a stack of up-projections about 64 MB in all per format (twice the L3 at least), so the weights
/// stream from memory: GGUF bytes/s against the machine's read bandwidth. Every format (Q6_K is the head of most
/// quantized files).
fn decode_stream(c: &mut Criterion) {
    let mut r = StdRng::seed_from_u64(5);
    let (n, k) = (3072, 1024);
    let x = uniform(&mut r, k);
    let mut y = vec![0.0f32; n];
    let mut xq = QuantizedActs::new();
    let mut group = c.benchmark_group("qmatmul_decode_stream");
    group.sample_size(10);
    let plain: Vec<u64> = (0..(64u64 << 20) / 8).collect();
    group.throughput(Throughput::Bytes(64 << 20));
    for (threads, pool) in pools() {
        group.bench_function(BenchmarkId::new("plain_sum", format!("t{threads}")), |b| {
            pool.install(|| b.iter(|| read_sum(black_box(&plain))))
        });
    }
    for fmt in QuantFormat::ALL {
        let count = (64 << 20) / (n * fmt.row_bytes(k).unwrap());
        let ws: Vec<QuantMatrix> = (0..count)
            .map(|_| QuantMatrix::pack(fmt, k, &[(&random_gguf(&mut r, fmt, n, k), n)]).unwrap())
            .collect();
        group.throughput(Throughput::Bytes(
            (count * n * fmt.row_bytes(k).unwrap()) as u64,
        ));
        for (threads, pool) in pools() {
            group.bench_function(BenchmarkId::new(fmt.name(), format!("t{threads}")), |b| {
                pool.install(|| {
                    b.iter(|| {
                        for w in &ws {
                            xq.quantize(black_box(&x), 1, k);
                            qmatmul(&xq, w, &mut y, n);
                        }
                    })
                })
            });
        }
    }
    group.finish();
}

#[cfg(feature = "compare-candle")]
mod candle_cmp {
    use super::*;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};

    /// Whether CPUID advertises AMX tiles: candle's Q4_K prefill then takes an AMX path, which faults on machines
    /// that advertise AMX without supporting it, so that case is skipped.
    fn amx_advertised() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let info = std::arch::x86_64::__cpuid_count(7, 0);
            info.edx & (1 << 24) != 0
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn bench(
        group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
        r: &mut StdRng,
        name: &str,
        n: usize,
        k: usize,
        rows: usize,
        threads: usize,
        pool: &rayon::ThreadPool,
    ) {
        let wf = Tensor::from_slice(&uniform(r, n * k), (n, k), &Device::Cpu).unwrap();
        let x = Tensor::from_slice(&uniform(r, rows * k), (rows, k), &Device::Cpu).unwrap();
        for (dtype, fmt) in [
            (GgmlDType::Q8_0, QuantFormat::Q8_0),
            (GgmlDType::Q4K, QuantFormat::Q4K),
        ] {
            if rows >= 32 && dtype == GgmlDType::Q4K && amx_advertised() {
                continue;
            }
            let mm = QMatMul::from_qtensor(QTensor::quantize(&wf, dtype).unwrap()).unwrap();
            group.throughput(if rows == 1 {
                Throughput::Bytes((fmt.row_bytes(k).unwrap() * n) as u64)
            } else {
                Throughput::Elements((2 * rows * n * k) as u64)
            });
            let id = BenchmarkId::new(format!("{name}/candle-{fmt}"), format!("t{threads}"));
            std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
            group.bench_function(id, |b| {
                pool.install(|| b.iter(|| black_box(mm.forward(&x).unwrap())))
            });
        }
    }
}

criterion_group!(benches, decode, prefill, decode_stream);
criterion_main!(benches);
