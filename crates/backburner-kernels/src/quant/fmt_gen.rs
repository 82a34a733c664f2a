//! The [`Fmt`] of the generic panel formats ([`super::spec`]): one implementation, specialised at compile time by
//! the format's [`Spec`] (codebook or plain codes, sub-block scales, mins).
//!
//! The float step of a 32-block, with `S`, `Sa`, `Sb` the exact integer sums of `v·xq` over the block and its two
//! halves of 16 and `Σa`, `Σb` the halves' `Σ xq`:
//! * no sub-scales or one per 32: `f = ds·float(S)`; with a unit min: `f = fma(ds, float(S), −dm·float(Σxq))`;
//! * one scale per 16: `f = fma(ds_a, float(Sa), ds_b·float(Sb))`; with mins per 16 (Q2_K) then
//!   `f − fma(dm_a, float(Σa), dm_b·float(Σb))`;
//!
//! and `acc = fma(f, dx, acc)`, as [`super::qmatmul_reference`] computes it.

use super::acts::ActBlock;
use super::fmt::{halves_term, in_order_prefetch, scale_rows, At, Fmt, Prefetch};
use super::format::QuantFormat;
use super::isa::{nibbles, QIsa};
use super::spec::{spec, Codes, Mins, Scales, Spec};

/// A generic format, by its ggml type id.
pub(crate) struct Gen<const ID: u32>;

/// The format of ggml type id `id` among the generic ones (a compile-time lookup).
const fn format_of(id: u32) -> QuantFormat {
    let mut i = 0;
    while i < QuantFormat::ALL.len() {
        if QuantFormat::ALL[i].ggml_type() == id {
            return QuantFormat::ALL[i];
        }
        i += 1;
    }
    panic!("not a ggml type id")
}

/// The spec of a generic format (a compile-time lookup).
const fn spec_of(id: u32) -> Spec {
    match spec(format_of(id)) {
        Some(s) => s,
        None => panic!("not a generic format"),
    }
}

/// A codebook as the dot products take it: signed values, or values + 128.
#[inline(always)]
fn table<I: QIsa>(lut: [i8; 16]) -> [u8; 16] {
    lut.map(|v| {
        if I::SIGNED {
            v as u8
        } else {
            (i16::from(v) + 128) as u8
        }
    })
}

impl<const ID: u32> Gen<ID> {
    const SPEC: Spec = spec_of(ID);
}

