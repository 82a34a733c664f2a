//! Register-blocked small matrix products for the chunked delta rule.
//!
//! Every output element is accumulated as `c ← fma(a_k, b_k, c)` for `k` in increasing order (one rounding per
//! step), whatever the tiling and the [`Isa`], so these give exactly the bits of the obvious
//! `for k { c = a[i][k].mul_add(b[k], c) }` loops.

use crate::simd::{Isa, LANES};

/// A read-only matrix view: element `(i, k)` is `data[i * rs + k * cs]` (so `cs = 1` is row-major and
/// `rs = 1` a transposed row-major matrix).
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    /// The view of `data` with element `(i, k)` at `data[i * rs + k * cs]`.
    #[inline(always)]
    pub(crate) fn new(data: &'a [f32], rs: usize, cs: usize) -> Self {
        View { data, rs, cs }
    }

    #[inline(always)]
    fn at(&self, i: usize, k: usize) -> f32 {
        self.data[i * self.rs + k * self.cs]
    }
}

/// Rows of the output tile.
const MR: usize = 4;
/// 16-lane vectors per row of the output tile.
const NV: usize = 2;

/// `C[i, :] += Σ_{k < kdim} A(i, k) · B[k, :]` for rows `i` in `0..m`; `C` is `[m, n]` and `B` `[kdim, n]`,
/// both row-major with row stride `n`.
#[inline(always)]
pub(crate) fn gemm_acc<I: Isa>(
    isa: I,
    c: &mut [f32],
    m: usize,
    n: usize,
    a: View,
    b: &[f32],
    kdim: usize,
) {
    let mut i = 0;
    while i + MR <= m {
        rows_tile::<I, MR>(isa, c, i, n, a, b, kdim);
        i += MR;
    }
    while i < m {
        rows_tile::<I, 1>(isa, c, i, n, a, b, kdim);
        i += 1;
    }
}

/// `C[i, :] += Σ_{k < i + diag} A(i, k) · B[k, :]` for rows `i` in `0..m` (a lower-triangular `A`: `diag = 0`
/// strict, `1` with the diagonal). Row `i` may read rows of `B` that earlier rows of `C` wrote only through
/// separate buffers: `B` and `C` are distinct slices.
#[inline(always)]
pub(crate) fn gemm_acc_lower<I: Isa>(
    isa: I,
    c: &mut [f32],
    m: usize,
    n: usize,
    a: View,
    b: &[f32],
    diag: usize,
) {
    for i in 0..m {
        rows_tile::<I, 1>(isa, c, i, n, a, b, i + diag);
    }
}

/// Forward substitution with a unit lower-triangular matrix: for `i` in order,
/// `X[i, :] += Σ_{k < i} A(i, k) · X[k, :]` (pass `A = −strict_lower(M)` to solve `M X = X₀` in place).
#[inline(always)]
pub(crate) fn forward_subst<I: Isa>(isa: I, x: &mut [f32], m: usize, n: usize, a: View) {
    for i in 1..m {
        let (done, rest) = x.split_at_mut(i * n);
        rows_tile::<I, 1>(isa, rest, 0, n, shift_rows(a, i), done, i);
    }
}

/// The view of `a` starting at row `i0`.
#[inline(always)]
fn shift_rows(a: View, i0: usize) -> View {
    View {
        data: &a.data[i0 * a.rs..],
        rs: a.rs,
        cs: a.cs,
    }
}

