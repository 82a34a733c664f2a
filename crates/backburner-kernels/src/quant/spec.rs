//! The *generic* panel formats: every GGUF block type that has no hand-laid panel of its own (all but Q8_0, Q4_0,
//! Q4_K, Q5_K, Q6_K and IQ4_XS) is decoded at pack time into one shape of unit that a single [`Fmt`] reads.
//!
//! A weight of a generic format is `w = ds·v − dm` over a 16- or 32-element sub-block, where
//! * `v` is the element's integer value: a codebook entry (`code` a 4-bit index into [`Spec::lut`], for the i-quants,
//!   IQ4_NL and MXFP4), or a plain 4- or 5-bit code minus [`Spec::offset`] (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, TQ1_0, TQ2_0);
//! * `ds = d·sc`: `d` the unit's scale as f32 (the block's f16 `d`, or MXFP4's power of two, times a power of two that
//!   the format's own formula carries, e.g. IQ2's `0.25·(0.5 + ls) = (2·ls + 1)/8`: exact) and `sc` a small integer
//!   per sub-block (`1` where the format has none);
//! * `dm = dmin·m`: the min term, for Q4_1 / Q5_1 (`dmin = −m`, one per block) and Q2_K (per 16).
//!
//! Each of these products is exact in f32 (an f16 mantissa times an integer of at most 6 bits), so `ds·v − dm` is,
//! operation for operation, ggml's and gguf-py's value of the weight (tested on gguf-py's output for every type).
//!
//! [`Fmt`]: super::fmt::Fmt

use super::format::{QuantFormat, IQ4_VALUES};
use super::unit::{Field, Lay, Unit};

/// Where a generic format's element values come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Codes {
    /// A 4-bit index into [`Spec::lut`] (signed values; the kernels take them as offset-128 codes).
    Lut,
    /// A 3-bit index into [`Spec::lut`] held as a 2-bit level (two bits per input, 4 groups per vector) plus a sign
    /// bit plane (as Q5_K's fifth bits): index `level | sign << 2` (the IQ2 and IQ1 types: 3 levels, a sign).
    Lut3,
    /// A plain 2-bit code `c`, value `c − offset` (Q2_K, TQ1_0, TQ2_0).
    Two,
    /// A plain 4-bit code `c`, value `c − offset`.
    Nib,
    /// A 5-bit code (a nibble plus a fifth-bit plane, as Q5_K), value `c − offset`.
    Five,
}

/// Sub-block scales of a generic format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scales {
    /// None: `ds = d` for the whole unit.
    None,
    /// One i8 per 32 elements.
    Per32,
    /// One i8 per 16 elements.
    Per16,
}

/// Min terms of a generic format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mins {
    /// None.
    None,
    /// One per unit: `dm = dmin` (Q4_1, Q5_1, whose unit is their 32-element block).
    Unit,
    /// One u8 `m` per 16 elements: `dm = dmin·m` (Q2_K).
    Per16,
}

/// How a generic format's weights are held (see the module docs).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Spec {
    /// Elements per unit (the GGUF block: 32 or 256).
    pub unit: usize,
    /// Where values come from.
    pub codes: Codes,
    /// The codebook of [`Codes::Lut`] (16 signed values; unused entries 0).
    pub lut: [i8; 16],
    /// What a [`Codes::Nib`] / [`Codes::Five`] code exceeds its value by.
    pub offset: i32,
    /// Sub-block scales.
    pub scales: Scales,
    /// Min terms.
    pub mins: Mins,
}

