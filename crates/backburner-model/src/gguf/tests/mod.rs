//! Tests of the GGUF reader on files written by [`super::writer`]: valid files (every value type, tensor types,
//! alignment, v2/v3, split sets, directories), malformed ones (each a typed error, without panics or large
//! allocations), the config from `qwen35` metadata and the tokenizer from `tokenizer.*` metadata.

mod config;
mod format;
mod malformed;
mod split;
mod tokenizer;

use std::path::{Path, PathBuf};

use super::metadata::{MetaArray, MetaValue, StrArray};
use super::writer::GgufWriter;
use crate::error::ModelError;

/// Writes `w` as `dir/name` and returns the path.
fn write_tmp(w: &GgufWriter, dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    w.write(&p).unwrap();
    p
}

/// The parser's message for bytes that must be refused.
fn parse_err(bytes: &[u8]) -> String {
    match super::parse::parse(bytes) {
        Ok(p) => panic!("parsed a malformed file: {p:?}"),
        Err(m) => m,
    }
}

/// A string array value.
fn str_array(items: &[&str]) -> MetaValue {
    let mut a = StrArray::with_capacity(items.len(), 0);
    for s in items {
        a.push(s);
    }
    MetaValue::Array(MetaArray::Str(a))
}

/// The error's message with its sources.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out += &format!(": {s}");
        src = s.source();
    }
    out
}

/// Runs `f` on a thread and fails (instead of hanging) if it takes more than 10 s.
fn within_10s<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(10))
        .expect("blocked on a non-regular file")
}

/// Makes a FIFO at `p`; false where `mkfifo` is unavailable.
fn mkfifo(p: &Path) -> bool {
    std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The message of a [`ModelError::CorruptGguf`] (panics on any other outcome).
fn corrupt_message(r: crate::Result<super::GgufFile>) -> String {
    match r {
        Err(ModelError::CorruptGguf { message, .. }) => message,
        Err(e) => panic!("expected CorruptGguf, got {e:?}"),
        Ok(f) => panic!("expected CorruptGguf, opened {f:?}"),
    }
}
