//! The serving engine (`backburner_engine::serve`): parallel slots give each sequence exactly the tokens and logits
//! it gets alone; the prompt cache reuses prefixes with the same tokens; cancellation, a full queue, shutdown.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use backburner_engine::serve::{CacheLimits, Engine, Event, Job, ServeOptions, SubmitError};
use backburner_engine::{
    generate, GenerateParams, Generation, Session, SessionOptions, StopReason,
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

fn engine(model: &Arc<Model>, slots: usize, queue: usize, cache: CacheLimits) -> Engine {
    let sessions = (0..slots)
        .map(|_| Session::new(model.clone(), opts()).unwrap())
        .collect();
    Engine::start(
        sessions,
        None,
        ServeOptions {
            queue,
            cache,
            ..Default::default()
        },
    )
    .unwrap()
}

fn greedy(max_tokens: usize) -> GenerateParams {
    GenerateParams {
        max_tokens,
        keep_logits: true,
        ..GenerateParams::default()
    }
}

/// A prompt of `n` ids from a seed (deterministic, inside the vocabulary).
fn prompt(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97 + 13) >> 7) % vocab as u32)
        .collect()
}

/// What a job produced, as its events told.
#[derive(Debug)]
struct Outcome {
    cached: usize,
    tokens: Vec<u32>,
    generation: Option<Generation>,
    failed: Option<String>,
}

fn submit(e: &Engine, prompt: Vec<u32>, params: GenerateParams) -> Receiver<Event> {
    try_submit(e, prompt, params).unwrap()
}

fn try_submit(
    e: &Engine,
    prompt: Vec<u32>,
    params: GenerateParams,
) -> Result<Receiver<Event>, SubmitError> {
    let (tx, rx) = channel();
    e.submit(Job {
        id: "t".into(),
        prompt,
        params,
        stable_prefix: None,
        cache_prompt: true,
        siblings: Vec::new(),
        events: Box::new(move |ev| tx.send(ev).is_ok()),
    })?;
    Ok(rx)
}

fn collect(rx: Receiver<Event>) -> Outcome {
    let mut o = Outcome {
        cached: 0,
        tokens: Vec::new(),
        generation: None,
        failed: None,
    };
    while let Ok(ev) = rx.recv_timeout(Duration::from_secs(60)) {
        match ev {
            Event::Started { cached_tokens, .. } => o.cached = cached_tokens,
            Event::Token { id, .. } => o.tokens.push(id),
            Event::Done { generation, .. } => {
                o.generation = Some(*generation);
                break;
            }
            Event::Failed(e) => {
                o.failed = Some(e.to_string());
                break;
            }
        }
    }
    o
}

/// The same prompt generated alone in a fresh session.
fn alone(model: &Arc<Model>, prompt: &[u32], params: &GenerateParams) -> Generation {
    let mut s = Session::new(model.clone(), opts()).unwrap();
    generate(&mut s, prompt, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

#[test]
fn four_slots_give_each_sequence_its_own_tokens_and_logits() {
    // dense, and mixture of experts (the batch groups the sequences' rows by routed expert), and Qwen3-Next
    for name in [
        "tiny-f32",
        "tiny-moe-f32",
        "tiny-next-f32",
        "gguf/tiny-q-mix.gguf",
    ] {
        four_slots(name);
    }
}

fn four_slots(name: &str) {
    let model = load_model(name);
    let vocab = model.config().vocab_size;
    let e = engine(&model, 4, 8, CacheLimits::default());
    let prompts: Vec<Vec<u32>> = [(1, 5), (2, 40), (3, 77), (4, 130)]
        .iter()
        .map(|&(s, n)| prompt(s, n, vocab))
        .collect();
    let rxs: Vec<_> = prompts
        .iter()
        .map(|p| submit(&e, p.clone(), greedy(24)))
        .collect();
    let got: Vec<Outcome> = rxs.into_iter().map(collect).collect();
    for (p, o) in prompts.iter().zip(&got) {
        let want = alone(&model, p, &greedy(24));
        let g = o.generation.as_ref().expect("done");
        assert_eq!(
            o.tokens,
            want.tokens,
            "{name}: tokens of the {}-token prompt",
            p.len()
        );
        assert_eq!(g.tokens, want.tokens);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&g.step_logits) == bits(&want.step_logits),
            "{name}: logits of the {}-token prompt",
            p.len()
        );
        assert_eq!(g.step_logits.len(), 24 * vocab);
    }
    let m = e.metrics();
    assert_eq!(m.requests_ok.load(Ordering::Relaxed), 4);
    // the decode steps ran batched: fewer steps than rows
    let (steps, rows) = (
        m.decode_steps.load(Ordering::Relaxed),
        m.decode_rows.load(Ordering::Relaxed),
    );
    assert_eq!(rows, 4 * 23);
    assert!(steps < rows, "{steps} decode steps for {rows} rows");
}

