//! The scheduler thread: takes jobs when a slot is free, routes each to the slot holding its longest reusable
//! prefix, and turns the crank — one prefill chunk, the sampling steps, one batched decode step — until every job
//! is done; cancels between steps.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backburner_model::TextTokenizer;

use super::admit::{admit, refuse};
use super::fork::{self, Forks};
use super::links::{ping_workers, publish_link};
use super::metrics::Metrics;
use super::tally::{Outcome, Ticket};
use super::{decode_batch, Event, Job, Shared, Slot};
use crate::error::EngineError;
use crate::generate::StopReason;
use crate::sequence::{Phase, Sampled, Sequence};

/// A job in a slot.
pub(super) struct Active<'t> {
    pub(super) slot: usize,
    pub(super) seq: Sequence<'t>,
    pub(super) job: Job,
    /// Absolute position where a pipelined prefill call ends at the latest (the grid point at or before the stable
    /// prefix), if ahead.
    cut: Option<usize>,
    /// The client went away (its sink returned false): nothing more is sent.
    gone: bool,
    /// The shutdown's grace period is over: cancel at the next step.
    expired: bool,
    /// This turn its step waits for a worker's backoff to end ([`crate::Session::worker_wait`]): it sits out.
    pub(super) wait: Option<Duration>,
    /// It waited at least once (counted in [`Metrics::requests_delayed`]).
    waited: bool,
    /// Its choices' share of the request's outcome (its own, and its siblings' until they split off).
    pub(super) ticket: Ticket,
}

impl<'t> Active<'t> {
    /// `job` in `slot`, running `seq`.
    pub(super) fn new(
        slot: usize,
        seq: Sequence<'t>,
        job: Job,
        cut: Option<usize>,
        ticket: Ticket,
    ) -> Self {
        Active {
            slot,
            seq,
            cut,
            gone: false,
            expired: false,
            wait: None,
            waited: false,
            job,
            ticket,
        }
    }

    pub(super) fn cancelled(&self) -> bool {
        self.gone
            || self.expired
            || self
                .job
                .params
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed))
    }

    pub(super) fn send(&mut self, e: Event) {
        if !self.gone && !(self.job.events)(e) {
            self.gone = true;
        }
    }
}

/// The scheduler's loop; returns when the channel is closed and nothing runs.
///
/// While jobs run, the turns run on one of the slots' compute threads with the others kept awake
/// ([`crate::ComputePool::install_hot`], as [`crate::Session::in_pool`]: no hand-off to the pool and wait per decode
/// step); while none does, the scheduler waits for a job on its own thread, leaving the pool free.
pub(super) fn run(
    slots: Vec<Slot>,
    tokenizer: Option<Arc<TextTokenizer>>,
    rx: Receiver<(Job, Instant)>,
    shared: Arc<Shared>,
) {
    let pool = slots.first().map(|s| s.session().options().pool.clone());
    let mut l = Turns {
        slots,
        active: Vec::new(),
        tok: tokenizer.as_deref(),
        m: shared.metrics.clone(),
        rx,
        shared: &shared,
        turn: 0,
        closed: false,
        last_ping: Instant::now(),
        forks: Forks::default(),
    };
    publish_link(&l.slots, &l.m);
    let mut pause = Duration::ZERO;
    loop {
        l.take_jobs(pause);
        if l.active.is_empty() {
            if l.closed {
                return;
            }
            if l.last_ping.elapsed() >= l.shared.ping_every {
                ping_workers(&mut l.slots, &l.m);
                l.last_ping = Instant::now();
            }
            continue;
        }
        // runs turns until no job is left, or every job left waits for a worker's backoff: then the pool is let go
        // and the scheduler waits here (a new job, a cancellation or the shutdown's deadline are seen within
        // `WAIT_POLL`)
        let mut busy = || loop {
            let wait = l.step();
            if l.active.is_empty() || wait.is_some() {
                return wait;
            }
            l.take_jobs(Duration::ZERO);
        };
        let wait = match &pool {
            Some(pool) => pool.install_hot(busy),
            None => busy(),
        };
        pause = wait.map_or(Duration::ZERO, |w| w.min(WAIT_POLL));
        // with no slot free (or the queue closed) no job can arrive to wake the scheduler: it sleeps instead
        if !pause.is_zero() && (l.closed || l.active.len() >= l.slots.len()) {
            std::thread::sleep(std::mem::take(&mut pause));
        }
    }
}

