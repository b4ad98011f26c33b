//! Local fakes shared by the integration tests: model-server pods and an Envoy ingest endpoint,
//! all on 127.0.0.1 with OS-assigned ports.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, dead_code)]

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use gpuroute_core::snapshot::Snapshot;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A vLLM-like pod whose body and answer delay can be changed while it runs.
#[derive(Clone)]
pub struct FakePod {
    pub addr: SocketAddr,
    state: Arc<Mutex<(String, Duration)>>,
}

impl FakePod {
    pub async fn start(body: &str) -> FakePod {
        let state = Arc::new(Mutex::new((body.to_string(), Duration::ZERO)));
        let s = state.clone();
        let router = axum::Router::new().route(
            "/metrics",
            get(move || {
                let s = s.clone();
                async move {
                    let (body, delay) = s.lock().unwrap().clone();
                    tokio::time::sleep(delay).await;
                    body
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await });
        FakePod { addr, state }
    }

    pub fn set_body(&self, body: &str) {
        self.state.lock().unwrap().0 = body.to_string();
    }

    pub fn set_delay(&self, d: Duration) {
        self.state.lock().unwrap().1 = d;
    }
}

/// vLLM V1 gauges with the given queue length.
pub fn vllm_body(waiting: u32) -> String {
    format!(
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{engine=\"0\",model_name=\"m\"}} {waiting}.0\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"m\"}} 3.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"m\"}} 0.25\n"
    )
}

/// The filter's ingest endpoint as the contract describes it.
#[derive(Clone)]
pub struct FakeIngest {
    pub token: String,
    pub received: Arc<Mutex<Vec<Snapshot>>>,
    pub delay: Arc<Mutex<Duration>>,
    pub in_flight: Arc<AtomicUsize>,
    pub max_in_flight: Arc<AtomicUsize>,
    pub unauthorized: Arc<AtomicU64>,
}

impl FakeIngest {
    pub fn new(token: &str) -> FakeIngest {
        FakeIngest {
            token: token.to_string(),
            received: Arc::default(),
            delay: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
            unauthorized: Arc::default(),
        }
    }

    /// Serves on `listener` until the runtime ends.
    pub fn serve(&self, listener: tokio::net::TcpListener) {
        let router = axum::Router::new()
            .route("/gpuroute/v1/snapshot", post(ingest))
            .with_state(self.clone());
        tokio::spawn(async move { axum::serve(listener, router).await });
    }

    pub fn versions(&self) -> Vec<u64> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.version)
            .collect()
    }
}

async fn ingest(State(s): State<FakeIngest>, headers: HeaderMap, body: Bytes) -> impl IntoResponse {
    let n = s.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    s.max_in_flight.fetch_max(n, Ordering::SeqCst);
    let delay = *s.delay.lock().unwrap();
    tokio::time::sleep(delay).await;
    s.in_flight.fetch_sub(1, Ordering::SeqCst);
    if headers.get("content-type").and_then(|v| v.to_str().ok()) != Some("application/json") {
        return (
            StatusCode::BAD_REQUEST,
            r#"{"error":{"message":"content-type"}}"#.to_string(),
        );
    }
    let expected = format!("Bearer {}", s.token);
    if headers.get("authorization").and_then(|v| v.to_str().ok()) != Some(expected.as_str()) {
        s.unauthorized.fetch_add(1, Ordering::SeqCst);
        return (StatusCode::UNAUTHORIZED, String::new());
    }
    match Snapshot::from_json(&body, 8 << 20) {
        Ok(snap) => {
            let mut r = s.received.lock().unwrap();
            if r.last().is_some_and(|last| last.version >= snap.version) {
                return (
                    StatusCode::BAD_REQUEST,
                    r#"{"error":{"message":"version not newer"}}"#.to_string(),
                );
            }
            r.push(snap);
            (StatusCode::NO_CONTENT, String::new())
        }
        Err(e) => (
            StatusCode::BAD_REQUEST,
            serde_json::json!({"error": {"message": e.to_string()}}).to_string(),
        ),
    }
}

/// Polls `f` every 10 ms until it is true or `limit` passes; returns whether it became true.
pub async fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < end {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    f()
}
