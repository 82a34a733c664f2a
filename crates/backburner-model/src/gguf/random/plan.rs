//! What a generated file holds: the config as the GGUF reader will see it, every tensor of the architecture's table
//! with its GGUF name, dims and type, and the metadata.

use super::blocks::{Draw, ValueMap};
use super::rule::{choose, Fallback, TypeRule};
use super::vocab::{write_vocab, Vocab};
use crate::arch::{arch_of, Arch, GdnProjections, Read, Slot, TensorSpec};
use crate::checkpoint::VectorKind;
use crate::config::{FfnKind, ModelConfig, VHeadOrder, WeightLayout};
use crate::error::{ModelError, Result};
use crate::gguf::metadata::{MetaArray, MetaValue};
use crate::gguf::writer::GgufWriter;
use crate::gguf::GgmlType;

/// One tensor of a generated file.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    /// GGUF name (`blk.3.attn_q.weight`).
    pub name: String,
    /// Dims in ggml order (`dims[0]`, the row length, first); the routed experts' matrices are one 3-D tensor
    /// `[cols, rows, experts]` per kind.
    pub dims: Vec<u64>,
    /// The type the rule asked for.
    pub requested: GgmlType,
    /// The type written.
    pub ggml_type: GgmlType,
    /// Why `ggml_type` differs from `requested`, when it does.
    pub fallback: Option<Fallback>,
    /// Stored bytes.
    pub n_bytes: u64,
    /// How its values are drawn.
    pub draw: Draw,
}

