//! The Backburner link: how a host and a worker talk over TCP.
//!
//! A frame is a 16-byte header (magic, protocol version, message kind, control length, tensor length), a small
//! control struct encoded with postcard, and a raw little-endian tensor section. The handshake authenticates both
//! sides with a pre-shared key (HMAC-SHA256 challenge-response) and checks the model fingerprint, layer range and
//! dtypes. docs/PROTOCOL.md is the written specification; this crate is the one implementation both sides share.
#![warn(missing_docs)]

pub mod auth;
pub mod conn;
pub mod error;
pub mod frame;
pub mod handshake;
pub mod message;
pub mod relay;

pub use conn::{Conn, Counters, FrameReader, FrameWriter, Shaper};
pub use error::{ErrorCode, LinkError};
pub use frame::{Frame, Kind, MAGIC, PROTOCOL_VERSION};
pub use message::SessionParams;
