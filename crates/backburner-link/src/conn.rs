//! A TCP connection carrying frames: whole-message deadlines on both halves, byte counters, per-frame sealing after
//! the handshake, and an optional shaper that emulates a slower link (one-way delay and rate) in user space (the
//! kernel here has no netem).

use std::io::{BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::codec::{decode_body, encode_control, encode_frame, wire_body_len};
use crate::crypto::FrameKey;
use crate::crypto::SessionKeys;
pub use crate::deadline::Pace;
use crate::deadline::{map_io, retime, Deadline, DeadlineStream};
use crate::error::{ErrorCode, LinkError};
use crate::frame::{Frame, Header, Kind, DEFAULT_MAX_TENSOR, HEADER_LEN};
use crate::message::ErrorMsg;

/// Bytes sent and received on a connection (shared by its reader and writer halves).
#[derive(Debug, Default)]
pub struct Counters {
    /// Bytes written.
    pub sent: AtomicU64,
    /// Bytes read.
    pub received: AtomicU64,
}

/// Emulated link: every frame is held for `delay + (header + tensor bytes) / rate` before it is written (the small
/// control section is not counted).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shaper {
    /// One-way delay added to every frame.
    pub delay: Duration,
    /// Line rate in bits per second (0 = unlimited).
    pub rate_bps: u64,
}

impl Shaper {
    fn hold(&self, bytes: usize) {
        let mut d = self.delay;
        if self.rate_bps > 0 {
            d += Duration::from_secs_f64(bytes as f64 * 8.0 / self.rate_bps as f64);
        }
        if !d.is_zero() {
            let t = Instant::now();
            // sleep for the bulk, spin for the last 100 µs: sleeps alone overshoot by ~60 µs here
            if d > Duration::from_micros(200) {
                std::thread::sleep(d - Duration::from_micros(100));
            }
            while t.elapsed() < d {
                std::hint::spin_loop();
            }
        }
    }
}

/// The writing half of a connection.
#[derive(Debug)]
pub struct FrameWriter {
    s: TcpStream,
    buf: Vec<u8>,
    counters: Arc<Counters>,
    shaper: Option<Shaper>,
    key: Option<FrameKey>,
    session: u64,
    deadline: Option<Deadline>,
    applied: Option<Option<Duration>>,
}

impl FrameWriter {
    /// Sends one frame (sealed after the handshake) within the writer's deadline; returns the bytes written.
    ///
    /// Errors: [`LinkError::Timeout`] when the peer does not take the bytes in time, [`LinkError::Io`] (a dead peer
    /// shows up here or on the next read), [`LinkError::FrameTooLarge`] for a section over its bound.
    pub fn send<T: serde::Serialize>(
        &mut self,
        kind: Kind,
        control: &T,
        tensor: &[u8],
    ) -> Result<usize, LinkError> {
        let c = encode_control(control)?;
        self.send_raw(kind, &c, tensor).map(|(_, n)| n)
    }

    /// Sends a frame whose control section is already encoded; returns its header and the bytes written.
    pub fn send_raw(
        &mut self,
        kind: Kind,
        control: &[u8],
        tensor: &[u8],
    ) -> Result<(Header, usize), LinkError> {
        if let Some(s) = &self.shaper {
            s.hold(HEADER_LEN + tensor.len());
        }
        let mut buf = std::mem::take(&mut self.buf);
        let r = encode_frame(
            &mut buf,
            kind,
            control,
            tensor,
            self.session,
            self.key.as_mut(),
        )
        .and_then(|h| self.write_all(&buf).map(|()| (h, buf.len())));
        // keep a small buffer around for the next frame, not the largest one ever sent
        if buf.capacity() <= 1 << 20 {
            self.buf = buf;
        }
        let (h, n) = r?;
        self.counters.sent.fetch_add(n as u64, Ordering::Relaxed);
        Ok((h, n))
    }

    fn write_all(&mut self, mut b: &[u8]) -> Result<(), LinkError> {
        while !b.is_empty() {
            let t = self
                .deadline
                .map(|d| d.left())
                .transpose()
                .map_err(|e| map_io(e, self.deadline))?;
            if let Some(t) = retime(self.applied, t) {
                self.s.set_write_timeout(t)?;
                self.applied = Some(t);
            }
            match self.s.write(b) {
                Ok(0) => return Err(LinkError::Closed),
                Ok(n) => b = &b[n..],
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(map_io(e, self.deadline)),
            }
        }
        Ok(())
    }

