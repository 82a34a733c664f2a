//! The pipelined split prefill over a connected [`WorkerClient`], with a deadline on every message.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use backburner_link::frame::{f32_bytes, Kind};
use backburner_link::message::{Empty, Fetch, FetchDone, LayersDone, RunLayers, Sync};
use backburner_link::{FrameReader, FrameWriter, LinkError};
use backburner_model::{Model, ModelConfig, ModelState};

use super::WorkerClient;
use crate::compute::ComputePool;
use crate::grid::Grid;
use crate::wire;

/// Sets `r`'s deadline to `start + budget`.
fn deadline_from(r: &mut FrameReader, start: Instant, budget: Duration) {
    let left = budget.saturating_sub(start.elapsed());
    r.set_deadline(Some(left.max(Duration::from_millis(1))));
}

impl WorkerClient {
    /// Rows per `Sync`/`Fetch` frame under the frame budget (the host's and the worker's).
    fn rows_per_frame(&self, cfg: &ModelConfig, kv: backburner_kernels::kv::KvDtype) -> usize {
        let (l, n) = (self.split, cfg.num_hidden_layers);
        let budget = self
            .link
            .limits
            .map_or(self.link.settings.frame_budget, |w| {
                self.link
                    .settings
                    .frame_budget
                    .min(usize::try_from(w.max_frame).unwrap_or(usize::MAX))
            });
        let row_bytes = wire::payload_len(cfg, l..n, 1, kv, false)
            .unwrap_or(usize::MAX)
            .max(1);
        let lin_bytes = wire::payload_len(cfg, l..n, 0, kv, true).unwrap_or(usize::MAX);
        (budget.saturating_sub(lin_bytes) / row_bytes).max(1)
    }

    /// Brings the mirror to the host's position `p`: rows past the watermark, then the linear states.
    fn sync_mirror(
        &mut self,
        cfg: &ModelConfig,
        state: &ModelState,
        max_rows: usize,
    ) -> Result<(), LinkError> {
        let p = state.n_tokens();
        if self.mirror_kv == p && self.mirror_linear_at == Some(p) {
            return Ok(());
        }
        let (l, n) = (self.split, cfg.num_hidden_layers);
        let mut at = self.mirror_kv.min(p);
        loop {
            let to = (at + max_rows).min(p);
            let last = to == p;
            let payload = wire::encode(state, cfg, l..n, at, to, last);
            let d = self.allowance(payload.len(), Duration::ZERO);
            let conn = self.link.conn.as_mut().expect("connected");
            conn.set_deadline(Some(d));
            let msg = Sync {
                truncate_to: at as u64,
                pos_after: to as u64,
                linear: last,
            };
            if let Err(e) = conn.writer.send(Kind::Sync, &msg, &payload) {
                return Err(crate::connection::why(conn, e));
            }
            let _: (Empty, _) = conn.reader.expect(Kind::SyncDone, "SyncDone")?;
            at = to;
            if last {
                break;
            }
        }
        self.mirror_kv = p;
        self.mirror_linear_at = Some(p);
        Ok(())
    }

