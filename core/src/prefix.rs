//! Prefix-cache affinity without a central index.
//!
//! A prompt is cut into blocks of `block_chars` bytes (16 tokens x ~4 characters: one vLLM KV
//! block) and hashed as a chain seeded by the model, so the hash at a depth stands for the whole
//! prefix up to it, like the engines' own block hashes. Only the depths of a geometric grid are
//! hashed (the anchors, see [`prompt_anchors`]). The prompt's hashes are xxh64, not xxh3: in the
//! filter's wasm32 build xxh3 runs its inputs of up to 240 bytes (the first anchors' segments)
//! through 128-bit multiplies, a library call each there; through Envoy a request costs ~2,000
//! fewer instructions with xxh64 (`make bench-envoy-instr`, one build against the other).
//!
//! Two mechanisms decide where a prefix goes:
//! - **Rendezvous (HRW) home.** The hash of the prompt's first `home_blocks` blocks ranks the
//!   pool's pods by `mix64(hash ^ pod)`; the top candidate is the prefix's home. It is a pure
//!   function of the prompt and the candidate set, so every Envoy worker and every gateway
//!   replica sends a new conversation to the same pod without sharing any state.
//! - **A learned index.** After each pick the request's anchors (hashes at a geometric grid of
//!   depths: 1, 2, 3, 4, 6, 8, 12, 16, ...) are recorded against the chosen pod, so a later
//!   request that shares a prefix with it finds the pod that holds the longest match even when
//!   load moved that earlier request away from its home. Workers exchange their records through
//!   Envoy shared data on a timer ([`SyncLog`]), so every worker of a gateway learns what the
//!   others sent.
//!
//! The geometric grid keeps a request's work at ~2 log2(n) map operations instead of n, and loses
//! at most a third of a match's depth to quantisation.

use crate::idmap::Generations;
use crate::rng::mix64;
use xxhash_rust::xxh3::xxh3_64_with_seed;
use xxhash_rust::xxh64::xxh64;

/// Seed of the hash chain: prefixes of different models (or adapters, whose KV differs) never
/// collide.
pub fn model_seed(model: &str) -> u64 {
    xxh64(model.as_bytes(), 0x6770_7572_6f75_7465)
}

/// Stable 64-bit key of a pod address; survives snapshot changes that reorder pods.
pub fn pod_key(address: &str) -> u64 {
    // Never 0: 0 marks an empty slot in the index.
    xxh3_64_with_seed(address.as_bytes(), 0x706f_6473).max(1)
}

/// Rendezvous weight of `pod` for `key`; the highest weight wins.
#[inline]
pub fn hrw_weight(key: u64, pod: u64) -> u64 {
    mix64(key ^ mix64(pod))
}

