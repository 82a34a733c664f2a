//! Decode (one activation row) through quantized matrices of the 27B's MLP shapes (gate|up `[34816, 5120]`, down
//! `[5120, 17408]`), per format, each pass of the products alternating with a plain read of the same packed bytes
//! (`read_sum_slices` over the matrices' storage, which lives in huge pages: the read bandwidth of the very memory the
//! products stream). Prints per format the medians of the products' packed bytes/s, the reads', and of their ratio
//! (the share of the read bandwidth), with the range of the ratio over the rounds. Weights are random GGUF blocks
//! with finite scales (the values do not change the time).
//!
//! `cargo bench -p backburner-kernels --bench qdecode_27b -- [rounds] [threads] [formats, comma-separated]`
//! (defaults: 5 rounds, 1 thread, Q4_K,Q5_K,Q6_K,IQ4_XS,Q8_0).

use backburner_kernels::parallel::read_sum_slices;
use backburner_kernels::quant::{qmatmul, QuantFormat, QuantMatrix, QuantizedActs};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::hint::black_box;
use std::time::Instant;

mod common;
use common::random_gguf;

/// `(n, k)` of the matrices: gate|up and down, twice each (534 M weights: 301 MB as Q4_K, far beyond the L3).
const SHAPES: [(usize, usize); 4] = [(34816, 5120), (5120, 17408), (34816, 5120), (5120, 17408)];
/// `QDECODE_IN_CACHE=1`: four small matrices instead (about 0.5 MB in all, held in the L2), each product repeated, to
/// tell the kernel's arithmetic rate apart from memory.
const CACHE_SHAPES: [(usize, usize); 4] = [(256, 1024), (256, 1024), (256, 1024), (256, 1024)];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let (args, rounds, threads) = common::bench_args();
    let fmts: Vec<QuantFormat> = args
        .get(2)
        .map(|s| {
            s.split(',')
                .map(|f| {
                    QuantFormat::ALL
                        .into_iter()
                        .find(|q| q.name() == f)
                        .expect("format")
                })
                .collect()
        })
        .unwrap_or_else(|| {
            vec![
                QuantFormat::Q4K,
                QuantFormat::Q5K,
                QuantFormat::Q6K,
                QuantFormat::Iq4Xs,
                QuantFormat::Q8_0,
            ]
        });
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut r = StdRng::seed_from_u64(7);
    println!("format  threads  product GB/s  read GB/s  share   (GGUF bytes / packed bytes)");
    let in_cache = std::env::var_os("QDECODE_IN_CACHE").is_some();
    let shapes: &[(usize, usize)] = if in_cache { &CACHE_SHAPES } else { &SHAPES };
    let reps = if in_cache { 400 } else { 1 };
    for fmt in fmts {
        let ws: Vec<QuantMatrix> = shapes
            .iter()
            .map(|&(n, k)| {
                QuantMatrix::pack(fmt, k, &[(&random_gguf(&mut r, fmt, n, k), n)]).unwrap()
            })
            .collect();
        let gguf: usize = shapes
            .iter()
            .map(|&(n, k)| n * fmt.row_bytes(k).unwrap())
            .sum();
        let packed: usize = ws.iter().map(|w| w.bytes()).sum();
        let slices: Vec<&[u8]> = ws.iter().map(|w| w.as_bytes()).collect();
        let xs: Vec<Vec<f32>> = shapes
            .iter()
            .map(|&(_, k)| (0..k).map(|_| r.random_range(-1.0f32..1.0)).collect())
            .collect();
        let mut ys: Vec<Vec<f32>> = shapes.iter().map(|&(n, _)| vec![0.0; n]).collect();
        let mut xq = QuantizedActs::new();
        let (mut prod, mut read, mut share) = (vec![], vec![], vec![]);
        pool.install(|| {
            for round in 0..=rounds {
                let t = Instant::now();
                for _ in 0..reps {
                    for (i, w) in ws.iter().enumerate() {
                        xq.quantize(black_box(&xs[i]), 1, w.k());
                        qmatmul(&xq, w, &mut ys[i], w.n());
                    }
                }
                let tp = t.elapsed().as_secs_f64() / reps as f64;
                let t = Instant::now();
                for _ in 0..reps {
                    black_box(read_sum_slices(black_box(&slices)));
                }
                let tr = t.elapsed().as_secs_f64() / reps as f64;
                if round > 0 {
                    prod.push(packed as f64 / tp / 1e9);
                    read.push(packed as f64 / tr / 1e9);
                    share.push(tr / tp);
                }
            }
        });
        println!(
            "{:<7} {:>7}  {:>12.1}  {:>9.1}  {:>5.1} %  ({:.0} / {:.0} MB; rounds {:.0}-{:.0} %)",
            fmt.name(),
            threads,
            median(&mut prod),
            median(&mut read),
            100.0 * median(&mut share.clone()),
            gguf as f64 / 1e6,
            packed as f64 / 1e6,
            100.0 * share.iter().cloned().fold(f64::MAX, f64::min),
            100.0 * share.iter().cloned().fold(0.0, f64::max),
        );
    }
}
