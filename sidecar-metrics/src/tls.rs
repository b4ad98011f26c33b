//! TLS for the connections the aggregator makes to other pods, and takes from them:
//!
//! - scrapes of pods that serve their metrics over HTTPS (`scrape_tls`: vLLM's `--ssl-certfile`,
//!   or a mesh with strict mutual TLS, scraped with the mesh's workload certificate as Istio's
//!   own Prometheus integration does): the certificate authorities to check the pods against, an
//!   optional client certificate, the name to check, or no check at all;
//! - the relays between gateway replicas (`prefix.tls`): mutual TLS, each sidecar serving its
//!   certificate on `prefix.listen` and showing it to the peers it posts to, each checking the
//!   other's against the same authorities.
//!
//! The files are looked at every few seconds ([`watch`]) and taken again when they change, so a
//! renewed certificate needs no restart. rustls with ring, the stack kube-rs already brings: no
//! OpenSSL, no second TLS library.

use crate::config::{ConfigError, TlsConfig};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A client's TLS: its rustls configuration, and the name the other side's certificate is
/// checked against when it is not the URL's host.
#[derive(Clone, Debug)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    pub server_name: Option<ServerName<'static>>,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// What is wrong with a TLS section, naming the field (`scrape_tls.ca_file`, ...).
fn bad(field: String, reason: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field,
        reason: reason.into(),
    }
}

/// The client TLS `c` (the section at `at`: `scrape_tls`, `prefix.tls`) describes, or what is
/// wrong with it.
pub fn client_tls(c: &TlsConfig, at: &str) -> Result<ClientTls, ConfigError> {
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(at.into(), e.to_string()))?;
    let builder = if c.insecure_skip_verify {
        builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider())))
    } else {
        builder.with_root_certificates(roots(c.ca_file.as_deref(), at)?)
    };
    let config = match (&c.cert_file, &c.key_file) {
        (Some(cert), Some(key)) => {
            let (chain, key) = certified(cert, key, at)?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| mismatch(at, e))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => return Err(bad(at.into(), "cert_file and key_file go together")),
    };
    let server_name = match &c.server_name {
        None => None,
        Some(name) => Some(
            ServerName::try_from(name.clone())
                .map_err(|e| bad(format!("{at}.server_name"), format!("{name:?}: {e}")))?,
        ),
    };
    Ok(ClientTls {
        config: Arc::new(config),
        server_name,
    })
}

/// The server TLS `c` (at `at`) describes: its certificate, and clients must show one that its
/// `ca_file` signed (mutual TLS). All three files are required.
pub fn server_tls(c: &TlsConfig, at: &str) -> Result<Arc<ServerConfig>, ConfigError> {
    let need = |f: &Option<std::path::PathBuf>, name: &str| {
        f.clone().ok_or_else(|| {
            bad(
                format!("{at}.{name}"),
                "required (mutual TLS between the sidecars)",
            )
        })
    };
    let (cert, key, ca) = (
        need(&c.cert_file, "cert_file")?,
        need(&c.key_file, "key_file")?,
        need(&c.ca_file, "ca_file")?,
    );
    let verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots(Some(&ca), at)?), provider())
            .build()
            .map_err(|e| bad(format!("{at}.ca_file"), e.to_string()))?;
    let (chain, key) = certified(&cert, &key, at)?;
    let config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| bad(at.into(), e.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key)
        .map_err(|e| mismatch(at, e))?;
    Ok(Arc::new(config))
}

/// A certificate chain and its key, read from their PEM files.
fn certified(
    cert: &Path,
    key: &Path,
    at: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), ConfigError> {
    let chain = certificates(&format!("{at}.cert_file"), cert)?;
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        bad(
            format!("{at}.key_file"),
            format!("{}: no private key read: {e}", key.display()),
        )
    })?;
    Ok((chain, key))
}

fn mismatch(at: &str, e: rustls::Error) -> ConfigError {
    bad(
        format!("{at}.key_file"),
        format!("not the certificate's key: {e}"),
    )
}

/// What the files `c` names look like now (modification time and length, following symbolic
/// links, as a mounted Secret's are): a change in any of them is a change of the TLS.
fn files_stamp(c: &TlsConfig) -> Vec<Option<(std::time::SystemTime, u64)>> {
    [&c.ca_file, &c.cert_file, &c.key_file]
        .into_iter()
        .map(|f| {
            let m = std::fs::metadata(f.as_ref()?).ok()?;
            Some((m.modified().ok()?, m.len()))
        })
        .collect()
}

/// What `build` makes of the TLS files `c` names, made again whenever they change (looked at
/// every `every`, until `shutdown`): renewed certificates (Istio's daily, a mounted Secret when
/// cert-manager renews it) are taken without a restart. A change that does not build (a file
/// half written, a certificate with the old key) keeps the value in use and is tried again at
/// the next look. The first build's error is returned: it stops the start.
pub fn watch<T, F>(
    c: TlsConfig,
    every: Duration,
    shutdown: CancellationToken,
    build: F,
) -> Result<watch::Receiver<T>, ConfigError>
where
    T: Send + Sync + 'static,
    F: Fn(&TlsConfig) -> Result<T, ConfigError> + Send + 'static,
{
    let mut stamp = files_stamp(&c);
    let (tx, rx) = watch::channel(build(&c)?);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let now = files_stamp(&c);
            if now == stamp {
                continue;
            }
            match build(&c) {
                Ok(v) => {
                    tracing::info!("TLS files changed: new connections use them");
                    tx.send_replace(v);
                    stamp = now;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "TLS files changed but do not load; keeping the ones in use");
                }
            }
        }
    });
    Ok(rx)
}

