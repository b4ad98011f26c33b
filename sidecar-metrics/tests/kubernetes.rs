//! Kubernetes discovery against a local fake API server that speaks list and watch
//! (`common/fake_kube.rs`), driven through the real kube-rs client and watcher.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/fake_kube.rs"]
mod fake_kube;

use axum::routing::get;
use common::{eventually, vllm_body};
use fake_kube::{pod, FakeApi};
use serde_json::json;
use sidecar_metrics::app::{self, RunOptions};
use sidecar_metrics::config::{Config, KubernetesConfig, PoolConfig};
use sidecar_metrics::discovery::{self, kubernetes, UpdateRx};
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn client(addr: std::net::SocketAddr) -> kubernetes::ApiClient {
    client_with(addr, kubernetes::READ_TIMEOUT)
}

fn client_with(addr: std::net::SocketAddr, read_timeout: Duration) -> kubernetes::ApiClient {
    let cfg = kube::Config::new(format!("http://{addr}").parse().unwrap());
    kubernetes::ApiClient::new(cfg, read_timeout).unwrap()
}

/// Discovery of pool 0's pods by the selector `app=vllm` in namespace `llm`, port 8000, through
/// `client`: its updates, and the token that stops it.
fn discover_vllm_pods(client: kubernetes::ApiClient) -> (UpdateRx, CancellationToken) {
    let (tx, rx) = discovery::channel();
    let stop = CancellationToken::new();
    let k = KubernetesConfig {
        namespace: "llm".into(),
        selector: Some("app=vllm".into()),
        port: Some(8000),
        inference_pool: None,
    };
    tokio::spawn(kubernetes::run(
        0,
        pool(k.clone()),
        k,
        client,
        tx,
        stop.clone(),
    ));
    (rx, stop)
}

fn pool(k: KubernetesConfig) -> PoolConfig {
    PoolConfig {
        kubernetes: Some(k),
        ..PoolConfig::named("llama")
    }
}

/// Waits for the next update and returns it as `(address, ready)` pairs.
async fn next(rx: &mut UpdateRx) -> Vec<(String, bool)> {
    let u = tokio::time::timeout(Duration::from_secs(30), rx.recv())
        .await
        .expect("an update")
        .unwrap();
    u.targets
        .iter()
        .map(|t| (t.address.to_string(), t.ready))
        .collect()
}

#[tokio::test]
async fn label_selector_pods_join_leave_and_change_readiness() {
    let api = FakeApi::new();
    api.put("pods", pod("a", "127.0.0.2", "vllm", true));
    api.put("pods", pod("b", "127.0.0.3", "vllm", false));
    api.put("pods", pod("other", "127.0.0.9", "web", true));
    let addr = api.serve().await;
    let (mut rx, stop) = discover_vllm_pods(client(addr));

    assert_eq!(
        next(&mut rx).await,
        vec![
            ("127.0.0.2:8000".into(), true),
            ("127.0.0.3:8000".into(), false)
        ]
    );
    api.put("pods", pod("b", "127.0.0.3", "vllm", true));
    assert_eq!(
        next(&mut rx).await,
        vec![
            ("127.0.0.2:8000".into(), true),
            ("127.0.0.3:8000".into(), true)
        ]
    );
    api.put("pods", pod("c", "127.0.0.4", "vllm", true));
    assert_eq!(next(&mut rx).await.len(), 3);
    api.delete("pods", "a");
    assert_eq!(
        next(&mut rx).await,
        vec![
            ("127.0.0.3:8000".into(), true),
            ("127.0.0.4:8000".into(), true)
        ]
    );
    // A pod that starts terminating leaves at once.
    let mut terminating = pod("c", "127.0.0.4", "vllm", true);
    terminating["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
    api.put("pods", terminating);
    assert_eq!(next(&mut rx).await, vec![("127.0.0.3:8000".into(), true)]);
    // Pods of other apps never show up.
    api.put("pods", pod("other2", "127.0.0.10", "web", true));
    assert!(tokio::time::timeout(Duration::from_millis(300), rx.recv())
        .await
        .is_err());
    stop.cancel();
}

#[tokio::test]
async fn inference_pool_selector_and_target_ports_are_followed() {
    let api = FakeApi::new();
    api.put("pods", pod("a", "127.0.0.2", "vllm", true));
    api.put("pods", pod("s", "127.0.0.5", "sglang", true));
    let ip = |app: &str, port: u16| {
        json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llama", "namespace": "llm"},
            "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}
        })
    };
    api.put("inferencepools", ip("vllm", 8000));
    api.put("inferencepools", json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "unrelated"}, "spec": {"selector": {"matchLabels": {"app": "web"}}, "targetPorts": [{"number": 1}]}}));
    let addr = api.serve().await;
    let (tx, mut rx) = discovery::channel();
    let stop = CancellationToken::new();
    let k = KubernetesConfig {
        namespace: "llm".into(),
        selector: None,
        port: None,
        inference_pool: Some("llama".into()),
    };
    tokio::spawn(kubernetes::run(
        0,
        pool(k.clone()),
        k,
        client(addr),
        tx,
        stop.clone(),
    ));

    assert_eq!(next(&mut rx).await, vec![("127.0.0.2:8000".into(), true)]);
    // The pool is edited to select other pods on another port.
    api.put("inferencepools", ip("sglang", 30000));
    assert_eq!(next(&mut rx).await, vec![("127.0.0.5:30000".into(), true)]);
    // Deleted: the pool has no pods.
    api.delete("inferencepools", "llama");
    let mut last = next(&mut rx).await;
    // A late update of the stopped pod watch may come first; the end state is empty.
    while !last.is_empty() {
        last = next(&mut rx).await;
    }
    stop.cancel();
}

