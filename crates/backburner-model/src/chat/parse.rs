//! What a Qwen3.5 model generates → OpenAI fields: reasoning (up to `</think>`), content, and tool calls in the
//! template's XML form (`<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`).
//!
//! Whitespace follows the template's conventions: leading whitespace of the reasoning and of the content after
//! `</think>` or after a tool call is dropped, as is trailing whitespace before `</think>` and before a tool call.
//! Streaming holds back only what could still be dropped that way (a run of trailing whitespace) or could be the
//! start of a tag; everything else is emitted as soon as it arrives. Anything that does not parse as a tool call
//! comes back as content, exactly as generated.

use serde_json::Value;

use super::toolcall::parse_tool_call;

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";

/// Whether generation after `prompt` starts inside a reasoning block: the prompt ends (but for whitespace) with an
/// open `<think>`, as the Qwen3.5 template's generation prompt does unless `enable_thinking` is false.
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    prompt.trim_end().ends_with(THINK_OPEN)
}

/// One complete tool call, OpenAI-shaped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Position among this response's tool calls, from 0.
    pub index: usize,
    /// The call id: the parser's id prefix (`call_` unless set with [`ChatOutputParser::with_id_prefix`]) followed
    /// by `index`.
    pub id: String,
    /// The function name.
    pub name: String,
    /// The arguments as a JSON object in a string (OpenAI `function.arguments`), keys in the order generated.
    pub arguments: String,
}

/// A piece of parsed output, in generation order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatDelta {
    /// Reasoning text (OpenAI-compatible servers send it as `reasoning_content`).
    Reasoning(String),
    /// Answer text.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// The whole output, parsed: [`ChatDelta`]s merged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// All reasoning text; `None` when there was none.
    pub reasoning: Option<String>,
    /// All content text; `None` when there was none.
    pub content: Option<String>,
    /// The tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedOutput {
    /// Merges deltas: reasoning pieces and content pieces concatenated, tool calls listed.
    pub fn from_deltas(deltas: impl IntoIterator<Item = ChatDelta>) -> Self {
        let mut out = ParsedOutput::default();
        for d in deltas {
            match d {
                ChatDelta::Reasoning(s) => {
                    out.reasoning.get_or_insert_with(String::new).push_str(&s)
                }
                ChatDelta::Content(s) => out.content.get_or_insert_with(String::new).push_str(&s),
                ChatDelta::ToolCall(c) => out.tool_calls.push(c),
            }
        }
        out.reasoning = out.reasoning.filter(|s| !s.is_empty());
        out.content = out.content.filter(|s| !s.is_empty());
        out
    }
}

/// Parses a whole generated text: the same as pushing it to a [`ChatOutputParser`] and finishing, merged.
/// `in_reasoning` is [`prompt_opens_reasoning`] of the prompt; `tools` the request's tool definitions.
pub fn parse_output(text: &str, in_reasoning: bool, tools: Option<&[Value]>) -> ParsedOutput {
    let mut p = ChatOutputParser::new(in_reasoning, tools);
    let mut deltas = p.push(text);
    deltas.extend(p.finish());
    ParsedOutput::from_deltas(deltas)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Reasoning,
    Content,
    ToolCall,
}

/// Incremental parser of generated text for streaming. Feed it text pieces as they are decoded, split anywhere (even
/// inside a tag); for any split the deltas merge to the same [`ParsedOutput`] as [`parse_output`] gives.
#[derive(Clone, Debug)]
pub struct ChatOutputParser {
    mode: Mode,
    /// Text received but not yet emitted or dropped.
    pending: String,
    /// Nothing of the current section kept yet: its leading whitespace is dropped.
    at_start: bool,
    /// Still at the very start of an output that began as content: an opening `<think>` there starts reasoning.
    may_open_think: bool,
    /// Where to look for `</tool_call>` in `pending` next.
    scan_from: usize,
    /// The whitespace dropped before the open `<tool_call>`, given back if the call turns out malformed.
    gap: String,
    tools: Option<Vec<Value>>,
    id_prefix: String,
    next_index: usize,
}

impl ChatOutputParser {
    /// A parser for one response. `in_reasoning`: generation starts inside `<think>` ([`prompt_opens_reasoning`]).
    /// `tools`: the request's OpenAI tool definitions, used to type parameter values (a parameter declared
    /// `"type": "string"` keeps `123` as a string).
    pub fn new(in_reasoning: bool, tools: Option<&[Value]>) -> Self {
        ChatOutputParser {
            mode: if in_reasoning {
                Mode::Reasoning
            } else {
                Mode::Content
            },
            pending: String::new(),
            at_start: true,
            may_open_think: !in_reasoning,
            scan_from: 0,
            gap: String::new(),
            tools: tools.map(<[Value]>::to_vec),
            id_prefix: "call_".into(),
            next_index: 0,
        }
    }

