//! The tokenizer, chat template and end-of-generation ids of a GGUF file, from its `tokenizer.*` metadata.
//!
//! A byte-level BPE vocabulary (`tokenizer.ggml.model` = `gpt2`) is turned into a Hugging Face `tokenizer.json`
//! document, which [`crate::TextTokenizer`] loads as it loads the file of a checkpoint directory. The document is
//! the one our Qwen3.5 `tokenizer.json` is (see `assets/qwen3.5/README.md`): NFC normalizer, the pre-tokenizer's
//! split regex then ByteLevel, BPE with `ignore_merges: false`, ByteLevel decoder.

use std::collections::HashSet;
use std::fmt::Write as _;

use super::GgufFile;
use crate::error::{ModelError, Result};

/// The Qwen3.5 split regex (`tokenizer.ggml.pre` = `qwen35`; llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN35`, quoted there
/// as the "original regex from tokenizer.json"): `\p{M}` joins letters.
pub const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The Qwen2 split regex (`tokenizer.ggml.pre` = `qwen2`; `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
pub const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Token texts llama.cpp treats as end of generation whatever the ids in the metadata say
/// (`llama_vocab::impl::load`, the `special_eog_ids` list, the entries that apply to byte-level BPE vocabularies).
pub(crate) const EOG_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
];

/// GGUF token types (`llama_token_type`).
const TT_NORMAL: i32 = 1;
const TT_UNKNOWN: i32 = 2;
const TT_CONTROL: i32 = 3;
const TT_USER_DEFINED: i32 = 4;
const TT_UNUSED: i32 = 5;
const TT_BYTE: i32 = 6;

fn tok_err(f: &GgufFile, m: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(format!("{}: {m}", f.paths()[0].display()))
}

/// `tokenizer.chat_template`, if the file has one.
pub fn chat_template(f: &GgufFile) -> Option<String> {
    f.metadata()
        .get_str("tokenizer.chat_template")
        .map(str::to_string)
}

/// The text of the token whose id is the value of `key` (`tokenizer.ggml.bos_token_id`, …), if both exist.
pub(crate) fn special_token_text(f: &GgufFile, key: &str) -> Option<String> {
    let id = usize::try_from(f.metadata().get_u64(key)?).ok()?;
    let tokens = f.metadata().get_str_array("tokenizer.ggml.tokens")?;
    tokens.get(id).map(str::to_string)
}

/// The end-of-generation ids: `tokenizer.ggml.eos_token_id`, then `eot_token_id` and `eom_token_id` when present,
/// then, as llama.cpp does, every token whose text is a known end marker (`<|im_end|>`, `<|endoftext|>`, …), in id
/// order, without repeats. For a Qwen3.5 file this gives `[<|im_end|>, <|endoftext|>]` = [248046, 248044], the ids
/// of its `generation_config.json`.
///
/// Errors: [`ModelError::Tokenizer`] when an id key is not an unsigned integer or lies past the vocabulary.
pub fn eos_token_ids(f: &GgufFile) -> Result<Vec<u32>> {
    let md = f.metadata();
    let tokens = md.get_str_array("tokenizer.ggml.tokens");
    let mut ids: Vec<u32> = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        let Some(v) = md.get(key) else { continue };
        let id = v
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| tok_err(f, format!("{key} = {v:?} is not a token id")))?;
        if tokens.is_some_and(|t| id as usize >= t.len()) {
            return Err(tok_err(f, format!("{key} = {id} lies past the vocabulary")));
        }
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    if let Some(tokens) = tokens {
        for (i, t) in tokens.iter().enumerate() {
            let Ok(id) = u32::try_from(i) else { break };
            if EOG_TEXTS.contains(&t) && !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// Appends `s` as a JSON string.
fn json_str(out: &mut String, s: &str) {
    // Serializing a str cannot fail.
    out.push_str(&serde_json::Value::from(s).to_string());
}

/// Splits a GGUF merge `"a b"` at its first space after the first character, as llama.cpp does.
fn split_merge(m: &str) -> Option<(&str, &str)> {
    let first = m.chars().next()?;
    let at = m[first.len_utf8()..].find(' ')? + first.len_utf8();
    Some((&m[..at], &m[at + 1..]))
}

/// The vocabulary (normal tokens, by id) and added tokens (control → special, user-defined → not special) of the
/// `model` section and `added_tokens` list. Unused tokens (the converter's `[PAD<id>]` fillers up to the model's
/// vocab size) are left out.
fn vocab_json(f: &GgufFile, out_vocab: &mut String, out_added: &mut String) -> Result<()> {
    let md = f.metadata();
    let tokens = md
        .get_str_array("tokenizer.ggml.tokens")
        .ok_or_else(|| tok_err(f, "tokenizer.ggml.tokens (an array of strings) is missing"))?;
    if tokens.len() > u32::MAX as usize {
        return Err(tok_err(f, "more than 2^32 tokens"));
    }
    let types = match md.get("tokenizer.ggml.token_type") {
        None => None,
        Some(_) => Some(
            md.get_i32_array("tokenizer.ggml.token_type")
                .filter(|t| t.len() == tokens.len())
                .ok_or_else(|| {
                    tok_err(
                        f,
                        "tokenizer.ggml.token_type is not an integer array as long as the token list",
                    )
                })?,
        ),
    };
    let mut seen: HashSet<&str> = HashSet::with_capacity(tokens.len());
    out_vocab.push('{');
    out_added.push('[');
    for (i, text) in tokens.iter().enumerate() {
        let ty = types.as_ref().map_or(TT_NORMAL, |t| t[i]);
        match ty {
            0 | TT_NORMAL | TT_UNKNOWN | TT_BYTE => {
                if !seen.insert(text) {
                    return Err(tok_err(f, format!("token {text:?} appears twice")));
                }
                if out_vocab.len() > 1 {
                    out_vocab.push(',');
                }
                json_str(out_vocab, text);
                let _ = write!(out_vocab, ":{i}");
            }
            TT_CONTROL | TT_USER_DEFINED => {
                if out_added.len() > 1 {
                    out_added.push(',');
                }
                let _ = write!(out_added, "{{\"id\":{i},\"content\":");
                json_str(out_added, text);
                let _ = write!(
                    out_added,
                    ",\"single_word\":false,\"lstrip\":false,\"rstrip\":false,\"normalized\":false,\"special\":{}}}",
                    ty == TT_CONTROL
                );
            }
            TT_UNUSED => {}
            other => return Err(tok_err(f, format!("token {i} has unknown type {other}"))),
        }
    }
    out_vocab.push('}');
    out_added.push(']');
    Ok(())
}

/// The merges as a JSON list of pairs.
fn merges_json(f: &GgufFile, out: &mut String) -> Result<()> {
    let merges = f
        .metadata()
        .get_str_array("tokenizer.ggml.merges")
        .ok_or_else(|| tok_err(f, "tokenizer.ggml.merges (an array of strings) is missing"))?;
    out.push('[');
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = split_merge(m).ok_or_else(|| {
            tok_err(
                f,
                format!("merge {i} ({m:?}) is not two tokens separated by a space"),
            )
        })?;
        if i > 0 {
            out.push(',');
        }
        out.push('[');
        json_str(out, a);
        out.push(',');
        json_str(out, b);
        out.push(']');
    }
    out.push(']');
    Ok(())
}

/// The split regex for `tokenizer.ggml.pre`.
fn split_regex(f: &GgufFile) -> Result<&'static str> {
    match f.metadata().get_str("tokenizer.ggml.pre") {
        Some("qwen35") => Ok(QWEN35_SPLIT),
        Some("qwen2") => Ok(QWEN2_SPLIT),
        Some(other) => Err(tok_err(
            f,
            format!("pre-tokenizer {other:?} (tokenizer.ggml.pre) is not supported; supported: qwen35, qwen2"),
        )),
        None => Err(tok_err(
            f,
            "tokenizer.ggml.pre is missing (supported pre-tokenizers: qwen35, qwen2)",
        )),
    }
}

/// A Hugging Face `tokenizer.json` document equivalent to the file's byte-level BPE tokenizer
/// (`tokenizer.ggml.model` = `gpt2`, `tokenizer.ggml.pre` = `qwen35` or `qwen2`): vocabulary from
/// `tokenizer.ggml.tokens` (normal tokens), added tokens from the control (special) and user-defined (not special)
/// ones, merges from `tokenizer.ggml.merges`, NFC normalizer (as Qwen's own files have; llama.cpp itself does not
/// normalize, so it differs from us on text that is not NFC), the pre-tokenizer's split regex, ByteLevel decoder.
///
/// Errors: [`ModelError::Tokenizer`] when the file carries no tokenizer (`tokenizer.ggml.model` = `none`), another
/// tokenizer model or pre-tokenizer, or a malformed token list, token types or merges.
pub fn tokenizer_json_from_gguf(f: &GgufFile) -> Result<String> {
    match f.metadata().get_str("tokenizer.ggml.model") {
        Some("gpt2") => {}
        Some("none" | "no_vocab") => {
            return Err(tok_err(
                f,
                "the file carries no tokenizer (tokenizer.ggml.model = \"none\"); give a tokenizer.json",
            ))
        }
        Some(other) => {
            return Err(tok_err(
                f,
                format!("tokenizer model {other:?} is not supported (only \"gpt2\": byte-level BPE)"),
            ))
        }
        None => return Err(tok_err(f, "tokenizer.ggml.model is missing")),
    }
    let regex = split_regex(f)?;
    let mut vocab = String::new();
    let mut added = String::new();
    vocab_json(f, &mut vocab, &mut added)?;
    let mut merges = String::new();
    merges_json(f, &mut merges)?;
    let mut out = String::with_capacity(vocab.len() + merges.len() + added.len() + 1024);
    out.push_str(r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":"#);
    out.push_str(&added);
    out.push_str(r#","normalizer":{"type":"NFC"},"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"#);
    json_str(&mut out, regex);
    out.push_str(r#"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"trim_offsets":true,"use_regex":false}]},"post_processor":null,"decoder":{"type":"ByteLevel","add_prefix_space":true,"trim_offsets":true,"use_regex":true},"model":{"type":"BPE","dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":"#);
    out.push_str(&vocab);
    out.push_str(r#","merges":"#);
    out.push_str(&merges);
    out.push_str("}}");
    Ok(out)
}
