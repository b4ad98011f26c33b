//! Fetching one pod's `/metrics` over HTTP, and reading it.
//!
//! The HTTP client keeps connections alive (one idle connection per pod is all a 100 ms poll
//! needs) and never uses a proxy from the environment: pods are reached directly. The timeout
//! is applied by the caller around the whole fetch (connect, headers and body), so a pod that
//! trickles its body is cut off like one that never answers.
//!
//! Fetching sits behind the [`Fetch`] trait so the aggregator loop is tested with scripted pods
//! under tokio's paused clock.

use crate::engine::{self, ReadError, Reading};
use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use gpuroute_core::snapshot::Engine;
use std::time::Duration;
use thiserror::Error;

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
    /// Short label for metrics (`sidecar_scrape_failures_total{kind=...}`).
    pub fn kind(&self) -> &'static str {
        match self {
            ScrapeError::Connect(_) => "connect",
            ScrapeError::Timeout(_) => "timeout",
            ScrapeError::Status(_) => "status",
            ScrapeError::Body(_) | ScrapeError::TooLarge(_) | ScrapeError::NotUtf8 => "body",
            ScrapeError::Read(ReadError::Parse(_)) => "parse",
            ScrapeError::Read(ReadError::NoMetrics { .. }) => "no_metrics",
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
    fn fetch(&self, url: &str) -> BoxFuture<'static, Result<Bytes, ScrapeError>>;
}

/// The real fetcher: a shared keep-alive `reqwest` client.
#[derive(Clone)]
pub struct HttpFetcher {
    client: reqwest::Client,
    max_body: usize,
}

impl HttpFetcher {
    /// A fetcher refusing bodies above `max_body` bytes.
    pub fn new(max_body: usize) -> Result<HttpFetcher, reqwest::Error> {
        let client = reqwest::Client::builder()
            .no_proxy()
            // One idle connection per pod; kept across polls (idle timeout far above the
            // interval), dropped when a pod leaves.
            .pool_max_idle_per_host(1)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!(
                "gpuroute-sidecar-metrics/",
                env!("CARGO_PKG_VERSION")
            ))
            .build()?;
        Ok(HttpFetcher { client, max_body })
    }
}

impl Fetch for HttpFetcher {
    fn fetch(&self, url: &str) -> BoxFuture<'static, Result<Bytes, ScrapeError>> {
        let req = self
            .client
            .get(url)
            .header(reqwest::header::ACCEPT, "text/plain;version=0.0.4");
        let max = self.max_body;
        Box::pin(async move {
            let mut resp = req.send().await.map_err(|e| {
                if e.is_connect() {
                    ScrapeError::Connect(root_cause(&e))
                } else {
                    ScrapeError::Body(root_cause(&e))
                }
            })?;
            if !resp.status().is_success() {
                return Err(ScrapeError::Status(resp.status().as_u16()));
            }
            match resp.content_length() {
                Some(n) if n as usize > max => return Err(ScrapeError::TooLarge(max)),
                // Known length (prometheus_client and most exporters send it): take hyper's
                // buffer as is, without copying it into ours.
                Some(_) => {
                    return resp
                        .bytes()
                        .await
                        .map_err(|e| ScrapeError::Body(root_cause(&e)));
                }
                None => {}
            }
            let mut body =
                BytesMut::with_capacity(resp.content_length().map_or(16 * 1024, |n| n as usize));
            while let Some(chunk) = resp
                .chunk()
                .await
                .map_err(|e| ScrapeError::Body(root_cause(&e)))?
            {
                if body.len() + chunk.len() > max {
                    return Err(ScrapeError::TooLarge(max));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(body.freeze())
        })
    }
}

/// The innermost error message (reqwest's own is "error sending request for url (...)").
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
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
    url: &str,
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
    url: &str,
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
        let f = HttpFetcher::new(2048).unwrap();
        let t = Duration::from_millis(200);
        let ok = scrape(&f, &format!("http://{addr}/metrics"), None, t, false)
            .await
            .unwrap();
        assert_eq!((ok.engine, ok.waiting), (Engine::Vllm, Some(4.0)));

        let kind = |r: Result<Reading, ScrapeError>| r.unwrap_err().kind();
        assert_eq!(
            kind(scrape(&f, &format!("http://{addr}/garbage"), None, t, false).await),
            "parse"
        );
        assert_eq!(
            kind(scrape(&f, &format!("http://{addr}/json"), None, t, false).await),
            "parse"
        );
        assert_eq!(
            kind(scrape(&f, &format!("http://{addr}/nope"), None, t, false).await),
            "status"
        );
        assert_eq!(
            kind(scrape(&f, &format!("http://{addr}/big"), None, t, false).await),
            "body"
        );
        let started = std::time::Instant::now();
        assert_eq!(
            kind(scrape(&f, &format!("http://{addr}/slow"), None, t, false).await),
            "timeout"
        );
        assert!(started.elapsed() < Duration::from_secs(2));

        // A closed port: connection refused.
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        assert_eq!(
            kind(scrape(&f, &format!("http://{closed}/metrics"), None, t, false).await),
            "connect"
        );
    }
}
