//! gpuroute as an Envoy dynamic module: the same `gpuroute-core` decisions as the proxy-wasm
//! filter, compiled natively and run in Envoy's worker threads without a VM.
//!
//! Why a second shell: through Envoy, the proxy-wasm filter's fixed costs (a VM call per hook,
//! copying headers and the body into the VM, shared data through the host) and the ~2.5x
//! slower code inside V8 add ~55 us of gateway CPU per request (`make bench-envoy`); the same
//! decision natively takes a few microseconds. Behaviour is the wasm filter's, request for
//! request (the end-to-end suite runs against both: `GPUROUTE_RUNTIME=dynamic`); what differs
//! is only where state lives:
//!
//! - the snapshot is one process-wide `Arc` swapped by the ingest path (no shared-data copy, no
//!   per-worker decode);
//! - the in-flight tables and the prefix index are one per filter configuration, behind a
//!   mutex held only for the decision (prefix lookups, score, count, commit): every worker sees
//!   every other worker's picks at once, with no sync ring. Reading the body (parse, resolve,
//!   hash the prompt) needs none of that and runs before the lock, in parallel across workers;
//! - metrics are defined when the configuration loads (Envoy freezes definitions after that),
//!   so per-pool counters exist for the configured pools, and per-pod picks are one counter
//!   labelled by pool and endpoint (`gpuroute_pool`, `gpuroute_endpoint`: the labels
//!   envoy/render.py's tag extraction gives the wasm filter's per-pod counters); requests only
//!   add to a local tally, which a ticker thread has Envoy's main thread hand over every
//!   `tick_ms` (Envoy's own metric calls cost more per request than the decision);
//! - requests held while their pool is saturated (`hold`) wait in one queue per filter
//!   configuration, for every worker; the ticker thread, and each request's end, wake the
//!   first of each pool on its own worker through Envoy's per-stream scheduler (and the
//!   requests waiting for the pod caching their prompt or adapter, `hold.affinity_wait_ms`: on
//!   a tick all of them, on a request's end those waiting for its pod).
//!
//! The ABI is pinned to Envoy 1.40 (see [`abi`]); a module built for another Envoy version
//! must not be loaded.

pub mod abi;
mod host;

use abi::{ConfigEnvoyPtr, EnvoyBuffer, FilterEnvoyPtr, REQUEST_HEADERS, RESPONSE_HEADERS};
use gpuroute_core::config::{DataPlane, FilterConfig};
use gpuroute_core::engine::{self, DecideOptions, Engine, Prepared, Reader, RequestContext};
use gpuroute_core::error::{ApiError, ErrorStyle};
use gpuroute_core::exchange::{self, Cursor, Export};
use gpuroute_core::fleet::{pod_stat_key, stat_segment, FleetState, PodStatSet, OTHER_POD};
use gpuroute_core::form;
use gpuroute_core::headers::{self, RequestHead};
use gpuroute_core::hold::{self, held_stat, hold_ms_stat, hold_stat, HoldEvent, HoldQueue};
use gpuroute_core::idmap::{IdMap, NameMap};
use gpuroute_core::ingest::{self, Endpoint, StoredHeader};
use gpuroute_core::load::{Completion, InFlight, LoadTable, PodLoad};
use gpuroute_core::outlier;
use gpuroute_core::picker::{Decision, HoldReason};
use gpuroute_core::prefix;
use gpuroute_core::replica_load::{self, ReplicaLoad, ReplicaLoads};
use gpuroute_core::request;
use gpuroute_core::rng::SplitMix64;
use gpuroute_core::routing::{
    failover_stat, overflow_stat, split_rerouted_stat, split_stat, ModelsQuery,
};
use host::{ConfigStats, Definer, Scheduler, Stream, StreamScheduler};
use std::collections::HashMap;
use std::ffi::c_void;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock, PoisonError, RwLock, Weak};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const OUTCOMES: &[&str] = &["picked", "fail_open", "shed", "error", "routed"];
const FAIL_OPEN: &[&str] = &["no_snapshot", "unknown_pool", "no_fresh_pod"];
const REJECTED: &[&str] = &[
    "invalid_json",
    "invalid_type",
    "model_not_found",
    "missing_required_parameter",
    "request_too_large",
    "unsupported_content_encoding",
    "invalid_form",
    "method_not_allowed",
    "other",
];

/// The accepted snapshot, shared by every worker and every filter configuration.
static FLEET: RwLock<Option<Arc<FleetState>>> = RwLock::new(None);
/// The version of the snapshot in [`FLEET`] (written with it): a request that read another one
/// can tell without the lock.
static FLEET_VERSION: AtomicU64 = AtomicU64::new(0);

/// Every live filter configuration, by a process-wide id: the prefix-record exchange between
/// gateway replicas (`exchange`) arrives on the ingest listener's configuration and reads or
/// feeds the routing configurations' engines.
static CONFIGS: Mutex<Vec<(u32, Weak<Config>)>> = Mutex::new(Vec::new());
static NEXT_CONFIG_ID: AtomicU32 = AtomicU32::new(0);

/// The live configurations that route (have pools), dropping the dead from the list.
fn routing_configs() -> Vec<(u32, Arc<Config>)> {
    let mut all = lock(&CONFIGS);
    all.retain(|(_, c)| c.strong_count() > 0);
    all.iter()
        .filter_map(|(id, c)| Some((*id, c.upgrade()?)))
        .filter(|(_, c)| !c.settings.pools.is_empty())
        .collect()
}

/// The module's clock, ms: Unix time as the wall clock read it when first asked, then counted
/// on the monotonic clock, so it never steps. Every age and deadline is measured on it: on the
/// wall clock, a step back (an NTP correction, a VM resumed) made a snapshot received before it
/// look new for as long as the step, and a dead aggregator's last snapshot was routed on for
/// that long instead of failing open.
fn now_ms() -> u64 {
    static BASE: OnceLock<(u64, Instant)> = OnceLock::new();
    let (wall, at) = BASE.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        (wall, Instant::now())
    });
    wall.saturating_add(at.elapsed().as_millis() as u64)
}

/// This Envoy process's epoch for the prefix exchange's cursors ([`Export::of_envoy`]): at
/// random, once per process.
fn envoy_epoch() -> u64 {
    static EPOCH: OnceLock<u64> = OnceLock::new();
    *EPOCH.get_or_init(|| {
        let wall = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        gpuroute_core::rng::mix64(wall ^ (u64::from(std::process::id()) << 40)).max(1)
    })
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing in this module panics while holding a lock; if something ever did, the state is
    // still consistent enough to route with (counts may be off until the next snapshot).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn current_fleet() -> Option<Arc<FleetState>> {
    FLEET.read().unwrap_or_else(PoisonError::into_inner).clone()
}

/// Metric ids (defined at configuration time; `None` if Envoy refused one).
struct Metrics {
    /// Per pool, one id per entry of `OUTCOMES` (looked up by `&str`: no allocation per request).
    outcome: NameMap<String, Vec<Option<usize>>>,
    fail_open: HashMap<&'static str, Option<usize>>,
    /// Per split, one id per target, in configuration order, and the `rerouted` counter's.
    split: NameMap<String, (Vec<Option<usize>>, Option<usize>)>,
    /// Per pool with `failover`: the counters of each of its failover pools.
    failover: NameMap<String, Vec<FailoverIds>>,
    rejected: HashMap<&'static str, Option<usize>>,
    /// `gpuroute.<endpoint>.rejected.<reason>`, by endpoint and reason.
    ingest_rejected: HashMap<(Endpoint, &'static str), Option<usize>>,
    prefix_exported: Option<usize>,
    prefix_imported: Option<usize>,
    replica_load_exported: Option<usize>,
    replica_load_imported: Option<usize>,
    snapshot_accepted: Option<usize>,
    snapshot_age: Option<usize>,
    snapshot_pods: Option<usize>,
    models_list: Option<usize>,
    /// `gpuroute.responses.{learned,pinned,unpinned}`.
    responses_learned: Option<usize>,
    responses_pinned: Option<usize>,
    responses_unpinned: Option<usize>,
    decision_us: Option<usize>,
    /// Per pool: `gpuroute.pool.<pool>.ttft_ms`.
    ttft: NameMap<String, Option<usize>>,
    /// Per pool: `gpuroute.pool.<pool>.ejections` (pods out of the picks for server errors).
    ejections: NameMap<String, Option<usize>>,
    /// Per pool: `gpuroute.pool.<pool>.unanswered` (requests a pod took and did not serve).
    unanswered: NameMap<String, Option<usize>>,
    picks: Option<usize>,
    /// `gpuroute.module.panics`: panics caught in a hook ([`guarded`]).
    panics: Option<usize>,
    /// `hold` (defined only when it is on): per pool `gpuroute.hold.<pool>.{held,affinity,
    /// released,expired,answered,cancelled,full}`, the `gpuroute.held.<pool>` gauge and the
    /// `gpuroute.hold_ms.<pool>` histogram.
    hold: Option<HoldMetrics>,
}

/// The counters of requests one pool sent to one of its failover pools, `to`:
/// `gpuroute.failover.<pool>.to.<to>` and, with `overflow`, `gpuroute.overflow.<pool>.to.<to>`.
struct FailoverIds {
    to: String,
    failover: Option<usize>,
    overflow: Option<usize>,
}

struct HoldMetrics {
    /// Each configured pool's index in `pools`.
    index: NameMap<String, usize>,
    pools: Vec<PoolHoldIds>,
}

/// A pool's hold metrics.
struct PoolHoldIds {
    /// In [`HoldEvent::ALL`]'s order.
    counters: [Option<usize>; HoldEvent::ALL.len()],
    held: Option<usize>,
    wait_ms: Option<usize>,
}

impl HoldMetrics {
    /// The counter of `event` for a request held (or, `Full`, to be held) in `pool`.
    fn id(&self, pool: &str, event: HoldEvent) -> Option<usize> {
        let ids = self.pools.get(*self.index.get(pool)?)?;
        ids.counters.get(event as usize).copied().flatten()
    }

