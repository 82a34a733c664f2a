//! The terminal side of `backburner chat`: the prompt, slash commands, one turn (submit the rendered conversation,
//! stream the reply), and the reply's printing with its thinking apart from the answer.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;

use backburner_engine::serve::{Engine, Event, Job};
use backburner_engine::{GenerateParams, Generation, StopReason};
use backburner_model::chat::{ChatDelta, ChatOutputParser};
use backburner_model::TextTokenizer;

use crate::chat_conv::{Conversation, Rendered};
use crate::sampling_args::SamplingArgs;

/// What the chat loop waits for: a line of input, its end, a Ctrl-C, or an event of the running reply.
#[derive(Debug)]
pub enum Msg {
    /// A line typed (without its newline).
    Line(String),
    /// A line the terminal cut at its limit for a typed line ([`TTY_LINE_MAX`] bytes): what was typed past it is
    /// lost.
    Cut,
    /// The end of the input (Ctrl-D at an empty prompt, or a closed pipe).
    Eof,
    /// Ctrl-C.
    Interrupt,
    /// An event of the running reply.
    Event(Event),
}

/// The chat's fixed settings.
pub struct Settings {
    /// Most tokens per reply (`usize::MAX`: until eos or a full context).
    pub max_tokens: usize,
    /// Sampling (the seed given, or a random one per reply).
    pub sampling: SamplingArgs,
    /// Ids that end a reply.
    pub eos_ids: Vec<u32>,
    /// Speculative decoding (`--spec`).
    pub spec: Option<backburner_engine::spec::SpecParams>,
    /// The slot's context length.
    pub context: usize,
    /// Dim the thinking with ANSI escapes (else plain `<think>` … `</think>` text).
    pub color: bool,
    /// Show the control characters of the model's text visibly ([`visible`]): stdout is a terminal, which would
    /// act on them (retitle, clear, move the cursor).
    pub visible_controls: bool,
    /// A stats line on stderr after each reply.
    pub verbose: bool,
}

const HELP: &str = "commands:
  /clear          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt and start a new conversation (/system alone shows it)
  /save FILE      write the conversation as JSON: {\"messages\": [...]} in the OpenAI shape
  /stats          the last reply's token counts and rates
  /help           this list
  /exit, /quit    leave (also Ctrl-D)
A line ending in \\ continues on the next line; //text sends /text. Ctrl-C stops a reply (what it wrote stays in
the conversation).";

/// The longest line a terminal in canonical mode passes on (Linux's line discipline: 4096 bytes with the newline);
/// the bytes typed or pasted past it are dropped.
pub const TTY_LINE_MAX: usize = 4095;

/// `s` with the characters a terminal would act on rather than show, shown visibly: C0 controls other than `\n`
/// and `\t` and DEL in caret notation (ESC as `^[`, CR as `^M`, DEL as `^?`), C1 controls as `<U+0085>`. A model
/// writes what it likes; on a terminal, escape sequences in it could retitle or clear the window, or spoof output.
pub fn visible(s: &str) -> std::borrow::Cow<'_, str> {
    let hidden = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !s.chars().any(hidden) {
        return s.into();
    }
    let mut o = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        match c as u32 {
            _ if !hidden(c) => o.push(c),
            n @ 0..=0x1f => {
                o.push('^');
                o.push(char::from(n as u8 + 0x40));
            }
            0x7f => o.push_str("^?"),
            n => o.push_str(&format!("<U+{n:04X}>")),
        }
    }
    o.into()
}

const DIM: &str = "\x1b[2m";
const RESET: &str = "\x1b[0m";

/// Writes to stdout and flushes; a closed stdout ends the chat quietly (as `run` does).
fn out(s: &str) {
    let mut o = std::io::stdout();
    if write!(o, "{s}").and_then(|_| o.flush()).is_err() {
        std::process::exit(0);
    }
}

