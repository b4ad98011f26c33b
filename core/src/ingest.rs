//! The snapshot ingest endpoint's rules (authentication, validation, versioning) and the layout
//! of the snapshot in Envoy shared data. Pure functions; the filter calls them and does the I/O.
//!
//! Shared data holds three keys per VM id:
//! - [`SNAPSHOT_KEY`]: [`StoredHeader`] (received-at and version) followed by the snapshot JSON
//!   as accepted;
//! - [`SNAPSHOT_BINARY_KEY`]: the same header followed by the snapshot's binary form
//!   ([`Snapshot::encode_binary`]), which workers decode in a fraction of the JSON's time. The
//!   JSON stays for a build without it (during a change of the filter, an old and a new VM share
//!   the keys), and is read when the binary form is not of the current version;
//! - [`SNAPSHOT_VERSION_KEY`]: the 16-byte header alone. Workers read this small key per request
//!   and decode a big one only when the version changed.
//!
//! And [`STALE_WINDOW_KEY`]: the longest `stale_after_ms` of the configurations that route in this
//! VM, for the ingest's [`version_floor`] (the ingest listener's own configuration has no pools).

use crate::config::IngestConfig;
use crate::error::ApiError;
use crate::snapshot::{Snapshot, SnapshotError};

/// Shared-data key of the stored snapshot.
pub const SNAPSHOT_KEY: &str = "gpuroute.snapshot";
/// Shared-data key of the stored snapshot's binary form.
pub const SNAPSHOT_BINARY_KEY: &str = "gpuroute.snapshot.binary";
/// Shared-data key of its version header.
pub const SNAPSHOT_VERSION_KEY: &str = "gpuroute.snapshot.version";

/// Shared-data key of the longest `stale_after_ms` of any configuration that routes, 8 bytes
/// little-endian ([`widen_stale_window`]).
pub const STALE_WINDOW_KEY: &str = "gpuroute.snapshot.stale_window_ms";

/// The value [`STALE_WINDOW_KEY`] holds read as milliseconds (0 when unset or malformed).
pub fn decode_stale_window(b: Option<&[u8]>) -> u64 {
    b.and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map_or(0, u64::from_le_bytes)
}

/// What [`STALE_WINDOW_KEY`] should hold once a configuration whose longest `stale_after_ms` is
/// `mine` is loaded, `None` when it already holds as long a window. The window only widens
/// (until Envoy restarts): the ingest listener cannot tell a configuration that was replaced
/// from one still routing, and a window too long only keeps a runaway version a little longer.
pub fn widen_stale_window(current: Option<&[u8]>, mine: u64) -> Option<[u8; 8]> {
    (mine > decode_stale_window(current)).then(|| mine.to_le_bytes())
}

/// Received-at time and version of the stored snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredHeader {
    pub received_at_ms: u64,
    pub version: u64,
}

impl StoredHeader {
    pub const LEN: usize = 16;

    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&self.received_at_ms.to_le_bytes());
        b[8..].copy_from_slice(&self.version.to_le_bytes());
        b
    }

    pub fn decode(bytes: &[u8]) -> Option<StoredHeader> {
        let h = bytes.get(..16)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&h[..8]);
        let received_at_ms = u64::from_le_bytes(a);
        a.copy_from_slice(&h[8..16]);
        Some(StoredHeader {
            received_at_ms,
            version: u64::from_le_bytes(a),
        })
    }
}

/// Why an ingest request was refused (the `gpuroute.<endpoint>.rejected.<reason>` stat, see
/// [`Endpoint::stat`]) and the answer to send.
pub type Refusal = (&'static str, ApiError);

/// The two endpoints of the ingest configuration, under one token, peer rule and size limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `ingest.path`: `POST` of a snapshot.
    Snapshot,
    /// `ingest.prefix_path`: the prefix-record exchange between gateway replicas
    /// ([`crate::exchange`]), `GET` and `POST`.
    Prefix,
    /// `ingest.load_path`: the in-flight exchange between gateway replicas
    /// ([`crate::replica_load`]), `GET` and `POST`.
    Load,
}

