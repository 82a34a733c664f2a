//! `backburner calibrate`: measure the host's and each worker's per-layer speed and the link, for `plan
//! --calibration`. Each side loads only one layer cycle, so a host that cannot hold the model can be calibrated.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backburner_engine::chain::calibrate::{time_host_layers, time_worker};
use backburner_engine::connection::Connection;
use backburner_engine::plan::{Calibration, DeviceTimes, LinkTimes};
use backburner_engine::WorkerSettings;
use clap::Args;

use crate::worker_cmd;

/// `backburner calibrate`.
#[derive(Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    model: crate::ModelArgs,
    /// A worker to measure (repeatable, in chain order); it loads the first layer cycle for the measurement.
    #[arg(long, value_parser = worker_cmd::parse_worker_addr)]
    worker: Vec<String>,
    /// File holding the shared secret of the workers (or set BACKBURNER_SECRET).
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// Where to write the calibration JSON.
    #[arg(long)]
    out: PathBuf,
    /// Decode steps to time.
    #[arg(long, default_value_t = 16)]
    decode_tokens: usize,
}

/// Runs `backburner calibrate`: on the host, one prefill ubatch (at most `--ubatch` and 512 tokens) and
/// `--decode-tokens` decode steps through the first layer cycle (the only layers loaded), and the ends (embedding,
/// final norm, head) timed apart; on each `--worker`, the same through a layer-split session holding that cycle,
/// from the worker's own compute reports, and the link's round trip and bandwidth.
pub fn calibrate(a: CalibrateArgs) -> Result<()> {
    a.model
        .device
        .refuse("calibrate (it times the CPU path's layers for `plan --calibration`)")?;
    if a.decode_tokens == 0 {
        bail!("--decode-tokens must be ≥ 1");
    }
    if a.model.ubatch == 0 {
        bail!("--ubatch must be ≥ 1 (the prefill ubatch timed is min(--ubatch, 512) tokens)");
    }
    for (i, w) in a.worker.iter().enumerate() {
        if a.worker[..i].contains(w) {
            bail!("--worker {w} is given twice");
        }
    }
    // the output is opened first, so an unwritable path fails before minutes of measuring
    let mut out =
        std::fs::File::create(&a.out).with_context(|| format!("create {}", a.out.display()))?;
    let threads = crate::thread_count(a.model.threads)?;
    let pool = crate::compute_pool(a.model.threads)?;
    let dir = match &a.model.model {
        Some(d) => d.clone(),
        None => crate::default_model::ensure()?,
    };
    let cfg = backburner_model::ModelConfig::from_dir(&dir)?;
    let k = cfg.full_attention_interval.clamp(1, cfg.num_hidden_layers);
    let loaded = crate::load_host(&a.model, &pool, Some(k))?;
    let model = loaded.model.clone();
    let kv = a.model.session_options(&pool).kv;
    let t = a.model.ubatch.clamp(1, 512);
    let host = time_host_layers(&model, 0..k, t, a.decode_tokens, kv, &pool)?;
    let ids: Vec<u32> = (0..t as u32)
        .map(|i| (i * 7919) % cfg.vocab_size as u32)
        .collect();
    let (embed_us, head_us) = time_ends(&model, &ids, &pool)?;
    let secret = worker_cmd::read_secret(a.secret_file.as_ref())?.unwrap_or_default();
    let mut workers = Vec::new();
    let mut link: Option<LinkTimes> = None;
    for addr in &a.worker {
        let mut st = WorkerSettings::new(addr.clone(), threads);
        st.secret = secret.clone();
        st.timeout = Duration::from_secs(60);
        let fp = backburner_engine::split::dir_fingerprint_with(dir.clone(), a.model.precision);
        let conn = Connection::new(st, fp);
        let w = time_worker(&model, conn, 0..k, t, a.decode_tokens, kv, &pool)
            .with_context(|| format!("calibrating worker {addr}"))?;
        eprintln!(
            "worker {addr}: prefill {:.2} µs/token/layer, decode {:.1} µs/layer ({} thread{}); link round trip {:.0} µs, {:.0} MB/s",
            w.layers.prefill_us_per_token_layer,
            w.layers.decode_us_per_layer,
            w.threads,
            if w.threads == 1 { "" } else { "s" },
            w.round_trip_us,
            w.bytes_per_s / 1e6
        );
        workers.push(DeviceTimes {
            threads: w.threads,
            prefill_us_per_token_layer: w.layers.prefill_us_per_token_layer,
            decode_us_per_layer: w.layers.decode_us_per_layer,
            ends_prefill_us_per_token: 0.0,
            ends_decode_us: 0.0,
            prefill_tokens: t,
        });
        // the plan takes one link: the slowest measured
        let this = LinkTimes {
            round_trip_us: w.round_trip_us,
            bytes_per_s: w.bytes_per_s,
        };
        link = Some(match link {
            Some(l) if l.round_trip_us >= this.round_trip_us => l,
            _ => this,
        });
    }
    let cal = Calibration {
        version: 1,
        model: format!("{} ({} layers)", dir.display(), cfg.num_hidden_layers),
        layers: cfg.num_hidden_layers,
        hidden: cfg.hidden_size,
        host: DeviceTimes {
            threads,
            prefill_us_per_token_layer: host.prefill_us_per_token_layer,
            decode_us_per_layer: host.decode_us_per_layer,
            ends_prefill_us_per_token: embed_us + head_us / t as f64,
            ends_decode_us: embed_us + head_us,
            prefill_tokens: t,
        },
        workers,
        link,
    };
    let text = serde_json::to_string_pretty(&cal)?;
    use std::io::Write;
    out.write_all((text + "\n").as_bytes())
        .with_context(|| format!("write {}", a.out.display()))?;
    eprintln!(
        "host: prefill {:.2} µs/token/layer ({t} tokens), decode {:.1} µs/layer; written to {}",
        cal.host.prefill_us_per_token_layer,
        cal.host.decode_us_per_layer,
        a.out.display()
    );
    Ok(())
}

/// (embedding µs per token, final norm + head µs for one row), each the best of three.
fn time_ends(
    model: &Arc<backburner_model::Model>,
    ids: &[u32],
    pool: &backburner_engine::ComputePool,
) -> Result<(f64, f64)> {
    let mut embed = f64::MAX;
    let mut head = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        let x = pool.install(|| model.embed(ids))?;
        embed = embed.min(t0.elapsed().as_secs_f64() * 1e6 / ids.len() as f64);
        let h = model.config().hidden_size;
        let t0 = Instant::now();
        pool.install(|| model.logits(&x[..h], 1))?;
        head = head.min(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok((embed, head))
}
