//! Paged attention: per-page partials folded over pages against one page and against the f64 reference,
//! causality across page boundaries, GQA, f16 storage, and bit reproducibility.

use crate::common;

use backburner_kernels::attention::{
    attend_page, attend_pages, fold_pages, fold_partials, merge_into, page_partial, Partial,
};
use backburner_kernels::kv::{KvDtype, KvPage, PageView, PagedKvCache, RowsRef};
use backburner_kernels::reference::attention_reference;
use common::*;
use half::f16;

/// Paged fold vs one page, relative to the output scale. Each extra page adds one LSE merge per row: an
/// f32 `exp` of an LSE difference (error ~|λ|·6e-8 for |λ| ≲ 8) and a convex combination; 19 merges
/// (300 keys in pages of 16) stay at a few 1e-7, so 2e-6 leaves a margin while a wrong weight or a lost
/// key changes outputs by 1e-3 or more.
const PAGED_TOL: f32 = 2e-6;
/// f32 kernel vs the f64 reference: f32 dot products over head_dim and f32 softmax sums over 300 keys.
const REF_TOL: f32 = 1e-5;

const D: usize = 32;

struct Kv {
    n_kv_heads: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl Kv {
    fn random(n_keys: usize, n_kv_heads: usize, seed: u64) -> Self {
        let mut r = rng(seed);
        Kv {
            n_kv_heads,
            k: uniform(&mut r, n_keys * n_kv_heads * D, -1.0, 1.0),
            v: uniform(&mut r, n_keys * n_kv_heads * D, -1.0, 1.0),
        }
    }

    fn cache(&self, page_size: usize, dtype: KvDtype) -> PagedKvCache {
        let mut c = PagedKvCache::new(page_size, self.n_kv_heads, D, dtype);
        c.append(&self.k, &self.v, self.k.len() / (self.n_kv_heads * D));
        c
    }
}

fn scale() -> f32 {
    (D as f32).powf(-0.5)
}

fn queries(n_tokens: usize, n_heads: usize, seed: u64) -> Vec<f32> {
    // Scores up to ~±11 after scaling: softmaxes that are neither flat nor one-hot.
    uniform(&mut rng(seed), n_tokens * n_heads * D, -2.0, 2.0)
}

#[test]
fn paged_attention_matches_one_page_and_the_reference() {
    let n_keys = 300;
    let (mut worst_paged, mut worst_ref) = (0.0f32, 0.0f32);
    for (n_heads, n_kv) in [(4, 2), (6, 2), (2, 2)] {
        let kv = Kv::random(n_keys, n_kv, 1 + n_heads as u64);
        let one = kv.cache(4096, KvDtype::F32);
        assert_eq!(one.pages().len(), 1);
        // (q_pos0, n_tokens): prefill from 0, a chunk on top of 250 keys, decode of the last position.
        for (q_pos0, n_tokens) in [(0, 300), (250, 50), (299, 1)] {
            let q = queries(n_tokens, n_heads, 7 + q_pos0 as u64);
            let want = one.attend(&q, n_tokens, n_heads, q_pos0, scale());
            let keys_seen = &kv.k[..(q_pos0 + n_tokens) * n_kv * D];
            let vals_seen = &kv.v[..(q_pos0 + n_tokens) * n_kv * D];
            let reference = attention_reference(
                &q,
                n_tokens,
                n_heads,
                q_pos0,
                keys_seen,
                vals_seen,
                n_kv,
                D,
                scale(),
            );
            let what = format!("heads {n_heads}/{n_kv}, q_pos0 {q_pos0}, n_tokens {n_tokens}");
            let e = assert_close_rel(
                &format!("{what}: one page vs ref"),
                &want.o,
                &reference,
                REF_TOL,
            );
            worst_ref = worst_ref.max(e);
            for page_size in [16, 64] {
                let paged = kv.cache(page_size, KvDtype::F32);
                let got = paged.attend(&q, n_tokens, n_heads, q_pos0, scale());
                let what = format!("{what}, page {page_size}");
                let e_o = assert_close_rel(&format!("{what}: o"), &got.o, &want.o, PAGED_TOL);
                let e_l = assert_close_rel(&format!("{what}: lse"), &got.lse, &want.lse, PAGED_TOL);
                let e_r = assert_close_rel(&format!("{what}: vs ref"), &got.o, &reference, REF_TOL);
                worst_paged = worst_paged.max(e_o).max(e_l);
                worst_ref = worst_ref.max(e_r);
            }
        }
    }
    eprintln!(
        "paged vs one page: worst {worst_paged:e}; vs the f64 reference: worst {worst_ref:e}"
    );
}

#[test]
fn head_dims_that_are_not_a_multiple_of_16_match_the_reference() {
    // The block layout keeps 16-wide lane groups of keys and 16-wide chunks of values; a narrower last chunk of
    // V (dim 24, 40) and dims below one vector (8) take the kernels' scalar tails. Decode (one token: the path that
    // reads the page in place) and prefill (the path that widens each block first), f32 and f16 storage.
    for dim in [8, 24, 40] {
        let (n_heads, n_kv, n_keys) = (4, 2, 150);
        let mut r = rng(dim as u64);
        let k = uniform(&mut r, n_keys * n_kv * dim, -1.0, 1.0);
        let v = uniform(&mut r, n_keys * n_kv * dim, -1.0, 1.0);
        let sc = (dim as f32).powf(-0.5);
        for dtype in [KvDtype::F32, KvDtype::F16] {
            let mut cache = PagedKvCache::new(128, n_kv, dim, dtype);
            cache.append(&k, &v, n_keys);
            let (ks, vs) = match dtype {
                KvDtype::F32 => (k.clone(), v.clone()),
                KvDtype::F16 => (round_f16(&k), round_f16(&v)),
                KvDtype::Bf16 => {
                    unreachable!("bf16 pages are not compared with the f32 reference here")
                }
            };
            for (q_pos0, n_tokens) in [(149, 1), (0, 150), (100, 50)] {
                let q = uniform(&mut r, n_tokens * n_heads * dim, -2.0, 2.0);
                let got = cache.attend(&q, n_tokens, n_heads, q_pos0, sc);
                let seen = (q_pos0 + n_tokens) * n_kv * dim;
                let want = attention_reference(
                    &q,
                    n_tokens,
                    n_heads,
                    q_pos0,
                    &ks[..seen],
                    &vs[..seen],
                    n_kv,
                    dim,
                    sc,
                );
                let what = format!("dim {dim}, {dtype}, q_pos0 {q_pos0}, {n_tokens} tokens");
                assert_close_rel(&what, &got.o, &want, REF_TOL);
            }
        }
    }
}

fn round_f16(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

#[test]
fn a_query_sees_exactly_the_keys_at_or_before_its_position() {
    // Key j has value j in every dim and all scores are equal (zero queries), so the output is the mean
    // of the visible positions: (0 + ... + p) / (p + 1) = p / 2, and lse = ln(p + 1).
    let (n_keys, n_kv) = (40, 1);
    let k = vec![0.0f32; n_keys * D];
    let v: Vec<f32> = (0..n_keys * D).map(|i| (i / D) as f32).collect();
    let mut cache = PagedKvCache::new(16, n_kv, D, KvDtype::F32);
    cache.append(&k, &v, n_keys);
    let q = vec![0.0f32; 40 * D];
    let p = cache.attend(&q, 40, 1, 0, scale());
    for t in 0..40 {
        assert!(
            (p.o[t * D] - t as f32 / 2.0).abs() < 1e-5,
            "token {t}: {}",
            p.o[t * D]
        );
        assert!((p.lse[t] - ((t + 1) as f32).ln()).abs() < 1e-5);
    }
}

#[test]
fn a_page_entirely_in_the_future_gives_an_empty_partial_and_merging_it_is_a_no_op() {
    let kv = Kv::random(100, 2, 3);
    let cache = kv.cache(64, KvDtype::F32);
    let future = &cache.pages()[1];
    assert_eq!(future.start(), 64);
    let q = queries(3, 4, 5);
    let p = attend_page(&q, 3, 4, 10, future, scale());
    assert_eq!(p, Partial::empty(3, 4, D));
    assert!(p.lse.iter().all(|l| *l == f32::NEG_INFINITY));
    let mut acc = attend_page(&q, 3, 4, 10, &cache.pages()[0], scale());
    let before = acc.clone();
    merge_into(&mut acc, &p);
    assert_eq!(bits(&acc.o), bits(&before.o));
    assert_eq!(bits(&acc.lse), bits(&before.lse));
    // Within one call, tokens before the page start are empty and later ones are not.
    let q = queries(10, 4, 6);
    let p = attend_page(&q, 10, 4, 60, future, scale());
    assert!(p.lse[..4 * 4].iter().all(|l| *l == f32::NEG_INFINITY));
    assert!(p.lse[4 * 4..].iter().all(|l| l.is_finite()));
}

#[test]
fn f16_pages_equal_f32_pages_of_the_f16_rounded_values() {
    let kv = Kv::random(300, 2, 9);
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|v| f16::from_f32(*v).to_f32()).collect() };
    let rounded = Kv {
        n_kv_heads: 2,
        k: round(&kv.k),
        v: round(&kv.v),
    };
    for page_size in [16, 4096] {
        let h = kv.cache(page_size, KvDtype::F16);
        let f = rounded.cache(page_size, KvDtype::F32);
        let q = queries(40, 6, 10);
        let a = h.attend(&q, 40, 6, 260, scale());
        let b = f.attend(&q, 40, 6, 260, scale());
        assert_eq!(bits(&a.o), bits(&b.o), "page {page_size}");
        assert_eq!(bits(&a.lse), bits(&b.lse), "page {page_size}");
    }
}

