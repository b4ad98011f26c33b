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
use crate::idmap::IdMap;

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
