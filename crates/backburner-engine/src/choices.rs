//! Several sequences from one prompt (OpenAI's `n` > 1): the prompt is prefilled once and every choice samples
//! from its logits and state.
//!
//! Seeds: choice `i` samples with seed `s + i` (wrapping), `s` the request's seed, so choice `i` is token for token
//! the single request with seed `s + i` (the same prompt, settings and cache). With greedy sampling every choice is
//! the same; without a seed the server draws `s` at random, so the choices differ. (vLLM likewise derives one
//! generator per sequence from the request's seed; llama-server has no `n` for chat.)
//!
//! [`generate_choices`] runs the choices one after another in one session, rewinding it to the end of the prompt
//! between them (`backburner run --n-choices`); the serving engine forks the prompt's state into free slots and
//! decodes the choices together ([`crate::serve::Job::siblings`]).

use backburner_model::TextTokenizer;

use crate::error::Result;
use crate::generate::{drive, GenerateParams, Generation};
use crate::sequence::Sequence;
use crate::session::Session;

/// Most choices one request may ask for (the server's `n`, `run --n-choices`).
pub const MAX_CHOICES: usize = 16;

/// The settings of choice `i` of a request with `params`: the same, with seed `params.sampling.seed + i`
/// (wrapping). Choice 0's are `params` itself.
pub fn choice_params(params: &GenerateParams, i: usize) -> GenerateParams {
    let mut p = params.clone();
    p.sampling.seed = p.sampling.seed.wrapping_add(i as u64);
    p
}

/// Generates `n` (≥ 1) continuations of `prompt` in `session`, choice `i` with [`choice_params`]`(params, i)`: the
/// prompt is prefilled once, then each choice is sampled and decoded to its end in turn, the session rewound to the
/// end of the prompt before each choice after the first ([`Session::rewind`]: in place on this host; with a layer
/// split whose workers lost the checkpoint, or KV offload below the pages on workers, the first decode step
/// re-ingests the prompt with the same bits). Choice `i` equals [`crate::generate`] with `choice_params(params, i)`
/// token for token. `on_token(i, id)` and `on_text(i, piece)` report choice `i`'s progress.
///
/// Errors: those of [`crate::generate`].
#[allow(clippy::too_many_arguments)]
pub fn generate_choices(
    session: &mut Session,
    prompt: &[u32],
    params: &GenerateParams,
    n: usize,
    tokenizer: Option<&TextTokenizer>,
    mut on_prefill: impl FnMut(usize, usize),
    mut on_token: impl FnMut(usize, u32) + Send,
    mut on_text: impl FnMut(usize, &str) + Send,
) -> Result<Vec<Generation>> {
    let mut first = Sequence::new(session, prompt.to_vec(), params.clone(), tokenizer)?;
    first.prefill_step(session, prompt.len(), &mut on_prefill)?;
    let context = session.tokens().to_vec();
    let snap = session.snapshot();
    // the others fork from an untouched copy of the prompt's logits (the first one samples at once)
    let forks = (1..n.max(1))
        .map(|i| {
            first
                .fork(&context, choice_params(params, i))
                .expect("a sequence fresh from its prefill forks")
        })
        .collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(n.max(1));
    drive(
        session,
        &mut first,
        params,
        |id| on_token(0, id),
        |t| on_text(0, t),
    )?;
    out.push(first.finish());
    for (i, mut seq) in forks.into_iter().enumerate().map(|(i, s)| (i + 1, s)) {
        session.rewind(&snap);
        let p = choice_params(params, i);
        drive(
            session,
            &mut seq,
            &p,
            |id| on_token(i, id),
            |t| on_text(i, t),
        )?;
        out.push(seq.finish());
    }
    Ok(out)
}
