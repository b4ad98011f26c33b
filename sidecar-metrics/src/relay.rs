//! The relays between gateway replicas: prefix records, and in-flight (prefill) counts.
//!
//! Each gateway replica's filter knows where its own workers sent which prompt prefixes; the
//! filter's side of the exchange is `gpuroute_core::exchange`. Every `prefix.interval_ms` this
//! task asks each Envoy it pushes snapshots to, each on its own clock (one slow to answer delays
//! only its own records), for its decisions since the last ask (`GET {prefix path}` with the
//! cursor it was given last), and hands what it got to:
//! - the other Envoys it pushes to (`POST {prefix path}`), and
//! - every peer, another replica's sidecar-metrics (`POST {peer}/v1/prefix`), which hands them
//!   to its own Envoys ([`Relay::deliver_local`], behind the HTTP surface).
//!
//! The records are hints, so nothing is retried or queued: a batch an Envoy or a peer does not
//! take is counted and dropped, and the next interval carries only newer records. Deliveries
//! run on their own, so a slow target holds up neither the asks nor the other targets; one
//! still busy with the batch before is skipped. An Envoy that
//! restarted answers with a cursor of its new workers, so asking resumes by itself. The bearer
//! token is the push token, on both hops.
//!
//! The in-flight count relay ([`Kind::Load`], in `relay/load.rs`) is a second [`Relay`] over the
//! same peers, listener, token and client, with the same failure counting and skip-if-busy:
//! every `prefix.load_interval_ms` (a few ms; `prefix.load_idle_interval_ms` while an Envoy has
//! nothing in prefill) it reads each Envoy's requests still in prefill and hands them on the same
//! way, named by the replica they come from, to each target only when they changed or the
//! target's copy needs keeping alive. What peers send goes to this replica's Envoys one post at
//! a time per Envoy, at most six an interval, what came meanwhile bundled into the next.

mod load;

pub use load::{
    instance_name, replica_name, valid_replica, LOAD_PEER_PATH, MAX_REPLICA_LEN, REPLICA_HEADER,
};

use crate::client::{self, HttpClient};
use crate::config::{Config, DnsConfig};
use crate::discovery::dns::Resolver;
use crate::tls;
use crate::util::LogGate;
use bytes::Bytes;
use gpuroute_core::exchange::{CURSOR_HEADER, MAX_IMPORT_RECORDS};
use gpuroute_core::prefix::decode_records;
use http::{HeaderValue, Method};
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// The content type of what the relays post (the filter's binary record and count formats).
static OCTETS: HeaderValue = HeaderValue::from_static("application/octet-stream");

/// The path of the sidecar's own surface that takes peers' records.
pub const PEER_PATH: &str = "/v1/prefix";

/// The header naming the sidecar (its [`Relay::instance`]) a post to a peer comes from, so that
/// the receiver can tell two senders apart even when one reaches it at two addresses.
pub const SIDECAR_HEADER: &str = "x-gpuroute-sidecar";

/// How long a peer found to be this sidecar itself (it answered with this sidecar's
/// [`SIDECAR_HEADER`]) is left out before it is tried again: a name (a static peer's) may come
/// to mean another replica.
const SELF_RECHECK: Duration = Duration::from_secs(60);

/// This pod's addresses, as the downward API gives them: `POD_IPS` (`status.podIPs`, both
/// families on a dual-stack cluster, comma-separated) and `POD_IP` (`status.podIP`, one).
pub fn own_addresses(pod_ip: Option<&str>, pod_ips: Option<&str>) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = pod_ips
        .unwrap_or_default()
        .split(|c: char| c == ',' || c.is_whitespace())
        .chain(pod_ip)
        .filter_map(|v| v.trim().parse::<IpAddr>().ok())
        .map(|ip| ip.to_canonical())
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// The peers found by DNS, in one address family: on a dual-stack cluster a headless Service
/// answers every gateway pod under an A and an AAAA record, and posting to both would send each
/// peer everything twice. The family kept is that of this pod's primary address (`POD_IP`,
/// `status.podIP`: the family Kubernetes lists first); without one, both are kept.
fn one_family(addrs: Vec<SocketAddr>, primary: Option<IpAddr>) -> Vec<SocketAddr> {
    let Some(primary) = primary else {
        return addrs;
    };
    let both = addrs.iter().any(|a| a.is_ipv4()) && addrs.iter().any(|a| a.is_ipv6());
    if !both {
        return addrs;
    }
    addrs
        .into_iter()
        .filter(|a| a.ip().to_canonical().is_ipv4() == primary.is_ipv4())
        .collect()
}

/// How long a replica name is remembered with the sender that last posted under it: another
/// sender posting under it within this is a name clash.
const CLASH_WINDOW: Duration = Duration::from_secs(10);

/// The most replica names remembered with their sender (the filter keeps at most 256 replicas).
const MAX_SENDERS: usize = 1_024;

/// The largest body a peer may send, prefix records or in-flight counts (the filter's default
/// `ingest.max_snapshot_bytes`).
pub const MAX_PEER_BODY: usize = 8 * 1024 * 1024;

/// Which exchange a relay carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Prefix records (routing decisions), asked for after a cursor, every `prefix.interval_ms`.
    Prefix,
    /// In-flight (prefill) counts, each answer replacing the one before from the same replica,
    /// every `prefix.load_interval_ms`.
    Load,
}

impl Kind {
    /// The name used in log messages.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Prefix => "prefix",
            Kind::Load => "load",
        }
    }

    /// The path of the peers' surface for this exchange.
    pub fn peer_path(self) -> &'static str {
        match self {
            Kind::Prefix => PEER_PATH,
            Kind::Load => LOAD_PEER_PATH,
        }
    }
}

