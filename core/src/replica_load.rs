//! In-flight counts between gateway replicas: what each replica has sent that is still in
//! prefill, per pod.
//!
//! The workers of one Envoy add each other's in-flight tables to their own within a
//! millisecond (`load`). Gateway replicas share no memory, and a replica that sees only its own
//! requests routes blind to the prefills the others just started: the offline replay read
//! 7-29% more mean TTFT at two or three replicas than at one gateway, and all but 0-7% of it
//! back when each replica learned the others' prefill counts within 5 ms (bench/README.md,
//! "Workers and gateway replicas").
//!
//! So each Envoy answers `GET ingest.load_path` with its own requests still in prefill, per pool
//! and pod: their number and their prompt tokens ([`ReplicaLoad`], summed over its workers'
//! published tables). `sidecar-metrics` asks every few milliseconds and posts the answer to the
//! other replicas' Envoys (`POST`, with [`REPLICA_HEADER`] naming the replica). Each Envoy keeps
//! the newest post of every replica for `ingest.load_ttl_ms` ([`ReplicaLoads`], in shared data
//! under [`STORE_KEY`]), and its workers add the fresh ones to the prefill counts of their view
//! of the pool before each pick.
//!
//! Only prefill counts travel, not the whole in-flight table: the rest of a table is counted
//! against its replica's own snapshot, which another replica's aggregator took at another
//! moment; the prefill backlog is absolute, and it is what no scrape shows (which pods are
//! prefilling how much right now). In the replay, exchanging the whole table gained no more.

use crate::bytes::ByteReader;
use crate::load::{LoadTable, PodLoad};
use crate::prefix::pod_key;

/// Header of a `POST` naming the replica (Envoy) the counts come from.
pub const REPLICA_HEADER: &str = "x-gpuroute-replica";

/// Shared-data key of the other replicas' newest counts ([`ReplicaLoads`]).
pub const STORE_KEY: &str = "gpuroute.replica_load";

const LOAD_MAGIC: &[u8; 4] = b"GPL1";
const STORE_MAGIC: &[u8; 4] = b"GPR1";
const BUNDLE_MAGIC: &[u8; 4] = b"GPB1";

/// Most pools in one replica's counts.
pub const MAX_POOLS: usize = 1_024;
/// Most pods over all pools of one replica's counts (a pod with nothing in prefill is left
/// out, so this bounds the pods busy at once, not the fleet).
pub const MAX_PODS: usize = 65_536;
/// Most replicas held.
pub const MAX_REPLICAS: usize = 256;
/// Longest pool name.
const MAX_NAME: usize = 256;
/// Longest replica name in [`REPLICA_HEADER`].
pub const MAX_REPLICA_NAME: usize = 128;

/// One pod's requests in prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodPrefill {
    /// [`pod_key`] of the pod's address.
    pub key: u64,
    pub requests: u32,
    /// Their prompt tokens (what the pod still has to prefill, as far as the sender knows).
    pub tokens: u32,
}

/// One replica's requests in prefill, per pool (by name) and pod.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaLoad {
    pub pools: Vec<(String, Vec<PodPrefill>)>,
}

