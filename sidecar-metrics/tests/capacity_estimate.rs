//! The speed (capacity) estimate against the simulated fleet (`fleet-sim`, whose step times
//! follow a roofline of public GPU figures): it must read identical pods as equal however
//! unevenly they are loaded, and keep real GPU generations apart. Load goes straight to the
//! pods at fixed rates (no router), so the estimate cannot be helped by a balanced load.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use fleet_sim::{Fleet, FleetFile, Overrides as SimOverrides};
use sidecar_metrics::app::{self, RunOptions};
use sidecar_metrics::config::{Config, Overrides};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// Starts a fleet of `(gpu, count)` groups serving Llama-3.1-8B.
async fn fleet(groups: &[(&str, u32)]) -> (Fleet, Vec<String>) {
    let pods: Vec<serde_json::Value> = groups
        .iter()
        .map(|(gpu, n)| {
            serde_json::json!({"name": gpu, "count": n, "pool": "p", "model": MODEL, "gpu": gpu})
        })
        .collect();
    let file: FleetFile =
        serde_json::from_value(serde_json::json!({"seed": 1, "engine": "vllm", "pods": pods}))
            .unwrap();
    let cfg = file.resolve(SimOverrides::default()).unwrap();
    let fleet = Fleet::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let addrs = fleet
        .ports()
        .pods
        .iter()
        .map(|p| p.address.clone())
        .collect();
    (fleet, addrs)
}

/// Sends `rates[i]` requests a second to pod `i` for `secs` seconds (1,000-token prompts, 64
/// tokens out, every prompt different), scraped by an in-process aggregator every 100 ms with a
/// `window_ms` capacity window; returns the capacities of the last snapshot, in pod order.
async fn capacities_under_load(addrs: &[String], rates: &[f64], secs: f64) -> Vec<f64> {
    let mut cfg = Config::default();
    cfg.apply(Overrides {
        interval_ms: Some(100),
        listen: Some("127.0.0.1:0".into()),
        pools: vec![format!("p={}", addrs.join(","))],
        ..Overrides::default()
    })
    .unwrap();
    cfg.push.urls.clear();
    cfg.capacity.time_constant_ms = 4_000;
    let run = app::start(cfg, RunOptions::default(), CancellationToken::new())
        .await
        .unwrap();
    let client = reqwest::Client::new();
    let mut senders = tokio::task::JoinSet::new();
    for (i, (addr, rate)) in addrs.iter().zip(rates).enumerate() {
        let (client, url, rate) = (
            client.clone(),
            format!("http://{addr}/v1/chat/completions"),
            *rate,
        );
        senders.spawn(async move {
            let n = (rate * secs) as usize;
            let gap = Duration::from_secs_f64(1.0 / rate);
            let mut requests = tokio::task::JoinSet::new();
            for k in 0..n {
                // ~4 characters a token: 1,000 tokens, unique from the first block on.
                let text = format!("pod {i} request {k}: ").repeat(400)[..4000].to_string();
                let body = serde_json::json!({
                    "model": MODEL, "max_tokens": 64,
                    "messages": [{"role": "user", "content": text}],
                });
                let (client, url) = (client.clone(), url.clone());
                requests.spawn(async move {
                    let r = client.post(&url).json(&body).send().await.unwrap();
                    assert!(r.status().is_success(), "{}", r.status());
                    r.bytes().await.unwrap();
                });
                tokio::time::sleep(gap).await;
            }
            while let Some(r) = requests.join_next().await {
                r.unwrap();
            }
        });
    }
    // Read the estimate while the load is still on (at its end the last requests drain).
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let snap = run.published.borrow().as_ref().unwrap().snapshot.clone();
    while let Some(r) = senders.join_next().await {
        r.unwrap();
    }
    run.shutdown();
    addrs
        .iter()
        .map(|a| {
            let pod = snap.pools[0].pods.iter().find(|p| &p.address == a).unwrap();
            pod.capacity
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_pods_read_equal_however_unevenly_loaded() {
    let (fleet, addrs) = fleet(&[("a100", 4)]).await;
    // The first pod gets three times the others' traffic: more prefill chunks beside its
    // decoding and a bigger batch. A mean of its inter-token latency read it as slower.
    let caps = capacities_under_load(&addrs, &[6.0, 2.0, 2.0, 2.0], 6.0).await;
    eprintln!("A100 x4, 3:1:1:1 load: capacities {caps:?}");
    fleet.shutdown(Duration::from_secs(1)).await;
    assert!(
        caps.iter().all(|c| (0.8..=1.25).contains(c)),
        "identical pods, capacities {caps:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_generations_stay_apart() {
    // H100 vs L40S: 3.35 vs 0.864 TB/s of HBM, so a decode step (memory bound) ~3.9x faster.
    let (fleet, addrs) = fleet(&[("h100", 2), ("l40s", 2)]).await;
    let caps = capacities_under_load(&addrs, &[3.0, 3.0, 3.0, 3.0], 6.0).await;
    eprintln!("H100 x2 + L40S x2, even load: capacities {caps:?}");
    fleet.shutdown(Duration::from_secs(1)).await;
    let (fast, slow) = (caps[0].min(caps[1]), caps[2].max(caps[3]));
    assert!(
        fast / slow >= 2.5,
        "H100 {:?} vs L40S {:?}: {:.2}x",
        &caps[..2],
        &caps[2..],
        fast / slow
    );
}