/// Counters, for `/metrics`.
#[derive(Debug, Default)]
pub struct RelayStats {
    /// Records (the load relay: bodies of counts) received from this replica's Envoys.
    pub records_out: AtomicU64,
    /// Records (the load relay: bodies of counts) received from peers.
    pub records_in: AtomicU64,
    /// Asks and deliveries that failed, to an Envoy and to a peer.
    pub envoy_failures: AtomicU64,
    pub peer_failures: AtomicU64,
    /// Batches not sent to a target still busy with the one before.
    pub busy_skips: AtomicU64,
    /// The load relay: bodies not posted to a target because it already has them (unchanged
    /// since the last post and the keepalive not due, or empty and already sent).
    pub unchanged: AtomicU64,
    /// The load relay: peers' bodies posted to an Envoy together with other replicas' (in a
    /// bundle), because they came while a post to it was under way or its budget was spent.
    pub bundled: AtomicU64,
    /// The load relay: peers' bodies under a replica name another sender (another address, or
    /// another sidecar's name) posted under within the last [`CLASH_WINDOW`].
    pub name_clashes: AtomicU64,
    /// Posts from this sidecar itself, dropped (its own address among its peers).
    pub own_dropped: AtomicU64,
}

/// The relay's targets and state.
#[derive(Debug)]
pub struct Relay {
    /// What this relay carries.
    pub kind: Kind,
    /// The prefix URL (the load relay: the load URL) of each Envoy pushed to.
    pub envoys: Vec<String>,
    /// Each configured peer's `PEER_PATH` (the load relay: `LOAD_PEER_PATH`) URL.
    pub peers: Vec<String>,
    /// Peers found by DNS (`prefix.peers_dns`), as last resolved: `http://ip:port` (`https://`
    /// with `prefix.tls`), shared by the
    /// two relays so that one task resolves for both.
    found: Arc<Mutex<Vec<String>>>,
    dns: Option<DnsConfig>,
    /// This pod's addresses (`POD_IPS`, `POD_IP`), left out of the peers found.
    own_ips: Vec<IpAddr>,
    /// This pod's primary address (`POD_IP`): its family is the one peers are posted to when
    /// DNS answers both ([`one_family`]).
    primary_ip: Option<IpAddr>,
    /// Peers (URLs, as in [`Relay::all_peers`]) that turned out to be this sidecar itself, and
    /// when: left out for [`SELF_RECHECK`].
    selves: Mutex<std::collections::HashMap<String, Instant>>,
    pub token: String,
    /// `Authorization: Bearer <token>`, for every request.
    auth: HeaderValue,
    interval: Duration,
    timeout: Duration,
    /// The client (with `prefix.tls`, one speaking TLS to the peers, replaced when its files
    /// change).
    client: watch::Receiver<HttpClient>,
    /// `https` with `prefix.tls`, for the peers found by DNS.
    peer_scheme: &'static str,
    pub stats: RelayStats,
    gate: Mutex<LogGate>,
    /// Targets with a delivery under way (the load relay: target and source replica).
    busy: Mutex<HashSet<String>>,
    /// The `x-gpuroute-replica` name of each Envoy's in-flight counts (used by the load relay).
    replicas: Vec<String>,
    /// The load relay's keepalive, idle interval and what each target was last sent.
    load: load::LoadState,
    /// This sidecar's name among the replicas ([`instance_name`]): what its Envoys' counts are
    /// named after, and what it says it is to the peers ([`SIDECAR_HEADER`]).
    pub instance: String,
    /// The load relay: for each replica name peers posted under, the sender that last did (its
    /// [`SIDECAR_HEADER`], else its address) and when.
    senders: Mutex<std::collections::HashMap<String, (String, Instant)>>,
    /// The log limit of name clashes, apart from the failures'.
    clash_gate: Mutex<LogGate>,
    /// The log limit of posts from this sidecar to itself.
    self_gate: Mutex<LogGate>,
}

/// A delivery under way to one target: the target is busy until this is dropped, whether the
/// delivery finished or was cancelled.
struct Claim {
    relay: Arc<Relay>,
    key: String,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.relay
            .busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

/// `url` with its path replaced by `path` and no query: the prefix URL beside an ingest URL.
pub fn beside(url: &str, path: &str) -> Option<String> {
    let mut u = url::Url::parse(url).ok()?;
    u.set_path(path);
    u.set_query(None);
    Some(u.to_string())
}

impl Relay {
    /// The relay `cfg` asks for; `None` when it is off or has no one to relay to (one Envoy and
    /// no peer).
    pub fn from_config(cfg: &Config, client: HttpClient) -> Option<Arc<Relay>> {
        Relay::alone(cfg, client, Kind::Prefix)
    }

    /// The in-flight count relay `cfg` asks for; `None` when it is off
    /// (`prefix.load_interval_ms: 0`) or has no one to relay to (one Envoy and no peer).
    pub fn load_from_config(cfg: &Config, client: HttpClient) -> Option<Arc<Relay>> {
        Relay::alone(cfg, client, Kind::Load)
    }

    /// One relay of `kind`, with peers of its own and a name drawn for it.
    fn alone(cfg: &Config, client: HttpClient, kind: Kind) -> Option<Arc<Relay>> {
        let instance = instance_name(&cfg.source_name());
        Relay::build(cfg, tls::fixed(client), kind, Arc::default(), instance)
    }

    /// Both relays `cfg` asks for, prefix first, sharing the peers found by DNS: run
    /// [`Relay::find_peers`] on one of them and both see the peers. `client` may change (a
    /// [`tls::watch`]ed one).
    pub fn pair_from_config(
        cfg: &Config,
        client: watch::Receiver<HttpClient>,
    ) -> (Option<Arc<Relay>>, Option<Arc<Relay>>) {
        let found: Arc<Mutex<Vec<String>>> = Arc::default();
        let instance = instance_name(&cfg.source_name());
        (
            Relay::build(
                cfg,
                client.clone(),
                Kind::Prefix,
                found.clone(),
                instance.clone(),
            ),
            Relay::build(cfg, client, Kind::Load, found, instance),
        )
    }

