//! Where each stored response lives (Responses API ids learned from the pods' answers), apart
//! from the prefix index.
//!
//! A server that keeps responses in its own memory (vLLM with its store enabled) can continue a
//! turn naming `previous_response_id` only on the pod that made that response. The id's key
//! once lived in the prefix index, where every routed prompt adds about a dozen anchors: on a
//! busy gateway an id was forgotten after a few thousand requests, seconds at high rates, and a
//! turn that came later went by load to a pod that does not have the response. Here each
//! response takes one entry, and only other responses push it out.
//!
//! Keys travel between workers and gateway replicas in the same records as prompt anchors
//! ([`crate::prefix::SyncRecord`]); a response's key carries a tag in bits 32-47
//! ([`response_key`]) so a receiver can tell it from a prompt's. Those bits are neither the ones
//! that pick a hash-table bucket (the low ones) nor the ones in its control bytes (the top 7).

use crate::idmap::Generations;
use crate::prefix;

/// Seed domain of stored responses' keys (Responses API ids).
const RESPONSE_DOMAIN: u64 = 0x7265_7370_6f6e_7365;

/// Bits 32-47 of every response key.
const TAG_MASK: u64 = 0xFFFF << 32;
const TAG: u64 = 0x7e5d << 32;

/// The key of a stored response's id: a hash of the id, tagged ([`is_response_key`]).
pub fn response_key(id: &str) -> u64 {
    prefix::conversation_key(id.as_bytes(), RESPONSE_DOMAIN) & !TAG_MASK | TAG
}

/// Whether a key received from another worker or replica is a response's. A prompt anchor has
/// the tag by chance once in 65,536; taken for a response's, it costs that one prompt its
/// affinity, nothing else (no request names it as a response).
pub fn is_response_key(key: u64) -> bool {
    key & TAG_MASK == TAG
}

/// Response key -> the pod that holds the response. Bounded: two generations of
/// `capacity / 2` entries ([`Generations`], as the prefix index). A response named again (a turn
/// continuing it) moves to the current generation, so a conversation in use is the last to be
/// forgotten: an entry lives at least `capacity / 2` further responses after it was last
/// learned or named.
pub struct ResponseTable {
    map: Generations<u64>,
}

impl ResponseTable {
    pub fn new(capacity: usize) -> Self {
        // Grows on demand: a gateway that serves no Responses API turns spends nothing.
        ResponseTable {
            map: Generations::new(capacity / 2),
        }
    }

    /// Records that the response `key` lives on `pod` (a newer record of the same key wins).
    pub fn insert(&mut self, key: u64, pod: u64) {
        *self.map.entry(key) = pod;
    }

    /// The pod holding the response `key`, if known.
    pub fn get(&self, key: u64) -> Option<u64> {
        self.map.get(key).copied()
    }

    /// [`ResponseTable::get`], moving an entry of the previous generation to the current one:
    /// for a turn that continues the response.
    pub fn get_and_keep(&mut self, key: u64) -> Option<u64> {
        self.get(key)?;
        Some(*self.map.entry(key))
    }

    /// Entries held (both generations).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_keys_are_tagged_and_still_tell_ids_apart() {
        let keys: Vec<u64> = (0..1000)
            .map(|i| response_key(&format!("resp_{i:032x}")))
            .collect();
        assert!(keys.iter().all(|k| is_response_key(*k)));
        let mut unique = keys.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), keys.len());
        // The bits a hash table uses still vary: the low ones (bucket) and the top 7 (control).
        assert!(keys.iter().any(|k| k & 0xFFFF != keys[0] & 0xFFFF));
        assert!(keys.iter().any(|k| k >> 57 != keys[0] >> 57));
        // Prompt anchors carry the tag only by chance.
        let mut anchors = Vec::new();
        let text = "some prompt text that runs on for a few blocks ".repeat(40);
        prefix::prompt_anchors(text.as_bytes(), 7, 64, 256, &mut anchors);
        assert!(anchors.len() > 5);
        assert!(anchors.iter().all(|a| !is_response_key(a.hash)));
        assert!(!is_response_key(prefix::conversation_key(b"resp_1", 0)));
    }

    #[test]
    fn an_entry_lives_until_half_the_capacity_of_newer_ones_came() {
        let mut t = ResponseTable::new(8);
        t.insert(1, 100);
        for k in 2..=4 {
            t.insert(k, 200);
        }
        // Four in the current generation; the fifth starts a new one, and the first four stay
        // readable in the previous.
        t.insert(5, 300);
        assert_eq!((t.get(1), t.get(5), t.len()), (Some(100), Some(300), 5));
        for k in 6..=8 {
            t.insert(k, 300);
        }
        assert_eq!(t.get(1), Some(100));
        // The ninth drops the first generation.
        t.insert(9, 300);
        assert_eq!((t.get(1), t.get(5), t.len()), (None, Some(300), 5));
        // A newer record of a key wins.
        t.insert(9, 400);
        assert_eq!(t.get(9), Some(400));
    }

    #[test]
    fn a_response_named_again_is_kept_with_the_newest() {
        let mut t = ResponseTable::new(8);
        t.insert(1, 100);
        t.insert(2, 200);
        for k in 3..=5 {
            t.insert(k, 300);
        }
        // 1 and 2 are in the previous generation now; 1 is named by a turn.
        assert_eq!(t.get_and_keep(1), Some(100));
        assert_eq!(t.get_and_keep(42), None);
        for k in 6..=8 {
            t.insert(k, 300);
        }
        // Another generation on: 2 is gone, 1 was kept.
        assert_eq!((t.get(1), t.get(2)), (Some(100), None));
        assert!(t.len() <= 8);
    }

    #[test]
    fn the_table_never_holds_more_than_its_capacity() {
        let mut t = ResponseTable::new(64);
        for k in 0..10_000u64 {
            t.insert(k.wrapping_mul(0x9E37_79B9_7F4A_7C15), k);
            if k % 7 == 0 {
                t.get_and_keep(k.wrapping_sub(20).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            }
            assert!(t.len() <= 64);
        }
        assert!(!t.is_empty());
    }
}
