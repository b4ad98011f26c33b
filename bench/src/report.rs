//! The benchmark report: one scenario, several router configurations, same workload.
//!
//! Input: each configuration's `loadgen` results (which carry the pods' counters scraped
//! before and after). Output: a printed table, a per-pod request-share table, the
//! scenario's target figures checked, `target/bench/<scenario>.json` in the shape other
//! tools read:
//!
//! ```json
//! {"scenario": "...", "setup": {...},
//!  "results": {"round_robin": {"ttft_ms": {"p50":..,"p90":..,"p95":..,"p99":..},
//!              "e2e_ms": {...}, "output_tokens_per_s": .., "prefix_hit_rate": ..,
//!              "adapter_loads": .., "errors": .., "send_lag_ms_p99": ..}, ...},
//!  "figures": [...]}
//! ```
//!
//! (each configuration also carries a few extra keys, e.g. `served_by`; readers of the
//! fixed keys are unaffected), and `target/bench/<scenario>-ttft-cdf.svg`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::metrics::REQUEST_SUCCESS;
use crate::results::{LoadgenResults, Percentiles};
use crate::scenario::{Scenario, Target};
use crate::svg::{fmt_ms, ttft_cdf_svg};

/// The configurations the benchmark compares, in display order.
pub const CONFIGURATIONS: &[&str] = &["round_robin", "least_request", "filter"];

/// One configuration's results as a label and its loadgen output.
#[derive(Debug, Clone)]
pub struct ConfigRun {
    /// `round_robin`, `least_request`, `filter`, or any other label.
    pub label: String,
    /// What loadgen wrote.
    pub results: LoadgenResults,
}

/// Latency percentiles in milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Quantiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

impl Quantiles {
    /// A quantile by its name in metric paths (`p50`, `p90`, `p95`, `p99`, `max`, `mean`).
    pub fn get(&self, name: &str) -> Option<f64> {
        match name {
            "p50" => Some(self.p50),
            "p90" => Some(self.p90),
            "p95" => Some(self.p95),
            "p99" => Some(self.p99),
            "max" => Some(self.max),
            "mean" => Some(self.mean),
            _ => None,
        }
    }
}

impl From<Percentiles> for Quantiles {
    fn from(p: Percentiles) -> Self {
        Self {
            p50: p.p50,
            p90: p.p90,
            p95: p.p95,
            p99: p.p99,
            max: p.max,
            mean: p.mean,
        }
    }
}

/// One configuration's row of the report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConfigResult {
    /// TTFT of successful requests.
    pub ttft_ms: Quantiles,
    /// End-to-end latency of successful requests.
    pub e2e_ms: Quantiles,
    /// Output tokens per wall second over the run.
    pub output_tokens_per_s: f64,
    /// Pods' prefix-cache hit rate over the run (token-weighted), if scraped.
    pub prefix_hit_rate: Option<f64>,
    /// LoRA adapter loads over the run, summed over pods, if scraped.
    pub adapter_loads: Option<f64>,
    /// Failed requests.
    pub errors: u64,
    /// The load generator's 99th percentile send lag.
    pub send_lag_ms_p99: f64,
    /// Requests sent.
    pub requests: u64,
    /// Failures by kind.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Successful requests per wall second.
    pub requests_per_s: f64,
    /// Largest send lag.
    pub send_lag_ms_max: f64,
    /// Most requests in flight.
    pub max_in_flight: u64,
    /// Requests per serving pod.
    pub served_by: BTreeMap<String, u64>,
    /// Pods whose metrics could not be scraped.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scrape_errors: Vec<String>,
}

impl ConfigResult {
    /// The row for one loadgen run.
    pub fn of(r: &LoadgenResults) -> Self {
        let s = &r.summary;
        Self {
            ttft_ms: s.ttft_ms.into(),
            e2e_ms: s.e2e_ms.into(),
            output_tokens_per_s: s.output_tokens_per_s,
            prefix_hit_rate: r.metrics.as_ref().and_then(|m| m.prefix_hit_rate()),
            adapter_loads: r.metrics.as_ref().and_then(|m| m.adapter_loads()),
            errors: s.errors,
            send_lag_ms_p99: s.send_lag.p99_ms,
            requests: s.requests,
            errors_by_kind: s.errors_by_kind.clone(),
            requests_per_s: s.requests_per_s,
            send_lag_ms_max: s.send_lag.max_ms,
            max_in_flight: s.max_in_flight,
            served_by: s.served_by.clone(),
            scrape_errors: r
                .metrics
                .as_ref()
                .map(|m| m.scrape_errors.clone())
                .unwrap_or_default(),
        }
    }

