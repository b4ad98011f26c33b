//! The open-loop runner: sends every request of a workload at its scheduled time and
//! measures its stream.
//!
//! Open loop means a request leaves when the schedule says, whether or not earlier ones
//! have finished: each send is its own task, so a slow server cannot hold back later
//! sends (a closed loop would, and would hide exactly the tail latency the benchmark is
//! about). What the runner cannot hide is its own lateness: every record carries its
//! scheduled and actual send times, and the summary reports the lag.
//!
//! Request bodies (prompts up to tens of kB) are built on a blocking thread a bounded
//! number of requests ahead of the schedule, so building text never delays a send unless
//! the machine is out of CPU, and then the lag shows it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::results::{ErrorKind, RequestRecord};
use crate::sse::{parse_chunk, Event, SseParser};
use crate::workload::Workload;

/// The response header naming the pod that served a request (set by fleet-sim).
pub const SERVED_BY_HEADER: &str = "x-served-by";
/// The filter's decision breakdown (`debug_header: true` in its configuration).
pub const GATEWAY_DEBUG_HEADER: &str = "x-gateway-debug";

/// Settings of a run.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Base URL, e.g. `http://127.0.0.1:8080` (the request path is appended); several,
    /// comma-separated, take the requests in turn (gateway replicas behind a Service).
    pub target: String,
    /// Whole-request timeout, from send to the end of the stream.
    pub request_timeout: Duration,
    /// TCP connect timeout.
    pub connect_timeout: Duration,
    /// Delay between the start of [`run`] and the first scheduled time, so the body
    /// builder is ahead before the first send is due.
    pub start_delay: Duration,
    /// How many bodies may be built ahead of the schedule.
    pub lookahead: usize,
    /// Extra request headers.
    pub headers: Vec<(String, String)>,
    /// Longest wait for requests still running after the last scheduled send; those
    /// still running then are cut and counted as timeouts. `None`: only the per-request
    /// timeout bounds the run (a quick run may want a short drain instead).
    pub max_drain: Option<Duration>,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            target: "http://127.0.0.1:8080".into(),
            // long enough for the slowest configuration's queue to drain in a 40 s run,
            // short enough that a hung stream ends the run
            request_timeout: Duration::from_secs(120),
            connect_timeout: Duration::from_secs(5),
            start_delay: Duration::from_millis(200),
            lookahead: 256,
            headers: Vec::new(),
            max_drain: None,
        }
    }
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The HTTP client could not be built.
    #[error("cannot build HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// Builds the HTTP client: no proxy (targets are local), an unbounded pool of
/// keep-alive connections (an open loop opens as many as it has requests in flight),
/// Nagle off so small requests are not delayed.
pub fn build_client(cfg: &RunConfig) -> Result<reqwest::Client, RunError> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(usize::MAX)
        .pool_idle_timeout(Duration::from_secs(90))
        .tcp_nodelay(true)
        .connect_timeout(cfg.connect_timeout)
        .build()?)
}

/// What a run returns.
#[derive(Debug, Clone)]
pub struct RunOutput {
    /// One record per request, in workload order.
    pub records: Vec<RequestRecord>,
    /// Most requests in flight at once.
    pub max_in_flight: u64,
    /// Unix time (ms) of the first scheduled time.
    pub started_unix_ms: u64,
}

/// Counts requests in flight and remembers the maximum.
#[derive(Default)]
struct InFlight {
    now: AtomicU64,
    max: AtomicU64,
}

