//! The linear-layer type: a projection's weight matrix kept in its stored format, packed once for the product
//! kernels. Dense weights (f32, bf16, f16) go to [`backburner_kernels::matmul`]; GGUF block formats (Q8_0, Q4_0,
//! Q4_K, Q5_K, Q6_K, IQ4_XS) to [`backburner_kernels::quant`], which multiplies with the activations quantized per
//! row in blocks of 32 (as llama.cpp does). No f32 copy of the weights is made: the memory held is about the file's
//! bytes.
//!
//! A fused projection (several tensors read by the same input, concatenated by rows) whose parts differ in format
//! is held as consecutive segments, each computing its own range of output columns.

use std::cell::RefCell;
use std::ops::Range;

use backburner_kernels::matmul::{matmul, PackedMatrix, Precision, RowMajor, WeightDtype};
use backburner_kernels::profile::{self, Op};
use backburner_kernels::quant::{
    qmatmul_parts, qmatmul_swiglu, QuantFormat, QuantMatrix, QuantizedActs,
};
use backburner_kernels::rowops;

use crate::checkpoint::{Checkpoint, WeightPart};
use crate::error::{ModelError, Result};

/// What a linear layer's weights are stored as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearFormat {
    /// Dense f32, bf16 or f16.
    Dense(WeightDtype),
    /// One GGUF block format.
    Quant(QuantFormat),
    /// Parts in different formats.
    Mixed,
}

#[derive(Clone, Debug, PartialEq)]
enum Segment {
    Dense(PackedMatrix),
    Quant(QuantMatrix),
}

impl Segment {
    fn n(&self) -> usize {
        match self {
            Segment::Dense(w) => w.n(),
            Segment::Quant(w) => w.n(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Segment::Dense(w) => w.bytes(),
            Segment::Quant(w) => w.bytes(),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Segment::Dense(w) => w.as_bytes(),
            Segment::Quant(w) => w.as_bytes(),
        }
    }
}

/// One segment of a [`Linear`] as a compute backend reads it to upload it
/// ([`crate::device::Backend::upload_matrix`]): a dense matrix (rows through [`PackedMatrix::row_into`]) or a block
/// format (rows as their GGUF bytes through [`QuantMatrix::gguf_row_into`], or dequantized).
#[derive(Clone, Copy, Debug)]
pub enum LinearPart<'a> {
    /// Dense f32, bf16 or f16.
    Dense(&'a PackedMatrix),
    /// One GGUF block format.
    Quant(&'a QuantMatrix),
}

/// `y = x · Wᵀ` with `W: [out_features, in_features]` (no bias: Qwen3.5 projections have none).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    /// Segments in output-column order, with their first column.
    segs: Vec<(usize, Segment)>,
    k: usize,
}

thread_local! {
    /// The quantized activations of the last product on this thread (reused buffer).
    static ACTS: RefCell<QuantizedActs> = RefCell::new(QuantizedActs::new());
}

/// One stored tensor of a fused projection: its name, its rows, and the rows the projection reads from it, in
/// order (`None`: all, as stored).
pub type PartSpec = (String, usize, Option<Vec<Range<usize>>>);

impl Linear {
    /// Wraps a packed dense matrix.
    pub fn new(w: PackedMatrix) -> Self {
        let k = w.k();
        Linear {
            segs: vec![(0, Segment::Dense(w))],
            k,
        }
    }

