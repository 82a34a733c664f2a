//! The model config from `qwen35` metadata: the metadata llama.cpp's converter writes for real configs gives the
//! config our safetensors loader reads from their config.json, field by field; bad metadata is refused.

use serde_json::Value;

use super::super::{config_from_gguf, GgmlType, GgufFile, MetaArray, MetaValue};
use super::*;
use crate::config::{LayerKind, ModelConfig, RopeParameters, VHeadOrder, WeightLayout};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn u32v(x: &Value) -> MetaValue {
    MetaValue::U32(x.as_u64().unwrap() as u32)
}

/// The metadata and tensors-that-matter `convert_hf_to_gguf.py` writes for an HF text config (as
/// `Qwen3NextModel.set_gguf_parameters` + `TextModel.set_gguf_parameters` + `_Qwen35MRopeMixin` do), with `n_mtp`
/// MTP blocks. The token list is `n_vocab` fillers with `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at
/// `specials..`; eos is `<|im_end|>`.
fn converter_metadata(hf: &Value, n_mtp: u64, specials: u64) -> GgufWriter {
    let a = |k: &str| format!("qwen35.{k}");
    let n_layers = hf["num_hidden_layers"].as_u64().unwrap();
    let rope = &hf["rope_parameters"];
    let head_dim = hf["head_dim"].as_u64().unwrap();
    let hv = hf["linear_num_value_heads"].as_u64().unwrap();
    let mut w = GgufWriter::new();
    w.kv("general.architecture", MetaValue::Str("qwen35".into()))
        .kv(&a("block_count"), MetaValue::U32((n_layers + n_mtp) as u32))
        .kv(&a("context_length"), u32v(&hf["max_position_embeddings"]))
        .kv(&a("embedding_length"), u32v(&hf["hidden_size"]))
        .kv(&a("feed_forward_length"), u32v(&hf["intermediate_size"]))
        .kv(&a("attention.head_count"), u32v(&hf["num_attention_heads"]))
        .kv(
            &a("attention.head_count_kv"),
            u32v(&hf["num_key_value_heads"]),
        )
        .kv(
            &a("rope.dimension_sections"),
            MetaValue::Array(MetaArray::I32(vec![11, 11, 10, 0])),
        )
        .kv(
            &a("rope.freq_base"),
            MetaValue::F32(rope["rope_theta"].as_f64().unwrap() as f32),
        )
        .kv(
            &a("attention.layer_norm_rms_epsilon"),
            MetaValue::F32(hf["rms_norm_eps"].as_f64().unwrap() as f32),
        )
        .kv(&a("attention.key_length"), MetaValue::U32(head_dim as u32))
        .kv(
            &a("attention.value_length"),
            MetaValue::U32(head_dim as u32),
        )
        .kv("general.file_type", MetaValue::U32(15))
        .kv(&a("ssm.conv_kernel"), u32v(&hf["linear_conv_kernel_dim"]))
        .kv(&a("ssm.state_size"), u32v(&hf["linear_key_head_dim"]))
        .kv(&a("ssm.group_count"), u32v(&hf["linear_num_key_heads"]))
        .kv(&a("ssm.time_step_rank"), MetaValue::U32(hv as u32))
        .kv(
            &a("ssm.inner_size"),
            MetaValue::U32((hv * hf["linear_value_head_dim"].as_u64().unwrap()) as u32),
        );
    if let Some(types) = hf["layer_types"].as_array() {
        let mut flags: Vec<bool> = types.iter().map(|t| t == "linear_attention").collect();
        flags.extend((0..n_mtp).map(|_| false));
        w.kv(
            &a("attention.recurrent_layers"),
            MetaValue::Array(MetaArray::Bool(flags)),
        );
    }
    w.kv(
        &a("full_attention_interval"),
        MetaValue::U32(hf["full_attention_interval"].as_u64().unwrap_or(4) as u32),
    )
    .kv(
        &a("rope.dimension_count"),
        MetaValue::U32((head_dim as f64 * rope["partial_rotary_factor"].as_f64().unwrap()) as u32),
    );
    if n_mtp > 0 {
        w.kv(&a("nextn_predict_layers"), MetaValue::U32(n_mtp as u32));
    }
    add_vocab_and_tensors(&mut w, hf, specials);
    w
}