    fn build(
        cfg: &Config,
        client: watch::Receiver<HttpClient>,
        kind: Kind,
        found: Arc<Mutex<Vec<String>>>,
        instance: String,
    ) -> Option<Arc<Relay>> {
        let p = &cfg.prefix;
        let on = match kind {
            Kind::Prefix => p.enabled,
            Kind::Load => p.load_interval_ms > 0,
        };
        if !on || cfg.push.urls.is_empty() {
            return None;
        }
        if cfg.push.urls.len() < 2 && p.peers.is_empty() && p.peers_dns.is_none() {
            return None;
        }
        let (path, interval, timeout) = match kind {
            Kind::Prefix => (
                &p.path,
                Duration::from_millis(p.interval_ms),
                Duration::from_millis(cfg.push.timeout_ms),
            ),
            Kind::Load => {
                let interval = Duration::from_millis(p.load_interval_ms);
                (&p.load_path, interval, load::timeout(interval))
            }
        };
        let envoys: Vec<String> = cfg
            .push
            .urls
            .iter()
            .filter_map(|u| beside(u, path))
            .collect();
        let peers = p
            .peers
            .iter()
            .filter_map(|u| beside(u, kind.peer_path()))
            .collect();
        let n = envoys.len();
        let replicas = (0..n).map(|i| replica_name(&instance, i, n)).collect();
        let load = match kind {
            Kind::Prefix => load::LoadState::default(),
            Kind::Load => load::LoadState::new(
                Duration::from_millis(p.load_keepalive_ms),
                // At least the interval, even in a configuration that was not validated.
                Duration::from_millis(p.load_idle_interval_ms).max(interval),
                n,
            ),
        };
        Some(Arc::new(Relay {
            kind,
            envoys,
            peers,
            found,
            dns: p.peers_dns.clone(),
            own_ips: own_addresses(
                std::env::var("POD_IP").ok().as_deref(),
                std::env::var("POD_IPS").ok().as_deref(),
            ),
            primary_ip: std::env::var("POD_IP")
                .ok()
                .and_then(|v| v.trim().parse::<IpAddr>().ok())
                .map(|ip| ip.to_canonical()),
            selves: Mutex::default(),
            token: cfg.push.token.clone().unwrap_or_default(),
            auth: client::bearer(cfg.push.token.as_deref().unwrap_or_default()),
            interval,
            timeout,
            client,
            peer_scheme: if p.tls_set() { "https" } else { "http" },
            stats: RelayStats::default(),
            gate: Mutex::new(LogGate::new(Duration::from_secs(10))),
            busy: Mutex::new(HashSet::new()),
            replicas,
            load,
            instance,
            senders: Mutex::default(),
            clash_gate: Mutex::new(LogGate::new(Duration::from_secs(10))),
            self_gate: Mutex::new(LogGate::new(Duration::from_secs(10))),
        }))
    }

    fn failed(&self, counter: &AtomicU64, what: &str, url: &str, why: String) {
        counter.fetch_add(1, Ordering::Relaxed);
        let mut gate = self.gate.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = gate.allow(Instant::now()) {
            tracing::warn!(
                %url,
                error = %why,
                suppressed = held,
                "{} relay: {what} failed",
                self.kind.name()
            );
        }
    }

    /// Whether `sidecar` (a [`SIDECAR_HEADER`] value) names this sidecar.
    pub fn is_own(&self, sidecar: Option<&HeaderValue>) -> bool {
        sidecar.is_some_and(|v| v.as_bytes() == self.instance.as_bytes())
    }

    /// Whether `replica` is one of this sidecar's replica names (its Envoys' counts).
    pub fn is_own_replica(&self, replica: &str) -> bool {
        self.replicas.iter().any(|r| r == replica)
    }

    /// Counts a post from this sidecar to itself that its peers' surface dropped, and logs it
    /// at most every 10 s: taken, this replica's own counts would be counted twice by its
    /// Envoys (and its own records handed back to them).
    pub fn dropped_own(&self) {
        self.stats.own_dropped.fetch_add(1, Ordering::Relaxed);
        let mut gate = self.self_gate.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = gate.allow(Instant::now()) {
            tracing::warn!(
                instance = %self.instance,
                suppressed = held,
                "{} relay: dropped a post from this sidecar to itself (one of its peers is its \
                 own address); the sender leaves that peer out for a minute",
                self.kind.name()
            );
        }
    }

    /// Leaves the peer `url` out for [`SELF_RECHECK`]: it answered as this sidecar.
    fn found_self(&self, url: &str) {
        let now = Instant::now();
        let mut selves = self.selves.lock().unwrap_or_else(|e| e.into_inner());
        selves.retain(|_, at| now.saturating_duration_since(*at) < SELF_RECHECK);
        if selves.insert(url.to_string(), now).is_none() {
            tracing::info!(
                %url,
                "{} relay: this peer is this sidecar itself; left out",
                self.kind.name()
            );
        }
    }

    /// Notes that `sender` (a peer's [`SIDECAR_HEADER`], else its address) posted counts under
    /// `replica`: when another sender did within [`CLASH_WINDOW`], two replicas share the name
    /// and the receivers keep only one's counts, so it is counted (`name_clashes`) and logged at
    /// most every 10 s.
    pub fn note_sender(&self, replica: &str, sender: &str) {
        let now = Instant::now();
        let before = {
            let mut senders = self.senders.lock().unwrap_or_else(|e| e.into_inner());
            if senders.len() >= MAX_SENDERS && !senders.contains_key(replica) {
                senders.retain(|_, (_, at)| now.saturating_duration_since(*at) < CLASH_WINDOW);
                if senders.len() >= MAX_SENDERS {
                    return;
                }
            }
            let entry = (sender.to_string(), now);
            match senders.insert(replica.to_string(), entry) {
                Some((who, at))
                    if who != sender && now.saturating_duration_since(at) < CLASH_WINDOW =>
                {
                    who
                }
                _ => return,
            }
        };
        self.stats.name_clashes.fetch_add(1, Ordering::Relaxed);
        let mut gate = self.clash_gate.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = gate.allow(now) {
            tracing::warn!(
                replica,
                sender,
                other = %before,
                suppressed = held,
                "load relay: two senders post in-flight counts under one replica name; the \
                 Envoys keep one entry per name, so one replica's requests go uncounted (a \
                 sidecar-metrics from before replica names were made unique, or another client)"
            );
        }
    }

