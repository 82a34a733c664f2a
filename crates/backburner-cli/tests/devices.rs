//! `backburner devices`, `--device` and `--device-layers` end to end on a default build (no GPU backend): the CPU
//! listed with its memory; `cuda:0` and `vulkan:0` refused with the device layer's not-built message; a bad name
//! refused by the parser; `--device cpu` accepted by every command that computes, with the output of a run without
//! it; the commands and modes that cannot run layers on a device refusing one (no panic); and the placement path of
//! `run` and `perplexity` on the device layer's CPU backend (the hidden `--device-cpu-backend`), bit for bit the
//! CPU path's.

use std::process::Output;

use backburner_model::device::{DeviceId, Registry};

use crate::common::{bb, fixture, stderr};

fn tiny() -> String {
    fixture("tiny-f32").to_str().unwrap().to_string()
}

/// `run` on the tiny fixture: a text prompt, 12 tokens, greedy, plus `extra`.
fn run_tiny(extra: &[&str]) -> Output {
    let m = tiny();
    let mut a = vec![
        "run",
        "--model",
        &m,
        "--prompt",
        "Hello there",
        "-n",
        "12",
        "--ignore-eos",
    ];
    a.extend_from_slice(extra);
    bb(&a)
}

/// The device layer's own message for a backend this build lacks.
fn not_built(id: &str) -> String {
    let id: DeviceId = id.parse().unwrap();
    Registry::cpu_only().open(id).err().unwrap().to_string()
}

