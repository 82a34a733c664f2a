//! llama.cpp's multi-letter short flags (`-ngl`, `-cnv`, `-fa`, `-np`, `-ctk`, `-ctv`, `-ub`, `-b`, …) and a few of
//! its (and vLLM's) long flags, read before clap sees the arguments, which would otherwise take a multi-letter short
//! flag as a cluster of one-letter flags (`-fa` as `-f a`, a prompt file named `a`; `-st` as `-s t`, a seed `t`).
//! Each flag of the table is rewritten to this CLI's long flag where it means the same here, accepted without effect
//! where what it asks for is what happens anyway, and refused with a message naming it otherwise. Any other argument
//! of the shape `-` and two or more letters where a flag stands is refused with a message naming it: every short
//! flag here but `-h` takes a value, so such an argument is never a cluster of one-letter flags.
//!
//! Where a flag stands is read from clap's own description of the command ([`crate::cli_command`]): the argument
//! after a flag that takes a value is that value (`-p -fa` is the prompt `-fa`) and is passed on untouched.

use clap::Command;

/// What one llama.cpp flag becomes.
enum Meaning {
    /// The same flag here, taking the same value.
    Long(&'static str),
    /// Accepted: what it asks for is what this engine always does. With `true`, it takes an optional
    /// `on`/`auto`/`off` value (`-fa`); `off` is refused.
    Always(bool, &'static str),
    /// Refused, with why.
    No(&'static str),
    /// GPU layers: `--device-layers N` where the command has it (`true`: the model's layers); elsewhere (and for
    /// a draft model's, `false`, which there is none of) 0 is accepted (the CPU only, as scripts pass it) and more
    /// refused.
    Gpu(bool),
    /// llama.cpp's `--reasoning-budget N`: 0 is `--no-think`, -1 (no budget) what happens anyway; others refused.
    Budget,
    /// llama.cpp's `--repeat-last-n N`: -1 (the whole context) is what `--repeat-penalty` covers here.
    RepeatLastN,
}

fn meaning(flag: &str, sub: &str) -> Option<Meaning> {
    use Meaning::*;
    Some(match flag {
        "-ub" => Long("--ubatch"),
        "-np" => Long("--parallel"),
        "-ctk" | "-ctv" | "--cache-type-k" | "--cache-type-v" => Long("--kv-dtype"),
        "-sys" => Long("--system"),
        "-a" | "--served-model-name" => Long("--alias"),
        "--max-model-len" => Long("--ctx-size"),
        "-r" | "--reverse-prompt" => Long("--stop"),
        "-fa" | "--flash-attn" => Always(true, "attention over KV pages always runs as a fused online softmax (flash attention)"),
        "-no-cnv" | "--no-conversation" => Always(false, "run is single-turn"),
        "-st" | "--single-turn" if sub == "chat" => No(
            "chat is the multi-turn conversation; for a single answer use `backburner run --chat -p TEXT`",
        ),
        "-st" | "--single-turn" => Always(false, "run is single-turn"),
        "-cb" | "--cont-batching" => Always(false, "serve always batches the decode steps of its slots (continuous batching)"),
        "-nocb" | "--no-cont-batching" => No("serve always batches the decode steps of its slots; it cannot be turned off"),
        "--metrics" => Always(false, "serve's GET /metrics is always on"),
        "--slots" => Always(false, "serve's GET /slots is on unless --no-slots turns it off"),
        "--no-warmup" => Always(false, "there is no warmup run"),
        "--no-mmap" => Always(
            false,
            "the weights are copied (packed) into this process's memory at load; the files are only read through a \
             map, whose pages are dropped once copied",
        ),
        "-cmoe" | "--cpu-moe" => Always(false, "the experts run on the CPU (or on workers with --expert-split)"),
        "--jinja" => Always(false, "chat templates always render as transformers renders them (Jinja)"),
        "--mlock" => No("not supported: the weights are not locked in memory"),
        "-dev" => Long("--device"),
        "-ngl" | "--n-gpu-layers" | "--gpu-layers" => Gpu(true),
        "-ngld" | "--n-gpu-layers-draft" => Gpu(false),
        "--reasoning-budget" => Budget,
        "--repeat-last-n" => RepeatLastN,
        "-ts" | "-sm" | "-mg" => No("a model runs on one device at a time here (--device, --device-layers); it splits across machines with --layer-split"),
        "-cnv" | "--conversation" => No("the interactive conversation is `backburner chat`, or `backburner run -cnv`"),
        "-b" => No("prompts are ingested in --ubatch chunks with no logical batch above them; set -ub / --ubatch"),
        "-tb" => No("prefill and decode share one thread pool: set -t / --threads"),
        "-nkvo" => No("a layer's KV cache lives where the layer runs (in host memory, or on the --device that runs it) or on workers with --kv-budget"),
        "-ot" => No("tensors go to devices by layer (--layer-split) or by expert (--expert-split), not by pattern"),
        "-hf" | "-hfr" | "-hff" => No("no model hub is reached: give a local checkpoint directory or GGUF file with -m"),
        _ => return None,
    })
}

/// The options that give `run` its prompt: `chat` has none of them (it reads its messages from the terminal).
const PROMPT_FLAGS: [&str; 7] = [
    "-p",
    "--prompt",
    "-f",
    "--prompt-file",
    "--file",
    "--prompt-tokens",
    "--prompt-tokens-file",
];

/// `-` and two or more letters (then letters, digits or `-`): a llama.cpp-style multi-letter short flag, which
/// clap would read as a cluster of one-letter flags.
fn multi_letter_short(flag: &str) -> bool {
    let b = flag.as_bytes();
    b.len() >= 3
        && b[0] == b'-'
        && b[1].is_ascii_alphabetic()
        && b[2].is_ascii_alphabetic()
        && b[3..]
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'-')
}

/// The argument of `cmd` that `flag` (`--long`, or `-s` with or without an attached value) names.
fn find_arg<'a>(cmd: &'a Command, flag: &str) -> Option<&'a clap::Arg> {
    if let Some(long) = flag.strip_prefix("--") {
        return cmd.get_arguments().find(|a| {
            a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|v| v.contains(&long))
        });
    }
    let c = flag.strip_prefix('-')?.chars().next()?;
    cmd.get_arguments().find(|a| {
        a.get_short() == Some(c) || a.get_all_short_aliases().is_some_and(|v| v.contains(&c))
    })
}

