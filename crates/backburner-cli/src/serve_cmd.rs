//! `backburner serve`: the OpenAI-compatible HTTP server (`backburner-server`) over parallel slots, with the run
//! command's placement flags (workers for split prefill, KV offload, layer split), configurable by flags or a TOML
//! file (`--config`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use backburner_engine::serve::{CacheLimits, Engine, ServeOptions};
use backburner_server::AppState;
use clap::Args;

use crate::{compute_pool, LinkArgs, ModelArgs};

#[derive(Args)]
#[command(args_override_self = true)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// A TOML file of these options (keys are the long flag names, `port = 8080`, `worker = ["a:1", "b:2"]`);
    /// flags on the command line win over the file.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port; the one chosen is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences served at once, each in its own slot (own KV cache and recurrent state); their decode steps run
    /// as one batch.
    #[arg(long, default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free slot; beyond it the server answers 503 with Retry-After (0: no queue, a
    /// request that finds every slot busy gets the 503 at once).
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Seconds between health pings to the workers while the server is idle: `/health` turns `degraded` when a
    /// required worker stops answering, and `ok` again when it is back.
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub worker_ping: f64,
    /// Require `Authorization: Bearer KEY` on /v1 requests.
    #[arg(long, value_name = "KEY", conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from a file (first line).
    #[arg(long, value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// The model's name in the API (default: the model directory's name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Recurrent-state checkpoints kept per slot for the prompt cache (0 = reuse only exact extensions of a slot's
    /// history).
    #[arg(long, default_value_t = 16)]
    pub cache_checkpoints: usize,
    /// Most bytes of checkpoints per slot (units as --max-memory).
    #[arg(long, value_name = "BYTES", default_value = "512MiB", value_parser = backburner_engine::offload::parse_bytes)]
    pub cache_bytes: u64,
    /// Let browser pages from this origin call the API (CORS; repeatable, e.g. `http://localhost:3000`; `*`: any
    /// origin). Default: no CORS headers, so pages from other origins cannot read the answers.
    #[arg(long, value_name = "ORIGIN")]
    pub cors_origin: Vec<String>,
    /// Turn off `GET /slots` (what each slot is doing; it answers 501 then), as llama-server's `--no-slots`.
    #[arg(long)]
    pub no_slots: bool,
    /// Seconds running requests get to finish on Ctrl-C / SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 10.0)]
    pub grace: f64,
    #[command(flatten)]
    pub spec: crate::spec_args::SpecArgs,
    #[command(flatten)]
    pub link: LinkArgs,
}

