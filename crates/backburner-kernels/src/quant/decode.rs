//! GGUF blocks of the generic formats decoded into [`Unit`]s (codes, `df`, `dmf`, sub-scales and mins; see
//! [`super::spec`]), with ggml's element order (`ggml-common.h` for the structs, `ggml-quants.c`
//! `dequantize_row_*` and gguf-py's `dequantize_blocks` for the order and arithmetic).

use super::format::{f16_at, QuantFormat};
use super::grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use super::spec::{spec, value};
use super::unit::Unit;

/// Bits per value in the IQ2 and IQ1 grid words.
const TWO: u32 = 2;

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 8 sign bits of a 7-bit IQ2 / IQ3_XXS sign index: the index with an eighth bit that makes the count of set
/// bits even (the format's `ksigns_iq2xs` table).
fn ksigns(i: u32) -> u8 {
    let i = (i & 0x7F) as u8;
    i | (((i.count_ones() & 1) as u8) << 7)
}

/// The codebook index of level `t` with sign bit `neg`, for IQ3's codebook `[−L[7] .. −L[0], L[0] .. L[7]]`.
fn signed_index(n: u8, t: u8, neg: bool) -> u8 {
    if neg {
        n - 1 - t
    } else {
        n + t
    }
}

/// Writes the 8 (IQ2) values of grid row `row` of `grid` (2 bits per value, 3 levels), with sign byte `signs`, as
/// codebook indices `level | sign << 2` into `code[at..at + 8]`.
fn put_iq2(code: &mut [u8], at: usize, grid: &[u16], row: usize, signs: u8) {
    let w = grid[row];
    for i in 0..8 {
        let t = ((w >> (TWO * i as u32)) & 3) as u8;
        code[at + i] = t | (((signs >> i) & 1) << 2);
    }
}

/// Writes the 4 (IQ3) values of grid row `row` (3 bits per value, 8 levels), signs from bits `shift..shift + 4` of
/// `signs`, as codebook indices into `code[at..at + 4]`.
fn put_iq3(code: &mut [u8], at: usize, grid: &[u16], row: usize, signs: u8, shift: usize) {
    let w = grid[row];
    for i in 0..4 {
        let t = ((w >> (3 * i as u32)) & 7) as u8;
        code[at + i] = signed_index(8, t, (signs >> (shift + i)) & 1 != 0);
    }
}

/// Writes the 8 IQ1 values of grid row `row` with delta sign `neg_delta` as indices `level | neg_delta << 2` of
/// `8·(g + δ)` into the IQ1 codebook (level 0, 1, 2 = grid value −1, 0, 1).
fn put_iq1(code: &mut [u8], at: usize, row: usize, neg_delta: bool) {
    let w = IQ1S_GRID[row];
    for i in 0..8 {
        code[at + i] = ((w >> (TWO * i as u32)) & 3) as u8 | (u8::from(neg_delta) << 2);
    }
}

