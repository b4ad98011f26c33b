//! `fleet-sim`: a simulated fleet of GPU model servers for testing and benchmarking gpuroute
//! without GPUs. One process runs N pods, each on its own 127.0.0.1 port with vLLM's
//! OpenAI-compatible HTTP surface and vLLM v1 (or SGLang) `/metrics`. Behind each pod is an
//! engine model, not a fixed sleep: continuous batching with chunked prefill, a paged KV cache
//! with prefix caching and LRU eviction, LoRA slots with load delays, queueing and preemption,
//! timed from public GPU figures. See `sim/README.md`.

pub mod admin;
pub mod config;
pub mod cost;
pub mod engine;
pub mod error;
pub mod fleet;
pub mod http;
pub mod kv;
pub mod lora;
pub mod metrics;
pub mod pod;
pub mod profiles;
pub mod render;
pub mod server;
pub mod text;

pub use config::{FleetConfig, FleetFile, Overrides};
pub use engine::EngineKind;
pub use fleet::Fleet;
