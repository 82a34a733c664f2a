//! A fault-injecting TCP relay for tests: it sits between a host and a worker, forwards both directions byte for
//! byte, and can flip a byte, drop a range, trickle, stall or cut one direction of the first few connections.
//!
//! Offsets count the bytes of one direction of one connection from 0. Each direction of each connection is pumped
//! by its own thread with a 64 KiB buffer, forwarding what every read returns; when either side closes (or a pump
//! fails), both sockets of that connection are shut down.

use std::collections::HashMap;
use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Direction of the bytes through the relay.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dir {
    /// From the accepted client (the host) to the upstream (the worker).
    ToWorker,
    /// From the upstream (the worker) back to the client (the host).
    ToHost,
}

/// The fault a relay injects into one direction of a faulty connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything unchanged.
    None,
    /// XOR 0x01 into the byte at stream offset `at` of `dir`.
    FlipByte {
        /// Direction affected.
        dir: Dir,
        /// Stream offset of the byte.
        at: u64,
    },
    /// Silently omit the bytes `[at, at + len)` of `dir`.
    DropBytes {
        /// Direction affected.
        dir: Dir,
        /// First omitted offset.
        at: u64,
        /// Number of omitted bytes.
        len: u64,
    },
    /// After the first `after` bytes of `dir`, forward at most `chunk` bytes per `every`.
    Trickle {
        /// Direction affected.
        dir: Dir,
        /// Bytes forwarded at full speed first.
        after: u64,
        /// Bytes per step (0 counts as 1).
        chunk: usize,
        /// Pause between steps.
        every: Duration,
    },
    /// After the first `after` bytes of `dir`, forward nothing more; the sockets stay open and the relay keeps
    /// reading (and discarding) that direction.
    Stall {
        /// Direction affected.
        dir: Dir,
        /// Bytes forwarded before the stall.
        after: u64,
    },
    /// Forward the first `after` bytes of `dir`, then close both sockets of the connection.
    CloseAfter {
        /// Direction affected.
        dir: Dir,
        /// Bytes forwarded before the close.
        after: u64,
    },
}

impl Fault {
    /// The fault as the pump of direction `d` sees it (`None` when it targets the other direction).
    fn for_dir(self, d: Dir) -> Fault {
        match self {
            Fault::FlipByte { dir, .. }
            | Fault::DropBytes { dir, .. }
            | Fault::Trickle { dir, .. }
            | Fault::Stall { dir, .. }
            | Fault::CloseAfter { dir, .. }
                if dir != d =>
            {
                Fault::None
            }
            f => f,
        }
    }
}

/// State shared by the relay handle, its accept loop and every pump.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    accepted: AtomicUsize,
    bytes: [AtomicU64; 2], // indexed by `Dir as usize`
    links: Mutex<HashMap<usize, Arc<Link>>>,
}

impl Shared {
    fn links(&self) -> MutexGuard<'_, HashMap<usize, Arc<Link>>> {
        self.links.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One relayed connection: the accepted client socket, the socket to the upstream, and its fault.
struct Link {
    client: TcpStream,
    upstream: TcpStream,
    fault: Fault,
    closed: AtomicBool,
    shared: Arc<Shared>,
}

impl Link {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        let _ = self.upstream.shutdown(Shutdown::Both);
    }
}

