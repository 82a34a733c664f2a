//! `backburner chat` (also `run -cnv`): a multi-turn conversation in the terminal.
//!
//! Each turn re-renders the whole conversation through the chat template and submits it to a one-slot serving engine
//! ([`backburner_engine::serve::Engine`]), the same prompt cache as `serve`'s: the slot keeps a checkpoint at the end
//! of the conversation before the generation prompt (the stable prefix), so the next turn resumes from it with the
//! bits of a cold run and prefills only what follows. The terminal side (reading lines, slash commands, printing
//! the reply with its thinking dimmed) is [`crate::chat_repl`].

use std::io::{BufRead, IsTerminal};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;

use anyhow::{Context, Result};
use backburner_engine::serve::{Engine, ServeOptions};
use clap::Args;

use crate::chat_conv::Conversation;
use crate::chat_repl::{Msg, Repl, Settings, TTY_LINE_MAX};
use crate::sampling_args::SamplingArgs;
use crate::{compute_pool, LinkArgs, ModelArgs};

#[derive(Args)]
#[command(allow_negative_numbers = true)]
pub(crate) struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt (`/system TEXT` changes it during the chat; it may start with `-`).
    #[arg(long, allow_hyphen_values = true)]
    system: Option<String>,
    /// Ask a thinking model to answer without a thinking block (sets `enable_thinking=false` in the template).
    #[arg(long)]
    no_think: bool,
    /// Most tokens per reply (-1, the default: until an eos id or a full context, as llama-cli's -n -1).
    #[arg(short = 'n', long, visible_alias = "n-predict", default_value_t = -1)]
    max_tokens: i64,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    spec: crate::spec_args::SpecArgs,
    /// Do not stop a reply at the model's eos ids.
    #[arg(long)]
    ignore_eos: bool,
    /// Show the thinking as plain text between `<think>` and `</think>` instead of dimmed (also when NO_COLOR is
    /// set or stdout is not a terminal).
    #[arg(long)]
    no_color: bool,
    /// After each reply, print a stats line to stderr: prompt tokens, how many came from the cache, rates.
    #[arg(long)]
    verbose: bool,
    #[command(flatten)]
    link: LinkArgs,
}

/// Runs `backburner chat` until `/exit`, Ctrl-D or the end of the input.
pub(crate) fn run(a: ChatArgs) -> Result<()> {
    let spec = a.spec.spec != crate::spec_args::SpecKind::None;
    let backend = a
        .model
        .device
        .open_for_serving("chat", a.link.splits_layers(), spec)?;
    crate::device_args::note_idle_workers(&a.model, &a.link);
    a.sampling.check()?;
    let max_tokens = crate::run_cmd::max_tokens(a.max_tokens, false)?;
    let pool = compute_pool(a.model.threads)?;
    let mut model_args = a.model.clone();
    model_args.mtp = a.spec.wants_mtp();
    let mut placed = crate::placement::load_placed(&model_args, &a.link, &pool, backend, 1)?;
    crate::need_tok(&placed.tokenizer, &placed.dir, "chat", "")?;
    let tok = Arc::new(placed.tokenizer.take().context("a tokenizer")?);
    tok.chat_template()
        .context("chat needs the model's chat template")?;
    let mut session = placed.host.session()?;
    a.spec.enable(&mut session)?;
    let context = session.context_length();
    let opts = ServeOptions {
        queue: 1,
        ..Default::default()
    };
    let engine = Engine::start(vec![session], Some(tok.clone()), opts)?;
    let (tx, rx) = channel();
    let interrupt = Arc::new(AtomicBool::new(false));
    watch_signals(interrupt.clone(), tx.clone())?;
    read_lines(tx.clone())?;
    let color = !a.no_color
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
        && std::io::stdout().is_terminal();
    let eos_ids = match a.ignore_eos {
        true => Vec::new(),
        false => tok.eos_ids().to_vec(),
    };
    let settings = Settings {
        max_tokens,
        sampling: a.sampling.clone(),
        eos_ids,
        spec: a.spec.params()?,
        context,
        color,
        visible_controls: std::io::stdout().is_terminal(),
        verbose: a.verbose,
    };
    let name = placed
        .dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    eprintln!(
        "chat with {name} (context {context} tokens): /help for commands; Ctrl-C stops a reply; Ctrl-D or /exit \
         leaves"
    );
    let conv = Conversation::new(a.system.clone(), a.no_think.then_some(false));
    let mut repl = Repl::new(engine, tok, conv, settings, (tx, rx), interrupt);
    repl.run();
    Ok(())
}

/// Reads standard input on a thread of its own, a line at a time (invalid UTF-8 replaced), into `tx`; the end of the
/// input (or a read error) sends [`Msg::Eof`]; a line that a terminal cut at its limit ([`TTY_LINE_MAX`]) sends
/// [`Msg::Cut`] instead of the part that came through.
fn read_lines(tx: Sender<Msg>) -> Result<()> {
    let tty = std::io::stdin().is_terminal();
    std::thread::Builder::new()
        .name("chat-input".into())
        .spawn(move || {
            let mut stdin = std::io::stdin().lock();
            let mut buf = Vec::new();
            loop {
                buf.clear();
                match stdin.read_until(b'\n', &mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = tx.send(Msg::Eof);
                        return;
                    }
                    Ok(_) => {
                        let body = buf.strip_suffix(b"\n").unwrap_or(&buf);
                        if tty && body.len() >= TTY_LINE_MAX {
                            if tx.send(Msg::Cut).is_err() {
                                return;
                            }
                            continue;
                        }
                        let line = String::from_utf8_lossy(&buf);
                        let line = line.strip_suffix('\n').unwrap_or(&line);
                        let line = line.strip_suffix('\r').unwrap_or(line);
                        if tx.send(Msg::Line(line.to_string())).is_err() {
                            return;
                        }
                    }
                }
            }
        })
        .context("start the input thread")?;
    Ok(())
}

/// Catches Ctrl-C (SIGINT): it raises `interrupt` (the running reply's cancel flag: the engine stops it at its next
/// step) and sends [`Msg::Interrupt`]. SIGTERM and SIGHUP end the process (143, 129), as they would without a
/// handler. Uses tokio's signal handling (already a dependency of the server), on a thread of its own, which tells
/// SIGINT from the others (the `ctrlc` crate, as configured here, does not).
fn watch_signals(interrupt: Arc<AtomicBool>, tx: Sender<Msg>) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("start the signal handler's runtime")?;
    #[cfg(unix)]
    let (mut int, mut term, mut hup) = {
        use tokio::signal::unix::{signal, SignalKind};
        let _in_rt = rt.enter();
        let sig = |k| signal(k).context("install the Ctrl-C handler");
        (
            sig(SignalKind::interrupt())?,
            sig(SignalKind::terminate())?,
            sig(SignalKind::hangup())?,
        )
    };
    std::thread::Builder::new()
        .name("chat-signals".into())
        .spawn(move || {
            rt.block_on(async move {
                loop {
                    #[cfg(unix)]
                    tokio::select! {
                        _ = int.recv() => {}
                        _ = term.recv() => std::process::exit(143),
                        _ = hup.recv() => std::process::exit(129),
                    }
                    #[cfg(not(unix))]
                    if tokio::signal::ctrl_c().await.is_err() {
                        return;
                    }
                    interrupt.store(true, Ordering::SeqCst);
                    if tx.send(Msg::Interrupt).is_err() {
                        return;
                    }
                }
            })
        })
        .context("start the signal thread")?;
    Ok(())
}
