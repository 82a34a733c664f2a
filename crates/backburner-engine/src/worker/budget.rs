//! The worker's memory budget: the weights of the layers it loads, every byte of session state (KV rows, linear
//! states) and every transient buffer of a request (a received frame, a fetch's payload) are reserved here before
//! they are allocated.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A reservation did not fit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "{what} needs {need} more bytes; the worker holds {used} of its --max-memory {limit} bytes"
)]
pub struct OverBudget {
    /// What was being reserved.
    pub what: &'static str,
    /// Bytes asked for.
    pub need: u64,
    /// Bytes reserved when it was asked.
    pub used: u64,
    /// The budget.
    pub limit: u64,
}

/// Frees memory held elsewhere when a reservation of the given bytes does not fit (the worker evicts an idle
/// session); returns whether it freed anything worth waiting for (false when even evicting every idle session could
/// not make the bytes fit).
pub type MakeRoom = Arc<dyn Fn(u64) -> bool + Send + Sync>;

/// Most rounds of eviction one reservation may trigger.
const MAX_ROUNDS: usize = 64;

/// A byte budget shared by all sessions of a worker.
#[derive(Debug)]
pub struct MemoryBudget {
    limit: u64,
    used: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(MemoryBudget {
            limit,
            used: AtomicU64::new(0),
        })
    }

    /// Bytes reserved now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The limit (bytes).
    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn take(&self, bytes: u64, what: &'static str) -> Result<(), OverBudget> {
        let mut cur = self.used.load(Ordering::Acquire);
        loop {
            let next = cur
                .checked_add(bytes)
                .filter(|n| *n <= self.limit)
                .ok_or(OverBudget {
                    what,
                    need: bytes,
                    used: cur,
                    limit: self.limit,
                })?;
            match self
                .used
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => cur = now,
            }
        }
    }

    fn give(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }

    /// Waits up to 500 ms for `bytes` more to fit (memory freed by an evicted session's thread).
    fn wait_for(&self, bytes: u64) {
        let until = std::time::Instant::now() + std::time::Duration::from_millis(500);
        while std::time::Instant::now() < until && self.used().saturating_add(bytes) > self.limit {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// As [`MemoryBudget::reserve`], but when `bytes` do not fit, asks `room` to free memory (and waits for it) until
    /// they fit or `room` has nothing left to free.
    pub fn reserve_with(
        self: &Arc<Self>,
        bytes: u64,
        what: &'static str,
        room: Option<&MakeRoom>,
    ) -> Result<Reservation, OverBudget> {
        let mut rounds = 0;
        loop {
            let e = match self.reserve(bytes, what) {
                Ok(r) => return Ok(r),
                Err(e) => e,
            };
            rounds += 1;
            match room {
                Some(f) if rounds <= MAX_ROUNDS && f(bytes) => self.wait_for(bytes),
                _ => return Err(e),
            }
        }
    }

    /// Reserves `bytes`, released when the returned value is dropped. Errors: [`OverBudget`].
    pub fn reserve(
        self: &Arc<Self>,
        bytes: u64,
        what: &'static str,
    ) -> Result<Reservation, OverBudget> {
        self.take(bytes, what)?;
        Ok(Reservation {
            budget: self.clone(),
            bytes,
            what,
        })
    }
}

/// Bytes held against a [`MemoryBudget`] until dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<MemoryBudget>,
    bytes: u64,
    what: &'static str,
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Holds exactly `bytes` from now on (grows or shrinks). Errors: [`OverBudget`] when growing does not fit (the
    /// reservation is then unchanged).
    pub fn resize(&mut self, bytes: u64) -> Result<(), OverBudget> {
        if bytes > self.bytes {
            self.budget.take(bytes - self.bytes, self.what)?;
        } else {
            self.budget.give(self.bytes - bytes);
        }
        self.bytes = bytes;
        Ok(())
    }
}

impl Reservation {
    /// As [`Reservation::resize`], asking `room` to free memory when growing does not fit.
    pub fn resize_with(&mut self, bytes: u64, room: Option<&MakeRoom>) -> Result<(), OverBudget> {
        let mut rounds = 0;
        loop {
            let e = match self.resize(bytes) {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            rounds += 1;
            let more = bytes.saturating_sub(self.bytes);
            match room {
                Some(f) if rounds <= MAX_ROUNDS && f(more) => self.budget.wait_for(more),
                _ => return Err(e),
            }
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.budget.give(self.bytes);
    }
}

/// The default memory budget of a worker (weights and state): half the machine's physical memory (from `/proc/meminfo`), or 4 GiB where
/// that cannot be read.
pub fn default_max_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(512)
        })
        .unwrap_or(4 << 30)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_add_up_and_release_on_drop() {
        let b = MemoryBudget::new(100);
        let mut a = b.reserve(60, "a").unwrap();
        let e = b.reserve(41, "b").unwrap_err();
        assert_eq!((e.need, e.used, e.limit), (41, 60, 100));
        let c = b.reserve(40, "c").unwrap();
        assert_eq!(b.used(), 100);
        assert!(a.resize(61).is_err());
        assert_eq!(a.bytes(), 60);
        a.resize(10).unwrap();
        assert_eq!(b.used(), 50);
        drop(c);
        assert_eq!(b.used(), 10);
        assert!(b.reserve(u64::MAX, "huge").is_err());
        drop(a);
        assert_eq!(b.used(), 0);
        assert!(default_max_memory() >= 1 << 20);
    }
}