/// Weighted rendezvous score (Schindelhauer & Schomaker, "Weighted distributed hash tables",
/// SPAA 2005): `w / -ln(u)` with `u` the pod's uniform hash for `key`. Each pod is the winner
/// for a share of keys proportional to its weight, and removing a pod moves only its own keys.
#[inline]
pub fn weighted_hrw(key: u64, pod: u64, weight: f64) -> f64 {
    // u in (0, 1]: never 0, so -ln(u) is finite.
    let u = ((hrw_weight(key, pod) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    weighted_score(u, weight)
}

/// `weight / -ln(u)` for `u` in (0, 1]. Written `0.0 - ln(u)`: at `u = 1`, `ln(u)` is `+0.0`,
/// and `-(+0.0)` is `-0.0`, which would make the top draw the bottom score (`-inf`); `0.0 -
/// 0.0` is `+0.0`, so it scores `+inf`, the top. Elsewhere the two are the same number.
#[inline]
fn weighted_score(u: f64, weight: f64) -> f64 {
    weight / (0.0 - u.ln())
}

/// A recorded depth and the chain hash at that depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    /// Blocks from the start of the prompt (1-based).
    pub depth: u32,
    pub hash: u64,
}

/// The grid depths 1, 2, 3, 4, 6, 8, 12, 16, ... up to `n`, shallowest first.
fn grid(n: usize) -> impl Iterator<Item = usize> {
    let powers = std::iter::successors(Some(2usize), |p| p.checked_mul(2));
    std::iter::once(1)
        .chain(
            powers
                .take_while(move |p| *p <= n)
                .flat_map(|p| [p, p + p / 2]),
        )
        .filter(move |d| *d <= n)
}

/// A prompt's anchors: the chain hash at each grid depth ([`grid`]), shallowest first, seeded by
/// `seed`. Returns the number of full blocks of `block_chars` bytes, at most `max_blocks` (a
/// trailing partial block is not cached by engines either).
///
/// The chain runs over the grid's segments (blocks 1, 2, 3, 4, 5-6, 7-8, 9-12, ...), not block by
/// block: an anchor still stands for the whole prefix up to its depth, and two prompts share an
/// anchor exactly when they share every block up to it. A 4 KB prompt is 12 hash calls over
/// growing inputs instead of 64 over single blocks (about a third of the time in V8).
pub fn prompt_anchors(
    text: &[u8],
    seed: u64,
    block_chars: usize,
    max_blocks: usize,
    out: &mut Vec<Anchor>,
) -> usize {
    out.clear();
    let Some(n) = text.len().checked_div(block_chars) else {
        return 0;
    };
    let n = n.min(max_blocks);
    // The grid has at most two depths per power of two up to n: one allocation, not three.
    if n > 0 {
        out.reserve(2 * (usize::BITS - n.leading_zeros()) as usize);
    }
    let mut h = seed;
    let mut from = 0;
    for depth in grid(n) {
        let to = depth * block_chars;
        h = xxh64(text.get(from..to).unwrap_or_default(), h);
        out.push(Anchor {
            depth: depth as u32,
            hash: h,
        });
        from = to;
    }
    n
}

/// The hash that picks an unstructured prompt's rendezvous home: its anchor at the largest power
/// of two <= `min(depth, home_blocks)`. Quantising keeps the home of a growing prompt (a
/// completion that is extended turn after turn) stable except when its length doubles.
pub fn home_key(anchors: &[Anchor], home_blocks: usize) -> Option<u64> {
    let d = (anchors.last()?.depth as usize).min(home_blocks);
    if d == 0 {
        return None;
    }
    let d = 1u32 << (usize::BITS - 1 - d.leading_zeros());
    anchors.iter().find(|a| a.depth == d).map(|a| a.hash)
}

/// The rendezvous key of a conversation (see `request::InferenceRequest::conversation_len`).
pub fn conversation_key(text: &[u8], seed: u64) -> u64 {
    xxh64(text, seed ^ 0x636f_6e76)
}

/// Keys of a conversation's turns, from its prompt text (`request::InferenceRequest::prompt`):
/// `(history, state)`. `state` stands for the whole text and is recorded against the pod the
/// turn goes to; `history` for its first `history_len` bytes (the previous turn's text, see
/// `request::InferenceRequest::history_len`) and is looked up: the next turn finds the pods that
/// hold this conversation's history, not those of any conversation that opens alike.
///
/// Each key is the conversation's (`conversation`, which covers its opening), the length, and
/// the last [`TURN_TAIL`] bytes: two histories of one opening with the same length and the same
/// last 128 bytes are all but the same history. Hashing the whole text instead cost ~7,000
/// Envoy instructions on a 4 KB chat request (callgrind), 2.4% of its cost, for no better an
/// answer in practice.
pub fn turn_keys(text: &[u8], history_len: Option<usize>, conversation: u64) -> (Option<u64>, u64) {
    let key = |end: usize| {
        let end = end.min(text.len());
        let tail = text
            .get(end.saturating_sub(TURN_TAIL)..end)
            .unwrap_or_default();
        xxh64(
            tail,
            conversation ^ TURN_DOMAIN ^ (end as u64).rotate_left(32),
        )
    };
    (history_len.map(key), key(text.len()))
}

/// How much of a turn's end [`turn_keys`] reads (bytes).
const TURN_TAIL: usize = 128;

/// Seed domain of [`turn_keys`]: no anchor, conversation or adapter key is the same by accident.
const TURN_DOMAIN: u64 = 0x7475_726e;

/// Pods known to hold one anchor; 4 is plenty (a prefix on more pods is hot everywhere).
const PODS_PER_ANCHOR: usize = 4;

#[derive(Debug, Clone, Copy, Default)]
struct PodSet {
    pods: [u64; PODS_PER_ANCHOR],
    stamps: [u64; PODS_PER_ANCHOR],
}

impl PodSet {
    fn insert(&mut self, pod: u64, stamp: u64) {
        let mut slot = 0;
        for i in 0..PODS_PER_ANCHOR {
            if self.pods[i] == pod {
                self.stamps[i] = stamp;
                return;
            }
            // Prefer an empty slot, else the oldest.
            if self.pods[i] == 0 && self.pods[slot] != 0 || self.stamps[i] < self.stamps[slot] {
                slot = i;
            }
        }
        self.pods[slot] = pod;
        self.stamps[slot] = stamp;
    }
}

/// Per-worker map from anchor hash to the pods recently sent that prefix. Bounded: two
/// generations of `capacity / 2` entries ([`Generations`]).
pub struct PrefixIndex {
    map: Generations<PodSet>,
    stamp: u64,
}

/// How deep a pod's match goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodMatch {
    pub pod: u64,
    /// Matched leading blocks.
    pub depth: u32,
}

