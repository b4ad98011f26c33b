//! The aggregator's own HTTP surface: `/healthz`, `/readyz`, `/metrics`, `/debug/snapshot`, the
//! peers' `POST /v1/prefix` and `POST /v1/load`, and `/`, a status page that refreshes itself
//! every 2 s and shows, per pool, every pod's health, load, LoRA adapters, ramp-up and last error
//! at a glance.

use crate::aggregator::{PublishRx, Published};
use crate::config::ReadyPolicy;
use crate::metrics;
use crate::push::PushTarget;
use crate::relay::{
    valid_replica, Relay, LOAD_PEER_PATH, MAX_PEER_BODY, MAX_REPLICA_LEN, PEER_PATH,
    REPLICA_HEADER, SIDECAR_HEADER,
};
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use gpuroute_core::exchange::MAX_IMPORT_RECORDS;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What the handlers read.
#[derive(Clone)]
pub struct AppState {
    pub published: PublishRx,
    pub push: Arc<Vec<Arc<PushTarget>>>,
    pub ready_policy: ReadyPolicy,
    /// The prefix-record relay, when it runs: `POST /v1/prefix` takes peers' records.
    pub relay: Option<Arc<Relay>>,
    /// The in-flight count relay, when it runs: `POST /v1/load` takes peers' counts.
    pub load: Option<Arc<Relay>>,
}

impl AppState {
    /// Ready = the configured push targets accepted a snapshot (all of them, or any, per
    /// `push.ready`); with no push target, ready once a snapshot exists.
    pub fn ready(&self) -> bool {
        if self.push.is_empty() {
            return self.published.borrow().is_some();
        }
        match self.ready_policy {
            ReadyPolicy::All => self.push.iter().all(|t| t.accepted_once()),
            ReadyPolicy::Any => self.push.iter().any(|t| t.accepted_once()),
        }
    }

    fn current(&self) -> Option<Arc<Published>> {
        self.published.borrow().clone()
    }
}

/// The router.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/", get(status_page))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_handler))
        .route("/debug/snapshot", get(debug_snapshot))
        .route(PEER_PATH, post(prefix_from_peer))
        .route(LOAD_PEER_PATH, post(load_from_peer))
        .with_state(state)
}

/// The address a request's connection came from (set by [`serve`] on every request).
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub Option<std::net::SocketAddr>);

/// How long a peer has to finish its TLS handshake before its connection is closed.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A connection [`serve`] speaks HTTP over: plain TCP, or TLS over it.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// How long a client may take to send a request's headers, and how long a connection may sit
/// idle between requests: then it is closed (hyper's `header_read_timeout`, which since hyper
/// 1.6 also runs between the requests of a keep-alive connection). Prometheus, the peers and
/// the probes each send their request at once.
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The most connections one listener serves at once; past them a new one is closed at once. A
/// sidecar's clients are a Prometheus or two, the probes and its peers: far fewer.
const MAX_CONNECTIONS: usize = 512;

