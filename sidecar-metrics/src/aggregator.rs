//! The scrape loop: every `interval`, start a scrape of every pod that is not already being
//! scraped, fold results in as they arrive, and publish a snapshot when the round is complete
//! or at its publish deadline, whichever comes first.
//!
//! Why this shape:
//! - Each scrape is its own task with its own timeout, so a slow or dead pod delays nobody: the
//!   round publishes what has arrived at the deadline (default half the interval) and the slow
//!   pod's answer, when it comes, is folded into the next round.
//! - A pod still being scraped is not scraped again, so a hung pod costs one connection, not one
//!   per interval.
//! - Publishing right when the last pod answered (typically a few ms into the round) keeps the
//!   filter's view at most about one interval behind a pod.
//!
//! The loop is one task that owns all pod state (no locks); scrapes, parsing included, run on
//! the runtime's worker threads and send their result back over a channel.

use crate::config::Config;
use crate::discovery::{Target, Update, UpdateRx};
use crate::engine::Reading;
use crate::metrics::Histogram;
use crate::pod::{pool_snapshot, PodState};
use crate::scrape::{self, Fetch, ScrapeError};
use crate::util::{LogGate, WallClock};
use bytes::Bytes;
use gpuroute_core::snapshot::{PodSnapshot, PoolSnapshot, Snapshot, MAX_PODS, SNAPSHOT_SCHEMA};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// Summary of one round, for metrics, tests and the load harness.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundReport {
    pub index: u64,
    /// Time from the round's start to the last answer of its scrapes (or to the deadline).
    pub duration: Duration,
    /// Every scrape started in this round answered before publishing.
    pub complete: bool,
    /// Scrapes started in this round (pods not already in flight).
    pub launched: usize,
    /// Scrapes of this round that failed.
    pub failed: usize,
    pub pods: usize,
    pub healthy: usize,
}

