//! Split prefill over a connected [`WorkerClient`], on the pipelined driver ([`crate::pipeline`]): the host's part
//! of each ubatch (layers `[0, L)`; the last ubatch stays on the host), the worker's fetches after the stream, and
//! what the host does with them (adopt the worker's rows and states, run `[L, n)` of the last ubatch and the head).

use std::time::{Duration, Instant};

use backburner_kernels::kv::KvDtype;
use backburner_link::frame::{f32_bytes, Kind};
use backburner_link::message::{Empty, Fetch, FetchDone, LayersDone, RunLayers, Sync};
use backburner_link::{FrameReader, FrameWriter, LinkError};
use backburner_model::{Model, ModelConfig, ModelState};

use super::WorkerClient;
use crate::compute::ComputePool;
use crate::grid::Grid;
use crate::pipeline::{self, compute_allowance, Hop, HostStage, Link, LinkStage, Pace};
use crate::wire;

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

    /// Runs a split prefill of `ids` (≥ 2 ubatches of `grid`, ending at absolute multiples of its size) on `state`,
    /// returning the last token's logits `[vocab]`.
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
        let p = state.n_tokens();
        let max_rows = self.rows_per_frame(cfg, kv.dtype);
        self.sync_mirror(cfg, state, max_rows)?;

        let chunks: Vec<&[u32]> = grid
            .ubatches(p, ids.len())
            .into_iter()
            .map(|r| &ids[r.start - p..r.end - p])
            .collect();
        debug_assert!(chunks.len() >= 2);
        let pos_last = p + ids.len() - chunks[chunks.len() - 1].len();
        let fetches = Fetches::plan(cfg, l..n, kv.dtype, p..pos_last, max_rows);
        let (mut x, t) = self.stream(model, state, &chunks, pool, &fetches, progress)?;
        pool.install(|| model.forward_layers_at(l..n, &mut x, t, pos_last, state));
        state.set_position(pos_last + t);
        progress(ids.len(), ids.len());
        self.mirror_kv = pos_last;
        self.mirror_linear_at = Some(pos_last);
        self.link.stats.worker_tokens += (pos_last - p) as u64;
        self.link.stats.split_calls += 1;
        self.succeeded();
        let hidden = cfg.hidden_size;
        let logits = pool
            .install(|| model.logits(&x[(t - 1) * hidden..], 1))
            .map_err(|e| LinkError::Malformed(e.to_string()))?;
        Ok(logits)
    }

    /// Streams every ubatch of `chunks` but the last through the worker on the pipelined driver (the host computing
    /// the next ubatch's `[0, L)` meanwhile), runs the last one's `[0, L)` here, then fetches and adopts the
    /// worker's rows and states of the streamed positions. Returns the last ubatch's residual `[t, hidden]` and `t`.
    fn stream(
        &mut self,
        model: &Model,
        state: &mut ModelState,
        chunks: &[&[u32]],
        pool: &ComputePool,
        fetches: &Fetches,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<(Vec<f32>, usize), LinkError> {
        let cfg = model.config();
        let (l, n) = (self.split, cfg.num_hidden_layers);
        let p = state.n_tokens();
        let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let mut host = SplitHost {
            model,
            state: &mut *state,
            chunks,
            pool,
            layers: (l, n),
            pos: p,
            observed: self.us_per_token_layer,
            threads: (self.link.settings.host_threads, self.link.worker_threads),
            kept: None,
        };
        let pace = Pace::of(&self.link.settings);
        let conn = self.link.conn.as_mut().expect("connected");
        let link = Link {
            writer: &mut conn.writer,
            reader: &mut conn.reader,
            pace,
        };
        let got = pipeline::drive(vec![link], fetches, &mut host, &sizes, progress)?;
        let kept = host.kept.take();
        let fetched = got.result.map_err(|f| f.error)?.pop().unwrap_or_default();
        let (x, t) = kept.ok_or_else(|| LinkError::Malformed("pipeline aborted".into()))?;
        let acks: Vec<LayersDone> = got.acks.into_iter().flatten().map(|a| a.done).collect();
        check_replies(&acks, &fetched, &fetches.reqs, chunks, p)?;
        // Adopt the worker's rows and states; the caller runs the tail of the last ubatch here.
        for ((fd, payload), f) in fetched.iter().zip(fetches.reqs.iter()) {
            let rows = (fd.to_pos - fd.from_pos) as usize;
            wire::apply(state, cfg, l..n, rows, f.linear, payload)?;
        }
        let us: u64 = acks.iter().map(|a| a.compute_us).sum();
        self.link.stats.worker_compute_us += us;
        self.link.stats.worker_idle_us += acks.iter().skip(1).map(|a| a.idle_us).sum::<u64>();
        let toks: usize = sizes[..sizes.len() - 1].iter().sum();
        if toks > 0 && n > l {
            self.us_per_token_layer = Some(us as f64 / (toks * (n - l)) as f64);
        }
        Ok((x, t))
    }
}

