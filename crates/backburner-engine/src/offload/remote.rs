//! The forward pass's store of pages held by workers: the `Attend`s of every worker holding a run are sent before
//! any answer is read (the workers compute in parallel, the host its own pages), and their partials are folded in
//! page order.
//!
//! The first worker answers one partial folded over its run. A later worker answers one partial per page; so that
//! such an answer stays as small as one folded partial of the whole op (the buffer the worker keeps for it), its
//! queries go in token chunks of `n_tokens / pages` rows (at least one), each answered separately. A query row's
//! partial does not depend on the other rows of its request, so the chunks give the same bits.

use std::ops::Range;

use backburner_kernels::attention::{fold_partials, Partial};
use backburner_link::message::Attend;
use backburner_link::LinkError;
use backburner_model::{RemoteError, RemotePages};

use super::{Placement, Run, Workers};

/// The op in flight: its shape, and per run the token chunks sent.
struct Pending {
    layer: usize,
    n_tokens: usize,
    n_heads: usize,
    chunks: Vec<Vec<Range<usize>>>,
}

/// [`RemotePages`] over the workers of a session.
pub struct LinkPages {
    workers: Workers,
    placement: Placement,
    head_dim: usize,
    page_size: usize,
    pending: Option<Pending>,
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
        }
    }

    fn fail(&self, worker: usize, e: impl std::fmt::Display) -> RemoteError {
        RemoteError(format!("KV pages on worker {worker}: {e}"))
    }

    /// Pages of `run` (one partial each from a later worker).
    fn pages(&self, run: &Run) -> usize {
        (run.end - run.start) / self.page_size.max(1)
    }

    /// The token chunks of run `i` for `n_tokens` queries.
    fn chunks(&self, i: usize, run: &Run, n_tokens: usize) -> Vec<Range<usize>> {
        let step = if i == 0 {
            n_tokens
        } else {
            (n_tokens / self.pages(run).max(1)).max(1)
        };
        (0..n_tokens)
            .step_by(step.max(1))
            .map(|a| a..(a + step).min(n_tokens))
            .collect()
    }
}

/// Reads and drops the answers to `sent` chunks per run, so those workers' sessions stay in step after a failure.
fn drain(
    ws: &mut [crate::split::WorkerClient],
    sent: &[(usize, Range<usize>)],
    n_heads: usize,
    d: usize,
) {
    for (worker, c) in sent {
        let w = &mut ws[*worker];
        if w.link.conn.is_some() {
            if let Err(e) = w.attend_recv(c.len(), n_heads, d) {
                w.fail_offload(&e);
            }
        }
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
            u32::try_from(v)
                .map_err(|_| RemoteError(format!("KV pages: {v} does not fit the protocol")))
        };
        let runs = self.placement.runs().to_vec();
        let row = n_heads * self.head_dim;
        let workers = self.workers.clone();
        let mut ws = workers.lock().unwrap_or_else(|p| p.into_inner());
        let mut sent: Vec<(usize, Range<usize>)> = Vec::new();
        let mut chunks = Vec::with_capacity(runs.len());
        for (i, run) in runs.iter().enumerate() {
            let cs = self.chunks(i, run, n_tokens);
            let parts = if i == 0 { 1 } else { self.pages(run) };
            for c in &cs {
                let a = Attend {
                    layer: shape(layer)?,
                    q_pos0: (q_pos0 + c.start) as u64,
                    n_tokens: shape(c.len())?,
                    n_heads: shape(n_heads)?,
                    scale,
                    per_page: i > 0,
                };
                let rows = &q[c.start * row..c.end * row];
                let r = match ws.get_mut(run.worker) {
                    Some(w) => w
                        .attend_send(&a, rows, run.end - run.start, parts)
                        .inspect_err(|e| w.fail_offload(e)),
                    None => Err(LinkError::Refused("no such worker".into())),
                };
                if let Err(e) = r {
                    drain(&mut ws, &sent, n_heads, self.head_dim);
                    return Err(self.fail(run.worker, e));
                }
                sent.push((run.worker, c.clone()));
            }
            chunks.push(cs);
        }
        self.pending = Some(Pending {
            layer,
            n_tokens,
            n_heads,
            chunks,
        });
        Ok(())
    }

    fn finish(&mut self, layer: usize) -> Result<Partial, RemoteError> {
        let Some(p) = self.pending.take() else {
            return Err(RemoteError("KV pages: finish without begin".into()));
        };
        if p.layer != layer {
            return Err(RemoteError(format!(
                "KV pages: finish for layer {layer}, begun for {}",
                p.layer
            )));
        }
        let (t, h, d) = (p.n_tokens, p.n_heads, self.head_dim);
        let workers = self.workers.clone();
        let mut ws = workers.lock().unwrap_or_else(|p| p.into_inner());
        let mut acc: Option<Partial> = None;
        let mut first_err: Option<RemoteError> = None;
        // every answer is read, even after a failure, so the other workers' sessions stay in step
        for (i, (run, cs)) in self
            .placement
            .runs()
            .to_vec()
            .iter()
            .zip(&p.chunks)
            .enumerate()
        {
            let want = if i == 0 { 1 } else { self.pages(run) };
            let mut parts: Vec<Partial> = (0..want).map(|_| Partial::empty(t, h, d)).collect();
            let w = &mut ws[run.worker];
            for c in cs {
                if w.link.conn.is_none() {
                    continue; // failed on an earlier chunk
                }
                let got = w.attend_recv(c.len(), h, d).and_then(|g| {
                    if g.len() == want {
                        Ok(g)
                    } else {
                        Err(LinkError::Malformed(format!(
                            "{} partials where {want} were due",
                            g.len()
                        )))
                    }
                });
                match got {
                    Ok(g) => {
                        for (dst, src) in parts.iter_mut().zip(&g) {
                            dst.o[c.start * h * d..c.end * h * d].copy_from_slice(&src.o);
                            dst.lse[c.start * h..c.end * h].copy_from_slice(&src.lse);
                        }
                    }
                    Err(e) => {
                        w.fail_offload(&e);
                        let err = self.fail(run.worker, e);
                        first_err.get_or_insert(err);
                    }
                }
            }
            match acc.as_mut() {
                None => acc = parts.into_iter().next(),
                Some(a) => fold_partials(a, parts.iter()),
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        acc.ok_or_else(|| RemoteError("KV pages: no worker holds pages".into()))
    }
}
