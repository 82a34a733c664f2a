//! A link's two threads in a pipelined call: the sender writes each request as it comes, the receiver reads each
//! reply within its deadline, checks it and passes it on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::{Duration, Instant};

use backburner_link::frame::Kind;
use backburner_link::message::{LayersDone, RunLayers};
use backburner_link::{FrameReader, FrameWriter, LinkError};

use super::{Ack, Hop, Link, LinkStage};

/// Deadline inputs of a link: the base timeout and the slowest transfer rate (bytes per second).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Pace {
    pub timeout: Duration,
    pub min_rate: u64,
}

impl Pace {
    /// The inputs of `settings` (`timeout`, `min_rate`).
    pub(crate) fn of(settings: &crate::split::WorkerSettings) -> Self {
        Pace {
            timeout: settings.timeout,
            min_rate: settings.min_rate,
        }
    }

    /// The budget of a message of `bytes` bytes whose reply also waits for `compute`: `timeout + compute +
    /// bytes / min_rate`.
    pub(crate) fn allow(&self, bytes: usize, compute: Duration) -> Duration {
        let transfer = (bytes as f64 / self.min_rate.max(1) as f64).min(1e9);
        self.timeout
            .saturating_add(compute)
            .saturating_add(Duration::from_secs_f64(transfer))
    }

    /// Sets `r`'s deadline to `start + allow(bytes, compute)` (at least 1 ms from now).
    pub(crate) fn deadline_from(
        &self,
        r: &mut FrameReader,
        start: Instant,
        bytes: usize,
        compute: Duration,
    ) {
        let left = self.allow(bytes, compute).saturating_sub(start.elapsed());
        r.set_deadline(Some(left.max(Duration::from_millis(1))));
    }
}

/// What a link's sender tells its receiver.
enum Note {
    /// A request went out at this instant; the worker may take this compute for it.
    Sent(Instant, Duration, RunLayers),
    /// The stream ended with every request written; the tails follow.
    End,
}

/// Where a link's receiver passes replies on, and the call's failure flag.
pub(super) struct Ends<'a> {
    /// The next link's sender (`None` for the last link).
    pub next: Option<mpsc::Sender<Hop>>,
    /// Back to the caller (the last link's replies).
    pub out: mpsc::Sender<(RunLayers, Vec<u8>)>,
    /// Set by a thread that fails; the host stops feeding.
    pub failed: &'a AtomicBool,
}

/// A receiver's result: its acknowledgements and its tail (`None`: the stream was cut).
type Received<T> = (Vec<Ack>, Result<Option<T>, LinkError>);

/// The join handles of a link's sender and receiver.
type Handles<'s, T> = (
    ScopedJoinHandle<'s, Result<(), LinkError>>,
    ScopedJoinHandle<'s, Received<T>>,
);

/// Starts link `i`'s sender (fed by `hops`) and receiver; each sets `ends.failed` when it fails.
pub(super) fn spawn<'s, 'e: 's, L: LinkStage>(
    sc: &'s Scope<'s, 'e>,
    i: usize,
    link: Link<'e>,
    hops: mpsc::Receiver<Hop>,
    ends: Ends<'e>,
    stage: &'e L,
) -> Handles<'s, L::Tail> {
    let Link {
        writer,
        reader,
        pace,
    } = link;
    let (notes_tx, notes_rx) = mpsc::channel();
    let failed = ends.failed;
    let sender = sc.spawn(move || {
        let res = send_link(i, writer, hops, notes_tx, pace, stage);
        if res.is_err() {
            failed.store(true, Ordering::Relaxed);
        }
        res
    });
    let receiver = sc.spawn(move || {
        let mut acks = Vec::new();
        let next = |msg: RunLayers, x: Vec<u8>| match &ends.next {
            Some(tx) => {
                let compute = stage.relay_compute(i + 1, msg.n_tokens as usize);
                tx.send(Hop {
                    msg,
                    bytes: x,
                    compute,
                })
                .is_ok()
            }
            None => ends.out.send((msg, x)).is_ok(),
        };
        let res = receive_link(i, reader, notes_rx, &next, pace, stage, &mut acks);
        if res.is_err() {
            failed.store(true, Ordering::Relaxed);
        }
        (acks, res)
    });
    (sender, receiver)
}

/// A link's sender: each request as it comes (its deadline includes the previous ubatch's compute, which it may wait
/// behind in the socket), noting when it went out; then the stream's end and the mode's tail.
fn send_link<L: LinkStage>(
    i: usize,
    w: &mut FrameWriter,
    hops: mpsc::Receiver<Hop>,
    notes: mpsc::Sender<Note>,
    pace: Pace,
    stage: &L,
) -> Result<(), LinkError> {
    let mut prev = Duration::ZERO;
    for hop in hops {
        w.set_deadline(Some(pace.allow(hop.bytes.len(), prev)));
        w.send(Kind::RunLayers, &hop.msg, &hop.bytes)?;
        let _ = notes.send(Note::Sent(Instant::now(), hop.compute, hop.msg));
        prev = hop.compute;
    }
    let _ = notes.send(Note::End);
    drop(notes);
    stage.send_tail(i, w, pace, prev)
}

/// A link's receiver: each `LayersDone` due `allow(reply bytes, compute)` after its request went out or the
/// previous reply arrived (whichever is later), checked, and passed on by `next` (false: nobody takes it, stop);
/// then the mode's tail. `Ok(None)` when the stream was cut (its sender failed, or `next` refused).
fn receive_link<L: LinkStage>(
    i: usize,
    r: &mut FrameReader,
    notes: mpsc::Receiver<Note>,
    next: &dyn Fn(RunLayers, Vec<u8>) -> bool,
    pace: Pace,
    stage: &L,
    acks: &mut Vec<Ack>,
) -> Result<Option<L::Tail>, LinkError> {
    let mut last = Instant::now();
    loop {
        let (at, compute, msg) = match notes.recv() {
            Ok(Note::Sent(at, compute, msg)) => (at, compute, msg),
            Ok(Note::End) => return stage.receive_tail(i, r, pace, last).map(Some),
            Err(_) => return Ok(None),
        };
        let t = msg.n_tokens as usize;
        pace.deadline_from(r, at.max(last), stage.reply_bytes(i, t), compute);
        let (done, back): (LayersDone, _) = r.expect(Kind::LayersDone, "LayersDone")?;
        stage.check(i, &msg, &done, &back)?;
        acks.push(Ack { tokens: t, done });
        last = Instant::now();
        if !next(msg, back) {
            return Ok(None);
        }
    }
}