impl ReplicaLoad {
    /// The prefill counts of `tables` (a pool's name with one worker's table each), summed per
    /// pool and pod; pods with nothing in prefill are left out.
    pub fn from_tables<'a>(tables: impl IntoIterator<Item = (&'a str, &'a LoadTable)>) -> Self {
        // Per pool, each pod's place in its list: a large pool's tables sum in linear time.
        let mut at: Vec<std::collections::HashMap<u64, usize>> = Vec::new();
        let mut out = ReplicaLoad::default();
        for (pool, table) in tables {
            let i = match out.pools.iter().position(|(n, _)| n == pool) {
                Some(i) => i,
                None => {
                    out.pools.push((pool.to_string(), Vec::new()));
                    at.push(std::collections::HashMap::new());
                    out.pools.len() - 1
                }
            };
            let (pods, index) = (&mut out.pools[i].1, &mut at[i]);
            for p in table.pods.iter().filter(|p| p.prefill > 0) {
                match index.get(&p.key) {
                    Some(&j) => {
                        let q = &mut pods[j];
                        q.requests = q.requests.saturating_add(p.prefill);
                        q.tokens = q.tokens.saturating_add(p.prefill_tokens);
                    }
                    None => {
                        index.insert(p.key, pods.len());
                        pods.push(PodPrefill {
                            key: p.key,
                            requests: p.prefill,
                            tokens: p.prefill_tokens,
                        });
                    }
                }
            }
        }
        out.pools.retain(|(_, pods)| !pods.is_empty());
        out
    }

    /// Pods over all pools.
    fn pods(&self) -> usize {
        self.pools.iter().map(|(_, pods)| pods.len()).sum()
    }

    /// The body of a `GET` answer (and of the `POST` that carries it on).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(8 + self.pools.len() * 64);
        b.extend_from_slice(LOAD_MAGIC);
        self.encode_pools(&mut b);
        b
    }

    fn encode_pools(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&(self.pools.len() as u32).to_le_bytes());
        for (name, pods) in &self.pools {
            b.extend_from_slice(&(name.len() as u16).to_le_bytes());
            b.extend_from_slice(name.as_bytes());
            b.extend_from_slice(&(pods.len() as u32).to_le_bytes());
            for p in pods {
                b.extend_from_slice(&p.key.to_le_bytes());
                b.extend_from_slice(&p.requests.to_le_bytes());
                b.extend_from_slice(&p.tokens.to_le_bytes());
            }
        }
    }

    /// Reads a body [`ReplicaLoad::encode`] wrote; anything else (truncated, trailing bytes,
    /// over the limits, not UTF-8 names) is refused with the reason.
    pub fn decode(bytes: &[u8]) -> Result<ReplicaLoad, &'static str> {
        let rest = bytes
            .strip_prefix(LOAD_MAGIC.as_slice())
            .ok_or("not in-flight counts (GPL1)")?;
        let mut r = ByteReader::new(rest);
        let load = Self::decode_pools(&mut r)?;
        if r.left() != 0 {
            return Err("trailing bytes after the counts");
        }
        Ok(load)
    }

    fn decode_pools(r: &mut ByteReader<'_>) -> Result<ReplicaLoad, &'static str> {
        let n = r.u32()? as usize;
        if n > MAX_POOLS {
            return Err("too many pools");
        }
        let mut pools = Vec::with_capacity(n.min(64));
        let mut total = 0usize;
        for _ in 0..n {
            let len = usize::from(r.u16()?);
            if len > MAX_NAME {
                return Err("pool name too long");
            }
            let name = std::str::from_utf8(r.take(len)?).map_err(|_| "pool name not UTF-8")?;
            let count = r.u32()? as usize;
            total = total.saturating_add(count);
            if total > MAX_PODS {
                return Err("too many pods");
            }
            // 16 bytes a pod: a count the body cannot hold is refused before allocating.
            if r.left() < count.saturating_mul(16) {
                return Err("truncated");
            }
            let mut pods = Vec::with_capacity(count);
            for _ in 0..count {
                pods.push(PodPrefill {
                    key: r.u64()?,
                    requests: r.u32()?,
                    tokens: r.u32()?,
                });
            }
            pools.push((name.to_string(), pods));
        }
        Ok(ReplicaLoad { pools })
    }
}

/// Several replicas' counts in one `POST` ([`decode_post`] reads it): what `sidecar-metrics`
/// hands an Envoy when several peers' counts came in since its last post to it, so that an
/// Envoy takes a bounded number of posts however many replicas there are (each post is a
/// request through the Envoy and a rewrite of the shared store). `entries` are replica names
/// (checked by [`replica_key`]) with the body each posted ([`ReplicaLoad::encode`]).
///
/// The layout: `GPB1`, the number of entries (u16), then per entry the name's length (u8), the
/// name, the body's length (u32) and the body. Entries past the first [`MAX_REPLICAS`], or whose
/// name or body is too long for the layout, are left out (the filter would refuse them).
pub fn encode_bundle<'a>(entries: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Vec<u8> {
    let mut b = BUNDLE_MAGIC.to_vec();
    b.extend_from_slice(&[0, 0]);
    let mut n = 0u16;
    for (name, body) in entries {
        let (Ok(name_len), Ok(body_len)) = (u8::try_from(name.len()), u32::try_from(body.len()))
        else {
            continue;
        };
        if usize::from(n) >= MAX_REPLICAS {
            break;
        }
        b.push(name_len);
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&body_len.to_le_bytes());
        b.extend_from_slice(body);
        n = n.saturating_add(1);
    }
    b[4..6].copy_from_slice(&n.to_le_bytes());
    b
}

