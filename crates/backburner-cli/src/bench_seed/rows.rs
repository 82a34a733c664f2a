//! The seed table's rows: each runs its rounds (ours, then llama.cpp's where it has the configuration) and gathers
//! the figures into lines.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::{json, Value};

use super::llama::{ngl_from, tok_s, Llama};
use super::{arg, Line, LlamaRun, RowReport, Runner};
use backburner_kernels::kv::KvDtype;
use backburner_model::ModelConfig;

/// The file a row needs, or an error naming its option.
fn need<'a>(p: &'a Option<PathBuf>, opt: &str) -> Result<&'a PathBuf> {
    p.as_ref()
        .with_context(|| format!("this row needs {opt} FILE (a GGUF file; see `bench gen-gguf`)"))
}

/// The model's decoder layers and a short description of its shape.
fn shape(model: &Path) -> Result<(usize, String)> {
    let c = ModelConfig::from_dir(model)?;
    let name = model
        .file_name()
        .map_or(String::new(), |f| f.to_string_lossy().into_owned());
    Ok((
        c.num_hidden_layers,
        format!(
            "`{name}` ({} layers, hidden {}, intermediate {}, vocab {})",
            c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size
        ),
    ))
}

/// A number as an argument.
fn n(x: usize) -> String {
    x.to_string()
}

/// Zero to one: the layer split with the host under `--z2o-host-memory`, beside llama.cpp's RPC split of the same
/// layers.
pub(super) fn zero_to_one(r: &Runner) -> Result<RowReport> {
    let z = &r.a.z2o;
    let model = need(&z.model, "--z2o-model")?;
    let (layers, desc) = shape(model)?;
    let l = z.layer_split.unwrap_or(layers / 2);
    let mut lines = vec![
        Line::new("prefill", "tok/s", Some(64.0)),
        Line::new("decode", "tok/s", Some(3.9)),
        Line::new("decode: host", "ms/token", Some(87.0)),
        Line::new("decode: worker", "ms/token", Some(135.0)),
        Line::new("decode: link", "ms/token", Some(28.0)),
    ];
    let (p, d) = (n(z.prompt_tokens), n(z.decode_tokens));
    let mut host_bytes = 0.0;
    for round in 0..r.rounds("zero-to-one") {
        let mut args: Vec<String> = ["layer-split", "--model", &arg(model), "--no-local"]
            .into_iter()
            .map(String::from)
            .collect();
        args.extend(["--no-chain", "--no-shaped", "--rounds", "1", "--json"].map(String::from));
        args.extend([
            "--layer-split".into(),
            n(l),
            "--max-memory".into(),
            z.host_memory.clone(),
        ]);
        args.extend([
            "--prompt-tokens".into(),
            p.clone(),
            "--decode-tokens".into(),
            d.clone(),
        ]);
        args.extend(r.threads());
        let v = r.cached(&format!("zero-to-one-ours-{round}"), || r.ours(&args))?;
        let c = &v["results"][0];
        host_bytes = c["host_weight_bytes"].as_f64().unwrap_or(0.0);
        let ms = &c["decode_ms_per_token"];
        for (line, x) in lines.iter_mut().zip([
            &c["prefill_tok_s"],
            &c["decode_tok_s"],
            &ms["host"],
            &ms["workers"],
            &ms["link"],
        ]) {
            line.ours.push(x.as_f64().context("layer-split's JSON")?);
        }
        let name = format!("zero-to-one-llama-{round}");
        if let Some(v) = r.theirs(&name, |ll| {
            let s = ll.rpc_server()?;
            let rpc = [
                "--rpc".to_string(),
                s.addr.clone(),
                "-ngl".into(),
                n(ngl_from(l, layers)),
            ];
            let pre = [&rpc[..], &["-p".into(), p.clone(), "-n".into(), "0".into()]].concat();
            let dec = [
                &rpc[..],
                &[
                    "-p".into(),
                    "0".into(),
                    "-n".into(),
                    d.clone(),
                    "-d".into(),
                    p.clone(),
                ],
            ]
            .concat();
            Ok(json!({"prefill": ll.bench(model, &pre)?, "decode": ll.bench(model, &dec)?}))
        })? {
            lines[0].llama.push(tok_s(&v["prefill"])?);
            lines[1].llama.push(tok_s(&v["decode"])?);
        }
    }
    Ok(RowReport {
        row: "zero-to-one",
        title: "Zero to one: a host that cannot hold the model, plus one worker".into(),
        setup: format!(
            "{desc}; host layers 0..{l} under `--max-memory {}` ({:.2} GB of weights held), worker layers \
             {l}..{layers}; host {} thread(s), worker {} thread(s), loopback; prompt {p} tokens, decode {d} tokens. \
             llama.cpp: `llama-bench --rpc` with `-ngl {}` (the same layers on a `ggml-rpc-server`; its host has no \
             memory budget and maps the whole file). The original: 27B IQ2_XS, 8 GB laptop + phone over USB-C.",
            z.host_memory,
            host_bytes / 1e9,
            r.a.threads,
            r.a.worker_threads,
            ngl_from(l, layers)
        ),
        lines,
    })
}

