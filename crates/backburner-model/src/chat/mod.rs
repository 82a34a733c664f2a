//! The chat text layer: rendering OpenAI-shaped conversations through a checkpoint's Jinja chat template exactly as
//! transformers renders them ([`ChatTemplate`], [`ChatRequest`]), and parsing what the model generates back into
//! OpenAI fields (reasoning, content, tool calls) for the Qwen3.5 format ([`ChatOutputParser`], [`parse_output`]).

mod parse;
mod pycompat;
mod pyvalue;
mod request;
mod template;
mod toolcall;

pub use parse::{
    parse_output, prompt_opens_reasoning, ChatDelta, ChatOutputParser, ParsedOutput, ToolCall,
};
pub use pycompat::{is_py_space, py_split, py_splitlines, py_strip};
pub use pyvalue::{float_repr, str_repr};
pub use request::{json_kind, normalize_messages, normalize_tools};
pub use template::ChatTemplate;
pub use toolcall::allowed_types;

use crate::error::{ModelError, Result};

/// One chat completion request as the server received it, to render into a prompt.
#[derive(Clone, Copy, Debug)]
pub struct ChatRequest<'a> {
    /// OpenAI-shaped messages as received: objects with `role`, `content` (a string, null, or an array of
    /// `{"type": "text", "text": ...}` parts), and optionally `tool_calls` (with `function.arguments` as an object
    /// or a JSON string), `tool_call_id`, `name` and `reasoning_content` (or `reasoning` / `thinking`).
    pub messages: &'a [serde_json::Value],
    /// The OpenAI `tools` array as received (`{"type": "function", "function": {"name", "description",
    /// "parameters"}}`); `None` when the request has none.
    pub tools: Option<&'a [serde_json::Value]>,
    /// End the prompt with the assistant's turn opening (what a completion request wants).
    pub add_generation_prompt: bool,
    /// `chat_template_kwargs`: extra template variables, e.g. `enable_thinking: false`.
    pub kwargs: &'a serde_json::Map<String, serde_json::Value>,
}

impl ChatTemplate {
    /// Renders `req` as transformers' `apply_chat_template(messages, tools=tools, add_generation_prompt=...,
    /// tokenize=False, **special_tokens, **kwargs)` does, after normalizing the messages
    /// ([`normalize_messages`]: null keys dropped, reasoning aliased, string tool-call arguments parsed).
    ///
    /// A template that fails on content given as an array of text parts (one that only takes strings) is rendered
    /// again with each such content as its parts' texts joined by `"\n"` (what vLLM and llama.cpp's server send
    /// such templates); one that takes arrays (the Qwen3.5 template) renders them itself.
    ///
    /// Errors: [`crate::ModelError::InvalidChatRequest`] for a malformed request, one the template rejects
    /// (`raise_exception`), or one whose message without content (`content` null or absent) the template cannot
    /// render (field `messages[i].content`: it renders once that content is `""`);
    /// [`crate::ModelError::ChatTemplate`] when rendering fails otherwise.
    pub fn render(&self, req: &ChatRequest<'_>, special_tokens: &[(&str, &str)]) -> Result<String> {
        let ctx = request::build_context(req, special_tokens)?;
        match self.render_json(&ctx) {
            Err(ModelError::ChatTemplate(why)) => match flatten_text_parts(&ctx) {
                // a template that only takes string content: the text parts joined, as vLLM and llama.cpp do
                Some(flat) => match self.render_json(&flat) {
                    Ok(text) => Ok(text),
                    Err(_) => Err(self.blame_missing_content(ctx, why)),
                },
                None => Err(self.blame_missing_content(ctx, why)),
            },
            other => other,
        }
    }

    /// The error of a render that failed with `why`: [`ModelError::InvalidChatRequest`] naming the first message
    /// without content (a `user` one first) when the conversation renders with every such content set to `""`, so
    /// that the client's null is what the template could not take; else `why` as it was. One more render at most.
    fn blame_missing_content(&self, mut ctx: serde_json::Value, why: String) -> ModelError {
        let Some(messages) = ctx.get_mut("messages").and_then(|m| m.as_array_mut()) else {
            return ModelError::ChatTemplate(why);
        };
        let mut empty: Vec<(usize, String)> = Vec::new();
        for (i, m) in messages.iter_mut().enumerate() {
            if let Some(obj) = m.as_object_mut().filter(|o| !o.contains_key("content")) {
                let role = obj.get("role").and_then(|r| r.as_str()).unwrap_or("");
                empty.push((i, role.to_string()));
                obj.insert("content".into(), serde_json::Value::String(String::new()));
            }
        }
        let Some((i, role)) = empty
            .iter()
            .find(|(_, r)| r == "user")
            .or(empty.first())
            .cloned()
        else {
            return ModelError::ChatTemplate(why);
        };
        if self.render_json(&ctx).is_err() {
            return ModelError::ChatTemplate(why);
        }
        let first_line = why.lines().next().unwrap_or_default();
        ModelError::InvalidChatRequest {
            field: format!("messages[{i}].content"),
            message: format!(
                "the model's chat template cannot render this {role} message without content (null or absent): \
                 {first_line}; send a string (\"\" for none)"
            ),
        }
    }
}

/// `ctx` with every message content that is an array of text parts (normalized by [`normalize_messages`]) replaced by
/// their texts joined with `"\n"`; `None` when no message has such content.
fn flatten_text_parts(ctx: &serde_json::Value) -> Option<serde_json::Value> {
    let mut flat = ctx.clone();
    let mut changed = false;
    for m in flat.get_mut("messages")?.as_array_mut()? {
        let Some(serde_json::Value::Array(parts)) = m.get("content") else {
            continue;
        };
        let texts: Vec<&str> = parts
            .iter()
            .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
            .collect();
        let joined = texts.join("\n");
        m["content"] = serde_json::Value::String(joined);
        changed = true;
    }
    changed.then_some(flat)
}
