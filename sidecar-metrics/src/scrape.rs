//! Fetching one pod's `/metrics` over HTTP or HTTPS, and reading it.
//!
//! The HTTP client keeps connections alive (one idle connection per pod is all a 100 ms poll
//! needs) and never uses a proxy from the environment: pods are reached directly. The timeout
//! is applied by the caller around the whole fetch (connect, headers and body), so a pod that
//! trickles its body is cut off like one that never answers.
//!
//! The client is the aggregator's own ([`crate::client`]), and each pod's URL is parsed once
//! ([`ScrapeUrl`]).
//!
//! Fetching sits behind the [`Fetch`] trait so the aggregator loop is tested with scripted pods
//! under tokio's paused clock.

use crate::client::{self, HttpClient, HttpError};
use crate::config::{ConfigError, TlsConfig};
use crate::engine::{self, ReadError, Reading};
use crate::tls::{self, ClientTls};
use bytes::Bytes;
use futures::future::BoxFuture;
use gpuroute_core::snapshot::Engine;
use http::{HeaderValue, Method, Uri};
use std::time::Duration;
use thiserror::Error;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use url::Url;

/// A failed scrape.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ScrapeError {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
    #[error("HTTP status {0}")]
    Status(u16),
    #[error("reading the body failed: {0}")]
    Body(String),
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
    #[error("body is not UTF-8")]
    NotUtf8,
    #[error(transparent)]
    Read(#[from] ReadError),
}

impl ScrapeError {
    /// Short label for metrics (`gpuroute_sidecar_scrape_failures_total{kind=...}`).
    pub fn kind(&self) -> &'static str {
        match self {
            ScrapeError::Connect(_) => "connect",
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::Status(_) => "status",
            ScrapeError::Body(_) | ScrapeError::TooLarge(_) | ScrapeError::NotUtf8 => "body",
            ScrapeError::Read(ReadError::Parse(_)) => "parse",
            ScrapeError::Read(ReadError::NoMetrics { .. }) => "no_metrics",
            ScrapeError::Read(ReadError::NotANumber { .. }) => "not_a_number",
        }
    }
}

impl ScrapeError {
    /// Whether a scrape that asked for only the metrics read (`filter_metrics`) failed in a
    /// way that says the pod does not take that: a 4xx, or an answer with none of them
    /// (prometheus_client leaves out unknown names, so a vLLM pod answers it; a multiprocess
    /// registry, SGLang's and vLLM's with `PROMETHEUS_MULTIPROC_DIR`, answers nothing). Scraped
    /// whole from then on. A timeout, a refused connection or a malformed line is a failed
    /// scrape like any other.
    pub fn drops_filter(&self) -> bool {
        matches!(
            self,
            ScrapeError::Status(400..=499) | ScrapeError::Read(ReadError::NoMetrics { .. })
        )
    }
}

/// Fetches the body of a metrics URL.
pub trait Fetch: Send + Sync + 'static {
    /// GET `url`; the body on a 2xx answer.
    fn fetch(&self, url: &Uri) -> BoxFuture<'static, Result<Bytes, ScrapeError>>;
}

/// Where one pod is scraped, parsed once (a clone is a reference count).
#[derive(Debug, Clone)]
pub struct ScrapeUrl {
    /// The metrics URL as configured or discovered; why not, when it is not a URL.
    whole: Result<Uri, String>,
    /// The same URL asking for only the metrics read (`filter_metrics`), while the pod takes it.
    filtered: Option<Uri>,
}

