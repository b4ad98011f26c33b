//! Envoy stats emitted by the filter. They appear in Envoy's `/stats` and `/stats/prometheus`
//! under the names below (Envoy strips the `wasmcustom.` prefix it adds). The README's
//! Observability section lists them for users; an end-to-end test holds Envoy's to that list.
//!
//! - `gpuroute.pool.<pool>.requests.<picked|fail_open|shed|error|routed>` (counters; `routed`: the pod left to Envoy by design)
//! - `gpuroute.pool.<pool>.pod.<ip:port>.picks` (counters, created on first pick; the address as
//!   the snapshot has it, which Envoy's tag extraction takes whole into `gpuroute_endpoint`)
//! - `gpuroute.fail_open.<no_snapshot|unknown_pool|no_fresh_pod>` (counters)
//! - `gpuroute.rejected.<code>` (counters: invalid_json, invalid_type, model_not_found,
//!   missing_required_parameter, request_too_large, unsupported_content_encoding,
//!   method_not_allowed)
//! - `gpuroute.split.<split>.to.<target>` (counters: requests for a split, by the target they
//!   took), `gpuroute.split.<split>.rerouted` (counter: moved off a target that could not serve)
//! - `gpuroute.failover.<pool>.to.<failover pool>` (counters: requests for a pool without a
//!   healthy pod sent to its failover pool, `pools[].failover`), `gpuroute.overflow.<pool>.to.
//!   <failover pool>` (the same for a pool whose pods were all saturated, `pools[].overflow`)
//! - `gpuroute.snapshot.accepted`, `gpuroute.snapshot.rejected.<reason>` (counters)
//! - `gpuroute.prefix.exported`, `gpuroute.prefix.imported`, `gpuroute.prefix.rejected.<reason>`
//!   (counters: prefix records given to and taken from other gateway replicas)
//! - `gpuroute.replica_load.exported`, `gpuroute.replica_load.imported`,
//!   `gpuroute.replica_load.rejected.<reason>` (counters: this Envoy's requests in prefill given
//!   to the relay, other gateway replicas' taken)
//! - `gpuroute.snapshot.age_ms`, `gpuroute.snapshot.pods`, `gpuroute.workers` (gauges)
//! - `gpuroute.decision_us` (histogram: body parse to headers set, microseconds; a sample: the
//!   worker's first routed request and, at random, one in `DECISION_SAMPLE` after it)
//! - `gpuroute.pool.<pool>.ttft_ms` (histogram: a streamed request's time from its routing
//!   decision to the first byte of its answer, ms; the requests whose decision time is sampled)
//! - `gpuroute.models_list` (counter: `GET` under `models_path` answered, the list or one model)
//! - `gpuroute.responses.learned`, `gpuroute.responses.pinned`, `gpuroute.responses.unpinned`
//!   (counters: stored-response ids learned from answers; turns and calls by id sent to the pod
//!   that holds their response, and those that could not be)
//! - `gpuroute.idle_wakes` (counter: a routed request found its worker's tick slowed down by
//!   idling, `idle_tick_ms`, and restored it)
//! - `gpuroute.hold.<pool>.{held,affinity,released,expired,answered,cancelled,full}` (counters:
//!   requests held while their pool was saturated, or the pod caching their prompt or adapter
//!   was, `hold`; those that waited for that pod; sent when a pod had room; sent after
//!   `max_wait_ms` to a saturated pod; answered by the filter itself when it decided again, shed
//!   or with ORIGINAL_DST no pod to name; whose client left while held; not held because the
//!   worker held `max_held`),
//!   `gpuroute.held.<pool>` (gauge: requests held now, all workers), each by the pool the
//!   request was first held in (a request held where it overflowed counts there, wherever it
//!   goes), `gpuroute.hold_ms.<pool>` (histogram: how long each request held there waited),
//!   every pool's defined at 0 with the configuration (`hold` on)
//!
//! The two counters of the happy path (`picked`, `picks`) are batched in the worker and handed
//! to Envoy on the root context's tick (`tick_ms`), saving two host calls per request, and so
//! are a split's counters (`to`, which every request for a split counts, and `rerouted`) and
//! the failover and overflow counters (a pool overflowing may move many requests a second);
//! every other counter is immediate. Their ids are cached per pool and pod (`hot`), per split
//! (`splits`) and per pair of pools (`moved`), apart from the by-name cache of the others, so
//! these paths format no metric names.

use crate::abi::MetricType;
use crate::host;
use gpuroute_core::engine::{FailedOver, SplitTaken};
use gpuroute_core::fleet::{pod_stat_key, stat_segment as sanitize, PodStatSet, OTHER_POD};
use gpuroute_core::hold::{held_stat, hold_ms_stat, hold_stat, HoldEvent};
use gpuroute_core::idmap::{IdMap, NameMap};
use gpuroute_core::ingest::{self, Endpoint};
use gpuroute_core::routing::{split_rerouted_stat, split_stat};
use std::sync::Arc;

