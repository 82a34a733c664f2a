//! The bf16 pair kernel against a plain statement of its arithmetic (bit for bit, on every instruction set), against
//! the f64 reference (within bf16's rounding), and through packed pages and page folds.

use std::sync::atomic::Ordering;

use half::bf16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::super::online::RowState;
use super::super::page_kernel::{KEY_BLOCK, KEY_SEGMENT};
use super::super::{attend_page, attend_pages, Partial};
use super::pair;
use crate::kv::{KvDtype, KvPage, PackedPage};
use crate::reference::attention_reference;
use crate::simd::dp::dp_lane;
use crate::simd::{ISA_CAP, ISA_MAX};

fn uniform(r: &mut StdRng, n: usize, lo: f32, hi: f32) -> Vec<f32> {
    (0..n).map(|_| r.random_range(lo..hi)).collect()
}

fn bits(p: &Partial) -> (Vec<u32>, Vec<u32>) {
    let b = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect();
    (b(&p.o), b(&p.lse))
}

/// `x` rounded to bf16 (to nearest even).
fn rb(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// The kernel's arithmetic for one query row at a time, written out plainly: per key segment of 1024 and block of
/// 64, the score of key `j` is the chain `dp_lane` over the dimension pairs of the bf16 query and key; the f32 online
/// softmax rounds the weights to bf16; an output element is the chain over the block's key pairs (weights past the
/// visible keys 0); segments merge in order. K and V are read back from the page by position, not by layout.
fn plain(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    page: &KvPage,
    scale: f32,
) -> Partial {
    let (hkv, dim) = (page.n_kv_heads(), page.head_dim());
    let group = n_heads / hkv;
    let (mut k, mut v) = (
        vec![0.0; page.len() * hkv * dim],
        vec![0.0; page.len() * hkv * dim],
    );
    page.read_rows(0, page.len(), &mut k, &mut v);
    let kv_at = |j: usize, g: usize, d: usize| (j * hkv + g) * dim + d;
    let mut out = Partial::empty(n_tokens, n_heads, dim);
    for t in 0..n_tokens {
        let visible = (q_pos0 + t + 1)
            .saturating_sub(page.start())
            .min(page.len());
        for h in 0..n_heads {
            let g = h / group;
            let qr = &q[(t * n_heads + h) * dim..][..dim];
            let qp: Vec<u32> = qr
                .chunks(2)
                .map(|x| pair(rb(x[0] * scale), rb(x[1] * scale)))
                .collect();
            let mut st: Option<RowState> = None;
            for k0 in (0..visible).step_by(KEY_SEGMENT) {
                let mut seg = RowState::new(1, dim);
                for kb0 in (k0..visible.min(k0 + KEY_SEGMENT)).step_by(KEY_BLOCK) {
                    let nv = (visible - kb0).min(KEY_BLOCK);
                    let mut sc = vec![0.0f32; KEY_BLOCK];
                    for (j, s) in sc.iter_mut().enumerate().take(nv) {
                        let kj = |d: usize| rb(k[kv_at(kb0 + j, g, d)]);
                        *s = (0..dim / 2).fold(0.0, |a, i| {
                            dp_lane(a, qp[i], pair(kj(2 * i), kj(2 * i + 1)))
                        });
                    }
                    seg.softmax_bf16(0, &mut sc, nv);
                    let acc = seg.acc_from(0);
                    for (d, a) in acc.iter_mut().enumerate() {
                        for jp in 0..nv.div_ceil(2) {
                            let w = |j: usize| if j < nv { rb(sc[j]) } else { bf16::ZERO };
                            let vj = |j: usize| rb(v[kv_at((kb0 + j).min(page.len() - 1), g, d)]);
                            // Past `nv` the weight is 0; the kernel reads whatever the block holds there.
                            let vp = if 2 * jp + 1 < nv {
                                pair(vj(2 * jp), vj(2 * jp + 1))
                            } else {
                                pair(vj(2 * jp), bf16::ZERO)
                            };
                            *a = dp_lane(*a, vp, pair(w(2 * jp), w(2 * jp + 1)));
                        }
                    }
                }
                match &mut st {
                    None => st = Some(seg),
                    Some(s) => s.merge(&seg),
                }
            }
            if let Some(s) = st {
                s.finalize(&mut out, h, t, 1);
            }
        }
    }
    out
}

fn bf16_page(
    r: &mut StdRng,
    start: usize,
    len: usize,
    cap: usize,
    hkv: usize,
    dim: usize,
) -> KvPage {
    let mut page = KvPage::new(start, cap, hkv, dim, KvDtype::Bf16);
    page.append(
        &uniform(r, len * hkv * dim, -1.0, 1.0),
        &uniform(r, len * hkv * dim, -1.0, 1.0),
        len,
    );
    page
}

#[test]
fn the_pair_kernel_is_its_plain_arithmetic_on_every_instruction_set() {
    let mut r = StdRng::seed_from_u64(7);
    // (n_heads, n_kv_heads, head_dim, page length, query tokens, first query position): the 24/4 group of 6,
    // a dimension with a 8-wide last chunk (24), decode over several segments, a prefill batch inside the page.
    for (nh, hkv, dim, len, nt, p0) in [
        (6, 1, 64, 200, 37, 163),
        (24, 4, 256, 130, 1, 129),
        (4, 2, 24, 300, 5, 295),
        (2, 1, 32, 2500, 1, 2499),
        (8, 2, 128, 700, 40, 660),
    ] {
        let page = bf16_page(&mut r, 0, len, len.max(64), hkv, dim);
        let q = uniform(&mut r, nt * nh * dim, -2.0, 2.0);
        let scale = (dim as f32).powf(-0.5);
        let want = bits(&plain(&q, nt, nh, p0, &page, scale));
        for cap in (0..=3u8).rev() {
            ISA_CAP.store(cap, Ordering::SeqCst);
            let got = bits(&attend_page(&q, nt, nh, p0, &page, scale));
            ISA_CAP.store(ISA_MAX, Ordering::SeqCst);
            assert!(got == want, "{nh}/{hkv}/{dim}, {len} keys, {nt} tokens: cap {cap} differs from the plain arithmetic");
        }
    }
}

#[test]
fn bf16_pages_stay_within_bf16_rounding_of_the_f64_reference() {
    let mut r = StdRng::seed_from_u64(8);
    let (nh, hkv, dim, n) = (24, 4, 256, 600);
    let k = uniform(&mut r, n * hkv * dim, -1.0, 1.0);
    let v = uniform(&mut r, n * hkv * dim, -1.0, 1.0);
    let q = uniform(&mut r, 20 * nh * dim, -2.0, 2.0);
    let scale = (dim as f32).powf(-0.5);
    let worst = |dtype: KvDtype| {
        let mut page = KvPage::new(0, n, hkv, dim, dtype);
        page.append(&k, &v, n);
        let got = attend_page(&q, 20, nh, n - 20, &page, scale);
        let want = attention_reference(&q, 20, nh, n - 20, &k, &v, hkv, dim, scale);
        got.o
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max)
    };
    let (e16, eb16) = (worst(KvDtype::F16), worst(KvDtype::Bf16));
    // bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3) of keys, values, queries and weights; the outputs
    // are weighted means of values in [-1, 1] whose errors partly cancel. f16's 11 bits give ~8× less.
    assert!(eb16 < 1.5e-3, "bf16 worst |error| {eb16}");
    assert!(
        e16 < 2e-4 && e16 < eb16,
        "f16 worst |error| {e16} (bf16 {eb16})"
    );
}

