//! `backburner bench seed-table`: the original write-up's table (zero to one, long-context prefill local vs split,
//! decode at a long context with KV pages on a worker, an agent session's time to first answer) measured here on
//! files of the 27B's per-layer shapes, each row beside llama.cpp's figure on the same file where llama.cpp can do it
//! (its RPC backend for the split rows), in alternating rounds (ours, then llama.cpp's, round by round; medians).
//!
//! Each row runs this binary's own benches as child processes (`bench layer-split --no-local`, `bench
//! split-prefill`, `bench decode-offload`, `bench session`) and, with `--llama-cpp`, `llama-bench` with and without a
//! `ggml-rpc-server`. Every run's JSON lands in `--out` (a run whose file is there already is not repeated, so an
//! interrupted table resumes); the table (`seed-table.md`), its data (`seed-table.json`) and one plot per row
//! (`<row>.svg`) are written from them.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use backburner_kernels::kv::KvDtype;
use clap::{Args, ValueEnum};
use serde_json::Value;

mod llama;
mod report;
mod rows;
mod svg;

pub(crate) use report::{Line, RowReport};

/// Options.
#[derive(Args)]
pub struct SeedArgs {
    /// Folder for every run's JSON, the table (seed-table.md, seed-table.json) and the plots (<row>.svg).
    #[arg(long)]
    out: PathBuf,
    /// Rows to run, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "zero-to-one,long-prefill,offload-decode,session"
    )]
    rows: Vec<Row>,
    /// Alternating rounds per row (ours, then llama.cpp's); medians are reported.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// A llama.cpp build's binary folder (holding llama-bench and ggml-rpc-server): its figure on the same file is
    /// run beside ours where it has one (local, and split over its RPC backend).
    #[arg(long, value_name = "DIR")]
    llama_cpp: Option<PathBuf>,
    /// Host threads (ours and llama.cpp's).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Threads of the worker process (ours) and of the ggml-rpc-server (llama.cpp's).
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    /// Only write the table and plots from the runs already in --out.
    #[arg(long)]
    report_only: bool,
    #[command(flatten)]
    z2o: ZeroToOne,
    #[command(flatten)]
    prefill: LongPrefill,
    #[command(flatten)]
    offload: OffloadDecode,
    #[command(flatten)]
    session: SessionRow,
}

/// The table's rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Row {
    /// The whole model on a host whose --max-memory cannot hold it, plus one worker (a layer split).
    ZeroToOne,
    /// Long-context prefill, local vs split prefill with a worker.
    LongPrefill,
    /// Decode at a long context, the whole KV cache on the host vs half of its pages on a worker.
    OffloadDecode,
    /// Time to the first answer of the agent session's last (longest) turn, alone vs with a worker.
    Session,
}

impl Row {
    /// The row's file-name stem.
    pub fn stem(self) -> &'static str {
        match self {
            Row::ZeroToOne => "zero-to-one",
            Row::LongPrefill => "long-prefill",
            Row::OffloadDecode => "offload-decode",
            Row::Session => "session",
        }
    }
}

/// Zero to one.
#[derive(Args)]
pub(crate) struct ZeroToOne {
    /// GGUF file of the zero-to-one row (the seed's: the 64-layer 27B as IQ2_XS).
    #[arg(long = "z2o-model", id = "z2o-model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// The host's --max-memory in that row (must be below the model's size).
    #[arg(long = "z2o-host-memory", default_value = "6GB", value_name = "BYTES")]
    pub host_memory: String,
    /// First worker layer (default: half the layers).
    #[arg(long = "z2o-layer-split", value_name = "L")]
    pub layer_split: Option<usize>,
    /// Prompt tokens prefilled in that row.
    #[arg(long = "z2o-prompt-tokens", default_value_t = 64)]
    pub prompt_tokens: usize,
    /// Tokens decoded in that row.
    #[arg(long = "z2o-decode-tokens", default_value_t = 8)]
    pub decode_tokens: usize,
}

