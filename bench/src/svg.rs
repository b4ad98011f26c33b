//! A hand-written SVG chart of TTFT CDFs, one line per router configuration.
//!
//! The x axis is logarithmic: the configurations the benchmark compares differ by orders
//! of magnitude in the tail (the seeds claim -98% p99), which a linear axis flattens into
//! one corner. Dashed lines mark p50, p90 and p99. No plotting dependency: the chart is a
//! few polylines, and a benchmark run must not need Python.

use std::fmt::Write;

/// Line colours, one per series in order (colour-blind-safe Okabe-Ito palette).
const COLOURS: &[&str] = &[
    "#E69F00", "#56B4E9", "#009E73", "#CC79A7", "#0072B2", "#D55E00",
];

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 440.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 60.0;

/// Most points drawn per series; the last 2% of a series (its tail) is always kept whole.
const MAX_POINTS: usize = 1500;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Points (value, cumulative share) of the empirical CDF of sorted values, thinned to at
/// most about [`MAX_POINTS`].
fn cdf_points(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    let tail_start = n - n / 50;
    let stride = (tail_start / MAX_POINTS).max(1);
    let mut pts = Vec::new();
    for (i, &v) in sorted.iter().enumerate() {
        if i >= tail_start || i % stride == 0 || i + 1 == n {
            pts.push((v, (i + 1) as f64 / n as f64));
        }
    }
    pts
}

/// The SVG document for the given series of TTFT samples in milliseconds. Series without
/// samples are listed in the legend as having none.
pub fn ttft_cdf_svg(title: &str, series: &[(String, Vec<f64>)]) -> String {
    let mut sorted: Vec<(String, Vec<f64>)> = series
        .iter()
        .map(|(name, v)| {
            let mut v: Vec<f64> = v
                .iter()
                .copied()
                .filter(|x| x.is_finite() && *x > 0.0)
                .collect();
            v.sort_by(f64::total_cmp);
            (name.clone(), v)
        })
        .collect();
    let all = sorted.iter().flat_map(|(_, v)| v.iter().copied());
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    let (lo, hi) = if lo.is_finite() {
        (lo, hi)
    } else {
        (1.0, 10.0)
    };
    // whole decades around the data
    let d_lo = lo.log10().floor();
    let d_hi = hi.log10().ceil().max(d_lo + 1.0);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x_of = |v: f64| LEFT + (v.log10() - d_lo) / (d_hi - d_lo) * plot_w;
    let y_of = |q: f64| TOP + (1.0 - q) * plot_h;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="15" font-weight="bold">{}</text>"#,
        LEFT,
        escape(title)
    );
    // decade grid and labels
    let mut d = d_lo;
    while d <= d_hi + 1e-9 {
        let x = LEFT + (d - d_lo) / (d_hi - d_lo) * plot_w;
        let v = 10f64.powf(d);
        let label = if v >= 1000.0 {
            format!("{} s", v / 1000.0)
        } else {
            format!("{v} ms")
        };
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{label}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 18.0
        );
        d += 1.0;
    }
    for (q, label) in [
        (0.0, "0"),
        (0.25, "0.25"),
        (0.5, "0.5"),
        (0.75, "0.75"),
        (1.0, "1"),
    ] {
        let y = y_of(q);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            y + 4.0
        );
    }
    for (q, label) in [(0.9, "p90"), (0.99, "p99")] {
        let y = y_of(q);
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#999" stroke-dasharray="4 3"/><text x="{:.1}" y="{:.1}" fill="#666">{label}</text>"##,
            LEFT + plot_w,
            LEFT + plot_w + 4.0,
            y + 4.0
        );
    }
    let _ = writeln!(
        s,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333"/>"##
    );
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time to first token (log scale)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 16.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">share of requests</text>"#,
        TOP + plot_h / 2.0
    );
    for (i, (name, v)) in sorted.iter_mut().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        if !v.is_empty() {
            let mut pts = String::new();
            // a step function: each sample raises the curve at its own x
            let mut prev_q = 0.0;
            for (x, q) in cdf_points(v) {
                let _ = write!(
                    pts,
                    "{:.1},{:.1} {:.1},{:.1} ",
                    x_of(x),
                    y_of(prev_q),
                    x_of(x),
                    y_of(q)
                );
                prev_q = q;
            }
            let _ = writeln!(
                s,
                r#"<polyline fill="none" stroke="{colour}" stroke-width="2" points="{}"/>"#,
                pts.trim_end()
            );
        }
        let ly = TOP + 20.0 + i as f64 * 36.0;
        let lx = LEFT + plot_w + 34.0;
        let pct = |p: f64| {
            v.get(((v.len() as f64 * p).ceil() as usize).saturating_sub(1))
                .copied()
                .unwrap_or(f64::NAN)
        };
        let stats = if v.is_empty() {
            "no samples".to_string()
        } else {
            format!("p50 {} · p99 {}", fmt_ms(pct(0.5)), fmt_ms(pct(0.99)))
        };
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{colour}" stroke-width="3"/><text x="{}" y="{}">{}</text><text x="{}" y="{}" fill="#555" font-size="11">{}</text>"##,
            lx + 18.0,
            lx + 24.0,
            ly + 4.0,
            escape(name),
            lx,
            ly + 18.0,
            stats
        );
    }
    s.push_str("</svg>\n");
    s
}

/// Milliseconds as a short label (`850 ms`, `4.2 s`).
pub fn fmt_ms(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v >= 1000.0 {
        format!("{:.2} s", v / 1000.0)
    } else if v >= 10.0 {
        format!("{v:.0} ms")
    } else {
        format!("{v:.1} ms")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_has_one_polyline_per_series_with_data_and_a_legend() {
        let svg = ttft_cdf_svg(
            "TTFT <test>",
            &[
                (
                    "round_robin".into(),
                    (1..=100).map(|i| f64::from(i) * 10.0).collect(),
                ),
                ("filter".into(), (1..=100).map(f64::from).collect()),
                ("empty".into(), vec![]),
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("round_robin") && svg.contains("no samples"));
        assert!(svg.contains("TTFT &lt;test&gt;"), "title is escaped");
        // data from 1 ms to 1 s: decades 1 ms .. 1 s labelled
        assert!(svg.contains(">1 ms<") && svg.contains(">1 s<"));
    }

    #[test]
    fn cdf_keeps_the_tail_and_ends_at_one() {
        let v: Vec<f64> = (0..100_000).map(f64::from).collect();
        let pts = cdf_points(&v);
        assert!(pts.len() < 5000);
        assert_eq!(pts.last().map(|p| p.1), Some(1.0));
        // the last 2% at full resolution
        assert!(pts.iter().filter(|p| p.1 > 0.98).count() >= 2000);
    }
}
