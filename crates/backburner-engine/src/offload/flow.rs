//! A session's prefill and decode under a KV budget: moving the oldest pages to workers before a step would pass
//! the budget, attending through them, and recovering when a worker holding pages fails (re-ingesting the lost
//! positions from the token history, or a typed error that keeps the session for a later rebuild).

use backburner_kernels::profile::{self, Phase};
use backburner_model::{KvOptions, GDN_CHUNK};

use super::recovery::backoff_reason;
use super::{attention_layers, LinkPages, PutOutcome};
use crate::error::{EngineError, Result};
use crate::history::History;
use crate::session::{Logits, Session};
use crate::worker::pages::{page_bytes, PageShape};

/// Why a budgeted step stopped.
pub(crate) enum Failure {
    /// Nothing was lost; the request fails with this error.
    Refused(EngineError),
    /// A worker holding pages failed: those positions are gone.
    Lost(String),
}

impl Session {
    /// The KV budget in positions, if any.
    pub(crate) fn budget_positions(&self) -> Option<usize> {
        let kv: KvOptions = self.opts.kv;
        self.opts
            .kv_budget
            .map(|b| b.positions(self.model.config(), kv))
    }

    /// Whether a prefill of `add` tokens goes the budgeted way (pages held by workers, a pending rebuild, or the
    /// budget would be passed).
    pub(crate) fn offload_needed(&self, add: usize) -> bool {
        self.rebuild
            || self.state.offloaded() > 0
            || self
                .budget_positions()
                .is_some_and(|b| self.history.len().saturating_add(add) > b)
    }

    /// Drops the state and the pages on workers (best effort); the tokens are kept for a rebuild.
    pub(crate) fn drop_state_for_rebuild(&mut self) {
        let held: Vec<usize> = self.placement.runs().iter().map(|r| r.worker).collect();
        {
            let mut ws = self.lock_workers();
            for i in held {
                if let Some(w) = ws.get_mut(i) {
                    if w.link.conn.is_some() {
                        if let Err(e) = w.pages_drop(0) {
                            w.fail_offload(&e);
                        }
                    }
                }
            }
        }
        self.placement.clear();
        self.state.clear();
        let _ = self.state.take_remote_error();
        self.rebuild = !self.history.is_empty();
    }

    /// Prefill of validated `ids` under the KV budget, re-ingesting the history first when a rebuild is pending.
    /// A worker lost mid-call is recovered by re-ingesting everything with the workers left (or locally when the
    /// budget allows). A request that failed because a worker's session was lost (a dropped connection, an
    /// eviction, a deadline) is retried once at once, on a fresh connection to that worker. When pages must move and
    /// every worker that could take them is waiting out a backoff that ends within
    /// [`crate::connection::MAX_BACKOFF_WAIT`], the request waits for it once and tries again. Failing all that,
    /// the request fails with [`EngineError::KvBudget`] and the session keeps its tokens (without `ids`) for a later
    /// rebuild.
    pub(crate) fn prefill_budgeted(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut impl FnMut(usize, usize),
    ) -> Result<Vec<f32>> {
        if let Some(b) = self.budget_positions() {
            let need = self.history.len().saturating_add(ids.len());
            if need > b && self.lock_workers().is_empty() {
                let why = "no worker is attached to hold the oldest pages (--worker)";
                return Err(self.budget_error(need, why.into()));
            }
        }
        self.backoff_waited = false;
        let n_workers = self.lock_workers().len();
        let (mut losses, mut retried) = (0usize, false);
        loop {
            let before = self.sessions_lost();
            let failure = match self.attempt_budgeted(ids, which, progress) {
                Ok(logits) => return Ok(logits),
                Err(f) => f,
            };
            let err = match failure {
                Failure::Refused(e) => Some(e),
                Failure::Lost(why) => {
                    self.offload_stats.offload_failures += 1;
                    tracing::warn!(
                        "KV pages on a worker were lost ({why}); re-ingesting {} tokens of history, then the {} of \
                         this step",
                        self.history.len(),
                        ids.len()
                    );
                    losses += 1;
                    (losses > n_workers).then(|| {
                        let need = self.history.len() + ids.len();
                        self.budget_error(need, format!("workers kept failing ({why})"))
                    })
                }
            };
            let lost = self.lost_since(&before);
            if retried || lost.is_empty() {
                if let Some(e) = err {
                    return Err(e);
                }
                continue;
            }
            retried = true;
            self.retry_now(&lost);
        }
    }