    /// A metric by the name targets use (`ttft_ms.p99`, `output_tokens_per_s`, ...).
    pub fn metric(&self, name: &str) -> Option<f64> {
        match name.split_once('.') {
            Some(("ttft_ms", p)) => self.ttft_ms.get(p),
            Some(("e2e_ms", p)) => self.e2e_ms.get(p),
            _ => match name {
                "output_tokens_per_s" => Some(self.output_tokens_per_s),
                "prefix_hit_rate" => self.prefix_hit_rate,
                "adapter_loads" => self.adapter_loads,
                "errors" => Some(self.errors as f64),
                "requests_per_s" => Some(self.requests_per_s),
                _ => None,
            },
        }
    }
}

/// The machine the benchmark ran on.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MachineInfo {
    /// Logical CPUs available.
    pub cpus: usize,
    /// CPU model name.
    pub cpu_model: Option<String>,
    /// Total memory in GiB.
    pub mem_gib: Option<f64>,
    /// OS and architecture.
    pub os: String,
    /// Kernel release.
    pub kernel: Option<String>,
    /// 1-minute load average when the report was written.
    pub loadavg_1m: Option<f64>,
}

impl MachineInfo {
    /// Reads what this machine says about itself (Linux `/proc`; fields stay empty
    /// elsewhere).
    pub fn detect() -> Self {
        let read = |p: &str| std::fs::read_to_string(p).ok();
        let cpu_model = read("/proc/cpuinfo").and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        });
        let mem_gib = read("/proc/meminfo").and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
                .map(|kb| (kb / 1024.0 / 1024.0 * 10.0).round() / 10.0)
        });
        Self {
            cpus: std::thread::available_parallelism().map_or(0, usize::from),
            cpu_model,
            mem_gib,
            os: format!("{}-{}", std::env::consts::OS, std::env::consts::ARCH),
            kernel: read("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()),
            loadavg_1m: read("/proc/loadavg")
                .and_then(|t| t.split_whitespace().next().and_then(|v| v.parse().ok())),
        }
    }
}

/// How the benchmark was set up.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// One-line fleet description.
    pub fleet_summary: String,
    /// The fleet file (fleet-sim format), when the scenario was given.
    pub fleet: serde_json::Value,
    /// Workload name.
    pub workload: String,
    /// `trace` or `poisson`.
    pub workload_kind: String,
    /// Trace file replayed (Poisson: the file lengths are drawn from, if any).
    pub trace_file: Option<String>,
    /// Quick variant.
    pub quick: bool,
    /// Trace seconds per wall second.
    pub speedup: f64,
    /// Prompt token scale.
    pub token_scale: f64,
    /// Output token scale.
    pub output_scale: f64,
    /// fleet-sim's time compression (simulated seconds per wall second).
    pub time_scale: Option<f64>,
    /// Sending duration (wall seconds).
    pub duration_s: Option<f64>,
    /// Wall seconds from the first to the last scheduled send.
    pub schedule_span_s: f64,
    /// Requests per configuration.
    pub request_count: usize,
    /// Offered requests per wall second.
    pub offered_rate_per_s: f64,
    /// Mean prompt tokens sent.
    pub mean_prompt_tokens: f64,
    /// Mean max_tokens sent.
    pub mean_output_tokens: f64,
    /// Ideal prefix reuse of the whole trace.
    pub ideal_prefix_reuse_full: Option<f64>,
    /// Ideal prefix reuse of the replayed slice (the hit-rate target's reference).
    pub ideal_prefix_reuse_slice: Option<f64>,
    /// The workload's TTFT floor on this fleet (each request on an idle pod holding every
    /// prefix sent before it; see `floor.rs`): the best any router could reach. `None` without
    /// the scenario's fleet.
    #[serde(default)]
    pub ttft_floor_ms: Option<Quantiles>,
    /// The workload's TTFT under the greedy oracle router (each request to the pod where, on
    /// the engines' exact state at its arrival, its first token comes soonest; see `floor.rs`):
    /// what routing on perfect information reaches. Not a bound.
    #[serde(default)]
    pub ttft_oracle_ms: Option<Quantiles>,
    /// Seed.
    pub seed: u64,
    /// What the latency numbers measure.
    pub units: String,
    /// Configurations in display order.
    pub configurations: Vec<String>,
    /// The machine.
    pub machine: MachineInfo,
    /// Inconsistencies between configurations (different workloads, scrape failures).
    pub warnings: Vec<String>,
}

