//! `backburner plan` and `backburner calibrate` end to end on the 27B reference config and the tiny fixture.

use crate::common;

use std::process::{Command, Output};

use common::fixture;

fn bb(args: &[&str]) -> Output {
    Command::new(common::bin())
        .args(args)
        .env(
            "BACKBURNER_CACHE",
            std::env::temp_dir().join("backburner-cli-test-cache"),
        )
        .output()
        .expect("run backburner")
}

fn ref27b() -> String {
    fixture("ref-27b-config").to_str().unwrap().to_string()
}

#[test]
fn plan_explains_that_the_27b_does_not_fit_24gb_plus_8gb() {
    let m = ref27b();
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "24GB",
        "--worker-memory",
        "8GB",
    ]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("weights need 53.8 GB; host 24 GB + worker 8 GB = 32 GB: does not fit; with a second worker of 25 GB it fits as layer split: host 0..24, worker 1 24..33, worker 2 33..64"),
        "{err}"
    );
}

#[test]
fn plan_json_of_a_layer_split_holds_the_ranges_and_fits_every_device() {
    let m = ref27b();
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "24GB",
        "--worker-memory",
        "8GB",
        "--worker-memory",
        "26GB",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mode"], "layer_split");
    let range = |d: &serde_json::Value| {
        (
            d["layers"][0].as_u64().unwrap(),
            d["layers"][1].as_u64().unwrap(),
        )
    };
    assert_eq!(range(&v["host"]), (0, 24));
    assert_eq!(range(&v["workers"][0]), (24, 32));
    assert_eq!(range(&v["workers"][1]), (32, 64));
    assert_eq!(v["max_ctx"], 6212);
    for d in std::iter::once(&v["host"]).chain(v["workers"].as_array().unwrap()) {
        let total: u64 = ["weight_bytes", "state_bytes", "kv_bytes", "scratch_bytes"]
            .iter()
            .map(|k| d[k].as_u64().unwrap())
            .sum();
        assert!(total <= d["memory"].as_u64().unwrap(), "{d}");
        // KV for its own attention layers (every 4th) at max_ctx, 4096 bytes per layer and position.
        let (a, b) = range(d);
        let attn = (a..b).filter(|l| (l + 1) % 4 == 0).count() as u64;
        assert_eq!(d["kv_bytes"].as_u64().unwrap(), attn * 4096 * 6212);
    }
    assert_eq!(v["link"]["decode_bytes_per_token"], 2 * 2 * 5120 * 4);
    assert!(v["expected"].is_null());
}

#[test]
fn plan_human_output_and_gib_units() {
    let m = ref27b();
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "64GiB",
        "--worker-memory",
        "8GiB",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    // 64 GiB = 68.7 GB: the weights fit, the 262144-token KV (17.2 GB) does not: KV offload.
    assert!(
        out.starts_with("plan: KV offload: the host holds all 64 layers"),
        "{out}"
    );
    assert!(out.contains("68.7 GB"), "{out}");
    assert!(
        out.contains("context: 262144 tokens, 262144 fit this placement"),
        "{out}"
    );
    let bad = bb(&["plan", "--model", &m, "--host-memory", "24 gigs"]);
    assert!(!bad.status.success());
}

#[test]
fn plan_refuses_a_gguf_without_output_norm_as_run_does() {
    use backburner_model::gguf::writer::GgufWriter;
    use backburner_model::GgufFile;
    let src = GgufFile::open(&fixture("gguf/tiny-q-q4_k.gguf")).unwrap();
    let mut w = GgufWriter::copy_of(&src).unwrap();
    w.remove_tensor("output_norm.weight");
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("no-output-norm.gguf");
    w.write(&p).unwrap();
    let m = p.to_str().unwrap();
    let want = format!("missing tensor \"output_norm.weight\" in checkpoint {m}");
    let plan = bb(&["plan", "-m", m, "--host-memory", "1GB"]);
    assert!(!plan.status.success());
    let err = String::from_utf8_lossy(&plan.stderr);
    assert!(err.contains(&want), "{err}");
    let run = bb(&[
        "run",
        "-m",
        m,
        "--prompt-tokens",
        "1,2",
        "--max-tokens",
        "1",
    ]);
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(err.contains(&want), "{err}");
}

