//! The commands with GGUF models as real processes: a `backburner worker` on a GGUF file gives the host's local
//! logits bit for bit in split prefill and a worker on another file is refused (the host runs locally, same bits);
//! `serve` names a GGUF by its file name and chats with the file's own template; `plan` counts each layer as the
//! load allocates it and names the format; `bench local` runs; `--max-memory` counts the quantized bytes.
//!
//! `tiny-q-<fmt>.gguf` is one 4-layer cycle (no split point for split prefill): the split tests restack it to 8
//! layers (its blocks twice, bytes unchanged).

use crate::common;
use crate::serve_util;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use backburner_engine::memory::human;
use backburner_model::gguf::writer::{restack_layers, GgufWriter};
use backburner_model::gguf::MetaValue;
use backburner_model::{Checkpoint, GgufFile, LoadOptions, Model, ModelConfig, TextTokenizer};
use serde_json::{json, Value};

use common::{bin, fixture, worker_for};

fn gguf(name: &str) -> PathBuf {
    fixture("gguf").join(name)
}

/// `tiny-q-<fmt>.gguf` with its 4 blocks twice (8 layers, split point 4), written into `dir`.
fn stacked(dir: &Path, fmt: &str) -> PathBuf {
    let src = GgufFile::open(&gguf(&format!("tiny-q-{fmt}.gguf"))).unwrap();
    let path = dir.join(format!("tiny-q-{fmt}-x2.gguf"));
    restack_layers(&src, &[0, 1, 2, 3, 0, 1, 2, 3])
        .unwrap()
        .write(&path)
        .unwrap();
    path
}

/// `backburner ARGS...` with no secret in the environment.
fn cmd(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env_remove("BACKBURNER_SECRET")
        .output()
        .unwrap()
}

/// `run` on `model` with the tiny fixtures' prompt (336 tokens), 12 greedy tokens, ubatch 64, 1 thread, `--json`,
/// the logits written to `dump`: the JSON object and stderr.
fn host(model: &Path, extra: &[&str], dump: &Path) -> (Value, String) {
    let prompt = fixture("tiny-f32").join("prompt.txt");
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-file",
        prompt.to_str().unwrap(),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--ubatch",
        "64",
        "--threads",
        "1",
        "--json",
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = cmd(&args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "host failed: {err}");
    (serde_json::from_slice(&o.stdout).unwrap(), err)
}

#[test]
fn a_gguf_worker_process_gives_the_local_logits_and_a_worker_on_another_file_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let q4k = stacked(d.path(), "q4_k");
    let q8 = stacked(d.path(), "q8_0");
    for (model, other) in [(gguf("tiny-f32.gguf"), gguf("tiny-bf16.gguf")), (q4k, q8)] {
        let name = model.file_name().unwrap().to_string_lossy().into_owned();
        let cfg = ModelConfig::from_dir(&model).unwrap();
        let local_f = d.path().join(format!("{name}.local.bin"));
        let (local, _) = host(&model, &[], &local_f);
        let want = std::fs::read(&local_f).unwrap();
        assert_eq!(want.len(), 12 * cfg.vocab_size * 4, "{name}");

        // the same file: split prefill, the local bits
        let w = worker_for(&model, &[], &[]);
        let f = d.path().join(format!("{name}.split.bin"));
        let (split, _) = host(
            &model,
            &["--worker", &w.addr, "--split-min-tokens", "64"],
            &f,
        );
        assert_eq!(split["tokens"], local["tokens"], "{name}");
        assert!(std::fs::read(&f).unwrap() == want, "{name}: logits differ");
        let link = &split["link"];
        // 336 prompt tokens in ubatches of 64: the first 5 (320 tokens) run their tail on the worker
        assert_eq!(link["worker_tokens"], 320, "{name}");
        assert_eq!(link["fallbacks"], 0, "{name}");
        // out: 320 residuals (hidden f32) plus the handshake and headers
        let residuals = 320 * cfg.hidden_size as u64 * 4;
        let sent = link["bytes_sent"].as_u64().unwrap();
        assert!(
            (residuals..residuals + 4096).contains(&sent),
            "{name}: sent {sent}, residuals {residuals}"
        );
        // back: 320 KV rows of the one attention layer in 4..8 (K, V in f16) and the 3 linear layers' states (f32)
        let kv = 320 * 2 * cfg.num_key_value_heads * cfg.head_dim * 2;
        let lin = 3
            * 4
            * (cfg.conv_dim() * (cfg.linear_conv_kernel_dim - 1)
                + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim);
        let recv = link["bytes_received"].as_u64().unwrap() as usize;
        assert!(
            (kv + lin..kv + lin + 4096).contains(&recv),
            "{name}: received {recv}, state {}",
            kv + lin
        );
        drop(w);

        // another file of the same shape: the fingerprint differs, the worker refuses, the host runs locally
        let w = worker_for(&other, &[], &[]);
        let f = d.path().join(format!("{name}.refused.bin"));
        let (out, err) = host(
            &model,
            &["--worker", &w.addr, "--split-min-tokens", "64"],
            &f,
        );
        let other_name = other.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            err.contains("ModelMismatch: model fingerprint differs for layers 4..8")
                && err.contains(&other_name),
            "{name}: {err}"
        );
        assert_eq!(out["tokens"], local["tokens"], "{name}");
        assert!(
            std::fs::read(&f).unwrap() == want,
            "{name}: the fallback changed the logits"
        );
        assert_eq!(out["link"]["fallbacks"], 1, "{name}");
        assert_eq!(out["link"]["worker_tokens"], 0, "{name}");
    }
}

