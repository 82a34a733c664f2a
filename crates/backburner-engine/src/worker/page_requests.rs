//! A session's KV-offload requests on the worker (`PagesPut`, `PagesDrop`, `Attend`; docs/PROTOCOL.md §5.11): the
//! checks of every size taken from the request, before the [`SessionPages`] store is touched or anything is
//! allocated.

use std::time::Instant;

use backburner_link::frame::{bytes_f32, f32_bytes};
use backburner_link::message::{Attend, PagesDone, PagesDrop, PagesFull, PagesPut, Partials};
use backburner_link::ErrorCode;
use backburner_model::{LayerKind, ModelConfig};

use super::budget::MemoryBudget;
use super::core::{Fault, Reply};
use super::pages::SessionPages;

fn fault(code: ErrorCode, m: impl Into<String>) -> Fault {
    Fault {
        code,
        message: m.into(),
    }
}

/// What the checks of a session's page requests need to know.
pub(super) struct PageLimits<'a> {
    pub cfg: &'a ModelConfig,
    /// The model's full-attention layers, in order (the layers of a `PagesPut`'s tensor section).
    pub attn_layers: &'a [usize],
    pub max_positions: usize,
    pub max_ubatch: usize,
    pub max_frame: usize,
}

fn done(store: &SessionPages, layer: usize) -> Reply {
    let (first, end) = store.span(layer);
    Reply::PagesDone(PagesDone {
        first_pos: first as u64,
        end_pos: end as u64,
        bytes: store.bytes(),
    })
}

/// `PagesPut`: the pages of every attention layer, or `PagesFull` (nothing stored, the session goes on) when they do
/// not fit the budget. Errors: `Malformed` for a size that does not match; `BadState` off the run's end or past the
/// session's positions.
pub(super) fn put(
    store: &mut SessionPages,
    lim: &PageLimits<'_>,
    budget: &MemoryBudget,
    p: PagesPut,
    bytes: &[u8],
) -> Result<Reply, Fault> {
    let ps = store.shape().page_size as u64;
    let n_pages = usize::try_from(p.n_pages).map_err(|_| fault(ErrorCode::Malformed, "n_pages"))?;
    let end = u64::from(p.n_pages)
        .checked_mul(ps)
        .and_then(|n| n.checked_add(p.first_pos));
    if end.is_none_or(|e| e > lim.max_positions as u64) {
        return Err(fault(
            ErrorCode::BadState,
            format!(
                "{} pages from position {} pass the session's {} positions",
                p.n_pages, p.first_pos, lim.max_positions
            ),
        ));
    }
    match store.put_layers(lim.attn_layers, p.first_pos, n_pages, bytes) {
        Ok(()) => Ok(done(store, lim.attn_layers.first().copied().unwrap_or(0))),
        Err(f) if f.code == ErrorCode::OutOfMemory => Ok(full(store, budget, bytes.len())),
        Err(f) => Err(f),
    }
}

/// The `PagesFull` answer to a put of `pages` bytes of pages into `store`: `needed` counts the pages and, while the
/// store holds none, the headroom it starts reserving with them (see [`attend_headroom`]), so that it always exceeds
/// `free`, the bytes the budget has free now (beside the request's own buffer when that could be reserved).
pub(super) fn full(store: &SessionPages, budget: &MemoryBudget, pages: usize) -> Reply {
    Reply::PagesFull(PagesFull {
        needed: (pages as u64).saturating_add(store.put_headroom()),
        free: budget.limit().saturating_sub(budget.used()),
    })
}

/// Bytes of one `Partials` of `n_tokens` queries (`[n_tokens, heads, head_dim + 1]` f32) and of their `q`
/// (`[n_tokens, heads, head_dim]` f32), or `None` on overflow.
pub(super) fn attend_sizes(cfg: &ModelConfig, n_tokens: usize) -> Option<(usize, usize)> {
    let rows = n_tokens.checked_mul(cfg.num_attention_heads)?;
    let reply = rows.checked_mul(cfg.head_dim + 1)?.checked_mul(4)?;
    let q = rows.checked_mul(cfg.head_dim)?.checked_mul(4)?;
    Some((reply, q))
}

/// Bytes allowed for an `Attend`'s control section in the standing headroom (it encodes in at most 32; a request
/// with a larger one reserves the excess as any request does).
pub(super) const ATTEND_CONTROL: usize = 64;

/// The standing reservation (bytes) of a session holding pages (see `SessionPages::with_headroom`): an `Attend` of
/// up to `ubatch` tokens answered with one partial, its reply reserved three times (the partial, its bytes, the
/// sealed frame) and its request twice (as any request's buffers). `u64::MAX` on overflow.
pub fn attend_headroom(cfg: &ModelConfig, ubatch: usize) -> u64 {
    attend_sizes(cfg, ubatch)
        .and_then(|(reply, q)| {
            reply
                .checked_mul(3)?
                .checked_add(q.checked_add(ATTEND_CONTROL)?.checked_mul(2)?)
        })
        .map_or(u64::MAX, |b| b as u64)
}