/// The longest the scheduler sleeps at once while every job waits for a worker's backoff.
const WAIT_POLL: Duration = Duration::from_millis(50);

/// The scheduler's state between turns.
struct Turns<'t> {
    slots: Vec<Slot>,
    active: Vec<Active<'t>>,
    tok: Option<&'t TextTokenizer>,
    m: Arc<Metrics>,
    rx: Receiver<(Job, Instant)>,
    shared: &'t Shared,
    turn: u64,
    closed: bool,
    last_ping: Instant,
    /// Choices of `n` > 1 requests waiting for a slot ([`super::fork`]).
    forks: Forks<'t>,
}

impl Turns<'_> {
    /// Starts a turn: takes jobs while a slot is free (all of them, to refuse, once shutting down), blocking for
    /// the first one up to 200 ms when nothing runs, else up to `block` (while every running job waits).
    fn take_jobs(&mut self, mut block: Duration) {
        let m = &*self.m;
        self.turn += 1;
        // shutting down, every queued job is taken (and refused below) now, not when a slot frees
        let stopping = || self.shared.stopping.load(Ordering::Relaxed);
        // the choices of requests already running go before new jobs
        if !self.forks.is_empty() {
            if stopping() {
                self.forks.refuse();
            }
            let (slots, active) = (&mut self.slots, &mut self.active);
            self.forks.place(slots, active, self.turn, m);
            while self.active.len() < self.slots.len() {
                let Some((job, queued, ticket)) = self.forks.jobs.pop_front() else {
                    break;
                };
                let (slots, active) = (&mut self.slots, &self.active);
                let (tok, turn) = (self.tok, self.turn);
                if let Some(a) = admit(slots, active, (job, queued, ticket), tok, turn, m) {
                    self.forks.taken(a.slot);
                    self.active.push(a);
                }
            }
            self.publish();
        }
        while !self.closed && (self.active.len() < self.slots.len() || stopping()) {
            if self.active.is_empty() {
                block = Duration::from_millis(200);
            }
            let wait = std::mem::take(&mut block);
            let got = if !wait.is_zero() {
                self.rx.recv_timeout(wait)
            } else {
                self.rx.try_recv().map_err(|e| match e {
                    std::sync::mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                    std::sync::mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            };
            match got {
                Ok((job, queued)) => {
                    let choices = 1 + job.siblings.len();
                    m.queue_depth.fetch_sub(choices as u64, Ordering::Relaxed);
                    let ticket = Ticket::new(&self.m, &job.id, choices);
                    if stopping() {
                        refuse(job, ticket);
                        continue;
                    }
                    let (slots, active) = (&mut self.slots, &self.active);
                    let (tok, turn) = (self.tok, self.turn);
                    if let Some(a) = admit(slots, active, (job, queued, ticket), tok, turn, m) {
                        self.forks.taken(a.slot);
                        self.active.push(a);
                    }
                    self.publish();
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => self.closed = true,
            }
        }
    }

    /// The rest of a turn with jobs running: the shutdown deadline, one [`step`], the finished jobs leave. Returns
    /// the shortest wait when every job left waits for a worker's backoff.
    fn step(&mut self) -> Option<Duration> {
        let m = &*self.m;
        let past_deadline = self
            .shared
            .deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some_and(|d| Instant::now() >= d);
        if past_deadline {
            for a in &mut self.active {
                a.expired = true;
            }
        }
        let (forks, turn) = (&mut self.forks, self.turn);
        let wait = step(&mut self.slots, &mut self.active, forks, turn, m);
        self.active.retain_mut(|a| a.seq.phase() != Phase::Done);
        self.publish();
        let running = self.active.iter();
        let running = running.map(|a| (a.slot, a.seq.prompt_left(), a.seq.tokens().len()));
        m.slots.update(&self.slots, running);
        wait
    }
}

impl Turns<'_> {
    /// The gauges of sequences in slots and of choices waiting for one (the siblings of running jobs not split off
    /// yet, and those in [`Forks`]).
    fn publish(&self) {
        let m = &*self.m;
        Metrics::set(&m.active, self.active.len() as u64);
        let unsplit: usize = self.active.iter().map(|a| a.job.siblings.len()).sum();
        Metrics::set(&m.choices_waiting, (unsplit + self.forks.len()) as u64);
    }
}

/// One turn: cancellations, one prefill chunk, the sampling steps, one batched decode step; a job whose step would
/// wait for a worker's backoff sits the turn out. Returns the shortest such wait when every job left waits.
fn step<'t>(
    slots: &mut [Slot],
    active: &mut Vec<Active<'t>>,
    forks: &mut Forks<'t>,
    turn: u64,
    m: &Metrics,
) -> Option<Duration> {
    for a in active.iter_mut() {
        if a.cancelled() && a.seq.phase() != Phase::Done {
            let end = a.seq.cancel();
            finish(a, end, m);
        }
    }
    let all_wait = mark_waiting(slots, active, m);
    if all_wait.is_some() {
        return all_wait;
    }
    prefill_one(slots, active, turn, m);
    // `n` > 1: a prompt just prefilled is forked into free slots before anything samples from it
    forks.split(slots, active, turn, m);
    for a in active.iter_mut().filter(|a| a.seq.phase() == Phase::Sample) {
        match a.seq.sample_step(false) {
            Ok(s) => emit(a, s, m),
            Err(e) => fail(a, e),
        }
    }
    let verified = super::spec_turn::verify_all(slots, active, m);
    decode_all(slots, active, &verified, m);
    None
}

