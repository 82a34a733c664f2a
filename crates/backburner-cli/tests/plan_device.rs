//! `backburner plan --device`: the commands it prints pass the CLI's parser and refusals, a host with less memory
//! than the weights gets a plan beside a device (the host holding only the CPU layers' weights and the ends), and a
//! plan that does not fit suggests what a device accepts, on the 27B reference config.

use std::process::{Command, Output};

use crate::common::{self, fixture};

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

/// `plan --model <27B config> --ctx 8192 --device cuda:0 …` plus `extra`, as JSON.
fn device_plan(extra: &[&str]) -> serde_json::Value {
    let m = ref27b();
    let mut a = vec!["plan", "--model", &m, "--json", "--device", "cuda:0"];
    a.extend_from_slice(extra);
    let o = bb(&a);
    assert!(
        o.status.success(),
        "{extra:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Runs a command `plan` printed (its workers' placeholders given loopback addresses): on this build without a
/// CUDA backend it must get past the parser and every refusal and stop at opening the device.
fn run_printed(command: &str) -> Output {
    let words: Vec<String> = command
        .split_whitespace()
        .map(|w| match w {
            "HOST:PORT" => "127.0.0.1:50061".to_string(),
            w if w.starts_with("HOST") && w.ends_with(":PORT") => {
                format!("127.0.0.1:5006{}", &w[4..w.len() - 5])
            }
            w => w.to_string(),
        })
        .collect();
    assert_eq!(words[..2], ["backburner", "run"], "{command}");
    let args: Vec<&str> = words[1..].iter().map(|s| s.as_str()).collect();
    bb(&args)
}

#[test]
fn every_command_plan_prints_with_a_device_passes_the_cli_and_its_refusals() {
    let shapes: Vec<(Vec<&str>, Option<&str>)> = vec![
        // a big host: the device takes what fits
        (
            vec![
                "--host-memory",
                "512GiB",
                "--ctx",
                "8192",
                "--device-memory",
                "24GiB",
            ],
            Some("--device-layers 31"),
        ),
        // a host smaller than the weights beside the device
        (
            vec![
                "--host-memory",
                "32GiB",
                "--ctx",
                "8192",
                "--device-memory",
                "24GiB",
            ],
            Some("--device-layers 31"),
        ),
        // a small host, every layer on a big device
        (
            vec!["--host-memory", "8GiB", "--device-memory", "80GB"],
            Some("--device-layers 64"),
        ),
        // workers beside the device: KV pages only, one and two of them
        (
            vec![
                "--host-memory",
                "32GiB",
                "--device-memory",
                "24GiB",
                "--worker-memory",
                "8GB",
            ],
            Some("--worker HOST:PORT --kv-budget "),
        ),
        (
            vec![
                "--host-memory",
                "32GiB",
                "--device-memory",
                "24GiB",
                "--worker-memory",
                "4GB",
                "--worker-memory",
                "4GB",
                "--kv-page-size",
                "1024",
            ],
            Some("--worker HOST1:PORT --worker HOST2:PORT --kv-budget "),
        ),
        // no layer fits: no device flags
        (
            vec![
                "--host-memory",
                "512GiB",
                "--ctx",
                "8192",
                "--device-memory",
                "1GiB",
            ],
            None,
        ),
    ];
    let not_built = backburner_model::device::Registry::cpu_only()
        .open("cuda:0".parse().unwrap())
        .err()
        .unwrap()
        .to_string();
    for (extra, has) in &shapes {
        let v = device_plan(extra);
        let command = v["device"]["command"].as_str().unwrap().to_string();
        for refused in ["--split-layer", "--layer-split", "--expert-split"] {
            assert!(!command.contains(refused), "{extra:?}: {command}");
        }
        let o = run_printed(&command);
        let e = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(
            !e.contains("cannot run layers on a device"),
            "{command}: {e}"
        );
        match has {
            Some(flags) => {
                assert!(command.contains(flags), "{extra:?}: {command}");
                assert!(
                    command.contains("--device cuda:0 --device-layers"),
                    "{command}"
                );
                // past the parser (exit 2) and the refusals: the build has no CUDA backend
                assert_eq!(o.status.code(), Some(1), "{command}: {e}");
                assert!(
                    e.contains(&format!("--device cuda:0: {not_built}")),
                    "{command}: {e}"
                );
            }
            None => {
                assert!(!command.contains("--device"), "{command}");
                assert_ne!(o.status.code(), Some(2), "{command}: {e}");
            }
        }
        if command.contains("--kv-budget") {
            let budget = v["mode"]["kv_offload"]["host_kv_positions"]
                .as_u64()
                .unwrap();
            assert!(
                command.ends_with(&format!(" --kv-budget {budget}")),
                "{command}"
            );
        }
    }
}

#[test]
fn a_host_with_less_memory_than_the_weights_gets_a_plan_beside_a_device() {
    let m = ref27b();
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "32GiB",
        "--ctx",
        "8192",
        "--device",
        "cuda:0",
        "--device-memory",
        "24GiB",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "plan: local: cuda:0 holds layers 0..31, the host 31..64 and the embedding and head; context up to 19947 \
         tokens"
    );
    // the host's row: the weights of layers 31..64 (25,097,707,008 bytes, counted in the engine's plan tests) and
    // of the ends (5,085,603,840), not the device's layers'
    assert!(
        lines[2].starts_with("host      31..64 +ends   30.2 GB "),
        "{text}"
    );
    assert!(
        text.contains(
            "note: the host does not keep the weights of layers 0..31 (they are on cuda:0 only): its row counts the \
             weights of the layers on the CPU and of the embedding and head\n"
        ),
        "{text}"
    );
    assert!(
        text.contains("\ncommand: backburner run --model "),
        "{text}"
    );
    // without the device the host alone does not hold the weights
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "32GiB",
        "--ctx",
        "8192",
    ]);
    assert_eq!(o.status.code(), Some(1));
}

#[test]
fn nothing_fits_beside_a_device_and_the_suggestion_is_more_device_memory_not_a_worker_computing_layers(
) {
    let m = ref27b();
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "8GiB",
        "--ctx",
        "8192",
        "--device",
        "cuda:0",
        "--device-memory",
        "24GiB",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains(
            "weights need 53.8 GB; cuda:0 25.8 GB (keeping back 1.5 GB for its runtime) + host 8.6 GB: does not fit; \
             with 49 GB on cuda:0 (--device-memory) it fits as local: cuda:0 holds layers 0..61, the host 61..64"
        ),
        "{e}"
    );
    assert!(!e.contains("layer split") && !e.contains("worker"), "{e}");
    // the suggestion works
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "8GiB",
        "--ctx",
        "8192",
        "--device",
        "cuda:0",
        "--device-memory",
        "49GB",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // --layer-split beside a device: refused, saying what workers may do
    let o = bb(&[
        "plan",
        "--model",
        &m,
        "--host-memory",
        "32GiB",
        "--worker-memory",
        "32GiB",
        "--layer-split",
        "32",
        "--device",
        "cuda:0",
        "--device-memory",
        "24GiB",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("workers hold KV pages only"), "{e}");
}
