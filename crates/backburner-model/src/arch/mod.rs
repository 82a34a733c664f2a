//! Architectures as data. Each architecture is one table of its tensors — Hugging Face and GGUF names, shapes from
//! the config, what each one feeds in a layer and how the synthetic generator draws it — and one entry in the
//! registry ([`ARCHITECTURES`]) with the `model_type`s and GGUF `general.architecture` it answers to. Loading, the
//! GGUF name map, the synthetic generator, the fingerprint, the unused-tensor report and the planner's memory model
//! all read the table, so a new architecture is one new entry and one file.

use crate::checkpoint::VectorKind;
use crate::config::{LayerKind, ModelConfig};

mod qwen35;

/// Which weight of a layer (or of the model's ends) a tensor feeds. Matrices with the same slot are fused by rows, in
/// table order, into one projection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    /// The token embedding `[V, H]` (also the head when tied).
    Embed,
    /// The final norm's gain `[H]`.
    FinalNorm,
    /// The untied output head `[V, H]`.
    Head,
    /// The layer's input RMSNorm gain `[H]`.
    InputNorm,
    /// The RMSNorm gain before the feed-forward block `[H]`.
    PostNorm,
    /// The dense feed-forward block's fused gate|up projection `[2I, H]`.
    FfnGateUp,
    /// The dense feed-forward block's down projection `[H, I]`.
    FfnDown,
    /// The mixer's fused input projection (Gated DeltaNet `qkv|z|b|a`, attention `q|k|v`).
    MixIn,
    /// The mixer's output projection.
    MixOut,
    /// Gated DeltaNet conv kernel `[conv_dim, 1, kernel]`.
    Conv,
    /// Gated DeltaNet `dt_bias` `[Hv]`.
    DtBias,
    /// Gated DeltaNet decay `A_log` `[Hv]` (read as `A = −exp(A_log)`).
    DecayA,
    /// Gated DeltaNet gated norm `[Dv]`.
    GatedNorm,
    /// Attention q norm `[D]`.
    QNorm,
    /// Attention k norm `[D]`.
    KNorm,
}

/// The layers a table entry belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applies {
    /// The model's ends (embedding, final norm, head): once per model.
    Ends,
    /// Every decoder layer.
    EveryLayer,
    /// Layers whose mixer is of this kind.
    Mixer(LayerKind),
}

/// How the loader reads a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// A weight matrix `[rows, cols]`, kept in its stored format.
    Matrix,
    /// A vector read as f32 with this meaning.
    Vector(VectorKind),
}

/// One row of an architecture's tensor table: the name suffixes and a shape rule, independent of any config.
#[derive(Clone, Copy, Debug)]
pub struct Entry {
    /// Hugging Face name after the layer prefix (`mlp.gate_proj.weight`), or, for the ends, after the decoder prefix
    /// (`embed_tokens.weight`), except the head's full name `lm_head.weight`.
    pub hf: &'static str,
    /// GGUF name after `blk.N.` (or the whole name for the ends), as llama.cpp's converter writes it.
    pub gguf: &'static str,
    /// Where the entry applies.
    pub applies: Applies,
    /// What it feeds.
    pub slot: Slot,
    /// How it is read.
    pub read: Read,
    /// Its Hugging Face shape for a config.
    pub shape: fn(&ModelConfig) -> Vec<usize>,
    /// The synthetic generator's draw: N(mean, std) per element.
    pub init: Init,
}

/// A normal distribution the synthetic generator draws a tensor's elements from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Init {
    /// Standard deviation.
    pub std: f64,
    /// Mean.
    pub mean: f64,
}

/// One tensor of a concrete model: an [`Entry`] resolved for a config and a layer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// The checkpoint name in the config's layout (`model.language_model.layers.3.…` for the hub layout).
    pub name: String,
    /// Hugging Face shape.
    pub shape: Vec<usize>,
    /// What it feeds.
    pub slot: Slot,
    /// How it is read.
    pub read: Read,
    /// The synthetic draw.
    pub init: Init,
}

impl TensorSpec {
    /// Elements (saturating: a size that overflows never fits anywhere).
    pub fn elements(&self) -> u64 {
        self.shape
            .iter()
            .fold(1u64, |a, &x| a.saturating_mul(x as u64))
    }
}

/// A registered architecture.
#[derive(Debug)]
pub struct Arch {
    /// Our name for it.
    pub name: &'static str,
    /// GGUF `general.architecture`.
    pub gguf_arch: &'static str,
    /// Its tensor table, in the synthetic generator's draw order (per layer: norms, feed-forward, mixer).
    pub table: &'static [Entry],
}