    /// Marks `key` (a target) busy with a delivery; `None`, counted in `busy_skips`, when it
    /// already is.
    fn claim(self: &Arc<Self>, key: String) -> Option<Claim> {
        if !self
            .busy
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone())
        {
            self.stats.busy_skips.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Claim {
            relay: self.clone(),
            key,
        })
    }

    /// Whether there is anyone to relay to: another Envoy pushed to, or a peer (configured, or
    /// found by DNS other than this pod).
    fn has_targets(&self) -> bool {
        self.envoys.len() >= 2 || !self.all_peers().is_empty()
    }

    /// Asks Envoy `i` for its records after `cursor`; on an answer, moves the cursor on and
    /// returns the body.
    async fn ask(&self, i: usize, cursor: &mut String) -> Option<Bytes> {
        let url = self.envoys.get(i)?;
        let asked = async {
            let at = HeaderValue::from_str(cursor).map_err(|e| e.to_string())?;
            let headers = [(CURSOR_HEADER, &at), (client::AUTH, &self.auth)];
            let req = client::request(Method::GET, url, &headers, Bytes::new())
                .map_err(|e| e.to_string())?;
            let resp = self.exchange(req).await?;
            if resp.status != 200 {
                return Err(format!("status {}", resp.status));
            }
            let next = resp
                .headers
                .get(CURSOR_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            Ok((resp.body, next))
        };
        match asked.await {
            Ok((body, next)) => {
                if let Some(next) = next {
                    *cursor = next;
                }
                Some(body)
            }
            Err(why) => {
                self.failed(&self.stats.envoy_failures, "asking an Envoy", url, why);
                None
            }
        }
    }

    /// POSTs `body` to `url`, naming the replica it comes from when `replica` is given, and this
    /// sidecar to a `peer`; whether it was taken (2xx).
    async fn post(
        &self,
        url: &str,
        body: Bytes,
        peer: bool,
        replica: Option<&str>,
    ) -> Result<(), String> {
        let value = |v: &str| HeaderValue::from_str(v).map_err(|e| e.to_string());
        let from = replica.map(value).transpose()?;
        let sidecar = peer.then(|| value(&self.instance)).transpose()?;
        let mut headers = vec![(client::AUTH, &self.auth), ("content-type", &OCTETS)];
        if let Some(from) = &from {
            headers.push((REPLICA_HEADER, from));
        }
        if let Some(sidecar) = &sidecar {
            headers.push((SIDECAR_HEADER, sidecar));
        }
        let req = client::request(Method::POST, url, &headers, body).map_err(|e| e.to_string())?;
        let resp = self.exchange(req).await?;
        if peer && self.is_own(resp.headers.get(SIDECAR_HEADER)) {
            self.found_self(url);
        }
        if resp.status.is_success() {
            Ok(())
        } else {
            Err(format!("status {}", resp.status))
        }
    }

    /// Sends `req` and reads the answer (a body up to [`MAX_PEER_BODY`]) within the relay's
    /// timeout; why not, as text for the log.
    pub(crate) async fn exchange(&self, req: client::Req) -> Result<client::Answer, String> {
        let client = self.client.borrow().clone();
        client
            .send_within(req, MAX_PEER_BODY, self.timeout)
            .await
            .map_err(|e| e.to_string())
    }

    /// POSTs `body` to `url`, counting a failure against an Envoy or a peer; whether it was
    /// taken.
    async fn post_counted(
        self: Arc<Self>,
        url: String,
        body: Bytes,
        peer: bool,
        replica: Option<String>,
    ) -> bool {
        match self.post(&url, body, peer, replica.as_deref()).await {
            Ok(()) => true,
            Err(why) if peer => {
                self.failed(&self.stats.peer_failures, "delivering to a peer", &url, why);
                false
            }
            Err(why) => {
                self.failed(
                    &self.stats.envoy_failures,
                    "delivering to an Envoy",
                    &url,
                    why,
                );
                false
            }
        }
    }

    /// Where what Envoy `from` gave goes: the other Envoys (`false`) and the peers (`true`).
    fn targets(&self, from: usize) -> Vec<(String, bool)> {
        let envoys = self
            .envoys
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != from)
            .map(|(_, u)| (u.clone(), false));
        let peers = self.all_peers().into_iter().map(|u| (u, true));
        envoys.chain(peers).collect()
    }

    /// Hands a batch read from Envoy `from` to the other Envoys and to the peers, without
    /// waiting: a slow or blackholed target must not hold up the asks. A target still busy with
    /// an earlier batch from the same Envoy is skipped for this one (`busy_skips`): the records
    /// are hints, and a backlog would only deliver stale ones late. Another Envoy's batch is not
    /// held up by it: before, the Envoys of one sidecar, asked in step, took turns at each
    /// peer, and what one of them routed was lost whenever the other's batch was on its way
    /// (an audit, 2026-12-07: a peer took 47 and 72 of 80 decisions routed on two Envoys, the
    /// proxy-wasm and the dynamic-module build). (The load relay's own is [`Relay::send_load`],
    /// busy per target and replica the same way.)
    fn fan_out(self: &Arc<Self>, body: Bytes, from: usize) {
        for (url, peer) in self.targets(from) {
            let Some(claim) = self.claim(format!("{url} {from}")) else {
                continue;
            };
            let me = self.clone();
            let body = body.clone();
            tokio::spawn(async move {
                me.post_counted(url, body, peer, None).await;
                drop(claim);
            });
        }
    }