    /// The histogram of how long the requests held in `pool` waited.
    fn wait_ms(&self, pool: &str) -> Option<usize> {
        self.pools.get(*self.index.get(pool)?)?.wait_ms
    }
}

impl Metrics {
    fn define(d: &Definer, config: &FilterConfig) -> Metrics {
        let outcome = config
            .pools
            .iter()
            .map(|p| {
                let ids = OUTCOMES
                    .iter()
                    .map(|o| {
                        let name = format!("gpuroute.pool.{}.requests.{o}", stat_segment(&p.name));
                        d.counter(&name, &[])
                    })
                    .collect();
                (p.name.clone(), ids)
            })
            .collect();
        let named = |prefix: &str, list: &[&'static str]| {
            list.iter()
                .map(|r| (*r, d.counter(&format!("{prefix}.{r}"), &[])))
                .collect::<HashMap<_, _>>()
        };
        let split = config
            .splits
            .iter()
            .map(|(name, targets)| {
                let ids = targets
                    .iter()
                    .map(|t| d.counter(&split_stat(name, &t.model), &[]))
                    .collect();
                let rerouted = d.counter(&split_rerouted_stat(name), &[]);
                (name.clone(), (ids, rerouted))
            })
            .collect();
        let failover = config
            .pools
            .iter()
            .filter(|p| !p.failover.is_empty())
            .map(|p| {
                let ids = p
                    .failover
                    .iter()
                    .map(|to| FailoverIds {
                        to: to.clone(),
                        failover: d.counter(&failover_stat(&p.name, to), &[]),
                        overflow: p
                            .overflow
                            .then(|| d.counter(&overflow_stat(&p.name, to), &[]))
                            .flatten(),
                    })
                    .collect();
                (p.name.clone(), ids)
            })
            .collect();
        // Per pool, a counter `gpuroute.pool.<pool>.<what>`.
        let pool_counters = |what: &str| -> NameMap<String, Option<usize>> {
            config
                .pools
                .iter()
                .map(|p| {
                    let name = format!("gpuroute.pool.{}.{what}", stat_segment(&p.name));
                    (p.name.clone(), d.counter(&name, &[]))
                })
                .collect()
        };
        Metrics {
            outcome,
            split,
            failover,
            fail_open: named("gpuroute.fail_open", FAIL_OPEN),
            rejected: named("gpuroute.rejected", REJECTED),
            ingest_rejected: Endpoint::ALL
                .iter()
                .flat_map(|ep| {
                    let prefix = format!("gpuroute.{}.rejected", ep.stat());
                    named(&prefix, &ingest::REJECT_REASONS)
                        .into_iter()
                        .map(move |(r, id)| ((*ep, r), id))
                })
                .collect(),
            prefix_exported: d.counter("gpuroute.prefix.exported", &[]),
            prefix_imported: d.counter("gpuroute.prefix.imported", &[]),
            replica_load_exported: d.counter("gpuroute.replica_load.exported", &[]),
            replica_load_imported: d.counter("gpuroute.replica_load.imported", &[]),
            snapshot_accepted: d.counter("gpuroute.snapshot.accepted", &[]),
            snapshot_age: d.gauge("gpuroute.snapshot.age_ms"),
            snapshot_pods: d.gauge("gpuroute.snapshot.pods"),
            models_list: d.counter("gpuroute.models_list", &[]),
            responses_learned: d.counter("gpuroute.responses.learned", &[]),
            responses_pinned: d.counter("gpuroute.responses.pinned", &[]),
            responses_unpinned: d.counter("gpuroute.responses.unpinned", &[]),
            decision_us: d.histogram("gpuroute.decision_us"),
            ttft: config
                .pools
                .iter()
                .map(|p| {
                    let name = format!("gpuroute.pool.{}.ttft_ms", stat_segment(&p.name));
                    (p.name.clone(), d.histogram(&name))
                })
                .collect(),
            ejections: pool_counters("ejections"),
            unanswered: pool_counters("unanswered"),
            picks: d.counter(
                "gpuroute.pool.picks",
                &["gpuroute_pool", "gpuroute_endpoint"],
            ),
            panics: d.counter("gpuroute.module.panics", &[]),
            // The pools the proxy-wasm build defines them for too (`hold::stat_pools`).
            hold: config.hold.map(|_| HoldMetrics {
                index: hold::stat_pools(config)
                    .enumerate()
                    .map(|(i, p)| (p.to_string(), i))
                    .collect(),
                pools: hold::stat_pools(config)
                    .map(|p| PoolHoldIds {
                        counters: HoldEvent::ALL.map(|e| d.counter(&hold_stat(p, e), &[])),
                        held: d.gauge(&held_stat(p)),
                        wait_ms: d.histogram(&hold_ms_stat(p)),
                    })
                    .collect(),
            }),
        }
    }

    fn outcome_id(&self, pool: &str, outcome: &'static str) -> Option<usize> {
        let i = OUTCOMES.iter().position(|o| *o == outcome)?;
        self.outcome.get(pool)?.get(i).copied().flatten()
    }

    /// The counters of a split request: of the target it took, and `rerouted` if it was.
    fn split_ids(&self, prep: &Prepared) -> [Option<usize>; 2] {
        let Some(taken) = prep.split.as_ref() else {
            return [None, None];
        };
        let Some((targets, rerouted)) = self.split.get(&taken.split.name) else {
            return [None, None];
        };
        let target = targets.get(taken.target).copied().flatten();
        [target, rerouted.filter(|_| taken.rerouted)]
    }

    /// The counter of a request sent to its pool's failover pool (`prep.pool`), if it was.
    fn failover_id(&self, prep: &Prepared) -> Option<usize> {
        let f = prep.failed_over.as_ref()?;
        let ids = self
            .failover
            .get(&*f.from)?
            .iter()
            .find(|ids| *ids.to == *prep.pool)?;
        if f.overflow {
            ids.overflow
        } else {
            ids.failover
        }
    }

    fn rejected_id(&self, code: Option<&str>) -> Option<usize> {
        let key = code
            .and_then(|c| REJECTED.iter().find(|r| **r == c))
            .copied()
            .unwrap_or("other");
        self.rejected.get(key).copied().flatten()
    }

    /// `gpuroute.<endpoint>.rejected.<reason>`.
    fn ingest_rejected_id(&self, ep: Endpoint, reason: &'static str) -> Option<usize> {
        self.ingest_rejected.get(&(ep, reason)).copied().flatten()
    }
}

/// Metric updates not yet handed to Envoy. The request path only adds to this (one short lock,
/// no call into Envoy); `Config::flush` hands it over on Envoy's main thread every `tick_ms`.
/// Envoy's labelled counters cost ~5 us per increment (a symbol-table lookup under a lock) and
/// even plain counters and histograms a few, which batching takes off the request path.
#[derive(Default)]
struct Pending {
    counts: IdMap<usize, u64>,
    /// Picks per pool, per pod (by pod key): the pod's address and the count.
    picks: NameMap<String, IdMap<u64, (String, u64)>>,
    decision_us: Vec<u64>,
    /// Streamed requests' times from their decision to their first response byte: each pool's
    /// `ttft_ms` histogram and the value, ms.
    first_token_ms: Vec<(usize, u64)>,
    snapshot_pods: Option<u64>,
    /// How long each request taken out of `hold` since the last flush waited: its pool's
    /// `hold_ms` histogram and the value, ms.
    hold_ms: Vec<(usize, u64)>,
}

/// The longest the snapshot-age gauge goes without an update when nothing else is pending.
const GAUGE_REFRESH: Duration = Duration::from_secs(1);

/// Decision times kept per tick at most (beyond this, one in two is dropped: the histogram stays
/// representative and memory bounded).
const MAX_PENDING_TIMES: usize = 65_536;

impl Pending {
    fn count(&mut self, id: Option<usize>) {
        self.add(id, 1);
    }

    fn add(&mut self, id: Option<usize>, n: u64) {
        if let Some(id) = id {
            *self.counts.entry(id).or_insert(0) += n;
        }
    }

    fn pick(&mut self, pool: &str, pod_key: u64, address: &str) {
        if !self.picks.contains_key(pool) {
            self.picks.insert(pool.to_string(), IdMap::default());
        }
        if let Some(pods) = self.picks.get_mut(pool) {
            pods.entry(pod_key)
                .or_insert_with(|| (address.to_string(), 0))
                .1 += 1;
        }
    }

    fn decision_time(&mut self, us: u64) {
        push_bounded(&mut self.decision_us, us);
    }

    fn first_token(&mut self, histogram: Option<usize>, ms: u64) {
        if let Some(id) = histogram {
            push_bounded(&mut self.first_token_ms, (id, ms));
        }
    }

    fn is_empty(&self) -> bool {
        self.counts.is_empty()
            && self.picks.is_empty()
            && self.decision_us.is_empty()
            && self.first_token_ms.is_empty()
            && self.snapshot_pods.is_none()
            && self.hold_ms.is_empty()
    }
}

/// Appends `x`; at `MAX_PENDING_TIMES` one value in two is dropped first (a histogram's values
/// stay representative and memory bounded).
fn push_bounded<T>(values: &mut Vec<T>, x: T) {
    if values.len() >= MAX_PENDING_TIMES {
        let mut keep = false;
        values.retain(|_| {
            keep = !keep;
            keep
        });
    }
    values.push(x);
}

/// This Envoy's requests in flight per pod, per pool (re-aligned with each new snapshot): one
/// set for the process, like the snapshot, whatever filter configuration routed them. Each
/// configuration kept its own before, so after a change (an LDS update) the new one routed as
/// if the requests still running under the old one (for as long as they drain) were not there
/// (an audit: a pod with a stream in progress scored as idle, and got the next request).
/// Locked after a configuration's `router` when both are held, never before.
static LOADS: LazyLock<parking_lot::Mutex<NameMap<String, LoadTable>>> =
    LazyLock::new(Default::default);

/// Routing state of one filter configuration, shared by all workers.
struct Router {
    engine: Engine,
    rng: SplitMix64,
    /// Other gateway replicas' requests in prefill (`ingest.load_path`).
    replicas: ReplicaView,
    /// Requests sent to a pod and not answered yet, with passive health's `unanswered_ms` on
    /// ([`outlier::Unanswered`]): each with the state its stream sets to [`ANSWERED`] when the
    /// answer's headers come (no lock on the answer's path), and the ticker to [`LOST`] when it
    /// judges it so; a state no stream holds any more is a request that ended unanswered. The
    /// ticker judges them ([`Config::check_unanswered`]).
    unanswered: Vec<(Arc<AtomicU8>, outlier::Unanswered)>,
    /// The snapshot version the ticker last judged them by (a verdict needs a new reading).
    unanswered_judged: u64,
}

/// The most requests [`Router::unanswered`] holds: the ticker sweeps out the answered and
/// ended ones; without a ticker (no scheduler for the configuration) the request path does.
const MAX_UNANSWERED: usize = 65_536;

/// The state of a request in [`Router::unanswered`]: no answer yet.
const AWAITED: u8 = 0;
/// Its answer came.
const ANSWERED: u8 = 1;
/// Judged unanswered: counted in its pod's run, where a server error answering it (Envoy's 504
/// at a route timeout) is not counted again.
const LOST: u8 = 2;

impl Router {
    /// Whether another request fits in `unanswered`, after sweeping out, when it is full, those
    /// answered or ended (not judged: that is the ticker's).
    fn unanswered_room(&mut self) -> bool {
        if self.unanswered.len() >= MAX_UNANSWERED {
            self.unanswered
                .retain(|(a, _)| Arc::strong_count(a) > 1 && a.load(Ordering::Acquire) == AWAITED);
        }
        self.unanswered.len() < MAX_UNANSWERED
    }
}

/// Other gateway replicas' requests in prefill, as this Envoy adds them to its own counts.
#[derive(Default)]
struct ReplicaView {
    held: ReplicaLoads,
    /// Posts taken: each changes what is added.
    posts: u64,
    /// Per pool, the counts aligned with the snapshot's pods.
    aligned: NameMap<String, replica_load::Aligned>,
    /// A pool's table with the replicas' counts added: the view a pick reads, kept between
    /// requests so that filling it allocates nothing.
    view: Vec<PodLoad>,
}

impl ReplicaView {
    /// Fills `self.view` with the pods of `pool`'s table `loads` plus the other replicas'
    /// requests in prefill (fresh at `now_ms`); `false` (nothing to add): `loads` is the view.
    fn add(
        &mut self,
        pool: &str,
        loads: &LoadTable,
        fleet: Option<&FleetState>,
        now_ms: u64,
    ) -> bool {
        if self.held.is_empty() {
            return false;
        }
        let Some((f, p)) = fleet.and_then(|f| Some((f, f.pool(pool)?))) else {
            return false;
        };
        if !self.aligned.contains_key(pool) {
            self.aligned
                .insert(pool.to_string(), replica_load::Aligned::default());
        }
        let Some(aligned) = self.aligned.get_mut(pool) else {
            return false;
        };
        self.view.clear();
        self.view.extend_from_slice(&loads.pods);
        aligned.add_to(
            &mut self.view,
            &self.held,
            self.posts,
            pool,
            f.version,
            &p.keys,
            now_ms,
        );
        true
    }
}

/// One filter configuration (`on_http_filter_config_new`).
struct Config {
    settings: FilterConfig,
    /// Reads requests (parse, resolve, hash) and answers the models path, outside the router's
    /// lock: the lock is held only for what needs the shared state (prefix lookups, the pick,
    /// the counts).
    reader: Reader,
    /// `parking_lot`'s mutex: it spins with back-off before parking a waiting worker, and the
    /// lock is held for microseconds; std's parks almost at once, and waking a parked worker
    /// costs more than the wait (`shared_engine` in core/benches/decision.rs).
    router: parking_lot::Mutex<Router>,
    /// Whether the router's passive health has a pod on record
    /// ([`gpuroute_core::outlier::Outliers::tracking`]): only then does a success take the lock.
    outliers_tracking: AtomicBool,
    metrics: Metrics,
    pending: parking_lot::Mutex<Pending>,
    /// Wakes the main thread to flush `pending`; taken out (and deleted) when Envoy destroys
    /// the configuration, which also ends the ticker thread.
    scheduler: Mutex<Option<Scheduler>>,
    /// When this configuration was loaded: before any snapshot, the snapshot-age gauge is how
    /// long it has run without one.
    created: Instant,
    /// Requests held while their pool is saturated (`hold`), from every worker, in the order
    /// they are to go.
    held: parking_lot::Mutex<HoldQueue<HeldEntry>>,
    next_held: AtomicU64,
    /// Envoy's side of this configuration, for the last flush when Envoy destroys it.
    envoy: ConfigStats,
}

/// The pods that have a picks label of their own (`max_pod_stats`), for the whole process:
/// Envoy keeps every labelled counter it was given for as long as it runs, whatever
/// configuration gave it. Only `flush` (Envoy's main thread) uses it.
static POD_STATS: LazyLock<parking_lot::Mutex<PodStatSet>> = LazyLock::new(Default::default);

/// A held request: its pool and deadline, and how to wake its stream on its worker.
struct HeldEntry {
    id: u64,
    pool: Arc<str>,
    deadline: Instant,
    /// The key of the pod it waits for, when its last decision held it for the pod that caches
    /// its prompt (`hold.affinity_wait_ms`); 0 when it waits for its pool to have room. Such a
    /// request is asked again at each tick and when that pod's request ends, and the requests
    /// behind it may go.
    awaits: AtomicU64,
    wake: StreamScheduler,
    /// An event to decide again is on its way to the stream (committed, not yet run): another
    /// is not committed until it runs. Without this, every request that went after its wait
    /// ran out woke every other expired one again (`Wake::Sent`): N held requests whose waits
    /// ran out together posted ~N²/2 events to the workers (6,000 took Envoy from 0.2 to 1.3 GB).
    asked: AtomicBool,
    /// Queued behind held requests of its pool on its arrival (`Filter::route_body`), not decided
    /// yet: woken once one ahead decides to wait on (the room may suit it, not them).
    behind: AtomicBool,
}

impl HeldEntry {
    /// Wakes the stream to decide again, unless an earlier wake has not run yet.
    fn ask(&self) {
        if !self.asked.swap(true, Ordering::Relaxed) {
            self.wake.commit(self.id);
        }
    }
}

impl Config {
    fn new(raw: &[u8], definer: &Definer) -> Result<Config, String> {
        let settings = FilterConfig::from_json(raw).map_err(|e| e.to_string())?;
        let metrics = Metrics::define(definer, &settings);
        let hold_order = settings.hold.map(|h| h.order).unwrap_or_default();
        // One engine for every worker: picks are visible to all at once, no sync log needed.
        let engine = Engine::new(settings.clone()).without_sync_log();
        let reader = engine.reader().clone();
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Ok(Config {
            settings,
            reader,
            router: parking_lot::Mutex::new(Router {
                engine,
                rng: SplitMix64::new(seed),
                replicas: ReplicaView::default(),
                unanswered: Vec::new(),
                unanswered_judged: 0,
            }),
            outliers_tracking: AtomicBool::new(false),
            metrics,
            pending: parking_lot::Mutex::new(Pending::default()),
            scheduler: Mutex::new(None),
            created: Instant::now(),
            held: parking_lot::Mutex::new(HoldQueue::new(hold_order)),
            next_held: AtomicU64::new(1),
            envoy: ConfigStats(definer.0),
        })
    }

