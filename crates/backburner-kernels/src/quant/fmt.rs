//! Per-format decoding of a panel unit's 32-blocks into code vectors and scale vectors ([`Fmt`]), for the generic
//! kernel, and the per-block float step of the canonical arithmetic.

use super::acts::ActBlock;
use super::format::{QuantFormat, IQ4_VALUES};
use super::isa::{nibbles, QIsa};
pub(crate) use super::prefetch::{in_order_prefetch, lone_stream_prefetcher, Prefetch};
use super::unit::Lay;

/// A format as the kernel sees it: how a 32-block's codes and scales are read from a panel unit and how the
/// block's integer sums become its float term (see the [module docs](super) for the arithmetic).
pub(crate) trait Fmt {
    /// The format.
    const FORMAT: QuantFormat;
    /// Its panel layout.
    const LAY: Lay = Lay::of(Self::FORMAT);
    /// Per 32-block state read once per panel and block (high-bit planes; Q8_0's codes).
    type Pre<I: QIsa>: Copy;
    /// Largest code magnitude the dot products see on `I` (bounds the AVX2 i16 accumulation).
    fn cmax<I: QIsa>() -> u32;
    /// How the decode kernel prefetches this format's panels in software when `streams` threads stream panels from
    /// memory at once (the product's task count); the default: [`Prefetch::EveryLine`].
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        Prefetch::EveryLine
    }
    /// Reads the per-block state of block `b` of the unit at `u`.
    ///
    /// # Safety
    /// `u` must point at a whole panel unit of this format and `b < LAY.unit / 32`.
    unsafe fn pre<I: QIsa>(isa: I, u: *const u8, b: usize) -> Self::Pre<I>;
    /// [`Fmt::pre`] of the unit's block 0, read before anything else of the unit, and the unit's address to read the
    /// rest through: always the address `u` (the same value; for Q8_0 passed through [`QIsa::load8_w`] so that the
    /// unit's scales are read after its codes).
    ///
    /// # Safety
    /// As [`Fmt::pre`].
    #[inline(always)]
    unsafe fn pre_first<I: QIsa>(isa: I, u: *const u8) -> (Self::Pre<I>, *const u8) {
        // SAFETY: forwarded.
        (unsafe { Self::pre(isa, u, 0) }, u)
    }
    /// Code vectors of groups `h` and `h + 4` (inputs `4h..4h + 4` and `16 + 4h..16 + 4h + 4` of the block).
    ///
    /// # Safety
    /// As [`Fmt::pre`], with `h < 4`.
    unsafe fn codes<I: QIsa>(
        isa: I,
        u: *const u8,
        b: usize,
        h: usize,
        pre: Self::Pre<I>,
    ) -> (I::W, I::W);
    /// The unit's f16 `d` and `dmin` (zeros for formats without mins) widened once per unit.
    ///
    /// # Safety
    /// `u` must point at a whole panel unit of this format.
    #[inline(always)]
    unsafe fn unit_scales<I: QIsa>(isa: I, u: *const u8) -> (I::F, I::F) {
        let lay = Self::LAY;
        // SAFETY: the unit's d and dmin fields.
        unsafe {
            let dmin = if lay.dmin != 0 {
                isa.load_f16(u.add(lay.dmin))
            } else {
                isa.f_zero()
            };
            (isa.load_f16(u.add(lay.d)), dmin)
        }
    }
    /// Whether [`Fmt::combine`] takes the block's two halves' sums apart (Q6_K: one scale per 16 inputs); the
    /// others use only `lo + hi`.
    const HALVES: bool = false;
    /// Whether the block has a min per 16 inputs (Q2_K), read by [`Fmt::mins`] and applied by [`Fmt::combine_m`].
    const MINS16: bool = false;
    /// The block's mins per 16 as the float step takes them (only called when [`Fmt::MINS16`]).
    ///
    /// # Safety
    /// As [`Fmt::pre`] for `at.u`, `at.b`.
    #[inline(always)]
    unsafe fn mins<I: QIsa>(isa: I, _: At<I>) -> (I::F, I::F) {
        (isa.f_zero(), isa.f_zero())
    }
    /// [`Fmt::combine`] with the block's [`Fmt::mins`] (the default: `combine`, for the formats without mins per
    /// 16).
    #[inline(always)]
    fn combine_m<I: QIsa>(
        isa: I,
        s: (I::F, I::F),
        _m: (I::F, I::F),
        lo: I::I,
        hi: I::I,
        ab: ActBlock,
        acc: I::F,
    ) -> I::F {
        Self::combine(isa, s, lo, hi, ab, acc)
    }
    /// Whether products of a few rows (up to [`QIsa::FEW_ROWS`]) run register tiles of up to [`QIsa::WIDE_ROWS`]
    /// rows (the formats with panel layouts of their own; the generic ones keep tiles of [`QIsa::ROWS`]).
    const WIDE_TILES: bool = false;
    /// Whether the codes are offset-128 values (Q8_0, IQ4_XS), which go to [`QIsa::dot_s`]; the others go to
    /// [`QIsa::dot_u`].
    const OFFSET_128: bool = false;
    /// One dot-product step with this format's codes.
    #[inline(always)]
    fn dot<I: QIsa>(isa: I, a: I::A, w: I::W, x4: i32) -> I::A {
        if Self::OFFSET_128 {
            isa.dot_s(a, w, x4)
        } else {
            isa.dot_u(a, w, x4)
        }
    }
    /// What the sums the kernel computes exceed the true `Σ q·xq` by, per unit of `Σ xq` (the default: 128 for
    /// offset-128 codes summed unsigned, else 0).
    #[inline(always)]
    fn offset<I: QIsa>() -> i32 {
        if Self::OFFSET_128 && !I::SIGNED {
            128
        } else {
            0
        }
    }
    /// The weight scales of the block `at` as the float step takes them (see [`Fmt::combine`]; the default: the
    /// unit's `d`, for the formats with one scale per 32-block).
    ///
    /// # Safety
    /// As [`Fmt::pre`] for `at.u`, `at.b`.
    #[inline(always)]
    unsafe fn scales<I: QIsa>(_: I, at: At<I>) -> (I::F, I::F) {
        at.ud
    }
    /// `acc + f·dx` for one row: `lo`, `hi` are the exact sums of `code·xq` over the block's first and second 16
    /// inputs, `s` the block's [`Fmt::scales`], `ab` the activation block (the default: the plain term of the
    /// formats without mins, `ds·float(S)` with `S = lo + hi − offset·Σxq`).
    #[inline(always)]
    fn combine<I: QIsa>(
        isa: I,
        s: (I::F, I::F),
        lo: I::I,
        hi: I::I,
        ab: ActBlock,
        acc: I::F,
    ) -> I::F {
        plain(isa, s.0, lo, hi, Self::offset::<I>(), ab, acc)
    }
}

