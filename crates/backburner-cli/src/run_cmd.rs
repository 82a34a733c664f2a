//! `backburner run`: generate from a prompt on the local engine, optionally with workers (split prefill, KV
//! offload), streaming text or printing one JSON object.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use backburner_engine::{generate, GenerateParams, Generation, Session, StopReason};
use backburner_model::{ChatMessage, TextTokenizer};
use clap::Args;
use indicatif::ProgressBar;

use backburner_engine::memory;

mod choices;
mod device;

use crate::constraint_args::ConstraintArgs;
use crate::sampling_args::SamplingArgs;
use crate::spec_args::SpecArgs;
use crate::{bar, compute_pool, link_args, need_tok, prompt, LinkArgs, ModelArgs, IDS_HINT};

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (it may start with `-`, as llama.cpp reads it: `-p -x` is the prompt `-x`).
    #[arg(short = 'p', long, group = "input", allow_hyphen_values = true)]
    prompt: Option<String>,
    /// Read the prompt text from a file.
    #[arg(short = 'f', long, visible_alias = "file", group = "input")]
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
    /// Most tokens to generate (-1: until an eos id or a full context, as llama-cli's -n -1).
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = 128)]
    max_tokens: i64,
    /// Generate this many sequences from the prompt (the server's `n`, 1 … 16): the prompt is prefilled once and
    /// sequence i samples with seed + i (so it is `run --seed <seed + i>`'s output); each is printed after a
    /// `[choice i]` line (with --json: a `choices` array). Not `-n` (max tokens, as in llama.cpp) nor `--parallel`
    /// (llama.cpp's `-np`: server slots).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=16))]
    n_choices: u64,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    constraint: ConstraintArgs,
    #[command(flatten)]
    spec: SpecArgs,
    /// Stop when the output contains this text (repeatable, up to 16 strings of up to 256 bytes each; needs a
    /// tokenizer; it may start with `-`).
    #[arg(long, allow_hyphen_values = true)]
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

/// Rejects `--stop` values past the engine's limits ([`backburner_engine::check_stop_strings`]), before the model
/// loads.
fn check_stop(a: &RunArgs) -> Result<()> {
    backburner_engine::check_stop_strings(&a.stop).map_err(|e| {
        let m = e.to_string();
        let m = m
            .strip_prefix("invalid input: stop strings: ")
            .unwrap_or(&m);
        anyhow::anyhow!("--stop: {m}")
    })
}

/// `-n`/`--max-tokens` as a count: -1 (or llama.cpp's -2, "until the context is full", the same here) is no limit
/// but an eos id or a full context; other negative counts are refused, and 0 unless `zero_ok` (`run`'s 0: the
/// prompt is prefilled and nothing generated).
pub(crate) fn max_tokens(n: i64, zero_ok: bool) -> Result<usize> {
    match n {
        -2 | -1 => Ok(usize::MAX),
        0 if zero_ok => Ok(0),
        0 => bail!(
            "--max-tokens 0 leaves no room for a reply (-1: until an eos id or a full context)"
        ),
        n if n < 0 => {
            bail!("--max-tokens {n}: give a count, or -1 for until an eos id or a full context")
        }
        n => Ok(usize::try_from(n).unwrap_or(usize::MAX)),
    }
}

