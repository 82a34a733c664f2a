//! Attention over bf16 pages with bf16 dot products (`vdpbf16ps`, or its exact emulations: [`Dp`]).
//!
//! A bf16 page keeps pairs side by side inside each block ([`k_pair_offset`](crate::kv::k_pair_offset): dimensions
//! `2i, 2i + 1` of 16 keys in one vector; [`v_pair_offset`](crate::kv::v_pair_offset): keys `2j, 2j + 1` of 16
//! dimensions in one vector). A score is `Σ_i dp(q[2i], q[2i+1]; k[2i], k[2i+1])` over the query's pairs in order
//! with the query (pre-scaled in f32) rounded to bf16; an output element is `Σ_j dp(p[2j], p[2j+1]; v[2j], v[2j+1])`
//! over the block's key pairs in order with the softmax weights rounded to bf16 (0 past the visible keys), the
//! chains continuing across the blocks of a segment. Each `vdpbf16ps` lane does two fused steps per instruction
//! where the f16 kernel does one f32 fused multiply-add: half the arithmetic per byte of the page. The softmax, the
//! segment merge and the normalization are the f32 code of [`RowState`].

use half::bf16;

use super::online::RowState;
use super::page_kernel::{Ctx, KEY_BLOCK, KEY_SEGMENT};
use crate::kv::tiles::BlockWalk;
use crate::kv::{PageLayout, RowsRef, KV_LANES};
use crate::simd::dp::{dp_dispatch, dp_lane, Dp, DpKernel};
use crate::simd::prefetch_l2;

/// Pairs of keys per block.
const KEY_PAIRS: usize = KEY_BLOCK / 2;

/// The online softmax of the query rows of tokens `[t0, t1)`, kv head `g`, over key segment `seg` of a bf16 page,
/// with the CPU's best [`Dp`]: the same task as the f16 kernel's `run_segment`.
pub(super) fn segment(ctx: &Ctx<'_>, g: usize, t0: usize, t1: usize, seg: usize) -> RowState {
    dp_dispatch(PairJob {
        ctx,
        g,
        t0,
        t1,
        seg,
    })
}

struct PairJob<'a> {
    ctx: &'a Ctx<'a>,
    g: usize,
    t0: usize,
    t1: usize,
    seg: usize,
}

impl DpKernel for PairJob<'_> {
    type Out = RowState;

    #[inline(always)]
    fn run<D: Dp>(self, dp: D) -> RowState {
        run_segment(dp, self.ctx, self.g, self.t0, self.t1, self.seg)
    }
}

/// bf16 `x` and `y` as one pair (`x` in the low half, as `vdpbf16ps` reads element `2l`).
#[inline(always)]
fn pair(x: bf16, y: bf16) -> u32 {
    u32::from(x.to_bits()) | u32::from(y.to_bits()) << 16
}

#[inline(always)]
fn run_segment<D: Dp>(
    dp: D,
    ctx: &Ctx<'_>,
    g: usize,
    t0: usize,
    t1: usize,
    seg: usize,
) -> RowState {
    let dim = ctx.page.head_dim();
    let half = dim / 2;
    let r = ctx.group;
    let rows = (t1 - t0) * r;
    let mut st = RowState::new(rows, dim);
    let k0 = seg * KEY_SEGMENT;
    let k1 = (k0 + KEY_SEGMENT).min(ctx.visible(t1 - 1));
    if k0 >= k1 {
        return st;
    }
    // Queries scaled in f32 (as the f16 kernel does), then rounded to bf16 pairs: row = (t − t0)·r + hh.
    let mut qp = vec![0u32; rows * half];
    for t in t0..t1 {
        let src = &ctx.q[(t * ctx.n_heads + g * r) * dim..][..r * dim];
        let dst = &mut qp[(t - t0) * r * half..][..r * half];
        for (o, x) in dst.iter_mut().zip(src.chunks_exact(2)) {
            let q = |v: f32| bf16::from_f32(v * ctx.scale);
            *o = pair(q(x[0]), q(x[1]));
        }
    }
    if ctx.page.layout() == PageLayout::HeadMajor {
        let walk = BlockWalk::<true> { dim };
        segment_blocks(dp, ctx, (g, t0, t1), (k0, k1), &qp, walk, &mut st);
    } else {
        let walk = BlockWalk::<false> { dim };
        segment_blocks(dp, ctx, (g, t0, t1), (k0, k1), &qp, walk, &mut st);
    }
    st
}

