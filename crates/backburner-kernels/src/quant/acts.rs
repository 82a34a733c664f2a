//! [`QuantizedActs`]: activation rows quantized to i8 in blocks of 32, the other operand of the products.

use rayon::prelude::*;

/// Elements per activation block.
pub const ACT_BLOCK: usize = 32;

/// Below this many elements a quantization runs on the calling thread alone.
const SERIAL_ELEMS: usize = 1 << 16;

/// Per-block data of one activation row: the scale and the sums of the quantized values.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub(crate) struct ActBlock {
    /// `dx = amax / 127` (0 for an all-zero block).
    pub d: f32,
    /// `Σ xq` as f32 (exact: `|Σ xq| ≤ 32·127`).
    pub sumf: f32,
    /// `Σ xq` over the block.
    pub sum: i32,
    /// `Σ xq` over its first 16 elements.
    pub half: i32,
}

/// Activations `x: [m, k]` quantized per row in blocks of 32: `x ≈ dx·xq` with `dx = amax/127` (the block's
/// largest magnitude over 127, computed in f32; 0 for an all-zero block) and `xq = round_ties_even(x · (1/dx))`
/// in `-127..=127` (all 0 when `dx = 0`), plus the per-block sums `Σ xq` the products need for the offset and
/// min terms. `|x − dx·xq| ≤ dx/2` up to the rounding of `1/dx` and of the product. A block holding a NaN or an infinity gets the scale NaN, so every product it enters is NaN.
///
/// A reusable buffer: [`QuantizedActs::quantize`] keeps the allocations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizedActs {
    m: usize,
    k: usize,
    /// `[m, k]` quantized values.
    q: Vec<i8>,
    /// `[m, k / 32]` per-block scales and sums.
    blocks: Vec<ActBlock>,
}

impl QuantizedActs {
    /// An empty buffer (0 rows).
    pub fn new() -> Self {
        Self::default()
    }

    /// Quantizes `x: [m, k]` (row-major f32) into this buffer. Runs on the current rayon pool when large.
    ///
    /// Panics if `k` is not a multiple of 32 or `x.len() != m · k` (callers check; see
    /// [`QuantFormat::row_bytes`](super::QuantFormat::row_bytes)).
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        assert!(
            k.is_multiple_of(ACT_BLOCK),
            "quantize: k = {k} is not a multiple of 32"
        );
        assert_eq!(x.len(), m * k, "quantize: x is not [{m}, {k}]");
        let nb = k / ACT_BLOCK;
        self.m = m;
        self.k = k;
        self.q.resize(m * k, 0);
        self.blocks.resize(m * nb, ActBlock::default());
        if k == 0 {
            return;
        }
        if m * k < SERIAL_ELEMS {
            let rows = self.q.chunks_mut(k).zip(self.blocks.chunks_mut(nb));
            for ((q, b), x) in rows.zip(x.chunks_exact(k)) {
                quantize_row(x, q, b);
            }
        } else {
            let rows = self.q.par_chunks_mut(k).zip(self.blocks.par_chunks_mut(nb));
            rows.zip(x.par_chunks_exact(k))
                .for_each(|((q, b), x)| quantize_row(x, q, b));
        }
    }

    /// Rows `m`.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Elements per row `k`.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Row `i`'s quantized values (`[k]`).
    pub(crate) fn row_q(&self, i: usize) -> &[i8] {
        &self.q[i * self.k..(i + 1) * self.k]
    }

    /// Row `i`'s blocks (`[k / 32]`).
    pub(crate) fn row_blocks(&self, i: usize) -> &[ActBlock] {
        let nb = self.k / ACT_BLOCK;
        &self.blocks[i * nb..(i + 1) * nb]
    }

    /// Row `i` dequantized, `dx·xq` (tests: the activations the products actually use).
    pub fn row_dequantized(&self, i: usize) -> Vec<f32> {
        let q = self.row_q(i);
        let b = self.row_blocks(i);
        q.iter()
            .enumerate()
            .map(|(j, &v)| f32::from(v) * b[j / ACT_BLOCK].d)
            .collect()
    }

    /// Row `i`'s block scales `dx` (`[k / 32]`).
    pub fn row_scales(&self, i: usize) -> Vec<f32> {
        self.row_blocks(i).iter().map(|b| b.d).collect()
    }
}

/// One row: per block of 32, the scale, the rounded values and their sums (AVX2 when the CPU has it: the same
/// bits, see `acts_x86.rs`).
fn quantize_row(x: &[f32], q: &mut [i8], blocks: &mut [ActBlock]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::allowed(1) && std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { super::acts_x86::quantize_row_avx2(x, q, blocks) };
    }
    for ((x, q), blk) in x
        .chunks_exact(ACT_BLOCK)
        .zip(q.chunks_exact_mut(ACT_BLOCK))
        .zip(blocks.iter_mut())
    {
        *blk = quantize_block(x, q);
    }
}

/// One block of 32: its [`ActBlock`], with the rounded values written to `q` (the definition the vector path
/// matches).
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8]) -> ActBlock {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    // A NaN or infinity (f32::max skips NaN) makes the block's scale NaN, so the products and the logits are
    // NaN and the engine's non-finite check fires, rather than the values quietly becoming zeros.
    let d = if x.iter().all(|v| v.is_finite()) {
        amax / 127.0
    } else {
        f32::NAN
    };
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    for (qi, xi) in q.iter_mut().zip(x) {
        *qi = (xi * id).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
    let half: i32 = q[..16].iter().map(|&v| i32::from(v)).sum();
    ActBlock {
        d,
        sumf: sum as f32,
        sum,
        half,
    }
}
