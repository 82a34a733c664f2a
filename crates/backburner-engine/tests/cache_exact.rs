//! The prompt cache is exact: every answer the serving engine gives from a slot's cached state — the next turn of
//! a chat, an agent's extension of the history (which ended in decode steps), a regenerate, an edit of an earlier
//! turn — has the logits, bit for bit, of a cold run of the same prompt in a fresh session. Randomized conversations
//! on every weight format (f32, bf16, f16, Q8_0, Q4_0, Q4_K, Q6_K, IQ4_XS) and several ubatch sizes, including sizes that are not a
//! multiple of the Gated DeltaNet chunk.

use crate::common;

use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::serve::{CacheLimits, Engine, Event, Job, ServeOptions};
use backburner_engine::{generate, GenerateParams, Generation, Session, SessionOptions};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, Model};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub fn opts(ubatch: usize) -> SessionOptions {
    SessionOptions {
        ubatch,
        kv: KvOptions {
            page_size: 16,
            dtype: KvDtype::F16,
        },
        ..SessionOptions::default()
    }
}

/// What one request gave: the tokens cached, and the generation.
pub struct Answer {
    pub cached: usize,
    pub generation: Generation,
}

/// Runs one job on `e` and waits for it.
pub fn ask(e: &Engine, prompt: &[u32], params: &GenerateParams, stable: Option<usize>) -> Answer {
    let (tx, rx) = channel();
    e.submit(Job {
        id: "t".into(),
        prompt: prompt.to_vec(),
        params: params.clone(),
        stable_prefix: stable,
        cache_prompt: true,
        siblings: Vec::new(),
        events: Box::new(move |ev| tx.send(ev).is_ok()),
    })
    .unwrap();
    let mut cached = 0;
    loop {
        match rx.recv_timeout(Duration::from_secs(120)).expect("an event") {
            Event::Started { cached_tokens, .. } => cached = cached_tokens,
            Event::Done { generation, .. } => {
                return Answer {
                    cached,
                    generation: *generation,
                }
            }
            Event::Failed(e) => panic!("request failed: {e}"),
            _ => {}
        }
    }
}

/// The kinds of next request a conversation makes.
#[derive(Clone, Copy, Debug)]
pub enum Turn {
    /// The previous prompt, the answer and new tokens (an agent's next step; the history ended in decode steps).
    Extend,
    /// The previous prompt and new tokens (a chat template that drops the reply's thinking), stable prefix at the
    /// previous prompt's end.
    Chat,
    /// The previous prompt again (regenerate).
    Regenerate,
    /// A cut of the previous prompt and new tokens (an edit of an earlier turn).
    Edit,
}

/// A randomized conversation of `turns` requests against `e`, each answer compared bit for bit with `cold` (a fresh
/// session's run of the same prompt). Returns the tokens taken from the cache over all turns.
pub fn converse(
    e: &Engine,
    cold: &dyn Fn(&[u32], &GenerateParams) -> Generation,
    vocab: usize,
    seed: u64,
    turns: usize,
    what: &str,
) -> usize {
    let mut rng = StdRng::seed_from_u64(seed);
    let new = |rng: &mut StdRng, lo: usize, hi: usize| -> Vec<u32> {
        let n = rng.random_range(lo..=hi);
        (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
    };
    let mut prev: Vec<u32> = new(&mut rng, 60, 260);
    let mut answer: Vec<u32> = Vec::new();
    let mut reused = 0;
    for i in 0..turns {
        let (prompt, stable) = if i == 0 {
            (prev.clone(), None)
        } else {
            let kind =
                [Turn::Extend, Turn::Chat, Turn::Regenerate, Turn::Edit][rng.random_range(0..4)];
            match kind {
                Turn::Extend => {
                    let p = [&prev[..], &answer[..], &new(&mut rng, 1, 90)[..]].concat();
                    (p, None)
                }
                Turn::Chat => {
                    let p = [&prev[..], &new(&mut rng, 1, 90)[..]].concat();
                    (p, Some(prev.len()))
                }
                Turn::Regenerate => (prev.clone(), None),
                Turn::Edit => {
                    let cut = rng.random_range(1..prev.len());
                    let p = [&prev[..cut], &new(&mut rng, 1, 90)[..]].concat();
                    (p, Some(cut))
                }
            }
        };
        let params = GenerateParams {
            max_tokens: rng.random_range(1..=10),
            keep_logits: true,
            ..GenerateParams::default()
        };
        let got = ask(e, &prompt, &params, stable);
        let want = cold(&prompt, &params);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            got.generation.tokens,
            want.tokens,
            "{what}, turn {i}: tokens of the {}-token prompt (cached {})",
            prompt.len(),
            got.cached
        );
        assert!(
            bits(&got.generation.step_logits) == bits(&want.step_logits),
            "{what}, turn {i}: logits of the {}-token prompt (cached {})",
            prompt.len(),
            got.cached
        );
        reused += got.cached;
        answer = got.generation.tokens;
        prev = prompt;
    }
    reused
}

