//! Files of the random GGUF generator (`backburner_model::gguf::random`) load as models of every architecture and
//! run: a forward pass gives finite logits that differ from token to token, every tensor is read, and the byte-level
//! tokenizer encodes text one token per byte.

use std::path::Path;

use backburner_model::gguf::random::{Generator, TypeRule, Vocab};
use backburner_model::{
    synthetic, Checkpoint, GgufFile, KvOptions, Model, ModelConfig, ModelState,
};

const KV: KvOptions = KvOptions {
    page_size: 4096,
    dtype: backburner_kernels::kv::KvDtype::F32,
};

/// Writes the random file of `cfg` typed by `default` and `overrides` to `path`.
fn generate(cfg: &serde_json::Value, default: &str, overrides: &[&str], path: &Path) -> Generator {
    let c = ModelConfig::from_json_str(&cfg.to_string()).unwrap();
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    let rule = TypeRule::parse(default, &o).unwrap();
    let g = Generator::new(&c, &rule, &Vocab::ByteLevel, 42).unwrap();
    g.write_file(path, 1 << 20, &mut |_| {}).unwrap();
    g
}

/// Loads `path`, checks its config and that every tensor is read, and runs 24 tokens: every logit finite, the rows
/// not all alike.
fn check_runs(g: &Generator, path: &Path) {
    let m = Model::load(path).unwrap();
    assert_eq!(m.config(), g.config());
    let ck = Checkpoint::open(path).unwrap();
    let unused = backburner_model::checkpoint::unused_tensors(&ck, m.config());
    assert!(unused.unknown.is_empty(), "{:?}", unused.unknown);
    let c = m.config();
    let ids: Vec<u32> = (0..24).map(|i| (i * 37 + 5) % 300).collect();
    let mut s = ModelState::new(c, 0..c.num_hidden_layers, KV);
    let logits = m.forward_tokens(&ids, &mut s, Some(0..ids.len()));
    assert_eq!(logits.len(), ids.len() * c.vocab_size);
    assert!(logits.iter().all(|x| x.is_finite()), "{}", path.display());
    let rows: Vec<&[f32]> = logits.chunks(c.vocab_size).collect();
    assert!(rows.windows(2).all(|r| r[0] != r[1]), "{}", path.display());
    let spread =
        rows[0].iter().fold(0f32, |a, &x| a.max(x)) - rows[0].iter().fold(0f32, |a, &x| a.min(x));
    assert!(spread > 1e-3, "{}: logits spread {spread}", path.display());
}

#[test]
fn generated_qwen35_files_with_supported_types_run_to_finite_logits() {
    let dir = tempfile::tempdir().unwrap();
    // the tiny shape (rows of 64: 32-element blocks) and a 256-wide one (the k-quants and IQ4_XS)
    let tiny = dir.path().join("tiny.gguf");
    let g = generate(
        &synthetic::tiny_config(4),
        "Q8_0",
        &[
            "ffn_down=Q4_0",
            "attn_qkv=F16",
            "ssm_beta=BF16",
            "ssm_alpha=F32",
        ],
        &tiny,
    );
    check_runs(&g, &tiny);
    let mut wide_cfg = synthetic::tiny_config(4);
    for (k, v) in [
        ("hidden_size", 256),
        ("intermediate_size", 512),
        ("head_dim", 64),
        ("linear_key_head_dim", 64),
        ("linear_value_head_dim", 64),
    ] {
        wide_cfg[k] = v.into();
    }
    let wide = dir.path().join("wide.gguf");
    let g = generate(
        &wide_cfg,
        "Q4_K",
        &[
            "ffn_down=Q5_K",
            "^output.weight$=Q6_K",
            "attn_gate=IQ4_XS",
            "token_embd=Q8_0",
            "ssm_out=Q4_0",
        ],
        &wide,
    );
    assert_eq!(g.fallbacks().count(), 0);
    check_runs(&g, &wide);
    // the byte-level tokenizer: one token per byte, eos <|im_end|>
    let f = GgufFile::open(&wide).unwrap();
    let tok = backburner_model::TextTokenizer::from_gguf(&f, 512).unwrap();
    let ids = tok.encode("héllo").unwrap();
    assert_eq!(ids.len(), "héllo".len());
    assert_eq!(tok.decode(&ids).unwrap(), "héllo");
    assert_eq!(tok.eos_ids()[0], 258);
}

#[test]
fn generated_moe_and_next_files_run_to_finite_logits() {
    let dir = tempfile::tempdir().unwrap();
    for (cfg, name) in [
        (synthetic::tiny_moe_config(4), "moe.gguf"),
        (synthetic::tiny_next_config(4), "next.gguf"),
    ] {
        let path = dir.path().join(name);
        let g = generate(&cfg, "Q8_0", &["_exps=Q4_0"], &path);
        check_runs(&g, &path);
    }
}
