//! The aggregator's own Prometheus metrics (`GET /metrics`), rendered by hand in the text
//! format: a handful of families does not justify a metrics framework, and every value already
//! lives in the published round or the push targets' stats.

use crate::aggregator::Published;
use crate::push::PushTarget;
use gpuroute_core::snapshot::{PodSnapshot, PoolSnapshot};
use std::fmt::Write;
use std::time::Duration;

/// Bucket bounds (seconds) for scrape, round and push latencies: from 1 ms (a loopback scrape)
/// to 1 s (well past the default 300 ms scrape timeout).
pub const LATENCY_BUCKETS: [f64; 11] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// A fixed-bucket histogram (cumulative on render).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    overflow: u64,
    sum: f64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&mut self, d: Duration) {
        let s = d.as_secs_f64();
        self.sum += s;
        match LATENCY_BUCKETS.iter().position(|b| s <= *b) {
            Some(i) => self.counts[i] += 1,
            None => self.overflow += 1,
        }
    }

    /// Number of observations.
    pub fn count(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.overflow
    }

    /// Writes the `_bucket`, `_sum` and `_count` lines; `labels` is `k="v",...` or empty.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cum = 0;
        for (b, c) in LATENCY_BUCKETS.iter().zip(self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {cum}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}",
            self.count()
        );
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count());
    }
}