#[test]
fn plan_with_a_calibration_prints_expected_rates() {
    let dir = tempfile::tempdir().unwrap();
    let cal = dir.path().join("cal.json");
    std::fs::write(
        &cal,
        r#"{"version":1,"host":{"threads":8,"prefill_us_per_token_layer":20.0,"decode_us_per_layer":500.0,
            "ends_prefill_us_per_token":10.0,"ends_decode_us":1000.0,"prefill_tokens":512},"workers":[]}"#,
    )
    .unwrap();
    let m = ref27b();
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "64GB",
        "--calibration",
        cal.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["mode"], "local");
    // 64 × 500 µs + 1000 µs per token = 33 ms.
    assert!((v["expected"]["decode_ms"]["host"].as_f64().unwrap() - 33.0).abs() < 1e-9);
    assert!(
        (v["expected"]["prefill_tok_s"].as_f64().unwrap() - 1e6 / (64.0 * 20.0 + 10.0)).abs()
            < 1e-6
    );
}

#[test]
fn calibrate_measures_the_host_a_worker_and_the_link() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("cal.json");
    let m = fixture("tiny-f32");
    let w = common::worker(&[]);
    let args = |worker: &str| {
        let mut v = vec![
            "calibrate".to_string(),
            "--model".into(),
            m.to_str().unwrap().into(),
            "--out".into(),
            out.to_str().unwrap().into(),
            "--threads".into(),
            "1".into(),
            "--ubatch".into(),
            "64".into(),
            "--decode-tokens".into(),
            "4".into(),
        ];
        if !worker.is_empty() {
            v.extend(["--worker".to_string(), worker.to_string()]);
        }
        v
    };
    let run = |a: Vec<String>| bb(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run(args(""));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(v["host"]["prefill_tokens"], 64);
    assert!(v["host"]["decode_us_per_layer"].as_f64().unwrap() > 0.0);
    assert_eq!(v["workers"], serde_json::json!([]));
    assert!(v["link"].is_null());
    let o = run(args(&w.addr));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let wk = &v["workers"][0];
    assert_eq!(wk["threads"], 1);
    assert_eq!(wk["prefill_tokens"], 64);
    for f in ["prefill_us_per_token_layer", "decode_us_per_layer"] {
        assert!(wk[f].as_f64().unwrap() > 0.0, "{f}: {v}");
    }
    assert!(v["link"]["round_trip_us"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["link"]["bytes_per_s"].as_f64().unwrap() > 1e6, "{v}");
    // the calibration gives a layer-split plan its expected rates
    let o = bb(&[
        "plan",
        "--model",
        m.to_str().unwrap(),
        "--host-memory",
        "4MB",
        "--worker-memory",
        "1GB",
        "--ubatch",
        "64",
        "--calibration",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(p["mode"], "layer_split", "{p}");
    assert!(p["expected"]["decode_tok_s"].as_f64().unwrap() > 0.0, "{p}");
    // a worker pinned to other layers (`--layers 2..5`) is timed on those
    let pinned = common::worker(&["--layers", "2..5"]);
    let o = run(args(&pinned.addr));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // an unreachable worker: a clear error
    let o = run(args("127.0.0.1:1"));
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("calibrating worker 127.0.0.1:1")
            && String::from_utf8_lossy(&o.stderr).contains("cannot use worker"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn plan_without_host_memory_takes_this_machines() {
    let tiny = fixture("tiny-hub");
    let o = bb(&["plan", "--model", tiny.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .unwrap()
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    assert_eq!(v["host"]["memory"].as_u64(), Some(kib * 1024));
}
