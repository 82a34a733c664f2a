//! `bench slots` and `bench session` end to end on the tiny fixture with tiny settings: the reports' shape and
//! counts (timings are not checked).

use crate::common;

use std::process::Command;

use common::*;

/// Runs `backburner bench <kind> --model tiny-f32 <extra> --json FILE` and returns the JSON report.
fn bench_json(kind: &str, extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report.json");
    let m = fixture("tiny-f32");
    let o = Command::new(bin())
        .args(["bench", kind, "--model", m.to_str().unwrap(), "--json"])
        .arg(&out)
        .args(extra)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

#[test]
fn bench_slots_reports_each_slot_count() {
    let r = bench_json(
        "slots",
        &[
            "--slots",
            "1,2,4",
            "--steps",
            "2",
            "--rounds",
            "1",
            "--prompt-tokens",
            "8",
            "--threads",
            "1",
        ],
    );
    assert_eq!(r["bench"], "slots");
    let results = r["results"].as_array().unwrap();
    let slots: Vec<u64> = results
        .iter()
        .map(|x| x["slots"].as_u64().unwrap())
        .collect();
    assert_eq!(slots, [1, 2, 4]);
    assert_eq!(results[0]["vs_one_slot"], 1.0);
    for x in results {
        for k in [
            "aggregate_tok_s",
            "ms_per_step",
            "vs_one_slot",
            "sequential_ms_per_step",
            "speedup_vs_sequential",
        ] {
            assert!(x[k].as_f64().unwrap() > 0.0, "{k}: {x}");
        }
    }
}

#[test]
fn bench_session_measures_the_first_turn_in_every_mode() {
    // Turn 0 only: the tiny fixture's 4096-token context holds no more of the transcript.
    let r = bench_json("session", &["--turns", "1", "--answer-tokens", "2"]);
    assert_eq!(r["bench"], "session");
    let turns = r["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 1, "{r}");
    let t = &turns[0];
    let prompt = t["prompt_tokens"].as_u64().unwrap();
    assert!(prompt > 512, "{t}");
    for mode in ["cold", "worker", "warm"] {
        let m = &t[mode];
        assert_eq!(m["prompt_tokens"].as_u64(), Some(prompt), "{mode}: {t}");
        assert_eq!(m["cached_tokens"], 0, "{mode}: {t}");
        let n = m["completion_tokens"].as_u64().unwrap();
        assert!((1..=2).contains(&n), "{mode}: {t}");
        assert!(m["first_answer_s"].as_f64().unwrap() > 0.0, "{mode}: {t}");
    }
    assert!(
        r["worker_stats"]["worker_tokens"].as_u64().unwrap() > 0,
        "{r}"
    );
    assert_eq!(r["totals"]["cold_turns"], 1);
    assert!(r["totals"]["worker_speedup"].is_number(), "{r}");
}
