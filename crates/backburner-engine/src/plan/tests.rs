use std::path::PathBuf;

use backburner_kernels::kv::KvDtype;
use backburner_model::{Checkpoint, KvOptions};

use super::*;
use crate::memory::human;

const GB: u64 = 1_000_000_000;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

fn request(dir: &str, host: u64, workers: &[u64]) -> PlanRequest {
    let (config, costs) = ModelCosts::from_dir(&fixture(dir), KvDtype::F16).unwrap();
    PlanRequest {
        config,
        costs,
        host_memory: host,
        worker_memory: workers.to_vec(),
        ctx: None,
        ubatch: 512,
        page_size: 4096,
        layer_split: None,
        calibration: None,
    }
}

/// Every device holds what it says, within its memory; the KV of each covers its own attention layers at max_ctx;
/// max_ctx is the largest the placement holds (one more position overflows a device, or the model's limit is hit).
fn check_totals(req: &PlanRequest, p: &Plan) {
    let c = &req.costs;
    for d in std::iter::once(&p.host).chain(&p.workers) {
        assert!(
            d.total_bytes() <= d.memory,
            "{}: {} > {}",
            d.name,
            d.total_bytes(),
            d.memory
        );
    }
    if p.mode == Mode::LayerSplit {
        let mut free_positions = Vec::new();
        for (i, d) in std::iter::once(&p.host).chain(&p.workers).enumerate() {
            assert_eq!(d.holds_ends, i == 0);
            if d.layers.is_empty() && i > 0 {
                continue;
            }
            let attn = d
                .layers
                .clone()
                .filter(|&l| c.layer_kinds[l] == backburner_model::LayerKind::FullAttention)
                .count() as u64;
            assert_eq!(d.kv_positions, p.max_ctx);
            let per = c.kv_bytes_per_position * attn;
            assert_eq!(d.kv_bytes, per * p.max_ctx as u64);
            let fixed = d.weight_bytes + d.state_bytes + d.scratch_bytes;
            if attn > 0 {
                free_positions.push((d.memory - fixed) / per);
            }
        }
        let expect = free_positions
            .into_iter()
            .min()
            .unwrap()
            .min(c.max_position_embeddings as u64);
        assert_eq!(p.max_ctx as u64, expect);
    }
}

#[test]
fn ref_27b_costs_match_the_hand_computed_shapes() {
    let r = request("ref-27b-config", 24 * GB, &[8 * GB]);
    let c = &r.costs;
    assert_eq!(c.source, WeightSource::Config { bytes_per_param: 2 });
    // Linear layer: MLP 3·5120·17408 + norms 2·5120 + in_proj (10240 + 6144 + 96)·5120 + out 6144·5120
    // + conv 10240·4 + A_log, dt_bias 2·48 + norm 128 = 383,273,184 params.
    assert_eq!(c.layer_weight_bytes[0], 2 * 383_273_184);
    // Attention layer: q (with gate) 2·24·256, k, v 4·256 each, o 6144 → 104,858,112 + MLP and norms.
    assert_eq!(c.layer_weight_bytes[3], 2 * 372_255_232);
    assert_eq!(c.ends.embedding, 2 * 248_320 * 5120);
    assert_eq!(c.ends.head, c.ends.embedding);
    assert_eq!(c.total_weight_bytes(), 53_791_996_928);
    assert_eq!(human(c.total_weight_bytes()), "53.8 GB");
    // KV: 2 · 4 heads · 256 · 2 bytes per layer and position, 64 KiB over the 16 attention layers (DESIGN §1).
    assert_eq!(c.kv_bytes_per_position, 4096);
    let all = crate::offload::bytes_per_position(&r.config, KvOptions::default()) as u64;
    assert_eq!(c.kv_bytes(0..64, 1), all);
    assert_eq!(all, 64 << 10);
    // conv [10240, 3] + recurrent [48, 128, 128], f32: ~3 MiB (DESIGN §1).
    assert_eq!(c.linear_state_bytes, 4 * (10240 * 3 + 48 * 128 * 128));
    assert_eq!(c.state_bytes(0..64), 48 * c.linear_state_bytes);
    // (3·5120 + 3·17408 + 2·16480 + 6144) · 4 bytes · 2.
    assert_eq!(c.scratch_bytes(512, true, false), 512 * 106_688 * 8);
    assert_eq!(
        c.scratch_bytes(512, true, true),
        512 * 106_688 * 8 + 248_320 * 4
    );
}

