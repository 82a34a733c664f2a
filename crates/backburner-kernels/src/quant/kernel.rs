//! [`qmatmul`]: threads × panel ranges × cache blocks × register tiles of the generic kernel.

use super::acts::{ActBlock, QuantizedActs, ACT_BLOCK};
use super::fmt::{At, Fmt, Iq4Xs, Q40, Q4K, Q5K, Q6K, Q80};
use super::format::QuantFormat;
use super::isa::{qdispatch, QIsa, QKernel, LANES};
use super::pack::{QuantMatrix, PANEL_GROUP};
use crate::parallel::{for_each_task, split_range, threads};

/// Below this many multiply-adds a product runs on the calling thread alone.
const SERIAL_WORK: usize = 1 << 18;
/// Packed weight bytes per cache block of the many-row path: the block's panels are read from memory once and then
/// from L2 for every row tile (256 KiB leaves room in a 512 KiB–1 MiB L2 for the activation rows).
const CACHE_BLOCK_BYTES: usize = 256 << 10;
/// Packed weight bytes of one panel per `k` range of the many-row path (a tile's weights and its activation rows
/// then fit L1).
const KC_BYTES: usize = 12 << 10;
/// How far ahead of the block being read the kernels prefetch a panel's bytes (the decode path streams each panel
/// once from memory, as one sequential stream per thread).
const PREFETCH_BYTES: usize = 6 << 10;

/// `y[i·ldy + j] = Σ_kk W[j][kk]·x[i][kk]` for `i < m`, `j < n`, with `x` quantized: `x: [m, k]` as
/// [`QuantizedActs`], `w: [n, k]`, `y` row-major with row stride `ldy ≥ n` (columns `n..ldy` are not touched).
///
/// Each output is the canonical sum of the [module docs](super): bit-identical to [`qmatmul_reference`] on every
/// instruction set, thread count, batch size and row position. Runs on the current rayon pool, split by contiguous
/// panel ranges.
///
/// [`qmatmul_reference`]: super::qmatmul_reference
///
/// Panics if `x.k() != w.k()`, `ldy < n` or `y` is shorter than `(m − 1)·ldy + n`.
pub fn qmatmul(x: &QuantizedActs, w: &QuantMatrix, y: &mut [f32], ldy: usize) {
    let (m, n, k) = (x.rows(), w.n(), w.k());
    if !check_shapes("qmatmul", x, w, y, ldy) {
        return;
    }
    if k == 0 {
        for i in 0..m {
            y[i * ldy..i * ldy + n].fill(0.0);
        }
        return;
    }
    let groups = w.n_panels() / PANEL_GROUP;
    let n_tasks = if m.saturating_mul(n).saturating_mul(k) < SERIAL_WORK {
        1
    } else {
        threads().min(groups)
    };
    let chunk = (CACHE_BLOCK_BYTES / w.panel_bytes()).max(1);
    let out = OutPtr(y.as_mut_ptr());
    let live = n.div_ceil(LANES);
    for_each_task(n_tasks, |t| {
        let g = split_range(groups, n_tasks, t);
        qdispatch(Task {
            x,
            w,
            out: &out,
            ldy,
            panels: (g.start * PANEL_GROUP).min(live)..(g.end * PANEL_GROUP).min(live),
            chunk,
        });
    });
}

/// Checks the shapes shared by [`qmatmul`] and its reference; `false` when there is nothing to compute.
pub(crate) fn check_shapes(
    what: &str,
    x: &QuantizedActs,
    w: &QuantMatrix,
    y: &[f32],
    ldy: usize,
) -> bool {
    let (m, n) = (x.rows(), w.n());
    assert_eq!(
        x.k(),
        w.k(),
        "{what}: x has k = {}, w has k = {}",
        x.k(),
        w.k()
    );
    assert!(ldy >= n, "{what}: ldy = {ldy} < n = {n}");
    if m == 0 || n == 0 {
        return false;
    }
    assert!(
        y.len() >= (m - 1) * ldy + n,
        "{what}: y has {} elements, [{m}, {n}] with stride {ldy} needs {}",
        y.len(),
        (m - 1) * ldy + n
    );
    true
}