    fn count(&self, id: Option<usize>) {
        self.pending.lock().count(id);
    }

    /// Whether passive health is on (`outlier_detection.consecutive_5xx` > 0): without it no
    /// answer's status is read.
    fn outliers_on(&self) -> bool {
        self.settings.outlier_detection.consecutive_5xx > 0
    }

    /// Hands the pending metric updates to Envoy (main thread, `on_http_filter_config_scheduled`).
    fn flush(&self, stats: ConfigStats) {
        let p = std::mem::take(&mut *self.pending.lock());
        let m = &self.metrics;
        for (id, n) in p.counts {
            stats.counter(Some(id), &[], n);
        }
        // Process-wide; every configuration's counter is the one Envoy stat.
        let panics = PANICS.swap(0, Ordering::Relaxed);
        if panics > 0 {
            stats.counter(m.panics, &[], panics);
        }
        let limit = self.settings.max_pod_stats;
        let mut admitted = POD_STATS.lock();
        for (pool, pods) in p.picks.iter().filter(|_| limit > 0) {
            // The pool label as the other counters' names have it (and the proxy-wasm build's).
            let label = stat_segment(pool);
            let mut other = 0;
            for (key, (addr, n)) in pods {
                if admitted.admit(pod_stat_key(pool, *key), limit) {
                    stats.counter(m.picks, &[label.as_str(), addr.as_str()], *n);
                } else {
                    other += n;
                }
            }
            if other > 0 {
                stats.counter(m.picks, &[label.as_str(), OTHER_POD], other);
            }
        }
        drop(admitted);
        for us in p.decision_us {
            stats.histogram(m.decision_us, us);
        }
        for (id, ms) in p.first_token_ms {
            stats.histogram(Some(id), ms);
        }
        if let Some(h) = &m.hold {
            for (id, ms) in p.hold_ms {
                stats.histogram(Some(id), ms);
            }
            // Every live configuration's held in each of this one's pools (they share the
            // gauges): during an LDS change the old one still holds requests the new one's
            // queue does not have. By the pool each was first held in, as its counters.
            let mut held = vec![0u64; h.pools.len()];
            for (_, c) in routing_configs() {
                for e in c.held.lock().iter() {
                    if let Some(n) = h.index.get(&*e.pool).and_then(|i| held.get_mut(*i)) {
                        *n += 1;
                    }
                }
            }
            for (ids, n) in h.pools.iter().zip(held) {
                stats.gauge(ids.held, n);
            }
        }
        if let Some(n) = p.snapshot_pods {
            stats.gauge(m.snapshot_pods, n);
        }
        match current_fleet() {
            Some(f) => stats.gauge(m.snapshot_age, f.age_ms(now_ms())),
            // Not 0 ("fresh") before any snapshot: how long this configuration has run without one.
            None if !self.settings.pools.is_empty() => {
                stats.gauge(m.snapshot_age, self.created.elapsed().as_millis() as u64)
            }
            None => {}
        }
    }

    /// Starts the ticker: every `tick_ms` it asks Envoy's main thread to run `flush` when
    /// something is pending, and at least every `GAUGE_REFRESH` for a routing configuration
    /// (its snapshot-age gauge moves by itself). An idle gateway is woken once a second, not 50
    /// times. It holds only a weak reference and stops once the scheduler is gone.
    fn start_ticker(config: &Arc<Config>, scheduler: Scheduler) {
        *lock(&config.scheduler) = Some(scheduler);
        let weak = Arc::downgrade(config);
        let tick = Duration::from_millis(config.settings.tick_ms.max(1));
        let spawned = std::thread::Builder::new()
            .name("gpuroute-stats".into())
            .spawn(move || {
                let mut flushed = Instant::now();
                loop {
                    std::thread::sleep(tick);
                    let Some(c) = weak.upgrade() else { return };
                    // New snapshots, and the deadlines of held requests, are looked at here.
                    c.check_unanswered();
                    let holding = c.wake_held(Wake::Tick);
                    let gauge_due =
                        !c.settings.pools.is_empty() && flushed.elapsed() >= GAUGE_REFRESH;
                    let work = gauge_due || holding || !c.pending.lock().is_empty();
                    let guard = lock(&c.scheduler);
                    match guard.as_ref() {
                        Some(s) if work => {
                            s.commit(0);
                            flushed = Instant::now();
                        }
                        Some(_) => {}
                        None => return,
                    }
                }
            });
        if spawned.is_err() {
            host::log(abi::LOG_ERROR, "gpuroute: could not start the stats ticker");
        }
    }

    /// Judges the requests not answered yet ([`outlier::Unanswered`]), on the ticker: those
    /// answered are dropped; one that ended unanswered is judged once more and dropped; the
    /// others are judged when a new snapshot came since the last time. One judged lost counts
    /// in its pod's run as a server error does.
    fn check_unanswered(&self) {
        let mut r = self.router.lock();
        if r.unanswered.is_empty() {
            return;
        }
        let fleet = current_fleet();
        let version = fleet.as_ref().map_or(0, |f| f.version);
        let new_reading = version != r.unanswered_judged;
        r.unanswered_judged = version;
        let now = now_ms();
        let grace = r.engine.outliers.unanswered_ms();
        let mut list = std::mem::take(&mut r.unanswered);
        let mut lost = Vec::new();
        // Out: those answered, and those that ended (judged once more, alone on their pod).
        list.retain_mut(|(answer, sent)| {
            // The count first: a stream sets its flag before it drops its handle.
            let ended = Arc::strong_count(answer) == 1;
            std::sync::atomic::fence(Ordering::Acquire);
            if answer.load(Ordering::Acquire) != AWAITED {
                return false;
            }
            if !ended {
                return true;
            }
            if let Some(f) = fleet.as_deref() {
                if let outlier::Verdict::Lost { waited_ms } = sent.judge(f, grace, 1, now) {
                    lost.push((sent.clone(), waited_ms));
                }
            }
            false
        });
        // The others together, by a new reading ([`outlier::judge_all`]).
        if let Some(f) = fleet.as_deref().filter(|_| new_reading) {
            let verdicts = {
                let mut refs: Vec<&mut outlier::Unanswered> =
                    list.iter_mut().map(|(_, u)| u).collect();
                outlier::judge_all(&mut refs, f, grace, now)
            };
            let mut verdicts = verdicts.into_iter();
            list.retain(|(answer, sent)| match verdicts.next() {
                None | Some(outlier::Verdict::Wait) => true,
                Some(outlier::Verdict::Gone) => false,
                Some(outlier::Verdict::Lost { waited_ms }) => {
                    // Not if its answer came meanwhile; else its stream knows (`Filter::answered`).
                    let swapped =
                        answer.compare_exchange(AWAITED, LOST, Ordering::AcqRel, Ordering::Acquire);
                    if swapped.is_ok() {
                        lost.push((sent.clone(), waited_ms));
                    }
                    false
                }
            });
        }
        r.unanswered = list;
        let mut ejected = Vec::new();
        for (sent, waited_ms) in lost {
            let e = r.engine.unanswered(&sent, fleet.as_deref(), now);
            ejected.push((sent, waited_ms, e));
        }
        let tracking = r.engine.outliers.tracking();
        drop(r);
        self.outliers_tracking.store(tracking, Ordering::Relaxed);
        for (sent, waited_ms, e) in ejected {
            let m = &self.metrics;
            self.count(m.unanswered.get(&*sent.pool).copied().flatten());
            let Some(e) = e else { continue };
            self.count(m.ejections.get(&*sent.pool).copied().flatten());
            let address = fleet
                .as_deref()
                .and_then(|f| f.address_of(&sent.pool, sent.pod))
                .unwrap_or("(gone)");
            host::log(
                abi::LOG_WARN,
                &e.unanswered_message(
                    address,
                    &sent.pool,
                    self.settings.outlier_detection.consecutive_5xx,
                    waited_ms,
                ),
            );
        }
    }

