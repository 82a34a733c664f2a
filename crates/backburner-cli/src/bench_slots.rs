//! `backburner bench slots`: aggregate decode throughput of N sequences decoded as one batch
//! ([`backburner_engine::serve::decode_batch`], what `serve --parallel N` runs each step), for several N.
//!
//! Engine-level, no HTTP: N sessions on the bench model, each prefilled with its own short prompt, then `--steps`
//! greedy decode steps of all N at once, rewound after each measurement. Slot counts alternate within each of
//! `--rounds` rounds, and medians are reported. Each round also times one session decoding alone
//! ([`Session::decode`]), so that N sequences decoded one after another (N × that time) can be compared with the
//! batch.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use backburner_engine::serve::decode_batch;
use backburner_engine::{argmax, Logits, Session};
use backburner_model::StateSnapshot;
use clap::Args;
use serde::Serialize;
use serde_json::json;

use crate::{bench, compute_pool, ModelArgs};

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors) or GGUF file. Default: the bundled bench model (random weights, generated once)")))]
pub struct SlotsArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Slot counts (sequences decoded at once), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    slots: Vec<usize>,
    /// Prompt tokens prefilled in each session before decoding (each session its own prompt).
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Decode steps per measurement.
    #[arg(long, default_value_t = 32)]
    steps: usize,
    /// Rounds (every slot count once per round, in turn); medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The medians of one slot count.
#[derive(Serialize)]
struct SlotResult {
    slots: usize,
    /// Tokens decoded per second over all slots.
    aggregate_tok_s: f64,
    /// Milliseconds per batched step (one token of every slot).
    ms_per_step: f64,
    /// aggregate_tok_s / that of 1 slot (null when 1 is not measured).
    vs_one_slot: Option<f64>,
    /// Milliseconds for `slots` sequences decoded one after another, one token each (slots × one session alone).
    sequential_ms_per_step: f64,
    /// sequential_ms_per_step / ms_per_step.
    speedup_vs_sequential: f64,
}

/// Seconds for `steps` greedy steps of `sessions` as one batch; they are then rewound to `snaps`.
fn time_batch(sessions: &mut [Session], snaps: &[StateSnapshot], steps: usize) -> Result<f64> {
    let mut ids: Vec<u32> = (0..sessions.len() as u32).map(|i| 100 + i).collect();
    let mut refs: Vec<&mut Session> = sessions.iter_mut().collect();
    let t = Instant::now();
    for _ in 0..steps {
        let logits = decode_batch(&mut refs, &ids);
        for (id, l) in ids.iter_mut().zip(logits) {
            *id = argmax(&l?);
        }
    }
    let s = t.elapsed().as_secs_f64();
    for (s, snap) in refs.into_iter().zip(snaps) {
        s.rewind(snap);
    }
    Ok(s)
}

/// Seconds for `steps` greedy steps of `s` alone; it is then rewound to `snap`.
fn time_alone(s: &mut Session, snap: &StateSnapshot, steps: usize) -> Result<f64> {
    let mut id = 100;
    let t = Instant::now();
    for _ in 0..steps {
        id = argmax(&s.decode(id)?);
    }
    let el = t.elapsed().as_secs_f64();
    s.rewind(snap);
    Ok(el)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark.
pub fn run(a: SlotsArgs) -> Result<()> {
    if a.slots.is_empty() || a.slots.contains(&0) {
        bail!("--slots needs slot counts ≥ 1");
    }
    if a.prompt_tokens == 0 || a.steps == 0 || a.rounds == 0 {
        bail!("--prompt-tokens, --steps and --rounds must be ≥ 1");
    }
    let pool = compute_pool(a.model.threads)?;
    let (margs, loaded) = bench::load_or_bench_model(&a.model, &pool)?;
    let cfg = loaded.model.config().clone();
    let max = *a.slots.iter().max().expect("non-empty");
    eprintln!(
        "bench slots: model {} ({} layers, hidden {}), {} thread(s), {} prompt tokens per slot, {} steps × {} rounds, machine: {}",
        loaded.dir.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        pool.threads(),
        a.prompt_tokens,
        a.steps,
        a.rounds,
        bench::machine_description()
    );
    let mut sessions = Vec::with_capacity(max);
    for i in 0..max {
        let mut s = Session::new(loaded.model.clone(), margs.session_options(&pool))?;
        let p =
            bench::pseudo_random_prompt(a.prompt_tokens, cfg.vocab_size, 0x9e37_79b9 + i as u64);
        s.prefill(&p, Logits::Last, |_, _| {})
            .with_context(|| format!("prefilling slot {i}"))?;
        sessions.push(s);
    }
    let snaps: Vec<_> = sessions.iter().map(Session::snapshot).collect();
    time_batch(&mut sessions, &snaps, a.steps.min(2))?; // warm-up: grows every buffer
    let mut secs = vec![Vec::new(); a.slots.len()];
    let mut alone = Vec::new();
    for _ in 0..a.rounds {
        alone.push(time_alone(&mut sessions[0], &snaps[0], a.steps)?);
        for (k, &n) in a.slots.iter().enumerate() {
            secs[k].push(time_batch(&mut sessions[..n], &snaps[..n], a.steps)?);
        }
    }
    let alone_ms = 1e3 * median(alone) / a.steps as f64;
    let mut results: Vec<SlotResult> = a
        .slots
        .iter()
        .zip(&secs)
        .map(|(&n, s)| {
            let sec = median(s.clone());
            let ms = 1e3 * sec / a.steps as f64;
            SlotResult {
                slots: n,
                aggregate_tok_s: (n * a.steps) as f64 / sec,
                ms_per_step: ms,
                vs_one_slot: None,
                sequential_ms_per_step: n as f64 * alone_ms,
                speedup_vs_sequential: n as f64 * alone_ms / ms,
            }
        })
        .collect();
    if let Some(one) = results
        .iter()
        .find(|r| r.slots == 1)
        .map(|r| r.aggregate_tok_s)
    {
        for r in &mut results {
            r.vs_one_slot = Some(r.aggregate_tok_s / one);
        }
    }
    println!("{}", table(&results, alone_ms));
    if let Some(path) = &a.json {
        let report = json!({
            "bench": "slots",
            "model": loaded.dir.display().to_string(),
            "config": {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "params": bench::param_count(&cfg)},
            "threads": pool.threads(),
            "prompt_tokens": a.prompt_tokens,
            "steps": a.steps,
            "rounds": a.rounds,
            "alone_ms_per_token": alone_ms,
            "machine": bench::machine_description(),
            "results": results,
        });
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

/// The results as a text table.
fn table(results: &[SlotResult], alone_ms: f64) -> String {
    let mut out = format!(
        "{:>5} {:>15} {:>9} {:>8} | {:>16} {:>8}\n",
        "slots", "aggregate tok/s", "ms/step", "vs 1", "sequential ms", "speedup"
    );
    for r in results {
        out += &format!(
            "{:>5} {:>15.1} {:>9.2} {:>8} | {:>16.2} {:>7.2}x\n",
            r.slots,
            r.aggregate_tok_s,
            r.ms_per_step,
            r.vs_one_slot
                .map_or_else(|| "-".into(), |v| format!("{v:.2}x")),
            r.sequential_ms_per_step,
            r.speedup_vs_sequential,
        );
    }
    out += &format!("one session alone (Session::decode): {alone_ms:.2} ms/token");
    out
}
