//! Per-pod state across scrapes: health, ramp-up, counter rates and the speed estimate.
//!
//! Pure and synchronous: every method takes the instant it happens at, so the rules are tested
//! with plain instants and the aggregator loop stays a thin driver.
//!
//! Rules:
//! - **Healthy** = the platform says ready (Kubernetes), at least one good scrape whose data is
//!   no older than `health.max_data_age_ms`, and fewer than `health.unhealthy_after_failures`
//!   consecutive failed scrapes. A pod that never answered is listed, unhealthy.
//! - **Ramp**: when a pod turns healthy after having been unhealthy (or appears after the
//!   aggregator's start-up grace), its weight grows linearly from `ramp.start_weight` to 1 over
//!   `ramp.window_ms`. An unhealthy pod reports weight 0.
//! - **Rates** come from deltas between consecutive good scrapes; a counter that went down was
//!   reset (the server restarted), and its new value is the delta.
//! - **Speed**: the mean inter-token latency of each interval with at least
//!   `capacity.min_tokens` decoded tokens, smoothed by an exponential moving average with time
//!   constant `capacity.time_constant_ms`; see [`pool_capacities`].

use crate::config::{CapacityConfig, HealthConfig, RampConfig};
use crate::discovery::Target;
use crate::engine::Reading;
use crate::scrape::ScrapeUrl;
use gpuroute_core::snapshot::{Engine, PodSnapshot};
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

/// Lower and upper bound of an estimated capacity. A 10x spread covers the GPU generations one
/// pool can realistically mix (A10G to H200); beyond that the estimate is more likely an
/// artefact (an idle pod with one slow request) than a real speed ratio.
pub const CAPACITY_MIN: f64 = 0.1;
/// See [`CAPACITY_MIN`].
pub const CAPACITY_MAX: f64 = 10.0;
/// Quantile of a pod's per-interval inter-token latencies taken as its decode step time: low
/// enough to skip the intervals slowed by prefill chunks and adapter loads (a quarter or more of
/// a busy pod's intervals), high enough not to be one lucky interval.
pub const ITL_QUANTILE: f64 = 0.2;
/// Most samples kept per pod (10 s of 100 ms scrapes is 100).
const ITL_WINDOW_MAX: usize = 512;
/// A published capacity changes only when the estimate moves further than this from it (as a
/// ratio). The filter rounds capacities to speed classes (steps of sqrt 2) and homes
/// conversations and adapters by them, so an estimate wandering across a class boundary would
/// move homes back and forth. Replaying the mixed-gpu benchmark's scrapes (H100s 1.9-2.8 against
/// a boundary at 2.38): 7 changes of the pool's classes in 48 s without, 2 with 25%. A real
/// change (another GPU, a throttled card) is 2x and more.
pub const CAPACITY_DEADBAND: f64 = 0.25;

/// The counters kept from the previous good scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Counters {
    hits: Option<f64>,
    queries: Option<f64>,
    itl_sum: Option<f64>,
    itl_count: Option<f64>,
}

/// Why the last scrape of a pod failed, as a metric label.
pub type FailureKind = &'static str;

/// Everything the aggregator remembers about one pod.
#[derive(Debug, Clone)]
pub struct PodState {
    pub target: Target,
    /// A scrape is running; no second one starts until it ends.
    pub in_flight: bool,
    pub consecutive_failures: u32,
    /// Monotonic and wall-clock time of the last good scrape.
    pub last_success: Option<Instant>,
    pub last_success_ms: u64,
    /// The last good reading.
    pub reading: Option<Reading>,
    prev: Option<Counters>,
    /// Prefix-cache hit rate over the last interval (or the engine's own gauge).
    pub prefix_hit_rate: Option<f64>,
    /// Typical decode-step latency, seconds: the [`ITL_QUANTILE`] of the per-interval mean
    /// inter-token latencies of the last `time_constant_ms` (see [`PodState::on_success`]).
    pub itl_estimate: Option<f64>,
    /// Per-interval mean inter-token latencies in the estimate's window, oldest first.
    itl_window: VecDeque<(Instant, f64)>,
    /// The capacity last published for this pod ([`stable_capacity`]).
    pub published_capacity: Option<f64>,
    /// Health as of the last [`PodState::evaluate`].
    pub healthy: bool,
    ever_healthy: bool,
    ramp_from: Option<Instant>,
    /// Last failure, for the status page and `scrape-once`.
    pub last_error: Option<String>,
    pub scrapes_total: u64,
    pub failures_total: u64,
    /// Failures by kind (`connect`, `timeout`, `status`, `parse`, ...).
    pub failures_by_kind: Vec<(FailureKind, u64)>,
    /// Duration of the last finished scrape.
    pub last_latency: Duration,
    /// Where the pod is scraped: its metrics URL, and while the pod takes it, the same asking
    /// for only what is read (`filter_metrics`).
    pub url: ScrapeUrl,
}

