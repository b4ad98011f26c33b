//! The registry of live proxy-wasm workers in Envoy shared data: which worker ids are taken, so
//! that a worker reads the in-flight tables and prefix records of live workers only, and ids are
//! reused instead of growing with every plugin configuration.
//!
//! Envoy creates a plugin instance per worker thread (and one on the main thread) for each plugin
//! configuration, and a new set whenever the configuration changes (an xDS update of the
//! filter). Each instance that routes takes the lowest free id when it routes its first request;
//! the main thread's instance never routes, so it never takes one. When Envoy removes a
//! configuration it deletes its instances, which release their ids. The readers therefore touch
//! the live workers' keys only, however many configurations came and went (with ids that only
//! grew, every exchange read every dead worker's table too).
//!
//! The value is `GPW1`, a generation (incremented by every take) and a bitmap of taken ids. A
//! worker bases its sequence numbers on the generation of its take, so a reader that still
//! remembers the sequence of an id's previous holder does not skip the new holder's records.

const MAGIC: &[u8; 4] = b"GPW1";
const HEADER: usize = 4 + 8;

/// Ids are below this: far beyond any Envoy's worker threads times live plugin configurations.
/// It bounds the registry's size (512 bytes of bitmap) and what a reader trusts from it.
pub const MAX_WORKERS: u32 = 4096;

/// Bits of a sequence number left to one holder of an id: its sequences run from
/// `generation << SEQ_BITS`, and 2^40 records (over three years at 10,000 requests/s) never
/// reach the next generation's.
pub const SEQ_BITS: u32 = 40;

/// The decoded registry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerSet {
    /// Incremented by every take.
    pub generation: u64,
    bits: Vec<u8>,
}

impl WorkerSet {
    /// Decodes the shared-data value; anything malformed is an empty registry (ids are then
    /// handed out again from 0: a reader sees at worst a stale table, which its version check
    /// leaves out).
    pub fn decode(bytes: &[u8]) -> WorkerSet {
        let Some(rest) = bytes.strip_prefix(MAGIC.as_slice()) else {
            return WorkerSet::default();
        };
        let Some((gen, bits)) = rest.split_first_chunk::<8>() else {
            return WorkerSet::default();
        };
        let n = bits.len().min(MAX_WORKERS as usize / 8);
        WorkerSet {
            generation: u64::from_le_bytes(*gen),
            bits: bits[..n].to_vec(),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let used = self.bits.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        let mut out = Vec::with_capacity(HEADER + used);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.bits[..used]);
        out
    }

    pub fn contains(&self, id: u32) -> bool {
        let (byte, bit) = (id as usize / 8, id % 8);
        self.bits.get(byte).is_some_and(|b| b & (1 << bit) != 0)
    }

    /// Takes the lowest free id and counts a generation; `None` when all `MAX_WORKERS` are taken.
    pub fn take(&mut self) -> Option<u32> {
        let id = (0..MAX_WORKERS).find(|id| !self.contains(*id))?;
        let byte = id as usize / 8;
        if self.bits.len() <= byte {
            self.bits.resize(byte + 1, 0);
        }
        self.bits[byte] |= 1 << (id % 8);
        self.generation = self.generation.wrapping_add(1);
        Some(id)
    }

    /// Frees `id` (a no-op if it is not taken).
    pub fn release(&mut self, id: u32) {
        if let Some(b) = self.bits.get_mut(id as usize / 8) {
            *b &= !(1 << (id % 8));
        }
    }

