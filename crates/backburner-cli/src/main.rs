//! `backburner`: run Qwen3.5-family hybrid models on CPU, optionally with a worker over a link for split prefill.

mod bench;
mod bench_gen_gguf;
mod bench_layer_split;
mod bench_offload;
mod bench_report;
mod bench_seed;
mod bench_session;
mod bench_session_http;
mod bench_session_report;
mod bench_share;
mod bench_slots;
mod bench_spec;
mod bench_split;
mod calibrate_cmd;
mod chain_args;
mod chat_cmd;
mod chat_conv;
mod chat_repl;
mod constraint_args;
mod default_model;
mod device_args;
mod device_layers;
mod devices_cmd;
mod experts_args;
mod link_args;
mod llama_flags;
mod placement;
mod plan_cmd;
mod prompt;
mod run_cmd;
mod sampling_args;
mod serve_cmd;
mod spec_args;
mod tokenizer_load;
mod worker_cmd;

pub use link_args::LinkArgs;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use backburner_engine::{ComputePool, SessionOptions};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, Model, ModelConfig, Precision, TextTokenizer};
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use run_cmd::out_line;
pub use tokenizer_load::{load_tokenizer, need_tok};

#[derive(Parser)]
#[command(
    name = "backburner",
    version,
    about = "Exact inference of Qwen3.5-family hybrid models on CPUs and GPUs, with borrowed devices"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt (streams to stdout, stats to stderr).
    Run(Box<run_cmd::RunArgs>),
    /// Chat in the terminal, multi-turn, each turn resuming from the previous one's prompt cache (also `run -cnv`).
    Chat(Box<chat_cmd::ChatArgs>),
    /// Perplexity of a text file.
    Perplexity(PplArgs),
    /// Benchmarks.
    Bench(bench::BenchArgs),
    /// Serve hosts over the link (a daemon): the tail layers of split prefill, and the KV pages of KV offload.
    Worker(worker_cmd::WorkerArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (chat and text completions, streaming, parallel slots,
    /// prompt cache, tools), optionally with workers.
    Serve(Box<serve_cmd::ServeArgs>),
    /// Compute a placement for memory budgets (mode, layer ranges, KV, largest context) without loading weights.
    Plan(Box<plan_cmd::PlanArgs>),
    /// Measure the host's and workers' per-layer prefill and decode speed and the link, for `plan --calibration`.
    Calibrate(Box<calibrate_cmd::CalibrateArgs>),
    /// List the devices this build and machine offer (`--device`): id, name, memory, backend; and the backends
    /// not built.
    Devices(devices_cmd::DevicesArgs),
}

/// Options shared by every command that loads a model.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a GGUF file (a directory holding one, or
    /// any part of a split set). Default: the bundled model.
    #[arg(short = 'm', long)]
    pub model: Option<PathBuf>,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Tokens per ubatch in prefill.
    #[arg(long, default_value_t = 512)]
    pub ubatch: usize,
    /// Positions per KV cache page.
    #[arg(long, default_value_t = 4096)]
    pub kv_page_size: usize,
    /// KV cache dtype: f16, f32 or bf16. bf16 pages hold as many bytes as f16's and attention multiplies them with
    /// bf16 dot products (queries and softmax weights rounded to bf16, as llama.cpp's `-ctk bf16 -ctv bf16`;
    /// AVX-512 BF16, emulated bit for bit elsewhere); it needs a model with an even head_dim.
    #[arg(long, default_value = "f16")]
    pub kv_dtype: KvDtype,
    /// Context length in tokens (default, or 0 as in llama.cpp: the model's max_position_embeddings).
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
    /// Most bytes this command may allocate for weights, KV cache, recurrent state and buffers, checked before
    /// anything is allocated (units: K/KiB, M/MiB, G/GiB binary; KB, MB, GB decimal). The OS's limits (ulimit -d,
    /// ulimit -v, the cgroup's memory.max) are checked the same way whether or not it is given.
    #[arg(long, value_name = "BYTES", value_parser = backburner_engine::offload::parse_bytes)]
    pub max_memory: Option<u64>,
    /// Arithmetic of products against bf16 weights: f32 (weights widened to f32, f32 activations: the reference's
    /// results) or bf16 (activations rounded to bf16, AVX-512 BF16 dot products as llama.cpp computes them: about
    /// twice the prefill speed; emulated, slower, on a CPU without AVX-512 BF16). Other weight types ignore it. The
    /// workers of a split must be given the same (the handshake's fingerprint covers it).
    #[arg(long, default_value = "f32", value_parser = parse_precision)]
    pub precision: Precision,
    /// Load the checkpoint's MTP block (set by `--spec mtp`; otherwise it stays on disk).
    #[arg(skip)]
    pub mtp: bool,
    #[command(flatten)]
    pub device: device_args::DeviceArgs,
}

