//! Whole kernels give the same bits on every vector instruction set this CPU has (AVX-512F, AVX2, plain
//! Rust), by capping [`dispatch`](crate::simd::dispatch) in turn.

use std::sync::atomic::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::attention::attend_page;
use crate::gdn::{delta_rule_chunked, delta_rule_recurrent, GdnDims};
use crate::kv::{KvDtype, KvPage};
use crate::simd::ISA_CAP;

fn uniform(r: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| r.random_range(-1.0f32..1.0)).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Runs `f` once per dispatch level (2, 1, 0) and returns the results.
fn at_every_level<T>(f: impl Fn() -> T) -> Vec<T> {
    let out = (0..=2u8)
        .rev()
        .map(|cap| {
            ISA_CAP.store(cap, Ordering::SeqCst);
            f()
        })
        .collect();
    ISA_CAP.store(2, Ordering::SeqCst);
    out
}

#[test]
fn attention_gives_the_same_bits_on_every_instruction_set() {
    let mut r = StdRng::seed_from_u64(1);
    // head_dim 40: not a multiple of 16, so the lane tails are exercised too.
    for (dtype, dim) in [(KvDtype::F16, 64), (KvDtype::F32, 40)] {
        let mut page = KvPage::new(0, 300, 2, dim, dtype);
        page.append(
            &uniform(&mut r, 300 * 2 * dim),
            &uniform(&mut r, 300 * 2 * dim),
            300,
        );
        let q = uniform(&mut r, 37 * 6 * dim);
        let runs = at_every_level(|| attend_page(&q, 37, 6, 263, &page, 0.2));
        for run in &runs[1..] {
            assert_eq!(bits(&run.o), bits(&runs[0].o), "{dtype} o");
            assert_eq!(bits(&run.lse), bits(&runs[0].lse), "{dtype} lse");
        }
    }
}

#[test]
fn delta_rules_give_the_same_bits_on_every_instruction_set() {
    let mut r = StdRng::seed_from_u64(2);
    let d = GdnDims {
        n_tokens: 70,
        n_k_heads: 2,
        n_v_heads: 4,
        d_k: 24,
        d_v: 20,
    };
    let q = uniform(&mut r, 70 * 2 * 24);
    let k = uniform(&mut r, 70 * 2 * 24);
    let v = uniform(&mut r, 70 * 4 * 20);
    let g: Vec<f32> = uniform(&mut r, 70 * 4).iter().map(|x| -x.abs()).collect();
    let beta: Vec<f32> = uniform(&mut r, 70 * 4).iter().map(|x| x.abs()).collect();
    let s0 = uniform(&mut r, 4 * 24 * 20);
    let run = |chunked: bool| {
        let mut s = s0.clone();
        let mut o = vec![0.0; 70 * 4 * 20];
        if chunked {
            delta_rule_chunked(d, 16, &q, &k, &v, &g, &beta, &mut s, &mut o);
        } else {
            delta_rule_recurrent(d, &q, &k, &v, &g, &beta, &mut s, &mut o);
        }
        (bits(&o), bits(&s))
    };
    for chunked in [false, true] {
        let runs = at_every_level(|| run(chunked));
        assert!(runs.iter().all(|x| *x == runs[0]), "chunked {chunked}");
    }
}

#[test]
fn matmul_gives_the_same_bits_on_every_instruction_set_and_as_the_plain_loop() {
    use crate::matmul::{matmul, matmul_reference, PackedMatrix, WeightDtype};
    let mut r = StdRng::seed_from_u64(7);
    // m = 1 and 3 take the direct path on every level, 5 the direct path on AVX-512 only, 30 the blocked path
    // with a row remainder; n = 40 leaves a partial panel; k = 300 crosses a 256-input block.
    for dtype in [WeightDtype::F32, WeightDtype::Bf16, WeightDtype::F16] {
        let (n, k) = (40, 300);
        let w = PackedMatrix::from_f32(n, k, &uniform(&mut r, n * k), dtype);
        for m in [1, 3, 5, 30] {
            let x = uniform(&mut r, m * k);
            let mut want = vec![0.0; m * n];
            matmul_reference(&x, m, &w, &mut want);
            let runs = at_every_level(|| {
                let mut y = vec![f32::NAN; m * n];
                matmul(&x, m, &w, &mut y);
                y
            });
            for run in &runs {
                assert_eq!(bits(run), bits(&want), "{dtype} m={m}");
            }
        }
    }
}
