//! # backburner-cuda: the CUDA backend of the device layer
//!
//! [`CudaBackend`] implements [`backburner_model::device::Backend`] on one NVIDIA GPU; [`CudaProvider`] lists the
//! machine's GPUs and opens one for the device [`Registry`](backburner_model::device::Registry) (the CLI registers
//! it when built with its `cuda` feature).
//!
//! ## Design
//!
//! - **No toolkit at build time.** cudarc binds the driver API, NVRTC and cuBLAS and opens `libcuda`, `libnvrtc`
//!   and `libcublas` when first used (`dynamic-loading`, CUDA 13.0 bindings: sonames `.so.13` and `.so.12` are
//!   both tried). [`loader`] checks they open before any call, so a machine without them gets a message
//!   ([`CudaProvider::unavailable`]), never a panic; `BACKBURNER_CUDA_LIB_DIRS` names extra directories.
//! - **Kernels compiled at open.** The CUDA C sources in `src/kernels/*.cu` (no CUDA header needed) are compiled
//!   by NVRTC to PTX for the device's compute capability when a device is opened ([`compile`]).
//! - **One stream.** Every op is queued on the backend's stream in call order; allocations are stream-ordered
//!   (`cuMemAllocAsync`); `download` and `top_k` wait. A buffer grows when an op needs it longer and is kept.
//! - **Weights** (`backend/matrix.rs`): dense bf16 as bf16, f32 and f16 as f32 (exact); Q4_K, Q6_K, Q8_0 in their
//!   GGUF bytes (Q6_K's and Q8_0's scales in planes of their own, for aligned loads); other block formats (Q5_K,
//!   IQ*, Q5_0, …) dequantized to f32 rows (exact, 4 bytes per weight: [`fallback_formats`]). Up to 4 rows of x:
//!   GEMV kernels that
//!   read each weight once and dequantize in registers, in f32; more: cuBLAS `GemmEx`, bf16 × bf16 with f32
//!   accumulation (x rounded to bf16, block formats dequantized to a bf16 tile first), f32 weights in f32.
//! - **Gated DeltaNet** (`backend/gdn.rs`): the causal conv with SiLU and its state; the delta rule over a prompt
//!   as the recurrent rule token by token (the CPU's chunked form is the same function in exact arithmetic); the
//!   decode step as conv, l2 norms, recurrent step and gated norm kernels.
//! - **Attention** (`backend/attn.rs`): a KV cache of K and V rows in f16, f32 or bf16 (bf16 stored, attended in
//!   f32: the CPU also rounds queries and softmax weights to bf16 there), growing by whole pages; one block per
//!   (token, head) computes the normalized partial and its natural-log LSE as
//!   [`backburner_kernels::attention::Partial`] (causal, GQA). Head dims up to 512.
//! - **Row ops** follow `backburner_kernels::rowops`: the RMSNorms sum squares in f64, the l2 norm in f32 with its
//!   f64 fallback past f32's range, softplus is linear above 20, RoPE takes the model's inverse frequencies.
//! - **top-k** copies the logits to the host and selects there ([`backburner_model::device::top_k_row`]).
//!
//! ## Exactness
//!
//! Not the CPU's bits: other summation orders, `expf`/`logf` of CUDA's libdevice, bf16 rounding of x in the
//! cuBLAS products and (for block formats) f32 activations where the CPU quantizes them to 8 bits. The GPU tests
//! (`tests/gpu.rs`) state their tolerances against [`CpuBackend`](backburner_model::device::CpuBackend): element
//! ops 1e-5 relative, GEMV 1e-4 relative to the row's scale, cuBLAS bf16 products 1e-2, attention and the delta
//! rule 1e-4, and whole models' logits within 5e-2 of the largest logit with the same greedy tokens.

//!
//! ## Testing without and with a GPU
//!
//! - `tests/no_gpu.rs` runs anywhere: the provider answers without a driver, and every kernel source compiles with
//!   NVRTC for sm_80 and sm_90 when libnvrtc loads (`scripts/get_nvrtc.sh DIR` fetches it from PyPI; point
//!   `BACKBURNER_CUDA_LIB_DIRS` at the directory it prints), else one `skipped:` line.
//! - `tests/gpu_ops.rs` (every op against the CPU backend) and `tests/gpu_model.rs` (whole models through
//!   `Model::place_layers`) need a device and print one `skipped:` line per test without one.
//! - `scripts/gpu/emulate.sh` runs the kernels on a CPU emulation (`emu/`: each CUDA thread a `std::thread`) against
//!   plain references, and, given an NVRTC directory, the test binaries above on stand-in `libcuda.so.1` and
//!   `libcublas.so.13` that execute the emulated kernels: the whole crate, cudarc included, without a GPU (not its
//!   speed, nor the real driver's or cuBLAS's behaviour).
//! - On a GPU machine without Rust: `scripts/gpu/build.sh` here (stripped test, `cuda_bench` and CLI binaries packed
//!   into `target/gpu-carry/bins.tar.xz`), then `scripts/gpu/check.sh` there (tests, benchmark, PyTorch's reference
//!   rates, the CLI's text on the GPU against its CPU path, into `$OUT`).

pub mod backend;
pub mod compile;
pub mod loader;
pub mod provider;

pub use backend::{fallback_formats, CudaBackend, GEMV_MAX_ROWS};
pub use provider::CudaProvider;
