//! A trivial OpenAI-compatible streaming server with known timings.
//!
//! It is not a model server simulator (that is fleet-sim): it answers every request with
//! a stream whose first content chunk leaves after a fixed delay and whose further tokens
//! follow at a fixed interval. Its uses: the load generator's tests (TTFT and open-loop
//! checks need a server whose timings are known), and measuring how much load the load
//! generator itself sustains (`sse-stub` binary), which tells what rates a benchmark on
//! this machine can trust.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use axum::Router;
use bytes::Bytes;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// How the stub answers.
#[derive(Debug, Clone)]
pub struct StubConfig {
    /// Names put in `x-served-by`, cycling per request (one pod per name).
    pub pod_names: Vec<String>,
    /// Delay from receiving the request to the first content chunk.
    pub first_token_delay: Duration,
    /// Delay between further tokens.
    pub token_interval: Duration,
    /// Most tokens generated, whatever `max_tokens` asks.
    pub max_tokens_cap: u64,
    /// Answer every request with this status instead of a stream.
    pub fail_status: Option<u16>,
    /// End streams without `[DONE]`.
    pub omit_done: bool,
}

impl Default for StubConfig {
    fn default() -> Self {
        Self {
            pod_names: vec!["stub-0".into()],
            first_token_delay: Duration::ZERO,
            token_interval: Duration::ZERO,
            max_tokens_cap: 16,
            fail_status: None,
            omit_done: false,
        }
    }
}

struct StubState {
    cfg: StubConfig,
    requests: AtomicU64,
    tokens: AtomicU64,
}

/// Binds `addr` (use `127.0.0.1:0` in tests) and serves in a background task; returns the
/// bound address.
pub async fn spawn(addr: &str, cfg: StubConfig) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        // the stub lives as long as the runtime; a serve error only ends the stub
        let _ = serve(listener, cfg).await;
    });
    Ok(local)
}

/// Serves on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, cfg: StubConfig) -> std::io::Result<()> {
    let state = Arc::new(StubState {
        cfg,
        requests: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
    });
    let app = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/metrics", get(metrics))
        .with_state(state);
    // Nagle on the server plus delayed ACKs on the client hold every small SSE chunk
    // that follows another for up to 40 ms: without this, TTFT would measure the kernel
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await
}

async fn chat(State(s): State<Arc<StubState>>, body: Bytes) -> Response {
    answer(s, body, true)
}

async fn completions(State(s): State<Arc<StubState>>, body: Bytes) -> Response {
    answer(s, body, false)
}

async fn metrics(State(s): State<Arc<StubState>>) -> String {
    format!(
        "# TYPE vllm:request_success counter\nvllm:request_success_total{{engine=\"0\",model_name=\"stub\",finished_reason=\"length\"}} {}\n\
         vllm:generation_tokens_total{{engine=\"0\",model_name=\"stub\"}} {}\n\
         fleet_sim:lora_adapter_loads_total 0\n",
        s.requests.load(Ordering::Relaxed),
        s.tokens.load(Ordering::Relaxed)
    )
}

fn answer(s: Arc<StubState>, body: Bytes, chat: bool) -> Response {
    let n = s.requests.fetch_add(1, Ordering::Relaxed);
    let pod = s
        .cfg
        .pod_names
        .get(n as usize % s.cfg.pod_names.len().max(1))
        .cloned()
        .unwrap_or_else(|| "stub".into());
    let served_by = HeaderValue::from_str(&pod).unwrap_or(HeaderValue::from_static("stub"));
    if let Some(code) = s.cfg.fail_status {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return (status, [("x-served-by", served_by)], "stub failure").into_response();
    }
    let req: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let max_tokens = req["max_tokens"]
        .as_u64()
        .unwrap_or(16)
        .clamp(1, s.cfg.max_tokens_cap.max(1));
    let (tx, rx) = mpsc::channel::<Result<Bytes, Infallible>>(8);
    let state = Arc::clone(&s);
    tokio::spawn(async move {
        tokio::time::sleep(state.cfg.first_token_delay).await;
        for i in 0..max_tokens {
            if i > 0 && !state.cfg.token_interval.is_zero() {
                tokio::time::sleep(state.cfg.token_interval).await;
            }
            let chunk = if chat {
                format!("data: {{\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i} \"}}}}]}}\n\n")
            } else {
                format!("data: {{\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"t{i} \"}}]}}\n\n")
            };
            if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                return;
            }
        }
        state.tokens.fetch_add(max_tokens, Ordering::Relaxed);
        let usage = format!(
            "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{max_tokens}}}}}\n\n"
        );
        let _ = tx.send(Ok(Bytes::from(usage))).await;
        if !state.cfg.omit_done {
            let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n"))).await;
        }
    });
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            ),
            (header::HeaderName::from_static("x-served-by"), served_by),
        ],
        Body::from_stream(ReceiverStream::new(rx)),
    )
        .into_response()
}
