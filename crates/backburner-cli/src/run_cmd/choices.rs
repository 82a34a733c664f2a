//! `run --n-choices N`: printing the choices (each after a `[choice i]` line, or one `--json` object).

use anyhow::{bail, Result};
use backburner_engine::{Generation, StopReason};

use super::RunArgs;
use crate::out_line;

/// Prints the choices of `--n-choices` (each after a `[choice i]` line, or one `--json` object with a `choices`
/// array) and a closing stats line on stderr; fails as `run` does when a choice stopped on an error, exits 130 when
/// interrupted.
pub(super) fn report_choices(
    a: &RunArgs,
    prompt: &[u32],
    seed: u64,
    gens: &[Generation],
    total_s: f64,
) -> Result<()> {
    let text_of = |g: &Generation| {
        if g.text.is_empty() && !g.tokens.is_empty() && !a.json {
            // no tokenizer: the ids, as `run` streams them
            g.tokens.iter().map(|t| format!("{t} ")).collect()
        } else {
            g.text.clone()
        }
    };
    if a.json {
        let choices: Vec<serde_json::Value> = gens
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let mut c = serde_json::json!({
                    "index": i,
                    "seed": seed.wrapping_add(i as u64),
                    "tokens": g.tokens,
                    "text": g.text,
                    "stop_reason": g.stop_reason.as_str(),
                });
                if let Some(e) = &g.error {
                    c["error"] = e.clone().into();
                }
                if let Some(sc) = &g.speculative {
                    c["speculative"] = serde_json::to_value(sc).unwrap_or_default();
                }
                c
            })
            .collect();
        let tm = &gens[0].timings;
        let obj = serde_json::json!({
            "prompt_tokens": prompt,
            "seed": seed,
            "choices": choices,
            "timings": {"prefill_ms": tm.prefill_ms, "prefill_tok_s": tm.prefill_tok_s, "total_s": total_s},
        });
        out_line(&obj.to_string());
    } else {
        for (i, g) in gens.iter().enumerate() {
            out_line(&format!("[choice {i}]"));
            out_line(&text_of(g));
        }
        let generated: usize = gens.iter().map(|g| g.tokens.len()).sum();
        let mut stats = format!(
            "prompt {} tokens (prefilled once) | prefill {:.1} tok/s | {} choices | generated {generated} tokens in \
             {total_s:.2} s",
            prompt.len(),
            gens[0].timings.prefill_tok_s,
            gens.len(),
        );
        if a.sampling.temp > 0.0 {
            stats += &format!(
                " | seeds {seed}…{}",
                seed.wrapping_add(gens.len() as u64 - 1)
            );
        }
        stats += &crate::spec_args::stats_suffix(gens.iter().map(|g| &g.speculative));
        eprintln!("{stats}");
    }
    if gens
        .iter()
        .any(|g| g.stop_reason == StopReason::Interrupted)
    {
        std::process::exit(130);
    }
    if let Some((i, e)) = gens
        .iter()
        .enumerate()
        .find_map(|(i, g)| g.error.as_ref().map(|e| (i, e)))
    {
        bail!(
            "choice {i} stopped after {} tokens: {e}",
            gens[i].tokens.len()
        );
    }
    Ok(())
}