    /// Runs a split prefill of `ids` (≥ 2 ubatches of `grid`, ending at absolute multiples of its size) on `state`, returning the last token's logits `[vocab]`.
    /// On error the caller must restore `state` and rerun locally, then call [`WorkerClient::fail`].
    ///
    /// Every message has a deadline: `timeout + bytes / min_rate`, plus for a `LayersDone` the worker's expected
    /// compute for its ubatch, counted from when its `RunLayers` was sent or the previous reply arrived, whichever
    /// is later. A worker that stalls, trickles or loses frames fails the call within that time.
    pub fn prefill(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        ids: &[u32],
        grid: Grid,
        pool: &ComputePool,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Vec<f32>, LinkError> {
        backburner_kernels::profile::set_phase(backburner_kernels::profile::Phase::Prefill);
        let cfg = model.config();
        let kv = state.kv_options();
        self.ensure_connected(cfg, kv.dtype, kv.page_size, grid.ubatch())?;
        let (l, n) = (self.split, cfg.num_hidden_layers);
        let hidden = cfg.hidden_size;
        let p = state.n_tokens();
        let max_rows = self.rows_per_frame(cfg, kv.dtype);
        self.sync_mirror(cfg, state, max_rows)?;

        let chunks: Vec<&[u32]> = grid
            .ubatches(p, ids.len())
            .into_iter()
            .map(|r| &ids[r.start - p..r.end - p])
            .collect();
        let k = chunks.len();
        debug_assert!(k >= 2);
        let pos_last = p + ids.len() - chunks[k - 1].len();
        let fetches: Vec<Fetch> = (p..pos_last)
            .step_by(max_rows)
            .map(|a| {
                let b = (a + max_rows).min(pos_last);
                Fetch {
                    from_pos: a as u64,
                    to_pos: b as u64,
                    linear: b == pos_last,
                }
            })
            .collect();
        let fetch_bytes: Vec<usize> = fetches
            .iter()
            .map(|f| {
                let rows = (f.to_pos - f.from_pos) as usize;
                wire::payload_len(cfg, l..n, rows, kv.dtype, f.linear).unwrap_or(usize::MAX)
            })
            .collect();
        let worker_threads = self.link.worker_threads;
        let conn = self.link.conn.as_mut().expect("connected");
        let failed = AtomicBool::new(false);
        // the residual of a ubatch, with the worker's expected compute for it
        let (tx, rx) = mpsc::channel::<(RunLayers, Vec<u8>, Duration)>();
        // when each RunLayers went out, and its compute allowance
        let (sent_tx, sent_rx) = mpsc::channel::<(Instant, Duration)>();
        let base = (
            self.link.settings.timeout,
            self.link.settings.min_rate.max(1),
        );
        let allow = move |bytes: usize, compute: Duration| {
            let transfer = (bytes as f64 / base.1 as f64).min(1e9);
            base.0
                .saturating_add(compute)
                .saturating_add(Duration::from_secs_f64(transfer))
        };
        let (conn_w, conn_r) = (&mut conn.writer, &mut conn.reader);
        let observed = self.us_per_token_layer;
        let host_threads = self.link.settings.host_threads;
        let last: Result<(Vec<f32>, usize), LinkError> = std::thread::scope(|s| {
            let failed_ref = &failed;
            let (fetches_ref, fetch_bytes_ref) = (&fetches, &fetch_bytes);
            let sender = s.spawn(move || -> Result<(), LinkError> {
                let r = send_all(conn_w, rx, sent_tx, fetches_ref, &allow);
                if r.is_err() {
                    failed_ref.store(true, Ordering::Relaxed);
                }
                r
            });
            let expected = k - 1;
            let receiver = s.spawn(move || -> Result<Fetched, LinkError> {
                let r = receive_all(
                    conn_r,
                    expected,
                    sent_rx,
                    fetches_ref,
                    fetch_bytes_ref,
                    &allow,
                );
                if r.is_err() {
                    failed_ref.store(true, Ordering::Relaxed);
                }
                r
            });
            let mut pos = p;
            let mut out = None;
            for (ci, chunk) in chunks.iter().enumerate() {
                if failed.load(Ordering::Relaxed) {
                    break;
                }
                let t = chunk.len();
                let mut x = model
                    .embed(chunk)
                    .map_err(|e| LinkError::Malformed(e.to_string()))?;
                let st = &mut *state;
                let t0 = Instant::now();
                pool.install(|| model.forward_layers_at(0..l, &mut x, t, pos, st));
                let host_us = t0.elapsed().as_secs_f64() * 1e6 / (t * l.max(1)) as f64;
                pos += t;
                if ci + 1 < k {
                    // the worker's own timings set the allowance, but never more than 25× what the host's own
                    // speed suggests (a worker cannot buy itself day-long deadlines)
                    let host_based =
                        host_us * host_threads.max(1) as f64 / worker_threads.max(1) as f64;
                    let per = observed.map_or(host_based, |o| o.min(25.0 * host_based));
                    let compute = Duration::from_secs_f64(
                        (4.0 * per * ((n - l) * t) as f64 / 1e6).min(86_400.0),
                    );
                    let msg = RunLayers {
                        pos: (pos - t) as u64,
                        n_tokens: u32::try_from(t)
                            .expect("ubatch checked to fit u32 in the handshake"),
                        keep: Vec::new(),
                    };
                    let _ = tx.send((msg, f32_bytes(&x), compute));
                    progress(pos - p, ids.len());
                } else {
                    out = Some((x, t));
                }
            }
            drop(tx);
            let sent = sender.join().expect("sender thread");
            let got = receiver.join().expect("receiver thread");
            // The receiver's error first: it carries the worker's typed Error frame when there is one.
            let (acks, fetched) = got?;
            sent?;
            let (x, t) = out.ok_or_else(|| LinkError::Malformed("pipeline aborted".into()))?;
            check_replies(&acks, &fetched, &fetches, &chunks, p)?;
            // Adopt the worker's rows and states, then run the tail of the last ubatch here.
            for ((fd, payload), f) in fetched.iter().zip(fetches.iter()) {
                let rows = (fd.to_pos - fd.from_pos) as usize;
                wire::apply(state, cfg, l..n, rows, f.linear, payload)?;
            }
            self.link.stats.worker_compute_us += acks.iter().map(|a| a.compute_us).sum::<u64>();
            self.link.stats.worker_idle_us += acks.iter().skip(1).map(|a| a.idle_us).sum::<u64>();
            let us: u64 = acks.iter().map(|a| a.compute_us).sum();
            let toks = pos_last - p;
            if toks > 0 && n > l {
                self.us_per_token_layer = Some(us as f64 / (toks * (n - l)) as f64);
            }
            Ok((x, t))
        });
        let (mut x, t) = last?;
        pool.install(|| model.forward_layers_at(l..n, &mut x, t, pos_last, state));
        state.set_position(pos_last + t);
        progress(ids.len(), ids.len());
        self.mirror_kv = pos_last;
        self.mirror_linear_at = Some(pos_last);
        self.link.stats.worker_tokens += (pos_last - p) as u64;
        self.link.stats.split_calls += 1;
        self.succeeded();
        let logits = pool
            .install(|| model.logits(&x[(t - 1) * hidden..], 1))
            .map_err(|e| LinkError::Malformed(e.to_string()))?;
        Ok(logits)
    }
}

/// The worker's acknowledgements and the fetched rows with their payloads.
type Fetched = (Vec<LayersDone>, Vec<(FetchDone, Vec<u8>)>);

/// The sender thread: each residual as it comes, then the fetches. A `RunLayers` may wait in the socket while the
/// worker computes the previous ubatch, so its send deadline includes that ubatch's expected compute.
fn send_all(
    w: &mut FrameWriter,
    rx: mpsc::Receiver<(RunLayers, Vec<u8>, Duration)>,
    sent: mpsc::Sender<(Instant, Duration)>,
    fetches: &[Fetch],
    allow: &impl Fn(usize, Duration) -> Duration,
) -> Result<(), LinkError> {
    let mut prev = Duration::ZERO;
    for (msg, bytes, compute) in rx {
        w.set_deadline(Some(allow(bytes.len(), prev)));
        w.send(Kind::RunLayers, &msg, &bytes)?;
        let _ = sent.send((Instant::now(), compute));
        prev = compute;
    }
    for f in fetches {
        w.set_deadline(Some(allow(0, prev)));
        w.send(Kind::Fetch, f, &[])?;
    }
    Ok(())
}

/// The receiver thread: one `LayersDone` per `RunLayers`, each due `allow(0, compute)` after its request went out
/// or the previous reply arrived (whichever is later); then one `FetchDone` per `Fetch`, each due
/// `allow(bytes, 0)` after the previous reply.
fn receive_all(
    r: &mut FrameReader,
    expected: usize,
    sent: mpsc::Receiver<(Instant, Duration)>,
    fetches: &[Fetch],
    fetch_bytes: &[usize],
    allow: &impl Fn(usize, Duration) -> Duration,
) -> Result<Fetched, LinkError> {
    let mut acks = Vec::with_capacity(expected);
    let mut last = Instant::now();
    for _ in 0..expected {
        let Ok((at, compute)) = sent.recv() else {
            return Err(LinkError::Malformed("the sender stopped".into()));
        };
        deadline_from(r, at.max(last), allow(0, compute));
        let (a, _): (LayersDone, _) = r.expect(Kind::LayersDone, "LayersDone")?;
        acks.push(a);
        last = Instant::now();
    }
    let mut got = Vec::with_capacity(fetches.len());
    for bytes in fetch_bytes {
        deadline_from(r, last, allow(*bytes, Duration::ZERO));
        got.push(r.expect::<FetchDone>(Kind::FetchDone, "FetchDone")?);
        last = Instant::now();
    }
    Ok((acks, got))
}

/// Checks that the worker's replies are the ones asked for (positions of every ack and fetched range).
fn check_replies(
    acks: &[LayersDone],
    fetched: &[(FetchDone, Vec<u8>)],
    fetches: &[Fetch],
    chunks: &[&[u32]],
    p: usize,
) -> Result<(), LinkError> {
    let mut want = p as u64;
    for (a, c) in acks.iter().zip(chunks) {
        want += c.len() as u64;
        if a.pos_after != want {
            return Err(LinkError::Malformed(format!(
                "worker acknowledged position {}, expected {want}",
                a.pos_after
            )));
        }
    }
    for ((fd, _), want) in fetched.iter().zip(fetches) {
        if fd.from_pos != want.from_pos || fd.to_pos != want.to_pos {
            return Err(LinkError::Malformed(format!(
                "worker returned rows {}..{}, expected {}..{}",
                fd.from_pos, fd.to_pos, want.from_pos, want.to_pos
            )));
        }
    }
    Ok(())
}
