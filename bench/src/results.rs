//! What a load-generator run produces: one record per request, and summaries computed
//! from them with HDR histograms.
//!
//! `results.json` (see [`LoadgenResults`]) holds both, so the report can draw CDFs from
//! the raw records while simple tools read only the summary.

use std::collections::BTreeMap;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::metrics::MetricsDelta;
use crate::workload::WorkloadInfo;

/// Why a request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The server answered with a non-2xx status.
    HttpStatus,
    /// Connecting failed, or the connection broke mid-response.
    Connection,
    /// The per-request timeout fired.
    Timeout,
    /// The stream was malformed: invalid JSON, an error object, no content, or no
    /// `[DONE]` before the end.
    BadStream,
}

impl ErrorKind {
    /// The snake_case name used in summaries.
    pub fn name(self) -> &'static str {
        match self {
            ErrorKind::HttpStatus => "http_status",
            ErrorKind::Connection => "connection",
            ErrorKind::Timeout => "timeout",
            ErrorKind::BadStream => "bad_stream",
        }
    }
}

/// One request as sent and answered. Times are milliseconds; `scheduled_ms` and
/// `sent_ms` count from the run's start, the others from `sent_ms`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Index in the workload.
    pub id: usize,
    /// `model` field sent.
    pub model: String,
    /// Prompt length in characters.
    pub prompt_chars: usize,
    /// `max_tokens` sent.
    pub max_tokens: u64,
    /// When the workload said to send it.
    pub scheduled_ms: f64,
    /// When it was actually sent (send lag = sent - scheduled).
    pub sent_ms: f64,
    /// HTTP status, if a response arrived.
    pub status: Option<u16>,
    /// Failure kind; `None` for success.
    pub error: Option<ErrorKind>,
    /// Failure detail (status body, error text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_detail: Option<String>,
    /// Time to the response headers.
    pub headers_ms: Option<f64>,
    /// Time to the first chunk with non-empty content (TTFT).
    pub ttft_ms: Option<f64>,
    /// Time to the end of the stream.
    pub e2e_ms: Option<f64>,
    /// Output tokens: the final `usage.completion_tokens`, else the content chunk count.
    pub output_tokens: u64,
    /// Whether `output_tokens` came from `usage`.
    pub usage_reported: bool,
    /// The `x-served-by` response header.
    pub served_by: Option<String>,
    /// The filter's `x-gateway-debug` response header, when its `debug_header` option is on
    /// (why the request went where it went).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_debug: Option<String>,
}

impl RequestRecord {
    /// Send lag in milliseconds.
    pub fn send_lag_ms(&self) -> f64 {
        (self.sent_ms - self.scheduled_ms).max(0.0)
    }

    /// Whether the request succeeded.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// Percentiles of a distribution, in its unit (milliseconds or tokens/s).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Samples.
    pub count: u64,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest sample.
    pub max: f64,
}

/// HDR histogram resolution: values are recorded in microseconds (or milli-tokens/s)
/// with 3 significant digits, i.e. within 0.1% — finer than any difference the
/// benchmark's targets talk about.
const SIGFIG: u8 = 3;
/// Values are recorded in thousandths of their unit.
const SCALE: f64 = 1000.0;

impl Percentiles {
    /// Percentiles of the values (NaN and negative values are ignored).
    pub fn of(values: impl IntoIterator<Item = f64>) -> Self {
        let Ok(mut h) = Histogram::<u64>::new(SIGFIG) else {
            return Self::default();
        };
        for v in values {
            if v.is_finite() && v >= 0.0 {
                // auto-resizing histogram: recording cannot fail for u64 values
                let _ = h.record((v * SCALE).round() as u64);
            }
        }
        if h.is_empty() {
            return Self::default();
        }
        let q = |p: f64| h.value_at_quantile(p) as f64 / SCALE;
        Self {
            count: h.len(),
            mean: h.mean() / SCALE,
            p50: q(0.50),
            p90: q(0.90),
            p95: q(0.95),
            p99: q(0.99),
            max: h.max() as f64 / SCALE,
        }
    }
}

