//! The offline replay: a workload routed by the filter's own decision code over fleet-sim's own
//! engines, in simulated time, with no Envoy, no HTTP and no wall clock.
//!
//! Each request of the workload is read by [`gpuroute_core::engine::Engine`] exactly as the
//! filter reads its body (the same JSON the load generator sends), decided against the
//! snapshot and the in-flight table the filter would hold at that moment, and submitted to the
//! simulated engine of the pod picked. The snapshot comes from the aggregator's own code: every
//! `interval_ms` each engine's `/metrics` page is rendered (fleet-sim's renderer), read by
//! `sidecar-metrics` (its parser, its health, ramp and capacity estimate) and installed in the
//! filter `snapshot_lag_ms` later. The in-flight table is counted as the filter counts it: a
//! request is in prefill until its first token (the first streamed chunk), in flight until its
//! last.
//!
//! What it leaves out: the proxy's own latency (unless [`ReplaySettings::proxy_ms`] draws
//! one), the network, and the wall-clock jitter of a real run (timers, the scheduler of a
//! 2-core machine). So one replay is exactly reproducible from its inputs and a seed, and two
//! policies replayed on one workload differ only by their decisions: the tool for comparing
//! routing changes, where the live benchmark (`scripts/bench.py`) needs many paired runs to
//! see a few percent through its noise. The live benchmark stays the measure of the shipped
//! system; bench/README.md ("Offline replay") sets the replay's figures beside a live run's.
//!
//! Requests the filter leaves to Envoy (fail-open) go to Envoy's `least_request` fallback
//! (power of two choices over each pod's open requests) in the pool the filter named. A pool
//! that overflows (`pools[].overflow`) hands its request on as the filter's shells do, and it
//! is picked for again in the pool it moved to. In a fleet of several pools the baselines
//! route by model as the benchmark's stack has them do: the filter names the pool (its body
//! routing only), and round robin or `least_request` picks among that pool's pods.
//!
//! By default one filter engine routes everything: one Envoy worker, whose own table is the
//! whole view. [`Gateways`] sets up several: each with its own prefix index and in-flight table
//! (as each Envoy worker and each gateway replica has), each request reaching one drawn at
//! random (Envoy's listener spreading connections over workers; a Kubernetes Service spreading
//! them over replicas). They learn each other's routing decisions and in-flight counts only
//! through the relays [`Gateways`] names, that long after the fact: the workers of one Envoy
//! exchange both through shared data within milliseconds; gateway replicas exchange prefix
//! records and requests in prefill through `sidecar-metrics`. They share the pods and
//! the aggregator's snapshots (each replica's own sidecar scrapes at its own phase; here every
//! engine installs the same snapshot at the same time).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use fleet_sim::config::FleetConfig;
use fleet_sim::engine::{Engine as SimEngine, Output, SimNs};
use fleet_sim::pod::{MetricsView, SimClock};
use gpuroute_core::config::FilterConfig;
use gpuroute_core::engine::{DecideOptions, Engine as FilterEngine};
use gpuroute_core::fleet::FleetState;
use gpuroute_core::load::{Completion, InFlight, LoadTable};
use gpuroute_core::picker::Decision;
use gpuroute_core::prefix::SyncRecord;
use gpuroute_core::rng::SplitMix64;
use gpuroute_core::snapshot::{PoolSnapshot, Snapshot, SNAPSHOT_SCHEMA};
use serde_json::{json, Value};
use sidecar_metrics::config::Config as SidecarConfig;
use sidecar_metrics::discovery::Target;
use sidecar_metrics::pod::{pool_snapshot, PodState as ScrapeState};

use crate::floor::{serves, SimPrompt};
use crate::workload::{Api, TimedRequest};

/// How requests are routed in a replay.
#[derive(Debug, Clone, PartialEq)]
pub enum Policy {
    /// The filter, with these top-level keys over the benchmark's filter configuration (as
    /// `scripts/bench.py --filter-variant` applies them).
    Filter(Value),
    /// Each pool's pods in turn (Kubernetes Service / Envoy `ROUND_ROBIN`).
    RoundRobin,
    /// Envoy's `LEAST_REQUEST`: the fewer open requests of two pods drawn at random.
    LeastRequest,
}

