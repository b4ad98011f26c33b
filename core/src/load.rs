//! In-flight accounting shared by all Envoy workers: what this gateway has sent to each pod and
//! not yet seen finish, and how much of that the current snapshot already reflects.
//!
//! This is what stops the thundering herd. Between two snapshots every request would otherwise
//! see the same "best" pod; with this table a pick immediately counts against its pod, so a burst
//! arriving inside one scrape interval spreads by free capacity.
//!
//! In the proxy-wasm filter each worker keeps its own table per pool (a stream lives and ends in
//! one worker, so its requests are its own), exact and local, and publishes it in Envoy shared
//! data under its own key; the other workers' published tables are summed into its view of the
//! pool ([`PeerTables::sum`], by pod key). The dynamic module keeps one table per pool for
//! all workers, behind its lock. Per pod a table keeps `inflight` (sent minus finished) and `base`,
//! the value of `inflight` when the current snapshot took effect. `inflight - base` is then the
//! change since the snapshot: positive for requests the pods have not reported yet, negative for
//! requests that finished since. Both are per worker, so the deltas of all workers add up to the
//! gateway's. Pods are keyed by [`crate::prefix::pod_key`], so a new snapshot that adds, drops or reorders
//! pods carries the counts over by identity.
//!
//! A worker publishes its table as a [`SparseTable`] (`GPL3`): only the pods it has a count on,
//! each with its place in the snapshot's list, so reading and summing the other workers' tables
//! costs what they have in flight, not the pool's size (a dense table is 32 bytes a pod: at 1,000
//! pods and four workers the exchange was ~700,000 instructions a request). Builds before it
//! read only the dense form (`GPL2`), which a worker still writes on its tick for them (during a
//! change of the filter both builds share the keys), and which this build reads when a worker
//! has published no sparse table (an earlier build's).
//!
//! It also keeps each pod's **prefill backlog** from this gateway: requests sent whose first
//! response byte has not come back yet, and their prompt tokens. Engines report a request in
//! chunked prefill as "running", so a pod busy prefilling long prompts looks idle in its
//! metrics; the first streamed chunk marks the end of prefill, which the filter sees directly.

use crate::idmap::IdMap;

const MAGIC: &[u8; 4] = b"GPL2";
const HEADER: usize = 4 + 8 + 4;
const ENTRY: usize = 8 + 6 * 4;
const SPARSE_MAGIC: &[u8; 4] = b"GPL3";
/// A sparse entry: the pod's index in the snapshot's list, then its dense entry.
const SPARSE_ENTRY: usize = 4 + ENTRY;

/// One pod's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodLoad {
    pub key: u64,
    pub inflight: u32,
    pub base: u32,
    pub tokens: u32,
    pub base_tokens: u32,
    /// Requests sent whose first response byte has not arrived (still queued or prefilling).
    pub prefill: u32,
    /// Their prompt tokens.
    pub prefill_tokens: u32,
}

impl PodLoad {
    /// Requests sent (positive) or finished (negative) since the snapshot.
    pub fn delta(&self) -> i64 {
        i64::from(self.inflight) - i64::from(self.base)
    }

    /// Prompt tokens sent (positive) or finished (negative) since the snapshot.
    pub fn delta_tokens(&self) -> i64 {
        i64::from(self.tokens) - i64::from(self.base_tokens)
    }

    /// Adds another table's counts of the same pod (another worker's, another engine's).
    pub fn add(&mut self, o: &PodLoad) {
        self.inflight = self.inflight.saturating_add(o.inflight);
        self.base = self.base.saturating_add(o.base);
        self.tokens = self.tokens.saturating_add(o.tokens);
        self.base_tokens = self.base_tokens.saturating_add(o.base_tokens);
        self.add_prefill(o.prefill, o.prefill_tokens);
    }

    /// Whether every count is zero: adding it to another changes nothing.
    pub fn is_zero(&self) -> bool {
        (self.inflight
            | self.base
            | self.tokens
            | self.base_tokens
            | self.prefill
            | self.prefill_tokens)
            == 0
    }

    fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key.to_le_bytes());
        for v in [
            self.inflight,
            self.base,
            self.tokens,
            self.base_tokens,
            self.prefill,
            self.prefill_tokens,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }

    /// Reads an entry as [`PodLoad::write`] wrote it (`e`: [`ENTRY`] bytes).
    fn read(e: &[u8]) -> PodLoad {
        PodLoad {
            key: u64::from_le_bytes(arr8(e, 0)),
            inflight: u32::from_le_bytes(arr4(e, 8)),
            base: u32::from_le_bytes(arr4(e, 12)),
            tokens: u32::from_le_bytes(arr4(e, 16)),
            base_tokens: u32::from_le_bytes(arr4(e, 20)),
            prefill: u32::from_le_bytes(arr4(e, 24)),
            prefill_tokens: u32::from_le_bytes(arr4(e, 28)),
        }
    }

    /// Adds `requests` in prefill with `tokens` of prompt (another gateway replica's).
    pub fn add_prefill(&mut self, requests: u32, tokens: u32) {
        self.prefill = self.prefill.saturating_add(requests);
        self.prefill_tokens = self.prefill_tokens.saturating_add(tokens);
    }
}

