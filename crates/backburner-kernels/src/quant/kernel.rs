//! [`qmatmul`]: threads × panel ranges × cache blocks × register tiles of the generic kernel.

use super::acts::{ActBlock, QuantizedActs, ACT_BLOCK};
use super::fmt::{At, Fmt, Iq4Xs, Prefetch, Q40, Q4K, Q5K, Q6K, Q80};
use super::fmt_gen::Gen;
use super::format::QuantFormat;
use super::isa::{QIsa, QKernel, LANES};
use super::pack::QuantMatrix;

/// Below this many multiply-adds a product runs on the calling thread alone.
pub(super) const SERIAL_WORK: usize = 1 << 18;
/// How far ahead of the block being read the kernels prefetch a panel's bytes (the decode path streams each panel
/// once from memory, as one sequential stream per thread), for [`Prefetch::EveryLine`]. 12 KiB since the weights
/// live in huge pages (`crate::hugebuf`): on the Intel AVX-512 VM at 2 threads, 6 alternating rounds, the decode share
/// of the read bandwidth went 78.9 → 82.7 % (IQ4_XS) and 81.1 → 84.5 % (Q4_K_M) from 6 KiB, Q8_0 and 1 thread
/// level; with base pages 3, 6 and 12 KiB had measured alike.
const PREFETCH_BYTES: usize = 12 << 10;
/// How far ahead [`Prefetch::OneLine`] touches a panel, bytes: 16 KiB, four 4 KiB pages, so that the next pages'
/// translations and first lines are under way before the hardware stream prefetcher (which stops at page
/// boundaries) gets there.
const SPARSE_PREFETCH_BYTES: usize = 16 << 10;
/// How far ahead [`Prefetch::Near`] prefetches every line of a panel, bytes (measured: see [`Prefetch::Near`]).
const NEAR_PREFETCH_BYTES: usize = 6 << 10;

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
    super::regions::qmatmul_parts(x, &[(w, 0)], y, ldy);
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
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements (their own panels' columns) of one live `&mut [f32]`, and `qmatmul` returns
// only after every task has finished.
unsafe impl Sync for OutPtr {}

/// One task: panels `panels` of the output (all of them `< n / 16` rounded up), every row.
pub(super) struct Task<'a> {
    pub x: &'a QuantizedActs,
    pub w: &'a QuantMatrix,
    pub out: &'a OutPtr,
    pub ldy: usize,
    pub panels: std::ops::Range<usize>,
    /// Tasks of this product (threads streaming panels from memory at once).
    pub streams: usize,
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
            QuantFormat::Q4_1 => self.run_fmt::<I, Gen<3>>(isa),
            QuantFormat::Q5_0 => self.run_fmt::<I, Gen<6>>(isa),
            QuantFormat::Q5_1 => self.run_fmt::<I, Gen<7>>(isa),
            QuantFormat::Q2K => self.run_fmt::<I, Gen<10>>(isa),
            QuantFormat::Q3K => self.run_fmt::<I, Gen<11>>(isa),
            QuantFormat::Iq2Xxs => self.run_fmt::<I, Gen<16>>(isa),
            QuantFormat::Iq2Xs => self.run_fmt::<I, Gen<17>>(isa),
            QuantFormat::Iq3Xxs => self.run_fmt::<I, Gen<18>>(isa),
            QuantFormat::Iq1S => self.run_fmt::<I, Gen<19>>(isa),
            QuantFormat::Iq4Nl => self.run_fmt::<I, Gen<20>>(isa),
            QuantFormat::Iq3S => self.run_fmt::<I, Gen<21>>(isa),
            QuantFormat::Iq2S => self.run_fmt::<I, Gen<22>>(isa),
            QuantFormat::Iq1M => self.run_fmt::<I, Gen<29>>(isa),
            QuantFormat::Tq1_0 => self.run_fmt::<I, Gen<34>>(isa),
            QuantFormat::Tq2_0 => self.run_fmt::<I, Gen<35>>(isa),
            QuantFormat::Mxfp4 => self.run_fmt::<I, Gen<39>>(isa),
        }
    }
}

