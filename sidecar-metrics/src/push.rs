//! Pushing snapshots to the filter's ingest endpoint(s).
//!
//! Contract (the filter implements the other end): `POST {url}` with
//! `Authorization: Bearer <token>` and `Content-Type: application/json`, the body being the
//! snapshot's JSON. `204` = accepted; `400` = the filter refused the snapshot (a bug on our
//! side: logged with its message); `401` = wrong token (logged loudly); `413` = too large;
//! anything else, a timeout or a refused connection = Envoy is down or restarting.
//!
//! One task per URL, each following the aggregator's `watch` channel: a push takes the newest
//! snapshot, and snapshots published while a push is under way are not queued (the next push
//! takes only the newest). So a slow Envoy never builds a backlog, each Envoy is fed
//! independently, and a failed push is retried with the next round's snapshot, one interval
//! later, which is also how pushing resumes as soon as Envoy is back.

use crate::aggregator::PublishRx;
use crate::client::{self, HttpClient, HttpError};
use crate::metrics::Histogram;
use crate::util::LogGate;
use http::{HeaderValue, Method};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

static JSON: HeaderValue = HeaderValue::from_static("application/json");

/// The largest answer read from the ingest listener (its errors are a few hundred bytes).
const MAX_ANSWER: usize = 64 * 1024;

/// Counters of one ingest URL.
#[derive(Debug, Clone, Default)]
pub struct PushStats {
    pub accepted: u64,
    /// Failures by reason (`unreachable`, `timeout`, `rejected_400`, `unauthorized_401`,
    /// `too_large_413`, `status`).
    pub failures: Vec<(&'static str, u64)>,
    pub latency: Histogram,
    /// Version of the last accepted snapshot.
    pub last_accepted_version: Option<u64>,
    /// The last failure, for the status page.
    pub last_error: Option<String>,
    pub consecutive_failures: u64,
}

/// One ingest URL and its state, shared between its push task and the HTTP surface.
#[derive(Debug)]
pub struct PushTarget {
    pub url: String,
    accepted_once: AtomicBool,
    stats: Mutex<PushStats>,
}

impl PushTarget {
    /// A target that has not pushed yet.
    pub fn new(url: String) -> PushTarget {
        PushTarget {
            url,
            accepted_once: AtomicBool::new(false),
            stats: Mutex::new(PushStats::default()),
        }
    }

    /// At least one snapshot was accepted since start.
    pub fn accepted_once(&self) -> bool {
        self.accepted_once.load(Ordering::Relaxed)
    }

    /// A copy of the counters.
    pub fn stats(&self) -> PushStats {
        self.lock().clone()
    }

