//! The report of `backburner bench session`: a row per turn (what each mode measured), the totals, and the text
//! table.

use serde::Serialize;
use serde_json::Value;

use crate::bench_session_http::Reply;

/// One turn's measurements.
#[derive(Serialize)]
pub(crate) struct TurnRow {
    pub turn: usize,
    /// Messages the turn adds.
    pub messages: usize,
    pub prompt_tokens: usize,
    pub cold: Option<Reply>,
    pub worker: Option<Reply>,
    pub warm: Option<Reply>,
    /// Whether the warm answer's text equals the cold one's (greedy; null unless both ran).
    pub warm_matches_cold: Option<bool>,
    /// Whether the worker answer's text equals the cold one's (null unless both ran).
    pub worker_matches_cold: Option<bool>,
}

impl TurnRow {
    /// An empty row per turn (`turns[k]`: turn k's messages).
    pub fn for_turns(turns: &[Vec<Value>]) -> Vec<TurnRow> {
        turns
            .iter()
            .enumerate()
            .map(|(k, m)| TurnRow {
                turn: k,
                messages: m.len(),
                prompt_tokens: 0,
                cold: None,
                worker: None,
                warm: None,
                warm_matches_cold: None,
                worker_matches_cold: None,
            })
            .collect()
    }

    /// Whether any mode measured this turn.
    pub fn measured(&self) -> bool {
        self.cold.is_some() || self.worker.is_some() || self.warm.is_some()
    }

    /// Fills the `*_matches_cold` fields from the answers' texts.
    pub fn compare(&mut self) {
        let same = |x: &Option<Reply>| match (&self.cold, x) {
            (Some(c), Some(o)) => Some(c.text == o.text),
            _ => None,
        };
        self.warm_matches_cold = same(&self.warm);
        self.worker_matches_cold = same(&self.worker);
    }
}

/// A progress line on stderr.
pub(crate) fn progress(mode: &str, k: usize, r: &Reply) {
    eprintln!(
        "{mode:>6} turn {k:>2}: {:>6} prompt tokens ({:>6} cached): first answer {:>8.3} s, done {:>8.3} s",
        r.prompt_tokens, r.cached_tokens, r.first_answer_s, r.total_s
    );
}

/// Sums over the turns.
#[derive(Serialize)]
pub(crate) struct Totals {
    /// Turns measured cold.
    cold_turns: usize,
    /// Seconds to the first answer summed over the cold turns: alone, with the worker, and warm on the same turns.
    cold_s: Option<f64>,
    worker_s: Option<f64>,
    warm_same_turns_s: Option<f64>,
    /// Warm, over every turn: the whole session's waiting.
    warm_all_turns_s: Option<f64>,
    /// Prompt tokens reused from the cache over the warm turns, and prompt tokens in all.
    warm_cached_tokens: usize,
    warm_prompt_tokens: usize,
    /// cold_s / worker_s.
    worker_speedup: Option<f64>,
    /// cold_s / warm_same_turns_s.
    warm_speedup: Option<f64>,
}

impl Totals {
    pub fn of(rows: &[TurnRow], cold_turns: &[usize]) -> Totals {
        // Σ over the cold turns of one mode's first-answer time; None unless that mode measured every one of them.
        let sum = |mode: fn(&TurnRow) -> &Option<Reply>| -> Option<f64> {
            if cold_turns.is_empty() {
                return None;
            }
            cold_turns
                .iter()
                .map(|&k| {
                    let row = rows.iter().find(|r| r.turn == k)?;
                    mode(row).as_ref().map(|x| x.first_answer_s)
                })
                .sum()
        };
        let cold = sum(|r| &r.cold);
        let worker = sum(|r| &r.worker);
        let warm_same = sum(|r| &r.warm);
        let warm: Vec<&Reply> = rows.iter().filter_map(|r| r.warm.as_ref()).collect();
        let ratio = |x: Option<f64>, y: Option<f64>| Some(x? / y?);
        Totals {
            cold_turns: cold_turns.len(),
            cold_s: cold,
            worker_s: worker,
            warm_same_turns_s: warm_same,
            warm_all_turns_s: (!warm.is_empty())
                .then(|| warm.iter().map(|r| r.first_answer_s).sum()),
            warm_cached_tokens: warm.iter().map(|r| r.cached_tokens).sum(),
            warm_prompt_tokens: warm.iter().map(|r| r.prompt_tokens).sum(),
            worker_speedup: ratio(cold, worker),
            warm_speedup: ratio(cold, warm_same),
        }
    }
}

/// The per-turn table and the totals, as text.
pub(crate) fn table(rows: &[TurnRow], t: &Totals) -> String {
    let s = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.3}"));
    let first = |r: &Option<Reply>| s(r.as_ref().map(|x| x.first_answer_s));
    let mut out = format!(
        "{:>4} {:>4} {:>8} | {:>12} {:>14} | {:>10} {:>8}\n",
        "turn", "msgs", "prompt", "cold alone s", "cold worker s", "warm s", "cached"
    );
    for r in rows {
        out += &format!(
            "{:>4} {:>4} {:>8} | {:>12} {:>14} | {:>10} {:>8}\n",
            r.turn,
            r.messages,
            r.prompt_tokens,
            first(&r.cold),
            first(&r.worker),
            first(&r.warm),
            r.warm
                .as_ref()
                .map_or("-".into(), |w| w.cached_tokens.to_string()),
        );
    }
    let x = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.2}x"));
    out += &format!(
        "total over the {} cold turn(s): cold alone {} s, cold with worker {} s ({}), warm {} s ({})\n",
        t.cold_turns,
        s(t.cold_s),
        s(t.worker_s),
        x(t.worker_speedup),
        s(t.warm_same_turns_s),
        x(t.warm_speedup),
    );
    out += &format!(
        "warm, whole session: {} s to first answers, {} of {} prompt tokens from the cache",
        s(t.warm_all_turns_s),
        t.warm_cached_tokens,
        t.warm_prompt_tokens
    );
    out
}