/// An engine of `slots` local sessions of `model` with ubatch `ubatch`.
fn local_engine(model: &Arc<Model>, slots: usize, ubatch: usize) -> Engine {
    let sessions = (0..slots)
        .map(|_| Session::new(model.clone(), opts(ubatch)).unwrap())
        .collect();
    let serve = ServeOptions {
        queue: 4,
        cache: CacheLimits::default(),
        ..Default::default()
    };
    Engine::start(sessions, None, serve).unwrap()
}

fn cold_local(model: &Arc<Model>, ubatch: usize) -> impl Fn(&[u32], &GenerateParams) -> Generation {
    let model = model.clone();
    move |p, params| {
        let mut s = Session::new(model.clone(), opts(ubatch)).unwrap();
        generate(&mut s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
    }
}

#[test]
fn cached_answers_equal_cold_runs_on_every_format_and_ubatch() {
    let models = [
        "tiny-f32",
        "tiny-bf16",
        "gguf/tiny-f16-split-00001-of-00002.gguf",
        "gguf/tiny-q-q8_0.gguf",
        "gguf/tiny-q-q4_0.gguf",
        "gguf/tiny-q-q4_k.gguf",
        "gguf/tiny-q-q6_k.gguf",
        "gguf/tiny-q-iq4_xs.gguf",
        "gguf/tiny-q-mix.gguf",
    ];
    for (mi, name) in models.iter().enumerate() {
        let model = Arc::new(Model::load(&common::fixture(name)).unwrap());
        let vocab = model.config().vocab_size;
        for (ui, ubatch) in [32, 64, 96, 200].into_iter().enumerate() {
            let e = local_engine(&model, 1, ubatch);
            let seed = (mi * 16 + ui) as u64;
            let what = format!("{name}, ubatch {ubatch}");
            let reused = converse(&e, &cold_local(&model, ubatch), vocab, seed, 8, &what);
            assert!(
                reused >= 100,
                "{what}: only {reused} tokens came from the cache"
            );
        }
    }
}

#[test]
fn a_prompt_one_token_past_a_grid_point_is_not_resumed_there() {
    // ubatch 200: the 65-token prompt's last grid point is 64. Its regenerate cannot resume there (the lone token
    // would run the decode step, where the cold run has it in a chunk of its ubatch): it starts over.
    let model = Arc::new(Model::load(&common::fixture("gguf/tiny-q-q8_0.gguf")).unwrap());
    let vocab = model.config().vocab_size as u32;
    let e = local_engine(&model, 1, 200);
    let p: Vec<u32> = (0..65u32).map(|i| (i * 37 + 11) % vocab).collect();
    let params = GenerateParams {
        max_tokens: 3,
        keep_logits: true,
        ..GenerateParams::default()
    };
    let first = ask(&e, &p, &params, None);
    let again = ask(&e, &p, &params, None);
    assert_eq!((first.cached, again.cached), (0, 0));
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&again.generation.step_logits) == bits(&first.generation.step_logits));
    // one more token and it resumes from 64
    let longer = [&p[..], &[5]].concat();
    let third = ask(&e, &longer, &params, None);
    assert_eq!(third.cached, 64);
    let want = cold_local(&model, 200)(&longer, &params);
    assert!(bits(&third.generation.step_logits) == bits(&want.step_logits));
}

#[test]
fn a_session_prefill_runs_ubatches_at_absolute_positions() {
    // 64 tokens, then 206 more: the second call's ubatches end at 96 and 192 (ubatch 96), as a single prefill of 270
    // tokens does (counted from 64 they would end at 160 and 256, and their chunks would start elsewhere), and its
    // logits are those of the single prefill, bit for bit
    let model = Arc::new(Model::load(&common::fixture("gguf/tiny-q-q4_k.gguf")).unwrap());
    let vocab = model.config().vocab_size as u32;
    let ids: Vec<u32> = (0..270u32).map(|i| (i * 91 + 7) % vocab).collect();
    let mut one = Session::new(model.clone(), opts(96)).unwrap();
    let all = one
        .prefill(&ids, backburner_engine::Logits::All, |_, _| {})
        .unwrap();
    let mut two = Session::new(model.clone(), opts(96)).unwrap();
    let mut got = two
        .prefill(&ids[..64], backburner_engine::Logits::All, |_, _| {})
        .unwrap();
    got.extend(
        two.prefill(&ids[64..], backburner_engine::Logits::All, |_, _| {})
            .unwrap(),
    );
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(bits(&got) == bits(&all), "logits differ");
    use backburner_engine::Segment;
    assert_eq!(two.history().segments(), [Segment::Prefill(0..270)]);
    assert_eq!(two.history().calls(two.grid()), [0..96, 96..192, 192..270]);
}
