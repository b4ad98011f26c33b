//! gpuroute-bench: the load generator, workloads and report of gpuroute's benchmark.
//!
//! The benchmark compares router configurations (Envoy round robin, Envoy least_request,
//! the gpuroute filter) on the same simulated fleet with the same traffic. This crate
//! provides the traffic and the verdict:
//! - [`workload`]: timed request lists from public traces ([`trace`]) or synthetic
//!   scenarios, with deterministic prompt text ([`text`]);
//! - [`runner`]: the open-loop sender that streams every request and measures TTFT,
//!   end-to-end latency, tokens and its own send lag ([`results`], [`sse`]);
//! - [`metrics`]: the pods' own counters (prefix-cache hits, adapter loads) scraped around
//!   a run;
//! - [`report`]: the comparison table, the JSON other tools read, and a TTFT CDF chart
//!   ([`svg`]);
//! - [`floor`]: each request's best possible TTFT (idle pod, ideal cache), from fleet-sim's
//!   engine, so targets read against what any router could reach;
//! - [`scenario`]: scenario files pairing a fleet with a workload, and workload SPECs;
//! - [`stub`]: a trivial streaming server with known timings for tests and self-measurement;
//! - [`interleave`]: closed-loop load on several listeners in interleaved slots (`httpload`,
//!   what `make bench-envoy` measures the filter's cost inside Envoy with).
//!
//! Binaries: `loadgen`, `bench-report`, `bench-scenario`, `sse-stub`, `httpload`.

pub mod floor;
pub mod interleave;
pub mod metrics;
pub mod replay;
pub mod report;
pub mod results;
pub mod rng;
pub mod runner;
pub mod scenario;
pub mod sse;
pub mod stub;
pub mod svg;
pub mod text;
pub mod trace;
pub mod workload;
