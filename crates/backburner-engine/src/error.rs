//! Engine errors.

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The model failed (a load or tensor error).
    #[error(transparent)]
    Model(#[from] backburner_model::ModelError),
    /// The request does not fit the context window.
    #[error("context overflow: {add} new token(s) after the {have} already in context exceed the context length of {limit} tokens (shorten the prompt or raise --ctx-size)")]
    ContextOverflow {
        /// Tokens already in the session.
        have: usize,
        /// Tokens the request adds (prompt, plus max_tokens for generation).
        add: usize,
        /// The context length.
        limit: usize,
    },
    /// An empty prompt: there is nothing to condition on.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The model produced NaN or infinite logits (broken weights or config); no token is sampled from them.
    #[error("the model produced non-finite logits (NaN or infinity): the checkpoint's weights or config are broken")]
    NonFinite,
    /// The host's KV budget (`--kv-budget`) cannot hold what the request needs and no worker can take the oldest
    /// pages (none attached, unreachable, lost, or full). The session keeps its tokens; a later request rebuilds
    /// the state once a worker is back.
    #[error("KV budget exceeded: {need} positions of KV cache would be on this host but --kv-budget allows {budget}: {why}")]
    KvBudget {
        /// The host's budget (positions).
        budget: usize,
        /// Positions the host would have to hold.
        need: usize,
        /// Why no worker took the pages.
        why: String,
    },
    /// A layer-split worker, which holds the only copy of its layers, lost its session during the request and the
    /// request's one retry on fresh sessions failed too (the worker could not be reached again, or failed again):
    /// the request fails (nothing else can run those layers). The session keeps its tokens (without this request's)
    /// and the next request re-ingests them through the worker once it is back.
    #[error("worker {addr} holding layers {layers} is lost ({reason}){}", kept_note(*kept))]
    WorkerLost {
        /// The worker's address.
        addr: String,
        /// The layers it holds (`a..b`).
        layers: String,
        /// What failed.
        reason: String,
        /// Tokens the session keeps.
        kept: usize,
    },
    /// A layer-split worker could not be used for its layers: unreachable, or it refused them in the handshake
    /// (another model, a pinned `--layers` range, too little memory, a wrong secret). Nothing ran; the session keeps
    /// its tokens.
    #[error("cannot use worker {addr} for layers {layers}: {reason}")]
    WorkerUnavailable {
        /// The worker's address.
        addr: String,
        /// The layers it was to hold (`a..b`).
        layers: String,
        /// Why: the worker's refusal or the connection's error.
        reason: String,
    },
    /// Routed experts held by workers could not be run during the request, and its one retry on fresh
    /// connections failed too: the request fails (the host does not hold those experts). The session keeps its
    /// tokens (without this request's) and the next request re-ingests them once the workers are back.
    #[error("routed experts on a worker are unavailable ({reason}){}", kept_note(*kept))]
    ExpertsLost {
        /// What failed.
        reason: String,
        /// Tokens the session keeps.
        kept: usize,
    },
    /// A request value without a meaning (a sampling value out of its range, ...): nothing ran.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The grammar engine of a constrained generation failed mid-way (`crate::constraint`).
    #[error("constrained decoding failed: {0}")]
    Constraint(String),
    /// A bad setting (ubatch 0, page size 0, ...).
    #[error("invalid setting: {0}")]
    InvalidSetting(String),
    /// The serving engine is shutting down: a queued request is refused without running (HTTP 503).
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// The tail of [`EngineError::WorkerLost`]'s message: what the session keeps.
fn kept_note(kept: usize) -> String {
    match kept {
        0 => String::new(),
        n => format!("; the session keeps its {n} tokens and re-ingests them on its next request"),
    }
}

/// Result alias.
pub type Result<T> = std::result::Result<T, EngineError>;
