//! The scrape loop over real sockets: a slow pod and a dead pod never delay the healthy ones,
//! and a pod's change reaches the snapshot within about one interval.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{eventually, vllm_body, FakePod};
use sidecar_metrics::app::{self, RunOptions};
use sidecar_metrics::config::{Config, Overrides};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn slow_and_dead_pods_do_not_hold_up_the_round() {
    let fast = FakePod::start(&vllm_body(1)).await;
    let slow = FakePod::start(&vllm_body(2)).await;
    slow.set_delay(Duration::from_secs(5));
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cfg = Config::default();
    cfg.apply(Overrides {
        interval_ms: Some(100),
        listen: Some("127.0.0.1:0".into()),
        pools: vec![format!("p={},{},{}", fast.addr, slow.addr, dead)],
        ..Overrides::default()
    })
    .unwrap();
    cfg.push.urls.clear();
    let (obs, mut rounds) = mpsc::unbounded_channel();
    let run = app::start(
        cfg,
        RunOptions {
            round_observer: Some(obs),
            ..RunOptions::default()
        },
        CancellationToken::new(),
    )
    .await
    .unwrap();
    let mut durations = Vec::new();
    for _ in 0..15 {
        durations.push(rounds.recv().await.unwrap().duration);
    }
    // The deadline is 50 ms; allow scheduling noise on a loaded machine, never the 300 ms timeout.
    assert!(
        durations.iter().all(|d| *d < Duration::from_millis(150)),
        "{durations:?}"
    );
    let p = run.published.borrow().clone().unwrap();
    let pods = &p.snapshot.pools[0].pods;
    let by = |a: std::net::SocketAddr| pods.iter().find(|x| x.address == a.to_string()).unwrap();
    assert!(by(fast.addr).healthy);
    assert!(
        p.snapshot.generated_at_ms - by(fast.addr).last_scrape_ms <= 150,
        "fast pod data is fresh"
    );
    assert!(!by(slow.addr).healthy && !by(dead).healthy);

    // A change on the fast pod shows up within about one interval.
    fast.set_body(&vllm_body(42));
    let changed = tokio::time::Instant::now();
    assert!(
        eventually(Duration::from_secs(2), || {
            run.published.borrow().as_ref().unwrap().snapshot.pools[0]
                .pods
                .iter()
                .any(|x| x.waiting == 42)
        })
        .await
    );
    assert!(
        changed.elapsed() <= Duration::from_millis(250),
        "seen after {:?}",
        changed.elapsed()
    );
    run.shutdown();
}
