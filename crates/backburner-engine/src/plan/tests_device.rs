//! A device's memory as a budget: the layers that fit, counted by hand from the 27B's per-layer shapes.

use std::path::PathBuf;

use backburner_kernels::kv::KvDtype;

use super::*;

const GIB: u64 = 1 << 30;

fn request(host: u64, workers: &[u64], ctx: usize) -> PlanRequest {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/ref-27b-config");
    let (config, costs) = ModelCosts::from_dir(&dir, KvDtype::F16).unwrap();
    PlanRequest {
        config,
        costs,
        host_memory: host,
        worker_memory: workers.to_vec(),
        ctx: Some(ctx),
        ubatch: 512,
        page_size: 4096,
        layer_split: None,
        calibration: None,
    }
}

fn cuda0(memory: u64) -> DeviceBudget {
    DeviceBudget {
        id: "cuda:0".into(),
        memory,
    }
}

// The 27B at bf16 (the shapes of `ref_27b_costs_match_the_hand_computed_shapes`), ctx 8192, f16 KV, ubatch 512:
// a Gated DeltaNet layer: weights 2·383,273,184 = 766,546,368 + state 4·(10240·3 + 48·128·128) = 3,268,608
//   = 769,814,976 bytes;
// an attention layer: weights 2·372,255,232 = 744,510,464 + KV 4096·8192 = 33,554,432 = 778,064,896 bytes;
// a 4-layer cycle (3 + 1): 2,309,444,928 + 778,064,896 = 3,087,509,824 bytes;
// the reserve: 1 GiB + 512·106,688·8 = 1,073,741,824 + 436,994,048 = 1,510,735,872 bytes.
const LINEAR: u64 = 769_814_976;
const ATTENTION: u64 = 778_064_896;
const CYCLE: u64 = 3_087_509_824;
const RESERVE: u64 = 1_510_735_872;

#[test]
fn the_27b_per_layer_device_bytes_are_the_hand_computed_ones() {
    let r = request(512 * GIB, &[], 8192);
    assert_eq!(layer_device_bytes(&r.costs, 0, 8192), LINEAR);
    assert_eq!(layer_device_bytes(&r.costs, 3, 8192), ATTENTION);
    assert_eq!(3 * LINEAR + ATTENTION, CYCLE);
    assert_eq!(device_reserve(&r.costs, 512), RESERVE);
}

#[test]
fn a_24_gib_device_takes_31_layers_of_the_27b_at_8k() {
    // 24 GiB = 25,769,803,776; less the reserve: 24,259,067,904 = 7 cycles (21,612,568,768) + 2,646,499,136, which
    // holds the next three Gated DeltaNet layers (2,309,444,928) and not the attention layer after them: 31 layers.
    assert_eq!(24 * GIB - RESERVE, 7 * CYCLE + 2_646_499_136);
    const { assert!(3 * LINEAR <= 2_646_499_136 && 3 * LINEAR + ATTENTION > 2_646_499_136) };
    let r = request(512 * GIB, &[], 8192);
    let p = plan_with_device(&r, &cuda0(24 * GIB)).unwrap();
    let d = p.device.as_ref().unwrap();
    assert_eq!(d.layers, 0..31);
    assert_eq!(d.cpu_layers, 31..64);
    assert_eq!(d.flags, "--device cuda:0 --device-layers 31");
    // 7 · (3 · 766,546,368 + 744,510,464) + 3 · 766,546,368
    assert_eq!(d.weight_bytes, 23_608_686_080);
    assert_eq!(d.state_bytes, 24 * 3_268_608);
    assert_eq!(d.kv_bytes, 7 * 33_554_432);
    assert_eq!(d.total_bytes(), RESERVE + 7 * CYCLE + 3 * LINEAR);
    assert!(d.total_bytes() <= 24 * GIB);
    assert!(
        summary(&p).contains("; layers 0..31 on cuda:0;"),
        "{}",
        summary(&p)
    );
    // one byte short of the 31st layer: 30
    let short = RESERVE + 7 * CYCLE + 3 * LINEAR - 1;
    let p = plan_with_device(&r, &cuda0(short)).unwrap();
    assert_eq!(p.device.unwrap().layers, 0..30);
    let v = serde_json::to_value(plan_with_device(&r, &cuda0(24 * GIB)).unwrap()).unwrap();
    assert_eq!(v["device"]["layers"], serde_json::json!([0, 31]));
    assert_eq!(v["device"]["cpu_layers"], serde_json::json!([31, 64]));
}

#[test]
fn an_80gb_device_takes_every_layer_and_a_small_one_none() {
    let r = request(512 * GIB, &[], 8192);
    // 16 cycles + the reserve = 50,910,893,056 bytes < 80 GB
    const { assert!(16 * CYCLE + RESERVE < 80_000_000_000) };
    let d = plan_with_device(&r, &cuda0(80_000_000_000))
        .unwrap()
        .device
        .unwrap();
    assert_eq!((d.layers, d.cpu_layers), (0..64, 64..64));
    assert_eq!(d.flags, "--device cuda:0 --device-layers 64");
    // the reserve alone does not fit 1 GiB: no layer, and a note saying why
    let p = plan_with_device(&r, &cuda0(GIB)).unwrap();
    assert_eq!(p.device.as_ref().unwrap().layers, 0..0);
    assert!(
        p.notes.iter().any(|n| n.contains("no layer fits")),
        "{:?}",
        p.notes
    );
    assert!(summary(&p).contains("no layer fits cuda:0"));
    // without a device the plan (and its JSON) is as before
    let plain = plan(&r).unwrap();
    assert!(plain.device.is_none());
    assert!(serde_json::to_value(&plain)
        .unwrap()
        .get("device")
        .is_none());
}

#[test]
fn a_device_with_workers_is_refused() {
    let r = request(512 * GIB, &[8 * GIB], 8192);
    let e = plan_with_device(&r, &cuda0(80 * GIB)).unwrap_err();
    assert!(e.to_string().contains("not with workers"), "{e}");
}