/// The send-lag figures: how late the load generator itself was.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SendLag {
    /// Median lag (ms).
    pub p50_ms: f64,
    /// 99th percentile lag (ms).
    pub p99_ms: f64,
    /// Largest lag (ms).
    pub max_ms: f64,
}

/// The summary of a run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: u64,
    /// Requests that succeeded.
    pub ok: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Failures by kind (`http_status`, `connection`, `timeout`, `bad_stream`).
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Failures by HTTP status code.
    pub errors_by_status: BTreeMap<String, u64>,
    /// TTFT of successful requests (ms).
    pub ttft_ms: Percentiles,
    /// End-to-end latency of successful requests (ms).
    pub e2e_ms: Percentiles,
    /// Time per output token after the first, of successful requests with > 1 token (ms).
    pub tpot_ms: Percentiles,
    /// Per-request decode speed: (tokens - 1) / (e2e - ttft), tokens/s.
    pub decode_tokens_per_s: Percentiles,
    /// Output tokens of successful requests.
    pub output_tokens: u64,
    /// Output tokens per wall second, over the run (first send to last completion).
    pub output_tokens_per_s: f64,
    /// Successful requests per wall second over the run.
    pub requests_per_s: f64,
    /// Wall seconds from the first send to the last completion.
    pub wall_s: f64,
    /// Send lag.
    pub send_lag: SendLag,
    /// Requests per serving pod (`x-served-by`; `unknown` without the header).
    pub served_by: BTreeMap<String, u64>,
    /// Most requests in flight at once.
    pub max_in_flight: u64,
}

impl Summary {
    /// Summarises records; `max_in_flight` comes from the runner.
    pub fn of(records: &[RequestRecord], max_in_flight: u64) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
        let mut s = Summary {
            requests: records.len() as u64,
            ok: ok.len() as u64,
            errors: (records.len() - ok.len()) as u64,
            max_in_flight,
            ..Summary::default()
        };
        for r in records {
            if let Some(kind) = r.error {
                *s.errors_by_kind.entry(kind.name().to_string()).or_default() += 1;
                if let (ErrorKind::HttpStatus, Some(code)) = (kind, r.status) {
                    *s.errors_by_status.entry(code.to_string()).or_default() += 1;
                }
            }
            let pod = r.served_by.clone().unwrap_or_else(|| "unknown".into());
            *s.served_by.entry(pod).or_default() += 1;
        }
        s.ttft_ms = Percentiles::of(ok.iter().filter_map(|r| r.ttft_ms));
        s.e2e_ms = Percentiles::of(ok.iter().filter_map(|r| r.e2e_ms));
        let decode = |r: &&RequestRecord| match (r.ttft_ms, r.e2e_ms) {
            (Some(t), Some(e)) if r.output_tokens > 1 && e > t => {
                Some(((e - t) / (r.output_tokens - 1) as f64, r.output_tokens))
            }
            _ => None,
        };
        s.tpot_ms = Percentiles::of(ok.iter().filter_map(decode).map(|(tpot, _)| tpot));
        s.decode_tokens_per_s =
            Percentiles::of(ok.iter().filter_map(decode).map(|(tpot, _)| 1000.0 / tpot));
        s.output_tokens = ok.iter().map(|r| r.output_tokens).sum();
        let start = records
            .iter()
            .map(|r| r.sent_ms)
            .fold(f64::INFINITY, f64::min);
        let end = records
            .iter()
            .filter_map(|r| r.e2e_ms.map(|e| r.sent_ms + e))
            .fold(f64::NEG_INFINITY, f64::max);
        if end > start {
            s.wall_s = (end - start) / 1000.0;
            s.output_tokens_per_s = s.output_tokens as f64 / s.wall_s;
            s.requests_per_s = s.ok as f64 / s.wall_s;
        }
        let lag = Percentiles::of(records.iter().map(RequestRecord::send_lag_ms));
        s.send_lag = SendLag {
            p50_ms: lag.p50,
            p99_ms: lag.p99,
            max_ms: lag.max,
        };
        s
    }
}

