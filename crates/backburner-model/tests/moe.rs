//! The mixture-of-experts block against Hugging Face transformers: `fixtures/tiny-moe-f32` (a random
//! `Qwen3_5MoeForCausalLM`, 4 layers, 8 experts, 2 per token, a shared expert; see scripts/make_moe_fixtures.py),
//! prefill logits of a 100-token prompt and 16 greedy decode steps. The fixture's seed was chosen so that no router
//! decision of the reference run is within 1e-3 (in logits) of a tie, so the same experts must be picked.

use std::path::PathBuf;

use backburner_model::{FfnKind, KvOptions, Model, ModelState};
use safetensors::SafeTensors;

const KV: KvOptions = KvOptions {
    page_size: 4096,
    dtype: backburner_kernels::kv::KvDtype::F32,
};

fn fixture() -> PathBuf {
    fixture_named("tiny-moe-f32")
}

fn fixture_named(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn tensor(st: &SafeTensors<'_>, name: &str) -> Vec<f32> {
    st.tensor(name)
        .unwrap()
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The bits of the logits of every row of `ids` from a fresh state of `m` (f32 KV).
pub fn logit_bits(m: &Model, ids: &[u32]) -> Vec<u32> {
    let c = m.config();
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let l = m.forward_tokens(ids, &mut s, Some(0..ids.len()));
    l.into_iter().map(f32::to_bits).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in x.iter().enumerate() {
        if v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn a_qwen3_5_moe_checkpoint_gives_the_reference_logits_and_greedy_tokens() {
    let m = check_reference(&fixture());
    let c = m.config();
    assert_eq!(c.ffn_types, vec![FfnKind::Moe; 4]);
    let moe = c.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.num_experts_per_tok), (8, 2));
    assert!(moe.norm_topk_prob);
}

#[test]
fn a_bf16_moe_checkpoint_gives_the_reference_logits_and_greedy_tokens() {
    // bf16 storage, read in its stored format (the reference upcasts the same weights to f32)
    let m = check_reference(&fixture_named("tiny-moe-bf16"));
    assert!(m.weight_bytes() < Model::load(&fixture()).unwrap().weight_bytes());
}

#[test]
fn a_hub_layout_moe_checkpoint_of_transformers_gives_its_reference() {
    // Qwen3_5MoeForConditionalGeneration's own file: model.language_model.*, a vision tower skipped, bf16
    let m = check_reference(&fixture_named("tiny-moe-hub"));
    assert_eq!(m.config().model_type, "qwen3_5_moe");
}

#[test]
fn a_qwen3_next_checkpoint_gives_the_reference_logits_and_greedy_tokens() {
    // fused `in_proj_qkvz` / `in_proj_ba` read per k head, a dense layer (mlp_only_layers [2]) among the MoE ones,
    // and the top k weights not renormalized (norm_topk_prob false)
    let m = check_reference(&fixture_named("tiny-next-f32"));
    let c = m.config();
    assert_eq!(c.model_type, "qwen3_next");
    assert_eq!(
        c.ffn_types,
        [FfnKind::Moe, FfnKind::Moe, FfnKind::Dense, FfnKind::Moe]
    );
    assert!(!c.moe.as_ref().unwrap().norm_topk_prob);
}

/// The model of fixture `dir` against its transformers reference (prefill logits, 16 greedy steps); the model.
fn check_reference(dir: &std::path::Path) -> Model {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids: Vec<u32> = serde_json::from_value(meta["prompt_ids"].clone()).unwrap();
    let greedy: Vec<u32> = serde_json::from_value(meta["greedy_ids"].clone()).unwrap();
    let bytes = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (prefill, decode) = (tensor(&st, "prefill_logits"), tensor(&st, "decode_logits"));

    let m = Model::load(dir).unwrap();
    let c = m.config();
    let v = c.vocab_size;
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let got = m.forward_tokens(&ids, &mut s, Some(0..ids.len()));
    let d = max_diff(&got, &prefill);
    eprintln!("prefill max |ours - hf32| = {d:.3e}");
    assert!(d < 1e-3, "prefill logits differ by {d}");
    let mut tok = argmax(&got[(ids.len() - 1) * v..]);
    for (i, want) in greedy.iter().enumerate() {
        assert_eq!(tok, *want, "greedy token {i}");
        let l = m.forward_tokens(&[tok], &mut s, Some(0..1));
        let d = max_diff(&l, &decode[i * v..(i + 1) * v]);
        assert!(d < 1e-3, "decode step {i}: logits differ by {d}");
        tok = argmax(&l);
    }
    m
}

#[test]
fn a_batched_decode_step_of_an_moe_model_equals_each_sequence_alone() {
    // three sequences at different positions: each one's routed experts differ, and the batch groups their rows by
    // expert; the logits must still be each sequence's own
    let dir = fixture();
    let m = Model::load(&dir).unwrap();
    let c = m.config();
    let prompts: [Vec<u32>; 3] = [vec![1, 2, 3], (10..80).collect(), vec![400; 9]];
    let next = [7u32, 300, 51];
    let mut alone = Vec::new();
    let mut states: Vec<ModelState> = Vec::new();
    for (p, &t) in prompts.iter().zip(&next) {
        let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
        m.forward_tokens(p, &mut s, None);
        let mut solo = ModelState::new(c, 0..c.num_hidden_layers, KV);
        m.forward_tokens(p, &mut solo, None);
        alone.push(m.forward_tokens(&[t], &mut solo, Some(0..1)));
        states.push(s);
    }
    let mut refs: Vec<&mut ModelState> = states.iter_mut().collect();
    let batch = m.forward_decode_batch(&next, &mut refs);
    let v = c.vocab_size;
    for (i, a) in alone.iter().enumerate() {
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&batch[i * v..(i + 1) * v]), bits(a), "sequence {i}");
    }
}