/// The per-pool table, in the snapshot's pod order once [`LoadTable::rebase`] ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTable {
    /// Snapshot version the `base` values belong to.
    pub version: u64,
    pub pods: Vec<PodLoad>,
}

impl LoadTable {
    /// Decodes the dense form (`GPL2`); an empty or malformed value is an empty table.
    pub fn decode(bytes: &[u8]) -> LoadTable {
        let Some((version, body)) = framed(bytes, MAGIC, ENTRY) else {
            return LoadTable::default();
        };
        let pods = body.chunks_exact(ENTRY).map(PodLoad::read).collect();
        LoadTable { version, pods }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + self.pods.len() * ENTRY);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.pods.len() as u32).to_le_bytes());
        for p in &self.pods {
            p.write(&mut out);
        }
        out
    }

    /// The sparse form (`GPL3`, [`SparseTable`]): the pods with a count, each with its index.
    pub fn encode_sparse(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + 4 * SPARSE_ENTRY);
        out.extend_from_slice(SPARSE_MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        let mut n = 0u32;
        for (i, p) in self.pods.iter().enumerate() {
            if !p.is_zero() {
                out.extend_from_slice(&(i as u32).to_le_bytes());
                p.write(&mut out);
                n += 1;
            }
        }
        out[12..16].copy_from_slice(&n.to_le_bytes());
        out
    }

    /// Adds a sparse table of this table's snapshot version, pod by pod (by key: an entry whose
    /// index names another pod is left out). Returns whether it was added.
    pub fn add_sparse(&mut self, other: &SparseTable) -> bool {
        if other.version != self.version {
            return false;
        }
        for (i, o) in &other.entries {
            if let Some(p) = self.pods.get_mut(*i as usize).filter(|p| p.key == o.key) {
                p.add(o);
            }
        }
        true
    }

    /// Whether the table is aligned with snapshot `version` whose pods have these keys.
    pub fn matches(&self, version: u64, keys: &[u64]) -> bool {
        self.version == version
            && self.pods.len() == keys.len()
            && self.pods.iter().zip(keys).all(|(p, k)| p.key == *k)
    }

    /// Aligns the table with a new snapshot: pods in the snapshot's order, counts carried over by
    /// key, and `base` set to the current in-flight values (the snapshot reflects them).
    /// Returns false if it was already aligned (nothing to write).
    pub fn rebase(&mut self, version: u64, keys: &[u64]) -> bool {
        if self.matches(version, keys) {
            return false;
        }
        let same_version = self.version == version;
        // Each pod's old entry: at its own index when the pod kept its place (the usual new
        // version of the same fleet), else by key. A search of the old table per pod made this
        // O(pods^2) on every push: 27 ms natively, 38 ms in V8 at 10,000 pods (a scale audit).
        let mut by_key: Option<IdMap<u64, usize>> = None;
        let old_pods = &self.pods;
        let pods = keys
            .iter()
            .enumerate()
            .map(|(i, &key)| {
                let old = match old_pods.get(i) {
                    Some(p) if p.key == key => Some(*p),
                    _ => by_key
                        .get_or_insert_with(|| {
                            old_pods
                                .iter()
                                .enumerate()
                                .map(|(j, p)| (p.key, j))
                                .collect()
                        })
                        .get(&key)
                        .and_then(|&j| old_pods.get(j))
                        .copied(),
                };
                match old {
                    // Same snapshot, different layout (should not happen): keep the bases.
                    Some(p) if same_version => p,
                    Some(p) => PodLoad {
                        base: p.inflight,
                        base_tokens: p.tokens,
                        ..p
                    },
                    None => PodLoad {
                        key,
                        ..PodLoad::default()
                    },
                }
            })
            .collect();
        self.version = version;
        self.pods = pods;
        true
    }

    /// Whether no request of this table's writer is in flight on any of its pods.
    pub fn is_idle(&self) -> bool {
        self.pods.iter().all(|p| p.inflight == 0)
    }

    /// A table aligned with snapshot `version` whose pods have these keys, all counts zero.
    pub fn zeroed(version: u64, keys: &[u64]) -> LoadTable {
        LoadTable {
            version,
            pods: keys
                .iter()
                .map(|&key| PodLoad {
                    key,
                    ..PodLoad::default()
                })
                .collect(),
        }
    }

    /// Adds another worker's dense table to this one, pod by pod (by key), if it counts
    /// ([`counts`]). Returns whether it was added. The exchange before the sparse form; kept as
    /// the reference its sums are tested against.
    #[cfg(test)]
    pub fn add_table(&mut self, other: &LoadTable, previous: Option<u64>) -> bool {
        if !counts(other.version, self.version, previous) {
            return false;
        }
        for (i, o) in other.pods.iter().enumerate() {
            // Tables of one snapshot list the pods in the same order: the same index, unless a
            // table of the snapshot before lists them otherwise (then by key). Per request this
            // runs over the whole pool, so no search per pod in the common case.
            let at = match self.pods.get(i) {
                Some(p) if p.key == o.key => Some(i),
                _ => self.pods.iter().position(|p| p.key == o.key),
            };
            if let Some(p) = at.and_then(|j| self.pods.get_mut(j)) {
                p.add(o);
            }
        }
        true
    }

    /// Counts a request sent to pod `idx`: in flight as its `sequences` (the pod runs each of a
    /// request's `n` choices as a request of its own) with its prompt `tokens` (KV it will take),
    /// and, when its end of prefill is observable (a streamed response), in prefill with
    /// `prefill_tokens` (the part the pod must compute, not cached) until its first byte.
    pub fn add(&mut self, idx: usize, sequences: u32, tokens: u32, prefill_tokens: Option<u32>) {
        if let Some(p) = self.pods.get_mut(idx) {
            p.inflight = p.inflight.saturating_add(sequences);
            p.tokens = p.tokens.saturating_add(tokens);
            if let Some(pt) = prefill_tokens {
                p.add_prefill(1, pt);
            }
        }
    }

    /// Counts the request `f` records against pod `idx`: what [`InFlight::finished`] and
    /// [`InFlight::first_byte`] undo.
    pub fn count(&mut self, idx: usize, f: &InFlight) {
        let prefill = f.in_prefill.then_some(f.prefill_tokens);
        self.add(idx, f.sequences, f.tokens, prefill);
    }

    /// The first response byte of a request to the pod with `key` arrived: its prefill is done.
    /// Returns false if the pod is gone from the table.
    pub fn first_byte(&mut self, key: u64, prefill_tokens: u32) -> bool {
        let Some(p) = self.pods.iter_mut().find(|p| p.key == key) else {
            return false;
        };
        p.prefill = p.prefill.saturating_sub(1);
        p.prefill_tokens = p.prefill_tokens.saturating_sub(prefill_tokens);
        true
    }

    /// Counts a request of `sequences` to the pod with `key` as finished; `in_prefill` carries
    /// its prefill tokens when no byte came back first. Returns false if the pod is gone from the
    /// table (it left the pool; nothing to undo).
    pub fn finish(
        &mut self,
        key: u64,
        sequences: u32,
        tokens: u32,
        in_prefill: Option<u32>,
    ) -> bool {
        let Some(p) = self.pods.iter_mut().find(|p| p.key == key) else {
            return false;
        };
        if let Some(pt) = in_prefill {
            p.prefill = p.prefill.saturating_sub(1);
            p.prefill_tokens = p.prefill_tokens.saturating_sub(pt);
        }
        p.inflight = p.inflight.saturating_sub(sequences);
        p.tokens = p.tokens.saturating_sub(tokens);
        // `base` stays: a request the snapshot counted that finishes makes the delta negative,
        // which is exactly "one fewer than the snapshot reported".
        true
    }
}

