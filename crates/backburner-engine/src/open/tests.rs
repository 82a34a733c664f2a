//! The request's decisions (the planner's mode carried into the loaded host and its sessions) and its refusals,
//! on the tiny fixtures. Workers are addresses nothing listens on: nothing here connects (split prefill, KV offload
//! and layer split connect on the first prefill; the experts' refusal is a connection error).

use std::path::PathBuf;
use std::time::Duration;

use backburner_model::ModelConfig;

use super::*;
use crate::plan::{Mode, ModelCosts};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures")
        .join(name)
}

/// A request for `name` with `workers` (addresses), no placement fixed and no memory limit.
fn request(name: &str, workers: &[&str]) -> SessionRequest {
    let dir = fixture(name);
    SessionRequest {
        config: ModelConfig::from_dir(&dir).unwrap(),
        dir,
        max_memory: None,
        options: SessionOptions {
            pool: crate::ComputePool::new(1).unwrap(),
            ..SessionOptions::default()
        },
        workers: Workers {
            addrs: workers.iter().map(|s| s.to_string()).collect(),
            memory: Vec::new(),
            secret: Vec::new(),
            timeout: Duration::from_secs(1),
            split_min_tokens: 512,
        },
        placement: PlacementFlags::default(),
        run: None,
    }
}

/// A run of 64 prompt tokens and 64 generated, in ubatches of 64.
const RUN: RunNeed = RunNeed {
    positions: 128,
    ubatch: 64,
};

fn refusal(req: SessionRequest) -> String {
    match open(req, &mut ()) {
        Ok(_) => panic!("the request was not refused"),
        Err(e) => e.to_string(),
    }
}

/// Collects warnings.
#[derive(Default)]
struct Heard(Vec<String>, Option<Mode>);

impl OpenObserver for Heard {
    fn planned(&mut self, plan: &Plan) {
        self.1 = Some(plan.mode.clone());
    }
    fn warning(&mut self, m: &str) {
        self.0.push(m.to_string());
    }
}

#[test]
fn without_workers_the_host_holds_every_layer() {
    let mut r = request("tiny-f32", &[]);
    r.run = Some(RUN);
    r.max_memory = Some(1 << 30);
    let (host, s) = open(r, &mut ()).unwrap();
    assert!(host.plan.is_none());
    assert_eq!(host.model.layer_range(), 0..8);
    assert!(s.workers().is_empty() && s.layer_split().is_none());
}

#[test]
fn a_roomy_host_with_a_worker_runs_split_prefill_at_the_planned_layer() {
    let mut r = request("tiny-f32", &["127.0.0.1:1"]);
    r.run = Some(RUN);
    r.max_memory = Some(1 << 30);
    let mut heard = Heard::default();
    let host = load(r, &mut heard).unwrap();
    let Some(Mode::SplitPrefill { split_layer }) = heard.1 else {
        panic!("{:?}", heard.1)
    };
    assert_eq!(split_layer, 4);
    assert_eq!(host.request.placement.split_layer, Some(4));
    assert_eq!(host.model.layer_range(), 0..8);
    let s = host.session().unwrap();
    assert_eq!(s.workers().len(), 1);
    assert_eq!(s.workers()[0].settings().split_layer, Some(4));
    // the plan's context caps the session's
    assert_eq!(
        s.context_length(),
        host.plan.as_ref().unwrap().max_ctx.min(4096)
    );
}

#[test]
fn a_host_short_of_memory_keeps_the_layers_the_plan_gives_it_and_chains_the_rest() {
    let dir = fixture("tiny-f32");
    let (_, costs) = ModelCosts::from_dir(&dir, backburner_kernels::kv::KvDtype::F16).unwrap();
    let mut r = request("tiny-f32", &["127.0.0.1:1", "127.0.0.1:2"]);
    r.run = Some(RUN);
    // short of room for every weight (and the scratch), with room for the ends and the first layer cycle with
    // their KV at pages of 64 positions
    r.options.kv.page_size = 64;
    r.max_memory = Some(costs.total_weight_bytes() * 6 / 5);
    let host = load(r, &mut ()).unwrap();
    let plan = host.plan.clone().unwrap();
    assert_eq!(plan.mode, Mode::LayerSplit);
    let l1 = plan.host.layers.end;
    assert!(0 < l1 && l1 < 8, "{:?}", plan.host);
    assert_eq!(host.model.layer_range(), 0..l1);
    assert_eq!(host.request.placement.layer_split[0], l1);
    // the workers the plan left without layers are dropped from the chain
    let used = plan.workers.iter().filter(|w| !w.layers.is_empty()).count();
    assert_eq!(host.request.workers.addrs.len(), used);
    let s = host.session().unwrap();
    let chain = s.layer_split().unwrap();
    assert_eq!(chain.host_end(), l1);
    assert_eq!(chain.stages()[0].range().start, l1);
    assert_eq!(chain.stages().last().unwrap().range().end, 8);
}