/// Serves `app` on `listener` until `shutdown`, over TLS when `tls` holds an acceptor
/// (`prefix.listen` with `prefix.tls`: each connection is taken with the acceptor current when
/// it arrives, so renewed files apply to the next connections; a peer whose certificate the
/// authorities did not sign, or that shows none, is refused in the handshake and never reaches
/// `app`). HTTP/1 only. A client that sends its headers too slowly or leaves its connection
/// idle ([`HEADER_TIMEOUT`]), or connections past [`MAX_CONNECTIONS`], are closed: slow or
/// idle connections cannot take the process's file descriptors, which its scrapes need too.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tokio::sync::watch::Receiver<tokio_rustls::TlsAcceptor>>,
    app: Router,
    shutdown: tokio_util::sync::CancellationToken,
    what: &'static str,
) {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto;
    use hyper_util::service::TowerToHyperService;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT);
    let builder = Arc::new(builder.http1_only());
    loop {
        let tcp = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors, say: wait a little rather than spin.
                    tracing::warn!(error = %e, "{what} listener: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            tracing::debug!(
                "{what} listener: {MAX_CONNECTIONS} connections open; closing a new one"
            );
            continue;
        };
        let acceptor = tls.as_ref().map(|t| t.borrow().clone());
        let from = PeerAddr(tcp.peer_addr().ok());
        let app = app.clone().layer(axum::Extension(from));
        let (stop, builder) = (shutdown.clone(), Arc::clone(&builder));
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tcp.set_nodelay(true);
            let io: Box<dyn Io> = match acceptor {
                None => Box::new(tcp),
                Some(acceptor) => {
                    let peer = tcp.peer_addr().ok();
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => Box::new(tls),
                        Ok(Err(e)) => {
                            tracing::debug!(?peer, error = %e, "{what} listener: TLS handshake refused");
                            return;
                        }
                        Err(_) => return,
                    }
                }
            };
            let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
            tokio::select! {
                _ = conn => {}
                _ = stop.cancelled() => {}
            }
        });
    }
}

/// The metrics listener's routes (`metrics_listen`): what Prometheus needs and nothing of the
/// fleet's detail.
pub fn metrics_router(state: AppState) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/metrics", get(metrics_handler))
        .with_state(state)
}

/// The peers' listener (`prefix.listen`): `POST /v1/prefix`, `POST /v1/load` and nothing else.
pub fn peer_router(state: AppState) -> Router {
    Router::new()
        .route(PEER_PATH, post(prefix_from_peer))
        .route(LOAD_PEER_PATH, post(load_from_peer))
        .with_state(state)
}

async fn readyz(State(s): State<AppState>) -> Response {
    if s.ready() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        let why = if s.push.is_empty() {
            "no snapshot assembled yet\n".to_string()
        } else {
            let waiting: Vec<&str> = s
                .push
                .iter()
                .filter(|t| !t.accepted_once())
                .map(|t| t.url.as_str())
                .collect();
            format!("no snapshot accepted yet by: {}\n", waiting.join(", "))
        };
        (StatusCode::SERVICE_UNAVAILABLE, why).into_response()
    }
}

/// How long a peer may take to send a body once its headers are in.
const PEER_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// A peer's body, read only once its headers show the relay's token: an unauthenticated client
/// gets its 401 before any of its body is read (and cannot make this process hold one), a body
/// declared over [`MAX_PEER_BODY`] its 413 before it is sent, and a body not in within
/// [`PEER_BODY_TIMEOUT`] a 408.
async fn peer_body(req: Request, token: &str) -> Result<(HeaderMap, Bytes), Response> {
    let (parts, body) = req.into_parts();
    let auth = parts
        .headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if !gpuroute_core::ingest::authorized(auth, token) {
        return Err((StatusCode::UNAUTHORIZED, "bad or missing bearer token\n").into_response());
    }
    let too_large = || {
        let why = format!("body over {MAX_PEER_BODY} bytes\n");
        (StatusCode::PAYLOAD_TOO_LARGE, why).into_response()
    };
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_PEER_BODY as u64) {
        return Err(too_large());
    }
    match tokio::time::timeout(PEER_BODY_TIMEOUT, axum::body::to_bytes(body, MAX_PEER_BODY)).await {
        Ok(Ok(bytes)) => Ok((parts.headers, bytes)),
        Ok(Err(_)) => Err(too_large()),
        Err(_) => Err((StatusCode::REQUEST_TIMEOUT, "body not sent in time\n").into_response()),
    }
}

/// `answer` with [`SIDECAR_HEADER`] naming this sidecar: a sender that finds its own name
/// there posted to itself, and leaves that peer out. Not told to a client without the token.
fn signed(relay: &Relay, mut answer: Response) -> Response {
    if answer.status() == StatusCode::UNAUTHORIZED {
        return answer;
    }
    if let Ok(v) = header::HeaderValue::from_str(&relay.instance) {
        answer.headers_mut().insert(SIDECAR_HEADER, v);
    }
    answer
}

