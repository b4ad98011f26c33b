//! Scrapes the pods' own Prometheus counters before and after a run.
//!
//! The report's prefix-cache hit rate and adapter loads come from the model servers,
//! not from the router: `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`
//! (token counters, so the hit rate is delta hits over delta queries) and
//! `fleet_sim:lora_adapter_loads_total`, each summed over every series and every pod.
//! The pods list comes from fleet-sim's ports file (`--pods-file`).
//!
//! Metric names contain `:`, which some Prometheus parsers reject, so the few lines
//! needed are parsed here directly.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// vLLM v1's prefix-cache hit counter, in tokens (vLLM `vllm/v1/metrics/loggers.py`).
pub const PREFIX_HITS: &str = "vllm:prefix_cache_hits_total";
/// vLLM v1's prefix-cache query counter, in tokens.
pub const PREFIX_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// The same counters under vLLM 0.8's names, used when the current ones are absent.
pub const PREFIX_HITS_V08: &str = "vllm:gpu_prefix_cache_hits_total";
/// See [`PREFIX_HITS_V08`].
pub const PREFIX_QUERIES_V08: &str = "vllm:gpu_prefix_cache_queries_total";
/// fleet-sim's count of LoRA adapter loads (vLLM exposes none).
pub const ADAPTER_LOADS: &str = "fleet_sim:lora_adapter_loads_total";

/// vLLM's finished-request counter: non-zero before a run means the fleet is not fresh.
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";

/// The counters scraped by default.
pub const DEFAULT_COUNTERS: &[&str] = &[
    PREFIX_HITS,
    PREFIX_QUERIES,
    PREFIX_HITS_V08,
    PREFIX_QUERIES_V08,
    ADAPTER_LOADS,
    REQUEST_SUCCESS,
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
];

/// Per-scrape timeout: a pod that does not answer in this time is reported, not waited
/// for (the sims answer in microseconds; a real pod in milliseconds).
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// One pod of fleet-sim's ports file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodEntry {
    /// Pod name (what `x-served-by` says).
    pub name: String,
    /// Pool name.
    #[serde(default)]
    pub pool: Option<String>,
    /// Base model.
    #[serde(default)]
    pub model: Option<String>,
    /// LoRA adapters it can serve.
    #[serde(default)]
    pub adapters: Vec<String>,
    /// `ip:port`.
    #[serde(default)]
    pub address: Option<String>,
    /// Prometheus endpoint (default: `http://<address>/metrics`).
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// Engine flavour (`vllm`, `sglang`).
    #[serde(default)]
    pub engine: Option<String>,
    /// GPU profile.
    #[serde(default)]
    pub gpu: Option<String>,
}

impl PodEntry {
    /// The URL to scrape, if known.
    pub fn metrics_url(&self) -> Option<String> {
        self.metrics_url
            .clone()
            .or_else(|| self.address.as_ref().map(|a| format!("http://{a}/metrics")))
    }
}

/// fleet-sim's ports file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodsFile {
    /// The pods.
    pub pods: Vec<PodEntry>,
    /// The fleet's admin address.
    #[serde(default)]
    pub admin: Option<String>,
}

/// Why the pods file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The file could not be read.
    #[error("cannot read pods file {path}: {source}")]
    Io {
        /// File path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The file is not a pods file.
    #[error("bad pods file {path}: {source}")]
    Json {
        /// File path.
        path: String,
        /// Underlying error.
        source: serde_json::Error,
    },
}

impl PodsFile {
    /// Reads a pods file.
    pub fn load(path: &Path) -> Result<Self, MetricsError> {
        let text = std::fs::read_to_string(path).map_err(|source| MetricsError::Io {
            path: path.display().to_string(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| MetricsError::Json {
            path: path.display().to_string(),
            source,
        })
    }
}

/// Sums of the wanted counters, per pod: pod -> metric -> value.
pub type CounterSums = BTreeMap<String, BTreeMap<String, f64>>;

/// Sums every series of each wanted metric in Prometheus text exposition. Metrics that do
/// not appear are absent from the map (absent is not zero: the server may not have them).
pub fn sum_counters(text: &str, wanted: &[&str]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = parse_sample(line) else {
            continue;
        };
        if wanted.contains(&name) && value.is_finite() {
            *out.entry(name.to_string()).or_insert(0.0) += value;
        }
    }
    out
}

/// Splits a sample line into its metric name and value.
fn parse_sample(line: &str) -> Option<(&str, f64)> {
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = &line[..name_end];
    let mut rest = &line[name_end..];
    if rest.starts_with('{') {
        // skip the label set, honouring quoted values that may contain '}'
        let mut in_quotes = false;
        let mut escaped = false;
        let mut end = None;
        for (i, c) in rest.char_indices() {
            match c {
                _ if escaped => escaped = false,
                '\\' if in_quotes => escaped = true,
                '"' => in_quotes = !in_quotes,
                '}' if !in_quotes => {
                    end = Some(i);
                    break;
                }
                _ => {}
            }
        }
        rest = &rest[end? + 1..];
    }
    let value = rest.split_whitespace().next()?;
    let v = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((name, v))
}

/// Counters before and after a run, and what changed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsDelta {
    /// Per-pod sums before the run.
    pub before: CounterSums,
    /// Per-pod sums after the run.
    pub after: CounterSums,
    /// after - before, summed over pods, per metric (only metrics seen on both scrapes).
    pub total_delta: BTreeMap<String, f64>,
    /// Pods that could not be scraped, with the reason.
    pub scrape_errors: Vec<String>,
}

