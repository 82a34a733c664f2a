//! llama-server's `GET /slots` on the real engine: idle slots; a running request (held at its third token, so the
//! values are exact) with its id, prompt and tokens generated; `?fail_on_no_slot`; the API key; `--no-slots`.

use crate::common;

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use backburner_engine::serve::{Engine, EngineClient, Event, Job, Metrics, SubmitError};
use common::*;
use serde_json::{json, Value};

/// The real engine, whose first job's event sink holds the scheduler's thread at the job's third token until
/// [`Held::release`]: what the scheduler published stays as it was after the turn before.
struct Held {
    engine: Arc<Engine>,
    /// Told the held job's id when it is held.
    reached: Mutex<Option<Sender<String>>>,
    gate: Mutex<Option<Receiver<()>>>,
    release: Mutex<Option<Sender<()>>>,
}

impl Held {
    fn new(engine: Arc<Engine>) -> (Arc<Held>, Receiver<String>) {
        let (reached, at) = channel();
        let (release, gate) = channel();
        let h = Held {
            engine,
            reached: Mutex::new(Some(reached)),
            gate: Mutex::new(Some(gate)),
            release: Mutex::new(Some(release)),
        };
        (Arc::new(h), at)
    }

    fn release(&self) {
        let _ = self.release.lock().unwrap().take().map(|r| r.send(()));
    }
}

impl EngineClient for Held {
    fn submit(&self, mut job: Job) -> Result<(), SubmitError> {
        if let (Some(reached), Some(gate)) = (
            self.reached.lock().unwrap().take(),
            self.gate.lock().unwrap().take(),
        ) {
            let (id, mut inner, mut tokens) = (job.id.clone(), job.events, 0);
            job.events = Box::new(move |ev| {
                if matches!(ev, Event::Token { .. }) {
                    tokens += 1;
                    if tokens == 3 {
                        reached.send(id.clone()).unwrap();
                        gate.recv_timeout(LIMIT).expect("released");
                    }
                }
                inner(ev)
            });
        }
        self.engine.submit(job)
    }

    fn metrics(&self) -> &Metrics {
        self.engine.metrics()
    }

    fn slots(&self) -> usize {
        self.engine.slots()
    }

    fn shutdown(&self, grace: Duration) {
        self.release();
        EngineClient::shutdown(&*self.engine, grace)
    }
}

const CONTEXT: usize = 512;

async fn held_server(api_key: Option<&'static str>) -> (Server, Arc<Held>, Receiver<String>) {
    let (held, at) = Held::new(engine(2, 4, Some(CONTEXT)));
    let mut s = Server::start(
        state(held.clone(), CONTEXT, api_key),
        Duration::from_secs(5),
    )
    .await;
    s.key = api_key.map(str::to_string);
    (s, held, at)
}

