//! Several choices from one prompt (`n` > 1; [`super::Job::siblings`]): the prompt is prefilled once, by the job
//! itself (choice 0), and when its prefill ends its state is forked into free slots, one per other choice, which
//! then decode in the batched decode step beside it. Choice `i` samples with [`crate::choice_params`] (seed `s + i`),
//! from a copy of the prompt's logits, so it equals the single request with that seed token for token.
//!
//! Choices that find no free slot wait, ahead of new jobs, until one frees: a slot that still holds the prompt (the
//! slot of choice 0 or of another choice: their histories start with it) rewinds to the end of the prompt in place,
//! or another free slot gets a copy from one, so no choice prefills the prompt again. Where the prompt's state
//! cannot be copied — part of it lives on workers (KV pages offloaded, a layer split), or no slot holds the prompt
//! any more — the choice runs as a job of its own (the prompt prefilled again, from the slot's cache where it can).

use std::collections::VecDeque;
use std::time::Instant;

use backburner_model::StateSnapshot;

use super::metrics::Metrics;
use super::scheduler::Active;
use super::tally::{Outcome, Ticket};
use super::{Event, Job, Slot};
use crate::error::EngineError;
use crate::sequence::{Phase, Sequence};

/// The choices waiting for a slot, and those that run as jobs of their own.
#[derive(Default)]
pub(super) struct Forks<'t> {
    groups: Vec<Group<'t>>,
    /// Choices whose prompt state could not be copied: taken, before new jobs, as jobs of their own.
    pub(super) jobs: VecDeque<Waiting>,
}

/// A choice waiting for a slot: its job, since when, its share of the request's outcome.
pub(super) type Waiting = (Job, Instant, Ticket);

/// The waiting choices of one request.
struct Group<'t> {
    /// The whole prompt.
    prompt: Vec<u32>,
    /// The state at the end of the prompt (linear layers; the KV rows are the holders' own).
    snap: StateSnapshot,
    /// Choice 0 as its prefill left it (never stepped): each choice forks from it.
    template: Sequence<'t>,
    /// Slots whose history starts with the prompt as choice 0 computed it.
    holders: Vec<usize>,
    /// The choices waiting for a slot (their jobs carry their settings and sinks).
    waiting: VecDeque<Waiting>,
}

impl<'t> Forks<'t> {
    /// Whether no choice waits.
    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty() && self.jobs.is_empty()
    }

    /// Choices waiting for a slot.
    pub(super) fn len(&self) -> usize {
        self.jobs.len() + self.groups.iter().map(|g| g.waiting.len()).sum::<usize>()
    }

    /// For every job whose prefill just ended (its logits ready, nothing sampled yet) and that has siblings: makes
    /// their jobs ([`crate::choice_params`]) and places them in free slots with a copy of its state, the rest to wait
    /// ([`Forks::place`]); where the state cannot be copied, they become jobs of their own.
    pub(super) fn split(
        &mut self,
        slots: &mut [Slot],
        active: &mut Vec<Active<'t>>,
        turn: u64,
        m: &Metrics,
    ) {
        for a in active.iter_mut() {
            if a.job.siblings.is_empty() || a.seq.phase() != Phase::Sample {
                continue;
            }
            let sinks = std::mem::take(&mut a.job.siblings);
            let now = Instant::now();
            let ticket = &mut a.ticket;
            let jobs = sinks.into_iter().enumerate().map(|(k, events)| {
                let index = k + 1;
                let job = Job {
                    id: format!("{}/{index}", a.job.id),
                    prompt: a.job.prompt.clone(),
                    params: crate::choice_params(&a.job.params, index),
                    stable_prefix: a.job.stable_prefix,
                    cache_prompt: a.job.cache_prompt,
                    events,
                    siblings: Vec::new(),
                };
                (job, now, ticket.split(index))
            });
            let jobs: Vec<Waiting> = jobs.collect();
            let slot = &slots[a.slot];
            let template = slot
                .forkable()
                .then(|| a.seq.fork(&a.job.prompt, a.job.params.clone()))
                .flatten()
                .and_then(|r| r.ok());
            match template {
                Some(template) => {
                    tracing::info!(request = %a.job.id, choices = 1 + jobs.len(), "forking the prompt's state");
                    self.groups.push(Group {
                        prompt: a.job.prompt.clone(),
                        snap: slot.session().snapshot(),
                        template,
                        holders: vec![a.slot],
                        waiting: jobs.into(),
                    });
                }
                None => {
                    tracing::info!(
                        request = %a.job.id, choices = 1 + jobs.len(),
                        "the prompt's state is partly on workers: each choice prefills it"
                    );
                    self.jobs.extend(jobs);
                }
            }
        }
        self.place(slots, active, turn, m);
    }

    /// Places waiting choices in free slots (a slot holding their prompt first), each starting from the end of its
    /// prompt; a group no slot holds the prompt of any more goes to [`Forks::jobs`]. Cancelled choices are dropped.
    pub(super) fn place(
        &mut self,
        slots: &mut [Slot],
        active: &mut Vec<Active<'t>>,
        turn: u64,
        m: &Metrics,
    ) {
        let mut g = 0;
        while g < self.groups.len() {
            {
                let group = &mut self.groups[g];
                // a cancelled choice is dropped: its ticket ends it as cancelled
                group.waiting.retain(|(j, _, _)| !cancelled(j));
                let prompt = &group.prompt[..];
                group.holders.retain(|&h| holds(&slots[h], prompt));
            }
            loop {
                let group = &mut self.groups[g];
                if group.waiting.is_empty() || group.holders.is_empty() {
                    break;
                }
                let free = |i: usize| !active.iter().any(|a| a.slot == i);
                let Some(d) = group
                    .holders
                    .iter()
                    .copied()
                    .find(|&h| free(h))
                    .or_else(|| (0..slots.len()).find(|&i| free(i)))
                else {
                    break;
                };
                let (job, queued, ticket) = group.waiting.pop_front().expect("a waiting choice");
                let ok = if group.holders.contains(&d) {
                    slots[d].fork_from(None, &group.snap)
                } else {
                    let (dst, src) = pair(slots, d, group.holders[0]);
                    dst.fork_from(Some(src), &group.snap)
                };
                if !ok {
                    // the state could not be placed there: this choice prefills the prompt instead
                    group.holders.retain(|&h| h != d);
                    self.jobs.push_back((job, queued, ticket));
                    continue;
                }
                self.taken(d);
                let group = &mut self.groups[g];
                group.holders.push(d);
                slots[d].last_used = turn;
                if let Some(a) = start(d, job, queued, ticket, &group.template, m) {
                    active.push(a);
                }
            }
            let group = &mut self.groups[g];
            if group.waiting.is_empty() {
                self.groups.remove(g);
            } else if group.holders.is_empty() {
                tracing::info!(
                    "no slot holds the prompt of waiting choices any more: they prefill it"
                );
                let waiting = std::mem::take(&mut group.waiting);
                self.jobs.extend(waiting);
                self.groups.remove(g);
            } else {
                g += 1;
            }
        }
        self.jobs.retain(|(j, _, _)| !cancelled(j));
    }

    /// Slot `slot` took another job: it no longer holds any waiting choice's prompt.
    pub(super) fn taken(&mut self, slot: usize) {
        for g in &mut self.groups {
            g.holders.retain(|&h| h != slot);
        }
    }

    /// Shutting down: every waiting choice is refused.
    pub(super) fn refuse(&mut self) {
        let waiting = self.groups.drain(..).flat_map(|g| g.waiting);
        for (mut job, _, mut ticket) in waiting.chain(self.jobs.drain(..)) {
            ticket.close(Outcome::Cancelled);
            (job.events)(Event::Failed(EngineError::ShuttingDown));
        }
    }
}