#[test]
fn host_24gb_worker_8gb_does_not_fit_the_27b_and_says_what_would() {
    let r = request("ref-27b-config", 24 * GB, &[8 * GB]);
    let Err(PlanError::DoesNotFit {
        explanation,
        extra_worker_bytes,
    }) = plan(&r)
    else {
        panic!("the 27B cannot fit 32 GB");
    };
    // Host: 24 GB − ends 5.0856 − scratch 0.438 leaves 18.48 GB: 6 cycles of 3.0707 GB (weights, state, KV for
    // 4096 tokens). Worker 1: 2 cycles. On seams, layers 32..64 (8 cycles + scratch = 25.003 GB) would need a 26 GB
    // worker; splitting worker 1 off a seam (24..33: 9 layers, 8 GB) leaves layers 33..64 for 25 GB.
    assert!(
        explanation.starts_with(
            "weights need 53.8 GB; host 24 GB + worker 8 GB = 32 GB: does not fit; with a second worker of 25 GB it fits as layer split: host 0..24, worker 1 24..33, worker 2 33..64; context up to "
        ),
        "{explanation}"
    );
    assert_eq!(extra_worker_bytes, Some(25 * GB));
    // The suggestion is the least: 25 GB fits (off a seam, so said), 24 GB does not.
    let r25 = request("ref-27b-config", 24 * GB, &[8 * GB, 25 * GB]);
    let p = plan(&r25).unwrap();
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("split points at any layer boundary")),
        "{:?}",
        p.notes
    );
    let r24 = request("ref-27b-config", 24 * GB, &[8 * GB, 24 * GB]);
    assert!(matches!(plan(&r24), Err(PlanError::DoesNotFit { .. })));
}

#[test]
fn host_8gb_workers_12gb_8gb_does_not_fit_and_a_third_worker_takes_the_rest_off_seams() {
    let r = request("ref-27b-config", 8 * GB, &[12 * GB, 8 * GB]);
    let Err(PlanError::DoesNotFit {
        explanation,
        extra_worker_bytes,
    }) = plan(&r)
    else {
        panic!("the 27B cannot fit 28 GB");
    };
    // Host: 8 − 5.52 = 2.48 GB, less than one cycle (on seams it would keep only the ends and worker 3 would need
    // 35 GB) but 3 layers of ~0.77 GB; worker 1: 15 layers in 11.56 GB; worker 2: 9 layers; layers 27..64 (37
    // layers + scratch) need a 29 GB third worker.
    assert!(
        explanation.starts_with(
            "weights need 53.8 GB; host 8 GB + worker 1 12 GB + worker 2 8 GB = 28 GB: does not fit; with a third worker of 29 GB it fits as layer split: host 0..3, worker 1 3..18, worker 2 18..27, worker 3 27..64"
        ),
        "{explanation}"
    );
    assert_eq!(extra_worker_bytes, Some(29 * GB));
    let r28 = request("ref-27b-config", 8 * GB, &[12 * GB, 8 * GB, 28 * GB]);
    assert!(matches!(plan(&r28), Err(PlanError::DoesNotFit { .. })));
}

#[test]
fn a_small_model_gets_a_suggestion_rounded_to_its_scale_and_off_seam_placements() {
    // The tiny fixture (a few MB): the suggestion is in steps of a tenth of its leading power of ten, not whole
    // GB, and it is the least that fits.
    let host_min = super::search::host_minimum(&request("tiny-f32", 1, &[1]));
    let r = request("tiny-f32", host_min, &[1]);
    let Err(PlanError::DoesNotFit {
        explanation,
        extra_worker_bytes: Some(b),
    }) = plan(&r)
    else {
        panic!("a host with room for the ends only and a 1-byte worker cannot hold the layers");
    };
    assert!(b < 100_000_000, "{explanation}");
    assert!(
        explanation.contains(&format!(
            "with a second worker of {} MB it fits",
            b / 1_000_000
        )),
        "{explanation}"
    );
    assert!(plan(&request("tiny-f32", host_min, &[1, b])).is_ok());
    assert!(plan(&request("tiny-f32", host_min, &[1, b * 4 / 5])).is_err());
}