/// The output shared by the tasks, which write disjoint columns.
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (their own panels' columns) of one live `&mut [f32]`, and `qmatmul` returns
// only after every task has finished.
unsafe impl Sync for OutPtr {}

/// One task: panels `panels` of the output (all of them `< n / 16` rounded up), every row.
struct Task<'a> {
    x: &'a QuantizedActs,
    w: &'a QuantMatrix,
    out: &'a OutPtr,
    ldy: usize,
    panels: std::ops::Range<usize>,
    /// Panels per cache block.
    chunk: usize,
}

impl QKernel for Task<'_> {
    type Out = ();

    #[inline(always)]
    fn run<I: QIsa>(self, isa: I) {
        match self.w.format() {
            QuantFormat::Q8_0 => self.run_fmt::<I, Q80>(isa),
            QuantFormat::Q4_0 => self.run_fmt::<I, Q40>(isa),
            QuantFormat::Q4K => self.run_fmt::<I, Q4K>(isa),
            QuantFormat::Q5K => self.run_fmt::<I, Q5K>(isa),
            QuantFormat::Q6K => self.run_fmt::<I, Q6K>(isa),
            QuantFormat::Iq4Xs => self.run_fmt::<I, Iq4Xs>(isa),
        }
    }
}

impl Task<'_> {
    /// Cache blocks of `chunk` panels; in each, all row tiles of at most `I::ROWS` rows × each panel. With few rows
    /// (decode: one row tile) each panel is streamed from memory once over the whole `k`. With many, a block's
    /// panels come from L2 after the first row tile, and `k` is cut into ranges of about [`KC_BYTES`] per panel so
    /// that a tile's weights and activation rows stay in L1; the accumulators go through `y` between ranges (f32
    /// stores and loads are exact, so the chain of each output is unchanged).
    #[inline(always)]
    fn run_fmt<I: QIsa, F: Fmt>(&self, isa: I) {
        let m = self.x.rows();
        let units = self.w.k() / F::LAY.unit;
        let kc = if m <= I::ROWS {
            units
        } else {
            (KC_BYTES / F::LAY.bytes).max(1)
        };
        let mut p0 = self.panels.start;
        while p0 < self.panels.end {
            let p1 = (p0 + self.chunk).min(self.panels.end);
            let mut u0 = 0;
            while u0 < units {
                let us = u0..(u0 + kc).min(units);
                let mut r0 = 0;
                while r0 < m {
                    let rows = (m - r0).min(I::ROWS).min(4);
                    for p in p0..p1 {
                        let t = Tile {
                            p,
                            row0: r0,
                            units: us.clone(),
                        };
                        // SAFETY: p < n_panels, rows r0..r0 + rows < m, units < k / unit.
                        unsafe {
                            match rows {
                                1 => self.tile::<I, F, 1>(isa, t),
                                2 => self.tile::<I, F, 2>(isa, t),
                                3 => self.tile::<I, F, 3>(isa, t),
                                _ => self.tile::<I, F, 4>(isa, t),
                            }
                        }
                    }
                    r0 += rows;
                }
                u0 = us.end;
            }
            p0 = p1;
        }
    }

    /// Rows `t.row0..t.row0 + R` × panel `t.p` over units `t.units`: accumulators from zero (first range) or from
    /// the output, written back to the output (columns `< n`).
    ///
    /// # Safety
    /// `t.p < n_panels`, `t.row0 + R ≤ m`, `t.units.end ≤ k / unit`, and no other task writes panel `t.p`'s columns.
    #[inline(always)]
    unsafe fn tile<I: QIsa, F: Fmt, const R: usize>(&self, isa: I, t: Tile) {
        let lay = F::LAY;
        let bpu = lay.unit / ACT_BLOCK;
        let base = self.w.as_bytes()[t.p * self.w.panel_bytes()..].as_ptr();
        let xq: [*const u8; R] = std::array::from_fn(|r| self.x.row_q(t.row0 + r).as_ptr().cast());
        let xb: [&[ActBlock]; R] = std::array::from_fn(|r| self.x.row_blocks(t.row0 + r));
        let cols = (self.w.n() - t.p * LANES).min(LANES);
        // SAFETY: row row0 + r < m and columns p·16 .. p·16 + cols < n lie in y (checked by `qmatmul`); they are
        // this task's.
        let out = |r: usize| unsafe { self.out.0.add((t.row0 + r) * self.ldy + t.p * LANES) };
        let mut acc = [isa.f_zero(); R];
        if t.units.start > 0 {
            for (r, a) in acc.iter_mut().enumerate() {
                let mut v = [0.0f32; LANES];
                // SAFETY: see `out`.
                unsafe { std::ptr::copy_nonoverlapping(out(r), v.as_mut_ptr(), cols) };
                *a = isa.load_f(v);
            }
        }
        let block_bytes = lay.bytes / bpu;
        for u in t.units {
            // SAFETY: unit u of panel p lies in the storage (panel_bytes = units · lay.bytes).
            let up = unsafe { base.add(u * lay.bytes) };
            // SAFETY: as above.
            let ud = unsafe { F::unit_scales(isa, up) };
            for b in 0..bpu {
                // A hint only: the address may lie past the storage (wrapping arithmetic, never dereferenced).
                let ahead = up.wrapping_add(PREFETCH_BYTES + b * block_bytes);
                for line in (0..block_bytes).step_by(64) {
                    isa.prefetch(ahead.wrapping_add(line));
                }
                // SAFETY: block u·bpu + b's 32 inputs lie in each row; the unit is whole.
                unsafe {
                    block::<I, F, R>(isa, At { u: up, b, ud }, &xq, &xb, u * bpu + b, &mut acc)
                };
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let v = isa.lanes(*a);
            // SAFETY: see `out`.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out(r), cols) };
        }
    }
}