/// A worker's in-flight table as published for the others (`GPL3`): its pods with a count, each
/// with its index in the snapshot's list, whatever the pool's size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SparseTable {
    /// Snapshot version the `base` values (and the indices) belong to.
    pub version: u64,
    /// (index in the snapshot's pods, counts), ascending by index.
    pub entries: Vec<(u32, PodLoad)>,
}

impl SparseTable {
    /// Decodes a published table: the sparse form, or the dense one an earlier build writes
    /// (its pods with a count taken). An empty or malformed value is an empty table.
    pub fn decode(bytes: &[u8]) -> SparseTable {
        if bytes.starts_with(MAGIC) {
            let dense = LoadTable::decode(bytes);
            let entries = dense
                .pods
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.is_zero())
                .map(|(i, p)| (i as u32, *p))
                .collect();
            return SparseTable {
                version: dense.version,
                entries,
            };
        }
        let Some((version, body)) = framed(bytes, SPARSE_MAGIC, SPARSE_ENTRY) else {
            return SparseTable::default();
        };
        let entries = body
            .chunks_exact(SPARSE_ENTRY)
            .map(|e| (u32::from_le_bytes(arr4(e, 0)), PodLoad::read(&e[4..])))
            .collect();
        SparseTable { version, entries }
    }

    /// As a dense table of only its pods (not aligned with a snapshot): for readers that go by
    /// key.
    pub fn into_table(self) -> LoadTable {
        LoadTable {
            version: self.version,
            pods: self.entries.into_iter().map(|(_, p)| p).collect(),
        }
    }
}

