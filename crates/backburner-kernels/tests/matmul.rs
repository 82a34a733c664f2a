//! The packed dense product: exact agreement with its plain-loop twin for every shape class, dtype and thread
//! count; a row alone equals the row inside a batch; closeness to the float64 product.

use backburner_kernels::matmul::{matmul, matmul_reference, PackedMatrix, WeightDtype};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn run(x: &[f32], m: usize, w: &PackedMatrix) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * w.n()];
    matmul(x, m, w, &mut y);
    y
}

const DTYPES: [WeightDtype; 3] = [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16];

#[test]
fn matmul_equals_the_fma_chain_loop_bit_for_bit_for_every_shape_class() {
    let mut r = StdRng::seed_from_u64(11);
    // m: the direct path (1..4), the blocked path with full and partial row blocks (12, 13, 25, 64);
    // n: a partial panel, one panel, panels that do not fill a group of 4 or of 16; k: short, one block, blocks
    // plus a remainder.
    for dtype in DTYPES {
        for &(n, k) in &[(1, 3), (16, 16), (17, 256), (100, 257), (300, 600)] {
            let w = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), dtype);
            for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 25, 64] {
                let x = uniform(&mut r, m * k);
                let mut want = vec![0.0; m * n];
                matmul_reference(&x, m, &w, &mut want);
                assert_eq!(
                    bits(&run(&x, m, &w)),
                    bits(&want),
                    "{dtype} m={m} n={n} k={k}"
                );
            }
        }
    }
}

#[test]
fn matmul_gives_the_same_bits_on_any_thread_count() {
    let mut r = StdRng::seed_from_u64(12);
    let (n, k) = (520, 700);
    for dtype in DTYPES {
        let w = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), dtype);
        for m in [1, 4, 77] {
            let x = uniform(&mut r, m * k);
            let runs: Vec<Vec<u32>> = [1, 2, 3, 5]
                .iter()
                .map(|&t| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(t)
                        .build()
                        .unwrap();
                    bits(&pool.install(|| run(&x, m, &w)))
                })
                .collect();
            for other in &runs[1..] {
                assert_eq!(other, &runs[0], "{dtype} m={m}");
            }
        }
    }
}

#[test]
fn a_row_alone_gives_the_bits_it_has_inside_a_batch() {
    let mut r = StdRng::seed_from_u64(13);
    let (n, k, m) = (96, 512, 40);
    for dtype in DTYPES {
        let w = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), dtype);
        let x = uniform(&mut r, m * k);
        let batch = run(&x, m, &w);
        for i in [0, 11, 12, 39] {
            let alone = run(&x[i * k..(i + 1) * k], 1, &w);
            assert_eq!(
                bits(&alone),
                bits(&batch[i * n..(i + 1) * n]),
                "{dtype} row {i}"
            );
        }
    }
}

#[test]
fn matmul_is_within_float_rounding_of_the_f64_product_of_the_stored_weights() {
    let mut r = StdRng::seed_from_u64(14);
    let (m, n, k) = (9, 70, 1000);
    for dtype in DTYPES {
        let w = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), dtype);
        let wr = w.to_f32_rows();
        let x = uniform(&mut r, m * k);
        let y = run(&x, m, &w);
        for i in 0..m {
            for j in 0..n {
                let (mut exact, mut mag) = (0.0f64, 0.0f64);
                for kk in 0..k {
                    let p = x[i * k + kk] as f64 * wr[j * k + kk] as f64;
                    exact += p;
                    mag += p.abs();
                }
                let err = (y[i * n + j] as f64 - exact).abs();
                // k roundings of at most half an ulp of the running sum, bounded by the sum of magnitudes.
                assert!(
                    err <= k as f64 * f32::EPSILON as f64 * mag,
                    "{dtype} ({i},{j}): {err}"
                );
            }
        }
    }
}

#[test]
fn rows_of_a_packed_matrix_read_back_as_the_embedding_rows() {
    let mut r = StdRng::seed_from_u64(15);
    let (n, k) = (50, 33);
    let w = uniform(&mut r, n * k);
    let p = PackedMatrix::from_f32(n, k, &w, WeightDtype::F32);
    let mut row = vec![0.0; k];
    for i in [0, 15, 16, 49] {
        p.row_into(i, &mut row);
        assert_eq!(&row[..], &w[i * k..(i + 1) * k]);
    }
    assert_eq!((p.n(), p.k(), p.dtype()), (50, 33, WeightDtype::F32));
}

#[test]
fn a_zero_width_input_gives_zeros_and_empty_shapes_do_nothing() {
    let w = PackedMatrix::from_f32(5, 0, &[], WeightDtype::Bf16);
    let mut y = vec![f32::NAN; 3 * 5];
    matmul(&[], 3, &w, &mut y);
    assert_eq!(y, vec![0.0; 15]);
    let mut none: Vec<f32> = vec![];
    matmul(&[], 0, &w, &mut none);
}