/// What a `POST` to `ingest.load_path` carries, as (replica key, counts): one replica's counts
/// named by its [`REPLICA_HEADER`] value `header`, or a bundle ([`encode_bundle`]) whose
/// entries name themselves (the header is then not needed, and not used). Anything wrong
/// refuses the whole post, with the reason: a bad name, a bad body, more than [`MAX_REPLICAS`]
/// entries or [`MAX_PODS`] pods over all of them.
pub fn decode_post(
    header: Option<&str>,
    body: &[u8],
) -> Result<Vec<(u64, ReplicaLoad)>, &'static str> {
    let Some(entries) = bundle_entries(body) else {
        let replica = replica_key(header)?;
        return Ok(vec![(replica, ReplicaLoad::decode(body)?)]);
    };
    let entries = entries?;
    let mut out = Vec::with_capacity(entries.len());
    let mut pods = 0usize;
    for (name, body) in entries {
        let replica = replica_key(Some(name))?;
        let load = ReplicaLoad::decode(body)?;
        pods = pods.saturating_add(load.pods());
        if pods > MAX_PODS {
            return Err("too many pods");
        }
        out.push((replica, load));
    }
    Ok(out)
}

/// A bundle's entries: (replica name, body).
pub type BundleEntries<'a> = Vec<(&'a str, &'a [u8])>;

/// The entries of a bundle ([`encode_bundle`]), not checked further; `None` when `body` is not
/// a bundle.
pub fn bundle_entries(body: &[u8]) -> Option<Result<BundleEntries<'_>, &'static str>> {
    let rest = body.strip_prefix(BUNDLE_MAGIC.as_slice())?;
    let read = || {
        let mut r = ByteReader::new(rest);
        let n = usize::from(r.u16()?);
        if n > MAX_REPLICAS {
            return Err("too many replicas in the bundle");
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let name_len = usize::from(r.take(1)?[0]);
            let name =
                std::str::from_utf8(r.take(name_len)?).map_err(|_| "replica name not ASCII")?;
            let len = r.u32()? as usize;
            out.push((name, r.take(len)?));
        }
        if r.left() != 0 {
            return Err("trailing bytes after the bundle");
        }
        Ok(out)
    };
    Some(read())
}

/// Checks a [`REPLICA_HEADER`] value (1 to [`MAX_REPLICA_NAME`] visible ASCII characters) and
/// gives the replica's key.
pub fn replica_key(header: Option<&str>) -> Result<u64, &'static str> {
    let name = header.ok_or("the x-gpuroute-replica header is missing")?;
    if name.is_empty()
        || name.len() > MAX_REPLICA_NAME
        || !name.bytes().all(|c| c.is_ascii_graphic())
    {
        return Err("x-gpuroute-replica must be 1-128 visible ASCII characters");
    }
    Ok(pod_key(name))
}

/// The other replicas' newest counts, as an Envoy holds them: one entry per replica, with the
/// last instant it counts (received + `ingest.load_ttl_ms`: the ingest listener's configuration
/// knows the ttl; the routing listeners' workers that read the entries need not).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReplicaLoads {
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    replica: u64,
    expires_ms: u64,
    load: ReplicaLoad,
}

impl ReplicaLoads {
    /// Replaces `replica`'s counts with `load`, received at `now_ms` and counted for `ttl_ms`;
    /// forgets every entry no longer counted (and the oldest beyond [`MAX_REPLICAS`]).
    pub fn put(&mut self, replica: u64, load: ReplicaLoad, now_ms: u64, ttl_ms: u64) {
        self.put_all(vec![(replica, load)], now_ms, ttl_ms);
    }

