//! Envoy stats emitted by the filter. They appear in Envoy's `/stats` and `/stats/prometheus`
//! under the names below (Envoy strips the `wasmcustom.` prefix it adds).
//!
//! - `gpuroute.pool.<pool>.requests.<picked|fail_open|shed|error>` (counters)
//! - `gpuroute.pool.<pool>.pod.<ip_port>.picks` (counters, created on first pick)
//! - `gpuroute.fail_open.<no_snapshot|unknown_pool|no_fresh_pod>` (counters)
//! - `gpuroute.rejected.<code>` (counters: invalid_json, invalid_type, model_not_found,
//!   missing_required_parameter, request_too_large)
//! - `gpuroute.snapshot.accepted`, `gpuroute.snapshot.rejected.<reason>` (counters)
//! - `gpuroute.snapshot.age_ms`, `gpuroute.snapshot.pods` (gauges)
//! - `gpuroute.decision_us` (histogram: body parse to headers set, microseconds)
//! - `gpuroute.models_list` (counter: `/v1/models` answered)

use crate::host;
use gpuroute_core::fleet::stat_segment as sanitize;
use proxy_wasm::types::MetricType;
use std::collections::HashMap;

/// Metric ids, defined lazily and cached per worker.
#[derive(Default)]
pub struct Stats {
    ids: HashMap<String, Option<u32>>,
}

impl Stats {
    fn id(&mut self, kind: MetricType, name: &str) -> Option<u32> {
        if let Some(id) = self.ids.get(name) {
            return *id;
        }
        let id = host::define_metric(kind, name);
        self.ids.insert(name.to_string(), id);
        id
    }

    pub fn inc(&mut self, name: &str) {
        if let Some(id) = self.id(MetricType::Counter, name) {
            host::increment_metric(id, 1);
        }
    }

    pub fn gauge(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Gauge, name) {
            host::record_metric(id, value);
        }
    }

    pub fn histogram(&mut self, name: &str, value: u64) {
        if let Some(id) = self.id(MetricType::Histogram, name) {
            host::record_metric(id, value);
        }
    }

    pub fn pool_outcome(&mut self, pool: &str, outcome: &str) {
        self.inc(&format!(
            "gpuroute.pool.{}.requests.{outcome}",
            sanitize(pool)
        ));
    }

    pub fn pod_pick(&mut self, pool: &str, address: &str) {
        self.inc(&format!(
            "gpuroute.pool.{}.pod.{}.picks",
            sanitize(pool),
            sanitize(address)
        ));
    }
}