impl PrefixIndex {
    pub fn new(capacity: usize) -> Self {
        PrefixIndex {
            // Grows on demand: a plugin instance that never routes costs nothing.
            map: Generations::new((capacity / 2).max(8)),
            stamp: 0,
        }
    }

    /// Records that `pod` was sent a prompt with these anchors.
    pub fn record(&mut self, anchors: &[u64], pod: u64) {
        self.stamp += 1;
        for &a in anchors {
            self.map.entry(a).insert(pod, self.stamp);
        }
    }

    /// For each pod that holds any anchor of the prompt, its deepest anchor. Sorted by depth,
    /// deepest first.
    pub fn lookup(&self, anchors: &[Anchor], out: &mut Vec<PodMatch>) {
        out.clear();
        for a in anchors.iter().rev() {
            let Some(set) = self.map.get(a.hash) else {
                continue;
            };
            for &pod in set.pods.iter().filter(|p| **p != 0) {
                if !out.iter().any(|m| m.pod == pod) {
                    out.push(PodMatch {
                        pod,
                        depth: a.depth,
                    });
                }
            }
        }
    }

    /// Pods recorded under one key (e.g. a conversation key).
    pub fn pods_of(&self, key: u64) -> Vec<u64> {
        self.map
            .get(key)
            .map(|s| s.pods.iter().copied().filter(|p| *p != 0).collect())
            .unwrap_or_default()
    }

    /// The pod most recently recorded under a key.
    pub fn latest_pod_of(&self, key: u64) -> Option<u64> {
        let set = self.map.get(key)?;
        (0..PODS_PER_ANCHOR)
            .filter(|i| set.pods[*i] != 0)
            .max_by_key(|i| set.stamps[*i])
            .map(|i| set.pods[i])
    }

    /// Entries held (both generations).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One routing decision as exchanged between workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyncRecord {
    pub seq: u64,
    pub pod: u64,
    pub anchors: Vec<u64>,
}

const SYNC_MAGIC: &[u8; 4] = b"GPX1";

/// A worker's outgoing ring of recent decisions. The owner is the only writer of its shared-data
/// key, so publishing needs no compare-and-swap loop; readers remember the last `seq` they
/// applied from each worker.
#[derive(Debug, Clone)]
pub struct SyncLog {
    records: std::collections::VecDeque<SyncRecord>,
    next_seq: u64,
    cap: usize,
}

impl SyncLog {
    pub fn new(cap: usize) -> Self {
        SyncLog {
            records: Default::default(),
            next_seq: 1,
            cap: cap.max(1),
        }
    }

