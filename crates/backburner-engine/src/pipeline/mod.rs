//! The one pipelined driver of the worker modes that stream ubatches over links (split prefill, layer split).
//!
//! A call hands the driver a chain of links (one worker connection each, in order), a [`HostStage`] and a
//! [`LinkStage`]. The driver owns the threads, the channels and their order:
//!
//! * on the calling thread, ubatch after ubatch, the host's part ([`HostStage::step`]); each [`Hop`] it returns
//!   goes to the first link and `progress(done, total)` counts its tokens; the host stops early once a link failed;
//! * per link, a sender thread writes each request (`RunLayers` + residual) as it comes, and a receiver thread
//!   reads each `LayersDone`, checks it ([`LinkStage::check`]) and passes the reply's residual on: to the next link's
//!   sender (with [`LinkStage::relay_compute`]) or, from the last link, back to the caller ([`Outcome::out`]);
//! * after the stream, each link's trailing exchange ([`LinkStage::send_tail`], [`LinkStage::receive_tail`]: split
//!   prefill's fetches of the worker's rows and states);
//! * every message's deadline: a request `pace.allow(bytes, previous compute)` from when it is written (it may wait
//!   in the socket behind the previous ubatch); a reply `pace.allow(reply bytes, its compute)` from when its request
//!   went out or the previous reply arrived, whichever is later;
//! * the failure order: the host's error, else the lowest failing link, its receiver (which carries the worker's
//!   typed `Error` frame) before its sender.
//!
//! What the host does with the replies (adopt rows, run the head, update statistics) stays with the mode.

mod link;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backburner_link::message::{LayersDone, RunLayers};
use backburner_link::{FrameReader, FrameWriter, LinkError};

pub(crate) use link::Pace;

/// A ubatch's request on its way to a link: the `RunLayers`, its tensor section (the residual `[t, hidden]` f32,
/// little-endian), and the compute the worker may take for it (part of the reply's deadline).
pub(crate) struct Hop {
    pub msg: RunLayers,
    pub bytes: Vec<u8>,
    pub compute: Duration,
}

/// One worker connection of a call: its two halves and its deadline inputs.
pub(crate) struct Link<'a> {
    pub writer: &'a mut FrameWriter,
    pub reader: &'a mut FrameReader,
    pub pace: Pace,
}

/// The host's part of a mode, run on the calling thread in ubatch order.
pub(crate) trait HostStage {
    /// Runs the host's part of ubatch `i`: `Some(hop)` goes to the first link, `None` keeps the ubatch on the host
    /// (split prefill's last one). Errors stop the call (the links' results are then dropped).
    fn step(&mut self, i: usize) -> Result<Option<Hop>, LinkError>;
}

/// The link side of a mode, called on the links' threads (`link` is the index in the chain).
pub(crate) trait LinkStage: Sync {
    /// What a link's trailing exchange returns.
    type Tail: Send;

    /// Bytes of the reply's tensor section for a ubatch of `tokens` tokens (its deadline's transfer time).
    fn reply_bytes(&self, link: usize, tokens: usize) -> usize;

    /// Checks a reply against its request (positions, residual size). An error fails the link.
    fn check(
        &self,
        _link: usize,
        _req: &RunLayers,
        _done: &LayersDone,
        _back: &[u8],
    ) -> Result<(), LinkError> {
        Ok(())
    }

    /// The compute `link` (≥ 1) may take for a relayed ubatch of `tokens` tokens.
    fn relay_compute(&self, link: usize, tokens: usize) -> Duration;

    /// After the stream: what the sender writes (`prev`: the last request's compute, which it may wait behind).
    fn send_tail(
        &self,
        _link: usize,
        _w: &mut FrameWriter,
        _pace: Pace,
        _prev: Duration,
    ) -> Result<(), LinkError> {
        Ok(())
    }

    /// After the stream: what the receiver reads (`last`: when the last reply arrived).
    fn receive_tail(
        &self,
        link: usize,
        r: &mut FrameReader,
        pace: Pace,
        last: Instant,
    ) -> Result<Self::Tail, LinkError>;
}

/// A reply that arrived and passed [`LinkStage::check`]: the ubatch's tokens and the worker's acknowledgement.
pub(crate) struct Ack {
    pub tokens: usize,
    pub done: LayersDone,
}

/// A link's failure: its index in the chain and why.
pub(crate) struct LinkFailure {
    pub link: usize,
    pub error: LinkError,
}

