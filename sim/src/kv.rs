//! The paged KV cache: a fixed pool of blocks with reference counts, a prefix-cache index from
//! block hash to block, and a free queue ordered for LRU eviction, after vLLM v1's
//! `BlockPool`/`FreeKVCacheBlockQueue`. A freed block keeps its hash (and so stays a cache hit)
//! until it is reallocated; allocation takes the least recently freed block first.

use std::collections::HashMap;

/// Index of a block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// The block pool of one pod.
#[derive(Debug, Clone)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    hash: Vec<Option<u64>>,
    // intrusive doubly linked free list: head is evicted first, tail was freed last
    prev: Vec<u32>,
    next: Vec<u32>,
    in_free: Vec<bool>,
    head: u32,
    tail: u32,
    free_count: u32,
    cached: HashMap<u64, BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` free, empty blocks.
    pub fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        let mut pool = BlockPool {
            ref_cnt: vec![0; n],
            hash: vec![None; n],
            prev: vec![NIL; n],
            next: vec![NIL; n],
            in_free: vec![false; n],
            head: NIL,
            tail: NIL,
            free_count: 0,
            cached: HashMap::new(),
        };
        for b in 0..num_blocks {
            pool.push_tail(b);
        }
        pool
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Blocks with no reference (empty or cached-evictable).
    pub fn num_free(&self) -> u32 {
        self.free_count
    }

    /// vLLM's `kv_cache_usage_perc`: 1 - free / total (cached but unreferenced blocks count as free).
    pub fn usage(&self) -> f64 {
        let total = self.num_blocks();
        if total == 0 {
            return 0.0;
        }
        1.0 - f64::from(self.free_count) / f64::from(total)
    }

    /// Blocks that hold a registered hash (cached), whether referenced or not.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// The blocks holding the longest cached prefix of `hashes`, without touching them.
    pub fn lookup_prefix(&self, hashes: &[u64]) -> Vec<BlockId> {
        let mut out = Vec::new();
        for h in hashes {
            match self.cached.get(h) {
                Some(&b) => out.push(b),
                None => break,
            }
        }
        out
    }

    /// How many of `blocks` are currently unreferenced (they sit in the free queue, so taking a
    /// reference removes them from the free count).
    pub fn count_unreferenced(&self, blocks: &[BlockId]) -> u32 {
        blocks
            .iter()
            .filter(|&&b| self.ref_cnt.get(b as usize).copied() == Some(0))
            .count() as u32
    }

    /// Takes a reference to a cached block found by [`lookup_prefix`](Self::lookup_prefix).
    pub fn touch(&mut self, block: BlockId) {
        let i = block as usize;
        if i >= self.ref_cnt.len() {
            return;
        }
        if self.ref_cnt[i] == 0 {
            self.unlink(block);
        }
        self.ref_cnt[i] += 1;
    }

    /// Allocates the least recently freed block, evicting its cached hash. `None` if every
    /// block is referenced.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink(b);
        let i = b as usize;
        if let Some(h) = self.hash[i].take() {
            if self.cached.get(&h) == Some(&b) {
                self.cached.remove(&h);
            }
        }
        self.ref_cnt[i] = 1;
        Some(b)
    }

    /// Drops one reference to each block; unreferenced blocks join the free queue in the given
    /// order (callers pass a sequence's blocks tail first, so its last blocks are evicted first,
    /// as vLLM does).
    pub fn free<I: IntoIterator<Item = BlockId>>(&mut self, blocks: I) {
        for b in blocks {
            let i = b as usize;
            if i >= self.ref_cnt.len() || self.ref_cnt[i] == 0 {
                continue;
            }
            self.ref_cnt[i] -= 1;
            if self.ref_cnt[i] == 0 {
                self.push_tail(b);
            }
        }
    }

    /// Registers a full block's content hash so later requests can hit it. A hash already held
    /// by another block keeps the first block (the duplicate is not indexed).
    pub fn set_hash(&mut self, block: BlockId, hash: u64) {
        let i = block as usize;
        if i >= self.hash.len() || self.hash[i].is_some() {
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(block);
            self.hash[i] = Some(hash);
        }
    }

    fn push_tail(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail != NIL {
            self.next[self.tail as usize] = b;
        } else {
            self.head = b;
        }
        self.tail = b;
        self.in_free[i] = true;
        self.free_count += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        if !self.in_free[i] {
            return;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_free[i] = false;
        self.free_count -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_stay_cached_until_reallocated() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate().unwrap();
        pool.set_hash(a, 11);
        pool.free([a]);
        assert_eq!(pool.lookup_prefix(&[11]), vec![a]);
        assert_eq!(pool.num_free(), 4);
        // three other free blocks are older in the queue than `a`, so they go first
        for _ in 0..3 {
            let b = pool.allocate().unwrap();
            assert_ne!(b, a);
        }
        assert_eq!(pool.lookup_prefix(&[11]), vec![a]);
        // now `a` is the only free block: allocating it evicts the hash
        assert_eq!(pool.allocate(), Some(a));
        assert!(pool.lookup_prefix(&[11]).is_empty());
        assert_eq!(pool.allocate(), None);
    }

    #[test]
    fn lru_eviction_takes_least_recently_freed() {
        let mut pool = BlockPool::new(3);
        let blocks: Vec<_> = (0..3).map(|_| pool.allocate().unwrap()).collect();
        for (i, &b) in blocks.iter().enumerate() {
            pool.set_hash(b, 100 + i as u64);
        }
        // free in order 2, 0, 1: block 2 is least recently freed
        pool.free([blocks[2]]);
        pool.free([blocks[0]]);
        pool.free([blocks[1]]);
        // touching a cached block (a hit) takes it out of the eviction queue
        pool.touch(blocks[2]);
        assert_eq!(pool.allocate(), Some(blocks[0]));
        assert!(pool.lookup_prefix(&[100]).is_empty());
        assert_eq!(pool.lookup_prefix(&[102]), vec![blocks[2]]);
        assert_eq!(pool.lookup_prefix(&[101]), vec![blocks[1]]);
    }

    #[test]
    fn prefix_lookup_stops_at_first_miss_and_usage_counts_references() {
        let mut pool = BlockPool::new(8);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        pool.set_hash(a, 1);
        pool.set_hash(b, 2);
        assert_eq!(pool.lookup_prefix(&[1, 3, 2]), vec![a]);
        assert_eq!(pool.lookup_prefix(&[1, 2, 3]), vec![a, b]);
        assert!((pool.usage() - 0.25).abs() < 1e-12);
        assert_eq!(pool.count_unreferenced(&[a, b]), 0);
        pool.free([b, a]);
        assert_eq!(pool.count_unreferenced(&[a, b]), 2);
        assert_eq!(pool.usage(), 0.0);
    }
}
