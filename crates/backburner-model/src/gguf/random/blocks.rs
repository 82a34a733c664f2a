//! Random valid blocks of every ggml storage type the generator writes.
//!
//! A quantized block is random bytes (codes, sign indices, grid indices and sub-scales are all valid for any bit
//! pattern), then its super-block scale is overwritten with a finite, positive f16 `d` chosen so that the
//! dequantized values have about the requested RMS, jittered by a factor in [0.75, 1.25) per block (so a kernel that
//! reads the wrong block's scale gives other numbers). The K-quants' `dmin` and Q4_1 / Q5_1's `m` are set from `d` so
//! that the values are centred on 0. TQ2_0's 2-bit codes are drawn from {0, 1, 2} (3 would be +2, outside the
//! ternary set). MXFP4 gets an e8m0 exponent byte instead of an f16.
//!
//! The RMS per unit of `d` ([`Quant::rms`]) is exact for random codes where the formula needs no lookup table other
//! than IQ4_NL's, and an estimate from the grids' value sets for the grid types (IQ1_*, IQ2_*, IQ3_*): within a few
//! tens of percent.

use backburner_kernels::quant::IQ4_VALUES;
use half::{bf16, f16};

use crate::gguf::GgmlType;
use crate::synthetic::SplitMix;

/// Where a block keeps its super-block scale.
#[derive(Clone, Copy, Debug)]
enum Scale {
    /// A little-endian f16 `d` at this byte offset.
    F16(usize),
    /// IQ1_M: the f16 `d` split over the top nibbles of the four u16 words of the block's last 8 bytes (word `i`
    /// holds bits `4i..4i+4`).
    Iq1m,
    /// MXFP4: one e8m0 exponent byte at offset 0 (the block's scale is `2^(e − 128)` times the table values).
    E8m0,
}

/// How to make random blocks of one quantized type.
#[derive(Clone, Copy, Debug)]
pub(super) struct Quant {
    scale: Scale,
    /// `(offset, ratio)`: a second f16 written as `ratio · d` (Q4_1 / Q5_1's min, the K-quants' `dmin`).
    min: Option<(usize, f64)>,
    /// RMS of the dequantized values per unit of `d` with random codes and sub-scales.
    pub(super) rms: f64,
    /// Byte range of 2-bit codes to draw from {0, 1, 2} (TQ2_0).
    trits: Option<(usize, usize)>,
}

/// Mean of the squared IQ4_NL / IQ4_XS table values.
fn iq4_mean_sq() -> f64 {
    IQ4_VALUES
        .iter()
        .map(|&v| f64::from(v).powi(2))
        .sum::<f64>()
        / IQ4_VALUES.len() as f64
}

/// `E[(0.5 + ls)²]` for a random 4-bit `ls` (the IQ2 / IQ3_XXS block scale).
const HALF_PLUS_LS4_SQ: f64 = 85.25;
/// Estimated mean square of the IQ2 grids' values ({8, 25, 43}, small ones the most frequent).
const IQ2_GRID_SQ: f64 = 560.0;
/// Estimated mean square of the IQ3_XXS grid's values ({4, 12, …, 62}).
const IQ3XXS_GRID_SQ: f64 = 700.0;
/// Estimated mean square of the IQ3_S grid's values ({1, 3, …, 15}).
const IQ3S_GRID_SQ: f64 = 50.0;
/// `E[(2·ls + 1)²]` for a random 3-bit `ls` times the estimated mean square of `grid ± 1/8`, grid in {−1, 0, 1}
/// (IQ1_S, IQ1_M).
const IQ1_SQ: f64 = 85.0 * 0.62;
/// Mean square of the MXFP4 (e2m1) table values {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12}.
const MXFP4_SQ: f64 = 34.25;

