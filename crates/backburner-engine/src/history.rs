//! A session's token history with how each position was computed — prefill calls on the grid, or one-token steps —
//! so that a state lost with a worker (or dropped for a rewind a worker cannot follow) is rebuilt with the same bits:
//! the rebuild replays the same calls ([`History::calls`]) rather than prefilling every token at once.

use std::ops::Range;

use crate::grid::Grid;

/// A run of positions computed one way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Segment {
    /// Prefill calls on the grid: ubatches ending at absolute multiples of the ubatch size, the first call starting
    /// at the segment's start (its chunks counted from there).
    Prefill(Range<usize>),
    /// One-token calls (decode steps), one per position.
    Steps(Range<usize>),
}

/// The tokens of a session and the segments that computed them (covering `0..tokens.len()` in order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct History {
    tokens: Vec<u32>,
    segments: Vec<Segment>,
}

impl History {
    /// The token ids, `[n]`.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Tokens held.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether no token is held.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The segments, in position order.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Appends one forward call of `ids` at the end (a whole call of the session's prefill or a decode step), on
    /// `grid`. A call of one token is a step; a longer one extends the last prefill segment when it starts at one of
    /// that segment's chunk boundaries on the grid (replaying both as one call there gives the same bits), and
    /// starts a new segment otherwise.
    pub fn push_call(&mut self, ids: &[u32], grid: Grid) {
        let (pos, t) = (self.tokens.len(), ids.len());
        if t == 0 {
            return;
        }
        self.tokens.extend_from_slice(ids);
        let end = pos + t;
        match self.segments.last_mut() {
            Some(Segment::Steps(r)) if t == 1 => r.end = end,
            Some(Segment::Prefill(r)) if t > 1 && joins(r.start, pos, grid) => r.end = end,
            _ if t == 1 => self.segments.push(Segment::Steps(pos..end)),
            _ => self.segments.push(Segment::Prefill(pos..end)),
        }
    }

    /// Keeps the first `n` tokens (and their segments, cut at `n`).
    pub fn truncate(&mut self, n: usize) {
        if n >= self.tokens.len() {
            return;
        }
        self.tokens.truncate(n);
        self.segments.retain(|s| span(s).start < n);
        if let Some(s) = self.segments.last_mut() {
            let r = span_mut(s);
            r.end = r.end.min(n);
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.segments.clear();
    }

    /// Takes the tokens and segments out, leaving the history empty.
    pub fn take(&mut self) -> History {
        std::mem::take(self)
    }

    /// The forward calls that compute the history again with the same bits, on `grid` (absolute position ranges in
    /// order): each prefill segment's ubatches, each step alone.
    pub fn calls(&self, grid: Grid) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        for s in &self.segments {
            match s {
                Segment::Prefill(r) => out.extend(grid.ubatches(r.start, r.len())),
                Segment::Steps(r) => out.extend(r.clone().map(|p| p..p + 1)),
            }
        }
        out
    }

    /// Whether positions `[0, n)` were computed as one prefill from position 0 on the grid computes them (they lie in
    /// the first segment, a prefill from 0), so that a grid point `n` may hold an exact resume point.
    pub fn exact_to(&self, n: usize) -> bool {
        n == 0
            || matches!(self.segments.first(), Some(Segment::Prefill(r)) if r.start == 0 && r.end >= n)
    }
}

/// Whether a prefill call at `pos` continues the prefill segment that started at `start` with the same bits as one
/// call: `pos` starts a ubatch, or lies a whole number of chunks into the call that replaying the segment would run
/// there.
fn joins(start: usize, pos: usize, grid: Grid) -> bool {
    let u = grid.ubatch();
    if pos.is_multiple_of(u) {
        return true;
    }
    let call_start = start.max(pos - pos % u);
    (pos - call_start).is_multiple_of(backburner_model::GDN_CHUNK)
}

fn span(s: &Segment) -> &Range<usize> {
    match s {
        Segment::Prefill(r) | Segment::Steps(r) => r,
    }
}

fn span_mut(s: &mut Segment) -> &mut Range<usize> {
    match s {
        Segment::Prefill(r) | Segment::Steps(r) => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(n: usize) -> Vec<u32> {
        (0..n as u32).collect()
    }

    #[test]
    fn calls_on_the_grid_join_one_segment_and_steps_another() {
        let g = Grid::new(256);
        let mut h = History::default();
        h.push_call(&ids(256), g);
        h.push_call(&ids(44), g); // 256..300
        h.push_call(&ids(1), g);
        h.push_call(&ids(1), g); // steps 300..302
        assert_eq!(
            h.segments(),
            [Segment::Prefill(0..300), Segment::Steps(300..302)]
        );
        assert_eq!(h.calls(g), [0..256, 256..300, 300..301, 301..302]);
        assert!(h.exact_to(300) && !h.exact_to(301));
        // a prefill after steps starts its own segment; one cut at a chunk boundary of its call joins it
        h.push_call(&ids(64), g); // 302..366
        h.push_call(&ids(10), g); // 366..376: 64 rows into the call from 302
        h.push_call(&ids(10), g); // 376..386: not a chunk boundary
        assert_eq!(
            h.segments()[2..],
            [Segment::Prefill(302..376), Segment::Prefill(376..386)]
        );
        assert_eq!(h.calls(g)[4..], [302..376, 376..386]);
    }

    #[test]
    fn truncation_cuts_segments() {
        let g = Grid::new(64);
        let mut h = History::default();
        h.push_call(&ids(100), g);
        h.push_call(&ids(1), g);
        h.push_call(&ids(1), g);
        h.truncate(101);
        assert_eq!(
            h.segments(),
            [Segment::Prefill(0..100), Segment::Steps(100..101)]
        );
        h.truncate(70);
        assert_eq!(h.segments(), [Segment::Prefill(0..70)]);
        assert_eq!(h.len(), 70);
        assert_eq!(h.calls(g), [0..64, 64..70]);
        h.truncate(0);
        assert!(h.is_empty() && h.segments().is_empty());
    }
}
