//! The handshake: version, mutual authentication bound to the whole transcript, the session parameter check, and
//! the session keys.
//!
//! ```text
//! host → Hello{host_nonce}                 worker → Challenge{worker_nonce, threads, layers, limits}
//! host → Auth{mac_h, params}               worker → Welcome{mac_w, session, threads, limits}   (or Error{code})
//! mac_h = HMAC(secret, "bb2-host"   ‖ th(Hello, Challenge) ‖ postcard(params))
//! mac_w = HMAC(secret, "bb2-worker" ‖ th(Hello, Challenge, Auth) ‖ session ‖ threads ‖ limits)   (u64/u32 LE)
//! keys  = crypto::derive(secret, th(Hello, Challenge, Auth, Welcome))
//! ```
//! `th` hashes each frame's header and control bytes, so a change to any handshake byte (a threads count, a limit,
//! a header) makes a MAC fail or, without a secret, the first sealed frame fail. The protocol version travels in
//! every frame header; a mismatch fails the first read on either side.

use crate::auth;
use crate::codec::encode_control;
use crate::conn::Conn;
use crate::crypto::{derive, Role, Transcript};
use crate::error::{ErrorCode, LinkError};
use crate::frame::{Frame, Kind};
use crate::message::{Auth, Challenge, Hello, SessionParams, Welcome, WorkerLimits};

const HOST_LABEL: &[u8] = b"bb2-host";
const WORKER_LABEL: &[u8] = b"bb2-worker";

fn send_recorded<T: serde::Serialize>(
    conn: &mut Conn,
    t: &mut Transcript,
    kind: Kind,
    msg: &T,
) -> Result<(), LinkError> {
    let c = encode_control(msg)?;
    let (h, _) = conn.writer.send_raw(kind, &c, &[])?;
    t.absorb(&h.encode(), &c);
    Ok(())
}

fn recv_recorded(
    conn: &mut Conn,
    t: &mut Transcript,
    kind: Kind,
    name: &'static str,
) -> Result<Frame, LinkError> {
    let f = conn.reader.recv()?;
    if f.kind() != kind {
        return Err(LinkError::Unexpected {
            expected: name,
            got: f.kind(),
        });
    }
    if f.header.session != 0 {
        return Err(LinkError::Malformed(format!(
            "{name} carries session id {}",
            f.header.session
        )));
    }
    t.absorb(&f.header.encode(), &f.control);
    Ok(f)
}

fn welcome_mac(
    secret: &[u8],
    th: &[u8; 32],
    session: u64,
    threads: u32,
    l: &WorkerLimits,
) -> [u8; 32] {
    auth::mac(
        secret,
        WORKER_LABEL,
        &[
            th,
            &session.to_le_bytes(),
            &threads.to_le_bytes(),
            &l.max_ubatch.to_le_bytes(),
            &l.max_frame.to_le_bytes(),
            &l.max_memory.to_le_bytes(),
        ],
    )
}

