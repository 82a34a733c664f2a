//! Typed errors for checkpoint loading and the model.

use std::path::PathBuf;

/// Every way loading or running a checkpoint can fail. Each variant names the offending file, tensor or field so a
/// user can act on the message alone.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A file could not be opened or read.
    #[error("cannot read {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file (config, index, tokenizer config) is not valid JSON or lacks a required field.
    #[error("invalid JSON in {path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What the parser said, with line and column.
        message: String,
    },
    /// `model_type` is not one this engine runs.
    #[error("unsupported model_type {found:?}; supported: {}", supported.join(", "))]
    UnsupportedModelType {
        /// The `model_type` found in config.json.
        found: String,
        /// The model types this build supports.
        supported: Vec<&'static str>,
    },
    /// A known model family that a later release will support.
    #[error("model_type {0:?} (mixture-of-experts hybrid) is not yet supported; supported: qwen3_5_text, qwen3_5")]
    NotYetSupported(String),
    /// The config is well-formed JSON but describes an impossible model.
    #[error("invalid config: {0}")]
    InvalidConfig(String),
    /// A device holding some of the model failed (memory, the driver) or cannot run what it was given.
    #[error("device: {0}")]
    Device(#[from] crate::device::DeviceError),
    /// A tensor the architecture needs is absent from every shard.
    #[error("missing tensor {name:?} in checkpoint {dir}")]
    MissingTensor {
        /// The checkpoint name of the tensor (as stored on disk).
        name: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A tensor has the wrong shape for the config.
    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The checkpoint name of the tensor.
        name: String,
        /// The shape the config implies, in the file's order (safetensors: Hugging Face's `[rows, cols]`; GGUF:
        /// `ne[0]` first, as llama.cpp prints it).
        expected: Vec<usize>,
        /// The shape on disk, in the same order.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype we cannot convert to f32.
    #[error("tensor {name:?} has unsupported dtype {dtype}; supported: F32, BF16, F16 and the GGUF block formats Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K–Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, TQ2_0, MXFP4")]
    UnsupportedDtype {
        /// The checkpoint name of the tensor.
        name: String,
        /// The stored dtype.
        dtype: String,
    },
    /// A safetensors file is truncated, has a corrupt header, or its index points at a missing file.
    #[error("corrupt safetensors file {path}: {message}")]
    CorruptSafetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A GGUF file is truncated or malformed (its header, metadata, tensor table or split metadata).
    #[error("corrupt GGUF file {path}: {message}")]
    CorruptGguf {
        /// The file (the part of a split set at fault).
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// A GGUF path does not name one model: a directory with no `.gguf` file or several, or one part of a split set
    /// whose name does not lead to the others.
    #[error("cannot open a GGUF model at {path}: {message}")]
    GgufPath {
        /// The path given.
        path: PathBuf,
        /// Why.
        message: String,
    },
    /// A GGUF file's `general.architecture` is not one this engine runs.
    #[error("{}; supported: {}", architecture_problem(found, *not_yet), supported.join(", "))]
    UnsupportedArchitecture {
        /// `general.architecture` as found (empty when the key is absent).
        found: String,
        /// The architectures this build loads.
        supported: Vec<&'static str>,
        /// Whether it is a family member a later release will run.
        not_yet: bool,
    },
    /// `--model` names neither a checkpoint directory nor a GGUF model.
    #[error("{0} is neither a checkpoint directory (config.json + *.safetensors) nor a GGUF file (or a directory holding one)")]
    NotAModel(PathBuf),
    /// The directory has no weights at all.
    #[error("no model.safetensors or model.safetensors.index.json in {0}")]
    NoWeights(PathBuf),
    /// The tokenizer produces ids the model has no embedding for.
    #[error(
        "tokenizer vocabulary ({tokenizer} ids) does not fit the model's vocab_size ({model})"
    )]
    VocabMismatch {
        /// Largest token id + 1 in the tokenizer.
        tokenizer: usize,
        /// `vocab_size` of the model.
        model: usize,
    },
    /// The tokenizer file could not be loaded or used.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    /// A chat request is malformed (a message without a role, tool-call arguments that are not JSON, …) or the chat
    /// template rejects the conversation (its `raise_exception`, reported with field `messages`). The caller's
    /// fault: a server answers it with HTTP 400.
    #[error("invalid chat request: {field}: {message}")]
    InvalidChatRequest {
        /// Where in the request, e.g. `messages[2].tool_calls[0].function.arguments`.
        field: String,
        /// What is wrong with it.
        message: String,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.into(),
            source,
        }
    }
}

/// What is wrong with a GGUF file's `general.architecture` value `found` (empty when the key is absent).
fn architecture_problem(found: &str, not_yet: bool) -> String {
    if found.is_empty() {
        "the GGUF file has no general.architecture (string) key".to_string()
    } else if not_yet {
        format!("GGUF architecture {found:?} (a mixture-of-experts hybrid) is not yet supported")
    } else {
        format!("GGUF architecture {found:?} is not supported")
    }
}
