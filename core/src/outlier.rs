//! Passive health (`outlier_detection`): a pod that answers server errors in a row leaves the
//! picks for a while.
//!
//! A pod whose engine fails every request (a GPU in a bad state, a broken rollout) while its
//! `/metrics` still answer looks idle in the snapshot: each request fails within milliseconds,
//! so its queue stays empty and it keeps winning picks, a black hole for its share of the pool
//! (an end-to-end run, three pods and one answering 500: 55 of 160 requests failed, and would
//! for as long as the pod did). Envoy's own outlier detection ejects such a host, but its
//! `override_host` load balancer sends a request to the host the filter names whether Envoy
//! ejected it or not (Envoy 1.40, verified: the host flagged `failed_outlier_check` kept its
//! third). So the filter keeps its own, per filter instance (in the proxy-wasm build each worker
//! counts the answers it routed and shares the pods it ejects through an [`EjectionBoard`]; the
//! dynamic module counts all of a configuration's), with Envoy's semantics and defaults:
//!
//! - `consecutive_5xx` answers in a row with status 500, 502, 503 or 504 from a pod eject it;
//!   any other answer from it ends the run (a 4xx is the client's doing; 501 and 505 say what
//!   the server does not do, not that it is broken).
//! - The n-th ejection in a row lasts n x `base_ejection_ms`, at most `max_ejection_ms`; a pod
//!   that answers a success once back starts again from the first.
//! - At most `max_ejection_percent` of a pool's pods (at least one) are out at once: a fault
//!   that fails every pod leaves half the pool serving, and the clients their errors.
//! - An ejected pod is a candidate again only when no other pod of its pool is one
//!   ([`crate::picker::Picker::pick`]), rather than failing the request open.

use crate::config::OutlierConfig;
use crate::fleet::FleetState;
use crate::idmap::IdMap;
use std::sync::Arc;

/// The most pods tracked at once: a record is kept only for a pod in a run of errors or
/// ejected, and a fleet of 10,000 pods all failing fits.
pub const MAX_TRACKED: usize = 16_384;

/// A pool's key for [`Outliers::server_error`].
pub fn pool_key(pool: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(pool.as_bytes())
}

/// Whether an answer's `:status` counts toward ejecting the pod that gave it.
pub fn is_server_error(status: &[u8]) -> bool {
    matches!(status, b"500" | b"502" | b"503" | b"504")
}

#[derive(Debug, Clone, Copy, Default)]
struct Record {
    /// Server errors in a row since the last other answer (or the end of the last ejection).
    errors: u32,
    /// Ejections in a row (without a success in between).
    times: u32,
    /// Out of the picks until then (unix ms); 0: not ejected yet.
    until_ms: u64,
    /// [`pool_key`] of the pool the pod served in when it last failed.
    pool: u64,
}

/// An ejection: the pod is out for `for_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ejection {
    pub for_ms: u64,
    /// How many times in a row the pod was ejected (this one included).
    pub times: u32,
}

impl Ejection {
    /// The warning both builds log: `pod` (its address, or how it is known), its `pool`, the
    /// run of `errors` that ejected it and the last `status`.
    pub fn message(&self, pod: &str, pool: &str, errors: u32, status: &[u8]) -> String {
        format!(
            "gpuroute: pod {pod} of pool {pool} ejected for {} ms after {errors} server errors in a row (status {}; ejection {} in a row)",
            self.for_ms,
            String::from_utf8_lossy(status),
            self.times,
        )
    }

    /// The warning for an ejection whose run ended with a request to `pod` unanswered after
    /// `waited_ms` ([`Unanswered`]).
    pub fn unanswered_message(&self, pod: &str, pool: &str, errors: u32, waited_ms: u64) -> String {
        format!(
            "gpuroute: pod {pod} of pool {pool} ejected for {} ms after {errors} failed requests in a row (the last unanswered after {waited_ms} ms, more than the pod's metrics counted; ejection {} in a row)",
            self.for_ms, self.times,
        )
    }
}

