//! Aggregate decode rate of [`Model::forward_decode_batch`] for batches of 1, 2, 4 and 8 sequences on the
//! benchmark-size synthetic model. A timing example, not a test: it asserts nothing about time. Run it alone, in
//! release, on a quiet machine:
//!
//! `cargo test --release -p backburner-model --test batch_decode_timing -- --ignored --nocapture`

use std::time::Instant;

use backburner_model::synthetic::write_random_checkpoint;
use backburner_model::{KvOptions, Model, ModelState};

/// The benchmark model's config (as `backburner-cli`'s `bench_config`): 8 layers (3 GDN : 1 attention), hidden
/// 1024, intermediate 3072, vocab 32768, bf16.
fn bench_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 32768, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": true, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "dtype": "bfloat16"
    })
}

const SIZES: [usize; 4] = [1, 2, 4, 8];
const ROUNDS: usize = 5;
const STEPS: usize = 16;
const PROMPT: usize = 64;

/// Seconds for `STEPS` batched steps of the first `n` states, which are then rewound.
fn time_batch(m: &Model, states: &mut [ModelState], n: usize) -> f64 {
    let snaps: Vec<_> = states[..n].iter().map(ModelState::snapshot).collect();
    let mut refs: Vec<&mut ModelState> = states[..n].iter_mut().collect();
    let mut ids: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
    let vocab = m.config().vocab_size;
    let t0 = Instant::now();
    for _ in 0..STEPS {
        let logits = m.forward_decode_batch(&ids, &mut refs);
        for (id, row) in ids.iter_mut().zip(logits.chunks_exact(vocab)) {
            *id = (0..vocab).fold(0, |b, j| if row[j] > row[b] { j } else { b }) as u32;
        }
    }
    let s = t0.elapsed().as_secs_f64();
    for (st, snap) in states.iter_mut().zip(&snaps) {
        st.restore(snap);
    }
    s
}

/// Seconds for `STEPS` single-sequence steps ([`Model::forward_tokens`]) of the first state, which is then rewound.
fn time_alone(m: &Model, st: &mut ModelState) -> f64 {
    let snap = st.snapshot();
    let mut id = 100u32;
    let t0 = Instant::now();
    for _ in 0..STEPS {
        let row = m.forward_tokens(&[id], st, Some(0..1));
        id = (0..row.len()).fold(0, |b, j| if row[j] > row[b] { j } else { b }) as u32;
    }
    let s = t0.elapsed().as_secs_f64();
    st.restore(&snap);
    s
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[test]
#[ignore = "timing example: run in release with --ignored --nocapture"]
fn aggregate_decode_rate_by_batch_size() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &bench_config(), 1).unwrap();
    let m = Model::load(dir.path()).unwrap();
    let n_layers = m.config().num_hidden_layers;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let max = *SIZES.iter().max().unwrap();
        let mut states: Vec<ModelState> = (0..max)
            .map(|_| ModelState::new(m.config(), 0..n_layers, KvOptions::default()))
            .collect();
        for (s, st) in states.iter_mut().enumerate() {
            let p: Vec<u32> = (0..PROMPT as u32).map(|i| (i * 7919 + s as u32 * 104_729) % 32768).collect();
            m.forward_tokens(&p, st, None);
        }
        time_batch(&m, &mut states, max); // warm-up: grows every buffer
        let mut secs: Vec<Vec<f64>> = vec![Vec::new(); SIZES.len()];
        let mut alone = Vec::new();
        for _ in 0..ROUNDS {
            alone.push(time_alone(&m, &mut states[0]));
            for (k, &n) in SIZES.iter().enumerate() {
                secs[k].push(time_batch(&m, &mut states, n));
            }
        }
        println!("batched decode, bench model, {threads} threads, depth {PROMPT}, {STEPS} steps × {ROUNDS} rounds (median):");
        println!("batch  aggregate tok/s  ms/step");
        let s = median(alone);
        println!("alone  {:>15.1}  {:>7.2}   (forward_tokens, one sequence)", STEPS as f64 / s, 1e3 * s / STEPS as f64);
        for (k, &n) in SIZES.iter().enumerate() {
            let s = median(secs[k].clone());
            let rate = (n * STEPS) as f64 / s;
            println!("{n:>5}  {rate:>15.1}  {:>7.2}", 1e3 * s / STEPS as f64);
        }
    });
}