#[test]
fn kv_offload_and_layer_split_over_gguf_worker_processes_give_the_local_logits() {
    let d = tempfile::tempdir().unwrap();
    let q4k = stacked(d.path(), "q4_k");
    let page = ["--kv-page-size", "64"];
    let local_f = d.path().join("local.bin");
    let (local, _) = host(&q4k, &page, &local_f);
    let want = std::fs::read(&local_f).unwrap();
    let n = local["prompt_tokens"].as_array().unwrap().len() + 11;

    // KV offload: a 128-position budget, the oldest pages on the worker
    let w = worker_for(&q4k, &[], &[]);
    let f = d.path().join("offload.bin");
    let (out, _) = host(
        &q4k,
        &[&page[..], &["--kv-budget", "128", "--worker", &w.addr]].concat(),
        &f,
    );
    assert_eq!(out["tokens"], local["tokens"]);
    assert!(std::fs::read(&f).unwrap() == want, "offload: logits differ");
    let link = &out["link"];
    let held = link["positions_on_workers"].as_u64().unwrap() as usize;
    assert!(held.is_multiple_of(64) && n - held <= 128, "{link}");
    assert_eq!(
        link["pages_on_workers"].as_u64().unwrap() as usize,
        held / 64 * 2
    );
    assert_eq!(link["offload_failures"], 0);
    drop(w);

    // layer split: one worker, then a chain of two; the host loads layers 0..4 and the ends
    let (a, b, c) = (
        worker_for(&q4k, &[], &[]),
        worker_for(&q4k, &[], &[]),
        worker_for(&q4k, &[], &[]),
    );
    for (what, flags) in [
        ("one", vec!["--worker", &a.addr, "--layer-split", "4"]),
        (
            "two",
            vec![
                "--worker",
                &b.addr,
                "--worker",
                &c.addr,
                "--layer-split",
                "4,6",
            ],
        ),
    ] {
        let f = d.path().join(format!("{what}.bin"));
        let (out, _) = host(&q4k, &[&page[..], &flags].concat(), &f);
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert!(std::fs::read(&f).unwrap() == want, "{what}: logits differ");
        let link = &out["link"];
        assert_eq!(link["mode"], "layer_split", "{what}");
        assert_eq!(link["host_layers"], json!([0, 4]), "{what}");
        assert_eq!(link["worker_layers"], 4, "{what}");
        assert_eq!(link["failures"], 0, "{what}");
        // the host held only its layers and the ends, in their quantized bytes
        let ck = Checkpoint::open(&q4k).unwrap();
        let cfg = ModelConfig::from_dir(&q4k).unwrap();
        let host_bytes = backburner_model::load_bytes(
            &ck,
            &cfg,
            &LoadOptions {
                layers: 0..4,
                ends: true,
            },
        )
        .unwrap();
        assert_eq!(out["memory"]["weights"], host_bytes, "{what}");
    }
}

