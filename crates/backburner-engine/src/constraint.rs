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
/// special, ids past the tokenizer's vocabulary too). Text is tokenized greedily on the trie: llguidance only
/// tokenizes to force tokens, which masks do not use.
struct Env {
    trie: TokTrie,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
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
        let env: TokEnv = Arc::new(Env { trie });
        let mut factory = ParserFactory::new_simple(&env).map_err(grammar_error)?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// Compiles `g` into a matcher at its start. Errors: [`EngineError::InvalidInput`] naming what the grammar
    /// engine refused (a malformed schema or grammar).
    fn compile(&self, g: &Grammar) -> Result<Matcher> {
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

fn grammar_error(e: impl std::fmt::Display) -> EngineError {
    EngineError::InvalidInput(format!("grammar: {e}"))
}

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
    /// Compiles the grammar. Errors: those of the grammar engine, as [`EngineError::InvalidInput`].
    pub fn start(&self) -> Result<Constraint> {
        Ok(Constraint {
            matcher: self.grammars.compile(&self.grammar)?,
            waiting: self.after.as_ref().map(|a| a.as_bytes().to_vec()),
            tail: Vec::new(),
        })
    }
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
            .map_err(|e| EngineError::Constraint(e.to_string()))?;
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
            .map_err(|e| EngineError::Constraint(e.to_string()))
    }
}
