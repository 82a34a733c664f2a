//! The online-softmax state of a set of query rows (Milakov & Gimelshein 2018; FlashAttention, Dao et al.
//! 2022): running max, running sum of exponentials and unnormalized output, updated block by block.

use super::page_kernel::{BlockSrc, KEY_BLOCK};
use super::Partial;
use crate::kv::tiles::BlockWalk;
use crate::kv::KV_LANES;
use crate::simd::{exp_fast, max, scale, sum, Isa, LANES};

/// Unnormalized online-softmax state of `rows` query rows: running max `m`, running sum `l` of
/// `exp(score − m)`, and `acc = Σ exp(score − m)·v` (`[rows, dim]`).
pub(super) struct RowState {
    dim: usize,
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

impl RowState {
    pub(super) fn new(rows: usize, dim: usize) -> Self {
        RowState {
            dim,
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            acc: vec![0.0; rows * dim],
        }
    }

    /// The softmax half of adding the first `nv ≥ 1` keys of a block to row `row`: `sc` holds the block's scaled
    /// scores (`[KEY_BLOCK]`) and is overwritten with their weights `exp(score − m)` (0 for a row that sees nothing),
    /// the running max and sum are updated and the output rescaled. [`RowState::accumulate`] then adds the values.
    #[inline(always)]
    pub(super) fn softmax(&mut self, row: usize, sc: &mut [f32], nv: usize) {
        self.softmax_as::<false>(row, sc, nv);
    }

    /// [`RowState::softmax`] for the bf16 dot products of bf16 pages: each weight is rounded to bf16 (to nearest
    /// even; below `2^-126` to 0, as `vdpbf16ps` reads it) before the sum, so the running sum counts exactly the
    /// weights the values are multiplied by, and a rescaled output has its subnormals flushed to zero (the native
    /// instruction reads a subnormal accumulator as zero, its emulations assume none).
    #[inline(always)]
    pub(super) fn softmax_bf16(&mut self, row: usize, sc: &mut [f32], nv: usize) {
        self.softmax_as::<true>(row, sc, nv);
    }

    #[inline(always)]
    fn softmax_as<const BF16: bool>(&mut self, row: usize, sc: &mut [f32], nv: usize) {
        let dim = self.dim;
        let p = &mut sc[..nv];
        let m_old = self.m[row];
        let m_new = m_old.max(max(p));
        if m_new == f32::NEG_INFINITY {
            p.fill(0.0);
            return;
        }
        if m_new > m_old && m_old != f32::NEG_INFINITY {
            let corr = exp_fast(m_old - m_new);
            self.l[row] *= corr;
            let acc = &mut self.acc[row * dim..(row + 1) * dim];
            scale(acc, corr);
            if BF16 {
                for a in acc.iter_mut().filter(|a| a.is_subnormal()) {
                    *a = f32::from_bits(a.to_bits() & 0x8000_0000);
                }
            }
        }
        self.m[row] = m_new;
        for x in p.iter_mut() {
            *x = exp_fast(*x - m_new);
        }
        if BF16 {
            for x in p.iter_mut() {
                *x = bf16_weight(*x);
            }
        }
        self.l[row] += sum(p);
    }

    /// The output accumulators of rows `r0..` (`[rows − r0, dim]`), for the bf16 pair kernel.
    pub(super) fn acc_from(&mut self, r0: usize) -> &mut [f32] {
        &mut self.acc[r0 * self.dim..]
    }

    /// The values half: rows `r0..r0 + n` (which all see the block's first `nv` keys) add `Σ_j p_j·v_j`, with their
    /// weights in `p` (`[n][KEY_BLOCK]`) and the values in `v` (chunks of 16 dimensions × `KEY_BLOCK` keys,
    /// `v_offset`). Each output element is one fused multiply-add chain over the keys in order, so a row's bits do
    /// not depend on the rows beside it; rows share each loaded value vector, in tiles of up to 4 rows × 64
    /// dimensions.
    #[inline(always)]
    pub(super) fn accumulate<I: Isa, S: BlockSrc, const T: bool>(
        &mut self,
        isa: I,
        r0: usize,
        n: usize,
        p: &[f32],
        nv: usize,
        (v, walk): (S, BlockWalk<T>),
    ) {
        let mut r = 0;
        while r < n {
            let left = n - r;
            let (acc, w) = (&mut self.acc[(r0 + r) * self.dim..], &p[r * KEY_BLOCK..]);
            if I::WIDE && left >= 6 && !left.is_multiple_of(4) {
                // 24 accumulators fit the 32 registers: a group of 6 reads each value vector once.
                weighted_rows::<I, S, 6, T>(isa, acc, w, nv, v, walk);
                r += 6;
            } else if left >= 4 {
                weighted_rows::<I, S, 4, T>(isa, acc, w, nv, v, walk);
                r += 4;
            } else if left >= 2 {
                weighted_rows::<I, S, 2, T>(isa, acc, w, nv, v, walk);
                r += 2;
            } else {
                weighted_rows::<I, S, 1, T>(isa, acc, w, nv, v, walk);
                r += 1;
            }
        }
    }

