//! [`PackedMatrix`]: construction from row-major little-endian bytes, row gathers and byte counts.

use half::{bf16, f16};
use rayon::prelude::*;

use super::{Precision, PANEL};
use crate::hugebuf::HugeBuf;

/// Panels are allocated in groups of this many, so a kernel reading up to 4 panels at once stays in bounds.
pub(crate) const PANEL_GROUP: usize = 4;

/// Storage dtype of a weight matrix (of its elements as stored in a checkpoint, and as kept in memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightDtype {
    /// IEEE binary32.
    F32,
    /// bfloat16 (the top 16 bits of an f32).
    Bf16,
    /// IEEE binary16.
    F16,
}

impl WeightDtype {
    /// Bytes per element.
    pub fn size_of(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 | WeightDtype::F16 => 2,
        }
    }

    /// The dtype to keep a fused matrix in: the parts' dtype when they agree, else f32 (exact for all three).
    pub fn common(parts: &[RowMajor]) -> WeightDtype {
        match parts.first() {
            Some(p) if parts.iter().all(|q| q.dtype == p.dtype) => p.dtype,
            _ => WeightDtype::F32,
        }
    }
}

impl std::fmt::Display for WeightDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightDtype::F32 => "f32",
            WeightDtype::Bf16 => "bf16",
            WeightDtype::F16 => "f16",
        })
    }
}

/// A row-major `[rows, k]` matrix as little-endian bytes in `dtype` (e.g. a tensor's bytes in a memory-mapped
/// safetensors file; no alignment needed).
#[derive(Clone, Copy, Debug)]
pub struct RowMajor<'a> {
    /// Element dtype of `bytes`.
    pub dtype: WeightDtype,
    /// `rows · k · dtype.size_of()` bytes.
    pub bytes: &'a [u8],
    /// Rows (outputs).
    pub rows: usize,
}

/// Why a matrix could not be packed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PackError {
    /// A part's byte length is not `rows · k · size_of(dtype)`.
    #[error("part {part}: {got} bytes, expected {rows} rows × {k} × {size} bytes")]
    Length {
        /// Index of the part.
        part: usize,
        /// Bytes given.
        got: usize,
        /// Rows of the part.
        rows: usize,
        /// Inputs per row.
        k: usize,
        /// Bytes per element.
        size: usize,
    },
    /// The total size overflows `usize`.
    #[error("matrix size overflows")]
    Overflow,
}

/// The panels' elements, in [`HugeBuf`]s (huge pages on Linux: decode streams them).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Storage {
    /// f32 elements.
    F32(HugeBuf),
    /// bf16 or f16 bit patterns (see [`PackedMatrix::dtype`]).
    Half(HugeBuf),
    /// bf16 weights in k-pairs for the bf16-activation arithmetic ([`Precision::Bf16`]; layout in
    /// [`super::bf16`]): `n_panels · ⌈k/2⌉ · 16` u32.
    Pairs(HugeBuf),
}

/// A weight matrix `W: [n, k]` in panels of 16 outputs, in its dtype (see the [module docs](super)).
#[derive(Clone, Debug, PartialEq)]
pub struct PackedMatrix {
    n: usize,
    k: usize,
    n_panels: usize,
    dtype: WeightDtype,
    pub(crate) data: Storage,
}

impl PackedMatrix {
    /// Packs the row-wise concatenation of `parts` (each `[rows_i, k]`) into one `[Σ rows_i, k]` matrix stored in
    /// `dtype` (same dtype: the bits are kept; bf16/f16 → f32: exact; f32 → bf16/f16: rounded to nearest even).
    /// Parts are fused projections that read the same input (e.g. q|k|v). Runs on the current rayon pool.
    ///
    /// Errors: [`PackError::Length`] when a part's bytes do not match its shape, [`PackError::Overflow`].
    pub fn pack(k: usize, parts: &[RowMajor], dtype: WeightDtype) -> Result<Self, PackError> {
        Self::pack_with(k, parts, dtype, Precision::F32)
    }

