//! The crate's integration tests, one module per file beside this one, linked into one test binary (each
//! binary links the whole workspace: one instead of many keeps the build short).

mod common;
mod serve_util;

mod bench_layer_split;
mod bench_seed;
mod bench_serving;
mod bench_spec;
mod chat;
mod choices;
mod cli;
mod device_layers;
mod devices;
mod devices_host;
mod experts;
mod gen_gguf;
mod gguf_modes;
mod layer_split;
mod link_faults;
mod memory_limit;
mod offload;
mod plan;
mod plan_device;
mod qwen35_tokenizer;
mod serve;
mod serve_choices;
mod serve_health;
mod worker;