/// What a call brought back.
pub(crate) struct Outcome<T> {
    /// Per link in chain order, the replies that arrived and passed the check (also when the call failed).
    pub acks: Vec<Vec<Ack>>,
    /// The last link's replies in order: each request with the tensor section its reply carried.
    pub out: Vec<(RunLayers, Vec<u8>)>,
    /// Every link's tail, or the first failure (lowest link; its receiver's error before its sender's).
    pub result: Result<Vec<T>, LinkFailure>,
}

/// A link's two threads' results: its acknowledgements and tail (`None`: its stream was cut), and its sender's.
type Joined<T> = (
    Vec<Ack>,
    Result<Option<T>, LinkError>,
    Result<(), LinkError>,
);

/// Runs ubatches of `ubatches` tokens each (their count is the number of host steps) through the host's part and
/// the chain of `links` (at least one), pipelined: the host computes ubatch i + 1 while the links carry and the
/// workers compute the earlier ones.
///
/// Errors: the host step's error (`Err`); a link's failure is in [`Outcome::result`].
pub(crate) fn drive<L: LinkStage>(
    links: Vec<Link<'_>>,
    stage: &L,
    host: &mut dyn HostStage,
    ubatches: &[usize],
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Outcome<L::Tail>, LinkError> {
    let n = links.len();
    assert!(n > 0, "a pipelined call needs a link");
    let failed = AtomicBool::new(false);
    let (out_tx, out_rx) = mpsc::channel::<(RunLayers, Vec<u8>)>();
    let (hops_tx, hops_rx): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel::<Hop>()).unzip();
    let first_tx = hops_tx[0].clone();
    let (fed, joined) = std::thread::scope(|sc| {
        let mut handles = Vec::with_capacity(n);
        for (i, (link, rx)) in links.into_iter().zip(hops_rx).enumerate() {
            let next = hops_tx.get(i + 1).cloned();
            let ends = link::Ends {
                next,
                out: out_tx.clone(),
                failed: &failed,
            };
            handles.push(link::spawn(sc, i, link, rx, ends, stage));
        }
        drop(hops_tx);
        drop(out_tx);
        let fed = feed(host, first_tx, ubatches, progress, &failed);
        let joined: Vec<Joined<L::Tail>> = handles
            .into_iter()
            .map(|(s, r)| {
                let (acks, got) = r.join().expect("link receiver thread");
                (acks, got, s.join().expect("link sender thread"))
            })
            .collect();
        (fed, joined)
    });
    fed?;
    let (acks, result) = settle(joined);
    let out = out_rx.try_iter().collect();
    Ok(Outcome { acks, out, result })
}

/// Each link's acknowledgements, and every tail or the first failure: links in order, a receiver's error before its
/// sender's. A stream cut with no error anywhere (which the threads never do) is an error too.
fn settle<T>(joined: Vec<Joined<T>>) -> (Vec<Vec<Ack>>, Result<Vec<T>, LinkFailure>) {
    let mut acks = Vec::with_capacity(joined.len());
    let mut got = Vec::with_capacity(joined.len());
    let mut first = None;
    for (link, (a, tail, sent)) in joined.into_iter().enumerate() {
        acks.push(a);
        match tail.and_then(|t| sent.map(|()| t)) {
            Ok(t) => got.push(t),
            Err(error) => {
                first.get_or_insert(LinkFailure { link, error });
            }
        }
    }
    let result = match first {
        Some(f) => Err(f),
        None => got
            .into_iter()
            .enumerate()
            .map(|(link, t)| {
                t.ok_or_else(|| LinkFailure {
                    link,
                    error: LinkError::Malformed("the stream to the worker was cut".into()),
                })
            })
            .collect(),
    };
    (acks, result)
}

/// The host's loop: each ubatch's step in turn, its hop to the first link; stops once a link failed.
fn feed(
    host: &mut dyn HostStage,
    first: mpsc::Sender<Hop>,
    ubatches: &[usize],
    progress: &mut dyn FnMut(usize, usize),
    failed: &AtomicBool,
) -> Result<(), LinkError> {
    let total: usize = ubatches.iter().sum();
    let mut done = 0;
    for (i, t) in ubatches.iter().enumerate() {
        if failed.load(Ordering::Relaxed) {
            break;
        }
        done += t;
        if let Some(hop) = host.step(i)? {
            let _ = first.send(hop);
            progress(done, total);
        }
    }
    Ok(())
}