#[test]
fn the_27b_splits_on_seams_over_three_devices_with_the_context_that_fits() {
    let r = request("ref-27b-config", 24 * GB, &[8 * GB, 26 * GB]);
    let p = plan(&r).unwrap();
    assert_eq!(p.mode, Mode::LayerSplit);
    // With the largest context the chain's least free device sets it; seams only.
    for d in std::iter::once(&p.host).chain(&p.workers) {
        assert_eq!(d.layers.start % 4, 0);
        assert!(d.layers.end % 4 == 0);
    }
    assert_eq!(p.host.layers, 0..24);
    assert_eq!(p.workers[0].layers, 24..32);
    assert_eq!(p.workers[1].layers, 32..64);
    assert_eq!(p.ctx, p.max_ctx);
    check_totals(&r, &p);
    // The host is the tightest: 24 GB − ends − scratch (with the logits row) − 6 cycles' weights and state, over
    // its 6 attention layers × 4096 bytes. A longer context would push layers 20..24 off the host and onto
    // worker 2, which cannot take 9 cycles.
    let cycle = 3 * 766_546_368 + 744_510_464 + 3 * 3_268_608;
    let fixed = 5_085_603_840 + 512 * 106_688 * 8 + 248_320 * 4 + 6 * cycle;
    assert_eq!(p.max_ctx as u64, (24 * GB - fixed) / (6 * 4096));
    assert_eq!(p.max_ctx, 6212);
    // Residual 5120 × 4 bytes to and back from each of the two workers.
    assert_eq!(p.link.decode_bytes_per_token, 2 * 2 * 5120 * 4);
    assert!(p.expected.is_none());
}

#[test]
fn an_explicit_context_that_does_not_fit_is_refused_with_numbers() {
    let mut r = request("ref-27b-config", 24 * GB, &[8 * GB, 26 * GB]);
    r.ctx = Some(262_144);
    let Err(PlanError::DoesNotFit { explanation, .. }) = plan(&r) else {
        panic!("262144 tokens of KV do not fit a 26 GB worker");
    };
    assert!(
        explanation.starts_with(
            "weights 53.8 GB + recurrent state 156.9 MB + KV for 262144 tokens 17.2 GB"
        ),
        "{explanation}"
    );
}

#[test]
fn everything_local_then_split_prefill_then_kv_offload() {
    // 64 GB host: 53.8 GB weights + state + scratch leave 9.5 GB: 145k positions at 64 KiB.
    let r = request("ref-27b-config", 64 * GB, &[]);
    let p = plan(&r).unwrap();
    assert_eq!(p.mode, Mode::Local);
    let fixed = 53_791_996_928 + 48 * 3_268_608 + 512 * 106_688 * 8 + 248_320 * 4;
    assert_eq!(p.max_ctx as u64, (64 * GB - fixed) / 65_536);
    assert!(p.notes.iter().any(|n| n.contains("context capped")));
    check_totals(&r, &p);
    // 80 GB host: the whole 262144-token context fits; a worker makes it split prefill on the balanced seam.
    let r = request("ref-27b-config", 80 * GB, &[40 * GB]);
    let p = plan(&r).unwrap();
    assert_eq!(p.mode, Mode::SplitPrefill { split_layer: 32 });
    assert_eq!(p.workers[0].layers, 32..64);
    assert_eq!(p.max_ctx, 262_144);
    assert!(p.notes.iter().any(|n| n.contains("≥ 512 tokens")));
    check_totals(&r, &p);
    // A 20 GB worker cannot mirror 32 layers: the split layer moves to the tail until it fits.
    let r = request("ref-27b-config", 80 * GB, &[20 * GB]);
    let p = plan(&r).unwrap();
    let Mode::SplitPrefill { split_layer } = p.mode else {
        panic!("{:?}", p.mode)
    };
    assert!(split_layer > 32 && split_layer % 4 == 0);
    check_totals(&r, &p);
    // 64 GB host + 8 GB worker: the weights fit, the full context does not: KV offload in whole pages.
    let r = request("ref-27b-config", 64 * GB, &[8 * GB]);
    let p = plan(&r).unwrap();
    let host_pages = (64 * GB - fixed) / (65_536 * 4096);
    let worker_pages = (8 * GB - 512 * 4 * (5 * 24 * 256 + 3 * 24)) / (65_536 * 4096);
    assert_eq!(
        p.mode,
        Mode::KvOffload {
            host_kv_positions: host_pages as usize * 4096
        }
    );
    assert_eq!(
        p.max_ctx as u64,
        ((host_pages + worker_pages) * 4096).min(262_144)
    );
    assert_eq!(p.workers[0].kv_positions, p.max_ctx - p.host.kv_positions);
    check_totals(&r, &p);
}