    /// Sends an `Error` frame, best effort, waiting at most 1 s for the peer to take it.
    pub fn send_error(&mut self, code: ErrorCode, message: impl Into<String>) {
        let keep = self.deadline;
        self.deadline = Some(Deadline::after(Duration::from_secs(1)));
        let _ = self.send(
            Kind::Error,
            &ErrorMsg {
                code,
                message: message.into(),
            },
            &[],
        );
        self.deadline = keep;
    }

    /// Every later send must complete within `d` from now (None = no deadline).
    pub fn set_deadline(&mut self, d: Option<Duration>) {
        self.deadline = d.map(Deadline::after);
    }
}

/// The reading half of a connection.
#[derive(Debug)]
pub struct FrameReader {
    r: BufReader<DeadlineStream>,
    counters: Arc<Counters>,
    max_tensor: usize,
    key: Option<FrameKey>,
    session: u64,
    pace: Option<Pace>,
}

impl FrameReader {
    fn deadline(&self) -> Option<Deadline> {
        self.r.get_ref().deadline
    }

    fn read_exact(&mut self, b: &mut [u8]) -> Result<(), LinkError> {
        let d = self.deadline();
        self.r.read_exact(b).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => LinkError::Cut,
            _ => map_io(e, d),
        })
    }

    /// Reads and validates the next header (nothing of the body is read or allocated). With a [`Pace`], the wait for
    /// the first byte is bounded by the deadline and the rest of the frame by the pace from then on.
    ///
    /// Errors: [`LinkError::Closed`] on a clean end of stream before a frame, [`LinkError::Cut`] inside one, the
    /// header errors of [`Header::decode`], [`LinkError::Timeout`], [`LinkError::Io`].
    pub fn recv_header(&mut self) -> Result<Header, LinkError> {
        let mut h = [0u8; HEADER_LEN];
        let d = self.deadline();
        let n = loop {
            match self.r.read(&mut h[..1]) {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(map_io(e, d)),
            }
        };
        if n == 0 {
            return Err(LinkError::Closed);
        }
        if let Some(p) = self.pace {
            self.r.get_mut().deadline = Some(Deadline::after(p.base));
        }
        self.read_exact(&mut h[1..])?;
        let header = Header::decode(&h, self.max_tensor)?;
        if let Some(p) = self.pace {
            self.r.get_mut().deadline = Some(Deadline::after(p.allowance(header.body_len())));
        }
        Ok(header)
    }

    /// Reads the body of a frame whose header [`FrameReader::recv_header`] returned, checks its tag and session id.
    /// An `Error` frame from the peer becomes [`LinkError::Remote`].
    ///
    /// Errors: [`LinkError::Integrity`] (tag or session id), [`LinkError::Timeout`], [`LinkError::Io`],
    /// [`LinkError::Malformed`].
    pub fn recv_body(&mut self, h: Header) -> Result<Frame, LinkError> {
        let mut wire = vec![0u8; wire_body_len(&h, self.key.is_some())];
        self.read_exact(&mut wire)?;
        self.counters
            .received
            .fetch_add((HEADER_LEN + wire.len()) as u64, Ordering::Relaxed);
        let f = decode_body(h, wire, self.key.as_mut())?;
        if self.key.is_some() && h.session != self.session {
            return Err(LinkError::Integrity(format!(
                "frame of session {} on session {}",
                h.session, self.session
            )));
        }
        if f.kind() == Kind::Error {
            let m: ErrorMsg = f.control()?;
            return Err(LinkError::Remote {
                code: m.code,
                message: m.message,
            });
        }
        Ok(f)
    }

    /// Receives one whole frame within the deadline.
    pub fn recv(&mut self) -> Result<Frame, LinkError> {
        let h = self.recv_header()?;
        self.recv_body(h)
    }

    /// Receives a frame of `kind` and decodes its control section. Errors: [`LinkError::Unexpected`] for another kind.
    pub fn expect<T: serde::de::DeserializeOwned>(
        &mut self,
        kind: Kind,
        name: &'static str,
    ) -> Result<(T, Vec<u8>), LinkError> {
        let f = self.recv()?;
        if f.kind() != kind {
            return Err(LinkError::Unexpected {
                expected: name,
                got: f.kind(),
            });
        }
        let c = f.control()?;
        Ok((c, f.tensor))
    }

    /// Sets the bound on a frame's tensor section (bytes). A worker keeps it at 0 until the host has authenticated.
    pub fn set_max_tensor(&mut self, max: usize) {
        self.max_tensor = max;
    }

    /// Every later read must complete within `d` from now (None = wait forever).
    pub fn set_deadline(&mut self, d: Option<Duration>) {
        self.r.get_mut().deadline = d.map(Deadline::after);
    }

    /// Bounds each frame by `pace` once its first byte has arrived (None = only the deadline).
    pub fn set_pace(&mut self, pace: Option<Pace>) {
        self.pace = pace;
    }
}