/// The recipe of a quantized type; `None` for float types and types without one (Q8_K, unknown ids).
pub(super) fn quant(t: GgmlType) -> Option<Quant> {
    use GgmlType::*;
    let q = |at: usize, rms_sq: f64| Quant {
        scale: Scale::F16(at),
        min: None,
        rms: rms_sq.sqrt(),
        trits: None,
    };
    let with_min = |at: usize, ratio: f64, rms_sq: f64| Quant {
        min: Some((at, ratio)),
        ..q(0, rms_sq)
    };
    Some(match t {
        // d·(q − 8), q in 0..16
        Q4_0 => q(0, 21.5),
        // d·q + m, m = −7.5·d: (q − 7.5)·d
        Q4_1 => with_min(2, -7.5, 255.0 / 12.0),
        // d·(q − 16), q in 0..32
        Q5_0 => q(0, 85.5),
        Q5_1 => with_min(2, -15.5, 1023.0 / 12.0),
        // d·q, q an i8
        Q8_0 => q(0, 5461.5),
        // d·sc·q − dmin·m with sc, m in 0..16, q in 0..4; dmin = 1.5·d centres it
        Q2K => Quant {
            scale: Scale::F16(80),
            min: Some((82, 1.5)),
            ..q(80, 192.5)
        },
        // d·(sc − 32)·q, sc in 0..64, q in −4..4
        Q3K => q(108, 341.5 * 5.5),
        // d·sc·q − dmin·m, sc and m in 0..64; q in 0..16 (Q4_K) or 0..32 (Q5_K)
        Q4K => with_min(2, 7.5, 66_727.5),
        Q5K => with_min(2, 15.5, 277_651.5),
        // d·sc·(q − 32), sc an i8, q in 0..64
        Q6K => q(208, 5461.5 * 341.5),
        // d·(0.5 + ls)·{1/4, 1/2}·grid·sign
        Iq2Xxs | Iq2Xs | Iq2S => q(0, HALF_PLUS_LS4_SQ * 0.0625 * IQ2_GRID_SQ),
        Iq3Xxs => q(0, HALF_PLUS_LS4_SQ * 0.25 * IQ3XXS_GRID_SQ),
        // d·(1 + 2·ls)·grid·sign, ls in 0..16
        Iq3S => q(0, 341.0 * IQ3S_GRID_SQ),
        Iq1S => q(0, IQ1_SQ),
        Iq1M => Quant {
            scale: Scale::Iq1m,
            ..q(0, IQ1_SQ)
        },
        // d·table[q]; IQ4_XS: d·(ls − 32)·table[q], ls in 0..64
        Iq4Nl => q(0, iq4_mean_sq()),
        Iq4Xs => q(0, 341.5 * iq4_mean_sq()),
        // d·(t − 1), t in {0, 1, 2}
        Tq1_0 => q(52, 2.0 / 3.0),
        Tq2_0 => Quant {
            trits: Some((0, 64)),
            ..q(64, 2.0 / 3.0)
        },
        Mxfp4 => Quant {
            scale: Scale::E8m0,
            ..q(0, MXFP4_SQ)
        },
        _ => return None,
    })
}

/// Fills `out` with random bytes.
pub(super) fn fill_random(out: &mut [u8], rng: &mut SplitMix) {
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let b = rng.next_u64().to_le_bytes();
        rest.copy_from_slice(&b[..rest.len()]);
    }
}

/// `x` as a finite f16 of the same sign that is never zero: values past the f16 range become ±65504, values that
/// round to zero the smallest subnormal.
fn nonzero_f16(x: f64) -> f16 {
    let h = f16::from_f64(x.abs());
    let h = if !h.is_finite() {
        f16::MAX
    } else if h == f16::ZERO {
        f16::from_bits(1)
    } else {
        h
    };
    if x < 0.0 {
        -h
    } else {
        h
    }
}

fn put_f16(b: &mut [u8], at: usize, h: f16) {
    b[at..at + 2].copy_from_slice(&h.to_le_bytes());
}

/// The MXFP4 exponent byte whose blocks have an RMS of at most `std` and more than half of it.
fn mxfp4_exponent(std: f64) -> u8 {
    let e = (128.0 + (std / MXFP4_SQ.sqrt()).log2()).ceil();
    e.clamp(1.0, 254.0) as u8
}

