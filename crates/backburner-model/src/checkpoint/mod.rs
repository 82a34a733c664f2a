//! A model's weights as the loader sees them, whatever file holds them: a safetensors checkpoint directory
//! (Hugging Face's names and conventions) or a llama.cpp GGUF file (its names, its quantized block formats and the
//! transforms its converter applied).
//!
//! The loader asks for tensors by their Hugging Face names (`model.layers.3.mlp.down_proj.weight`) and for vectors
//! by what they mean ([`VectorKind`]): a GGUF backend maps each name to the GGUF tensor and undoes nothing it need
//! not undo (norm gains and `A` are stored folded, so they are read as stored; the v-head order the converter
//! chose is followed by the model through [`crate::config::VHeadOrder`], not undone).

mod gguf_map;
mod mtp_names;
mod safetensors;
mod unused;

use std::path::Path;

use backburner_kernels::matmul::{RowMajor, WeightDtype};
use backburner_kernels::quant::QuantFormat;

pub use self::safetensors::SafetensorsCheckpoint;
pub use self::unused::{log_unused_tensors, unused_tensors, UnusedTensors};
use crate::error::{ModelError, Result};
use gguf_map::GgufCheckpoint;

/// How a tensor is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    /// 32-bit float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// A GGUF block format the kernels compute with.
    Quant(QuantFormat),
    /// Anything else, by its name in the file (refused when the load needs it).
    Other(String),
}

impl StoredDtype {
    /// The type's name as llama.cpp prints it: `F32`, `F16`, `BF16`, `Q4_K`, `IQ4_XS`, … (another type by its name in
    /// the file).
    pub fn name(&self) -> String {
        match self {
            StoredDtype::F32 => "F32".into(),
            StoredDtype::F16 => "F16".into(),
            StoredDtype::BF16 => "BF16".into(),
            StoredDtype::Quant(q) => q.name().into(),
            StoredDtype::Other(s) => s.clone(),
        }
    }
}

impl<'a> WeightPart<'a> {
    /// Rows `r` of the part (a borrowed slice of its bytes); `None` when `r` is not inside its rows.
    pub fn rows(&self, r: std::ops::Range<usize>) -> Option<WeightPart<'a>> {
        let (bytes, rows) = match self {
            WeightPart::Dense(d) => (d.bytes, d.rows),
            WeightPart::Quant { bytes, rows, .. } => (*bytes, *rows),
        };
        if r.start > r.end || r.end > rows || rows == 0 {
            return None;
        }
        let per = bytes.len() / rows;
        let b = &bytes[r.start * per..r.end * per];
        let n = r.end - r.start;
        Some(match self {
            WeightPart::Dense(d) => WeightPart::Dense(RowMajor {
                dtype: d.dtype,
                bytes: b,
                rows: n,
            }),
            WeightPart::Quant { format, .. } => WeightPart::Quant {
                format: *format,
                bytes: b,
                rows: n,
            },
        })
    }
}

/// A 2-D weight `[rows, cols]` as stored, borrowed from the mapped file.
#[derive(Clone, Copy, Debug)]
pub enum WeightPart<'a> {
    /// F32, BF16 or F16 rows.
    Dense(RowMajor<'a>),
    /// GGUF blocks of `format`, `rows` rows of `cols / format.block_elems()` blocks each.
    Quant {
        /// The block format.
        format: QuantFormat,
        /// The rows' blocks.
        bytes: &'a [u8],
        /// Rows.
        rows: usize,
    },
}

/// What a 1-D (or conv) tensor means, so each backend can return the value the model computes with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VectorKind {
    /// Used as stored.
    Plain,
    /// A Qwen3.5 RMSNorm weight: the model multiplies by `1 + w` (Hugging Face stores `w`; llama.cpp's converter
    /// stores `1 + w`).
    NormGain,
    /// The Gated DeltaNet decay rate: the model uses `A = −exp(A_log)` (Hugging Face stores `A_log`; llama.cpp's
    /// converter stores `A`).
    NegExp,
}

enum Inner {
    Safetensors(SafetensorsCheckpoint),
    Gguf(Box<GgufCheckpoint>),
}

/// An opened checkpoint: a safetensors directory or a GGUF file (or split set), every file mapped and validated.
pub struct Checkpoint {
    inner: Inner,
}

/// Whether `path` names a GGUF model: a file named `*.gguf` (any case) or starting with the GGUF magic, a missing
/// path named `*.gguf` (so that the GGUF opener reports it), or a directory without `config.json` that holds a
/// `*.gguf` file.
pub fn is_gguf(path: &Path) -> bool {
    let ext = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    match std::fs::metadata(path) {
        Err(_) => ext,
        Ok(m) if m.is_dir() => {
            !path.join("config.json").exists()
                && std::fs::read_dir(path).is_ok_and(|rd| {
                    rd.flatten()
                        .any(|e| e.file_name().to_string_lossy().ends_with(".gguf"))
                })
        }
        // only a regular file is opened to read its magic (a FIFO would block)
        Ok(m) => ext || (m.is_file() && has_gguf_magic(path)),
    }
}