/// Runs `backburner serve` until Ctrl-C or SIGTERM.
pub(crate) fn run(a: ServeArgs) -> Result<()> {
    let spec = a.spec.spec != crate::spec_args::SpecKind::None;
    let backend = a
        .model
        .device
        .open_for_serving("serve", a.link.splits_layers(), spec)?;
    crate::device_args::note_idle_workers(&a.model, &a.link);
    if a.parallel == 0 || a.parallel > 256 {
        bail!("--parallel must be in 1..=256");
    }
    if !a.grace.is_finite() || a.grace < 0.0 {
        bail!("--grace must be a number of seconds ≥ 0");
    }
    if !a.worker_ping.is_finite() || a.worker_ping < 0.05 || a.worker_ping > 86_400.0 {
        bail!("--worker-ping must be a number of seconds in [0.05, 86400]");
    }
    let api_key = match (&a.api_key, &a.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(f)) => {
            let t = backburner_model::fsutil::read_text(f, 4096)
                .with_context(|| format!("reading --api-key-file {}", f.display()))?;
            Some(t.lines().next().unwrap_or("").trim().to_string())
        }
        (None, None) => None,
    };
    if api_key.as_deref() == Some("") {
        bail!("the API key is empty");
    }
    let pool = compute_pool(a.model.threads)?;
    let mut model_args = a.model.clone();
    model_args.mtp = a.spec.wants_mtp();
    let placed = crate::placement::load_placed(&model_args, &a.link, &pool, backend, a.parallel)?;
    let model_id = a.alias.clone().unwrap_or_else(|| {
        placed
            .dir
            .file_name()
            .map_or("model".into(), |n| n.to_string_lossy().into_owned())
    });
    let mut sessions = Vec::new();
    for _ in 0..a.parallel {
        // each slot its own connections to the workers
        let mut s = placed.host.session()?;
        a.spec.enable(&mut s)?;
        sessions.push(s);
    }
    let context_length = sessions[0].context_length();
    let eos_ids = match &placed.tokenizer {
        Some(t) => t.eos_ids().to_vec(),
        None => placed.host.model.config().eos_token_ids.clone(),
    };
    let tokenizer = placed.tokenizer.map(Arc::new);
    let opts = ServeOptions {
        queue: a.queue,
        cache: CacheLimits {
            max_checkpoints: a.cache_checkpoints,
            max_bytes: usize::try_from(a.cache_bytes).unwrap_or(usize::MAX),
        },
        ping_every: std::time::Duration::from_secs_f64(a.worker_ping),
    };
    let engine = Arc::new(Engine::start(sessions, tokenizer.clone(), opts)?);
    let mut state = AppState::new(
        engine,
        tokenizer,
        model_id.clone(),
        context_length,
        eos_ids,
        api_key,
    );
    for o in &a.cors_origin {
        let origin = (o.starts_with("http://") || o.starts_with("https://"))
            && !o.ends_with('/')
            && o.bytes().all(|c| c.is_ascii_graphic());
        if o != "*" && !origin {
            bail!("--cors-origin {o:?} is not an origin (scheme://host[:port] without a path, e.g. http://localhost:3000; or *)");
        }
    }
    state.cors_origins = a.cors_origin.clone();
    state.slots_endpoint = !a.no_slots;
    state.spec = a.spec.params()?;
    let state = Arc::new(state);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let grace = Duration::from_secs_f64(a.grace);
    rt.block_on(async move {
        let addr = format!("{}:{}", a.host, a.port);
        let keyed = state.api_key.is_some();
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local: SocketAddr = listener.local_addr()?;
        if !local.ip().is_loopback() && !keyed {
            eprintln!(
                "warning: serving on {local}, which is not a loopback address, without --api-key: anyone who can \
                 reach it can use the model"
            );
        }
        eprintln!(
            "serving {model_id} on http://{local} ({} slot{}, context {context_length} tokens)",
            a.parallel,
            if a.parallel == 1 { "" } else { "s" }
        );
        // a line of its own: scripts and tests read the address from the one above
        eprintln!("chat page: http://{local}/ (the OpenAI API under http://{local}/v1)");
        backburner_server::serve(listener, state, shutdown_signal(), grace)
            .await
            .context("serving")
    })
}

/// Resolves on Ctrl-C or SIGTERM, the start of a graceful shutdown; a second one while the server drains exits the
/// process at once (status 130 for Ctrl-C, 143 for SIGTERM, as a shell reports a process those signals killed).
async fn shutdown_signal() {
    let first = next_signal().await;
    eprintln!("{first}: shutting down (again to exit at once)");
    tokio::spawn(async {
        let (what, code) = match next_signal().await {
            "SIGTERM" => ("SIGTERM", 143),
            other => (other, 130),
        };
        eprintln!("{what} again: exiting without waiting for running requests");
        std::process::exit(code);
    });
}

/// Waits for the next Ctrl-C or SIGTERM and names it (`"Ctrl-C"`, `"SIGTERM"`).
async fn next_signal() -> &'static str {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => "Ctrl-C",
        _ = term => "SIGTERM",
    }
}