impl PodState {
    /// A pod just discovered, scraped whole: unhealthy until its first good scrape.
    pub fn new(target: Target) -> PodState {
        PodState::scraped(target, false)
    }

    /// A pod just discovered; `filter` asks it for only the metrics read.
    pub fn scraped(target: Target, filter: bool) -> PodState {
        PodState {
            url: ScrapeUrl::new(&target.metrics_url, target.engine, filter),
            target,
            in_flight: false,
            consecutive_failures: 0,
            last_success: None,
            last_success_ms: 0,
            reading: None,
            prev: None,
            prefix_hit_rate: None,
            itl_estimate: None,
            itl_window: VecDeque::new(),
            published_capacity: None,
            healthy: false,
            ever_healthy: false,
            ramp_from: None,
            last_error: None,
            scrapes_total: 0,
            failures_total: 0,
            failures_by_kind: Vec::new(),
            last_latency: Duration::ZERO,
        }
    }

    /// The pod's target as discovered again; its URLs are made anew only when the metrics URL
    /// or the engine changed, so a pod that stopped taking the filter is not asked again.
    pub fn set_target(&mut self, target: Target, filter: bool) {
        if target.metrics_url != self.target.metrics_url || target.engine != self.target.engine {
            self.url = ScrapeUrl::new(&target.metrics_url, target.engine, filter);
        }
        self.target = target;
    }

    /// Folds in a good scrape taken at `at` (`wall_ms` on the wall clock).
    pub fn on_success(
        &mut self,
        reading: Reading,
        at: Instant,
        wall_ms: u64,
        cap: &CapacityConfig,
    ) {
        self.scrapes_total += 1;
        self.consecutive_failures = 0;
        self.last_success = Some(at);
        self.last_success_ms = wall_ms;
        self.last_error = None;
        let now = Counters {
            hits: reading.prefix_hits,
            queries: reading.prefix_queries,
            itl_sum: reading.itl_sum,
            itl_count: reading.itl_count,
        };
        self.prefix_hit_rate = match (reading.prefix_hit_rate, &self.prev) {
            // The engine reports a rate itself (SGLang, vLLM V0).
            (Some(r), _) => Some(r),
            (None, Some(prev)) => {
                match (delta(prev.hits, now.hits), delta(prev.queries, now.queries)) {
                    // Not a number when the counters' deltas overflow (inf / inf): no rate.
                    (Some(h), Some(q)) if q > 0.0 => Some(h / q)
                        .filter(|r| !r.is_nan())
                        .map(|r| r.clamp(0.0, 1.0)),
                    // No queries in the interval: no rate, rather than a made-up 0.
                    _ => None,
                }
            }
            (None, None) => None,
        };
        if let Some(prev) = &self.prev {
            if let (Some(ds), Some(dc)) = (
                delta(prev.itl_sum, now.itl_sum),
                delta(prev.itl_count, now.itl_count),
            ) {
                if dc >= cap.min_tokens as f64 && ds > 0.0 {
                    self.push_itl(at, ds / dc, cap);
                }
            }
        }
        self.prev = Some(now);
        self.reading = Some(reading);
    }