/// The signed IQ2 levels: index `t` for `L[t]`, `4 + t` for `−L[t]`, with `L = [8, 25, 43]`.
pub(crate) const IQ2_LUT: [i8; 16] = [8, 25, 43, 0, -8, -25, -43, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// The signed IQ3_XXS levels: index `7 − t` for `−L[t]`, `8 + t` for `+L[t]`, `L = [4, 12, …, 52, 62]`.
pub(crate) const IQ3XXS_LUT: [i8; 16] = [
    -62, -52, -44, -36, -28, -20, -12, -4, 4, 12, 20, 28, 36, 44, 52, 62,
];
/// The signed IQ3_S levels: index `7 − t` for `−(2t + 1)`, `8 + t` for `2t + 1`.
pub(crate) const IQ3S_LUT: [i8; 16] =
    [-15, -13, -11, -9, -7, -5, -3, -1, 1, 3, 5, 7, 9, 11, 13, 15];
/// IQ1 values times 8, `8·(g + δ)` for a grid value `g = t − 1` (`t` in `0..3`) and `δ = ±1/8`: index `t` for
/// `δ = +1/8`, `4 + t` for `δ = −1/8`.
pub(crate) const IQ1_LUT: [i8; 16] = [-7, 1, 9, 0, -9, -1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0];
/// The MXFP4 (E2M1) values, doubled as ggml keeps them (`kvalues_mxfp4`); its scale carries the half.
pub(crate) const MXFP4_LUT: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// The generic spec of `fmt`; `None` for the formats with their own panel layout.
pub(crate) const fn spec(fmt: QuantFormat) -> Option<Spec> {
    use QuantFormat as F;
    const fn s(
        unit: usize,
        codes: Codes,
        lut: [i8; 16],
        offset: i32,
        scales: Scales,
        mins: Mins,
    ) -> Spec {
        Spec {
            unit,
            codes,
            lut,
            offset,
            scales,
            mins,
        }
    }
    const Z: [i8; 16] = [0; 16];
    Some(match fmt {
        F::Q8_0 | F::Q4_0 | F::Q4K | F::Q5K | F::Q6K | F::Iq4Xs => return None,
        F::Q4_1 => s(32, Codes::Nib, Z, 0, Scales::None, Mins::Unit),
        F::Q5_0 => s(32, Codes::Five, Z, 16, Scales::None, Mins::None),
        F::Q5_1 => s(32, Codes::Five, Z, 0, Scales::None, Mins::Unit),
        F::Q2K => s(256, Codes::Two, Z, 0, Scales::Per16, Mins::Per16),
        F::Q3K => s(256, Codes::Nib, Z, 4, Scales::Per16, Mins::None),
        F::Tq1_0 | F::Tq2_0 => s(256, Codes::Two, Z, 1, Scales::None, Mins::None),
        F::Iq4Nl => s(32, Codes::Lut, IQ4_VALUES, 0, Scales::None, Mins::None),
        F::Mxfp4 => s(32, Codes::Lut, MXFP4_LUT, 0, Scales::None, Mins::None),
        F::Iq2Xxs => s(256, Codes::Lut3, IQ2_LUT, 0, Scales::Per32, Mins::None),
        F::Iq2Xs | F::Iq2S => s(256, Codes::Lut3, IQ2_LUT, 0, Scales::Per16, Mins::None),
        F::Iq3Xxs => s(256, Codes::Lut, IQ3XXS_LUT, 0, Scales::Per32, Mins::None),
        F::Iq3S => s(256, Codes::Lut, IQ3S_LUT, 0, Scales::Per32, Mins::None),
        F::Iq1S => s(256, Codes::Lut3, IQ1_LUT, 0, Scales::Per32, Mins::None),
        F::Iq1M => s(256, Codes::Lut3, IQ1_LUT, 0, Scales::Per16, Mins::None),
    })
}

/// The panel layout of a generic format: the unit's 16 f32 `d` (64 bytes), its 16 f32 `dmin` when it has mins, then
/// each 32-block's bit plane (64: [`Codes::Five`]'s fifth bits, [`Codes::Lut3`]'s signs), its codes (4 nibble
/// vectors, 256; or 2 vectors of 2-bit codes, 128: groups `0..4` in the first, `4..8` in the second, group `g` in bits
/// `2(g mod 4)..`), scales (16 per 32 or 2 × 16 per 16) and mins (2 × 16), in the order decode reads them.
pub(crate) const fn gen_lay(s: Spec) -> Lay {
    const fn f(base: usize, stride: usize) -> Field {
        Field { base, stride }
    }
    let head = if matches!(s.mins, Mins::None) {
        64
    } else {
        128
    };
    let plane = if matches!(s.codes, Codes::Five | Codes::Lut3) {
        64
    } else {
        0
    };
    let codes = if matches!(s.codes, Codes::Two | Codes::Lut3) {
        128
    } else {
        256
    };
    let sc = match s.scales {
        Scales::None => 0,
        Scales::Per32 => 16,
        Scales::Per16 => 32,
    };
    let m = if matches!(s.mins, Mins::Per16) { 32 } else { 0 };
    let stride = plane + codes + sc + m;
    Lay {
        unit: s.unit,
        bytes: head + stride * (s.unit / 32),
        d: 0,
        dmin: if head == 128 { 64 } else { 0 },
        hb: f(head, stride),
        codes: f(head + plane, stride),
        sc: f(head + plane + codes, stride),
        m: f(head + plane + codes + sc, stride),
    }
}

/// Writes a generic format's unit `u` into lane `l` (`< 16`) of a zeroed panel unit `p` of layout `lay`.
pub(crate) fn store_generic(u: &Unit, s: Spec, lay: Lay, p: &mut [u8], l: usize) {
    for e in 0..s.unit {
        let c = u.code[e];
        let (b, g, t) = (e / 32, (e % 32) / 4, e % 4);
        match s.codes {
            Codes::Two | Codes::Lut3 => {
                p[lay.codes.at(b) + 64 * (g / 4) + 4 * l + t] |= (c & 3) << (2 * (g % 4));
            }
            _ => p[lay.codes.at(b) + 64 * (g % 4) + 4 * l + t] |= (c & 0xF) << (4 * (g / 4)),
        }
        match s.codes {
            Codes::Five => p[lay.hb.at(b) + 4 * l + t] |= ((c >> 4) & 1) << g,
            Codes::Lut3 => p[lay.hb.at(b) + 4 * l + t] |= ((c >> 2) & 1) << g,
            _ => {}
        }
    }
    p[lay.d + 4 * l..lay.d + 4 * l + 4].copy_from_slice(&u.df.to_le_bytes());
    if s.mins != Mins::None {
        p[lay.dmin + 4 * l..lay.dmin + 4 * l + 4].copy_from_slice(&u.dmf.to_le_bytes());
    }
    for b in 0..s.unit / 32 {
        match s.scales {
            Scales::None => {}
            Scales::Per32 => p[lay.sc.at(b) + l] = u.sc[b],
            Scales::Per16 => (0..2).for_each(|h| p[lay.sc.at(b) + 16 * h + l] = u.sc[2 * b + h]),
        }
        if s.mins == Mins::Per16 {
            (0..2).for_each(|h| p[lay.m.at(b) + 16 * h + l] = u.m[2 * b + h]);
        }
    }
}

/// Reads lane `l` of a generic panel unit `p`: the inverse of [`store_generic`].
pub(crate) fn load_generic(s: Spec, lay: Lay, p: &[u8], l: usize) -> Unit {
    let mut u = Unit::zeroed();
    let f32_at = |at: usize| f32::from_le_bytes([p[at], p[at + 1], p[at + 2], p[at + 3]]);
    for e in 0..s.unit {
        let (b, g, t) = (e / 32, (e % 32) / 4, e % 4);
        let plane = (p[lay.hb.at(b) + 4 * l + t] >> g) & 1;
        u.code[e] = match s.codes {
            Codes::Two => (p[lay.codes.at(b) + 64 * (g / 4) + 4 * l + t] >> (2 * (g % 4))) & 3,
            Codes::Lut3 => {
                ((p[lay.codes.at(b) + 64 * (g / 4) + 4 * l + t] >> (2 * (g % 4))) & 3) | plane << 2
            }
            Codes::Five => {
                ((p[lay.codes.at(b) + 64 * (g % 4) + 4 * l + t] >> (4 * (g / 4))) & 0xF)
                    | plane << 4
            }
            _ => (p[lay.codes.at(b) + 64 * (g % 4) + 4 * l + t] >> (4 * (g / 4))) & 0xF,
        };
    }
    u.df = f32_at(lay.d + 4 * l);
    if s.mins != Mins::None {
        u.dmf = f32_at(lay.dmin + 4 * l);
    }
    for b in 0..s.unit / 32 {
        match s.scales {
            Scales::None => {}
            Scales::Per32 => u.sc[b] = p[lay.sc.at(b) + l],
            Scales::Per16 => (0..2).for_each(|h| u.sc[2 * b + h] = p[lay.sc.at(b) + 16 * h + l]),
        }
        if s.mins == Mins::Per16 {
            (0..2).for_each(|h| u.m[2 * b + h] = p[lay.m.at(b) + 16 * h + l]);
        }
    }
    u
}

/// The value of element `e` of a generic unit: `(df·sc)·v − dmf·m`, in ggml's and gguf-py's operation order (see
/// the module docs; the subtraction is left out without mins, as their formulas do).
pub(crate) fn value(s: Spec, u: &Unit, e: usize) -> f32 {
    let c = u.code[e];
    let v = match s.codes {
        Codes::Lut | Codes::Lut3 => i32::from(s.lut[usize::from(c & 0xF)]),
        Codes::Nib | Codes::Five | Codes::Two => i32::from(c) - s.offset,
    };
    let sc = match s.scales {
        Scales::None => 1.0,
        Scales::Per32 => f32::from(u.sc[e / 32] as i8),
        Scales::Per16 => f32::from(u.sc[e / 16] as i8),
    };
    let w = (u.df * sc) * v as f32;
    match s.mins {
        Mins::None => w,
        Mins::Unit => w - u.dmf,
        Mins::Per16 => w - u.dmf * f32::from(u.m[e / 16]),
    }
}
