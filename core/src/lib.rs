//! gpuroute-core: the decision logic of the gpuroute Envoy filter, free of any proxy-wasm
//! dependency so it runs (and is tested) natively, in the wasm filter, in `sidecar-metrics`
//! and in the benchmarks alike.

pub mod snapshot;
