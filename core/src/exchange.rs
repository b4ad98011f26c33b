//! Prefix records exchanged between gateway replicas.
//!
//! Within one Envoy the workers share their routing decisions (a prompt's prefix hashes and the
//! pod it went to) through shared data on the filter's tick ([`crate::prefix::SyncLog`]).
//! Separate gateway replicas share no memory: without this exchange they agree only on a new
//! conversation's rendezvous home, and a conversation that load moved off its home on one
//! replica goes home again on the other. `sidecar-metrics` relays the records between replicas
//! through the filter's ingest listener, at `ingest.prefix_path`, under the snapshot's token and
//! peer rule:
//!
//! - `GET {prefix_path}` with the header [`CURSOR_HEADER`] answers this Envoy's own decisions
//!   newer than the cursor: the body is `GPX1` records ([`crate::prefix::encode_records`]), the
//!   same header the cursor to send next (no cursor, or an unreadable one, asks for every
//!   record held). The proxy-wasm build's workers write their rings to shared data at most
//!   every [`EXPORT_MS`], and only while someone asked within [`WANTED_FOR_MS`]: a gateway
//!   without a relay pays nothing.
//! - `POST {prefix_path}` with a `GPX1` body gives other replicas' decisions; each worker
//!   applies them to its prefix index within a tick (proxy-wasm: from the import ring under
//!   [`IMPORT_ID`], read like one more worker's records).
//!
//! Imported records are never exported again, so a relay cannot loop. Records are hints: one
//! lost or applied twice costs at most one pick that ignores, or repeats, where a prefix went,
//! so the exchange has no acknowledgements or retries.

use crate::prefix::{append_record, SyncBoard, SyncLog, SyncRecord};
use crate::workers::MAX_WORKERS;

/// Request header of a `GET`'s cursor, and response header of the cursor to send next.
pub const CURSOR_HEADER: &str = "x-gpuroute-cursor";
/// A worker writes its outgoing records for the exchange at most this often (ms).
pub const EXPORT_MS: u64 = 50;
/// Workers export while the last `GET` is at most this old (ms).
pub const WANTED_FOR_MS: u64 = 10_000;
/// The board id (and `gpuroute.sync.<id>` ring) of the records imported from other replicas:
/// past every worker id, so workers read it like another worker's ring.
pub const IMPORT_ID: u32 = MAX_WORKERS;
/// Imported records kept in the import ring: a reader ticking at `idle_tick_ms` (320 ms) still
/// sees every record of a relay delivering up to ~12,000 a second.
pub const IMPORT_RING: usize = 4096;
/// Records one `POST` may carry.
pub const MAX_IMPORT_RECORDS: usize = 65_536;
/// Shared-data key of the time (ms, u64 little-endian) of the last `GET`.
pub const WANTED_KEY: &str = "gpuroute.prefix.wanted";
/// Shared-data key of this Envoy process's epoch (u64 little-endian, not 0): the proxy-wasm
/// build's ([`Export::of_envoy`]); the dynamic module keeps its own in the process.
pub const EPOCH_KEY: &str = "gpuroute.prefix.epoch";
/// The cursor entry that carries the epoch of the Envoy that wrote it: past every exporter id,
/// so builds from before it read it as an exporter they never have, and leave it out of the
/// cursor they answer with.
pub const EPOCH_ID: u32 = u32::MAX;

/// Shared-data key of worker `id`'s records as written for the exchange.
pub fn export_key(id: u32) -> String {
    format!("gpuroute.prefix.export.{id}")
}

/// Where a relay is in each exporter's records: the newest sequence received per exporter id
/// (kept as the workers' board keeps theirs), and the epoch of the Envoy process that wrote it.
/// Written `id:seq,id:seq`, ascending by id, the epoch last as [`EPOCH_ID`]`:epoch`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cursor {
    seqs: SyncBoard,
    /// 0: none (a cursor from a build before epochs, or none at all).
    epoch: u64,
}

impl Cursor {
    /// Reads a cursor. Anything malformed ends it there (the relay then receives again what it
    /// already has: harmless), at most `MAX_WORKERS` entries.
    pub fn parse(s: &str) -> Cursor {
        let mut c = Cursor::default();
        for part in s.split(',').take(MAX_WORKERS as usize + 1) {
            let Some((id, seq)) = part.split_once(':') else {
                break;
            };
            let (Ok(id), Ok(seq)) = (id.trim().parse::<u32>(), seq.trim().parse::<u64>()) else {
                break;
            };
            if id == EPOCH_ID {
                c.epoch = seq;
            } else if c.seqs.len() < MAX_WORKERS as usize {
                c.set(id, seq);
            }
        }
        c
    }

