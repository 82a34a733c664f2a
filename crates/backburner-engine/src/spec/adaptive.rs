//! The draft length controller: how many tokens to draft at the next step, from the acceptance seen so far and the
//! cost of a verify step.
//!
//! # The model
//! Each draft is taken to be right with probability `a`, independently of the others (the per-position acceptance).
//! With `k` drafts a step keeps `j < k` of them with probability `a^j (1 − a)` and all `k` with `a^k`, and emits one
//! more token (the correction or the bonus token), so it emits on average
//! `E(a, k) = 1 + a + a² + … + a^k` tokens ([`expected_tokens`]). It costs, relative to one plain decode step,
//! `C(k) = V(k + 1) + k · D + (1 − a^k) · R` ([`CostModel::step_cost`]): `V(T)` the verify step of `T` positions
//! (`V(1) = 1`), `D` the cost of drafting one token (0 for n-gram drafts, the MTP block's share for MTP), `R` a
//! rollback after a rejection. The controller picks `k` in `0..=draft_max` maximizing `E(a, k) / C(k)`, the
//! expected speedup over plain decoding ([`best_k`]; ties to the smaller `k`). Drafting pays when
//! `E(a, 1) / C(1) > 1`, i.e. `a > V(2) − 1 + D + (1 − a) R`. At `a = 1` with `V(T) = 1 + β (T − 1)`, the ratio
//! `(k + 1) / (1 + β k + k D)` grows with `k` while `β + D < 1`, so `draft_max` is chosen.
//!
//! # The estimate
//! A step with `k` drafts and `j` kept is `j` successes in `j + 1` trials (`j` in `k`, if all were kept): the
//! geometric likelihood. Both counts decay by `decay` per step with drafts (an effective memory of
//! `1 / (1 − decay)` steps), starting from `prior_weight` trials at acceptance `prior`, so the prior fades too and
//! `a` estimated at `successes / trials` reaches 0 when nothing is accepted.
//!
//! # Probing
//! At `k = 0` nothing is learned. After `probe_interval` steps at 0 the controller asks for one draft (a probe);
//! each probe with nothing kept doubles the interval up to `max_probe_interval`, a kept one resets it. At 0 %
//! acceptance the overhead is one failed probe per `max_probe_interval` (64) steps, `(V(2) − 1 + D + R) / 64` of
//! a decode step each: 1.6 % when verifying 2 positions costs two decode steps (and `D = R = 0`), 0.16 % at
//! `V(2) = 1.1`; the start, from the prior down to 0, adds a few steps of drafting once. A step where the source
//! proposes nothing (`drafted = 0`) tells nothing and leaves a probe due.

use crate::error::{EngineError, Result};

/// `E(a, k) = 1 + a + … + a^k`: the tokens a step with `k` drafts emits on average when each is right with
/// probability `a` (in [0, 1]).
pub fn expected_tokens(a: f64, k: usize) -> f64 {
    let mut term = 1.0;
    let mut sum = 1.0;
    for _ in 0..k {
        term *= a;
        sum += term;
    }
    sum
}

/// The cost of a speculative step relative to one plain decode step (see the module documentation).
#[derive(Clone, Debug, PartialEq)]
pub struct CostModel {
    /// `V(T)` for `T = 1..=verify.len()` at index `T − 1`; `verify[0] = 1`.
    verify: Vec<f64>,
    /// `D`: drafting one token.
    draft_per_token: f64,
    /// `R`: a rollback after a rejection.
    rollback: f64,
}

impl Default for CostModel {
    /// `V(T) = 1 + 0.1 (T − 1)` up to `T = 17`, no drafting or rollback cost: a placeholder until measured.
    fn default() -> Self {
        CostModel::linear(0.1, 16).expect("valid")
    }
}

fn check_cost(name: &str, v: f64) -> Result<()> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(EngineError::InvalidInput(format!(
            "speculative cost {name} {v} must be a finite number ≥ 0"
        )))
    }
}

impl CostModel {
    /// `V(T) = 1 + per_position · (T − 1)` for `T` up to `max_k + 1`.
    ///
    /// Errors: [`EngineError::InvalidInput`] when `per_position` is not finite and ≥ 0.
    pub fn linear(per_position: f64, max_k: usize) -> Result<Self> {
        check_cost("per position", per_position)?;
        Ok(CostModel {
            verify: (0..=max_k).map(|i| 1.0 + per_position * i as f64).collect(),
            draft_per_token: 0.0,
            rollback: 0.0,
        })
    }

