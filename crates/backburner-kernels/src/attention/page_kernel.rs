//! Causal attention of a batch of queries over one KV page, as a [`Partial`].

use super::online::RowState;
use super::Partial;
use half::f16;

use crate::kv::tiles::BlockWalk;
use crate::kv::{PageLayout, PageView, RowsRef, KV_BLOCK, KV_LANES};
use crate::parallel::{for_each_chunk_mut, threads};
use crate::simd::{dispatch, f16_to_f32, prefetch_l2, scale, Isa, Kernel, LANES};

/// Keys per block: the page's storage block ([`KV_BLOCK`]).
pub(super) const KEY_BLOCK: usize = KV_BLOCK;
const _: () = assert!(
    KEY_SEGMENT.is_multiple_of(KEY_BLOCK) && KEY_BLOCK.is_multiple_of(LANES) && KV_LANES == LANES
);

/// Keys per segment. A row's softmax runs online over the blocks of a segment; segment partials are then
/// merged in order. Fixed, so the bits never depend on how the work is spread over threads.
pub(super) const KEY_SEGMENT: usize = 1024;
/// Query tokens per task (times the GQA group size in query rows).
const TOKEN_BLOCK: usize = 16;

/// Causal attention partial of queries over one page.
///
/// * `q`: `[n_tokens, n_heads, head_dim]` f32, queries at absolute positions `q_pos0..q_pos0 + n_tokens`
///   (post q_norm and RoPE); a query at position `p` sees the page's keys at positions `<= p`;
/// * GQA: query head `h` uses kv head `h / (n_heads / n_kv_heads)` (consecutive query heads share one);
/// * `scale`: multiplies the scores `q·k` (`head_dim^-0.5` for Qwen3.5).
///
/// Returns the [`Partial`] with `o: [n_tokens, n_heads, head_dim]`, `lse: [n_tokens, n_heads]`
/// (`-inf` and 0 for queries that see no key of this page). Softmax in f32, online over key blocks
/// (FlashAttention, Dao et al. 2022; Milakov & Gimelshein 2018), f16 keys/values converted exactly to f32. bf16
/// pages are multiplied with bf16 dot products instead (queries and softmax weights rounded to bf16; see
/// [`KvDtype::Bf16`](crate::kv::KvDtype::Bf16)), every instruction set giving the same bits.
///
/// Work is split over rayon tasks (kv head × token block, and over fixed key segments when there are few
/// such tasks, e.g. decode). Each output row is computed by the same sequence of f32 operations whatever the
/// split, the thread count, or the other queries in the batch: bit-deterministic, and a query attended
/// alone gives the same bits as inside a batch.
///
/// Panics if `n_heads` is not a positive multiple of `page.n_kv_heads()` or `q` has the wrong length.
pub fn attend_page<'p>(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    page: impl Into<PageView<'p>>,
    scale: f32,
) -> Partial {
    let page = page.into();
    let (hkv, dim) = (page.n_kv_heads(), page.head_dim());
    assert!(
        n_heads > 0 && n_heads.is_multiple_of(hkv),
        "attend_page: n_heads ({n_heads}) must be a positive multiple of n_kv_heads ({hkv})"
    );
    assert_eq!(
        q.len(),
        n_tokens * n_heads * dim,
        "attend_page: `q` must have shape [{n_tokens}, {n_heads}, {dim}]"
    );
    let mut out = Partial::empty(n_tokens, n_heads, dim);
    let ctx = Ctx {
        q,
        n_heads,
        group: n_heads / hkv,
        q_pos0,
        page,
        scale,
    };
    if n_tokens == 0 || ctx.visible(n_tokens - 1) == 0 {
        return out;
    }
    // Tokens before the page start see none of it and stay empty.
    let t_first = page.start().saturating_sub(q_pos0);
    let mut tasks = Vec::new();
    for g in 0..hkv {
        let mut t0 = t_first;
        while t0 < n_tokens {
            let t1 = (t0 + TOKEN_BLOCK).min(n_tokens);
            tasks.push((g, t0, t1));
            t0 = t1;
        }
    }
    let n_seg = ctx.visible(n_tokens - 1).div_ceil(KEY_SEGMENT);
    let results: Vec<RowState> = if n_seg == 1 || tasks.len() >= 2 * threads() {
        each_state(tasks.len(), |i| {
            let (g, t0, t1) = tasks[i];
            let mut st = ctx.run_segment(g, t0, t1, 0);
            for s in 1..n_seg {
                st.merge(&ctx.run_segment(g, t0, t1, s));
            }
            st
        })
    } else {
        let parts = each_state(tasks.len() * n_seg, |i| {
            let (g, t0, t1) = tasks[i / n_seg];
            ctx.run_segment(g, t0, t1, i % n_seg)
        });
        let mut it = parts.into_iter();
        let mut merged = Vec::with_capacity(tasks.len());
        for _ in 0..tasks.len() {
            let mut st = it.next().expect("one state per segment");
            for _ in 1..n_seg {
                st.merge(&it.next().expect("one state per segment"));
            }
            merged.push(st);
        }
        merged
    };
    for (&(g, t0, _), st) in tasks.iter().zip(&results) {
        st.finalize(&mut out, g, t0, ctx.group);
    }
    out
}

