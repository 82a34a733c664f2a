//! The layer split's workers while no request runs: idle health pings, and reconnecting a failed worker once its
//! backoff ends, so that a server's `/health` follows a worker going away and coming back without waiting for a
//! request to find out.

use std::time::Duration;

use backburner_model::ModelConfig;

use super::{LayerSplit, StageError};
use crate::connection::SessionShape;

impl LayerSplit {
    /// A health check while idle, per worker in chain order (the error as text; each connect, handshake and ping
    /// waits at most [`crate::connection::HEALTH_PING_TIMEOUT`]): the round trip of an empty `Ping` on an open
    /// connection; for a worker whose last exchange failed and whose backoff has ended, a fresh connection (a new
    /// session at position 0: the next request sees the workers' state is not the host's and re-ingests the
    /// history, as after any loss). `None` for a worker not tried: never connected yet (connections are made by the
    /// first request), or still backing off.
    ///
    /// A failed ping or connect fails the chain as a failed request does ([`LayerSplit::fail`]): every worker
    /// session closes and the failed worker backs off.
    pub fn probe(
        &mut self,
        cfg: &ModelConfig,
        shape: SessionShape,
    ) -> Vec<Option<Result<Duration, String>>> {
        let cap = crate::connection::HEALTH_PING_TIMEOUT;
        let saved: Vec<Duration> = self
            .stages
            .iter_mut()
            .map(|s| {
                let t = s.link.settings.timeout.min(cap);
                s.link.swap_timeout(t)
            })
            .collect();
        let out = self.probe_capped(cfg, shape);
        for (s, t) in self.stages.iter_mut().zip(saved) {
            s.link.swap_timeout(t);
        }
        out
    }

    /// [`LayerSplit::probe`] with the timeouts capped.
    fn probe_capped(
        &mut self,
        cfg: &ModelConfig,
        shape: SessionShape,
    ) -> Vec<Option<Result<Duration, String>>> {
        let mut out: Vec<Option<Result<Duration, String>>> =
            (0..self.stages.len()).map(|_| None).collect();
        let reconnect = self
            .stages
            .iter()
            .any(|s| s.link.failing() && s.link.available() && !s.link.is_connected());
        if reconnect {
            let t = std::time::Instant::now();
            match self.connect(cfg, shape) {
                Ok(()) => {
                    for s in &mut self.stages {
                        s.link.succeeded();
                    }
                    out.fill_with(|| Some(Ok(t.elapsed())));
                }
                Err(e) => {
                    let stage = e.stage;
                    out[stage] = Some(Err(e.error.to_string()));
                    self.fail(&e);
                }
            }
            return out;
        }
        let mut failed = None;
        for (i, (s, slot)) in self.stages.iter_mut().zip(out.iter_mut()).enumerate() {
            if !s.link.is_connected() {
                continue;
            }
            match s.link.ping(&[]) {
                Ok(d) => *slot = Some(Ok(d)),
                Err(error) => {
                    *slot = Some(Err(error.to_string()));
                    failed = Some(StageError {
                        stage: i,
                        error,
                        connecting: false,
                    });
                    break;
                }
            }
        }
        if let Some(e) = failed {
            self.fail(&e);
        }
        out
    }

    /// Workers whose last exchange failed: `(address, layers, why)`.
    pub fn failing(&self) -> Vec<(String, std::ops::Range<usize>, String)> {
        self.stages
            .iter()
            .filter(|s| s.link.failing())
            .map(|s| {
                let why = s.link.last_error().unwrap_or("unreachable").to_string();
                (s.addr().to_string(), s.range(), why)
            })
            .collect()
    }
}
