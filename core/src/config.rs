//! The filter's configuration (the JSON in Envoy's `PluginConfig.configuration`), its defaults
//! and their reasons, and validation that names the offending field.
//!
//! Every option and default here is documented in the README's configuration reference;
//! `core/tests/config_reference.rs` fails when the two part.

use serde::Deserialize;
use std::collections::{BTreeMap, HashMap, HashSet};
use thiserror::Error;

/// Top-level filter configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// Model pools: which models, aliases and LoRA adapters each serves.
    pub pools: Vec<PoolConfig>,
    /// Paths whose bodies are parsed and routed. Other paths pass through untouched.
    #[serde(default = "default_inference_paths")]
    pub inference_paths: Vec<String>,
    /// Path answered by the filter with the OpenAI model list; empty string disables it.
    #[serde(default = "default_models_path")]
    pub models_path: String,
    /// Largest request body the filter buffers (bytes); larger bodies get 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
    /// Pool for requests without a `model`; without it they get 400.
    #[serde(default)]
    pub default_pool: Option<String>,
    #[serde(default)]
    pub scoring: ScoringConfig,
    #[serde(default)]
    pub prefix: PrefixConfig,
    /// Stored responses (Responses API ids) each worker remembers the pod of, apart from the
    /// prefix index: two generations of half this size, so an id is kept at least this many
    /// halved newer responses after it was last learned or continued.
    #[serde(default = "default_response_entries")]
    pub response_entries: usize,
    /// Snapshot ingest endpoint; absent = this plugin instance accepts no snapshots.
    #[serde(default)]
    pub ingest: Option<IngestConfig>,
    /// How the chosen pod reaches Envoy's load balancer.
    #[serde(default)]
    pub data_plane: DataPlane,
    /// Extra endpoints after the best one in the destination header, for retries.
    #[serde(default = "default_fallbacks")]
    pub fallback_endpoints: usize,
    /// Add `x-gateway-debug` to responses: chosen pod and every candidate's score breakdown.
    #[serde(default)]
    pub debug_header: bool,
    /// The most pods that get a picks counter of their own (`gpuroute.pool.<pool>.pod.<ip:port>.
    /// picks`) in one Envoy, across its workers and configurations; picks of pods past it are
    /// counted as pod `other` ([`crate::fleet::PodStatSet`]). Envoy never removes a stat,
    /// so without a bound a fleet whose pods come and go would add a series per pod for as long
    /// as Envoy runs. `0`: no picks counted by pod (no `other` either).
    #[serde(default = "default_max_pod_stats")]
    pub max_pod_stats: usize,
    /// Reject requests with `x-gateway-priority` below zero with 429 when every pod of their
    /// pool is saturated.
    #[serde(default = "yes")]
    pub shed_sheddable: bool,
    /// Hold requests at the gateway while every pod of their pool is saturated, and send each
    /// when a pod has room. Absent: off (a request goes to the least saturated pod at once, to
    /// wait in its queue).
    #[serde(default)]
    pub hold: Option<HoldConfig>,
    /// Passive health: a pod that answers server errors in a row leaves the picks for a while
    /// ([`crate::outlier`]).
    #[serde(default)]
    pub outlier_detection: OutlierConfig,
    /// Pick endpoints. `false` keeps body-based routing to the pool (headers, errors,
    /// `/v1/models`) and leaves the pod to Envoy's load balancer: a baseline for benchmarks, or
    /// a first rollout step.
    #[serde(default = "yes")]
    pub pick_endpoints: bool,
    /// Period of the root context's tick (prefix-index sync between workers), ms. The dynamic
    /// module hands its batched metrics to Envoy at this period.
    #[serde(default = "default_tick_ms")]
    pub tick_ms: u64,
    /// The longest tick period of a proxy-wasm worker with nothing to exchange (ms): after
    /// `IDLE_TICKS` ticks in which it routed nothing and finished nothing, its tick period
    /// doubles, up to this; its next routed request restores `tick_ms` and does the tick's
    /// exchange first. At or under `tick_ms` (`0` included): always `tick_ms`.
    #[serde(default = "default_idle_tick_ms")]
    pub idle_tick_ms: u64,
    /// How often, at most, a proxy-wasm worker exchanges state with the others on the request
    /// path (ms): it re-reads the snapshot version and the other workers' in-flight tables, and
    /// publishes its own. The tick does the same for an idle worker.
    #[serde(default = "default_shared_refresh_ms")]
    pub shared_refresh_ms: u64,
    /// The most other workers' in-flight tables a proxy-wasm worker reads in one exchange on the
    /// request path. With more other workers it reads this many in turn (each one every
    /// `ceil(others / shared_peer_reads)` exchanges) and sums the latest it read of each; its
    /// tick reads those the exchanges did not reach since the tick before (`workers::Turn`).
    /// Bounds the exchange's host calls however many workers Envoy runs.
    #[serde(default = "default_shared_peer_reads")]
    pub shared_peer_reads: usize,
    /// Weighted traffic splits: a public model name whose requests go to several served names
    /// (models, aliases or adapters, in any pools) in proportion to their weights, the body's
    /// `model` rewritten to the one chosen. A conversation (or a prompt) always gets the same
    /// target, on every worker and gateway replica, so its turns stay on one version and its
    /// KV cache; the weights divide conversations, not requests. For canary rollouts of a new
    /// model or adapter version, and A/B tests.
    #[serde(default, deserialize_with = "unique_keys")]
    pub splits: BTreeMap<String, Vec<SplitTarget>>,
}

/// One target of a traffic split.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitTarget {
    /// A served name: a model, alias or adapter of some pool (not another split).
    pub model: String,
    /// Relative share of conversations; 0 drains the target (it gets nothing new).
    pub weight: u32,
}

/// The largest weight of a split target (weights are shares; this leaves sums far from
/// overflow).
pub const MAX_SPLIT_WEIGHT: u32 = 1_000_000;

/// One model deployment.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Pool name; the snapshot's pool of the same name carries its pods, and the filter sets
    /// `x-gateway-pool` to it so an Envoy route selects the pool's cluster.
    pub name: String,
    /// Model names served by the pool's pods (the first is the base model for adapters).
    pub models: Vec<String>,
    /// Extra names clients may use, mapped to one of `models`. The body is rewritten to the
    /// target name, since the pods do not know the alias.
    #[serde(default, deserialize_with = "unique_keys")]
    pub aliases: BTreeMap<String, String>,
    /// LoRA adapters served on top of the pool's base model.
    #[serde(default)]
    pub adapters: Vec<String>,
    /// This pool's changes to the top-level `scoring` (a batch pool that wants `throughput`
    /// beside chat pools on `latency`, a pool whose metrics come slower).
    #[serde(default)]
    pub scoring: ScoringOverrides,
    /// Pools that take this pool's requests while the snapshot shows it without a healthy pod
    /// with fresh metrics: the first of them that has one (a standby pool in another zone or
    /// cluster). Their pods serve this pool's models and adapters under the same names; the
    /// request goes unchanged but for `x-gateway-pool`. Not followed further: a failover
    /// pool's own `failover` applies to requests for its own models only.
    #[serde(default)]
    pub failover: Vec<String>,
    /// Also hand requests to the failover pools while every pod of this pool that could take
    /// one is saturated as the pick counts it (`scoring.queue_threshold`, `kv_threshold`, by the
    /// snapshot and what the gateway sent since): to the first of them whose snapshot shows a
    /// pod that is not (a burst pool, on-demand capacity).
    #[serde(default)]
    pub overflow: bool,
}

