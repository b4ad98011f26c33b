//! LoRA adapter slots on the GPU: `max_loras` slots, filled on demand and evicted least
//! recently used, after vLLM's `LRUCacheWorkerLoRAManager`. The scheduler guarantees that the
//! adapters of one batch never exceed the slot count (vLLM v1's `max_loras` check), so a batch
//! can always be made resident by evicting adapters the batch does not use.

/// Index of an adapter in its pod's adapter list.
pub type AdapterId = u16;

/// The adapter slots of one pod.
#[derive(Debug, Clone)]
pub struct LoraSlots {
    max: usize,
    // (adapter, tick of last use); at most `max` entries
    resident: Vec<(AdapterId, u64)>,
    tick: u64,
    loads: u64,
}

impl LoraSlots {
    /// Empty slots.
    pub fn new(max_loras: usize) -> Self {
        LoraSlots {
            max: max_loras,
            resident: Vec::with_capacity(max_loras),
            tick: 0,
            loads: 0,
        }
    }

    /// Number of slots.
    pub fn max_loras(&self) -> usize {
        self.max
    }

    /// Whether an adapter is loaded.
    pub fn is_resident(&self, id: AdapterId) -> bool {
        self.resident.iter().any(|&(a, _)| a == id)
    }

    /// Loaded adapters, most recently used first.
    pub fn resident(&self) -> Vec<AdapterId> {
        let mut r = self.resident.clone();
        r.sort_by_key(|e| std::cmp::Reverse(e.1));
        r.into_iter().map(|(a, _)| a).collect()
    }

    /// Adapter loads so far.
    pub fn loads(&self) -> u64 {
        self.loads
    }

    /// Makes every adapter of a batch resident, loading the missing ones into free slots or in
    /// place of the least recently used adapter outside the batch. Returns how many were loaded.
    /// Adapters that cannot be placed (the batch holds more distinct adapters than slots, which
    /// the scheduler prevents) are skipped.
    pub fn activate(&mut self, batch: &[AdapterId]) -> u32 {
        self.tick += 1;
        let tick = self.tick;
        for entry in self.resident.iter_mut() {
            if batch.contains(&entry.0) {
                entry.1 = tick;
            }
        }
        let mut loaded = 0;
        for &a in batch {
            if self.is_resident(a) {
                continue;
            }
            if self.resident.len() < self.max {
                self.resident.push((a, tick));
            } else {
                let victim = self
                    .resident
                    .iter()
                    .enumerate()
                    .filter(|(_, (r, _))| !batch.contains(r))
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(i, _)| i);
                match victim {
                    Some(i) => self.resident[i] = (a, tick),
                    None => continue,
                }
            }
            loaded += 1;
        }
        self.loads += u64::from(loaded);
        loaded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_slot_loads_then_lru_outside_batch_is_evicted() {
        let mut s = LoraSlots::new(2);
        assert_eq!(s.activate(&[0]), 1);
        assert_eq!(s.activate(&[1]), 1);
        assert_eq!(s.activate(&[0]), 0); // 0 is now more recent than 1
        assert_eq!(s.activate(&[2]), 1); // evicts 1, the LRU
        assert!(s.is_resident(0) && s.is_resident(2) && !s.is_resident(1));
        assert_eq!(s.loads(), 3);
        assert_eq!(s.resident(), vec![2, 0]);
    }

    #[test]
    fn adapters_in_the_batch_are_never_evicted() {
        let mut s = LoraSlots::new(2);
        s.activate(&[0, 1]);
        // 1 is older than 0 is not true here (same tick); batch [1, 2] must evict 0, not 1
        assert_eq!(s.activate(&[1, 2]), 1);
        assert!(s.is_resident(1) && s.is_resident(2) && !s.is_resident(0));
        // more distinct adapters than slots: the extra one is skipped, nothing in the batch evicted
        assert_eq!(s.activate(&[1, 2, 3]), 0);
        assert!(!s.is_resident(3));
    }
}