/// `[f(0), f(1), …, f(n - 1)]`, each computed as a task of the current pool ([`for_each_chunk_mut`]).
fn each_state(n: usize, f: impl Fn(usize) -> RowState + Sync) -> Vec<RowState> {
    let mut slots: Vec<Option<RowState>> = (0..n).map(|_| None).collect();
    for_each_chunk_mut(&mut slots, 1, |i, slot| slot[0] = Some(f(i)));
    slots
        .into_iter()
        .map(|s| s.expect("every task fills its slot"))
        .collect()
}

/// The arguments of one `attend_page` call.
pub(super) struct Ctx<'a> {
    pub(super) q: &'a [f32],
    pub(super) n_heads: usize,
    pub(super) group: usize,
    pub(super) q_pos0: usize,
    pub(super) page: PageView<'a>,
    pub(super) scale: f32,
}

impl Ctx<'_> {
    /// Page rows visible to token `t` (a prefix of the page).
    pub(super) fn visible(&self, t: usize) -> usize {
        (self.q_pos0 + t + 1)
            .saturating_sub(self.page.start())
            .min(self.page.len())
    }

    /// Online softmax of the query rows of tokens `[t0, t1)`, kv head `g`, over key segment `seg`.
    fn run_segment(&self, g: usize, t0: usize, t1: usize, seg: usize) -> RowState {
        if let RowsRef::Bf16(_) = self.page.k() {
            return super::pair_kernel::segment(self, g, t0, t1, seg);
        }
        dispatch(SegmentJob {
            ctx: self,
            g,
            t0,
            t1,
            seg,
        })
    }

    #[inline(always)]
    fn run_segment_impl<I: Isa>(
        &self,
        isa: I,
        g: usize,
        t0: usize,
        t1: usize,
        seg: usize,
    ) -> RowState {
        let dim = self.page.head_dim();
        let r = self.group;
        let rows = (t1 - t0) * r;
        let mut st = RowState::new(rows, dim);
        let k0 = seg * KEY_SEGMENT;
        let k1 = (k0 + KEY_SEGMENT).min(self.visible(t1 - 1));
        if k0 >= k1 {
            return st;
        }
        // Pre-scaled queries, row = (t - t0) * r + hh for query head g * r + hh.
        let mut qs = vec![0.0f32; rows * dim];
        for t in t0..t1 {
            let src = (t * self.n_heads + g * r) * dim;
            let dst = (t - t0) * r * dim;
            qs[dst..dst + r * dim].copy_from_slice(&self.q[src..src + r * dim]);
        }
        scale(&mut qs, self.scale);

        // Many rows (prefill): each block is widened once into f32 buffers (in the page's block layout, `k_offset`
        // and `v_offset`) that every row tile then reads from L1. Few rows (decode): the tiles read the page
        // directly, widening f16 in registers, so the block streams from memory once, and each load prefetches the
        // same element of the head's next block (the cold decode micro-benchmark,
        // `attend_decode/bench_model_8192_cold`: 3.0 → 3.85 GiB/s, medians of 8 alternating runs). The arithmetic is
        // the same either way (widening is exact).
        let direct = rows <= DIRECT_ROWS;
        let (mut kt, mut vb) = if direct {
            (Vec::new(), Vec::new())
        } else {
            (vec![0.0f32; dim * KEY_BLOCK], vec![0.0f32; KEY_BLOCK * dim])
        };
        let mut sc = vec![0.0f32; rows * KEY_BLOCK];
        let tiles = self.page.layout() == PageLayout::HeadMajor;
        let mut kb0 = k0;
        while kb0 < k1 {
            let nb = KEY_BLOCK.min(k1 - kb0);
            let b = kb0 / KEY_BLOCK;
            let step = Step {
                t0,
                t1,
                kb0,
                nb,
                tiles,
            };
            if direct {
                let (k, k_at, v, v_at) = self.page.block(b, g);
                let n = dim * KEY_BLOCK;
                // The block read next ([`PageView::read_next`]), prefetched as this one is read.
                let (pk, pv) = self.page.read_next(b, g, kb0 + nb < k1);
                match (k, v) {
                    (RowsRef::F16(k), RowsRef::F16(v)) => {
                        let (ka, va) = (ahead(k, pk), ahead(v, pv));
                        let k = F16Block::new(&k[k_at..k_at + n], ka);
                        let v = F16Block::new(&v[v_at..v_at + n], va);
                        self.block_step(isa, step, &qs, k, v, &mut sc, &mut st);
                    }
                    (RowsRef::F32(k), RowsRef::F32(v)) => {
                        let (ka, va) = (ahead(k, pk), ahead(v, pv));
                        let k = F32Block::<true>::new(&k[k_at..k_at + n], ka);
                        let v = F32Block::<true>::new(&v[v_at..v_at + n], va);
                        self.block_step(isa, step, &qs, k, v, &mut sc, &mut st);
                    }
                    _ => unreachable!("K and V share the page dtype"),
                }
            } else {
                load_block(isa, &self.page, &mut kt, &mut vb, kb0, nb, g);
                let null = std::ptr::null();
                let (k, v) = (
                    F32Block::<false>::new(&kt, null),
                    F32Block::<false>::new(&vb, null),
                );
                self.block_step(isa, step, &qs, k, v, &mut sc, &mut st);
            }
            kb0 += nb;
        }
        st
    }

    /// One key block for the rows of tokens `t0..t1`: scores of the rows that see part of it, then their softmax
    /// updates.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn block_step<I: Isa, S: BlockSrc>(
        &self,
        isa: I,
        s: Step,
        qs: &[f32],
        k: S,
        v: S,
        sc: &mut [f32],
        st: &mut RowState,
    ) {
        let dim = self.page.head_dim();
        if s.tiles {
            self.block_step_in(isa, s, BlockWalk::<true> { dim }, qs, (k, v), sc, st);
        } else {
            self.block_step_in(isa, s, BlockWalk::<false> { dim }, qs, (k, v), sc, st);
        }
    }

    /// [`Ctx::block_step`] in the block order `T`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn block_step_in<I: Isa, S: BlockSrc, const T: bool>(
        &self,
        isa: I,
        s: Step,
        walk: BlockWalk<T>,
        qs: &[f32],
        (k, v): (S, S),
        sc: &mut [f32],
        st: &mut RowState,
    ) {
        let dim = walk.dim;
        let r = self.group;
        // Tokens before `first` see nothing of this block (visibility grows with the token).
        let first = (s.t0..s.t1)
            .find(|&t| self.visible(t) > s.kb0)
            .unwrap_or(s.t1);
        let row0 = (first - s.t0) * r;
        scores(isa, &qs[row0 * dim..], k, walk, &mut sc[row0 * KEY_BLOCK..]);
        for t in first..s.t1 {
            let nv = (self.visible(t) - s.kb0).min(s.nb);
            let rows = (t - s.t0) * r..(t - s.t0 + 1) * r;
            for row in rows.clone() {
                st.softmax(row, &mut sc[row * KEY_BLOCK..(row + 1) * KEY_BLOCK], nv);
            }
            let p = &sc[rows.start * KEY_BLOCK..rows.end * KEY_BLOCK];
            st.accumulate(isa, rows.start, r, p, nv, (v, walk));
        }
    }
}

