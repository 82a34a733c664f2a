//! The product kernels: `matmul` (threads × panel ranges × micro-kernels) and its plain-loop twin.

use std::cell::RefCell;

use super::pack::{PackedMatrix, Storage, WeightDtype, PANEL_GROUP};
use super::src::{widen_block, Bf16Src, F16Src, F32Src, Src};
use super::PANEL;
use crate::parallel::{for_each_task, split_range, threads};
use crate::simd::{dispatch, Isa, Kernel};

/// Inputs per block of the prefill path (the widened weight block is `KC × 16` f32 per panel).
const KC: usize = 256;
/// Panels widened per block (`KC × 16 × 16 × 4` bytes = 256 KiB, which stays in L2).
const GROUP_PANELS: usize = 16;
/// Up to this many rows (decode, and a batch of decode steps) a product streams the weights once from memory with the
/// whole `k` chain in registers, in row blocks that fit the registers (4 rows on a wide ISA, 2 otherwise): the
/// first block reads a pass's panels from memory, the next ones from the cache. More rows go through the blocked
/// prefill path. Measured on the bench model's decode batch (`batch_decode_timing`): the blocked path at 3–8 rows
/// was slower than two passes of the direct one; and at the 27B's MLP shapes with bf16 weights (gate|up `[34816,
/// 5120]` and down, 1 thread, alternating runs of `qverify_27b`), at 9–16 rows (speculative decoding's verify steps)
/// up to four passes of the direct one took about half the blocked path's time in the f32 arithmetic (9 rows: 97 →
/// 44–48 ms) and 20–30 % less in the bf16-activation one (9 rows: 44 → 32 ms, 30 → 24 ms).
pub(super) const DIRECT_ROWS: usize = 16;
/// Below this many multiply-adds a product runs on the calling thread alone.
const SERIAL_WORK: usize = 1 << 16;

/// Rows per packed activation block for `m` rows: all of them on the direct (decode) path, else the register tile's
/// height (12 on a wide ISA, 6 otherwise). Shared by the f32 and bf16-activation products.
pub(super) fn row_block(m: usize, wide: bool) -> usize {
    match (m <= DIRECT_ROWS, wide) {
        (true, _) => m,
        (false, true) => 12,
        (false, false) => 6,
    }
}

/// Tasks for a product of `work` multiply-adds over `groups` panel groups: one below [`SERIAL_WORK`], else one per
/// pool thread (at most one per group).
pub(super) fn task_count(work: usize, groups: usize) -> usize {
    if work < SERIAL_WORK {
        1
    } else {
        threads().min(groups)
    }
}

/// `y = x · Wᵀ`: x `[m, k]` f32, `w` packed `[n, k]`, y `[m, n]` f32 (overwritten).
///
/// Every `y[i][j]` is the fused multiply-add chain of the [module docs](super) (bit-identical to
/// [`matmul_reference`] on every instruction set and thread count). Runs on the current rayon pool, split by
/// contiguous panel ranges, one task per thread.
///
/// Panics if `x` or `y` do not have those shapes.
pub fn matmul(x: &[f32], m: usize, w: &PackedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n(), w.k());
    assert_eq!(x.len(), m * k, "matmul: x is not [{m}, {k}]");
    assert_eq!(y.len(), m * n, "matmul: y is not [{m}, {n}]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    if let Storage::Pairs(d) = &w.data {
        return super::bf16::matmul_pairs(x, m, w, d.view::<u32>(), y);
    }
    let wide = dispatch(IsWide);
    let direct = m <= DIRECT_ROWS;
    let mr = row_block(m, wide);
    let a = pack_rows(x, m, k, mr);
    let groups = w.n_panels() / PANEL_GROUP;
    let n_tasks = task_count(m * n * k, groups);
    let out = OutPtr(y.as_mut_ptr());
    for_each_task(n_tasks, |t| {
        let g = split_range(groups, n_tasks, t);
        let job = Task {
            a: &a,
            m,
            mr,
            w,
            out: &out,
            panels: g.start * PANEL_GROUP..g.end * PANEL_GROUP,
            direct,
        };
        dispatch(job);
    });
}

