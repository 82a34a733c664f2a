//! The MTP block against the reference of scripts/make_mtp_fixture.py (docs/MTP.md): `fixtures/tiny-mtp` (dense
//! Qwen3.5, hub layout, bf16, two shards; `model.gguf` beside it with the block's matrices in Q8_0) and
//! `fixtures/tiny-mtp-moe` (Qwen3.5-MoE, causal-LM layout, the block's experts fused). The block's logits for every
//! prompt pair, the greedy drafts after the prompt, the trunk's verify of them and the drafts after the accepted
//! pairs, plus the loading rules (optional block, bytes, unused tensors) and the state's behaviour.

use std::path::PathBuf;

use backburner_kernels::kv::KvDtype;
use backburner_model::checkpoint::{unused_tensors, UnusedTensors};
use backburner_model::{
    load_bytes, Checkpoint, GgufFile, KvOptions, LoadOptions, Model, ModelConfig, ModelState,
    MtpState,
};
use safetensors::SafeTensors;
use serde_json::Value;

const KV: KvOptions = KvOptions {
    page_size: 4096,
    dtype: KvDtype::F32,
};

/// The tolerance of the f32 fixtures (as tests/moe.rs): the engine's f32 arithmetic against torch's.
const TOL: f32 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

struct Reference {
    json: Value,
    bytes: Vec<u8>,
}

impl Reference {
    fn open(name: &str) -> Self {
        let d = fixture(name);
        let json =
            serde_json::from_slice(&std::fs::read(d.join("reference.json")).unwrap()).unwrap();
        let bytes = std::fs::read(d.join("reference.safetensors")).unwrap();
        Reference { json, bytes }
    }

