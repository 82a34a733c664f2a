//! The serving engine on a model with layers placed on a device (here the CPU backend, the only one this machine
//! has): randomized conversations through the prompt cache (checkpoints and snapshots of the device's states, KV
//! truncated on the device) give the tokens and logits, bit for bit, of cold runs on the plain model, and the
//! cache is used.

use std::sync::Arc;

use backburner_engine::serve::{CacheLimits, Engine, ServeOptions};
use backburner_engine::{generate, GenerateParams, Generation, Session};
use backburner_model::device::CpuBackend;
use backburner_model::Model;

use crate::cache_exact::{converse, opts};
use crate::common;

#[test]
fn cached_answers_with_layers_on_a_device_equal_cold_runs_on_the_cpu_path() {
    for (mi, name) in ["tiny-f32", "gguf/tiny-q-q4_k.gguf"].iter().enumerate() {
        let path = common::fixture(name);
        let plain = Arc::new(Model::load(&path).unwrap());
        let mut placed = Model::load(&path).unwrap();
        let n = placed.config().num_hidden_layers;
        placed.place_layers(1..n, Arc::new(CpuBackend)).unwrap();
        placed.place_head(Arc::new(CpuBackend)).unwrap();
        let placed = Arc::new(placed);
        let ubatch = 64;
        let sessions = vec![Session::new(placed.clone(), opts(ubatch)).unwrap()];
        let serve = ServeOptions {
            queue: 4,
            cache: CacheLimits::default(),
            ..Default::default()
        };
        let e = Engine::start(sessions, None, serve).unwrap();
        let cold = |p: &[u32], params: &GenerateParams| -> Generation {
            let mut s = Session::new(plain.clone(), opts(ubatch)).unwrap();
            generate(&mut s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
        };
        let vocab = plain.config().vocab_size;
        let what = format!("{name} with layers 1..{n} and the head on the CPU backend");
        let reused = converse(&e, &cold, vocab, 40 + mi as u64, 8, &what);
        assert!(
            reused >= 100,
            "{what}: only {reused} tokens came from the cache"
        );
    }
}