/// Per-pool changes to [`ScoringConfig`]: each field given replaces the top-level one; `weights`
/// merge weight by weight over the top-level overrides.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoringOverrides {
    pub preset: Option<Preset>,
    pub weights: WeightOverrides,
    pub stale_after_ms: Option<u64>,
    pub queue_threshold: Option<f64>,
    pub lora_queue_threshold: Option<f64>,
    pub kv_threshold: Option<f64>,
    pub queue_horizon: Option<f64>,
    pub running_scale: Option<f64>,
    pub prefix_home_score: Option<f64>,
    pub prefix_home_reuse: Option<f64>,
    pub pending_cost: Option<f64>,
}

/// Which of the published weight sets to start from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Preset {
    /// Minimise time to first token: queue and load dominate, cache affinity helps.
    #[default]
    Latency,
    /// Maximise reuse (prefix cache, resident adapters), accepting some queueing.
    Throughput,
}

/// Scorer weights; each scorer returns 0..1 and the pick maximises the weighted mean.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Weights {
    pub queue: f64,
    pub kv_cache: f64,
    pub running: f64,
    pub lora: f64,
    pub prefix: f64,
}

/// Partial override of a preset's weights.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WeightOverrides {
    pub queue: Option<f64>,
    pub kv_cache: Option<f64>,
    pub running: Option<f64>,
    pub lora: Option<f64>,
    pub prefix: Option<f64>,
}

impl Preset {
    /// The published default weights. Reasons in the README ("Default weights").
    pub fn weights(self) -> Weights {
        match self {
            Preset::Latency => Weights {
                queue: 3.0,
                kv_cache: 1.0,
                running: 0.5,
                lora: 3.0,
                prefix: 3.0,
            },
            Preset::Throughput => Weights {
                queue: 1.5,
                kv_cache: 1.0,
                running: 0.25,
                lora: 4.0,
                prefix: 4.0,
            },
        }
    }
}

/// Endpoint-picking parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScoringConfig {
    pub preset: Preset,
    pub weights: WeightOverrides,
    /// A pod whose last good scrape is older than this is not a candidate.
    pub stale_after_ms: u64,
    /// Queue length (per unit of capacity) at which a pod counts as saturated.
    pub queue_threshold: f64,
    /// Queue length (per unit of capacity) under which an adapter request keeps to a pod that
    /// holds its adapter (runs it, or is its home with a free slot), saturated or not. Apart
    /// from `queue_threshold` so that a low one (what `hold` wants) does not send adapter
    /// requests to pods that must load their adapter.
    pub lora_queue_threshold: f64,
    /// KV-cache use at which a pod counts as saturated.
    pub kv_threshold: f64,
    /// Extra expected wait over the best candidate, in average requests of prefill on a
    /// capacity-1 pod, at which the queue score reaches 0. The score falls linearly with the
    /// extra wait, so it separates pods in proportion to the time a request would lose on each
    /// (a long prompt on a slow pod loses far more than a short one).
    pub queue_horizon: f64,
    /// Running requests (per unit of capacity) at which the running score halves.
    pub running_scale: f64,
    /// Prefix score given to the rendezvous-hash home of a prompt no pod is known to hold.
    pub prefix_home_score: f64,
    /// Share of the pool's recent requests whose prompt (or conversation) was found on a pod, at
    /// and above which a new prompt's home gets all of `prefix_home_score`; below it, in
    /// proportion, none when no prompt is found again ([`crate::engine::home_fade`]). 0: all of
    /// it always.
    pub prefix_home_reuse: f64,
    /// What a request's prefill costs the requests already waiting for their first token on a
    /// pod, per waiting request, as a share of its own prefill time: an engine that batches the
    /// waiting prefills into one step (vLLM's chunked prefill) gives every one of them its first
    /// token only when the whole step is done.
    pub pending_cost: f64,
}

impl Default for ScoringConfig {
    fn default() -> Self {
        ScoringConfig {
            preset: Preset::Latency,
            weights: WeightOverrides::default(),
            stale_after_ms: 1_000,
            queue_threshold: 5.0,
            lora_queue_threshold: 5.0,
            kv_threshold: 0.8,
            queue_horizon: 4.0,
            running_scale: 32.0,
            prefix_home_score: 0.3,
            prefix_home_reuse: 0.25,
            pending_cost: 1.0,
        }
    }
}

impl ScoringConfig {
    /// This configuration with a pool's changes applied ([`ScoringOverrides`]).
    pub fn with(&self, o: &ScoringOverrides) -> ScoringConfig {
        let w = self.weights;
        let ow = o.weights;
        ScoringConfig {
            preset: o.preset.unwrap_or(self.preset),
            weights: WeightOverrides {
                queue: ow.queue.or(w.queue),
                kv_cache: ow.kv_cache.or(w.kv_cache),
                running: ow.running.or(w.running),
                lora: ow.lora.or(w.lora),
                prefix: ow.prefix.or(w.prefix),
            },
            stale_after_ms: o.stale_after_ms.unwrap_or(self.stale_after_ms),
            queue_threshold: o.queue_threshold.unwrap_or(self.queue_threshold),
            lora_queue_threshold: o.lora_queue_threshold.unwrap_or(self.lora_queue_threshold),
            kv_threshold: o.kv_threshold.unwrap_or(self.kv_threshold),
            queue_horizon: o.queue_horizon.unwrap_or(self.queue_horizon),
            running_scale: o.running_scale.unwrap_or(self.running_scale),
            prefix_home_score: o.prefix_home_score.unwrap_or(self.prefix_home_score),
            prefix_home_reuse: o.prefix_home_reuse.unwrap_or(self.prefix_home_reuse),
            pending_cost: o.pending_cost.unwrap_or(self.pending_cost),
        }
    }