    /// The newest sequence received from exporter `id` (0: none yet).
    pub fn get(&self, id: u32) -> u64 {
        self.seqs.get(id).unwrap_or(0)
    }

    pub fn set(&mut self, id: u32, seq: u64) {
        self.seqs.set(id, seq);
    }

    pub fn encode(&self) -> String {
        let epoch = (self.epoch != 0).then_some((EPOCH_ID, self.epoch));
        let parts: Vec<String> = self
            .seqs
            .entries()
            .chain(epoch)
            .map(|(id, seq)| format!("{id}:{seq}"))
            .collect();
        parts.join(",")
    }
}

/// The answer to a `GET`, built from each live exporter's records.
#[derive(Debug)]
pub struct Export {
    after: Cursor,
    next: Cursor,
    body: Vec<u8>,
    records: usize,
}

impl Export {
    /// An answer after the cursor `after`, of an exporter without an epoch (a test's).
    pub fn new(after: Cursor) -> Export {
        Export::of_envoy(after, 0)
    }

    /// An answer of the Envoy process with `epoch` after the cursor `after`. A cursor another
    /// process wrote (the Envoy restarted under the relay, which kept its cursor; or a build
    /// from before epochs) says nothing of this one's records: every record held is sent. Before,
    /// a restarted Envoy whose exporters had routed past the old cursor by the relay's first ask
    /// had the records below it skipped ([`Export::after`] tells a restart only by records all
    /// older than the cursor).
    pub fn of_envoy(after: Cursor, epoch: u64) -> Export {
        let after = if after.epoch == epoch {
            after
        } else {
            Cursor::default()
        };
        Export {
            after,
            next: Cursor {
                epoch,
                ..Cursor::default()
            },
            body: b"GPX1".to_vec(),
            records: 0,
        }
    }

    /// Adds exporter `id`'s records newer than the cursor, from their encoding (a worker's
    /// shared-data value). The next cursor holds only the exporters added: a worker gone since
    /// drops out of it. The records are copied as they are encoded, not decoded.
    pub fn add_encoded(&mut self, id: u32, encoded: &[u8]) {
        let held = crate::prefix::encoded_after(encoded, 0)
            .last()
            .map(|(seq, _)| seq);
        let after = self.after(id, held);
        let mut newest = after;
        for (seq, bytes) in crate::prefix::encoded_after(encoded, after) {
            self.body.extend_from_slice(bytes);
            self.records += 1;
            newest = newest.max(seq);
        }
        self.next.set(id, newest);
    }

    /// Adds exporter `id`'s records newer than the cursor, from its log.
    pub fn add_log(&mut self, id: u32, log: &SyncLog) {
        let after = self.after(id, log.records_after(0).last().map(|r| r.seq));
        self.add(id, after, log.records_after(after));
    }

    /// Where exporter `id`'s records are read from, `held` its newest record (`None`: it holds
    /// none). Within one Envoy an exporter's sequence numbers only grow, so an exporter holding
    /// records that are all older than the cursor is a new one under the same id: the Envoy
    /// restarted while the relay beside it kept its cursor (the dynamic module's logs number
    /// from 1 again, the proxy-wasm workers from the same generation's base). It is read from
    /// its start. Before, its records were skipped until it had routed past the cursor: after
    /// a restart, as many decisions as the Envoy had routed before it (an audit, 2026-12-07:
    /// 0 of 10 relayed, then 9-14 of the next 45, with 40 routed before the restart).
    fn after(&self, id: u32, held: Option<u64>) -> u64 {
        let after = self.after.get(id);
        match held {
            Some(newest) if newest < after => 0,
            _ => after,
        }
    }

    fn add<'a>(&mut self, id: u32, after: u64, records: impl Iterator<Item = &'a SyncRecord>) {
        let mut newest = after;
        for r in records {
            append_record(&mut self.body, r);
            self.records += 1;
            newest = newest.max(r.seq);
        }
        self.next.set(id, newest);
    }

    /// Records in the answer.
    pub fn len(&self) -> usize {
        self.records
    }

    pub fn is_empty(&self) -> bool {
        self.records == 0
    }

    /// The body and the next cursor.
    pub fn finish(self) -> (Vec<u8>, String) {
        (self.body, self.next.encode())
    }
}