/// The blocks of keys `[k0, k1)` of kv head `g` for the rows of tokens `[t0, t1)` (queries `qp` as bf16 pairs), the
/// page's blocks in order `T`: scores, softmax, values, into `st`.
#[inline(always)]
fn segment_blocks<D: Dp, const T: bool>(
    dp: D,
    ctx: &Ctx<'_>,
    (g, t0, t1): (usize, usize, usize),
    (k0, k1): (usize, usize),
    qp: &[u32],
    walk: BlockWalk<T>,
    st: &mut RowState,
) {
    let half = walk.dim / 2;
    let r = ctx.group;
    let rows = (t1 - t0) * r;
    let mut sc = vec![0.0f32; rows * KEY_BLOCK];
    let mut pp = vec![0u32; rows * KEY_PAIRS];
    let mut kb0 = k0;
    while kb0 < k1 {
        let nb = KEY_BLOCK.min(k1 - kb0);
        // Decode (few rows, one pass over the block): every line loaded also prefetches the same line of the block
        // read next ([`PageView::read_next`](crate::kv::PageView)), as the f16 kernel does. Prefill reads each block
        // once per tile of rows, from cache after the first.
        let (kb, vb, (ka, va)) = bf16_block(ctx, kb0 / KEY_BLOCK, g, kb0 + nb < k1);
        let ahead = (rows <= PREFETCH_ROWS).then_some((ka, va));
        // Tokens before `first` see nothing of this block (visibility grows with the token).
        let first = (t0..t1).find(|&t| ctx.visible(t) > kb0).unwrap_or(t1);
        let row0 = (first - t0) * r;
        let ka = ahead.map(|a| a.0);
        scores(
            dp,
            &qp[row0 * half..],
            (kb, ka),
            walk,
            &mut sc[row0 * KEY_BLOCK..],
        );
        for t in first..t1 {
            let nv = (ctx.visible(t) - kb0).min(nb);
            let row_range = (t - t0) * r..(t - t0 + 1) * r;
            for row in row_range.clone() {
                let s = &mut sc[row * KEY_BLOCK..(row + 1) * KEY_BLOCK];
                st.softmax_bf16(row, s, nv);
                weight_pairs(&s[..nv], &mut pp[row * KEY_PAIRS..(row + 1) * KEY_PAIRS]);
            }
            let p = &pp[row_range.start * KEY_PAIRS..row_range.end * KEY_PAIRS];
            let va = ahead.map(|a| a.1);
            let (acc, np) = (st.acc_from(row_range.start), nv.div_ceil(2));
            values(dp, acc, p, r, np, (vb, va), walk);
        }
        kb0 += nb;
    }
}

/// At most this many query rows per task prefetch the next block (decode: one token's GQA group).
const PREFETCH_ROWS: usize = 8;

/// Block `b` of kv head `g` of a bf16 page: its K and V runs (`head_dim · 64` elements each), and where a decode
/// reading it prefetches ([`PageView::read_next`](crate::kv::PageView); `more`: blocks of the segment follow).
#[inline(always)]
#[allow(clippy::type_complexity)]
fn bf16_block<'a>(
    ctx: &Ctx<'a>,
    b: usize,
    g: usize,
    more: bool,
) -> (&'a [bf16], &'a [bf16], (*const bf16, *const bf16)) {
    let n = ctx.page.head_dim() * KEY_BLOCK;
    let (pk, pv) = ctx.page.read_next(b, g, more);
    match ctx.page.block(b, g) {
        (RowsRef::Bf16(k), k_at, RowsRef::Bf16(v), v_at) => (
            &k[k_at..k_at + n],
            &v[v_at..v_at + n],
            // Prefetch addresses only (wrapping: they may lie past the storage).
            (k.as_ptr().wrapping_add(pk), v.as_ptr().wrapping_add(pv)),
        ),
        _ => unreachable!("the pair kernel runs on bf16 pages"),
    }
}