#[test]
fn continuing_a_fold_from_a_prefix_partial_gives_the_same_bits() {
    let kv = Kv::random(300, 2, 12);
    let cache = kv.cache(64, KvDtype::F16);
    let q = queries(20, 4, 13);
    let all = cache.attend(&q, 20, 4, 280, scale());
    for split in 0..=cache.pages().len() {
        let (head, tail) = cache.pages().split_at(split);
        let worker = attend_pages(&q, 20, 4, 280, head, scale(), None);
        let host = attend_pages(&q, 20, 4, 280, tail, scale(), Some(worker));
        assert_eq!(bits(&host.o), bits(&all.o), "split at page {split}");
        assert_eq!(bits(&host.lse), bits(&all.lse), "split at page {split}");
    }
}

#[test]
fn a_query_alone_gets_the_same_bits_as_inside_a_batch() {
    // 3000 keys in one page: a single decode query takes the key-segment-parallel path, the batch the
    // token-parallel path; the fixed segment order makes them agree bit for bit.
    let kv = Kv::random(3000, 2, 14);
    let cache = kv.cache(4096, KvDtype::F32);
    let q = queries(64, 6, 15);
    let batch = cache.attend(&q, 64, 6, 2936, scale());
    for t in [0, 31, 63] {
        let alone = cache.attend(&q[t * 6 * D..(t + 1) * 6 * D], 1, 6, 2936 + t, scale());
        assert_eq!(
            bits(&alone.o),
            bits(&batch.o[t * 6 * D..(t + 1) * 6 * D]),
            "token {t}"
        );
        assert_eq!(
            bits(&alone.lse),
            bits(&batch.lse[t * 6..(t + 1) * 6]),
            "token {t}"
        );
    }
}

