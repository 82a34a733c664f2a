//! Penalties, `logit_bias`, log-probabilities and seeded sampling act on the logits after the model, so every
//! placement gives the local run's tokens and log-probabilities bit for bit: split prefill, KV offload (packed
//! pages) and layer split, each against a local session on the same synthetic checkpoint.

use crate::worker_common;

use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::offload::KvBudget;
use backburner_engine::{
    generate, GenerateParams, Generation, SamplingParams, Session, SessionOptions, WorkerSettings,
};
use backburner_model::{Checkpoint, LoadOptions, Model, ModelConfig};
use worker_common::*;

fn params(first: u32) -> GenerateParams {
    GenerateParams {
        max_tokens: 24,
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 7,
            top_k: 40,
            presence_penalty: 0.5,
            frequency_penalty: 0.7,
            repetition_penalty: 1.3,
            logit_bias: vec![(first, -5.0), (3, 2.0)],
            ..Default::default()
        },
        logprobs: Some(4),
        ..Default::default()
    }
}

fn gen(s: &mut Session, p: &[u32], params: &GenerateParams) -> Generation {
    generate(s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
}

/// A token's id, log-probability bits and alternatives (id, bits).
type LogprobBits = (u32, u32, Vec<(u32, u32)>);

/// Tokens and log-probabilities (as bits) of a generation.
fn key(g: &Generation) -> (Vec<u32>, Vec<LogprobBits>) {
    let lps = g
        .logprobs
        .iter()
        .map(|t| {
            (
                t.id,
                t.logprob.to_bits(),
                t.top.iter().map(|&(i, v)| (i, v.to_bits())).collect(),
            )
        })
        .collect();
    (g.tokens.clone(), lps)
}

#[test]
fn every_placement_gives_the_local_adjusted_tokens_and_logprobs() {
    let f = model_with_layers(8, 61);
    let p = prompt(7 * 64 + 5, 9);
    let mut plain = Session::new(f.model.clone(), opts()).unwrap();
    let first = gen(
        &mut plain,
        &p,
        &GenerateParams {
            max_tokens: 1,
            ..Default::default()
        },
    )
    .tokens[0];
    let params = params(first);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = key(&gen(&mut local, &p, &params));
    assert_eq!(want.0.len(), 24);
    assert_ne!(want.0[0], first, "the bias moved the first token");

    // split prefill
    let w = start_worker(f.dir.path(), None, None);
    let mut split = Session::new(f.model.clone(), opts()).unwrap();
    split.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert_eq!(key(&gen(&mut split, &p, &params)), want, "split prefill");
    assert!(split.link_stats().worker_tokens > 0);

    // KV offload with packed pages
    let w2 = start_worker_with(f.dir.path(), |o| o.pack_pages = true);
    let o = SessionOptions {
        kv_budget: Some(KvBudget::Positions(128)),
        ..opts()
    };
    let mut off = Session::new(f.model.clone(), o).unwrap();
    off.attach_worker(client(f.dir.path(), &w2.addr, Some(4), b""));
    assert_eq!(key(&gen(&mut off, &p, &params)), want, "KV offload");
    assert!(off.link_stats().pages_on_workers > 0);

    // layer split: host layers 0..4, worker 4..8
    let cfg = ModelConfig::from_dir(f.dir.path()).unwrap();
    let host = Arc::new(
        Model::from_checkpoint(
            cfg,
            &Checkpoint::open(f.dir.path()).unwrap(),
            &LoadOptions {
                layers: 0..4,
                ends: true,
            },
            |_, _| {},
        )
        .unwrap(),
    );
    let w3 = start_worker(f.dir.path(), None, None);
    let mut s = WorkerSettings::new(&w3.addr, 1);
    s.timeout = Duration::from_secs(5);
    let conn = Connection::new(
        s,
        backburner_engine::split::dir_fingerprint(f.dir.path().to_path_buf()),
    );
    let chain = LayerSplit::from_parts(host.config(), vec![(conn, 4..8)]).unwrap();
    let mut ls = Session::with_layer_split(host, opts(), chain).unwrap();
    assert_eq!(key(&gen(&mut ls, &p, &params)), want, "layer split");
}
