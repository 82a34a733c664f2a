//! The chat page at `GET /`: served as HTML without the API key; and, in a real headless Chromium (`--dump-dom`
//! after the page's streamed request), it sends `?q=` as the first message and shows the scripted answer, with the
//! reasoning apart, all as text; or the server's error message. Without a browser the browser tests print
//! "skipped: no chromium", unless `CI` is set: then they fail (CI must install one).

use crate::common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backburner_engine::serve::{Backend, Event, Job, Metrics, SubmitError};
use backburner_engine::{Generation, StopReason, Timings};
use common::*;
use reqwest::StatusCode;

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

/// A backend answering every job with [`PIECES`] from a thread of its own; it keeps the prompts it got.
#[derive(Default)]
struct Canned {
    metrics: Metrics,
    prompts: Mutex<Vec<String>>,
}

impl Backend for Canned {
    fn submit(&self, mut job: Job) -> Result<(), SubmitError> {
        let prompt = tokenizer().decode(&job.prompt).expect("a prompt of text");
        self.prompts.lock().unwrap().push(prompt);
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
    let b = Arc::new(Canned::default());
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
    assert!(r.headers().contains_key("content-security-policy"));
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
    // the request: one user turn with the text of `q`
    let prompts = b.prompts.lock().unwrap().clone();
    assert_eq!(prompts.len(), 1, "{prompts:?}");
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

/// The DOM of `url` once its scripts and requests are done, as headless Chromium's `--dump-dom` prints it.
async fn dump_dom(browser: &Path, url: &str) -> String {
    let (browser, url) = (browser.to_path_buf(), url.to_string());
    let run = tokio::task::spawn_blocking(move || run_browser(&browser, &url));
    bounded("the browser", run)
        .await
        .expect("the browser thread")
}

fn run_browser(browser: &Path, url: &str) -> String {
    let dir = tempfile::tempdir().expect("a temp dir");
    let (out, err) = (dir.path().join("dom.html"), dir.path().join("stderr.txt"));
    let mut child = Command::new(browser)
        .args([
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
        ])
        .args(["--disable-extensions", "--disable-background-networking"])
        .arg(format!(
            "--user-data-dir={}",
            dir.path().join("profile").display()
        ))
        // virtual time waits for the page's network requests, the streamed fetch included
        .args(["--virtual-time-budget=10000", "--dump-dom", url])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).expect("a file for the DOM"))
        .stderr(std::fs::File::create(&err).expect("a file for stderr"))
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", browser.display()));
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("waiting for the browser") {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            let _ = child.wait();
            let log = std::fs::read_to_string(&err).unwrap_or_default();
            panic!("the browser ran over 60 s:\n{log}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let dom = std::fs::read_to_string(&out).expect("the DOM");
    let log = std::fs::read_to_string(&err).unwrap_or_default();
    assert!(status.success(), "the browser failed ({status}):\n{log}");
    assert!(dom.contains("</html>"), "no DOM dumped:\n{log}");
    dom
}