    pub fn push(&mut self, pod: u64, anchors: &[u64]) {
        // A full ring reuses its oldest record's list: no allocation per request once full.
        let mut list = if self.records.len() == self.cap {
            self.records
                .pop_front()
                .map(|r| r.anchors)
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        list.clear();
        list.extend_from_slice(anchors);
        self.records.push_back(SyncRecord {
            seq: self.next_seq,
            pod,
            anchors: list,
        });
        self.next_seq += 1;
    }

    /// Numbers the records from `base + 1` on (never backwards): a worker that took an id
    /// another worker held before sequences after it (`workers::seq_base`).
    pub fn start_after(&mut self, base: u64) {
        self.next_seq = self.next_seq.max(base.saturating_add(1));
    }

    /// Sequence number of the newest record (0 if none).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    pub fn encode(&self) -> Vec<u8> {
        self.encode_after(0)
    }

    /// The ring's records newer than `after`, encoded as [`SyncLog::encode`] does: what a
    /// writer publishes when its readers have seen everything up to `after`.
    pub fn encode_after(&self, after: u64) -> Vec<u8> {
        encode_records(self.records.iter().filter(|r| r.seq > after))
    }

    /// The records of the ring newer than `after` (oldest first).
    pub fn records_after(&self, after: u64) -> impl Iterator<Item = &SyncRecord> {
        self.records.iter().filter(move |r| r.seq > after)
    }

    /// Decodes another worker's ring, keeping records newer than `after`. Malformed input yields
    /// the records decoded before the fault: it is only a hint.
    pub fn decode_after(bytes: &[u8], after: u64, out: &mut Vec<SyncRecord>) {
        out.clear();
        let Some(records) = raw_records(bytes) else {
            return;
        };
        // Up to the first record cut short; older records' anchors are never decoded.
        for r in records.map_while(Result::ok) {
            if r.seq > after {
                out.push(r.record());
            }
        }
    }
}

/// Encodes records as [`SyncLog::encode`] does: `GPX1`, then per record its sequence and pod
/// (u64 each), the number of anchors (u8, at most 255 kept) and the anchors (u64 each), all
/// little-endian.
pub fn encode_records<'a>(records: impl Iterator<Item = &'a SyncRecord> + Clone) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + records.clone().count() * 96);
    out.extend_from_slice(SYNC_MAGIC);
    for r in records {
        append_record(&mut out, r);
    }
    out
}

/// Appends one record to an encoding that starts with `GPX1`.
pub fn append_record(out: &mut Vec<u8>, r: &SyncRecord) {
    out.extend_from_slice(&r.seq.to_le_bytes());
    out.extend_from_slice(&r.pod.to_le_bytes());
    let n = r.anchors.len().min(255);
    out.push(n as u8);
    for a in &r.anchors[..n] {
        out.extend_from_slice(&a.to_le_bytes());
    }
}

/// Decodes records that came from outside this Envoy (another gateway replica, through
/// `sidecar-metrics`): unlike [`SyncLog::decode_after`], anything malformed refuses the whole
/// body, naming the fault, and so do more than `max_records` records.
pub fn decode_records(bytes: &[u8], max_records: usize) -> Result<Vec<SyncRecord>, String> {
    let Some(records) = raw_records(bytes) else {
        return Err("prefix records must start with GPX1".into());
    };
    let mut out = Vec::new();
    for r in records {
        if out.len() == max_records {
            return Err(format!("more than {max_records} prefix records"));
        }
        let Ok(r) = r else {
            return Err(format!("prefix record {} is truncated", out.len()));
        };
        out.push(r.record());
    }
    Ok(out)
}

/// The records of an encoding newer than `after`, each as (sequence, its bytes as encoded), up
/// to the first record cut short: what [`SyncLog::decode_after`] decodes, left encoded.
pub(crate) fn encoded_after(bytes: &[u8], after: u64) -> impl Iterator<Item = (u64, &[u8])> {
    raw_records(bytes)
        .into_iter()
        .flatten()
        .map_while(Result::ok)
        .filter(move |r| r.seq > after)
        .map(|r| (r.seq, r.bytes))
}

