//! Host and worker as two real processes on loopback: split prefill gives the local output bit for bit, a worker
//! killed at several points leaves the output unchanged, and the daemon's flags are checked.

use crate::common;

use std::process::Command;

use common::{bin, fixture, host, worker};

#[test]
fn two_processes_give_the_local_logits_bit_for_bit() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    assert!(local.get("link").is_none());
    let w = worker(&[]);
    let split = host(
        &["--worker", &w.addr, "--split-min-tokens", "64"],
        &d.path().join("split.bin"),
    );
    assert_eq!(split["tokens"], local["tokens"]);
    let a = std::fs::read(d.path().join("local.bin")).unwrap();
    let b = std::fs::read(d.path().join("split.bin")).unwrap();
    assert_eq!(a.len(), 12 * 512 * 4);
    assert!(a == b, "logits differ");
    let link = &split["link"];
    // 336 prompt tokens in ubatches of 64: the first 5 ubatches (320 tokens) run their tail on the worker
    assert_eq!(link["worker_tokens"], 320);
    assert_eq!(link["fallbacks"], 0);
    // residuals: 320 tokens × 64 hidden × 4 bytes, plus headers and the handshake
    let sent = link["bytes_sent"].as_u64().unwrap();
    assert!(
        (320 * 64 * 4..320 * 64 * 4 + 4096).contains(&sent),
        "{sent}"
    );
    // back: 320 rows × 1 attention layer × K,V × 2 heads × 32 dims × 2 bytes (f16) + 3 linear states
    let lin = 3 * 4 * (160 * 3 + 4 * 16 * 24);
    let recv = link["bytes_received"].as_u64().unwrap();
    let payload = 320 * 2 * 2 * 32 * 2 + lin;
    assert!(
        (payload..payload + 4096).contains(&(recv as usize)),
        "{recv} vs {payload}"
    );
}

#[test]
fn a_worker_killed_before_during_or_after_the_pipeline_changes_nothing() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    let want = std::fs::read(d.path().join("local.bin")).unwrap();
    // before connect: nothing listens on the address
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("127.0.0.1:{port}");
    // session frames: 5 × RunLayers then Fetch (the first call needs no Sync)
    let cases: Vec<(&str, Option<&str>)> = vec![
        ("before connect", None),
        ("mid-pipeline", Some("2")),
        ("during merge", Some("6")),
    ];
    for (what, after) in cases {
        let w = after.map(|n| worker(&["--exit-after-frames", n]));
        let addr = w
            .as_ref()
            .map(|w| w.addr.clone())
            .unwrap_or_else(|| dead.clone());
        let f = d.path().join(format!("{what}.bin"));
        let out = host(
            &[
                "--worker",
                &addr,
                "--split-min-tokens",
                "64",
                "--worker-timeout",
                "10",
            ],
            &f,
        );
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert!(std::fs::read(&f).unwrap() == want, "{what}: logits differ");
        assert_eq!(out["link"]["fallbacks"], 1, "{what}");
        assert_eq!(out["link"]["worker_tokens"], 0, "{what}");
        if let Some(mut w) = w {
            let st = w.child.wait().unwrap();
            assert_eq!(st.code(), Some(101), "{what}: the worker should have died");
        }
    }
}

#[test]
fn the_worker_shuts_down_cleanly_on_sigterm() {
    let mut w = worker(&[]);
    let pid = w.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let st = w.child.wait().unwrap();
    assert!(st.success(), "{st:?}");
}

#[test]
fn worker_flags_are_validated() {
    let m = fixture("tiny-f32");
    let ms = m.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["worker", "--model", ms, "--listen", "0.0.0.0:0"],
            "--allow-remote",
        ),
        (
            vec![
                "worker",
                "--model",
                ms,
                "--listen",
                "0.0.0.0:0",
                "--allow-remote",
            ],
            "secret",
        ),
        (
            vec!["worker", "--model", ms, "--layers", "3..9"],
            "not a non-empty range of this 8-layer model",
        ),
        (vec!["worker", "--model", ms, "--layers", "4-8"], "a..b"),
        (
            vec!["worker", "--model", ms, "--max-memory", "lots"],
            "is not a byte size",
        ),
        (
            vec![
                "run",
                "--model",
                ms,
                "--prompt-tokens",
                "1,2",
                "--worker",
                "127.0.0.1:1",
                "--split-layer",
                "2",
            ],
            "cycle boundary",
        ),
        (
            vec![
                "run",
                "--model",
                ms,
                "--prompt-tokens",
                "1,2",
                "--worker",
                "127.0.0.1:1",
                "--split-layer",
                "0",
            ],
            "--split-layer 0 leaves the host no layers",
        ),
        (
            vec![
                "run",
                "--model",
                ms,
                "--prompt-tokens",
                "1,2",
                "--worker",
                "127.0.0.1:1",
                "--split-layer",
                "8",
            ],
            "--split-layer 8 is the end of this 8-layer model and leaves the worker no layers",
        ),
        (
            vec![
                "run",
                "--model",
                ms,
                "--prompt",
                "x",
                "--worker",
                "localhost",
            ],
            "invalid value 'localhost' for '--worker <HOST:PORT>': no port",
        ),
        (
            vec![
                "run",
                "--model",
                ms,
                "--prompt",
                "x",
                "--worker",
                "nonsense:99999",
            ],
            "\"99999\" is not a port (1 to 65535)",
        ),
    ];
    for (args, want) in cases {
        let o = Command::new(bin())
            .args(&args)
            .env_remove("BACKBURNER_SECRET")
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: want {want:?} in {err}");
    }
}

#[test]
fn bench_split_prefill_with_no_shaped_skips_the_shaped_run_and_ping() {
    let m = fixture("tiny-f32");
    let o = Command::new(bin())
        .args([
            "bench",
            "split-prefill",
            "--model",
            m.to_str().unwrap(),
            "--depths",
            "64",
            "--ubatch",
            "16",
            "--pings",
            "3",
            "--no-shaped",
        ])
        .env_remove("BACKBURNER_SECRET")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["results"][0]["tokens"], 64);
    assert_eq!(v["results"][0]["shaped_tok_s"], serde_json::Value::Null);
    assert_eq!(v["shaped_link"], serde_json::Value::Null);
    assert_eq!(v["ping_loopback"]["n"], 3);
    assert_eq!(v["ping_shaped"], serde_json::Value::Null);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("ping 16 B loopback") && !err.contains("shaped:"),
        "{err}"
    );
}
