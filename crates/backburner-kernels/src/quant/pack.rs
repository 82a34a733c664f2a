//! [`QuantMatrix`]: GGUF rows repacked once into panels of 16 outputs, their byte counts and row reads.

use rayon::prelude::*;

use super::format::{dequantize, QuantError, QuantFormat};
use super::spec::{spec, value};
use super::unit::{Lay, Unit};
use crate::hugebuf::HugeBuf;
use crate::matmul::PANEL;

/// Panels are allocated in groups of this many (the zero rows of the last group cost nothing but memory), so that
/// threads split whole groups, as in [`crate::matmul`].
pub(crate) const PANEL_GROUP: usize = 4;

/// One 64-byte aligned line of storage (the prefill kernel's decode buffer).
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(C, align(64))]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// A quantized weight matrix `W: [n, k]` (n outputs, k inputs) in its GGUF format, repacked once into panels of 16
/// rows for the kernels (see the [module docs](super) for the layout). Memory is about the GGUF bytes: the same
/// codes and scales, with Q4_K / Q5_K sub-block scales unpacked to bytes (+2.8 % / +2.3 %), IQ4_XS scales as bytes
/// (+1.5 %) and the zero rows of the last panel group.
#[derive(Clone, PartialEq)]
pub struct QuantMatrix {
    format: QuantFormat,
    n: usize,
    k: usize,
    n_panels: usize,
    panel_bytes: usize,
    data: HugeBuf,
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("format", &self.format)
            .field("n", &self.n)
            .field("k", &self.k)
            .field("bytes", &self.bytes())
            .finish_non_exhaustive()
    }
}

/// `(panels, bytes per panel, bytes allocated)` of an `[n, k]` matrix of `fmt`; `None` when `k` is not a whole
/// number of blocks or a size overflows.
fn sizes(fmt: QuantFormat, n: usize, k: usize) -> Option<(usize, usize, usize)> {
    let lay = Lay::of(fmt);
    if !k.is_multiple_of(lay.unit) {
        return None;
    }
    let n_panels = n.div_ceil(PANEL).div_ceil(PANEL_GROUP) * PANEL_GROUP;
    let panel_bytes = (k / lay.unit).checked_mul(lay.bytes)?;
    let total = n_panels
        .checked_mul(panel_bytes)?
        .checked_next_multiple_of(64)?;
    Some((n_panels, panel_bytes, total))
}

impl QuantMatrix {
    /// Packs the row-wise concatenation of `parts` (each `(bytes, rows)`: the GGUF data of a `[rows, k]` tensor of
    /// `fmt`, no alignment needed) into one `[Σ rows, k]` matrix, e.g. fused projections that read the same input.
    /// Runs on the current rayon pool.
    ///
    /// Errors: [`QuantError::RowLength`] when `k` is not a whole number of blocks, [`QuantError::PartLength`] when
    /// a part's bytes do not match its rows, [`QuantError::Overflow`], [`QuantError::NonFiniteScale`] naming the
    /// first block found whose scale is NaN or infinite. Never panics on malformed input.
    pub fn pack(fmt: QuantFormat, k: usize, parts: &[(&[u8], usize)]) -> Result<Self, QuantError> {
        let row_bytes = fmt
            .row_bytes(k)
            .ok_or(QuantError::RowLength { format: fmt, k })?;
        let mut starts = Vec::with_capacity(parts.len() + 1);
        let mut n = 0usize;
        for (part, &(bytes, rows)) in parts.iter().enumerate() {
            let expected = rows.checked_mul(row_bytes).ok_or(QuantError::Overflow)?;
            if bytes.len() != expected {
                return Err(QuantError::PartLength {
                    part,
                    rows,
                    expected,
                    found: bytes.len(),
                });
            }
            starts.push(n);
            n = n.checked_add(rows).ok_or(QuantError::Overflow)?;
        }
        let (n_panels, panel_bytes, total) = sizes(fmt, n, k).ok_or(QuantError::Overflow)?;
        let mut m = QuantMatrix {
            format: fmt,
            n,
            k,
            n_panels,
            panel_bytes,
            data: HugeBuf::zeroed(total),
        };
        if panel_bytes == 0 {
            return Ok(m);
        }
        let (lay, bb) = (Lay::of(fmt), fmt.block_bytes());
        let panels = &mut m.bytes_mut()[..n_panels * panel_bytes];
        panels
            .par_chunks_mut(panel_bytes)
            .enumerate()
            .try_for_each(|(p, panel)| {
                for l in 0..PANEL {
                    let r = p * PANEL + l;
                    if r >= n {
                        break;
                    }
                    let part = starts.partition_point(|&s| s <= r) - 1;
                    let row0 = (r - starts[part]) * row_bytes;
                    let row = &parts[part].0[row0..row0 + row_bytes];
                    let units = panel.chunks_exact_mut(lay.bytes);
                    for (block, (blk, unit)) in row.chunks_exact(bb).zip(units).enumerate() {
                        let u = Unit::from_gguf(fmt, blk);
                        if !u.scales_finite(fmt) {
                            return Err(QuantError::NonFiniteScale { row: r, block });
                        }
                        u.store(fmt, unit, l);
                    }
                }
                Ok(())
            })?;
        Ok(m)
    }