/// Metric ids, defined lazily and cached per worker.
pub struct Stats {
    ids: NameMap<String, Option<u32>>,
    /// Per pool: the id of its `picked` counter and of each pod's `picks` counter, so the hot
    /// path neither formats names nor hashes long strings.
    hot: NameMap<String, PoolIds>,
    /// Per split, by the address of its `Arc` (the configuration's splits live as long as this
    /// `Stats`, which a new configuration replaces; a request held across the change keeps its
    /// old split alive, so no other split takes that address): its counters, once counted.
    splits: IdMap<usize, SplitIds>,
    /// The counters of requests moved off their pool (`pools[].failover`, `overflow`), once
    /// counted: by the pool they left, the pool they went to and whether they overflowed. A
    /// configuration has few such pairs, so a scan.
    moved: Vec<Moved>,
    /// Per pool: its hold counters and held gauge ([`HoldEvent`]), defined with the
    /// configuration ([`Stats::define_hold`]).
    hold: NameMap<String, HoldIds>,
    /// Increments of hot counters not yet handed to Envoy (flushed on the tick).
    pending: IdMap<u32, i64>,
    /// `max_pod_stats`: how many pods, in all, the Envoy gives a picks counter of their own
    /// (the set in shared data, [`POD_STATS_KEY`]).
    max_pod_stats: usize,
    /// Pods ([`pod_stat_key`]) this worker found refused, so that their picks do not read the
    /// shared set again (cleared when it holds [`REFUSED_CACHE`]).
    refused: IdMap<u64, ()>,
}

/// Shared data: the pods given a picks counter of their own ([`PodStatSet`]), one set for
/// every worker and configuration of the VM.
const POD_STATS_KEY: &str = "gpuroute.pod_stats";

/// The most refused pods a worker remembers; past it, it forgets them all (and asks again).
const REFUSED_CACHE: usize = 4096;

/// A split's counters: each target's `to`, and `rerouted`, once counted.
#[derive(Default)]
struct SplitIds {
    to: Vec<Option<Option<u32>>>,
    rerouted: Option<Option<u32>>,
}

/// The counter of requests moved from pool `from` to pool `to` ([`FailedOver::stat`]).
struct Moved {
    from: Arc<str>,
    to: String,
    overflow: bool,
    id: Option<u32>,
}

/// A pool's hold counters, in [`HoldEvent::ALL`]'s order, its held gauge and its wait histogram.
struct HoldIds {
    counters: [Option<u32>; HoldEvent::ALL.len()],
    gauge: Option<u32>,
    wait_ms: Option<u32>,
}

#[derive(Default)]
struct PoolIds {
    picked: Option<u32>,
    /// By pod key ([`gpuroute_core::prefix::pod_key`]): no address string hashed per request.
    /// Only the pods admitted to their own counter.
    pods: IdMap<u64, Option<u32>>,
    /// The pool's `other` picks counter, once a pod past `max_pod_stats` was picked.
    other: Option<Option<u32>>,
    /// The pool's `ttft_ms` histogram, once a streamed request's first byte was timed.
    ttft: Option<Option<u32>>,
}

impl Stats {
    /// `max_pod_stats`: the most pods the Envoy gives a picks counter of their own.
    pub fn new(max_pod_stats: usize) -> Stats {
        Stats {
            ids: NameMap::default(),
            hot: NameMap::default(),
            splits: IdMap::default(),
            moved: Vec::new(),
            hold: NameMap::default(),
            pending: IdMap::default(),
            max_pod_stats,
            refused: IdMap::default(),
        }
    }

