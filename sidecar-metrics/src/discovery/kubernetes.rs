//! Kubernetes discovery with kube-rs: the pods matching a label selector in a namespace, or the
//! pods of a Gateway API Inference Extension `InferencePool` (`inference.networking.k8s.io/v1`:
//! its `spec.selector.matchLabels` and `spec.targetPorts[].number`).
//!
//! Both are watches (list, then a watch stream from the list's resourceVersion, re-listed by
//! kube-rs's watcher after an error or a 410 Gone), so pods joining, leaving and changing
//! readiness show up within a round trip of the API server, not at a polling period.
//!
//! A pod becomes a target once it has an IP; it is listed but never healthy while its `Ready`
//! condition is not `True`; it is dropped when it is deleted or starts terminating
//! (`deletionTimestamp`), since a terminating vLLM drains and must not get new requests, and
//! when it has finished (phase `Failed` or `Succeeded`: evicted, completed), since its IP is
//! free for another pod to take. Two pods at one address (an IP reused before the API server
//! forgot the old pod, host networking) are one endpoint: the `Ready` one is listed.
//! RBAC: `get`/`list`/`watch` on `pods` and on `inferencepools` (see `deploy/kubernetes/`).
//!
//! Every request to the API server has a read timeout ([`READ_TIMEOUT`]): a LIST or the start of
//! a watch that the server accepted and never answers fails after it, is logged, and is tried
//! again (a LIST from scratch). kube-rs sets none by default, and its watcher's idle timeout only
//! covers a watch stream that has started, so one hung request used to freeze the pool's pod
//! list for good. Each watch asks the server to end it after [`ApiClient::watch_timeout_secs`],
//! shorter than the read timeout, so a healthy watch with nothing to say ends (and is resumed
//! from its resourceVersion, without a LIST) before the read timeout could take it for hung.

use super::{Target, Update, UpdateTx};
use crate::config::{KubernetesConfig, PoolConfig};
use crate::util::LogGate;
use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;
use thiserror::Error;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Failure to set up Kubernetes discovery.
#[derive(Debug, Error)]
pub enum KubeError {
    #[error("cannot build a Kubernetes client (in-cluster config or KUBECONFIG)")]
    Client(#[source] kube::Error),
}

/// The longest the API server may leave a request without a byte (the response's headers or
/// its next part) before the request fails and is tried again. A LIST of thousands of pods
/// starts answering within seconds; 60 s leaves a loaded API server room.
pub const READ_TIMEOUT: Duration = Duration::from_secs(60);

/// A Kubernetes API client whose requests cannot hang (see the module's documentation), and
/// the server-side timeout its watches ask for.
#[derive(Clone)]
pub struct ApiClient {
    pub client: kube::Client,
    /// `timeoutSeconds` of every watch: below the client's read timeout.
    pub watch_timeout_secs: u32,
}

impl ApiClient {
    /// From the in-cluster configuration or `KUBECONFIG` (as `kube::Client::try_default`), with
    /// [`READ_TIMEOUT`].
    pub async fn infer() -> Result<ApiClient, KubeError> {
        let cfg = kube::Config::infer()
            .await
            .map_err(|e| KubeError::Client(kube::Error::InferConfig(e)))?;
        ApiClient::new(cfg, READ_TIMEOUT)
    }