/// A value that never changes, where a [`watch`]ed one may be given.
pub fn fixed<T: Send + Sync + 'static>(value: T) -> watch::Receiver<T> {
    // The sender goes: the receiver keeps the one value.
    watch::channel(value).1
}

/// The certificate authorities in `ca_file`, or the system's.
fn roots(ca_file: Option<&Path>, at: &str) -> Result<RootCertStore, ConfigError> {
    let field = format!("{at}.ca_file");
    let mut roots = RootCertStore::empty();
    match ca_file {
        Some(path) => {
            for cert in certificates(&field, path)? {
                roots.add(cert).map_err(|e| {
                    bad(
                        field.clone(),
                        format!("{}: a certificate rustls refuses: {e}", path.display()),
                    )
                })?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            // Certificates the system has that rustls cannot read are skipped, as browsers do.
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map_or("none installed".to_string(), |e| e.to_string());
                return Err(bad(
                    field,
                    format!("unset, and no certificate authority found on this system ({why})"),
                ));
            }
        }
    }
    Ok(roots)
}

/// Every certificate in the PEM file at `path` (at least one).
fn certificates(field: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| bad(field.into(), format!("{}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(bad(
            field.into(),
            format!("{}: no PEM certificate in it", path.display()),
        ));
    }
    Ok(certs)
}

/// `insecure_skip_verify`: any certificate is taken (the handshake's signatures are still
/// checked, so the connection is encrypted to whoever holds the key it shows).
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
#[path = "../tests/common/tls_pod.rs"]
mod tls_pod;

#[cfg(test)]
mod tests {
    use super::tls_pod::{file, serve, server_config};
    use super::*;
    use crate::scrape::{fetch_within, HttpFetcher, ScrapeError};
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    const BODY: &str = "vllm:num_requests_waiting 3\n";

    /// A pod serving `BODY` over TLS with `testdata/tls/{cert}.pem`, asking for a client
    /// certificate when `client_auth`; its address and how many handshakes it completed.
    async fn pod(cert: &str, client_auth: bool) -> (SocketAddr, Arc<AtomicUsize>) {
        serve(Some(server_config(cert, client_auth)), BODY.to_string()).await
    }

    fn cfg(ca: Option<&str>) -> TlsConfig {
        TlsConfig {
            ca_file: ca.map(file),
            ..TlsConfig::default()
        }
    }

    async fn scrape(c: &TlsConfig, url: String) -> Result<String, ScrapeError> {
        let tls = client_tls(c, "scrape_tls").unwrap();
        let f = HttpFetcher::with_tls(1 << 20, Some(&tls));
        let body = fetch_within(&f, &url.parse().unwrap(), Duration::from_secs(5)).await?;
        Ok(String::from_utf8(body.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn a_pod_serving_https_is_scraped_and_its_connection_kept() {
        let (addr, sessions) = pod("pod", false).await;
        let tls = client_tls(&cfg(Some("ca.pem")), "scrape_tls").unwrap();
        let f = HttpFetcher::with_tls(1 << 20, Some(&tls));
        let url = format!("https://{addr}/metrics").parse().unwrap();
        for _ in 0..3 {
            let body = fetch_within(&f, &url, Duration::from_secs(5))
                .await
                .unwrap();
            assert_eq!(body, BODY.as_bytes());
        }
        // Three scrapes, one handshake.
        assert_eq!(sessions.load(Ordering::SeqCst), 1);
        // The same fetcher still scrapes plain HTTP pods.
        let plain = {
            let router =
                axum::Router::new().route("/metrics", axum::routing::get(|| async { BODY }));
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let a = l.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(l, router).await });
            a
        };
        let url = format!("http://{plain}/metrics").parse().unwrap();
        assert_eq!(
            fetch_within(&f, &url, Duration::from_secs(5))
                .await
                .unwrap(),
            BODY.as_bytes()
        );
    }

    #[tokio::test]
    async fn a_certificate_no_configured_authority_signed_is_refused_unless_told_to_skip() {
        let (addr, _) = pod("pod", false).await;
        let url = format!("https://{addr}/metrics");
        let err = scrape(&cfg(Some("other-ca.pem")), url.clone())
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "connect");
        assert!(err.to_string().contains("UnknownIssuer"), "{err}");
        let skip = TlsConfig {
            insecure_skip_verify: true,
            ..cfg(Some("other-ca.pem"))
        };
        assert_eq!(scrape(&skip, url).await.unwrap(), BODY);
    }

