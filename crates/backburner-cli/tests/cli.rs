//! The `backburner` binary end to end on the committed fixtures.

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn reference(name: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("reference.json")).unwrap())
        .unwrap()
}

fn bb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backburner"))
        .args(args)
        .env(
            "BACKBURNER_CACHE",
            std::env::temp_dir().join("backburner-cli-test-cache"),
        )
        .output()
        .expect("run backburner")
}

fn json_out(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)))
}

#[test]
fn run_json_from_token_ids_gives_the_reference_greedy_tokens() {
    let r = reference("tiny-f32");
    let ids: Vec<u32> = serde_json::from_value(r["prompt_ids"].clone()).unwrap();
    let ids_s = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let m = fixture("tiny-f32");
    let o = bb(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt-tokens",
        &ids_s,
        "--max-tokens",
        "32",
        "--ignore-eos",
        "--kv-dtype",
        "f32",
        "--ubatch",
        "64",
        "--json",
    ]);
    let v = json_out(&o);
    assert_eq!(v["prompt_tokens"], r["prompt_ids"]);
    assert_eq!(v["tokens"], r["greedy"]["tokens"]);
    for k in ["ttft_ms", "prefill_tok_s", "decode_tok_s"] {
        assert!(v["timings"][k].as_f64().unwrap() > 0.0, "{k}");
    }
}

#[test]
fn run_json_from_a_text_prompt_file_tokenizes_like_transformers() {
    let r = reference("tiny-bf16");
    let m = fixture("tiny-bf16");
    let p = m.join("prompt.txt");
    let o = bb(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt-file",
        p.to_str().unwrap(),
        "--max-tokens",
        "32",
        "--ignore-eos",
        "--kv-dtype",
        "f32",
        "--json",
    ]);
    let v = json_out(&o);
    assert_eq!(v["prompt_tokens"], r["prompt_ids"]);
    assert_eq!(v["tokens"], r["greedy"]["tokens"]);
    assert!(v["text"].is_string());
}

#[test]
fn llama_cpp_short_flags_mean_the_long_ones() {
    let m = fixture("tiny-bf16");
    let p = m.join("prompt.txt");
    let (m, p) = (m.to_str().unwrap(), p.to_str().unwrap());
    // The same run spelled three ways: (model, prompt file, max tokens, threads, ctx, seed) flags.
    let spellings = [
        [
            "--model",
            "--prompt-file",
            "--max-tokens",
            "--threads",
            "--ctx-size",
            "--seed",
        ],
        ["-m", "-f", "-n", "-t", "-c", "-s"],
        ["-m", "--file", "--n-predict", "-t", "-c", "-s"],
    ];
    let outs: Vec<serde_json::Value> = spellings
        .iter()
        .map(|f| {
            let values = [m, p, "5", "1", "400", "3"];
            let mut args = vec!["run", "--temp", "0.8", "--ignore-eos", "--json"];
            for (flag, value) in f.iter().zip(values) {
                args.extend([*flag, value]);
            }
            json_out(&bb(&args))
        })
        .collect();
    let want = &outs[0];
    assert_eq!(want["tokens"].as_array().unwrap().len(), 5);
    for v in &outs[1..] {
        assert_eq!(
            (&v["prompt_tokens"], &v["tokens"], &v["seed"]),
            (&want["prompt_tokens"], &want["tokens"], &want["seed"])
        );
    }
    let text = bb(&[
        "run",
        "-m",
        m,
        "-p",
        "Hello",
        "-n",
        "2",
        "--ignore-eos",
        "--json",
    ]);
    assert_eq!(json_out(&text)["tokens"].as_array().unwrap().len(), 2);
}

#[test]
fn run_streams_text_and_prints_a_stats_line() {
    let m = fixture("tiny-f32");
    let o = bb(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "8",
        "--ignore-eos",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("prompt ")
            && err.contains("prefill")
            && err.contains("decode")
            && err.contains("ttft"),
        "{err}"
    );
}

#[test]
fn chat_applies_the_template() {
    let m = fixture("tiny-hub");
    let r = reference("tiny-hub");
    let o = bb(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--chat",
        "--system",
        "You are terse.",
        "--prompt",
        "Hello there",
        "--max-tokens",
        "2",
        "--json",
    ]);
    let v = json_out(&o);
    assert_eq!(v["prompt_tokens"], r["chat_reference"]["ids"]);
}