/// Facts about the run itself.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    /// Base URL the requests went to.
    pub target: String,
    /// Unix time (ms) of the run's start.
    pub started_unix_ms: u64,
    /// Per-request timeout (s).
    pub request_timeout_s: f64,
    /// Configuration label, if given (`round_robin`, `least_request`, `filter`, ...).
    pub label: Option<String>,
}

/// Everything `loadgen --out` writes.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadgenResults {
    /// Format version of this file.
    pub version: u32,
    /// The run.
    pub run: RunInfo,
    /// The workload replayed.
    pub workload: WorkloadInfo,
    /// The summary.
    pub summary: Summary,
    /// Pod metrics scraped before and after, if a pods file was given.
    #[serde(default)]
    pub metrics: Option<MetricsDelta>,
    /// The workload's TTFT references on the fleet, if a fleet file was given (computed,
    /// not measured: see `floor.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub references: Option<TtftReferences>,
    /// Every request.
    pub records: Vec<RequestRecord>,
}

/// TTFT references of a workload on a fleet (milliseconds): the floor (each request alone on
/// an idle pod holding every earlier prefix) and the greedy oracle router's TTFT.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct TtftReferences {
    /// Percentiles of the floors.
    pub floor_ms: Percentiles,
    /// Percentiles of the greedy oracle router's TTFTs.
    pub oracle_ms: Percentiles,
}

/// Current version of [`LoadgenResults`].
pub const RESULTS_VERSION: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: usize, sent: f64, ttft: f64, e2e: f64, tokens: u64) -> RequestRecord {
        RequestRecord {
            id,
            model: "m".into(),
            prompt_chars: 10,
            max_tokens: tokens,
            scheduled_ms: sent - 0.5,
            sent_ms: sent,
            status: Some(200),
            error: None,
            error_detail: None,
            headers_ms: Some(ttft / 2.0),
            ttft_ms: Some(ttft),
            e2e_ms: Some(e2e),
            output_tokens: tokens,
            usage_reported: true,
            served_by: Some(format!("pod-{}", id % 2)),
            gateway_debug: None,
        }
    }

    #[test]
    fn percentiles_are_within_hdr_precision() {
        let p = Percentiles::of((1..=1000).map(f64::from));
        assert_eq!(p.count, 1000);
        assert!((p.p50 - 500.0).abs() <= 0.5, "{p:?}");
        assert!((p.p99 - 990.0).abs() <= 1.0, "{p:?}");
        assert!((p.max - 1000.0).abs() <= 1.0);
        assert!((p.mean - 500.5).abs() < 0.5);
        assert_eq!(Percentiles::of(std::iter::empty()), Percentiles::default());
    }

    #[test]
    fn summary_counts_errors_pods_and_throughput() {
        let mut records: Vec<RequestRecord> = (0..10)
            .map(|i| rec(i, i as f64 * 100.0, 50.0, 1050.0, 101))
            .collect();
        records[3].error = Some(ErrorKind::HttpStatus);
        records[3].status = Some(503);
        records[4].error = Some(ErrorKind::Timeout);
        records[4].served_by = None;
        let s = Summary::of(&records, 4);
        assert_eq!((s.requests, s.ok, s.errors), (10, 8, 2));
        assert_eq!(s.errors_by_kind["http_status"], 1);
        assert_eq!(s.errors_by_kind["timeout"], 1);
        assert_eq!(s.errors_by_status["503"], 1);
        assert_eq!(s.served_by["unknown"], 1);
        assert_eq!(s.served_by.values().sum::<u64>(), 10);
        assert_eq!(s.output_tokens, 8 * 101);
        // first send 0 ms, last completion 900 + 1050 ms
        assert!((s.wall_s - 1.95).abs() < 1e-9);
        assert!((s.output_tokens_per_s - 808.0 / 1.95).abs() < 1e-6);
        // 100 tokens decoded in 1000 ms
        assert!((s.decode_tokens_per_s.p50 - 100.0).abs() < 0.2);
        assert!((s.tpot_ms.p50 - 10.0).abs() < 0.02);
        assert!((s.send_lag.p99_ms - 0.5).abs() < 0.01);
        assert_eq!(s.max_in_flight, 4);
    }
}