    /// Loads the row-wise concatenation of the named `[rows_i, in_features]` tensors as one layer (fused
    /// projections that read the same input), keeping their stored format: dense parts of one dtype pack together
    /// (f32 if the dense dtypes differ), consecutive parts of one block format pack together. Then lets the OS drop
    /// the mapped file pages it read from resident memory.
    ///
    /// Dense bf16 weights compute in `precision` ([`PackedMatrix::pack_with`]); other formats ignore it.
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`];
    /// [`ModelError::InvalidConfig`] if the sizes overflow or a block format's row length does not fit.
    pub fn load(
        ck: &Checkpoint,
        in_features: usize,
        parts: &[PartSpec],
        precision: Precision,
    ) -> Result<Self> {
        let mut raw: Vec<WeightPart> = Vec::new();
        for (name, rows, select) in parts {
            let w = ck.weight_part(name, *rows, in_features)?;
            match select {
                None => raw.push(w),
                Some(ranges) => {
                    for r in ranges {
                        raw.push(w.rows(r.clone()).ok_or_else(|| {
                            ModelError::InvalidConfig(format!(
                                "{}: rows {r:?} are outside its {rows}",
                                ck.stored_name(name)
                            ))
                        })?);
                    }
                }
            }
        }
        let what = &parts[0].0;
        let segs = group_parts(&raw)
            .into_iter()
            .map(|g| pack_group(&raw[g], in_features, what, precision))
            .collect::<Result<Vec<Segment>>>()?;
        for (name, _, _) in parts {
            ck.release(name);
        }
        let mut at = 0;
        let segs = segs
            .into_iter()
            .map(|s| {
                let first = at;
                at += s.n();
                (first, s)
            })
            .collect();
        Ok(Linear {
            segs,
            k: in_features,
        })
    }

    /// Outputs per row (`W`'s rows).
    pub fn out_features(&self) -> usize {
        self.segs.iter().map(|(_, s)| s.n()).sum()
    }

    /// Inputs per row (`W`'s columns).
    pub fn in_features(&self) -> usize {
        self.k
    }

    /// The stored dense dtype (f32 for block formats, whose products run in f32 after the integer dot products).
    pub fn dtype(&self) -> WeightDtype {
        match self.format() {
            LinearFormat::Dense(d) => d,
            _ => WeightDtype::F32,
        }
    }

    /// The stored format.
    pub fn format(&self) -> LinearFormat {
        let f = |s: &Segment| match s {
            Segment::Dense(w) => LinearFormat::Dense(w.dtype()),
            Segment::Quant(w) => LinearFormat::Quant(w.format()),
        };
        let first = f(&self.segs[0].1);
        if self.segs.iter().all(|(_, s)| f(s) == first) {
            first
        } else {
            LinearFormat::Mixed
        }
    }

    /// The segments in output-column order, each with its first output column (rows of `W`).
    pub fn parts(&self) -> impl Iterator<Item = (usize, LinearPart<'_>)> {
        self.segs.iter().map(|(first, s)| {
            let p = match s {
                Segment::Dense(w) => LinearPart::Dense(w),
                Segment::Quant(w) => LinearPart::Quant(w),
            };
            (*first, p)
        })
    }

    /// Bytes of weights held.
    pub fn bytes(&self) -> usize {
        self.segs.iter().map(|(_, s)| s.bytes()).sum()
    }

    /// The weights' storage, one byte slice per segment ([`Linear::bytes`] in all), as the products stream it.
    pub fn storage(&self) -> impl Iterator<Item = &[u8]> {
        self.segs.iter().map(|(_, s)| s.as_bytes())
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

    /// The SwiGLU MLP's input from this fused `[gate; up]` projection (`out_features = 2·inter`): `gu = x·Wᵀ`
    /// (`[n_rows, 2·inter]`, resized) and `act = silu(gate)·up` (`[n_rows, inter]`, resized; as
    /// [`rowops::silu_mul_halves`]). Held in one block format with `inter` a multiple of 16, both run in one parallel
    /// region ([`qmatmul_swiglu`]: each thread takes the SwiGLU of the columns it computed); otherwise the product,
    /// then the SwiGLU. The same bits either way.
    ///
    /// Panics if `x.len() != n_rows · in_features` or `out_features` is odd.
    pub fn forward_swiglu(&self, x: &[f32], n_rows: usize, gu: &mut Vec<f32>, act: &mut Vec<f32>) {
        let n = self.out_features();
        assert!(
            n.is_multiple_of(2),
            "Linear::forward_swiglu: {n} outputs are not [gate | up]"
        );
        let inter = n / 2;
        act.resize(n_rows * inter, 0.0);
        let [(_, Segment::Quant(w))] = self.segs.as_slice() else {
            return self.forward_then_swiglu(x, n_rows, gu, act, inter);
        };
        if !inter.is_multiple_of(16) {
            return self.forward_then_swiglu(x, n_rows, gu, act, inter);
        }
        let _s = profile::scope(Op::Matmul);
        self.check_rows(x, n_rows);
        gu.resize(n_rows * n, 0.0);
        with_acts(x, n_rows, self.k, |acts| qmatmul_swiglu(acts, w, gu, act));
        self.add_work(Op::Matmul, n_rows);
    }

    /// [`Linear::forward_swiglu`] as two steps: the product, then the SwiGLU on one pass.
    fn forward_then_swiglu(
        &self,
        x: &[f32],
        n_rows: usize,
        gu: &mut Vec<f32>,
        act: &mut [f32],
        inter: usize,
    ) {
        self.forward_into(x, n_rows, gu);
        let _p = profile::scope(Op::Activation);
        rowops::silu_mul_halves(gu, inter, act);
    }

    fn forward_into_as(&self, op: Op, x: &[f32], n_rows: usize, y: &mut Vec<f32>) {
        let _s = profile::scope(op);
        self.check_rows(x, n_rows);
        y.resize(n_rows * self.out_features(), 0.0);
        if let [(_, Segment::Dense(w))] = self.segs.as_slice() {
            matmul(x, n_rows, w, y);
        } else {
            self.forward_segments(x, n_rows, y);
        }
        self.add_work(op, n_rows);
    }

    /// Panics unless `x` is `[n_rows, in_features]`.
    fn check_rows(&self, x: &[f32], n_rows: usize) {
        assert_eq!(
            x.len(),
            n_rows * self.k,
            "Linear: x is not [{n_rows}, {}]",
            self.k
        );
    }

    /// Charges a product of `n_rows` rows to `op` in the profile: its flops and the weights' bytes.
    fn add_work(&self, op: Op, n_rows: usize) {
        let macs = (n_rows * self.out_features() * self.k) as u64;
        profile::add_work(op, 2 * macs, self.bytes() as u64);
    }

    fn forward_segments(&self, x: &[f32], n_rows: usize, y: &mut [f32]) {
        let n = self.out_features();
        // The parts in block formats in one parallel region (one per format otherwise: a region costs a fork, a
        // join and the imbalance of its split).
        let quant: Vec<(&QuantMatrix, usize)> = self
            .segs
            .iter()
            .filter_map(|(first, s)| match s {
                Segment::Quant(w) => Some((w, *first)),
                Segment::Dense(_) => None,
            })
            .collect();
        if !quant.is_empty() {
            with_acts(x, n_rows, self.k, |acts| qmatmul_parts(acts, &quant, y, n));
        }
        for (first, seg) in &self.segs {
            if let Segment::Dense(w) = seg {
                let mut part = vec![0.0f32; n_rows * w.n()];
                matmul(x, n_rows, w, &mut part);
                for (dst, src) in y.chunks_mut(n).zip(part.chunks(w.n())) {
                    dst[*first..*first + w.n()].copy_from_slice(src);
                }
            }
        }
    }

    /// Row `r` of `W` as f32 (the embedding lookup when the table is tied to the head); for a block format, the
    /// row dequantized.
    ///
    /// Panics if `r >= out_features` or `out.len() != in_features`.
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        let (first, seg) = self
            .segs
            .iter()
            .rev()
            .find(|(first, _)| *first <= r)
            .expect("Linear::row_into: row out of range");
        match seg {
            Segment::Dense(w) => w.row_into(r - first, out),
            Segment::Quant(w) => w.row_into(r - first, out),
        }
    }
}

/// Runs `f` on `x` (`[n_rows, k]` f32) quantized per row in blocks of 32, in this thread's reused buffer. The buffer
/// is taken out of the thread-local rather than borrowed: while a product waits for its tasks, rayon may run another
/// product on this thread, which then finds an empty buffer (and allocates) instead of a borrow error.
fn with_acts<R>(x: &[f32], n_rows: usize, k: usize, f: impl FnOnce(&QuantizedActs) -> R) -> R {
    let mut acts = ACTS.with(|a| a.take());
    acts.quantize(x, n_rows, k);
    let r = f(&acts);
    ACTS.with(|a| a.replace(acts));
    r
}

/// Ranges of consecutive parts that pack into one segment: all dense parts together when every part is dense
/// (the fused dense matrix of before), else runs of one format.
fn group_parts(raw: &[WeightPart]) -> Vec<Range<usize>> {
    let key = |p: &WeightPart| match p {
        WeightPart::Dense(_) => None,
        WeightPart::Quant { format, .. } => Some(*format),
    };
    let mut out: Vec<Range<usize>> = Vec::new();
    for (i, p) in raw.iter().enumerate() {
        match out.last_mut() {
            Some(g) if key(&raw[g.start]) == key(p) => g.end = i + 1,
            _ => out.push(i..i + 1),
        }
    }
    out
}

fn pack_group(parts: &[WeightPart], k: usize, what: &str, precision: Precision) -> Result<Segment> {
    match parts[0] {
        WeightPart::Dense(_) => {
            let dense: Vec<RowMajor> = parts
                .iter()
                .map(|p| match p {
                    WeightPart::Dense(d) => *d,
                    WeightPart::Quant { .. } => {
                        unreachable!("group_parts groups dense parts alone")
                    }
                })
                .collect();
            let w = PackedMatrix::pack_with(k, &dense, WeightDtype::common(&dense), precision)
                .map_err(|e| ModelError::InvalidConfig(format!("packing {what}: {e}")))?;
            Ok(Segment::Dense(w))
        }
        WeightPart::Quant { format, .. } => {
            let q: Vec<(&[u8], usize)> = parts
                .iter()
                .map(|p| match p {
                    WeightPart::Quant { bytes, rows, .. } => (*bytes, *rows),
                    WeightPart::Dense(_) => unreachable!("group_parts groups one format"),
                })
                .collect();
            let w = QuantMatrix::pack(format, k, &q)
                .map_err(|e| ModelError::InvalidConfig(format!("packing {what}: {e}")))?;
            Ok(Segment::Quant(w))
        }
    }
}

/// Bytes [`Linear::load`] allocates for parts of these formats and row counts (`[rows_i, k]` each) in `precision`,
/// grouped as the load groups them; `None` on overflow or a row length a block format cannot hold.
pub(crate) fn packed_bytes(
    parts: &[(Option<QuantFormat>, WeightDtype, usize)],
    k: usize,
    precision: Precision,
) -> Option<usize> {
    let mut total = 0usize;
    let mut i = 0;
    while i < parts.len() {
        let key = parts[i].0;
        let mut j = i;
        let mut rows = 0usize;
        let mut common: Option<WeightDtype> = None;
        let mut mixed = false;
        while j < parts.len() && parts[j].0 == key {
            rows = rows.checked_add(parts[j].2)?;
            mixed |= common.is_some_and(|c| c != parts[j].1);
            common = Some(parts[j].1);
            j += 1;
        }
        let bytes = match key {
            Some(q) => QuantMatrix::packed_bytes(q, rows, k)?,
            None => {
                let d = if mixed {
                    WeightDtype::F32
                } else {
                    common.unwrap_or(WeightDtype::F32)
                };
                PackedMatrix::packed_bytes_with(rows, k, d, precision)?
            }
        };
        total = total.checked_add(bytes)?;
        i = j;
    }
    Some(total)
}