    /// [`ReplicaLoads::put`] for each of `loads` ([`decode_post`]'s), in one pass; of two
    /// entries for the same replica, the later counts.
    pub fn put_all(&mut self, loads: Vec<(u64, ReplicaLoad)>, now_ms: u64, ttl_ms: u64) {
        let expires_ms = now_ms.saturating_add(ttl_ms);
        for (replica, load) in loads {
            self.entries.retain(|e| e.replica != replica);
            self.entries.push(Entry {
                replica,
                expires_ms,
                load,
            });
        }
        // The new entries are fresh: this forgets the old ones no longer counted.
        self.entries.retain(|e| fresh(e, now_ms));
        // Newest first; beyond MAX_REPLICAS entries, or MAX_PODS pods over all of them (what
        // every worker decodes at each change), the oldest go.
        self.entries
            .sort_by_key(|e| std::cmp::Reverse(e.expires_ms));
        let mut pods = 0usize;
        let keep = self
            .entries
            .iter()
            .take(MAX_REPLICAS)
            .take_while(|e| {
                pods = pods.saturating_add(e.load.pods());
                pods <= MAX_PODS
            })
            .count()
            .max(1);
        self.entries.truncate(keep);
    }

    /// Replicas held (fresh or not).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Replicas whose counts are fresh at `now_ms`.
    pub fn fresh(&self, now_ms: u64) -> usize {
        self.entries.iter().filter(|e| fresh(e, now_ms)).count()
    }

    /// The last instant the first of the fresh entries counts (after it,
    /// [`ReplicaLoads::aligned`] gives less); `None` if none is fresh.
    pub fn next_expiry(&self, now_ms: u64) -> Option<u64> {
        self.entries
            .iter()
            .filter(|e| fresh(e, now_ms))
            .map(|e| e.expires_ms)
            .min()
    }

    /// The fresh replicas' prefill counts of `pool` at `now_ms`, aligned with the snapshot's
    /// pod `keys`: `out[i]` = (requests, tokens) on pod `keys[i]`. Pods the snapshot does not
    /// have are left out.
    pub fn aligned(&self, pool: &str, keys: &[u64], now_ms: u64) -> Vec<(u32, u32)> {
        let mut out = vec![(0u32, 0u32); keys.len()];
        let mut index: Option<std::collections::HashMap<u64, usize>> = None;
        for e in self.entries.iter().filter(|e| fresh(e, now_ms)) {
            let Some((_, pods)) = e.load.pools.iter().find(|(n, _)| n == pool) else {
                continue;
            };
            let index = index
                .get_or_insert_with(|| keys.iter().enumerate().map(|(i, &k)| (k, i)).collect());
            for p in pods {
                if let Some(&i) = index.get(&p.key) {
                    let o = &mut out[i];
                    o.0 = o.0.saturating_add(p.requests);
                    o.1 = o.1.saturating_add(p.tokens);
                }
            }
        }
        out
    }

    /// The shared-data value.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(8 + self.entries.len() * 128);
        b.extend_from_slice(STORE_MAGIC);
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&e.replica.to_le_bytes());
            b.extend_from_slice(&e.expires_ms.to_le_bytes());
            e.load.encode_pools(&mut b);
        }
        b
    }

    /// Reads the shared-data value; an empty or unreadable value holds nothing.
    pub fn decode(bytes: &[u8]) -> ReplicaLoads {
        Self::try_decode(bytes).unwrap_or_default()
    }

    fn try_decode(bytes: &[u8]) -> Result<ReplicaLoads, &'static str> {
        let rest = bytes.strip_prefix(STORE_MAGIC.as_slice()).ok_or("magic")?;
        let mut r = ByteReader::new(rest);
        let n = r.u32()? as usize;
        if n > MAX_REPLICAS {
            return Err("too many replicas");
        }
        let mut entries = Vec::with_capacity(n);
        for _ in 0..n {
            entries.push(Entry {
                replica: r.u64()?,
                expires_ms: r.u64()?,
                load: ReplicaLoad::decode_pools(&mut r)?,
            });
        }
        if r.left() != 0 {
            return Err("trailing bytes");
        }
        Ok(ReplicaLoads { entries })
    }
}

