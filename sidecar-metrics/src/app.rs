//! Wiring: binds the HTTP surface, starts discovery, the scrape loop, one push task per ingest
//! URL and the relays between gateway replicas, and stops them all on a shared cancellation
//! token. The binary, the tests and the load harness all start the aggregator through
//! [`start`].

use crate::aggregator::{Aggregator, PublishRx, RoundReport};
use crate::config::{Config, ConfigError};
use crate::discovery::{self, kubernetes::KubeError, Deps};
use crate::http::{self, AppState};
use crate::push::{self, PushTarget};
use crate::relay::Relay;
use crate::scrape::{Fetch, HttpFetcher};
use crate::util::WallClock;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use thiserror::Error;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// Test and tool hooks; the defaults are the real thing.
#[derive(Default)]
pub struct RunOptions {
    /// Replaces the HTTP fetcher.
    pub fetcher: Option<Arc<dyn Fetch>>,
    /// Replaces the DNS resolver and/or the Kubernetes client.
    pub deps: Deps,
    /// Receives a report after every round.
    pub round_observer: Option<mpsc::UnboundedSender<RoundReport>>,
}

/// Why the aggregator could not start.
#[derive(Debug, Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Kube(#[from] KubeError),
}

/// How often the TLS files (`scrape_tls`, `prefix.tls`) are looked at for a change (a renewed
/// certificate).
const TLS_RELOAD: Duration = Duration::from_secs(10);

/// A started aggregator.
pub struct Running {
    /// The bound address of the HTTP surface (useful with `listen: 127.0.0.1:0`).
    pub local_addr: SocketAddr,
    /// Every published round.
    pub published: PublishRx,
    /// The push targets' state.
    pub push: Arc<Vec<Arc<PushTarget>>>,
    /// The prefix-record relay, when it runs.
    pub relay: Option<Arc<Relay>>,
    /// The in-flight count relay, when it runs.
    pub load_relay: Option<Arc<Relay>>,
    /// The bound address of the peers' listener (`prefix.listen`).
    pub peer_addr: Option<SocketAddr>,
    /// The bound address of the metrics listener (`metrics_listen`).
    pub metrics_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
}

impl Running {
    /// Asks every task to stop.
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Waits until every task has stopped (after [`Running::shutdown`] or the token given to
    /// [`start`] is cancelled), at most `grace`.
    pub async fn wait(mut self, grace: Duration) {
        let all = async { while self.tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, all).await.is_err() {
            tracing::warn!("some tasks did not stop within {grace:?}; exiting anyway");
        }
    }
}

async fn bind(addr: &str) -> Result<tokio::net::TcpListener, StartError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| StartError::Bind {
            addr: addr.to_string(),
            source,
        })
}

