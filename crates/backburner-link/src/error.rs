//! Link errors.

use serde::{Deserialize, Serialize};

/// Error codes carried by an `Error` frame (postcard varint of the variant index: one byte).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorCode {
    /// The worker already serves another host.
    Busy,
    /// The MAC did not verify: wrong or missing shared secret.
    AuthFailed,
    /// Protocol versions differ.
    VersionMismatch,
    /// The model fingerprints differ (different config or weights).
    ModelMismatch,
    /// The worker cannot serve the requested layer range.
    LayerRangeMismatch,
    /// Another session parameter (KV dtype, page size, ubatch) is unacceptable.
    ParamMismatch,
    /// A frame or message was malformed or out of order.
    Malformed,
    /// The request would exceed the worker's memory budget.
    OutOfMemory,
    /// A request referred to positions the mirror does not have.
    BadState,
    /// Anything else.
    Internal,
    /// The worker dropped this session to make room for another (memory budget) or is shutting down.
    Evicted,
    /// A request did not arrive completely within its deadline.
    Deadline,
}

/// Everything that can go wrong on the link.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// Socket error.
    #[error("link I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// A message did not arrive (or could not be sent) completely within its deadline.
    #[error("link deadline of {0:?} passed")]
    Timeout(std::time::Duration),
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    Closed,
    /// The peer closed the connection (or it was cut) in the middle of a frame.
    #[error("the peer closed the connection inside a frame")]
    Cut,
    /// Not a Backburner frame.
    #[error("bad frame magic {0:02x?}: not a Backburner link peer")]
    BadMagic([u8; 4]),
    /// Protocol versions differ.
    #[error("protocol version mismatch: we speak {ours}, the peer {theirs}")]
    VersionMismatch {
        /// Ours.
        ours: u16,
        /// Theirs.
        theirs: u16,
    },
    /// An unknown message kind.
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// A frame section over its bound.
    #[error("frame section of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Declared length.
        len: usize,
        /// The bound.
        max: usize,
    },
    /// A frame that does not decode or does not fit the protocol state.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// A message other than the one expected.
    #[error("unexpected message {got:?} (expected {expected})")]
    Unexpected {
        /// What was expected.
        expected: &'static str,
        /// What arrived.
        got: crate::frame::Kind,
    },
    /// The peer sent an `Error` frame.
    #[error("worker error {code:?}: {message}")]
    Remote {
        /// The code.
        code: ErrorCode,
        /// The peer's explanation.
        message: String,
    },
    /// A frame after the handshake failed its authentication tag (corrupted, forged, reordered, replayed, or a frame
    /// before it was lost), or carried another session's id.
    #[error("link integrity check failed: {0}")]
    Integrity(String),
    /// This side will not use the peer (no usable split point, a limit of the peer below what this side needs, a
    /// value that does not fit a protocol field); nothing was sent, or the handshake was abandoned.
    #[error("not using the worker: {0}")]
    Refused(String),
    /// The peer's MAC did not verify.
    #[error("authentication failed: {0}")]
    AuthFailed(String),
}

impl LinkError {
    /// Maps socket timeouts to [`LinkError::Timeout`].
    pub fn from_io(e: std::io::Error, timeout: Option<std::time::Duration>) -> Self {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                LinkError::Timeout(timeout.unwrap_or_default())
            }
            _ => LinkError::Io(e),
        }
    }
}
