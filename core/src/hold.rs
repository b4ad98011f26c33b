//! The queue of requests held while their pool is saturated (`hold`): the order they go in.
//! Both shells keep one (the proxy-wasm filter per worker, the dynamic module per filter
//! configuration), each with its own handle to wake a held request.

use crate::config::{FilterConfig, HoldOrder};
use crate::fleet::stat_segment;

/// What befell a request `hold` held (or, `Full`, would have held): counted in
/// `gpuroute.hold.<pool>.<event>` ([`hold_stat`]) of the pool it was first held in, wherever a
/// later decision moves it (back home from a failover pool, `Engine::homeward`). Both shells.
/// Each held request leaves the queue once, as one of `Released`, `Expired`, `Answered` and
/// `Cancelled`: `held` is their sum and the requests held now (the `gpuroute.held.<pool>` gauge).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HoldEvent {
    Held,
    /// It waited for the saturated pod caching its prompt or adapter (once per request).
    Affinity,
    /// Sent before its wait ran out: a pod had room (or it failed open, its snapshot stale).
    Released,
    /// Sent to a saturated pod once its wait (`max_wait_ms`) ran out.
    Expired,
    /// Answered by the gateway itself when it decided again, sent to no pod: shed (a sheddable
    /// request held for its prompt's pod while the rest of its pool filled up), or with
    /// ORIGINAL_DST no pod to name (its pool gone from the snapshot). See [`HoldEvent::left`].
    Answered,
    /// Its client left, or its stream was reset, while it was held.
    Cancelled,
    /// Not held: the queue was full (`max_held`).
    Full,
}

impl HoldEvent {
    /// Every event, in the order of `as usize`.
    pub const ALL: [HoldEvent; 7] = [
        HoldEvent::Held,
        HoldEvent::Affinity,
        HoldEvent::Released,
        HoldEvent::Expired,
        HoldEvent::Answered,
        HoldEvent::Cancelled,
        HoldEvent::Full,
    ];

    /// How a held request that a decision took out of the queue left it: `answered` (the
    /// decision was the gateway's own answer, an error or a shed) before `expired` (its wait
    /// ran out): a request answered so was sent nowhere, whether or not its wait had run out.
    pub fn left(expired: bool, answered: bool) -> HoldEvent {
        match (answered, expired) {
            (true, _) => HoldEvent::Answered,
            (false, true) => HoldEvent::Expired,
            (false, false) => HoldEvent::Released,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HoldEvent::Held => "held",
            HoldEvent::Affinity => "affinity",
            HoldEvent::Released => "released",
            HoldEvent::Expired => "expired",
            HoldEvent::Answered => "answered",
            HoldEvent::Cancelled => "cancelled",
            HoldEvent::Full => "full",
        }
    }
}

/// The counter of `event` for `pool`: `gpuroute.hold.<pool>.<event>`. Envoy's tag extraction
/// (envoy/render.py) takes the pool into `gpuroute_pool`, leaving `gpuroute.hold.<event>`: the
/// Prometheus name the process-wide counter had.
pub fn hold_stat(pool: &str, event: HoldEvent) -> String {
    format!("gpuroute.hold.{}.{}", stat_segment(pool), event.name())
}

/// The gauge of the requests held in `pool` now: `gpuroute.held.<pool>` (`gpuroute.held` once
/// Envoy took the pool into `gpuroute_pool`).
pub fn held_stat(pool: &str) -> String {
    format!("gpuroute.held.{}", stat_segment(pool))
}

/// The histogram of how long requests held in `pool` waited, ms: `gpuroute.hold_ms.<pool>`
/// (`gpuroute.hold_ms` once Envoy took the pool into `gpuroute_pool`, the Prometheus name the
/// one histogram of every pool had). Its buckets are the shipped configurations'
/// (envoy/render.py's `HISTOGRAM_BUCKETS`, which match the name with and without the pool).
pub fn hold_ms_stat(pool: &str) -> String {
    format!("gpuroute.hold_ms.{}", stat_segment(pool))
}

/// The pools whose hold stats (counters, held gauge, wait histogram) a configuration defines, at
/// 0, as it is read: with `hold` on, every configured pool (a request is held in its own pool or
/// in a failover pool it overflowed to, both configured); none with it off. Before their first
/// count: a counter that first appears at 1 gives Prometheus's `increase()` no earlier sample,
/// so its first count never alerts. Both shells define these, so both expose the same series
/// from the start.
pub fn stat_pools(config: &FilterConfig) -> impl Iterator<Item = &str> {
    let pools = match config.hold {
        Some(_) => config.pools.as_slice(),
        None => &[],
    };
    pools.iter().map(|p| p.name.as_str())
}

/// Held requests, in the order they are to go: higher `x-gateway-priority` first; among equal
/// priorities by arrival, or with [`HoldOrder::Shortest`] the shortest prefill first (arrival
/// between equal lengths).
#[derive(Debug)]
pub struct HoldQueue<T> {
    order: HoldOrder,
    entries: Vec<(i64, u32, T)>,
}

impl<T> HoldQueue<T> {
    pub fn new(order: HoldOrder) -> HoldQueue<T> {
        HoldQueue {
            order,
            entries: Vec::new(),
        }
    }

    /// Queues `item` (a request of `priority` that leaves about `prefill_tokens` to prefill) in
    /// its place.
    pub fn push(&mut self, priority: i64, prefill_tokens: u32, item: T) {
        let tokens = match self.order {
            HoldOrder::Arrival => 0,
            HoldOrder::Shortest => prefill_tokens,
        };
        let at = self
            .entries
            .iter()
            .position(|(p, t, _)| priority > *p || (priority == *p && tokens < *t))
            .unwrap_or(self.entries.len());
        self.entries.insert(at, (priority, tokens, item));
    }

