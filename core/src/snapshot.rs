//! The metrics snapshot: the one wire type between `sidecar-metrics` (producer) and the filter
//! (consumer). Both sides use these structs, so they cannot drift.
//!
//! The aggregator scrapes every pod, normalises each engine's metrics into a [`PodSnapshot`] and
//! POSTs a whole [`Snapshot`] as JSON to the filter's ingest endpoint. The filter validates it
//! ([`Snapshot::from_json`]), keeps it in Envoy shared data, and every worker decodes it once per
//! version (never per request).
//!
//! Compatibility: `schema` is bumped only for changes an older reader would misread. Readers
//! ignore unknown fields, so adding an optional field does not need a new schema number.

use crate::bytes::{self, put_str, ByteReader};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use thiserror::Error;

/// The schema number this build writes and accepts.
pub const SNAPSHOT_SCHEMA: u32 = 1;

/// Upper bound on pods in one snapshot. 10,000 pods of ~300 bytes of JSON each is ~3 MB, inside
/// the default ingest limit; a larger fleet should be split over several gateways anyway.
pub const MAX_PODS: usize = 10_000;

/// Longest accepted pool, adapter or model name (bytes). Kubernetes names stop at 253.
pub const MAX_NAME_LEN: usize = 256;

/// Upper bound for LoRA adapter lists per pod, running or waiting.
pub const MAX_ADAPTERS_PER_POD: usize = 1_024;

/// A whole-fleet view at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Must equal [`SNAPSHOT_SCHEMA`].
    pub schema: u32,
    /// Strictly increasing across pushes, also across aggregator restarts: the aggregator derives
    /// it from its wall clock (`unix_ms * 1000 + sequence`), so a restarted aggregator is not
    /// rejected as going backwards.
    pub version: u64,
    /// Free-form identity of the producer (host name, pod name); shown in debug output.
    #[serde(default)]
    pub source: String,
    /// Producer's wall clock (unix ms) when the snapshot was assembled. Only differences between
    /// this and the pods' `last_scrape_ms` are used, so clock skew between the aggregator and
    /// Envoy does not make pods look stale or fresh.
    pub generated_at_ms: u64,
    /// One entry per pool. Pool names match the filter configuration's pool names.
    pub pools: Vec<PoolSnapshot>,
}

/// The pods of one pool (one model deployment).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolSnapshot {
    pub name: String,
    pub pods: Vec<PodSnapshot>,
}

/// Normalised state of one model-server pod.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PodSnapshot {
    /// `ip:port` the gateway connects to (IPv6 as `[::1]:8000`). It is what the filter writes
    /// into `x-gateway-destination-endpoint`, so it must match the Envoy cluster's member.
    pub address: String,
    #[serde(default)]
    pub engine: Engine,
    /// False once the aggregator gave up on the pod (consecutive scrape failures or old data).
    pub healthy: bool,
    /// Producer's wall clock (unix ms) of the last successful scrape of this pod.
    pub last_scrape_ms: u64,
    /// KV-cache blocks in use, 0..1. `None` when the engine does not export it (TGI).
    #[serde(default)]
    pub kv_cache_usage: Option<f64>,
    /// Requests queued, not yet scheduled.
    #[serde(default)]
    pub waiting: u32,
    /// Requests in the running batch.
    #[serde(default)]
    pub running: u32,
    /// LoRA state, present when the engine reports it (vLLM `lora_requests_info`).
    #[serde(default)]
    pub lora: Option<LoraState>,
    /// Prefix-cache hit rate over the last scrape interval, 0..1 (vLLM: delta hits / delta
    /// queries; SGLang: `cache_hit_rate`).
    #[serde(default)]
    pub prefix_cache_hit_rate: Option<f64>,
    /// Tokens per KV-cache block.
    #[serde(default)]
    pub block_size: Option<u32>,
    /// KV-cache capacity in blocks.
    #[serde(default)]
    pub num_blocks: Option<u64>,
    /// Relative serving speed within the pool (1.0 = reference). From configuration, or estimated
    /// by the aggregator; a pod with capacity 3 is expected to drain a queue three times faster.
    #[serde(default = "one")]
    pub capacity: f64,
    /// Ramp-up weight, 0..1: 1 for a pod in steady service, growing from near 0 for a pod that
    /// just came back, so it is not flooded the instant it reappears.
    #[serde(default = "one")]
    pub ramp_weight: f64,
}

