//! `backburner run` under a memory limit: the OS's data limit (`ulimit -d`, RLIMIT_DATA) and `--max-memory` both fail
//! with an error naming the weights and the limit, before anything is allocated, instead of an allocator abort; with
//! room for the model the same command succeeds.

use crate::common;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Output};

use backburner_model::synthetic;

/// A random checkpoint whose weights (about 44 MB, bf16) dwarf the process's own data (a few MB): 4 layers, hidden
/// 256, a 32k vocabulary with an untied head.
fn big_model(dir: &Path) -> u64 {
    let mut c = synthetic::tiny_config(4);
    c["hidden_size"] = 256.into();
    c["intermediate_size"] = 1024.into();
    c["vocab_size"] = 32768.into();
    synthetic::write_random_checkpoint(dir, &c, 9).unwrap();
    let cfg = backburner_model::ModelConfig::from_dir(dir).unwrap();
    let ck = backburner_model::Checkpoint::open(dir).unwrap();
    let opts = backburner_model::LoadOptions {
        layers: 0..4,
        ends: true,
    };
    backburner_model::load_bytes(&ck, &cfg, &opts).unwrap()
}

/// A command that runs `program args…` under a data limit of `kib` KiB (RLIMIT_DATA through the shell's `ulimit -d`,
/// which any user may lower): private writable memory, the heap included, beyond it fails to allocate. It binds
/// our weights (heap copies) but not the read-only map of the checkpoint file. Reusable for a worker or a host.
pub fn under_data_limit(kib: u64, program: &str) -> Command {
    let mut c = Command::new("sh");
    c.args([
        "-c",
        &format!("ulimit -d {kib} && exec \"$0\" \"$@\""),
        program,
    ]);
    c
}