/// Which block a [`Ctx::block_step`] runs, for which tokens.
#[derive(Clone, Copy)]
struct Step {
    t0: usize,
    t1: usize,
    kb0: usize,
    nb: usize,
    /// Whether the page's blocks (and the f32 copies of them) are in tile order.
    tiles: bool,
}

/// At most this many query rows per task read blocks straight from the page (decode: one token's GQA group).
const DIRECT_ROWS: usize = 8;

/// One block's keys or values (`dim · KEY_BLOCK` elements in the layout of [`k_offset`](crate::kv::k_offset) or
/// [`v_offset`](crate::kv::v_offset)) as the kernel reads them.
///
/// # Safety
/// [`BlockSrc::len`] must be the number of elements that [`BlockSrc::load`] may read: the kernels' unchecked loads
/// rely on it.
pub(super) unsafe trait BlockSrc: Copy {
    /// Elements in the block (`head_dim · KEY_BLOCK`).
    fn len(self) -> usize;
    /// Elements `[at, at + 16)` as f32 lanes, read without a bounds check (the loops of the kernels check their
    /// whole range once, before they start: this runs once per 8 fused multiply-adds).
    ///
    /// # Safety
    /// `at + 16 ≤ self.len()`.
    unsafe fn load<I: Isa>(self, isa: I, at: usize) -> I::V;
    /// Element `at` as f32.
    fn get(self, at: usize) -> f32;
}

