//! Challenge-response authentication with a pre-shared key (HMAC-SHA256, RFC 2104). The key never crosses the link:
//! each side proves it holds the key by MACing both sides' fresh nonces.

use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;

type HmacSha256 = Hmac<Sha256>;

/// 32 random bytes from the OS-seeded thread RNG.
pub fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    rand::rng().fill_bytes(&mut n);
    n
}

/// HMAC-SHA256(key, label ‖ parts…). An empty key is allowed (no secret configured on loopback).
pub fn mac(key: &[u8], label: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Constant-time check of a MAC.
pub fn verify(key: &[u8], label: &[u8], parts: &[&[u8]], tag: &[u8; 32]) -> bool {
    let mut m = HmacSha256::new_from_slice(key).expect("HMAC takes any key length");
    m.update(label);
    for p in parts {
        m.update(p);
    }
    m.verify_slice(tag).is_ok()
}

/// Constant-time equality of two MACs.
pub fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads a shared secret: the file's contents with surrounding whitespace trimmed. Errors if it is empty.
pub fn read_secret_file(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let s = std::fs::read(path)?;
    let t = s.trim_ascii().to_vec();
    if t.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "it is empty (or only whitespace)",
        ));
    }
    Ok(t)
}
