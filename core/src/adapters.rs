//! Where each LoRA adapter lives: a balanced partition of a pool's configured adapters over its
//! pods, computed the same way by every Envoy worker and every gateway replica from the same
//! inputs (the configuration and the snapshot), so all of them keep each adapter on the same pod
//! without exchanging anything.
//!
//! Plain rendezvous hashing gives each adapter a pod, but unevenly: with 16 adapters on 4 pods
//! of 4 slots, some pods get 6 adapters and churn through their slots while others hold 2. Here
//! each pod gets a quota (its capacity share of the adapters, never more than its slots while
//! the adapters fit in the pool's slots; past them, its slots and its capacity share of the
//! excess) and each adapter, in a fixed order, takes its highest-ranked pod in plain rendezvous
//! order that still has room. So a pod's share of adapters follows its capacity and every
//! adapter can stay loaded.
//!
//! Capacity enters through the quotas only, not the ranking. Any speed estimate moves with load
//! (the mean-latency one `sidecar-metrics` used before its decode-step estimate spread over
//! 0.6-1.2 on four identical pods in a multi-lora run), and a capacity-weighted ranking
//! reshuffled homes every time a pod's speed class flipped; every reshuffle is a round of
//! adapter loads. With the ranking fixed, homes move only when quotas change, and when the
//! adapters fill every slot of the pool (the case that matters for loads) quotas are the slot
//! counts, whatever the capacities.
//!
//! Popularity is deliberately not an input: weighting by each gateway's recent request counts
//! balanced traffic better on paper but moved homes whenever the counts shifted, and every move
//! is a load (measured on the multi-lora benchmark: 82 loads with popularity, 37 without).

use crate::prefix::hrw_weight;
use std::collections::HashMap;

/// A pod as the partition sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlotPod {
    /// [`crate::prefix::pod_key`].
    pub key: u64,
    /// Relative speed (the picker's speed class).
    pub weight: f64,
    /// Adapter slots (`max_loras`); 0 when unknown.
    pub slots: u32,
}

/// Assigns every adapter (by [`crate::fleet::adapter_key`]) a home pod key.
pub fn partition(adapters: &[u64], pods: &[SlotPod]) -> HashMap<u64, u64> {
    let mut homes = HashMap::with_capacity(adapters.len());
    if pods.is_empty() {
        return homes;
    }
    let mut sorted: Vec<u64> = adapters.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let quota = quotas(sorted.len(), pods);
    let mut load = vec![0usize; pods.len()];
    for a in sorted {
        // The highest-ranked pod with room (the highest-ranked of all if none has): one pass,
        // each pod's rendezvous weight computed once. Sorting the pods for every adapter, with
        // the weights computed in the comparator, took 21 ms for 5,000 adapters over 64 pods.
        let rank = |i: usize| (hrw_weight(a, pods[i].key), pods[i].key);
        let mut best: Option<((u64, u64), usize)> = None;
        let mut top: Option<((u64, u64), usize)> = None;
        for i in 0..pods.len() {
            let r = rank(i);
            if top.is_none_or(|(t, _)| r > t) {
                top = Some((r, i));
            }
            if load[i] < quota[i] && best.is_none_or(|(b, _)| r > b) {
                best = Some((r, i));
            }
        }
        let Some((_, i)) = best.or(top) else {
            continue;
        };
        load[i] += 1;
        homes.insert(a, pods[i].key);
    }
    homes
}