    /// As [`PackedMatrix::pack`], for products in `precision`: [`Precision::Bf16`] with `dtype` bf16 packs the
    /// k-pair layout of the bf16-activation arithmetic ([`super::bf16`]); every other combination is
    /// [`PackedMatrix::pack`]'s (f32 and f16 weights keep the f32 arithmetic).
    ///
    /// Errors: as [`PackedMatrix::pack`].
    pub fn pack_with(
        k: usize,
        parts: &[RowMajor],
        dtype: WeightDtype,
        precision: Precision,
    ) -> Result<Self, PackError> {
        let (starts, n) = part_starts(k, parts)?;
        let n_panels = n.div_ceil(PANEL).div_ceil(PANEL_GROUP) * PANEL_GROUP;
        // The source of output row r: (part, row within the part).
        let locate = |r: usize| -> Option<(usize, usize)> {
            if r >= n {
                return None;
            }
            let part = starts.partition_point(|&s| s <= r) - 1;
            Some((part, r - starts[part]))
        };
        let data = fill_storage(k, parts, n_panels, &locate, dtype, precision)?;
        Ok(PackedMatrix {
            n,
            k,
            n_panels,
            dtype,
            data,
        })
    }

    /// Bytes [`PackedMatrix::pack`] allocates for an `[n, k]` matrix stored in `dtype` (the zero padding of the last
    /// panel group included), without packing it: what a loader must budget before it allocates. `None` when the
    /// size overflows `usize`.
    pub fn packed_bytes(n: usize, k: usize, dtype: WeightDtype) -> Option<usize> {
        Self::packed_bytes_with(n, k, dtype, Precision::F32)
    }

    /// [`PackedMatrix::packed_bytes`] of [`PackedMatrix::pack_with`] in `precision` (the k-pair layout pads an odd
    /// `k` by one input).
    pub fn packed_bytes_with(
        n: usize,
        k: usize,
        dtype: WeightDtype,
        precision: Precision,
    ) -> Option<usize> {
        let n_panels = n.div_ceil(PANEL).div_ceil(PANEL_GROUP) * PANEL_GROUP;
        let k = if pairs_for(dtype, precision) {
            k.div_ceil(2) * 2
        } else {
            k
        };
        n_panels
            .checked_mul(k)?
            .checked_mul(PANEL)?
            .checked_mul(dtype.size_of())
    }

    /// Packs a row-major f32 matrix `[n, k]` into `dtype` (rounding to nearest even for bf16/f16). For tests and
    /// synthetic weights.
    ///
    /// Panics if `w.len() != n · k`.
    pub fn from_f32(n: usize, k: usize, w: &[f32], dtype: WeightDtype) -> Self {
        assert_eq!(w.len(), n * k, "from_f32: w is not [n, k]");
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let part = RowMajor {
            dtype: WeightDtype::F32,
            bytes: &bytes,
            rows: n,
        };
        Self::pack(k, &[part], dtype).expect("lengths match")
    }

    /// Outputs (rows of `W`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Inputs (columns of `W`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// Storage dtype.
    pub fn dtype(&self) -> WeightDtype {
        self.dtype
    }

    /// The arithmetic of products against this matrix: [`Precision::Bf16`] for bf16 weights packed for it,
    /// [`Precision::F32`] otherwise.
    pub fn precision(&self) -> Precision {
        match self.data {
            Storage::Pairs(_) => Precision::Bf16,
            _ => Precision::F32,
        }
    }

    /// Panels allocated (a multiple of 4, ≥ `n / 16`).
    pub(crate) fn n_panels(&self) -> usize {
        self.n_panels
    }

    /// Bytes of storage held (including the zero padding of the last panels).
    pub fn bytes(&self) -> usize {
        match &self.data {
            Storage::F32(d) | Storage::Half(d) | Storage::Pairs(d) => d.len(),
        }
    }

