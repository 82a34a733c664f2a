//! The scheduler thread: takes jobs when a slot is free, routes each to the slot holding its longest reusable
//! prefix, and turns the crank — one prefill chunk, the sampling steps, one batched decode step — until every job
//! is done; cancels between steps.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backburner_model::TextTokenizer;

use super::metrics::Metrics;
use super::{decode_batch, Event, Job, Shared, Slot};
use crate::error::EngineError;
use crate::generate::StopReason;
use crate::sequence::{Phase, Sampled, Sequence};

/// A job in a slot.
struct Active<'t> {
    slot: usize,
    seq: Sequence<'t>,
    job: Job,
    /// Absolute position where a pipelined prefill call ends at the latest (the grid point at or before the stable
    /// prefix), if ahead.
    cut: Option<usize>,
    /// The client went away (its sink returned false): nothing more is sent.
    gone: bool,
    /// The shutdown's grace period is over: cancel at the next step.
    expired: bool,
}

impl Active<'_> {
    fn cancelled(&self) -> bool {
        self.gone
            || self.expired
            || self
                .job
                .params
                .cancel
                .as_ref()
                .is_some_and(|c| c.load(Ordering::Relaxed))
    }

    fn send(&mut self, e: Event) {
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
    };
    publish_link(&l.slots, &l.m);
    loop {
        l.take_jobs();
        if l.active.is_empty() {
            if l.closed {
                return;
            }
            if l.last_ping.elapsed() >= PING_EVERY {
                ping_workers(&mut l.slots, &l.m);
                l.last_ping = Instant::now();
            }
            continue;
        }
        let mut busy = || loop {
            l.step();
            if l.active.is_empty() {
                return;
            }
            l.take_jobs();
        };
        match &pool {
            Some(pool) => pool.install_hot(busy),
            None => busy(),
        }
    }
}

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
}

