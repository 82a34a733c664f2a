//! A slot: one session the server keeps between requests, with its prompt cache, and the routing of a request to
//! the slot holding its longest reusable prefix.

use backburner_model::StateSnapshot;

use crate::serve::cache::{CacheLimits, Checkpoints};
use crate::session::Session;

/// One server slot: a session (its tokens, KV pages and recurrent state stay after a request) and its checkpoints.
#[derive(Debug)]
pub struct Slot {
    session: Session,
    checkpoints: Checkpoints,
    /// The scheduler's turn when the slot last took a request (least recently used goes first on ties).
    pub(crate) last_used: u64,
}

/// What a slot kept of a request's prompt ([`Slot::prepare`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reuse {
    /// Prompt tokens the session holds: the request ingests the rest.
    pub kept: usize,
    /// Of those, the tokens whose state is there (`kept`, unless the rewind had to drop the state: the next prefill
    /// then re-ingests the kept tokens first, a layer split whose workers lost their checkpoints, or KV offload
    /// going back below the pages on workers).
    pub cached: usize,
}

/// Length of the common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Slot {
    /// A slot around `session` (usually empty), keeping checkpoints within `limits`.
    pub fn new(session: Session, limits: CacheLimits) -> Self {
        Slot {
            session,
            checkpoints: Checkpoints::new(limits),
            last_used: 0,
        }
    }

    /// The session.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The session, to run steps on.
    pub fn session_mut(&mut self) -> &mut Session {
        &mut self.session
    }

    /// The checkpoints.
    pub fn checkpoints(&self) -> &Checkpoints {
        &self.checkpoints
    }

    /// Tokens of `prompt` (`[n]` ids) this slot can skip with the bits of a cold run: the largest exact resume point
    /// inside the prefix it shares with the history from which a prefill of the rest computes what a prefill of the
    /// whole prompt computes ([`crate::Grid::resumes`]) — a checkpoint the session can go back to in place
    /// ([`Session::rewinds_in_place`]: one that needs a re-ingest saves nothing), or the history's end when that is
    /// one (a grid point reached by prefill alone). At most `n − 1`: the last prompt token always runs.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        let s = &self.session;
        let (grid, n) = (s.grid(), prompt.len());
        let lcp = common_prefix(s.tokens(), prompt);
        let end = s.tokens().len();
        let end_exact = grid.is_point(end) && s.history().exact_to(end);
        let ok = |c: usize| c <= lcp && grid.resumes(c, n) && s.rewinds_in_place(c);
        if end > 0 && end_exact && ok(end) {
            return end;
        }
        self.checkpoints
            .positions()
            .into_iter()
            .rev()
            .find(|&c| ok(c))
            .unwrap_or(0)
    }

    /// Makes the session hold exactly the prefix of `prompt` that [`Slot::reusable`] gives (rewinding to a
    /// checkpoint, or clearing): the caller ingests `prompt[kept..]`.
    pub fn prepare(&mut self, prompt: &[u32]) -> Reuse {
        let reuse = self.reusable(prompt);
        if reuse > 0 && reuse == self.session.tokens().len() {
            return Reuse {
                kept: reuse,
                cached: reuse,
            };
        }
        match self.checkpoints.at(reuse) {
            Some(c) if reuse > 0 => {
                let in_place = self.session.rewind(c);
                self.checkpoints.truncate(reuse);
                Reuse {
                    kept: reuse,
                    cached: if in_place { reuse } else { 0 },
                }
            }
            _ => {
                self.clear();
                Reuse { kept: 0, cached: 0 }
            }
        }
    }

    /// Whether the session's whole state is on this host and can be copied into another slot or rewound in place
    /// ([`Slot::fork_from`]): no layer split, no KV page on a worker, no pending rebuild.
    pub(crate) fn forkable(&self) -> bool {
        let s = &self.session;
        s.chain.is_none()
            && !s.rebuild
            && s.state.offloaded() == 0
            && s.state.remote_error().is_none()
    }

    /// Makes this slot hold `src`'s history up to `snap` (a snapshot of `src`'s at a position of its history), with
    /// the same bits: KV pages and linear states copied, then rewound to `snap`; `src`'s checkpoints up to there
    /// come along. When `src` is this slot, it rewinds in place. False (the slot then cleared) when `src` is not
    /// [`Slot::forkable`] or the sessions differ (model, layers, KV settings, a layer split here).
    pub(crate) fn fork_from(&mut self, src: Option<&Slot>, snap: &StateSnapshot) -> bool {
        let n = snap.n_tokens();
        let Some(src) = src else {
            let ok = self.session.rewind(snap);
            self.checkpoints.truncate(n);
            return ok;
        };
        self.clear();
        let same = std::sync::Arc::ptr_eq(src.session.model(), self.session.model())
            && self.session.chain.is_none()
            && src.forkable();
        if !same || !self.session.state.copy_from(&src.session.state) {
            self.clear();
            return false;
        }
        self.session.history = src.session.history.clone();
        for c in src.checkpoints.positions().into_iter().filter(|&p| p <= n) {
            if let Some(c) = src.checkpoints.at(c) {
                self.checkpoints.push(c.clone());
            }
        }
        self.session.rewind(snap)
    }

    /// Forgets the history and the checkpoints.
    pub fn clear(&mut self) {
        self.session.clear();
        self.checkpoints.clear();
    }

    /// Asks the session for the exact checkpoints a request that ingests `prompt[reused..n]` should leave for later
    /// ones ([`crate::Grid::checkpoints`]: ubatch ends, the last grid point of the prompt and of its stable prefix),
    /// the newest as many as the cache keeps (its count and byte bounds).
    pub fn plan_checkpoints(&mut self, reused: usize, n: usize, stable_prefix: Option<usize>) {
        let grid = self.session.grid();
        let marks: Vec<usize> = stable_prefix.into_iter().collect();
        let mut at = grid.checkpoints(reused, n, &marks);
        let limits = self.checkpoints.limits();
        let each = self.session.state().linear_bytes().max(1);
        let room = limits.max_checkpoints.min(limits.max_bytes / each);
        at.drain(..at.len().saturating_sub(room));
        self.session.keep_checkpoints_at(at);
    }

    /// Keeps the checkpoints the session's prefills took since the last call.
    pub fn collect_checkpoints(&mut self) {
        for c in self.session.take_checkpoints() {
            self.checkpoints.push(c);
        }
    }
}