#[test]
fn generation_stops_when_the_context_is_full() {
    let m = fixture("tiny-f32");
    let o = bb(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt-tokens",
        "1,2,3",
        "--ctx-size",
        "10",
        "--max-tokens",
        "50",
        "--ignore-eos",
        "--json",
    ]);
    let v = json_out(&o);
    assert_eq!(v["stop_reason"], "context_full");
    assert_eq!(v["tokens"].as_array().unwrap().len(), 7);
}

#[test]
fn n_minus_1_generates_until_the_context_is_full_as_in_llama_cpp() {
    let m = fixture("tiny-f32");
    let m = m.to_str().unwrap();
    for n in ["-1", "-2"] {
        let o = bb(&[
            "run",
            "-m",
            m,
            "--prompt-tokens",
            "1,2,3",
            "-c",
            "10",
            "-n",
            n,
            "--ignore-eos",
            "--json",
        ]);
        let v = json_out(&o);
        assert_eq!(v["stop_reason"], "context_full", "-n {n}");
        assert_eq!(v["tokens"].as_array().unwrap().len(), 7, "-n {n}");
    }
    let o = bb(&["run", "-m", m, "--prompt-tokens", "1", "-n", "-3"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--max-tokens -3: give a count, or -1"));
}

#[test]
fn multi_letter_short_flags_are_never_clusters_and_values_that_look_like_flags_pass() {
    let m = fixture("tiny-hub");
    let m = m.to_str().unwrap();
    // accepted llama.cpp flags, and a prompt and a stop string that look like flags
    let o = bb(&[
        "run",
        "-m",
        m,
        "-st",
        "-cmoe",
        "--no-mmap",
        "-p",
        "-st",
        "--stop",
        "-xy",
        "-n",
        "2",
        "-t",
        "1",
        "--json",
    ]);
    let v = json_out(&o);
    assert_eq!(v["tokens"].as_array().unwrap().len(), 2);
    // the errors name the flag instead of a one-letter flag it does not contain
    for (args, msg) in [
        (
            &["run", "-st", "-sysf", "s.txt"][..],
            "error: -sysf is not a flag of `backburner run`",
        ),
        (
            &["run", "-fit", "on"],
            "error: -fit is not a flag of `backburner run`",
        ),
        (
            &["serve", "-cb", "-kvu"],
            "error: -kvu is not a flag of `backburner serve`",
        ),
        (
            &["run", "-dev", "GPU0"],
            "'GPU0' is not a device name: use cpu, cuda:N or vulkan:N",
        ),
        (
            &["chat", "-p", "hi"],
            "for a one-shot answer use `backburner run --chat -p TEXT`",
        ),
        (
            &["chat", "hello there"],
            "chat takes no message on the command line (\"hello there\")",
        ),
    ] {
        let o = bb(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(msg), "{args:?}: {err}");
    }
}

#[test]
fn ctx_size_0_means_the_models_own_context_as_in_llama_cpp() {
    let m = fixture("tiny-f32");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt-tokens",
            "1,2,3",
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--json",
        ];
        args.extend(extra);
        json_out(&bb(&args))
    };
    let (zero, default) = (run(&["-c", "0"]), run(&[]));
    assert_eq!(zero["stop_reason"], "max_tokens");
    assert_eq!(zero["tokens"].as_array().unwrap().len(), 12);
    assert_eq!(zero["tokens"], default["tokens"]);
}

#[test]
fn no_think_closes_the_thinking_block_of_the_qwen35_template() {
    // The bundled default model carries the real Qwen3.5 template; with --no-think it renders an empty think block.
    let with = json_out(&bb(&[
        "run",
        "--chat",
        "--prompt",
        "Hi",
        "--max-tokens",
        "1",
        "--json",
    ]));
    let without = json_out(&bb(&[
        "run",
        "--chat",
        "--no-think",
        "--prompt",
        "Hi",
        "--max-tokens",
        "1",
        "--json",
    ]));
    let (a, b) = (
        with["prompt_tokens"].as_array().unwrap().len(),
        without["prompt_tokens"].as_array().unwrap().len(),
    );
    assert!(b > a, "{a} vs {b}");
    assert_eq!(
        with["prompt_tokens"].as_array().unwrap().last(),
        Some(&serde_json::json!(198)),
        "ends in <think>\\n"
    );
}