impl ScrapeUrl {
    /// The URLs of a pod of `engine` (detected: `None`) at `url`; `filter` asks for only the
    /// metrics read.
    pub fn new(url: &str, engine: Option<Engine>, filter: bool) -> ScrapeUrl {
        // Parsed as a URL first (which percent-encodes what needs it), then as the URI that
        // goes on the wire.
        let uri = |u: &Url| {
            u.as_str()
                .parse::<Uri>()
                .map_err(|e| format!("{url:?} is not a URL: {e}"))
        };
        let parsed = Url::parse(url).map_err(|e| format!("{url:?} is not a URL: {e}"));
        let whole = parsed.as_ref().map_err(Clone::clone).and_then(uri);
        let filtered = match &parsed {
            Ok(u) if filter && whole.is_ok() => uri(&engine::filtered_url(u, engine)).ok(),
            _ => None,
        };
        ScrapeUrl { whole, filtered }
    }

    /// The URL to scrape now, and whether it is the filtered one.
    pub fn current(&self) -> Result<(Uri, bool), ScrapeError> {
        match (&self.filtered, &self.whole) {
            (Some(f), _) => Ok((f.clone(), true)),
            (None, Ok(w)) => Ok((w.clone(), false)),
            (None, Err(e)) => Err(ScrapeError::Connect(e.clone())),
        }
    }

    /// Whether the pod is asked for only the metrics read.
    pub fn filtered(&self) -> bool {
        self.filtered.is_some()
    }

    /// Scrape the pod whole from now on.
    pub fn drop_filter(&mut self) {
        self.filtered = None;
    }
}

/// The real fetcher: the aggregator's keep-alive client ([`HttpClient`]). With TLS whose files
/// are watched ([`HttpFetcher::reloading`]), the client is replaced when they change.
#[derive(Clone)]
pub struct HttpFetcher {
    client: watch::Receiver<HttpClient>,
    max_body: usize,
}

static ACCEPT_TEXT: HeaderValue = HeaderValue::from_static("text/plain;version=0.0.4");

/// One idle connection per pod; kept across polls (idle timeout far above the interval),
/// dropped when a pod leaves.
const IDLE_PER_POD: usize = 1;
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);

impl HttpFetcher {
    /// A plain-HTTP fetcher refusing bodies above `max_body` bytes.
    pub fn new(max_body: usize) -> HttpFetcher {
        HttpFetcher::of(HttpClient::new(IDLE_PER_POD, IDLE_TIMEOUT), max_body)
    }

    /// The same, scraping `https://` URLs too, with `tls` (plain HTTP without it).
    pub fn with_tls(max_body: usize, tls: Option<&ClientTls>) -> HttpFetcher {
        match tls {
            Some(tls) => HttpFetcher::of(
                HttpClient::with_tls(IDLE_PER_POD, IDLE_TIMEOUT, tls),
                max_body,
            ),
            None => HttpFetcher::new(max_body),
        }
    }

    fn of(client: HttpClient, max_body: usize) -> HttpFetcher {
        HttpFetcher {
            client: tls::fixed(client),
            max_body,
        }
    }

    /// A fetcher with the TLS `cfg` (`scrape_tls`) describes, its files looked at every
    /// `every` until `shutdown` ([`tls::watch`]): after a change the next scrapes use a new
    /// client, with connections of its own.
    pub fn reloading(
        max_body: usize,
        cfg: TlsConfig,
        every: Duration,
        shutdown: CancellationToken,
    ) -> Result<HttpFetcher, ConfigError> {
        let client = tls::watch(cfg, every, shutdown, |c| {
            let t = tls::client_tls(c, "scrape_tls")?;
            Ok(HttpClient::with_tls(IDLE_PER_POD, IDLE_TIMEOUT, &t))
        })?;
        Ok(HttpFetcher { client, max_body })
    }
}

impl Fetch for HttpFetcher {
    fn fetch(&self, url: &Uri) -> BoxFuture<'static, Result<Bytes, ScrapeError>> {
        let req = client::request(
            Method::GET,
            url.clone(),
            &[("accept", &ACCEPT_TEXT)],
            Bytes::new(),
        );
        let (client, max) = (self.client.borrow().clone(), self.max_body);
        Box::pin(async move {
            let sent = async { client.send(req?, max).await };
            let answer = sent.await.map_err(|e| match e {
                HttpError::Connect(why) => ScrapeError::Connect(why),
                HttpError::Failed(why) => ScrapeError::Body(why),
                HttpError::TooLarge(n) => ScrapeError::TooLarge(n),
                // The caller times the whole scrape (`fetch_within`).
                HttpError::Timeout(t) => ScrapeError::Timeout(t),
            })?;
            if !answer.status.is_success() {
                return Err(ScrapeError::Status(answer.status.as_u16()));
            }
            Ok(answer.body)
        })
    }
}

