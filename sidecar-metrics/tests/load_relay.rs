//! The in-flight count relay through the whole sidecar: its peers' surface (`POST /v1/load` on
//! `prefix.listen` and on `listen`) and two sidecars relaying one Envoy's counts to another's,
//! against fake Envoys on 127.0.0.1.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;
#[path = "common/replica_name.rs"]
mod replica_name;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use common::eventually;
use replica_name::plain;
use sidecar_metrics::app::{self, RunOptions, Running};
use sidecar_metrics::config::{Config, Overrides, TlsConfig};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// One POST of counts an Envoy received: (authorization, x-gpuroute-replica, body).
type Post = (String, String, Vec<u8>);

/// An Envoy as the sidecar sees it: takes snapshots, answers its own in-flight counts (404 when
/// `None`), records the counts posted to it.
#[derive(Clone, Default)]
struct FakeEnvoy {
    counts: Arc<Mutex<Option<Vec<u8>>>>,
    got: Arc<Mutex<Vec<Post>>>,
    refuse: Arc<Mutex<bool>>,
    /// Its own routing decisions, given out to the prefix relay (none unless set).
    decisions: Arc<Mutex<Option<gpuroute_core::prefix::SyncLog>>>,
    /// Prefix records posted to it (bodies).
    records: Arc<Mutex<Vec<Vec<u8>>>>,
}

impl FakeEnvoy {
    /// Serves on a fresh port; the Envoy and its push URL.
    async fn start(counts: Option<&[u8]>) -> (FakeEnvoy, String) {
        let f = FakeEnvoy::default();
        *f.counts.lock().unwrap() = counts.map(<[u8]>::to_vec);
        let app = axum::Router::new()
            .route(
                "/gpuroute/v1/snapshot",
                post(|| async { StatusCode::NO_CONTENT }),
            )
            .route("/gpuroute/v1/load", get(counts_get).post(counts_post))
            .route("/gpuroute/v1/prefix", get(prefix_get).post(prefix_post))
            .with_state(f.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        (f, format!("http://{addr}/gpuroute/v1/snapshot"))
    }

    /// Bodies received from `replica`: a sidecar's replica name without the random part
    /// drawn at its start (`gw-1/0` for `gw-1@0123abcd/0`), or a name as it came.
    fn from(&self, replica: &str) -> Vec<Vec<u8>> {
        self.got
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, r, _)| r == replica || plain(r) == replica)
            .map(|(_, _, b)| b.clone())
            .collect()
    }
}

