//! Helpers of the `serve` tests: a server process on an ephemeral port (killed when dropped), bounded HTTP calls,
//! server-sent-event parsing, `/metrics` values and the process's resident memory.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, Response};
use serde_json::Value;

/// Longest wait for a server to start listening (it loads the model first).
pub const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Every HTTP call's total deadline.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(60);

/// A `backburner serve` process; killed (and reaped) when dropped.
pub struct Server {
    pub child: Child,
    /// `127.0.0.1:PORT`.
    pub addr: String,
    /// The model name it printed ("serving NAME on ...").
    pub name: String,
    /// Everything it wrote on stderr so far (for failure messages).
    pub log: Arc<Mutex<String>>,
    pub client: Client,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A blocking client with [`HTTP_TIMEOUT`] on every call.
pub fn client() -> Client {
    Client::builder()
        .timeout(HTTP_TIMEOUT)
        .connect_timeout(Duration::from_secs(10))
        .build()
        .unwrap()
}

/// Starts `backburner serve --model MODEL --port 0 --threads 1 EXTRA...` and waits (bounded) for its "serving NAME
/// on http://ADDR" line.
pub fn serve(model: &Path, extra: &[&str]) -> Server {
    let mut args = vec!["--model", model.to_str().unwrap(), "--threads", "1"];
    if !extra.contains(&"--port") && !extra.contains(&"--config") {
        args.extend(["--port", "0"]);
    }
    args.extend(extra);
    serve_args(&args)
}

/// Starts `backburner serve ARGS...` (nothing added) and waits for its address. Panics with the server's stderr
/// when it exits or stays silent past [`START_TIMEOUT`].
pub fn serve_args(args: &[&str]) -> Server {
    let mut child = Command::new(crate::common::bin())
        .arg("serve")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let (log, lines) = drain(child.stderr.take().unwrap());
    let deadline = Instant::now() + START_TIMEOUT;
    let mut server = Server {
        child,
        addr: String::new(),
        name: String::new(),
        log: log.clone(),
        client: client(),
    };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if let Some(rest) = line.split("serving ").nth(1) {
                    if let Some((name, tail)) = rest.split_once(" on http://") {
                        server.name = name.to_string();
                        server.addr = tail.split_whitespace().next().unwrap().to_string();
                        return server;
                    }
                }
            }
            Err(_) => {
                let st = wait_exit(&mut server.child, Duration::from_secs(1));
                panic!(
                    "serve {args:?} did not start (exit {st:?}); stderr:\n{}",
                    log.lock().unwrap()
                );
            }
        }
    }
}

/// Reads `stderr` on a thread until EOF: each line goes into the log and on the channel.
fn drain(stderr: std::process::ChildStderr) -> (Arc<Mutex<String>>, Receiver<String>) {
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = channel();
    let l = log.clone();
    std::thread::spawn(move || {
        let mut r = BufReader::new(stderr);
        let mut line = String::new();
        while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            l.lock().unwrap().push_str(&line);
            let _ = tx.send(line.clone());
            line.clear();
        }
    });
    (log, rx)
}

/// Waits up to `limit` for `child` to exit; `None` if it is still running.
pub fn wait_exit(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends SIGTERM to `pid`.
pub fn sigterm(pid: u32) {
    // SAFETY: kill(2) on a child's pid with a valid signal number has no memory effects here.
    let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
    assert_eq!(rc, 0, "kill -TERM {pid}");
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The server's stderr so far.
    pub fn stderr(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// POSTs `body` as JSON to `path`.
    pub fn post(&self, path: &str, body: &Value) -> Response {
        self.client
            .post(self.url(path))
            .json(body)
            .send()
            .unwrap_or_else(|e| panic!("POST {path}: {e}; server stderr:\n{}", self.stderr()))
    }

    /// POSTs `body` to `path` and returns the 200 answer's JSON (panics on another status).
    pub fn post_ok(&self, path: &str, body: &Value) -> Value {
        let r = self.post(path, body);
        let status = r.status();
        let text = r.text().unwrap();
        assert_eq!(status, 200, "POST {path} {body}: {text}");
        serde_json::from_str(&text).unwrap()
    }

    /// GETs `path` (status, body).
    pub fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .client
            .get(self.url(path))
            .send()
            .unwrap_or_else(|e| panic!("GET {path}: {e}"));
        (r.status().as_u16(), r.text().unwrap())
    }

    /// The value of the sample `backburner_{name}` (no labels) on `/metrics`.
    pub fn metric(&self, name: &str) -> f64 {
        let (st, page) = self.get("/metrics");
        assert_eq!(st, 200);
        metric(&page, name)
    }

    /// VmRSS of the server process (bytes), from /proc.
    pub fn rss(&self) -> u64 {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = s
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .expect("VmRSS line")
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap();
        kb * 1024
    }
}

/// The value of the sample `backburner_{name}` (without labels) in a Prometheus text page.
pub fn metric(page: &str, name: &str) -> f64 {
    let full = format!("backburner_{name} ");
    page.lines()
        .find_map(|l| l.strip_prefix(&full))
        .unwrap_or_else(|| panic!("no {full} in /metrics:\n{page}"))
        .trim()
        .parse()
        .unwrap()
}

/// The `data:` payloads of a server-sent-event body, in order (`[DONE]` included as is).
pub fn sse_data(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(|d| d.trim_start().to_string())
        .collect()
}

/// A streamed answer put together: the text (chat `delta.content` or completion `text`), the last
/// `finish_reason`, and whether it ended with `[DONE]` (and nothing after it).
#[derive(Debug, PartialEq, Eq, Clone)]
pub struct Streamed {
    pub text: String,
    /// Chat `delta.reasoning_content` put together.
    pub reasoning: String,
    pub finish_reason: Option<String>,
    pub done: bool,
    /// An `error` object came in the stream.
    pub error: bool,
}

pub fn assemble(body: &str) -> Streamed {
    let data = sse_data(body);
    let done = data.last().map(String::as_str) == Some("[DONE]")
        && data.iter().filter(|d| *d == "[DONE]").count() == 1;
    let mut out = Streamed {
        text: String::new(),
        reasoning: String::new(),
        finish_reason: None,
        done,
        error: false,
    };
    for d in data.iter().filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(d).unwrap_or_else(|e| panic!("chunk {d}: {e}"));
        if v.get("error").is_some() {
            out.error = true;
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(t) = c["delta"]["content"].as_str() {
                out.text.push_str(t);
            }
            if let Some(t) = c["delta"]["reasoning_content"].as_str() {
                out.reasoning.push_str(t);
            }
            if let Some(t) = c["text"].as_str() {
                out.text.push_str(t);
            }
            if let Some(f) = c["finish_reason"].as_str() {
                out.finish_reason = Some(f.to_string());
            }
        }
    }
    out
}