/// The other workers' published tables of one pool as this worker last read them, by worker id.
///
/// An exchange reads a bounded number of them, in turn (`workers::Turn`), and sums all it
/// holds: with many workers each table is at most a few exchanges old, and an exchange costs the
/// same host calls however many workers Envoy runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerTables {
    tables: Vec<(u32, SparseTable)>,
}

impl PeerTables {
    /// Records what was read of worker `peer`'s table; `None` (nothing published) forgets it.
    pub fn store(&mut self, peer: u32, table: Option<SparseTable>) {
        let held = self.tables.iter_mut().find(|(id, _)| *id == peer);
        match (held, table) {
            (Some(held), Some(t)) => held.1 = t,
            (None, Some(t)) => self.tables.push((peer, t)),
            (Some(_), None) => self.tables.retain(|(id, _)| *id != peer),
            (None, None) => {}
        }
    }

    /// Forgets the tables of workers no longer in `live` (they gave their id back).
    pub fn retain_live(&mut self, live: &[u32]) {
        self.tables.retain(|(id, _)| live.contains(id));
    }

    /// The tables held, summed into one aligned with snapshot `version` whose pods have these
    /// `keys` (which tables count: [`counts`], with `previous`). Each
    /// entry goes to its pod by index, or by key when the index names another pod (a table of
    /// the snapshot before, whose list differed). Linear in the entries held, not in the pods.
    pub fn sum(&self, version: u64, keys: &[u64], previous: Option<u64>) -> SparseTable {
        let mut entries: Vec<(u32, PodLoad)> = Vec::new();
        let mut by_key: Option<IdMap<u64, usize>> = None;
        for (_, t) in &self.tables {
            if !counts(t.version, version, previous) {
                continue;
            }
            for (i, o) in &t.entries {
                let at = match keys.get(*i as usize) {
                    Some(k) if *k == o.key => Some(*i as usize),
                    _ => by_key
                        .get_or_insert_with(|| {
                            keys.iter().enumerate().map(|(j, k)| (*k, j)).collect()
                        })
                        .get(&o.key)
                        .copied(),
                };
                if let Some(at) = at {
                    entries.push((at as u32, *o));
                }
            }
        }
        entries.sort_unstable_by_key(|(i, _)| *i);
        let mut summed: Vec<(u32, PodLoad)> = Vec::with_capacity(entries.len());
        for (i, p) in entries {
            match summed.last_mut() {
                Some((j, q)) if *j == i => q.add(&p),
                _ => summed.push((i, p)),
            }
        }
        SparseTable {
            version,
            entries: summed,
        }
    }

    /// Workers whose table is held.
    pub fn len(&self) -> usize {
        self.tables.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tables.is_empty()
    }
}

/// Whether another worker's table of snapshot `table` counts for a reader on `version` that had
/// `previous` before it. It does if it belongs to the reader's version, or to `previous` or any
/// version between them: a worker that has not installed the newest snapshot yet (it will
/// within its refresh interval or its tick) still counts, its deltas measured from the snapshot
/// before, which can only count a request the newest snapshot already reflects twice for that
/// moment; leaving it out would hide all of that worker's requests instead (measured: the bursty
/// benchmark's p99 TTFT 4% worse at two workers). The versions between: a reader that was idle
/// installs only the newest snapshot when it wakes, and the other worker may be one push behind
/// it, on a version the reader never saw (an audit: the first request after an idle spell did
/// not count the other worker's requests). Older tables are workers that are gone. After
/// versions went back (a reset, `previous` above this one), only this version counts.
fn counts(table: u64, version: u64, previous: Option<u64>) -> bool {
    table == version || previous.is_some_and(|p| p <= table && table < version)
}

/// A table's version and entries, `entry` bytes each, from `magic`, the version, the count of
/// entries and the entries (both forms' layout); `None` if it is not that.
fn framed<'a>(bytes: &'a [u8], magic: &[u8; 4], entry: usize) -> Option<(u64, &'a [u8])> {
    let rest = bytes.strip_prefix(magic.as_slice())?;
    if rest.len() < HEADER - 4 {
        return None;
    }
    let version = u64::from_le_bytes(arr8(rest, 0));
    let n = u32::from_le_bytes(arr4(rest, 8)) as usize;
    let body = &rest[12..];
    (body.len() == n.saturating_mul(entry)).then_some((version, body))
}

