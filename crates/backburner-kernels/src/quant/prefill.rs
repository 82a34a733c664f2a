//! The many-row path of [`qmatmul`](super::qmatmul): each cache block (16 panels × a `k` range) is decoded once into
//! a per-thread buffer — code vectors ready for the dot products, block scales in f32 — and every row tile then runs
//! against the buffer, so the unpacking is paid once per block instead of once per row tile.
//!
//! The buffer holds exactly the values the direct path computes in registers ([`Fmt::codes`], [`Fmt::scales`]),
//! and the row tiles run the same [`block`] step (or, for 4 rows of a format [`quad`] accepts, the ISA's
//! [`QIsa::quad_sums`], which forms the same exact integer sums), so results are the same bits as
//! the decode path.

use std::cell::RefCell;
use std::ops::Range;

use super::acts::ACT_BLOCK;
use super::fmt::{At, Fmt};
use super::isa::QIsa;
use super::kernel::{block, Src, Task, Tile};
use super::pack::Line;

/// Bytes of one decoded 32-block of a panel: 8 code vectors (groups 0..8), then its 2 scale vectors.
const DEC: usize = 10 * 64;

/// Bytes of one decoded 32-block of `F`: [`DEC`], plus 2 min vectors for the formats with mins per 16.
#[inline(always)]
const fn dec<F: Fmt>() -> usize {
    if F::MINS16 {
        DEC + 2 * 64
    } else {
        DEC
    }
}
/// Decoded 32-blocks per panel per `k` range: 24 × 640 B = 15 KiB, which a row tile reads, with its activation rows,
/// from L1.
const KC_BLOCKS: usize = 24;
/// Panels per cache block: 16 × 15 KiB = 240 KiB of decoded weights, which every row tile reads from L2.
const CHUNK: usize = 16;

/// Whether the many-row path of format `F` runs 4-row tiles through the ISA's [`QIsa::quad_sums`]: offset-128 codes,
/// or unsigned codes `≤ 16` whose block term takes only the sum of both halves.
#[inline(always)]
fn quad<I: QIsa, F: Fmt>() -> bool {
    I::QUAD && !F::HALVES && (F::OFFSET_128 || F::cmax::<I>() <= 16)
}

thread_local! {
    /// The decoded cache block (per thread, reused).
    static DEC_BUF: RefCell<Vec<Line>> = const { RefCell::new(Vec::new()) };
}

/// A decoded block in the buffer (`DEC` readable bytes).
#[derive(Clone, Copy)]
struct Decoded(*const u8);

impl<I: QIsa> Src<I> for Decoded {
    #[inline(always)]
    unsafe fn codes(self, isa: I, h: usize) -> (I::W, I::W) {
        // SAFETY: a decoded block holds 8 code vectors.
        unsafe {
            (
                isa.load_w(self.0.add(64 * h)),
                isa.load_w(self.0.add(64 * (h + 4))),
            )
        }
    }
    #[inline(always)]
    unsafe fn scales(self, isa: I) -> (I::F, I::F) {
        // SAFETY: then its 2 scale vectors.
        unsafe { (isa.load_fp(self.0.add(512)), isa.load_fp(self.0.add(576))) }
    }
    #[inline(always)]
    unsafe fn mins(self, isa: I) -> (I::F, I::F) {
        // SAFETY: then, for the formats with mins per 16, its 2 min vectors.
        unsafe { (isa.load_fp(self.0.add(640)), isa.load_fp(self.0.add(704))) }
    }
}

