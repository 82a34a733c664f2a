//! The `tokenizer.*` section of a generated file.

use crate::error::{ModelError, Result};
use crate::gguf::metadata::{MetaArray, MetaValue, StrArray};
use crate::gguf::tokenizer::EOG_TEXTS;
use crate::gguf::writer::GgufWriter;

/// GGUF token types (`llama_token_type`).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const UNUSED: i32 = 5;

/// The special tokens of the byte-level vocabulary, after its 256 byte tokens; the last is eos.
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// A byte-level BPE vocabulary to write (`tokenizer.ggml.model` = `gpt2`), e.g. a real tokenizer converted by the
/// caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufVocab {
    /// Token texts by id (at most the model's vocab size; the rest is filled with unused `[PAD<id>]` tokens, as
    /// llama.cpp's converter does).
    pub tokens: Vec<String>,
    /// GGUF token types by id (1 normal, 3 control, 4 user-defined, 5 unused), as long as `tokens`.
    pub token_types: Vec<i32>,
    /// BPE merges, `"a b"`.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.pre`: `qwen35` or `qwen2`.
    pub pre: String,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: u32,
    /// `tokenizer.chat_template`, if any.
    pub chat_template: Option<String>,
}

/// The tokenizer a generated file carries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Vocab {
    /// None (`tokenizer.ggml.model` = `none`): the model runs on token ids only.
    None,
    /// A minimal valid byte-level BPE tokenizer: the 256 byte tokens (GPT-2's byte-to-character map, no merges, so
    /// text is one token per byte), then `<|endoftext|>`, `<|im_start|>` and `<|im_end|>` (eos) as control tokens,
    /// then unused fillers up to the vocab size; pre-tokenizer `qwen35`. Needs a vocab of at least 259. The default.
    #[default]
    ByteLevel,
    /// The given vocabulary.
    Given(GgufVocab),
}

/// GPT-2's byte-level character for each byte: printable Latin-1 bytes stand for themselves, the others (controls,
/// space, DEL, NBSP, soft hyphen) for U+0100 onwards in byte order.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 33..=126 | 161..=172 | 174..=255);
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("a valid code point")
}

/// The byte-level vocabulary of `vocab_size` tokens.
fn byte_level(vocab_size: usize) -> Result<GgufVocab> {
    let n_real = 256 + SPECIALS.len();
    if vocab_size < n_real {
        return Err(ModelError::InvalidConfig(format!(
            "vocab_size {vocab_size} is below the {n_real} tokens of the byte-level tokenizer"
        )));
    }
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    let mut token_types = vec![NORMAL; 256];
    tokens.extend(SPECIALS.iter().map(|s| s.to_string()));
    token_types.extend([CONTROL; 3]);
    Ok(GgufVocab {
        tokens,
        token_types,
        merges: Vec::new(),
        pre: "qwen35".into(),
        eos: (n_real - 1) as u32,
        chat_template: None,
    })
}

fn strs(v: &[String]) -> MetaValue {
    let mut a = StrArray::with_capacity(v.len(), v.iter().map(String::len).sum());
    v.iter().for_each(|s| a.push(s));
    MetaValue::Array(MetaArray::Str(a))
}

/// Writes the `tokenizer.*` keys of `vocab` for a model of `vocab_size` tokens and returns the end-of-generation
/// ids the reader derives from them (eos, then every known end marker in id order; [`crate::gguf::eos_token_ids`]).
///
/// Errors: [`ModelError::InvalidConfig`] for a vocabulary longer than `vocab_size`, token types not as long as the
/// tokens, an eos past them, or a byte-level one that does not fit.
pub(super) fn write_vocab(
    w: &mut GgufWriter,
    vocab: &Vocab,
    vocab_size: usize,
) -> Result<Vec<u32>> {
    let v = match vocab {
        Vocab::None => {
            w.kv("tokenizer.ggml.model", MetaValue::Str("none".into()));
            return Ok(Vec::new());
        }
        Vocab::ByteLevel => byte_level(vocab_size)?,
        Vocab::Given(v) => v.clone(),
    };
    let bad = |m: String| Err(ModelError::InvalidConfig(m));
    if v.tokens.len() > vocab_size || v.token_types.len() != v.tokens.len() {
        return bad(format!(
            "a vocabulary of {} tokens and {} token types for a vocab_size of {vocab_size}",
            v.tokens.len(),
            v.token_types.len()
        ));
    }
    if v.eos as usize >= v.tokens.len() {
        return bad(format!("eos id {} lies past the vocabulary", v.eos));
    }
    let mut tokens = v.tokens;
    let mut types = v.token_types;
    for i in tokens.len()..vocab_size {
        tokens.push(format!("[PAD{i}]"));
        types.push(UNUSED);
    }
    let mut eos = vec![v.eos];
    for (i, t) in tokens.iter().enumerate() {
        if EOG_TEXTS.contains(&t.as_str()) && i as u32 != v.eos {
            eos.push(i as u32);
        }
    }
    w.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()))
        .kv("tokenizer.ggml.pre", MetaValue::Str(v.pre))
        .kv("tokenizer.ggml.tokens", strs(&tokens))
        .kv(
            "tokenizer.ggml.token_type",
            MetaValue::Array(MetaArray::I32(types)),
        )
        .kv("tokenizer.ggml.merges", strs(&v.merges))
        .kv("tokenizer.ggml.eos_token_id", MetaValue::U32(v.eos));
    if let Some(t) = v.chat_template {
        w.kv("tokenizer.chat_template", MetaValue::Str(t));
    }
    Ok(eos)
}
