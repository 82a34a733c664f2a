//! The crate's integration tests, one module per file beside this one, linked into one test binary (each
//! binary links the whole workspace: one instead of many keeps the build short).

mod common;

mod attention;
mod gdn;
mod gdn_decode;
mod gdn_rollback;
mod kv;
mod matmul;
mod merge;
mod packed;
mod quant;
mod quant_ggml;
mod quant_parts;
mod team;
