//! `backburner bench gen-gguf`: writes a random-weight GGUF file of any shape and per-tensor type mix, streaming
//! (bounded memory), for benchmarks of real-size models without converting a real checkpoint
//! ([`backburner_model::gguf::random`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use backburner_model::gguf::random::{
    Fallback, Generator, GgufVocab, TypeRule, Vocab, DEFAULT_BUFFER_BYTES,
};
use backburner_model::ModelConfig;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::Value;

/// Tokens of the bundled Qwen3.5 tokenizer (its vocabulary and added tokens).
const QWEN35_TOKENS: u64 = 248_077;

/// The real Qwen3.5-27B's config.json (64 layers; `--layers` picks fewer).
const CONFIG_27B: &str = include_str!("../../../fixtures/ref-27b-config/config.json");

/// Options of `bench gen-gguf`.
#[derive(Args)]
pub struct GenGgufArgs {
    /// File to write (replaced if it exists).
    #[arg(long)]
    out: PathBuf,
    /// Shape: `27b` (Qwen3.5-27B: hidden 5120, 64 layers, vocab 248320), `bench` (the `bench local` model), `tiny`
    /// (the tests' 64-wide model) or the path of a config.json (or of a directory holding one).
    #[arg(long, default_value = "bench")]
    shape: String,
    /// GGUF architecture. Default: the shape's. A dense shape made `qwen35moe` or `qwen3next` gets the experts of
    /// the `--experts*` options, else of the Hugging Face config class's defaults (256 × 512 of 8, shared 512; Next:
    /// 512 × 512 of 10, shared 512).
    #[arg(long, value_parser = ["qwen35", "qwen35moe", "qwen3next"])]
    arch: Option<String>,
    /// Decoder layers (default: the shape's).
    #[arg(long)]
    layers: Option<usize>,
    /// Routed experts per layer (MoE architectures).
    #[arg(long)]
    experts: Option<usize>,
    /// Experts per token (MoE architectures).
    #[arg(long)]
    experts_used: Option<usize>,
    /// An expert's inner width (MoE architectures).
    #[arg(long)]
    expert_ff: Option<usize>,
    /// The shared expert's inner width (MoE architectures).
    #[arg(long)]
    shared_ff: Option<usize>,
    /// Type of every tensor llama-quantize would quantize (F32, F16, BF16, Q4_0 … Q8_0, Q2_K … Q6_K, IQ1_S … IQ4_XS,
    /// TQ1_0, TQ2_0, MXFP4). Vectors, the conv kernel and the MoE router stay F32.
    #[arg(long = "type", default_value = "Q4_K")]
    default_type: String,
    /// `PATTERN=TYPE`: tensors whose GGUF name contains PATTERN (`^` / `$` anchor it at the start / end) get TYPE;
    /// the first match wins. Repeatable, or comma-separated: `ssm_alpha=F32,token_embd=Q8_0,^output.weight$=Q6_K`.
    #[arg(long = "tensor-type", value_delimiter = ',')]
    tensor_types: Vec<String>,
    /// Seed of the random data (the same seed gives the same bytes).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Tokenizer section: `qwen35` (the bundled Qwen3.5 tokenizer and chat template; needs a vocab of 248077 or
    /// more), `bytes` (256 byte tokens and 3 specials: text runs, one token per byte), `none`. Default: `qwen35`
    /// when the vocab holds it, else `bytes`.
    #[arg(long, value_parser = ["qwen35", "bytes", "none"])]
    tokenizer: Option<String>,
    /// Size of the one buffer the data go through (MiB).
    #[arg(long, default_value_t = DEFAULT_BUFFER_BYTES >> 20)]
    buffer_mib: usize,
    /// Print the plan (sizes, types, fallbacks) without writing.
    #[arg(long)]
    dry_run: bool,
}

