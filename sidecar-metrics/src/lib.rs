//! `sidecar-metrics`: the native aggregator that runs beside each Envoy. It discovers the
//! model-server pods of each pool, scrapes their Prometheus `/metrics` concurrently, normalises
//! them into the shared [`gpuroute_core::snapshot::Snapshot`] and POSTs it to the filter's ingest
//! listener. The binary (`src/main.rs`) is a thin shell over this library, so tests, examples
//! and benchmarks drive the very same code.

pub mod aggregator;
pub mod app;
pub mod client;
pub mod config;
pub mod discovery;
pub mod engine;
pub mod http;
pub mod metrics;
pub mod pod;
pub mod prom;
pub mod push;
pub mod relay;
pub mod scrape;
pub mod tls;
pub mod util;
