//! DNS discovery: a name that resolves to many A/AAAA records (a Kubernetes headless Service),
//! re-resolved every `refresh_ms`. The port comes from the configuration, since plain A records
//! carry none.
//!
//! Resolution goes through the [`Resolver`] trait so tests use a fake instead of the network.

use super::{Target, Update, UpdateTx};
use crate::config::{DnsConfig, PoolConfig};
use crate::util::LogGate;
use futures::future::BoxFuture;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// Resolves a host name to socket addresses.
pub trait Resolver: Send + Sync + 'static {
    /// All addresses of `name`, each with `port`.
    fn resolve(
        &self,
        name: &str,
        port: u16,
    ) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>>;
}

/// The operating system's resolver (`getaddrinfo` through tokio). A name that does not exist
/// (`EAI_NONAME`: NXDOMAIN; `EAI_NODATA`: no address records) is an error of kind
/// [`std::io::ErrorKind::NotFound`]; other failures (`EAI_AGAIN`: SERVFAIL, a timeout) keep
/// their kind.
pub struct SystemResolver;

impl Resolver for SystemResolver {
    fn resolve(
        &self,
        name: &str,
        port: u16,
    ) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
        let name = name.to_string();
        Box::pin(async move {
            match tokio::net::lookup_host((name.as_str(), port)).await {
                Ok(addrs) => Ok(addrs.collect()),
                Err(e) if is_no_such_name(&e) => {
                    Err(std::io::Error::new(std::io::ErrorKind::NotFound, e))
                }
                Err(e) => Err(e),
            }
        })
    }
}

/// Whether a failure of std's `getaddrinfo` says the name has no address at all. std reports
/// every `getaddrinfo` code as one kind of error with `gai_strerror`'s text, so the text is
/// compared with the C library's own texts for those codes (the process never calls
/// `setlocale`, so both come from the same locale).
#[cfg(unix)]
fn is_no_such_name(e: &std::io::Error) -> bool {
    static TEXTS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let texts = TEXTS.get_or_init(|| {
        let mut codes = vec![libc::EAI_NONAME];
        #[cfg(any(target_os = "linux", target_os = "android", target_os = "macos"))]
        codes.push(libc::EAI_NODATA);
        codes
            .into_iter()
            .filter_map(|c| {
                // SAFETY: gai_strerror returns a pointer to a static NUL-terminated string.
                let p = unsafe { libc::gai_strerror(c) };
                (!p.is_null()).then(|| {
                    // SAFETY: non-null, static and NUL-terminated (above).
                    unsafe { std::ffi::CStr::from_ptr(p) }
                        .to_string_lossy()
                        .into_owned()
                })
            })
            .filter(|t| !t.is_empty())
            .collect()
    });
    let text = e.to_string();
    texts.iter().any(|t| text.ends_with(t.as_str()))
}

#[cfg(not(unix))]
fn is_no_such_name(_: &std::io::Error) -> bool {
    false
}

