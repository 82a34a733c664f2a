//! Speculation with workers attached: split prefill (the prompt through the worker, then verify steps here) and KV
//! offload (verify steps before and after the budget is crossed, the later ones attending through the worker's
//! pages) give the local plain run's tokens and logits, bit for bit (a layer split: `layer_split.rs`,
//! `speculative_chain.rs`).

use crate::worker_common;

use backburner_engine::offload::KvBudget;
use backburner_engine::spec::{SpecParams, SpecSource};
use backburner_engine::{generate, GenerateParams, Generation, Session, SessionOptions};
use worker_common::*;

fn params(spec: Option<SpecParams>) -> GenerateParams {
    GenerateParams {
        max_tokens: 40,
        keep_logits: true,
        spec,
        ..GenerateParams::default()
    }
}

fn scripted(script: Vec<u32>) -> SpecParams {
    SpecParams {
        source: SpecSource::Scripted {
            script,
            error_rate: 0.25,
            seed: 9,
        },
        draft_max: 4,
        fixed: true,
        cost: None,
    }
}

fn gen(s: &mut Session, p: &[u32], params: &GenerateParams) -> Generation {
    generate(s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

fn same(got: &Generation, want: &Generation, what: &str) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens");
    assert!(
        bits(&got.step_logits) == bits(&want.step_logits),
        "{what}: logits"
    );
}

#[test]
fn speculation_with_workers_gives_the_local_plain_bits() {
    let f = model_with_layers(8, 21);
    let w = start_worker(f.dir.path(), None, None);
    let p = prompt(3 * 64 + 40, 5);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = gen(&mut local, &p, &params(None));
    let script: Vec<u32> = p.iter().chain(&want.tokens).copied().collect();
    let spec = params(Some(scripted(script)));

    // split prefill: the prompt goes through the worker, decode verifies here
    let mut split = Session::new(f.model.clone(), opts()).unwrap();
    split.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    let got = gen(&mut split, &p, &spec);
    same(&got, &want, "split prefill");
    assert!(
        split.link_stats().worker_tokens > 0,
        "the prompt went through the worker"
    );
    let c = got.speculative.unwrap();
    assert!(c.accepted > 0 && c.accepted < c.drafted, "{c:?}");

    // KV offload: a budget of 4 pages; the prompt fits, the generation crosses it
    let budgeted = SessionOptions {
        kv_budget: Some(KvBudget::Positions(4 * 64)),
        ..opts()
    };
    let mut off = Session::new(f.model.clone(), budgeted).unwrap();
    off.attach_worker(client(f.dir.path(), &w.addr, None, b""));
    let got = gen(&mut off, &p, &spec);
    same(&got, &want, "KV offload");
    assert!(off.state().offloaded() > 0, "pages moved to the worker");
    assert!(got.speculative.unwrap().accepted > 0, "verify steps ran");
}