    fn lock(&self) -> MutexGuard<'_, PushStats> {
        // A poisoned lock only means a panic elsewhere mid-update of plain counters.
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// How one push ended.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Accepted,
    Failed {
        reason: &'static str,
        message: String,
    },
}

/// Pushes every new snapshot from `rx` to `target` until `shutdown`.
pub async fn run(
    target: Arc<PushTarget>,
    client: HttpClient,
    token: String,
    timeout: Duration,
    mut rx: PublishRx,
    shutdown: CancellationToken,
) {
    let mut gate = LogGate::new(Duration::from_secs(10));
    let mut auth_gate = LogGate::new(Duration::from_secs(10));
    let auth = client::bearer(&token);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            changed = rx.changed() => if changed.is_err() { return },
        }
        let Some(published) = rx.borrow_and_update().clone() else {
            continue;
        };
        let begin = Instant::now();
        let headers = [(client::AUTH, &auth), ("content-type", &JSON)];
        let sent = async {
            let url = target.url.as_str();
            let req = client::request(Method::POST, url, &headers, published.json.clone())?;
            client.send_within(req, MAX_ANSWER, timeout).await
        };
        let outcome = match sent.await {
            Ok(resp) => {
                let status = resp.status.as_u16();
                match status {
                    200..=299 => Outcome::Accepted,
                    400 => {
                        let body = String::from_utf8_lossy(&resp.body).into_owned();
                        let message = serde_json::from_str::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                            .unwrap_or(body);
                        Outcome::Failed {
                            reason: "rejected_400",
                            message,
                        }
                    }
                    401 => Outcome::Failed {
                        reason: "unauthorized_401",
                        message: "the ingest endpoint refused the token".into(),
                    },
                    413 => Outcome::Failed {
                        reason: "too_large_413",
                        message: format!(
                            "snapshot of {} bytes is above the ingest limit",
                            published.json.len()
                        ),
                    },
                    s => Outcome::Failed {
                        reason: "status",
                        message: format!("HTTP {s}"),
                    },
                }
            }
            Err(e @ HttpError::Timeout(_)) => Outcome::Failed {
                reason: "timeout",
                message: e.to_string(),
            },
            Err(e) => Outcome::Failed {
                reason: "unreachable",
                message: match e {
                    HttpError::Connect(why) | HttpError::Failed(why) => why,
                    other => other.to_string(),
                },
            },
        };
        let elapsed = begin.elapsed();
        let now = Instant::now();
        let mut s = target.lock();
        match outcome {
            Outcome::Accepted => {
                s.latency.observe(elapsed);
                s.accepted += 1;
                s.last_accepted_version = Some(published.snapshot.version);
                if s.consecutive_failures > 0 {
                    tracing::info!(url = %target.url, after_failures = s.consecutive_failures,
                        "push: ingest endpoint accepts snapshots again");
                }
                s.consecutive_failures = 0;
                s.last_error = None;
                gate.reset();
                auth_gate.reset();
                if !target.accepted_once.swap(true, Ordering::Relaxed) {
                    tracing::info!(url = %target.url, version = published.snapshot.version,
                        "push: first snapshot accepted");
                }
            }
            Outcome::Failed { reason, message } => {
                if reason != "unreachable" && reason != "timeout" {
                    s.latency.observe(elapsed);
                }
                match s.failures.iter_mut().find(|(k, _)| *k == reason) {
                    Some((_, n)) => *n += 1,
                    None => s.failures.push((reason, 1)),
                }
                s.consecutive_failures += 1;
                s.last_error = Some(format!("{reason}: {message}"));
                match reason {
                    "unauthorized_401" => {
                        if let Some(held) = auth_gate.allow(now) {
                            tracing::error!(url = %target.url, suppressed = held,
                                "push: ingest endpoint answered 401: the token does not match the filter's (push.token / GPUROUTE_INGEST_TOKEN)");
                        }
                    }
                    "rejected_400" | "too_large_413" => {
                        if let Some(held) = gate.allow(now) {
                            tracing::error!(url = %target.url, reason, error = %message, suppressed = held,
                                "push: ingest endpoint refused the snapshot");
                        }
                    }
                    _ => {
                        if let Some(held) = gate.allow(now) {
                            tracing::warn!(url = %target.url, reason, error = %message, suppressed = held,
                                "push: ingest endpoint unavailable; scraping goes on and pushing resumes when it is back");
                        }
                    }
                }
            }
        }
    }
}

/// The HTTP client for pushing and relaying: keep-alive to the loopback ingest listeners and the
/// peers (a few connections each: a relay's posts to one target may overlap).
pub fn client() -> HttpClient {
    HttpClient::new(IDLE_PER_TARGET, IDLE_TIMEOUT)
}

/// The same, speaking TLS to the peers too (`prefix.tls`); plain HTTP to the Envoys.
pub fn tls_client(tls: &crate::tls::ClientTls) -> HttpClient {
    HttpClient::with_tls(IDLE_PER_TARGET, IDLE_TIMEOUT, tls)
}

const IDLE_PER_TARGET: usize = 4;
/// Under the 10 s after which a peer's listener closes an idle connection (`http::serve`): a
/// relay with nothing to send idles longer, and a post on a connection the peer is closing at
/// that moment would be lost. Pushes, every interval, never idle that long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(8);
