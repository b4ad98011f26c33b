//! `bench-scenario`: reads scenario files for the scripts that run the benchmark, so
//! they need no JSON tool: the fleet part for fleet-sim, the workload's description, its TTFT
//! floor, the list of scenarios.
//!
//! `bench-scenario fleet mixed-gpu > fleet.json`, `bench-scenario describe mixed-gpu --quick`,
//! `bench-scenario floor shared-prefix`, `bench-scenario list`, and the offline replay
//! (`bench-scenario replay mixed-gpu --configs filter,filter-h5 --filter-variant
//! 'h5={"scoring":{"prefix_home_score":0.5}}' --workloads 5`; see `gpuroute_bench::replay`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use fleet_sim::config::FleetConfig;
use gpuroute_bench::floor::{oracle_ttft_ms, present_percentiles, scenario_parts, ttft_floor_ms};
use gpuroute_bench::replay::{
    fleet_pools, replay, Gateways, Policy, ReplayOutcome, ReplaySettings,
};
use gpuroute_bench::report::Quantiles;
use gpuroute_bench::scenario::{scenario_candidates, Scenario, SCENARIO_DIR};
use gpuroute_bench::workload::Workload;

/// Scenario file helper.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print the scenario's fleet file (fleet-sim format).
    Fleet {
        /// Scenario name or file.
        scenario: String,
    },
    /// Build the workload and print its description (requests, rate, prefix reuse).
    Describe {
        /// Scenario name or file.
        scenario: String,
        /// The quick variant.
        #[arg(long)]
        quick: bool,
    },
    /// The workload's TTFT floor on the scenario's fleet (each request alone on an idle pod
    /// holding every prefix sent before it, the best any router could give it) and its TTFT
    /// under the greedy oracle router (each request to the pod where, on the engines' exact
    /// state, its first token comes soonest).
    Floor {
        /// Scenario name or file.
        scenario: String,
        /// The quick variant.
        #[arg(long)]
        quick: bool,
        /// Also list each request's floor (ms, workload order; null where none).
        #[arg(long)]
        per_request: bool,
    },
    /// Replay the workload offline: the filter's decision code (and the baselines) over
    /// fleet-sim's engines in simulated time, with the aggregator's own reading of their
    /// metrics; no Envoy, no wall clock, so a run is exactly reproducible and two routers are
    /// compared on the very same arrivals. Prints TTFT percentiles per router (mean over the
    /// runs), and each router against the first, paired run by run.
    Replay(Box<ReplayArgs>),
    /// List scenario names.
    List,
}

