//! Configuration: the file format (YAML or JSON), its defaults, command-line/environment
//! overrides, and validation that names the offending field.
//!
//! Every option and the reason for its default is listed in `sidecar-metrics/README.md`
//! (`tests/config_reference.rs` fails when the two part); the constants below say where their
//! values come from. Precedence: command-line flag, then
//! environment variable (clap reads both), then the file, then the default.

use gpuroute_core::snapshot::{Engine, MAX_NAME_LEN};
use serde::Deserialize;
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Scrape interval. 100 ms: twice the GIE endpoint picker's 50 ms poll, which is enough to see a
/// queue build up within a fraction of a typical TTFT (hundreds of ms), while 1,000 pods cost
/// well under half a core (see the README's measurement). Pushes follow each round, so the
/// filter's view lags a pod by at most about two intervals.
pub const DEFAULT_INTERVAL_MS: u64 = 100;
/// Per-pod scrape timeout. vLLM renders `/metrics` in a few milliseconds even under load; 300 ms
/// (3 intervals) tolerates a GIL-starved server without waiting so long that a hung pod keeps
/// its traffic: three timeouts in a row are about one second.
pub const DEFAULT_TIMEOUT_MS: u64 = 300;
/// Consecutive failed scrapes before a pod is unhealthy. 3: one lost scrape is noise on a busy
/// pod; three at 100 ms (connection refused answers at once) take a dead pod out in ~0.3 s.
pub const DEFAULT_UNHEALTHY_AFTER_FAILURES: u32 = 3;
/// A pod whose last good data is older than this is unhealthy, whatever the failure count: it
/// bounds the time a hung pod (each scrape runs into its timeout) keeps traffic to ~1 s.
pub const DEFAULT_MAX_DATA_AGE_MS: u64 = 1_000;
/// Ramp-up window after a pod comes back. 30 s: long enough for a restarted vLLM to warm its
/// CUDA graphs and prefix cache under a growing share of traffic, short next to a deployment.
pub const DEFAULT_RAMP_WINDOW_MS: u64 = 30_000;
/// Ramp weight at the start of the window: 0.1, so a returning pod takes some traffic at once
/// (its metrics then show whether it copes) but not a full share.
pub const DEFAULT_RAMP_START_WEIGHT: f64 = 0.1;
/// Pods that first become healthy this soon after the aggregator starts do not ramp: a restart
/// of the aggregator must not throttle a whole healthy fleet.
pub const DEFAULT_STARTUP_GRACE_MS: u64 = 5_000;
/// Window of the per-pod speed (inter-token latency) estimate, a low quantile of the window's
/// interval means. 10 s holds ~100 intervals at the default scrape interval while following a
/// real change (another GPU, a throttled card) within seconds.
pub const DEFAULT_CAPACITY_TIME_CONSTANT_MS: u64 = 10_000;
/// Fewest decoded tokens in one scrape interval for its mean inter-token latency to count: below
/// that one long prefill stall dominates the mean.
pub const DEFAULT_CAPACITY_MIN_TOKENS: u64 = 16;
/// Ingest endpoint of the Envoy beside us (the shipped Envoy configs' loopback listener).
pub const DEFAULT_INGEST_URL: &str = "http://127.0.0.1:9002/gpuroute/v1/snapshot";
/// Push timeout. The ingest listener is on loopback and answers in well under a millisecond;
/// 500 ms only guards against a wedged Envoy, and a newer snapshot replaces the pending one.
pub const DEFAULT_PUSH_TIMEOUT_MS: u64 = 500;
/// Our own HTTP surface. Loopback by default: `/debug/snapshot` shows the whole fleet.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9100";
/// Largest `/metrics` body read from a pod. A real vLLM scrape is ~45 KB; 4 MiB leaves room for
/// many LoRA adapters while bounding memory if a pod misbehaves.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
/// DNS re-resolution period: 5 s follows a headless Service's endpoint changes (its DNS TTL is
/// typically 5-30 s) without flooding the resolver.
pub const DEFAULT_DNS_REFRESH_MS: u64 = 5_000;
/// How often each Envoy's in-flight (prefill) counts are read and relayed to the other gateway
/// replicas. 5 ms: the offline replay (`make replay-gateways`) found that replicas which share
/// these counts within ~5 ms win back nearly all the mean TTFT that routing blind to each other
/// loses (7-29% with 3 replicas), within 20 ms only about half. One small loopback GET per Envoy
/// each interval (less often while it has nothing in prefill), and a POST per target when the
/// counts changed or need keeping alive.
pub const DEFAULT_LOAD_INTERVAL_MS: u64 = 5;
/// Longest `prefix.load_interval_ms` accepted: slower than a second, the counts say nothing about
/// requests that are still in prefill.
pub const MAX_LOAD_INTERVAL_MS: u64 = 1_000;
/// The filter's in-flight count exchange path, beside the ingest path.
pub const DEFAULT_LOAD_PATH: &str = "/gpuroute/v1/load";
/// How long an unchanged (non-empty) body of in-flight counts goes without being posted again
/// to a target, ms. It must stay below the filters' `ingest.load_ttl_ms` (50 by default), or a
/// receiving Envoy forgets the counts between two posts. 20 leaves room for a late post on a
/// loaded node, and posts counts that stand still a quarter as often as every 5 ms would.
pub const DEFAULT_LOAD_KEEPALIVE_MS: u64 = 20;
/// Longest `prefix.load_keepalive_ms` accepted.
pub const MAX_LOAD_KEEPALIVE_MS: u64 = 10_000;
/// How often an Envoy with nothing in prefill (its last body was empty) is read, ms: an idle
/// gateway is read a quarter as often as every 5 ms, at the cost of a burst's first requests
/// reaching the other replicas up to 20 ms later (the rest follow every `load_interval_ms`).
pub const DEFAULT_LOAD_IDLE_INTERVAL_MS: u64 = 20;
/// Longest `prefix.load_idle_interval_ms` accepted.
pub const MAX_LOAD_IDLE_INTERVAL_MS: u64 = 1_000;

