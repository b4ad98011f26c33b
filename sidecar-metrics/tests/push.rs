//! Pushing against a local fake of the filter's ingest endpoint: Envoy down then back, a wrong
//! token, and a slow Envoy that must not build a backlog; and what the status page and
//! `/metrics` say of a pod that answers nothing when asked for only the metrics read.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{eventually, vllm_body, FakeIngest, FakePod};
use sidecar_metrics::app::{self, RunOptions};
use sidecar_metrics::config::{Config, Overrides};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn config(pod: &FakePod, ingest: &str, token: &str, interval_ms: u64) -> Config {
    let mut c = Config::default();
    c.apply(Overrides {
        interval_ms: Some(interval_ms),
        listen: Some("127.0.0.1:0".into()),
        ingest_urls: vec![format!("http://{ingest}/gpuroute/v1/snapshot")],
        token: Some(token.into()),
        pools: vec![format!("llama={}", pod.addr)],
        ..Overrides::default()
    })
    .unwrap();
    c
}

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    let r = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// Serves `ingest` on a free loopback port; its address.
async fn serve_on_any_port(ingest: &FakeIngest) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    ingest.serve(listener);
    addr
}

#[tokio::test]
async fn envoy_down_then_back_up() {
    let pod = FakePod::start(&vllm_body(2)).await;
    // A port nobody listens on yet: connection refused, like an Envoy that is restarting.
    let reserved = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let run = app::start(
        config(&pod, &reserved.to_string(), "tok", 50),
        RunOptions::default(),
        CancellationToken::new(),
    )
    .await
    .unwrap();

    let failing = eventually(Duration::from_secs(3), || {
        run.push[0]
            .stats()
            .failures
            .iter()
            .any(|(k, n)| *k == "unreachable" && *n >= 3)
    })
    .await;
    assert!(
        failing,
        "pushes fail while Envoy is down: {:?}",
        run.push[0].stats()
    );
    assert_eq!(get(run.local_addr, "/readyz").await.0, 503);
    // Scraping goes on meanwhile.
    let v1 = run.published.borrow().as_ref().unwrap().snapshot.version;
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(run.published.borrow().as_ref().unwrap().snapshot.version > v1);

    let ingest = FakeIngest::new("tok");
    ingest.serve(tokio::net::TcpListener::bind(reserved).await.unwrap());
    let back = tokio::time::Instant::now();
    assert!(eventually(Duration::from_secs(3), || !ingest.versions().is_empty()).await);
    // The next round's snapshot goes out as soon as Envoy answers again.
    assert!(
        back.elapsed() < Duration::from_millis(500),
        "resumed after {:?}",
        back.elapsed()
    );
    assert!(eventually(Duration::from_secs(2), || ingest.versions().len() >= 5).await);
    let (status, _) = get(run.local_addr, "/readyz").await;
    assert_eq!(status, 200);
    let snaps = ingest.received.lock().unwrap().clone();
    assert!(snaps.windows(2).all(|w| w[1].version > w[0].version));
    let pod_snap = &snaps.last().unwrap().pools[0].pods[0];
    assert!(pod_snap.healthy);
    assert_eq!(pod_snap.waiting, 2);
    assert_eq!(pod_snap.address, pod.addr.to_string());
    run.shutdown();
    run.wait(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn a_wrong_token_is_reported_and_never_ready() {
    let pod = FakePod::start(&vllm_body(0)).await;
    let ingest = FakeIngest::new("right");
    let addr = serve_on_any_port(&ingest).await;
    let run = app::start(
        config(&pod, &addr.to_string(), "wrong", 50),
        RunOptions::default(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    assert!(
        eventually(Duration::from_secs(3), || ingest
            .unauthorized
            .load(std::sync::atomic::Ordering::SeqCst)
            >= 3)
        .await
    );
    let stats = run.push[0].stats();
    assert!(
        stats.failures.iter().any(|(k, _)| *k == "unauthorized_401"),
        "{stats:?}"
    );
    assert_eq!(stats.accepted, 0);
    let (status, body) = get(run.local_addr, "/readyz").await;
    assert_eq!(status, 503);
    assert!(body.contains(&addr.to_string()), "{body}");
    let (_, metrics) = get(run.local_addr, "/metrics").await;
    assert!(metrics.contains("reason=\"unauthorized_401\""), "{metrics}");
    run.shutdown();
}

#[tokio::test]
async fn a_slow_envoy_gets_the_newest_snapshot_without_a_backlog() {
    let pod = FakePod::start(&vllm_body(1)).await;
    let ingest = FakeIngest::new("tok");
    *ingest.delay.lock().unwrap() = Duration::from_millis(200);
    let addr = serve_on_any_port(&ingest).await;
    let run = app::start(
        config(&pod, &addr.to_string(), "tok", 20),
        RunOptions::default(),
        CancellationToken::new(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let rounds = run.published.borrow().as_ref().unwrap().round.index;
    let versions = ingest.versions();
    // ~55 rounds in 1.1 s, but one push at a time, each 200 ms: at most 6 got through.
    assert!(rounds >= 30, "{rounds} rounds");
    assert!(
        (3..=7).contains(&versions.len()),
        "{} pushes: {versions:?}",
        versions.len()
    );
    assert_eq!(
        ingest
            .max_in_flight
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "never two pushes at once"
    );
    // Each push carried the newest snapshot: consecutive pushes skip the rounds in between.
    let round_version_step = 20 * 1000; // 20 ms of version space per round
    assert!(
        versions
            .windows(2)
            .all(|w| w[1] - w[0] >= 5 * round_version_step),
        "{versions:?}"
    );
    run.shutdown();
}

#[tokio::test]
async fn a_pod_that_answers_nothing_filtered_is_scraped_whole_and_shown_so() {
    // A multiprocess prometheus_client registry (SGLang's): asked for names, it answers none.
    let body = vllm_body(4);
    let router = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |axum::extract::RawQuery(q): axum::extract::RawQuery| {
            let body = body.clone();
            async move {
                if q.is_some() {
                    String::new()
                } else {
                    body
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pod_addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await });
    // The same body for every query: a server that ignores the filter stays asked through it.
    let ignoring = FakePod::start(&vllm_body(1)).await;
    let ingest = FakeIngest::new("tok");
    let ingest_addr = serve_on_any_port(&ingest).await;
    let mut cfg = config(&ignoring, &ingest_addr.to_string(), "tok", 50);
    cfg.apply(Overrides {
        pools: vec![format!("llama={},{pod_addr}", ignoring.addr)],
        ..Overrides::default()
    })
    .unwrap();
    let run = app::start(cfg, RunOptions::default(), CancellationToken::new())
        .await
        .unwrap();
    let healthy = eventually(Duration::from_secs(3), || {
        run.published.borrow().as_ref().is_some_and(|p| {
            p.snapshot.pools[0]
                .pods
                .iter()
                .all(|d| d.healthy && d.waiting > 0)
        })
    })
    .await;
    assert!(healthy, "both pods read");
    let (_, metrics) = get(run.local_addr, "/metrics").await;
    assert!(
        metrics.contains("\ngpuroute_sidecar_scrape_filter_fallbacks_total 1\n"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("kind=\"no_metrics\""),
        "not a failed scrape: {metrics}"
    );
    let (_, page) = get(run.local_addr, "/").await;
    let row = |addr: std::net::SocketAddr| {
        page.split("<tr>")
            .find(|r| r.contains(&format!(">{addr}<")))
            .unwrap_or_default()
            .to_string()
    };
    assert!(row(pod_addr).contains("whole"), "{page}");
    assert!(!row(ignoring.addr).contains("whole"), "{page}");
    run.shutdown();
}

#[tokio::test]
async fn the_metrics_listener_serves_metrics_and_nothing_of_the_fleet() {
    let pod = FakePod::start(&vllm_body(0)).await;
    let ingest = FakeIngest::new("tok");
    let addr = serve_on_any_port(&ingest).await;
    let mut cfg = config(&pod, &addr.to_string(), "tok", 50);
    cfg.metrics_listen = Some("127.0.0.1:0".into());
    let run = app::start(cfg, RunOptions::default(), CancellationToken::new())
        .await
        .unwrap();
    let metrics_addr = run.metrics_addr.expect("metrics_listen bound");
    assert_ne!(metrics_addr, run.local_addr);
    // The same families as /metrics on `listen`, once a round and a push are in.
    assert!(
        eventually(Duration::from_secs(3), || run.push[0].stats().accepted >= 1).await,
        "no push accepted"
    );
    let (status, metrics) = get(metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    for family in [
        "gpuroute_sidecar_pods{gpuroute_pool=\"llama\",healthy=\"true\"} 1",
        "gpuroute_sidecar_push_accepted_total{url=",
    ] {
        assert!(metrics.contains(family), "{family} missing from {metrics}");
    }
    assert_eq!(get(metrics_addr, "/healthz").await, (200, "ok\n".into()));
    // The fleet's detail stays on `listen`.
    for path in ["/debug/snapshot", "/", "/readyz"] {
        assert_eq!(get(metrics_addr, path).await.0, 404, "{path}");
        assert_eq!(get(run.local_addr, path).await.0, 200, "{path}");
    }
    run.shutdown();
}

#[tokio::test]
async fn a_metrics_listen_that_is_not_an_address_stops_the_start() {
    let pod = FakePod::start(&vllm_body(0)).await;
    let mut cfg = config(&pod, "127.0.0.1:1", "tok", 50);
    cfg.metrics_listen = Some("everywhere:9102".into());
    let err = app::start(cfg, RunOptions::default(), CancellationToken::new())
        .await
        .err()
        .expect("refused");
    assert!(err.to_string().contains("metrics_listen"), "{err}");
}