#[test]
fn the_8_layer_model_splits_off_seams_for_two_workers() {
    let base = request("tiny-bf16", 0, &[]);
    let c = &base.costs;
    let ctx = 4096;
    let stage = |r: std::ops::Range<usize>, ends: bool| {
        c.weight_bytes(r.clone())
            + c.state_bytes(r.clone())
            + c.kv_bytes(r.clone(), ctx)
            + c.scratch_bytes(512, true, ends)
            + if ends { c.ends.total() } else { 0 }
    };
    // Each device holds 3 layers at most (the host: 2 and the ends), so the one seam (4) cannot serve 3 stages.
    let host = stage(0..2, true) + 1000;
    let w = stage(2..5, false).max(stage(5..8, false)) + 1000;
    let mut r = request("tiny-bf16", host, &[w, w]);
    r.ctx = Some(ctx);
    let p = plan(&r).unwrap();
    assert_eq!(p.mode, Mode::LayerSplit);
    assert_eq!(
        (p.host.layers.clone(), p.workers[0].layers.clone()),
        (0..2, 2..5)
    );
    assert_eq!(p.workers[1].layers, 5..8);
    assert!(
        p.notes.iter().any(|n| n.contains("any layer boundary")),
        "{:?}",
        p.notes
    );
    check_totals(&r, &p);
    // With room on seams, seams win: host 0..4, worker 1 4..8, worker 2 idle.
    let mut r = request(
        "tiny-bf16",
        stage(0..4, true) + 1000,
        &[stage(4..8, false) + 1000, w],
    );
    r.ctx = Some(ctx);
    let p = plan(&r).unwrap();
    assert_eq!(
        (p.host.layers.clone(), p.workers[0].layers.clone()),
        (0..4, 4..8)
    );
    assert!(p.workers[1].layers.is_empty());
    assert!(p.notes.iter().any(|n| n.contains("worker 2 is not needed")));
}

#[test]
fn fixed_split_points_are_validated_and_the_rest_placed() {
    let mut r = request("ref-27b-config", 24 * GB, &[8 * GB, 30 * GB]);
    r.layer_split = Some(vec![20]);
    let p = plan(&r).unwrap();
    assert_eq!(p.host.layers, 0..20);
    // Worker 1 (8 GB) takes 2 cycles after the fixed point; worker 2 the remaining 9.
    assert_eq!(p.workers[0].layers, 20..28);
    assert_eq!(p.workers[1].layers, 28..64);
    check_totals(&r, &p);
    for bad in [vec![64], vec![20, 20], vec![8, 16, 24]] {
        r.layer_split = Some(bad.clone());
        assert!(matches!(plan(&r), Err(PlanError::Invalid(_))), "{bad:?}");
    }
    // 0 leaves the host only the embedding and head: a valid point (here the rest does not fit the workers)
    r.layer_split = Some(vec![0]);
    assert!(
        matches!(plan(&r), Err(PlanError::DoesNotFit { .. })),
        "{:?}",
        plan(&r)
    );
}