/// Escapes a label value for the text format.
pub fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// Renders every family.
pub fn render(published: Option<&Published>, push: &[std::sync::Arc<PushTarget>]) -> String {
    let mut out = String::with_capacity(16 * 1024);
    if let Some(p) = published {
        header(
            &mut out,
            "gpuroute_sidecar_scrape_duration_seconds",
            "histogram",
            "Time to fetch and read one pod's /metrics (successes and failures).",
        );
        p.scrape_latency
            .render(&mut out, "gpuroute_sidecar_scrape_duration_seconds", "");
        header(&mut out, "gpuroute_sidecar_round_duration_seconds", "histogram",
            "Time from a round's start until every pod scraped in it answered (or the publish deadline).");
        p.round_latency
            .render(&mut out, "gpuroute_sidecar_round_duration_seconds", "");
        header(
            &mut out,
            "gpuroute_sidecar_rounds_incomplete_total",
            "counter",
            "Rounds published at the deadline with some pods still being scraped.",
        );
        let _ = writeln!(
            out,
            "gpuroute_sidecar_rounds_incomplete_total {}",
            p.rounds_incomplete
        );
        header(
            &mut out,
            "gpuroute_sidecar_scrape_filter_fallbacks_total",
            "counter",
            "Pods scraped whole after asking for only the metrics read found none (filter_metrics).",
        );
        let _ = writeln!(
            out,
            "gpuroute_sidecar_scrape_filter_fallbacks_total {}",
            p.filter_fallbacks
        );
        header(
            &mut out,
            "gpuroute_sidecar_scrape_failures_total",
            "counter",
            "Failed scrapes per pod and kind (connect, timeout, status, body, parse, no_metrics).",
        );
        for (pool, statuses) in p.snapshot.pools.iter().zip(&p.status) {
            for (pod, st) in pool.pods.iter().zip(statuses) {
                for (kind, n) in &st.failures_by_kind {
                    let _ = writeln!(out,
                        "gpuroute_sidecar_scrape_failures_total{{gpuroute_pool=\"{}\",gpuroute_endpoint=\"{}\",kind=\"{kind}\"}} {n}",
                        esc(&pool.name), esc(&pod.address));
                }
            }
        }
        header(
            &mut out,
            "gpuroute_sidecar_pods",
            "gauge",
            "Pods per pool and health.",
        );
        for pool in &p.snapshot.pools {
            let healthy = pool.pods.iter().filter(|x| x.healthy).count();
            let _ = writeln!(
                out,
                "gpuroute_sidecar_pods{{gpuroute_pool=\"{}\",healthy=\"true\"}} {healthy}",
                esc(&pool.name)
            );
            let _ = writeln!(
                out,
                "gpuroute_sidecar_pods{{gpuroute_pool=\"{}\",healthy=\"false\"}} {}",
                esc(&pool.name),
                pool.pods.len() - healthy
            );
        }
        pool_load(&mut out, &p.snapshot.pools);
        header(
            &mut out,
            "gpuroute_sidecar_snapshot_bytes",
            "gauge",
            "Size of the last snapshot's JSON.",
        );
        let _ = writeln!(out, "gpuroute_sidecar_snapshot_bytes {}", p.json.len());
        header(
            &mut out,
            "gpuroute_sidecar_snapshot_version",
            "gauge",
            "Version of the last snapshot.",
        );
        let _ = writeln!(
            out,
            "gpuroute_sidecar_snapshot_version {}",
            p.snapshot.version
        );
        let totals = [
            (
                "gpuroute_sidecar_snapshots_invalid_total",
                "Snapshots that failed their own validation and were not pushed (a bug).",
                p.invalid_snapshots,
            ),
            (
                "gpuroute_sidecar_pods_quarantined_total",
                "Pods published without their values, as unhealthy, because the snapshot would have refused them.",
                p.pods_quarantined,
            ),
            (
                "gpuroute_sidecar_snapshots_trimmed_total",
                "Snapshots pushed without (some of) the pods' adapter lists, to fit push.max_snapshot_bytes.",
                p.snapshots_trimmed,
            ),
            (
                "gpuroute_sidecar_pods_left_out_total",
                "Pods left out of snapshots past the schema's 10,000.",
                p.pods_left_out,
            ),
        ];
        for (name, help, n) in totals {
            header(&mut out, name, "counter", help);
            let _ = writeln!(out, "{name} {n}");
        }
    }
    header(
        &mut out,
        "gpuroute_sidecar_push_duration_seconds",
        "histogram",
        "Time to POST one snapshot to an ingest URL (answered pushes).",
    );
    for t in push {
        let s = t.stats();
        s.latency.render(
            &mut out,
            "gpuroute_sidecar_push_duration_seconds",
            &format!("url=\"{}\"", esc(&t.url)),
        );
    }
    header(
        &mut out,
        "gpuroute_sidecar_push_accepted_total",
        "counter",
        "Snapshots accepted (204) per ingest URL.",
    );
    for t in push {
        let _ = writeln!(
            out,
            "gpuroute_sidecar_push_accepted_total{{url=\"{}\"}} {}",
            esc(&t.url),
            t.stats().accepted
        );
    }
    header(&mut out, "gpuroute_sidecar_push_failures_total", "counter",
        "Failed pushes per ingest URL and reason (unreachable, timeout, rejected_400, unauthorized_401, too_large_413, status).");
    for t in push {
        for (kind, n) in &t.stats().failures {
            let _ = writeln!(
                out,
                "gpuroute_sidecar_push_failures_total{{url=\"{}\",reason=\"{kind}\"}} {n}",
                esc(&t.url)
            );
        }
    }
    out
}

/// Each pool's load as its healthy pods report it (the pods the filter picks from): requests
/// waiting and running, summed, and the mean KV-cache use of those that report it (no sample
/// when none does, as TGI's pods). Signals for autoscaling the pools (deploy/autoscaling/), and
/// for the dashboard.
fn pool_load(out: &mut String, pools: &[PoolSnapshot]) {
    type Count = fn(&PodSnapshot) -> u32;
    let sums: [(&str, &str, Count); 2] = [
        (
            "gpuroute_sidecar_pool_waiting",
            "Requests waiting in the pool's healthy pods (the sum of their queues).",
            |x| x.waiting,
        ),
        (
            "gpuroute_sidecar_pool_running",
            "Requests running in the pool's healthy pods (the sum of their batches).",
            |x| x.running,
        ),
    ];
    for (name, help, of) in sums {
        header(out, name, "gauge", help);
        for pool in pools {
            let sum: u64 = healthy(pool).map(|x| u64::from(of(x))).sum();
            let _ = writeln!(out, "{name}{{gpuroute_pool=\"{}\"}} {sum}", esc(&pool.name));
        }
    }
    header(
        out,
        "gpuroute_sidecar_pool_kv_cache_usage",
        "gauge",
        "Mean KV-cache use (0..1) of the pool's healthy pods that report it.",
    );
    for pool in pools {
        let (n, sum) = healthy(pool)
            .filter_map(|x| x.kv_cache_usage)
            .fold((0u32, 0.0), |(n, sum), kv| (n + 1, sum + kv));
        if n > 0 {
            let _ = writeln!(
                out,
                "gpuroute_sidecar_pool_kv_cache_usage{{gpuroute_pool=\"{}\"}} {}",
                esc(&pool.name),
                sum / f64::from(n)
            );
        }
    }
}