/// Resolves `dns.name` every `dns.refresh_ms` and sends the pool's pod list when it changes.
/// A name that does not exist (an error of kind `NotFound`: NXDOMAIN, which CoreDNS answers for
/// a headless Service with no ready endpoint, e.g. scaled to zero) is an empty list: the old
/// pods are gone, and their IPs may already be another server's. Any other failure (SERVFAIL,
/// a timeout) keeps the previous list.
pub async fn run(
    pool_index: usize,
    pool: PoolConfig,
    dns: DnsConfig,
    resolver: Arc<dyn Resolver>,
    tx: UpdateTx,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(Duration::from_millis(dns.refresh_ms));
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last: Option<Vec<SocketAddr>> = None;
    let mut gate = LogGate::new(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let resolved = match resolver.resolve(&dns.name, dns.port).await {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if last.as_ref().is_some_and(|l| !l.is_empty()) {
                    tracing::warn!(pool = %pool.name, name = %dns.name, error = %e,
                        "dns: the name does not exist; the pool has no pods");
                }
                Ok(Vec::new())
            }
            r => r,
        };
        match resolved {
            Ok(mut addrs) => {
                gate.reset();
                addrs.sort();
                addrs.dedup();
                if last.as_ref() != Some(&addrs) {
                    tracing::info!(pool = %pool.name, name = %dns.name, pods = addrs.len(), "dns: pod list changed");
                    let targets = addrs.iter().map(|a| Target::for_pool(&pool, *a)).collect();
                    if tx
                        .send(Update {
                            pool: pool_index,
                            targets,
                        })
                        .is_err()
                    {
                        return;
                    }
                    last = Some(addrs);
                }
            }
            Err(e) => {
                if let Some(held) = gate.allow(Instant::now()) {
                    tracing::warn!(pool = %pool.name, name = %dns.name, error = %e, suppressed = held,
                        "dns: resolution failed; keeping the previous pod list");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Answers from a script, one entry per call; the last entry repeats.
    struct Scripted(Mutex<Vec<std::io::Result<Vec<&'static str>>>>);

    impl Resolver for Scripted {
        fn resolve(
            &self,
            name: &str,
            port: u16,
        ) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> {
            assert_eq!(name, "vllm.llm.svc.cluster.local");
            let mut script = self.0.lock().unwrap();
            let next = if script.len() > 1 {
                script.remove(0)
            } else {
                match &script[0] {
                    Ok(v) => Ok(v.clone()),
                    Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                }
            };
            Box::pin(async move {
                next.map(|ips| {
                    ips.iter()
                        .map(|ip| SocketAddr::new(ip.parse().unwrap(), port))
                        .collect()
                })
            })
        }
    }

    fn pool() -> PoolConfig {
        PoolConfig::named("p")
    }

    /// DNS discovery of pool `index` (`vllm.llm.svc.cluster.local`, port 8000, every second)
    /// through `script`: its updates, its stop token and its task.
    fn watch(
        index: usize,
        script: Scripted,
    ) -> (
        crate::discovery::UpdateRx,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let dns = DnsConfig {
            name: "vllm.llm.svc.cluster.local".into(),
            port: 8000,
            refresh_ms: 1000,
        };
        let (tx, rx) = crate::discovery::channel();
        let stop = CancellationToken::new();
        let task = tokio::spawn(run(index, pool(), dns, Arc::new(script), tx, stop.clone()));
        (rx, stop, task)
    }

    #[tokio::test(start_paused = true)]
    async fn re_resolves_sends_changes_only_and_survives_failures() {
        let script = Scripted(Mutex::new(vec![
            Ok(vec!["127.0.0.3", "127.0.0.2", "127.0.0.2"]),
            Ok(vec!["127.0.0.2", "127.0.0.3"]),
            Err(std::io::Error::other("SERVFAIL")),
            Ok(vec!["127.0.0.2", "::1"]),
        ]));
        let (mut rx, stop, task) = watch(3, script);

        let first = rx.recv().await.unwrap();
        assert_eq!(first.pool, 3);
        let addrs: Vec<String> = first
            .targets
            .iter()
            .map(|t| t.address.to_string())
            .collect();
        assert_eq!(
            addrs,
            ["127.0.0.2:8000", "127.0.0.3:8000"],
            "sorted and deduplicated"
        );
        assert_eq!(
            first.targets[0].metrics_url,
            "http://127.0.0.2:8000/metrics"
        );

        // Same set, then a failure: nothing is sent; then a change is sent.
        let second = rx.recv().await.unwrap();
        let addrs: Vec<String> = second
            .targets
            .iter()
            .map(|t| t.address.to_string())
            .collect();
        assert_eq!(addrs, ["127.0.0.2:8000", "[::1]:8000"]);
        assert!(tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .is_err());
        stop.cancel();
        task.await.unwrap();
    }

    /// NXDOMAIN (a headless Service scaled to zero) empties the pool; before, the old pods were
    /// kept for good, and their IPs may be reused by another server. A transient failure
    /// (SERVFAIL, timeout) still keeps the list.
    #[tokio::test(start_paused = true)]
    async fn a_name_that_does_not_exist_empties_the_pool_other_failures_keep_it() {
        let gone = || {
            Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "failed to lookup address information: Name or service not known",
            ))
        };
        let script = Scripted(Mutex::new(vec![
            Ok(vec!["127.0.0.2"]),
            Err(std::io::Error::other(
                "Temporary failure in name resolution",
            )),
            gone(),
            gone(),
            Ok(vec!["127.0.0.3"]),
        ]));
        let (mut rx, stop, task) = watch(0, script);
        let mut lists = Vec::new();
        for _ in 0..3 {
            let u = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .expect("a list within a minute")
                .unwrap();
            lists.push(
                u.targets
                    .iter()
                    .map(|t| t.address.to_string())
                    .collect::<Vec<_>>(),
            );
        }
        assert_eq!(
            lists,
            [vec!["127.0.0.2:8000"], vec![], vec!["127.0.0.3:8000"]]
        );
        stop.cancel();
        task.await.unwrap();
    }

    /// The resolver's errors as std gives them (`gai_strerror`'s text): no such name, or not.
    #[cfg(unix)]
    #[test]
    fn getaddrinfo_no_such_name_is_told_from_a_transient_failure() {
        let gai = |code| {
            // SAFETY: as in is_no_such_name.
            let text = unsafe { std::ffi::CStr::from_ptr(libc::gai_strerror(code)) };
            std::io::Error::other(format!(
                "failed to lookup address information: {}",
                text.to_string_lossy()
            ))
        };
        assert!(is_no_such_name(&gai(libc::EAI_NONAME)));
        #[cfg(target_os = "linux")]
        assert!(is_no_such_name(&gai(libc::EAI_NODATA)));
        assert!(!is_no_such_name(&gai(libc::EAI_AGAIN)));
        assert!(!is_no_such_name(&gai(libc::EAI_FAIL)));
        assert!(!is_no_such_name(&std::io::Error::other(
            "connection refused"
        )));
    }

    #[tokio::test]
    async fn system_resolver_resolves_localhost_without_the_network() {
        let addrs = SystemResolver.resolve("localhost", 8000).await.unwrap();
        assert!(!addrs.is_empty());
        assert!(addrs
            .iter()
            .all(|a| a.ip().is_loopback() && a.port() == 8000));
    }
}