#[test]
fn a_prompt_extending_the_history_resumes_from_its_last_grid_point_bit_for_bit() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 1, 4, CacheLimits::default());
    let p1 = prompt(7, 90, vocab);
    let first = collect(submit(&e, p1.clone(), greedy(8)));
    assert_eq!(first.cached, 0);
    // the next turn: the history (prompt + the tokens decoded) and new tokens
    let g = first.generation.unwrap();
    let mut p2 = p1.clone();
    p2.extend_from_slice(&g.tokens[..g.tokens.len() - 1]);
    p2.extend(prompt(8, 20, vocab));
    let second = collect(submit(&e, p2.clone(), greedy(8)));
    // the history ended in decode steps and its prompt mid-ubatch: it resumes from the prompt's last grid point (64,
    // a ubatch end of 32) and runs the rest as a cold run does
    assert_eq!(second.cached, 64);
    let want = alone(&model, &p2, &greedy(8));
    let g = second.generation.unwrap();
    assert_eq!(g.tokens, want.tokens);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&g.step_logits) == bits(&want.step_logits),
        "logits differ"
    );
    let m = e.metrics();
    assert_eq!(m.cache_hits.load(Ordering::Relaxed), 1);
    assert_eq!(m.cached_tokens.load(Ordering::Relaxed), 64);
}

#[test]
fn a_diverging_prompt_resumes_from_a_checkpoint_bit_for_bit() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 1, 4, CacheLimits::default());
    let p1 = prompt(9, 150, vocab);
    collect(submit(&e, p1.clone(), greedy(4)));
    // shares 100 tokens, then differs: the checkpoint at 96 (a ubatch boundary) is the longest inside
    let mut p2 = p1[..100].to_vec();
    p2.extend(prompt(10, 30, vocab));
    let o = collect(submit(&e, p2.clone(), greedy(12)));
    assert_eq!(o.cached, 96);
    let want = alone(&model, &p2, &greedy(12));
    let g = o.generation.unwrap();
    assert_eq!(g.tokens, want.tokens);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&g.step_logits) == bits(&want.step_logits),
        "logits differ"
    );
    assert_eq!(g.step_logits.len(), 12 * vocab);
    // without checkpoints only exact extensions are reused: this one starts over
    let e0 = engine(
        &model,
        1,
        4,
        CacheLimits {
            max_checkpoints: 0,
            max_bytes: 0,
        },
    );
    collect(submit(&e0, p1, greedy(4)));
    let o0 = collect(submit(&e0, p2, greedy(12)));
    assert_eq!(o0.cached, 0);
    assert_eq!(o0.tokens, want.tokens);
}

#[test]
fn a_request_goes_to_the_slot_holding_its_prefix() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 2, 4, CacheLimits::default());
    let (a, b) = (prompt(11, 70, vocab), prompt(12, 70, vocab));
    let oa = collect(submit(&e, a.clone(), greedy(2)));
    let ob = collect(submit(&e, b.clone(), greedy(2)));
    assert_eq!((oa.cached, ob.cached), (0, 0));
    for p in [&b, &a] {
        let mut next = p.clone();
        next.extend(prompt(13, 5, vocab));
        // each slot holds an exact checkpoint at 64, the last grid point (ubatch 32) of its 70-token prompt
        let o = collect(submit(&e, next, greedy(2)));
        assert_eq!(o.cached, 64, "routed to the slot that holds it");
    }
}

#[test]
fn cancelling_frees_the_slot_and_a_full_queue_refuses() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 1, 1, CacheLimits::default());
    let cancel = Arc::new(AtomicBool::new(false));
    let long = GenerateParams {
        max_tokens: 100_000,
        cancel: Some(cancel.clone()),
        ..GenerateParams::default()
    };
    let rx = submit(&e, prompt(14, 20, vocab), long);
    // wait until it runs, so the next one waits in the queue and the one after finds it full
    assert!(matches!(rx.recv().unwrap(), Event::Started { .. }));
    let queued = submit(&e, prompt(15, 20, vocab), greedy(3));
    assert!(matches!(
        try_submit(&e, prompt(16, 20, vocab), greedy(3)),
        Err(SubmitError::QueueFull(1))
    ));
    rx.recv().unwrap(); // a token
    cancel.store(true, Ordering::Relaxed);
    let o = collect(rx);
    assert_eq!(o.generation.unwrap().stop_reason, StopReason::Interrupted);
    let q = collect(queued);
    assert_eq!(q.tokens.len(), 3);
    let m = e.metrics();
    assert_eq!(m.requests_cancelled.load(Ordering::Relaxed), 1);
    assert_eq!(m.requests_rejected.load(Ordering::Relaxed), 1);
}

