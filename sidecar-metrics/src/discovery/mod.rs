//! Discovery: where each pool's pods are. Three sources, one per pool: a static list, a DNS name
//! (a headless Service) re-resolved periodically, or Kubernetes (a label selector or an
//! `InferencePool`), watched.
//!
//! Every source sends the pool's complete current pod list as an [`Update`] whenever it changes;
//! the aggregator reconciles (new pods start unhealthy until scraped, gone pods are dropped).
//! Only the newest list of each pool waits to be taken ([`channel`]): a list is complete, so one
//! not yet taken is worth nothing once a newer one exists, and a burst of changes (10,000 pods
//! turning NotReady at once) must not queue 10,000 lists of 10,000 pods.
//! A source that fails keeps the last list it sent: a DNS or API-server hiccup must not empty a
//! pool that is serving.

pub mod dns;
pub mod kubernetes;

use crate::config::{Config, PodConfig, PoolConfig};
use gpuroute_core::snapshot::Engine;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
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

/// Where discovery hands its lists to the aggregator: per pool, the newest list not yet taken.
/// Memory is bounded by one list per pool however fast lists come.
pub fn channel() -> (UpdateTx, UpdateRx) {
    let shared = Arc::new(Mailbox {
        state: Mutex::new(MailState {
            pending: BTreeMap::new(),
            senders: 1,
            closed: false,
        }),
        notify: Notify::new(),
    });
    (
        UpdateTx {
            shared: shared.clone(),
        },
        UpdateRx { shared },
    )
}

struct Mailbox {
    state: Mutex<MailState>,
    notify: Notify,
}

struct MailState {
    pending: BTreeMap<usize, Vec<Target>>,
    senders: usize,
    /// The receiver is gone.
    closed: bool,
}

impl Mailbox {
    fn lock(&self) -> std::sync::MutexGuard<'_, MailState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sending side of [`channel`]; clone it for each source.
pub struct UpdateTx {
    shared: Arc<Mailbox>,
}

impl UpdateTx {
    /// Hands over a pool's list, replacing one of the same pool not yet taken. `Err` (with the
    /// update) once the receiver is gone.
    pub fn send(&self, u: Update) -> Result<(), Update> {
        {
            let mut st = self.shared.lock();
            if st.closed {
                return Err(u);
            }
            st.pending.insert(u.pool, u.targets);
        }
        self.shared.notify.notify_one();
        Ok(())
    }
}

impl Clone for UpdateTx {
    fn clone(&self) -> UpdateTx {
        self.shared.lock().senders += 1;
        UpdateTx {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for UpdateTx {
    fn drop(&mut self) {
        let last = {
            let mut st = self.shared.lock();
            st.senders -= 1;
            st.senders == 0
        };
        if last {
            self.shared.notify.notify_one();
        }
    }
}

impl std::fmt::Debug for UpdateTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("UpdateTx")
    }
}

/// The receiving side of [`channel`].
pub struct UpdateRx {
    shared: Arc<Mailbox>,
}

impl UpdateRx {
    /// The newest list of a pool that has one waiting (the lowest pool index first); `None`
    /// once every sender is gone and nothing waits. Cancel safe.
    pub async fn recv(&mut self) -> Option<Update> {
        loop {
            {
                let mut st = self.shared.lock();
                if let Some((pool, targets)) = st.pending.pop_first() {
                    return Some(Update { pool, targets });
                }
                if st.senders == 0 {
                    return None;
                }
            }
            // A notification sent since the lock was released is kept as a permit.
            self.shared.notify.notified().await;
        }
    }
}

impl Drop for UpdateRx {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        st.closed = true;
        st.pending.clear();
    }
}

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
        let (tx, mut rx) = channel();
        let handles = spawn_all(&cfg, Deps::default(), tx, CancellationToken::new())
            .await
            .unwrap();
        assert!(handles.is_empty(), "static pools need no task");
        let a = rx.recv().await.unwrap();
        assert_eq!(a.pool, 0);
        let b = rx.recv().await.unwrap();
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
        assert_eq!(
            b.targets[0].metrics_url,
            "http://127.0.0.1:4/prometheus/metrics"
        );
        assert!(rx.recv().await.is_none(), "nothing else is sent");
    }

    fn list(pool: usize, n: usize) -> Update {
        let pc = PoolConfig::named("p");
        Update {
            pool,
            targets: (0..n)
                .map(|i| Target::for_pool(&pc, SocketAddr::from(([127, 0, 0, 1], i as u16 + 1))))
                .collect(),
        }
    }

    /// A burst of lists (before, one queued per change on an unbounded channel: 10,000 pods
    /// changing at once queued 10,000 lists of 10,000 pods) leaves only each pool's newest.
    #[tokio::test]
    async fn only_the_newest_list_of_each_pool_waits() {
        let (tx, mut rx) = channel();
        let tx2 = tx.clone();
        for n in 1..=1000 {
            tx.send(list(1, n)).unwrap();
            tx2.send(list(0, n)).unwrap();
        }
        tx.send(list(1, 7)).unwrap();
        assert_eq!(Arc::strong_count(&rx.shared), 3);
        assert_eq!(rx.shared.lock().pending.len(), 2, "one list per pool waits");
        let a = rx.recv().await.unwrap();
        assert_eq!((a.pool, a.targets.len()), (0, 1000));
        let b = rx.recv().await.unwrap();
        assert_eq!((b.pool, b.targets.len()), (1, 7));
        // Nothing waits: recv waits for the next send, then ends once every sender is gone.
        let waiter = tokio::spawn(async move {
            let next = rx.recv().await.map(|u| u.pool);
            (next, rx.recv().await.is_none())
        });
        tokio::task::yield_now().await;
        tx.send(list(3, 1)).unwrap();
        drop(tx);
        drop(tx2);
        assert_eq!(waiter.await.unwrap(), (Some(3), true));
    }

    #[test]
    fn sending_fails_once_the_receiver_is_gone() {
        let (tx, rx) = channel();
        drop(rx);
        assert!(tx.send(list(0, 1)).is_err());
    }
}
