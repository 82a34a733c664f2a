//! The linear-layer type: a projection's weight matrix kept in its checkpoint dtype (f32, bf16 or f16), packed
//! once for the product kernels ([`backburner_kernels::matmul`]). No f32 copy of bf16/f16 weights is made: the
//! memory held is the checkpoint's bytes (plus at most 3 zero panels of padding).

use backburner_kernels::matmul::{matmul, PackedMatrix, RowMajor, WeightDtype};
use backburner_kernels::profile::{self, Op};

use crate::checkpoint::Checkpoint;
use crate::error::{ModelError, Result};

/// `y = x · Wᵀ` with `W: [out_features, in_features]` (no bias: Qwen3.5 projections have none).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    w: PackedMatrix,
}

impl Linear {
    /// Wraps a packed matrix.
    pub fn new(w: PackedMatrix) -> Self {
        Linear { w }
    }

    /// Loads the row-wise concatenation of the named `[rows_i, in_features]` tensors as one layer (fused
    /// projections that read the same input), keeping their dtype (f32 if the parts' dtypes differ), then lets the
    /// OS drop the mapped file pages it read from resident memory.
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`];
    /// [`ModelError::InvalidConfig`] if the sizes overflow.
    pub fn load(ck: &Checkpoint, in_features: usize, parts: &[(String, usize)]) -> Result<Self> {
        let raw: Vec<RowMajor> = parts
            .iter()
            .map(|(name, rows)| ck.weight_part(name, *rows, in_features))
            .collect::<Result<_>>()?;
        let w = PackedMatrix::pack(in_features, &raw, WeightDtype::common(&raw))
            .map_err(|e| ModelError::InvalidConfig(format!("packing {}: {e}", parts[0].0)))?;
        for (name, _) in parts {
            ck.release(name);
        }
        Ok(Linear { w })
    }

    /// Outputs per row (`W`'s rows).
    pub fn out_features(&self) -> usize {
        self.w.n()
    }

    /// Inputs per row (`W`'s columns).
    pub fn in_features(&self) -> usize {
        self.w.k()
    }

    /// The stored dtype.
    pub fn dtype(&self) -> WeightDtype {
        self.w.dtype()
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        self.w.bytes()
    }

    /// `x [n_rows, in] → [n_rows, out]` f32, charged to [`Op::Matmul`] in the profile.
    pub fn forward(&self, x: &[f32], n_rows: usize) -> Vec<f32> {
        self.forward_as(Op::Matmul, x, n_rows)
    }

    /// As [`Linear::forward`], charged to `op` (e.g. [`Op::Head`]).
    ///
    /// Panics if `x.len() != n_rows · in_features`.
    pub fn forward_as(&self, op: Op, x: &[f32], n_rows: usize) -> Vec<f32> {
        let mut y = Vec::new();
        self.forward_into_as(op, x, n_rows, &mut y);
        y
    }

    /// As [`Linear::forward`], into `y` (resized to `[n_rows, out]`; its capacity is reused).
    pub fn forward_into(&self, x: &[f32], n_rows: usize, y: &mut Vec<f32>) {
        self.forward_into_as(Op::Matmul, x, n_rows, y);
    }

    fn forward_into_as(&self, op: Op, x: &[f32], n_rows: usize, y: &mut Vec<f32>) {
        let _s = profile::scope(op);
        y.resize(n_rows * self.w.n(), 0.0);
        matmul(x, n_rows, &self.w, y);
        let macs = (n_rows * self.w.n() * self.w.k()) as u64;
        profile::add_work(op, 2 * macs, self.w.bytes() as u64);
    }

    /// Row `r` of `W` as f32 (the embedding lookup when the table is tied to the head).
    ///
    /// Panics if `r >= out_features` or `out.len() != in_features`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.w.row_into(r, out);
    }
}