/// An f32 block; with `PF`, each load also prefetches the same element of the block at `ahead` (a hint only: never
/// dereferenced, so any address will do).
#[derive(Clone, Copy)]
pub(super) struct F32Block<'a, const PF: bool> {
    rows: &'a [f32],
    ahead: *const f32,
}

impl<'a, const PF: bool> F32Block<'a, PF> {
    pub(super) fn new(rows: &'a [f32], ahead: *const f32) -> Self {
        F32Block { rows, ahead }
    }
}

// SAFETY: `len` is the length of the slice that `load` reads.
unsafe impl<const PF: bool> BlockSrc for F32Block<'_, PF> {
    #[inline(always)]
    fn len(self) -> usize {
        self.rows.len()
    }

    #[inline(always)]
    unsafe fn load<I: Isa>(self, isa: I, at: usize) -> I::V {
        debug_assert!(at + LANES <= self.rows.len());
        if PF {
            prefetch_l2(self.ahead.wrapping_add(at).cast());
        }
        // SAFETY: the caller guarantees 16 elements at `at`.
        unsafe { isa.load_ptr(self.rows.as_ptr().add(at)) }
    }

    #[inline(always)]
    fn get(self, at: usize) -> f32 {
        self.rows[at]
    }
}

/// An f16 block of a page, widened in registers (exactly); each load also prefetches the same elements of the block
/// at `ahead` (a hint only: never dereferenced).
#[derive(Clone, Copy)]
pub(super) struct F16Block<'a> {
    rows: &'a [f16],
    ahead: *const f16,
}

