//! Model fingerprints: what host and worker compare in the handshake so that a worker never runs layers of a
//! different model.

use std::ops::Range;

use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;

/// SHA-256 over the validated config (its `Debug` form: every field that affects the math) and, for every tensor of
/// decoder layers `layers` (sorted by name), its name, dtype, shape and the XXH3-128 hash of its bytes. Two
/// checkpoints with the same fingerprint compute the same function on those layers; the layout (hub or causal,
/// sharding) does not enter.
///
/// Cost: one pass over the layers' bytes at memory speed (XXH3), e.g. ~2 s for 20 GB.
///
/// Errors: [`crate::ModelError::MissingTensor`] cannot happen (only present names are read); errors reading the mmap
/// surface as [`crate::ModelError::CorruptSafetensors`].
pub fn fingerprint(
    ckpt: &Checkpoint,
    config: &ModelConfig,
    layers: Range<usize>,
) -> Result<[u8; 32]> {
    let mut h = Sha256::new();
    let mut c = config.clone();
    c.model_type = String::new(); // layout-independent
    c.layout = crate::config::WeightLayout::CausalLm;
    h.update(format!("{c:?}").as_bytes());
    h.update(format!("layers {}..{}", layers.start, layers.end).as_bytes());
    let prefix = config.layout.prefix();
    let mut names: Vec<(String, &str)> = Vec::new();
    for name in ckpt.names() {
        let Some(rest) = name
            .strip_prefix(prefix)
            .and_then(|r| r.strip_prefix("layers."))
        else {
            continue;
        };
        let Some((idx, tail)) = rest.split_once('.') else {
            continue;
        };
        let Ok(i) = idx.parse::<usize>() else {
            continue;
        };
        if layers.contains(&i) {
            names.push((format!("layers.{i}.{tail}"), name));
        }
    }
    names.sort();
    for (canon, name) in names {
        let (dtype, bytes) = ckpt.raw(name)?;
        h.update(canon.as_bytes());
        h.update(format!("{dtype:?}{:?}", ckpt.shape(name)?).as_bytes());
        h.update(xxhash_rust::xxh3::xxh3_128(bytes).to_le_bytes());
    }
    Ok(h.finalize().into())
}
