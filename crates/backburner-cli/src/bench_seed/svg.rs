//! One plot per row of the seed table: for each line, horizontal bars for ours, llama.cpp's and the original's
//! figure, scaled to the largest of the three (each line has its own unit), values written at the bars' ends.

use std::fmt::Write;

use super::report::RowReport;

const WIDTH: f64 = 880.0;
const LABEL_W: f64 = 300.0;
const BAR_H: f64 = 14.0;
const GAP: f64 = 12.0;
const COLOURS: [(&str, &str); 3] = [
    ("ours", "#1f6fb4"),
    ("llama.cpp", "#e07b1a"),
    ("original (its machines)", "#9a9a9a"),
];

/// Escapes text for SVG.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The SVG of `row`.
pub(super) fn plot(row: &RowReport) -> String {
    let group_h = 3.0 * BAR_H + GAP;
    let top = 46.0;
    let height = top + group_h * row.lines.len() as f64 + 10.0;
    let mut s = String::new();
    let _ = write!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"8\" y=\"16\" font-size=\"13\" font-weight=\"bold\">{}</text>\n",
        esc(&row.title)
    );
    for (i, (name, colour)) in COLOURS.iter().enumerate() {
        let x = 8.0 + 190.0 * i as f64;
        let _ = writeln!(
            s,
            "<rect x=\"{x}\" y=\"26\" width=\"10\" height=\"10\" fill=\"{colour}\"/><text x=\"{}\" y=\"35\">{name}</text>",
            x + 14.0
        );
    }
    let plot_w = WIDTH - LABEL_W - 90.0;
    for (k, l) in row.lines.iter().enumerate() {
        let y0 = top + group_h * k as f64;
        let vals = [l.ours_median(), l.llama_median(), l.seed];
        let max = vals.iter().flatten().fold(0.0_f64, |m, &v| m.max(v));
        let _ = writeln!(
            s,
            "<text x=\"8\" y=\"{}\">{} ({})</text>",
            y0 + 1.5 * BAR_H + 4.0,
            esc(&l.label),
            esc(l.unit)
        );
        for (j, v) in vals.iter().enumerate() {
            let Some(v) = v.filter(|v| v.is_finite()) else {
                continue;
            };
            let w = if max > 0.0 { plot_w * v / max } else { 0.0 };
            let y = y0 + BAR_H * j as f64;
            let _ = writeln!(
                s,
                "<rect x=\"{LABEL_W}\" y=\"{y}\" width=\"{w:.1}\" height=\"{}\" fill=\"{}\"/>\
                 <text x=\"{:.1}\" y=\"{}\">{}</text>",
                BAR_H - 2.0,
                COLOURS[j].1,
                LABEL_W + w + 4.0,
                y + BAR_H - 4.0,
                if v >= 100.0 {
                    format!("{v:.0}")
                } else {
                    format!("{v:.2}")
                }
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::super::report::{Line, RowReport};
    use super::*;

    #[test]
    fn bars_are_scaled_within_a_line_and_missing_figures_are_left_out() {
        let mut a = Line::new("prefill <16k>", "tok/s", Some(100.0));
        a.ours = vec![50.0];
        a.llama = vec![25.0];
        let row = RowReport {
            row: "x",
            title: "T & U".into(),
            setup: String::new(),
            lines: vec![a],
        };
        let svg = plot(&row);
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.contains("T &amp; U"));
        assert!(svg.contains("prefill &lt;16k&gt; (tok/s)"));
        let full = WIDTH - LABEL_W - 90.0;
        assert!(svg.contains(&format!("width=\"{:.1}\"", full)), "{svg}");
        assert!(
            svg.contains(&format!("width=\"{:.1}\"", full / 2.0)),
            "{svg}"
        );
        assert!(
            svg.contains(&format!("width=\"{:.1}\"", full / 4.0)),
            "{svg}"
        );
        assert_eq!(svg.matches("<rect x=\"300\"").count(), 3);
    }
}