    /// Checks the values; errors name the field under `at` (`scoring`, `pools[i].scoring`).
    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        let w = self.effective_weights();
        let ws = [w.queue, w.kv_cache, w.running, w.lora, w.prefix];
        if ws.iter().any(|x| !x.is_finite() || *x < 0.0) {
            return Err(cfg_err(
                format!("{at}.weights"),
                "weights must be finite and >= 0",
            ));
        }
        if ws.iter().sum::<f64>() <= 0.0 {
            return Err(cfg_err(
                format!("{at}.weights"),
                "at least one weight must be positive",
            ));
        }
        for (name, v) in [
            ("queue_threshold", self.queue_threshold),
            ("lora_queue_threshold", self.lora_queue_threshold),
            ("queue_horizon", self.queue_horizon),
            ("running_scale", self.running_scale),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(cfg_err(format!("{at}.{name}"), "must be > 0"));
            }
        }
        let kv = self.kv_threshold;
        if !(kv.is_finite() && kv > 0.0 && kv <= 1.0) {
            return Err(cfg_err(format!("{at}.kv_threshold"), "must be in (0, 1]"));
        }
        let home = self.prefix_home_score;
        if !(home.is_finite() && (0.0..=1.0).contains(&home)) {
            return Err(cfg_err(
                format!("{at}.prefix_home_score"),
                "must be in [0, 1]",
            ));
        }
        let reuse = self.prefix_home_reuse;
        if !(reuse.is_finite() && (0.0..=1.0).contains(&reuse)) {
            return Err(cfg_err(
                format!("{at}.prefix_home_reuse"),
                "must be in [0, 1]",
            ));
        }
        let pc = self.pending_cost;
        if !(pc.is_finite() && (0.0..=4.0).contains(&pc)) {
            return Err(cfg_err(format!("{at}.pending_cost"), "must be in [0, 4]"));
        }
        if self.stale_after_ms == 0 {
            return Err(cfg_err(format!("{at}.stale_after_ms"), "must be > 0"));
        }
        Ok(())
    }

    /// The preset's weights with the overrides applied.
    pub fn effective_weights(&self) -> Weights {
        let mut w = self.preset.weights();
        let o = self.weights;
        w.queue = o.queue.unwrap_or(w.queue);
        w.kv_cache = o.kv_cache.unwrap_or(w.kv_cache);
        w.running = o.running.unwrap_or(w.running);
        w.lora = o.lora.unwrap_or(w.lora);
        w.prefix = o.prefix.unwrap_or(w.prefix);
        w
    }
}

/// Prefix-affinity parameters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixConfig {
    /// Characters per prefix block: 16 tokens x ~4 characters, the KV-cache block of vLLM
    /// (block_size 16), so one hashed block is about one cached block.
    pub block_chars: usize,
    /// Leading blocks considered (256 x 64 = 16 KiB of prompt): beyond that, two prompts that
    /// agree are already on the same pod for all practical purposes.
    pub max_blocks: usize,
    /// Entries in each worker's learned prefix index (two generations of half this size).
    pub index_entries: usize,
    /// Leading blocks whose hash picks a new prompt's rendezvous home (16 x 64 = 1 KiB): deep
    /// enough to get past a typical system prompt's opening, shallow enough that the turns of
    /// one conversation share it.
    pub home_blocks: usize,
}

impl PrefixConfig {
    /// Tokens per prefix block (about 4 characters a token): what a matched depth saves.
    pub fn block_tokens(&self) -> u32 {
        u32::try_from(self.block_chars / 4).unwrap_or(u32::MAX)
    }
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            block_chars: 64,
            max_blocks: 256,
            index_entries: 131_072,
            home_blocks: 16,
        }
    }
}

/// Holding requests while their pool is saturated (`hold`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HoldConfig {
    /// The longest a request is held (ms); then it goes to the best saturated pod, as it would
    /// have without holding.
    #[serde(default = "default_hold_max_wait_ms")]
    pub max_wait_ms: u64,
    /// The most requests one Envoy worker holds at once; the next ones go to a saturated pod
    /// at once.
    #[serde(default = "default_hold_max_held")]
    pub max_held: usize,
    /// Which held request goes first when a pod has room, among those of the same
    /// `x-gateway-priority`.
    #[serde(default)]
    pub order: HoldOrder,
    /// How long a request may wait for the pod that caches its prompt or adapter (ms) while that
    /// pod is saturated and others are not; 0: it goes to another pod at once, as without `hold`.
    /// Read through [`HoldConfig::affinity_wait`].
    #[serde(default = "default_hold_affinity_wait_ms")]
    pub affinity_wait_ms: u64,
}

impl HoldConfig {
    /// `affinity_wait_ms`, at most `max_wait_ms` (the longest any request is held).
    pub fn affinity_wait(&self) -> u64 {
        self.affinity_wait_ms.min(self.max_wait_ms)
    }

    /// Whether a request held for `waited_ms` has waited out `max_wait_ms`: it goes to the best
    /// pod, saturated or not.
    pub fn expired(&self, waited_ms: u64) -> bool {
        waited_ms >= self.max_wait_ms
    }

    /// Whether a request held for `waited_ms` may still wait for the pod that caches its prompt
    /// or holds its adapter.
    pub fn may_await(&self, waited_ms: u64) -> bool {
        waited_ms < self.affinity_wait()
    }
}

/// The order of held requests of one priority (`hold.order`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HoldOrder {
    /// First come, first served.
    #[default]
    Arrival,
    /// The shortest prefill first: the prompt's estimated tokens less what the pod that caches
    /// most of it holds ([`crate::engine::Prepared::least_prefill`]). Short prefills do not wait
    /// behind long ones; a long one waits at most `max_wait_ms`.
    Shortest,
}

impl Default for HoldConfig {
    fn default() -> HoldConfig {
        HoldConfig {
            max_wait_ms: default_hold_max_wait_ms(),
            max_held: default_hold_max_held(),
            order: HoldOrder::Arrival,
            affinity_wait_ms: default_hold_affinity_wait_ms(),
        }
    }
}

fn default_hold_affinity_wait_ms() -> u64 {
    1_000
}

fn default_hold_max_wait_ms() -> u64 {
    2_000
}
fn default_hold_max_held() -> usize {
    256
}

/// Passive health (`outlier_detection`): which answers leave a pod out of the picks, and for how
/// long. Named and defaulted as Envoy's own outlier detection (`consecutive_5xx` 5, at most half
/// the pool out), which the filter cannot use: Envoy's `override_host` load balancer sends a
/// request to the host the filter names whether Envoy ejected that host or not.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutlierConfig {
    /// Answers in a row with status 500, 502, 503 or 504 that eject a pod; 0: never.
    #[serde(default = "default_consecutive_5xx")]
    pub consecutive_5xx: u32,
    /// How long a pod ejected for the first time in a row stays out (ms); the n-th time in a
    /// row, n times this, at most `max_ejection_ms`.
    #[serde(default = "default_base_ejection_ms")]
    pub base_ejection_ms: u64,
    #[serde(default = "default_max_ejection_ms")]
    pub max_ejection_ms: u64,
    /// The most of a pool's pods out at once, in percent of its pods in the snapshot (at least
    /// one pod).
    #[serde(default = "default_max_ejection_percent")]
    pub max_ejection_percent: u32,
    /// A request sent to a pod and still unanswered (no response headers) while two of the
    /// pod's scrapes taken at least this long after it was sent read the pod idle (nothing
    /// waiting, nothing running) counts in the pod's run as a server error does: the pod took
    /// it and does not serve it ([`crate::outlier::Unanswered`]). 0: never.
    #[serde(default = "default_unanswered_ms")]
    pub unanswered_ms: u64,
}

impl Default for OutlierConfig {
    fn default() -> OutlierConfig {
        OutlierConfig {
            consecutive_5xx: default_consecutive_5xx(),
            base_ejection_ms: default_base_ejection_ms(),
            max_ejection_ms: default_max_ejection_ms(),
            max_ejection_percent: default_max_ejection_percent(),
            unanswered_ms: default_unanswered_ms(),
        }
    }
}

