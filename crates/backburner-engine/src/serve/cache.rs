//! The prompt cache of one slot: checkpoints of its recurrent state, so a request that shares a prefix with the
//! slot's history ingests only what follows.
//!
//! A hybrid model's state has two kinds of parts. The full-attention layers' KV rows are independent per position:
//! truncating them to any prefix is exact. The Gated DeltaNet layers' recurrent and conv states fold every position
//! in and cannot be rewound; so the slot keeps copies of them ([`StateSnapshot`]) at chosen positions — the end of
//! each prefill chunk (ubatch boundaries) and the end of the conversation's stable prefix (before the generation
//! prompt) — and a request resumes from the longest checkpoint inside the prefix it shares with the history, or
//! continues the history itself when its prompt extends all of it (the next chat turn, an agent's next step).
//!
//! Bounds: at most [`CacheLimits::max_checkpoints`] per slot and [`CacheLimits::max_bytes`] of them per slot (each
//! checkpoint holds every linear layer's conv and recurrent state: `n_linear × (conv_dim × (kernel − 1) + n_v_heads ×
//! d_k × d_v) × 4` bytes); past either bound the oldest go first.

use backburner_model::StateSnapshot;

/// Bounds of one slot's checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheLimits {
    /// Most checkpoints kept per slot (0 disables checkpoints: only exact extensions of the history are reused).
    pub max_checkpoints: usize,
    /// Most bytes of checkpoints per slot.
    pub max_bytes: usize,
}

impl Default for CacheLimits {
    fn default() -> Self {
        CacheLimits {
            max_checkpoints: 16,
            max_bytes: 512 << 20,
        }
    }
}

/// One slot's checkpoints, in increasing position.
#[derive(Debug, Default)]
pub struct Checkpoints {
    list: Vec<StateSnapshot>,
    limits: CacheLimits,
}

impl Checkpoints {
    /// No checkpoints yet, bounded by `limits`.
    pub fn new(limits: CacheLimits) -> Self {
        Checkpoints {
            list: Vec::new(),
            limits,
        }
    }

    /// Keeps `snap` (an exact checkpoint of the slot's history), replacing any at the same position, then drops the
    /// oldest while over the bounds. A snapshot alone larger than the byte bound is not kept.
    pub fn push(&mut self, snap: StateSnapshot) {
        let n = snap.n_tokens();
        if n == 0 || self.limits.max_checkpoints == 0 || snap.bytes() > self.limits.max_bytes {
            return;
        }
        self.list.retain(|c| c.n_tokens() != n);
        let at = self.list.partition_point(|c| c.n_tokens() < n);
        self.list.insert(at, snap);
        while self.list.len() > self.limits.max_checkpoints || self.bytes() > self.limits.max_bytes
        {
            self.list.remove(0);
        }
    }

    /// The checkpoint at the longest position ≤ `n` (`None`: start from the empty state).
    pub fn best_at_most(&self, n: usize) -> Option<&StateSnapshot> {
        self.list.iter().rev().find(|c| c.n_tokens() <= n)
    }

    /// The checkpoint at position `n`, if kept.
    pub fn at(&self, n: usize) -> Option<&StateSnapshot> {
        self.list.iter().find(|c| c.n_tokens() == n)
    }

    /// Drops the checkpoints past position `n` (the history was cut to `n` tokens).
    pub fn truncate(&mut self, n: usize) {
        self.list.retain(|c| c.n_tokens() <= n);
    }

    /// The bounds.
    pub fn limits(&self) -> CacheLimits {
        self.limits
    }

    /// Drops every checkpoint.
    pub fn clear(&mut self) {
        self.list.clear();
    }

    /// Checkpoints held.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Bytes held by the checkpoints.
    pub fn bytes(&self) -> usize {
        self.list.iter().map(StateSnapshot::bytes).sum()
    }

    /// The positions of the checkpoints, increasing.
    pub fn positions(&self) -> Vec<usize> {
        self.list.iter().map(StateSnapshot::n_tokens).collect()
    }
}
