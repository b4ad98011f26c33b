//! Prometheus exposition of a pod's state, with the exact metric names, labels, HELP texts,
//! bucket boundaries and number formatting of the engines it imitates: vLLM v1 (as in
//! `shared/metrics-samples/vllm-v1-0.11-hardware-aware-router-idle.txt`, prometheus_client text
//! format 0.0.4 with `_created` gauges) or SGLang (as in `sglang-docs-production-metrics.txt`).
//! Latency histograms hold wall-clock seconds (simulated seconds / time scale), which is what a
//! client and a scraper observe. Simulator-only series use the `fleet_sim:` prefix.

use std::fmt::Write;

/// vLLM's `time_to_first_token_seconds` buckets (vLLM v1 `loggers.py`, seen in the 0.11 sample).
pub const VLLM_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `inter_token_latency_seconds` buckets.
pub const VLLM_ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's `e2e_request_latency_seconds` buckets.
pub const VLLM_E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// SGLang's `time_to_first_token_seconds` buckets (SGLang production-metrics docs sample).
pub const SGLANG_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    15.0, 20.0, 25.0, 30.0,
];
/// SGLang's `e2e_request_latency_seconds` buckets.
pub const SGLANG_E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
];
/// SGLang's `time_per_output_token_seconds` buckets.
pub const SGLANG_TPOT_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5,
];