/// The token list (fillers, and `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` at `specials..`; eos `<|im_end|>`),
/// the embedding, the output head unless tied (holes in the written file), the final norm.
fn add_vocab_and_tensors(w: &mut GgufWriter, hf: &Value, specials: u64) {
    let vocab = hf["vocab_size"].as_u64().unwrap();
    let names: Vec<String> = (0..vocab)
        .map(|i| match i.checked_sub(specials) {
            Some(0) => "<|endoftext|>".into(),
            Some(1) => "<|im_start|>".into(),
            Some(2) => "<|im_end|>".into(),
            _ => format!("t{i}"),
        })
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    w.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .kv("tokenizer.ggml.tokens", str_array(&names))
        .kv(
            "tokenizer.ggml.eos_token_id",
            MetaValue::U32((specials + 2) as u32),
        );
    let h = hf["hidden_size"].as_u64().unwrap();
    let t = if h.is_multiple_of(256) {
        GgmlType::Q4K
    } else {
        GgmlType::F16
    };
    w.tensor_zeroed("token_embd.weight", &[h, vocab], t);
    if !hf["tie_word_embeddings"].as_bool().unwrap_or(false) {
        let t = if h.is_multiple_of(256) {
            GgmlType::Q6K
        } else {
            GgmlType::F16
        };
        w.tensor_zeroed("output.weight", &[h, vocab], t);
    }
    w.tensor_zeroed("output_norm.weight", &[h], GgmlType::F32);
}

fn open_written(w: &GgufWriter) -> (tempfile::TempDir, GgufFile) {
    let d = tempfile::tempdir().unwrap();
    let p = write_tmp(w, d.path(), "model.gguf");
    let f = GgufFile::open(&p).unwrap();
    (d, f)
}

#[test]
fn gguf_config_of_the_real_27b_equals_its_config_json() {
    let dir = fixture("ref-27b-config");
    let hf: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    for n_mtp in [1, 0] {
        let (_d, f) = open_written(&converter_metadata(&hf, n_mtp, 248_044));
        let got = config_from_gguf(&f).unwrap();
        let mut want = ModelConfig::from_dir(&dir).unwrap();
        // What the GGUF path knows beyond config.json: the v-head order, eos ids from the vocabulary, and the
        // mrope sections the converter always writes.
        want.linear_v_head_order = VHeadOrder::Tiled;
        want.eos_token_ids = vec![248_046, 248_044];
        want.rope.mrope_section = Some(vec![11, 11, 10]);
        want.mtp_num_hidden_layers = n_mtp as usize;
        assert_eq!(got, want, "n_mtp {n_mtp}");
        assert_eq!(got.num_hidden_layers, 64);
        assert_eq!(got.hidden_size, 5120);
        assert_eq!(got.linear_num_value_heads, 48);
        assert_eq!(got.rotary_dim(), 64);
        assert_eq!(got.rope.rope_theta, 1e7);
        assert_eq!(got.rms_norm_eps, 1e-6);
        assert!(!got.tie_word_embeddings);
    }
}

#[test]
fn gguf_config_of_the_tiny_fixture_equals_its_config_json() {
    let dir = fixture("tiny-f32");
    let hf: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let (_d, f) = open_written(&converter_metadata(&hf, 1, 445));
    let got = config_from_gguf(&f).unwrap();
    let mut want = ModelConfig::from_dir(&dir).unwrap();
    want.linear_v_head_order = VHeadOrder::Tiled;
    want.eos_token_ids = vec![447, 445];
    want.rope.mrope_section = Some(vec![11, 11, 10]);
    want.mtp_num_hidden_layers = 1; // the metadata declares one MTP block
    assert_eq!(got, want);
}

/// Metadata shaped like a Qwen3.5-0.8B conversion (24 layers + 1 MTP block, n_embd 1024, the size llama.cpp's
/// `qwen35` loader calls 0.8B), tied embeddings.
fn qwen35_0_8b() -> GgufWriter {
    let hf = serde_json::json!({
        "num_hidden_layers": 24, "hidden_size": 1024, "intermediate_size": 3584, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262_144, "rms_norm_eps": 1e-6, "vocab_size": 248_320,
        "tie_word_embeddings": true, "full_attention_interval": 4,
        "layer_types": (0..24).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect::<Vec<_>>(),
        "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25, "rope_type": "default"},
    });
    converter_metadata(&hf, 1, 248_044)
}

