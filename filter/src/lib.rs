//! gpuroute proxy-wasm filter: the thin shell between Envoy and `gpuroute-core`.
//!
//! Per request (see `Http`): strip client-supplied routing headers; answer `/v1/models` and the
//! snapshot ingest path; on inference paths pause the headers, buffer the body, let the core
//! parse, resolve and pick, then set `x-gateway-pool` / `x-gateway-model-name` /
//! `x-gateway-destination-endpoint` and continue. Every failure has a defined outcome: an
//! OpenAI-style error, or fail-open (destination left unset, Envoy's load balancer picks).
//!
//! Per worker (see `Worker`): the decoded snapshot (re-decoded only when the shared version
//! changes), the prefix index, its own in-flight tables, and an exchange with the other workers
//! through shared data: the registry of live workers, in-flight tables and the snapshot version
//! at most every `shared_refresh_ms` on the request path, prefix decisions on the tick. Workers
//! know each other from that registry of live worker ids (`gpuroute_core::workers`): a worker
//! takes the lowest free id with its first routed request and gives it back when Envoy deletes
//! its plugin instance, so the exchange reads live workers only, through any number of
//! configuration changes.
//!
//! The host calls in through [`abi`] (the ABI 0.2.1 exports, only those the filter uses) and is
//! called through [`host`]; neither can panic.

mod abi;
mod host;
mod stats;

use abi::{Action, BufferType, LogLevel, MapType};
use gpuroute_core::config::{DataPlane, FilterConfig};
use gpuroute_core::engine::{self, DecideOptions, Engine, Prepared, RequestContext};
use gpuroute_core::error::{ApiError, ErrorStyle};
use gpuroute_core::exchange::{self, Cursor, Export};
use gpuroute_core::fleet::FleetState;
use gpuroute_core::form;
use gpuroute_core::headers::{self, RequestHead};
use gpuroute_core::hold::{HoldEvent, HoldQueue};
use gpuroute_core::idmap::{IdMap, NameMap};
use gpuroute_core::ingest::{
    self, Endpoint, Stored, StoredHeader, SNAPSHOT_BINARY_KEY, SNAPSHOT_KEY, SNAPSHOT_VERSION_KEY,
    STALE_WINDOW_KEY,
};
use gpuroute_core::load::{Completion, InFlight, LoadTable, PeerTables, SparseTable};
use gpuroute_core::outlier;
use gpuroute_core::picker::{Decision, HoldReason};
use gpuroute_core::prefix::{self, SyncBoard, SyncLog};
use gpuroute_core::replica_load::{self, ReplicaLoad, ReplicaLoads};
use gpuroute_core::request;
use gpuroute_core::rng::SplitMix64;
use gpuroute_core::routing::ModelsQuery;
use gpuroute_core::snapshot::Snapshot;
use gpuroute_core::workers::{self, Turn, WorkerSet};
use stats::Stats;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::rc::Rc;
use std::sync::Arc;

/// Size-class free lists in front of wasi-libc's dlmalloc ([`gpuroute_core::alloc`]): a request's
/// dozen allocations and frees at a few instructions each instead of ~250. The VM has one thread.
#[cfg(all(target_arch = "wasm32", not(target_feature = "atomics")))]
#[global_allocator]
static ALLOC: gpuroute_core::alloc::SizeClasses<std::alloc::System> =
    gpuroute_core::alloc::SizeClasses::new(std::alloc::System);

/// `memcmp` for the whole module, in place of wasi-libc's one-byte-per-step loop (the linker
/// takes this definition and leaves libc's out): string equality and every string-keyed map
/// lookup call it, ~10 times per request (`make profile-wasm-instr`: 875 instructions per request
/// in libc's, ~130 in this one). See [`gpuroute_core::bytes::compare`]. Being `#[no_mangle]`, it
/// is also one of the module's exports; hosts ignore exports they do not look for.
///
/// # Safety
/// C's contract: `a` and `b` readable for `n` bytes.
#[cfg(target_arch = "wasm32")]
#[no_mangle]
unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    if n == 0 {
        return 0;
    }
    // SAFETY: the caller's contract above.
    let (a, b) = unsafe {
        (
            std::slice::from_raw_parts(a, n),
            std::slice::from_raw_parts(b, n),
        )
    };
    gpuroute_core::bytes::compare(a, b)
}

/// Shared-data key of the registry of live workers (`gpuroute_core::workers`).
const WORKERS_KEY: &str = "gpuroute.workers.live";
/// The id of a worker that has not taken one (it has not routed yet, or the registry could not
/// be updated): its keys are ones nobody reads.
const UNREGISTERED: u32 = u32::MAX;
/// Attempts at a compare-and-swap update before giving up (the update is then skipped; the
/// next request or snapshot corrects it).
const CAS_ATTEMPTS: usize = 16;
/// A worker publishes the prefix records of its last this many publishes (each a tick in which
/// it routed), not its whole ring of 512 (~50 KB, which every other worker would copy and
/// decode each time): the others read every tick, so three leave two ticks of slack for a late
/// reader.
const SYNC_PUBLISHES: usize = 3;
/// A worker's decision-time histogram takes its first request and then, at random, one in this
/// many: the value costs a second clock read and a metric call, ~1% of a request's cost in Envoy.
const DECISION_SAMPLE: u64 = 8;

/// A pool this worker has not routed to for this long (ns) is left out of its exchanges: the
/// other workers' tables of it are read again, all at once, when it routes there next. Every
/// pool ever routed cost a table read per other worker at each exchange (once a millisecond under
/// load): 1,000 pools took a worker from 4,260 requests/s to 427 (a scale audit).
const POOL_IDLE_NS: u64 = 1_000_000_000;
/// A pool this worker has not routed to for this long (ns), with none of its requests in flight,
/// is dropped from its tables at the next snapshot (published once more, empty, first).
const POOL_DROP_NS: u64 = 60_000_000_000;

const JSON: &str = "application/json";

/// Shared-data key of one worker's in-flight table of `pool` in the dense form (`GPL2`), which
/// builds before the sparse form read: written on the tick (built once per pool and worker).
fn load_key(pool: &str, worker: u32) -> String {
    format!("gpuroute.load.{pool}.{worker}")
}
/// Shared-data key of one worker's in-flight table of `pool` in the sparse form (`GPL3`), which
/// this build reads and writes at every exchange. (`load2`, not `load.`: no pool name makes one
/// key the other.)
fn sparse_load_key(pool: &str, worker: u32) -> String {
    format!("gpuroute.load2.{pool}.{worker}")
}
/// A worker's table of `pool` as published: the sparse form, else (nothing there, or emptied
/// by a worker that gave the id back) the dense one, an earlier build's.
fn read_load(pool: &str, worker: u32) -> Option<SparseTable> {
    match host::get_shared(&sparse_load_key(pool, worker)).0 {
        Some(b) if !b.is_empty() => Some(SparseTable::decode(&b)),
        _ => host::get_shared(&load_key(pool, worker))
            .0
            .map(|b| SparseTable::decode(&b)),
    }
}
fn sync_key(id: u32) -> String {
    format!("gpuroute.sync.{id}")
}
/// Shared-data key of the newest published sequence of every worker's prefix records
/// (`SyncBoard`).
const SYNC_BOARD_KEY: &str = "gpuroute.sync.board";
/// The pods the workers ejected for their server errors ([`outlier::EjectionBoard`]): written
/// by a worker when it ejects one, read by every worker on its tick.
const EJECTIONS_KEY: &str = "gpuroute.outlier.ejected";

/// Per-plugin-instance state in one worker VM.
struct Worker {
    engine: Engine,
    fleet: Option<FleetState>,
    /// The version header last read from shared data (not the decoded version: a reader
    /// compares against what it saw, so a racing writer cannot make it re-decode every time).
    seen_header: Option<StoredHeader>,
    rng: SplitMix64,
    stats: Stats,
    /// This worker's id in the registry, taken with its first routed request; `UNREGISTERED`
    /// before (the main thread's instance never routes, so never takes one).
    id: u32,
    /// A take was tried (and, if `id` is still `UNREGISTERED`, failed: retried on the tick).
    register_tried: bool,
    /// The other live workers' ids, from the registry: read when this worker takes its id and
    /// at each exchange (`refresh_shared`).
    peers: Vec<u32>,
    /// Which of `peers`' tables the next exchange reads: `shared_peer_reads` in turn on the
    /// request path, the rest of the round on the tick (`workers::Turn`).
    turn: Turn,
    /// `peers` changed since the last tick (the tick then reads every table).
    peers_changed: bool,
    /// Live workers in the registry at the last read, this one included (the `gpuroute.workers`
    /// gauge).
    live: usize,
    /// Newest sync sequence applied per other worker.
    applied: HashMap<u32, u64>,
    /// The newest sequence of each of the last `SYNC_PUBLISHES` publishes of the prefix records
    /// (a ring, oldest at `publish_slot`): a publish carries the records after the oldest.
    publishes: [u64; SYNC_PUBLISHES],
    publish_slot: usize,
    /// This worker's in-flight view of each pool it has routed to.
    loads: NameMap<String, PoolLoad>,
    /// The request's view of its pool's in-flight requests (this worker's and the others'),
    /// kept between requests so that filling it allocates nothing.
    view: LoadTable,
    /// The snapshot version before the current one (other workers may still be on it).
    previous_version: Option<u64>,
    /// When the request path last exchanged with the other workers, and the interval.
    refreshed_ns: u64,
    /// When the exchange last ran (ns): the time `read_others` and `install_fleet` judge the
    /// pools' idleness by.
    exchange_ns: u64,
    /// The CAS of `EJECTIONS_KEY` as last read.
    ejections_cas: Option<u32>,
    published_ns: u64,
    refresh_ns: u64,
    /// Requests routed, for the decision-time sample.
    routed: u64,
    /// The tick period now (the configuration's `tick_ms`, or longer while idle:
    /// `idle_tick_ms`), `routed` at the last tick, and the ticks in a row with nothing to
    /// exchange.
    tick_now_ms: u64,
    /// When this worker's configuration was loaded (unix ms).
    started_ms: u64,
    routed_at_tick: u64,
    idle_ticks: u32,
    /// The exchange between gateway replicas: when this worker last looked whether its records
    /// are wanted, and the newest sequence it wrote for it.
    export_checked_ms: u64,
    exported_seq: u64,
    /// Requests held while their pool is saturated (`hold`), in the order they are to go.
    held: HoldQueue<Queued>,
    /// A request was just queued behind held requests of its pool: the held are to be decided
    /// again before its callback returns ([`Http::queued_behind`]).
    pass_due: bool,
    /// Other gateway replicas' requests in prefill (`ingest.load_path`), as last read from
    /// shared data, with the compare-and-swap value it was read at; and whether any were
    /// there (the request path reads them only then: a gateway without replicas spends
    /// nothing on it but a read on the tick).
    replicas: ReplicaLoads,
    replicas_cas: Option<u32>,
    replicas_seen: bool,
    /// This worker's requests sent to a pod and not answered yet, by stream context id, with
    /// passive health's `unanswered_ms` on ([`outlier::Unanswered`]); and the snapshot version
    /// the tick last judged them by (a verdict changes only with a new reading).
    unanswered: IdMap<u32, outlier::Unanswered>,
    unanswered_judged: u64,
}