/// The whole configuration, as read from the file (every field has a default).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Scrape interval, ms.
    #[serde(default = "d_interval")]
    pub interval_ms: u64,
    /// Per-pod scrape timeout, ms.
    #[serde(default = "d_timeout")]
    pub timeout_ms: u64,
    /// How long after a round starts its snapshot is published even if some pods have not
    /// answered yet, ms. Default: half the interval.
    #[serde(default)]
    pub publish_deadline_ms: Option<u64>,
    /// Address of our own HTTP surface (`127.0.0.1:0` picks a free port; the bound address is
    /// logged).
    #[serde(default = "d_listen")]
    pub listen: String,
    /// A second listener, `ip:port`, serving only `/metrics` (and `/healthz`): Prometheus can
    /// scrape it from outside the pod while `listen` (with `/debug/snapshot`, the whole
    /// fleet's view) stays on loopback. Unset: `/metrics` only on `listen`.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// Producer name written into snapshots. Default: `$HOSTNAME`, else `sidecar-metrics`.
    #[serde(default)]
    pub source: Option<String>,
    /// Largest `/metrics` body accepted from a pod, bytes.
    #[serde(default = "d_max_body")]
    pub max_body_bytes: usize,
    /// Tokio worker threads. Default 2: a round's scrapes are CPU work (~37 us each) that two
    /// threads finish in parallel; on the 2-core reference machine 1,000 pods took p50 35 ms per
    /// round with two threads against 43 ms with one, for ~2.5 points more CPU (README,
    /// "Measured"). One thread is the cheapest for small fleets.
    #[serde(default = "d_workers")]
    pub worker_threads: usize,
    /// Ask each pod for only the metrics the aggregator reads (`?name[]=...`, which
    /// prometheus_client honours: vLLM). A pod that answers such a scrape with a
    /// 4xx or with none of them is scraped whole from then on.
    #[serde(default = "d_true")]
    pub filter_metrics: bool,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub ramp: RampConfig,
    #[serde(default)]
    pub capacity: CapacityConfig,
    #[serde(default)]
    pub push: PushConfig,
    /// The prefix-record relay between gateway replicas.
    #[serde(default)]
    pub prefix: PrefixRelayConfig,
    /// TLS for scrapes of `https://` metrics URLs (`pools[].metrics_scheme: https`, or a pod's
    /// own `metrics_url`). Left at its defaults, such scrapes check the pods against the
    /// system's certificate authorities.
    #[serde(default)]
    pub scrape_tls: TlsConfig,
    /// The pools and how to find their pods.
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
}

/// How pods serving their metrics over HTTPS are scraped (`crate::tls`).
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the certificate authorities the pods' certificates are checked against.
    /// Unset: the system's.
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain shown to pods that ask for one (mutual TLS), with `key_file`.
    #[serde(default)]
    pub cert_file: Option<PathBuf>,
    /// PEM private key of `cert_file`.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// The name the pods' certificates must be issued for. Unset: the URL's host, for
    /// discovered pods their IP address, which their certificates must then list.
    #[serde(default)]
    pub server_name: Option<String>,
    /// Take any certificate (the connection is still encrypted). For meshes whose workload
    /// certificates name an identity, not a host (Istio's SPIFFE ids): Istio's own Prometheus
    /// integration scrapes with its workload certificate and this set.
    #[serde(default)]
    pub insecure_skip_verify: bool,
}

/// The scheme of discovered pods' metrics URLs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricsScheme {
    #[default]
    Http,
    Https,
}

/// When a pod stops being a candidate.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    #[serde(default = "d_failures")]
    pub unhealthy_after_failures: u32,
    #[serde(default = "d_max_age")]
    pub max_data_age_ms: u64,
}

/// Gradual return of a pod that comes back.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RampConfig {
    /// Window over which the weight grows linearly to 1; 0 turns ramping off.
    #[serde(default = "d_ramp_window")]
    pub window_ms: u64,
    /// Weight at the start of the window.
    #[serde(default = "d_ramp_start")]
    pub start_weight: f64,
    /// Pods first healthy within this time of the aggregator's start do not ramp.
    #[serde(default = "d_grace")]
    pub startup_grace_ms: u64,
}

/// Relative serving speed (`capacity`) estimation.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacityConfig {
    /// Estimate capacity from inter-token latency when a pod has none configured.
    #[serde(default = "d_true")]
    pub estimate: bool,
    #[serde(default = "d_cap_tau")]
    pub time_constant_ms: u64,
    #[serde(default = "d_cap_min_tokens")]
    pub min_tokens: u64,
}

/// Which pushes make `/readyz` succeed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReadyPolicy {
    /// Every ingest URL has accepted at least one snapshot.
    #[default]
    All,
    /// At least one ingest URL has.
    Any,
}

/// Where and how snapshots are pushed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PushConfig {
    /// Ingest endpoints (one per Envoy). An empty list disables pushing (debugging only).
    #[serde(default = "d_urls")]
    pub urls: Vec<String>,
    /// Shared bearer token. Prefer `token_file` or `GPUROUTE_INGEST_TOKEN` in production.
    #[serde(default)]
    pub token: Option<String>,
    /// File holding the token (a mounted Secret); whitespace around it is ignored.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    #[serde(default = "d_push_timeout")]
    pub timeout_ms: u64,
    #[serde(default)]
    pub ready: ReadyPolicy,
    /// The largest snapshot pushed, bytes: at most the filter's `ingest.max_snapshot_bytes` (5 MiB
    /// in the shipped Envoy Gateway and Istio configurations; 8 MiB by the filter's default). A
    /// larger one is trimmed first (adapter lists), not refused.
    #[serde(default = "d_max_snapshot")]
    pub max_snapshot_bytes: usize,
}