/// A running relay; dropping it stops the accept loop and shuts down every open connection.
pub struct Relay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl Relay {
    /// Listens on 127.0.0.1:0 and forwards every accepted connection to `upstream`. The fault applies to the
    /// first `faulty_connections` connections (counted from 1 in accept order); later connections pass cleanly.
    pub fn start(
        upstream: SocketAddr,
        fault: Fault,
        faulty_connections: usize,
    ) -> io::Result<Relay> {
        let listener = TcpListener::bind(("127.0.0.1", 0))?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        let sh = shared.clone();
        let accept = thread::Builder::new()
            .name("relay-accept".into())
            .spawn(move || accept_loop(listener, upstream, fault, faulty_connections, sh))?;
        let accept = Some(accept);
        Ok(Relay {
            addr,
            shared,
            accept,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Bytes forwarded so far in direction `dir`, all connections together (counted as they are handed to the
    /// destination socket; dropped, stalled and discarded bytes are not counted).
    pub fn bytes(&self, dir: Dir) -> u64 {
        self.shared.bytes[dir as usize].load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own; join only if that worked (else detach).
        let woke = TcpStream::connect_timeout(&self.addr, Duration::from_millis(100)).is_ok();
        if let Some(h) = self.accept.take().filter(|_| woke) {
            let _ = h.join();
        }
        // Pumps are detached: once their sockets are shut down they exit within a read or a 10 ms sleep slice.
        for link in std::mem::take(&mut *self.shared.links()).into_values() {
            link.close();
        }
    }
}

fn accept_loop(l: TcpListener, up: SocketAddr, fault: Fault, faulty: usize, sh: Arc<Shared>) {
    for stream in l.incoming() {
        if sh.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(client) = stream else {
            thread::sleep(Duration::from_millis(5)); // e.g. out of descriptors: do not spin
            continue;
        };
        let id = sh.accepted.fetch_add(1, Ordering::SeqCst) + 1;
        let fault = if id <= faulty { fault } else { Fault::None };
        let sh = sh.clone();
        let _ = thread::Builder::new()
            .name(format!("relay-{id}"))
            .spawn(move || serve(id, client, up, fault, sh));
    }
}

/// Connects to the upstream, registers the link, and pumps both directions (ToHost on a second thread).
fn serve(id: usize, client: TcpStream, up: SocketAddr, fault: Fault, shared: Arc<Shared>) {
    let Ok(upstream) = TcpStream::connect(up) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let closed = AtomicBool::new(false);
    let link = Arc::new(Link {
        client,
        upstream,
        fault,
        closed,
        shared,
    });
    {
        let mut links = link.shared.links();
        if link.shared.stop.load(Ordering::SeqCst) {
            return link.close();
        }
        links.insert(id, link.clone());
    }
    let back = link.clone();
    let spawned = thread::Builder::new()
        .name(format!("relay-{id}-back"))
        .spawn(move || pump(&back, Dir::ToHost));
    if spawned.is_ok() {
        pump(&link, Dir::ToWorker);
    }
    link.close();
    link.shared.links().remove(&id);
}

/// Forwards one direction of `link` until EOF, an error, or a CloseAfter fault; then closes the link.
fn pump(link: &Link, dir: Dir) {
    let (mut src, mut dst) = match dir {
        Dir::ToWorker => (&link.client, &link.upstream),
        Dir::ToHost => (&link.upstream, &link.client),
    };
    let fault = link.fault.for_dir(dir);
    let counter = &link.shared.bytes[dir as usize];
    let mut send = |bytes: &[u8]| {
        counter.fetch_add(bytes.len() as u64, Ordering::SeqCst);
        bytes.is_empty() || dst.write_all(bytes).is_ok()
    };
    let mut buf = vec![0u8; 64 * 1024];
    let mut off = 0u64; // bytes of this direction read so far
    let mut next_chunk = Instant::now();
    loop {
        if matches!(fault, Fault::CloseAfter { after, .. } if off >= after) {
            break;
        }
        let n = match src.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        let start = off;
        off += n as u64;
        let data = &mut buf[..n];
        // Index into `data` of stream offset `x`, clamped to this read.
        let at = |x: u64| x.saturating_sub(start).min(n as u64) as usize;
        let ok = match fault {
            Fault::None => send(data),
            Fault::FlipByte { at: x, .. } => {
                if (start..off).contains(&x) {
                    data[(x - start) as usize] ^= 0x01;
                }
                send(data)
            }
            Fault::DropBytes { at: x, len, .. } => {
                let (a, b) = (at(x), at(x.saturating_add(len)));
                send(&data[..a]) && send(&data[b..])
            }
            Fault::Trickle {
                after,
                chunk,
                every,
                ..
            } => {
                let k = at(after);
                send(&data[..k])
                    && data[k..].chunks(chunk.max(1)).all(|piece| {
                        let ok = sleep_until(link, next_chunk) && send(piece);
                        next_chunk = Instant::now() + every;
                        ok
                    })
            }
            Fault::Stall { after, .. } | Fault::CloseAfter { after, .. } => {
                send(&data[..at(after)])
            }
        };
        if !ok {
            break;
        }
    }
    link.close();
}

/// Sleeps until `deadline` in slices of at most 10 ms; false if the link was closed meanwhile.
fn sleep_until(link: &Link, deadline: Instant) -> bool {
    loop {
        let now = Instant::now();
        if link.closed.load(Ordering::SeqCst) || now >= deadline {
            return !link.closed.load(Ordering::SeqCst);
        }
        thread::sleep((deadline - now).min(Duration::from_millis(10)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver};

    /// An echo server on 127.0.0.1:0; each connection's received bytes go on the channel when it ends.
    fn echo_server() -> (SocketAddr, Receiver<Vec<u8>>) {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let (addr, (tx, rx)) = (listener.local_addr().unwrap(), channel());
        thread::spawn(move || {
            for mut s in listener.incoming().flatten() {
                let tx = tx.clone();
                thread::spawn(move || {
                    let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        got.extend_from_slice(&buf[..n]);
                        if s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = tx.send(got);
                });
            }
        });
        (addr, rx)
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + 3) as u8).collect()
    }

    /// Connects through the relay and writes `data`.
    fn send(relay: &Relay, data: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect(relay.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.write_all(data).unwrap();
        s
    }

    fn recv(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut got = vec![0u8; n];
        s.read_exact(&mut got).unwrap();
        got
    }

    /// Reads until the relay closes the stream (EOF or reset); panics on a timeout.
    fn read_until_closed(s: &mut TcpStream) -> Vec<u8> {
        let (mut got, mut buf) = (Vec::new(), [0u8; 4096]);
        loop {
            match s.read(&mut buf) {
                Ok(0) => return got,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return got,
                Err(e) => panic!("stream not closed: {e}"),
            }
        }
    }

    #[test]
    fn flip_and_drop_alter_exactly_the_chosen_bytes() {
        let (up, _) = echo_server();
        let data = pattern(100);
        let mut flipped = data.clone();
        flipped[5] ^= 0x01;
        let dropped: Vec<u8> = data[..10].iter().chain(&data[30..]).copied().collect();
        for dir in [Dir::ToWorker, Dir::ToHost] {
            let relay = Relay::start(up, Fault::FlipByte { dir, at: 5 }, 1).unwrap();
            assert_eq!(recv(&mut send(&relay, &data), 100), flipped);
            assert_eq!(
                (relay.bytes(Dir::ToWorker), relay.bytes(Dir::ToHost)),
                (100, 100)
            );

            let relay = Relay::start(
                up,
                Fault::DropBytes {
                    dir,
                    at: 10,
                    len: 20,
                },
                1,
            )
            .unwrap();
            assert_eq!(recv(&mut send(&relay, &data), 80), dropped);
            let to_worker = if dir == Dir::ToWorker { 80 } else { 100 };
            assert_eq!(
                (relay.bytes(Dir::ToWorker), relay.bytes(Dir::ToHost)),
                (to_worker, 80)
            );
        }
    }

    #[test]
    fn trickle_honours_the_pace() {
        let (up, _) = echo_server();
        let every = Duration::from_millis(50);
        let fault = Fault::Trickle {
            dir: Dir::ToWorker,
            after: 0,
            chunk: 3,
            every,
        };
        let relay = Relay::start(up, fault, 1).unwrap();
        let (data, t) = (pattern(10), Instant::now());
        assert_eq!(recv(&mut send(&relay, &data), 10), data);
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(150),
            "4 chunks 50 ms apart took {took:?}"
        );
        assert!(took < Duration::from_secs(1), "trickle too slow: {took:?}");
    }

    #[test]
    fn stall_delivers_the_prefix_then_nothing_while_open() {
        let (up, _) = echo_server();
        let relay = Relay::start(
            up,
            Fault::Stall {
                dir: Dir::ToHost,
                after: 10,
            },
            1,
        )
        .unwrap();
        let data = pattern(30);
        let mut s = send(&relay, &data);
        assert_eq!(recv(&mut s, 10), data[..10]);
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let e = s
            .read(&mut [0u8; 64])
            .expect_err("stalled stream delivered bytes or EOF");
        assert!(
            matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
            "{e}"
        );
        s.write_all(&data).unwrap(); // still open: goes up, comes back, is discarded
        assert_eq!(relay.bytes(Dir::ToHost), 10);
        let mut clean = send(&relay, b"ok"); // a clean connection still passes meanwhile
        assert_eq!(recv(&mut clean, 2), b"ok");
    }

    #[test]
    fn close_after_cuts_the_connection() {
        let (up, rx) = echo_server();
        let data = pattern(30);
        let relay = Relay::start(
            up,
            Fault::CloseAfter {
                dir: Dir::ToWorker,
                after: 10,
            },
            1,
        )
        .unwrap();
        let got = read_until_closed(&mut send(&relay, &data));
        assert!(got.len() <= 10 && data.starts_with(&got), "got {got:?}");
        assert_eq!(rx.recv_timeout(Duration::from_secs(2)).unwrap(), data[..10]);
        assert_eq!(relay.bytes(Dir::ToWorker), 10);

        let relay = Relay::start(
            up,
            Fault::CloseAfter {
                dir: Dir::ToHost,
                after: 10,
            },
            1,
        )
        .unwrap();
        assert_eq!(read_until_closed(&mut send(&relay, &data)), data[..10]);
        assert_eq!(relay.bytes(Dir::ToHost), 10);
    }

    #[test]
    fn only_the_first_connections_are_faulty() {
        let (up, _) = echo_server();
        let relay = Relay::start(
            up,
            Fault::FlipByte {
                dir: Dir::ToHost,
                at: 0,
            },
            1,
        )
        .unwrap();
        let data = pattern(100);
        let got = recv(&mut send(&relay, &data), 100);
        assert_eq!((got[0], &got[1..]), (data[0] ^ 0x01, &data[1..]));
        assert_eq!(recv(&mut send(&relay, &data), 100), data);
        assert_eq!(relay.connections(), 2);
        assert_eq!(relay.bytes(Dir::ToHost), 200);
    }

    #[test]
    fn drop_is_prompt_and_closes_open_connections() {
        let (up, _) = echo_server();
        let every = Duration::from_secs(10);
        let fault = Fault::Trickle {
            dir: Dir::ToHost,
            after: 0,
            chunk: 1,
            every,
        };
        let relay = Relay::start(up, fault, 1).unwrap();
        let mut s = send(&relay, b"ab");
        assert_eq!(recv(&mut s, 1), b"a"); // "b" now waits 10 s in the relay
        let t = Instant::now();
        drop(relay);
        let took = t.elapsed();
        assert!(took < Duration::from_millis(100), "drop took {took:?}");
        assert_eq!(read_until_closed(&mut s), b"");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "closed late: {:?}",
            t.elapsed()
        );
    }
}