/// The chat loop's state.
pub struct Repl {
    engine: Engine,
    tok: Arc<TextTokenizer>,
    conv: Conversation,
    s: Settings,
    tx: Sender<Msg>,
    rx: Receiver<Msg>,
    /// Raised by Ctrl-C; the running reply's cancel flag.
    interrupt: Arc<AtomicBool>,
    /// Input that arrived while a reply ran (typed ahead, or piped).
    pending: VecDeque<Msg>,
    /// The next turn starts from an empty slot (after `/clear` or `/system`).
    cold: bool,
    last_stats: Option<String>,
    turns: u64,
}

impl Repl {
    /// A chat on `engine` (one slot) with `tok`, starting from `conv`; `chan` carries input, Ctrl-Cs and the
    /// engine's events ([`Msg`]); `interrupt` is raised by Ctrl-C.
    pub fn new(
        engine: Engine,
        tok: Arc<TextTokenizer>,
        conv: Conversation,
        s: Settings,
        chan: (Sender<Msg>, Receiver<Msg>),
        interrupt: Arc<AtomicBool>,
    ) -> Self {
        Repl {
            engine,
            tok,
            conv,
            s,
            tx: chan.0,
            rx: chan.1,
            interrupt,
            pending: VecDeque::new(),
            cold: false,
            last_stats: None,
            turns: 0,
        }
    }

    /// Prompts, reads and answers until `/exit`, `/quit` or the end of the input.
    pub fn run(&mut self) {
        loop {
            out("> ");
            let Some(line) = self.read_input() else {
                out("\n");
                return;
            };
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            match line.strip_prefix('/') {
                Some(rest) if !rest.starts_with('/') => {
                    if !self.command(line) {
                        return;
                    }
                }
                Some(rest) => self.turn(rest),
                None => self.turn(line),
            }
        }
    }

    /// The next message: a line, joined with the following ones while it ends in `\`; `None` at the end of the
    /// input. Ctrl-C here says how to leave and prompts again (as ollama does).
    fn read_input(&mut self) -> Option<String> {
        let mut text = String::new();
        loop {
            let msg = match self.pending.pop_front() {
                Some(m) => m,
                None => self.rx.recv().ok()?,
            };
            match msg {
                Msg::Line(l) => match l.strip_suffix('\\') {
                    Some(part) => {
                        text.push_str(part);
                        text.push('\n');
                    }
                    None => {
                        text.push_str(&l);
                        return Some(text);
                    }
                },
                Msg::Eof => return None,
                Msg::Cut => {
                    text.clear();
                    eprintln!(
                        "(the terminal cut this line at {TTY_LINE_MAX} bytes, its limit for a typed line, and \
                         dropped the rest: the message was not sent. Type or paste long text in lines shorter than \
                         that, each but the last ending in \\ (they join into one message), or pipe it in: \
                         `backburner chat < file`)"
                    );
                    out("> ");
                }
                Msg::Interrupt => {
                    self.interrupt.store(false, Ordering::SeqCst);
                    text.clear();
                    out("\n");
                    eprintln!("(Ctrl-C stops a reply; to leave, press Ctrl-D or type /exit)");
                    out("> ");
                }
                Msg::Event(_) => {} // a finished reply's stray event
            }
        }
    }

    /// Runs a slash command; `false` to leave.
    fn command(&mut self, line: &str) -> bool {
        let (cmd, arg) = match line.split_once(char::is_whitespace) {
            Some((c, a)) => (c, a.trim()),
            None => (line, ""),
        };
        match cmd {
            "/exit" | "/quit" => return false,
            "/help" | "/?" => out(&format!("{HELP}\n")),
            "/clear" => {
                self.conv.clear();
                self.cold = true;
                eprintln!("(conversation cleared; the system prompt stays)");
            }
            "/system" if arg.is_empty() => match self.conv.system() {
                Some(s) => eprintln!("system prompt: {s}"),
                None => eprintln!("(no system prompt; /system TEXT sets one)"),
            },
            "/system" => {
                self.conv.set_system(Some(arg.to_string()));
                self.cold = true;
                eprintln!("(system prompt set; a new conversation starts)");
            }
            "/save" if arg.is_empty() => eprintln!("usage: /save FILE"),
            "/save" => match self.conv.save(Path::new(arg)) {
                Ok(n) => eprintln!("(saved {n} messages to {arg})"),
                Err(e) => eprintln!("error: {e:#}; the chat goes on"),
            },
            "/stats" => match &self.last_stats {
                Some(s) => eprintln!("{s}"),
                None => eprintln!("(no reply yet)"),
            },
            _ => out(&format!("unknown command {cmd}\n{HELP}\n")),
        }
        true
    }

