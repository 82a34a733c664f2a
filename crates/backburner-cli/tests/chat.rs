//! `backburner chat` under a pseudo-terminal (as a person at a terminal uses it: echo, Ctrl-C as SIGINT from the
//! line discipline, Ctrl-D as the end of the input), on the bundled default model, against `backburner run`.
//!
//! The pseudo-terminal comes from `libc::openpty` (libc is already a dev-dependency; no expect crate needed).
#![cfg(unix)]

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backburner_model::chat::{parse_output, ChatRequest};
use backburner_model::{ModelConfig, TextTokenizer};
use serde_json::{json, Value};

fn cache() -> PathBuf {
    std::env::temp_dir().join("backburner-cli-test-cache")
}

/// `backburner chat ARGS` on a pseudo-terminal: its stdin, stdout and stderr, and its controlling terminal.
struct Pty {
    master: std::fs::File,
    child: Child,
    out: Arc<Mutex<Vec<u8>>>,
    /// Bytes of `out` that earlier [`Pty::expect`] calls consumed.
    seen: usize,
}

impl Pty {
    fn chat(args: &[&str]) -> Pty {
        let (mut m, mut s) = (0, 0);
        let null = std::ptr::null_mut();
        // SAFETY: openpty writes two fds; no name, default termios and window size
        let rc = unsafe { libc::openpty(&mut m, &mut s, null, std::ptr::null(), std::ptr::null()) };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: both fds are new and owned here
        let (m, s) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_backburner"));
        cmd.arg("chat")
            .args(args)
            .env("BACKBURNER_CACHE", cache())
            .env_remove("NO_COLOR")
            .stdin(Stdio::from(s.try_clone().unwrap()))
            .stdout(Stdio::from(s.try_clone().unwrap()))
            .stderr(Stdio::from(s));
        // SAFETY: only async-signal-safe calls between fork and exec: a new session whose controlling terminal is
        // the pty (stdin), so that ^C typed there sends SIGINT to the chat
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("spawn chat");
        drop(cmd); // our copies of the terminal's side: reads end (EIO) once the chat exits
        let master = std::fs::File::from(m);
        let mut reader = master.try_clone().unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let o = out.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                o.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Pty {
            master,
            child,
            out,
            seen: 0,
        }
    }

    /// Types `s`.
    fn send(&mut self, s: &str) {
        self.master.write_all(s.as_bytes()).unwrap();
    }