/// A Prometheus histogram with fixed upper bounds.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    // per bucket (not cumulative); the last entry is the +Inf bucket
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// An empty histogram.
    pub fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one observation.
    pub fn observe(&mut self, v: f64) {
        self.observe_n(v, 1);
    }

    /// Records `n` observations of the same value (one call for a whole batch of sequences that
    /// saw the same inter-token gap).
    pub fn observe_n(&mut self, v: f64, n: u64) {
        if n == 0 {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < v);
        if let Some(c) = self.counts.get_mut(i) {
            *c += n;
        }
        self.sum += v * n as f64;
        self.count += n;
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of observations.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` pairs, ending with `+Inf`.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            acc += c;
            out.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), acc));
        }
        out
    }
}

/// Formats a float as Python's prometheus_client does (`floatToGoString`): `repr()` digits,
/// `.0` on whole numbers, and Go-style `d.ddde+0N` once there are more than six digits before
/// the point (`1.7624384230434499e+09`, `7.400757e+06`).
pub fn go_float(v: f64) -> String {
    if v.is_nan() {
        return "NaN".to_string();
    }
    if v == f64::INFINITY {
        return "+Inf".to_string();
    }
    if v == f64::NEG_INFINITY {
        return "-Inf".to_string();
    }
    let s = python_repr(v);
    if v > 0.0 {
        if let Some(dot) = s.find('.') {
            if dot > 6 && !s.contains('e') {
                let mantissa = format!("{}.{}{}", &s[..1], &s[1..dot], &s[dot + 1..]);
                let mantissa = mantissa.trim_end_matches(['0', '.']);
                return format!("{mantissa}e+0{}", dot - 1);
            }
        }
    }
    s
}

/// Python's `repr(float)`: shortest round-trip digits, `.0` on whole numbers, exponent form
/// (`1e-05`, `1e+16`) outside [1e-4, 1e16).
fn python_repr(v: f64) -> String {
    if v == 0.0 {
        return if v.is_sign_negative() { "-0.0" } else { "0.0" }.to_string();
    }
    let a = v.abs();
    if (1e-4..1e16).contains(&a) {
        // Rust's Debug is shortest round-trip and keeps `.0`, like repr
        let s = format!("{v:?}");
        if s.contains('e') {
            // Debug switches to exponent form for some values in range; expand it
            return format!("{v}");
        }
        return s;
    }
    let s = format!("{v:e}"); // e.g. 1.5e-5, 1e16
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = match e.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', e),
            };
            let digits = if digits.len() < 2 {
                format!("0{digits}")
            } else {
                digits.to_string()
            };
            format!("{m}e{sign}{digits}")
        }
        None => s,
    }
}

/// Escapes a label value for the text format.
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// A small writer for exposition text.
#[derive(Debug, Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    /// An empty document.
    pub fn new() -> Self {
        Exposition {
            out: String::with_capacity(16 * 1024),
        }
    }

    /// `# HELP` and `# TYPE` lines.
    pub fn family(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    /// One sample line; `labels` is the rendered `k="v",...` text (may be empty).
    pub fn sample(&mut self, name: &str, labels: &str, value: f64) {
        if labels.is_empty() {
            let _ = writeln!(self.out, "{name} {}", go_float(value));
        } else {
            let _ = writeln!(self.out, "{name}{{{labels}}} {}", go_float(value));
        }
    }

    /// A histogram's series. `before_le` and `after_le` are the labels that sort before and
    /// after `le` (vLLM: `engine` / `model_name`); `sum_first` puts `_sum` before the buckets
    /// (SGLang's order), otherwise `_count` then `_sum` follow the buckets (vLLM's order).
    pub fn histogram(
        &mut self,
        name: &str,
        before_le: &str,
        after_le: &str,
        h: &Histogram,
        sum_first: bool,
    ) {
        let plain = match (before_le.is_empty(), after_le.is_empty()) {
            (true, true) => String::new(),
            (false, true) => before_le.to_string(),
            (true, false) => after_le.to_string(),
            (false, false) => format!("{before_le},{after_le}"),
        };
        let sum_name = format!("{name}_sum");
        if sum_first {
            self.sample(&sum_name, &plain, h.sum());
        }
        for (bound, cum) in h.cumulative() {
            let mut labels = String::new();
            if !before_le.is_empty() {
                labels.push_str(before_le);
                labels.push(',');
            }
            let _ = write!(labels, "le=\"{}\"", go_float(bound));
            if !after_le.is_empty() {
                labels.push(',');
                labels.push_str(after_le);
            }
            self.sample(&format!("{name}_bucket"), &labels, cum as f64);
        }
        self.sample(&format!("{name}_count"), &plain, h.count() as f64);
        if !sum_first {
            self.sample(&sum_name, &plain, h.sum());
        }
    }

    /// The finished text.
    pub fn finish(self) -> String {
        self.out
    }
}

/// The names a `/metrics` query asks for (`?name[]=a&name[]=b`, percent-encoded or not); empty
/// when it asks for none (everything).
pub fn names_asked(query: Option<&str>) -> Vec<String> {
    form_urlencoded::parse(query.unwrap_or_default().as_bytes())
        .filter(|(k, _)| k == "name[]")
        .map(|(_, v)| v.into_owned())
        .collect()
}

/// The items of an exposition's `lines` (each line's text with what stands for it) that
/// prometheus_client serves for `?name[]=...`: the samples whose name is one of `names` (its
/// `restricted_registry` goes by sample name, so a histogram's `_sum` can be asked for alone),
/// with their families' `# HELP` and `# TYPE` lines. A family none of whose samples is asked
/// for is left out whole.
pub fn restricted<'a, T>(
    lines: impl IntoIterator<Item = (&'a str, T)>,
    names: &[String],
) -> Vec<T> {
    let mut out = Vec::new();
    let mut comments = Vec::new();
    for (line, item) in lines {
        if line.starts_with("# HELP ") {
            // A new family: the comments held for the one before had no sample asked for.
            comments.clear();
        }
        if line.starts_with('#') {
            comments.push(item);
            continue;
        }
        let name = line.split(['{', ' ']).next().unwrap_or_default();
        if names.iter().any(|n| n == name) {
            out.append(&mut comments);
            out.push(item);
        }
    }
    out
}

/// [`restricted`] of a page of text.
pub fn restrict(page: &str, names: &[String]) -> String {
    restricted(page.lines().map(|l| (l, l)), names)
        .into_iter()
        .fold(String::new(), |mut out, l| {
            out.push_str(l);
            out.push('\n');
            out
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_format_like_prometheus_client() {
        assert_eq!(go_float(0.0), "0.0");
        assert_eq!(go_float(2452.0), "2452.0");
        assert_eq!(go_float(0.001), "0.001");
        assert_eq!(go_float(2560.0), "2560.0");
        assert_eq!(go_float(f64::INFINITY), "+Inf");
        assert_eq!(go_float(1.7624384230434499e9), "1.7624384230434499e+09");
        assert_eq!(go_float(7_400_757.0), "7.400757e+06");
        assert_eq!(go_float(1e-5), "1e-05");
        assert_eq!(go_float(0.28), "0.28");
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_inclusive() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.1); // le is inclusive
        h.observe(0.5);
        h.observe_n(5.0, 3);
        assert_eq!(h.cumulative(), vec![(0.1, 1), (1.0, 2), (f64::INFINITY, 5)]);
        assert_eq!(h.count(), 5);
        assert!((h.sum() - 15.6).abs() < 1e-9);
        let mut e = Exposition::new();
        e.histogram("x", "engine=\"0\"", "model_name=\"m\"", &h, false);
        let text = e.finish();
        assert!(text.contains("x_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 5.0"));
        assert!(text.ends_with("x_count{engine=\"0\",model_name=\"m\"} 5.0\nx_sum{engine=\"0\",model_name=\"m\"} 15.6\n"));
    }

    #[test]
    fn a_restricted_page_has_the_named_samples_and_their_families_comments_only() {
        let mut h = Histogram::new(&[0.1]);
        h.observe(0.05);
        let mut e = Exposition::new();
        e.family("g", "a gauge", "gauge");
        e.sample("g", "", 2.0);
        e.family("other", "not asked for", "gauge");
        e.sample("other", "", 3.0);
        e.family("x", "a histogram", "histogram");
        e.histogram("x", "", "", &h, false);
        let page = e.finish();
        let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let got = restrict(&page, &names(&["g", "x_sum"]));
        assert_eq!(
            got,
            "# HELP g a gauge\n# TYPE g gauge\ng 2.0\n# HELP x a histogram\n# TYPE x histogram\nx_sum 0.05\n"
        );
        assert_eq!(restrict(&page, &names(&["nothing"])), "");
    }
}
