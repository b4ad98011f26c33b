//! A snapshot decoded for picking: per pool, per pod, the values the scorers read, with names
//! pre-hashed. Built once per snapshot version in each worker, never per request.

use crate::idmap::{IdMap, NameMap};
use crate::picker::speed_class;
use crate::prefix::pod_key;
use crate::snapshot::{PodSnapshot, Snapshot};
use xxhash_rust::xxh3::xxh3_64;

/// Hash of a LoRA adapter name, as the picker compares them.
pub fn adapter_key(name: &str) -> u64 {
    xxh3_64(name.as_bytes())
}

/// A name made safe as one segment of an Envoy stat name (no `.` or `:`, which Envoy's
/// hierarchy and tag extraction treat as separators).
pub fn stat_segment(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The endpoint under which picks of pods past `max_pod_stats` are counted.
pub const OTHER_POD: &str = "other";

/// A pod of a pool, as [`PodStatSet`] knows it.
pub fn pod_stat_key(pool: &str, pod_key: u64) -> u64 {
    crate::rng::mix64(pod_key ^ xxh3_64(pool.as_bytes()))
}

/// The pods that have a picks counter of their own ([`pod_stat_key`]): the first
/// `max_pod_stats` distinct pods an Envoy picked, for as long as it runs. Envoy has no way to
/// remove a counter, so a pod that left keeps its series until Envoy restarts; past the limit,
/// a new pod's picks go to [`OTHER_POD`]. One set per Envoy, across its workers and its filter
/// configurations: the proxy-wasm filter keeps it in shared data (`encode`, `decode`), the
/// dynamic module in the process.
#[derive(Debug, Clone, Default)]
pub struct PodStatSet {
    keys: IdMap<u64, ()>,
}

impl PodStatSet {
    /// The shared-data form: the keys, 8 bytes each (little-endian). Bytes past the last whole
    /// key are ignored.
    pub fn decode(bytes: &[u8]) -> PodStatSet {
        let keys = bytes
            .chunks_exact(8)
            .map(|c| (u64::from_le_bytes(c.try_into().unwrap_or_default()), ()))
            .collect();
        PodStatSet { keys }
    }

    pub fn encode(&self) -> Vec<u8> {
        self.keys.keys().flat_map(|k| k.to_le_bytes()).collect()
    }

    pub fn contains(&self, key: u64) -> bool {
        self.keys.contains_key(&key)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether the pod `key` has a counter of its own under `limit` (`max_pod_stats`): it had
    /// one already, or there was room and it now has.
    pub fn admit(&mut self, key: u64, limit: usize) -> bool {
        if self.contains(key) {
            return true;
        }
        if self.keys.len() >= limit {
            return false;
        }
        self.keys.insert(key, ());
        true
    }
}

/// One pod, ready for scoring.
#[derive(Debug, Clone)]
pub struct PodState {
    pub snap: PodSnapshot,
    /// [`pod_key`] of the address.
    pub key: u64,
    /// How old the pod's data already was when the snapshot was assembled.
    pub age_at_generation_ms: u64,
    pub lora_running: Vec<u64>,
    pub lora_waiting: Vec<u64>,
    /// The pod's speed class, [`pool_speed_classes`] of its pool: per snapshot, not per
    /// request (a logarithm, a rounding and a power each time otherwise).
    pub speed: f64,
}

impl PodState {
    /// Healthy, with metrics no older than `stale_after_ms` (`snapshot_age_ms` after the
    /// snapshot was accepted): the picker's candidate rule, before ramp-up and saturation.
    #[inline]
    pub fn fresh(&self, snapshot_age_ms: u64, stale_after_ms: u64) -> bool {
        self.snap.healthy
            && snapshot_age_ms.saturating_add(self.age_at_generation_ms) <= stale_after_ms
    }

    fn new(snap: PodSnapshot, generated_at_ms: u64, speed: f64) -> PodState {
        let (lora_running, lora_waiting) = match &snap.lora {
            Some(l) => (
                l.running.iter().map(|a| adapter_key(a)).collect(),
                l.waiting.iter().map(|a| adapter_key(a)).collect(),
            ),
            None => (Vec::new(), Vec::new()),
        };
        PodState {
            key: pod_key(&snap.address),
            speed,
            age_at_generation_ms: generated_at_ms.saturating_sub(snap.last_scrape_ms),
            snap,
            lora_running,
            lora_waiting,
        }
    }

    /// Free LoRA slots: `max_loras` minus the distinct adapters running or waiting. `None` when
    /// the pod reports no LoRA state.
    /// Counted in place: the picker asks it for every candidate of an adapter request, and the
    /// lists are a few adapters long.
    pub fn free_lora_slots(&self) -> Option<u32> {
        let l = self.snap.lora.as_ref()?;
        let waiting = &self.lora_waiting;
        let new_waiting = waiting
            .iter()
            .enumerate()
            .filter(|(i, w)| !self.lora_running.contains(w) && !waiting[..*i].contains(w))
            .count();
        let used = self.lora_running.len() + new_waiting;
        Some(
            l.max_loras
                .saturating_sub(u32::try_from(used).unwrap_or(u32::MAX)),
        )
    }
}

/// The pods of one pool.
#[derive(Debug, Clone)]
pub struct PoolState {
    pub name: String,
    pub pods: Vec<PodState>,
    /// Pod keys in order, for [`crate::load::LoadTable::rebase`].
    pub keys: Vec<u64>,
}

impl PoolState {
    /// Whether any pod could take a request ([`PodState::fresh`]).
    pub fn serving(&self, snapshot_age_ms: u64, stale_after_ms: u64) -> bool {
        self.pods
            .iter()
            .any(|p| p.fresh(snapshot_age_ms, stale_after_ms))
    }

    /// The index of the pod `key`, while the snapshot shows it healthy: where a stored
    /// response is kept (a pod that failed has lost what it held in memory).
    pub fn healthy_pod(&self, key: u64) -> Option<usize> {
        self.pods
            .iter()
            .position(|p| p.key == key && p.snap.healthy)
    }
}

/// A whole decoded snapshot.
#[derive(Debug, Clone)]
pub struct FleetState {
    pub version: u64,
    /// Envoy's clock (unix ms) when the snapshot was accepted.
    pub received_at_ms: u64,
    pub source: String,
    pub pools: Vec<PoolState>,
    by_name: NameMap<String, usize>,
}

/// The widest ratio of capacities one speed group spans: sqrt(2), one step of
/// [`speed_class`]. Identical GPUs' estimates differ by up to about that with the batch each
/// runs; GPU generations are 1.4x (H200 over H100) to 4x (H100 over L40S) apart in memory
/// bandwidth, what decoding is bound by.
const GROUP_SPAN: f64 = std::f64::consts::SQRT_2;

/// Speed classes of a pool's pods from their capacities, in order: pods whose capacities lie
/// within [`GROUP_SPAN`] of the slowest of their group share one class, the [`speed_class`] of
/// their geometric mean. Rounding each pod's capacity alone would split two identical GPUs
/// whose estimates straddle a class boundary (2.30 and 2.53 against the boundary at 2.38: two
/// H100s of the mixed-gpu benchmark, 2 and 2.83), and the one read as 41% faster would get
/// the other's share of long prompts.
pub fn pool_speed_classes(capacities: &[f64]) -> Vec<f64> {
    // Sorted as integers: a positive finite f64's bits order as its value, and the index
    // takes the low 16 of the 52 mantissa bits (a pool holds at most 10,000 pods; one past
    // 65,535 would keep its own class). The .wasm already holds an integer sort; a float
    // sort by key would add ~10 KB to it.
    let mut order: Vec<u64> = capacities
        .iter()
        .enumerate()
        .filter(|&(i, &c)| c.is_finite() && c > 0.0 && i <= 0xFFFF)
        .map(|(i, &c)| (c.to_bits() & !0xFFFF) | i as u64)
        .collect();
    order.sort_unstable();
    let order: Vec<usize> = order.iter().map(|k| (k & 0xFFFF) as usize).collect();
    // Unknown capacities read as 1, as [`speed_class`] reads them.
    let mut out: Vec<f64> = capacities.iter().map(|&c| speed_class(c)).collect();
    let mut start = 0;
    while start < order.len() {
        let floor = capacities[order[start]];
        let end = start
            + order[start..]
                .iter()
                .take_while(|&&i| capacities[i] <= floor * GROUP_SPAN)
                .count();
        let group = &order[start..end];
        // In log2 and powf, which speed_class already uses: no more of libm in the .wasm.
        let mean_log2 =
            group.iter().map(|&i| capacities[i].log2()).sum::<f64>() / group.len() as f64;
        let class = speed_class(2f64.powf(mean_log2));
        for &i in group {
            out[i] = class;
        }
        start = end;
    }
    out
}

impl FleetState {
    pub fn new(snapshot: Snapshot, received_at_ms: u64) -> FleetState {
        let generated = snapshot.generated_at_ms;
        let pools: Vec<PoolState> = snapshot
            .pools
            .into_iter()
            .map(|p| {
                let caps: Vec<f64> = p.pods.iter().map(|x| x.capacity).collect();
                let pods: Vec<PodState> = p
                    .pods
                    .into_iter()
                    .zip(pool_speed_classes(&caps))
                    .map(|(s, speed)| PodState::new(s, generated, speed))
                    .collect();
                PoolState {
                    name: p.name,
                    keys: pods.iter().map(|x| x.key).collect(),
                    pods,
                }
            })
            .collect();
        let by_name = pools
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), i))
            .collect();
        FleetState {
            version: snapshot.version,
            received_at_ms,
            source: snapshot.source,
            pools,
            by_name,
        }
    }

    pub fn pool(&self, name: &str) -> Option<&PoolState> {
        self.by_name.get(name).and_then(|i| self.pools.get(*i))
    }

    /// The address of the pod `key` of `pool`, if the snapshot has it.
    pub fn address_of(&self, pool: &str, key: u64) -> Option<&str> {
        let p = self.pool(pool)?;
        p.pods
            .iter()
            .find(|p| p.key == key)
            .map(|p| p.snap.address.as_str())
    }

    /// Milliseconds since the snapshot was accepted.
    pub fn age_ms(&self, now_ms: u64) -> u64 {
        now_ms.saturating_sub(self.received_at_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::LoraState;

    #[test]
    fn pod_stat_set_admits_up_to_the_limit_and_keeps_who_it_admitted() {
        let (a, b, c) = (
            pod_stat_key("llama", 1),
            pod_stat_key("llama", 2),
            pod_stat_key("qwen", 1),
        );
        assert_ne!(a, c, "the same pod in another pool is another counter");
        let mut s = PodStatSet::default();
        assert!(s.admit(a, 2) && s.admit(c, 2));
        assert!(!s.admit(b, 2));
        assert!(s.admit(a, 2) && s.admit(c, 2) && !s.admit(b, 2));
        // Through its shared-data form, as another worker or configuration reads it.
        let mut back = PodStatSet::decode(&s.encode());
        assert_eq!(back.len(), 2);
        assert!(back.contains(a) && back.contains(c) && !back.admit(b, 2));
        assert!(
            back.admit(b, 3),
            "a larger limit (a new configuration) has room"
        );
        assert!(!PodStatSet::default().admit(a, 0));
        assert!(PodStatSet::decode(&[1, 2, 3]).is_empty());
    }

    #[test]
    fn stat_segment_removes_separators() {
        assert_eq!(stat_segment("10.0.0.1:8000"), "10_0_0_1_8000");
        assert_eq!(stat_segment("[::1]:80"), "___1__80");
        assert_eq!(stat_segment("llama-8b"), "llama-8b");
    }

    #[test]
    fn decodes_ages_keys_and_lora_slots() {
        let mut pod = PodSnapshot::new("10.0.0.1:8000", 900);
        pod.lora = Some(LoraState {
            max_loras: 3,
            running: vec!["a".into(), "b".into()],
            waiting: vec!["b".into(), "c".into()],
        });
        let snap = Snapshot::of_pool("p", vec![pod, PodSnapshot::new("10.0.0.2:8000", 1_000)]);
        let f = FleetState::new(snap, 5_000);
        let p = f.pool("p").unwrap();
        assert_eq!(p.pods[0].age_at_generation_ms, 100);
        assert_eq!(p.keys[1], pod_key("10.0.0.2:8000"));
        assert_eq!(p.pods[0].free_lora_slots(), Some(0));
        assert_eq!(p.pods[1].free_lora_slots(), None);
        assert_eq!(f.age_ms(5_250), 250);
        assert!(f.pool("q").is_none());
    }

    #[test]
    fn identical_gpus_share_a_speed_class_and_generations_keep_theirs() {
        let sqrt2 = std::f64::consts::SQRT_2;
        // Two H100s whose estimates straddle the boundary at 2.38 (alone: classes 2 and 2.83),
        // two L40Ss: one class each, the generations ~4x apart.
        let c = pool_speed_classes(&[2.30, 2.53, 0.55, 0.64]);
        assert_eq!((speed_class(2.30), speed_class(2.53)), (2.0, 2.0 * sqrt2));
        assert_eq!(c[0], c[1]);
        assert_eq!(c[2], c[3]);
        assert!(c[0] / c[2] >= 2.0 * sqrt2, "{c:?}");
        // The group's class is its geometric mean's, whatever the order.
        assert_eq!(c[0], speed_class((2.30f64 * 2.53).sqrt()));
        assert_eq!(
            pool_speed_classes(&[0.64, 2.53, 0.55, 2.30]),
            [c[3], c[1], c[2], c[0]]
        );
        // One pod: its own class. Unknown capacities read as 1, and stay out of the groups.
        assert_eq!(pool_speed_classes(&[3.1]), [speed_class(3.1)]);
        assert_eq!(
            pool_speed_classes(&[f64::NAN, 0.0, 1.9, 2.1]),
            [1.0, 1.0, 2.0, 2.0]
        );
        assert!(pool_speed_classes(&[]).is_empty());
        // A group spans sqrt(2) from its slowest: 1.0, 1.3 together; 1.5 starts the next.
        let c = pool_speed_classes(&[1.0, 1.3, 1.5, 2.0]);
        assert_eq!(c[0], c[1]);
        assert_eq!(c[2], c[3]);
        assert!(c[2] > c[1]);
    }

    #[test]
    fn the_decoded_pool_carries_the_groups_classes() {
        let pods = [
            ("10.0.0.1:8000", 2.30),
            ("10.0.0.2:8000", 2.53),
            ("10.0.0.3:8000", 0.6),
        ]
        .into_iter()
        .map(|(a, c)| {
            let mut p = PodSnapshot::new(a, 1_000);
            p.capacity = c;
            p
        })
        .collect();
        let f = FleetState::new(Snapshot::of_pool("p", pods), 1_000);
        let speeds: Vec<f64> = f.pool("p").unwrap().pods.iter().map(|p| p.speed).collect();
        assert_eq!(speeds, pool_speed_classes(&[2.30, 2.53, 0.6]));
        assert_eq!(speeds[0], speeds[1]);
    }
}