/// The prefix-record relay (`relay`): every `interval_ms` each Envoy pushed to is asked for its
/// new routing decisions (`GET {path}`), which go to the other Envoys pushed to and to every
/// peer (another gateway replica's sidecar-metrics, `POST /v1/prefix`), which hands them to its
/// own Envoys. So gateway replicas keep a conversation on the pod that holds its prefix even
/// when its turns alternate between replicas. It runs when there is someone to relay to: two
/// or more push URLs, or a peer.
///
/// The in-flight count relay shares its peers, their listener and the token: every
/// `load_interval_ms` each Envoy pushed to is read (`GET {load_path}`: the requests it has in
/// prefill on each pod), and the answer goes, as it is, to the other Envoys pushed to and to every
/// peer (`POST /v1/load`), which hands it to its own Envoys; to each target only when it changed
/// or the target's copy needs keeping alive (`load_keepalive_ms`), and an Envoy with nothing in
/// prefill is read every `load_idle_interval_ms` instead. So each replica routes knowing the
/// others' requests still in prefill, not blind to them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefixRelayConfig {
    /// Off = neither ask the Envoys nor accept peers' records.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// How often each Envoy is asked, ms: a follow-up turn that arrives at another replica
    /// sooner than this after the turn before may miss where that one went.
    #[serde(default = "d_prefix_interval")]
    pub interval_ms: u64,
    /// The filter's `ingest.prefix_path`, on each push URL's host and port.
    #[serde(default = "d_prefix_path")]
    pub path: String,
    /// Other replicas' sidecar-metrics, `http://host:port` (their `listen`). They must share
    /// the push token: it authenticates the records between sidecars too.
    #[serde(default)]
    pub peers: Vec<String>,
    /// Peers found by DNS: a headless Service of the gateway pods, re-resolved every
    /// `refresh_ms`, `port` being the sidecars' `listen` port. This pod's own addresses are left
    /// out when the `POD_IPS` or `POD_IP` environment variables name them (Kubernetes' downward
    /// API: `status.podIPs`, both families on a dual-stack cluster, and `status.podIP`); any
    /// other peer that answers as this sidecar itself is left out once it did.
    #[serde(default)]
    pub peers_dns: Option<DnsConfig>,
    /// Mutual TLS between the sidecars: `listen` serves `cert_file` and takes only peers whose
    /// certificate `ca_file` signed; posts to the peers (`https://`) show the same certificate
    /// and check theirs against `ca_file` and `server_name` (peers are reached by IP). Unset:
    /// plain HTTP, the token the only check.
    #[serde(default)]
    pub tls: TlsConfig,
    /// A second listener, `ip:port`, serving only the peers' `POST /v1/prefix` and
    /// `POST /v1/load`: the peers can reach it while `listen` (with `/debug/snapshot`, the whole
    /// fleet's view) stays on loopback. Unset: peers use `listen`.
    #[serde(default)]
    pub listen: Option<String>,
    /// How often each Envoy's in-flight (prefill) counts are read and relayed, ms (1 to 1000);
    /// 0 turns the in-flight count relay off (neither read the Envoys nor accept peers'
    /// counts). It runs, like the prefix relay, only with someone to relay to.
    #[serde(default = "d_load_interval")]
    pub load_interval_ms: u64,
    /// The filter's in-flight count exchange path, on each push URL's host and port: `GET`
    /// answers that Envoy's own counts, `POST` takes another replica's.
    #[serde(default = "d_load_path")]
    pub load_path: String,
    /// The longest an unchanged body of counts goes without being posted again to a target, ms
    /// (1 to 10000). Keep it below the filters' `ingest.load_ttl_ms`, or the receivers forget
    /// the counts between posts. An empty body (nothing in prefill) is not kept alive: an
    /// expired entry means the same.
    #[serde(default = "d_load_keepalive")]
    pub load_keepalive_ms: u64,
    /// How often an Envoy whose last body was empty (nothing in prefill) is read, ms (1 to
    /// 1000, at least `load_interval_ms`); it is read every `load_interval_ms` again from its
    /// first non-empty body on.
    #[serde(default = "d_load_idle_interval")]
    pub load_idle_interval_ms: u64,
}

impl PrefixRelayConfig {
    /// Whether the peers speak TLS (`tls` set).
    pub fn tls_set(&self) -> bool {
        self.tls != TlsConfig::default()
    }
}

impl Default for PrefixRelayConfig {
    fn default() -> Self {
        PrefixRelayConfig {
            enabled: true,
            interval_ms: d_prefix_interval(),
            path: d_prefix_path(),
            peers: Vec::new(),
            peers_dns: None,
            tls: TlsConfig::default(),
            listen: None,
            load_interval_ms: d_load_interval(),
            load_path: d_load_path(),
            load_keepalive_ms: d_load_keepalive(),
            load_idle_interval_ms: d_load_idle_interval(),
        }
    }
}

fn yes() -> bool {
    true
}
fn d_prefix_interval() -> u64 {
    50
}
fn d_prefix_path() -> String {
    "/gpuroute/v1/prefix".to_string()
}
fn d_load_interval() -> u64 {
    DEFAULT_LOAD_INTERVAL_MS
}
fn d_load_path() -> String {
    DEFAULT_LOAD_PATH.to_string()
}
fn d_load_keepalive() -> u64 {
    DEFAULT_LOAD_KEEPALIVE_MS
}
fn d_load_idle_interval() -> u64 {
    DEFAULT_LOAD_IDLE_INTERVAL_MS
}

/// One pool (one model deployment) and the single source of its pods.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Must match the filter configuration's pool name.
    pub name: String,
    /// Engine of the pool's pods when a pod does not say; detected from metric names if unset.
    #[serde(default)]
    pub engine: Option<Engine>,
    /// Path of the metrics endpoint for discovered pods. Default `/metrics`
    /// (`/prometheus/metrics` for `trtllm`).
    #[serde(default)]
    pub metrics_path: Option<String>,
    /// `https` for pods that serve their metrics over TLS (`scrape_tls`).
    #[serde(default)]
    pub metrics_scheme: MetricsScheme,
    /// Static list of pods.
    #[serde(default)]
    pub pods: Option<Vec<PodConfig>>,
    /// A DNS name resolving to the pods (a headless Service).
    #[serde(default)]
    pub dns: Option<DnsConfig>,
    /// Kubernetes pods, by label selector or through an `InferencePool`.
    #[serde(default)]
    pub kubernetes: Option<KubernetesConfig>,
}

/// A statically configured pod.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodConfig {
    /// `ip:port` the gateway connects to.
    pub address: String,
    #[serde(default)]
    pub engine: Option<Engine>,
    /// Default `{metrics_scheme}://{address}{metrics_path}`; `http://` or `https://`.
    #[serde(default)]
    pub metrics_url: Option<String>,
    /// Relative serving speed; overrides the estimate.
    #[serde(default)]
    pub capacity: Option<f64>,
}

/// DNS discovery.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsConfig {
    pub name: String,
    pub port: u16,
    #[serde(default = "d_dns_refresh")]
    pub refresh_ms: u64,
}

/// Kubernetes discovery: exactly one of `selector` (+ `port`) or `inference_pool`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubernetesConfig {
    #[serde(default = "d_namespace")]
    pub namespace: String,
    /// Label selector, e.g. `app=vllm,model=llama-8b`.
    #[serde(default)]
    pub selector: Option<String>,
    /// Serving port of the selected pods.
    #[serde(default)]
    pub port: Option<u16>,
    /// Name of an `InferencePool` (`inference.networking.k8s.io/v1`) whose `selector` and
    /// `targetPorts` define the pods.
    #[serde(default)]
    pub inference_pool: Option<String>,
}