/// An API server that accepts a LIST, or the start of a watch, and never answers: the request
/// fails after the client's read timeout and discovery goes on (before, the pod list froze for
/// good, without a word in the log).
#[tokio::test]
async fn a_hung_list_or_watch_start_times_out_and_discovery_recovers() {
    let api = FakeApi::new();
    api.put("pods", pod("a", "127.0.0.2", "vllm", true));
    api.hang_lists.store(1, Ordering::SeqCst);
    let addr = api.serve().await;
    // Read timeout 2 s: watches ask the server to end them after 1 s.
    let c = client_with(addr, Duration::from_secs(2));
    assert_eq!(c.watch_timeout_secs, 1);
    let (mut rx, stop) = discover_vllm_pods(c);
    let deadline = Duration::from_secs(60);
    let first = tokio::time::timeout(deadline, rx.recv())
        .await
        .expect("the pod list after the hung LIST")
        .unwrap();
    assert_eq!(first.targets.len(), 1);
    assert_eq!(api.hung.load(Ordering::SeqCst), 1);

    // The watch ends after its 1 s; the next watch start hangs. A change made while it hangs
    // arrives once it has timed out and the watch is started again.
    api.hang_watches.store(1, Ordering::SeqCst);
    assert!(eventually(deadline, || api.hung.load(Ordering::SeqCst) == 2).await);
    api.put("pods", pod("a", "127.0.0.2", "vllm", false));
    assert_eq!(next(&mut rx).await, vec![("127.0.0.2:8000".into(), false)]);
    stop.cancel();
}

/// An API server that refuses every LIST (RBAC missing): the watch is tried again after 1, 2,
/// 4, 8... s (up to 30 s), not every ~1 s forever as with kube-rs's backoff (reset by the
/// watcher's `Init` before every LIST), and the pods come once the LIST is allowed.
#[tokio::test]
async fn a_refused_list_is_tried_again_less_and_less_often() {
    let api = FakeApi::new();
    api.put("pods", pod("a", "127.0.0.2", "vllm", true));
    api.list_status.store(403, Ordering::SeqCst);
    let addr = api.serve().await;
    let (mut rx, stop) = discover_vllm_pods(client(addr));
    // Tries at ~0, 1, 3 and 7 s (each delay up to a fifth longer): 4 in 12 s; kube-rs's
    // backoff alone made 7 or more.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let lists = api.lists.load(Ordering::SeqCst);
    assert!((2..=5).contains(&lists), "{lists} LISTs in 12 s");
    api.list_status.store(0, Ordering::SeqCst);
    assert_eq!(next(&mut rx).await, vec![("127.0.0.2:8000".into(), true)]);
    stop.cancel();
}

