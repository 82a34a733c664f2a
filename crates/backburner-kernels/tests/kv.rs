//! Paged KV cache bookkeeping: pages, reads across pages, truncation, byte counts, f16 and bf16 storage.

use crate::common;

use backburner_kernels::attention::fold_pages;
use backburner_kernels::kv::{
    k_pair_offset, v_pair_offset, KvDtype, KvError, KvPage, PagedKvCache, RowsRef, KV_BLOCK,
};
use common::*;
use half::{bf16, f16};

const HEADS: usize = 2;
const DIM: usize = 32;
const ROW: usize = HEADS * DIM;

fn rows(n: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let mut r = rng(seed);
    (
        uniform(&mut r, n * ROW, -1.0, 1.0),
        uniform(&mut r, n * ROW, -1.0, 1.0),
    )
}

#[test]
fn append_opens_pages_at_boundaries_and_fills_them_in_order() {
    let mut c = PagedKvCache::new(16, HEADS, DIM, KvDtype::F32);
    assert!(c.is_empty());
    let (k, v) = rows(26, 1);
    c.append(&k[..5 * ROW], &v[..5 * ROW], 5);
    c.append(&k[5 * ROW..25 * ROW], &v[5 * ROW..25 * ROW], 20);
    c.append(&k[25 * ROW..], &v[25 * ROW..], 1);
    assert_eq!(c.len(), 26);
    let shape: Vec<(usize, usize, bool)> = c
        .pages()
        .iter()
        .map(|p| (p.start(), p.len(), p.is_full()))
        .collect();
    assert_eq!(shape, vec![(0, 16, true), (16, 10, false)]);
    assert!(c.pages().iter().all(|p| p.capacity() == 16));
    let (rk, rv) = c.read_rows(0, 26);
    assert_eq!(rk, k);
    assert_eq!(rv, v);
}

#[test]
fn read_rows_spans_several_pages() {
    let mut c = PagedKvCache::new(16, HEADS, DIM, KvDtype::F32);
    let (k, v) = rows(50, 2);
    c.append(&k, &v, 50);
    for (p0, p1) in [(3, 40), (16, 32), (15, 17), (49, 50), (7, 7)] {
        let (rk, rv) = c.read_rows(p0, p1);
        assert_eq!(rk, &k[p0 * ROW..p1 * ROW], "[{p0}, {p1})");
        assert_eq!(rv, &v[p0 * ROW..p1 * ROW], "[{p0}, {p1})");
    }
}

#[test]
fn truncating_into_a_page_and_appending_again_equals_never_having_appended() {
    let (k, v) = rows(60, 3);
    let (k2, v2) = rows(30, 4);
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        let mut a = PagedKvCache::new(16, HEADS, DIM, dtype);
        a.append(&k[..45 * ROW], &v[..45 * ROW], 45);
        a.truncate(21);
        assert_eq!(a.len(), 21);
        assert_eq!(a.pages().len(), 2, "the empty third page is dropped");
        a.append(&k2, &v2, 30);

        let mut b = PagedKvCache::new(16, HEADS, DIM, dtype);
        b.append(&k[..21 * ROW], &v[..21 * ROW], 21);
        b.append(&k2, &v2, 30);
        assert_eq!(a, b, "{dtype}");
        assert_eq!(a.read_rows(0, 51), b.read_rows(0, 51));
    }
}

#[test]
fn truncating_at_a_page_boundary_drops_the_pages_after_it() {
    let mut c = PagedKvCache::new(16, HEADS, DIM, KvDtype::F32);
    let (k, v) = rows(40, 5);
    c.append(&k, &v, 40);
    c.truncate(32);
    assert_eq!(c.pages().len(), 2);
    assert!(c.pages().iter().all(KvPage::is_full));
    c.truncate(100);
    assert_eq!(c.len(), 32, "truncating past the end changes nothing");
    c.truncate(0);
    assert!(c.is_empty());
    assert!(c.pages().is_empty());
    assert_eq!(c.bytes(), 0);
}

#[test]
fn bytes_count_the_stored_rows_exactly() {
    let (k, v) = rows(300, 6);
    let mut h = PagedKvCache::new(64, HEADS, DIM, KvDtype::F16);
    h.append(&k, &v, 300);
    assert_eq!(h.bytes(), 300 * 2 * 32 * 2 * 2);
    let mut f = PagedKvCache::new(64, HEADS, DIM, KvDtype::F32);
    f.append(&k, &v, 300);
    assert_eq!(f.bytes(), 300 * 2 * 32 * 2 * 4);
    assert_eq!(f.pages()[4].bytes(), 44 * 2 * 32 * 2 * 4);
    f.truncate(100);
    assert_eq!(f.bytes(), 100 * 2 * 32 * 2 * 4);
    let mut b = PagedKvCache::new(64, HEADS, DIM, KvDtype::Bf16);
    b.append(&k, &v, 300);
    assert_eq!(b.bytes(), 300 * 2 * 32 * 2 * 2);
    assert_eq!(b.pages()[4].bytes(), 44 * 2 * 32 * 2 * 2);
}

