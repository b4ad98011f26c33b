//! Starting and stopping a whole fleet: binds every pod (and the admin API), starts their
//! schedulers and listeners, and writes the ports file other tools read to find the pods.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::FleetConfig;
use crate::engine::EngineKind;
use crate::error::StartError;
use crate::pod::{Pod, SimClock};

/// A running fleet.
#[derive(Debug)]
pub struct Fleet {
    /// The pods, in configuration order.
    pub pods: Arc<Vec<Arc<Pod>>>,
    /// Where the admin API listens.
    pub admin: SocketAddr,
    shutdown: watch::Sender<bool>,
    open: Arc<AtomicUsize>,
    tasks: Vec<JoinHandle<()>>,
}

/// One pod in the ports file.
#[derive(Debug, Clone, Serialize)]
pub struct PortsEntry {
    /// Pod name.
    pub name: String,
    /// Pool.
    pub pool: String,
    /// Base model.
    pub model: String,
    /// Adapters.
    pub adapters: Vec<String>,
    /// `ip:port`.
    pub address: String,
    /// `http://ip:port/metrics`.
    pub metrics_url: String,
    /// `vllm` or `sglang`.
    pub engine: EngineKind,
    /// GPU profile key.
    pub gpu: String,
}

/// The ports file: every pod's address, plus the admin API's.
#[derive(Debug, Clone, Serialize)]
pub struct PortsFile {
    /// Pods.
    pub pods: Vec<PortsEntry>,
    /// Admin API `ip:port`.
    pub admin: String,
}

impl Fleet {
    /// Binds and starts every pod and the admin API on `admin` (port 0 = any).
    pub async fn start(cfg: FleetConfig, admin: SocketAddr) -> Result<Fleet, StartError> {
        let clock = SimClock::new(cfg.time_scale);
        let (shutdown, shutdown_rx) = watch::channel(false);
        let open = Arc::new(AtomicUsize::new(0));
        let mut pods = Vec::new();
        let mut listeners = Vec::new();
        for pc in cfg.pods {
            let want = SocketAddr::from(([127, 0, 0, 1], pc.port));
            let listener = TcpListener::bind(want)
                .await
                .map_err(|source| StartError::Bind {
                    addr: want.to_string(),
                    source,
                })?;
            let addr = listener.local_addr().map_err(|source| StartError::Bind {
                addr: want.to_string(),
                source,
            })?;
            pods.push(Pod::new(pc, addr, cfg.seed, clock));
            listeners.push(listener);
        }
        let admin_listener = TcpListener::bind(admin)
            .await
            .map_err(|source| StartError::Bind {
                addr: admin.to_string(),
                source,
            })?;
        let admin = admin_listener
            .local_addr()
            .map_err(|source| StartError::Bind {
                addr: admin.to_string(),
                source,
            })?;
        let pods = Arc::new(pods);
        let mut tasks = Vec::new();
        for (pod, listener) in pods.iter().zip(listeners) {
            tasks.push(pod.spawn_scheduler());
            tasks.push(tokio::spawn(crate::server::serve_pod(
                Arc::clone(pod),
                listener,
                shutdown_rx.clone(),
                Arc::clone(&open),
            )));
        }
        let app = crate::admin::router(Arc::clone(&pods));
        let mut admin_stop = shutdown_rx.clone();
        tasks.push(tokio::spawn(async move {
            let stop = async move {
                let _ = admin_stop.wait_for(|s| *s).await;
            };
            if let Err(e) = axum::serve(admin_listener, app)
                .with_graceful_shutdown(stop)
                .await
            {
                tracing::warn!(error = %e, "admin API stopped");
            }
        }));
        Ok(Fleet {
            pods,
            admin,
            shutdown,
            open,
            tasks,
        })
    }

    /// The ports file content.
    pub fn ports(&self) -> PortsFile {
        PortsFile {
            pods: self
                .pods
                .iter()
                .map(|p| PortsEntry {
                    name: p.cfg.name.clone(),
                    pool: p.cfg.pool.clone(),
                    model: p.cfg.model.clone(),
                    adapters: p.cfg.adapters.clone(),
                    address: p.addr.to_string(),
                    metrics_url: format!("http://{}/metrics", p.addr),
                    engine: p.cfg.engine.kind,
                    gpu: p.cfg.gpu_key.clone(),
                })
                .collect(),
            admin: self.admin.to_string(),
        }
    }

    /// Writes the ports file atomically (a temporary file in the same directory, then rename),
    /// so a reader never sees a partial file.
    pub fn write_ports_file(&self, path: &Path) -> Result<(), StartError> {
        let err = |source| StartError::PortsFile {
            path: path.to_path_buf(),
            source,
        };
        let json = serde_json::to_string_pretty(&self.ports())
            .map_err(|e| err(std::io::Error::other(e)))?;
        let mut tmp: PathBuf = path.to_path_buf();
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "ports.json".to_string());
        tmp.set_file_name(format!(".{file_name}.tmp.{}", std::process::id()));
        std::fs::write(&tmp, json + "\n").map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }

    /// Stops accepting connections, lets open requests finish for up to `grace`, then stops.
    pub async fn shutdown(self, grace: Duration) {
        self.shutdown.send_replace(true);
        let deadline = Instant::now() + grace;
        while self.open.load(Ordering::SeqCst) > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for t in self.tasks {
            t.abort();
        }
    }
}
