//! The headers the filter (either build) uses to steer Envoy, in one place: a header added here
//! is stripped from client requests by both the proxy-wasm and the dynamic-module shells.

/// Headers the filter sets to steer Envoy. A client must never be able to set them: with an
/// ORIGINAL_DST data plane a forged destination would make the gateway connect anywhere. Every
/// one starts with `x-` (the shells skip other headers on one compare).
pub const INTERNAL: &[&str] = &[
    DESTINATION,
    MODEL,
    BASE_MODEL,
    POOL,
    ADAPTER,
    "x-envoy-original-dst-host",
];
/// `ip:port[,ip:port...]`: the picked pod first, then fallbacks for retries.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
pub const MODEL: &str = "x-gateway-model-name";
pub const BASE_MODEL: &str = "x-gateway-base-model-name";
/// The pool; the shipped Envoy routes match on it.
pub const POOL: &str = "x-gateway-pool";
pub const ADAPTER: &str = "x-gateway-lora-adapter";
/// Response header with the decision's score breakdown (`debug_header`).
pub const DEBUG: &str = "x-gateway-debug";

#[cfg(test)]
mod tests {
    #[test]
    fn every_internal_header_starts_with_x_dash() {
        assert!(super::INTERNAL.iter().all(|h| h.starts_with("x-")));
    }
}
