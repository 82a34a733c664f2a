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
/// The bundled Qwen3.5 `tokenizer_config.json` (its chat template).
pub const TOKENIZER_CONFIG: &str = include_str!("../../../assets/qwen3.5/tokenizer_config.json");
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
///
/// The files are written to `<d>.tmp<PID>` and renamed into place when complete; the temporary directory is removed
/// when writing fails, and ones left by generations that died (interrupted, killed) are removed on the next call.
pub fn ensure_at(d: &Path, cfg: &serde_json::Value) -> Result<PathBuf> {
    let d = d.to_path_buf();
    remove_stale_tmp(&d);
    if d.join("complete").exists() {
        return Ok(d);
    }
    eprintln!("generating model weights in {} (once)", d.display());
    let tmp = tmp_dir(&d, std::process::id());
    let written = std::fs::create_dir_all(&tmp)
        .with_context(|| format!("create {}", tmp.display()))
        .and_then(|()| write_model(&tmp, cfg))
        .and_then(|()| Ok(std::fs::write(tmp.join("complete"), VERSION)?));
    if let Err(e) = written {
        std::fs::remove_dir_all(&tmp).ok();
        return Err(e);
    }
    if d.exists() {
        std::fs::remove_dir_all(&d).ok();
    }
    match std::fs::rename(&tmp, &d) {
        Ok(()) => {}
        // Another process finished first: use its copy.
        Err(_) if d.join("complete").exists() => {
            std::fs::remove_dir_all(&tmp).ok();
        }
        Err(e) => {
            std::fs::remove_dir_all(&tmp).ok();
            return Err(e).with_context(|| format!("move model into {}", d.display()));
        }
    }
    Ok(d)
}

/// `<d>.tmp<pid>`: where process `pid` generates `d`.
fn tmp_dir(d: &Path, pid: u32) -> PathBuf {
    let name = d
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    d.with_file_name(format!("{name}.tmp{pid}"))
}

/// Removes the `<d>.tmp<PID>` directories of generations that died: those whose process no longer runs (checked in
/// `/proc`, where there is one) and any older than a day (a generation takes seconds).
fn remove_stale_tmp(d: &Path) {
    let (Some(parent), Some(name)) = (d.parent(), d.file_name()) else {
        return;
    };
    let prefix = format!("{}.tmp", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let procfs = Path::new("/proc/self").exists();
    for e in entries.flatten() {
        let file_name = e.file_name();
        let Some(pid) = file_name
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        let dead = procfs && !Path::new("/proc").join(pid.to_string()).exists();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(24 * 3600));
        if dead || old {
            std::fs::remove_dir_all(e.path()).ok();
        }
    }
}

/// The bundled Qwen3.5 `tokenizer.json` (decompressed).
pub fn tokenizer_json() -> Result<Vec<u8>> {
    let mut tok = Vec::new();
    flate2::read::GzDecoder::new(TOKENIZER_GZ)
        .read_to_end(&mut tok)
        .context("decompress the bundled tokenizer")?;
    Ok(tok)
}

/// Seed of the weight generator ("backburn").
const SEED: u64 = 0x6261_636b_6275_726e;

fn write_model(dir: &Path, cfg: &serde_json::Value) -> Result<()> {
    // The Qwen3.5 tokenizer needs 248,077 ids; smaller (benchmark) vocabularies run from token ids.
    if cfg["vocab_size"].as_u64().unwrap_or(0) >= 248_077 {
        std::fs::write(dir.join("tokenizer_config.json"), TOKENIZER_CONFIG)?;
        std::fs::write(dir.join("generation_config.json"), GENERATION_CONFIG)?;
        std::fs::write(dir.join("tokenizer.json"), tokenizer_json()?)?;
    }

    backburner_model::synthetic::write_random_checkpoint(dir, cfg, SEED)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_os = "linux")]
    #[test]
    fn tmp_dirs_of_dead_generations_are_removed_and_live_ones_kept() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("default-model-v1");
        // no process has id u32::MAX (Linux pids stay below 2^22); this test process is alive
        let dead = tmp_dir(&d, u32::MAX);
        let live = tmp_dir(&d, std::process::id());
        let other_model = root.path().join("bench-model-v1.tmp4294967295");
        let not_a_pid = root.path().join("default-model-v1.tmpx");
        for t in [&dead, &live, &other_model, &not_a_pid] {
            std::fs::create_dir_all(t.join("sub")).unwrap();
            std::fs::write(t.join("sub/f"), "x").unwrap();
        }
        assert_eq!(
            dead.file_name().unwrap().to_str().unwrap(),
            "default-model-v1.tmp4294967295"
        );
        remove_stale_tmp(&d);
        assert!(!dead.exists());
        assert!(live.exists() && other_model.exists() && not_a_pid.exists());
    }

    #[test]
    fn a_failed_generation_leaves_no_tmp_dir() {
        let root = tempfile::tempdir().unwrap();
        let d = root.path().join("m");
        let e = ensure_at(&d, &serde_json::json!({"vocab_size": 10})).unwrap_err();
        assert!(
            format!("{e:#}").contains(r#"config.json has no "model_type""#),
            "{e:#}"
        );
        let left: Vec<_> = std::fs::read_dir(root.path()).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
