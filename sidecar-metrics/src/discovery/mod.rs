//! Discovery: where each pool's pods are. Three sources, one per pool: a static list, a DNS name
//! (a headless Service) re-resolved periodically, or Kubernetes (a label selector or an
//! `InferencePool`), watched.
//!
//! Every source sends the pool's complete current pod list as an [`Update`] whenever it changes;
//! the aggregator reconciles (new pods start unhealthy until scraped, gone pods are dropped).
//! A source that fails keeps the last list it sent: a DNS or API-server hiccup must not empty a
//! pool that is serving.

pub mod dns;
pub mod kubernetes;

use crate::config::{Config, PodConfig, PoolConfig};
use gpuroute_core::snapshot::Engine;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// One endpoint of a pool: where the gateway sends requests and where its metrics are.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// `ip:port` the gateway connects to (what goes into the snapshot).
    pub address: SocketAddr,
    /// Full URL of the Prometheus endpoint.
    pub metrics_url: String,
    /// Engine, when configured (otherwise detected from the metric names).
    pub engine: Option<Engine>,
    /// Configured relative speed; overrides the estimate.
    pub capacity: Option<f64>,
    /// False when the platform reports the pod not ready (Kubernetes readiness); such a pod is
    /// listed but never healthy.
    pub ready: bool,
    /// Human name (the Kubernetes pod name), for the status page and logs.
    pub name: Option<String>,
}

impl Target {
    /// A target with the pool's defaults for the metrics URL and engine.
    pub fn for_pool(pool: &PoolConfig, address: SocketAddr) -> Target {
        Target {
            address,
            metrics_url: pool.metrics_url_for(address, None),
            engine: pool.engine,
            capacity: None,
            ready: true,
            name: None,
        }
    }

    fn from_pod(pool: &PoolConfig, pod: &PodConfig, address: SocketAddr) -> Target {
        let engine = pod.engine.or(pool.engine);
        Target {
            address,
            metrics_url: pod
                .metrics_url
                .clone()
                .unwrap_or_else(|| pool.metrics_url_for(address, engine)),
            engine,
            capacity: pod.capacity,
            ready: true,
            name: None,
        }
    }
}

/// The complete current pod list of pool number `pool` (index into `Config::pools`).
#[derive(Debug, Clone, PartialEq)]
pub struct Update {
    pub pool: usize,
    pub targets: Vec<Target>,
}

/// Sink for discovery updates.
pub type UpdateTx = mpsc::UnboundedSender<Update>;

/// Injectable dependencies of the dynamic sources (tests use fakes; `None` means the real one).
#[derive(Clone, Default)]
pub struct Deps {
    pub resolver: Option<Arc<dyn dns::Resolver>>,
    pub kube_client: Option<kubernetes::ApiClient>,
}

/// Starts one discovery task per dynamic pool and sends the static pools' lists at once.
pub async fn spawn_all(
    cfg: &Config,
    deps: Deps,
    tx: UpdateTx,
    shutdown: CancellationToken,
) -> Result<Vec<JoinHandle<()>>, kubernetes::KubeError> {
    let mut handles = Vec::new();
    let mut kube_client = deps.kube_client.clone();
    for (i, pool) in cfg.pools.iter().enumerate() {
        if let Some(pods) = &pool.pods {
            let targets = pods
                .iter()
                .filter_map(|p| {
                    // Validated at start; a bad address cannot reach here.
                    p.address.parse().ok().map(|a| Target::from_pod(pool, p, a))
                })
                .collect();
            let _ = tx.send(Update { pool: i, targets });
        } else if let Some(d) = &pool.dns {
            let resolver = deps
                .resolver
                .clone()
                .unwrap_or_else(|| Arc::new(dns::SystemResolver));
            handles.push(tokio::spawn(dns::run(
                i,
                pool.clone(),
                d.clone(),
                resolver,
                tx.clone(),
                shutdown.clone(),
            )));
        } else if let Some(k) = &pool.kubernetes {
            let client = match &kube_client {
                Some(c) => c.clone(),
                None => {
                    let c = kubernetes::ApiClient::infer().await?;
                    kube_client = Some(c.clone());
                    c
                }
            };
            handles.push(tokio::spawn(kubernetes::run(
                i,
                pool.clone(),
                k.clone(),
                client,
                tx.clone(),
                shutdown.clone(),
            )));
        }
    }
    Ok(handles)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[tokio::test]
    async fn static_pools_are_sent_once_with_their_defaults() {
        let cfg = Config::from_str_named(
            r#"
push: {token: t}
pools:
  - name: a
    engine: vllm
    pods:
      - { address: "127.0.0.1:1" }
      - { address: "[::1]:2", engine: sglang, capacity: 2.5 }
      - { address: "127.0.0.1:3", metrics_url: "http://127.0.0.1:9/m" }
  - name: b
    pods: [{ address: "127.0.0.1:4", engine: trtllm }]
"#,
            Path::new("t"),
        )
        .unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let handles = spawn_all(&cfg, Deps::default(), tx, CancellationToken::new())
            .await
            .unwrap();
        assert!(handles.is_empty(), "static pools need no task");
        let a = rx.recv().await.unwrap();
        assert_eq!(a.pool, 0);
        let urls: Vec<_> = a.targets.iter().map(|t| t.metrics_url.as_str()).collect();
        assert_eq!(
            urls,
            [
                "http://127.0.0.1:1/metrics",
                "http://[::1]:2/metrics",
                "http://127.0.0.1:9/m"
            ]
        );
        assert_eq!(a.targets[0].engine, Some(Engine::Vllm));
        assert_eq!(a.targets[1].engine, Some(Engine::Sglang));
        assert_eq!(a.targets[1].capacity, Some(2.5));
        let b = rx.recv().await.unwrap();
        assert_eq!(
            b.targets[0].metrics_url,
            "http://127.0.0.1:4/prometheus/metrics"
        );
        assert!(rx.recv().await.is_none(), "nothing else is sent");
    }
}