    /// The configured peers and those found by DNS, without those found to be this sidecar
    /// itself within [`SELF_RECHECK`].
    pub fn all_peers(&self) -> Vec<String> {
        let mut all = self.peers.clone();
        {
            let found = self.found.lock().unwrap_or_else(|e| e.into_inner());
            let path = self.kind.peer_path();
            all.extend(
                found
                    .iter()
                    .map(|base| format!("{base}{path}"))
                    .filter(|u| !self.peers.contains(u)),
            );
        }
        let selves = self.selves.lock().unwrap_or_else(|e| e.into_inner());
        if !selves.is_empty() {
            let now = Instant::now();
            all.retain(|u| {
                selves
                    .get(u)
                    .is_none_or(|at| now.saturating_duration_since(*at) >= SELF_RECHECK)
            });
        }
        all
    }

    /// Resolves `prefix.peers_dns` every `refresh_ms` until `shutdown`. A name that does not
    /// exist (NXDOMAIN: a headless Service with no ready gateway pod) leaves no peer found by
    /// DNS, as it empties a pool; any other failure keeps the peers found before.
    pub async fn find_peers(
        self: Arc<Self>,
        resolver: Arc<dyn Resolver>,
        shutdown: CancellationToken,
    ) {
        let Some(dns) = self.dns.clone() else {
            return;
        };
        let mut tick = tokio::time::interval(Duration::from_millis(dns.refresh_ms));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let resolved = match resolver.resolve(&dns.name, dns.port).await {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    if !self
                        .found
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .is_empty()
                    {
                        tracing::warn!(name = %dns.name, error = %e,
                            "relay: the peers' name does not exist; no peer found by DNS");
                    }
                    Ok(Vec::new())
                }
                r => r,
            };
            match resolved {
                Ok(addrs) => {
                    let mut urls: Vec<String> = one_family(addrs, self.primary_ip)
                        .iter()
                        .filter(|a| !self.own_ips.contains(&a.ip().to_canonical()))
                        .map(|a| format!("{}://{a}", self.peer_scheme))
                        .collect();
                    urls.sort();
                    urls.dedup();
                    *self.found.lock().unwrap_or_else(|e| e.into_inner()) = urls;
                }
                Err(e) => self.failed(
                    &self.stats.peer_failures,
                    "resolving the peers",
                    &dns.name,
                    e.to_string(),
                ),
            }
        }
    }

    /// A peer's records (checked by the caller) to every Envoy of this replica; whether one
    /// took them, told as soon as one did: the posts to the others go on without the peer
    /// waiting for them. Before, the peer's answer waited for the slowest Envoy, so one hung
    /// Envoy here held every post for the whole `push.timeout_ms`, the peer counted it failed
    /// and skipped its next batches as busy meanwhile, and this replica's healthy Envoy took a
    /// fraction of them (an audit, 2026-12-07: 6 of 40 decisions).
    pub async fn deliver_local(self: &Arc<Self>, body: Bytes, records: usize) -> bool {
        self.stats
            .records_in
            .fetch_add(records as u64, Ordering::Relaxed);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for url in &self.envoys {
            let post = self
                .clone()
                .post_counted(url.clone(), body.clone(), false, None);
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = tx.send(post.await);
            });
        }
        drop(tx);
        while let Some(taken) = rx.recv().await {
            if taken {
                return true;
            }
        }
        false
    }

    /// Asks Envoy `i` for its records after `cursor` and hands what it had to the other targets.
    async fn relay_from(self: &Arc<Self>, i: usize, cursor: &mut String) {
        if !self.has_targets() {
            // One replica (the peers found by DNS are only this pod): no one to relay to, and
            // not asking leaves the filter's workers without the export's work.
            return;
        }
        let Some(body) = self.ask(i, cursor).await else {
            return;
        };
        let n = match decode_records(&body, MAX_IMPORT_RECORDS) {
            Ok(r) => r.len(),
            Err(why) => {
                let url = self.envoys.get(i).cloned().unwrap_or_default();
                self.failed(
                    &self.stats.envoy_failures,
                    "reading an Envoy's records",
                    &url,
                    why,
                );
                return;
            }
        };
        if n == 0 {
            return;
        }
        self.stats
            .records_out
            .fetch_add(n as u64, Ordering::Relaxed);
        self.fan_out(body, i);
    }

    /// One round: every Envoy asked at once, what each had relayed as soon as it answers.
    pub async fn round(self: &Arc<Self>, cursors: &mut [String]) {
        let asks = cursors
            .iter_mut()
            .enumerate()
            .map(|(i, cursor)| self.relay_from(i, cursor));
        futures::future::join_all(asks).await;
    }

    /// Relays every `interval` until `shutdown` (the load relay: [`Relay::run_load`]). Each
    /// Envoy is asked on its own clock, so that one slow to answer (hung, or its node loaded)
    /// delays only its own records: asked one after another, an Envoy that never answered held
    /// every other one's asks for the whole timeout. An ask missed while the one before was
    /// under way is skipped.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        if self.kind == Kind::Load {
            return self.run_load(shutdown).await;
        }
        let mut set = JoinSet::new();
        for i in 0..self.envoys.len() {
            let (me, stop) = (self.clone(), shutdown.clone());
            set.spawn(async move {
                let mut cursor = String::new();
                let mut tick = tokio::time::interval(me.interval);
                tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tick.tick() => {}
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = me.relay_from(i, &mut cursor) => {}
                    }
                }
            });
        }
        while set.join_next().await.is_some() {}
    }
}

#[cfg(test)]
#[path = "../tests/common/replica_name.rs"]
mod replica_name;

/// What the relays' unit tests share.
#[cfg(test)]
mod test_support {
    pub use super::replica_name::{plain, posted};

