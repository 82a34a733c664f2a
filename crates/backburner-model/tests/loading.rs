//! Checkpoint loading: the three fixture layouts load, and every kind of bad input returns its typed error.

use std::path::{Path, PathBuf};

use backburner_model::{
    ChatMessage, LayerKind, Model, ModelConfig, ModelError, TextTokenizer, WeightLayout,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// A writable copy of a fixture directory.
fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    tmp
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v).unwrap()).unwrap();
}

fn reference_json(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

#[test]
fn all_three_fixture_layouts_load_with_the_right_config() {
    let f32m = Model::load(&fixture("tiny-f32")).unwrap();
    assert_eq!(f32m.config().layout, WeightLayout::CausalLm);
    assert!(!f32m.config().tie_word_embeddings);
    let bf = Model::load(&fixture("tiny-bf16")).unwrap();
    assert!(bf.config().tie_word_embeddings);
    let hub = Model::load(&fixture("tiny-hub")).unwrap();
    let c = hub.config();
    assert_eq!(c.layout, WeightLayout::Hub);
    assert_eq!(c.model_type, "qwen3_5");
    assert_eq!(c.rope.rope_theta, 1e6);
    assert_eq!(c.full_attention_layers(), vec![3, 7]);
    assert_eq!(c.conv_dim(), 2 * 2 * 16 + 4 * 24);
    assert_eq!(c.rotary_dim(), 8);
}

#[test]
fn weights_stay_in_the_checkpoint_dtype_and_hold_its_bytes() {
    use backburner_kernels::matmul::WeightDtype;
    use backburner_model::model::Mixer;
    use backburner_model::Linear;
    // Packed panels round the outputs up to groups of 64 (4 panels of 16); nothing else is added or widened (the
    // f32 vectors count 4 bytes an element).
    let held =
        |l: &Linear| l.out_features().div_ceil(64) * 64 * l.in_features() * l.dtype().size_of();
    for (name, dtype) in [
        ("tiny-f32", WeightDtype::F32),
        ("tiny-bf16", WeightDtype::Bf16),
        ("tiny-hub", WeightDtype::F16),
    ] {
        let m = Model::load(&fixture(name)).unwrap();
        let mut want = 0;
        for i in 0..m.config().num_hidden_layers {
            let layer = m.layer(i).unwrap();
            let mut lins = layer.ffn.linears();
            match &layer.mixer {
                Mixer::Linear(w) => lins.extend([&w.in_proj, &w.out_proj]),
                Mixer::Attention(w) => lins.extend([&w.qkv, &w.o_proj]),
            }
            // and the f32 vectors: norms, conv kernel, dt_bias, A
            let c = m.config();
            want += 4 * match &layer.mixer {
                Mixer::Linear(_) => {
                    c.conv_dim() * c.linear_conv_kernel_dim
                        + 2 * c.linear_num_value_heads
                        + c.linear_value_head_dim
                }
                Mixer::Attention(_) => 2 * c.head_dim,
            } + 4 * 2 * c.hidden_size;
            for l in lins {
                assert_eq!(l.dtype(), dtype, "{name} layer {i}");
                assert_eq!(l.bytes(), held(l), "{name} layer {i}");
                want += held(l);
            }
        }
        let c = m.config();
        let table = c.vocab_size.div_ceil(64) * 64 * c.hidden_size * dtype.size_of();
        want += 4 * c.hidden_size; // the final norm
        want += if c.tie_word_embeddings {
            table
        } else {
            2 * table
        };
        assert_eq!(m.weight_bytes(), want, "{name}");
    }
}

#[test]
fn layer_kinds_come_from_full_attention_interval_without_layer_types() {
    let text = r#"{"model_type":"qwen3_5_text","num_hidden_layers":8,"full_attention_interval":4}"#;
    let c = ModelConfig::from_json_str(text).unwrap();
    use LayerKind::*;
    assert_eq!(
        c.layer_types,
        vec![
            LinearAttention,
            LinearAttention,
            LinearAttention,
            FullAttention,
            LinearAttention,
            LinearAttention,
            LinearAttention,
            FullAttention
        ]
    );
    let text = r#"{"model_type":"qwen3_5_text","num_hidden_layers":4,"full_attention_interval":2}"#;
    let c = ModelConfig::from_json_str(text).unwrap();
    assert_eq!(
        c.layer_types,
        vec![
            LinearAttention,
            FullAttention,
            LinearAttention,
            FullAttention
        ]
    );
    // an explicit list wins
    let text = r#"{"model_type":"qwen3_5_text","num_hidden_layers":2,"full_attention_interval":4,"layer_types":["full_attention","linear_attention"]}"#;
    let c = ModelConfig::from_json_str(text).unwrap();
    assert_eq!(c.layer_types, vec![FullAttention, LinearAttention]);
}

#[test]
fn unsupported_model_type_lists_the_supported_ones() {
    let e = ModelConfig::from_json_str(r#"{"model_type":"llama"}"#).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedModelType { found, .. } if found == "llama"),
        "{e:?}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("qwen3_5_text") && msg.contains("qwen3_5"),
        "{msg}"
    );
}

#[test]
fn invalid_json_names_the_file() {
    let d = copy_fixture("tiny-f32");
    std::fs::write(d.path().join("config.json"), "{\"model_type\": ").unwrap();
    let e = Model::load(d.path()).unwrap_err();
    match &e {
        ModelError::Json { path, .. } => assert!(path.ends_with("config.json")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_config_values_are_rejected() {
    let e = ModelConfig::from_json_str(
        r#"{"model_type":"qwen3_5_text","num_attention_heads":6,"num_key_value_heads":4}"#,
    )
    .unwrap_err();
    assert!(
        matches!(e, ModelError::InvalidConfig(ref m) if m.contains("num_key_value_heads")),
        "{e:?}"
    );
    let e = ModelConfig::from_json_str(
        r#"{"model_type":"qwen3_5_text","num_hidden_layers":3,"layer_types":["full_attention"]}"#,
    )
    .unwrap_err();
    assert!(
        matches!(e, ModelError::InvalidConfig(ref m) if m.contains("layer_types")),
        "{e:?}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let d = copy_fixture("tiny-f32");
    // Ask for one more layer than the file holds: layer 8's tensors are absent.
    edit_config(d.path(), |v| {
        v["num_hidden_layers"] = 9.into();
        v["layer_types"]
            .as_array_mut()
            .unwrap()
            .push("linear_attention".into());
    });
    let e = Model::load(d.path()).unwrap_err();
    match &e {
        ModelError::MissingTensor { name, .. } => {
            assert!(name.starts_with("model.layers.8."), "{name}")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_shape_mismatch_reports_expected_and_found() {
    let d = copy_fixture("tiny-f32");
    edit_config(d.path(), |v| v["intermediate_size"] = 96.into());
    let e = Model::load(d.path()).unwrap_err();
    match &e {
        ModelError::ShapeMismatch {
            name,
            expected,
            found,
        } => {
            assert_eq!(name, "model.layers.0.mlp.gate_proj.weight");
            assert_eq!(expected, &vec![96, 64]);
            assert_eq!(found, &vec![128, 64]);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_gguf_tensor_error_names_the_tensor_and_its_dims_as_the_file_stores_them() {
    use backburner_model::gguf::writer::GgufWriter;
    use backburner_model::gguf::MetaValue;
    use backburner_model::GgufFile;
    let src = GgufFile::open(&fixture("gguf/tiny-q-q8_0.gguf")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing.gguf");
    GgufWriter::copy_of(&src)
        .unwrap()
        .remove_tensor("blk.1.ffn_down.weight")
        .write(&missing)
        .unwrap();
    match Model::load(&missing).unwrap_err() {
        ModelError::MissingTensor { name, .. } => assert_eq!(name, "blk.1.ffn_down.weight"),
        other => panic!("{other:?}"),
    }
    // A feed-forward length the tensors do not have: dims in GGUF order (ne[0] = the input length first).
    let dims = &src.tensor("blk.0.ffn_gate.weight").unwrap().dims;
    let (hidden, ffn) = (dims[0] as usize, dims[1] as usize);
    let key = "qwen35.feed_forward_length";
    // + 32: whole Q8_0 blocks; + 1: a down projection whose rows are not (the load's size count meets it first)
    for extra in [32, 1] {
        let reshaped = tmp.path().join(format!("reshaped-{extra}.gguf"));
        GgufWriter::copy_of(&src)
            .unwrap()
            .remove(key)
            .kv(key, MetaValue::U32((ffn + extra) as u32))
            .write(&reshaped)
            .unwrap();
        match Model::load(&reshaped).unwrap_err() {
            ModelError::ShapeMismatch {
                name,
                expected,
                found,
            } => {
                assert_eq!(name, "blk.0.ffn_gate.weight", "+{extra}");
                assert_eq!(expected, vec![hidden, ffn + extra]);
                assert_eq!(found, vec![hidden, ffn]);
            }
            other => panic!("+{extra}: {other:?}"),
        }
    }
}

#[test]
fn a_truncated_safetensors_file_is_reported_as_corrupt() {
    let d = copy_fixture("tiny-f32");
    let p = d.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 1000]).unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::CorruptSafetensors { message, .. } if message.contains("truncated")),
        "{e:?}"
    );
    // a file shorter than its own header
    std::fs::write(&p, &bytes[..100]).unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(matches!(&e, ModelError::CorruptSafetensors { .. }), "{e:?}");
    // garbage
    std::fs::write(&p, b"not a safetensors file at all").unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(matches!(&e, ModelError::CorruptSafetensors { .. }), "{e:?}");
}

#[test]
fn a_corrupt_header_is_reported_as_corrupt() {
    let d = copy_fixture("tiny-f32");
    let p = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8] = b'['; // the JSON header no longer parses as an object
    std::fs::write(&p, &bytes).unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(matches!(&e, ModelError::CorruptSafetensors { .. }), "{e:?}");
}

#[test]
fn a_shard_named_by_the_index_but_absent_is_an_io_error_naming_it() {
    let d = copy_fixture("tiny-hub");
    let shard = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("model-00002")
        })
        .expect("a second shard");
    std::fs::remove_file(&shard).unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::Io { path, .. } if path == &shard),
        "{e:?}"
    );
}

#[test]
fn no_weights_at_all_is_its_own_error() {
    let d = copy_fixture("tiny-f32");
    std::fs::remove_file(d.path().join("model.safetensors")).unwrap();
    assert!(matches!(
        Model::load(d.path()).unwrap_err(),
        ModelError::NoWeights(_)
    ));
}

#[test]
fn a_tokenizer_larger_than_the_model_vocab_is_rejected() {
    let e = TextTokenizer::from_dir(&fixture("tiny-f32"), 300, &[]).unwrap_err();
    assert!(
        matches!(
            e,
            ModelError::VocabMismatch {
                tokenizer: 448,
                model: 300
            }
        ),
        "{e:?}"
    );
}

#[test]
fn the_tokenizer_matches_python_tokenizers_ids_and_round_trips() {
    for name in ["tiny-f32", "tiny-hub"] {
        let tok = TextTokenizer::from_dir(&fixture(name), 512, &[])
            .unwrap()
            .unwrap();
        let r = reference_json(name);
        let checks = r["tokenizer_checks"].as_array().unwrap();
        assert!(checks.len() >= 5);
        for c in checks {
            let text = c["text"].as_str().unwrap();
            let want: Vec<u32> = serde_json::from_value(c["ids"].clone()).unwrap();
            assert_eq!(tok.encode(text).unwrap(), want, "{text:?}");
            assert_eq!(tok.decode(&want).unwrap(), c["decoded"].as_str().unwrap());
        }
        let prompt = std::fs::read_to_string(fixture(name).join("prompt.txt")).unwrap();
        let want: Vec<u32> = serde_json::from_value(r["prompt_ids"].clone()).unwrap();
        assert_eq!(tok.encode(&prompt).unwrap(), want);
        assert_eq!(tok.eos_ids(), &[447, 445]);
    }
}

#[test]
fn chat_templates_render_like_transformers_from_both_locations() {
    // tiny-f32 keeps the template in tokenizer_config.json, tiny-hub in chat_template.jinja.
    for name in ["tiny-f32", "tiny-hub"] {
        let tok = TextTokenizer::from_dir(&fixture(name), 512, &[])
            .unwrap()
            .unwrap();
        let r = &reference_json(name)["chat_reference"];
        let msgs: Vec<ChatMessage> = r["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| ChatMessage {
                role: m["role"].as_str().unwrap().into(),
                content: m["content"].as_str().unwrap().into(),
            })
            .collect();
        let text = tok.apply_chat_template(&msgs, true).unwrap();
        assert_eq!(text, r["text"].as_str().unwrap(), "{name}");
        let ids: Vec<u32> = serde_json::from_value(r["ids"].clone()).unwrap();
        assert_eq!(tok.encode(&text).unwrap(), ids, "{name}");
    }
}

#[test]
fn a_checkpoint_without_tokenizer_loads_without_one() {
    let d = copy_fixture("tiny-f32");
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    assert!(TextTokenizer::from_dir(d.path(), 512, &[])
        .unwrap()
        .is_none());
    Model::load(d.path()).unwrap();
}

#[test]
fn configs_that_would_compute_silently_wrong_are_rejected() {
    let cases = [
        (
            r#"{"model_type":"qwen3_5_text","rms_norm_eps":-1}"#,
            "rms_norm_eps",
        ),
        (
            r#"{"model_type":"qwen3_5_text","rope_parameters":{"rope_type":"yarn","factor":4}}"#,
            "rope_type",
        ),
        (
            r#"{"model_type":"qwen3_5_text","rope_scaling":{"rope_type":"linear","factor":8}}"#,
            "rope_scaling",
        ),
        (
            r#"{"model_type":"qwen3_5_text","num_attention_heads":576460752303423492}"#,
            "num_attention_heads",
        ),
        (
            r#"{"model_type":"qwen3_5_text","linear_key_head_dim":4611686018427387920}"#,
            "linear_key_head_dim",
        ),
        (
            r#"{"model_type":"qwen3_5_text","eos_token_id":4294967320}"#,
            "eos_token_id",
        ),
        (
            r#"{"model_type":"qwen3_5_text","eos_token_id":"</s>"}"#,
            "eos_token_id",
        ),
    ];
    for (text, want) in cases {
        let e = ModelConfig::from_json_str(text).unwrap_err();
        assert!(
            matches!(&e, ModelError::InvalidConfig(m) if m.contains(want)),
            "{text}: {e:?}"
        );
    }
}

#[test]
fn a_tensor_stored_in_two_shards_is_an_error() {
    let d = copy_fixture("tiny-f32");
    // write a second shard holding a copy of one tensor and an index naming both files
    let src = std::fs::read(d.path().join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&src).unwrap();
    let t = st.tensor("model.norm.weight").unwrap();
    safetensors::serialize_to_file(
        vec![("model.norm.weight", t)],
        None,
        &d.path().join("extra.safetensors"),
    )
    .unwrap();
    let mut map = serde_json::Map::new();
    for n in st.names() {
        map.insert(n.to_string(), "model.safetensors".into());
    }
    map.insert("model.norm.weight".into(), "extra.safetensors".into());
    let idx = serde_json::json!({ "weight_map": map });
    std::fs::write(
        d.path().join("model.safetensors.index.json"),
        idx.to_string(),
    )
    .unwrap();
    let e = Model::load(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::CorruptSafetensors { message, .. } if message.contains("also stored")),
        "{e:?}"
    );
}

#[test]
fn load_bytes_from_the_headers_equals_the_weights_held_after_loading() {
    use backburner_model::{load_bytes, Checkpoint, LoadOptions};
    // GGUF files too: quantized projections are held as packed blocks, so the count from the headers must follow
    // each format's block size and panel padding
    for name in [
        "tiny-f32",
        "tiny-bf16",
        "tiny-hub",
        "gguf/tiny-f16-split-00001-of-00002.gguf",
        "gguf/tiny-q-q8_0.gguf",
        "gguf/tiny-q-q4_0.gguf",
        "gguf/tiny-q-q4_k.gguf",
        "gguf/tiny-q-q6_k.gguf",
        "gguf/tiny-q-iq4_xs.gguf",
    ] {
        let dir = fixture(name);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        let n = cfg.num_hidden_layers;
        for (layers, ends) in [
            (0..n, true),
            (0..n / 2, true),
            (n / 2..n, false),
            (1..2, false),
        ] {
            let opts = LoadOptions {
                layers: layers.clone(),
                ends,
            };
            let want = load_bytes(&ck, &cfg, &opts).unwrap();
            let m = Model::from_checkpoint(cfg.clone(), &ck, &opts, |_, _| {}).unwrap();
            assert_eq!(
                want,
                m.weight_bytes() as u64,
                "{name} {layers:?} ends {ends}"
            );
        }
        let bad = LoadOptions {
            layers: 0..n + 1,
            ends: true,
        };
        assert!(matches!(
            load_bytes(&ck, &cfg, &bad),
            Err(ModelError::InvalidConfig(_))
        ));
    }
}

#[test]
fn a_restacked_gguf_repeats_the_blocks_it_names() {
    // restack_layers builds the test models that need a split point from a one-cycle quantized fixture
    use backburner_model::gguf::writer::restack_layers;
    use backburner_model::{Checkpoint, GgufFile};
    let src_path = fixture("gguf/tiny-q-q4_k.gguf");
    let src = GgufFile::open(&src_path).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("stacked.gguf");
    restack_layers(&src, &[0, 1, 2, 3, 0, 1, 2, 3])
        .unwrap()
        .write(&out)
        .unwrap();
    let cfg = ModelConfig::from_dir(&out).unwrap();
    let (lin, full) = (LayerKind::LinearAttention, LayerKind::FullAttention);
    assert_eq!(cfg.layer_types, [lin, lin, lin, full, lin, lin, lin, full]);
    let (a, b) = (
        Checkpoint::open(&src_path).unwrap(),
        Checkpoint::open(&out).unwrap(),
    );
    for name in a.names() {
        let (da, ba) = a.raw(name).unwrap();
        let (db, bb) = b.raw(name).unwrap();
        assert!(da == db && ba == bb, "{name}");
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let (i, tail) = rest.split_once('.').unwrap();
            let moved = format!("model.layers.{}.{tail}", i.parse::<usize>().unwrap() + 4);
            assert!(b.raw(&moved).unwrap().1 == ba, "{moved}");
        }
    }
    let ends = a
        .names()
        .iter()
        .filter(|n| !n.starts_with("model.layers."))
        .count();
    assert_eq!(ends, 2, "embedding and final norm (tied head)");
    assert_eq!(b.names().len(), 2 * a.names().len() - ends, "the ends once");
    assert!(restack_layers(&src, &[4]).is_err());
}

