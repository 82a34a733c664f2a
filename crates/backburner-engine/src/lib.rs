//! Backburner engine: sessions with ubatched prefill and decode, sampling, the generation loop with stop conditions,
//! and perplexity.
#![warn(missing_docs)]

pub mod error;
pub mod generate;
pub mod perplexity;
pub mod sampling;
pub mod session;

pub use error::{EngineError, Result};
pub use generate::{generate, GenerateParams, Generation, StopReason, Timings};
pub use perplexity::{perplexity, Perplexity};
pub use sampling::{argmax, Sampler, SamplingParams};
pub use session::{Logits, Session, SessionOptions};
