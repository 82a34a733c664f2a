//! The crate's integration tests, one module per file beside this one, linked into one test binary (each
//! binary links the whole workspace: one instead of many keeps the build short).

mod common;
mod worker_common;

mod cache_exact;
mod cache_modes;
mod choices;
mod consistency;
mod constraint;
mod device_engine;
mod experts_limits;
mod experts_remote;
mod faults;
mod faults_connect;
mod faults_serve;
mod gguf;
mod gguf_modes;
mod kv_bf16;
mod layer_split;
mod link_fuzz;
mod moe_modes;
mod offload_limits;
mod offload_link;
mod offload_local;
mod picker;
mod picker_modes;
mod reference;
mod serve;
mod speculative;
mod speculative_chain;
mod speculative_modes;
mod speculative_mtp;
mod speculative_mtp_modes;
mod speculative_offload;
mod speculative_serve;
mod split;
mod step_plan;
mod text_stream;
mod worker_core;
mod worker_memory;
mod worker_pages;
mod worker_verify;
