//! The bundled default model: the real Qwen3.5 tokenizer (embedded in the binary, gzip) and random weights of a small
//! Qwen3.5-architecture decoder, generated deterministically on first use into the cache directory.
//!
//! The weights are random, so the text it writes is random tokens of the real vocabulary; it exists so the whole
//! pipeline (tokenizer, chat template, prefill, decode, streaming) runs on real text on any machine without a download.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Bumped whenever the generated files change, so an old cache is not reused.
const VERSION: &str = "v1";
const TOKENIZER_GZ: &[u8] = include_bytes!("../../../assets/qwen3.5/tokenizer.json.gz");
const TOKENIZER_CONFIG: &str = include_str!("../../../assets/qwen3.5/tokenizer_config.json");
const GENERATION_CONFIG: &str = include_str!("../../../assets/qwen3.5/generation_config.json");

/// config.json of the default model (Qwen3.5 text architecture, small).
pub fn config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 248320,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true,
        "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        "eos_token_id": 248046,
        "dtype": "bfloat16"
    })
}

/// Where the default model lives: `<cache>/default-model-<version>` (see [`cache_dir`]).
pub fn dir() -> PathBuf {
    cache_dir().join(format!("default-model-{VERSION}"))
}

/// `$BACKBURNER_CACHE`, else `$XDG_CACHE_HOME/backburner`, else `~/.cache/backburner`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("BACKBURNER_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|p| PathBuf::from(p).join("backburner")))
        .or_else(|| std::env::var_os("HOME").map(|p| PathBuf::from(p).join(".cache/backburner")))
        .unwrap_or_else(|| std::env::temp_dir().join("backburner"))
}

/// Returns the default model's directory, generating it first if needed (about 130 MB of bf16 weights; seconds).
pub fn ensure() -> Result<PathBuf> {
    ensure_at(&dir(), &config_json())
}

/// Generates a model of config `cfg` (random weights, the Qwen3.5 tokenizer) in `d` unless it is already complete.
pub fn ensure_at(d: &Path, cfg: &serde_json::Value) -> Result<PathBuf> {
    let d = d.to_path_buf();
    if d.join("complete").exists() {
        return Ok(d);
    }
    eprintln!("generating model weights in {} (once)", d.display());
    let tmp = d.with_extension(format!("tmp{}", std::process::id()));
    std::fs::create_dir_all(&tmp).with_context(|| format!("create {}", tmp.display()))?;
    write_model(&tmp, cfg)?;
    std::fs::write(tmp.join("complete"), VERSION)?;
    if d.exists() {
        std::fs::remove_dir_all(&d).ok();
    }
    match std::fs::rename(&tmp, &d) {
        Ok(()) => {}
        // Another process finished first: use its copy.
        Err(_) if d.join("complete").exists() => {
            std::fs::remove_dir_all(&tmp).ok();
        }
        Err(e) => return Err(e).with_context(|| format!("move model into {}", d.display())),
    }
    Ok(d)
}

/// Seed of the weight generator ("backburn").
const SEED: u64 = 0x6261_636b_6275_726e;

fn write_model(dir: &Path, cfg: &serde_json::Value) -> Result<()> {
    // The Qwen3.5 tokenizer needs 248,077 ids; smaller (benchmark) vocabularies run from token ids.
    if cfg["vocab_size"].as_u64().unwrap_or(0) >= 248_077 {
        std::fs::write(dir.join("tokenizer_config.json"), TOKENIZER_CONFIG)?;
        std::fs::write(dir.join("generation_config.json"), GENERATION_CONFIG)?;
        let mut tok = Vec::new();
        flate2::read::GzDecoder::new(TOKENIZER_GZ)
            .read_to_end(&mut tok)
            .context("decompress the bundled tokenizer")?;
        std::fs::write(dir.join("tokenizer.json"), tok)?;
    }

    backburner_model::synthetic::write_random_checkpoint(dir, cfg, SEED)?;
    Ok(())
}
