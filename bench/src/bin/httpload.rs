//! httpload: a minimal closed-loop HTTP/1.1 load tool for measuring what the filter costs inside
//! Envoy (`scripts/envoy_overhead.py`). Each of `--connections` keep-alive connections sends the
//! same request back to back for `--duration-s`; latency is recorded per request in an HDR
//! histogram. Raw TCP with a pre-built request keeps the client's own cost small and constant,
//! so the difference between two Envoy configurations measured side by side is Envoy's.
//!
//! Output: one JSON object on stdout.

use anyhow::{bail, Context, Result};
use clap::Parser;
use hdrhistogram::Histogram;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Parser)]
struct Args {
    /// host:port of the listener.
    #[arg(long)]
    addr: String,
    #[arg(long, default_value = "/v1/chat/completions")]
    path: String,
    /// File holding the request body (JSON).
    #[arg(long)]
    body_file: String,
    #[arg(long, default_value_t = 1)]
    connections: usize,
    #[arg(long, default_value_t = 10.0)]
    duration_s: f64,
    /// Requests before measuring starts, per connection (JIT, caches, connection setup).
    #[arg(long, default_value_t = 200)]
    warmup: usize,
}

struct Outcome {
    hist: Histogram<u64>,
    ok: u64,
    errors: u64,
}

/// Reads one HTTP/1.1 response with a content-length body; returns the status.
async fn read_response(s: &mut TcpStream, buf: &mut Vec<u8>) -> Result<u16> {
    buf.clear();
    let mut tmp = [0u8; 16384];
    loop {
        let n = s.read(&mut tmp).await?;
        if n == 0 {
            bail!("connection closed");
        }
        buf.extend_from_slice(&tmp[..n]);
        if let Some(end) = find(buf, b"\r\n\r\n") {
            let head = std::str::from_utf8(&buf[..end]).context("non-UTF-8 head")?;
            let status: u16 = head
                .split(' ')
                .nth(1)
                .and_then(|x| x.parse().ok())
                .context("no status")?;
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .context("no content-length")?;
            let want = end + 4 + len;
            while buf.len() < want {
                let n = s.read(&mut tmp).await?;
                if n == 0 {
                    bail!("connection closed mid-body");
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            return Ok(status);
        }
    }
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

async fn connection(
    addr: String,
    req: Arc<Vec<u8>>,
    warmup: usize,
    barrier: Arc<tokio::sync::Barrier>,
    duration: Duration,
) -> Result<Outcome> {
    let mut s = TcpStream::connect(&addr).await?;
    s.set_nodelay(true)?;
    let mut buf = Vec::with_capacity(4096);
    let mut out = Outcome {
        hist: Histogram::new_with_bounds(1, 60_000_000, 3)?,
        ok: 0,
        errors: 0,
    };
    for _ in 0..warmup {
        s.write_all(&req).await?;
        read_response(&mut s, &mut buf).await?;
    }
    // Every connection is warm before any measures: the window is the same for all.
    barrier.wait().await;
    let until = Instant::now() + duration;
    while Instant::now() < until {
        let t = Instant::now();
        s.write_all(&req).await?;
        match read_response(&mut s, &mut buf).await {
            Ok(200) => {
                out.ok += 1;
                out.hist.saturating_record(t.elapsed().as_micros() as u64);
            }
            Ok(_) => out.errors += 1,
            Err(_) => {
                out.errors += 1;
                s = TcpStream::connect(&addr).await?;
                s.set_nodelay(true)?;
            }
        }
    }
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let body = std::fs::read(&a.body_file).with_context(|| format!("reading {}", a.body_file))?;
    let mut req = format!(
        "POST {} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        a.path,
        a.addr,
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(&body);
    let req = Arc::new(req);
    let barrier = Arc::new(tokio::sync::Barrier::new(a.connections));
    let duration = Duration::from_secs_f64(a.duration_s);
    let tasks: Vec<_> = (0..a.connections)
        .map(|_| {
            tokio::spawn(connection(
                a.addr.clone(),
                req.clone(),
                a.warmup,
                barrier.clone(),
                duration,
            ))
        })
        .collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3)?;
    let (mut ok, mut errors) = (0u64, 0u64);
    for t in tasks {
        let o = t.await??;
        hist.add(&o.hist)?;
        ok += o.ok;
        errors += o.errors;
    }
    let secs = a.duration_s;
    let out = serde_json::json!({
        "connections": a.connections,
        "duration_s": secs,
        "requests": ok,
        "errors": errors,
        "rps": ok as f64 / secs,
        "latency_us": {
            "p50": hist.value_at_quantile(0.50),
            "p90": hist.value_at_quantile(0.90),
            "p99": hist.value_at_quantile(0.99),
            "mean": hist.mean(),
        },
        "body_bytes": body.len(),
    });
    println!("{out}");
    Ok(())
}