    /// A port that accepts connections and never answers: `http://ip:port`.
    pub async fn blackhole() -> String {
        let hole = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = hole.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((c, _)) = hole.accept().await {
                held.push(c);
            }
        });
        format!("http://{addr}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use axum::extract::State;
    use axum::http::HeaderMap;
    use axum::routing::post;
    use axum::Router;
    use gpuroute_core::exchange::{Cursor, Export};
    use gpuroute_core::prefix::SyncLog;

    /// A stand-in for one Envoy's side of the exchange (the filter's is tested through real
    /// Envoys in tests/e2e/test_replicas.py): its own records behind the cursor protocol, and
    /// the bodies POSTed to it. Also a peer's `/v1/prefix`.
    /// (authorization header, body) of each POST received.
    type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

    #[derive(Clone, Default)]
    struct Fake {
        log: Arc<Mutex<Option<SyncLog>>>,
        got: Received,
        asked: Arc<Mutex<Vec<String>>>,
    }

    async fn fake_get(State(f): State<Fake>, h: HeaderMap) -> axum::response::Response {
        let after = h
            .get(CURSOR_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        f.asked.lock().unwrap().push(after.clone());
        let mut e = Export::new(Cursor::parse(&after));
        if let Some(log) = f.log.lock().unwrap().as_ref() {
            e.add_log(3, log);
        }
        let (body, cursor) = e.finish();
        use axum::response::IntoResponse;
        ([(CURSOR_HEADER, cursor)], body).into_response()
    }

    async fn fake_post(State(f): State<Fake>, h: HeaderMap, body: Bytes) -> axum::http::StatusCode {
        let auth = h
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string();
        f.got.lock().unwrap().push((auth, body.to_vec()));
        axum::http::StatusCode::NO_CONTENT
    }

    async fn serve(f: Fake) -> String {
        let app = Router::new()
            .route("/gpuroute/v1/prefix", get(fake_get).post(fake_post))
            .route(PEER_PATH, post(fake_post))
            .with_state(f);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}")
    }

    use axum::routing::get;

    /// Waits until no delivery is under way (at most 5 s).
    async fn settle(relay: &Relay) {
        for _ in 0..500 {
            if relay.busy.lock().unwrap().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_blackholed_peer_holds_up_neither_the_asks_nor_the_other_envoy() {
        let (a, b) = (Fake::default(), Fake::default());
        *a.log.lock().unwrap() = Some(SyncLog::new(16));
        let (ua, ub) = (serve(a.clone()).await, serve(b.clone()).await);
        // Accepts connections and never answers.
        let hole = super::test_support::blackhole().await;
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.timeout_ms = 2_000;
        cfg.push.urls = vec![format!("{ua}/s"), format!("{ub}/s")];
        cfg.prefix.peers = vec![hole];
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        let mut cursors = vec![String::new(); 2];
        let t0 = Instant::now();
        for pod in 1..=3 {
            a.log.lock().unwrap().as_mut().unwrap().push(pod, &[pod]);
            relay.round(&mut cursors).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            t0.elapsed() < Duration::from_millis(1_000),
            "{:?}",
            t0.elapsed()
        );
        assert_eq!(
            b.got.lock().unwrap().len(),
            3,
            "every batch reached B meanwhile"
        );
        assert_eq!(
            relay.stats.busy_skips.load(Ordering::Relaxed),
            2,
            "the peer got the first only"
        );
    }

    #[tokio::test]
    async fn each_envoys_batch_reaches_a_slow_peer_while_the_others_is_on_its_way() {
        let (a, b) = (Fake::default(), Fake::default());
        for (f, pod) in [(&a, 1), (&b, 2)] {
            let mut log = SyncLog::new(16);
            log.push(pod, &[pod]);
            *f.log.lock().unwrap() = Some(log);
        }
        let (ua, ub) = (serve(a.clone()).await, serve(b.clone()).await);
        // A peer that takes 200 ms to answer: both Envoys' batches reach it meanwhile.
        let got: Received = Arc::default();
        let app = Router::new()
            .route(
                PEER_PATH,
                post(|State(got): State<Received>, body: Bytes| async move {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    got.lock().unwrap().push((String::new(), body.to_vec()));
                    axum::http::StatusCode::NO_CONTENT
                }),
            )
            .with_state(got.clone());
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = format!("http://{}", l.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(l, app).await });
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.urls = vec![format!("{ua}/s"), format!("{ub}/s")];
        cfg.prefix.peers = vec![peer];
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        let mut cursors = vec![String::new(); 2];
        relay.round(&mut cursors).await;
        settle(&relay).await;
        let mut pods: Vec<u64> = got
            .lock()
            .unwrap()
            .iter()
            .flat_map(|(_, body)| decode_records(body, 10).unwrap())
            .map(|r| r.pod)
            .collect();
        pods.sort();
        assert_eq!(pods, vec![1, 2], "each Envoy's record reached the peer");
        assert_eq!(relay.stats.busy_skips.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_peers_records_are_taken_once_one_envoy_took_them_whatever_a_hung_one_does() {
        let b = Fake::default();
        let ub = serve(b.clone()).await;
        // Envoy 0 accepts connections and never answers.
        let hole = super::test_support::blackhole().await;
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.timeout_ms = 2_000;
        cfg.push.urls = vec![format!("{hole}/s"), format!("{ub}/s")];
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        let mut log = SyncLog::new(4);
        log.push(5, &[1]);
        let t0 = Instant::now();
        assert!(relay.deliver_local(Bytes::from(log.encode()), 1).await);
        assert!(
            t0.elapsed() < Duration::from_millis(1_000),
            "answered after {:?}, not at the hung Envoy's timeout",
            t0.elapsed()
        );
        assert_eq!(b.got.lock().unwrap().len(), 1);
        // None takes them: told once every post failed.
        cfg.push.urls = vec![format!("{hole}/s")];
        cfg.prefix.peers = vec![hole.clone()];
        cfg.push.timeout_ms = 100;
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        assert!(!relay.deliver_local(Bytes::from(log.encode()), 1).await);
    }

    #[tokio::test]
    async fn a_hung_envoy_delays_only_its_own_asks() {
        // Envoy 0 accepts connections and never answers; Envoy 1 answers at once.
        let hole = super::test_support::blackhole().await;
        let b = Fake::default();
        *b.log.lock().unwrap() = Some(SyncLog::new(16));
        let ub = serve(b.clone()).await;
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.timeout_ms = 5_000;
        cfg.prefix.interval_ms = 50;
        cfg.push.urls = vec![format!("{hole}/s"), format!("{ub}/s")];
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        let stop = CancellationToken::new();
        let task = tokio::spawn(relay.clone().run(stop.clone()));
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        stop.cancel();
        task.await.unwrap();
        // ~40 asks in 2 s at 50 ms; asked in turn behind the hung one, none (its ask takes the
        // whole 5 s timeout).
        let asked = b.asked.lock().unwrap().len();
        assert!(asked >= 10, "Envoy 1 asked {asked} times in 2 s");
    }

    #[tokio::test]
    async fn a_round_relays_each_envoys_new_records_to_the_others_and_the_peers_once() {
        let (a, b, peer) = (Fake::default(), Fake::default(), Fake::default());
        let mut log = SyncLog::new(16);
        log.push(7, &[1, 2]);
        log.push(8, &[3]);
        *a.log.lock().unwrap() = Some(log);
        let (ua, ub, up) = (
            serve(a.clone()).await,
            serve(b.clone()).await,
            serve(peer.clone()).await,
        );
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.urls = vec![
            format!("{ua}/gpuroute/v1/snapshot"),
            format!("{ub}/gpuroute/v1/snapshot"),
        ];
        cfg.prefix.peers = vec![up];
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        let mut cursors = vec![String::new(); 2];

        relay.round(&mut cursors).await;
        settle(&relay).await;
        let got_b = b.got.lock().unwrap().clone();
        assert_eq!(got_b.len(), 1, "B gets A's batch");
        assert_eq!(got_b[0].0, "Bearer secret-token");
        let pods: Vec<u64> = decode_records(&got_b[0].1, 10)
            .unwrap()
            .iter()
            .map(|r| r.pod)
            .collect();
        assert_eq!(pods, vec![7, 8]);
        assert_eq!(peer.got.lock().unwrap().len(), 1, "the peer gets it too");
        assert!(a.got.lock().unwrap().is_empty(), "nothing goes back to A");
        assert_eq!(cursors[0], "3:2");
        assert_eq!(relay.stats.records_out.load(Ordering::Relaxed), 2);

        // Nothing new: nothing delivered. One more record: only it, after the cursor.
        relay.round(&mut cursors).await;
        settle(&relay).await;
        assert_eq!(b.got.lock().unwrap().len(), 1);
        a.log.lock().unwrap().as_mut().unwrap().push(9, &[4]);
        relay.round(&mut cursors).await;
        settle(&relay).await;
        let got_b = b.got.lock().unwrap().clone();
        assert_eq!(got_b.len(), 2);
        assert_eq!(decode_records(&got_b[1].1, 10).unwrap()[0].pod, 9);
        assert_eq!(a.asked.lock().unwrap().as_slice(), ["", "3:2", "3:2"]);
    }

    struct FakeDns(Mutex<Option<Vec<std::net::SocketAddr>>>);

    impl Resolver for FakeDns {
        fn resolve(
            &self,
            _name: &str,
            port: u16,
        ) -> futures::future::BoxFuture<'static, std::io::Result<Vec<std::net::SocketAddr>>>
        {
            let r = self.0.lock().unwrap().clone().map(|ips| {
                ips.into_iter()
                    .map(|a| std::net::SocketAddr::new(a.ip(), port))
                    .collect()
            });
            Box::pin(async move { r.ok_or_else(|| std::io::Error::other("server failure")) })
        }
    }

    /// A relay with one listed peer (10.0.0.9) and peers by DNS, resolved every 20 ms.
    fn dns_relay() -> Arc<Relay> {
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.prefix.peers = vec!["http://10.0.0.9:9100".into()];
        cfg.prefix.peers_dns = Some(DnsConfig {
            name: "gateway-headless".into(),
            port: 9100,
            refresh_ms: 20,
        });
        Relay::from_config(&cfg, crate::push::client()).unwrap()
    }

    #[tokio::test]
    async fn peers_are_found_by_dns_without_this_pod_and_kept_when_resolution_fails() {
        let relay = dns_relay();
        // Stand-in for POD_IP and POD_IPS (the test does not set process-wide environment
        // variables).
        let relay = Arc::new(Relay {
            own_ips: own_addresses(Some("10.0.0.1"), Some("10.0.0.1,fd00::1")),
            primary_ip: "10.0.0.1".parse().ok(),
            ..Arc::try_unwrap(relay).unwrap()
        });
        // A dual-stack headless Service: this pod and each peer under both their addresses;
        // the peers are posted to in this pod's primary family only.
        let addrs = [
            "10.0.0.2:1",
            "10.0.0.1:1",
            "[fd00::1]:1",
            "[fd00::2]:1",
            "10.0.0.3:1",
            "[fd00::3]:1",
            "10.0.0.9:1",
        ]
        .map(|a| a.parse().unwrap())
        .to_vec();
        let dns = Arc::new(FakeDns(Mutex::new(Some(addrs))));
        let stop = CancellationToken::new();
        let task = tokio::spawn(relay.clone().find_peers(dns.clone(), stop.clone()));
        tokio::time::sleep(Duration::from_millis(60)).await;
        let want = vec![
            "http://10.0.0.9:9100/v1/prefix".to_string(),
            "http://10.0.0.2:9100/v1/prefix".to_string(),
            "http://10.0.0.3:9100/v1/prefix".to_string(),
        ];
        assert_eq!(relay.all_peers(), want);
        *dns.0.lock().unwrap() = None;
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            relay.all_peers(),
            want,
            "a failed resolution keeps the peers"
        );
        assert!(relay.stats.peer_failures.load(Ordering::Relaxed) > 0);
        stop.cancel();
        task.await.unwrap();
    }

    /// A name that does not exist, as CoreDNS answers for a headless Service with no ready pod.
    struct NoSuchName;

    impl Resolver for NoSuchName {
        fn resolve(
            &self,
            _name: &str,
            _port: u16,
        ) -> futures::future::BoxFuture<'static, std::io::Result<Vec<std::net::SocketAddr>>>
        {
            Box::pin(async {
                Err(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "Name or service not known",
                ))
            })
        }
    }

    #[tokio::test]
    async fn a_peers_name_that_no_longer_exists_leaves_only_the_listed_peers() {
        let relay = dns_relay();
        *relay.found.lock().unwrap() = vec!["http://10.0.0.2:9100".into()];
        let (logs, _guard) = crate::util::Logs::capture();
        let stop = CancellationToken::new();
        let task = tokio::spawn(relay.clone().find_peers(Arc::new(NoSuchName), stop.clone()));
        tokio::time::sleep(Duration::from_millis(60)).await;
        stop.cancel();
        task.await.unwrap();
        assert_eq!(relay.all_peers(), ["http://10.0.0.9:9100/v1/prefix"]);
        assert_eq!(relay.stats.peer_failures.load(Ordering::Relaxed), 0);
        assert_eq!(
            logs.count("the peers' name does not exist"),
            1,
            "warned once"
        );
    }

    #[test]
    fn dual_stack_peers_are_posted_to_in_the_primary_family_only() {
        let addrs = |list: &[&str]| -> Vec<SocketAddr> {
            list.iter().map(|a| a.parse().unwrap()).collect()
        };
        let both = addrs(&["10.0.0.2:1", "[fd00::2]:1", "10.0.0.3:1", "[fd00::3]:1"]);
        let v4 = "10.0.0.1".parse().ok();
        let v6 = "fd00::1".parse().ok();
        assert_eq!(
            one_family(both.clone(), v4),
            addrs(&["10.0.0.2:1", "10.0.0.3:1"])
        );
        assert_eq!(
            one_family(both.clone(), v6),
            addrs(&["[fd00::2]:1", "[fd00::3]:1"])
        );
        // Without POD_IP, or with one family only, nothing is left out.
        assert_eq!(one_family(both.clone(), None), both);
        let only_v6 = addrs(&["[fd00::2]:1"]);
        assert_eq!(one_family(only_v6.clone(), v4), only_v6);
    }

    #[test]
    fn this_pods_addresses_are_those_of_both_downward_api_variables() {
        let v4: IpAddr = "10.0.0.1".parse().unwrap();
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(own_addresses(None, None), Vec::<IpAddr>::new());
        assert_eq!(own_addresses(Some("10.0.0.1"), None), vec![v4]);
        assert_eq!(
            own_addresses(Some("fd00::1"), Some("10.0.0.1, fd00::1")),
            vec![v4, v6]
        );
        // An IPv4 address as IPv6 writes it is the IPv4 one; what does not parse is left out.
        assert_eq!(
            own_addresses(Some("::ffff:10.0.0.1"), Some("nonsense,")),
            vec![v4]
        );
    }

    #[tokio::test]
    async fn a_dead_envoy_or_peer_is_counted_and_the_rest_still_served() {
        let (a, b) = (Fake::default(), Fake::default());
        let mut log = SyncLog::new(16);
        log.push(7, &[1]);
        *a.log.lock().unwrap() = Some(log);
        let (ua, ub) = (serve(a.clone()).await, serve(b.clone()).await);
        let dead = "http://127.0.0.1:9".to_string();
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.timeout_ms = 500;
        cfg.push.urls = vec![format!("{ua}/s"), format!("{dead}/s"), format!("{ub}/s")];
        cfg.prefix.peers = vec![dead];
        let relay = Relay::from_config(&cfg, crate::push::client()).unwrap();
        let mut cursors = vec![String::new(); 3];
        relay.round(&mut cursors).await;
        settle(&relay).await;
        assert_eq!(b.got.lock().unwrap().len(), 1);
        // Asking the dead Envoy, delivering to it, and delivering to the dead peer.
        assert_eq!(relay.stats.envoy_failures.load(Ordering::Relaxed), 2);
        assert_eq!(relay.stats.peer_failures.load(Ordering::Relaxed), 1);
        assert_eq!(cursors[1], "", "a failed ask leaves the cursor");
    }

    #[test]
    fn the_prefix_url_sits_beside_each_ingest_url() {
        assert_eq!(
            beside(
                "http://127.0.0.1:9902/gpuroute/v1/snapshot?x=1",
                "/gpuroute/v1/prefix"
            )
            .as_deref(),
            Some("http://127.0.0.1:9902/gpuroute/v1/prefix")
        );
        assert_eq!(beside("not a url", "/p"), None);
    }

    #[test]
    fn the_relay_runs_only_with_someone_to_relay_to() {
        let client = crate::push::client();
        let mut cfg = Config::default();
        cfg.push.token = Some("secret-token".into());
        cfg.push.urls = vec!["http://127.0.0.1:1/s".into()];
        assert!(Relay::from_config(&cfg, client.clone()).is_none());
        cfg.push.urls.push("http://127.0.0.1:2/s".into());
        let r = Relay::from_config(&cfg, client.clone());
        assert_eq!(r.map(|r| r.envoys.len()), Some(2));
        cfg.push.urls.truncate(1);
        cfg.prefix.peers = vec!["http://10.0.0.2:9100".into()];
        let r = Relay::from_config(&cfg, client.clone());
        assert_eq!(
            r.map(|r| r.peers.clone()),
            Some(vec!["http://10.0.0.2:9100/v1/prefix".to_string()])
        );
        cfg.prefix.enabled = false;
        assert!(Relay::from_config(&cfg, client).is_none());
    }
}