    /// Waits (up to 2 minutes) until `pat` appears in the output after what was consumed; returns the output up to
    /// and including it, carriage returns removed (the terminal writes `\n` as `\r\n`).
    fn expect(&mut self, pat: &str) -> String {
        let t0 = Instant::now();
        loop {
            {
                let out = self.out.lock().unwrap();
                let text = String::from_utf8_lossy(&out[self.seen..]).replace('\r', "");
                if let Some(at) = text.find(pat) {
                    let upto = &text[..at + pat.len()];
                    // count the consumed bytes in the raw output: the text without CRs, CRs added back
                    let mut raw = 0;
                    let mut kept = 0;
                    while kept < upto.len() {
                        if out[self.seen + raw] != b'\r' {
                            kept += 1;
                        }
                        raw += 1;
                    }
                    self.seen += raw;
                    return upto.to_string();
                }
                if t0.elapsed() > Duration::from_secs(120) {
                    panic!("no {pat:?} after 2 minutes in:\n{text}");
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the chat to exit; its exit code.
    fn wait(mut self) -> Option<i32> {
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code();
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the chat did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Pty {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `backburner run ARGS --json` on the bundled model, greedy: the object.
fn run_json(args: &[&str]) -> Value {
    let o = Command::new(env!("CARGO_BIN_EXE_backburner"))
        .arg("run")
        .args(args)
        .args(["--temp", "0", "--threads", "1", "-c", "512", "--json"])
        .env("BACKBURNER_CACHE", cache())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    let a = v.as_array().unwrap();
    a.iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// One reply as the chat shows it: what follows the echoed input line up to the stats line (`--verbose`).
fn reply(turn: &str) -> (String, usize, usize) {
    let after_echo = &turn[turn.find('\n').unwrap() + 1..];
    let at = after_echo.rfind("prompt ").unwrap();
    let stats = &after_echo[at..];
    let num = |s: &str| s.split(' ').next().unwrap().parse::<usize>().unwrap();
    let n = num(&stats["prompt ".len()..]);
    let cached = num(&stats[stats.find('(').unwrap() + 1..]);
    (after_echo[..at].to_string(), n, cached)
}

/// The bundled model's tokenizer (generated by an earlier `run` of the test).
fn tokenizer() -> TextTokenizer {
    let dir = cache().join("default-model-v1");
    let cfg = ModelConfig::from_dir(&dir).unwrap();
    TextTokenizer::from_dir(&dir, cfg.vocab_size, &cfg.eos_token_ids)
        .unwrap()
        .unwrap()
}

fn render(tok: &TextTokenizer, messages: &[Value], generation_prompt: bool) -> Vec<u32> {
    let kwargs = serde_json::Map::new();
    let req = ChatRequest {
        messages,
        tools: None,
        add_generation_prompt: generation_prompt,
        kwargs: &kwargs,
    };
    tok.encode(&tok.render_chat(&req).unwrap()).unwrap()
}

fn assistant(text: &str) -> Value {
    let p = parse_output(text, true, None);
    let mut m = json!({"role": "assistant", "content": p.content.unwrap_or_default()});
    if let Some(r) = p.reasoning {
        m["reasoning_content"] = r.into();
    }
    m
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// The end of the greeting and the first prompt (the loading bar before it draws `>` too).
const GREETING_END: &str = "Ctrl-D or /exit leaves\n> ";

const SYSTEM: &str = "You are a careful assistant for people who run language models on their own machines. \
    Answer in two or three sentences, name the command to run when there is one, and say plainly when you do not \
    know.";
const FIRST: &str = "How do I chat with a model in the terminal?";
const SECOND: &str = "And how do I save the conversation?";

#[test]
fn chat_turns_reuse_the_previous_turn_and_match_run_clear_save_and_bad_input() {
    // the reference of the first turn: `run --chat` on the same messages (this also generates the bundled model)
    let r1 = run_json(&["--chat", "--system", SYSTEM, "-p", FIRST, "-n", "8"]);
    let (p1, text1) = (ids(&r1["prompt_tokens"]), r1["text"].as_str().unwrap());
    let mut c = Pty::chat(&[
        "--no-color",
        "--temp",
        "0",
        "-n",
        "8",
        "--threads",
        "1",
        "-c",
        "512",
        "--verbose",
        "--system",
        SYSTEM,
    ]);
    c.expect(GREETING_END);
    c.send(&format!("{FIRST}\n"));
    let (shown1, n1, cached1) = reply(&c.expect("tok/s\n> "));
    // the template opened the thinking block: without color the text shows as generated after that `<think>`
    assert_eq!(shown1, format!("<think>\n{text1}\n"));
    assert_eq!((n1, cached1), (p1.len(), 0));

    c.send(&format!("{SECOND}\n"));
    let (shown2, n2, cached2) = reply(&c.expect("tok/s\n> "));
    // the second turn's prompt is the whole conversation re-rendered; the slot resumes from the first turn's
    // checkpoints (the last grid point, a multiple of 64 here, of its stable prefix and of its prompt) inside
    // the prefix this prompt shares with what the slot holds
    let tok = tokenizer();
    let sys = json!({"role": "system", "content": SYSTEM});
    let u1 = json!({"role": "user", "content": FIRST});
    let u2 = json!({"role": "user", "content": SECOND});
    let convo = [sys.clone(), u1.clone(), assistant(text1), u2.clone()];
    let p2 = render(&tok, &convo, true);
    let stable1 = common_prefix(&p1, &render(&tok, &[sys.clone(), u1.clone()], false));
    let held: Vec<u32> = p1.iter().chain(&ids(&r1["tokens"])).copied().collect();
    let shared = common_prefix(&held, &p2);
    let expected = [stable1, p1.len()]
        .map(|p| p - p % 64)
        .into_iter()
        .filter(|&c| c <= shared)
        .max()
        .unwrap();
    assert!(expected >= 64, "stable prefix {stable1}, shared {shared}");
    assert_eq!((n2, cached2), (p2.len(), expected));
    // and the resumed state gives the bits of a cold run of the whole prompt
    let ids2: Vec<String> = p2.iter().map(u32::to_string).collect();
    let r2 = run_json(&["--prompt-tokens", &ids2.join(","), "-n", "8"]);
    let text2 = r2["text"].as_str().unwrap();
    assert_eq!(shown2, format!("<think>\n{text2}\n"));

    // /save writes the conversation as OpenAI messages
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("chat.json");
    c.send(&format!("/save {}\n", file.display()));
    c.expect("(saved 5 messages to ");
    c.expect("> ");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let mut all = convo.to_vec();
    all.push(assistant(text2));
    assert_eq!(saved, json!({ "messages": all }));

    // bad input: an unwritable file, an unknown command, a message past the context; the chat goes on
    c.send("/save /nonexistent-dir/chat.json\n");
    c.expect("error: write /nonexistent-dir/chat.json: ");
    c.expect("; the chat goes on\n> ");
    c.send("/bogus\n");
    c.expect("unknown command /bogus\ncommands:\n  /clear ");
    c.expect("> ");
    c.send(&format!("{}\n", "word ".repeat(600)));
    c.expect(
        "which leaves no room for a reply in the context of 512 tokens: the message was not sent",
    );
    c.expect("> ");
    c.send("/save /dev/null\n");
    c.expect("(saved 5 messages to /dev/null)"); // the conversation is kept

    // /clear: the next turn starts cold, and the first message gives the first answer again
    c.send("/clear\n");
    c.expect("(conversation cleared; the system prompt stays)\n> ");
    c.send(&format!("{FIRST}\n"));
    let (shown3, n3, cached3) = reply(&c.expect("tok/s\n> "));
    assert_eq!((shown3, n3, cached3), (shown1, p1.len(), 0));
    c.send("/exit\n");
    assert_eq!(c.wait(), Some(0));
}

#[test]
fn ctrl_c_stops_a_reply_and_the_chat_goes_on_until_ctrl_d() {
    // a reply that would not end by itself; on a terminal the thinking is dimmed
    let mut c = Pty::chat(&["--temp", "0", "--ignore-eos", "--threads", "1"]);
    c.expect(GREETING_END);
    c.send("Hi\n");
    c.expect("\x1b[2m");
    std::thread::sleep(Duration::from_millis(300));
    c.send("\x03");
    c.expect("\x1b[0m\n");
    c.expect("(interrupted: the reply so far stays in the conversation)\n> ");
    // at the prompt, Ctrl-C says how to leave
    c.send("\x03");
    c.expect("press Ctrl-D or type /exit)\n> ");
    // the interrupted reply is in the conversation
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.json");
    c.send(&format!("/save {}\n", file.display()));
    c.expect("(saved 2 messages to ");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let m = saved["messages"].as_array().unwrap();
    assert_eq!(m[0], json!({"role": "user", "content": "Hi"}));
    assert_eq!(m[1]["role"], "assistant");
    assert!(
        !m[1]["reasoning_content"].as_str().unwrap().is_empty(),
        "{saved}"
    );
    // a further turn runs (and is stopped the same way), then Ctrl-D leaves with 0
    c.expect("> ");
    c.send("Again\n");
    c.expect("\x1b[2m");
    c.send("\x03");
    c.expect("(interrupted: the reply so far stays in the conversation)\n> ");
    c.send("\x04");
    assert_eq!(c.wait(), Some(0));
}

/// `backburner ARGS` (a chat) greedy on one thread, with `input` on standard input (not a terminal): its stdout and
/// stderr; asserts exit code 0.
fn talk(args: &[&str], input: &str) -> (String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_backburner"))
        .args(args)
        .args(["--threads", "1", "--temp", "0"])
        .env("BACKBURNER_CACHE", cache())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // typed ahead: the lines wait for the reply before them
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(input.as_bytes()).unwrap();
    drop(stdin);
    let o = child.wait_with_output().unwrap();
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(o.status.code(), Some(0), "{err}");
    (String::from_utf8(o.stdout).unwrap(), err)
}

#[test]
fn run_cnv_is_the_chat_and_reads_piped_input() {
    let args = ["-n", "4", "-sys", "Be terse."];
    let (chat, _) = talk(&[&["chat"][..], &args].concat(), "Hi\n/help\n");
    // not a terminal: no color, the text as generated after the `<think>` the template opened
    assert!(
        chat.starts_with("> <think>\n") && chat.contains("\n> commands:\n"),
        "{chat}"
    );
    assert!(
        chat.ends_with("Ctrl-C stops a reply (what it wrote stays in\nthe conversation).\n> \n"),
        "{chat}"
    );
    assert_eq!(
        talk(&[&["run", "-cnv"][..], &args].concat(), "Hi\n/help\n").0,
        chat
    );
}

#[test]
fn a_layer_split_chat_gives_the_local_replies_and_reuse() {
    let m = crate::common::fixture("tiny-hub");
    let w = crate::common::worker_for(&m, &[], &[]);
    let input = "Hello there, how are you today?\nAnd what comes next?\n";
    let chat = |extra: &[&str]| {
        let model = [
            "chat",
            "--model",
            m.to_str().unwrap(),
            "-n",
            "6",
            "--verbose",
        ];
        let args = [&model[..], &["--system", SYSTEM], extra].concat();
        let (out, err) = talk(&args, input);
        // the token counts of the stats lines, not the rates
        let counts: Vec<String> = err
            .lines()
            .filter(|l| l.starts_with("prompt "))
            .map(|l| l.split(" | prefill").next().unwrap().to_string())
            .collect();
        (out, counts)
    };
    let local = chat(&[]);
    // the second turn resumes from the first's checkpoints (the system prompt makes them reachable)
    assert_eq!(local.1.len(), 2, "{local:?}");
    assert!(
        local.1[1].starts_with("prompt 167 tokens (128 cached, 39 prefilled)"),
        "{local:?}"
    );
    assert_eq!(chat(&["--worker", &w.addr, "--layer-split", "4"]), local);
    // layers on a device (the device layer's CPU backend): the same replies, the second turn from the cache
    assert_eq!(
        chat(&["--device", "cpu", "--device-cpu-backend", "-ngl", "3"]),
        local
    );
}

#[test]
fn the_models_control_characters_are_shown_on_a_terminal_and_exact_in_a_pipe() {
    // token 215 of tiny-hub is the byte 0x1b (ESC): a reply of nothing but escapes
    let m = crate::common::fixture("tiny-hub");
    let args = [
        "-m",
        m.to_str().unwrap(),
        "-n",
        "6",
        "--logit-bias",
        "215+100",
    ];
    let mut c = Pty::chat(&[&args[..], &["--no-color", "--threads", "1"]].concat());
    c.expect(GREETING_END);
    c.send("hello\n");
    let shown = c.expect("\n> ");
    assert!(shown.contains("^[^[^[^[^[^["), "{shown:?}");
    assert!(!shown.contains('\x1b'), "{shown:?}");
    c.send("/exit\n");
    assert_eq!(c.wait(), Some(0));
    // piped: the bytes as generated
    let (out, _) = talk(&[&["chat"][..], &args].concat(), "hello\n/exit\n");
    assert!(out.contains("\x1b\x1b\x1b\x1b\x1b\x1b"), "{out:?}");
    assert!(!out.contains("^["), "{out:?}");
}

#[test]
fn a_line_the_terminal_cuts_is_not_sent_and_says_how_to_send_long_text() {
    let m = crate::common::fixture("tiny-hub");
    let mut c = Pty::chat(&[
        "-m",
        m.to_str().unwrap(),
        "-n",
        "2",
        "--threads",
        "1",
        "--verbose",
    ]);
    c.expect(GREETING_END);
    // past the line discipline's 4095 bytes: the rest is dropped, the line ends at the newline
    c.send(&format!("{}\n", "y".repeat(5000)));
    c.expect("(the terminal cut this line at 4095 bytes");
    c.expect("each but the last ending in \\ (they join into one message)");
    c.expect("> ");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("c.json");
    c.send(&format!("/save {}\n", file.display()));
    c.expect("(saved 0 messages to ");
    // a shorter line goes through
    c.send(&format!("{}\n", "y ".repeat(100)));
    c.expect("generated 2 tokens");
    c.send("/exit\n");
    assert_eq!(c.wait(), Some(0));
}