/// `--precision`: `f32` or `bf16`.
pub fn parse_precision(s: &str) -> Result<Precision, String> {
    Precision::parse(s).ok_or_else(|| format!("{s:?}: expected f32 or bf16"))
}

impl ModelArgs {
    /// `--ctx-size` as a limit: `None` when it is not given or 0 (llama.cpp's "the model's own context").
    pub fn ctx_limit(&self) -> Option<usize> {
        self.ctx_size.filter(|&c| c > 0)
    }

    /// The KV options these flags give.
    pub fn kv_options(&self) -> KvOptions {
        KvOptions {
            page_size: self.kv_page_size,
            dtype: self.kv_dtype,
        }
    }

    /// Refuses `--kv-dtype` for a model whose attention rows it cannot hold (bf16 with an odd head_dim,
    /// [`KvOptions::check`]), before the weights load.
    pub fn check_kv(&self, cfg: &ModelConfig) -> Result<()> {
        self.kv_options()
            .check(cfg)
            .map_err(|m| anyhow::anyhow!("{m}"))
    }

    /// The session options these flags give, computing on `pool`.
    pub fn session_options(&self, pool: &ComputePool) -> SessionOptions {
        SessionOptions {
            ubatch: self.ubatch,
            kv: self.kv_options(),
            context_length: self.ctx_limit(),
            pool: pool.clone(),
            kv_budget: None,
            interleave: true,
        }
    }
}

#[derive(Args)]
#[command(mut_arg("ctx_size", |a| a.hide(true).short(None)))]
#[command(group(clap::ArgGroup::new("input").required(true).args(["file", "tokens_file"])))]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(short = 'f', long)]
    file: Option<PathBuf>,
    /// Token ids to score instead of a text (a JSON array or ids separated by commas/whitespace, as `run
    /// --prompt-tokens-file`): for a model without a tokenizer.
    #[arg(long)]
    tokens_file: Option<PathBuf>,
    /// Window length in tokens, at least 2 and at most the model's context; windows do not overlap and each starts
    /// from an empty state (default: the whole text).
    #[arg(short = 'c', long)]
    ctx: Option<usize>,
    /// Score as llama.cpp's llama-perplexity does, so the two figures compare: only whole --ctx windows, and in each
    /// only the tokens of its second half (needs --ctx)
    #[arg(long, requires = "ctx")]
    second_half: bool,
    /// Print JSON {"ppl","nll","n_tokens",...}.
    #[arg(long)]
    json: bool,
}

/// The command line's description (what [`llama_flags`] reads to know which flags take a value).
pub(crate) fn cli_command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