fn default_consecutive_5xx() -> u32 {
    // Envoy's default: one failed request, or a client's retries of one poison prompt (the
    // OpenAI SDKs retry twice), does not eject a pod; a pod failing everything is out after
    // five requests.
    5
}
fn default_base_ejection_ms() -> u64 {
    // Long enough that a broken pod takes five requests per 10 s at most, short enough that a
    // pod that recovered (a restarted engine) is back soon; a pod still broken then is out
    // twice as long, and so on.
    10_000
}
fn default_max_ejection_ms() -> u64 {
    300_000
}
fn default_unanswered_ms() -> u64 {
    // Longer than a healthy pod keeps a request outside its engine, where its metrics do not
    // count it: vLLM tokenizes a prompt and fetches its media before the engine sees it (by
    // default up to 5 s for an image, 10 s for audio, 30 s for a video: VLLM_*_FETCH_TIMEOUT),
    // and its Responses API runs a built-in tool between two generations. A pod that takes
    // requests and never answers them is out about a minute after its first one; a fleet
    // serving text alone can set 10 s.
    60_000
}
fn default_max_ejection_percent() -> u32 {
    // A fault that fails every pod (a bad model rollout, a request pattern every engine
    // rejects with 500) must not take the whole pool out: the other half keeps serving, and
    // keeps answering with the errors the client needs to see.
    50
}

/// Snapshot ingest endpoint.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IngestConfig {
    /// Shared secret; the aggregator sends `Authorization: Bearer <token>`.
    pub token: String,
    #[serde(default = "default_ingest_path")]
    pub path: String,
    #[serde(default = "default_max_snapshot_bytes")]
    pub max_snapshot_bytes: usize,
    /// Accept snapshots only from a loopback peer address.
    #[serde(default = "yes")]
    pub loopback_only: bool,
    /// Path of the prefix-record exchange between gateway replicas (`exchange`): `GET` gives
    /// this Envoy's routing decisions, `POST` takes other replicas'; same token and peer rule
    /// as snapshots. `sidecar-metrics` relays between replicas. Empty turns it off.
    #[serde(default = "default_prefix_path")]
    pub prefix_path: String,
    /// Path of the in-flight exchange between gateway replicas ([`crate::replica_load`]):
    /// `GET` gives this Envoy's requests in prefill per pod, `POST` takes another replica's
    /// (with `x-gpuroute-replica` naming it); same token and peer rule as snapshots.
    /// `sidecar-metrics` relays between replicas every few milliseconds. Empty turns it off.
    #[serde(default = "default_load_path")]
    pub load_path: String,
    /// How long another replica's posted counts are counted: each post replaces the one before
    /// from the same replica, so a replica (or its relay) that stops posting drops out after
    /// this long.
    #[serde(default = "default_load_ttl_ms")]
    pub load_ttl_ms: u64,
}

/// How the chosen endpoint is handed to Envoy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DataPlane {
    /// A cluster of the pool's pods with the `override_host` load-balancing policy: a header
    /// naming a non-member is ignored and the fallback policy picks, so fail-open is free.
    #[default]
    OverrideHost,
    /// An `ORIGINAL_DST` cluster that connects wherever the header says (GIE-style data
    /// planes). Without a header it cannot route, so fail-open picks a pod itself.
    OriginalDst,
}

impl DataPlane {
    /// The destination header's value for a pick's `ip:port[,ip:port...]` list: an
    /// ORIGINAL_DST cluster parses the header as one address; the list form with retry
    /// fallbacks is for override_host.
    pub fn destination(self, list: &str) -> &str {
        match self {
            DataPlane::OriginalDst => list.split(',').next().unwrap_or(list),
            DataPlane::OverrideHost => list,
        }
    }
}

fn yes() -> bool {
    true
}
/// The default inference paths, one per line (`#` starts a comment). `envoy/render.py` reads
/// the same file for the routes it renders.
const DEFAULT_INFERENCE_PATHS: &str = include_str!("inference_paths.txt");

fn default_inference_paths() -> Vec<String> {
    DEFAULT_INFERENCE_PATHS
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(String::from)
        .collect()
}
fn default_models_path() -> String {
    "/v1/models".to_string()
}
/// 4 MiB: a 128k-token prompt is ~0.5 MB of text; 8x headroom for JSON escaping and
/// multi-part content, while one request cannot make Envoy hold tens of megabytes.
pub const DEFAULT_MAX_BODY_BYTES: usize = 4 * 1024 * 1024;
fn default_max_body_bytes() -> usize {
    DEFAULT_MAX_BODY_BYTES
}
fn default_response_entries() -> usize {
    // At least 131,072 newer responses (22 minutes at 100 responses/s across the gateways), at
    // up to ~11 MB per worker, spent only by gateways that serve Responses API turns.
    262_144
}
fn default_fallbacks() -> usize {
    2
}
/// The largest `max_pod_stats`: a million series per gateway is no bound in practice.
pub const MAX_POD_STATS: usize = 1 << 20;

fn default_max_pod_stats() -> usize {
    // Every pod of a 1,000-pod fleet through three full replacements (rollouts, autoscaling)
    // before pods share `other`: 4,096 series per gateway, a ~540 KB scrape, 1.5 MB (proxy-wasm)
    // to 3.5 MB (module) of Envoy's memory (scripts/pod_churn.py).
    4096
}

fn default_tick_ms() -> u64 {
    // Prefix-index sync between workers: well under a chat turn's think time, cheap to run.
    20
}
fn default_idle_tick_ms() -> u64 {
    // Four doublings of the default tick: Envoy dispatching 50 ticks a second into an idle VM
    // cost ~5 ms of CPU a second per worker, ~3 ticks a second a tenth of that.
    320
}
fn default_shared_refresh_ms() -> u64 {
    // Another worker's requests reach this one's view within ~2 ms under load: a small part of
    // a scrape interval (100 ms), while the exchange's host calls run once per millisecond
    // instead of once per request.
    1
}
fn default_shared_peer_reads() -> usize {
    // Up to five workers every table is read at every exchange; beyond, each is at most
    // ceil(others / 4) ms old under load (8 ms at 33 workers), still a small part of a scrape
    // interval, while an exchange costs at most four table reads (~10,000 instructions each).
    4
}
fn default_ingest_path() -> String {
    "/gpuroute/v1/snapshot".to_string()
}
fn default_prefix_path() -> String {
    "/gpuroute/v1/prefix".to_string()
}
fn default_load_path() -> String {
    "/gpuroute/v1/load".to_string()
}
fn default_load_ttl_ms() -> u64 {
    // Ten of the relay's 5 ms rounds: a late round or two on a loaded host does not drop a
    // replica's counts, and a replica that is gone stops counting well within a scrape interval.
    50
}
fn default_max_snapshot_bytes() -> usize {
    // MAX_PODS pods at ~400 bytes of JSON each, plus adapters.
    8 * 1024 * 1024
}

/// A configuration error, naming the field.
#[derive(Debug, Error, PartialEq)]
#[error("{field}: {reason}")]
pub struct ConfigError {
    pub field: String,
    pub reason: String,
}