/// One pool's in-flight requests as one worker sees them. Its own (sent, first byte, finished)
/// are exact and counted at once; the other workers' are read from their published tables at
/// most every `shared_refresh_ms` (and on the tick): with several workers under load, another
/// worker's request reaches this view ~1-2 ms after it was sent, a small part of a scrape
/// interval. With more than `shared_peer_reads` other workers, an exchange on the request path
/// reads that many of their tables in turn, so each is at most a few exchanges old. No
/// compare-and-swap: every table has one writer.
struct PoolLoad {
    /// Shared-data key `own` is published under in the dense form, for earlier builds.
    key: String,
    /// Shared-data key `own` is published under in the sparse form.
    sparse_key: String,
    /// When this worker last routed a request to the pool (ns): the exchange reads the other
    /// workers' tables only of pools it routed to within `POOL_IDLE_NS`.
    routed_ns: u64,
    /// This worker's requests, aligned with its snapshot.
    own: LoadTable,
    /// `own` changed since it was last published.
    dirty: bool,
    /// `own` changed since it was last published in the dense form (on the tick).
    dense_dirty: bool,
    /// The other workers' tables as last read.
    peer_tables: PeerTables,
    /// `peer_tables` of this snapshot (or the one before), summed (see `PeerTables::sum`).
    others: SparseTable,
    /// The other gateway replicas' requests in prefill on each pod, aligned with `own`.
    replicas: replica_load::Aligned,
}

impl PoolLoad {
    /// Reads the tables of `pool` that the workers `turn` published, then sums all the live
    /// workers' (`live`) tables held, for the snapshot `fleet` (or the one before it,
    /// `previous`). Nothing changes if the snapshot has no such pool.
    fn read_peers(
        &mut self,
        pool: &str,
        fleet: &FleetState,
        previous: Option<u64>,
        live: &[u32],
        turn: impl Iterator<Item = u32>,
    ) {
        let Some(p) = fleet.pool(pool) else {
            return;
        };
        self.peer_tables.retain_live(live);
        for other in turn {
            self.peer_tables.store(other, read_load(pool, other));
        }
        self.others = self.peer_tables.sum(fleet.version, &p.keys, previous);
    }
}

impl Worker {
    /// Re-reads the snapshot version; decodes the snapshot only when it changed.
    fn refresh_fleet(&mut self) {
        let (Some(hdr_bytes), _) = host::get_shared(SNAPSHOT_VERSION_KEY) else {
            return;
        };
        let Some(hdr) = StoredHeader::decode(&hdr_bytes) else {
            return;
        };
        if self.seen_header == Some(hdr) {
            return;
        }
        self.seen_header = Some(hdr);
        let binary = host::get_shared(SNAPSHOT_BINARY_KEY).0;
        match ingest::read_stored(hdr, binary.as_deref(), || host::get_shared(SNAPSHOT_KEY).0) {
            Stored::Found(snap, received_at_ms, json) => {
                if json {
                    self.stats.inc("gpuroute.snapshot.read_json");
                }
                self.install_fleet(snap, received_at_ms)
            }
            Stored::Missing => {}
            Stored::Unreadable => {
                host::log(LogLevel::Error, "gpuroute: stored snapshot is unreadable")
            }
        }
    }

    /// Makes `snap` this worker's snapshot, and re-bases its own in-flight tables on it (the
    /// snapshot reflects what was in flight when it was taken). The other workers' sums are
    /// read again with it (`refresh_shared`); until then the old sum, of another version, is
    /// left out of the view (`LoadTable::add_sparse`).
    fn install_fleet(&mut self, snap: Snapshot, received_at_ms: u64) {
        let fleet = FleetState::new(snap, received_at_ms);
        self.previous_version = self.fleet.as_ref().map(|f| f.version);
        let now_ns = self.exchange_ns;
        self.loads.retain(|pool, pl| {
            if let Some(p) = fleet.pool(pool) {
                pl.dirty |= pl.own.rebase(fleet.version, &p.keys);
            }
            let gone = now_ns.saturating_sub(pl.routed_ns) > POOL_DROP_NS && pl.own.is_idle();
            if gone {
                // Its last word: nothing in flight, on this snapshot. The others stop counting
                // the table once two snapshots newer than it came.
                let _ = host::set_shared(&pl.sparse_key, &pl.own.encode_sparse(), None);
                let _ = host::set_shared(&pl.key, &pl.own.encode(), None);
            }
            !gone
        });
        self.fleet = Some(fleet);
    }

    /// The exchange with the other workers: who they are (the registry, once this worker
    /// routes), the snapshot version (decoding a new snapshot), this worker's changed tables
    /// out, the others' in (on the request path `shared_peer_reads` of them in turn; on the
    /// `tick` those the request path did not read since the tick before).
    fn refresh_shared(&mut self, tick: bool, now_ns: u64) {
        self.exchange_ns = now_ns;
        if self.register_tried {
            self.read_registry();
        }
        self.refresh_fleet();
        self.publish_loads(tick);
        self.read_others(tick);
        if tick || self.replicas_seen {
            self.read_replicas();
        }
        if tick {
            self.read_ejections();
        }
    }

    /// Adds the other gateway replicas' requests in prefill on each pod of `pool` (fresh at
    /// `now_ms`) to `view`, this worker's view of the pool, aligned with the snapshot.
    fn add_replicas(&mut self, pool: &str, view: &mut LoadTable, now_ms: u64) {
        if self.replicas.is_empty() {
            return;
        }
        let (Some(fleet), Some(pl)) = (self.fleet.as_ref(), self.loads.get_mut(pool)) else {
            return;
        };
        let Some(p) = fleet.pool(pool) else {
            return;
        };
        let generation = self.replicas_cas.map_or(0, |c| u64::from(c) + 1);
        pl.replicas.add_to(
            &mut view.pods,
            &self.replicas,
            generation,
            pool,
            fleet.version,
            &p.keys,
            now_ms,
        );
    }

    /// Takes out of its picks the pods other workers ejected (`EJECTIONS_KEY`), when the board
    /// changed since it last read it.
    fn read_ejections(&mut self) {
        if !self.engine.outliers.enabled() {
            return;
        }
        let (bytes, cas) = host::get_shared(EJECTIONS_KEY);
        if cas != self.ejections_cas {
            self.ejections_cas = cas;
            let board = outlier::EjectionBoard::decode(bytes.as_deref().unwrap_or_default());
            self.engine
                .outliers
                .adopt(&board, self.exchange_ns / 1_000_000);
        }
    }

    /// Counts and publishes an ejection of `pod` of `pool` for `for_ms` (from `now_ms`), and
    /// logs `message`: the other workers take it out at their next tick.
    fn eject(&mut self, pool: &str, pod: u64, for_ms: u64, now_ms: u64, message: &str) {
        self.stats.ejection(pool);
        let until = now_ms.saturating_add(for_ms);
        update_shared(
            EJECTIONS_KEY,
            outlier::EjectionBoard::decode,
            outlier::EjectionBoard::encode,
            |b| {
                b.put(pod, until, now_ms);
                Some(())
            },
        );
        host::log(LogLevel::Warn, message);
    }

    /// Judges this worker's unanswered requests when a new snapshot came since it last did
    /// (a verdict needs a new reading of the pod), on the tick ([`outlier::judge_all`]): a
    /// request judged lost counts in its pod's run and stays until it ends (a server error
    /// ending it, Envoy's 504, is not counted again: `Http::answered`); those whose pod left are
    /// forgotten.
    fn check_unanswered(&mut self) {
        let version = self.fleet.as_ref().map_or(0, |f| f.version);
        if self.unanswered.is_empty() || version == self.unanswered_judged {
            return;
        }
        self.unanswered_judged = version;
        let now = host::now_ms();
        let grace = self.engine.outliers.unanswered_ms();
        let mut unanswered = std::mem::take(&mut self.unanswered);
        let mut sent: Vec<(u32, &mut outlier::Unanswered)> =
            unanswered.iter_mut().map(|(id, u)| (*id, u)).collect();
        let verdicts = match self.fleet.as_ref() {
            Some(fleet) => {
                let mut refs: Vec<&mut outlier::Unanswered> =
                    sent.iter_mut().map(|(_, u)| &mut **u).collect();
                outlier::judge_all(&mut refs, fleet, grace, now)
            }
            None => Vec::new(),
        };
        let mut gone = Vec::new();
        for ((id, u), verdict) in sent.iter().zip(verdicts) {
            match verdict {
                outlier::Verdict::Wait => {}
                outlier::Verdict::Gone => gone.push(*id),
                outlier::Verdict::Lost { waited_ms } => self.lost(u, waited_ms, now),
            }
        }
        for id in gone {
            unanswered.remove(&id);
        }
        self.unanswered = unanswered;
    }

    /// Judges one unanswered request alone by the latest snapshot (at its end); lost, it counts
    /// in its pod's run.
    fn judge_unanswered(&mut self, sent: &mut outlier::Unanswered, now_ms: u64) {
        let Some(fleet) = self.fleet.as_ref() else {
            return;
        };
        let grace = self.engine.outliers.unanswered_ms();
        if let outlier::Verdict::Lost { waited_ms } = sent.judge(fleet, grace, 1, now_ms) {
            self.lost(sent, waited_ms, now_ms);
        }
    }

    /// A request judged lost after `waited_ms`: counted, in its pod's run, and the ejection it
    /// causes published and logged.
    fn lost(&mut self, sent: &outlier::Unanswered, waited_ms: u64, now_ms: u64) {
        self.stats.unanswered(&sent.pool);
        if let Some(e) = self.engine.unanswered(sent, self.fleet.as_ref(), now_ms) {
            let address = self
                .fleet
                .as_ref()
                .and_then(|f| f.address_of(&sent.pool, sent.pod));
            let message = e.unanswered_message(
                address.unwrap_or("(gone)"),
                &sent.pool,
                self.engine.config.outlier_detection.consecutive_5xx,
                waited_ms,
            );
            self.eject(&sent.pool, sent.pod, e.for_ms, now_ms, &message);
        }
    }

    /// Re-reads the other gateway replicas' requests in prefill (posted to `ingest.load_path`,
    /// maybe on another listener), decoding only when they changed.
    fn read_replicas(&mut self) {
        let (bytes, cas) = host::get_shared(replica_load::STORE_KEY);
        self.replicas_seen = bytes.is_some();
        if cas != self.replicas_cas {
            self.replicas = ReplicaLoads::decode(bytes.as_deref().unwrap_or_default());
            self.replicas_cas = cas;
        }
    }

    /// [`Worker::refresh_shared`] on the request path, at most every `shared_refresh_ms`.
    fn refresh_shared_throttled(&mut self, now_ns: u64) {
        if now_ns.wrapping_sub(self.refreshed_ns) >= self.refresh_ns || self.fleet.is_none() {
            self.refreshed_ns = now_ns;
            self.refresh_shared(false, now_ns);
        }
    }

    /// [`Worker::publish_loads`] unless this worker published within `shared_refresh_ms`, or
    /// `force`d.
    fn publish_loads_throttled(&mut self, now_ns: u64, force: bool) {
        if force || now_ns.wrapping_sub(self.published_ns) >= self.refresh_ns {
            self.published_ns = now_ns;
            self.publish_loads(false);
        }
    }

