//! `bench spec` end to end on the tiny fixture with tiny settings: the report's shape and counts, the verify rows
//! equal to decode steps bit for bit and every speculative run's tokens equal to the plain run's (the bench itself
//! fails otherwise); timings are not checked.

use crate::common;

use std::process::Command;

use common::*;

#[test]
fn bench_spec_reports_verify_costs_and_tokens_equal_to_plain_decoding() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("report.json");
    let m = fixture("tiny-f32");
    let o = Command::new(bin())
        .args(["bench", "spec", "--model", m.to_str().unwrap(), "--json"])
        .arg(&out)
        .args([
            "--threads",
            "1",
            "--depth",
            "16",
            "--max-k",
            "3",
            "--gen-tokens",
            "12",
            "--rounds",
            "1",
            "--error-rates",
            "0,0.2,1",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(r["bench"], "spec");
    assert_eq!(r["depth"], 16);
    assert_eq!(r["verify"]["bit_equal"], true);
    let rows = r["verify"]["rows"].as_array().unwrap();
    let ts: Vec<u64> = rows.iter().map(|x| x["t"].as_u64().unwrap()).collect();
    assert_eq!(ts, [1, 2, 3, 4]);
    for x in rows {
        for k in ["verify_ms", "decodes_ms", "v", "verify_over_decodes"] {
            assert!(x[k].as_f64().unwrap() > 0.0, "{x}");
        }
        let t = x["t"].as_u64().unwrap();
        assert_eq!(x["rollback_to_1_ms"].is_number(), t >= 2, "{x}");
        assert_eq!(x["rollback_to_t_minus_1_ms"].is_number(), t >= 3, "{x}");
    }
    let cost = &r["cost_model"];
    assert_eq!(cost["v"].as_array().unwrap().len(), 4);
    assert_eq!(cost["v"][0], 1.0);
    assert_eq!(cost["predictions"].as_array().unwrap().len(), 9);

    let g = &r["generate"];
    assert_eq!(g["tokens_match"], true);
    assert_eq!(g["plain_tokens"].as_array().unwrap().len(), 12);
    let gen = g["rows"].as_array().unwrap();
    let modes: Vec<(f64, &str)> = gen
        .iter()
        .map(|x| {
            (
                x["error_rate"].as_f64().unwrap(),
                x["mode"].as_str().unwrap(),
            )
        })
        .collect();
    let mut want = Vec::new();
    for rate in [0.0, 0.2, 1.0] {
        for mode in ["fixed", "adaptive", "adaptive_measured"] {
            want.push((rate, mode));
        }
    }
    assert_eq!(modes, want);
    for x in gen {
        assert_eq!(x["tokens_match"], true, "{x}");
        assert!(x["plain_tok_s"].as_f64().unwrap() > 0.0, "{x}");
        assert!(x["spec_tok_s"].as_f64().unwrap() > 0.0, "{x}");
        let c = &x["counts"];
        let (drafted, accepted) = (
            c["drafted"].as_u64().unwrap(),
            c["accepted"].as_u64().unwrap(),
        );
        assert!(accepted <= drafted, "{x}");
        let (rate, mode) = (
            x["error_rate"].as_f64().unwrap(),
            x["mode"].as_str().unwrap(),
        );
        if rate == 0.0 && mode == "fixed" {
            // every draft right: k = 3 from the first step, all kept, the last step within max_tokens
            assert!(drafted > 0 && accepted == drafted, "{x}");
            assert_eq!(c["steps"], 3, "{x}"); // 11 tokens after the first: 4 + 4 + 3
        } else if rate == 1.0 {
            // every draft wrong: nothing kept
            assert_eq!(accepted, 0, "{x}");
        }
    }
    assert!(g["targets"].is_object());
}

#[test]
fn bench_spec_refuses_bad_settings() {
    let m = fixture("tiny-f32");
    for bad in [
        ["--error-rates", "1.5"],
        ["--fixed-k", "0"],
        ["--depth", "1"],
    ] {
        let o = Command::new(bin())
            .args(["bench", "spec", "--model", m.to_str().unwrap()])
            .args(bad)
            .output()
            .unwrap();
        assert_eq!(
            o.status.code(),
            Some(1),
            "{bad:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}
