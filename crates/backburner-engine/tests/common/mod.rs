//! Shared helpers for tests against the committed reference fixtures (`fixtures/`, made by
//! `scripts/make_fixtures.py` with Hugging Face transformers).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use backburner_model::Model;
use safetensors::tensor::{Dtype, SafeTensors};

/// `fixtures/<name>` in the repository.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// The reference outputs of a fixture.
pub struct Reference {
    bytes: Vec<u8>,
    pub json: serde_json::Value,
}

impl Reference {
    pub fn load(name: &str) -> Self {
        let dir = fixture(name);
        let bytes =
            std::fs::read(dir.join("reference.safetensors")).expect("reference.safetensors");
        let json = serde_json::from_str(
            &std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"),
        )
        .expect("valid reference.json");
        Reference { bytes, json }
    }

    /// A tensor as f32 with its shape.
    pub fn f32(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let st = SafeTensors::deserialize(&self.bytes).expect("valid reference");
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("reference has no {name}"));
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let v = t
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        (v, t.shape().to_vec())
    }

    /// An integer tensor as u32.
    pub fn ids(&self, name: &str) -> Vec<u32> {
        let st = SafeTensors::deserialize(&self.bytes).expect("valid reference");
        let t = st
            .tensor(name)
            .unwrap_or_else(|_| panic!("reference has no {name}"));
        assert_eq!(t.dtype(), Dtype::I64, "{name}");
        t.data()
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
}

pub fn load_model(name: &str) -> Arc<Model> {
    Arc::new(Model::load(&fixture(name)).expect("fixture loads"))
}

/// Largest absolute difference.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length differs");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max)
}
