//! Loading a layer's weights from a checkpoint, and the bytes a load will allocate, from the architecture's tensor
//! table ([`crate::arch`]).

use std::collections::HashMap;
use std::ops::Range;

use super::{AttnWeights, Ffn, GdnWeights, Layer, LoadOptions, Mixer, MoeWeights};
use crate::arch::{arch_of, Read, Slot, TensorSpec};
use crate::checkpoint::{dense_dtype, unsupported, Checkpoint, StoredDtype, VectorKind};
use crate::config::{FfnKind, LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::linear::{Linear, PartSpec};
use backburner_kernels::matmul::Precision;

/// A fused projection as the loader reads it: its parts (tensor name, rows, the rows read) concatenated by rows,
/// and its input width.
type Fused = (Vec<PartSpec>, usize);

/// A projection's place: its slot and, for a routed expert's, the expert.
type Key = (Slot, Option<usize>);

/// The matrices of `specs` fused by slot and expert (parts in table order), in the order they first appear.
fn fused(specs: &[TensorSpec]) -> Vec<(Key, Fused)> {
    let mut out: Vec<(Key, Fused)> = Vec::new();
    for t in specs.iter().filter(|t| t.read == Read::Matrix) {
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let key = (t.slot, t.expert);
        match out.iter_mut().find(|(k, _)| *k == key) {
            Some((_, (parts, _))) => parts.push((t.name.clone(), rows, t.rows.clone())),
            None => out.push((key, (vec![(t.name.clone(), rows, t.rows.clone())], cols))),
        }
    }
    out
}

/// The vectors of `specs`: (slot, name, shape, meaning).
fn vectors(specs: &[TensorSpec]) -> impl Iterator<Item = (Slot, &TensorSpec, VectorKind)> {
    specs.iter().filter_map(|t| match t.read {
        Read::Vector(k) => Some((t.slot, t, k)),
        Read::Matrix => None,
    })
}

/// Hugging Face names of every tensor a load of the whole model reads: the ends (embedding, final norm and, unless
/// tied, the head) and each layer's projections and vectors.
pub(crate) fn read_names(c: &ModelConfig) -> Vec<String> {
    arch_of(c).read_names(c)
}

/// The ends: the embedding, the final norm's gain and (unless tied) the head. transformers ties the head to the
/// embedding whenever `tie_word_embeddings` is set, even if the file also stores an `lm_head`.
pub(super) fn load_ends(
    c: &ModelConfig,
    ck: &Checkpoint,
) -> Result<(Linear, Vec<f32>, Option<Linear>)> {
    let specs = arch_of(c).end_tensors(c);
    let mut lin: HashMap<Key, Linear> = HashMap::new();
    for (key, (parts, k)) in fused(&specs) {
        lin.insert(key, Linear::load(ck, k, &parts, c.precision)?);
    }
    let (_, t, kind) = vectors(&specs)
        .find(|(s, _, _)| *s == Slot::FinalNorm)
        .expect("the table lists the final norm");
    let norm = ck.read_vector(&t.name, &t.shape, kind)?;
    let embed = lin
        .remove(&(Slot::Embed, None))
        .expect("the table lists the embedding");
    Ok((embed, norm, lin.remove(&(Slot::Head, None))))
}

/// Layer `i`, without the routed experts for which `elsewhere(i, expert)` holds (`None` in its expert list).
pub(super) fn load_layer(
    c: &ModelConfig,
    ck: &Checkpoint,
    i: usize,
    elsewhere: &dyn Fn(usize, usize) -> bool,
) -> Result<Layer> {
    let mut specs = arch_of(c).layer_tensors(c, i);
    specs.retain(|t| t.expert.is_none_or(|e| !elsewhere(i, e)));
    layer_from_specs(c, ck, &specs, c.layer_types[i], c.ffn_types[i])
}

/// A layer of mixer `mixer` and feed-forward block `ffn` from its tensors `specs` (as [`Arch::layer_tensors`]
/// lists them; a routed expert left out of `specs` is `None` in the expert list).
///
/// [`Arch::layer_tensors`]: crate::arch::Arch::layer_tensors
pub(super) fn layer_from_specs(
    c: &ModelConfig,
    ck: &Checkpoint,
    specs: &[TensorSpec],
    mixer: LayerKind,
    ffn: FfnKind,
) -> Result<Layer> {
    let mut lin: HashMap<Key, Linear> = HashMap::new();
    for (key, (parts, k)) in fused(specs) {
        lin.insert(key, Linear::load(ck, k, &parts, c.precision)?);
    }
    let mut vec: HashMap<Slot, Vec<f32>> = HashMap::new();
    for (slot, t, kind) in vectors(specs) {
        vec.insert(slot, ck.read_vector(&t.name, &t.shape, kind)?);
    }
    let mut v = |s: Slot| vec.remove(&s).expect("the table lists every vector");
    let mut m = |s: Slot| {
        lin.remove(&(s, None))
            .expect("the table lists every projection")
    };
    let (in_proj, out_proj) = (m(Slot::MixIn), m(Slot::MixOut));
    let ffn = match ffn {
        FfnKind::Dense => Ffn::Dense {
            gate_up: m(Slot::FfnGateUp),
            down: m(Slot::FfnDown),
        },
        FfnKind::Moe => {
            let (router, shared_gate_up) = (m(Slot::Router), m(Slot::SharedGateUp));
            let (shared_down, shared_gate) = (m(Slot::SharedDown), m(Slot::SharedGate));
            let mc = c.moe.as_ref().expect("an MoE layer has MoE settings");
            let experts = (0..mc.num_experts)
                .map(|e| {
                    let gu = lin.remove(&(Slot::ExpertGateUp, Some(e)))?;
                    let down = lin.remove(&(Slot::ExpertDown, Some(e)))?;
                    Some((gu, down))
                })
                .collect();
            Ffn::Moe(Box::new(MoeWeights {
                router,
                experts,
                shared_gate_up,
                shared_down,
                shared_gate,
                top_k: mc.num_experts_per_tok,
                norm_topk_prob: mc.norm_topk_prob,
            }))
        }
    };
    let mixer = match mixer {
        LayerKind::LinearAttention => Mixer::Linear(GdnWeights {
            in_proj,
            conv_weight: v(Slot::Conv),
            dt_bias: v(Slot::DtBias),
            neg_a: v(Slot::DecayA),
            norm: v(Slot::GatedNorm),
            out_proj,
        }),
        LayerKind::FullAttention => Mixer::Attention(AttnWeights {
            qkv: in_proj,
            q_norm: v(Slot::QNorm),
            k_norm: v(Slot::KNorm),
            o_proj: out_proj,
        }),
    };
    Ok(Layer {
        input_norm: v(Slot::InputNorm),
        post_norm: v(Slot::PostNorm),
        mixer,
        ffn,
    })
}

/// The routed experts `ids` of MoE layer `i` (index = expert id; `None` for the others).
///
/// Errors: as the layer's load; [`ModelError::InvalidConfig`] if layer `i` is not an MoE layer.
pub(super) fn load_experts(
    c: &ModelConfig,
    ck: &Checkpoint,
    i: usize,
    ids: &[usize],
) -> Result<Vec<Option<(Linear, Linear)>>> {
    let Some(mc) = c.moe.as_ref().filter(|_| c.ffn_types[i] == FfnKind::Moe) else {
        return Err(ModelError::InvalidConfig(format!(
            "layer {i} has no routed experts"
        )));
    };
    let mut specs = arch_of(c).layer_tensors(c, i);
    specs.retain(|t| t.expert.is_some_and(|e| ids.contains(&e)));
    let mut lin: HashMap<Key, Linear> = HashMap::new();
    for (key, (parts, k)) in fused(&specs) {
        lin.insert(key, Linear::load(ck, k, &parts, c.precision)?);
    }
    Ok((0..mc.num_experts)
        .map(|e| {
            let gu = lin.remove(&(Slot::ExpertGateUp, Some(e)))?;
            Some((gu, lin.remove(&(Slot::ExpertDown, Some(e)))?))
        })
        .collect())
}

/// Bytes [`load_experts`] allocates for the experts `ids` of each MoE layer of `layers` (dense layers hold none).
///
/// Errors: as [`load_bytes`].
pub fn experts_bytes(
    ckpt: &Checkpoint,
    c: &ModelConfig,
    layers: Range<usize>,
    ids: &[usize],
) -> Result<u64> {
    let overflow = || ModelError::InvalidConfig("the weights' size overflows".into());
    let mut total = 0u64;
    for i in layers.filter(|&i| i < c.num_hidden_layers && c.ffn_types[i] == FfnKind::Moe) {
        let mut specs = arch_of(c).layer_tensors(c, i);
        specs.retain(|t| t.expert.is_some_and(|e| ids.contains(&e)));
        total = total
            .checked_add(specs_bytes(ckpt, &specs, c.precision)?)
            .ok_or_else(overflow)?;
    }
    Ok(total)
}

/// Bytes of a vector the load reads as f32 (4 per element), checked as that read checks it: present, of `shape`,
/// in a dtype it converts.
fn vector_bytes(ckpt: &Checkpoint, name: &str, shape: &[usize]) -> Result<u64> {
    ckpt.check_shape(name, shape)?;
    let d = ckpt.dtype(name)?;
    if let StoredDtype::Other(_) = d {
        return Err(unsupported(&ckpt.stored_name(name), &d));
    }
    shape
        .iter()
        .try_fold(4u64, |a, &x| a.checked_mul(x as u64))
        .ok_or_else(|| ModelError::InvalidConfig("the weights' size overflows".into()))
}

/// Bytes of a fused projection: the parts' rows packed in their common dtype, checked as the load checks them.
fn linear_bytes(ckpt: &Checkpoint, parts: &[PartSpec], k: usize, p: Precision) -> Result<u64> {
    use backburner_kernels::matmul::WeightDtype;
    let formats = parts
        .iter()
        .map(|(name, rows, _)| {
            // the shape first: a size from the config that the file does not have is named as such
            ckpt.check_shape(name, &[*rows, k])?;
            let d = ckpt.dtype(name)?;
            match (&d, dense_dtype(&d)) {
                (_, Some(dense)) => Ok((None, dense, *rows)),
                (StoredDtype::Quant(q), None) => Ok((Some(*q), WeightDtype::F32, *rows)),
                _ => Err(unsupported(&ckpt.stored_name(name), &d)),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    crate::linear::packed_bytes(&formats, k, p)
        .map(|b| b as u64)
        .ok_or_else(|| ModelError::InvalidConfig("the weights' size overflows".into()))
}

/// Bytes of the tensors `specs` as loaded: matrices fused by slot and packed, vectors as f32.
pub(super) fn specs_bytes(ckpt: &Checkpoint, specs: &[TensorSpec], p: Precision) -> Result<u64> {
    let overflow = || ModelError::InvalidConfig("the weights' size overflows".into());
    let mut total = 0u64;
    for (_, (parts, k)) in fused(specs) {
        total = total
            .checked_add(linear_bytes(ckpt, &parts, k, p)?)
            .ok_or_else(overflow)?;
    }
    for (_, t, _) in vectors(specs) {
        total = total
            .checked_add(vector_bytes(ckpt, &t.name, &t.shape)?)
            .ok_or_else(overflow)?;
    }
    Ok(total)
}

/// Bytes [`Model::from_checkpoint`](super::Model::from_checkpoint) will allocate for the weights `opts` names,
/// computed from the checkpoint's tensor headers alone (nothing is read or allocated): each fused projection packed
/// in its parts' common dtype with its panel padding
/// ([`PackedMatrix::packed_bytes`](backburner_kernels::matmul::PackedMatrix::packed_bytes)), and 4 bytes per element
/// of every vector read as f32. Equals [`Model::weight_bytes`](super::Model::weight_bytes) of the loaded model, so a
/// caller can check a memory budget before loading. (The load's transient memory is the file pages it reads, which
/// it releases tensor by tensor, and a few small allocations.)
///
/// A load of the ends also loads the MTP block when the config asks for it and the file holds it
/// ([`super::Mtp`]); its bytes are counted then.
///
/// Errors: [`ModelError::InvalidConfig`] for a layer range outside the model or a size that overflows `u64`;
/// [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`] and [`ModelError::UnsupportedDtype`] for any tensor
/// the load would read (the ends' embedding, final norm and untied head, every layer's projections and vectors, the
/// MTP block's), as the load itself reports them.
pub fn load_bytes(ckpt: &Checkpoint, c: &ModelConfig, opts: &LoadOptions) -> Result<u64> {
    load_bytes_without(ckpt, c, opts, &|_, _| false)
}

/// As [`load_bytes`], for a load that leaves out the routed experts for which `elsewhere(layer, expert)` holds
/// ([`Model::from_checkpoint_without`](super::Model::from_checkpoint_without)).
///
/// Errors: as [`load_bytes`].
pub fn load_bytes_without(
    ckpt: &Checkpoint,
    c: &ModelConfig,
    opts: &LoadOptions,
    elsewhere: &dyn Fn(usize, usize) -> bool,
) -> Result<u64> {
    if opts.layers.end > c.num_hidden_layers || opts.layers.start > opts.layers.end {
        return Err(ModelError::InvalidConfig(format!(
            "layer range {:?} is outside 0..{}",
            opts.layers, c.num_hidden_layers
        )));
    }
    let overflow = || ModelError::InvalidConfig("the weights' size overflows".into());
    let arch = arch_of(c);
    let mut total = 0u64;
    if opts.ends {
        total = specs_bytes(ckpt, &arch.end_tensors(c), c.precision)?;
    }
    for i in opts.layers.clone() {
        let mut specs = arch.layer_tensors(c, i);
        specs.retain(|t| t.expert.is_none_or(|e| !elsewhere(i, e)));
        total = total
            .checked_add(specs_bytes(ckpt, &specs, c.precision)?)
            .ok_or_else(overflow)?;
    }
    if opts.ends {
        total = total
            .checked_add(super::mtp::mtp_bytes(ckpt, c)?)
            .ok_or_else(overflow)?;
    }
    Ok(total)
}
