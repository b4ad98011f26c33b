//! relay-peers: `--peers` gateway replicas' requests in prefill, posted to one target the way
//! their sidecars would, for measuring what the fan-in of the load relay costs the receiving
//! side (`scripts/replica_fanin_cost.py`).
//!
//! Each peer posts every `--interval-ms` a body of in-flight counts (`GPL1`, the filter's
//! format) naming itself `peer-<i>` in `x-gpuroute-replica`, to `--target`: a sidecar's
//! `POST /v1/load`, or an Envoy's `ingest.load_path` directly. Every body differs from the one
//! before (a busy replica's counts change at every read), so nothing is skipped as unchanged.
//! The peers start spread over one interval, as independent replicas would be.
//!
//! The posts go through sidecar-metrics' own HTTP client (`sidecar_metrics::client`, hyper's
//! pooled client), as its load relay sends them, so this process's CPU is what the sidecars
//! would spend posting (with reqwest, until 2026-12-06, it was more).
//!
//! Output: one JSON object on stdout: posts sent, taken (2xx), refused, failed, the rate, and
//! the taken posts' latency percentiles. A sidecar answers once its Envoy has taken the counts,
//! so through a sidecar that latency is how long the counts took to reach the Envoy.

use anyhow::{bail, Result};
use clap::Parser;
use gpuroute_bench::results::Percentiles;
use gpuroute_core::prefix::pod_key;
use gpuroute_core::replica_load::{PodPrefill, ReplicaLoad, REPLICA_HEADER};
use sidecar_metrics::client::{self, HttpClient};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};

#[derive(Parser)]
struct Args {
    /// URL the peers post to.
    #[arg(long)]
    target: String,
    /// Bearer token.
    #[arg(long, default_value = "dev-token-change-me")]
    token: String,
    /// Number of peers (other gateway replicas).
    #[arg(long, default_value_t = 1)]
    peers: usize,
    /// Each peer posts every this many milliseconds (sidecar-metrics' `prefix.load_interval_ms`).
    #[arg(long, default_value_t = 5.0)]
    interval_ms: f64,
    /// How long to post, seconds.
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// The pool the counts are for.
    #[arg(long, default_value = "llama")]
    pool: String,
    /// The pods' addresses (host:port), comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    pods: Vec<String>,
}

#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    taken: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    /// Each taken post's latency, milliseconds.
    latency_ms: std::sync::Mutex<Vec<f64>>,
}

/// Peer `peer`'s counts at its `n`th post: every pod has 1-4 requests in prefill, shifted at
/// every post so that no two bodies in a row are the same.
fn counts(pool: &str, keys: &[u64], peer: usize, n: u64) -> ReplicaLoad {
    let pods = keys
        .iter()
        .enumerate()
        .map(|(j, &key)| {
            let requests = u32::try_from((n + (peer + j) as u64) % 4 + 1).unwrap_or(1);
            PodPrefill {
                key,
                requests,
                tokens: requests * 700,
            }
        })
        .collect();
    ReplicaLoad {
        pools: vec![(pool.to_string(), pods)],
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !(a.interval_ms > 0.0 && a.seconds > 0.0) || a.peers == 0 {
        bail!("--interval-ms, --seconds and --peers must be positive");
    }
    let keys: Arc<Vec<u64>> = Arc::new(a.pods.iter().map(|p| pod_key(p)).collect());
    let client = HttpClient::new(a.peers * 2, Duration::from_secs(90));
    let target: http::Uri = a.target.parse()?;
    let auth = client::bearer(&a.token);
    let octets = http::HeaderValue::from_static("application/octet-stream");
    let counted = Arc::new(Counts::default());
    let interval = Duration::from_secs_f64(a.interval_ms / 1e3);
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(a.seconds);
    let mut tasks = Vec::new();
    for peer in 0..a.peers {
        let (client, counted, keys) = (client.clone(), counted.clone(), keys.clone());
        let (target, auth, octets, pool) =
            (target.clone(), auth.clone(), octets.clone(), a.pool.clone());
        let from = http::HeaderValue::from_str(&format!("peer-{peer}"))?;
        let offset = interval.mul_f64(peer as f64 / a.peers as f64);
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(start + offset, interval);
            tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
            let mut n = 0u64;
            loop {
                tick.tick().await;
                if Instant::now() >= end {
                    return;
                }
                n += 1;
                let body = counts(&pool, &keys, peer, n).encode();
                counted.sent.fetch_add(1, Ordering::Relaxed);
                let t0 = Instant::now();
                let headers = [
                    (client::AUTH, &auth),
                    ("content-type", &octets),
                    (REPLICA_HEADER, &from),
                ];
                let sent = match client::request(
                    http::Method::POST,
                    target.clone(),
                    &headers,
                    body.into(),
                ) {
                    Ok(req) => {
                        client
                            .send_within(req, 64 * 1024, Duration::from_millis(500))
                            .await
                    }
                    Err(e) => Err(e),
                };
                let slot = match sent {
                    Ok(r) if r.status.is_success() => {
                        if let Ok(mut l) = counted.latency_ms.lock() {
                            l.push(t0.elapsed().as_secs_f64() * 1e3);
                        }
                        &counted.taken
                    }
                    Ok(_) => &counted.refused,
                    Err(_) => &counted.failed,
                };
                slot.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await?;
    }
    let secs = start.elapsed().as_secs_f64();
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let latency = counted
        .latency_ms
        .lock()
        .map(|l| Percentiles::of(l.iter().copied()))
        .unwrap_or_default();
    let out = serde_json::json!({
        "peers": a.peers,
        "interval_ms": a.interval_ms,
        "seconds": secs,
        "sent": get(&counted.sent),
        "taken": get(&counted.taken),
        "refused": get(&counted.refused),
        "failed": get(&counted.failed),
        "taken_per_s": get(&counted.taken) as f64 / secs,
        "latency_ms": latency,
    });
    println!("{out}");
    Ok(())
}
