//! `n` > 1 with workers, in every mode: split prefill (the state stays on the host, so choices fork it), KV offload
//! and layer split (part of the state lives on a worker: each choice runs as its own job). In each, choice i equals
//! a local `n = 1` request seeded `seed + i` with the same ubatch and page size, token for token, with 1 and 3 slots.

use crate::common;
use crate::serve_util;

use serde_json::{json, Value};

use common::{fixture, worker_for};
use serve_util::serve;

/// A 200-token prompt: past a 128-position KV budget, and 25 ubatches of 8.
fn body(n: usize, seed: u64) -> Value {
    let prompt: Vec<u32> = (0..200u32).map(|i| (i * 53 + 7) % 440).collect();
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": seed, "n": n,
           "return_token_ids": true, "cache_prompt": false})
}

fn ids(choice: &Value) -> Value {
    choice["token_ids"].clone()
}

#[test]
fn choices_with_workers_equal_local_requests_seeded_seed_plus_i_in_every_mode() {
    let m = fixture("tiny-hub");
    let w = worker_for(&m, &[], &[]);
    // (mode, the flags the local reference shares, the worker's flags)
    let modes: [(&str, Vec<&str>, Vec<&str>); 3] = [
        (
            "split prefill",
            vec!["--ubatch", "8"],
            vec!["--worker", &w.addr, "--split-min-tokens", "16"],
        ),
        (
            "KV offload",
            vec!["--ubatch", "64", "--kv-page-size", "64"],
            vec!["--worker", &w.addr, "--kv-budget", "128"],
        ),
        (
            "layer split",
            vec![],
            vec!["--worker", &w.addr, "--layer-split", "4"],
        ),
    ];
    for (mode, shared, workers) in &modes {
        let local = serve(&m, shared);
        let want: Vec<Value> = (0..3)
            .map(|i| ids(&local.post_ok("/v1/completions", &body(1, 77 + i))["choices"][0]))
            .collect();
        assert!(
            want.windows(2).any(|w| w[0] != w[1]),
            "{mode}: the seeds should give different choices"
        );
        drop(local);
        for parallel in ["1", "3"] {
            let flags = [&shared[..], &workers[..], &["--parallel", parallel]].concat();
            let s = serve(&m, &flags);
            let got = s.post_ok("/v1/completions", &body(3, 77));
            let choices = got["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 3);
            for (i, c) in choices.iter().enumerate() {
                assert_eq!(c["index"], i);
                assert_eq!(
                    ids(c),
                    want[i],
                    "{mode}: choice {i} with --parallel {parallel}"
                );
            }
            assert_eq!(got["usage"]["prompt_tokens"], 200);
            let completion: u64 = choices
                .iter()
                .map(|c| c["token_ids"].as_array().unwrap().len() as u64)
                .sum();
            assert_eq!(got["usage"]["completion_tokens"], completion);
            match *mode {
                "split prefill" => assert!(s.metric("split_prefill_calls_total") >= 1.0, "{mode}"),
                "KV offload" => assert!(s.metric("kv_pages_on_workers") > 0.0, "{mode}"),
                _ => assert!(s.metric("worker_tokens_total") > 0.0, "{mode}"),
            }
        }
    }
}