impl Task<'_> {
    /// Few rows (at most [`QIsa::FEW_ROWS`] for the formats with [`Fmt::WIDE_TILES`], else `I::ROWS`: decode, and
    /// speculative decoding's verify steps): each panel in turn over the whole `k`, in as few row tiles as fit the
    /// registers (of balanced heights), the first streaming the panel from memory, the others reading it again from
    /// the cache. More rows: [`Task::run_decoded`].
    #[inline(always)]
    fn run_fmt<I: QIsa, F: Fmt>(&self, isa: I) {
        let m = self.x.rows();
        let (few, wide) = if F::WIDE_TILES {
            (I::FEW_ROWS.max(I::ROWS), I::WIDE_ROWS.clamp(I::ROWS, 8))
        } else {
            (I::ROWS, I::ROWS)
        };
        if m > few {
            return self.run_decoded::<I, F>(isa);
        }
        // One row: the format's policy (tuned for decode). More: every line ahead, since the hardware prefetchers
        // alone fall behind once a line carries several rows' arithmetic (at the 27B's MLP shapes, 1 thread, on
        // the AMD EPYC VM: Q4_K 2 rows 8.4 → 4.5 ms, Q6_K 13.9 → 7.3 ms, alternating runs of `qverify_27b`).
        let first = if m == 1 {
            F::prefetch::<I>(self.streams)
        } else {
            Prefetch::EveryLine
        };
        let tiles = m.div_ceil(wide);
        for p in self.panels.clone() {
            let mut row0 = 0;
            for i in 0..tiles {
                let rows = m / tiles + usize::from(i < m % tiles);
                let prefetch = if i == 0 { first } else { Prefetch::Hardware };
                // SAFETY: p < n_panels, rows row0..row0 + rows ≤ m (the tiles' heights sum to m), each at most
                // `wide`.
                unsafe { self.tile_of::<I, F>(isa, Tile { p, row0 }, rows, prefetch) };
                row0 += rows;
            }
        }
    }

    /// [`Task::tile`] of `rows` rows (`1..=4`, or up to [`QIsa::WIDE_ROWS`] ≤ 8 for [`Fmt::WIDE_TILES`] formats).
    ///
    /// # Safety
    /// As [`Task::tile`] with `R = rows`.
    #[inline(always)]
    unsafe fn tile_of<I: QIsa, F: Fmt>(&self, isa: I, t: Tile, rows: usize, pf: Prefetch) {
        let wide = F::WIDE_TILES && I::WIDE_ROWS > 4;
        debug_assert!(rows <= 4 || (wide && rows <= 8), "{rows} rows");
        // SAFETY: forwarded from the caller.
        unsafe {
            match rows {
                1 => self.tile::<I, F, 1>(isa, t, pf),
                2 => self.tile::<I, F, 2>(isa, t, pf),
                3 => self.tile::<I, F, 3>(isa, t, pf),
                5 if wide => self.tile::<I, F, 5>(isa, t, pf),
                6 if wide => self.tile::<I, F, 6>(isa, t, pf),
                7 if wide => self.tile::<I, F, 7>(isa, t, pf),
                8 if wide => self.tile::<I, F, 8>(isa, t, pf),
                _ => self.tile::<I, F, 4>(isa, t, pf),
            }
        }
    }

    /// Rows `t.row0..t.row0 + R` × panel `t.p` over the whole `k`, read from the panel with a prefetch ahead, written
    /// to the output, prefetched as `prefetch` says.
    ///
    /// # Safety
    /// `t.p < n_panels`, `t.row0 + R ≤ m`, and no other task writes panel `t.p`'s columns.
    #[inline(always)]
    unsafe fn tile<I: QIsa, F: Fmt, const R: usize>(&self, isa: I, t: Tile, prefetch: Prefetch) {
        let lay = F::LAY;
        let bpu = lay.unit / ACT_BLOCK;
        let base = self.w.as_bytes()[t.p * self.w.panel_bytes()..].as_ptr();
        let (xq, xb) = self.rows::<R>(t.row0);
        let mut acc = [isa.f_zero(); R];
        let block_bytes = lay.bytes / bpu;
        for u in 0..self.w.k() / lay.unit {
            // SAFETY: unit u of panel p lies in the storage (panel_bytes = units · lay.bytes).
            let up = unsafe { base.add(u * lay.bytes) };
            // SAFETY: as above. Block 0's state first, then the rest of the unit through the (same) address it
            // returns: Q8_0 on AVX-512 so reads the unit's lines in address order (see `QIsa::load8_w`).
            let (pre0, up) = unsafe { F::pre_first(isa, up) };
            // SAFETY: as above.
            let ud = unsafe { F::unit_scales(isa, up) };
            for b in 0..bpu {
                // A hint only: the address may lie past the storage (wrapping arithmetic, never dereferenced).
                match prefetch {
                    Prefetch::EveryLine => {
                        let ahead = up.wrapping_add(PREFETCH_BYTES + b * block_bytes);
                        for line in (0..block_bytes).step_by(64) {
                            isa.prefetch(ahead.wrapping_add(line));
                        }
                    }
                    Prefetch::Near => {
                        let ahead = up.wrapping_add(NEAR_PREFETCH_BYTES + b * block_bytes);
                        for line in (0..block_bytes).step_by(64) {
                            isa.prefetch_once(ahead.wrapping_add(line));
                        }
                    }
                    Prefetch::OneLine => {
                        isa.prefetch(up.wrapping_add(SPARSE_PREFETCH_BYTES + b * block_bytes))
                    }
                    Prefetch::Hardware => {}
                }
                let pre = if b == 0 {
                    pre0
                } else {
                    // SAFETY: the unit is whole and b < bpu.
                    unsafe { F::pre(isa, up, b) }
                };
                let src = Packed::<I, F> {
                    at: At { u: up, b, ud },
                    pre,
                };
                // SAFETY: block u·bpu + b's 32 inputs lie in each row.
                unsafe { block::<I, F, _, R>(isa, src, &xq, &xb, u * bpu + b, &mut acc) };
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.store_acc(isa, t, &acc) };
    }

    /// Rows `row0..row0 + R`' quantized values and blocks.
    #[inline(always)]
    pub(super) fn rows<const R: usize>(&self, row0: usize) -> ([*const u8; R], [&[ActBlock]; R]) {
        (
            std::array::from_fn(|r| self.x.row_q(row0 + r).as_ptr().cast()),
            std::array::from_fn(|r| self.x.row_blocks(row0 + r)),
        )
    }

    /// Where row `t.row0 + r` of panel `t.p`'s columns starts in the output, and how many of its 16 columns are
    /// `< n` (the only ones read or written). A pointer into `y` when `t.row0 + r < m` (wrapping arithmetic: not
    /// dereferenced here).
    #[inline(always)]
    fn out_at(&self, t: Tile, r: usize) -> (*mut f32, usize) {
        let cols = (self.w.n() - t.p * LANES).min(LANES);
        // Row row0 + r < m and columns p·16 .. p·16 + cols < n lie in y (checked by `qmatmul`).
        (
            self.out
                .0
                .wrapping_add((t.row0 + r) * self.ldy + t.p * LANES),
            cols,
        )
    }

    /// The tile's accumulators as left in the output by a previous `k` range.
    ///
    /// # Safety
    /// `t.row0 + R ≤ m`, `t.p` a panel of this task.
    #[inline(always)]
    pub(super) unsafe fn load_acc<I: QIsa, const R: usize>(&self, isa: I, t: Tile) -> [I::F; R] {
        std::array::from_fn(|r| {
            let (dst, cols) = self.out_at(t, r);
            let mut v = [0.0f32; LANES];
            // SAFETY: see `out_at`.
            unsafe { std::ptr::copy_nonoverlapping(dst, v.as_mut_ptr(), cols) };
            isa.load_f(v)
        })
    }

    /// Writes the tile's accumulators to the output (columns `< n`).
    ///
    /// # Safety
    /// `t.row0 + R ≤ m`, and no other task writes panel `t.p`'s columns.
    #[inline(always)]
    pub(super) unsafe fn store_acc<I: QIsa, const R: usize>(
        &self,
        isa: I,
        t: Tile,
        acc: &[I::F; R],
    ) {
        for (r, a) in acc.iter().enumerate() {
            let v = isa.lanes(*a);
            let (dst, cols) = self.out_at(t, r);
            // SAFETY: see `out_at`; the columns are this task's.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), dst, cols) };
        }
    }
}

