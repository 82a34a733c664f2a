//! Model fingerprints: what host and worker compare in the handshake so that a worker never runs layers of a
//! different model.

use std::ops::Range;

use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;

/// Bytes read at a time when hashing a tensor (the only memory [`layer_digest`] holds for its bytes).
pub const DIGEST_CHUNK: usize = 4 << 20;

/// The digest of one decoder layer: SHA-256 over, for every tensor of layer `layer` that the architecture's table
/// lists ([`crate::arch`]; sorted by its canonical name
/// `layers.<i>.<rest>`), the canonical name, `format!("{dtype:?}{shape:?}")` and the XXH3-128 hash of its bytes (16
/// bytes little-endian). Cost: one pass over the layer's bytes, read from the file [`DIGEST_CHUNK`] bytes at a time
/// with positional reads ([`Checkpoint::read_chunks`]), so a host can fingerprint layers it does not hold without
/// their bytes ever becoming resident in its process.
///
/// Errors: [`crate::ModelError::Io`] when a read fails.
pub fn layer_digest(ckpt: &Checkpoint, config: &ModelConfig, layer: usize) -> Result<[u8; 32]> {
    let prefix = format!("{}layers.{layer}.", config.layout.prefix());
    let mut names: Vec<(String, String)> = crate::arch::arch_of(config)
        .layer_tensors(config, layer)
        .into_iter()
        .map(|t| {
            let tail = t.name[prefix.len()..].to_string();
            (format!("layers.{layer}.{tail}"), t.name)
        })
        .collect();
    names.sort();
    let mut h = Sha256::new();
    for (canon, name) in names {
        let dtype = ckpt.dtype(&name)?;
        h.update(canon.as_bytes());
        h.update(format!("{dtype:?}{:?}", ckpt.shape(&name)?).as_bytes());
        // streamed: the same value as the one-shot xxh3_128 of the bytes, read DIGEST_CHUNK at a time from the
        // file so that none of them stays resident
        let mut x = xxhash_rust::xxh3::Xxh3::new();
        ckpt.read_chunks(&name, DIGEST_CHUNK, |c| x.update(c))?;
        h.update(x.digest128().to_le_bytes());
    }
    Ok(h.finalize().into())
}

/// Combines per-layer digests ([`layer_digest`] of each layer of `layers`, in order) into the fingerprint: SHA-256
/// over the validated config's `Debug` form (with `model_type` emptied and the layout set to `CausalLm`, so the Hub
/// and CausalLM layouts of the same weights agree, and `mtp_num_hidden_layers` 0, so a file with the MTP block and
/// one without it agree), the string `layers {a}..{b}`, and the digests.
///
/// Panics if `digests.len() != layers.len()`.
pub fn combine(config: &ModelConfig, layers: Range<usize>, digests: &[[u8; 32]]) -> [u8; 32] {
    assert_eq!(digests.len(), layers.len(), "one digest per layer");
    let mut h = Sha256::new();
    let mut c = config.clone();
    c.model_type = String::new(); // layout-independent
    c.layout = crate::config::WeightLayout::CausalLm;
    c.mtp_num_hidden_layers = 0; // the MTP block is no layer of a range: files with and without it agree
    h.update(format!("{c:?}").as_bytes());
    h.update(format!("layers {}..{}", layers.start, layers.end).as_bytes());
    for d in digests {
        h.update(d);
    }
    h.finalize().into()
}

/// The fingerprint of decoder layers `layers`: [`combine`] of their [`layer_digest`]s. Two checkpoints with the same
/// fingerprint compute the same function on those layers; the layout (hub or causal, sharding) does not enter.
///
/// Cost: one pass over the layers' bytes at memory speed (XXH3), e.g. ~2 s for 20 GB.
///
/// Errors: as [`layer_digest`].
pub fn fingerprint(
    ckpt: &Checkpoint,
    config: &ModelConfig,
    layers: Range<usize>,
) -> Result<[u8; 32]> {
    let d = layers
        .clone()
        .map(|i| layer_digest(ckpt, config, i))
        .collect::<Result<Vec<_>>>()?;
    Ok(combine(config, layers, &d))
}
