//! Control structs of each message kind (postcard-encoded in the control section) and the typed requests a worker
//! receives. Every integer is as wide on the wire as the value it carries (no truncation on either side).

use serde::{Deserialize, Serialize};

use crate::codec::decode_control;
use crate::error::{ErrorCode, LinkError};
use crate::frame::{Frame, Kind};

/// KV cache storage dtype (postcard: varint variant index, 0 = f16, 1 = f32, 2 = bf16; any other index fails to
/// decode). New dtypes are appended: the indices of the others never change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum WireKvDtype {
    /// IEEE binary16.
    F16,
    /// IEEE binary32.
    F32,
    /// bfloat16 (pages in the pair layouts of docs/PROTOCOL.md §5.11).
    Bf16,
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
    /// Layer split: the worker holds the only copy of layers `layer_start..layer_end` (any non-empty range of the
    /// model, on any layer boundary) and every `LayersDone` carries the residual stream leaving `layer_end`.
    /// `false`: a split-prefill mirror of a tail range `[L, n)` on a layer-cycle seam, whose `LayersDone` carry
    /// no tensor.
    pub layer_split: bool,
    /// Experts on the worker (version 7): non-empty for a session that holds these routed experts (ascending ids)
    /// of every MoE layer in `layer_start..layer_end` and answers `Experts` requests; it runs no layer and holds
    /// no state (`layer_split` is then false).
    pub experts: Vec<u32>,
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

/// Most positions one `RunLayers` may ask the worker to keep checkpoints at.
pub const MAX_KEEP: usize = 16;

/// `RunLayers` (host → worker). Tensor section: the residual stream entering layer L, `[n_tokens, hidden]` f32.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunLayers {
    /// Position of the first token (must equal the mirror's position).
    pub pos: u64,
    /// Tokens in this ubatch.
    pub n_tokens: u32,
    /// Positions in `(pos, pos + n_tokens]` at which the worker keeps an exact checkpoint of its layers' states for a
    /// later `Rewind` (layer split; at most [`MAX_KEEP`], increasing). A position that is not a multiple of 64 rows
    /// from `pos` nor the ubatch's end is not kept, and the worker may drop any checkpoint for memory.
    pub keep: Vec<u64>,
    /// A verify step of speculative decoding (layer split, version 8): every row computed with the bits a one-token
    /// ubatch would give it, and the worker keeps what going back to any prefix needs until its next request. A
    /// `RunLayers` or `Rewind` at a position `p` inside `(pos, pos + n_tokens)` then first drops the positions from
    /// `p` on (the host keeps the accepted prefix), any other request keeps them all. `keep` must be empty.
    pub verify: bool,
}

/// `Rewind` (host → worker, layer split): go back to position `to_pos`, restoring the checkpoint kept there.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rewind {
    /// The position to go back to (at most the mirror's position).
    pub to_pos: u64,
}

/// `RewindDone` (worker → host): whether the mirror is now at `to_pos` (its checkpoint there was restored, or it
/// was there already); if not, nothing changed and the host rebuilds the worker's state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewindDone {
    /// The mirror's position after the request.
    pub pos: u64,
    /// Whether the rewind took place (false: no checkpoint at `to_pos`; the mirror is unchanged).
    pub restored: bool,
}

/// `LayersDone` (worker → host). Tensor section: in a layer-split session the residual stream leaving the worker's
/// last layer, `[n_tokens, hidden]` f32; empty in a split-prefill session.
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

/// `PagesPut` (host → worker, KV offload). Tensor section: for each full-attention layer of the model in layer
/// order, for each of the `n_pages` pages in position order, the page's K storage then its V storage in the block
/// layout (K `[blocks, n_kv_heads, 4, head_dim, 16]`, V `[blocks, n_kv_heads, ceil(head_dim / 16), 64, w]` with
/// `w = 16` but for a narrower last chunk, `blocks = ceil(page_size / 64)`; docs/PROTOCOL.md §5.11) in the
/// session's KV dtype, little-endian. Pages are whole: positions
/// `[first_pos, first_pos + n_pages · page_size)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesPut {
    /// First position of the first page: the end of the session's run (or any page boundary for an empty store).
    pub first_pos: u64,
    /// Pages per layer.
    pub n_pages: u32,
}