/// Why an ingest endpoint refuses a request, as its counters name it
/// (`gpuroute.<endpoint>.rejected.<reason>`). The proxy-wasm build adds `not_stored` (shared
/// data did not take it); the dynamic module stores in its own memory.
pub const REJECT_REASONS: [&str; 5] = [
    "method",
    "forbidden",
    "unauthorized",
    "too_large",
    "invalid",
];

impl Endpoint {
    pub const ALL: [Endpoint; 3] = [Endpoint::Snapshot, Endpoint::Prefix, Endpoint::Load];

    /// Which endpoint `path` (without its query) is, if either.
    pub fn of(cfg: &IngestConfig, path: &str) -> Option<Endpoint> {
        if cfg.path == path {
            Some(Endpoint::Snapshot)
        } else if !cfg.prefix_path.is_empty() && cfg.prefix_path == path {
            Some(Endpoint::Prefix)
        } else if !cfg.load_path.is_empty() && cfg.load_path == path {
            Some(Endpoint::Load)
        } else {
            None
        }
    }

    /// The methods it takes, as the 405 names them.
    fn allowed(self) -> &'static str {
        match self {
            Endpoint::Snapshot => "POST",
            Endpoint::Prefix | Endpoint::Load => "GET, POST",
        }
    }

    /// What it takes, as its refusals name it.
    fn what(self) -> &'static str {
        match self {
            Endpoint::Snapshot => "snapshots",
            Endpoint::Prefix => "prefix records",
            Endpoint::Load => "in-flight counts",
        }
    }

    /// The error code of a body over the size limit.
    fn too_large_code(self) -> &'static str {
        match self {
            Endpoint::Snapshot => "snapshot_too_large",
            Endpoint::Prefix => "prefix_records_too_large",
            Endpoint::Load => "replica_load_too_large",
        }
    }

    /// Its segment in the refusal stat: `gpuroute.<stat>.rejected.<reason>`.
    pub fn stat(self) -> &'static str {
        match self {
            Endpoint::Snapshot => "snapshot",
            Endpoint::Prefix => "prefix",
            Endpoint::Load => "replica_load",
        }
    }
}

/// Checks a request to an ingest endpoint before its body, in this order: method, peer, token,
/// declared size. `peer_is_loopback` is asked only when the configuration restricts the peer.
pub fn check_request(
    cfg: &IngestConfig,
    endpoint: Endpoint,
    method: &str,
    peer_is_loopback: impl FnOnce() -> bool,
    authorization: Option<&str>,
    content_length: Option<usize>,
) -> Result<(), Refusal> {
    let allowed = endpoint.allowed();
    if !allowed.split(", ").any(|m| m == method) {
        return Err(("method", ApiError::method_not_allowed(allowed)));
    }
    if cfg.loopback_only && !peer_is_loopback() {
        let mut e = ApiError::unauthorized();
        e.status = 403;
        e.message = format!("{} are accepted from loopback peers only", endpoint.what());
        return Err(("forbidden", e));
    }
    if !authorized(authorization, &cfg.token) {
        return Err(("unauthorized", ApiError::unauthorized()));
    }
    check_size(cfg, endpoint, content_length.unwrap_or(0))
}

/// Checks the bytes of a body received (or declared) so far against the limit
/// (`max_snapshot_bytes`, for both endpoints).
pub fn check_size(cfg: &IngestConfig, endpoint: Endpoint, bytes: usize) -> Result<(), Refusal> {
    if bytes > cfg.max_snapshot_bytes {
        let message = format!(
            "{} exceed the limit of {} bytes",
            endpoint.what(),
            cfg.max_snapshot_bytes
        );
        let e = ApiError::ingest_too_large(endpoint.too_large_code(), message);
        return Err(("too_large", e));
    }
    Ok(())
}