/// `out[j] = (w[2j], w[2j + 1])` as bf16 pairs, 0 past `w.len()`; the weights are bf16 values already, so their
/// high halves are exact.
#[inline(always)]
fn weight_pairs(w: &[f32], out: &mut [u32]) {
    let whole = w.len() / 2;
    for (o, x) in out.iter_mut().zip(w.chunks_exact(2)) {
        *o = (x[0].to_bits() >> 16) | (x[1].to_bits() & 0xffff_0000);
    }
    if w.len() % 2 == 1 {
        out[whole] = w[w.len() - 1].to_bits() >> 16;
    }
}

/// `sc[row][j] = Σ_i dp(q pair i, key j's pair i)` for every row of `qp` (`[_, dim / 2]` pairs) and the 64 keys of
/// the block `kb` ([`k_pair_offset`](crate::kv::k_pair_offset)), in tiles of 6 or 4 rows × all 4 key vectors with
/// 32 registers, 4 rows × one key vector with 16; every tile runs the same chains.
#[inline(always)]
fn scores<D: Dp, const T: bool>(
    dp: D,
    qp: &[u32],
    (kb, ka): (&[bf16], Option<*const bf16>),
    walk: BlockWalk<T>,
    sc: &mut [f32],
) {
    let dim = walk.dim;
    const NV: usize = KEY_BLOCK / KV_LANES;
    let half = dim / 2;
    let rows = qp.len() / half;
    let mut r0 = 0;
    while D::WIDE && rows - r0 >= 6 && !(rows - r0).is_multiple_of(4) {
        score_tile::<D, 6, NV, T>(
            dp,
            &qp[r0 * half..],
            (kb, ka),
            walk,
            &mut sc[r0 * KEY_BLOCK..],
            0,
        );
        r0 += 6;
    }
    while r0 + 4 <= rows {
        let sc = &mut sc[r0 * KEY_BLOCK..];
        if D::WIDE {
            score_tile::<D, 4, NV, T>(dp, &qp[r0 * half..], (kb, ka), walk, sc, 0);
        } else {
            for v0 in 0..NV {
                score_tile::<D, 4, 1, T>(dp, &qp[r0 * half..], (kb, ka), walk, sc, v0);
            }
        }
        r0 += 4;
    }
    while r0 < rows {
        let sc = &mut sc[r0 * KEY_BLOCK..];
        if D::WIDE {
            score_tile::<D, 1, NV, T>(dp, &qp[r0 * half..], (kb, ka), walk, sc, 0);
        } else {
            for v0 in 0..NV {
                score_tile::<D, 1, 1, T>(dp, &qp[r0 * half..], (kb, ka), walk, sc, v0);
            }
        }
        r0 += 1;
    }
}