/// One pool's counts from [`ReplicaLoads`] aligned with a snapshot's pods, kept until the
/// snapshot, the counts held (their `generation`: any number that changes with them) or the
/// first fresh entry's expiry changes: a pick adds them without aligning them again.
#[derive(Debug, Clone, Default)]
pub struct Aligned {
    counts: Vec<(u32, u32)>,
    /// (snapshot version, generation, valid until ms).
    valid_for: Option<(u64, u64, u64)>,
}

impl Aligned {
    /// Adds the fresh replicas' requests in prefill on each pod to `pods`, the pool's in-flight
    /// view aligned with the snapshot `version` whose pod keys are `keys`.
    #[allow(clippy::too_many_arguments)]
    pub fn add_to(
        &mut self,
        pods: &mut [PodLoad],
        held: &ReplicaLoads,
        generation: u64,
        pool: &str,
        version: u64,
        keys: &[u64],
        now_ms: u64,
    ) {
        let valid = self
            .valid_for
            .is_some_and(|(v, g, until)| v == version && g == generation && now_ms < until);
        if !valid {
            self.counts = held.aligned(pool, keys, now_ms);
            let until = held
                .next_expiry(now_ms)
                .map_or(u64::MAX, |t| t.saturating_add(1));
            self.valid_for = Some((version, generation, until));
        }
        if self.counts.len() != pods.len() {
            return;
        }
        for (p, &(requests, tokens)) in pods.iter_mut().zip(&self.counts) {
            p.add_prefill(requests, tokens);
        }
    }
}