/// `R` rows starting at `i0`: `C[i, :] += Σ_{k < kdim} A(i, k) · B[k, :]`, in column tiles of `NV` vectors,
/// then single vectors, then scalars.
#[inline(always)]
fn rows_tile<I: Isa, const R: usize>(
    isa: I,
    c: &mut [f32],
    i0: usize,
    n: usize,
    a: View,
    b: &[f32],
    kdim: usize,
) {
    let mut j = 0;
    while j + NV * LANES <= n {
        tile::<I, R, NV>(isa, c, i0, j, n, a, b, kdim);
        j += NV * LANES;
    }
    while j + LANES <= n {
        tile::<I, R, 1>(isa, c, i0, j, n, a, b, kdim);
        j += LANES;
    }
    for col in j..n {
        for r in 0..R {
            let i = i0 + r;
            let mut acc = c[i * n + col];
            for k in 0..kdim {
                acc = a.at(i, k).mul_add(b[k * n + col], acc);
            }
            c[i * n + col] = acc;
        }
    }
}

/// One `R × V·16` tile of `C` at `(i0, j0)`, accumulated in registers over `k < kdim`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<I: Isa, const R: usize, const V: usize>(
    isa: I,
    c: &mut [f32],
    i0: usize,
    j0: usize,
    n: usize,
    a: View,
    b: &[f32],
    kdim: usize,
) {
    // (Explicit loops, not `std::array::from_fn`: its closure is not always inlined, and the vector
    // intrinsics must be inlined into the `#[target_feature]` caller.)
    let mut acc = [[isa.zero(); V]; R];
    for r in 0..R {
        for v in 0..V {
            acc[r][v] = isa.load(&c[(i0 + r) * n + j0 + v * LANES..]);
        }
    }
    let mut bv = [isa.zero(); V];
    for k in 0..kdim {
        for v in 0..V {
            bv[v] = isa.load(&b[k * n + j0 + v * LANES..]);
        }
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let ak = isa.splat(a.at(i0 + r, k));
            for (acc_rv, bvv) in acc_r.iter_mut().zip(&bv) {
                *acc_rv = isa.fma(*acc_rv, ak, *bvv);
            }
        }
    }
    for r in 0..R {
        for v in 0..V {
            isa.store(acc[r][v], &mut c[(i0 + r) * n + j0 + v * LANES..]);
        }
    }
}

/// `out[i * m + j] = x_i · y_j` for `j < i + diag` (rows of `x`, `y`: `[m, d]` row-major), in `4 × 2` register
/// tiles; other entries are left as they are. Each entry has the bits of a lone [`dot`](crate::simd::dot).
#[inline(always)]
pub(crate) fn gram_lower<I: Isa>(
    isa: I,
    x: &[f32],
    y: &[f32],
    m: usize,
    d: usize,
    diag: usize,
    out: &mut [f32],
) {
    let mut i0 = 0;
    while i0 + 4 <= m {
        // Columns any of the 4 rows needs: j < i0 + 3 + diag.
        let jend = (i0 + 3 + diag).min(m);
        let xs = [
            row(x, d, i0),
            row(x, d, i0 + 1),
            row(x, d, i0 + 2),
            row(x, d, i0 + 3),
        ];
        let mut j = 0;
        while j + 2 <= jend {
            let s = crate::simd::dots::<I, 4, 2>(isa, xs, [row(y, d, j), row(y, d, j + 1)]);
            for r in 0..4 {
                for cc in 0..2 {
                    if j + cc < i0 + r + diag {
                        out[(i0 + r) * m + j + cc] = s[r][cc];
                    }
                }
            }
            j += 2;
        }
        if j < jend {
            let s = crate::simd::dots::<I, 4, 1>(isa, xs, [row(y, d, j)]);
            for r in 0..4 {
                if j < i0 + r + diag {
                    out[(i0 + r) * m + j] = s[r][0];
                }
            }
        }
        i0 += 4;
    }
    for i in i0..m {
        for j in 0..(i + diag).min(m) {
            out[i * m + j] = crate::simd::dot(isa, row(x, d, i), row(y, d, j));
        }
    }
}

/// Row `i` of a row-major `[_, d]` matrix.
#[inline(always)]
fn row(s: &[f32], d: usize, i: usize) -> &[f32] {
    &s[i * d..(i + 1) * d]
}