/// How many of `n` adapters each pod may be home to.
fn quotas(n: usize, pods: &[SlotPod]) -> Vec<usize> {
    let weight = |p: &SlotPod| p.weight.max(1e-6);
    // Summed in key order, so the pods' order cannot move a share across an integer by an ulp.
    let mut by_key: Vec<usize> = (0..pods.len()).collect();
    by_key.sort_by_key(|&i| pods[i].key);
    let total_w: f64 = by_key.iter().map(|&i| weight(&pods[i])).sum();
    let total_slots: usize = pods.iter().map(|p| p.slots as usize).sum();
    if n > total_slots {
        // More adapters than slots (or slots unknown, 0): every pod is home to as many as its
        // slots, and the excess is shared by capacity, largest remainder first, so the quotas sum
        // to exactly `n`. Before, each pod took ceil(n * w / W) whatever its slots: past the
        // pool's slots some pods overfilled while others left slots empty, and one adapter past
        // them moved up to half the homes ([16, 4, 4, 4] slots, 28 -> 29 adapters: 14 moved,
        // homes per pod [5, 8, 8, 8]).
        let excess = n - total_slots;
        let share = |i: usize| excess as f64 * weight(&pods[i]) / total_w;
        let mut quota: Vec<usize> = pods
            .iter()
            .enumerate()
            .map(|(i, p)| p.slots as usize + share(i).floor() as usize)
            .collect();
        let given: usize = quota.iter().sum();
        let mut order = by_key;
        // Largest remainder first, then by key: the same order whatever the pods' order.
        order.sort_by(|&a, &b| {
            let rem = |i: usize| share(i) - share(i).floor();
            rem(b)
                .total_cmp(&rem(a))
                .then(pods[a].key.cmp(&pods[b].key))
        });
        for &i in order.iter().cycle().take(n.saturating_sub(given)) {
            quota[i] += 1;
        }
        return quota;
    }
    // Everything fits: capacity-proportional shares rounded up, never more adapters than slots
    // on a pod, topped up where there is room (fastest pods first) until the quotas cover every
    // adapter.
    let mut quota: Vec<usize> = pods
        .iter()
        .map(|p| (((n as f64) * weight(p) / total_w).ceil() as usize).min(p.slots as usize))
        .collect();
    let mut order: Vec<usize> = (0..pods.len()).collect();
    order.sort_by(|a, b| {
        pods[*b]
            .weight
            .total_cmp(&pods[*a].weight)
            .then(pods[*a].key.cmp(&pods[*b].key))
    });
    while quota.iter().sum::<usize>() < n {
        let Some(&i) = order.iter().find(|&&i| quota[i] < pods[i].slots as usize) else {
            break;
        };
        quota[i] += 1;
    }
    quota
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::adapter_key;

    fn pods(n: u64, slots: u32) -> Vec<SlotPod> {
        (1..=n)
            .map(|k| SlotPod {
                key: k * 7919,
                weight: 1.0,
                slots,
            })
            .collect()
    }

    fn counts(homes: &HashMap<u64, u64>, pods: &[SlotPod]) -> Vec<usize> {
        pods.iter()
            .map(|p| homes.values().filter(|v| **v == p.key).count())
            .collect()
    }

    #[test]
    fn fits_every_adapter_into_the_slots() {
        let adapters: Vec<u64> = (0..16).map(|i| adapter_key(&format!("lora-{i}"))).collect();
        let ps = pods(4, 4);
        let homes = partition(&adapters, &ps);
        assert_eq!(homes.len(), 16);
        assert_eq!(counts(&homes, &ps), [4, 4, 4, 4]);
    }

    #[test]
    fn faster_pods_hold_more_adapters_when_slots_allow() {
        let adapters: Vec<u64> = (0..12).map(|i| adapter_key(&format!("a{i}"))).collect();
        let mut ps = pods(3, 8);
        ps[0].weight = 2.0;
        let c = counts(&partition(&adapters, &ps), &ps);
        assert_eq!(c.iter().sum::<usize>(), 12);
        assert!(c[0] >= c[1] && c[0] >= c[2], "{c:?}");
        assert!(c.iter().all(|x| *x <= 8));
    }

    #[test]
    fn more_adapters_than_slots_are_spread_by_capacity() {
        let adapters: Vec<u64> = (0..40).map(|i| adapter_key(&format!("t{i}"))).collect();
        let ps = pods(4, 2);
        let c = counts(&partition(&adapters, &ps), &ps);
        assert_eq!(c, [10, 10, 10, 10]);
    }

    /// Homes of `n` adapters on pods of `slots` slots each (equal speeds).
    fn homes(n: usize, slots: &[u32]) -> (HashMap<u64, u64>, Vec<SlotPod>) {
        let ps: Vec<SlotPod> = slots
            .iter()
            .zip(pods(slots.len() as u64, 0))
            .map(|(&slots, p)| SlotPod { slots, ..p })
            .collect();
        let adapters: Vec<u64> = (0..n).map(|i| adapter_key(&format!("c{i}"))).collect();
        (partition(&adapters, &ps), ps)
    }

    #[test]
    fn past_the_pools_slots_every_pod_fills_its_slots_and_shares_the_rest() {
        // Before: [4, 4, 4, 4] slots, 17 adapters gave [2, 5, 5, 5] (one pod's slots unused);
        // [16, 4, 4, 4], 29 gave [5, 8, 8, 8].
        for (slots, n) in [
            (vec![4, 4, 4, 4], 17),
            (vec![16, 4, 4, 4], 29),
            (vec![8, 8, 4, 4], 25),
            (vec![8; 8], 65),
            (vec![16, 4, 4, 4], 60),
        ] {
            let (h, ps) = homes(n, &slots);
            let c = counts(&h, &ps);
            assert_eq!(c.iter().sum::<usize>(), n, "{slots:?}");
            let total: u32 = slots.iter().sum();
            let excess = n - total as usize;
            // Its slots, and an equal share of the excess (equal speeds) within one.
            for (c, s) in c.iter().zip(&slots) {
                let extra = c - *s as usize;
                assert!(
                    extra.abs_diff(excess / slots.len()) <= 1,
                    "{slots:?} {n}: {c:?}"
                );
            }
        }
        // The excess by capacity: a pod twice as fast takes twice the adapters past its slots.
        let mut ps = pods(3, 2);
        ps[0].weight = 2.0;
        let adapters: Vec<u64> = (0..26).map(|i| adapter_key(&format!("w{i}"))).collect();
        assert_eq!(counts(&partition(&adapters, &ps), &ps), [12, 7, 7]);
    }

    #[test]
    fn one_adapter_past_the_pools_slots_moves_few_homes() {
        // Moved before, in this order: 3, 14, 9 and 7 homes; now 2, 0, 0 and 2 (the new adapter
        // moves no home, or one whose place it takes).
        for (slots, n) in [
            (vec![4, 4, 4, 4], 16),
            (vec![16, 4, 4, 4], 28),
            (vec![8, 8, 4, 4], 24),
            (vec![8; 8], 64),
        ] {
            let (a, _) = homes(n, &slots);
            let (b, _) = homes(n + 1, &slots);
            let moved = a.iter().filter(|(k, v)| b[*k] != **v).count();
            assert!(moved <= 2, "{slots:?} {n} -> {}: {moved} moved", n + 1);
        }
    }

    #[test]
    fn same_inputs_same_homes_whatever_the_order() {
        let mut adapters: Vec<u64> = (0..16).map(|i| adapter_key(&format!("x{i}"))).collect();
        let ps = pods(5, 4);
        let a = partition(&adapters, &ps);
        adapters.reverse();
        let mut ps2 = ps.clone();
        ps2.reverse();
        assert_eq!(a, partition(&adapters, &ps2));
    }

    proptest::proptest! {
        /// Capacity estimates move with load; when the adapters fill every slot, homes must not.
        #[test]
        fn full_pool_homes_ignore_capacity_jitter(
            w in proptest::collection::vec(0.5f64..2.0, 4),
            names in 0u32..1000,
        ) {
            let adapters: Vec<u64> =
                (0..16).map(|i| adapter_key(&format!("lora-{names}-{i}"))).collect();
            let even = pods(4, 4);
            let mut jittered = even.clone();
            for (p, w) in jittered.iter_mut().zip(&w) {
                p.weight = *w;
            }
            proptest::prop_assert_eq!(partition(&adapters, &even), partition(&adapters, &jittered));
        }

        /// Below the slot limit capacity sets the quotas; a change of one pod's weight moves
        /// no more adapters than the quotas it changes.
        #[test]
        fn a_quota_change_moves_few_homes(w in 1.0f64..2.0, names in 0u32..1000) {
            let adapters: Vec<u64> = (0..10).map(|i| adapter_key(&format!("t-{names}-{i}"))).collect();
            let even = pods(4, 8);
            let mut faster = even.clone();
            faster[0].weight = w;
            let (a, b) = (partition(&adapters, &even), partition(&adapters, &faster));
            let moved = a.iter().filter(|(k, v)| b[*k] != **v).count();
            let (ca, cb) = (counts(&a, &even), counts(&b, &even));
            let quota_shift: usize = ca.iter().zip(&cb).map(|(x, y)| x.abs_diff(*y)).sum();
            proptest::prop_assert!(moved <= quota_shift.max(1) * 2, "{moved} moved, counts {ca:?} -> {cb:?}");
        }
    }

    #[test]
    fn no_pods_no_homes() {
        assert!(partition(&[1, 2], &[]).is_empty());
    }
}
