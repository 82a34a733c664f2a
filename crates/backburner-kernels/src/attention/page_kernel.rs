//! Causal attention of a batch of queries over one KV page, as a [`Partial`].

use rayon::prelude::*;

use super::online::{RowState, MAX_BLOCK};
use super::Partial;
use crate::kv::page::Rows;
use crate::kv::KvPage;
use crate::simd::{dispatch, dots, f16_to_f32, scale, Isa, Kernel};

/// Keys per block: f16 keys and values are converted to f32 once per block and task.
const KEY_BLOCK: usize = 32;
const _: () = assert!(KEY_BLOCK <= MAX_BLOCK && KEY_SEGMENT.is_multiple_of(KEY_BLOCK));
/// Query rows scored together per pass over a key block.
const GROUP: usize = 4;
/// Keys per segment. A row's softmax runs online over the blocks of a segment; segment partials are then
/// merged in order. Fixed, so the bits never depend on how the work is spread over threads.
const KEY_SEGMENT: usize = 1024;
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
/// (FlashAttention, Dao et al. 2022; Milakov & Gimelshein 2018), f16 keys/values converted exactly to f32.
///
/// Work is split over rayon tasks (kv head × token block, and over fixed key segments when there are few
/// such tasks, e.g. decode). Each output row is computed by the same sequence of f32 operations whatever the
/// split, the thread count, or the other queries in the batch: bit-deterministic, and a query attended
/// alone gives the same bits as inside a batch.
///
/// Panics if `n_heads` is not a positive multiple of `page.n_kv_heads()` or `q` has the wrong length.
pub fn attend_page(
    q: &[f32],
    n_tokens: usize,
    n_heads: usize,
    q_pos0: usize,
    page: &KvPage,
    scale: f32,
) -> Partial {
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
    let results: Vec<RowState> = if n_seg == 1 || tasks.len() >= 2 * rayon::current_num_threads() {
        tasks
            .par_iter()
            .map(|&(g, t0, t1)| {
                let mut st = ctx.run_segment(g, t0, t1, 0);
                for s in 1..n_seg {
                    st.merge(&ctx.run_segment(g, t0, t1, s));
                }
                st
            })
            .collect()
    } else {
        let parts: Vec<RowState> = (0..tasks.len() * n_seg)
            .into_par_iter()
            .map(|i| {
                let (g, t0, t1) = tasks[i / n_seg];
                ctx.run_segment(g, t0, t1, i % n_seg)
            })
            .collect();
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

/// The arguments of one `attend_page` call.
struct Ctx<'a> {
    q: &'a [f32],
    n_heads: usize,
    group: usize,
    q_pos0: usize,
    page: &'a KvPage,
    scale: f32,
}

impl Ctx<'_> {
    /// Page rows visible to token `t` (a prefix of the page).
    fn visible(&self, t: usize) -> usize {
        (self.q_pos0 + t + 1)
            .saturating_sub(self.page.start())
            .min(self.page.len())
    }

    /// Online softmax of the query rows of tokens `[t0, t1)`, kv head `g`, over key segment `seg`.
    fn run_segment(&self, g: usize, t0: usize, t1: usize, seg: usize) -> RowState {
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
        let hkv = self.page.n_kv_heads();
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

        // Each block's rows of kv head `g` are gathered into contiguous f32 buffers (f16 converted). Even
        // for f32 pages this pays: in place, rows sit `n_kv_heads * head_dim` floats apart (often a multiple
        // of 4 KiB), which maps them all to the same L1 cache sets.
        let mut kbuf = vec![0.0f32; KEY_BLOCK * dim];
        let mut vbuf = vec![0.0f32; KEY_BLOCK * dim];
        let mut sc = [[0.0f32; KEY_BLOCK]; GROUP];
        let mut live: Vec<(usize, usize)> = Vec::with_capacity(rows);
        let mut kb0 = k0;
        while kb0 < k1 {
            let nb = KEY_BLOCK.min(k1 - kb0);
            let kblk = BlockRows::load(self.page.k_rows(), &mut kbuf, kb0, nb, g, hkv, dim);
            let vblk = BlockRows::load(self.page.v_rows(), &mut vbuf, kb0, nb, g, hkv, dim);
            // Rows that see part of this block, with how many of its keys.
            live.clear();
            for t in t0..t1 {
                let vis = self.visible(t);
                if vis > kb0 {
                    let nv = (vis - kb0).min(nb);
                    live.extend(((t - t0) * r..(t - t0 + 1) * r).map(|row| (row, nv)));
                }
            }
            // Score GROUP rows against key pairs (each score has the bits of a lone `dot`, whatever the
            // grouping), then fold each row's scores into its online softmax.
            for grp in live.chunks(GROUP) {
                let nv_max = grp.iter().map(|x| x.1).max().unwrap_or(0);
                if grp.len() == GROUP {
                    let qr: [&[f32]; GROUP] =
                        std::array::from_fn(|i| &qs[grp[i].0 * dim..(grp[i].0 + 1) * dim]);
                    score_block(isa, qr, &kblk, nv_max, &mut sc);
                } else {
                    for (i, &(row, _)) in grp.iter().enumerate() {
                        let one: &mut [[f32; KEY_BLOCK]; 1] =
                            (&mut sc[i..i + 1]).try_into().expect("one row");
                        score_block(isa, [&qs[row * dim..(row + 1) * dim]], &kblk, nv_max, one);
                    }
                }
                for (i, &(row, nv)) in grp.iter().enumerate() {
                    st.update(isa, row, &sc[i][..nv], vblk.data);
                }
            }
            kb0 += nb;
        }
        st
    }
}

/// `nb` consecutive rows of one kv head inside a key block, as contiguous f32 `[nb, dim]`.
struct BlockRows<'a> {
    data: &'a [f32],
    dim: usize,
}

impl<'a> BlockRows<'a> {
    /// Rows `[kb0, kb0 + nb)` of kv head `g`, gathered into `buf` (f16 converted exactly).
    #[inline(always)]
    fn load(
        rows: &Rows,
        buf: &'a mut [f32],
        kb0: usize,
        nb: usize,
        g: usize,
        hkv: usize,
        dim: usize,
    ) -> Self {
        let first = (kb0 * hkv + g) * dim;
        for j in 0..nb {
            let at = first + j * hkv * dim;
            let dst = &mut buf[j * dim..(j + 1) * dim];
            match rows {
                Rows::F32(d) => dst.copy_from_slice(&d[at..at + dim]),
                Rows::F16(d) => f16_to_f32(&d[at..at + dim], dst),
            }
        }
        BlockRows {
            data: &buf[..nb * dim],
            dim,
        }
    }

    #[inline(always)]
    fn row(&self, j: usize) -> &[f32] {
        &self.data[j * self.dim..(j + 1) * self.dim]
    }
}

/// `sc[i][j] = q[i]·k_j` for the first `nv` keys of the block (two keys at a time).
#[inline(always)]
fn score_block<I: Isa, const R: usize>(
    isa: I,
    q: [&[f32]; R],
    k: &BlockRows,
    nv: usize,
    sc: &mut [[f32; KEY_BLOCK]; R],
) {
    let mut j = 0;
    while j + 2 <= nv {
        let s = dots::<I, R, 2>(isa, q, [k.row(j), k.row(j + 1)]);
        for i in 0..R {
            sc[i][j] = s[i][0];
            sc[i][j + 1] = s[i][1];
        }
        j += 2;
    }
    if j < nv {
        let s = dots::<I, R, 1>(isa, q, [k.row(j)]);
        for i in 0..R {
            sc[i][j] = s[i][0];
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