/// The plain loop with the same arithmetic as [`matmul`]: `y[i][j] = fma(x[i][k-1], W[j][k-1], … fma(x[i][0],
/// W[j][0], +0.0))`, one element at a time; for a matrix in the bf16-activation arithmetic
/// ([`PackedMatrix::precision`] = [`Precision::Bf16`](super::Precision)), its chain of `vdpbf16ps` steps (see
/// `matmul::bf16`), emulated in plain Rust. The slow, obvious twin for tests.
///
/// Panics if `x` or `y` do not have the shapes of [`matmul`].
pub fn matmul_reference(x: &[f32], m: usize, w: &PackedMatrix, y: &mut [f32]) {
    let (n, k) = (w.n(), w.k());
    assert_eq!(x.len(), m * k, "matmul_reference: x is not [{m}, {k}]");
    assert_eq!(y.len(), m * n, "matmul_reference: y is not [{m}, {n}]");
    let wr = w.to_f32_rows();
    if let Storage::Pairs(_) = &w.data {
        let kp = k.div_ceil(2);
        let bits = |j: usize, kk: usize| -> u32 {
            wr.get(j * k + kk)
                .filter(|_| kk < k)
                .map_or(0, |v| v.to_bits() >> 16)
        };
        let pairs: Vec<u32> = (0..n * kp)
            .map(|e| bits(e / kp, 2 * (e % kp)) | bits(e / kp, 2 * (e % kp) + 1) << 16)
            .collect();
        return super::bf16::matmul_pairs_reference(x, m, k, n, &pairs, y);
    }
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for kk in 0..k {
                acc = x[i * k + kk].mul_add(wr[j * k + kk], acc);
            }
            y[i * n + j] = acc;
        }
    }
}

/// `x [m, k]` as blocks of `mr` rows, each `[k][mr]` (row-interleaved, zero rows past `m`).
fn pack_rows(x: &[f32], m: usize, k: usize, mr: usize) -> Vec<f32> {
    if mr == 1 {
        return x.to_vec();
    }
    let blocks = m.div_ceil(mr);
    let mut a = vec![0.0f32; blocks * k * mr];
    for (b, blk) in a.chunks_mut(k * mr).enumerate() {
        for r in 0..mr.min(m - b * mr) {
            let row = &x[(b * mr + r) * k..(b * mr + r + 1) * k];
            for (kk, v) in row.iter().enumerate() {
                blk[kk * mr + r] = *v;
            }
        }
    }
    a
}

/// The output matrix shared by the tasks, which write disjoint column ranges.
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements (their own panels' columns) of one live `&mut [f32]`, and `matmul` returns
// only after every task has finished.
unsafe impl Sync for OutPtr {}

/// Asks [`dispatch`] whether the chosen instruction set is [`Isa::WIDE`].
struct IsWide;

impl Kernel for IsWide {
    type Out = bool;
    #[inline(always)]
    fn run<I: Isa>(self, _: I) -> bool {
        I::WIDE
    }
}

/// One task: panels `panels` of the output, every row.
struct Task<'a> {
    a: &'a [f32],
    m: usize,
    mr: usize,
    w: &'a PackedMatrix,
    out: &'a OutPtr,
    panels: std::ops::Range<usize>,
    direct: bool,
}

