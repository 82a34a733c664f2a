//! The Backburner link: how a host and a worker talk over TCP.
//!
//! A frame is a 24-byte header (magic, protocol version, message kind, control length, tensor length, session id), a
//! small control struct encoded with postcard, a raw little-endian tensor section and, after the handshake, a
//! 16-byte AES-256-GCM tag under per-session keys. The handshake authenticates both sides with a pre-shared key
//! (HMAC-SHA256 over the whole transcript) and checks the model fingerprint, layer range and dtypes; every message
//! has a whole-message deadline. docs/PROTOCOL.md is the written specification; this crate is the one
//! implementation both sides share.
#![warn(missing_docs)]

pub mod auth;
pub mod codec;
pub mod conn;
pub mod crypto;
mod deadline;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod message;
pub mod relay;

pub use conn::{Conn, Counters, FrameReader, FrameWriter, Pace, Shaper};
pub use error::{ErrorCode, LinkError};
pub use frame::{Frame, Header, Kind, HEADER_LEN, MAGIC, PROTOCOL_VERSION};
pub use message::{Request, SessionParams, WireKvDtype, WorkerLimits};