    /// One try of [`Session::prefill_budgeted`]. On failure the session is as before the call, or its state is
    /// dropped for a rebuild (its history kept, without `ids`).
    pub(crate) fn attempt_budgeted(
        &mut self,
        ids: &[u32],
        which: Logits,
        progress: &mut impl FnMut(usize, usize),
    ) -> std::result::Result<Vec<f32>, Failure> {
        let history = self.rebuild.then(|| self.history.take());
        if history.is_some() {
            self.placement.clear();
            self.state.clear();
        }
        let skip = history.as_ref().map_or(0, History::len);
        let input: Vec<u32> = match &history {
            Some(h) => h.tokens().iter().chain(ids).copied().collect(),
            None => ids.to_vec(),
        };
        // the history's own calls again (the same bits), then the new ids on the grid
        let grid = self.grid();
        let start = self.history.len();
        let mut calls = history.as_ref().map_or_else(Vec::new, |h| h.calls(grid));
        calls.extend(grid.ubatches(start + skip, ids.len()));
        // a refusal is raised before a ubatch runs: a call of one ubatch changes nothing before it, so only a
        // longer one needs a snapshot (a copy of every linear state: not on the decode path)
        let multi = calls.len() > 1;
        let snap = multi.then(|| self.state.snapshot());
        let off0 = self.state.offloaded();
        let failure = match self.run_budgeted(&input, &calls, which, skip, progress) {
            Ok(logits) => {
                self.rebuild = false;
                return Ok(logits);
            }
            Err(f) => f,
        };
        // the tokens before this call, and none of the checkpoints it took
        self.history.truncate(start);
        if let Some(h) = history {
            self.history = h;
        }
        let kept = self.history.len();
        self.taken.retain(|c| c.n_tokens() <= kept);
        match failure {
            Failure::Refused(_) if self.state.offloaded() == off0 && !self.rebuild => {
                if let Some(snap) = &snap {
                    self.state.restore(snap);
                }
            }
            _ => self.drop_state_for_rebuild(),
        }
        Err(failure)
    }

    /// Runs `input` (the tokens at the end of the history) as the forward `calls` (consecutive absolute position
    /// ranges covering it), moving pages to workers as the budget requires; returns the logits of `which` for the
    /// tokens past the first `skip` (re-ingested history).
    fn run_budgeted(
        &mut self,
        input: &[u32],
        calls: &[std::ops::Range<usize>],
        which: Logits,
        skip: usize,
        progress: &mut impl FnMut(usize, usize),
    ) -> std::result::Result<Vec<f32>, Failure> {
        profile::set_phase(if input.len() == 1 {
            Phase::Decode
        } else {
            Phase::Prefill
        });
        let mut out = Vec::new();
        let mut done = 0;
        let head_dim = self.model.config().head_dim;
        let ps = self.opts.kv.page_size;
        let base = self.history.len();
        for r in calls {
            let chunk = &input[r.start - base..r.end - base];
            let t = chunk.len();
            self.make_room(t)?;
            let decode_bytes =
                (input.len() == 1 && self.state.offloaded() > 0).then(|| self.link_bytes());
            if self.state.offloaded() > 0 {
                let lp = LinkPages::new(self.workers.clone(), self.placement.clone(), head_dim, ps);
                self.state.set_remote(Box::new(lp));
            }
            let want = match which {
                Logits::All if done + t > skip => Some(skip.saturating_sub(done)..t),
                Logits::All => None,
                Logits::Last if done + t == input.len() => Some(t - 1..t),
                Logits::Last => None,
            };
            let capture = self.capture_begin(t);
            let (model, state) = (&self.model, &mut self.state);
            // two halves on GDN-chunk boundaries, so each half's arithmetic is that of the whole ubatch
            let split = (t / 2) / GDN_CHUNK * GDN_CHUNK;
            // the MTP block takes every new position's hidden row (not interleaved then: one pass gives them); a
            // re-ingested history's it has already
            let mtp = self.mtp.is_some() && r.start >= base + skip;
            // (not with layers on a device either: the interleaved pass is the CPU path's)
            let interleave = self.opts.interleave
                && !mtp
                && state.offloaded() > 0
                && split >= GDN_CHUNK
                && model.placement().is_empty();
            let (logits, hidden) = self.opts.pool.install(|| {
                if interleave {
                    (
                        model.forward_tokens_interleaved(chunk, split, state, want),
                        None,
                    )
                } else if mtp {
                    let (l, h) = model.forward_tokens_hidden(chunk, state, want);
                    (l, Some(h))
                } else {
                    (model.forward_tokens(chunk, state, want), None)
                }
            });
            self.state.take_remote();
            self.offload_stats.interleaved_ubatches += u64::from(interleave);
            if let Some(e) = self.state.take_remote_error() {
                self.capture_discard(capture);
                return Err(Failure::Lost(e.to_string()));
            }
            if let Some(before) = decode_bytes {
                self.offload_stats.offload_decode_tokens += 1;
                self.offload_stats.offload_decode_bytes += self.link_bytes().saturating_sub(before);
            }
            out.extend(logits);
            if let Some(h) = hidden {
                self.mtp_feed(r.start, chunk, &h);
            }
            self.history.push_call(chunk, self.grid());
            self.capture_end(capture);
            done += t;
            if done > skip {
                progress(done - skip, input.len() - skip);
            }
        }
        Ok(out)
    }