/// A JSON object read into a map, refusing a key given twice: serde's maps keep the last value
/// without a word, so `{"a": "m1", "a": "m2"}` would serve `a` as `m2` while the operator reads
/// `m1` first. The configuration's structs refuse a field given twice already.
fn unique_keys<'de, D, V>(de: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: serde::Deserializer<'de>,
    V: Deserialize<'de>,
{
    struct Entries<V>(std::marker::PhantomData<V>);
    impl<'de, V: Deserialize<'de>> serde::de::Visitor<'de> for Entries<V> {
        type Value = BTreeMap<String, V>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some(key) = map.next_key::<String>()? {
                if out.contains_key(&key) {
                    return Err(serde::de::Error::custom(format!("{key:?} is given twice")));
                }
                let value = map.next_value()?;
                out.insert(key, value);
            }
            Ok(out)
        }
    }
    de.deserialize_map(Entries(std::marker::PhantomData))
}

/// A name the filter writes into a request header (`x-gateway-pool`, `x-gateway-model-name`):
/// no control characters, which Envoy refuses in a header value (every request of the pool
/// would get Envoy's 503 "invalid header value", while the stats counted them picked).
fn check_header_safe(field: impl FnOnce() -> String, name: &str) -> Result<(), ConfigError> {
    if name.chars().any(|c| c.is_ascii_control()) {
        return Err(cfg_err(
            field(),
            format!("{name:?} has a control character"),
        ));
    }
    Ok(())
}

/// An adapter name the pods' metrics can carry: vLLM's `vllm:lora_requests_info` lists the
/// running adapters joined by commas, and `sidecar-metrics` splits the list at commas and trims
/// each name (Unicode whitespace, as `str::trim`). A pod running `sql,v2` was published as
/// running `sql` and `v2`: requests for `sql,v2` went to pods that never ran it, and requests
/// for `sql` to the pod running `sql,v2` (an audit). Such names are refused.
fn check_adapter_name(field: impl FnOnce() -> String, name: &str) -> Result<(), ConfigError> {
    if name.contains(',') {
        return Err(cfg_err(
            field(),
            format!(
                "{name:?} has a comma: vLLM's lora_requests_info joins adapter names with commas"
            ),
        ));
    }
    if name.trim() != name {
        return Err(cfg_err(
            field(),
            format!("{name:?} starts or ends with whitespace, which the pods' metrics lose"),
        ));
    }
    Ok(())
}

/// Names that share a stat name would share their counters (`llama.8b` and `llama_8b` are
/// both `llama_8b` in Envoy's stats, [`crate::fleet::stat_segment`]): refused. `seen` maps
/// each stat name to the name that took it.
fn distinct_stat<'a>(
    seen: &mut HashMap<String, &'a str>,
    name: &'a str,
    field: impl FnOnce() -> String,
) -> Result<(), ConfigError> {
    match seen.insert(crate::fleet::stat_segment(name), name) {
        Some(other) if other != name => Err(cfg_err(
            field(),
            format!(
                "{name:?} and {other:?} have the same stat name {:?}: their counters would be one",
                crate::fleet::stat_segment(name)
            ),
        )),
        _ => Ok(()),
    }
}

fn cfg_err(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        reason: reason.into(),
    }
}