impl<'a> F16Block<'a> {
    fn new(rows: &'a [f16], ahead: *const f16) -> Self {
        F16Block { rows, ahead }
    }
}

// SAFETY: `len` is the length of the slice that `load` reads.
unsafe impl BlockSrc for F16Block<'_> {
    #[inline(always)]
    fn len(self) -> usize {
        self.rows.len()
    }

    #[inline(always)]
    unsafe fn load<I: Isa>(self, isa: I, at: usize) -> I::V {
        debug_assert!(at + LANES <= self.rows.len());
        prefetch_l2(self.ahead.wrapping_add(at).cast());
        // SAFETY: the caller guarantees 16 elements at `at`.
        unsafe { isa.load_f16(self.rows.as_ptr().add(at).cast::<u16>()) }
    }

    #[inline(always)]
    fn get(self, at: usize) -> f32 {
        self.rows[at].to_f32()
    }
}

/// Where a block starting at `at` of `rows` lies, as a prefetch address (never dereferenced: a prefetch is a hint).
fn ahead<T>(rows: &[T], at: usize) -> *const T {
    rows.as_ptr().wrapping_add(at)
}

/// Loads block `kb0 / KEY_BLOCK` of kv head `g` (its first `nb` keys) into `kt` and `vb` in the page's block layout
/// ([`k_offset`](crate::kv::k_offset), [`v_offset`](crate::kv::v_offset)), f16 widened exactly; each is one
/// contiguous run of the page. Keys ≥ nb carry whatever the page holds there: the caller uses only the first `nb`.
#[inline(always)]
fn load_block<I: Isa>(
    isa: I,
    page: &PageView<'_>,
    kt: &mut [f32],
    vb: &mut [f32],
    kb0: usize,
    nb: usize,
    g: usize,
) {
    debug_assert!(kb0.is_multiple_of(KEY_BLOCK) && nb <= KEY_BLOCK);
    let (k, k_at, v, v_at) = page.block(kb0 / KEY_BLOCK, g);
    read_run(isa, &k, k_at, kt);
    // The whole run: in the chunked V layout the first `nb` keys are not a prefix of it.
    read_run(isa, &v, v_at, vb);
}

/// `dst = storage[at..at + dst.len()]` as f32 (f16 widened exactly, 16 at a time with the vector conversion).
#[inline(always)]
fn read_run<I: Isa>(isa: I, rows: &RowsRef<'_>, at: usize, dst: &mut [f32]) {
    match rows {
        RowsRef::F32(d) => dst.copy_from_slice(&d[at..at + dst.len()]),
        RowsRef::F16(d) => {
            let src = &d[at..at + dst.len()];
            let full = src.len() / LANES * LANES;
            for (s, o) in src[..full]
                .chunks_exact(LANES)
                .zip(dst.chunks_exact_mut(LANES))
            {
                // SAFETY: `s` holds 16 f16 values.
                isa.store(unsafe { isa.load_f16(s.as_ptr().cast::<u16>()) }, o);
            }
            f16_to_f32(&src[full..], &mut dst[full..]);
        }
        RowsRef::Bf16(_) => unreachable!("bf16 pages take the pair kernel"),
    }
}