#[test]
fn attention_is_bit_identical_for_any_thread_count() {
    let kv = Kv::random(3000, 2, 16);
    let cache = kv.cache(1024, KvDtype::F16);
    let single = kv.cache(4096, KvDtype::F16);
    let q = queries(33, 4, 17);
    let run = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("thread pool");
        pool.install(|| {
            (
                cache.attend(&q, 33, 4, 2967, scale()),
                single.attend(&q[..4 * D], 1, 4, 2999, scale()),
            )
        })
    };
    let first = run(1);
    for threads in [1, 2, 3, 8] {
        let again = run(threads);
        assert_eq!(bits(&again.0.o), bits(&first.0.o), "{threads} threads");
        assert_eq!(bits(&again.0.lse), bits(&first.0.lse), "{threads} threads");
        assert_eq!(
            bits(&again.1.o),
            bits(&first.1.o),
            "{threads} threads, decode"
        );
    }
}

#[test]
fn a_single_page_partial_matches_the_reference_over_that_page() {
    // attend_page on its own (not through the cache): page starting at 128, queries from 150.
    let kv = Kv::random(64, 1, 18);
    let mut page = KvPage::new(128, 64, 1, D, KvDtype::F32);
    page.append(&kv.k, &kv.v, 64);
    let q = queries(5, 3, 19);
    let p = attend_page(&q, 5, 3, 150, &page, scale());
    // The reference sees positions 0..; shift the queries so that they see the same page rows.
    let reference = attention_reference(&q, 5, 3, 150 - 128, &kv.k, &kv.v, 1, D, scale());
    assert_close_rel("page partial", &p.o, &reference, REF_TOL);
}