/// `backburner run` on `model` with token ids, one thread, `--json`, 4 tokens unless `extra` says, plus `extra`, under a data limit of `kib` KiB
/// (`None`: no limit).
pub fn run_host(model: &Path, kib: Option<u64>, extra: &[&str]) -> Output {
    let mut c = match kib {
        Some(k) => under_data_limit(k, common::bin()),
        None => Command::new(common::bin()),
    };
    c.args([
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        "1,2,3,4,5",
        "--threads",
        "1",
        "--json",
    ])
    .args(extra);
    if !extra.contains(&"--max-tokens") {
        c.args(["--max-tokens", "4"]);
    }
    c.output().expect("spawn backburner")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_host_under_a_data_limit_below_its_weights_fails_with_the_weights_and_the_limit_named() {
    let dir = tempfile::tempdir().unwrap();
    let weights = big_model(dir.path());
    assert!(weights > 40_000_000, "{weights}");
    // half the weights: a clear error, exit 1, no abort (SIGABRT) and nothing on stdout
    let o = run_host(dir.path(), Some(weights / 2 / 1024), &[]);
    let e = stderr(&o);
    assert_eq!(o.status.signal(), None, "killed by a signal: {e}");
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("weights of layers 0..4 and the ends need") && e.contains("RLIMIT_DATA"),
        "{e}"
    );
    assert!(!e.contains("memory allocation of"), "{e}");
    assert!(o.stdout.is_empty());
    // room for the model: the same command succeeds, and reports what it held
    let o = run_host(dir.path(), Some(4 * weights / 1024), &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(v["memory"]["weights"], weights);
    let unlimited = run_host(dir.path(), None, &[]);
    let u: serde_json::Value = serde_json::from_slice(&unlimited.stdout).unwrap();
    assert_eq!(u["tokens"], v["tokens"]);
}

#[test]
fn max_memory_is_checked_before_loading_and_memory_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let weights = big_model(dir.path());
    let o = run_host(dir.path(), None, &["--max-memory", "20MB"]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("weights of layers 0..4 and the ends need")
            && e.contains("--max-memory is 20 MB"),
        "{e}"
    );
    // the weights fit but not a KV cache for a huge context: named as such
    let limit = (weights + 1_000_000).to_string();
    let o = run_host(
        dir.path(),
        None,
        &["--max-memory", &limit, "--max-tokens", "60000"],
    );
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(e.contains("the KV cache of 60005 positions need"), "{e}");
    // enough: the JSON carries the report, its parts adding up
    let o = run_host(dir.path(), None, &["--max-memory", "1GB"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let m = &v["memory"];
    let part = |k: &str| m[k].as_u64().unwrap();
    assert_eq!(part("weights"), weights);
    assert!(part("kv_pages") > 0 && part("recurrent_state") > 0 && part("scratch") > 0);
    assert_eq!(
        part("total"),
        part("weights") + part("kv_pages") + part("recurrent_state") + part("scratch")
    );
    assert!(part("peak_rss") >= weights, "{m}");
    // the stats line of a streamed run
    let o = run_host(dir.path(), None, &[]);
    assert!(o.status.success());
    let text = Command::new(common::bin())
        .args([
            "run",
            "--model",
            dir.path().to_str().unwrap(),
            "--prompt-tokens",
            "1,2",
            "--max-tokens",
            "2",
            "--threads",
            "1",
        ])
        .output()
        .unwrap();
    let e = stderr(&text);
    assert!(
        e.contains("memory: weights ") && e.contains(", kv ") && e.contains("(peak RSS "),
        "{e}"
    );
}

/// A random checkpoint whose decoder layers hold most of the weights (8 layers of ~15 MB, bf16; tied 4k vocabulary:
/// ~4 MB of ends), so that a host holding the ends and a few layers fits where the whole model does not.
fn layer_heavy_model(dir: &Path) -> u64 {
    let mut c = synthetic::tiny_config(8);
    c["hidden_size"] = 512.into();
    c["intermediate_size"] = 4096.into();
    c["vocab_size"] = 4096.into();
    c["tie_word_embeddings"] = true.into();
    synthetic::write_random_checkpoint(dir, &c, 11).unwrap();
    let cfg = backburner_model::ModelConfig::from_dir(dir).unwrap();
    let ck = backburner_model::Checkpoint::open(dir).unwrap();
    let opts = backburner_model::LoadOptions {
        layers: 0..8,
        ends: true,
    };
    backburner_model::load_bytes(&ck, &cfg, &opts).unwrap()
}

#[test]
fn a_host_under_a_data_limit_runs_the_model_with_one_worker_or_two_and_the_same_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let weights = layer_heavy_model(dir.path());
    assert!(weights > 100_000_000, "{weights}");
    // the limit: half the weights (the host can hold the ends and a few layers, not a whole 4-layer cycle)
    let kib = weights / 2 / 1024;
    let flags = ["--ubatch", "64", "--max-tokens", "6", "--ignore-eos"];
    let local = run_host(dir.path(), None, &flags);
    assert!(local.status.success(), "{}", stderr(&local));
    let want: serde_json::Value = serde_json::from_slice(&local.stdout).unwrap();
    // alone under the limit: the typed error naming the weights and the limit
    let o = run_host(dir.path(), Some(kib), &flags);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("weights of layers 0..8 and the ends need"),
        "{}",
        stderr(&o)
    );
    // with a worker: the planner places the layers the host cannot hold on it (same planner as `plan`)
    let a = common::worker_for(dir.path(), &[], &[]);
    let o = run_host(
        dir.path(),
        Some(kib),
        &[&flags[..], &["--worker", &a.addr]].concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], want["tokens"]);
    assert_eq!(v["plan"]["mode"], "layer_split", "{}", v["plan"]);
    let host_end = v["link"]["host_layers"][1].as_u64().unwrap();
    assert_eq!(v["link"]["worker_layers"].as_u64().unwrap(), 8 - host_end);
    assert!(v["memory"]["weights"].as_u64().unwrap() < weights / 2);
    // with two workers, the first given room for about half the model: a chain on the layer-cycle seams (the host
    // keeps the ends, worker 1 layers 0..4, worker 2 4..8)
    let b = common::worker_for(dir.path(), &[], &[]);
    let (half, all) = ((weights * 7 / 10).to_string(), (weights * 2).to_string());
    let o = run_host(
        dir.path(),
        Some(kib),
        &[
            &flags[..],
            &[
                "--worker",
                &a.addr,
                "--worker",
                &b.addr,
                "--worker-memory",
                &half,
                "--worker-memory",
                &all,
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], want["tokens"]);
    let stages = v["link"]["layer_split"].as_array().unwrap();
    assert_eq!(stages.len(), 2, "{}", v["plan"]);
    assert_eq!(
        stages[0]["layers"],
        serde_json::json!([host_end, 4]),
        "{}",
        v["link"]
    );
    // and an explicit chain under the same limit
    let o = run_host(
        dir.path(),
        Some(kib),
        &[
            &flags[..],
            &[
                "--worker",
                &a.addr,
                "--worker",
                &b.addr,
                "--layer-split",
                "2,5",
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tokens"], want["tokens"]);
    assert_eq!(v["link"]["host_layers"], serde_json::json!([0, 2]));
}

#[test]
fn a_gguf_tokenizer_too_big_for_the_data_limit_is_named_before_it_is_built() {
    use backburner_model::gguf::writer::GgufWriter;
    use backburner_model::gguf::{MetaArray, MetaValue, StrArray};
    use backburner_model::GgufFile;
    // the tiny GGUF with 400,000 extra 48-byte merges: ~25 MB of tokenizer JSON, ~0.55 GB to build
    let src = GgufFile::open(&common::fixture("gguf").join("tiny-f32.gguf")).unwrap();
    let mut merges = StrArray::with_capacity(400_000, 400_000 * 48);
    for i in 0..400_000u32 {
        merges.push(&format!("{:023} {:024}", i, i));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big-tokenizer.gguf");
    GgufWriter::copy_of(&src)
        .unwrap()
        .remove("tokenizer.ggml.merges")
        .kv(
            "tokenizer.ggml.merges",
            MetaValue::Array(MetaArray::Str(merges)),
        )
        .write(&path)
        .unwrap();
    let o = under_data_limit(256 * 1024, common::bin())
        .args([
            "run",
            "--model",
            path.to_str().unwrap(),
            "--prompt",
            "hi",
            "--max-tokens",
            "1",
        ])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.signal(), None, "killed by a signal: {e}");
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("the tokenizer's tables (")
            && e.contains("of the GGUF file's tokenizer as JSON")
            && e.contains("RLIMIT_DATA"),
        "{e}"
    );
}

#[test]
fn the_qwen35_tokenizer_under_a_data_limit_it_cannot_be_parsed_in_is_named_not_an_abort() {
    // the real Qwen3.5 tokenizer.json (10 MB) beside a tiny model: parsing it needs a data limit of about 291 MB
    // (measured); at 270 MB the check before parsing must refuse it (the old estimate, 22 times the JSON, let it
    // through to an allocator abort)
    use std::io::Read;
    let dir = tempfile::tempdir().unwrap();
    let src = common::fixture("tiny-f32");
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let gz = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../assets/qwen3.5/tokenizer.json.gz"),
    )
    .unwrap();
    let mut json = Vec::new();
    flate2::read::GzDecoder::new(&gz[..])
        .read_to_end(&mut json)
        .unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), &json).unwrap();
    let o = under_data_limit(270 * 1000, common::bin())
        .args([
            "run",
            "--model",
            dir.path().to_str().unwrap(),
            "-p",
            "hi",
            "-n",
            "1",
        ])
        .output()
        .unwrap();
    let e = stderr(&o);
    assert_eq!(o.status.signal(), None, "killed by a signal: {e}");
    assert_eq!(o.status.code(), Some(1), "{e}");
    assert!(
        e.contains("the tokenizer's tables (10.1 MB of tokenizer.json, about 30 times that while they are built)")
            && e.contains("raise the limit: the tokenizer is loaded whatever the placement"),
        "{e}"
    );
}
