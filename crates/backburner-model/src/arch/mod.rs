//! Architectures as data. Each architecture is one table of its tensors — Hugging Face and GGUF names, shapes from
//! the config, what each one feeds in a layer and how the synthetic generator draws it — and one entry in the
//! registry ([`ARCHITECTURES`]) with the `model_type`s and GGUF `general.architecture` it answers to. Loading, the
//! GGUF name map, the synthetic generator, the fingerprint, the unused-tensor report and the planner's memory model
//! all read the table, so a new architecture is one new entry and one file.

use std::ops::Range;

use crate::checkpoint::VectorKind;
use crate::config::{FfnKind, LayerKind, ModelConfig};

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
    /// The MoE router `[E, H]`.
    Router,
    /// An expert's fused gate|up projection `[2·I_e, H]` (one per expert).
    ExpertGateUp,
    /// An expert's down projection `[H, I_e]` (one per expert).
    ExpertDown,
    /// The shared expert's fused gate|up projection `[2·I_s, H]`.
    SharedGateUp,
    /// The shared expert's down projection `[H, I_s]`.
    SharedDown,
    /// The shared expert's gate `[1, H]` (its output scales by `sigmoid` of it).
    SharedGate,
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
    /// Layers whose feed-forward block is of this kind.
    Ffn(FfnKind),
    /// Layers whose feed-forward block is MoE, once per routed expert: the name holds `{e}` for its index.
    EachExpert,
    /// Gated DeltaNet layers whose `q|k|v` and `z` projections are stored by kind (`in_proj_qkv`, `in_proj_z`)
    /// when `fused` is false, or fused per k head (`in_proj_qkvz`) when it is true ([`GdnProjections`]).
    LinQkvz {
        /// Which storage the entry is.
        fused: bool,
    },
    /// Gated DeltaNet layers whose `b` and `a` projections are stored by kind (`in_proj_b`, `in_proj_a`) when
    /// `fused` is false, or fused per k head (`in_proj_ba`) when it is true.
    LinBa {
        /// Which storage the entry is.
        fused: bool,
    },
}

/// How an architecture stores the Gated DeltaNet's input projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdnProjections {
    /// Qwen3.5: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, each all heads of one kind.
    Split,
    /// Qwen3-Next: `in_proj_qkvz` (per k head: its q, k, then its v heads' v and z) and `in_proj_ba` (per k head: its
    /// v heads' b, then a); the loader gathers their rows into the split order. (Also GGUF `qwen3next` files of
    /// llama.cpp's older converters: `ssm_in` and `ssm_ba`.)
    FusedPerKHead,
    /// Qwen3-Next as llama.cpp's converter writes it (GGUF `qwen3next`): `q|k|v` and `z` split by kind (`attn_qkv`,
    /// `attn_gate`, v heads in Hugging Face's grouped order), `b|a` still fused per k head (`ssm_ba`).
    SplitQkvzFusedBa,
}

impl GdnProjections {
    /// Whether `q|k|v|z` are stored as one tensor fused per k head.
    pub fn fused_qkvz(self) -> bool {
        self == GdnProjections::FusedPerKHead
    }

    /// Whether `b|a` are stored as one tensor fused per k head.
    pub fn fused_ba(self) -> bool {
        self != GdnProjections::Split
    }
}

/// How the loader reads a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// A weight matrix `[rows, cols]`, kept in its stored format.
    Matrix,
    /// A vector read as f32 with this meaning.
    Vector(VectorKind),
}

/// The rows of a stored matrix a model reads, in order, for a config.
pub type RowSelect = fn(&ModelConfig) -> Vec<Range<usize>>;

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
    /// The stored rows the model reads, in the order it reads them (`None`: all, as stored).
    pub rows: Option<RowSelect>,
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
    /// The routed expert it belongs to ([`Applies::EachExpert`]).
    pub expert: Option<usize>,
    /// The stored rows the model reads, in order (`None`: all).
    pub rows: Option<Vec<Range<usize>>>,
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
    /// How its Gated DeltaNet input projections are stored (a config may say otherwise: [`Arch::gdn_of`]).
    pub gdn: GdnProjections,
}

/// Every architecture this build runs.
pub static ARCHITECTURES: &[&Arch] = &[&qwen35::QWEN35, &qwen35::QWEN35_MOE, &qwen35::QWEN3_NEXT];