/// Fills `out` (whole blocks of `t`, whose recipe is `q`) with random blocks whose dequantized values have an RMS
/// of about `std`.
pub(super) fn fill_quant(t: GgmlType, q: &Quant, out: &mut [u8], std: f64, rng: &mut SplitMix) {
    let (_, bytes) = t.block().expect("a quantized type with a block size");
    let d0 = std / q.rms;
    let e0 = mxfp4_exponent(std);
    for b in out.chunks_exact_mut(bytes) {
        fill_random(b, rng);
        if let Some((from, to)) = q.trits {
            for byte in &mut b[from..to] {
                let v = rng.next_u64();
                *byte = (0..4).fold(0u8, |acc, k| {
                    let t = (((v >> (16 * k)) & 0xffff) * 3) >> 16;
                    acc | ((t as u8) << (2 * k))
                });
            }
        }
        let d = nonzero_f16(d0 * (0.75 + 0.5 * rng.uniform()));
        match q.scale {
            Scale::F16(at) => put_f16(b, at, d),
            Scale::Iq1m => {
                let bits = d.to_bits();
                let base = bytes - 8;
                for i in 0..4 {
                    let at = base + 2 * i;
                    let w = u16::from_le_bytes([b[at], b[at + 1]]);
                    let w = (w & 0x0fff) | (((bits >> (4 * i)) & 0xf) << 12);
                    b[at..at + 2].copy_from_slice(&w.to_le_bytes());
                }
            }
            Scale::E8m0 => b[0] = e0 - (rng.next_u64() & 1) as u8,
        }
        if let Some((at, ratio)) = q.min {
            put_f16(b, at, nonzero_f16(ratio * d.to_f64()));
        }
    }
}

/// What a float tensor's values mean, as the GGUF file stores them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueMap {
    /// The drawn value itself.
    Plain,
    /// `1 + x`: an RMSNorm gain as llama.cpp's converter stores it.
    OnePlus,
    /// `−exp(x)`: the Gated DeltaNet decay `A` from `A_log`.
    NegExp,
}

/// How a tensor's values are drawn: `N(mean, std)`, then [`ValueMap`]ped (float types); quantized types get blocks
/// whose dequantized values have an RMS of `std` (their mean is about 0).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Draw {
    /// Mean of the normal draw.
    pub mean: f64,
    /// Standard deviation of the normal draw (the RMS of quantized blocks).
    pub std: f64,
    /// What the stored value is of the draw.
    pub map: ValueMap,
}

impl Draw {
    fn value(&self, z: f64) -> f64 {
        let x = self.mean + self.std * z;
        match self.map {
            ValueMap::Plain => x,
            ValueMap::OnePlus => 1.0 + x,
            ValueMap::NegExp => -x.exp(),
        }
    }
}

/// Fills `out` with values of float type `t` (F32, F16 or BF16) drawn as `draw` says (Box–Muller normals, both of
/// each pair used).
pub(super) fn fill_floats(t: GgmlType, out: &mut [u8], draw: &Draw, rng: &mut SplitMix) {
    let width = match t {
        GgmlType::F32 => 4,
        GgmlType::F16 | GgmlType::BF16 => 2,
        other => unreachable!("{other} is not a float type"),
    };
    let mut spare: Option<f64> = None;
    for c in out.chunks_exact_mut(width) {
        let z = spare.take().unwrap_or_else(|| {
            let (u1, u2) = (rng.uniform(), rng.uniform());
            let r = (-2.0 * u1.ln()).sqrt();
            let a = std::f64::consts::TAU * u2;
            spare = Some(r * a.sin());
            r * a.cos()
        });
        let v = draw.value(z);
        match t {
            GgmlType::F32 => c.copy_from_slice(&(v as f32).to_le_bytes()),
            GgmlType::F16 => c.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
            _ => c.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
        }
    }
}