/// LoRA adapters as the engine reports them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LoraState {
    /// Adapter slots on the GPU (vLLM `--max-loras`).
    pub max_loras: u32,
    /// Adapters of requests in the running batch (resident on the GPU).
    #[serde(default)]
    pub running: Vec<String>,
    /// Adapters of waiting requests (to be loaded when a slot frees).
    #[serde(default)]
    pub waiting: Vec<String>,
}

/// Model-server implementation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    Vllm,
    Sglang,
    /// TensorRT-LLM's `trtllm-serve`.
    Trtllm,
    /// Triton Inference Server with the TensorRT-LLM backend.
    Triton,
    Tgi,
    #[default]
    Unknown,
}

impl Engine {
    /// The lowercase name used in JSON and configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::Trtllm => "trtllm",
            Engine::Triton => "triton",
            Engine::Tgi => "tgi",
            Engine::Unknown => "unknown",
        }
    }

    /// Whether a pod of this engine reading 0 requests waiting and 0 running holds none: its
    /// `/metrics` always carry both counts. Triton's running count comes from the TensorRT-LLM
    /// backend's request metrics, which the aggregator reads only when they are exported, and
    /// an unknown engine's counts are whatever it sent.
    pub fn reports_running(self) -> bool {
        matches!(
            self,
            Engine::Vllm | Engine::Sglang | Engine::Trtllm | Engine::Tgi
        )
    }
}

fn one() -> f64 {
    1.0
}

/// Why a snapshot was refused. The message names the offending field.
#[derive(Debug, Error, PartialEq)]
pub enum SnapshotError {
    #[error("snapshot is {size} bytes, above the limit of {limit}")]
    TooLarge { size: usize, limit: usize },
    #[error("snapshot is not valid JSON for schema {SNAPSHOT_SCHEMA}: {0}")]
    Json(String),
    #[error(
        "snapshot schema {found} is not supported (this build reads schema {SNAPSHOT_SCHEMA})"
    )]
    Schema { found: u32 },
    #[error("snapshot version {offered} is not newer than the current version {current}")]
    NotNewer { offered: u64, current: u64 },
    #[error("{field}: {reason}")]
    Field { field: String, reason: String },
}

fn field_err(field: impl Into<String>, reason: impl Into<String>) -> SnapshotError {
    SnapshotError::Field {
        field: field.into(),
        reason: reason.into(),
    }
}

/// The first bytes of a snapshot's binary form.
const BINARY_MAGIC: &[u8; 4] = b"GPS1";

// Which of a pod's optional fields follow, in this order (the binary form's flags byte).
const HEALTHY: u8 = 1;
const HAS_KV: u8 = 1 << 1;
const HAS_HIT_RATE: u8 = 1 << 2;
const HAS_BLOCK_SIZE: u8 = 1 << 3;
const HAS_NUM_BLOCKS: u8 = 1 << 4;
const HAS_LORA: u8 = 1 << 5;

