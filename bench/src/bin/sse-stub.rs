//! `sse-stub`: a trivial OpenAI-compatible streaming server with fixed timings, for
//! measuring what the load generator sustains on a machine and for smoke-testing the
//! benchmark pipeline without a fleet. Not a model simulator (that is fleet-sim).

use std::time::Duration;

use anyhow::Result;
use clap::Parser;
use gpuroute_bench::stub::{serve, StubConfig};

/// Streaming stub server.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// Number of pod names to cycle through in x-served-by.
    #[arg(long, default_value_t = 1)]
    pods: usize,
    /// Delay to the first token (ms).
    #[arg(long, default_value_t = 0)]
    first_token_ms: u64,
    /// Delay between tokens (ms).
    #[arg(long, default_value_t = 0)]
    token_interval_ms: u64,
    /// Most tokens per response.
    #[arg(long, default_value_t = 16)]
    max_tokens: u64,
    /// Worker threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(t) = args.threads {
        rt.worker_threads(t.max(1));
    }
    rt.enable_all().build()?.block_on(async {
        let listener = tokio::net::TcpListener::bind(&args.listen).await?;
        println!("listening on {}", listener.local_addr()?);
        let cfg = StubConfig {
            pod_names: (0..args.pods.max(1)).map(|i| format!("stub-{i}")).collect(),
            first_token_delay: Duration::from_millis(args.first_token_ms),
            token_interval: Duration::from_millis(args.token_interval_ms),
            max_tokens_cap: args.max_tokens,
            ..StubConfig::default()
        };
        serve(listener, cfg).await?;
        anyhow::Ok(())
    })
}