/// `v` with the bits at position `from` (in each byte) moved to position 4 (word shifts; callers mask the result
/// to the moved bits, which stay inside their byte).
#[inline(always)]
pub(crate) fn to_bit4<I: QIsa>(isa: I, v: I::W, from: u32) -> I::W {
    if from < 4 {
        isa.shl16(v, 4 - from)
    } else if from > 4 {
        isa.shr16(v, from - 4)
    } else {
        v
    }
}

/// Where a 32-block lives: its panel unit, its index in the unit and the unit's [`Fmt::unit_scales`].
#[derive(Clone, Copy)]
pub(crate) struct At<I: QIsa> {
    /// The panel unit.
    pub u: *const u8,
    /// The block's index in the unit.
    pub b: usize,
    /// The unit's widened `d`, `dmin`.
    pub ud: (I::F, I::F),
}

/// The plain term `ds·float(S)` with `S = lo + hi − off·Σxq`, accumulated: `acc + that·dx`.
#[inline(always)]
fn plain<I: QIsa>(isa: I, ds: I::F, lo: I::I, hi: I::I, off: i32, ab: ActBlock, acc: I::F) -> I::F {
    let s = isa.sub_splat_i(isa.add_i(lo, hi), off * ab.sum);
    let f = isa.mul(ds, isa.cvt(s));
    isa.fma(f, isa.splat_f(ab.d), acc)
}