/// The config.json of `shape`, flattened to the text config when it is a hub one.
fn shape_json(shape: &str) -> Result<Value> {
    let v = match shape {
        "27b" => serde_json::from_str(CONFIG_27B).expect("the bundled 27B config parses"),
        "bench" => crate::bench::bench_config(),
        "tiny" => backburner_model::synthetic::tiny_config(4),
        path => {
            let p = Path::new(path);
            let p = if p.is_dir() {
                p.join("config.json")
            } else {
                p.to_path_buf()
            };
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("read {}", p.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parse {}", p.display()))?
        }
    };
    let Some(tc) = v.get("text_config").cloned() else {
        return Ok(v);
    };
    // a hub config: its text config, whose model_type is the text one
    let mut t = tc;
    let mt = v["model_type"].as_str().unwrap_or("qwen3_5");
    t["model_type"] = format!("{}_text", mt.trim_end_matches("_text")).into();
    if t.get("tie_word_embeddings").is_none() {
        t["tie_word_embeddings"] = v
            .get("tie_word_embeddings")
            .cloned()
            .unwrap_or(false.into());
    }
    Ok(t)
}

/// `v` with the options' architecture, layer count and expert sizes.
fn shaped(mut v: Value, a: &GenGgufArgs) -> Result<Value> {
    if let Some(n) = a.layers {
        if n == 0 {
            bail!("--layers must be at least 1");
        }
        v["num_hidden_layers"] = n.into();
        if let Some(types) = v.get_mut("layer_types").and_then(Value::as_array_mut) {
            if types.len() >= n {
                types.truncate(n);
            } else if let Some(o) = v.as_object_mut() {
                // more layers than listed: the full_attention_interval's pattern
                o.remove("layer_types");
            }
        }
        if let Some(d) = v.get_mut("mlp_only_layers").and_then(Value::as_array_mut) {
            d.retain(|i| i.as_u64().is_some_and(|i| (i as usize) < n));
        }
    }
    if let Some(arch) = &a.arch {
        v["model_type"] = match arch.as_str() {
            "qwen35moe" => "qwen3_5_moe_text",
            "qwen3next" => "qwen3_next",
            _ => "qwen3_5_text",
        }
        .into();
    }
    for (k, x) in [
        ("num_experts", a.experts),
        ("num_experts_per_tok", a.experts_used),
        ("moe_intermediate_size", a.expert_ff),
        ("shared_expert_intermediate_size", a.shared_ff),
    ] {
        if let Some(x) = x {
            v[k] = x.into();
        }
    }
    Ok(v)
}

/// The bundled Qwen3.5 tokenizer as GGUF token lists: vocabulary ids normal tokens, added ones control (special) or
/// user-defined, merges `"a b"`, eos `<|im_end|>`, pre-tokenizer `qwen35`, the chat template of its
/// tokenizer_config.json.
fn qwen35_vocab() -> Result<GgufVocab> {
    let tok: Value = serde_json::from_slice(&crate::default_model::tokenizer_json()?)?;
    let vocab = tok["model"]["vocab"]
        .as_object()
        .context("tokenizer.json has a vocab")?;
    let added = tok["added_tokens"]
        .as_array()
        .context("tokenizer.json has added_tokens")?;
    let mut entries: Vec<(u64, String, i32)> = vocab
        .iter()
        .filter_map(|(t, id)| Some((id.as_u64()?, t.clone(), 1)))
        .collect();
    for t in added {
        let (Some(id), Some(text)) = (t["id"].as_u64(), t["content"].as_str()) else {
            bail!("an added token without id or content: {t}");
        };
        let ty = if t["special"].as_bool() == Some(true) {
            3
        } else {
            4
        };
        entries.push((id, text.to_string(), ty));
    }
    entries.sort_by_key(|e| e.0);
    if entries.iter().enumerate().any(|(i, e)| e.0 != i as u64) {
        bail!("the bundled tokenizer's ids are not 0..{}", entries.len());
    }
    let merges = tok["model"]["merges"]
        .as_array()
        .context("tokenizer.json has merges")?
        .iter()
        .map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(p) => Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?)),
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .context("a merge is neither \"a b\" nor [a, b]")?;
    let eos = entries
        .iter()
        .position(|e| e.1 == "<|im_end|>")
        .context("no <|im_end|>")?;
    let tcfg: Value = serde_json::from_str(crate::default_model::TOKENIZER_CONFIG)?;
    Ok(GgufVocab {
        token_types: entries.iter().map(|e| e.2).collect(),
        tokens: entries.into_iter().map(|e| e.1).collect(),
        merges,
        pre: "qwen35".into(),
        eos: eos as u32,
        chat_template: tcfg["chat_template"].as_str().map(str::to_string),
    })
}

