//! `n` > 1 where the prompt's state cannot be forked between slots because part of it lives on a worker (a layer
//! split): each choice runs as its own job, and choice i still equals a local `n = 1` request seeded `seed + i`.

use crate::common;
use crate::serve_util;

use serde_json::{json, Value};

use common::{fixture, worker_for};
use serve_util::serve;

fn body(n: usize, seed: u64) -> Value {
    let prompt: Vec<u32> = (0..30u32).map(|i| (i * 53 + 7) % 440).collect();
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0.8, "seed": seed, "n": n,
           "return_token_ids": true})
}

fn ids(choice: &Value) -> Value {
    choice["token_ids"].clone()
}

#[test]
fn choices_over_a_layer_split_equal_local_requests_seeded_seed_plus_i() {
    let m = fixture("tiny-hub");
    let local = serve(&m, &[]);
    let want: Vec<Value> = (0..3)
        .map(|i| ids(&local.post_ok("/v1/completions", &body(1, 77 + i))["choices"][0]))
        .collect();
    assert!(
        want.windows(2).any(|w| w[0] != w[1]),
        "the seeds should give different choices"
    );
    drop(local);

    let w = worker_for(&m, &[], &[]);
    for parallel in ["1", "3"] {
        let s = serve(
            &m,
            &[
                "--worker",
                &w.addr,
                "--layer-split",
                "4",
                "--parallel",
                parallel,
            ],
        );
        let got = s.post_ok("/v1/completions", &body(3, 77));
        let choices = got["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 3);
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i);
            assert_eq!(ids(c), want[i], "choice {i} with --parallel {parallel}");
        }
        assert_eq!(got["usage"]["prompt_tokens"], 30);
        let completion: u64 = choices
            .iter()
            .map(|c| c["token_ids"].as_array().unwrap().len() as u64)
            .sum();
        assert_eq!(got["usage"]["completion_tokens"], completion);
    }
}
