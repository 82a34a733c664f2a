//! Whole models on the CUDA backend against the CPU path, on the fixtures of backburner-model's `tests/device.rs`
//! (a random `tiny_config` safetensors checkpoint in bf16; a random GGUF in Q4_K with Q6_K `ffn_down` and Q8_0
//! `attn_qkv`) and on a wider random GGUF whose every projection is in a block format: the block-format products
//! op by op, then every layer placed on `cuda:0` through `Model::place_layers`.
//!
//! Tolerances: each step's logits within `rel`·max|logit| + 1e-3 of the CPU's, `rel` 2e-2 for the bf16 checkpoint (bf16
//! products of the 70-token prompt), 6e-2 for block formats (the CPU quantizes activations to 8 bits, the GPU keeps
//! them f32: the CPU emulation of the kernels, emu/, measured 0.4 % and 2.2 % of max|logit| for the two, the
//! latter being the CPU's own quantization error); greedy tokens equal wherever the CPU's
//! top-2 margin exceeds twice that bound (both runs are fed the CPU's tokens, so one near-tie does not end the
//! comparison). Without a CUDA device the GPU tests print one `skipped:` line; the format check runs everywhere.

mod common;

use std::path::Path;

use backburner_cuda::fallback_formats;
use backburner_kernels::kv::KvDtype;
use backburner_model::device::top_k_row;
use backburner_model::gguf::random::{Generator, TypeRule, Vocab};
use backburner_model::model::{Ffn, Mixer};
use backburner_model::synthetic::{tiny_config, write_random_checkpoint};
use backburner_model::{KvOptions, Linear, Model, ModelConfig, ModelState};
use common::{check_products, gpu, max_abs};

const KV: KvOptions = KvOptions {
    page_size: 16,
    dtype: KvDtype::F16,
};

/// Writes a random GGUF of `cfg` (JSON) with Q4_K, Q6_K ffn_down, Q8_0 attn_qkv.
fn write_gguf(path: &Path, cfg: &serde_json::Value) {
    let c = ModelConfig::from_json_str(&cfg.to_string()).unwrap();
    let o = vec!["ffn_down=Q6_K".to_string(), "attn_qkv=Q8_0".to_string()];
    let rule = TypeRule::parse("Q4_K", &o).unwrap();
    let g = Generator::new(&c, &rule, &Vocab::ByteLevel, 7).unwrap();
    g.write_file(path, 1 << 20, &mut |_| {}).unwrap();
}

/// `tiny_config` widened so that every projection can be a 256-element block format.
fn wide_config() -> serde_json::Value {
    let mut c = tiny_config(4);
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("head_dim", 64),
        ("linear_key_head_dim", 32),
        ("linear_value_head_dim", 64),
    ] {
        c[k] = v.into();
    }
    c
}

/// Every projection of the layers of `m`.
fn linears(m: &Model) -> Vec<(String, &Linear)> {
    let mut v = Vec::new();
    for i in 0..m.config().num_hidden_layers {
        let l = m.layer(i).unwrap();
        match &l.mixer {
            Mixer::Linear(w) => v.extend([
                (format!("{i}.in_proj"), &w.in_proj),
                (format!("{i}.out_proj"), &w.out_proj),
            ]),
            Mixer::Attention(w) => v.extend([
                (format!("{i}.qkv"), &w.qkv),
                (format!("{i}.o_proj"), &w.o_proj),
            ]),
        }
        if let Ffn::Dense { gate_up, down } = &l.ffn {
            v.extend([
                (format!("{i}.gate_up"), gate_up),
                (format!("{i}.down"), down),
            ]);
        }
    }
    v
}

#[test]
fn the_wide_fixtures_weights_are_all_in_formats_with_kernels() {
    let dir = tempfile::tempdir().unwrap();
    for (name, cfg) in [("tiny", tiny_config(4)), ("wide", wide_config())] {
        let path = dir.path().join(format!("{name}.gguf"));
        write_gguf(&path, &cfg);
        let m = Model::load(&path).unwrap();
        for (what, w) in linears(&m) {
            let fb = fallback_formats(w);
            if name == "wide" {
                assert!(fb.is_empty(), "{name} {what}: {fb:?} held as f32");
            }
        }
    }
}

