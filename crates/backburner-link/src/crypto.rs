//! Per-frame protection after the handshake: a key schedule from the pre-shared secret and the handshake transcript,
//! and an AEAD per direction whose nonce is the frame counter.
//!
//! ```text
//! th      = SHA-256(every handshake frame's header ‖ control section, in the order sent)
//! prk     = HKDF-Extract(salt = th, ikm = secret)              (RFC 5869; the secret may be empty)
//! k_host  = HKDF-Expand(prk, "backburner v2 host->worker", 32)  seals frames the host sends
//! k_work  = HKDF-Expand(prk, "backburner v2 worker->host", 32)  seals frames the worker sends
//! frame i in one direction: AES-256-GCM(key, nonce = 0u32 ‖ i as u64 LE, aad = header) over control ‖ tensor,
//!         the 16-byte tag appended
//! ```
//! Fresh nonces from both sides enter `th`, so every connection has fresh keys; the counter makes a reordered,
//! replayed or dropped frame fail the next tag check, and the header (kind, lengths, session id) is authenticated as
//! associated data. With no secret the same construction runs with an empty secret: it then detects corruption,
//! reordering and truncation, but anyone on the path can compute the keys (docs/PROTOCOL.md §7).

use hkdf::Hkdf;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use sha2::{Digest, Sha256};

use crate::error::LinkError;
use crate::frame::HEADER_LEN;

/// Bytes of the authentication tag at the end of every frame after the handshake.
pub const TAG_LEN: usize = 16;

const HOST_INFO: &[u8] = b"backburner v2 host->worker";
const WORKER_INFO: &[u8] = b"backburner v2 worker->host";

/// The running hash of the handshake (SHA-256 over each frame's header and control bytes in conversation order).
#[derive(Clone, Default)]
pub struct Transcript(Sha256);

impl Transcript {
    /// Adds one handshake frame (its 24 header bytes and its control section).
    pub fn absorb(&mut self, header: &[u8; HEADER_LEN], control: &[u8]) {
        self.0.update(header);
        self.0.update(control);
    }

    /// The hash so far.
    pub fn hash(&self) -> [u8; 32] {
        self.0.clone().finalize().into()
    }
}

/// Which side of the link a key set is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side that connects and sends requests.
    Host,
    /// The side that answers.
    Worker,
}

/// One direction's key and frame counter. The cipher is `ring`'s AES-256-GCM (hardware AES and carry-less multiply
/// chosen at run time; 8.7 GB/s sealing on the reference machine, see docs/PROTOCOL.md §7 for the comparison).
pub struct FrameKey {
    cipher: LessSafeKey,
    counter: u64,
}

impl std::fmt::Debug for FrameKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameKey")
            .field("counter", &self.counter)
            .finish_non_exhaustive()
    }
}

impl FrameKey {
    fn new(key: &[u8; 32]) -> Self {
        let k = UnboundKey::new(&AES_256_GCM, key).expect("a 32-byte AES-256 key");
        FrameKey {
            cipher: LessSafeKey::new(k),
            counter: 0,
        }
    }

    /// The nonce of the next frame: 4 zero bytes, then the frame counter as u64 little-endian (each used once).
    fn next_nonce(&mut self) -> Result<Nonce, LinkError> {
        let c = self.counter;
        self.counter = c
            .checked_add(1)
            .ok_or_else(|| LinkError::Integrity("frame counter exhausted".into()))?;
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&c.to_le_bytes());
        Ok(Nonce::assume_unique_for_key(n))
    }

    /// Encrypts `body` in place and returns its tag; `aad` is the frame header. Errors: [`LinkError::Integrity`]
    /// only when the counter is exhausted (2⁶⁴ frames).
    pub fn seal(&mut self, aad: &[u8], body: &mut [u8]) -> Result<[u8; TAG_LEN], LinkError> {
        let nonce = self.next_nonce()?;
        let tag = self
            .cipher
            .seal_in_place_separate_tag(nonce, Aad::from(aad), body)
            .map_err(|_| LinkError::Integrity("encryption failed".into()))?;
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(tag.as_ref());
        Ok(t)
    }

    /// Checks the tag at the end of `sealed` (body ‖ tag) and decrypts the body in place; returns the body's length.
    /// Errors: [`LinkError::Integrity`] when the frame was corrupted, forged, reordered, replayed or follows a
    /// dropped frame (the bytes are then garbage and must be discarded).
    pub fn open(&mut self, aad: &[u8], sealed: &mut [u8]) -> Result<usize, LinkError> {
        let nonce = self.next_nonce()?;
        self.cipher
            .open_in_place(nonce, Aad::from(aad), sealed)
            .map(|plain| plain.len())
            .map_err(|_| {
                LinkError::Integrity(
                    "frame failed its authentication tag: corrupted, forged, reordered or replayed"
                        .into(),
                )
            })
    }
}