#[test]
#[should_panic(expected = "positive multiple of n_kv_heads")]
fn attend_page_panics_when_heads_do_not_divide_into_kv_heads() {
    let page = KvPage::new(0, 16, 2, D, KvDtype::F32);
    attend_page(&vec![0.0; 3 * D], 1, 3, 0, &page, 1.0);
}

fn pbits(p: &Partial) -> (Vec<u32>, Vec<u32>) {
    (
        p.o.iter().map(|x| x.to_bits()).collect(),
        p.lse.iter().map(|x| x.to_bits()).collect(),
    )
}

/// A page's storage copied out (as it would cross the link) and viewed again.
fn copied(v: PageView<'_>) -> (Vec<u8>, Vec<u8>, KvDtype) {
    let raw = |r: RowsRef<'_>| match r {
        RowsRef::F16(d) => d.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        RowsRef::F32(d) => d.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
        RowsRef::Bf16(d) => d.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
    };
    let dt = match v.k() {
        RowsRef::F16(_) => KvDtype::F16,
        RowsRef::F32(_) => KvDtype::F32,
        RowsRef::Bf16(_) => KvDtype::Bf16,
    };
    (raw(v.k()), raw(v.v()), dt)
}

#[test]
fn partials_computed_anywhere_and_folded_in_page_order_keep_the_bits() {
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        let kv = Kv::random(300, 2, 40);
        let cache = kv.cache(64, dtype);
        let pages = cache.pages();
        for (n_tokens, pos0) in [(1usize, 299usize), (37, 263)] {
            let q = queries(n_tokens, 4, 41);
            let want = attend_pages(&q, n_tokens, 4, pos0, pages, scale(), None);
            // every page's partial computed on its own, then folded in page order
            let parts: Vec<Partial> = pages
                .iter()
                .filter_map(|p| page_partial(&q, n_tokens, 4, pos0, p.view(), scale()))
                .collect();
            let mut acc = Partial::empty(n_tokens, 4, D);
            fold_partials(&mut acc, &parts);
            assert_eq!(pbits(&acc), pbits(&want), "{dtype:?} {n_tokens}");
            // a "worker" folds the first two pages from copies of their bytes, the "host" continues with the rest
            let copies: Vec<_> = pages[..2].iter().map(|p| copied(p.view())).collect();
            let f16s: Vec<(Vec<half::f16>, Vec<half::f16>)>;
            let f32s: Vec<(Vec<f32>, Vec<f32>)>;
            let bf16s: Vec<(Vec<half::bf16>, Vec<half::bf16>)>;
            let views: Vec<PageView<'_>> = match dtype {
                KvDtype::F16 => {
                    let dec = |b: &[u8]| {
                        b.chunks_exact(2)
                            .map(|c| half::f16::from_le_bytes([c[0], c[1]]))
                            .collect()
                    };
                    f16s = copies.iter().map(|(k, v, _)| (dec(k), dec(v))).collect();
                    f16s.iter()
                        .zip(&pages[..2])
                        .map(|((k, v), p)| {
                            PageView::new(
                                p.start(),
                                p.len(),
                                2,
                                D,
                                RowsRef::F16(k),
                                RowsRef::F16(v),
                            )
                            .unwrap()
                        })
                        .collect()
                }
                KvDtype::F32 => {
                    let dec = |b: &[u8]| {
                        b.chunks_exact(4)
                            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                            .collect()
                    };
                    f32s = copies.iter().map(|(k, v, _)| (dec(k), dec(v))).collect();
                    f32s.iter()
                        .zip(&pages[..2])
                        .map(|((k, v), p)| {
                            PageView::new(
                                p.start(),
                                p.len(),
                                2,
                                D,
                                RowsRef::F32(k),
                                RowsRef::F32(v),
                            )
                            .unwrap()
                        })
                        .collect()
                }
                KvDtype::Bf16 => {
                    let dec = |b: &[u8]| {
                        b.chunks_exact(2)
                            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]))
                            .collect()
                    };
                    bf16s = copies.iter().map(|(k, v, _)| (dec(k), dec(v))).collect();
                    bf16s
                        .iter()
                        .zip(&pages[..2])
                        .map(|((k, v), p)| {
                            PageView::new(
                                p.start(),
                                p.len(),
                                2,
                                D,
                                RowsRef::Bf16(k),
                                RowsRef::Bf16(v),
                            )
                            .unwrap()
                        })
                        .collect()
                }
            };
            let prefix = fold_pages(&q, n_tokens, 4, pos0, views, scale(), Some(D), None);
            let rest = attend_pages(&q, n_tokens, 4, pos0, &pages[2..], scale(), Some(prefix));
            assert_eq!(
                pbits(&rest),
                pbits(&want),
                "{dtype:?} {n_tokens}: prefix elsewhere"
            );
        }
    }
}

