//! Whole-message deadlines on a blocking socket: the deadline type, the pace a worker holds requests to, and the
//! socket timeouts that enforce them with as few system calls as possible.

use std::io::Read;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::error::LinkError;

/// A point in time by which a whole message must have been read or written, and the budget it was set from (for
/// the error message).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    pub(crate) at: Instant,
    pub(crate) budget: Duration,
}

impl Deadline {
    pub(crate) fn after(budget: Duration) -> Self {
        Deadline {
            // a budget past what the clock can represent (a huge flag value) is as good as none
            at: Instant::now()
                .checked_add(budget.min(FOREVER))
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400)),
            budget,
        }
    }

    /// Time left, or the timeout error.
    pub(crate) fn left(&self) -> std::io::Result<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        Ok(left.max(Duration::from_millis(1)))
    }
}

/// The longest deadline budget honoured (about 30 years): larger ones are clamped, never an overflow.
pub(crate) const FOREVER: Duration = Duration::from_secs(30 * 365 * 86_400);

/// How long a frame may take once its first byte has arrived: `base + bytes / min_rate`. Set on a worker, whose
/// idle wait between requests is long but whose requests must arrive at a useful pace.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pace {
    /// Fixed allowance per frame.
    pub base: Duration,
    /// Slowest accepted transfer rate (bytes per second, > 0).
    pub min_rate: u64,
}

impl Pace {
    /// The allowance for `bytes` bytes.
    pub fn allowance(&self, bytes: usize) -> Duration {
        let t = (bytes as f64 / self.min_rate.max(1) as f64).min(FOREVER.as_secs_f64());
        self.base.saturating_add(Duration::from_secs_f64(t))
    }
}

/// Fixed slack by which a socket timeout may exceed the time left before a deadline.
const SLACK: Duration = Duration::from_millis(10);

/// The socket timeout to apply when `want` is left before the deadline (None = no deadline), given the one
/// `applied` last: `Some(new)` when it must change, `None` when the applied one can stay. An applied timeout is never
/// shorter than the time left and at most 1/64 of it plus [`SLACK`] longer (so a deadline holds within that);
/// new ones are rounded up to 10 ms, so successive messages with the same budget reuse it and cost no system call.
pub(crate) fn retime(
    applied: Option<Option<Duration>>,
    want: Option<Duration>,
) -> Option<Option<Duration>> {
    match (applied, want) {
        (Some(None), None) => None,
        (Some(Some(a)), Some(w)) if a >= w && a <= w + w / 64 + SLACK => None,
        (_, Some(w)) => {
            let ms = u64::try_from(w.as_millis()).unwrap_or(u64::MAX / 2);
            Some(Some(Duration::from_millis(
                ms.div_ceil(10).saturating_add(1).saturating_mul(10),
            )))
        }
        (_, None) => Some(None),
    }
}

/// The socket under the reader: every read waits at most until the deadline (within the slack of [`retime`]).
#[derive(Debug)]
pub(crate) struct DeadlineStream {
    pub(crate) s: TcpStream,
    pub(crate) deadline: Option<Deadline>,
    pub(crate) applied: Option<Option<Duration>>,
}

impl DeadlineStream {
    fn set_timeout(&mut self, t: Option<Duration>) -> std::io::Result<()> {
        if let Some(t) = retime(self.applied, t) {
            self.s.set_read_timeout(t)?;
            self.applied = Some(t);
        }
        Ok(())
    }
}

impl Read for DeadlineStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let t = self.deadline.map(|d| d.left()).transpose()?;
        self.set_timeout(t)?;
        self.s.read(buf)
    }
}

pub(crate) fn map_io(e: std::io::Error, d: Option<Deadline>) -> LinkError {
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            LinkError::Timeout(d.map(|d| d.budget).unwrap_or_default())
        }
        _ => LinkError::Io(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_timeouts_are_never_shorter_than_the_time_left_and_rarely_reset() {
        let ms = Duration::from_millis;
        // first use, and a change between a deadline and none, always apply
        assert_eq!(retime(None, Some(ms(60_000))), Some(Some(ms(60_010))));
        assert_eq!(retime(None, None), Some(None));
        assert_eq!(retime(Some(Some(ms(5))), None), Some(None));
        assert_eq!(retime(Some(None), Some(ms(7))), Some(Some(ms(20))));
        // the same budget again (a little less left): kept
        assert_eq!(retime(Some(Some(ms(60_010))), Some(ms(59_999))), None);
        assert_eq!(retime(Some(None), None), None);
        // more left than applied: reset upward; far less left: reset downward
        assert_eq!(
            retime(Some(Some(ms(60_010))), Some(ms(60_011))),
            Some(Some(ms(60_030)))
        );
        assert_eq!(
            retime(Some(Some(ms(60_010))), Some(ms(1_000))),
            Some(Some(ms(1_010)))
        );
        // never shorter than what is left
        for w in [1u64, 9, 10, 11, 99, 1000, 123_456] {
            let Some(Some(a)) = retime(None, Some(ms(w))) else {
                panic!()
            };
            assert!(a >= ms(w) && a <= ms(w) + ms(20), "{w}: {a:?}");
        }
    }
}

#[cfg(test)]
mod huge {
    use super::*;

    #[test]
    fn huge_budgets_are_clamped_not_overflowed() {
        for b in [
            Duration::MAX,
            Duration::from_secs(u64::MAX),
            FOREVER,
            Duration::from_secs(1),
        ] {
            let d = Deadline::after(b);
            assert!(d.left().unwrap() > Duration::ZERO);
        }
        let p = Pace {
            base: Duration::MAX,
            min_rate: 1,
        };
        assert_eq!(p.allowance(usize::MAX), Duration::MAX);
        let p = Pace {
            base: Duration::from_secs(30),
            min_rate: 0,
        };
        assert!(p.allowance(usize::MAX) <= Duration::from_secs(30) + FOREVER);
    }
}
