//! llama.cpp's multi-letter short flags (`-ngl`, `-cnv`, `-fa`, `-np`, `-ctk`, `-ctv`, `-ub`, `-b`, …), read before
//! clap sees the arguments, which would otherwise take them as clusters of one-letter flags (`-fa` as `-f a`, a
//! prompt file named `a`; `-np 4` as `-n p`). Each is rewritten to this CLI's long flag where it means the same here,
//! accepted without effect where what it asks for is what happens anyway, and refused with a message naming it
//! otherwise.

/// What one llama.cpp flag becomes.
enum Meaning {
    /// The same flag here, taking the same value.
    Long(&'static str),
    /// Accepted: what it asks for is what this engine always does (takes a value when `bool` says so).
    Always(bool, &'static str),
    /// Refused, with why.
    No(&'static str),
    /// GPU layers: 0 (the CPU only, as scripts pass it) is what happens here; more is refused.
    Gpu,
}

fn meaning(flag: &str) -> Option<Meaning> {
    use Meaning::*;
    Some(match flag {
        "-ub" => Long("--ubatch"),
        "-np" => Long("--parallel"),
        "-ctk" | "-ctv" | "--cache-type-k" | "--cache-type-v" => Long("--kv-dtype"),
        "-sys" => Long("--system"),
        "-fa" | "--flash-attn" => Always(true, "attention over KV pages always runs as a fused online softmax (flash attention)"),
        "-no-cnv" | "--no-conversation" => Always(false, "run is single-turn"),
        "--jinja" => Always(false, "chat templates always render as transformers renders them (Jinja)"),
        "-ngl" | "-ngld" | "--n-gpu-layers" | "--gpu-layers" => Gpu,
        "-ts" | "-sm" | "-mg" => No("there is no GPU to split across; a model splits across machines with --layer-split"),
        "-cnv" | "--conversation" => No("the interactive conversation is `backburner chat`, or `backburner run -cnv`"),
        "-b" => No("prompts are ingested in --ubatch chunks with no logical batch above them; set -ub / --ubatch"),
        "-tb" => No("prefill and decode share one thread pool: set -t / --threads"),
        "-nkvo" => No("the KV cache lives in host memory (or on workers with --kv-budget); there is no device memory to keep it from"),
        "-ot" => No("tensors go to devices by layer (--layer-split) or by expert (--experts-worker), not by pattern"),
        "-hf" | "-hfr" | "-hff" => No("no model hub is reached: give a local checkpoint directory or GGUF file with -m"),
        _ => return None,
    })
}

/// `args` (program name first) with llama.cpp's multi-letter short flags rewritten. Errors: a message naming a flag
/// that means nothing here, one that lacks its value, or `-ctk` and `-ctv` with different types.
pub fn translate(args: Vec<String>) -> Result<Vec<String>, String> {
    let args = conversation(args)?;
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
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (a.clone(), None),
        };
        let Some(m) = meaning(&flag) else {
            out.push(a);
            continue;
        };
        match m {
            Meaning::Long(long) => {
                let v = match inline.or_else(|| it.next()) {
                    Some(v) => v,
                    None => return Err(format!("{flag} ({long}) needs a value")),
                };
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
                return Err(format!(
                    "{flag} (llama.cpp's flag) has no meaning here: {why}"
                ))
            }
            Meaning::Gpu => match inline.or_else(|| it.next()).as_deref() {
                Some("0") => {}
                Some(n) => {
                    return Err(format!(
                        "{flag} {n}: backburner has no GPU backend yet: layers run on the CPU (-ngl 0 is accepted), \
                         and on workers with --layer-split"
                    ))
                }
                None => return Err(format!("{flag} needs a value")),
            },
        }
    }
    Ok(out)
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
    let prompt = [
        "-p",
        "--prompt",
        "-f",
        "--prompt-file",
        "--file",
        "--prompt-tokens",
        "--prompt-tokens-file",
    ];
    if let Some(p) = args[..end]
        .iter()
        .find(|a| prompt.contains(&a.split('=').next().unwrap_or(a)))
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
mod tests {
    use super::translate;

    fn t(a: &[&str]) -> Result<Vec<String>, String> {
        translate(
            std::iter::once("bb")
                .chain(a.iter().copied())
                .map(String::from)
                .collect(),
        )
    }

    #[test]
    fn flags_with_a_meaning_become_long_ones_and_the_rest_are_named() {
        assert_eq!(
            t(
                &[
                    "serve", "-np", "4", "-ub", "256", "-ctk", "f16", "-ctv", "f16", "-fa", "-m",
                    "x"
                ]
            )
            .unwrap()[1..],
            [
                "serve",
                "--parallel",
                "4",
                "--ubatch",
                "256",
                "--kv-dtype",
                "f16",
                "-m",
                "x"
            ]
        );
        assert_eq!(
            t(&["run", "-fa", "on", "-p", "hi"]).unwrap()[1..],
            ["run", "-p", "hi"]
        );
        assert_eq!(
            t(&["run", "-ub=64"]).unwrap()[1..],
            ["run", "--ubatch", "64"]
        );
        assert!(t(&["run", "-ngl", "99"])
            .unwrap_err()
            .starts_with("-ngl 99: backburner has no GPU backend"));
        assert_eq!(
            t(&["run", "-ngl", "0", "-no-cnv", "--jinja"]).unwrap()[1..],
            ["run"]
        );
        assert!(t(&["run", "--n-gpu-layers=99"])
            .unwrap_err()
            .contains("--n-gpu-layers 99"));
        assert_eq!(
            t(&["run", "--flash-attn", "auto", "--cache-type-k", "bf16"]).unwrap()[1..],
            ["run", "--kv-dtype", "bf16"]
        );
        assert_eq!(
            t(&["run", "-m", "x", "-cnv", "-sys", "Be terse.", "--chat"]).unwrap()[1..],
            ["chat", "-m", "x", "--system", "Be terse."]
        );
        assert_eq!(
            t(&["run", "--conversation", "-n", "5"]).unwrap()[1..],
            ["chat", "-n", "5"]
        );
        assert_eq!(t(&["chat", "-cnv"]).unwrap()[1..], ["chat"]);
        assert!(t(&["run", "-cnv", "-p", "hi"])
            .unwrap_err()
            .contains("leave out -p"));
        assert!(t(&["serve", "-cnv"])
            .unwrap_err()
            .contains("backburner run -cnv"));
        assert!(t(&["run", "-b", "2048"]).unwrap_err().contains("-b"));
        assert!(t(&["run", "-fa", "off"]).unwrap_err().contains("-fa off"));
        assert!(t(&["run", "-ctk", "f16", "-ctv", "bf16"])
            .unwrap_err()
            .contains("-ctk and -ctv"));
        assert!(t(&["run", "-ub"]).unwrap_err().contains("needs a value"));
        // one-letter flags and values after `--` pass untouched
        assert_eq!(
            t(&["run", "-n", "5", "-t", "2"]).unwrap()[1..],
            ["run", "-n", "5", "-t", "2"]
        );
        assert_eq!(
            t(&["run", "--", "-ngl"]).unwrap()[1..],
            ["run", "--", "-ngl"]
        );
    }
}
