//! A small open-loop load generator for measuring what the simulator itself costs: it reads a
//! fleet-sim ports file, sends streaming chat requests round-robin over the pods at Poisson
//! arrivals for a fixed time, and reports completions/s, peak concurrent streams, client-side
//! TTFT, and the CPU the fleet-sim process used (from `/proc/<pid>/stat`), so the benchmark
//! knows how much load one core of simulator sustains. Not a benchmark of any router.
//!
//! `cargo run --release -p fleet-sim --example simload -- --ports-file P --pid PID --rate 100 --seconds 20`

// an example binary: failing loudly on a broken setup is the right behaviour
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

struct Args {
    ports_file: String,
    pid: Option<u32>,
    rate: f64,
    seconds: f64,
    max_tokens: u32,
    prompt_bytes: usize,
}

fn args() -> Args {
    let mut a = Args {
        ports_file: String::new(),
        pid: None,
        rate: 50.0,
        seconds: 20.0,
        max_tokens: 128,
        prompt_bytes: 2000,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i + 1 < argv.len() {
        let v = argv[i + 1].clone();
        match argv[i].as_str() {
            "--ports-file" => a.ports_file = v,
            "--pid" => a.pid = Some(v.parse().expect("--pid")),
            "--rate" => a.rate = v.parse().expect("--rate"),
            "--seconds" => a.seconds = v.parse().expect("--seconds"),
            "--max-tokens" => a.max_tokens = v.parse().expect("--max-tokens"),
            "--prompt-bytes" => a.prompt_bytes = v.parse().expect("--prompt-bytes"),
            other => panic!("unknown argument {other}"),
        }
        i += 2;
    }
    assert!(!a.ports_file.is_empty(), "--ports-file is required");
    a
}

/// utime + stime of a process in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("read /proc stat");
    // fields after the parenthesised command name; utime and stime are fields 14 and 15
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // USER_HZ is 100 on Linux
    ticks / 100.0
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

#[tokio::main]
async fn main() {
    let a = args();
    let ports: Value =
        serde_json::from_str(&std::fs::read_to_string(&a.ports_file).unwrap()).unwrap();
    let pods: Vec<(String, String)> = ports["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["address"].as_str().unwrap().to_string(),
                p["model"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()
        .unwrap();
    let in_flight = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let cpu0 = a.pid.map(cpu_seconds);
    let t0 = Instant::now();
    let mut rng: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = 0.0f64;
    let mut handles = Vec::new();
    let mut n = 0usize;
    while next < a.seconds {
        let at = t0 + Duration::from_secs_f64(next);
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        let (addr, model) = pods[n % pods.len()].clone();
        let prompt = format!("{n:08} {}", "lorem ipsum ".repeat(a.prompt_bytes / 12));
        let body = serde_json::json!({
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": a.max_tokens, "stream": true
        });
        let (c, inf, pk) = (client.clone(), Arc::clone(&in_flight), Arc::clone(&peak));
        handles.push(tokio::spawn(async move {
            let now = inf.fetch_add(1, Ordering::SeqCst) + 1;
            pk.fetch_max(now, Ordering::SeqCst);
            let start = Instant::now();
            let res = async {
                let mut r = c
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                    .ok()?;
                if !r.status().is_success() {
                    return None;
                }
                let mut ttft = None;
                while let Some(chunk) = r.chunk().await.ok()? {
                    if ttft.is_none() && chunk.windows(11).any(|w| w == b"\"content\":\"") {
                        ttft = Some(start.elapsed().as_secs_f64());
                    }
                }
                ttft
            }
            .await;
            inf.fetch_sub(1, Ordering::SeqCst);
            res
        }));
        n += 1;
        // exponential inter-arrival time from a xorshift draw
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let u = (rng >> 11) as f64 / (1u64 << 53) as f64;
        next += -(1.0 - u).ln() / a.rate;
    }
    let send_end = t0.elapsed().as_secs_f64();
    let mut ttfts = Vec::new();
    let mut errors = 0;
    for h in handles {
        match h.await.ok().flatten() {
            Some(t) => ttfts.push(t),
            None => errors += 1,
        }
    }
    let wall = t0.elapsed().as_secs_f64();
    ttfts.sort_by(f64::total_cmp);
    println!(
        "sent {n} in {send_end:.1}s ({:.1} req/s offered), ok {}, errors {errors}, drained at {wall:.1}s",
        n as f64 / send_end,
        ttfts.len()
    );
    println!(
        "peak concurrent streams {}, client TTFT p50 {:.1} ms p99 {:.1} ms",
        peak.load(Ordering::SeqCst),
        percentile(&ttfts, 0.5) * 1e3,
        percentile(&ttfts, 0.99) * 1e3
    );
    if let (Some(pid), Some(c0)) = (a.pid, cpu0) {
        let cpu = cpu_seconds(pid) - c0;
        println!(
            "fleet-sim CPU {cpu:.2} s over {wall:.1} s = {:.1}% of one core; {:.0} completed req/s per core",
            100.0 * cpu / wall,
            ttfts.len() as f64 / cpu.max(1e-9)
        );
    }
}