    /// From `cfg`, with `read_timeout` (at least 2 s) on every request; watches ask the server to
    /// end them after three quarters of it (45 s for the default 60 s).
    pub fn new(mut cfg: kube::Config, read_timeout: Duration) -> Result<ApiClient, KubeError> {
        let read_timeout = read_timeout.max(Duration::from_secs(2));
        cfg.read_timeout = Some(read_timeout);
        // Counted from when a request is sent, not from when its pooled connection went idle.
        cfg.reset_reader_on_write = true;
        let watch_timeout_secs =
            u32::try_from((read_timeout.as_secs() * 3 / 4).max(1)).unwrap_or(u32::MAX);
        Ok(ApiClient {
            client: kube::Client::try_from(cfg).map_err(KubeError::Client)?,
            watch_timeout_secs,
        })
    }
}

/// The `InferencePool` resource of the Gateway API Inference Extension, v1.
pub fn inference_pool_resource() -> ApiResource {
    ApiResource {
        group: "inference.networking.k8s.io".into(),
        version: "v1".into(),
        api_version: "inference.networking.k8s.io/v1".into(),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

/// Runs the discovery of one pool until `shutdown`.
pub async fn run(
    pool_index: usize,
    pool: PoolConfig,
    k: KubernetesConfig,
    client: ApiClient,
    tx: UpdateTx,
    shutdown: CancellationToken,
) {
    match (&k.selector, &k.inference_pool, k.port) {
        (Some(selector), _, Some(port)) => {
            watch_pods(
                pool_index,
                &pool,
                &k.namespace,
                selector,
                &[port],
                client,
                &tx,
                &shutdown,
            )
            .await
        }
        (None, Some(name), _) => {
            watch_inference_pool(
                pool_index,
                &pool,
                &k.namespace,
                name,
                client,
                &tx,
                &shutdown,
            )
            .await
        }
        // Validation rejects every other combination.
        _ => {}
    }
}

/// What the aggregator needs of one pod.
#[derive(Debug, Clone, PartialEq)]
struct PodEntry {
    name: String,
    ip: Option<IpAddr>,
    ready: bool,
    terminating: bool,
    /// Phase `Failed` or `Succeeded`: its containers have stopped for good.
    finished: bool,
}

fn entry(pod: &Pod) -> PodEntry {
    let status = pod.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    PodEntry {
        name: pod.metadata.name.clone().unwrap_or_default(),
        ip: status
            .and_then(|s| s.pod_ip.as_deref())
            .and_then(|ip| ip.parse().ok()),
        ready,
        terminating: pod.metadata.deletion_timestamp.is_some(),
        finished: status
            .and_then(|s| s.phase.as_deref())
            .is_some_and(|p| p == "Failed" || p == "Succeeded"),
    }
}

fn key(pod: &Pod) -> String {
    pod.metadata
        .uid
        .clone()
        .or_else(|| pod.metadata.name.clone())
        .unwrap_or_default()
}

fn targets(pool: &PoolConfig, pods: &BTreeMap<String, PodEntry>, ports: &[u16]) -> Vec<Target> {
    let mut out: Vec<Target> = pods
        .values()
        .filter(|p| !p.terminating && !p.finished)
        .filter_map(|p| p.ip.map(|ip| (p, ip)))
        .flat_map(|(p, ip)| {
            ports.iter().map(move |port| {
                let mut t = Target::for_pool(pool, SocketAddr::new(ip, *port));
                t.ready = p.ready;
                t.name = Some(p.name.clone());
                t
            })
        })
        .collect();
    // Two pods with one IP (host networking, an IP reused while the old pod is still listed)
    // would be one endpoint to the gateway: the ready one is kept (a stable sort, so among
    // equals the first by uid).
    out.sort_by(|a, b| a.address.cmp(&b.address).then(b.ready.cmp(&a.ready)));
    out.dedup_by_key(|t| t.address);
    out
}

/// First delay before a failed watch is tried again; it doubles with each failure in a row, up
/// to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// A failure this long after the watch was last tried again starts the delays over.
const RETRY_RESET_AFTER: Duration = Duration::from_secs(120);

/// The delays between tries of a failing watch. kube-rs's own backoff (`default_backoff`) is
/// reset by every `Ok` event, and its watcher yields `Ok(Init)` before each LIST, so an API
/// server that refused every LIST (RBAC missing: 403) got one LIST a second, forever. Here only
/// progress starts the delays over: an event of a running watch (a pod added, changed or
/// deleted), or a failure more than [`RETRY_RESET_AFTER`] after the last try (the watch ran
/// that long). A successful LIST alone is not progress (a watch that fails right after its
/// LIST, every time, would LIST in a loop).
struct Retry {
    delay: Duration,
    /// When the watch was last tried again after a failure.
    resumed: Option<Instant>,
}

impl Retry {
    fn new() -> Retry {
        Retry {
            delay: RETRY_MIN,
            resumed: None,
        }
    }

    /// The delay before the next try after a failure at `now`: the current one, plus up to a
    /// fifth at random so that many replicas refused at once do not retry in step.
    fn failed(&mut self, now: Instant) -> Duration {
        if self
            .resumed
            .is_some_and(|t| now.saturating_duration_since(t) >= RETRY_RESET_AFTER)
        {
            self.delay = RETRY_MIN;
        }
        let d = self.delay;
        self.delay = (d * 2).min(RETRY_MAX);
        self.resumed = None;
        use std::hash::{BuildHasher, Hasher};
        let r = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        d + d.mul_f64((r % 1000) as f64 / 5000.0)
    }

    fn resumed(&mut self, now: Instant) {
        self.resumed = Some(now);
    }

    fn progress(&mut self) {
        self.delay = RETRY_MIN;
    }
}

/// Most watch events taken at once before the pool's list is built again.
const MAX_EVENTS_AT_ONCE: usize = 100_000;

/// The pool's list is built (and handed to the aggregator) at most once per this, however fast
/// the watch's events come; the first change after a quiet spell goes at once. The watch
/// delivers one event per read of the connection, so taking the events that are ready alone
/// coalesced little: 10,000 pods turning NotReady cost ~8,600 builds of 10,000 targets.
const MIN_BUILD_GAP: Duration = Duration::from_millis(100);

/// The pods of one watch, as its events leave them.
#[derive(Default)]
struct PodSet {
    pods: BTreeMap<String, PodEntry>,
    /// The list being received (between `Init` and `InitDone`).
    buffer: Option<BTreeMap<String, PodEntry>>,
    initialised: bool,
}

impl PodSet {
    /// Applies one event; true when the list of pods changed.
    fn apply(&mut self, event: Event<Pod>) -> bool {
        match event {
            Event::Init => {
                self.buffer = Some(BTreeMap::new());
                false
            }
            Event::InitApply(p) => {
                self.buffer
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key(&p), entry(&p));
                false
            }
            Event::InitDone => {
                self.pods = self.buffer.take().unwrap_or_default();
                self.initialised = true;
                true
            }
            Event::Apply(p) => {
                let e = entry(&p);
                self.pods.insert(key(&p), e.clone()).as_ref() != Some(&e)
            }
            Event::Delete(p) => self.pods.remove(&key(&p)).is_some(),
        }
    }
}

/// Watches the pods matching `selector` and sends the pool's list after the initial list and
/// after every change. Every event that is ready when one arrives is applied before the list is
/// built, and the list is built at most every [`MIN_BUILD_GAP`]: a burst of changes (a zone's
/// pods turning NotReady at once) then costs a build per 100 ms, not one of the whole pool per
/// pod.
#[allow(clippy::too_many_arguments)]
async fn watch_pods(
    pool_index: usize,
    pool: &PoolConfig,
    namespace: &str,
    selector: &str,
    ports: &[u16],
    client: ApiClient,
    tx: &UpdateTx,
    shutdown: &CancellationToken,
) {
    let api: Api<Pod> = Api::namespaced(client.client, namespace);
    let cfg = watcher::Config::default()
        .labels(selector)
        .timeout(client.watch_timeout_secs);
    let mut stream = watcher::watcher(api, cfg).boxed();
    let mut retry = Retry::new();
    let mut set = PodSet::default();
    let mut last_sent: Option<Vec<Target>> = None;
    let mut gate = LogGate::new(Duration::from_secs(30));
    // A change not yet sent, and when the list was last built.
    let mut dirty = false;
    let mut last_build: Option<Instant> = None;
    loop {
        let due = last_build.map(|t| t + MIN_BUILD_GAP).filter(|_| dirty);
        let mut event = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now)), if due.is_some() => {
                None
            }
            e = stream.next() => Some(e),
        };
        let mut failed = None;
        let mut taken = 0;
        while let Some(ev) = event.take() {
            match ev {
                None => return,
                Some(Ok(e)) => {
                    match e {
                        Event::InitDone => gate.reset(),
                        Event::Apply(_) | Event::Delete(_) => retry.progress(),
                        _ => {}
                    }
                    dirty |= set.apply(e) && set.initialised;
                }
                Some(Err(e)) => {
                    let delay = retry.failed(Instant::now());
                    if let Some(held) = gate.allow(Instant::now()) {
                        tracing::warn!(pool = %pool.name, namespace, selector, error = %crate::util::with_causes(&e), suppressed = held,
                            retry_in_ms = delay.as_millis() as u64,
                            "kubernetes: pod watch failed; keeping the previous pod list");
                    }
                    failed = Some(delay);
                    break;
                }
            }
            taken += 1;
            if taken < MAX_EVENTS_AT_ONCE {
                event = stream.next().now_or_never();
            }
        }
        let now = Instant::now();
        if dirty && (failed.is_some() || last_build.is_none_or(|t| now >= t + MIN_BUILD_GAP)) {
            dirty = false;
            last_build = Some(now);
            let t = targets(pool, &set.pods, ports);
            if last_sent.as_ref() != Some(&t) {
                tracing::info!(pool = %pool.name, namespace, selector, pods = t.len(),
                    ready = t.iter().filter(|t| t.ready).count(), "kubernetes: pod list changed");
                if tx
                    .send(Update {
                        pool: pool_index,
                        targets: t.clone(),
                    })
                    .is_err()
                {
                    return;
                }
                last_sent = Some(t);
            }
        }
        if let Some(delay) = failed {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => retry.resumed(Instant::now()),
            }
        }
    }
}

