//! Transient worker faults under a KV budget: a request that lost a worker's session is retried once on a fresh
//! connection, and a request whose pages can only go to workers waiting out a backoff waits for it (at most
//! [`MAX_BACKOFF_WAIT`], once per request) instead of failing. The server's scheduler asks
//! [`Session::worker_wait`] before a step, so that such a wait delays that slot only.

use std::time::Duration;

use crate::connection::MAX_BACKOFF_WAIT;
use crate::session::Session;

impl Session {
    /// How long a prefill or decode step of `add` tokens would wait for a worker's backoff before it can run: KV
    /// offload must move pages for it (the host's budget cannot hold them), no worker that could take them may be
    /// tried now, and the first backoff to end does so within [`MAX_BACKOFF_WAIT`]. `None` when the step runs at
    /// once (or fails at once, with a backoff past that limit).
    ///
    /// [`Session::prefill`] waits that long itself; the server's scheduler defers the step instead, so that the
    /// other slots' steps go on meanwhile.
    pub fn worker_wait(&self, add: usize) -> Option<Duration> {
        let budget = self.budget_positions()?;
        let on_host = if self.rebuild {
            self.history.len()
        } else {
            self.state.n_tokens() - self.state.offloaded()
        };
        if on_host.saturating_add(add) <= budget {
            return None;
        }
        let from = match self.rebuild {
            true => 0,
            false => self.placement.open_worker().unwrap_or(0),
        };
        let ws = self.lock_workers();
        let mut soonest: Option<Duration> = None;
        for w in ws.iter().skip(from) {
            let d = w.retry_in()?;
            soonest = Some(soonest.map_or(d, |s| s.min(d)));
        }
        soonest.filter(|&d| d <= MAX_BACKOFF_WAIT)
    }

    /// Sessions each worker has lost so far (see [`crate::WorkerClient::sessions_lost`]).
    pub(crate) fn sessions_lost(&self) -> Vec<u64> {
        self.lock_workers()
            .iter()
            .map(|w| w.sessions_lost())
            .collect()
    }

    /// The workers that lost a session since `before` ([`Session::sessions_lost`]).
    pub(crate) fn lost_since(&self, before: &[u64]) -> Vec<usize> {
        self.lock_workers()
            .iter()
            .enumerate()
            .filter(|(i, w)| w.sessions_lost() > before.get(*i).copied().unwrap_or(0))
            .map(|(i, _)| i)
            .collect()
    }

    /// Lets `workers` (indices) reconnect at once for the request's one retry.
    pub(crate) fn retry_now(&mut self, workers: &[usize]) {
        self.offload_stats.offload_retries += 1;
        let mut ws = self.lock_workers();
        for &i in workers {
            if let Some(w) = ws.get_mut(i) {
                tracing::warn!(
                    worker = %w.settings().addr,
                    "retrying the request once on a fresh connection to the worker"
                );
                w.link.retry_now();
            }
        }
    }

    /// Waits for the nearest of the backoffs that kept the workers from taking pages (`soonest`), if it ends within
    /// [`MAX_BACKOFF_WAIT`] and this request has not waited yet. True when it waited (the caller tries again).
    pub(crate) fn wait_for_backoff(&mut self, soonest: Option<Duration>) -> bool {
        let Some(d) = soonest.filter(|&d| d <= MAX_BACKOFF_WAIT && !self.backoff_waited) else {
            return false;
        };
        self.backoff_waited = true;
        self.offload_stats.backoff_waits += 1;
        tracing::info!(
            "KV offload: waiting {d:?} for a worker's backoff to end before moving pages"
        );
        std::thread::sleep(d);
        true
    }
}

/// Why a worker in backoff did not take pages: when it may be tried again, and whether a request waits for that.
pub(crate) fn backoff_reason(addr: &str, left: Duration) -> String {
    let secs = left.as_secs_f64();
    if left <= MAX_BACKOFF_WAIT {
        format!("{addr} failed recently and is retried after its backoff (in {secs:.1} s)")
    } else {
        format!(
            "{addr} failed recently and is retried after its backoff (in {secs:.1} s; a request waits at most {} s for it)",
            MAX_BACKOFF_WAIT.as_secs()
        )
    }
}