/// A request sent to a pod and not answered yet: what finds a pod that takes requests and
/// never answers them while its `/metrics` read idle (an API server whose engine is gone, a
/// process wedged behind its metrics endpoint). Such a pod wins picks by looking idle, and its
/// clients wait until they give up; server errors never come to eject it.
///
/// The evidence is the pod's own count: a scrape taken `unanswered_ms` or more after the
/// request was sent that reads fewer requests waiting and running than this gateway has had
/// unanswered there since before then says the engine does not hold them all, yet no answer
/// came. With one such request: a pod reading idle; with more, also a pod whose counts froze
/// when its engine hung, once more requests wait on it than it last counted. Two such scrapes
/// are asked for, so that an answer still on its way when the first was taken (the engine
/// finished the request just before) has arrived by the second. A scrape that accounts for them
/// starts the count again.
///
/// A buffered answer's headers come with its end; a streamed one's come at once from most
/// servers (vLLM's among them), before the engine has the request, so a stream is answered by
/// its first chunk.
#[derive(Debug, Clone, PartialEq)]
pub struct Unanswered {
    pub pod: u64,
    pub pool: Arc<str>,
    /// When the request was sent (Envoy's clock, ms).
    pub sent_ms: u64,
    /// The scrape (Envoy's clock, ms) that first counted too few requests on the pod past the
    /// grace; 0: none.
    idle_at_ms: u64,
    /// That scrape's own time (`last_scrape_ms`, the aggregator's clock): the same scrape
    /// published again in a later snapshot is not a second one, however its arrival puts it on
    /// Envoy's clock.
    idle_scrape_ms: u64,
    /// Judged [`Verdict::Lost`]: in its pod's run already, where the server error that may end
    /// it (Envoy's 504 at a route timeout) is not to count it again ([`Unanswered::is_lost`]).
    lost: bool,
}

/// Judges `requests` against their pods' latest readings in `fleet` (`grace_ms`:
/// `unanswered_ms`), at `now_ms`; the verdicts in their order. A pod whose reading counts `c`
/// requests while `n` of these are unanswered there since `grace_ms` before it has `n - c` too
/// many: its `n - c` oldest are the ones judged ([`Unanswered::judge`]'s rule, two readings),
/// not all `n`. One request the engine does not count yet (a media fetch past the grace) then
/// puts one request of a busy pod in question, not every long one it runs. Each pool's pods are
/// indexed once, so the cost is the requests plus their pools' pods, not their product (an
/// audit: 6 ms for 10,000 requests on 1,000 pods, 40 ms at 65,536, with a scan per request).
pub fn judge_all(
    requests: &mut [&mut Unanswered],
    fleet: &FleetState,
    grace_ms: u64,
    now_ms: u64,
) -> Vec<Verdict> {
    // Each request's pod's reading, by (pool, pod): pools indexed as they come up.
    let mut pools: crate::idmap::NameMap<&str, IdMap<u64, usize>> = Default::default();
    let mut readings: Vec<Result<Reading, Verdict>> = Vec::with_capacity(requests.len());
    for r in requests.iter() {
        let reading = match fleet.pool(&r.pool) {
            None => Err(Verdict::Gone),
            Some(pool) => {
                let index = pools.entry(&r.pool).or_insert_with(|| {
                    pool.pods
                        .iter()
                        .enumerate()
                        .map(|(i, p)| (p.key, i))
                        .collect()
                });
                match index.get(&r.pod).and_then(|i| pool.pods.get(*i)) {
                    None => Err(Verdict::Gone),
                    Some(pod) => Reading::of(pod, fleet.received_at_ms),
                }
            }
        };
        readings.push(reading.and_then(|rd| rd.past(r.sent_ms, grace_ms)));
    }
    // Per pod: requests to account for, and its count.
    let mut excess: IdMap<u64, (u64, u64)> = IdMap::default();
    for (r, rd) in requests.iter().zip(&readings) {
        if let (Ok(rd), false) = (rd, r.lost) {
            excess.entry(r.pod).or_insert((0, rd.counted)).0 += 1;
        }
    }
    // The oldest first take the excess.
    let mut order: Vec<usize> = (0..requests.len()).collect();
    order.sort_by_key(|&i| requests.get(i).map_or(0, |r| r.sent_ms));
    let mut verdicts = vec![Verdict::Wait; requests.len()];
    for i in order {
        let (Some(r), Some(rd)) = (requests.get_mut(i), readings.get(i)) else {
            continue;
        };
        let verdict = match rd {
            // Counted once, and not among those to account for.
            _ if r.lost => Verdict::Wait,
            Err(v) => *v,
            Ok(rd) => {
                let over = excess.get_mut(&r.pod).is_some_and(|(n, counted)| {
                    let over = *n > *counted;
                    *n = n.saturating_sub(1);
                    over
                });
                r.judge_reading(rd, over, now_ms)
            }
        };
        if let Some(v) = verdicts.get_mut(i) {
            *v = verdict;
        }
    }
    verdicts
}

/// A pod's latest reading, as [`Unanswered`] judges by it.
#[derive(Debug, Clone, Copy)]
struct Reading {
    /// When it was taken, on Envoy's clock (ms).
    scraped_ms: u64,
    /// Requests waiting and running.
    counted: u64,
    /// Its own time (`last_scrape_ms`, the aggregator's clock): what tells one scrape from
    /// another, since the Envoy-clock time of a scrape published again moves with its
    /// snapshot's arrival.
    scrape: u64,
}

