//! Experts on a worker at its limits (found by an adversarial run): an experts session answers nothing but
//! `Experts` and `Ping` and takes any KV page size; its work is counted against the worker's budget; idle layers of
//! an earlier layer-split host give their memory back to a later experts host.

use crate::cache_modes::layer_split_session;
use crate::worker_common::*;

use std::time::Duration;

use backburner_engine::connection::{Connection, SessionShape};
use backburner_engine::experts::{ExpertHolder, LinkExperts};
use backburner_engine::{Logits, WorkerSettings};
use backburner_kernels::kv::KvDtype;
use backburner_link::frame::Kind;
use backburner_link::message::RunLayers;
use backburner_link::{Conn, ErrorCode, LinkError};
use backburner_model::{Checkpoint, ModelConfig, RemoteExperts};

fn experts_session(dir: &std::path::Path, addr: &str) -> Conn {
    raw_session(dir, addr, 100, (0..8).collect())
}

fn holder(dir: &std::path::Path, addr: &str, layers: std::ops::Range<usize>) -> LinkExperts {
    let mut st = WorkerSettings::new(addr, 1);
    st.timeout = Duration::from_secs(20);
    let fp = backburner_engine::split::dir_fingerprint(dir.to_path_buf());
    let h = ExpertHolder::new(Connection::new(st, fp), layers, (0..8).collect());
    let shape = SessionShape {
        kv: KvDtype::F16,
        page: 64,
        ubatch: 16,
    };
    LinkExperts::new(ModelConfig::from_dir(dir).unwrap(), shape, vec![h])
}

#[test]
fn an_experts_session_refuses_other_requests_and_takes_any_page_size() {
    let f = moe_with_layers(8, 91);
    let w = start_worker(f.dir.path(), None, None);
    let mut c = experts_session(f.dir.path(), &w.addr);
    c.writer
        .send(Kind::Ping, &backburner_link::message::Empty {}, b"hi")
        .unwrap();
    assert_eq!(c.reader.recv().unwrap().kind(), Kind::Pong);
    let r = RunLayers {
        pos: 0,
        n_tokens: 1,
        keep: vec![],
        verify: false,
    };
    c.writer
        .send(Kind::RunLayers, &r, &vec![0; 64 * 4])
        .unwrap();
    match c.reader.recv() {
        Err(LinkError::Remote { code, message }) => {
            assert_eq!(code, ErrorCode::BadState, "{message}");
            assert!(message.contains("only Experts"), "{message}");
        }
        other => panic!("expected BadState, got {other:?}"),
    }
}

#[test]
fn an_experts_request_whose_work_does_not_fit_the_budget_is_refused_with_out_of_memory() {
    let f = moe_with_layers(8, 92);
    let c = ModelConfig::from_dir(f.dir.path()).unwrap();
    let ck = Checkpoint::open(f.dir.path()).unwrap();
    let all: Vec<usize> = (0..8).collect();
    let weights = backburner_model::experts_bytes(&ck, &c, 4..8, &all).unwrap();
    // room for a short prompt's work, not for a 300-token ubatch's (300 tokens × 2 pairs × ~1.2 KB, and its answer)
    let w = start_worker_with(f.dir.path(), |o| o.max_memory = weights + (256 << 10));
    let (host, _) =
        crate::experts_remote::expert_host(f.dir.path(), &[(w.addr.as_str(), 4..8, all)]);
    let mut o = opts();
    o.ubatch = 300;
    let mut s = backburner_engine::Session::new(host, o).unwrap();
    s.prefill(&prompt(8, 1), Logits::Last, |_, _| {}).unwrap();
    let e = s
        .prefill(&prompt(300, 2), Logits::Last, |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("OutOfMemory"), "{e}");
}

#[test]
fn idle_layers_of_an_earlier_host_give_their_memory_to_an_experts_host() {
    let f = moe_with_layers(8, 93);
    let c = ModelConfig::from_dir(f.dir.path()).unwrap();
    let ck = Checkpoint::open(f.dir.path()).unwrap();
    let experts =
        backburner_model::experts_bytes(&ck, &c, 4..8, &(0..8).collect::<Vec<_>>()).unwrap();
    let layers = tail_weights(f.dir.path(), 4);
    // the budget holds the layers 4..8 (with a session's state) or their experts, not both
    let w = start_worker_with(f.dir.path(), |o| o.max_memory = layers + experts / 2);
    let mut ls = layer_split_session(f.dir.path(), &[(&w.addr, 4..8)]);
    ls.prefill(&prompt(20, 3), Logits::Last, |_, _| {}).unwrap();
    drop(ls);
    // the worker notices the host is gone, then the experts host gets the memory
    let rx = holder(f.dir.path(), &w.addr, 4..8);
    let mut last = Ok(());
    for _ in 0..40 {
        last = rx.connect_all();
        if last.is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
        RemoteExperts::retry_now(&rx);
    }
    last.unwrap();
}
