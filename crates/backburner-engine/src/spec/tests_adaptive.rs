//! Tests of the draft length controller against simulated acceptance.

use super::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What a simulated run cost and produced.
#[derive(Default)]
struct Run {
    tokens: f64,
    cost: f64,
    ks: Vec<usize>,
}

impl Run {
    /// Tokens per unit of cost, relative to plain decoding (1 token per unit).
    fn speedup(&self) -> f64 {
        self.tokens / self.cost
    }
}

/// `steps` steps where each draft is right with probability `a` (a source that always has drafts), costed with
/// the controller's own model (a rollback only when a draft was rejected).
fn simulate(c: &mut AdaptiveDraft, a: f64, steps: usize, g: &mut StdRng) -> Run {
    let mut run = Run::default();
    for _ in 0..steps {
        let k = c.next_k();
        let kept = (0..k).take_while(|_| g.random_bool(a)).count();
        c.observe(k, kept);
        let cost = &c.config().cost;
        let rollback = if kept < k { cost.rollback } else { 0.0 };
        run.cost += cost.step_cost(k, 1.0) + rollback;
        run.tokens += (kept + 1) as f64;
        run.ks.push(k);
    }
    run
}

fn controller(draft_max: usize, cost: CostModel) -> AdaptiveDraft {
    let mut cfg = AdaptiveConfig::new(draft_max);
    cfg.cost = cost;
    AdaptiveDraft::new(cfg).unwrap()
}

#[test]
fn expected_tokens_and_step_costs_follow_their_formulas() {
    assert_eq!(expected_tokens(0.0, 5), 1.0);
    assert_eq!(expected_tokens(1.0, 5), 6.0);
    assert!((expected_tokens(0.5, 3) - 1.875).abs() < 1e-15);
    let c = CostModel::linear(0.25, 4)
        .unwrap()
        .with_draft_cost(0.1)
        .unwrap()
        .with_rollback_cost(0.5)
        .unwrap();
    assert_eq!(c.max_k(), 4);
    assert_eq!(c.step_cost(0, 0.3), 1.0);
    // V(3) = 1.5, 2 drafts at 0.1, rollback 0.5 with probability 1 − 0.25
    assert!((c.step_cost(2, 0.5) - (1.5 + 0.2 + 0.375)).abs() < 1e-12);
    assert_eq!(c.step_cost(9, 1.0), c.step_cost(4, 1.0));
    let m = CostModel::from_verify_times(&[2.0, 2.2, 2.6]).unwrap();
    assert!((m.step_cost(1, 0.0) - 1.1).abs() < 1e-12);
    assert_eq!(m.max_k(), 2);
}

#[test]
fn the_best_length_is_0_at_no_acceptance_the_maximum_at_full_and_grows_with_acceptance() {
    for per_position in [0.01, 0.1, 0.3, 0.9] {
        let c = CostModel::linear(per_position, 8).unwrap();
        assert_eq!(best_k(0.0, &c, 8), 0);
        assert_eq!(best_k(1.0, &c, 8), 8);
        assert_eq!(best_k(1.0, &c, 3), 3);
        let ks: Vec<usize> = (0..=100).map(|i| best_k(i as f64 / 100.0, &c, 8)).collect();
        assert!(
            ks.windows(2).all(|w| w[0] <= w[1]),
            "{per_position}: {ks:?}"
        );
        // drafting starts just where E(a, 1) / C(1) > 1, i.e. a > per_position
        let first = ks.iter().position(|&k| k > 0).unwrap() as f64 / 100.0;
        assert!(
            (first - per_position).abs() <= 0.011,
            "{per_position}: {first}"
        );
    }
    // a verify of T positions that costs T decode steps never pays
    let c = CostModel::linear(1.0, 8).unwrap();
    assert_eq!(best_k(0.99, &c, 8), 0);
    // the worked example of a = 0.8 at 0.1 per position: E/C is largest at k = 6
    assert_eq!(best_k(0.8, &CostModel::default(), 16), 6);
    assert_eq!(best_k(0.5, &CostModel::default(), 16), 2);
    assert_eq!(best_k(f64::NAN, &CostModel::default(), 16), 0);
}

#[test]
fn at_no_acceptance_decode_stays_within_3_percent_of_plain() {
    // the cost of a verify of 2 positions from nearly free (a link-bound layer split) to two decode steps
    for per_position in [0.02, 0.1, 0.3, 1.0] {
        let mut g = StdRng::seed_from_u64(1);
        let mut c = controller(8, CostModel::linear(per_position, 8).unwrap());
        let all = simulate(&mut c, 0.0, 2000, &mut g);
        assert!(all.speedup() >= 0.97, "{per_position}: {}", all.speedup());
        let late = simulate(&mut c, 0.0, 2000, &mut g);
        eprintln!(
            "a = 0, V(2) = {}: speedup {:.4} over the first 2000 steps, {:.4} over the next",
            1.0 + per_position,
            all.speedup(),
            late.speedup()
        );
        // one probe per 64 steps costs V(2) − 1 extra: 1.6 % when it is a whole decode step
        let bound = 1.0 / (1.0 + per_position / 64.0) - 1e-3;
        assert!(
            late.speedup() >= bound,
            "{per_position}: {}",
            late.speedup()
        );
        // only probes of one draft, at most one per 64 steps once backed off
        assert!(late.ks.iter().all(|&k| k <= 1));
        assert!(late.ks.iter().filter(|&&k| k == 1).count() <= 2000 / 64 + 1);
        assert!(c.acceptance() < 1e-6, "{}", c.acceptance());
    }
}