fn d_interval() -> u64 {
    DEFAULT_INTERVAL_MS
}
fn d_timeout() -> u64 {
    DEFAULT_TIMEOUT_MS
}
fn d_listen() -> String {
    DEFAULT_LISTEN.to_string()
}
fn d_max_body() -> usize {
    DEFAULT_MAX_BODY_BYTES
}
fn d_workers() -> usize {
    2
}
fn d_failures() -> u32 {
    DEFAULT_UNHEALTHY_AFTER_FAILURES
}
fn d_max_age() -> u64 {
    DEFAULT_MAX_DATA_AGE_MS
}
fn d_ramp_window() -> u64 {
    DEFAULT_RAMP_WINDOW_MS
}
fn d_ramp_start() -> f64 {
    DEFAULT_RAMP_START_WEIGHT
}
fn d_grace() -> u64 {
    DEFAULT_STARTUP_GRACE_MS
}
fn d_true() -> bool {
    true
}
fn d_cap_tau() -> u64 {
    DEFAULT_CAPACITY_TIME_CONSTANT_MS
}
fn d_cap_min_tokens() -> u64 {
    DEFAULT_CAPACITY_MIN_TOKENS
}
fn d_urls() -> Vec<String> {
    vec![DEFAULT_INGEST_URL.to_string()]
}
fn d_push_timeout() -> u64 {
    DEFAULT_PUSH_TIMEOUT_MS
}
fn d_max_snapshot() -> usize {
    5 * 1024 * 1024
}
fn d_dns_refresh() -> u64 {
    DEFAULT_DNS_REFRESH_MS
}
fn d_namespace() -> String {
    "default".to_string()
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            unhealthy_after_failures: d_failures(),
            max_data_age_ms: d_max_age(),
        }
    }
}

impl Default for RampConfig {
    fn default() -> Self {
        RampConfig {
            window_ms: d_ramp_window(),
            start_weight: d_ramp_start(),
            startup_grace_ms: d_grace(),
        }
    }
}

impl Default for CapacityConfig {
    fn default() -> Self {
        CapacityConfig {
            estimate: true,
            time_constant_ms: d_cap_tau(),
            min_tokens: d_cap_min_tokens(),
        }
    }
}

impl Default for PushConfig {
    fn default() -> Self {
        PushConfig {
            urls: d_urls(),
            token: None,
            token_file: None,
            timeout_ms: d_push_timeout(),
            ready: ReadyPolicy::All,
            max_snapshot_bytes: d_max_snapshot(),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            interval_ms: d_interval(),
            timeout_ms: d_timeout(),
            publish_deadline_ms: None,
            listen: d_listen(),
            metrics_listen: None,
            source: None,
            max_body_bytes: d_max_body(),
            worker_threads: d_workers(),
            filter_metrics: true,
            health: HealthConfig::default(),
            ramp: RampConfig::default(),
            capacity: CapacityConfig::default(),
            push: PushConfig::default(),
            prefix: PrefixRelayConfig::default(),
            scrape_tls: TlsConfig::default(),
            pools: Vec::new(),
        }
    }
}

/// A configuration that cannot be used; the message names the field.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("config file {path} is not valid YAML/JSON: {message}")]
    Syntax { path: PathBuf, message: String },
    #[error("config {field}: {reason}")]
    Field { field: String, reason: String },
}

fn field(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// Command-line and environment overrides (see `main.rs` for the flag and variable names).
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub interval_ms: Option<u64>,
    pub timeout_ms: Option<u64>,
    pub listen: Option<String>,
    /// Replaces `push.urls` when non-empty.
    pub ingest_urls: Vec<String>,
    pub token: Option<String>,
    /// `NAME=ADDR,ADDR...`: a static pool, replacing a file pool of the same name.
    pub pools: Vec<String>,
    /// Replaces `prefix.peers` when non-empty.
    pub prefix_peers: Vec<String>,
}