/// One record of an encoding, its anchors not decoded yet.
struct RawRecord<'a> {
    /// The whole record as encoded.
    bytes: &'a [u8],
    seq: u64,
    pod: u64,
    /// `8 * n` bytes: the anchors, little-endian.
    anchors: &'a [u8],
}

impl RawRecord<'_> {
    fn record(&self) -> SyncRecord {
        SyncRecord {
            seq: self.seq,
            pod: self.pod,
            anchors: self
                .anchors
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(take8(c, 0)))
                .collect(),
        }
    }
}

/// The records of an encoding ([`encode_records`]) in order, `None` without the `GPX1` magic;
/// a record cut short comes as `Err(())`, and nothing after it.
fn raw_records(bytes: &[u8]) -> Option<impl Iterator<Item = Result<RawRecord<'_>, ()>>> {
    let mut rest = bytes.strip_prefix(SYNC_MAGIC.as_slice())?;
    Some(std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let n = rest.get(16).map_or(0, |n| usize::from(*n));
        let Some((head, tail)) = rest.split_at_checked(17 + n * 8) else {
            rest = &[];
            return Some(Err(()));
        };
        rest = tail;
        Some(Ok(RawRecord {
            bytes: head,
            seq: u64::from_le_bytes(take8(head, 0)),
            pod: u64::from_le_bytes(take8(head, 8)),
            anchors: head.get(17..).unwrap_or_default(),
        }))
    }))
}

const BOARD_MAGIC: &[u8; 4] = b"GPQ1";
const BOARD_ENTRY: usize = 4 + 8;

/// The newest published sequence of each worker's prefix records ([`SyncLog`]), all in one
/// shared-data value: a reader learns which workers have new records from one read, instead of
/// one read per worker. Each worker changes its own entry with a compare-and-swap when it
/// publishes, and removes it when it gives its id back.
///
/// The value is `GPQ1` and (worker id u32, sequence u64) pairs, little-endian, ascending by id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncBoard {
    entries: Vec<(u32, u64)>,
}

impl SyncBoard {
    /// Decodes the shared-data value. Anything malformed yields the entries before the fault (it
    /// only says which rings to read), at most [`crate::workers::MAX_WORKERS`] + 1 of them.
    pub fn decode(bytes: &[u8]) -> SyncBoard {
        let mut entries = Vec::new();
        let Some(rest) = bytes.strip_prefix(BOARD_MAGIC.as_slice()) else {
            return SyncBoard { entries };
        };
        // Every worker id, and the slot of the records imported from other gateway replicas
        // (`exchange::IMPORT_ID`).
        for e in rest
            .chunks_exact(BOARD_ENTRY)
            .take(crate::workers::MAX_WORKERS as usize + 1)
        {
            let mut id = [0u8; 4];
            id.copy_from_slice(&e[..4]);
            let id = u32::from_le_bytes(id);
            if entries.last().is_some_and(|(last, _)| *last >= id) {
                break;
            }
            entries.push((id, u64::from_le_bytes(take8(e, 4))));
        }
        SyncBoard { entries }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + self.entries.len() * BOARD_ENTRY);
        out.extend_from_slice(BOARD_MAGIC);
        for (id, seq) in &self.entries {
            out.extend_from_slice(&id.to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
        }
        out
    }

    /// (id, sequence) of every entry, ascending by id.
    pub fn entries(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.entries.iter().copied()
    }

    /// Worker `id`'s newest published sequence, if it published.
    pub fn get(&self, id: u32) -> Option<u64> {
        let i = self.entries.binary_search_by_key(&id, |e| e.0).ok()?;
        self.entries.get(i).map(|e| e.1)
    }

    pub fn set(&mut self, id: u32, seq: u64) {
        match self.entries.binary_search_by_key(&id, |e| e.0) {
            Ok(i) => {
                if let Some(e) = self.entries.get_mut(i) {
                    e.1 = seq;
                }
            }
            Err(i) => self.entries.insert(i, (id, seq)),
        }
    }

