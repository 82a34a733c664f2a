//! A GGUF file's tensors that the architecture does not use are reported (a warning naming each), while the MTP
//! blocks and vision tensors, which are expected and skipped, are only counted (one info line per group); the model
//! loads as without them.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use backburner_model::checkpoint::{unused_tensors, UnusedTensors};
use backburner_model::gguf::writer::GgufWriter;
use backburner_model::gguf::{GgmlType, MetaValue};
use backburner_model::{Checkpoint, GgufFile, Model, ModelConfig};
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Metadata, Subscriber};

fn gguf(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/gguf")
        .join(name)
}

/// Records every event's level and message.
#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<(Level, String)>>>);

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl Subscriber for Recorder {
    fn enabled(&self, _: &Metadata<'_>) -> bool {
        true
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, e: &Event<'_>) {
        let mut m = Message(String::new());
        e.record(&mut m);
        self.0.lock().unwrap().push((*e.metadata().level(), m.0));
    }
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Loads the model at `path` under a [`Recorder`]; returns its logits for a short prompt and the events.
fn load_logged(path: &std::path::Path) -> (Vec<f32>, Vec<(Level, String)>) {
    let rec = Recorder::default();
    let m = tracing::subscriber::with_default(rec.clone(), || Model::load(path).unwrap());
    let mut state = backburner_model::ModelState::new(m.config(), 0..4, Default::default());
    let logits = m.forward_tokens(&[1, 2, 3], &mut state, Some(2..3));
    let events = rec.0.lock().unwrap().clone();
    (logits, events)
}

#[test]
fn tensors_the_architecture_does_not_use_are_named_and_known_groups_counted() {
    let src_path = gguf("tiny-q-q8_0.gguf");
    let src = GgufFile::open(&src_path).unwrap();
    let cfg = ModelConfig::from_dir(&src_path).unwrap();
    // the fixture: every tensor used
    let ck = Checkpoint::open(&src_path).unwrap();
    assert_eq!(unused_tensors(&ck, &cfg), UnusedTensors::default());
    let (want, events) = load_logged(&src_path);
    assert!(events.iter().all(|(l, _)| *l > Level::INFO), "{events:?}");

    // extras: an attention projection in a Gated DeltaNet block (layer 0), a tensor no architecture of this name
    // set has, one outside the blocks; an MTP block past the 4 layers (block_count 5, one nextn layer) with a
    // nextn tensor; two vision tensors
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("extra.gguf");
    let mut w = GgufWriter::copy_of(&src).unwrap();
    w.remove("qwen35.block_count")
        .kv("qwen35.block_count", MetaValue::U32(5))
        .kv("qwen35.nextn_predict_layers", MetaValue::U32(1));
    for (name, dims) in [
        ("blk.0.attn_q.weight", vec![256u64, 512]),
        ("blk.2.ffn_extra.weight", vec![256, 8]),
        ("token_types.weight", vec![256, 2]),
        ("blk.4.attn_norm.weight", vec![256]),
        ("blk.4.nextn.eh_proj.weight", vec![512, 256]),
        ("v.patch_embd.weight", vec![16, 16]),
        ("mm.0.weight", vec![16, 16]),
    ] {
        w.tensor_filled(name, &dims, GgmlType::F32, 7);
    }
    w.write(&path).unwrap();
    let cfg2 = ModelConfig::from_dir(&path).unwrap();
    assert_eq!(cfg2.mtp_num_hidden_layers, 1);
    assert_eq!(
        ModelConfig {
            mtp_num_hidden_layers: 0,
            ..cfg2.clone()
        },
        cfg,
        "the extra block is an MTP block, not a layer"
    );
    let ck = Checkpoint::open(&path).unwrap();
    assert_eq!(
        unused_tensors(&ck, &cfg2),
        UnusedTensors {
            unknown: vec![
                "blk.0.attn_q.weight".into(),
                "blk.2.ffn_extra.weight".into(),
                "token_types.weight".into(),
            ],
            mtp: 2,
            vision: 2,
        }
    );
    let (got, events) = load_logged(&path);
    assert!(
        got.iter()
            .map(|v| v.to_bits())
            .eq(want.iter().map(|v| v.to_bits())),
        "the extras changed the model"
    );
    let file = path.display();
    let at = |level: Level| -> Vec<&str> {
        events
            .iter()
            .filter(|(l, _)| *l == level)
            .map(|(_, m)| m.as_str())
            .collect()
    };
    let warned: Vec<String> = ["blk.0.attn_q.weight", "blk.2.ffn_extra.weight", "token_types.weight"]
        .iter()
        .map(|n| {
            format!(
                "{file}: tensor `{n}` is not used by the qwen35 architecture with this file's config; it is not loaded"
            )
        })
        .collect();
    assert_eq!(at(Level::WARN), warned);
    assert_eq!(
        at(Level::INFO),
        [
            format!("{file}: skipping the 2 tensors of the MTP blocks (multi-token prediction is not used)"),
            format!("{file}: skipping 2 vision tensors (this engine reads text only)"),
        ]
    );
}