impl Config {
    /// Reads a config file. YAML is a superset of JSON, so one reader takes both.
    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_str_named(&text, path)
    }

    /// Parses config text; `path` is only used in messages.
    pub fn from_str_named(text: &str, path: &Path) -> Result<Config, ConfigError> {
        if text.trim().is_empty() {
            return Ok(Config::default());
        }
        let value: serde_json::Value =
            serde_saphyr::from_str(text).map_err(|e| ConfigError::Syntax {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        if value.is_null() {
            return Ok(Config::default());
        }
        // Going through a JSON value lets serde_path_to_error name the field for any syntax.
        serde_path_to_error::deserialize(value).map_err(|e| {
            let path = e.path().to_string();
            let reason = e.into_inner().to_string();
            field(
                if path == "." {
                    "(top level)".into()
                } else {
                    path
                },
                reason,
            )
        })
    }

    /// Applies command-line/environment overrides.
    pub fn apply(&mut self, o: Overrides) -> Result<(), ConfigError> {
        if let Some(v) = o.interval_ms {
            self.interval_ms = v;
        }
        if let Some(v) = o.timeout_ms {
            self.timeout_ms = v;
        }
        if let Some(v) = o.listen {
            self.listen = v;
        }
        if !o.ingest_urls.is_empty() {
            self.push.urls = o.ingest_urls;
        }
        if let Some(t) = o.token {
            self.push.token = Some(t);
        }
        if !o.prefix_peers.is_empty() {
            self.prefix.peers = o.prefix_peers;
        }
        for spec in o.pools {
            let (name, addrs) = spec
                .split_once('=')
                .ok_or_else(|| field("--pool", format!("{spec:?} is not NAME=ADDR,ADDR...")))?;
            let pods = addrs
                .split(',')
                .map(str::trim)
                .filter(|a| !a.is_empty())
                .map(|a| PodConfig {
                    address: a.to_string(),
                    engine: None,
                    metrics_url: None,
                    capacity: None,
                })
                .collect();
            let pool = PoolConfig {
                pods: Some(pods),
                ..PoolConfig::named(name.trim())
            };
            match self.pools.iter_mut().find(|p| p.name == pool.name) {
                Some(existing) => *existing = pool,
                None => self.pools.push(pool),
            }
        }
        Ok(())
    }

    /// The publish deadline in effect (configured, or half the interval).
    pub fn publish_deadline_ms(&self) -> u64 {
        self.publish_deadline_ms
            .unwrap_or(self.interval_ms / 2)
            .max(1)
    }

    /// The producer name in effect: `source`, else `$HOSTNAME`, else `sidecar-metrics`. It names
    /// the snapshots and, with a random part drawn at start (`relay::instance_name`), this
    /// replica's in-flight counts.
    pub fn source_name(&self) -> String {
        self.source
            .clone()
            .or_else(|| std::env::var("HOSTNAME").ok())
            .unwrap_or_else(|| "sidecar-metrics".to_string())
    }

    /// The token in effect: `push.token`, else the content of `push.token_file`.
    pub fn resolve_token(&mut self) -> Result<(), ConfigError> {
        if self.push.token.is_none() {
            if let Some(path) = &self.push.token_file {
                let t = std::fs::read_to_string(path).map_err(|e| {
                    field(
                        "push.token_file",
                        format!("cannot read {}: {e}", path.display()),
                    )
                })?;
                self.push.token = Some(t.trim().to_string());
            }
        }
        Ok(())
    }

    /// Checks every field; the first problem is returned, naming its field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(10..=60_000).contains(&self.interval_ms) {
            return Err(field("interval_ms", "must be between 10 and 60000"));
        }
        if self.timeout_ms == 0 {
            return Err(field("timeout_ms", "must be positive"));
        }
        if let Some(d) = self.publish_deadline_ms {
            if d == 0 || d > self.interval_ms {
                return Err(field(
                    "publish_deadline_ms",
                    "must be positive and at most interval_ms",
                ));
            }
        }
        if self.listen.parse::<SocketAddr>().is_err() {
            return Err(field("listen", format!("{:?} is not ip:port", self.listen)));
        }
        if let Some(m) = &self.metrics_listen {
            if m.parse::<SocketAddr>().is_err() {
                return Err(field("metrics_listen", format!("{m:?} is not ip:port")));
            }
        }
        if self.max_body_bytes < 1024 {
            return Err(field("max_body_bytes", "must be at least 1024"));
        }
        if !(1..=64).contains(&self.worker_threads) {
            return Err(field("worker_threads", "must be between 1 and 64"));
        }
        if self.health.unhealthy_after_failures == 0 {
            return Err(field(
                "health.unhealthy_after_failures",
                "must be at least 1",
            ));
        }
        if self.health.max_data_age_ms < self.interval_ms {
            return Err(field(
                "health.max_data_age_ms",
                "must be at least interval_ms, or every pod would look stale",
            ));
        }
        if !(self.ramp.start_weight > 0.0 && self.ramp.start_weight <= 1.0) {
            return Err(field("ramp.start_weight", "must be in (0, 1]"));
        }
        if self.capacity.time_constant_ms == 0 {
            return Err(field("capacity.time_constant_ms", "must be positive"));
        }
        for (i, u) in self.push.urls.iter().enumerate() {
            check_http_url(&format!("push.urls[{i}]"), u)?;
        }
        if !self.push.urls.is_empty() && self.push.token.as_deref().is_none_or(str::is_empty) {
            return Err(field(
                "push.token",
                "required to push (set push.token, push.token_file, --token or GPUROUTE_INGEST_TOKEN)",
            ));
        }
        // It travels in an `Authorization` header: a character a header cannot carry (a line
        // break from a careless Secret, say) would otherwise be dropped with the whole token.
        if let Some(t) = &self.push.token {
            if !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(field(
                    "push.token",
                    "must be visible ASCII characters only (no spaces, line breaks or other control characters)",
                ));
            }
        }
        if self.push.timeout_ms == 0 {
            return Err(field("push.timeout_ms", "must be positive"));
        }
        if self.push.max_snapshot_bytes < 64 * 1024 {
            return Err(field("push.max_snapshot_bytes", "must be at least 65536"));
        }
        if !(10..=60_000).contains(&self.prefix.interval_ms) {
            return Err(field("prefix.interval_ms", "must be between 10 and 60000"));
        }
        if !self.prefix.path.starts_with('/') {
            return Err(field("prefix.path", "must start with '/'"));
        }
        if self.prefix.load_interval_ms > MAX_LOAD_INTERVAL_MS {
            return Err(field(
                "prefix.load_interval_ms",
                format!("must be 0 (off) or between 1 and {MAX_LOAD_INTERVAL_MS}"),
            ));
        }
        if !self.prefix.load_path.starts_with('/') {
            return Err(field("prefix.load_path", "must start with '/'"));
        }
        if !(1..=MAX_LOAD_KEEPALIVE_MS).contains(&self.prefix.load_keepalive_ms) {
            return Err(field(
                "prefix.load_keepalive_ms",
                format!("must be between 1 and {MAX_LOAD_KEEPALIVE_MS}"),
            ));
        }
        // Shorter than `load_interval_ms` is taken as `load_interval_ms` (an idle Envoy is never
        // read more often than a busy one), so raising the interval alone stays valid.
        let idle = self.prefix.load_idle_interval_ms;
        if !(1..=MAX_LOAD_IDLE_INTERVAL_MS).contains(&idle) {
            return Err(field(
                "prefix.load_idle_interval_ms",
                format!("must be between 1 and {MAX_LOAD_IDLE_INTERVAL_MS}"),
            ));
        }
        let peer_tls = self.prefix.tls_set();
        for (i, u) in self.prefix.peers.iter().enumerate() {
            let f = format!("prefix.peers[{i}]");
            if peer_tls {
                check_url(&f, u, &["https"])?;
            } else {
                check_http_url(&f, u)?;
            }
        }
        if let Some(l) = &self.prefix.listen {
            if l.parse::<SocketAddr>().is_err() {
                return Err(field("prefix.listen", format!("{l:?} is not ip:port")));
            }
        }
        if peer_tls {
            if self.prefix.listen.is_none() {
                return Err(field(
                    "prefix.listen",
                    "required with prefix.tls: the listener the peers reach over TLS",
                ));
            }
            // Read now: a missing or mismatched file stops the start.
            crate::tls::server_tls(&self.prefix.tls, "prefix.tls")?;
            crate::tls::client_tls(&self.prefix.tls, "prefix.tls")?;
        }
        if let Some(d) = &self.prefix.peers_dns {
            if d.name.is_empty() || d.port == 0 || d.refresh_ms == 0 {
                return Err(field(
                    "prefix.peers_dns",
                    "needs a name, a port and a positive refresh_ms",
                ));
            }
        }
        let any_peer = !self.prefix.peers.is_empty() || self.prefix.peers_dns.is_some();
        if any_peer && self.push.token.as_deref().is_none_or(str::is_empty) {
            return Err(field(
                "push.token",
                "required to exchange prefix records with peers",
            ));
        }
        if self.pools.is_empty() {
            return Err(field(
                "pools",
                "no pools configured (add pools to the file or use --pool NAME=ADDR,...)",
            ));
        }
        let mut names = HashSet::new();
        for (i, p) in self.pools.iter().enumerate() {
            p.validate(&format!("pools[{i}]"))?;
            if !names.insert(p.name.as_str()) {
                return Err(field(
                    format!("pools[{i}].name"),
                    format!("duplicate pool {:?}", p.name),
                ));
            }
        }
        // Its files are read now, so a missing or unreadable one stops the start.
        self.scrape_client_tls()?;
        Ok(())
    }

    /// Whether the scrapes need TLS: a pod is scraped over HTTPS, or `scrape_tls` is set (its
    /// files are then read even if nothing uses them yet, so a mistake shows at start-up).
    pub fn scrapes_over_tls(&self) -> bool {
        self.scrape_tls != TlsConfig::default() || self.pools.iter().any(PoolConfig::scrapes_https)
    }

    /// The scrapes' TLS, from `scrape_tls`, when they need it ([`Config::scrapes_over_tls`]).
    pub fn scrape_client_tls(&self) -> Result<Option<crate::tls::ClientTls>, ConfigError> {
        if !self.scrapes_over_tls() {
            return Ok(None);
        }
        crate::tls::client_tls(&self.scrape_tls, "scrape_tls").map(Some)
    }
}