fn main() {
    let args: Vec<String> = match std::env::args_os()
        .enumerate()
        .map(|(i, a)| {
            a.into_string()
                .map_err(|a| anyhow::anyhow!("argument {i} ({a:?}) is not valid UTF-8"))
        })
        .collect::<Result<_>>()
    {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let args = match serve_cmd::expand_config(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    };
    let args = match llama_flags::translate(args) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let cli = Cli::parse_from(args);
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BACKBURNER_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let r = match cli.cmd {
        Cmd::Run(a) => run_cmd::run(*a),
        Cmd::Chat(a) => chat_cmd::run(*a),
        Cmd::Perplexity(a) => run_perplexity(a),
        Cmd::Bench(a) => bench::run(a),
        Cmd::Worker(a) => worker_cmd::run(a),
        Cmd::Plan(a) => plan_cmd::run(*a),
        Cmd::Serve(a) => serve_cmd::run(*a),
        Cmd::Calibrate(a) => calibrate_cmd::calibrate(*a),
        Cmd::Devices(a) => devices_cmd::run(a),
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
    load_host(args, pool, None)
}

/// As [`load`], holding only layers `[0, held)` (and the ends) when `held` is given: a layer-split host. Errors:
/// `held` past the model's layers, and every error of loading.
pub fn load_host(args: &ModelArgs, pool: &ComputePool, held: Option<usize>) -> Result<Loaded> {
    load_host_without(args, pool, held, &[])
}

/// As [`load_host`], leaving out the routed experts `away` holds (experts on workers: `(layers, ids)` per worker),
/// through the engine's loader ([`backburner_engine::open::load_weights`]: the weights are checked against
/// `--max-memory` and the OS's limits first).
pub fn load_host_without(
    args: &ModelArgs,
    pool: &ComputePool,
    held: Option<usize>,
    away: &[(std::ops::Range<usize>, Vec<usize>)],
) -> Result<Loaded> {
    load_host_placed(args, pool, held, away, None, None)
}

/// As [`load_host_without`], placing the layers `--device-layers` names on `backend` (when given) as they load
/// ([`backburner_engine::open::load_weights_placed`]: the host never holds their weights); `auto` sizes them for
/// `ctx` positions (`None`: the model's context) of one sequence. Errors: as [`load_host_without`], and the
/// device's refusals of the placement.
pub fn load_host_placed(
    args: &ModelArgs,
    pool: &ComputePool,
    held: Option<usize>,
    away: &[(std::ops::Range<usize>, Vec<usize>)],
    backend: Option<&std::sync::Arc<dyn backburner_model::device::Backend>>,
    ctx: Option<usize>,
) -> Result<Loaded> {
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => default_model::ensure()?,
    };
    let n = args.device_layer_count(backend, &dir, ctx, 1)?;
    pool.install(|| {
        let (mut config, tokenizer) = load_tokenizer(&dir)?;
        config.precision = args.precision;
        if !args.mtp {
            // the MTP block drafts only for --spec mtp: otherwise its weights stay on disk
            config.mtp_num_hidden_layers = 0;
        }
        args.check_kv(&config)?;
        let mut printer = placement::Printer::new(true);
        let place = backend.and_then(|b| device_args::place(&config, b, n));
        let model = backburner_engine::open::load_weights_placed(
            &dir,
            config,
            held,
            away,
            place.as_ref(),
            args.max_memory,
            &mut printer,
        )?;
        Ok(Loaded {
            model,
            tokenizer,
            dir: dir.clone(),
        })
    })
}

const IDS_HINT: &str = "; give token ids with --prompt-tokens or --prompt-tokens-file";

/// The file perplexity scores and its token ids: `--tokens-file` as given (each id checked against the vocabulary),
/// or `--file` through the tokenizer.
fn ppl_tokens<'a>(a: &'a PplArgs, loaded: &Loaded) -> Result<(&'a Path, Vec<u32>)> {
    let read = |p: &Path| prompt::read_bounded(p, prompt::MAX_SCORED_FILE, "file");
    if let Some(p) = &a.tokens_file {
        let ids = prompt::parse_token_ids(&read(p)?).with_context(|| format!("{}", p.display()))?;
        backburner_engine::sequence::check_token_ids(&ids, loaded.model.config().vocab_size)
            .with_context(|| format!("{}", p.display()))?;
        return Ok((p, ids));
    }
    let p = a.file.as_deref().context("give --file or --tokens-file")?;
    let tok = need_tok(
        &loaded.tokenizer,
        &loaded.dir,
        "perplexity of a text",
        "; give token ids with --tokens-file",
    )?;
    Ok((p, tok.encode(&read(p)?)?))
}

fn run_perplexity(a: PplArgs) -> Result<()> {
    if let Some(n) = a.model.ctx_size {
        bail!("perplexity takes --ctx {n} (the window length, at most the model's context), not --ctx-size");
    }
    if let Some(c) = a.ctx.filter(|&c| c < 2) {
        bail!("--ctx {c} is too short: a window needs at least 2 tokens (a token to predict and one before it)");
    }
    let backend = a.model.device.open()?;
    let pool = compute_pool(a.model.threads)?;
    let loaded = load_host_placed(&a.model, &pool, None, &[], backend.as_ref(), a.ctx)?;
    device_args::place_loaded(&loaded.model, backend.as_ref());
    let (path, ids) = ppl_tokens(&a, &loaded)?;
    let path = path.display();
    if ids.len() < 2 {
        bail!(
            "{path} is {} token(s); perplexity needs at least 2",
            ids.len()
        );
    }
    let limit = loaded.model.config().max_position_embeddings;
    if let Some(c) = a.ctx.filter(|&c| c > limit) {
        bail!("--ctx {c} is longer than the model's context of {limit} tokens (max_position_embeddings); use --ctx {limit} or less");
    }
    if let Some(c) = a.ctx.filter(|&c| a.second_half && c > ids.len()) {
        bail!(
            "{path} is {} tokens, shorter than one --ctx {c} window: --second-half scores whole windows only (as llama-perplexity)",
            ids.len()
        );
    }
    let ctx = a.ctx.unwrap_or(ids.len()).min(ids.len());
    // A given --ctx is within the limit (checked above), so only the whole text can be too long here.
    if ctx > limit {
        bail!(
            "{path} is {} tokens, longer than the model's context of {limit} tokens (max_position_embeddings): score it in windows with --ctx {limit} (or less)",
            ids.len()
        );
    }
    let pb = bar(ids.len() as u64, "scoring");
    let r = backburner_engine::perplexity_windows(
        loaded.model.clone(),
        &ids,
        ctx,
        a.second_half,
        a.model.session_options(&pool),
        |d, _| pb.set_position(d as u64),
    )?;
    pb.finish_and_clear();
    if r.n_scored == 0 {
        bail!(
            "no token was scored: the second half of a --ctx {} window holds no token to predict; use --ctx 3 or more",
            r.ctx
        );
    }
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