impl Reading {
    /// `pod`'s reading in a snapshot received at `received_at_ms`. `Err` with the verdict for a
    /// pod not to judge by: [`Verdict::Gone`] when its engine does not report what it runs,
    /// [`Verdict::Wait`] when it is unhealthy (the aggregator's rules take such a pod out).
    fn of(pod: &crate::fleet::PodState, received_at_ms: u64) -> Result<Reading, Verdict> {
        if !pod.snap.engine.reports_running() {
            return Err(Verdict::Gone);
        }
        if !pod.snap.healthy {
            return Err(Verdict::Wait);
        }
        Ok(Reading {
            scraped_ms: received_at_ms.saturating_sub(pod.age_at_generation_ms),
            counted: u64::from(pod.snap.waiting) + u64::from(pod.snap.running),
            scrape: pod.snap.last_scrape_ms,
        })
    }

    /// The reading if taken `grace_ms` or more after a request sent at `sent_ms`, else
    /// [`Verdict::Wait`]: the engine may not have the request yet.
    fn past(self, sent_ms: u64, grace_ms: u64) -> Result<Reading, Verdict> {
        if self.scraped_ms < sent_ms.saturating_add(grace_ms) {
            return Err(Verdict::Wait);
        }
        Ok(self)
    }
}

/// What [`Unanswered::judge`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not known yet: within the grace, the pod busy or not scraped since.
    Wait,
    /// The pod holds the request without serving it: it waited `waited_ms` so far.
    Lost { waited_ms: u64 },
    /// Never to be judged: the pod left the pool, or its engine does not report what it runs.
    Gone,
}

impl Unanswered {
    pub fn new(pod: u64, pool: Arc<str>, sent_ms: u64) -> Unanswered {
        Unanswered {
            pod,
            pool,
            sent_ms,
            idle_at_ms: 0,
            idle_scrape_ms: 0,
            lost: false,
        }
    }

    /// The pod's latest reading in `fleet` if it is one to judge this request by
    /// ([`Reading::of`], [`Reading::past`]).
    fn reading(&self, fleet: &FleetState, grace_ms: u64) -> Result<Reading, Verdict> {
        let Some(pod) = fleet
            .pool(&self.pool)
            .and_then(|p| p.pods.iter().find(|p| p.key == self.pod))
        else {
            return Err(Verdict::Gone);
        };
        Reading::of(pod, fleet.received_at_ms)?.past(self.sent_ms, grace_ms)
    }

    /// Whether the request was judged [`Verdict::Lost`]: it counted in its pod's run, and a
    /// server error that ends it is not to count it again.
    pub fn is_lost(&self) -> bool {
        self.lost
    }

    /// Judges the request against the pod's latest reading in `fleet` at `now_ms`,
    /// `unanswered` being how many requests this gateway has had unanswered on the pod since
    /// `grace_ms` before that reading, this one included (at least 1): the request alone, as at
    /// its end ([`judge_all`] judges a worker's requests together).
    pub fn judge(
        &mut self,
        fleet: &FleetState,
        grace_ms: u64,
        unanswered: u64,
        now_ms: u64,
    ) -> Verdict {
        match self.reading(fleet, grace_ms) {
            Ok(rd) => self.judge_reading(&rd, rd.counted < unanswered.max(1), now_ms),
            Err(v) => v,
        }
    }

    /// One step of the rule by a reading past the grace: `over` when the pod counts fewer
    /// requests than it is to account for, this one among them.
    fn judge_reading(&mut self, rd: &Reading, over: bool, now_ms: u64) -> Verdict {
        if self.lost {
            // Counted once.
            return Verdict::Wait;
        }
        if !over {
            self.idle_at_ms = 0;
            return Verdict::Wait;
        }
        if self.idle_at_ms == 0 {
            self.idle_at_ms = rd.scraped_ms.max(1);
            self.idle_scrape_ms = rd.scrape;
            return Verdict::Wait;
        }
        if rd.scraped_ms > self.idle_at_ms && rd.scrape != self.idle_scrape_ms {
            self.lost = true;
            return Verdict::Lost {
                waited_ms: now_ms.saturating_sub(self.sent_ms),
            };
        }
        Verdict::Wait
    }
}

/// The ejections every proxy-wasm worker of one Envoy publishes and reads (a shared-data value):
/// a worker that ejects a pod puts it here, and the others take it out of their picks too at
/// their next tick, instead of each finding it out with its own failed requests (with 8 workers,
/// ~8 x 13 of them a round). Pod keys and the time each is out until.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EjectionBoard {
    pub entries: Vec<(u64, u64)>,
}

const BOARD_MAGIC: &[u8; 4] = b"GPE1";

impl EjectionBoard {
    /// A malformed or empty value is an empty board.
    pub fn decode(bytes: &[u8]) -> EjectionBoard {
        let Some(rest) = bytes.strip_prefix(BOARD_MAGIC.as_slice()) else {
            return EjectionBoard::default();
        };
        if rest.len() % 16 != 0 {
            return EjectionBoard::default();
        }
        let word = |b: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        };
        EjectionBoard {
            entries: rest
                .chunks_exact(16)
                .map(|e| (word(&e[..8]), word(&e[8..])))
                .collect(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 16 * self.entries.len());
        out.extend_from_slice(BOARD_MAGIC);
        for (pod, until) in &self.entries {
            out.extend_from_slice(&pod.to_le_bytes());
            out.extend_from_slice(&until.to_le_bytes());
        }
        out
    }

