//! The planner's expert placement, on the 35B-A3B's shapes (from config.json shapes at bf16).

use backburner_kernels::kv::KvDtype;
use backburner_model::ModelConfig;

use super::*;

const GB: u64 = 1_000_000_000;

/// Qwen3.5-35B-A3B as the issue lists it: 40 layers (10 full attention), hidden 2048, 16/2 × 256 attention,
/// 16/32 × 128 linear, 256 experts of 512, 8 routed + 1 shared of 512.
fn a3b() -> ModelConfig {
    let mut j = backburner_model::synthetic::tiny_moe_config(40);
    for (k, v) in [
        ("vocab_size", 248_320),
        ("hidden_size", 2048),
        ("num_attention_heads", 16),
        ("num_key_value_heads", 2),
        ("head_dim", 256),
        ("linear_num_key_heads", 16),
        ("linear_num_value_heads", 32),
        ("linear_key_head_dim", 128),
        ("linear_value_head_dim", 128),
        ("num_experts", 256),
        ("num_experts_per_tok", 8),
        ("moe_intermediate_size", 512),
        ("shared_expert_intermediate_size", 512),
        ("max_position_embeddings", 262_144),
    ] {
        j[k] = v.into();
    }
    ModelConfig::from_json_str(&j.to_string()).unwrap()
}

fn request(cfg: ModelConfig, host: u64, workers: &[u64], ctx: Option<usize>) -> PlanRequest {
    let costs = ModelCosts::from_config(&cfg, 2, KvDtype::F16);
    PlanRequest {
        config: cfg,
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

#[test]
fn a_35b_a3b_past_the_host_puts_its_later_layers_experts_on_the_worker() {
    let req = request(a3b(), 16 * GB, &[64 * GB], Some(32_768));
    let c = &req.costs;
    // 256 experts × (2·512 + 512) × 2048 elements × 2 bytes per layer
    assert_eq!(c.layer_expert_bytes[0], 256 * 3 * 512 * 2048 * 2);
    let p = plan(&req).unwrap();
    assert_eq!(p.mode, Mode::ExpertSplit, "{:?}", p.notes);
    let w = &p.workers[0];
    assert_eq!(w.layers.end, 40);
    let l1 = w.layers.start;
    assert!(l1 > 0 && l1 < 40, "{l1}");
    // the host holds everything else, within its memory, with the KV of the whole context
    let away: u64 = c.layer_expert_bytes[l1..].iter().sum();
    assert_eq!(w.weight_bytes, away);
    assert_eq!(p.host.weight_bytes, c.total_weight_bytes() - away);
    assert!(p.host.total_bytes() <= p.host.memory && w.total_bytes() <= w.memory);
    assert!(p.max_ctx >= 32_768);
    // one more layer's experts kept on the host would not leave it the context
    let more = p.host.total_bytes() + c.layer_expert_bytes[l1];
    assert!(
        more > p.host.memory,
        "the host could keep layer {l1}'s experts"
    );
    assert!(
        p.notes.iter().any(|n| n.contains("experts on workers")),
        "{:?}",
        p.notes
    );
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("chosen over a layer split")),
        "{:?}",
        p.notes
    );
    assert_eq!(
        summary(&p),
        format!("experts on workers: the host holds all 40 layers, worker 1 the routed experts of {l1}..40; context up to {} tokens", p.max_ctx)
    );
    // per token: the row out with 8 routes and one back, per MoE layer on the worker
    assert_eq!(
        p.link.decode_bytes_per_token,
        (40 - l1) as u64 * (2 * 4 * 2048 + 16 + 64)
    );
}

#[test]
fn experts_go_to_several_workers_in_order_and_a_dense_model_or_a_tiny_host_gets_a_layer_split() {
    let req = request(a3b(), 16 * GB, &[20 * GB, 60 * GB], Some(8192));
    let p = plan(&req).unwrap();
    assert_eq!(p.mode, Mode::ExpertSplit);
    let (a, b) = (&p.workers[0].layers, &p.workers[1].layers);
    assert_eq!((a.end, b.start, b.end), (b.start, a.end, 40));
    assert!(p.workers.iter().all(|w| w.weight_bytes <= w.memory));
    // the host cannot even hold the mixers, shared experts and ends: no expert placement
    let req = request(a3b(), 3 * GB, &[100 * GB], Some(8192));
    let p = plan(&req).unwrap();
    assert_eq!(p.mode, Mode::LayerSplit);
    // a dense model of the same memory never gets one
    let mut dense = backburner_model::synthetic::tiny_config(40);
    dense["hidden_size"] = 4096.into();
    dense["intermediate_size"] = 16_384.into();
    let cfg = ModelConfig::from_json_str(&dense.to_string()).unwrap();
    let req = request(cfg, 4 * GB, &[100 * GB], Some(8192));
    assert_eq!(plan(&req).unwrap().mode, Mode::LayerSplit);
}

#[test]
fn an_all_moe_model_sizes_its_scratch_from_its_experts_not_the_dense_default() {
    // the MoE configs name no intermediate_size (transformers' class default is a dense size): an all-MoE model's
    // activations are its shared / routed experts' width, whatever that field says
    let mut j = backburner_model::synthetic::tiny_moe_config(4);
    let plain = ModelConfig::from_json_str(&j.to_string()).unwrap();
    j["intermediate_size"] = (1 << 18).into();
    let big = ModelConfig::from_json_str(&j.to_string()).unwrap();
    let per = |c: &ModelConfig| ModelCosts::from_config(c, 2, KvDtype::F16).scratch_bytes_per_token;
    assert_eq!(per(&plain), per(&big));
    // hidden 64: 3·64 + 3·(48 + 64) + 2·max(proj) + core, f32, times the factor
    assert!(per(&plain) < 4 * SCRATCH_FACTOR * 4096, "{}", per(&plain));
    // a model with a dense layer among the MoE ones counts the dense MLP too
    let mut n = backburner_model::synthetic::tiny_next_config(4);
    n["intermediate_size"] = (1 << 18).into();
    let next = ModelConfig::from_json_str(&n.to_string()).unwrap();
    assert!(per(&next) > 3 * 4 * SCRATCH_FACTOR * (1 << 18));
}
