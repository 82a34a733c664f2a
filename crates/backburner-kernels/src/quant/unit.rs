//! One row's block of a format decoded to integer codes and scale fields ([`Unit`]), to and from GGUF bytes and to
//! and from a lane of the panel layout ([`Lay`]); see the [module docs](super) for the layout.

use super::format::{k_pack_scale_min, k_scale_min, QuantFormat};
use super::spec::{gen_lay, spec};

/// Where a field of each 32-block of a panel unit lies: at `base + stride·b` for block `b`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Field {
    /// Offset of block 0's field in the unit.
    pub base: usize,
    /// Bytes from one block's field to the next.
    pub stride: usize,
}

impl Field {
    const NONE: Field = Field { base: 0, stride: 0 };

    /// Offset of block `b`'s field.
    #[inline(always)]
    pub const fn at(self, b: usize) -> usize {
        self.base + self.stride * b
    }
}

/// Where the fields of one panel unit (16 rows × one GGUF block) lie. The K-quants, Q4_0 and IQ4_XS are laid out in
/// the order the decode kernel uses them: the unit's `d` (and `dmin`) first, then its 32-blocks one after the other,
/// each block's high-bit planes, nibble vectors and sub-block scales (and mins) together, so that a unit streams
/// upwards (see the module docs). Q8_0 keeps its `d` after its codes (the asm load of
/// [`super::isa::QIsa::load8_w`] orders them).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lay {
    /// Elements of a row per unit (the GGUF block: 32 or 256).
    pub unit: usize,
    /// Bytes of the unit for the 16 rows of a panel.
    pub bytes: usize,
    /// 16 × f16 `d`.
    pub d: usize,
    /// 16 × f16 `dmin`; 0 for the formats without mins.
    pub dmin: usize,
    /// Code vectors (512 bytes for Q8_0, 4 nibble vectors of 64 for the others).
    pub codes: Field,
    /// High-bit planes (Q5_K: one 64-byte plane per 32-block; Q6_K: two).
    pub hb: Field,
    /// Sub-block scales, `[sub-block][row]` bytes (Q6_K: two sub-blocks of 16 per 32-block).
    pub sc: Field,
    /// Sub-block mins, `[row]` bytes.
    pub m: Field,
}

impl Lay {
    /// The panel layout of `fmt`.
    pub const fn of(fmt: QuantFormat) -> Lay {
        const fn f(base: usize, stride: usize) -> Field {
            Field { base, stride }
        }
        if let Some(s) = spec(fmt) {
            return gen_lay(s);
        }
        let z = Lay {
            unit: 256,
            bytes: 0,
            d: 0,
            dmin: 0,
            codes: Field::NONE,
            hb: Field::NONE,
            sc: Field::NONE,
            m: Field::NONE,
        };
        match fmt {
            // codes; d.
            QuantFormat::Q8_0 => Lay {
                unit: 32,
                bytes: 544,
                d: 512,
                codes: f(0, 0),
                ..z
            },
            // d; nibbles.
            QuantFormat::Q4_0 => Lay {
                unit: 32,
                bytes: 288,
                codes: f(32, 0),
                ..z
            },
            // d, dmin; 8 × (nibbles 256, scales 16, mins 16).
            QuantFormat::Q4K => Lay {
                bytes: 2368,
                dmin: 32,
                codes: f(64, 288),
                sc: f(64 + 256, 288),
                m: f(64 + 272, 288),
                ..z
            },
            // d, dmin; 8 × (fifth-bit plane 64, nibbles 256, scales 16, mins 16).
            QuantFormat::Q5K => Lay {
                bytes: 2880,
                dmin: 32,
                hb: f(64, 352),
                codes: f(64 + 64, 352),
                sc: f(64 + 320, 352),
                m: f(64 + 336, 352),
                ..z
            },
            // d; 8 × (two bit-pair planes 128, nibbles 256, two rows of 16 scales 32).
            QuantFormat::Q6K => Lay {
                bytes: 3360,
                hb: f(32, 416),
                codes: f(32 + 128, 416),
                sc: f(32 + 384, 416),
                ..z
            },
            // d; 8 × (nibbles 256, scales 16).
            QuantFormat::Iq4Xs => Lay {
                bytes: 2208,
                codes: f(32, 272),
                sc: f(32 + 256, 272),
                ..z
            },
            // The generic formats (above).
            _ => z,
        }
    }
}