fn arr8(b: &[u8], at: usize) -> [u8; 8] {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    a
}

fn arr4(b: &[u8], at: usize) -> [u8; 4] {
    let mut a = [0u8; 4];
    if let Some(s) = b.get(at..at + 4) {
        a.copy_from_slice(s);
    }
    a
}

/// A change to a pod's in-flight counts (the filter may queue it before writing it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Completion {
    /// The first response byte arrived: prefill of `prefill_tokens` done.
    FirstByte { pod_key: u64, prefill_tokens: u32 },
    /// The request of `sequences` ended; `in_prefill` carries its prefill tokens if no byte
    /// came back first.
    Finished {
        pod_key: u64,
        sequences: u32,
        tokens: u32,
        in_prefill: Option<u32>,
    },
}

impl Completion {
    /// Applies it to `table`; false if the pod is gone from it (nothing to undo).
    pub fn apply(self, table: &mut LoadTable) -> bool {
        match self {
            Completion::FirstByte {
                pod_key,
                prefill_tokens,
            } => table.first_byte(pod_key, prefill_tokens),
            Completion::Finished {
                pod_key,
                sequences,
                tokens,
                in_prefill,
            } => table.finish(pod_key, sequences, tokens, in_prefill),
        }
    }
}

/// A request counted against a pod (by [`LoadTable::add`]) until it ends: what to undo.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight {
    pub pool: std::sync::Arc<str>,
    pub pod_key: u64,
    /// The request's sequences ([`crate::request::InferenceRequest::sequences`]).
    pub sequences: u32,
    pub tokens: u32,
    /// Tokens the pod must prefill (not in its prefix cache as far as we know).
    pub prefill_tokens: u32,
    /// No response byte yet: the request is still queued or prefilling. Only streamed requests
    /// start so: a buffered response's first byte is its last, so the end of its prefill is not
    /// observable and it is not counted in prefill.
    pub in_prefill: bool,
}

impl InFlight {
    /// The first response byte arrived (the first streamed chunk is the first token): the
    /// change to make, once per request.
    pub fn first_byte(&mut self) -> Option<Completion> {
        if !self.in_prefill {
            return None;
        }
        self.in_prefill = false;
        Some(Completion::FirstByte {
            pod_key: self.pod_key,
            prefill_tokens: self.prefill_tokens,
        })
    }

