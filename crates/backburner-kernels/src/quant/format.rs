//! The GGUF block formats: type ids, block sizes, errors and the reference dequantization (the oracle of the
//! kernels' tests).
//!
//! Block layouts and formulas from ggml (`ggml-common.h` for the structs, `ggml-quants.c` `dequantize_row_*` for
//! the element order and arithmetic); every multi-byte field is little-endian, f16 is IEEE binary16.

use half::f16;

/// A quantized weight format (a GGUF / ggml tensor type).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// 32 elements: f16 `d`, 32 × i8 `q`; `w = d·q`. 34 bytes.
    Q8_0,
    /// 32 elements: f16 `d`, 16 bytes of nibbles (element `j < 16` in the low nibble of byte `j`, `j ≥ 16` in the
    /// high nibble of byte `j − 16`); `w = d·(q − 8)`. 18 bytes.
    Q4_0,
    /// 256 elements: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32, 128 bytes of
    /// nibbles; `w = d·sc·q − dmin·m`. 144 bytes.
    Q4K,
    /// 256 elements: `d`, `dmin`, 12 scale bytes (as Q4_K), 32 bytes of fifth bits `qh`, 128 bytes of nibbles;
    /// `w = d·sc·q − dmin·m` with `q` in `0..32`. 176 bytes.
    Q5K,
    /// 256 elements: 128 bytes of low nibbles `ql`, 64 bytes of high bit pairs `qh`, 16 × i8 scales (one per 16
    /// elements), f16 `d`; `w = d·sc·(q − 32)`. 210 bytes.
    Q6K,
    /// 256 elements: f16 `d`, u16 `scales_h`, 4 bytes `scales_l` (a 6-bit scale `ls` per 32), 128 bytes of 4-bit
    /// indices; `w = d·(ls − 32)·IQ4_VALUES[q]`. 136 bytes.
    Iq4Xs,
    /// 32 elements: f16 `d`, f16 `m`, 16 bytes of nibbles (as Q4_0); `w = d·q + m`. 20 bytes.
    Q4_1,
    /// 32 elements: f16 `d`, u32 of fifth bits, 16 bytes of nibbles; `w = d·(q − 16)`. 22 bytes.
    Q5_0,
    /// 32 elements: f16 `d`, f16 `m`, u32 of fifth bits, 16 bytes of nibbles; `w = d·q + m`. 24 bytes.
    Q5_1,
    /// 256 elements: 16 bytes of 4-bit scales and mins (per 16), 64 bytes of 2-bit codes, f16 `d`, f16 `dmin`;
    /// `w = d·sc·q − dmin·m`. 84 bytes.
    Q2K,
    /// 256 elements: 32 bytes of high bits, 64 bytes of 2-bit low codes, 12 bytes of 6-bit scales (per 16), f16 `d`;
    /// `w = d·(sc − 32)·q` with `q` in `−4..4`. 110 bytes.
    Q3K,
    /// 256 elements: f16 `d`, 8 × (4 grid indices of 8 values, 4 × 7 sign bits, a 4-bit scale); 66 bytes.
    Iq2Xxs,
    /// 256 elements: f16 `d`, 32 × u16 (9-bit grid index of 8 values, 7 sign bits), 8 bytes of 4-bit scales (per
    /// 16); 74 bytes.
    Iq2Xs,
    /// 256 elements: f16 `d`, 64 grid indices of 4 values, 8 × u32 (4 × 7 sign bits, 4-bit scale); 98 bytes.
    Iq3Xxs,
    /// 256 elements: f16 `d`, 32 low index bytes, 8 × u16 (4 × 3 high index bits, 3-bit scale, delta sign) over an
    /// 11-bit grid of 8 ternary values; 50 bytes.
    Iq1S,
    /// 32 elements: f16 `d`, 16 bytes of 4-bit indices into [`IQ4_VALUES`]; `w = d·IQ4_VALUES[q]`. 18 bytes.
    Iq4Nl,
    /// 256 elements: f16 `d`, 64 low index bytes, 8 bytes of ninth index bits, 32 bytes of signs, 4 bytes of 4-bit
    /// scales (per 32) over a 9-bit grid of 4 values; 110 bytes.
    Iq3S,
    /// 256 elements: f16 `d`, 32 low index bytes, 32 bytes of signs, 8 bytes of high index bits, 8 bytes of 4-bit
    /// scales (per 16) over a 10-bit grid of 8 values; 82 bytes.
    Iq2S,
    /// 256 elements: 32 low index bytes, 16 bytes of high index bits and delta signs, 4 × u16 of 3-bit scales (per
    /// 16) whose top nibbles make up the f16 `d`; 56 bytes.
    Iq1M,
    /// 256 elements: 48 + 4 bytes of base-3 packed ternary codes (5 and 4 per byte), f16 `d`; `w = d·(q − 1)`. 54 bytes.
    Tq1_0,
    /// 256 elements: 64 bytes of 2-bit codes, f16 `d`; `w = d·(q − 1)`. 66 bytes.
    Tq2_0,
    /// 32 elements: an E8M0 exponent byte `e`, 16 bytes of 4-bit E2M1 codes; `w = 2^(e − 128)·kvalue[q]` (ggml's
    /// doubled table). 17 bytes.
    Mxfp4,
}

