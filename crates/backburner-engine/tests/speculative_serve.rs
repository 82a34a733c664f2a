//! Speculation through the public paths: [`generate`] with [`GenerateParams::spec`] (n-gram and scripted drafts,
//! adaptive and fixed lengths) and the serving engine's slots (one job speculating beside one that does not, n > 1
//! choices, metrics), each equal token for token and logit for logit to plain decoding.

use crate::common;

use std::sync::atomic::Ordering;
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::serve::{CacheLimits, Engine, Event, Job, ServeOptions};
use backburner_engine::spec::{SpecParams, SpecSource};
use backburner_engine::{
    generate, GenerateParams, Generation, SamplingParams, Session, SessionOptions,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, Model};
use common::*;

fn opts() -> SessionOptions {
    SessionOptions {
        ubatch: 32,
        kv: KvOptions {
            page_size: 8,
            dtype: KvDtype::F32,
        },
        ..SessionOptions::default()
    }
}

/// A prompt that repeats a 9-token phrase, so that prompt lookup has something to find.
fn repetitive(vocab: usize) -> Vec<u32> {
    let phrase: Vec<u32> = (0..9u32).map(|i| (i * 37 + 11) % vocab as u32).collect();
    phrase.iter().cycle().take(45).copied().collect()
}

fn run(model: &Arc<Model>, prompt: &[u32], params: &GenerateParams) -> Generation {
    let mut s = Session::new(model.clone(), opts()).unwrap();
    generate(&mut s, prompt, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

fn params(max_tokens: usize, temperature: f32, spec: Option<SpecParams>) -> GenerateParams {
    GenerateParams {
        max_tokens,
        keep_logits: true,
        sampling: SamplingParams {
            temperature,
            top_k: 20,
            seed: 77,
            ..SamplingParams::default()
        },
        spec,
        ..GenerateParams::default()
    }
}

fn ngram(draft_max: usize) -> SpecParams {
    SpecParams {
        source: SpecSource::Ngram { min: 2, max: 4 },
        draft_max,
        fixed: false,
        cost: None,
    }
}

fn scripted(script: Vec<u32>, error_rate: f64, draft_max: usize, fixed: bool) -> SpecParams {
    SpecParams {
        source: SpecSource::Scripted {
            script,
            error_rate,
            seed: 5,
        },
        draft_max,
        fixed,
        cost: None,
    }
}

fn assert_same(a: &Generation, b: &Generation, what: &str) {
    assert_eq!(a.tokens, b.tokens, "{what}: tokens");
    assert_eq!(a.stop_reason, b.stop_reason, "{what}: stop");
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&a.step_logits) == bits(&b.step_logits),
        "{what}: logits"
    );
}

#[test]
fn generate_with_drafts_equals_generate_without() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let p = repetitive(vocab);
    for temperature in [0.0, 0.8] {
        let want = run(&model, &p, &params(48, temperature, None));
        assert!(want.speculative.is_none());
        let script: Vec<u32> = p.iter().chain(&want.tokens).copied().collect();
        let cases = [
            ("ngram", ngram(6)),
            (
                "scripted exact, fixed 4",
                scripted(script.clone(), 0.0, 4, true),
            ),
            (
                "scripted 30 % wrong, adaptive",
                scripted(script.clone(), 0.3, 8, false),
            ),
            (
                "scripted all wrong, adaptive",
                scripted(script.clone(), 1.0, 8, false),
            ),
        ];
        for (name, spec) in cases {
            let got = run(&model, &p, &params(48, temperature, Some(spec)));
            assert_same(&got, &want, &format!("t={temperature}, {name}"));
            let c = got.speculative.expect("counts");
            assert!(c.accepted <= c.drafted);
            match name {
                "scripted exact, fixed 4" => {
                    // 47 tokens after the first, 5 per step but the last ones
                    assert_eq!(c.accepted, c.drafted, "{name}");
                    assert!(c.steps <= 11 && c.accepted >= 36, "{name}: {c:?}");
                }
                "scripted all wrong, adaptive" => {
                    assert_eq!(c.accepted, 0, "{name}");
                    // the controller stops drafting: a few probes, not a draft per step
                    assert!(c.drafted < 20, "{name}: {c:?}");
                }
                _ => {}
            }
        }
    }
}