/// `PagesDrop`. Errors: `BadState` off a page boundary.
pub(super) fn drop_to(
    store: &mut SessionPages,
    lim: &PageLimits<'_>,
    d: PagesDrop,
) -> Result<Reply, Fault> {
    store.truncate(d.to_pos)?;
    Ok(done(store, lim.attn_layers.first().copied().unwrap_or(0)))
}

/// `Attend`: the partials of the queries over `layer`'s pages, with a reservation covering the reply until it is
/// sent. Errors: `Malformed` for a layer that is not a full-attention layer, a head count other than the model's,
/// a non-finite or non-positive scale, or a tensor of the wrong size; `BadState` for queries that are not wholly
/// past the pages held, too many tokens, or a reply over the frame bound; `OutOfMemory`.
pub(super) fn attend(
    store: &SessionPages,
    lim: &PageLimits<'_>,
    budget: &std::sync::Arc<MemoryBudget>,
    a: Attend,
    q: &[u8],
) -> Result<Reply, Fault> {
    let cfg = lim.cfg;
    let layer = usize::try_from(a.layer).unwrap_or(usize::MAX);
    if cfg.layer_types.get(layer) != Some(&LayerKind::FullAttention) {
        return Err(fault(
            ErrorCode::Malformed,
            format!(
                "layer {} is not a full-attention layer of this model",
                a.layer
            ),
        ));
    }
    let (t, h) = (a.n_tokens as usize, a.n_heads as usize);
    if h != cfg.num_attention_heads || !(a.scale.is_finite() && a.scale > 0.0) {
        return Err(fault(
            ErrorCode::Malformed,
            format!(
                "Attend with {h} heads (the model has {}) and scale {}",
                cfg.num_attention_heads, a.scale
            ),
        ));
    }
    let (_, end) = store.span(layer);
    let last = a.q_pos0.checked_add(u64::from(a.n_tokens));
    if t == 0
        || t > lim.max_ubatch
        || a.q_pos0 < end as u64
        || last.is_none_or(|l| l > lim.max_positions as u64)
    {
        return Err(fault(
            ErrorCode::BadState,
            format!(
                "Attend of {t} tokens at {} over pages ending at {end} (ubatch ≤ {}, ≤ {} positions)",
                a.q_pos0, lim.max_ubatch, lim.max_positions
            ),
        ));
    }
    let q_len = t.checked_mul(h).and_then(|v| v.checked_mul(cfg.head_dim));
    if q_len.and_then(|v| v.checked_mul(4)) != Some(q.len()) {
        return Err(fault(
            ErrorCode::Malformed,
            format!(
                "Attend tensor of {} bytes is not [{t}, {h}, {}] f32",
                q.len(),
                cfg.head_dim
            ),
        ));
    }
    let parts = if a.per_page {
        store.layer_pages(layer).max(1)
    } else {
        1
    };
    let reply_len = t
        .checked_mul(h)
        .and_then(|v| v.checked_mul(cfg.head_dim + 1))
        .and_then(|v| v.checked_mul(4))
        .and_then(|v| v.checked_mul(parts))
        .filter(|l| *l <= lim.max_frame)
        .ok_or_else(|| {
            fault(
                ErrorCode::BadState,
                format!("the partials of {t} tokens over {parts} pages exceed the frame bound of {} bytes", lim.max_frame),
            )
        })?;
    // the partials, their bytes and the sealed frame: one partial's worth is the store's standing headroom, more
    // (one per page) is reserved now, without evicting other sessions
    let covered = attend_sizes(cfg, lim.max_ubatch).map_or(0, |(r, _)| r as u64 * 3);
    let covered = if store.headroom() > 0 { covered } else { 0 };
    let extra = (reply_len as u64).saturating_mul(3).saturating_sub(covered);
    let hold = budget.reserve(extra, "attention partials")?;
    let q = bytes_f32(q).map_err(|e| fault(ErrorCode::Malformed, e.to_string()))?;
    let pos0 = usize::try_from(a.q_pos0).map_err(|_| fault(ErrorCode::Malformed, "q_pos0"))?;
    let t0 = Instant::now();
    let parts = if a.per_page {
        store.attend_each(layer, &q, t, h, pos0, a.scale)?
    } else {
        vec![store.attend(layer, &q, t, h, pos0, a.scale)?]
    };
    let compute_us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
    let mut out = Vec::with_capacity(reply_len);
    for p in &parts {
        out.extend_from_slice(&f32_bytes(&p.o));
        out.extend_from_slice(&f32_bytes(&p.lse));
    }
    Ok(Reply::Partials(
        Partials {
            n_parts: u32::try_from(parts.len()).unwrap_or(u32::MAX),
            compute_us,
        },
        out,
        hold,
    ))
}
