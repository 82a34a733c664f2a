//! A slot: one session the server keeps between requests, with its prompt cache, and the routing of a request to
//! the slot holding its longest reusable prefix.

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

    /// Tokens of `prompt` (`[n]` ids) this slot can skip: its whole history when `prompt` extends it, else the
    /// longest checkpoint within the common prefix; at most `n − 1` (the last prompt token must run to give logits).
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        let hist = self.session.tokens();
        let limit = prompt.len().saturating_sub(1);
        let lcp = common_prefix(hist, prompt);
        if lcp == hist.len() && hist.len() <= limit {
            return hist.len();
        }
        self.checkpoints
            .best_at_most(lcp.min(limit))
            .map_or(0, |c| c.n_tokens())
    }

    /// Makes the session hold exactly the prefix of `prompt` that [`Slot::reusable`] gives (rewinding to a
    /// checkpoint, or clearing), and returns its length: the caller ingests `prompt[len..]`.
    pub fn prepare(&mut self, prompt: &[u32]) -> usize {
        let reuse = self.reusable(prompt);
        if reuse == self.session.tokens().len() {
            return reuse;
        }
        match self.checkpoints.best_at_most(reuse) {
            Some(c) if c.n_tokens() == reuse && reuse > 0 => {
                self.session.rewind(c);
                self.checkpoints.truncate(reuse);
                reuse
            }
            _ => {
                self.session.clear();
                self.checkpoints.clear();
                0
            }
        }
    }

    /// Forgets the history and the checkpoints.
    pub fn clear(&mut self) {
        self.session.clear();
        self.checkpoints.clear();
    }

    /// Keeps a checkpoint of the session's state now (at the end of its history).
    pub fn checkpoint(&mut self) {
        if self.session.batchable() {
            self.checkpoints.push(self.session.snapshot());
        }
    }
}