#[test]
fn checkpoint_weight_bytes_are_what_the_load_allocates() {
    let dir = fixture("tiny-bf16");
    let (cfg, c) = ModelCosts::from_dir(&dir, KvDtype::F16).unwrap();
    assert_eq!(c.source, WeightSource::Checkpoint);
    let model = backburner_model::Model::load(&dir).unwrap();
    assert_eq!(c.total_weight_bytes(), model.weight_bytes() as u64);
    let ck = Checkpoint::open(&dir).unwrap();
    let half = backburner_model::LoadOptions {
        layers: 0..4,
        ends: true,
    };
    let want = backburner_model::load_bytes(&ck, &cfg, &half).unwrap();
    assert_eq!(c.weight_bytes(0..4) + c.ends.total(), want);
    assert_eq!(c.ends.head, 0, "tied head");
    // the config's shapes at 2 bytes per weight give the stored sizes: within 10 % of what the load allocates
    // (panel padding and the f32 copies of bf16 vectors; 6 % on these tiny shapes, far less on real ones)
    let from_cfg = ModelCosts::from_config(&cfg, 2, KvDtype::F16);
    let stored: u64 = ck
        .names()
        .iter()
        .map(|n| ck.raw(n).unwrap().1.len() as u64)
        .sum();
    assert_eq!(from_cfg.total_weight_bytes(), stored);
    let (a, b) = (stored as f64, c.total_weight_bytes() as f64);
    assert!((b - a).abs() / b < 0.10, "{a} vs {b}");
}

#[test]
fn the_scratch_estimate_covers_a_real_ubatch() {
    let dir = fixture("tiny-bf16");
    let model = std::sync::Arc::new(backburner_model::Model::load(&dir).unwrap());
    let (_, c) = ModelCosts::from_dir(&dir, KvDtype::F16).unwrap();
    let opts = crate::SessionOptions {
        ubatch: 64,
        ..Default::default()
    };
    let mut s = crate::Session::new(model, opts).unwrap();
    let ids: Vec<u32> = (0..64).map(|i| (i * 7) % 512).collect();
    s.prefill(&ids, crate::Logits::Last, |_, _| {}).unwrap();
    let used = s.state().scratch_bytes() as u64;
    let est = c.scratch_bytes(64, true, false);
    assert!(
        used > 0 && used <= est && est <= 4 * used,
        "used {used}, estimate {est}"
    );
    // The state the planner counts equals what the session holds: linear states + KV rows of 64 positions.
    let want = c.state_bytes(0..8) + c.kv_bytes(0..8, 64);
    assert_eq!(s.state().bytes() as u64, want);
}

#[test]
fn calibration_gives_expected_rates() {
    let mut r = request("ref-27b-config", 24 * GB, &[8 * GB, 26 * GB]);
    let t = |pf: f64, dec: f64| DeviceTimes {
        threads: 8,
        prefill_us_per_token_layer: pf,
        decode_us_per_layer: dec,
        ends_prefill_us_per_token: 10.0,
        ends_decode_us: 1000.0,
        prefill_tokens: 512,
    };
    r.calibration = Some(Calibration {
        version: 1,
        model: String::new(),
        layers: 0,
        hidden: 0,
        host: t(20.0, 500.0),
        workers: vec![t(40.0, 1000.0), t(40.0, 1000.0)],
        link: Some(LinkTimes {
            round_trip_us: 100.0,
            bytes_per_s: 1e9,
        }),
    });
    let p = plan(&r).unwrap();
    let e = p.expected.clone().unwrap();
    // Decode: host 24 × 500 + 1000 µs; workers 8 × 1000 + 32 × 1000; link 2 hops × 100 µs + 81920 B at 1 GB/s.
    assert!((e.decode_ms.host - 13.0).abs() < 1e-9);
    assert!((e.decode_ms.workers - 40.0).abs() < 1e-9);
    assert!((e.decode_ms.link - (0.2 + 0.08192)).abs() < 1e-9);
    assert!((e.decode_tok_s - 1e3 / (13.0 + 40.0 + 0.28192)).abs() < 1e-9);
    // Prefill: the slowest stage is worker 2, 32 × 40 µs per token.
    assert!((e.prefill_tok_s - 1e6 / 1280.0).abs() < 1e-9);
    // Without numbers for worker 2 there is no estimate, and a note says so.
    r.calibration.as_mut().unwrap().workers.pop();
    let p = plan(&r).unwrap();
    assert!(p.expected.is_none());
    assert!(p.notes.iter().any(|n| n.contains("no expected rates")));
}