/// Host side. `secret` is the shared secret (empty when none is configured); `choose` turns the worker's
/// `Challenge` (threads, fixed layer range, limits) into the session parameters and must not block (the worker
/// bounds its whole handshake). On success the connection is sealed with the session keys.
///
/// Errors: [`LinkError::Remote`] with the worker's code (Busy, AuthFailed, ModelMismatch, ...),
/// [`LinkError::AuthFailed`] when the worker cannot prove it holds the secret, errors from `choose`, and transport
/// errors.
pub fn host_handshake(
    conn: &mut Conn,
    secret: &[u8],
    choose: impl FnOnce(&Challenge) -> Result<SessionParams, LinkError>,
) -> Result<(SessionParams, Welcome), LinkError> {
    let mut t = Transcript::default();
    send_recorded(
        conn,
        &mut t,
        Kind::Hello,
        &Hello {
            host_nonce: auth::nonce(),
        },
    )?;
    let ch: Challenge = recv_recorded(conn, &mut t, Kind::Challenge, "Challenge")?.control()?;
    let params = choose(&ch)?;
    let mac = auth::mac(secret, HOST_LABEL, &[&t.hash(), &encode_control(&params)?]);
    send_recorded(
        conn,
        &mut t,
        Kind::Auth,
        &Auth {
            mac,
            params: params.clone(),
        },
    )?;
    let th = t.hash();
    let wf = recv_recorded(conn, &mut t, Kind::Welcome, "Welcome")?;
    let w: Welcome = wf.control()?;
    let want = welcome_mac(secret, &th, w.session, w.threads, &w.limits);
    if !auth::ct_eq(&want, &w.mac) {
        return Err(LinkError::AuthFailed(
            "the worker could not prove it holds the shared secret (or the handshake was altered)"
                .into(),
        ));
    }
    if w.session == 0 {
        return Err(LinkError::Malformed("Welcome with session id 0".into()));
    }
    conn.protect(derive(secret, &t.hash(), Role::Host), w.session);
    conn.reader.set_max_tensor(crate::frame::DEFAULT_MAX_TENSOR);
    Ok((params, w))
}

/// What a worker announces and how it judges a host, for [`worker_handshake`].
#[derive(Clone, Debug)]
pub struct WorkerOffer {
    /// The secret, or `None` to accept any host (loopback without a secret).
    pub secret: Option<Vec<u8>>,
    /// Compute threads.
    pub threads: u32,
    /// The fixed layer range (`--layers`), if any.
    pub layers: Option<(u32, u32)>,
    /// What the worker accepts.
    pub limits: WorkerLimits,
    /// The id this session gets (never 0).
    pub session: u64,
    /// Deadline for sending `Welcome` once the parameters are accepted (the check may take long: loading layers).
    pub reply_timeout: std::time::Duration,
}

/// Worker side. `check` inspects the host's parameters once its MAC has verified, and returns the error to send
/// back if they are unacceptable. On success the connection is sealed with the session keys.
///
/// On a failed check or MAC, sends an `Error` frame to the host and returns the error.
pub fn worker_handshake(
    conn: &mut Conn,
    offer: &WorkerOffer,
    check: impl FnOnce(&SessionParams) -> Result<(), (ErrorCode, String)>,
) -> Result<SessionParams, LinkError> {
    let mut t = Transcript::default();
    let _: Hello = recv_recorded(conn, &mut t, Kind::Hello, "Hello")?.control()?;
    let ch = Challenge {
        worker_nonce: auth::nonce(),
        threads: offer.threads,
        layers: offer.layers,
        limits: offer.limits,
    };
    send_recorded(conn, &mut t, Kind::Challenge, &ch)?;
    let th = t.hash();
    let a: Auth = recv_recorded(conn, &mut t, Kind::Auth, "Auth")?.control()?;
    let secret = offer.secret.as_deref().unwrap_or(&[]);
    if offer.secret.is_some() {
        let p = encode_control(&a.params)?;
        if !auth::verify(secret, HOST_LABEL, &[&th, &p], &a.mac) {
            let msg = "the host's MAC does not verify: wrong or missing shared secret";
            conn.writer.send_error(ErrorCode::AuthFailed, msg);
            return Err(LinkError::AuthFailed(msg.into()));
        }
    }
    if let Err((code, message)) = check(&a.params) {
        conn.writer.send_error(code, message.clone());
        return Err(LinkError::Remote { code, message });
    }
    conn.writer.set_deadline(Some(offer.reply_timeout));
    let th = t.hash();
    let w = Welcome {
        mac: welcome_mac(secret, &th, offer.session, offer.threads, &offer.limits),
        session: offer.session,
        threads: offer.threads,
        limits: offer.limits,
    };
    send_recorded(conn, &mut t, Kind::Welcome, &w)?;
    conn.protect(derive(secret, &t.hash(), Role::Worker), offer.session);
    Ok(a.params)
}
