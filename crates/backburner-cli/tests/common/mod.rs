//! Helpers shared by the two-process tests: the binary, fixtures, a worker process, a host run.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_backburner")
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

pub struct WorkerProc {
    pub child: Child,
    pub addr: String,
}

impl Drop for WorkerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `backburner worker` on an ephemeral port and waits for its "listening on" line.
pub fn worker(extra: &[&str]) -> WorkerProc {
    worker_wrapped(&[], extra)
}

/// Starts `backburner worker` under a wrapper command (`wrapper[0] wrapper[1..] backburner worker ...`), e.g. to run
/// it as another user or under a resource limit.
pub fn worker_wrapped(wrapper: &[&str], extra: &[&str]) -> WorkerProc {
    worker_for(&fixture("tiny-f32"), wrapper, extra)
}

/// Starts `backburner worker` on the model in `m` (under `wrapper`, as [`worker_wrapped`]).
pub fn worker_for(m: &std::path::Path, wrapper: &[&str], extra: &[&str]) -> WorkerProc {
    let mut cmd = match wrapper.split_first() {
        Some((w, rest)) => {
            let mut c = Command::new(w);
            c.args(rest).arg(bin());
            c
        }
        None => Command::new(bin()),
    };
    // an ephemeral port unless `extra` gives one
    let listen: &[&str] = if extra.contains(&"--listen") {
        &[]
    } else {
        &["--listen", "127.0.0.1:0"]
    };
    let child = cmd
        .arg("worker")
        .args(listen)
        .args(["--threads", "1", "--model", m.to_str().unwrap()])
        .args(extra)
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn worker");
    let mut w = WorkerProc {
        child,
        addr: String::new(),
    };
    let mut r = BufReader::new(w.child.stderr.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            r.read_line(&mut line).unwrap() > 0,
            "worker exited before listening"
        );
        if let Some(rest) = line.split("listening on ").nth(1) {
            let addr = rest.split_whitespace().next().unwrap().to_string();
            // keep draining stderr so the worker never blocks on a full pipe
            std::thread::spawn(move || {
                let mut sink = String::new();
                while r.read_line(&mut sink).map(|n| n > 0).unwrap_or(false) {
                    sink.clear();
                }
            });
            w.addr = addr;
            return w;
        }
    }
}

/// `run` on the tiny fixture's prompt (12 greedy tokens, ubatch 64, 1 thread, `--json`) with `extra` flags.
pub fn run_tiny(extra: &[&str]) -> Output {
    let m = fixture("tiny-f32");
    let p = m.join("prompt.txt");
    Command::new(bin())
        .args([
            "run",
            "--model",
            m.to_str().unwrap(),
            "--prompt-file",
            p.to_str().unwrap(),
        ])
        .args([
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--ubatch",
            "64",
            "--threads",
            "1",
            "--json",
        ])
        .args(extra)
        .output()
        .unwrap()
}

/// [`run_tiny`] writing its logits to `dump`; asserts success and returns the JSON object.
pub fn host(extra: &[&str], dump: &std::path::Path) -> serde_json::Value {
    let o = run_tiny(&[extra, &["--dump-logits", dump.to_str().unwrap()]].concat());
    assert!(
        o.status.success(),
        "host failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Runs the binary with `args`, stdin closed, the tests' model cache.
pub fn bb(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .env(
            "BACKBURNER_CACHE",
            std::env::temp_dir().join("backburner-cli-test-cache"),
        )
        .stdin(Stdio::null())
        .output()
        .expect("run backburner")
}

/// A run's stderr as text.
pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
