//! The bf16-activation product kernel: threads × panel ranges × `vdpbf16ps` register tiles (native or emulated, see
//! [`Dp`]).

use super::super::kernel::{row_block, task_count, OutPtr, DIRECT_ROWS};
use super::super::pack::{PackedMatrix, PANEL_GROUP};
use super::super::PANEL;
use super::pack_act_pairs;
use crate::parallel::{for_each_task, split_range};
use crate::simd::dp::{dp_dispatch, Dp, DpKernel};

/// Pairs of inputs per block of the prefill path (a block of [`GROUP_PANELS`] panels is `KCP × 64` bytes each:
/// 256 KiB, which stays in L2, the activations' `12 × KCP × 4` bytes in L1).
const KCP: usize = 256;
/// Panels per block of the prefill path.
const GROUP_PANELS: usize = 16;

/// `y [m, n] = x [m, k] · Wᵀ` in the bf16-activation arithmetic (see the [module docs](super)); `pairs` is `w`'s
/// pair storage. The caller has checked the shapes and that `m`, `n`, `k` are non-zero.
pub(in crate::matmul) fn matmul_pairs(
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    pairs: &[u32],
    y: &mut [f32],
) {
    let (n, k) = (w.n(), w.k());
    let wide = dp_dispatch(IsWide);
    let direct = m <= DIRECT_ROWS;
    let mr = row_block(m, wide);
    let a = pack_act_pairs(x, m, k, mr);
    let groups = w.n_panels() / PANEL_GROUP;
    let n_tasks = task_count(m * n * k, groups);
    let out = OutPtr(y.as_mut_ptr());
    for_each_task(n_tasks, |t| {
        let g = split_range(groups, n_tasks, t);
        dp_dispatch(Task {
            a: &a,
            m,
            mr,
            n,
            kp: k.div_ceil(2),
            w: pairs,
            out: &out,
            panels: g.start * PANEL_GROUP..g.end * PANEL_GROUP,
            direct,
        });
    });
}

/// Asks [`dp_dispatch`] whether the chosen instruction set is [`Dp::WIDE`].
struct IsWide;

impl DpKernel for IsWide {
    type Out = bool;
    #[inline(always)]
    fn run<D: Dp>(self, _: D) -> bool {
        D::WIDE
    }
}

/// One task: panels `panels` of the output, every row.
struct Task<'a> {
    /// The activations as [`pack_act_pairs`] gives them for `mr` rows per block.
    a: &'a [u32],
    m: usize,
    mr: usize,
    n: usize,
    /// Pairs per row.
    kp: usize,
    /// The weights' pair storage (`kp · 16` words per panel).
    w: &'a [u32],
    out: &'a OutPtr,
    panels: std::ops::Range<usize>,
    direct: bool,
}

/// Where a tile reads its rows and which panels and pairs.
#[derive(Clone, Copy)]
struct Tile {
    /// `[kcp][a_stride]` pairs.
    a: *const u32,
    a_stride: usize,
    /// First output row.
    row0: usize,
    /// First panel.
    panel: usize,
    /// First pair.
    q0: usize,
    /// Pairs.
    kcp: usize,
    /// Start from zero instead of the output's current values.
    first: bool,
}

impl Tile {
    /// The tile `r0` rows further down.
    #[inline(always)]
    fn down(self, r0: usize) -> Tile {
        Tile {
            // SAFETY: callers keep r0 below the block's a_stride.
            a: unsafe { self.a.add(r0) },
            row0: self.row0 + r0,
            ..self
        }
    }
}

impl DpKernel for Task<'_> {
    type Out = ();

    #[inline(always)]
    fn run<D: Dp>(self, dp: D) {
        if self.direct {
            if D::WIDE && self.m == 1 {
                self.direct_rows::<D, 8>(dp);
            } else if D::WIDE {
                self.direct_rows::<D, 4>(dp);
            } else {
                self.direct_rows::<D, 2>(dp);
            }
        } else if self.mr == 12 {
            // the row block the activations were packed for (chosen by an earlier dispatch: the same instruction set
            // outside tests, whose dispatch cap may change in between)
            self.blocked::<D, 12, 2>(dp);
        } else {
            self.blocked::<D, 6, 1>(dp);
        }
    }
}