/// The term with a min, `fma(ds, float(S), −dm·float(Σxq))` with `S = lo + hi`, accumulated: `acc + that·dx`.
#[inline(always)]
fn with_min<I: QIsa>(
    isa: I,
    ds: I::F,
    dm: I::F,
    lo: I::I,
    hi: I::I,
    ab: ActBlock,
    acc: I::F,
) -> I::F {
    let t = isa.mul(dm, isa.splat_f(ab.sumf));
    let f = isa.fms(ds, isa.cvt(isa.add_i(lo, hi)), t);
    isa.fma(f, isa.splat_f(ab.d), acc)
}

/// The term of a block with one scale per 16 inputs: `fma(ds_a, float(lo − off·Σxq_a), ds_b·float(hi − off·Σxq_b))`
/// (Q6_K, and the generic formats with sub-scales per 16).
#[inline(always)]
pub(crate) fn halves_term<I: QIsa>(
    isa: I,
    s: (I::F, I::F),
    lo: I::I,
    hi: I::I,
    off: i32,
    ab: ActBlock,
) -> I::F {
    let sa = isa.cvt(isa.sub_splat_i(lo, off * ab.half));
    let sb = isa.cvt(isa.sub_splat_i(hi, off * (ab.sum - ab.half)));
    isa.fma(s.0, sa, isa.mul(s.1, sb))
}

/// Two rows of 16 byte scales at `p` and `p + 16` (i8 if `signed`, else u8), each times `d`.
///
/// # Safety
/// `p` must be valid for reading 32 bytes.
#[inline(always)]
pub(crate) unsafe fn scale_rows<I: QIsa>(
    isa: I,
    d: I::F,
    p: *const u8,
    signed: bool,
) -> (I::F, I::F) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if signed {
            (
                isa.mul(d, isa.load_i8f(p)),
                isa.mul(d, isa.load_i8f(p.add(16))),
            )
        } else {
            (
                isa.mul(d, isa.load_u8f(p)),
                isa.mul(d, isa.load_u8f(p.add(16))),
            )
        }
    }
}

/// Q8_0: codes `q + 128` as bytes.
pub(crate) struct Q80;
/// Q4_0: nibbles `q` (value `q − 8`).
pub(crate) struct Q40;
/// Q4_K: nibbles with 6-bit scales and mins.
pub(crate) struct Q4K;
/// Q5_K: nibbles plus a fifth-bit plane.
pub(crate) struct Q5K;
/// Q6_K: nibbles plus two bit-pair planes, i8 scales per 16.
pub(crate) struct Q6K;
/// IQ4_XS: nibble indices into the codebook.
pub(crate) struct Iq4Xs;