#[test]
fn perplexity_json_agrees_with_transformers() {
    let r = reference("tiny-f32");
    let m = fixture("tiny-f32");
    let f = m.join("ppl.txt");
    let o = bb(&[
        "perplexity",
        "--model",
        m.to_str().unwrap(),
        "--file",
        f.to_str().unwrap(),
        "--ctx",
        "64",
        "--kv-dtype",
        "f32",
        "--json",
    ]);
    let v = json_out(&o);
    let want = r["ppl_ctx64"]["nll"].as_f64().unwrap();
    assert!(
        (v["nll"].as_f64().unwrap() - want).abs() < 1e-3,
        "{v} vs {want}"
    );
    assert_eq!(v["n_tokens"], r["ppl_ctx64"]["n_tokens"]);
}

#[test]
fn a_gguf_without_a_tokenizer_says_so_and_scores_and_runs_token_ids() {
    use backburner_model::gguf::writer::GgufWriter;
    use backburner_model::gguf::MetaValue;
    use backburner_model::{GgufFile, ModelConfig, TextTokenizer};
    let src = fixture("gguf/tiny-f32.gguf");
    let d = tempfile::tempdir().unwrap();
    let bare = d.path().join("bare.gguf");
    GgufWriter::copy_of(&GgufFile::open(&src).unwrap())
        .unwrap()
        .remove("tokenizer.ggml.model")
        .kv("tokenizer.ggml.model", MetaValue::Str("none".into()))
        .write(&bare)
        .unwrap();
    let bs = bare.to_str().unwrap();
    let text = fixture("tiny-f32").join("ppl.txt");
    let o = bb(&["run", "--model", bs, "--prompt", "hi"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains("whose `tokenizer.ggml.model` is `none`") && !err.contains("warning above"),
        "{err}"
    );
    // perplexity on the file without a tokenizer: (success, stderr)
    let on_bare = |extra: &[&str]| {
        let o = bb(&[&["perplexity", "--model", bs][..], extra].concat());
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (_, err) = on_bare(&["--file", text.to_str().unwrap()]);
    assert!(err.contains("give token ids with --tokens-file"), "{err}");
    // the same text as ids scores exactly as the original file does from text
    let vocab = ModelConfig::from_dir(&src).unwrap().vocab_size;
    let tok = TextTokenizer::from_dir(&src, vocab, &[]).unwrap().unwrap();
    let ids = tok
        .encode(&std::fs::read_to_string(&text).unwrap())
        .unwrap();
    let ids_file = d.path().join("ids.json");
    let ids_path = ids_file.to_str().unwrap();
    std::fs::write(&ids_file, serde_json::to_string(&ids).unwrap()).unwrap();
    let ppl = |model: &str, arg: &str, file: &str| {
        json_out(&bb(&[
            "perplexity",
            "--model",
            model,
            arg,
            file,
            "-c",
            "64",
            "--json",
        ]))
    };
    let from_text = ppl(src.to_str().unwrap(), "-f", text.to_str().unwrap());
    let from_ids = ppl(bs, "--tokens-file", ids_path);
    assert_eq!(from_ids, from_text);
    assert_eq!(from_ids["n_tokens"], ids.len());
    // a window whose second half predicts nothing is an error, not a NaN
    let (ok, err) = on_bare(&["--tokens-file", ids_path, "--ctx", "2", "--second-half"]);
    assert!(!ok && err.contains("no token was scored"), "{err}");
    // ids outside the vocabulary, and both inputs at once, are refused
    std::fs::write(&ids_file, format!("[1, {vocab}]")).unwrap();
    let (ok, err) = on_bare(&["--tokens-file", ids_path]);
    assert!(
        !ok && err.contains(&format!("token id {vocab} is out of range")),
        "{err}"
    );
    let (ok, err) = on_bare(&["--tokens-file", "x", "--file", "y"]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");
}

#[test]
fn a_tokenizer_far_smaller_than_the_models_vocabulary_is_warned_about() {
    let d = tempfile::tempdir().unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(fixture("tiny-f32").join(f), d.path().join(f)).unwrap();
    }
    let m = d.path().to_str().unwrap();
    let run = || {
        let o = bb(&["run", "--model", m, "--prompt", "hi", "--max-tokens", "1"]);
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let mut cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("tiny-f32").join("config.json")).unwrap(),
    )
    .unwrap();
    // the fixture's 448 ids against its 512 rows: no warning
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    assert!(!run().contains("likely another model's tokenizer"));
    // against 1024 rows (the weights then fail to load, after the warning)
    cfg["vocab_size"] = 1024.into();
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    let err = run();
    assert!(
        err.contains(
            "has 448 ids but the model embeds 1024: it is likely another model's tokenizer"
        ),
        "{err}"
    );
}

#[test]
fn text_options_without_a_tokenizer_say_they_need_one() {
    let d = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("tiny-f32").join(f), d.path().join(f)).unwrap();
    }
    let m = d.path().to_str().unwrap();
    let o = bb(&["run", "--model", m, "--prompt", "hi"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(
            "a text prompt needs a tokenizer, and this model has none: no tokenizer.json in"
        ),
        "{err}"
    );
    // ids still work, and the output is ids
    let o = bb(&[
        "run",
        "--model",
        m,
        "--prompt-tokens",
        "[1, 2, 3]",
        "--max-tokens",
        "3",
        "--ignore-eos",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        out.split_whitespace()
            .filter(|w| w.parse::<u32>().is_ok())
            .count(),
        3,
        "{out}"
    );
}

#[test]
fn bad_inputs_fail_with_a_clear_message() {
    let m = fixture("tiny-f32");
    let ms = m.to_str().unwrap();
    let mut many_stops = vec!["run", "--model", ms, "--prompt", "x"];
    for _ in 0..17 {
        many_stops.extend(["--stop", "s"]);
    }
    let long_stop = "é".repeat(129);
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            many_stops,
            "error: --stop: at most 16 non-empty per request, got 17\n",
        ),
        (
            vec![
                "run", "--model", ms, "--prompt", "x", "--stop", "a", "--stop", &long_stop,
            ],
            "error: --stop: at most 256 bytes each (UTF-8), but string 1 has 258 bytes\n",
        ),
        (
            vec!["run", "--model", "/nonexistent/dir", "--prompt", "x"],
            "cannot read",
        ),
        (
            vec!["run", "--model", ms, "--prompt-tokens", "1,2,999999"],
            "out of range",
        ),
        (
            vec!["run", "--model", ms, "--prompt-tokens", "1,x"],
            "not a non-negative integer",
        ),
        (
            vec![
                "run",
                "--model",
                ms,
                "--prompt",
                "The quick brown fox jumps over the lazy dog",
                "--ctx-size",
                "4",
            ],
            "context overflow",
        ),
        (
            vec!["run", "--model", ms, "--prompt", "x", "--temp", "nan"],
            "--temp",
        ),
        (
            vec!["run", "--model", ms, "--prompt", "x", "--temp", "-1"],
            "--temp",
        ),
        (
            vec!["run", "--model", ms, "--prompt", "x", "--top-p", "0"],
            "--top-p",
        ),
        (
            vec!["run", "--model", ms, "--prompt", "x", "--min-p", "2"],
            "--min-p",
        ),
        (
            vec!["run", "--model", ms, "--prompt", "x", "--threads", "100000"],
            "--threads",
        ),
        (vec!["run", "--model", ms, "--prompt", ""], "empty"),
        (vec!["run", "--model", ms], "give a prompt"),
        (
            vec!["run", "--model", ms, "--prompt", "x", "--kv-dtype", "q4"],
            "q4",
        ),
    ];
    for (args, want) in cases {
        let o = bb(&args);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

#[test]
fn a_closed_stdout_ends_the_run_quietly() {
    use std::process::Stdio;
    let m = fixture("tiny-f32");
    let mut child = Command::new(env!("CARGO_BIN_EXE_backburner"))
        .args([
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt",
            "hello",
            "--max-tokens",
            "200",
            "--ignore-eos",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away, like `| head -c0`
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(o.status.code(), Some(0), "{err}");
}

#[test]
fn the_stats_line_leaves_out_rates_it_cannot_measure_and_shows_a_random_seed() {
    let m = fixture("tiny-f32");
    let ms = m.to_str().unwrap();
    let stats = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            ms,
            "--prompt-tokens",
            "1,2,3",
            "--ignore-eos",
        ];
        args.extend_from_slice(extra);
        let o = bb(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).trim_end().to_string()
    };
    let e = stats(&["--max-tokens", "0"]);
    assert!(e.contains("| generated 0 tokens (max_tokens) in "), "{e}");
    assert!(!e.contains("decode") && !e.contains("ttft"), "{e}");
    let e = stats(&["--max-tokens", "1"]);
    assert!(e.contains("ttft") && !e.contains("decode"), "{e}");
    let e = stats(&["--max-tokens", "3", "--temp", "0.8", "--seed", "7"]);
    assert!(e.contains("| decode ") && e.ends_with(" s | seed 7"), "{e}");
    // greedy: no seed is used, none is shown
    let e = stats(&["--max-tokens", "3"]);
    assert!(!e.contains("seed"), "{e}");
}

/// Sends SIGINT to a child, as Ctrl-C in a terminal does (through the `kill` utility: no libc dependency).
#[cfg(unix)]
fn ctrl_c(child: &std::process::Child) {
    let st = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(st.success());
}

#[cfg(unix)]
fn spawn_long_run(extra: &[&str]) -> std::process::Child {
    use std::process::Stdio;
    // the bundled model: about 30 tokens/s, so a million tokens outlast any test
    Command::new(env!("CARGO_BIN_EXE_backburner"))
        .args([
            "run",
            "--prompt",
            "Hello",
            "--max-tokens",
            "1000000",
            "--ignore-eos",
        ])
        .args(extra)
        .env(
            "BACKBURNER_CACHE",
            std::env::temp_dir().join("backburner-cli-test-cache"),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[cfg(unix)]
#[test]
fn ctrl_c_prints_the_text_so_far_and_the_stats_line_and_exits_130() {
    use std::io::Read;
    let mut child = spawn_long_run(&[]);
    let mut out = child.stdout.take().unwrap();
    // text is streaming, so generation (and its Ctrl-C handler) has started
    let mut text = vec![0u8; 1];
    out.read_exact(&mut text).unwrap();
    ctrl_c(&child);
    out.read_to_end(&mut text).unwrap();
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    let stats = err.lines().last().unwrap();
    assert!(
        stats.starts_with("prompt 1 tokens | prefill ")
            && stats.contains(" tokens (interrupted) in "),
        "{err}"
    );
    assert!(text.ends_with(b"\n") && text.len() > 1);
}

#[cfg(unix)]
#[test]
fn ctrl_c_with_json_prints_the_object_with_stop_reason_interrupted_and_exits_130() {
    // With --json nothing shows that generation has started. Wait until the process catches SIGINT (its handler is
    // installed just before generation; a signal sent earlier would kill it, or be lost where the test runs with
    // SIGINT ignored, as background jobs of a non-interactive shell do), then signal once.
    let child = spawn_long_run(&["--json", "--temp", "0.7", "--seed", "3"]);
    let waited = std::time::Instant::now();
    while !catches_sigint(child.id()) {
        assert!(
            waited.elapsed() < std::time::Duration::from_secs(300),
            "the run never installed its Ctrl-C handler"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::thread::sleep(std::time::Duration::from_millis(500));
    ctrl_c(&child);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&o.stdout)));
    assert_eq!(v["stop_reason"], "interrupted");
    assert_eq!(v["seed"], 3);
    assert_eq!(v["prompt_tokens"].as_array().unwrap().len(), 1);
    assert!(v["tokens"].is_array() && v["text"].is_string(), "{v}");
}

/// Whether process `pid` has a handler for SIGINT (Linux: bit 1 of `SigCgt` in `/proc/PID/status`). Elsewhere, after
/// a fixed 3 s (the handler is installed within a second of loading the bundled model).
#[cfg(unix)]
fn catches_sigint(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(s) => s
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .is_some_and(|m| m & 0x2 != 0),
        Err(_) => {
            std::thread::sleep(std::time::Duration::from_secs(3));
            true
        }
    }
}

#[test]
fn perplexity_checks_the_window_up_front_and_takes_only_ctx() {
    let m = fixture("tiny-f32");
    let ms = m.to_str().unwrap();
    // more than the fixture's 4096-token context
    let d = tempfile::tempdir().unwrap();
    let long = d.path().join("long.txt");
    std::fs::write(
        &long,
        std::fs::read_to_string(m.join("ppl.txt"))
            .unwrap()
            .repeat(60),
    )
    .unwrap();
    let ls = long.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![],
            "tokens, longer than the model's context of 4096 tokens (max_position_embeddings): score it in windows with --ctx 4096",
        ),
        (
            vec!["--ctx", "5000"],
            "--ctx 5000 is longer than the model's context of 4096 tokens",
        ),
        (vec!["--ctx", "1"], "--ctx 1 is too short: a window needs at least 2 tokens"),
        (vec!["--ctx", "0"], "--ctx 0 is too short"),
        (vec!["--ctx-size", "64"], "perplexity takes --ctx 64"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["perplexity", "--model", ms, "--file", ls];
        args.extend_from_slice(&extra);
        let o = bb(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
        assert!(!err.contains("context overflow"), "{err}");
    }
    let v = json_out(&bb(&[
        "perplexity",
        "--model",
        ms,
        "--file",
        ls,
        "--ctx",
        "4096",
        "--json",
    ]));
    let n = v["n_tokens"].as_u64().unwrap();
    assert!(n > 4096 && n % 4096 >= 2, "{v}");
    assert_eq!(v["ctx"], 4096);
    assert_eq!(v["n_scored"].as_u64().unwrap(), n - n.div_ceil(4096));
    let help = bb(&["perplexity", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("--ctx <CTX>") && !help.contains("--ctx-size"),
        "{help}"
    );
}

#[test]
fn help_texts_say_what_the_commands_do() {
    let help = |args: &[&str]| {
        let o = bb(args);
        assert!(o.status.success(), "{args:?}");
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let top = help(&["--help"]);
    assert!(
        top.contains("Serve hosts over the link (a daemon): the tail layers of split prefill, and the KV pages of KV offload"),
        "{top}"
    );
    let local = help(&["bench", "local", "--help"]);
    for want in [
        "[default: 2048,8192,16384]",
        "[default: 1,2]",
        "Default: the bundled bench model",
    ] {
        assert!(local.contains(want), "{want:?} in {local}");
    }
    assert!(!local.contains("Default: the bundled model"), "{local}");
    let split = help(&["bench", "split-prefill", "--help"]);
    for want in [
        "[default: 2048,8192,16384]",
        "Default: the bundled bench model",
        "Skip the shaped-link run and the shaped ping",
    ] {
        assert!(split.contains(want), "{want:?} in {split}");
    }
}

#[test]
fn kv_dtype_bf16_runs_and_a_model_with_an_odd_head_dim_is_refused_before_it_loads() {
    // bf16 pages on the tiny model (head_dim 32): a normal run, reproducible
    let m = fixture("tiny-f32");
    let run = |dtype: &str| {
        json_out(&bb(&[
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt-tokens",
            "1,2,3,4,5,6,7,8,9,10,11,12",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--kv-dtype",
            dtype,
            "--kv-page-size",
            "4",
            "--json",
        ]))
    };
    let a = run("bf16");
    assert_eq!(a["tokens"].as_array().unwrap().len(), 8);
    assert_eq!(a["tokens"], run("BF16")["tokens"]);
    // head_dim 33: bf16 pages pair dimensions, so every command that would build them refuses, naming the cause
    let dir = tempfile::tempdir().unwrap();
    let mut c = backburner_model::synthetic::tiny_config(4);
    c["head_dim"] = 33.into();
    backburner_model::synthetic::write_random_checkpoint(dir.path(), &c, 3).unwrap();
    let d = dir.path().to_str().unwrap();
    let cases: [&[&str]; 3] = [
        &[
            "run",
            "--model",
            d,
            "--prompt-tokens",
            "1,2,3",
            "--kv-dtype",
            "bf16",
        ],
        &[
            "plan",
            "--model",
            d,
            "--kv-dtype",
            "bf16",
            "--host-memory",
            "1GB",
        ],
        &["serve", "--model", d, "--kv-dtype", "bf16", "--port", "0"],
    ];
    for args in cases {
        let o = bb(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("even head_dim") && err.contains("33") && err.contains("--kv-dtype f16"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
    // the same model with f16 pages runs
    let o = bb(&[
        "run",
        "--model",
        d,
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "2",
        "--kv-dtype",
        "f16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

#[test]
fn run_takes_penalties_and_a_logit_bias_and_names_a_bad_flag() {
    let r = reference("tiny-f32");
    let greedy: Vec<u32> = serde_json::from_value(r["greedy"]["tokens"].clone()).unwrap();
    let ids: Vec<u32> = serde_json::from_value(r["prompt_ids"].clone()).unwrap();
    let ids_s = ids
        .iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let m = fixture("tiny-f32");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt-tokens",
            &ids_s,
            "-n",
            "6",
            "--ignore-eos",
            "--json",
        ];
        args.extend(extra);
        bb(&args)
    };
    // a bias of +100 on a token the greedy run never picks forces it at every step
    let forced = (0..200u32).find(|t| !greedy.contains(t)).unwrap();
    let plus = format!("{forced}+100");
    let v = json_out(&run(&["--logit-bias", &plus]));
    assert_eq!(v["tokens"], serde_json::json!(vec![forced; 6]));
    // -100 on the greedy first token moves the first pick away from it
    let minus = format!("{}-100", greedy[0]);
    let v = json_out(&run(&["--logit-bias", &minus]));
    assert_ne!(v["tokens"][0], greedy[0]);
    // penalties are taken (their effect on tokens: the engine's picker tests)
    let v = json_out(&run(&[
        "--frequency-penalty",
        "2",
        "--repeat-penalty",
        "1.5",
    ]));
    assert_eq!(v["tokens"].as_array().unwrap().len(), 6);
    for (flag, value) in [
        ("--presence-penalty", "2.5"),
        ("--frequency-penalty", "-3"),
        ("--repeat-penalty", "0"),
        ("--logit-bias", "5+101"),
    ] {
        let o = run(&[flag, value]);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
    let o = run(&["--logit-bias", "x+1"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("TOKEN_ID+BIAS"));
}

#[test]
fn run_follows_a_grammar_or_a_json_schema_and_names_a_bad_one() {
    let m = fixture("tiny-bf16");
    let m = m.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "-m", m, "-p", "Answer:", "-n", "60", "--json"];
        args.extend(extra);
        bb(&args)
    };
    let v = json_out(&run(&["--grammar", "root ::= (\"yes\" | \"no\") \"!\""]));
    assert!(v["text"] == "yes!" || v["text"] == "no!", "{v}");
    assert_eq!(v["stop_reason"], "eos");
    let v = json_out(&run(&[
        "-j",
        r#"{"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"],"additionalProperties":false}"#,
    ]));
    let text = v["text"].as_str().unwrap();
    let parsed: serde_json::Value = serde_json::from_str(text).unwrap();
    assert!(parsed["ok"].is_boolean(), "{text}");
    assert_eq!(v["stop_reason"], "eos");
    for (args, want) in [
        (vec!["--grammar", "root ::= \"a"], "--grammar"),
        (vec!["-j", "{not json"], "--json-schema"),
        (vec!["-j", r#"{"type":"no-such-type"}"#], "--json-schema"),
        (vec!["-j", "{}", "--ignore-eos"], "--ignore-eos"),
    ] {
        let o = run(&args);
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

#[test]
fn run_reads_the_prompt_from_standard_input_with_dash() {
    use std::io::Write;
    let m = fixture("tiny-bf16");
    let m = m.to_str().unwrap();
    let text = "Hello there\nsecond line\n";
    let mut child = Command::new(env!("CARGO_BIN_EXE_backburner"))
        .args([
            "run",
            "-m",
            m,
            "-f",
            "-",
            "-n",
            "4",
            "--ignore-eos",
            "--json",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let piped = json_out(&child.wait_with_output().unwrap());
    let direct = json_out(&bb(&[
        "run",
        "-m",
        m,
        "-p",
        text,
        "-n",
        "4",
        "--ignore-eos",
        "--json",
    ]));
    assert_eq!(piped["prompt_tokens"], direct["prompt_tokens"]);
    assert_eq!(piped["tokens"], direct["tokens"]);
    assert!(piped["prompt_tokens"].as_array().unwrap().len() > 3);
}

/// `serve` on a non-loopback address without `--api-key` warns before it serves (as `worker` refuses one without a
/// secret); with a key it does not.
#[test]
fn serve_warns_on_a_public_address_without_a_key() {
    use std::io::{BufRead, BufReader};
    let m = fixture("tiny-hub");
    let first_lines = |extra: &[&str]| {
        let mut args = vec![
            "serve",
            "-m",
            m.to_str().unwrap(),
            "--host",
            "0.0.0.0",
            "--port",
            "0",
        ];
        args.extend(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_backburner"))
            .args(&args)
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = Vec::new();
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        for line in stderr.by_ref() {
            let line = line.unwrap();
            let done = line.starts_with("serving ");
            lines.push(line);
            if done || lines.len() > 50 {
                break;
            }
        }
        // the line after it says where the chat page is
        let page = stderr.next().unwrap().unwrap();
        let addr = lines.last().unwrap().split(" on http://").nth(1).unwrap();
        let addr = addr.split_whitespace().next().unwrap();
        assert_eq!(
            page,
            format!("chat page: http://{addr}/ (the OpenAI API under http://{addr}/v1)")
        );
        child.kill().unwrap();
        child.wait().unwrap();
        lines
    };
    let open = first_lines(&[]);
    assert!(
        open.iter()
            .any(|l| l.starts_with("warning: serving on 0.0.0.0:") && l.contains("--api-key")),
        "{open:?}"
    );
    assert!(open.last().unwrap().starts_with("serving "), "{open:?}");
    let keyed = first_lines(&["--api-key", "k"]);
    assert!(!keyed.iter().any(|l| l.starts_with("warning")), "{keyed:?}");
    assert!(keyed.last().unwrap().starts_with("serving "), "{keyed:?}");
}

#[test]
fn seed_minus_one_draws_a_random_seed_and_other_negatives_are_refused() {
    let seed = |o: &std::process::Output| -> u64 {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["seed"].as_u64().expect("the seed used")
    };
    let a = seed(&crate::common::run_tiny(&["--seed", "-1", "--temp", "0.8"]));
    let b = seed(&crate::common::run_tiny(&["--seed", "-1", "--temp", "0.8"]));
    assert_ne!(a, b, "two random seeds");
    assert_eq!(
        seed(&crate::common::run_tiny(&[
            "--seed",
            "18446744073709551615"
        ])),
        u64::MAX
    );
    let o = crate::common::run_tiny(&["--seed", "-2"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("-1 for a random one"));
}

#[test]
fn speculative_runs_print_the_plain_runs_tokens_and_their_draft_counts() {
    let run = |model: &str, extra: &[&str]| -> serde_json::Value {
        let m = fixture(model);
        let mut args = vec![
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt-tokens",
            "5,6,7,8,5,6,7,8,5,6,7,8,5,6",
            "-n",
            "24",
            "--ignore-eos",
            "--json",
        ];
        args.extend_from_slice(extra);
        json_out(&bb(&args))
    };
    for (model, spec) in [
        ("tiny-f32", "ngram"),
        ("tiny-mtp", "mtp"),
        ("tiny-mtp", "draft-mtp"),
    ] {
        for sampling in [&[][..], &["--temp", "0.8", "--seed", "11"][..]] {
            let plain = run(model, sampling);
            assert!(plain.get("speculative").is_none());
            let mut extra = vec!["--spec", spec, "--draft-max", "3"];
            extra.extend_from_slice(sampling);
            let got = run(model, &extra);
            assert_eq!(
                got["tokens"], plain["tokens"],
                "{model} --spec {spec} {sampling:?}"
            );
            let c = &got["speculative"];
            let (drafted, accepted) = (
                c["drafted"].as_u64().unwrap(),
                c["accepted"].as_u64().unwrap(),
            );
            assert!(accepted <= drafted, "{c}");
            if spec != "ngram" {
                // the block drafts at every step it is asked to (adaptive length: at least the first)
                assert!(drafted > 0, "{c}");
            }
        }
    }
    // a model without an MTP block says so, naming the flag
    let m = fixture("tiny-f32");
    let o = bb(&[
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt-tokens",
        "1,2",
        "--spec",
        "mtp",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--spec mtp") && err.contains("no MTP block"),
        "{err}"
    );
}