    /// Adds one interval's mean inter-token latency and re-estimates.
    ///
    /// The estimate is a low quantile of the window, not its mean: an interval's mean is the
    /// decode step time only when no prefill chunk or adapter load ran beside the decoding, and
    /// a busy pod has more intervals with those, so the mean read a busy pod as slow (on four
    /// identical simulated A100s under the multi-lora workload the mean-based capacities ranged
    /// over 0.36-3.45; this estimate 0.94-1.04, and on the mixed-gpu fleet it separates the H100
    /// and L40S pods by 3-4x where the mean said 1.6-2x). Without new samples the estimate holds.
    fn push_itl(&mut self, at: Instant, sample: f64, cap: &CapacityConfig) {
        let window = Duration::from_millis(cap.time_constant_ms);
        while self
            .itl_window
            .front()
            .is_some_and(|(t, _)| at.saturating_duration_since(*t) > window)
            || self.itl_window.len() >= ITL_WINDOW_MAX
        {
            self.itl_window.pop_front();
        }
        self.itl_window.push_back((at, sample));
        // Linear selection, not a sort: 1,000 busy pods scraped every 100 ms do this 10,000
        // times a second.
        let mut v: Vec<f64> = self.itl_window.iter().map(|(_, x)| *x).collect();
        let i = (((v.len() as f64) * ITL_QUANTILE) as usize).min(v.len() - 1);
        let (_, q, _) = v.select_nth_unstable_by(i, f64::total_cmp);
        self.itl_estimate = Some(*q);
    }

    /// Records a failed scrape.
    pub fn on_failure(&mut self, kind: FailureKind, message: String) {
        self.scrapes_total += 1;
        self.failures_total += 1;
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.last_error = Some(message);
        match self.failures_by_kind.iter_mut().find(|(k, _)| *k == kind) {
            Some((_, n)) => *n += 1,
            None => self.failures_by_kind.push((kind, 1)),
        }
    }

    /// Updates health and returns the ramp weight at `now`. `started` is the aggregator's start.
    pub fn evaluate(
        &mut self,
        now: Instant,
        started: Instant,
        health: &HealthConfig,
        ramp: &RampConfig,
    ) -> f64 {
        let fresh = self.last_success.is_some_and(|t| {
            now.saturating_duration_since(t) <= Duration::from_millis(health.max_data_age_ms)
        });
        let ok = self.target.ready
            && fresh
            && self.consecutive_failures < health.unhealthy_after_failures;
        if ok && !self.healthy {
            let in_grace = now.saturating_duration_since(started)
                <= Duration::from_millis(ramp.startup_grace_ms);
            let skip = ramp.window_ms == 0 || (!self.ever_healthy && in_grace);
            self.ramp_from = if skip { None } else { Some(now) };
            self.ever_healthy = true;
        }
        self.healthy = ok;
        if !ok {
            return 0.0;
        }
        match self.ramp_from {
            None => 1.0,
            Some(from) => {
                let f = now.saturating_duration_since(from).as_secs_f64()
                    / Duration::from_millis(ramp.window_ms).as_secs_f64();
                if f >= 1.0 {
                    self.ramp_from = None;
                    1.0
                } else {
                    ramp.start_weight + (1.0 - ramp.start_weight) * f
                }
            }
        }
    }

    /// The snapshot entry for this pod (after [`PodState::evaluate`]).
    pub fn snapshot(&self, ramp_weight: f64, capacity: f64) -> PodSnapshot {
        let r = self.reading.as_ref();
        let count =
            |v: Option<f64>| v.map_or(0, |v| v.round().clamp(0.0, f64::from(u32::MAX)) as u32);
        PodSnapshot {
            address: self.target.address.to_string(),
            engine: r
                .map(|r| r.engine)
                .filter(|e| *e != Engine::Unknown)
                .or(self.target.engine)
                .unwrap_or_default(),
            healthy: self.healthy,
            last_scrape_ms: self.last_success_ms,
            kv_cache_usage: r.and_then(|r| r.kv_cache_usage),
            waiting: count(r.and_then(|r| r.waiting)),
            running: count(r.and_then(|r| r.running)),
            lora: r.and_then(Reading::lora_for_snapshot),
            prefix_cache_hit_rate: self.prefix_hit_rate,
            block_size: r.and_then(|r| r.block_size),
            num_blocks: r.and_then(|r| r.num_blocks),
            capacity,
            ramp_weight,
        }
    }
}

/// Counter delta with reset handling: a counter that went down restarted from zero.
fn delta(prev: Option<f64>, now: Option<f64>) -> Option<f64> {
    match (prev, now) {
        (Some(p), Some(n)) if n.is_finite() && p.is_finite() => {
            Some(if n >= p { n - p } else { n })
        }
        _ => None,
    }
}