impl MetricsDelta {
    /// Computes the deltas of two scrapes.
    pub fn between(before: CounterSums, after: CounterSums, scrape_errors: Vec<String>) -> Self {
        let mut total_delta = BTreeMap::new();
        for (pod, a) in &after {
            let Some(b) = before.get(pod) else { continue };
            for (metric, va) in a {
                if let Some(vb) = b.get(metric) {
                    // a counter that went down means the pod restarted: count from zero
                    let d = if va >= vb { va - vb } else { *va };
                    *total_delta.entry(metric.clone()).or_insert(0.0) += d;
                }
            }
        }
        Self {
            before,
            after,
            total_delta,
            scrape_errors,
        }
    }

    /// Prefix-cache hit rate over the run (delta hits / delta queries), if measured.
    pub fn prefix_hit_rate(&self) -> Option<f64> {
        let get = |k: &str| self.total_delta.get(k).copied();
        let (hits, queries) = match (get(PREFIX_HITS), get(PREFIX_QUERIES)) {
            (Some(h), Some(q)) => (h, q),
            _ => (get(PREFIX_HITS_V08)?, get(PREFIX_QUERIES_V08)?),
        };
        (queries > 0.0).then(|| hits / queries)
    }

    /// LoRA adapter loads during the run, if measured.
    pub fn adapter_loads(&self) -> Option<f64> {
        self.total_delta.get(ADAPTER_LOADS).copied()
    }
}

/// Scrapes every pod concurrently; returns the sums and one line per pod that failed.
pub async fn scrape_all(
    client: &reqwest::Client,
    pods: &[PodEntry],
    wanted: &[&str],
) -> (CounterSums, Vec<String>) {
    let mut tasks = tokio::task::JoinSet::new();
    for pod in pods {
        let Some(url) = pod.metrics_url() else {
            continue;
        };
        let client = client.clone();
        let name = pod.name.clone();
        tasks.spawn(async move {
            let res = async {
                let resp = client
                    .get(&url)
                    .timeout(SCRAPE_TIMEOUT)
                    .send()
                    .await?
                    .error_for_status()?;
                resp.text().await
            }
            .await;
            (name, url, res)
        });
    }
    let mut sums = CounterSums::new();
    let mut errors = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((name, _, Ok(text))) => {
                sums.insert(name, sum_counters(&text, wanted));
            }
            Ok((name, url, Err(e))) => errors.push(format!("{name} ({url}): {e}")),
            Err(e) => errors.push(format!("scrape task failed: {e}")),
        }
    }
    (sums, errors)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shape of vLLM v1 output (vLLM 0.10 `/metrics`, trimmed): names with ':', a counter
    /// split over label sets, a label value containing '}' and a timestamp.
    const VLLM: &str = r#"# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1200.0
vllm:prefix_cache_queries_total{engine="1",model_name="odd}name"} 800.0 1712345678000
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 900.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
fleet_sim:lora_adapter_loads_total 4
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e+09
"#;

    #[test]
    fn sums_series_of_wanted_counters_only() {
        let s = sum_counters(VLLM, DEFAULT_COUNTERS);
        assert_eq!(s[PREFIX_QUERIES], 2000.0);
        assert_eq!(s[PREFIX_HITS], 900.0);
        assert_eq!(s[ADAPTER_LOADS], 4.0);
        assert!(!s.contains_key("vllm:num_requests_running"));
        assert!(!s.contains_key(PREFIX_HITS_V08));
    }

    #[test]
    fn delta_gives_hit_rate_and_adapter_loads() {
        let pod = |h: f64, q: f64, l: f64| {
            BTreeMap::from([
                (PREFIX_HITS.to_string(), h),
                (PREFIX_QUERIES.to_string(), q),
                (ADAPTER_LOADS.to_string(), l),
            ])
        };
        let before = CounterSums::from([
            ("a".into(), pod(10.0, 100.0, 1.0)),
            ("b".into(), pod(0.0, 0.0, 0.0)),
        ]);
        let after = CounterSums::from([
            ("a".into(), pod(70.0, 200.0, 3.0)),
            ("b".into(), pod(20.0, 100.0, 2.0)),
        ]);
        let d = MetricsDelta::between(before, after, vec![]);
        // (60 + 20) / (100 + 100)
        assert!((d.prefix_hit_rate().unwrap() - 0.4).abs() < 1e-12);
        assert_eq!(d.adapter_loads(), Some(4.0));
        assert!(MetricsDelta::default().prefix_hit_rate().is_none());
    }

    #[test]
    fn pods_file_in_fleet_sim_format_parses() {
        let text = r#"{"pods": [{"name":"h100-0","pool":"llama-8b","model":"m","adapters":["x"],
            "address":"127.0.0.1:40123","metrics_url":"http://127.0.0.1:40123/metrics",
            "engine":"vllm","gpu":"h100"}, {"name":"p2","address":"127.0.0.1:1"}],
            "admin": "127.0.0.1:40100"}"#;
        let f: PodsFile = serde_json::from_str(text).unwrap();
        assert_eq!(f.pods.len(), 2);
        assert_eq!(
            f.pods[1].metrics_url().as_deref(),
            Some("http://127.0.0.1:1/metrics")
        );
    }
}
