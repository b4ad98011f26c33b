//! A local fake Kubernetes API server that speaks list and watch for pods and
//! InferencePools (JSON lines of `{"type": ADDED|MODIFIED|DELETED, "object": ...}`,
//! resourceVersion-ordered, replayed from the requested version), with failures to order (a
//! hung LIST or watch start, a refused LIST). Included by path where needed
//! (`#[path = "../tests/common/fake_kube.rs"] mod fake_kube;`).

// Test helpers: a failed setup should fail loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::response::Response;
use axum::routing::get;
use futures::StreamExt;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::broadcast;

#[derive(Clone, Debug)]
pub struct Ev {
    rv: u64,
    resource: &'static str,
    kind: &'static str,
    object: Value,
}

#[derive(Default)]
pub struct Store {
    rv: u64,
    objects: HashMap<(&'static str, String), Value>,
    history: Vec<Ev>,
}

#[derive(Clone)]
pub struct FakeApi {
    pub store: Arc<Mutex<Store>>,
    pub events: broadcast::Sender<Ev>,
    /// The next this many LISTs (watch starts) are accepted and never answered.
    pub hang_lists: Arc<AtomicUsize>,
    pub hang_watches: Arc<AtomicUsize>,
    /// Requests left hanging so far.
    pub hung: Arc<AtomicUsize>,
    /// When not 0, every LIST is refused with this status (403: RBAC missing).
    pub list_status: Arc<AtomicU16>,
    /// LISTs asked for so far.
    pub lists: Arc<AtomicUsize>,
}

impl FakeApi {
    pub fn new() -> FakeApi {
        FakeApi {
            store: Arc::default(),
            events: broadcast::channel(16384).0,
            hang_lists: Arc::default(),
            hang_watches: Arc::default(),
            hung: Arc::default(),
            list_status: Arc::default(),
            lists: Arc::default(),
        }
    }

    /// Never returns when the request is one of those to leave hanging.
    pub async fn maybe_hang(&self, q: &HashMap<String, String>) {
        let counter = if q.get("watch").map(String::as_str) == Some("true") {
            &self.hang_watches
        } else {
            &self.hang_lists
        };
        let take = counter.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        if take.is_ok() {
            self.hung.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<()>().await;
        }
    }

    /// Creates or replaces an object, stamping a new resourceVersion.
    pub fn put(&self, resource: &'static str, mut object: Value) {
        let mut s = self.store.lock().unwrap();
        s.rv += 1;
        object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        let kind = if s.objects.insert((resource, name), object.clone()).is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        let ev = Ev {
            rv: s.rv,
            resource,
            kind,
            object,
        };
        s.history.push(ev.clone());
        let _ = self.events.send(ev);
    }

    pub fn delete(&self, resource: &'static str, name: &str) {
        let mut s = self.store.lock().unwrap();
        s.rv += 1;
        let Some(mut object) = s.objects.remove(&(resource, name.to_string())) else {
            return;
        };
        object["metadata"]["resourceVersion"] = json!(s.rv.to_string());
        let ev = Ev {
            rv: s.rv,
            resource,
            kind: "DELETED",
            object,
        };
        s.history.push(ev.clone());
        let _ = self.events.send(ev);
    }

    pub async fn serve(&self) -> std::net::SocketAddr {
        let router = axum::Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(handle_pods))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
                get(handle_pools),
            )
            .with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        addr
    }
}

/// Equality-based label selectors (`a=b,c=d`) and `metadata.name=` field selectors.
fn matches(obj: &Value, q: &HashMap<String, String>) -> bool {
    if let Some(sel) = q.get("labelSelector").filter(|s| !s.is_empty()) {
        for part in sel.split(',') {
            let (k, v) = part.split_once('=').unwrap();
            if obj["metadata"]["labels"][k].as_str() != Some(v) {
                return false;
            }
        }
    }
    if let Some(sel) = q.get("fieldSelector").filter(|s| !s.is_empty()) {
        let name = sel.strip_prefix("metadata.name=").unwrap();
        if obj["metadata"]["name"].as_str() != Some(name) {
            return false;
        }
    }
    true
}

async fn handle_pods(
    s: State<FakeApi>,
    _ns: Path<String>,
    q: Query<HashMap<String, String>>,
) -> Response {
    s.0.maybe_hang(&q.0).await;
    if q.0.get("watch").map(String::as_str) != Some("true") {
        s.0.lists.fetch_add(1, Ordering::SeqCst);
        let code = s.0.list_status.load(Ordering::SeqCst);
        if code != 0 {
            let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                "status": "Failure", "message": "refused by the fake", "reason": "Forbidden", "code": code});
            return Response::builder()
                .status(code)
                .header("content-type", "application/json")
                .body(Body::from(status.to_string()))
                .unwrap();
        }
    }
    respond(s.0, "pods", "PodList", "v1", q.0)
}

async fn handle_pools(
    s: State<FakeApi>,
    _ns: Path<String>,
    q: Query<HashMap<String, String>>,
) -> Response {
    s.0.maybe_hang(&q.0).await;
    respond(
        s.0,
        "inferencepools",
        "InferencePoolList",
        "inference.networking.k8s.io/v1",
        q.0,
    )
}

fn respond(
    api: FakeApi,
    resource: &'static str,
    list_kind: &str,
    api_version: &str,
    q: HashMap<String, String>,
) -> Response {
    if q.get("watch").map(String::as_str) != Some("true") {
        let s = api.store.lock().unwrap();
        let mut items: Vec<&Value> = s
            .objects
            .iter()
            .filter(|((r, _), o)| *r == resource && matches(o, &q))
            .map(|(_, o)| o)
            .collect();
        items.sort_by_key(|o| o["metadata"]["name"].as_str().unwrap_or("").to_string());
        let body = json!({"apiVersion": api_version, "kind": list_kind,
            "metadata": {"resourceVersion": s.rv.to_string()}, "items": items});
        return Response::builder()
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
    }
    // Watch: replay history after the requested version, then follow live events, until the
    // watch's timeoutSeconds (as the API server does).
    let since: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (replay, rx) = {
        let s = api.store.lock().unwrap();
        let rx = api.events.subscribe();
        let replay: Vec<Ev> = s.history.iter().filter(|e| e.rv > since).cloned().collect();
        (replay, rx)
    };
    let last_replayed = replay.last().map_or(since, |e| e.rv);
    let live = tokio_stream_from(rx).filter(move |e| {
        let keep = e.rv > last_replayed;
        async move { keep }
    });
    let q2 = q.clone();
    let timeout: u64 = q
        .get("timeoutSeconds")
        .and_then(|v| v.parse().ok())
        .unwrap_or(3600);
    let lines = futures::stream::iter(replay)
        .chain(live)
        .take_until(tokio::time::sleep(Duration::from_secs(timeout)))
        .filter(move |e| {
            let keep = e.resource == resource && matches(&e.object, &q2);
            async move { keep }
        })
        .map(|e| {
            Ok::<_, std::io::Error>(format!("{}\n", json!({"type": e.kind, "object": e.object})))
        });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(lines))
        .unwrap()
}

fn tokio_stream_from(rx: broadcast::Receiver<Ev>) -> impl futures::Stream<Item = Ev> {
    futures::stream::unfold(rx, |mut rx| async move {
        loop {
            match rx.recv().await {
                Ok(e) => return Some((e, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    })
}

pub fn pod(name: &str, ip: &str, app: &str, ready: bool) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "uid": format!("uid-{name}"), "labels": {"app": app}},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}]}
    })
}