#[test]
fn page_views_refuse_storage_that_does_not_fit() {
    let k = vec![0.0f32; 2 * D * 64];
    let short = vec![0.0f32; 2 * D * 64 - 1];
    let h = vec![half::f16::ZERO; 2 * D * 64];
    assert!(PageView::new(0, 64, 2, D, RowsRef::F32(&k), RowsRef::F32(&k)).is_ok());
    assert!(PageView::new(0, 1, 2, D, RowsRef::F32(&k), RowsRef::F32(&k)).is_ok());
    let e = PageView::new(0, 65, 2, D, RowsRef::F32(&k), RowsRef::F32(&k)).unwrap_err();
    assert_eq!(e.need, 2 * 2 * D * 64);
    assert!(PageView::new(0, 64, 2, D, RowsRef::F32(&short), RowsRef::F32(&k)).is_err());
    assert!(PageView::new(0, 64, 2, D, RowsRef::F32(&k), RowsRef::F16(&h)).is_err());
    assert!(PageView::new(0, 64, 0, D, RowsRef::F32(&k), RowsRef::F32(&k)).is_err());
    assert_eq!(
        PageView::new(0, usize::MAX, 2, D, RowsRef::F32(&k), RowsRef::F32(&k))
            .unwrap_err()
            .need,
        usize::MAX
    );
}
