//! Single-node outputs against Hugging Face transformers on the committed fixtures.
//!
//! Tolerance. The fixtures carry two references: transformers' own f32 run (`prefill_logits`, `decode_logits`) and a
//! float64 run of the same checkpoint (`*_f64`, see fixtures/README.md). The fixtures' weights are deliberately large
//! so that layout mistakes show, and that also amplifies f32 rounding: transformers' f32 logits sit up to 4e-4 from
//! the f64 truth on prefill and up to 1e-3 on one tiny-hub decode step (`f64_check` in reference.json). An f32
//! engine cannot do better than "as close to the truth as transformers' f32 run", so we assert exactly that, with a
//! 1.5× margin for a different (not worse) summation order: max|ours − f64| ≤ 1.5 · max|HF f32 − f64| per tensor,
//! and never more than 2e-3. We also keep the absolute 1e-4 figure where it holds for any f32 implementation: the
//! last prompt row's logits (the ones generation uses) must be within 1e-4 + 2·(HF's gap there) of f64. Greedy tokens
//! must be identical for all 32 steps.

use crate::common;

use backburner_engine::{argmax, Logits, Session, SessionOptions};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, ModelState};
use common::*;

fn f32_opts(ubatch: usize, page_size: usize) -> SessionOptions {
    SessionOptions {
        ubatch,
        kv: KvOptions {
            page_size,
            dtype: KvDtype::F32,
        },
        context_length: None,
        ..SessionOptions::default()
    }
}

/// max |a − b| over rows `rows` of `[n, vocab]` matrices.
fn rows_diff(a: &[f32], b: &[f32], vocab: usize, rows: std::ops::Range<usize>) -> f32 {
    max_abs_diff(
        &a[rows.start * vocab..rows.end * vocab],
        &b[rows.start * vocab..rows.end * vocab],
    )
}

fn check_prefill_and_greedy(name: &str) {
    check_model_against_reference(name, load_model(name));
}

/// `model` against the references of fixture `name` (also its GGUF conversion, fixtures/gguf).
fn check_model_against_reference(name: &str, model: std::sync::Arc<backburner_model::Model>) {
    let r = Reference::load(name);
    let vocab = model.config().vocab_size;
    let prompt = r.ids("prompt_ids");
    let t = prompt.len();
    assert!(t >= 300);
    let (hf, shape) = r.f32("prefill_logits");
    let (truth, _) = r.f32("prefill_logits_f64");
    let mut s = Session::new(model.clone(), f32_opts(512, 4096)).unwrap();
    let got = s.prefill(&prompt, Logits::All, |_, _| {}).unwrap();
    assert_eq!(got.len(), shape[0] * shape[1]);

    let hf_gap = max_abs_diff(&hf, &truth);
    let ours = max_abs_diff(&got, &truth);
    eprintln!(
        "{name}: prefill |ours-f64| {ours:.3e}, |hf32-f64| {hf_gap:.3e}, |ours-hf32| {:.3e}",
        max_abs_diff(&got, &hf)
    );
    assert!(
        ours <= (1.5 * hf_gap).min(2e-3),
        "{name}: prefill logits {ours} from f64 (HF f32: {hf_gap})"
    );
    let hf_last = rows_diff(&hf, &truth, vocab, t - 1..t);
    let ours_last = rows_diff(&got, &truth, vocab, t - 1..t);
    assert!(
        ours_last <= 1e-4 + 2.0 * hf_last,
        "{name}: last-row logits {ours_last} from f64 (HF f32: {hf_last})"
    );

    // 32 greedy steps: identical tokens, and every step's logits as close to the truth as HF's f32 step.
    let want_tokens = r.ids("greedy_tokens");
    let (hf_dec, _) = r.f32("decode_logits");
    let (truth_dec, _) = r.f32("decode_logits_f64");
    let mut logits = got[(t - 1) * vocab..].to_vec();
    let mut tokens = Vec::new();
    let mut worst = 0.0f32;
    for step in 0..want_tokens.len() {
        let row = step * vocab..(step + 1) * vocab;
        let hf_gap = max_abs_diff(&hf_dec[row.clone()], &truth_dec[row.clone()]);
        let ours = max_abs_diff(&logits, &truth_dec[row]);
        worst = worst.max(ours);
        assert!(
            ours <= (1e-4 + 1.5 * hf_gap).min(2e-3),
            "{name}: decode step {step} logits {ours} from f64 (HF f32: {hf_gap})"
        );
        let t = argmax(&logits);
        tokens.push(t);
        logits = s.decode(t).unwrap();
    }
    eprintln!("{name}: worst decode |ours-f64| {worst:.3e}");
    assert_eq!(tokens, want_tokens, "{name}: greedy tokens differ");
}