/// Reads a fetched body as `engine` (or detects it).
pub fn read_body(
    body: &[u8],
    engine: Option<Engine>,
    keep_raw: bool,
) -> Result<Reading, ScrapeError> {
    let text = std::str::from_utf8(body).map_err(|_| ScrapeError::NotUtf8)?;
    Ok(engine::read(text, engine, keep_raw)?)
}

/// Fetches and reads one pod with a timeout: the whole scrape as the aggregator runs it.
pub async fn scrape(
    fetcher: &dyn Fetch,
    url: &Uri,
    engine: Option<Engine>,
    timeout: Duration,
    keep_raw: bool,
) -> Result<Reading, ScrapeError> {
    read_body(
        &fetch_within(fetcher, url, timeout).await?,
        engine,
        keep_raw,
    )
}

/// The body of `url`, fetched within `timeout` (connect, headers and body).
pub async fn fetch_within(
    fetcher: &dyn Fetch,
    url: &Uri,
    timeout: Duration,
) -> Result<Bytes, ScrapeError> {
    tokio::time::timeout(timeout, fetcher.fetch(url))
        .await
        .map_err(|_| ScrapeError::Timeout(timeout))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use std::net::SocketAddr;

    fn u(s: String) -> Uri {
        s.parse().unwrap()
    }

    async fn serve(router: axum::Router) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        addr
    }

    #[tokio::test]
    async fn fetches_reads_and_classifies_failures() {
        let router = axum::Router::new()
            .route(
                "/metrics",
                get(|| async { "vllm:num_requests_waiting 4\n" }),
            )
            .route("/garbage", get(|| async { "{{{ not metrics\n" }))
            .route("/json", get(|| async { "[]" }))
            .route("/big", get(|| async { "x 1\n".repeat(1000) }))
            .route(
                "/slow",
                get(|| async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    "vllm:num_requests_waiting 1\n"
                }),
            );
        let addr = serve(router).await;
        let f = HttpFetcher::new(2048);
        let t = Duration::from_millis(200);
        let ok = scrape(&f, &u(format!("http://{addr}/metrics")), None, t, false)
            .await
            .unwrap();
        assert_eq!((ok.engine, ok.waiting), (Engine::Vllm, Some(4.0)));

        let kind = |r: Result<Reading, ScrapeError>| r.unwrap_err().kind();
        assert_eq!(
            kind(scrape(&f, &u(format!("http://{addr}/garbage")), None, t, false).await),
            "parse"
        );
        assert_eq!(
            kind(scrape(&f, &u(format!("http://{addr}/json")), None, t, false).await),
            "parse"
        );
        assert_eq!(
            kind(scrape(&f, &u(format!("http://{addr}/nope")), None, t, false).await),
            "status"
        );
        assert_eq!(
            kind(scrape(&f, &u(format!("http://{addr}/big")), None, t, false).await),
            "body"
        );
        let started = std::time::Instant::now();
        assert_eq!(
            kind(scrape(&f, &u(format!("http://{addr}/slow")), None, t, false).await),
            "timeout"
        );
        assert!(started.elapsed() < Duration::from_secs(2));

        // A closed port: connection refused.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        assert_eq!(
            kind(scrape(&f, &u(format!("http://{closed}/metrics")), None, t, false).await),
            "connect"
        );
    }

    #[tokio::test]
    async fn keeps_one_connection_per_pod_and_cuts_off_a_chunked_body_past_the_limit() {
        use axum::extract::ConnectInfo;
        use std::sync::{Arc, Mutex};
        let peers = Arc::new(Mutex::new(Vec::new()));
        let seen = peers.clone();
        let router = axum::Router::new()
            .route(
                "/metrics",
                get(move |ConnectInfo(peer): ConnectInfo<SocketAddr>| {
                    seen.lock().unwrap().push(peer);
                    async { "vllm:num_requests_waiting 4\n" }
                }),
            )
            // No Content-Length: chunks, 4,000 bytes in all.
            .route(
                "/chunked",
                get(|| async {
                    let chunks = (0..40).map(|_| Ok::<_, std::io::Error>("x 1\n".repeat(25)));
                    axum::body::Body::from_stream(futures::stream::iter(chunks))
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let app = router.into_make_service_with_connect_info::<SocketAddr>();
            axum::serve(listener, app).await.unwrap()
        });
        let f = HttpFetcher::new(2048);
        let t = Duration::from_millis(500);
        let url = u(format!("http://{addr}/metrics"));
        for _ in 0..5 {
            let r = scrape(&f, &url, Some(Engine::Vllm), t, false)
                .await
                .unwrap();
            assert_eq!(r.waiting, Some(4.0));
        }
        let peers = peers.lock().unwrap().clone();
        assert_eq!(peers.len(), 5);
        assert!(peers.iter().all(|p| *p == peers[0]), "{peers:?}");

        let e = fetch_within(&f, &u(format!("http://{addr}/chunked")), t)
            .await
            .unwrap_err();
        assert_eq!(e, ScrapeError::TooLarge(2048));
        // Within the limit it arrives whole.
        let body = fetch_within(
            &HttpFetcher::new(4000),
            &u(format!("http://{addr}/chunked")),
            t,
        )
        .await
        .unwrap();
        assert_eq!(body.len(), 4000);
    }

    #[test]
    fn a_pod_url_is_parsed_once_with_its_engines_filter() {
        let vllm = ScrapeUrl::new("http://10.0.0.7:8000/metrics", Some(Engine::Vllm), true);
        let (url, filtered) = vllm.current().unwrap();
        assert!(filtered && vllm.filtered());
        assert_eq!(url.path(), "/metrics");
        let asked: Vec<String> = url
            .query()
            .unwrap()
            .split('&')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                assert_eq!(k, "name%5B%5D");
                v.replace("%3A", ":")
            })
            .collect();
        assert!(asked.contains(&"vllm:num_requests_waiting".to_string()));
        assert!(asked.iter().all(|n| n.starts_with("vllm:")), "{asked:?}");
        // Detected engines: every engine's names; a query of its own is kept in front.
        let any = ScrapeUrl::new("http://10.0.0.7:8000/m?x=1", None, true);
        let (url, _) = any.current().unwrap();
        assert!(url.query().unwrap().starts_with("x=1&name%5B%5D="));
        let names = url.query().unwrap().split('&').count();
        assert!(url.query().unwrap().contains("name%5B%5D=sglang%3A"));
        assert!(names > asked.len() + 1);

        let mut fell_back = vllm.clone();
        fell_back.drop_filter();
        let (url, filtered) = fell_back.current().unwrap();
        assert_eq!(
            (url.to_string().as_str(), filtered),
            ("http://10.0.0.7:8000/metrics", false)
        );
        let (url, filtered) = ScrapeUrl::new("http://10.0.0.7:8000/metrics", None, false)
            .current()
            .unwrap();
        assert_eq!((url.query(), filtered), (None, false));

        // Not a URL: every scrape of it fails as a connection that cannot be made, with why.
        let bad = ScrapeUrl::new("http://[::1/metrics", Some(Engine::Vllm), true);
        assert!(!bad.filtered());
        let e = bad.current().unwrap_err();
        assert_eq!(e.kind(), "connect");
        assert!(e.to_string().contains("is not a URL"), "{e}");
    }
}