    /// `V(T)` from measured times: `times[T − 1]` the seconds (or any unit) of a verify step of `T` positions,
    /// `times[0]` a plain decode step.
    ///
    /// Errors: [`EngineError::InvalidInput`] when `times` is empty or holds a time that is not finite and > 0.
    pub fn from_verify_times(times: &[f64]) -> Result<Self> {
        if times.is_empty() || times.iter().any(|t| !(t.is_finite() && *t > 0.0)) {
            return Err(EngineError::InvalidInput(format!(
                "verify times {times:?} must be finite and > 0, one at least"
            )));
        }
        Ok(CostModel {
            verify: times.iter().map(|t| t / times[0]).collect(),
            draft_per_token: 0.0,
            rollback: 0.0,
        })
    }

    /// With `D`, the cost of drafting one token. Errors: [`EngineError::InvalidInput`] unless finite and ≥ 0.
    pub fn with_draft_cost(mut self, per_token: f64) -> Result<Self> {
        check_cost("per draft", per_token)?;
        self.draft_per_token = per_token;
        Ok(self)
    }

    /// With `R`, the cost of a rollback. Errors: [`EngineError::InvalidInput`] unless finite and ≥ 0.
    pub fn with_rollback_cost(mut self, cost: f64) -> Result<Self> {
        check_cost("of a rollback", cost)?;
        self.rollback = cost;
        Ok(self)
    }

    /// The largest `k` the model knows a verify cost for.
    pub fn max_k(&self) -> usize {
        self.verify.len() - 1
    }

    /// `C(k) = V(k + 1) + k · D + (1 − a^k) · R` for `k ≤` [`CostModel::max_k`] (clamped to it).
    pub fn step_cost(&self, k: usize, a: f64) -> f64 {
        let k = k.min(self.max_k());
        let reject = if k == 0 { 0.0 } else { 1.0 - a.powi(k as i32) };
        self.verify[k] + k as f64 * self.draft_per_token + reject * self.rollback
    }
}

/// The `k` in `0..=min(draft_max, cost.max_k())` maximizing `E(a, k) / C(k)`; the smaller `k` on ties.
pub fn best_k(a: f64, cost: &CostModel, draft_max: usize) -> usize {
    let a = if a.is_nan() { 0.0 } else { a.clamp(0.0, 1.0) };
    let mut best = (0, 1.0 / cost.step_cost(0, a));
    for k in 1..=draft_max.min(cost.max_k()) {
        let gain = expected_tokens(a, k) / cost.step_cost(k, a);
        if gain > best.1 * (1.0 + 1e-12) {
            best = (k, gain);
        }
    }
    best.0
}

/// Settings of [`AdaptiveDraft`].
#[derive(Clone, Debug, PartialEq)]
pub struct AdaptiveConfig {
    /// Most drafts per step.
    pub draft_max: usize,
    /// The cost of a step ([`CostModel`]).
    pub cost: CostModel,
    /// Per-step decay of the acceptance counts, in (0, 1) (0.8: a memory of about 5 steps).
    pub decay: f64,
    /// The acceptance assumed at the start, in [0, 1].
    pub prior: f64,
    /// How many trials the prior weighs at the start (> 0).
    pub prior_weight: f64,
    /// Steps at `k = 0` before the first probe (≥ 1).
    pub probe_interval: usize,
    /// Longest interval between probes (≥ `probe_interval`).
    pub max_probe_interval: usize,
}

impl AdaptiveConfig {
    /// Defaults with `draft_max`: [`CostModel::default`] (to replace by a measured one), decay 0.8, prior 0.5 over
    /// 2 trials, probes every 8 steps growing to 64.
    pub fn new(draft_max: usize) -> Self {
        AdaptiveConfig {
            draft_max,
            cost: CostModel::default(),
            decay: 0.8,
            prior: 0.5,
            prior_weight: 2.0,
            probe_interval: 8,
            max_probe_interval: 64,
        }
    }
}