fn has_gguf_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path).is_ok_and(|mut f| f.read_exact(&mut magic).is_ok())
        && &magic == b"GGUF"
}

/// Checks that `path` can name a safetensors checkpoint directory before its files are read, so that a typo or a
/// file of another kind is named as such rather than as a missing `config.json`.
///
/// Errors: [`ModelError::Io`] for a path that does not exist; [`ModelError::NotAModel`] for one that is not a
/// directory holding config.json (a file that is not GGUF, a FIFO, an empty directory).
pub(crate) fn check_checkpoint_dir(path: &Path) -> Result<()> {
    if let Err(e) = std::fs::metadata(path) {
        return Err(ModelError::io(path, e));
    }
    if path.is_dir() && path.join("config.json").exists() {
        Ok(())
    } else {
        Err(ModelError::NotAModel(path.to_path_buf()))
    }
}

impl Checkpoint {
    /// Opens a safetensors checkpoint directory ([`SafetensorsCheckpoint::open`]) or, when [`is_gguf`], a GGUF
    /// model ([`crate::gguf::GgufFile::open`]).
    ///
    /// Errors: those of the two openers; [`ModelError::UnsupportedArchitecture`] for a GGUF of another
    /// architecture.
    pub fn open(path: &Path) -> Result<Self> {
        let inner = if is_gguf(path) {
            Inner::Gguf(Box::new(GgufCheckpoint::open(path)?))
        } else {
            Inner::Safetensors(SafetensorsCheckpoint::open(path)?)
        };
        Ok(Checkpoint { inner })
    }

    /// Whether the weights come from a GGUF file.
    pub fn is_gguf(&self) -> bool {
        matches!(self.inner, Inner::Gguf(_))
    }

    /// The path opened (a directory, or the GGUF file).
    pub fn dir(&self) -> &Path {
        match &self.inner {
            Inner::Safetensors(s) => s.dir(),
            Inner::Gguf(g) => g.path(),
        }
    }

    /// Whether a tensor of this (Hugging Face) name exists.
    pub fn contains(&self, name: &str) -> bool {
        match &self.inner {
            Inner::Safetensors(s) => s.contains(name),
            Inner::Gguf(g) => g.contains(name),
        }
    }

    /// A tensor's name as the file stores it, for messages: the Hugging Face name for safetensors, the GGUF name
    /// (`blk.0.ffn_gate.weight`) for GGUF.
    pub fn stored_name(&self, name: &str) -> String {
        match &self.inner {
            Inner::Safetensors(_) => name.to_string(),
            Inner::Gguf(g) => g.stored_name(name),
        }
    }

    /// All tensor names the model can ask for (Hugging Face names), sorted.
    pub fn names(&self) -> Vec<&str> {
        match &self.inner {
            Inner::Safetensors(s) => s.names(),
            Inner::Gguf(g) => g.names(),
        }
    }

