//! The chat page at `GET /`: served as HTML without the API key; and, in a real headless Chromium (driven over the
//! DevTools protocol until the page's streamed answer is over), it sends `?q=` as the first message and shows the
//! scripted answer, with the reasoning apart, all as text; or the server's error message. Without a browser the browser tests print
//! "skipped: no chromium", unless `CI` is set: then they fail (CI must install one).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backburner_engine::serve::{EngineClient, Event, Job, Metrics, SubmitError};
use backburner_engine::{Generation, StopReason, Timings};
use common::*;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Answers every job with these pieces (reasoning, `</think>` split across pieces, then the answer).
const PIECES: [&str; 4] = [
    "The user says hello",
    "; greet back.\n</th",
    "ink>\n\nHi! I am <b>tiny</b> & ",
    "glad to \"help\".",
];
/// What the page must show of [`PIECES`]: the reasoning and the answer, as text.
const REASONING: &str = "The user says hello; greet back.";
const ANSWER: &str = "Hi! I am <b>tiny</b> & glad to \"help\".";

/// A backend answering every job with [`PIECES`] from a thread of its own; it keeps the prompts and `max_tokens` it
/// got. With a gate it waits after the first piece until the gate opens.
#[derive(Default)]
struct Canned {
    metrics: Metrics,
    prompts: Mutex<Vec<String>>,
    max_tokens: Mutex<Vec<usize>>,
    gate: Option<Arc<Gate>>,
}

/// Opens once: the answer goes on past its first piece.
#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.cv.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.cv.wait(open).unwrap();
        }
    }
}