    /// `pod` out until `until_ms`; entries over at `now_ms` are dropped, and past
    /// [`MAX_TRACKED`] the ones ending soonest.
    pub fn put(&mut self, pod: u64, until_ms: u64, now_ms: u64) {
        self.entries
            .retain(|&(p, until)| p != pod && until > now_ms);
        if until_ms > now_ms {
            self.entries.push((pod, until_ms));
        }
        if self.entries.len() > MAX_TRACKED {
            self.entries
                .sort_unstable_by_key(|&(_, until)| std::cmp::Reverse(until));
            self.entries.truncate(MAX_TRACKED);
        }
    }
}

/// The answers' record of one filter instance.
#[derive(Debug, Clone, Default)]
pub struct Outliers {
    config: OutlierConfig,
    pods: IdMap<u64, Record>,
    /// The ejected pods' keys, as of `checked_ms`; valid until `next_change_ms`.
    ejected: Vec<u64>,
    next_change_ms: u64,
}

impl Outliers {
    pub fn new(config: OutlierConfig) -> Outliers {
        Outliers {
            config,
            ..Default::default()
        }
    }

    /// Whether any answer can eject a pod.
    pub fn enabled(&self) -> bool {
        self.config.consecutive_5xx > 0
    }

    /// Whether requests are watched for answers that never come ([`Unanswered`]): passive
    /// health on and `unanswered_ms` > 0.
    pub fn watches_unanswered(&self) -> bool {
        self.enabled() && self.config.unanswered_ms > 0
    }

    /// `unanswered_ms`.
    pub fn unanswered_ms(&self) -> u64 {
        self.config.unanswered_ms
    }

    /// Whether some pod has a run of errors or an ejection on record: only then does a
    /// success need to be told, and its pod known.
    pub fn tracking(&self) -> bool {
        !self.pods.is_empty()
    }

    /// A success (any answer but a server error) from `pod`: its run of errors ends, and once
    /// its ejection is over, its record.
    pub fn success(&mut self, pod: u64, now_ms: u64) {
        if let Some(r) = self.pods.get_mut(&pod) {
            r.errors = 0;
            // A success of a request sent before the ejection says little about the pod now.
            if r.until_ms <= now_ms {
                self.pods.remove(&pod);
            }
        }
    }

    /// A server error from `pod` of pool `pool` ([`pool_key`]), which has `pool_pods` pods in
    /// the snapshot. Returns the ejection it caused, if it did.
    pub fn server_error(
        &mut self,
        pod: u64,
        pool: u64,
        pool_pods: usize,
        now_ms: u64,
    ) -> Option<Ejection> {
        let threshold = self.config.consecutive_5xx;
        if threshold == 0 || (self.pods.len() >= MAX_TRACKED && !self.pods.contains_key(&pod)) {
            return None;
        }
        let r = self.pods.entry(pod).or_default();
        r.pool = pool;
        if r.until_ms > now_ms {
            // A request sent before the ejection, failing late: already out.
            return None;
        }
        r.errors = r.errors.saturating_add(1);
        if r.errors < threshold {
            return None;
        }
        // The pool's pods out now (this one is not): counted only for a run that would eject.
        let most = (pool_pods * self.config.max_ejection_percent as usize / 100).max(1);
        if self.ejected_in(pool, now_ms) >= most {
            // Ejected once another pod of the pool is back, if it still fails then.
            return None;
        }
        let r = self.pods.get_mut(&pod)?;
        r.times = r.times.saturating_add(1);
        let for_ms = self
            .config
            .base_ejection_ms
            .saturating_mul(u64::from(r.times))
            .min(self.config.max_ejection_ms);
        r.until_ms = now_ms.saturating_add(for_ms);
        r.errors = 0;
        let times = r.times;
        // The cached list is stale now.
        self.next_change_ms = 0;
        Some(Ejection { for_ms, times })
    }

    /// Another worker's ejections ([`EjectionBoard`]): each pod still out at `now_ms` is out
    /// here too, until the same time (not counted toward this worker's pool caps' decisions of
    /// its own, which the ejecting worker made).
    pub fn adopt(&mut self, board: &EjectionBoard, now_ms: u64) {
        if self.config.consecutive_5xx == 0 {
            return;
        }
        for &(pod, until) in &board.entries {
            if until <= now_ms || (self.pods.len() >= MAX_TRACKED && !self.pods.contains_key(&pod))
            {
                continue;
            }
            let r = self.pods.entry(pod).or_default();
            if until > r.until_ms {
                r.until_ms = until;
                r.errors = 0;
                self.next_change_ms = 0;
            }
        }
    }