/// The non-linear 4-bit codebook of IQ4_NL / IQ4_XS (`kvalues_iq4nl` in ggml-common.h).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl QuantFormat {
    /// Every format, in ggml type-id order.
    pub const ALL: [QuantFormat; 22] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q2K,
        QuantFormat::Q3K,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
        QuantFormat::Iq2Xxs,
        QuantFormat::Iq2Xs,
        QuantFormat::Iq3Xxs,
        QuantFormat::Iq1S,
        QuantFormat::Iq4Nl,
        QuantFormat::Iq3S,
        QuantFormat::Iq2S,
        QuantFormat::Iq4Xs,
        QuantFormat::Iq1M,
        QuantFormat::Tq1_0,
        QuantFormat::Tq2_0,
        QuantFormat::Mxfp4,
    ];

    /// The format of ggml type id `t` (`GGML_TYPE_*`), `None` for types not supported here.
    pub fn from_ggml_type(t: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml_type() == t)
    }

    /// The ggml type id (`GGML_TYPE_*`: Q4_0 = 2, Q8_0 = 8, Q4_K = 12, IQ4_XS = 23, MXFP4 = 39, ...).
    pub const fn ggml_type(self) -> u32 {
        self.props().0
    }

    /// (ggml type id, name, elements per block, bytes per block).
    const fn props(self) -> (u32, &'static str, usize, usize) {
        use QuantFormat as F;
        match self {
            F::Q4_0 => (2, "Q4_0", 32, 18),
            F::Q4_1 => (3, "Q4_1", 32, 20),
            F::Q5_0 => (6, "Q5_0", 32, 22),
            F::Q5_1 => (7, "Q5_1", 32, 24),
            F::Q8_0 => (8, "Q8_0", 32, 34),
            F::Q2K => (10, "Q2_K", 256, 84),
            F::Q3K => (11, "Q3_K", 256, 110),
            F::Q4K => (12, "Q4_K", 256, 144),
            F::Q5K => (13, "Q5_K", 256, 176),
            F::Q6K => (14, "Q6_K", 256, 210),
            F::Iq2Xxs => (16, "IQ2_XXS", 256, 66),
            F::Iq2Xs => (17, "IQ2_XS", 256, 74),
            F::Iq3Xxs => (18, "IQ3_XXS", 256, 98),
            F::Iq1S => (19, "IQ1_S", 256, 50),
            F::Iq4Nl => (20, "IQ4_NL", 32, 18),
            F::Iq3S => (21, "IQ3_S", 256, 110),
            F::Iq2S => (22, "IQ2_S", 256, 82),
            F::Iq4Xs => (23, "IQ4_XS", 256, 136),
            F::Iq1M => (29, "IQ1_M", 256, 56),
            F::Tq1_0 => (34, "TQ1_0", 256, 54),
            F::Tq2_0 => (35, "TQ2_0", 256, 66),
            F::Mxfp4 => (39, "MXFP4", 32, 17),
        }
    }

    /// ggml's name of the type ("Q8_0", "Q4_K", "IQ4_XS", ...).
    pub fn name(self) -> &'static str {
        self.props().1
    }

    /// Elements per block (32 or 256).
    pub fn block_elems(self) -> usize {
        self.props().2
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.props().3
    }

    /// Writes the block-level scales of one GGUF block of this format (`block.len() == self.block_bytes()`): `d` into
    /// its f16 `d` field, and `dmin` into its second f16 field where it has one (Q4_1 / Q5_1 `m`, Q2_K / Q4_K / Q5_K
    /// `dmin`); IQ1_M's `d` goes into the top nibbles of its 4 scale words, MXFP4's E8M0 exponent is the one of
    /// `|d|` (its sign dropped). Sub-block scales and codes are left as they are. For making valid random blocks
    /// (tests, the random-weight GGUF generator).
    pub fn write_scales(self, block: &mut [u8], d: f16, dmin: f16) {
        use QuantFormat as F;
        let mut put =
            |at: usize, v: f16| block[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
        match self {
            F::Q4_1 | F::Q5_1 | F::Q4K | F::Q5K => {
                put(0, d);
                put(2, dmin);
            }
            F::Q2K => {
                put(80, d);
                put(82, dmin);
            }
            F::Q3K => put(108, d),
            F::Q6K => put(208, d),
            F::Tq1_0 => put(52, d),
            F::Tq2_0 => put(64, d),
            F::Iq1M => {
                let bits = d.to_bits();
                for w in 0..4 {
                    let at = 48 + 2 * w;
                    let old = u16::from_le_bytes([block[at], block[at + 1]]) & 0x0FFF;
                    let v = old | (((bits >> (4 * w)) & 0xF) << 12);
                    block[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            F::Mxfp4 => {
                // 2^(e − 128) with the exponent of |d|: f32 biased exponent + 1.
                let e = ((d.to_f32().abs().to_bits() >> 23) & 0xFF) + 1;
                block[0] = e.clamp(2, 254) as u8;
            }
            _ => put(0, d),
        }
    }

    /// Bytes of a row of `k` elements; `None` unless `k` is a multiple of [`QuantFormat::block_elems`] (or the
    /// size overflows).
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        if !k.is_multiple_of(self.block_elems()) {
            return None;
        }
        (k / self.block_elems()).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why quantized data could not be read.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    /// A row length that is not a whole number of blocks.
    #[error("{format}: a row of {k} elements is not a whole number of {} -element blocks", format.block_elems())]
    RowLength {
        /// The format.
        format: QuantFormat,
        /// Elements per row.
        k: usize,
    },
    /// Bytes that do not match the number of elements.
    #[error("{expected} bytes expected, {found} given")]
    ByteLength {
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes given.
        found: usize,
    },
    /// A part of a fused matrix whose bytes do not match its rows.
    #[error("part {part}: {found} bytes, expected {expected} ({rows} rows)")]
    PartLength {
        /// Index of the part.
        part: usize,
        /// Rows of the part.
        rows: usize,
        /// Bytes its shape needs.
        expected: usize,
        /// Bytes given.
        found: usize,
    },
    /// The matrix size overflows `usize`.
    #[error("matrix size overflows")]
    Overflow,
    /// A block whose scale (`d`, `dmin`, MXFP4's exponent, …) is NaN or infinite: every product it enters would be.
    #[error("row {row}, block {block}: a non-finite scale (NaN or infinity)")]
    NonFiniteScale {
        /// Row of the matrix (across its parts).
        row: usize,
        /// Block of the row.
        block: usize,
    },
}

/// Reference dequantization of whole blocks of `fmt` (`bytes`, e.g. one row of a GGUF tensor) into `out` (f32, one
/// element per weight, `out.len()` a multiple of the block size and `bytes.len()` the matching byte count), with
/// ggml's formulas in their written order (`dequantize_row_*`; no fused multiply-add): the oracle of the kernels.
///
/// Errors: [`QuantError::RowLength`] if `out.len()` is not a whole number of blocks, [`QuantError::ByteLength`] if
/// `bytes` has the wrong length. Never panics.
pub fn dequantize(fmt: QuantFormat, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    let (be, bb) = (fmt.block_elems(), fmt.block_bytes());
    let expected = fmt.row_bytes(out.len()).ok_or(QuantError::RowLength {
        format: fmt,
        k: out.len(),
    })?;
    if bytes.len() != expected {
        return Err(QuantError::ByteLength {
            expected,
            found: bytes.len(),
        });
    }
    for (b, y) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
        match fmt {
            QuantFormat::Q8_0 => dequant_q8_0(b, y),
            QuantFormat::Q4_0 => dequant_q4_0(b, y),
            QuantFormat::Q4K => dequant_q4_k(b, y),
            QuantFormat::Q5K => dequant_q5_k(b, y),
            QuantFormat::Q6K => dequant_q6_k(b, y),
            QuantFormat::Iq4Xs => dequant_iq4_xs(b, y),
            other => super::decode::dequant_generic(other, b, y),
        }
    }
    Ok(())
}

/// The f16 at `b[at..at + 2]` as f32 (exact).
#[inline]
pub(crate) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Scale and min `j` (`0..8`) of the 12 packed 6-bit bytes of Q4_K / Q5_K (`get_scale_min_k4`): `j < 4` in the low
/// 6 bits of bytes `j` and `j + 4`; `j ≥ 4` as a low nibble in byte `j + 4` and 2 high bits from the top of bytes
/// `j − 4` (scale) and `j` (min).
pub fn k_scale_min(q: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The inverse of [`k_scale_min`]: packs 8 scales and 8 mins (each `< 64`) into 12 bytes.
pub fn k_pack_scale_min(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

fn dequant_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, v) in y.iter_mut().enumerate() {
        *v = f32::from(b[2 + j] as i8) * d;
    }
}

fn dequant_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for j in 0..16 {
        let q = b[2 + j];
        y[j] = (i32::from(q & 0xF) - 8) as f32 * d;
        y[j + 16] = (i32::from(q >> 4) - 8) as f32 * d;
    }
}

fn dequant_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for j in 0..4 {
        let q = &qs[32 * j..32 * j + 32];
        let (s1, m1) = k_scale_min(scales, 2 * j);
        let (s2, m2) = k_scale_min(scales, 2 * j + 1);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        for l in 0..32 {
            y[64 * j + l] = d1 * f32::from(q[l] & 0xF) - m1;
            y[64 * j + 32 + l] = d2 * f32::from(q[l] >> 4) - m2;
        }
    }
}