    /// Publishes the tables that changed (no compare-and-swap: this worker is their only writer),
    /// in the sparse form; with `dense` (the tick), also in the dense form for earlier builds
    /// that may share the keys during a change of the filter (they then see this worker's
    /// requests a tick late). The dense form is 32 bytes a pod whatever is in flight: written at
    /// every exchange, it cost a worker at 1,000 pods ~100,000 instructions a request.
    fn publish_loads(&mut self, dense: bool) {
        for pl in self.loads.values_mut() {
            if pl.dirty && host::set_shared(&pl.sparse_key, &pl.own.encode_sparse(), None).is_ok() {
                pl.dirty = false;
                pl.dense_dirty = true;
            }
            if dense && pl.dense_dirty && host::set_shared(&pl.key, &pl.own.encode(), None).is_ok()
            {
                pl.dense_dirty = false;
            }
        }
    }

    /// Reads the other workers' tables of every pool this worker routes to: on the request path
    /// `shared_peer_reads` of them in turn; on the `tick` the rest of the round (none when the
    /// request path went round them all since the last tick; all when the peers changed).
    fn read_others(&mut self, tick: bool) {
        let Some(fleet) = &self.fleet else {
            return;
        };
        let n = self.peers.len();
        let turn = if tick {
            self.turn.tick(n, std::mem::take(&mut self.peers_changed))
        } else {
            self.turn.exchange(n, self.engine.config.shared_peer_reads)
        };
        let peers = &self.peers;
        let now_ns = self.exchange_ns;
        for (pool, pl) in self.loads.iter_mut() {
            if now_ns.saturating_sub(pl.routed_ns) > POOL_IDLE_NS {
                continue;
            }
            let ids = turn.clone().filter_map(|i| peers.get(i).copied());
            pl.read_peers(pool, fleet, self.previous_version, peers, ids);
        }
    }

    /// This worker's view of `pool`'s in-flight requests (created on its first request, with
    /// the other workers' tables read at once), aligned with the snapshot. `None` without a
    /// snapshot of the pool.
    fn pool_load(&mut self, pool: &str, now_ns: u64) -> Option<&mut PoolLoad> {
        let fleet = self.fleet.as_ref()?;
        let p = fleet.pool(pool)?;
        if !self.loads.contains_key(pool) {
            let pl = PoolLoad {
                key: load_key(pool, self.id),
                sparse_key: sparse_load_key(pool, self.id),
                // Never routed: the other workers' tables are read below.
                routed_ns: 0,
                own: LoadTable::zeroed(fleet.version, &p.keys),
                dirty: false,
                dense_dirty: false,
                peer_tables: PeerTables::default(),
                others: SparseTable::default(),
                replicas: replica_load::Aligned::default(),
            };
            self.loads.insert(pool.to_string(), pl);
        }
        let pl = self.loads.get_mut(pool)?;
        // New, or back after an idle spell: every other worker's table at once (this worker
        // knows nothing of the pool yet, or did not read it meanwhile).
        if now_ns.saturating_sub(pl.routed_ns) > POOL_IDLE_NS {
            let peers = &self.peers;
            pl.read_peers(
                pool,
                fleet,
                self.previous_version,
                peers,
                peers.iter().copied(),
            );
        }
        pl.routed_ns = now_ns;
        // Installing a snapshot re-bases the table of every pool it has (`install_fleet`, which
        // compares every key: a snapshot can replace a stale one of the same version), and a new
        // table starts aligned; so on the request path the version and the length tell. Every
        // key compared here cost 110,000 instructions a request at 10,000 pods.
        if pl.own.version != fleet.version || pl.own.pods.len() != p.keys.len() {
            pl.dirty |= pl.own.rebase(fleet.version, &p.keys);
        }
        Some(pl)
    }

    /// Takes the lowest free worker id in the registry (a compare-and-swap), numbers this
    /// worker's prefix records after every earlier holder's, and learns the other live workers.
    /// Called on the first routed request, and on the tick while it has not succeeded.
    fn register(&mut self) {
        self.register_tried = true;
        if self.id != UNREGISTERED {
            return;
        }
        let taken = update_registry(|set| {
            let id = set.take();
            if id.is_none() {
                host::log(LogLevel::Warn, "gpuroute: worker registry full");
            }
            id
        });
        let Some((id, set)) = taken else {
            return;
        };
        self.id = id;
        self.engine
            .sync_start_after(workers::seq_base(set.generation));
        self.peers = set.ids().filter(|w| *w != id).collect();
        self.peers_changed = true;
        self.live = set.len();
        // Tables made before (a failed take) move to this id's keys.
        for (pool, pl) in self.loads.iter_mut() {
            pl.key = load_key(pool, id);
            pl.sparse_key = sparse_load_key(pool, id);
            pl.dirty = true;
        }
    }

    /// How long a stored snapshot may still be read by some configuration of this VM: this
    /// one's longest `stale_after_ms`, or a routing configuration's (`STALE_WINDOW_KEY`), the
    /// ingest listener's own having no pools.
    fn stale_window_ms(&self) -> u64 {
        let shared = host::get_shared(STALE_WINDOW_KEY).0;
        ingest::decode_stale_window(shared.as_deref())
            .max(self.engine.config.longest_stale_after_ms())
    }

    /// Gives this worker's id back when Envoy deletes its plugin instance (its configuration was
    /// removed): its published tables and prefix records are emptied first, so nothing reads a
    /// dead worker's counts, and a later worker reuses the id.
    fn release(&mut self) {
        if self.id == UNREGISTERED {
            return;
        }
        for pl in self.loads.values() {
            let _ = host::set_shared(&pl.sparse_key, &[], None);
            let _ = host::set_shared(&pl.key, &[], None);
        }
        let _ = host::set_shared(&sync_key(self.id), &[], None);
        let _ = host::set_shared(&exchange::export_key(self.id), &[], None);
        let id = self.id;
        update_board(|board| board.remove(id).then_some(()));
        update_registry(|set| {
            set.release(id);
            Some(())
        });
        self.id = UNREGISTERED;
    }

    /// Re-reads the registry: the other live workers (`peers`) and how many are live. Part of
    /// every exchange, so a worker that starts routing is among the others' peers from their
    /// next exchange (within `shared_refresh_ms` under load, at the latest their next tick).
    fn read_registry(&mut self) {
        let set = read_shared(WORKERS_KEY, WorkerSet::decode);
        let me = self.id;
        let others = || set.ids().filter(|w| *w != me);
        if !others().eq(self.peers.iter().copied()) {
            self.peers.clear();
            self.peers.extend(others());
            self.peers_changed = true;
        }
        self.live = set.len();
    }

    /// The root context's tick: a failed registration again, the exchange, the prefix
    /// decisions, and the gauges and batched counters out to Envoy.
    fn tick(&mut self) {
        // Something to exchange: requests routed, or in-flight counts changed (requests
        // finished), since the last tick; or requests of this worker still in flight. Their
        // table must follow each new snapshot within a tick: the other workers count a table
        // only of the newest snapshot or the one before, and at the idle tick (320 ms, three
        // of the aggregator's pushes) a worker whose requests were all still queued at their
        // pods dropped out of the others' view half the time (an audit: the other worker sent
        // new requests to such a pod as if it were idle).
        let active = self.routed != self.routed_at_tick
            || self
                .loads
                .values()
                .any(|pl| pl.dirty || pl.dense_dirty || !pl.own.is_idle())
            || !self.held.is_empty();
        self.routed_at_tick = self.routed;
        if self.register_tried && self.id == UNREGISTERED {
            self.register();
        }
        // Decoding here keeps the cost off the request path in the common case. The exchange
        // first: it re-reads the registry the prefix exchange uses. The tables the request path
        // did not read since the last tick, so none is older than two ticks (none at all read
        // here by a worker whose exchanges went round its peers).
        self.refresh_shared(true, host::now_nanos());
        self.check_unanswered();
        self.sync();
        self.export();
        if self.register_tried {
            self.stats.gauge("gpuroute.workers", self.live as u64);
        }
        self.snapshot_age_gauge();
        self.stats.flush();
        self.idle_ticks = if active {
            0
        } else {
            self.idle_ticks.saturating_add(1)
        };
        let config = &self.engine.config;
        let next = workers::tick_period(
            self.tick_now_ms,
            config.tick_ms,
            config.idle_tick_ms,
            self.idle_ticks,
        );
        self.set_tick_period(next);
    }

    /// Sets the root context's tick period (an HTTP context's call sets its root's).
    fn set_tick_period(&mut self, ms: u64) {
        if ms != self.tick_now_ms
            && host::set_tick_period_ms(ms.min(u64::from(u32::MAX)) as u32).is_ok()
        {
            self.tick_now_ms = ms;
        }
    }

    /// A routed request on a worker whose tick slowed down while idle: the tick period back to
    /// `tick_ms`, and the tick's exchange now (every other worker's in-flight table, the prefix
    /// records they published meanwhile), so this request sees what a worker ticking all along
    /// would.
    fn wake(&mut self, now_ns: u64) {
        self.stats.inc("gpuroute.idle_wakes");
        self.set_tick_period(self.engine.config.tick_ms);
        self.idle_ticks = 0;
        self.refreshed_ns = now_ns;
        self.refresh_shared(true, now_ns);
        self.sync();
    }

    /// The newest sequence this worker published (0 before its first publish): the entry of
    /// `publishes` just before `publish_slot`.
    fn last_published(&self) -> u64 {
        let newest = (self.publish_slot + SYNC_PUBLISHES - 1) % SYNC_PUBLISHES;
        self.publishes.get(newest).copied().unwrap_or(0)
    }

    /// Before this worker's first routed request (or call by response id): takes a worker id,
    /// and reads what the other workers and replicas published meanwhile (its ticks did not
    /// read it while it had not routed).
    fn join(&mut self) {
        if !self.register_tried {
            self.register();
            self.sync();
        }
    }

    /// Reads a stored response's shared slot (`engine::response_slot`), written by the worker
    /// that served it, into this worker's table of stored responses: whether it held that
    /// response's pod.
    fn note_shared_response(&mut self, key: u64) -> bool {
        let pod = host::get_shared(&engine::response_slot_key(key))
            .0
            .and_then(|v| engine::response_slot_pod(key, &v));
        if let Some(pod) = pod {
            self.engine.note_response(key, pod);
        }
        pod.is_some()
    }

