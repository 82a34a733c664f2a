//! `bench spec`'s printed tables and its check of issue 37's targets.

use serde_json::json;

use super::{GenRow, MeasuredCost, Prediction, VerifyRow};

/// Issue 37's targets: at 80 % acceptance with `k = 3` (fixed) ≥ 1.4× locally, ≥ 1.8× over a layer split
/// (`split`); within 3 % of plain at 0 % (adaptive). Returns the JSON and the lines to print.
pub(super) fn targets(
    rows: &[GenRow],
    fixed_k: usize,
    split: bool,
) -> (serde_json::Value, Vec<String>) {
    let find = |rate: f64, mode: &str| {
        rows.iter()
            .find(|r| (r.error_rate - rate).abs() < 1e-9 && r.mode == mode)
    };
    let mut out = serde_json::Map::new();
    let mut lines = Vec::new();
    let (target, where_) = if split {
        (1.8, "over a layer split")
    } else {
        (1.4, "locally")
    };
    if let (Some(r), 3) = (find(0.2, "fixed"), fixed_k) {
        let met = r.ratio >= target;
        out.insert(
            "speedup_at_80_k3".into(),
            json!({"ratio": r.ratio, "target": target, "met": met}),
        );
        lines.push(format!(
            "target ≥ {target:.2}× {where_} at 80 % acceptance, k = 3: {:.2}× ({})",
            r.ratio,
            yes(met)
        ));
    }
    for mode in ["adaptive", "adaptive_measured"] {
        if let Some(r) = find(1.0, mode) {
            let met = r.ratio >= 0.97;
            out.insert(
                format!("{mode}_at_0"),
                json!({"ratio": r.ratio, "target": 0.97, "met": met}),
            );
            lines.push(format!(
                "target within 3 % of plain at 0 % acceptance ({mode}): {:.3}× ({})",
                r.ratio,
                yes(met)
            ));
        }
    }
    (serde_json::Value::Object(out), lines)
}

fn yes(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "NOT met"
    }
}

pub(super) fn verify_table(rows: &[VerifyRow], c: &MeasuredCost) -> String {
    let mut out = format!(
        "verify cost (decode step {:.2} ms):\n{:>3} {:>3} {:>10} {:>13} {:>7} {:>15} {:>14} {:>16}\n",
        c.decode_ms, "T", "k", "verify ms", "T decodes ms", "V(T)", "verify/decodes", "rollback→1 ms", "rollback→T−1 ms"
    );
    let opt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.3}"));
    for r in rows {
        out += &format!(
            "{:>3} {:>3} {:>10.2} {:>13.2} {:>7.3} {:>15.3} {:>14} {:>16}\n",
            r.t,
            r.t - 1,
            r.verify_ms,
            r.decodes_ms,
            r.v,
            r.verify_over_decodes,
            opt(r.rollback_to_1_ms),
            opt(r.rollback_to_t_minus_1_ms)
        );
    }
    out += &format!(
        "fit V(T) = 1 + β (T − 1): β = {:.3} (CostModel::default: 0.1); rollback R = {:.3} decode steps",
        c.per_position, c.rollback
    );
    out
}

pub(super) fn prediction_table(p: &[Prediction]) -> String {
    let mut out = format!(
        "draft length chosen (best_k) and predicted speedup under the measured costs:\n{:>10} {:>9} {:>8} {:>10} {:>8}\n",
        "acceptance", "k default", "speedup", "k measured", "speedup"
    );
    for r in p {
        out += &format!(
            "{:>10.2} {:>9} {:>7.2}x {:>10} {:>7.2}x\n",
            r.acceptance, r.k_default, r.speedup_default_k, r.k_measured, r.speedup_measured_k
        );
    }
    out.pop();
    out
}

pub(super) fn gen_table(rows: &[GenRow], n: usize) -> String {
    let mut out = format!(
        "tokens/s vs acceptance ({n} greedy tokens; tokens equal to plain in every run):\n{:>10} {:>21} {:>11} {:>10} {:>7} {:>6} {:>8} {:>8}\n",
        "acceptance", "mode", "plain tok/s", "spec tok/s", "ratio", "steps", "drafted", "accepted"
    );
    for r in rows {
        out += &format!(
            "{:>9.0}% {:>21} {:>11.2} {:>10.2} {:>6.2}x {:>6} {:>8} {:>8}\n",
            100.0 * (1.0 - r.error_rate),
            format!("{} ({})", r.mode, r.draft_max),
            r.plain_tok_s,
            r.spec_tok_s,
            r.ratio,
            r.counts.steps,
            r.counts.drafted,
            r.counts.accepted
        );
    }
    out.pop();
    out
}
