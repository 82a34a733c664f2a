//! Admission: a job taken from the queue goes to the free slot holding the longest reusable prefix of its prompt,
//! its request is checked and the slot's cache prepared; or it is refused (at shutdown, or by the checks).

use backburner_model::TextTokenizer;

use super::fork;
use super::metrics::Metrics;
use super::scheduler::Active;
use super::tally::{Outcome, Ticket};
use super::{Event, Job, Slot};
use crate::error::EngineError;
use crate::sequence::Sequence;

/// A job refused at shutdown.
pub(super) fn refuse(mut job: Job, mut ticket: Ticket) {
    ticket.close(Outcome::Cancelled);
    fork::fail_all(&mut job, EngineError::ShuttingDown);
}

/// Puts `job` in the free slot with the longest reusable prefix (least recently used on ties), prepares the cache
/// and checks the request; `None` when it failed (the job got its `Failed` event).
pub(super) fn admit<'t>(
    slots: &mut [Slot],
    active: &[Active<'t>],
    (mut job, queued, mut ticket): fork::Waiting,
    tok: Option<&'t TextTokenizer>,
    turn: u64,
    m: &Metrics,
) -> Option<Active<'t>> {
    let busy = |i: usize| active.iter().any(|a| a.slot == i);
    let slot = (0..slots.len())
        .filter(|&i| !busy(i))
        .max_by_key(|&i| {
            let reuse = if job.cache_prompt {
                slots[i].reusable(&job.prompt)
            } else {
                0
            };
            (reuse, std::cmp::Reverse(slots[i].last_used))
        })
        .expect("a free slot");
    Metrics::add(&m.requests, 1);
    let s = &mut slots[slot];
    s.last_used = turn;
    // check before touching the slot's cache
    if let Err(e) = check(s, &job) {
        ticket.close(Outcome::Invalid);
        fork::fail_all(&mut job, e);
        return None;
    }
    let (reused, cached) = if job.cache_prompt {
        let r = s.prepare(&job.prompt);
        (r.kept, r.cached)
    } else {
        s.clear();
        (0, 0)
    };
    let rest = job.prompt[reused..].to_vec();
    let seq = match Sequence::new(s.session(), rest, job.params.clone(), tok) {
        Ok(q) => q,
        Err(e) => {
            ticket.close(Outcome::Invalid);
            fork::fail_all(&mut job, e);
            return None;
        }
    };
    Metrics::add(&m.prompt_tokens, job.prompt.len() as u64);
    if cached > 0 {
        Metrics::add(&m.cache_hits, 1);
        Metrics::add(&m.cached_tokens, cached as u64);
    }
    tracing::info!(
        request = %job.id, slot, prompt_tokens = job.prompt.len(), cached_tokens = cached,
        rebuilt_tokens = reused - cached, "request started"
    );
    s.plan_checkpoints(reused, job.prompt.len(), job.stable_prefix);
    // a pipelined prefill (split prefill, layer split) ends a call at the stable prefix's grid point, where the
    // host holds every layer's state (not where that would leave a lone last token: a decode step)
    let grid = s.session().grid();
    let n = job.prompt.len();
    let cut = job
        .stable_prefix
        .map(|p| grid.floor(p.min(n)))
        .filter(|&p| p > reused && grid.resumes(p, n));
    let (id, choice, n, max) = (
        ticket.request(),
        ticket.choice,
        job.prompt.len(),
        job.params.max_tokens,
    );
    m.slots.start(slot, (id, choice), n, cached, max);
    let mut a = Active::new(slot, seq, job, cut, ticket);
    let started = Event::Started {
        slot,
        prompt_tokens: a.job.prompt.len(),
        cached_tokens: cached,
        queue_ms: queued.elapsed().as_secs_f64() * 1e3,
    };
    a.send(started);
    Some(a)
}

/// The checks of a request against a slot that do not depend on its cache: the whole prompt must fit the context
/// with at least one token to generate.
fn check(s: &Slot, job: &Job) -> crate::Result<()> {
    let limit = s.session().context_length();
    if job.prompt.len() >= limit {
        return Err(EngineError::ContextOverflow {
            have: 0,
            add: job.prompt.len(),
            limit,
        });
    }
    job.params.sampling.validate()
}
