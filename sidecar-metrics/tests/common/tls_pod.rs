//! A pod for the TLS tests and the client bench: answers every request head on a connection
//! with one fixed body, over TLS (a rustls server) or plain TCP, keeping connections alive.
//! Included by path where needed (`#[path = "../tests/common/tls_pod.rs"] mod tls_pod;`).

// Test helpers: a failed setup should fail loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// A file of `testdata/tls/`.
pub fn file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../testdata/tls")
        .join(name)
}

/// A server configuration with `testdata/tls/{cert}.pem` and its key, asking clients for a
/// certificate of the test authority when `client_auth`.
pub fn server_config(cert: &str, client_auth: bool) -> Arc<ServerConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(file(&format!("{cert}.pem")))
            .and_then(|it| it.collect())
            .expect("test certificate");
    let key = PrivateKeyDer::from_pem_file(file(&format!("{cert}.key"))).expect("test key");
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .expect("protocol versions");
    let builder = if client_auth {
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_file_iter(file("ca.pem")).expect("test authority") {
            roots
                .add(ca.expect("test authority"))
                .expect("test authority");
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .expect("client verifier");
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    Arc::new(
        builder
            .with_single_cert(chain, key)
            .expect("certificate and key"),
    )
}

/// Serves `body` on 127.0.0.1 (TLS with `tls`, else plain); its address and the count of
/// connections it accepted (TLS: of handshakes completed).
pub async fn serve(tls: Option<Arc<ServerConfig>>, body: String) -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    let answer: Arc<[u8]> = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
    .into();
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, counted, answer) = (acceptor.clone(), counted.clone(), answer.clone());
            tokio::spawn(async move {
                let _ = tcp.set_nodelay(true);
                match acceptor {
                    Some(a) => {
                        if let Ok(s) = a.accept(tcp).await {
                            counted.fetch_add(1, Ordering::SeqCst);
                            answer_each(s, &answer).await;
                        }
                    }
                    None => {
                        counted.fetch_add(1, Ordering::SeqCst);
                        answer_each(tcp, &answer).await;
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// `answer` for every request head read from `s` (requests without a body).
async fn answer_each(mut s: impl AsyncRead + AsyncWrite + Unpin, answer: &[u8]) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    while let Ok(n @ 1..) = s.read(&mut chunk).await {
        buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.drain(..end + 4);
            if s.write_all(answer).await.is_err() {
                return;
            }
        }
    }
}
