//! The online-softmax state of a set of query rows (Milakov & Gimelshein 2018; FlashAttention, Dao et al.
//! 2022): running max, running sum of exponentials and unnormalized output, updated block by block.

use super::Partial;
use crate::simd::{axpy_rows, exp_fast, max, scale, sum, Isa};

/// Most keys one [`RowState::update`] takes.
pub(super) const MAX_BLOCK: usize = 64;

/// Row `j` of a contiguous `[_, dim]` block.
#[inline(always)]
fn vrow(v: &[f32], dim: usize, j: usize) -> &[f32] {
    &v[j * dim..(j + 1) * dim]
}

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

    /// Adds keys with scores `sc` (already scaled, at most [`MAX_BLOCK`] of them) and their values `vb`
    /// (`[≥ sc.len(), dim]` contiguous f32) to row `row`.
    #[inline(always)]
    pub(super) fn update<I: Isa>(&mut self, isa: I, row: usize, sc: &[f32], vb: &[f32]) {
        let dim = self.dim;
        let m_old = self.m[row];
        let m_new = m_old.max(max(sc));
        let acc = &mut self.acc[row * dim..(row + 1) * dim];
        if m_new > m_old && m_old != f32::NEG_INFINITY {
            let corr = exp_fast(m_old - m_new);
            self.l[row] *= corr;
            scale(acc, corr);
        }
        self.m[row] = m_new;
        let mut p = [0.0f32; MAX_BLOCK];
        let p = &mut p[..sc.len()];
        for (pj, s) in p.iter_mut().zip(sc) {
            *pj = exp_fast(s - m_new);
        }
        self.l[row] += sum(p);
        // acc += Σ_j p_j v_j in key order, four keys per pass over acc (same rounding as one at a time).
        let mut j = 0;
        while j + 4 <= p.len() {
            let pq = [p[j], p[j + 1], p[j + 2], p[j + 3]];
            let rows = [
                vrow(vb, dim, j),
                vrow(vb, dim, j + 1),
                vrow(vb, dim, j + 2),
                vrow(vb, dim, j + 3),
            ];
            axpy_rows(isa, acc, pq, rows);
            j += 4;
        }
        while j < p.len() {
            axpy_rows(isa, acc, [p[j]], [vrow(vb, dim, j)]);
            j += 1;
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