    /// Counts a change in a pod's in-flight load (first byte back, or the end of the request).
    fn complete(&self, pool: &str, op: Completion) {
        if let Some(t) = LOADS.lock().get_mut(pool) {
            op.apply(t);
        }
    }

    /// Asks held requests to decide again, each on its own worker (`on_http_filter_scheduled`):
    /// every one whose wait ran out, the first of each pool that waits for room, and those that
    /// wait for the pod caching their prompt or adapter, all of them on a tick, on a request's end
    /// those waiting for its pod. One that goes wakes the next. Returns whether any request is
    /// held.
    fn wake_held(&self, why: Wake) -> bool {
        if self.settings.hold.is_none() {
            return false;
        }
        let held = self.held.lock();
        let now = Instant::now();
        let mut asked: Vec<&str> = Vec::new();
        for e in held.iter() {
            let awaits = e.awaits.load(Ordering::Relaxed);
            let ask = if e.deadline <= now {
                true
            } else if awaits != 0 {
                why == Wake::Tick || why == Wake::Ended(awaits)
            } else if !asked.contains(&&*e.pool) {
                asked.push(&e.pool);
                true
            } else {
                false
            };
            if ask {
                e.ask();
            }
        }
        !held.is_empty()
    }

    /// Request `id`, held, decided again to wait for the pod `awaits` that caches its prompt or
    /// adapter (0: for its pool to have room): marked so. Waiting for its prompt's pod, it left the
    /// room it was asked about: the first request of its pool that waits for room is asked.
    /// Waiting for room, the requests queued behind it on arrival are asked (once each).
    fn still_held(&self, id: u64, awaits: u64) {
        let held = self.held.lock();
        let Some(e) = held.iter().find(|e| e.id == id) else {
            return;
        };
        e.awaits.store(awaits, Ordering::Relaxed);
        if awaits == 0 {
            // Its pool still has no room for it: those queued behind it on arrival decide once,
            // the room there may be may suit them.
            for n in held.iter().filter(|n| n.pool == e.pool) {
                if n.behind.swap(false, Ordering::Relaxed) {
                    n.ask();
                }
            }
            return;
        }
        let next = held
            .iter()
            .find(|n| n.pool == e.pool && n.awaits.load(Ordering::Relaxed) == 0);
        if let Some(n) = next {
            n.ask();
        }
    }

    /// Request `id`'s wake has run: the next one is committed again.
    fn asked(&self, id: u64) {
        if let Some(e) = self.held.lock().iter().find(|e| e.id == id) {
            e.asked.store(false, Ordering::Relaxed);
            e.behind.store(false, Ordering::Relaxed);
        }
    }

    /// Takes a held request out of the queue; false if it was not in it.
    fn unhold(&self, id: u64) -> bool {
        self.held.lock().remove(|e| e.id == id)
    }
}

/// Why held requests are asked to decide again ([`Config::wake_held`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// The ticker: new snapshots, deadlines.
    Tick,
    /// A request on this pod (key) ended, leaving room on it.
    Ended(u64),
    /// A held request went: the next of its pool may fit too.
    Sent,
}

enum Mode {
    Pass,
    Inference,
    /// A snapshot, or prefix records from other gateway replicas (`exchange`), being buffered.
    Ingest(Endpoint),
    Answered,
    /// Held while its pool is saturated (`hold`): stopped until `on_scheduled` sends it.
    Held,
}

/// A request held while its pool is saturated, or while the pod caching its prompt or adapter is.
struct Held {
    prep: Box<Prepared>,
    /// Its entry in `Config::held`.
    id: u64,
    /// When it was first held: with `hold`'s limits, how long it may still wait.
    since: Instant,
    /// It has waited for that pod (counted once, `gpuroute.hold.<pool>.affinity`).
    waited_for_affinity: bool,
    /// The pool it was first held in: its hold counters and its place in the held gauge
    /// (`HeldEntry::pool`), wherever a later decision moves it (`Engine::homeward`, overflow).
    pool: Arc<str>,
}

/// One HTTP stream (`on_http_filter_new`).
struct Filter {
    config: Arc<Config>,
    mode: Mode,
    head: RequestHead,
    /// A form's bytes buffered when it was last read for its fields before its end.
    form_scanned: usize,
    picked: Option<InFlight>,
    /// When a streamed request was routed: its time to the first response byte goes to its
    /// pool's `ttft_ms`.
    ttft_from: Option<Instant>,
    /// A Responses API request's pod and its answer's first bytes, until they give the answer's
    /// id.
    learn_response: Option<(u64, request::ResponseHead)>,
    /// A streamed Responses API answer, read until its first output (`FirstOutput`).
    first_output: Option<request::FirstOutput>,
    debug: Option<String>,
    held: Option<Held>,
    /// Wakes this stream on its worker once it has been held; deleted at its end.
    wake: Option<StreamScheduler>,
    /// `Some` while `on_scheduled` runs: its local reply, sent after it returns.
    deferred_reply: Option<Option<Reply>>,
    /// Set when the answer's headers come: the request is in the router's `unanswered` until
    /// then.
    answer: Option<Arc<AtomicU8>>,
    /// Judged unanswered before its answer came: in its pod's run already, where a server
    /// error answering it is not counted again.
    lost: bool,
}

/// A local reply `on_scheduled` decided on.
struct Reply {
    status: u32,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

/// What `on_scheduled` leaves to do once the Filter is no longer borrowed. Outside Envoy's filter
/// iteration (a scheduled event), a local reply ends the stream inside `send_response`, and a
/// resumed request whose route answers at once (a direct response, no healthy upstream) does so
/// inside `continue_decoding`: Envoy then runs this stream's `response_headers`,
/// `response_body` and `stream_complete` hooks within the call, each taking the Filter as
/// `&mut` while `on_scheduled` still held it (two live `&mut`, undefined behaviour).
#[derive(Default)]
#[must_use]
struct After {
    reply: Option<Reply>,
    resume: bool,
    /// The request went: the next held request of its pool may fit too.
    sent: Option<Arc<Config>>,
}

impl After {
    fn run(self, s: Stream) {
        if let Some(r) = self.reply {
            let headers: Vec<(&str, &str)> = r
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            s.send_response(r.status, &headers, &r.body);
        } else if self.resume {
            s.continue_decoding();
        }
        if let Some(config) = self.sent {
            config.wake_held(Wake::Sent);
        }
    }
}

impl Filter {
    fn reply(&mut self, s: Stream, status: u16, body: &str, content_type: &str) {
        self.reply_with(s, status, body, &[("content-type", content_type)]);
    }

    fn reply_with(&mut self, s: Stream, status: u16, body: &str, headers: &[(&str, &str)]) {
        self.mode = Mode::Answered;
        // A reply after a decision (a shed request, or ORIGINAL_DST with no pod to fail open
        // to) carries the decision's debug header, as the proxy-wasm build's does: Envoy does
        // not run this filter's `response_headers` for its own local reply, where
        // `on_response_headers` would add it.
        let debug = self.debug.take();
        let mut all = headers.to_vec();
        if let Some(d) = debug.as_deref() {
            all.push((headers::DEBUG, d));
        }
        if let Some(slot) = self.deferred_reply.as_mut() {
            // `on_scheduled`: sent once the Filter is no longer borrowed ([`After`]).
            *slot = Some(Reply {
                status: u32::from(status),
                headers: all
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                body: body.as_bytes().to_vec(),
            });
            return;
        }
        s.send_response(u32::from(status), &all, body.as_bytes());
    }

    /// Answers with `err` in the shape of the request path's API.
    fn reply_error(&mut self, s: Stream, err: &ApiError) {
        let body = err.body(ErrorStyle::for_path(&self.head.path));
        match &err.allow {
            Some(allow) => self.reply_with(
                s,
                err.status,
                &body,
                &[("content-type", "application/json"), ("allow", allow)],
            ),
            None => self.reply(s, err.status, &body, "application/json"),
        }
    }

    fn on_request_headers(&mut self, s: Stream, end_of_stream: bool) -> u32 {
        let config = Arc::clone(&self.config);
        let cfg = &config.settings;
        // One call reads every header; only client-sent internal headers are then removed.
        self.head = RequestHead::read(s.request_headers());
        let method = std::mem::take(&mut self.head.method);
        let content_length = self.head.content_length;
        let forged = std::mem::take(&mut self.head.forged);
        // The borrowed header slices are dead from here on: the map may change.
        let any_forged = !forged.is_empty();
        for h in forged {
            s.remove_header(REQUEST_HEADERS, h);
        }
        if any_forged {
            // Envoy matched the route on the headers as they arrived, the forged ones among
            // them (a route on `x-gateway-pool`): match again without them, whatever happens
            // to this request next. (Proxy-wasm's header calls clear the route cache
            // themselves; this host's do not.)
            s.clear_route_cache();
        }

        let endpoint = |i| Some((i, Endpoint::of(i, &self.head.path)?));
        if let Some((ing, ep)) = cfg.ingest.as_ref().and_then(endpoint) {
            let checked = ingest::check_request(
                ing,
                ep,
                &method,
                || peer_is_loopback(s),
                self.head.authorization.as_deref(),
                content_length,
            );
            if let Err((reason, e)) = checked {
                config.count(config.metrics.ingest_rejected_id(ep, reason));
                self.reply_error(s, &e);
            } else if ep == Endpoint::Prefix && method == "GET" {
                self.export(s);
            } else if ep == Endpoint::Load && method == "GET" {
                self.load_answer(s);
            } else {
                self.mode = Mode::Ingest(ep);
                if end_of_stream {
                    self.ingest_end(s, ep);
                }
            }
            return abi::HEADERS_STOP_ITERATION;
        }
        if let Some(q) = (method == "GET")
            .then(|| ModelsQuery::of(&self.head.path, &cfg.models_path))
            .flatten()
        {
            config.count(config.metrics.models_list);
            let (status, body) = config.reader.routes.models_answer(&q, self.head.anthropic);
            self.reply(s, status, &body, "application/json");
            return abi::HEADERS_STOP_ITERATION;
        }
        if let Some(id) = request::stored_response_path(&self.head.path) {
            // A stored response's own call carries no model: it goes to the pod whose answer
            // carried the id, when the engine learned it (else on, unrouted, to the route
            // table's 404).
            let fleet = current_fleet();
            let found = fleet.as_deref().and_then(|f| {
                let r = config.router.lock();
                let (pool, address) = r.engine.stored_response_pod(id, f)?;
                Some((pool.to_owned(), address.to_owned()))
            });
            let m = &config.metrics;
            if let Some((pool, address)) = found {
                s.add_header(REQUEST_HEADERS, headers::POOL, &pool);
                s.add_header(REQUEST_HEADERS, headers::DESTINATION, &address);
                s.clear_route_cache();
                config.count(m.responses_pinned);
            } else {
                config.count(m.responses_unpinned);
            }
            return abi::HEADERS_CONTINUE;
        }
        if cfg.is_inference_path(&self.head.path) {
            if let Err(e) = self.head.admit(&method, cfg.max_body_bytes) {
                config.count(config.metrics.rejected_id(e.code.as_deref()));
                self.reply_error(s, &e);
                return abi::HEADERS_STOP_ITERATION;
            }
            self.mode = Mode::Inference;
            if end_of_stream {
                self.route(s);
                return match self.mode {
                    Mode::Answered | Mode::Held => abi::HEADERS_STOP_ITERATION,
                    _ => abi::HEADERS_CONTINUE,
                };
            }
            return abi::HEADERS_STOP_ITERATION;
        }
        abi::HEADERS_CONTINUE
    }