#[test]
fn at_full_acceptance_it_drafts_the_maximum() {
    for draft_max in [1, 3, 8] {
        let mut g = StdRng::seed_from_u64(2);
        let mut c = controller(draft_max, CostModel::default());
        let run = simulate(&mut c, 1.0, 200, &mut g);
        assert!(run.ks[5..].iter().all(|&k| k == draft_max), "{:?}", run.ks);
        assert!(c.acceptance() > 0.99);
    }
}

#[test]
fn in_between_it_gets_close_to_the_best_fixed_length() {
    for (a, per_position) in [(0.6, 0.1), (0.8, 0.1), (0.8, 0.3), (0.9, 0.05)] {
        let cost = CostModel::linear(per_position, 8).unwrap();
        let oracle = best_k(a, &cost, 8);
        let mut g = StdRng::seed_from_u64(3);
        let mut c = controller(8, cost.clone());
        let run = simulate(&mut c, a, 4000, &mut g);
        let best = expected_tokens(a, oracle) / cost.step_cost(oracle, 1.0);
        assert!(
            run.speedup() >= 0.9 * best,
            "a {a} β {per_position}: {} vs {best} at k {oracle}",
            run.speedup()
        );
        assert!(oracle > 0);
        let mean_k = run.ks.iter().sum::<usize>() as f64 / run.ks.len() as f64;
        eprintln!(
            "a {a}, β {per_position}: speedup {:.3} vs {best:.3} at the best fixed k {oracle}; mean k {mean_k:.2}",
            run.speedup()
        );
        assert!(
            (mean_k - oracle as f64).abs() <= 2.0,
            "a {a}: mean k {mean_k} vs {oracle}"
        );
    }
}

#[test]
fn after_a_run_without_acceptance_it_recovers_when_drafts_become_right() {
    let mut g = StdRng::seed_from_u64(4);
    let mut c = controller(6, CostModel::default());
    simulate(&mut c, 0.0, 1000, &mut g);
    let run = simulate(&mut c, 0.95, 400, &mut g);
    let back = run.ks.iter().position(|&k| k >= 4).expect("recovers");
    // a probe comes within 64 steps; a few kept drafts bring the estimate up
    assert!(
        back <= 64 + 20,
        "recovered after {back} steps: {:?}",
        &run.ks[..back + 1]
    );
    assert!(run.ks[back + 20..].iter().filter(|&&k| k >= 4).count() > 300);
}

#[test]
fn steps_without_drafts_teach_nothing_and_keep_a_probe_due() {
    let mut c = controller(4, CostModel::linear(0.5, 4).unwrap());
    // prior 0.5 at 0.5 per position: no drafting
    for _ in 0..7 {
        assert_eq!(c.next_k(), 0);
        c.observe(0, 0);
    }
    assert_eq!(c.next_k(), 1); // the 8th step at 0 probes
    let a = c.acceptance();
    for _ in 0..5 {
        c.observe(0, 0); // the source had nothing to propose
        assert_eq!(c.acceptance(), a);
        assert_eq!(c.next_k(), 1);
    }
    c.observe(1, 0); // a failed probe: the next one after 16 steps at 0
    assert!(c.acceptance() < a);
    for _ in 0..15 {
        assert_eq!(c.next_k(), 0);
        c.observe(0, 0);
    }
    assert_eq!(c.next_k(), 1);
    let s = c.stats();
    assert_eq!((s.steps, s.drafted, s.accepted), (28, 1, 0));
    assert_eq!(s.tokens_per_step(), 1.0);
}

#[test]
fn stats_count_drafts_and_kept_tokens() {
    let mut c = controller(4, CostModel::default());
    c.observe(4, 4);
    c.observe(4, 1);
    c.observe(0, 0);
    c.observe(2, 5); // more kept than drafted is clamped
    let s = c.stats();
    assert_eq!((s.steps, s.drafted, s.accepted), (4, 10, 7));
    assert!((s.acceptance() - 0.7).abs() < 1e-12);
    assert!((s.tokens_per_step() - 11.0 / 4.0).abs() < 1e-12);
}

#[test]
fn bad_settings_are_invalid_input() {
    let base = AdaptiveConfig::new(4);
    let changes: [fn(&mut AdaptiveConfig); 6] = [
        |c| c.decay = 1.0,
        |c| c.decay = 0.0,
        |c| c.prior = 1.5,
        |c| c.prior_weight = 0.0,
        |c| c.probe_interval = 0,
        |c| c.max_probe_interval = 4,
    ];
    for f in changes {
        let mut cfg = base.clone();
        f(&mut cfg);
        assert!(matches!(
            AdaptiveDraft::new(cfg),
            Err(EngineError::InvalidInput(_))
        ));
    }
    assert!(CostModel::linear(-0.1, 4).is_err());
    assert!(CostModel::linear(f64::NAN, 4).is_err());
    assert!(CostModel::from_verify_times(&[]).is_err());
    assert!(CostModel::from_verify_times(&[1.0, 0.0]).is_err());
    assert!(CostModel::default().with_draft_cost(-1.0).is_err());
    assert!(CostModel::default()
        .with_rollback_cost(f64::INFINITY)
        .is_err());
}
