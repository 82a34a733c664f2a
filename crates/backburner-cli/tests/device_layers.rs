//! `--device-layers N|all|-1|auto` (llama.cpp's `-ngl`) end to end on the device layer's CPU backend (the hidden
//! `--device-cpu-backend`), `auto` choosing the count worked out here from the tiny fixture's sizes, and
//! `--device-memory` refusing a bare small number.

use std::process::Output;

use backburner_engine::plan::{head_device_bytes, ModelCosts};
use backburner_kernels::kv::KvDtype;

use crate::common::{bb, fixture, stderr};

/// `run` on the tiny fixture (8 layers: 3 Gated DeltaNet + 1 attention, twice), 6 greedy tokens, `--ctx-size 64`.
fn run_tiny(extra: &[&str]) -> Output {
    let m = fixture("tiny-f32");
    let mut a = vec![
        "run",
        "--model",
        m.to_str().unwrap(),
        "--prompt",
        "Hello there",
        "-n",
        "6",
        "--ignore-eos",
        "--ctx-size",
        "64",
    ];
    a.extend_from_slice(extra);
    bb(&a)
}

#[test]
fn all_and_minus_one_place_every_layer_and_other_negatives_are_parse_errors() {
    let plain = run_tiny(&[]);
    assert!(plain.status.success(), "{}", stderr(&plain));
    for every in [
        &["--device-layers", "all"][..],
        &["--device-layers", "-1"],
        &["--device-layers=-1"],
        &["-ngl", "-1"],
        &["-ngl", "all"],
        &["-ngl", "99"],
    ] {
        let mut a = vec!["--device-cpu-backend"];
        a.extend_from_slice(every);
        let o = run_tiny(&a);
        assert!(o.status.success(), "{every:?}: {}", stderr(&o));
        assert_eq!(o.stdout, plain.stdout, "{every:?}");
        let e = stderr(&o);
        assert!(e.starts_with("layers 0..8 on cpu ("), "{every:?}: {e}");
        assert!(!e.contains("5..8"), "{e}");
    }
    // with --device cpu (no device) `all` and `auto` place nothing, and are no error
    for l in ["all", "auto", "-1"] {
        let o = run_tiny(&["--device", "cpu", "--device-layers", l]);
        assert!(o.status.success(), "{l}: {}", stderr(&o));
        assert_eq!(o.stdout, plain.stdout);
        assert!(!stderr(&o).contains("layers 0.."), "{}", stderr(&o));
    }
    for (bad, msg) in [
        ("-2", "-2 is not a layer count: -1 (as llama.cpp's -ngl -1) or `all` puts every layer on the device"),
        ("x", "\"x\" is not a layer count: give N (the first N layers), all or -1 (every layer) or auto"),
    ] {
        for flag in ["--device-layers", "-ngl"] {
            let o = run_tiny(&["--device-cpu-backend", flag, bad]);
            assert_eq!(o.status.code(), Some(2), "{flag} {bad}");
            let e = stderr(&o);
            assert!(
                e.contains(&format!("invalid value '{bad}' for '--device-layers <N|all|auto>': {msg}")),
                "{flag} {bad}: {e}"
            );
        }
    }
}

/// The bytes `auto` counts for layer `l` of the tiny fixture at 64 positions, worked out from its config.json:
/// an attention layer's KV is 2 (K, V) · 2 KV heads · 32 (head_dim) · 2 bytes (f16) = 256 bytes per position,
/// 16,384 at 64; a Gated DeltaNet layer's state is 4 bytes · (conv (2·2·16 + 4·24 = 160 channels) · 3 + 4 heads ·
/// 16 · 24) = 4 · (480 + 1536) = 8,064 bytes; plus the layer's stored weights.
fn tiny_layer_bytes(costs: &ModelCosts, l: usize) -> u64 {
    let held = if (l + 1).is_multiple_of(4) {
        256 * 64
    } else {
        8_064
    };
    costs.layer_weight_bytes[l] + held
}

