//! Several choices from one prompt (`n` > 1): the serving engine prefills the prompt once and forks its state into
//! free slots (or, with too few slots, resumes later choices from a slot still holding the prompt); `run`'s
//! [`generate_choices`] rewinds one session. Either way choice `i` is, token for token and logit for logit, the
//! single request with seed `s + i` ([`choice_params`]).

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::serve::{CacheLimits, Engine, Event, Job, Metrics, ServeOptions};
use backburner_engine::{
    choice_params, generate, generate_choices, GenerateParams, Generation, SamplingParams, Session,
    SessionOptions, StopReason,
};
use backburner_kernels::kv::KvDtype;
use backburner_model::{KvOptions, Model};
use common::*;

fn opts() -> SessionOptions {
    SessionOptions {
        ubatch: 32,
        kv: KvOptions {
            page_size: 16,
            dtype: KvDtype::F32,
        },
        ..SessionOptions::default()
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

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(1234) >> 7) % vocab as u32)
        .collect()
}

fn sampled(max_tokens: usize, seed: u64) -> GenerateParams {
    GenerateParams {
        max_tokens,
        keep_logits: true,
        sampling: SamplingParams {
            temperature: 0.9,
            top_k: 40,
            seed,
            ..SamplingParams::default()
        },
        ..GenerateParams::default()
    }
}