impl EngineClient for Canned {
    fn submit(&self, mut job: Job) -> Result<(), SubmitError> {
        let prompt = tokenizer().decode(&job.prompt).expect("a prompt of text");
        self.prompts.lock().unwrap().push(prompt);
        self.max_tokens.lock().unwrap().push(job.params.max_tokens);
        let gate = self.gate.clone();
        std::thread::spawn(move || {
            let n = job.prompt.len();
            let started = Event::Started {
                slot: 0,
                prompt_tokens: n,
                cached_tokens: 0,
                queue_ms: 0.0,
            };
            let mut ok = (job.events)(started);
            for (id, p) in PIECES.iter().enumerate() {
                if let (1, Some(g)) = (id, &gate) {
                    g.wait();
                }
                let text = (*p).to_string();
                let id = id as u32;
                ok = ok
                    && (job.events)(Event::Token {
                        id,
                        text,
                        logprob: None,
                    });
            }
            let generation = Generation {
                tokens: (0..PIECES.len() as u32).collect(),
                text: PIECES.concat(),
                stop_reason: StopReason::Eos,
                timings: Timings::default(),
                step_logits: Vec::new(),
                error: None,
                logprobs: Vec::new(),
                speculative: None,
            };
            let text = String::new();
            let _ = ok
                && (job.events)(Event::Done {
                    generation: Box::new(generation),
                    text,
                });
        });
        Ok(())
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn slots(&self) -> usize {
        1
    }

    fn shutdown(&self, _grace: Duration) {}
}

async fn canned(api_key: Option<&str>) -> (Server, Arc<Canned>) {
    start(Canned::default(), api_key).await
}

async fn start(b: Canned, api_key: Option<&str>) -> (Server, Arc<Canned>) {
    let b = Arc::new(b);
    let s = Server::start(state(b.clone(), 4096, api_key), Duration::from_secs(1)).await;
    (s, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_html_and_needs_no_key() {
    let (s, _) = canned(Some("k")).await;
    // no key sent: the page loads, the API it calls does not
    let r = bounded("GET /", s.client.get(s.url("/")).send())
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let ct = r.headers()["content-type"].to_str().unwrap().to_string();
    assert_eq!(ct, "text/html; charset=utf-8");
    assert_eq!(
        r.headers()["content-security-policy"],
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; \
         frame-ancestors 'none'"
    );
    // no other site may frame the page (it has an API key field)
    assert_eq!(r.headers()["x-frame-options"], "DENY");
    let html = bounded("the page", r.text()).await.unwrap();
    assert!(html.starts_with("<!doctype html>"), "{}", &html[..40]);
    assert!(html.contains("/v1/chat/completions"));
    // nothing from elsewhere, and model text only ever set as text
    for outside in [
        "http://",
        "https://",
        "src=",
        "innerHTML",
        "insertAdjacentHTML",
    ] {
        assert!(!html.contains(outside), "the page has {outside:?}");
    }
    let (status, _) = s.get_text("/v1/models").await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // only GET
    let r = s.client.post(s.url("/")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_q_sends_the_first_message_and_the_answer_streams_in() {
    let Some(browser) = browser() else { return };
    let (s, b) = canned(None).await;
    let dom = dump_dom(&browser, &s.url("/?q=Hello%20%3Cthere%3E%20%26%20hi")).await;
    // the user's message and the answer, as text (escaped in the DOM's HTML), the reasoning in its own block
    let user = r#"<div class="msg user">Hello &lt;there&gt; &amp; hi</div>"#;
    assert!(dom.contains(user), "no user message in\n{dom}");
    let answer = ANSWER
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    let content = format!(r#"<div class="content">{answer}</div>"#);
    assert!(dom.contains(&content), "no answer {content} in\n{dom}");
    let think = format!(r#"<div class="think">{REASONING}</div>"#);
    let reasoning = dom.find(&think).expect("the reasoning apart");
    let block = dom[..reasoning]
        .rfind("<details")
        .expect("in a <details> block");
    assert!(
        dom[block..reasoning].contains(r#"class="reasoning""#),
        "{dom}"
    );
    assert!(
        reasoning < dom.find(&content).unwrap(),
        "reasoning above the answer"
    );
    assert!(
        dom.contains(r#"data-state="done""#),
        "the stream ended: {dom}"
    );
    assert!(!dom.contains("<b>tiny"), "model text became markup: {dom}");
    // the request: one user turn with the text of `q`, and the page's default token limit
    let prompts = b.prompts.lock().unwrap().clone();
    assert_eq!(prompts.len(), 1, "{prompts:?}");
    assert_eq!(*b.max_tokens.lock().unwrap(), [1024]);
    assert!(
        prompts[0].contains("<|im_start|>user\nHello <there> & hi<|im_end|>"),
        "{prompts:?}"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_servers_error_message_is_shown() {
    let Some(browser) = browser() else { return };
    // the page has no key stored: the API answers 401 and the page shows its message
    let (s, b) = canned(Some("k")).await;
    let dom = dump_dom(&browser, &s.url("/?q=Hi")).await;
    assert!(dom.contains(r#"<div class="msg user">Hi</div>"#), "{dom}");
    assert!(
        dom.contains(r#"<div class="error">invalid or missing API key"#),
        "{dom}"
    );
    assert!(dom.contains(r#"data-state="error""#), "{dom}");
    assert!(b.prompts.lock().unwrap().is_empty());
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_conversation_goes_on_with_the_system_prompt() {
    let Some(browser) = browser() else { return };
    let (s, b) = canned(None).await;
    let url = s.url("/?q=Hello");
    let run = tokio::task::spawn_blocking(move || {
        let mut br = Browser::start(&browser);
        let page = br.open(&url);
        br.wait(&page, &dom_when_done(1));
        let second = "document.getElementById('system').value = 'Be brief.'; \
            const max = document.getElementById('max-tokens'); max.value = '7'; \
            max.dispatchEvent(new Event('change')); \
            document.getElementById('input').value = 'And again?'; \
            document.getElementById('form').requestSubmit(); 'sent'";
        assert_eq!(br.eval(&page, second), "sent");
        let dom = br.wait(&page, &dom_when_done(2));
        // the limit is kept for the next visit
        let kept = "localStorage.getItem('backburner.maxTokens')";
        (dom, br.eval(&page, kept))
    });
    let (dom, kept) = bounded("the browser", run)
        .await
        .expect("the browser thread");
    assert_eq!(kept, "7");
    // the first request with the default limit, the second with the one set
    assert_eq!(*b.max_tokens.lock().unwrap(), [1024, 7]);
    assert!(
        dom.contains(r#"<div class="msg user">And again?</div>"#),
        "{dom}"
    );
    assert_eq!(dom.matches(r#"data-state="done""#).count(), 2, "{dom}");
    // the second request: the system prompt, the first turn with its answer (its reasoning dropped by the
    // template), the new question
    let prompts = b.prompts.lock().unwrap().clone();
    assert_eq!(prompts.len(), 2, "{prompts:?}");
    let want = format!(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
         <|im_start|>assistant\n{ANSWER}<|im_end|>\n<|im_start|>user\nAnd again?<|im_end|>\n"
    );
    assert!(
        prompts[1].starts_with(&want),
        "{want:?}\nnot at the start of\n{:?}",
        prompts[1]
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_browser_the_reasoning_summary_counts_while_it_streams() {
    let Some(browser) = browser() else { return };
    let gate = Arc::new(Gate::default());
    let canned = Canned {
        gate: Some(gate.clone()),
        ..Canned::default()
    };
    let (s, _) = start(canned, None).await;
    let url = s.url("/?q=Hi");
    let run = tokio::task::spawn_blocking(move || {
        let mut br = Browser::start(&browser);
        let page = br.open(&url);
        // the first piece is in, the answer held: the collapsed summary counts it
        let summary = "(() => { const d = document.querySelector('.msg.assistant details.reasoning'); \
            return d && !d.hidden ? (d.open ? 'open ' : '') + d.querySelector('summary').textContent : ''; })()";
        let live = br.wait(&page, summary);
        gate.open();
        br.wait(&page, &dom_when_done(1));
        (live, br.eval(&page, summary))
    });
    let (live, done) = bounded("the browser", run)
        .await
        .expect("the browser thread");
    assert_eq!(live, "Reasoning\u{2026} (1 token)");
    assert_eq!(done, "Reasoning");
    s.stop().await;
}

/// The browser to run: `$CHROMIUM`, else `chromium`, `chromium-browser` or `google-chrome` on the `PATH`. `None`
/// (after saying so) when there is none, unless `CI` is set: then the test fails.
fn browser() -> Option<PathBuf> {
    let found = std::env::var_os("CHROMIUM").map(PathBuf::from).or_else(|| {
        let path = std::env::var_os("PATH")?;
        let names = ["chromium", "chromium-browser", "google-chrome"];
        names.iter().find_map(|n| {
            std::env::split_paths(&path)
                .map(|d| d.join(n))
                .find(|p| p.is_file())
        })
    });
    if found.is_none() {
        assert!(
            std::env::var_os("CI").is_none(),
            "no chromium: CI must install one (chromium, chromium-browser or google-chrome on the PATH, or $CHROMIUM)"
        );
        println!("skipped: no chromium (set CHROMIUM or put chromium on the PATH)");
    }
    found
}

/// The page's DOM (`<!DOCTYPE html>` and the root's HTML, as `--dump-dom` prints it) once its first answer is over
/// (its assistant message is no longer `running`), read from headless Chromium over the DevTools protocol:
/// `--dump-dom` with a virtual time budget does not wait for a streamed body.
async fn dump_dom(browser: &Path, url: &str) -> String {
    let (browser, url) = (browser.to_path_buf(), url.to_string());
    let run = tokio::task::spawn_blocking(move || {
        let mut b = Browser::start(&browser);
        let page = b.open(&url);
        b.wait(&page, &dom_when_done(1))
    });
    bounded("the browser", run)
        .await
        .expect("the browser thread")
}

/// An expression giving the page's DOM once it shows `n` answers and the last is over, else "".
fn dom_when_done(n: usize) -> String {
    format!(
        "(() => {{ const m = document.querySelectorAll('.msg.assistant'); \
         return m.length === {n} && m[{n} - 1].dataset.state !== 'running' \
         ? '<!DOCTYPE html>\\n' + document.documentElement.outerHTML : ''; }})()"
    )
}

/// Headless Chromium driven over `--remote-debugging-pipe` (JSON messages ending in a NUL byte; commands on its fd
/// 3, answers and events on its fd 4). Killed when dropped.
struct Browser {
    child: std::process::Child,
    to: std::io::PipeWriter,
    from: std::io::BufReader<std::io::PipeReader>,
    next_id: u64,
    _profile: tempfile::TempDir,
}

impl Browser {
    fn start(path: &Path) -> Browser {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let profile = tempfile::tempdir().expect("a temp dir");
        let (their_in, to) = std::io::pipe().expect("a pipe");
        let (from, their_out) = std::io::pipe().expect("a pipe");
        let (r, w) = (their_in.as_raw_fd(), their_out.as_raw_fd());
        let mut cmd = Command::new(path);
        cmd.args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
        ])
        .args(["--disable-extensions", "--disable-background-networking"])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--remote-debugging-pipe", "about:blank"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls between fork and exec: the pipe ends become fds 3 and 4 (moved above
        // 10 first, so neither overwrites the other), kept open across exec
        unsafe {
            cmd.pre_exec(move || {
                let (a, b) = (
                    libc::fcntl(r, libc::F_DUPFD, 10),
                    libc::fcntl(w, libc::F_DUPFD, 10),
                );
                if a < 0 || b < 0 || libc::dup2(a, 3) < 0 || libc::dup2(b, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::fcntl(3, libc::F_SETFD, 0);
                libc::fcntl(4, libc::F_SETFD, 0);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", path.display()));
        drop((their_in, their_out));
        Browser {
            child,
            to,
            from: std::io::BufReader::new(from),
            next_id: 0,
            _profile: profile,
        }
    }

    /// Sends a command (to the page's session when given) and returns its `result`, skipping events.
    fn call(&mut self, session: Option<&str>, method: &str, params: Value) -> Value {
        use std::io::{BufRead, Write};
        self.next_id += 1;
        let mut msg = json!({"id": self.next_id, "method": method, "params": params});
        if let Some(s) = session {
            msg["sessionId"] = json!(s);
        }
        let mut bytes = serde_json::to_vec(&msg).unwrap();
        bytes.push(0);
        self.to.write_all(&bytes).expect("writing to the browser");
        loop {
            let mut buf = Vec::new();
            let n = self
                .from
                .read_until(0, &mut buf)
                .expect("reading the browser");
            assert!(n > 0, "the browser closed its pipe (during {method})");
            buf.pop_if(|b| *b == 0);
            let v: Value = serde_json::from_slice(&buf).expect("a JSON message");
            if v["id"] == self.next_id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    /// Opens `url` in a new page; returns the page's session.
    fn open(&mut self, url: &str) -> String {
        let target =
            self.call(None, "Target.createTarget", json!({"url": url}))["targetId"].clone();
        let attach = json!({"targetId": target, "flatten": true});
        let session = self.call(None, "Target.attachToTarget", attach)["sessionId"].clone();
        session.as_str().expect("a session").to_string()
    }

    /// The value of `expr` in the page.
    fn eval(&mut self, page: &str, expr: &str) -> Value {
        let eval = json!({"expression": expr, "returnByValue": true});
        self.call(Some(page), "Runtime.evaluate", eval)["result"]["value"].clone()
    }

    /// Polls `expr` in the page until it gives a non-empty string, and returns it (at most 60 s).
    fn wait(&mut self, page: &str, expr: &str) -> String {
        let t0 = Instant::now();
        loop {
            match self.eval(page, expr).as_str() {
                Some(v) if !v.is_empty() => return v.to_string(),
                _ => {}
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "never true in the page: {expr}"
            );
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for Browser {
    /// Asks the browser to close (so it ends its helper processes), and kills it after 5 s.
    fn drop(&mut self) {
        use std::io::Write;
        let close = format!(
            "{{\"id\":{},\"method\":\"Browser.close\"}}\0",
            self.next_id + 1
        );
        let _ = self.to.write_all(close.as_bytes());
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(5) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