fn vocab_for(choice: Option<&str>, vocab_size: usize) -> Result<Vocab> {
    let fits = vocab_size as u64 >= QWEN35_TOKENS;
    Ok(match choice {
        Some("qwen35") if !fits => {
            bail!("--tokenizer qwen35 needs a vocab of at least {QWEN35_TOKENS}; this shape has {vocab_size}")
        }
        Some("qwen35") => Vocab::Given(qwen35_vocab()?),
        None if fits => Vocab::Given(qwen35_vocab()?),
        Some("none") => Vocab::None,
        None if vocab_size < 259 => Vocab::None,
        _ => Vocab::ByteLevel,
    })
}

/// The fallbacks grouped by name with the block number as `*`: `(name, requested → written, why) → count`.
fn fallback_groups(g: &Generator) -> BTreeMap<(String, String, String), usize> {
    let mut out = BTreeMap::new();
    for t in g.fallbacks() {
        let name = match t.name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((_, rest)) => format!("blk.*.{rest}"),
            None => t.name.clone(),
        };
        let why = match t.fallback {
            Some(Fallback::RowLength { cols, block }) => {
                format!("rows of {cols} are not whole {block}-element blocks")
            }
            _ => "llama-quantize leaves it unquantized".to_string(),
        };
        let types = format!("{} → {}", t.requested, t.ggml_type);
        *out.entry((name, types, why)).or_insert(0) += 1;
    }
    out
}

fn gb(b: u64) -> String {
    format!("{:.2} GB", b as f64 / 1e9)
}

/// The type rule for people: `IQ2_XS,ffn=Q8_0` (as the file's metadata keeps it) as `IQ2_XS (tensors matching
/// "ffn": Q8_0)`.
fn human_types(rule: &str) -> String {
    let mut parts = rule.split(',');
    let default = parts.next().unwrap_or_default().to_string();
    let over: Vec<String> = parts
        .filter_map(|p| p.rsplit_once('='))
        .map(|(pat, t)| format!("tensors matching {pat:?}: {t}"))
        .collect();
    if over.is_empty() {
        default
    } else {
        format!("{default} ({})", over.join(", "))
    }
}

fn print_plan(g: &Generator, rule: &TypeRule) {
    let c = g.config();
    let arch = backburner_model::arch::arch_of(c).gguf_arch;
    println!(
        "{arch}: {} layers, hidden {}, vocab {}{}; types {}; {} tensors, {} ({} bytes)",
        c.num_hidden_layers,
        c.hidden_size,
        c.vocab_size,
        c.moe.as_ref().map_or(String::new(), |m| format!(
            ", {} experts of {} ({} per token)",
            m.num_experts, m.moe_intermediate_size, m.num_experts_per_tok
        )),
        human_types(&rule.describe()),
        g.tensors().len(),
        gb(g.file_bytes()),
        g.file_bytes()
    );
    println!("{:<8} {:>8} {:>16}", "type", "tensors", "bytes");
    for t in g.type_counts() {
        println!("{:<8} {:>8} {:>16}", t.ggml_type.name(), t.tensors, t.bytes);
    }
    let groups = fallback_groups(g);
    if !groups.is_empty() {
        let n: usize = groups.values().sum();
        println!("fallbacks ({n} tensors):");
        for ((name, types, why), k) in groups {
            println!("  {name} ×{k}: {types} ({why})");
        }
    }
}

/// Runs `bench gen-gguf`.
pub fn run(a: GenGgufArgs) -> Result<()> {
    let v = shaped(shape_json(&a.shape)?, &a)?;
    let c = ModelConfig::from_json_str(&v.to_string()).context("the shape's config")?;
    let rule = TypeRule::parse(&a.default_type, &a.tensor_types)?;
    let vocab = vocab_for(a.tokenizer.as_deref(), c.vocab_size)?;
    let g = Generator::new(&c, &rule, &vocab, a.seed)?;
    print_plan(&g, &rule);
    if a.dry_run {
        return Ok(());
    }
    let pb = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::new(g.file_bytes())
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template(
            "  writing [{bar:30}] {bytes}/{total_bytes} ({binary_bytes_per_sec}, {eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    let t0 = Instant::now();
    let stats = g.write_file(&a.out, a.buffer_mib << 20, &mut |b| pb.set_position(b))?;
    pb.finish_and_clear();
    let s = t0.elapsed().as_secs_f64();
    println!(
        "wrote {}: {} ({} bytes) in {s:.1} s ({:.0} MB/s), {} writes of at most {} bytes",
        a.out.display(),
        gb(stats.bytes),
        stats.bytes,
        stats.bytes as f64 / 1e6 / s,
        stats.writes,
        stats.largest_write
    );
    Ok(())
}

#[cfg(test)]
mod tests;
