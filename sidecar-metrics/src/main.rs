//! `sidecar-metrics` command line: `run` (the aggregator) and `scrape-once` (what the
//! aggregator makes of one pod, to debug "why is this pod never picked").
//!
//! A thin shell over the library: parse flags, read and check the configuration (a bad one
//! exits non-zero naming the field), set up logging, raise the open-file limit, start, and stop
//! cleanly on SIGTERM/SIGINT.

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use gpuroute_core::snapshot::Engine;
use sidecar_metrics::app::{self, RunOptions};
use sidecar_metrics::config::{
    CapacityConfig, Config, HealthConfig, Overrides, RampConfig, DEFAULT_TIMEOUT_MS,
};
use sidecar_metrics::discovery::Target;
use sidecar_metrics::pod::PodState;
use sidecar_metrics::scrape::{self, HttpFetcher};
use std::path::PathBuf;
use std::time::Duration;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(
    name = "sidecar-metrics",
    version,
    about = "Scrapes model-server pods and pushes live GPU load to the gpuroute Envoy filter"
)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text, env = "GPUROUTE_LOG_FORMAT")]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Run the aggregator.
    Run(RunArgs),
    /// Scrape one pod and print what the aggregator makes of it.
    ScrapeOnce(ScrapeOnceArgs),
}

#[derive(Args)]
struct RunArgs {
    /// Configuration file (YAML or JSON).
    #[arg(long, short, env = "GPUROUTE_CONFIG")]
    config: Option<PathBuf>,
    /// Scrape interval in ms (overrides interval_ms).
    #[arg(long, env = "GPUROUTE_INTERVAL_MS")]
    interval_ms: Option<u64>,
    /// Per-pod scrape timeout in ms (overrides timeout_ms).
    #[arg(long, env = "GPUROUTE_TIMEOUT_MS")]
    timeout_ms: Option<u64>,
    /// Address of our own HTTP surface (overrides listen); 127.0.0.1:0 picks a free port.
    #[arg(long, env = "GPUROUTE_LISTEN")]
    listen: Option<String>,
    /// Ingest URL; repeat for several Envoys (replaces push.urls). The variable takes a comma-separated list.
    #[arg(
        long = "ingest-url",
        env = "GPUROUTE_INGEST_URL",
        value_delimiter = ','
    )]
    ingest_urls: Vec<String>,
    /// Ingest bearer token (overrides push.token).
    #[arg(long, env = "GPUROUTE_INGEST_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A static pool, NAME=ADDR,ADDR...; repeatable (replaces a file pool of the same name).
    /// The variable takes a ';'-separated list.
    #[arg(long = "pool", env = "GPUROUTE_POOLS", value_delimiter = ';')]
    pools: Vec<String>,
    /// Another gateway replica's sidecar-metrics (http://host:port) to exchange prefix records
    /// with; repeatable (replaces prefix.peers). The variable takes a comma-separated list.
    #[arg(
        long = "prefix-peer",
        env = "GPUROUTE_PREFIX_PEERS",
        value_delimiter = ','
    )]
    prefix_peers: Vec<String>,
}