    /// Exchanges prefix decisions with the other workers of this Envoy (`peers`, read by the
    /// exchange just before).
    fn sync(&mut self) {
        if self.engine.config.pools.is_empty() || !self.register_tried {
            // Nothing routed here yet: nothing to send, and what the others send is read when
            // this worker starts routing (what they published last).
            return;
        }
        // Only when there are new records, and only those of the last `SYNC_PUBLISHES`
        // publishes.
        let seq = self.engine.sync_seq();
        let after = self.publishes.get(self.publish_slot).copied().unwrap_or(0);
        let id = self.id;
        let mut board = None;
        if seq != self.last_published()
            && host::set_shared(&sync_key(id), &self.engine.sync_payload(after), None).is_ok()
        {
            // The board as written is also the one read below: one read either way.
            if let Some(((), written)) = update_board(|b| {
                b.set(id, seq);
                Some(())
            }) {
                board = Some(written);
                if let Some(slot) = self.publishes.get_mut(self.publish_slot) {
                    *slot = seq;
                }
                self.publish_slot = (self.publish_slot + 1) % SYNC_PUBLISHES;
            }
        }
        let board = board.unwrap_or_else(|| read_shared(SYNC_BOARD_KEY, SyncBoard::decode));
        let mut records = Vec::new();
        // The other workers' rings, and the records imported from other gateway replicas.
        for other in self.peers.iter().copied().chain([exchange::IMPORT_ID]) {
            let Some(their) = board.get(other) else {
                continue;
            };
            let applied = self.applied.get(&other).copied().unwrap_or(0);
            if their <= applied {
                continue;
            }
            if let (Some(ring), _) = host::get_shared(&sync_key(other)) {
                SyncLog::decode_after(&ring, applied, &mut records);
                self.engine.apply_sync(&records);
                self.applied.insert(other, their);
            }
        }
    }

    /// Writes this worker's outgoing prefix records for the exchange between gateway replicas
    /// (`exchange`): at most every `EXPORT_MS`, when it has new ones, and only while a relay
    /// asked for them within `WANTED_FOR_MS` (on the ingest listener, whose configuration is
    /// not this one: the routing configuration need not name the exchange's path).
    fn export(&mut self) {
        let now = host::now_ms();
        if self.id == UNREGISTERED
            || now.saturating_sub(self.export_checked_ms) < exchange::EXPORT_MS
        {
            return;
        }
        self.export_checked_ms = now;
        let seq = self.engine.sync_seq();
        if seq == self.exported_seq {
            return;
        }
        let asked = host::get_shared(exchange::WANTED_KEY)
            .0
            .and_then(|b| b.get(..8).and_then(|t| t.try_into().ok()))
            .map(u64::from_le_bytes);
        if asked.is_none_or(|t| now.saturating_sub(t) > exchange::WANTED_FOR_MS) {
            return;
        }
        let ring = self.engine.sync_payload(0);
        if host::set_shared(&exchange::export_key(self.id), &ring, None).is_ok() {
            self.exported_seq = seq;
        }
    }

    /// The snapshot's age; before any snapshot, how long this worker has run without one
    /// (not no series, nor 0: `GpurouteSnapshotStale` then fires for a gateway that never got
    /// one, traffic or not, as for one whose aggregator stopped).
    fn snapshot_age_gauge(&mut self) {
        let now = host::now_ms();
        let age = match &self.fleet {
            Some(f) => f.age_ms(now),
            None => now.saturating_sub(self.started_ms),
        };
        self.stats.gauge("gpuroute.snapshot.age_ms", age);
    }
}

/// The value under shared-data `key`, decoded (`decode` of no bytes when there is none).
fn read_shared<T>(key: &str, decode: fn(&[u8]) -> T) -> T {
    decode(host::get_shared(key).0.as_deref().unwrap_or_default())
}

/// Applies `change` to the value under shared-data `key` (read with `decode`, written with
/// `encode`) with a compare-and-swap, from a fresh read on each of up to `CAS_ATTEMPTS` attempts
/// (another worker may write between the read and the write). Returns what `change` returned
/// and the value as written; `None` if `change` declined or every attempt lost the race.
fn update_shared<T, R>(
    key: &str,
    decode: fn(&[u8]) -> T,
    encode: fn(&T) -> Vec<u8>,
    mut change: impl FnMut(&mut T) -> Option<R>,
) -> Option<(R, T)> {
    for _ in 0..CAS_ATTEMPTS {
        let (bytes, cas) = host::get_shared(key);
        let mut value = decode(bytes.as_deref().unwrap_or_default());
        let r = change(&mut value)?;
        if host::set_shared(key, &encode(&value), cas).is_ok() {
            return Some((r, value));
        }
    }
    None
}

/// [`update_shared`] of the registry of live workers.
fn update_registry<R>(change: impl FnMut(&mut WorkerSet) -> Option<R>) -> Option<(R, WorkerSet)> {
    update_shared(WORKERS_KEY, WorkerSet::decode, WorkerSet::encode, change)
}

/// Widens `STALE_WINDOW_KEY` to `ms` (a routing configuration's longest `stale_after_ms`) if
/// it is shorter, compare-and-swapped against other workers doing the same, and read again
/// after each write (a first write has no CAS token to race with).
fn publish_stale_window(ms: u64) {
    for _ in 0..CAS_ATTEMPTS {
        let (cur, cas) = host::get_shared(STALE_WINDOW_KEY);
        let Some(v) = ingest::widen_stale_window(cur.as_deref(), ms) else {
            return;
        };
        let _ = host::set_shared(STALE_WINDOW_KEY, &v, cas);
    }
}

/// [`update_shared`] of the board of prefix sequence numbers.
fn update_board<R>(change: impl FnMut(&mut SyncBoard) -> Option<R>) -> Option<(R, SyncBoard)> {
    update_shared(SYNC_BOARD_KEY, SyncBoard::decode, SyncBoard::encode, change)
}

struct Root {
    id: u32,
    worker: Option<Rc<RefCell<Worker>>>,
}

impl Root {
    fn new(id: u32) -> Root {
        Root { id, worker: None }
    }

    fn on_configure(&mut self, size: usize) -> bool {
        let raw = host::get_buffer(BufferType::PluginConfiguration, 0, size).unwrap_or_default();
        let config = match FilterConfig::from_json(&raw) {
            Ok(c) => c,
            Err(e) => {
                host::log(
                    LogLevel::Critical,
                    &format!("gpuroute: invalid configuration: {e}"),
                );
                return false;
            }
        };
        // A configuration again on a live instance: the old worker's id goes back first.
        self.on_delete();
        let tick_ms = config.tick_ms;
        let tick = tick_ms.min(u64::from(u32::MAX)) as u32;
        let refresh_ns = config.shared_refresh_ms.saturating_mul(1_000_000);
        let routes = !config.pools.is_empty();
        if routes {
            publish_stale_window(config.longest_stale_after_ms());
        }
        let hold_order = config.hold.map(|h| h.order).unwrap_or_default();
        let seed = host::now_nanos() ^ (u64::from(self.id) << 32);
        let mut stats = Stats::new(config.max_pod_stats);
        if config.ingest.is_some() {
            stats.define_ingest_rejected();
        }
        stats.define_hold(gpuroute_core::hold::stat_pools(&config));
        let o = &config.outlier_detection;
        if o.consecutive_5xx > 0 {
            let pools = config.pools.iter().map(|p| p.name.as_str());
            stats.define_passive_health(pools, o.unanswered_ms > 0);
        }
        let mut worker = Worker {
            engine: Engine::new(config),
            fleet: None,
            seen_header: None,
            rng: SplitMix64::new(seed),
            stats,
            id: UNREGISTERED,
            register_tried: false,
            peers: Vec::new(),
            turn: Turn::default(),
            peers_changed: false,
            live: 0,
            applied: HashMap::new(),
            publishes: [0; SYNC_PUBLISHES],
            publish_slot: 0,
            loads: NameMap::default(),
            view: LoadTable::default(),
            previous_version: None,
            refreshed_ns: 0,
            exchange_ns: 0,
            ejections_cas: None,
            published_ns: 0,
            refresh_ns,
            routed: 0,
            tick_now_ms: tick_ms,
            started_ms: host::now_ms(),
            routed_at_tick: 0,
            idle_ticks: 0,
            export_checked_ms: 0,
            exported_seq: 0,
            held: HoldQueue::new(hold_order),
            pass_due: false,
            replicas: ReplicaLoads::default(),
            replicas_cas: None,
            replicas_seen: false,
            unanswered: IdMap::default(),
            unanswered_judged: 0,
        };
        worker.refresh_fleet();
        self.worker = Some(Rc::new(RefCell::new(worker)));
        if routes {
            let _ = host::set_tick_period_ms(tick.max(1));
        }
        true
    }

    /// The tick; returns the worker, to decide again for the requests it holds.
    fn on_tick(&mut self) -> Option<Rc<RefCell<Worker>>> {
        // The worker is never borrowed between callbacks (one VM thread, callbacks never nest).
        if let Some(mut w) = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok()) {
            w.tick();
        }
        self.worker.clone()
    }

    /// Envoy deletes this plugin instance (its configuration was removed, or Envoy stops).
    fn on_delete(&mut self) {
        if let Some(w) = self.worker.take() {
            if let Ok(mut w) = w.try_borrow_mut() {
                w.release();
            }
        }
    }

    fn create_http(&self, id: u32) -> Http {
        Http {
            id,
            held: None,
            worker: self.worker.clone(),
            mode: Mode::Pass,
            head: RequestHead::default(),
            path: String::new(),
            body_size: 0,
            form_scanned: 0,
            learn_response: None,
            first_output: None,
            picked: None,
            ttft_from: None,
            watch_status: false,
            awaits_answer: false,
            lost: false,
            debug: None,
        }
    }
}

/// A request held while its pool is saturated, or while the pod caching its prompt or adapter is.
struct Held {
    prep: Box<Prepared>,
    /// Its body's length (Envoy buffers the body while it is held).
    size: usize,
    /// When it was first held (ns): with `hold`'s limits, how long it may still wait.
    since_ns: u64,
    /// It has waited for that pod (counted once, `gpuroute.hold.<pool>.affinity`).
    waited_for_affinity: bool,
    /// The pod it waits for, when its last decision held it for the pod that caches its prompt or
    /// adapter: only that pod's room, or a tick, makes deciding again worth it.
    awaits: Option<u64>,
    /// The pool it was first held in: its hold counters and its place in the held gauge, wherever
    /// a later decision moves it (`Engine::homeward`, overflow).
    pool: Arc<str>,
    /// Queued behind held requests of its pool on its arrival, not decided yet: decided in the
    /// pass that follows even if one ahead finds its pool still saturated (the room may suit
    /// it, not them).
    behind: bool,
}

/// A held request in its worker's queue.
pub(crate) struct Queued {
    /// Its stream's context id.
    pub(crate) id: u32,
    /// The pool it is held in.
    pool: Arc<str>,
    /// It waits for its pool to have room (not for the pod caching its prompt or adapter): a
    /// request of the pool that comes meanwhile queues behind it.
    for_room: Cell<bool>,
}

/// Why the held requests are decided again ([`Http::release`]).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// The worker's tick: new snapshots, deadlines, every held request.
    Tick,
    /// A request on this pod (key) ended: those waiting for it, or for room.
    Ended(u64),
    /// A request was queued behind held requests of its pool ([`Http::queued_behind`]): those
    /// waiting for room, in their order, the newcomer among them.
    Queued,
}

/// What deciding again for a held request came to.
pub(crate) enum Release {
    /// Not (or no longer) held, or its worker was busy.
    Nothing,
    /// Still held: its pool is still saturated.
    Held(Arc<str>),
    /// Still held for the pod caching its prompt or adapter: other requests of its pool may go.
    Waiting,
    /// Routed: continue the request.
    Continue,
    /// Answered by the filter (an error, or shed): the host has the reply.
    Answered,
}