/// A target figure checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FigureCheck {
    /// The figure as stated.
    pub figure: String,
    /// Metric compared.
    pub metric: String,
    /// Configuration measured.
    pub config: String,
    /// What it is compared with.
    pub baseline: String,
    /// Its value.
    pub value: Option<f64>,
    /// The baseline's value.
    pub baseline_value: Option<f64>,
    /// value / baseline.
    pub ratio: Option<f64>,
    /// For TTFT figures: the workload's TTFT floor at the same percentile / baseline, the
    /// smallest ratio any router could reach. A `max_ratio` below it cannot be met.
    #[serde(default)]
    pub floor_ratio: Option<f64>,
    /// For TTFT figures: the greedy oracle router's TTFT at the same percentile / baseline.
    #[serde(default)]
    pub oracle_ratio: Option<f64>,
    /// Allowed maximum ratio.
    pub max_ratio: Option<f64>,
    /// Allowed minimum ratio.
    pub min_ratio: Option<f64>,
    /// Met, missed, or not measurable (`null`).
    pub met: Option<bool>,
}

/// The whole report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// Scenario name.
    pub scenario: String,
    /// Setup.
    pub setup: Setup,
    /// Per-configuration results.
    pub results: BTreeMap<String, ConfigResult>,
    /// Target figures.
    pub figures: Vec<FigureCheck>,
}

/// Why the report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Writing a file failed.
    #[error("cannot write {path}: {source}")]
    Io {
        /// File path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Serialising failed.
    #[error("cannot serialise report: {0}")]
    Json(#[from] serde_json::Error),
}

/// Configuration labels in display order: the known three first, then others sorted.
pub fn ordered_labels<'a>(labels: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    let set: BTreeSet<&String> = labels.into_iter().collect();
    let mut out: Vec<String> = CONFIGURATIONS
        .iter()
        .filter(|c| set.iter().any(|l| l.as_str() == **c))
        .map(|c| c.to_string())
        .collect();
    out.extend(
        set.into_iter()
            .filter(|l| !CONFIGURATIONS.contains(&l.as_str()))
            .cloned(),
    );
    out
}

/// Builds the report from the configurations' results.
pub fn build_report(
    scenario_name: &str,
    runs: &[ConfigRun],
    scenario: Option<&Scenario>,
    quick: bool,
    references: References,
) -> Report {
    let results: BTreeMap<String, ConfigResult> = runs
        .iter()
        .map(|r| (r.label.clone(), ConfigResult::of(&r.results)))
        .collect();
    let labels = ordered_labels(results.keys());
    let w = runs
        .iter()
        .find(|r| r.label == labels.first().cloned().unwrap_or_default())
        .or(runs.first())
        .map(|r| r.results.workload.clone())
        .unwrap_or_default();
    let mut warnings = Vec::new();
    for r in runs {
        let o = &r.results.workload;
        if o.request_count != w.request_count || o.seed != w.seed || o.name != w.name {
            warnings.push(format!(
                "{} replayed a different workload ({} requests, seed {}, {}) than {} requests, seed {}, {}",
                r.label, o.request_count, o.seed, o.name, w.request_count, w.seed, w.name
            ));
        }
        if let Some(m) = &r.results.metrics {
            for e in &m.scrape_errors {
                warnings.push(format!("{}: scrape failed: {e}", r.label));
            }
            let served_before: f64 = m
                .before
                .values()
                .filter_map(|pod| pod.get(REQUEST_SUCCESS))
                .sum();
            if served_before > 0.0 {
                warnings.push(format!(
                    "{}: the pods had already served {served_before:.0} requests before this run: their caches were warm, which favours this configuration (start a fresh fleet for each configuration)",
                    r.label
                ));
            }
        } else {
            warnings.push(format!(
                "{}: no pod metrics (loadgen ran without --pods-file)",
                r.label
            ));
        }
        let lag = r.results.summary.send_lag.p99_ms;
        if lag > OVERLOAD_LAG_MS {
            warnings.push(format!(
                "{}: load generator send lag p99 {lag:.1} ms > {OVERLOAD_LAG_MS} ms: the machine was overloaded, latencies include it",
                r.label
            ));
        }
    }
    let time_scale = scenario.and_then(Scenario::time_scale);
    let setup = Setup {
        fleet_summary: scenario.map(Scenario::fleet_summary).unwrap_or_default(),
        fleet: scenario.map(|s| s.fleet.clone()).unwrap_or_default(),
        workload: w.name.clone(),
        workload_kind: w.kind.clone(),
        trace_file: w.source.clone(),
        quick,
        speedup: w.speedup,
        token_scale: w.token_scale,
        output_scale: w.output_scale,
        time_scale,
        duration_s: w.duration_s,
        schedule_span_s: w.schedule_span_s,
        request_count: w.request_count,
        offered_rate_per_s: w.offered_rate_per_s,
        mean_prompt_tokens: w.mean_prompt_tokens,
        mean_output_tokens: w.mean_output_tokens,
        ideal_prefix_reuse_full: w.ideal_prefix_reuse_full,
        ideal_prefix_reuse_slice: w.ideal_prefix_reuse_slice,
        ttft_floor_ms: references.floor,
        ttft_oracle_ms: references.oracle,
        seed: w.seed,
        units: match time_scale {
            Some(t) if (t - 1.0).abs() > f64::EPSILON => format!(
                "latencies are wall-clock ms of the compressed run; the fleet runs {t}x faster than real GPUs, so multiply by {t} for simulated GPU time (ratios are unaffected)"
            ),
            Some(_) => "latencies are wall-clock ms; the fleet runs at real GPU speed (time_scale 1)".into(),
            None => "latencies are wall-clock ms".into(),
        },
        configurations: labels,
        machine: MachineInfo::detect(),
        warnings,
    };
    let figures = scenario
        .map(|s| {
            s.targets
                .iter()
                .map(|t| check_target(t, &results, &setup))
                .collect()
        })
        .unwrap_or_default();
    Report {
        scenario: scenario_name.to_string(),
        setup,
        results,
        figures,
    }
}

