//! The scheduler's speculative turn: every job that speculates runs its verify step on its own slot
//! ([`crate::Sequence::speculate`]), before the other jobs' batched decode step.

use std::time::Instant;

use super::metrics::Metrics;
use super::scheduler::{emit, fail, Active};
use super::Slot;
use crate::sequence::Phase;

/// The speculative step of every job that speculates and has drafts this turn, one job at a time (a verify step
/// of several positions is not batched across slots); returns, per job, whether it ran one (it then sits out the
/// batched decode step of this turn).
pub(super) fn verify_all(slots: &mut [Slot], active: &mut [Active<'_>], m: &Metrics) -> Vec<bool> {
    let mut ran = vec![false; active.len()];
    for (i, a) in active.iter_mut().enumerate() {
        if a.seq.phase() != Phase::Decode || a.wait.is_some() || !a.seq.speculates() {
            continue;
        }
        let before = a.seq.spec_counts().unwrap_or_default();
        let cancelled = a.cancelled();
        let t0 = Instant::now();
        let Some(r) = a.seq.speculate(slots[a.slot].session_mut(), cancelled) else {
            continue;
        };
        ran[i] = true;
        Metrics::add(&m.decode_us, t0.elapsed().as_micros() as u64);
        let after = a.seq.spec_counts().unwrap_or_default();
        Metrics::add(&m.decode_steps, 1);
        Metrics::add(&m.spec_steps, after.steps - before.steps);
        Metrics::add(&m.spec_drafted, after.drafted - before.drafted);
        Metrics::add(&m.spec_accepted, after.accepted - before.accepted);
        match r {
            Ok(steps) => {
                // the pending token and the accepted drafts were decoded
                Metrics::add(&m.decode_rows, 1 + after.accepted - before.accepted);
                for s in steps {
                    emit(a, s, m);
                }
            }
            Err(e) => fail(a, e),
        }
    }
    ran
}