enum Mode {
    Pass,
    Inference,
    /// A snapshot, or prefix records from other gateway replicas (`exchange`), being buffered;
    /// `current`: the snapshot version when its headers came.
    Ingest {
        endpoint: Endpoint,
        current: Option<u64>,
    },
    Answered,
}

struct Http {
    /// The host's id of this stream's context.
    id: u32,
    /// Held while its pool is saturated (`hold`): what the decision needs again.
    held: Option<Held>,
    worker: Option<Rc<RefCell<Worker>>>,
    mode: Mode,
    head: RequestHead,
    path: String,
    /// Bytes of the request body buffered so far (for a request that ends with trailers).
    body_size: usize,
    /// A form's bytes buffered when it was last read for its fields before its end.
    form_scanned: usize,
    /// A Responses API request's pod and its answer's first bytes, until they give the answer's
    /// id.
    learn_response: Option<(u64, request::ResponseHead)>,
    /// A streamed Responses API answer, read until its first output (`FirstOutput`).
    first_output: Option<request::FirstOutput>,
    picked: Option<InFlight>,
    /// When a streamed request whose decision time is sampled was routed (ns): its time to the
    /// first response byte goes to its pool's `ttft_ms`.
    ttft_from: Option<u64>,
    /// The decision was sampled: its answer's status is read for passive health even while no
    /// pod is on record ([`Http::answered`]).
    watch_status: bool,
    /// In its worker's `unanswered` until its answer comes (its headers; a stream's first
    /// chunk).
    awaits_answer: bool,
    /// Judged unanswered before its answer came: in its pod's run already, where a server
    /// error answering it is not counted again.
    lost: bool,
    /// The decision's score breakdown, for the debug response header.
    debug: Option<String>,
}

impl Http {
    fn reply(&mut self, status: u32, body: &str, content_type: &str) -> Action {
        self.reply_with(status, body, &[("content-type", content_type)])
    }

    fn reply_with(&mut self, status: u32, body: &str, headers: &[(&str, &str)]) -> Action {
        self.mode = Mode::Answered;
        let _ = host::send_response(status, headers, body.as_bytes());
        Action::Pause
    }

    /// Answers with `err` in the shape of the request path's API.
    fn reply_error(&mut self, err: &ApiError) -> Action {
        let body = err.body(ErrorStyle::for_path(&self.path));
        let status = u32::from(err.status);
        match &err.allow {
            Some(allow) => {
                self.reply_with(status, &body, &[("content-type", JSON), ("allow", allow)])
            }
            None => self.reply(status, &body, JSON),
        }
    }

    /// Answers a refused inference request with `err` and counts it as
    /// `gpuroute.rejected.<code>`.
    fn reject(&mut self, w: &mut Worker, err: &ApiError) -> Action {
        let code = err.code.as_deref().unwrap_or("other");
        w.stats.inc(&format!("gpuroute.rejected.{code}"));
        self.reply_error(err)
    }

    /// A request to an ingest endpoint (`ingest::Endpoint`): checked, then a snapshot's or
    /// prefix records' body buffered for [`Http::ingest_end`]; the prefix records' `GET` is
    /// answered at once.
    fn ingest_headers(
        &mut self,
        w: &mut Worker,
        endpoint: Endpoint,
        method: &str,
        end_of_stream: bool,
    ) -> Action {
        let Some(ing) = w.engine.config.ingest.as_ref() else {
            return Action::Continue;
        };
        let checked = ingest::check_request(
            ing,
            endpoint,
            method,
            peer_is_loopback,
            self.head.authorization.as_deref(),
            self.head.content_length,
        );
        if let Err((reason, e)) = checked {
            w.stats.ingest_rejected(endpoint, reason);
            return self.reply_error(&e);
        }
        let current = match endpoint {
            Endpoint::Prefix if method == "GET" => return self.export_answer(w),
            Endpoint::Load if method == "GET" => return self.load_answer(w),
            Endpoint::Prefix | Endpoint::Load => None,
            Endpoint::Snapshot => ingest::version_floor(
                host::get_shared(SNAPSHOT_VERSION_KEY)
                    .0
                    .and_then(|b| StoredHeader::decode(&b)),
                host::now_ms(),
                w.stale_window_ms(),
            ),
        };
        self.mode = Mode::Ingest { endpoint, current };
        if end_of_stream {
            return self.ingest_end(w, endpoint, 0, current);
        }
        Action::Pause
    }

    /// The whole body of a request to an ingest endpoint is in.
    fn ingest_end(
        &mut self,
        w: &mut Worker,
        endpoint: Endpoint,
        size: usize,
        current: Option<u64>,
    ) -> Action {
        match endpoint {
            Endpoint::Snapshot => self.ingest_body(w, size, current),
            Endpoint::Prefix => self.import_body(w, size),
            Endpoint::Load => self.replica_load_body(w, size),
        }
    }

    /// This Envoy's own requests in prefill per pool and pod, summed over every live worker's
    /// published table (this worker's published first), for the other gateway replicas.
    fn load_answer(&mut self, w: &mut Worker) -> Action {
        // The pools' names come from the snapshot, which a worker that routes nothing (the
        // ingest listener's) has not decoded otherwise.
        w.refresh_fleet();
        w.publish_loads(false);
        let live = read_shared(WORKERS_KEY, WorkerSet::decode);
        let mut tables: Vec<(&str, LoadTable)> = Vec::new();
        if let Some(fleet) = &w.fleet {
            for pool in &fleet.pools {
                for id in live.ids() {
                    if let Some(t) = read_load(&pool.name, id) {
                        tables.push((pool.name.as_str(), t.into_table()));
                    }
                }
            }
        }
        let load = ReplicaLoad::from_tables(tables.iter().map(|(p, t)| (*p, t)));
        w.stats.inc("gpuroute.replica_load.exported");
        self.mode = Mode::Answered;
        let headers = [("content-type", "application/octet-stream")];
        let _ = host::send_response(200, &headers, &load.encode());
        Action::Pause
    }

    /// Other gateway replicas' requests in prefill (one replica's, or a bundle of several):
    /// replaces each one's entry in shared data (one compare-and-swap), where every worker adds
    /// them to its view from its next exchange.
    fn replica_load_body(&mut self, w: &mut Worker, size: usize) -> Action {
        let body = host::get_buffer(BufferType::HttpRequestBody, 0, size).unwrap_or_default();
        let loads = match replica_load::decode_post(self.head.replica.as_deref(), &body) {
            Ok(l) => l,
            Err(msg) => {
                w.stats.ingest_rejected(Endpoint::Load, "invalid");
                return self.reply_error(&ApiError::bad_replica_load(msg));
            }
        };
        let taken = loads.len() as u64;
        let ttl = w.engine.config.ingest.as_ref().map_or(0, |i| i.load_ttl_ms);
        let now = host::now_ms();
        let stored = update_shared(
            replica_load::STORE_KEY,
            ReplicaLoads::decode,
            ReplicaLoads::encode,
            |held| {
                held.put_all(loads.clone(), now, ttl);
                Some(())
            },
        );
        if stored.is_none() {
            w.stats.ingest_rejected(Endpoint::Load, "not_stored");
            return self.reply_error(&ApiError::not_stored("in-flight counts"));
        }
        w.stats.add("gpuroute.replica_load.imported", taken);
        self.reply(204, "", "text/plain")
    }

    /// This Envoy's own prefix records newer than the request's cursor, from every live
    /// worker's export ring; also tells the workers their records are wanted.
    fn export_answer(&mut self, w: &mut Worker) -> Action {
        let _ = host::set_shared(exchange::WANTED_KEY, &host::now_ms().to_le_bytes(), None);
        let live = read_shared(WORKERS_KEY, WorkerSet::decode);
        let mut export = Export::of_envoy(
            Cursor::parse(self.head.cursor.as_deref().unwrap_or_default()),
            envoy_epoch(w),
        );
        for id in live.ids() {
            let ring = host::get_shared(&exchange::export_key(id)).0;
            export.add_encoded(id, ring.as_deref().unwrap_or_default());
        }
        w.stats.add("gpuroute.prefix.exported", export.len() as u64);
        let (body, cursor) = export.finish();
        self.mode = Mode::Answered;
        let headers = [
            ("content-type", "application/octet-stream"),
            (exchange::CURSOR_HEADER, cursor.as_str()),
        ];
        let _ = host::send_response(200, &headers, &body);
        Action::Pause
    }

    /// Adds other replicas' prefix records to the import ring (a compare-and-swap) and its
    /// newest sequence to the board: every worker applies them on its next tick.
    fn import_body(&mut self, w: &mut Worker, size: usize) -> Action {
        let body = host::get_buffer(BufferType::HttpRequestBody, 0, size).unwrap_or_default();
        let records = match prefix::decode_records(&body, exchange::MAX_IMPORT_RECORDS) {
            Ok(r) => r,
            Err(msg) => {
                w.stats.ingest_rejected(Endpoint::Prefix, "invalid");
                return self.reply_error(&ApiError::bad_prefix_records(msg));
            }
        };
        if !records.is_empty() {
            let newest = update_shared(
                &sync_key(exchange::IMPORT_ID),
                <[u8]>::to_vec,
                Vec::clone,
                |ring| {
                    let (merged, n) = exchange::merge_import(ring, &records);
                    *ring = merged;
                    Some(n)
                },
            );
            let told = newest.and_then(|(n, _)| {
                update_board(|b| {
                    if b.get(exchange::IMPORT_ID).is_none_or(|s| s < n) {
                        b.set(exchange::IMPORT_ID, n);
                    }
                    Some(())
                })
            });
            if told.is_none() {
                w.stats.ingest_rejected(Endpoint::Prefix, "not_stored");
                return self.reply_error(&ApiError::not_stored("prefix records"));
            }
        }
        w.stats
            .add("gpuroute.prefix.imported", records.len() as u64);
        self.reply(204, "", "text/plain")
    }