    /// Bytes [`QuantMatrix::pack`] allocates for an `[n, k]` matrix of `fmt` (the zero rows of the last panel group
    /// included), without packing it; `None` when `k` is not a whole number of blocks or the size overflows.
    pub fn packed_bytes(fmt: QuantFormat, n: usize, k: usize) -> Option<usize> {
        sizes(fmt, n, k).map(|s| s.2)
    }

    /// Outputs (rows of `W`).
    pub fn n(&self) -> usize {
        self.n
    }

    /// Inputs (columns of `W`).
    pub fn k(&self) -> usize {
        self.k
    }

    /// The stored format.
    pub fn format(&self) -> QuantFormat {
        self.format
    }

    /// Bytes of storage held (including the zero rows of the last panel group).
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Panels allocated (a multiple of 4).
    pub(crate) fn n_panels(&self) -> usize {
        self.n_panels
    }

    /// Bytes of one panel (16 rows × k).
    pub(crate) fn panel_bytes(&self) -> usize {
        self.panel_bytes
    }

    /// The storage as bytes ([`QuantMatrix::bytes`] of them, in the panel layout): what a decode product streams, for
    /// a plain read of the same memory (e.g. a read-bandwidth pass).
    pub fn as_bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.data.as_mut_slice()
    }

    /// Row `r` as the GGUF bytes it was packed from (`fmt.row_bytes(k)` bytes) into `out`, for the formats with a
    /// panel layout of their own; `false` (`out` untouched) for the generic ones, which are not re-encoded.
    ///
    /// Panics if `r >= n` or `out` has another length.
    pub fn gguf_row_into(&self, r: usize, out: &mut [u8]) -> bool {
        assert!(r < self.n, "gguf_row_into: row {r} of {}", self.n);
        let fmt = self.format;
        let (lay, bb) = (Lay::of(fmt), fmt.block_bytes());
        assert_eq!(
            Some(out.len()),
            fmt.row_bytes(self.k),
            "gguf_row_into: out is not one row"
        );
        if spec(fmt).is_some() {
            return false;
        }
        if self.k == 0 {
            return true;
        }
        let panel = &self.as_bytes()[(r / PANEL) * self.panel_bytes..][..self.panel_bytes];
        for (unit, blk) in panel.chunks_exact(lay.bytes).zip(out.chunks_exact_mut(bb)) {
            Unit::load(fmt, unit, r % PANEL).to_gguf(fmt, blk);
        }
        true
    }

    /// Row `r` of `W` dequantized into `out` (`[k]`): bit-identical to [`dequantize`] of the row's GGUF bytes (the
    /// embedding lookup of a quantized table).
    ///
    /// Panics if `r >= n` or `out.len() != k`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.n, "row_into: row {r} of {}", self.n);
        assert_eq!(out.len(), self.k, "row_into: out is not [k]");
        let fmt = self.format;
        let (lay, bb) = (Lay::of(fmt), fmt.block_bytes());
        if self.k == 0 {
            return;
        }
        let mut blk = [0u8; 256];
        let panel = &self.as_bytes()[(r / PANEL) * self.panel_bytes..][..self.panel_bytes];
        for (unit, y) in panel
            .chunks_exact(lay.bytes)
            .zip(out.chunks_exact_mut(lay.unit))
        {
            let u = Unit::load(fmt, unit, r % PANEL);
            if let Some(s) = spec(fmt) {
                y.iter_mut()
                    .enumerate()
                    .for_each(|(e, v)| *v = value(s, &u, e));
            } else {
                u.to_gguf(fmt, &mut blk[..bb]);
                dequantize(fmt, &blk[..bb], y).expect("one whole block");
            }
        }
    }

    /// The whole matrix dequantized, row-major `[n, k]` (tests and reference paths).
    pub fn to_f32_rows(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.n * self.k];
        if self.k > 0 {
            for (r, row) in out.chunks_exact_mut(self.k).enumerate() {
                self.row_into(r, row);
            }
        }
        out
    }
}
