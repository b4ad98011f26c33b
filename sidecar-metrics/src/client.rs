//! The aggregator's one HTTP client, for every request it makes: scrapes, pushes to the ingest
//! listener, and the relays' reads and posts between gateway replicas.
//!
//! It is hyper's pooled client (hyper-util's, what reqwest is built on) without reqwest's layers:
//! reqwest parsed a request's URL as text, turned it into an `http::Uri`, and parsed it again
//! from the response (its redirect layer's, with redirects off), on every request. At 1,000 pods
//! scraped every 100 ms that was about a third of the aggregator's CPU (sidecar-metrics/README.md,
//! "Measured"). HTTP/1.1, keep-alive, no proxy from the environment, no redirects followed.
//! Plain HTTP, and HTTPS for a client made [`HttpClient::with_tls`] ([`crate::tls`]: scrapes of
//! pods that serve their metrics over TLS, and the relays' posts to peers with `prefix.tls`); the
//! pushes to the loopback ingest listeners are plain HTTP (`config.rs` refuses other schemes).
//! Timeouts are the caller's, around the whole exchange (connect, headers and body), so a peer
//! that trickles its body is cut off like one that never answers.

use crate::tls::ClientTls;
use bytes::Bytes;
use http::header::{CONTENT_LENGTH, USER_AGENT};
use http::{HeaderMap, HeaderValue, Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use std::time::Duration;
use thiserror::Error;

/// Every request's `User-Agent`.
const AGENT: HeaderValue = HeaderValue::from_static(concat!(
    "gpuroute-sidecar-metrics/",
    env!("CARGO_PKG_VERSION")
));

/// How an exchange failed before a whole answer was read.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum HttpError {
    /// No connection (refused, unreachable, a name that does not resolve).
    #[error("cannot connect: {0}")]
    Connect(String),
    /// The request could not be made (not a URL) or the exchange broke off.
    #[error("{0}")]
    Failed(String),
    /// The answer's body is larger than the caller takes.
    #[error("body larger than {0} bytes")]
    TooLarge(usize),
    /// No whole answer within the time given ([`HttpClient::send_within`]).
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

/// A whole answer.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A request: its body is empty or one buffer.
pub type Req = Request<Full<Bytes>>;

/// A shared keep-alive client; a clone shares its pool.
#[derive(Clone, Debug)]
pub struct HttpClient {
    inner: Inner,
}

#[derive(Clone, Debug)]
enum Inner {
    Plain(Client<HttpConnector, Full<Bytes>>),
    Tls(Client<HttpsConnector<HttpConnector>, Full<Bytes>>),
}

impl HttpClient {
    /// A plain-HTTP client keeping up to `idle_per_host` idle connections to each host (a pod
    /// scraped every interval needs one) for `idle_timeout`. An `https://` URL fails to connect
    /// ("scheme is not http").
    pub fn new(idle_per_host: usize, idle_timeout: Duration) -> HttpClient {
        HttpClient {
            inner: Inner::Plain(pooled(idle_per_host, idle_timeout).build(connector())),
        }
    }

    /// The same, speaking HTTPS too, with `tls`.
    pub fn with_tls(idle_per_host: usize, idle_timeout: Duration, tls: &ClientTls) -> HttpClient {
        let mut http = connector();
        // Let `https://` through to the TLS layer.
        http.enforce_http(false);
        let builder = HttpsConnectorBuilder::new()
            .with_tls_config((*tls.config).clone())
            .https_or_http();
        let builder = match &tls.server_name {
            Some(name) => {
                builder.with_server_name_resolver(FixedServerNameResolver::new(name.clone()))
            }
            None => builder,
        };
        let https = builder.enable_http1().wrap_connector(http);
        HttpClient {
            inner: Inner::Tls(pooled(idle_per_host, idle_timeout).build(https)),
        }
    }

    /// Sends `req` (with this client's `User-Agent`) and reads the whole answer, its body up to
    /// `max_body` bytes: a larger one is [`HttpError::TooLarge`], whether it declares its length
    /// (refused before reading) or streams.
    pub async fn send(&self, mut req: Req, max_body: usize) -> Result<Answer, HttpError> {
        req.headers_mut().insert(USER_AGENT, AGENT);
        let sent = match &self.inner {
            Inner::Plain(c) => c.request(req),
            Inner::Tls(c) => c.request(req),
        };
        let resp = sent.await.map_err(|e| {
            // A TLS failure after the handshake's last client message (TLS 1.3: a refused
            // client certificate) is still no connection, not a broken answer.
            if e.is_connect() || tls_failure(&e) {
                HttpError::Connect(root_cause(&e))
            } else {
                HttpError::Failed(root_cause(&e))
            }
        })?;
        let declared = resp
            .headers()
            .get(CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
        if declared.is_some_and(|n| n > max_body) {
            return Err(HttpError::TooLarge(max_body));
        }
        let (head, body) = resp.into_parts();
        // A body that arrived in one piece is taken as it is, without a copy.
        let body = Limited::new(body, max_body)
            .collect()
            .await
            .map_err(|e| {
                if e.is::<LengthLimitError>() {
                    HttpError::TooLarge(max_body)
                } else {
                    HttpError::Failed(root_cause(&*e))
                }
            })?
            .to_bytes();
        Ok(Answer {
            status: head.status,
            headers: head.headers,
            body,
        })
    }

    /// [`HttpClient::send`] within `timeout` (connect, headers and body).
    pub async fn send_within(
        &self,
        req: Req,
        max_body: usize,
        timeout: Duration,
    ) -> Result<Answer, HttpError> {
        tokio::time::timeout(timeout, self.send(req, max_body))
            .await
            .map_err(|_| HttpError::Timeout(timeout))?
    }
}

fn connector() -> HttpConnector {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    http
}

fn pooled(idle_per_host: usize, idle_timeout: Duration) -> hyper_util::client::legacy::Builder {
    let mut b = Client::builder(TokioExecutor::new());
    b.pool_max_idle_per_host(idle_per_host)
        .pool_idle_timeout(idle_timeout)
        // What expires idle connections.
        .pool_timer(TokioTimer::new());
    b
}

/// A request of `method` to `url` (text, or a `Uri` parsed once) with `body`;
/// [`HttpError::Failed`] when `url` is not one.
pub fn request<U>(
    method: http::Method,
    url: U,
    headers: &[(&str, &HeaderValue)],
    body: Bytes,
) -> Result<Req, HttpError>
where
    Uri: TryFrom<U>,
    <Uri as TryFrom<U>>::Error: Into<http::Error>,
{
    let mut b = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        b = b.header(*name, *value);
    }
    b.body(Full::new(body))
        .map_err(|e| HttpError::Failed(format!("not a request: {e}")))
}

/// `Authorization: Bearer <token>`, marked sensitive (kept out of debug output).
pub fn bearer(token: &str) -> HeaderValue {
    let mut v = HeaderValue::from_str(&format!("Bearer {token}"))
        .unwrap_or_else(|_| HeaderValue::from_static("Bearer"));
    v.set_sensitive(true);
    v
}

/// The `Authorization` header's name, for [`request`]'s header lists.
pub const AUTH: &str = "authorization";

/// Whether a TLS error is among `e`'s causes.
fn tls_failure(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<rustls::Error>()
            || err
                .downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .is_some_and(|inner| inner.is::<rustls::Error>())
        {
            return true;
        }
        cur = err.source();
    }
    false
}

/// The innermost error message (hyper's own is "client error (Connect)").
fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}
