//! `loadgen`: replays a workload open-loop against an OpenAI-compatible endpoint and
//! writes every request's record plus summaries to a results file.
//!
//! Typical use (one router configuration of a benchmark):
//! `loadgen --target http://127.0.0.1:8080 --workload mixed-gpu --pods-file ports.json
//!  --label filter --out target/bench/mixed-gpu/filter.json`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpuroute_bench::floor::references;
use gpuroute_bench::metrics::{scrape_all, MetricsDelta, PodsFile, DEFAULT_COUNTERS};
use gpuroute_bench::results::{LoadgenResults, RunInfo, Summary, RESULTS_VERSION};
use gpuroute_bench::runner::{build_client, run, RunConfig};
use gpuroute_bench::scenario::resolve_spec;
use gpuroute_bench::svg::fmt_ms;
use gpuroute_bench::workload::{Overrides, Workload};

/// Open-loop LLM load generator (streams every request; measures TTFT, latency, tokens).
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Base URL of the OpenAI-compatible endpoint (an Envoy, or any server); several,
    /// comma-separated, take the requests in turn (gateway replicas behind a Service).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    target: String,
    /// What to replay: a scenario name or file, a workload JSON file or inline JSON,
    /// a trace file (Azure CSV / Mooncake JSONL), or `poisson:rate=R,duration=D,...`.
    #[arg(long)]
    workload: String,
    /// Where to write results JSON (records + summary).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Seed (replaces the workload's).
    #[arg(long)]
    seed: Option<u64>,
    /// Trace replay speed (trace s per wall s); for Poisson, multiplies the rate.
    #[arg(long)]
    speedup: Option<f64>,
    /// Mean requests per wall second: a trace is replayed at the speed that gives its
    /// slice this mean rate (when --speedup is not given); a Poisson workload gets it.
    #[arg(long)]
    rate: Option<f64>,
    /// Sending duration in wall seconds.
    #[arg(long)]
    duration_s: Option<f64>,
    /// Prompt token scale.
    #[arg(long)]
    token_scale: Option<f64>,
    /// Request cap.
    #[arg(long)]
    max_requests: Option<usize>,
    /// Use the scenario's quick variant.
    #[arg(long)]
    quick: bool,
    /// Model name for a bare trace file or poisson: spec.
    #[arg(long)]
    model: Option<String>,
    /// fleet-sim ports file: pods' counters are scraped before and after the run.
    #[arg(long)]
    pods_file: Option<PathBuf>,
    /// The fleet's fleet-sim file: adds the workload's TTFT floor and greedy-oracle TTFT on
    /// that fleet to the results (computed before the run, not measured).
    #[arg(long)]
    fleet_file: Option<PathBuf>,
    /// Configuration label stored in the results (round_robin, least_request, filter).
    #[arg(long)]
    label: Option<String>,
    /// Per-request timeout (seconds, send to end of stream).
    #[arg(long, default_value_t = 120.0)]
    timeout_s: f64,
    /// Cut requests still running this many seconds after the last scheduled send
    /// (counted as timeouts); default: the scenario's quick `max_drain_s` with --quick,
    /// else wait up to --timeout-s for each.
    #[arg(long)]
    max_drain_s: Option<f64>,
    /// Extra request header `Name: value` (repeatable).
    #[arg(long = "header")]
    headers: Vec<String>,
    /// Build the workload, print what it is, send nothing.
    #[arg(long)]
    dry_run: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let resolved = resolve_spec(&args.workload, args.model.as_deref(), args.quick)?;
    let overrides = Overrides {
        seed: args.seed,
        speedup: args.speedup,
        duration_s: args.duration_s,
        token_scale: args.token_scale,
        max_requests: args.max_requests,
        rate_per_s: args.rate,
    };
    let config = resolved.config.with_overrides(&overrides);
    let workload = Workload::build(&config, resolved.base_dir.as_deref())
        .with_context(|| format!("building workload {}", args.workload))?;
    eprintln!("{}", serde_json::to_string_pretty(&workload.info)?);
    if args.dry_run {
        return Ok(());
    }
    if workload.requests.is_empty() {
        bail!("the workload has no requests");
    }
    let mut headers = Vec::new();
    for h in &args.headers {
        let (k, v) = h
            .split_once(':')
            .with_context(|| format!("header {h:?} is not `Name: value`"))?;
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let cfg = RunConfig {
        target: args.target.clone(),
        request_timeout: Duration::from_secs_f64(args.timeout_s.max(0.001)),
        headers,
        max_drain: args
            .max_drain_s
            .or_else(|| {
                resolved
                    .scenario
                    .as_ref()
                    .and_then(|s| s.max_drain_s(args.quick))
            })
            .map(|d| Duration::from_secs_f64(d.max(0.0))),
        ..RunConfig::default()
    };
    let references = match &args.fleet_file {
        Some(p) => {
            let fleet = std::fs::read_to_string(p)
                .with_context(|| format!("reading {}", p.display()))
                .and_then(|t| Ok(fleet_sim::FleetFile::parse(&t)?))
                .and_then(|f| Ok(f.resolve(fleet_sim::Overrides::default())?))
                .with_context(|| format!("fleet file {}", p.display()))?;
            references(&workload.requests, &fleet)
        }
        None => None,
    };
    let pods = match &args.pods_file {
        Some(p) => Some(PodsFile::load(p)?),
        None => None,
    };

    let rt = tokio::runtime::Runtime::new()?;
    let results = rt.block_on(async {
        let client = build_client(&cfg)?;
        let before = match &pods {
            Some(p) => Some(scrape_all(&client, &p.pods, DEFAULT_COUNTERS).await),
            None => None,
        };
        let workload = Arc::new(workload);
        let out = run(Arc::clone(&workload), client.clone(), &cfg).await;
        let metrics = match (&pods, before) {
            (Some(p), Some((before, mut errors))) => {
                let (after, after_errors) = scrape_all(&client, &p.pods, DEFAULT_COUNTERS).await;
                errors.extend(after_errors);
                Some(MetricsDelta::between(before, after, errors))
            }
            _ => None,
        };
        let summary = Summary::of(&out.records, out.max_in_flight);
        anyhow::Ok(LoadgenResults {
            version: RESULTS_VERSION,
            run: RunInfo {
                target: args.target.clone(),
                started_unix_ms: out.started_unix_ms,
                request_timeout_s: cfg.request_timeout.as_secs_f64(),
                label: args.label.clone(),
            },
            workload: workload.info.clone(),
            summary,
            metrics,
            references,
            records: out.records,
        })
    })?;

    let s = &results.summary;
    println!(
        "{}: {} requests, {} ok, {} errors {:?}",
        args.label.as_deref().unwrap_or("run"),
        s.requests,
        s.ok,
        s.errors,
        s.errors_by_kind
    );
    println!(
        "ttft p50 {} p90 {} p99 {} | e2e p50 {} p99 {} | {:.0} output tok/s | {:.1} req/s",
        fmt_ms(s.ttft_ms.p50),
        fmt_ms(s.ttft_ms.p90),
        fmt_ms(s.ttft_ms.p99),
        fmt_ms(s.e2e_ms.p50),
        fmt_ms(s.e2e_ms.p99),
        s.output_tokens_per_s,
        s.requests_per_s
    );
    println!(
        "send lag p50 {:.2} ms p99 {:.2} ms max {:.2} ms | max in flight {}",
        s.send_lag.p50_ms, s.send_lag.p99_ms, s.send_lag.max_ms, s.max_in_flight
    );
    if let Some(m) = &results.metrics {
        println!(
            "pods: prefix hit rate {} | adapter loads {}",
            m.prefix_hit_rate()
                .map_or_else(|| "-".into(), |h| format!("{:.1}%", h * 100.0)),
            m.adapter_loads()
                .map_or_else(|| "-".into(), |l| format!("{l:.0}"))
        );
        for e in &m.scrape_errors {
            eprintln!("warning: scrape failed: {e}");
        }
    }
    if let Some(out) = &args.out {
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(out, serde_json::to_vec(&results)?)
            .with_context(|| format!("writing {}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}