    /// One turn: the user's `text` joins the conversation, the whole conversation is rendered and submitted, and
    /// the reply streams. A turn that cannot run (a template error, a conversation past the context) says why and
    /// leaves the conversation as it was.
    fn turn(&mut self, text: &str) {
        self.conv.push_user(text);
        let r = match self.conv.render(&self.tok) {
            Ok(r) => r,
            Err(e) => return self.drop_turn(&format!("error: {e:#}")),
        };
        if r.ids.len() >= self.s.context {
            let why = format!(
                "error: the conversation with this message is {} tokens, which leaves no room for a reply in the \
                 context of {} tokens: the message was not sent (the conversation is kept; /clear starts over)",
                r.ids.len(),
                self.s.context
            );
            return self.drop_turn(&why);
        }
        self.interrupt.store(false, Ordering::SeqCst);
        self.turns += 1;
        let tx = self.tx.clone();
        let job = Job {
            id: format!("chat-{}", self.turns),
            prompt: r.ids.clone(),
            params: self.params(),
            stable_prefix: Some(r.stable),
            cache_prompt: !std::mem::take(&mut self.cold),
            events: Box::new(move |e| tx.send(Msg::Event(e)).is_ok()),
            siblings: Vec::new(),
        };
        if let Err(e) = self.engine.submit(job) {
            return self.drop_turn(&format!("error: {e}"));
        }
        self.stream(&r);
    }

    /// Takes the user's last message back and says why.
    fn drop_turn(&mut self, why: &str) {
        self.conv.pop();
        eprintln!("{why}");
    }

    fn params(&self) -> GenerateParams {
        GenerateParams {
            max_tokens: self.s.max_tokens,
            sampling: self
                .s
                .sampling
                .params(self.s.sampling.seed.unwrap_or_else(rand::random)),
            eos_ids: self.s.eos_ids.clone(),
            cancel: Some(self.interrupt.clone()),
            spec: self.s.spec.clone(),
            ..Default::default()
        }
    }

    /// Prints the submitted turn's reply as it streams, until it ends; the reply joins the conversation (also an
    /// interrupted one, with what it wrote).
    fn stream(&mut self, r: &Rendered) {
        let mut printer = None;
        let mut cached = 0;
        loop {
            let Ok(msg) = self.rx.recv() else { return };
            let ev = match msg {
                Msg::Event(ev) => ev,
                Msg::Interrupt => continue, // the flag stops the reply at the engine's next step
                other => {
                    self.pending.push_back(other);
                    continue;
                }
            };
            match ev {
                Event::Started { cached_tokens, .. } => {
                    cached = cached_tokens;
                    printer = Some(Printer::new(
                        self.s.color,
                        self.s.visible_controls,
                        r.in_reasoning,
                    ));
                }
                Event::Token { text, .. } => printer.iter_mut().for_each(|p| p.push(&text)),
                Event::Done { generation, text } => {
                    if let Some(p) = printer.as_mut() {
                        p.push(&text);
                        p.finish();
                    }
                    return self.answered(&generation, r, cached);
                }
                Event::Failed(e) => {
                    if let Some(p) = printer.as_mut() {
                        p.finish();
                    }
                    return self.drop_turn(&format!("error: {e}"));
                }
            }
        }
    }

