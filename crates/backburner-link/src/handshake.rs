//! The handshake: version, mutual challenge-response authentication, and the session parameter check.
//!
//! ```text
//! host → Hello{host_nonce}            worker → Challenge{worker_nonce}   (or Error{Busy})
//! host → Auth{mac_h, params}          worker → Welcome{mac_w, ...}       (or Error{code, what differs})
//! mac_h = HMAC(key, "bb-host" ‖ worker_nonce ‖ host_nonce ‖ postcard(params))
//! mac_w = HMAC(key, "bb-worker" ‖ host_nonce ‖ worker_nonce)
//! ```
//! The protocol version travels in every frame header; a mismatch fails the first read on either side.

use crate::auth;
use crate::conn::Conn;
use crate::error::{ErrorCode, LinkError};
use crate::frame::Kind;
use crate::message::{Auth, Challenge, Hello, SessionParams, Welcome};

const HOST_LABEL: &[u8] = b"bb-host";
const WORKER_LABEL: &[u8] = b"bb-worker";

/// Host side. `key` is the shared secret (empty when none is configured); `choose` turns the worker's `Challenge`
/// (its threads and fixed layer range) into the session parameters. Returns the parameters sent and the worker's
/// `Welcome`.
///
/// Errors: [`LinkError::Remote`] with the worker's code (Busy, AuthFailed, ModelMismatch, ...),
/// [`LinkError::AuthFailed`] when the worker cannot prove it holds the key, errors from `choose`, and transport
/// errors.
pub fn host_handshake(
    conn: &mut Conn,
    key: &[u8],
    choose: impl FnOnce(&Challenge) -> Result<SessionParams, LinkError>,
) -> Result<(SessionParams, Welcome), LinkError> {
    let host_nonce = auth::nonce();
    conn.writer.send(Kind::Hello, &Hello { host_nonce }, &[])?;
    let (ch, _): (Challenge, _) = conn.reader.expect(Kind::Challenge, "Challenge")?;
    let params = choose(&ch)?;
    let params = &params;
    let p = postcard::to_stdvec(params).map_err(|e| LinkError::Malformed(e.to_string()))?;
    let mac = auth::mac(key, HOST_LABEL, &[&ch.worker_nonce, &host_nonce, &p]);
    conn.writer.send(
        Kind::Auth,
        &Auth {
            mac,
            params: params.clone(),
        },
        &[],
    )?;
    let (w, _): (Welcome, _) = conn.reader.expect(Kind::Welcome, "Welcome")?;
    if !auth::verify(key, WORKER_LABEL, &[&host_nonce, &ch.worker_nonce], &w.mac) {
        return Err(LinkError::AuthFailed(
            "the worker could not prove it holds the shared secret".into(),
        ));
    }
    Ok((params.clone(), w))
}

/// Worker side. `key` is the shared secret, or `None` to accept any host (loopback without a secret); `threads` and
/// `layers` are announced in the `Challenge`. `check` inspects
/// the host's parameters and returns the `Welcome` fields (threads, max_memory) or the error to send back.
///
/// On a failed check or MAC, sends an `Error` frame to the host and returns the error.
pub fn worker_handshake(
    conn: &mut Conn,
    key: Option<&[u8]>,
    threads: u32,
    layers: Option<(u32, u32)>,
    check: impl FnOnce(&SessionParams) -> Result<(u32, u64), (ErrorCode, String)>,
) -> Result<SessionParams, LinkError> {
    let (hello, _): (Hello, _) = conn.reader.expect(Kind::Hello, "Hello")?;
    let worker_nonce = auth::nonce();
    conn.writer.send(
        Kind::Challenge,
        &Challenge {
            worker_nonce,
            threads,
            layers,
        },
        &[],
    )?;
    let (a, _): (Auth, _) = conn.reader.expect(Kind::Auth, "Auth")?;
    let p = postcard::to_stdvec(&a.params).map_err(|e| LinkError::Malformed(e.to_string()))?;
    if let Some(k) = key {
        if !auth::verify(
            k,
            HOST_LABEL,
            &[&worker_nonce, &hello.host_nonce, &p],
            &a.mac,
        ) {
            let msg = "the host's MAC does not verify: wrong or missing shared secret";
            conn.writer.send_error(ErrorCode::AuthFailed, msg);
            return Err(LinkError::AuthFailed(msg.into()));
        }
    }
    let (threads, max_memory) = match check(&a.params) {
        Ok(v) => v,
        Err((code, message)) => {
            conn.writer.send_error(code, message.clone());
            return Err(LinkError::Remote { code, message });
        }
    };
    let mac = auth::mac(
        key.unwrap_or(&[]),
        WORKER_LABEL,
        &[&hello.host_nonce, &worker_nonce],
    );
    conn.writer.send(
        Kind::Welcome,
        &Welcome {
            mac,
            threads,
            max_memory,
        },
        &[],
    )?;
    Ok(a.params)
}