#[test]
fn gguf_config_of_a_0_8b_shaped_file_field_by_field() {
    let (_d, f) = open_written(&qwen35_0_8b());
    let c = config_from_gguf(&f).unwrap();
    assert_eq!(c.model_type, "qwen3_5_text");
    assert_eq!(c.layout, WeightLayout::CausalLm);
    assert_eq!(c.vocab_size, 248_320);
    assert_eq!(c.hidden_size, 1024);
    assert_eq!(c.intermediate_size, 3584);
    assert_eq!(c.num_hidden_layers, 24, "the MTP block is not a layer");
    assert_eq!(c.num_attention_heads, 8);
    assert_eq!(c.num_key_value_heads, 2);
    assert_eq!(c.head_dim, 256);
    assert_eq!(c.linear_num_key_heads, 16);
    assert_eq!(c.linear_num_value_heads, 16);
    assert_eq!(c.linear_key_head_dim, 128);
    assert_eq!(c.linear_value_head_dim, 128);
    assert_eq!(c.linear_conv_kernel_dim, 4);
    assert_eq!(c.rms_norm_eps, 1e-6);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.max_position_embeddings, 262_144);
    assert_eq!(c.full_attention_interval, 4);
    assert_eq!(c.full_attention_layers(), [3, 7, 11, 15, 19, 23]);
    assert_eq!(c.layer_types.len(), 24);
    assert_eq!(
        c.rope,
        RopeParameters {
            rope_theta: 1e7,
            partial_rotary_factor: 0.25,
            mrope_section: Some(vec![11, 11, 10]),
            rope_type: Some("default".into()),
        }
    );
    assert_eq!(c.eos_token_ids, [248_046, 248_044]);
    assert_eq!(c.linear_v_head_order, VHeadOrder::Tiled);
}

/// Opens `w` after `edit` and returns the config error's text.
fn config_err(edit: impl FnOnce(&mut GgufWriter)) -> String {
    let mut w = qwen35_0_8b();
    edit(&mut w);
    let (_d, f) = open_written(&w);
    chain(&config_from_gguf(&f).unwrap_err())
}

/// Replaces (or with `None` removes) the value of `key`.
fn set(w: &mut GgufWriter, key: &str, v: Option<MetaValue>) {
    w.remove(key);
    if let Some(v) = v {
        w.kv(key, v);
    }
}

#[test]
fn gguf_config_derives_layer_types_and_accepts_per_layer_arrays() {
    let mut w = qwen35_0_8b();
    set(&mut w, "qwen35.attention.recurrent_layers", None);
    set(
        &mut w,
        "qwen35.full_attention_interval",
        Some(MetaValue::U32(3)),
    );
    set(
        &mut w,
        "qwen35.attention.head_count",
        Some(MetaValue::Array(MetaArray::I32(vec![8; 25]))),
    );
    set(
        &mut w,
        "qwen35.attention.layer_norm_rms_epsilon",
        Some(MetaValue::F64(1e-5)),
    );
    // as newer converters write it: per layer, 0 on the recurrent layers
    let kv: Vec<i32> = (0..25).map(|i| if i % 3 == 2 { 2 } else { 0 }).collect();
    set(
        &mut w,
        "qwen35.attention.head_count_kv",
        Some(MetaValue::Array(MetaArray::I32(kv))),
    );
    let (_d, f) = open_written(&w);
    let c = config_from_gguf(&f).unwrap();
    assert_eq!(c.num_key_value_heads, 2);
    assert_eq!(c.full_attention_layers(), [2, 5, 8, 11, 14, 17, 20, 23]);
    assert_eq!(c.layer_types[0], LayerKind::LinearAttention);
    assert_eq!(c.num_attention_heads, 8);
    assert_eq!(c.rms_norm_eps, 1e-5);
}

