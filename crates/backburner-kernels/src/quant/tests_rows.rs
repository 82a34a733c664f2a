//! Row invariance of the few-row products (speculative decoding's verify steps): every row of a `T`-row product is
//! the bits of that row's 1-row product, for every format, `T = 1..=12` (and past the few-row path), every
//! instruction set this CPU has and 1 or 2 threads.

use std::sync::atomic::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::tests::random_block;
use super::*;
use crate::simd::{ISA_CAP, ISA_MAX};

/// Largest batch checked: past [`isa::QIsa::FEW_ROWS`] (16 on AVX-512) by one, so the many-row path's first batch
/// is checked too.
const MAX_T: usize = 17;

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// `qmatmul` of `rows` of `xf: [.., k]` as one batch, into `[rows.len(), n]` with row stride `ldy`.
fn product(
    xf: &[f32],
    rows: std::ops::Range<usize>,
    k: usize,
    w: &QuantMatrix,
    ldy: usize,
) -> Vec<f32> {
    let m = rows.len();
    let mut x = QuantizedActs::new();
    x.quantize(&xf[rows.start * k..rows.end * k], m, k);
    let mut y = vec![f32::NAN; m * ldy];
    qmatmul(&x, w, &mut y, ldy);
    y
}

#[test]
fn every_row_of_a_few_row_product_is_its_one_row_product() {
    let mut r = StdRng::seed_from_u64(21);
    // k: a multiple of 256 (every format) that is not one of 512; n: not a multiple of the 16-row panel, with enough
    // work (n·k ≥ 2^18 multiply-adds) that 2 threads split even the 1-row product; ldy > n.
    let (n, k, ldy) = (345, 768, 347);
    let pools = [pool(1), pool(2)];
    for fmt in QuantFormat::ALL {
        let blocks: Vec<u8> = (0..n * k / fmt.block_elems())
            .flat_map(|_| random_block(&mut r, fmt))
            .collect();
        let w = QuantMatrix::pack(fmt, k, &[(&blocks, n)]).unwrap();
        let xf: Vec<f32> = (0..MAX_T * k)
            .map(|_| r.random_range(-1.0f32..1.0))
            .collect();
        // Each row alone through the reference: the bits every product must give.
        let want: Vec<Vec<f32>> = (0..MAX_T)
            .map(|i| {
                let mut x = QuantizedActs::new();
                x.quantize(&xf[i * k..(i + 1) * k], 1, k);
                let mut y = vec![0.0f32; n];
                qmatmul_reference(&x, &w, &mut y, n);
                y
            })
            .collect();
        for cap in (0..=ISA_MAX).rev() {
            ISA_CAP.store(cap, Ordering::SeqCst);
            let isa = kernel_isa();
            for (threads, pool) in [1, 2].into_iter().zip(&pools) {
                pool.install(|| {
                    for (i, want) in want.iter().enumerate() {
                        let y = product(&xf, i..i + 1, k, &w, ldy);
                        check(
                            &y[..n],
                            want,
                            &format!("{fmt} 1 row ({i}) {isa} {threads} threads"),
                        );
                    }
                    for t in 2..=MAX_T {
                        // Rows from an offset, so that a row's place in the batch differs from its 1-row run's.
                        let first = (t * 5) % (MAX_T + 1 - t);
                        let y = product(&xf, first..first + t, k, &w, ldy);
                        for (j, row) in y.chunks(ldy).enumerate() {
                            let what = format!("{fmt} T={t} row {j} {isa} {threads} threads");
                            check(&row[..n], &want[first + j], &what);
                            assert!(row[n..].iter().all(|v| v.is_nan()), "{what}: wrote past n");
                        }
                    }
                });
            }
        }
        ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
    }
}

fn check(got: &[f32], want: &[f32], what: &str) {
    let bad = got
        .iter()
        .zip(want)
        .position(|(a, b)| a.to_bits() != b.to_bits());
    if let Some(j) = bad {
        ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
        panic!(
            "{what}: column {j} is {} where its 1-row product is {}",
            got[j], want[j]
        );
    }
}