/// `bench-scenario replay`'s options.
#[derive(clap::Args, Debug)]
struct ReplayArgs {
    /// Scenario name or file.
    scenario: String,
    /// The quick variant.
    #[arg(long)]
    quick: bool,
    /// Routers, comma-separated: round_robin, least_request, filter, filter-NAME (the
    /// filter with --filter-variant NAME=JSON).
    #[arg(long, default_value = "round_robin,least_request,filter")]
    configs: String,
    /// NAME=JSON: top-level keys over the filter's configuration for filter-NAME (as
    /// `scripts/bench.py --filter-variant`).
    #[arg(long = "filter-variant", value_name = "NAME=JSON")]
    filter_variant: Vec<String>,
    /// Workloads to run each router on: the scenario's own, then others of its kind
    /// (Poisson: seeds 1, 2, ...; a trace: the windows after and before the scenario's,
    /// alternately).
    #[arg(long, default_value_t = 1)]
    workloads: u64,
    /// Seed of the routers' random choices.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The aggregator's scrape interval, ms (the benchmark's stack: 100).
    #[arg(long, default_value_t = 100)]
    interval_ms: u64,
    /// From a scrape to the filter holding its snapshot, ms.
    #[arg(long, default_value_t = 5)]
    lag_ms: u64,
    /// The proxy's mean delay each way, ms (a request reaches its pod after 0 to twice
    /// this, drawn per request; its first token is this much later at the client).
    #[arg(long, default_value_t = 0.0)]
    proxy_ms: f64,
    /// The filter as N workers of one Envoy: each request reaches one drawn at random;
    /// each learns the others' in-flight counts 2 ms and routing decisions 20 ms later.
    #[arg(long, conflicts_with = "replicas")]
    workers: Option<usize>,
    /// The filter as N gateway replicas: each request reaches one drawn at random; each
    /// learns the others' routing decisions 60 ms later and their requests in prefill 5 ms
    /// later (sidecar-metrics' relays).
    #[arg(long)]
    replicas: Option<usize>,
    /// With --workers or --replicas: the routing decisions' delay to the other engines, ms.
    #[arg(long, conflicts_with = "no_prefix_relay")]
    prefix_relay_ms: Option<u64>,
    /// With --workers or --replicas: no routing decisions pass between them.
    #[arg(long)]
    no_prefix_relay: bool,
    /// With --workers or --replicas: the in-flight counts' delay to the other engines, ms.
    #[arg(long, conflicts_with = "no_load_relay")]
    load_relay_ms: Option<u64>,
    /// With --workers or --replicas: no in-flight counts pass between them.
    #[arg(long)]
    no_load_relay: bool,
    /// Print JSON (every run, and with --per-request each request's TTFT and pod).
    #[arg(long)]
    json: bool,
    /// With --json: each request's TTFT and the pod index it went to.
    #[arg(long)]
    per_request: bool,
    /// Each pod's capacity, comma-separated in the fleet's pod order (`bench-scenario fleet
    /// S`), as `capacity` configured per pod in sidecar-metrics: the hardware known instead
    /// of estimated from the metrics (e.g. 2.7,2.7,1,1 for mixed-gpu's H100s and L40Ss).
    #[arg(long, value_delimiter = ',')]
    capacities: Option<Vec<f64>>,
    /// Print the filter's decision for requests FROM-TO (workload order, the indices of
    /// --per-request; or one request, N) on stderr: its score breakdown, and each pod's true
    /// state beside the snapshot and in-flight counts it decided on.
    #[arg(long, value_name = "FROM-TO")]
    explain: Option<String>,
}

/// The filter engines of `bench-scenario replay` from its options.
fn gateways(
    workers: Option<usize>,
    replicas: Option<usize>,
    prefix_relay_ms: Option<u64>,
    no_prefix_relay: bool,
    load_relay_ms: Option<u64>,
    no_load_relay: bool,
) -> Gateways {
    let mut g = match (workers, replicas) {
        (Some(n), _) => Gateways::workers(n),
        (None, Some(n)) => Gateways::replicas(n),
        (None, None) => Gateways::one(),
    };
    if prefix_relay_ms.is_some() {
        g.prefix_relay_ms = prefix_relay_ms;
    }
    if no_prefix_relay {
        g.prefix_relay_ms = None;
    }
    if load_relay_ms.is_some() {
        g.load_relay_ms = load_relay_ms;
    }
    if no_load_relay {
        g.load_relay_ms = None;
    }
    g
}

/// `, N engines, ...` for the replay's heading; empty for one engine.
fn describe_gateways(g: &Gateways) -> String {
    if g.engines <= 1 {
        return String::new();
    }
    let when = |ms: Option<u64>| match ms {
        Some(ms) => format!("{ms} ms later"),
        None => "never".to_string(),
    };
    format!(
        ", {} filter engines: each other's decisions {}, in-flight counts {}",
        g.engines,
        when(g.prefix_relay_ms),
        when(g.load_relay_ms)
    )
}

/// `--explain FROM-TO` (or one request, `N`): the requests' range, inclusive.
fn parse_range(s: &str) -> Result<(usize, usize)> {
    let (from, to) = s.split_once('-').unwrap_or((s, s));
    let (from, to) = (from.trim().parse()?, to.trim().parse()?);
    anyhow::ensure!(
        from <= to,
        "--explain {s}: the first request is after the last"
    );
    Ok((from, to))
}