/// The original's long-prefill figures (tokens → local, split tok/s).
fn seed_prefill(depth: usize) -> (Option<f64>, Option<f64>) {
    match depth {
        16384 => (Some(109.0), Some(157.0)),
        32768 => (Some(101.0), Some(130.0)),
        49152 => (Some(87.0), Some(113.0)),
        _ => (None, None),
    }
}

/// Long-context prefill per file and depth: local vs split, beside llama.cpp local and its RPC split.
pub(super) fn long_prefill(r: &Runner) -> Result<RowReport> {
    let a = &r.a.prefill;
    if a.models.is_empty() {
        anyhow::bail!("the long-prefill row needs --prefill-models FILE[,FILE]");
    }
    let mut lines = Vec::new();
    let mut setup = Vec::new();
    for (i, model) in a.models.iter().enumerate() {
        setup.push(prefill_file(r, i, model, &mut lines)?);
    }
    Ok(RowReport {
        row: "long-prefill",
        title: "Long-context prefill: local vs split prefill with a worker".into(),
        setup: format!(
            "{}. Host {} thread(s) (local runs too), worker {} thread(s), loopback, ubatch 512, KV {} (both \
             engines), our `--precision {}`. The original: 27B, 64 layers, on its laptop + phone.",
            setup.join("; "),
            r.a.threads,
            r.a.worker_threads,
            a.kv,
            a.precision
        ),
        lines,
    })
}

/// Pushes the samples of a run's per-depth objects `runs` onto the lines of their depth (`lines[first + 2k]` local,
/// `+ 1` split, for `depths[k]`; `keys`: the objects' local and split fields, a null one not run). Errors: a depth
/// not among `depths` (a file of another table), a field not a rate.
fn push_depths(
    lines: &mut [Line],
    first: usize,
    depths: &[usize],
    runs: &[Value],
    keys: [&str; 2],
    llama: bool,
) -> Result<()> {
    for x in runs {
        // a number (or, in the first tables' llama.cpp runs, a string)
        let t = &x["tokens"];
        let tokens = t.as_u64().or_else(|| t.as_str()?.parse().ok());
        let tokens = tokens.and_then(|t| usize::try_from(t).ok());
        let k = depths
            .iter()
            .position(|&d| Some(d) == tokens)
            .with_context(|| {
                format!("a run in --out is of {tokens:?} tokens, not of --prefill-depths")
            })?;
        for (j, key) in keys.into_iter().enumerate() {
            let line = &mut lines[first + 2 * k + j];
            match (llama, &x[key]) {
                (true, Value::Null) => {}
                (true, v) => line.llama.push(tok_s(v)?),
                (false, v) => line.ours.push(v.as_f64().context("split-prefill's JSON")?),
            }
        }
    }
    Ok(())
}