/// Scores of rows `0..R` against key vectors `v0..v0 + NV` of the block (keys `16·v0..16·(v0 + NV)`); with `ka`,
/// each load also prefetches the same line of the block at `ka` (a hint only: never dereferenced).
#[inline(always)]
fn score_tile<D: Dp, const R: usize, const NV: usize, const T: bool>(
    dp: D,
    qp: &[u32],
    (kb, ka): (&[bf16], Option<*const bf16>),
    walk: BlockWalk<T>,
    sc: &mut [f32],
    v0: usize,
) {
    let half = walk.dim / 2;
    // Every index below is checked here, once.
    assert!(
        qp.len() >= R * half
            && (v0 + NV) * KV_LANES <= KEY_BLOCK
            && kb.len() >= 2 * half * KEY_BLOCK
            && sc.len() >= (R - 1) * KEY_BLOCK + (v0 + NV) * KV_LANES
    );
    // Pair i of lane group v sits at u32 index start + i·step of the block ([`BlockWalk::k`]): (v·half + i)·16 in
    // the link's block layout, i·64 + v·16 in tile order.
    let kp = kb.as_ptr().cast::<u32>();
    let mut acc = [[dp.zero(); NV]; R];
    let walks: [(usize, usize); NV] = std::array::from_fn(|v| walk.k(v0 + v, half));
    for i in 0..half {
        let mut kv = [dp.splat_pair(0); NV];
        for (v, x) in kv.iter_mut().enumerate() {
            let at = walks[v].0 + i * walks[v].1;
            if let Some(a) = ka {
                prefetch_l2(a.cast::<u32>().wrapping_add(at).cast());
            }
            // SAFETY: at + 16 ≤ 4·half·16 u32s = dim·64 bf16 ≤ kb.len() (asserted above) in either order.
            *x = unsafe { dp.load_pairs(kp.add(at)) };
        }
        for (rr, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: rr·half + i < R·half ≤ qp.len() (asserted above).
            let qv = dp.splat_pair(unsafe { *qp.get_unchecked(rr * half + i) });
            for (a, k) in acc_r.iter_mut().zip(&kv) {
                *a = dp.dp(*a, *k, qv);
            }
        }
    }
    for (rr, acc_r) in acc.iter().enumerate() {
        for (v, a) in acc_r.iter().enumerate() {
            let at = rr * KEY_BLOCK + (v0 + v) * KV_LANES;
            // SAFETY: at + 16 ≤ sc.len() (asserted above).
            unsafe { dp.store_acc(*a, sc.as_mut_ptr().add(at)) };
        }
    }
}

/// Rows `0..n` of `acc` (`[n, dim]`) add `Σ_j dp(weight pair j, value pair j)` over the first `npairs` key pairs of
/// the block `vb` ([`v_pair_offset`](crate::kv::v_pair_offset)), with their weight pairs in `p` (`[n][32]`): tiles
/// of up to 6 rows × 64 dimensions with 32 registers, single chunks of 16 dimensions otherwise, then the dimensions
/// past the last whole chunk one by one; each output element is one chain over the pairs in order.
#[inline(always)]
fn values<D: Dp, const T: bool>(
    dp: D,
    acc: &mut [f32],
    p: &[u32],
    n: usize,
    npairs: usize,
    vb: (&[bf16], Option<*const bf16>),
    walk: BlockWalk<T>,
) {
    let dim = walk.dim;
    let mut r = 0;
    while r < n {
        let left = n - r;
        let (a, w) = (&mut acc[r * dim..], &p[r * KEY_PAIRS..]);
        if D::WIDE && left >= 6 && !left.is_multiple_of(4) {
            value_rows::<D, 6, T>(dp, a, w, npairs, vb, walk);
            r += 6;
        } else if left >= 4 {
            value_rows::<D, 4, T>(dp, a, w, npairs, vb, walk);
            r += 4;
        } else if left >= 2 {
            value_rows::<D, 2, T>(dp, a, w, npairs, vb, walk);
            r += 2;
        } else {
            value_rows::<D, 1, T>(dp, a, w, npairs, vb, walk);
            r += 1;
        }
    }
}