fn fresh(e: &Entry, now_ms: u64) -> bool {
    now_ms <= e.expires_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn table(pods: &[(u64, u32, u32)]) -> LoadTable {
        LoadTable {
            version: 1,
            pods: pods
                .iter()
                .map(|&(key, prefill, prefill_tokens)| PodLoad {
                    key,
                    prefill,
                    prefill_tokens,
                    inflight: prefill + 5,
                    ..PodLoad::default()
                })
                .collect(),
        }
    }

    #[test]
    fn the_workers_tables_sum_to_their_prefill_counts_per_pool_and_pod() {
        let a = table(&[(1, 2, 300), (2, 0, 0), (3, 1, 50)]);
        let b = table(&[(1, 1, 100), (3, 0, 0)]);
        let c = table(&[(9, 0, 0)]);
        let load = ReplicaLoad::from_tables([("chat", &a), ("chat", &b), ("embed", &c)]);
        assert_eq!(
            load.pools,
            vec![(
                "chat".to_string(),
                vec![
                    PodPrefill {
                        key: 1,
                        requests: 3,
                        tokens: 400
                    },
                    PodPrefill {
                        key: 3,
                        requests: 1,
                        tokens: 50
                    },
                ]
            )],
            "pods and pools with nothing in prefill are left out; the rest of a table is not sent"
        );
        assert_eq!(ReplicaLoad::decode(&load.encode()), Ok(load));
        assert_eq!(
            ReplicaLoad::decode(&ReplicaLoad::default().encode()).map(|l| l.pools.len()),
            Ok(0)
        );
    }

    #[test]
    fn bad_bodies_are_refused_with_a_reason() {
        let good = ReplicaLoad::from_tables([("p", &table(&[(1, 1, 10)]))]).encode();
        assert!(ReplicaLoad::decode(b"").is_err());
        assert!(ReplicaLoad::decode(b"GPX1\0\0\0\0").is_err());
        for cut in 4..good.len() {
            assert!(ReplicaLoad::decode(&good[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = good.clone();
        trailing.push(0);
        assert_eq!(
            ReplicaLoad::decode(&trailing),
            Err("trailing bytes after the counts")
        );
        // A pod count the body cannot hold is refused before anything is allocated for it.
        let mut huge = b"GPL1".to_vec();
        huge.extend_from_slice(&1u32.to_le_bytes());
        huge.extend_from_slice(&1u16.to_le_bytes());
        huge.push(b'p');
        huge.extend_from_slice(&60_000u32.to_le_bytes());
        assert_eq!(ReplicaLoad::decode(&huge), Err("truncated"));
        let mut pools = b"GPL1".to_vec();
        pools.extend_from_slice(&(MAX_POOLS as u32 + 1).to_le_bytes());
        assert_eq!(ReplicaLoad::decode(&pools), Err("too many pools"));
        let mut name = b"GPL1".to_vec();
        name.extend_from_slice(&1u32.to_le_bytes());
        name.extend_from_slice(&2u16.to_le_bytes());
        name.extend_from_slice(&[0xff, 0xfe]);
        name.extend_from_slice(&0u32.to_le_bytes());
        assert_eq!(ReplicaLoad::decode(&name), Err("pool name not UTF-8"));
    }

    #[test]
    fn a_replica_is_named_by_a_short_visible_header() {
        assert!(replica_key(Some("gw-7f9c/0")).is_ok());
        assert_eq!(replica_key(Some("a")), replica_key(Some("a")));
        assert_ne!(replica_key(Some("a")), replica_key(Some("b")));
        for bad in [None, Some(""), Some("has space"), Some("tab\t"), Some("é")] {
            assert!(replica_key(bad).is_err(), "{bad:?}");
        }
        assert!(replica_key(Some(&"x".repeat(MAX_REPLICA_NAME))).is_ok());
        assert!(replica_key(Some(&"x".repeat(MAX_REPLICA_NAME + 1))).is_err());
    }

    fn one(pool: &str, pods: &[(u64, u32, u32)]) -> ReplicaLoad {
        ReplicaLoad::from_tables([(pool, &table(pods))])
    }

    #[test]
    fn each_replicas_newest_counts_are_added_while_fresh() {
        let mut held = ReplicaLoads::default();
        held.put(10, one("chat", &[(1, 2, 200), (7, 1, 10)]), 1_000, 50);
        held.put(20, one("chat", &[(1, 1, 100), (2, 3, 30)]), 1_010, 50);
        let keys = [2, 1, 3];
        // Pod 7 is not in this snapshot: left out.
        assert_eq!(
            held.aligned("chat", &keys, 1_020),
            vec![(3, 30), (3, 300), (0, 0)]
        );
        assert_eq!(held.aligned("other", &keys, 1_020), vec![(0, 0); 3]);
        assert_eq!(held.next_expiry(1_020), Some(1_050));
        // A newer post from replica 10 replaces its counts.
        held.put(10, one("chat", &[(3, 1, 5)]), 1_030, 50);
        assert_eq!(held.len(), 2);
        assert_eq!(
            held.aligned("chat", &keys, 1_030),
            vec![(3, 30), (1, 100), (1, 5)]
        );
        // Replica 20 stops posting: its counts drop out after the ttl, and a later put forgets it.
        assert_eq!(held.fresh(1_061), 1);
        assert_eq!(
            held.aligned("chat", &keys, 1_061),
            vec![(0, 0), (0, 0), (1, 5)]
        );
        held.put(30, ReplicaLoad::default(), 1_070, 50);
        assert_eq!(held.len(), 2, "replica 20's entry is gone");
        assert_eq!(ReplicaLoads::decode(&held.encode()), held);
        assert!(ReplicaLoads::decode(b"junk").is_empty());
        assert_eq!(held.next_expiry(10_000), None);
    }

    #[test]
    fn a_bundle_carries_several_replicas_counts_in_one_post() {
        let (a, b) = (one("chat", &[(1, 2, 200)]), one("chat", &[(2, 1, 10)]));
        let (ea, eb) = (a.encode(), b.encode());
        let bundle = encode_bundle([("gw-a", ea.as_slice()), ("gw-b", eb.as_slice())]);
        // The entries name themselves: a header, if any, is not used.
        for header in [None, Some("gw-c"), Some("bad name")] {
            let got = decode_post(header, &bundle).unwrap();
            assert_eq!(
                got,
                vec![
                    (replica_key(Some("gw-a")).unwrap(), a.clone()),
                    (replica_key(Some("gw-b")).unwrap(), b.clone())
                ]
            );
        }
        // A plain body needs its header.
        assert_eq!(
            decode_post(Some("gw-a"), &ea),
            Ok(vec![(replica_key(Some("gw-a")).unwrap(), a.clone())])
        );
        assert!(decode_post(None, &ea).is_err());
        assert_eq!(decode_post(None, &encode_bundle([])), Ok(vec![]));
        // Only what the filter would take is written: at most MAX_REPLICAS entries.
        let names: Vec<String> = (0..=MAX_REPLICAS).map(|i| format!("gw-{i}")).collect();
        let full = encode_bundle(names.iter().map(|n| (n.as_str(), ea.as_slice())));
        assert_eq!(decode_post(None, &full).map(|l| l.len()), Ok(MAX_REPLICAS));

        // One bad entry refuses the whole post.
        let bad_name = encode_bundle([("gw-a", ea.as_slice()), ("sp ace", eb.as_slice())]);
        assert!(decode_post(None, &bad_name).is_err());
        let bad_body = encode_bundle([("gw-a", ea.as_slice()), ("gw-b", b"GPL1junk".as_slice())]);
        assert!(decode_post(None, &bad_body).is_err());
        let mut trailing = bundle.clone();
        trailing.push(0);
        assert_eq!(
            decode_post(None, &trailing),
            Err("trailing bytes after the bundle")
        );
        assert_eq!(
            decode_post(None, &bundle[..bundle.len() - 1]),
            Err("truncated")
        );
        let mut many = b"GPB1".to_vec();
        many.extend_from_slice(&(MAX_REPLICAS as u16 + 1).to_le_bytes());
        assert_eq!(
            decode_post(None, &many),
            Err("too many replicas in the bundle")
        );
        // Over MAX_PODS pods in all, though each entry is under it.
        let half: Vec<(u64, u32, u32)> =
            (1..=(MAX_PODS as u64 / 2 + 1)).map(|k| (k, 1, 1)).collect();
        let big = one("p", &half).encode();
        let too_big = encode_bundle([("a", big.as_slice()), ("b", big.as_slice())]);
        assert_eq!(decode_post(None, &too_big), Err("too many pods"));
    }

    #[test]
    fn a_bundles_entries_are_held_like_posts_of_their_own() {
        let mut held = ReplicaLoads::default();
        held.put(10, one("chat", &[(1, 5, 500)]), 1_000, 50);
        held.put(20, one("chat", &[(2, 5, 500)]), 1_000, 50);
        // Replica 10 again and a new one, 30, in one post; of two entries for 30 the later counts.
        held.put_all(
            vec![
                (10, one("chat", &[(1, 1, 10)])),
                (30, one("chat", &[(2, 9, 9)])),
                (30, one("chat", &[(2, 2, 20)])),
            ],
            1_020,
            50,
        );
        assert_eq!(held.len(), 3);
        assert_eq!(
            held.aligned("chat", &[1, 2], 1_040),
            vec![(1, 10), (7, 520)]
        );
        // Replica 20's entry expires on its own clock; the bundle's later.
        assert_eq!(held.aligned("chat", &[1, 2], 1_060), vec![(1, 10), (2, 20)]);
        assert_eq!(held.next_expiry(1_060), Some(1_070));
    }

    #[test]
    fn at_most_max_replicas_are_held_newest_first() {
        let mut held = ReplicaLoads::default();
        for r in 0..(MAX_REPLICAS as u64 + 10) {
            held.put(r, one("p", &[(1, 1, 1)]), 1_000 + r, 60_000);
        }
        assert_eq!(held.len(), MAX_REPLICAS);
        let newest = 1_000 + MAX_REPLICAS as u64 + 9;
        assert_eq!(
            held.aligned("p", &[1], newest),
            vec![(MAX_REPLICAS as u32, MAX_REPLICAS as u32)]
        );
        assert_eq!(held.next_expiry(newest), Some(1_010 + 60_000));
    }

    #[test]
    fn aligned_counts_are_added_and_kept_until_the_counts_the_snapshot_or_an_expiry_change() {
        let mut held = ReplicaLoads::default();
        held.put(1, one("chat", &[(5, 2, 200)]), 1_000, 50);
        let keys = [4, 5];
        let pods = || {
            vec![
                PodLoad {
                    key: 4,
                    ..PodLoad::default()
                },
                PodLoad {
                    key: 5,
                    prefill: 1,
                    prefill_tokens: 10,
                    ..PodLoad::default()
                },
            ]
        };
        let mut a = Aligned::default();
        let mut view = pods();
        a.add_to(&mut view, &held, 1, "chat", 7, &keys, 1_010);
        assert_eq!(
            (view[0].prefill, view[1].prefill, view[1].prefill_tokens),
            (0, 3, 210)
        );
        // The same generation and snapshot: the cached alignment, even if `held` changed
        // behind it (the generation is what tells).
        held.put(1, one("chat", &[(4, 9, 9)]), 1_020, 50);
        let mut view = pods();
        a.add_to(&mut view, &held, 1, "chat", 7, &keys, 1_020);
        assert_eq!((view[0].prefill, view[1].prefill), (0, 3));
        let mut view = pods();
        a.add_to(&mut view, &held, 2, "chat", 7, &keys, 1_020);
        assert_eq!(
            (view[0].prefill, view[1].prefill),
            (9, 1),
            "a new generation realigns"
        );
        // Past the post's expiry the counts drop out without a new generation.
        let mut view = pods();
        a.add_to(&mut view, &held, 2, "chat", 7, &keys, 1_071);
        assert_eq!((view[0].prefill, view[1].prefill), (0, 1));
        // A view of another length (another snapshot's) is left alone.
        let mut short = vec![PodLoad::default()];
        a.add_to(&mut short, &held, 3, "chat", 8, &keys, 1_020);
        assert_eq!(short[0].prefill, 0);
    }

    #[test]
    fn the_entries_held_stay_under_max_pods_newest_first() {
        let big = |n: u64| ReplicaLoad {
            pools: vec![(
                "p".to_string(),
                (0..n)
                    .map(|key| PodPrefill {
                        key,
                        requests: 1,
                        tokens: 1,
                    })
                    .collect(),
            )],
        };
        let mut held = ReplicaLoads::default();
        let third = MAX_PODS as u64 / 3;
        for r in 0..5 {
            held.put(r, big(third), 1_000 + r, 60_000);
        }
        assert_eq!(held.len(), 3, "three thirds fit, the two oldest went");
        assert_eq!(held.aligned("p", &[0], 2_000), vec![(3, 3)]);
        // One replica alone at the limit is kept.
        held.put(9, big(MAX_PODS as u64), 3_000, 60_000);
        assert_eq!(held.len(), 1);
    }

    proptest! {
        #[test]
        fn any_bytes_decode_or_are_refused_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = ReplicaLoad::decode(&bytes);
            let mut with_magic = b"GPL1".to_vec();
            with_magic.extend_from_slice(&bytes);
            let _ = ReplicaLoad::decode(&with_magic);
            let mut stored = b"GPR1".to_vec();
            stored.extend_from_slice(&bytes);
            let _ = ReplicaLoads::decode(&stored);
            let mut bundle = b"GPB1".to_vec();
            bundle.extend_from_slice(&bytes);
            let _ = decode_post(None, &bundle);
        }

        #[test]
        fn what_is_encoded_decodes_the_same(pods in proptest::collection::vec((1u64..20, 0u32..5, 0u32..10_000), 0..30)) {
            let load = one("pool", &pods);
            prop_assert_eq!(ReplicaLoad::decode(&load.encode()), Ok(load.clone()));
            let mut held = ReplicaLoads::default();
            held.put(1, load, 5, 50);
            prop_assert_eq!(ReplicaLoads::decode(&held.encode()), held);
        }
    }
}