/// The long-prefill rounds of file `i`: its lines pushed onto `lines`; returns its setup's description.
fn prefill_file(r: &Runner, i: usize, model: &Path, lines: &mut Vec<Line>) -> Result<String> {
    let a = &r.a.prefill;
    let (layers, desc) = shape(model)?;
    let stem = model
        .file_stem()
        .map_or(String::new(), |f| f.to_string_lossy().into_owned());
    let first = lines.len();
    for &dp in &a.depths {
        let (sl, ss) = seed_prefill(dp);
        lines.push(Line::new(
            format!("{stem}: {dp} tokens, local"),
            "tok/s",
            sl,
        ));
        lines.push(Line::new(
            format!("{stem}: {dp} tokens, split"),
            "tok/s",
            ss,
        ));
    }
    let depths: Vec<String> = a.depths.iter().map(|x| x.to_string()).collect();
    let mut split_layer = layers / 2;
    for round in 0..r.rounds(&format!("long-prefill-{i}")) {
        let mut args: Vec<String> = vec!["split-prefill".into(), "--model".into(), arg(model)];
        args.extend(["--depths".into(), depths.join(","), "--no-shaped".into()]);
        args.extend(["--pings", "100", "--precision", &a.precision].map(String::from));
        args.extend(["--kv-dtype".into(), a.kv.to_string()]);
        args.extend(r.threads());
        let v = r.cached(&format!("long-prefill-{i}-ours-{round}"), || r.ours(&args))?;
        split_layer = v["split_layer"]
            .as_u64()
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l > 0 && l < layers)
            .context("split-prefill's JSON: split_layer")?;
        let res = v["results"].as_array().context("split-prefill's JSON")?;
        push_depths(
            lines,
            first,
            &a.depths,
            res,
            ["local_tok_s", "split_tok_s"],
            false,
        )?;
        let ngl = ngl_from(split_layer, layers);
        let name = format!("long-prefill-{i}-llama-{round}");
        if let Some(v) = r.theirs(&name, |ll| {
            llama_prefill(ll, model, (&a.depths, a.kv), &a.llama_runs, ngl)
        })? {
            let runs = v.as_array().context("llama's runs")?;
            push_depths(lines, first, &a.depths, runs, ["local", "rpc"], true)?;
        }
    }
    Ok(format!(
        "{desc}: split at layer {split_layer} (host 0..{split_layer}, worker {split_layer}..{layers}); llama.cpp \
         `-ngl {}` on its RPC server, `-b` = the prompt so that it pipelines ubatches",
        ngl_from(split_layer, layers)
    ))
}

/// llama.cpp's prefill of each of `depths` on `model`: local and/or (`runs`) with `-ngl ngl` on an RPC server, `-b`
/// the prompt so that it pipelines ubatches across the two, without llama-bench's warm-up pass; one object per depth
/// (`local`, `rpc`: llama-bench's report, or null when not run).
fn llama_prefill(
    ll: &Llama,
    model: &Path,
    (depths, kv): (&[usize], KvDtype),
    runs: &[LlamaRun],
    ngl: usize,
) -> Result<Value> {
    let mut out = Vec::new();
    for &dp in depths {
        // no warm-up pass: at these lengths it doubles the time and touches nothing the timed pass does not
        let base = ["-p", &n(dp), "-n", "0", "-b", &n(dp), "--no-warmup"].map(String::from);
        let local = match runs.contains(&LlamaRun::Local) {
            true => ll.bench_kv(model, &base, kv)?,
            false => Value::Null,
        };
        let rpc = match runs.contains(&LlamaRun::Rpc) {
            true => {
                let s = ll.rpc_server()?;
                let head = ["--rpc".to_string(), s.addr.clone(), "-ngl".into(), n(ngl)];
                ll.bench_kv(model, &[&head[..], &base[..]].concat(), kv)?
            }
            false => Value::Null,
        };
        out.push(json!({"tokens": dp, "local": local, "rpc": rpc}));
    }
    Ok(Value::Array(out))
}

/// Decode at a long context: the whole KV cache on the host vs half of its pages on a worker.
pub(super) fn offload_decode(r: &Runner) -> Result<RowReport> {
    let o = &r.a.offload;
    let model = need(&o.model, "--offload-model")?;
    let (_, desc) = shape(model)?;
    let mut lines = vec![
        Line::new("local", "ms/token", Some(279.0)),
        Line::new("half the pages on a worker", "ms/token", Some(176.0)),
        Line::new("half the pages on two workers", "ms/token", None),
    ];
    for round in 0..r.rounds("offload-decode") {
        let mut args: Vec<String> = vec!["decode-offload".into(), "--model".into(), arg(model)];
        args.extend([
            "--depth".into(),
            n(o.depth),
            "--ingest-tokens".into(),
            "0".into(),
        ]);
        args.extend([
            "--reps".into(),
            "3".into(),
            "--kv-page-size".into(),
            n(o.page_size),
        ]);
        args.extend(r.threads());
        let v = r.cached(&format!("offload-decode-ours-{round}"), || r.ours(&args))?;
        for c in v["decode"].as_array().context("decode-offload's JSON")? {
            let k = match c["config"].as_str() {
                Some("local") => 0,
                Some("one_worker") => 1,
                Some("two_workers") => 2,
                _ => continue,
            };
            lines[k]
                .ours
                .push(c["decode_ms_per_token"].as_f64().unwrap_or(f64::NAN));
        }
    }
    Ok(RowReport {
        row: "offload-decode",
        title: format!("Decode at {} positions with KV pages on a worker", o.depth),
        setup: format!(
            "{desc}; KV pages of {} positions, the cache filled with synthetic rows to {} positions (decode time depends on their number, not \
             their values), packed pages on the worker; host {} thread(s), worker {} thread(s) each, loopback; 3 \
             alternating repetitions per round. llama.cpp has no KV cache on another machine's memory: no figure. \
             The original: 27B at 140k, laptop + phone.",
            o.page_size, o.depth, r.a.threads, r.a.worker_threads
        ),
        lines,
    })
}

