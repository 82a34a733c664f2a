//! `backburner`: run Qwen3.5-family hybrid models on CPU, optionally with a worker over a link for split prefill.

mod bench;
mod bench_offload;
mod bench_report;
mod bench_split;
mod default_model;
mod link_args;
mod prompt;
mod worker_cmd;

pub use link_args::LinkArgs;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use backburner_engine::{
    generate, perplexity, ComputePool, GenerateParams, SamplingParams, SessionOptions, StopReason,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{
    ChatMessage, Checkpoint, KvOptions, LoadOptions, Model, ModelConfig, TextTokenizer,
};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser)]
#[command(
    name = "backburner",
    version,
    about = "Exact CPU inference of Qwen3.5-family hybrid models"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt (streams to stdout, stats to stderr).
    Run(Box<RunArgs>),
    /// Perplexity of a text file.
    Perplexity(PplArgs),
    /// Benchmarks.
    Bench(bench::BenchArgs),
    /// Serve the tail layers of split prefill to a host over the link (a daemon).
    Worker(worker_cmd::WorkerArgs),
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json). Default: the bundled model.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Tokens per ubatch in prefill.
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Positions per KV cache page.
    #[arg(long, default_value_t = 4096)]
    pub kv_page_size: usize,
    /// KV cache dtype: f16 or f32.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Context length in tokens (default: the model's max_position_embeddings).
    #[arg(long)]
    pub ctx_size: Option<usize>,
}

impl ModelArgs {
    /// The session options these flags give, computing on `pool`.
    pub fn session_options(&self, pool: &ComputePool) -> SessionOptions {
        SessionOptions {
            ubatch: self.ubatch,
            kv: KvOptions {
                page_size: self.kv_page_size,
                dtype: self.kv_dtype,
            },
            context_length: self.ctx_size,
            pool: pool.clone(),
            kv_budget: None,
            interleave: true,
        }
    }
}

#[derive(Args)]
#[command(allow_negative_numbers = true)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text.
    #[arg(long, group = "input")]
    prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(long, group = "input")]
    prompt_file: Option<PathBuf>,
    /// Prompt as token ids: a JSON array or ids separated by commas/whitespace.
    #[arg(long, group = "input")]
    prompt_tokens: Option<String>,
    /// Read prompt token ids from a file (same formats as --prompt-tokens).
    #[arg(long, group = "input")]
    prompt_tokens_file: Option<PathBuf>,
    /// Wrap the prompt text as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// With --chat: ask a thinking model to answer without a thinking block (sets `enable_thinking=false` in the
    /// template, as transformers does).
    #[arg(long, requires = "chat")]
    no_think: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temp: f32,
    /// Top-k (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Top-p (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Min-p (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// RNG seed for sampling (default: random; the seed used is printed in the stats line and --json).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when the output contains this text (repeatable; needs a tokenizer).
    #[arg(long)]
    stop: Vec<String>,
    /// Do not stop at the model's eos ids.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Write the logits of every sampling step to this file (f32 little-endian, `[steps, vocab]`), for comparing
    /// runs bit for bit.
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    #[command(flatten)]
    link: LinkArgs,
}

#[derive(Args)]
#[command(mut_arg("ctx_size", |a| a.hide(true)))]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(long)]
    file: PathBuf,
    /// Window length in tokens, at least 2 and at most the model's context; windows do not overlap and each starts
    /// from an empty state (default: the whole text).
    #[arg(long)]
    ctx: Option<usize>,
    /// Print JSON {"ppl","nll","n_tokens",...}.
    #[arg(long)]
    json: bool,
}

