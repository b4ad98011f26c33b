//! Hash maps keyed by values that need no hashing: xxh3 outputs (already uniform) and small
//! integer ids handed out by a host (spread with one multiply). SipHash, the std default, costs
//! more than the lookups it guards on the filter's per-request path.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// See the module docs. Keys other than `u64`, `u32` and `usize` fall back to folding their
/// bytes.
#[derive(Default)]
pub struct IdHasher(u64);

/// Spreads a small sequential id over all 64 bits (Fibonacci hashing): hashbrown picks the bucket
/// from the low bits and the control byte from the top 7, and both must differ between ids.
fn spread(id: u64) -> u64 {
    id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        // Keys are already xxh3 outputs: uniformly distributed.
        self.0 = v;
    }
    fn write_u32(&mut self, n: u32) {
        // Small sequential ids handed out by the host.
        self.0 = spread(u64::from(n));
    }
    fn write_usize(&mut self, n: usize) {
        // Small sequential ids too (metric ids). Folding their bytes would leave the low bits,
        // which pick the bucket, zero for every key.
        self.0 = spread(n as u64);
    }
}

/// A `HashMap` with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// FxHash-style hashing of names (pool, model and metric names), eight bytes per multiply.
/// Only for maps whose keys come from the configuration: a lookup with a client-chosen name
/// (the `model` of a body) cannot add entries, so no one can make a bucket grow.
#[derive(Default)]
pub struct NameHasher(u64);

impl NameHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        // The tail byte by byte, not copied into a buffer: a copy of a variable length is a
        // `memory.copy` on wasm32, which V8 runs as a call out of the wasm code.
        let tail = chunks.remainder();
        let w = tail
            .iter()
            .rev()
            .fold(0u64, |w, b| (w << 8) | u64::from(*b));
        self.add(w ^ ((tail.len() as u64) << 56));
    }
}

/// A `HashMap` with [`NameHasher`], for names from the configuration.
pub type NameMap<K, V> = HashMap<K, V, BuildHasherDefault<NameHasher>>;

/// A bounded map keyed by hashes: two generations of `half` entries each. When the current one
/// is full and a new key comes, the previous is dropped and the current becomes the previous
/// (an approximate LRU with O(1) work and no per-entry bookkeeping). Writing a key through
/// [`Generations::entry`] moves it into the current generation, carrying its value over. The
/// learned prefix index and the table of stored responses are built on it.
pub struct Generations<V> {
    cur: IdMap<u64, V>,
    prev: IdMap<u64, V>,
    half: usize,
}

impl<V: Copy + Default> Generations<V> {
    /// At most `2 * half` entries. Grows on demand: nothing is allocated until a key is written.
    pub fn new(half: usize) -> Self {
        Generations {
            cur: IdMap::default(),
            prev: IdMap::default(),
            half: half.max(1),
        }
    }

    pub fn get(&self, key: u64) -> Option<&V> {
        self.cur.get(&key).or_else(|| self.prev.get(&key))
    }

    /// The value of `key` in the current generation, to write: carried over from the previous
    /// generation when it is there, else the default.
    pub fn entry(&mut self, key: u64) -> &mut V {
        if self.cur.len() >= self.half && !self.cur.contains_key(&key) {
            self.prev = std::mem::take(&mut self.cur);
        }
        let base = self.prev.get(&key).copied().unwrap_or_default();
        self.cur.entry(key).or_insert(base)
    }

    /// Entries held (both generations; a key carried over counts in both until the previous is
    /// dropped).
    pub fn len(&self) -> usize {
        self.cur.len() + self.prev.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_maps_find_what_they_hold_and_nothing_else() {
        let names: Vec<String> = (0..500)
            .map(|i| format!("pool-{i}.model/{}", "x".repeat(i % 19)))
            .collect();
        let mut m = NameMap::default();
        for (i, n) in names.iter().enumerate() {
            m.insert(n.clone(), i);
        }
        for (i, n) in names.iter().enumerate() {
            assert_eq!(m.get(n.as_str()), Some(&i));
        }
        // Names that differ only in length or in a trailing byte stay apart.
        assert_eq!(m.get("pool-0.model/"), Some(&0));
        assert_eq!(m.get("pool-0.model/\0"), None);
        assert_eq!(m.get(""), None);
    }

    #[test]
    fn small_ids_spread_over_the_buckets() {
        // hashbrown picks the bucket from the low bits: sequential ids must not share them.
        let low = |h: u64| h & 63;
        let hash = |f: &dyn Fn(&mut IdHasher)| {
            let mut h = IdHasher::default();
            f(&mut h);
            h.finish()
        };
        let usize_buckets: std::collections::HashSet<u64> = (0..64usize)
            .map(|i| low(hash(&|h| h.write_usize(i))))
            .collect();
        let u32_buckets: std::collections::HashSet<u64> =
            (0..64u32).map(|i| low(hash(&|h| h.write_u32(i)))).collect();
        assert!(usize_buckets.len() >= 32, "{}", usize_buckets.len());
        assert!(u32_buckets.len() >= 32, "{}", u32_buckets.len());
        let mut m: IdMap<usize, usize> = IdMap::default();
        for i in 0..1_000 {
            m.insert(i, i * 2);
        }
        assert!((0..1_000).all(|i| m.get(&i) == Some(&(i * 2))));
        assert_eq!(m.get(&1_000), None);
    }
}
