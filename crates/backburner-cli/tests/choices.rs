//! `run --n-choices N`: the prompt prefilled once, choice i exactly `run --seed <s + i>` (tokens and text), printed
//! labelled; with greedy sampling every choice is the same.

use std::process::Command;

use crate::common::*;

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "run failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("one JSON object")
}

#[test]
fn choice_i_is_run_with_seed_plus_i() {
    let all = json(&run_tiny(&[
        "--temp",
        "0.9",
        "--seed",
        "40",
        "--n-choices",
        "3",
    ]));
    let choices = all["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    let mut singles = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        let seed = (40 + i).to_string();
        let one = json(&run_tiny(&["--temp", "0.9", "--seed", &seed]));
        assert_eq!(c["index"], i);
        assert_eq!(c["seed"], 40 + i);
        assert_eq!(c["tokens"], one["tokens"], "choice {i}");
        assert_eq!(c["text"], one["text"], "choice {i}");
        assert_eq!(c["stop_reason"], one["stop_reason"]);
        assert_eq!(one["tokens"].as_array().unwrap().len(), 12);
        singles.push(one);
    }
    assert!(
        singles.iter().any(|o| o["tokens"] != singles[0]["tokens"]),
        "the seeds give different sequences"
    );
    // greedy: all the same
    let g = json(&run_tiny(&["--n-choices", "2"]));
    assert_eq!(g["choices"][0]["tokens"], g["choices"][1]["tokens"]);

    // text: each choice after its label, the texts of the single runs
    let m = fixture("tiny-f32");
    let o = Command::new(bin())
        .args(["run", "--model", m.to_str().unwrap(), "--prompt-file"])
        .arg(m.join("prompt.txt"))
        .args([
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--ubatch",
            "64",
            "--threads",
            "1",
        ])
        .args(["--temp", "0.9", "--seed", "40", "--n-choices", "3"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut want = String::new();
    for (i, one) in singles.iter().enumerate() {
        want += &format!("[choice {i}]\n{}\n", one["text"].as_str().unwrap());
    }
    assert_eq!(String::from_utf8_lossy(&o.stdout), want);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("prefilled once") && err.contains("3 choices"),
        "{err}"
    );
}

#[test]
fn n_choices_is_bounded() {
    for bad in ["0", "17"] {
        let o = run_tiny(&["--n-choices", bad]);
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("--n-choices"),
            "{}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

/// `--n-choices` with `--spec ngram`: every choice the plain run's, each with its draft counts, and the stats line
/// sums them.
#[test]
fn speculating_choices_are_the_plain_choices_with_their_draft_counts() {
    let flags = ["--temp", "0.9", "--seed", "7", "--n-choices", "2"];
    let plain = json(&run_tiny(&flags));
    let spec_flags = ["--spec", "ngram", "--ngram-min", "1", "--ngram-max", "2"];
    let spec = json(&run_tiny(&[&flags[..], &spec_flags].concat()));
    let mut drafted = 0;
    for i in 0..2 {
        let (p, s) = (&plain["choices"][i], &spec["choices"][i]);
        assert_eq!(s["tokens"], p["tokens"], "choice {i}");
        assert!(p.get("speculative").is_none());
        drafted += s["speculative"]["drafted"].as_u64().unwrap();
    }
    assert!(drafted > 0, "{spec}");
    let m = fixture("tiny-f32");
    let o = Command::new(bin())
        .args(["run", "--model", m.to_str().unwrap(), "--prompt-file"])
        .arg(m.join("prompt.txt"))
        .args(["--max-tokens", "12", "--ignore-eos", "--threads", "1"])
        .args(flags)
        .args(spec_flags)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("| drafts ") && err.contains(&format!(" of {drafted} in ")),
        "{err}"
    );
}