/// Every architecture this build runs.
pub static ARCHITECTURES: &[&Arch] = &[&qwen35::QWEN35];

/// The architecture of a config. (One today; the config will name it when there are several.)
pub fn arch_of(_c: &ModelConfig) -> &'static Arch {
    &qwen35::QWEN35
}

/// The architecture a GGUF `general.architecture` names, if this build runs it.
pub fn arch_of_gguf(name: &str) -> Option<&'static Arch> {
    ARCHITECTURES.iter().copied().find(|a| a.gguf_arch == name)
}

impl Arch {
    /// The entries that apply to layer `i` of `c`.
    fn layer_entries<'a>(
        &'a self,
        c: &'a ModelConfig,
        i: usize,
    ) -> impl Iterator<Item = &'a Entry> {
        self.table.iter().filter(move |e| match e.applies {
            Applies::Ends => false,
            Applies::EveryLayer => true,
            Applies::Mixer(k) => c.layer_types[i] == k,
        })
    }

    /// The tensors of decoder layer `i` of `c`, in table order.
    pub fn layer_tensors(&self, c: &ModelConfig, i: usize) -> Vec<TensorSpec> {
        let p = format!("{}layers.{i}.", c.layout.prefix());
        self.layer_entries(c, i)
            .map(|e| resolve(e, c, format!("{p}{}", e.hf)))
            .collect()
    }

    /// The tensors of the model's ends (the head only when not tied), in table order.
    pub fn end_tensors(&self, c: &ModelConfig) -> Vec<TensorSpec> {
        self.table
            .iter()
            .filter(|e| e.applies == Applies::Ends)
            .filter(|e| !(e.slot == Slot::Head && c.tie_word_embeddings))
            .map(|e| {
                let name = if e.slot == Slot::Head {
                    e.hf.to_string()
                } else {
                    format!("{}{}", c.layout.prefix(), e.hf)
                };
                resolve(e, c, name)
            })
            .collect()
    }

    /// Hugging Face names (`CausalLm` layout) of every tensor a load of the whole model reads.
    pub fn read_names(&self, c: &ModelConfig) -> Vec<String> {
        let mut out: Vec<String> = self.end_tensors(c).into_iter().map(|t| t.name).collect();
        for i in 0..c.num_hidden_layers {
            out.extend(self.layer_tensors(c, i).into_iter().map(|t| t.name));
        }
        out
    }

    /// Elements of layer `i`'s weights.
    pub fn layer_elements(&self, c: &ModelConfig, i: usize) -> u64 {
        self.layer_tensors(c, i)
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.elements()))
    }

    /// The GGUF name of a Hugging Face name (`CausalLm` layout), if the architecture has the tensor.
    pub fn gguf_name(&self, hf: &str) -> Option<String> {
        if let Some(e) = self.ends().find(|e| end_hf_name(e) == hf) {
            return Some(e.gguf.to_string());
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (idx, tail) = rest.split_once('.')?;
        let i: usize = idx.parse().ok()?;
        let e = self.layers().find(|e| e.hf == tail)?;
        Some(format!("blk.{i}.{}", e.gguf))
    }

    /// The Hugging Face name (`CausalLm` layout) of a GGUF name, if the architecture reads it (MTP and vision
    /// tensors map to none).
    pub fn hf_name(&self, gguf: &str) -> Option<String> {
        if let Some(e) = self.ends().find(|e| e.gguf == gguf) {
            return Some(end_hf_name(e));
        }
        let rest = gguf.strip_prefix("blk.")?;
        let (idx, tail) = rest.split_once('.')?;
        let i: usize = idx.parse().ok()?;
        let e = self.layers().find(|e| e.gguf == tail)?;
        Some(format!("model.layers.{i}.{}", e.hf))
    }

    fn ends(&self) -> impl Iterator<Item = &Entry> {
        self.table.iter().filter(|e| e.applies == Applies::Ends)
    }

    fn layers(&self) -> impl Iterator<Item = &Entry> {
        self.table.iter().filter(|e| e.applies != Applies::Ends)
    }
}

fn end_hf_name(e: &Entry) -> String {
    if e.slot == Slot::Head {
        e.hf.to_string()
    } else {
        format!("model.{}", e.hf)
    }
}

fn resolve(e: &Entry, c: &ModelConfig, name: String) -> TensorSpec {
    TensorSpec {
        name,
        shape: (e.shape)(c),
        slot: e.slot,
        read: e.read,
        init: e.init,
    }
}

#[cfg(test)]
mod tests;