impl Fmt for Q80 {
    const WIDE_TILES: bool = true;
    const FORMAT: QuantFormat = QuantFormat::Q8_0;
    const OFFSET_128: bool = true;
    /// The block's eight code vectors (or their address: [`QIsa::Codes8`]).
    type Pre<I: QIsa> = I::Codes8;
    fn cmax<I: QIsa>() -> u32 {
        128
    }
    #[inline(always)]
    fn prefetch<I: QIsa>(streams: usize) -> Prefetch {
        match (I::ORDERED_LOAD8 && lone_stream_prefetcher(), streams) {
            (true, 1) => Prefetch::OneLine,
            (true, _) => Prefetch::Hardware,
            (false, _) => Prefetch::EveryLine,
        }
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(isa: I, u: *const u8, _: usize) -> I::Codes8 {
        // SAFETY: the unit holds 8 code vectors.
        unsafe { isa.load8_w(u).0 }
    }
    #[inline(always)]
    unsafe fn pre_first<I: QIsa>(isa: I, u: *const u8) -> (I::Codes8, *const u8) {
        // SAFETY: as in `pre`.
        unsafe { isa.load8_w(u) }
    }
    #[inline(always)]
    unsafe fn codes<I: QIsa>(
        isa: I,
        _: *const u8,
        _: usize,
        h: usize,
        v: I::Codes8,
    ) -> (I::W, I::W) {
        // SAFETY: `v` is this unit's (from `pre`, whose unit the caller keeps valid), h < 4.
        let (lo, hi) = unsafe { (isa.pick8(v, h), isa.pick8(v, h + 4)) };
        if I::SIGNED {
            let s = isa.splat_w(0x80);
            (isa.xor_w(lo, s), isa.xor_w(hi, s))
        } else {
            (lo, hi)
        }
    }
}

impl Fmt for Q40 {
    const WIDE_TILES: bool = true;
    const FORMAT: QuantFormat = QuantFormat::Q4_0;
    type Pre<I: QIsa> = ();
    fn cmax<I: QIsa>() -> u32 {
        15
    }
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        in_order_prefetch::<I>()
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(_: I, _: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn codes<I: QIsa>(isa: I, u: *const u8, _: usize, h: usize, _: ()) -> (I::W, I::W) {
        // SAFETY: the unit holds 4 nibble vectors.
        unsafe { nibbles(isa, u.add(Self::LAY.codes.at(0) + 64 * h)) }
    }
    #[inline(always)]
    fn offset<I: QIsa>() -> i32 {
        8
    }
}

/// Q4_K / Q5_K's scale and min of block `b`: `(d·sc, dmin·m)`.
///
/// # Safety
/// `u` points at a whole unit of `lay`, `b < 8`.
#[inline(always)]
unsafe fn k_scales<I: QIsa>(
    isa: I,
    lay: Lay,
    u: *const u8,
    b: usize,
    ud: (I::F, I::F),
) -> (I::F, I::F) {
    // SAFETY: block b's scales and mins.
    unsafe {
        let ds = isa.mul(ud.0, isa.load_u8f(u.add(lay.sc.at(b))));
        let dm = isa.mul(ud.1, isa.load_u8f(u.add(lay.m.at(b))));
        (ds, dm)
    }
}

impl Fmt for Q4K {
    const WIDE_TILES: bool = true;
    const FORMAT: QuantFormat = QuantFormat::Q4K;
    type Pre<I: QIsa> = ();
    fn cmax<I: QIsa>() -> u32 {
        15
    }
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        in_order_prefetch::<I>()
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(_: I, _: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn codes<I: QIsa>(isa: I, u: *const u8, b: usize, h: usize, _: ()) -> (I::W, I::W) {
        // SAFETY: block b's 4 nibble vectors.
        unsafe { nibbles(isa, u.add(Self::LAY.codes.at(b) + 64 * h)) }
    }
    #[inline(always)]
    unsafe fn scales<I: QIsa>(isa: I, at: At<I>) -> (I::F, I::F) {
        // SAFETY: forwarded.
        unsafe { k_scales(isa, Self::LAY, at.u, at.b, at.ud) }
    }
    #[inline(always)]
    fn combine<I: QIsa>(
        isa: I,
        s: (I::F, I::F),
        lo: I::I,
        hi: I::I,
        ab: ActBlock,
        acc: I::F,
    ) -> I::F {
        with_min(isa, s.0, s.1, lo, hi, ab, acc)
    }
}

impl Fmt for Q5K {
    const WIDE_TILES: bool = true;
    const FORMAT: QuantFormat = QuantFormat::Q5K;
    type Pre<I: QIsa> = I::W;
    fn cmax<I: QIsa>() -> u32 {
        31
    }
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        in_order_prefetch::<I>()
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(isa: I, u: *const u8, b: usize) -> I::W {
        // SAFETY: block b's fifth-bit plane.
        unsafe { isa.load_w(u.add(Self::LAY.hb.at(b))) }
    }
    #[inline(always)]
    unsafe fn codes<I: QIsa>(isa: I, u: *const u8, b: usize, h: usize, hb: I::W) -> (I::W, I::W) {
        // SAFETY: block b's 4 nibble vectors.
        let h = h as u32;
        unsafe {
            isa.nibbles_high(
                u.add(Self::LAY.codes.at(b) + 64 * h as usize),
                (hb, hb),
                (h, h + 4),
                1,
            )
        }
    }
    #[inline(always)]
    unsafe fn scales<I: QIsa>(isa: I, at: At<I>) -> (I::F, I::F) {
        // SAFETY: forwarded.
        unsafe { k_scales(isa, Self::LAY, at.u, at.b, at.ud) }
    }
    #[inline(always)]
    fn combine<I: QIsa>(
        isa: I,
        s: (I::F, I::F),
        lo: I::I,
        hi: I::I,
        ab: ActBlock,
        acc: I::F,
    ) -> I::F {
        with_min(isa, s.0, s.1, lo, hi, ab, acc)
    }
}

impl Fmt for Q6K {
    const WIDE_TILES: bool = true;
    const FORMAT: QuantFormat = QuantFormat::Q6K;
    const HALVES: bool = true;
    type Pre<I: QIsa> = (I::W, I::W);
    fn cmax<I: QIsa>() -> u32 {
        63
    }
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        in_order_prefetch::<I>()
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(isa: I, u: *const u8, b: usize) -> (I::W, I::W) {
        let p = Self::LAY.hb.at(b);
        // SAFETY: block b's two bit-pair planes.
        unsafe { (isa.load_w(u.add(p)), isa.load_w(u.add(p + 64))) }
    }
    #[inline(always)]
    unsafe fn codes<I: QIsa>(
        isa: I,
        u: *const u8,
        b: usize,
        h: usize,
        hb: (I::W, I::W),
    ) -> (I::W, I::W) {
        // SAFETY: block b's 4 nibble vectors.
        let from = 2 * h as u32;
        unsafe { isa.nibbles_high(u.add(Self::LAY.codes.at(b) + 64 * h), hb, (from, from), 2) }
    }
    #[inline(always)]
    unsafe fn scales<I: QIsa>(isa: I, at: At<I>) -> (I::F, I::F) {
        // SAFETY: block b's two rows of scales.
        unsafe { scale_rows(isa, at.ud.0, at.u.add(Self::LAY.sc.at(at.b)), true) }
    }
    #[inline(always)]
    fn combine<I: QIsa>(
        isa: I,
        s: (I::F, I::F),
        lo: I::I,
        hi: I::I,
        ab: ActBlock,
        acc: I::F,
    ) -> I::F {
        isa.fma(halves_term(isa, s, lo, hi, 32, ab), isa.splat_f(ab.d), acc)
    }
}

/// The IQ4_XS codebook as the dot products take it: signed values, or values + 128.
#[inline(always)]
fn iq4_table<I: QIsa>() -> [u8; 16] {
    IQ4_VALUES.map(|v| {
        if I::SIGNED {
            v as u8
        } else {
            (i16::from(v) + 128) as u8
        }
    })
}

impl Fmt for Iq4Xs {
    const WIDE_TILES: bool = true;
    const FORMAT: QuantFormat = QuantFormat::Iq4Xs;
    const OFFSET_128: bool = true;
    type Pre<I: QIsa> = ();
    fn cmax<I: QIsa>() -> u32 {
        128
    }
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        in_order_prefetch::<I>()
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(_: I, _: *const u8, _: usize) {}
    #[inline(always)]
    unsafe fn codes<I: QIsa>(isa: I, u: *const u8, b: usize, h: usize, _: ()) -> (I::W, I::W) {
        // SAFETY: block b's 4 nibble vectors.
        unsafe { isa.nibble_lut(iq4_table::<I>(), u.add(Self::LAY.codes.at(b) + 64 * h)) }
    }
    #[inline(always)]
    unsafe fn scales<I: QIsa>(isa: I, at: At<I>) -> (I::F, I::F) {
        // SAFETY: block b's scales.
        let ds = unsafe { isa.mul(at.ud.0, isa.load_i8f(at.u.add(Self::LAY.sc.at(at.b)))) };
        (ds, isa.f_zero())
    }
}
