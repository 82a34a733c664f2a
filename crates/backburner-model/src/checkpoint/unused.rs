//! Tensors of a GGUF file that the architecture does not use: the loader never reads them, so a file that carries
//! one (a converter's extra tensor, a tensor of another architecture, a block's tensor of the other mixer kind) is
//! reported instead of being silently loaded as if it were complete.
//!
//! Two groups are known and expected, and skipped without a warning (one `info` line per group with its count):
//! the **MTP blocks** that are not loaded (multi-token prediction, `nextn_predict_layers`: llama.cpp's converter
//! stores them as the last blocks, past the model's layers, with `nextn` tensors; the first one is loaded when the
//! config asks for it, [`crate::model::Mtp`], the others and the dedicated `nextn.embed_tokens` /
//! `nextn.shared_head_head` of other architectures never are) and **vision** tensors (`v.*`, `mm.*`: a multimodal
//! projector, normally in a separate `mmproj` file). Every other unused tensor is a warning naming it.

use std::collections::HashSet;

use super::{Checkpoint, Inner};
use crate::config::ModelConfig;

/// Most unused tensors named one by one in the log; the rest are counted in one more line.
const MAX_NAMED: usize = 16;

/// The tensors of a checkpoint that a load of the whole model does not read ([`unused_tensors`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UnusedTensors {
    /// Unused tensors outside the known groups, as the file names them (sorted): each is a warning.
    pub unknown: Vec<String>,
    /// Tensors of the MTP blocks that the load does not read (blocks past the model's layers, or names with `nextn`
    /// / `mtp`).
    pub mtp: usize,
    /// Vision tensors (`v.*`, `mm.*`).
    pub vision: usize,
}

/// Whether an unused GGUF tensor is part of the MTP blocks.
fn is_mtp(name: &str, n_layers: usize) -> bool {
    let block_past_layers = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(i, _)| i.parse::<usize>().ok())
        .is_some_and(|i| i >= n_layers);
    block_past_layers || name.contains(".nextn.") || name.starts_with("mtp.")
}

/// Whether an MTP tensor is one the load of the MTP block reads (config `mtp_num_hidden_layers` = 1): the first
/// MTP block's, less the dedicated embedding and head that Qwen's blocks do not have.
fn read_by_mtp(name: &str, config: &ModelConfig) -> bool {
    let first = format!("blk.{}.", config.num_hidden_layers);
    config.mtp_num_hidden_layers == 1
        && name.starts_with(&first)
        && !name.contains(".nextn.embed_tokens.")
        && !name.contains(".nextn.shared_head_head.")
}

/// Whether an unused GGUF tensor is a vision tensor (llama.cpp's `clip` names).
fn is_vision(name: &str) -> bool {
    name.starts_with("v.") || name.starts_with("mm.")
}

/// The tensors of `ckpt` that a load of the whole model of `config` (every layer and the ends) does not read. For
/// a GGUF file: its tensors by their stored names, sorted into the MTP and vision groups and the rest. A safetensors
/// checkpoint reports none (its loader reads Hugging Face names; the hub layout's `mtp.*` and `model.visual.*` are
/// skipped by design).
pub fn unused_tensors(ckpt: &Checkpoint, config: &ModelConfig) -> UnusedTensors {
    let Inner::Gguf(g) = &ckpt.inner else {
        return UnusedTensors::default();
    };
    let read: HashSet<String> = crate::model::read_names(config).into_iter().collect();
    let mtp_read = crate::model::mtp_loads(ckpt, config);
    let mut out = UnusedTensors::default();
    for name in g.stored_names() {
        let used = match g.arch().hf_name(name) {
            Some(h) => read.contains(&h.replace("{e}", "0")),
            None => g.maps(name) && !is_mtp(name, config.num_hidden_layers),
        };
        if used || (mtp_read && read_by_mtp(name, config)) {
            continue;
        }
        if is_mtp(name, config.num_hidden_layers) {
            out.mtp += 1;
        } else if is_vision(name) {
            out.vision += 1;
        } else {
            out.unknown.push(name.to_string());
        }
    }
    out.unknown.sort();
    out
}

/// Logs [`unused_tensors`]: a warning per unknown tensor (the first [`MAX_NAMED`], then one line with the count of
/// the rest) and one `info` line per known group.
pub fn log_unused_tensors(ckpt: &Checkpoint, config: &ModelConfig) {
    let u = unused_tensors(ckpt, config);
    let file = ckpt.dir().display();
    for name in u.unknown.iter().take(MAX_NAMED) {
        tracing::warn!(
            "{file}: tensor `{name}` is not used by the {} architecture with this file's config; it is not loaded",
            crate::arch::arch_of(config).gguf_arch
        );
    }
    if u.unknown.len() > MAX_NAMED {
        tracing::warn!(
            "{file}: {} more tensors are not used by the architecture and are not loaded",
            u.unknown.len() - MAX_NAMED
        );
    }
    if u.mtp > 0 {
        tracing::info!(
            "{file}: skipping the {} tensors of the MTP blocks (multi-token prediction is not used)",
            u.mtp
        );
    }
    if u.vision > 0 {
        tracing::info!(
            "{file}: skipping {} vision tensors (this engine reads text only)",
            u.vision
        );
    }
}