/// The filter's side of the prefix exchange: its decisions after the cursor asked with.
async fn prefix_get(State(f): State<FakeEnvoy>, h: HeaderMap) -> Response {
    use gpuroute_core::exchange::{Cursor, Export, CURSOR_HEADER};
    let after = h
        .get(CURSOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let mut e = Export::new(Cursor::parse(after));
    if let Some(log) = f.decisions.lock().unwrap().as_ref() {
        e.add_log(3, log);
    }
    let (body, cursor) = e.finish();
    ([(CURSOR_HEADER, cursor)], body).into_response()
}

async fn prefix_post(State(f): State<FakeEnvoy>, body: Bytes) -> StatusCode {
    f.records.lock().unwrap().push(body.to_vec());
    StatusCode::NO_CONTENT
}

async fn counts_get(State(f): State<FakeEnvoy>) -> Response {
    match f.counts.lock().unwrap().clone() {
        Some(b) => b.into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn counts_post(State(f): State<FakeEnvoy>, h: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let auth = header("authorization");
    let Some(posted) = replica_name::posted(auth, header("x-gpuroute-replica"), &body) else {
        return StatusCode::BAD_REQUEST;
    };
    f.got.lock().unwrap().extend(posted);
    if *f.refuse.lock().unwrap() {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::NO_CONTENT
    }
}

/// A sidecar named `source` pushing to `push`, relaying to `peers`, with a peers' listener.
fn config(source: &str, push: Vec<String>, peers: Vec<String>) -> Config {
    let mut c = Config::default();
    c.apply(Overrides {
        listen: Some("127.0.0.1:0".into()),
        ingest_urls: push,
        token: Some("tok".into()),
        // A pod nobody serves: scraping fails, which the relay does not care about.
        pools: vec!["llama=127.0.0.1:1".into()],
        prefix_peers: peers,
        ..Overrides::default()
    })
    .unwrap();
    c.source = Some(source.into());
    c.prefix.listen = Some("127.0.0.1:0".into());
    c
}

async fn start(cfg: Config) -> Running {
    app::start(cfg, RunOptions::default(), CancellationToken::new())
        .await
        .unwrap()
}

/// A port nobody listens on.
fn closed_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

/// POSTs `body` to `addr`'s `/v1/load` over plain HTTP with these headers; the status, 0 for
/// no answer.
async fn post_load(addr: SocketAddr, headers: &[(&str, &str)], body: impl AsRef<[u8]>) -> u16 {
    let mut req = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .post(format!("http://{addr}/v1/load"))
        .body(body.as_ref().to_vec());
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.send().await.map_or(0, |r| r.status().as_u16())
}

/// Counts with `requests` in prefill on one pod, as the filter writes them.
fn counts(requests: u32) -> Vec<u8> {
    use gpuroute_core::replica_load::{PodPrefill, ReplicaLoad};
    let pod = PodPrefill {
        key: 7,
        requests,
        tokens: 100 * requests,
    };
    ReplicaLoad {
        pools: vec![("llama".into(), vec![pod])],
    }
    .encode()
}

async fn metrics(addr: SocketAddr) -> String {
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

#[tokio::test]
async fn the_load_surface_checks_the_token_and_the_replica_and_hands_the_counts_to_every_envoy() {
    let ((a, ua), (b, ub)) = (
        FakeEnvoy::start(Some(b"own counts")).await,
        FakeEnvoy::start(Some(b"own counts")).await,
    );
    let run = start(config("gw-1", vec![ua, ub], vec![])).await;
    let peer = run.peer_addr.unwrap();
    let auth = ("authorization", "Bearer tok");
    let replica = ("x-gpuroute-replica", "gw-2/0");

    assert_eq!(post_load(peer, &[replica], b"c").await, 401);
    let wrong = ("authorization", "Bearer nope");
    assert_eq!(post_load(peer, &[wrong, replica], b"c").await, 401);
    assert_eq!(post_load(peer, &[auth], b"c").await, 400);
    let spaced = ("x-gpuroute-replica", "gw 2");
    assert_eq!(post_load(peer, &[auth, spaced], b"c").await, 400);
    let long = "x".repeat(129);
    let long = ("x-gpuroute-replica", long.as_str());
    assert_eq!(post_load(peer, &[auth, long], b"c").await, 400);
    // Not counts as the filter writes them: refused here, not bundled with other replicas'.
    assert_eq!(post_load(peer, &[auth, replica], b"c").await, 400);
    assert_eq!(post_load(peer, &[auth, replica], b"GPL1\x01").await, 400);
    assert!(a.from("gw-2/0").is_empty() && b.from("gw-2/0").is_empty());

    assert_eq!(post_load(peer, &[auth, replica], counts(1)).await, 204);
    for envoy in [&a, &b] {
        assert_eq!(envoy.from("gw-2/0"), vec![counts(1)]);
        let posts = envoy.got.lock().unwrap().clone();
        assert!(posts.iter().all(|(auth, _, _)| auth == "Bearer tok"));
    }
    // The main surface serves it too.
    assert_eq!(
        post_load(run.local_addr, &[auth, replica], counts(2)).await,
        204
    );
    assert_eq!(a.from("gw-2/0").len(), 2);

    // Meanwhile the sidecar's own relay hands each Envoy's counts to the other.
    assert!(eventually(Duration::from_secs(5), || !b.from("gw-1/0").is_empty()).await);
    assert_eq!(b.from("gw-1/0")[0], b"own counts".to_vec());
    assert!(eventually(Duration::from_secs(5), || !a.from("gw-1/1").is_empty()).await);
    let m = metrics(run.local_addr).await;
    assert!(
        m.contains("gpuroute_sidecar_replica_load_relayed_total{direction=\"in\"} 2\n"),
        "{m}"
    );
    for line in [
        "gpuroute_sidecar_replica_load_relayed_total{direction=\"out\"} ",
        "gpuroute_sidecar_replica_load_failures_total{target=\"envoy\"} ",
        "gpuroute_sidecar_replica_load_failures_total{target=\"peer\"} 0\n",
        "gpuroute_sidecar_replica_load_busy_skips_total ",
        "gpuroute_sidecar_replica_load_unchanged_total ",
        "gpuroute_sidecar_replica_load_bundled_total 0\n",
    ] {
        assert!(m.contains(line), "{line} in {m}");
    }

    // No Envoy takes them: 502.
    *a.refuse.lock().unwrap() = true;
    *b.refuse.lock().unwrap() = true;
    assert_eq!(post_load(peer, &[auth, replica], counts(3)).await, 502);
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn the_load_surface_is_404_with_the_load_relay_off() {
    let ((_a, ua), (_b, ub)) = (FakeEnvoy::start(None).await, FakeEnvoy::start(None).await);
    let mut cfg = config("gw-1", vec![ua, ub], vec![]);
    cfg.prefix.load_interval_ms = 0;
    let run = start(cfg).await;
    assert!(run.load_relay.is_none() && run.relay.is_some());
    let auth = ("authorization", "Bearer tok");
    let replica = ("x-gpuroute-replica", "gw-2");
    for addr in [run.peer_addr.unwrap(), run.local_addr] {
        assert_eq!(post_load(addr, &[auth, replica], b"c").await, 404);
    }
    assert!(!metrics(run.local_addr)
        .await
        .contains("sidecar_replica_load"));
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn the_peers_listener_runs_for_the_load_relay_alone() {
    let (a, ua) = FakeEnvoy::start(None).await;
    let mut cfg = config("gw-1", vec![ua], vec![closed_port()]);
    cfg.prefix.enabled = false;
    let run = start(cfg).await;
    assert!(run.relay.is_none() && run.load_relay.is_some());
    let auth = ("authorization", "Bearer tok");
    let replica = ("x-gpuroute-replica", "gw-2");
    assert_eq!(
        post_load(run.peer_addr.unwrap(), &[auth, replica], counts(1)).await,
        204
    );
    assert_eq!(a.from("gw-2"), vec![counts(1)]);
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn one_replicas_counts_reach_another_replicas_envoy_within_100_ms() {
    // Replica 2: Envoy B, its sidecar's peer a dead address (replica 1 is not known to it).
    let (b, ub) = FakeEnvoy::start(None).await;
    let two = start(config("gw-2", vec![ub], vec![closed_port()])).await;
    // Replica 1: Envoy A, relaying to replica 2's sidecar.
    let (a, ua) = FakeEnvoy::start(Some(&counts(1))).await;
    let peer = format!("http://{}", two.peer_addr.unwrap());
    let one = start(config("gw-1", vec![ua], vec![peer])).await;

    assert!(eventually(Duration::from_secs(5), || !b.from("gw-1").is_empty()).await);
    // A change on A reaches B through both sidecars within 100 ms (a few ms on an idle machine:
    // one 5 ms tick and two loopback hops; the margin is for a loaded CI machine).
    *a.counts.lock().unwrap() = Some(counts(2));
    let t0 = Instant::now();
    let mut took = None;
    while t0.elapsed() < Duration::from_secs(5) {
        if b.from("gw-1").last().is_some_and(|c| *c == counts(2)) {
            took = Some(t0.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        took.is_some_and(|t| t < Duration::from_millis(100)),
        "{took:?}"
    );
    // The body now stands still: it is kept alive every `prefix.load_keepalive_ms` (20 ms: ~10
    // bodies in 200 ms, well inside the filter's 50 ms ttl), not posted every 5 ms (~40).
    let before = b.from("gw-1").len();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let sent = b.from("gw-1").len() - before;
    assert!((3..=15).contains(&sent), "{sent} bodies in 200 ms");
    let m = metrics(one.local_addr).await;
    let unchanged = m
        .lines()
        .find_map(|l| l.strip_prefix("gpuroute_sidecar_replica_load_unchanged_total "))
        .and_then(|v| v.parse::<u64>().ok());
    assert!(unchanged.is_some_and(|n| n > 0), "{m}");
    // Nothing goes back: B's sidecar reads B (404 here), and A hears nothing from replica 2.
    assert!(a.got.lock().unwrap().is_empty());
    for run in [one, two] {
        run.shutdown();
        run.wait(Duration::from_secs(5)).await;
    }
}

/// `testdata/tls/{name}`.
fn tls_file(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tls")
        .join(name)
}

/// The sidecars' mutual TLS: the test authority's `peer` certificate, for `gpuroute-peers`.
fn peer_tls() -> TlsConfig {
    TlsConfig {
        ca_file: Some(tls_file("ca.pem")),
        cert_file: Some(tls_file("peer.pem")),
        key_file: Some(tls_file("peer.key")),
        // Peers are reached by IP; their certificate names the Service.
        server_name: Some("gpuroute-peers".into()),
        insecure_skip_verify: false,
    }
}

#[tokio::test]
async fn replicas_relay_over_mutual_tls_and_the_peers_listener_takes_no_one_else() {
    let (b, ub) = FakeEnvoy::start(None).await;
    let mut cfg_two = config("gw-2", vec![ub], vec![]);
    cfg_two.prefix.peers = vec![closed_port().replace("http:", "https:")];
    cfg_two.prefix.tls = peer_tls();
    cfg_two.validate().unwrap();
    let two = start(cfg_two).await;
    let (_a, ua) = FakeEnvoy::start(Some(&counts(1))).await;
    let peer = two.peer_addr.unwrap();
    let mut cfg_one = config("gw-1", vec![ua], vec![]);
    cfg_one.prefix.peers = vec![format!("https://{peer}")];
    cfg_one.prefix.tls = peer_tls();
    cfg_one.validate().unwrap();
    let one = start(cfg_one).await;

    // Replica 1's Envoy's counts reach replica 2's Envoy, sidecar to sidecar over TLS.
    assert!(
        eventually(Duration::from_secs(5), || b.from("gw-1").last()
            == Some(&counts(1)))
        .await
    );

    // Plain HTTP to the peers' listener gets nowhere, token or not.
    let auth = ("authorization", "Bearer tok");
    let replica = ("x-gpuroute-replica", "intruder");
    let before = b.from("intruder").len();
    assert_eq!(post_load(peer, &[auth, replica], counts(3)).await, 0);
    // Nor does TLS without a certificate of the authority: the handshake refuses it.
    let no_cert = TlsConfig {
        cert_file: None,
        key_file: None,
        ..peer_tls()
    };
    let tls = sidecar_metrics::tls::client_tls(&no_cert, "prefix.tls").unwrap();
    let client = sidecar_metrics::client::HttpClient::with_tls(1, Duration::from_secs(5), &tls);
    let auth_value = sidecar_metrics::client::bearer("tok");
    let replica_value = http::HeaderValue::from_static("intruder");
    let req = sidecar_metrics::client::request(
        http::Method::POST,
        format!("https://{peer}/v1/load"),
        &[
            (sidecar_metrics::client::AUTH, &auth_value),
            ("x-gpuroute-replica", &replica_value),
        ],
        counts(3).into(),
    )
    .unwrap();
    let refused = client.send(req, 1 << 16).await;
    assert!(
        matches!(refused, Err(sidecar_metrics::client::HttpError::Connect(_))),
        "{refused:?}"
    );
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(b.from("intruder").len(), before);
    for run in [one, two] {
        run.shutdown();
        run.wait(Duration::from_secs(5)).await;
    }
}

/// The value of metric `name` (a line `name value`) in `m`.
fn metric(m: &str, name: &str) -> Option<u64> {
    m.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

#[tokio::test]
async fn replicas_with_one_source_are_told_apart() {
    // Replica A, whose Envoy takes the others' counts (its own peer a dead address, so that its
    // relay runs); B and C relay to it. All three have the `source` of one shared ConfigMap.
    let (a, ua) = FakeEnvoy::start(None).await;
    let one = start(config("gw", vec![ua], vec![closed_port()])).await;
    let peer = format!("http://{}", one.peer_addr.unwrap());
    let (_b, ub) = FakeEnvoy::start(Some(&counts(1))).await;
    let (_c, uc) = FakeEnvoy::start(Some(&counts(2))).await;
    let two = start(config("gw", vec![ub], vec![peer.clone()])).await;
    let three = start(config("gw", vec![uc], vec![peer])).await;
    let names = || {
        let mut n: Vec<String> = a.got.lock().unwrap().iter().map(|p| p.1.clone()).collect();
        n.sort();
        n.dedup();
        n
    };
    // B's and C's counts both stand in A's Envoy, each under a name of its own.
    let both = || {
        let n = names();
        n.iter().any(|r| a.from(r).contains(&counts(1)))
            && n.iter().any(|r| a.from(r).contains(&counts(2)))
    };
    assert!(eventually(Duration::from_secs(5), both).await);
    let n = names();
    assert_eq!(n.len(), 2, "{n:?}");
    for r in &n {
        assert!(r.starts_with("gw@") && r.len() == "gw@".len() + 8, "{r}");
        assert!(
            a.from(r).iter().all(|b| *b == a.from(r)[0]),
            "{r}: one replica each"
        );
    }
    assert_eq!(
        metric(
            &metrics(one.local_addr).await,
            "gpuroute_sidecar_replica_load_name_clashes_total"
        ),
        Some(0)
    );
    for run in [one, two, three] {
        run.shutdown();
        run.wait(Duration::from_secs(5)).await;
    }
}

/// POSTs counts to `addr`'s `/v1/load` from `local` (a loopback address) under `replica`, as
/// `sidecar` when given; the status.
async fn post_from(local: &str, addr: SocketAddr, replica: &str, sidecar: Option<&str>) -> u16 {
    let client = reqwest::Client::builder()
        .no_proxy()
        .local_address(local.parse::<std::net::IpAddr>().unwrap())
        .build()
        .unwrap();
    let mut req = client
        .post(format!("http://{addr}/v1/load"))
        .header("authorization", "Bearer tok")
        .header("x-gpuroute-replica", replica)
        .body(counts(1));
    if let Some(s) = sidecar {
        req = req.header("x-gpuroute-sidecar", s);
    }
    req.send().await.map_or(0, |r| r.status().as_u16())
}

#[tokio::test]
async fn two_senders_under_one_replica_name_are_counted() {
    let (_a, ua) = FakeEnvoy::start(None).await;
    let run = start(config("gw-1", vec![ua], vec![closed_port()])).await;
    let peer = run.peer_addr.unwrap();
    let clashes = || async {
        metric(
            &metrics(run.local_addr).await,
            "gpuroute_sidecar_replica_load_name_clashes_total",
        )
    };
    // One sender, whichever of its addresses it comes from when it names itself (dual stack).
    assert_eq!(post_from("127.0.0.1", peer, "gw-2", Some("s-2")).await, 204);
    assert_eq!(post_from("127.0.0.2", peer, "gw-2", Some("s-2")).await, 204);
    assert_eq!(post_from("127.0.0.1", peer, "gw-3", None).await, 204);
    assert_eq!(post_from("127.0.0.1", peer, "gw-3", None).await, 204);
    assert_eq!(clashes().await, Some(0));
    // Two: another sidecar's name, another address.
    assert_eq!(post_from("127.0.0.3", peer, "gw-2", Some("s-9")).await, 204);
    assert_eq!(post_from("127.0.0.2", peer, "gw-3", None).await, 204);
    assert_eq!(clashes().await, Some(2));
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn a_sidecar_among_its_own_peers_takes_nothing_from_itself() {
    // A shared static list of peers that names this replica too (the same happens with POD_IP
    // unset, or of the other family than the one DNS gives): the sidecar's peers' listener is
    // one of its peers. (Its port reserved and let go: the list must name it before it starts.)
    let own = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let own_addr = own.local_addr().unwrap();
    drop(own);
    let (a, ua) = FakeEnvoy::start(Some(&counts(1))).await;
    let mut log = gpuroute_core::prefix::SyncLog::new(16);
    log.push(7, &[1, 2]);
    *a.decisions.lock().unwrap() = Some(log);
    let mut cfg = config(
        "gw-1",
        vec![ua],
        vec![format!("http://{own_addr}"), closed_port()],
    );
    cfg.prefix.listen = Some(own_addr.to_string());
    let run = start(cfg).await;
    assert_eq!(run.peer_addr, Some(own_addr));
    let dropped = |kind: &'static str| async move {
        let m = metrics(run.local_addr).await;
        let name = format!("gpuroute_sidecar_{kind}_own_dropped_total");
        metric(&m, &name)
    };
    let echoed = || !a.got.lock().unwrap().is_empty() || !a.records.lock().unwrap().is_empty();
    // The first post of each relay reaches the sidecar itself, which drops it...
    let t0 = Instant::now();
    while dropped("replica_load").await < Some(1) || dropped("prefix_relay").await < Some(1) {
        if echoed() || t0.elapsed() > Duration::from_secs(5) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ...and that peer is then left out: no more posts to itself, where the load relay posted
    // its unchanged counts every 20 ms (50 in a second).
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    // Its Envoy never got its own counts or records back.
    let got = a.got.lock().unwrap().len();
    assert_eq!(got, 0, "its own counts came back {got} times");
    assert!(
        a.records.lock().unwrap().is_empty(),
        "its own records came back"
    );
    for kind in ["replica_load", "prefix_relay"] {
        let n = dropped(kind).await;
        assert!(n.is_some_and(|n| (1..=2).contains(&n)), "{kind}: {n:?}");
    }
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}
