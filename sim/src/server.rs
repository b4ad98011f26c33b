//! The listener of one pod: accepts connections and serves them (HTTP/1.1 and h2c) with the
//! pod's router, and implements the `down` failure mode for real: the listening socket is
//! closed (new connections are refused) and open connections are dropped; leaving `down`
//! binds the same address again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::pod::{Mode, Pod};

/// How long to wait before retrying to re-bind a port after `down` (it may be briefly taken).
const REBIND_RETRY: Duration = Duration::from_millis(50);

/// Serves a pod until `shutdown` turns true. `open` counts open connections (for graceful
/// shutdown).
pub async fn serve_pod(
    pod: Arc<Pod>,
    listener: TcpListener,
    mut shutdown: watch::Receiver<bool>,
    open: Arc<AtomicUsize>,
) {
    let app = crate::http::router(Arc::clone(&pod));
    let mut mode = pod.watch_mode();
    // bumped on every transition to `down`: connections opened before it are dropped
    let (kill_tx, _) = watch::channel(0u64);
    let mut listener = Some(listener);
    loop {
        if *shutdown.borrow() {
            break;
        }
        match &listener {
            Some(l) => {
                tokio::select! {
                    accepted = l.accept() => {
                        let Ok((stream, _)) = accepted else { continue };
                        // SSE chunks are small: send them at once
                        let _ = stream.set_nodelay(true);
                        let svc = TowerToHyperService::new(app.clone());
                        let mut kill = kill_tx.subscribe();
                        let mut stop = shutdown.clone();
                        let open = Arc::clone(&open);
                        open.fetch_add(1, Ordering::SeqCst);
                        tokio::spawn(async move {
                            let builder = auto::Builder::new(TokioExecutor::new());
                            let conn = builder.serve_connection(TokioIo::new(stream), svc);
                            tokio::pin!(conn);
                            tokio::select! {
                                _ = conn.as_mut() => {}
                                _ = kill.changed() => {}
                                _ = stop.changed() => {
                                    conn.as_mut().graceful_shutdown();
                                    let _ = conn.await;
                                }
                            }
                            open.fetch_sub(1, Ordering::SeqCst);
                        });
                    }
                    changed = mode.changed() => {
                        if changed.is_err() { break; }
                        if *mode.borrow_and_update() == Mode::Down {
                            listener = None;
                            kill_tx.send_modify(|g| *g += 1);
                        }
                    }
                    _ = shutdown.changed() => break,
                }
            }
            None => {
                if *mode.borrow_and_update() != Mode::Down {
                    match TcpListener::bind(pod.addr).await {
                        Ok(l) => listener = Some(l),
                        Err(e) => {
                            tracing::warn!(pod = %pod.cfg.name, error = %e, "re-bind failed, retrying");
                            tokio::select! {
                                _ = tokio::time::sleep(REBIND_RETRY) => {}
                                _ = shutdown.changed() => break,
                            }
                        }
                    }
                    continue;
                }
                tokio::select! {
                    changed = mode.changed() => if changed.is_err() { break; },
                    _ = shutdown.changed() => break,
                }
            }
        }
    }
}