/// Sends a sampling step's token, or the end of the job when it ended.
pub(super) fn emit(a: &mut Active<'_>, s: Sampled, m: &Metrics) {
    if s.stop.is_some() {
        return finish(a, s, m);
    }
    Metrics::add(&m.generated_tokens, 1);
    let Sampled {
        token,
        text,
        logprob,
        ..
    } = s;
    a.send(Event::Token {
        id: token.expect("a token when not stopped"),
        text,
        logprob,
    });
}

/// The tokens of `a`'s next step: its next prefill chunk (see [`prefill_one`]; `others`: another job is in a slot),
/// or 1 for a decode step; 0 when it has none.
fn next_tokens(a: &Active<'_>, session: &crate::Session, others: bool) -> usize {
    match a.seq.phase() {
        Phase::Prefill => {
            let pos = session.tokens().len();
            let ubatch = session.options().ubatch;
            let left = a.seq.prompt_left();
            // split prefill and a layer split pipeline the ubatches of one call across the workers
            let pipelined = session.layer_split().is_some() || session.split_prefill_wants(left);
            let mut n = if !others && pipelined {
                left
            } else {
                ubatch - pos % ubatch
            };
            if let Some(c) = a.cut.filter(|&c| !others && pipelined && c > pos) {
                n = n.min(c - pos);
            }
            n.min(left)
        }
        Phase::Decode => 1,
        _ => 0,
    }
}