#[test]
fn layer_digests_read_in_chunks_equal_the_one_shot_hash_of_the_mapped_bytes() {
    use backburner_model::fingerprint::layer_digest;
    use backburner_model::Checkpoint;
    use sha2::{Digest, Sha256};
    for name in ["tiny-f32", "tiny-bf16", "tiny-hub"] {
        let dir = fixture(name);
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        for layer in 0..cfg.num_hidden_layers {
            // the definition, hashed from the map in one piece
            let prefix = cfg.layout.prefix();
            let mut names: Vec<(String, &str)> = ck
                .names()
                .into_iter()
                .filter_map(|n| {
                    let rest = n.strip_prefix(prefix)?.strip_prefix("layers.")?;
                    let (idx, tail) = rest.split_once('.')?;
                    (idx.parse::<usize>() == Ok(layer))
                        .then(|| (format!("layers.{layer}.{tail}"), n))
                })
                .collect();
            names.sort();
            let mut h = Sha256::new();
            for (canon, n) in names {
                let (dtype, bytes) = ck.raw(n).unwrap();
                h.update(canon.as_bytes());
                h.update(format!("{dtype:?}{:?}", ck.shape(n).unwrap()).as_bytes());
                h.update(xxhash_rust::xxh3::xxh3_128(bytes).to_le_bytes());
            }
            let want: [u8; 32] = h.finalize().into();
            assert_eq!(
                layer_digest(&ck, &cfg, layer).unwrap(),
                want,
                "{name} layer {layer}"
            );
        }
        // chunks smaller than a tensor and than the read buffer give the same bytes in order
        let t = ck.names()[0].to_string();
        let mut got = Vec::new();
        ck.read_chunks(&t, 7, |c| got.extend_from_slice(c)).unwrap();
        assert_eq!(got, ck.raw(&t).unwrap().1);
        let mut x = xxhash_rust::xxh3::Xxh3::new();
        ck.read_chunks(&t, 7, |c| x.update(c)).unwrap();
        assert_eq!(x.digest128(), xxhash_rust::xxh3::xxh3_128(&got));
    }
}