/// `PagesDone` (worker → host): the session's store after a `PagesPut` or `PagesDrop`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesDone {
    /// First position held (0 for an empty store).
    pub first_pos: u64,
    /// One past the last position held (equal to `first_pos` for an empty store).
    pub end_pos: u64,
    /// Bytes the store holds against the worker's budget.
    pub bytes: u64,
}

/// `PagesFull` (worker → host): a `PagesPut` that does not fit the worker's memory budget; nothing was stored and
/// the session goes on (the host keeps the pages or places them elsewhere).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesFull {
    /// Bytes the put needed: its pages and, when the session held no page yet, the headroom the worker keeps beside
    /// them for answering `Attend` (docs/PROTOCOL.md §6.4).
    pub needed: u64,
    /// Bytes the worker's budget had free (beside the request's own buffer, when that was reserved).
    pub free: u64,
}

/// `PagesDrop` (host → worker): drop every page at or past `to_pos` (a page boundary; 0 drops all).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagesDrop {
    /// Positions kept: `[first_pos, to_pos)` of the store.
    pub to_pos: u64,
}

/// `Attend` (host → worker). Tensor section: `q`, `[n_tokens, n_heads, head_dim]` f32 (post q-norm and RoPE) at
/// positions `q_pos0..q_pos0 + n_tokens`, every one of them at or past the end of the pages held.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Attend {
    /// The full-attention layer.
    pub layer: u32,
    /// Position of the first query.
    pub q_pos0: u64,
    /// Query tokens.
    pub n_tokens: u32,
    /// Query heads (the model's attention heads).
    pub n_heads: u32,
    /// Score scale (finite, > 0; `head_dim^-0.5` for Qwen3.5).
    pub scale: f32,
    /// One partial per page held (else one partial folded over the pages in order from empty).
    pub per_page: bool,
}

/// `Partials` (worker → host). Tensor section: `n_parts` partials in page order, each `o` `[n_tokens, n_heads,
/// head_dim]` f32 then `lse` `[n_tokens, n_heads]` f32.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Partials {
    /// Partials that follow (1 unless the `Attend` asked for one per page).
    pub n_parts: u32,
    /// Worker compute time (µs).
    pub compute_us: u64,
}

/// `Experts` (host → worker, version 7). Tensor section: the rows `[n_rows, hidden]` f32, then `n_segments`
/// segments, each `row: u32`, `n_pairs: u32` and `n_pairs` × (`expert: u32`, `weight: f32`), little-endian.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Experts {
    /// The MoE layer.
    pub layer: u32,
    /// Rows sent.
    pub n_rows: u32,
    /// Segments that follow the rows.
    pub n_segments: u32,
}

/// `ExpertsDone` (worker → host, version 7). Tensor section: `[n_segments, hidden]` f32, one vector per segment in
/// request order: its pairs' weighted outputs folded from +0.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertsDone {
    /// Vectors that follow.
    pub n_segments: u32,
    /// Worker compute time (µs).
    pub compute_us: u64,
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
    /// Hold whole KV pages; the payload is their storage.
    PagesPut(PagesPut, Vec<u8>),
    /// Drop pages at or past a position.
    PagesDrop(PagesDrop),
    /// Attend queries (`[n_tokens, n_heads, head_dim]` f32 bytes) over the pages held.
    Attend(Attend, Vec<u8>),
    /// Go back to a checkpoint (layer split).
    Rewind(Rewind),
    /// Run the routed experts held on rows and segments (the tensor section's bytes).
    Experts(Experts, Vec<u8>),
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
            Kind::PagesPut => Request::PagesPut(decode_control(k, &f.control)?, f.tensor),
            Kind::PagesDrop => Request::PagesDrop(decode_control(k, &f.control)?),
            Kind::Attend => Request::Attend(decode_control(k, &f.control)?, f.tensor),
            Kind::Rewind => Request::Rewind(decode_control(k, &f.control)?),
            Kind::Experts => Request::Experts(decode_control(k, &f.control)?, f.tensor),
            other => return Err(LinkError::Unexpected {
                expected:
                    "a request (Ping, Sync, RunLayers, Fetch, Reset, PagesPut, PagesDrop, Attend, Rewind, Experts)",
                got: other,
            }),
        })
    }
}