impl FilterConfig {
    /// Parses and validates the plugin configuration.
    pub fn from_json(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let de = &mut serde_json::Deserializer::from_slice(bytes);
        let cfg: FilterConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." {
                "configuration".to_string()
            } else {
                path
            };
            cfg_err(field, e.into_inner().to_string())
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let mut pool_names = HashSet::new();
        let mut pool_stats = HashMap::new();
        let mut names = HashSet::new();
        for (i, pool) in self.pools.iter().enumerate() {
            let f = format!("pools[{i}]");
            if pool.name.is_empty() {
                return Err(cfg_err(format!("{f}.name"), "must not be empty"));
            }
            check_header_safe(|| format!("{f}.name"), &pool.name)?;
            if !pool_names.insert(pool.name.as_str()) {
                return Err(cfg_err(
                    format!("{f}.name"),
                    format!("duplicate pool {:?}", pool.name),
                ));
            }
            distinct_stat(&mut pool_stats, &pool.name, || format!("{f}.name"))?;
            // A standby pool serves only as another pool's failover: no names of its own.
            let standby = self.pools.iter().any(|p| p.failover.contains(&pool.name));
            if pool.models.is_empty() && !standby {
                return Err(cfg_err(
                    format!("{f}.models"),
                    "needs at least one model (or to be named in another pool's failover)",
                ));
            }
            if pool.models.is_empty() && !pool.adapters.is_empty() {
                return Err(cfg_err(
                    format!("{f}.adapters"),
                    "a pool without models has no base model for adapters",
                ));
            }
            if pool.overflow && pool.failover.is_empty() {
                return Err(cfg_err(
                    format!("{f}.overflow"),
                    "needs failover pools to overflow to",
                ));
            }
            for (j, name) in pool.failover.iter().enumerate() {
                let at = format!("{f}.failover[{j}]");
                if name == &pool.name {
                    return Err(cfg_err(at, "a pool cannot be its own failover"));
                }
                if !self.pools.iter().any(|p| &p.name == name) {
                    return Err(cfg_err(at, format!("no pool named {name:?}")));
                }
                if pool.failover[..j].contains(name) {
                    return Err(cfg_err(at, format!("{name:?} is listed twice")));
                }
            }
            let all = pool
                .models
                .iter()
                .map(|m| ("models", m))
                .chain(pool.aliases.keys().map(|a| ("aliases", a)))
                .chain(pool.adapters.iter().map(|a| ("adapters", a)));
            for (kind, name) in all {
                if name.is_empty() {
                    return Err(cfg_err(format!("{f}.{kind}"), "empty name"));
                }
                check_header_safe(|| format!("{f}.{kind}"), name)?;
                if kind == "adapters" {
                    check_adapter_name(|| format!("{f}.{kind}"), name)?;
                }
                if !names.insert(name.as_str()) {
                    return Err(cfg_err(
                        format!("{f}.{kind}"),
                        format!("{name:?} is already served (names must be unique across models, aliases and adapters of all pools)"),
                    ));
                }
            }
            for (alias, target) in &pool.aliases {
                if !pool.models.contains(target) {
                    return Err(cfg_err(
                        format!("{f}.aliases.{alias}"),
                        format!("target {target:?} is not one of the pool's models"),
                    ));
                }
            }
        }
        self.validate_splits(&names)?;
        for (i, p) in self.inference_paths.iter().enumerate() {
            if !p.starts_with('/') {
                return Err(cfg_err(
                    format!("inference_paths[{i}]"),
                    "must start with '/'",
                ));
            }
        }
        self.validate_models_path()?;
        if let Some(h) = &self.hold {
            if !(1..=60_000).contains(&h.max_wait_ms) {
                return Err(cfg_err("hold.max_wait_ms", "must be between 1 and 60000"));
            }
            if !(1..=65_536).contains(&h.max_held) {
                return Err(cfg_err("hold.max_held", "must be between 1 and 65536"));
            }
            if h.affinity_wait_ms > 60_000 {
                return Err(cfg_err("hold.affinity_wait_ms", "must be at most 60000"));
            }
        }
        let o = &self.outlier_detection;
        if o.consecutive_5xx > 1_000 {
            return Err(cfg_err(
                "outlier_detection.consecutive_5xx",
                "must be at most 1000",
            ));
        }
        if !(1..=3_600_000).contains(&o.base_ejection_ms) {
            return Err(cfg_err(
                "outlier_detection.base_ejection_ms",
                "must be between 1 and 3600000",
            ));
        }
        if !(o.base_ejection_ms..=3_600_000).contains(&o.max_ejection_ms) {
            return Err(cfg_err(
                "outlier_detection.max_ejection_ms",
                "must be between base_ejection_ms and 3600000",
            ));
        }
        if o.max_ejection_percent > 100 {
            return Err(cfg_err(
                "outlier_detection.max_ejection_percent",
                "must be at most 100",
            ));
        }
        if o.unanswered_ms > 3_600_000 {
            return Err(cfg_err(
                "outlier_detection.unanswered_ms",
                "must be at most 3600000",
            ));
        }
        if !(1..=64 * 1024 * 1024).contains(&self.max_body_bytes) {
            return Err(cfg_err("max_body_bytes", "must be between 1 and 64 MiB"));
        }
        if let Some(d) = &self.default_pool {
            match self.pools.iter().find(|p| &p.name == d) {
                None => return Err(cfg_err("default_pool", format!("no pool named {d:?}"))),
                Some(p) if p.models.is_empty() => {
                    return Err(cfg_err(
                        "default_pool",
                        format!("pool {d:?} has no model to send requests without one as"),
                    ))
                }
                Some(_) => {}
            }
        }
        if self.fallback_endpoints > 16 {
            return Err(cfg_err("fallback_endpoints", "at most 16"));
        }
        self.scoring.validate("scoring")?;
        for i in 0..self.pools.len() {
            self.pool_scoring(i)
                .validate(&format!("pools[{i}].scoring"))?;
        }
        let p = &self.prefix;
        if !(8..=4096).contains(&p.block_chars) {
            return Err(cfg_err("prefix.block_chars", "must be between 8 and 4096"));
        }
        if !(1..=4096).contains(&p.max_blocks) {
            return Err(cfg_err("prefix.max_blocks", "must be between 1 and 4096"));
        }
        if !(1..=p.max_blocks).contains(&p.home_blocks) {
            return Err(cfg_err(
                "prefix.home_blocks",
                "must be between 1 and max_blocks",
            ));
        }
        if !(16..=16 * 1024 * 1024).contains(&p.index_entries) {
            return Err(cfg_err(
                "prefix.index_entries",
                "must be between 16 and 16M",
            ));
        }
        if !(16..=16 * 1024 * 1024).contains(&self.response_entries) {
            return Err(cfg_err("response_entries", "must be between 16 and 16M"));
        }
        // The same bound in both builds (usize is 32 bits in the proxy-wasm filter).
        if self.max_pod_stats > MAX_POD_STATS {
            return Err(cfg_err("max_pod_stats", "must be at most 1M (1048576)"));
        }
        if let Some(ing) = &self.ingest {
            if ing.token.len() < 8 {
                return Err(cfg_err("ingest.token", "must be at least 8 characters"));
            }
            if !ing.path.starts_with('/') {
                return Err(cfg_err("ingest.path", "must start with '/'"));
            }
            if self.inference_paths.contains(&ing.path) {
                return Err(cfg_err("ingest.path", "collides with an inference path"));
            }
            if ing.max_snapshot_bytes == 0 {
                return Err(cfg_err("ingest.max_snapshot_bytes", "must be > 0"));
            }
            let p = &ing.prefix_path;
            if !p.is_empty() && !p.starts_with('/') {
                return Err(cfg_err(
                    "ingest.prefix_path",
                    "must start with '/' (or be empty)",
                ));
            }
            if *p == ing.path || self.inference_paths.contains(p) {
                return Err(cfg_err(
                    "ingest.prefix_path",
                    "collides with the ingest path or an inference path",
                ));
            }
            let l = &ing.load_path;
            if !l.is_empty() && !l.starts_with('/') {
                return Err(cfg_err(
                    "ingest.load_path",
                    "must start with '/' (or be empty)",
                ));
            }
            if !l.is_empty()
                && (*l == ing.path || *l == ing.prefix_path || self.inference_paths.contains(l))
            {
                return Err(cfg_err(
                    "ingest.load_path",
                    "collides with another ingest path or an inference path",
                ));
            }
            if ing.load_ttl_ms == 0 || ing.load_ttl_ms > 60_000 {
                return Err(cfg_err("ingest.load_ttl_ms", "must be in 1..=60000"));
            }
        }
        if self.tick_ms == 0 {
            return Err(cfg_err("tick_ms", "must be > 0"));
        }
        if self.shared_refresh_ms == 0 {
            return Err(cfg_err("shared_refresh_ms", "must be > 0"));
        }
        if self.shared_peer_reads == 0 {
            return Err(cfg_err("shared_peer_reads", "must be > 0"));
        }
        Ok(())
    }

    /// Splits name new public models whose targets are served names (`served`: every model,
    /// alias and adapter of the pools).
    /// `models_path` answers `GET` for itself and every path under it: none of the paths the
    /// filter serves otherwise may be among them (an ingest path there is taken as ingest, an
    /// inference path answered as a model lookup on `GET`).
    fn validate_models_path(&self) -> Result<(), ConfigError> {
        let m = &self.models_path;
        if m.is_empty() {
            return Ok(());
        }
        if !m.starts_with('/') {
            return Err(cfg_err("models_path", "must start with '/' (or be empty)"));
        }
        let ingest = self
            .ingest
            .iter()
            .flat_map(|i| [&i.path, &i.prefix_path, &i.load_path]);
        let taken = self
            .inference_paths
            .iter()
            .chain(ingest)
            .filter(|p| !p.is_empty());
        for p in taken {
            if crate::routing::ModelsQuery::of(p, m).is_some() {
                return Err(cfg_err(
                    "models_path",
                    format!("{p:?} is {m:?} or under it, and is an inference or ingest path"),
                ));
            }
        }
        Ok(())
    }

    fn validate_splits(&self, served: &HashSet<&str>) -> Result<(), ConfigError> {
        let mut split_stats = HashMap::new();
        for (name, targets) in &self.splits {
            let f = format!("splits.{name}");
            if name.is_empty() {
                return Err(cfg_err("splits", "empty split name"));
            }
            check_header_safe(|| f.clone(), name)?;
            distinct_stat(&mut split_stats, name, || f.clone())?;
            let mut target_stats = HashMap::new();
            if served.contains(name.as_str()) {
                return Err(cfg_err(
                    f,
                    format!(
                        "{name:?} is already served by a pool (a split needs a name of its own)"
                    ),
                ));
            }
            if targets.is_empty() {
                return Err(cfg_err(f, "needs at least one target"));
            }
            let mut seen = HashSet::new();
            let mut total = 0u64;
            for (i, t) in targets.iter().enumerate() {
                let tf = format!("{f}[{i}]");
                if !served.contains(t.model.as_str()) {
                    let why = if self.splits.contains_key(&t.model) {
                        format!("target {:?} is a split (splits do not nest)", t.model)
                    } else {
                        format!("target {:?} is not served by any pool", t.model)
                    };
                    return Err(cfg_err(format!("{tf}.model"), why));
                }
                if !seen.insert(t.model.as_str()) {
                    return Err(cfg_err(
                        format!("{tf}.model"),
                        format!("target {:?} is listed twice", t.model),
                    ));
                }
                distinct_stat(&mut target_stats, &t.model, || format!("{tf}.model"))?;
                if t.weight > MAX_SPLIT_WEIGHT {
                    return Err(cfg_err(
                        format!("{tf}.weight"),
                        format!("at most {MAX_SPLIT_WEIGHT}"),
                    ));
                }
                total += u64::from(t.weight);
            }
            if total == 0 {
                return Err(cfg_err(f, "at least one weight must be positive"));
            }
        }
        Ok(())
    }

    /// The scoring of pool `i`: the top-level `scoring` with the pool's changes.
    pub fn pool_scoring(&self, i: usize) -> ScoringConfig {
        match self.pools.get(i) {
            Some(p) => self.scoring.with(&p.scoring),
            None => self.scoring.clone(),
        }
    }

    /// The longest `stale_after_ms` of any pool: a snapshot older than this says nothing any
    /// pool reads.
    pub fn longest_stale_after_ms(&self) -> u64 {
        (0..self.pools.len())
            .map(|i| self.pool_scoring(i).stale_after_ms)
            .fold(self.scoring.stale_after_ms, u64::max)
    }

    /// Whether `path` (without query) is an inference path.
    pub fn is_inference_path(&self, path: &str) -> bool {
        self.inference_paths.iter().any(|p| p == path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = r#"{"pools":[{"name":"llama","models":["llama-3"]}]}"#;

    #[test]
    fn the_longest_stale_after_ms_is_any_pools() {
        let c = FilterConfig::from_json(MINIMAL.as_bytes()).unwrap();
        assert_eq!(c.longest_stale_after_ms(), 1_000);
        let c = FilterConfig::from_json(
            br#"{"scoring":{"stale_after_ms":300},"pools":[{"name":"a","models":["a"]},
               {"name":"b","models":["b"],"scoring":{"stale_after_ms":3000}}]}"#,
        )
        .unwrap();
        assert_eq!(c.longest_stale_after_ms(), 3_000);
        let c = FilterConfig::from_json(
            br#"{"scoring":{"stale_after_ms":5000},"pools":[{"name":"a","models":["a"],"scoring":{"stale_after_ms":300}}]}"#,
        )
        .unwrap();
        assert_eq!(c.longest_stale_after_ms(), 5_000);
    }

    #[test]
    fn minimal_config_gets_documented_defaults() {
        let c = FilterConfig::from_json(MINIMAL.as_bytes()).unwrap();
        assert_eq!(c.max_body_bytes, 4 * 1024 * 1024);
        assert_eq!(c.inference_paths.len(), 18);
        let mut seen = std::collections::HashSet::new();
        assert!(
            c.inference_paths.iter().all(|p| seen.insert(p)),
            "inference_paths.txt lists a path twice: {:?}",
            c.inference_paths
        );
        assert_eq!(c.inference_paths[0], "/v1/chat/completions");
        assert_eq!(c.inference_paths[17], "/detokenize");
        assert!(c.is_inference_path("/v1/messages"));
        assert!(c.is_inference_path("/v1/audio/transcriptions"));
        assert!(c.is_inference_path("/v1/audio/translations"));
        assert!(c.is_inference_path("/v2/rerank"));
        assert!(c.is_inference_path("/v1/messages/count_tokens"));
        assert!(c.is_inference_path("/tokenize"));
        assert!(!c.is_inference_path("/v1/tokenize"));
        assert_eq!(c.models_path, "/v1/models");
        assert_eq!(c.scoring.stale_after_ms, 1_000);
        assert_eq!(c.scoring.effective_weights(), Preset::Latency.weights());
        assert_eq!(c.data_plane, DataPlane::OverrideHost);
        assert_eq!(c.fallback_endpoints, 2);
        assert!(c.ingest.is_none());
        assert_eq!(c.hold, None);
        let held = r#"{"pools":[{"name":"llama","models":["llama-3"]}],"hold":{}}"#;
        let c = FilterConfig::from_json(held.as_bytes()).unwrap();
        assert_eq!(c.hold, Some(HoldConfig::default()));
        let h = HoldConfig::default();
        assert_eq!(
            (h.max_wait_ms, h.max_held, h.affinity_wait()),
            (2_000, 256, 1_000)
        );
        // No request waits for its prompt's pod longer than any request is held.
        let short = r#"{"pools":[{"name":"p","models":["m"]}],"hold":{"max_wait_ms":300}}"#;
        let c = FilterConfig::from_json(short.as_bytes()).unwrap();
        assert_eq!(c.hold.map(|h| h.affinity_wait()), Some(300));
        let h = c.hold.unwrap();
        assert!(h.may_await(299) && !h.may_await(300) && !h.expired(299) && h.expired(300));
    }

    #[test]
    fn weight_overrides_apply_on_top_of_the_preset() {
        let c = FilterConfig::from_json(
            br#"{"pools":[{"name":"p","models":["m"]}],
                 "scoring":{"preset":"throughput","weights":{"queue":9}}}"#,
        )
        .unwrap();
        let w = c.scoring.effective_weights();
        assert_eq!(w.queue, 9.0);
        assert_eq!(w.prefix, Preset::Throughput.weights().prefix);
    }

    #[test]
    fn a_pools_scoring_changes_only_what_it_names() {
        let c = FilterConfig::from_json(
            br#"{"pools":[{"name":"chat","models":["a"]},
                          {"name":"batch","models":["b"],
                           "scoring":{"preset":"throughput","weights":{"lora":1},"stale_after_ms":5000,
                                      "lora_queue_threshold":8}}],
                 "scoring":{"weights":{"prefix":7},"kv_threshold":0.9,"queue_threshold":1}}"#,
        )
        .unwrap();
        let chat = c.pool_scoring(0);
        assert_eq!(chat.preset, Preset::Latency);
        assert_eq!(chat.effective_weights().prefix, 7.0);
        assert_eq!((chat.stale_after_ms, chat.kv_threshold), (1_000, 0.9));
        // The adapter threshold stays at its own default under a lower queue threshold.
        assert_eq!(
            (chat.queue_threshold, chat.lora_queue_threshold),
            (1.0, 5.0)
        );
        let batch = c.pool_scoring(1);
        let w = batch.effective_weights();
        // The pool's preset, the top-level prefix override, the pool's own lora override.
        assert_eq!(batch.preset, Preset::Throughput);
        assert_eq!(
            (w.queue, w.prefix, w.lora),
            (Preset::Throughput.weights().queue, 7.0, 1.0)
        );
        assert_eq!((batch.stale_after_ms, batch.kv_threshold), (5_000, 0.9));
        assert_eq!(
            (batch.queue_threshold, batch.lora_queue_threshold),
            (1.0, 8.0)
        );
    }

    #[test]
    fn a_standby_pool_needs_no_models_of_its_own() {
        let c = FilterConfig::from_json(
            br#"{"pools":[{"name":"llama","models":["m"],"failover":["dr","other"]},
                          {"name":"dr","models":[]},
                          {"name":"other","models":["o"],"failover":["llama"]}]}"#,
        )
        .unwrap();
        assert_eq!(c.pools[0].failover, ["dr", "other"]);
        assert!(c.pools[1].failover.is_empty() && c.pools[1].models.is_empty());
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"pools":[{"name":"","models":["m"]}]}"#, "pools[0].name"),
            (r#"{"pools":[{"name":"p","models":[]}]}"#, "pools[0].models"),
            (
                r#"{"pools":[{"name":"p","models":["m"]},{"name":"q","models":["m"]}]}"#,
                "pools[1].models",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"aliases":{"a":"x"}}]}"#,
                "pools[0].aliases.a",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"adapters":["m"]}]}"#,
                "pools[0].adapters",
            ),
            (r#"{"pools":[],"default_pool":"z"}"#, "default_pool"),
            (
                r#"{"pools":[{"name":"p","models":["m"],"failover":["p"]}]}"#,
                "pools[0].failover[0]",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"failover":["q"]}]}"#,
                "pools[0].failover[0]",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"failover":["q","q"]},{"name":"q","models":[]}]}"#,
                "pools[0].failover[1]",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"failover":["q"]},{"name":"q","models":[],"adapters":["a"]}]}"#,
                "pools[1].adapters",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"adapters":["ok","sql,v2"]}]}"#,
                "pools[0].adapters",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"adapters":[" padded "]}]}"#,
                "pools[0].adapters",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"adapters":["nel\u0085"]}]}"#,
                "pools[0].adapters",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"failover":["q"]},{"name":"q","models":[]}],"default_pool":"q"}"#,
                "default_pool",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"overflow":true}]}"#,
                "pools[0].overflow",
            ),
            (r#"{"pools":[],"max_body_bytes":0}"#, "max_body_bytes"),
            (r#"{"pools":[],"shared_peer_reads":0}"#, "shared_peer_reads"),
            (r#"{"pools":[],"response_entries":8}"#, "response_entries"),
            (r#"{"pools":[],"max_pod_stats":1048577}"#, "max_pod_stats"),
            (
                r#"{"pools":[],"scoring":{"weights":{"queue":-1}}}"#,
                "scoring.weights",
            ),
            (r#"{"pools":[],"ingest":{"token":"short"}}"#, "ingest.token"),
            (
                r#"{"pools":[],"prefix":{"block_chars":1}}"#,
                "prefix.block_chars",
            ),
            (r#"{"pools":[],"surprise":1}"#, "unknown field `surprise`"),
            (
                r#"{"pools":[{"name":"p","models":["m"],"scoring":{"kv_threshold":2}}]}"#,
                "pools[0].scoring.kv_threshold",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"scoring":{"lora_queue_threshold":0}}]}"#,
                "pools[0].scoring.lora_queue_threshold",
            ),
            (
                r#"{"pools":[],"scoring":{"lora_queue_threshold":-1}}"#,
                "scoring.lora_queue_threshold",
            ),
            (
                r#"{"pools":[],"ingest":{"token":"token-long-enough","load_path":"x"}}"#,
                "ingest.load_path",
            ),
            (
                r#"{"pools":[],"ingest":{"token":"token-long-enough","load_path":"/gpuroute/v1/prefix"}}"#,
                "ingest.load_path",
            ),
            (
                r#"{"pools":[],"ingest":{"token":"token-long-enough","load_path":"/v1/chat/completions"}}"#,
                "ingest.load_path",
            ),
            (
                r#"{"pools":[],"ingest":{"token":"token-long-enough","load_ttl_ms":0}}"#,
                "ingest.load_ttl_ms",
            ),
            (
                r#"{"pools":[],"scoring":{"pending_cost":4.5}}"#,
                "scoring.pending_cost",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"scoring":{"pending_cost":-0.1}}]}"#,
                "pools[0].scoring.pending_cost",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"scoring":{"weights":{"queue":0,"kv_cache":0,"running":0,"lora":0,"prefix":0}}}]}"#,
                "pools[0].scoring.weights",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"scoring":{"nope":1}}]}"#,
                "unknown field `nope`",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"m":[{"model":"m","weight":1}]}}"#,
                "splits.m",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[]}}"#,
                "splits.s",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"x","weight":1}]}}"#,
                "splits.s[0].model",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m","weight":1}],"t":[{"model":"s","weight":1}]}}"#,
                "splits do not nest",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m","weight":1},{"model":"m","weight":2}]}}"#,
                "splits.s[1].model",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m","weight":0}]}}"#,
                "at least one weight must be positive",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m","weight":1000001}]}}"#,
                "splits.s[0].weight",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m","weight":-1}]}}"#,
                "splits.s[0].weight",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m"}]}}"#,
                "missing field `weight`",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"hold":{"max_wait_ms":0}}"#,
                "hold.max_wait_ms",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"hold":{"max_held":100000}}"#,
                "hold.max_held",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"hold":{"affinity_wait_ms":60001}}"#,
                "hold.affinity_wait_ms",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"hold":{"max_wait":5}}"#,
                "unknown field `max_wait`",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"hold":{"order":"random"}}"#,
                "unknown variant `random`",
            ),
            // Found by an audit: each was accepted and then misbehaved.
            // Two pools counted as one in Envoy's stats.
            (
                r#"{"pools":[{"name":"llama.8b","models":["m"]},{"name":"llama_8b","models":["n"]}]}"#,
                r#"pools[1].name: "llama_8b" and "llama.8b" have the same stat name "llama_8b""#,
            ),
            (
                r#"{"pools":[{"name":"p","models":["m.1","m_1"]}],"splits":{"s.x":[{"model":"m.1","weight":1}],"s_x":[{"model":"m.1","weight":1}]}}"#,
                "splits.s_x: ",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m.1","m_1"]}],"splits":{"s":[{"model":"m.1","weight":1},{"model":"m_1","weight":1}]}}"#,
                "splits.s[1].model",
            ),
            // Names Envoy refuses in a header value.
            (
                r#"{"pools":[{"name":"p\nx","models":["m"]}]}"#,
                "pools[0].name: \"p\\nx\" has a control character",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m\u0000"]}]}"#,
                "pools[0].models",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"],"aliases":{"a\u007f":"m"}}]}"#,
                "pools[0].aliases",
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s\t":[{"model":"m","weight":1}]}}"#,
                "has a control character",
            ),
            // A key given twice (serde would keep the last without a word).
            (
                r#"{"pools":[{"name":"p","models":["m","m2"],"aliases":{"a":"m","a":"m2"}}]}"#,
                r#"pools[0].aliases: "a" is given twice"#,
            ),
            (
                r#"{"pools":[{"name":"p","models":["m"]}],"splits":{"s":[{"model":"m","weight":1}],"s":[{"model":"m","weight":2}]}}"#,
                r#"splits: "s" is given twice"#,
            ),
            // Paths that models_path would answer.
            (
                r#"{"pools":[],"models_path":"/v1/chat/completions"}"#,
                "models_path",
            ),
            (r#"{"pools":[],"models_path":"/v1"}"#, "models_path"),
            (r#"{"pools":[],"models_path":"v1/models"}"#, "models_path"),
            (
                r#"{"pools":[],"ingest":{"token":"token-long-enough","path":"/v1/models"}}"#,
                r#"models_path: "/v1/models" is "/v1/models" or under it"#,
            ),
        ];
        for (json, needle) in cases {
            let err = FilterConfig::from_json(json.as_bytes())
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(needle),
                "{json}: {err:?} should mention {needle:?}"
            );
        }
    }
}
