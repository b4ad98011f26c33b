//! The interleaved closed-loop load (`httpload`) against small local HTTP/1.1 servers: every
//! target is measured in alternating slots, latency and errors are told apart per target, and
//! CPU time is counted for a target's process. Servers bind 127.0.0.1:0.

// test helpers are not #[test] functions, which clippy's allow-unwrap-in-tests covers;
// a failing setup must fail the test
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use gpuroute_bench::interleave::{run, Plan, Target};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Arrivals at the servers: (when, which server).
type Log = Arc<Mutex<Vec<(Instant, usize)>>>;

/// A keep-alive server that reads each request (head and content-length body), waits `delay`,
/// and answers `status` with a 2-byte body; it logs each arrival under `id`.
async fn server(id: usize, delay: Duration, status: u16, log: Log) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut tmp = [0u8; 8192];
                loop {
                    // one request: the head, then the body its content-length announces
                    let (end, len) = loop {
                        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                            let len: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .map(|v| v.trim().parse().unwrap())
                                .unwrap_or(0);
                            break (end, len);
                        }
                        match s.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    };
                    while buf.len() < end + 4 + len {
                        match s.read(&mut tmp).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&tmp[..n]),
                        }
                    }
                    buf.drain(..end + 4 + len);
                    log.lock().unwrap().push((Instant::now(), id));
                    tokio::time::sleep(delay).await;
                    let answer = format!("HTTP/1.1 {status} X\r\ncontent-length: 2\r\n\r\nok");
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

fn plan(addrs: &[String], pid: Option<u32>, duration_ms: u64, slot_ms: u64) -> Plan {
    Plan {
        targets: addrs
            .iter()
            .map(|a| Target {
                addr: a.clone(),
                pid,
            })
            .collect(),
        path: "/v1/chat/completions".into(),
        body: br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
        connections: 2,
        duration: Duration::from_millis(duration_ms),
        slot: Duration::from_millis(slot_ms),
        warmup: 3,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_take_turns_and_are_measured_apart() {
    let log: Log = Arc::default();
    let fast = server(0, Duration::ZERO, 200, log.clone()).await;
    let slow = server(1, Duration::from_millis(3), 200, log.clone()).await;
    let t0 = Instant::now();
    let report = run(&plan(&[fast, slow], Some(std::process::id()), 600, 100))
        .await
        .unwrap();
    let took = t0.elapsed();
    let (f, s) = (&report.targets[0], &report.targets[1]);

    // 6 slots each, measured for the asked 600 ms each (a slot ends with its last answer)
    for t in [f, s] {
        assert_eq!(t.slots, 6);
        assert_eq!(t.errors, 0);
        assert!(t.requests > 0);
        assert!((0.6..0.9).contains(&t.active_s), "active {}", t.active_s);
        assert!((t.rps - t.requests as f64 / t.active_s).abs() < 1e-6);
        // the servers run in this process, so its CPU time is the target's
        assert!(t.cpu_us_per_request.unwrap() > 0.0);

        // turn by turn: one record per slot, adding up to the whole-run figures
        assert_eq!(t.turns.len(), 6);
        let sum: u64 = t.turns.iter().map(|x| x.requests).sum();
        assert_eq!(sum, t.requests);
        let secs: f64 = t.turns.iter().map(|x| x.active_s).sum();
        assert!((secs - t.active_s).abs() < 1e-6, "{secs} vs {}", t.active_s);
        for x in &t.turns {
            assert!(x.requests > 0 && x.errors == 0);
            assert!((x.rps - x.requests as f64 / x.active_s).abs() < 1e-6);
        }
        // the turns' CPU time adds up to the run's (one turn may read 0: the other tests in
        // this process end threads, and their time leaves the total)
        let cpu_us: f64 = t
            .turns
            .iter()
            .map(|x| x.cpu_us_per_request.unwrap() * x.requests as f64)
            .sum();
        let whole = t.cpu_us_per_request.unwrap() * t.requests as f64;
        assert!((cpu_us - whole).abs() < 1e-3 * whole, "{cpu_us} vs {whole}");
    }
    // every turn of the slow server has its 3 ms in its median; no turn of the fast one does
    for (x, y) in f.turns.iter().zip(&s.turns) {
        assert!(y.p50_us >= 3000, "slow turn p50 {}", y.p50_us);
        assert!(x.p50_us < y.p50_us, "fast {} slow {}", x.p50_us, y.p50_us);
    }
    assert!(took >= Duration::from_millis(1200), "took {took:?}");
    // two connections, each waiting 3 ms per request at the slow server
    assert!(s.latency_us.p50 >= 3000, "slow p50 {}", s.latency_us.p50);
    assert!(s.rps < 2.0 * 1000.0 / 3.0 + 1.0, "slow rps {}", s.rps);
    assert!(
        f.latency_us.p50 < s.latency_us.p50,
        "fast {} slow {}",
        f.latency_us.p50,
        s.latency_us.p50
    );

    // one target at a time: the warm-ups (0, then 1), then the slots 0 1 | 0 1 | 0 1 | 0 1 |
    // 0 1 | 0 1 (never one target twice in a row) make 14 runs of one server each, 13
    // switches; two targets loaded at once would make many more
    let mut arrivals = log.lock().unwrap().clone();
    arrivals.sort_by_key(|a| a.0);
    let switches = arrivals.windows(2).filter(|w| w[0].1 != w[1].1).count();
    assert_eq!(switches, 13);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_answers_are_counted_apart_from_answers() {
    let log: Log = Arc::default();
    let ok = server(0, Duration::ZERO, 200, log.clone()).await;
    let bad = server(1, Duration::ZERO, 503, log.clone()).await;
    let report = run(&plan(&[ok, bad], None, 200, 100)).await.unwrap();
    let (o, b) = (&report.targets[0], &report.targets[1]);
    assert!(o.requests > 0 && o.errors == 0);
    assert!(b.requests == 0 && b.errors > 0);
    assert_eq!(b.rps, 0.0);
    // per turn too: the errors are in the turns that had them, and a turn with no answer has
    // no median
    assert_eq!(b.turns.iter().map(|x| x.errors).sum::<u64>(), b.errors);
    assert!(b
        .turns
        .iter()
        .all(|x| x.requests == 0 && x.p50_us == 0 && x.rps == 0.0));
    assert!(o.turns.iter().all(|x| x.errors == 0 && x.p50_us > 0));
    assert!(o.cpu_us_per_request.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_target_is_one_slot_and_a_dead_one_is_an_error() {
    let log: Log = Arc::default();
    let ok = server(0, Duration::ZERO, 200, log).await;
    let report = run(&plan(&[ok], None, 200, 50)).await.unwrap();
    assert_eq!(report.targets[0].slots, 1);
    assert!(report.targets[0].requests > 0);

    // a port nobody listens on: the run fails with the address in the message
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let err = run(&plan(std::slice::from_ref(&dead), None, 100, 50))
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains(&dead), "{err:#}");
    assert!(run(&plan(&[], None, 100, 50)).await.is_err());
}