fn main() {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BACKBURNER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let r = match cli.cmd {
        Cmd::Run(a) => run(*a),
        Cmd::Perplexity(a) => run_perplexity(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Worker(a) => worker_cmd::run(a),
    };
    if let Err(e) = r {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The compute thread count of `--threads` (default: all cores), checked.
pub fn thread_count(n: Option<usize>) -> Result<usize> {
    let n = n.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    if n == 0 {
        bail!("--threads must be ≥ 1");
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    if n > 4 * cores.max(16) {
        bail!(
            "--threads {n} is far more than this machine's {cores} cores (at most {} allowed)",
            4 * cores.max(16)
        );
    }
    Ok(n)
}

/// A compute pool of `--threads` threads (see [`thread_count`]); each command that computes owns one.
pub fn compute_pool(n: Option<usize>) -> Result<ComputePool> {
    Ok(ComputePool::new(thread_count(n)?)?)
}

fn bar(len: u64, msg: &str) -> ProgressBar {
    let pb = if std::io::stderr().is_terminal() {
        ProgressBar::new(len)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template("{msg:>9} [{bar:30}] {pos}/{len} ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    pb.set_message(msg.to_string());
    pb
}

/// A loaded model with its tokenizer (if the checkpoint has one).
pub struct Loaded {
    /// The model.
    pub model: Arc<Model>,
    /// The tokenizer.
    pub tokenizer: Option<TextTokenizer>,
    /// Where it came from.
    pub dir: PathBuf,
}

/// Loads `--model` (or the bundled default, generating it on first use), with a progress bar on a TTY; weights are
/// packed on `pool`'s threads.
pub fn load(args: &ModelArgs, pool: &ComputePool) -> Result<Loaded> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model::ensure()?,
    };
    pool.install(|| load_dir(&dir))
}

fn load_dir(dir: &Path) -> Result<Loaded> {
    let config = ModelConfig::from_dir(dir)?;
    let ckpt = Checkpoint::open(dir)?;
    let n = config.num_hidden_layers;
    let tokenizer = TextTokenizer::from_dir(dir, config.vocab_size, &config.eos_token_ids)?;
    let pb = bar(n as u64, "loading");
    let model = Model::from_checkpoint(
        config,
        &ckpt,
        &LoadOptions {
            layers: 0..n,
            ends: true,
        },
        |done, _| pb.set_position(done as u64),
    )?;
    pb.finish_and_clear();
    Ok(Loaded {
        model: Arc::new(model),
        tokenizer,
        dir: dir.to_path_buf(),
    })
}

fn need_tok<'a>(
    tok: &'a Option<TextTokenizer>,
    what: &str,
    hint: &str,
) -> Result<&'a TextTokenizer> {
    tok.as_ref().with_context(|| {
        format!("{what} needs a tokenizer, and this checkpoint has no tokenizer.json{hint}")
    })
}

const IDS_HINT: &str = "; give token ids with --prompt-tokens or --prompt-tokens-file";

/// Rejects sampling settings that have no meaning (NaN or negative temperature, top-p outside (0, 1], min-p
/// outside [0, 1]).
fn check_sampling(a: &RunArgs) -> Result<()> {
    if !a.temp.is_finite() || a.temp < 0.0 {
        bail!("--temp {} must be a finite number ≥ 0 (0 = greedy)", a.temp);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p {} must be in (0, 1] (1 = off)", a.top_p);
    }
    if !(0.0..=1.0).contains(&a.min_p) {
        bail!("--min-p {} must be in [0, 1] (0 = off)", a.min_p);
    }
    Ok(())
}

fn run(a: RunArgs) -> Result<()> {
    check_sampling(&a)?;
    let pool = compute_pool(a.model.threads)?;
    let loaded = load(&a.model, &pool)?;
    let workers = a.link.clients(&loaded, pool.threads())?;
    let tok = &loaded.tokenizer;
    if !a.stop.is_empty() {
        need_tok(tok, "--stop", "")?;
    }
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Some(p.clone()),
        (_, Some(f)) => Some(read_prompt_file(f)?),
        _ => None,
    };
    let prompt: Vec<u32> = if let Some(text) = text {
        let t = need_tok(
            tok,
            if a.chat { "--chat" } else { "a text prompt" },
            IDS_HINT,
        )?;
        let text = if a.chat {
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(ChatMessage {
                    role: "system".into(),
                    content: s.clone(),
                });
            }
            msgs.push(ChatMessage {
                role: "user".into(),
                content: text,
            });
            t.apply_chat_template_with(&msgs, true, if a.no_think { Some(false) } else { None })?
        } else {
            text
        };
        t.encode(&text)?
    } else if let Some(ids) = &a.prompt_tokens {
        if a.chat {
            bail!("--chat applies to a text prompt (--prompt or --prompt-file), not to token ids");
        }
        prompt::parse_token_ids(ids)?
    } else if let Some(f) = &a.prompt_tokens_file {
        if a.chat {
            bail!("--chat applies to a text prompt (--prompt or --prompt-file), not to token ids");
        }
        prompt::parse_token_ids(
            &std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?,
        )?
    } else {
        bail!("give a prompt: --prompt TEXT, --prompt-file F, --prompt-tokens IDS or --prompt-tokens-file F");
    };
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let vocab = loaded.model.config().vocab_size;
    if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        bail!("prompt token id {bad} is out of range: the model's vocab_size is {vocab}");
    }
    let eos_ids = if a.ignore_eos {
        Vec::new()
    } else {
        tok.as_ref()
            .map(|t| t.eos_ids().to_vec())
            .unwrap_or_else(|| loaded.model.config().eos_token_ids.clone())
    };
    let seed = a.seed.unwrap_or_else(rand::random);
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temp,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            seed,
        },
        eos_ids,
        stop: a.stop.clone(),
        keep_logits: a.dump_logits.is_some(),
        cancel: Some(cancel_on_ctrl_c()?),
    };
    let mut opts = a.model.session_options(&pool);
    opts.kv_budget = a.link.kv_budget;
    opts.interleave = !a.link.no_interleave;
    let mut session = backburner_engine::Session::new(loaded.model.clone(), opts)?;
    for w in workers {
        session.attach_worker(w);
    }
    let show_bar = prompt.len() >= 2 * a.model.ubatch;
    let pb = if show_bar {
        bar(prompt.len() as u64, "prefill")
    } else {
        ProgressBar::hidden()
    };
    let json = a.json;
    let mut out = std::io::stdout();
    let has_tok = tok.is_some();
    let t_start = Instant::now();
    let gen = generate(
        &mut session,
        &prompt,
        &params,
        tok.as_ref(),
        |done, total| {
            if show_bar {
                pb.set_position(done as u64);
                if done == total {
                    pb.finish_and_clear();
                }
            }
        },
        |id| {
            if !json && !has_tok && write!(out, "{id} ").and_then(|_| out.flush()).is_err() {
                quiet_exit_on_closed_stdout();
            }
        },
        |piece| {
            if !json {
                let mut o = std::io::stdout();
                if write!(o, "{piece}").and_then(|_| o.flush()).is_err() {
                    quiet_exit_on_closed_stdout();
                }
            }
        },
    )?;
    if let Some(f) = &a.dump_logits {
        let bytes: Vec<u8> = gen
            .step_logits
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(f, bytes).with_context(|| format!("write {}", f.display()))?;
    }
    let total_s = t_start.elapsed().as_secs_f64();
    let tm = &gen.timings;
    let interrupted = gen.stop_reason == StopReason::Interrupted;
    if json {
        let obj = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": gen.tokens,
            "text": gen.text,
            "stop_reason": gen.stop_reason.as_str(),
            "seed": seed,
            "timings": {
                "ttft_ms": tm.ttft_ms,
                "prefill_tok_s": tm.prefill_tok_s,
                "decode_tok_s": tm.decode_tok_s,
                "prefill_ms": tm.prefill_ms,
                "decode_ms": tm.decode_ms,
            },
        });
        let mut obj = obj;
        if let Some(link) = link_args::link_json(&session, tm) {
            obj["link"] = link;
        }
        out_line(&obj.to_string());
    } else {
        out_line("");
        let mut stats = format!(
            "prompt {} tokens | prefill {:.1} tok/s",
            prompt.len(),
            tm.prefill_tok_s
        );
        // a decode rate needs two tokens, a time to first token one sampled token (an eos counts)
        if gen.tokens.len() >= 2 {
            stats += &format!(" | decode {:.1} tok/s", tm.decode_tok_s);
        }
        if !gen.tokens.is_empty() || gen.stop_reason == StopReason::Eos {
            stats += &format!(" | ttft {:.0} ms", tm.ttft_ms);
        }
        stats += &format!(
            " | generated {} tokens ({}) in {:.2} s",
            gen.tokens.len(),
            gen.stop_reason.as_str(),
            total_s
        );
        if a.temp > 0.0 {
            stats += &format!(" | seed {seed}");
        }
        eprintln!("{stats}");
        for line in link_args::link_lines(&session, tm) {
            eprintln!("{line}");
        }
    }
    if interrupted {
        std::process::exit(130); // 128 + SIGINT, as a shell reports a Ctrl-C
    }
    Ok(())
}