/// The agent session's longest turn, cold: alone vs with a worker (split prefill).
pub(super) fn session(r: &Runner) -> Result<RowReport> {
    let model = need(&r.a.session.model, "--session-model")?;
    let (_, desc) = shape(model)?;
    let turn = r.a.session.turn;
    let mut lines = vec![
        Line::new("time to first answer, alone", "s", Some(245.0)),
        Line::new("time to first answer, with a worker", "s", Some(168.0)),
    ];
    let mut tokens = 0;
    for round in 0..r.rounds("session") {
        let file = r.a.out.join(format!("session-ours-{round}.run.json"));
        let mut args: Vec<String> = vec!["session".into(), "--model".into(), arg(model)];
        args.extend([
            "--cold-turns".into(),
            n(turn),
            "--turns".into(),
            n(turn + 1),
        ]);
        args.extend([
            "--modes".into(),
            "cold,worker".into(),
            "--json".into(),
            arg(&file),
        ]);
        args.extend(r.threads());
        let v = r.cached(&format!("session-ours-{round}"), || {
            r.ours_to_file(&args, &file)
        })?;
        let t = &v["totals"];
        lines[0]
            .ours
            .push(t["cold_s"].as_f64().context("session's JSON")?);
        lines[1]
            .ours
            .push(t["worker_s"].as_f64().context("session's JSON")?);
        tokens = v["turns"][0]["prompt_tokens"].as_u64().unwrap_or(0);
    }
    Ok(RowReport {
        row: "session",
        title: "Time to the first answer of the agent session's longest turn".into(),
        setup: format!(
            "{desc}; the shipped agent transcript's turn {turn} ({tokens} prompt tokens through the Qwen3.5 chat \
             template) sent cold over HTTP to `serve`, alone vs with a worker taking part of the prefill; server {} \
             thread(s), worker {} thread(s), loopback. llama.cpp's server has no split prefill: its cold time is \
             the long-prefill row's local figure. The original: 27B, a 27k-token agent session, laptop + phone.",
            r.a.threads, r.a.worker_threads
        ),
        lines,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_land_on_their_depths_lines_and_a_foreign_depth_is_refused() {
        let mut lines: Vec<Line> = (0..4).map(|_| Line::new("x", "tok/s", None)).collect();
        let ours = [json!({"tokens": 4096, "local_tok_s": 10.0, "split_tok_s": 20.0})];
        push_depths(
            &mut lines,
            0,
            &[1024, 4096],
            &ours,
            ["local_tok_s", "split_tok_s"],
            false,
        )
        .unwrap();
        assert!(lines[0].ours.is_empty() && lines[1].ours.is_empty());
        assert_eq!(
            (lines[2].ours.clone(), lines[3].ours.clone()),
            (vec![10.0], vec![20.0])
        );
        let theirs = [json!({"tokens": "1024", "local": null, "rpc": [{"avg_ts": 7.5}]})];
        push_depths(
            &mut lines,
            0,
            &[1024, 4096],
            &theirs,
            ["local", "rpc"],
            true,
        )
        .unwrap();
        assert_eq!(
            (lines[0].llama.len(), lines[1].llama.clone()),
            (0, vec![7.5])
        );
        let e = push_depths(
            &mut lines,
            0,
            &[1024],
            &ours,
            ["local_tok_s", "split_tok_s"],
            false,
        );
        assert!(e.unwrap_err().to_string().contains("of Some(4096) tokens"));
    }
}