fn healthy(pool: &PoolSnapshot) -> impl Iterator<Item = &PodSnapshot> {
    pool.pods.iter().filter(|x| x.healthy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_load_sums_the_healthy_pods_and_averages_the_kv_use_they_report() {
        let pod = |waiting, running, kv, healthy| PodSnapshot {
            waiting,
            running,
            kv_cache_usage: kv,
            healthy,
            ..PodSnapshot::new("10.0.0.1:8000", 0)
        };
        let pools = [
            PoolSnapshot {
                name: "llama".into(),
                pods: vec![
                    pod(3, 10, Some(0.5), true),
                    pod(1, 6, Some(0.25), true),
                    pod(0, 4, None, true),
                    // Left out: the filter does not pick it, so it takes no load.
                    pod(50, 50, Some(1.0), false),
                ],
            },
            PoolSnapshot {
                name: "tgi\"pool".into(),
                pods: vec![pod(2, 1, None, true)],
            },
            PoolSnapshot {
                name: "empty".into(),
                pods: vec![],
            },
        ];
        let mut out = String::new();
        pool_load(&mut out, &pools);
        let samples: Vec<_> = crate::prom::parse(&out).collect::<Result<_, _>>().unwrap();
        let value = |name: &str, pool: &str| {
            samples
                .iter()
                .find(|s| s.name == name && s.label("gpuroute_pool").as_deref() == Some(pool))
                .map(|s| s.value)
        };
        let waiting = "gpuroute_sidecar_pool_waiting";
        let running = "gpuroute_sidecar_pool_running";
        let kv = "gpuroute_sidecar_pool_kv_cache_usage";
        assert_eq!(value(waiting, "llama"), Some(4.0));
        assert_eq!(value(running, "llama"), Some(20.0));
        assert_eq!(value(kv, "llama"), Some(0.375));
        assert_eq!(value(waiting, "tgi\"pool"), Some(2.0));
        assert_eq!(value(kv, "tgi\"pool"), None);
        assert_eq!(value(waiting, "empty"), Some(0.0));
        assert_eq!(value(running, "empty"), Some(0.0));
        assert_eq!(value(kv, "empty"), None);
    }

    #[test]
    fn histogram_renders_cumulative_buckets_that_our_parser_reads() {
        let mut h = Histogram::default();
        for ms in [0, 3, 3, 40, 5000] {
            h.observe(Duration::from_millis(ms));
        }
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "a=\"b\"");
        let samples: Vec<_> = crate::prom::parse(&out).collect::<Result<_, _>>().unwrap();
        let bucket = |le: &str| {
            samples
                .iter()
                .find(|s| s.name == "x_seconds_bucket" && s.label("le").as_deref() == Some(le))
                .unwrap()
                .value
        };
        assert_eq!(bucket("0.001"), 1.0);
        assert_eq!(bucket("0.005"), 3.0);
        assert_eq!(bucket("0.05"), 4.0);
        assert_eq!(bucket("2.5"), 4.0);
        assert_eq!(bucket("+Inf"), 5.0);
        assert_eq!(h.count(), 5);
    }
}