/// What this sidecar answers a post from itself (its own address among its peers): taken,
/// and nothing done with it. This replica's Envoys have its own counts and records already;
/// handed back to them, they would count its requests twice.
fn own_post(relay: &Relay) -> Response {
    relay.dropped_own();
    StatusCode::NO_CONTENT.into_response()
}

/// A peer's prefix records: checked (token, encoding), then handed to this replica's Envoys
/// (unless they come from this sidecar itself: dropped). 204 when at least one took them, 502
/// when none did.
async fn prefix_from_peer(State(s): State<AppState>, req: Request) -> Response {
    let Some(relay) = s.relay else {
        return (StatusCode::NOT_FOUND, "the prefix relay is off here\n").into_response();
    };
    let answer = prefix_records(&relay, req).await;
    signed(&relay, answer)
}

async fn prefix_records(relay: &Arc<Relay>, req: Request) -> Response {
    let (headers, body) = match peer_body(req, &relay.token).await {
        Ok(read) => read,
        Err(answer) => return answer,
    };
    if relay.is_own(headers.get(SIDECAR_HEADER)) {
        return own_post(relay);
    }
    let n = match gpuroute_core::prefix::decode_records(&body, MAX_IMPORT_RECORDS) {
        Ok(r) => r.len(),
        Err(why) => return (StatusCode::BAD_REQUEST, format!("{why}\n")).into_response(),
    };
    if relay.deliver_local(body, n).await || relay.envoys.is_empty() {
        StatusCode::NO_CONTENT.into_response()
    } else {
        (StatusCode::BAD_GATEWAY, "no Envoy took the records\n").into_response()
    }
}

/// A peer's in-flight counts: checked (token, the `x-gpuroute-replica` header naming where they
/// come from, a body of counts as the filter writes them: a bad one would spoil the bundle it
/// could go in), then handed to this replica's Envoys under that name, unless they are this
/// sidecar's own (its own name in `x-gpuroute-sidecar`, or one of its replica names: dropped).
/// 204 when at least one took them, 502 when none did.
async fn load_from_peer(State(s): State<AppState>, req: Request) -> Response {
    let Some(relay) = s.load else {
        return (
            StatusCode::NOT_FOUND,
            "the in-flight count relay is off here\n",
        )
            .into_response();
    };
    let answer = load_counts(&relay, req).await;
    signed(&relay, answer)
}

async fn load_counts(relay: &Arc<Relay>, req: Request) -> Response {
    let address = req
        .extensions()
        .get::<PeerAddr>()
        .and_then(|p| p.0)
        .map(|a| a.ip());
    let (headers, body) = match peer_body(req, &relay.token).await {
        Ok(read) => read,
        Err(answer) => return answer,
    };
    let replica = headers
        .get(REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|r| valid_replica(r));
    let Some(replica) = replica else {
        let why = format!(
            "{REPLICA_HEADER} must name the replica: 1 to {MAX_REPLICA_LEN} visible ASCII characters, no space\n"
        );
        return (StatusCode::BAD_REQUEST, why).into_response();
    };
    if relay.is_own(headers.get(SIDECAR_HEADER)) || relay.is_own_replica(replica) {
        return own_post(relay);
    }
    if let Err(why) = gpuroute_core::replica_load::ReplicaLoad::decode(&body) {
        return (
            StatusCode::BAD_REQUEST,
            format!("not in-flight counts: {why}\n"),
        )
            .into_response();
    }
    // Who sent it: the sidecar it names (one sidecar may reach this one at two addresses, its
    // IPv4 and IPv6 one), else its address.
    let sender = headers
        .get(SIDECAR_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|s| valid_replica(s))
        .map(str::to_string)
        .or_else(|| address.map(|a| a.to_string()));
    if let Some(sender) = sender {
        relay.note_sender(replica, &sender);
    }
    if relay.deliver_load(body, replica).await || relay.envoys.is_empty() {
        StatusCode::NO_CONTENT.into_response()
    } else {
        (StatusCode::BAD_GATEWAY, "no Envoy took the counts\n").into_response()
    }
}