    /// Drops worker `id`'s entry; `false` if it had none.
    pub fn remove(&mut self, id: u32) -> bool {
        match self.entries.binary_search_by_key(&id, |e| e.0) {
            Ok(i) => {
                self.entries.remove(i);
                true
            }
            Err(_) => false,
        }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

fn take8(b: &[u8], at: usize) -> [u8; 8] {
    let mut a = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        a.copy_from_slice(s);
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn anchor_list(text: &str) -> Vec<Anchor> {
        let mut a = Vec::new();
        prompt_anchors(text.as_bytes(), model_seed("m"), 4, 64, &mut a);
        a
    }

    fn hashes(text: &str) -> Vec<u64> {
        anchor_list(text).iter().map(|a| a.hash).collect()
    }

    #[test]
    fn chain_hash_depends_on_the_whole_prefix() {
        let a = hashes("aaaabbbbcccc");
        let b = hashes("aaaabbbbdddd");
        let c = hashes("xaaabbbbcccc");
        assert_eq!(a.len(), 3);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same second block text, different first block: different hash.
        assert_ne!(a[1], c[1]);
        // Partial trailing block is not hashed.
        assert_eq!(hashes("aaaabb").len(), 1);
        // Within a multi-block segment (blocks 5-6 end at depth 6), any block counts.
        let base = "aaaabbbbccccddddeeeeffff";
        let at_5 = "aaaabbbbccccddddXeeeffff";
        let at_6 = "aaaabbbbccccddddeeeeXfff";
        let (h, h5, h6) = (hashes(base), hashes(at_5), hashes(at_6));
        assert_eq!(h.len(), 5); // depths 1, 2, 3, 4, 6
        assert_eq!(h[..4], h5[..4]);
        assert_ne!(h[4], h5[4]);
        assert_ne!(h[4], h6[4]);
        assert_ne!(h5[4], h6[4]);
    }

    #[test]
    fn model_seed_separates_models() {
        let mut a = Vec::new();
        let mut b = Vec::new();
        prompt_anchors(b"same text here..", model_seed("m1"), 4, 8, &mut a);
        prompt_anchors(b"same text here..", model_seed("m2"), 4, 8, &mut b);
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(x, y)| x.hash != y.hash));
    }

    #[test]
    fn anchor_grid_is_geometric_and_bounded() {
        let depths = |text: &str, max_blocks: usize| {
            let mut a = Vec::new();
            let n = prompt_anchors(text.as_bytes(), 1, 4, max_blocks, &mut a);
            (n, a.iter().map(|a| a.depth).collect::<Vec<u32>>())
        };
        let forty = "abcd".repeat(40);
        assert_eq!(
            depths(&forty, 64),
            (40, vec![1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
        );
        assert_eq!(depths(&forty, 12), (12, vec![1, 2, 3, 4, 6, 8, 12]));
        assert_eq!(depths("abc", 64), (0, vec![]));
        assert_eq!(depths("abcd", 64), (1, vec![1]));
        let mut a = Vec::new();
        assert_eq!(prompt_anchors(b"abcd", 1, 0, 64, &mut a), 0);
        assert!(a.is_empty());
    }

    #[test]
    fn index_finds_the_longest_shared_prefix() {
        let mut idx = PrefixIndex::new(1_000);
        idx.record(&hashes(&"conversation one ".repeat(10)), 7); // 42 blocks
        idx.record(&hashes(&"something else entirely".repeat(5)), 9);
        // A later turn: the first conversation plus more text.
        let next = anchor_list(&format!(
            "{}{}",
            "conversation one ".repeat(10),
            "and a reply".repeat(4)
        ));
        let mut m = Vec::new();
        idx.lookup(&next, &mut m);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].pod, 7);
        assert_eq!(m[0].depth, 32); // deepest grid depth <= 42 shared blocks
    }

