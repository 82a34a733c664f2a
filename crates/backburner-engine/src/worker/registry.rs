//! Who is connected to a worker: connections still in their handshake (unauthenticated, capped, oldest dropped
//! first) and sessions (authenticated, capped by `--max-sessions`, the least recently active idle one evicted when
//! another needs its memory).

use std::collections::{HashMap, VecDeque};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// What the registry and a session's own thread share.
#[derive(Debug)]
pub(crate) struct SessionFlags {
    /// Waiting for the host's next request (safe to evict).
    pub idle: AtomicBool,
    /// Set before the registry shuts the session's socket to make room.
    pub evicted: AtomicBool,
    /// Milliseconds since the registry's epoch of the last request.
    pub last_active_ms: AtomicU64,
    /// Bytes the session holds against the budget (as of its last request).
    pub bytes: AtomicU64,
    /// Whether the session holds offloaded KV pages (evicting it costs its host a re-ingest: evicted last).
    pub holds_pages: AtomicBool,
}

#[derive(Debug)]
struct Entry {
    handle: TcpStream,
    flags: Arc<SessionFlags>,
}

#[derive(Debug, Default)]
struct Inner {
    next_pending: u64,
    pending: VecDeque<(u64, TcpStream)>,
    sessions: HashMap<u64, Entry>,
}

/// Connections and sessions of one worker.
#[derive(Debug)]
pub(crate) struct Registry {
    inner: Mutex<Inner>,
    max_pending: usize,
    max_sessions: usize,
    epoch: Instant,
}

impl Registry {
    pub fn new(max_pending: usize, max_sessions: usize) -> Arc<Self> {
        Arc::new(Registry {
            inner: Mutex::new(Inner::default()),
            max_pending: max_pending.max(1),
            max_sessions: max_sessions.max(1),
            epoch: Instant::now(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection in its handshake; over the cap, the oldest such connection is shut down (a host's
    /// handshake takes a few round trips, so only a flood of new connections can push it out).
    pub fn admit(self: &Arc<Self>, handle: TcpStream) -> PendingGuard {
        let mut g = self.lock();
        g.next_pending += 1;
        let id = g.next_pending;
        g.pending.push_back((id, handle));
        while g.pending.len() > self.max_pending {
            if let Some((_, old)) = g.pending.pop_front() {
                let _ = old.shutdown(Shutdown::Both);
            }
        }
        PendingGuard {
            reg: self.clone(),
            id,
        }
    }

    /// Opens a session slot. Errors: a message when `--max-sessions` sessions are open.
    pub fn open_session(
        self: &Arc<Self>,
        id: u64,
        handle: TcpStream,
    ) -> Result<SessionGuard, String> {
        let mut g = self.lock();
        if g.sessions.contains_key(&id) {
            return Err(format!("session id {id} is in use (try again)"));
        }
        if g.sessions.len() >= self.max_sessions {
            return Err(format!(
                "this worker serves {} sessions, its --max-sessions",
                self.max_sessions
            ));
        }
        let flags = Arc::new(SessionFlags {
            idle: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            last_active_ms: AtomicU64::new(self.now_ms()),
            bytes: AtomicU64::new(0),
            holds_pages: AtomicBool::new(false),
        });
        g.sessions.insert(
            id,
            Entry {
                handle,
                flags: flags.clone(),
            },
        );
        Ok(SessionGuard {
            reg: self.clone(),
            id,
            flags,
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Makes room for `need` more bytes of `budget` by evicting (sessions without KV pages first) the least recently
    /// active idle session other than `me` (it is marked and its socket's reading side shut, so its thread wakes, tells its host `Evicted` and drops
    /// its state). Returns false, evicting nothing, when even every idle session's bytes could not make `need` fit;
    /// true when a session was evicted or evicted ones are still freeing their memory.
    pub fn evict_idle_except(&self, me: u64, need: u64, budget: &super::MemoryBudget) -> bool {
        let g = self.lock();
        let others = || g.sessions.iter().filter(|(id, _)| **id != me);
        let freeable: u64 = others()
            .filter(|(_, e)| {
                e.flags.idle.load(Ordering::Acquire) || e.flags.evicted.load(Ordering::Acquire)
            })
            .map(|(_, e)| e.flags.bytes.load(Ordering::Acquire))
            .sum();
        if budget.used().saturating_sub(freeable).saturating_add(need) > budget.limit() {
            return false;
        }
        let victim = others()
            .filter(|(_, e)| e.flags.idle.load(Ordering::Acquire))
            .filter(|(_, e)| !e.flags.evicted.load(Ordering::Acquire))
            .min_by_key(|(_, e)| {
                (
                    e.flags.holds_pages.load(Ordering::Acquire),
                    e.flags.last_active_ms.load(Ordering::Acquire),
                )
            });
        match victim {
            Some((_, e)) => {
                e.flags.evicted.store(true, Ordering::Release);
                let _ = e.handle.shutdown(Shutdown::Read);
                true
            }
            // sessions evicted earlier may still be dropping their state
            None => others().any(|(_, e)| e.flags.evicted.load(Ordering::Acquire)),
        }
    }

    /// Open sessions and connections in their handshake.
    pub fn counts(&self) -> (usize, usize) {
        let g = self.lock();
        (g.sessions.len(), g.pending.len())
    }
}

/// Removes a handshake connection from the registry when dropped.
pub(crate) struct PendingGuard {
    reg: Arc<Registry>,
    id: u64,
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.reg.lock().pending.retain(|(i, _)| *i != self.id);
    }
}

/// A session's slot; closes it when dropped.
pub(crate) struct SessionGuard {
    reg: Arc<Registry>,
    id: u64,
    flags: Arc<SessionFlags>,
}

impl SessionGuard {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Marks the session idle (waiting for a request) or busy; a busy session is stamped as just active.
    pub fn set_idle(&self, idle: bool) {
        if !idle {
            self.flags
                .last_active_ms
                .store(self.reg.now_ms(), Ordering::Release);
        }
        self.flags.idle.store(idle, Ordering::Release);
    }

    /// Records the bytes the session holds (for eviction decisions).
    pub fn set_bytes(&self, bytes: u64) {
        self.flags.bytes.store(bytes, Ordering::Release);
    }

    /// Records whether the session holds offloaded KV pages (such sessions are evicted only when no other idle one
    /// is left).
    pub fn set_holds_pages(&self, holds: bool) {
        self.flags.holds_pages.store(holds, Ordering::Release);
    }

    /// Whether the registry evicted this session.
    pub fn evicted(&self) -> bool {
        self.flags.evicted.load(Ordering::Acquire)
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.reg.lock().sessions.remove(&self.id);
    }
}
