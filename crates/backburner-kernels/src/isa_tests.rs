//! Whole kernels give the same bits on every vector instruction set this CPU has (AVX-512F, AVX2, plain
//! Rust), by capping [`dispatch`](crate::simd::dispatch) in turn.

use std::sync::atomic::Ordering;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::attention::attend_page;
use crate::gdn::{delta_rule_chunked, delta_rule_recurrent, GdnDims};
use crate::kv::{KvDtype, KvPage};
use crate::simd::{ISA_CAP, ISA_MAX};

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
    ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
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
        tiled_v_heads: false,
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
        for m in [1, 3, 5, 7, 8, 30] {
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

/// FNV-1a over the bits of a partial's outputs and log-sum-exps.
fn fnv(h: &mut u64, x: &[f32]) {
    for v in x {
        for b in v.to_bits().to_le_bytes() {
            *h = (*h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
}

/// The exact bits of `attend_page`, recorded from the kernel as it stood before the decode path was restructured
/// (commit 6dfef0e), on every instruction set: decode (1 token, all or part of the page visible), a short batch
/// inside the page and a prefill batch starting before it; f16 and f32; block-major and packed pages; 1 and 2
/// threads; GQA groups of 1 to 12 rows; head_dim 40 (lane tails) to 256; one page long enough for two key segments.
/// Any change of the arithmetic's order in the kernel shows here.
#[test]
fn attention_keeps_its_recorded_bits_on_every_instruction_set() {
    use crate::kv::PackedPage;
    // (n_heads, n_kv_heads, head_dim, page len, fnv of f16 outputs, fnv of f32 outputs)
    let cases: [(usize, usize, usize, usize, u64, u64); 6] = [
        (8, 2, 128, 300, 0x6b0d_b436_8a8f_75c4, 0x79fe_f114_a4cc_b736),
        (
            24,
            4,
            256,
            200,
            0x02f7_b059_abc8_291e,
            0x78ff_3fb4_caeb_a63b,
        ),
        (6, 2, 40, 300, 0x4e39_62b5_70bf_d032, 0x3eac_e899_9a67_a18b),
        (4, 4, 64, 300, 0xe0c5_e69a_c840_d379, 0xbe7f_2f49_c9e6_067c),
        (12, 1, 32, 300, 0x0f59_5813_cb05_d0af, 0x16ba_7e2b_92ab_a875),
        (8, 2, 64, 1100, 0x61a7_7b26_bef9_e5e1, 0x5856_09cf_27ed_ebbc),
    ];
    let pools: Vec<rayon::ThreadPool> = [1, 2]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .expect("pool")
        })
        .collect();
    let mut r = StdRng::seed_from_u64(5);
    let mut report = Vec::new();
    let mut ok = true;
    for (n_heads, hkv, dim, len, want16, want32) in cases {
        for (dtype, want) in [(KvDtype::F16, want16), (KvDtype::F32, want32)] {
            let start = 64;
            let mut page = KvPage::new(start, len.next_multiple_of(64), hkv, dim, dtype);
            page.append(
                &uniform(&mut r, len * hkv * dim),
                &uniform(&mut r, len * hkv * dim),
                len,
            );
            let packed = PackedPage::pack(page.view());
            // (tokens, position of the first)
            let queries = [
                (1, start + len + 10),
                (1, start + len / 2 + 3),
                (5, start + len - 40),
                (20, start - 3),
            ];
            let qs: Vec<Vec<f32>> = queries
                .iter()
                .map(|&(n, _)| uniform(&mut r, n * n_heads * dim))
                .collect();
            let runs = at_every_level(|| {
                let mut h = 0xcbf2_9ce4_8422_2325u64;
                for (&(n, pos), q) in queries.iter().zip(&qs) {
                    let scale = (dim as f32).powf(-0.5);
                    let base = pools[0].install(|| attend_page(q, n, n_heads, pos, &page, scale));
                    for pool in &pools {
                        for view in [page.view(), packed.view()] {
                            let p = pool.install(|| attend_page(q, n, n_heads, pos, view, scale));
                            assert_eq!(
                                bits(&p.o),
                                bits(&base.o),
                                "layouts and thread counts agree"
                            );
                            assert_eq!(
                                bits(&p.lse),
                                bits(&base.lse),
                                "layouts and thread counts agree"
                            );
                        }
                    }
                    fnv(&mut h, &base.o);
                    fnv(&mut h, &base.lse);
                }
                h
            });
            report.push(format!(
                "{n_heads}/{hkv}/{dim} len {len} {dtype}: {:#018x}",
                runs[0]
            ));
            ok &= runs.iter().all(|&h| h == want);
        }
    }
    assert!(ok, "recorded bits changed:\n{}", report.join("\n"));
}
