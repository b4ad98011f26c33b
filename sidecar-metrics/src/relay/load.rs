//! The in-flight (prefill) count relay between gateway replicas.
//!
//! Each replica's filter knows which of its own requests are still in prefill on which pod;
//! replicas that do not share this route blind to each other's load (the offline replay: 7-29%
//! more mean TTFT with three replicas, nearly all of it won back when the counts are exchanged
//! within ~5 ms, about half within 20 ms). So every `prefix.load_interval_ms` (default 5) this
//! relay reads each Envoy it pushes to (`GET {load_path}`, an opaque body) and posts the body as
//! it came, naming where it came from in `x-gpuroute-replica`, to:
//! - the other Envoys it pushes to (`POST {load_path}`), and
//! - every peer (`POST {peer}/v1/load`), which hands it to its own Envoys
//!   ([`Relay::deliver_load`], behind the HTTP surface).
//!
//! A receiving sidecar posts its peers' counts to each of its Envoys as they come, one post at a
//! time per Envoy and at most [`POSTS_PER_INTERVAL`] in any `prefix.load_interval_ms`: what
//! comes while a post is under way, or once the budget is spent, waits (the newest body of each
//! replica) and goes in the next post, together ([`Outbox`]; several replicas' in one body, a
//! bundle: `gpuroute_core::replica_load::encode_bundle`). Each post costs the Envoy a request
//! through its ingest listener and a rewrite of its shared store (~77 us of its CPU on the
//! benchmark host, `scripts/replica_fanin_cost.py`), so
//! without this an Envoy would take one post per peer per interval: with 15 peers, 3,000 a
//! second. With up to four peers their counts go as they come (a budget of six leaves room for
//! their timing to wander); from five or so on an Envoy takes at most 1,200 posts a second (at
//! 5 ms), however many replicas there are.
//!
//! A receiving Envoy keeps one entry per replica name for its `ingest.load_ttl_ms` (50 ms by
//! default) and replaces it with each newer post, so only the newest body matters: nothing is
//! queued, a failed read or post is counted and dropped, and a target still busy with the
//! previous body from the same replica is skipped.
//!
//! Most bodies are the same as the one before (an idle gateway's always are), so each target is
//! posted a body only when it needs it ([`LoadState`], per Envoy read and target):
//! - a body that differs from the last one the target took, at the next round;
//! - an unchanged body again once `prefix.load_keepalive_ms` (default 20) has passed since the
//!   target took it, so that its copy never outlives the receiver's ttl (the keepalive must stay
//!   below `ingest.load_ttl_ms`);
//! - the empty body (nothing in prefill) once, and not again until a non-empty one went in
//!   between: an expired entry means the same, so it needs no keepalive.
//!
//! A post that failed counts as not sent, so the next round posts again; the skipped ones are
//! counted in `unchanged`. A peer that took a body took it, even if one of its Envoys did not
//! (refused it, or had [`MAX_REPLICAS`] replicas' bodies waiting): that Envoy gets the next
//! change or keepalive (an empty body: its entry expires). And an Envoy whose last body was
//! empty is read every
//! `prefix.load_idle_interval_ms` (default 20) instead, back to every `load_interval_ms` from its
//! first non-empty body on: an idle gateway costs a GET per Envoy every 20 ms and no post, and a
//! burst's first requests reach the other replicas up to that much later. Each Envoy is read on
//! its own clock, so a slow one delays only its own counts, and reads missed meanwhile are
//! skipped, never caught up in a burst.

use super::Relay;
use crate::client;
use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use gpuroute_core::replica_load::{encode_bundle, ReplicaLoad, MAX_REPLICAS};
use http::Method;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// The path of the sidecar's own surface that takes peers' in-flight counts.
pub const LOAD_PEER_PATH: &str = "/v1/load";

/// The header naming the replica (one Envoy) a body of in-flight counts comes from.
pub use gpuroute_core::replica_load::REPLICA_HEADER;

/// The longest replica name the filter takes.
pub use gpuroute_core::replica_load::MAX_REPLICA_NAME as MAX_REPLICA_LEN;