impl Snapshot {
    /// The binary form the filter's workers read a pushed snapshot in (`GPS1`, then the fields
    /// in declaration order, little-endian, strings as a u32 length and their bytes). Decoding
    /// it takes a fraction of the JSON's time (`cargo bench -p gpuroute-core --bench decision
    /// -- snapshot`), and every worker that routes decodes every push. Only this crate writes
    /// it, from a snapshot [`Snapshot::from_json`] accepted.
    pub fn encode_binary(&self) -> Vec<u8> {
        let pods: usize = self.pools.iter().map(|p| p.pods.len()).sum();
        let mut out = Vec::with_capacity(64 + pods * 80);
        out.extend_from_slice(BINARY_MAGIC);
        out.extend_from_slice(&self.schema.to_le_bytes());
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.generated_at_ms.to_le_bytes());
        put_str(&mut out, &self.source);
        out.extend_from_slice(&(self.pools.len() as u32).to_le_bytes());
        for pool in &self.pools {
            put_str(&mut out, &pool.name);
            out.extend_from_slice(&(pool.pods.len() as u32).to_le_bytes());
            for pod in &pool.pods {
                pod.encode_binary(&mut out);
            }
        }
        out
    }

    /// Reads [`Snapshot::encode_binary`]'s form; an error for anything else, truncated or with
    /// bytes left over.
    pub fn decode_binary(b: &[u8]) -> Result<Snapshot, &'static str> {
        let mut r = ByteReader::new(b);
        if r.take(4)? != BINARY_MAGIC {
            return Err("not GPS1");
        }
        let schema = r.u32()?;
        let version = r.u64()?;
        let generated_at_ms = r.u64()?;
        let source = bytes::owned(r.str()?);
        let n = r.u32()? as usize;
        // Counts come from the bytes: no reservation beyond what the bytes left could hold.
        let mut pools = Vec::with_capacity(n.min(r.left()));
        for _ in 0..n {
            let name = bytes::owned(r.str()?);
            let n = r.u32()? as usize;
            let mut pods = Vec::with_capacity(n.min(r.left() / 32));
            for _ in 0..n {
                pods.push(PodSnapshot::decode_binary(&mut r)?);
            }
            pools.push(PoolSnapshot { name, pods });
        }
        if r.left() != 0 {
            return Err("trailing bytes");
        }
        Ok(Snapshot {
            schema,
            version,
            source,
            generated_at_ms,
            pools,
        })
    }
}

impl PodSnapshot {
    fn encode_binary(&self, out: &mut Vec<u8>) {
        put_str(out, &self.address);
        out.push(engine_code(self.engine));
        let flags = [
            (self.healthy, HEALTHY),
            (self.kv_cache_usage.is_some(), HAS_KV),
            (self.prefix_cache_hit_rate.is_some(), HAS_HIT_RATE),
            (self.block_size.is_some(), HAS_BLOCK_SIZE),
            (self.num_blocks.is_some(), HAS_NUM_BLOCKS),
            (self.lora.is_some(), HAS_LORA),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .fold(0u8, |f, (_, bit)| f | bit);
        out.push(flags);
        out.extend_from_slice(&self.last_scrape_ms.to_le_bytes());
        out.extend_from_slice(&self.waiting.to_le_bytes());
        out.extend_from_slice(&self.running.to_le_bytes());
        out.extend_from_slice(&self.capacity.to_bits().to_le_bytes());
        out.extend_from_slice(&self.ramp_weight.to_bits().to_le_bytes());
        if let Some(kv) = self.kv_cache_usage {
            out.extend_from_slice(&kv.to_bits().to_le_bytes());
        }
        if let Some(hit) = self.prefix_cache_hit_rate {
            out.extend_from_slice(&hit.to_bits().to_le_bytes());
        }
        if let Some(bs) = self.block_size {
            out.extend_from_slice(&bs.to_le_bytes());
        }
        if let Some(nb) = self.num_blocks {
            out.extend_from_slice(&nb.to_le_bytes());
        }
        if let Some(lora) = &self.lora {
            out.extend_from_slice(&lora.max_loras.to_le_bytes());
            for list in [&lora.running, &lora.waiting] {
                out.extend_from_slice(&(list.len() as u32).to_le_bytes());
                for name in list {
                    put_str(out, name);
                }
            }
        }
    }

    fn decode_binary(r: &mut ByteReader<'_>) -> Result<PodSnapshot, &'static str> {
        let address = bytes::owned(r.str()?);
        let engine = engine_from_code(r.u8()?)?;
        let flags = r.u8()?;
        let mut pod = PodSnapshot {
            address,
            engine,
            healthy: flags & HEALTHY != 0,
            last_scrape_ms: r.u64()?,
            waiting: r.u32()?,
            running: r.u32()?,
            capacity: r.f64()?,
            ramp_weight: r.f64()?,
            kv_cache_usage: None,
            prefix_cache_hit_rate: None,
            block_size: None,
            num_blocks: None,
            lora: None,
        };
        if flags & HAS_KV != 0 {
            pod.kv_cache_usage = Some(r.f64()?);
        }
        if flags & HAS_HIT_RATE != 0 {
            pod.prefix_cache_hit_rate = Some(r.f64()?);
        }
        if flags & HAS_BLOCK_SIZE != 0 {
            pod.block_size = Some(r.u32()?);
        }
        if flags & HAS_NUM_BLOCKS != 0 {
            pod.num_blocks = Some(r.u64()?);
        }
        if flags & HAS_LORA != 0 {
            let max_loras = r.u32()?;
            let mut lists = [Vec::new(), Vec::new()];
            for list in &mut lists {
                let n = r.u32()? as usize;
                list.reserve(n.min(r.left() / 4));
                for _ in 0..n {
                    list.push(bytes::owned(r.str()?));
                }
            }
            let [running, waiting] = lists;
            pod.lora = Some(LoraState {
                max_loras,
                running,
                waiting,
            });
        }
        Ok(pod)
    }
}

fn engine_code(e: Engine) -> u8 {
    match e {
        Engine::Vllm => 1,
        Engine::Sglang => 2,
        Engine::Trtllm => 3,
        Engine::Triton => 4,
        Engine::Tgi => 5,
        Engine::Unknown => 0,
    }
}

fn engine_from_code(c: u8) -> Result<Engine, &'static str> {
    Ok(match c {
        0 => Engine::Unknown,
        1 => Engine::Vllm,
        2 => Engine::Sglang,
        3 => Engine::Trtllm,
        4 => Engine::Triton,
        5 => Engine::Tgi,
        _ => return Err("unknown engine"),
    })
}

#[cfg(test)]
impl Snapshot {
    /// A snapshot of one pool, version 1, generated at 1,000 ms: the unit tests' fleet.
    pub(crate) fn of_pool(name: &str, pods: Vec<PodSnapshot>) -> Snapshot {
        Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: 1,
            source: String::new(),
            generated_at_ms: 1_000,
            pools: vec![PoolSnapshot {
                name: name.into(),
                pods,
            }],
        }
    }
}