/// Where a tile works: panel `p`, rows from `row0`.
#[derive(Clone, Copy)]
pub(super) struct Tile {
    pub p: usize,
    pub row0: usize,
}

/// Where a 32-block's code vectors and scales come from.
pub(super) trait Src<I: QIsa>: Copy {
    /// Code vectors of groups `h` and `h + 4`.
    ///
    /// # Safety
    /// The source must be valid (see the implementations), `h < 4`.
    unsafe fn codes(self, isa: I, h: usize) -> (I::W, I::W);
    /// The block's [`Fmt::scales`].
    ///
    /// # Safety
    /// As [`Src::codes`].
    unsafe fn scales(self, isa: I) -> (I::F, I::F);
    /// The block's [`Fmt::mins`] (only called for formats with [`Fmt::MINS16`]).
    ///
    /// # Safety
    /// As [`Src::codes`].
    unsafe fn mins(self, isa: I) -> (I::F, I::F);
}

/// A block read from the panel layout (`at` a whole unit of `F`).
pub(super) struct Packed<I: QIsa, F: Fmt> {
    pub at: At<I>,
    pub pre: F::Pre<I>,
}

impl<I: QIsa, F: Fmt> Clone for Packed<I, F> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<I: QIsa, F: Fmt> Copy for Packed<I, F> {}