/// The most posts of peers' counts one Envoy takes in any `prefix.load_interval_ms`. Four peers
/// post four times an interval; six leaves room for their timing to wander, so up to four
/// their counts go as they come (unless a post to that Envoy is under way). With more, what
/// comes once the six are spent waits for the next, all in one post. Against four and eight
/// (`scripts/replica_fanin_cost.py`, one run each): four made the counts of four and five peers
/// wait (median 0.6-1.5 ms from a peer's post, against 0.4 with six) for little of the Envoy's
/// CPU; with fifteen peers eight left the Envoy at 179 ms/s of CPU, six at 127.
pub const POSTS_PER_INTERVAL: usize = 6;

/// The filter's body for "nothing in prefill": the magic and a pool count of zero.
const NO_PREFILL: &[u8] = b"GPL1\0\0\0\0";

/// Whether `body` says that nothing is in prefill: the filter's counts without a single pod
/// (what it answers while idle is exactly [`NO_PREFILL`]). Any other body, even one the filter
/// would refuse, is passed on as counts.
pub(super) fn no_prefill(body: &[u8]) -> bool {
    body == NO_PREFILL
        || ReplicaLoad::decode(body).is_ok_and(|l| l.pools.iter().all(|(_, pods)| pods.is_empty()))
}

/// The load relay's pacing and memory: how long an unchanged body may go without a post, how
/// often an idle Envoy is read, and what each target last took from each Envoy.
#[derive(Debug, Default)]
pub(super) struct LoadState {
    /// `prefix.load_keepalive_ms`.
    keepalive: Duration,
    /// `prefix.load_idle_interval_ms`, at least the relay's interval.
    pub(super) idle_interval: Duration,
    /// For each Envoy read (by index), the last body each target (by URL) took from it.
    sent: Vec<Mutex<HashMap<String, Sent>>>,
    /// For each Envoy (by index), the peers' counts waiting for a post to it (at most
    /// [`POSTS_PER_INTERVAL`] posts in any relay interval).
    outboxes: Vec<Outbox>,
}

/// The peers' counts waiting for a post to one Envoy, and the post that will carry them.
#[derive(Debug)]
pub(super) struct Outbox(Mutex<Waiting>);

#[derive(Debug)]
struct Waiting {
    /// The newest body of each replica that came since the last post began, by replica name.
    bodies: Vec<(String, Bytes)>,
    /// Tells whether the post that takes `bodies` was taken.
    taken: watch::Sender<Option<bool>>,
    /// A task is posting, and takes what comes meanwhile.
    draining: bool,
    /// When the latest posts began, oldest first (at most [`POSTS_PER_INTERVAL`]).
    began: std::collections::VecDeque<Instant>,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox(Mutex::new(Waiting {
            bodies: Vec::new(),
            taken: watch::channel(None).0,
            draining: false,
            began: std::collections::VecDeque::new(),
        }))
    }
}

impl Outbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The last body one target took from one Envoy.
#[derive(Debug, Clone)]
struct Sent {
    body: Bytes,
    /// Whether it said nothing is in prefill ([`no_prefill`]).
    empty: bool,
    /// When its post began: the target's copy is at least this fresh.
    at: Instant,
}

impl LoadState {
    /// The state of a relay reading `envoys` Envoys.
    pub(super) fn new(keepalive: Duration, idle_interval: Duration, envoys: usize) -> LoadState {
        LoadState {
            keepalive,
            idle_interval,
            sent: (0..envoys).map(|_| Mutex::default()).collect(),
            outboxes: (0..envoys).map(|_| Outbox::default()).collect(),
        }
    }

