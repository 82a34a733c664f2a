//! Reusable activation buffers of the forward pass (f32), grown to the largest ubatch seen and then reused (no
//! allocation per op), the checkpoints requested of a call, and what an open speculative verify keeps for its
//! rollback (`verify.rs`). None of it is part of the state: it is never snapshotted, copied or transferred.

use super::capture::Capture;
use super::verify::VerifyKeep;

/// Row-wise buffers of a layer: the norms, the projections and the MLP on `[rows, ·]` activations (`rows` = the
/// ubatch's tokens, or one token per sequence in a batched decode step).
#[derive(Debug, Default)]
pub(crate) struct RowBufs {
    /// Normed layer input `[T, H]`.
    pub(super) h: Vec<f32>,
    /// A fused projection's output `[T, width]`.
    pub(super) proj: Vec<f32>,
    /// The mixer's or the MLP's output `[T, H]`.
    pub(super) out: Vec<f32>,
    /// `[gate | up]` `[T, 2I]`.
    pub(super) gu: Vec<f32>,
    /// `silu(gate) ⊙ up` `[T, I]`.
    pub(super) act: Vec<f32>,
    /// The sequences' mixer core outputs stacked `[N, heads·dim]` (batched decode only).
    pub(super) o: Vec<f32>,
    /// The residual stream `[N, H]` (batched decode only).
    pub(super) x: Vec<f32>,
    /// A mixture-of-experts block's buffers.
    pub(super) moe: MoeBufs,
}

/// Buffers of a mixture-of-experts block on `[T, ·]` rows.
#[derive(Debug, Default)]
pub(crate) struct MoeBufs {
    /// Router logits `[T, E]`.
    pub(super) logits: Vec<f32>,
    /// The shared expert's gate logits `[T, 1]`.
    pub(super) gate: Vec<f32>,
    /// The rows routed to one expert, gathered `[n_e, H]`.
    pub(super) x: Vec<f32>,
    /// Its `[gate | up]` `[n_e, 2·I_e]`.
    pub(super) gu: Vec<f32>,
    /// Its `silu(gate) ⊙ up` `[n_e, I_e]`.
    pub(super) act: Vec<f32>,
    /// Its output `[n_e, H]`.
    pub(super) y: Vec<f32>,
    /// The routed experts' weighted sum `[T, H]`.
    pub(super) acc: Vec<f32>,
    /// With experts held elsewhere: the weighted outputs computed here, one per (token, expert) `[pairs, H]`.
    pub(super) pairs: Vec<f32>,
}

/// One sequence's buffers of a mixer's core (the per-sequence part between the input and output projections).
#[derive(Debug, Default)]
pub(crate) struct MixerBufs {
    /// GDN conv input / attention queries.
    pub(super) a: Vec<f32>,
    /// GDN conv output / attention gate.
    pub(super) b: Vec<f32>,
    /// q, k, v, z heads.
    pub(super) q: Vec<f32>,
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    pub(super) z: Vec<f32>,
    /// GDN β and log-decay g `[T, Hv]`.
    pub(super) beta: Vec<f32>,
    pub(super) g: Vec<f32>,
    /// Mixer core output `[T, heads·dim]`.
    pub(super) o: Vec<f32>,
}

/// Reusable activation buffers of the forward pass (f32), grown to the largest ubatch seen. Held per sequence in its
/// [`ModelState`](crate::ModelState); not part of the state (never snapshotted, copied or transferred: a copy of a
/// state does not carry its open verify).
///
/// In a batched decode step ([`Model::forward_decode_batch`](crate::Model::forward_decode_batch)) each sequence's
/// mixer core runs in its own buffers, and the first sequence's row buffers serve the whole batch.
#[derive(Debug, Default)]
pub struct Scratch {
    pub(super) rows: RowBufs,
    pub(super) mix: MixerBufs,
    /// The exact checkpoints requested of the coming calls and those taken ([`crate::ModelState::request_checkpoints`]).
    pub(crate) capture: Capture,
    /// What the open speculative verify keeps for a rollback (`verify.rs`); not counted by [`Scratch::bytes`]
    /// (see [`crate::ModelState::verify_bytes`]).
    pub(super) verify: VerifyKeep,
}

impl Scratch {
    /// Forgets the open speculative verify, if any (its buffers stay for the next one): the state changed outside
    /// it, so a rollback would be wrong.
    pub(crate) fn close_verify(&mut self) {
        self.verify.close();
    }

    /// Bytes held by the buffers.
    pub fn bytes(&self) -> usize {
        let (r, m, e) = (&self.rows, &self.mix, &self.rows.moe);
        4 * [
            &r.h, &r.proj, &r.out, &r.gu, &r.act, &r.o, &r.x, &m.a, &m.b, &m.q, &m.k, &m.v, &m.z,
            &m.beta, &m.g, &m.o, &e.logits, &e.gate, &e.x, &e.gu, &e.act, &e.y, &e.acc,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
    }
}

/// `v` as a slice of `n` elements (grown with zeros if shorter; capacity kept).
pub(super) fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

/// Copies column block `[c0, c0 + width)` of the `[n_rows, n_cols]` matrix `x` into `out` (`[n_rows, width]`).
pub(super) fn take_cols_into(
    x: &[f32],
    n_cols: usize,
    c0: usize,
    width: usize,
    out: &mut Vec<f32>,
) {
    let n_rows = x.len() / n_cols;
    let dst = sized(out, n_rows * width);
    for (d, row) in dst
        .chunks_exact_mut(width.max(1))
        .zip(x.chunks_exact(n_cols))
    {
        d.copy_from_slice(&row[c0..c0 + width]);
    }
}