/// TTFT references computed from the workload and the fleet rather than measured (`floor.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct References {
    /// The TTFT floor.
    pub floor: Option<Quantiles>,
    /// The greedy oracle router's TTFT.
    pub oracle: Option<Quantiles>,
}

impl From<crate::results::TtftReferences> for References {
    fn from(t: crate::results::TtftReferences) -> Self {
        References {
            floor: Some(t.floor_ms.into()),
            oracle: Some(t.oracle_ms.into()),
        }
    }
}

/// Send lag above which a run is flagged as overloaded: a few ms of lag is timer
/// granularity (tokio's timer wheel ticks in 1 ms); tens of ms is a CPU-starved machine.
pub const OVERLOAD_LAG_MS: f64 = 20.0;

fn check_target(
    t: &Target,
    results: &BTreeMap<String, ConfigResult>,
    setup: &Setup,
) -> FigureCheck {
    let value = results.get(&t.config).and_then(|r| r.metric(&t.metric));
    let baseline_value = if t.baseline == "ideal_prefix_reuse" {
        setup.ideal_prefix_reuse_slice
    } else {
        results.get(&t.baseline).and_then(|r| r.metric(&t.metric))
    };
    let ratio = match (value, baseline_value) {
        (Some(v), Some(b)) if b > 0.0 => Some(v / b),
        _ => None,
    };
    let met =
        ratio.map(|r| t.max_ratio.is_none_or(|m| r <= m) && t.min_ratio.is_none_or(|m| r >= m));
    let reference_ratio = |reference: Option<Quantiles>| match (
        t.metric.strip_prefix("ttft_ms."),
        reference,
        baseline_value,
    ) {
        (Some(q), Some(r), Some(b)) if b > 0.0 && t.baseline != "ideal_prefix_reuse" => {
            r.get(q).map(|v| v / b)
        }
        _ => None,
    };
    FigureCheck {
        figure: t.figure.clone(),
        metric: t.metric.clone(),
        config: t.config.clone(),
        baseline: t.baseline.clone(),
        value,
        baseline_value,
        ratio,
        floor_ratio: reference_ratio(setup.ttft_floor_ms),
        oracle_ratio: reference_ratio(setup.ttft_oracle_ms),
        max_ratio: t.max_ratio,
        min_ratio: t.min_ratio,
        met,
    }
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".into(), f)
}

