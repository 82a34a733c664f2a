//! The conversation of `backburner chat`: OpenAI-shaped messages, rendered through the model's chat template for each
//! turn (the whole conversation, as the server renders a request), and saved as JSON.

use std::path::Path;

use anyhow::{Context, Result};
use backburner_engine::serve::common_prefix;
use backburner_model::chat::{parse_output, prompt_opens_reasoning, ChatRequest};
use backburner_model::TextTokenizer;
use serde_json::{json, Map, Value};

/// A conversation: the system prompt (kept by `/clear`) and the turns after it.
#[derive(Clone, Debug, Default)]
pub struct Conversation {
    system: Option<String>,
    turns: Vec<Value>,
    /// `enable_thinking` for the template (`Some(false)` with `--no-think`).
    thinking: Option<bool>,
}

/// One turn's prompt: the whole conversation rendered with the generation prompt and tokenized.
#[derive(Clone, Debug)]
pub struct Rendered {
    /// The prompt's token ids.
    pub ids: Vec<u32>,
    /// Tokens of the conversation before the generation prompt (the prompt cache keeps a checkpoint there, from
    /// which the next turn resumes).
    pub stable: usize,
    /// The prompt opened a `<think>` block: the reply starts in the model's reasoning.
    pub in_reasoning: bool,
}

impl Conversation {
    /// An empty conversation with `system` as its system prompt; `thinking` is passed to the template as
    /// `enable_thinking` when given.
    pub fn new(system: Option<String>, thinking: Option<bool>) -> Self {
        Conversation {
            system,
            turns: Vec::new(),
            thinking,
        }
    }

    /// The system prompt.
    pub fn system(&self) -> Option<&str> {
        self.system.as_deref()
    }

    /// Replaces the system prompt and forgets the turns (a new conversation).
    pub fn set_system(&mut self, system: Option<String>) {
        self.system = system;
        self.turns.clear();
    }

    /// Forgets the turns, keeping the system prompt.
    pub fn clear(&mut self) {
        self.turns.clear();
    }

    /// Adds the user's message.
    pub fn push_user(&mut self, text: &str) {
        self.turns.push(json!({"role": "user", "content": text}));
    }

    /// Takes back the last message (a user message whose turn could not run).
    pub fn pop(&mut self) {
        self.turns.pop();
    }

    /// Adds the assistant's reply: `text` as generated after a prompt that opened reasoning or not, split by the
    /// model's reasoning parser into `content` and `reasoning_content` (the fields the chat template reads back).
    pub fn push_reply(&mut self, text: &str, in_reasoning: bool) {
        let out = parse_output(text, in_reasoning, None);
        let mut m = json!({"role": "assistant", "content": out.content.unwrap_or_default()});
        if let Some(r) = out.reasoning {
            m["reasoning_content"] = Value::String(r);
        }
        self.turns.push(m);
    }

    /// Every message, the system prompt first, in the OpenAI shape.
    pub fn messages(&self) -> Vec<Value> {
        let system = self
            .system
            .as_ref()
            .map(|s| json!({"role": "system", "content": s}));
        system
            .into_iter()
            .chain(self.turns.iter().cloned())
            .collect()
    }

    /// Renders the whole conversation with the generation prompt and tokenizes it; the stable prefix is where it
    /// parts from the rendering without the generation prompt (0 when the template refuses that one). Errors: the
    /// template's or the tokenizer's.
    pub fn render(&self, tok: &TextTokenizer) -> Result<Rendered> {
        let messages = self.messages();
        let mut kwargs = Map::new();
        if let Some(t) = self.thinking {
            kwargs.insert("enable_thinking".into(), t.into());
        }
        let mut req = ChatRequest {
            messages: &messages,
            tools: None,
            add_generation_prompt: true,
            kwargs: &kwargs,
        };
        let text = tok.render_chat(&req)?;
        let ids = tok.encode(&text)?;
        req.add_generation_prompt = false;
        let stable = tok
            .render_chat(&req)
            .and_then(|h| tok.encode(&h))
            .map_or(0, |h| common_prefix(&ids, &h));
        Ok(Rendered {
            in_reasoning: prompt_opens_reasoning(&text),
            ids,
            stable,
        })
    }

    /// Writes `{"messages": [...]}` (the body of a chat completion request, without the model) to `path`. Errors:
    /// the file cannot be written.
    pub fn save(&self, path: &Path) -> Result<usize> {
        let messages = self.messages();
        let body = serde_json::to_string_pretty(&json!({ "messages": messages }))?;
        std::fs::write(path, body + "\n").with_context(|| format!("write {}", path.display()))?;
        Ok(messages.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_keep_the_system_prompt_first_and_split_the_reasoning() {
        let mut c = Conversation::new(Some("Be terse.".into()), None);
        c.push_user("Hi");
        c.push_reply("Let me think.\n</think>\n\nHello!", true);
        assert_eq!(
            Value::Array(c.messages()),
            json!([
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "Let me think."},
            ])
        );
        c.clear();
        assert_eq!(c.messages().len(), 1);
        c.push_user("x");
        c.set_system(None);
        assert!(c.messages().is_empty());
        c.push_user("x");
        c.pop();
        assert!(c.messages().is_empty());
    }
}
