//! Causal attention of a batch of queries over one KV page, as a [`Partial`].

use rayon::prelude::*;

use super::Partial;
use crate::kv::KvPage;
use crate::simd::{axpy, scale};

/// Keys per block: K is converted to f32 and transposed (`[head_dim, KEY_BLOCK]`) once per block.
const KEY_BLOCK: usize = 64;
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

        let mut kt = vec![0.0f32; dim * KEY_BLOCK];
        let mut vb = vec![0.0f32; KEY_BLOCK * dim];
        let mut tmp = vec![0.0f32; dim];
        let mut sc = [0.0f32; KEY_BLOCK];
        let mut kb0 = k0;
        while kb0 < k1 {
            let nb = KEY_BLOCK.min(k1 - kb0);
            for jj in 0..nb {
                let at = ((kb0 + jj) * hkv + g) * dim;
                self.page.k_rows().read(at, &mut tmp);
                for (d, x) in tmp.iter().enumerate() {
                    kt[d * KEY_BLOCK + jj] = *x;
                }
                self.page
                    .v_rows()
                    .read(at, &mut vb[jj * dim..(jj + 1) * dim]);
            }
            for t in t0..t1 {
                let vis = self.visible(t);
                if vis <= kb0 {
                    continue;
                }
                let nv = (vis - kb0).min(nb);
                for hh in 0..r {
                    let row = (t - t0) * r + hh;
                    let qrow = &qs[row * dim..(row + 1) * dim];
                    scores(qrow, &kt, &mut sc);
                    st.update(row, &sc[..nv], &vb);
                }
            }
            kb0 += nb;
        }
        st
    }
}

/// `sc[j] = Σ_d q[d] · kt[d][j]` for the `KEY_BLOCK` columns of `kt: [dim, KEY_BLOCK]`.
#[inline]
fn scores(q: &[f32], kt: &[f32], sc: &mut [f32; KEY_BLOCK]) {
    sc.fill(0.0);
    for (qd, krow) in q.iter().zip(kt.chunks_exact(KEY_BLOCK)) {
        for (s, k) in sc.iter_mut().zip(krow) {
            *s += qd * k;
        }
    }
}

/// Unnormalized online-softmax state of `rows` query rows: running max `m`, running sum `l` of
/// `exp(score − m)`, and `acc = Σ exp(score − m)·v` (`[rows, dim]`).
struct RowState {
    dim: usize,
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

impl RowState {
    fn new(rows: usize, dim: usize) -> Self {
        RowState {
            dim,
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            acc: vec![0.0; rows * dim],
        }
    }

    /// Adds keys with scores `sc` (already scaled) and values `vb` (`[≥ sc.len(), dim]`) to row `row`.
    #[inline]
    fn update(&mut self, row: usize, sc: &[f32], vb: &[f32]) {
        let dim = self.dim;
        let bmax = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let m_old = self.m[row];
        let m_new = m_old.max(bmax);
        let acc = &mut self.acc[row * dim..(row + 1) * dim];
        if m_new > m_old && m_old != f32::NEG_INFINITY {
            let corr = (m_old - m_new).exp();
            self.l[row] *= corr;
            scale(acc, corr);
        }
        self.m[row] = m_new;
        let mut psum = 0.0f32;
        for (j, &s) in sc.iter().enumerate() {
            let p = (s - m_new).exp();
            psum += p;
            axpy(acc, p, &vb[j * dim..(j + 1) * dim]);
        }
        self.l[row] += psum;
    }

    /// Merges the state of the next key segment into this one (same rows).
    fn merge(&mut self, other: &RowState) {
        let dim = self.dim;
        for row in 0..self.m.len() {
            let (m1, m2) = (self.m[row], other.m[row]);
            if m2 == f32::NEG_INFINITY {
                continue;
            }
            let acc = &mut self.acc[row * dim..(row + 1) * dim];
            let oacc = &other.acc[row * dim..(row + 1) * dim];
            if m1 == f32::NEG_INFINITY {
                acc.copy_from_slice(oacc);
                self.m[row] = m2;
                self.l[row] = other.l[row];
                continue;
            }
            let m = m1.max(m2);
            let (c1, c2) = ((m1 - m).exp(), (m2 - m).exp());
            for (a, b) in acc.iter_mut().zip(oacc) {
                *a = c1 * *a + c2 * b;
            }
            self.l[row] = c1 * self.l[row] + c2 * other.l[row];
            self.m[row] = m;
        }
    }

    /// Normalizes rows into `out` for tokens starting at `t0` and query heads `g * group..`.
    fn finalize(&self, out: &mut Partial, g: usize, t0: usize, group: usize) {
        let dim = self.dim;
        for row in 0..self.m.len() {
            if self.m[row] == f32::NEG_INFINITY {
                continue;
            }
            let (t, h) = (t0 + row / group, g * group + row % group);
            let l = self.l[row];
            let o = &mut out.o[(t * out.n_heads + h) * dim..][..dim];
            for (x, a) in o.iter_mut().zip(&self.acc[row * dim..(row + 1) * dim]) {
                *x = a / l;
            }
            out.lse[t * out.n_heads + h] = self.m[row] + l.ln();
        }
    }
}
