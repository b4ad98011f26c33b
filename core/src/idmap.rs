//! Hash maps keyed by values that need no hashing: xxh3 outputs (already uniform) and small
//! integer ids handed out by a host (spread with one multiply). SipHash, the std default, costs
//! more than the lookups it guards on the filter's per-request path.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// See the module docs. Keys other than `u64`/`u32` fall back to folding their bytes.
#[derive(Default)]
pub struct IdHasher(u64);

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
        // Small sequential ids: spread the bits so hashbrown's top-7-bit control bytes differ.
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A `HashMap` with [`IdHasher`].
pub type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;
