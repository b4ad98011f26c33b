//! The in-flight count relay against real HTTP servers on 127.0.0.1: fake Envoys (their
//! `GET`/`POST {load_path}`) and fake peers (`POST /v1/load`).

use super::super::test_support::{blackhole, plain, posted};
use super::super::{Kind, Relay};
use super::*;
use crate::config::{Config, DnsConfig};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::sync::atomic::AtomicUsize;
use std::sync::Mutex;
use tokio::time::Instant;

/// One POST received: (authorization, x-gpuroute-replica, body).
type Post = (String, String, Vec<u8>);

/// A stand-in for one Envoy's side of the exchange (the filter's own is the other engineer's),
/// also serving a peer sidecar's `POST /v1/load`.
#[derive(Clone, Default)]
struct Fake {
    /// What `GET` answers: `None` is 404 (the filter's exchange off).
    counts: Arc<Mutex<Option<Vec<u8>>>>,
    /// `GET`s received.
    reads: Arc<AtomicUsize>,
    /// `POST`s received, in order, a bundle's entries each on its own.
    got: Arc<Mutex<Vec<Post>>>,
    /// `POST` requests received (a bundle is one), and when.
    posts: Arc<Mutex<Vec<Instant>>>,
    /// When set, `POST` answers this instead of 204.
    refuse: Arc<Mutex<Option<StatusCode>>>,
}

impl Fake {
    fn serving(body: &[u8]) -> Fake {
        let f = Fake::default();
        f.set_counts(body);
        f
    }

    fn set_counts(&self, body: &[u8]) {
        *self.counts.lock().unwrap() = Some(body.to_vec());
    }

    fn got(&self) -> Vec<Post> {
        self.got.lock().unwrap().clone()
    }

    /// Bodies received from `replica`.
    fn from(&self, replica: &str) -> Vec<Vec<u8>> {
        self.got()
            .into_iter()
            .filter(|(_, r, _)| r == replica)
            .map(|(_, _, b)| b)
            .collect()
    }
}

async fn fake_get(State(f): State<Fake>, h: HeaderMap) -> Response {
    f.reads.fetch_add(1, Ordering::SeqCst);
    if h.get("authorization").and_then(|v| v.to_str().ok()) != Some("Bearer secret-token") {
        return StatusCode::UNAUTHORIZED.into_response();
    }
    match f.counts.lock().unwrap().clone() {
        Some(b) => ([("content-type", "application/octet-stream")], b).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn fake_post(State(f): State<Fake>, h: HeaderMap, body: Bytes) -> StatusCode {
    let header = |name: &str| {
        h.get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    f.posts.lock().unwrap().push(Instant::now());
    let auth = header("authorization");
    let Some(posted) = posted(auth, plain(&header(REPLICA_HEADER)), &body) else {
        return StatusCode::BAD_REQUEST;
    };
    f.got.lock().unwrap().extend(posted);
    f.refuse.lock().unwrap().unwrap_or(StatusCode::NO_CONTENT)
}

/// Serves `f` on a fresh port; its base URL.
async fn serve(f: Fake) -> String {
    let app = Router::new()
        .route("/gpuroute/v1/load", get(fake_get).post(fake_post))
        .route(LOAD_PEER_PATH, post(fake_post))
        .with_state(f);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, app).await });
    format!("http://{addr}")
}

/// A port nobody listens on: connections are refused.
fn closed_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://{}", l.local_addr().unwrap())
}

/// A configuration pushing to `envoys` (base URLs), relaying to `peers`, as replica `gw-1`.
fn config(envoys: &[&str], peers: &[&str]) -> Config {
    let mut cfg = Config {
        source: Some("gw-1".into()),
        ..Config::default()
    };
    cfg.push.token = Some("secret-token".into());
    cfg.push.urls = envoys
        .iter()
        .map(|e| format!("{e}/gpuroute/v1/snapshot"))
        .collect();
    cfg.prefix.peers = peers.iter().map(|p| p.to_string()).collect();
    cfg
}

fn relay(cfg: &Config) -> Arc<Relay> {
    Relay::load_from_config(cfg, crate::push::client()).unwrap()
}

