//! Control structs of each message kind (postcard-encoded in the control section) and the typed requests a worker
//! receives. Every integer is as wide on the wire as the value it carries (no truncation on either side).

use serde::{Deserialize, Serialize};

use crate::codec::decode_control;
use crate::error::{ErrorCode, LinkError};
use crate::frame::{Frame, Kind};

/// KV cache storage dtype (postcard: varint variant index, 0 = f16, 1 = f32; any other index fails to decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WireKvDtype {
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
}

/// `Hello` (host → worker).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Hello {
    /// The host's random nonce for this connection.
    pub host_nonce: [u8; 32],
}

/// What a worker accepts per request, announced in `Challenge` and `Welcome`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLimits {
    /// Most tokens in one `RunLayers` (the host's ubatch must not exceed it).
    pub max_ubatch: u32,
    /// Most tensor bytes in one frame.
    pub max_frame: u64,
    /// The worker's state memory budget (bytes) shared by all its sessions.
    pub max_memory: u64,
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
    /// What the worker accepts.
    pub limits: WorkerLimits,
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
    /// KV cache dtype.
    pub kv_dtype: WireKvDtype,
    /// KV page size (positions).
    pub kv_page_size: u64,
    /// Largest ubatch the host sends (tokens).
    pub ubatch: u32,
}

/// `Auth` (host → worker).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Auth {
    /// HMAC-SHA256(secret, "bb2-host" ‖ th(Hello, Challenge) ‖ postcard(params)).
    pub mac: [u8; 32],
    /// The session parameters.
    pub params: SessionParams,
}

/// `Welcome` (worker → host).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Welcome {
    /// HMAC-SHA256(secret, "bb2-worker" ‖ th(Hello, Challenge, Auth) ‖ session ‖ threads ‖ limits), fixed-width LE.
    pub mac: [u8; 32],
    /// The session id every later frame header carries (never 0).
    pub session: u64,
    /// Compute threads of the worker.
    pub threads: u32,
    /// What the worker accepts.
    pub limits: WorkerLimits,
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

/// A request as the worker receives it after the handshake, decoded and typed.
#[derive(Clone, Debug, PartialEq)]
pub enum Request {
    /// Echo the payload.
    Ping(Vec<u8>),
    /// Bring the mirror to the host's state; the payload is the state rows.
    Sync(Sync, Vec<u8>),
    /// Run the layers on a residual stream (`[n_tokens, hidden]` f32 bytes).
    RunLayers(RunLayers, Vec<u8>),
    /// Send back rows and states.
    Fetch(Fetch),
    /// Forget the mirror.
    Reset,
}

impl Request {
    /// Decodes a session frame into a request. Errors: [`LinkError::Malformed`] for a control section that does not
    /// decode exactly, [`LinkError::Unexpected`] for a kind that is not a request.
    pub fn decode(f: Frame) -> Result<Request, LinkError> {
        let k = f.kind();
        Ok(match k {
            Kind::Ping => {
                decode_control::<Empty>(k, &f.control)?;
                Request::Ping(f.tensor)
            }
            Kind::Sync => Request::Sync(decode_control(k, &f.control)?, f.tensor),
            Kind::RunLayers => Request::RunLayers(decode_control(k, &f.control)?, f.tensor),
            Kind::Fetch => Request::Fetch(decode_control(k, &f.control)?),
            Kind::Reset => {
                decode_control::<Empty>(k, &f.control)?;
                Request::Reset
            }
            other => {
                return Err(LinkError::Unexpected {
                    expected: "a request (Ping, Sync, RunLayers, Fetch, Reset)",
                    got: other,
                })
            }
        })
    }
}
