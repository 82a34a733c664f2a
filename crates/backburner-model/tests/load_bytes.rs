//! `load_bytes` checks every tensor the load reads, as the load does: a GGUF missing one of the ends' tensors or a
//! layer's vector is refused with the load's own typed error, so `plan` and the budget check before loading refuse
//! the files `run` refuses.

use std::path::PathBuf;

use backburner_model::gguf::writer::GgufWriter;
use backburner_model::{
    load_bytes, Checkpoint, GgufFile, LoadOptions, Model, ModelConfig, ModelError,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

#[test]
fn load_bytes_refuses_a_gguf_without_its_final_norm_or_a_layer_vector_as_the_load_does() {
    let src = GgufFile::open(&fixture("gguf/tiny-q-q4_k.gguf")).unwrap();
    let d = tempfile::tempdir().unwrap();
    for missing in ["output_norm.weight", "blk.1.ssm_norm.weight"] {
        let mut w = GgufWriter::copy_of(&src).unwrap();
        w.remove_tensor(missing);
        let p = d.path().join(format!("without-{missing}.gguf"));
        w.write(&p).unwrap();
        let cfg = ModelConfig::from_dir(&p).unwrap();
        let ck = Checkpoint::open(&p).unwrap();
        let opts = LoadOptions {
            layers: 0..cfg.num_hidden_layers,
            ends: true,
        };
        let e = load_bytes(&ck, &cfg, &opts).unwrap_err();
        assert!(
            matches!(&e, ModelError::MissingTensor { name, dir } if name == missing && *dir == p),
            "{missing}: {e:?}"
        );
        let loaded = Model::from_checkpoint(cfg.clone(), &ck, &opts, |_, _| {}).unwrap_err();
        assert_eq!(e.to_string(), loaded.to_string(), "{missing}");
    }
}

#[test]
fn weight_storage_is_every_matrix_once_the_weights_less_their_f32_vectors() {
    use backburner_model::LayerKind;
    for name in [
        "gguf/tiny-q-q4_k.gguf",
        "gguf/tiny-q-q8_0.gguf",
        "gguf/tiny-bf16.gguf",
    ] {
        let m = Model::load(&fixture(name)).unwrap();
        let c = m.config().clone();
        let storage: usize = m.weight_storage().iter().map(|s| s.len()).sum();
        // the f32 vectors: every layer's two norms and its mixer's vectors, and the final norm
        let (h, hv, dv, d) = (
            c.hidden_size,
            c.linear_num_value_heads,
            c.linear_value_head_dim,
            c.head_dim,
        );
        let vectors: usize = h + c
            .layer_types
            .iter()
            .map(|k| {
                2 * h
                    + match k {
                        LayerKind::LinearAttention => {
                            c.conv_dim() * c.linear_conv_kernel_dim + 2 * hv + dv
                        }
                        LayerKind::FullAttention => 2 * d,
                    }
            })
            .sum::<usize>();
        assert_eq!(storage + 4 * vectors, m.weight_bytes(), "{name}");
        assert!(storage > 0);
    }
}

#[test]
fn a_decode_step_reads_one_row_of_an_untied_embedding_and_all_of_a_tied_one() {
    // tiny-f32: untied ([V, H] f32 table beside lm_head); tiny-bf16: tied (the table is the head)
    let untied = Model::load(&fixture("tiny-f32")).unwrap();
    let c = untied.config().clone();
    assert!(!c.tie_word_embeddings);
    let table = 4 * c.vocab_size * c.hidden_size;
    assert_eq!(
        untied.decode_weight_bytes(),
        untied.weight_bytes() - table + 4 * c.hidden_size
    );
    let tied = Model::load(&fixture("tiny-bf16")).unwrap();
    assert!(tied.config().tie_word_embeddings);
    assert_eq!(tied.decode_weight_bytes(), tied.weight_bytes());
}