/// An error with its sources, as a CLI prints it.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out += &format!(": {s}");
        src = s.source();
    }
    out
}

/// Runs `f` on a thread and fails (instead of hanging) if it takes more than 10 s.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .expect("blocked on a non-regular file")
}

#[test]
fn a_fifo_or_directory_in_place_of_a_checkpoint_file_is_refused_without_blocking() {
    for name in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "tokenizer_config.json",
    ] {
        let d = copy_fixture("tiny-bf16");
        let p = d.path().join(name);
        let _ = std::fs::remove_file(&p);
        let made = std::process::Command::new("mkfifo").arg(&p).status();
        if !made.map(|s| s.success()).unwrap_or(false) {
            eprintln!("mkfifo unavailable: skipping {name}");
            continue;
        }
        let dir = d.path().to_path_buf();
        let err = within_10s(move || {
            let cfg = ModelConfig::from_dir(&dir).map_err(|e| chain(&e))?;
            TextTokenizer::from_dir(&dir, cfg.vocab_size, &cfg.eos_token_ids)
                .map_err(|e| chain(&e))?;
            backburner_model::Checkpoint::open(&dir)
                .map(|_| ())
                .map_err(|e| chain(&e))
        })
        .expect_err(name);
        assert!(
            err.contains("not a regular file") && err.contains(name),
            "{name}: {err}"
        );
    }
    // a directory named config.json
    let d = copy_fixture("tiny-bf16");
    let p = d.path().join("config.json");
    std::fs::remove_file(&p).unwrap();
    std::fs::create_dir(&p).unwrap();
    let err = chain(&ModelConfig::from_dir(d.path()).unwrap_err());
    assert!(err.contains("not a regular file"), "{err}");
}
