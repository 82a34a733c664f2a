//! `backburner bench gen-gguf` as a process: the files it writes are what `backburner run --model FILE` needs (the
//! dense model from text through its byte-level tokenizer, a Qwen3-Next one from token ids), and `--dry-run` plans
//! the 27B shape without writing.

use std::path::Path;
use std::process::{Command, Output};

fn bb(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_backburner"))
        .args(args)
        .output()
        .expect("run backburner")
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `run` on `model` for 4 greedy tokens (`input`: `--prompt` or `--prompt-tokens` and its value): the JSON report.
fn run_json(model: &Path, input: [&str; 2]) -> serde_json::Value {
    let o = bb(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        input[0],
        input[1],
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--threads",
        "1",
        "--json",
    ]);
    serde_json::from_str(&ok(&o)).unwrap()
}

#[test]
fn generated_files_run_and_the_27b_plan_is_printed_without_writing() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.gguf");
    let out = ok(&bb(&[
        "bench",
        "gen-gguf",
        "--shape",
        "tiny",
        "--type",
        "Q8_0",
        "--tensor-type",
        "ffn_down=Q6_K,ssm_alpha=F32",
        "--seed",
        "3",
        "--out",
        tiny.to_str().unwrap(),
    ]));
    // ffn_down's rows of 128 cannot take Q6_K: llama-quantize's Q8_0, reported
    assert!(
        out.contains("blk.*.ffn_down.weight ×4: Q6_K → Q8_0"),
        "{out}"
    );
    let size = std::fs::metadata(&tiny).unwrap().len();
    assert!(out.contains(&format!("({size} bytes)")), "{out}");
    let r = run_json(&tiny, ["--prompt", "hello"]);
    // one token per byte, the byte tokens in byte order
    assert_eq!(
        r["prompt_tokens"],
        serde_json::json!([104, 101, 108, 108, 111]),
        "{r}"
    );
    assert_eq!(r["tokens"].as_array().unwrap().len(), 4, "{r}");

    let next = dir.path().join("next.gguf");
    ok(&bb(&[
        "bench",
        "gen-gguf",
        "--shape",
        "tiny",
        "--arch",
        "qwen3next",
        "--type",
        "Q8_0",
        "--experts",
        "4",
        "--experts-used",
        "2",
        "--expert-ff",
        "32",
        "--shared-ff",
        "48",
        "--tokenizer",
        "none",
        "--out",
        next.to_str().unwrap(),
    ]));
    let r = run_json(&next, ["--prompt-tokens", "1,2,3"]);
    assert_eq!(r["tokens"].as_array().unwrap().len(), 4, "{r}");

    let big = dir.path().join("27b.gguf");
    let out = ok(&bb(&[
        "bench",
        "gen-gguf",
        "--shape",
        "27b",
        "--layers",
        "8",
        "--type",
        "IQ4_XS",
        "--dry-run",
        "--out",
        big.to_str().unwrap(),
    ]));
    assert!(
        out.starts_with("qwen35: 8 layers, hidden 5120, vocab 248320; types IQ4_XS; 109 tensors"),
        "{out}"
    );
    assert!(!out.contains("fallbacks"), "{out}");
    assert!(!big.exists());
}

/// A model of one layer cycle has no split point: `bench split-prefill` says so instead of timing a "split" the
/// worker takes no part in.
#[test]
fn split_prefill_refuses_a_model_without_a_split_point() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("four.gguf");
    let f = f.to_str().unwrap();
    ok(&bb(&[
        "bench", "gen-gguf", "--shape", "tiny", "--layers", "4", "--out", f,
    ]));
    let o = bb(&[
        "bench",
        "split-prefill",
        "--model",
        f,
        "--depths",
        "64",
        "--no-shaped",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("this 4-layer model has no split point on its 4-layer cycle"),
        "{err}"
    );
}