/// The selector (as a label-selector string) and ports of an `InferencePool`. Accepts v1
/// (`selector.matchLabels`, `targetPorts[].number`) and the older v1alpha2 shape (`selector` as
/// a plain map, `targetPortNumber`), which some clusters still serve under the same kind.
fn pool_spec(obj: &DynamicObject) -> Result<(String, Vec<u16>), String> {
    let spec = obj.data.get("spec").ok_or("no spec")?;
    let sel = spec.get("selector").ok_or("no spec.selector")?;
    let labels = sel.get("matchLabels").unwrap_or(sel);
    let labels = labels
        .as_object()
        .ok_or("spec.selector.matchLabels is not a map")?;
    let mut parts = Vec::new();
    for (k, v) in labels {
        let v = v
            .as_str()
            .ok_or("spec.selector.matchLabels values must be strings")?;
        parts.push(format!("{k}={v}"));
    }
    if parts.is_empty() {
        // An empty selector would select every pod in the namespace.
        return Err("spec.selector.matchLabels is empty".into());
    }
    let mut ports: Vec<u16> = match spec.get("targetPorts").and_then(|p| p.as_array()) {
        Some(list) => list
            .iter()
            .filter_map(|p| p.get("number").and_then(|n| n.as_u64()))
            .filter_map(|n| u16::try_from(n).ok())
            .collect(),
        None => spec
            .get("targetPortNumber")
            .and_then(|n| n.as_u64())
            .and_then(|n| u16::try_from(n).ok())
            .into_iter()
            .collect(),
    };
    ports.retain(|p| *p != 0);
    ports.sort_unstable();
    ports.dedup();
    if ports.is_empty() {
        return Err("no spec.targetPorts[].number".into());
    }
    Ok((parts.join(","), ports))
}