impl PlannedTensor {
    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// `c` as a GGUF file of its architecture describes it, which is what [`crate::gguf::config_from_gguf`] reads back:
/// the causal-LM layout and the default RoPE type; for `qwen35` / `qwen35moe` the converter's tiled v-head order; for
/// an MoE model every layer MoE with the top k renormalized (neither GGUF architecture can say otherwise); for
/// `qwen3next` the current converter's split `attn_qkv` / `attn_gate` with `ssm_ba` fused per k head. The eos ids
/// are left for the vocabulary to set.
pub(super) fn gguf_view(c: &ModelConfig) -> (ModelConfig, &'static Arch) {
    let arch = arch_of(c);
    let mut g = c.clone();
    g.layout = WeightLayout::CausalLm;
    g.rope.rope_type = Some("default".into());
    g.model_type = match arch.gguf_arch {
        "qwen3next" => "qwen3_next",
        "qwen35moe" => "qwen3_5_moe_text",
        _ => "qwen3_5_text",
    }
    .into();
    if let Some(m) = g.moe.as_mut() {
        m.norm_topk_prob = true;
        g.ffn_types = vec![FfnKind::Moe; g.num_hidden_layers];
    }
    if arch.gguf_arch == "qwen3next" {
        g.gdn_projections = Some(GdnProjections::SplitQkvzFusedBa);
        g.linear_v_head_order = VHeadOrder::Grouped;
    } else {
        g.gdn_projections = None;
        g.linear_v_head_order = VHeadOrder::Tiled;
    }
    (g, arch)
}

/// The GGUF dims of a table tensor: the Hugging Face shape reversed, the conv kernel `[kernel, conv_dim]` and the
/// shared expert's gate `[H]` as llama.cpp stores them; a routed expert's matrix gets the expert count appended.
fn gguf_dims(t: &TensorSpec, n_experts: usize) -> Vec<u64> {
    let mut dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
    if matches!(t.slot, Slot::Conv | Slot::SharedGate) {
        dims.retain(|&d| d != 1);
    }
    if t.expert.is_some() {
        dims.push(n_experts as u64);
    }
    dims
}

fn draw_of(t: &TensorSpec) -> Draw {
    let map = match t.read {
        Read::Vector(VectorKind::NormGain) => ValueMap::OnePlus,
        Read::Vector(VectorKind::NegExp) => ValueMap::NegExp,
        _ => ValueMap::Plain,
    };
    Draw {
        mean: t.init.mean,
        std: t.init.std,
        map,
    }
}

/// Every tensor of `c` (already [`gguf_view`]ed) in the table's order (the ends, then layer by layer), the routed
/// experts once per kind, typed by `rule`.
pub(super) fn tensors(c: &ModelConfig, arch: &Arch, rule: &TypeRule) -> Result<Vec<PlannedTensor>> {
    let n_experts = c.moe.as_ref().map_or(0, |m| m.num_experts);
    let specs = arch
        .end_tensors(c)
        .into_iter()
        .chain((0..c.num_hidden_layers).flat_map(|i| arch.layer_tensors(c, i)));
    let mut out = Vec::new();
    for t in specs.filter(|t| t.expert.is_none_or(|e| e == 0)) {
        let name = arch.gguf_name(&t.name).ok_or_else(|| {
            ModelError::InvalidConfig(format!("{} has no GGUF name in {}", t.name, arch.name))
        })?;
        let dims = gguf_dims(&t, n_experts);
        // llama-quantize quantizes matrices, but neither the conv kernel (read as a vector) nor the MoE router
        let quantizable = t.read == Read::Matrix && dims.len() >= 2 && t.slot != Slot::Router;
        let (requested, ggml_type, fallback) = choose(rule, &name, dims[0], quantizable);
        let (be, bb) = ggml_type
            .block()
            .expect("a generated type has a block size");
        let elements: u64 = dims.iter().product();
        out.push(PlannedTensor {
            name,
            requested,
            ggml_type,
            fallback,
            n_bytes: elements / be as u64 * bb as u64,
            draw: draw_of(&t),
            dims,
        });
    }
    Ok(out)
}

/// The architecture's keys of `c` (already [`gguf_view`]ed), as llama.cpp's converter writes them.
fn arch_keys(w: &mut GgufWriter, c: &ModelConfig, arch: &str) {
    let a = |k: &str| format!("{arch}.{k}");
    let u = |x: usize| MetaValue::U32(x as u32);
    w.kv("general.architecture", MetaValue::Str(arch.into()));
    for (k, v) in [
        ("block_count", c.num_hidden_layers),
        ("context_length", c.max_position_embeddings),
        ("embedding_length", c.hidden_size),
        ("feed_forward_length", c.intermediate_size),
        ("vocab_size", c.vocab_size),
        ("attention.head_count", c.num_attention_heads),
        ("attention.head_count_kv", c.num_key_value_heads),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("rope.dimension_count", c.rotary_dim()),
        ("ssm.conv_kernel", c.linear_conv_kernel_dim),
        ("ssm.state_size", c.linear_key_head_dim),
        ("ssm.group_count", c.linear_num_key_heads),
        ("ssm.time_step_rank", c.linear_num_value_heads),
        (
            "ssm.inner_size",
            c.linear_num_value_heads * c.linear_value_head_dim,
        ),
        ("full_attention_interval", c.full_attention_interval),
    ] {
        w.kv(&a(k), u(v));
    }
    w.kv(
        &a("rope.freq_base"),
        MetaValue::F32(c.rope.rope_theta as f32),
    )
    .kv(
        &a("attention.layer_norm_rms_epsilon"),
        MetaValue::F32(c.rms_norm_eps as f32),
    );
    let recurrent = c
        .layer_types
        .iter()
        .map(|&k| k == crate::LayerKind::LinearAttention);
    w.kv(
        &a("attention.recurrent_layers"),
        MetaValue::Array(MetaArray::Bool(recurrent.collect())),
    );
    let mut sections: Vec<i32> = (c.rope.mrope_section.iter().flatten())
        .map(|&x| x as i32)
        .collect();
    sections.resize(sections.len().max(4), 0);
    w.kv(
        &a("rope.dimension_sections"),
        MetaValue::Array(MetaArray::I32(sections)),
    );
    if let Some(m) = &c.moe {
        for (k, v) in [
            ("expert_count", m.num_experts),
            ("expert_used_count", m.num_experts_per_tok),
            ("expert_feed_forward_length", m.moe_intermediate_size),
            (
                "expert_shared_feed_forward_length",
                m.shared_expert_intermediate_size,
            ),
        ] {
            w.kv(&a(k), u(v));
        }
    }
}

/// A writer holding the metadata of `c` (already [`gguf_view`]ed) and the infos of `tensors` (no data), and the eos
/// ids the vocabulary gives. Provenance keys: `backburner.random.seed` and `backburner.random.types` (the rule).
pub(super) fn header(
    c: &ModelConfig,
    arch: &Arch,
    tensors: &[PlannedTensor],
    vocab: &Vocab,
    seed: u64,
    rule: &TypeRule,
) -> Result<(GgufWriter, Vec<u32>)> {
    let mut w = GgufWriter::new();
    arch_keys(&mut w, c, arch.gguf_arch);
    w.kv(
        "general.name",
        MetaValue::Str(format!(
            "random {} ({} layers)",
            arch.gguf_arch, c.num_hidden_layers
        )),
    )
    .kv("general.quantization_version", MetaValue::U32(2))
    .kv("backburner.random.seed", MetaValue::U64(seed))
    .kv("backburner.random.types", MetaValue::Str(rule.describe()));
    let eos = write_vocab(&mut w, vocab, c.vocab_size)?;
    for t in tensors {
        w.tensors.push(crate::gguf::writer::WTensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            type_id: t.ggml_type.id(),
            data: Vec::new(),
            zeros: t.n_bytes,
            declared_offset: None,
        });
    }
    Ok((w, eos))
}