    /// Pods of pool `pool` out at `now_ms`.
    fn ejected_in(&self, pool: u64, now_ms: u64) -> usize {
        self.pods
            .values()
            .filter(|r| r.pool == pool && r.until_ms > now_ms)
            .count()
    }

    /// Brings [`Outliers::ejected`] up to `now_ms` (no work while no pod is on record, or
    /// until the next ejection ends).
    pub fn refresh(&mut self, now_ms: u64) {
        if now_ms >= self.next_change_ms && !(self.pods.is_empty() && self.ejected.is_empty()) {
            self.ejected.clear();
            let mut next = u64::MAX;
            for (key, r) in &self.pods {
                if r.until_ms > now_ms {
                    self.ejected.push(*key);
                    next = next.min(r.until_ms);
                }
            }
            self.next_change_ms = next;
        }
    }

    /// The keys of the pods out of the picks as of the last [`Outliers::refresh`].
    pub fn ejected(&self) -> &[u64] {
        &self.ejected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Outliers {
        /// [`Outliers::refresh`], then [`Outliers::ejected`].
        fn ejected_at(&mut self, now_ms: u64) -> &[u64] {
            self.refresh(now_ms);
            &self.ejected
        }
    }

    fn outliers() -> Outliers {
        Outliers::new(OutlierConfig::default())
    }

    /// A pool `p` of one vLLM pod `10.0.0.1:8000` scraped at `scraped_ms` (Envoy's clock)
    /// reading `waiting` and `running`, in a snapshot received at `received_ms`.
    fn reading(scraped_ms: u64, received_ms: u64, waiting: u32, running: u32) -> FleetState {
        use crate::snapshot::{Engine, PodSnapshot, Snapshot};
        let mut pod = PodSnapshot::new("10.0.0.1:8000", 1_000);
        pod.engine = Engine::Vllm;
        (pod.waiting, pod.running) = (waiting, running);
        // The aggregator's clock 100,000 ahead of Envoy's, the snapshot generated as it
        // arrives: the pod's data is `received_ms - scraped_ms` old then, and each scrape has a
        // time of its own on the aggregator's clock.
        pod.last_scrape_ms = 100_000 + scraped_ms;
        let mut s = Snapshot::of_pool("p", vec![pod]);
        s.generated_at_ms = 100_000 + received_ms;
        FleetState::new(s, received_ms)
    }

    impl Unanswered {
        /// [`Unanswered::judge`] of a request alone on its pod.
        fn judge1(&mut self, fleet: &FleetState, grace_ms: u64, now_ms: u64) -> Verdict {
            self.judge(fleet, grace_ms, 1, now_ms)
        }
    }

    fn request(sent_ms: u64) -> Unanswered {
        let key = crate::prefix::pod_key("10.0.0.1:8000");
        Unanswered::new(key, Arc::from("p"), sent_ms)
    }

    #[test]
    fn a_request_is_lost_when_two_scrapes_past_the_grace_read_its_pod_idle() {
        let mut r = request(10_000);
        // Within the grace (2,000 ms here): the engine may not have the request yet.
        assert_eq!(
            r.judge1(&reading(11_999, 12_050, 0, 0), 2_000, 12_050),
            Verdict::Wait
        );
        // The first idle scrape past it: an answer may be on its way.
        assert_eq!(
            r.judge1(&reading(12_000, 12_050, 0, 0), 2_000, 12_050),
            Verdict::Wait
        );
        // The same scrape again (a worker reading the snapshot twice) proves nothing more.
        assert_eq!(
            r.judge1(&reading(12_000, 12_050, 0, 0), 2_000, 12_080),
            Verdict::Wait
        );
        assert!(!r.is_lost());
        assert_eq!(
            r.judge1(&reading(12_100, 12_150, 0, 0), 2_000, 12_150),
            Verdict::Lost { waited_ms: 2_150 }
        );
        // Counted once: the request is lost, and later readings do not judge it again.
        assert!(r.is_lost());
        assert_eq!(
            r.judge1(&reading(12_200, 12_250, 0, 0), 2_000, 12_250),
            Verdict::Wait
        );
    }

    #[test]
    fn the_same_scrape_pushed_again_is_not_a_second_scrape() {
        // The aggregator publishes a pod's last scrape again when its next one has not come
        // (a scrape timed out, or answered after the round's deadline). On Envoy's clock the
        // scrape's time is the snapshot's arrival less its age, so a push delivered 2 ms later
        // than the one before puts the same scrape 2 ms later: it must not count as the second.
        use crate::snapshot::{Engine, PodSnapshot, Snapshot};
        let pushed = |last_scrape_ms: u64, generated_ms: u64, received_ms: u64| {
            let mut pod = PodSnapshot::new("10.0.0.1:8000", last_scrape_ms);
            pod.engine = Engine::Vllm;
            let mut s = Snapshot::of_pool("p", vec![pod]);
            s.generated_at_ms = generated_ms;
            FleetState::new(s, received_ms)
        };
        let mut r = request(10_000);
        // Scraped at 1,000 (the aggregator's clock), pushed at 1,010, here at 12,050: 12,040.
        assert_eq!(
            r.judge1(&pushed(1_000, 1_010, 12_050), 2_000, 12_050),
            Verdict::Wait
        );
        // The same scrape in the next push, 100 ms later, delivered 2 ms slower: 12,042.
        assert_eq!(
            r.judge1(&pushed(1_000, 1_110, 12_152), 2_000, 12_152),
            Verdict::Wait,
            "one scrape read twice"
        );
        // A new scrape: the second.
        assert_eq!(
            r.judge1(&pushed(1_100, 1_210, 12_250), 2_000, 12_250),
            Verdict::Lost { waited_ms: 2_250 }
        );
    }

    #[test]
    fn a_pod_reading_busy_in_between_starts_the_count_again() {
        let mut r = request(0);
        assert_eq!(
            r.judge1(&reading(3_000, 3_050, 0, 0), 2_000, 3_050),
            Verdict::Wait
        );
        for (waiting, running) in [(1, 0), (0, 1)] {
            assert_eq!(
                r.judge1(&reading(3_100, 3_150, waiting, running), 2_000, 3_150),
                Verdict::Wait
            );
            assert_eq!(
                r.judge1(&reading(3_200, 3_250, 0, 0), 2_000, 3_250),
                Verdict::Wait
            );
        }
        assert!(matches!(
            r.judge1(&reading(3_300, 3_350, 0, 0), 2_000, 3_350),
            Verdict::Lost { .. }
        ));
    }

    #[test]
    fn more_requests_unanswered_than_a_pod_counts_are_lost_too() {
        // A pod whose counts froze at 3 running when its engine hung: 3 requests unanswered
        // since before its scrape are what it counts; a 4th is more than it holds.
        let mut r = request(0);
        for at in [3_000, 3_100, 3_200] {
            assert_eq!(
                r.judge(&reading(at, at + 50, 0, 3), 2_000, 3, at + 50),
                Verdict::Wait
            );
        }
        assert_eq!(
            r.judge(&reading(3_300, 3_350, 1, 2), 2_000, 4, 3_350),
            Verdict::Wait
        );
        assert!(matches!(
            r.judge(&reading(3_400, 3_450, 1, 2), 2_000, 4, 3_450),
            Verdict::Lost { .. }
        ));
        // 0 counts as 1: the request itself is unanswered.
        let mut alone = request(0);
        assert_eq!(
            alone.judge(&reading(3_000, 3_050, 0, 0), 2_000, 0, 3_050),
            Verdict::Wait
        );
        assert!(matches!(
            alone.judge(&reading(3_100, 3_150, 0, 0), 2_000, 0, 3_150),
            Verdict::Lost { .. }
        ));
    }

    #[test]
    fn of_a_pods_requests_only_as_many_as_it_does_not_count_are_judged_the_oldest_first() {
        // A busy pod counting 3 while 4 requests are unanswered there past the grace (one
        // stuck before its engine, say): one is in question, the oldest, not all four.
        let mut rs: Vec<Unanswered> = [400, 100, 300, 200].map(request).to_vec();
        // One sent within the grace of the reading is not to be accounted for.
        rs.push(request(1_500));
        let mut judge = |scraped: u64, counted: u32| {
            let f = reading(scraped, scraped + 50, 0, counted);
            let mut refs: Vec<&mut Unanswered> = rs.iter_mut().collect();
            judge_all(&mut refs, &f, 2_000, scraped + 50)
        };
        assert_eq!(judge(3_000, 3), vec![Verdict::Wait; 5]);
        let v = judge(3_100, 3);
        assert!(matches!(v[1], Verdict::Lost { waited_ms: 3_050 }), "{v:?}");
        assert_eq!(
            v.iter().filter(|v| **v != Verdict::Wait).count(),
            1,
            "{v:?}"
        );
        // Counted once; a pod counting none of the others now: they go too, in two readings.
        assert_eq!(judge(3_200, 0), vec![Verdict::Wait; 5]);
        let v = judge(3_300, 0);
        let lost = |i: usize| matches!(v[i], Verdict::Lost { .. });
        assert!(
            lost(0) && lost(2) && lost(3) && !lost(1) && !lost(4),
            "{v:?}"
        );
        // Another pool's request, and a pod that left: gone.
        let mut gone = [request(0), Unanswered::new(7, Arc::from("p"), 0)];
        gone[0].pool = Arc::from("q");
        let mut refs: Vec<&mut Unanswered> = gone.iter_mut().collect();
        let f = reading(3_000, 3_050, 0, 0);
        assert_eq!(
            judge_all(&mut refs, &f, 2_000, 3_050),
            vec![Verdict::Gone; 2]
        );
    }

    #[test]
    fn no_verdict_without_a_pod_that_reports_what_it_runs() {
        use crate::snapshot::Engine;
        let mut r = request(0);
        let mut f = reading(5_000, 5_050, 0, 0);
        f.pools[0].pods[0].snap.healthy = false;
        assert_eq!(
            r.judge1(&f, 2_000, 5_050),
            Verdict::Wait,
            "unhealthy: no reading"
        );
        for engine in [Engine::Triton, Engine::Unknown] {
            let mut f = reading(5_000, 5_050, 0, 0);
            f.pools[0].pods[0].snap.engine = engine;
            assert_eq!(r.judge1(&f, 2_000, 5_050), Verdict::Gone, "{engine:?}");
        }
        let mut other = Unanswered::new(1, Arc::from("p"), 0);
        assert_eq!(
            other.judge1(&reading(5_000, 5_050, 0, 0), 2_000, 5_050),
            Verdict::Gone
        );
        let mut elsewhere = request(0);
        elsewhere.pool = Arc::from("q");
        assert_eq!(
            elsewhere.judge1(&reading(5_000, 5_050, 0, 0), 2_000, 5_050),
            Verdict::Gone
        );
    }

    #[test]
    fn lost_requests_eject_their_pod_as_server_errors_do_and_an_answer_ends_the_run() {
        use crate::config::FilterConfig;
        use crate::engine::Engine;
        let cfg = r#"{"pools":[{"name":"p","models":["m"]}]}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        assert!(e.outliers.watches_unanswered());
        assert_eq!(e.outliers.unanswered_ms(), 60_000);
        let f = reading(20_000, 20_050, 0, 0);
        let lost = request(0);
        for _ in 0..4 {
            assert_eq!(e.unanswered(&lost, Some(&f), 20_050), None);
        }
        e.answered("p", lost.pod, Some(b"200"), Some(&f), 20_050);
        for _ in 0..4 {
            assert_eq!(e.unanswered(&lost, Some(&f), 20_050), None);
        }
        let ejected = e.unanswered(&lost, Some(&f), 20_050);
        assert_eq!(
            ejected,
            Some(Ejection {
                for_ms: 10_000,
                times: 1
            })
        );
        let msg = ejected
            .unwrap()
            .unanswered_message("10.0.0.1:8000", "p", 5, 20_050);
        assert!(msg.contains("unanswered after 20050 ms"), "{msg}");
        let off =
            r#"{"pools":[{"name":"p","models":["m"]}],"outlier_detection":{"unanswered_ms":0}}"#;
        let e = Engine::new(FilterConfig::from_json(off.as_bytes()).unwrap());
        assert!(!e.outliers.watches_unanswered());
    }

    /// Server errors from `pod` of `pool` until it is ejected (at most 100): how many it took.
    fn errors_to_eject(
        o: &mut Outliers,
        pod: u64,
        pool: u64,
        pool_pods: usize,
        now: u64,
    ) -> Option<u32> {
        (1..=100).find(|_| o.server_error(pod, pool, pool_pods, now).is_some())
    }

    fn fail_until_ejected(o: &mut Outliers, pod: u64, pool_pods: usize, now: u64) -> u32 {
        errors_to_eject(o, pod, 0, pool_pods, now).expect("never ejected")
    }

    #[test]
    fn five_server_errors_in_a_row_eject_a_pod_and_any_other_answer_ends_the_run() {
        let mut o = outliers();
        for _ in 0..4 {
            assert_eq!(o.server_error(1, 0, 4, 1_000), None);
        }
        o.success(1, 1_000);
        assert!(
            !o.tracking(),
            "a success forgets a pod that was not ejected"
        );
        assert_eq!(fail_until_ejected(&mut o, 1, 4, 1_000), 5);
        assert_eq!(o.ejected_at(1_000), &[1]);
        assert_eq!(o.ejected_at(10_999), &[1]);
        assert!(
            o.ejected_at(11_000).is_empty(),
            "back after base_ejection_ms"
        );
        assert!(is_server_error(b"503") && is_server_error(b"500"));
        for other in [&b"200"[..], b"429", b"404", b"501", b"505", b"5000", b""] {
            assert!(!is_server_error(other), "{other:?}");
        }
    }

    #[test]
    fn each_ejection_in_a_row_lasts_longer_until_a_success() {
        let mut o = outliers();
        let mut now = 0;
        for (n, want) in [10_000, 20_000, 30_000].into_iter().enumerate() {
            assert_eq!(fail_until_ejected(&mut o, 7, 4, now), 5);
            let r = o.pods[&7];
            assert_eq!((r.until_ms - now, r.times), (want, n as u32 + 1));
            now = r.until_ms;
        }
        // Late errors of requests sent before the ejection do not extend it.
        let mut o2 = outliers();
        fail_until_ejected(&mut o2, 7, 4, 0);
        for _ in 0..20 {
            assert_eq!(o2.server_error(7, 0, 4, 5_000), None);
        }
        assert_eq!(o2.pods[&7].until_ms, 10_000);
        // A success while ejected keeps the ejection (and the count of them); once back, it
        // starts over.
        o.success(7, now - 1);
        assert_eq!(o.ejected_at(now - 1), &[7]);
        o.success(7, now);
        assert_eq!(fail_until_ejected(&mut o, 7, 4, now), 5);
        assert_eq!(o.pods[&7].until_ms - now, 10_000);
    }

    #[test]
    fn the_ejection_lasts_at_most_max_ejection_ms() {
        let mut o = Outliers::new(OutlierConfig {
            max_ejection_ms: 25_000,
            ..OutlierConfig::default()
        });
        let mut now = 0;
        let mut lengths = Vec::new();
        for _ in 0..4 {
            fail_until_ejected(&mut o, 3, 4, now);
            lengths.push(o.pods[&3].until_ms - now);
            now = o.pods[&3].until_ms;
        }
        assert_eq!(lengths, [10_000, 20_000, 25_000, 25_000]);
    }

    #[test]
    fn at_most_half_a_pool_is_out_and_at_least_one_pod() {
        let mut o = outliers();
        // Four pods, all failing: two are ejected, the others keep failing in the picks.
        let ejected: Vec<bool> = (1..=4)
            .map(|pod| (0..10).any(|_| o.server_error(pod, 0, 4, 0).is_some()))
            .collect();
        assert_eq!(ejected, [true, true, false, false]);
        let mut out = o.ejected_at(0).to_vec();
        out.sort_unstable();
        assert_eq!(out, [1, 2]);
        // Another pool's pods are counted apart.
        assert!(o.server_error(9, 1, 2, 0).is_none());
        assert_eq!(errors_to_eject(&mut o, 9, 1, 2, 0), Some(4));
        // Once the first two are back, the next failing pod goes out at its next error.
        assert!(o.server_error(3, 0, 4, 10_000).is_some());
        // A pool of one pod: that pod may go (the picker still takes it when it is the only
        // candidate).
        let mut one = outliers();
        assert_eq!(fail_until_ejected(&mut one, 5, 1, 0), 5);
        // Percent 0: still one pod.
        let mut zero = Outliers::new(OutlierConfig {
            max_ejection_percent: 0,
            ..OutlierConfig::default()
        });
        assert_eq!(fail_until_ejected(&mut zero, 5, 10, 0), 5);
        assert_eq!(errors_to_eject(&mut zero, 6, 0, 10, 0), None);
    }

    #[test]
    fn workers_share_their_ejections_through_the_board() {
        let mut a = outliers();
        let mut b = outliers();
        let mut board = EjectionBoard::default();
        assert_eq!(fail_until_ejected(&mut a, 7, 4, 1_000), 5);
        board.put(7, a.pods[&7].until_ms, 1_000);
        board.put(8, 900, 1_000);
        let board = EjectionBoard::decode(&board.encode());
        assert_eq!(
            board.entries,
            [(7, 11_000)],
            "an entry already over is left out"
        );
        b.adopt(&board, 2_000);
        assert_eq!(b.ejected_at(2_000), &[7]);
        assert!(b.ejected_at(11_000).is_empty());
        // A success from it once back forgets it, as for its own.
        b.success(7, 11_000);
        assert!(!b.tracking());
        // Garbage is an empty board.
        for bad in [&b""[..], b"GPE1\x01", b"XXXX"] {
            assert_eq!(EjectionBoard::decode(bad), EjectionBoard::default());
        }
        let mut off = Outliers::new(OutlierConfig {
            consecutive_5xx: 0,
            ..OutlierConfig::default()
        });
        off.adopt(&board, 2_000);
        assert!(off.ejected_at(2_000).is_empty());
    }

    #[test]
    fn off_with_zero_and_bounded_in_pods_tracked() {
        let mut off = Outliers::new(OutlierConfig {
            consecutive_5xx: 0,
            ..OutlierConfig::default()
        });
        assert!(!off.enabled());
        assert_eq!(errors_to_eject(&mut off, 1, 0, 4, 0), None);
        assert!(!off.tracking() && off.ejected_at(0).is_empty());

        let mut o = outliers();
        for pod in 0..(MAX_TRACKED as u64 + 100) {
            o.server_error(pod, 0, 100_000, 0);
        }
        assert_eq!(o.pods.len(), MAX_TRACKED);
        // A tracked pod still counts on.
        assert!((0..4).any(|_| o.server_error(0, 0, 100_000, 0).is_some()));
    }
}
