//! The dense Qwen3.5 hybrid (`qwen3_5_text`, hub `qwen3_5`; GGUF `qwen35`): Hugging Face transformers 5.23
//! `modeling_qwen3_5.py` names and shapes, and the names llama.cpp gives them (its `src/models/qwen35.cpp` and
//! `gguf-py` tensor map).

use std::ops::Range;

use super::{Applies, Arch, Entry, GdnProjections, Init, Read, Slot};
use crate::checkpoint::VectorKind;
use crate::config::{FfnKind, LayerKind, ModelConfig};

const W: Init = Init {
    std: 0.02,
    mean: 0.0,
};
const GAIN: Init = Init {
    std: 0.1,
    mean: 0.0,
};

const DENSE: Applies = Applies::Ffn(FfnKind::Dense);
const MOE: Applies = Applies::Ffn(FfnKind::Moe);
const EXP: Applies = Applies::EachExpert;
const LIN: Applies = Applies::Mixer(LayerKind::LinearAttention);
const ATT: Applies = Applies::Mixer(LayerKind::FullAttention);
const SPLIT_QKVZ: Applies = Applies::LinQkvz { fused: false };
const FUSED_QKVZ: Applies = Applies::LinQkvz { fused: true };
const SPLIT_BA: Applies = Applies::LinBa { fused: false };
const FUSED_BA: Applies = Applies::LinBa { fused: true };
const MAT: Read = Read::Matrix;
const NORM: Read = Read::Vector(VectorKind::NormGain);
const PLAIN: Read = Read::Vector(VectorKind::Plain);

const fn entry(
    hf: &'static str,
    gguf: &'static str,
    applies: Applies,
    slot: Slot,
    read: Read,
    shape: fn(&ModelConfig) -> Vec<usize>,
    init: Init,
) -> Entry {
    Entry {
        hf,
        gguf,
        applies,
        slot,
        read,
        shape,
        rows: None,
        init,
    }
}

/// An [`entry`] of which the model reads the stored rows `rows` selects, in that order.
const fn gathered(
    hf: &'static str,
    gguf: &'static str,
    applies: Applies,
    shape: fn(&ModelConfig) -> Vec<usize>,
    rows: fn(&ModelConfig) -> Vec<Range<usize>>,
) -> Entry {
    let mut e = entry(hf, gguf, applies, Slot::MixIn, MAT, shape, W);
    e.rows = Some(rows);
    e
}

/// Qwen3-Next's `in_proj_qkvz` rows in the split order: per k head h the stored group is `[q_h (Dk), k_h (Dk),
/// v of its r v heads (r·Dv), z of them (r·Dv)]`; the model reads every q, then every k, v and z.
fn qkvz_rows(c: &ModelConfig) -> Vec<Range<usize>> {
    let (hk, dk) = (c.linear_num_key_heads, c.linear_key_head_dim);
    let rv = c.linear_num_value_heads / hk * c.linear_value_head_dim;
    let g = 2 * dk + 2 * rv;
    let part = |off: usize, len: usize| (0..hk).map(move |h| h * g + off..h * g + off + len);
    part(0, dk)
        .chain(part(dk, dk))
        .chain(part(2 * dk, rv))
        .chain(part(2 * dk + rv, rv))
        .collect()
}

/// Qwen3-Next's `in_proj_ba` rows in the split order: per k head the stored group is `[b of its r v heads, a of
/// them]`; the model reads every b, then every a.
fn ba_rows(c: &ModelConfig) -> Vec<Range<usize>> {
    let r = c.linear_num_value_heads / c.linear_num_key_heads;
    let hk = c.linear_num_key_heads;
    let part = |off: usize| (0..hk).map(move |h| h * 2 * r + off..h * 2 * r + off + r);
    part(0).chain(part(r)).collect()
}

fn hv_dv(c: &ModelConfig) -> usize {
    c.linear_num_value_heads * c.linear_value_head_dim
}

fn moe(c: &ModelConfig) -> &crate::config::MoeConfig {
    c.moe
        .as_ref()
        .expect("an MoE entry applies to an MoE config only")
}