    /// Sets what tool call ids start with (default `call_`, giving `call_0`, `call_1`, …); pass something unique
    /// per request (e.g. `call_<request id>_`) to make ids unique across requests.
    pub fn with_id_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.id_prefix = prefix.into();
        self
    }

    /// Takes the next piece of generated text and returns what can be told of it now.
    pub fn push(&mut self, text: &str) -> Vec<ChatDelta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out) {}
        out
    }

    /// Ends the generation: flushes what was held back (as it stands: a partial tag is text, an unfinished tool
    /// call becomes content).
    pub fn finish(&mut self) -> Vec<ChatDelta> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        match self.mode {
            Mode::Reasoning => emit(&mut out, ChatDelta::Reasoning(rest)),
            Mode::Content => emit(&mut out, ChatDelta::Content(rest)),
            Mode::ToolCall => emit(
                &mut out,
                ChatDelta::Content(format!("{}{CALL_OPEN}{rest}", self.gap)),
            ),
        }
        self.scan_from = 0;
        out
    }

    /// Makes one decision on `pending`; `true` when another may follow.
    fn step(&mut self, out: &mut Vec<ChatDelta>) -> bool {
        match self.mode {
            Mode::ToolCall => self.step_tool_call(out),
            Mode::Reasoning | Mode::Content => self.step_text(out),
        }
    }

    fn step_text(&mut self, out: &mut Vec<ChatDelta>) -> bool {
        let reasoning = self.mode == Mode::Reasoning;
        if self.at_start {
            let trimmed = self.pending.trim_start().len();
            self.pending.drain(..self.pending.len() - trimmed);
            if self.pending.is_empty() {
                return false;
            }
            // A reasoning block may restate its `<think>`; an output that began as content may open one.
            if reasoning || self.may_open_think {
                if let Some(rest) = self.pending.strip_prefix(THINK_OPEN) {
                    self.pending = rest.to_string();
                    self.mode = Mode::Reasoning;
                    self.may_open_think = false;
                    return true;
                }
                if THINK_OPEN.starts_with(self.pending.as_str()) {
                    return false;
                }
            }
            self.at_start = false;
            self.may_open_think = false;
        }
        let (close, next_mode) = if reasoning {
            (THINK_CLOSE, Mode::Content)
        } else {
            (CALL_OPEN, Mode::ToolCall)
        };
        let make = |s: String| {
            if reasoning {
                ChatDelta::Reasoning(s)
            } else {
                ChatDelta::Content(s)
            }
        };
        if let Some(i) = self.pending.find(close) {
            let before = self.pending[..i].trim_end().to_string();
            self.gap = self.pending[before.len()..i].to_string();
            emit(out, make(before));
            self.pending.drain(..i + close.len());
            self.mode = next_mode;
            self.at_start = true;
            self.scan_from = 0;
            return true;
        }
        let keep = held_back(&self.pending, close);
        let ready: String = self.pending.drain(..self.pending.len() - keep).collect();
        emit(out, make(ready));
        false
    }

    fn step_tool_call(&mut self, out: &mut Vec<ChatDelta>) -> bool {
        let Some(found) = self.pending[self.scan_from..].find(CALL_CLOSE) else {
            let mut from = self.pending.len().saturating_sub(CALL_CLOSE.len());
            while !self.pending.is_char_boundary(from) {
                from -= 1;
            }
            self.scan_from = from;
            return false;
        };
        let end = self.scan_from + found;
        let body = &self.pending[..end];
        match parse_tool_call(body, self.tools.as_deref()) {
            Some((name, arguments)) => {
                let index = self.next_index;
                self.next_index += 1;
                out.push(ChatDelta::ToolCall(ToolCall {
                    index,
                    id: format!("{}{index}", self.id_prefix),
                    name,
                    arguments,
                }));
                self.at_start = true;
            }
            None => {
                let text = format!("{}{CALL_OPEN}{body}{CALL_CLOSE}", self.gap);
                emit(out, ChatDelta::Content(text));
                self.at_start = false;
            }
        }
        self.pending.drain(..end + CALL_CLOSE.len());
        self.mode = Mode::Content;
        self.scan_from = 0;
        true
    }
}

/// Bytes at the end of `s` to hold back while looking for `tag`: the longest proper prefix of `tag` that `s` ends
/// with, and the whitespace run before it.
fn held_back(s: &str, tag: &str) -> usize {
    let partial = (1..tag.len())
        .rev()
        .find(|&n| s.ends_with(&tag[..n]))
        .unwrap_or(0);
    let before = &s[..s.len() - partial];
    partial + (before.len() - before.trim_end().len())
}

/// Appends a text delta unless it is empty, merged into the previous delta when that is of the same kind.
fn emit(out: &mut Vec<ChatDelta>, d: ChatDelta) {
    match (&d, out.last_mut()) {
        (ChatDelta::Reasoning(s) | ChatDelta::Content(s), _) if s.is_empty() => {}
        (ChatDelta::Reasoning(s), Some(ChatDelta::Reasoning(prev))) => prev.push_str(s),
        (ChatDelta::Content(s), Some(ChatDelta::Content(prev))) => prev.push_str(s),
        _ => out.push(d),
    }
}