/// 2,000 pods turn NotReady in one burst while the aggregator is busy. Before, every event
/// queued the whole list on an unbounded channel (2,000 lists of 2,000 pods, O(n^2) to build and
/// in memory); now only the newest list waits, and the burst ends in the right state.
#[tokio::test]
async fn a_burst_of_changes_leaves_only_the_newest_list_waiting() {
    const N: usize = 2000;
    let ip = |i: usize| format!("127.1.{}.{}", i / 250, i % 250 + 1);
    let api = FakeApi::new();
    for i in 0..N {
        api.put("pods", pod(&format!("p{i:05}"), &ip(i), "vllm", true));
    }
    let addr = api.serve().await;
    let (mut rx, stop) = discover_vllm_pods(client(addr));
    let first = next(&mut rx).await;
    assert_eq!((first.len(), first.iter().filter(|p| p.1).count()), (N, N));
    for i in 0..N {
        api.put("pods", pod(&format!("p{i:05}"), &ip(i), "vllm", false));
    }
    // The aggregator is busy for a while, then takes what waits, as it comes.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut taken = 0;
    loop {
        let l = next(&mut rx).await;
        taken += 1;
        assert_eq!(l.len(), N);
        if l.iter().all(|p| !p.1) {
            break;
        }
    }
    assert!(taken <= 50, "{taken} lists taken for one burst");
    stop.cancel();
}

#[tokio::test]
async fn discovered_pods_are_scraped_end_to_end() {
    // Pods on 127.0.0.2 and 127.0.0.3 (loopback), same port, as Kubernetes pod IPs would be.
    let l2 = tokio::net::TcpListener::bind("127.0.0.2:0").await.unwrap();
    let port = l2.local_addr().unwrap().port();
    let Ok(l3) = tokio::net::TcpListener::bind(("127.0.0.3", port)).await else {
        eprintln!("port {port} busy on 127.0.0.3; skipping");
        return;
    };
    for (l, waiting) in [(l2, 4), (l3, 9)] {
        let body = vllm_body(waiting);
        let router = axum::Router::new().route(
            "/metrics",
            get(move || {
                let b = body.clone();
                async move { b }
            }),
        );
        tokio::spawn(async move { axum::serve(l, router).await });
    }
    let api = FakeApi::new();
    api.put("pods", pod("a", "127.0.0.2", "vllm", true));
    api.put("pods", pod("b", "127.0.0.3", "vllm", false));
    let addr = api.serve().await;

    let mut cfg = Config {
        listen: "127.0.0.1:0".into(),
        interval_ms: 50,
        ..Config::default()
    };
    cfg.push.urls.clear();
    cfg.pools.push(pool(KubernetesConfig {
        namespace: "llm".into(),
        selector: Some("app=vllm".into()),
        port: Some(port),
        inference_pool: None,
    }));
    let mut opts = RunOptions::default();
    opts.deps.kube_client = Some(client(addr));
    let run = app::start(cfg, opts, CancellationToken::new())
        .await
        .unwrap();
    let state = |run: &app::Running| -> Vec<(u32, bool)> {
        run.published.borrow().as_ref().map_or(vec![], |p| {
            p.snapshot.pools[0]
                .pods
                .iter()
                .map(|x| (x.waiting, x.healthy))
                .collect()
        })
    };
    assert!(
        eventually(Duration::from_secs(5), || state(&run)
            == vec![(4, true), (9, false)])
        .await,
        "{:?}",
        state(&run)
    );
    // b becomes ready: healthy at its next scrape.
    api.put("pods", pod("b", "127.0.0.3", "vllm", true));
    assert!(
        eventually(Duration::from_secs(5), || state(&run)
            == vec![(4, true), (9, true)])
        .await,
        "{:?}",
        state(&run)
    );
    run.shutdown();
}
