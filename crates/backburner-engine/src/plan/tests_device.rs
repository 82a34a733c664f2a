//! A device's memory as a budget: the layers that fit, and the host's share of what is left (the other layers'
//! weights and the ends only), counted by hand from the 27B's per-layer shapes.

use std::path::PathBuf;

use backburner_kernels::kv::KvDtype;

use super::*;

const GIB: u64 = 1 << 30;

fn request(host: u64, workers: &[u64], ctx: Option<usize>) -> PlanRequest {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/ref-27b-config");
    let (config, costs) = ModelCosts::from_dir(&dir, KvDtype::F16).unwrap();
    PlanRequest {
        config,
        costs,
        host_memory: host,
        worker_memory: workers.to_vec(),
        ctx,
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
const LINEAR_W: u64 = 766_546_368;
const ATTENTION_W: u64 = 744_510_464;
const STATE: u64 = 3_268_608;
const LINEAR: u64 = 769_814_976;
const ATTENTION: u64 = 778_064_896;
const CYCLE: u64 = 3_087_509_824;
const RESERVE: u64 = 1_510_735_872;
// The host's fixed share: the ends 2·(2·248,320·5120) + 2·5120 = 5,085,603,840 and the scratch of a node with
// layers and the ends 512·106,688·8 + 248,320·4 = 437,987,328.
const ENDS: u64 = 5_085_603_840;
const HOST_SCRATCH: u64 = 437_987_328;

fn load(r: &PlanRequest, memory: u64, positions: usize, sequences: usize) -> DeviceLoad<'_> {
    DeviceLoad {
        config: &r.config,
        costs: &r.costs,
        memory,
        positions,
        sequences,
        ubatch: 512,
    }
}

#[test]
fn the_27b_per_layer_device_bytes_are_the_hand_computed_ones() {
    let r = request(512 * GIB, &[], Some(8192));
    assert_eq!(layer_device_bytes(&r.costs, 0, 8192), LINEAR);
    assert_eq!(layer_device_bytes(&r.costs, 3, 8192), ATTENTION);
    assert_eq!(LINEAR_W + STATE, LINEAR);
    assert_eq!(ATTENTION_W + 4096 * 8192, ATTENTION);
    assert_eq!(3 * LINEAR + ATTENTION, CYCLE);
    assert_eq!(device_reserve(&r.costs, 512), RESERVE);
    assert_eq!(r.costs.ends.total(), ENDS);
    assert_eq!(r.costs.scratch_bytes(512, true, true), HOST_SCRATCH);
}

#[test]
fn fit_layers_takes_the_longest_prefix_and_says_what_stopped_it() {
    let r = request(512 * GIB, &[], None);
    // 24 GiB less the reserve: 7 cycles + 2,646,499,136, which holds the next three Gated DeltaNet layers and not
    // the attention layer after them (337,054,208 left of its 778,064,896): 31 layers.
    assert_eq!(24 * GIB - RESERVE, 7 * CYCLE + 2_646_499_136);
    let f = fit_layers(&load(&r, 24 * GIB, 8192, 1), 0..64);
    assert_eq!(f.layers, 0..31);
    assert_eq!(
        f.stop,
        FitStop::Memory {
            layer: 31,
            need: ATTENTION,
            left: 2_646_499_136 - 3 * LINEAR
        }
    );
    assert_eq!(f.total_bytes(), RESERVE + 7 * CYCLE + 3 * LINEAR);
    // two sequences (serve's slots): each holds its own KV and state; 31 layers still fit, 23,726,592 bytes left:
    // 24 GiB − reserve − 7·(3·(L + 2·S) + A + 2·KV) − 3·(L + 2·S)
    let two = fit_layers(&load(&r, 24 * GIB, 8192, 2), 0..64);
    assert_eq!(two.layers, 0..31);
    assert_eq!(two.state_bytes, 2 * 24 * STATE);
    assert_eq!(two.kv_bytes, 2 * 7 * 4096 * 8192);
    assert_eq!(24 * GIB - two.total_bytes(), 23_726_592);
    // the reserve alone: none, and the first layer named
    let none = fit_layers(&load(&r, GIB, 8192, 1), 0..64);
    assert_eq!(none.layers, 0..0);
    assert!(matches!(
        none.stop,
        FitStop::Memory {
            layer: 0,
            left: 0,
            ..
        }
    ));
    // ample: all of them
    let all = fit_layers(&load(&r, 80 * GIB, 8192, 1), 0..64);
    assert_eq!((all.layers, all.stop), (0..64, FitStop::AllFit));
}

#[test]
fn a_32_gib_host_runs_the_27b_beside_24_gib_of_device_holding_only_the_cpu_layers_weights() {
    // The weights (53.8 GB) are more than the host's 32 GiB (34.4 GB): on the host alone the 27B does not fit.
    let r = request(32 * GIB, &[], Some(8192));
    assert!(r.costs.total_weight_bytes() > 32 * GIB);
    assert!(matches!(plan(&r), Err(PlanError::DoesNotFit { .. })));
    // The device takes layers 0..31 at 8192 positions (above); the host holds 31..64: layer 31 (attention) and 8
    // cycles, 744,510,464 + 8·(3·766,546,368 + 744,510,464) = 25,097,707,008 bytes of weights, + the ends.
    let p = plan_with_device(&r, &cuda0(24 * GIB)).unwrap();
    assert_eq!(p.mode, Mode::Local);
    let d = p.device.as_ref().unwrap();
    assert_eq!((d.layers.clone(), d.cpu_layers.clone()), (0..31, 31..64));
    assert_eq!(d.flags, "--device cuda:0 --device-layers 31");
    assert_eq!(
        d.weight_bytes,
        7 * (3 * LINEAR_W + ATTENTION_W) + 3 * LINEAR_W
    );
    assert_eq!(d.weight_bytes, 23_608_686_080);
    assert_eq!((d.kv_positions, d.kv_bytes), (8192, 7 * 33_554_432));
    assert_eq!(d.state_bytes, 24 * STATE);
    let host_w = ATTENTION_W + 8 * (3 * LINEAR_W + ATTENTION_W);
    assert_eq!(host_w, 25_097_707_008);
    assert_eq!(p.host.layers, 31..64);
    assert!(p.host.holds_ends);
    assert_eq!(p.host.weight_bytes, host_w + ENDS);
    assert_eq!(p.host.state_bytes, 24 * STATE);
    // the context both hold: the device's 24 GiB − reserve − weights − state = 571,935,232 bytes for the KV of its
    // 7 attention layers, 571,935,232 / (7·4096) = 19,947 positions; the host's 32 GiB − 30,699,744,768 fixed =
    // 3,659,993,600 for its 9 attention layers' (99,283 positions). The device's is the smaller.
    assert_eq!(
        24 * GIB - RESERVE - d.weight_bytes - d.state_bytes,
        571_935_232
    );
    assert_eq!(571_935_232 / (7 * 4096), 19_947);
    assert_eq!(host_w + ENDS + 24 * STATE + HOST_SCRATCH, 30_699_744_768);
    assert_eq!(p.max_ctx, 19_947);
    assert_eq!(p.ctx, 8192);
    assert_eq!(
        (p.host.kv_positions, p.host.kv_bytes),
        (19_947, 9 * 4096 * 19_947)
    );
    assert_eq!(p.host.total_bytes(), 30_699_744_768 + 9 * 4096 * 19_947);
    assert!(p.host.total_bytes() <= 32 * GIB && d.total_bytes() <= 24 * GIB);
    assert!(
        summary(&p).starts_with(
            "local: cuda:0 holds layers 0..31, the host 31..64 and the embedding and head; context up to 19947"
        ),
        "{}",
        summary(&p)
    );
    assert!(
        p.notes.iter().any(|n| n
            == "the host does not keep the weights of layers 0..31 (they are on cuda:0 only): its row counts the \
                weights of the layers on the CPU and of the embedding and head"),
        "{:?}",
        p.notes
    );
    // one byte short of the 31st layer: 30 on the device, one more (a Gated DeltaNet layer) on the host
    let short = plan_with_device(&r, &cuda0(RESERVE + 7 * CYCLE + 3 * LINEAR - 1)).unwrap();
    let sd = short.device.unwrap();
    assert_eq!(sd.layers, 0..30);
    assert_eq!(short.host.weight_bytes, host_w + LINEAR_W + ENDS);
    let v = serde_json::to_value(&p).unwrap();
    assert_eq!(v["device"]["layers"], serde_json::json!([0, 31]));
    assert_eq!(v["device"]["cpu_layers"], serde_json::json!([31, 64]));
    assert_eq!(v["host"]["layers"], serde_json::json!([31, 64]));
}

#[test]
fn an_8_gib_host_and_an_80_gb_device_hold_the_27b_with_every_layer_on_the_device() {
    // Every layer: 16 cycles at the largest context, 262,144 positions: weights 48,706,393,088 + state
    // 48·3,268,608 + KV 16·4096·262,144 = 17,179,869,184 + the reserve = 67,553,891,328 bytes, + the head 2,542,807,040
    // < 80 GB. The host: the
    // ends and its scratch only, 5,523,591,168 bytes < 8 GiB.
    let r = request(8 * GIB, &[], None);
    let p = plan_with_device(&r, &cuda0(80_000_000_000)).unwrap();
    let d = p.device.as_ref().unwrap();
    assert_eq!((d.layers.clone(), d.cpu_layers.clone()), (0..64, 64..64));
    assert_eq!(d.weight_bytes, 48_706_393_088);
    assert_eq!(d.kv_bytes, 17_179_869_184);
    // with every layer, the final norm (bf16, 10,240 bytes) and lm_head (248,320 · 5,120 · 2) go to the device too
    assert_eq!(d.head_bytes, 10_240 + 2_542_796_800);
    assert_eq!(d.total_bytes(), 67_553_891_328 + 2_542_807_040);
    assert_eq!((p.ctx, p.max_ctx), (262_144, 262_144));
    assert_eq!(p.host.layers, 64..64);
    assert_eq!((p.host.weight_bytes, p.host.kv_bytes), (ENDS, 0));
    assert_eq!(p.host.total_bytes(), ENDS + HOST_SCRATCH);
    assert_eq!(ENDS + HOST_SCRATCH, 5_523_591_168);
    assert!(summary(&p)
        .starts_with("local: cuda:0 holds all 64 layers, the host the embedding and head;"));
    // a device too small for any layer: the plan is the host's alone, no --device flags
    let r = request(512 * GIB, &[], Some(8192));
    let p = plan_with_device(&r, &cuda0(GIB)).unwrap();
    assert_eq!(p.device.as_ref().unwrap().layers, 0..0);
    assert_eq!(p.host.layers, 0..64);
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
fn nothing_fits_and_the_suggestions_are_what_a_device_accepts_more_device_memory() {
    // 8 GiB host, 24 GiB device: the host holds the ends and scratch (5,523,591,168) and 3,066,343,424 bytes more,
    // which does not hold layers 31..64. The least device memory, in whole GB: the host keeps layers 61..64 (2 Gated
    // DeltaNet + 1 attention, 2,317,694,848 bytes with their KV at 8192) but not 60..64 (a cycle, 3,087,509,824), so
    // the device holds 0..61: reserve + 15 cycles + a Gated DeltaNet layer = 48,593,198,208 bytes: 49 GB.
    let r = request(8 * GIB, &[], Some(8192));
    assert_eq!(8 * GIB - ENDS - HOST_SCRATCH, 3_066_343_424);
    assert_eq!(2 * LINEAR + ATTENTION, 2_317_694_848);
    assert_eq!(RESERVE + 15 * CYCLE + LINEAR, 48_593_198_208);
    let Err(PlanError::DoesNotFit {
        explanation,
        extra_worker_bytes,
    }) = plan_with_device(&r, &cuda0(24 * GIB))
    else {
        panic!("8 GiB + 24 GiB cannot hold the 27B")
    };
    assert!(
        explanation.starts_with(
            "weights need 53.8 GB; cuda:0 25.8 GB (keeping back 1.5 GB for its runtime) + host 8.6 GB: does not fit; \
             with 49 GB on cuda:0 (--device-memory) it fits as local: cuda:0 holds layers 0..61, the host 61..64 \
             and the embedding and head; context up to "
        ),
        "{explanation}"
    );
    // no worker helps (workers beside a device hold KV pages, not weights), and none that computes layers is named
    assert_eq!(extra_worker_bytes, None);
    assert!(
        !explanation.contains("layer split") && !explanation.contains("worker"),
        "{explanation}"
    );
    assert!(plan_with_device(&r, &cuda0(49_000_000_000)).is_ok());
    assert!(plan_with_device(&r, &cuda0(48_000_000_000)).is_err());
    // the weights fit but not the KV of the whole context: more device memory, or one worker holding KV pages (the
    // least in whole GB: 14 GB fits, 13 GB does not)
    let long = request(32 * GIB, &[], Some(262_144));
    let Err(PlanError::DoesNotFit {
        explanation,
        extra_worker_bytes,
    }) = plan_with_device(&long, &cuda0(24 * GIB))
    else {
        panic!("the context's KV does not fit")
    };
    assert!(
        explanation.contains("; with 40 GB on cuda:0 (--device-memory) it fits as local: "),
        "{explanation}"
    );
    assert!(
        explanation.contains(
            "; or with a first worker of 14 GB holding KV pages (`run --worker ADDR --kv-budget N`: beside a device, \
             workers do not compute layers) it fits as KV offload: cuda:0 holds layers 0.."
        ),
        "{explanation}"
    );
    assert_eq!(extra_worker_bytes, Some(14_000_000_000));
    let with = |w: u64| plan_with_device(&request(32 * GIB, &[w], Some(262_144)), &cuda0(24 * GIB));
    assert!(matches!(
        with(14_000_000_000).unwrap().mode,
        Mode::KvOffload { .. }
    ));
    assert!(with(13_000_000_000).is_err());
    // a host that cannot hold the ends: said, nothing suggested
    let tiny = request(4 * GIB, &[], Some(8192));
    let e = plan_with_device(&tiny, &cuda0(80 * GIB))
        .unwrap_err()
        .to_string();
    assert!(e.ends_with("; the host alone needs 5.5 GB for the embedding, head and scratch (the host keeps them with layers on a device)"), "{e}");
}

#[test]
fn workers_beside_a_device_hold_kv_pages_and_a_layer_split_is_refused() {
    // 32 GiB host + 24 GiB device + an 8 GB worker, the model's whole context: the two hold 19,947 positions
    // together (above), the worker's 29 pages of 16·4096·4096 bytes 118,784 more: KV offload.
    let r = request(32 * GIB, &[8_000_000_000], None);
    let p = plan_with_device(&r, &cuda0(24 * GIB)).unwrap();
    let Mode::KvOffload { host_kv_positions } = p.mode else {
        panic!("{:?}", p.mode)
    };
    assert_eq!(host_kv_positions % 4096, 0);
    assert!(host_kv_positions >= 512 + 2 * 4096);
    let d = p.device.as_ref().unwrap();
    assert!(!d.layers.is_empty());
    assert_eq!(d.kv_positions, host_kv_positions.min(p.max_ctx));
    assert_eq!(p.host.layers, d.layers.end..64);
    assert_eq!(p.workers[0].kv_positions, p.max_ctx - host_kv_positions);
    assert!(p.workers[0].kv_positions <= 29 * 4096);
    assert!(p.max_ctx > 19_947);
    for dev in std::iter::once(&p.host).chain(&p.workers) {
        assert!(dev.total_bytes() <= dev.memory, "{dev:?}");
    }
    assert!(d.total_bytes() <= 24 * GIB);
    assert!(
        summary(&p).starts_with("KV offload: cuda:0 holds layers 0.."),
        "{}",
        summary(&p)
    );
    // the device's layers are those that fit at the budget
    let fit_at = |positions| {
        let l = load(&r, 24 * GIB, positions, 1);
        fit_layers(&l, 0..64).layers
    };
    assert_eq!(fit_at(host_kv_positions), d.layers);
    // everything fits without them: unused, said
    let r = request(512 * GIB, &[8_000_000_000], Some(8192));
    let p = plan_with_device(&r, &cuda0(24 * GIB)).unwrap();
    assert_eq!(p.mode, Mode::Local);
    assert!(p.workers[0].layers.is_empty() && p.workers[0].kv_positions == 0);
    assert!(
        p.notes.iter().any(|n| n.contains("they are unused")),
        "{:?}",
        p.notes
    );
    // workers computing layers: refused
    let mut r = request(32 * GIB, &[32 * GIB], Some(8192));
    r.layer_split = Some(vec![32]);
    let e = plan_with_device(&r, &cuda0(24 * GIB))
        .unwrap_err()
        .to_string();
    assert!(e.contains("workers hold KV pages only"), "{e}");
}
