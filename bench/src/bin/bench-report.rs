//! `bench-report`: turns each router configuration's `loadgen` results into the
//! benchmark's table, JSON (`<out-dir>/<scenario>.json`) and TTFT CDF chart.
//!
//! `bench-report --scenario mixed-gpu --result round_robin=rr.json
//!  --result least_request=lr.json --result filter=f.json --out-dir target/bench`

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpuroute_bench::floor::{references, scenario_parts};
use gpuroute_bench::report::{
    build_report, render_figures, render_pod_share, render_table, write_outputs, ConfigRun,
    References,
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
    // The workload's TTFT floor and greedy-oracle TTFT on the fleet: from the runs (loadgen
    // computes them when given the fleet file), else rebuilt from the scenario file.
    let refs = match runs.iter().find_map(|r| r.results.references) {
        Some(t) => References::from(t),
        None => {
            let replayed = runs.first().map(|r| r.results.workload.request_count);
            match (&scenario, &scenario_path) {
                (Some(s), Some(p)) => scenario_references(s, p, args.quick, replayed),
                _ => References::default(),
            }
        }
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

/// The references rebuilt from the scenario file: only right when the runs replayed that file's
/// workload (checked by request count); a warning and none otherwise.
fn scenario_references(
    scenario: &Scenario,
    path: &Path,
    quick: bool,
    replayed: Option<usize>,
) -> References {
    match scenario_parts(scenario, path, quick) {
        Ok((w, _)) if Some(w.requests.len()) != replayed => {
            eprintln!(
                "warning: no TTFT floor: the scenario's workload has {} requests, the runs replayed {replayed:?}",
                w.requests.len()
            );
            References::default()
        }
        Ok((w, fleet)) => references(&w.requests, &fleet)
            .map(References::from)
            .unwrap_or_default(),
        Err(e) => {
            eprintln!("warning: no TTFT floor: {e}");
            References::default()
        }
    }
}