#[test]
fn f32_checkpoint_matches_transformers_logits_and_greedy_tokens() {
    check_prefill_and_greedy("tiny-f32");
}

#[test]
fn bf16_checkpoint_matches_transformers_logits_and_greedy_tokens() {
    check_prefill_and_greedy("tiny-bf16");
}

#[test]
fn sharded_f16_hub_checkpoint_matches_transformers_logits_and_greedy_tokens() {
    check_prefill_and_greedy("tiny-hub");
}

#[test]
fn gguf_conversions_match_transformers_logits_and_greedy_tokens() {
    // llama.cpp's converter's files (fixtures/gguf, byte-identical to its output): tiled v heads, folded norm gains,
    // A = −exp(A_log) as torch computed it; the same tolerances as the checkpoints they came from.
    for name in ["tiny-f32", "tiny-bf16"] {
        let path = fixture("gguf").join(format!("{name}.gguf"));
        check_model_against_reference(
            name,
            std::sync::Arc::new(backburner_model::Model::load(&path).unwrap()),
        );
    }
}

#[test]
fn every_layer_output_matches_transformers_hidden_states() {
    let r = Reference::load("tiny-f32");
    let model = load_model("tiny-f32");
    let cfg = model.config().clone();
    let prompt = r.ids("prompt_ids");
    let (hs, shape) = r.f32("hidden_states");
    let (t, h) = (shape[1], shape[2]);
    let mut state = ModelState::new(
        &cfg,
        0..cfg.num_hidden_layers,
        KvOptions {
            page_size: 4096,
            dtype: KvDtype::F32,
        },
    );
    let mut x = model.embed(&prompt).unwrap();
    assert_eq!(max_abs_diff(&x, &hs[..t * h]), 0.0, "embeddings");
    let (last, _) = r.f32("last_layer_output");
    for i in 0..cfg.num_hidden_layers {
        model.forward_layers(i..i + 1, &mut x, t, &mut state);
        let want: &[f32] = if i + 1 < cfg.num_hidden_layers {
            &hs[(i + 1) * t * h..(i + 2) * t * h]
        } else {
            &last
        };
        let d = max_abs_diff(&x, want);
        assert!(d < 2e-4, "layer {i} output differs by {d}");
    }
}

#[test]
fn state_after_prefill_matches_transformers_cache() {
    let r = Reference::load("tiny-f32");
    let model = load_model("tiny-f32");
    let cfg = model.config().clone();
    let prompt = r.ids("prompt_ids");
    let mut s = Session::new(model.clone(), f32_opts(512, 64)).unwrap();
    s.prefill(&prompt, Logits::Last, |_, _| {}).unwrap();
    let t = prompt.len();
    let kc = cfg.linear_conv_kernel_dim;
    for i in 0..cfg.num_hidden_layers {
        match s.state().layer(i).unwrap() {
            backburner_model::LayerState::Linear(ls) => {
                let (conv, cshape) = r.f32(&format!("conv_state.{i}"));
                // HF keeps [conv_dim, Kc]; we keep the last Kc-1 columns.
                let want: Vec<f32> = conv
                    .chunks(cshape[1])
                    .flat_map(|row| row[1..].to_vec())
                    .collect();
                assert_eq!(ls.conv.len(), cfg.conv_dim() * (kc - 1));
                assert!(max_abs_diff(&ls.conv, &want) < 1e-4, "conv state {i}");
                let (rec, _) = r.f32(&format!("recurrent_state.{i}"));
                let d = max_abs_diff(&ls.recurrent, &rec);
                assert!(d < 1e-4, "recurrent state {i} differs by {d}");
            }
            backburner_model::LayerState::Attention(_) => {
                let (k, v) = s.state().read_kv_rows(i, 0, t).unwrap();
                let (hk, _) = r.f32(&format!("key_cache.{i}"));
                let (hv, _) = r.f32(&format!("value_cache.{i}"));
                // HF [Hkv, T, D] -> ours [T, Hkv, D]
                let (nkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
                let to_ours = |x: &[f32]| {
                    let mut o = vec![0.0; x.len()];
                    for hh in 0..nkv {
                        for p in 0..t {
                            o[(p * nkv + hh) * d..(p * nkv + hh + 1) * d]
                                .copy_from_slice(&x[(hh * t + p) * d..(hh * t + p + 1) * d]);
                        }
                    }
                    o
                };
                assert!(max_abs_diff(&k, &to_ours(&hk)) < 1e-4, "keys {i}");
                assert!(max_abs_diff(&v, &to_ours(&hv)) < 1e-4, "values {i}");
            }
        }
    }
}