/// Operator-facing details of one pod that the snapshot does not carry.
#[derive(Debug, Clone, PartialEq)]
pub struct PodStatus {
    pub name: Option<String>,
    pub metrics_url: String,
    pub last_error: Option<String>,
    pub consecutive_failures: u32,
    pub scrapes_total: u64,
    pub failures_by_kind: Vec<(&'static str, u64)>,
    pub last_latency: Duration,
    /// Decode step time estimate, seconds (the capacity estimate's input).
    pub itl_estimate: Option<f64>,
    pub in_flight: bool,
    /// Scraped asking for only the metrics read (`filter_metrics`).
    pub filtered: bool,
}

/// What one round publishes: the snapshot, its JSON, and everything the HTTP surface shows.
#[derive(Debug, Clone)]
pub struct Published {
    pub snapshot: Snapshot,
    /// `serde_json` of `snapshot`: the exact bytes pushed and served at `/debug/snapshot`.
    pub json: Bytes,
    /// Per pool, per pod, parallel to `snapshot.pools[i].pods`.
    pub status: Vec<Vec<PodStatus>>,
    pub round: RoundReport,
    pub scrape_latency: Histogram,
    pub round_latency: Histogram,
    pub rounds_incomplete: u64,
    pub invalid_snapshots: u64,
    /// Pods scraped whole after a filtered scrape found nothing (`filter_metrics`).
    pub filter_fallbacks: u64,
    /// Pods published without their values, as unhealthy, because the snapshot would have been
    /// refused with them ([`quarantine`]), since the start.
    pub pods_quarantined: u64,
    /// Pods left out of snapshots past [`MAX_PODS`], since the start.
    pub pods_left_out: u64,
    /// Snapshots pushed without (some of) the pods' adapter lists to fit
    /// `push.max_snapshot_bytes`, since the start.
    pub snapshots_trimmed: u64,
}

/// The snapshot's JSON within `max` bytes: as it is, or without the pods' waiting adapter
/// lists, then without their running ones too (what was dropped, when anything was). The filter
/// refuses a larger snapshot whole (413), every pool's pods with it; a pod's adapter lists are
/// what can grow past any bound that keeps the rest (the counts of pods and of adapters are
/// bounded, a name's length too, their product is not small).
fn fit(snapshot: &mut Snapshot, max: usize) -> Result<(Vec<u8>, Option<&'static str>), String> {
    let encode =
        |s: &Snapshot| serde_json::to_vec(s).map_err(|e| format!("cannot serialise it (bug): {e}"));
    let json = encode(snapshot)?;
    if json.len() <= max {
        return Ok((json, None));
    }
    for (what, running_too) in [("waiting adapter lists", false), ("adapter lists", true)] {
        for pool in &mut snapshot.pools {
            for pod in &mut pool.pods {
                if let Some(lora) = &mut pod.lora {
                    lora.waiting.clear();
                    if running_too {
                        lora.running.clear();
                    }
                }
            }
        }
        let json = encode(snapshot)?;
        if json.len() <= max {
            return Ok((json, Some(what)));
        }
    }
    Err(format!(
        "{} bytes without any adapter list, over push.max_snapshot_bytes ({max})",
        encode(snapshot)?.len()
    ))
}

/// A pod whose values the snapshot would refuse (values this reader should have caught, from
/// a broken or hostile pod): published with none of them and as unhealthy, so the filter
/// leaves it out, and one pod cannot get every pool's snapshot refused.
fn quarantine(pod: &mut PodSnapshot) {
    pod.healthy = false;
    pod.kv_cache_usage = None;
    pod.prefix_cache_hit_rate = None;
    pod.lora = None;
    pod.block_size = None;
    pod.num_blocks = None;
    pod.capacity = 1.0;
    pod.ramp_weight = 1.0;
}

/// How long the aggregator waits for every pool's discovery to report before it publishes
/// anyway. Publishing a pool as empty because the Kubernetes list has not come back yet would
/// make a restarted aggregator replace Envoy's good snapshot with a worse one; 5 s is far above
/// a normal API-server list and short enough that a broken discovery does not block the others.
pub const DISCOVERY_WAIT: Duration = Duration::from_secs(5);

/// Channel the aggregator publishes on; `None` until the first round.
pub type PublishRx = watch::Receiver<Option<Arc<Published>>>;

struct Done {
    id: u64,
    round: u64,
    at: Instant,
    latency: Duration,
    result: Result<Reading, ScrapeError>,
    /// Asked for only what is read (`filter_metrics`).
    filtered: bool,
}

struct Pool {
    name: String,
    /// Pod ids by address: the snapshot lists pods in address order.
    pods: BTreeMap<SocketAddr, u64>,
}

struct Round {
    index: u64,
    started: Instant,
    open: bool,
    pending: usize,
    launched: usize,
    failed: usize,
    last_answer: Instant,
}

/// The scrape loop's state. Build with [`Aggregator::new`], drive with [`Aggregator::run`].
pub struct Aggregator {
    cfg: Arc<Config>,
    fetcher: Arc<dyn Fetch>,
    clock: WallClock,
    started: Instant,
    source: String,
    pools: Vec<Pool>,
    /// Discovery has reported at least once, per pool.
    discovered: Vec<bool>,
    pods: HashMap<u64, PodState>,
    next_id: u64,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    publish: watch::Sender<Option<Arc<Published>>>,
    observer: Option<mpsc::UnboundedSender<RoundReport>>,
    round: Round,
    version: u64,
    scrape_latency: Histogram,
    round_latency: Histogram,
    rounds_incomplete: u64,
    invalid_snapshots: u64,
    invalid_gate: LogGate,
    /// Pods published without their values, as unhealthy, because the snapshot would refuse
    /// them ([`quarantine`]); and pods left out past [`MAX_PODS`].
    quarantined: u64,
    left_out: u64,
    /// Snapshots pushed without (some of) the pods' adapter lists, to fit ([`fit`]).
    trimmed: u64,
    /// One log limit each: a condition that holds every round (pods left out) must not keep
    /// the others' warnings from ever being logged.
    quarantine_gate: LogGate,
    left_out_gate: LogGate,
    trim_gate: LogGate,
    failure_gate: LogGate,
    /// Pods that fell back to whole scrapes (`filter_metrics`), and their log lines' limit (a
    /// fleet of SGLang pods falls back all at once).
    filter_fallbacks: u64,
    fallback_gate: LogGate,
}

impl Aggregator {
    /// An aggregator for `cfg`'s pools (no pods until discovery sends them) and the channel it
    /// publishes on.
    pub fn new(
        cfg: Arc<Config>,
        fetcher: Arc<dyn Fetch>,
        clock: WallClock,
        observer: Option<mpsc::UnboundedSender<RoundReport>>,
    ) -> (Aggregator, PublishRx) {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let (publish, rx) = watch::channel(None);
        let now = Instant::now();
        let source = cfg.source_name();
        let pools = cfg
            .pools
            .iter()
            .map(|p| Pool {
                name: p.name.clone(),
                pods: BTreeMap::new(),
            })
            .collect();
        let discovered = vec![false; cfg.pools.len()];
        let agg = Aggregator {
            cfg,
            discovered,
            fetcher,
            clock,
            started: now,
            source,
            pools,
            pods: HashMap::new(),
            next_id: 0,
            done_tx,
            done_rx,
            publish,
            observer,
            round: Round {
                index: 0,
                started: now,
                open: false,
                pending: 0,
                launched: 0,
                failed: 0,
                last_answer: now,
            },
            version: 0,
            scrape_latency: Histogram::default(),
            round_latency: Histogram::default(),
            rounds_incomplete: 0,
            invalid_snapshots: 0,
            invalid_gate: LogGate::new(Duration::from_secs(10)),
            quarantined: 0,
            left_out: 0,
            trimmed: 0,
            quarantine_gate: LogGate::new(Duration::from_secs(10)),
            left_out_gate: LogGate::new(Duration::from_secs(10)),
            trim_gate: LogGate::new(Duration::from_secs(10)),
            failure_gate: LogGate::new(Duration::from_secs(10)),
            filter_fallbacks: 0,
            fallback_gate: LogGate::new(Duration::from_secs(10)),
        };
        (agg, rx)
    }

