//! The device layer: where a layer's weights and state live and which backend computes it.
//!
//! - [`Backend`] is the seam: a device's buffers and the dozen ops a decoder layer is made of (products dense and
//!   quantized, the Gated DeltaNet's conv, chunked and recurrent steps, paged attention giving a partial and its LSE,
//!   norms, RoPE, activations, the embedding gather, the head's top-k).
//! - [`CpuBackend`] runs them with the CPU path's kernels (the same bits).
//! - [`DeviceLayers`] holds a range of layers' weights on one backend and runs them on a sequence's
//!   [`DeviceState`]; the model's plain forward hands those layers to it ([`crate::Model::place_layers`]).
//! - [`Registry`] lists the devices a build and machine offer and opens one by its [`DeviceId`] (`cpu`, `cuda:0`).
//!
//! Exactness tiers (docs/DEVICES.md): within one backend and device, bit-identical run to run and across
//! placements of pages (the LSE merge is exact by construction); across backends, within a stated tolerance of the
//! f64 reference.

mod backend;
mod cpu;
mod gdn;
mod id;
mod layer;
mod registry;
mod state;

pub use backend::{Backend, Buf, DecodeStep, DeviceKv, DeviceMatrix, DeviceResult};
pub use cpu::{top_k_row, CpuBackend};
pub use id::{BackendKind, DeviceError, DeviceId, DeviceInfo};
pub use layer::{DeviceLayers, LayerPlacement};
pub use registry::{cpu_info, Provider, Registry};
pub use state::DeviceState;