/// One row's GGUF block as integers. `code` holds the panel codes (unsigned): Q8_0 `q + 128`, Q4_0 / Q4_K `0..16`,
/// Q5_K `0..32`, Q6_K `0..64`, IQ4_XS the codebook index `0..16`; the generic formats (`super::spec`) their codebook
/// index or plain code, with `df`, `dmf`, `sc` (i8) and `m` per sub-block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Unit {
    /// Codes of the block's elements, in element order (only the first 32 for Q8_0 / Q4_0).
    pub code: [u8; 256],
    /// f16 bits of `d`.
    pub d: u16,
    /// f16 bits of `dmin` (Q4_K, Q5_K).
    pub dmin: u16,
    /// Q4_K / Q5_K: 8 six-bit scales; Q6_K: 16 i8 scales; IQ4_XS: 8 × `ls − 32` as i8.
    pub sc: [u8; 16],
    /// Q4_K / Q5_K: 8 six-bit mins; Q2_K: 16 four-bit mins.
    pub m: [u8; 16],
    /// Generic formats: the unit's f32 scale `d`.
    pub df: f32,
    /// Generic formats: the unit's f32 `dmin` (0 without mins).
    pub dmf: f32,
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// Byte and nibble (0 low, 1 high) of element `e` of a Q4_K / Q5_K block's 128 nibble bytes.
fn k_nibble(e: usize) -> (usize, usize) {
    let (j, r) = (e / 64, e % 64);
    (32 * j + r % 32, r / 32)
}

/// Byte of `ql`, nibble, byte of `qh` and bit-pair index of element `e` of a Q6_K block.
fn q6_pos(e: usize) -> (usize, usize, usize, usize) {
    let (n, r) = (e / 128, e % 128);
    let (quarter, l) = (r / 32, r % 32);
    (
        64 * n + 32 * (quarter % 2) + l,
        quarter / 2,
        32 * n + l,
        quarter,
    )
}

/// Byte and nibble of element `e` of a 32-element nibble block (Q4_0, each 32 of IQ4_XS).
fn block_nibble(e: usize) -> (usize, usize) {
    (e % 16, e / 16)
}

impl Unit {
    fn zero() -> Unit {
        Unit {
            code: [0; 256],
            d: 0,
            dmin: 0,
            sc: [0; 16],
            m: [0; 16],
            df: 0.0,
            dmf: 0.0,
        }
    }

    /// Whether the block's scales are finite (f16 `d` and `dmin`, or the generic formats' f32 `df`, `dmf`).
    pub fn scales_finite(&self, fmt: QuantFormat) -> bool {
        let f16_ok = |b: u16| b & 0x7C00 != 0x7C00;
        if spec(fmt).is_some() {
            self.df.is_finite() && self.dmf.is_finite()
        } else {
            f16_ok(self.d) && f16_ok(self.dmin)
        }
    }

    /// A zeroed unit (for the generic decoders).
    pub(crate) fn zeroed() -> Unit {
        Unit::zero()
    }