/// Capacities of a pool's pods, in order: the configured value where set; else, when
/// estimation is on, `median ITL of the pool / ITL of the pod`, clamped to
/// [[`CAPACITY_MIN`], [`CAPACITY_MAX`]] (a pod twice as fast per token as the median gets 2);
/// 1.0 for pods without data.
///
/// Known bias: ITL grows with batch size, so a fast pod that the router loads harder looks
/// slower than it is; the estimate understates real spreads, never inverts them under equal
/// load. Configure `capacity` per pod where the hardware is known.
pub fn pool_capacities<'a>(
    pods: impl Iterator<Item = &'a PodState> + Clone,
    estimate: bool,
) -> Vec<f64> {
    let median = if estimate {
        let mut itls: Vec<f64> = pods
            .clone()
            .filter_map(|p| p.itl_estimate)
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        itls.sort_by(f64::total_cmp);
        match itls.len() {
            0 => None,
            n if n % 2 == 1 => Some(itls[n / 2]),
            n => Some((itls[n / 2 - 1] + itls[n / 2]) / 2.0),
        }
    } else {
        None
    };
    pods.map(|p| {
        if let Some(c) = p.target.capacity {
            return c;
        }
        match (median, p.itl_estimate) {
            (Some(m), Some(itl)) if itl > 0.0 && itl.is_finite() => {
                (m / itl).clamp(CAPACITY_MIN, CAPACITY_MAX)
            }
            _ => 1.0,
        }
    })
    .collect()
}

/// A pool's snapshot entries from its pods' states (after [`PodState::evaluate`], which gave
/// `weights`, in the same order), and the capacity published for each, to keep as its
/// `published_capacity`.
pub fn pool_snapshot(
    states: &[&PodState],
    weights: &[f64],
    estimate: bool,
) -> (Vec<PodSnapshot>, Vec<f64>) {
    let caps: Vec<f64> = pool_capacities(states.iter().copied(), estimate)
        .into_iter()
        .zip(states)
        .map(|(c, p)| stable_capacity(p.published_capacity, c))
        .collect();
    let pods = states
        .iter()
        .zip(weights)
        .zip(&caps)
        .map(|((p, w), c)| p.snapshot(*w, *c))
        .collect();
    (pods, caps)
}