impl<const ID: u32> Fmt for Gen<ID> {
    const FORMAT: QuantFormat = format_of(ID);
    const HALVES: bool = matches!(Self::SPEC.scales, Scales::Per16);
    const OFFSET_128: bool = matches!(Self::SPEC.codes, Codes::Lut | Codes::Lut3);
    const MINS16: bool = matches!(Self::SPEC.mins, Mins::Per16);
    /// The block's bit plane ([`Codes::Five`]'s fifth bits, [`Codes::Lut3`]'s signs; zeros otherwise).
    type Pre<I: QIsa> = I::W;
    /// The 2-bit planes (Q2_K, TQ1_0, TQ2_0; IQ2_*, IQ1_* with their sign planes) prefetch every line (see
    /// [`Prefetch::Hardware`]); the other generic formats are read in address order.
    #[inline(always)]
    fn prefetch<I: QIsa>(_streams: usize) -> Prefetch {
        match Self::SPEC.codes {
            Codes::Two | Codes::Lut3 => Prefetch::EveryLine,
            Codes::Lut | Codes::Nib | Codes::Five => in_order_prefetch::<I>(),
        }
    }
    fn cmax<I: QIsa>() -> u32 {
        match Self::SPEC.codes {
            Codes::Lut | Codes::Lut3 => 128,
            Codes::Nib => 15,
            Codes::Five => 31,
            Codes::Two => 3,
        }
    }
    #[inline(always)]
    fn offset<I: QIsa>() -> i32 {
        match Self::SPEC.codes {
            Codes::Lut | Codes::Lut3 if !I::SIGNED => 128,
            Codes::Lut | Codes::Lut3 => 0,
            _ => Self::SPEC.offset,
        }
    }
    #[inline(always)]
    unsafe fn pre<I: QIsa>(isa: I, u: *const u8, b: usize) -> I::W {
        if matches!(Self::SPEC.codes, Codes::Five | Codes::Lut3) {
            // SAFETY: block b's fifth-bit plane.
            unsafe { isa.load_w(u.add(Self::LAY.hb.at(b))) }
        } else {
            isa.splat_w(0)
        }
    }
    #[inline(always)]
    unsafe fn codes<I: QIsa>(isa: I, u: *const u8, b: usize, h: usize, hb: I::W) -> (I::W, I::W) {
        let c = Self::LAY.codes.at(b);
        match Self::SPEC.codes {
            // SAFETY: block b's 4 nibble vectors.
            Codes::Lut => unsafe { isa.nibble_lut(table::<I>(Self::SPEC.lut), u.add(c + 64 * h)) },
            // SAFETY: as above.
            Codes::Nib => unsafe { nibbles(isa, u.add(c + 64 * h)) },
            Codes::Five => {
                let g = h as u32;
                // SAFETY: as above.
                unsafe { isa.nibbles_high(u.add(c + 64 * h), (hb, hb), (g, g + 4), 1) }
            }
            Codes::Two => {
                // SAFETY: block b's 2 vectors of 2-bit codes.
                unsafe { two_bits(isa, u.add(c), h) }
            }
            Codes::Lut3 => {
                // SAFETY: as above.
                let (lo, hi) = unsafe { two_bits(isa, u.add(c), h) };
                let lut = table::<I>(Self::SPEC.lut);
                (
                    isa.lut16(lut, plane_bit(isa, lo, hb, h, 2)),
                    isa.lut16(lut, plane_bit(isa, hi, hb, h + 4, 2)),
                )
            }
        }
    }
    #[inline(always)]
    unsafe fn unit_scales<I: QIsa>(isa: I, u: *const u8) -> (I::F, I::F) {
        let lay = Self::LAY;
        // SAFETY: the unit's f32 d (and dmin) rows.
        unsafe {
            let dmin = if Self::SPEC.mins == Mins::None {
                isa.f_zero()
            } else {
                isa.load_fp(u.add(lay.dmin))
            };
            (isa.load_fp(u.add(lay.d)), dmin)
        }
    }
    #[inline(always)]
    unsafe fn scales<I: QIsa>(isa: I, at: At<I>) -> (I::F, I::F) {
        let p = Self::LAY.sc.at(at.b);
        let d = at.ud.0;
        // SAFETY: block b's scale rows.
        unsafe {
            match Self::SPEC.scales {
                Scales::None => (d, at.ud.1),
                Scales::Per32 => (isa.mul(d, isa.load_i8f(at.u.add(p))), at.ud.1),
                Scales::Per16 => scale_rows(isa, d, at.u.add(p), true),
            }
        }
    }
    #[inline(always)]
    unsafe fn mins<I: QIsa>(isa: I, at: At<I>) -> (I::F, I::F) {
        // SAFETY: block b's min rows (only read for mins per 16).
        unsafe { scale_rows(isa, at.ud.1, at.u.add(Self::LAY.m.at(at.b)), false) }
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
        let off = Self::offset::<I>();
        let f = if Self::HALVES {
            halves_term(isa, s, lo, hi, off, ab)
        } else {
            let sum = isa.cvt(isa.sub_splat_i(isa.add_i(lo, hi), off * ab.sum));
            if Self::SPEC.mins == Mins::Unit {
                isa.fms(s.0, sum, isa.mul(s.1, isa.splat_f(ab.sumf)))
            } else {
                isa.mul(s.0, sum)
            }
        };
        isa.fma(f, isa.splat_f(ab.d), acc)
    }
    #[inline(always)]
    fn combine_m<I: QIsa>(
        isa: I,
        s: (I::F, I::F),
        m: (I::F, I::F),
        lo: I::I,
        hi: I::I,
        ab: ActBlock,
        acc: I::F,
    ) -> I::F {
        if !Self::MINS16 {
            return Self::combine(isa, s, lo, hi, ab, acc);
        }
        let f = halves_term(isa, s, lo, hi, Self::offset::<I>(), ab);
        let rest = (ab.sum - ab.half) as f32;
        let t = isa.fma(
            m.0,
            isa.splat_f(ab.half as f32),
            isa.mul(m.1, isa.splat_f(rest)),
        );
        let f = isa.fms(isa.splat_f(1.0), f, t);
        isa.fma(f, isa.splat_f(ab.d), acc)
    }
}

/// Groups `h` and `h + 4` of a 32-block's two vectors of 2-bit codes at `p` (group `g` in bits `2(g mod 4)..` of
/// vector `g / 4`), as bytes `0..4`.
///
/// # Safety
/// `p` must be valid for reading 128 bytes.
#[inline(always)]
unsafe fn two_bits<I: QIsa>(isa: I, p: *const u8, h: usize) -> (I::W, I::W) {
    let m = isa.splat_w(3);
    let s = 2 * h as u32;
    // SAFETY: forwarded from the caller.
    let (a, b) = unsafe { (isa.load_w(p), isa.load_w(p.add(64))) };
    if s == 0 {
        (isa.and_w(a, m), isa.and_w(b, m))
    } else {
        (isa.and_w(isa.shr16(a, s), m), isa.and_w(isa.shr16(b, s), m))
    }
}

/// `codes` with bit `g` of each byte of `plane` moved to bit `to` (and or-ed in).
#[inline(always)]
fn plane_bit<I: QIsa>(isa: I, codes: I::W, plane: I::W, g: usize, to: u32) -> I::W {
    let g = g as u32;
    let moved = if g < to {
        isa.shl16(plane, to - g)
    } else if g > to {
        isa.shr16(plane, g - to)
    } else {
        plane
    };
    isa.or_w(codes, isa.and_w(moved, isa.splat_w(1 << to)))
}