    /// Decodes one GGUF block (`b.len() == fmt.block_bytes()`).
    pub fn from_gguf(fmt: QuantFormat, b: &[u8]) -> Unit {
        if spec(fmt).is_some() {
            return super::decode::decode_generic(fmt, b);
        }
        let mut u = Unit::zero();
        let nib = |byte: u8, which: usize| (byte >> (4 * which)) & 0xF;
        match fmt {
            QuantFormat::Q8_0 => {
                u.d = le16(b, 0);
                for e in 0..32 {
                    u.code[e] = b[2 + e] ^ 0x80;
                }
            }
            QuantFormat::Q4_0 => {
                u.d = le16(b, 0);
                for e in 0..32 {
                    let (i, w) = block_nibble(e);
                    u.code[e] = nib(b[2 + i], w);
                }
            }
            QuantFormat::Q4K | QuantFormat::Q5K => {
                (u.d, u.dmin) = (le16(b, 0), le16(b, 2));
                for j in 0..8 {
                    (u.sc[j], u.m[j]) = k_scale_min(&b[4..16], j);
                }
                let five = fmt == QuantFormat::Q5K;
                let qs = if five { &b[48..176] } else { &b[16..144] };
                for e in 0..256 {
                    let (i, w) = k_nibble(e);
                    let high = if five {
                        (b[16 + e % 32] >> (e / 32)) & 1
                    } else {
                        0
                    };
                    u.code[e] = nib(qs[i], w) | (high << 4);
                }
            }
            QuantFormat::Q6K => {
                u.d = le16(b, 208);
                u.sc.copy_from_slice(&b[192..208]);
                for e in 0..256 {
                    let (l, w, h, pair) = q6_pos(e);
                    u.code[e] = nib(b[l], w) | (((b[128 + h] >> (2 * pair)) & 3) << 4);
                }
            }
            QuantFormat::Iq4Xs => {
                u.d = le16(b, 0);
                let scales_h = le16(b, 2);
                for ib in 0..8 {
                    let lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
                    let ls = lo | ((((scales_h >> (2 * ib)) & 3) as u8) << 4);
                    u.sc[ib] = (ls as i8 - 32) as u8;
                }
                for e in 0..256 {
                    let (i, w) = block_nibble(e % 32);
                    u.code[e] = nib(b[8 + 16 * (e / 32) + i], w);
                }
            }
            _ => {}
        }
        u
    }

    /// Encodes the block as GGUF bytes into `b` (`fmt.block_bytes()` bytes, all written): the inverse of
    /// [`Unit::from_gguf`], for the hand-laid formats; `false` (nothing written) for the generic ones, whose grids
    /// and packed sub-scales are not re-encoded.
    pub fn to_gguf(self, fmt: QuantFormat, b: &mut [u8]) -> bool {
        if spec(fmt).is_some() {
            return false;
        }
        b.fill(0);
        let put16 =
            |b: &mut [u8], at: usize, v: u16| b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        match fmt {
            QuantFormat::Q8_0 => {
                put16(b, 0, self.d);
                for e in 0..32 {
                    b[2 + e] = self.code[e] ^ 0x80;
                }
            }
            QuantFormat::Q4_0 => {
                put16(b, 0, self.d);
                for e in 0..32 {
                    let (i, w) = block_nibble(e);
                    b[2 + i] |= (self.code[e] & 0xF) << (4 * w);
                }
            }
            QuantFormat::Q4K | QuantFormat::Q5K => {
                put16(b, 0, self.d);
                put16(b, 2, self.dmin);
                let sc: [u8; 8] = self.sc[..8].try_into().expect("8 scales");
                let m: [u8; 8] = self.m[..8].try_into().expect("8 mins");
                b[4..16].copy_from_slice(&k_pack_scale_min(&sc, &m));
                let five = fmt == QuantFormat::Q5K;
                let qs0 = if five { 48 } else { 16 };
                for e in 0..256 {
                    let (i, w) = k_nibble(e);
                    b[qs0 + i] |= (self.code[e] & 0xF) << (4 * w);
                    if five {
                        b[16 + e % 32] |= ((self.code[e] >> 4) & 1) << (e / 32);
                    }
                }
            }
            QuantFormat::Q6K => {
                put16(b, 208, self.d);
                b[192..208].copy_from_slice(&self.sc);
                for e in 0..256 {
                    let (l, w, h, pair) = q6_pos(e);
                    b[l] |= (self.code[e] & 0xF) << (4 * w);
                    b[128 + h] |= ((self.code[e] >> 4) & 3) << (2 * pair);
                }
            }
            QuantFormat::Iq4Xs => {
                put16(b, 0, self.d);
                let mut scales_h = 0u16;
                for ib in 0..8 {
                    let ls = (self.sc[ib] as i8 + 32) as u8;
                    b[4 + ib / 2] |= (ls & 0xF) << (4 * (ib % 2));
                    scales_h |= u16::from(ls >> 4) << (2 * ib);
                }
                put16(b, 2, scales_h);
                for e in 0..256 {
                    let (i, w) = block_nibble(e % 32);
                    b[8 + 16 * (e / 32) + i] |= (self.code[e] & 0xF) << (4 * w);
                }
            }
            _ => {}
        }
        true
    }