#[test]
fn f16_pages_store_values_rounded_to_nearest_f16() {
    let (k, v) = rows(20, 7);
    let mut c = PagedKvCache::new(8, HEADS, DIM, KvDtype::F16);
    c.append(&k, &v, 20);
    let (rk, rv) = c.read_rows(0, 20);
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|a| f16::from_f32(*a).to_f32()).collect() };
    assert_eq!(rk, round(&k));
    assert_eq!(rv, round(&v));
    assert_ne!(rk, k, "f16 storage does round");
}

#[test]
fn bf16_pages_store_values_rounded_to_nearest_bf16() {
    let (k, v) = rows(20, 7);
    let mut c = PagedKvCache::new(8, HEADS, DIM, KvDtype::Bf16);
    c.append(&k, &v, 20);
    let (rk, rv) = c.read_rows(0, 20);
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|a| bf16::from_f32(*a).to_f32()).collect() };
    assert_eq!(rk, round(&k));
    assert_eq!(rv, round(&v));
    assert_ne!(rk, k, "bf16 storage does round");
    let f16s: Vec<f32> = k.iter().map(|a| f16::from_f32(*a).to_f32()).collect();
    assert_ne!(rk, f16s, "to bf16's 8 significant bits, not f16's 11");
    // ties go to the even neighbour, and bf16 keeps f32's range where f16 overflows or flushes
    let special = |i: usize| -> f32 {
        match i % 6 {
            0 => 1.0 + 2f32.powi(-8), // halfway between 1 and 1 + 2^-7: down to 1 (even)
            1 => 1.0 + 3.0 * 2f32.powi(-8), // halfway between 1 + 2^-7 and 1 + 2^-6: up to 1 + 2^-6 (even)
            2 => -(1.0 + 2f32.powi(-8) + 2f32.powi(-20)), // past halfway: away from -1
            3 => 1.0e20,                    // f16's max is 65504
            4 => 3.0e-30,                   // below f16's smallest subnormal
            _ => -0.0,
        }
    };
    let want = |i: usize| -> f32 {
        match i % 6 {
            0 => 1.0,
            1 => 1.0 + 2f32.powi(-6),
            2 => -(1.0 + 2f32.powi(-7)),
            3 => bf16::from_f32(1.0e20).to_f32(),
            4 => bf16::from_f32(3.0e-30).to_f32(),
            _ => -0.0,
        }
    };
    let x: Vec<f32> = (0..3 * ROW).map(special).collect();
    let mut p = KvPage::new(0, 64, HEADS, DIM, KvDtype::Bf16);
    p.append(&x, &x, 3);
    let (mut ko, mut vo) = (vec![0.0; 3 * ROW], vec![0.0; 3 * ROW]);
    p.read_rows(0, 3, &mut ko, &mut vo);
    for i in 0..3 * ROW {
        assert_eq!(
            ko[i].to_bits(),
            want(i).to_bits(),
            "K element {i} ({})",
            x[i]
        );
        assert_eq!(
            vo[i].to_bits(),
            want(i).to_bits(),
            "V element {i} ({})",
            x[i]
        );
    }
    assert!((ko[3] / 1.0e20 - 1.0).abs() < 2f32.powi(-8) && ko[4] > 0.0);
}