/// Whether the argument after `arg` (which stands where a flag does in `cmd`) is its value: a flag of `cmd` that
/// takes a value, given without one (`--seed 5`, `-s 5`; not `--seed=5` nor `-s5`).
fn takes_next(cmd: &Command, arg: &str) -> bool {
    if arg.contains('=') || (!arg.starts_with("--") && arg.len() > 2) {
        return false;
    }
    find_arg(cmd, arg).is_some_and(|a| a.get_action().takes_values())
}

/// `args` (program name first) with llama.cpp's flags rewritten. Errors: a message naming a flag that means nothing
/// here (or is no flag of the command), one that lacks its value, `-ctk` and `-ctv` with different types, or a
/// prompt given to `chat`.
pub fn translate(args: Vec<String>) -> Result<Vec<String>, String> {
    let args = conversation(args)?;
    let root = crate::cli_command();
    let mut cmd: &Command = &root;
    let mut path = String::from("backburner");
    let mut out = Vec::with_capacity(args.len());
    let mut kv: Option<String> = None;
    let mut it = args.into_iter();
    out.extend(it.next());
    while let Some(a) = it.next() {
        if a == "--" {
            out.push(a);
            out.extend(it);
            break;
        }
        let sub = path.strip_prefix("backburner ").unwrap_or("");
        // a word where a flag stands: a subcommand's name, or (to chat) a message
        if !a.starts_with('-') || a == "-" {
            if let Some(sc) = cmd.find_subcommand(&a) {
                cmd = sc;
                path = format!("{path} {}", sc.get_name());
            } else if sub == "chat" {
                return Err(format!(
                    "chat takes no message on the command line ({a:?}): {CHAT_READS}; for a one-shot answer use \
                     `backburner run --chat -p {a:?}`"
                ));
            }
            out.push(a);
            continue;
        }
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (a.clone(), None),
        };
        if sub == "chat" && PROMPT_FLAGS.contains(&flag.as_str()) {
            return Err(format!(
                "chat has no {flag}: {CHAT_READS}; for a one-shot answer use `backburner run --chat -p TEXT`"
            ));
        }
        // a flag of the command itself is clap's (`bench slots --slots 1,2`), whatever llama.cpp means by it
        let own = (flag.starts_with("--") || flag.len() == 2) && find_arg(cmd, &flag).is_some();
        let Some(m) = meaning(&flag, sub).filter(|_| !own) else {
            if multi_letter_short(&flag) {
                return Err(not_a_flag(cmd, &path, &flag));
            }
            let value = takes_next(cmd, &a);
            out.push(a);
            if value {
                out.extend(it.next());
            }
            continue;
        };
        let value = |it: &mut std::vec::IntoIter<String>| {
            inline
                .clone()
                .or_else(|| it.next())
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        match m {
            Meaning::Long(long) => {
                if find_arg(cmd, long).is_none() {
                    return Err(format!("{flag} ({long} here) is not a flag of `{path}`; see `{path} --help`"));
                }
                let v = value(&mut it).map_err(|_| format!("{flag} ({long}) needs a value"))?;
                if long == "--kv-dtype" {
                    match &kv {
                        Some(prev) if *prev != v => {
                            return Err(format!(
                                "-ctk and -ctv must name the same type here (one --kv-dtype for K and V): got {prev} and {v}"
                            ))
                        }
                        Some(_) => continue,
                        None => kv = Some(v.clone()),
                    }
                }
                out.push(long.to_string());
                out.push(v);
            }
            Meaning::Always(takes_value, why) => {
                if takes_value && inline.is_none() {
                    // `-fa` alone, or `-fa on|auto|1`; `-fa off` asks for what this engine does not do
                    if let Some(v) = it.as_slice().first().cloned() {
                        if ["on", "auto", "1", "true"].contains(&v.as_str()) {
                            it.next();
                        } else if ["off", "0", "false"].contains(&v.as_str()) {
                            return Err(format!("{flag} {v}: {why}, and cannot be turned off"));
                        }
                    }
                }
            }
            Meaning::No(why) => {
                return Err(format!("{flag} (llama.cpp's flag) has no meaning here: {why}"))
            }
            Meaning::Gpu(layers) => match value(&mut it)?.as_str() {
                // `-ngl 0 -dev CUDA0`: no layer on the device (as in llama.cpp), not the default of all
                n if layers && find_arg(cmd, "--device-layers").is_some() => {
                    out.push("--device-layers".into());
                    out.push(n.to_string());
                }
                "0" => {}
                n => {
                    return Err(format!(
                        "{flag} {n}: `{path}` has no --device-layers (-ngld: there is no separate draft model here; \
                         layers on a GPU: `run`, `chat`, `serve`, `perplexity` with --device cuda:0 --device-layers N, \
                         docs/DEVICES.md); -ngl 0 is accepted"
                    ))
                }
            },
            Meaning::Budget => match value(&mut it)?.as_str() {
                "-1" => {}
                "0" if find_arg(cmd, "--no-think").is_some() => out.push("--no-think".into()),
                "0" => return Err(format!("{flag} 0 (--no-think here) is not a flag of `{path}`")),
                n => {
                    return Err(format!(
                        "{flag} {n}: there is no thinking budget here: 0 (--no-think) turns thinking off, and -1 (no \
                         budget) is what happens anyway"
                    ))
                }
            },
            Meaning::RepeatLastN => match value(&mut it)?.as_str() {
                "-1" => {}
                n => {
                    return Err(format!(
                        "{flag} {n}: --repeat-penalty here applies to every token of the context (the prompt, its \
                         cached part included, and the output so far), as transformers' repetition_penalty: there is \
                         no window to set (-1, the whole context, is accepted)"
                    ))
                }
            },
        }
    }
    Ok(out)
}