impl Task<'_> {
    /// Few rows: each pass of `NP` panels (the last ones 4 at a time) streams its panels once over the whole `k`, in
    /// row blocks of 4 (2 on a narrow instruction set).
    #[inline(always)]
    fn direct_rows<D: Dp, const NP: usize>(&self, dp: D) {
        let mut p = self.panels.start;
        while p < self.panels.end {
            let np = if p + NP <= self.panels.end {
                NP
            } else {
                PANEL_GROUP
            };
            let block = if D::WIDE { 4 } else { 2 };
            let mut r0 = 0;
            while r0 < self.m {
                let rows = (self.m - r0).min(block);
                let t = Tile {
                    a: self.a.as_ptr(),
                    a_stride: self.mr,
                    row0: 0,
                    panel: p,
                    q0: 0,
                    kcp: self.kp,
                    first: true,
                }
                .down(r0);
                // SAFETY: `a` is [kp][m]; rows r0..r0 + rows < m; panels p..p + np lie in the task's range (whole
                // groups of 4 inside the padded storage).
                unsafe {
                    match (rows, np == NP) {
                        (1, true) => self.tile::<D, 1, NP>(dp, t),
                        (2, true) => self.tile::<D, 2, NP>(dp, t),
                        (3, true) => self.tile::<D, 3, NP>(dp, t),
                        (_, true) => self.tile::<D, 4, NP>(dp, t),
                        (1, false) => self.tile::<D, 1, PANEL_GROUP>(dp, t),
                        (2, false) => self.tile::<D, 2, PANEL_GROUP>(dp, t),
                        (3, false) => self.tile::<D, 3, PANEL_GROUP>(dp, t),
                        (_, false) => self.tile::<D, 4, PANEL_GROUP>(dp, t),
                    }
                }
                r0 += rows;
            }
            p += np;
        }
    }

    /// Many rows: blocks of [`GROUP_PANELS`] panels × [`KCP`] pairs (read in place from the packed storage), each
    /// swept by every row block's register tiles; accumulators pass through `y` between blocks of pairs.
    #[inline(always)]
    fn blocked<D: Dp, const MR: usize, const NP: usize>(&self, dp: D) {
        let blocks = self.m.div_ceil(MR);
        let mut g0 = self.panels.start;
        while g0 < self.panels.end {
            let g1 = (g0 + GROUP_PANELS).min(self.panels.end);
            let mut q0 = 0;
            while q0 < self.kp {
                let kcp = KCP.min(self.kp - q0);
                for b in 0..blocks {
                    let rows = MR.min(self.m - b * MR);
                    let t = Tile {
                        // SAFETY: block b of `a` is [kp][MR]; q0 < kp.
                        a: unsafe { self.a.as_ptr().add(b * self.kp * MR + q0 * MR) },
                        a_stride: MR,
                        row0: b * MR,
                        panel: g0,
                        q0,
                        kcp,
                        first: q0 == 0,
                    };
                    let mut p = g0;
                    while p < g1 {
                        // SAFETY: rows of block b < m; panels p..p + NP inside g0..g1 (groups are multiples of 4).
                        unsafe { self.rows_tile::<D, MR, NP>(dp, Tile { panel: p, ..t }, rows) };
                        p += NP;
                    }
                }
                q0 += kcp;
            }
            g0 = g1;
        }
    }

    /// A tile of `rows ≤ MR` rows: the full micro-kernel, or the rows split as 8/4/2/1 for the last row block.
    ///
    /// # Safety
    /// As [`Task::tile`] for `rows` rows.
    #[inline(always)]
    unsafe fn rows_tile<D: Dp, const MR: usize, const NP: usize>(
        &self,
        dp: D,
        t: Tile,
        rows: usize,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            if rows == MR {
                return self.tile::<D, MR, NP>(dp, t);
            }
            let mut r0 = 0;
            while r0 < rows {
                let left = rows - r0;
                let step = if left >= 8 && MR > 8 {
                    self.tile::<D, 8, NP>(dp, t.down(r0));
                    8
                } else if left >= 4 {
                    self.tile::<D, 4, NP>(dp, t.down(r0));
                    4
                } else if left >= 2 {
                    self.tile::<D, 2, NP>(dp, t.down(r0));
                    2
                } else {
                    self.tile::<D, 1, NP>(dp, t.down(r0));
                    1
                };
                r0 += step;
            }
        }
    }

    /// Rows `t.row0..t.row0 + R` × panels `t.panel..t.panel + NP`, pairs `t.q0..t.q0 + t.kcp`: accumulators start at
    /// zero (`t.first`) or from `out`, advance one `vdpbf16ps` per pair and are stored back (columns `< n` only).
    ///
    /// # Safety
    /// `t.a` must hold `[t.kcp][t.a_stride]` readable pairs with `R ≤ a_stride`; panels `t.panel..t.panel + NP` must
    /// lie in the storage and pairs `t.q0 + t.kcp ≤ kp`; rows `t.row0..t.row0 + R` must be `< m`.
    #[inline(always)]
    unsafe fn tile<D: Dp, const R: usize, const NP: usize>(&self, dp: D, t: Tile) {
        let mut acc = [[dp.zero(); NP]; R];
        let col0 = t.panel * PANEL;
        if !t.first {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                for (j, v) in acc_r.iter_mut().enumerate() {
                    // SAFETY: row t.row0 + r < m; columns checked inside.
                    *v = unsafe { self.load_out(dp, t.row0 + r, col0 + j * PANEL) };
                }
            }
        }
        let stride = self.kp * PANEL;
        // SAFETY: panel t.panel, pair t.q0 inside the storage (caller).
        let w0 = unsafe { self.w.as_ptr().add(t.panel * stride + t.q0 * PANEL) };
        for q in 0..t.kcp {
            // SAFETY: panels t.panel + j < the storage's, pair t.q0 + q < kp (caller).
            let wv: [D::P; NP] =
                std::array::from_fn(|j| unsafe { dp.load_pairs(w0.add(j * stride + q * PANEL)) });
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: q < kcp, r < R ≤ a_stride.
                let xv = dp.splat_pair(unsafe { *t.a.add(q * t.a_stride + r) });
                for (v, w) in acc_r.iter_mut().zip(&wv) {
                    *v = dp.dp(*v, *w, xv);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (j, v) in acc_r.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { self.store_out(dp, *v, t.row0 + r, col0 + j * PANEL) };
            }
        }
    }

    /// `out[row][col..col + 16]` (columns ≥ n read as 0).
    ///
    /// # Safety
    /// `row < m`.
    #[inline(always)]
    unsafe fn load_out<D: Dp>(&self, dp: D, row: usize, col: usize) -> D::A {
        let n = self.n;
        // SAFETY: row < m and the columns read are < n, inside the [m, n] output.
        unsafe {
            let p = self.out.0.add(row * n + col);
            if col + PANEL <= n {
                dp.load_acc(p)
            } else {
                let mut tmp = [0.0f32; PANEL];
                for (c, t) in tmp.iter_mut().enumerate().take(n.saturating_sub(col)) {
                    *t = *p.add(c);
                }
                dp.acc_of(tmp)
            }
        }
    }

    /// Writes `v` to `out[row][col..col + 16]`, dropping columns ≥ n.
    ///
    /// # Safety
    /// `row < m`, and no other task writes these columns.
    #[inline(always)]
    unsafe fn store_out<D: Dp>(&self, dp: D, v: D::A, row: usize, col: usize) {
        let n = self.n;
        // SAFETY: row < m and the columns written are < n, this task's.
        unsafe {
            let p = self.out.0.add(row * n + col);
            if col + PANEL <= n {
                dp.store_acc(v, p);
            } else {
                let tmp = dp.lanes(v);
                for (c, t) in tmp.iter().enumerate().take(n.saturating_sub(col)) {
                    *p.add(c) = *t;
                }
            }
        }
    }
}