/// A connection split into its two halves, with shared counters.
#[derive(Debug)]
pub struct Conn {
    /// Writing half.
    pub writer: FrameWriter,
    /// Reading half.
    pub reader: FrameReader,
    /// Byte counters.
    pub counters: Arc<Counters>,
    stream: TcpStream,
}

impl Conn {
    /// Wraps a connected stream: sets `TCP_NODELAY`, the deadline of both halves and the tensor bound (default
    /// [`DEFAULT_MAX_TENSOR`]).
    pub fn new(
        stream: TcpStream,
        deadline: Option<Duration>,
        max_tensor: Option<usize>,
        shaper: Option<Shaper>,
    ) -> Result<Self, LinkError> {
        stream.set_nodelay(true)?;
        let counters = Arc::new(Counters::default());
        let mut writer = FrameWriter {
            s: stream.try_clone()?,
            buf: Vec::new(),
            counters: counters.clone(),
            shaper,
            key: None,
            session: 0,
            deadline: None,
            applied: None,
        };
        writer.set_deadline(deadline);
        let mut reader = FrameReader {
            r: BufReader::with_capacity(
                1 << 16,
                DeadlineStream {
                    s: stream.try_clone()?,
                    deadline: None,
                    applied: None,
                },
            ),
            counters: counters.clone(),
            max_tensor: max_tensor.unwrap_or(DEFAULT_MAX_TENSOR),
            key: None,
            session: 0,
            pace: None,
        };
        reader.set_deadline(deadline);
        Ok(Conn {
            writer,
            reader,
            counters,
            stream,
        })
    }

    /// Connects to `addr` within `timeout` (each resolved address in turn); both halves get `timeout` as their
    /// first deadline, and the tensor bound is 0 until the handshake raises it.
    pub fn connect(
        addr: &str,
        timeout: Duration,
        shaper: Option<Shaper>,
    ) -> Result<Self, LinkError> {
        use std::net::ToSocketAddrs;
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, timeout) {
                // no handshake frame carries a tensor: none is read (or allocated) from an unauthenticated peer
                Ok(s) => return Conn::new(s, Some(timeout), Some(0), shaper),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .map(LinkError::Io)
            .unwrap_or_else(|| LinkError::Malformed(format!("{addr} resolves to no address"))))
    }

    /// Seals every later frame with the session keys and stamps (and expects) `session` in every header.
    pub fn protect(&mut self, keys: SessionKeys, session: u64) {
        self.writer.key = Some(keys.send);
        self.writer.session = session;
        self.reader.key = Some(keys.recv);
        self.reader.session = session;
    }

    /// Sets the deadline of both halves (None = none).
    pub fn set_deadline(&mut self, d: Option<Duration>) {
        self.writer.set_deadline(d);
        self.reader.set_deadline(d);
    }

    /// Bytes sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.counters.sent.load(Ordering::Relaxed)
    }

    /// Bytes received so far.
    pub fn bytes_received(&self) -> u64 {
        self.counters.received.load(Ordering::Relaxed)
    }

    /// Closes after an `Error` frame so that the peer can read it: shuts the writing side, then reads and discards
    /// what the peer is still sending (at most `max_bytes`, for at most `max_wait`) before closing. Closing at once
    /// with unread bytes would reset the connection and could destroy the `Error` frame in flight.
    pub fn linger_close(&mut self, max_bytes: usize, max_wait: Duration) {
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        self.reader.set_deadline(Some(max_wait));
        let mut buf = [0u8; 64 << 10];
        let mut left = max_bytes;
        while left > 0 {
            match self.reader.r.read(&mut buf[..left.min(64 << 10)]) {
                Ok(0) | Err(_) => break,
                Ok(n) => left -= n,
            }
        }
        self.shutdown();
    }

    /// Closes both directions (wakes a thread blocked on the other half).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// A handle that can shut the socket down from another thread.
    pub fn shutdown_handle(&self) -> Result<TcpStream, LinkError> {
        Ok(self.stream.try_clone()?)
    }
}