    /// Shape of a tensor in Hugging Face's convention (`[rows, cols]` for a matrix).
    ///
    /// Errors: [`ModelError::MissingTensor`].
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        match &self.inner {
            Inner::Safetensors(s) => s.shape(name).map(<[usize]>::to_vec),
            Inner::Gguf(g) => g.shape(name),
        }
    }

    /// Checks a tensor's shape (Hugging Face's convention) against `expected`, as the reads do.
    ///
    /// Errors: [`ModelError::MissingTensor`]; [`ModelError::ShapeMismatch`] naming the tensor as the file stores it
    /// (a GGUF's name and dims in its order).
    pub fn check_shape(&self, name: &str, expected: &[usize]) -> Result<()> {
        match &self.inner {
            Inner::Safetensors(s) => s.check_shape(name, expected),
            Inner::Gguf(g) => g.check_shape(name, expected),
        }
    }

    /// A tensor's stored dtype. Errors: [`ModelError::MissingTensor`].
    pub fn dtype(&self, name: &str) -> Result<StoredDtype> {
        match &self.inner {
            Inner::Safetensors(s) => s.dtype(name).map(|d| match d {
                ::safetensors::Dtype::F32 => StoredDtype::F32,
                ::safetensors::Dtype::F16 => StoredDtype::F16,
                ::safetensors::Dtype::BF16 => StoredDtype::BF16,
                other => StoredDtype::Other(format!("{other:?}")),
            }),
            Inner::Gguf(g) => g.dtype(name),
        }
    }

    /// Raw stored bytes of a tensor and its dtype. Errors: [`ModelError::MissingTensor`]; a corrupt-file error if
    /// the bytes lie outside the file.
    pub fn raw(&self, name: &str) -> Result<(StoredDtype, &[u8])> {
        let dtype = self.dtype(name)?;
        let bytes = match &self.inner {
            Inner::Safetensors(s) => s.raw(name)?.1,
            Inner::Gguf(g) => g.raw(name)?,
        };
        Ok((dtype, bytes))
    }

    /// Stored size of a tensor's data (bytes). Errors: [`ModelError::MissingTensor`].
    pub fn stored_bytes(&self, name: &str) -> Result<usize> {
        match &self.inner {
            Inner::Safetensors(s) => s.stored_bytes(name),
            Inner::Gguf(g) => g.stored_bytes(name),
        }
    }

    /// The file holding a tensor. Errors: [`ModelError::MissingTensor`].
    pub fn shard_path(&self, name: &str) -> Result<&Path> {
        match &self.inner {
            Inner::Safetensors(s) => s.shard_path(name),
            Inner::Gguf(g) => g.shard_path(name),
        }
    }

    /// Passes a tensor's stored bytes to `f` in pieces of at most `chunk` bytes read with positional reads, so
    /// they never become resident in this process (see [`SafetensorsCheckpoint::read_chunks`]).
    ///
    /// Errors: [`ModelError::MissingTensor`]; [`ModelError::Io`] when a read fails.
    pub fn read_chunks(&self, name: &str, chunk: usize, f: impl FnMut(&[u8])) -> Result<()> {
        match &self.inner {
            Inner::Safetensors(s) => s.read_chunks(name, chunk, f),
            Inner::Gguf(g) => g.read_chunks(name, chunk, f),
        }
    }

    /// Reads a tensor as f32 as stored ([`VectorKind::Plain`]), checking its shape against `expected`.
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`].
    pub fn read_f32(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        self.read_vector(name, expected, VectorKind::Plain)
    }

    /// Reads a tensor as the f32 values the model computes with (see [`VectorKind`]), checking its shape against
    /// `expected` (Hugging Face's shape).
    ///
    /// Errors: as [`Checkpoint::read_f32`].
    pub fn read_vector(
        &self,
        name: &str,
        expected: &[usize],
        kind: VectorKind,
    ) -> Result<Vec<f32>> {
        match &self.inner {
            Inner::Safetensors(s) => {
                let mut v = s.read_f32(name, expected)?;
                match kind {
                    VectorKind::Plain => {}
                    // as transformers computes it: `1.0 + weight.float()`
                    VectorKind::NormGain => v.iter_mut().for_each(|w| *w += 1.0),
                    VectorKind::NegExp => v.iter_mut().for_each(|a| *a = -a.exp()),
                }
                Ok(v)
            }
            // stored folded by the converter: read as is
            Inner::Gguf(g) => g.read_f32(name, expected),
        }
    }

    /// A 2-D weight tensor as stored (no copy), checking its shape against `[rows, cols]`.
    ///
    /// Errors: [`ModelError::MissingTensor`], [`ModelError::ShapeMismatch`], [`ModelError::UnsupportedDtype`].
    pub fn weight_part(&self, name: &str, rows: usize, cols: usize) -> Result<WeightPart<'_>> {
        match &self.inner {
            Inner::Safetensors(s) => s.weight_part(name, rows, cols).map(WeightPart::Dense),
            Inner::Gguf(g) => g.weight_part(name, rows, cols),
        }
    }

    /// Drops the mapped pages of a tensor already copied out from resident memory (see
    /// [`SafetensorsCheckpoint::release`]).
    pub fn release(&self, name: &str) {
        match &self.inner {
            Inner::Safetensors(s) => s.release(name),
            Inner::Gguf(g) => g.release(name),
        }
    }

    /// The files holding the model's tensors (each shard or GGUF part once, in path order) and their sizes in bytes
    /// (file sizes: headers and padding included).
    ///
    /// Errors: [`ModelError::Io`] when a file's size cannot be read.
    pub fn files(&self) -> Result<Vec<(std::path::PathBuf, u64)>> {
        let mut paths: Vec<&Path> = self
            .names()
            .into_iter()
            .map(|n| self.shard_path(n))
            .collect::<Result<_>>()?;
        paths.sort();
        paths.dedup();
        paths
            .into_iter()
            .map(|p| {
                let len = std::fs::metadata(p)
                    .map_err(|e| ModelError::io(p, e))?
                    .len();
                Ok((p.to_path_buf(), len))
            })
            .collect()
    }

    /// Sum of the stored sizes of all tensors (bytes).
    pub fn total_bytes(&self) -> usize {
        match &self.inner {
            Inner::Safetensors(s) => s.total_bytes(),
            Inner::Gguf(g) => g.total_bytes(),
        }
    }
}

/// The dense dtype of a stored dtype, if it is one.
pub(crate) fn dense_dtype(d: &StoredDtype) -> Option<WeightDtype> {
    match d {
        StoredDtype::F32 => Some(WeightDtype::F32),
        StoredDtype::F16 => Some(WeightDtype::F16),
        StoredDtype::BF16 => Some(WeightDtype::Bf16),
        _ => None,
    }
}

/// The error for a tensor stored in a dtype the load cannot use.
pub(crate) fn unsupported(name: &str, d: &StoredDtype) -> ModelError {
    ModelError::UnsupportedDtype {
        name: name.to_string(),
        dtype: match d {
            StoredDtype::Quant(q) => q.name().to_string(),
            StoredDtype::Other(s) => s.clone(),
            other => format!("{other:?}"),
        },
    }
}
