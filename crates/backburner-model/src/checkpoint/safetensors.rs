//! Memory-mapped safetensors checkpoints: single-file or sharded (`model.safetensors.index.json`).
//!
//! Tensors are looked up by their on-disk names (Hugging Face's); stored F32, BF16 or F16 data is converted to f32 on
//! read (compute is f32 on CPU).

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use backburner_kernels::matmul::{RowMajor, WeightDtype};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, SafeTensors, TensorInfo};

use crate::error::{ModelError, Result};

struct Shard {
    path: PathBuf,
    /// The open file, for positional reads that do not go through the map (fingerprints).
    file: File,
    mmap: Mmap,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
}

/// An opened safetensors checkpoint: every shard mapped and its header validated.
pub struct SafetensorsCheckpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    /// Stored tensors and views ([`expert_views`]): a view is a stored tensor's byte range under another name.
    tensors: HashMap<String, (usize, TensorInfo)>,
    /// The names in `tensors` that are views.
    views: BTreeSet<String>,
}

impl SafetensorsCheckpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or else `dir/model.safetensors`, memory-maps every shard and
    /// validates every header (offsets within the file, file length equal to the header's data length).
    ///
    /// Errors: [`ModelError::NoWeights`] when neither file exists, [`ModelError::Json`] for a broken index,
    /// [`ModelError::Io`] for an unreadable shard (including one the index names but that is absent), and
    /// [`ModelError::CorruptSafetensors`] for a truncated or malformed shard.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index.exists() {
            let text = crate::fsutil::read_text(&index, crate::fsutil::MAX_SMALL_FILE)?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Json {
                    path: index.clone(),
                    message: e.to_string(),
                })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Json {
                    path: index.clone(),
                    message: "no \"weight_map\" object".into(),
                })?;
            let mut names = BTreeSet::new();
            for (tensor, file) in map {
                let f = file.as_str().ok_or_else(|| ModelError::Json {
                    path: index.clone(),
                    message: format!("weight_map[{tensor:?}] is not a file name"),
                })?;
                if f.contains('/') || f.contains('\\') || f.starts_with('.') {
                    return Err(ModelError::Json {
                        path: index.clone(),
                        message: format!("weight_map[{tensor:?}] = {f:?} is not a plain file name"),
                    });
                }
                names.insert(f.to_string());
            }
            names.into_iter().map(|n| dir.join(n)).collect()
        } else if single.exists() {
            vec![single]
        } else {
            return Err(ModelError::NoWeights(dir.to_path_buf()));
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        for (si, path) in files.into_iter().enumerate() {
            crate::fsutil::check_regular(&path, u64::MAX)?;
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the map is read-only; a checkpoint modified while we run is outside our contract
            // (as for every mmap-based loader).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            let (n, meta) =
                SafeTensors::read_metadata(&mmap).map_err(|e| ModelError::CorruptSafetensors {
                    path: path.clone(),
                    message: describe_st_error(&e, mmap.len()),
                })?;
            for (name, info) in meta.tensors() {
                if let Some((other, _)) = tensors.insert(name.clone(), (si, info.clone())) {
                    let first: &Shard = &shards[other];
                    return Err(ModelError::CorruptSafetensors {
                        path: path.clone(),
                        message: format!(
                            "tensor {name:?} is also stored in {}",
                            first.path.display()
                        ),
                    });
                }
            }
            shards.push(Shard {
                path,
                file,
                mmap,
                data_start: 8 + n,
            });
        }
        let mut views = BTreeSet::new();
        for (name, v) in expert_views(&tensors) {
            if let std::collections::hash_map::Entry::Vacant(slot) = tensors.entry(name.clone()) {
                slot.insert(v);
                views.insert(name);
            }
        }
        Ok(SafetensorsCheckpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
            views,
        })
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Whether a tensor of this on-disk name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// All on-disk tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(|s| s.as_str()).collect();
        v.sort_unstable();
        v
    }

    /// Shape of a tensor as stored. Errors: [`ModelError::MissingTensor`].
    pub fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.info(name)?.1.shape)
    }

    fn info(&self, name: &str) -> Result<&(usize, TensorInfo)> {
        self.tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
                dir: self.dir.clone(),
            })
    }

    /// Raw stored bytes of a tensor (little-endian, row-major) and its dtype.
    pub fn raw(&self, name: &str) -> Result<(Dtype, &[u8])> {
        let (si, info) = self.info(name)?;
        let shard = &self.shards[*si];
        let (a, b) = info.data_offsets;
        let bytes = shard
            .mmap
            .get(shard.data_start + a..shard.data_start + b)
            .ok_or_else(|| ModelError::CorruptSafetensors {
                path: shard.path.clone(),
                message: format!("tensor {name:?} data lies outside the file"),
            })?;
        Ok((info.dtype, bytes))
    }

    /// Stored size of a tensor's data (bytes). Errors: [`ModelError::MissingTensor`].
    pub fn stored_bytes(&self, name: &str) -> Result<usize> {
        let (_, info) = self.info(name)?;
        Ok(info.data_offsets.1 - info.data_offsets.0)
    }

    /// A tensor's stored dtype. Errors: [`ModelError::MissingTensor`].
    pub fn dtype(&self, name: &str) -> Result<Dtype> {
        Ok(self.info(name)?.1.dtype)
    }

    /// The shard file holding a tensor. Errors: [`ModelError::MissingTensor`].
    pub fn shard_path(&self, name: &str) -> Result<&Path> {
        let (si, _) = self.info(name)?;
        Ok(&self.shards[*si].path)
    }

    /// Passes a tensor's stored bytes to `f` in order, in pieces of at most `chunk` bytes (at least 1), read from
    /// the file with positional reads into one buffer of that size rather than through the memory map: the bytes go
    /// through the OS page cache but never become resident in this process, so hashing tensors this process does
    /// not hold (a host fingerprinting a worker's layers) costs `chunk` bytes of memory, not the tensors' size.
    /// (Where positional reads are not available the map is read and its pages released after.)
    ///
    /// Errors: [`ModelError::MissingTensor`]; [`ModelError::Io`] when a read fails or the file ends early (it was
    /// truncated after it was opened).
    pub fn read_chunks(&self, name: &str, chunk: usize, mut f: impl FnMut(&[u8])) -> Result<()> {
        let (si, info) = self.info(name)?;
        let shard = &self.shards[*si];
        let (a, b) = info.data_offsets;
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileExt;
            let chunk = chunk.max(1).min(b - a).max(1);
            let mut buf = vec![0u8; chunk];
            let mut at = a;
            while at < b {
                let n = chunk.min(b - at);
                let off = (shard.data_start + at) as u64;
                shard
                    .file
                    .read_exact_at(&mut buf[..n], off)
                    .map_err(|e| ModelError::io(&shard.path, e))?;
                f(&buf[..n]);
                at += n;
            }
        }
        #[cfg(not(unix))]
        {
            let _ = (&shard.file, a, b);
            let (_, bytes) = self.raw(name)?;
            for c in bytes.chunks(chunk.max(1)) {
                f(c);
            }
            self.release(name);
        }
        Ok(())
    }

    /// Checks a tensor's shape against `expected` (elements per dim).
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`].
    pub fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        let (_, info) = self.info(name)?;
        if info.shape != expected {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                expected: expected.to_vec(),
                found: info.shape.clone(),
            });
        }
        Ok(())
    }

    /// Reads a tensor as f32, checking its shape against `expected` (elements per dim).
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`].
    pub fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        self.check_shape(name, expected)?;
        let (dtype, bytes) = self.raw(name)?;
        let out = match dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok(out)
    }

    /// A 2-D weight tensor as it is stored (row-major little-endian bytes in its dtype, no copy), checking its shape
    /// against `[rows, cols]`.
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`].
    pub fn weight_part(&self, name: &str, rows: usize, cols: usize) -> Result<RowMajor<'_>> {
        self.check_shape(name, &[rows, cols])?;
        let (dtype, bytes) = self.raw(name)?;
        let dtype = match dtype {
            Dtype::F32 => WeightDtype::F32,
            Dtype::BF16 => WeightDtype::Bf16,
            Dtype::F16 => WeightDtype::F16,
            other => {
                return Err(ModelError::UnsupportedDtype {
                    name: name.to_string(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        Ok(RowMajor { dtype, bytes, rows })
    }

    /// Tells the OS that the mapped pages of a tensor already copied out are no longer needed, so they leave this
    /// process's resident memory (the file stays in the page cache; a later read maps it again). Loading layer by
    /// layer this way keeps peak resident memory near the size of the weights kept, not twice it. Unknown names and
    /// platforms without `madvise` are ignored.
    pub fn release(&self, name: &str) {
        #[cfg(unix)]
        if let Some((si, info)) = self.tensors.get(name) {
            let shard = &self.shards[*si];
            let (a, b) = info.data_offsets;
            // SAFETY: the map is read-only and file-backed; MADV_DONTNEED only drops its resident pages, and any
            // later access (a slice still held elsewhere) reads the same bytes back from the file.
            let _ = unsafe {
                shard.mmap.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    shard.data_start + a,
                    b - a,
                )
            };
        }
        #[cfg(not(unix))]
        let _ = name;
    }

    /// Sum of the stored sizes of all tensors (bytes).
    pub fn total_bytes(&self) -> usize {
        self.tensors
            .iter()
            .filter(|(n, _)| !self.views.contains(*n))
            .map(|(_, (_, i))| i.data_offsets.1 - i.data_offsets.0)
            .sum()
    }
}

/// Per-expert views of the fused expert tensors that transformers 5 keeps in memory and some checkpoints store:
/// `…mlp.experts.gate_up_proj` `[E, 2·I, H]` (each expert's gate rows, then its up rows) gives
/// `…mlp.experts.{e}.gate_proj.weight` and `….up_proj.weight` `[I, H]`, and `…mlp.experts.down_proj` `[E, H, I]`
/// gives `…mlp.experts.{e}.down_proj.weight` `[H, I]` — the names `save_pretrained` writes and the loader reads.
/// Each view is a byte range of the stored tensor (row-major, so one expert's rows are contiguous). Tensors of
/// another rank, dtype size or byte length are left alone (a load then misses the per-expert names, by name).
fn expert_views(
    tensors: &HashMap<String, (usize, TensorInfo)>,
) -> Vec<(String, (usize, TensorInfo))> {
    let mut out = Vec::new();
    for (name, (si, info)) in tensors {
        let (prefix, parts): (&str, &[&str]) =
            if let Some(p) = name.strip_suffix("experts.gate_up_proj") {
                (p, &["gate_proj", "up_proj"])
            } else if let Some(p) = name.strip_suffix("experts.down_proj") {
                (p, &["down_proj"])
            } else {
                continue;
            };
        let elem = match info.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            _ => continue,
        };
        let &[n_exp, rows, cols] = info.shape.as_slice() else {
            continue;
        };
        let k = parts.len();
        let (a, b) = info.data_offsets;
        let stride = rows.checked_mul(cols).and_then(|x| x.checked_mul(elem));
        if !rows.is_multiple_of(k) || stride.and_then(|s| s.checked_mul(n_exp)) != Some(b - a) {
            continue;
        }
        let stride = stride.expect("checked above");
        let part = stride / k;
        for e in 0..n_exp {
            for (j, p) in parts.iter().enumerate() {
                let start = a + e * stride + j * part;
                let view = TensorInfo {
                    dtype: info.dtype,
                    shape: vec![rows / k, cols],
                    data_offsets: (start, start + part),
                };
                out.push((format!("{prefix}experts.{e}.{p}.weight"), (*si, view)));
            }
        }
    }
    out
}

fn describe_st_error(e: &safetensors::SafeTensorError, file_len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => {
            format!("file is {file_len} bytes, too short for a safetensors header")
        }
        E::InvalidHeaderLength => {
            format!(
                "header length exceeds the file ({file_len} bytes): truncated or not safetensors"
            )
        }
        E::MetadataIncompleteBuffer => {
            format!("data section does not match the header ({file_len} bytes on disk): truncated or padded file")
        }
        other => format!("{other}"),
    }
}
