//! Several quantized matrices on the same activations in one parallel region (`qmatmul_parts`, a fused projection
//! whose parts are stored in different formats): the bits of one `qmatmul` per part.

use backburner_kernels::quant::{qmatmul, qmatmul_parts, QuantFormat, QuantMatrix, QuantizedActs};
use rand::rngs::StdRng;
use rand::SeedableRng;

use crate::quant::{activations, random_rows};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

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