impl InFlight {
    fn enter(&self) {
        let n = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        self.max.fetch_max(n, Ordering::Relaxed);
    }
    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A request whose body is built.
struct Prepared {
    index: usize,
    at: Duration,
    path: &'static str,
    model: String,
    prompt_chars: usize,
    max_tokens: u64,
    body: Vec<u8>,
}

/// Replays the workload open-loop against `cfg.target` and returns every request's record.
pub async fn run(workload: Arc<Workload>, client: reqwest::Client, cfg: &RunConfig) -> RunOutput {
    let (tx, mut rx) = mpsc::channel::<Prepared>(cfg.lookahead.max(1));
    let wl = Arc::clone(&workload);
    let builder = tokio::task::spawn_blocking(move || {
        for (index, r) in wl.requests.iter().enumerate() {
            let p = Prepared {
                index,
                at: Duration::from_secs_f64(r.at_s.max(0.0)),
                path: r.api.path(),
                model: r.model.clone(),
                prompt_chars: r.prompt.chars(),
                max_tokens: r.max_tokens,
                body: r.body(),
            };
            if tx.blocking_send(p).is_err() {
                break;
            }
        }
    });

    let t0 = Instant::now() + cfg.start_delay;
    let started_unix_ms = SystemTime::now()
        .checked_add(cfg.start_delay)
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    let bases: Vec<String> = cfg
        .target
        .split(',')
        .map(|t| t.trim().trim_end_matches('/').to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let last_at = workload.requests.last().map_or(0.0, |r| r.at_s.max(0.0));
    let run_deadline = cfg
        .max_drain
        .map(|d| t0 + Duration::from_secs_f64(last_at) + d);
    let in_flight = Arc::new(InFlight::default());
    let mut tasks = tokio::task::JoinSet::new();
    while let Some(p) = rx.recv().await {
        let due = t0 + p.at;
        tokio::time::sleep_until(due).await;
        let client = client.clone();
        let base = bases
            .get(p.index % bases.len().max(1))
            .map_or("", String::as_str);
        let url = format!("{base}{}", p.path);
        let in_flight = Arc::clone(&in_flight);
        let timeout = cfg.request_timeout;
        let headers = cfg.headers.clone();
        tasks.spawn(async move {
            in_flight.enter();
            let rec = execute(&client, &url, &headers, p, due, t0, timeout, run_deadline).await;
            in_flight.leave();
            rec
        });
    }
    // the builder has sent everything once the channel closes; its result is only a join
    let _ = builder.await;

    let mut records = Vec::with_capacity(workload.requests.len());
    while let Some(joined) = tasks.join_next().await {
        // a request task cannot panic (no unwraps); a join error would mean it did, and
        // the record is then missing from the count, which the summary shows
        if let Ok(rec) = joined {
            records.push(rec);
        }
    }
    records.sort_by_key(|r| r.id);
    RunOutput {
        records,
        max_in_flight: in_flight.max.load(Ordering::Relaxed),
        started_unix_ms,
    }
}

/// What has been seen of a response so far (kept outside the timed future, so a timeout
/// still reports the TTFT it had).
#[derive(Default)]
struct Progress {
    status: Option<u16>,
    headers_at: Option<Instant>,
    first_content_at: Option<Instant>,
    end_at: Option<Instant>,
    content_chunks: u64,
    usage_tokens: Option<u64>,
    done: bool,
    served_by: Option<String>,
    gateway_debug: Option<String>,
}

type Failure = (ErrorKind, String);

/// Longest error-response body kept in a record.
const MAX_ERROR_DETAIL: usize = 300;

fn ms_between(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1000.0
}

#[allow(clippy::too_many_arguments)] // one call site; a struct would only rename them
async fn execute(
    client: &reqwest::Client,
    url: &str,
    headers: &[(String, String)],
    p: Prepared,
    due: Instant,
    t0: Instant,
    timeout: Duration,
    run_deadline: Option<Instant>,
) -> RequestRecord {
    let sent = Instant::now();
    let own_deadline = sent + timeout;
    let (deadline, cut) = match run_deadline {
        Some(d) if d < own_deadline => (d, true),
        _ => (own_deadline, false),
    };
    let mut progress = Progress::default();
    let outcome = tokio::time::timeout_at(
        deadline,
        stream_request(client, url, headers, p.body, &mut progress),
    )
    .await;
    let failure = match outcome {
        Err(_) if cut => Some((
            ErrorKind::Timeout,
            "still running at the end of the run's drain time: cut".to_string(),
        )),
        Err(_) => Some((
            ErrorKind::Timeout,
            format!("no end of stream within {timeout:?}"),
        )),
        Ok(Err(f)) => Some(f),
        Ok(Ok(())) => None,
    };
    let ok = failure.is_none();
    let output_tokens = progress.usage_tokens.unwrap_or(progress.content_chunks);
    let (error, error_detail) = match failure {
        Some((k, d)) => (Some(k), Some(d)),
        None => (None, None),
    };
    RequestRecord {
        id: p.index,
        model: p.model,
        prompt_chars: p.prompt_chars,
        max_tokens: p.max_tokens,
        scheduled_ms: ms_between(t0, due),
        sent_ms: ms_between(t0, sent),
        status: progress.status,
        error,
        error_detail,
        headers_ms: progress.headers_at.map(|t| ms_between(sent, t)),
        ttft_ms: progress.first_content_at.map(|t| ms_between(sent, t)),
        e2e_ms: if ok {
            progress.end_at.map(|t| ms_between(sent, t))
        } else {
            None
        },
        output_tokens,
        usage_reported: progress.usage_tokens.is_some(),
        served_by: progress.served_by,
        gateway_debug: progress.gateway_debug,
    }
}

fn classify(e: &reqwest::Error) -> Failure {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else {
        ErrorKind::Connection
    };
    // the source chain says what actually failed (refused, reset, ...)
    let mut detail = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        detail.push_str(": ");
        detail.push_str(&s.to_string());
        src = s.source();
    }
    (kind, detail)
}

async fn stream_request(
    client: &reqwest::Client,
    url: &str,
    headers: &[(String, String)],
    body: Vec<u8>,
    p: &mut Progress,
) -> Result<(), Failure> {
    let mut req = client
        .post(url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(reqwest::header::ACCEPT, "text/event-stream")
        .body(body);
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let mut resp = req.send().await.map_err(|e| classify(&e))?;
    p.headers_at = Some(Instant::now());
    p.status = Some(resp.status().as_u16());
    p.served_by = resp
        .headers()
        .get(SERVED_BY_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    p.gateway_debug = resp
        .headers()
        .get(GATEWAY_DEBUG_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let mut detail = format!("{status}: {text}");
        if detail.len() > MAX_ERROR_DETAIL {
            let mut cut = MAX_ERROR_DETAIL;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
        }
        return Err((ErrorKind::HttpStatus, detail));
    }
    let mut parser = SseParser::new();
    while let Some(bytes) = resp.chunk().await.map_err(|e| classify(&e))? {
        let events = parser
            .feed(&bytes)
            .map_err(|e| (ErrorKind::BadStream, e.to_string()))?;
        for data in events {
            match parse_chunk(&data) {
                Ok(Event::Done) => {
                    p.done = true;
                    p.end_at.get_or_insert_with(Instant::now);
                }
                Ok(Event::Chunk(c)) => {
                    if let Some(err) = c.error {
                        return Err((ErrorKind::BadStream, format!("error event: {err}")));
                    }
                    if c.has_content {
                        p.first_content_at.get_or_insert_with(Instant::now);
                        p.content_chunks += 1;
                    }
                    if let Some(t) = c.completion_tokens {
                        p.usage_tokens = Some(t);
                    }
                }
                Err(e) => return Err((ErrorKind::BadStream, format!("bad chunk: {e}"))),
            }
        }
    }
    p.end_at.get_or_insert_with(Instant::now);
    if !p.done {
        return Err((ErrorKind::BadStream, "stream ended without [DONE]".into()));
    }
    if p.first_content_at.is_none() {
        return Err((ErrorKind::BadStream, "stream had no content".into()));
    }
    Ok(())
}