/// Runs `backburner run`.
pub(crate) fn run(mut a: RunArgs) -> Result<()> {
    a.sampling.check()?;
    let max_tokens = max_tokens(a.max_tokens, true)?;
    let grammar = a.constraint.grammar()?;
    if grammar.is_some() && a.ignore_eos {
        bail!("--ignore-eos cannot go with --grammar/--json-schema: a complete grammar ends at an eos id");
    }
    check_stop(&a)?;
    let backend = device::check(&a)?;
    let pool = compute_pool(a.model.threads)?;
    let dir = match &a.model.model {
        Some(d) => d.clone(),
        None => crate::default_model::ensure()?,
    };
    a.model.model = Some(dir.clone());
    // the prompt first (config and tokenizer only): the placement is planned for what this run needs
    let (mut config, tokenizer) = crate::load_tokenizer(&dir)?;
    config.precision = a.model.precision;
    if !a.spec.wants_mtp() {
        // the MTP block drafts only for --spec mtp: otherwise its weights stay on disk
        config.mtp_num_hidden_layers = 0;
    }
    a.model.check_kv(&config)?;
    if !a.stop.is_empty() {
        need_tok(&tokenizer, &dir, "--stop", "")?;
    }
    let prompt = build_prompt(&a, &tokenizer)?;
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let need = backburner_engine::open::RunNeed {
        positions: prompt.len().saturating_add(max_tokens),
        ubatch: a.model.ubatch.min(prompt.len()),
    };
    // the engine plans, checks memory, loads and connects: one request in, a ready session out
    let req = crate::placement::request(&a.model, &a.link, dir, config, &pool, Some(need))?;
    let (host, mut session) = device::open_session(req, &a, backend)?;
    let (plan, experts) = (host.plan, host.experts);
    let tok = &tokenizer;
    backburner_engine::sequence::check_token_ids(&prompt, session.model().config().vocab_size)
        .context("--prompt-tokens")?;
    let eos_ids = if a.ignore_eos {
        Vec::new()
    } else {
        tok.as_ref()
            .map(|t| t.eos_ids().to_vec())
            .unwrap_or_else(|| session.model().config().eos_token_ids.clone())
    };
    let constraint = match (grammar, tok.as_ref()) {
        (Some(g), Some(t)) => {
            // a chat prompt that opens a reasoning block: the grammar applies to the answer after it
            let opens =
                a.chat && backburner_model::chat::prompt_opens_reasoning(&t.decode(&prompt)?);
            let after = opens.then(|| "</think>".to_string());
            Some(ConstraintArgs::spec(g, t, &eos_ids, after)?)
        }
        (Some(_), None) => bail!("--grammar/--json-schema need a tokenizer"),
        (None, _) => None,
    };
    let seed = a.sampling.seed.unwrap_or_else(rand::random);
    let params = GenerateParams {
        max_tokens,
        sampling: a.sampling.params(seed),
        eos_ids,
        stop: a.stop.clone(),
        keep_logits: a.dump_logits.is_some(),
        cancel: Some(cancel_on_ctrl_c()?),
        logprobs: None,
        constraint,
        spec: a.spec.params()?,
    };
    a.spec.enable(&mut session)?;
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
    let progress = |done: usize, total: usize| {
        if show_bar {
            pb.set_position(done as u64);
            if done == total {
                pb.finish_and_clear();
            }
        }
    };
    if a.n_choices > 1 {
        if a.dump_logits.is_some() {
            bail!("--dump-logits writes one sequence's logits: it cannot go with --n-choices");
        }
        let n = a.n_choices as usize;
        let gens = backburner_engine::generate_choices(
            &mut session,
            &prompt,
            &params,
            n,
            tok.as_ref(),
            progress,
            |_, _| {},
            |_, _| {},
        )
        .map_err(one_shot_error)?;
        return choices::report_choices(&a, &prompt, seed, &gens, t_start.elapsed().as_secs_f64());
    }
    let gen_result = generate(
        &mut session,
        &prompt,
        &params,
        tok.as_ref(),
        progress,
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
    );
    let gen = match gen_result.map_err(one_shot_error) {
        Ok(g) => g,
        Err(e) if json => {
            // a failure before the first token (e.g. a lost layer-split worker during prefill): still one object
            let mut obj = serde_json::json!({
                "prompt_tokens": prompt,
                "tokens": [],
                "text": "",
                "stop_reason": "error",
                "seed": seed,
                "error": e.to_string(),
            });
            if let Some(link) = link_args::link_json(&session, &Default::default()) {
                obj["link"] = link;
            }
            if let Some(p) = &plan {
                obj["plan"] = serde_json::to_value(p).unwrap_or_default();
            }
            out_line(&obj.to_string());
            eprintln!("error: {e}");
            std::process::exit(1);
        }
        Err(e) => return Err(e),
    };
    if let Some(f) = &a.dump_logits {
        let bytes: Vec<u8> = gen
            .step_logits
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(f, bytes).with_context(|| format!("write {}", f.display()))?;
    }
    let total_s = t_start.elapsed().as_secs_f64();
    let interrupted = gen.stop_reason == StopReason::Interrupted;
    let link = Link {
        session: &session,
        experts: experts.as_deref(),
    };
    report(&a, &prompt, seed, &gen, &link, total_s, plan.as_ref());
    if interrupted {
        std::process::exit(130); // 128 + SIGINT, as a shell reports a Ctrl-C
    }
    if let Some(e) = &gen.error {
        bail!("generation stopped after {} tokens: {e}", gen.tokens.len());
    }
    Ok(())
}