/// `sc[row][j] = q[row] · k_j` for every row of `q` (`[_, dim]`) and the `KEY_BLOCK` keys of `kt` (`[4][dim][16]`,
/// [`k_offset`](crate::kv::k_offset)): one fused multiply-add chain over `d` per score (lanes = keys), in tiles of
/// 4 rows × all the block's keys with 32 vector registers, 4 rows × one vector of keys with 16 (AVX2: the
/// accumulators stay in registers; the chains, and so the bits, are the same).
#[inline(always)]
fn scores<I: Isa, S: BlockSrc, const T: bool>(
    isa: I,
    q: &[f32],
    kt: S,
    walk: BlockWalk<T>,
    sc: &mut [f32],
) {
    const NV: usize = KEY_BLOCK / LANES;
    let dim = walk.dim;
    let rows = q.len() / dim;
    let mut r0 = 0;
    // With 32 registers, a tile of 6 rows (24 accumulators) takes a group of 6 (e.g. Qwen3.5's 24/4) in one pass
    // over the keys instead of 4 + 1 + 1; the scores are the same chains either way.
    while I::WIDE && rows - r0 >= 6 && !(rows - r0).is_multiple_of(4) {
        score_tile::<I, S, 6, NV, T>(isa, &q[r0 * dim..], kt, walk, &mut sc[r0 * KEY_BLOCK..], 0);
        r0 += 6;
    }
    while r0 + 4 <= rows {
        let sc = &mut sc[r0 * KEY_BLOCK..];
        if I::WIDE {
            score_tile::<I, S, 4, NV, T>(isa, &q[r0 * dim..], kt, walk, sc, 0);
        } else {
            for v0 in 0..NV {
                score_tile::<I, S, 4, 1, T>(isa, &q[r0 * dim..], kt, walk, sc, v0);
            }
        }
        r0 += 4;
    }
    while r0 < rows {
        score_tile::<I, S, 1, NV, T>(isa, &q[r0 * dim..], kt, walk, &mut sc[r0 * KEY_BLOCK..], 0);
        r0 += 1;
    }
}

/// Scores of rows `0..R` against key vectors `v0..v0 + NV` of the block (keys `16·v0..16·(v0 + NV)`).
#[inline(always)]
fn score_tile<I: Isa, S: BlockSrc, const R: usize, const NV: usize, const T: bool>(
    isa: I,
    q: &[f32],
    kt: S,
    walk: BlockWalk<T>,
    sc: &mut [f32],
    v0: usize,
) {
    let dim = walk.dim;
    // Every index below is checked here, once: the loop runs 8 fused multiply-adds per iteration, and per-access
    // checks were most of its instructions.
    assert!(q.len() >= R * dim && (v0 + NV) * LANES <= KEY_BLOCK && kt.len() >= dim * KEY_BLOCK);
    let mut acc = [[isa.zero(); NV]; R];
    let walks: [(usize, usize); NV] = std::array::from_fn(|v| walk.k(v0 + v, dim));
    for d in 0..dim {
        let mut kv = [isa.zero(); NV];
        for (v, x) in kv.iter_mut().enumerate() {
            // Lane group v0 + v of the block's keys, dimension d ([`BlockWalk::k`]): ((v0 + v)·dim + d)·16 in the
            // link's block layout (`k_offset`), d·64 + (v0 + v)·16 in tile order.
            // SAFETY: the offset + 16 ≤ 4·dim·16 ≤ kt.len() (asserted above) in either order.
            *x = unsafe { kt.load(isa, walks[v].0 + d * walks[v].1) };
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            // SAFETY: r·dim + d < R·dim ≤ q.len() (asserted above).
            let qv = isa.splat(unsafe { *q.get_unchecked(r * dim + d) });
            for (a, k) in acc_r.iter_mut().zip(&kv) {
                *a = isa.fma(*a, qv, *k);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        for (v, a) in acc_r.iter().enumerate() {
            isa.store(*a, &mut sc[r * KEY_BLOCK + (v0 + v) * LANES..]);
        }
    }
}

/// One `run_segment` call, as a [`Kernel`] for [`dispatch`].
struct SegmentJob<'a> {
    ctx: &'a Ctx<'a>,
    g: usize,
    t0: usize,
    t1: usize,
    seg: usize,
}

impl Kernel for SegmentJob<'_> {
    type Out = RowState;

    #[inline(always)]
    fn run<I: Isa>(self, isa: I) -> RowState {
        self.ctx
            .run_segment_impl(isa, self.g, self.t0, self.t1, self.seg)
    }
}
