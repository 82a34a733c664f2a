//! `backburner worker`: the worker daemon.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use backburner_engine::{Worker, WorkerOptions};
use clap::Args;

use crate::{default_model, thread_count};

/// Worker options.
#[derive(Args)]
pub struct WorkerArgs {
    /// Address to listen on. Any non-loopback address needs --allow-remote and a shared secret.
    #[arg(long, default_value = "127.0.0.1:50060")]
    listen: String,
    /// Allow listening on a non-loopback address (requires a secret).
    #[arg(long)]
    allow_remote: bool,
    /// Checkpoint directory or GGUF file (the same model as the host's: the handshake compares fingerprints of the
    /// layers' names, types, shapes and bytes). Default: the bundled model.
    #[arg(short = 'm', long)]
    model: Option<PathBuf>,
    /// Layer range to serve, `a..b`: the tail `L..n` for split prefill, any range for a layer split (default: what
    /// the host's handshake asks for).
    #[arg(long)]
    layers: Option<String>,
    /// Compute threads (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Arithmetic of products against bf16 weights, as the hosts' `--precision` (f32 or bf16): it must be theirs,
    /// which the handshake checks (a different one is a model mismatch).
    #[arg(long, default_value = "f32", value_parser = crate::parse_precision)]
    precision: backburner_model::Precision,
    /// Most bytes the worker holds: the weights of the layers, or the routed experts (`--expert-split` hosts), it
    /// serves (reserved before they are loaded; a range whose weights do not fit is refused) plus the session state (KV rows, recurrent
    /// states, offloaded KV pages) and request buffers of all sessions together; default half the machine's memory.
    /// Units: K/KiB, M/MiB, G/GiB (binary), KB, MB, GB (decimal).
    #[arg(long)]
    max_memory: Option<String>,
    /// Most host sessions served at once; more get a Busy error and run locally.
    #[arg(long, default_value_t = 8)]
    max_sessions: usize,
    /// Most tokens per ubatch a host may send (bounds one request's compute); hosts with a larger --ubatch run
    /// locally.
    #[arg(long, default_value_t = 4096)]
    max_ubatch: usize,
    /// File holding the shared secret (or set BACKBURNER_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Seconds a connected host may stay silent before the worker drops it.
    #[arg(long, default_value_t = 600)]
    idle_timeout: u64,
    /// Keep the KV pages hosts offload here as received instead of re-laying them (in a background thread) into
    /// the attention kernel's faster layout; same results either way.
    #[arg(long)]
    no_pack_pages: bool,
    #[command(flatten)]
    device: crate::device_args::DeviceArgs,
    /// Test fault injection: exit the process on the Nth frame after a handshake.
    #[arg(long, hide = true)]
    exit_after_frames: Option<usize>,
}

/// Parses `a..b`.
pub fn parse_range(s: &str) -> Result<std::ops::Range<usize>> {
    let (a, b) = s
        .split_once("..")
        .with_context(|| format!("--layers {s:?}: expected a..b, e.g. 4..8"))?;
    let a: usize = a
        .trim()
        .parse()
        .with_context(|| format!("--layers {s:?}: {a:?} is not a layer index"))?;
    let b: usize = b
        .trim()
        .parse()
        .with_context(|| format!("--layers {s:?}: {b:?} is not a layer index"))?;
    if a >= b {
        bail!("--layers {s:?}: the range is empty");
    }
    Ok(a..b)
}

/// Checks a worker address given to `--worker`: `HOST:PORT` (an IPv6 address in brackets, `[::1]:50060`) with a port
/// in 1..=65535 and a host that resolves. Returns it unchanged; the error is the message of clap's usage error.
pub fn parse_worker_addr(s: &str) -> std::result::Result<String, String> {
    let example = "expected HOST:PORT, e.g. 127.0.0.1:50060 (the worker's default)";
    let Some((host, port)) = s.rsplit_once(':') else {
        return Err(format!("no port; {example}"));
    };
    if host.is_empty() {
        return Err(format!("no host; {example}"));
    }
    if host.contains(':') && !(host.starts_with('[') && host.ends_with(']')) {
        return Err(format!("an IPv6 address needs brackets: [{host}]:{port}"));
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => {}
        _ => return Err(format!("{port:?} is not a port (1 to 65535)")),
    }
    match s.to_socket_addrs().map(|mut a| a.next()) {
        Ok(Some(_)) => Ok(s.to_string()),
        Ok(None) => Err(format!("host {host:?} has no address")),
        Err(e) => Err(format!("cannot resolve host {host:?}: {e}")),
    }
}

/// A byte count for people: `512 B`, `1.5 KiB`, `64.0 MiB`, `31.2 GiB`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if b < 1024 {
        return format!("{b} B");
    }
    let mut v = b as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Parses a byte size (`backburner_engine::offload::parse_bytes`: 8G, 8GiB, 512M, 512MiB, 4096).