#[test]
fn bf16_pages_keep_pairs_side_by_side_in_the_block_layout() {
    // K: dimensions 2i, 2i + 1 of a key adjacent ([`k_pair_offset`]); V: keys 2j, 2j + 1 of a dimension adjacent
    // ([`v_pair_offset`]); blocks of 64 positions, block-major then head. 150 rows: a partly filled third block,
    // appended in pieces of odd lengths (a V pair split across two appends).
    const DIM: usize = 24; // a last V chunk 8 wide
    let row = HEADS * DIM;
    let n = 150;
    let mut r = rng(13);
    let (k, v) = (
        uniform(&mut r, n * row, -1.0, 1.0),
        uniform(&mut r, n * row, -1.0, 1.0),
    );
    let mut p = KvPage::new(0, 192, HEADS, DIM, KvDtype::Bf16);
    let mut at = 0;
    for m in [1, 1, 63, 3, 82] {
        p.append(
            &k[at * row..(at + m) * row],
            &v[at * row..(at + m) * row],
            m,
        );
        at += m;
    }
    assert_eq!(at, n);
    let view = p.view();
    let (RowsRef::Bf16(ks), RowsRef::Bf16(vs)) = (view.k(), view.v()) else {
        panic!("bf16 storage");
    };
    assert!(ks.len() >= 3 * HEADS * DIM * KV_BLOCK && vs.len() == ks.len());
    for pos in 0..n {
        for h in 0..HEADS {
            let base = ((pos / KV_BLOCK) * HEADS + h) * DIM * KV_BLOCK;
            for d in 0..DIM {
                let i = (pos * HEADS + h) * DIM + d;
                let kat = base + k_pair_offset(DIM, pos % KV_BLOCK, d);
                let vat = base + v_pair_offset(DIM, pos % KV_BLOCK, d);
                assert_eq!(
                    ks[kat],
                    bf16::from_f32(k[i]),
                    "K pos {pos} head {h} dim {d}"
                );
                assert_eq!(
                    vs[vat],
                    bf16::from_f32(v[i]),
                    "V pos {pos} head {h} dim {d}"
                );
            }
        }
    }
    // the pair neighbours, spelled out: K dims 0, 1 of key 0 and V keys 0, 1 of dim 0 are elements 0 and 1
    assert_eq!((ks[0], ks[1]), (bf16::from_f32(k[0]), bf16::from_f32(k[1])));
    assert_eq!(
        (vs[0], vs[1]),
        (bf16::from_f32(v[0]), bf16::from_f32(v[row]))
    );
}

#[test]
#[should_panic(expected = "even head_dim")]
fn a_bf16_page_of_an_odd_head_dim_panics() {
    KvPage::new(0, 64, HEADS, 15, KvDtype::Bf16);
}

#[test]
fn a_page_reports_its_geometry() {
    let mut p = KvPage::new(4096, 4096, HEADS, DIM, KvDtype::F16);
    assert_eq!((p.start(), p.len(), p.capacity()), (4096, 0, 4096));
    assert!(p.is_empty() && !p.is_full());
    assert_eq!(
        (p.n_kv_heads(), p.head_dim(), p.dtype()),
        (HEADS, DIM, KvDtype::F16)
    );
    let (k, v) = rows(3, 8);
    p.append(&k, &v, 3);
    let mut ko = vec![0.0; ROW];
    let mut vo = vec![0.0; ROW];
    p.read_rows(1, 2, &mut ko, &mut vo);
    assert_eq!(ko[0], f16::from_f32(k[ROW]).to_f32());
    p.truncate(1);
    assert_eq!(p.len(), 1);
    assert_eq!(p.bytes(), 2 * ROW * 2);
}

#[test]
#[should_panic(expected = "overflow the page")]
fn appending_past_a_page_capacity_panics() {
    let mut p = KvPage::new(0, 2, HEADS, DIM, KvDtype::F32);
    let (k, v) = rows(3, 9);
    p.append(&k, &v, 3);
}

#[test]
#[should_panic(expected = "out of range")]
fn reading_past_the_cache_length_panics() {
    let mut c = PagedKvCache::new(16, HEADS, DIM, KvDtype::F32);
    let (k, v) = rows(3, 10);
    c.append(&k, &v, 3);
    c.read_rows(2, 4);
}

#[test]
fn rows_appended_in_pieces_across_storage_growth_read_back_exactly() {
    // Pieces of 1, 7, 20 and 100 rows cross the transposed K storage's growth from 16 to 32, 64 and 128
    // positions; a truncation in the middle is then overwritten by new rows.
    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
        let (k, v) = rows(128, 11);
        let mut p = KvPage::new(0, 200, HEADS, DIM, dtype);
        let mut at = 0;
        for n in [1, 7, 20, 100] {
            p.append(
                &k[at * ROW..(at + n) * ROW],
                &v[at * ROW..(at + n) * ROW],
                n,
            );
            at += n;
        }
        let (mut ko, mut vo) = (vec![0.0; at * ROW], vec![0.0; at * ROW]);
        p.read_rows(0, at, &mut ko, &mut vo);
        let stored = |x: &[f32]| -> Vec<f32> {
            match dtype {
                KvDtype::F16 => x.iter().map(|a| f16::from_f32(*a).to_f32()).collect(),
                KvDtype::F32 => x.to_vec(),
                KvDtype::Bf16 => x.iter().map(|a| bf16::from_f32(*a).to_f32()).collect(),
            }
        };
        assert_eq!(ko, stored(&k[..at * ROW]), "{dtype} keys");
        assert_eq!(vo, stored(&v[..at * ROW]), "{dtype} values");
        p.truncate(50);
        let (k2, v2) = rows(10, 12);
        p.append(&k2, &v2, 10);
        let (mut ko, mut vo) = (vec![0.0; 60 * ROW], vec![0.0; 60 * ROW]);
        p.read_rows(0, 60, &mut ko, &mut vo);
        assert_eq!(&ko[..50 * ROW], &stored(&k[..50 * ROW])[..], "{dtype}");
        assert_eq!(&ko[50 * ROW..], &stored(&k2)[..], "{dtype}");
        assert_eq!(&vo[50 * ROW..], &stored(&v2)[..], "{dtype}");
    }
}