#[derive(Args)]
struct ScrapeOnceArgs {
    /// Metrics URL of the pod, e.g. http://10.0.0.7:8000/metrics.
    url: String,
    /// Engine to read it as (default: detect from the metric names).
    #[arg(long, value_parser = parse_engine)]
    engine: Option<Engine>,
    /// Timeout of each scrape, ms.
    #[arg(long, default_value_t = DEFAULT_TIMEOUT_MS)]
    timeout_ms: u64,
    /// Scrape a second time this many ms later to show the rates (prefix-cache hit rate,
    /// inter-token latency); 0 scrapes once.
    #[arg(long, default_value_t = 1000)]
    delta_ms: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Ask for the whole exposition, not only the metrics the aggregator reads (the
    /// aggregator's `filter_metrics: false`).
    #[arg(long)]
    whole: bool,
    /// The aggregator's configuration file: an `https://` URL is scraped with its `scrape_tls`
    /// (without it, against the system's certificate authorities).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
}

fn parse_engine(s: &str) -> Result<Engine, String> {
    serde_json::from_value(serde_json::Value::String(s.to_lowercase()))
        .map_err(|_| format!("unknown engine {s:?} (vllm, sglang, trtllm, triton, tgi)"))
}

/// `RUST_LOG` (default `info`), with kube-rs's own lines held back unless `RUST_LOG` names
/// kube-rs: its watcher logs a warning for every refused request of a watch (a 403 on every
/// retry), and its client an error for every failed request, with the outer message only
/// ("client error (SendRequest)" for a timeout). Discovery logs each failure itself, with its
/// causes, at most once per 30 s with a count of those held back.
fn log_filter(rust_log: Option<&str>) -> tracing_subscriber::EnvFilter {
    let mut filter = rust_log
        .and_then(|s| tracing_subscriber::EnvFilter::try_new(s).ok())
        .unwrap_or_else(|| tracing_subscriber::EnvFilter::new("info"));
    if rust_log.is_some_and(|s| s.contains("kube")) {
        return filter;
    }
    for d in [
        "kube_runtime::watcher=error",
        "kube_client::client::builder=off",
    ] {
        if let Ok(d) = d.parse() {
            filter = filter.add_directive(d);
        }
    }
    filter
}

fn init_logging(format: LogFormat) {
    let filter = log_filter(std::env::var("RUST_LOG").ok().as_deref());
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes would break the harnesses that read the listen address from the log.
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// mimalloc instead of glibc malloc: scraping allocates and frees a ~10 KB body per pod per
/// interval from two threads, where glibc's allocator showed up as ~15% of the aggregator's CPU.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit status for a configuration that cannot be used (distinct from runtime failures).
const EXIT_BAD_CONFIG: i32 = 2;

fn main() {
    let cli = Cli::parse();
    init_logging(cli.log_format);
    // Print the error chain ourselves: anyhow's Debug output adds a backtrace when
    // RUST_BACKTRACE is set, which buries the one line an operator needs.
    if let Err(e) = real_main(cli) {
        eprintln!("sidecar-metrics: {e:#}");
        let code = if e.downcast_ref::<BadConfig>().is_some() {
            EXIT_BAD_CONFIG
        } else {
            1
        };
        std::process::exit(code);
    }
}

/// Marks configuration errors for the exit status.
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: {0}")]
struct BadConfig(String);

fn real_main(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(args) => run(args),
        Command::ScrapeOnce(args) => {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            rt.block_on(scrape_once(args))
        }
    }
}

fn load_config(args: RunArgs) -> Result<Config> {
    let mut cfg = match &args.config {
        Some(path) => Config::from_file(path)?,
        None => Config::default(),
    };
    cfg.apply(Overrides {
        interval_ms: args.interval_ms,
        timeout_ms: args.timeout_ms,
        listen: args.listen,
        ingest_urls: args.ingest_urls,
        token: args.token,
        pools: args.pools,
        prefix_peers: args.prefix_peers,
    })?;
    cfg.resolve_token()?;
    cfg.validate()?;
    Ok(cfg)
}

fn run(args: RunArgs) -> Result<()> {
    let cfg = load_config(args).map_err(|e| BadConfig(format!("{e:#}")))?;
    raise_fd_limit(&cfg);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cfg.worker_threads)
        .thread_name("sidecar-metrics")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let running = app::start(cfg, RunOptions::default(), shutdown.clone()).await?;
        wait_for_signal().await;
        tracing::info!("shutting down");
        running.shutdown();
        running.wait(Duration::from_secs(5)).await;
        Ok(())
    })
}

