//! `backburner bench spec`: what speculative decoding costs and gains on this machine (issue 37), engine-level, on
//! one local session (no HTTP, no worker).
//!
//! 1. **Verify cost.** At a fixed context depth (a pseudo-random prompt of `--depth` tokens), for `T = 1..=k + 1`:
//!    one [`Session::verify`] of `T` tokens (the pending token and the greedy continuation) and
//!    [`Session::keep_verified`]`(T)`, against `T` plain [`Session::decode`] steps of the same tokens, the two in
//!    alternating order, each from the same snapshot (rewound after every measurement, untimed). `V(T)` is the verify
//!    step's time over one decode step's (the median over rounds of each round's ratio). A rollback
//!    (`keep_verified(m)` with `m < T`: the attention rows truncated, the Gated DeltaNet states replayed over `m`
//!    positions) is timed on its own after an untimed verify step. Before timing, the verify rows of the longest
//!    step must equal the `T` decode steps' logits bit for bit (checked; the bench fails otherwise).
//! 2. **The controller's cost model.** The measured `V(T)` and rollback make a [`CostModel`]
//!    ([`CostModel::from_verify_times`]); the report gives the draft length [`best_k`] chooses at several acceptances
//!    with it and with [`CostModel::default`], and the speedup the model predicts for each.
//! 3. **Tokens/s vs acceptance.** `--gen-tokens` greedy tokens from the same depth, without speculation and with a
//!    [`SpecSource::Scripted`] source drafting the known greedy continuation with each draft wrong at a given rate
//!    (acceptance per position `1 − rate`), with a fixed `k` and adaptive (default and measured cost model). Each
//!    speculative run is paired with a plain run just before it; medians over rounds of the rates and of each
//!    pair's ratio. Every run's tokens must be the plain run's (checked; the bench fails otherwise).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use backburner_engine::spec::{
    best_k, expected_tokens, CostModel, SpecCounts, SpecParams, SpecSource,
};
use backburner_engine::{generate, GenerateParams, Generation, Logits, Session, StopReason};
use backburner_model::StateSnapshot;
use clap::Args;
use serde::Serialize;
use serde_json::json;

use crate::{bench, compute_pool, ModelArgs};

mod report;
mod setup;
mod verify_cost;

use report::{gen_table, prediction_table, targets, verify_table};
use verify_cost::verify_cost;

/// Options.
#[derive(Args)]
#[command(mut_arg("model", |a| a.help("Checkpoint directory (config.json, *.safetensors) or GGUF file. Default: the bundled bench model (random weights, generated once)")))]
pub struct SpecArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    /// Context depth: tokens of the pseudo-random prompt before the verify steps and the generation.
    #[arg(long, default_value_t = 512)]
    depth: usize,
    /// Largest draft count timed: verify steps of T = 1..=K+1 positions.
    #[arg(long, default_value_t = 8, value_name = "K")]
    max_k: usize,
    /// Greedy tokens generated per run.
    #[arg(long, default_value_t = 128)]
    gen_tokens: usize,
    /// Error rates of the scripted drafts (each draft wrong with this probability: acceptance 1 − rate per
    /// position), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "0,0.2,0.4,1")]
    error_rates: Vec<f64>,
    /// Drafts per step of the fixed mode.
    #[arg(long, default_value_t = 3)]
    fixed_k: usize,
    /// Most drafts per step of the adaptive modes (the measured cost model knows verify steps of up to K + 1
    /// positions only, so the adaptive mode with it drafts at most --max-k).
    #[arg(long, default_value_t = 8)]
    draft_max: usize,
    /// Rounds (medians are reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Skip the verify cost (then the adaptive mode with the measured cost model is not run either).
    #[arg(long)]
    no_verify: bool,
    /// Skip tokens/s vs acceptance.
    #[arg(long)]
    no_generate: bool,
    /// Seed of the scripted drafts' errors.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write the results as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Over a layer split: the host holds layers [0, L) and the ends, one worker process (this binary, on
    /// loopback) holds [L, n); every verify and decode step goes through it, over the emulated link unless
    /// --loopback.
    #[arg(long, value_name = "L")]
    layer_split: Option<usize>,
    /// Threads of the worker process (--layer-split).
    #[arg(long, default_value_t = 1)]
    worker_threads: usize,
    #[command(flatten)]
    shaped: bench::ShapedLinkArgs,
    /// --layer-split over plain loopback instead of the emulated link.
    #[arg(long)]
    loopback: bool,
}