/// Marks the jobs whose next step would wait for a worker's backoff ([`crate::Session::worker_wait`]: KV offload
/// must move pages and every worker that could take them is backing off), so that they sit this turn out while the
/// other slots' steps go on. Returns the shortest wait when every job waits.
fn mark_waiting(slots: &[Slot], active: &mut [Active<'_>], m: &Metrics) -> Option<Duration> {
    let others = active.len() > 1;
    let mut all: Option<Duration> = None;
    let mut every = !active.is_empty();
    for a in active.iter_mut() {
        let session = slots[a.slot].session();
        let add = next_tokens(a, session, others);
        a.wait = (add > 0).then(|| session.worker_wait(add)).flatten();
        match a.wait {
            Some(w) => {
                if !std::mem::replace(&mut a.waited, true) {
                    Metrics::add(&m.requests_delayed, 1);
                    tracing::info!(request = %a.job.id, "waiting {w:?} for a worker's backoff to end");
                }
                all = Some(all.map_or(w, |x| x.min(w)));
            }
            None => every &= a.seq.phase() == Phase::Done,
        }
    }
    all.filter(|_| every)
}

/// Runs one prefill chunk of the job with the least prompt left (shortest first): one ubatch (ending at an absolute
/// multiple of the ubatch), or, when the session pipelines ubatches across workers (split prefill that the worker
/// would take, a layer split) and no other job is in a slot, all of the prompt up to the stable prefix's grid point.
/// Either way every call ends at a chunk boundary of the whole prompt's prefill (or its end), so the bits are those
/// of a cold run, and the exact checkpoints it takes go to the slot's cache.
fn prefill_one(slots: &mut [Slot], active: &mut [Active<'_>], _turn: u64, m: &Metrics) {
    let others = active.len() > 1;
    // the job with the least prompt left goes first: a short prompt is not held behind a long one's ingest
    let Some(a) = active
        .iter_mut()
        .filter(|a| a.seq.phase() == Phase::Prefill && a.wait.is_none())
        .min_by_key(|a| a.seq.prompt_left())
    else {
        return;
    };
    let slot = &mut slots[a.slot];
    let n = next_tokens(a, slot.session(), others);
    let left = a.seq.prompt_left();
    let session = slot.session_mut();
    let t0 = Instant::now();
    let r = a.seq.prefill_step(session, n, |_, _| {});
    Metrics::add(&m.prefill_us, t0.elapsed().as_micros() as u64);
    let r = r.map(|()| Metrics::add(&m.prefill_tokens, n.min(left) as u64));
    slot.collect_checkpoints();
    // before the job's next event: a client that reads /metrics after its answer sees this step's link use
    publish_link(slots, m);
    if let Err(e) = r {
        fail(a, e);
    }
}

/// One batched decode step of every job with a pending token, but those that ran a verify step this turn
/// (`verified`).
fn decode_all(slots: &mut [Slot], active: &mut [Active<'_>], verified: &[bool], m: &Metrics) {
    let mut idx: Vec<usize> = (0..active.len())
        .filter(|&i| {
            active[i].seq.phase() == Phase::Decode && active[i].wait.is_none() && !verified[i]
        })
        .collect();
    if idx.is_empty() {
        return;
    }
    idx.sort_by_key(|&i| active[i].slot);
    let ids: Vec<u32> = idx
        .iter()
        .map(|&i| active[i].seq.pending().expect("pending"))
        .collect();
    let want: Vec<usize> = idx.iter().map(|&i| active[i].slot).collect();
    let mut sessions: Vec<&mut crate::Session> = slots
        .iter_mut()
        .enumerate()
        .filter(|(i, _)| want.binary_search(i).is_ok())
        .map(|(_, s)| s.session_mut())
        .collect();
    let t0 = Instant::now();
    let results = decode_batch(&mut sessions, &ids);
    Metrics::add(&m.decode_us, t0.elapsed().as_micros() as u64);
    Metrics::add(&m.decode_steps, 1);
    Metrics::add(&m.decode_rows, idx.len() as u64);
    drop(sessions);
    // before the jobs' events (KV offload may have used the workers)
    publish_link(slots, m);
    for (&i, r) in idx.iter().zip(results) {
        let a = &mut active[i];
        if let Some(end) = a.seq.accept_logits(r) {
            finish(a, end, m);
        }
    }
}

/// Sends the end of a job.
fn finish(a: &mut Active<'_>, end: Sampled, m: &Metrics) {
    let reason = end.stop.unwrap_or(StopReason::Error);
    if end.token.is_some() {
        Metrics::add(&m.generated_tokens, 1);
    }
    // before the events: a client that reads /metrics after its answer sees it counted (siblings that never
    // started end as this job did)
    a.ticket.close(match reason {
        StopReason::Interrupted => Outcome::Cancelled,
        StopReason::Error => Outcome::Failed,
        _ => Outcome::Ok,
    });
    fork::orphan(&mut a.job, None);
    let generation = Box::new(a.seq.take_generation());
    tracing::info!(
        request = %a.job.id, stop = reason.as_str(), tokens = generation.tokens.len(),
        ttft_ms = generation.timings.ttft_ms, "request done"
    );
    // The last token carries the text it completed with whatever the stream held back (so a client pairing each
    // token with its text sees them together); without a last token (eos, cancellation) the rest goes with `Done`.
    let text = match end.token {
        Some(id) => {
            a.send(Event::Token {
                id,
                text: end.text,
                logprob: end.logprob,
            });
            String::new()
        }
        None => end.text,
    };
    a.send(Event::Done { generation, text });
}

/// A job whose prefill or sampling failed: its error, then it is done.
pub(super) fn fail(a: &mut Active<'_>, e: EngineError) {
    a.ticket.close(Outcome::Failed);
    tracing::warn!(request = %a.job.id, error = %e, "request failed");
    a.seq.cancel();
    fork::orphan(&mut a.job, Some(&e));
    a.send(Event::Failed(e));
}
