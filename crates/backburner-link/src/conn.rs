//! A TCP connection carrying frames, with byte counters, per-read timeouts and an optional shaper that emulates a
//! slower link (one-way delay and rate) in user space (the kernel here has no netem).

use std::io::{BufReader, BufWriter};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{ErrorCode, LinkError};
use crate::frame::{read_frame, write_frame, Frame, Kind, DEFAULT_MAX_TENSOR};
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
    w: BufWriter<TcpStream>,
    counters: Arc<Counters>,
    shaper: Option<Shaper>,
}

impl FrameWriter {
    /// Sends one frame. Errors: [`LinkError::Io`] (a dead peer shows up here or on the next read).
    pub fn send<T: serde::Serialize>(
        &mut self,
        kind: Kind,
        control: &T,
        tensor: &[u8],
    ) -> Result<usize, LinkError> {
        if let Some(s) = &self.shaper {
            s.hold(crate::frame::HEADER_LEN + tensor.len());
        }
        let n = write_frame(&mut self.w, kind, control, tensor)?;
        self.counters.sent.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }

    /// Sends an `Error` frame (best effort).
    pub fn send_error(&mut self, code: ErrorCode, message: impl Into<String>) {
        let _ = self.send(
            Kind::Error,
            &ErrorMsg {
                code,
                message: message.into(),
            },
            &[],
        );
    }
}

/// The reading half of a connection.
#[derive(Debug)]
pub struct FrameReader {
    r: BufReader<TcpStream>,
    counters: Arc<Counters>,
    max_tensor: usize,
    timeout: Option<Duration>,
}

impl FrameReader {
    /// Receives one frame. An `Error` frame from the peer becomes [`LinkError::Remote`].
    pub fn recv(&mut self) -> Result<Frame, LinkError> {
        let f = read_frame(&mut self.r, self.max_tensor).map_err(|e| match e {
            LinkError::Io(io) => LinkError::from_io(io, self.timeout),
            other => other,
        })?;
        self.counters
            .received
            .fetch_add(f.wire_len() as u64, Ordering::Relaxed);
        if f.kind == Kind::Error {
            let m: ErrorMsg = f.control()?;
            return Err(LinkError::Remote {
                code: m.code,
                message: m.message,
            });
        }
        Ok(f)
    }

    /// Receives a frame of `kind` and decodes its control section. Errors: [`LinkError::Unexpected`] for another kind.
    pub fn expect<T: serde::de::DeserializeOwned>(
        &mut self,
        kind: Kind,
        name: &'static str,
    ) -> Result<(T, Vec<u8>), LinkError> {
        let f = self.recv()?;
        if f.kind != kind {
            return Err(LinkError::Unexpected {
                expected: name,
                got: f.kind,
            });
        }
        let c = f.control()?;
        Ok((c, f.tensor))
    }

    /// Sets the bound on a frame's tensor section (bytes). A worker keeps it small until the host has authenticated.
    pub fn set_max_tensor(&mut self, max: usize) {
        self.max_tensor = max;
    }

    /// Sets the read timeout (None = block forever).
    pub fn set_timeout(&mut self, t: Option<Duration>) -> Result<(), LinkError> {
        self.r.get_ref().set_read_timeout(t)?;
        self.timeout = t;
        Ok(())
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
    /// Wraps a connected stream: sets `TCP_NODELAY`, the read timeout and the tensor bound.
    pub fn new(
        stream: TcpStream,
        timeout: Option<Duration>,
        max_tensor: Option<usize>,
        shaper: Option<Shaper>,
    ) -> Result<Self, LinkError> {
        stream.set_nodelay(true)?;
        stream.set_read_timeout(timeout)?;
        // A peer that stops reading must not block our writer forever either.
        stream.set_write_timeout(timeout)?;
        let counters = Arc::new(Counters::default());
        let writer = FrameWriter {
            w: BufWriter::with_capacity(1 << 16, stream.try_clone()?),
            counters: counters.clone(),
            shaper,
        };
        let reader = FrameReader {
            r: BufReader::with_capacity(1 << 16, stream.try_clone()?),
            counters: counters.clone(),
            max_tensor: max_tensor.unwrap_or(DEFAULT_MAX_TENSOR),
            timeout,
        };
        Ok(Conn {
            writer,
            reader,
            counters,
            stream,
        })
    }

    /// Connects to `addr` within `timeout`.
    pub fn connect(
        addr: &str,
        timeout: Duration,
        shaper: Option<Shaper>,
    ) -> Result<Self, LinkError> {
        use std::net::ToSocketAddrs;
        let mut last = None;
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, timeout) {
                Ok(s) => return Conn::new(s, Some(timeout), None, shaper),
                Err(e) => last = Some(e),
            }
        }
        Err(last
            .map(LinkError::Io)
            .unwrap_or_else(|| LinkError::Malformed(format!("{addr} resolves to no address"))))
    }

    /// Bytes sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.counters.sent.load(Ordering::Relaxed)
    }

    /// Bytes received so far.
    pub fn bytes_received(&self) -> u64 {
        self.counters.received.load(Ordering::Relaxed)
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