    /// The storage as bytes ([`PackedMatrix::bytes`] of them, panel layout, native-endian elements): what a decode
    /// product streams, for a plain read of the same memory (e.g. a read-bandwidth pass).
    pub fn as_bytes(&self) -> &[u8] {
        match &self.data {
            Storage::F32(d) | Storage::Half(d) | Storage::Pairs(d) => d.as_slice(),
        }
    }

    /// Row `r` of `W` (`[k]`) widened to f32 into `out`: the embedding lookup of a tied or packed embedding table.
    ///
    /// Panics if `r >= n` or `out.len() != k`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.n, "row_into: row {r} of {}", self.n);
        assert_eq!(out.len(), self.k, "row_into: out is not [k]");
        let base = (r / PANEL) * self.k * PANEL + r % PANEL;
        match &self.data {
            Storage::F32(d) => {
                let d = d.view::<f32>();
                for (kk, o) in out.iter_mut().enumerate() {
                    *o = d[base + kk * PANEL];
                }
            }
            Storage::Half(d) => {
                let (d, widen) = (d.view::<u16>(), half_to_f32(self.dtype));
                for (kk, o) in out.iter_mut().enumerate() {
                    *o = widen(d[base + kk * PANEL]);
                }
            }
            Storage::Pairs(d) => {
                let (d, widen) = (d.view::<u16>(), half_to_f32(self.dtype));
                let base = (r / PANEL) * self.k.div_ceil(2) * 2 * PANEL + 2 * (r % PANEL);
                for (kk, o) in out.iter_mut().enumerate() {
                    *o = widen(d[base + (kk / 2) * 2 * PANEL + kk % 2]);
                }
            }
        }
    }

    /// The whole matrix as row-major f32 `[n, k]` (tests and reference paths).
    pub fn to_f32_rows(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.n * self.k];
        for (r, row) in out.chunks_mut(self.k.max(1)).enumerate().take(self.n) {
            self.row_into(r, row);
        }
        out
    }
}

/// The first output row of each part and the total rows, after checking each part's byte length.
fn part_starts(k: usize, parts: &[RowMajor]) -> Result<(Vec<usize>, usize), PackError> {
    let mut starts = Vec::with_capacity(parts.len() + 1);
    let mut n = 0usize;
    for (i, p) in parts.iter().enumerate() {
        let want = p
            .rows
            .checked_mul(k)
            .and_then(|e| e.checked_mul(p.dtype.size_of()))
            .ok_or(PackError::Overflow)?;
        if p.bytes.len() != want {
            return Err(PackError::Length {
                part: i,
                got: p.bytes.len(),
                rows: p.rows,
                k,
                size: p.dtype.size_of(),
            });
        }
        starts.push(n);
        n = n.checked_add(p.rows).ok_or(PackError::Overflow)?;
    }
    starts.push(n);
    Ok((starts, n))
}

/// The panel storage of `n_panels` panels of `parts` in `dtype` (k-pairs for [`Precision::Bf16`] bf16, k-major
/// otherwise), output row `r` from `locate(r)`.
fn fill_storage(
    k: usize,
    parts: &[RowMajor],
    n_panels: usize,
    locate: &(impl Fn(usize) -> Option<(usize, usize)> + Sync),
    dtype: WeightDtype,
    precision: Precision,
) -> Result<Storage, PackError> {
    let pairs = pairs_for(dtype, precision);
    // inputs per panel row in storage (an odd k padded by one in k-pairs)
    let kk = if pairs { k.div_ceil(2) * 2 } else { k };
    let len = n_panels
        .checked_mul(kk)
        .and_then(|e| e.checked_mul(PANEL))
        .and_then(|e| e.checked_mul(dtype.size_of()))
        .ok_or(PackError::Overflow)?;
    let mut d = HugeBuf::zeroed(len);
    let half = |from, b: &[u8]| read_half(from, b, dtype);
    Ok(match dtype {
        _ if pairs => {
            let pos = |kk: usize, l: usize| (kk / 2) * 2 * PANEL + 2 * l + kk % 2;
            fill_panels(d.view_mut::<u16>(), kk * PANEL, k, parts, locate, pos, half);
            Storage::Pairs(d)
        }
        WeightDtype::F32 => {
            fill_panels(
                d.view_mut::<f32>(),
                k * PANEL,
                k,
                parts,
                locate,
                k_major,
                read_f32,
            );
            Storage::F32(d)
        }
        WeightDtype::Bf16 | WeightDtype::F16 => {
            fill_panels(
                d.view_mut::<u16>(),
                k * PANEL,
                k,
                parts,
                locate,
                k_major,
                half,
            );
            Storage::Half(d)
        }
    })
}

