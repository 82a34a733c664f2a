//! The bundled default model: the real Qwen3.5 tokenizer (embedded in the binary, gzip) and random weights of a small
//! Qwen3.5-architecture decoder, generated deterministically on first use into the cache directory.
//!
//! The weights are random, so the text it writes is random tokens of the real vocabulary; it exists so the whole
//! pipeline (tokenizer, chat template, prefill, decode, streaming) runs on real text on any machine without a download.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use half::bf16;
use safetensors::tensor::{Dtype, TensorView};

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

/// SplitMix64: a tiny fixed PRNG, so the weights never change with a dependency's version.
struct SplitMix(u64);
impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    /// Standard normal (Box–Muller).
    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

fn write_model(dir: &Path, cfg: &serde_json::Value) -> Result<()> {
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
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

    let g = |k: &str| cfg[k].as_u64().expect("int field") as usize;
    let (v, h, inter, n_layers) = (
        g("vocab_size"),
        g("hidden_size"),
        g("intermediate_size"),
        g("num_hidden_layers"),
    );
    let (hq, hkv, d) = (
        g("num_attention_heads"),
        g("num_key_value_heads"),
        g("head_dim"),
    );
    let (hk, hv, dk, dv, kc) = (
        g("linear_num_key_heads"),
        g("linear_num_value_heads"),
        g("linear_key_head_dim"),
        g("linear_value_head_dim"),
        g("linear_conv_kernel_dim"),
    );
    let conv_dim = 2 * hk * dk + hv * dv;
    let mut rng = SplitMix(0x6261_636b_6275_726e); // "backburn"
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, f: &mut dyn FnMut() -> f64| {
        let n: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(n * 2);
        for _ in 0..n {
            bytes.extend_from_slice(&bf16::from_f64(f()).to_le_bytes());
        }
        tensors.push((name, shape, bytes));
    };
    let std = 0.02;
    macro_rules! w {
        ($name:expr, $shape:expr, $std:expr, $mean:expr) => {{
            let (s, m) = ($std, $mean);
            add($name, $shape, &mut || m + s * rng.normal());
        }};
    }
    w!("model.embed_tokens.weight".into(), vec![v, h], std, 0.0);
    w!("model.norm.weight".into(), vec![h], 0.1, 0.0);
    for i in 0..n_layers {
        let p = format!("model.layers.{i}.");
        w!(format!("{p}input_layernorm.weight"), vec![h], 0.1, 0.0);
        w!(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            0.1,
            0.0
        );
        w!(format!("{p}mlp.gate_proj.weight"), vec![inter, h], std, 0.0);
        w!(format!("{p}mlp.up_proj.weight"), vec![inter, h], std, 0.0);
        w!(format!("{p}mlp.down_proj.weight"), vec![h, inter], std, 0.0);
        if (i + 1) % g("full_attention_interval") == 0 {
            w!(
                format!("{p}self_attn.q_proj.weight"),
                vec![hq * 2 * d, h],
                std,
                0.0
            );
            w!(
                format!("{p}self_attn.k_proj.weight"),
                vec![hkv * d, h],
                std,
                0.0
            );
            w!(
                format!("{p}self_attn.v_proj.weight"),
                vec![hkv * d, h],
                std,
                0.0
            );
            w!(
                format!("{p}self_attn.o_proj.weight"),
                vec![h, hq * d],
                std,
                0.0
            );
            w!(format!("{p}self_attn.q_norm.weight"), vec![d], 0.1, 0.0);
            w!(format!("{p}self_attn.k_norm.weight"), vec![d], 0.1, 0.0);
        } else {
            w!(
                format!("{p}linear_attn.in_proj_qkv.weight"),
                vec![conv_dim, h],
                std,
                0.0
            );
            w!(
                format!("{p}linear_attn.in_proj_z.weight"),
                vec![hv * dv, h],
                std,
                0.0
            );
            w!(
                format!("{p}linear_attn.in_proj_b.weight"),
                vec![hv, h],
                std,
                0.0
            );
            w!(
                format!("{p}linear_attn.in_proj_a.weight"),
                vec![hv, h],
                std,
                0.0
            );
            w!(
                format!("{p}linear_attn.conv1d.weight"),
                vec![conv_dim, 1, kc],
                0.3,
                0.0
            );
            w!(format!("{p}linear_attn.dt_bias"), vec![hv], 0.5, 0.0);
            w!(format!("{p}linear_attn.A_log"), vec![hv], 0.5, 0.0);
            w!(format!("{p}linear_attn.norm.weight"), vec![dv], 0.1, 1.0);
            w!(
                format!("{p}linear_attn.out_proj.weight"),
                vec![h, hv * dv],
                std,
                0.0
            );
        }
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::BF16, s.clone(), b)?)))
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .context("write model.safetensors")?;
    Ok(())
}
