//! The load generator and the scenarios against the real simulated fleet (fleet-sim,
//! in-process on 127.0.0.1 ports, heavily time-compressed so each test takes about a
//! second): every scenario's `fleet` part is a valid fleet-sim fleet file serving the
//! models its workload names; the streams, `x-served-by`, usage and metric names of the
//! sim are what the runner and the scraper expect; and Mooncake's expanded `hash_ids`
//! really hit the simulator's prefix cache.

// test helpers are not #[test] functions, which clippy's allow-unwrap-in-tests covers
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use fleet_sim::{Fleet, FleetFile, Overrides as SimOverrides};
use gpuroute_bench::metrics::{scrape_all, MetricsDelta, PodsFile, DEFAULT_COUNTERS};
use gpuroute_bench::results::Summary;
use gpuroute_bench::runner::{build_client, run, RunConfig};
use gpuroute_bench::scenario::Scenario;
use gpuroute_bench::workload::{Overrides, Workload, WorkloadConfig};

fn scenario_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scenarios")
        .join(format!("{name}.json"))
}

fn fleet_file(s: &Scenario) -> FleetFile {
    serde_json::from_value(s.fleet.clone())
        .unwrap_or_else(|e| panic!("{}: fleet is not a fleet-sim file: {e}", s.name))
}

#[test]
fn every_scenario_fleet_is_a_valid_fleet_sim_file_serving_its_models() {
    for name in [
        "mixed-gpu",
        "bursty",
        "shared-prefix",
        "multi-lora",
        "uniform-steady",
    ] {
        let s = Scenario::load(&scenario_path(name)).unwrap();
        let cfg = fleet_file(&s)
            .resolve(SimOverrides::default())
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let served: Vec<&str> = cfg
            .pods
            .iter()
            .flat_map(|p| {
                std::iter::once(p.model.as_str()).chain(p.adapters.iter().map(String::as_str))
            })
            .collect();
        for m in &s.workload.models().names {
            assert!(
                served.contains(&m.as_str()),
                "{name}: {m} is served by no pod"
            );
        }
    }
}

/// Starts the scenario's fleet at `time_scale`, replays its quick workload (with the given
/// overrides, and a trace start) straight at the first pod; returns the summary, the
/// metrics delta, the pod name and the workload.
async fn replay_on_first_pod(
    name: &str,
    time_scale: f64,
    o: &Overrides,
    start_s: Option<f64>,
) -> (Summary, MetricsDelta, String, Workload) {
    let path = scenario_path(name);
    let s = Scenario::load(&path).unwrap();
    let cfg = fleet_file(&s)
        .resolve(SimOverrides {
            time_scale: Some(time_scale),
            seed: None,
        })
        .unwrap();
    let fleet = Fleet::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    // the ports file as fleet-sim writes it, read as the load generator reads it
    let pods: PodsFile =
        serde_json::from_value(serde_json::to_value(fleet.ports()).unwrap()).unwrap();
    let first = pods.pods[0].clone();
    let mut wc = s.workload_config(true).with_overrides(o);
    if let (Some(start), WorkloadConfig::Trace(t)) = (start_s, &mut wc) {
        t.start_s = start;
    }
    let wl = Arc::new(Workload::build(&wc, path.parent()).unwrap());
    let cfg = RunConfig {
        target: format!("http://{}", first.address.clone().unwrap()),
        request_timeout: Duration::from_secs(20),
        start_delay: Duration::from_millis(20),
        ..RunConfig::default()
    };
    let client = build_client(&cfg).unwrap();
    let (before, e1) = scrape_all(&client, &pods.pods, DEFAULT_COUNTERS).await;
    let out = run(Arc::clone(&wl), client.clone(), &cfg).await;
    let (after, e2) = scrape_all(&client, &pods.pods, DEFAULT_COUNTERS).await;
    assert!(e1.is_empty() && e2.is_empty(), "{e1:?} {e2:?}");
    let summary = Summary::of(&out.records, out.max_in_flight);
    for r in &out.records {
        assert!(r.ok(), "{r:?}");
        assert!(r.usage_reported, "the sim reports usage");
        assert_eq!(
            r.output_tokens, r.max_tokens,
            "the sim generates max_tokens (ignore_eos)"
        );
    }
    fleet.shutdown(Duration::from_secs(1)).await;
    let wl = Arc::try_unwrap(wl).unwrap_or_else(|a| (*a).clone());
    (
        summary,
        MetricsDelta::between(before, after, vec![]),
        first.name,
        wl,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lora_requests_stream_from_the_sim_and_adapter_loads_are_counted() {
    let (s, m, pod, wl) = replay_on_first_pod(
        "multi-lora",
        100.0,
        &Overrides {
            max_requests: Some(40),
            speedup: Some(4.0),
            ..Overrides::default()
        },
        None,
    )
    .await;
    assert_eq!(s.ok, 40);
    assert_eq!(s.served_by.get(&pod), Some(&40), "{:?}", s.served_by);
    let distinct: std::collections::HashSet<&str> =
        wl.requests.iter().map(|r| r.model.as_str()).collect();
    let loads = m
        .adapter_loads()
        .expect("fleet_sim:lora_adapter_loads_total is scraped");
    // two slots: every adapter beyond the first two is loaded at least once
    assert!(
        loads >= distinct.len() as f64,
        "{loads} loads for {} adapters",
        distinct.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mooncake_blocks_hit_the_sim_prefix_cache_as_the_trace_says() {
    let (s, m, _, wl) = replay_on_first_pod(
        "shared-prefix",
        100.0,
        &Overrides {
            max_requests: Some(60),
            speedup: Some(10.0),
            ..Overrides::default()
        },
        // the trace's last minutes revisit earlier conversations: 60 requests from 1000 s
        // on repeat 52% of their blocks
        Some(1000.0),
    )
    .await;
    assert_eq!(s.ok, 60);
    let ideal = wl.info.ideal_prefix_reuse_slice.unwrap();
    let hit = m
        .prefix_hit_rate()
        .expect("vllm prefix cache counters are scraped");
    // one pod with a cache far larger than 60 prompts: the token hit rate approaches the
    // block reuse the trace records (partial last blocks and 16-token alignment lose a little)
    eprintln!("sim prefix hit rate {hit:.3}, trace ideal {ideal:.3}");
    assert!(ideal > 0.2, "the slice shares prefixes: {ideal}");
    assert!(
        hit > 0.85 * ideal && hit < 1.15 * ideal,
        "hit rate {hit} vs ideal {ideal}"
    );
}