    /// Merges the state of the next key segment into this one (same rows).
    pub(super) fn merge(&mut self, other: &RowState) {
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
            let (c1, c2) = (exp_fast(m1 - m), exp_fast(m2 - m));
            for (a, b) in acc.iter_mut().zip(oacc) {
                *a = c1 * *a + c2 * b;
            }
            self.l[row] = c1 * self.l[row] + c2 * other.l[row];
            self.m[row] = m;
        }
    }

    /// Normalizes rows into `out` for tokens starting at `t0` and query heads `g * group..`.
    pub(super) fn finalize(&self, out: &mut Partial, g: usize, t0: usize, group: usize) {
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

/// A softmax weight (`0 ≤ w ≤ 1`, finite) rounded to bf16 as `vdpbf16ps` reads it: to nearest even, and 0 below
/// `2^-126`. Integer arithmetic on the bits, so that the loop over a block's weights vectorizes.
#[inline(always)]
fn bf16_weight(w: f32) -> f32 {
    let b = w.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
    f32::from_bits(if b < 0x0080_0000 { 0 } else { rounded })
}

/// For rows `r < R` (`acc`: `[R][dim]` at row stride `dim`, `p`: `[R][KEY_BLOCK]`): `acc[r][d] = fma(p[r][j],
/// v[j][d], acc[r][d])` for `j < nv` in order, for every `d < dim`: 4 vectors of 16 lanes at a time (32 registers),
/// then single vectors, then scalars (the same fused operation in every path).
#[inline(always)]
fn weighted_rows<I: Isa, S: BlockSrc, const R: usize, const T: bool>(
    isa: I,
    acc: &mut [f32],
    p: &[f32],
    nv: usize,
    v: S,
    walk: BlockWalk<T>,
) {
    let dim = walk.dim;
    let full = dim / LANES * LANES;
    let mut c0 = 0;
    // Four vectors of columns × R rows of accumulators need 32 registers for R = 4; with 16 (AVX2), one vector.
    while I::WIDE && c0 + 4 * LANES <= full {
        weighted_cols::<I, S, R, 4, T>(isa, acc, p, nv, v, walk, c0);
        c0 += 4 * LANES;
    }
    while c0 < full {
        weighted_cols::<I, S, R, 1, T>(isa, acc, p, nv, v, walk, c0);
        c0 += LANES;
    }
    for r in 0..R {
        for d in full..dim {
            let mut a = acc[r * dim + d];
            for j in 0..nv {
                a = p[r * KEY_BLOCK + j].mul_add(v.get(walk.v_at(j, d, false)), a);
            }
            acc[r * dim + d] = a;
        }
    }
}

#[inline(always)]
fn weighted_cols<I: Isa, S: BlockSrc, const R: usize, const NV: usize, const T: bool>(
    isa: I,
    acc: &mut [f32],
    p: &[f32],
    nv: usize,
    v: S,
    walk: BlockWalk<T>,
    c0: usize,
) {
    let dim = walk.dim;
    let mut a = [[isa.zero(); NV]; R];
    for (r, ar) in a.iter_mut().enumerate() {
        for (i, ai) in ar.iter_mut().enumerate() {
            *ai = isa.load(&acc[r * dim + c0 + i * LANES..]);
        }
    }
    // Every index of the loop is checked here, once (per-access checks were most of its instructions).
    assert!(
        c0.is_multiple_of(KV_LANES)
            && c0 + NV * LANES <= dim
            && nv <= KEY_BLOCK
            && p.len() >= (R - 1) * KEY_BLOCK + nv
            && v.len() >= dim * KEY_BLOCK
    );
    // Chunk c0 / 16 + i of the block's values, key j's 16 dimensions ([`BlockWalk::v`]): at chunk·16·64 + j·16 in
    // the link's block layout (`v_offset`), at (the chunk's quad)·64·64 + j·w + (chunk mod 4)·16 in tile order.
    let walks: [(usize, usize); NV] = std::array::from_fn(|i| walk.v(c0 / KV_LANES + i, false));
    for j in 0..nv {
        let mut vv = [isa.zero(); NV];
        for (i, x) in vv.iter_mut().enumerate() {
            // SAFETY: the offset + 16 ≤ dim·64 ≤ v.len() (asserted above): chunk c0 / 16 + i is whole and j < 64,
            // in either order.
            *x = unsafe { v.load(isa, walks[i].0 + j * walks[i].1) };
        }
        for (r, ar) in a.iter_mut().enumerate() {
            // SAFETY: r·64 + j < (R − 1)·64 + nv ≤ p.len() (asserted above).
            let pv = isa.splat(unsafe { *p.get_unchecked(r * KEY_BLOCK + j) });
            for (ai, x) in ar.iter_mut().zip(&vv) {
                *ai = isa.fma(*ai, pv, *x);
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        for (i, ai) in ar.iter().enumerate() {
            isa.store(*ai, &mut acc[r * dim + c0 + i * LANES..]);
        }
    }
}