    /// The taken ids, ascending.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.bits.iter().enumerate().flat_map(|(i, b)| {
            (0..8u32)
                .filter(move |bit| b & (1 << bit) != 0)
                .map(move |bit| i as u32 * 8 + bit)
        })
    }

    pub fn len(&self) -> usize {
        self.bits.iter().map(|b| b.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Which of `n` peers one exchange reads when it may read at most `limit` of them: all when
/// they fit, else `limit` in turn from `cursor` (which it advances), so that each is read every
/// `ceil(n / limit)` exchanges. Indices into the peer list; the cursor moves at the call, so the
/// turn can be cloned for each pool.
pub fn in_turn(n: usize, limit: usize, cursor: &mut usize) -> Positions {
    let (start, count) = if limit >= n {
        (0, n)
    } else {
        let start = *cursor % n;
        *cursor = (start + limit) % n;
        (start, limit)
    };
    Positions {
        n,
        at: start,
        left: count,
    }
}

/// Positions in a peer list of `n`, `left` of them from `at`, wrapping around ([`in_turn`]).
#[derive(Debug, Clone)]
pub struct Positions {
    n: usize,
    at: usize,
    left: usize,
}

impl Iterator for Positions {
    type Item = usize;

    fn next(&mut self) -> Option<usize> {
        if self.left == 0 {
            return None;
        }
        let i = self.at;
        self.left -= 1;
        self.at = if i + 1 == self.n { 0 } else { i + 1 };
        Some(i)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// The order in which a worker reads its peers' tables: a bounded number in turn on each
/// exchange of the request path ([`in_turn`]), and on the tick the ones those exchanges did not
/// reach since the tick before. Between two ticks every peer is read at least once (at the
/// latest by the second), so no table a worker holds is older than two ticks, and a worker
/// under load, whose exchanges went round all its peers within the tick, reads none on the tick.
#[derive(Debug, Default, Clone)]
pub struct Turn {
    cursor: usize,
    /// Peers read since the last tick, in consecutive turns (saturating).
    since_tick: usize,
}

impl Turn {
    /// An exchange on the request path: at most `limit` of `n` peers, in turn.
    pub fn exchange(&mut self, n: usize, limit: usize) -> Positions {
        let turn = in_turn(n, limit, &mut self.cursor);
        self.since_tick = self.since_tick.saturating_add(n.min(limit));
        turn
    }

    /// The tick: the peers the exchanges since the last tick did not read, which continue their
    /// turn; all of them if the peer list `changed` since the last tick (the turn's positions
    /// then no longer name the same peers).
    pub fn tick(&mut self, n: usize, changed: bool) -> Positions {
        let left = if changed {
            n
        } else {
            n.saturating_sub(self.since_tick)
        };
        self.since_tick = 0;
        in_turn(n, left, &mut self.cursor)
    }
}

/// The first sequence number of the holder that took its id at `generation`.
pub fn seq_base(generation: u64) -> u64 {
    (generation % (1 << (64 - SEQ_BITS))) << SEQ_BITS
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn takes_the_lowest_free_id_and_reuses_released_ones() {
        let mut s = WorkerSet::default();
        assert_eq!(s.take(), Some(0));
        assert_eq!(s.take(), Some(1));
        assert_eq!(s.take(), Some(2));
        s.release(1);
        assert_eq!(s.ids().collect::<Vec<_>>(), vec![0, 2]);
        assert_eq!(s.take(), Some(1));
        assert_eq!(s.take(), Some(3));
        assert_eq!(s.generation, 5);
        assert_eq!(s.len(), 4);
    }

    #[test]
    fn round_trips_and_trims_free_tail() {
        let mut s = WorkerSet::default();
        for _ in 0..20 {
            s.take();
        }
        for id in 9..20 {
            s.release(id);
        }
        let bytes = s.encode();
        // Ids 0..9 fit in two bytes; the released tail is not stored.
        assert_eq!(bytes.len(), HEADER + 2);
        assert_eq!(WorkerSet::decode(&bytes), {
            let mut t = s.clone();
            t.bits.truncate(2);
            t
        });
        assert_eq!(WorkerSet::decode(&bytes).ids().count(), 9);
    }

    #[test]
    fn garbage_is_an_empty_registry() {
        for bad in [
            &b""[..],
            b"GPW1",
            b"GPW1\x01\x02",
            b"XXXX\x01\0\0\0\0\0\0\0\xff",
        ] {
            let s = WorkerSet::decode(bad);
            assert!(s.is_empty(), "{bad:?}");
            assert_eq!(s.generation, 0);
        }
    }

    #[test]
    fn full_registry_takes_nothing() {
        let mut bytes = MAGIC.to_vec();
        bytes.extend_from_slice(&7u64.to_le_bytes());
        // More bitmap than MAX_WORKERS allows: the excess is ignored.
        bytes.extend(std::iter::repeat_n(0xff, MAX_WORKERS as usize / 8 + 10));
        let mut s = WorkerSet::decode(&bytes);
        assert_eq!(s.len(), MAX_WORKERS as usize);
        assert_eq!(s.take(), None);
        assert_eq!(s.generation, 7);
        s.release(4095);
        assert_eq!(s.take(), Some(4095));
    }

    #[test]
    fn peers_are_read_in_turn_when_they_do_not_all_fit() {
        let mut cursor = 0;
        let mut turn = |n, limit| in_turn(n, limit, &mut cursor).collect::<Vec<_>>();
        // All fit: all, and the turn does not move.
        assert_eq!(turn(3, 4), vec![0, 1, 2]);
        assert_eq!(turn(0, 4), Vec::<usize>::new());
        // Seven peers, three a time: every one within three exchanges, wrapping around.
        assert_eq!(turn(7, 3), vec![0, 1, 2]);
        assert_eq!(turn(7, 3), vec![3, 4, 5]);
        assert_eq!(turn(7, 3), vec![6, 0, 1]);
        // The list shrank under the cursor: it still stays inside the list.
        assert_eq!(turn(2, 1), vec![0]);
        assert_eq!(turn(2, 1), vec![1]);
        assert_eq!(turn(2, 1), vec![0]);
    }

    #[test]
    fn the_tick_reads_what_the_exchanges_did_not_reach() {
        let mut t = Turn::default();
        let read = |it: &mut dyn Iterator<Item = usize>| it.collect::<Vec<_>>();
        // Seven peers, three an exchange: two exchanges leave one for the tick.
        assert_eq!(read(&mut t.exchange(7, 3)), vec![0, 1, 2]);
        assert_eq!(read(&mut t.exchange(7, 3)), vec![3, 4, 5]);
        assert_eq!(read(&mut t.tick(7, false)), vec![6]);
        // Three exchanges went round them all: the tick reads none, and the turn goes on.
        assert_eq!(read(&mut t.exchange(7, 3)), vec![0, 1, 2]);
        assert_eq!(read(&mut t.exchange(7, 3)), vec![3, 4, 5]);
        assert_eq!(read(&mut t.exchange(7, 3)), vec![6, 0, 1]);
        assert_eq!(read(&mut t.tick(7, false)), Vec::<usize>::new());
        assert_eq!(read(&mut t.exchange(7, 3)), vec![2, 3, 4]);
        // The peer list changed since the last tick: all of them.
        assert_eq!(read(&mut t.tick(7, true)).len(), 7);
        // No exchange between two ticks (an idle worker): all of them.
        assert_eq!(read(&mut t.tick(7, false)).len(), 7);
        // All fit in an exchange: the tick after one reads none.
        assert_eq!(read(&mut t.exchange(3, 4)), vec![0, 1, 2]);
        assert_eq!(read(&mut t.tick(3, false)), Vec::<usize>::new());
    }

    #[test]
    fn a_later_generation_sequences_after_an_earlier_one() {
        // The previous holder's sequences stay below the next holder's first one.
        let old_last = seq_base(41) + (1 << SEQ_BITS) - 1;
        assert!(seq_base(42) > old_last);
        assert_eq!(seq_base(0), 0);
    }

    proptest! {
        #[test]
        fn every_peer_is_read_within_its_turns(n in 0usize..40, limit in 1usize..10, start in any::<usize>()) {
            let mut cursor = start;
            let rounds = n.div_ceil(limit);
            let mut seen = vec![0u32; n];
            for _ in 0..rounds {
                let turn: Vec<usize> = in_turn(n, limit, &mut cursor).collect();
                prop_assert_eq!(turn.len(), n.min(limit));
                for i in turn {
                    prop_assert!(i < n);
                    seen[i] += 1;
                }
            }
            // Each peer read at least once in ceil(n / limit) exchanges, and none more than twice.
            prop_assert!(seen.iter().all(|&c| (1..=2).contains(&c)), "{:?}", seen);
        }

        #[test]
        fn between_two_ticks_every_peer_is_read(
            n in 0usize..40,
            limit in 1usize..10,
            start in 0usize..40,
            ops in proptest::collection::vec(0usize..12, 1..30),
        ) {
            // Each op: that many exchanges, then a tick.
            let mut t = Turn::default();
            for _ in 0..start {
                let _ = t.exchange(n, limit);
            }
            let _ = t.tick(n, false);
            for exchanges in ops {
                let mut seen = vec![false; n];
                let mut reads = 0;
                for _ in 0..exchanges {
                    for i in t.exchange(n, limit) {
                        prop_assert!(i < n);
                        seen[i] = true;
                        reads += 1;
                    }
                }
                let on_tick: Vec<usize> = t.tick(n, false).collect();
                // The tick reads only what is left, nothing once the exchanges went round.
                prop_assert_eq!(on_tick.len(), n.saturating_sub(reads));
                for i in on_tick {
                    prop_assert!(i < n);
                    seen[i] = true;
                }
                prop_assert!(seen.iter().all(|&s| s), "{:?}", seen);
            }
        }

        #[test]
        fn ids_are_unique_and_dense(ops in proptest::collection::vec(any::<Option<u8>>(), 0..200)) {
            // Some(i): release the i-th taken id (mod count); None: take.
            let mut s = WorkerSet::default();
            let mut model: Vec<u32> = Vec::new();
            for op in ops {
                match op {
                    None => {
                        let id = s.take().unwrap();
                        prop_assert!(!model.contains(&id));
                        // The lowest free one.
                        prop_assert!((0..id).all(|i| model.contains(&i)));
                        model.push(id);
                    }
                    Some(i) if !model.is_empty() => {
                        let id = model.remove(i as usize % model.len());
                        s.release(id);
                    }
                    Some(_) => {}
                }
                let s2 = WorkerSet::decode(&s.encode());
                let mut sorted = model.clone();
                sorted.sort_unstable();
                prop_assert_eq!(s2.ids().collect::<Vec<_>>(), sorted);
                prop_assert_eq!(s2.generation, s.generation);
            }
        }
    }
}

/// Ticks in a row with nothing to exchange after which a worker's tick period starts to grow.
pub const IDLE_TICKS: u32 = 5;

/// The tick period after a tick (ms): `base` while the worker had something to exchange in the
/// last `IDLE_TICKS` ticks (`idle_ticks` counts the quiet ones in a row), then doubling from
/// `current` up to `idle_max` (never under `base`: an `idle_max` at or under it turns the
/// growth off).
pub fn tick_period(current: u64, base: u64, idle_max: u64, idle_ticks: u32) -> u64 {
    let top = idle_max.max(base);
    if idle_ticks < IDLE_TICKS {
        base
    } else {
        current.max(base).saturating_mul(2).min(top)
    }
}

#[cfg(test)]
mod tick_tests {
    use super::*;

    #[test]
    fn an_idle_worker_ticks_less_and_less_often_up_to_the_limit() {
        // active, or not idle long enough: the base period
        assert_eq!(tick_period(20, 20, 320, 0), 20);
        assert_eq!(tick_period(320, 20, 320, 0), 20);
        assert_eq!(tick_period(20, 20, 320, IDLE_TICKS - 1), 20);
        // then doubling, up to the limit
        let mut p = 20;
        let mut seen = vec![];
        for quiet in IDLE_TICKS..IDLE_TICKS + 6 {
            p = tick_period(p, 20, 320, quiet);
            seen.push(p);
        }
        assert_eq!(seen, [40, 80, 160, 320, 320, 320]);
        // a limit that is not a power-of-two multiple is reached exactly
        assert_eq!(tick_period(160, 20, 250, IDLE_TICKS), 250);
        // a limit at or under the base (0 included) turns the growth off
        for limit in [0, 10, 20] {
            assert_eq!(tick_period(20, 20, limit, 100), 20);
        }
        assert_eq!(tick_period(u64::MAX, 20, u64::MAX, 100), u64::MAX);
    }
}
