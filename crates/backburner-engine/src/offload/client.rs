//! KV-offload requests on a worker connection (docs/PROTOCOL.md §5.11): put pages, drop pages, attend.

use std::time::Duration;

use backburner_kernels::attention::Partial;
use backburner_link::frame::{bytes_f32, f32_bytes, Kind};
use backburner_link::message::{Attend, PagesDone, PagesDrop, PagesFull, PagesPut, Partials};
use backburner_link::LinkError;

use crate::split::{why, WorkerClient};

/// The slowest attention a worker is assumed to compute (flop/s) when a reply's deadline is set: a tenth of one
/// slow core, so that only a stalled or dead worker misses it.
pub const MIN_ATTEND_FLOPS: f64 = 1e9;

/// What a worker did with a `PagesPut`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored; the worker's store now.
    Stored(PagesDone),
    /// Did not fit the worker's memory; nothing stored, the session goes on.
    Full(PagesFull),
}

impl WorkerClient {
    fn conn_or_lost(&mut self) -> Result<&mut backburner_link::Conn, LinkError> {
        self.link.conn.as_mut().ok_or_else(|| {
            LinkError::Refused("the worker's connection (and the pages it held) is gone".into())
        })
    }

    /// Sends `PagesPut` (pages `[first_pos, first_pos + n_pages · page_size)` of every full-attention layer, their
    /// storage in `bytes`) on the current connection and waits for the answer. Errors: transport errors,
    /// deadlines, the worker's typed `Error` (the session is then gone).
    pub fn pages_put(
        &mut self,
        first_pos: u64,
        n_pages: u32,
        bytes: &[u8],
    ) -> Result<PutOutcome, LinkError> {
        let d = self.allowance(bytes.len(), Duration::ZERO);
        let c = self.conn_or_lost()?;
        c.set_deadline(Some(d));
        if let Err(e) = c
            .writer
            .send(Kind::PagesPut, &PagesPut { first_pos, n_pages }, bytes)
        {
            return Err(why(c, e));
        }
        let f = c.reader.recv()?;
        let out = match f.kind() {
            Kind::PagesDone => PutOutcome::Stored(f.control()?),
            Kind::PagesFull => PutOutcome::Full(f.control()?),
            got => {
                return Err(LinkError::Unexpected {
                    expected: "PagesDone or PagesFull",
                    got,
                })
            }
        };
        self.succeeded();
        Ok(out)
    }

    /// Sends `PagesDrop { to_pos }` and waits for `PagesDone`. Errors: as [`WorkerClient::pages_put`].
    pub fn pages_drop(&mut self, to_pos: u64) -> Result<PagesDone, LinkError> {
        let d = self.allowance(0, Duration::ZERO);
        let c = self.conn_or_lost()?;
        c.set_deadline(Some(d));
        if let Err(e) = c.writer.send(Kind::PagesDrop, &PagesDrop { to_pos }, &[]) {
            return Err(why(c, e));
        }
        let (done, _) = c.reader.expect(Kind::PagesDone, "PagesDone")?;
        self.succeeded();
        Ok(done)
    }

    /// Sends an `Attend` with `q` (`[n_tokens, n_heads, head_dim]` f32) over `positions` held by the worker, to be
    /// answered with `reply_parts` partials; the answer is read by [`WorkerClient::attend_recv`] (the host computes meanwhile, and other workers get theirs).
    /// The deadline allows the transfers plus the attention at a pessimistic [`MIN_ATTEND_FLOPS`]. Errors: as
    /// [`WorkerClient::pages_put`].
    pub fn attend_send(
        &mut self,
        a: &Attend,
        q: &[f32],
        positions: usize,
        reply_parts: usize,
    ) -> Result<(), LinkError> {
        let bytes = f32_bytes(q);
        // q·k and p·v: 4 flops per query element and key position
        let flops = (q.len() as f64) * (positions as f64) * 4.0;
        let compute = Duration::from_secs_f64((flops / MIN_ATTEND_FLOPS).min(1e9));
        // the request, and a reply of `reply_parts` partials (each a little over q's size)
        let reply = bytes
            .len()
            .saturating_mul(2)
            .saturating_mul(reply_parts.max(1));
        let d = self.allowance(bytes.len().saturating_add(reply), compute);
        let c = self.conn_or_lost()?;
        c.set_deadline(Some(d));
        if let Err(e) = c.writer.send(Kind::Attend, a, &bytes) {
            return Err(why(c, e));
        }
        Ok(())
    }

    /// The partials answering the last [`WorkerClient::attend_send`], each `o` `[n_tokens, n_heads, head_dim]`
    /// and `lse` `[n_tokens, n_heads]`, in page order. Errors: transport errors and deadlines; `Malformed` for a
    /// reply whose size does not match or that holds NaN or infinite outputs (or a NaN or +∞ log-sum-exp).
    pub fn attend_recv(
        &mut self,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
    ) -> Result<Vec<Partial>, LinkError> {
        let c = self.conn_or_lost()?;
        let (p, t): (Partials, _) = c.reader.expect(Kind::Partials, "Partials")?;
        let parts = decode_partials(&p, &t, n_tokens, n_heads, head_dim)?;
        self.link.stats.offload_compute_us = self
            .link
            .stats
            .offload_compute_us
            .saturating_add(p.compute_us);
        self.succeeded();
        Ok(parts)
    }
}

/// Splits a `Partials` tensor section into checked partials.
fn decode_partials(
    p: &Partials,
    t: &[u8],
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
) -> Result<Vec<Partial>, LinkError> {
    let rows = n_tokens.checked_mul(n_heads);
    let per = rows
        .and_then(|r| r.checked_mul(head_dim + 1))
        .and_then(|v| v.checked_mul(4));
    let n = p.n_parts as usize;
    let (Some(rows), Some(per)) = (rows, per) else {
        return Err(LinkError::Malformed("partial shape overflows".into()));
    };
    if per.checked_mul(n) != Some(t.len()) {
        return Err(LinkError::Malformed(format!(
            "{} bytes of partials are not {n} partials of [{n_tokens}, {n_heads}, {head_dim}]",
            t.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for chunk in t.chunks_exact(per.max(1)) {
        let vals = bytes_f32(chunk)?;
        let (o, lse) = vals.split_at(rows * head_dim);
        if o.iter().any(|x| !x.is_finite()) || lse.iter().any(|x| x.is_nan() || *x == f32::INFINITY)
        {
            return Err(LinkError::Malformed(
                "a partial holds NaN or infinite values".into(),
            ));
        }
        let mut part = Partial::empty(n_tokens, n_heads, head_dim);
        part.o.copy_from_slice(o);
        part.lse.copy_from_slice(lse);
        out.push(part);
    }
    Ok(out)
}
