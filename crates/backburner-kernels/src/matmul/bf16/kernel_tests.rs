//! The bf16-activation kernel gives the bits of the plain loop on every instruction set (native AVX-512 BF16 and the
//! AVX-512F, AVX2 and plain-Rust emulations), thread count, batch size and row position.

use std::sync::atomic::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::matmul::{matmul, matmul_reference, PackedMatrix, Precision, WeightDtype};
use crate::simd::{ISA_CAP, ISA_MAX};

fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `f` once per dispatch level (3 = native BF16 where the CPU has it, 2, 1, 0), then lifts the cap.
fn at_every_level<T>(f: impl Fn() -> T) -> Vec<T> {
    let out = (0..=3u8)
        .rev()
        .map(|cap| {
            ISA_CAP.store(cap, Ordering::SeqCst);
            f()
        })
        .collect();
    ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
    out
}

fn pools() -> Vec<rayon::ThreadPool> {
    [1, 2, 3]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .expect("pool")
        })
        .collect()
}

#[test]
fn pair_products_equal_the_plain_loop_on_every_instruction_set_and_thread_count() {
    let mut r = StdRng::seed_from_u64(11);
    let pools = pools();
    // n = 40 and 200 leave partial panels; k = 301 is odd (a padded pair) and k = 1100 crosses a 256-pair block;
    // m = 1..16 take the direct path (in row blocks of up to 4), 17 and 30 the blocked one with row remainders.
    for (n, k) in [(40, 301), (200, 1100), (16, 2)] {
        let mut wf = uniform(&mut r, n * k);
        // a few special weights: a bf16 denormal, a negative zero, a large value
        wf[3] = 1e-39;
        wf[5] = -0.0;
        wf[7] = 3.0e4;
        let w = PackedMatrix::pack_with(
            k,
            &[crate::matmul::RowMajor {
                dtype: WeightDtype::F32,
                bytes: &wf.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>(),
                rows: n,
            }],
            WeightDtype::Bf16,
            Precision::Bf16,
        )
        .unwrap();
        assert_eq!(w.precision(), Precision::Bf16);
        for m in [1, 2, 3, 5, 8, 9, 13, 16, 17, 30] {
            let mut x = uniform(&mut r, m * k);
            x[0] = 1e-40; // an f32 denormal activation
            x[k.min(m * k - 1)] = -0.0;
            let mut want = vec![0.0; m * n];
            matmul_reference(&x, m, &w, &mut want);
            let runs = at_every_level(|| {
                pools
                    .iter()
                    .map(|p| {
                        let mut y = vec![f32::NAN; m * n];
                        p.install(|| matmul(&x, m, &w, &mut y));
                        bits(&y)
                    })
                    .collect::<Vec<_>>()
            });
            for (level, run) in runs.iter().enumerate() {
                for (t, y) in run.iter().enumerate() {
                    assert_eq!(
                        *y,
                        bits(&want),
                        "n={n} k={k} m={m} level {} threads {}",
                        3 - level,
                        t + 1
                    );
                }
            }
        }
    }
}

#[test]
fn a_rows_products_in_a_batch_equal_its_product_alone() {
    let mut r = StdRng::seed_from_u64(12);
    let (n, k, m) = (100, 700, 40);
    let w = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), WeightDtype::Bf16);
    let w = PackedMatrix::pack_with(
        k,
        &[crate::matmul::RowMajor {
            dtype: WeightDtype::Bf16,
            bytes: &w
                .to_f32_rows()
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect::<Vec<u8>>(),
            rows: n,
        }],
        WeightDtype::Bf16,
        Precision::Bf16,
    )
    .unwrap();
    let x = uniform(&mut r, m * k);
    let mut batch = vec![0.0; m * n];
    matmul(&x, m, &w, &mut batch);
    for (i, row) in x.chunks(k).enumerate() {
        let mut one = vec![0.0; n];
        matmul(row, 1, &w, &mut one);
        assert_eq!(bits(&one), bits(&batch[i * n..(i + 1) * n]), "row {i}");
    }
    for b in [3usize, 8, 12] {
        let mut part = vec![0.0; b * n];
        matmul(&x[5 * k..(5 + b) * k], b, &w, &mut part);
        assert_eq!(
            bits(&part),
            bits(&batch[5 * n..(5 + b) * n]),
            "rows 5..{}",
            5 + b
        );
    }
}

#[test]
fn pair_storage_keeps_the_checkpoint_bits_and_is_close_to_the_f32_arithmetic() {
    let mut r = StdRng::seed_from_u64(13);
    let (n, k, m) = (33, 257, 4);
    let wf = uniform(&mut r, n * k);
    let half = PackedMatrix::from_f32(n, k, &wf, WeightDtype::Bf16);
    let bytes: Vec<u8> = half
        .to_f32_rows()
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
        .collect();
    let part = crate::matmul::RowMajor {
        dtype: WeightDtype::Bf16,
        bytes: &bytes,
        rows: n,
    };
    let pairs = PackedMatrix::pack_with(k, &[part], WeightDtype::Bf16, Precision::Bf16).unwrap();
    assert_eq!(pairs.to_f32_rows(), half.to_f32_rows());
    let mut row = vec![0.0; k];
    pairs.row_into(17, &mut row);
    assert_eq!(row, half.to_f32_rows()[17 * k..18 * k]);
    assert_eq!(
        PackedMatrix::packed_bytes_with(n, k, WeightDtype::Bf16, Precision::Bf16),
        Some(pairs.bytes())
    );
    // f16 and f32 weights keep the f32 arithmetic whatever the precision asked
    let f16 = PackedMatrix::pack_with(k, &[part], WeightDtype::F16, Precision::Bf16).unwrap();
    assert_eq!(f16.precision(), Precision::F32);
    let x = uniform(&mut r, m * k);
    let (mut a, mut b) = (vec![0.0; m * n], vec![0.0; m * n]);
    matmul(&x, m, &half, &mut a);
    matmul(&x, m, &pairs, &mut b);
    // activations rounded to 8 significant bits: |error| ≤ Σ|x·w|·2^-8 (plus float rounding)
    for i in 0..m {
        for j in 0..n {
            let bound: f32 = (0..k)
                .map(|kk| (x[i * k + kk] * wf[j * k + kk]).abs())
                .sum::<f32>()
                * 2f32.powi(-8)
                + 1e-5;
            let (u, v) = (a[i * n + j], b[i * n + j]);
            assert!(
                (u - v).abs() <= bound,
                "({i}, {j}): {u} vs {v}, bound {bound}"
            );
        }
    }
}