/// Installs a Ctrl-C (and SIGTERM/SIGHUP) handler for generation: the first signal raises the returned flag, so the
/// loop stops between tokens and the run reports what it made; a second exits at once with 130 (a prefill in progress
/// is not interrupted).
fn cancel_on_ctrl_c() -> Result<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    let f = flag.clone();
    ctrlc::set_handler(move || {
        if f.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
    })
    .context("install the Ctrl-C handler")?;
    Ok(flag)
}

/// The reader of our stdout went away (`| head`): stop quietly, as command-line tools do.
fn quiet_exit_on_closed_stdout() -> ! {
    std::process::exit(0)
}

/// Prints a line to stdout; a closed stdout ends the process quietly instead of panicking.
fn out_line(s: &str) {
    let mut o = std::io::stdout();
    if writeln!(o, "{s}").and_then(|_| o.flush()).is_err() {
        quiet_exit_on_closed_stdout();
    }
}

/// Reads a prompt file, refusing files over 256 MiB (far beyond any context) before reading them.
fn read_prompt_file(f: &Path) -> Result<String> {
    let len = std::fs::metadata(f)
        .with_context(|| format!("read prompt file {}", f.display()))?
        .len();
    if len > 256 << 20 {
        bail!(
            "prompt file {} is {len} bytes; more than any context window holds",
            f.display()
        );
    }
    std::fs::read_to_string(f).with_context(|| format!("read prompt file {}", f.display()))
}