    fn ingest_body(&mut self, w: &mut Worker, size: usize, current: Option<u64>) -> Action {
        let Some(ing) = w.engine.config.ingest.clone() else {
            return Action::Continue;
        };
        let body = host::get_buffer(BufferType::HttpRequestBody, 0, size).unwrap_or_default();
        let snap = match ingest::accept(&body, ing.max_snapshot_bytes, current) {
            Ok(s) => s,
            Err(e) => {
                let reason = if e.status == 413 {
                    "too_large"
                } else {
                    "invalid"
                };
                w.stats.ingest_rejected(Endpoint::Snapshot, reason);
                host::log(
                    LogLevel::Warn,
                    &format!("gpuroute: snapshot rejected: {}", e.message),
                );
                return self.reply_error(&e);
            }
        };
        let header = StoredHeader {
            received_at_ms: host::now_ms(),
            version: snap.version,
        };
        let stored = ingest::encode_stored(header, &body);
        // Compare-and-swap on the snapshot itself, re-checking the version each time, so two
        // racing pushes can never leave the older one in place.
        let stale_after_ms = w.stale_window_ms();
        let mut stored_ok = false;
        let mut replaced = None;
        for _ in 0..CAS_ATTEMPTS {
            let (old, cas) = host::get_shared(SNAPSHOT_KEY);
            let old = old.as_deref().and_then(StoredHeader::decode);
            match ingest::version_floor(old, header.received_at_ms, stale_after_ms) {
                Some(v) if v >= snap.version => {
                    w.stats.ingest_rejected(Endpoint::Snapshot, "invalid");
                    return self.reply_error(&ApiError::bad_snapshot(format!(
                        "snapshot version {} is not newer than the current version {v}",
                        snap.version
                    )));
                }
                _ => {}
            }
            replaced = old.filter(|h| h.version >= snap.version);
            if host::set_shared(SNAPSHOT_KEY, &stored, cas).is_ok() {
                stored_ok = true;
                break;
            }
        }
        if let (true, Some(old)) = (stored_ok, replaced) {
            host::log(
                LogLevel::Warn,
                &ingest::went_back(old.version, snap.version),
            );
        }
        // The binary form before the version that announces it. Not storing it would cost the
        // other workers the JSON's decode, nothing else.
        if stored_ok {
            let binary = ingest::encode_stored_binary(header, &snap);
            let _ = host::set_shared(SNAPSHOT_BINARY_KEY, &binary, None);
        }
        if !stored_ok || host::set_shared(SNAPSHOT_VERSION_KEY, &header.encode(), None).is_err() {
            w.stats.ingest_rejected(Endpoint::Snapshot, "not_stored");
            return self.reply_error(&ApiError::not_stored("snapshot"));
        }
        let pods: usize = snap.pools.iter().map(|p| p.pods.len()).sum();
        w.stats.inc("gpuroute.snapshot.accepted");
        w.stats.gauge("gpuroute.snapshot.pods", pods as u64);
        w.install_fleet(snap, header.received_at_ms);
        w.seen_header = Some(header);
        self.reply(204, "", "text/plain")
    }

    /// What the engine reads of the request besides its path and body.
    #[inline(always)]
    fn context<'a>(&'a self, fleet: Option<&'a FleetState>, now_ms: u64) -> RequestContext<'a> {
        RequestContext {
            fleet,
            now_ms,
            split_key: self.head.split_key.as_deref(),
            split_target: None,
        }
    }

    /// Routes the request, its body (of `size` bytes) whole.
    fn route(&mut self, w: &mut Worker, size: usize) -> Action {
        self.route_body(w, size, true).unwrap_or(Action::Continue)
    }

    /// Routes the request on the `size` bytes of its body buffered so far (`complete`: all of
    /// it). `None`: a form whose fields routing needs have not arrived yet (never when
    /// `complete`).
    fn route_body(&mut self, w: &mut Worker, size: usize, complete: bool) -> Option<Action> {
        let t0 = host::now_nanos();
        let body = host::get_buffer(BufferType::HttpRequestBody, 0, size).unwrap_or_default();
        w.join();
        if w.tick_now_ms != w.engine.config.tick_ms {
            w.wake(t0);
        }
        w.refresh_shared_throttled(t0);
        let now = t0 / 1_000_000;
        let ctx = self.context(w.fleet.as_ref(), now);
        let mut prep = match &self.head.form_boundary {
            None => match w.engine.prepare_in(&self.path, &body, ctx) {
                Ok(p) => p,
                Err(e) => return Some(self.reject(w, &e)),
            },
            Some(b) => match w.engine.prepare_form(&self.path, &body, b, complete, ctx) {
                Ok(Some(p)) => p,
                Ok(None) => return None,
                Err(e) => return Some(self.reject(w, &e)),
            },
        };
        if let Some(key) = prep.missed_response() {
            // Another worker may have served it: its slot says so before any tick.
            if w.note_shared_response(key) {
                w.engine.look_up_response(&mut prep);
            }
        }
        if prep.may_follow_response() {
            let ctx = self.context(w.fleet.as_ref(), now);
            if let Err(e) = w.engine.follow_response(&mut prep, &self.path, &body, ctx) {
                return Some(self.reject(w, &e));
            }
        }
        if let Some(taken) = &prep.split {
            w.stats.split(taken);
        }
        // Only a whole body is held: a form that streams on cannot wait.
        let hold = w.engine.config.hold.filter(|_| complete);
        let affinity_hold = hold.is_some_and(|h| h.affinity_wait() > 0);
        let len = body.len();
        let priority = self.head.priority.unwrap_or(0);
        // Requests of its pool held for room go before it: the room a snapshot, or another
        // worker's request, left is theirs first. Queued behind them; the pass right after this
        // callback (`abi::after_route`) decides for them and it in their order.
        let sheddable = w.engine.config.shed_sheddable && priority < 0;
        let behind = hold.is_some_and(|h| {
            (1..h.max_held).contains(&w.held.len())
                && !sheddable
                && w.held.ahead(
                    priority,
                    prep.least_prefill(w.engine.config.prefix.block_tokens()),
                    |q| q.for_room.get() && q.pool == prep.pool,
                )
        });
        let mut dispatched = match behind {
            true => Err(HoldReason::Saturated),
            false => self.dispatch(
                w,
                &mut prep,
                t0,
                len,
                complete,
                hold.is_some(),
                affinity_hold,
            ),
        };
        if dispatched.is_err() && hold.is_some_and(|h| w.held.len() >= h.max_held) {
            // It would be held, and the worker holds `max_held`: counted, and decided again
            // without holding (it goes to a saturated pod at once). Only such a request is
            // counted, not every request while the queue is full (another pool's, a shed one).
            w.stats.hold(&prep.pool, HoldEvent::Full);
            dispatched = self.dispatch(w, &mut prep, t0, len, complete, false, false);
        }
        match dispatched {
            Ok(action) => Some(action),
            Err(reason) => {
                let prefill = prep.least_prefill(w.engine.config.prefix.block_tokens());
                let awaits = reason.awaited_pod();
                let for_affinity = awaits.is_some();
                let queued = Queued {
                    id: self.id,
                    pool: prep.pool.clone(),
                    for_room: Cell::new(!for_affinity),
                };
                w.held.push(priority, prefill, queued);
                w.pass_due |= behind;
                let pool = prep.pool.clone();
                w.stats.hold(&pool, HoldEvent::Held);
                if for_affinity {
                    w.stats.hold(&pool, HoldEvent::Affinity);
                }
                w.stats.held(&pool, 1);
                self.held = Some(Held {
                    prep: Box::new(prep),
                    size: len,
                    since_ns: t0,
                    waited_for_affinity: for_affinity,
                    awaits,
                    pool,
                    behind,
                });
                Some(Action::Pause)
            }
        }
    }

    /// Every pod of the request's pool is saturated ([`Decision::Overflow`]): decides again in
    /// the pool `to` it overflows to, with that pool's in-flight table (each move further down
    /// the failover list). `again`: [`Http::dispatch`]'s arguments. Out of line: rare, and kept
    /// out of the common path's code.
    #[cold]
    #[inline(never)]
    fn overflow(
        &mut self,
        w: &mut Worker,
        prep: &mut Prepared,
        to: usize,
        again: (u64, usize, bool, bool, bool),
    ) -> Result<Action, HoldReason> {
        let (t0, body_len, complete, holdable, affinity_hold) = again;
        w.engine.overflow(prep, to);
        self.dispatch(w, prep, t0, body_len, complete, holdable, affinity_hold)
    }

    /// Decides where the prepared request goes and tells Envoy (headers; or the filter's own
    /// answer). `t0`: when routing began (ns); `body_len`: the bytes buffered of the body (all of
    /// it when `complete`). `Err`: the request may be held (`holdable`; `affinity_hold`: also for
    /// the pod caching its prompt or adapter) and is, for the reason given: nothing was done, the
    /// caller holds it.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        w: &mut Worker,
        prep: &mut Prepared,
        t0: u64,
        body_len: usize,
        complete: bool,
        holdable: bool,
        affinity_hold: bool,
    ) -> Result<Action, HoldReason> {
        let now = t0 / 1_000_000;
        let sheddable = w.engine.config.shed_sheddable && self.head.priority.is_some_and(|p| p < 0);
        let debug = w.engine.config.debug_header;

        // The pool's in-flight requests: this worker's and the others', aligned with the
        // snapshot.
        let mut view = std::mem::take(&mut w.view);
        view.pods.clear();
        if let Some(pl) = w.pool_load(&prep.pool, t0) {
            view.version = pl.own.version;
            view.pods.extend_from_slice(&pl.own.pods);
            view.add_sparse(&pl.others);
        }
        w.add_replicas(&prep.pool, &mut view, now);
        let opts = DecideOptions {
            now_ms: now,
            sheddable,
            holdable,
            affinity_hold: holdable && affinity_hold,
            debug,
        };
        let mut choice = w
            .engine
            .decide(prep, w.fleet.as_ref(), &view.pods, opts, &mut w.rng);
        w.view = view;
        match choice.decision {
            Decision::Hold(reason) => return Err(reason),
            Decision::Overflow(to) => {
                let again = (t0, body_len, complete, holdable, affinity_hold);
                return self.overflow(w, prep, to, again);
            }
            _ => {}
        }
        // Counted with the decision that stands (a held request's, when it is released).
        if let Some(f) = &prep.failed_over {
            w.stats.moved(&prep.pool, f);
        }
        if prep.continues_response() {
            w.stats.inc(match choice.pinned_response {
                true => "gpuroute.responses.pinned",
                false => "gpuroute.responses.unpinned",
            });
        }
        self.debug = choice.debug.take();
        // The worker's first routed request and, at random, one in DECISION_SAMPLE after it: its
        // decision time is recorded, and, streamed, its time to the first byte. At random, not
        // every eighth: clients whose requests come in a fixed cycle (a streamed one among 7
        // others) would have the same kinds of request sampled, or never, cycle after cycle.
        let sampled = w.routed == 0 || w.rng.next_u64().is_multiple_of(DECISION_SAMPLE);

        let pool = &*prep.pool;
        match &choice.decision {
            Decision::Picked(_) => {
                let (Some(dest), Some(idx), Some(pod_key)) =
                    (&choice.destination, choice.picked_index, choice.picked_key)
                else {
                    return Ok(Action::Continue);
                };
                let dest = w.engine.config.data_plane.destination(dest);
                let _ = host::add_header(MapType::HttpRequestHeaders, headers::DESTINATION, dest);
                let flight = prep.in_flight(pod_key, choice.prefill_tokens);
                if let Some(pl) = w.loads.get_mut(pool) {
                    pl.own.count(idx, &flight);
                    pl.dirty = true;
                }
                // Published at once unless this worker published within the interval (then
                // with the next request or end after it, or the tick).
                w.publish_loads_throttled(t0, false);
                w.engine.commit(prep, pod_key);
                if let Some(addr) = dest.split(',').next() {
                    w.stats.picked(pool, pod_key, addr);
                }
                if flight.in_prefill && sampled {
                    self.ttft_from = Some(t0);
                }
                // Only with passive health on: reading the status costs a host call.
                self.watch_status = sampled && w.engine.outliers.enabled();
                // Not an upload routed by its leading fields: the pod counts it only once the
                // rest has come, however long the client takes to send it.
                if complete && w.engine.outliers.watches_unanswered() {
                    let sent = outlier::Unanswered::new(pod_key, prep.pool.clone(), t0 / 1_000_000);
                    w.unanswered.insert(self.id, sent);
                    self.awaits_answer = true;
                }
                self.picked = Some(flight);
                self.learn_response = prep
                    .learns_response
                    .then(|| (pod_key, request::ResponseHead::default()));
                self.first_output =
                    (prep.learns_response && prep.stream).then(request::FirstOutput::default);
            }
            Decision::FailOpen(reason) => {
                // Envoy's balancer picks the pod: the id is learned for the one that answers.
                self.learn_response = prep
                    .learns_response
                    .then(|| (0, request::ResponseHead::default()));
                if w.engine.config.data_plane == DataPlane::OriginalDst {
                    // No load balancer behind an ORIGINAL_DST cluster: pick any known pod.
                    let pool_state = w.fleet.as_ref().and_then(|f| f.pool(pool));
                    let any = pool_state.and_then(|p| Engine::any_pod(p, &mut w.rng));
                    match any {
                        Some(addr) => {
                            let _ = host::set_header(
                                MapType::HttpRequestHeaders,
                                headers::DESTINATION,
                                &addr,
                            );
                        }
                        None => {
                            // Answered, not failed open: one outcome per request.
                            w.stats.pool_outcome(pool, "error");
                            return Ok(self.reply_error(&ApiError::no_endpoints(pool)));
                        }
                    }
                }
                if reason.by_design() {
                    w.stats.pool_outcome(pool, "routed");
                } else {
                    w.stats.pool_outcome(pool, "fail_open");
                    w.stats
                        .inc(&format!("gpuroute.fail_open.{}", reason.as_str()));
                }
            }
            Decision::Shed => {
                w.stats.pool_outcome(pool, "shed");
                return Ok(self.reply_error(&ApiError::shed(pool)));
            }
            // Returned above.
            Decision::Hold(_) | Decision::Overflow(_) => {}
        }
        self.set_routing_headers(prep, body_len, complete);
        if sampled {
            let t1 = host::now_nanos();
            w.stats
                .histogram("gpuroute.decision_us", t1.saturating_sub(t0) / 1_000);
        }
        w.routed = w.routed.wrapping_add(1);
        Ok(Action::Continue)
    }

    /// `body_len`: the bytes buffered of the request's body (all of it when `complete`).
    fn set_routing_headers(&self, prep: &Prepared, body_len: usize, complete: bool) {
        let h = MapType::HttpRequestHeaders;
        // Added, not replaced: every internal header was stripped on arrival (cheaper for Envoy).
        for (name, value) in prep.routing_headers() {
            let _ = host::add_header(h, name, value);
        }
        if let Some(rewrite) = &prep.rewrite {
            // Envoy drains the body's first `replaced` bytes and puts `with` before the rest:
            // only the bytes up to the model's value cross into Envoy.
            let (replaced, with) = (rewrite.replaced, &rewrite.with);
            if host::set_buffer(BufferType::HttpRequestBody, 0, replaced, with).is_ok() {
                let declared = self.head.content_length;
                let (old, new) = (body_len, rewrite.new_len(body_len));
                if let Some(n) = engine::rewritten_length(complete, declared, old, new) {
                    let _ = host::set_header(h, "content-length", &n.to_string());
                }
            }
        }
    }
}