/// A router of `bench-scenario replay --configs`.
fn policy(name: &str, variants: &[(String, serde_json::Value)]) -> Result<Policy> {
    Ok(match name {
        "round_robin" => Policy::RoundRobin,
        "least_request" => Policy::LeastRequest,
        "filter" => Policy::Filter(serde_json::json!({})),
        _ => {
            let v = name
                .strip_prefix("filter-")
                .and_then(|n| variants.iter().find(|(k, _)| k == n))
                .with_context(|| {
                    format!("router {name}: not round_robin, least_request, filter, or filter-NAME with --filter-variant NAME=JSON")
                })?;
            Policy::Filter(v.1.clone())
        }
    })
}

fn quantiles(o: &ReplayOutcome) -> Option<Quantiles> {
    present_percentiles(&o.ttft_ms).map(Quantiles::from)
}

fn outcome_json(o: &ReplayOutcome, fleet: &FleetConfig, per_request: bool) -> serde_json::Value {
    let mut v = serde_json::json!({
        "ttft_ms": quantiles(o),
        "routed": o.served_by.iter().flatten().count(),
        "routed_by_pool": served_by_pool(o, fleet),
        "fail_open": o.fail_open,
        "refused": o.refused,
        "overflowed": o.overflowed,
        "prefix_hit_rate": o.prefix_hit_rate(),
        "adapter_loads": o.adapter_loads,
    });
    if per_request {
        v["ttft_per_request_ms"] = serde_json::json!(o.ttft_ms);
        v["served_by"] = serde_json::json!(o.served_by);
    }
    v
}

/// Requests each of the fleet's pools served, by pool name, in the fleet's order
/// ([`fleet_pools`]).
fn served_by_pool(o: &ReplayOutcome, fleet: &FleetConfig) -> Vec<(String, u64)> {
    fleet_pools(fleet)
        .into_iter()
        .map(|(name, members)| {
            let n = o
                .served_by
                .iter()
                .flatten()
                .filter(|i| members.contains(i))
                .count();
            (name, n as u64)
        })
        .collect()
}

