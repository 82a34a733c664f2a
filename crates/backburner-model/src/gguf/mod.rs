//! llama.cpp GGUF files: a bounded parser of the format (v2 and v3, little-endian, single files and split sets),
//! memory-mapped tensor data, the model config from `qwen35.*` metadata, and the tokenizer and chat template from
//! `tokenizer.*` metadata.
//!
//! Nothing read from a file is trusted: counts and lengths are checked against the bytes left before anything is
//! allocated, size arithmetic is checked, tensors must lie aligned inside their file without overlapping, and every
//! failure is a typed [`ModelError`] naming the file.

mod config;
mod metadata;
mod parse;
mod paths;
pub mod random;
mod tokenizer;
mod types;
pub mod writer;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{ModelError, Result};

pub use config::{check_architecture, config_from_gguf, SUPPORTED_ARCHITECTURES};
pub use metadata::{MetaArray, MetaValue, Metadata, StrArray};
pub use parse::DEFAULT_ALIGNMENT;
pub(crate) use tokenizer::special_token_text;
pub use tokenizer::{
    chat_template, eos_token_ids, tokenizer_json_from_gguf, QWEN2_SPLIT, QWEN35_SPLIT,
};
pub use types::GgmlType;

/// Where one tensor's bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The GGUF name (`blk.0.attn_qkv.weight`, …).
    pub name: String,
    /// Dimensions in ggml order: `dims[0]` varies fastest (the row length).
    pub dims: Vec<u64>,
    /// Storage type.
    pub ggml_type: GgmlType,
    /// Index of the part file holding it (into [`GgufFile::paths`]).
    pub part: usize,
    /// Absolute byte offset in the part file.
    pub offset: u64,
    /// Stored size in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Part `j` of `k` equal parts of a 2-D tensor's rows (`[cols, rows]` → `[cols, rows / k]`), named `name
    /// (part j of k)`; `None` when the rows or bytes do not split into `k` equal parts.
    pub fn rows_part(&self, j: usize, k: usize) -> Option<TensorInfo> {
        let &[cols, rows] = self.dims.as_slice() else {
            return None;
        };
        let (j, k) = (u64::try_from(j).ok()?, u64::try_from(k).ok()?);
        if j >= k || !rows.is_multiple_of(k) || !self.n_bytes.is_multiple_of(k) {
            return None;
        }
        let per = self.n_bytes / k;
        Some(TensorInfo {
            name: format!("{} (part {j} of {k})", self.name),
            dims: vec![cols, rows / k],
            ggml_type: self.ggml_type,
            part: self.part,
            offset: self.offset.checked_add(per.checked_mul(j)?)?,
            n_bytes: per,
        })
    }

    /// Expert `i` of a 3-D expert tensor (`[cols, rows, E]`, ggml order: one `[cols, rows]` matrix per expert, in
    /// expert order): a 2-D `[cols, rows]` tensor at its byte range, named `name (expert i)`. `None` when the tensor
    /// is not 3-D, `i` is not below E, or its bytes do not split into E equal parts.
    pub fn expert(&self, i: usize) -> Option<TensorInfo> {
        let &[cols, rows, n] = self.dims.as_slice() else {
            return None;
        };
        let i = u64::try_from(i).ok().filter(|&i| i < n)?;
        if n == 0 || !self.n_bytes.is_multiple_of(n) {
            return None;
        }
        let per = self.n_bytes / n;
        Some(TensorInfo {
            name: format!("{} (expert {i})", self.name),
            dims: vec![cols, rows],
            ggml_type: self.ggml_type,
            part: self.part,
            offset: self.offset.checked_add(per.checked_mul(i)?)?,
            n_bytes: per,
        })
    }

    /// `(rows, cols)` of a matrix stored row-major with rows of `dims[0]` elements: a 2-D tensor is
    /// `(dims[1], dims[0])`, a 1-D one `(1, dims[0])`; 3-D and 4-D tensors whose extra dims are all 1 count as 2-D.
    /// `None` for other shapes or sizes past `usize`.
    pub fn rows_cols(&self) -> Option<(usize, usize)> {
        if self.dims.len() > 2 && self.dims[2..].iter().any(|&d| d != 1) {
            return None;
        }
        let cols = usize::try_from(*self.dims.first()?).ok()?;
        let rows = usize::try_from(self.dims.get(1).copied().unwrap_or(1)).ok()?;
        Some((rows, cols))
    }

    /// Number of elements.
    pub fn n_elements(&self) -> u64 {
        // Checked when parsing: the product fits an i64.
        self.dims.iter().product()
    }
}

struct Part {
    path: PathBuf,
    /// The open file, for positional reads that bypass the map (fingerprints).
    file: File,
    mmap: Mmap,
}

