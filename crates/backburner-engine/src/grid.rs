//! Where each position's arithmetic is decided: the prefill grid that makes a prefill resumed from a cached state
//! compute the same bits as one that never stopped.
//!
//! Every op of a layer but one is per row or per position and gives the same bits whatever rows share its call (the
//! products, norms, conv, RoPE, the paged attention's fixed fold: see their modules). The one exception is the Gated
//! DeltaNet's chunked delta rule: its arithmetic depends on where its chunks of [`GDN_CHUNK`] start, which is the
//! first position of each forward call; and a call of one token runs the recurrence (the decode step) instead. So a
//! session runs every prefill in ubatches that end at **absolute** multiples of the ubatch size (not counted from
//! where the call started), and:
//!
//! * a prefill from position 0 puts its chunk boundaries at the **grid points**: positions whose offset in their
//!   ubatch is a multiple of [`GDN_CHUNK`] ([`Grid::is_point`]);
//! * cutting a call at one of its chunk boundaries gives the same bits as not cutting it (the chunks are the same;
//!   tested on every weight format), as long as no piece is a single token that was not one before;
//! * so a prefill resumed from the exact state at a grid point `c` (a checkpoint taken there by a prefill, never by
//!   decode steps) computes, for every later position, the bits of a prefill from 0 ([`Grid::resumes`]).
//!
//! Decode steps are one-token calls (the recurrence): a state reached through them is exact for continuing with
//! decode steps, but never a resume point for a prefill.

use std::ops::Range;

use backburner_model::GDN_CHUNK;

/// The prefill grid of a session with ubatches of `ubatch` tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grid {
    ubatch: usize,
}

impl Grid {
    /// The grid of ubatches of `ubatch` tokens. Panics if `ubatch` is 0 (sessions refuse it).
    pub fn new(ubatch: usize) -> Self {
        assert!(ubatch > 0, "a ubatch holds at least one token");
        Grid { ubatch }
    }

    /// Tokens per ubatch.
    pub fn ubatch(&self) -> usize {
        self.ubatch
    }

    /// The forward calls of a prefill of `n` tokens at positions `pos..pos + n`: consecutive ranges of absolute
    /// positions, each ending at the next multiple of the ubatch size or at `pos + n`.
    pub fn ubatches(&self, pos: usize, n: usize) -> Vec<Range<usize>> {
        let end = pos.saturating_add(n);
        let mut out = Vec::with_capacity(n.div_ceil(self.ubatch) + 1);
        let mut a = pos;
        while a < end {
            let b = (a - a % self.ubatch).saturating_add(self.ubatch).min(end);
            out.push(a..b);
            a = b;
        }
        out
    }

    /// Whether `p` is a grid point: a chunk boundary of a prefill from position 0 (its offset in its ubatch is a
    /// multiple of [`GDN_CHUNK`]).
    pub fn is_point(&self, p: usize) -> bool {
        (p % self.ubatch).is_multiple_of(GDN_CHUNK)
    }

    /// The largest grid point ≤ `p`.
    pub fn floor(&self, p: usize) -> usize {
        let off = p % self.ubatch;
        p - off % GDN_CHUNK
    }

    /// Whether a prefill of positions `[c, n)` from the exact state at grid point `c` gives the bits of a prefill of
    /// `[0, n)`: `c` is a grid point before `n`, and the first call of the resumed prefill is not a single token
    /// unless the whole run's call there is one too (it starts a ubatch).
    pub fn resumes(&self, c: usize, n: usize) -> bool {
        if !self.is_point(c) || c >= n {
            return false;
        }
        let first_end = (c - c % self.ubatch).saturating_add(self.ubatch).min(n);
        c.is_multiple_of(self.ubatch) || first_end - c >= 2
    }

    /// The positions in `(from, to]` where a prefill over them should keep exact checkpoints for the cache: every
    /// ubatch end, the last grid point before `to` from which a longer prompt can resume, and the last grid point at
    /// or before each of `marks` (e.g. the end of a conversation's stable prefix).
    pub fn checkpoints(&self, from: usize, to: usize, marks: &[usize]) -> Vec<usize> {
        let mut out: Vec<usize> = self
            .ubatches(from, to.saturating_sub(from))
            .iter()
            .map(|r| r.end)
            .filter(|&e| e % self.ubatch == 0)
            .collect();
        out.push(self.floor(to));
        out.extend(marks.iter().map(|&m| self.floor(m.min(to))));
        out.retain(|&p| p > from && p <= to && self.is_point(p));
        out.sort_unstable();
        out.dedup();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ubatches_end_at_absolute_multiples() {
        let g = Grid::new(512);
        assert_eq!(g.ubatches(0, 1100), [0..512, 512..1024, 1024..1100]);
        assert_eq!(g.ubatches(300, 800), [300..512, 512..1024, 1024..1100]);
        assert_eq!(g.ubatches(512, 1), vec![512..513]);
        assert!(g.ubatches(7, 0).is_empty());
        assert_eq!(Grid::new(1).ubatches(3, 2), [3..4, 4..5]);
    }

    #[test]
    fn grid_points_are_chunk_boundaries_of_a_prefill_from_zero() {
        let g = Grid::new(200); // chunks at 0, 64, 128, 192 | 200, 264, 328, 392 | 400, ...
        let pts: Vec<usize> = (0..420).filter(|&p| g.is_point(p)).collect();
        assert_eq!(pts, [0, 64, 128, 192, 200, 264, 328, 392, 400]);
        assert_eq!(g.floor(199), 192);
        assert_eq!(g.floor(263), 200);
        assert_eq!(g.floor(264), 264);
        let small = Grid::new(32);
        assert_eq!(small.floor(95), 64);
        assert!(small.is_point(96) && !small.is_point(64 + 16));
    }

    #[test]
    fn resuming_needs_a_grid_point_and_no_new_single_token_call() {
        let g = Grid::new(512);
        assert!(g.resumes(0, 1) && g.resumes(512, 513) && g.resumes(64, 66));
        // a lone token at 64 would run the recurrence where the whole run has it in a chunk
        assert!(!g.resumes(64, 65));
        assert!(!g.resumes(65, 200) && !g.resumes(64, 64));
        // a ubatch of 65: the grid point 64 leaves a one-token rest of its ubatch
        let odd = Grid::new(65);
        assert!(odd.is_point(64) && !odd.resumes(64, 1000) && odd.resumes(65, 1000));
    }

    #[test]
    fn checkpoints_are_ubatch_ends_the_last_point_and_the_marks() {
        let g = Grid::new(256);
        assert_eq!(g.checkpoints(0, 700, &[300]), [256, 512, 640]);
        assert_eq!(g.checkpoints(0, 700, &[330]), [256, 320, 512, 640]);
        assert_eq!(g.checkpoints(100, 200, &[150]), [128, 192]);
        assert_eq!(g.checkpoints(192, 200, &[]), Vec::<usize>::new());
    }
}