#[test]
fn the_hub_layout_of_an_moe_checkpoint_loads_the_same_weights() {
    // `Qwen3_5MoeForConditionalGeneration`'s layout: the text model under `model.language_model.`, its settings under
    // `text_config`, the head at the top; the same tensors must give the same bits
    let src = fixture();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let renamed: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| match name.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), t),
            None => (name, t),
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(renamed, None, &dir.path().join("model.safetensors")).unwrap();
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let hub = serde_json::json!({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": false});
    std::fs::write(dir.path().join("config.json"), hub.to_string()).unwrap();
    let (a, b) = (Model::load(&src).unwrap(), Model::load(dir.path()).unwrap());
    assert_eq!(b.config().layout, backburner_model::WeightLayout::Hub);
    let ids: Vec<u32> = (0..70).map(|i| (i * 37) % 512).collect();
    assert_eq!(logit_bits(&a, &ids), logit_bits(&b, &ids));
}

#[test]
fn fused_expert_tensors_load_as_the_per_expert_ones() {
    // transformers 5's in-memory layout, which some checkpoints store: `mlp.experts.gate_up_proj` [E, 2I, H] (each
    // expert's gate rows, then its up rows) and `mlp.experts.down_proj` [E, H, I]
    let src = fixture();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (n_exp, layers) = (8, 4);
    let mut fused: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for l in 0..layers {
        let p = format!("model.layers.{l}.mlp.experts.");
        let data = |e: usize, m: &str| st.tensor(&format!("{p}{e}.{m}.weight")).unwrap();
        let (mut gu, mut down) = (Vec::new(), Vec::new());
        for e in 0..n_exp {
            gu.extend_from_slice(data(e, "gate_proj").data());
            gu.extend_from_slice(data(e, "up_proj").data());
            down.extend_from_slice(data(e, "down_proj").data());
        }
        let (i, h) = (
            data(0, "gate_proj").shape()[0],
            data(0, "gate_proj").shape()[1],
        );
        fused.push((format!("{p}gate_up_proj"), vec![n_exp, 2 * i, h], gu));
        fused.push((format!("{p}down_proj"), vec![n_exp, h, i], down));
    }
    let mut all: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .filter(|(n, _)| !n.contains(".mlp.experts."))
        .collect();
    for (n, shape, b) in &fused {
        let t = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
            .unwrap();
        all.push((n.clone(), t));
    }
    let dir = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(all, None, &dir.path().join("model.safetensors")).unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let (a, b) = (Model::load(&src).unwrap(), Model::load(dir.path()).unwrap());
    assert_eq!(a.weight_bytes(), b.weight_bytes());
    let ids: Vec<u32> = (0..70).map(|i| (i * 41) % 512).collect();
    assert_eq!(logit_bits(&a, &ids), logit_bits(&b, &ids));
    // the fingerprints of the two layouts agree (the views hash the same bytes under the same names)
    let (ca, cb) = (
        backburner_model::Checkpoint::open(&src).unwrap(),
        backburner_model::Checkpoint::open(dir.path()).unwrap(),
    );
    let fp = |ck: &backburner_model::Checkpoint, m: &Model| {
        backburner_model::fingerprint(ck, m.config(), 0..layers).unwrap()
    };
    assert_eq!(fp(&ca, &a), fp(&cb, &b));
}

#[test]
fn moe_configs_take_their_class_defaults_and_name_the_culprit() {
    // Qwen3-Next: the 80B-A3B's defaults; every layer MoE unless mlp_only_layers or decoder_sparse_step say
    let c = backburner_model::ModelConfig::from_json_str(r#"{"model_type":"qwen3_next"}"#).unwrap();
    let m = c.moe.as_ref().unwrap();
    assert_eq!(
        (
            c.vocab_size,
            c.num_hidden_layers,
            m.num_experts,
            m.num_experts_per_tok
        ),
        (151936, 48, 512, 10)
    );
    let c = backburner_model::ModelConfig::from_json_str(
        r#"{"model_type":"qwen3_next","num_hidden_layers":4,"decoder_sparse_step":2,"mlp_only_layers":[3],"norm_topk_prob":false}"#,
    )
    .unwrap();
    use backburner_model::FfnKind::{Dense, Moe};
    assert_eq!(c.ffn_types, [Dense, Moe, Dense, Dense]);
    assert!(!c.moe.unwrap().norm_topk_prob);
    let e = backburner_model::ModelConfig::from_json_str(
        r#"{"model_type":"qwen3_next","num_hidden_layers":4,"mlp_only_layers":[4]}"#,
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("mlp_only_layers names layer 4"),
        "{e}"
    );
    // a hub config without text_config, a text_config of another family, and MoE sizes that cannot work
    let e = backburner_model::ModelConfig::from_json_str(r#"{"model_type":"qwen3_5_moe"}"#)
        .unwrap_err();
    assert!(e.to_string().contains("text_config"), "{e}");
    let hub = r#"{"model_type":"qwen3_5_moe","text_config":{"model_type":"qwen3_5_text"}}"#;
    let e = backburner_model::ModelConfig::from_json_str(hub).unwrap_err();
    assert!(e.to_string().contains("qwen3_5_text"), "{e}");
    for (field, value, says) in [
        ("num_experts_per_tok", "300", "exceeds num_experts"),
        ("num_experts", "0", "num_experts = 0"),
        ("moe_intermediate_size", "0", "moe_intermediate_size = 0"),
    ] {
        let text = format!(r#"{{"model_type":"qwen3_5_moe_text","{field}":{value}}}"#);
        let e = backburner_model::ModelConfig::from_json_str(&text).unwrap_err();
        assert!(e.to_string().contains(says), "{field}: {e}");
    }
    // the defaults are the 35B-A3B's
    let c = backburner_model::ModelConfig::from_json_str(r#"{"model_type":"qwen3_5_moe_text"}"#)
        .unwrap();
    let m = c.moe.unwrap();
    assert_eq!(
        (
            c.num_hidden_layers,
            c.hidden_size,
            m.num_experts,
            m.num_experts_per_tok
        ),
        (40, 2048, 256, 8)
    );
    assert_eq!(
        (m.moe_intermediate_size, m.shared_expert_intermediate_size),
        (512, 512)
    );
    assert!(m.norm_topk_prob);
}