impl PoolConfig {
    /// A pool of this name with every option at its default and no source of pods yet (a
    /// configuration needs one of `pods`, `dns` or `kubernetes` set).
    pub fn named(name: impl Into<String>) -> PoolConfig {
        PoolConfig {
            name: name.into(),
            engine: None,
            metrics_path: None,
            metrics_scheme: Default::default(),
            pods: None,
            dns: None,
            kubernetes: None,
        }
    }

    fn validate(&self, f: &str) -> Result<(), ConfigError> {
        if self.name.is_empty() || self.name.len() > MAX_NAME_LEN {
            return Err(field(
                format!("{f}.name"),
                format!("must be 1 to {MAX_NAME_LEN} bytes"),
            ));
        }
        let sources = [
            self.pods.is_some(),
            self.dns.is_some(),
            self.kubernetes.is_some(),
        ]
        .iter()
        .filter(|s| **s)
        .count();
        if sources != 1 {
            return Err(field(f, "needs exactly one of pods, dns or kubernetes"));
        }
        if let Some(path) = &self.metrics_path {
            if !path.starts_with('/') {
                return Err(field(format!("{f}.metrics_path"), "must start with '/'"));
            }
        }
        if let Some(pods) = &self.pods {
            let mut seen = HashSet::new();
            for (j, pod) in pods.iter().enumerate() {
                let pf = format!("{f}.pods[{j}]");
                let addr: SocketAddr = pod.address.parse().map_err(|_| {
                    field(
                        format!("{pf}.address"),
                        format!(
                            "{:?} is not ip:port (use dns discovery for names)",
                            pod.address
                        ),
                    )
                })?;
                // What the filter's snapshot refuses: Envoy would find no such host.
                let zone = matches!(addr, SocketAddr::V6(a) if a.scope_id() != 0);
                if addr.port() == 0 || zone {
                    return Err(field(
                        format!("{pf}.address"),
                        format!("{:?}: port 0 or an IPv6 zone id", pod.address),
                    ));
                }
                if !seen.insert(addr) {
                    return Err(field(
                        format!("{pf}.address"),
                        format!("duplicate pod {addr}"),
                    ));
                }
                if let Some(u) = &pod.metrics_url {
                    check_url(&format!("{pf}.metrics_url"), u, &["http", "https"])?;
                }
                if let Some(c) = pod.capacity {
                    if !(c.is_finite() && c > 0.0 && c <= 1_000.0) {
                        return Err(field(format!("{pf}.capacity"), "must be in (0, 1000]"));
                    }
                }
            }
        }
        if let Some(d) = &self.dns {
            if d.name.trim().is_empty() {
                return Err(field(format!("{f}.dns.name"), "must not be empty"));
            }
            if d.port == 0 {
                return Err(field(format!("{f}.dns.port"), "must be positive"));
            }
            if d.refresh_ms < 100 {
                return Err(field(format!("{f}.dns.refresh_ms"), "must be at least 100"));
            }
        }
        if let Some(k) = &self.kubernetes {
            let kf = format!("{f}.kubernetes");
            if k.namespace.is_empty() {
                return Err(field(format!("{kf}.namespace"), "must not be empty"));
            }
            match (&k.selector, &k.inference_pool) {
                (Some(s), None) => {
                    if s.trim().is_empty() {
                        return Err(field(format!("{kf}.selector"), "must not be empty"));
                    }
                    if k.port.is_none_or(|p| p == 0) {
                        return Err(field(
                            format!("{kf}.port"),
                            "required with selector (the pods' serving port)",
                        ));
                    }
                }
                (None, Some(name)) => {
                    if name.is_empty() {
                        return Err(field(format!("{kf}.inference_pool"), "must not be empty"));
                    }
                }
                _ => {
                    return Err(field(
                        kf,
                        "needs exactly one of selector (with port) or inference_pool",
                    ))
                }
            }
        }
        Ok(())
    }

    /// Path of the metrics endpoint for pods of this pool that do not set `metrics_url`.
    /// Whether any pod's metrics URL is `https://`.
    pub fn scrapes_https(&self) -> bool {
        let https = |u: &String| url::Url::parse(u).is_ok_and(|u| u.scheme() == "https");
        self.metrics_scheme == MetricsScheme::Https
            || self
                .pods
                .iter()
                .flatten()
                .any(|p| p.metrics_url.as_ref().is_some_and(https))
    }

    /// The metrics URL of a discovered pod at `address`.
    pub fn metrics_url_for(&self, address: SocketAddr, engine: Option<Engine>) -> String {
        let scheme = match self.metrics_scheme {
            MetricsScheme::Http => "http",
            MetricsScheme::Https => "https",
        };
        format!("{scheme}://{address}{}", self.metrics_path_for(engine))
    }

    pub fn metrics_path_for(&self, engine: Option<Engine>) -> String {
        match (&self.metrics_path, engine.or(self.engine)) {
            (Some(p), _) => p.clone(),
            // trtllm-serve answers JSON on /metrics; Prometheus text is under /prometheus.
            (None, Some(Engine::Trtllm)) => "/prometheus/metrics".to_string(),
            _ => "/metrics".to_string(),
        }
    }
}

fn check_http_url(f: &str, u: &str) -> Result<(), ConfigError> {
    check_url(f, u, &["http"])
}

