//! Reading the small files of a checkpoint directory safely: only regular files (a FIFO or a device in place of
//! `config.json` would block or never end), and at most a bounded number of bytes.

use std::io::Read;
use std::path::Path;

use crate::error::{ModelError, Result};

/// Most bytes read from a config, index, tokenizer config or chat template file (16 MiB).
pub const MAX_SMALL_FILE: u64 = 16 << 20;

/// Most bytes of a `tokenizer.json` (256 MiB; the Qwen3.5 tokenizer is 10 MiB).
pub const MAX_TOKENIZER_FILE: u64 = 256 << 20;

fn invalid(path: &Path, what: String) -> ModelError {
    ModelError::io(
        path,
        std::io::Error::new(std::io::ErrorKind::InvalidInput, what),
    )
}

/// Checks that `path` is a regular file (following symlinks) of at most `max` bytes, without opening it.
///
/// Errors: [`ModelError::Io`] for a missing path, a FIFO, device, socket or directory, or a file past `max`.
pub fn check_regular(path: &Path, max: u64) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if !meta.is_file() {
        return Err(invalid(
            path,
            "not a regular file (a FIFO, device, socket or directory cannot be read as one)".into(),
        ));
    }
    if meta.len() > max {
        return Err(invalid(
            path,
            format!(
                "{} bytes is more than the {max} this file may have",
                meta.len()
            ),
        ));
    }
    Ok(())
}

/// Reads the regular file `path` as UTF-8 text, at most `max` bytes.
///
/// Errors: those of [`check_regular`], an unreadable file, text that is not UTF-8, or a file that grew past `max`.
pub fn read_text(path: &Path, max: u64) -> Result<String> {
    check_regular(path, max)?;
    let f = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
    let mut text = String::new();
    f.take(max.saturating_add(1))
        .read_to_string(&mut text)
        .map_err(|e| ModelError::io(path, e))?;
    if text.len() as u64 > max {
        return Err(invalid(path, format!("more than {max} bytes")));
    }
    Ok(text)
}