#[test]
fn a_host_that_holds_the_weights_but_not_the_runs_kv_offloads_its_oldest_pages() {
    let dir = fixture("tiny-f32");
    let (_, costs) = ModelCosts::from_dir(&dir, backburner_kernels::kv::KvDtype::F16).unwrap();
    let mut r = request("tiny-f32", &["127.0.0.1:1"]);
    let need = RunNeed {
        positions: 4096,
        ubatch: 64,
    };
    r.run = Some(need);
    r.options.kv.page_size = 256;
    // every weight, state and buffer, and half the run's KV cache
    let all = 0..8;
    let fixed = costs.total_weight_bytes()
        + costs.state_bytes(all.clone())
        + costs.scratch_bytes(need.ubatch, true, true);
    r.max_memory = Some(fixed + costs.kv_bytes(all, 4096) / 2);
    let host = load(r, &mut ()).unwrap();
    let plan = host.plan.clone().unwrap();
    let Mode::KvOffload { host_kv_positions } = plan.mode else {
        panic!("{plan:?}")
    };
    assert!(host_kv_positions > 0 && host_kv_positions < 4096 && host_kv_positions % 256 == 0);
    let budget = Some(crate::offload::KvBudget::Positions(host_kv_positions));
    assert_eq!(host.request.options.kv_budget, budget);
    assert_eq!(host.model.layer_range(), 0..8);
    let s = host.session().unwrap();
    assert_eq!(s.options().kv_budget, budget);
    assert_eq!(s.workers().len(), 1);
}

#[test]
fn a_fixed_placement_is_not_planned() {
    let mut r = request("tiny-f32", &["127.0.0.1:1"]);
    r.run = Some(RUN);
    r.max_memory = Some(1 << 30);
    r.placement.layer_split = vec![4];
    let (host, s) = open(r, &mut ()).unwrap();
    assert!(host.plan.is_none());
    assert_eq!(host.model.layer_range(), 0..4);
    assert_eq!(s.layer_split().unwrap().stages()[0].range(), 4..8);
}

#[test]
fn flags_that_do_not_fit_the_model_are_refused_with_their_messages() {
    let with = |f: &dyn Fn(&mut SessionRequest)| {
        let mut r = request("tiny-f32", &["127.0.0.1:1"]);
        f(&mut r);
        refusal(r)
    };
    assert_eq!(
        with(&|r| {
            r.run = Some(RUN);
            r.max_memory = Some(1 << 30);
            r.workers.addrs.push("127.0.0.1:2".into());
            r.workers.memory = vec![1 << 30];
        }),
        "--worker-memory is given 1 time for 2 --workers: give it once per worker, in --worker order"
    );
    assert_eq!(
        with(&|r| r.placement.layer_split = vec![9]),
        "--layer-split 9 is past this 8-layer model's last layer"
    );
    assert_eq!(
        with(&|r| r.placement.layer_split = vec![8]),
        "--layer-split 8 leaves worker 1 no layers: split points must increase and stay below the model's 8 layers"
    );
    assert_eq!(
        with(&|r| r.placement.layer_split = vec![2, 4]),
        "--layer-split gives 2 split points for 1 --worker: one per worker, the first layer each holds"
    );
    assert_eq!(
        with(&|r| r.placement.split_layer = Some(0)),
        "--split-layer 0 leaves the host no layers: the host runs layers [0, L) and the worker [L, 8); valid: 4"
    );
    assert!(with(&|r| r.placement.split_layer = Some(8))
        .starts_with("--split-layer 8 is the end of this 8-layer"));
    assert_eq!(
        with(&|r| r.placement.split_layer = Some(3)),
        "--split-layer 3 is not on a 4-layer cycle boundary of this 8-layer model; valid: 4"
    );
    assert_eq!(
        with(&|r| r.workers.addrs.push("127.0.0.1:1".into())),
        "--worker 127.0.0.1:1 is given twice (as 127.0.0.1:1 before)"
    );
    assert_eq!(
        with(&|r| r.placement.expert_split = vec![2]),
        "--expert-split needs a mixture-of-experts model; this one (qwen3_5_text) is dense"
    );
    assert_eq!(
        with(&|r| {
            r.options.kv.page_size = 100;
            r.options.kv_budget = Some(crate::offload::KvBudget::Positions(200));
        }),
        "--kv-page-size 100 must be a multiple of 64 for workers to hold KV pages (--kv-budget with --worker)"
    );
}

#[test]
fn expert_splits_are_checked_against_the_experts() {
    let with = |split: Vec<usize>, ids: Option<&str>| {
        let mut r = request("tiny-moe-f32", &["127.0.0.1:1"]);
        r.placement.expert_split = split;
        r.placement.expert_ids = ids.map(str::to_string);
        refusal(r)
    };
    assert_eq!(
        with(vec![1, 2], None),
        "--expert-split gives 2 first layer(s) for 1 --worker(s): one per worker"
    );
    assert_eq!(
        with(vec![2], Some("3-9")),
        "--expert-ids: \"3-9\" is not within 0-7 (this model has 8 experts per layer)"
    );
    assert_eq!(with(vec![2], Some(",")), "--expert-ids names no expert");
    assert_eq!(
        parse_expert_ids("0-3,7, 5", 8).unwrap(),
        vec![0, 1, 2, 3, 5, 7]
    );
    // nothing listens there: the refusal comes before a session exists
    assert!(with(vec![2], Some("0-3")).starts_with("cannot use the experts' workers: "));
}

