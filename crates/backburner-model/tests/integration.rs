//! The crate's integration tests, one module per file beside this one, linked into one test binary (each
//! binary links the whole workspace: one instead of many keeps the build short).

mod batch_decode;
mod chat_parse;
mod chat_pycompat;
mod chat_request;
mod chat_template;
mod checkpoints;
mod device;
mod device_fork;
mod device_host;
mod gguf_mix;
mod load_bytes;
mod loading;
mod moe;
mod moe_gguf;
mod moe_remote;
mod mtp;
mod precision;
mod random_gguf;
mod state_manager;
mod unused_tensors;
mod verify;
