//! The tokenizer of a model as commands load it: checked against the OS's memory limits before it is built, and,
//! when a command needs one the model lacks, an error that says why it has none.

use std::path::Path;

use anyhow::{Context, Result};
use backburner_model::{ModelConfig, TextTokenizer};

/// The config and tokenizer of `dir` (no weights): what a command needs to tokenize its prompt before it decides
/// what to load.
pub fn load_tokenizer(dir: &Path) -> Result<(ModelConfig, Option<TextTokenizer>)> {
    let config = ModelConfig::from_dir(dir)?;
    // Parsing a tokenizer takes far more memory than its file: under an OS limit, say so instead of an allocator
    // abort. Measured on the Qwen3.5 tokenizer's 10.08 MB: RLIMIT_DATA must be at least 291 MB with 5 MB in use
    // before the parse (1 or 2 threads), 28.4 times the file; 30 leaves a margin.
    // A tokenizer.json beside a GGUF file wins over the file's own and is checked the same way; the file's own is
    // checked by the size of the JSON it is built as.
    let tok_dir = if dir.is_file() {
        dir.parent().unwrap_or(Path::new("."))
    } else {
        dir
    };
    let source = match std::fs::metadata(tok_dir.join("tokenizer.json")) {
        Ok(meta) => Some((meta.len(), "tokenizer.json")),
        Err(_) => gguf_tokenizer_bytes(dir).map(|b| (b, "the GGUF file's tokenizer as JSON")),
    };
    if let Some((bytes, what)) = source {
        use backburner_engine::memory::{check_fits, os_limits, MemoryNeed};
        let need = MemoryNeed::new(
            format!(
                "the tokenizer's tables ({} of {what}, about {TOKENIZER_FACTOR} times that while they are built)",
                backburner_engine::memory::human(bytes)
            ),
            bytes.saturating_mul(TOKENIZER_FACTOR),
        )
        .with_advice("raise the limit: the tokenizer is loaded whatever the placement");
        check_fits(&[need], &os_limits())?;
    }
    let tokenizer = TextTokenizer::from_dir(dir, config.vocab_size, &config.eos_token_ids)?;
    Ok((config, tokenizer))
}

/// Bytes a tokenizer takes while it is parsed, per byte of its JSON (measured, see [`load_tokenizer`]).
const TOKENIZER_FACTOR: u64 = 30;

/// About the size of the `tokenizer.json` a GGUF model's tokenizer is built as (bytes: its tokens' and merges' text
/// plus ~16 bytes of JSON per entry), or `None` when `dir` is not a GGUF model with a tokenizer (or does not open:
/// loading it then reports why).
fn gguf_tokenizer_bytes(dir: &Path) -> Option<u64> {
    if !backburner_model::checkpoint::is_gguf(dir) {
        return None;
    }
    let f = backburner_model::GgufFile::open(dir).ok()?;
    let md = f.metadata();
    let tokens = md.get_str_array("tokenizer.ggml.tokens")?;
    let bytes = |a: &backburner_model::gguf::StrArray| a.text_bytes() as u64 + 16 * a.len() as u64;
    let merges = md.get_str_array("tokenizer.ggml.merges").map_or(0, bytes);
    Some(bytes(tokens) + merges)
}

/// The model's tokenizer, or an error saying that `what` needs one and why the model at `dir` has none.
pub fn need_tok<'a>(
    tok: &'a Option<TextTokenizer>,
    dir: &Path,
    what: &str,
    hint: &str,
) -> Result<&'a TextTokenizer> {
    tok.as_ref().with_context(|| {
        format!(
            "{what} needs a tokenizer, and this model has none: {}{hint}",
            no_tokenizer_reason(dir)
        )
    })
}

/// Why the model at `dir` loaded without a tokenizer (see [`TextTokenizer::from_dir`]).
fn no_tokenizer_reason(dir: &Path) -> String {
    if !backburner_model::checkpoint::is_gguf(dir) {
        return format!("no tokenizer.json in {}", dir.display());
    }
    let file = match backburner_model::GgufFile::open(dir) {
        Ok(f) => f,
        Err(e) => {
            return format!("no tokenizer.json beside it, and its GGUF file did not open ({e})")
        }
    };
    let md = file.metadata();
    match md.get_str("tokenizer.ggml.model") {
        None => "no tokenizer.json beside the GGUF file, which has no tokenizer (`tokenizer.ggml.model` absent)".into(),
        Some("none") => {
            "no tokenizer.json beside the GGUF file, whose `tokenizer.ggml.model` is `none`".into()
        }
        Some(m) => format!(
            "no tokenizer.json beside the GGUF file, and its tokenizer (`{m}`, pre-tokenizer `{}`) is not supported (the warning above says why)",
            md.get_str("tokenizer.ggml.pre").unwrap_or("absent")
        ),
    }
}