/// The dense Qwen3.5 table: the ends, then per layer the two norms, the SwiGLU MLP and the mixer's tensors.
#[rustfmt::skip]
pub(super) static TABLE: &[Entry] = &[
    entry("embed_tokens.weight", "token_embd.weight", Applies::Ends, Slot::Embed, MAT, |c| vec![c.vocab_size, c.hidden_size], W),
    entry("norm.weight", "output_norm.weight", Applies::Ends, Slot::FinalNorm, NORM, |c| vec![c.hidden_size], GAIN),
    entry("lm_head.weight", "output.weight", Applies::Ends, Slot::Head, MAT, |c| vec![c.vocab_size, c.hidden_size], W),
    entry("input_layernorm.weight", "attn_norm.weight", Applies::EveryLayer, Slot::InputNorm, NORM, |c| vec![c.hidden_size], GAIN),
    entry("post_attention_layernorm.weight", "post_attention_norm.weight", Applies::EveryLayer, Slot::PostNorm, NORM, |c| vec![c.hidden_size], GAIN),
    entry("mlp.gate_proj.weight", "ffn_gate.weight", DENSE, Slot::FfnGateUp, MAT, |c| vec![c.intermediate_size, c.hidden_size], W),
    entry("mlp.up_proj.weight", "ffn_up.weight", DENSE, Slot::FfnGateUp, MAT, |c| vec![c.intermediate_size, c.hidden_size], W),
    entry("mlp.down_proj.weight", "ffn_down.weight", DENSE, Slot::FfnDown, MAT, |c| vec![c.hidden_size, c.intermediate_size], W),
    // mixture of experts (HF `Qwen3_5MoeSparseMoeBlock`; GGUF stores each kind of expert matrix as one 3-D tensor)
    entry("mlp.gate.weight", "ffn_gate_inp.weight", MOE, Slot::Router, MAT, |c| vec![moe(c).num_experts, c.hidden_size], W),
    entry("mlp.experts.{e}.gate_proj.weight", "ffn_gate_exps.weight", EXP, Slot::ExpertGateUp, MAT, |c| vec![moe(c).moe_intermediate_size, c.hidden_size], W),
    entry("mlp.experts.{e}.up_proj.weight", "ffn_up_exps.weight", EXP, Slot::ExpertGateUp, MAT, |c| vec![moe(c).moe_intermediate_size, c.hidden_size], W),
    entry("mlp.experts.{e}.down_proj.weight", "ffn_down_exps.weight", EXP, Slot::ExpertDown, MAT, |c| vec![c.hidden_size, moe(c).moe_intermediate_size], W),
    entry("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight", MOE, Slot::SharedGateUp, MAT, |c| vec![moe(c).shared_expert_intermediate_size, c.hidden_size], W),
    entry("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight", MOE, Slot::SharedGateUp, MAT, |c| vec![moe(c).shared_expert_intermediate_size, c.hidden_size], W),
    entry("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight", MOE, Slot::SharedDown, MAT, |c| vec![c.hidden_size, moe(c).shared_expert_intermediate_size], W),
    entry("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", MOE, Slot::SharedGate, MAT, |c| vec![1, c.hidden_size], W),
    // gated attention: q_proj holds each head's q and gate rows interleaved
    entry("self_attn.q_proj.weight", "attn_q.weight", ATT, Slot::MixIn, MAT, |c| vec![c.num_attention_heads * 2 * c.head_dim, c.hidden_size], W),
    entry("self_attn.k_proj.weight", "attn_k.weight", ATT, Slot::MixIn, MAT, |c| vec![c.num_key_value_heads * c.head_dim, c.hidden_size], W),
    entry("self_attn.v_proj.weight", "attn_v.weight", ATT, Slot::MixIn, MAT, |c| vec![c.num_key_value_heads * c.head_dim, c.hidden_size], W),
    entry("self_attn.o_proj.weight", "attn_output.weight", ATT, Slot::MixOut, MAT, |c| vec![c.hidden_size, c.num_attention_heads * c.head_dim], W),
    entry("self_attn.q_norm.weight", "attn_q_norm.weight", ATT, Slot::QNorm, NORM, |c| vec![c.head_dim], GAIN),
    entry("self_attn.k_norm.weight", "attn_k_norm.weight", ATT, Slot::KNorm, NORM, |c| vec![c.head_dim], GAIN),
    // Gated DeltaNet
    entry("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", SPLIT_QKVZ, Slot::MixIn, MAT, |c| vec![c.conv_dim(), c.hidden_size], W),
    entry("linear_attn.in_proj_z.weight", "attn_gate.weight", SPLIT_QKVZ, Slot::MixIn, MAT, |c| vec![hv_dv(c), c.hidden_size], W),
    entry("linear_attn.in_proj_b.weight", "ssm_beta.weight", SPLIT_BA, Slot::MixIn, MAT, |c| vec![c.linear_num_value_heads, c.hidden_size], W),
    entry("linear_attn.in_proj_a.weight", "ssm_alpha.weight", SPLIT_BA, Slot::MixIn, MAT, |c| vec![c.linear_num_value_heads, c.hidden_size], W),
    // Qwen3-Next's fused projections, read in the order above (llama.cpp's converter splits in_proj_qkvz into
    // attn_qkv and attn_gate, and keeps in_proj_ba fused: GdnProjections::SplitQkvzFusedBa)
    gathered("linear_attn.in_proj_qkvz.weight", "ssm_in.weight", FUSED_QKVZ, |c| vec![c.conv_dim() + hv_dv(c), c.hidden_size], qkvz_rows),
    gathered("linear_attn.in_proj_ba.weight", "ssm_ba.weight", FUSED_BA, |c| vec![2 * c.linear_num_value_heads, c.hidden_size], ba_rows),
    entry("linear_attn.conv1d.weight", "ssm_conv1d.weight", LIN, Slot::Conv, PLAIN, |c| vec![c.conv_dim(), 1, c.linear_conv_kernel_dim], Init { std: 0.3, mean: 0.0 }),
    entry("linear_attn.dt_bias", "ssm_dt.bias", LIN, Slot::DtBias, PLAIN, |c| vec![c.linear_num_value_heads], Init { std: 0.5, mean: 0.0 }),
    entry("linear_attn.A_log", "ssm_a", LIN, Slot::DecayA, Read::Vector(VectorKind::NegExp), |c| vec![c.linear_num_value_heads], Init { std: 0.5, mean: 0.0 }),
    // the gated norm multiplies by w itself (not 1 + w)
    entry("linear_attn.norm.weight", "ssm_norm.weight", LIN, Slot::GatedNorm, PLAIN, |c| vec![c.linear_value_head_dim], Init { std: 0.1, mean: 1.0 }),
    entry("linear_attn.out_proj.weight", "ssm_out.weight", LIN, Slot::MixOut, MAT, |c| vec![c.hidden_size, hv_dv(c)], W),
];

/// The dense Qwen3.5 architecture.
pub(super) static QWEN35: Arch = Arch {
    name: "qwen3_5",
    gguf_arch: "qwen35",
    table: TABLE,
    gdn: GdnProjections::Split,
};

/// The Qwen3.5 mixture-of-experts hybrid (`qwen3_5_moe_text`, hub `qwen3_5_moe`; GGUF `qwen35moe`): the same table,
/// whose MoE entries apply.
pub(super) static QWEN35_MOE: Arch = Arch {
    name: "qwen3_5_moe",
    gguf_arch: "qwen35moe",
    table: TABLE,
    gdn: GdnProjections::Split,
};

/// Qwen3-Next (`qwen3_next`; GGUF `qwen3next`): the same table with the fused Gated DeltaNet projections (a GGUF file
/// of llama.cpp's converter stores `q|k|v` and `z` split: its config says so), and dense or MoE feed-forward blocks
/// by layer (`decoder_sparse_step`, `mlp_only_layers`).
pub(super) static QWEN3_NEXT: Arch = Arch {
    name: "qwen3_next",
    gguf_arch: "qwen3next",
    table: TABLE,
    gdn: GdnProjections::FusedPerKHead,
};