/// The capacity to publish: the previous one while `estimate` stays within
/// [`CAPACITY_DEADBAND`] of it, else `estimate`.
pub fn stable_capacity(previous: Option<f64>, estimate: f64) -> f64 {
    match previous {
        Some(p) if p > 0.0 && (estimate / p).ln().abs() <= (1.0 + CAPACITY_DEADBAND).ln() => p,
        _ => estimate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> Target {
        Target {
            address: "127.0.0.1:8000".parse().unwrap(),
            metrics_url: "http://127.0.0.1:8000/metrics".into(),
            engine: None,
            capacity: None,
            ready: true,
            name: None,
        }
    }

    fn reading() -> Reading {
        Reading {
            engine: Engine::Vllm,
            waiting: Some(1.0),
            running: Some(2.0),
            ..Reading::default()
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[tokio::test(start_paused = true)]
    async fn a_dead_pod_leaves_after_three_failures_and_a_hung_one_after_max_age() {
        let (h, r, cap) = (
            HealthConfig::default(),
            RampConfig::default(),
            CapacityConfig::default(),
        );
        let t0 = Instant::now();
        let mut dead = PodState::new(target());
        assert_eq!(
            dead.evaluate(t0, t0, &h, &r),
            0.0,
            "never scraped: unhealthy"
        );
        dead.on_success(reading(), t0, 1, &cap);
        assert_eq!(
            dead.evaluate(t0, t0, &h, &r),
            1.0,
            "healthy at start-up: no ramp"
        );
        // Connection refused every 100 ms.
        for i in 1..=3 {
            dead.on_failure("connect", "refused".into());
            dead.evaluate(t0 + ms(100 * i), t0, &h, &r);
            assert_eq!(dead.healthy, i < 3, "after {i} failures");
        }

        // A hung pod: its scrapes time out, so failures come slowly; age decides.
        let mut hung = PodState::new(target());
        hung.on_success(reading(), t0, 1, &cap);
        hung.evaluate(t0, t0, &h, &r);
        hung.on_failure("timeout", "timeout".into());
        hung.evaluate(t0 + ms(1000), t0, &h, &r);
        assert!(hung.healthy, "data exactly max_data_age old is still fresh");
        hung.evaluate(t0 + ms(1001), t0, &h, &r);
        assert!(!hung.healthy, "older than max_data_age: out");
    }

    #[tokio::test(start_paused = true)]
    async fn a_returning_pod_ramps_linearly() {
        let (h, r, cap) = (
            HealthConfig::default(),
            RampConfig::default(),
            CapacityConfig::default(),
        );
        let t0 = Instant::now();
        let mut p = PodState::new(target());
        p.on_success(reading(), t0, 1, &cap);
        p.evaluate(t0, t0, &h, &r);
        for _ in 0..3 {
            p.on_failure("connect", "x".into());
        }
        let down = t0 + ms(60_000);
        assert_eq!(p.evaluate(down, t0, &h, &r), 0.0);
        let back = down + ms(100);
        p.on_success(reading(), back, 2, &cap);
        let w0 = p.evaluate(back, t0, &h, &r);
        assert!((w0 - 0.1).abs() < 1e-9, "{w0}");
        p.on_success(reading(), back + ms(15_000), 3, &cap);
        let mid = p.evaluate(back + ms(15_000), t0, &h, &r);
        assert!((mid - 0.55).abs() < 1e-9, "{mid}");
        p.on_success(reading(), back + ms(30_000), 4, &cap);
        assert_eq!(p.evaluate(back + ms(30_000), t0, &h, &r), 1.0);
        assert_eq!(p.evaluate(back + ms(30_100), t0, &h, &r), 1.0, "stays at 1");
    }

    #[tokio::test(start_paused = true)]
    async fn new_pods_ramp_only_after_the_startup_grace_and_window_zero_disables() {
        let (h, cap) = (HealthConfig::default(), CapacityConfig::default());
        let r = RampConfig::default();
        let t0 = Instant::now();
        let late = t0 + ms(r.startup_grace_ms + 1);
        let mut p = PodState::new(target());
        p.on_success(reading(), late, 1, &cap);
        assert!((p.evaluate(late, t0, &h, &r) - r.start_weight).abs() < 1e-9);
        let off = RampConfig {
            window_ms: 0,
            ..RampConfig::default()
        };
        let mut q = PodState::new(target());
        q.on_success(reading(), late, 1, &cap);
        assert_eq!(q.evaluate(late, t0, &h, &off), 1.0);
    }

    #[tokio::test(start_paused = true)]
    async fn not_ready_pods_are_never_healthy() {
        let (h, r, cap) = (
            HealthConfig::default(),
            RampConfig::default(),
            CapacityConfig::default(),
        );
        let t0 = Instant::now();
        let mut p = PodState::new(Target {
            ready: false,
            ..target()
        });
        p.on_success(reading(), t0, 1, &cap);
        assert_eq!(p.evaluate(t0, t0, &h, &r), 0.0);
        assert!(!p.healthy);
    }

    #[tokio::test(start_paused = true)]
    async fn prefix_hit_rate_from_deltas_with_resets() {
        let cap = CapacityConfig::default();
        let t0 = Instant::now();
        let mut p = PodState::new(target());
        let at = |hits: f64, queries: f64| Reading {
            prefix_hits: Some(hits),
            prefix_queries: Some(queries),
            ..reading()
        };
        p.on_success(at(100.0, 1000.0), t0, 1, &cap);
        assert_eq!(p.prefix_hit_rate, None, "no previous scrape");
        p.on_success(at(175.0, 1100.0), t0 + ms(100), 2, &cap);
        assert_eq!(p.prefix_hit_rate, Some(0.75));
        p.on_success(at(175.0, 1100.0), t0 + ms(200), 3, &cap);
        assert_eq!(p.prefix_hit_rate, None, "no queries in the interval");
        // Server restarted: counters start again from 0.
        p.on_success(at(10.0, 40.0), t0 + ms(300), 4, &cap);
        assert_eq!(p.prefix_hit_rate, Some(0.25));
        // SGLang reports the rate directly.
        p.on_success(
            Reading {
                prefix_hit_rate: Some(0.5),
                ..reading()
            },
            t0 + ms(400),
            5,
            &cap,
        );
        assert_eq!(p.prefix_hit_rate, Some(0.5));
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_from_inter_token_latency_relative_to_the_pool_median() {
        let cap = CapacityConfig::default();
        let t0 = Instant::now();
        let itl = |sum: f64, count: f64| Reading {
            itl_sum: Some(sum),
            itl_count: Some(count),
            ..reading()
        };
        // Three pods: 10 ms, 20 ms and 30 ms per token; one pod idle; one configured.
        let mut pods: Vec<PodState> = (0..5).map(|_| PodState::new(target())).collect();
        for (p, per_token) in pods.iter_mut().zip([0.010, 0.020, 0.030]) {
            p.on_success(itl(0.0, 0.0), t0, 1, &cap);
            p.on_success(itl(per_token * 100.0, 100.0), t0 + ms(100), 2, &cap);
        }
        pods[3].on_success(itl(0.0, 0.0), t0, 1, &cap);
        pods[3].on_success(itl(0.05, 5.0), t0 + ms(100), 2, &cap); // below min_tokens
        pods[4].target.capacity = Some(4.0);
        let c = pool_capacities(pods.iter(), true);
        assert!((c[0] - 2.0).abs() < 1e-9, "{c:?}");
        assert!((c[1] - 1.0).abs() < 1e-9, "{c:?}");
        assert!((c[2] - 2.0 / 3.0).abs() < 1e-9, "{c:?}");
        assert_eq!(c[3], 1.0, "no usable data");
        assert_eq!(c[4], 4.0, "configured wins");
        assert_eq!(
            pool_capacities(pods.iter(), false),
            vec![1.0, 1.0, 1.0, 1.0, 4.0]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn itl_estimate_skips_slow_intervals_and_follows_a_real_change() {
        let cap = CapacityConfig::default(); // window 10 s
        let t0 = Instant::now();
        let mut p = PodState::new(target());
        let itl = |sum: f64, count: f64| Reading {
            itl_sum: Some(sum),
            itl_count: Some(count),
            ..reading()
        };
        let (mut sum, mut count) = (0.0, 0.0);
        p.on_success(itl(sum, count), t0, 1, &cap);
        // 10 s of 100 ms intervals: decode steps of 10 ms, every third interval slowed to
        // 60 ms by a prefill chunk. The mean says 26.7 ms; the decode step is 10 ms.
        for i in 1..=100u64 {
            let per_token = if i % 3 == 0 { 0.06 } else { 0.01 };
            sum += per_token * 100.0;
            count += 100.0;
            p.on_success(itl(sum, count), t0 + ms(100 * i), 1 + i, &cap);
        }
        assert_eq!(p.itl_estimate, Some(0.01));
        // Too few tokens in an interval: not a sample.
        p.on_success(itl(sum + 1.0, count + 5.0), t0 + ms(10_100), 200, &cap);
        assert_eq!(p.itl_estimate, Some(0.01));
        (sum, count) = (sum + 1.0, count + 5.0);
        // The pod becomes 3x slower for good: once the window has turned over, so has the
        // estimate; halfway through it has not.
        for i in 1..=100u64 {
            sum += 0.03 * 100.0;
            count += 100.0;
            p.on_success(itl(sum, count), t0 + ms(10_100 + 100 * i), 300 + i, &cap);
            if i == 50 {
                assert_eq!(p.itl_estimate, Some(0.01));
            }
        }
        assert_eq!(p.itl_estimate, Some(0.03));
        // No tokens for a while: the estimate holds.
        p.on_success(itl(sum, count), t0 + ms(60_000), 500, &cap);
        assert_eq!(p.itl_estimate, Some(0.03));
    }

    #[test]
    fn published_capacity_ignores_wander_and_follows_real_changes() {
        let mut published = None;
        let mut seen = Vec::new();
        // An H100 wandering around 2.3, then throttled to half.
        for e in [2.3, 2.0, 2.7, 1.9, 2.8, 3.0, 2.5, 1.2, 1.1, 1.3] {
            let c = stable_capacity(published, e);
            published = Some(c);
            seen.push(c);
        }
        assert_eq!(seen, [2.3, 2.3, 2.3, 2.3, 2.3, 3.0, 3.0, 1.2, 1.2, 1.2]);
        assert_eq!(stable_capacity(Some(0.0), 1.0), 1.0);
    }

    #[test]
    fn snapshot_entries_are_valid_for_the_filter() {
        let mut p = PodState::new(target());
        p.reading = Some(Reading {
            waiting: Some(3.6),
            running: Some(-1.0),
            kv_cache_usage: Some(0.5),
            ..reading()
        });
        p.healthy = true;
        let s = p.snapshot(0.5, 2.0);
        assert_eq!((s.waiting, s.running), (4, 0));
        assert_eq!(s.engine, Engine::Vllm);
        assert_eq!(s.address, "127.0.0.1:8000");
        assert_eq!((s.capacity, s.ramp_weight), (2.0, 0.5));
    }
}