/// This Envoy process's epoch for the prefix exchange's cursors (`exchange::EPOCH_KEY`): the
/// first worker to answer a relay writes one at random, and every answer reads what is stored,
/// so two workers that raced to write it agree from then on. Shared data lives as long as the
/// process, across VM reloads and configuration changes.
fn envoy_epoch(w: &mut Worker) -> u64 {
    let stored = || {
        host::get_shared(exchange::EPOCH_KEY)
            .0
            .and_then(|v| v.try_into().ok().map(u64::from_le_bytes))
            .filter(|e| *e != 0)
    };
    stored().unwrap_or_else(|| {
        let mine = gpuroute_core::rng::mix64(host::now_nanos() ^ w.rng.next_u64()).max(1);
        let _ = host::set_shared(exchange::EPOCH_KEY, &mine.to_le_bytes(), None);
        stored().unwrap_or(mine)
    })
}

/// Applies a completion to the worker's table of the pool, and publishes the table at once when
/// this worker did not publish within `shared_refresh_ms`, or when the table is left with no
/// request in flight. A worker that went quiet has no later request or end to publish that end
/// with, and until its tick (`tick_ms`, later on a loaded host) the other workers would count
/// the finished request on its pod, and send the next turn of a conversation that pod holds
/// elsewhere. With requests still in flight, a throttled end waits at most for the next
/// publication or the tick.
fn complete(worker: &Option<Rc<RefCell<Worker>>>, pool: &str, op: Completion) {
    // The worker is never borrowed between callbacks (one VM thread, callbacks never nest).
    let Some(mut w) = worker.as_ref().and_then(|w| w.try_borrow_mut().ok()) else {
        return;
    };
    // No other worker to read the table: it is not published (one that joins later reads it
    // as published last, and so may count this request until this worker's next publication or
    // tick).
    let alone = w.peers.is_empty();
    let Some(pl) = w.loads.get_mut(pool) else {
        return;
    };
    // A pod that left the table has nothing to undo.
    if !op.apply(&mut pl.own) {
        return;
    }
    pl.dirty = true;
    if alone {
        return;
    }
    let idle = pl.own.is_idle();
    w.publish_loads_throttled(host::now_nanos(), idle);
}

fn peer_is_loopback() -> bool {
    let Some(raw) = host::get_property(&["source", "address"]) else {
        return false;
    };
    let Ok(s) = std::str::from_utf8(&raw) else {
        return false;
    };
    s.parse::<SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| s.parse::<IpAddr>())
        .is_ok_and(|ip| ip.is_loopback())
}

/// The stream callbacks, called by [`abi`].
impl Http {
    fn on_request_headers(&mut self, end_of_stream: bool) -> Action {
        // One host call reads every header; only client-sent internal headers are removed.
        let raw = host::get_header_map(MapType::HttpRequestHeaders);
        self.head = RequestHead::read(host::header_pairs(&raw));
        for h in &self.head.forged {
            let _ = host::remove_header(MapType::HttpRequestHeaders, h);
        }
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        // Never borrowed between callbacks (one VM thread, callbacks never nest); were it ever,
        // Envoy's own routing takes the request rather than a panic taking the VM down.
        let Ok(mut w) = worker.try_borrow_mut() else {
            return Action::Continue;
        };
        self.path = std::mem::take(&mut self.head.path);
        let method = std::mem::take(&mut self.head.method);

        let ingest = w.engine.config.ingest.as_ref();
        if let Some(ep) = ingest.and_then(|i| Endpoint::of(i, &self.path)) {
            return self.ingest_headers(&mut w, ep, &method, end_of_stream);
        }
        if method == "GET" {
            if let Some(q) = ModelsQuery::of(&self.path, &w.engine.config.models_path) {
                w.stats.inc("gpuroute.models_list");
                let (status, body) = w.engine.routes().models_answer(&q, self.head.anthropic);
                let body = body.into_owned();
                return self.reply(u32::from(status), &body, JSON);
            }
        }
        if let Some(id) = request::stored_response_path(&self.path) {
            self.stored_response(&mut w, id.to_owned());
            return Action::Continue;
        }
        if w.engine.config.is_inference_path(&self.path) {
            if let Err(e) = self.head.admit(&method, w.engine.config.max_body_bytes) {
                return self.reject(&mut w, &e);
            }
            self.mode = Mode::Inference;
            if end_of_stream {
                return self.route(&mut w, 0);
            }
            return Action::Pause;
        }
        Action::Continue
    }