/// Settings of a replay besides the policy.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplaySettings {
    /// The aggregator's scrape interval (the benchmark's stack uses 100 ms).
    pub interval_ms: u64,
    /// From a scrape to the filter holding its snapshot (scrape, assembly, push).
    pub snapshot_lag_ms: u64,
    /// Seed of the router's random choices (the filter's tie-breaks, `least_request`'s draws)
    /// and of the proxy's delays.
    pub seed: u64,
    /// The proxy's mean delay each way, ms: a request reaches its pod after a delay drawn
    /// uniformly from 0 to twice this, and its first token reaches the client this much after
    /// the pod sent it. 0: none, and a replay of the same inputs is the same whatever the seed
    /// but for the routers' own draws.
    pub proxy_ms: f64,
    /// The filter engines requests are spread over, and what they learn of each other.
    pub gateways: Gateways,
    /// Each pod's capacity, in the fleet's pod order, as `capacity` configured per pod in
    /// sidecar-metrics (the hardware known); `None`: estimated from the pods' metrics, as by
    /// default. A list shorter than the fleet leaves the rest estimated.
    pub capacities: Option<Vec<f64>>,
    /// Requests (workload order, inclusive) whose routing the filter explains on stderr: its
    /// score breakdown beside each pod's true state and the in-flight table it decided on.
    pub explain: Option<(usize, usize)>,
    /// The scenario's settings of its pools in the filter's configuration, by pool name
    /// ([`crate::scenario::Scenario::pools`]).
    pub pools: serde_json::Map<String, Value>,
}

/// Filter engines that decide apart: the workers of one Envoy, or gateway replicas.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gateways {
    /// Engines, each with its own prefix index and in-flight table; each request reaches one
    /// drawn at random.
    pub engines: usize,
    /// How long after a routing decision the other engines' prefix indexes hold it. `None`:
    /// never (they agree only through the rendezvous home and the snapshot).
    pub prefix_relay_ms: Option<u64>,
    /// How long after a request is counted (sent, its first token, its end) the other engines'
    /// in-flight views count it. `None`: never (each knows only its own requests).
    pub load_relay_ms: Option<u64>,
    /// Only the requests in prefill pass between the engines (gateway replicas: each counts
    /// the rest against its own aggregator's snapshot, `ingest.load_path`), not whole tables
    /// (the workers of one Envoy).
    pub load_relay_prefill_only: bool,
    /// The engines are workers of one Envoy, so the baselines' `least_request` counts every
    /// engine's open requests (Envoy's per-host counts are shared by its workers); otherwise
    /// each engine counts only its own, as separate Envoys do.
    pub one_envoy: bool,
}

impl Gateways {
    /// One engine: one Envoy with one worker.
    pub fn one() -> Gateways {
        Gateways {
            engines: 1,
            prefix_relay_ms: None,
            load_relay_ms: None,
            load_relay_prefill_only: false,
            one_envoy: true,
        }
    }

    /// `n` workers of one Envoy (README, "No thundering herd"): another worker's request counts
    /// ~2 ms after it was sent (`shared_refresh_ms` 1 ms, on the next request), its routing
    /// decisions arrive with the next tick's exchange (`tick_ms` 20 ms).
    pub fn workers(n: usize) -> Gateways {
        Gateways {
            engines: n.max(1),
            prefix_relay_ms: Some(20),
            load_relay_ms: Some(2),
            load_relay_prefill_only: false,
            one_envoy: true,
        }
    }

    /// `n` gateway replicas of one worker each, as the shipped manifests run them: routing
    /// decisions relayed by `sidecar-metrics` (p50 51-68 ms on loopback, README "Prefix
    /// affinity"; 60 here), requests in prefill relayed every 5 ms (`prefix.load_interval_ms`;
    /// a body reaches the other replica's Envoy ~2.5 ms after it was read: 5 ms here, half an
    /// interval's wait on average plus the hops).
    pub fn replicas(n: usize) -> Gateways {
        Gateways {
            engines: n.max(1),
            prefix_relay_ms: Some(60),
            load_relay_ms: Some(5),
            load_relay_prefill_only: true,
            one_envoy: false,
        }
    }
}

impl Default for ReplaySettings {
    fn default() -> Self {
        ReplaySettings {
            interval_ms: 100,
            snapshot_lag_ms: 5,
            seed: 1,
            proxy_ms: 0.0,
            gateways: Gateways::one(),
            capacities: None,
            explain: None,
            pools: serde_json::Map::new(),
        }
    }
}

/// What a replay measured.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ReplayOutcome {
    /// Each request's time to first token, ms, in workload order (`None`: no pod served it,
    /// or it was shed or refused by the filter).
    pub ttft_ms: Vec<Option<f64>>,
    /// Index (in the fleet's pod list) of the pod each request went to.
    pub served_by: Vec<Option<usize>>,
    /// Requests the filter left to Envoy's own balancing.
    pub fail_open: u64,
    /// Requests the filter answered itself (errors, shed, held: a hold is not modelled).
    pub refused: u64,
    /// Prompt tokens looked up in the pods' prefix caches, and found there.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// LoRA adapter loads over the fleet.
    pub adapter_loads: u64,
    /// Requests the filter moved to another pool because every pod of theirs was saturated
    /// (`pools[].overflow`).
    pub overflowed: u64,
}

impl ReplayOutcome {
    /// Prefix-cache hit rate over the fleet (tokens), if any prompt was looked up.
    pub fn prefix_hit_rate(&self) -> Option<f64> {
        (self.prefix_queries > 0).then(|| self.prefix_hits as f64 / self.prefix_queries as f64)
    }
}