/// Decodes one GGUF block of a generic format (`b.len() == fmt.block_bytes()`).
pub(crate) fn decode_generic(fmt: QuantFormat, b: &[u8]) -> Unit {
    let mut u = Unit::zeroed();
    use QuantFormat as F;
    match fmt {
        F::Q4_1 | F::Q5_0 | F::Q5_1 | F::Iq4Nl => decode_32(fmt, b, &mut u),
        F::Mxfp4 => {
            let e = u32::from(b[0]);
            let bits = if e < 2 {
                0x0020_0000 << e
            } else {
                (e - 1) << 23
            };
            u.df = f32::from_bits(bits);
            for l in 0..16 {
                u.code[l] = b[1 + l] & 0xF;
                u.code[16 + l] = b[1 + l] >> 4;
            }
        }
        F::Q2K => decode_q2k(b, &mut u),
        F::Q3K => decode_q3k(b, &mut u),
        F::Tq1_0 => decode_tq1(b, &mut u),
        F::Tq2_0 => {
            u.df = f16_at(b, 64);
            for e in 0..256 {
                let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
                u.code[e] = (b[32 * n + l] >> (2 * s)) & 3;
            }
        }
        F::Iq2Xxs | F::Iq3Xxs => decode_xxs(fmt, b, &mut u),
        F::Iq2Xs => {
            u.df = f16_at(b, 0) * 0.125;
            for k in 0..32 {
                let q = le16(b, 2 + 2 * k);
                put_iq2(
                    &mut u.code,
                    8 * k,
                    &IQ2XS_GRID,
                    usize::from(q & 511),
                    ksigns(u32::from(q >> 9)),
                );
            }
            iq_scales16(&b[66..74], &mut u);
        }
        F::Iq2S => {
            u.df = f16_at(b, 0) * 0.125;
            for k in 0..32 {
                let row = usize::from(b[2 + k])
                    | (usize::from((b[66 + k / 4] >> (2 * (k % 4))) & 3) << 8);
                put_iq2(&mut u.code, 8 * k, &IQ2S_GRID, row, b[34 + k]);
            }
            iq_scales16(&b[74..82], &mut u);
        }
        F::Iq3S => {
            u.df = f16_at(b, 0);
            for k in 0..64 {
                let row =
                    usize::from(b[2 + k]) | (usize::from((b[66 + k / 8] >> (k % 8)) & 1) << 8);
                let (sb, shift) = (b[74 + k / 2], 4 * (k % 2));
                put_iq3(&mut u.code, 4 * k, &IQ3S_GRID, row, sb, shift);
            }
            for i in 0..8 {
                u.sc[i] = 2 * ((b[106 + i / 2] >> (4 * (i % 2))) & 0xF) + 1;
            }
        }
        F::Iq1S => {
            u.df = f16_at(b, 0) * 0.125;
            for g in 0..8 {
                let qh = le16(b, 34 + 2 * g);
                u.sc[g] = 2 * ((qh >> 12) & 7) as u8 + 1;
                for j in 0..4 {
                    let row =
                        usize::from(b[2 + 4 * g + j]) | (usize::from((qh >> (3 * j)) & 7) << 8);
                    put_iq1(&mut u.code, 32 * g + 8 * j, row, qh & 0x8000 != 0);
                }
            }
        }
        F::Iq1M => decode_iq1m(b, &mut u),
        F::Q8_0 | F::Q4_0 | F::Q4K | F::Q5K | F::Q6K | F::Iq4Xs => {}
    }
    u
}

/// The 32-element blocks: Q4_1, Q5_0, Q5_1 (nibbles as Q4_0, element `j < 16` low, `j ≥ 16` high, fifth bit `j`
/// of the u32 `qh`) and IQ4_NL.
fn decode_32(fmt: QuantFormat, b: &[u8], u: &mut Unit) {
    use QuantFormat as F;
    u.df = f16_at(b, 0);
    let (qs, qh) = match fmt {
        F::Q4_1 => (4, None),
        F::Q5_0 => (6, Some(le32(b, 2))),
        F::Q5_1 => (8, Some(le32(b, 4))),
        _ => (2, None),
    };
    if matches!(fmt, F::Q4_1 | F::Q5_1) {
        u.dmf = -f16_at(b, 2);
    }
    for j in 0..32 {
        let byte = b[qs + j % 16];
        let nib = if j < 16 { byte & 0xF } else { byte >> 4 };
        let high = qh.map_or(0, |h| ((h >> j) & 1) as u8);
        u.code[j] = nib | (high << 4);
    }
}

/// Q2_K: element `e = 128n + 32s + l` is bits `2s..2s + 2` of `qs[32n + l]`; sub-block `e / 16` has scale
/// `scales[e/16] & 0xF` and min `scales[e/16] >> 4`.
fn decode_q2k(b: &[u8], u: &mut Unit) {
    u.df = f16_at(b, 80);
    u.dmf = f16_at(b, 82);
    for (i, &s) in b[..16].iter().enumerate() {
        u.sc[i] = s & 0xF;
        u.m[i] = s >> 4;
    }
    for e in 0..256 {
        let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
        u.code[e] = (b[16 + 32 * n + l] >> (2 * s)) & 3;
    }
}

/// Q3_K: low bits as Q2_K's codes, the high bit of element `e` is bit `e / 32` of `hmask[e % 32]` (set: value
/// `q`, clear: `q − 4`); 16 six-bit scales `sc − 32` packed as 8 low-nibble bytes and 4 bytes of bit pairs.
fn decode_q3k(b: &[u8], u: &mut Unit) {
    u.df = f16_at(b, 108);
    let sc = &b[96..108];
    for i in 0..16 {
        let lo = (sc[i % 8] >> (4 * (i / 8))) & 0xF;
        let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        u.sc[i] = ((lo | (hi << 4)) as i8 - 32) as u8;
    }
    for e in 0..256 {
        let (n, s, l) = (e / 128, (e % 128) / 32, e % 32);
        let low = (b[32 + 32 * n + l] >> (2 * s)) & 3;
        let high = (b[e % 32] >> (e / 32)) & 1;
        // Code = value + 4: `low + 4·high`.
        u.code[e] = low + 4 * high;
    }
}