pub fn parse_bytes(s: &str) -> Result<u64> {
    backburner_engine::offload::parse_bytes(s).map_err(anyhow::Error::msg)
}

/// Reads the shared secret from `--secret-file` or `BACKBURNER_SECRET` (file wins).
pub fn read_secret(file: Option<&PathBuf>) -> Result<Option<Vec<u8>>> {
    if let Some(f) = file {
        let s = backburner_link::auth::read_secret_file(f)
            .with_context(|| format!("read secret file {}", f.display()))?;
        return Ok(Some(s));
    }
    match std::env::var("BACKBURNER_SECRET") {
        Ok(s) if !s.trim().is_empty() => Ok(Some(s.trim().as_bytes().to_vec())),
        _ => Ok(None),
    }
}

/// Runs the daemon until SIGINT/SIGTERM.
pub fn run(a: WorkerArgs) -> Result<()> {
    a.device.refuse(
        "a worker (the layers and KV pages it serves run on the CPU path; a host's own layers go on a device with \
         the host's --device)",
    )?;
    let threads = thread_count(a.threads)?;
    let addr: SocketAddr = a
        .listen
        .parse()
        .with_context(|| format!("--listen {:?}: expected IP:PORT", a.listen))?;
    let secret = read_secret(a.secret_file.as_ref())?;
    if !addr.ip().is_loopback() {
        if !a.allow_remote {
            bail!("--listen {addr} is not a loopback address: pass --allow-remote (and a shared secret) to listen on it");
        }
        if secret.is_none() {
            bail!(
                "listening on {addr} needs a shared secret: --secret-file F or BACKBURNER_SECRET"
            );
        }
    }
    let layers = a.layers.as_deref().map(parse_range).transpose()?;
    let model_dir = match a.model {
        Some(d) => d,
        None => default_model::ensure()?,
    };
    let max_memory = match a.max_memory.as_deref() {
        Some(m) => parse_bytes(m)?,
        None => backburner_engine::worker::default_max_memory(),
    };
    let ram = backburner_engine::worker::default_max_memory().saturating_mul(2);
    if max_memory > ram {
        eprintln!(
            "warning: --max-memory {} is more than this machine's {} of memory: the system, not the worker, will run out",
            human_bytes(max_memory),
            human_bytes(ram)
        );
    }
    if max_memory == 0 {
        bail!(
            "--max-memory 0: the worker needs memory for its weights and session state (e.g. 2G)"
        );
    }
    if a.max_sessions == 0 || a.max_ubatch == 0 {
        bail!("--max-sessions and --max-ubatch must be at least 1");
    }
    let mut opts = WorkerOptions::new(model_dir.clone());
    opts.layers = layers.clone();
    opts.threads = threads;
    opts.max_memory = max_memory;
    opts.secret = secret;
    opts.idle_timeout = Duration::from_secs(a.idle_timeout.max(1));
    opts.max_sessions = a.max_sessions;
    opts.max_ubatch = a.max_ubatch;
    opts.exit_after_frames = a.exit_after_frames;
    opts.pack_pages = !a.no_pack_pages;
    opts.precision = a.precision;
    let worker = Worker::bind(&addr.to_string(), opts)?;
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    ctrlc::set_handler(move || s2.store(true, Ordering::Relaxed))
        .context("install the SIGINT/SIGTERM handler")?;
    let weights = worker.weight_bytes();
    eprintln!(
        "backburner worker listening on {} (model {}, layers {}, {threads} thread{}, {} for weights, state and KV pages{})",
        worker.local_addr(),
        model_dir.display(),
        layers
            .map(|r| format!("{}..{}", r.start, r.end))
            .unwrap_or_else(|| "from the host".into()),
        if threads == 1 { "" } else { "s" },
        human_bytes(max_memory),
        if weights > 0 {
            format!(", weights {} of it", human_bytes(weights))
        } else {
            String::new()
        }
    );
    worker.serve(stop);
    eprintln!("backburner worker: shut down");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_addresses_need_a_host_and_a_port() {
        assert_eq!(
            parse_worker_addr("127.0.0.1:50060").as_deref(),
            Ok("127.0.0.1:50060")
        );
        assert_eq!(
            parse_worker_addr("localhost:7").as_deref(),
            Ok("localhost:7")
        );
        assert_eq!(
            parse_worker_addr("[::1]:50060").as_deref(),
            Ok("[::1]:50060")
        );
        let err = |s: &str| parse_worker_addr(s).unwrap_err();
        assert!(err("localhost").contains("no port"), "{}", err("localhost"));
        assert!(err(":50060").contains("no host"));
        assert!(err("nonsense:99999").contains("\"99999\" is not a port"));
        assert!(err("host:0").contains("\"0\" is not a port"));
        assert!(err("::1:50060").contains("brackets"));
    }
}
