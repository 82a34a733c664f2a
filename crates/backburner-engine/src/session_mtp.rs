//! The MTP block's state beside a session (speculative decoding with the checkpoint's own draft head,
//! docs/MTP.md): every position the session computes locally (prefill, decode steps, the kept part of a verify)
//! feeds the block the pair (final-normed hidden row of a position, token that follows it), so that drafting starts
//! from the last pair.
//!
//! The block only proposes drafts; what is kept is decided by the main model's verify, so a block that is behind
//! changes the speed, never the output. A jump of the session (a rewind, a prompt-cache restore) loses the hidden
//! row of the new last position: the pair there is fed a zero hidden row (as llama.cpp feeds its first row). A layer
//! split and KV offload feed the block as a local session does (the host holds the final norm: every row comes back
//! to it; an offloading prefill then runs its ubatches whole, not as interleaved halves). A longer gap (positions
//! whose hidden rows never reach the host: a split prefill's worker) leaves the block without a state until
//! [`Session::clear`]: it drafts nothing then.

use backburner_model::{KvOptions, MtpState};

use crate::error::{EngineError, Result};
use crate::session::Session;

/// The block's state and the hidden row that waits for its next token.
#[derive(Debug)]
pub(crate) struct MtpRun {
    st: MtpState,
    /// Final-normed hidden row `[H]` of the session's last position, waiting for the token that follows it.
    waiting: Option<Vec<f32>>,
    /// Out of step with the session (a gap it cannot fill): no drafts until the session is cleared.
    lost: bool,
    kv: KvOptions,
}

impl Session {
    /// Drafts with the model's MTP block from now on ([`crate::spec::SpecSource::Mtp`]); the session must be empty
    /// (the block learns every position from the first).
    ///
    /// Errors: [`EngineError::InvalidSetting`] when the model holds no MTP block (the checkpoint has none, or it was
    /// loaded without it) or the session already holds tokens.
    pub fn enable_mtp(&mut self) -> Result<()> {
        if self.model.mtp().is_none() {
            return Err(EngineError::InvalidSetting(
                "this model holds no MTP block (the checkpoint has none, or it was loaded without it)".into(),
            ));
        }
        if !self.history.is_empty() {
            return Err(EngineError::InvalidSetting(
                "the MTP block must see a session from its first token".into(),
            ));
        }
        let kv = self.opts.kv;
        self.mtp = Some(MtpRun {
            st: MtpState::new(self.model.config(), kv),
            waiting: None,
            lost: false,
            kv,
        });
        Ok(())
    }

    /// Whether the MTP block drafts for this session ([`Session::enable_mtp`]).
    pub fn mtp_enabled(&self) -> bool {
        self.mtp.is_some()
    }

    /// Feeds the block `ids` just computed at positions `p0..p0 + t` with their final-normed hidden rows `[t, H]`.
    pub(crate) fn mtp_feed(&mut self, p0: usize, ids: &[u32], hidden: &[f32]) {
        let h = self.model.config().hidden_size;
        let Some(run) = self.mtp.as_mut() else {
            return;
        };
        if run.lost || ids.is_empty() {
            return;
        }
        let have = run.st.n_positions();
        // rows: the pair at p0 − 1 (when missing), then the pairs inside the call
        let mut rows: Vec<f32> = Vec::with_capacity(ids.len() * h);
        let mut next: Vec<u32> = Vec::with_capacity(ids.len());
        if p0 > 0 && have + 1 == p0 {
            match run.waiting.take() {
                Some(w) => rows.extend_from_slice(&w),
                None => rows.resize(h, 0.0),
            }
            next.push(ids[0]);
        } else if have != p0 {
            run.lost = true;
            return;
        }
        rows.extend_from_slice(&hidden[..(ids.len() - 1) * h]);
        next.extend_from_slice(&ids[1..]);
        run.waiting = Some(hidden[(ids.len() - 1) * h..].to_vec());
        if !next.is_empty() {
            let (model, st) = (&self.model, &mut run.st);
            if self
                .opts
                .pool
                .install(|| model.mtp_ingest(st, &rows, &next))
                .is_err()
            {
                run.lost = true;
            }
        }
    }

    /// Up to `k` drafts from the block for the tokens after `pending` (the token the next verify decodes first, at
    /// the session's next position), greedy; none when the block is off or lost its step. The block's own state
    /// moves to the pair of the last position (drafting again gives the same tokens).
    pub fn mtp_draft(&mut self, pending: u32, k: usize) -> Vec<u32> {
        let n = self.history.len();
        let h = self.model.config().hidden_size;
        let Some(run) = self.mtp.as_mut() else {
            return Vec::new();
        };
        if run.lost || k == 0 || n == 0 {
            return Vec::new();
        }
        let (model, pool) = (&self.model, &self.opts.pool);
        // the pair at n − 1: (its hidden row, the pending token)
        if run.st.n_positions() + 1 == n {
            let row = run.waiting.take().unwrap_or_else(|| vec![0.0; h]);
            let st = &mut run.st;
            if pool
                .install(|| model.mtp_ingest(st, &row, &[pending]))
                .is_err()
            {
                run.lost = true;
                return Vec::new();
            }
        }
        if run.st.n_positions() != n || !run.st.has_frontier() {
            return Vec::new();
        }
        let st = &mut run.st;
        pool.install(|| model.mtp_draft(st, k)).unwrap_or_default()
    }

    /// The session jumped to its current length without computing the positions here (a rewind, a restore): the
    /// block keeps the pairs before the last position, whose hidden row is gone.
    pub(crate) fn mtp_jump(&mut self) {
        let n = self.history.len();
        if let Some(run) = self.mtp.as_mut() {
            run.st.truncate(n.saturating_sub(1));
            run.waiting = None;
        }
    }

    /// Starts the block over (the session was cleared).
    pub(crate) fn mtp_clear(&mut self) {
        if let Some(run) = self.mtp.as_mut() {
            run.st = MtpState::new(self.model.config(), run.kv);
            run.waiting = None;
            run.lost = false;
        }
    }
}
