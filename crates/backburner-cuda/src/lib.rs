//! placeholder
pub mod compile;
pub mod loader;