    /// A reply ended: it joins the conversation; its stop reason is told when it is not the usual one, and the
    /// stats line is kept (and printed with `--verbose`).
    fn answered(&mut self, g: &Generation, r: &Rendered, cached: usize) {
        self.conv.push_reply(&g.text, r.in_reasoning);
        match g.stop_reason {
            StopReason::Interrupted => {
                eprintln!("(interrupted: the reply so far stays in the conversation)")
            }
            StopReason::ContextFull => {
                eprintln!("(the context is full: /clear to go on)")
            }
            StopReason::Error => eprintln!(
                "(the reply failed: {})",
                g.error.as_deref().unwrap_or("unknown error")
            ),
            _ => {}
        }
        let n = r.ids.len();
        let t = &g.timings;
        let stats = format!(
            "prompt {n} tokens ({cached} cached, {} prefilled) | generated {} tokens ({}) | prefill {:.1} tok/s | \
             decode {:.1} tok/s{}",
            n - cached,
            g.tokens.len(),
            g.stop_reason.as_str(),
            t.prefill_tok_s,
            t.decode_tok_s,
            crate::spec_args::stats_suffix([&g.speculative])
        );
        if self.s.verbose {
            eprintln!("{stats}");
        }
        self.last_stats = Some(stats);
    }
}

/// Prints a reply as it streams. With color, the model's reasoning parser splits it: the thinking is dimmed and the
/// answer follows in plain text. Without, the text is printed as generated, after the `<think>` the prompt opened,
/// so the thinking stands between its own `<think>` and `</think>` markers.
struct Printer {
    parser: Option<ChatOutputParser>,
    dim: bool,
    /// The model's control characters shown visibly ([`visible`]).
    visible_controls: bool,
}

impl Printer {
    fn new(color: bool, visible_controls: bool, in_reasoning: bool) -> Self {
        if !color && in_reasoning {
            out("<think>\n");
        }
        Printer {
            parser: color.then(|| ChatOutputParser::new(in_reasoning, None)),
            dim: false,
            visible_controls,
        }
    }

    /// Writes the model's `text`, its control characters shown when they would reach a terminal.
    fn text(&self, text: &str) {
        match self.visible_controls {
            true => out(&visible(text)),
            false => out(text),
        }
    }

    fn push(&mut self, text: &str) {
        match self.parser.as_mut() {
            Some(p) => {
                let deltas = p.push(text);
                self.show(deltas);
            }
            None => self.text(text),
        }
    }

    fn show(&mut self, deltas: Vec<ChatDelta>) {
        for d in deltas {
            match d {
                ChatDelta::Reasoning(s) => {
                    if !std::mem::replace(&mut self.dim, true) {
                        out(DIM);
                    }
                    self.text(&s);
                }
                ChatDelta::Content(s) => {
                    if std::mem::replace(&mut self.dim, false) {
                        out(&format!("{RESET}\n\n"));
                    }
                    self.text(&s);
                }
                ChatDelta::ToolCall(c) => {
                    self.text(&format!("[tool call {}({})]", c.name, c.arguments))
                }
            }
        }
    }

    /// Ends the reply: what the parser held back, the color reset, a newline.
    fn finish(&mut self) {
        if let Some(p) = self.parser.as_mut() {
            let deltas = p.finish();
            self.show(deltas);
        }
        if self.dim {
            out(RESET);
        }
        out("\n");
    }
}

#[cfg(test)]
mod tests {
    use super::visible;

    #[test]
    fn control_characters_are_shown_not_sent() {
        assert!(matches!(
            visible("plain\ttext\nand é ✓"),
            std::borrow::Cow::Borrowed(_)
        ));
        assert_eq!(
            visible("\x1b]0;pwned\x07\x1b[2J\r\0x\x7f"),
            "^[]0;pwned^G^[[2J^M^@x^?"
        );
        assert_eq!(visible("a\u{9b}31mb\u{85}"), "a<U+009B>31mb<U+0085>");
        assert_eq!(visible("\u{1f}\u{a0}"), "^_\u{a0}");
    }
}
