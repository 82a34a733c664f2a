//! Dense products `y = x · Wᵀ` against a weight matrix packed once, at load time, in its stored dtype.
//!
//! # Layout
//! A [`PackedMatrix`] holds `W: [n, k]` (n outputs, k inputs, as checkpoints store projections) in *panels* of
//! [`PANEL`] = 16 outputs: panel `p` holds rows `16p..16p+16` of `W` k-major, element `(16p + l, kk)` at
//! `p·k·16 + kk·16 + l`. A kernel then reads 16 outputs' weights for one input as one vector, in both the decode
//! path (one activation row, bound by memory bandwidth) and the prefill path (many rows, bound by compute). The
//! panel count is padded to a multiple of 4 with zero rows, so kernels never read outside the storage. Weights
//! stay in their dtype (f32, bf16 or f16: the same bytes as the checkpoint, reordered); bf16/f16 are widened to
//! f32 exactly inside the kernels.
//!
//! # Arithmetic
//! Every output element is one fused multiply-add chain over `kk = 0..k` in order, starting from `+0.0`:
//! `acc = fma(x[i][kk], W[j][kk], acc)`. This is exactly specified by IEEE 754, so the result is the same bits on
//! every instruction set (AVX-512, AVX2, NEON, plain Rust), for every thread count, every blocking of `k`, every
//! batch size and every row position in the batch: a token's projections in decode equal its projections inside
//! a prefill ubatch. [`matmul_reference`] is the obvious loop with the same chain.
//!
//! # Kernels
//! Few rows (decode, and up to 16 rows: speculative decoding's verify steps): each task streams its panels once and
//! converts bf16/f16 in registers, in row blocks of 4 on AVX-512 (2 otherwise), the later blocks of a pass reading its
//! panels again from the cache. Many
//! rows (prefill): blocked as in GotoBLAS/BLIS (Goto & van de Geijn 2008; Van Zee & van de Geijn 2015): `x` is
//! packed into row blocks of `MR` rows, weight panels are widened block by block (`KC` inputs × 16 panels) into an
//! f32 buffer that stays in L2, and a register-tile micro-kernel (12 rows × 32 outputs on AVX-512) accumulates.
//! Work is split over the pool's threads by contiguous ranges of panels.
//!
//! # bf16 activations
//! A bf16 matrix packed with [`Precision::Bf16`] ([`PackedMatrix::pack_with`]) computes in a second arithmetic,
//! llama.cpp's: activations rounded to bf16 and AVX-512 BF16 `vdpbf16ps` dot products over pairs of inputs (k-pair
//! panels, a 12 × 32 register tile for prefill, the same streaming decode path). It has its own exactly specified
//! chain per output (see `matmul::bf16`), emulated bit for bit without AVX-512 BF16, so the guarantees above hold for
//! it too; [`matmul_reference`] follows whichever arithmetic the matrix was packed for. On the 27B's MLP shapes
//! (512 rows) it runs at about twice the f32 arithmetic's throughput (`benches/matmul_bf16.rs`).

mod bf16;
mod kernel;
mod pack;
mod src;

pub use bf16::round_act as round_bf16_act;
pub use kernel::{matmul, matmul_reference};
pub use pack::{PackError, PackedMatrix, RowMajor, WeightDtype};

/// The arithmetic of dense products against bf16 weights, chosen per matrix when it is packed
/// ([`PackedMatrix::pack_with`]). f32 and f16 weights always compute in [`Precision::F32`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Weights widened to f32 exactly, f32 activations, one fused multiply-add chain per output (the arithmetic
    /// of the module docs). The reference-accurate choice, and the default.
    #[default]
    F32,
    /// "bf16 activations": activations rounded to bf16 and each output a chain of AVX-512 BF16 `vdpbf16ps` steps
    /// over pairs of inputs, as llama.cpp computes bf16 weights (about twice the f32 arithmetic's throughput on a
    /// CPU with AVX-512 BF16; emulated bit for bit, slower, elsewhere). See `matmul::bf16`.
    Bf16,
}

impl Precision {
    /// `"f32"` or `"bf16"`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }

    /// Parses [`Precision::name`]'s output.
    pub fn parse(s: &str) -> Option<Precision> {
        match s {
            "f32" => Some(Precision::F32),
            "bf16" => Some(Precision::Bf16),
            _ => None,
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The instruction set the bf16-activation products use on this CPU: `"avx512-bf16"` (native `vdpbf16ps`), or an
/// emulation: `"avx512f-emulated"`, `"avx2-emulated"`, `"scalar-emulated"` (for benches and logs).
pub fn bf16_kernel_isa() -> &'static str {
    crate::simd::dp::dp_name()
}

/// Outputs per panel (one 16-lane vector of f32).
pub const PANEL: usize = crate::simd::LANES;