#[test]
fn serve_names_a_gguf_by_its_file_and_chats_with_the_files_own_template() {
    let d = tempfile::tempdir().unwrap();
    let fixture_file = gguf("tiny-q-q4_k.gguf");
    // a copy whose template no other source could supply
    let custom = d.path().join("custom-template.gguf");
    let template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
    let mut w = GgufWriter::copy_of(&GgufFile::open(&fixture_file).unwrap()).unwrap();
    w.remove("tokenizer.chat_template");
    w.kv("tokenizer.chat_template", MetaValue::Str(template.into()));
    w.write(&custom).unwrap();

    let user = "Hi there, tiny model";
    for (path, id) in [
        (&fixture_file, "tiny-q-q4_k.gguf"),
        (&custom, "custom-template.gguf"),
    ] {
        let vocab = ModelConfig::from_dir(path).unwrap().vocab_size;
        let tok = TextTokenizer::from_dir(path, vocab, &[]).unwrap().unwrap();
        let rendered = tok
            .apply_chat_template(
                &[backburner_model::ChatMessage {
                    role: "user".into(),
                    content: user.into(),
                }],
                true,
            )
            .unwrap();
        if path == &custom {
            assert_eq!(rendered, format!("[user] {user}\n[assistant] "));
        } else {
            assert!(rendered.starts_with("<|im_start|>user\n"), "{rendered}");
        }
        let want_prompt = tok.encode(&rendered).unwrap();
        // the server's prefill runs the ubatches `run` does (a chat's stable prefix keeps a checkpoint inside its
        // ubatch without cutting it), so its answer is `run`'s, bit for bit
        let o = cmd(&[
            "run",
            "--model",
            path.to_str().unwrap(),
            "--chat",
            "--prompt",
            user,
            "--max-tokens",
            "8",
            "--threads",
            "1",
            "--json",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let run: Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(run["prompt_tokens"], json!(want_prompt), "{id}");

        let s = serve_util::serve(path, &[]);
        assert_eq!(s.name, id);
        let (st, body) = s.get("/v1/models");
        assert_eq!(st, 200, "{body}");
        let models: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(models["data"][0]["id"], id);
        let v = s.post_ok(
            "/v1/chat/completions",
            &json!({
                "messages": [{"role": "user", "content": user}],
                "max_tokens": 8,
                "temperature": 0
            }),
        );
        assert_eq!(v["model"], id);
        assert_eq!(v["usage"]["prompt_tokens"], want_prompt.len(), "{id}: {v}");
        let n_run = run["tokens"].as_array().unwrap().len();
        assert_eq!(v["usage"]["completion_tokens"], n_run, "{id}: {v}");
        // (the chat parser drops the whitespace an answer starts with)
        let text = run["text"].as_str().unwrap().trim_start();
        assert_eq!(v["choices"][0]["message"]["content"], text, "{id}: {v}");
    }
}

#[test]
fn plan_of_a_gguf_counts_each_layer_as_the_load_allocates_and_names_the_format() {
    let d = tempfile::tempdir().unwrap();
    let file = gguf("tiny-q-q4_k.gguf");
    let in_dir = d.path().join("model");
    std::fs::create_dir(&in_dir).unwrap();
    std::fs::copy(&file, in_dir.join("tiny-q-q4_k.gguf")).unwrap();
    let cfg = ModelConfig::from_dir(&file).unwrap();
    let ck = Checkpoint::open(&file).unwrap();
    let loaded = |layers: std::ops::Range<usize>, ends: bool| {
        Model::from_checkpoint(cfg.clone(), &ck, &LoadOptions { layers, ends }, |_, _| {})
            .unwrap()
            .weight_bytes() as u64
    };
    let n = cfg.num_hidden_layers;
    let whole = loaded(0..n, true);
    for path in [&file, &in_dir] {
        let p = path.to_str().unwrap();
        let o = cmd(&["plan", "--model", p, "--host-memory", "1GB", "--json"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let w = &v["weights"];
        assert_eq!(w["format"]["container"], "gguf", "{w}");
        assert_eq!(
            w["format"]["types"],
            json!([
                {"dtype": "Q4_K", "tensors": 32, "stored_bytes": 1_109_376},
                {"dtype": "F32", "tensors": 23, "stored_bytes": 35_680}
            ]),
            "{w}"
        );
        for i in 0..n {
            assert_eq!(w["layer_bytes"][i], loaded(i..i + 1, false), "layer {i}");
        }
        let ends = &w["ends"];
        assert_eq!(ends["head"], 0, "tied");
        assert_eq!(
            ends["embedding"].as_u64().unwrap() + ends["final_norm"].as_u64().unwrap(),
            loaded(0..0, true)
        );
        assert_eq!(w["total_bytes"], whole);
        assert_eq!(v["host"]["weight_bytes"], whole);

        // llama.cpp's short flag for the model, as `run` takes it
        let o = cmd(&["plan", "-m", p, "--host-memory", "1GB"]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains(&format!(
                "weights: {} as loaded, from GGUF: Q4_K (32 tensors), F32 (23 tensors)",
                human(whole)
            )),
            "{out}"
        );
    }
    // a host too small for the whole model: the layer split places the quantized bytes
    let o = cmd(&[
        "plan",
        "--model",
        file.to_str().unwrap(),
        "--host-memory",
        &(whole + 2_000_000).to_string(),
        "--worker-memory",
        "1GB",
        "--ubatch",
        "16",
        "--ctx",
        "64",
        "--layer-split",
        "2",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mode"], "layer_split");
    assert_eq!(v["host"]["weight_bytes"], loaded(0..2, true));
    assert_eq!(v["workers"][0]["weight_bytes"], loaded(2..4, false));
}

#[test]
fn bench_local_runs_on_a_gguf_and_reports_its_bytes() {
    let file = gguf("tiny-q-q4_k.gguf");
    let o = cmd(&[
        "bench",
        "local",
        "--model",
        file.to_str().unwrap(),
        "--depths",
        "64",
        "--decode-tokens",
        "4",
        "--thread-counts",
        "1",
        "--no-bandwidth",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["weight_bytes"],
        Model::load(&file).unwrap().weight_bytes() as u64
    );
    assert_eq!(
        v["checkpoint_bytes"],
        std::fs::metadata(&file).unwrap().len()
    );
    let r = &v["results"][0]["depths"][0];
    assert_eq!(r["depth"], 64);
    assert!(r["prefill_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
    // All the bytes a decode step reads: the weights, 64 positions of f16 KV and the Gated DeltaNet states.
    let cfg = ModelConfig::from_dir(&file).unwrap();
    let n = cfg.num_hidden_layers;
    let kv = backburner_model::KvOptions {
        page_size: 4096,
        dtype: backburner_kernels::kv::KvDtype::F16,
    };
    let extra = backburner_engine::memory::kv_bytes(&cfg, 0..n, kv, 64).unwrap()
        + backburner_engine::memory::recurrent_bytes(&cfg, 0..n).unwrap();
    let weights = v["weight_bytes"].as_f64().unwrap();
    let ratio = r["decode_read_gb_s"].as_f64().unwrap() / r["decode_weight_gb_s"].as_f64().unwrap();
    let want = (weights + extra as f64) / weights;
    assert!((ratio - want).abs() < 1e-9 * want, "{ratio} vs {want}");
    assert!(want > 1.0);
}

#[test]
fn bench_local_pairs_its_decode_rounds_with_read_passes() {
    let file = gguf("tiny-q-q4_k.gguf");
    let args = [
        "bench",
        "local",
        "--model",
        file.to_str().unwrap(),
        "--depths",
        "32",
        "--decode-tokens",
        "2",
        "--thread-counts",
        "1",
    ];
    let o = cmd(&[&args[..], &["--json"]].concat());
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["results"][0]["read_bandwidth_gb_s"].as_f64().unwrap() > 0.0,
        "{v}"
    );
    let r = &v["results"][0]["depths"][0];
    let p = &r["paired"];
    assert_eq!(p["rounds"], 7, "{p}");
    assert_eq!(p["tokens_per_round"], 8, "{p}");
    let mut shares: Vec<f64> = p["round_shares"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(shares.len(), 7, "{p}");
    assert!(shares.iter().all(|s| *s > 0.0), "{p}");
    shares.sort_by(f64::total_cmp);
    assert_eq!(p["read_share"].as_f64().unwrap(), shares[3], "{p}");
    // the weights' part of the share is the weights' part of the bytes (the same ratio as the contiguous decode's)
    let (all, weights) = (
        r["decode_read_gb_s"].as_f64().unwrap(),
        r["decode_weight_gb_s"].as_f64().unwrap(),
    );
    let ws = p["weight_share"].as_f64().unwrap();
    assert!((ws - shares[3] * weights / all).abs() < 1e-9, "{p}");
    assert!(
        p["pass_gb_s"].as_f64().unwrap() > 0.0 && p["decode_read_gb_s"].as_f64().unwrap() > 0.0,
        "{p}"
    );
    // the text report names it; --no-bandwidth drops it
    let text = String::from_utf8_lossy(&cmd(&args).stderr).into_owned();
    assert!(
        text.contains("in alternation with reads of the weights (7 rounds of 8 tokens)"),
        "{text}"
    );
    let o = cmd(&[&args[..], &["--json", "--no-bandwidth"]].concat());
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(v["results"][0]["depths"][0]["paired"].is_null(), "{v}");
}

#[test]
fn max_memory_counts_a_ggufs_quantized_bytes_on_the_host_and_the_worker() {
    let d = tempfile::tempdir().unwrap();
    let q4k = stacked(d.path(), "q4_k");
    let cfg = ModelConfig::from_dir(&q4k).unwrap();
    let ck = Checkpoint::open(&q4k).unwrap();
    let bytes = |layers: std::ops::Range<usize>, ends: bool| {
        backburner_model::load_bytes(&ck, &cfg, &LoadOptions { layers, ends }).unwrap()
    };
    let (all, tail) = (bytes(0..8, true), bytes(4..8, false));
    // the host: the weights' check names the quantized size
    let m = q4k.to_str().unwrap();
    let o = cmd(&[
        "run",
        "--model",
        m,
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "1",
        "--threads",
        "1",
        "--max-memory",
        &(all - 1).to_string(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "weights of layers 0..8 and the ends need {}",
            human(all)
        )),
        "{err}"
    );
    let o = cmd(&[
        "run",
        "--model",
        m,
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "1",
        "--threads",
        "1",
        "--json",
        "--max-memory",
        &(all + 2_000_000).to_string(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["memory"]["weights"], all);
    // the worker: its layers' quantized weights are reserved from --max-memory before loading
    let o = cmd(&[
        "worker",
        "--model",
        m,
        "--layers",
        "4..8",
        "--listen",
        "127.0.0.1:0",
        "--threads",
        "1",
        "--max-memory",
        &(tail - 1).to_string(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        err.contains(&format!("the weights of layers 4..8 need {tail} bytes")),
        "{err}"
    );
    // enough for them and a session's state and transfers, yet less than the layers would take as f32: the worker
    // loads them and serves the split
    let f32_tail = backburner_engine::plan::ModelCosts::from_config(
        &cfg,
        4,
        backburner_kernels::kv::KvDtype::F16,
    )
    .weight_bytes(4..8);
    let budget = tail + 3_000_000;
    assert!(budget < f32_tail, "{budget} vs {f32_tail}");
    let budget = budget.to_string();
    let w = worker_for(&q4k, &[], &["--layers", "4..8", "--max-memory", &budget]);
    let p = d.path().join("p.bin");
    let (out, err) = host(&q4k, &["--worker", &w.addr, "--split-min-tokens", "64"], &p);
    assert_eq!(out["link"]["worker_tokens"], 320, "{err}");
    assert_eq!(out["link"]["fallbacks"], 0);
}