/// Bytes with a binary unit.
pub fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= (1u64 << 30) as f64 {
        format!("{:.2} GiB", b / (1u64 << 30) as f64)
    } else if b >= (1u64 << 20) as f64 {
        format!("{:.2} MiB", b / (1u64 << 20) as f64)
    } else if b >= 1024.0 {
        format!("{:.1} KiB", b / 1024.0)
    } else {
        format!("{b} B")
    }
}

fn run_perplexity(a: PplArgs) -> Result<()> {
    if let Some(n) = a.model.ctx_size {
        bail!("perplexity takes --ctx {n} (the window length, at most the model's context), not --ctx-size");
    }
    if let Some(c) = a.ctx.filter(|&c| c < 2) {
        bail!("--ctx {c} is too short: a window needs at least 2 tokens (a token to predict and one before it)");
    }
    let pool = compute_pool(a.model.threads)?;
    let loaded = load(&a.model, &pool)?;
    let tok = need_tok(&loaded.tokenizer, "perplexity", "")?;
    let text =
        std::fs::read_to_string(&a.file).with_context(|| format!("read {}", a.file.display()))?;
    let ids = tok.encode(&text)?;
    if ids.len() < 2 {
        bail!(
            "{} is {} token(s); perplexity needs at least 2",
            a.file.display(),
            ids.len()
        );
    }
    let ctx = a.ctx.unwrap_or(ids.len()).min(ids.len());
    let limit = loaded.model.config().max_position_embeddings;
    if ctx > limit {
        match a.ctx {
            Some(c) => bail!("--ctx {c} is longer than the model's context of {limit} tokens (max_position_embeddings); use --ctx {limit} or less"),
            None => bail!(
                "{} is {} tokens, longer than the model's context of {limit} tokens (max_position_embeddings): score it in windows with --ctx {limit} (or less)",
                a.file.display(),
                ids.len()
            ),
        }
    }
    let pb = bar(ids.len() as u64, "scoring");
    let r = perplexity(
        loaded.model.clone(),
        &ids,
        ctx,
        a.model.session_options(&pool),
        |d, _| pb.set_position(d as u64),
    )?;
    pb.finish_and_clear();
    if a.json {
        out_line(&serde_json::to_string(&r)?);
    } else {
        out_line(&format!(
            "perplexity {:.4} (nll {:.6} nats/token) over {} tokens, {} scored, ctx {}",
            r.ppl, r.nll, r.n_tokens, r.n_scored, r.ctx
        ));
    }
    Ok(())
}