/// The import ring after taking `incoming`: the ring as stored (`slot`, possibly empty), the
/// new records numbered after its newest, the oldest dropped past [`IMPORT_RING`]. Returns the
/// encoding and its newest sequence (what the board then says for [`IMPORT_ID`]).
pub fn merge_import(slot: &[u8], incoming: &[SyncRecord]) -> (Vec<u8>, u64) {
    let mut held = Vec::new();
    SyncLog::decode_after(slot, 0, &mut held);
    let mut next = held.last().map_or(0, |r| r.seq);
    for r in incoming {
        next += 1;
        held.push(SyncRecord {
            seq: next,
            pod: r.pod,
            anchors: r.anchors.clone(),
        });
    }
    let skip = held.len().saturating_sub(IMPORT_RING);
    (crate::prefix::encode_records(held[skip..].iter()), next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::decode_records;

    fn log_of(pods: &[u64], start_after: u64) -> SyncLog {
        let mut log = SyncLog::new(8);
        log.start_after(start_after);
        for (i, p) in pods.iter().enumerate() {
            log.push(*p, &[i as u64 + 100, i as u64 + 200]);
        }
        log
    }

    #[test]
    fn cursors_round_trip_and_stop_at_garbage() {
        let mut c = Cursor::default();
        c.set(3, 30);
        c.set(1, 10);
        assert_eq!(c.encode(), "1:10,3:30");
        assert_eq!(Cursor::parse("1:10,3:30"), c);
        assert_eq!(Cursor::parse("1:10,x:3,3:30").encode(), "1:10");
        assert_eq!(Cursor::parse("").encode(), "");
        assert_eq!(Cursor::parse("-1:5"), Cursor::default());
        let long: Vec<String> = (0..5000).map(|i| format!("{i}:1")).collect();
        assert_eq!(
            Cursor::parse(&long.join(",")).seqs.len(),
            MAX_WORKERS as usize
        );
    }

    #[test]
    fn an_export_gives_each_exporters_records_after_the_cursor_once() {
        let a = log_of(&[11, 12, 13], 0);
        let b = log_of(&[21, 22], 1 << 40);
        let mut first = Export::new(Cursor::default());
        first.add_encoded(0, &a.encode());
        first.add_log(7, &b);
        assert_eq!(first.len(), 5);
        let (body, cursor) = first.finish();
        let pods: Vec<u64> = decode_records(&body, 100)
            .unwrap_or_default()
            .iter()
            .map(|r| r.pod)
            .collect();
        assert_eq!(pods, vec![11, 12, 13, 21, 22]);
        assert_eq!(cursor, format!("0:3,7:{}", (1u64 << 40) + 2));

        // The same rings again, one record newer on `a`: only that one.
        let mut a2 = a.clone();
        a2.push(14, &[1]);
        let mut second = Export::new(Cursor::parse(&cursor));
        second.add_encoded(0, &a2.encode());
        second.add_log(7, &b);
        assert_eq!(second.len(), 1);
        let (body, cursor2) = second.finish();
        assert_eq!(decode_records(&body, 100).map(|r| r[0].pod), Ok(14));
        assert_eq!(cursor2, format!("0:4,7:{}", (1u64 << 40) + 2));

        // An exporter that is gone drops out of the cursor; garbage in a ring adds nothing.
        let mut third = Export::new(Cursor::parse(&cursor2));
        third.add_encoded(0, b"garbage");
        assert!(third.is_empty());
        assert_eq!(third.finish().1, "0:4");
    }

    #[test]
    fn an_exporter_numbering_below_the_cursor_restarted_and_is_read_from_its_start() {
        // The cursor a relay kept from before the Envoy restarted: 40 records of exporter 0.
        let cursor = Cursor::parse("0:40,1:7");
        // After the restart, exporter 0 numbers from 1 again (the dynamic module's logs) and
        // routed 3 decisions before the relay asked; exporter 1 has none yet.
        let log = log_of(&[31, 32, 33], 0);
        let mut export = Export::new(cursor.clone());
        export.add_log(0, &log);
        export.add_log(1, &SyncLog::new(8));
        assert_eq!(export.len(), 3, "all of the restarted exporter's records");
        assert_eq!(
            export.finish().1,
            "0:3,1:7",
            "an exporter without records keeps its place"
        );
        // The same from a ring in shared data (the proxy-wasm workers).
        let mut export = Export::new(cursor.clone());
        export.add_encoded(0, &log.encode());
        assert_eq!(export.len(), 3);
        assert_eq!(export.finish().1, "0:3");
        // An exporter whose newest record is at or past the cursor is the same one: only the
        // records after it.
        let long = log_of(&(0..45).collect::<Vec<u64>>(), 0);
        let mut export = Export::new(cursor);
        export.add_log(0, &long);
        assert_eq!(export.len(), 5);
        assert_eq!(export.finish().1, "0:45");
    }

    #[test]
    fn a_cursor_of_another_envoy_process_reads_every_record() {
        let epoch = 0xfeed;
        let mut log = SyncLog::new(64);
        for pod in 0..50 {
            log.push(pod, &[pod + 100]);
        }
        // The relay's cursor from before the restart (40 records of exporter 0, another
        // epoch); the restarted Envoy routed 50 before the relay's first ask, past the cursor.
        let before = format!("0:40,{EPOCH_ID}:7");
        let mut export = Export::of_envoy(Cursor::parse(&before), epoch);
        export.add_log(0, &log);
        assert_eq!(
            export.len(),
            50,
            "every record, not the 10 past the old cursor"
        );
        let (_, cursor) = export.finish();
        assert_eq!(cursor, format!("0:50,{EPOCH_ID}:{epoch}"));
        // Its own cursor: only what is newer.
        let mut newer = log.clone();
        newer.push(99, &[1]);
        let mut export = Export::of_envoy(Cursor::parse(&cursor), epoch);
        export.add_log(0, &newer);
        assert_eq!(export.len(), 1);
        // A cursor without an epoch (a build from before them) is another process's too.
        let mut export = Export::of_envoy(Cursor::parse("0:40"), epoch);
        export.add_log(0, &log);
        assert_eq!(export.len(), 50);
        // Parsing keeps room for the epoch past a full cursor of exporters.
        let full: Vec<String> = (0..MAX_WORKERS)
            .map(|i| format!("{i}:1"))
            .chain([format!("{EPOCH_ID}:{epoch}")])
            .collect();
        let c = Cursor::parse(&full.join(","));
        assert_eq!((c.seqs.len(), c.epoch), (MAX_WORKERS as usize, epoch));
    }

    #[test]
    fn imports_are_renumbered_after_the_ring_and_bounded() {
        let incoming: Vec<SyncRecord> = (0..3)
            .map(|i| SyncRecord {
                seq: 999,
                pod: i,
                anchors: vec![i],
            })
            .collect();
        let (slot, newest) = merge_import(&[], &incoming);
        assert_eq!(newest, 3);
        let (slot, newest) = merge_import(&slot, &incoming);
        assert_eq!(newest, 6);
        let held = decode_records(&slot, 100).unwrap_or_default();
        let seqs: Vec<u64> = held.iter().map(|r| r.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3, 4, 5, 6]);

        let many: Vec<SyncRecord> = (0..IMPORT_RING as u64 + 10)
            .map(|i| SyncRecord {
                seq: 0,
                pod: i,
                anchors: vec![],
            })
            .collect();
        let (slot, newest) = merge_import(&slot, &many);
        assert_eq!(newest, 6 + IMPORT_RING as u64 + 10);
        let held = decode_records(&slot, IMPORT_RING).unwrap_or_default();
        assert_eq!(held.len(), IMPORT_RING);
        assert_eq!(held.last().map(|r| r.seq), Some(newest));
        // Readers that applied up to 6 read the rest after it.
        let mut after = Vec::new();
        SyncLog::decode_after(&slot, 6, &mut after);
        assert_eq!(after.len(), IMPORT_RING);
    }

    #[test]
    fn imported_bodies_are_checked_whole() {
        let log = log_of(&[1, 2], 0);
        let good = log.encode();
        assert_eq!(decode_records(&good, 10).map(|r| r.len()), Ok(2));
        assert_eq!(decode_records(b"GPX1", 10).map(|r| r.len()), Ok(0));
        assert!(decode_records(b"{\"x\":1}", 10).is_err());
        assert!(decode_records(&good[..good.len() - 1], 10).is_err());
        let mut trailing = good.clone();
        trailing.push(0);
        assert!(decode_records(&trailing, 10).is_err());
        assert!(decode_records(&good, 1).is_err());
    }
}
