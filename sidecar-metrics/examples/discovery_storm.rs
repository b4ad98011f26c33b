//! Kubernetes discovery under a storm: every pod of one pool turns NotReady at once (a node
//! pool drained, a bad rollout). How long until the aggregator holds the pool's final state,
//! how many lists were built to get there, and how much memory it took?
//!
//! ```text
//! cargo run --release -p sidecar-metrics --example discovery_storm -- --pods 10000
//! ```
//!
//! The harness re-runs itself as a child process (`--serve-api`): the fake API server of the
//! Kubernetes tests (`tests/common/fake_kube.rs`: LIST and watch of pods, as JSON lines), with N
//! ready pods. This process runs the real discovery (`discovery::kubernetes::run` through the
//! real kube-rs client and watcher) and takes each list from `discovery::channel` as the
//! aggregator's scrape loop does, `--busy-ms` apart (the loop's work between two lists). Once
//! the first list holds the N ready pods, it tells the child to make every pod NotReady: N watch
//! events of N pods each. It reports the time from that order to the list that shows them all
//! NotReady, the lists taken, this process's CPU time over the storm and its peak RSS
//! (`VmHWM`, before and after). The fake API server's own CPU and memory are the child's and
//! not counted.

// A harness: a failed setup should stop it loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use anyhow::{bail, Context, Result};
use sidecar_metrics::config::{KubernetesConfig, PoolConfig};
use sidecar_metrics::discovery::{self, kubernetes};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[path = "../tests/common/fake_kube.rs"]
mod fake_kube;
#[path = "common/harness.rs"]
mod harness;

const USAGE: &str = "discovery_storm [--pods N (10000, at most 16000: the fake API's event buffer)] [--busy-ms MS (0)] [--timeout-s S (600)]";

struct Opts {
    pods: usize,
    busy_ms: u64,
    timeout_s: u64,
    serve_api: bool,
}

fn opts() -> Result<Opts> {
    let mut o = Opts {
        pods: 10_000,
        busy_ms: 0,
        timeout_s: 600,
        serve_api: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| harness::number(&mut args, name);
        match a.as_str() {
            "--pods" => o.pods = (num("--pods")? as usize).clamp(1, 16_000),
            "--busy-ms" => o.busy_ms = num("--busy-ms")?,
            "--timeout-s" => o.timeout_s = num("--timeout-s")?,
            "--serve-api" => o.serve_api = true,
            "--help" | "-h" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    Ok(o)
}

/// Pod `i`'s address: distinct loopback IPs, as pod IPs are distinct.
fn ip(i: usize) -> String {
    format!("127.{}.{}.{}", 1 + i / 62_500, (i / 250) % 250, i % 250 + 1)
}

fn name(i: usize) -> String {
    format!("vllm-{i:05}")
}

fn main() -> Result<()> {
    let o = opts()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if o.serve_api {
        return rt.block_on(serve_api(o.pods));
    }
    rt.block_on(measure(o))
}

/// The child: the fake API server with `pods` ready pods; its address on stdout; on a line
/// `storm` from stdin, every pod NotReady, one event each; ends when stdin closes.
async fn serve_api(pods: usize) -> Result<()> {
    let api = fake_kube::FakeApi::new();
    for i in 0..pods {
        api.put("pods", fake_kube::pod(&name(i), &ip(i), "vllm", true));
    }
    let addr = api.serve().await;
    println!("{addr}");
    std::io::stdout().flush()?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    while let Some(line) = rx.recv().await {
        if line.trim() == "storm" {
            for i in 0..pods {
                api.put("pods", fake_kube::pod(&name(i), &ip(i), "vllm", false));
            }
        }
    }
    Ok(())
}

/// A field of `/proc/self/status` in kB (`VmHWM`: peak RSS).
fn status_kb(field: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field} in /proc/self/status"))?;
    line.split_whitespace()
        .nth(1)
        .context("no value")?
        .parse()
        .context("not a number")
}

async fn measure(o: Opts) -> Result<()> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["--serve-api", "--pods", &o.pods.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("cannot start the fake API server")?;
    let mut stdin = child.stdin.take().context("no stdin")?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("no stdout")?).read_line(&mut line)?;
    let addr: std::net::SocketAddr = line.trim().parse().context("the fake API's address")?;

    let cfg = kube::Config::new(format!("http://{addr}").parse()?);
    let client = kubernetes::ApiClient::new(cfg, kubernetes::READ_TIMEOUT)?;
    let k = KubernetesConfig {
        namespace: "llm".into(),
        selector: Some("app=vllm".into()),
        port: Some(8000),
        inference_pool: None,
    };
    let pool = PoolConfig {
        kubernetes: Some(k.clone()),
        ..PoolConfig::named("llama")
    };
    let (tx, mut rx) = discovery::channel();
    let stop = CancellationToken::new();
    tokio::spawn(kubernetes::run(0, pool, k, client, tx, stop.clone()));
    let deadline = Duration::from_secs(o.timeout_s);
    let started = Instant::now();
    let counts = |u: &discovery::Update| {
        (
            u.targets.len(),
            u.targets.iter().filter(|t| t.ready).count(),
        )
    };

    loop {
        let u = tokio::time::timeout(deadline, rx.recv())
            .await
            .context("no first list in time")?
            .context("discovery ended")?;
        if counts(&u) == (o.pods, o.pods) {
            break;
        }
    }
    let listed = started.elapsed();
    let rss_before = status_kb("VmHWM")?;
    let cpu_before = harness::cpu_seconds("self")?;

    writeln!(stdin, "storm")?;
    stdin.flush()?;
    let storm = Instant::now();
    let mut lists = 0usize;
    let mut first_list = None;
    loop {
        let u = tokio::time::timeout(deadline, rx.recv())
            .await
            .context("the storm did not settle in time")?
            .context("discovery ended")?;
        lists += 1;
        first_list.get_or_insert_with(|| storm.elapsed());
        let (n, ready) = counts(&u);
        if n != o.pods {
            bail!("a list of {n} pods, not {}", o.pods);
        }
        if ready == 0 {
            break;
        }
        if o.busy_ms > 0 {
            tokio::time::sleep(Duration::from_millis(o.busy_ms)).await;
        }
    }
    let settled = storm.elapsed();
    let cpu = harness::cpu_seconds("self")? - cpu_before;
    let rss_after = status_kb("VmHWM")?;
    stop.cancel();
    drop(stdin);
    let _ = child.kill();
    let _ = child.wait();

    println!("discovery storm: {} pods of one pool turn NotReady at once ({} watch events of {} pods each)", o.pods, o.pods, o.pods);
    println!(
        "  first list of {} ready pods after {:.2} s",
        o.pods,
        listed.as_secs_f64()
    );
    println!(
        "  settled (the list with every pod NotReady) {:.3} s after the storm began; first list after {:.3} s",
        settled.as_secs_f64(),
        first_list.unwrap_or_default().as_secs_f64()
    );
    println!(
        "  lists taken: {lists} (the scrape loop busy {} ms between two)",
        o.busy_ms
    );
    println!("  discovery's CPU over the storm: {cpu:.2} s");
    println!(
        "  peak RSS of this process: {:.0} MB before the storm, {:.0} MB after",
        rss_before as f64 / 1024.0,
        rss_after as f64 / 1024.0
    );
    Ok(())
}
