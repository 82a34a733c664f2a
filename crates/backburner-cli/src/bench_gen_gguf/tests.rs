//! Shapes, architectures and the bundled tokenizer of `bench gen-gguf`.

use backburner_model::gguf::random::PlannedTensor;
use backburner_model::gguf::GgmlType;
use backburner_model::{FfnKind, LayerKind, TextTokenizer};
use clap::Parser;

use super::*;

/// The tensors of a plan whose GGUF name ends with `suffix`.
fn named<'a>(g: &'a Generator, suffix: &str) -> Vec<&'a PlannedTensor> {
    g.tensors()
        .iter()
        .filter(|t| t.name.ends_with(suffix))
        .collect()
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    a: GenGgufArgs,
}

fn args(extra: &[&str]) -> GenGgufArgs {
    let mut v = vec!["gen-gguf", "--out", "unused.gguf"];
    v.extend_from_slice(extra);
    Cli::try_parse_from(v).unwrap().a
}

/// The plan of `extra`'s options, with the vocabulary `vocab`.
fn plan(extra: &[&str], vocab: &Vocab) -> Generator {
    let a = args(extra);
    let v = shaped(shape_json(&a.shape).unwrap(), &a).unwrap();
    let c = ModelConfig::from_json_str(&v.to_string()).unwrap();
    let rule = TypeRule::parse(&a.default_type, &a.tensor_types).unwrap();
    Generator::new(&c, &rule, vocab, a.seed).unwrap()
}

#[test]
fn the_27b_shape_in_iq4_xs_plans_every_tensor_without_fallbacks() {
    let g = plan(
        &["--shape", "27b", "--layers", "8", "--type", "IQ4_XS"],
        &Vocab::None,
    );
    let c = g.config();
    assert_eq!(
        (
            c.hidden_size,
            c.intermediate_size,
            c.vocab_size,
            c.num_hidden_layers
        ),
        (5120, 17408, 248_320, 8)
    );
    assert_eq!(
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
        (24, 4, 256)
    );
    assert_eq!(
        (
            c.linear_num_key_heads,
            c.linear_num_value_heads,
            c.linear_key_head_dim,
            c.linear_value_head_dim
        ),
        (16, 48, 128, 128)
    );
    assert_eq!(
        (
            c.rope.rope_theta,
            c.rope.partial_rotary_factor,
            c.rms_norm_eps
        ),
        (1e7, 0.25, 1e-6)
    );
    assert_eq!(c.full_attention_layers(), [3, 7]);
    assert!(!c.tie_word_embeddings);
    // 3 end tensors, 14 per Gated DeltaNet layer, 11 per attention layer
    assert_eq!(g.tensors().len(), 3 + 6 * 14 + 2 * 11);
    assert_eq!(g.fallbacks().count(), 0);
    let down = named(&g, "blk.0.ffn_down.weight")[0];
    assert_eq!(down.dims, [17408, 5120]);
    assert_eq!(
        (down.ggml_type, down.n_bytes),
        (GgmlType::Iq4Xs, 17408 * 5120 / 256 * 136)
    );
    let q = named(&g, "blk.3.attn_q.weight")[0];
    assert_eq!(q.dims, [5120, 24 * 2 * 256]);
    assert_eq!(
        named(&g, "blk.0.ssm_conv1d.weight")[0].dims,
        [4, 2 * 16 * 128 + 48 * 128]
    );
    let iq4: u64 = g
        .type_counts()
        .iter()
        .filter(|t| t.ggml_type == GgmlType::Iq4Xs)
        .map(|t| t.bytes)
        .sum();
    assert!(
        iq4 > g.file_bytes() * 99 / 100,
        "{iq4} of {}",
        g.file_bytes()
    );
}

#[test]
fn more_layers_than_listed_follow_the_interval_and_fewer_keep_the_list() {
    let g = plan(
        &["--shape", "27b", "--layers", "68", "--dry-run"],
        &Vocab::None,
    );
    let full = g.config().full_attention_layers();
    assert_eq!(full.len(), 17);
    assert_eq!(full.last(), Some(&67));
    let g = plan(&["--shape", "bench", "--layers", "2"], &Vocab::None);
    assert_eq!(g.config().layer_types, [LayerKind::LinearAttention; 2]);
}