/// `run` ends with its one request: a lost worker's error says to run again instead of promising the session's
/// next request (which a server has, and `run` has not).
fn one_shot_error(e: backburner_engine::EngineError) -> anyhow::Error {
    use backburner_engine::EngineError as E;
    match e {
        E::WorkerLost {
            addr,
            layers,
            reason,
            ..
        } => anyhow::anyhow!(
            "worker {addr} holding layers {layers} is lost ({reason}): nothing else holds those layers; run again \
             once it is back"
        ),
        E::ExpertsLost { reason, .. } => anyhow::anyhow!(
            "routed experts on a worker are unavailable ({reason}): run again once the worker is back"
        ),
        e => e.into(),
    }
}

/// The prompt's token ids from `--prompt`, `--prompt-file` (through the chat template with `--chat`),
/// `--prompt-tokens` or `--prompt-tokens-file`. Errors: a missing tokenizer for text, `--chat` with ids, no prompt.
fn build_prompt(a: &RunArgs, tok: &Option<TextTokenizer>) -> Result<Vec<u32>> {
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => Some(p.clone()),
        (_, Some(f)) => Some(read_prompt_file(f)?),
        _ => None,
    };
    Ok(if let Some(text) = text {
        let t = need_tok(
            tok,
            a.model.model.as_deref().unwrap_or(Path::new(".")),
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
        prompt::parse_token_ids(&prompt::read_bounded(
            f,
            prompt::MAX_PROMPT_FILE,
            "prompt tokens file",
        )?)?
    } else {
        bail!("give a prompt: --prompt TEXT, --prompt-file F, --prompt-tokens IDS or --prompt-tokens-file F");
    })
}

/// Prints the `--json` object, or the closing stats lines on stderr.
/// What ran where: the session and, with experts on workers, their holders.
struct Link<'a> {
    session: &'a Session,
    experts: Option<&'a backburner_engine::experts::LinkExperts>,
}

fn report(
    a: &RunArgs,
    prompt: &[u32],
    seed: u64,
    gen: &Generation,
    link: &Link<'_>,
    total_s: f64,
    plan: Option<&backburner_engine::plan::Plan>,
) {
    let session = link.session;
    let json = a.json;
    let tm = &gen.timings;
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
        if let Some(e) = &gen.error {
            obj["error"] = e.clone().into();
        }
        if let Some(c) = &gen.speculative {
            obj["speculative"] = serde_json::to_value(c).unwrap_or_default();
        }
        if let Some(l) = link_args::link_json(session, tm) {
            obj["link"] = l;
        }
        if let Some(rx) = link.experts {
            obj["link"] = crate::experts_args::link_json(rx);
        }
        if let Some(p) = plan {
            obj["plan"] = serde_json::to_value(p).unwrap_or_default();
        }
        let (mem, peak) = (session.memory(), memory::peak_rss_bytes());
        let mut m = serde_json::to_value(mem).expect("a report serializes");
        m["total"] = mem.total().into();
        m["peak_rss"] = peak.into();
        obj["memory"] = m;
        out_line(&obj.to_string());
    } else {
        out_line("");
        // before the stats line, which stays the last line; decimal units, as --max-memory and its errors
        let m = session.memory();
        let h = memory::human;
        // the host's weights, and those of the layers on devices beside them
        let d = (m.device_weights > 0).then(|| format!(" (+ {} on devices)", h(m.device_weights)));
        eprintln!(
            "memory: weights {}{}, kv {}, state {}, scratch {} (peak RSS {})",
            h(m.weights),
            d.unwrap_or_default(),
            h(m.kv_pages),
            h(m.recurrent_state),
            h(m.scratch),
            memory::peak_rss_bytes().map_or("unknown".into(), h)
        );
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
        if a.sampling.temp > 0.0 {
            stats += &format!(" | seed {seed}");
        }
        stats += &crate::spec_args::stats_suffix([&gen.speculative]);
        eprintln!("{stats}");
        for line in link_args::link_lines(session, tm) {
            eprintln!("{line}");
        }
        for line in link
            .experts
            .map(crate::experts_args::link_lines)
            .unwrap_or_default()
        {
            eprintln!("{line}");
        }
    }
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
pub(crate) fn out_line(s: &str) {
    let mut o = std::io::stdout();
    if writeln!(o, "{s}").and_then(|_| o.flush()).is_err() {
        quiet_exit_on_closed_stdout();
    }
}

/// Reads a prompt file, refusing files over 256 MiB (far beyond any context) before reading them.
pub(crate) fn read_prompt_file(f: &Path) -> Result<String> {
    prompt::read_bounded(f, prompt::MAX_PROMPT_FILE, "prompt file")
}