    fn tensor(&self, name: &str) -> Vec<f32> {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap();
        t.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// The ids under `key` of `part` (the json root, or its `gguf` object).
    fn ids(part: &Value, key: &str) -> Vec<u32> {
        part[key]
            .as_array()
            .unwrap_or_else(|| panic!("{key}"))
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    }

    fn prompt(&self) -> Vec<u32> {
        Self::ids(&self.json, "prompt_ids")
    }
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

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn new_states(m: &Model) -> (ModelState, MtpState) {
    let c = m.config();
    (
        ModelState::new(c, 0..c.num_hidden_layers, KV),
        MtpState::new(c, KV),
    )
}

/// The pairs' tokens after a prompt: the prompt's tokens after the first, then the sampled `x_n`.
fn next_tokens(prompt: &[u32], x_n: u32) -> Vec<u32> {
    prompt[1..].iter().copied().chain([x_n]).collect()
}

/// The block's logits for every prompt pair, from the reference's own hidden rows (no trunk rounding in between).
fn check_mtp_logits(model: &str, name: &str, prefix: &str, tol: f32) -> f32 {
    let r = Reference::open(name);
    let m = Model::load(&fixture(model)).unwrap();
    assert!(m.mtp().is_some(), "{model}: the MTP block is loaded");
    let part = if prefix.is_empty() {
        &r.json
    } else {
        &r.json["gguf"]
    };
    let next = next_tokens(&r.prompt(), part["x_n"].as_u64().unwrap() as u32);
    let hidden = r.tensor(&format!("{prefix}hidden"));
    let (_, mut st) = new_states(&m);
    let n = next.len();
    let (g, logits) = m.mtp_forward(&mut st, &hidden, &next, Some(0..n)).unwrap();
    assert_eq!(g.len(), n * m.config().hidden_size);
    assert_eq!(st.n_positions(), n);
    let d = max_diff(&logits, &r.tensor(&format!("{prefix}mtp_logits")));
    assert!(d < tol, "{model}: MTP logits differ by {d}");
    // the hidden input matters: zeros instead give other logits
    let (_, mut st) = new_states(&m);
    let (_, zeros) = m
        .mtp_forward(&mut st, &vec![0.0; hidden.len()], &next, Some(0..n))
        .unwrap();
    assert!(max_diff(&zeros, &logits) > 0.1);
    d
}

#[test]
fn mtp_logits_of_every_prompt_pair_match_the_reference() {
    check_mtp_logits("tiny-mtp", "tiny-mtp", "", TOL);
    check_mtp_logits("tiny-mtp-moe", "tiny-mtp-moe", "", TOL);
}

#[test]
fn the_trunk_s_hidden_rows_match_the_reference_and_its_logits_are_forward_tokens_bits() {
    for name in ["tiny-mtp", "tiny-mtp-moe"] {
        let r = Reference::open(name);
        let m = Model::load(&fixture(name)).unwrap();
        let p = r.prompt();
        let (mut s, _) = new_states(&m);
        let (logits, hidden) = m.forward_tokens_hidden(&p, &mut s, Some(0..p.len()));
        let d = max_diff(&hidden, &r.tensor("hidden"));
        assert!(d < TOL, "{name}: hidden rows differ by {d}");
        let (mut s2, _) = new_states(&m);
        let plain = m.forward_tokens(&p, &mut s2, Some(0..p.len()));
        assert_eq!(bits(&logits), bits(&plain), "{name}");
        assert_eq!(s.n_tokens(), p.len());
        let again = m
            .final_hidden(&vec![1.0; 2 * m.config().hidden_size], 2)
            .unwrap();
        assert_eq!(again.len(), 2 * m.config().hidden_size);
        assert!(m.final_hidden(&[1.0; 3], 2).is_err());
    }
}

/// A speculative round as a coordinator runs it: prefill with hidden rows, ingest, draft, verify with the trunk,
/// ingest the accepted pairs, draft again; every token against the reference.
fn check_speculative_round(model: &str, name: &str, gguf: bool) {
    let r = Reference::open(name);
    let part = if gguf { &r.json["gguf"] } else { &r.json };
    let ids = |k: &str| Reference::ids(part, k);
    let m = Model::load(&fixture(model)).unwrap();
    let h = m.config().hidden_size;
    let p = r.prompt();
    let (mut s, mut st) = new_states(&m);
    let (logits, hidden) = m.forward_tokens_hidden(&p, &mut s, Some(p.len() - 1..p.len()));
    let x_n = argmax(&logits);
    assert_eq!(x_n as u64, part["x_n"].as_u64().unwrap());
    m.mtp_ingest(&mut st, &hidden, &next_tokens(&p, x_n))
        .unwrap();
    assert_eq!(st.n_positions(), p.len());
    let drafts = m.mtp_draft(&mut st, 4).unwrap();
    assert_eq!(drafts, ids("drafts"), "{model}: drafts after the prompt");
    // drafting leaves the state as it was
    assert_eq!(st.n_positions(), p.len());
    assert_eq!(m.mtp_draft(&mut st, 4).unwrap(), drafts);
    assert_eq!(m.mtp_draft(&mut st, 2).unwrap(), drafts[..2]);
    let mut seen = 0;
    let stopped = m
        .mtp_draft_with(&mut st, 4, |l| {
            seen += 1;
            (seen < 3).then(|| argmax(l))
        })
        .unwrap();
    assert_eq!(stopped, drafts[..2]);
    // verify [x_n, d_1..d_k] with the trunk
    let verify: Vec<u32> = std::iter::once(x_n).chain(drafts.iter().copied()).collect();
    assert_eq!(verify, ids("verify_tokens"));
    let (vl, vh) = m.forward_tokens_hidden(&verify, &mut s, Some(0..verify.len()));
    let picks: Vec<u32> = vl.chunks_exact(m.config().vocab_size).map(argmax).collect();
    assert_eq!(picks, ids("verify_picks"), "{model}: the trunk's picks");
    let a = drafts
        .iter()
        .zip(&picks)
        .take_while(|(d, p)| d == p)
        .count();
    assert_eq!(a as u64, part["accepted"].as_u64().unwrap());
    let bonus = picks[a];
    let accepted: Vec<u32> = drafts[..a].iter().copied().chain([bonus]).collect();
    m.mtp_ingest(&mut st, &vh[..(a + 1) * h], &accepted)
        .unwrap();
    assert_eq!(st.n_positions(), p.len() + a + 1);
    assert_eq!(
        m.mtp_draft(&mut st, 4).unwrap(),
        ids("drafts_after_verify"),
        "{model}: drafts after the verify"
    );
}

#[test]
fn a_speculative_round_drafts_the_reference_tokens() {
    check_speculative_round("tiny-mtp", "tiny-mtp", false);
    check_speculative_round("tiny-mtp-moe", "tiny-mtp-moe", false);
}

#[test]
fn the_gguf_file_s_q8_0_block_drafts_the_reference_tokens() {
    // The block's matrices are Q8_0 and the products round the activations to 8 bits (as llama.cpp's do): the logits
    // are near the exact ones of the dequantized weights, and every pick the reference makes with a margin above
    // 0.5 (the fixture's seed was chosen so) is the same.
    let d = check_mtp_logits("tiny-mtp/model.gguf", "tiny-mtp", "gguf_", 0.25);
    eprintln!("Q8_0 block: max logit difference {d}");
    check_speculative_round("tiny-mtp/model.gguf", "tiny-mtp", true);
}

#[test]
fn ingesting_in_pieces_gives_the_bits_of_one_call() {
    let r = Reference::open("tiny-mtp");
    let m = Model::load(&fixture("tiny-mtp")).unwrap();
    let h = m.config().hidden_size;
    let next = next_tokens(&r.prompt(), r.json["x_n"].as_u64().unwrap() as u32);
    let hidden = r.tensor("hidden");
    let (_, mut whole) = new_states(&m);
    let (g, l) = m
        .mtp_forward(&mut whole, &hidden, &next, Some(0..next.len()))
        .unwrap();
    let (_, mut parts) = new_states(&m);
    let mut g2 = Vec::new();
    let mut l2 = Vec::new();
    for (a, b) in [(0, 1), (1, 10), (10, 23), (23, 24)] {
        let (g, l) = m
            .mtp_forward(
                &mut parts,
                &hidden[a * h..b * h],
                &next[a..b],
                Some(0..b - a),
            )
            .unwrap();
        g2.extend(g);
        l2.extend(l);
    }
    assert_eq!(bits(&g), bits(&g2));
    assert_eq!(bits(&l), bits(&l2));
    // truncation drops pairs and the frontier; ingesting them again restores the drafts
    let (_, mut st) = new_states(&m);
    m.mtp_ingest(&mut st, &hidden, &next).unwrap();
    let drafts = m.mtp_draft(&mut st, 4).unwrap();
    st.truncate(20);
    assert_eq!(st.n_positions(), 20);
    assert!(!st.has_frontier());
    assert!(m.mtp_draft(&mut st, 1).is_err());
    m.mtp_ingest(&mut st, &hidden[20 * h..], &next[20..])
        .unwrap();
    assert_eq!(m.mtp_draft(&mut st, 4).unwrap(), drafts);
    assert!(st.bytes() > 0);
}

#[test]
fn bad_input_is_a_typed_error() {
    let m = Model::load(&fixture("tiny-mtp")).unwrap();
    let (_, mut st) = new_states(&m);
    let h = m.config().hidden_size;
    assert!(m.mtp_draft(&mut st, 2).is_err(), "nothing ingested");
    assert!(m.mtp_forward(&mut st, &[0.0; 3], &[1], None).is_err());
    assert!(m.mtp_forward(&mut st, &[], &[], None).is_err());
    assert!(m.mtp_forward(&mut st, &vec![0.0; h], &[512], None).is_err());
    assert!(m
        .mtp_forward(&mut st, &vec![0.0; h], &[1], Some(0..2))
        .is_err());
    assert_eq!(st.n_positions(), 0, "a refused call appends nothing");
    m.mtp_ingest(&mut st, &vec![0.5; h], &[3]).unwrap();
    assert!(m.mtp_draft_with(&mut st, 2, |_| Some(9999)).is_err());
    assert_eq!(st.n_positions(), 1);
    // a model without the block
    let plain = Model::load(&fixture("tiny-f32")).unwrap();
    assert!(plain.mtp().is_none());
    let mut st = MtpState::new(plain.config(), KV);
    assert!(plain.mtp_ingest(&mut st, &vec![0.0; h], &[1]).is_err());
}

#[test]
fn the_block_is_optional_and_counted_in_the_weight_bytes() {
    for name in ["tiny-mtp", "tiny-mtp-moe", "tiny-mtp/model.gguf"] {
        let dir = fixture(name);
        let c = ModelConfig::from_dir(&dir).unwrap();
        assert_eq!(c.mtp_num_hidden_layers, 1, "{name}");
        let ck = Checkpoint::open(&dir).unwrap();
        let opts = LoadOptions {
            layers: 0..c.num_hidden_layers,
            ends: true,
        };
        let with = Model::from_checkpoint(c.clone(), &ck, &opts, |_, _| {}).unwrap();
        let mtp = with.mtp().expect("loaded").bytes();
        assert_eq!(
            load_bytes(&ck, &c, &opts).unwrap(),
            with.weight_bytes() as u64
        );
        // every tensor of the file is read, the block's included
        assert_eq!(unused_tensors(&ck, &c), UnusedTensors::default(), "{name}");
        // left out on request
        let off = ModelConfig {
            mtp_num_hidden_layers: 0,
            ..c.clone()
        };
        let without = Model::from_checkpoint(off.clone(), &ck, &opts, |_, _| {}).unwrap();
        assert!(without.mtp().is_none());
        assert_eq!(without.weight_bytes() + mtp, with.weight_bytes());
        assert_eq!(
            load_bytes(&ck, &off, &opts).unwrap(),
            without.weight_bytes() as u64
        );
        // a worker's range without the ends holds no block
        let tail = LoadOptions {
            layers: 1..c.num_hidden_layers,
            ends: false,
        };
        let w = Model::from_checkpoint(c.clone(), &ck, &tail, |_, _| {}).unwrap();
        assert!(w.mtp().is_none());
        assert_eq!(load_bytes(&ck, &c, &tail).unwrap(), w.weight_bytes() as u64);
        // the trunk is the same with and without the block
        let p = [5, 6, 7];
        let (mut s1, _) = new_states(&with);
        let (mut s2, _) = new_states(&without);
        assert_eq!(
            bits(&with.forward_tokens(&p, &mut s1, Some(0..3))),
            bits(&without.forward_tokens(&p, &mut s2, Some(0..3)))
        );
    }
}

#[test]
fn gguf_mtp_names_reach_the_nextn_tensors_and_the_block_s_expert_views() {
    use backburner_model::gguf::writer::GgufWriter;
    use backburner_model::gguf::{GgmlType, MetaValue};
    // 2 trunk blocks and one MTP block (block 2) of a qwen35moe file: 4 experts of [32, 64] in one 3-D tensor, and a
    // merged gate|up one in the other layout
    let tmp = tempfile::tempdir().unwrap();
    for merged in [false, true] {
        let path = tmp.path().join(format!("m{merged}.gguf"));
        let mut w = GgufWriter::default();
        w.kv("general.architecture", MetaValue::Str("qwen35moe".into()))
            .kv("qwen35moe.block_count", MetaValue::U32(3))
            .kv("qwen35moe.nextn_predict_layers", MetaValue::U32(1));
        let (exps, rows) = if merged {
            ("blk.2.ffn_gate_up_exps.weight", 64usize)
        } else {
            ("blk.2.ffn_gate_exps.weight", 32)
        };
        w.tensor_filled(exps, &[64, rows as u64, 4], GgmlType::F32, 1)
            .tensor_filled("blk.2.nextn.eh_proj.weight", &[128, 64], GgmlType::F32, 2)
            .tensor_filled("blk.2.nextn.hnorm.weight", &[64], GgmlType::F32, 3)
            .tensor_filled("blk.2.attn_q.weight", &[64, 256], GgmlType::F32, 4);
        w.write(&path).unwrap();
        let ck = Checkpoint::open(&path).unwrap();
        let stored = |n: &str| ck.stored_name(n);
        assert_eq!(stored("mtp.fc.weight"), "blk.2.nextn.eh_proj.weight");
        assert_eq!(ck.shape("mtp.fc.weight").unwrap(), [64, 128]);
        assert_eq!(
            stored("model.mtp.pre_fc_norm_hidden.weight"),
            "blk.2.nextn.hnorm.weight"
        );
        assert_eq!(
            stored("mtp.layers.0.self_attn.q_proj.weight"),
            "blk.2.attn_q.weight"
        );
        assert_eq!(
            ck.shape("mtp.layers.0.self_attn.q_proj.weight").unwrap(),
            [256, 64]
        );
        assert!(!ck.contains("mtp.norm.weight"));
        // expert 3's gate rows: the 4th [32, 64] block of the separate tensor, or the first half of the 4th [64, 64]
        // block of the merged one
        let name = "mtp.layers.0.mlp.experts.3.gate_proj.weight";
        assert!(stored(name).starts_with(exps), "{}", stored(name));
        assert_eq!(ck.shape(name).unwrap(), [32, 64]);
        let whole = ck.raw(exps).map(|(_, b)| b.to_vec());
        let expert = ck.raw(name).unwrap().1.to_vec();
        let at = 3 * rows * 64 * 4;
        let f = GgufFile::open(&path).unwrap();
        let all = f.data_of(f.tensor(exps).unwrap()).unwrap();
        assert_eq!(expert, all[at..at + 32 * 64 * 4]);
        assert!(
            whole.is_err(),
            "the 3-D tensor itself has no Hugging Face name"
        );
    }
}
