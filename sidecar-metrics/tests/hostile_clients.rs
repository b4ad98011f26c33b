//! The sidecar's own listeners against clients that try to hold its memory or its file
//! descriptors (found by an audit on 2026-12-07): a body is read only after its token, a body
//! declared too large is refused before it is sent, slow or idle connections are closed, and a
//! listener serves a bounded number of connections at once. Real sockets on 127.0.0.1.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use sidecar_metrics::app::{self, RunOptions, Running};
use sidecar_metrics::config::{Config, Overrides};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

async fn start() -> Running {
    let mut c = Config::default();
    c.apply(Overrides {
        listen: Some("127.0.0.1:0".into()),
        token: Some("tok".into()),
        // A pod nobody serves: scraping fails, which these listeners do not care about.
        pools: vec!["llama=127.0.0.1:1".into()],
        prefix_peers: vec!["http://127.0.0.1:1".into()],
        ..Overrides::default()
    })
    .unwrap();
    c.prefix.listen = Some("127.0.0.1:0".into());
    app::start(c, RunOptions::default(), CancellationToken::new())
        .await
        .unwrap()
}

/// Sends `head` (and no more) on a new connection; what the server answers within `wait`
/// (empty when it closed the connection without an answer, `None` when it kept it open
/// without answering).
async fn send_head(addr: SocketAddr, head: &str, wait: Duration) -> Option<String> {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    match tokio::time::timeout(wait, s.read_to_end(&mut got)).await {
        Ok(_) => Some(String::from_utf8_lossy(&got).into_owned()),
        Err(_) if got.is_empty() => None,
        Err(_) => Some(String::from_utf8_lossy(&got).into_owned()),
    }
}

#[tokio::test]
async fn a_body_is_read_only_after_its_token_and_within_its_size() {
    let run = start().await;
    for addr in [run.peer_addr.unwrap(), run.local_addr] {
        for path in ["/v1/load", "/v1/prefix"] {
            // 8 MiB declared, none of it sent: the 401 comes at once, from the headers.
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\nx-gpuroute-replica: gw-2\r\ncontent-length: 8388608\r\nconnection: close\r\n\r\n"
            );
            let answer = send_head(addr, &head, Duration::from_secs(3)).await;
            let answer = answer.unwrap_or_else(|| panic!("{path}: no answer without the body"));
            assert!(answer.starts_with("HTTP/1.1 401"), "{path}: {answer}");
            // With the token, a body declared over the limit: 413 before it is sent.
            let head = format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer tok\r\nx-gpuroute-replica: gw-2\r\ncontent-length: 104857600\r\nconnection: close\r\n\r\n"
            );
            let answer = send_head(addr, &head, Duration::from_secs(3)).await;
            let answer = answer.unwrap_or_else(|| panic!("{path}: no early 413"));
            assert!(answer.starts_with("HTTP/1.1 413"), "{path}: {answer}");
        }
    }
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}

#[tokio::test]
async fn slow_and_idle_connections_are_closed_and_connections_are_bounded() {
    let run = start().await;
    let addr = run.local_addr;
    // Headers never finished: the connection is closed after the header timeout (10 s), with
    // no answer kept waiting for.
    let t0 = Instant::now();
    let answer = send_head(
        addr,
        "GET /healthz HTTP/1.1\r\nhost: x\r\n",
        Duration::from_secs(15),
    )
    .await;
    assert!(
        answer.is_some(),
        "a half-sent head kept its connection open for 15 s"
    );
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(9) && took < Duration::from_secs(15),
        "{took:?}"
    );
    // A keep-alive connection left idle after a request: closed too.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let idle = tokio::time::timeout(Duration::from_secs(15), s.read(&mut buf)).await;
    assert!(
        matches!(idle, Ok(Ok(0))),
        "an idle keep-alive connection stayed open: {idle:?}"
    );
    // Many connections at once: past the listener's bound, new ones are closed, and the
    // listener still answers once they go.
    let mut held = Vec::new();
    for _ in 0..600 {
        held.push(TcpStream::connect(addr).await.unwrap());
    }
    let mut refused = 0;
    for s in held.iter_mut().skip(512) {
        let mut b = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_secs(2), s.read(&mut b)).await {
            refused += 1;
        }
    }
    assert!(refused >= 80, "{refused} of the 88 past the bound closed");
    drop(held);
    let ok = async {
        loop {
            let answer = send_head(
                addr,
                "GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
                Duration::from_secs(2),
            )
            .await;
            if answer.is_some_and(|a| a.starts_with("HTTP/1.1 200")) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), ok)
        .await
        .expect("the listener answers again");
    run.shutdown();
    run.wait(Duration::from_secs(5)).await;
}