/// Long-context prefill.
#[derive(Args)]
pub(crate) struct LongPrefill {
    /// GGUF files of the long-prefill row, comma-separated (e.g. a bf16 and a Q4_K_M file of the 27B's per-layer
    /// shapes with a few layers).
    #[arg(
        long = "prefill-models",
        value_delimiter = ',',
        value_name = "FILE,..."
    )]
    pub models: Vec<PathBuf>,
    /// Prompt lengths of that row (tokens, each from an empty context).
    #[arg(
        long = "prefill-depths",
        value_delimiter = ',',
        default_value = "16384,32768,49152"
    )]
    pub depths: Vec<usize>,
    /// llama.cpp's runs in that row: `local` (its single-node prefill) and/or `rpc` (its split over a
    /// ggml-rpc-server, the row's target). Its single-thread prefill at 16k positions takes about half an hour at
    /// the 27B's shapes with 8 layers here, so `rpc` alone keeps a row short.
    #[arg(
        long = "prefill-llama",
        value_delimiter = ',',
        default_value = "local,rpc"
    )]
    pub llama_runs: Vec<LlamaRun>,
    /// --precision of our runs on bf16/f16 weights (llama.cpp computes them with bf16/f16 activations).
    #[arg(long = "prefill-precision", default_value = "bf16")]
    pub precision: String,
    /// KV cache dtype of that row, ours (`--kv-dtype`) and llama.cpp's (`-ctk`, `-ctv`): f16, bf16 or f32.
    #[arg(long = "prefill-kv", default_value = "f16")]
    pub kv: KvDtype,
}

/// A llama.cpp configuration of the long-prefill row.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LlamaRun {
    /// Every layer on the host.
    Local,
    /// The worker's layers on a ggml-rpc-server.
    Rpc,
}

/// Decode with KV pages on a worker.
#[derive(Args)]
pub(crate) struct OffloadDecode {
    /// GGUF file of the offload-decode row.
    #[arg(long = "offload-model", id = "offload-model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// Context depth (positions) decoded at.
    #[arg(long = "offload-depth", default_value_t = 140_000)]
    pub depth: usize,
    /// KV page size (positions) of that row; the depth must hold four pages.
    #[arg(long = "offload-page-size", default_value_t = 4096)]
    pub page_size: usize,
}

/// The agent session.
#[derive(Args)]
pub(crate) struct SessionRow {
    /// GGUF file of the session row (with the Qwen3.5 tokenizer and chat template: `bench gen-gguf --tokenizer
    /// qwen35`).
    #[arg(long = "session-model", id = "session-model", value_name = "FILE")]
    pub model: Option<PathBuf>,
    /// The turn measured cold (0-based; the shipped transcript's last, 19, is its longest: about 27k tokens).
    #[arg(long = "session-turn", default_value_t = 19)]
    pub turn: usize,
}

/// Where a row's runs go and how they are made.
pub(crate) struct Runner<'a> {
    pub a: &'a SeedArgs,
    pub llama: Option<llama::Llama>,
}