    fn on_request_body(&mut self, s: Stream, end_of_stream: bool) -> u32 {
        let config = Arc::clone(&self.config);
        match self.mode {
            Mode::Inference => {
                let len = s.request_body_len();
                // A form is routed as soon as its fields are in (before its file, when they come
                // first: the upload then streams on, whatever its size), while what is buffered
                // of it is short; else at its end.
                let form = self.head.form_boundary.is_some();
                if form && !end_of_stream && self.form_scanned < form::EARLY_BYTES {
                    self.form_scanned = len;
                    if self.route_body(s, false) {
                        return match self.mode {
                            Mode::Answered => abi::BODY_STOP_NO_BUFFER,
                            _ => {
                                self.mode = Mode::Pass;
                                abi::BODY_CONTINUE
                            }
                        };
                    }
                }
                let max = config.settings.max_body_bytes;
                if len > max {
                    config.count(config.metrics.rejected_id(Some("request_too_large")));
                    let e = self.head.too_large(max);
                    self.reply_error(s, &e);
                    return abi::BODY_STOP_NO_BUFFER;
                }
                if !end_of_stream {
                    return abi::BODY_STOP_AND_BUFFER;
                }
                self.route(s);
                match self.mode {
                    Mode::Answered => abi::BODY_STOP_NO_BUFFER,
                    Mode::Held => abi::BODY_STOP_AND_BUFFER,
                    _ => abi::BODY_CONTINUE,
                }
            }
            Mode::Ingest(ep) => {
                let checked = config
                    .settings
                    .ingest
                    .as_ref()
                    .map(|i| ingest::check_size(i, ep, s.request_body_len()));
                if let Some(Err((reason, e))) = checked {
                    config.count(config.metrics.ingest_rejected_id(ep, reason));
                    self.reply_error(s, &e);
                    return abi::BODY_STOP_NO_BUFFER;
                }
                if !end_of_stream {
                    return abi::BODY_STOP_AND_BUFFER;
                }
                self.ingest_end(s, ep);
                abi::BODY_STOP_NO_BUFFER
            }
            Mode::Answered => abi::BODY_STOP_NO_BUFFER,
            Mode::Held => abi::BODY_STOP_AND_BUFFER,
            Mode::Pass => abi::BODY_CONTINUE,
        }
    }

    /// An HTTP/2 request can end with trailers instead of with its last body bytes: its body,
    /// buffered, is then whole, and is routed (or ingested) as at the end of the body.
    fn on_request_trailers(&mut self, s: Stream) -> u32 {
        match self.mode {
            Mode::Inference => {
                self.route(s);
                match self.mode {
                    Mode::Answered | Mode::Held => abi::TRAILERS_STOP_ITERATION,
                    _ => abi::TRAILERS_CONTINUE,
                }
            }
            Mode::Ingest(ep) => {
                self.ingest_end(s, ep);
                abi::TRAILERS_STOP_ITERATION
            }
            Mode::Answered | Mode::Held => abi::TRAILERS_STOP_ITERATION,
            Mode::Pass => abi::TRAILERS_CONTINUE,
        }
    }

    /// The whole body of a request to an ingest endpoint is in.
    fn ingest_end(&mut self, s: Stream, ep: Endpoint) {
        match ep {
            Endpoint::Snapshot => self.ingest(s),
            Endpoint::Prefix => self.import(s),
            Endpoint::Load => self.replica_load(s),
        }
    }

    /// This Envoy's own requests in prefill per pool and pod, for the other gateway replicas.
    fn load_answer(&mut self, s: Stream) {
        let load = {
            let loads = LOADS.lock();
            ReplicaLoad::from_tables(loads.iter().map(|(p, t)| (p.as_str(), t)))
        };
        self.config
            .pending
            .lock()
            .add(self.config.metrics.replica_load_exported, 1);
        self.mode = Mode::Answered;
        s.send_response(
            200,
            &[("content-type", "application/octet-stream")],
            &load.encode(),
        );
    }

    /// Other gateway replicas' requests in prefill (one replica's, or a bundle of several), into
    /// every routing configuration.
    fn replica_load(&mut self, s: Stream) {
        let config = Arc::clone(&self.config);
        let reject = |me: &mut Self, msg: &str| {
            config.count(config.metrics.ingest_rejected_id(Endpoint::Load, "invalid"));
            me.reply_error(s, &ApiError::bad_replica_load(msg));
        };
        let replica = self.head.replica.clone();
        let loads = match s.with_request_body(|b| replica_load::decode_post(replica.as_deref(), b))
        {
            Ok(l) => l,
            Err(msg) => return reject(self, msg),
        };
        let taken = loads.len() as u64;
        let ttl = config.settings.ingest.as_ref().map_or(0, |i| i.load_ttl_ms);
        let now = now_ms();
        for (_, c) in routing_configs() {
            let mut r = c.router.lock();
            r.replicas.held.put_all(loads.clone(), now, ttl);
            r.replicas.posts = r.replicas.posts.wrapping_add(1);
        }
        config
            .pending
            .lock()
            .add(config.metrics.replica_load_imported, taken);
        self.reply(s, 204, "", "text/plain");
    }

    /// This Envoy's own prefix records newer than the request's cursor: each routing
    /// configuration's engine keeps an outgoing log from the first such request on.
    fn export(&mut self, s: Stream) {
        let mut export = Export::of_envoy(
            Cursor::parse(self.head.cursor.as_deref().unwrap_or_default()),
            envoy_epoch(),
        );
        for (id, c) in routing_configs() {
            let mut r = c.router.lock();
            r.engine.enable_sync_log();
            if let Some(log) = r.engine.sync_log() {
                export.add_log(id, log);
            }
        }
        let m = &self.config.metrics;
        self.config
            .pending
            .lock()
            .add(m.prefix_exported, export.len() as u64);
        let (body, cursor) = export.finish();
        self.mode = Mode::Answered;
        s.send_response(
            200,
            &[
                ("content-type", "application/octet-stream"),
                (exchange::CURSOR_HEADER, cursor.as_str()),
            ],
            &body,
        );
    }

    /// Other replicas' prefix records into every routing configuration's prefix index.
    fn import(&mut self, s: Stream) {
        let config = Arc::clone(&self.config);
        let decoded =
            s.with_request_body(|b| prefix::decode_records(b, exchange::MAX_IMPORT_RECORDS));
        let records = match decoded {
            Ok(r) => r,
            Err(msg) => {
                config.count(
                    config
                        .metrics
                        .ingest_rejected_id(Endpoint::Prefix, "invalid"),
                );
                self.reply_error(s, &ApiError::bad_prefix_records(msg));
                return;
            }
        };
        for (_, c) in routing_configs() {
            c.router.lock().engine.apply_sync(&records);
        }
        config
            .pending
            .lock()
            .add(config.metrics.prefix_imported, records.len() as u64);
        self.reply(s, 204, "", "text/plain");
    }

    /// Validates and installs a pushed snapshot (the whole body is in).
    fn ingest(&mut self, s: Stream) {
        let config = Arc::clone(&self.config);
        let m = &config.metrics;
        let Some(ing) = config.settings.ingest.as_ref() else {
            return;
        };
        // While any live configuration that routes may still read the current snapshot (the
        // ingest listener's own has no pools).
        let stale_after_ms = routing_configs()
            .iter()
            .map(|(_, c)| c.settings.longest_stale_after_ms())
            .fold(config.settings.longest_stale_after_ms(), u64::max);
        let header = |f: &FleetState| StoredHeader {
            received_at_ms: f.received_at_ms,
            version: f.version,
        };
        let current = ingest::version_floor(
            current_fleet().map(|f| header(&f)),
            now_ms(),
            stale_after_ms,
        );
        let accepted = s.with_request_body(|b| ingest::accept(b, ing.max_snapshot_bytes, current));
        let snap = match accepted {
            Ok(snap) => snap,
            Err(e) => {
                config.count(m.ingest_rejected_id(
                    Endpoint::Snapshot,
                    if e.status == 413 {
                        "too_large"
                    } else {
                        "invalid"
                    },
                ));
                host::log(
                    abi::LOG_WARN,
                    &format!("gpuroute: snapshot rejected: {}", e.message),
                );
                self.reply_error(s, &e);
                return;
            }
        };
        let pods: usize = snap.pools.iter().map(|p| p.pods.len()).sum();
        let fleet = Arc::new(FleetState::new(snap, now_ms()));
        let mut went_back = None;
        {
            let mut slot = FLEET.write().unwrap_or_else(PoisonError::into_inner);
            // Re-checked under the lock: of two racing pushes the older never wins.
            let old = slot.as_deref().map(header);
            let floor = ingest::version_floor(old, fleet.received_at_ms, stale_after_ms);
            if let Some(v) = floor.filter(|v| *v >= fleet.version) {
                let e = ApiError::bad_snapshot(format!(
                    "snapshot version {} is not newer than the current version {v}",
                    fleet.version
                ));
                drop(slot);
                config.count(m.ingest_rejected_id(Endpoint::Snapshot, "invalid"));
                self.reply_error(s, &e);
                return;
            }
            if let Some(old) = old.filter(|h| h.version >= fleet.version) {
                went_back = Some(ingest::went_back(old.version, fleet.version));
            }
            FLEET_VERSION.store(fleet.version, Ordering::Relaxed);
            *slot = Some(fleet);
        }
        if let Some(warning) = went_back {
            host::log(abi::LOG_WARN, &warning);
        }
        {
            let mut p = config.pending.lock();
            p.count(m.snapshot_accepted);
            p.snapshot_pods = Some(pods as u64);
        }
        self.reply(s, 204, "", "text/plain");
    }

    /// Parses, resolves and picks (the whole body is in), then sets the routing headers.
    fn route(&mut self, s: Stream) {
        self.route_body(s, true);
    }

