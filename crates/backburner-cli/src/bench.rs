//! `backburner bench`: end-to-end benchmarks (filled in below).

use anyhow::Result;
use clap::Args;

/// Benchmark options.
#[derive(Args)]
pub struct BenchArgs {}

/// Runs a benchmark.
pub fn run(_a: BenchArgs) -> Result<()> {
    anyhow::bail!("not built yet")
}
