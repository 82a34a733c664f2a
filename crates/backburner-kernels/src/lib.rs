//! CPU kernels for Backburner.
//!
//! * [`gdn`]: the Gated DeltaNet mixer core — causal depthwise conv + SiLU with carried state, the
//!   delta-rule recurrence (decode) and its chunked WY/UT form (prefill).
//! * [`attention`]: causal attention over one KV page as a normalized partial with its log-sum-exp,
//!   the LSE merge of partials and the fixed left fold over pages.
//! * [`kv`]: the paged KV cache of one full-attention layer (f16, f32 or bf16 storage).
//! * [`matmul`]: dense products against weight matrices packed once in their dtype (f32, bf16, f16).
//! * [`quant`]: GGUF quantized weights (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, IQ4_XS) repacked into panels, and their
//!   products with 8-bit quantized activations by integer dot products (AVX-512 VNNI, AVX2, plain Rust).
//! * [`rowops`]: RMSNorms, l2 norm, activations and residual adds, vectorized and threaded.
//! * [`parallel`]: static task splitting on the caller's thread pool; [`profile`]: opt-in time accounting by
//!   operator class.
//! * [`reference`](mod@reference): slow, obvious float64 twins of the kernels, for tests (also used by the model crate).
//!
//! Conventions: every tensor is a row-major `f32` slice whose shape is given in the item's docs as
//! `[outer, ..., inner]`. Kernels assert their shapes on entry and panic with a message naming the
//! argument on misuse: these are internal APIs and the model crate validates user input before.
//!
//! The math follows `ARCH_SPEC.md` (read from Hugging Face transformers `qwen3_5`), the paper "Gated Delta
//! Networks: Improving Mamba2 with Delta Rule" (Yang, Kautz, Hatamizadeh 2024), FlashAttention (Dao et al.
//! 2022) and "Online normalizer calculation for softmax" (Milakov & Gimelshein 2018).

#![warn(missing_docs)]

pub mod attention;
pub mod gdn;
pub mod hugebuf;
pub mod kv;
pub mod matmul;
pub mod parallel;
pub mod profile;
pub mod quant;
pub mod reference;
pub mod rowops;
pub mod team;

mod simd;

#[cfg(test)]
mod isa_tests;