    fn link_bytes(&self) -> u64 {
        self.lock_workers()
            .iter()
            .map(|w| {
                let s = w.stats();
                s.bytes_sent + s.bytes_received
            })
            .sum()
    }

    fn refuse(&self, need: usize, why: String) -> Failure {
        Failure::Refused(self.budget_error(need, why))
    }

    /// The typed budget error, saying how a byte budget was converted to positions.
    pub(crate) fn budget_error(&self, need: usize, why: String) -> EngineError {
        let why = match self.opts.kv_budget {
            Some(super::KvBudget::Bytes(b)) => {
                let per = super::bytes_per_position(self.model.config(), self.opts.kv);
                format!("{why} (the budget of {b} bytes is that many positions at {per} bytes of KV per position)")
            }
            _ => why,
        };
        EngineError::KvBudget {
            budget: self.budget_positions().unwrap_or(usize::MAX),
            need,
            why,
        }
    }

    /// Moves whole pages of the oldest positions to workers until `add` more positions fit the budget.
    pub(super) fn make_room(&mut self, add: usize) -> std::result::Result<(), Failure> {
        let Some(budget) = self.budget_positions() else {
            return Ok(());
        };
        let on_host = self.state.n_tokens() - self.state.offloaded();
        if on_host + add <= budget {
            return Ok(());
        }
        let ps = self.opts.kv.page_size;
        let layers = attention_layers(self.model.config());
        let n = (on_host + add - budget).div_ceil(ps);
        let movable = layers
            .iter()
            .filter_map(|&l| self.state.movable_pages(l))
            .min()
            .unwrap_or(0);
        if n > movable {
            let why = format!(
                "a step of {add} tokens needs {n} page{} of {ps} positions moved but only {movable} full page{} may move (the newest page stays); raise --kv-budget to at least {} positions, or lower --kv-page-size or --ubatch",
                if n == 1 { "" } else { "s" },
                if movable == 1 { "" } else { "s" },
                add + ps
            );
            return Err(self.refuse(on_host + add, why));
        }
        if self.lock_workers().is_empty() {
            return Err(self.refuse(
                on_host + add,
                "no worker is attached to take the oldest pages (--worker)".into(),
            ));
        }
        let mut left = n;
        while left > 0 {
            let k = left.min(self.pages_per_frame(layers.len()));
            self.move_pages(&layers, k, on_host + add)?;
            left -= k;
        }
        Ok(())
    }

    /// Pages (per layer) that fit one `PagesPut` frame.
    fn pages_per_frame(&self, n_layers: usize) -> usize {
        let per = self
            .page_shape()
            .page_bytes()
            .unwrap_or(usize::MAX)
            .saturating_mul(n_layers.max(1));
        let ws = self.lock_workers();
        let frame = ws
            .iter()
            .map(|w| {
                let lim = w.link.limits.map_or(usize::MAX, |l| {
                    usize::try_from(l.max_frame).unwrap_or(usize::MAX)
                });
                w.link.settings.frame_budget.min(lim)
            })
            .min()
            .unwrap_or(usize::MAX);
        (frame / per.max(1)).max(1)
    }

