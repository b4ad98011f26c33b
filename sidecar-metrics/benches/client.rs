//! The aggregator's HTTP client against reqwest, the client it replaced, on the requests the
//! aggregator makes: a scrape (GET of a URL asking for the 34 metric names read, a 2.4 KB answer)
//! and a relay post (1 KB of counts, a 204). Each iteration is one request over a kept-alive
//! loopback connection to the same local server, one after another, so the server's work and the
//! kernel's are the same on both sides and the difference is the clients'.
//!
//! Then the cost of TLS (`tls/`): the same scrape over a kept-alive connection to one pod, plain
//! and over TLS, against the same minimal server (tests/common/tls_pod.rs, rustls on its side
//! too), so the difference is both ends' TLS work on each request and its answer (the handshake
//! comes once per connection).
//!
//! The time reported is the process's CPU time (all threads, user and system), not the wall
//! clock: a request's wall time here is mostly threads handing work to each other, which varies
//! from run to run on a shared machine far more than the work does.

// A benchmark, like a test, may stop loudly on broken setup.
#![allow(clippy::panic)]

use bytes::Bytes;
use criterion::{black_box, criterion_group, criterion_main, Criterion};
use http::{HeaderValue, Method};
use sidecar_metrics::client::{self, HttpClient};
use std::net::SocketAddr;
use std::time::Duration;

#[path = "../tests/common/tls_pod.rs"]
mod tls_pod;

/// The value, or a panic naming the error: a benchmark's setup either works or stops here.
fn ok<T, E: std::fmt::Debug>(r: Result<T, E>) -> T {
    r.unwrap_or_else(|e| panic!("{e:?}"))
}

fn serve(rt: &tokio::runtime::Runtime) -> SocketAddr {
    rt.block_on(async {
        let page = "vllm:num_requests_waiting{model_name=\"m\"} 1\n".repeat(50);
        let router = axum::Router::new()
            .route("/metrics", axum::routing::get(move || async move { page }))
            .route(
                "/v1/load",
                axum::routing::post(|_: Bytes| async { axum::http::StatusCode::NO_CONTENT }),
            );
        let listener = ok(tokio::net::TcpListener::bind("127.0.0.1:0").await);
        let addr = ok(listener.local_addr());
        tokio::spawn(async move { axum::serve(listener, router).await });
        addr
    })
}

/// This process's CPU time so far.
fn cpu() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to write.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// `iters` runs of `one`, timed by the CPU they took.
fn cpu_of(iters: u64, mut one: impl FnMut()) -> Duration {
    let start = cpu();
    for _ in 0..iters {
        one();
    }
    cpu().saturating_sub(start)
}

fn bench(c: &mut Criterion) {
    let rt = ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build());
    let addr = serve(&rt);
    let scrape_url = format!(
        "http://{addr}/metrics?{}",
        sidecar_metrics::engine::filter_query(None)
    );
    let post_url = format!("http://{addr}/v1/load");
    let body = Bytes::from(vec![7u8; 1024]);
    // The aggregator's clients: the scrape's (one idle connection per pod) and the one that
    // pushes and relays.
    let ours = HttpClient::new(1, Duration::from_secs(90));
    let relays = sidecar_metrics::push::client();
    // As the aggregator had it.
    let theirs = ok(reqwest::Client::builder()
        .no_proxy()
        .tcp_nodelay(true)
        .redirect(reqwest::redirect::Policy::none())
        .build());
    let auth = client::bearer("token");
    let octets = HeaderValue::from_static("application/octet-stream");

    let mut g = c.benchmark_group("client");
    g.bench_function("scrape/reqwest", |b| {
        b.iter_custom(|n| {
            cpu_of(n, || {
                rt.block_on(async {
                    let r = ok(theirs.get(&scrape_url).send().await);
                    black_box(ok(r.bytes().await).len())
                });
            })
        })
    });
    // As the aggregator scrapes: the URL parsed once, its clone per request.
    let uri: http::Uri = ok(scrape_url.parse());
    g.bench_function("scrape/ours", |b| {
        b.iter_custom(|n| {
            cpu_of(n, || {
                rt.block_on(async {
                    let req = ok(client::request(Method::GET, uri.clone(), &[], Bytes::new()));
                    black_box(ok(ours.send(req, 1 << 20).await).body.len())
                });
            })
        })
    });
    g.bench_function("post/reqwest", |b| {
        b.iter_custom(|n| {
            cpu_of(n, || {
                rt.block_on(async {
                    let r = ok(theirs
                        .post(&post_url)
                        .bearer_auth("token")
                        .header("content-type", "application/octet-stream")
                        .body(body.clone())
                        .send()
                        .await);
                    black_box(r.status())
                });
            })
        })
    });
    // As the relays post: the URL as text, parsed per request.
    g.bench_function("post/ours", |b| {
        b.iter_custom(|n| {
            cpu_of(n, || {
                rt.block_on(async {
                    let headers = [(client::AUTH, &auth), ("content-type", &octets)];
                    let req = ok(client::request(
                        Method::POST,
                        &post_url,
                        &headers,
                        body.clone(),
                    ));
                    black_box(ok(relays.send(req, 1 << 20).await).status)
                });
            })
        })
    });
    g.finish();

    // TLS against plain: one pod, the scrape's 2.4 KB answer.
    let page = "vllm:num_requests_waiting{model_name=\"m\"} 1\n".repeat(50);
    let (plain, _) = rt.block_on(tls_pod::serve(None, page.clone()));
    let (tls_addr, handshakes) = rt.block_on(tls_pod::serve(
        Some(tls_pod::server_config("pod", false)),
        page,
    ));
    let tls = ok(sidecar_metrics::tls::client_tls(
        &sidecar_metrics::config::TlsConfig {
            ca_file: Some(tls_pod::file("ca.pem")),
            ..Default::default()
        },
        "scrape_tls",
    ));
    let https = HttpClient::with_tls(1, Duration::from_secs(90), &tls);
    let query = sidecar_metrics::engine::filter_query(None);
    let mut g = c.benchmark_group("tls");
    for (name, client, url) in [
        (
            "scrape/plain",
            &ours,
            format!("http://{plain}/metrics?{query}"),
        ),
        (
            "scrape/tls",
            &https,
            format!("https://{tls_addr}/metrics?{query}"),
        ),
    ] {
        let uri: http::Uri = ok(url.parse());
        g.bench_function(name, |b| {
            b.iter_custom(|n| {
                cpu_of(n, || {
                    rt.block_on(async {
                        let req = ok(client::request(Method::GET, uri.clone(), &[], Bytes::new()));
                        black_box(ok(client.send(req, 1 << 20).await).body.len())
                    });
                })
            })
        });
    }
    g.finish();
    // Kept alive: one handshake for every TLS scrape of the run.
    assert_eq!(handshakes.load(std::sync::atomic::Ordering::SeqCst), 1);
}

criterion_group!(benches, bench);
criterion_main!(benches);