    #[tokio::test]
    async fn a_certificate_issued_for_a_name_is_checked_against_server_name() {
        // Scraped by IP, as discovered pods are; the certificate names only `pod.test`.
        let (addr, _) = pod("pod-by-name", false).await;
        let url = format!("https://{addr}/metrics");
        let err = scrape(&cfg(Some("ca.pem")), url.clone()).await.unwrap_err();
        assert!(err.to_string().contains("not valid for name"), "{err}");
        let named = TlsConfig {
            server_name: Some("pod.test".into()),
            ..cfg(Some("ca.pem"))
        };
        assert_eq!(scrape(&named, url.clone()).await.unwrap(), BODY);
        let wrong = TlsConfig {
            server_name: Some("other.test".into()),
            ..cfg(Some("ca.pem"))
        };
        assert!(scrape(&wrong, url).await.is_err());
    }

    #[tokio::test]
    async fn a_pod_asking_for_a_client_certificate_gets_the_configured_one() {
        let (addr, _) = pod("pod", true).await;
        let url = format!("https://{addr}/metrics");
        // Without one the pod ends the handshake (TLS 1.3: after the client's Finished, so
        // the refusal shows while the request is read or written): no connection all the same.
        let err = scrape(&cfg(Some("ca.pem")), url.clone()).await.unwrap_err();
        assert_eq!(err.kind(), "connect", "{err}");
        let mutual = TlsConfig {
            cert_file: Some(file("client.pem")),
            key_file: Some(file("client.key")),
            ..cfg(Some("ca.pem"))
        };
        assert_eq!(scrape(&mutual, url).await.unwrap(), BODY);
    }

    #[tokio::test]
    async fn a_plain_fetcher_refuses_https() {
        let (addr, sessions) = pod("pod", false).await;
        let f = HttpFetcher::new(1 << 20);
        let url = format!("https://{addr}/metrics").parse().unwrap();
        let err = fetch_within(&f, &url, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(err.kind(), "connect");
        assert!(err.to_string().contains("scheme is not http"), "{err}");
        assert_eq!(sessions.load(Ordering::SeqCst), 0);
    }

    #[tokio::test]
    async fn changed_files_are_taken_without_a_restart_and_broken_ones_are_not() {
        let (addr, _) = pod("pod", false).await;
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        // Written as a mounted Secret is updated: the new file moved into place.
        let put = |content: &[u8]| {
            let tmp = dir.path().join("next");
            std::fs::write(&tmp, content).unwrap();
            std::fs::rename(&tmp, &ca).unwrap();
        };
        put(&std::fs::read(file("ca.pem")).unwrap());
        let c = TlsConfig {
            ca_file: Some(ca.clone()),
            ..TlsConfig::default()
        };
        let stop = tokio_util::sync::CancellationToken::new();
        let f =
            HttpFetcher::reloading(1 << 20, c, Duration::from_millis(10), stop.clone()).unwrap();
        let url = format!("https://{addr}/metrics").parse().unwrap();
        let scrape = || fetch_within(&f, &url, Duration::from_secs(5));
        assert!(scrape().await.is_ok());
        // Half written: no certificate in it. The client in use stays.
        put(b"-----BEGIN CERTIFICATE-----\nMIIB");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(scrape().await.is_ok());
        // Another authority: the next scrapes check against it, and this pod fails them.
        put(&std::fs::read(file("other-ca.pem")).unwrap());
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut last = scrape().await;
        while last.is_ok() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
            last = scrape().await;
        }
        let err = last.unwrap_err();
        assert!(err.to_string().contains("UnknownIssuer"), "{err}");
        stop.cancel();
    }

    #[test]
    fn what_is_wrong_with_a_configuration_names_its_field() {
        let err = |c: TlsConfig| match client_tls(&c, "scrape_tls").unwrap_err() {
            ConfigError::Field { field, reason } => (field, reason),
            other => panic!("{other}"),
        };
        assert_eq!(err(cfg(Some("no-such.pem"))).0, "scrape_tls.ca_file");
        // A key is not a certificate.
        let (f, why) = err(cfg(Some("client.key")));
        assert_eq!(f, "scrape_tls.ca_file");
        assert!(why.contains("no PEM certificate"), "{why}");
        let half = TlsConfig {
            cert_file: Some(file("client.pem")),
            ..cfg(Some("ca.pem"))
        };
        assert_eq!(err(half).0, "scrape_tls");
        let no_key = TlsConfig {
            cert_file: Some(file("client.pem")),
            key_file: Some(file("client.pem")),
            ..cfg(Some("ca.pem"))
        };
        assert_eq!(err(no_key).0, "scrape_tls.key_file");
        // Another certificate's key (a renewal caught between its two files) is refused too.
        let mismatched = TlsConfig {
            cert_file: Some(file("client.pem")),
            key_file: Some(file("pod.key")),
            ..cfg(Some("ca.pem"))
        };
        let (f, why) = err(mismatched);
        assert_eq!(f, "scrape_tls.key_file");
        assert!(why.contains("not the certificate's key"), "{why}");
        let bad_name = TlsConfig {
            server_name: Some("not a name".into()),
            ..cfg(Some("ca.pem"))
        };
        assert_eq!(err(bad_name).0, "scrape_tls.server_name");
    }
}