fn dequant_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for j in 0..4 {
        let ql = &qs[32 * j..32 * j + 32];
        let (u1, u2) = (1u8 << (2 * j), 2u8 << (2 * j));
        let (s1, m1) = k_scale_min(scales, 2 * j);
        let (s2, m2) = k_scale_min(scales, 2 * j + 1);
        let (d1, m1) = (d * f32::from(s1), dmin * f32::from(m1));
        let (d2, m2) = (d * f32::from(s2), dmin * f32::from(m2));
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * j + l] = d1 * f32::from((ql[l] & 0xF) + h1) - m1;
            y[64 * j + 32 + l] = d2 * f32::from((ql[l] >> 4) + h2) - m2;
        }
    }
}

fn dequant_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = |i: usize| f32::from(b[192 + 8 * n + i] as i8);
        let y = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc(is) * q1 as f32;
            y[l + 32] = d * sc(is + 2) * q2 as f32;
            y[l + 64] = d * sc(is + 4) * q3 as f32;
            y[l + 96] = d * sc(is + 6) * q4 as f32;
        }
    }
}

fn dequant_iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for ib in 0..8 {
        let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF)
            | ((((scales_h >> (2 * ib)) & 3) as u8) << 4);
        let dl = d * (i32::from(ls) - 32) as f32;
        for j in 0..16 {
            let q = qs[16 * ib + j];
            y[32 * ib + j] = dl * f32::from(IQ4_VALUES[usize::from(q & 0xF)]);
            y[32 * ib + 16 + j] = dl * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
        }
    }
}