/// The medians of one verify length.
#[derive(Serialize)]
struct VerifyRow {
    /// Positions of the verify step (`k + 1`).
    t: usize,
    /// One verify step of `t` positions and `keep_verified(t)`, ms.
    verify_ms: f64,
    /// `t` decode steps of the same tokens, ms.
    decodes_ms: f64,
    /// `V(t)`: the verify step over one decode step (median of each round's ratio).
    v: f64,
    /// The verify step over the `t` decode steps (median of each round's ratio).
    verify_over_decodes: f64,
    /// `keep_verified(1)` after a verify step of `t` (null for `t = 1`), ms.
    rollback_to_1_ms: Option<f64>,
    /// `keep_verified(t − 1)` after a verify step of `t` (null for `t < 3`), ms.
    rollback_to_t_minus_1_ms: Option<f64>,
}

/// The medians of one speculative configuration against plain decoding.
#[derive(Serialize)]
struct GenRow {
    error_rate: f64,
    /// `fixed`, `adaptive` (the default cost model) or `adaptive_measured` (the cost model measured here).
    mode: &'static str,
    draft_max: usize,
    plain_tok_s: f64,
    spec_tok_s: f64,
    /// Median of each pair's spec / plain.
    ratio: f64,
    /// Counts of the last run (verify steps with drafts, drafted, accepted).
    counts: SpecCounts,
    tokens_match: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn check(a: &SpecArgs) -> Result<()> {
    if a.depth < 2 || a.rounds == 0 || a.gen_tokens < 2 || a.max_k == 0 {
        bail!("--depth and --gen-tokens must be ≥ 2, --rounds and --max-k ≥ 1");
    }
    let max = backburner_engine::spec::MAX_DRAFT;
    if !(1..=max).contains(&a.fixed_k) || !(1..=max).contains(&a.draft_max) || a.max_k > max {
        bail!("--fixed-k, --draft-max and --max-k must be in 1..={max}");
    }
    if let Some(r) = a.error_rates.iter().find(|r| !(0.0..=1.0).contains(*r)) {
        bail!("--error-rates: {r} is not in [0, 1]");
    }
    Ok(())
}

/// Runs the benchmark.
pub fn run(a: SpecArgs) -> Result<()> {
    check(&a)?;
    let pool = compute_pool(a.model.threads)?;
    let (margs, loaded) = bench::load_or_bench_model(&a.model, &pool)?;
    let cfg = loaded.model.config().clone();
    let machine = bench::machine_description();
    eprintln!(
        "bench spec: model {} ({} layers, hidden {}), {} thread(s), depth {}, {} rounds, machine: {machine}",
        loaded.dir.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        pool.threads(),
        a.depth,
        a.rounds,
    );
    let prompt = bench::pseudo_random_prompt(a.depth, cfg.vocab_size, 0x5bec_0de5);
    let (mut s, _worker, placement) = setup::session(&a, &margs, &loaded, &pool)?;
    if !s.can_verify() {
        bail!("this session cannot run verify steps (experts on workers)");
    }
    // the prompt but its last token: the generation and the verify steps run from here (through a layer split the
    // worker keeps its layers' checkpoint here, so every rewind to it is in place)
    s.keep_checkpoints_at(vec![a.depth - 1]);
    s.prefill(&prompt[..a.depth - 1], Logits::Last, |_, _| {})
        .context("prefilling the prompt")?;
    let base = s.snapshot();
    let mut report = json!({
        "bench": "spec",
        "model": loaded.dir.display().to_string(),
        "config": {"num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size, "params": bench::param_count(&cfg)},
        "threads": pool.threads(),
        "depth": a.depth,
        "rounds": a.rounds,
        "machine": machine,
        "placement": placement,
    });
    let mut measured = None;
    if !a.no_verify {
        let last = prompt[a.depth - 1];
        let rows = verify_cost(&mut s, &base, last, a.max_k + 1, a.rounds)?;
        let cost = cost_model(&rows)?;
        println!("{}", verify_table(&rows, &cost));
        let predicted = predictions(&cost.model, a.draft_max);
        println!("{}", prediction_table(&predicted));
        report["verify"] = json!({"bit_equal": true, "rows": rows});
        report["cost_model"] = json!({
            "decode_ms": cost.decode_ms,
            "v": cost.v,
            "rollback": cost.rollback,
            "per_position_fit": cost.per_position,
            "default_per_position": 0.1,
            "predictions": predicted,
        });
        measured = Some(cost.model);
        s.rewind(&base);
    }
    if !a.no_generate {
        let (rows, plain_tokens) = tokens_vs_acceptance(&a, &mut s, &base, &prompt, measured)?;
        println!("{}", gen_table(&rows, a.gen_tokens));
        let targets = targets(&rows, a.fixed_k, a.layer_split.is_some());
        for line in targets.1 {
            println!("{line}");
        }
        report["generate"] = json!({
            "gen_tokens": a.gen_tokens,
            "fixed_k": a.fixed_k,
            "draft_max": a.draft_max,
            "seed": a.seed,
            "tokens_match": rows.iter().all(|r| r.tokens_match),
            "plain_tokens": plain_tokens,
            "rows": rows,
            "targets": targets.0,
        });
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

/// The controller's cost model from part 1.
struct MeasuredCost {
    /// One decode step, ms (median over every length of the decode times per step).
    decode_ms: f64,
    /// `V(T)` for `T = 1..`, with `V(1) = 1` (a step of one position is a plain decode step).
    v: Vec<f64>,
    /// `R`: `keep_verified(1)` after the longest verify step, in decode steps.
    rollback: f64,
    /// `β` of the least-squares fit `V(T) = 1 + β (T − 1)`.
    per_position: f64,
    model: CostModel,
}

fn cost_model(rows: &[VerifyRow]) -> Result<MeasuredCost> {
    let decode_ms = median(rows.iter().map(|r| r.decodes_ms / r.t as f64).collect());
    let v: Vec<f64> = std::iter::once(1.0)
        .chain(rows.iter().skip(1).map(|r| r.v))
        .collect();
    let rollback = rows
        .last()
        .and_then(|r| r.rollback_to_1_ms)
        .map_or(0.0, |ms| ms / decode_ms);
    let (num, den) = v.iter().enumerate().fold((0.0, 0.0), |(n, d), (i, v)| {
        (n + i as f64 * (v - 1.0), d + (i * i) as f64)
    });
    let per_position = if den > 0.0 { num / den } else { 0.0 };
    let model = CostModel::from_verify_times(&v)?.with_rollback_cost(rollback)?;
    Ok(MeasuredCost {
        decode_ms,
        v,
        rollback,
        per_position,
        model,
    })
}

/// What [`best_k`] chooses at one acceptance, with the default and the measured cost model, and the speedup over
/// plain decoding the measured model predicts for each choice.
#[derive(Serialize)]
struct Prediction {
    acceptance: f64,
    k_default: usize,
    speedup_default_k: f64,
    k_measured: usize,
    speedup_measured_k: f64,
}

fn predictions(measured: &CostModel, draft_max: usize) -> Vec<Prediction> {
    let default = CostModel::default();
    let speedup = |a: f64, k: usize| expected_tokens(a, k) / measured.step_cost(k, a);
    [0.0, 0.2, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
        .into_iter()
        .map(|a| {
            let (kd, km) = (
                best_k(a, &default, draft_max),
                best_k(a, measured, draft_max),
            );
            Prediction {
                acceptance: a,
                k_default: kd,
                speedup_default_k: speedup(a, kd),
                k_measured: km,
                speedup_measured_k: speedup(a, km),
            }
        })
        .collect()
}

/// One greedy generation of `n` tokens from `base` (the prompt but its last token `last`), with `spec`.
fn gen_once(
    s: &mut Session,
    base: &StateSnapshot,
    last: u32,
    n: usize,
    spec: Option<SpecParams>,
) -> Result<Generation> {
    s.rewind(base);
    let params = GenerateParams {
        max_tokens: n,
        spec,
        ..Default::default()
    };
    let g = generate(s, &[last], &params, None, |_, _| {}, |_| {}, |_| {})?;
    if g.stop_reason != StopReason::MaxTokens || g.tokens.len() != n {
        bail!(
            "a generation stopped after {} of {n} tokens ({}{})",
            g.tokens.len(),
            g.stop_reason.as_str(),
            g.error
                .as_deref()
                .map_or(String::new(), |e| format!(": {e}"))
        );
    }
    Ok(g)
}

/// Part 3: tokens/s of plain and speculative runs in pairs (see the module documentation). Returns the rows and
/// the plain run's tokens.
fn tokens_vs_acceptance(
    a: &SpecArgs,
    s: &mut Session,
    base: &StateSnapshot,
    prompt: &[u32],
    measured: Option<CostModel>,
) -> Result<(Vec<GenRow>, Vec<u32>)> {
    let last = prompt[a.depth - 1];
    let plain = gen_once(s, base, last, a.gen_tokens, None)?.tokens; // also the warm-up
    let script: Vec<u32> = prompt.iter().chain(&plain).copied().collect();
    let mut configs = Vec::new();
    for &rate in &a.error_rates {
        let source = SpecSource::Scripted {
            script: script.clone(),
            error_rate: rate,
            seed: a.seed,
        };
        let params = |draft_max, fixed, cost| SpecParams {
            source: source.clone(),
            draft_max,
            fixed,
            cost,
        };
        configs.push((rate, "fixed", params(a.fixed_k, true, None)));
        configs.push((rate, "adaptive", params(a.draft_max, false, None)));
        if let Some(m) = &measured {
            configs.push((
                rate,
                "adaptive_measured",
                params(a.draft_max, false, Some(m.clone())),
            ));
        }
    }
    let mut rates = vec![(Vec::new(), Vec::new(), None); configs.len()];
    for _ in 0..a.rounds {
        for ((rate, mode, params), (p, sp, counts)) in configs.iter().zip(&mut rates) {
            let g0 = gen_once(s, base, last, a.gen_tokens, None)?;
            let g = gen_once(s, base, last, a.gen_tokens, Some(params.clone()))?;
            for (what, toks) in [("plain", &g0.tokens), ("speculative", &g.tokens)] {
                if *toks != plain {
                    let i = toks
                        .iter()
                        .zip(&plain)
                        .position(|(x, y)| x != y)
                        .unwrap_or(0);
                    bail!(
                        "TOKENS DIFFER: a {what} run (error rate {rate}, mode {mode}) gave token {} at index {i} \
                         where the first plain greedy run gave {}: speculative decoding must not change greedy output",
                        toks[i],
                        plain[i]
                    );
                }
            }
            p.push(g0.timings.decode_tok_s);
            sp.push(g.timings.decode_tok_s);
            *counts = g.speculative;
        }
    }
    let rows = configs
        .iter()
        .zip(rates)
        .map(|((rate, mode, params), (p, sp, counts))| GenRow {
            error_rate: *rate,
            mode,
            draft_max: params.draft_max,
            plain_tok_s: median(p.clone()),
            spec_tok_s: median(sp.clone()),
            ratio: median(p.iter().zip(&sp).map(|(p, s)| s / p).collect()),
            counts: counts.unwrap_or_default(),
            tokens_match: true,
        })
        .collect();
    Ok((rows, plain))
}