    /// Parses, resolves and picks on the body buffered so far (`complete`: all of it), then
    /// sets the routing headers. False: a form whose fields routing needs have not arrived yet
    /// (never when `complete`).
    fn route_body(&mut self, s: Stream, complete: bool) -> bool {
        let t0 = Instant::now();
        let config = Arc::clone(&self.config);
        let cfg = &config.settings;
        let m = &config.metrics;
        let fleet = current_fleet();
        let now = now_ms();

        let ctx = RequestContext {
            fleet: fleet.as_deref(),
            now_ms: now,
            split_key: self.head.split_key.as_deref(),
            split_target: None,
        };
        let read = s.with_request_body(|body| match &self.head.form_boundary {
            None => config.reader.read(&self.head.path, body, ctx).map(Some),
            Some(b) => config
                .reader
                .read_form(&self.head.path, body, b, complete, ctx),
        });
        let read = match read {
            Ok(Some(r)) => r,
            Ok(None) => return false,
            Err(e) => {
                config.count(m.rejected_id(e.code.as_deref()));
                self.reply_error(s, &e);
                return true;
            }
        };
        // Only a whole body is held: a form that streams on cannot wait.
        let hold = cfg.hold.filter(|_| complete);
        let mut guard = config.router.lock();
        let mut prep = guard.engine.prepare_read(read);
        if prep.may_follow_response() {
            let path = self.head.path.as_str();
            let again = s
                .with_request_body(|body| guard.engine.follow_response(&mut prep, path, body, ctx));
            if let Err(e) = again {
                drop(guard);
                config.count(m.rejected_id(e.code.as_deref()));
                self.reply_error(s, &e);
                return true;
            }
        }
        let affinity_hold = hold.is_some_and(|h| h.affinity_wait() > 0);
        // Requests of its pool held for room go before it: the room a snapshot, or a request's
        // end, left is theirs first (their wakes run on their workers after this request could
        // take it). Queued behind them; the first is woken, and the room left after them is
        // this one's in its turn (`Config::still_held` wakes it should theirs not suit them).
        let priority = self.head.priority.unwrap_or(0);
        let behind = hold.is_some_and(|h| {
            if cfg.shed_sheddable && priority < 0 {
                return false;
            }
            let held = config.held.lock();
            !held.is_empty()
                && held.len() < h.max_held
                && held.ahead(
                    priority,
                    prep.least_prefill(cfg.prefix.block_tokens()),
                    |e| e.awaits.load(Ordering::Relaxed) == 0 && *e.pool == *prep.pool,
                )
        });
        if behind {
            drop(guard);
            self.hold(
                s,
                Box::new(prep),
                HoldReason::Saturated,
                &fleet,
                now,
                t0,
                true,
            );
            config.wake_held(Wake::Sent);
            return true;
        }
        let dispatched = self.dispatch(
            s,
            guard,
            prep,
            &fleet,
            now,
            complete,
            t0,
            hold.is_some(),
            affinity_hold,
        );
        let dispatched = match dispatched {
            // It would be held, and `max_held` are: counted, and decided again without holding
            // (it goes to a saturated pod at once). Only such a request is counted, not every
            // request while the queue is full (another pool's, a shed one).
            Err((prep, _)) if hold.is_some_and(|h| config.held.lock().len() >= h.max_held) => {
                let full = m
                    .hold
                    .as_ref()
                    .and_then(|h| h.id(&prep.pool, HoldEvent::Full));
                config.count(full);
                let guard = config.router.lock();
                self.dispatch(s, guard, *prep, &fleet, now, complete, t0, false, false)
            }
            d => d,
        };
        if let Err((prep, reason)) = dispatched {
            self.hold(s, prep, reason, &fleet, now, t0, false);
        }
        true
    }

    /// Decides where the prepared request goes and tells Envoy (headers; or the filter's own
    /// answer), `guard` held for the decision and the counts. `Err`: the request may be held
    /// (`holdable`; `affinity_hold`: also for the pod caching its prompt or adapter) and is, for
    /// the reason given: nothing was done or counted.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        s: Stream,
        mut guard: parking_lot::MutexGuard<'_, Router>,
        mut prep: Prepared,
        fleet: &Option<Arc<FleetState>>,
        now: u64,
        complete: bool,
        t0: Instant,
        holdable: bool,
        affinity_hold: bool,
    ) -> Result<(), (Box<Prepared>, HoldReason)> {
        let config = Arc::clone(&self.config);
        let cfg = &config.settings;
        let m = &config.metrics;
        let r = &mut *guard;
        let mut loads = LOADS.lock();
        // Another snapshot came in since this request read one: decide on it. Another worker
        // may have rebased the shared table to it already, and rebasing back to the older one
        // dropped the in-flight counts of the pods only the newer one has, which then read idle
        // (an audit, by reading: a race of microseconds between two workers).
        let newer;
        let fleet = match fleet.as_deref() {
            Some(f) if FLEET_VERSION.load(Ordering::Relaxed) != f.version => {
                newer = current_fleet();
                &newer
            }
            _ => fleet,
        };
        // Again after an overflow: in the pool it went to, with that pool's table.
        let (pool_state, table, mut choice) = loop {
            let pool_state = fleet.as_deref().and_then(|f| f.pool(&prep.pool));
            if !loads.contains_key(&*prep.pool) {
                loads.insert(prep.pool.to_string(), LoadTable::default());
            }
            let Some(table) = loads.get_mut(&*prep.pool) else {
                return Ok(());
            };
            if let (Some(f), Some(p)) = (fleet.as_deref(), pool_state) {
                table.rebase(f.version, &p.keys);
            }
            let opts = DecideOptions {
                now_ms: now,
                sheddable: cfg.shed_sheddable && self.head.priority.is_some_and(|p| p < 0),
                holdable,
                affinity_hold: holdable && affinity_hold,
                debug: cfg.debug_header,
            };
            // The other gateway replicas' requests in prefill, added to a copy of the table (the
            // table itself counts this Envoy's own only).
            let with_replicas = r.replicas.add(&prep.pool, table, fleet.as_deref(), now);
            let pods: &[PodLoad] = if with_replicas {
                &r.replicas.view
            } else {
                &table.pods
            };
            let choice = r
                .engine
                .decide(&prep, fleet.as_deref(), pods, opts, &mut r.rng);
            match choice.decision {
                Decision::Hold(reason) => return Err((Box::new(prep), reason)),
                // Every pod of the pool is saturated: to the pool it overflows to (each move
                // further down the failover list). Counted with the request's other counters.
                Decision::Overflow(to) => r.engine.overflow(&mut prep, to),
                _ => break (pool_state, table, choice),
            }
        };
        self.debug = choice.debug.take();
        let mut any_pod = None;
        if let Decision::Picked(_) = &choice.decision {
            if let (Some(idx), Some(pod_key), Some(_)) =
                (choice.picked_index, choice.picked_key, pool_state)
            {
                let flight = prep.in_flight(pod_key, choice.prefill_tokens);
                table.count(idx, &flight);
                r.engine.commit(&prep, pod_key);
                // Not an upload routed by its leading fields: the pod counts it only once the
                // rest has come, however long the client takes to send it.
                if complete && r.engine.outliers.watches_unanswered() && r.unanswered_room() {
                    let answer = Arc::new(AtomicU8::new(AWAITED));
                    let sent = outlier::Unanswered::new(pod_key, prep.pool.clone(), now_ms());
                    r.unanswered.push((answer.clone(), sent));
                    self.answer = Some(answer);
                }
                self.ttft_from = flight.in_prefill.then_some(t0);
                self.picked = Some(flight);
                self.learn_response = prep
                    .learns_response
                    .then(|| (pod_key, request::ResponseHead::default()));
                self.first_output =
                    (prep.learns_response && prep.stream).then(request::FirstOutput::default);
            }
        } else if matches!(choice.decision, Decision::FailOpen(_)) {
            // Envoy's balancer picks the pod: the id is learned for the one that answers.
            self.learn_response = prep
                .learns_response
                .then(|| (0, request::ResponseHead::default()));
            if cfg.data_plane == DataPlane::OriginalDst {
                // No load balancer behind an ORIGINAL_DST cluster: pick any known pod.
                any_pod = pool_state.and_then(|p| Engine::any_pod(p, &mut r.rng));
            }
        }
        drop(loads);
        drop(guard);

        let pool = &*prep.pool;
        // What to count, handed to `pending` in one lock at the end.
        let mut outcome = None;
        let mut fail_open = None;
        let mut picked_at = None;
        let mut answer = None;
        match &choice.decision {
            Decision::Picked(_) => {
                if let Some(dest) = &choice.destination {
                    let dest = cfg.data_plane.destination(dest);
                    s.add_header(REQUEST_HEADERS, headers::DESTINATION, dest);
                    outcome = Some("picked");
                    picked_at = choice.picked_key.zip(dest.split(',').next());
                }
            }
            Decision::FailOpen(reason) => {
                if reason.by_design() {
                    outcome = Some("routed");
                } else {
                    outcome = Some("fail_open");
                    fail_open = m.fail_open.get(reason.as_str()).copied().flatten();
                }
                if cfg.data_plane == DataPlane::OriginalDst {
                    match any_pod {
                        Some(addr) => s.set_header(REQUEST_HEADERS, headers::DESTINATION, &addr),
                        None => {
                            // Answered, not failed open: one outcome per request.
                            (outcome, fail_open) = (None, None);
                            answer = Some(("error", ApiError::no_endpoints(pool)));
                        }
                    }
                }
            }
            Decision::Shed => answer = Some(("shed", ApiError::shed(pool))),
            // Returned above.
            Decision::Hold(_) | Decision::Overflow(_) => {}
        }
        if answer.is_none() {
            for (name, value) in prep.routing_headers() {
                s.add_header(REQUEST_HEADERS, name, value);
            }
            if let Some(rewrite) = &prep.rewrite {
                let buffered = s.request_body_len();
                // No host call puts bytes before a body's rest here, as proxy-wasm's body
                // write does: the whole new body.
                let new_body = s.with_request_body(|b| rewrite.apply(b));
                s.replace_request_body(&new_body);
                let declared = self.head.content_length;
                let length = engine::rewritten_length(complete, declared, buffered, new_body.len());
                if let Some(n) = length {
                    s.set_header(REQUEST_HEADERS, "content-length", &n.to_string());
                }
            }
            // The route was matched on the headers as they arrived; match again on the pool.
            s.clear_route_cache();
        }
        {
            let mut p = config.pending.lock();
            p.count(outcome.and_then(|o| m.outcome_id(pool, o)));
            p.count(fail_open);
            for id in m.split_ids(&prep) {
                p.count(id);
            }
            p.count(m.failover_id(&prep));
            if prep.continues_response() {
                p.count(match choice.pinned_response {
                    true => m.responses_pinned,
                    false => m.responses_unpinned,
                });
            }
            if let Some((key, addr)) = picked_at {
                p.pick(pool, key, addr);
            }
            if let Some((o, _)) = &answer {
                p.count(m.outcome_id(pool, o));
            } else {
                p.decision_time(t0.elapsed().as_micros() as u64);
            }
        }
        if let Some((_, e)) = answer {
            self.reply_error(s, &e);
        }
        Ok(())
    }

    /// Holds the request (`dispatch` found its pool saturated): queued in `Config::held`, its
    /// stream stopped until `on_scheduled` sends it. Without a scheduler for the stream it goes
    /// at once, to a saturated pod. `behind`: queued behind held requests of its pool on
    /// arrival, not decided yet (`HeldEntry::behind`).
    #[allow(clippy::too_many_arguments)]
    fn hold(
        &mut self,
        s: Stream,
        prep: Box<Prepared>,
        reason: HoldReason,
        fleet: &Option<Arc<FleetState>>,
        now: u64,
        t0: Instant,
        behind: bool,
    ) {
        let config = Arc::clone(&self.config);
        let Some(h) = config.settings.hold else {
            return;
        };
        if self.wake.is_none() {
            // SAFETY: the live filter pointer of the current hook.
            self.wake = unsafe { StreamScheduler::new(s) };
        }
        let Some(wake) = self.wake.as_ref().map(StreamScheduler::share) else {
            let guard = config.router.lock();
            let _ = self.dispatch(s, guard, *prep, fleet, now, true, t0, false, false);
            return;
        };
        let id = config.next_held.fetch_add(1, Ordering::Relaxed);
        let deadline = t0 + Duration::from_millis(h.max_wait_ms);
        let awaits = reason.awaited_pod().unwrap_or(0);
        let for_affinity = awaits != 0;
        let entry = HeldEntry {
            id,
            pool: prep.pool.clone(),
            deadline,
            awaits: AtomicU64::new(awaits),
            wake,
            asked: AtomicBool::new(false),
            behind: AtomicBool::new(behind),
        };
        let priority = self.head.priority.unwrap_or(0);
        let prefill = prep.least_prefill(config.settings.prefix.block_tokens());
        config.held.lock().push(priority, prefill, entry);
        let pool = prep.pool.clone();
        if let Some(m) = config.metrics.hold.as_ref() {
            let mut p = config.pending.lock();
            p.count(m.id(&pool, HoldEvent::Held));
            if for_affinity {
                p.count(m.id(&pool, HoldEvent::Affinity));
            }
        }
        self.held = Some(Held {
            prep,
            id,
            since: t0,
            waited_for_affinity: for_affinity,
            pool,
        });
        self.mode = Mode::Held;
    }

