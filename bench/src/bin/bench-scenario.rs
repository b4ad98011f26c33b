//! `bench-scenario`: reads scenario files for the scripts that run the benchmark, so
//! they need no JSON tool: the fleet part for fleet-sim, the workload's description, the
//! list of scenarios.
//!
//! `bench-scenario fleet mixed-gpu > fleet.json`, `bench-scenario describe mixed-gpu --quick`,
//! `bench-scenario list`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
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