    /// The request ended: the change that takes it out of the table.
    pub fn finished(&self) -> Completion {
        Completion::Finished {
            pod_key: self.pod_key,
            sequences: self.sequences,
            tokens: self.tokens,
            in_prefill: self.in_prefill.then_some(self.prefill_tokens),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip() {
        let mut t = LoadTable::default();
        t.rebase(3, &[11, 22]);
        t.add(1, 1, 500, Some(500));
        let back = LoadTable::decode(&t.encode());
        assert_eq!(back, t);
        assert_eq!(back.pods[1].delta(), 1);
        assert_eq!(back.pods[1].delta_tokens(), 500);
    }

    #[test]
    fn idle_until_a_request_is_counted_and_again_once_it_finished() {
        let mut t = LoadTable::zeroed(3, &[11, 22]);
        assert!(t.is_idle());
        t.add(1, 2, 500, Some(500));
        assert!(!t.is_idle());
        // A new snapshot that counts it keeps it in flight: only its end makes the table idle.
        t.rebase(4, &[11, 22]);
        assert!(!t.is_idle());
        assert!(t.finish(22, 2, 500, Some(500)));
        assert!(t.is_idle());
    }

    fn sparse(t: &LoadTable) -> SparseTable {
        SparseTable::decode(&t.encode_sparse())
    }

    /// `peers` summed, as a dense table (what a worker's view adds them to).
    fn summed(peers: &PeerTables, version: u64, keys: &[u64], previous: Option<u64>) -> LoadTable {
        let mut t = LoadTable::zeroed(version, keys);
        assert!(t.add_sparse(&peers.sum(version, keys, previous)));
        t
    }

    fn table(version: u64, keys: &[u64], inflight: &[u32]) -> LoadTable {
        let mut t = LoadTable::zeroed(version, keys);
        for (p, n) in t.pods.iter_mut().zip(inflight) {
            p.inflight = *n;
        }
        t
    }

    #[test]
    fn peer_tables_sum_what_was_read_in_earlier_exchanges_too() {
        let keys = [1, 2];
        let mut peers = PeerTables::default();
        // Exchange 1 reads worker 3, exchange 2 worker 5: the sum holds both.
        peers.store(3, Some(sparse(&table(7, &keys, &[2, 0]))));
        peers.store(5, Some(sparse(&table(7, &keys, &[1, 4]))));
        let sum = summed(&peers, 7, &keys, None);
        assert_eq!(
            sum.pods.iter().map(|p| p.inflight).collect::<Vec<_>>(),
            vec![3, 4]
        );
        // A newer read of worker 3 replaces its older one instead of adding to it.
        peers.store(3, Some(sparse(&table(7, &keys, &[0, 1]))));
        let sum = summed(&peers, 7, &keys, None);
        assert_eq!(
            sum.pods.iter().map(|p| p.inflight).collect::<Vec<_>>(),
            vec![1, 5]
        );
        assert_eq!(peers.len(), 2);
    }

    #[test]
    fn peer_tables_forget_workers_that_left_or_published_nothing() {
        let keys = [1];
        let mut peers = PeerTables::default();
        for id in [0, 1, 2] {
            peers.store(id, Some(sparse(&table(7, &keys, &[10]))));
        }
        peers.store(1, None);
        assert_eq!(summed(&peers, 7, &keys, None).pods[0].inflight, 20);
        peers.retain_live(&[2, 9]);
        assert_eq!(summed(&peers, 7, &keys, None).pods[0].inflight, 10);
        peers.retain_live(&[]);
        assert!(peers.is_empty());
        assert_eq!(summed(&peers, 7, &keys, None), LoadTable::zeroed(7, &keys));
    }

    #[test]
    fn peer_tables_of_an_older_snapshot_count_only_as_the_previous_one() {
        let keys = [1];
        let mut peers = PeerTables::default();
        peers.store(0, Some(sparse(&table(6, &keys, &[1]))));
        peers.store(1, Some(sparse(&table(5, &keys, &[100]))));
        peers.store(2, Some(sparse(&table(7, &keys, &[10]))));
        // Version 7 now, 6 the one before: version 5's table is a worker long gone.
        assert_eq!(summed(&peers, 7, &keys, Some(6)).pods[0].inflight, 11);
    }

    #[test]
    fn rebase_carries_counts_by_key_and_resets_deltas() {
        let mut t = LoadTable::default();
        t.rebase(1, &[1, 2, 3]);
        t.add(0, 1, 10, Some(10));
        t.add(2, 1, 30, Some(30));
        t.add(2, 1, 30, Some(30));
        assert!(t.rebase(2, &[3, 4, 1]));
        assert_eq!(t.pods.iter().map(|p| p.key).collect::<Vec<_>>(), [3, 4, 1]);
        assert_eq!(t.pods[0].inflight, 2);
        assert_eq!(t.pods[0].delta(), 0);
        assert_eq!(t.pods[2].inflight, 1);
        assert!(!t.rebase(2, &[3, 4, 1]), "already aligned");
        // A request counted by the snapshot finishes: the delta goes negative.
        assert!(t.first_byte(3, 30));
        assert_eq!((t.pods[0].prefill, t.pods[0].prefill_tokens), (1, 30));
        assert!(t.finish(3, 1, 30, None));
        assert_eq!(t.pods[0].delta(), -1);
        assert!(t.finish(3, 1, 30, Some(30)));
        assert_eq!((t.pods[0].prefill, t.pods[0].inflight), (0, 0));
        assert!(!t.finish(99, 1, 1, Some(1)));
    }

    #[test]
    fn tables_of_the_same_snapshot_add_up_by_pod() {
        // Two workers, each with its own requests; the second lists the pods in another order.
        let mut a = LoadTable::default();
        a.rebase(4, &[1, 2]);
        a.add(0, 1, 100, Some(60));
        let mut b = LoadTable::default();
        b.rebase(4, &[2, 1]);
        b.add(1, 1, 10, None);
        b.add(0, 1, 5, Some(5));
        let mut sum = LoadTable::zeroed(4, &[1, 2]);
        assert!(sum.add_table(&a, None) && sum.add_table(&b, None));
        assert_eq!((sum.pods[0].delta(), sum.pods[0].delta_tokens()), (2, 110));
        assert_eq!((sum.pods[0].prefill, sum.pods[0].prefill_tokens), (1, 60));
        assert_eq!((sum.pods[1].delta(), sum.pods[1].prefill_tokens), (1, 5));
        // A worker gone with an older snapshot does not count; one still on the snapshot just
        // before does.
        let mut old = LoadTable::default();
        old.rebase(2, &[1, 2]);
        old.add(0, 1, 1_000, Some(1_000));
        assert!(!sum.add_table(&old, Some(3)));
        assert_eq!(sum.pods[0].delta(), 2);
        let mut late = LoadTable::default();
        late.rebase(3, &[2, 1]);
        late.add(1, 1, 7, None);
        let mut with_late = sum.clone();
        assert!(with_late.add_table(&late, Some(3)));
        assert_eq!(with_late.pods[0].delta(), 3);
        // Deltas of different workers add up like one table's: a request the snapshot counted
        // finishing in one worker offsets one sent by another.
        let mut c = LoadTable::default();
        c.rebase(3, &[1, 2]);
        c.add(1, 1, 7, None);
        c.rebase(4, &[1, 2]);
        assert!(c.finish(2, 1, 7, None));
        assert!(sum.add_table(&c, None));
        assert_eq!(sum.pods[1].delta(), 0);
        // A reader that was idle went from version 2 straight to 4: a worker on 3, which that
        // reader never installed, counts; one on 1 (gone) does not.
        let mut skipped = LoadTable::zeroed(4, &[1, 2]);
        assert!(skipped.add_table(&late, Some(2)));
        assert_eq!(skipped.pods[0].delta(), 1);
        let mut gone = LoadTable::default();
        gone.rebase(1, &[1, 2]);
        assert!(!skipped.add_table(&gone, Some(2)));
        // After versions went back (10 before, 4 now), only version 4 counts.
        assert!(!LoadTable::zeroed(4, &[1, 2]).add_table(&late, Some(10)));
        assert!(!LoadTable::zeroed(4, &[1, 2]).add_table(&old, Some(10)));
    }

    #[test]
    fn sparse_tables_carry_only_the_pods_with_a_count() {
        let keys: Vec<u64> = (100..1_100).collect();
        let mut t = LoadTable::zeroed(4, &keys);
        t.add(7, 1, 300, Some(300));
        t.add(900, 2, 50, None);
        let bytes = t.encode_sparse();
        assert_eq!(bytes.len(), HEADER + 2 * SPARSE_ENTRY);
        let back = SparseTable::decode(&bytes);
        assert_eq!(back.version, 4);
        assert_eq!(back.entries, vec![(7, t.pods[7]), (900, t.pods[900])]);
        // A pod whose requests all ended since the snapshot still carries its base (the
        // snapshot counted them): the others must see its negative delta.
        t.rebase(5, &keys);
        assert!(t.finish(107, 1, 300, Some(300)));
        let back = SparseTable::decode(&t.encode_sparse());
        assert_eq!(back.entries.len(), 2);
        assert_eq!(back.entries[0].1.delta(), -1);
        // An earlier build's dense table reads as the same entries.
        assert_eq!(SparseTable::decode(&t.encode()), back);
        // Added to a view, as the dense table was.
        let mut view = LoadTable::zeroed(5, &keys);
        assert!(view.add_sparse(&back));
        let mut dense = LoadTable::zeroed(5, &keys);
        assert!(dense.add_table(&t, None));
        assert_eq!(view, dense);
        // Of another snapshot: not added.
        let mut other = LoadTable::zeroed(6, &keys);
        assert!(!other.add_sparse(&back));
        assert!(other.is_idle());
    }

    #[test]
    fn garbage_decodes_to_an_empty_table() {
        assert_eq!(SparseTable::decode(b"GPL3\x01"), SparseTable::default());
        let mut t = LoadTable::zeroed(1, &[1, 2]);
        t.add(1, 1, 1, None);
        let mut bytes = t.encode_sparse();
        bytes.pop();
        assert_eq!(SparseTable::decode(&bytes), SparseTable::default());
        // A count of entries past the body (a length that would overflow) reads as nothing.
        let mut huge = t.encode_sparse();
        huge[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(SparseTable::decode(&huge), SparseTable::default());
        assert_eq!(LoadTable::decode(b""), LoadTable::default());
        assert_eq!(LoadTable::decode(b"GPL2\x01"), LoadTable::default());
        let mut t = LoadTable::default();
        t.rebase(1, &[1]);
        let mut bytes = t.encode();
        bytes.pop();
        assert_eq!(LoadTable::decode(&bytes), LoadTable::default());
    }

    proptest! {
        #[test]
        fn rebase_carries_each_pods_counts_whatever_the_new_order(
            old in proptest::collection::btree_set(1u64..40, 0..20),
            new in proptest::collection::vec(1u64..40, 0..20),
            shift in 0usize..20,
        ) {
            // Distinct new keys (a snapshot's pods are), in any order, some kept in place.
            let mut seen = std::collections::HashSet::new();
            let mut new: Vec<u64> = new.into_iter().filter(|k| seen.insert(*k)).collect();
            let mut old: Vec<u64> = old.into_iter().collect();
            let n = old.len();
            if n > 0 {
                old.rotate_left(shift % n);
            }
            let mut t = LoadTable::default();
            t.rebase(1, &old);
            for (i, &k) in old.iter().enumerate() {
                for _ in 0..k % 3 {
                    t.add(i, 1, k as u32, Some(1));
                }
            }
            let before = t.clone();
            if new.len() > 2 {
                new.swap(0, 1);
            }
            t.rebase(2, &new);
            for (p, &k) in t.pods.iter().zip(&new) {
                let want = before.pods.iter().find(|o| o.key == k).map_or(0, |o| o.inflight);
                prop_assert_eq!(p.key, k);
                prop_assert_eq!((p.inflight, p.base), (want, want));
            }
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = LoadTable::decode(&bytes);
            let _ = SparseTable::decode(&bytes);
            let mut sparse = b"GPL3".to_vec();
            sparse.extend_from_slice(&bytes);
            let _ = SparseTable::decode(&sparse);
        }

        /// The sparse tables sum to what the dense ones did, whatever the tables' versions and
        /// layouts: each peer's table dense and added pod by pod (the exchange before the sparse
        /// form) against its sparse form summed by index.
        #[test]
        fn sparse_tables_sum_as_the_dense_ones(
            peers in proptest::collection::vec(
                (5u64..9, proptest::collection::vec((0u32..3, 0u32..2, 0u32..500), 6), any::<bool>()),
                0..5),
            previous in proptest::option::of(5u64..9),
        ) {
            let keys: Vec<u64> = (1..=6).collect();
            let version = 8;
            let mut dense = LoadTable::zeroed(version, &keys);
            let mut held = PeerTables::default();
            for (id, (v, counts, reversed)) in peers.iter().enumerate() {
                let mut layout = keys.clone();
                if *reversed {
                    layout.reverse();
                }
                let mut t = LoadTable::zeroed(*v, &layout);
                for (p, (inflight, prefill, tokens)) in t.pods.iter_mut().zip(counts) {
                    p.inflight = *inflight;
                    p.base = inflight / 2;
                    p.tokens = *tokens;
                    p.add_prefill(*prefill, tokens / 2);
                }
                dense.add_table(&LoadTable::decode(&t.encode()), previous);
                held.store(id as u32, Some(sparse(&t)));
            }
            prop_assert_eq!(summed(&held, version, &keys, previous), dense);
        }

        #[test]
        fn finishing_everything_sent_returns_to_zero(sends in proptest::collection::vec((0usize..4, 1u32..300, 0u32..1000), 0..50)) {
            let keys = [5u64, 6, 7, 8];
            let mut t = LoadTable::default();
            t.rebase(1, &keys);
            for (i, seqs, tok) in &sends { t.add(*i, *seqs, *tok, Some(*tok / 2)); }
            t.rebase(2, &keys);
            for (n, (i, seqs, tok)) in sends.iter().enumerate() {
                // Half get a first byte before they finish, half fail before any byte.
                if n % 2 == 0 { t.first_byte(keys[*i], *tok / 2); }
                t.finish(keys[*i], *seqs, *tok, (n % 2 == 1).then_some(*tok / 2));
            }
            for p in &t.pods {
                prop_assert_eq!(p.inflight, 0);
                prop_assert_eq!(p.tokens, 0);
                prop_assert_eq!(p.prefill, 0);
                prop_assert_eq!(p.prefill_tokens, 0);
                prop_assert!(p.delta() <= 0);
            }
        }
    }

    #[test]
    fn in_flight_undoes_exactly_what_was_added() {
        let mut t = LoadTable::default();
        t.rebase(1, &[7, 9]);
        t.add(0, 1, 100, Some(80));
        let mut f = InFlight {
            pool: "p".into(),
            pod_key: 7,
            sequences: 1,
            tokens: 100,
            prefill_tokens: 80,
            in_prefill: true,
        };
        let first = f.first_byte();
        assert!(first.is_some_and(|op| op.apply(&mut t)));
        assert_eq!(f.first_byte(), None, "the first byte counts once");
        assert_eq!((t.pods[0].prefill, t.pods[0].prefill_tokens), (0, 0));
        assert!(f.finished().apply(&mut t));
        assert_eq!((t.pods[0].inflight, t.pods[0].tokens), (0, 0));
        // Ended before any byte came back: its prefill is undone too; a request of 8 sequences
        // counts 8 until it ends.
        let g = InFlight {
            pod_key: 9,
            sequences: 8,
            tokens: 50,
            prefill_tokens: 50,
            in_prefill: true,
            ..f
        };
        t.count(1, &g);
        assert_eq!(t.pods[1].delta(), 8);
        assert!(g.finished().apply(&mut t));
        assert_eq!(
            t.pods[1],
            PodLoad {
                key: 9,
                ..PodLoad::default()
            }
        );
    }
}