/// The command line with `serve --config FILE`'s options inserted before the given ones (so the given ones win):
/// each TOML key `k` becomes `--k` (underscores as dashes) with its value; `true` is the bare flag, `false` is
/// left out, an array repeats the flag. A key is left out when the command line gives its flag (a list such as
/// `--worker` replaces the file's, not adds to it) or a flag that conflicts with it (`--api-key-file` over the
/// file's `api_key`). Other command lines come back unchanged.
///
/// Errors: an unreadable file, TOML that does not parse, a nested table, a value that is not a string, number,
/// boolean or array of those.
pub(crate) fn expand_config(args: Vec<String>) -> Result<Vec<String>> {
    if args.get(1).map(String::as_str) != Some("serve") {
        return Ok(args);
    }
    let mut path = None;
    for (i, x) in args.iter().enumerate() {
        if let Some(p) = x.strip_prefix("--config=") {
            path = Some(p.to_string());
        } else if x == "--config" {
            path = args.get(i + 1).cloned();
        }
    }
    let Some(path) = path else {
        return Ok(args);
    };
    let text = backburner_model::fsutil::read_text(std::path::Path::new(&path), 1 << 20)
        .with_context(|| format!("reading --config {path}"))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {path} is not valid TOML"))?;
    let given = given_flags(&args[2..]);
    let cmd = <ServeArgs as Args>::augment_args(clap::Command::new("serve"));
    let mut out = vec![args[0].clone(), args[1].clone()];
    for (k, v) in &table {
        let name = k.replace('_', "-");
        if overridden(&cmd, &given, &name) {
            continue;
        }
        let flag = format!("--{name}");
        let scalar = |v: &toml::Value| -> Result<String> {
            Ok(match v {
                toml::Value::String(s) => s.clone(),
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Float(f) => f.to_string(),
                _ => bail!("--config {path}: `{k}` must be a string, a number, a boolean or an array of those"),
            })
        };
        match v {
            toml::Value::Boolean(true) => out.push(flag),
            toml::Value::Boolean(false) => {}
            toml::Value::Array(items) => {
                for it in items {
                    out.push(flag.clone());
                    out.push(scalar(it)?);
                }
            }
            other => {
                out.push(flag);
                out.push(scalar(other)?);
            }
        }
    }
    out.extend(args[2..].iter().cloned());
    Ok(out)
}

/// The long flags on a command line (`--name` or `--name=value`; none after a bare `--`), without the dashes.
fn given_flags(args: &[String]) -> Vec<String> {
    args.iter()
        .take_while(|a| *a != "--")
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_string())
        .collect()
}

/// Whether the config file's flag `--name` yields to the command line: the command line gives it, or a flag that
/// conflicts with it (either way round).
fn overridden(cmd: &clap::Command, given: &[String], name: &str) -> bool {
    if given.iter().any(|g| g == name) {
        return true;
    }
    let find = |n: &str| cmd.get_arguments().find(|a| a.get_long() == Some(n));
    let Some(arg) = find(name) else {
        return false; // not a flag of `serve`: clap says so
    };
    given.iter().filter_map(|g| find(g)).any(|g| {
        cmd.get_arg_conflicts_with(arg)
            .iter()
            .chain(cmd.get_arg_conflicts_with(g).iter())
            .any(|c| c.get_id() == arg.get_id() || c.get_id() == g.get_id())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(file: &str, line: &[&str]) -> Vec<String> {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("c.toml");
        std::fs::write(&f, file).unwrap();
        let mut args = vec!["bb".to_string(), "serve".into(), "--config".into()];
        args.push(f.to_str().unwrap().into());
        args.extend(line.iter().map(|s| s.to_string()));
        let out = expand_config(args).unwrap();
        // leave out the program, the subcommand and `--config FILE`
        out[2..]
            .iter()
            .filter(|a| *a != "--config" && !a.ends_with("c.toml"))
            .cloned()
            .collect()
    }

    #[test]
    fn the_file_gives_flags_before_the_command_line() {
        assert_eq!(
            expand(
                "port = 0\nalias = \"m\"\nno_interleave = true\nworker = [\"a:1\", \"b:2\"]\n",
                &["--parallel", "2"]
            ),
            [
                "--alias",
                "m",
                "--no-interleave",
                "--port",
                "0",
                "--worker",
                "a:1",
                "--worker",
                "b:2",
                "--parallel",
                "2"
            ]
        );
    }

    #[test]
    fn a_flag_on_the_command_line_replaces_the_files_and_its_conflicting_ones() {
        // the same flag: a list is replaced, not extended
        assert_eq!(
            expand(
                "worker = [\"a:1\", \"b:2\"]\nport = 1\n",
                &["--worker", "c:3", "--port=2"]
            ),
            ["--worker", "c:3", "--port=2"]
        );
        // conflicting flags, both ways round
        assert_eq!(
            expand("api_key = \"k\"\n", &["--api-key-file", "f"]),
            ["--api-key-file", "f"]
        );
        assert_eq!(
            expand("api_key_file = \"f\"\n", &["--api-key", "k"]),
            ["--api-key", "k"]
        );
        assert_eq!(
            expand(
                "split_layer = 4\nkv_budget = \"1MiB\"\n",
                &["--layer-split", "4"]
            ),
            ["--layer-split", "4"]
        );
        // an unknown key still reaches clap, which names it
        assert_eq!(expand("bogus = 1\n", &[]), ["--bogus", "1"]);
    }
}