/// TQ1_0: 48 bytes of 5 base-3 digits each (bytes 0..32 give elements `32i + l`, bytes 32..48 elements
/// `160 + 16i + l`), 4 bytes of 4 digits (elements `240 + 4i + l`); digit `i` of byte `q` is
/// `((q·3^i mod 256)·3) >> 8`.
fn decode_tq1(b: &[u8], u: &mut Unit) {
    u.df = f16_at(b, 52);
    let digit = |q: u8, i: u32| ((u16::from(q.wrapping_mul(3u8.pow(i))) * 3) >> 8) as u8;
    for i in 0..5 {
        for (l, &q) in b[..32].iter().enumerate() {
            u.code[32 * i + l] = digit(q, i as u32);
        }
        for (l, &q) in b[32..48].iter().enumerate() {
            u.code[160 + 16 * i + l] = digit(q, i as u32);
        }
    }
    for i in 0..4 {
        for l in 0..4 {
            u.code[240 + 4 * i + l] = digit(b[48 + l], i as u32);
        }
    }
}

/// IQ2_XXS and IQ3_XXS: per 32 elements, grid indices (4 bytes of 8 values, or 8 bytes of 4), then a u32 of 4 × 7
/// sign bits and a 4-bit scale in its top bits.
fn decode_xxs(fmt: QuantFormat, b: &[u8], u: &mut Unit) {
    let two = fmt == QuantFormat::Iq2Xxs;
    u.df = f16_at(b, 0) * if two { 0.125 } else { 0.25 };
    for g in 0..8 {
        let aux = if two {
            le32(b, 2 + 8 * g + 4)
        } else {
            le32(b, 66 + 4 * g)
        };
        u.sc[g] = 2 * (aux >> 28) as u8 + 1;
        for j in 0..4 {
            let signs = ksigns(aux >> (7 * j));
            let at = 32 * g + 8 * j;
            if two {
                put_iq2(
                    &mut u.code,
                    at,
                    &IQ2XXS_GRID,
                    usize::from(b[2 + 8 * g + j]),
                    signs,
                );
            } else {
                for h in 0..2 {
                    let row = usize::from(b[2 + 8 * g + 2 * j + h]);
                    put_iq3(&mut u.code, at + 4 * h, &IQ3XXS_GRID, row, signs, 4 * h);
                }
            }
        }
    }
}

/// The 16 four-bit IQ2_XS / IQ2_S scales (two per byte, low nibble first) as `2·ls + 1`.
fn iq_scales16(s: &[u8], u: &mut Unit) {
    for i in 0..16 {
        u.sc[i] = 2 * ((s[i / 2] >> (4 * (i % 2))) & 0xF) + 1;
    }
}

/// IQ1_M: its f16 `d` from the top nibbles of the 4 scale words, 3-bit scales per 16 (`2s + 1`), grid rows of 8
/// with 3 high index bits and a delta sign per nibble of `qh`.
fn decode_iq1m(b: &[u8], u: &mut Unit) {
    let sc = [0, 1, 2, 3].map(|w| le16(b, 48 + 2 * w));
    let bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000);
    u.df = half::f16::from_bits(bits).to_f32() * 0.125;
    for i in 0..16 {
        u.sc[i] = 2 * ((sc[i / 4] >> (3 * (i % 4))) & 7) as u8 + 1;
    }
    for k in 0..32 {
        let nib = (b[32 + k / 2] >> (4 * (k % 2))) & 0xF;
        let row = usize::from(b[k]) | (usize::from(nib & 7) << 8);
        put_iq1(&mut u.code, 8 * k, row, nib & 8 != 0);
    }
}

/// Reference dequantization of one block of a generic format into `y` (`fmt.block_elems()` values), through its
/// [`Unit`] and [`value`]: ggml's values, checked against gguf-py's on random blocks of every type.
pub(crate) fn dequant_generic(fmt: QuantFormat, b: &[u8], y: &mut [f32]) {
    let Some(s) = spec(fmt) else {
        return;
    };
    let u = decode_generic(fmt, b);
    for (e, v) in y.iter_mut().enumerate() {
        *v = value(s, &u, e);
    }
}