impl<I: QIsa, F: Fmt> Src<I> for Packed<I, F> {
    #[inline(always)]
    unsafe fn codes(self, isa: I, h: usize) -> (I::W, I::W) {
        // SAFETY: forwarded.
        unsafe { F::codes(isa, self.at.u, self.at.b, h, self.pre) }
    }
    #[inline(always)]
    unsafe fn scales(self, isa: I) -> (I::F, I::F) {
        // SAFETY: forwarded.
        unsafe { F::scales(isa, self.at) }
    }
    #[inline(always)]
    unsafe fn mins(self, isa: I) -> (I::F, I::F) {
        // SAFETY: forwarded.
        unsafe { F::mins(isa, self.at) }
    }
}

/// One 32-block of `R` rows: the exact integer sums over each half of the block (widened as often as the ISA
/// needs), then the format's float step into `acc`.
///
/// # Safety
/// `src` is valid, and each `xq[r]` has inputs `32·bi..32·bi + 32`.
#[inline(always)]
pub(super) unsafe fn block<I: QIsa, F: Fmt, S: Src<I>, const R: usize>(
    isa: I,
    src: S,
    xq: &[*const u8; R],
    xb: &[&[ActBlock]; R],
    bi: usize,
    acc: &mut [I::F; R],
) {
    let every = isa.widen_every(F::cmax::<I>());
    let (mut al, mut ah) = ([isa.a_zero(); R], [isa.a_zero(); R]);
    let (mut sl, mut sh) = ([isa.i_zero(); R], [isa.i_zero(); R]);
    for h in 0..4 {
        // SAFETY: forwarded from the caller.
        let (lo, hi) = unsafe { src.codes(isa, h) };
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
    let s = unsafe { src.scales(isa) };
    let mn = if F::MINS16 {
        // SAFETY: forwarded from the caller.
        unsafe { src.mins(isa) }
    } else {
        (isa.f_zero(), isa.f_zero())
    };
    for r in 0..R {
        acc[r] = F::combine_m(isa, s, mn, sl[r], sh[r], xb[r][bi], acc[r]);
    }
}