    /// Runs until `shutdown`, taking pod lists from `updates`.
    pub async fn run(mut self, mut updates: UpdateRx, shutdown: CancellationToken) {
        let interval = Duration::from_millis(self.cfg.interval_ms);
        let deadline_after = Duration::from_millis(self.cfg.publish_deadline_ms());
        let mut tick = tokio::time::interval(interval);
        // A loop that fell behind (machine overloaded) skips rounds instead of bursting.
        tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
        let deadline = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(deadline);
        let mut updates_open = true;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                u = updates.recv(), if updates_open => match u {
                    Some(u) => self.apply_update(u),
                    None => updates_open = false,
                },
                Some(done) = self.done_rx.recv() => {
                    self.on_done(done);
                    if self.round.open && self.round.pending == 0 {
                        self.close_round(self.round.last_answer);
                    }
                }
                _ = &mut deadline, if self.round.open => {
                    self.close_round(Instant::now());
                }
                _ = tick.tick() => {
                    if self.round.open {
                        self.close_round(Instant::now());
                    }
                    self.start_round();
                    deadline.as_mut().reset(self.round.started + deadline_after);
                    if self.round.pending == 0 {
                        self.close_round(self.round.started);
                    }
                }
            }
        }
    }

    /// Reconciles one pool with its new pod list.
    fn apply_update(&mut self, u: Update) {
        let Some(pool) = self.pools.get_mut(u.pool) else {
            return;
        };
        self.discovered[u.pool] = true;
        let mut next: BTreeMap<SocketAddr, u64> = BTreeMap::new();
        for t in u.targets {
            if next.contains_key(&t.address) {
                continue;
            }
            let id = match pool.pods.remove(&t.address) {
                Some(id) => {
                    if let Some(p) = self.pods.get_mut(&id) {
                        if p.target != t {
                            p.set_target(t.clone(), self.cfg.filter_metrics);
                        }
                    }
                    id
                }
                None => {
                    let id = self.next_id;
                    self.next_id += 1;
                    self.pods
                        .insert(id, PodState::scraped(t.clone(), self.cfg.filter_metrics));
                    id
                }
            };
            next.insert(t.address, id);
        }
        // What is left was removed; a scrape still in flight for it is ignored on arrival.
        for id in pool.pods.values() {
            self.pods.remove(id);
        }
        pool.pods = next;
    }

    fn start_round(&mut self) {
        let now = Instant::now();
        self.round = Round {
            index: self.round.index + 1,
            started: now,
            open: true,
            pending: 0,
            launched: 0,
            failed: 0,
            last_answer: now,
        };
        let timeout = Duration::from_millis(self.cfg.timeout_ms);
        for (id, pod) in self.pods.iter_mut() {
            if pod.in_flight {
                continue;
            }
            pod.in_flight = true;
            self.round.pending += 1;
            self.round.launched += 1;
            let (id, round) = (*id, self.round.index);
            let fetcher = self.fetcher.clone();
            let url = pod.url.current();
            let filtered = url.as_ref().is_ok_and(|(_, f)| *f);
            let engine = pod.target.engine;
            let tx = self.done_tx.clone();
            tokio::spawn(async move {
                let begin = Instant::now();
                let result = match url {
                    Ok((url, _)) => scrape::scrape(&*fetcher, &url, engine, timeout, false).await,
                    Err(e) => Err(e),
                };
                let at = Instant::now();
                // The receiver is gone only at shutdown.
                let _ = tx.send(Done {
                    id,
                    round,
                    at,
                    latency: at - begin,
                    result,
                    filtered,
                });
            });
        }
    }

    fn on_done(&mut self, d: Done) {
        let current = d.round == self.round.index && self.round.open;
        if current {
            self.round.pending = self.round.pending.saturating_sub(1);
            self.round.last_answer = self.round.last_answer.max(d.at);
        }
        self.scrape_latency.observe(d.latency);
        let Some(pod) = self.pods.get_mut(&d.id) else {
            return;
        };
        pod.in_flight = false;
        pod.last_latency = d.latency;
        match d.result {
            Ok(reading) => {
                let wall = self.clock.ms_at(d.at);
                pod.on_success(reading, d.at, wall, &self.cfg.capacity);
            }
            // Asked for only what it reads, the pod refused or had none of it: scraped whole from
            // the next round on; not a failure.
            Err(e) if d.filtered && e.drops_filter() => {
                pod.url.drop_filter();
                self.filter_fallbacks += 1;
                if let Some(held) = self.fallback_gate.allow(d.at) {
                    tracing::info!(pod = %pod.target.address, url = %pod.target.metrics_url, error = %e,
                        suppressed = held, "the pod answers no metrics when asked for only the ones read; scraping it whole");
                }
            }
            Err(e) => {
                if current {
                    self.round.failed += 1;
                }
                let first = pod.consecutive_failures == 0;
                let msg = e.to_string();
                pod.on_failure(e.kind(), msg.clone());
                // Log a pod's first failure of a streak (rate limited across pods); the rest
                // is in /metrics and on the status page.
                if first {
                    if let Some(held) = self.failure_gate.allow(d.at) {
                        tracing::warn!(pod = %pod.target.address, url = %pod.target.metrics_url,
                            error = %msg, suppressed = held, "scrape failed");
                    }
                }
            }
        }
    }

    fn close_round(&mut self, end: Instant) {
        self.round.open = false;
        let complete = self.round.pending == 0;
        let duration = end.saturating_duration_since(self.round.started);
        self.round_latency.observe(duration);
        if !complete {
            self.rounds_incomplete += 1;
        }
        let now = Instant::now();
        if !self.discovered.iter().all(|d| *d)
            && now.saturating_duration_since(self.started) < DISCOVERY_WAIT
        {
            return;
        }
        let mut pools = Vec::with_capacity(self.pools.len());
        let mut status = Vec::with_capacity(self.pools.len());
        let (mut total, mut healthy) = (0, 0);
        for pool in &self.pools {
            let mut weights = Vec::with_capacity(pool.pods.len());
            for id in pool.pods.values() {
                if let Some(p) = self.pods.get_mut(id) {
                    weights.push(p.evaluate(now, self.started, &self.cfg.health, &self.cfg.ramp));
                }
            }
            let mut states: Vec<&PodState> = pool
                .pods
                .values()
                .filter_map(|id| self.pods.get(id))
                .collect();
            // The snapshot holds at most MAX_PODS pods: past them (a discovery that found
            // more), pods are left out rather than the whole snapshot refused.
            let room = MAX_PODS.saturating_sub(total);
            if states.len() > room {
                let over = states.len() - room;
                self.left_out += over as u64;
                if let Some(held) = self.left_out_gate.allow(now) {
                    tracing::error!(pool = %pool.name, left_out = over, suppressed = held,
                        "more than {MAX_PODS} pods in all: the rest are left out of the snapshot");
                }
                states.truncate(room);
                weights.truncate(room);
            }
            let (mut pods, caps) = pool_snapshot(&states, &weights, self.cfg.capacity.estimate);
            pods.retain_mut(|pod| {
                let Err(e) = pod.validate(|| format!("pod {}", pod.address)) else {
                    return true;
                };
                self.quarantined += 1;
                if let Some(held) = self.quarantine_gate.allow(now) {
                    tracing::warn!(pool = %pool.name, error = %e, suppressed = held,
                        "a pod's values would get the snapshot refused: published without them, as unhealthy");
                }
                quarantine(pod);
                // An address no pod can have (port 0, a zone id): not published at all.
                pod.validate(String::new).is_ok()
            });
            let mut st = Vec::with_capacity(states.len());
            for p in &states {
                total += 1;
                healthy += usize::from(p.healthy);
                st.push(PodStatus {
                    name: p.target.name.clone(),
                    metrics_url: p.target.metrics_url.clone(),
                    last_error: p.last_error.clone(),
                    consecutive_failures: p.consecutive_failures,
                    scrapes_total: p.scrapes_total,
                    failures_by_kind: p.failures_by_kind.clone(),
                    last_latency: p.last_latency,
                    itl_estimate: p.itl_estimate,
                    in_flight: p.in_flight,
                    filtered: p.url.filtered(),
                });
            }
            // The same pods in the same order as `states`.
            let mut published = caps.into_iter();
            for id in pool.pods.values() {
                if let Some(p) = self.pods.get_mut(id) {
                    p.published_capacity = published.next();
                }
            }
            pools.push(PoolSnapshot {
                name: pool.name.clone(),
                pods,
            });
            status.push(st);
        }
        let wall = self.clock.ms_at(now);
        // Strictly increasing, also across restarts: wall-clock based, never repeating.
        self.version = (self.version + 1).max(wall.saturating_mul(1000));
        let snapshot = Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: self.version,
            source: self.source.clone(),
            generated_at_ms: wall,
            pools,
        };
        let report = RoundReport {
            index: self.round.index,
            duration,
            complete,
            launched: self.round.launched,
            failed: self.round.failed,
            pods: total,
            healthy,
        };
        if let Some(obs) = &self.observer {
            let _ = obs.send(report.clone());
        }
        // A snapshot the filter would reject is our bug: keep the previous one in force.
        if let Err(e) = snapshot.validate() {
            self.invalid_snapshots += 1;
            if let Some(held) = self.invalid_gate.allow(now) {
                tracing::error!(error = %e, suppressed = held, "assembled an invalid snapshot; not publishing it (bug)");
            }
            return;
        }
        let mut snapshot = snapshot;
        let json = match fit(&mut snapshot, self.cfg.push.max_snapshot_bytes) {
            Ok((v, trimmed)) => {
                if let Some(what) = trimmed {
                    self.trimmed += 1;
                    if let Some(held) = self.trim_gate.allow(now) {
                        tracing::warn!(max = self.cfg.push.max_snapshot_bytes, dropped = what, suppressed = held,
                            "the snapshot was over push.max_snapshot_bytes: pushed without the pods' adapter lists");
                    }
                }
                Bytes::from(v)
            }
            Err(e) => {
                self.invalid_snapshots += 1;
                if let Some(held) = self.invalid_gate.allow(now) {
                    tracing::error!(error = %e, suppressed = held, "not publishing the snapshot");
                }
                return;
            }
        };
        let published = Published {
            snapshot,
            json,
            status,
            round: report,
            scrape_latency: self.scrape_latency.clone(),
            round_latency: self.round_latency.clone(),
            rounds_incomplete: self.rounds_incomplete,
            invalid_snapshots: self.invalid_snapshots,
            pods_quarantined: self.quarantined,
            pods_left_out: self.left_out,
            snapshots_trimmed: self.trimmed,
            filter_fallbacks: self.filter_fallbacks,
        };
        self.publish.send_replace(Some(Arc::new(published)));
    }
}

