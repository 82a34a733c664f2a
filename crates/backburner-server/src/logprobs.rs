//! Log-probabilities in OpenAI's shapes: chat's `logprobs.content[]` entries (`token`, `logprob`, `bytes`,
//! `top_logprobs`) and the legacy completions object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
//!
//! The values are the engine's ([`backburner_engine::picker`]): the log-softmax of the logits the token was sampled
//! from, after penalties and `logit_bias`, at temperature 1. A token's `token` is its bytes read as UTF-8 (lossy for
//! a token holding part of a character, whose `bytes` are exact); without a tokenizer it is `token_id:<id>`, as
//! vLLM writes ids. A log-probability of `-inf` (probability 0 in f64) is written as −9999, as OpenAI does.

use backburner_engine::TokenLogprob;
use backburner_model::TextTokenizer;
use serde_json::{json, Map, Value};

/// Turns token ids into the strings and bytes the API reports.
pub struct TokenNames<'a>(pub Option<&'a TextTokenizer>);

impl TokenNames<'_> {
    /// `(token, bytes)` of `id`.
    fn name(&self, id: u32) -> (String, Option<Vec<u8>>) {
        match self.0.and_then(|t| t.token_bytes(id)) {
            Some(b) => (String::from_utf8_lossy(&b).into_owned(), Some(b)),
            None => (format!("token_id:{id}"), None),
        }
    }

    /// One `{token, logprob, bytes}` object.
    fn alt(&self, id: u32, lp: f32) -> Value {
        let (token, bytes) = self.name(id);
        json!({"token": token, "logprob": finite(lp), "bytes": bytes})
    }

    /// A chat `logprobs` object (`{"content": [...], "refusal": null}`) for `lps`.
    pub fn chat(&self, lps: &[TokenLogprob]) -> Value {
        let content: Vec<Value> = lps
            .iter()
            .map(|t| {
                let mut e = self.alt(t.id, t.logprob);
                e["top_logprobs"] = t.top.iter().map(|&(id, lp)| self.alt(id, lp)).collect();
                e
            })
            .collect();
        json!({"content": content, "refusal": null})
    }
}

/// `lp`, or −9999 for `-inf` (JSON has no infinities).
fn finite(lp: f32) -> f64 {
    if lp.is_finite() {
        lp as f64
    } else {
        -9999.0
    }
}

/// The legacy completions `logprobs` object, built token by token; `text_offset` counts characters of the
/// tokens' strings from the start of the completion.
#[derive(Default)]
pub struct Legacy {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<Value>,
    offset: usize,
}

impl Legacy {
    /// Appends the entries of `lps`.
    pub fn push(&mut self, names: &TokenNames, lps: &[TokenLogprob]) {
        for t in lps {
            let (token, _) = names.name(t.id);
            self.text_offset.push(json!(self.offset));
            self.offset += token.chars().count();
            self.tokens.push(Value::String(token));
            self.token_logprobs.push(json!(finite(t.logprob)));
            // a map by token string, as OpenAI's: two ids with one string (parts of characters, shown as U+FFFD)
            // keep the more likely
            let mut top = Map::new();
            for &(id, lp) in &t.top {
                top.entry(names.name(id).0).or_insert(json!(finite(lp)));
            }
            self.top_logprobs.push(Value::Object(top));
        }
    }

    /// The object so far; the entries are moved out (for a stream's next chunk).
    pub fn take(&mut self) -> Value {
        json!({
            "tokens": std::mem::take(&mut self.tokens),
            "token_logprobs": std::mem::take(&mut self.token_logprobs),
            "top_logprobs": std::mem::take(&mut self.top_logprobs),
            "text_offset": std::mem::take(&mut self.text_offset),
        })
    }
}