#[test]
fn block_format_products_match_the_cpu() {
    let Some(g) = gpu("block-format products") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.gguf");
    write_gguf(&path, &wide_config());
    let m = Model::load(&path).unwrap();
    for (what, w) in linears(&m) {
        check_products(&g, w, &format!("{what} {:?}", w.format()));
    }
}

/// Logits of a 70-token prompt, then of 5 decode steps fed `feed` (the CPU's greedy tokens; `None`: its own).
fn run(m: &Model, feed: Option<&[u32]>) -> (Vec<Vec<f32>>, Vec<u32>) {
    let c = m.config();
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let prompt: Vec<u32> = (0..70u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % c.vocab_size as u32)
        .collect();
    let l = m.forward_tokens(&prompt, &mut s, Some(69..70));
    let mut out = vec![l];
    let mut toks = Vec::new();
    for step in 0..5 {
        let next = feed.map_or_else(|| top_k_row(out.last().unwrap(), 1)[0].0, |f| f[step]);
        toks.push(next);
        out.push(m.forward_tokens(&[next], &mut s, Some(0..1)));
    }
    assert!(s.take_remote_error().is_none());
    (out, toks)
}

fn check_model(load: impl Fn() -> Model, what: &str, rel: f32) {
    let Some(g) = gpu(what) else { return };
    let (want, toks) = run(&load(), None);
    let mut m = load();
    let n = m.config().num_hidden_layers;
    m.place_layers(0..n, g).unwrap();
    let (got, _) = run(&m, Some(&toks));
    for (step, (gl, wl)) in got.iter().zip(&want).enumerate() {
        let tol = rel * max_abs(wl) + 1e-3;
        let dev = gl
            .iter()
            .zip(wl)
            .fold(0.0f32, |a, (x, y)| a.max((x - y).abs()));
        assert!(
            dev <= tol,
            "{what} step {step}: logits differ by {dev} (tolerance {tol})"
        );
        let top = top_k_row(wl, 2);
        if top[0].1 - top[1].1 > 2.0 * tol {
            assert_eq!(
                top_k_row(gl, 1)[0].0,
                top[0].0,
                "{what} step {step}: greedy token"
            );
        }
        println!(
            "{what} step {step}: max deviation {dev:.2e} of max |logit| {:.3}",
            max_abs(wl)
        );
    }
}

#[test]
fn a_dense_model_on_cuda_matches_the_cpu_path() {
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 23).unwrap();
    check_model(
        || Model::load(dir.path()).unwrap(),
        "tiny bf16 safetensors",
        2e-2,
    );
}

#[test]
fn block_format_models_on_cuda_match_the_cpu_path() {
    let dir = tempfile::tempdir().unwrap();
    for (name, cfg) in [("tiny", tiny_config(4)), ("wide", wide_config())] {
        let path = dir.path().join(format!("{name}.gguf"));
        write_gguf(&path, &cfg);
        check_model(
            || Model::load(&path).unwrap(),
            &format!("{name} GGUF"),
            6e-2,
        );
    }
}

/// Within one device the bits repeat: layers and head on `cuda:0`, a snapshot after the prompt, decode steps, back to
/// the snapshot (the Gated DeltaNet states written back, the KV cache truncated on the device), the same steps give
/// the same logits bit for bit; and a cleared state gives the first run's.
#[test]
fn snapshots_on_the_gpu_restore_the_same_bits() {
    let Some(g) = gpu("snapshots_on_the_gpu_restore_the_same_bits") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    write_random_checkpoint(dir.path(), &tiny_config(4), 31).unwrap();
    let mut m = Model::load(dir.path()).unwrap();
    m.place_layers(0..4, g.clone()).unwrap();
    m.place_head(g).unwrap();
    let c = m.config().clone();
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 11 + 2) % 200).collect();
    let steps = [3u32, 7, 1];
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let decode = |s: &mut ModelState| -> Vec<Vec<u32>> {
        steps
            .iter()
            .map(|&t| bits(&m.forward_tokens(&[t], s, Some(0..1))))
            .collect()
    };
    let mut s = ModelState::new(&c, 0..4, KV);
    m.forward_tokens(&prompt, &mut s, None);
    let snap = s.snapshot();
    let first = decode(&mut s);
    s.restore(&snap);
    assert_eq!(decode(&mut s), first, "after restore");
    s.clear();
    m.forward_tokens(&prompt, &mut s, None);
    assert_eq!(decode(&mut s), first, "after clear");
    assert!(s.take_remote_error().is_none());
}