/// Counts of a speculative run (for metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Steps observed (with or without drafts).
    pub steps: u64,
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafts kept.
    pub accepted: u64,
}

impl SpecStats {
    /// Share of drafted tokens kept (0 with none drafted).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens emitted per step: kept drafts plus one per step (0 with no step).
    pub fn tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            (self.accepted + self.steps) as f64 / self.steps as f64
        }
    }
}

/// The draft length controller (see the module documentation).
#[derive(Clone, Debug)]
pub struct AdaptiveDraft {
    cfg: AdaptiveConfig,
    /// Decayed kept drafts and trials.
    successes: f64,
    trials: f64,
    /// Steps at `k = 0` since the last draft or probe.
    idle: usize,
    /// The current interval between probes.
    probe_every: usize,
    /// The last `next_k` asked for a probe not yet observed with drafts.
    probing: bool,
    stats: SpecStats,
}

impl AdaptiveDraft {
    /// A controller with `cfg`.
    ///
    /// Errors: [`EngineError::InvalidInput`] for a decay outside (0, 1), a prior outside [0, 1], a prior weight not
    /// > 0, or probe intervals not `1 ≤ probe_interval ≤ max_probe_interval`.
    pub fn new(cfg: AdaptiveConfig) -> Result<Self> {
        let bad = |m: &str| Err(EngineError::InvalidInput(format!("draft control: {m}")));
        if !(cfg.decay > 0.0 && cfg.decay < 1.0) {
            return bad("decay must be in (0, 1)");
        }
        if !(0.0..=1.0).contains(&cfg.prior) {
            return bad("prior acceptance must be in [0, 1]");
        }
        if !(cfg.prior_weight > 0.0 && cfg.prior_weight.is_finite()) {
            return bad("prior weight must be > 0");
        }
        if cfg.probe_interval == 0 || cfg.probe_interval > cfg.max_probe_interval {
            return bad("probe intervals must satisfy 1 ≤ probe_interval ≤ max_probe_interval");
        }
        Ok(AdaptiveDraft {
            successes: cfg.prior * cfg.prior_weight,
            trials: cfg.prior_weight,
            idle: 0,
            probe_every: cfg.probe_interval,
            probing: false,
            stats: SpecStats::default(),
            cfg,
        })
    }

    /// The settings.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.cfg
    }

    /// Replaces the cost model (e.g. with one measured on this machine and placement).
    pub fn set_cost(&mut self, cost: CostModel) {
        self.cfg.cost = cost;
    }

    /// The estimated per-position acceptance `a`, in [0, 1].
    pub fn acceptance(&self) -> f64 {
        (self.successes / self.trials).clamp(0.0, 1.0)
    }

    /// Counts so far.
    pub fn stats(&self) -> SpecStats {
        self.stats
    }

    /// How many tokens to draft at the next step, in `0..=draft_max`: [`best_k`] at the estimated acceptance, or 1
    /// when a probe is due.
    pub fn next_k(&mut self) -> usize {
        let k = best_k(self.acceptance(), &self.cfg.cost, self.cfg.draft_max);
        if k > 0 {
            self.idle = 0;
            self.probing = false;
            self.probe_every = self.cfg.probe_interval;
            return k;
        }
        self.idle += 1;
        if self.idle >= self.probe_every && self.cfg.draft_max > 0 {
            self.probing = true;
            return 1;
        }
        0
    }

    /// The outcome of a step: `drafted` tokens verified (0: a plain step), the first `accepted` kept.
    pub fn observe(&mut self, drafted: usize, accepted: usize) {
        let accepted = accepted.min(drafted);
        self.stats.steps += 1;
        self.stats.drafted += drafted as u64;
        self.stats.accepted += accepted as u64;
        if drafted == 0 {
            return;
        }
        let trials = accepted + usize::from(accepted < drafted);
        self.successes = self.cfg.decay * self.successes + accepted as f64;
        self.trials = self.cfg.decay * self.trials + trials as f64;
        if self.probing {
            self.probing = false;
            self.idle = 0;
            self.probe_every = if accepted > 0 {
                self.cfg.probe_interval
            } else {
                (self.probe_every * 2).min(self.cfg.max_probe_interval)
            };
        }
    }
}

#[cfg(test)]
#[path = "tests_adaptive.rs"]
mod tests;
