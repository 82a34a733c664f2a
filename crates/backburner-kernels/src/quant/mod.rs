//! Quantized weights (every GGUF / ggml block format: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K–Q6_K, IQ1_S, IQ1_M,
//! IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4) and their products with activations
//! quantized to 8 bits, computed with integer dot products as llama.cpp does, in our panel layout.
//!
//! Q8_0, Q4_0, Q4_K, Q5_K, Q6_K and IQ4_XS have panel layouts of their own (below). Every other format is decoded at
//! pack time into the *generic* layout of [`spec`](self) (4-bit codebook indices or plain 4/5-bit codes, an f32
//! scale per row and unit, i8 sub-scales and u8 mins per sub-block), exact for each format's weights: memory is
//! 1.1–1.3× the GGUF bytes for the 4–5-bit formats and 2–2.8× for the 1–3-bit ones (the test
//! `packed_memory_is_about_the_gguf_bytes` lists each).
//!
//! # Formats
//! [`QuantFormat`] names a format (with its ggml type id and block size) and [`dequantize`] turns GGUF block
//! bytes into f32 with ggml's formulas (`ggml-quants.c` `dequantize_row_*`): the oracle of the tests.
//!
//! # Layout
//! A [`QuantMatrix`] holds `W: [n, k]` in panels of 16 rows (outputs), like [`crate::matmul::PackedMatrix`]; the
//! panel count is padded to a multiple of 4 with zero rows. A panel is a sequence of *units*, one per GGUF block of
//! its rows (32 inputs for Q8_0 / Q4_0, 256 for the others). Inside a unit, each 32-block of inputs holds its codes
//! in 64-byte vectors: vector lane `l` (4 bytes) = row `l`'s codes of 4 consecutive inputs (a *group*; 8 groups per
//! 32-block), so one `vpdpbusd` against 4 broadcast activation bytes advances 16 outputs by 4 inputs. Codes are
//! unsigned bytes:
//!
//! | format | codes (value)                  | unit bytes (per 16 rows) | vs GGUF |
//! |--------|--------------------------------|--------------------------|---------|
//! | Q8_0   | 8 vectors of `q + 128` (q)      | 512 + 16 f16 d = 544      | 1.000 |
//! | Q4_0   | 4 nibble vectors (`q − 8`)      | 32 d + 256 = 288          | 1.000 |
//! | Q4_K   | 8 × 4 nibble vectors (q)        | d, dmin + 8 × (256 + 16 scales + 16 mins) = 2368 | 1.028 |
//! | Q5_K   | nibbles + 8 fifth-bit planes    | d, dmin + 8 × (64 + 256 + 16 + 16) = 2880 | 1.023 |
//! | Q6_K   | nibbles + 16 bit-pair planes (`q − 32`) | d + 8 × (128 + 256 + 2×16 i8 scales) = 3360 | 1.000 |
//! | IQ4_XS | nibble indices (`IQ4_VALUES[i]`) | d + 8 × (256 + 16 i8 `ls − 32`) = 2208 | 1.015 |
//!
//! A nibble vector `h` (`0..4`) of a 32-block holds group `h` in its low nibbles and group `h + 4` in its high
//! nibbles. Q5_K's plane for a 32-block has the fifth bit of group `g` in bit `g` of the byte at the code's position;
//! Q6_K's two planes (groups 0–3, 4–7) have the high bit pair of group `g` in bits `2(g mod 4)..`. Scales stay in
//! the stored precision (f16 `d`, `dmin`; 6-bit sub-scales unpacked to bytes at pack time), so resident memory is
//! about the GGUF bytes. The panels live in [`HugeBuf`](crate::hugebuf::HugeBuf)s: on Linux, transparent huge pages
//! shared by consecutive matrices (decode streams them; IQ4_XS at 2 threads ×1.05 over base pages).
//!
//! The fields of a unit lie in the order decode uses them: `d` (and `dmin`), then each 32-block's planes, nibble
//! vectors, scales and mins together, so that the unit streams upwards (Q4_K_M decode 8–14 % faster than with each
//! field gathered in one run per unit, docs/BENCHMARKS.md); with block strides of 272 (IQ4_XS), 288, 352 and 416
//! bytes, most of their vectors straddle two cache lines (the loads are unaligned ones). Q8_0 keeps its codes before
//! its `d` (read in that order, see Kernels). IQ4_XS had its `d` and all its scales first, then 32 bytes of padding so
//! that its codes started on a cache line: that read 77–79 % of the read bandwidth at the 27B's MLP shapes (1 thread,
//! no software prefetch), the reading order 89–91 % (and 1.4 % less memory); with every line prefetched in software,
//! as before the AMD policy of `prefetch.rs`, the order had measured the other way round.
//!
//! # Arithmetic
//! [`QuantizedActs`] holds `x` as `xq·dx` per block of 32 (see its docs). For output `(i, j)`, every 32-block of
//! inputs contributes a float term computed from the exact integer `S = Σ q·xq` over its 32 products (true weight
//! values `q`; the kernels sum unsigned codes and subtract `offset·Σxq` exactly):
//!
//! * Q8_0, Q4_0: `f = d·float(S)`; IQ4_XS: `f = ds·float(S)` with `ds = d·(ls − 32)`;
//! * Q4_K, Q5_K: `f = fma(ds, float(S), −(dm·float(Σxq)))` with `ds = d·sc`, `dm = dmin·m` (each one f32 product);
//! * Q6_K: `f = fma(ds_a, float(S_a), ds_b·float(S_b))` over the block's two halves of 16, `ds = d·sc`;
//!
//! and `acc = fma(f, dx, acc)`, from `+0.0`, blocks in `k` order. All integers are exact (`|S| < 2^24`, so
//! `float(S)` is exact) and every float operation is an IEEE 754 product or fused multiply-add, so the result is the
//! same bits on every instruction set (AVX-512 VNNI, AVX2, plain Rust), thread count, batch size and row position:
//! a token's projections in decode equal its projections inside a prefill batch. [`qmatmul_reference`] is the
//! plain loop. Against the exact product with the unquantized `x`, the error is at most `Σ_blocks Σ|w|·dx/2` from
//! the activation rounding, plus float rounding.
//!
//! # Kernels
//! One generic kernel (`QIsa` over AVX-512 VNNI, AVX2 or plain Rust, chosen at run time; never AMX): per register tile
//! of up to 4 rows (2 on AVX2) × one panel, for each 32-block, the codes are unpacked in registers (nibble masks, bit
//! planes, a `vpshufb` codebook for IQ4_XS; where the CPU has AVX-512 VBMI and GFNI, `vpermb` lookups, and the
//! high-bit planes of Q5_K, Q6_K, Q5_0 and Q5_1 moved into place by one `vgf2p8affineqb` each and merged by
//! `vpternlogd`) and multiplied against 4 broadcast activation bytes per group (`vpdpbusd`, or `vpmaddubsw` +
//! `vpmaddwd` on AVX2 with i16 partial sums kept below overflow), then the block's float term. Threads split
//! contiguous ranges of panel groups ([`crate::parallel`]). One row (decode): each thread streams its panels once
//! over the whole `k`, prefetched as `prefetch.rs` says per format, ISA and vendor: every line 12 KiB ahead on Intel
//! cores and for the 2-bit planes; for the formats read in address order with the AVX-512 kernels, no software
//! prefetch on AMD Zen 4 cores and every line 6 KiB ahead with a one-use hint (`prefetchnta`) on AMD Zen 5. Q8_0 on AVX-512 reads each 544-byte unit's lines strictly upwards (one asm
//! block for its 8 code vectors, then its scales) and, when it is the product's only task on an AMD core, prefetches
//! one line per unit 16 KiB ahead (with two or more tasks there, none). A few rows (speculative decoding's verify
//! steps: up to a tile, and on AVX-512 up to 16 rows of the formats with panel layouts of their own): the same, each
//! panel in register tiles of balanced heights (up to 8 rows on AVX-512), the first streaming the panel with every
//! line prefetched 12 KiB ahead, the others reading it again from L2; the codes are unpacked once per tile and block.
//! More rows (prefill): cache blocks of 16 panels × `k` ranges of 24 blocks are decoded
//! once into a per-thread buffer (code vectors ready for the dot products, block scales in f32, 240 KiB: L2), then
//! every row tile runs against it; the accumulators pass through `y` between `k` ranges, which keeps each output's
//! chain (and bits) unchanged. On AVX2, the offset-128 formats (Q8_0, IQ4_XS) and those with codes `≤ 16` (Q4_0, Q4_K)
//! run that path in tiles of 4 rows whose integer sums come from one hand-scheduled asm block per 32-block
//! (`QIsa::quad_sums`): the same instructions as the generic step, with the code loads (and `vpabsb`) shared by 4 rows
//! and nothing spilled.

mod acts;
#[cfg(target_arch = "x86_64")]
mod acts_x86;
mod decode;
mod fmt;
mod fmt_gen;
mod format;
mod grids;
mod isa;
mod kernel;
mod pack;
mod prefetch;
mod prefill;
mod reference;
mod regions;
mod spec;
mod unit;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_asm;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_rows;

pub use acts::{QuantizedActs, ACT_BLOCK};
pub use format::{dequantize, k_pack_scale_min, k_scale_min, QuantError, QuantFormat, IQ4_VALUES};
pub use kernel::qmatmul;
pub use pack::QuantMatrix;
pub use reference::qmatmul_reference;
pub use regions::{qmatmul_parts, qmatmul_swiglu};

/// The integer-dot instruction set [`qmatmul`] uses on this CPU: `"avx512-vnni-vbmi"`, `"avx512-vnni"`, `"avx2"` or
/// `"scalar"` (for benches and logs).
pub fn kernel_isa() -> &'static str {
    match isa::qisa_level() {
        3 => "avx512-vnni-vbmi",
        2 => "avx512-vnni",
        1 => "avx2",
        _ => "scalar",
    }
}
