//! Constrained decoding: each step, the tokens a grammar cannot continue with get a logit of `-inf` before sampling,
//! so the output follows the grammar (a JSON schema, any JSON object, or a Lark grammar). The grammar engine is
//! `llguidance` (the one behind llama.cpp's and vLLM's guided decoding): it walks a trie of every token's bytes
//! against an Earley parser with lexer-level derivatives, computing a step's mask in well under a millisecond on a
//! 248k vocabulary for JSON schemas.
//!
//! [`Grammars`] holds the vocabulary side (the token trie), built once per tokenizer; [`ConstraintSpec`] is one
//! request's grammar, compiled into a [`Constraint`] when its sequence starts. A constraint may wait for a text
//! first (`after`: `</think>`, matched on the output's bytes whatever tokens spell it), so that a thinking model
//! reasons freely and the grammar applies to its answer.
//! When the grammar is complete only the eos ids remain allowed, and the generation ends there.

use std::sync::Arc;

use backburner_model::TextTokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::error::{EngineError, Result};

/// What an output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// A value of this JSON schema (`response_format: {"type": "json_schema", …}`, llama-server's `json_schema`).
    JsonSchema(serde_json::Value),
    /// A Lark grammar in llguidance's dialect (llama-server's `grammar`; see `docs/SERVER.md`).
    Lark(String),
}

/// The token trie of a vocabulary and the parser factory over it (built once: ~0.2 s for 248k tokens).
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.factory.tok_env().tok_trie().vocab_size();
        f.debug_struct("Grammars").field("vocab", &n).finish()
    }
}

/// The tokenizer as llguidance sees it: every id's bytes (markup tokens such as `<|im_end|>` and `<think>` marked
/// special, ids past the tokenizer's vocabulary too), and the tokenizer's own tokenization of text: where a grammar
/// forces text, llguidance allows the tokens the tokenizer would write for it (what the model saw in training),
/// not any spelling of it.
struct Env {
    trie: TokTrie,
    enc: backburner_model::TextEncoder,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie
            .tokenize_with_greedy_fallback(s, |s| self.enc.encode(s).unwrap_or_default())
    }
}

impl Grammars {
    /// The grammars of a model with `vocab` logits (≥ the tokenizer's ids) and end-of-sequence ids `eos` (the
    /// tokens a finished grammar allows). Errors: [`EngineError::InvalidInput`] without an eos id, or when the
    /// vocabulary cannot be turned into a trie.
    pub fn new(tok: &TextTokenizer, vocab: usize, eos: &[u32]) -> Result<Self> {
        let Some(&first_eos) = eos.first() else {
            return Err(EngineError::InvalidInput(
                "constrained decoding needs an end-of-sequence id".into(),
            ));
        };
        let markup: std::collections::HashMap<u32, String> =
            tok.markup_tokens().into_iter().collect();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let special = |name: &[u8]| [&[TokTrie::SPECIAL_TOKEN_MARKER][..], name].concat();
                match (markup.get(&id), tok.token_bytes(id)) {
                    (Some(m), _) => special(m.as_bytes()),
                    (None, Some(b)) => b,
                    (None, None) => special(format!("<[{id}]>").as_bytes()),
                }
            })
            .collect();
        let vocab_u32 = u32::try_from(vocab)
            .map_err(|_| EngineError::InvalidInput(format!("vocabulary of {vocab} ids")))?;
        let trie =
            TokTrie::from(&TokRxInfo::new(vocab_u32, first_eos), &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Env {
            trie,
            enc: tok.encoder(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(grammar_error)?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// Compiles `g` into a matcher at its start. Errors: [`EngineError::InvalidInput`] naming what the grammar
    /// engine refused (a malformed schema or grammar, one past [`MAX_GRAMMAR_BYTES`]).
    fn compile(&self, g: &Grammar) -> Result<Matcher> {
        let size = match g {
            Grammar::JsonObject => 0,
            Grammar::JsonSchema(s) => s.to_string().len(),
            Grammar::Lark(s) => s.len(),
        };
        if size > MAX_GRAMMAR_BYTES {
            return Err(EngineError::InvalidInput(format!(
                "grammar: {size} bytes, more than the {MAX_GRAMMAR_BYTES} accepted"
            )));
        }
        let top = match g {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            Grammar::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s.clone())),
            Grammar::Lark(s) => TopLevelGrammar::from_lark(s.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(grammar_error)?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(grammar_error(e)),
            None => Ok(m),
        }
    }
}

/// JSON as OpenAI's structured outputs write it: `", "` and `": "` between items and keys, no other whitespace (a
/// model cannot pad the output with endless blanks), unless the schema sets llguidance's `x-guidance` itself.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
        });
    }
    schema
}

/// The grammar engine's message: its first line, at most 300 characters (a caught panic's message carries a
/// backtrace, which says nothing to a client).
fn short(e: impl std::fmt::Display) -> String {
    let m = e.to_string();
    let line = m.lines().next().unwrap_or("").trim();
    match line.char_indices().nth(300) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line.to_string(),
    }
}

fn grammar_error(e: impl std::fmt::Display) -> EngineError {
    EngineError::InvalidInput(format!("grammar: {}", short(e)))
}