impl Turns<'_> {
    /// Starts a turn: takes jobs while a slot is free (all of them, to refuse, once shutting down), blocking up to
    /// 200 ms for one only when nothing runs.
    fn take_jobs(&mut self) {
        let m = &*self.m;
        self.turn += 1;
        // shutting down, every queued job is taken (and refused below) now, not when a slot frees
        let stopping = || self.shared.stopping.load(Ordering::Relaxed);
        while !self.closed && (self.active.len() < self.slots.len() || stopping()) {
            let got = if self.active.is_empty() {
                self.rx.recv_timeout(Duration::from_millis(200))
            } else {
                self.rx.try_recv().map_err(|e| match e {
                    std::sync::mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                    std::sync::mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            };
            match got {
                Ok((job, queued)) => {
                    m.queue_depth.fetch_sub(1, Ordering::Relaxed);
                    if stopping() {
                        refuse(job, m);
                        continue;
                    }
                    let (slots, active) = (&mut self.slots, &self.active);
                    if let Some(a) = admit(slots, active, job, queued, self.tok, self.turn, m) {
                        self.active.push(a);
                        Metrics::set(&m.active, self.active.len() as u64);
                    }
                }
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => self.closed = true,
            }
        }
    }

    /// The rest of a turn with jobs running: the shutdown deadline, one [`step`], the finished jobs leave.
    fn step(&mut self) {
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
        step(&mut self.slots, &mut self.active, self.turn, m);
        self.active.retain_mut(|a| a.seq.phase() != Phase::Done);
        Metrics::set(&m.active, self.active.len() as u64);
    }
}

/// How often the workers get a health ping while no job runs.
const PING_EVERY: Duration = Duration::from_secs(10);

/// Pings every slot's split-prefill / KV-offload workers (idle only, so no compute waits on it): the largest round
/// trip goes to `link_rtt_us`, failures mark the worker unavailable (its backoff) and count in `ping_failures`.
fn ping_workers(slots: &mut [Slot], m: &Metrics) {
    let mut worst = None;
    for s in slots.iter_mut() {
        let session = s.session_mut();
        let (cfg, o) = (session.model().config().clone(), session.options().clone());
        for w in session.workers().iter_mut() {
            match w.probe(&cfg, o.kv.dtype, o.kv.page_size, o.ubatch) {
                Some(Ok(d)) => worst = worst.max(Some(d.as_micros() as u64)),
                Some(Err(e)) => {
                    tracing::warn!(worker = %w.settings().addr, error = %e, "worker health ping failed");
                    Metrics::add(&m.ping_failures, 1);
                }
                None => {}
            }
        }
    }
    if let Some(us) = worst {
        Metrics::set(&m.link_rtt_us, us);
    }
    publish_link(slots, m);
}

/// A job refused at shutdown.
fn refuse(mut job: Job, m: &Metrics) {
    Metrics::add(&m.requests_cancelled, 1);
    (job.events)(Event::Failed(EngineError::ShuttingDown));
}

/// Puts `job` in the free slot with the longest reusable prefix (least recently used on ties), prepares the cache
/// and checks the request; `None` when it failed (the job got its `Failed` event).
fn admit<'t>(
    slots: &mut [Slot],
    active: &[Active<'t>],
    mut job: Job,
    queued: Instant,
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
        Metrics::add(&m.requests_invalid, 1);
        (job.events)(Event::Failed(e));
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
            Metrics::add(&m.requests_invalid, 1);
            (job.events)(Event::Failed(e));
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
    let mut a = Active {
        slot,
        seq,
        cut,
        gone: false,
        expired: false,
        job,
    };
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

/// One turn: cancellations, one prefill chunk, the sampling steps, one batched decode step.
fn step(slots: &mut [Slot], active: &mut [Active<'_>], turn: u64, m: &Metrics) {
    for a in active.iter_mut() {
        if a.cancelled() && a.seq.phase() != Phase::Done {
            let end = a.seq.cancel();
            finish(a, end, m);
        }
    }
    prefill_one(slots, active, turn, m);
    for a in active.iter_mut().filter(|a| a.seq.phase() == Phase::Sample) {
        match a.seq.sample_step(false) {
            Ok(s) if s.stop.is_some() => finish(a, s, m),
            Ok(s) => {
                Metrics::add(&m.generated_tokens, 1);
                let Sampled { token, text, .. } = s;
                a.send(Event::Token {
                    id: token.expect("a token when not stopped"),
                    text,
                });
            }
            Err(e) => fail(a, e, m),
        }
    }
    decode_all(slots, active, m);
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
        .filter(|a| a.seq.phase() == Phase::Prefill)
        .min_by_key(|a| a.seq.prompt_left())
    else {
        return;
    };
    let slot = &mut slots[a.slot];
    let session = slot.session_mut();
    let pos = session.tokens().len();
    let ubatch = session.options().ubatch;
    let left = a.seq.prompt_left();
    // split prefill and a layer split pipeline the ubatches of one call across the workers
    let pipelined = session.layer_split().is_some()
        || session
            .workers()
            .first()
            .is_some_and(|w| w.wants(left, ubatch));
    let whole = !others && pipelined;
    let mut n = if whole { left } else { ubatch - pos % ubatch };
    if let Some(c) = a.cut.filter(|&c| whole && c > pos) {
        n = n.min(c - pos);
    }
    let t0 = Instant::now();
    let r = a.seq.prefill_step(session, n, |_, _| {});
    Metrics::add(&m.prefill_us, t0.elapsed().as_micros() as u64);
    let r = r.map(|()| Metrics::add(&m.prefill_tokens, n.min(left) as u64));
    slot.collect_checkpoints();
    // before the job's next event: a client that reads /metrics after its answer sees this step's link use
    publish_link(slots, m);
    if let Err(e) = r {
        fail(a, e, m);
    }
}

/// One batched decode step of every job with a pending token.
fn decode_all(slots: &mut [Slot], active: &mut [Active<'_>], m: &Metrics) {
    let mut idx: Vec<usize> = (0..active.len())
        .filter(|&i| active[i].seq.phase() == Phase::Decode)
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
    let counter = match reason {
        StopReason::Interrupted => &m.requests_cancelled,
        StopReason::Error => &m.requests_failed,
        _ => &m.requests_ok,
    };
    Metrics::add(counter, 1);
    let generation = Box::new(a.seq.take_generation());
    tracing::info!(
        request = %a.job.id, stop = reason.as_str(), tokens = generation.tokens.len(),
        ttft_ms = generation.timings.ttft_ms, "request done"
    );
    // The last token carries the text it completed with whatever the stream held back (so a client pairing each
    // token with its text sees them together); without a last token (eos, cancellation) the rest goes with `Done`.
    let text = match end.token {
        Some(id) => {
            a.send(Event::Token { id, text: end.text });
            String::new()
        }
        None => end.text,
    };
    a.send(Event::Done { generation, text });
}

/// A job whose prefill or sampling failed: its error, then it is done.
fn fail(a: &mut Active<'_>, e: EngineError, m: &Metrics) {
    Metrics::add(&m.requests_failed, 1);
    tracing::warn!(request = %a.job.id, error = %e, "request failed");
    a.seq.cancel();
    a.send(Event::Failed(e));
}

/// Publishes the slots' link statistics and worker gauges; called after every step that may use a worker (a
/// prefill chunk, a decode step) and before that step's events go out, so that what a client reads on `/metrics`
/// after its answer includes its request.
fn publish_link(slots: &[Slot], m: &Metrics) {
    let mut sum = crate::split::LinkStats::default();
    let (mut attached, mut healthy) = (0, 0);
    for s in slots {
        sum.add(&s.session().link_stats());
        for w in s.session().workers().iter() {
            attached += 1;
            // not `available()`: that turns true again when a backoff runs out, with nobody having tried the worker
            healthy += !w.failing() as u64;
        }
    }
    *m.link.lock().unwrap_or_else(|p| p.into_inner()) = sum;
    Metrics::set(&m.workers_attached, attached);
    Metrics::set(&m.workers_available, healthy);
}