/// Convenience for tests and tools: the targets of a static pool as an [`Update`].
pub fn static_update(pool: usize, targets: Vec<Target>) -> Update {
    Update { pool, targets }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::future::BoxFuture;
    use std::sync::Mutex;

    /// Pods scripted per URL: each answers after its delay with its text, or fails to connect.
    /// A URL with a query not scripted itself is answered as the URL without it (a server that
    /// ignores the filter); calls are counted per URL as asked.
    #[derive(Default)]
    struct FakeFleet {
        pods: Mutex<HashMap<String, (Duration, Option<String>)>>,
        calls: Mutex<HashMap<String, usize>>,
    }

    impl FakeFleet {
        fn set(&self, url: &str, delay_ms: u64, body: Option<&str>) {
            self.pods.lock().unwrap().insert(
                url.to_string(),
                (Duration::from_millis(delay_ms), body.map(str::to_string)),
            );
        }
        /// Calls of `url`, with or without a query.
        fn calls(&self, url: &str) -> usize {
            self.calls
                .lock()
                .unwrap()
                .iter()
                .filter(|(u, _)| u.split('?').next() == Some(url))
                .map(|(_, n)| n)
                .sum()
        }
        /// Calls of exactly `url`.
        fn calls_exactly(&self, url: &str) -> usize {
            self.calls.lock().unwrap().get(url).copied().unwrap_or(0)
        }
    }

    impl Fetch for FakeFleet {
        fn fetch(&self, url: &http::Uri) -> BoxFuture<'static, Result<Bytes, ScrapeError>> {
            let url = &url.to_string();
            *self
                .calls
                .lock()
                .unwrap()
                .entry(url.to_string())
                .or_default() += 1;
            let pods = self.pods.lock().unwrap();
            let (delay, body) = pods
                .get(url)
                .or_else(|| pods.get(url.split('?').next().unwrap_or(url)))
                .cloned()
                .unwrap_or((Duration::ZERO, None));
            Box::pin(async move {
                tokio::time::sleep(delay).await;
                body.map(Bytes::from)
                    .ok_or(ScrapeError::Connect("refused".into()))
            })
        }
    }

    fn target(port: u16) -> Target {
        Target {
            address: SocketAddr::from(([127, 0, 0, 1], port)),
            metrics_url: format!("http://127.0.0.1:{port}/metrics"),
            engine: None,
            capacity: None,
            ready: true,
            name: None,
        }
    }

    fn config() -> Arc<Config> {
        let mut c = Config::default();
        c.pools.push(crate::config::PoolConfig {
            pods: Some(vec![]),
            ..crate::config::PoolConfig::named("p")
        });
        Arc::new(c)
    }

    struct Harness {
        fleet: Arc<FakeFleet>,
        rx: PublishRx,
        rounds: mpsc::UnboundedReceiver<RoundReport>,
        updates: crate::discovery::UpdateTx,
        stop: CancellationToken,
    }

    fn start(cfg: Arc<Config>, ports: &[u16]) -> Harness {
        let fleet = Arc::new(FakeFleet::default());
        let (obs_tx, rounds) = mpsc::unbounded_channel();
        let (agg, rx) = Aggregator::new(cfg, fleet.clone(), WallClock::system(), Some(obs_tx));
        let (updates, up_rx) = crate::discovery::channel();
        updates
            .send(static_update(0, ports.iter().map(|p| target(*p)).collect()))
            .unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(agg.run(up_rx, stop.clone()));
        Harness {
            fleet,
            rx,
            rounds,
            updates,
            stop,
        }
    }

    fn pod(p: &Published, port: u16) -> &gpuroute_core::snapshot::PodSnapshot {
        let addr = format!("127.0.0.1:{port}");
        p.snapshot.pools[0]
            .pods
            .iter()
            .find(|x| x.address == addr)
            .unwrap()
    }

    const BODY: &str =
        "vllm:num_requests_waiting 2\nvllm:num_requests_running 3\nvllm:kv_cache_usage_perc 0.5\n";

    #[tokio::test(start_paused = true)]
    async fn a_slow_pod_does_not_delay_the_round_or_get_scraped_twice() {
        let mut h = start(config(), &[1, 2, 3]);
        h.fleet.set("http://127.0.0.1:1/metrics", 2, Some(BODY));
        h.fleet.set("http://127.0.0.1:2/metrics", 3, Some(BODY));
        // Answers after 250 ms: inside the 300 ms timeout, far past the 50 ms deadline.
        h.fleet.set("http://127.0.0.1:3/metrics", 250, Some(BODY));
        let mut durations = Vec::new();
        for _ in 0..10 {
            let r = h.rounds.recv().await.unwrap();
            durations.push(r.duration);
        }
        // Every round is published at the 50 ms deadline at the latest, never waiting 250 ms.
        assert!(
            durations.iter().all(|d| *d <= Duration::from_millis(50)),
            "{durations:?}"
        );
        // 10 rounds = 1 s; the slow pod can be scraped at most once per 250 ms.
        let slow = h.fleet.calls("http://127.0.0.1:3/metrics");
        assert!((3..=4).contains(&slow), "slow pod scraped {slow} times");
        assert!(h.fleet.calls("http://127.0.0.1:1/metrics") >= 10);
        let p = h.rx.borrow().clone().unwrap();
        assert!(
            pod(&p, 1).healthy && pod(&p, 3).healthy,
            "slow but in time is healthy"
        );
        assert_eq!(pod(&p, 1).waiting, 2);
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn pods_are_asked_for_only_what_is_read_and_scraped_whole_when_that_finds_nothing() {
        let mut h = start(config(), &[1, 2, 3, 4]);
        let whole = |p: u16| format!("http://127.0.0.1:{p}/metrics");
        let filtered = |p: u16| {
            let url = url::Url::parse(&whole(p)).unwrap();
            crate::engine::filtered_url(&url, None).to_string()
        };
        // 1 takes the filter (answers its metrics); 2 ignores it (the same whole body); 3
        // answers it with a broken line of a metric it reads; 4 with nothing the aggregator
        // reads (an exporter whose metric names the filter misses).
        for p in [1, 2, 3, 4] {
            h.fleet.set(&whole(p), 1, Some(BODY));
        }
        h.fleet.set(&filtered(1), 1, Some(BODY));
        h.fleet.set(
            &filtered(3),
            1,
            Some("vllm:num_requests_waiting{broken 1\n"),
        );
        h.fleet.set(&filtered(4), 1, Some("other_metric 1\n"));
        for _ in 0..6 {
            h.rounds.recv().await.unwrap();
        }
        let p = h.rx.borrow().clone().unwrap();
        for port in [1, 2, 4] {
            assert!(pod(&p, port).healthy, "pod {port}");
            assert_eq!(pod(&p, port).waiting, 2, "pod {port}");
        }
        // 1 and 2 are always asked through the filter; 4 once, then whole.
        assert_eq!(h.fleet.calls_exactly(&whole(1)), 0);
        assert_eq!(h.fleet.calls_exactly(&whole(2)), 0);
        assert!(h.fleet.calls_exactly(&filtered(1)) >= 6);
        assert_eq!(h.fleet.calls_exactly(&filtered(4)), 1);
        assert!(h.fleet.calls_exactly(&whole(4)) >= 4);
        // A malformed answer is a failed scrape like any other, not a reason to give up the
        // filter: 3 stays on it, and out of the pool.
        assert!(!pod(&p, 3).healthy);
        assert!(h.fleet.calls_exactly(&filtered(3)) >= 6);
        assert_eq!(h.fleet.calls_exactly(&whole(3)), 0);
        assert_eq!(p.filter_fallbacks, 1);
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_refusing_the_filtered_url_is_scraped_whole() {
        struct Refuses(FakeFleet);
        impl Fetch for Refuses {
            fn fetch(&self, url: &http::Uri) -> BoxFuture<'static, Result<Bytes, ScrapeError>> {
                if url.query().is_some() {
                    *self
                        .0
                        .calls
                        .lock()
                        .unwrap()
                        .entry(url.to_string())
                        .or_default() += 1;
                    return Box::pin(async { Err(ScrapeError::Status(400)) });
                }
                self.0.fetch(url)
            }
        }
        let fleet = Arc::new(Refuses(FakeFleet::default()));
        fleet.0.set("http://127.0.0.1:1/metrics", 1, Some(BODY));
        let (obs_tx, mut rounds) = mpsc::unbounded_channel();
        let (agg, rx) = Aggregator::new(config(), fleet.clone(), WallClock::system(), Some(obs_tx));
        let (updates, up_rx) = crate::discovery::channel();
        updates.send(static_update(0, vec![target(1)])).unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(agg.run(up_rx, stop.clone()));
        for _ in 0..3 {
            rounds.recv().await.unwrap();
        }
        let p = rx.borrow().clone().unwrap();
        assert!(pod(&p, 1).healthy);
        assert_eq!(fleet.0.calls("http://127.0.0.1:1/metrics"), 3);
        assert_eq!(fleet.0.calls_exactly("http://127.0.0.1:1/metrics"), 2);
        assert_eq!(p.filter_fallbacks, 1);
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn filter_metrics_off_scrapes_whole() {
        let mut c = (*config()).clone();
        c.filter_metrics = false;
        let mut h = start(Arc::new(c), &[1]);
        h.fleet.set("http://127.0.0.1:1/metrics", 1, Some(BODY));
        for _ in 0..3 {
            h.rounds.recv().await.unwrap();
        }
        assert_eq!(h.fleet.calls_exactly("http://127.0.0.1:1/metrics"), 3);
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn rounds_complete_as_soon_as_every_pod_answered() {
        let mut h = start(config(), &[1, 2]);
        h.fleet.set("http://127.0.0.1:1/metrics", 4, Some(BODY));
        h.fleet.set("http://127.0.0.1:2/metrics", 7, Some(BODY));
        let _first = h.rounds.recv().await.unwrap();
        let r = h.rounds.recv().await.unwrap();
        assert!(r.complete);
        assert_eq!(r.launched, 2);
        assert_eq!(r.duration, Duration::from_millis(7));
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn dead_and_hung_pods_leave_within_a_second_and_ramp_back() {
        let cfg = {
            let mut c = (*config()).clone();
            // Short start-up grace so the returning pod visibly ramps.
            c.ramp.startup_grace_ms = 100;
            Arc::new(c)
        };
        let mut h = start(cfg, &[1, 2, 3]);
        for p in [1, 2, 3] {
            h.fleet
                .set(&format!("http://127.0.0.1:{p}/metrics"), 1, Some(BODY));
        }
        for _ in 0..5 {
            h.rounds.recv().await.unwrap();
        }
        assert!(pod(&h.rx.borrow().clone().unwrap(), 2).healthy);
        let died = Instant::now();
        h.fleet.set("http://127.0.0.1:2/metrics", 0, None); // connection refused
        h.fleet
            .set("http://127.0.0.1:3/metrics", 60_000, Some(BODY)); // hangs: timeouts
        let (mut dead_out, mut hung_out) = (None, None);
        while dead_out.is_none() || hung_out.is_none() {
            h.rounds.recv().await.unwrap();
            let p = h.rx.borrow().clone().unwrap();
            if dead_out.is_none() && !pod(&p, 2).healthy {
                dead_out = Some(died.elapsed());
            }
            if hung_out.is_none() && !pod(&p, 3).healthy {
                hung_out = Some(died.elapsed());
            }
            assert!(pod(&p, 1).healthy, "the others stay in");
            assert!(died.elapsed() < Duration::from_secs(3), "took too long");
        }
        let (dead_out, hung_out) = (dead_out.unwrap(), hung_out.unwrap());
        println!("dead pod out after {dead_out:?}, hung pod out after {hung_out:?}");
        assert!(
            dead_out <= Duration::from_millis(400),
            "dead pod out after {dead_out:?}"
        );
        assert!(
            hung_out <= Duration::from_millis(1_100),
            "hung pod out after {hung_out:?}"
        );

        // The dead pod comes back: healthy at once, weight ramping from 0.1 to 1 over 30 s.
        h.fleet.set("http://127.0.0.1:2/metrics", 1, Some(BODY));
        let back = Instant::now();
        let mut seen = Vec::new();
        loop {
            h.rounds.recv().await.unwrap();
            let p = h.rx.borrow().clone().unwrap();
            let pd = pod(&p, 2);
            if pd.healthy {
                seen.push((back.elapsed(), pd.ramp_weight));
            }
            if pd.ramp_weight >= 1.0 {
                break;
            }
            assert!(back.elapsed() < Duration::from_secs(31));
        }
        let first = seen[0];
        assert!(
            first.0 <= Duration::from_millis(200) && first.1 < 0.15,
            "{first:?}"
        );
        assert!(
            seen.windows(2).all(|w| w[1].1 >= w[0].1),
            "weight never decreases"
        );
        let last = seen[seen.len() - 1];
        assert!(
            last.0 >= Duration::from_secs(29),
            "full weight only at the window's end: {last:?}"
        );
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn discovery_changes_add_and_remove_pods_and_never_answered_pods_are_listed() {
        let mut h = start(config(), &[1]);
        h.fleet.set("http://127.0.0.1:1/metrics", 1, Some(BODY));
        h.rounds.recv().await.unwrap();
        h.updates
            .send(static_update(0, vec![target(4), target(1)]))
            .unwrap();
        for _ in 0..3 {
            h.rounds.recv().await.unwrap();
        }
        let p = h.rx.borrow().clone().unwrap();
        let addrs: Vec<_> = p.snapshot.pools[0]
            .pods
            .iter()
            .map(|x| x.address.as_str())
            .collect();
        assert_eq!(addrs, ["127.0.0.1:1", "127.0.0.1:4"], "sorted by address");
        assert!(!pod(&p, 4).healthy, "never answered: listed, unhealthy");
        assert_eq!(pod(&p, 4).last_scrape_ms, 0);
        assert!(p.status[0][1]
            .last_error
            .as_deref()
            .unwrap()
            .contains("refused"));
        h.updates.send(static_update(0, vec![target(4)])).unwrap();
        h.rounds.recv().await.unwrap();
        let p = h.rx.borrow().clone().unwrap();
        assert_eq!(p.snapshot.pools[0].pods.len(), 1);
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn nothing_is_published_until_every_pool_was_discovered() {
        let cfg = {
            let mut c = (*config()).clone();
            let mut second = c.pools[0].clone();
            second.name = "q".into();
            c.pools.push(second);
            Arc::new(c)
        };
        let fleet = Arc::new(FakeFleet::default());
        fleet.set("http://127.0.0.1:1/metrics", 1, Some(BODY));
        let (agg, rx) = Aggregator::new(cfg, fleet, WallClock::system(), None);
        let (updates, up_rx) = crate::discovery::channel();
        updates.send(static_update(0, vec![target(1)])).unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(agg.run(up_rx, stop.clone()));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(rx.borrow().is_none(), "pool q has not been discovered yet");
        updates.send(static_update(1, vec![])).unwrap();
        tokio::time::sleep(Duration::from_millis(150)).await;
        let p = rx.borrow().clone().unwrap();
        assert_eq!(p.snapshot.pools.len(), 2);
        assert!(p.snapshot.pools[0].pods[0].healthy);
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_pool_whose_discovery_never_answers_stops_blocking_after_the_wait() {
        let cfg = {
            let mut c = (*config()).clone();
            let mut second = c.pools[0].clone();
            second.name = "q".into();
            c.pools.push(second);
            Arc::new(c)
        };
        let fleet = Arc::new(FakeFleet::default());
        let (agg, rx) = Aggregator::new(cfg, fleet, WallClock::system(), None);
        let (updates, up_rx) = crate::discovery::channel();
        updates.send(static_update(0, vec![target(1)])).unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(agg.run(up_rx, stop.clone()));
        tokio::time::sleep(DISCOVERY_WAIT - Duration::from_millis(200)).await;
        assert!(rx.borrow().is_none());
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(rx.borrow().is_some());
        stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn no_pods_values_keep_the_others_snapshot_from_being_published() {
        // Each a broken or hostile pod (found by an audit): before, 2 and 3 got every snapshot
        // refused (a NaN rate or fraction), 4 and 5 read as idle and took all the traffic.
        let mut h = start(config(), &[1, 2, 3, 4, 5]);
        h.fleet.set("http://127.0.0.1:1/metrics", 0, Some(BODY));
        // Prefix-cache counters whose deltas overflow to inf: inf / inf.
        let counters = |v: &str| {
            format!("{BODY}vllm:prefix_cache_hits_total {v}\nvllm:prefix_cache_queries_total {v}\n")
        };
        h.fleet
            .set("http://127.0.0.1:2/metrics", 0, Some(&counters("-1.7e308")));
        // Triton's KV use from used / max blocks, both sums overflowing.
        let triton = "nv_trt_llm_request_metrics{request_type=\"waiting\"} 1\n\
            nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",a=\"1\"} 1.7e308\n\
            nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"used\",a=\"2\"} 1.7e308\n\
            nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",a=\"1\"} 1.7e308\n\
            nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=\"max\",a=\"2\"} 1.7e308\n";
        h.fleet.set("http://127.0.0.1:3/metrics", 0, Some(triton));
        let nan = "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n";
        h.fleet.set("http://127.0.0.1:4/metrics", 0, Some(nan));
        let inf = "vllm:num_requests_waiting +Inf\nvllm:num_requests_running +Inf\nvllm:kv_cache_usage_perc +Inf\n";
        h.fleet.set("http://127.0.0.1:5/metrics", 0, Some(inf));
        for _ in 0..3 {
            h.rounds.recv().await.unwrap();
        }
        h.fleet
            .set("http://127.0.0.1:2/metrics", 0, Some(&counters("1.7e308")));
        let mut last = 0;
        for _ in 0..5 {
            h.rounds.recv().await.unwrap();
            let p = h.rx.borrow().clone().unwrap();
            // Published every round.
            assert!(p.snapshot.version > last);
            last = p.snapshot.version;
            assert!(p.snapshot.validate().is_ok());
            let good = pod(&p, 1);
            assert!(good.healthy && good.waiting == 2 && good.kv_cache_usage == Some(0.5));
            let overflowed = pod(&p, 2);
            assert!(overflowed.healthy && overflowed.prefix_cache_hit_rate.is_none());
            let triton = pod(&p, 3);
            assert!(triton.healthy && triton.waiting == 1 && triton.kv_cache_usage.is_none());
            // NaN load: unknown, so out of routing (a failed scrape).
            assert!(!pod(&p, 4).healthy);
            // +Inf load: as loaded as a pod can read.
            let full = pod(&p, 5);
            assert!(full.healthy && full.waiting == u32::MAX && full.running == u32::MAX);
            assert_eq!(full.kv_cache_usage, Some(1.0));
        }
        h.stop.cancel();
    }

    /// A pod's metrics with 10 running and 30 waiting adapters of long names.
    fn lora(i: u16) -> String {
        let names = |kind: &str, n: usize| {
            (0..n)
                .map(|j| format!("{kind}-adapter-{i}-{j:0>24}"))
                .collect::<Vec<_>>()
                .join(",")
        };
        format!(
            "{BODY}vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} 1\n",
            names("run", 10),
            names("wait", 30)
        )
    }

    #[tokio::test(start_paused = true)]
    async fn a_pod_at_an_address_envoy_cannot_have_is_left_out_not_the_snapshot() {
        // Port 0: what a discovery should never hand over, and the snapshot refuses.
        let mut h = start(config(), &[1, 0]);
        h.fleet.set("http://127.0.0.1:1/metrics", 0, Some(BODY));
        h.fleet.set("http://127.0.0.1:0/metrics", 0, Some(BODY));
        h.rounds.recv().await.unwrap();
        h.rounds.recv().await.unwrap();
        let p = h.rx.borrow().clone().unwrap();
        let addrs: Vec<_> = p.snapshot.pools[0]
            .pods
            .iter()
            .map(|p| &p.address)
            .collect();
        assert_eq!(addrs, ["127.0.0.1:1"]);
        assert!(p.snapshot.validate().is_ok() && pod(&p, 1).healthy);
        h.stop.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn pods_past_the_schemas_limit_are_left_out_not_the_snapshot() {
        const LEFT_OUT: &str = "the rest are left out of the snapshot";
        const TRIMMED: &str = "pushed without the pods' adapter lists";
        let ports: Vec<u16> = (1..=(MAX_PODS as u16 + 5)).collect();
        // The second time, the size limit is under the first snapshot's size: its adapter lists
        // go too, each round, as pods are left out each round. Both are logged.
        let mut max = config().push.max_snapshot_bytes;
        for trimmed in [false, true] {
            let (logs, _guard) = crate::util::Logs::capture();
            let mut cfg = (*config()).clone();
            cfg.push.max_snapshot_bytes = max;
            let mut h = start(Arc::new(cfg), &ports);
            h.fleet.set("http://127.0.0.1:1/metrics", 0, Some(&lora(1)));
            h.rounds.recv().await.unwrap();
            h.rounds.recv().await.unwrap();
            let p = h.rx.borrow().clone().unwrap();
            assert_eq!(p.snapshot.pools[0].pods.len(), MAX_PODS);
            assert_eq!(p.status[0].len(), MAX_PODS);
            assert!(p.pods_left_out >= 5 && p.snapshot.validate().is_ok());
            let lists = pod(&p, 1).lora.as_ref().unwrap();
            assert_eq!(lists.waiting.is_empty(), trimmed);
            assert_eq!(p.snapshots_trimmed >= 1, trimmed);
            // Once each within the log limit's 10 s, two rounds apart.
            assert_eq!(logs.count(LEFT_OUT), 1);
            assert_eq!(logs.count(TRIMMED), usize::from(trimmed));
            max = p.json.len() - 1;
            h.stop.cancel();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_snapshot_over_its_size_is_pushed_without_adapter_lists() {
        // (max bytes, what must be left): the waiting lists go first, then the running ones.
        for (max, running_kept) in [(4_000, true), (1_500, false)] {
            let mut cfg = (*config()).clone();
            cfg.push.max_snapshot_bytes = max;
            let mut h = start(Arc::new(cfg), &[1, 2, 3]);
            for port in [1, 2, 3] {
                h.fleet.set(
                    &format!("http://127.0.0.1:{port}/metrics"),
                    0,
                    Some(&lora(port)),
                );
            }
            h.rounds.recv().await.unwrap();
            h.rounds.recv().await.unwrap();
            let p = h.rx.borrow().clone().unwrap();
            assert!(p.json.len() <= max, "{} > {max}", p.json.len());
            assert_eq!(Snapshot::from_json(&p.json, 1 << 20).unwrap(), p.snapshot);
            for port in [1, 2, 3] {
                let l = pod(&p, port).lora.as_ref().unwrap();
                assert!(
                    l.waiting.is_empty() && l.running.is_empty() != running_kept,
                    "{max}"
                );
                assert_eq!(l.max_loras, 4);
            }
            assert!(p.snapshots_trimmed >= 1);
            h.stop.cancel();
        }
        // Within its size, a snapshot keeps its lists.
        let mut h = start(config(), &[1]);
        h.fleet.set("http://127.0.0.1:1/metrics", 0, Some(&lora(1)));
        h.rounds.recv().await.unwrap();
        h.rounds.recv().await.unwrap();
        let p = h.rx.borrow().clone().unwrap();
        assert_eq!(pod(&p, 1).lora.as_ref().unwrap().waiting.len(), 30);
        assert_eq!(p.snapshots_trimmed, 0);
        h.stop.cancel();
    }

    #[test]
    fn a_quarantined_pod_validates_and_is_out_of_routing() {
        let mut pod = PodSnapshot {
            kv_cache_usage: Some(f64::NAN),
            prefix_cache_hit_rate: Some(2.0),
            capacity: f64::INFINITY,
            ..PodSnapshot::new("10.0.0.1:8000", 1)
        };
        assert!(pod.validate(String::new).is_err());
        quarantine(&mut pod);
        assert!(pod.validate(String::new).is_ok() && !pod.healthy);
    }

    #[tokio::test(start_paused = true)]
    async fn versions_strictly_increase_and_snapshots_validate() {
        let mut h = start(config(), &[1]);
        h.fleet.set("http://127.0.0.1:1/metrics", 0, Some(BODY));
        let mut last = 0;
        for _ in 0..20 {
            h.rounds.recv().await.unwrap();
            let p = h.rx.borrow().clone().unwrap();
            assert!(p.snapshot.version > last);
            last = p.snapshot.version;
            let parsed = Snapshot::from_json(&p.json, 1 << 20).unwrap();
            assert_eq!(parsed, p.snapshot);
            let pd = pod(&p, 1);
            assert!(p.snapshot.generated_at_ms >= pd.last_scrape_ms);
        }
        h.stop.cancel();
    }
}
