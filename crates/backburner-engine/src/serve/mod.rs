//! The serving engine: parallel slots driven step by step by one scheduler thread (an actor fed by a bounded
//! channel), batched decode across slots, and a prompt cache per slot. The HTTP server (`backburner-server`) only
//! renders, tokenizes, submits [`Job`]s and forwards [`Event`]s: it never blocks on compute.
//!
//! Each scheduler turn runs at most one prefill chunk (one ubatch, or the whole prompt when a split-prefill worker
//! would take it and nothing else is decoding) and then one batched decode step of every sequence that has a token
//! pending ([`decode_batch`]), so a long prompt delays the others' next token by at most one ubatch.

mod admit;
mod batch;
mod board;
mod cache;
mod fork;
mod links;
mod metrics;
mod scheduler;
mod slot;
mod spec_turn;
mod tally;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use backburner_model::TextTokenizer;

pub use self::batch::decode_batch;
pub use self::board::{SlotBoard, SlotInfo, SlotTask};
pub use self::cache::{CacheLimits, Checkpoints};
pub use self::links::PING_EVERY;
pub use self::metrics::Metrics;
pub use self::slot::{common_prefix, Reuse, Slot};
use crate::error::{EngineError, Result};
use crate::generate::{GenerateParams, Generation};
use crate::session::Session;

/// Settings of the serving engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// Requests that may wait for a slot; beyond it [`Engine::submit`] refuses with [`SubmitError::QueueFull`]. 0:
    /// no queue, a request that finds every slot busy is refused at once.
    pub queue: usize,
    /// Bounds of each slot's checkpoints.
    pub cache: CacheLimits,
    /// How often the slots' workers get a health ping while no job runs ([`links::PING_EVERY`] by default).
    pub ping_every: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            queue: 64,
            cache: CacheLimits::default(),
            ping_every: links::PING_EVERY,
        }
    }
}

/// What happened to a job, sent to its [`Job::events`] callback in this order: `Started`, any number of `Token`,
/// then `Done`; or `Failed` alone (nothing ran, or a prefill failed).
#[derive(Debug)]
pub enum Event {
    /// A slot took the job and its prompt checked out.
    Started {
        /// The slot.
        slot: usize,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Of those, tokens reused from the slot's cache.
        cached_tokens: usize,
        /// Time waited in the queue (ms).
        queue_ms: f64,
    },
    /// A generated token and the text it completed (may be empty).
    Token {
        /// The id.
        id: u32,
        /// Text completed by it (complete UTF-8, stop strings held back; the last token of a generation that ends
        /// on it also carries what was held back).
        text: String,
        /// Its log-probability and alternatives, when the job asked ([`crate::GenerateParams::logprobs`]).
        logprob: Option<crate::TokenLogprob>,
    },
    /// The generation ended ([`Generation::stop_reason`]); `text` is the last piece of text not sent yet.
    Done {
        /// The whole generation (tokens, text, stop reason, timings).
        generation: Box<Generation>,
        /// Text not sent in a `Token` event yet (held back until the end).
        text: String,
    },
    /// The job failed before generating: invalid input, a prompt too long, a prefill error.
    Failed(EngineError),
}

/// The callback receiving a job's events; returning `false` (the client is gone) cancels the job at the next step.
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;