fn idle(slot: &Value) {
    assert_eq!(slot["is_processing"], false, "{slot}");
    assert_eq!(slot["id_task"], -1, "{slot}");
    assert_eq!(slot["id_request"], Value::Null, "{slot}");
    assert_eq!(slot["choice"], Value::Null, "{slot}");
    assert_eq!(slot["n_ctx"], CONTEXT, "{slot}");
    assert_eq!(slot["next_token"]["has_next_token"], false, "{slot}");
    assert_eq!(slot["n_prompt_tokens"], 0, "{slot}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_show_a_running_request_then_idle_slots_holding_its_history() {
    let (s, held, at) = held_server(None).await;
    let before = s.get("/slots").await.ok();
    let list = before.as_array().expect("an array");
    assert_eq!(list.len(), 2);
    for (i, slot) in list.iter().enumerate() {
        assert_eq!(slot["id"], i);
        assert_eq!(slot["speculative"], false);
        assert_eq!(slot["n_past"], 0);
        idle(slot);
    }
    // eos banned: the request runs to its 6 tokens
    let body = json!({"messages": [{"role": "user", "content": "Count slowly"}], "max_tokens": 6,
                      "temperature": 0, "logit_bias": {"445": -100, "447": -100}, "stream": true,
                      "stream_options": {"include_usage": true}});
    let client = (s.client.clone(), s.url("/v1/chat/completions"));
    let req = tokio::spawn(async move {
        let r = client.0.post(client.1).json(&body).send().await.unwrap();
        let mut rd = SseReader::new(r);
        let mut chunks = Vec::new();
        while let Some(d) = rd.next().await {
            if d != "[DONE]" {
                chunks.push(serde_json::from_str::<Value>(&d).unwrap());
            }
        }
        chunks
    });
    let wait = tokio::task::spawn_blocking(move || at.recv_timeout(LIMIT).expect("held"));
    let id = bounded("the third token", wait).await.unwrap();
    let during = s.get("/slots").await.ok();
    let busy: Vec<&Value> = during
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["is_processing"] == true)
        .collect();
    assert_eq!(busy.len(), 1, "{during}");
    let slot = busy[0];
    assert_eq!(slot["id_request"], id.as_str());
    assert_eq!(slot["choice"], 0);
    assert_eq!(slot["id_task"], 0, "the first task: {slot}");
    let prompt = slot["n_prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 5, "{slot}");
    assert_eq!(slot["n_prompt_tokens_cache"], 0, "{slot}");
    assert_eq!(slot["n_prompt_tokens_processed"], prompt, "{slot}");
    // the turn before the third token sampled and decoded two
    assert_eq!(
        slot["next_token"],
        json!({"has_next_token": true, "n_decoded": 2, "n_remain": 4})
    );
    assert_eq!(slot["n_past"], prompt + 2, "{slot}");
    let other = &during[1 - slot["id"].as_u64().unwrap() as usize];
    idle(other);
    assert_eq!(other["n_past"], 0);
    // one slot is idle: `fail_on_no_slot` still answers
    assert_eq!(s.get("/slots?fail_on_no_slot=1").await.status, 200);
    held.release();
    let chunks = bounded("the stream", req).await.unwrap();
    assert_eq!(
        chunks[0]["id"],
        id.as_str(),
        "the slot showed the response's id"
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], prompt);
    assert_eq!(usage["completion_tokens"], 6);
    // published after the turn that ended it: the slot is idle and holds the prompt and the tokens decoded
    let t0 = Instant::now();
    let after = loop {
        let v = s.get("/slots").await.ok();
        if v.as_array()
            .unwrap()
            .iter()
            .all(|x| x["is_processing"] == false)
        {
            break v;
        }
        assert!(t0.elapsed() < LIMIT, "the slot never went idle: {v}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let slot = &after[slot["id"].as_u64().unwrap() as usize];
    idle(slot);
    let past = slot["n_past"].as_u64().unwrap();
    assert!((prompt + 5..=prompt + 6).contains(&past), "{slot}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_choices_of_an_n_request_each_show_in_their_slot_and_fill_them() {
    let (s, held, at) = held_server(None).await;
    // two choices on two slots, held at choice 0's third token: choice 1 was forked when the prompt's prefill ended
    // and decoded beside it
    let body = json!({"prompt": "Count slowly", "max_tokens": 6, "n": 2, "temperature": 0,
                      "logit_bias": {"445": -100, "447": -100}});
    let (c, url) = (s.client.clone(), s.url("/v1/completions"));
    let req = tokio::spawn(async move {
        let r = c.post(url).json(&body).send().await.unwrap();
        (r.status(), r.json::<Value>().await.unwrap())
    });
    let wait = tokio::task::spawn_blocking(move || at.recv_timeout(LIMIT).expect("held"));
    let id = bounded("the third token", wait).await.unwrap();
    let during = s.get("/slots").await.ok();
    let list = during.as_array().unwrap();
    let prompt = list[0]["n_prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 1, "{during}");
    let mut choices = Vec::new();
    let mut tasks = Vec::new();
    for slot in list {
        assert_eq!(slot["is_processing"], true, "{during}");
        assert_eq!(slot["id_request"], id.as_str(), "{during}");
        assert_eq!(slot["n_prompt_tokens"], prompt, "{during}");
        assert_eq!(slot["n_prompt_tokens_processed"], prompt, "{during}");
        assert_eq!(
            slot["next_token"],
            json!({"has_next_token": true, "n_decoded": 2, "n_remain": 4}),
            "{during}"
        );
        assert_eq!(slot["n_past"], prompt + 2, "{during}");
        choices.push(slot["choice"].as_u64().unwrap());
        tasks.push(slot["id_task"].as_u64().expect("an integer task id"));
        // choice 0 prefilled the prompt; choice 1 started from its state
        let cached = if slot["choice"] == 0 { 0 } else { prompt };
        assert_eq!(slot["n_prompt_tokens_cache"], cached, "{during}");
    }
    choices.sort_unstable();
    tasks.sort_unstable();
    assert_eq!(choices, [0, 1]);
    assert_eq!(tasks, [0, 1], "one task per choice, numbered from 0");
    // no slot is free
    let (_, _, code, _) = s.get("/slots?fail_on_no_slot=1").await.error(503);
    assert_eq!(code.as_deref(), Some("server_busy"));
    let h = s.get("/health").await.ok();
    assert_eq!(
        (&h["slots_busy"], &h["queue_depth"]),
        (&json!(2), &json!(0))
    );
    held.release();
    let (status, r) = bounded("the request", req).await.unwrap();
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["id"], id.as_str());
    assert_eq!(r["usage"]["completion_tokens"], 12);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_on_no_slot_is_503_when_every_slot_is_busy() {
    let (held, at) = Held::new(engine(1, 4, Some(CONTEXT)));
    let s = Server::start(state(held.clone(), CONTEXT, None), Duration::from_secs(5)).await;
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                      "logit_bias": {"445": -100, "447": -100}});
    let (c, url) = (s.client.clone(), s.url("/v1/chat/completions"));
    let req = tokio::spawn(async move { c.post(url).json(&body).send().await.unwrap().status() });
    let wait = tokio::task::spawn_blocking(move || at.recv_timeout(LIMIT).expect("held"));
    bounded("the third token", wait).await.unwrap();
    let r = s.get("/slots?fail_on_no_slot=1").await;
    let (kind, _, code, _) = r.error(503);
    assert_eq!(
        (kind.as_str(), code.as_deref()),
        ("server_error", Some("server_busy"))
    );
    assert_eq!(s.get("/slots?fail_on_no_slot=0").await.status, 200);
    held.release();
    assert_eq!(bounded("the request", req).await.unwrap(), 200);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_need_the_key_and_no_slots_turns_them_off() {
    let (mut s, _held, _at) = held_server(Some("k")).await;
    assert_eq!(s.get("/slots").await.ok().as_array().unwrap().len(), 2);
    s.key = None;
    let (_, _, code, _) = s.get("/slots").await.error(401);
    assert_eq!(code.as_deref(), Some("invalid_api_key"));
    s.stop().await;

    let mut st = state(engine(1, 4, Some(CONTEXT)), CONTEXT, None);
    st.slots_endpoint = false;
    let s = Server::start(st, Duration::from_secs(5)).await;
    let (kind, _, code, _) = s.get("/slots").await.error(501);
    assert_eq!(
        (kind.as_str(), code.as_deref()),
        ("not_supported_error", Some("not_supported"))
    );
    s.stop().await;
}
