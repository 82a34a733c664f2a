//! Layers on a device leave the host: `run --device-layers N` (on the device layer's CPU backend, the hidden
//! `--device-cpu-backend`) reports host weights smaller than a run without a device by exactly the placed layers'
//! bytes, the device's beside them, with the same text; and `--max-memory` counts only the host's weights, so a
//! limit below the whole model's weights runs once the layers are on the device.

use std::process::Output;

use backburner_model::Model;

use crate::common::{bb, fixture, stderr};

/// `run` on the tiny fixture: a text prompt, 8 tokens, greedy, plus `extra`.
fn run_tiny(extra: &[&str]) -> Output {
    let m = fixture("tiny-f32");
    let mut a = vec![
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "Hello there",
        "-n",
        "8",
        "--ignore-eos",
    ];
    a.extend_from_slice(extra);
    bb(&a)
}

/// `run --json` with `extra`: its object, the run having succeeded.
fn run_json(extra: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(extra);
    let o = run_tiny(&a);
    assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// The `memory: weights …` line's host figure, in bytes as `memory::human` rounds them (`4.6 MB`).
fn host_figure(e: &str) -> f64 {
    let line = e
        .lines()
        .find_map(|l| l.strip_prefix("memory: weights "))
        .unwrap_or_else(|| panic!("no memory line: {e}"));
    let mut it = line.split([' ', ',']);
    let v: f64 = it.next().unwrap().parse().unwrap();
    let unit = match it.next().unwrap() {
        "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        u => panic!("unit {u} in {line}"),
    };
    v * unit
}

const PLACE: [&str; 5] = [
    "--device",
    "cpu",
    "--device-cpu-backend",
    "--device-layers",
    "5",
];

#[test]
fn run_with_placed_layers_reports_host_weights_without_them_and_the_same_text() {
    let plain = run_json(&[]);
    let placed = run_json(&PLACE);
    assert_eq!(placed["tokens"], plain["tokens"]);
    assert_eq!(placed["text"], plain["text"]);
    let (pm, m) = (&plain["memory"], &placed["memory"]);
    let part = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    // the placed layers' bytes, counted on a model loaded here
    let model = Model::load(&fixture("tiny-f32")).unwrap();
    let layers: u64 = (0..5)
        .map(|i| model.layer(i).unwrap().weight_bytes() as u64)
        .sum();
    assert_eq!(part(pm, "weights"), model.weight_bytes() as u64);
    assert_eq!(part(m, "weights"), part(pm, "weights") - layers);
    assert_eq!(part(pm, "device_weights"), 0);
    assert!(part(m, "device_weights") > 0);
    // the total is the host's
    assert_eq!(
        part(m, "total"),
        part(m, "weights") + part(m, "kv_pages") + part(m, "recurrent_state") + part(m, "scratch")
    );

    // the text report: the host's figure first, smaller, the devices' beside it
    let (a, b) = (run_tiny(&[]), run_tiny(&PLACE));
    assert!(b.status.success(), "{}", stderr(&b));
    assert_eq!(a.stdout, b.stdout);
    let (ea, eb) = (stderr(&a), stderr(&b));
    assert!(host_figure(&eb) < host_figure(&ea), "{ea}\n{eb}");
    assert!(eb.contains(" on devices), kv "), "{eb}");
    assert!(!ea.contains("on devices"), "{ea}");
    assert!(eb.starts_with("layers 0..5 on cpu ("), "{eb}");
}

#[test]
fn max_memory_counts_only_the_weights_the_host_holds() {
    let plain = run_json(&[]);
    let all = plain["memory"]["weights"].as_u64().unwrap();
    let every = [
        "--device",
        "cpu",
        "--device-cpu-backend",
        "--device-layers",
        "8",
    ];
    let placed = run_json(&every);
    let host = placed["memory"]["weights"].as_u64().unwrap();
    let others: u64 = ["kv_pages", "recurrent_state", "scratch"]
        .iter()
        .map(|k| placed["memory"][k].as_u64().unwrap())
        .sum();
    assert!(
        host + 4 * others < all,
        "host {host}, rest {others}, all {all}"
    );
    // a limit below the model's weights: refused on the CPU, a run with every layer on the device
    let limit = (all - 1).to_string();
    let o = run_tiny(&["--json", "--max-memory", &limit]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("weights of layers 0..8 and the ends need"),
        "{}",
        stderr(&o)
    );
    let mut a = vec!["--max-memory", limit.as_str()];
    a.extend_from_slice(&every);
    let v = run_json(&a);
    assert_eq!(v["tokens"], plain["tokens"]);
}