/// One request for the scheduler.
pub struct Job {
    /// Request id for logs.
    pub id: String,
    /// The whole prompt, token ids `[n]` (the slot's cache decides how much of it runs).
    pub prompt: Vec<u32>,
    /// Generation settings; [`GenerateParams::cancel`] set by the caller cancels the job at the next step.
    pub params: GenerateParams,
    /// Length of the prompt's stable prefix (the conversation before the generation prompt): a checkpoint is kept
    /// there, so the next turn, which re-renders the history differently after it, resumes from it.
    pub stable_prefix: Option<usize>,
    /// Reuse the slot's cache (llama-server's `cache_prompt`, default true); `false` starts from an empty slot
    /// (a cold prefill, e.g. to measure one).
    pub cache_prompt: bool,
    /// Where events go.
    pub events: EventSink,
    /// The sinks of more choices from the same prompt (OpenAI's `n` > 1: choices 1 … n−1; empty for one): choice
    /// `i` runs with [`crate::choice_params`]`(&params, i)` (seed + i) and sends its own events (`Started`, tokens,
    /// `Done`) to `siblings[i − 1]`. The prompt is prefilled once and its state forked into free slots, the choices
    /// then decoding batched together; a choice that finds no free slot waits for one ahead of new jobs and starts
    /// from a slot still holding the prompt (rewound or copied, no second prefill). Where the state is partly on
    /// workers (KV offload, a layer split) each choice prefills the prompt as a job of its own. A job that fails or is
    /// cancelled before its prompt is prefilled sends `Failed` to its siblings too.
    pub siblings: Vec<EventSink>,
}

impl std::fmt::Debug for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Job")
            .field("id", &self.id)
            .field("prompt_tokens", &self.prompt.len())
            .finish()
    }
}

/// Why [`Engine::submit`] refused a job.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Every slot is busy and the queue is full: retry later (HTTP 503).
    #[error("the server is busy: all slots are in use and the queue of {0} is full")]
    QueueFull(usize),
    /// The engine is shutting down or stopped.
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// What a server needs of a serving engine: [`Engine`], or a scripted stand-in in tests (to check how the server
/// presents given outputs: reasoning, tool calls, errors). The HTTP layer's view of the engine, as vLLM's
/// `EngineClient` is its API server's (named so, not `Backend`, to keep that word for compute backends: issue 38).
pub trait EngineClient: Send + Sync {
    /// Queues a job ([`Engine::submit`]).
    fn submit(&self, job: Job) -> std::result::Result<(), SubmitError>;
    /// The counters.
    fn metrics(&self) -> &Metrics;
    /// Parallel slots.
    fn slots(&self) -> usize;
    /// Stops ([`Engine::shutdown`]).
    fn shutdown(&self, grace: Duration);
    /// What each slot is doing, one [`SlotInfo`] per slot in order: those the scheduler published on
    /// [`Metrics::slots`], or every slot idle when none were.
    fn slot_states(&self) -> Vec<SlotInfo> {
        let s = self.metrics().slots.snapshot();
        if !s.is_empty() {
            return s;
        }
        (0..self.slots())
            .map(|id| SlotInfo {
                id,
                ..SlotInfo::default()
            })
            .collect()
    }
}

impl EngineClient for Engine {
    fn submit(&self, job: Job) -> std::result::Result<(), SubmitError> {
        Engine::submit(self, job)
    }

    fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    fn slots(&self) -> usize {
        self.n_slots
    }

    fn shutdown(&self, grace: Duration) {
        Engine::shutdown(self, grace)
    }
}

/// Shared between the handle and the scheduler thread.
pub(crate) struct Shared {
    pub(crate) metrics: Arc<Metrics>,
    /// Set by [`Engine::shutdown`]: take no new job.
    pub(crate) stopping: AtomicBool,
    /// After this instant, cancel what is still running.
    pub(crate) deadline: Mutex<Option<Instant>>,
    /// How often idle workers get a health ping.
    pub(crate) ping_every: Duration,
}

