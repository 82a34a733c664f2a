//! Speculative decoding's verify step through quantized matrices of the 27B's MLP shapes: the time of a `T`-row
//! product (`T` = 1..=12 activation rows, the activation quantization included) against the 1-row one, `V(T) =
//! time(T) / time(1)`, per format. Matrices gate|up `[34816, 5120]` and down `[5120, 17408]` (about 170 MB as Q4_K,
//! far beyond the L3, so every product streams its weights from memory), each round running every `T` once in a
//! rotating order; prints per format and `T` the median time of the round's products and the median of the per-round
//! ratio `V(T)` (with its range). Weights are random GGUF blocks with finite scales.
//!
//! `cargo bench -p backburner-kernels --bench qverify_27b -- [rounds] [threads] [formats, comma-separated] [max T]`
//! (defaults: 5 rounds, 1 thread, Q4_K,Q6_K, 12; `QVERIFY_ONLY=T` runs only `T` rows and 1). `Q4_K_M` as a format
//! name: gate|up Q4_K, down Q6_K (the mix of a Q4_K_M file's MLP layers); `bf16` and `bf16-act`: dense bf16 weights
//! in the f32 arithmetic and in the bf16-activation one (`matmul`, f32 activations as they are).

use backburner_kernels::matmul::{matmul, PackedMatrix, Precision, RowMajor, WeightDtype};
use backburner_kernels::quant::{qmatmul, QuantFormat, QuantMatrix, QuantizedActs};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

mod common;
use common::random_gguf;

/// `(n, k)` of the matrices: gate|up and down.
const SHAPES: [(usize, usize); 2] = [(34816, 5120), (5120, 17408)];
/// `QVERIFY_IN_CACHE=1`: two small matrices instead (about 0.4 MB as Q4_K, held in the L2), each product repeated
/// 200 times, to tell the kernel's arithmetic rate apart from memory.
const CACHE_SHAPES: [(usize, usize); 2] = [(512, 1024), (256, 2048)];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// A matrix of the bench: quantized, or dense bf16 in one of the two arithmetics.
enum Mat {
    Q(QuantMatrix),
    D(PackedMatrix),
}

impl Mat {
    fn new(r: &mut StdRng, name: &str, gate_up: bool, n: usize, k: usize) -> Mat {
        let prec = match name {
            "bf16" => Precision::F32,
            "bf16-act" => Precision::Bf16,
            _ => {
                let fmt = match (name, gate_up) {
                    ("Q4_K_M", true) => QuantFormat::Q4K,
                    ("Q4_K_M", false) => QuantFormat::Q6K,
                    _ => QuantFormat::ALL
                        .into_iter()
                        .find(|q| q.name() == name)
                        .expect("format"),
                };
                return Mat::Q(
                    QuantMatrix::pack(fmt, k, &[(&random_gguf(r, fmt, n, k), n)]).unwrap(),
                );
            }
        };
        let bytes = common::random_bf16(r, n, k);
        let part = RowMajor {
            dtype: WeightDtype::Bf16,
            bytes: &bytes,
            rows: n,
        };
        Mat::D(PackedMatrix::pack_with(k, &[part], WeightDtype::Bf16, prec).unwrap())
    }

    fn nk(&self) -> (usize, usize) {
        match self {
            Mat::Q(w) => (w.n(), w.k()),
            Mat::D(w) => (w.n(), w.k()),
        }
    }

    /// `y [t, n] = x [t, k] · Wᵀ`, the activation quantization included for a quantized matrix.
    fn product(&self, xq: &mut QuantizedActs, x: &[f32], t: usize, y: &mut [f32]) {
        let (n, k) = self.nk();
        match self {
            Mat::Q(w) => {
                xq.quantize(black_box(&x[..t * k]), t, k);
                qmatmul(xq, w, y, n);
            }
            Mat::D(w) => matmul(black_box(&x[..t * k]), t, w, &mut y[..t * n]),
        }
    }
}

fn main() {
    let (args, rounds, threads) = common::bench_args();
    let names: Vec<String> = args
        .get(2)
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or_else(|| vec!["Q4_K".into(), "Q6_K".into()]);
    let max_t: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(12);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut r = StdRng::seed_from_u64(11);
    let in_cache = std::env::var_os("QVERIFY_IN_CACHE").is_some();
    let shapes: &[(usize, usize)] = if in_cache { &CACHE_SHAPES } else { &SHAPES };
    let reps = if in_cache { 200 } else { 1 };
    // `QVERIFY_ONLY=T`: only T rows (and 1, the baseline), e.g. under `perf stat`.
    let only: Option<usize> = std::env::var("QVERIFY_ONLY")
        .ok()
        .and_then(|s| s.parse().ok());
    println!("format   threads  T  µs/step  V(T) median [range]");
    for name in names {
        let ws: Vec<Mat> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(n, k))| Mat::new(&mut r, &name, i == 0, n, k))
            .collect();
        let xs: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(_, k)| {
                (0..max_t * k)
                    .map(|_| r.random_range(-1.0f32..1.0))
                    .collect()
            })
            .collect();
        let mut ys: Vec<Vec<f32>> = shapes.iter().map(|&(n, _)| vec![0.0; max_t * n]).collect();
        let mut xq = QuantizedActs::new();
        // times[t - 1]: one entry per round.
        let mut times = vec![Vec::new(); max_t];
        pool.install(|| {
            for round in 0..=rounds {
                for i in 0..max_t {
                    let t = (i + round) % max_t + 1;
                    if only.is_some_and(|o| o != t && t != 1) {
                        continue;
                    }
                    let start = Instant::now();
                    for _ in 0..reps {
                        for (j, w) in ws.iter().enumerate() {
                            w.product(&mut xq, &xs[j], t, &mut ys[j]);
                        }
                    }
                    if round > 0 {
                        times[t - 1].push(start.elapsed().as_secs_f64() / reps as f64);
                    }
                }
            }
        });
        for t in (1..=max_t).filter(|&t| !times[t - 1].is_empty()) {
            let mut v: Vec<f64> = times[t - 1]
                .iter()
                .zip(&times[0])
                .map(|(a, b)| a / b)
                .collect();
            let lo = v.iter().cloned().fold(f64::MAX, f64::min);
            let hi = v.iter().cloned().fold(0.0, f64::max);
            println!(
                "{:<8} {:>7} {:>2} {:>8.1}  {:.2} [{:.2}-{:.2}]",
                name,
                threads,
                t,
                1e6 * median(&mut times[t - 1].clone()),
                median(&mut v),
                lo,
                hi
            );
        }
    }
}