/// Waits until no delivery is under way (at most 5 s).
async fn settle(relay: &Relay) {
    for _ in 0..500 {
        if relay.busy.lock().unwrap().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until `cond` holds (at most `limit`); how long that took, or `None`.
async fn within(limit: Duration, cond: impl Fn() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if cond() {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

/// Envoys A and B (this sidecar pushes to both) and one peer, each a fake serving on loopback,
/// and the relay's configuration for them.
async fn two_envoys_and_a_peer(a: Fake, b: Fake) -> (Fake, Fake, Fake, Config) {
    let peer = Fake::default();
    let (ua, ub, up) = (
        serve(a.clone()).await,
        serve(b.clone()).await,
        serve(peer.clone()).await,
    );
    let cfg = config(&[&ua, &ub], &[&up]);
    (a, b, peer, cfg)
}

#[tokio::test]
async fn a_round_hands_each_envoys_counts_to_the_other_envoys_and_the_peers_as_they_came() {
    let (a, b, peer, mut cfg) = two_envoys_and_a_peer(
        Fake::serving(b"counts of A"),
        Fake::serving(&[0, 1, 2, 255]),
    )
    .await;
    // No keepalive during the test: only changed bodies go out.
    cfg.prefix.load_keepalive_ms = 10_000;
    let relay = relay(&cfg);
    assert_eq!(relay.kind, Kind::Load);
    relay.load_round().await;
    settle(&relay).await;

    let want = |replica: &str, body: &[u8]| {
        (
            "Bearer secret-token".to_string(),
            replica.to_string(),
            body.to_vec(),
        )
    };
    assert_eq!(b.got(), vec![want("gw-1/0", b"counts of A")]);
    assert_eq!(a.got(), vec![want("gw-1/1", &[0, 1, 2, 255])]);
    let mut at_peer = peer.got();
    at_peer.sort();
    assert_eq!(
        at_peer,
        vec![
            want("gw-1/0", b"counts of A"),
            want("gw-1/1", &[0, 1, 2, 255])
        ]
    );
    assert_eq!(relay.stats.records_out.load(Ordering::Relaxed), 2);
    assert_eq!(relay.stats.envoy_failures.load(Ordering::Relaxed), 0);
    assert_eq!(relay.stats.peer_failures.load(Ordering::Relaxed), 0);

    // Newest wins: the next round carries what the Envoy holds now, even nothing at all; B's
    // counts did not change, so neither A nor the peer gets them again.
    a.set_counts(b"");
    relay.load_round().await;
    settle(&relay).await;
    assert_eq!(b.from("gw-1/0"), vec![b"counts of A".to_vec(), Vec::new()]);
    assert_eq!(a.got().len(), 1);
    assert_eq!(peer.from("gw-1/1").len(), 1);
    assert_eq!(peer.from("gw-1/0").len(), 2);
    assert_eq!(relay.stats.unchanged.load(Ordering::Relaxed), 2);
}

#[tokio::test]
async fn one_envoy_is_named_by_the_source_alone() {
    let (a, peer) = (Fake::serving(b"x"), Fake::default());
    let (ua, up) = (serve(a.clone()).await, serve(peer.clone()).await);
    let mut cfg = config(&[&ua], &[&up]);
    cfg.source = Some("gateway pod ä".into());
    let relay = relay(&cfg);
    relay.load_round().await;
    settle(&relay).await;
    assert_eq!(peer.from("gateway_pod__"), vec![b"x".to_vec()]);
}

#[tokio::test]
async fn nothing_is_read_when_there_is_no_one_to_send_to() {
    let a = Fake::serving(b"x");
    let ua = serve(a.clone()).await;
    // One Envoy and no peer: no relay at all.
    assert!(Relay::load_from_config(&config(&[&ua], &[]), crate::push::client()).is_none());
    // One Envoy and peers by DNS that found none (or only this pod): it runs, but reads nothing.
    let mut cfg = config(&[&ua], &[]);
    cfg.prefix.peers_dns = Some(DnsConfig {
        name: "gateway-headless".into(),
        port: 9100,
        refresh_ms: 20,
    });
    let relay = relay(&cfg);
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.clone().run(stop.clone()));
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.cancel();
    task.await.unwrap();
    assert_eq!(a.reads.load(Ordering::SeqCst), 0);
    assert_eq!(relay.stats.records_out.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_failing_envoy_or_peer_is_counted_and_the_relay_keeps_going() {
    let (a, b, peer, off) = (
        Fake::serving(b"A"),
        Fake::serving(b"B"),
        Fake::default(),
        Fake::default(),
    );
    let (ua, ub, up, uoff) = (
        serve(a.clone()).await,
        serve(b.clone()).await,
        serve(peer.clone()).await,
        serve(off.clone()).await,
    );
    let dead = closed_port();
    // `off` is an Envoy with the exchange off (404) that refuses posts too.
    *off.refuse.lock().unwrap() = Some(StatusCode::BAD_REQUEST);
    let mut cfg = config(&[&ua, &dead, &uoff, &ub], &[&dead, &up]);
    cfg.prefix.load_interval_ms = 5;
    let relay = relay(&cfg);
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.clone().run(stop.clone()));
    let going = within(Duration::from_secs(5), || {
        b.from("gw-1/0").len() >= 5 && peer.from("gw-1/3").len() >= 5 && a.from("gw-1/3").len() >= 5
    })
    .await;
    stop.cancel();
    task.await.unwrap();
    assert!(going.is_some(), "{} {}", b.got().len(), peer.got().len());
    let st = &relay.stats;
    // Reads of the dead Envoy and of `off`, posts to them.
    assert!(st.envoy_failures.load(Ordering::Relaxed) >= 4, "{st:?}");
    assert!(st.peer_failures.load(Ordering::Relaxed) >= 2, "{st:?}");
    assert!(
        !off.from("gw-1/0").is_empty(),
        "a refusing Envoy is still posted to"
    );
    assert!(peer.from("gw-1/1").is_empty() && peer.from("gw-1/2").is_empty());
}

#[tokio::test]
async fn a_blackholed_peer_is_skipped_while_busy_and_holds_up_nothing_else() {
    let (a, b) = (Fake::serving(b"A"), Fake::default());
    let (ua, ub) = (serve(a.clone()).await, serve(b.clone()).await);
    let hole = blackhole().await;
    let mut cfg = config(&[&ua, &ub], &[&hole]);
    // A 50 ms interval: posts time out after 500 ms, so the hole stays busy for all five rounds.
    // The rounds are 40 ms apart, past the 20 ms keepalive: each one posts A's unchanged body.
    cfg.prefix.load_interval_ms = 50;
    cfg.prefix.load_idle_interval_ms = 50;
    let relay = relay(&cfg);
    let t0 = Instant::now();
    for _ in 0..5 {
        relay.load_round().await;
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert!(
        t0.elapsed() < Duration::from_millis(450),
        "{:?}",
        t0.elapsed()
    );
    settle(&relay).await;
    assert_eq!(b.from("gw-1/0").len(), 5, "every body reached B meanwhile");
    // B has the exchange off (404), so only A's counts go out: they reach the hole once, and it
    // is busy for the rest.
    assert_eq!(relay.stats.busy_skips.load(Ordering::Relaxed), 4);
    assert_eq!(relay.stats.peer_failures.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn with_a_5_ms_interval_the_counts_reach_a_peer_within_100_ms_again_and_again() {
    let (a, peer) = (Fake::serving(b"first"), Fake::default());
    let (ua, up) = (serve(a.clone()).await, serve(peer.clone()).await);
    let mut cfg = config(&[&ua], &[&up]);
    cfg.prefix.load_interval_ms = 5;
    let relay = relay(&cfg);
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.clone().run(stop.clone()));

    let first = within(Duration::from_secs(5), || !peer.got().is_empty()).await;
    assert!(
        first.is_some_and(|t| t < Duration::from_millis(100)),
        "{first:?}"
    );
    // A change on the Envoy reaches the peer within 100 ms (5 ms plus a loopback round trip,
    // on an idle machine; the margin is for a loaded CI machine).
    a.set_counts(b"second");
    let changed = within(Duration::from_secs(5), || {
        peer.got().last().is_some_and(|p| p.2 == b"second")
    })
    .await;
    assert!(
        changed.is_some_and(|t| t < Duration::from_millis(100)),
        "{changed:?}"
    );
    // A body that changes every millisecond keeps coming: one post per interval, not one per
    // change. (Before unchanged bodies were left out, an unchanging one did this too.)
    let before = peer.got().len();
    let changing = {
        let a = a.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            for n in 0u32.. {
                if t0.elapsed() >= Duration::from_millis(200) {
                    break;
                }
                a.set_counts(format!("change {n}").as_bytes());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    changing.await.unwrap();
    let sent = peer.got().len() - before;
    assert!(sent >= 8, "only {sent} posts in 200 ms");
    assert!(
        sent <= 45,
        "{sent} posts in 200 ms: ticks were caught up in bursts"
    );
    // A body that stands still goes once per keepalive (20 ms: ~10 in 200 ms), not every 5 ms.
    tokio::time::sleep(Duration::from_millis(30)).await;
    let before = peer.got().len();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let kept = peer.got().len() - before;
    stop.cancel();
    task.await.unwrap();
    assert!((3..=15).contains(&kept), "{kept} keepalive posts in 200 ms");
    for (auth, replica, _) in peer.got() {
        assert_eq!(
            (auth.as_str(), replica.as_str()),
            ("Bearer secret-token", "gw-1")
        );
    }
}

/// Waits up to 2 s for `done`.
async fn eventually(done: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(2), "not within 2 s");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_peers_counts_are_taken_once_one_envoy_took_them_whatever_a_hung_one_does() {
    let b = Fake::default();
    let ub = serve(b.clone()).await;
    // Envoy 0 accepts connections and never answers.
    let hole = blackhole().await;
    // Posts time out after ten intervals: 1 s here.
    let mut cfg = config(&[&hole, &ub], &["http://127.0.0.1:1"]);
    cfg.prefix.load_interval_ms = 100;
    let relay = relay(&cfg);
    let t0 = Instant::now();
    assert!(relay.deliver_load(busy_counts(1).into(), "gw-2").await);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_millis(500),
        "answered after {took:?}, not at the hung Envoy's timeout"
    );
    assert_eq!(b.got().len(), 1);
    // None takes them: told once every post failed.
    let relay = self::relay(&config(&[&hole], &["http://127.0.0.1:1"]));
    assert!(!relay.deliver_load(busy_counts(2).into(), "gw-2").await);
}

#[tokio::test]
async fn a_peers_counts_reach_every_envoy_and_those_that_come_meanwhile_go_in_one_post() {
    let (a, b) = (Fake::default(), Fake::default());
    let (ua, ub) = (serve(a.clone()).await, serve(b.clone()).await);
    let relay = relay(&config(&[&ua, &ub], &[]));
    let [c, d, e, f] = [1, 2, 3, 4].map(busy_counts);
    assert!(relay.deliver_load(c.clone().into(), "gw-2").await);
    // Answered once one Envoy took them; the other's post goes on.
    eventually(|| a.got().len() == 1 && b.got().len() == 1).await;
    for envoy in [&a, &b] {
        assert_eq!(
            envoy.got(),
            vec![("Bearer secret-token".into(), "gw-2".into(), c.clone())]
        );
    }
    // Three at once: the post that takes them carries gw-3's and gw-2's newest, together.
    let (x, y, z) = tokio::join!(
        relay.deliver_load(d.into(), "gw-2"),
        relay.deliver_load(e.clone().into(), "gw-3"),
        relay.deliver_load(f.clone().into(), "gw-2"),
    );
    assert_eq!((x, y, z), (true, true, true));
    eventually(|| a.posts.lock().unwrap().len() == 2 && b.posts.lock().unwrap().len() == 2).await;
    for envoy in [&a, &b] {
        assert_eq!(envoy.posts.lock().unwrap().len(), 2);
        assert_eq!(envoy.from("gw-2"), vec![c.clone(), f.clone()]);
        assert_eq!(envoy.from("gw-3"), vec![e.clone()]);
        assert!(envoy
            .got()
            .iter()
            .all(|(auth, _, _)| auth == "Bearer secret-token"));
    }
    assert_eq!(relay.stats.bundled.load(Ordering::Relaxed), 4);
    assert_eq!(relay.stats.records_in.load(Ordering::Relaxed), 4);
    *a.refuse.lock().unwrap() = Some(StatusCode::BAD_REQUEST);
    assert!(relay.deliver_load(busy_counts(5).into(), "gw-2").await);
    *b.refuse.lock().unwrap() = Some(StatusCode::SERVICE_UNAVAILABLE);
    assert!(!relay.deliver_load(busy_counts(6).into(), "gw-2").await);
    assert_eq!(relay.stats.envoy_failures.load(Ordering::Relaxed), 3);
}

#[tokio::test]
async fn an_envoy_takes_at_most_six_posts_an_interval_and_the_rest_waits_for_the_window() {
    let a = Fake::default();
    let ua = serve(a.clone()).await;
    let mut cfg = config(&[&ua], &["http://127.0.0.1:1"]);
    cfg.prefix.load_interval_ms = 500;
    let relay = relay(&cfg);
    // Six replicas' counts one after the other: each goes at once.
    let t0 = Instant::now();
    for r in 1..=POSTS_PER_INTERVAL {
        let before = Instant::now();
        assert!(
            relay
                .deliver_load(busy_counts(1).into(), &format!("gw-{r}"))
                .await
        );
        let took = before.elapsed();
        assert!(took < Duration::from_millis(150), "post {r}: {took:?}");
    }
    // Two more within the same interval wait until the first post is an interval old, and then
    // go together.
    let (x, y) = tokio::join!(
        relay.deliver_load(busy_counts(2).into(), "gw-7"),
        relay.deliver_load(busy_counts(2).into(), "gw-8"),
    );
    assert_eq!((x, y), (true, true));
    let posts = a.posts.lock().unwrap().clone();
    assert_eq!(posts.len(), POSTS_PER_INTERVAL + 1);
    let waited = posts[POSTS_PER_INTERVAL].duration_since(posts[0]);
    assert!(waited >= Duration::from_millis(480), "{waited:?}");
    assert!(t0.elapsed() >= Duration::from_millis(490));
    assert_eq!(relay.stats.bundled.load(Ordering::Relaxed), 2);
    assert_eq!(a.from("gw-7").len() + a.from("gw-8").len(), 2);
    // After an interval without posts: at once again.
    tokio::time::sleep(Duration::from_millis(520)).await;
    let t1 = Instant::now();
    assert!(relay.deliver_load(busy_counts(3).into(), "gw-1").await);
    let again = t1.elapsed();
    assert!(again < Duration::from_millis(150), "{again:?}");
}

#[tokio::test]
async fn an_envoys_waiting_counts_are_bounded_to_max_replicas() {
    let a = Fake::default();
    let ua = serve(a.clone()).await;
    let relay = relay(&config(&[&ua], &["http://127.0.0.1:1"]));
    let body = Bytes::from(busy_counts(1));
    // MAX_REPLICAS + 1 replicas' counts come before the post that takes them starts (no await
    // between them): the outbox keeps MAX_REPLICAS, the last is turned away.
    let waits: Vec<_> = (0..=MAX_REPLICAS)
        .map(|i| relay.enqueue(0, &format!("gw-{i}"), body.clone()))
        .collect();
    assert!(waits[..MAX_REPLICAS].iter().all(Option::is_some));
    assert!(waits[MAX_REPLICAS].is_none());
    assert_eq!(relay.stats.busy_skips.load(Ordering::Relaxed), 1);
    for mut w in waits.into_iter().flatten() {
        assert_eq!(*w.wait_for(Option::is_some).await.unwrap(), Some(true));
    }
    assert_eq!(a.posts.lock().unwrap().len(), 1);
    assert_eq!(a.got().len(), MAX_REPLICAS);
    // Through deliver_load, one at a time: each is taken.
    assert!(relay.deliver_load(body.clone(), "gw-x").await);
}

#[test]
fn the_load_relay_follows_its_own_switch_and_the_prefix_relays_peers() {
    let client = crate::push::client();
    let mut cfg = config(&["http://127.0.0.1:1"], &["http://10.0.0.2:9100"]);
    cfg.prefix.load_path = "/lp".into();
    let (prefix, load) = Relay::pair_from_config(&cfg, crate::tls::fixed(client.clone()));
    let load = load.unwrap();
    assert_eq!(load.envoys, vec!["http://127.0.0.1:1/lp".to_string()]);
    assert_eq!(load.peers, vec!["http://10.0.0.2:9100/v1/load".to_string()]);
    assert_eq!(load.interval, Duration::from_millis(5));
    assert_eq!(load.timeout, Duration::from_millis(50));
    assert_eq!(load.load.keepalive, Duration::from_millis(20));
    assert_eq!(load.load.idle_interval, Duration::from_millis(20));
    assert_eq!(load.load.sent.len(), 1);
    // An idle interval below the interval (a configuration that was not validated) is the
    // interval.
    let mut slow = cfg.clone();
    slow.prefix.load_interval_ms = 30;
    let load = Relay::load_from_config(&slow, client.clone()).unwrap();
    assert_eq!(load.load.idle_interval, Duration::from_millis(30));
    assert_eq!(load.replicas, vec![load.instance.clone()]);
    assert!(load.instance.starts_with("gw-1@"), "{}", load.instance);
    let prefix = prefix.unwrap();
    assert_eq!(prefix.kind, Kind::Prefix);
    // The two relays of one sidecar say the same name to the peers.
    let (p2, l2) = Relay::pair_from_config(&cfg, crate::tls::fixed(client.clone()));
    assert_eq!(p2.unwrap().instance, l2.unwrap().instance);
    // Its own switch: the prefix relay's does not turn it off, 0 does.
    cfg.prefix.enabled = false;
    let (prefix, load) = Relay::pair_from_config(&cfg, crate::tls::fixed(client.clone()));
    assert!(prefix.is_none() && load.is_some());
    cfg.prefix.load_interval_ms = 0;
    assert!(Relay::load_from_config(&cfg, client).is_none());
}

#[test]
fn the_timeout_is_ten_intervals_and_at_least_50_ms() {
    assert_eq!(timeout(Duration::from_millis(1)), Duration::from_millis(50));
    assert_eq!(timeout(Duration::from_millis(5)), Duration::from_millis(50));
    assert_eq!(
        timeout(Duration::from_millis(20)),
        Duration::from_millis(200)
    );
}

#[test]
fn each_sidecar_draws_a_name_of_its_own() {
    let (a, b) = (instance_name("gw a\u{e4}"), instance_name("gw a\u{e4}"));
    assert_ne!(a, b, "two draws, two names");
    for name in [&a, &b] {
        let (source, drawn) = name.split_once('@').unwrap();
        assert_eq!(source, "gw_a_");
        assert_eq!(drawn.len(), 8);
        assert!(drawn.bytes().all(|c| c.is_ascii_hexdigit()), "{name}");
        assert!(valid_replica(name));
    }
    assert!(instance_name("").starts_with("sidecar-metrics@"));
    // A long source leaves room for the random part and an Envoy's index.
    let long = instance_name(&"x".repeat(300));
    let named = replica_name(&long, 11, 12);
    assert!(named.len() <= MAX_REPLICA_LEN, "{named}");
    assert!(named.ends_with("/11") && named.contains('@'), "{named}");
    assert!(valid_replica(&named));
}

#[test]
fn replica_names_are_visible_ascii_without_spaces_and_at_most_128() {
    assert_eq!(replica_name("gw-7f9c", 0, 1), "gw-7f9c");
    assert_eq!(replica_name("gw-7f9c", 2, 3), "gw-7f9c/2");
    assert_eq!(replica_name("a b\tcé", 0, 1), "a_b_c_");
    assert_eq!(replica_name("", 1, 2), "sidecar-metrics/1");
    let long = "x".repeat(300);
    assert_eq!(replica_name(&long, 0, 1).len(), MAX_REPLICA_LEN);
    let named = replica_name(&long, 11, 12);
    assert_eq!(named.len(), MAX_REPLICA_LEN);
    assert!(named.ends_with("x/11"));
    for name in [replica_name("a b", 0, 1), named] {
        assert!(valid_replica(&name), "{name}");
    }
    assert!(!valid_replica(""));
    assert!(!valid_replica("a b"));
    assert!(!valid_replica("é"));
    assert!(!valid_replica(&"x".repeat(129)));
}

#[tokio::test]
async fn the_peers_found_by_dns_serve_both_relays() {
    struct OneAddr;
    impl crate::discovery::dns::Resolver for OneAddr {
        fn resolve(
            &self,
            _name: &str,
            port: u16,
        ) -> futures::future::BoxFuture<'static, std::io::Result<Vec<std::net::SocketAddr>>>
        {
            let a = std::net::SocketAddr::new([10, 0, 0, 5].into(), port);
            Box::pin(async move { Ok(vec![a]) })
        }
    }
    let mut cfg = config(&["http://127.0.0.1:1"], &[]);
    cfg.prefix.peers_dns = Some(DnsConfig {
        name: "gateway-headless".into(),
        port: 9100,
        refresh_ms: 10,
    });
    let (prefix, load) = Relay::pair_from_config(&cfg, crate::tls::fixed(crate::push::client()));
    let (prefix, load) = (prefix.unwrap(), load.unwrap());
    let stop = CancellationToken::new();
    let task = tokio::spawn(prefix.clone().find_peers(Arc::new(OneAddr), stop.clone()));
    let found = within(Duration::from_secs(5), || !load.all_peers().is_empty()).await;
    stop.cancel();
    task.await.unwrap();
    assert!(found.is_some());
    assert_eq!(
        load.all_peers(),
        vec!["http://10.0.0.5:9100/v1/load".to_string()]
    );
    assert_eq!(
        prefix.all_peers(),
        vec!["http://10.0.0.5:9100/v1/prefix".to_string()]
    );
}

/// Counts with one pod in prefill, as the filter writes them.
fn busy_counts(requests: u32) -> Vec<u8> {
    use gpuroute_core::replica_load::PodPrefill;
    ReplicaLoad {
        pools: vec![(
            "llama".into(),
            vec![PodPrefill {
                key: 7,
                requests,
                tokens: 100 * requests,
            }],
        )],
    }
    .encode()
}

/// Runs one round and waits for its posts to be answered.
async fn round(relay: &Arc<Relay>) {
    relay.load_round().await;
    settle(relay).await;
}

#[test]
fn nothing_in_prefill_is_the_filters_empty_counts_or_counts_without_a_pod() {
    assert!(no_prefill(b"GPL1\0\0\0\0"));
    assert!(no_prefill(&ReplicaLoad::default().encode()));
    let no_pods = ReplicaLoad {
        pools: vec![("llama".into(), Vec::new())],
    };
    assert!(no_prefill(&no_pods.encode()));
    assert!(!no_prefill(&busy_counts(1)));
    // Not counts at all: passed on as they came, for the filter to refuse.
    for other in [
        &b""[..],
        b"GPL1",
        b"GPL1\0\0\0\0\0",
        b"GPL2\0\0\0\0",
        b"counts",
    ] {
        assert!(!no_prefill(other), "{other:?}");
    }
}

#[tokio::test]
async fn an_unchanged_body_is_posted_again_only_once_the_keepalive_has_passed() {
    let (_, b, peer, mut cfg) =
        two_envoys_and_a_peer(Fake::serving(&busy_counts(2)), Fake::default()).await;
    // Long enough that the rounds below fit well inside it on a loaded machine.
    cfg.prefix.load_keepalive_ms = 300;
    let relay = relay(&cfg);
    round(&relay).await;
    let t0 = Instant::now();
    assert_eq!(b.from("gw-1/0").len(), 1);
    assert_eq!(peer.from("gw-1/0").len(), 1);
    for _ in 0..3 {
        round(&relay).await;
    }
    assert!(
        t0.elapsed() < Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(b.from("gw-1/0").len(), 1, "not again before the keepalive");
    assert_eq!(peer.from("gw-1/0").len(), 1);
    // B has the exchange off (404): only A's body goes out, to two targets, skipped 3 times.
    assert_eq!(relay.stats.unchanged.load(Ordering::Relaxed), 6);
    assert_eq!(relay.stats.records_out.load(Ordering::Relaxed), 4);

    tokio::time::sleep(Duration::from_millis(320).saturating_sub(t0.elapsed())).await;
    round(&relay).await;
    assert_eq!(b.from("gw-1/0"), vec![busy_counts(2); 2], "again after it");
    assert_eq!(peer.from("gw-1/0"), vec![busy_counts(2); 2]);
    // And the keepalive counts from that post.
    round(&relay).await;
    assert_eq!(b.from("gw-1/0").len(), 2);
    assert_eq!(relay.stats.unchanged.load(Ordering::Relaxed), 8);
}

#[tokio::test]
async fn a_changed_body_is_posted_at_the_next_round() {
    let (a, b, peer, mut cfg) =
        two_envoys_and_a_peer(Fake::serving(&busy_counts(1)), Fake::default()).await;
    cfg.prefix.load_keepalive_ms = 10_000;
    let relay = relay(&cfg);
    round(&relay).await;
    round(&relay).await;
    a.set_counts(&busy_counts(3));
    round(&relay).await;
    round(&relay).await;
    a.set_counts(&busy_counts(1));
    round(&relay).await;
    let want = vec![busy_counts(1), busy_counts(3), busy_counts(1)];
    assert_eq!(b.from("gw-1/0"), want);
    assert_eq!(peer.from("gw-1/0"), want);
    assert_eq!(relay.stats.unchanged.load(Ordering::Relaxed), 4);
}

#[tokio::test]
async fn the_empty_body_is_posted_once_until_a_non_empty_one_went_in_between() {
    let (a, b, peer, mut cfg) =
        two_envoys_and_a_peer(Fake::serving(NO_PREFILL), Fake::default()).await;
    // A keepalive that is always due: only the empty body is held back.
    cfg.prefix.load_keepalive_ms = 1;
    let relay = relay(&cfg);
    let empty = NO_PREFILL.to_vec();
    for _ in 0..3 {
        round(&relay).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(b.from("gw-1/0"), vec![empty.clone()]);
    assert_eq!(peer.from("gw-1/0"), vec![empty.clone()]);
    // Counts without a pod say the same: held back too.
    let no_pods = ReplicaLoad {
        pools: vec![("llama".into(), Vec::new())],
    };
    a.set_counts(&no_pods.encode());
    round(&relay).await;
    assert_eq!(b.from("gw-1/0").len(), 1);

    // Something in prefill (kept alive), then nothing again: posted once more.
    a.set_counts(&busy_counts(1));
    for _ in 0..2 {
        round(&relay).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    a.set_counts(NO_PREFILL);
    for _ in 0..3 {
        round(&relay).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let want = vec![empty.clone(), busy_counts(1), busy_counts(1), empty.clone()];
    assert_eq!(b.from("gw-1/0"), want);
    assert_eq!(peer.from("gw-1/0"), want);

    // A non-empty body the target refused does not count as in between: it still has nothing.
    *b.refuse.lock().unwrap() = Some(StatusCode::SERVICE_UNAVAILABLE);
    a.set_counts(&busy_counts(2));
    round(&relay).await;
    *b.refuse.lock().unwrap() = None;
    a.set_counts(NO_PREFILL);
    round(&relay).await;
    let mut want_b = want.clone();
    want_b.push(busy_counts(2));
    assert_eq!(
        b.from("gw-1/0"),
        want_b,
        "refused, and no empty body after it"
    );
    let mut want_peer = want;
    want_peer.extend([busy_counts(2), empty]);
    assert_eq!(peer.from("gw-1/0"), want_peer);
}

#[tokio::test]
async fn a_failed_post_is_posted_again_at_the_next_round() {
    let (a, b, peer, mut cfg) =
        two_envoys_and_a_peer(Fake::serving(&busy_counts(4)), Fake::default()).await;
    cfg.prefix.load_keepalive_ms = 10_000;
    let relay = relay(&cfg);
    *b.refuse.lock().unwrap() = Some(StatusCode::BAD_REQUEST);
    *peer.refuse.lock().unwrap() = Some(StatusCode::BAD_GATEWAY);
    round(&relay).await;
    round(&relay).await;
    assert_eq!(b.from("gw-1/0").len(), 2, "refused, so posted again");
    assert_eq!(peer.from("gw-1/0").len(), 2);
    // The two refused posts, and B's two reads (the exchange off there: 404).
    assert_eq!(relay.stats.envoy_failures.load(Ordering::Relaxed), 4);
    assert_eq!(relay.stats.peer_failures.load(Ordering::Relaxed), 2);
    *b.refuse.lock().unwrap() = None;
    round(&relay).await;
    round(&relay).await;
    assert_eq!(b.from("gw-1/0").len(), 3, "taken once, then held back");
    assert_eq!(peer.from("gw-1/0").len(), 4, "the peer still refuses");
    // A target that cannot be reached at all is tried every round too.
    let ua = serve(a.clone()).await;
    let mut cfg = config(&[&ua], &[&closed_port()]);
    cfg.prefix.load_keepalive_ms = 10_000;
    let relay = self::relay(&cfg);
    for _ in 0..3 {
        round(&relay).await;
    }
    assert_eq!(relay.stats.peer_failures.load(Ordering::Relaxed), 3);
    assert_eq!(relay.stats.unchanged.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn a_peers_bodies_are_passed_on_as_they_come_even_when_unchanged() {
    let a = Fake::default();
    let ua = serve(a.clone()).await;
    let relay = relay(&config(&[&ua], &["http://127.0.0.1:1"]));
    for _ in 0..3 {
        assert!(
            relay
                .deliver_load(Bytes::from_static(NO_PREFILL), "gw-2")
                .await
        );
    }
    assert_eq!(a.from("gw-2").len(), 3);
    assert_eq!(relay.stats.unchanged.load(Ordering::Relaxed), 0);
}

#[tokio::test]
async fn an_idle_envoy_is_read_at_the_idle_interval_and_a_busy_one_at_the_interval() {
    let (a, peer) = (Fake::serving(NO_PREFILL), Fake::default());
    let (ua, up) = (serve(a.clone()).await, serve(peer.clone()).await);
    let mut cfg = config(&[&ua], &[&up]);
    cfg.prefix.load_interval_ms = 5;
    cfg.prefix.load_idle_interval_ms = 50;
    let relay = relay(&cfg);
    let stop = CancellationToken::new();
    let task = tokio::spawn(relay.clone().run(stop.clone()));
    let reads = || a.reads.load(Ordering::SeqCst);
    // Reads in a 500 ms window: ~10 at 50 ms, ~100 at 5 ms (fewer on a loaded machine, never
    // more: missed reads are skipped).
    let window = || async {
        let before = reads();
        tokio::time::sleep(Duration::from_millis(500)).await;
        reads() - before
    };

    assert!(within(Duration::from_secs(5), || reads() >= 1)
        .await
        .is_some());
    let idle = window().await;
    assert!(
        (3..=13).contains(&idle),
        "{idle} reads of an idle Envoy in 500 ms"
    );

    // Something in prefill: seen at the next idle read at the latest, then read every 5 ms.
    a.set_counts(&busy_counts(1));
    let seen = within(Duration::from_secs(5), || {
        peer.from("gw-1").last() == Some(&busy_counts(1))
    })
    .await;
    assert!(
        seen.is_some_and(|t| t < Duration::from_millis(200)),
        "{seen:?}"
    );
    let busy = window().await;
    assert!(busy >= 30, "only {busy} reads of a busy Envoy in 500 ms");
    assert!(
        busy <= 110,
        "{busy} reads in 500 ms: reads were caught up in bursts"
    );

    // Nothing in prefill again: posted once, and back to the idle interval.
    a.set_counts(NO_PREFILL);
    let emptied = within(Duration::from_secs(5), || {
        peer.from("gw-1").last().map(Vec::as_slice) == Some(NO_PREFILL)
    })
    .await;
    assert!(emptied.is_some());
    let idle = window().await;
    stop.cancel();
    task.await.unwrap();
    assert!(
        (3..=13).contains(&idle),
        "{idle} reads of an idle Envoy in 500 ms"
    );
    let empties = peer
        .from("gw-1")
        .iter()
        .filter(|b| b.as_slice() == NO_PREFILL)
        .count();
    assert_eq!(
        empties, 2,
        "the empty body, once before and once after the busy spell"
    );
}

#[test]
fn a_read_missed_while_the_one_before_ran_is_skipped() {
    let t = Instant::now();
    let ms = Duration::from_millis;
    // On time: one step after the read before.
    assert_eq!(next_read(t, ms(5), t + ms(2)), t + ms(5));
    // Late by 12 ms on a 5 ms beat: the reads due at 5 and 10 are skipped, the next is at 15.
    assert_eq!(next_read(t, ms(5), t + ms(12)), t + ms(15));
    // Exactly on a beat: the one after it.
    assert_eq!(next_read(t, ms(5), t + ms(10)), t + ms(15));
    assert_eq!(next_read(t, ms(20), t + ms(20)), t + ms(40));
}
