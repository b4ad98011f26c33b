//! httpload: closed-loop HTTP/1.1 load for measuring what the filter costs inside Envoy
//! (`scripts/envoy_overhead.py`). Each `--addr` gets `--connections` keep-alive connections
//! that send the same pre-built request back to back; with several addresses they take turns in
//! short slots (`--slot-ms`) until each has been measured for `--duration-s`, so a slow spell of
//! a shared machine falls on all of them alike (see `gpuroute_bench::interleave`). Raw TCP with
//! a pre-built request keeps the client's own cost small and the same for every target.
//!
//! `--pid` (once per `--addr`, in the same order) adds each target process's CPU time per
//! request, counted over its own slots.
//!
//! Output: one JSON object on stdout, with one entry per address under `targets`.

use anyhow::{bail, Context, Result};
use clap::Parser;
use gpuroute_bench::interleave::{run, Plan, Target};
use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// host:port of a listener; repeat for several (they are measured interleaved).
    #[arg(long, required = true)]
    addr: Vec<String>,
    /// The process behind each --addr, in the same order (its CPU time per request is reported).
    #[arg(long)]
    pid: Vec<u32>,
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// File holding the request body (JSON).
    #[arg(long)]
    body_file: String,
    /// Keep-alive connections per address.
    #[arg(long, default_value_t = 1)]
    connections: usize,
    /// Measured seconds per address.
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Length of one address's turn when there are several, milliseconds.
    #[arg(long, default_value_t = 250.0)]
    slot_ms: f64,
    /// Requests before measuring starts, per connection (JIT, caches, connection setup).
    #[arg(long, default_value_t = 200)]
    warmup: usize,
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    if !a.pid.is_empty() && a.pid.len() != a.addr.len() {
        bail!(
            "--pid: give one per --addr ({} addresses, {} pids)",
            a.addr.len(),
            a.pid.len()
        );
    }
    if !(a.duration_s > 0.0 && a.slot_ms > 0.0) {
        bail!("--duration-s and --slot-ms must be positive");
    }
    let body = std::fs::read(&a.body_file).with_context(|| format!("reading {}", a.body_file))?;
    let targets = a
        .addr
        .iter()
        .enumerate()
        .map(|(i, addr)| Target {
            addr: addr.clone(),
            pid: a.pid.get(i).copied(),
        })
        .collect();
    let plan = Plan {
        targets,
        path: a.path,
        body,
        connections: a.connections,
        duration: Duration::from_secs_f64(a.duration_s),
        slot: Duration::from_secs_f64(a.slot_ms / 1e3),
        warmup: a.warmup,
    };
    println!("{}", serde_json::to_string(&run(&plan).await?)?);
    Ok(())
}
