//! gpuroute-core: the decision logic of the gpuroute Envoy filter, free of any proxy-wasm
//! dependency so it runs (and is tested) natively, in the wasm filter, in the dynamic module
//! (`dynmod/`), in `sidecar-metrics` and in the benchmarks alike.
//!
//! - [`request`]: OpenAI body parsing (model, stream, prompt text), with a single-pass
//!   scanner for the common chat shape (`scan`);
//! - [`routing`]: model -> pool resolution and the `/v1/models` answer;
//! - [`adapters`]: the balanced partition of LoRA adapters over a pool's pods;
//! - [`snapshot`]: the metrics snapshot schema the aggregator pushes;
//! - [`ingest`]: the rules of the snapshot ingest endpoint;
//! - [`fleet`]: a snapshot decoded for picking;
//! - [`load`]: the in-flight table shared by Envoy workers (no thundering herd);
//! - [`prefix`]: prefix hashing, rendezvous homes and the learned prefix index;
//! - [`exchange`]: prefix records exchanged between gateway replicas;
//! - [`picker`]: candidates, scorers and the pick;
//! - [`engine`]: the per-request pipeline the filter runs;
//! - [`headers`]: the headers the filter sets (and strips from clients);
//! - [`alloc`]: the size-class allocator the filter runs on in the VM;
//! - [`bytes`]: copies and compares that stay in the wasm code (no `memory.copy`, no byte loops).

pub mod adapters;
pub mod alloc;
pub mod bytes;
pub mod config;
pub mod engine;
pub mod error;
pub mod exchange;
pub mod fleet;
pub mod form;
pub mod headers;
pub mod hold;
pub mod idmap;
pub mod ingest;
pub mod load;
pub mod outlier;
pub mod picker;
pub mod prefix;
pub mod replica_load;
pub mod request;
pub mod responses;
pub mod rng;
pub mod routing;
mod scan;
pub mod snapshot;
pub mod workers;
