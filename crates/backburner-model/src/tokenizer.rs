//! Text side of a checkpoint: `tokenizer.json` (via the `tokenizers` crate), the chat template (via `minijinja`,
//! from `chat_template.jinja` or `tokenizer_config.json`) and the eos ids (`generation_config.json`, else config.json,
//! else the tokenizer's eos token).

use std::path::Path;

use serde::Serialize;

use crate::chat::{ChatRequest, ChatTemplate};
use crate::config::parse_id_list;
use crate::error::{ModelError, Result};

/// One chat message for the template.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// A loaded tokenizer with its chat template and eos ids.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    /// The template compiled on first use (or why it does not compile).
    compiled: std::sync::OnceLock<std::result::Result<ChatTemplate, String>>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab", &self.vocab_size())
            .field("chat_template", &self.chat_template.is_some())
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = crate::fsutil::read_text(path, crate::fsutil::MAX_SMALL_FILE)?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| ModelError::Json {
            path: path.to_path_buf(),
            message: e.to_string(),
        })
}

fn token_string(v: Option<&serde_json::Value>) -> Option<String> {
    match v? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// Checks that every token of a GGUF's list (but the unused ones, type 5) has its position as its id in the built
/// tokenizer: the `tokenizers` crate numbers added tokens itself, after the BPE vocabulary, so special tokens stored
/// anywhere else would silently get other ids.
///
/// Errors: [`ModelError::Tokenizer`] naming the first token whose id moved.
fn check_token_ids(
    inner: &tokenizers::Tokenizer,
    tokens: &crate::gguf::StrArray,
    types: Option<&crate::gguf::MetaArray>,
) -> Result<()> {
    let types = types.and_then(|t| t.to_i64_vec()).unwrap_or_default();
    for (id, text) in tokens.iter().enumerate() {
        if types.get(id) == Some(&5) {
            continue;
        }
        let got = inner.token_to_id(text);
        if got != u32::try_from(id).ok() {
            return Err(ModelError::Tokenizer(format!(
                "token {text:?} is stored at id {id} but the tokenizer built from the file gives it {got:?}; this token layout is not supported"
            )));
        }
    }
    Ok(())
}

impl TextTokenizer {
    /// Loads the tokenizer of a checkpoint directory, or `Ok(None)` when it has no `tokenizer.json`.
    ///
    /// `model_vocab` is the model's `vocab_size`; `config_eos` the eos ids from config.json (used when
    /// generation_config.json has none).
    ///
    /// Errors: [`ModelError::Tokenizer`] for an unloadable tokenizer.json, [`ModelError::Json`] for invalid side files,
    /// [`ModelError::VocabMismatch`] when the tokenizer has ids the model cannot embed.
    pub fn from_dir(dir: &Path, model_vocab: usize, config_eos: &[u32]) -> Result<Option<Self>> {
        if crate::checkpoint::is_gguf(dir) {
            return Self::beside_gguf(dir, model_vocab, config_eos);
        }
        Self::from_side_files(dir, model_vocab, config_eos)
    }

    /// `tokenizer.json` and its side files in `dir` (see [`TextTokenizer::from_dir`]).
    fn from_side_files(dir: &Path, model_vocab: usize, config_eos: &[u32]) -> Result<Option<Self>> {
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.exists() {
            return Ok(None);
        }
        crate::fsutil::check_regular(&tok_path, crate::fsutil::MAX_TOKENIZER_FILE)?;
        let inner = tokenizers::Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let n = inner.get_vocab_size(true);
        if n > model_vocab {
            return Err(ModelError::VocabMismatch {
                tokenizer: n,
                model: model_vocab,
            });
        }
        // Checkpoints pad their embedding past the tokenizer's ids (to a multiple of 64, 128, …), never to twice
        // as many: a tokenizer that small is most likely another model's.
        if n < model_vocab / 2 {
            tracing::warn!(
                "{} has {n} ids but the model embeds {model_vocab}: it is likely another model's tokenizer, and text \
                 will be tokenized as that model's",
                tok_path.display()
            );
        }
        let tcfg = read_json(&dir.join("tokenizer_config.json"))?;
        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = if jinja_path.exists() {
            Some(crate::fsutil::read_text(
                &jinja_path,
                crate::fsutil::MAX_SMALL_FILE,
            )?)
        } else {
            tcfg.as_ref()
                .and_then(|c| c.get("chat_template"))
                .and_then(|t| match t {
                    serde_json::Value::String(s) => Some(s.clone()),
                    // A list of named templates: take "default".
                    serde_json::Value::Array(a) => a
                        .iter()
                        .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                        .and_then(|e| e.get("template")?.as_str().map(str::to_string)),
                    _ => None,
                })
        };
        let bos_token = token_string(tcfg.as_ref().and_then(|c| c.get("bos_token")));
        let eos_token = token_string(tcfg.as_ref().and_then(|c| c.get("eos_token")));
        let gen = read_json(&dir.join("generation_config.json"))?;
        let mut eos_ids =
            parse_id_list(gen.as_ref().and_then(|g| g.get("eos_token_id"))).map_err(|m| {
                ModelError::Json {
                    path: dir.join("generation_config.json"),
                    message: format!("eos_token_id: {m}"),
                }
            })?;
        if eos_ids.is_empty() {
            eos_ids = config_eos.to_vec();
        }
        if eos_ids.is_empty() {
            if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
                eos_ids.push(id);
            }
        }
        Ok(Some(TextTokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
            compiled: std::sync::OnceLock::new(),
        }))
    }

    /// The tokenizer of a GGUF model: a `tokenizer.json` beside the file wins (with its directory's side files, as
    /// [`TextTokenizer::from_dir`]); else the file's own ([`TextTokenizer::from_gguf`]); `Ok(None)` when the file
    /// carries none (`tokenizer.ggml.model` absent or `"none"`) or one this build cannot build (an unsupported
    /// pre-tokenizer: logged as a warning, and the model runs from token ids).
    fn beside_gguf(path: &Path, model_vocab: usize, config_eos: &[u32]) -> Result<Option<Self>> {
        let dir = if path.is_file() {
            path.parent().unwrap_or(Path::new("."))
        } else {
            path
        };
        let f = crate::gguf::GgufFile::open(path)?;
        if dir.join("tokenizer.json").is_file() {
            let mut tok = Self::from_side_files(dir, model_vocab, config_eos)?;
            if let Some(t) = tok.as_mut() {
                if t.chat_template.is_none() {
                    t.chat_template = crate::gguf::chat_template(&f);
                }
            }
            return Ok(tok);
        }
        match f.metadata().get_str("tokenizer.ggml.model") {
            None | Some("none") => Ok(None),
            Some(_) => match Self::from_gguf(&f, model_vocab) {
                Ok(t) => Ok(Some(t)),
                // the weights still run from token ids (as llama.cpp's would with its fallback)
                Err(e @ ModelError::Tokenizer(_)) => {
                    tracing::warn!("{e}; the model runs from token ids only");
                    Ok(None)
                }
                Err(e) => Err(e),
            },
        }
    }

    /// Loads the tokenizer of a GGUF file (see [`crate::gguf::tokenizer_json_from_gguf`]) with its chat template
    /// (`tokenizer.chat_template`) and end-of-generation ids ([`crate::gguf::eos_token_ids`]; a GGUF file has no
    /// generation config). `bos_token` / `eos_token` for the template are the texts of
    /// `tokenizer.ggml.bos_token_id` / `eos_token_id`, as llama.cpp passes them.
    ///
    /// Errors: [`ModelError::Tokenizer`] when the file has no usable tokenizer (`tokenizer.ggml.model` = `none`,
    /// another model or pre-tokenizer, malformed lists), [`ModelError::VocabMismatch`] when it has ids the model
    /// cannot embed.
    pub fn from_gguf(f: &crate::gguf::GgufFile, model_vocab: usize) -> Result<Self> {
        let json = crate::gguf::tokenizer_json_from_gguf(f)?;
        let inner: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", f.paths()[0].display())))?;
        // The converter writes one token per embedding row (padding with unused ones), and llama.cpp refuses a file
        // whose token list and token_embd disagree: so do we.
        let md = f.metadata();
        let tokens = md
            .get_str_array("tokenizer.ggml.tokens")
            .ok_or_else(|| ModelError::Tokenizer("no tokenizer.ggml.tokens".into()))?;
        if tokens.len() != model_vocab {
            return Err(ModelError::VocabMismatch {
                tokenizer: tokens.len(),
                model: model_vocab,
            });
        }
        check_token_ids(&inner, tokens, md.get_array("tokenizer.ggml.token_type"))?;
        Ok(TextTokenizer {
            inner,
            chat_template: crate::gguf::chat_template(f),
            bos_token: crate::gguf::special_token_text(f, "tokenizer.ggml.bos_token_id"),
            eos_token: crate::gguf::special_token_text(f, "tokenizer.ggml.eos_token_id"),
            eos_ids: crate::gguf::eos_token_ids(f)?,
            compiled: std::sync::OnceLock::new(),
        })
    }

    /// Ids the tokenizer can produce (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// End-of-sequence ids.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The chat template's Jinja source, if one was found.
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Encodes text to ids; special tokens written in the text (e.g. `<|im_start|>`) map to their ids.
    /// No BOS is added (Qwen tokenizers add none). Errors: [`ModelError::Tokenizer`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decodes ids to text, special tokens included. Errors: [`ModelError::Tokenizer`].
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// The longest token of the vocabulary, in characters of its token string (for byte-level BPE, as Qwen's, one
    /// character per byte): text of `n` bytes is at least `n / max_token_bytes()` tokens.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .get_vocab(true)
            .keys()
            .map(|t| t.chars().count().max(t.len()))
            .max()
            .unwrap_or(1)
            .max(1)
    }

    /// The string of one token id (`None` if out of range).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// An owned encoder of this tokenizer's text (a copy of its vocabulary and merges), for code that must own
    /// one (a grammar engine's tokenizer).
    pub fn encoder(&self) -> TextEncoder {
        TextEncoder(self.inner.clone())
    }

    /// The added tokens that are markup rather than text: those the tokenizer marks special, and those written
    /// `<…>` (Qwen's `<think>`, `<tool_call>`), as `(id, content)` in id order. Grammar engines treat them as
    /// special tokens.
    pub fn markup_tokens(&self) -> Vec<(u32, String)> {
        let mut v: Vec<(u32, String)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special || (t.content.starts_with('<') && t.content.ends_with('>')))
            .map(|(id, t)| (id, t.content))
            .collect();
        v.sort_unstable();
        v
    }

    /// The bytes one token id stands for (`None` if out of range): for a byte-level BPE vocabulary (Qwen's), its
    /// token string read back through GPT-2's byte-to-character map, so that a token holding part of a UTF-8
    /// character gives that part; otherwise (a character outside the map) the UTF-8 of its decoding alone.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let t = self.inner.id_to_token(id)?;
        let map = byte_level_inverse();
        match t.chars().map(|c| map.get(&c).copied()).collect() {
            Some(bytes) => Some(bytes),
            None => self.decode(&[id]).ok().map(String::into_bytes),
        }
    }

    /// Renders the chat template for `messages` (with `add_generation_prompt`), as transformers'
    /// `apply_chat_template(tokenize=False)` does. Errors: [`ModelError::ChatTemplate`] when there is no template or it
    /// fails, [`ModelError::InvalidChatRequest`] when the template rejects the conversation.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, None)
    }

    /// As [`TextTokenizer::apply_chat_template`], also passing `enable_thinking` to the template when given (Qwen3.5
    /// templates close an empty thinking block when it is false). A thin wrapper over [`TextTokenizer::render_chat`].
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        let mut kwargs = serde_json::Map::new();
        if let Some(t) = enable_thinking {
            kwargs.insert("enable_thinking".into(), t.into());
        }
        self.render_chat(&ChatRequest {
            messages: &messages,
            tools: None,
            add_generation_prompt,
            kwargs: &kwargs,
        })
    }

    /// The compiled chat template (compiled on first use). Errors: [`ModelError::ChatTemplate`] when the checkpoint
    /// has none or it does not parse.
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        let src = self.chat_template.as_deref().ok_or_else(|| {
            ModelError::ChatTemplate("this checkpoint has no chat template".into())
        })?;
        self.compiled
            .get_or_init(|| ChatTemplate::new(src).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| ModelError::ChatTemplate(e.clone()))
    }

    /// Renders an OpenAI-shaped chat request into the prompt text, as transformers' `apply_chat_template` renders
    /// it with `bos_token`/`eos_token` from tokenizer_config.json (see [`ChatTemplate::render`]).
    ///
    /// Errors: [`ModelError::InvalidChatRequest`] for a malformed request or one the template rejects (HTTP 400),
    /// [`ModelError::ChatTemplate`] when there is no template or it fails otherwise.
    pub fn render_chat(&self, req: &ChatRequest<'_>) -> Result<String> {
        let template = self.chat_template()?;
        let mut special = Vec::new();
        if let Some(t) = &self.bos_token {
            special.push(("bos_token", t.as_str()));
        }
        if let Some(t) = &self.eos_token {
            special.push(("eos_token", t.as_str()));
        }
        template.render(req, &special)
    }
}

/// GPT-2's `bytes_to_unicode` map, reversed: the character a byte-level BPE vocabulary writes for each byte → the
/// byte. Printable bytes (`!`…`~`, `¡`…`¬`, `®`…`ÿ`) are their own characters; the other 68 take U+0100 onwards in
/// byte order.
fn byte_level_inverse() -> &'static std::collections::HashMap<char, u8> {
    static MAP: std::sync::OnceLock<std::collections::HashMap<char, u8>> =
        std::sync::OnceLock::new();
    MAP.get_or_init(|| {
        let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next = 0x100u32;
        (0..=255u8)
            .map(|b| {
                let c = if printable(b) {
                    char::from(b)
                } else {
                    next += 1;
                    char::from_u32(next - 1).expect("U+0100..U+0143 are chars")
                };
                (c, b)
            })
            .collect()
    })
}

/// Text to ids, as [`TextTokenizer::encode`] (special tokens written in the text map to their ids).
#[derive(Clone)]
pub struct TextEncoder(tokenizers::Tokenizer);

impl TextEncoder {
    /// The ids of `text`. Errors: [`ModelError::Tokenizer`].
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .0
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}
