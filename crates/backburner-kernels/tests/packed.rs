//! Frozen pages packed head-major (`PackedPage`): the attention kernel reads them with the same bits as the pages
//! they copy, for every dtype, shape, query batch and thread count.

use crate::common;

use backburner_kernels::attention::{attend_page, attend_pages, fold_pages, Partial};
use backburner_kernels::kv::{
    k_pair_offset, k_pair_tile_offset, v_pair_offset, v_pair_tile_offset, KvDtype, KvPage,
    PackedPage, PageLayout, PageView, RowsRef, KV_BLOCK,
};
use common::*;

/// A page of `len` random rows (capacity `cap`) starting at `start`.
fn page(start: usize, len: usize, cap: usize, hkv: usize, dim: usize, dtype: KvDtype) -> KvPage {
    let mut r = rng((start * 31 + len * 7 + dim) as u64);
    let n = len * hkv * dim;
    let (k, v) = (uniform(&mut r, n, -1.0, 1.0), uniform(&mut r, n, -1.0, 1.0));
    let mut p = KvPage::new(start, cap, hkv, dim, dtype);
    p.append(&k, &v, len);
    p
}

fn bits(p: &Partial) -> (Vec<u32>, Vec<u32>) {
    (
        p.o.iter().map(|x| x.to_bits()).collect(),
        p.lse.iter().map(|x| x.to_bits()).collect(),
    )
}

/// Query batches `(n_tokens, q_pos0)` around a page at `[start, start + len)`: decode after it, inside it and on
/// its first row; prefill from before it, across it and after it.
fn batches(start: usize, len: usize) -> Vec<(usize, usize)> {
    vec![
        (1, start + len + 5),
        (1, start + len / 2),
        (1, start),
        (5, start + len - 3),
        (40, start.saturating_sub(7)),
        (70, start + 10),
    ]
}

#[test]
fn packed_pages_give_the_same_bits_as_the_pages_they_copy() {
    // (n_heads, n_kv_heads, head_dim, page capacity, rows): GQA groups of 1 to 4, head dims off the 16-lane vector,
    // full and partly filled pages, a page of several key segments.
    let shapes = [
        (4, 2, 32, 128, 128),
        (6, 3, 48, 192, 192),
        (8, 2, 64, 64, 64),
        (2, 2, 20, 128, 100),
        (4, 1, 16, 2112, 2112),
    ];
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        for (n_heads, hkv, dim, cap, len) in shapes {
            let start = 3 * cap;
            let p = page(start, len, cap, hkv, dim, dtype);
            let packed = PackedPage::pack(p.view());
            assert_eq!(packed.view().layout(), PageLayout::HeadMajor);
            assert_eq!(
                (packed.start(), packed.len(), packed.dtype()),
                (start, len, dtype)
            );
            assert_eq!(packed.bytes(), p.bytes());
            for (n_tokens, pos0) in batches(start, len) {
                let q = uniform(&mut rng(pos0 as u64), n_tokens * n_heads * dim, -2.0, 2.0);
                let scale = (dim as f32).powf(-0.5);
                let want = attend_page(&q, n_tokens, n_heads, pos0, &p, scale);
                let got = attend_page(&q, n_tokens, n_heads, pos0, &packed, scale);
                let what =
                    format!("{dtype} {n_heads}/{hkv}/{dim} len {len}, {n_tokens} tokens at {pos0}");
                assert_eq!(bits(&got), bits(&want), "{what}");
                assert!(want.lse.iter().any(|l| l.is_finite()), "{what}: sees keys");
            }
        }
    }
}

#[test]
fn a_fold_over_packed_pages_equals_the_fold_over_the_pages_for_any_thread_count() {
    let (n_heads, hkv, dim, cap) = (8, 2, 32, 256);
    let pages: Vec<KvPage> = (0..5)
        .map(|i| page(i * cap, cap, cap, hkv, dim, KvDtype::F16))
        .collect();
    let packed: Vec<PackedPage> = pages.iter().map(|p| PackedPage::pack(p.view())).collect();
    for (n_tokens, pos0) in [(1, 5 * cap), (1, 3 * cap + 17), (9, 2 * cap - 4)] {
        let q = uniform(&mut rng(9), n_tokens * n_heads * dim, -2.0, 2.0);
        let scale = (dim as f32).powf(-0.5);
        let want = attend_pages(&q, n_tokens, n_heads, pos0, &pages, scale, None);
        for threads in [1, 2, 3] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("thread pool");
            let views = packed.iter().map(PackedPage::view);
            let got =
                pool.install(|| fold_pages(&q, n_tokens, n_heads, pos0, views, scale, None, None));
            assert_eq!(
                bits(&got),
                bits(&want),
                "{n_tokens} tokens at {pos0}, {threads} threads"
            );
        }
    }
}

