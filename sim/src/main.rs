//! The `fleet-sim` binary: starts a simulated fleet from a fleet file or a preset, writes the
//! ports file, prints `fleet-sim ready: N pods` once every pod listens, and shuts down
//! gracefully on SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use fleet_sim::config::DEMO_ADMIN;
use fleet_sim::{Fleet, FleetFile, Overrides};

/// How long in-flight requests may run after SIGTERM before the process exits.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Simulated vLLM/SGLang GPU fleet.
#[derive(Debug, Parser)]
#[command(name = "fleet-sim", version, about)]
struct Args {
    /// Fleet file (JSON; see sim/README.md).
    #[arg(long, conflicts_with = "preset")]
    fleet: Option<PathBuf>,
    /// A built-in fleet instead of a file: `demo`.
    #[arg(long)]
    preset: Option<String>,
    /// Write every pod's address here (atomically) once all listen.
    #[arg(long)]
    ports_file: Option<PathBuf>,
    /// Simulated seconds per wall second (overrides the file).
    #[arg(long)]
    time_scale: Option<f64>,
    /// Seed of every random choice (overrides the file).
    #[arg(long)]
    seed: Option<u64>,
    /// Admin API address (default 127.0.0.1:0; the demo preset uses 127.0.0.1:18000).
    #[arg(long)]
    admin: Option<SocketAddr>,
    /// Every pod, and the admin API unless `--admin` is given, on an OS-chosen port instead of
    /// the fleet's own (a test running the demo preset beside other servers).
    #[arg(long)]
    any_ports: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let (file, default_admin) = match (&args.fleet, &args.preset) {
        (Some(path), _) => (FleetFile::load(path)?, "127.0.0.1:0"),
        (None, Some(name)) => (FleetFile::preset(name)?, DEMO_ADMIN),
        (None, None) => bail!("give --fleet FLEET.json or --preset demo"),
    };
    let mut cfg = file.resolve(Overrides {
        seed: args.seed,
        time_scale: args.time_scale,
    })?;
    let default_admin = if args.any_ports {
        for p in &mut cfg.pods {
            p.port = 0;
        }
        "127.0.0.1:0"
    } else {
        default_admin
    };
    let admin = match args.admin {
        Some(a) => a,
        None => default_admin.parse().context("admin address")?,
    };
    let n = cfg.pods.len();
    let time_scale = cfg.time_scale;
    let fleet = Fleet::start(cfg, admin).await?;
    if let Some(path) = &args.ports_file {
        fleet.write_ports_file(path)?;
    }
    for p in fleet.pods.iter() {
        tracing::info!(
            pod = %p.cfg.name, address = %p.addr, model = %p.cfg.model, gpu = %p.cfg.gpu_key,
            blocks = p.cfg.engine.num_gpu_blocks, "pod listening"
        );
    }
    tracing::info!(admin = %fleet.admin, time_scale, "admin API listening");
    println!("fleet-sim ready: {n} pods");
    wait_for_signal().await?;
    tracing::info!("shutting down");
    fleet.shutdown(SHUTDOWN_GRACE).await;
    Ok(())
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {}
        r = tokio::signal::ctrl_c() => r.context("waiting for Ctrl-C")?,
    }
    Ok(())
}
