//! The MTP block's tensors and their load: the same table as a main full-attention layer ([`crate::arch`]) under
//! `mtp.layers.0.`, plus `mtp.fc`, the two input norms and the final norm. A GGUF file's `nextn` names are mapped by
//! the checkpoint (`checkpoint/mtp_names.rs`).

use super::Mtp;
use crate::arch::{arch_of, Init, Read, Slot, TensorSpec};
use crate::checkpoint::{Checkpoint, VectorKind};
use crate::config::{LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::model::load::{layer_from_specs, specs_bytes};

/// The tensors of the MTP block of `c` under `prefix` (`mtp.` or `model.mtp.`): the decoder layer's, then `fc`,
/// then the three norms.
pub(super) struct MtpSpecs {
    /// The decoder layer's tensors (`{prefix}layers.0.…`), in table order.
    layer: Vec<TensorSpec>,
    /// `fc` `[H, 2H]`.
    fc: TensorSpec,
    /// `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `norm`, each `[H]`.
    norms: [TensorSpec; 3],
}

impl MtpSpecs {
    fn all(&self) -> impl Iterator<Item = &TensorSpec> {
        self.layer
            .iter()
            .chain(std::iter::once(&self.fc))
            .chain(&self.norms)
    }
}

/// A tensor outside the table: a norm gain `[H]` or the fusion `[H, 2H]`.
fn extra(name: String, shape: Vec<usize>, read: Read) -> TensorSpec {
    TensorSpec {
        name,
        shape,
        // fc is loaded alone, never fused with a layer's projections: the slot is only a label
        slot: Slot::MixIn,
        expert: None,
        rows: None,
        read,
        init: Init {
            std: 0.02,
            mean: 0.0,
        },
    }
}

/// The config of the MTP decoder layer as a one-layer model: full attention, and the feed-forward block the main
/// model's rule gives layer index 0 (vLLM's layer index of `mtp.layers.0`): dense for dense Qwen3.5, MoE for
/// Qwen3.5-MoE and Qwen3-Next.
fn layer_config(c: &ModelConfig) -> ModelConfig {
    let mut one = c.clone();
    one.num_hidden_layers = 1;
    one.layer_types = vec![LayerKind::FullAttention];
    one.ffn_types = vec![c.ffn_types[0]];
    one
}

/// The MTP block's tensors of `c` under `prefix`.
fn specs(c: &ModelConfig, prefix: &str) -> MtpSpecs {
    let one = layer_config(c);
    let trunk = one.layout.prefix();
    let layer = arch_of(c)
        .layer_tensors(&one, 0)
        .into_iter()
        .map(|mut t| {
            t.name = format!("{prefix}{}", &t.name[trunk.len()..]);
            t
        })
        .collect();
    let h = c.hidden_size;
    let norm = |n: &str| {
        extra(
            format!("{prefix}{n}.weight"),
            vec![h],
            Read::Vector(VectorKind::NormGain),
        )
    };
    MtpSpecs {
        layer,
        fc: extra(format!("{prefix}fc.weight"), vec![h, 2 * h], Read::Matrix),
        norms: [
            norm("pre_fc_norm_embedding"),
            norm("pre_fc_norm_hidden"),
            norm("norm"),
        ],
    }
}

/// The MTP block a load of `c`'s ends reads from `ck`, if any: the config asks for exactly one block
/// (`mtp_num_hidden_layers`) and the file holds every tensor of it (under `mtp.` or `model.mtp.`). A block the
/// config declares but the file lacks (a re-upload that dropped it), or more than one block (no released model has
/// them), is left out with a debug line; a present block's shapes and dtypes are checked by the load.
pub(super) fn planned(ck: &Checkpoint, c: &ModelConfig) -> Option<MtpSpecs> {
    match c.mtp_num_hidden_layers {
        0 => return None,
        1 => {}
        n => {
            tracing::debug!("{n} MTP blocks declared: only one is supported; loading none");
            return None;
        }
    }
    let prefix = if ck.contains("model.mtp.fc.weight") {
        "model.mtp."
    } else {
        "mtp."
    };
    let s = specs(c, prefix);
    if let Some(t) = s.all().find(|t| !ck.contains(&t.name)) {
        tracing::debug!(
            "{}: the config declares an MTP block but `{}` is absent; loading without it",
            ck.dir().display(),
            ck.stored_name(&t.name)
        );
        return None;
    }
    Some(s)
}

/// Bytes the load of the MTP block allocates (0 when [`planned`] gives none).
///
/// Errors: as [`crate::model::load_bytes`] for the block's tensors.
pub(crate) fn mtp_bytes(ck: &Checkpoint, c: &ModelConfig) -> Result<u64> {
    let Some(s) = planned(ck, c) else {
        return Ok(0);
    };
    let overflow = || ModelError::InvalidConfig("the weights' size overflows".into());
    let layer = specs_bytes(ck, &s.layer, c.precision)?;
    let fc = specs_bytes(ck, std::slice::from_ref(&s.fc), c.precision)?;
    let norms = specs_bytes(ck, &s.norms, c.precision)?;
    layer
        .checked_add(fc)
        .and_then(|b| b.checked_add(norms))
        .ok_or_else(overflow)
}

/// Whether a load of `c`'s ends from `ck` loads an MTP block.
pub(crate) fn mtp_loads(ck: &Checkpoint, c: &ModelConfig) -> bool {
    planned(ck, c).is_some()
}

/// Loads the block [`planned`] gives.
///
/// Errors: [`ModelError::ShapeMismatch`] / [`ModelError::UnsupportedDtype`] per tensor, as a layer's load.
pub(super) fn load(ck: &Checkpoint, c: &ModelConfig, s: &MtpSpecs) -> Result<Mtp> {
    let one = layer_config(c);
    let layer = layer_from_specs(
        &one,
        ck,
        &s.layer,
        LayerKind::FullAttention,
        one.ffn_types[0],
    )?;
    let h = c.hidden_size;
    let fc = Linear::load(ck, 2 * h, &[(s.fc.name.clone(), h, None)], c.precision)?;
    let [e, hn, n] = &s.norms;
    let read = |t: &TensorSpec| ck.read_vector(&t.name, &t.shape, VectorKind::NormGain);
    Ok(Mtp {
        enorm: read(e)?,
        hnorm: read(hn)?,
        fc,
        layer,
        norm: read(n)?,
    })
}