#[test]
fn gguf_config_refuses_other_architectures() {
    for (arch, not_yet) in [("llama", false), ("qwen2moe", false)] {
        let mut w = qwen35_0_8b();
        set(
            &mut w,
            "general.architecture",
            Some(MetaValue::Str(arch.into())),
        );
        let (_d, f) = open_written(&w);
        let e = config_from_gguf(&f).unwrap_err();
        assert!(
            matches!(&e, ModelError::UnsupportedArchitecture { found, not_yet: n, .. } if found == arch && *n == not_yet),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(m.contains("supported: qwen35, qwen35moe, qwen3next"), "{m}");
        assert_eq!(m.contains("not yet supported"), not_yet, "{m}");
    }
}

#[test]
fn gguf_config_refuses_missing_mistyped_and_impossible_metadata() {
    let cases: Vec<(&str, Option<MetaValue>, &str)> = vec![
        ("general.architecture", None, "has no general.architecture"),
        ("qwen35.block_count", None, "qwen35.block_count is missing"),
        (
            "qwen35.block_count",
            Some(MetaValue::U32(0)),
            "block_count is 0: the model has no layers",
        ),
        (
            "qwen35.embedding_length",
            Some(MetaValue::Str("1024".into())),
            "has type str",
        ),
        (
            "qwen35.attention.layer_norm_rms_epsilon",
            Some(MetaValue::U32(1)),
            "expected f32 or f64",
        ),
        (
            "qwen35.attention.layer_norm_rms_epsilon",
            Some(MetaValue::F32(f32::NAN)),
            "is NaN",
        ),
        (
            "qwen35.nextn_predict_layers",
            Some(MetaValue::U32(25)),
            "leaves none",
        ),
        (
            "qwen35.attention.head_count",
            Some(MetaValue::Array(MetaArray::I32((0..25).collect()))),
            "differs across layers",
        ),
        (
            "qwen35.attention.head_count",
            Some(MetaValue::U32(0)),
            "is 0",
        ),
        (
            "qwen35.attention.head_count_kv",
            Some(MetaValue::Array(MetaArray::I32(vec![0; 25]))),
            "is 0 on every layer",
        ),
        (
            "qwen35.attention.head_count_kv",
            Some(MetaValue::Array(MetaArray::I32(
                (0..25).map(|i| i % 3).collect(),
            ))),
            "differs across layers",
        ),
        (
            "qwen35.attention.recurrent_layers",
            Some(MetaValue::Array(MetaArray::Bool(vec![true; 7]))),
            "has 7 entries",
        ),
        (
            "qwen35.attention.value_length",
            Some(MetaValue::U32(128)),
            "differs from attention.value_length",
        ),
        (
            "qwen35.ssm.inner_size",
            Some(MetaValue::U32(2047)),
            "not a multiple",
        ),
        (
            "qwen35.ssm.group_count",
            Some(MetaValue::U32(5)),
            "multiple of linear_num_key_heads",
        ),
        (
            "qwen35.rope.scaling.type",
            Some(MetaValue::Str("yarn".into())),
            "rope_scaling",
        ),
        (
            "qwen35.rope.dimension_count",
            Some(MetaValue::U32(3)),
            "rotary dims",
        ),
        (
            "qwen35.context_length",
            Some(MetaValue::I32(-1)),
            "expected an unsigned integer",
        ),
        (
            "tokenizer.ggml.eos_token_id",
            Some(MetaValue::U32(300_000)),
            "past the vocabulary",
        ),
    ];
    for (key, v, want) in cases {
        let m = config_err(|w| set(w, key, v.clone()));
        assert!(m.contains(want), "{key} = {v:?}: want {want:?}: {m}");
    }
}

#[test]
fn gguf_config_needs_an_embedding_of_the_model_width() {
    let m = config_err(|w| w.tensors.retain(|t| t.name != "token_embd.weight"));
    assert!(m.contains("no token_embd.weight"), "{m}");
    let m = config_err(|w| w.tensors[0].dims[0] = 512);
    assert!(m.contains("token_embd.weight has dims"), "{m}");
}

#[test]
fn gguf_config_refuses_a_vocab_size_other_than_the_embeddings_rows() {
    // token_embd.weight has 248320 rows; a vocab_size that disagrees is refused, naming both numbers
    for n in [248_319u32, 248_321, 1] {
        let e = {
            let mut w = qwen35_0_8b();
            w.kv("qwen35.vocab_size", MetaValue::U32(n));
            let (_d, f) = open_written(&w);
            config_from_gguf(&f).unwrap_err()
        };
        let ModelError::InvalidConfig(m) = &e else {
            panic!("expected InvalidConfig, got {e:?}");
        };
        assert!(
            m.ends_with(&format!(
                ": qwen35.vocab_size is {n} but token_embd.weight has 248320 rows (one per token id)"
            )),
            "{m}"
        );
    }
    // one that agrees is fine, and the vocab is the rows'
    let mut w = qwen35_0_8b();
    w.kv("qwen35.vocab_size", MetaValue::U32(248_320));
    let (_d, f) = open_written(&w);
    assert_eq!(config_from_gguf(&f).unwrap().vocab_size, 248_320);
    let m = config_err(|w| {
        w.kv("qwen35.vocab_size", MetaValue::Str("248320".into()));
    });
    assert!(m.contains("qwen35.vocab_size has type str"), "{m}");
}
