//! Load harness: how much CPU does the aggregator need to scrape N pods every interval, and how
//! long does a pass over all of them take?
//!
//! ```text
//! cargo run --release -p sidecar-metrics --example scrape_load -- --pods 1000 --seconds 30
//! ```
//!
//! The harness re-runs itself as a child process (`--serve-fleet`) that answers on N loopback
//! ports with realistic vLLM V1 `/metrics` bodies (built from the real sample in
//! `testdata/metrics/`, ~10 KB by default, the whole 45 KB scrape with `--full`) whose values
//! change every 100 ms, plus an ingest endpoint that checks the token and validates every pushed
//! snapshot with `Snapshot::from_json`. The fleet's CPU is its own process's, so it is not
//! counted against the aggregator, which runs in this process exactly as the binary runs it
//! (`app::start`, same runtime size). After a warm-up, the harness reads this process's CPU time
//! from `/proc/self/stat` over the measurement window and collects every round's duration.
//! With `--tls` every pod serves HTTPS (the test certificate of `testdata/tls/`) and the
//! aggregator scrapes over TLS, checking it against the test authority.

use anyhow::{bail, Context, Result};
use gpuroute_core::snapshot::{Engine, Snapshot};
use sidecar_metrics::app::{self, RunOptions};
use sidecar_metrics::config::{Config, MetricsScheme, PodConfig, PoolConfig};
use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Read};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// mimalloc instead of glibc malloc: scraping allocates and frees a ~10 KB body per pod per
/// interval from two threads, where glibc's allocator showed up as ~15% of the aggregator's CPU.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const TOKEN: &str = "load-test-token";

#[path = "common/harness.rs"]
mod harness;
#[path = "../tests/common/tls_pod.rs"]
mod tls_pod;

const USAGE: &str = "usage: scrape_load [--pods N] [--seconds S] [--warmup S] [--interval-ms N] \
[--workers N] [--pools N] [--full] [--whole] [--engine vllm] [--tls]
  --full         serve the whole real 45 KB vLLM page (default: a ~10 KB one)
  --whole        the aggregator asks for everything (filter_metrics: false)
  --engine vllm  the pools configured as vLLM (default: detected from the metric names)
  --tls          the pods serve HTTPS, scraped over TLS (testdata/tls/ certificates)";

struct Opts {
    pods: usize,
    seconds: u64,
    warmup: u64,
    interval_ms: u64,
    workers: usize,
    pools: usize,
    full: bool,
    whole: bool,
    /// The pools' engine (`--engine vllm`, what the fake pods serve); detected from the metric
    /// names when not given.
    engine: Option<Engine>,
    tls: bool,
    serve_fleet: bool,
}