/// Watches one `InferencePool`; (re)starts the pod watch whenever its selector or ports change.
async fn watch_inference_pool(
    pool_index: usize,
    pool: &PoolConfig,
    namespace: &str,
    name: &str,
    client: ApiClient,
    tx: &UpdateTx,
    shutdown: &CancellationToken,
) {
    let ar = inference_pool_resource();
    let api: Api<DynamicObject> = Api::namespaced_with(client.client.clone(), namespace, &ar);
    let cfg = watcher::Config::default()
        .fields(&format!("metadata.name={name}"))
        .timeout(client.watch_timeout_secs);
    let mut stream = watcher::watcher(api, cfg).boxed();
    let mut retry = Retry::new();
    let mut current: Option<((String, Vec<u16>), CancellationToken)> = None;
    let mut gate = LogGate::new(Duration::from_secs(30));
    let mut seen_in_init = false;
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = stream.next() => e,
        };
        let spec = match event {
            None => break,
            Some(Ok(Event::Init)) => {
                seen_in_init = false;
                continue;
            }
            Some(Ok(Event::InitApply(obj))) | Some(Ok(Event::Apply(obj))) => {
                seen_in_init = true;
                retry.progress();
                match pool_spec(&obj) {
                    Ok(s) => Some(s),
                    Err(why) => {
                        tracing::error!(pool = %pool.name, namespace, inference_pool = name, problem = %why,
                            "kubernetes: InferencePool is unusable; keeping the previous pod list");
                        continue;
                    }
                }
            }
            Some(Ok(Event::InitDone)) => {
                if seen_in_init {
                    continue;
                }
                None
            }
            Some(Ok(Event::Delete(_))) => {
                retry.progress();
                None
            }
            Some(Err(e)) => {
                let delay = retry.failed(Instant::now());
                if let Some(held) = gate.allow(Instant::now()) {
                    tracing::warn!(pool = %pool.name, namespace, inference_pool = name, error = %crate::util::with_causes(&e), suppressed = held,
                        retry_in_ms = delay.as_millis() as u64, "kubernetes: InferencePool watch failed");
                }
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(delay) => retry.resumed(Instant::now()),
                }
                continue;
            }
        };
        match spec {
            Some(spec) => {
                if current.as_ref().is_some_and(|(s, _)| *s == spec) {
                    continue;
                }
                if let Some((_, stop)) = current.take() {
                    stop.cancel();
                }
                tracing::info!(pool = %pool.name, namespace, inference_pool = name, selector = %spec.0,
                    ports = ?spec.1, "kubernetes: watching the InferencePool's pods");
                let stop = shutdown.child_token();
                let (p, ns, c, t, s) = (
                    pool.clone(),
                    namespace.to_string(),
                    client.clone(),
                    tx.clone(),
                    stop.clone(),
                );
                let (selector, ports) = spec.clone();
                tokio::spawn(async move {
                    watch_pods(pool_index, &p, &ns, &selector, &ports, c, &t, &s).await;
                });
                current = Some((spec, stop));
            }
            None => {
                // The InferencePool does not exist (or was deleted): the pool has no pods.
                if let Some((_, stop)) = current.take() {
                    stop.cancel();
                }
                tracing::warn!(pool = %pool.name, namespace, inference_pool = name,
                    "kubernetes: InferencePool not found; the pool has no pods");
                if tx
                    .send(Update {
                        pool: pool_index,
                        targets: Vec::new(),
                    })
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    if let Some((_, stop)) = current.take() {
        stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn inference_pool_v1_and_v1alpha2_shapes() {
        let v1: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "llama"},
            "spec": {"selector": {"matchLabels": {"app": "vllm", "model": "llama"}},
                     "targetPorts": [{"number": 8000}, {"number": 8001}],
                     "endpointPickerRef": {"name": "epp"}}
        }))
        .unwrap();
        assert_eq!(
            pool_spec(&v1).unwrap(),
            ("app=vllm,model=llama".to_string(), vec![8000, 8001])
        );
        let alpha: DynamicObject = serde_json::from_value(json!({
            "metadata": {"name": "llama"},
            "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000}
        }))
        .unwrap();
        assert_eq!(
            pool_spec(&alpha).unwrap(),
            ("app=vllm".to_string(), vec![8000])
        );
        let empty: DynamicObject = serde_json::from_value(json!({
            "metadata": {"name": "x"}, "spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}
        }))
        .unwrap();
        assert!(pool_spec(&empty).unwrap_err().contains("empty"));
    }

    fn test_pool() -> PoolConfig {
        PoolConfig::named("p")
    }

    /// An evicted (or completed) pod keeps its IP in the API until it is deleted; the kubelet
    /// may give the IP to a new pod meanwhile. Before, the finished pod was listed (and
    /// scraped), and at an IP taken again the pod whose uid sorted first won, so a live Ready
    /// pod could be published as not ready for good.
    #[test]
    fn finished_pods_are_skipped_and_a_reused_ip_is_the_ready_pods() {
        let pod = |uid: &str, ip: &str, phase: &str, ready: bool| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": format!("pod-{uid}"), "uid": uid},
                "status": {"phase": phase, "podIP": ip,
                    "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
            }))
            .unwrap()
        };
        let mut map = BTreeMap::new();
        for p in [
            // Evicted, and its IP given to a live pod whose uid sorts after it.
            pod("a", "127.0.0.2", "Failed", false),
            pod("b", "127.0.0.2", "Running", true),
            // Completed, its IP not reused: not scraped any more.
            pod("c", "127.0.0.3", "Succeeded", false),
            // Two running pods at one IP (host networking): the ready one, whatever the uids.
            pod("d", "127.0.0.4", "Running", false),
            pod("e", "127.0.0.4", "Running", true),
            // Pending and running pods that are not ready are listed as before.
            pod("f", "127.0.0.5", "Pending", false),
        ] {
            map.insert(key(&p), entry(&p));
        }
        let got: Vec<_> = targets(&test_pool(), &map, &[8000])
            .iter()
            .map(|t| (t.address.to_string(), t.ready, t.name.clone().unwrap()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("127.0.0.2:8000".into(), true, "pod-b".into()),
                ("127.0.0.4:8000".into(), true, "pod-e".into()),
                ("127.0.0.5:8000".into(), false, "pod-f".into()),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn retry_delays_double_to_30_s_and_start_over_only_after_progress() {
        let mut r = Retry::new();
        let mut seen = Vec::new();
        for _ in 0..8 {
            let d = r.failed(Instant::now());
            seen.push(d);
            tokio::time::advance(d).await;
            r.resumed(Instant::now());
        }
        let base = [1, 2, 4, 8, 16, 30, 30, 30].map(Duration::from_secs);
        for (d, b) in seen.iter().zip(base) {
            assert!(*d >= b && *d <= b.mul_f64(1.2), "{seen:?}");
        }
        // A LIST that succeeds and a watch that fails at once: no progress, the delay stays.
        assert!(r.failed(Instant::now()) >= RETRY_MAX);
        // An event of a running watch starts the delays over.
        r.progress();
        assert!(r.failed(Instant::now()) < Duration::from_secs(2));
        // So does a failure long after the last try.
        assert!(r.failed(Instant::now()) >= Duration::from_secs(2));
        r.resumed(Instant::now());
        tokio::time::advance(RETRY_RESET_AFTER).await;
        assert!(r.failed(Instant::now()) < Duration::from_secs(2));
    }

    #[test]
    fn pods_without_ip_or_terminating_are_skipped_and_readiness_is_kept() {
        let pod = |name: &str, ip: Option<&str>, ready: bool, terminating: bool| -> Pod {
            let mut v = json!({
                "metadata": {"name": name, "uid": name},
                "status": {"conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
            });
            if let Some(ip) = ip {
                v["status"]["podIP"] = json!(ip);
            }
            if terminating {
                v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
            }
            serde_json::from_value(v).unwrap()
        };
        let mut map = BTreeMap::new();
        for p in [
            pod("a", Some("127.0.0.2"), true, false),
            pod("b", Some("127.0.0.3"), false, false),
            pod("c", None, false, false),
            pod("d", Some("127.0.0.4"), true, true),
        ] {
            map.insert(key(&p), entry(&p));
        }
        let pool = PoolConfig {
            metrics_path: Some("/m".into()),
            ..PoolConfig::named("p")
        };
        let t = targets(&pool, &map, &[8000]);
        let got: Vec<_> = t
            .iter()
            .map(|t| {
                (
                    t.address.to_string(),
                    t.ready,
                    t.name.clone().unwrap(),
                    t.metrics_url.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "127.0.0.2:8000".into(),
                    true,
                    "a".into(),
                    "http://127.0.0.2:8000/m".into()
                ),
                (
                    "127.0.0.3:8000".into(),
                    false,
                    "b".into(),
                    "http://127.0.0.3:8000/m".into()
                ),
            ]
        );
    }
}