/// An opened GGUF model: every part mapped and its header validated.
pub struct GgufFile {
    paths: Vec<PathBuf>,
    parts: Vec<Part>,
    metadata: Metadata,
    tensors: HashMap<String, TensorInfo>,
    version: u32,
    alignment: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("paths", &self.paths)
            .field("version", &self.version)
            .field("architecture", &self.architecture())
            .field("tensors", &self.tensors.len())
            .field("kv", &self.metadata.len())
            .finish()
    }
}

fn corrupt(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::CorruptGguf {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Opens, maps and parses one part file.
fn open_part(path: &Path) -> Result<(Part, parse::ParsedPart)> {
    crate::fsutil::check_regular(path, u64::MAX)?;
    let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
    let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
    if len == 0 {
        return Err(corrupt(path, "the file is empty"));
    }
    // SAFETY: the map is read-only; a file modified while we run is outside our contract (as for every mmap-based
    // loader). Every access goes through bounds-checked slices of the length mapped here.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
    let parsed = parse::parse(&mmap).map_err(|m| corrupt(path, m))?;
    let part = Part {
        path: path.to_path_buf(),
        file,
        mmap,
    };
    Ok((part, parsed))
}

/// Checks `split.no` / `split.count` of part `i` (from 0) of `n`.
fn check_split_keys(parsed: &parse::ParsedPart, path: &Path, i: usize, n: usize) -> Result<()> {
    let md = &parsed.metadata;
    let count = md.get("split.count").map(MetaValue::as_u64);
    let no = md.get("split.no").map(MetaValue::as_u64);
    if n == 1 {
        return match count {
            None | Some(Some(0 | 1)) => Ok(()),
            Some(Some(c)) => Err(ModelError::GgufPath {
                path: path.to_path_buf(),
                message: format!(
                    "the file is one part of a split set of {c} (split.count), but its name is not \
                     <stem>-0000K-of-{c:05}.gguf, so the other parts cannot be found"
                ),
            }),
            Some(None) => Err(corrupt(path, "split.count is not an unsigned integer")),
        };
    }
    if count == Some(Some(n as u64)) && no == Some(Some(i as u64)) {
        return Ok(());
    }
    let found = |v: Option<Option<u64>>| match v {
        None => "absent".to_string(),
        Some(None) => "not an unsigned integer".to_string(),
        Some(Some(x)) => x.to_string(),
    };
    Err(corrupt(
        path,
        format!(
            "as part {} of {n} it needs split.no = {i} and split.count = {n}; found split.no {}, split.count {}",
            i + 1,
            found(no),
            found(count)
        ),
    ))
}

impl GgufFile {
    /// Opens a `.gguf` file, any part of a split set named `<stem>-0000K-of-0000N.gguf` (all N parts are opened and
    /// must exist, with matching `split.no` / `split.count`), or a directory holding exactly one `.gguf` model or
    /// one split set (`mmproj*` files are skipped).
    ///
    /// Errors: [`ModelError::Io`] for a missing or unreadable file or one that is not a regular file (a FIFO);
    /// [`ModelError::GgufPath`] for a directory with no model or several, or a split part named as a single file;
    /// [`ModelError::CorruptGguf`] for anything malformed: bad magic, a big-endian file, versions other than 2 and 3,
    /// truncation, lengths or counts that cannot fit the file, duplicate keys or tensor names, more than 4 or
    /// zero-sized dimensions, an unknown tensor type, misaligned, overlapping or out-of-file tensor data,
    /// inconsistent split metadata.
    pub fn open(path: &Path) -> Result<Self> {
        let paths = paths::resolve(path)?;
        let n = paths.len();
        let mut parts = Vec::with_capacity(n);
        let mut tensors: HashMap<String, TensorInfo> = HashMap::new();
        let mut first: Option<(Metadata, u32, u64)> = None;
        for (i, p) in paths.iter().enumerate() {
            let (part, parsed) = open_part(p)?;
            check_split_keys(&parsed, p, i, n)?;
            for t in &parsed.tensors {
                if tensors.contains_key(&t.name) {
                    return Err(corrupt(
                        p,
                        format!("tensor {:?} is also in an earlier part", t.name),
                    ));
                }
                let info = TensorInfo {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ggml_type: t.ggml_type,
                    part: i,
                    offset: t.offset,
                    n_bytes: t.n_bytes,
                };
                tensors.insert(t.name.clone(), info);
            }
            if first.is_none() {
                first = Some((parsed.metadata, parsed.version, parsed.alignment));
            }
            parts.push(part);
        }
        let (metadata, version, alignment) = first.unwrap_or_default();
        if let Some(total) = metadata.get_u64("split.tensors.count") {
            if n > 1 && total != tensors.len() as u64 {
                return Err(corrupt(
                    &paths[0],
                    format!(
                        "split.tensors.count = {total} but the {n} parts hold {} tensors",
                        tensors.len()
                    ),
                ));
            }
        }
        Ok(GgufFile {
            paths,
            parts,
            metadata,
            tensors,
            version,
            alignment,
        })
    }

    /// The part files, in order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }

    /// The GGUF version of the (first) file: 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data (`general.alignment`, default 32) of the (first) file.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The metadata: the first part's key–value pairs (later parts of a split set carry only `split.*`).
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Option<&str> {
        self.metadata.get_str("general.architecture")
    }

    /// A tensor's info.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// All tensor names, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.paths[0].clone(),
            })
    }

    /// `(start, len)` of a tensor in its part's map, as usize.
    fn range(&self, info: &TensorInfo) -> Result<(usize, usize)> {
        let part = &self.parts[info.part];
        let start = usize::try_from(info.offset).ok();
        let len = usize::try_from(info.n_bytes).ok();
        match (start, len) {
            (Some(s), Some(l)) if s.checked_add(l).is_some_and(|e| e <= part.mmap.len()) => {
                Ok((s, l))
            }
            _ => Err(corrupt(
                &part.path,
                format!("tensor {:?} data lies outside the mapped file", info.name),
            )),
        }
    }

    /// A tensor's stored bytes (no copy), validated when the file was opened to lie inside its part's file.
    ///
    /// Errors: [`ModelError::MissingTensor`] (naming the first part's path).
    pub fn data(&self, name: &str) -> Result<&[u8]> {
        self.data_of(self.info(name)?)
    }

    /// The bytes `info` describes: one of this file's tensors, or a part of one ([`TensorInfo::expert`]).
    pub fn data_of(&self, info: &TensorInfo) -> Result<&[u8]> {
        let (s, l) = self.range(info)?;
        Ok(&self.parts[info.part].mmap[s..s + l])
    }

    /// Tells the OS that a tensor's mapped pages are no longer needed (they leave resident memory; the file stays in
    /// the page cache), as [`crate::Checkpoint::release`] does. Unknown names and platforms without `madvise` are
    /// ignored.
    pub fn release(&self, name: &str) {
        if let Some(info) = self.tensors.get(name) {
            self.release_of(info);
        }
    }

    /// [`GgufFile::release`] of the bytes `info` describes.
    pub fn release_of(&self, info: &TensorInfo) {
        #[cfg(unix)]
        {
            if let Ok((s, l)) = self.range(info) {
                // SAFETY: the map is read-only and file-backed; MADV_DONTNEED only drops its resident pages, and any
                // later access (a slice still held elsewhere) reads the same bytes back from the file.
                let _ = unsafe {
                    self.parts[info.part].mmap.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        s,
                        l,
                    )
                };
            }
        }
        #[cfg(not(unix))]
        let _ = info;
    }

    /// Passes a tensor's bytes to `f` in order, in pieces of at most `chunk` bytes (at least 1), read with positional
    /// reads into one buffer rather than through the map, as [`crate::Checkpoint::read_chunks`] does (for
    /// fingerprints of tensors this process does not hold).
    ///
    /// Errors: [`ModelError::MissingTensor`]; [`ModelError::Io`] when a read fails or the file ends early.
    pub fn read_chunks(&self, name: &str, chunk: usize, f: impl FnMut(&[u8])) -> Result<()> {
        self.read_chunks_of(self.info(name)?, chunk, f)
    }

    /// [`GgufFile::read_chunks`] of the bytes `info` describes.
    pub fn read_chunks_of(
        &self,
        info: &TensorInfo,
        chunk: usize,
        mut f: impl FnMut(&[u8]),
    ) -> Result<()> {
        let (start, len) = self.range(info)?;
        let part = &self.parts[info.part];
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            let chunk = chunk.clamp(1, len.max(1));
            let mut buf = vec![0u8; chunk];
            let mut done = 0usize;
            while done < len {
                let n = chunk.min(len - done);
                let off = (start + done) as u64;
                part.file
                    .read_exact_at(&mut buf[..n], off)
                    .map_err(|e| ModelError::io(&part.path, e))?;
                f(&buf[..n]);
                done += n;
            }
        }
        #[cfg(not(unix))]
        {
            let _ = &part.file;
            for c in part.mmap[start..start + len].chunks(chunk.max(1)) {
                f(c);
            }
            self.release_of(info);
        }
        Ok(())
    }

    /// Sum of the stored sizes of all tensors (bytes).
    pub fn total_tensor_bytes(&self) -> u64 {
        self.tensors
            .values()
            .fold(0u64, |a, t| a.saturating_add(t.n_bytes))
    }
}