    fn on_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        // Never borrowed between callbacks (one VM thread, callbacks never nest); were it ever,
        // Envoy's own routing takes the request rather than a panic taking the VM down.
        let Ok(mut w) = worker.try_borrow_mut() else {
            return Action::Continue;
        };
        self.body_size = body_size;
        match self.mode {
            Mode::Inference => {
                // A form is routed as soon as its fields are in (before its file, when they come
                // first: the upload then streams on, whatever its size), while what is buffered
                // of it is short; else at its end.
                let form = self.head.form_boundary.is_some();
                if form && !end_of_stream && self.form_scanned < form::EARLY_BYTES {
                    self.form_scanned = body_size;
                    if let Some(action) = self.route_body(&mut w, body_size, false) {
                        if matches!(self.mode, Mode::Inference) {
                            self.mode = Mode::Pass;
                        }
                        return action;
                    }
                }
                let max = w.engine.config.max_body_bytes;
                if body_size > max {
                    let e = self.head.too_large(max);
                    return self.reject(&mut w, &e);
                }
                if !end_of_stream {
                    return Action::Pause;
                }
                self.route(&mut w, body_size)
            }
            Mode::Ingest { endpoint, current } => {
                let checked = w
                    .engine
                    .config
                    .ingest
                    .as_ref()
                    .map(|i| ingest::check_size(i, endpoint, body_size));
                if let Some(Err((reason, e))) = checked {
                    w.stats.ingest_rejected(endpoint, reason);
                    return self.reply_error(&e);
                }
                if !end_of_stream {
                    return Action::Pause;
                }
                self.ingest_end(&mut w, endpoint, body_size, current)
            }
            Mode::Answered => Action::Pause,
            Mode::Pass => Action::Continue,
        }
    }

    /// A stored response's own call (`GET`/`DELETE /v1/responses/{id}`, its `cancel`) carries
    /// no model: it goes to the pod whose answer carried the id, when this worker knows it
    /// (else on, unrouted, to the route table's 404).
    fn stored_response(&mut self, w: &mut Worker, id: String) {
        w.join();
        w.refresh_shared_throttled(host::now_nanos());
        fn known<'w>(w: &'w Worker, id: &str) -> Option<(&'w str, &'w str)> {
            w.engine.stored_response_pod(id, w.fleet.as_ref()?)
        }
        if known(w, &id).is_none() {
            // Another worker may have served it: its slot says so before any tick.
            w.note_shared_response(engine::response_key(&id));
        }
        let pinned = match known(w, &id) {
            Some((pool, address)) => {
                let h = MapType::HttpRequestHeaders;
                let _ = host::add_header(h, headers::POOL, pool);
                let _ = host::add_header(h, headers::DESTINATION, address);
                "gpuroute.responses.pinned"
            }
            None => "gpuroute.responses.unpinned",
        };
        w.stats.inc(pinned);
    }

    /// An HTTP/2 request can end with trailers instead of with its last body bytes: its body,
    /// buffered, is then whole, and is routed (or ingested) as at the end of the body.
    fn on_request_trailers(&mut self) -> Action {
        let Some(worker) = self.worker.clone() else {
            return Action::Continue;
        };
        let Ok(mut w) = worker.try_borrow_mut() else {
            return Action::Continue;
        };
        match self.mode {
            Mode::Inference => {
                // Routed once, here: a request whose body ended it has no trailers.
                self.mode = Mode::Pass;
                self.route(&mut w, self.body_size)
            }
            Mode::Ingest { endpoint, current } => {
                self.ingest_end(&mut w, endpoint, self.body_size, current)
            }
            Mode::Answered => Action::Pause,
            Mode::Pass => Action::Continue,
        }
    }

    fn on_response_headers(&mut self) -> Action {
        // A stream is answered by its first chunk (`outlier::Unanswered`).
        if !self.picked.as_ref().is_some_and(|p| p.in_prefill) {
            self.answer_came();
        }
        if let Some(d) = &self.debug {
            let _ = host::set_header(MapType::HttpResponseHeaders, headers::DEBUG, d);
        }
        if self.learn_response.is_none() && self.ttft_from.is_none() && self.first_output.is_none()
        {
            // A picked pod's answer tells passive health how it did: its status alone, read for
            // the sampled decisions (one in DECISION_SAMPLE) until an error puts a pod on
            // record, then for every answer. Reading it costs ~11,000 Envoy instructions (a
            // crossing out of the VM, and one back in to allocate the value), 3.5% of a plain
            // request's: a pod failing everything is found within ~DECISION_SAMPLE of its
            // answers instead of at once, for an eighth of that.
            if self.picked.is_some() && (self.watch_status || self.outliers_tracking()) {
                let status = host::get_header(MapType::HttpResponseHeaders, ":status");
                self.answered(status.as_deref());
            }
            return Action::Continue;
        }
        // Only requests that learn a response's id or time a first token read the head.
        let raw = host::get_header_map(MapType::HttpResponseHeaders);
        let pairs = host::header_pairs(&raw);
        let header = |name: &[u8]| pairs.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
        // A first token only from a success: an error's first byte (a pod's 503, Envoy's own
        // when no pod took the request) timed as one pulled the histogram down just when
        // things were worst.
        let status = header(b":status");
        self.answered(status);
        if !status.is_some_and(request::is_success) {
            self.ttft_from = None;
            // An error has no preamble to read past: its first byte ends the prefill.
            self.first_output = None;
        }
        // A Responses API answer: whether its id is learned, and for which pod (the one that
        // answered).
        if let Some((pod, _)) = self.learn_response.as_mut() {
            let upstream = host::get_property(&["upstream", "address"]);
            match request::response_learner(
                status,
                header(b"content-encoding"),
                upstream.as_deref(),
                *pod,
            ) {
                Some(answered) => *pod = answered,
                None => self.learn_response = None,
            }
        }
        Action::Continue
    }

    /// The request's answer came: out of its worker's `unanswered`.
    fn answer_came(&mut self) {
        if std::mem::take(&mut self.awaits_answer) {
            if let Some(mut w) = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok()) {
                self.lost = w.unanswered.remove(&self.id).is_some_and(|u| u.is_lost());
            }
        }
    }

    /// Whether this worker's passive health has a pod on record (every answer's status counts).
    fn outliers_tracking(&self) -> bool {
        self.worker
            .as_ref()
            .and_then(|w| w.try_borrow().ok())
            .is_some_and(|w| w.engine.outliers.tracking())
    }

    /// Tells passive health how the picked pod answered (`status`, the answer's `:status`):
    /// a server error counts toward ejecting the pod that gave it, another answer ends its run
    /// ([`gpuroute_core::outlier`]). Only a server error, or an answer while some pod is on
    /// record, costs more than a look at the status.
    fn answered(&mut self, status: Option<&[u8]>) {
        let Some(p) = &self.picked else {
            return;
        };
        let Some(mut w) = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok()) else {
            return;
        };
        let w = &mut *w;
        let server_error = status.is_some_and(outlier::is_server_error);
        // Only for a server error: a success's path does not look.
        let lost = || {
            self.lost
                || (self.awaits_answer && w.unanswered.get(&self.id).is_some_and(|u| u.is_lost()))
        };
        if server_error && lost() {
            // Judged unanswered: counted in the pod's run then.
            return;
        }
        if !w.engine.outliers.enabled() || !(server_error || w.engine.outliers.tracking()) {
            return;
        }
        // The pod that answered: Envoy may have retried a refused connection on a fallback.
        let upstream = host::get_property(&["upstream", "address"]);
        let pod = request::answered_by(upstream.as_deref(), p.pod_key);
        let now = host::now_ms();
        if let Some(e) = w
            .engine
            .answered(&p.pool, pod, status, w.fleet.as_ref(), now)
        {
            let address = upstream.as_deref().map(String::from_utf8_lossy);
            let message = e.message(
                address.as_deref().unwrap_or("(picked)"),
                &p.pool,
                w.engine.config.outlier_detection.consecutive_5xx,
                status.unwrap_or_default(),
            );
            w.eject(&p.pool, pod, e.for_ms, now, &message);
        }
    }

    fn on_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        // A Responses answer's chunk, read once for its id and for its first output: as much as
        // either still reads.
        let want = match (&self.learn_response, &self.first_output) {
            (_, Some(_)) => body_size,
            (Some((_, head)), None) => body_size.min(head.room()),
            (None, None) => 0,
        };
        let chunk = if want > 0 {
            host::get_buffer(BufferType::HttpResponseBody, 0, want).unwrap_or_default()
        } else {
            Vec::new()
        };
        // A Responses API answer's id, from its first bytes: a later turn continuing it goes to
        // this pod, which holds it.
        if let Some((pod, head)) = self.learn_response.as_mut() {
            let (pod, found) = (*pod, head.push(&chunk[..chunk.len().min(head.room())]));
            if found.is_some() || head.room() == 0 || end_of_stream {
                self.learn_response = None;
            }
            let worker = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok());
            if let (Some(id), Some(mut w)) = (found, worker) {
                w.engine.learn_response(&id, pod);
                w.stats.inc("gpuroute.responses.learned");
                // In the workers' shared slots at once, before the client has the answer: its
                // next turn may reach another worker before this one's tick.
                let (slot, value) = engine::response_slot(engine::response_key(&id), pod);
                let _ = host::set_shared(&slot, &value, None);
            }
        }
        // The first streamed chunk is the first token (vLLM sends its first SSE event with the
        // first output): the pod's prefill of this request is over. A Responses stream's first
        // output comes after its preamble events, read here until then.
        if let Some(first) = self.first_output.as_mut() {
            if !first.push(&chunk) && !end_of_stream {
                return Action::Continue;
            }
            self.first_output = None;
        }
        let mut first_byte = false;
        if let Some(p) = self.picked.as_mut() {
            if let Some(op) = p.first_byte() {
                complete(&self.worker, &p.pool, op);
                first_byte = true;
                if let Some(t0) = self.ttft_from.take() {
                    let ms = host::now_nanos().saturating_sub(t0) / 1_000_000;
                    if let Some(mut w) = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok())
                    {
                        w.stats.first_token(&p.pool, ms);
                    }
                }
            }
        }
        if first_byte {
            self.answer_came();
        }
        Action::Continue
    }

    /// After a callback that routed this request: its worker, when the request was queued behind
    /// held requests of its pool, for the pass that decides again for them and it.
    pub(crate) fn queued_behind(&mut self) -> Option<Rc<RefCell<Worker>>> {
        let worker = self.worker.as_ref()?;
        let mut w = worker.try_borrow_mut().ok()?;
        if !std::mem::take(&mut w.pass_due) {
            return None;
        }
        drop(w);
        self.worker.clone()
    }

    /// The request is over (the host deletes its context): it leaves the in-flight table, or,
    /// held (its client left), its worker's queue. Returns the pod it leaves room on.
    fn on_end(&mut self) -> Option<u64> {
        if std::mem::take(&mut self.awaits_answer) {
            // Ended with no answer (its client left, or Envoy gave up): judged once more by the
            // latest reading of its pod.
            if let Some(mut w) = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok()) {
                if let Some(mut sent) = w.unanswered.remove(&self.id).filter(|u| !u.is_lost()) {
                    w.judge_unanswered(&mut sent, host::now_ms());
                }
            }
        }
        let freed = self.picked.take().map(|p| {
            complete(&self.worker, &p.pool, p.finished());
            p.pod_key
        });
        if let Some(held) = self.held.take() {
            if let Some(mut w) = self.worker.as_ref().and_then(|w| w.try_borrow_mut().ok()) {
                w.held.remove(|c| c.id == self.id);
                w.stats.hold(&held.pool, HoldEvent::Cancelled);
                w.stats.held(&held.pool, -1);
            }
        }
        freed
    }

    /// Decides again for this request, held while its pool (or the pod caching its prompt or
    /// adapter) was saturated (the host's effective context is this stream's). Pools in `blocked`
    /// were found still saturated in this pass. `pass`: why; a request waiting for a pod is
    /// decided again on a tick or that pod's request's end, not on another pod's.
    pub(crate) fn release(&mut self, blocked: &[Arc<str>], pass: Pass) -> Release {
        let Some(worker) = self.worker.clone() else {
            return Release::Nothing;
        };
        let Ok(mut w) = worker.try_borrow_mut() else {
            return Release::Nothing;
        };
        let Some(mut held) = self.held.take() else {
            return Release::Nothing;
        };
        let now_ns = host::now_nanos();
        // Moved to a failover pool and held there: back to its own once that has room.
        w.engine
            .homeward(w.fleet.as_ref(), now_ns / 1_000_000, &mut held.prep);
        let limits = w.engine.config.hold.unwrap_or_default();
        let waited_ms = now_ns.saturating_sub(held.since_ns) / 1_000_000;
        let expired = limits.expired(waited_ms);
        if !expired && !held.behind && blocked.contains(&held.prep.pool) {
            let pool = held.prep.pool.clone();
            self.held = Some(held);
            return Release::Held(pool);
        }
        held.behind = false;
        let affinity_hold = limits.may_await(waited_ms);
        if let (Some(pod), true) = (held.awaits, affinity_hold) {
            if pass == Pass::Queued || matches!(pass, Pass::Ended(f) if f != pod) {
                self.held = Some(held);
                return Release::Waiting;
            }
        }
        let Held { mut prep, .. } = held;
        w.refresh_shared_throttled(now_ns);
        match self.dispatch(
            &mut w,
            &mut prep,
            now_ns,
            held.size,
            true,
            !expired,
            affinity_hold,
        ) {
            Err(reason) => {
                let pool = prep.pool.clone();
                let awaits = reason.awaited_pod();
                let first_wait = awaits.is_some() && !held.waited_for_affinity;
                if first_wait {
                    w.stats.hold(&held.pool, HoldEvent::Affinity);
                }
                if let Some(q) = w.held.iter().find(|q| q.id == self.id) {
                    q.for_room.set(awaits.is_none());
                }
                self.held = Some(Held {
                    prep,
                    waited_for_affinity: held.waited_for_affinity || first_wait,
                    awaits,
                    ..held
                });
                match awaits {
                    None => Release::Held(pool),
                    Some(_) => Release::Waiting,
                }
            }
            Ok(action) => {
                w.held.remove(|c| c.id == self.id);
                w.stats.held(&held.pool, -1);
                // `Pause`: the filter answered it (shed, or no pod with ORIGINAL_DST), not sent.
                let answered = matches!(action, Action::Pause);
                w.stats.hold(&held.pool, HoldEvent::left(expired, answered));
                w.stats.hold_waited(&held.pool, waited_ms);
                if let Some(d) = self.debug.as_mut() {
                    *d = engine::held_debug(waited_ms, d);
                }
                match action {
                    Action::Continue => Release::Continue,
                    Action::Pause => Release::Answered,
                }
            }
        }
    }
}
