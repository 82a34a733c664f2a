//! The link under a bad cable and a hostile peer, as two real processes with a fault-injecting relay between them:
//! a flipped byte, lost bytes, a trickling or stalled peer and a cut connection each end the split call within its
//! deadline, and the host's output is the local one bit for bit. A slow unauthenticated connection cannot hold the
//! worker, and a thread limit cannot crash it.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use backburner_link::relay::{Dir, Fault, Relay};
use common::{host, worker, worker_wrapped};

/// The host's split run through `relay`, with a 2 s worker timeout.
fn split_through(relay: &Relay, dump: &std::path::Path) -> (serde_json::Value, Duration) {
    let addr = relay.addr().to_string();
    let t = Instant::now();
    let out = host(
        &[
            "--worker",
            &addr,
            "--split-min-tokens",
            "64",
            "--worker-timeout",
            "2",
        ],
        dump,
    );
    (out, t.elapsed())
}

#[test]
fn a_page_size_workers_refuse_runs_locally_without_contacting_the_worker() {
    // Nothing listens at port 1: had the host tried the worker, it would report a failure and count a fallback.
    let d = tempfile::tempdir().unwrap();
    let page = ["--kv-page-size", "100"];
    let local = host(&page, &d.path().join("local.bin"));
    let flags = [
        &page[..],
        &["--worker", "127.0.0.1:1", "--split-min-tokens", "1"],
    ]
    .concat();
    let o = common::run_tiny(
        &[
            &flags[..],
            &["--dump-logits", d.path().join("w.bin").to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--kv-page-size 100 is not a multiple of 64")
            && !err.contains("worker failed"),
        "{err}"
    );
    let out: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(out["tokens"], local["tokens"]);
    assert!(out.get("link").is_none(), "no worker attached: {out}");
    assert_eq!(
        std::fs::read(d.path().join("w.bin")).unwrap(),
        std::fs::read(d.path().join("local.bin")).unwrap()
    );
    // KV offload needs the workers to hold pages: there the same size is an error, not a silent local run.
    let o = common::run_tiny(&[&flags[..], &["--kv-budget", "128"]].concat());
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("--kv-page-size 100 must be a multiple of 64 for workers to hold KV pages"),
        "{err}"
    );
}

#[test]
fn every_link_fault_falls_back_to_the_local_logits_within_the_deadline() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    let want = std::fs::read(d.path().join("local.bin")).unwrap();
    let w = worker(&[]);
    let upstream = w.addr.parse().unwrap();
    // The host sends ~0.4 KB of handshake, then 5 RunLayers of 16 KiB (64 tokens × 64 hidden × f32) and a Fetch; the
    // worker answers ~0.3 KB of handshake, 5 LayersDone and an ~87 KB FetchDone.
    let faults = [
        (
            "flipped byte in a residual",
            Fault::FlipByte {
                dir: Dir::ToWorker,
                at: 30_000,
            },
        ),
        (
            "flipped byte in fetched rows",
            Fault::FlipByte {
                dir: Dir::ToHost,
                at: 20_000,
            },
        ),
        (
            "flipped byte in a header",
            Fault::FlipByte {
                dir: Dir::ToHost,
                at: 700,
            },
        ),
        (
            "lost bytes",
            Fault::DropBytes {
                dir: Dir::ToWorker,
                at: 20_000,
                len: 100,
            },
        ),
        (
            "trickling worker",
            Fault::Trickle {
                dir: Dir::ToHost,
                after: 1_000,
                chunk: 64,
                every: Duration::from_millis(200),
            },
        ),
        (
            "trickling host",
            Fault::Trickle {
                dir: Dir::ToWorker,
                after: 1_000,
                chunk: 64,
                every: Duration::from_millis(200),
            },
        ),
        (
            "stalled worker",
            Fault::Stall {
                dir: Dir::ToHost,
                after: 1_000,
            },
        ),
        (
            "stalled host",
            Fault::Stall {
                dir: Dir::ToWorker,
                after: 10_000,
            },
        ),
        (
            "cut connection",
            Fault::CloseAfter {
                dir: Dir::ToHost,
                after: 5_000,
            },
        ),
    ];
    for (what, fault) in faults {
        let relay = Relay::start(upstream, fault, 1).unwrap();
        let f = d.path().join("split.bin");
        let (out, took) = split_through(&relay, &f);
        assert_eq!(out["tokens"], local["tokens"], "{what}");
        assert!(std::fs::read(&f).unwrap() == want, "{what}: logits differ");
        assert_eq!(out["link"]["fallbacks"], 1, "{what}: {}", out["link"]);
        assert_eq!(out["link"]["worker_tokens"], 0, "{what}");
        // the deadline is 2 s plus transfer and compute allowances; the local rerun takes well under a second
        assert!(took < Duration::from_secs(20), "{what}: took {took:?}");
    }
    // the same relay with no fault: split, bit for bit
    let relay = Relay::start(upstream, Fault::None, 1).unwrap();
    let f = d.path().join("clean.bin");
    let (out, _) = split_through(&relay, &f);
    assert!(std::fs::read(&f).unwrap() == want);
    assert_eq!(out["link"]["fallbacks"], 0);
    assert_eq!(out["link"]["worker_tokens"], 320);
}

