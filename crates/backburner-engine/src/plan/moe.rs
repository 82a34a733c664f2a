//! What a mixture-of-experts model's decode reads of its weights: all of a layer's but the routed experts, of which
//! only the k a token is routed to (a layer's total and active bytes, from the architecture's table).

use backburner_model::arch::arch_of;

use super::PlanRequest;

/// The active share of each decoder layer's weights in decode: `(all − experts + experts · k / E) / all`, by
/// elements of the architecture's table (1 for a dense layer).
pub fn active_share(req: &PlanRequest) -> Vec<f64> {
    let c = &req.config;
    let arch = arch_of(c);
    let (k, e) = c
        .moe
        .as_ref()
        .map_or((1, 1), |m| (m.num_experts_per_tok, m.num_experts));
    (0..c.num_hidden_layers)
        .map(|i| {
            let specs = arch.layer_tensors(c, i);
            let all: u64 = specs.iter().map(|t| t.elements()).sum();
            let experts: u64 = specs
                .iter()
                .filter(|t| t.expert.is_some())
                .map(|t| t.elements())
                .sum();
            let active = (all - experts) as f64 + experts as f64 * k as f64 / e as f64;
            active / (all as f64).max(1.0)
        })
        .collect()
}

/// Elements of layer `i`'s routed experts (0 for a dense layer), from the architecture's table.
pub fn expert_params(c: &backburner_model::ModelConfig, i: usize) -> u64 {
    arch_of(c)
        .layer_tensors(c, i)
        .iter()
        .filter(|t| t.expert.is_some())
        .map(|t| t.elements())
        .sum()
}

/// The note a plan of a mixture-of-experts model carries: the layers' total and active weight bytes.
pub fn note(req: &PlanRequest) -> Option<String> {
    let m = req.config.moe.as_ref()?;
    let total: u64 = req.costs.layer_weight_bytes.iter().sum();
    let active: f64 = active_share(req)
        .iter()
        .zip(&req.costs.layer_weight_bytes)
        .map(|(s, &b)| s * b as f64)
        .sum();
    Some(format!(
        "mixture of experts: a decode step reads about {} of the layers' {} of weights ({} of {} routed experts per \
         MoE layer, and every router, shared expert and mixer); the host and workers must still hold all of them",
        crate::memory::human(active as u64),
        crate::memory::human(total),
        m.num_experts_per_tok,
        m.num_experts
    ))
}