    #[test]
    fn index_keeps_several_pods_per_anchor_and_stays_bounded() {
        let mut idx = PrefixIndex::new(64);
        let text = "shared system prompt....";
        let a = hashes(text);
        idx.record(&a, 1);
        idx.record(&a, 2);
        let mut m = Vec::new();
        idx.lookup(&anchor_list(text), &mut m);
        let mut pods: Vec<u64> = m.iter().map(|x| x.pod).collect();
        pods.sort();
        assert_eq!(pods, [1, 2]);
        assert_eq!(idx.latest_pod_of(a[0]), Some(2));
        assert_eq!(idx.latest_pod_of(12345), None);
        for i in 0..10_000u64 {
            idx.record(&[i.wrapping_mul(0x9E37_79B9_7F4A_7C15)], 3);
        }
        assert!(idx.len() <= 64, "{}", idx.len());
    }

    #[test]
    fn podset_evicts_the_oldest() {
        let mut s = PodSet::default();
        for (i, pod) in [1u64, 2, 3, 4].iter().enumerate() {
            s.insert(*pod, i as u64 + 1);
        }
        s.insert(1, 10); // refresh pod 1
        s.insert(5, 11); // evicts pod 2, the oldest
        let mut pods = s.pods.to_vec();
        pods.sort();
        assert_eq!(pods, [1, 3, 4, 5]);
    }

    #[test]
    fn home_key_uses_a_bounded_depth() {
        // Anchors of a prompt of `n` blocks whose hash at depth d is 9 + d.
        let anchors = |n: usize| -> Vec<Anchor> {
            grid(n)
                .map(|d| Anchor {
                    depth: d as u32,
                    hash: 9 + d as u64,
                })
                .collect()
        };
        assert_eq!(home_key(&anchors(20), 4), Some(13));
        assert_eq!(home_key(&anchors(20), 16), Some(25));
        assert_eq!(home_key(&anchors(2), 4), Some(11));
        // 3, 5, 6 and 7 blocks round down to a power of two: a growing prompt keeps its home.
        assert_eq!(home_key(&anchors(3), 16), Some(11));
        assert_eq!(home_key(&anchors(7), 16), Some(13));
        assert_eq!(home_key(&anchors(0), 4), None);
        assert_eq!(home_key(&anchors(5), 0), None);
    }