/// The choice `job` in slot `d`, which holds its prompt: it starts sampling from `template`'s logits.
fn start<'t>(
    d: usize,
    mut job: Job,
    queued: Instant,
    mut ticket: Ticket,
    template: &Sequence<'t>,
    m: &Metrics,
) -> Option<Active<'t>> {
    Metrics::add(&m.requests, 1);
    let seq = match template.fork(&job.prompt, job.params.clone()) {
        Some(Ok(s)) => s,
        Some(Err(e)) => {
            ticket.close(Outcome::Invalid);
            (job.events)(Event::Failed(e));
            return None;
        }
        None => unreachable!("the template is never stepped"),
    };
    tracing::info!(request = %job.id, slot = d, "choice started from the prompt's state");
    let n = job.prompt.len();
    let max = job.params.max_tokens;
    m.slots
        .start(d, (ticket.request(), ticket.choice), n, n, max);
    let mut a = Active::new(d, seq, job, None, ticket);
    a.send(Event::Started {
        slot: d,
        prompt_tokens: n,
        cached_tokens: n,
        queue_ms: queued.elapsed().as_secs_f64() * 1e3,
    });
    Some(a)
}

/// Whether slot `s` holds `prompt` as a prefix of its history, in a state it can copy or rewind.
fn holds(s: &Slot, prompt: &[u32]) -> bool {
    s.forkable() && s.session().tokens().get(..prompt.len()) == Some(prompt)
}

fn cancelled(j: &Job) -> bool {
    j.params
        .cancel
        .as_ref()
        .is_some_and(|c| c.load(std::sync::atomic::Ordering::Relaxed))
}

/// Slots `a` and `b` (different), mutable and shared.
fn pair(slots: &mut [Slot], a: usize, b: usize) -> (&mut Slot, &Slot) {
    if a < b {
        let (lo, hi) = slots.split_at_mut(b);
        (&mut lo[a], &hi[0])
    } else {
        let (lo, hi) = slots.split_at_mut(a);
        (&mut hi[0], &lo[b])
    }
}

/// Sends `e` to `job` and a copy to each of its siblings that have not started (the job failed or was cancelled
/// before its prompt was prefilled).
pub(super) fn fail_all(job: &mut Job, e: EngineError) {
    for mut s in std::mem::take(&mut job.siblings) {
        s(Event::Failed(copy(&e)));
    }
    (job.events)(Event::Failed(e));
}

/// The siblings of a job that ended before its prompt was prefilled (cancelled, or failed): they fail with the
/// job's error, or as cancelled.
pub(super) fn orphan(job: &mut Job, e: Option<&EngineError>) {
    for mut s in std::mem::take(&mut job.siblings) {
        let e = match e {
            Some(e) => copy(e),
            None => EngineError::InvalidInput(
                "cancelled: the request was cancelled before its prompt was prefilled".into(),
            ),
        };
        s(Event::Failed(e));
    }
}

/// The same error for a sibling (the engine's errors are not `Clone`: those a request's checks give are copied,
/// the others described).
fn copy(e: &EngineError) -> EngineError {
    use EngineError as E;
    match e {
        E::ContextOverflow { have, add, limit } => E::ContextOverflow {
            have: *have,
            add: *add,
            limit: *limit,
        },
        E::EmptyPrompt => E::EmptyPrompt,
        E::NonFinite => E::NonFinite,
        E::InvalidInput(s) => E::InvalidInput(s.clone()),
        E::Constraint(s) => E::Constraint(s.clone()),
        E::InvalidSetting(s) => E::InvalidSetting(s.clone()),
        E::ShuttingDown => E::ShuttingDown,
        other => E::InvalidSetting(format!("choice 0 failed: {other}")),
    }
}