/// The filter configuration the benchmark's stack writes for `fleet` (`scripts/stack.py`:
/// one pool per fleet pool, its models and adapters, with the scenario's settings of it from
/// `settings` over them), with `overrides`' top-level keys over it.
pub fn filter_config<'a>(
    fleet: &'a FleetConfig,
    settings: &serde_json::Map<String, Value>,
    overrides: &Value,
) -> Result<FilterConfig, String> {
    let fleet_pools = fleet_pools(fleet);
    if let Some(name) = settings
        .keys()
        .find(|n| !fleet_pools.iter().any(|(p, _)| p == *n))
    {
        return Err(format!(
            "settings for pool {name:?}, which the fleet does not have"
        ));
    }
    let pools: Vec<Value> = fleet_pools
        .into_iter()
        .map(|(name, members)| {
            let (mut models, mut adapters): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
            let add = |list: &mut Vec<&'a str>, name: &'a str| {
                if !list.contains(&name) {
                    list.push(name);
                }
            };
            for p in members.iter().map(|&i| &fleet.pods[i]) {
                add(&mut models, &p.model);
                for a in &p.adapters {
                    add(&mut adapters, a);
                }
            }
            let mut pool = json!({"name": name, "models": models, "adapters": adapters});
            if let (Some(p), Some(Value::Object(set))) = (pool.as_object_mut(), settings.get(&name))
            {
                p.extend(set.clone());
            }
            pool
        })
        .collect();
    let mut cfg = json!({
        "pools": pools,
        "ingest": {"token": "offline-replay"},
    });
    if let (Some(base), Some(over)) = (cfg.as_object_mut(), overrides.as_object()) {
        for (k, v) in over {
            base.insert(k.clone(), v.clone());
        }
    } else if !overrides.is_null() {
        return Err("filter overrides must be a JSON object".into());
    }
    let bytes = serde_json::to_vec(&cfg).map_err(|e| e.to_string())?;
    FilterConfig::from_json(&bytes).map_err(|e| format!("filter configuration: {e}"))
}

/// The fleet's pools in order of first appearance, each with its pods' indices.
pub fn fleet_pools(fleet: &FleetConfig) -> Vec<(String, Vec<usize>)> {
    let mut pools: Vec<(String, Vec<usize>)> = Vec::new();
    for (i, p) in fleet.pods.iter().enumerate() {
        match pools.iter_mut().find(|(n, _)| *n == p.pool) {
            Some((_, members)) => members.push(i),
            None => pools.push((p.pool.clone(), vec![i])),
        }
    }
    pools
}

/// A request on its pod: what to undo when it ends, and when it arrived.
struct Open {
    request: usize,
    /// Wall ns of its arrival.
    at: u64,
    /// The filter's in-flight entry (None for the baselines and fail-open requests).
    flight: Option<InFlight>,
    /// The filter engine that routed it ([`Gateways`]).
    gateway: usize,
    /// Sequences (choices) not yet finished.
    sequences: u32,
}

/// Replays `requests` on `fleet` under `policy`.
pub fn replay(
    requests: &[TimedRequest],
    fleet: &FleetConfig,
    policy: &Policy,
    settings: &ReplaySettings,
) -> Result<ReplayOutcome, String> {
    let mut r = Replay::new(fleet, policy, settings)?;
    // The benchmark's stack starts sending once the aggregator pushed its first snapshot.
    r.scrape(0);
    r.install(0);
    r.next_scrape = settings.interval_ms * 1_000_000;
    for (i, req) in requests.iter().enumerate() {
        let at = (req.at_s.max(0.0) * 1e9) as u64;
        r.run_to(at);
        r.route(i, req, at);
    }
    r.drain();
    Ok(r.finish())
}

/// A pod's simulated engine and what the aggregator remembers of it.
struct Pod {
    engine: SimEngine,
    scrape: ScrapeState,
    clock: SimClock,
    /// Open requests (HTTP streams) on the pod, for `least_request`, per engine that sent
    /// them.
    open: Vec<u32>,
}

struct Filter {
    engine: FilterEngine,
    fleet: Option<FleetState>,
    /// The worker's own in-flight table per pool, by pool name.
    loads: HashMap<String, LoadTable>,
    /// The other engines' in-flight counts as far as relayed, per pool, counted as their own
    /// tables count them (against the same snapshot's bases).
    peers: HashMap<String, LoadTable>,
}

/// What one engine tells the others, on its way: when it happened and when it reaches them
/// (wall ns), and which engine it comes from.
struct Relayed<T> {
    at: u64,
    due: u64,
    from: usize,
    what: T,
}

/// A change to an engine's in-flight table.
enum LoadEvent {
    Sent(InFlight),
    Done(Arc<str>, Completion),
}