impl Task<'_> {
    /// Cache blocks of up to 16 panels × `k` ranges of 24 blocks: decode the block's panels, then all row tiles of
    /// up to `I::ROWS` rows × each panel; the accumulators pass through `y` between `k` ranges (f32 stores and loads
    /// are exact, so each output's chain is unchanged).
    #[inline(always)]
    pub(super) fn run_decoded<I: QIsa, F: Fmt>(&self, isa: I) {
        let m = self.x.rows();
        let bpu = F::LAY.unit / ACT_BLOCK;
        let units = self.w.k() / F::LAY.unit;
        let kc = (KC_BLOCKS / bpu).max(1);
        // Taken out of the thread-local for the duration (no closure around the hot loop: a closure body would be
        // compiled without the caller's target features).
        let mut buf = DEC_BUF.with(|b| b.take());
        buf.resize(CHUNK * kc * bpu * dec::<F>() / 64, Line([0; 64]));
        let base = buf.as_mut_ptr().cast::<u8>();
        let mut p0 = self.panels.start;
        while p0 < self.panels.end {
            let p1 = (p0 + CHUNK).min(self.panels.end);
            let mut u0 = 0;
            while u0 < units {
                let u1 = (u0 + kc).min(units);
                let nblk = (u1 - u0) * bpu;
                // Panel p's slot in the buffer.
                let slot = |p: usize| base.wrapping_add((p - p0) * nblk * dec::<F>());
                for p in p0..p1 {
                    // SAFETY: p < n_panels, units u0..u1 < k / unit; the slot holds nblk decoded blocks.
                    unsafe { self.decode::<I, F>(isa, p, u0..u1, slot(p)) };
                }
                let mut r0 = 0;
                while r0 < m {
                    let quad = m - r0 >= 4 && quad::<I, F>();
                    let rows = if quad {
                        4
                    } else {
                        (m - r0).min(I::ROWS).min(4)
                    };
                    for p in p0..p1 {
                        let t = Tile { p, row0: r0 };
                        let (d, b0) = (slot(p).cast_const(), u0 * bpu);
                        // SAFETY: rows r0..r0 + rows < m; the slot was just filled with blocks b0..b0 + nblk.
                        unsafe {
                            match rows {
                                1 => self.tile_dec::<I, F, 1>(isa, t, d, b0..b0 + nblk),
                                2 => self.tile_dec::<I, F, 2>(isa, t, d, b0..b0 + nblk),
                                3 => self.tile_dec::<I, F, 3>(isa, t, d, b0..b0 + nblk),
                                _ if quad => self.tile_quad::<I, F>(isa, t, d, b0..b0 + nblk),
                                _ => self.tile_dec::<I, F, 4>(isa, t, d, b0..b0 + nblk),
                            }
                        }
                    }
                    r0 += rows;
                }
                u0 = u1;
            }
            p0 = p1;
        }
        DEC_BUF.with(|b| b.replace(buf));
    }

    /// Decodes units `us` of panel `p` into `dst`.
    ///
    /// # Safety
    /// `p < n_panels`, `us.end ≤ k / unit`, and `dst` is valid for writing `us.len() · unit/32 · DEC` bytes.
    #[inline(always)]
    unsafe fn decode<I: QIsa, F: Fmt>(&self, isa: I, p: usize, us: Range<usize>, dst: *mut u8) {
        let lay = F::LAY;
        let base = self.w.as_bytes()[p * self.w.panel_bytes()..].as_ptr();
        let mut d = dst;
        for u in us {
            // SAFETY: unit u of panel p lies in the storage; the writes stay in dst's blocks (one DEC per block).
            unsafe {
                let up = base.add(u * lay.bytes);
                let ud = F::unit_scales(isa, up);
                for b in 0..lay.unit / ACT_BLOCK {
                    let pre = F::pre(isa, up, b);
                    for h in 0..4 {
                        let (lo, hi) = F::codes(isa, up, b, h, pre);
                        isa.store_w(lo, d.add(64 * h));
                        isa.store_w(hi, d.add(64 * (h + 4)));
                    }
                    let at = At { u: up, b, ud };
                    let s = F::scales(isa, at);
                    isa.store_fp(s.0, d.add(512));
                    isa.store_fp(s.1, d.add(576));
                    if F::MINS16 {
                        let m = F::mins(isa, at);
                        isa.store_fp(m.0, d.add(640));
                        isa.store_fp(m.1, d.add(704));
                    }
                    d = d.add(dec::<F>());
                }
            }
        }
    }

    /// [`Task::tile_dec`] for 4 rows of a format that [`quad`] accepts, with the ISA's [`QIsa::quad_sums`] for the
    /// integer sums (the same sums, so the same bits).
    ///
    /// # Safety
    /// As [`Task::tile_dec`] with `R = 4`.
    #[inline(always)]
    unsafe fn tile_quad<I: QIsa, F: Fmt>(
        &self,
        isa: I,
        t: Tile,
        d: *const u8,
        blocks: Range<usize>,
    ) {
        let (xq, xb) = self.rows::<4>(t.row0);
        let mut acc = if blocks.start > 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.load_acc::<I, 4>(isa, t) }
        } else {
            [isa.f_zero(); 4]
        };
        for (j, bi) in blocks.enumerate() {
            // SAFETY: decoded block j exists (its 8 code vectors first); block bi's 32 inputs lie in each row.
            let (s, sc) = unsafe {
                let at = d.add(j * dec::<F>());
                let x = xq.map(|p| p.add(ACT_BLOCK * bi));
                let s = if F::OFFSET_128 {
                    isa.quad_sums::<true>(at, x)
                } else {
                    isa.quad_sums::<false>(at, x)
                };
                (s, Decoded(at).scales(isa))
            };
            for r in 0..4 {
                acc[r] = F::combine(isa, sc, s[r], isa.i_zero(), xb[r][bi], acc[r]);
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.store_acc(isa, t, &acc) };
    }

    /// Rows `t.row0..t.row0 + R` × panel `t.p` over the decoded blocks at `d` (activation blocks `blocks`): the
    /// accumulators from zero (first range) or from the output, written back to the output.
    ///
    /// # Safety
    /// `t.row0 + R ≤ m`, `d` holds `blocks.len()` decoded blocks of panel `t.p`, `blocks.end ≤ k / 32`, and no
    /// other task writes panel `t.p`'s columns.
    #[inline(always)]
    unsafe fn tile_dec<I: QIsa, F: Fmt, const R: usize>(
        &self,
        isa: I,
        t: Tile,
        d: *const u8,
        blocks: Range<usize>,
    ) {
        let (xq, xb) = self.rows::<R>(t.row0);
        let mut acc = if blocks.start > 0 {
            // SAFETY: forwarded from the caller.
            unsafe { self.load_acc::<I, R>(isa, t) }
        } else {
            [isa.f_zero(); R]
        };
        for (j, bi) in blocks.enumerate() {
            // SAFETY: decoded block j exists; block bi's 32 inputs lie in each row.
            unsafe {
                block::<I, F, _, R>(isa, Decoded(d.add(j * dec::<F>())), &xq, &xb, bi, &mut acc)
            };
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.store_acc(isa, t, &acc) };
    }
}