/// Each pod holds a keep-alive connection, and a fleet of 1,000 pods passes the common soft
/// limit of 1,024 open files: raise the soft limit to the hard one.
fn raise_fd_limit(cfg: &Config) {
    let static_pods: usize = cfg
        .pools
        .iter()
        .filter_map(|p| p.pods.as_ref())
        .map(Vec::len)
        .sum();
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => {
            tracing::debug!(limit, "open-file limit");
            if (limit as usize) < static_pods + 256 {
                tracing::warn!(
                    limit,
                    pods = static_pods,
                    "open-file limit is low for this many pods"
                );
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot raise the open-file limit"),
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// One scrape as the aggregator reads it, and the body's size.
async fn fetch_and_read(
    fetcher: &HttpFetcher,
    url: &http::Uri,
    engine: Option<Engine>,
    timeout: Duration,
) -> Result<(sidecar_metrics::engine::Reading, usize), scrape::ScrapeError> {
    let body = scrape::fetch_within(fetcher, url, timeout).await?;
    Ok((scrape::read_body(&body, engine, true)?, body.len()))
}

async fn scrape_once(args: ScrapeOnceArgs) -> Result<()> {
    let timeout = Duration::from_millis(args.timeout_ms);
    let url = url::Url::parse(&args.url).with_context(|| format!("{:?} is not a URL", args.url))?;
    let tls = if url.scheme() == "https" {
        let c = match &args.config {
            Some(path) => Config::from_file(path)?.scrape_tls,
            None => Default::default(),
        };
        Some(sidecar_metrics::tls::client_tls(&c, "scrape_tls")?)
    } else {
        None
    };
    let fetcher = HttpFetcher::with_tls(
        sidecar_metrics::config::DEFAULT_MAX_BODY_BYTES,
        tls.as_ref(),
    );
    // The snapshot needs ip:port; for a host name show the first address it resolves to.
    let host = url
        .host_str()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = url.port_or_known_default().unwrap_or(80);
    let address = tokio::net::lookup_host((host, port))
        .await
        .ok()
        .and_then(|mut a| a.next())
        .with_context(|| format!("cannot resolve {host}"))?;
    let target = Target {
        address,
        metrics_url: args.url.clone(),
        engine: args.engine,
        capacity: None,
        ready: true,
        name: None,
    };
    // As the aggregator scrapes: the filtered URL while the pod takes it.
    let mut pod = PodState::scraped(target, !args.whole);
    let cap = CapacityConfig {
        min_tokens: 1,
        ..CapacityConfig::default()
    };
    let started = Instant::now();
    let mut raw = Vec::new();
    let mut fetch_ms = Vec::new();
    let mut body_bytes = Vec::new();
    let scrapes = if args.delta_ms == 0 { 1 } else { 2 };
    for i in 0..scrapes {
        if i > 0 {
            tokio::time::sleep(Duration::from_millis(args.delta_ms)).await;
        }
        let begin = Instant::now();
        let (url, filtered) = pod.url.current()?;
        let got = match fetch_and_read(&fetcher, &url, args.engine, timeout).await {
            Err(e) if filtered && e.drops_filter() => {
                pod.url.drop_filter();
                fetch_and_read(&fetcher, &pod.url.current()?.0, args.engine, timeout).await
            }
            got => got,
        };
        match got {
            Ok((reading, bytes)) => {
                fetch_ms.push(begin.elapsed().as_secs_f64() * 1000.0);
                body_bytes.push(bytes);
                raw = reading.used.clone();
                let wall = sidecar_metrics::util::WallClock::system().ms_at(Instant::now());
                pod.on_success(reading, Instant::now(), wall, &cap);
            }
            Err(e) => {
                bail!("scrape of {} failed ({}): {e}\nA pod whose scrapes fail is unhealthy and never picked.", args.url, e.kind());
            }
        }
    }
    let health = HealthConfig {
        max_data_age_ms: u64::MAX / 2,
        ..HealthConfig::default()
    };
    let weight = pod.evaluate(Instant::now(), started, &health, &RampConfig::default());
    let snap = pod.snapshot(weight, 1.0);
    let detected = args.engine.is_none();
    if args.json {
        let out = serde_json::json!({
            "url": args.url,
            "filtered": pod.url.filtered(),
            "engine_detected": detected,
            "fetch_ms": fetch_ms,
            "body_bytes": body_bytes,
            "pod": snap,
            "itl_estimate_seconds": pod.itl_estimate,
            "raw": raw,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("url:     {}", args.url);
    println!(
        "engine:  {}{}",
        snap.engine.as_str(),
        if detected {
            " (detected from metric names)"
        } else {
            " (given)"
        }
    );
    println!(
        "fetch:   {} ({} bytes; {})",
        fetch_ms
            .iter()
            .map(|m| format!("{m:.1} ms"))
            .collect::<Vec<_>>()
            .join(", "),
        body_bytes
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join(", "),
        if pod.url.filtered() {
            "asked for only the metrics read"
        } else if args.whole {
            "asked for everything"
        } else {
            "the pod answered nothing when asked for only the metrics read: asked for everything"
        }
    );
    println!();
    println!(
        "As the filter would see this pod (capacity shown as 1.0: it is relative to the pool):"
    );
    println!("{}", serde_json::to_string_pretty(&snap)?);
    if scrapes == 2 {
        println!();
        println!(
            "Rates over {} ms: prefix-cache hit rate {}, mean inter-token latency {}",
            args.delta_ms,
            snap.prefix_cache_hit_rate.map_or(
                "none (no prefix-cache queries in the interval)".into(),
                |r| format!("{:.3}", r)
            ),
            pod.itl_estimate.map_or(
                "none (no tokens decoded in the interval)".into(),
                |s| format!("{:.2} ms", s * 1000.0)
            )
        );
    }
    println!();
    println!("Raw samples used ({}):", raw.len());
    for line in raw {
        println!("  {line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::log_filter;

    #[test]
    fn kube_runtime_watcher_warnings_are_held_back_unless_asked_for() {
        for env in [None, Some("info"), Some("debug"), Some("not a filter")] {
            let f = log_filter(env).to_string();
            assert!(f.contains("kube_runtime::watcher=error"), "{env:?}: {f}");
            assert!(
                f.contains("kube_client::client::builder=off"),
                "{env:?}: {f}"
            );
        }
        let f = log_filter(Some("info,kube_runtime=debug")).to_string();
        assert!(
            !f.contains("watcher=error") && !f.contains("builder=off"),
            "{f}"
        );
    }
}
