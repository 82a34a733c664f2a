//! Frames: a 16-byte header followed by a control section (postcard-encoded struct) and a raw tensor section
//! (little-endian). See docs/PROTOCOL.md for the byte layout.

use std::io::{Read, Write};

use crate::error::LinkError;

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"BBLK";
/// The protocol version this build speaks. Peers must match exactly (see docs/PROTOCOL.md, "Versioning").
pub const PROTOCOL_VERSION: u16 = 1;
/// Header length in bytes: magic (4) | version u16 | kind u16 | control length u32 | tensor length u32.
pub const HEADER_LEN: usize = 16;
/// Largest control section accepted (bytes); control structs are small.
pub const MAX_CONTROL: usize = 64 << 10;
/// Default bound on a frame's tensor section (bytes): 1 GiB.
pub const DEFAULT_MAX_TENSOR: usize = 1 << 30;

/// Message kinds (u16 on the wire).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Kind {
    /// host → worker: the host's nonce (the protocol version is in every header).
    Hello = 1,
    /// worker → host: the worker's nonce.
    Challenge = 2,
    /// host → worker: MAC over both nonces and the session parameters.
    Auth = 3,
    /// worker → host: the worker's MAC (mutual authentication) and its description.
    Welcome = 4,
    /// worker → host: a typed error; the worker closes the connection after it.
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
}

impl TryFrom<u16> for Kind {
    type Error = LinkError;
    fn try_from(v: u16) -> Result<Self, LinkError> {
        use Kind::*;
        Ok(match v {
            1 => Hello,
            2 => Challenge,
            3 => Auth,
            4 => Welcome,
            5 => Error,
            6 => Ping,
            7 => Pong,
            8 => Sync,
            9 => SyncDone,
            10 => RunLayers,
            11 => LayersDone,
            12 => Fetch,
            13 => FetchDone,
            14 => Reset,
            15 => ResetDone,
            other => return Err(LinkError::UnknownKind(other)),
        })
    }
}

/// A received frame.
#[derive(Debug)]
pub struct Frame {
    /// Message kind.
    pub kind: Kind,
    /// Control section (postcard bytes).
    pub control: Vec<u8>,
    /// Tensor section (raw little-endian values).
    pub tensor: Vec<u8>,
}

impl Frame {
    /// Total bytes on the wire.
    pub fn wire_len(&self) -> usize {
        HEADER_LEN + self.control.len() + self.tensor.len()
    }

    /// Decodes the control section as `T`. Errors: [`LinkError::Malformed`].
    pub fn control<T: serde::de::DeserializeOwned>(&self) -> Result<T, LinkError> {
        postcard::from_bytes(&self.control)
            .map_err(|e| LinkError::Malformed(format!("{:?} control section: {e}", self.kind)))
    }
}

/// Writes one frame; returns the bytes written. The control struct is encoded with postcard; `tensor` is written as
/// is (no copy).
pub fn write_frame<T: serde::Serialize>(
    w: &mut impl Write,
    kind: Kind,
    control: &T,
    tensor: &[u8],
) -> Result<usize, LinkError> {
    let ctl = postcard::to_stdvec(control).map_err(|e| LinkError::Malformed(e.to_string()))?;
    if ctl.len() > MAX_CONTROL {
        return Err(LinkError::FrameTooLarge {
            len: ctl.len(),
            max: MAX_CONTROL,
        });
    }
    let tlen = u32::try_from(tensor.len()).map_err(|_| LinkError::FrameTooLarge {
        len: tensor.len(),
        max: u32::MAX as usize,
    })?;
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h[6..8].copy_from_slice(&(kind as u16).to_le_bytes());
    h[8..12].copy_from_slice(&(ctl.len() as u32).to_le_bytes());
    h[12..16].copy_from_slice(&tlen.to_le_bytes());
    w.write_all(&h)?;
    w.write_all(&ctl)?;
    w.write_all(tensor)?;
    w.flush()?;
    Ok(HEADER_LEN + ctl.len() + tensor.len())
}

/// Reads one frame, validating the header before reading (and allocating for) the body.
///
/// Errors: [`LinkError::Closed`] on a clean EOF before a header, [`LinkError::BadMagic`],
/// [`LinkError::VersionMismatch`], [`LinkError::UnknownKind`], [`LinkError::FrameTooLarge`] (control section over
/// [`MAX_CONTROL`] or tensor section over `max_tensor`), [`LinkError::Timeout`] / [`LinkError::Io`].
pub fn read_frame(r: &mut impl Read, max_tensor: usize) -> Result<Frame, LinkError> {
    let mut h = [0u8; HEADER_LEN];
    let mut got = 0;
    while got < HEADER_LEN {
        match r.read(&mut h[got..]) {
            Ok(0) if got == 0 => return Err(LinkError::Closed),
            Ok(0) => {
                return Err(LinkError::Malformed(format!(
                    "connection closed inside a header ({got} of {HEADER_LEN} bytes)"
                )))
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
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
    let clen = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    let tlen = u32::from_le_bytes([h[12], h[13], h[14], h[15]]) as usize;
    if clen > MAX_CONTROL {
        return Err(LinkError::FrameTooLarge {
            len: clen,
            max: MAX_CONTROL,
        });
    }
    if tlen > max_tensor {
        return Err(LinkError::FrameTooLarge {
            len: tlen,
            max: max_tensor,
        });
    }
    let mut control = vec![0u8; clen];
    r.read_exact(&mut control)?;
    let mut tensor = vec![0u8; tlen];
    r.read_exact(&mut tensor)?;
    Ok(Frame {
        kind,
        control,
        tensor,
    })
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