/// The handle of a running serving engine: submit jobs, read metrics, shut down.
pub struct Engine {
    tx: Mutex<Option<SyncSender<(Job, Instant)>>>,
    shared: Arc<Shared>,
    queue: usize,
    n_slots: usize,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Engine {
    /// Starts the scheduler thread with one slot per session (all on the same model; workers already attached as
    /// the caller wants them) and `tokenizer` for text (`None`: token events carry no text).
    ///
    /// Errors: [`EngineError::InvalidSetting`] for no session, or sessions on different models.
    pub fn start(
        sessions: Vec<Session>,
        tokenizer: Option<Arc<TextTokenizer>>,
        opts: ServeOptions,
    ) -> Result<Engine> {
        let Some(first) = sessions.first() else {
            return Err(EngineError::InvalidSetting(
                "the server needs at least one slot".into(),
            ));
        };
        if sessions
            .iter()
            .any(|s| !Arc::ptr_eq(s.model(), first.model()))
        {
            return Err(EngineError::InvalidSetting(
                "every slot must run on the same model".into(),
            ));
        }
        let n_slots = sessions.len();
        let shared = Arc::new(Shared {
            metrics: Arc::new(Metrics::default()),
            stopping: AtomicBool::new(false),
            deadline: Mutex::new(None),
            ping_every: opts.ping_every,
        });
        shared.metrics.slots.reset(n_slots);
        // the channel holds the queue; the scheduler takes a job only when a slot is free (with no queue, the channel
        // only hands jobs over: `submit` refuses one that would wait)
        let (tx, rx) = sync_channel(if opts.queue == 0 { n_slots } else { opts.queue });
        let slots: Vec<Slot> = sessions
            .into_iter()
            .map(|s| Slot::new(s, opts.cache))
            .collect();
        // the worker gauges hold from the start, before the scheduler's first turn (`/health` may ask at once)
        links::publish_link(&slots, &shared.metrics);
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("backburner-scheduler".into())
            // a grammar's parser recurses on its nesting (`constraint::GRAMMAR_STACK`)
            .stack_size(crate::constraint::GRAMMAR_STACK)
            .spawn(move || scheduler::run(slots, tokenizer, rx, sh))
            .map_err(|e| EngineError::InvalidSetting(format!("cannot start the scheduler: {e}")))?;
        Ok(Engine {
            tx: Mutex::new(Some(tx)),
            shared,
            queue: opts.queue,
            n_slots,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Queues `job`; its events go to [`Job::events`] on the scheduler's thread.
    ///
    /// Errors: [`SubmitError::QueueFull`] when `queue` jobs already wait (with `queue` 0: when every slot is busy or
    /// taken by a job about to start); [`SubmitError::ShuttingDown`].
    pub fn submit(&self, job: Job) -> std::result::Result<(), SubmitError> {
        let guard = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        let Some(tx) = guard.as_ref() else {
            return Err(SubmitError::ShuttingDown);
        };
        if self.shared.stopping.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let m = &self.shared.metrics;
        // the queue's gauge counts sequences: each choice of a request will take a slot
        let choices = 1 + job.siblings.len() as u64;
        let rejected = || {
            Metrics::add(&m.requests_rejected, 1);
            Metrics::add(&m.sequences_rejected, choices);
        };
        let waiting = Metrics::get(&m.queue_depth) + Metrics::get(&m.active);
        if self.queue == 0 && waiting >= self.n_slots as u64 {
            rejected();
            return Err(SubmitError::QueueFull(0));
        }
        Metrics::add(&m.queue_depth, choices);
        match tx.try_send((job, Instant::now())) {
            Ok(()) => Ok(()),
            Err(e) => {
                m.queue_depth.fetch_sub(choices, Ordering::Relaxed);
                match e {
                    TrySendError::Full(_) => {
                        rejected();
                        Err(SubmitError::QueueFull(self.queue))
                    }
                    TrySendError::Disconnected(_) => Err(SubmitError::ShuttingDown),
                }
            }
        }
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.shared.metrics
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.n_slots
    }

    /// Stops taking jobs, refuses the queued ones at once ([`EngineError::ShuttingDown`]), lets running
    /// ones finish for up to `grace`, then cancels the rest (they end with `Interrupted`), and waits for the
    /// scheduler to exit. Idempotent.
    pub fn shutdown(&self, grace: Duration) {
        self.shared.stopping.store(true, Ordering::Relaxed);
        *self
            .shared
            .deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + grace);
        drop(self.tx.lock().unwrap_or_else(|p| p.into_inner()).take());
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}
