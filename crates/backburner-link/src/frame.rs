//! Frame headers and message kinds. A frame is a 24-byte header, a control section (a postcard-encoded struct), a
//! tensor section (raw little-endian numbers) and, after the handshake, a 16-byte authentication tag. See
//! docs/PROTOCOL.md §2 for the byte layout and [`crate::codec`] for encoding and decoding.

use crate::error::LinkError;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"BBLK";
/// The protocol version this build speaks. Peers must match exactly (see docs/PROTOCOL.md, "Versioning").
pub const PROTOCOL_VERSION: u16 = 8;
/// Header length in bytes: magic (4) | version u16 | kind u16 | control length u32 | tensor length u32 | session u64.
pub const HEADER_LEN: usize = 24;
/// Largest control section accepted (bytes); control structs are small.
pub const MAX_CONTROL: usize = 64 << 10;
/// Default bound on a frame's tensor section (bytes): 1 GiB.
pub const DEFAULT_MAX_TENSOR: usize = 1 << 30;

/// Message kinds (u16 on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// host → worker: the host's nonce.
    Hello = 1,
    /// worker → host: the worker's nonce and what it offers.
    Challenge = 2,
    /// host → worker: MAC over the transcript and the session parameters.
    Auth = 3,
    /// worker → host: the worker's MAC over the whole transcript, the session id and the worker's limits.
    Welcome = 4,
    /// either way: a typed error; the sender closes the connection after it.
    Error = 5,
    /// host → worker: round-trip probe (any payload).
    Ping = 6,
    /// worker → host: the ping's payload echoed.
    Pong = 7,
    /// host → worker: bring the mirror to the host's state (truncate, KV rows, linear states).
    Sync = 8,
    /// worker → host: sync applied.
    SyncDone = 9,
    /// host → worker: run the worker's layers on a residual stream.
    RunLayers = 10,
    /// worker → host: layers run (timing).
    LayersDone = 11,
    /// host → worker: send back the rows and states produced since a position.
    Fetch = 12,
    /// worker → host: the rows and states.
    FetchDone = 13,
    /// host → worker: forget the mirror.
    Reset = 14,
    /// worker → host: mirror cleared.
    ResetDone = 15,
    /// host → worker: whole KV pages of every full-attention layer to hold (KV offload).
    PagesPut = 16,
    /// worker → host: pages stored or dropped; what the session's store holds now.
    PagesDone = 17,
    /// worker → host: the pages of a `PagesPut` do not fit the worker's memory; nothing was stored, the session goes
    /// on.
    PagesFull = 18,
    /// host → worker: drop the pages at or past a position.
    PagesDrop = 19,
    /// host → worker: queries of one full-attention layer to attend over the pages held.
    Attend = 20,
    /// worker → host: the attention partials (normalized output and log-sum-exp) over the pages held.
    Partials = 21,
    /// host → worker: go back to a position, restoring the checkpoint kept there (layer split).
    Rewind = 22,
    /// worker → host: whether the rewind took place.
    RewindDone = 23,
    /// host → worker: rows and segments of one MoE layer for the routed experts the worker holds.
    Experts = 24,
    /// worker → host: one vector per segment.
    ExpertsDone = 25,
}

impl Kind {
    /// Whether frames of this kind may carry a tensor section.
    pub fn has_tensor(self) -> bool {
        matches!(
            self,
            Kind::Ping
                | Kind::Pong
                | Kind::Sync
                | Kind::RunLayers
                | Kind::LayersDone
                | Kind::FetchDone
                | Kind::PagesPut
                | Kind::Attend
                | Kind::Partials
                | Kind::Experts
                | Kind::ExpertsDone
        )
    }
}