#[test]
fn a_dense_shape_made_moe_takes_the_expert_options_or_the_config_class_defaults() {
    let g = plan(
        &[
            "--shape",
            "tiny",
            "--arch",
            "qwen35moe",
            "--experts",
            "4",
            "--experts-used",
            "2",
            "--expert-ff",
            "32",
            "--shared-ff",
            "48",
            "--type",
            "Q8_0",
        ],
        &Vocab::ByteLevel,
    );
    let m = g.config().moe.clone().unwrap();
    let sizes = (
        m.num_experts,
        m.num_experts_per_tok,
        m.moe_intermediate_size,
        m.shared_expert_intermediate_size,
    );
    assert_eq!(sizes, (4, 2, 32, 48));
    assert_eq!(named(&g, "blk.0.ffn_gate_exps.weight")[0].dims, [64, 32, 4]);
    assert!(named(&g, "ffn_gate.weight").is_empty());
    let g = plan(&["--shape", "tiny", "--arch", "qwen3next"], &Vocab::None);
    let c = g.config();
    assert_eq!(c.model_type, "qwen3_next");
    let m = c.moe.as_ref().unwrap();
    assert_eq!((m.num_experts, m.num_experts_per_tok), (512, 10));
    assert!(c.ffn_types.iter().all(|&k| k == FfnKind::Moe));
    assert_eq!(named(&g, "blk.0.attn_qkv.weight").len(), 1);
    assert_eq!(named(&g, "blk.0.ssm_ba.weight").len(), 1);
}

#[test]
fn a_hub_config_is_read_as_its_text_config() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = backburner_model::synthetic::tiny_config(4);
    text.as_object_mut().unwrap().remove("model_type");
    text.as_object_mut().unwrap().remove("tie_word_embeddings");
    let hub = serde_json::json!({"model_type": "qwen3_5", "tie_word_embeddings": true, "text_config": text});
    std::fs::write(dir.path().join("config.json"), hub.to_string()).unwrap();
    let v = shape_json(dir.path().to_str().unwrap()).unwrap();
    assert_eq!(v["model_type"], "qwen3_5_text");
    let c = ModelConfig::from_json_str(&v.to_string()).unwrap();
    assert!(c.tie_word_embeddings);
    assert!(shape_json("/nonexistent/config.json").is_err());
}

#[test]
fn the_bundled_tokenizer_in_a_generated_file_encodes_as_its_tokenizer_json() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = backburner_model::synthetic::tiny_config(4);
    cfg["vocab_size"] = 248_320.into();
    cfg["tie_word_embeddings"] = true.into();
    let c = ModelConfig::from_json_str(&cfg.to_string()).unwrap();
    assert!(matches!(
        vocab_for(None, c.vocab_size).unwrap(),
        Vocab::Given(_)
    ));
    assert!(vocab_for(Some("qwen35"), 512).is_err());
    assert_eq!(vocab_for(None, 512).unwrap(), Vocab::ByteLevel);
    let vocab = Vocab::Given(qwen35_vocab().unwrap());
    let g = Generator::new(&c, &TypeRule::parse("Q8_0", &[]).unwrap(), &vocab, 1).unwrap();
    assert_eq!(g.config().eos_token_ids, [248_046, 248_044]);
    let path = dir.path().join("m.gguf");
    g.write_file(&path, 1 << 20, &mut |_| {}).unwrap();
    let f = backburner_model::GgufFile::open(&path).unwrap();
    let from_gguf = TextTokenizer::from_gguf(&f, c.vocab_size).unwrap();
    let json_dir = dir.path().join("json");
    std::fs::create_dir(&json_dir).unwrap();
    std::fs::write(
        json_dir.join("tokenizer.json"),
        crate::default_model::tokenizer_json().unwrap(),
    )
    .unwrap();
    std::fs::write(
        json_dir.join("tokenizer_config.json"),
        crate::default_model::TOKENIZER_CONFIG,
    )
    .unwrap();
    let from_json = TextTokenizer::from_dir(&json_dir, c.vocab_size, &[])
        .unwrap()
        .unwrap();
    for text in [
        "Hello, world! 12345",
        "<|im_start|>user\nWie geht's? 你好 🦀<|im_end|>\n",
        "  fn main() {\n\tprintln!(\"x\");\n}",
    ] {
        assert_eq!(
            from_gguf.encode(text).unwrap(),
            from_json.encode(text).unwrap(),
            "{text:?}"
        );
    }
    assert!(from_gguf.has_chat_template());
}

#[test]
fn the_type_rule_prints_for_people() {
    assert_eq!(super::human_types("IQ4_XS"), "IQ4_XS");
    assert_eq!(
        super::human_types("IQ2_XS,^output.weight$=Q6_K,ffn=Q8_0"),
        "IQ2_XS (tensors matching \"^output.weight$\": Q6_K, tensors matching \"ffn\": Q8_0)"
    );
}