#[test]
fn the_oldest_pages_move_out_and_back_and_the_fold_continues_with_the_same_bits() {
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        let mut c = PagedKvCache::new(16, HEADS, DIM, dtype);
        let (k, v) = rows(70, 7);
        c.append(&k, &v, 70); // pages at 0, 16, 32, 48 (full) and 64 (6 rows)
        let whole = c.clone();
        assert_eq!(c.movable_pages(), 4);
        assert_eq!(
            c.take_oldest(5),
            Err(KvError::NotMovable {
                asked: 5,
                movable: 4
            })
        );
        let taken = c.take_oldest(2).unwrap();
        assert_eq!((c.offloaded(), c.len(), c.pages().len()), (32, 70, 3));
        assert_eq!(
            taken.iter().map(|p| p.start()).collect::<Vec<_>>(),
            vec![0, 16]
        );
        assert_eq!(
            c.bytes(),
            whole.bytes() - taken.iter().map(KvPage::bytes).sum::<usize>()
        );
        // the pages elsewhere fold first, the cache continues: same bits as the whole cache
        let q: Vec<f32> = uniform(&mut rng(8), 3 * 4 * DIM, -2.0, 2.0);
        let scale = (DIM as f32).powf(-0.5);
        let want = whole.attend(&q, 3, 4, 67, scale);
        let prefix = fold_pages(
            &q,
            3,
            4,
            67,
            taken.iter().map(KvPage::view),
            scale,
            Some(DIM),
            None,
        );
        let got = c.attend_after(prefix.clone(), &q, 3, 4, 67, scale);
        let b = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            (b(&got.o), b(&got.lse)),
            (b(&want.o), b(&want.lse)),
            "{dtype:?}"
        );
        // the host's own pages computed ahead (none fit, one, all) while the prefix is elsewhere: same bits
        let per_page = 3 * 4 * (DIM + 1) * 4;
        for max_bytes in [0, per_page, 2 * per_page + 1, usize::MAX] {
            let ahead = c.partials_ahead(&q, 3, 4, 67, scale, max_bytes);
            assert_eq!(ahead.len(), (max_bytes / per_page).clamp(1, 3));
            let got = c.attend_after_ahead(prefix.clone(), &ahead, &q, 3, 4, 67, scale);
            assert_eq!(
                (b(&got.o), b(&got.lse)),
                (b(&want.o), b(&want.lse)),
                "{dtype:?} ahead {max_bytes}"
            );
        }
        // queries that see only the first page here: the later pages' partials are None and skipped
        let early = c.partials_ahead(&q[..4 * DIM], 1, 4, 33, scale, usize::MAX);
        assert_eq!(
            early.iter().map(Option::is_some).collect::<Vec<_>>(),
            [true, false, false]
        );
        // rows elsewhere cannot be read or cut here
        assert_eq!(
            c.try_read_rows(16, 40).unwrap_err(),
            KvError::Offloaded {
                offloaded: 32,
                from: 16
            }
        );
        assert_eq!(c.try_read_rows(32, 70).unwrap(), whole.read_rows(32, 70));
        assert!(c.try_truncate(31).is_err());
        // appending and truncating above the pages elsewhere work as before
        let mut d = c.clone();
        d.try_truncate(40).unwrap();
        assert_eq!((d.offloaded(), d.len(), d.pages().len()), (32, 40, 1));
        d.try_truncate(32).unwrap();
        assert!(d.pages().is_empty());
        let (k2, v2) = rows(20, 9);
        d.append(&k2, &v2, 20);
        assert_eq!(
            d.pages().iter().map(|p| p.start()).collect::<Vec<_>>(),
            vec![32, 48]
        );
        // only the pages taken last go back, in order, and then the cache is whole again
        let mut wrong = taken.clone();
        wrong.reverse();
        assert!(c.restore_oldest(wrong).is_err());
        assert!(c.restore_oldest(taken[1..].to_vec()).is_ok());
        assert_eq!(c.offloaded(), 16);
        assert!(c.restore_oldest(taken[1..].to_vec()).is_err());
        c.restore_oldest(taken[..1].to_vec()).unwrap();
        assert_eq!(c, whole);
    }
}
