//! Experts on workers through the commands: `run --expert-split` with `backburner worker` processes on the MoE
//! fixture gives the local run's logits byte for byte with the host holding fewer weights, and `run` under a
//! `--max-memory` below the weights plans the same placement itself.

use crate::common;

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use common::{bin, fixture, worker_for};

/// `run` on `model` (prompt ids 1..=40, 10 greedy tokens, 1 thread, `--json`), logits into `dump`: JSON and stderr.
fn host(model: &Path, extra: &[&str], dump: &Path) -> (Value, String) {
    let ids: Vec<String> = (1..=40).map(|i| ((i * 37) % 500).to_string()).collect();
    let ids = ids.join(",");
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt-tokens",
        &ids,
        "--max-tokens",
        "10",
        "--ignore-eos",
        "--threads",
        "1",
        "--json",
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend(extra);
    let o = Command::new(bin())
        .args(&args)
        .env_remove("BACKBURNER_SECRET")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "host failed: {err}");
    (serde_json::from_slice(&o.stdout).unwrap(), err)
}

#[test]
fn experts_on_worker_processes_give_the_local_logits() {
    let d = tempfile::tempdir().unwrap();
    let m = fixture("tiny-moe-f32");
    let local_f = d.path().join("local.bin");
    let (local, _) = host(&m, &[], &local_f);
    let want = std::fs::read(&local_f).unwrap();
    let local_weights = local["memory"]["weights"].as_u64().unwrap();
    let (a, b) = (worker_for(&m, &[], &[]), worker_for(&m, &[], &[]));
    // Qwen3-Next (a dense layer among the MoE ones) with the experts of layers 1.. on a worker
    let next = fixture("tiny-next-f32");
    let (nl, _) = host(&next, &[], &d.path().join("next-local.bin"));
    let w = worker_for(&next, &[], &[]);
    let f = d.path().join("next-experts.bin");
    let (out, _) = host(&next, &["--worker", &w.addr, "--expert-split", "1"], &f);
    assert_eq!(out["tokens"], nl["tokens"], "qwen3_next");
    assert!(std::fs::read(&f).unwrap() == std::fs::read(d.path().join("next-local.bin")).unwrap());
    for (what, flags) in [
        (
            "one worker",
            vec!["--worker", &a.addr, "--expert-split", "1"],
        ),
        (
            "a subset",
            vec![
                "--worker",
                &a.addr,
                "--expert-split",
                "0",
                "--expert-ids",
                "0-2,6",
            ],
        ),
        (
            "two workers",
            vec![
                "--worker",
                &a.addr,
                "--worker",
                &b.addr,
                "--expert-split",
                "0,2",
            ],
        ),
    ] {
        let f = d.path().join(format!("{what}.bin"));
        let (out, _) = host(&m, &flags, &f);
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert!(std::fs::read(&f).unwrap() == want, "{what}: logits differ");
        let w = out["memory"]["weights"].as_u64().unwrap();
        assert!(
            w < local_weights,
            "{what}: host weights {w} vs {local_weights}"
        );
        let link = &out["link"];
        assert_eq!(link["mode"], "expert_split", "{what}");
        for w in link["workers"].as_array().unwrap() {
            let (s, r) = (
                w["bytes_sent"].as_u64().unwrap(),
                w["bytes_received"].as_u64().unwrap(),
            );
            assert!(s > 0 && r > 0, "{what}: {link}");
        }
    }
    // a host limited below the weights (1.8 MB, and 0.3 MB of scratch for 40 tokens) with one worker: the plan
    // puts the experts of some layers on it
    let f = d.path().join("planned.bin");
    let (out, err) = host(
        &m,
        &[
            "--worker",
            &a.addr,
            "--worker-memory",
            "1GB",
            "--max-memory",
            "1900000B",
        ],
        &f,
    );
    assert_eq!(out["plan"]["mode"], "expert_split", "{err}");
    assert_eq!(out["tokens"], local["tokens"]);
    assert!(std::fs::read(&f).unwrap() == want, "planned: logits differ");
    // a dense model refuses the flag with a reason
    let o = Command::new(bin())
        .args([
            "run",
            "--model",
            fixture("tiny-f32").to_str().unwrap(),
            "--prompt-tokens",
            "1,2",
        ])
        .args(["--worker", &a.addr, "--expert-split", "2"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("needs a mixture-of-experts model"));
}