#[test]
fn an_untied_head_stored_in_another_type_than_the_embedding_is_counted_as_stored() {
    // tiny-f32.gguf with its head (`output.weight`) rewritten as F16, as quantized files often store the head in
    // another type than the embedding: the ends split into the embedding's and the head's own bytes
    use backburner_model::gguf::writer::GgufWriter;
    use backburner_model::gguf::GgmlType;
    let src = backburner_model::GgufFile::open(&fixture("gguf/tiny-f32.gguf")).unwrap();
    let mut w = GgufWriter::copy_of(&src).unwrap();
    let head = w
        .tensors
        .iter_mut()
        .find(|t| t.name == "output.weight")
        .unwrap();
    head.data = head
        .data
        .chunks_exact(4)
        .flat_map(|c| half::f16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect();
    head.type_id = GgmlType::F16.id();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("f16-head.gguf");
    w.write(&path).unwrap();
    let (cfg, c) = ModelCosts::from_dir(&path, KvDtype::F16).unwrap();
    assert!(!cfg.tie_word_embeddings);
    let model = backburner_model::Model::load(&path).unwrap();
    assert_eq!(c.total_weight_bytes(), model.weight_bytes() as u64);
    let (_, f32_costs) =
        ModelCosts::from_dir(&fixture("gguf/tiny-f32.gguf"), KvDtype::F16).unwrap();
    // the embedding as before, the head at half its bytes
    assert_eq!(c.ends.embedding, f32_costs.ends.embedding);
    assert_eq!(c.ends.head, f32_costs.ends.head / 2);
    let types: Vec<(&str, usize)> = c
        .format
        .types
        .iter()
        .map(|t| (t.dtype.as_str(), t.tensors))
        .collect();
    assert_eq!(types, [("F32", 108), ("F16", 1)]);
    assert_eq!(c.format.container, "gguf");
}

#[test]
fn a_ubatch_whose_scratch_saturates_the_sums_gets_an_answer_not_a_hang() {
    // The breaker's case: `plan --host-memory 18446744073709551615 --ubatch 281474976710656`. The scratch for that
    // ubatch saturates at u64::MAX, and the extra-worker suggestion's rounding used to loop forever on it.
    let mut r = request("ref-27b-config", u64::MAX, &[]);
    r.ubatch = 1 << 48;
    let Err(PlanError::DoesNotFit {
        explanation,
        extra_worker_bytes,
    }) = plan(&r)
    else {
        panic!("a scratch of u64::MAX bytes cannot fit beside the weights");
    };
    assert!(
        explanation.starts_with(
            "weights 53.8 GB + recurrent state 156.9 MB + KV for 4096 tokens 268.4 MB + scratch"
        ) && explanation.ends_with("no placement of whole layers fits"),
        "{explanation}"
    );
    assert_eq!(extra_worker_bytes, None, "{explanation}");
}

#[test]
fn a_moe_plan_says_what_decode_reads_of_the_weights() {
    // tiny-moe-f32 layer 0 (Gated DeltaNet): norms 128, router 512, 8 experts × 6,144, shared expert 9,216 and its
    // gate 64, the mixer 23,712 elements: 82,784 in all, of which decode reads 2 of the 8 experts
    let req = request("tiny-moe-f32", 10 * GB, &[]);
    let share = moe::active_share(&req);
    assert_eq!(share[0], 45_920.0 / 82_784.0);
    let p = plan(&req).unwrap();
    let note = p
        .notes
        .iter()
        .find(|n| n.starts_with("mixture of experts"))
        .expect("an MoE note");
    assert!(note.contains("2 of 8 routed experts"), "{note}");
    // a dense model has no such note
    let dense = plan(&request("tiny-f32", 10 * GB, &[])).unwrap();
    assert!(dense.notes.iter().all(|n| !n.starts_with("mixture")));
}
