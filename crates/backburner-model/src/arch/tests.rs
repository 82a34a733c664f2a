use super::*;
use crate::synthetic::tiny_config;

fn tiny(n: usize) -> ModelConfig {
    ModelConfig::from_json_str(&tiny_config(n).to_string()).unwrap()
}

#[test]
fn the_dense_table_lists_each_layer_kind_in_load_order() {
    let c = tiny(4);
    let arch = arch_of(&c);
    let names = |i| -> Vec<String> {
        arch.layer_tensors(&c, i)
            .into_iter()
            .map(|t| t.name["model.layers.0.".len()..].to_string())
            .collect()
    };
    assert_eq!(
        names(0),
        [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "linear_attn.in_proj_qkv.weight",
            "linear_attn.in_proj_z.weight",
            "linear_attn.in_proj_b.weight",
            "linear_attn.in_proj_a.weight",
            "linear_attn.conv1d.weight",
            "linear_attn.dt_bias",
            "linear_attn.A_log",
            "linear_attn.norm.weight",
            "linear_attn.out_proj.weight",
        ]
    );
    assert_eq!(
        names(3)[5..],
        [
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight"
        ]
    );
    // tiny: H 64, I 128, conv_dim 160, Hv 4, Dv 24, kernel 4; Hq 4, Hkv 2, D 32
    let mlp = 3 * 64 * 128 + 2 * 64;
    let gdn = (160 + 96 + 8) * 64 + 64 * 96 + 160 * 4 + 4 + 4 + 24;
    let att = (256 + 64 + 64) * 64 + 64 * 128 + 32 + 32;
    assert_eq!(arch.layer_elements(&c, 0), (mlp + gdn) as u64);
    assert_eq!(arch.layer_elements(&c, 3), (mlp + att) as u64);
}

#[test]
fn ends_follow_the_layout_and_tying() {
    let mut c = tiny(4);
    let arch = arch_of(&c);
    let names = |c: &ModelConfig| -> Vec<String> {
        arch.end_tensors(c).into_iter().map(|t| t.name).collect()
    };
    assert_eq!(
        names(&c),
        [
            "model.embed_tokens.weight",
            "model.norm.weight",
            "lm_head.weight"
        ]
    );
    c.tie_word_embeddings = true;
    c.layout = crate::config::WeightLayout::Hub;
    assert_eq!(
        names(&c),
        [
            "model.language_model.embed_tokens.weight",
            "model.language_model.norm.weight"
        ]
    );
    assert_eq!(
        arch.layer_tensors(&c, 1)[0].name,
        "model.language_model.layers.1.input_layernorm.weight"
    );
}

#[test]
fn a_qwen3_next_layer_reads_its_projections_as_the_checkpoint_stores_them() {
    let mut c =
        ModelConfig::from_json_str(&crate::synthetic::tiny_next_config(4).to_string()).unwrap();
    let arch = arch_of(&c);
    let mix_in = |c: &ModelConfig| -> Vec<(String, Option<Vec<Range<usize>>>)> {
        arch.layer_tensors(c, 0)
            .into_iter()
            .filter(|t| t.slot == Slot::MixIn)
            .map(|t| {
                (
                    t.name["model.layers.0.linear_attn.".len()..].to_string(),
                    t.rows,
                )
            })
            .collect()
    };
    // Hk 2, Dk 16, Hv 4 (r 2), Dv 24: per k head [q 16 | k 16 | v 48 | z 48] and [b 2 | a 2]
    let ba = Some(vec![0..2, 4..6, 2..4, 6..8]);
    let qkvz = Some(vec![
        0..16,
        128..144,
        16..32,
        144..160,
        32..80,
        160..208,
        80..128,
        208..256,
    ]);
    assert_eq!(arch.gdn_of(&c), GdnProjections::FusedPerKHead);
    assert_eq!(
        mix_in(&c),
        [
            ("in_proj_qkvz.weight".to_string(), qkvz),
            ("in_proj_ba.weight".to_string(), ba.clone())
        ]
    );
    // llama.cpp's converter: q|k|v and z split by kind, b|a still fused per k head
    c.gdn_projections = Some(GdnProjections::SplitQkvzFusedBa);
    assert_eq!(
        mix_in(&c),
        [
            ("in_proj_qkv.weight".to_string(), None),
            ("in_proj_z.weight".to_string(), None),
            ("in_proj_ba.weight".to_string(), ba)
        ]
    );
    assert_eq!(
        arch.gguf_name("model.layers.0.linear_attn.in_proj_z.weight")
            .as_deref(),
        Some("blk.0.attn_gate.weight")
    );
}

#[test]
fn the_registry_finds_gguf_architectures() {
    assert_eq!(arch_of_gguf("qwen3next").unwrap().name, "qwen3_next");
    assert_eq!(arch_of_gguf("qwen35").unwrap().name, "qwen3_5");
    assert!(arch_of_gguf("llama").is_none());
}