#[test]
fn packed_bf16_pages_and_page_folds_keep_the_bits() {
    let mut r = StdRng::seed_from_u64(9);
    let (nh, hkv, dim) = (12, 2, 64);
    let pages: Vec<KvPage> = (0..3)
        .map(|i| bf16_page(&mut r, i * 128, 128, 128, hkv, dim))
        .collect();
    let q = uniform(&mut r, 9 * nh * dim, -2.0, 2.0);
    for page in &pages {
        let packed = PackedPage::pack(page.view());
        assert_eq!(packed.dtype(), KvDtype::Bf16);
        let a = bits(&attend_page(&q, 9, nh, 300, page, 0.125));
        assert!(
            a == bits(&attend_page(&q, 9, nh, 300, &packed, 0.125)),
            "packed page differs"
        );
    }
    // One page holding all 384 positions folds differently (one segment, not three merged partials), but both stay
    // close; the fold itself is the same on any machine.
    let fold = attend_pages(&q, 9, nh, 300, &pages, 0.125, None);
    let mut one = KvPage::new(0, 384, hkv, dim, KvDtype::Bf16);
    for p in &pages {
        let (mut k, mut v) = (vec![0.0; 128 * hkv * dim], vec![0.0; 128 * hkv * dim]);
        p.read_rows(0, 128, &mut k, &mut v);
        one.append(&k, &v, 128);
    }
    let whole = attend_page(&q, 9, nh, 300, &one, 0.125);
    let worst = fold
        .o
        .iter()
        .zip(&whole.o)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst < 2e-3, "fold vs one page: {worst}");
    assert!(fold.lse.iter().all(|x| x.is_finite()));
}
