//! Exact checkpoints through a layer split: each worker keeps its layers' states at the positions the host names in
//! `RunLayers.keep` (the host keeps its own layers' in the session's checkpoints), and a `Rewind` returns every
//! worker there, so the prompt cache resumes a layer split as it does a local session, with the same bits.

use backburner_link::frame::Kind;
use backburner_link::message::{Rewind, RewindDone, MAX_KEEP};

use super::LayerSplit;

impl LayerSplit {
    /// Asks the workers to keep exact checkpoints at `positions` in the coming calls (replacing earlier requests).
    pub(crate) fn set_keep(&mut self, positions: &[usize]) {
        self.keep = positions.to_vec();
    }

    /// The positions of a ubatch at `pos..pos + t` where the workers should keep checkpoints (the newest
    /// [`MAX_KEEP`]).
    pub(crate) fn keep_in(&self, pos: usize, t: usize) -> Vec<u64> {
        keep_in(&self.keep, pos, t)
    }

    /// Returns every worker to position `to` from the checkpoint it kept there. True when all did (their states
    /// are then those of `to`); false when one had none, failed or is not connected at the host's position (the
    /// caller then rebuilds: see [`LayerSplit::reset`]).
    pub(crate) fn rewind(&mut self, from: usize, to: usize) -> bool {
        if !self.in_step(from) || self.stages.iter().any(|s| s.link.conn.is_none()) {
            return false;
        }
        for s in &mut self.stages {
            let d = s.link.allowance(0, std::time::Duration::ZERO);
            let c = s.link.conn.as_mut().expect("checked above");
            c.set_deadline(Some(d));
            let msg = Rewind { to_pos: to as u64 };
            let r = c
                .writer
                .send(Kind::Rewind, &msg, &[])
                .map_err(|e| crate::connection::why(c, e))
                .and_then(|_| {
                    c.reader
                        .expect::<RewindDone>(Kind::RewindDone, "RewindDone")
                });
            match r {
                Ok((d, _)) if d.restored && d.pos == to as u64 => s.pos = Some(to),
                _ => return false,
            }
        }
        self.stats.rewinds += 1;
        true
    }
}

/// The positions of `keep` inside a ubatch at `pos..pos + t` (`(pos, pos + t]`), increasing, the newest
/// [`MAX_KEEP`].
pub(crate) fn keep_in(keep: &[usize], pos: usize, t: usize) -> Vec<u64> {
    let mut k: Vec<u64> = keep
        .iter()
        .filter(|&&p| p > pos && p - pos <= t)
        .map(|&p| p as u64)
        .collect();
    k.sort_unstable();
    k.dedup();
    let drop = k.len().saturating_sub(MAX_KEEP);
    k.drain(..drop);
    k
}
