//! Where a session's offloaded pages live: contiguous runs in position order, each on one worker.

/// Positions `[start, end)` of every full-attention layer held by worker `worker` (an index into the session's
/// workers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// The worker holding the run.
    pub worker: usize,
    /// First position.
    pub start: usize,
    /// One past the last position.
    pub end: usize,
}

/// The runs of a session, covering `[0, offloaded)` in order without gaps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    runs: Vec<Run>,
}

impl Placement {
    /// The runs in position order.
    pub fn runs(&self) -> &[Run] {
        &self.runs
    }

    /// Positions held by workers (`[0, end)`).
    pub fn end(&self) -> usize {
        self.runs.last().map_or(0, |r| r.end)
    }

    /// The worker of the newest run, which takes the next pages while it has room.
    pub fn open_worker(&self) -> Option<usize> {
        self.runs.last().map(|r| r.worker)
    }

    /// Whether `worker` holds any run.
    pub fn uses(&self, worker: usize) -> bool {
        self.runs.iter().any(|r| r.worker == worker)
    }

    /// Records that `worker` took positions `[end(), end() + n)`: the newest run grows if it is `worker`'s, else a
    /// new run starts.
    pub fn push(&mut self, worker: usize, n: usize) {
        let start = self.end();
        match self.runs.last_mut() {
            Some(r) if r.worker == worker => r.end += n,
            _ => self.runs.push(Run {
                worker,
                start,
                end: start + n,
            }),
        }
    }

    /// Keeps positions `[0, end)`: runs past it are cut or dropped.
    pub fn truncate(&mut self, end: usize) {
        self.runs.retain(|r| r.start < end);
        if let Some(r) = self.runs.last_mut() {
            r.end = r.end.min(end);
        }
    }

    /// Forgets every run (the pages were dropped or lost).
    pub fn clear(&mut self) {
        self.runs.clear();
    }
}