struct Replay<'a> {
    fleet: &'a FleetConfig,
    policy: &'a Policy,
    settings: &'a ReplaySettings,
    pods: Vec<Pod>,
    /// One per engine of [`Gateways`]; none for the baselines.
    filters: Vec<Filter>,
    /// The baselines' body-based routing in a fleet of several pools: the filter, which only
    /// names the pool (`pick_endpoints` off, no snapshot), as the benchmark's stack runs them.
    body_router: Option<FilterEngine>,
    /// Wall ns of the last snapshot install.
    installed_at: u64,
    /// Snapshots taken and not yet installed: (wall ns to install at, snapshot).
    pending: Vec<(u64, Snapshot)>,
    version: u64,
    /// The fleet's pod index of each snapshot address.
    by_address: HashMap<String, usize>,
    /// Routing decisions and in-flight changes not yet at the other engines, in order of
    /// arrival there.
    prefix_relay: VecDeque<Relayed<SyncRecord>>,
    load_relay: VecDeque<Relayed<LoadEvent>>,
    sidecar: SidecarConfig,
    /// The fleet's pools and their pods ([`fleet_pools`]).
    pools: Vec<(String, Vec<usize>)>,
    /// The aggregator's start, and the instant of wall ns 0.
    started: Instant,
    /// Unix ms at wall ns 0.
    epoch_ms: u64,
    next_scrape: u64,
    /// (pod, sequence) -> open request.
    open: HashMap<(usize, u64), usize>,
    requests: Vec<Open>,
    rng: SplitMix64,
    /// Draws of the proxy's delays, apart from the router's so a delay does not change its
    /// choices' draws.
    delays: SplitMix64,
    /// Draws of the engine each request reaches, apart from the others for the same reason.
    spread: SplitMix64,
    /// Each engine's round-robin position per model.
    round_robin: HashMap<(usize, String), usize>,
    out: ReplayOutcome,
    scratch: Vec<Output>,
}

/// The snapshot address of pod `i` (a stand-in: nothing connects to it).
fn address(i: usize) -> SocketAddr {
    let b = |shift: usize| ((i >> shift) & 255) as u8;
    SocketAddr::from(([10, b(16), b(8), b(0)], 8000))
}

