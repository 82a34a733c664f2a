//! KV offload on the host (docs/KV_OFFLOAD.md): the KV budget, where each run of offloaded pages lives, and the
//! remote page store the forward pass attends through.
//!
//! When a prefill ubatch or a decode step would take the host's KV cache past its budget, whole pages of the oldest
//! positions (every full-attention layer, K and V, in the session's KV dtype) move to workers and are freed here.
//! Workers hold **contiguous runs** in position order: the first worker the oldest run, then the next (a worker
//! takes pages until it answers `PagesFull`, then the next worker takes over: placement by free memory). For every
//! attention op each worker returns its partial (the first worker folded from empty, later ones one partial per page)
//! and the host folds them and then its own pages in page order: the bits of the local run.

mod client;
pub(crate) mod flow;
mod placement;
mod recovery;
mod remote;
mod rewind;
mod verify;

pub use client::PutOutcome;
pub use placement::{Placement, Run};
pub use remote::LinkPages;

use std::sync::{Arc, Mutex};

use backburner_model::{KvOptions, LayerKind, ModelConfig};

use crate::split::WorkerClient;

/// The workers a session uses, shared with the remote page store during a forward step.
pub type Workers = Arc<Mutex<Vec<WorkerClient>>>;

/// How much KV cache the host may hold (`--kv-budget`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBudget {
    /// Positions (tokens) of every full-attention layer.
    Positions(usize),
    /// Bytes of K and V rows over all full-attention layers, in the KV dtype.
    Bytes(u64),
}

impl KvBudget {
    /// Parses `N` (positions) or a byte size with a unit (see [`parse_bytes`]: `512MiB`, `2G`, `1000000B`).
    /// Errors: a message naming the accepted forms.
    pub fn parse(s: &str) -> Result<Self, String> {
        let t = s.trim();
        if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
            let bad = || format!("invalid KV budget {s:?}: too large");
            return t
                .parse::<usize>()
                .map(KvBudget::Positions)
                .map_err(|_| bad());
        }
        parse_bytes(t).map(KvBudget::Bytes).map_err(|_| {
            format!("invalid KV budget {s:?}: give positions (e.g. 8192) or bytes with a unit (e.g. 512MiB, 2G)")
        })
    }

    /// The budget in positions for `cfg`'s full-attention layers with `kv` (a byte budget is rounded down to
    /// whole positions; a model without attention layers has no KV and an unlimited budget).
    pub fn positions(&self, cfg: &ModelConfig, kv: KvOptions) -> usize {
        match *self {
            KvBudget::Positions(n) => n,
            KvBudget::Bytes(b) => {
                let per = bytes_per_position(cfg, kv);
                if per == 0 {
                    return usize::MAX;
                }
                usize::try_from(b / per as u64).unwrap_or(usize::MAX)
            }
        }
    }
}

/// Parses a byte size: a whole number with an optional unit, case-insensitive: none or `B` (bytes), `K`/`KiB`,
/// `M`/`MiB`, `G`/`GiB`, `T`/`TiB` (powers of 1024) or `KB`, `MB`, `GB`, `TB` (powers of 1000). Errors: a message
/// naming the accepted forms, for anything else or a size past `u64`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let bad = || format!("{s:?} is not a byte size (e.g. 4096, 512M, 512MiB, 8G)");
    let n: u64 = num.parse().map_err(|_| bad())?;
    let mul: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    n.checked_mul(mul).ok_or_else(bad)
}

/// Bytes of K and V one position takes over all of `cfg`'s full-attention layers in `kv`'s dtype.
pub fn bytes_per_position(cfg: &ModelConfig, kv: KvOptions) -> usize {
    attention_layers(cfg).len() * 2 * cfg.num_key_value_heads * cfg.head_dim * kv.dtype.size_of()
}

/// The full-attention layers of `cfg`, in order (the layers of a `PagesPut`).
pub fn attention_layers(cfg: &ModelConfig) -> Vec<usize> {
    (0..cfg.num_hidden_layers)
        .filter(|&i| cfg.layer_types[i] == LayerKind::FullAttention)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_and_budgets_parse_in_one_way() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("8G"), Ok(8 << 30));
        assert_eq!(parse_bytes("8GiB"), Ok(8 << 30));
        assert_eq!(parse_bytes("512mib"), Ok(512 << 20));
        assert_eq!(parse_bytes("2MB"), Ok(2_000_000));
        assert_eq!(parse_bytes("1B"), Ok(1));
        for bad in [
            "",
            "1.5MiB",
            "-1",
            "8 XB",
            "G",
            "99999999999999999999",
            "20000000000T",
        ] {
            assert!(parse_bytes(bad).is_err(), "{bad:?}");
        }
        assert_eq!(KvBudget::parse("8192"), Ok(KvBudget::Positions(8192)));
        assert_eq!(KvBudget::parse("64KiB"), Ok(KvBudget::Bytes(64 << 10)));
        assert!(KvBudget::parse("").is_err() && KvBudget::parse("1.5MiB").is_err());
    }
}