/// Validates `cfg` and starts everything. Returns once the HTTP surface is bound.
pub async fn start(
    cfg: Config,
    opts: RunOptions,
    shutdown: CancellationToken,
) -> Result<Running, StartError> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    let listener = bind(&cfg.listen).await?;
    let local_addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: cfg.listen.clone(),
        source,
    })?;

    let fetcher: Arc<dyn Fetch> = match opts.fetcher {
        Some(f) => f,
        None if cfg.scrapes_over_tls() => Arc::new(HttpFetcher::reloading(
            cfg.max_body_bytes,
            cfg.scrape_tls.clone(),
            TLS_RELOAD,
            shutdown.clone(),
        )?),
        None => Arc::new(HttpFetcher::new(cfg.max_body_bytes)),
    };
    let (agg, published) = Aggregator::new(
        cfg.clone(),
        fetcher,
        WallClock::system(),
        opts.round_observer,
    );
    let (up_tx, up_rx) = discovery::channel();
    let mut tasks = JoinSet::new();
    let peer_resolver = opts.deps.resolver.clone();
    for h in discovery::spawn_all(&cfg, opts.deps, up_tx, shutdown.clone()).await? {
        tasks.spawn(async move {
            let _ = h.await;
        });
    }
    tasks.spawn(agg.run(up_rx, shutdown.clone()));

    let push_targets: Arc<Vec<Arc<PushTarget>>> = Arc::new(
        cfg.push
            .urls
            .iter()
            .map(|u| Arc::new(PushTarget::new(u.clone())))
            .collect(),
    );
    if !push_targets.is_empty() {
        let client = push::client();
        let token = cfg.push.token.clone().unwrap_or_default();
        for t in push_targets.iter() {
            tasks.spawn(push::run(
                t.clone(),
                client.clone(),
                token.clone(),
                Duration::from_millis(cfg.push.timeout_ms),
                published.clone(),
                shutdown.clone(),
            ));
        }
    } else {
        tracing::warn!("no push URL configured: snapshots are only served at /debug/snapshot");
    }
    let relay_client = if cfg.prefix.tls_set() {
        crate::tls::watch(cfg.prefix.tls.clone(), TLS_RELOAD, shutdown.clone(), |c| {
            Ok(push::tls_client(&crate::tls::client_tls(c, "prefix.tls")?))
        })?
    } else {
        crate::tls::fixed(push::client())
    };
    let (relay, load_relay) = Relay::pair_from_config(&cfg, relay_client);
    for r in relay.iter().chain(load_relay.iter()) {
        tasks.spawn(r.clone().run(shutdown.clone()));
    }
    // The two relays share the peers found: one task resolves for both.
    if let Some(r) = relay.as_ref().or(load_relay.as_ref()) {
        if cfg.prefix.peers_dns.is_some() {
            let resolver =
                peer_resolver.unwrap_or_else(|| Arc::new(crate::discovery::dns::SystemResolver));
            tasks.spawn(r.clone().find_peers(resolver, shutdown.clone()));
        }
    }

    let state = AppState {
        published: published.clone(),
        push: push_targets.clone(),
        ready_policy: cfg.push.ready,
        relay: relay.clone(),
        load: load_relay.clone(),
    };
    let mut peer_addr = None;
    let relaying = relay.is_some() || load_relay.is_some();
    if let (Some(addr), true) = (&cfg.prefix.listen, relaying) {
        let l = bind(addr).await?;
        peer_addr = l.local_addr().ok();
        let (stop, app) = (shutdown.clone(), http::peer_router(state.clone()));
        if cfg.prefix.tls_set() {
            let acceptor =
                crate::tls::watch(cfg.prefix.tls.clone(), TLS_RELOAD, shutdown.clone(), |c| {
                    crate::tls::server_tls(c, "prefix.tls").map(tokio_rustls::TlsAcceptor::from)
                })?;
            tasks.spawn(http::serve(l, Some(acceptor), app, stop, "peers'"));
        } else {
            tasks.spawn(http::serve(l, None, app, stop, "peers'"));
        }
    }
    let mut metrics_addr = None;
    if let Some(addr) = &cfg.metrics_listen {
        let l = bind(addr).await?;
        metrics_addr = l.local_addr().ok();
        let app = http::metrics_router(state.clone());
        tasks.spawn(http::serve(l, None, app, shutdown.clone(), "metrics"));
    }
    tasks.spawn(http::serve(
        listener,
        None,
        http::router(state),
        shutdown.clone(),
        "the main",
    ));
    tracing::info!(
        listen = %local_addr,
        pools = cfg.pools.len(),
        interval_ms = cfg.interval_ms,
        timeout_ms = cfg.timeout_ms,
        push = ?cfg.push.urls,
        prefix_relay = relay.is_some(),
        load_relay = load_relay.is_some(),
        prefix_peers = ?cfg.prefix.peers,
        prefix_listen = ?peer_addr,
        metrics_listen = ?metrics_addr,
        "sidecar-metrics listening"
    );
    Ok(Running {
        local_addr,
        published,
        push: push_targets,
        relay,
        load_relay,
        peer_addr,
        metrics_addr,
        shutdown,
        tasks,
    })
}