    /// Woken on this stream's worker (`Config::wake_held`): a held request decides again, and goes
    /// if a pod has room (the pod caching its prompt or adapter, while it may wait for that) or its
    /// wait ran out.
    fn on_scheduled(&mut self, s: Stream) -> After {
        let Some(held) = self.held.take() else {
            return After::default();
        };
        self.deferred_reply = Some(None);
        let mut after = self.decide_again(s, held);
        after.reply = self.deferred_reply.take().flatten();
        after
    }

    fn decide_again(&mut self, s: Stream, held: Held) -> After {
        let config = Arc::clone(&self.config);
        // Before it decides: a pod that frees up meanwhile wakes it once more.
        config.asked(held.id);
        let t0 = Instant::now();
        let limits = config.settings.hold.unwrap_or_default();
        let waited_ms = t0.duration_since(held.since).as_millis() as u64;
        let expired = limits.expired(waited_ms);
        let affinity_hold = limits.may_await(waited_ms);
        let fleet = current_fleet();
        let guard = config.router.lock();
        let mut prep = held.prep;
        // Moved to a failover pool and held there: back to its own once that has room.
        guard.engine.homeward(fleet.as_deref(), now_ms(), &mut prep);
        match self.dispatch(
            s,
            guard,
            *prep,
            &fleet,
            now_ms(),
            true,
            t0,
            !expired,
            affinity_hold,
        ) {
            Err((prep, reason)) => {
                let awaits = reason.awaited_pod().unwrap_or(0);
                let for_affinity = awaits != 0;
                if for_affinity && !held.waited_for_affinity {
                    let m = config.metrics.hold.as_ref();
                    config.count(m.and_then(|h| h.id(&held.pool, HoldEvent::Affinity)));
                }
                config.still_held(held.id, awaits);
                self.held = Some(Held {
                    prep,
                    waited_for_affinity: held.waited_for_affinity || for_affinity,
                    ..held
                });
                After::default()
            }
            Ok(()) => {
                config.unhold(held.id);
                // The module answered it (shed, or no pod with ORIGINAL_DST): sent nowhere.
                let answered = matches!(self.mode, Mode::Answered);
                if let Some(h) = &config.metrics.hold {
                    let event = HoldEvent::left(expired, answered);
                    let mut p = config.pending.lock();
                    p.count(h.id(&held.pool, event));
                    if let Some(id) = h.wait_ms(&held.pool) {
                        p.hold_ms.push((id, waited_ms));
                    }
                }
                if let Some(d) = self.debug.as_mut() {
                    *d = engine::held_debug(waited_ms, d);
                }
                let resume = !answered;
                if resume {
                    self.mode = Mode::Pass;
                }
                After {
                    reply: None,
                    resume,
                    sent: Some(config),
                }
            }
        }
    }

    fn on_response_headers(&mut self, s: Stream) {
        // A stream is answered by its first chunk (`outlier::Unanswered`).
        if !self.picked.as_ref().is_some_and(|p| p.in_prefill) {
            self.answer_came();
        }
        if let Some(d) = &self.debug {
            s.set_header(RESPONSE_HEADERS, headers::DEBUG, d);
        }
        let head = self.learn_response.is_some()
            || self.ttft_from.is_some()
            || self.first_output.is_some();
        if !head {
            // A picked pod's answer tells passive health how it did: its status alone.
            if self.picked.is_some() && self.config.outliers_on() {
                self.answered(s, s.response_header(":status"));
            }
            return;
        }
        let hs = s.response_headers();
        let header = |name: &[u8]| hs.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        let status = header(b":status");
        self.answered(s, status);
        // A first token only from a success: an error's first byte (a pod's 503, Envoy's own
        // when no pod took the request) timed as one pulled the histogram down just when
        // things were worst.
        if !status.is_some_and(request::is_success) {
            self.ttft_from = None;
            // An error has no preamble to read past: its first byte ends the prefill.
            self.first_output = None;
        }
        // A Responses API answer: whether its id is learned, and for which pod (the one that
        // answered).
        if let Some((pod, _)) = self.learn_response.as_mut() {
            let upstream = s.upstream_address();
            match request::response_learner(
                status,
                header(b"content-encoding"),
                upstream.as_deref().map(str::as_bytes),
                *pod,
            ) {
                Some(answered) => *pod = answered,
                None => self.learn_response = None,
            }
        }
    }

    /// The request's answer came: the router's `unanswered` drops it at the next sweep.
    fn answer_came(&mut self) {
        if let Some(a) = self.answer.take() {
            self.lost = a.swap(ANSWERED, Ordering::AcqRel) == LOST;
        }
    }

    /// Tells passive health how the picked pod answered (`status`, the answer's `:status`): a
    /// server error counts toward ejecting the pod that gave it, another answer ends its run
    /// ([`gpuroute_core::outlier`]). Only a server error, or an answer while some pod is on
    /// record, takes the router's lock.
    fn answered(&self, s: Stream, status: Option<&[u8]>) {
        let Some(p) = self.picked.as_ref().filter(|_| self.config.outliers_on()) else {
            return;
        };
        let server_error = status.is_some_and(outlier::is_server_error);
        if !server_error && !self.config.outliers_tracking.load(Ordering::Relaxed) {
            return;
        }
        let lost =
            self.lost || (self.answer.as_ref()).is_some_and(|a| a.load(Ordering::Acquire) == LOST);
        if server_error && lost {
            // Judged unanswered: counted in the pod's run then.
            return;
        }
        // The pod that answered: Envoy may have retried a refused connection on a fallback.
        let upstream = s.upstream_address();
        let pod = request::answered_by(upstream.as_deref().map(str::as_bytes), p.pod_key);
        let fleet = current_fleet();
        let (ejection, tracking) = {
            let mut r = self.config.router.lock();
            let e = r
                .engine
                .answered(&p.pool, pod, status, fleet.as_deref(), now_ms());
            (e, r.engine.outliers.tracking())
        };
        self.config
            .outliers_tracking
            .store(tracking, Ordering::Relaxed);
        if let Some(e) = ejection {
            let id = self
                .config
                .metrics
                .ejections
                .get(&*p.pool)
                .copied()
                .flatten();
            self.config.count(id);
            host::log(
                abi::LOG_WARN,
                &e.message(
                    upstream.as_deref().unwrap_or("(picked)"),
                    &p.pool,
                    self.config.settings.outlier_detection.consecutive_5xx,
                    status.unwrap_or_default(),
                ),
            );
        }
    }

    /// The first streamed chunk is the first token: the pod's prefill of this request is over.
    /// A Responses API answer's first chunk also gives its id: a later turn continuing it goes
    /// to this pod, which holds it.
    fn on_response_body(&mut self, s: Stream, end_of_stream: bool) {
        // A Responses answer's chunk, copied once for its id and for its first output: as much
        // as either still reads.
        let want = match (&self.learn_response, &self.first_output) {
            (_, Some(_)) => usize::MAX,
            (Some((_, head)), None) => head.room(),
            (None, None) => 0,
        };
        let (learn, first) = (&mut self.learn_response, &mut self.first_output);
        let (found, output) = if want == 0 {
            (None, None)
        } else {
            s.with_response_chunk(want, |c| {
                let found = learn.as_mut().and_then(|(pod, head)| {
                    let n = c.len().min(head.room());
                    head.push(&c[..n]).map(|id| (*pod, id))
                });
                (found, first.as_mut().map(|f| f.push(c)))
            })
        };
        if let Some((_, head)) = &self.learn_response {
            if found.is_some() || head.room() == 0 || end_of_stream {
                self.learn_response = None;
            }
        }
        if let Some((pod, id)) = found {
            self.config.router.lock().engine.learn_response(&id, pod);
            self.config.count(self.config.metrics.responses_learned);
        }
        // A Responses stream's first output comes after its preamble events, read until then.
        if let Some(output) = output {
            if !output && !end_of_stream {
                return;
            }
            self.first_output = None;
        }
        if let Some(p) = self.picked.as_mut() {
            if let Some(op) = p.first_byte() {
                self.config.complete(&p.pool, op);
                if let Some(a) = self.answer.take() {
                    self.lost = a.swap(ANSWERED, Ordering::AcqRel) == LOST;
                }
                if let Some(t0) = self.ttft_from.take() {
                    let histogram = self.config.metrics.ttft.get(&*p.pool).copied().flatten();
                    let ms = t0.elapsed().as_millis() as u64;
                    self.config.pending.lock().first_token(histogram, ms);
                }
            }
        }
    }

    /// The request is over: it leaves the in-flight table, or, held (its client left), the
    /// queue. Its end may leave room for a held request.
    fn on_end(&mut self) {
        let freed = self.picked.take().map(|p| {
            self.config.complete(&p.pool, p.finished());
            p.pod_key
        });
        if let Some(h) = self.held.take() {
            if self.config.unhold(h.id) {
                let m = self.config.metrics.hold.as_ref();
                self.config
                    .count(m.and_then(|m| m.id(&h.pool, HoldEvent::Cancelled)));
            }
        }
        if let Some(w) = self.wake.take() {
            // Out of the queue before it is deleted, under the queue's lock: the ticker and the
            // other workers commit through the queue's copies. `self.held` is not enough: a held
            // request the module answers when it decides again (`on_scheduled`, which took
            // `self.held`) ends inside that answer (Envoy runs `stream_complete` within
            // `send_response` outside its filter iteration), before `on_scheduled` takes it out.
            self.config.held.lock().remove(|e| e.wake.is(&w));
            w.delete();
        }
        if let Some(pod) = freed {
            self.config.wake_held(Wake::Ended(pod));
        }
    }
}

fn peer_is_loopback(s: Stream) -> bool {
    let Some(a) = s.source_address() else {
        return false;
    };
    a.parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| a.parse::<IpAddr>())
        .is_ok_and(|ip| ip.is_loopback())
}

// ----------------------------------------------------------------------------------------------
// Event hooks: Envoy resolves every one of these by name when it loads the module.
// ----------------------------------------------------------------------------------------------

/// The ABI version of Envoy 1.40 (its `ENVOY_DYNAMIC_MODULES_ABI_VERSION`). Envoy only warns on
/// a mismatch; the callbacks this module needs are checked for real by `abi::init`.
static ABI_VERSION: &[u8] = b"v0.2.0\0";

/// Panics caught in hooks since the last flush ([`guarded`]).
static PANICS: AtomicU64 = AtomicU64::new(0);

/// Runs a hook's body. A panic unwinding out of an `extern "C"` function aborts the process:
/// Envoy, with every request in it. Caught here, logged and counted (`gpuroute.module.panics`),
/// the hook answers `fallback`: the request goes on unrouted, to Envoy's own balancing, and the
/// locks it held are released as it unwinds. No panic is known (the audits' fuzzing of the
/// parsers and of the decisions found none); this is the floor under one found later.
fn guarded<R>(hook: &'static str, fallback: R, body: impl FnOnce() -> R) -> R {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(r) => r,
        Err(e) => {
            let what = e
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| e.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(no message)");
            PANICS.fetch_add(1, Ordering::Relaxed);
            host::log(
                abi::LOG_ERROR,
                &format!(
                    "gpuroute: caught a panic in {hook}: {what}; the request goes on unrouted"
                ),
            );
            fallback
        }
    }
}

