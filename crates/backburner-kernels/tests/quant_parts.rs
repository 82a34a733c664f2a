//! Products run as one parallel region: several quantized matrices on the same activations (`qmatmul_parts`, a
//! fused projection whose parts are stored in different formats) give the bits of one `qmatmul` per part; the
//! gate/up product with its SwiGLU (`qmatmul_swiglu`) the bits of `qmatmul` then `silu_mul_halves`.

use backburner_kernels::quant::{
    qmatmul, qmatmul_parts, qmatmul_swiglu, QuantFormat, QuantMatrix, QuantizedActs,
};
use backburner_kernels::rowops::silu_mul_halves;
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::common::bits;
use crate::quant::{activations, random_rows};

#[test]
fn parts_in_one_region_give_the_bits_of_one_product_per_part() {
    let mut r = StdRng::seed_from_u64(21);
    let k = 512;
    // A GDN input projection of an IQ4_XS file (Q5_K q/k/v, then IQ4_XS z, b, a), scaled down; a 16-column part
    // smaller than a panel group; a part past the others' columns with a gap before it.
    let shapes = [
        (QuantFormat::Q5K, 160, 0),
        (QuantFormat::Iq4Xs, 80, 160),
        (QuantFormat::Q8_0, 16, 240),
        (QuantFormat::Q6K, 33, 300),
    ];
    let ws: Vec<(QuantMatrix, usize)> = shapes
        .iter()
        .map(|&(f, n, first)| {
            let w = QuantMatrix::pack(f, k, &[(&random_rows(&mut r, f, n, k), n)]).unwrap();
            (w, first)
        })
        .collect();
    let ldy = 340;
    for m in [1, 2, 9] {
        let mut x = QuantizedActs::new();
        x.quantize(&activations(&mut r, m, k), m, k);
        let mut want = vec![-7.5f32; m * ldy];
        for (w, first) in &ws {
            qmatmul(&x, w, &mut want[*first..], ldy);
        }
        assert!(
            want.iter().any(|&v| v == -7.5),
            "the gap keeps its sentinel"
        );
        for t in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap();
            let mut got = vec![-7.5f32; m * ldy];
            let parts: Vec<(&QuantMatrix, usize)> = ws.iter().map(|(w, f)| (w, *f)).collect();
            pool.install(|| qmatmul_parts(&x, &parts, &mut got, ldy));
            assert_eq!(bits(&got), bits(&want), "m={m}, {t} threads");
        }
    }
}

#[test]
#[should_panic(expected = "overlap")]
fn overlapping_parts_are_refused() {
    let mut r = StdRng::seed_from_u64(22);
    let f = QuantFormat::Q8_0;
    let w = QuantMatrix::pack(f, 32, &[(&random_rows(&mut r, f, 16, 32), 16)]).unwrap();
    let mut x = QuantizedActs::new();
    x.quantize(&activations(&mut r, 1, 32), 1, 32);
    let mut y = vec![0.0f32; 40];
    qmatmul_parts(&x, &[(&w, 0), (&w, 8)], &mut y, 40);
}

#[test]
fn the_swiglu_in_the_region_gives_the_bits_of_the_product_then_the_swiglu() {
    let mut r = StdRng::seed_from_u64(23);
    let k = 256;
    // inter = 80: five panels per half, split 2 + 3 or 4 + 1 over two tasks (groups of four panels)
    for (fmt, inter) in [
        (QuantFormat::Iq4Xs, 80),
        (QuantFormat::Q4K, 48),
        (QuantFormat::Q8_0, 16),
    ] {
        let n = 2 * inter;
        let w = QuantMatrix::pack(fmt, k, &[(&random_rows(&mut r, fmt, n, k), n)]).unwrap();
        for m in [1, 3, 9] {
            let mut x = QuantizedActs::new();
            x.quantize(&activations(&mut r, m, k), m, k);
            let mut gu_want = vec![0.0f32; m * n];
            qmatmul(&x, &w, &mut gu_want, n);
            let mut want = vec![0.0f32; m * inter];
            silu_mul_halves(&gu_want, inter, &mut want);
            assert!(want.iter().any(|&v| v != 0.0));
            for t in [1, 2, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap();
                let (mut gu, mut act) = (vec![f32::NAN; m * n], vec![f32::NAN; m * inter]);
                pool.install(|| qmatmul_swiglu(&x, &w, &mut gu, &mut act));
                let what = format!("{fmt} inter={inter} m={m}, {t} threads");
                assert_eq!(bits(&gu), bits(&gu_want), "{what}: gate/up");
                assert_eq!(bits(&act), bits(&want), "{what}: SwiGLU");
            }
        }
    }
}

#[test]
#[should_panic(expected = "multiple of 32")]
fn a_swiglu_half_off_a_panel_boundary_is_refused() {
    let mut r = StdRng::seed_from_u64(24);
    let f = QuantFormat::Q8_0;
    let w = QuantMatrix::pack(f, 32, &[(&random_rows(&mut r, f, 40, 32), 40)]).unwrap();
    let mut x = QuantizedActs::new();
    x.quantize(&activations(&mut r, 1, 32), 1, 32);
    let (mut gu, mut act) = (vec![0.0f32; 40], vec![0.0f32; 20]);
    qmatmul_swiglu(&x, &w, &mut gu, &mut act);
}
