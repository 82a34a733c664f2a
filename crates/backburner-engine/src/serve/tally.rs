//! Counting outcomes once: every choice of a request (`n` > 1: [`super::Job::siblings`]) ends in exactly one
//! sequence outcome ([`Metrics::sequences_ok`] …), and the request in exactly one request outcome
//! ([`Metrics::requests_ok`] …), counted when its last choice ends: the worst of its choices' (failed, then invalid,
//! then cancelled, then ok).
//!
//! A [`Ticket`] goes with each job the scheduler holds: choice 0 with the siblings not split off yet, or one choice
//! split off ([`Ticket::split`]). [`Ticket::close`] ends all of its choices with one outcome (a job's siblings that
//! never started end as it did); a ticket dropped open (a waiting choice dropped because it was cancelled, the
//! scheduler gone) ends them as cancelled.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use super::metrics::Metrics;

/// How a choice, or a request, ended (worse ones later).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Outcome {
    /// Finished normally (eos, max tokens, stop string, full context).
    Ok = 0,
    /// Cancelled (client gone, shutdown).
    Cancelled = 1,
    /// Refused by the engine's checks.
    Invalid = 2,
    /// Failed in the engine.
    Failed = 3,
}

/// What the choices of one request share.
struct Tally {
    metrics: Arc<Metrics>,
    /// The request's id.
    request: String,
    /// Choices not ended yet.
    left: AtomicUsize,
    /// The worst outcome so far ([`Outcome`] as `u8`).
    worst: AtomicU8,
}

/// One job's share of its request's choices (see the module's doc).
pub(super) struct Ticket {
    tally: Arc<Tally>,
    /// The first choice it holds (its job's index in the request).
    pub(super) choice: usize,
    /// Choices it holds that have not ended.
    open: usize,
}

impl Ticket {
    /// A request `request` of `choices` choices (≥ 1), all held by this ticket.
    pub(super) fn new(metrics: &Arc<Metrics>, request: &str, choices: usize) -> Ticket {
        let choices = choices.max(1);
        Ticket {
            tally: Arc::new(Tally {
                metrics: metrics.clone(),
                request: request.to_string(),
                left: AtomicUsize::new(choices),
                worst: AtomicU8::new(Outcome::Ok as u8),
            }),
            choice: 0,
            open: choices,
        }
    }

    /// The request's id (its choice 0's job id).
    pub(super) fn request(&self) -> &str {
        &self.tally.request
    }

    /// Choice `choice` (one of the siblings this ticket holds) goes its own way, with a ticket of its own.
    pub(super) fn split(&mut self, choice: usize) -> Ticket {
        debug_assert!(self.open > 1, "a sibling to split off");
        self.open = self.open.saturating_sub(1);
        Ticket {
            tally: self.tally.clone(),
            choice,
            open: 1,
        }
    }

    /// Ends every choice still held with `o` (nothing once closed).
    pub(super) fn close(&mut self, o: Outcome) {
        let k = std::mem::take(&mut self.open);
        if k == 0 {
            return;
        }
        let t = &*self.tally;
        let m = &*t.metrics;
        let seq = match o {
            Outcome::Ok => &m.sequences_ok,
            Outcome::Cancelled => &m.sequences_cancelled,
            Outcome::Invalid => &m.sequences_invalid,
            Outcome::Failed => &m.sequences_failed,
        };
        Metrics::add(seq, k as u64);
        let worst = t.worst.fetch_max(o as u8, Relaxed).max(o as u8);
        if t.left.fetch_sub(k, Relaxed) == k {
            let req = match worst {
                0 => &m.requests_ok,
                1 => &m.requests_cancelled,
                2 => &m.requests_invalid,
                _ => &m.requests_failed,
            };
            Metrics::add(req, 1);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.close(Outcome::Cancelled);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(m: &Metrics) -> [u64; 8] {
        let g = Metrics::get;
        [
            g(&m.requests_ok),
            g(&m.requests_cancelled),
            g(&m.requests_invalid),
            g(&m.requests_failed),
            g(&m.sequences_ok),
            g(&m.sequences_cancelled),
            g(&m.sequences_invalid),
            g(&m.sequences_failed),
        ]
    }

    #[test]
    fn a_request_counts_once_with_its_worst_choice_and_each_choice_once() {
        let m = Arc::new(Metrics::default());
        let mut t = Ticket::new(&m, "r", 2);
        let mut c1 = t.split(1);
        assert_eq!((c1.choice, c1.request()), (1, "r"));
        t.close(Outcome::Ok);
        t.close(Outcome::Failed); // closed already: nothing
        assert_eq!(counts(&m), [0, 0, 0, 0, 1, 0, 0, 0]);
        c1.close(Outcome::Ok);
        assert_eq!(counts(&m), [1, 0, 0, 0, 2, 0, 0, 0]);
        // choice 0 ends with two siblings never started: they end as it did; a split one dropped is cancelled
        let mut t = Ticket::new(&m, "s", 4);
        let c3 = t.split(3);
        t.close(Outcome::Failed);
        drop(c3);
        assert_eq!(counts(&m), [1, 0, 0, 1, 2, 1, 0, 3]);
        drop(Ticket::new(&m, "u", 2));
        assert_eq!(counts(&m), [1, 1, 0, 1, 2, 3, 0, 3]);
    }
}