/// Whether an `Authorization` header value carries the token (`Bearer <token>`). The comparison
/// takes the same time wherever the first difference is.
pub fn authorized(header: Option<&str>, token: &str) -> bool {
    let Some(v) = header else { return false };
    let Some(given) = v.strip_prefix("Bearer ").map(str::trim) else {
        return false;
    };
    let (a, b) = (given.as_bytes(), token.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The version a pushed snapshot must be newer than: the current snapshot's (`current`), while
/// routing may still read it. Once it was received more than `stale_after_ms` ago (the longest
/// of the pools', [`crate::config::Config::longest_stale_after_ms`], of every configuration that
/// routes: [`STALE_WINDOW_KEY`]), every pod in it is stale
/// and any valid snapshot replaces it. Else one version from a clock that ran ahead (an
/// aggregator restarted after its clock stepped back, or a single bad push) would have every
/// later push refused, and the gateway failing open, until Envoy restarted.
pub fn version_floor(
    current: Option<StoredHeader>,
    now_ms: u64,
    stale_after_ms: u64,
) -> Option<u64> {
    current
        .filter(|h| now_ms.saturating_sub(h.received_at_ms) <= stale_after_ms)
        .map(|h| h.version)
}

/// The warning logged when a snapshot replaced a stale one of a version not older than its own.
pub fn went_back(old: u64, new: u64) -> String {
    format!(
        "gpuroute: snapshot version {new} replaced the stale snapshot of version {old}: \
         versions went back (the aggregator restarted with its clock behind, or a version ran ahead)"
    )
}

/// Validates a pushed snapshot against the size limit, the schema and the stored version.
/// `current`: the version it must be newer than ([`version_floor`]).
pub fn accept(body: &[u8], max_bytes: usize, current: Option<u64>) -> Result<Snapshot, ApiError> {
    let snap = Snapshot::from_json(body, max_bytes).map_err(|e| match e {
        SnapshotError::TooLarge { .. } => ApiError::snapshot_too_large(e.to_string()),
        other => ApiError::bad_snapshot(other.to_string()),
    })?;
    if let Some(cur) = current {
        if snap.version <= cur {
            return Err(ApiError::bad_snapshot(
                SnapshotError::NotNewer {
                    offered: snap.version,
                    current: cur,
                }
                .to_string(),
            ));
        }
    }
    Ok(snap)
}

/// A stored value: `header`, then `payload` (the JSON under [`SNAPSHOT_KEY`], the binary form
/// under [`SNAPSHOT_BINARY_KEY`]).
pub fn encode_stored(header: StoredHeader, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(StoredHeader::LEN + payload.len());
    v.extend_from_slice(&header.encode());
    v.extend_from_slice(payload);
    v
}

/// Decodes the value stored under [`SNAPSHOT_KEY`]. It was validated when accepted, so a failure
/// here means corruption; the caller treats it as "no snapshot" (fail open).
pub fn decode_stored(bytes: &[u8]) -> Option<(StoredHeader, Snapshot)> {
    let header = StoredHeader::decode(bytes)?;
    let snap: Snapshot = serde_json::from_slice(bytes.get(StoredHeader::LEN..)?).ok()?;
    Some((header, snap))
}

/// What a worker finds in shared data for a new version header.
#[derive(Debug, PartialEq)]
pub enum Stored {
    /// The snapshot, when it was received (unix ms), and whether it was read from the JSON.
    Found(Snapshot, u64, bool),
    /// No snapshot stored.
    Missing,
    /// A stored value that does not decode: corruption (it was validated when accepted).
    Unreadable,
}

/// The snapshot for version header `want`: the binary form (`binary`, the value under
/// [`SNAPSHOT_BINARY_KEY`]) when it is of that version, the JSON otherwise (`json` reads the value
/// under [`SNAPSHOT_KEY`], only then): after a racing push, or a push a build before the binary
/// form took.
pub fn read_stored(
    want: StoredHeader,
    binary: Option<&[u8]>,
    json: impl FnOnce() -> Option<Vec<u8>>,
) -> Stored {
    if let Some(snap) = binary.and_then(|b| decode_stored_binary(b, want)) {
        return Stored::Found(snap, want.received_at_ms, false);
    }
    match json() {
        None => Stored::Missing,
        Some(stored) => match decode_stored(&stored) {
            Some((h, snap)) => Stored::Found(snap, h.received_at_ms, true),
            None => Stored::Unreadable,
        },
    }
}

/// The value stored under [`SNAPSHOT_BINARY_KEY`].
pub fn encode_stored_binary(header: StoredHeader, snap: &Snapshot) -> Vec<u8> {
    encode_stored(header, &snap.encode_binary())
}

/// Decodes the value stored under [`SNAPSHOT_BINARY_KEY`] if it is of version `want` (a racing
/// push may have left another there); `None` otherwise, and for a value that does not decode.
pub fn decode_stored_binary(bytes: &[u8], want: StoredHeader) -> Option<Snapshot> {
    if StoredHeader::decode(bytes)? != want {
        return None;
    }
    Snapshot::decode_binary(bytes.get(StoredHeader::LEN..)?).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::{PodSnapshot, PoolSnapshot, SNAPSHOT_SCHEMA};

    fn snap(version: u64) -> Vec<u8> {
        serde_json::to_vec(&Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version,
            source: String::new(),
            generated_at_ms: 1,
            pools: vec![PoolSnapshot {
                name: "p".into(),
                pods: vec![PodSnapshot::new("127.0.0.1:1", 1)],
            }],
        })
        .unwrap()
    }

    #[test]
    fn the_stale_window_only_widens() {
        assert_eq!(decode_stale_window(None), 0);
        assert_eq!(decode_stale_window(Some(b"short")), 0);
        let five = widen_stale_window(None, 5_000).unwrap();
        assert_eq!(decode_stale_window(Some(&five)), 5_000);
        // The ingest listener's own 1 s default, or a shorter configuration later: unchanged.
        assert_eq!(widen_stale_window(Some(&five), 1_000), None);
        assert_eq!(widen_stale_window(Some(&five), 5_000), None);
        let ten = widen_stale_window(Some(&five), 10_000).unwrap();
        assert_eq!(decode_stale_window(Some(&ten)), 10_000);
        // A malformed value is replaced.
        assert!(widen_stale_window(Some(b"bad"), 1).is_some());
    }

    #[test]
    fn bearer_token_must_match_exactly() {
        assert!(authorized(Some("Bearer secret-token"), "secret-token"));
        assert!(!authorized(Some("Bearer secret-tokeN"), "secret-token"));
        assert!(!authorized(Some("Bearer secret"), "secret-token"));
        assert!(!authorized(Some("secret-token"), "secret-token"));
        assert!(!authorized(None, "secret-token"));
    }

    #[test]
    fn versions_must_increase() {
        assert!(accept(&snap(5), 1 << 20, None).is_ok());
        assert!(accept(&snap(5), 1 << 20, Some(4)).is_ok());
        let e = accept(&snap(5), 1 << 20, Some(5)).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("not newer"), "{}", e.message);
        assert_eq!(accept(&snap(3), 1 << 20, Some(5)).unwrap_err().status, 400);
    }

    #[test]
    fn a_stale_snapshot_is_replaced_whatever_its_version() {
        let runaway = StoredHeader {
            received_at_ms: 10_000,
            version: u64::MAX,
        };
        // Read by routing until `stale_after_ms` after it came: nothing older replaces it.
        for now in [10_000, 11_000] {
            let floor = version_floor(Some(runaway), now, 1_000);
            assert_eq!(floor, Some(u64::MAX));
            assert_eq!(accept(&snap(7), 1 << 20, floor).unwrap_err().status, 400);
        }
        // Then every pod in it is stale, and any valid snapshot replaces it.
        let floor = version_floor(Some(runaway), 11_001, 1_000);
        assert_eq!(floor, None);
        assert!(accept(&snap(7), 1 << 20, floor).is_ok());
        // A clock that went back since it came does not make it fresh for longer.
        assert_eq!(version_floor(Some(runaway), 9_000, 1_000), Some(u64::MAX));
        assert_eq!(version_floor(None, 11_001, 1_000), None);
    }

    #[test]
    fn oversize_is_413_and_garbage_is_400() {
        assert_eq!(accept(&snap(1), 10, None).unwrap_err().status, 413);
        assert_eq!(accept(b"{nope", 1 << 20, None).unwrap_err().status, 400);
    }

    #[test]
    fn stored_value_round_trips() {
        let h = StoredHeader {
            received_at_ms: 123,
            version: 9,
        };
        let stored = encode_stored(h, &snap(9));
        let (h2, s) = decode_stored(&stored).unwrap();
        assert_eq!(h2, h);
        assert_eq!(s.version, 9);
        assert_eq!(StoredHeader::decode(&h.encode()), Some(h));
        assert!(decode_stored(b"short").is_none());

        let snap = Snapshot::from_json(&snap(9), 1 << 20).unwrap();
        let binary = encode_stored_binary(h, &snap);
        assert_eq!(decode_stored_binary(&binary, h), Some(snap.clone()));
        // Another version's binary form (a racing push) is not taken for this one.
        let newer = StoredHeader { version: 10, ..h };
        assert_eq!(decode_stored_binary(&binary, newer), None);
        assert_eq!(decode_stored_binary(&binary[..20], h), None);
        assert_eq!(
            decode_stored_binary(&stored, h),
            None,
            "JSON is not the binary form"
        );
    }

    #[test]
    fn a_worker_reads_the_binary_form_of_its_version_and_the_json_otherwise() {
        let h = |version| StoredHeader {
            received_at_ms: 100 + version,
            version,
        };
        let parsed = |v| Snapshot::from_json(&snap(v), 1 << 20).unwrap();
        let json = encode_stored(h(9), &snap(9));
        let binary = encode_stored_binary(h(9), &parsed(9));
        let no_json = || -> Option<Vec<u8>> {
            panic!("the JSON is not read when the binary form is current")
        };
        assert_eq!(
            read_stored(h(9), Some(&binary), no_json),
            Stored::Found(parsed(9), 109, false)
        );
        // A newer push stored its JSON and header, and an older one's binary form is left (a
        // race), or a build without the binary form took the push: the JSON.
        let json10 = encode_stored(h(10), &snap(10));
        assert_eq!(
            read_stored(h(10), Some(&binary), || Some(json10.clone())),
            Stored::Found(parsed(10), 110, true)
        );
        assert_eq!(
            read_stored(h(9), None, || Some(json.clone())),
            Stored::Found(parsed(9), 109, true)
        );
        assert_eq!(read_stored(h(9), None, || None), Stored::Missing);
        assert_eq!(
            read_stored(h(9), Some(&binary[..30]), || Some(
                b"0123456789abcdef{".to_vec()
            )),
            Stored::Unreadable
        );
    }

    fn config() -> IngestConfig {
        IngestConfig {
            token: "secret-token".into(),
            path: "/p".into(),
            max_snapshot_bytes: 100,
            loopback_only: true,
            prefix_path: "/x".into(),
            load_path: "/l".into(),
            load_ttl_ms: 50,
        }
    }

    /// A check's refusal, as (reason, status).
    fn reason(r: Result<(), Refusal>) -> Option<(&'static str, u16)> {
        r.err().map(|(why, e)| (why, e.status))
    }

    /// `check_request` on `cfg` for each case: (endpoint, method, peer is loopback,
    /// authorization, content length) and the refusal expected, as (reason, status).
    fn check_cases(cfg: &IngestConfig, cases: &[Case]) {
        for &(ep, method, loopback, auth, len, want) in cases {
            let got = reason(check_request(cfg, ep, method, || loopback, auth, len));
            assert_eq!(
                got, want,
                "{ep:?} {method} loopback={loopback} {auth:?} {len:?}"
            );
        }
    }

    type Case = (
        Endpoint,
        &'static str,
        bool,
        Option<&'static str>,
        Option<usize>,
        Option<(&'static str, u16)>,
    );

    const AUTH: Option<&str> = Some("Bearer secret-token");

    #[test]
    fn ingest_requests_are_checked_in_order() {
        let (cfg, auth) = (config(), AUTH);
        use Endpoint::Snapshot as S;
        check_cases(
            &cfg,
            &[
                (S, "GET", true, AUTH, None, Some(("method", 405))),
                (S, "POST", false, AUTH, None, Some(("forbidden", 403))),
                (
                    S,
                    "POST",
                    true,
                    Some("Bearer x"),
                    None,
                    Some(("unauthorized", 401)),
                ),
                (S, "POST", true, AUTH, Some(101), Some(("too_large", 413))),
                (S, "POST", true, AUTH, Some(100), None),
                (S, "POST", true, AUTH, None, None),
            ],
        );
        let open = IngestConfig {
            loopback_only: false,
            ..cfg
        };
        let asked = std::cell::Cell::new(false);
        let peer = || {
            asked.set(true);
            false
        };
        assert_eq!(
            reason(check_request(
                &open,
                Endpoint::Snapshot,
                "POST",
                peer,
                auth,
                None
            )),
            None
        );
        assert!(
            !asked.get(),
            "the peer is not looked up unless the config restricts it"
        );
    }

    #[test]
    fn a_path_names_at_most_one_endpoint() {
        let mut cfg = config();
        assert_eq!(Endpoint::of(&cfg, "/p"), Some(Endpoint::Snapshot));
        assert_eq!(Endpoint::of(&cfg, "/x"), Some(Endpoint::Prefix));
        assert_eq!(Endpoint::of(&cfg, "/l"), Some(Endpoint::Load));
        assert_eq!(Endpoint::of(&cfg, "/v1/chat/completions"), None);
        cfg.prefix_path.clear();
        cfg.load_path.clear();
        assert_eq!(
            Endpoint::of(&cfg, ""),
            None,
            "an empty prefix_path or load_path is off"
        );
        assert_eq!(Endpoint::Prefix.stat(), "prefix");
        assert_eq!(Endpoint::Load.stat(), "replica_load");
    }

    #[test]
    fn the_exchanges_between_replicas_take_get_and_post_under_the_same_rules() {
        let (cfg, auth) = (config(), AUTH);
        for p in [Endpoint::Prefix, Endpoint::Load] {
            check_cases(
                &cfg,
                &[
                    (p, "GET", true, AUTH, None, None),
                    (p, "POST", true, AUTH, Some(100), None),
                    (p, "PUT", true, AUTH, None, Some(("method", 405))),
                    (p, "GET", false, AUTH, None, Some(("forbidden", 403))),
                    (p, "GET", true, None, None, Some(("unauthorized", 401))),
                    (p, "POST", true, AUTH, Some(101), Some(("too_large", 413))),
                ],
            );
        }
        // Each endpoint's refusals name what it takes.
        for (ep, what, code) in [
            (Endpoint::Snapshot, "snapshots", "snapshot_too_large"),
            (
                Endpoint::Prefix,
                "prefix records",
                "prefix_records_too_large",
            ),
            (Endpoint::Load, "in-flight counts", "replica_load_too_large"),
        ] {
            let Err((_, e)) = check_request(&cfg, ep, "POST", || false, auth, None) else {
                panic!("{ep:?}: a non-loopback peer is refused");
            };
            assert!(e.message.starts_with(what), "{ep:?}: {}", e.message);
            let Err((_, e)) = check_size(&cfg, ep, 101) else {
                panic!("{ep:?}: 101 bytes is over 100");
            };
            assert_eq!(e.code.as_deref(), Some(code));
            assert!(e.message.starts_with(what), "{ep:?}: {}", e.message);
        }
    }
}