/// The host's part of a split prefill: layers `[0, L)` of each ubatch at its position; every ubatch but the last
/// goes to the worker, the last one's residual stays here.
struct SplitHost<'a> {
    model: &'a Model,
    state: &'a mut ModelState,
    chunks: &'a [&'a [u32]],
    pool: &'a ComputePool,
    /// The split layer L and the model's layer count n.
    layers: (usize, usize),
    /// The next ubatch's position.
    pos: usize,
    /// The worker's observed compute per token and layer (µs).
    observed: Option<f64>,
    /// The host's and the worker's threads.
    threads: (usize, usize),
    /// The last ubatch's residual `[t, hidden]` after `[0, L)`, and `t`.
    kept: Option<(Vec<f32>, usize)>,
}

impl HostStage for SplitHost<'_> {
    fn step(&mut self, i: usize) -> Result<Option<Hop>, LinkError> {
        let chunk = self.chunks[i];
        let ((l, n), pos, t) = (self.layers, self.pos, chunk.len());
        let mut x = self
            .model
            .embed(chunk)
            .map_err(|e| LinkError::Malformed(e.to_string()))?;
        let (model, st) = (self.model, &mut *self.state);
        let t0 = Instant::now();
        self.pool
            .install(|| model.forward_layers_at(0..l, &mut x, t, pos, st));
        let host_us = t0.elapsed().as_secs_f64() * 1e6 / (t * l.max(1)) as f64;
        self.pos += t;
        if i + 1 == self.chunks.len() {
            self.kept = Some((x, t));
            return Ok(None);
        }
        // the worker's own timings set the allowance, but never more than 25× what the host's own speed suggests
        // (a worker cannot buy itself day-long deadlines)
        let (host_threads, worker_threads) = self.threads;
        let compute = compute_allowance(
            self.observed,
            host_us,
            host_threads,
            worker_threads,
            t,
            n - l,
        );
        let msg = RunLayers {
            pos: pos as u64,
            n_tokens: u32::try_from(t).expect("ubatch checked to fit u32 in the handshake"),
            keep: Vec::new(),
            verify: false,
        };
        Ok(Some(Hop {
            msg,
            bytes: f32_bytes(&x),
            compute,
        }))
    }
}

/// The fetches of the worker's rows `[from, to)` of `[L, n)` (the linear states with the last), each under the
/// frame budget, with each reply's expected bytes.
struct Fetches {
    reqs: Vec<Fetch>,
    bytes: Vec<usize>,
}

impl Fetches {
    fn plan(
        cfg: &ModelConfig,
        layers: std::ops::Range<usize>,
        kv: KvDtype,
        rows: std::ops::Range<usize>,
        max_rows: usize,
    ) -> Self {
        let reqs: Vec<Fetch> = rows
            .clone()
            .step_by(max_rows)
            .map(|a| {
                let b = (a + max_rows).min(rows.end);
                Fetch {
                    from_pos: a as u64,
                    to_pos: b as u64,
                    linear: b == rows.end,
                }
            })
            .collect();
        let bytes = reqs
            .iter()
            .map(|f| {
                let n = (f.to_pos - f.from_pos) as usize;
                wire::payload_len(cfg, layers.clone(), n, kv, f.linear).unwrap_or(usize::MAX)
            })
            .collect();
        Fetches { reqs, bytes }
    }
}

/// The split prefill's link: replies carry no residual; after the stream the fetches go out and their rows come back.
impl LinkStage for Fetches {
    type Tail = Vec<(FetchDone, Vec<u8>)>;

    fn reply_bytes(&self, _link: usize, _tokens: usize) -> usize {
        0
    }

    fn relay_compute(&self, _link: usize, _tokens: usize) -> Duration {
        Duration::ZERO // one link: nothing is relayed
    }

    fn send_tail(
        &self,
        _link: usize,
        w: &mut FrameWriter,
        pace: Pace,
        prev: Duration,
    ) -> Result<(), LinkError> {
        for f in &self.reqs {
            w.set_deadline(Some(pace.allow(0, prev)));
            w.send(Kind::Fetch, f, &[])?;
        }
        Ok(())
    }

    /// One `FetchDone` per `Fetch`, each due `allow(bytes, 0)` after the previous reply.
    fn receive_tail(
        &self,
        _link: usize,
        r: &mut FrameReader,
        pace: Pace,
        mut last: Instant,
    ) -> Result<Self::Tail, LinkError> {
        let mut got = Vec::with_capacity(self.reqs.len());
        for bytes in &self.bytes {
            pace.deadline_from(r, last, *bytes, Duration::ZERO);
            got.push(r.expect::<FetchDone>(Kind::FetchDone, "FetchDone")?);
            last = Instant::now();
        }
        Ok(got)
    }
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