    #[test]
    fn sync_log_round_trips_and_filters_by_seq() {
        let mut log = SyncLog::new(3);
        log.push(1, &[10, 11]);
        log.push(2, &[20]);
        log.push(3, &[]);
        log.push(4, &[40, 41, 42]); // evicts seq 1
        let bytes = log.encode();
        let mut out = Vec::new();
        SyncLog::decode_after(&bytes, 0, &mut out);
        assert_eq!(out.iter().map(|r| r.seq).collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(out[2].anchors, [40, 41, 42]);
        SyncLog::decode_after(&bytes, 3, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(log.last_seq(), 4);
        // Only the records newer than what readers have seen, in the same format.
        SyncLog::decode_after(&log.encode_after(2), 0, &mut out);
        assert_eq!(out.iter().map(|r| r.seq).collect::<Vec<_>>(), [3, 4]);
        assert_eq!(out[1].anchors, [40, 41, 42]);
        assert_eq!(log.encode_after(4), SYNC_MAGIC.to_vec());
        assert_eq!(log.encode_after(0), log.encode());
    }

    #[test]
    fn sync_board_keeps_one_entry_per_worker() {
        let mut b = SyncBoard::default();
        assert_eq!(b.get(3), None);
        b.set(7, 70);
        b.set(3, 30);
        b.set(7, 71);
        assert_eq!((b.get(3), b.get(7), b.len()), (Some(30), Some(71), 2));
        let round = SyncBoard::decode(&b.encode());
        assert_eq!(round, b);
        assert!(b.remove(3));
        assert!(!b.remove(3));
        assert_eq!((b.get(3), b.get(7)), (None, Some(71)));
        // Malformed: nothing, or the entries before the fault.
        assert!(SyncBoard::decode(b"nope").is_empty());
        let mut bytes = round.encode();
        bytes.extend_from_slice(&1u32.to_le_bytes()); // out of order, and cut short
        assert_eq!(SyncBoard::decode(&bytes), round);
        let mut out_of_order = round.encode();
        out_of_order.extend_from_slice(&2u32.to_le_bytes());
        out_of_order.extend_from_slice(&9u64.to_le_bytes());
        assert_eq!(SyncBoard::decode(&out_of_order), round);
    }

    #[test]
    fn a_new_holder_of_an_id_sequences_past_the_old_one() {
        // A reader applied the old holder's records up to 1,000; the new holder's start after
        // its base, so the reader takes them.
        let mut log = SyncLog::new(4);
        log.start_after(crate::workers::seq_base(2));
        log.push(7, &[70]);
        let mut out = Vec::new();
        SyncLog::decode_after(&log.encode(), 1_000, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].seq, crate::workers::seq_base(2) + 1);
        // Never backwards.
        log.start_after(5);
        log.push(8, &[80]);
        assert_eq!(log.last_seq(), crate::workers::seq_base(2) + 2);
    }

    #[test]
    fn the_top_draw_scores_highest() {
        // u = 1 (the hash's largest value) wins against every other draw, as ln's ordering says.
        assert_eq!(weighted_score(1.0, 2.0), f64::INFINITY);
        assert!(weighted_score(1.0 - f64::EPSILON, 2.0) > weighted_score(0.5, 2.0));
        assert!(weighted_score(0.5, 2.0) > weighted_score(0.5, 1.0));
        assert_eq!(weighted_score(0.5, 1.0), 1.0 / 2f64.ln());
    }

    proptest! {
        #[test]
        fn sync_board_agrees_with_a_map(ops in proptest::collection::vec((0u32..20, proptest::option::of(any::<u64>())), 0..60)) {
            // Each op sets a worker's sequence (Some) or removes its entry (None); the board,
            // through an encode and decode after each, holds what a map holds.
            let mut board = SyncBoard::default();
            let mut map = std::collections::BTreeMap::new();
            for (id, seq) in ops {
                match seq {
                    Some(seq) => {
                        board.set(id, seq);
                        map.insert(id, seq);
                    }
                    None => prop_assert_eq!(board.remove(id), map.remove(&id).is_some()),
                }
                board = SyncBoard::decode(&board.encode());
                for id in 0..20 {
                    prop_assert_eq!(board.get(id), map.get(&id).copied());
                }
            }
        }

        #[test]
        fn sync_board_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut with_magic = BOARD_MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            let b = SyncBoard::decode(&with_magic);
            prop_assert!(b.len() <= bytes.len() / BOARD_ENTRY);
            let _ = SyncBoard::decode(&bytes);
        }

        #[test]
        fn sync_decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let mut out = Vec::new();
            let mut with_magic = SYNC_MAGIC.to_vec();
            with_magic.extend_from_slice(&bytes);
            SyncLog::decode_after(&with_magic, 0, &mut out);
            SyncLog::decode_after(&bytes, 0, &mut out);
        }

        #[test]
        fn weighted_hrw_shares_follow_weights(seed in any::<u64>()) {
            let weights = [3.0, 1.0, 1.0];
            let mut wins = [0usize; 3];
            for k in 0..3_000u64 {
                let key = k.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ seed;
                let best = (0..3).max_by(|a, b| weighted_hrw(key, *a as u64 + 1, weights[*a])
                    .total_cmp(&weighted_hrw(key, *b as u64 + 1, weights[*b]))).unwrap();
                wins[best] += 1;
            }
            let share = wins[0] as f64 / 3_000.0;
            prop_assert!((0.55..=0.65).contains(&share), "{:?}", wins);
        }

        #[test]
        fn hrw_home_is_stable_when_other_pods_leave(key in any::<u64>(), n in 2usize..20, drop in 0usize..20) {
            let pods: Vec<u64> = (1..=n as u64).collect();
            let best = *pods.iter().max_by_key(|p| hrw_weight(key, **p)).unwrap();
            let removed = pods[drop % n];
            prop_assume!(removed != best);
            let rest: Vec<u64> = pods.iter().copied().filter(|p| *p != removed).collect();
            let best2 = *rest.iter().max_by_key(|p| hrw_weight(key, **p)).unwrap();
            prop_assert_eq!(best, best2);
        }
    }
}