#[test]
fn devices_lists_the_cpu_with_its_memory_and_the_backends_not_built() {
    let o = bb(&["devices", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let d = &v["devices"][0];
    assert_eq!(d["id"], "cpu");
    assert!(d["memory_bytes"].as_u64().unwrap() > 0, "{v}");
    assert!(!d["name"].as_str().unwrap().is_empty());
    assert_eq!(v["devices"].as_array().unwrap().len(), 1, "{v}");
    let nb = v["not_built"].as_array().unwrap();
    assert_eq!(nb[0]["backend"], "cuda");
    assert!(nb[0]["how"].as_str().unwrap().contains("--features cuda"));
    assert_eq!(nb[1]["backend"], "vulkan");

    let o = bb(&["devices"]);
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "devices:");
    assert!(lines[1].starts_with("  cpu "), "{text}");
    assert!(lines[1].contains(" GiB"), "{text}");
    assert!(
        lines[2]
            .starts_with("not built: cuda: rebuild with `cargo build --release --features cuda`"),
        "{text}"
    );
}

#[test]
fn a_gpu_device_on_a_default_build_fails_with_the_not_built_message() {
    for id in ["cuda:0", "vulkan:0"] {
        let o = run_tiny(&["--device", id]);
        assert_eq!(o.status.code(), Some(1), "{id}");
        let e = stderr(&o);
        assert!(
            e.contains(&format!("--device {id}: {}", not_built(id))),
            "{e}"
        );
        assert!(!e.contains("panicked"), "{e}");
        assert!(o.stdout.is_empty(), "nothing ran");
    }
    assert!(not_built("cuda:0").contains("--features cuda"));
    let m = tiny();
    let f = fixture("tiny-f32").join("ppl.txt");
    let o = bb(&[
        "perplexity",
        "-m",
        &m,
        "-f",
        f.to_str().unwrap(),
        "--device",
        "CUDA0",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&not_built("cuda:0")), "{}", stderr(&o));
}

#[test]
fn a_device_name_that_is_none_gets_the_parse_error() {
    let o = run_tiny(&["--device", "gpu"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("invalid value 'gpu' for '--device <DEVICE>': 'gpu' is not a device name: use cpu, cuda:N or vulkan:N"),
        "{e}"
    );
}

#[test]
fn device_cpu_gives_the_same_text_as_no_device_flag_and_layers_on_the_cpu_backend_too() {
    let plain = run_tiny(&[]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    assert!(!plain.stdout.is_empty());
    let cpu = run_tiny(&["--device", "cpu"]);
    assert!(cpu.status.success(), "{}", stderr(&cpu));
    assert_eq!(cpu.stdout, plain.stdout);
    let cpu0 = run_tiny(&["-dev", "none", "--device-layers", "0"]);
    assert_eq!(cpu0.stdout, plain.stdout);
    assert!(!stderr(&cpu).contains("layers 0.."), "nothing placed");

    // the placement path: layers on the device layer's CPU backend give the CPU path's logits, bit for bit
    let dir = tempfile::tempdir().unwrap();
    let logits = |name: &str, extra: &[&str]| {
        let f = dir.path().join(name);
        let mut a = vec!["--dump-logits", f.to_str().unwrap()];
        a.extend_from_slice(extra);
        let o = run_tiny(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        (o, std::fs::read(f).unwrap())
    };
    let (_, want) = logits("plain.bin", &[]);
    assert_eq!(want.len(), 12 * 4 * 512, "12 steps of the tiny vocabulary");
    for (n, line) in [
        (None, "layers 0..8 on cpu ("),
        (Some("5"), "layers 0..5 on cpu ("),
        (Some("99"), "layers 0..8 on cpu ("),
        (Some("0"), "layers 0..8 on cpu"),
    ] {
        let mut extra = vec!["--device", "cpu", "--device-cpu-backend"];
        if let Some(n) = n {
            extra.extend(["-ngl", n]);
        }
        let (o, got) = logits("placed.bin", &extra);
        assert_eq!(got, want, "--device-layers {n:?}");
        assert_eq!(o.stdout, plain.stdout);
        let e = stderr(&o);
        assert!(e.lines().next().unwrap().starts_with(line), "{e}");
        if n == Some("5") {
            assert!(e.lines().next().unwrap().ends_with("), 5..8 on cpu"), "{e}");
        }
    }
    // several sampled choices rewind to the prompt's snapshot, which holds the device's state: the same choices
    let choices = ["--n-choices", "3", "--temp", "0.9", "--seed", "3"];
    let want = run_tiny(&choices);
    assert!(want.status.success(), "{}", stderr(&want));
    let text = String::from_utf8_lossy(&want.stdout).to_string();
    assert!(text.contains("[choice 2]"), "{text}");
    let placed = [&choices[..], &["--device-cpu-backend", "-ngl", "5"]].concat();
    let got = run_tiny(&placed);
    assert!(got.status.success(), "{}", stderr(&got));
    assert_eq!(got.stdout, want.stdout);
    // bench local places the layers and says so in its report
    let m = tiny();
    let o = bb(&[
        "bench",
        "local",
        "-m",
        &m,
        "--depths",
        "16",
        "--decode-tokens",
        "2",
        "--json",
        "--device-cpu-backend",
        "-ngl",
        "4",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let placement = v["placement"].as_str().unwrap_or_default();
    assert!(
        placement.starts_with("layers 0..4 on cpu (") && placement.ends_with("), 4..8 on cpu"),
        "{v}"
    );
    assert!(v["results"][0]["read_bandwidth_gb_s"].is_null(), "{v}");
    // perplexity with placed layers: the same figure
    let f = fixture("tiny-f32").join("ppl.txt");
    let ppl = |extra: &[&str]| {
        let mut a = vec![
            "perplexity",
            "-m",
            &m,
            "-f",
            f.to_str().unwrap(),
            "--ctx",
            "64",
        ];
        a.extend_from_slice(extra);
        let o = bb(&a);
        assert!(o.status.success(), "{}", stderr(&o));
        o.stdout
    };
    let want = ppl(&[]);
    assert_eq!(ppl(&["--device", "cpu"]), want);
    assert_eq!(ppl(&["--device-cpu-backend", "--device-layers", "3"]), want);
}

#[test]
fn commands_and_modes_without_device_support_refuse_a_device_and_accept_the_cpu() {
    let m = tiny();
    let out = std::env::temp_dir().join("backburner-devices-test-cal.json");
    let out = out.to_str().unwrap();
    let refused: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["serve", "-m", &m, "--spec", "ngram"],
            "serve with speculative decoding",
        ),
        (
            vec![
                "chat",
                "-m",
                &m,
                "--worker",
                "127.0.0.1:9",
                "--split-layer",
                "4",
            ],
            "chat with workers that compute layers",
        ),
        (
            vec!["worker", "-m", &m],
            "a worker (the layers and KV pages",
        ),
        (
            vec!["calibrate", "-m", &m, "--out", out],
            "calibrate (it times",
        ),
        (
            vec!["bench", "slots", "-m", &m],
            "the benchmarks other than `bench local`",
        ),
        (
            vec!["run", "-m", &m, "-p", "hi", "--spec", "ngram"],
            "speculative decoding",
        ),
        (
            vec![
                "run",
                "-m",
                &m,
                "-p",
                "hi",
                "--worker",
                "127.0.0.1:9",
                "--layer-split",
                "4",
            ],
            "a run whose workers compute layers",
        ),
    ];
    for (args, what) in &refused {
        let mut a = args.clone();
        a.extend(["--device", "cuda:0"]);
        let o = bb(&a);
        assert_eq!(o.status.code(), Some(1), "{a:?}");
        let e = stderr(&o);
        assert!(
            e.starts_with(&format!("error: --device cuda:0: {what}")),
            "{a:?}: {e}"
        );
        assert!(e.contains("cannot run layers on a device yet"), "{e}");
        assert!(
            e.contains("docs/DEVICES.md") && !e.contains("panicked"),
            "{e}"
        );
    }
    // --device cpu passes each of them: the error that follows is the command's own
    let accepted: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["serve", "-m", &m, "--parallel", "0"],
            "--parallel must be",
        ),
        (
            vec!["worker", "-m", &m, "--listen", "nowhere"],
            "--listen \"nowhere\"",
        ),
        (
            vec!["bench", "local", "-m", &m, "--depths", "0"],
            "--depths, --thread-counts",
        ),
        (
            vec!["calibrate", "-m", &m, "--out", out, "--decode-tokens", "0"],
            "--decode-tokens must be",
        ),
    ];
    for (args, own) in &accepted {
        let mut a = args.clone();
        a.extend(["--device", "cpu"]);
        let o = bb(&a);
        assert!(stderr(&o).contains(own), "{a:?}: {}", stderr(&o));
    }
    // chat reads its messages from standard input (here empty): it opens and leaves
    let o = bb(&["chat", "-m", &m, "--device", "cpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // serve and chat run layers on a device: a build without the backend says so
    for cmd in ["serve", "chat"] {
        let o = bb(&[cmd, "-m", &m, "--device", "cuda:0"]);
        assert_eq!(o.status.code(), Some(1), "{cmd}");
        assert!(stderr(&o).contains(&not_built("cuda:0")), "{}", stderr(&o));
    }
    let o = bb(&["chat", "-m", &m, "--device-cpu-backend", "-ngl", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("layers 0..2 on cpu ("),
        "{}",
        stderr(&o)
    );
    // --device-layers without a device
    let o = run_tiny(&["-ngl", "99"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("--device-layers 99 puts layers on a device, but --device is cpu"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn plan_with_a_device_budget_puts_the_layers_that_fit_on_it_and_says_how_to_run_it() {
    let m = fixture("ref-27b-config");
    let m = m.to_str().unwrap();
    let base = [
        "plan",
        "--model",
        m,
        "--host-memory",
        "512GiB",
        "--ctx",
        "8192",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        bb(&a)
    };
    // 24 GiB: 31 layers of the 27B at 8k (counted by hand in the engine's plan tests)
    let o = with(&["--device", "cuda:0", "--device-memory", "24GiB", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let d = &v["device"];
    assert_eq!(d["device"], "cuda:0");
    assert_eq!(d["layers"], serde_json::json!([0, 31]));
    assert_eq!(d["cpu_layers"], serde_json::json!([31, 64]));
    assert_eq!(d["memory"], 24u64 << 30);
    assert_eq!(d["kv_positions"], 8192);
    assert_eq!(
        d["command"],
        format!("backburner run --model {m} --ctx-size 8192 --kv-dtype f16 --device cuda:0 --device-layers 31")
    );
    let o = with(&["--device", "cuda:0", "--device-memory", "80GB"]);
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(
        text.starts_with(
            "plan: local: cuda:0 holds all 64 layers, the host the embedding and head; context up to 262144 tokens\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("\ncommand: backburner run --model "),
        "{text}"
    );
    assert!(
        text.contains("--device cuda:0 --device-layers 64\n"),
        "{text}"
    );
    // no memory given and no such device in this build: say so
    let o = with(&["--device", "cuda:0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("give its memory with --device-memory"),
        "{}",
        stderr(&o)
    );
    // --device cpu: the plan without a device
    let plain = with(&["--json"]);
    let cpu = with(&["--device", "cpu", "--json"]);
    assert!(plain.status.success());
    assert_eq!(cpu.stdout, plain.stdout);
    let v: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
    assert!(v.get("device").is_none());
    // no layer fits: the command places none; a ubatch other than the default is carried over
    let o = with(&[
        "--device",
        "cuda:0",
        "--device-memory",
        "1MiB",
        "--ubatch",
        "256",
    ]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned() + &stderr(&o);
    assert!(text.contains("no layer fits on cuda:0"), "{text}");
    assert!(
        text.contains("--ubatch 256\n") && !text.contains("--device-layers 0"),
        "{text}"
    );
    // no build has a Vulkan backend: no plan for one
    let o = with(&["--device", "vulkan:0", "--device-memory", "8G"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no build has a Vulkan backend"),
        "{}",
        stderr(&o)
    );
}