impl Runner<'_> {
    /// The JSON of run `name` (a file in --out): read if there, else made by `make` and written.
    pub fn cached(&self, name: &str, make: impl FnOnce() -> Result<Value>) -> Result<Value> {
        let path = self.a.out.join(format!("{name}.json"));
        if path.exists() {
            let text = std::fs::read_to_string(&path)?;
            return serde_json::from_str(&text).with_context(|| format!("{}", path.display()));
        }
        if self.a.report_only {
            bail!("{} is missing (--report-only)", path.display());
        }
        eprintln!("seed-table: {name}");
        let v = make()?;
        std::fs::write(&path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(v)
    }

    /// The rounds of the row whose runs are named `{prefix}-ours-{k}`: `--rounds`, or with `--report-only` as
    /// many as are in --out (rows may have run with different `--rounds`).
    pub fn rounds(&self, prefix: &str) -> usize {
        if !self.a.report_only {
            return self.a.rounds;
        }
        let n = (0..)
            .take_while(|k| self.a.out.join(format!("{prefix}-ours-{k}.json")).exists())
            .count();
        if n == 0 {
            eprintln!(
                "warning: no runs named {prefix}-ours-*.json in {}",
                self.a.out.display()
            );
        }
        n
    }

    /// llama.cpp's run `name`: read from --out if there (also with `--report-only` and without `--llama-cpp`), else
    /// made by `make` with the build of `--llama-cpp` and written; None without either.
    pub fn theirs(
        &self,
        name: &str,
        make: impl FnOnce(&llama::Llama) -> Result<Value>,
    ) -> Result<Option<Value>> {
        let there = self.a.out.join(format!("{name}.json")).exists();
        match &self.llama {
            Some(ll) if !there && !self.a.report_only => self.cached(name, || make(ll)).map(Some),
            _ if there => self
                .cached(name, || bail!("{name}.json vanished from --out"))
                .map(Some),
            _ => Ok(None),
        }
    }

    /// Runs this binary's `bench` with `args` (its progress on stderr) and returns its standard output. The
    /// binary must stay in place while the row runs: the benches start their worker processes from its path.
    fn bench(&self, args: &[String]) -> Result<Vec<u8>> {
        let exe = std::env::current_exe().context("locate the backburner binary")?;
        let out = Command::new(exe)
            .arg("bench")
            .args(args)
            .stderr(Stdio::inherit())
            .output()
            .context("start the bench")?;
        if !out.status.success() {
            bail!(
                "`backburner bench {}` failed ({})",
                args.join(" "),
                out.status
            );
        }
        Ok(out.stdout)
    }

    /// Runs this binary's `bench` with `args` and parses its standard output as JSON.
    pub fn ours(&self, args: &[String]) -> Result<Value> {
        serde_json::from_slice(&self.bench(args)?).context("the bench's JSON")
    }

    /// Runs this binary's `bench` with `args`, which write their JSON to `file` (their table on stdout, dropped),
    /// and reads it.
    pub fn ours_to_file(&self, args: &[String], file: &Path) -> Result<Value> {
        self.bench(args)?;
        let text = std::fs::read_to_string(file).with_context(|| format!("{}", file.display()))?;
        serde_json::from_str(&text).context("the bench's JSON")
    }

    /// The common options of our runs: threads and worker threads.
    pub fn threads(&self) -> Vec<String> {
        vec![
            "--threads".into(),
            self.a.threads.to_string(),
            "--worker-threads".into(),
            self.a.worker_threads.to_string(),
        ]
    }
}

/// A path as an argument.
pub(crate) fn arg(p: &Path) -> String {
    p.display().to_string()
}

/// Runs the table.
pub fn run(a: SeedArgs) -> Result<()> {
    if a.rounds == 0 || a.threads == 0 || a.worker_threads == 0 {
        bail!("--rounds, --threads and --worker-threads must be ≥ 1");
    }
    std::fs::create_dir_all(&a.out).with_context(|| format!("create {}", a.out.display()))?;
    let llama = match &a.llama_cpp {
        Some(dir) => Some(llama::Llama::new(dir, a.threads, a.worker_threads)?),
        None => None,
    };
    let r = Runner { a: &a, llama };
    let mut reports = Vec::new();
    for row in &a.rows {
        let rep = match row {
            Row::ZeroToOne => rows::zero_to_one(&r)?,
            Row::LongPrefill => rows::long_prefill(&r)?,
            Row::OffloadDecode => rows::offload_decode(&r)?,
            Row::Session => rows::session(&r)?,
        };
        std::fs::write(a.out.join(format!("{}.svg", row.stem())), svg::plot(&rep))?;
        reports.push(rep);
    }
    let md = report::markdown(&reports);
    std::fs::write(a.out.join("seed-table.md"), &md)?;
    std::fs::write(
        a.out.join("seed-table.json"),
        serde_json::to_string_pretty(&report::json(&reports))? + "\n",
    )?;
    println!("{md}");
    Ok(())
}