/// `mean (min-max)` of `xs`.
fn spread(xs: &[f64]) -> String {
    if xs.is_empty() {
        return "-".into();
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if xs.len() == 1 {
        format!("{mean:.3}")
    } else {
        format!("{mean:.3} ({min:.3}-{max:.3})")
    }
}

fn run_replay(a: &ReplayArgs) -> Result<()> {
    let mut settings = ReplaySettings {
        interval_ms: a.interval_ms.max(1),
        snapshot_lag_ms: a.lag_ms,
        seed: a.seed,
        proxy_ms: if a.proxy_ms.is_finite() {
            a.proxy_ms.max(0.0)
        } else {
            0.0
        },
        gateways: gateways(
            a.workers,
            a.replicas,
            a.prefix_relay_ms,
            a.no_prefix_relay,
            a.load_relay_ms,
            a.no_load_relay,
        ),
        capacities: a.capacities.clone(),
        explain: a.explain.as_deref().map(parse_range).transpose()?,
        pools: serde_json::Map::new(),
    };
    let ReplayArgs {
        scenario,
        configs,
        filter_variant,
        ..
    } = a;
    let (quick, json, per_request) = (a.quick, a.json, a.per_request);
    let workloads = a.workloads.max(1);
    let path = find(scenario)?;
    let s = Scenario::load(&path)?;
    settings.pools = s.pools.clone();
    let settings = &settings;
    let (own, fleet) = scenario_parts(&s, &path, quick).map_err(anyhow::Error::msg)?;
    let variants = filter_variant
        .iter()
        .map(|v| {
            let (name, body) = v
                .split_once('=')
                .with_context(|| format!("--filter-variant {v}: not NAME=JSON"))?;
            let value: serde_json::Value = serde_json::from_str(body)
                .with_context(|| format!("--filter-variant {name}: not JSON"))?;
            Ok((name.to_string(), value))
        })
        .collect::<Result<Vec<_>>>()?;
    let names: Vec<&str> = configs
        .split(',')
        .map(str::trim)
        .filter(|c| !c.is_empty())
        .collect();
    let policies = names
        .iter()
        .map(|n| policy(n, &variants))
        .collect::<Result<Vec<_>>>()?;
    anyhow::ensure!(!policies.is_empty(), "--configs names no router");
    // outcomes[config][workload]
    let mut outcomes: Vec<Vec<ReplayOutcome>> = vec![Vec::new(); policies.len()];
    let mut runs = Vec::new();
    let mut requests = Vec::new();
    // The scenario's workload, then others of its kind: k = 1, -1, 2, -2, ... (a trace's
    // windows after and before the scenario's), skipping those with no request.
    let mut k: i64 = 0;
    while (requests.len() as u64) < workloads {
        anyhow::ensure!(
            k.unsigned_abs() <= 4 * workloads + 4,
            "{}: only {} workloads with requests (a trace too short for more windows)",
            s.name,
            requests.len()
        );
        let w = k;
        k = if k > 0 { -k } else { 1 - k };
        let workload = if w == 0 {
            own.clone()
        } else {
            match s.workload_config(quick).other(w) {
                Some(cfg) => Workload::build(&cfg, path.parent())?,
                None => continue,
            }
        };
        if workload.requests.is_empty() {
            continue;
        }
        requests.push(workload.requests.len());
        for (c, p) in policies.iter().enumerate() {
            let o = replay(&workload.requests, &fleet, p, settings).map_err(anyhow::Error::msg)?;
            if json {
                let mut v = outcome_json(&o, &fleet, per_request);
                v["config"] = names[c].into();
                v["workload"] = w.into();
                v["requests"] = workload.requests.len().into();
                runs.push(v);
            }
            outcomes[c].push(o);
        }
    }
    if json {
        let out = serde_json::json!({
            "scenario": s.name,
            "quick": quick,
            "settings": {"interval_ms": settings.interval_ms, "lag_ms": settings.snapshot_lag_ms, "seed": settings.seed, "proxy_ms": settings.proxy_ms, "engines": settings.gateways.engines, "prefix_relay_ms": settings.gateways.prefix_relay_ms, "load_relay_ms": settings.gateways.load_relay_ms},
            "runs": runs,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
"scenario {} ({} workload{} of {} requests, scrape every {} ms, snapshot {} ms later, proxy {} ms, seed {}{})",
        s.name,
        workloads,
        if workloads == 1 { "" } else { "s" },
        requests
            .iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("/"),
        settings.interval_ms,
        settings.snapshot_lag_ms,
        settings.proxy_ms,
        settings.seed,
        describe_gateways(&settings.gateways)
    );
    println!(
        "{:<18} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9} {:>7} {:>9}",
        "router", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "mean ms", "prefix", "loads", "fail-open"
    );
    for (c, runs) in outcomes.iter().enumerate() {
        let qs: Vec<Quantiles> = runs.iter().filter_map(quantiles).collect();
        let avg = |f: fn(&Quantiles) -> f64| qs.iter().map(f).sum::<f64>() / qs.len().max(1) as f64;
        let hits: Vec<f64> = runs
            .iter()
            .filter_map(ReplayOutcome::prefix_hit_rate)
            .collect();
        let hit = if hits.is_empty() {
            "-".to_string()
        } else {
            format!(
                "{:.1}%",
                100.0 * hits.iter().sum::<f64>() / hits.len() as f64
            )
        };
        let n = runs.len().max(1) as f64;
        let loads = runs.iter().map(|o| o.adapter_loads as f64).sum::<f64>() / n;
        let fail_open = runs.iter().map(|o| o.fail_open as f64).sum::<f64>() / n;
        println!(
            "{:<18} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9} {:>7.1} {:>9.1}",
            names[c],
            avg(|q| q.p50),
            avg(|q| q.p90),
            avg(|q| q.p95),
            avg(|q| q.p99),
            avg(|q| q.mean),
            hit,
            loads,
            fail_open
        );
    }
    if fleet_pools(&fleet).len() > 1 {
        println!("\nrequests served per pool (over all workloads):");
        for (c, runs) in outcomes.iter().enumerate() {
            // Every run lists the same pools in the same order.
            let mut total: Vec<(String, u64)> = served_by_pool(&ReplayOutcome::default(), &fleet);
            for o in runs {
                for (t, (_, n)) in total.iter_mut().zip(served_by_pool(o, &fleet)) {
                    t.1 += n;
                }
            }
            let all = total.iter().map(|(_, n)| n).sum::<u64>().max(1) as f64;
            let shares: Vec<String> = total
                .iter()
                .map(|(p, n)| format!("{p} {n} ({:.1}%)", 100.0 * *n as f64 / all))
                .collect();
            let overflowed: u64 = runs.iter().map(|o| o.overflowed).sum();
            println!(
                "  {:<16} {}; overflowed {overflowed}",
                names[c],
                shares.join(", ")
            );
        }
    }
    if policies.len() > 1 {
        println!(
            "\npaired with {} on the same workloads (ratio; mean (min-max) over workloads):",
            names[0]
        );
        for c in 1..outcomes.len() {
            let mut mean = Vec::new();
            let mut p90 = Vec::new();
            let mut p99 = Vec::new();
            for (a, b) in outcomes[0].iter().zip(&outcomes[c]) {
                if let (Some(qa), Some(qb)) = (quantiles(a), quantiles(b)) {
                    mean.push(qb.mean / qa.mean);
                    p90.push(qb.p90 / qa.p90);
                    p99.push(qb.p99 / qa.p99);
                }
            }
            let lower = mean.iter().filter(|r| **r < 1.0).count();
            println!(
                "  {:<16} mean {}  p90 {}  p99 {}  (mean lower in {} of {})",
                names[c],
                spread(&mean),
                spread(&p90),
                spread(&p99),
                lower,
                mean.len()
            );
        }
    }
    Ok(())
}

fn find(spec: &str) -> Result<PathBuf> {
    let p = Path::new(spec);
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    scenario_candidates(spec)
        .into_iter()
        .find(|p| p.exists())
        .with_context(|| format!("no scenario {spec} (looked in {SCENARIO_DIR})"))
}

fn main() -> Result<()> {
    match Args::parse().cmd {
        Cmd::Fleet { scenario } => {
            let s = Scenario::load(&find(&scenario)?)?;
            println!("{}", serde_json::to_string_pretty(&s.fleet)?);
        }
        Cmd::Describe { scenario, quick } => {
            let path = find(&scenario)?;
            let s = Scenario::load(&path)?;
            let w = Workload::build(&s.workload_config(quick), path.parent())?;
            println!("{}", serde_json::to_string_pretty(&w.info)?);
        }
        Cmd::Floor {
            scenario,
            quick,
            per_request,
        } => {
            let path = find(&scenario)?;
            let s = Scenario::load(&path)?;
            let (workload, fleet) = scenario_parts(&s, &path, quick).map_err(anyhow::Error::msg)?;
            let floors = ttft_floor_ms(&workload.requests, &fleet);
            let oracle = oracle_ttft_ms(&workload.requests, &fleet);
            let mut out = serde_json::json!({
                "scenario": s.name,
                "requests": floors.len(),
                "with_floor": floors.iter().flatten().count(),
                "ttft_floor_ms": present_percentiles(&floors).map(Quantiles::from),
                "ttft_oracle_ms": present_percentiles(&oracle).map(Quantiles::from),
            });
            if per_request {
                out["floors_ms"] = serde_json::json!(floors);
                out["oracle_ms"] = serde_json::json!(oracle);
            }
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
        Cmd::Replay(args) => run_replay(&args)?,
        Cmd::List => {
            let dir = scenario_candidates("x")
                .into_iter()
                .filter_map(|p| p.parent().map(Path::to_path_buf))
                .find(|d| d.is_dir())
                .with_context(|| format!("no {SCENARIO_DIR} directory"))?;
            let mut names: Vec<String> = std::fs::read_dir(&dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .filter_map(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
                .collect();
            names.sort();
            for n in names {
                println!("{n}");
            }
        }
    }
    Ok(())
}
