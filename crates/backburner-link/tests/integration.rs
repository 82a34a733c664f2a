//! The crate's integration tests, one module per file beside this one, linked into one test binary (each
//! binary links the whole workspace: one instead of many keeps the build short).

mod codec;
mod vector;