    /// Whether an entry `f` picks would go before a request of `priority` leaving
    /// `prefill_tokens` to prefill, were it queued now ([`HoldQueue::push`]'s place). A request
    /// that comes while such requests wait for room in its pool queues behind them: the room a
    /// snapshot or another worker's request leaves is theirs first, not the newcomer's.
    pub fn ahead(&self, priority: i64, prefill_tokens: u32, mut f: impl FnMut(&T) -> bool) -> bool {
        let tokens = match self.order {
            HoldOrder::Arrival => 0,
            HoldOrder::Shortest => prefill_tokens,
        };
        self.entries
            .iter()
            .take_while(|(p, t, _)| !(priority > *p || (priority == *p && tokens < *t)))
            .any(|(_, _, item)| f(item))
    }

    /// Takes out the entries `f` picks; whether there was any.
    pub fn remove(&mut self, mut f: impl FnMut(&T) -> bool) -> bool {
        let n = self.entries.len();
        self.entries.retain(|(_, _, item)| !f(item));
        self.entries.len() != n
    }

    /// The held requests, first to go first.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.entries.iter().map(|(_, _, item)| item)
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &HoldQueue<&'static str>) -> Vec<&'static str> {
        q.iter().copied().collect()
    }

    #[test]
    fn hold_stats_name_the_pool_as_one_segment_and_events_in_their_index_order() {
        assert_eq!(
            hold_stat("llama-3.1:8b", HoldEvent::Cancelled),
            "gpuroute.hold.llama-3_1_8b.cancelled"
        );
        assert_eq!(held_stat("burst"), "gpuroute.held.burst");
        assert_eq!(
            hold_ms_stat("llama-3.1:8b"),
            "gpuroute.hold_ms.llama-3_1_8b"
        );
        for (i, e) in HoldEvent::ALL.iter().enumerate() {
            assert_eq!(*e as usize, i);
        }
        let names = HoldEvent::ALL.map(HoldEvent::name);
        let want = [
            "held",
            "affinity",
            "released",
            "expired",
            "answered",
            "cancelled",
            "full",
        ];
        assert_eq!(names, want);
    }

    #[test]
    fn a_held_request_the_gateway_answers_counts_as_answered_whether_or_not_its_wait_ran_out() {
        assert_eq!(HoldEvent::left(false, false), HoldEvent::Released);
        assert_eq!(HoldEvent::left(true, false), HoldEvent::Expired);
        assert_eq!(HoldEvent::left(false, true), HoldEvent::Answered);
        assert_eq!(HoldEvent::left(true, true), HoldEvent::Answered);
    }

    #[test]
    fn with_hold_on_every_configured_pool_has_hold_stats_and_none_without() {
        // A standby pool, only another's failover, holds the requests that overflow to it.
        let pools = r#""pools":[{"name":"llama","models":["m"],"failover":["burst"],
                                 "overflow":true},
                                {"name":"burst","models":[]},{"name":"qwen","models":["q"]}]"#;
        let config = |hold: &str| FilterConfig::from_json(format!("{{{pools}{hold}}}").as_bytes());
        let on = config(r#","hold":{}"#).unwrap();
        assert_eq!(
            stat_pools(&on).collect::<Vec<_>>(),
            ["llama", "burst", "qwen"]
        );
        assert_eq!(stat_pools(&config("").unwrap()).count(), 0);
    }

    #[test]
    fn priority_first_then_arrival() {
        let mut q = HoldQueue::new(HoldOrder::Arrival);
        q.push(0, 900, "a");
        q.push(0, 10, "b");
        q.push(5, 500, "urgent");
        q.push(-1, 1, "batch");
        q.push(0, 1, "c");
        assert_eq!(order(&q), ["urgent", "a", "b", "c", "batch"]);
        assert!(q.remove(|i| *i == "b"));
        assert!(!q.remove(|i| *i == "b"));
        assert_eq!((order(&q), q.len()), (vec!["urgent", "a", "c", "batch"], 4));
    }

    #[test]
    fn ahead_names_the_entries_a_request_queued_now_would_wait_behind() {
        let mut q = HoldQueue::new(HoldOrder::Arrival);
        q.push(5, 0, "urgent");
        q.push(0, 0, "standard");
        assert!(q.ahead(0, 0, |i| *i == "urgent"));
        // Arrival: one of the same priority queued earlier goes first.
        assert!(q.ahead(0, 0, |i| *i == "standard"));
        assert!(!q.ahead(5, 0, |i| *i == "standard"));
        assert!(!q.ahead(6, 0, |_| true));
        assert!(q.ahead(-3, 0, |_| true));
        assert!(!q.ahead(-3, 0, |_| false));
        let mut q = HoldQueue::new(HoldOrder::Shortest);
        q.push(0, 100, "short");
        q.push(0, 900, "long");
        assert!(q.ahead(0, 500, |i| *i == "short"));
        assert!(!q.ahead(0, 500, |i| *i == "long"));
        assert!(q.ahead(0, 900, |i| *i == "long"));
        assert!(!HoldQueue::<&str>::new(HoldOrder::Arrival).ahead(0, 0, |_| true));
    }

    #[test]
    fn shortest_first_within_a_priority_arrival_between_equals() {
        let mut q = HoldQueue::new(HoldOrder::Shortest);
        q.push(0, 900, "long");
        q.push(0, 10, "short");
        q.push(0, 10, "short, later");
        q.push(1, 5_000, "urgent and long");
        q.push(0, 400, "middle");
        assert_eq!(
            order(&q),
            ["urgent and long", "short", "short, later", "middle", "long"]
        );
        q.remove(|_| true);
        assert!(q.is_empty());
    }
}