/// Test builds (`panic-probe`): the hook panics when the request says so in
/// `x-gpuroute-panic`, so that the e2e tests can check what [`guarded`] does.
#[cfg(feature = "panic-probe")]
#[allow(clippy::panic)]
fn probe(s: Stream, hook: &str) {
    let asked = s.request_headers().iter().any(|(k, v)| {
        k.eq_ignore_ascii_case(b"x-gpuroute-panic") && v.eq_ignore_ascii_case(hook.as_bytes())
    });
    if asked {
        panic!("panic-probe in {hook}");
    }
}

#[cfg(not(feature = "panic-probe"))]
#[inline(always)]
fn probe(_: Stream, _: &str) {}

/// Resolves the Envoy callbacks; null (Envoy refuses the module) if one is missing.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_program_init() -> *const u8 {
    match abi::init() {
        Ok(()) => ABI_VERSION.as_ptr(),
        Err(missing) => {
            // `log` may be the missing one; stderr reaches Envoy's console either way.
            eprintln!(
                "gpuroute: this Envoy lacks the callback {missing}: the module needs Envoy 1.40"
            );
            std::ptr::null()
        }
    }
}

/// # Safety
/// Called by Envoy with a live config pointer and buffers valid for the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    config_envoy: ConfigEnvoyPtr,
    _name: EnvoyBuffer,
    config: EnvoyBuffer,
) -> *const c_void {
    guarded("config_new", std::ptr::null(), || {
        match Config::new(config.as_slice(), &Definer(config_envoy)) {
            Ok(c) => {
                let c = Arc::new(c);
                let id = NEXT_CONFIG_ID.fetch_add(1, Ordering::Relaxed);
                lock(&CONFIGS).push((id, Arc::downgrade(&c)));
                match Scheduler::new(config_envoy) {
                    Some(s) => Config::start_ticker(&c, s),
                    None => host::log(
                        abi::LOG_ERROR,
                        "gpuroute: no config scheduler: stats stay at 0",
                    ),
                }
                Arc::into_raw(c).cast()
            }
            Err(e) => {
                host::log(
                    abi::LOG_CRITICAL,
                    &format!("gpuroute: invalid configuration: {e}"),
                );
                std::ptr::null()
            }
        }
    })
}

/// # Safety
/// `config` is a pointer returned by `on_http_filter_config_new`, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *const c_void) {
    if config.is_null() {
        return;
    }
    let c = Arc::from_raw(config.cast::<Config>());
    guarded("config_destroy", (), || {
        // Main thread: delete the scheduler here; the ticker sees it gone and stops.
        let scheduler = lock(&c.scheduler).take();
        if let Some(s) = scheduler {
            s.delete();
        }
        // What its last streams counted since the last tick, and the held gauges without its
        // requests: Envoy destroys a configuration after its last stream (each holds it), so the
        // requests held when an LDS change's drain ended are counted `hold.<pool>.cancelled`
        // here (no tick flushes for it any more; they were lost before). Envoy's side is whole
        // until this hook returns.
        c.flush(c.envoy);
    });
}

/// # Safety
/// Envoy's pointers for a live configuration (main thread).
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_scheduled(
    config_envoy: ConfigEnvoyPtr,
    config: *const c_void,
    _event: u64,
) {
    if let Some(c) = config.cast::<Config>().as_ref() {
        guarded("config_scheduled", (), || {
            c.flush(ConfigStats(config_envoy))
        });
    }
}

/// # Safety
/// `config` is a live pointer returned by `on_http_filter_config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_new(
    config: *const c_void,
    _filter_envoy: FilterEnvoyPtr,
) -> *mut c_void {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    let config = config.cast::<Config>();
    Arc::increment_strong_count(config);
    let filter = Filter {
        config: Arc::from_raw(config),
        mode: Mode::Pass,
        head: RequestHead::default(),
        form_scanned: 0,
        picked: None,
        ttft_from: None,
        learn_response: None,
        first_output: None,
        debug: None,
        held: None,
        wake: None,
        deferred_reply: None,
        answer: None,
        lost: false,
    };
    Box::into_raw(Box::new(filter)).cast()
}

/// # Safety
/// `filter` is null or a live pointer returned by `on_http_filter_new`.
unsafe fn filter<'a>(filter: *mut c_void) -> Option<&'a mut Filter> {
    filter.cast::<Filter>().as_mut()
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    envoy: FilterEnvoyPtr,
    f: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("request_headers", abi::HEADERS_CONTINUE, || {
        probe(Stream(envoy), "request_headers");
        filter(f).map_or(abi::HEADERS_CONTINUE, |f| {
            f.on_request_headers(Stream(envoy), end_of_stream)
        })
    })
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    envoy: FilterEnvoyPtr,
    f: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("request_body", abi::BODY_CONTINUE, || {
        probe(Stream(envoy), "request_body");
        filter(f).map_or(abi::BODY_CONTINUE, |f| {
            f.on_request_body(Stream(envoy), end_of_stream)
        })
    })
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_trailers(
    envoy: FilterEnvoyPtr,
    f: *mut c_void,
) -> u32 {
    guarded("request_trailers", abi::TRAILERS_CONTINUE, || {
        filter(f).map_or(abi::TRAILERS_CONTINUE, |f| {
            f.on_request_trailers(Stream(envoy))
        })
    })
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_headers(
    envoy: FilterEnvoyPtr,
    f: *mut c_void,
    _end_of_stream: bool,
) -> u32 {
    guarded("response_headers", (), || {
        probe(Stream(envoy), "response_headers");
        if let Some(f) = filter(f) {
            f.on_response_headers(Stream(envoy));
        }
    });
    0
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_response_body(
    envoy: FilterEnvoyPtr,
    f: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    guarded("response_body", (), || {
        if let Some(f) = filter(f) {
            f.on_response_body(Stream(envoy), end_of_stream);
        }
    });
    0
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_trailers(
    _envoy: FilterEnvoyPtr,
    _f: *mut c_void,
) -> u32 {
    0
}

/// # Safety
/// Envoy's pointers for a live stream.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete(
    _envoy: FilterEnvoyPtr,
    f: *mut c_void,
) {
    guarded("stream_complete", (), || {
        if let Some(f) = filter(f) {
            f.on_end();
        }
    });
}

/// # Safety
/// `f` is null or a pointer returned by `on_http_filter_new`, destroyed once.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_destroy(f: *mut c_void) {
    if !f.is_null() {
        let mut f = Box::from_raw(f.cast::<Filter>());
        // A stream reset before `stream_complete` still leaves the in-flight table.
        guarded("filter_destroy", (), move || f.on_end());
    }
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_local_reply(
    _envoy: FilterEnvoyPtr,
    _f: *mut c_void,
    _code: u32,
    _details: EnvoyBuffer,
    _reset_imminent: bool,
) -> u32 {
    0
}

/// Hooks for features this module does not use (callouts, streams, watermarks,
/// per-route configuration). They must exist for Envoy to load the module.
macro_rules! unused_hooks {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() {}
    )*};
}
unused_hooks!(
    envoy_dynamic_module_on_http_filter_http_callout_done,
    envoy_dynamic_module_on_http_filter_downstream_above_write_buffer_high_watermark,
    envoy_dynamic_module_on_http_filter_downstream_below_write_buffer_low_watermark,
    envoy_dynamic_module_on_http_filter_http_stream_headers,
    envoy_dynamic_module_on_http_filter_http_stream_data,
    envoy_dynamic_module_on_http_filter_http_stream_trailers,
    envoy_dynamic_module_on_http_filter_http_stream_complete,
    envoy_dynamic_module_on_http_filter_http_stream_reset,
    envoy_dynamic_module_on_http_filter_config_http_callout_done,
    envoy_dynamic_module_on_http_filter_config_http_stream_headers,
    envoy_dynamic_module_on_http_filter_config_http_stream_data,
    envoy_dynamic_module_on_http_filter_config_http_stream_trailers,
    envoy_dynamic_module_on_http_filter_config_http_stream_complete,
    envoy_dynamic_module_on_http_filter_config_http_stream_reset,
    envoy_dynamic_module_on_http_filter_per_route_config_destroy,
);

/// A held request's stream, woken on its worker (`Config::wake_held`).
///
/// # Safety
/// Envoy's pointers for a live stream (a null filter is ignored).
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_scheduled(
    envoy: FilterEnvoyPtr,
    f: *mut c_void,
    _event: u64,
) {
    guarded("scheduled", (), || {
        // The Filter's borrow ends with this statement: what `After` does may run its other
        // hooks.
        let after = filter(f).map(|f| f.on_scheduled(Stream(envoy)));
        if let Some(after) = after {
            after.run(Stream(envoy));
        }
    });
}

/// No per-route configuration: a null answer (only consulted when a route sets one).
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_per_route_config_new(
    _name: EnvoyBuffer,
    _config: EnvoyBuffer,
) -> *const c_void {
    std::ptr::null()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_counts_by_id_and_picks_by_pool_and_pod() {
        let mut p = Pending::default();
        assert!(p.is_empty());
        p.count(Some(3));
        p.count(Some(3));
        p.count(None);
        p.pick("llama", 7, "10.0.0.1:8000");
        p.pick("llama", 7, "10.0.0.1:8000");
        p.pick("llama", 9, "10.0.0.2:8000");
        p.pick("qwen", 7, "10.0.0.1:8000");
        assert_eq!(p.counts.get(&3), Some(&2));
        assert_eq!(p.counts.len(), 1);
        let llama = &p.picks["llama"];
        assert_eq!(llama[&7], ("10.0.0.1:8000".to_string(), 2));
        assert_eq!(llama[&9].1, 1);
        assert_eq!(p.picks["qwen"][&7].1, 1);
        assert!(!p.is_empty());
    }

    #[test]
    fn pending_decision_times_stay_bounded_and_keep_the_newest() {
        let mut p = Pending::default();
        for us in 0..(3 * MAX_PENDING_TIMES as u64) {
            p.decision_time(us);
        }
        assert!(p.decision_us.len() <= MAX_PENDING_TIMES);
        assert!(p.decision_us.len() >= MAX_PENDING_TIMES / 2);
        assert_eq!(
            p.decision_us.last(),
            Some(&(3 * MAX_PENDING_TIMES as u64 - 1))
        );
        // Thinned evenly, not truncated: old and new values both remain.
        assert!(p
            .decision_us
            .first()
            .is_some_and(|v| *v < MAX_PENDING_TIMES as u64));
    }

    #[test]
    fn outside_envoy_the_module_refuses_to_load_and_callbacks_are_inert() {
        // No Envoy in this process: the first callback is missing, so Envoy would be told the
        // module failed to initialise instead of crashing on the first request.
        assert_eq!(abi::init(), Err("envoy_dynamic_module_callback_log"));
        assert!(envoy_dynamic_module_on_program_init().is_null());
        // Unresolved callbacks answer their defaults.
        let s = Stream(std::ptr::null_mut());
        assert_eq!(s.request_body_len(), 0);
        assert!(s.request_headers().is_empty());
        assert!(Definer(std::ptr::null_mut()).counter("x", &[]).is_none());
    }

    #[test]
    fn config_defines_metrics_only_through_envoy_and_rejects_bad_json() {
        // Without Envoy there is no config pointer; `Config::new` must still judge the JSON
        // before it defines anything.
        let err = Config::new(b"{not json", &Definer(std::ptr::null_mut()));
        assert!(err.is_err());
    }
}