/// The compute a worker may take for `tokens` tokens through `layers` layers: 4× its observed time per token and
/// layer, or before any observation the host's own (`host_us` per token and layer, scaled by threads), never more
/// than 25× what the host's speed suggests; capped at a day.
pub(crate) fn compute_allowance(
    observed: Option<f64>,
    host_us: f64,
    host_threads: usize,
    worker_threads: usize,
    tokens: usize,
    layers: usize,
) -> Duration {
    let host_based = host_us * host_threads.max(1) as f64 / worker_threads.max(1) as f64;
    let per = observed.map_or(host_based, |o| o.min(25.0 * host_based));
    Duration::from_secs_f64((4.0 * per * (tokens * layers) as f64 / 1e6).min(86_400.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bad(m: &str) -> LinkError {
        LinkError::Malformed(m.into())
    }

    fn why<T>(r: Result<Vec<T>, LinkFailure>) -> (usize, String) {
        let f = r.err().expect("a failure");
        (f.link, f.error.to_string())
    }

    #[test]
    fn the_first_failure_is_the_lowest_link_and_its_receiver_first() {
        let joined: Vec<Joined<u8>> = vec![
            (Vec::new(), Ok(Some(1)), Ok(())),
            (Vec::new(), Err(bad("receiver 1")), Err(bad("sender 1"))),
            (Vec::new(), Err(bad("receiver 2")), Ok(())),
        ];
        let (acks, r) = settle(joined);
        assert_eq!(acks.len(), 3);
        let (link, e) = why(r);
        assert_eq!(link, 1);
        assert!(e.contains("receiver 1"), "{e}");
        // a stream cut by its failing sender reports the sender's error
        let joined: Vec<Joined<u8>> = vec![
            (Vec::new(), Ok(None), Err(bad("sender 0"))),
            (Vec::new(), Err(bad("receiver 1")), Ok(())),
        ];
        let (link, e) = why(settle(joined).1);
        assert_eq!(link, 0);
        assert!(e.contains("sender 0"), "{e}");
    }

    #[test]
    fn every_tail_on_success_and_a_cut_stream_is_an_error() {
        let joined: Vec<Joined<u8>> = vec![
            (Vec::new(), Ok(Some(7)), Ok(())),
            (Vec::new(), Ok(Some(9)), Ok(())),
        ];
        assert_eq!(settle(joined).1.ok(), Some(vec![7, 9]));
        let joined: Vec<Joined<u8>> = vec![
            (Vec::new(), Ok(Some(7)), Ok(())),
            (Vec::new(), Ok(None), Ok(())),
        ];
        assert_eq!(why(settle(joined).1).0, 1);
    }

    /// A host that keeps ubatch `keep` and sends the others.
    struct Steps {
        keep: usize,
        ran: Vec<usize>,
    }

    impl HostStage for Steps {
        fn step(&mut self, i: usize) -> Result<Option<Hop>, LinkError> {
            self.ran.push(i);
            Ok((i != self.keep).then(|| Hop {
                msg: RunLayers {
                    pos: 0,
                    n_tokens: 1,
                    keep: Vec::new(),
                    verify: false,
                },
                bytes: Vec::new(),
                compute: Duration::ZERO,
            }))
        }
    }

    #[test]
    fn the_host_reports_progress_per_request_sent_and_stops_once_a_link_failed() {
        let (tx, rx) = mpsc::channel();
        let mut host = Steps {
            keep: 2,
            ran: Vec::new(),
        };
        let mut seen = Vec::new();
        let failed = AtomicBool::new(false);
        feed(
            &mut host,
            tx,
            &[3, 4, 5],
            &mut |d, t| seen.push((d, t)),
            &failed,
        )
        .unwrap();
        assert_eq!(host.ran, vec![0, 1, 2]);
        assert_eq!(seen, vec![(3, 12), (7, 12)]);
        assert_eq!(rx.try_iter().count(), 2);
        let (tx, _rx) = mpsc::channel();
        failed.store(true, Ordering::Relaxed);
        let mut host = Steps {
            keep: 9,
            ran: Vec::new(),
        };
        feed(&mut host, tx, &[3, 4], &mut |_, _| {}, &failed).unwrap();
        assert!(host.ran.is_empty());
    }
}