#[test]
fn packing_a_packed_page_copies_it() {
    let p = page(64, 130, 192, 2, 24, KvDtype::F32);
    let once = PackedPage::pack(p.view());
    let twice = PackedPage::pack(once.view());
    let (RowsRef::F32(a), RowsRef::F32(b)) = (once.view().k(), twice.view().k()) else {
        panic!("f32 storage");
    };
    assert_eq!(a, b);
    assert!(PackedPage::pack(KvPage::new(0, 64, 2, 24, KvDtype::F16).view()).is_empty());
}

#[test]
fn packing_a_bf16_page_keeps_every_bit_in_the_head_major_order() {
    // Each head's blocks, K run then V run, copied bit for bit (inside a block in the tile order of the pair
    // layouts), lanes past len in the last block included; packing the packed copy again gives the same storage.
    let (hkv, dim, len) = (3, 40, 130);
    let p = page(64, len, 192, hkv, dim, KvDtype::Bf16);
    let packed = PackedPage::pack(p.view());
    assert_eq!(
        (packed.dtype(), packed.len(), packed.bytes()),
        (KvDtype::Bf16, len, 2 * len * hkv * dim * 2)
    );
    let (RowsRef::Bf16(k), RowsRef::Bf16(v)) = (p.view().k(), p.view().v()) else {
        panic!("bf16 storage");
    };
    let RowsRef::Bf16(kv) = packed.view().k() else {
        panic!("bf16 storage");
    };
    let (run, blocks) = (dim * KV_BLOCK, len.div_ceil(KV_BLOCK));
    assert_eq!(kv.len(), 2 * blocks * hkv * run);
    for h in 0..hkv {
        for b in 0..blocks {
            let from = (b * hkv + h) * run;
            let to = (h * blocks + b) * 2 * run;
            // Inside the block, K and V move from the link's pair layouts to the tile order.
            for lane in 0..KV_BLOCK {
                for d in 0..dim {
                    let (kt, kf) = (k_pair_tile_offset(lane, d), k_pair_offset(dim, lane, d));
                    assert_eq!(
                        kv[to + kt].to_bits(),
                        k[from + kf].to_bits(),
                        "K head {h} block {b} key {lane} dim {d}"
                    );
                    let (vt, vf) = (
                        v_pair_tile_offset(dim, lane, d),
                        v_pair_offset(dim, lane, d),
                    );
                    assert_eq!(
                        kv[to + run + vt].to_bits(),
                        v[from + vf].to_bits(),
                        "V head {h} block {b} key {lane} dim {d}"
                    );
                }
            }
        }
    }
    let twice = PackedPage::pack(packed.view());
    let RowsRef::Bf16(again) = twice.view().k() else {
        panic!("bf16 storage");
    };
    assert_eq!(again, kv);
}

#[test]
fn head_major_views_need_k_and_v_in_each_storage() {
    let (hkv, dim) = (2, 16);
    let one = vec![0.0f32; 64 * hkv * dim];
    let two = vec![0.0f32; 2 * one.len()];
    let view = |s| PageView::with_layout(0, 64, hkv, dim, PageLayout::HeadMajor, s, s);
    assert_eq!(view(RowsRef::F32(&one)).unwrap_err().need, two.len());
    assert!(view(RowsRef::F32(&two)).is_ok());
}

#[test]
fn bf16_views_need_an_even_head_dim() {
    // Storage big enough for either layout: f16 of head_dim 15 is fine, bf16 of 15 is refused (pairs of
    // dimensions), bf16 of 14 and 16 are fine.
    let hkv = 2;
    let h = vec![half::f16::ZERO; 2 * 64 * hkv * 16];
    let b = vec![half::bf16::ZERO; 2 * 64 * hkv * 16];
    for layout in [PageLayout::BlockMajor, PageLayout::HeadMajor] {
        let view = |dim, k, v| PageView::with_layout(0, 64, hkv, dim, layout, k, v);
        assert!(view(15, RowsRef::F16(&h), RowsRef::F16(&h)).is_ok());
        for dim in [14, 16] {
            assert!(
                view(dim, RowsRef::Bf16(&b), RowsRef::Bf16(&b)).is_ok(),
                "{dim}"
            );
        }
        let e = view(15, RowsRef::Bf16(&b), RowsRef::Bf16(&b)).unwrap_err();
        assert_eq!((e.head_dim, e.k, e.v), (15, b.len(), b.len()), "{layout:?}");
        assert!(e.to_string().contains("even head_dim"), "{e}");
        // K and V in different 2-byte dtypes are refused as any mix is
        assert!(view(16, RowsRef::Bf16(&b), RowsRef::F16(&h)).is_err());
    }
    assert!(PageView::new(0, 64, hkv, 15, RowsRef::Bf16(&b), RowsRef::Bf16(&b)).is_err());
    assert!(PageView::new(0, 64, hkv, 16, RowsRef::Bf16(&b), RowsRef::Bf16(&b)).is_ok());
}