/// The main table, one row per configuration.
pub fn render_table(report: &Report) -> String {
    let mut s = String::new();
    let st = &report.setup;
    let _ = writeln!(
        s,
        "scenario {}{}",
        report.scenario,
        if st.quick { " (quick)" } else { "" }
    );
    if !st.fleet_summary.is_empty() {
        let _ = writeln!(s, "fleet    {}", st.fleet_summary);
    }
    let _ = writeln!(
        s,
        "workload {} ({}): {} requests over {:.0} s ({:.1}/s), speedup {:.3}, token scale {}, time scale {}",
        st.workload,
        st.workload_kind,
        st.request_count,
        st.schedule_span_s,
        st.offered_rate_per_s,
        st.speedup,
        st.token_scale,
        opt(st.time_scale, |t| format!("{t}"))
    );
    if let Some(r) = st.ideal_prefix_reuse_slice {
        let _ = writeln!(
            s,
            "ideal prefix reuse: slice {:.3}, whole trace {}",
            r,
            opt(st.ideal_prefix_reuse_full, |f| format!("{f:.3}"))
        );
    }
    let header = [
        "config",
        "ttft p50",
        "ttft p95",
        "ttft p99",
        "e2e p50",
        "e2e p99",
        "out tok/s",
        "prefix hit",
        "adapt loads",
        "errors",
        "lag p99",
    ];
    let mut rows = vec![header.iter().map(|h| h.to_string()).collect::<Vec<_>>()];
    for label in &st.configurations {
        let Some(r) = report.results.get(label) else {
            continue;
        };
        rows.push(vec![
            label.clone(),
            fmt_ms(r.ttft_ms.p50),
            fmt_ms(r.ttft_ms.p95),
            fmt_ms(r.ttft_ms.p99),
            fmt_ms(r.e2e_ms.p50),
            fmt_ms(r.e2e_ms.p99),
            format!("{:.0}", r.output_tokens_per_s),
            opt(r.prefix_hit_rate, |h| format!("{:.1}%", h * 100.0)),
            opt(r.adapter_loads, |l| format!("{l:.0}")),
            format!("{}/{}", r.errors, r.requests),
            format!("{:.1} ms", r.send_lag_ms_p99),
        ]);
    }
    s.push_str(&render_rows(&rows));
    for (q, what) in [
        (st.ttft_floor_ms, "TTFT floor (each request alone on an idle pod holding every prefix sent before it; no router beats it)"),
        (st.ttft_oracle_ms, "TTFT of the greedy oracle router (each request to the pod where, on the engines' exact state, its first token comes soonest)"),
    ] {
        if let Some(f) = q {
            let _ = writeln!(
                s,
                "{what}: p50 {}, p90 {}, p95 {}, p99 {}",
                fmt_ms(f.p50),
                fmt_ms(f.p90),
                fmt_ms(f.p95),
                fmt_ms(f.p99)
            );
        }
    }
    s
}

/// The per-pod request share, one column per configuration.
pub fn render_pod_share(report: &Report) -> String {
    let labels = &report.setup.configurations;
    let pods: BTreeSet<&String> = report
        .results
        .values()
        .flat_map(|r| r.served_by.keys())
        .collect();
    let mut rows = vec![std::iter::once("pod".to_string())
        .chain(labels.iter().cloned())
        .collect::<Vec<_>>()];
    for pod in pods {
        let mut row = vec![pod.clone()];
        for l in labels {
            let cell = report.results.get(l).map_or_else(
                || "-".to_string(),
                |r| {
                    let n = r.served_by.get(pod).copied().unwrap_or(0);
                    let total: u64 = r.served_by.values().sum();
                    let pct = if total > 0 {
                        n as f64 * 100.0 / total as f64
                    } else {
                        0.0
                    };
                    format!("{n} ({pct:.1}%)")
                },
            );
            row.push(cell);
        }
        rows.push(row);
    }
    render_rows(&rows)
}

/// The target figures, one line each.
pub fn render_figures(report: &Report) -> String {
    let mut s = String::new();
    for f in &report.figures {
        let verdict = match f.met {
            Some(true) => "MET",
            Some(false) => "MISSED",
            None => "n/a",
        };
        let bound = match (f.min_ratio, f.max_ratio) {
            (Some(lo), Some(hi)) => format!("in [{lo}, {hi}]"),
            (None, Some(hi)) => format!("<= {hi}"),
            (Some(lo), None) => format!(">= {lo}"),
            (None, None) => "any".into(),
        };
        let floor = match (f.floor_ratio, f.max_ratio) {
            (Some(fr), Some(hi)) if fr > hi => {
                format!("; floor {fr:.3}: below what any router can reach")
            }
            (Some(fr), _) => format!("; floor {fr:.3}"),
            (None, _) => String::new(),
        } + &f
            .oracle_ratio
            .map_or_else(String::new, |o| format!(", greedy oracle {o:.3}"));
        let _ = writeln!(
            s,
            "{verdict:7} {}: {} {} = {} vs {} {} -> ratio {} (target {bound}{floor})",
            f.figure,
            f.config,
            f.metric,
            opt(f.value, |v| format!("{v:.3}")),
            f.baseline,
            opt(f.baseline_value, |v| format!("{v:.3}")),
            opt(f.ratio, |r| format!("{r:.3}")),
        );
    }
    s
}

