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
}

/// The non-linear 4-bit codebook of IQ4_NL / IQ4_XS (`kvalues_iq4nl` in ggml-common.h).
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl QuantFormat {
    /// Every format, in ggml type-id order.
    pub const ALL: [QuantFormat; 6] = [
        QuantFormat::Q4_0,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
        QuantFormat::Iq4Xs,
    ];

    /// The format of ggml type id `t` (`GGML_TYPE_*`), `None` for types not supported here.
    pub fn from_ggml_type(t: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.ggml_type() == t)
    }

    /// The ggml type id (`GGML_TYPE_Q4_0` = 2, `Q8_0` = 8, `Q4_K` = 12, `Q5_K` = 13, `Q6_K` = 14, `IQ4_XS` = 23).
    pub fn ggml_type(self) -> u32 {
        match self {
            QuantFormat::Q4_0 => 2,
            QuantFormat::Q8_0 => 8,
            QuantFormat::Q4K => 12,
            QuantFormat::Q5K => 13,
            QuantFormat::Q6K => 14,
            QuantFormat::Iq4Xs => 23,
        }
    }

    /// ggml's name of the type ("Q8_0", "Q4_K", "IQ4_XS", ...).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "Q8_0",
            QuantFormat::Q4_0 => "Q4_0",
            QuantFormat::Q4K => "Q4_K",
            QuantFormat::Q5K => "Q5_K",
            QuantFormat::Q6K => "Q6_K",
            QuantFormat::Iq4Xs => "IQ4_XS",
        }
    }

    /// Elements per block (32 or 256).
    pub fn block_elems(self) -> usize {
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q4_0 => 32,
            _ => 256,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5K => 176,
            QuantFormat::Q6K => 210,
            QuantFormat::Iq4Xs => 136,
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
