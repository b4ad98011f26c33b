//! `bench-report`: turns each router configuration's `loadgen` results into the
//! benchmark's table, JSON (`<out-dir>/<scenario>.json`) and TTFT CDF chart.
//!
//! `bench-report --scenario mixed-gpu --result round_robin=rr.json
//!  --result least_request=lr.json --result filter=f.json --out-dir target/bench`

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpuroute_bench::floor::{floor_percentiles, oracle_ttft_ms, scenario_parts, ttft_floor_ms};
use gpuroute_bench::report::{
    build_report, render_figures, render_pod_share, render_table, write_outputs, ConfigRun,
    Quantiles, References,
};
use gpuroute_bench::results::LoadgenResults;
use gpuroute_bench::scenario::{scenario_candidates, Scenario};

/// Compare router configurations run on the same fleet with the same workload.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Scenario name (names the output files).
    #[arg(long)]
    scenario: String,
    /// Scenario file (fleet and targets); default: bench/scenarios/<scenario>.json if it exists.
    #[arg(long)]
    scenario_file: Option<PathBuf>,
    /// LABEL=results.json, one per configuration (round_robin, least_request, filter).
    #[arg(long = "result", required = true)]
    results: Vec<String>,
    /// Output directory.
    #[arg(long, default_value = "target/bench")]
    out_dir: PathBuf,
    /// The runs used the scenario's quick variant.
    #[arg(long)]
    quick: bool,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let scenario_path = args.scenario_file.clone().or_else(|| {
        scenario_candidates(&args.scenario)
            .into_iter()
            .find(|p| p.exists())
    });
    let scenario = match &scenario_path {
        Some(p) => Some(Scenario::load(p)?),
        None => None,
    };
    // The workload's TTFT floor and greedy-oracle TTFT on the scenario's fleet: rebuilt from
    // the scenario file, so only when the runs replayed that file's workload (checked against
    // their request count).
    let floors = match (&scenario, &scenario_path) {
        (Some(s), Some(p)) => match scenario_parts(s, p, args.quick) {
            Ok((workload, fleet)) => Some((
                ttft_floor_ms(&workload.requests, &fleet),
                oracle_ttft_ms(&workload.requests, &fleet),
            )),
            Err(e) => {
                eprintln!("warning: no TTFT floor: {e}");
                None
            }
        },
        _ => None,
    };
    let mut runs = Vec::new();
    for r in &args.results {
        let Some((label, path)) = r.split_once('=') else {
            bail!("--result {r:?} is not LABEL=FILE");
        };
        let bytes = std::fs::read(path).with_context(|| format!("reading {path}"))?;
        let results: LoadgenResults =
            serde_json::from_slice(&bytes).with_context(|| format!("parsing {path}"))?;
        runs.push(ConfigRun {
            label: label.to_string(),
            results,
        });
    }
    let replayed = runs.first().map(|r| r.results.workload.request_count);
    let refs = match floors {
        Some((f, o)) if Some(f.len()) == replayed => References {
            floor: floor_percentiles(&f).map(Quantiles::from),
            oracle: floor_percentiles(&o).map(Quantiles::from),
        },
        Some((f, _)) => {
            eprintln!(
                "warning: no TTFT floor: the scenario's workload has {} requests, the runs replayed {replayed:?}",
                f.len()
            );
            References::default()
        }
        None => References::default(),
    };
    let report = build_report(&args.scenario, &runs, scenario.as_ref(), args.quick, refs);
    println!("{}", render_table(&report));
    println!("requests per pod\n{}", render_pod_share(&report));
    if !report.figures.is_empty() {
        println!("figures\n{}", render_figures(&report));
    }
    for w in &report.setup.warnings {
        eprintln!("warning: {w}");
    }
    let (json, svg) = write_outputs(&report, &runs, &args.out_dir)?;
    println!("wrote {} and {}", json.display(), svg.display());
    Ok(())
}
