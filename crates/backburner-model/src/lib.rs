//! Qwen3.5-family hybrid decoder (Gated DeltaNet + gated full attention): config, checkpoint loading, per-layer
//! state kept outside the layers, and a forward pass over any layer range on a residual stream
//! `[n_tokens, hidden]`.
#![warn(missing_docs)]

pub mod arch;
pub mod chat;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
pub mod fingerprint;
pub mod fsutil;
pub mod gguf;
pub mod linear;
pub mod model;
pub mod ops;
pub mod remote;
pub mod remote_experts;
pub mod state;
pub mod synthetic;
pub mod tokenizer;

pub use backburner_kernels::matmul::Precision;
pub use chat::{
    parse_output, prompt_opens_reasoning, ChatDelta, ChatOutputParser, ChatRequest, ChatTemplate,
    ParsedOutput, ToolCall,
};
pub use checkpoint::Checkpoint;
pub use config::{FfnKind, LayerKind, ModelConfig, MoeConfig, VHeadOrder, WeightLayout};
pub use error::{ModelError, Result};
pub use fingerprint::fingerprint;
pub use gguf::{config_from_gguf, GgufFile};
pub use linear::{Linear, LinearPart};
pub use model::{
    experts_bytes, load_bytes, load_bytes_without, ExpertStore, LoadOptions, Model, Mtp, MtpState,
    GDN_CHUNK,
};
pub use remote::{RemoteError, RemotePages};
pub use remote_experts::{HolderAsk, RemoteExperts, Segment};
pub use state::{KvOptions, LayerState, LinearState, ModelState, PageStore, StateSnapshot};
pub use tokenizer::{ChatMessage, TextEncoder, TextTokenizer};