/// `u` is a URL of one of `schemes`, with a host.
fn check_url(f: &str, u: &str, schemes: &[&str]) -> Result<(), ConfigError> {
    let url = url::Url::parse(u).map_err(|e| field(f, format!("{u:?}: {e}")))?;
    if !schemes.contains(&url.scheme()) {
        let why = match schemes {
            ["https"] => "only https:// (with prefix.tls the peers speak TLS)",
            ["http"] => {
                "only http:// is supported (the ingest listeners are plain HTTP, and the peers \
                 without prefix.tls)"
            }
            _ => "only http:// and https:// are supported",
        };
        return Err(field(f, format!("{u:?}: {why}")));
    }
    if url.host().is_none() {
        return Err(field(f, format!("{u:?}: no host")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        let mut c = Config::from_str_named(text, Path::new("test.yaml"))?;
        c.resolve_token()?;
        c.validate()?;
        Ok(c)
    }

    const MINIMAL: &str = r#"
interval_ms: 100
listen: 127.0.0.1:9100
push: { urls: ["http://127.0.0.1:9002/gpuroute/v1/snapshot"], token: dev-token }
pools:
  - name: llama-8b
    pods: [{ address: 127.0.0.1:18001 }, { address: 127.0.0.1:18002, capacity: 3 }]
"#;

    #[test]
    fn minimal_yaml_from_the_issue() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.interval_ms, 100);
        assert_eq!(c.timeout_ms, DEFAULT_TIMEOUT_MS);
        assert_eq!(c.push.token.as_deref(), Some("dev-token"));
        let pods = c.pools[0].pods.as_ref().unwrap();
        assert_eq!(pods[1].capacity, Some(3.0));
        assert_eq!(c.publish_deadline_ms(), 50);
    }

    #[test]
    fn json_works_too() {
        let c = parse(
            r#"{"push":{"token":"t"},"pools":[{"name":"p","engine":"sglang",
                "pods":[{"address":"[::1]:30000"}]}]}"#,
        )
        .unwrap();
        assert_eq!(c.pools[0].engine, Some(Engine::Sglang));
        assert_eq!(c.push.urls, vec![DEFAULT_INGEST_URL.to_string()]);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (MINIMAL.replace("capacity: 3", "capacity: fast"), "pools[0].pods[1].capacity"),
            (MINIMAL.replace("capacity: 3", "capacity: 0"), "pools[0].pods[1].capacity"),
            (MINIMAL.replace("127.0.0.1:18001", "pod-a"), "pools[0].pods[0].address"),
            (MINIMAL.replace("127.0.0.1:18002", "127.0.0.1:18001"), "duplicate pod"),
            (MINIMAL.replace("127.0.0.1:18001", "127.0.0.1:0"), "pools[0].pods[0].address"),
            (MINIMAL.replace("127.0.0.1:18001", "\"[fe80::1%2]:8000\""), "pools[0].pods[0].address"),
            (MINIMAL.replace("interval_ms: 100", "interval_ms: 1"), "interval_ms"),
            (MINIMAL.replace("interval_ms: 100", "interval_ms: 100\nintervl: 3"), "intervl"),
            (MINIMAL.replace("listen: 127.0.0.1:9100", "listen: nowhere"), "listen"),
            (MINIMAL.replace(", token: dev-token", ""), "push.token"),
            (MINIMAL.replace("token: dev-token", "token: \"dev\\ntoken\""), "push.token"),
            (MINIMAL.replace("token: dev-token", "token: \"dev token\""), "push.token"),
            (MINIMAL.replace("http://127.0.0.1:9002", "https://127.0.0.1:9002"), "push.urls[0]"),
            (MINIMAL.replace("address: 127.0.0.1:18001 }", "address: 127.0.0.1:18001, engine: vllx }"),
                "pools[0].pods[0].engine"),
            (MINIMAL.replace("name: llama-8b", "name: ''"), "pools[0].name"),
            (MINIMAL.replace("    pods:", "    dns: { name: x, port: 1 }\n    pods:"), "exactly one of pods"),
            ("pools: []\npush: {token: t}".to_string(), "pools"),
            ("pools: [{name: a, kubernetes: {selector: app=vllm}}]\npush: {token: t}".to_string(),
                "pools[0].kubernetes.port"),
            ("pools: [{name: a, kubernetes: {selector: x, port: 1, inference_pool: y}}]\npush: {token: t}".to_string(),
                "pools[0].kubernetes"),
            ("pools: [{name: a, dns: {name: svc, port: 0}}]\npush: {token: t}".to_string(), "pools[0].dns.port"),
            ("health: {max_data_age_ms: 10}\npools: [{name: a, pods: []}]\npush: {token: t}".to_string(),
                "health.max_data_age_ms"),
            ("interval_ms: [1".to_string(), "not valid YAML"),
        ];
        for (text, needle) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }

    #[test]
    fn the_load_relay_defaults_and_limits() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.prefix.load_interval_ms, 5);
        assert_eq!(c.prefix.load_path, "/gpuroute/v1/load");
        assert_eq!(c.prefix.load_keepalive_ms, 20);
        assert_eq!(c.prefix.load_idle_interval_ms, 20);
        let with = |prefix: &str| MINIMAL.replace("pools:", &format!("prefix: {prefix}\npools:"));
        let c = parse(&with("{load_interval_ms: 0, load_path: /lp}")).unwrap();
        assert_eq!(
            (c.prefix.load_interval_ms, c.prefix.load_path.as_str()),
            (0, "/lp")
        );
        // A slower interval alone is valid: an idle interval below it is taken as it.
        assert_eq!(
            parse(&with("{load_interval_ms: 1000}"))
                .unwrap()
                .prefix
                .load_interval_ms,
            1000
        );
        assert_eq!(
            parse(&with("{load_interval_ms: 1}"))
                .unwrap()
                .prefix
                .load_interval_ms,
            1
        );
        let c = parse(&with(
            "{load_interval_ms: 7, load_keepalive_ms: 10000, load_idle_interval_ms: 7}",
        ))
        .unwrap();
        assert_eq!(
            (c.prefix.load_keepalive_ms, c.prefix.load_idle_interval_ms),
            (10000, 7)
        );
        let c = parse(&with("{load_keepalive_ms: 1, load_idle_interval_ms: 1000}")).unwrap();
        assert_eq!(
            (c.prefix.load_keepalive_ms, c.prefix.load_idle_interval_ms),
            (1, 1000)
        );
        // The relay off: the idle interval need not follow it.
        let c = parse(&with("{load_interval_ms: 0, load_idle_interval_ms: 1}")).unwrap();
        assert_eq!(c.prefix.load_idle_interval_ms, 1);
        for (prefix, needle) in [
            (
                "{load_interval_ms: 1001}",
                "prefix.load_interval_ms: must be 0 (off) or between 1 and 1000",
            ),
            ("{load_interval_ms: -1}", "prefix.load_interval_ms"),
            (
                "{load_path: gpuroute/v1/load}",
                "prefix.load_path: must start with '/'",
            ),
            ("{load_path: ''}", "prefix.load_path"),
            (
                "{load_keepalive_ms: 0}",
                "prefix.load_keepalive_ms: must be between 1 and 10000",
            ),
            ("{load_keepalive_ms: 10001}", "prefix.load_keepalive_ms"),
            (
                "{load_idle_interval_ms: 0}",
                "prefix.load_idle_interval_ms: must be between 1 and 1000",
            ),
            (
                "{load_idle_interval_ms: 1001}",
                "prefix.load_idle_interval_ms",
            ),
        ] {
            let err = parse(&with(prefix)).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }

    #[test]
    fn the_source_name_is_the_configured_one_first() {
        let mut c = Config {
            source: Some("gw-a".into()),
            ..Config::default()
        };
        assert_eq!(c.source_name(), "gw-a");
        c.source = None;
        let want = std::env::var("HOSTNAME").unwrap_or_else(|_| "sidecar-metrics".into());
        assert_eq!(c.source_name(), want);
    }

    #[test]
    fn overrides_win_over_the_file() {
        let mut c = Config::from_str_named(MINIMAL, Path::new("t")).unwrap();
        c.apply(Overrides {
            interval_ms: Some(50),
            listen: Some("127.0.0.1:0".into()),
            ingest_urls: vec!["http://127.0.0.1:1/x".into(), "http://127.0.0.1:2/x".into()],
            token: Some("cli".into()),
            pools: vec![
                "llama-8b=127.0.0.1:1,127.0.0.1:2,127.0.0.1:3".into(),
                "new=127.0.0.1:9".into(),
            ],
            ..Overrides::default()
        })
        .unwrap();
        c.validate().unwrap();
        assert_eq!(c.interval_ms, 50);
        assert_eq!(c.listen, "127.0.0.1:0");
        assert_eq!(c.push.urls.len(), 2);
        assert_eq!(c.push.token.as_deref(), Some("cli"));
        assert_eq!(c.pools.len(), 2);
        assert_eq!(c.pools[0].pods.as_ref().unwrap().len(), 3);
        assert_eq!(c.pools[1].name, "new");
        let bad = c.apply(Overrides {
            pools: vec!["no-equals".into()],
            ..Overrides::default()
        });
        assert!(bad.unwrap_err().to_string().contains("--pool"));
    }

    #[test]
    fn token_file_is_read_and_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "s3cret\n").unwrap();
        let text = format!(
            "push: {{ token_file: {} }}\npools: [{{name: a, pods: [{{address: '127.0.0.1:1'}}]}}]",
            path.display()
        );
        assert_eq!(parse(&text).unwrap().push.token.as_deref(), Some("s3cret"));
    }

    #[test]
    fn metrics_path_defaults_per_engine() {
        let mut p = PoolConfig {
            name: "p".into(),
            engine: None,
            metrics_path: None,
            metrics_scheme: Default::default(),
            pods: Some(vec![]),
            dns: None,
            kubernetes: None,
        };
        assert_eq!(p.metrics_path_for(None), "/metrics");
        assert_eq!(
            p.metrics_path_for(Some(Engine::Trtllm)),
            "/prometheus/metrics"
        );
        p.metrics_path = Some("/m".into());
        assert_eq!(p.metrics_path_for(Some(Engine::Trtllm)), "/m");
    }

    #[test]
    fn pods_serving_https_are_scraped_with_scrape_tls() {
        let ca = format!("{}/../testdata/tls/ca.pem", env!("CARGO_MANIFEST_DIR"));
        let text = format!(
            r#"
scrape_tls: {{ ca_file: {ca}, server_name: pod.test }}
pools:
  - name: a
    metrics_scheme: https
    pods:
      - {{ address: 10.0.0.1:8000 }}
  - name: b
    pods:
      - {{ address: 10.0.0.2:8000, metrics_url: 'https://10.0.0.2:8443/metrics' }}
      - {{ address: 10.0.0.3:8000 }}
push: {{ token: t }}
"#
        );
        let c = parse(&text).unwrap();
        let a: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert_eq!(
            c.pools[0].metrics_url_for(a, None),
            "https://10.0.0.1:8000/metrics"
        );
        assert_eq!(
            c.pools[1].metrics_url_for(a, None),
            "http://10.0.0.1:8000/metrics"
        );
        assert!(c.pools[0].scrapes_https() && c.pools[1].scrapes_https());
        let t = c.scrape_client_tls().unwrap().unwrap();
        assert_eq!(t.server_name.unwrap().to_str(), "pod.test");
        // Nothing over HTTPS and no scrape_tls: no TLS at all (no certificate store read).
        assert!(parse(MINIMAL)
            .unwrap()
            .scrape_client_tls()
            .unwrap()
            .is_none());
        // A file that is not there stops the start, naming the field.
        let missing = text.replace("ca.pem", "no-such.pem");
        let err = parse(&missing).unwrap_err().to_string();
        assert!(
            err.contains("scrape_tls.ca_file") && err.contains("no-such.pem"),
            "{err}"
        );
        // The ingest listeners and the peers stay plain HTTP.
        let err = parse(&MINIMAL.replace("http://127.0.0.1:9002", "https://127.0.0.1:9002"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("only http:// is supported"), "{err}");
        let err = parse(&text.replace("'https://10.0.0.2", "'ftp://10.0.0.2"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("pools[1].pods[0].metrics_url"), "{err}");
        let err = parse(&text.replace("metrics_scheme: https", "metrics_scheme: tls"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("metrics_scheme"), "{err}");
    }

    #[test]
    fn the_peers_tls_needs_its_listener_its_three_files_and_https_peers() {
        let dir = format!("{}/../testdata/tls", env!("CARGO_MANIFEST_DIR"));
        let with = |prefix: &str| {
            parse(&format!(
                "pools: [{{name: a, pods: [{{address: 127.0.0.1:1}}]}}]\npush: {{token: t}}\nprefix: {prefix}\n"
            ))
        };
        let files = |key: &str| {
            format!("{{ca_file: {dir}/ca.pem, cert_file: {dir}/peer.pem, key_file: {dir}/{key}}}")
        };
        let tls = files("peer.key");
        let https = "peers: ['https://10.0.0.2:9101']";
        let good = with(&format!("{{listen: '127.0.0.1:0', {https}, tls: {tls}}}")).unwrap();
        assert!(good.prefix.tls_set());
        let err = |prefix: String| with(&prefix).unwrap_err().to_string();
        let e = err(format!("{{{https}, tls: {tls}}}"));
        assert!(e.contains("prefix.listen"), "{e}");
        let e = err(format!(
            "{{listen: '127.0.0.1:0', peers: ['http://10.0.0.2:9101'], tls: {tls}}}"
        ));
        assert!(
            e.contains("prefix.peers[0]") && e.contains("only https://"),
            "{e}"
        );
        let e = err(format!("{{{https}}}"));
        assert!(
            e.contains("prefix.peers[0]") && e.contains("only http://"),
            "{e}"
        );
        let no_ca = format!("{{cert_file: {dir}/peer.pem, key_file: {dir}/peer.key}}");
        let e = err(format!("{{listen: '127.0.0.1:0', {https}, tls: {no_ca}}}"));
        assert!(
            e.contains("prefix.tls.ca_file") && e.contains("required"),
            "{e}"
        );
        // Another certificate's key.
        let e = err(format!(
            "{{listen: '127.0.0.1:0', {https}, tls: {}}}",
            files("pod.key")
        ));
        assert!(e.contains("prefix.tls.key_file"), "{e}");
    }
}