async fn metrics_handler(State(s): State<AppState>) -> Response {
    let mut body = metrics::render(s.current().as_deref(), &s.push);
    if let Some(r) = &s.relay {
        let st = &r.stats;
        let _ = write!(
            body,
            "# HELP gpuroute_sidecar_prefix_records_total Prefix records relayed between gateway replicas: out = read from this replica's Envoys, in = received from peers.\n\
             # TYPE gpuroute_sidecar_prefix_records_total counter\n\
             gpuroute_sidecar_prefix_records_total{{direction=\"out\"}} {}\n\
             gpuroute_sidecar_prefix_records_total{{direction=\"in\"}} {}\n\
             # HELP gpuroute_sidecar_prefix_relay_failures_total Failed asks and deliveries of the prefix relay, by target.\n\
             # TYPE gpuroute_sidecar_prefix_relay_failures_total counter\n\
             gpuroute_sidecar_prefix_relay_failures_total{{target=\"envoy\"}} {}\n\
             gpuroute_sidecar_prefix_relay_failures_total{{target=\"peer\"}} {}\n\
             # HELP gpuroute_sidecar_prefix_relay_busy_skips_total Batches not sent to a target still busy with the batch before.\n\
             # TYPE gpuroute_sidecar_prefix_relay_busy_skips_total counter\n\
             gpuroute_sidecar_prefix_relay_busy_skips_total {}\n\
             # HELP gpuroute_sidecar_prefix_relay_own_dropped_total Batches of prefix records from this sidecar to itself (its own address among its peers), dropped.\n\
             # TYPE gpuroute_sidecar_prefix_relay_own_dropped_total counter\n\
             gpuroute_sidecar_prefix_relay_own_dropped_total {}\n",
            st.records_out.load(Ordering::Relaxed),
            st.records_in.load(Ordering::Relaxed),
            st.envoy_failures.load(Ordering::Relaxed),
            st.peer_failures.load(Ordering::Relaxed),
            st.busy_skips.load(Ordering::Relaxed),
            st.own_dropped.load(Ordering::Relaxed),
        );
    }
    if let Some(r) = &s.load {
        let st = &r.stats;
        let _ = write!(
            body,
            "# HELP gpuroute_sidecar_replica_load_relayed_total Bodies of in-flight (prefill) counts relayed between gateway replicas: out = read from this replica's Envoys, in = received from peers.\n\
             # TYPE gpuroute_sidecar_replica_load_relayed_total counter\n\
             gpuroute_sidecar_replica_load_relayed_total{{direction=\"out\"}} {}\n\
             gpuroute_sidecar_replica_load_relayed_total{{direction=\"in\"}} {}\n\
             # HELP gpuroute_sidecar_replica_load_failures_total Failed reads and deliveries of the in-flight count relay, by target.\n\
             # TYPE gpuroute_sidecar_replica_load_failures_total counter\n\
             gpuroute_sidecar_replica_load_failures_total{{target=\"envoy\"}} {}\n\
             gpuroute_sidecar_replica_load_failures_total{{target=\"peer\"}} {}\n\
             # HELP gpuroute_sidecar_replica_load_busy_skips_total Bodies of in-flight counts not sent: to a target still busy with the previous one from the same replica, or to an Envoy with 256 replicas' bodies waiting.\n\
             # TYPE gpuroute_sidecar_replica_load_busy_skips_total counter\n\
             gpuroute_sidecar_replica_load_busy_skips_total {}\n\
             # HELP gpuroute_sidecar_replica_load_unchanged_total Bodies of in-flight counts not posted to a target that already has them: unchanged since its last post and the keepalive not due, or empty and already sent.\n\
             # TYPE gpuroute_sidecar_replica_load_unchanged_total counter\n\
             gpuroute_sidecar_replica_load_unchanged_total {}\n\
             # HELP gpuroute_sidecar_replica_load_bundled_total Peers' bodies of in-flight counts posted to an Envoy in one post with other replicas' (they came while a post to it was under way, or once its six posts a load interval were spent).\n\
             # TYPE gpuroute_sidecar_replica_load_bundled_total counter\n\
             gpuroute_sidecar_replica_load_bundled_total {}\n\
             # HELP gpuroute_sidecar_replica_load_name_clashes_total Peers' bodies of in-flight counts under a replica name another sender (another address, or another sidecar) posted under within the last 10 s: the Envoys keep one entry per name, so one of them goes uncounted.\n\
             # TYPE gpuroute_sidecar_replica_load_name_clashes_total counter\n\
             gpuroute_sidecar_replica_load_name_clashes_total {}\n\
             # HELP gpuroute_sidecar_replica_load_own_dropped_total Bodies of in-flight counts from this sidecar to itself (its own address among its peers), dropped: taken, its Envoys would count their own requests twice.\n\
             # TYPE gpuroute_sidecar_replica_load_own_dropped_total counter\n\
             gpuroute_sidecar_replica_load_own_dropped_total {}\n",
            st.records_out.load(Ordering::Relaxed),
            st.records_in.load(Ordering::Relaxed),
            st.envoy_failures.load(Ordering::Relaxed),
            st.peer_failures.load(Ordering::Relaxed),
            st.busy_skips.load(Ordering::Relaxed),
            st.unchanged.load(Ordering::Relaxed),
            st.bundled.load(Ordering::Relaxed),
            st.name_clashes.load(Ordering::Relaxed),
            st.own_dropped.load(Ordering::Relaxed),
        );
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn debug_snapshot(State(s): State<AppState>) -> Response {
    match s.current() {
        Some(p) => ([(header::CONTENT_TYPE, "application/json")], p.json.clone()).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no snapshot yet\n").into_response(),
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "–".to_string(), |v| v.to_string())
}

async fn status_page(State(s): State<AppState>) -> Html<String> {
    Html(render_status(s.current().as_deref(), &s.push, s.ready()))
}

/// The status page's HTML.
pub fn render_status(p: Option<&Published>, push: &[Arc<PushTarget>], ready: bool) -> String {
    let mut h = String::with_capacity(32 * 1024);
    h.push_str(
        "<!doctype html><html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"2\">\
         <title>gpuroute sidecar-metrics</title><style>\
         body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}\
         table{border-collapse:collapse;margin-bottom:1.5em}td,th{padding:3px 9px;border-bottom:1px solid #ddd;text-align:right}\
         th{background:#f3f3f3}td.l,th.l{text-align:left}.ok{color:#137333;font-weight:600}.bad{color:#b3261e;font-weight:600}\
         .bar{display:inline-block;height:9px;background:#4a7fd4;vertical-align:middle}\
         .barbg{display:inline-block;width:60px;height:9px;background:#e6e6e6;margin-right:4px}\
         .err{color:#b3261e;max-width:28em;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}\
         </style></head><body><h1>gpuroute sidecar-metrics</h1>",
    );
    let _ = write!(
        h,
        "<p>Ready: <span class=\"{}\">{}</span>",
        if ready { "ok" } else { "bad" },
        if ready { "yes" } else { "no" }
    );
    let Some(p) = p else {
        h.push_str(" · no round finished yet</p></body></html>");
        return h;
    };
    let snap = &p.snapshot;
    let _ = write!(
        h,
        " · snapshot version {} · {} bytes · round {} took {:.1} ms{} · source {}</p>",
        snap.version,
        p.json.len(),
        p.round.index,
        p.round.duration.as_secs_f64() * 1000.0,
        if p.round.complete {
            ""
        } else {
            " (published at the deadline)"
        },
        esc(&snap.source)
    );
    h.push_str("<h2>Push</h2><table><tr><th class=\"l\">ingest URL</th><th>accepted</th><th>failing for</th><th class=\"l\">last error</th></tr>");
    for t in push {
        let st = t.stats();
        let _ = write!(
            h,
            "<tr><td class=\"l\">{}</td><td>{}</td><td class=\"{}\">{}</td><td class=\"l err\">{}</td></tr>",
            esc(&t.url),
            st.accepted,
            if st.consecutive_failures > 0 { "bad" } else { "ok" },
            if st.consecutive_failures > 0 { format!("{} pushes", st.consecutive_failures) } else { "ok".into() },
            esc(st.last_error.as_deref().unwrap_or(""))
        );
    }
    if push.is_empty() {
        h.push_str("<tr><td class=\"l\" colspan=\"4\">no push URL configured</td></tr>");
    }
    h.push_str("</table>");
    for (pool, statuses) in snap.pools.iter().zip(&p.status) {
        let healthy = pool.pods.iter().filter(|x| x.healthy).count();
        let _ = write!(
            h,
            "<h2>{} <small>{healthy}/{} healthy</small></h2><table><tr><th class=\"l\">pod</th><th class=\"l\">engine</th>\
             <th>health</th><th>waiting</th><th>running</th><th class=\"l\">KV cache</th><th>prefix hit</th>\
             <th class=\"l\">LoRA running / waiting (slots)</th><th>capacity</th><th>ramp</th><th>age ms</th>\
             <th title=\"whole: asked for the whole exposition, not only the metrics read\">scrape ms</th><th class=\"l\">last error</th></tr>",
            esc(&pool.name),
            pool.pods.len()
        );
        for (pod, st) in pool.pods.iter().zip(statuses) {
            let kv = pod.kv_cache_usage.map_or_else(
                || "–".to_string(),
                |k| {
                    format!(
                        "<span class=\"barbg\"><span class=\"bar\" style=\"width:{:.0}px\"></span></span>{:.0}%",
                        (k * 60.0).clamp(0.0, 60.0),
                        k * 100.0
                    )
                },
            );
            let lora = pod.lora.as_ref().map_or_else(
                || "–".to_string(),
                |l| {
                    format!(
                        "{} / {} ({})",
                        esc(&l.running.join(",")),
                        esc(&l.waiting.join(",")),
                        l.max_loras
                    )
                },
            );
            // Scraped whole: `filter_metrics` off, or the pod answered nothing filtered.
            let whole = if st.filtered {
                ""
            } else {
                " <small>whole</small>"
            };
            let age = if pod.last_scrape_ms == 0 {
                "never".to_string()
            } else {
                snap.generated_at_ms
                    .saturating_sub(pod.last_scrape_ms)
                    .to_string()
            };
            let name = st
                .name
                .as_ref()
                .map_or_else(String::new, |n| format!(" <small>{}</small>", esc(n)));
            let _ = write!(
                h,
                "<tr><td class=\"l\"><a href=\"{}\">{}</a>{name}</td><td class=\"l\">{}</td><td class=\"{}\">{}</td>\
                 <td>{}</td><td>{}</td><td class=\"l\">{kv}</td><td>{}</td><td class=\"l\">{lora}</td><td>{:.2}</td>\
                 <td>{:.2}</td><td>{age}</td><td>{:.1}{whole}</td><td class=\"l err\" title=\"{}\">{}</td></tr>",
                esc(&st.metrics_url),
                esc(&pod.address),
                pod.engine.as_str(),
                if pod.healthy { "ok" } else { "bad" },
                if pod.healthy { "healthy" } else { "DOWN" },
                pod.waiting,
                pod.running,
                opt(pod.prefix_cache_hit_rate.map(|r| format!("{:.0}%", r * 100.0))),
                pod.capacity,
                pod.ramp_weight,
                st.last_latency.as_secs_f64() * 1000.0,
                esc(st.last_error.as_deref().unwrap_or("")),
                esc(st.last_error.as_deref().unwrap_or("")),
            );
        }
        h.push_str("</table>");
    }
    h.push_str("</body></html>");
    h
}
