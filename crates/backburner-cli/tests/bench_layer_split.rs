//! `bench layer-split` end to end on the tiny fixture: one short round of every configuration, real worker
//! processes; the bench itself fails unless every configuration gives the local greedy tokens and prompt logits.

use crate::common;

use std::process::Command;

use common::*;

fn bench(extra: &[&str]) -> std::process::Output {
    let m = fixture("tiny-f32");
    Command::new(bin())
        .args(["bench", "layer-split", "--model", m.to_str().unwrap()])
        .args([
            "--rounds",
            "1",
            "--prompt-tokens",
            "64",
            "--decode-tokens",
            "2",
        ])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn bench_layer_split_reports_every_configuration_with_the_local_tokens() {
    let o = bench(&["--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["bench"], "layer-split");
    assert_eq!(r["tokens"].as_array().unwrap().len(), 3, "{r}");
    let results = r["results"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "local",
            "layer_split",
            "layer_split_shaped",
            "chain",
            "chain_shaped"
        ]
    );
    let workers = |c: &serde_json::Value| c["worker_layers"].clone();
    assert_eq!(workers(&results[1]), serde_json::json!([[4, 8]]));
    assert_eq!(workers(&results[3]), serde_json::json!([[4, 6], [6, 8]]));
    for c in results {
        assert!(c["prefill_tok_s"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["decode_tok_s"].as_f64().unwrap() > 0.0, "{c}");
        for k in ["total", "host", "workers", "link"] {
            assert!(c["decode_ms_per_token"][k].is_number(), "{c}");
        }
        let local = c["config"] == "local";
        assert_eq!(c["bytes_per_decode_token"].as_f64().unwrap() == 0.0, local);
        let expect_host = if local { [0, 8] } else { [0, 4] };
        assert_eq!(c["host_layers"], serde_json::json!(expect_host), "{c}");
    }
    assert_eq!(r["original_reference"]["decode_tok_s"], 3.9);
}

#[test]
fn bench_layer_split_refuses_a_chain_of_one() {
    let o = bench(&["--chain", "4"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("two or more split points"), "{err}");
}

/// Zero to one: with `--no-local` the host loads only its layers, so a `--max-memory` the whole model does not fit
/// still runs the split, and its greedy tokens are the local run's.
#[test]
fn bench_layer_split_no_local_runs_under_a_budget_the_model_does_not_fit() {
    let o = bench(&["--json", "--no-shaped", "--no-chain"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let full: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let whole = full["results"][0]["host_weight_bytes"].as_u64().unwrap();
    let part = full["results"][1]["host_weight_bytes"].as_u64().unwrap();
    assert!(part < whole, "{full}");
    let budget = format!("{}", (whole + part) / 2);
    let refused = bench(&[
        "--json",
        "--no-shaped",
        "--no-chain",
        "--max-memory",
        &budget,
    ]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(1), "{err}");
    assert!(err.contains("--max-memory"), "{err}");
    let o = bench(&[
        "--json",
        "--no-shaped",
        "--no-chain",
        "--no-local",
        "--max-memory",
        &budget,
        "--worker-max-memory",
        &budget,
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 1, "{r}");
    assert_eq!(results[0]["config"], "layer_split");
    assert_eq!(results[0]["host_weight_bytes"].as_u64(), Some(part));
    assert!(results[0]["prefill_vs_local"].is_null(), "{r}");
    assert_eq!(
        r["tokens"], full["tokens"],
        "the split's tokens are local's"
    );
}