    /// Whether the pod (`key`, [`pod_stat_key`]) has, or now gets, a picks counter of its own:
    /// asked once per pod and worker (the pods admitted are kept with their ids), or again for
    /// a refused pod once this worker's cache of them was cleared.
    fn admit(&mut self, key: u64) -> bool {
        if self.max_pod_stats == 0 || self.refused.contains_key(&key) {
            return false;
        }
        let limit = self.max_pod_stats;
        // One read: a pod already in the set is not written again, a pod refused not at all.
        let mut known = false;
        let added = crate::update_shared(
            POD_STATS_KEY,
            PodStatSet::decode,
            PodStatSet::encode,
            |set| {
                known = set.contains(key);
                (!known && set.admit(key, limit)).then_some(())
            },
        );
        let admitted = known || added.is_some();
        if !admitted {
            if self.refused.len() >= REFUSED_CACHE {
                self.refused.clear();
            }
            self.refused.insert(key, ());
        }
        admitted
    }

    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = host::define_metric(kind, name);
        self.ids.insert(name.to_string(), id);
        id
    }

    /// The ingest endpoints' refusal counters, defined at 0 so that Prometheus sees each
    /// series before its first refusal: a counter that appears at 1 has no earlier sample for
    /// `increase()`, and an alert on one bad push would never fire (an audit).
    pub fn define_ingest_rejected(&mut self) {
        for ep in Endpoint::ALL {
            for reason in ingest::REJECT_REASONS.into_iter().chain(["not_stored"]) {
                let name = format!("gpuroute.{}.rejected.{reason}", ep.stat());
                self.id(MetricType::Counter, &name);
            }
        }
    }

    pub fn inc(&mut self, name: &str) {
        self.add(name, 1);
    }

    pub fn add(&mut self, name: &str, n: u64) {
        if let Some(id) = self.id(MetricType::Counter, name) {
            host::increment_metric(id, n as i64);
        }
    }

    pub fn gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            host::record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            host::record_metric(id, value);
        }
    }

    /// A request for a split took a target (`rerouted`: off a target that could not serve):
    /// its `to` counter batched like a pick, by an id cached per split target.
    pub fn split(&mut self, taken: &SplitTaken) {
        let ids = self
            .splits
            .entry(Arc::as_ptr(&taken.split) as usize)
            .or_default();
        if ids.to.len() <= taken.target {
            ids.to.resize(taken.target + 1, None);
        }
        let to = *ids.to[taken.target].get_or_insert_with(|| {
            let (split, target) = taken.names();
            host::define_metric(MetricType::Counter, &split_stat(split, target))
        });
        let rerouted = taken.rerouted.then(|| {
            *ids.rerouted.get_or_insert_with(|| {
                let name = split_rerouted_stat(taken.split.name.as_str());
                host::define_metric(MetricType::Counter, &name)
            })
        });
        for id in [to, rerouted.flatten()].into_iter().flatten() {
            *self.pending.entry(id).or_insert(0) += 1;
        }
    }

    /// A request moved off its pool to pool `to` (`pools[].failover`, `overflow`): its
    /// counter's id is looked up once per pair of pools, and the count batched as the picks.
    pub fn moved(&mut self, to: &str, f: &FailedOver) {
        let known = self
            .moved
            .iter()
            .find(|m| m.overflow == f.overflow && *m.from == *f.from && m.to == to);
        let id = match known {
            Some(m) => m.id,
            None => {
                let id = host::define_metric(MetricType::Counter, &f.stat(to));
                self.moved.push(Moved {
                    from: f.from.clone(),
                    to: to.to_string(),
                    overflow: f.overflow,
                    id,
                });
                id
            }
        };
        if let Some(id) = id {
            *self.pending.entry(id).or_insert(0) += 1;
        }
    }

    /// Defines the hold counters, held gauge and wait histogram of every pool that may hold
    /// (`pools`, [`gpuroute_core::hold::stat_pools`]) as the configuration is read, as the
    /// dynamic module does: each series is there, at 0, before its first count (a counter that
    /// first appears at 1 gives Prometheus's `increase()` nothing, so a pool's first `full`
    /// never alerted).
    pub fn define_hold<'a>(&mut self, pools: impl Iterator<Item = &'a str>) {
        for pool in pools {
            let counters = HoldEvent::ALL
                .map(|e| host::define_metric(MetricType::Counter, &hold_stat(pool, e)));
            let gauge = host::define_metric(MetricType::Gauge, &held_stat(pool));
            let wait_ms = host::define_metric(MetricType::Histogram, &hold_ms_stat(pool));
            let ids = HoldIds {
                counters,
                gauge,
                wait_ms,
            };
            self.hold.insert(pool.to_string(), ids);
        }
    }

    /// Counts a hold event of a request held in `pool` (or, `Full`, that would have been). Every
    /// pool's ids are there with `hold` on ([`Stats::define_hold`]); without it nothing is held.
    pub fn hold(&mut self, pool: &str, event: HoldEvent) {
        let i = event as usize;
        let id = self
            .hold
            .get(pool)
            .and_then(|h| h.counters.get(i).copied().flatten());
        if let Some(id) = id {
            host::increment_metric(id, 1);
        }
    }

    /// Moves `pool`'s held gauge (every worker moves it: the count across workers).
    pub fn held(&mut self, pool: &str, delta: i64) {
        if let Some(id) = self.hold.get(pool).and_then(|h| h.gauge) {
            host::increment_metric(id, delta);
        }
    }

    /// How long a request held in `pool` waited before its decision took it out of the queue, ms.
    pub fn hold_waited(&mut self, pool: &str, ms: u64) {
        if let Some(id) = self.hold.get(pool).and_then(|h| h.wait_ms) {
            host::record_metric(id, ms);
        }
    }

    /// A refused request to an ingest endpoint: `gpuroute.<endpoint>.rejected.<reason>`.
    pub fn ingest_rejected(&mut self, endpoint: Endpoint, reason: &str) {
        self.inc(&format!("gpuroute.{}.rejected.{reason}", endpoint.stat()));
    }

    /// A streamed request's time from its routing decision to its first response byte, ms.
    /// The request was picked a pod, so its pool has its ids here ([`Stats::picked`]).
    pub fn first_token(&mut self, pool: &str, ms: u64) {
        let Some(ids) = self.hot.get_mut(pool) else {
            return;
        };
        let id = *ids.ttft.get_or_insert_with(|| {
            host::define_metric(
                MetricType::Histogram,
                &format!("gpuroute.pool.{}.ttft_ms", sanitize(pool)),
            )
        });
        if let Some(id) = id {
            host::record_metric(id, ms);
        }
    }

    /// A pod of `pool` left the picks for its server errors ([`gpuroute_core::outlier`]).
    /// Defines each pool's passive-health counters at 0 as the configuration is read, as the
    /// dynamic module does: an ejection alert (`GpuroutePodsEjected`) reads `increase()`, which
    /// a counter that first appears at 1 gives nothing.
    pub fn define_passive_health<'a>(
        &mut self,
        pools: impl Iterator<Item = &'a str>,
        unanswered: bool,
    ) {
        for pool in pools {
            let pool = sanitize(pool);
            self.id(
                MetricType::Counter,
                &format!("gpuroute.pool.{pool}.ejections"),
            );
            if unanswered {
                self.id(
                    MetricType::Counter,
                    &format!("gpuroute.pool.{pool}.unanswered"),
                );
            }
        }
    }

    pub fn ejection(&mut self, pool: &str) {
        self.inc(&format!("gpuroute.pool.{}.ejections", sanitize(pool)));
    }

    /// A request judged unanswered by its pod ([`gpuroute_core::outlier::Unanswered`]).
    pub fn unanswered(&mut self, pool: &str) {
        self.inc(&format!("gpuroute.pool.{}.unanswered", sanitize(pool)));
    }

    pub fn pool_outcome(&mut self, pool: &str, outcome: &str) {
        self.inc(&format!(
            "gpuroute.pool.{}.requests.{outcome}",
            sanitize(pool)
        ));
    }

    /// Counts a pick (pool `picked` and the pod's `picks`) without a host call: batched until
    /// the next [`Stats::flush`] (the root context's tick, every few ms). `address` names the
    /// pod's counter the first time the pod (`pod_key`) is picked; past `max_pod_stats` pods,
    /// the pool's `other` counter counts it.
    pub fn picked(&mut self, pool: &str, pod_key: u64, address: &str) {
        // One lookup of the pool on the hot path; its ids are defined on its first pick.
        let (picked, known) = match self.hot.get(pool) {
            Some(ids) => (ids.picked, ids.pods.get(&pod_key).copied()),
            None => {
                let picked = host::define_metric(
                    MetricType::Counter,
                    &format!("gpuroute.pool.{}.requests.picked", sanitize(pool)),
                );
                let ids = PoolIds {
                    picked,
                    ..PoolIds::default()
                };
                self.hot.insert(pool.to_string(), ids);
                (picked, None)
            }
        };
        let pod = match known {
            Some(id) => id,
            None => self.first_pick(pool, pod_key, address),
        };
        for id in [picked, pod].into_iter().flatten() {
            *self.pending.entry(id).or_insert(0) += 1;
        }
    }

    /// The picks counter of a pod this worker has not picked before (in `pool`, whose ids are
    /// in `hot`): its own if the Envoy has one for it or room for one (`max_pod_stats`), else
    /// the pool's `other`; none with `max_pod_stats` 0.
    fn first_pick(&mut self, pool: &str, pod_key: u64, address: &str) -> Option<u32> {
        if self.max_pod_stats == 0 {
            return None;
        }
        let admitted = self.admit(pod_stat_key(pool, pod_key));
        let ids = self.hot.get_mut(pool)?;
        // The address whole, as the snapshot has it (`ip:port`, validated there): Envoy's tag
        // extraction takes it into `gpuroute_endpoint`, as the dynamic module's label has it.
        let pod_counter = |pod: &str| {
            host::define_metric(
                MetricType::Counter,
                &format!("gpuroute.pool.{}.pod.{pod}.picks", sanitize(pool)),
            )
        };
        if admitted {
            let id = pod_counter(address);
            ids.pods.insert(pod_key, id);
            id
        } else {
            *ids.other.get_or_insert_with(|| pod_counter(OTHER_POD))
        }
    }

    /// Hands batched increments to Envoy.
    pub fn flush(&mut self) {
        for (id, n) in self.pending.drain() {
            host::increment_metric(id, n);
        }
    }
}