#[test]
fn memory_refusals_name_what_does_not_fit() {
    let mut r = request("tiny-f32", &[]);
    r.max_memory = Some(1000);
    let e = refusal(r);
    assert!(
        e.starts_with("weights of layers 0..8 and the ends need "),
        "{e}"
    );
    assert!(e.contains("--max-memory is 1 KB"), "{e}");
    // the weights fit, the KV cache of the run does not
    let mut r = request("tiny-f32", &[]);
    r.max_memory = Some(2_500_000);
    r.run = Some(RunNeed {
        positions: 4096,
        ubatch: 64,
    });
    let e = refusal(r);
    assert!(e.starts_with("the KV cache of 4096 positions need "), "{e}");
}

#[test]
fn workers_that_cannot_hold_the_page_size_are_left_out_with_a_warning() {
    let mut r = request("tiny-f32", &["127.0.0.1:1"]);
    r.options.kv.page_size = 100;
    let mut heard = Heard::default();
    let host = load(r, &mut heard).unwrap();
    assert!(host.session().unwrap().workers().is_empty());
    assert_eq!(
        heard.0,
        ["--kv-page-size 100 is not a multiple of 64, which workers require: the prompt runs on this host alone \
          (--worker is ignored)"]
    );
}

#[test]
fn expert_id_lists_parse_and_place() {
    assert_eq!(parse_expert_ids("2", 8).unwrap(), vec![2]);
    for bad in ["8", "3-1", "a", "1-", "", ","] {
        assert!(parse_expert_ids(bad, 8).is_err(), "{bad:?}");
    }
    let away = vec![(2..4, vec![1, 5])];
    assert!(is_away(&away, 3, 5) && !is_away(&away, 1, 5) && !is_away(&away, 3, 2));
}

#[test]
fn layers_placed_at_load_leave_the_host_and_its_memory_limit() {
    let place = |layers| LayerPlacement {
        layers,
        backend: Arc::new(backburner_model::device::CpuBackend),
    };
    let mut r = request("tiny-f32", &[]);
    r.run = Some(RUN);
    let (plain, s) = open(r.clone(), &mut ()).unwrap();
    let all = plain.model.weight_bytes();
    assert_eq!(s.memory().weights, all as u64);
    assert_eq!(s.memory().device_weights, 0);
    // a limit below the model's weights: refused on the CPU, room enough with every layer on the device
    r.max_memory = Some(all as u64 - 1);
    assert!(matches!(
        open(r.clone(), &mut ()),
        Err(OpenError::Memory(_))
    ));
    let host = load_placed(r.clone(), Some(place(0..8)), &mut ()).unwrap();
    let m = &host.model;
    assert_eq!(m.placement()[0].0, 0..8);
    assert_eq!(m.weight_bytes(), all);
    let layers: usize = (0..8)
        .map(|i| plain.model.layer(i).unwrap().weight_bytes())
        .sum();
    assert_eq!(m.host_weight_bytes(), all - layers);
    let mem = host.session().unwrap().memory();
    assert_eq!(mem.weights, (all - layers) as u64);
    assert_eq!(mem.device_weights, m.device_weight_bytes());
    // the session's check counts the KV of the layers the host computes only: a limit that holds the host's
    // weights, the recurrent states and the buffers, but not the 4096 positions' KV of the attention layers
    let need = RunNeed {
        positions: 4096,
        ubatch: 64,
    };
    let cfg = plain.model.config();
    let fixed = |placed: usize| -> u64 {
        let on_device: usize = (0..placed)
            .map(|i| plain.model.layer(i).unwrap().weight_bytes())
            .sum();
        (all - on_device) as u64
            + crate::memory::recurrent_bytes(cfg, 0..8).unwrap()
            + crate::memory::scratch_estimate(cfg, need.ubatch).unwrap()
    };
    let kv = r.options.kv;
    assert!(crate::memory::kv_bytes(cfg, 7..8, kv, 4096).unwrap() > 0);
    let mut r4k = r.clone();
    r4k.run = Some(need);
    r4k.max_memory = Some(fixed(8) + 1);
    let every = load_placed(r4k.clone(), Some(place(0..8)), &mut ()).unwrap();
    every.session().unwrap();
    // six layers placed: layer 7 (attention) runs on the CPU, and its KV counts
    r4k.max_memory = Some(fixed(6) + 1);
    let six = load_placed(r4k, Some(place(0..6)), &mut ()).unwrap();
    let Err(e) = six.session() else {
        panic!("the CPU layers' KV was not counted")
    };
    assert!(
        e.to_string().contains("the KV cache of 4096 positions"),
        "{e}"
    );
    // the layers split across workers: refused before anything loads
    let mut r = request("tiny-f32", &["127.0.0.1:1"]);
    r.placement.layer_split = vec![4];
    let e = load_placed(r, Some(place(0..2)), &mut ()).err().unwrap();
    assert!(matches!(e, OpenError::DeviceWithSplit { .. }), "{e}");
}