    /// What the targets took from Envoy `from`; `None` for an Envoy this relay does not read.
    fn sent(&self, from: usize) -> Option<std::sync::MutexGuard<'_, HashMap<String, Sent>>> {
        let m = self.sent.get(from)?;
        Some(m.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Whether `url` needs `body` (read from Envoy `from`; `empty` if it says nothing is in
    /// prefill) at `now`: it took nothing from that Envoy yet, or something else, or the same
    /// non-empty body a keepalive ago or longer.
    fn due(&self, from: usize, url: &str, body: &Bytes, empty: bool, now: Instant) -> bool {
        let Some(sent) = self.sent(from) else {
            return true;
        };
        match sent.get(url) {
            None => true,
            Some(last) if empty && last.empty => false,
            Some(last) => {
                last.body != *body || now.saturating_duration_since(last.at) >= self.keepalive
            }
        }
    }

    /// Notes that `url` took `body` from Envoy `from`, posted at `at`.
    fn took(&self, from: usize, url: String, body: Bytes, empty: bool, at: Instant) {
        if let Some(mut sent) = self.sent(from) {
            sent.insert(url, Sent { body, empty, at });
        }
    }

    /// Forgets the targets of Envoy `from` that are no longer among `targets` (peers DNS no
    /// longer finds), so that the memory follows the targets.
    fn keep_only(&self, from: usize, targets: &[(String, bool)]) {
        if let Some(mut sent) = self.sent(from) {
            if sent.len() > targets.len() {
                sent.retain(|url, _| targets.iter().any(|(t, _)| t == url));
            }
        }
    }
}

/// When to read next, the read before having been due at `last`: `step` later, or, when that
/// has passed already (the read took longer), the first instant on the same beat still ahead,
/// so that missed reads are skipped rather than caught up in a burst.
pub(super) fn next_read(last: Instant, step: Duration, now: Instant) -> Instant {
    let next = last + step;
    if next > now || step.is_zero() {
        return next;
    }
    let into = now.duration_since(next).as_nanos() % step.as_nanos();
    now + step.saturating_sub(Duration::from_nanos(u64::try_from(into).unwrap_or(0)))
}

/// The shortest timeout of a read or a post: the Envoys are on loopback or in the cluster, but a
/// loaded node can take a few tens of ms to schedule an answer.
const MIN_TIMEOUT: Duration = Duration::from_millis(50);

/// The timeout of one read or post at `interval`: ten intervals, at least [`MIN_TIMEOUT`]. A
/// body older than that is stale anyway, and newer ones follow.
pub(super) fn timeout(interval: Duration) -> Duration {
    (interval * 10).max(MIN_TIMEOUT)
}

/// The longest part of the snapshots' `source` kept in an [`instance_name`]: room is left for
/// the random part and for [`replica_name`]'s `/i`.
const MAX_SOURCE_IN_NAME: usize = 100;

/// A name for this sidecar among the replicas, drawn once per relay (per process, in the
/// binary): `source` (the snapshots' `source`, `$HOSTNAME` or `sidecar-metrics`) with every
/// character but visible ASCII (a space, a control or a non-ASCII character) made `_`, at most
/// [`MAX_SOURCE_IN_NAME`] characters, then `@` and eight random hex digits. The random part
/// keeps two replicas apart however they were named: without `$HOSTNAME` (systemd, `env -i`)
/// every one was `sidecar-metrics`, and a shared ConfigMap's `source` names them all alike,
/// and a receiver keeps one entry per name. A restart draws a new name; the one before expires
/// in the filters after their `ingest.load_ttl_ms`.
pub fn instance_name(source: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    static DRAWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut name = visible_ascii(source);
    // Only ASCII is left, so any byte length is a character boundary.
    name.truncate(MAX_SOURCE_IN_NAME);
    // Keyed from the OS's randomness once per process (std's `RandomState`), and apart for
    // every name drawn in it.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(DRAWN.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    h.write_u128(now.as_nanos());
    format!("{name}@{:08x}", h.finish() & 0xffff_ffff)
}

/// The replica name of Envoy `i` of the `n` this sidecar pushes to: `instance` (an
/// [`instance_name`]) plus `/i` when it pushes to more than one, at most [`MAX_REPLICA_LEN`]
/// characters.
pub fn replica_name(instance: &str, i: usize, n: usize) -> String {
    let suffix = if n > 1 {
        format!("/{i}")
    } else {
        String::new()
    };
    let mut name = visible_ascii(instance);
    // Only ASCII is left, so any byte length is a character boundary.
    name.truncate(MAX_REPLICA_LEN.saturating_sub(suffix.len()));
    name + &suffix
}

/// `name` with every character but visible ASCII as `_` (what the filter takes in a replica
/// name); `sidecar-metrics` when empty.
fn visible_ascii(name: &str) -> String {
    let name: String = name
        .chars()
        .map(|c| if c.is_ascii_graphic() { c } else { '_' })
        .collect();
    if name.is_empty() {
        "sidecar-metrics".to_string()
    } else {
        name
    }
}

/// Whether `name` is a replica name the filter takes: 1 to [`MAX_REPLICA_LEN`] visible ASCII
/// characters, no space.
pub fn valid_replica(name: &str) -> bool {
    gpuroute_core::replica_load::replica_key(Some(name)).is_ok()
}

impl Relay {
    /// Reads Envoy `i`'s in-flight counts: the body of a 200 answer to `GET {load_path}`.
    async fn read_load(&self, i: usize) -> Option<Bytes> {
        let url = self.envoys.get(i)?;
        let read = async {
            let req = client::request(
                Method::GET,
                url,
                &[(client::AUTH, &self.auth)],
                Bytes::new(),
            )
            .map_err(|e| e.to_string())?;
            // A body over MAX_PEER_BODY, more than a peer takes, fails here.
            let resp = self.exchange(req).await?;
            match resp.status.as_u16() {
                200 => {}
                404 => {
                    return Err(
                        "status 404 Not Found (is the filter's in-flight count exchange off?)"
                            .to_string(),
                    )
                }
                _ => return Err(format!("status {}", resp.status)),
            }
            Ok(resp.body)
        };
        match read.await {
            Ok(body) => Some(body),
            Err(why) => {
                self.failed(
                    &self.stats.envoy_failures,
                    "reading an Envoy's in-flight counts",
                    url,
                    why,
                );
                None
            }
        }
    }

    /// Reads Envoy `i`'s in-flight counts and hands them, named by its replica name, to the
    /// other Envoys and to the peers that need them (`LoadState`) without waiting for them;
    /// nothing, not even the read, when there is no one to hand them to. Whether the body read
    /// said nothing is in prefill; `None` when nothing was read.
    pub async fn relay_load(self: &Arc<Self>, i: usize) -> Option<bool> {
        if !self.has_targets() {
            return None;
        }
        let body = self.read_load(i).await?;
        self.stats.records_out.fetch_add(1, Ordering::Relaxed);
        let empty = no_prefill(&body);
        self.send_load(body, i, empty);
        Some(empty)
    }

    /// Posts `body`, read from Envoy `from` (`empty`: it says nothing is in prefill), to each
    /// target that needs it, without waiting: a slow or blackholed target must not hold up the
    /// reads. A target that already has it is skipped (`unchanged`), and so is one still busy
    /// with the previous body from the same replica (`busy_skips`). What a target takes is
    /// noted when it answers; a failed post notes nothing, so the next round posts again.
    fn send_load(self: &Arc<Self>, body: Bytes, from: usize, empty: bool) {
        let Some(replica) = self.replicas.get(from) else {
            return;
        };
        let targets = self.targets(from);
        self.load.keep_only(from, &targets);
        let now = Instant::now();
        for (url, peer) in targets {
            if !self.load.due(from, &url, &body, empty, now) {
                self.stats.unchanged.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let Some(claim) = self.claim(format!("{url} {replica}")) else {
                continue;
            };
            let (me, body, replica) = (self.clone(), body.clone(), replica.clone());
            tokio::spawn(async move {
                let at = Instant::now();
                let post = me
                    .clone()
                    .post_counted(url.clone(), body.clone(), peer, Some(replica));
                if post.await {
                    me.load.took(from, url, body, empty, at);
                }
                drop(claim);
            });
        }
    }

    /// One round: every Envoy read at once, each one's counts relayed as soon as they come.
    pub async fn load_round(self: &Arc<Self>) {
        futures::future::join_all((0..self.envoys.len()).map(|i| self.relay_load(i))).await;
    }

    /// Relays each Envoy's counts until `shutdown`, each Envoy on its own clock so that a slow
    /// one holds up no other: every `interval`, or every `idle_interval` while its last body
    /// said nothing is in prefill (a failed read keeps the pace it had). A read missed while
    /// the one before was under way is skipped.
    pub async fn run_load(self: Arc<Self>, shutdown: CancellationToken) {
        let mut set = JoinSet::new();
        for i in 0..self.envoys.len() {
            let (me, stop) = (self.clone(), shutdown.clone());
            set.spawn(async move {
                let mut due = Instant::now();
                let mut step = me.interval;
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep_until(due) => {}
                    }
                    let read = tokio::select! {
                        _ = stop.cancelled() => return,
                        read = me.relay_load(i) => read,
                    };
                    match read {
                        Some(true) => step = me.load.idle_interval,
                        Some(false) => step = me.interval,
                        None => {}
                    }
                    due = next_read(due, step, Instant::now());
                }
            });
        }
        while set.join_next().await.is_some() {}
    }

    /// A peer's in-flight counts from replica `replica` (both checked by the caller) to every
    /// Envoy of this replica; whether one took them (or the newer body of the same replica that
    /// replaced them while they waited), told as soon as one did: the posts to the others go
    /// on. Each Envoy takes one post at a time, at most `POSTS_PER_INTERVAL` an interval, each
    /// carrying everything that came meanwhile (its `Outbox`). Before, the peer's answer waited
    /// for the slowest Envoy: one hung Envoy here held every post for the whole timeout, which
    /// the peer's own (also `load_interval_ms`-scale) ran out first, so it counted the post
    /// failed and its counts reached this replica's healthy Envoy about once per timeout, at or
    /// past their `load_ttl_ms` (an audit, 2026-12-07: taken 19 times a second instead of 44,
    /// 35 peer failures in 2 s).
    pub async fn deliver_load(self: &Arc<Self>, body: Bytes, replica: &str) -> bool {
        self.stats.records_in.fetch_add(1, Ordering::Relaxed);
        let mut waits: FuturesUnordered<_> = (0..self.envoys.len())
            .filter_map(|i| self.enqueue(i, replica, body.clone()))
            .map(|mut w| async move {
                let done = w.wait_for(Option::is_some).await;
                done.is_ok_and(|t| *t == Some(true))
            })
            .collect();
        while let Some(taken) = waits.next().await {
            if taken {
                return true;
            }
        }
        false
    }

    /// Puts `body` from `replica` into Envoy `i`'s outbox, in place of an earlier one from the
    /// same replica, and starts a task posting it unless one is under way; what tells whether
    /// it was taken. `None` for an Envoy this relay does not post to, or a full outbox
    /// ([`MAX_REPLICAS`] replicas waiting, counted in `busy_skips`).
    fn enqueue(
        self: &Arc<Self>,
        i: usize,
        replica: &str,
        body: Bytes,
    ) -> Option<watch::Receiver<Option<bool>>> {
        let mut w = self.load.outboxes.get(i)?.lock();
        if let Some(slot) = w.bodies.iter_mut().find(|(r, _)| r == replica) {
            slot.1 = body;
        } else if w.bodies.len() >= MAX_REPLICAS {
            self.stats.busy_skips.fetch_add(1, Ordering::Relaxed);
            return None;
        } else {
            w.bodies.push((replica.to_string(), body));
        }
        let taken = w.taken.subscribe();
        if !w.draining {
            w.draining = true;
            tokio::spawn(self.clone().drain(i));
        }
        Some(taken)
    }

    /// Posts Envoy `i`'s outbox until it is empty: one replica's body as it came, several in
    /// one bundle; once [`POSTS_PER_INTERVAL`] posts began within the last interval, the next
    /// waits until the oldest of them is an interval old.
    async fn drain(self: Arc<Self>, i: usize) {
        let (Some(url), Some(outbox)) = (self.envoys.get(i), self.load.outboxes.get(i)) else {
            return;
        };
        loop {
            let wait = {
                let w = outbox.lock();
                let full = w.began.len() >= POSTS_PER_INTERVAL;
                w.began.front().filter(|_| full).map(|t| *t + self.interval)
            };
            if let Some(until) = wait {
                tokio::time::sleep_until(until).await;
            }
            let (bodies, taken) = {
                let mut w = outbox.lock();
                if w.bodies.is_empty() {
                    w.draining = false;
                    return;
                }
                let now = Instant::now();
                let window = self.interval;
                w.began
                    .retain(|t| now.saturating_duration_since(*t) < window);
                if w.began.len() >= POSTS_PER_INTERVAL {
                    w.began.pop_front();
                }
                w.began.push_back(now);
                let next = watch::channel(None).0;
                (
                    std::mem::take(&mut w.bodies),
                    std::mem::replace(&mut w.taken, next),
                )
            };
            let (body, replica) = match bodies.as_slice() {
                [(replica, body)] => (body.clone(), Some(replica.clone())),
                _ => {
                    let n = bodies.len() as u64;
                    self.stats.bundled.fetch_add(n, Ordering::Relaxed);
                    let entries = bodies.iter().map(|(r, b)| (r.as_str(), b.as_ref()));
                    (Bytes::from(encode_bundle(entries)), None)
                }
            };
            let ok = self
                .clone()
                .post_counted(url.clone(), body, false, replica)
                .await;
            taken.send_replace(Some(ok));
        }
    }
}

#[cfg(test)]
mod tests;