fn render_rows(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|v| v.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut s = String::new();
    for (i, row) in rows.iter().enumerate() {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(c, v)| {
                if c == 0 {
                    format!("{v:<w$}", w = widths[c])
                } else {
                    format!("{v:>w$}", w = widths[c])
                }
            })
            .collect();
        let _ = writeln!(s, "{}", line.join("  ").trim_end());
        if i == 0 {
            let total = widths.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
            let _ = writeln!(s, "{}", "-".repeat(total));
        }
    }
    s
}

/// Writes `<dir>/<scenario>.json` and `<dir>/<scenario>-ttft-cdf.svg`; returns both paths.
pub fn write_outputs(
    report: &Report,
    runs: &[ConfigRun],
    dir: &Path,
) -> Result<(PathBuf, PathBuf), ReportError> {
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| ReportError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let json_path = dir.join(format!("{}.json", report.scenario));
    let json = serde_json::to_vec_pretty(report)?;
    std::fs::write(&json_path, json).map_err(io(&json_path))?;

    let series: Vec<(String, Vec<f64>)> = report
        .setup
        .configurations
        .iter()
        .filter_map(|l| runs.iter().find(|r| &r.label == l))
        .map(|r| {
            let v = r
                .results
                .records
                .iter()
                .filter(|x| x.ok())
                .filter_map(|x| x.ttft_ms)
                .collect();
            (r.label.clone(), v)
        })
        .collect();
    let title = format!("TTFT CDF: {}", report.scenario);
    let svg_path = dir.join(format!("{}-ttft-cdf.svg", report.scenario));
    std::fs::write(&svg_path, ttft_cdf_svg(&title, &series)).map_err(io(&svg_path))?;
    Ok((json_path, svg_path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{
        MetricsDelta, ADAPTER_LOADS, PREFIX_HITS, PREFIX_QUERIES, REQUEST_SUCCESS,
    };
    use crate::results::{RequestRecord, Summary};
    use crate::workload::WorkloadInfo;

    fn run(label: &str, ttft_scale: f64, hits: f64, loads: f64) -> ConfigRun {
        let records: Vec<RequestRecord> = (0..200)
            .map(|i| RequestRecord {
                id: i,
                model: "m".into(),
                prompt_chars: 100,
                max_tokens: 10,
                scheduled_ms: i as f64 * 10.0,
                sent_ms: i as f64 * 10.0 + 0.2,
                status: Some(200),
                error: None,
                error_detail: None,
                headers_ms: Some(1.0),
                ttft_ms: Some((i % 100 + 1) as f64 * ttft_scale),
                e2e_ms: Some((i % 100 + 1) as f64 * ttft_scale + 100.0),
                output_tokens: 10,
                usage_reported: true,
                served_by: Some(format!("pod-{}", i % 3)),
                gateway_debug: None,
            })
            .collect();
        let counters = |h: f64, q: f64, l: f64| {
            BTreeMap::from([(
                "pod-0".to_string(),
                BTreeMap::from([
                    (PREFIX_HITS.to_string(), h),
                    (PREFIX_QUERIES.to_string(), q),
                    (ADAPTER_LOADS.to_string(), l),
                ]),
            )])
        };
        ConfigRun {
            label: label.into(),
            results: LoadgenResults {
                version: 1,
                workload: WorkloadInfo {
                    name: "w".into(),
                    kind: "trace".into(),
                    request_count: 200,
                    ideal_prefix_reuse_slice: Some(0.5),
                    ..WorkloadInfo::default()
                },
                summary: Summary::of(&records, 3),
                metrics: Some(MetricsDelta::between(
                    counters(0.0, 0.0, 0.0),
                    counters(hits, 1000.0, loads),
                    vec![],
                )),
                records,
                ..LoadgenResults::default()
            },
        }
    }

    fn scenario() -> Scenario {
        serde_json::from_value(serde_json::json!({
            "name": "s",
            "fleet": {"time_scale": 10, "pods": [{"name": "h", "count": 2, "gpu": "h100", "pool": "p"}]},
            "workload": {"kind": "poisson", "rate_per_s": 1, "duration_s": 1,
                "prompt_tokens": {"dist": "fixed", "value": 1}, "output_tokens": {"dist": "fixed", "value": 1}},
            "targets": [
                {"figure": "p99 <= 0.1x rr", "metric": "ttft_ms.p99", "config": "filter", "baseline": "round_robin", "max_ratio": 0.1},
                {"figure": "hit >= 0.85 ideal", "metric": "prefix_hit_rate", "config": "filter", "baseline": "ideal_prefix_reuse", "min_ratio": 0.85},
                {"figure": "loads <= 0.25x rr", "metric": "adapter_loads", "config": "filter", "baseline": "round_robin", "max_ratio": 0.25}
            ]
        }))
        .unwrap()
    }

    fn report() -> (Report, Vec<ConfigRun>) {
        let runs = vec![
            run("filter", 0.05, 450.0, 2.0),
            run("round_robin", 1.0, 100.0, 20.0),
            run("least_request", 0.5, 120.0, 15.0),
        ];
        let sc = scenario();
        (
            build_report("s", &runs, Some(&sc), false, References::default()),
            runs,
        )
    }

    #[test]
    fn report_json_has_the_shape_other_tools_read() {
        let (r, _) = report();
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["scenario"], "s");
        assert!(v["setup"].is_object());
        for c in CONFIGURATIONS {
            let c = &v["results"][c];
            for p in ["p50", "p90", "p95", "p99"] {
                assert!(c["ttft_ms"][p].is_f64(), "ttft_ms.{p}");
                assert!(c["e2e_ms"][p].is_f64(), "e2e_ms.{p}");
            }
            for k in [
                "output_tokens_per_s",
                "prefix_hit_rate",
                "adapter_loads",
                "send_lag_ms_p99",
            ] {
                assert!(c[k].is_number(), "{k}");
            }
            assert!(c["errors"].is_u64());
        }
        let rr = &v["results"]["round_robin"];
        assert!((rr["prefix_hit_rate"].as_f64().unwrap() - 0.1).abs() < 1e-12);
        assert_eq!(rr["adapter_loads"].as_f64(), Some(20.0));
        assert_eq!(v["setup"]["time_scale"].as_f64(), Some(10.0));
        assert_eq!(v["setup"]["request_count"], 200);
        assert!(v["setup"]["machine"]["cpus"].as_u64().unwrap() >= 1);
        assert_eq!(r.setup.configurations, CONFIGURATIONS);
    }

    #[test]
    fn figures_are_checked_against_baselines() {
        let (r, _) = report();
        let f = &r.figures;
        // p99 of filter is 0.05x round robin's
        assert_eq!(f[0].met, Some(true));
        assert!((f[0].ratio.unwrap() - 0.05).abs() < 0.001);
        // hit rate 0.45 vs ideal 0.5 -> 0.9 >= 0.85
        assert_eq!(f[1].met, Some(true));
        assert!((f[1].ratio.unwrap() - 0.9).abs() < 1e-9);
        // loads 2 vs 20 -> 0.1
        assert_eq!(f[2].met, Some(true));
        let text = render_figures(&r);
        assert_eq!(text.lines().count(), 3);
        assert!(text.contains("MET"));
    }

    #[test]
    fn missed_and_unmeasurable_figures_are_reported_as_such() {
        let runs = vec![
            run("filter", 1.0, 0.0, 0.0),
            run("round_robin", 1.0, 0.0, 0.0),
        ];
        let r = build_report("s", &runs, Some(&scenario()), true, References::default());
        assert_eq!(r.figures[0].met, Some(false));
        // adapter loads 0 vs 0: no ratio
        assert_eq!(r.figures[2].met, None);
        assert!(render_figures(&r).contains("MISSED"));
    }

    #[test]
    fn ttft_figures_carry_the_floor_and_say_when_a_target_is_below_it() {
        // round robin's TTFT p99 is 99 ms (1..=100 ms, each twice); a floor p99 of 19.8 ms
        // makes 0.2 the best reachable ratio, above the 0.1 target
        let runs = vec![
            run("filter", 0.15, 0.0, 0.0),
            run("round_robin", 1.0, 0.0, 0.0),
        ];
        let floor = Quantiles {
            p50: 1.0,
            p90: 5.0,
            p95: 10.0,
            p99: 19.8,
            max: 30.0,
            mean: 3.0,
        };
        let oracle = Quantiles { p99: 29.7, ..floor };
        let refs = References {
            floor: Some(floor),
            oracle: Some(oracle),
        };
        let r = build_report("s", &runs, Some(&scenario()), false, refs);
        let f = &r.figures[0];
        let rr_p99 = r.results["round_robin"].ttft_ms.p99;
        assert!((f.floor_ratio.unwrap() - 19.8 / rr_p99).abs() < 1e-9);
        assert!(f.floor_ratio.unwrap() > 0.1);
        assert_eq!(f.met, Some(false));
        assert!((f.oracle_ratio.unwrap() - 29.7 / rr_p99).abs() < 1e-9);
        assert!(render_figures(&r).contains("below what any router can reach"));
        assert!(render_figures(&r).contains("greedy oracle 0.3"));
        // figures without a TTFT reference end with their target alone
        assert!(render_figures(&r).contains("(target >= 0.85)"));
        // not a TTFT figure: no floor
        assert_eq!(r.figures[1].floor_ratio, None);
        assert_eq!(r.figures[2].floor_ratio, None);
        assert!(render_table(&r).contains("TTFT floor"));
        assert!(render_table(&r).contains("greedy oracle router"));
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["setup"]["ttft_floor_ms"]["p99"].as_f64(), Some(19.8));
        // a reachable target says only where the floor is
        let low = Quantiles { p99: 2.0, ..floor };
        let r = build_report(
            "s",
            &runs,
            Some(&scenario()),
            false,
            References {
                floor: Some(low),
                oracle: None,
            },
        );
        let text = render_figures(&r);
        assert!(
            text.contains("floor 0.0") && !text.contains("below what"),
            "{text}"
        );
        assert!(!text.contains("oracle"), "{text}");
    }

    #[test]
    fn tables_list_every_configuration_and_pod() {
        let (r, _) = report();
        let t = render_table(&r);
        let rr = t.find("round_robin").unwrap();
        let lr = t.find("least_request").unwrap();
        let fi = t.rfind("filter").unwrap();
        assert!(rr < lr && lr < fi, "display order");
        let pods = render_pod_share(&r);
        // header + rule + 3 pods
        assert_eq!(pods.lines().count(), 5);
        assert!(pods.contains("67 (33.5%)"));
    }

    #[test]
    fn outputs_are_written() {
        let (r, runs) = report();
        let dir =
            std::env::temp_dir().join(format!("gpuroute-bench-report-{}", std::process::id()));
        let (json, svg) = write_outputs(&r, &runs, &dir).unwrap();
        assert_eq!(json.file_name().unwrap(), "s.json");
        assert_eq!(svg.file_name().unwrap(), "s-ttft-cdf.svg");
        let back: Report = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        assert_eq!(back.results.len(), 3);
        for (k, v) in &r.results {
            // JSON float parsing may differ in the last bit
            assert!((back.results[k].ttft_ms.p99 - v.ttft_ms.p99).abs() < 1e-9);
            assert_eq!(back.results[k].served_by, v.served_by);
        }
        let svg_text = std::fs::read_to_string(&svg).unwrap();
        assert_eq!(svg_text.matches("<polyline").count(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn different_workloads_and_missing_metrics_are_warned_about() {
        let mut runs = vec![
            run("filter", 1.0, 0.0, 0.0),
            run("round_robin", 1.0, 0.0, 0.0),
        ];
        runs[0].results.workload.request_count = 199;
        runs[1].results.metrics = None;
        let r = build_report("s", &runs, None, false, References::default());
        assert_eq!(r.setup.warnings.len(), 2, "{:?}", r.setup.warnings);
        assert!(r.figures.is_empty());
        // a fleet reused from an earlier configuration
        if let Some(m) = runs[0].results.metrics.as_mut() {
            for pod in m.before.values_mut() {
                pod.insert(REQUEST_SUCCESS.to_string(), 12.0);
            }
        }
        let r = build_report("s", &runs, None, false, References::default());
        assert!(
            r.setup
                .warnings
                .iter()
                .any(|w| w.contains("already served 12 requests")),
            "{:?}",
            r.setup.warnings
        );
    }
}