/// Submits `prompt` with `n` choices; one receiver per choice.
fn submit_n(e: &Engine, prompt: &[u32], params: GenerateParams, n: usize) -> Vec<Receiver<Event>> {
    let mut rxs = Vec::new();
    let mut sinks: Vec<backburner_engine::serve::EventSink> = Vec::new();
    for _ in 0..n {
        let (tx, rx) = channel();
        rxs.push(rx);
        sinks.push(Box::new(move |ev| tx.send(ev).is_ok()));
    }
    let events = sinks.remove(0);
    e.submit(Job {
        id: "choices".into(),
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

/// A choice's tokens as its events told, and its generation (or its failure).
fn collect(rx: &Receiver<Event>) -> (Vec<u32>, Result<Generation, String>) {
    let mut tokens = Vec::new();
    while let Ok(ev) = rx.recv_timeout(Duration::from_secs(60)) {
        match ev {
            Event::Started { .. } => {}
            Event::Token { id, .. } => tokens.push(id),
            Event::Done { generation, .. } => return (tokens, Ok(*generation)),
            Event::Failed(e) => return (tokens, Err(e.to_string())),
        }
    }
    panic!("no end within 60 s");
}

fn alone(model: &Arc<Model>, prompt: &[u32], params: &GenerateParams) -> Generation {
    let mut s = Session::new(model.clone(), opts()).unwrap();
    generate(&mut s, prompt, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn choice_i_is_the_single_request_with_seed_plus_i_forked_or_resumed() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    // 70 tokens: two full ubatches and a partial one
    let p = prompt(70, vocab);
    let base = sampled(12, 4242);
    let want: Vec<Generation> = (0..4)
        .map(|i| alone(&model, &p, &choice_params(&base, i)))
        .collect();
    // the seeds matter: the four references are not all the same
    assert!(want.iter().any(|g| g.tokens != want[0].tokens));
    // 4 slots: all forked at once; 2: two forked, two resumed later; 1: three resumed one after another
    for slots in [4, 2, 1] {
        let e = engine(&model, slots);
        let rxs = submit_n(&e, &p, base.clone(), 4);
        for (i, rx) in rxs.iter().enumerate() {
            let (tokens, g) = collect(rx);
            let g = g.unwrap_or_else(|e| panic!("{slots} slots, choice {i}: {e}"));
            assert_eq!(tokens, want[i].tokens, "{slots} slots, choice {i}");
            assert_eq!(g.tokens, want[i].tokens);
            assert_eq!(g.stop_reason, want[i].stop_reason);
            assert_eq!(
                bits(&g.step_logits),
                bits(&want[i].step_logits),
                "{slots} slots, choice {i}: logits"
            );
        }
        let m = e.metrics();
        // the prompt was prefilled once
        assert_eq!(Metrics::get(&m.prefill_tokens), 70, "{slots} slots");
        assert_eq!(Metrics::get(&m.prompt_tokens), 70);
        // four sequences took a slot; one request with four choices finished
        assert_eq!(Metrics::get(&m.requests), 4);
        assert_eq!(Metrics::get(&m.requests_ok), 1);
        assert_eq!(Metrics::get(&m.sequences_ok), 4);
        if slots == 4 {
            // the four choices decoded together: 11 steps of 4 rows (the 12th token is not decoded)
            assert_eq!(Metrics::get(&m.decode_rows), 44);
            assert_eq!(Metrics::get(&m.decode_steps), 11);
        }
        // the slots still serve a plain request afterwards, with the single path's bits
        let rx = submit_n(&e, &p, choice_params(&base, 2), 1);
        let (_, g) = collect(&rx[0]);
        assert_eq!(bits(&g.unwrap().step_logits), bits(&want[2].step_logits));
    }
}

#[test]
fn greedy_choices_are_identical() {
    let model = load_model("tiny-f32");
    let p = prompt(40, model.config().vocab_size);
    let params = GenerateParams {
        max_tokens: 10,
        keep_logits: true,
        ..GenerateParams::default()
    };
    let want = alone(&model, &p, &params);
    let e = engine(&model, 2);
    for rx in submit_n(&e, &p, params, 3) {
        let (tokens, g) = collect(&rx);
        assert_eq!(tokens, want.tokens);
        assert_eq!(bits(&g.unwrap().step_logits), bits(&want.step_logits));
    }
}

#[test]
fn generate_choices_equals_generate_with_seed_plus_i() {
    let model = load_model("tiny-f32");
    let p = prompt(50, model.config().vocab_size);
    let base = sampled(9, 77);
    let mut s = Session::new(model.clone(), opts()).unwrap();
    let mut seen: Vec<Vec<u32>> = vec![Vec::new(); 3];
    let got = generate_choices(
        &mut s,
        &p,
        &base,
        3,
        None,
        |_, _| {},
        |i, id| seen[i].push(id),
        |_, _| {},
    )
    .unwrap();
    assert_eq!(got.len(), 3);
    for (i, g) in got.iter().enumerate() {
        let want = alone(&model, &p, &choice_params(&base, i));
        assert_eq!(g.tokens, want.tokens, "choice {i}");
        assert_eq!(seen[i], want.tokens);
        assert_eq!(bits(&g.step_logits), bits(&want.step_logits), "choice {i}");
    }
    // the session ends with the last choice after the prompt
    assert_eq!(s.tokens()[..p.len()], p[..]);
}

#[test]
fn cancelling_the_request_cancels_every_choice() {
    let model = load_model("tiny-f32");
    let p = prompt(30, model.config().vocab_size);
    let cancel = Arc::new(AtomicBool::new(false));
    let mut params = sampled(100_000, 5);
    params.keep_logits = false;
    params.cancel = Some(cancel.clone());
    // one slot: choice 0 runs, the others wait for the slot
    let e = engine(&model, 1);
    let rxs = submit_n(&e, &p, params, 3);
    // a few tokens of choice 0, then the client goes away
    let mut n = 0;
    while n < 3 {
        if let Event::Token { .. } = rxs[0].recv_timeout(Duration::from_secs(60)).unwrap() {
            n += 1;
        }
    }
    cancel.store(true, Ordering::Relaxed);
    let (_, g) = collect(&rxs[0]);
    assert_eq!(g.unwrap().stop_reason, StopReason::Interrupted);
    // the waiting choices never start: their sinks are dropped
    for rx in &rxs[1..] {
        assert!(rx.recv_timeout(Duration::from_secs(10)).is_err());
    }
    // and the slot is free for the next request
    let rx = submit_n(&e, &p, sampled(2, 1), 1);
    assert!(collect(&rx[0]).1.is_ok());
}

/// Choices on a model with layers and the head on a device (the CPU backend here): the prompt is still prefilled
/// once, its state (the device's KV caches and Gated DeltaNet states included) forked into the other slots, and
/// each choice has the plain model's single-request bits.
#[test]
fn choices_fork_the_state_of_layers_on_a_device() {
    let plain = load_model("tiny-f32");
    let mut placed = Model::load(&fixture("tiny-f32")).unwrap();
    let n = placed.config().num_hidden_layers;
    let cpu = Arc::new(backburner_model::device::CpuBackend);
    placed.place_layers(1..n, cpu.clone()).unwrap();
    placed.place_head(cpu).unwrap();
    let placed = Arc::new(placed);
    let p = prompt(70, plain.config().vocab_size);
    let base = sampled(10, 77);
    for slots in [3, 1] {
        let e = engine(&placed, slots);
        let rxs = submit_n(&e, &p, base.clone(), 3);
        for (i, rx) in rxs.iter().enumerate() {
            let want = alone(&plain, &p, &choice_params(&base, i));
            let (tokens, g) = collect(rx);
            let g = g.unwrap_or_else(|e| panic!("{slots} slots, choice {i}: {e}"));
            assert_eq!(tokens, want.tokens, "{slots} slots, choice {i}");
            assert_eq!(
                bits(&g.step_logits),
                bits(&want.step_logits),
                "{slots} slots, choice {i}: logits"
            );
        }
        // forked (3 slots) or resumed in place (1 slot): the prompt was prefilled once
        assert_eq!(
            Metrics::get(&e.metrics().prefill_tokens),
            70,
            "{slots} slots"
        );
    }
}