/// How `chat` reads its messages (for the errors that point a prompt elsewhere).
const CHAT_READS: &str =
    "it reads its messages from the terminal (piped: from standard input, a line each)";

/// The error for `-xy…`, which is no flag of `cmd` (at `path`), saying how to give a value to a one-letter flag
/// when `-x` is one.
fn not_a_flag(cmd: &Command, path: &str, flag: &str) -> String {
    let (short, rest) = flag[1..].split_at(1);
    let hint = match find_arg(cmd, &format!("-{short}")) {
        Some(a) if a.get_action().takes_values() => {
            format!(" (a value of -{short} goes after a space: `-{short} {rest}`)")
        }
        _ => String::new(),
    };
    format!("{flag} is not a flag of `{path}`; see `{path} --help`{hint}")
}

/// `run -cnv` (or `--conversation`) is `chat`, as llama-cli's `-cnv` starts its conversation: the subcommand becomes
/// `chat` and the flag (with `--chat`, which the conversation always does) is dropped; `chat -cnv` drops it too.
/// Errors: a prompt option beside it (the conversation reads its prompts from the terminal).
fn conversation(mut args: Vec<String>) -> Result<Vec<String>, String> {
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let is_cnv = |a: &String| a == "-cnv" || a == "--conversation";
    let sub = args.get(1).map(String::as_str);
    if !matches!(sub, Some("run" | "chat")) || !args[..end].iter().any(is_cnv) {
        return Ok(args);
    }
    if let Some(p) = args[..end]
        .iter()
        .find(|a| PROMPT_FLAGS.contains(&a.split('=').next().unwrap_or(a)))
    {
        return Err(format!(
            "-cnv starts the interactive chat (`backburner chat`), which reads its prompts from the terminal: leave \
             out {p} (a system prompt goes in -sys / --system)"
        ));
    }
    args[1] = "chat".into();
    let mut i = 0;
    args.retain(|a| {
        i += 1;
        i > end || !(is_cnv(a) || a == "--chat")
    });
    Ok(args)
}

#[cfg(test)]
mod tests;