#[test]
fn a_client_gone_cancels_and_bad_requests_fail_with_typed_errors() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 1, 4, CacheLimits::default());
    // a sink that goes away after the first token
    let (tx, rx) = channel();
    let mut n = 0;
    e.submit(Job {
        id: "gone".into(),
        prompt: prompt(17, 10, vocab),
        params: greedy(100_000),
        stable_prefix: None,
        cache_prompt: true,
        siblings: Vec::new(),
        events: Box::new(move |ev| {
            n += 1;
            let _ = tx.send(ev);
            n < 2
        }),
    })
    .unwrap();
    drop(rx);
    // the next request runs, so the slot was freed
    let o = collect(submit(&e, prompt(18, 10, vocab), greedy(2)));
    assert_eq!(o.tokens.len(), 2);
    assert_eq!(e.metrics().requests_cancelled.load(Ordering::Relaxed), 1);
    let bad_id = collect(submit(&e, vec![1, vocab as u32], greedy(2)));
    assert!(bad_id.failed.unwrap().contains("out of range"), "token id");
    let mut hot = greedy(2);
    hot.sampling.temperature = -1.0;
    assert!(collect(submit(&e, vec![1, 2], hot))
        .failed
        .unwrap()
        .contains("temperature"));
    let too_long = prompt(19, model.config().max_position_embeddings, vocab);
    assert!(collect(submit(&e, too_long, greedy(2)))
        .failed
        .unwrap()
        .contains("context"));
    assert!(collect(submit(&e, vec![], greedy(2)))
        .failed
        .unwrap()
        .contains("empty"));
}

#[test]
fn shutdown_finishes_within_the_grace_period_and_refuses_new_jobs() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 1, 4, CacheLimits::default());
    let rx = submit(&e, prompt(20, 10, vocab), greedy(100_000));
    assert!(matches!(rx.recv().unwrap(), Event::Started { .. }));
    e.shutdown(Duration::from_millis(50));
    let o = collect(rx);
    assert_eq!(o.generation.unwrap().stop_reason, StopReason::Interrupted);
    assert!(matches!(
        try_submit(&e, vec![1], greedy(1)),
        Err(SubmitError::ShuttingDown)
    ));
}