fn opts() -> Result<Opts> {
    let mut o = Opts {
        pods: 1000,
        seconds: 30,
        warmup: 3,
        interval_ms: 100,
        workers: 2,
        pools: 4,
        full: false,
        whole: false,
        engine: None,
        tls: false,
        serve_fleet: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| harness::number(&mut args, name);
        match a.as_str() {
            "--pods" => o.pods = num("--pods")? as usize,
            "--seconds" => o.seconds = num("--seconds")?,
            "--warmup" => o.warmup = num("--warmup")?,
            "--interval-ms" => o.interval_ms = num("--interval-ms")?,
            "--workers" => o.workers = num("--workers")? as usize,
            "--pools" => o.pools = (num("--pools")? as usize).max(1),
            "--full" => o.full = true,
            "--whole" => o.whole = true,
            // The fake pods serve vLLM's metrics: the one engine to configure.
            "--engine" => match args.next().as_deref() {
                Some("vllm") => o.engine = Some(Engine::Vllm),
                other => bail!("--engine {other:?}: the fake pods are vLLM's (--engine vllm)"),
            },
            "--tls" => o.tls = true,
            "--serve-fleet" => o.serve_fleet = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(o)
}

fn main() -> Result<()> {
    let o = opts()?;
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    if o.serve_fleet {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        return rt.block_on(fleet::serve(o.pods, o.full, o.tls));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(o.workers)
        .enable_all()
        .build()?;
    rt.block_on(measure(o))
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

async fn measure(o: Opts) -> Result<()> {
    let exe = std::env::current_exe()?;
    let mut args = vec![
        "--serve-fleet".to_string(),
        "--pods".into(),
        o.pods.to_string(),
    ];
    if o.full {
        args.push("--full".into());
    }
    if o.tls {
        args.push("--tls".into());
    }
    let mut child = Command::new(exe)
        .args(&args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the fake fleet")?;
    let child_pid = child.id().to_string();
    let mut stdout = BufReader::new(child.stdout.take().context("no stdout")?);
    let mut line = String::new();
    stdout.read_line(&mut line)?;
    let mut words = line.split_whitespace();
    if words.next() != Some("READY") {
        bail!("fleet did not start: {line:?}");
    }
    let ingest_port: u16 = words.next().context("no ingest port")?.parse()?;
    let ports: Vec<u16> = words.map(|w| w.parse()).collect::<Result<_, _>>()?;
    // The whole body, and the ones asked for only what is read (`filter_metrics`), for a
    // detected engine and for vLLM.
    let (whole_bytes, filtered_bytes): (usize, usize) = {
        let mut s = String::new();
        stdout.read_line(&mut s)?;
        let n: Vec<usize> = s
            .trim()
            .trim_start_matches("BODY ")
            .split(' ')
            .map(|x| x.parse().unwrap_or(0))
            .collect();
        let at = |i: usize| n.get(i).copied().unwrap_or(0);
        (at(0), at(if o.engine.is_some() { 2 } else { 1 }))
    };
    let body_bytes = if o.whole { whole_bytes } else { filtered_bytes };

    let mut cfg = Config {
        interval_ms: o.interval_ms,
        listen: "127.0.0.1:0".into(),
        worker_threads: o.workers,
        filter_metrics: !o.whole,
        ..Config::default()
    };
    cfg.push.urls = vec![format!(
        "http://127.0.0.1:{ingest_port}/gpuroute/v1/snapshot"
    )];
    cfg.push.token = Some(TOKEN.into());
    if o.tls {
        cfg.scrape_tls.ca_file = Some(tls_pod::file("ca.pem"));
    }
    let per_pool = ports.len().div_ceil(o.pools);
    for (i, chunk) in ports.chunks(per_pool.max(1)).enumerate() {
        cfg.pools.push(PoolConfig {
            name: format!("pool-{i}"),
            engine: o.engine,
            metrics_path: None,
            metrics_scheme: if o.tls {
                MetricsScheme::Https
            } else {
                MetricsScheme::Http
            },
            pods: Some(
                chunk
                    .iter()
                    .map(|p| PodConfig {
                        address: format!("127.0.0.1:{p}"),
                        engine: None,
                        metrics_url: None,
                        capacity: None,
                    })
                    .collect(),
            ),
            dns: None,
            kubernetes: None,
        });
    }
    let (obs_tx, mut obs_rx) = mpsc::unbounded_channel();
    let stop = CancellationToken::new();
    let running = app::start(
        cfg,
        RunOptions {
            round_observer: Some(obs_tx),
            ..RunOptions::default()
        },
        stop.clone(),
    )
    .await?;

    eprintln!(
        "fleet: {} pods{}, {body_bytes} bytes per /metrics body; aggregator: interval {} ms, {} worker threads; warm-up {} s, measuring {} s",
        ports.len(), if o.tls { " serving HTTPS" } else { "" }, o.interval_ms, o.workers, o.warmup, o.seconds
    );
    tokio::time::sleep(Duration::from_secs(o.warmup)).await;
    // The warm-up's first rounds open every connection (with --tls, one handshake per pod).
    let mut opening = Vec::new();
    while let Ok(r) = obs_rx.try_recv() {
        if opening.len() < 3 {
            opening.push(r);
        }
    }
    let cpu0 = harness::cpu_seconds("self")?;
    let fleet0 = harness::cpu_seconds(&child_pid).unwrap_or(0.0);
    let t0 = Instant::now();
    let mut rounds = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(o.seconds);
    loop {
        tokio::select! {
            r = obs_rx.recv() => match r { Some(r) => rounds.push(r), None => break },
            _ = tokio::time::sleep_until(deadline) => break,
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    let cpu = harness::cpu_seconds("self")? - cpu0;
    let fleet_cpu = harness::cpu_seconds(&child_pid).unwrap_or(0.0) - fleet0;

    let last = running.published.borrow().clone();
    let push = running.push[0].stats();
    running.shutdown();
    running.wait(Duration::from_secs(3)).await;
    drop(child.stdin.take());
    let _ = child.wait();

    let mut complete: Vec<Duration> = rounds
        .iter()
        .filter(|r| r.complete)
        .map(|r| r.duration)
        .collect();
    complete.sort();
    let mut all: Vec<Duration> = rounds.iter().map(|r| r.duration).collect();
    all.sort();
    let incomplete = rounds.len() - complete.len();
    let failed: usize = rounds.iter().map(|r| r.failed).sum();
    let launched: usize = rounds.iter().map(|r| r.launched).sum();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let mut out = String::new();
    let _ = writeln!(out, "pods                 {}", ports.len());
    let _ = writeln!(out, "interval             {} ms", o.interval_ms);
    let _ = writeln!(
        out,
        "metrics body         {body_bytes} bytes ({})",
        if o.whole {
            format!("whole; {filtered_bytes} asked for only what is read")
        } else {
            format!("asked for only what is read; {whole_bytes} whole")
        }
    );
    let _ = writeln!(
        out,
        "window               {wall:.1} s, {} rounds ({} expected)",
        rounds.len(),
        (wall * 1000.0 / o.interval_ms as f64).round()
    );
    let _ = writeln!(
        out,
        "scrapes              {launched} started, {failed} failed"
    );
    let _ = writeln!(
        out,
        "aggregator CPU       {:.1}% of one core ({cpu:.2} s CPU in {wall:.1} s)",
        cpu / wall * 100.0
    );
    let _ = writeln!(
        out,
        "fake fleet CPU       {:.1}% of one core (not counted above)",
        fleet_cpu / wall * 100.0
    );
    let _ = writeln!(
        out,
        "round duration       p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms (all rounds)",
        ms(pct(&all, 0.5)),
        ms(pct(&all, 0.9)),
        ms(pct(&all, 0.99)),
        ms(pct(&all, 1.0))
    );
    let _ = writeln!(
        out,
        "rounds incomplete    {incomplete} (published at the deadline)"
    );
    let _ = writeln!(
        out,
        "first rounds         {} (warm-up: every connection opened)",
        opening
            .iter()
            .map(|r| format!(
                "{:.1} ms{}",
                ms(r.duration),
                if r.complete { "" } else { " (at the deadline)" }
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if let Some(p) = last {
        let healthy: usize = p
            .snapshot
            .pools
            .iter()
            .map(|x| x.pods.iter().filter(|y| y.healthy).count())
            .sum();
        let _ = writeln!(out, "healthy pods (end)   {healthy}");
        let _ = writeln!(out, "snapshot size        {} bytes", p.json.len());
    }
    let _ = writeln!(
        out,
        "pushes accepted      {} (failures: {:?})",
        push.accepted, push.failures
    );
    print!("{out}");
    Ok(())
}

/// The fake fleet: N vLLM-like pods on loopback ports and an ingest endpoint.
mod fleet {
    use super::*;
    use axum::body::Bytes;
    use axum::extract::{RawQuery, State};
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::{get, post};

    /// What a template line's value is.
    #[derive(Clone, Copy)]
    enum Value {
        Fixed(f64),
        Running,
        Waiting,
        Kv,
        Queries,
        Hits,
        ItlSum,
        ItlCount,
        ItlBucket(f64),
        LoraTime,
    }

    struct Template {
        lines: Vec<(String, Value)>,
    }

    /// Families kept for the ~10 KB body: the ones the aggregator reads plus typical neighbours,
    /// as a real vLLM would serve them (HELP/TYPE lines, `_created` gauges, histograms).
    const KEEP: &[&str] = &[
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:inter_token_latency_seconds",
        "vllm:time_to_first_token_seconds",
        "vllm:cache_config_info",
    ];

    fn family(name: &str) -> &str {
        for suffix in ["_bucket", "_count", "_sum", "_created", "_total"] {
            if let Some(base) = name.strip_suffix(suffix) {
                return family(base);
            }
        }
        name
    }

    fn template(full: bool) -> Result<Template> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../testdata/metrics/vllm-v1-0.11-hardware-aware-router-idle.txt"
        );
        let text = std::fs::read_to_string(path)?;
        let mut lines = Vec::new();
        for l in text.lines() {
            let name_end = l.find(['{', ' ']).unwrap_or(l.len());
            let fam = if let Some(rest) = l.strip_prefix("# ") {
                rest.split_whitespace().nth(1).map(family).unwrap_or("")
            } else {
                family(&l[..name_end])
            };
            if !full && !KEEP.contains(&fam) {
                continue;
            }
            if l.starts_with('#') {
                lines.push((l.to_string(), Value::Fixed(f64::NAN)));
                continue;
            }
            let (head, val) = l.rsplit_once(' ').context("sample without value")?;
            let name = &l[..name_end];
            let v = match name {
                "vllm:num_requests_running" => Value::Running,
                "vllm:num_requests_waiting" => Value::Waiting,
                "vllm:kv_cache_usage_perc" => Value::Kv,
                "vllm:prefix_cache_queries_total" => Value::Queries,
                "vllm:prefix_cache_hits_total" => Value::Hits,
                "vllm:inter_token_latency_seconds_sum" => Value::ItlSum,
                "vllm:inter_token_latency_seconds_count" | "vllm:generation_tokens_total" => {
                    Value::ItlCount
                }
                "vllm:inter_token_latency_seconds_bucket" => {
                    let le = head
                        .split("le=\"")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .unwrap_or("+Inf");
                    Value::ItlBucket(if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        le.parse()?
                    })
                }
                _ => Value::Fixed(val.parse()?),
            };
            lines.push((head.to_string(), v));
        }
        lines.push((
            "# HELP vllm:lora_requests_info Running stats on lora requests.".into(),
            Value::Fixed(f64::NAN),
        ));
        lines.push((
            "# TYPE vllm:lora_requests_info gauge".into(),
            Value::Fixed(f64::NAN),
        ));
        lines.push((
            "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"sql-lora,chat-lora\",waiting_lora_adapters=\"\"}".into(),
            Value::LoraTime,
        ));
        Ok(Template { lines })
    }

    /// A cheap deterministic mix of pod index and time step.
    fn mix(a: u64, b: u64) -> u64 {
        let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        x ^= x >> 31;
        x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x ^ (x >> 29)
    }

    fn render(t: &Template, pod: u64, start: Instant) -> String {
        let step = start.elapsed().as_millis() as u64 / 100;
        // Half the pods are 3x slower per token, like the mixed-GPU scenario.
        let itl = if pod.is_multiple_of(2) { 0.010 } else { 0.030 };
        let tokens = (step * 100) as f64 / (itl * 100.0);
        let mut out = String::with_capacity(12 * 1024);
        for (head, v) in &t.lines {
            let value = match *v {
                Value::Fixed(x) if x.is_nan() => {
                    out.push_str(head);
                    out.push('\n');
                    continue;
                }
                Value::Fixed(x) => x,
                Value::Running => (mix(pod, step) % 32) as f64,
                Value::Waiting => (mix(pod, step + 7) % 6) as f64,
                Value::Kv => (mix(pod, step + 13) % 1000) as f64 / 1000.0,
                Value::Queries => (step * 512) as f64,
                Value::Hits => (step * (mix(pod, 1) % 512)) as f64,
                Value::ItlSum => tokens * itl,
                Value::ItlCount => tokens,
                Value::ItlBucket(le) => {
                    if le >= itl {
                        tokens
                    } else {
                        0.0
                    }
                }
                Value::LoraTime => 1.7e9 + step as f64 / 10.0,
            };
            let _ = writeln!(out, "{head} {value:?}");
        }
        out
    }

    /// The lines of `t` a prometheus_client registry restricted to `names` renders, so that a
    /// filtered page costs the fake pod what it costs prometheus_client: rendering what is
    /// asked for, not everything.
    fn restricted(t: &Template, names: &[String]) -> Template {
        let lines = t
            .lines
            .iter()
            .map(|(head, v)| (head.as_str(), (head.clone(), *v)));
        Template {
            lines: fleet_sim::metrics::restricted(lines, names),
        }
    }

    /// The names `filter_metrics` asks a pod of `engine` for.
    fn filter_names(engine: Option<Engine>) -> Vec<String> {
        fleet_sim::metrics::names_asked(Some(&sidecar_metrics::engine::filter_query(engine)))
    }

    struct Shared {
        template: Template,
        /// `template` restricted to [`filter_names`], for a detected engine and for vLLM.
        filtered: Vec<(Vec<String>, Template)>,
        start: Instant,
        accepted: AtomicU64,
    }

    pub async fn serve(pods: usize, full: bool, tls: bool) -> Result<()> {
        let acceptor = tls
            .then(|| tokio_rustls::TlsAcceptor::from(super::tls_pod::server_config("pod", false)));
        let template = template(full)?;
        let shared = Arc::new(Shared {
            filtered: [None, Some(Engine::Vllm)]
                .map(|e| {
                    let names = filter_names(e);
                    let t = restricted(&template, &names);
                    (names, t)
                })
                .into(),
            template,
            start: Instant::now(),
            accepted: AtomicU64::new(0),
        });
        let mut ports = Vec::with_capacity(pods);
        for i in 0..pods {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            ports.push(listener.local_addr()?.port());
            let s = shared.clone();
            let router = axum::Router::new()
                .route(
                    "/metrics",
                    get(
                        move |State(s): State<Arc<Shared>>, RawQuery(q): RawQuery| async move {
                            // `?name[]=...`: only those samples, as prometheus_client serves
                            // vLLM's metrics; the aggregator's names from a template of just
                            // those lines, any others cut from the whole page.
                            let names = fleet_sim::metrics::names_asked(q.as_deref());
                            if names.is_empty() {
                                render(&s.template, i as u64, s.start)
                            } else if let Some((_, t)) =
                                s.filtered.iter().find(|(n, _)| *n == names)
                            {
                                render(t, i as u64, s.start)
                            } else {
                                let page = render(&s.template, i as u64, s.start);
                                fleet_sim::metrics::restrict(&page, &names)
                            }
                        },
                    ),
                )
                .with_state(s);
            match acceptor.clone() {
                None => {
                    tokio::spawn(async move { axum::serve(listener, router).await });
                }
                Some(acceptor) => {
                    // The aggregator's own TLS listener (its peers'), with a fixed certificate.
                    tokio::spawn(sidecar_metrics::http::serve(
                        listener,
                        Some(sidecar_metrics::tls::fixed(acceptor)),
                        router,
                        CancellationToken::new(),
                        "fake pod's",
                    ));
                }
            }
        }
        let ingest = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let ingest_port = ingest.local_addr()?.port();
        let router = axum::Router::new()
            .route(
                "/gpuroute/v1/snapshot",
                post(
                    |State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes| async move {
                        let auth = headers.get("authorization").and_then(|v| v.to_str().ok());
                        if auth != Some(&format!("Bearer {TOKEN}")) {
                            return StatusCode::UNAUTHORIZED;
                        }
                        match Snapshot::from_json(&body, 16 << 20) {
                            Ok(_) => {
                                s.accepted.fetch_add(1, Ordering::Relaxed);
                                StatusCode::NO_CONTENT
                            }
                            Err(_) => StatusCode::BAD_REQUEST,
                        }
                    },
                ),
            )
            .with_state(shared.clone());
        tokio::spawn(async move { axum::serve(ingest, router).await });
        // The whole body, then the filtered one for each engine in `filtered`.
        let mut body = render(&shared.template, 0, shared.start).len().to_string();
        for (_, t) in &shared.filtered {
            write!(body, " {}", render(t, 0, shared.start).len())?;
        }
        println!(
            "READY {ingest_port} {}",
            ports
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        );
        println!("BODY {body}");
        // Serve until the parent closes our stdin (it exits or is done).
        tokio::task::spawn_blocking(|| {
            let mut sink = [0u8; 64];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
        })
        .await?;
        Ok(())
    }
}
