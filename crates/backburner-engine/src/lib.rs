//! Backburner engine: sessions with ubatched prefill and decode, sampling, the generation loop with stop conditions,
//! and perplexity.
#![warn(missing_docs)]

pub mod chain;
pub mod choices;
pub mod compute;
pub mod connection;
pub mod constraint;
pub mod error;
pub mod experts;
pub mod gbnf;
pub mod generate;
pub mod grid;
pub mod history;
pub mod memory;
pub mod offload;
pub mod open;
pub mod perplexity;
pub mod picker;
mod pipeline;
pub mod plan;
pub mod sampling;
pub mod sequence;
pub mod serve;
pub mod session;
mod session_checkpoints;
mod session_memory;
mod session_mtp;
mod session_verify;
pub mod spec;
pub mod split;
pub mod step_plan;
pub mod stop;
pub mod wire;
pub mod worker;

pub use choices::{choice_params, generate_choices, MAX_CHOICES};
pub use compute::ComputePool;
pub use error::{EngineError, Result};
pub use generate::{generate, GenerateParams, Generation, StopReason, TextStream, Timings};
pub use grid::Grid;
pub use history::{History, Segment};
pub use memory::MemoryReport;
pub use perplexity::{perplexity, perplexity_windows, Perplexity};
pub use picker::{Picker, TokenLogprob, MAX_TOP_LOGPROBS};
pub use sampling::{argmax, Sampler, SamplingParams};
pub use sequence::{Phase, Sampled, Sequence};
pub use session::{Logits, Session, SessionOptions};
pub use split::{balanced_split, LinkStats, WorkerClient, WorkerSettings};
pub use step_plan::{Executor, StepKind, StepPlan};
pub use stop::{check_stop_strings, StopMatcher, MAX_STOP_BYTES, MAX_STOP_STRINGS};
pub use worker::{valid_split_layers, Worker, WorkerError, WorkerOptions};