fn engine(model: &Arc<Model>, slots: usize) -> Engine {
    let sessions = (0..slots)
        .map(|_| Session::new(model.clone(), opts()).unwrap())
        .collect();
    let so = ServeOptions {
        queue: 8,
        cache: CacheLimits::default(),
        ..Default::default()
    };
    Engine::start(sessions, None, so).unwrap()
}

fn submit(
    e: &Engine,
    id: &str,
    prompt: &[u32],
    params: GenerateParams,
    n: usize,
) -> Vec<Receiver<Event>> {
    let mut rxs = Vec::new();
    let mut sinks: Vec<backburner_engine::serve::EventSink> = Vec::new();
    for _ in 0..n {
        let (tx, rx) = channel();
        rxs.push(rx);
        sinks.push(Box::new(move |ev| tx.send(ev).is_ok()));
    }
    let events = sinks.remove(0);
    e.submit(Job {
        id: id.into(),
        prompt: prompt.to_vec(),
        params,
        stable_prefix: None,
        cache_prompt: true,
        events,
        siblings: sinks,
    })
    .unwrap();
    rxs
}

fn collect(rx: &Receiver<Event>) -> (Vec<u32>, Generation) {
    let mut tokens = Vec::new();
    while let Ok(ev) = rx.recv_timeout(Duration::from_secs(60)) {
        match ev {
            Event::Started { .. } => {}
            Event::Token { id, .. } => tokens.push(id),
            Event::Done { generation, .. } => return (tokens, *generation),
            Event::Failed(e) => panic!("failed: {e}"),
        }
    }
    panic!("no end within 60 s");
}

#[test]
fn the_serving_engine_speculates_per_job_beside_batched_jobs() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let p = repetitive(vocab);
    let q: Vec<u32> = p.iter().rev().copied().collect();
    let plain_p = run(&model, &p, &params(40, 0.0, None));
    let plain_q = run(&model, &q, &params(40, 0.7, None));
    let script: Vec<u32> = p.iter().chain(&plain_p.tokens).copied().collect();
    let e = engine(&model, 3);
    // one job speculating (scripted, 20 % wrong), one plain, one speculating with 2 sampled choices
    let a = submit(
        &e,
        "a",
        &p,
        params(40, 0.0, Some(scripted(script, 0.2, 4, true))),
        1,
    );
    let b = submit(&e, "b", &q, params(40, 0.7, None), 1);
    let mut c_params = params(40, 0.7, Some(ngram(4)));
    c_params.sampling.seed = 77;
    let c = submit(&e, "c", &q, c_params.clone(), 2);
    let (ta, ga) = collect(&a[0]);
    let (tb, gb) = collect(&b[0]);
    assert_eq!(ta, plain_p.tokens);
    assert_same(&ga, &plain_p, "speculating job");
    assert_eq!(tb, plain_q.tokens);
    assert_same(&gb, &plain_q, "plain job beside it");
    let mut seed1 = params(40, 0.7, None);
    seed1.sampling.seed = 78;
    let plain_c1 = run(&model, &q, &seed1);
    for (i, want) in [&plain_q, &plain_c1].into_iter().enumerate() {
        let (t, g) = collect(&c[i]);
        assert_eq!(t, want.tokens, "choice {i}");
        assert_same(&g, want, &format!("speculating choice {i}"));
    }
    let counts = ga.speculative.expect("counts");
    assert!(
        counts.accepted > 0 && counts.accepted < counts.drafted,
        "{counts:?}"
    );
    let m = e.metrics();
    let drafted = m.spec_drafted.load(Ordering::Relaxed);
    let accepted = m.spec_accepted.load(Ordering::Relaxed);
    assert!(drafted >= counts.drafted && accepted >= counts.accepted);
    assert!(m.spec_steps.load(Ordering::Relaxed) >= counts.steps);
    // every token generated is counted once, speculated or not
    let generated = m.generated_tokens.load(Ordering::Relaxed);
    assert_eq!(generated, 40 * 4);
}