/// The architecture of a config.
pub fn arch_of(c: &ModelConfig) -> &'static Arch {
    if c.model_type == "qwen3_next" {
        &qwen35::QWEN3_NEXT
    } else if c.moe.is_some() {
        &qwen35::QWEN35_MOE
    } else {
        &qwen35::QWEN35
    }
}

/// The architecture a GGUF `general.architecture` names, if this build runs it.
pub fn arch_of_gguf(name: &str) -> Option<&'static Arch> {
    ARCHITECTURES.iter().copied().find(|a| a.gguf_arch == name)
}

impl Arch {
    /// How `c`'s checkpoint stores the Gated DeltaNet input projections: as the config says
    /// ([`ModelConfig::gdn_projections`], set by a GGUF file), else as the architecture does.
    pub fn gdn_of(&self, c: &ModelConfig) -> GdnProjections {
        c.gdn_projections.unwrap_or(self.gdn)
    }

    /// The entries that apply to layer `i` of `c`.
    fn layer_entries<'a>(
        &'a self,
        c: &'a ModelConfig,
        i: usize,
    ) -> impl Iterator<Item = &'a Entry> {
        let gdn = self.gdn_of(c);
        let linear = c.layer_types[i] == LayerKind::LinearAttention;
        self.table.iter().filter(move |e| match e.applies {
            Applies::Ends => false,
            Applies::EveryLayer => true,
            Applies::Mixer(k) => c.layer_types[i] == k,
            Applies::Ffn(k) => c.ffn_types[i] == k,
            Applies::EachExpert => c.ffn_types[i] == FfnKind::Moe,
            Applies::LinQkvz { fused } => linear && gdn.fused_qkvz() == fused,
            Applies::LinBa { fused } => linear && gdn.fused_ba() == fused,
        })
    }

    /// The tensors of decoder layer `i` of `c`, in table order; a run of [`Applies::EachExpert`] entries once per
    /// routed expert (all of expert 0's, then expert 1's, …).
    pub fn layer_tensors(&self, c: &ModelConfig, i: usize) -> Vec<TensorSpec> {
        let p = format!("{}layers.{i}.", c.layout.prefix());
        let entries: Vec<&Entry> = self.layer_entries(c, i).collect();
        let n_experts = c.moe.as_ref().map_or(0, |m| m.num_experts);
        let mut out = Vec::new();
        let mut k = 0;
        while k < entries.len() {
            let run = entries[k..]
                .iter()
                .take_while(|e| e.applies == Applies::EachExpert)
                .count();
            if run == 0 {
                out.push(resolve(entries[k], c, format!("{p}{}", entries[k].hf)));
                k += 1;
                continue;
            }
            for x in 0..n_experts {
                for e in &entries[k..k + run] {
                    let name = format!("{p}{}", e.hf.replace("{e}", &x.to_string()));
                    let mut t = resolve(e, c, name);
                    t.expert = Some(x);
                    out.push(t);
                }
            }
            k += run;
        }
        out
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

    /// The GGUF name of a Hugging Face name (`CausalLm` layout), if the architecture has the tensor (for one
    /// expert's matrix, the 3-D tensor holding every expert's).
    pub fn gguf_name(&self, hf: &str) -> Option<String> {
        if let Some(e) = self.ends().find(|e| end_hf_name(e) == hf) {
            return Some(e.gguf.to_string());
        }
        let rest = hf.strip_prefix("model.layers.")?;
        let (idx, tail) = rest.split_once('.')?;
        let i: usize = idx.parse().ok()?;
        let e = self
            .layers()
            .find(|e| e.hf == tail || expert_of(e.hf, tail).is_some())?;
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

/// The expert index `name` gives the `{e}` of `pattern` (`mlp.experts.{e}.gate_proj.weight`), if it matches.
fn expert_of(pattern: &str, name: &str) -> Option<usize> {
    let (pre, post) = pattern.split_once("{e}")?;
    name.strip_prefix(pre)?.strip_suffix(post)?.parse().ok()
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
        expert: None,
        rows: e.rows.map(|f| f(c)),
        read: e.read,
        init: e.init,
    }
}

#[cfg(test)]
mod tests;