/// Stack of the threads that compile grammars and compute their masks (the scheduler's): llguidance recurses on a
/// grammar's nesting, about 3 KB per level, so a 2 MB stack overflowed at ~700 nested rules (an adversarial trial).
/// 64 MiB (reserved, touched only as deep as used) takes ~20,000 levels, beyond what [`MAX_GRAMMAR_BYTES`] allows.
pub const GRAMMAR_STACK: usize = 64 << 20;

/// Largest grammar or JSON schema accepted, in bytes of its text (a grammar of this size nests at most a few
/// thousand levels).
pub const MAX_GRAMMAR_BYTES: usize = 128 << 10;

/// One request's constraint, before it is compiled.
#[derive(Clone, Debug)]
pub struct ConstraintSpec {
    /// The vocabulary's grammars.
    pub grammars: Arc<Grammars>,
    /// What the output must follow.
    pub grammar: Grammar,
    /// Apply the grammar only once the output ends with this text (`</think>`: reasoning stays free); `None`: from
    /// the first token.
    pub after: Option<String>,
}

impl PartialEq for ConstraintSpec {
    /// The same grammar and start over the same vocabulary.
    fn eq(&self, o: &Self) -> bool {
        Arc::ptr_eq(&self.grammars, &o.grammars)
            && self.grammar == o.grammar
            && self.after == o.after
    }
}

impl ConstraintSpec {
    /// Compiles the grammar (on a thread of [`GRAMMAR_STACK`] bytes). Errors: those of the grammar engine, as
    /// [`EngineError::InvalidInput`].
    pub fn start(&self) -> Result<Constraint> {
        let spec = self.clone();
        let matcher = on_grammar_stack(move || spec.grammars.compile(&spec.grammar))?;
        Ok(self.constraint(matcher))
    }

    /// Compiles the grammar and computes its first mask, on one thread of [`GRAMMAR_STACK`] bytes, so that one
    /// that cannot produce anything (`root ::= root`, a `$ref` cycle) or that the engine cannot run is refused
    /// before a request starts. Errors: [`EngineError::InvalidInput`].
    pub fn check(&self) -> Result<()> {
        let spec = self.clone();
        on_grammar_stack(move || {
            let mut m = spec.grammars.compile(&spec.grammar)?;
            let mask = m.compute_mask().map_err(|e| {
                grammar_error(format!(
                    "the grammar cannot produce any output ({})",
                    short(e)
                ))
            })?;
            if mask.is_zero() {
                return Err(grammar_error("no token can start the output"));
            }
            Ok(())
        })
    }

    fn constraint(&self, matcher: Matcher) -> Constraint {
        Constraint {
            matcher,
            waiting: self.after.as_ref().map(|a| a.as_bytes().to_vec()),
            tail: Vec::new(),
        }
    }
}

/// Runs `f` on a thread of [`GRAMMAR_STACK`] bytes and waits for it. Errors: `f`'s; [`EngineError::InvalidInput`]
/// when it panics.
fn on_grammar_stack<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    std::thread::Builder::new()
        .name("grammar".into())
        .stack_size(GRAMMAR_STACK)
        .spawn(f)
        .map_err(|e| EngineError::Constraint(format!("cannot start a grammar thread: {e}")))?
        .join()
        .map_err(|_| EngineError::InvalidInput("grammar: the grammar engine failed".into()))?
}

/// A compiled constraint, advancing with each generated token.
pub struct Constraint {
    matcher: Matcher,
    /// The text that starts the constraint, while the output has not ended with it.
    waiting: Option<Vec<u8>>,
    /// The output's last bytes (as long as `waiting`), while waiting.
    tail: Vec<u8>,
}

impl Constraint {
    /// Whether the grammar applies at this step.
    pub fn active(&self) -> bool {
        self.waiting.is_none()
    }

    /// Sets the logits of the tokens the grammar does not allow now to `-inf` (only eos ids once it is complete).
    /// Errors: [`EngineError::Constraint`] when the grammar engine fails.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<()> {
        if !self.active() {
            return Ok(());
        }
        let m = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| EngineError::Constraint(short(e)))?;
        let n = m.len();
        for (id, x) in logits.iter_mut().enumerate() {
            if id >= n || !m.is_allowed(id as TokenId) {
                *x = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances past generated token `id`. Errors: [`EngineError::Constraint`] when the grammar cannot take it.
    pub fn accept(&mut self, id: u32) -> Result<()> {
        if let Some(start) = &self.waiting {
            let env = self
                .matcher
                .tok_env()
                .map_err(|e| EngineError::Constraint(e.to_string()))?;
            self.tail.extend_from_slice(env.tok_trie().token(id));
            if self.tail.ends_with(start) {
                self.waiting = None;
            } else {
                let keep = self.tail.len().saturating_sub(start.len());
                self.tail.drain(..keep);
            }
            return Ok(());
        }
        if self.matcher.is_stopped() {
            return Ok(()); // an eos id after a complete grammar
        }
        self.matcher
            .consume_token(id)
            .map_err(|e| EngineError::Constraint(short(e)))
    }
}