/// Where a tile works: panel `p`, rows from `row0`, units (GGUF blocks along `k`) `units`.
#[derive(Clone)]
struct Tile {
    p: usize,
    row0: usize,
    units: std::ops::Range<usize>,
}

/// One 32-block of `R` rows against one panel unit: the exact integer sums over each half of the block (widened
/// as often as the ISA needs), then the format's float step into `acc`.
///
/// # Safety
/// `u` points at a whole panel unit of `F`, `b < units' blocks`, and each `xq[r]` has inputs `32·bi..32·bi + 32`.
#[inline(always)]
unsafe fn block<I: QIsa, F: Fmt, const R: usize>(
    isa: I,
    at: At<I>,
    xq: &[*const u8; R],
    xb: &[&[ActBlock]; R],
    bi: usize,
    acc: &mut [I::F; R],
) {
    let every = isa.widen_every(F::cmax::<I>());
    // SAFETY: forwarded from the caller.
    let pre = unsafe { F::pre(isa, at.u, at.b) };
    let (mut al, mut ah) = ([isa.a_zero(); R], [isa.a_zero(); R]);
    let (mut sl, mut sh) = ([isa.i_zero(); R], [isa.i_zero(); R]);
    for h in 0..4 {
        // SAFETY: forwarded from the caller.
        let (lo, hi) = unsafe { F::codes(isa, at.u, at.b, h, pre) };
        for r in 0..R {
            // SAFETY: inputs 32·bi + 4h.. and 32·bi + 16 + 4h.. (4 bytes each) lie in row r.
            let (xl, xh) = unsafe {
                let p = xq[r].add(ACT_BLOCK * bi + 4 * h);
                (
                    p.cast::<i32>().read_unaligned(),
                    p.add(16).cast::<i32>().read_unaligned(),
                )
            };
            al[r] = F::dot(isa, al[r], lo, xl);
            ah[r] = F::dot(isa, ah[r], hi, xh);
        }
        if (h + 1) % every == 0 || h == 3 {
            for r in 0..R {
                sl[r] = isa.widen(al[r], sl[r]);
                sh[r] = isa.widen(ah[r], sh[r]);
                al[r] = isa.a_zero();
                ah[r] = isa.a_zero();
            }
        }
    }
    // SAFETY: forwarded from the caller.
    let s = unsafe { F::scales(isa, at) };
    for r in 0..R {
        acc[r] = F::combine(isa, s, sl[r], sh[r], xb[r][bi], acc[r]);
    }
}
