//! Which files make up a GGUF model: one file, a split set named `<stem>-0000K-of-0000N.gguf` (llama.cpp's
//! `llama_split_path` format, K counted from 1), or a directory holding exactly one of these.

use std::path::{Path, PathBuf};

use crate::error::{ModelError, Result};

/// `(prefix, k, n)` of a split part's file name `<prefix>-<k:05>-of-<n:05>.gguf` (k from 1).
pub(crate) fn split_name(file_name: &str) -> Option<(&str, u32, u32)> {
    let stem = file_name.strip_suffix(".gguf")?;
    let (rest, n) = stem.rsplit_once("-of-")?;
    let (prefix, k) = rest.rsplit_once('-')?;
    let digits = |s: &str| s.len() >= 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(k) || !digits(n) || prefix.is_empty() {
        return None;
    }
    let (k, n) = (k.parse::<u32>().ok()?, n.parse::<u32>().ok()?);
    // llama.cpp stores split.count as a u16: a larger count in a name is no split set (and is never expanded into
    // a list of billions of paths).
    (k >= 1 && k <= n && n <= u32::from(u16::MAX)).then_some((prefix, k, n))
}

/// The name of part `k` (from 1) of `n`.
pub(crate) fn split_part_name(prefix: &str, k: u32, n: u32) -> String {
    format!("{prefix}-{k:05}-of-{n:05}.gguf")
}

fn path_err(path: &Path, message: String) -> ModelError {
    ModelError::GgufPath {
        path: path.to_path_buf(),
        message,
    }
}

/// The part files of the model at `path`, in order. A split set's parts must be named alike in one directory;
/// their existence is checked when they are opened.
pub(crate) fn resolve(path: &Path) -> Result<Vec<PathBuf>> {
    let meta = std::fs::metadata(path).map_err(|e| ModelError::io(path, e))?;
    if meta.is_dir() {
        return resolve_dir(path);
    }
    Ok(resolve_file(path))
}

/// The parts of the model a file names: the whole split set for a split part, else the file.
fn resolve_file(path: &Path) -> Vec<PathBuf> {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    match split_name(name) {
        Some((prefix, _, n)) => {
            let dir = path.parent().unwrap_or(Path::new(""));
            (1..=n)
                .map(|k| dir.join(split_part_name(prefix, k, n)))
                .collect()
        }
        None => vec![path.to_path_buf()],
    }
}

/// A directory must hold exactly one model: one `.gguf` file or one split set. Files named `mmproj*` (vision
/// projectors, which llama.cpp keeps next to the model) are not models and are skipped.
fn resolve_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| ModelError::io(dir, e))?;
    let mut models: Vec<String> = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| ModelError::io(dir, e))?;
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        // Subdirectories are not looked into (a `.gguf`-named directory, or a symlink to `.`, is skipped).
        let is_dir = std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir());
        if !name.ends_with(".gguf") || name.starts_with("mmproj") || is_dir {
            continue;
        }
        // A split set counts once, under the name of its first part.
        let key = match split_name(&name) {
            Some((prefix, _, n)) => split_part_name(prefix, 1, n),
            None => name,
        };
        if !models.contains(&key) {
            models.push(key);
            if models.len() > 16 {
                break;
            }
        }
    }
    models.sort();
    match models.len() {
        0 => Err(path_err(dir, "the directory holds no .gguf file".into())),
        1 => Ok(resolve_file(&dir.join(&models[0]))),
        _ => Err(path_err(
            dir,
            format!(
                "the directory holds several GGUF models ({}); name the file to load",
                models.join(", ")
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_split_names_parse_as_llama_cpp_writes_them() {
        assert_eq!(
            split_name("Qwen3.5-27B-Q4_K_M-00002-of-00003.gguf"),
            Some(("Qwen3.5-27B-Q4_K_M", 2, 3))
        );
        assert_eq!(split_part_name("m", 1, 3), "m-00001-of-00003.gguf");
        for bad in [
            "m.gguf",
            "m-00004-of-00003.gguf",
            "m-00000-of-00003.gguf",
            "m-1-of-3.gguf",
            "-00001-of-00002.gguf",
            "m-00001-of-00002.bin",
        ] {
            assert_eq!(split_name(bad), None, "{bad}");
        }
    }
}