#[inline(always)]
fn value_rows<D: Dp, const R: usize, const T: bool>(
    dp: D,
    acc: &mut [f32],
    p: &[u32],
    npairs: usize,
    (vb, va): (&[bf16], Option<*const bf16>),
    walk: BlockWalk<T>,
) {
    let dim = walk.dim;
    let chunks = dim / KV_LANES;
    let mut c0 = 0;
    while D::WIDE && c0 + 4 <= chunks {
        value_cols::<D, R, 4, T>(dp, acc, p, npairs, (vb, va), walk, c0);
        c0 += 4;
    }
    while c0 < chunks {
        value_cols::<D, R, 1, T>(dp, acc, p, npairs, (vb, va), walk, c0);
        c0 += 1;
    }
    // The last chunk, `dim mod 16` wide, element by element.
    let w = dim % KV_LANES;
    for rr in 0..R {
        for d in 0..w {
            let at = &mut acc[rr * dim + chunks * KV_LANES + d];
            for j in 0..npairs {
                let e = walk.v_at(2 * j, chunks * KV_LANES + d, true);
                *at = dp_lane(*at, pair(vb[e], vb[e + 1]), p[rr * KEY_PAIRS + j]);
            }
        }
    }
}

/// Rows `0..R` × chunks `c0..c0 + NV` (16 dimensions each) of the values' chains over the block's first `npairs`
/// key pairs; with `va`, each load also prefetches the same line of the block at `va` (a hint only).
#[inline(always)]
fn value_cols<D: Dp, const R: usize, const NV: usize, const T: bool>(
    dp: D,
    acc: &mut [f32],
    p: &[u32],
    npairs: usize,
    (vb, va): (&[bf16], Option<*const bf16>),
    walk: BlockWalk<T>,
    c0: usize,
) {
    let dim = walk.dim;
    // Every index of the loop is checked here, once.
    assert!(
        (c0 + NV) * KV_LANES <= dim
            && npairs <= KEY_PAIRS
            && p.len() >= (R - 1) * KEY_PAIRS + npairs
            && vb.len() >= dim * KEY_BLOCK
            && acc.len() >= (R - 1) * dim + (c0 + NV) * KV_LANES
    );
    let mut a = [[dp.zero(); NV]; R];
    for (rr, ar) in a.iter_mut().enumerate() {
        for (i, ai) in ar.iter_mut().enumerate() {
            // SAFETY: rr·dim + (c0 + i)·16 + 16 ≤ acc.len() (asserted above).
            *ai = unsafe { dp.load_acc(acc.as_ptr().add(rr * dim + (c0 + i) * KV_LANES)) };
        }
    }
    // Key pair j of chunk c: u32 index start + j·step ([`BlockWalk::v`]): (c·16·64)/2 + j·16 in the link's block
    // layout, (c's quad)·64·64/2 + j·w + (c mod 4)·16 in tile order.
    let vp = vb.as_ptr().cast::<u32>();
    let walks: [(usize, usize); NV] = std::array::from_fn(|i| walk.v(c0 + i, true));
    for j in 0..npairs {
        let mut vv = [dp.splat_pair(0); NV];
        for (i, x) in vv.iter_mut().enumerate() {
            let at = walks[i].0 + j * walks[i].1;
            if let Some(a) = va {
                prefetch_l2(a.cast::<u32>().wrapping_add(at).cast());
            }
            // SAFETY: at + 16 ≤ dim·32 u32s = dim·64 bf16 ≤ vb.len() (asserted above): chunk c0 + i is whole and
            // j < 32 in either order.
            *x = unsafe { dp.load_pairs(vp.add(at)) };
        }
        for (rr, ar) in a.iter_mut().enumerate() {
            // SAFETY: rr·32 + j < (R − 1)·32 + npairs ≤ p.len() (asserted above).
            let pv = dp.splat_pair(unsafe { *p.get_unchecked(rr * KEY_PAIRS + j) });
            for (ai, x) in ar.iter_mut().zip(&vv) {
                *ai = dp.dp(*ai, *x, pv);
            }
        }
    }
    for (rr, ar) in a.iter().enumerate() {
        for (i, ai) in ar.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { dp.store_acc(*ai, acc.as_mut_ptr().add(rr * dim + (c0 + i) * KV_LANES)) };
        }
    }
}

#[cfg(test)]
#[path = "pair_tests.rs"]
mod tests;