    pub(crate) fn page_shape(&self) -> PageShape {
        let c = self.model.config();
        PageShape {
            page_size: self.opts.kv.page_size,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            dtype: self.opts.kv.dtype,
        }
    }

    /// Puts the `k` oldest host pages of every attention layer on a worker (the open run's, or the next one with
    /// room) and frees them here.
    fn move_pages(
        &mut self,
        layers: &[usize],
        k: usize,
        need: usize,
    ) -> std::result::Result<(), Failure> {
        let shape = self.page_shape();
        let mut bytes = Vec::new();
        for &l in layers {
            let put = &mut |p: &backburner_kernels::kv::KvPage| {
                bytes.extend(page_bytes(p.view(), &shape))
            };
            if let Err(e) = self.state.for_oldest_pages(l, k, put) {
                return Err(Failure::Refused(EngineError::InvalidSetting(format!(
                    "moving KV pages of layer {l}: {e}"
                ))));
            }
        }
        let first = self.state.offloaded();
        let cfg = self.model.config().clone();
        let (kv, ubatch) = (self.opts.kv, self.opts.ubatch);
        let n_workers = self.lock_workers().len();
        let from = self.placement.open_worker().unwrap_or(0);
        let mut why = Vec::new();
        let mut soonest: Option<std::time::Duration> = None;
        for wi in from..n_workers {
            let mut ws = self.lock_workers();
            let w = &mut ws[wi];
            let holds = self.placement.uses(wi);
            if holds && w.link.conn.is_none() {
                return Err(Failure::Lost(format!(
                    "worker {wi} ({}) lost its connection",
                    w.link.settings.addr
                )));
            }
            if let Some(left) = w.retry_in().filter(|_| !holds) {
                soonest = Some(soonest.map_or(left, |s| s.min(left)));
                why.push(backoff_reason(&w.link.settings.addr, left));
                continue;
            }
            if let Err(e) = w.ensure_connected(&cfg, kv.dtype, kv.page_size, ubatch) {
                w.fail_offload(&e);
                why.push(format!("{}: {e}", w.link.settings.addr));
                continue;
            }
            match w.pages_put(first as u64, k as u32, &bytes) {
                Ok(PutOutcome::Stored(_)) => {
                    drop(ws);
                    for &l in layers {
                        self.state
                            .take_oldest_pages(l, k)
                            .expect("movable pages checked, copied above");
                    }
                    self.placement.push(wi, k * shape.page_size);
                    self.offload_stats.pages_moved += (k * layers.len()) as u64;
                    return Ok(());
                }
                Ok(PutOutcome::Full(f)) => {
                    why.push(full_reason(&w.link.settings.addr, &f, bytes.len()))
                }
                Err(e) => {
                    let addr = w.link.settings.addr.clone();
                    w.fail_offload(&e);
                    if holds {
                        return Err(Failure::Lost(format!("worker {wi} ({addr}): {e}")));
                    }
                    why.push(format!("{addr}: {e}"));
                }
            }
        }
        if self.wait_for_backoff(soonest) {
            return self.move_pages(layers, k, need);
        }
        Err(self.refuse(
            need,
            format!("no worker took the oldest pages: {}", why.join("; ")),
        ))
    }
}

/// Why a worker answered `PagesFull` to a put of `pages` bytes: what it needed — the pages and the headroom it keeps
/// for answering attention once it holds any — against what it had free.
fn full_reason(addr: &str, f: &backburner_link::message::PagesFull, pages: usize) -> String {
    let pages = pages as u64;
    match f.needed.checked_sub(pages).filter(|&kept| kept > 0) {
        Some(kept) => format!(
            "{addr} is full ({} bytes needed: {pages} of pages and {kept} it keeps for answering attention; {} free)",
            f.needed, f.free
        ),
        None => format!(
            "{addr} is full ({} bytes of pages needed, {} free)",
            f.needed, f.free
        ),
    }
}
