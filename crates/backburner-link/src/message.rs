//! Control structs of each message kind (postcard-encoded in the control section).

use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;

/// `Hello` (host → worker).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The host's random nonce for this connection.
    pub host_nonce: [u8; 32],
}

/// `Challenge` (worker → host).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Challenge {
    /// The worker's random nonce for this connection.
    pub worker_nonce: [u8; 32],
    /// The worker's compute threads (the host balances its split point with them).
    pub threads: u32,
    /// The layer range the worker was started with (`--layers`), if fixed.
    pub layers: Option<(u32, u32)>,
}

/// What the host asks the worker to be, checked in the handshake.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionParams {
    /// Fingerprint of the model: config and the weights of layers `layer_start..layer_end` (see `fingerprint`).
    pub fingerprint: [u8; 32],
    /// Decoder layers in the model.
    pub n_layers: u32,
    /// First layer the worker runs (L).
    pub layer_start: u32,
    /// One past the last layer the worker runs (n).
    pub layer_end: u32,
    /// Width of the residual stream.
    pub hidden: u32,
    /// KV cache dtype: 0 = f16, 1 = f32.
    pub kv_dtype: u8,
    /// KV page size (positions).
    pub kv_page_size: u32,
    /// Largest ubatch the host sends (tokens).
    pub ubatch: u32,
}

/// `Auth` (host → worker).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Auth {
    /// HMAC-SHA256(key, "bb-host" ‖ worker_nonce ‖ host_nonce ‖ postcard(params)).
    pub mac: [u8; 32],
    /// The session parameters.
    pub params: SessionParams,
}

/// `Welcome` (worker → host).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// HMAC-SHA256(key, "bb-worker" ‖ host_nonce ‖ worker_nonce).
    pub mac: [u8; 32],
    /// Compute threads of the worker.
    pub threads: u32,
    /// The worker's state memory budget (bytes; 0 = unlimited).
    pub max_memory: u64,
}

/// `Error` (either way).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorMsg {
    /// The code.
    pub code: ErrorCode,
    /// Human-readable detail.
    pub message: String,
}

/// `Sync` (host → worker). Tensor section: for each attention layer of the range in order, K rows then V rows of
/// positions `[truncate_to, pos_after)` (`[n, n_kv_heads, head_dim]` in the KV dtype), then if `linear` for each linear
/// layer in order its conv state `[conv_dim, kernel-1]` f32 and recurrent state `[n_v_heads, d_k, d_v]` f32.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sync {
    /// Truncate the mirror's KV to this many positions first (the watermark, lowered by any host edit).
    pub truncate_to: u64,
    /// Mirror position after the sync.
    pub pos_after: u64,
    /// Whether linear states follow.
    pub linear: bool,
}

/// `RunLayers` (host → worker). Tensor section: the residual stream entering layer L, `[n_tokens, hidden]` f32.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLayers {
    /// Position of the first token (must equal the mirror's position).
    pub pos: u64,
    /// Tokens in this ubatch.
    pub n_tokens: u32,
}

/// `LayersDone` (worker → host).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayersDone {
    /// Mirror position after the ubatch.
    pub pos_after: u64,
    /// Worker compute time for the ubatch (µs).
    pub compute_us: u64,
    /// Time the worker waited for this request after finishing the previous one (µs): the pipeline bubble.
    pub idle_us: u64,
}

/// `Fetch` (host → worker): send KV rows `[from_pos, to_pos)` and, if `linear`, the linear states (as of the mirror's
/// position). A host fetches a long range in several requests to stay under the frame bound.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fetch {
    /// First position to return.
    pub from_pos: u64,
    /// One past the last position to return (at most the mirror's position).
    pub to_pos: u64,
    /// Include the linear states.
    pub linear: bool,
}

/// `FetchDone` (worker → host). Tensor section: as `Sync`'s, for positions `[from_pos, to_pos)`, with the linear
/// states if the `Fetch` asked for them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchDone {
    /// First position returned.
    pub from_pos: u64,
    /// One past the last position returned.
    pub to_pos: u64,
}

/// An empty control section (`Ping`, `Pong`, `SyncDone`, `Reset`, `ResetDone`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Empty {}