#[test]
fn slow_or_silent_unauthenticated_connections_neither_hold_nor_block_the_worker() {
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    let want = std::fs::read(d.path().join("local.bin")).unwrap();
    let w = worker(&[]);
    // 40 silent connections, more than the 16 handshakes the worker keeps open (the oldest are dropped)
    let idle: Vec<TcpStream> = (0..40)
        .filter_map(|_| TcpStream::connect(&w.addr).ok())
        .collect();
    assert_eq!(idle.len(), 40);
    std::thread::sleep(Duration::from_millis(200));
    // a peer that drips a well-formed Hello (24-byte header, 32-byte nonce) one byte every 100 ms: 5.6 s for the frame
    let mut hello = b"BBLK".to_vec();
    hello.extend_from_slice(&backburner_link::PROTOCOL_VERSION.to_le_bytes());
    hello.extend_from_slice(b"\x01\x00\x20\x00\x00\x00");
    hello.resize(24 + 32, 0);
    let mut drip = TcpStream::connect(&w.addr).unwrap();
    let started = Instant::now();
    let dripper = std::thread::spawn(move || {
        for b in hello.iter().cycle().take(200) {
            if drip.write_all(&[*b]).is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut rest = Vec::new();
        let _ = drip.read_to_end(&mut rest);
        started.elapsed()
    });
    // meanwhile a real host is served at once
    let f = d.path().join("split.bin");
    let out = host(&["--worker", &w.addr, "--split-min-tokens", "64"], &f);
    assert!(std::fs::read(&f).unwrap() == want);
    assert_eq!(out["link"]["fallbacks"], 0);
    assert_eq!(out["link"]["worker_tokens"], 320);
    // and the dripping peer is cut off by the 5 s handshake deadline, not after its 20 s of bytes
    let held = dripper.join().unwrap();
    assert!(held < Duration::from_secs(10), "held for {held:?}");
    assert!(held >= Duration::from_secs(4), "cut after {held:?}");
    drop(idle);
    drop(local);
}

/// Tasks (processes and threads) the user `nobody` runs now.
fn nobody_tasks() -> usize {
    let mut n = 0;
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let status = e.path().join("status");
        if let Ok(s) = std::fs::read_to_string(status) {
            let uid = s.lines().find(|l| l.starts_with("Uid:"));
            let threads = s.lines().find(|l| l.starts_with("Threads:"));
            if uid.is_some_and(|l| l.split_whitespace().nth(1) == Some("65534")) {
                n += threads
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or(1);
            }
        }
    }
    n
}

#[test]
fn a_thread_limit_refuses_connections_instead_of_crashing_the_worker() {
    // RLIMIT_NPROC binds every user but root, so the worker runs as `nobody` under it (this needs root and
    // setpriv; elsewhere the test says so and checks nothing).
    let root = std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false);
    // setpriv and prlimit must exist and be allowed to switch users here (a container may forbid it)
    let usable = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "prlimit",
            "--nproc=64",
            "--",
            "true",
        ])
        .status()
        .is_ok_and(|s| s.success());
    if !root || !usable {
        eprintln!("skipped: needs root, setpriv and prlimit to run the worker as nobody under RLIMIT_NPROC");
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let local = host(&[], &d.path().join("local.bin"));
    let want = std::fs::read(d.path().join("local.bin")).unwrap();
    // the worker runs 3 tasks (main, signal handler, one compute thread): room for 5 connection threads
    let nproc = format!("--nproc={}", nobody_tasks() + 8);
    let wrapper = [
        "setpriv",
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "prlimit",
        &nproc,
        "--",
    ];
    let mut w = worker_wrapped(&wrapper, &[]);
    let flood: Vec<TcpStream> = (0..60)
        .filter_map(|_| TcpStream::connect(&w.addr).ok())
        .collect();
    assert!(flood.len() >= 50, "{} connections", flood.len());
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        w.child.try_wait().unwrap().is_none(),
        "the worker died under the thread limit"
    );
    // a host during the flood gets its answer, split or local, bit for bit
    let f = d.path().join("during.bin");
    let out = host(
        &[
            "--worker",
            &w.addr,
            "--split-min-tokens",
            "64",
            "--worker-timeout",
            "2",
        ],
        &f,
    );
    assert!(std::fs::read(&f).unwrap() == want);
    assert_eq!(out["tokens"], local["tokens"]);
    drop(flood);
    // once the flood is gone (its threads end at the end of stream), the worker serves split again
    std::thread::sleep(Duration::from_millis(500));
    assert!(w.child.try_wait().unwrap().is_none(), "the worker died");
    let f = d.path().join("after.bin");
    let out = host(&["--worker", &w.addr, "--split-min-tokens", "64"], &f);
    assert!(std::fs::read(&f).unwrap() == want);
    assert_eq!(out["link"]["fallbacks"], 0, "{}", out["link"]);
    assert_eq!(out["link"]["worker_tokens"], 320);
}