/// Whether `precision` packs `dtype` weights in k-pairs.
fn pairs_for(dtype: WeightDtype, precision: Precision) -> bool {
    dtype == WeightDtype::Bf16 && precision == Precision::Bf16
}

/// The k-major position of input `kk`, lane `l` inside a panel.
fn k_major(kk: usize, l: usize) -> usize {
    kk * PANEL + l
}

/// Fills panel storage of `panel_len` elements per panel: output row `r` comes from row `locate(r)` of a part (zero
/// padding where `None`), each element converted from its bytes by `conv(part dtype, bytes)` and put at
/// `pos(input, lane)` in its panel.
fn fill_panels<T: Copy + Send>(
    d: &mut [T],
    panel_len: usize,
    k: usize,
    parts: &[RowMajor],
    locate: &(impl Fn(usize) -> Option<(usize, usize)> + Sync),
    pos: impl Fn(usize, usize) -> usize + Sync,
    conv: impl Fn(WeightDtype, &[u8]) -> T + Sync,
) {
    if k == 0 {
        return;
    }
    d.par_chunks_mut(panel_len)
        .enumerate()
        .for_each(|(p, panel)| {
            for l in 0..PANEL {
                let Some((part, row)) = locate(p * PANEL + l) else {
                    continue;
                };
                let src = &parts[part];
                let size = src.dtype.size_of();
                let bytes = &src.bytes[row * k * size..(row + 1) * k * size];
                for (kk, e) in bytes.chunks_exact(size).enumerate() {
                    panel[pos(kk, l)] = conv(src.dtype, e);
                }
            }
        });
}

/// One element's little-endian bytes in `from` as f32 (exact).
fn read_f32(from: WeightDtype, e: &[u8]) -> f32 {
    match from {
        WeightDtype::F32 => f32::from_le_bytes([e[0], e[1], e[2], e[3]]),
        WeightDtype::Bf16 => bf16::from_bits(u16::from_le_bytes([e[0], e[1]])).to_f32(),
        WeightDtype::F16 => f16::from_bits(u16::from_le_bytes([e[0], e[1]])).to_f32(),
    }
}

/// One element's little-endian bytes in `from` as the bits of `to` (bf16 or f16): kept when the dtypes agree,
/// else rounded to nearest even.
fn read_half(from: WeightDtype, e: &[u8], to: WeightDtype) -> u16 {
    if from == to {
        return u16::from_le_bytes([e[0], e[1]]);
    }
    let v = read_f32(from, e);
    match to {
        WeightDtype::Bf16 => bf16::from_f32(v).to_bits(),
        _ => f16::from_f32(v).to_bits(),
    }
}

/// The exact widening of bf16 or f16 bits to f32.
pub(crate) fn half_to_f32(dtype: WeightDtype) -> fn(u16) -> f32 {
    match dtype {
        WeightDtype::Bf16 => |b| f32::from_bits(u32::from(b) << 16),
        _ => |b| f16::from_bits(b).to_f32(),
    }
}

#[cfg(test)]
#[path = "pack_tests.rs"]
mod tests;