    /// Writes the block into lane `l` (`< 16`) of a zeroed panel unit `p` (`Lay::of(fmt).bytes` bytes).
    pub fn store(&self, fmt: QuantFormat, p: &mut [u8], l: usize) {
        let lay = Lay::of(fmt);
        if let Some(s) = spec(fmt) {
            return super::spec::store_generic(self, s, lay, p, l);
        }
        for e in 0..lay.unit {
            let c = self.code[e];
            let (b, g, t) = (e / 32, (e % 32) / 4, e % 4);
            let (cv, hb) = (lay.codes.at(b), lay.hb.at(b));
            match fmt {
                QuantFormat::Q8_0 => p[cv + 64 * g + 4 * l + t] = c,
                _ => p[cv + 64 * (g % 4) + 4 * l + t] |= (c & 0xF) << (4 * (g / 4)),
            }
            if fmt == QuantFormat::Q5K {
                p[hb + 4 * l + t] |= ((c >> 4) & 1) << g;
            } else if fmt == QuantFormat::Q6K {
                p[hb + 64 * (g / 4) + 4 * l + t] |= ((c >> 4) & 3) << (2 * (g % 4));
            }
        }
        p[lay.d + 2 * l..lay.d + 2 * l + 2].copy_from_slice(&self.d.to_le_bytes());
        match fmt {
            QuantFormat::Q4K | QuantFormat::Q5K => {
                p[lay.dmin + 2 * l..lay.dmin + 2 * l + 2].copy_from_slice(&self.dmin.to_le_bytes());
                for b in 0..8 {
                    p[lay.sc.at(b) + l] = self.sc[b];
                    p[lay.m.at(b) + l] = self.m[b];
                }
            }
            QuantFormat::Q6K => {
                (0..16).for_each(|s| p[lay.sc.at(s / 2) + 16 * (s % 2) + l] = self.sc[s])
            }
            QuantFormat::Iq4Xs => (0..8).for_each(|b| p[lay.sc.at(b) + l] = self.sc[b]),
            _ => {}
        }
    }

    /// Reads lane `l` of panel unit `p`: the inverse of [`Unit::store`].
    pub fn load(fmt: QuantFormat, p: &[u8], l: usize) -> Unit {
        let lay = Lay::of(fmt);
        if let Some(s) = spec(fmt) {
            return super::spec::load_generic(s, lay, p, l);
        }
        let mut u = Unit::zero();
        for e in 0..lay.unit {
            let (b, g, t) = (e / 32, (e % 32) / 4, e % 4);
            let (cv, hb) = (lay.codes.at(b), lay.hb.at(b));
            let mut c = match fmt {
                QuantFormat::Q8_0 => p[cv + 64 * g + 4 * l + t],
                _ => (p[cv + 64 * (g % 4) + 4 * l + t] >> (4 * (g / 4))) & 0xF,
            };
            if fmt == QuantFormat::Q5K {
                c |= ((p[hb + 4 * l + t] >> g) & 1) << 4;
            } else if fmt == QuantFormat::Q6K {
                c |= ((p[hb + 64 * (g / 4) + 4 * l + t] >> (2 * (g % 4))) & 3) << 4;
            }
            u.code[e] = c;
        }
        u.d = le16(p, lay.d + 2 * l);
        match fmt {
            QuantFormat::Q4K | QuantFormat::Q5K => {
                u.dmin = le16(p, lay.dmin + 2 * l);
                for b in 0..8 {
                    u.sc[b] = p[lay.sc.at(b) + l];
                    u.m[b] = p[lay.m.at(b) + l];
                }
            }
            QuantFormat::Q6K => {
                (0..16).for_each(|s| u.sc[s] = p[lay.sc.at(s / 2) + 16 * (s % 2) + l])
            }
            QuantFormat::Iq4Xs => (0..8).for_each(|b| u.sc[b] = p[lay.sc.at(b) + l]),
            _ => {}
        }
        u
    }
}