/// The two directions' keys of one connection, as seen from `role`.
#[derive(Debug)]
pub struct SessionKeys {
    /// Seals what this side sends.
    pub send: FrameKey,
    /// Opens what this side receives.
    pub recv: FrameKey,
}

/// Derives the session keys from the secret (empty when none is configured) and the handshake transcript hash.
pub fn derive(secret: &[u8], transcript: &[u8; 32], role: Role) -> SessionKeys {
    let hk = Hkdf::<Sha256>::new(Some(transcript), secret);
    let mut host = [0u8; 32];
    let mut worker = [0u8; 32];
    hk.expand(HOST_INFO, &mut host)
        .expect("32 bytes is a valid HKDF length");
    hk.expand(WORKER_INFO, &mut worker)
        .expect("32 bytes is a valid HKDF length");
    let (send, recv) = match role {
        Role::Host => (host, worker),
        Role::Worker => (worker, host),
    };
    SessionKeys {
        send: FrameKey::new(&send),
        recv: FrameKey::new(&recv),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sealed(key: &mut FrameKey, aad: &[u8], msg: &[u8]) -> Vec<u8> {
        let mut b = msg.to_vec();
        let tag = key.seal(aad, &mut b).unwrap();
        b.extend_from_slice(&tag);
        b
    }

    fn opens(secret: &[u8], th: &[u8; 32], aad: &[u8], b: &[u8]) -> bool {
        derive(secret, th, Role::Worker)
            .recv
            .open(aad, &mut b.to_vec())
            .is_ok()
    }

    #[test]
    fn each_side_opens_what_the_other_sealed_and_nothing_else() {
        let th = [7u8; 32];
        let mut h = derive(b"secret", &th, Role::Host);
        let mut w = derive(b"secret", &th, Role::Worker);
        let aad = [1u8; HEADER_LEN];
        let body = sealed(&mut h.send, &aad, b"residual stream");
        assert_ne!(&body[..15], b"residual stream");
        let mut copy = body.clone();
        assert_eq!(w.recv.open(&aad, &mut copy).unwrap(), 15);
        assert_eq!(&copy[..15], b"residual stream");
        // replaying frame 0 fails: the worker now expects counter 1
        assert!(matches!(
            w.recv.open(&aad, &mut body.clone()),
            Err(LinkError::Integrity(_))
        ));
        // another header, secret or transcript, or a flipped bit, all fail
        let b = sealed(&mut derive(b"secret", &th, Role::Host).send, &aad, b"x");
        let mut other = aad;
        other[6] ^= 1;
        assert!(opens(b"secret", &th, &aad, &b));
        assert!(!opens(b"secret", &th, &other, &b));
        assert!(!opens(b"secreT", &th, &aad, &b));
        assert!(!opens(b"secret", &[8u8; 32], &aad, &b));
        for i in 0..b.len() {
            let mut flipped = b.clone();
            flipped[i] ^= 1;
            assert!(!opens(b"secret", &th, &aad, &flipped), "byte {i}");
        }
        // the two directions use different keys
        let back = sealed(&mut w.send, &aad, b"pong");
        let mut h3 = derive(b"secret", &th, Role::Host);
        assert!(h3.send.open(&aad, &mut back.clone()).is_err());
        let mut back2 = back.clone();
        assert_eq!(h.recv.open(&aad, &mut back2).unwrap(), 4);
        assert_eq!(&back2[..4], b"pong");
    }
}
