//! `bench-scenario`: reads scenario files for the scripts that run the benchmark, so
//! they need no JSON tool: the fleet part for fleet-sim, the workload's description, its TTFT
//! floor, the list of scenarios.
//!
//! `bench-scenario fleet mixed-gpu > fleet.json`, `bench-scenario describe mixed-gpu --quick`,
//! `bench-scenario floor shared-prefix`, `bench-scenario list`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use gpuroute_bench::floor::{oracle_ttft_ms, present_percentiles, scenario_parts, ttft_floor_ms};
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
    /// List scenario names.
    List,
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