#[test]
fn shutdown_refuses_queued_jobs_at_once_while_running_ones_finish() {
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    // a pool of its own: on the shared default pool, other tests' loops could hold the scheduler's turns back past
    // the grace period, and the running job would then end (cancelled) before the queued one is refused
    let session = Session::new(
        model.clone(),
        SessionOptions {
            pool: backburner_engine::ComputePool::new(1).unwrap(),
            ..opts()
        },
    )
    .unwrap();
    let e = Arc::new(
        Engine::start(
            vec![session],
            None,
            ServeOptions {
                queue: 4,
                cache: CacheLimits::default(),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let running = submit(&e, prompt(21, 10, vocab), greedy(100_000));
    assert!(matches!(running.recv().unwrap(), Event::Started { .. }));
    let queued = submit(&e, prompt(22, 10, vocab), greedy(4));
    let stopper = {
        let e = e.clone();
        std::thread::spawn(move || e.shutdown(Duration::from_secs(5)))
    };
    // the queued job is refused without running, as a shutdown (not when the slot frees after the grace period)
    let refused = queued.recv_timeout(Duration::from_secs(60));
    assert!(
        matches!(
            refused,
            Ok(Event::Failed(backburner_engine::EngineError::ShuttingDown))
        ),
        "queued job: not refused as a shutdown"
    );
    assert!(
        !running
            .try_iter()
            .any(|ev| matches!(ev, Event::Done { .. } | Event::Failed(_))),
        "the running job ended before the queued one was refused"
    );
    // it then ends on its own: cut by the grace period, or (the tiny model is fast) at the full context first
    let g = collect(running).generation.unwrap();
    let full = 10 + g.tokens.len() >= model.config().max_position_embeddings;
    let want = if full {
        StopReason::ContextFull
    } else {
        StopReason::Interrupted
    };
    assert_eq!(g.stop_reason, want, "{} tokens", g.tokens.len());
    stopper.join().unwrap();
}

#[test]
fn a_running_job_turns_on_a_compute_thread_and_an_idle_scheduler_leaves_the_pool() {
    // While a job runs, the scheduler's turns (prefill chunks, decode steps, the events they send) run on one of the
    // slots' compute threads, so no decode step hands its work to the pool and waits; between jobs the scheduler
    // waits on its own thread.
    let model = load_model("tiny-f32");
    // a pool of one thread: a scheduler that held it while idle would block any other use of it
    let pool = backburner_engine::ComputePool::new(1).unwrap();
    let session = Session::new(
        model.clone(),
        SessionOptions {
            pool: pool.clone(),
            ..opts()
        },
    )
    .unwrap();
    let e = Engine::start(
        vec![session],
        None,
        ServeOptions {
            queue: 4,
            cache: CacheLimits::default(),
            ..Default::default()
        },
    )
    .unwrap();
    let vocab = model.config().vocab_size;
    for seed in [1, 2] {
        let (tx, rx) = channel();
        e.submit(Job {
            id: "t".into(),
            prompt: prompt(seed, 20, vocab),
            params: greedy(6),
            stable_prefix: None,
            cache_prompt: true,
            siblings: Vec::new(),
            events: Box::new(move |ev| {
                let name = std::thread::current().name().unwrap_or("").to_owned();
                tx.send((name, matches!(ev, Event::Done { .. }))).is_ok()
            }),
        })
        .unwrap();
        let mut names = Vec::new();
        while let Ok((name, done)) = rx.recv_timeout(Duration::from_secs(60)) {
            names.push(name);
            if done {
                break;
            }
        }
        // Started (on admission, from the scheduler's thread), 6 tokens, Done
        assert_eq!(names.len(), 8, "job {seed}: {names:?}");
        assert_eq!(names[0], "backburner-scheduler");
        assert!(
            names[1..].iter().all(|n| n.starts_with("bb-compute-")),
            "job {seed}: {names:?}"
        );
        // once idle, the scheduler leaves the pool: other work on it runs (within seconds, not never)
        let (done_tx, done_rx) = channel();
        let p = pool.clone();
        std::thread::spawn(move || done_tx.send(p.install(|| 7)));
        assert_eq!(done_rx.recv_timeout(Duration::from_secs(10)), Ok(7));
    }
}

#[test]
fn the_slot_board_shows_a_running_job_and_then_the_idle_history() {
    use backburner_engine::serve::EngineClient;
    let model = load_model("tiny-f32");
    let vocab = model.config().vocab_size;
    let e = engine(&model, 2, 4, CacheLimits::default());
    assert_eq!(e.slot_states().len(), 2);
    assert!(e
        .slot_states()
        .iter()
        .all(|s| s.task.is_none() && s.n_past == 0));
    // the job's sink holds the scheduler at its third token: the board shows the end of the turn before
    let (reached, at) = channel();
    let (release, gate) = channel::<()>();
    let (tx, rx) = channel();
    let mut tokens = 0;
    e.submit(Job {
        id: "paused".into(),
        prompt: prompt(21, 40, vocab),
        params: greedy(10),
        stable_prefix: None,
        cache_prompt: true,
        siblings: Vec::new(),
        events: Box::new(move |ev| {
            if matches!(ev, Event::Token { .. }) {
                tokens += 1;
                if tokens == 3 {
                    reached.send(()).unwrap();
                    gate.recv_timeout(Duration::from_secs(60)).unwrap();
                }
            }
            tx.send(ev).is_ok()
        }),
    })
    .unwrap();
    at.recv_timeout(Duration::from_secs(60)).unwrap();
    let states = e.slot_states();
    let busy: Vec<_> = states.iter().filter(|s| s.task.is_some()).collect();
    assert_eq!(busy.len(), 1, "{states:?}");
    let t = busy[0].task.as_ref().unwrap();
    assert_eq!(
        (t.id.as_str(), t.prompt_tokens, t.cached_tokens),
        ("paused", 40, 0)
    );
    assert_eq!((t.prompt_done, t.generated, t.max_tokens), (40, 2, 10));
    assert_eq!(busy[0].n_past, 42, "the prompt and the two tokens decoded");
    let slot = busy[0].id;
    assert_eq!(states[1 - slot].n_past, 0);
    release.send(()).unwrap();
    let o = collect(rx);
    assert_eq!(o.tokens.len(), 10);
    // the board is published after the turn that sent `Done`
    let t0 = std::time::Instant::now();
    while e.slot_states()[slot].task.is_some() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the slot never went idle"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let idle = &e.slot_states()[slot];
    assert!((49..=50).contains(&idle.n_past), "{idle:?}");
}