impl TryFrom<u16> for Kind {
    type Error = LinkError;
    fn try_from(v: u16) -> Result<Self, LinkError> {
        use Kind::*;
        const ALL: [Kind; 25] = [
            Hello,
            Challenge,
            Auth,
            Welcome,
            Error,
            Ping,
            Pong,
            Sync,
            SyncDone,
            RunLayers,
            LayersDone,
            Fetch,
            FetchDone,
            Reset,
            ResetDone,
            PagesPut,
            PagesDone,
            PagesFull,
            PagesDrop,
            Attend,
            Partials,
            Rewind,
            RewindDone,
            Experts,
            ExpertsDone,
        ];
        ALL.into_iter()
            .find(|k| *k as u16 == v)
            .ok_or(LinkError::UnknownKind(v))
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Message kind.
    pub kind: Kind,
    /// Control section length (bytes), ≤ [`MAX_CONTROL`].
    pub control_len: u32,
    /// Tensor section length (bytes), ≤ the receiver's bound.
    pub tensor_len: u32,
    /// Session id (0 during the handshake; the worker's id from `Welcome` afterwards).
    pub session: u64,
}

impl Header {
    /// The 24 header bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&(self.kind as u16).to_le_bytes());
        h[8..12].copy_from_slice(&self.control_len.to_le_bytes());
        h[12..16].copy_from_slice(&self.tensor_len.to_le_bytes());
        h[16..24].copy_from_slice(&self.session.to_le_bytes());
        h
    }

    /// Parses and validates a header before anything is read or allocated for the body: magic, version, kind,
    /// control length ≤ [`MAX_CONTROL`], tensor length ≤ `max_tensor` and 0 for kinds without a tensor section.
    ///
    /// Errors: [`LinkError::BadMagic`], [`LinkError::VersionMismatch`], [`LinkError::UnknownKind`],
    /// [`LinkError::FrameTooLarge`], [`LinkError::Malformed`] (tensor bytes on a kind that has none).
    pub fn decode(h: &[u8; HEADER_LEN], max_tensor: usize) -> Result<Header, LinkError> {
        if h[..4] != MAGIC {
            return Err(LinkError::BadMagic([h[0], h[1], h[2], h[3]]));
        }
        let version = u16::from_le_bytes([h[4], h[5]]);
        if version != PROTOCOL_VERSION {
            return Err(LinkError::VersionMismatch {
                ours: PROTOCOL_VERSION,
                theirs: version,
            });
        }
        let kind = Kind::try_from(u16::from_le_bytes([h[6], h[7]]))?;
        let control_len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        let tensor_len = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        let session = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        let too_large = |len: u32, max: usize| LinkError::FrameTooLarge {
            len: len as usize,
            max,
        };
        if control_len as usize > MAX_CONTROL {
            return Err(too_large(control_len, MAX_CONTROL));
        }
        if tensor_len as usize > max_tensor {
            return Err(too_large(tensor_len, max_tensor));
        }
        if tensor_len > 0 && !kind.has_tensor() {
            return Err(LinkError::Malformed(format!(
                "{kind:?} carries no tensor section, got {tensor_len} bytes"
            )));
        }
        Ok(Header {
            kind,
            control_len,
            tensor_len,
            session,
        })
    }

    /// Control plus tensor bytes.
    pub fn body_len(&self) -> usize {
        self.control_len as usize + self.tensor_len as usize
    }
}

/// A received frame, its body already authenticated (after the handshake) and decrypted.
#[derive(Debug)]
pub struct Frame {
    /// The header as received.
    pub header: Header,
    /// Control section (postcard bytes).
    pub control: Vec<u8>,
    /// Tensor section (raw little-endian values).
    pub tensor: Vec<u8>,
}

impl Frame {
    /// Message kind.
    pub fn kind(&self) -> Kind {
        self.header.kind
    }

    /// Decodes the control section as `T`, refusing trailing bytes. Errors: [`LinkError::Malformed`].
    pub fn control<T: serde::de::DeserializeOwned>(&self) -> Result<T, LinkError> {
        crate::codec::decode_control(self.header.kind, &self.control)
    }
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() * 4);
    for v in x {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Little-endian bytes as f32 values. Errors: [`LinkError::Malformed`] if the length is not a multiple of 4.
pub fn bytes_f32(b: &[u8]) -> Result<Vec<f32>, LinkError> {
    if !b.len().is_multiple_of(4) {
        return Err(LinkError::Malformed(format!(
            "{} tensor bytes is not a whole number of f32",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}
