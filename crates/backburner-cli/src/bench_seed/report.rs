//! The seed table's figures: one line per measured quantity with our samples, llama.cpp's on the same file and the
//! original write-up's figure; medians, ratios, the Markdown table and the JSON.

use serde::Serialize;
use serde_json::{json, Value};

/// One measured quantity of a row.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Line {
    /// What is measured, e.g. `prefill 16384 tokens, split`.
    pub label: String,
    /// `tok/s`, `ms/token` or `s`.
    pub unit: &'static str,
    /// Whether a larger value is better (rates) or a smaller one (times).
    pub higher_is_better: bool,
    /// Our value in each round.
    pub ours: Vec<f64>,
    /// llama.cpp's value in each round on the same file (empty where it has no such configuration or was not run).
    pub llama: Vec<f64>,
    /// The original write-up's figure (its 27B on its machines), for reference only.
    pub seed: Option<f64>,
}

impl Line {
    /// A line with no samples yet.
    pub fn new(label: impl Into<String>, unit: &'static str, seed: Option<f64>) -> Line {
        Line {
            label: label.into(),
            unit,
            higher_is_better: unit.contains("/s"),
            ours: Vec::new(),
            llama: Vec::new(),
            seed,
        }
    }

    /// Our median.
    pub fn ours_median(&self) -> Option<f64> {
        median(&self.ours)
    }

    /// llama.cpp's median.
    pub fn llama_median(&self) -> Option<f64> {
        median(&self.llama)
    }

    /// How many times better ours is than llama.cpp's (rates: ours / theirs; times: theirs / ours).
    pub fn vs_llama(&self) -> Option<f64> {
        let (o, l) = (self.ours_median()?, self.llama_median()?);
        Some(if self.higher_is_better { o / l } else { l / o })
    }
}

/// A row of the table.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct RowReport {
    /// The row's name (its file stem).
    pub row: &'static str,
    /// The row's title.
    pub title: String,
    /// What was run, on what (model file, shape, threads, placements), and what llama.cpp ran.
    pub setup: String,
    pub lines: Vec<Line>,
}

/// The median (the upper one of an even count); None when empty.
pub(crate) fn median(v: &[f64]) -> Option<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

/// A figure with sensible digits, or `-`.
fn fig(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
    }
}

/// The table in Markdown, a section per row.
pub(crate) fn markdown(rows: &[RowReport]) -> String {
    let mut s = String::from("# The original's table at the 27B's per-layer shapes\n\n");
    s += "Ours and llama.cpp's on the same file, alternating rounds, medians; `vs llama.cpp` > 1 means ours is \
          better (rates: ours / theirs; times: theirs / ours). The original's figures are its own (the 27B on its \
          laptop and phone), for reference only.\n";
    for r in rows {
        s += &format!("\n## {}\n\n{}\n\n", r.title, r.setup);
        s += "| quantity | unit | ours | llama.cpp | vs llama.cpp | rounds | original |\n";
        s += "|---|---|---|---|---|---|---|\n";
        for l in &r.lines {
            s += &format!(
                "| {} | {} | {} | {} | {} | {} | {} |\n",
                l.label,
                l.unit,
                fig(l.ours_median()),
                fig(l.llama_median()),
                l.vs_llama().map_or("-".into(), |x| format!("{x:.2}×")),
                l.ours.len(),
                fig(l.seed),
            );
        }
        s += &format!("\n![{}]({}.svg)\n", r.title, r.row);
    }
    s
}

/// The table as JSON: every row with its lines' samples, medians and ratios.
pub(crate) fn json(rows: &[RowReport]) -> Value {
    let rows: Vec<Value> = rows
        .iter()
        .map(|r| {
            let lines: Vec<Value> = r
                .lines
                .iter()
                .map(|l| {
                    json!({
                        "label": l.label, "unit": l.unit, "higher_is_better": l.higher_is_better,
                        "ours": l.ours, "llama_cpp": l.llama, "seed": l.seed,
                        "ours_median": l.ours_median(), "llama_cpp_median": l.llama_median(),
                        "vs_llama_cpp": l.vs_llama(),
                    })
                })
                .collect();
            json!({"row": r.row, "title": r.title, "setup": r.setup, "lines": lines})
        })
        .collect();
    json!({"bench": "seed-table", "machine": crate::bench::machine_description(), "rows": rows})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_favour_the_better_side_for_rates_and_times() {
        let mut rate = Line::new("prefill", "tok/s", Some(64.0));
        rate.ours = vec![10.0, 30.0, 20.0];
        rate.llama = vec![8.0, 12.0];
        assert_eq!(rate.ours_median(), Some(20.0));
        assert_eq!(rate.llama_median(), Some(12.0));
        assert_eq!(rate.vs_llama(), Some(20.0 / 12.0));
        let mut time = Line::new("decode", "ms/token", None);
        time.ours = vec![50.0];
        time.llama = vec![100.0];
        assert!(!time.higher_is_better);
        assert_eq!(time.vs_llama(), Some(2.0));
        time.llama.clear();
        assert_eq!(time.vs_llama(), None);
        let md = markdown(&[RowReport {
            row: "zero-to-one",
            title: "Zero to one".into(),
            setup: "setup".into(),
            lines: vec![rate, time],
        }]);
        assert!(
            md.contains("| prefill | tok/s | 20.0 | 12.0 | 1.67× | 3 | 64.0 |"),
            "{md}"
        );
        assert!(
            md.contains("| decode | ms/token | 50.0 | - | - | 1 | - |"),
            "{md}"
        );
        assert!(md.contains("![Zero to one](zero-to-one.svg)"), "{md}");
    }
}
