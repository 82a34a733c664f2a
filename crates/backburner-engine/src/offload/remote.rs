//! The forward pass's store of pages held by workers: one `Attend` per worker holding a run, sent to all of them
//! before any answer is read (they compute in parallel), and their partials folded in page order.

use backburner_kernels::attention::{fold_partials, Partial};
use backburner_link::message::Attend;
use backburner_link::LinkError;
use backburner_model::{RemoteError, RemotePages};

use super::{Placement, Workers};

/// [`RemotePages`] over the workers of a session.
pub struct LinkPages {
    workers: Workers,
    placement: Placement,
    head_dim: usize,
    page_size: usize,
    /// The shape of the queries in flight: `(layer, n_tokens, n_heads)`.
    pending: Option<(usize, usize, usize)>,
    /// The first failure, and which worker failed.
    failed: Option<usize>,
}

impl LinkPages {
    /// A store over `workers` holding the runs of `placement` (pages of `page_size` positions), for heads of
    /// `head_dim`.
    pub fn new(workers: Workers, placement: Placement, head_dim: usize, page_size: usize) -> Self {
        LinkPages {
            workers,
            placement,
            head_dim,
            page_size,
            pending: None,
            failed: None,
        }
    }

    /// The worker whose failure was latched, if any.
    pub fn failed_worker(&self) -> Option<usize> {
        self.failed
    }

    fn fail(&mut self, worker: usize, e: impl std::fmt::Display) -> RemoteError {
        self.failed.get_or_insert(worker);
        RemoteError(format!("worker {worker}: {e}"))
    }
}

impl RemotePages for LinkPages {
    fn begin(
        &mut self,
        layer: usize,
        q: &[f32],
        n_tokens: usize,
        n_heads: usize,
        q_pos0: usize,
        scale: f32,
    ) -> Result<(), RemoteError> {
        let shape = |v: usize| {
            u32::try_from(v).map_err(|_| RemoteError(format!("{v} does not fit the protocol")))
        };
        let mut a = Attend {
            layer: shape(layer)?,
            q_pos0: q_pos0 as u64,
            n_tokens: shape(n_tokens)?,
            n_heads: shape(n_heads)?,
            scale,
            per_page: false,
        };
        let runs = self.placement.runs().to_vec();
        let workers = self.workers.clone();
        let mut ws = workers.lock().unwrap_or_else(|p| p.into_inner());
        for (i, run) in runs.iter().enumerate() {
            a.per_page = i > 0;
            let sent = match ws.get_mut(run.worker) {
                Some(w) => w
                    .attend_send(&a, q, run.end - run.start)
                    .inspect_err(|e| w.fail(e)),
                None => Err(LinkError::Refused("no such worker".into())),
            };
            if let Err(e) = sent {
                // the workers asked already answer; read and drop their answers so their sessions stay in step
                for r in &runs[..i] {
                    let w = &mut ws[r.worker];
                    if let Err(e) = w.attend_recv(n_tokens, n_heads, self.head_dim) {
                        w.fail(&e);
                    }
                }
                return Err(self.fail(run.worker, e));
            }
        }
        self.pending = Some((layer, n_tokens, n_heads));
        Ok(())
    }

    fn finish(&mut self, layer: usize) -> Result<Partial, RemoteError> {
        let Some((l, n_tokens, n_heads)) = self.pending.take() else {
            return Err(RemoteError("finish without begin".into()));
        };
        if l != layer {
            return Err(RemoteError(format!(
                "finish for layer {layer}, begun for {l}"
            )));
        }
        let workers = self.workers.clone();
        let mut ws = workers.lock().unwrap_or_else(|p| p.into_inner());
        let mut acc: Option<Partial> = None;
        let mut first_err: Option<RemoteError> = None;
        // every answer is read, even after a failure, so the other workers' sessions stay in step
        for (i, run) in self.placement.runs().to_vec().into_iter().enumerate() {
            let w = &mut ws[run.worker];
            let parts = match w.attend_recv(n_tokens, n_heads, self.head_dim) {
                Ok(p) => p,
                Err(e) => {
                    w.fail(&e);
                    let err = self.fail(run.worker, e);
                    first_err.get_or_insert(err);
                    continue;
                }
            };
            let want = if i == 0 {
                1
            } else {
                (run.end - run.start) / self.page_size.max(1)
            };
            if parts.len() != want {
                let e =
                    LinkError::Malformed(format!("{} partials where {want} were due", parts.len()));
                w.fail(&e);
                let err = self.fail(run.worker, e);
                first_err.get_or_insert(err);
                continue;
            }
            match acc.as_mut() {
                None => acc = parts.into_iter().next(),
                Some(a) => fold_partials(a, parts.iter()),
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        acc.ok_or_else(|| RemoteError("no worker holds pages".into()))
    }
}