impl<'a> Replay<'a> {
    fn new(
        fleet: &'a FleetConfig,
        policy: &'a Policy,
        settings: &'a ReplaySettings,
    ) -> Result<Replay<'a>, String> {
        let sidecar: SidecarConfig =
            serde_json::from_str("{}").map_err(|e| format!("sidecar defaults: {e}"))?;
        let pods = fleet
            .pods
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let addr = address(i);
                Pod {
                    engine: SimEngine::new(p.engine.clone()),
                    scrape: ScrapeState::new(Target {
                        address: addr,
                        metrics_url: format!("http://{addr}/metrics"),
                        engine: None,
                        capacity: settings.capacities.as_ref().and_then(|c| c.get(i).copied()),
                        ready: true,
                        name: Some(p.name.clone()),
                    }),
                    clock: SimClock::new(p.engine.time_scale),
                    open: vec![0; settings.gateways.engines.max(1)],
                }
            })
            .collect();
        let pools = fleet_pools(fleet);
        let body_router = match policy {
            Policy::RoundRobin | Policy::LeastRequest if pools.len() > 1 => {
                let cfg = filter_config(fleet, &settings.pools, &Value::Null)?;
                Some(FilterEngine::new(cfg).without_sync_log())
            }
            _ => None,
        };
        let filters = match policy {
            Policy::Filter(over) => {
                let cfg = filter_config(fleet, &settings.pools, over)?;
                (0..settings.gateways.engines.max(1))
                    .map(|_| Filter {
                        engine: FilterEngine::new(cfg.clone()).without_sync_log(),
                        fleet: None,
                        loads: HashMap::new(),
                        peers: HashMap::new(),
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        Ok(Replay {
            fleet,
            policy,
            settings,
            pods,
            filters,
            body_router,
            pending: Vec::new(),
            version: 0,
            by_address: (0..fleet.pods.len())
                .map(|i| (address(i).to_string(), i))
                .collect(),
            installed_at: 0,
            prefix_relay: VecDeque::new(),
            load_relay: VecDeque::new(),
            sidecar,
            pools,
            started: Instant::now(),
            epoch_ms: 1_800_000_000_000,
            next_scrape: 0,
            open: HashMap::new(),
            requests: Vec::new(),
            rng: SplitMix64::new(settings.seed),
            delays: SplitMix64::new(settings.seed ^ 0x9e37_79b9_7f4a_7c15),
            spread: SplitMix64::new(settings.seed ^ 0x5851_f42d_4c95_7f2d),
            round_robin: HashMap::new(),
            out: ReplayOutcome::default(),
            scratch: Vec::new(),
        })
    }

    fn wall_ms(&self, ns: u64) -> u64 {
        self.epoch_ms + ns / 1_000_000
    }

    /// Runs the fleet, the aggregator and the snapshot installs up to wall ns `t`.
    fn run_to(&mut self, t: u64) {
        if self.filters.is_empty() {
            self.advance(t);
            return;
        }
        loop {
            let install = self.pending.first().map(|p| p.0);
            let next = match install {
                Some(i) if i <= self.next_scrape => i,
                _ => self.next_scrape,
            };
            if next > t {
                break;
            }
            self.advance(next);
            if install == Some(next) {
                self.install(next);
            } else {
                self.scrape(next);
                self.next_scrape += self.settings.interval_ms * 1_000_000;
            }
        }
        self.advance(t);
    }

    /// Steps every engine to wall ns `t`, recording first tokens and ends.
    fn advance(&mut self, t: u64) {
        for i in 0..self.pods.len() {
            let scale = self.pods[i].engine.config().time_scale;
            let now = (t as f64 * scale) as SimNs;
            let mut out = std::mem::take(&mut self.scratch);
            self.pods[i].engine.advance(now, &mut out);
            for o in out.drain(..) {
                self.output(i, &o, scale);
            }
            self.scratch = out;
        }
    }

    fn output(&mut self, pod: usize, o: &Output, scale: f64) {
        let Some(&slot) = self.open.get(&(pod, o.seq)) else {
            return;
        };
        let wall = (o.at as f64 / scale) as u64;
        let open = &mut self.requests[slot];
        let gateway = open.gateway;
        let mut done = Vec::new();
        if o.new_tokens > 0 && self.out.ttft_ms[open.request].is_none() {
            let ms = wall.saturating_sub(open.at) as f64 / 1e6 + self.settings.proxy_ms;
            self.out.ttft_ms[open.request] = Some(ms);
            if let Some(fl) = open.flight.as_mut() {
                if let Some(c) = fl.first_byte() {
                    done.push(LoadEvent::Done(fl.pool.clone(), c));
                }
            }
        }
        if o.finish.is_some() {
            self.open.remove(&(pod, o.seq));
            open.sequences = open.sequences.saturating_sub(1);
            if open.sequences == 0 {
                if let Some(n) = self.pods[pod].open.get_mut(gateway) {
                    *n = n.saturating_sub(1);
                }
                if let Some(fl) = &open.flight {
                    done.push(LoadEvent::Done(fl.pool.clone(), fl.finished()));
                }
            }
        }
        for d in done {
            self.complete(gateway, wall, d);
        }
    }

    /// One scrape round at wall ns `t`: every pod's page rendered, read and folded in, and the
    /// snapshot assembled, to be installed `snapshot_lag_ms` later.
    fn scrape(&mut self, t: u64) {
        let at = self.started + Duration::from_nanos(t);
        let wall = self.wall_ms(t);
        for (i, pod) in self.pods.iter_mut().enumerate() {
            let view = MetricsView {
                gauges: pod.engine.gauges(),
                stats: pod.engine.stats().clone(),
            };
            let page = fleet_sim::render::render_view(&self.fleet.pods[i], &pod.clock, &view);
            match sidecar_metrics::engine::read(&page, None, false) {
                Ok(reading) => pod
                    .scrape
                    .on_success(reading, at, wall, &self.sidecar.capacity),
                Err(e) => pod.scrape.on_failure("parse", e.to_string()),
            }
        }
        let mut pools = Vec::with_capacity(self.pools.len());
        for (name, members) in &self.pools {
            let weights: Vec<f64> = members
                .iter()
                .map(|&i| {
                    let (h, r) = (&self.sidecar.health, &self.sidecar.ramp);
                    self.pods[i].scrape.evaluate(at, self.started, h, r)
                })
                .collect();
            let states: Vec<&ScrapeState> = members.iter().map(|&i| &self.pods[i].scrape).collect();
            let (pods, caps) = pool_snapshot(&states, &weights, self.sidecar.capacity.estimate);
            for (&i, c) in members.iter().zip(caps) {
                self.pods[i].scrape.published_capacity = Some(c);
            }
            pools.push(PoolSnapshot {
                name: name.clone(),
                pods,
            });
        }
        if self.filters.is_empty() {
            return;
        }
        self.version += 1;
        let snapshot = Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: self.version,
            source: "replay".into(),
            generated_at_ms: wall,
            pools,
        };
        self.pending
            .push((t + self.settings.snapshot_lag_ms * 1_000_000, snapshot));
    }

    /// Installs the oldest pending snapshot in every engine, as the filter's worker does.
    fn install(&mut self, t: u64) {
        let wall = self.wall_ms(t);
        if self.pending.is_empty() {
            return;
        }
        let (_, snap) = self.pending.remove(0);
        let fleet = FleetState::new(snap, wall);
        for f in &mut self.filters {
            for pool in &fleet.pools {
                f.loads
                    .entry(pool.name.clone())
                    .or_default()
                    .rebase(fleet.version, &pool.keys);
                f.peers
                    .entry(pool.name.clone())
                    .or_default()
                    .rebase(fleet.version, &pool.keys);
            }
            f.fleet = Some(fleet.clone());
        }
        self.installed_at = t;
    }

    /// Routes request `r` arriving at wall ns `at` and submits it to its pod.
    fn route(&mut self, r: usize, req: &TimedRequest, at: u64) {
        self.out.ttft_ms.push(None);
        self.out.served_by.push(None);
        let mut flight = None;
        let engines = self.settings.gateways.engines;
        let gateway = match engines {
            0 | 1 => 0,
            n => (self.spread.next_u64() % n as u64) as usize,
        };
        let pod = match self.policy {
            Policy::RoundRobin => {
                let Some(candidates) = self.baseline_candidates(req) else {
                    self.out.refused += 1;
                    return;
                };
                let spread = &mut self.spread;
                // Envoy starts each load balancer's rotation at a random host.
                let n = self
                    .round_robin
                    .entry((gateway, req.model.clone()))
                    .or_insert_with(|| {
                        if engines > 1 {
                            spread.next_u64() as usize % 1024
                        } else {
                            0
                        }
                    });
                let pick = candidates.get(*n % candidates.len().max(1)).copied();
                *n += 1;
                pick
            }
            Policy::LeastRequest => {
                let Some(candidates) = self.baseline_candidates(req) else {
                    self.out.refused += 1;
                    return;
                };
                self.least_request(&candidates, gateway)
            }
            Policy::Filter(_) => match self.filter_pick(r, req, at, gateway) {
                Picked::Pod(i, f) => {
                    flight = f;
                    Some(i)
                }
                Picked::FailOpen(pool) => {
                    self.out.fail_open += 1;
                    let candidates = self.candidates(pool.as_deref(), &req.model);
                    self.least_request(&candidates, gateway)
                }
                Picked::Refused => {
                    self.out.refused += 1;
                    None
                }
            },
        };
        let Some(pod) = pod else {
            return;
        };
        let cfg = &self.fleet.pods[pod];
        let mut sim = SimPrompt::new(req);
        if !sim.fits(&self.pods[pod].engine) {
            // The pod answers at once with an error: the request's end leaves the table.
            if let Some(fl) = &flight {
                let done = LoadEvent::Done(fl.pool.clone(), fl.finished());
                self.complete(gateway, at, done);
            }
            return;
        }
        let new = sim.engine_request(cfg);
        let scale = cfg.engine.time_scale;
        let delay = 2.0 * self.settings.proxy_ms * 1e6 * self.delays.next_f64();
        // An engine takes arrivals in order: one overtaken on the way arrives with the one
        // before it.
        let now = ((at as f64 + delay) * scale) as SimNs;
        let slot = self.requests.len();
        let sequences = req.n.max(1);
        self.requests.push(Open {
            request: r,
            at,
            flight,
            gateway,
            sequences,
        });
        for _ in 0..sequences {
            let id = self.pods[pod].engine.submit(new.clone(), now);
            self.open.insert((pod, id), slot);
        }
        if let Some(n) = self.pods[pod].open.get_mut(gateway) {
            *n += 1;
        }
        self.out.served_by[r] = Some(pod);
    }

    /// The pods that serve `model`: of the fleet's pool named `pool`, or of any pool.
    fn candidates(&self, pool: Option<&str>, model: &str) -> Vec<usize> {
        let pods = &self.fleet.pods;
        (0..pods.len())
            .filter(|&i| pool.is_none_or(|name| pods[i].pool == name) && serves(&pods[i], model))
            .collect()
    }

    /// A baseline's candidates for `req`: with one pool, every pod that serves its model (plain
    /// Envoy); with several, the pods of the pool the filter's body-based routing names (`None`:
    /// the filter answers the request itself, an error).
    fn baseline_candidates(&mut self, req: &TimedRequest) -> Option<Vec<usize>> {
        let pool = match self.body_router.as_mut() {
            Some(router) => Some(router.prepare(api_path(req.api), &req.body()).ok()?.pool),
            None => None,
        };
        Some(self.candidates(pool.as_deref(), &req.model))
    }

    /// Envoy's `least_request` with its default two choices, in engine `gateway`'s Envoy.
    fn least_request(&mut self, candidates: &[usize], gateway: usize) -> Option<usize> {
        let shared = self.settings.gateways.one_envoy;
        let open = |p: &Pod| -> u32 {
            if shared {
                p.open.iter().sum()
            } else {
                p.open.get(gateway).copied().unwrap_or(0)
            }
        };
        match candidates.len() {
            0 => None,
            1 => Some(candidates[0]),
            n => {
                let a = candidates[(self.rng.next_u64() % n as u64) as usize];
                let b = candidates[(self.rng.next_u64() % n as u64) as usize];
                Some(if open(&self.pods[b]) < open(&self.pods[a]) {
                    b
                } else {
                    a
                })
            }
        }
    }

    /// Delivers what the engines relayed, due by wall ns `at`, to the engines that did not
    /// send it.
    fn deliver(&mut self, at: u64) {
        while self.prefix_relay.front().is_some_and(|r| r.due <= at) {
            let Some(r) = self.prefix_relay.pop_front() else {
                break;
            };
            for (i, f) in self.filters.iter_mut().enumerate() {
                if i != r.from {
                    f.engine.apply_sync(std::slice::from_ref(&r.what));
                }
            }
        }
        while self.load_relay.front().is_some_and(|r| r.due <= at) {
            let Some(r) = self.load_relay.pop_front() else {
                break;
            };
            // The sender counts against the same snapshot's bases: a change from before the
            // last install is in its bases too, so it moves no delta, only the totals.
            let before = r.at < self.installed_at;
            for (i, f) in self.filters.iter_mut().enumerate() {
                if i != r.from {
                    peer_change(f, &r.what, before);
                }
            }
        }
    }

    /// A first token or end of a request engine `gateway` routed, at wall ns `at`: applied to
    /// its table, and relayed to the others if [`Gateways::load_relay_ms`] says so.
    fn complete(&mut self, gateway: usize, at: u64, done: LoadEvent) {
        let LoadEvent::Done(pool, c) = &done else {
            return;
        };
        if let Some(t) = self
            .filters
            .get_mut(gateway)
            .and_then(|f| f.loads.get_mut(&**pool))
        {
            c.apply(t);
        }
        self.relay_load(gateway, at, done);
    }

    fn relay_load(&mut self, from: usize, at: u64, what: LoadEvent) {
        if let Some(ms) = self
            .settings
            .gateways
            .load_relay_ms
            .filter(|_| self.filters.len() > 1)
        {
            let due = at + ms * 1_000_000;
            // Ends come in pod by pod, not in time order: keep the queue in order of arrival.
            let pos = self
                .load_relay
                .iter()
                .rposition(|r| r.due <= due)
                .map_or(0, |p| p + 1);
            self.load_relay.insert(
                pos,
                Relayed {
                    at,
                    due,
                    from,
                    what,
                },
            );
        }
    }

    /// Engine `gateway`'s decision for `req` at wall ns `at`, counted in its in-flight table and
    /// recorded in its prefix index as the filter's shell does, and relayed to the other
    /// engines as [`Gateways`] says.
    fn filter_pick(&mut self, r: usize, req: &TimedRequest, at: u64, gateway: usize) -> Picked {
        let now_ms = self.wall_ms(at);
        self.deliver(at);
        let prefix_relay = self
            .settings
            .gateways
            .prefix_relay_ms
            .filter(|_| self.filters.len() > 1);
        let Some(f) = self.filters.get_mut(gateway) else {
            return Picked::FailOpen(None);
        };
        let Ok(mut prep) = f.engine.prepare(api_path(req.api), &req.body()) else {
            return Picked::Refused;
        };
        let explain = self
            .settings
            .explain
            .is_some_and(|(from, to)| (from..=to).contains(&r));
        let opts = DecideOptions {
            now_ms,
            debug: explain,
            ..DecideOptions::default()
        };
        // As the filter's shells do: a pool whose pods are all saturated hands the request to
        // the pool it overflows to, where it is picked for again (each move further down the
        // failover list, so this ends).
        let (choice, loads) = loop {
            let mut loads = f
                .loads
                .get(&*prep.pool)
                .map(|t| t.pods.clone())
                .unwrap_or_default();
            // The other engines' tables added to this one's, as a worker adds the other
            // workers'.
            if let Some(peer) = f
                .peers
                .get(&*prep.pool)
                .filter(|p| p.pods.len() == loads.len())
            {
                let only_prefill = self.settings.gateways.load_relay_prefill_only;
                for (l, p) in loads.iter_mut().zip(&peer.pods) {
                    if only_prefill {
                        l.add_prefill(p.prefill, p.prefill_tokens);
                    } else {
                        l.add(p);
                    }
                }
            }
            let choice = f
                .engine
                .decide(&prep, f.fleet.as_ref(), &loads, opts, &mut self.rng);
            match choice.decision {
                Decision::Overflow(to) => f.engine.overflow(&mut prep, to),
                _ => break (choice, loads),
            }
        };
        if prep.failed_over.as_ref().is_some_and(|m| m.overflow) {
            self.out.overflowed += 1;
        }
        if explain {
            let pool = f.fleet.as_ref().and_then(|fl| fl.pool(&prep.pool));
            let mut lines = vec![format!(
                "request {r} at {:.1} s, gateway {gateway}, {} prompt tokens: {}",
                (now_ms - self.epoch_ms) as f64 / 1000.0,
                prep.prompt_tokens,
                choice.debug.as_deref().unwrap_or("no decision")
            )];
            for (idx, l) in loads.iter().enumerate() {
                let Some(p) = pool.and_then(|pl| pl.pods.get(idx)) else {
                    continue;
                };
                let Some(&pod) = self.by_address.get(&p.snap.address) else {
                    continue;
                };
                let g = self.pods[pod].engine.gauges();
                lines.push(format!(
                    "  {}: true running {} waiting {} kv {:.2}; snapshot running {} waiting {} capacity {:.2} (class {:.2}); in flight {} (+{} since), in prefill {} ({} tokens)",
                    p.snap.address,
                    g.running,
                    g.waiting,
                    g.kv_usage,
                    p.snap.running,
                    p.snap.waiting,
                    p.snap.capacity,
                    p.speed,
                    l.inflight,
                    l.delta(),
                    l.prefill,
                    l.prefill_tokens
                ));
            }
            eprintln!("{}", lines.join("\n"));
        }
        match choice.decision {
            Decision::Picked(_) => {
                let (Some(idx), Some(key)) = (choice.picked_index, choice.picked_key) else {
                    return Picked::FailOpen(Some(prep.pool));
                };
                let pod = f.fleet.as_ref().and_then(|fl| {
                    let p = fl.pool(&prep.pool)?.pods.get(idx)?;
                    self.by_address.get(&p.snap.address).copied()
                });
                let Some(pod) = pod else {
                    return Picked::FailOpen(Some(prep.pool));
                };
                let flight = prep.in_flight(key, choice.prefill_tokens);
                if let Some(t) = f.loads.get_mut(&*prep.pool) {
                    t.count(idx, &flight);
                }
                f.engine.commit(&prep, key);
                if let Some(ms) = prefix_relay {
                    let mut anchors = Vec::new();
                    prep.anchor_hashes(&mut anchors);
                    if !anchors.is_empty() {
                        let record = SyncRecord {
                            seq: 0,
                            pod: key,
                            anchors,
                        };
                        self.prefix_relay.push_back(Relayed {
                            at,
                            due: at + ms * 1_000_000,
                            from: gateway,
                            what: record,
                        });
                    }
                }
                self.relay_load(gateway, at, LoadEvent::Sent(flight.clone()));
                Picked::Pod(pod, Some(flight))
            }
            // Envoy's load balancing in the pool the request is routed to. (`Overflow` is
            // handled above.)
            Decision::FailOpen(_) | Decision::Overflow(_) => Picked::FailOpen(Some(prep.pool)),
            Decision::Shed | Decision::Hold(_) => Picked::Refused,
        }
    }

    /// Runs the engines until every routed request has its first token.
    fn drain(&mut self) {
        for _ in 0..10_000_000 {
            let waiting = self
                .requests
                .iter()
                .any(|o| self.out.ttft_ms[o.request].is_none());
            if !waiting {
                return;
            }
            let next = self
                .pods
                .iter()
                .filter_map(|p| {
                    let scale = p.engine.config().time_scale;
                    p.engine
                        .next_wakeup()
                        .map(|t| (t as f64 / scale).ceil() as u64)
                })
                .min();
            let Some(t) = next else {
                return;
            };
            self.run_to(t);
        }
    }

    fn finish(mut self) -> ReplayOutcome {
        for p in &self.pods {
            let s = p.engine.stats();
            self.out.prefix_queries += s.prefix_queries;
            self.out.prefix_hits += s.prefix_hits;
            self.out.adapter_loads += s.lora_loads;
        }
        self.out
    }
}

enum Picked {
    Pod(usize, Option<InFlight>),
    /// Left to Envoy's load balancing, in the pool named (`None`: the model's pods anywhere).
    FailOpen(Option<Arc<str>>),
    Refused,
}

/// The path the load generator sends a request of `api` to.
fn api_path(api: Api) -> &'static str {
    match api {
        Api::Chat => "/v1/chat/completions",
        Api::Completions => "/v1/completions",
    }
}

/// Another engine's in-flight change, in `f`'s view of the others' tables; `before`: it
/// happened before the snapshot both count against was installed.
fn peer_change(f: &mut Filter, what: &LoadEvent, before: bool) {
    match what {
        LoadEvent::Sent(fl) => {
            let Some(t) = f.peers.get_mut(&*fl.pool) else {
                return;
            };
            let Some(idx) = t.pods.iter().position(|p| p.key == fl.pod_key) else {
                return;
            };
            t.count(idx, fl);
            if before {
                let p = &mut t.pods[idx];
                p.base = p.base.saturating_add(fl.sequences);
                p.base_tokens = p.base_tokens.saturating_add(fl.tokens);
            }
        }
        LoadEvent::Done(pool, c) => {
            let Some(t) = f.peers.get_mut(&**pool) else {
                return;
            };
            c.apply(t);
            if let (
                true,
                Completion::Finished {
                    pod_key,
                    sequences,
                    tokens,
                    ..
                },
            ) = (before, c)
            {
                if let Some(p) = t.pods.iter_mut().find(|p| p.key == *pod_key) {
                    p.base = p.base.saturating_sub(*sequences);
                    p.base_tokens = p.base_tokens.saturating_sub(*tokens);
                }
            }
        }
    }
}