#[test]
fn auto_takes_the_leading_layers_that_fit_the_free_memory_at_the_context() {
    let (_, costs) = ModelCosts::from_dir(&fixture("tiny-f32"), KvDtype::F16).unwrap();
    // the per-layer state and KV of the planner agree with the hand count above
    assert_eq!(costs.linear_state_bytes, 8_064);
    assert_eq!(costs.kv_bytes_per_position, 256);
    // the reserve: 1 GiB + one ubatch of 512 tokens' activations, 512 · 4 · 2 · (3·64 + 3·128 + 2·384 + 128)
    let reserve: u64 = (1 << 30) + 512 * 8 * (3 * 64 + 3 * 128 + 2 * 384 + 128);
    assert_eq!(reserve, 1_079_771_136);
    let first = |k: usize| -> u64 { (0..k).map(|l| tiny_layer_bytes(&costs, l)).sum() };
    let plain = run_tiny(&[]);
    for (memory, want) in [
        (reserve + first(5), 5),
        (reserve + first(5) - 1, 4),
        (reserve + first(4), 4),
        // every layer: the final norm and head (the tied embedding) go with them
        (reserve + first(8) + head_device_bytes(&costs), 8),
        (reserve + first(8) + head_device_bytes(&costs) - 1, 7),
        (reserve, 0),
        (reserve - 1, 0),
    ] {
        let mem = memory.to_string();
        let o = run_tiny(&[
            "--device-cpu-backend",
            "--device-layers",
            "auto",
            "--device-free-memory",
            &mem,
        ]);
        assert!(o.status.success(), "{mem}: {}", stderr(&o));
        assert_eq!(o.stdout, plain.stdout, "the same tokens");
        let e = stderr(&o);
        let mut lines = e.lines();
        let auto = lines.next().unwrap();
        let how = match want {
            8 => "all 8 layers fit".to_string(),
            k => format!("{k} of 8 layers fit"),
        };
        assert!(
            auto.starts_with(&format!("--device-layers auto: {how} cpu's ")),
            "{mem}: {e}"
        );
        assert!(auto.contains(" free at 64 positions (weights "), "{auto}");
        let placed = lines.next().unwrap();
        match want {
            0 => {
                assert!(auto.ends_with(": every layer runs on the CPU"), "{auto}");
                assert!(placed.starts_with("layers 0..8 on cpu"), "{placed}");
            }
            8 => assert!(auto.ends_with("a ubatch's activations)"), "{auto}"),
            7 => {
                assert!(
                    auto.contains(
                        "; every layer fits but not the output head that goes with them ("
                    ),
                    "{auto}"
                );
                assert!(placed.ends_with(", 7..8 on cpu"), "{placed}");
            }
            k => {
                assert!(auto.contains(&format!("; layer {k} needs ")), "{auto}");
                assert!(
                    placed.starts_with(&format!("layers 0..{k} on cpu (")),
                    "{placed}"
                );
                assert!(placed.ends_with(&format!(", {k}..8 on cpu")), "{placed}");
            }
        }
    }
    // the host's own memory (what the CPU backend reports as free): every layer of the tiny model
    let o = run_tiny(&["--device-cpu-backend", "-ngl", "auto"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stderr(&o).starts_with("--device-layers auto: all 8 layers fit cpu's "),
        "{}",
        stderr(&o)
    );
}

#[test]
fn device_memory_without_a_unit_under_a_mib_is_refused_with_the_unit_to_give() {
    let m = fixture("ref-27b-config");
    let m = m.to_str().unwrap();
    let plan = |mem: &str| {
        bb(&[
            "plan",
            "--model",
            m,
            "--host-memory",
            "512GiB",
            "--ctx",
            "8192",
            "--device",
            "cuda:0",
            "--device-memory",
            mem,
        ])
    };
    let o = plan("80");
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains(
            "invalid value '80' for '--device-memory <DEVICE_MEMORY>': 80 without a unit is 80 bytes, too little \
             for a device: give a unit, e.g. 80G (80 GiB) or 80GB (80·10^9 bytes)"
        ),
        "{}",
        stderr(&o)
    );
    for ok in ["80G", "80GiB", "141GB"] {
        let o = plan(ok);
        assert!(o.status.success(), "{ok}: {}", stderr(&o));
        let text = String::from_utf8(o.stdout).unwrap();
        assert!(
            text.contains("--device cuda:0 --device-layers 64\n"),
            "{ok}: {text}"
        );
    }
}