impl Snapshot {
    /// Parses and validates a snapshot received over the wire.
    pub fn from_json(bytes: &[u8], max_bytes: usize) -> Result<Snapshot, SnapshotError> {
        if bytes.len() > max_bytes {
            return Err(SnapshotError::TooLarge {
                size: bytes.len(),
                limit: max_bytes,
            });
        }
        // Read without tracking the path (a 1,000-pod snapshot in about half the time); only a
        // snapshot that fails is read again with it, for the message to name the field at fault
        // ("pools[0].pods[3].waiting: invalid type ...").
        let snap: Snapshot = match serde_json::from_slice(bytes) {
            Ok(snap) => snap,
            Err(plain) => {
                let de = &mut serde_json::Deserializer::from_slice(bytes);
                let e = match serde_path_to_error::deserialize::<_, Snapshot>(de) {
                    Err(e) => e,
                    Ok(_) => return Err(SnapshotError::Json(plain.to_string())),
                };
                let path = e.path().to_string();
                let inner = e.into_inner();
                return Err(SnapshotError::Json(if path == "." {
                    inner.to_string()
                } else {
                    format!("{path}: {inner}")
                }));
            }
        };
        snap.validate()?;
        Ok(snap)
    }

    /// Checks every invariant the filter relies on. A snapshot that passes cannot make the
    /// picker misbehave (no NaN, no empty address, no duplicate pod).
    pub fn validate(&self) -> Result<(), SnapshotError> {
        if self.schema != SNAPSHOT_SCHEMA {
            return Err(SnapshotError::Schema { found: self.schema });
        }
        let mut pool_names = HashSet::new();
        let mut total_pods = 0usize;
        // Field names are written out only for a snapshot that fails: a valid one is checked
        // without an allocation per pod.
        for (pi, pool) in self.pools.iter().enumerate() {
            check_name(|| format!("pools[{pi}].name"), &pool.name)?;
            if !pool_names.insert(pool.name.as_str()) {
                return Err(field_err(
                    format!("pools[{pi}].name"),
                    format!("duplicate pool {:?}", pool.name),
                ));
            }
            total_pods += pool.pods.len();
            if total_pods > MAX_PODS {
                return Err(field_err("pools", format!("more than {MAX_PODS} pods")));
            }
            let mut addrs = HashSet::with_capacity(pool.pods.len());
            for (i, pod) in pool.pods.iter().enumerate() {
                let f = || format!("pools[{pi}].pods[{i}]");
                pod.validate(f)?;
                if !addrs.insert(pod.address.as_str()) {
                    return Err(field_err(
                        format!("{}.address", f()),
                        format!("duplicate pod {}", pod.address),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The pool with this name.
    pub fn pool(&self, name: &str) -> Option<&PoolSnapshot> {
        self.pools.iter().find(|p| p.name == name)
    }
}

impl PodSnapshot {
    /// A healthy, idle pod with no optional data; a convenient base for tests and producers.
    pub fn new(address: impl Into<String>, last_scrape_ms: u64) -> PodSnapshot {
        PodSnapshot {
            address: address.into(),
            engine: Engine::Unknown,
            healthy: true,
            last_scrape_ms,
            kv_cache_usage: None,
            waiting: 0,
            running: 0,
            lora: None,
            prefix_cache_hit_rate: None,
            block_size: None,
            num_blocks: None,
            capacity: 1.0,
            ramp_weight: 1.0,
        }
    }

    /// Checks the pod's fields; `f` names the pod in an error ("pools[0].pods[3]").
    pub fn validate(&self, f: impl Fn() -> String) -> Result<(), SnapshotError> {
        let Ok(addr) = self.address.parse::<SocketAddr>() else {
            return Err(field_err(
                format!("{}.address", f()),
                format!("{:?} is not ip:port", self.address),
            ));
        };
        if let Some(why) = unusable(&addr, &self.address) {
            return Err(field_err(
                format!("{}.address", f()),
                format!("{:?} {why}", self.address),
            ));
        }
        // Engines report KV use as a fraction; allow a rounding hair above 1.
        check_unit(
            || format!("{}.kv_cache_usage", f()),
            self.kv_cache_usage,
            1.01,
        )?;
        check_unit(
            || format!("{}.prefix_cache_hit_rate", f()),
            self.prefix_cache_hit_rate,
            1.0,
        )?;
        if !(self.capacity.is_finite() && self.capacity > 0.0 && self.capacity <= 1_000.0) {
            return Err(field_err(
                format!("{}.capacity", f()),
                format!("{} is not in (0, 1000]", self.capacity),
            ));
        }
        if !(self.ramp_weight.is_finite() && (0.0..=1.0).contains(&self.ramp_weight)) {
            return Err(field_err(
                format!("{}.ramp_weight", f()),
                format!("{} is not in [0, 1]", self.ramp_weight),
            ));
        }
        if self.block_size == Some(0) {
            return Err(field_err(format!("{}.block_size", f()), "must be positive"));
        }
        if let Some(lora) = &self.lora {
            for (kind, list) in [("running", &lora.running), ("waiting", &lora.waiting)] {
                if list.len() > MAX_ADAPTERS_PER_POD {
                    return Err(field_err(
                        format!("{}.lora.{kind}", f()),
                        format!("more than {MAX_ADAPTERS_PER_POD} adapters"),
                    ));
                }
                for (j, name) in list.iter().enumerate() {
                    check_name(|| format!("{}.lora.{kind}[{j}]", f()), name)?;
                }
            }
        }
        Ok(())
    }
}

/// A name is 1 to [`MAX_NAME_LEN`] bytes; `field` names it in the error.
/// Why an address that parsed cannot name a pod, if it cannot. The filter writes it into
/// `x-gateway-destination-endpoint`, and Envoy's `override_host` finds the pod only when it is
/// written as Envoy writes its hosts' addresses: the standard form (RFC 5952 for IPv6, what
/// `SocketAddr` displays). `[0::1]:8000` is a pod Envoy would not find, and a second spelling of
/// a pod would pass the duplicate check.
fn unusable(addr: &SocketAddr, written: &str) -> Option<String> {
    if addr.port() == 0 {
        return Some("has port 0".into());
    }
    match addr {
        // The parser takes an IPv4 address only in its standard form (four decimal octets, no
        // leading zeros): only the port can be written another way ("08000"). The common case,
        // checked without writing the address out.
        SocketAddr::V4(_)
            if written
                .rsplit(':')
                .next()
                .is_some_and(|p| !p.starts_with('0')) =>
        {
            return None;
        }
        SocketAddr::V6(a) if a.scope_id() != 0 || a.flowinfo() != 0 => {
            return Some("has a zone id".into());
        }
        _ => {}
    }
    // Compared as it is written out: no allocation for an address in the standard form.
    struct Rest<'a>(&'a str);
    impl std::fmt::Write for Rest<'_> {
        fn write_str(&mut self, part: &str) -> std::fmt::Result {
            self.0 = self.0.strip_prefix(part).ok_or(std::fmt::Error)?;
            Ok(())
        }
    }
    let mut rest = Rest(written);
    if std::fmt::write(&mut rest, format_args!("{addr}")).is_ok() && rest.0.is_empty() {
        return None;
    }
    Some(format!("is not in the standard form Envoy writes: {addr}"))
}

fn check_name(field: impl FnOnce() -> String, name: &str) -> Result<(), SnapshotError> {
    if name.is_empty() {
        return Err(field_err(field(), "must not be empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(field_err(
            field(),
            format!("longer than {MAX_NAME_LEN} bytes"),
        ));
    }
    Ok(())
}

/// A fraction, when given, is in [0, max]; `field` names it in the error.
fn check_unit(
    field: impl FnOnce() -> String,
    v: Option<f64>,
    max: f64,
) -> Result<(), SnapshotError> {
    match v {
        Some(x) if !(x.is_finite() && (0.0..=max).contains(&x)) => {
            Err(field_err(field(), format!("{x} is not in [0, {max}]")))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::any;

    fn sample() -> Snapshot {
        let mut pod = PodSnapshot::new("10.0.0.1:8000", 1_000);
        pod.engine = Engine::Vllm;
        pod.kv_cache_usage = Some(0.25);
        pod.waiting = 2;
        pod.running = 7;
        pod.lora = Some(LoraState {
            max_loras: 4,
            running: vec!["sql".into()],
            waiting: vec![],
        });
        Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: 7,
            source: "test".into(),
            generated_at_ms: 1_050,
            pools: vec![PoolSnapshot {
                name: "llama".into(),
                pods: vec![pod, PodSnapshot::new("[::1]:8001", 1_000)],
            }],
        }
    }

    #[test]
    fn round_trips_through_json() {
        let s = sample();
        let bytes = serde_json::to_vec(&s).unwrap();
        assert_eq!(Snapshot::from_json(&bytes, 1 << 20).unwrap(), s);
    }

    #[test]
    fn optional_fields_default() {
        let json = br#"{"schema":1,"version":1,"generated_at_ms":5,"pools":[{"name":"p","pods":[
            {"address":"127.0.0.1:1","healthy":true,"last_scrape_ms":5,"future_field":[1,2]}]}]}"#;
        let s = Snapshot::from_json(json, 1 << 20).unwrap();
        let pod = &s.pools[0].pods[0];
        assert_eq!(pod.capacity, 1.0);
        assert_eq!(pod.ramp_weight, 1.0);
        assert_eq!(pod.engine, Engine::Unknown);
        assert_eq!(pod.kv_cache_usage, None);
    }

    #[test]
    fn addresses_in_the_standard_form_are_pods() {
        for a in [
            "10.0.0.1:8000",
            "[::1]:8000",
            "[2001:db8::1]:65535",
            "[fe80::a:0:0:1]:1",
        ] {
            let pod = PodSnapshot::new(a, 1);
            assert!(pod.validate(String::new).is_ok(), "{a}");
        }
    }

    #[test]
    fn rejects_what_the_picker_cannot_use() {
        type Mutation = Box<dyn Fn(&mut Snapshot)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|s| s.schema = 2), "schema 2"),
            (
                Box::new(|s| s.pools[0].pods[0].address = "pod-a".into()),
                "pools[0].pods[0].address",
            ),
            (
                Box::new(|s| s.pools[0].pods[1].address = "10.0.0.1:8000".into()),
                "pools[0].pods[1].address: duplicate pod",
            ),
            // Addresses Envoy would not find among its hosts' (an audit's: the pick went to
            // `[0::1]`, the request to whatever least_request chose).
            (
                Box::new(|s| s.pools[0].pods[0].address = "[0::1]:8000".into()),
                "pools[0].pods[0].address: \"[0::1]:8000\" is not in the standard form Envoy writes: [::1]:8000",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].address = "[0:0:0:0:0:0:0:1]:8000".into()),
                "is not in the standard form Envoy writes: [::1]:8000",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].address = "[2001:DB8::1]:8000".into()),
                "is not in the standard form Envoy writes: [2001:db8::1]:8000",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].address = "10.0.0.1:08000".into()),
                "is not in the standard form Envoy writes: 10.0.0.1:8000",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].address = "010.0.0.1:8000".into()),
                "pools[0].pods[0].address: \"010.0.0.1:8000\" is not",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].address = "10.0.0.3:0".into()),
                "pools[0].pods[0].address: \"10.0.0.3:0\" has port 0",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].address = "[fe80::1%2]:8000".into()),
                "has a zone id",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].kv_cache_usage = Some(f64::NAN)),
                "pools[0].pods[0].kv_cache_usage",
            ),
            (
                Box::new(|s| s.pools[0].pods[1].prefix_cache_hit_rate = Some(1.5)),
                "pools[0].pods[1].prefix_cache_hit_rate",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].capacity = 0.0),
                "pools[0].pods[0].capacity",
            ),
            (
                Box::new(|s| s.pools[0].pods[0].ramp_weight = 1.5),
                "pools[0].pods[0].ramp_weight",
            ),
            (
                Box::new(|s| s.pools[0].pods[1].block_size = Some(0)),
                "pools[0].pods[1].block_size",
            ),
            (
                Box::new(|s| {
                    if let Some(l) = s.pools[0].pods[0].lora.as_mut() {
                        l.waiting = vec!["a".into(), String::new()];
                    }
                }),
                "pools[0].pods[0].lora.waiting[1]: must not be empty",
            ),
            (Box::new(|s| s.pools[0].name.clear()), "pools[0].name"),
            (
                Box::new(|s| {
                    let p = s.pools[0].clone();
                    s.pools.push(p)
                }),
                "duplicate pool",
            ),
        ];
        for (mutate, needle) in cases {
            let mut s = sample();
            mutate(&mut s);
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }

    #[test]
    fn the_binary_form_round_trips_and_refuses_anything_cut_or_foreign() {
        let mut s = sample();
        s.pools.push(PoolSnapshot {
            name: "embed".into(),
            pods: vec![],
        });
        let p = &mut s.pools[0].pods[1];
        p.engine = Engine::Triton;
        p.healthy = false;
        p.prefix_cache_hit_rate = Some(0.5);
        p.block_size = Some(16);
        p.num_blocks = Some(12_345);
        p.capacity = 2.75;
        p.ramp_weight = 0.125;
        p.lora = Some(LoraState {
            max_loras: 2,
            running: vec![],
            waiting: vec!["a".into(), "ünïcode".into()],
        });
        let b = s.encode_binary();
        assert_eq!(Snapshot::decode_binary(&b), Ok(s.clone()));
        for cut in 0..b.len() {
            assert!(Snapshot::decode_binary(&b[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert_eq!(Snapshot::decode_binary(&longer), Err("trailing bytes"));
        let json = serde_json::to_vec(&s).unwrap();
        assert_eq!(Snapshot::decode_binary(&json), Err("not GPS1"));
        let mut engine = b.clone();
        // The first pod's engine byte: magic, schema, version, generated-at, source, pool
        // count, pool name, pod count, address.
        let at = 4 + 4 + 8 + 8 + (4 + s.source.len()) + 4 + (4 + 5) + 4 + (4 + 13);
        assert_eq!(engine[at], 1, "vllm");
        engine[at] = 9;
        assert_eq!(Snapshot::decode_binary(&engine), Err("unknown engine"));
    }

    proptest::proptest! {
        #[test]
        fn any_valid_snapshot_round_trips_in_binary(
            pods in proptest::collection::vec(
                (
                    any::<u16>(),
                    any::<bool>(),
                    any::<u64>(),
                    proptest::option::of(0.0f64..=1.0),
                    (any::<u32>(), any::<u32>()),
                    proptest::option::of(proptest::collection::vec("[a-z]{1,12}", 0..4)),
                    proptest::option::of(1u32..512),
                    0.001f64..1000.0,
                ),
                0..40,
            )
        ) {
            let pods = pods
                .into_iter()
                .enumerate()
                .map(|(i, (port, healthy, ms, kv, (waiting, running), lora, bs, cap))| {
                    let mut p = PodSnapshot::new(format!("10.0.{}.1:{port}", i % 256), ms);
                    p.healthy = healthy;
                    p.kv_cache_usage = kv;
                    p.waiting = waiting;
                    p.running = running;
                    p.block_size = bs;
                    p.capacity = cap;
                    p.lora = lora.map(|running| LoraState {
                        max_loras: 4,
                        running,
                        waiting: vec!["w".into()],
                    });
                    p
                })
                .collect();
            let s = Snapshot::of_pool("p", pods);
            proptest::prop_assert_eq!(Snapshot::decode_binary(&s.encode_binary()), Ok(s));
        }

        #[test]
        fn any_bytes_decode_to_an_error_or_a_snapshot_never_a_panic(
            b in proptest::collection::vec(any::<u8>(), 0..256)
        ) {
            let mut with_magic = BINARY_MAGIC.to_vec();
            with_magic.extend_from_slice(&b);
            let _ = Snapshot::decode_binary(&b);
            let _ = Snapshot::decode_binary(&with_magic);
        }
    }

    #[test]
    fn a_json_error_names_the_field_at_fault() {
        let json = br#"{"schema":1,"version":1,"generated_at_ms":5,"pools":[{"name":"p","pods":[
            {"address":"127.0.0.1:1","healthy":true,"last_scrape_ms":5},
            {"address":"127.0.0.1:2","healthy":true,"last_scrape_ms":5,"waiting":"many"}]}]}"#;
        let err = Snapshot::from_json(json, 1 << 20).unwrap_err().to_string();
        assert!(
            err.contains("pools[0].pods[1].waiting: invalid type"),
            "{err}"
        );
        // Not JSON at all: no path to name.
        let err = Snapshot::from_json(b"{nope", 1 << 20)
            .unwrap_err()
            .to_string();
        assert!(err.contains("key must be a string"), "{err}");
    }

    #[test]
    fn nan_in_json_is_a_parse_error_not_a_panic() {
        let json = br#"{"schema":1,"version":1,"generated_at_ms":5,"pools":[{"name":"p","pods":[
            {"address":"127.0.0.1:1","healthy":true,"last_scrape_ms":5,"kv_cache_usage":NaN}]}]}"#;
        assert!(matches!(
            Snapshot::from_json(json, 1 << 20),
            Err(SnapshotError::Json(_))
        ));
    }

    #[test]
    fn size_limit_is_checked_before_parsing() {
        let bytes = serde_json::to_vec(&sample()).unwrap();
        let err = Snapshot::from_json(&bytes, 10).unwrap_err();
        assert!(matches!(err, SnapshotError::TooLarge { limit: 10, .. }));
    }
}