impl Kernel for Task<'_> {
    type Out = ();

    #[inline(always)]
    fn run<I: Isa>(self, isa: I) {
        let k = self.w.k();
        let stride = k * PANEL;
        match (&self.w.data, self.w.dtype()) {
            (Storage::F32(d), _) => {
                let src = F32Src {
                    base: d.view::<f32>().as_ptr(),
                    stride,
                };
                self.run_with(isa, src);
            }
            (Storage::Half(d), WeightDtype::Bf16) => {
                let src = Bf16Src {
                    base: d.view::<u16>().as_ptr(),
                    stride,
                };
                self.run_with(isa, src);
            }
            (Storage::Pairs(_), _) => unreachable!("matmul runs pair storage in matmul::bf16"),
            (Storage::Half(d), _) => {
                let src = F16Src {
                    base: d.view::<u16>().as_ptr(),
                    stride,
                };
                self.run_with(isa, src);
            }
        }
    }
}

impl Task<'_> {
    #[inline(always)]
    fn run_with<I: Isa, S: Src>(&self, isa: I, src: S) {
        if self.direct {
            if I::WIDE && self.m == 1 {
                // One row: eight panels (eight memory streams) per pass keep more loads in flight; measured ~5 %
                // faster than four at 1 thread on a weight stream far larger than the caches (alternating runs of
                // the `matmul_decode_stream` bench).
                self.direct_rows::<I, S, 8>(isa, src);
            } else if I::WIDE {
                self.direct_rows::<I, S, 4>(isa, src);
            } else {
                self.direct_rows::<I, S, 2>(isa, src);
            }
        } else if self.mr == 12 {
            // the row block `a` was packed for (chosen by an earlier dispatch: the same instruction set outside tests,
            // whose dispatch cap may change in between)
            self.blocked::<I, S, 12, 2>(isa, src);
        } else {
            self.blocked::<I, S, 6, 1>(isa, src);
        }
    }

    /// Few rows: each panel group is streamed once, weights widened in registers, the whole `k` chain in
    /// registers. `NP` panels per pass (a multiple of 4, or at most 4); a task's last panels, when fewer than `NP`,
    /// go 4 at a time (task ranges are whole groups of 4).
    #[inline(always)]
    fn direct_rows<I: Isa, S: Src, const NP: usize>(&self, isa: I, src: S) {
        let mut p = self.panels.start;
        while p + NP <= self.panels.end {
            self.direct_pass::<I, S, NP>(isa, src, p);
            p += NP;
        }
        while p < self.panels.end {
            self.direct_pass::<I, S, PANEL_GROUP>(isa, src, p);
            p += PANEL_GROUP;
        }
    }

    /// One pass of [`Task::direct_rows`] over panels `p..p + NP`.
    #[inline(always)]
    fn direct_pass<I: Isa, S: Src, const NP: usize>(&self, isa: I, src: S, p: usize) {
        let block = if I::WIDE { 4 } else { 2 };
        let mut r0 = 0;
        while r0 < self.m {
            let rows = (self.m - r0).min(block);
            let t = Tile {
                // SAFETY: r0 < m = mr, inside each input's row of `a`.
                a: unsafe { self.a.as_ptr().add(r0) },
                a_stride: self.mr,
                row0: r0,
                panel: p,
                kc: self.w.k(),
                first: true,
            };
            // SAFETY: `a` holds [k][mr] with mr = m and rows r0..r0 + rows < m; panels p..p+NP lie in the storage
            // (the callers keep p + NP within the task's range, a whole number of groups inside the padded
            // storage); rows r0..r0 + rows of `out` exist.
            unsafe {
                match rows {
                    1 => self.tile::<I, S, 1, NP>(isa, src, t),
                    2 => self.tile::<I, S, 2, NP>(isa, src, t),
                    3 => self.tile::<I, S, 3, NP>(isa, src, t),
                    _ => self.tile::<I, S, 4, NP>(isa, src, t),
                }
            }
            r0 += rows;
        }
    }

    /// Many rows: weight blocks widened to f32 once per task into an L2-resident buffer, then register tiles.
    #[inline(always)]
    fn blocked<I: Isa, S: Src, const MR: usize, const NP: usize>(&self, isa: I, src: S) {
        let k = self.w.k();
        let blocks = self.m.div_ceil(MR);
        // The buffer is taken out of the thread-local for the duration (no closure around the hot loop: a closure
        // body would be compiled without the caller's target features).
        let mut buf = WIDE_BUF.with(|b| b.take());
        let mut g0 = self.panels.start;
        while g0 < self.panels.end {
            let g1 = (g0 + GROUP_PANELS).min(self.panels.end);
            let mut k0 = 0;
            while k0 < k {
                let kc = KC.min(k - k0);
                let block = widen_block(isa, src, &mut buf, g0, g1, k0, kc);
                for b in 0..blocks {
                    let rows = MR.min(self.m - b * MR);
                    // SAFETY: block b of `a` is [k][MR]; `block` holds panels g0..g1 (a whole number of NP
                    // pairs, since task ranges and groups are multiples of 4 panels) for inputs k0..k0+kc.
                    let a = unsafe { self.a.as_ptr().add(b * k * MR + k0 * MR) };
                    let mut p = g0;
                    while p < g1 {
                        let t = Tile {
                            a,
                            a_stride: MR,
                            row0: b * MR,
                            panel: p - g0,
                            kc,
                            first: k0 == 0,
                        };
                        // SAFETY: see above; the block's panel 0 is output panel g0.
                        unsafe { self.rows_tile::<I, MR, NP>(isa, block, t, rows, g0) };
                        p += NP;
                    }
                }
                k0 += kc;
            }
            g0 = g1;
        }
        WIDE_BUF.with(|b| b.replace(buf));
    }

    /// A tile of `rows ≤ MR` rows: the full micro-kernel, or the rows split as 8/4/2/1 for the last row block.
    ///
    /// # Safety
    /// As [`Task::tile_at`]; `t.panel` is relative to `src`, whose panel 0 is output panel `col_shift`.
    #[inline(always)]
    unsafe fn rows_tile<I: Isa, const MR: usize, const NP: usize>(
        &self,
        isa: I,
        src: F32Src,
        t: Tile,
        rows: usize,
        col_shift: usize,
    ) {
        #[inline(always)]
        fn at(t: Tile, r0: usize) -> Tile {
            Tile {
                // SAFETY: r0 < MR, inside the block's [kc][MR] rows.
                a: unsafe { t.a.add(r0) },
                row0: t.row0 + r0,
                ..t
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe {
            if rows == MR {
                return self.tile_at::<I, F32Src, MR, NP>(isa, src, t, col_shift);
            }
            let mut r0 = 0;
            while r0 < rows {
                let left = rows - r0;
                if left >= 8 && MR > 8 {
                    self.tile_at::<I, F32Src, 8, NP>(isa, src, at(t, r0), col_shift);
                    r0 += 8;
                } else if left >= 4 {
                    self.tile_at::<I, F32Src, 4, NP>(isa, src, at(t, r0), col_shift);
                    r0 += 4;
                } else if left >= 2 {
                    self.tile_at::<I, F32Src, 2, NP>(isa, src, at(t, r0), col_shift);
                    r0 += 2;
                } else {
                    self.tile_at::<I, F32Src, 1, NP>(isa, src, at(t, r0), col_shift);
                    r0 += 1;
                }
            }
        }
    }

    /// # Safety
    /// As [`Task::tile_at`] with no column shift.
    #[inline(always)]
    unsafe fn tile<I: Isa, S: Src, const R: usize, const NP: usize>(
        &self,
        isa: I,
        src: S,
        t: Tile,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { self.tile_at::<I, S, R, NP>(isa, src, t, 0) }
    }

    /// Rows `t.row0..t.row0 + R` × panels `t.panel..t.panel + NP` of `src` (output panels shifted by
    /// `col_shift`): accumulators start at zero (`t.first`) or from `out`, run the chain over `t.kc` inputs and
    /// are stored back (only columns `< n`).
    ///
    /// # Safety
    /// `t.a` must hold `[t.kc][t.a_stride]` readable f32 with `R ≤ a_stride`; `src` must hold panels `t.panel ..
    /// t.panel + NP` for inputs `0..t.kc`; rows `t.row0..t.row0 + R` must be `< m`.
    #[inline(always)]
    unsafe fn tile_at<I: Isa, S: Src, const R: usize, const NP: usize>(
        &self,
        isa: I,
        src: S,
        t: Tile,
        col_shift: usize,
    ) {
        let n = self.w.n();
        let mut acc = [[isa.zero(); NP]; R];
        let col0 = (t.panel + col_shift) * PANEL;
        if !t.first {
            for (r, acc_r) in acc.iter_mut().enumerate() {
                for (j, v) in acc_r.iter_mut().enumerate() {
                    // SAFETY: row t.row0 + r < m; columns checked by `load_out`.
                    *v = unsafe { self.load_out(isa, t.row0 + r, col0 + j * PANEL, n) };
                }
            }
        }
        for kk in 0..t.kc {
            let mut bv = [isa.zero(); NP];
            for (j, b) in bv.iter_mut().enumerate() {
                // SAFETY: the caller guarantees panel t.panel + j, input t.k0 + kk.
                *b = unsafe { src.load(isa, t.panel + j, kk) };
            }
            for (r, acc_r) in acc.iter_mut().enumerate() {
                // SAFETY: kk < kc, r < R ≤ a_stride.
                let av = isa.splat(unsafe { *t.a.add(kk * t.a_stride + r) });
                for (v, b) in acc_r.iter_mut().zip(&bv) {
                    *v = isa.fma(*v, av, *b);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (j, v) in acc_r.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe { self.store_out(isa, *v, t.row0 + r, col0 + j * PANEL, n) };
            }
        }
    }

    /// `out[row][col..col + 16]` (columns ≥ n read as 0).
    ///
    /// # Safety
    /// `row < m`.
    #[inline(always)]
    unsafe fn load_out<I: Isa>(&self, isa: I, row: usize, col: usize, n: usize) -> I::V {
        // SAFETY: row < m and the columns read are < n, inside the [m, n] output.
        unsafe {
            let p = self.out.0.add(row * n + col);
            if col + PANEL <= n {
                isa.load_ptr(p)
            } else {
                let mut tmp = [0.0f32; PANEL];
                for (c, t) in tmp.iter_mut().enumerate().take(n.saturating_sub(col)) {
                    *t = *p.add(c);
                }
                isa.load(&tmp)
            }
        }
    }

    /// Writes `v` to `out[row][col..col + 16]`, dropping columns ≥ n.
    ///
    /// # Safety
    /// `row < m`, and no other task writes these columns.
    #[inline(always)]
    unsafe fn store_out<I: Isa>(&self, isa: I, v: I::V, row: usize, col: usize, n: usize) {
        // SAFETY: row < m and the columns written are < n, inside the [m, n] output; columns are this task's.
        unsafe {
            let p = self.out.0.add(row * n + col);
            if col + PANEL <= n {
                isa.store_ptr(v, p);
            } else {
                let tmp = isa.lanes(v);
                for (c, t) in tmp.iter().enumerate().take(n.saturating_sub(col)) {
                    *p.add(c) = *t;
                }
            }
        }
    }
}

/// Where a tile reads its `A` rows and which panels/inputs of `B`.
#[derive(Clone, Copy)]
struct Tile {
    /// `[kc][a_stride]` f32.
    a: *const f32,
    a_stride: usize,
    /// First output row.
    row0: usize,
    /// First panel, relative to the source.
    panel: usize,
    /// Inputs (from the source's first).
    kc: usize,
    /// Start from zero instead of the output's current values.
    first: bool,
}

thread_local! {
    /// The widened weight block of the prefill path (per thread, reused).
    static WIDE_BUF: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}
