//! Closed-loop HTTP/1.1 load against several listeners in interleaved time slots: what
//! `httpload` (and through it `scripts/envoy_overhead.py`) measures the filter's cost with.
//!
//! On a shared machine the speed of the host drifts over seconds (other tenants). Measuring
//! gateway A for 4 s and then gateway B for 4 s puts that drift into the A/B ratio: per-round
//! ratios of two identical gateways spread by ±20% on this project's benchmark hosts. Here every
//! target gets short slots in turn (`slot`, 250 ms by default) until each has been measured for
//! `duration`, so a slow spell falls on all of them alike. The order changes every cycle
//! (`slot_order`: a balanced Latin square), so no target always runs right after the same
//! neighbour, in the same position, or twice in a row.
//!
//! Each target keeps its own `connections` keep-alive connections for the whole run; in its
//! slot each connection sends the same pre-built request back to back, and in the other
//! targets' slots it is idle. Per target the run reports requests, errors, the time its slots
//! took, requests/s over that time, latency percentiles, and, given the target's process id,
//! that process's CPU time per request counted over its own slots only (an idle gateway's
//! timers do not count against it). It reports the same per turn too (`turns`, in cycle order):
//! two targets' turns of one cycle ran within a second of each other, so comparing them turn by
//! turn (paired) removes most of the host's drift that is left in the whole-run figures.

use anyhow::{bail, Context, Result};
use hdrhistogram::Histogram;
use serde::Serialize;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One listener to load.
#[derive(Clone, Debug)]
pub struct Target {
    /// `host:port`.
    pub addr: String,
    /// The process serving it, for its CPU time (Linux `/proc`); `None`: not counted.
    pub pid: Option<u32>,
}

/// What to send and for how long.
#[derive(Clone, Debug)]
pub struct Plan {
    pub targets: Vec<Target>,
    /// Request path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// The request body (sent as `application/json` with a content-length).
    pub body: Vec<u8>,
    /// Keep-alive connections per target.
    pub connections: usize,
    /// Measured time per target (the sum of its slots).
    pub duration: Duration,
    /// One slot. With one target the whole `duration` is one slot.
    pub slot: Duration,
    /// Requests per connection before measuring starts (connection setup, JIT, caches).
    pub warmup: usize,
}

/// Latency percentiles, microseconds.
#[derive(Clone, Debug, Serialize)]
pub struct Latency {
    pub p50: u64,
    pub p90: u64,
    pub p99: u64,
    pub mean: f64,
}

/// One target's measurements.
#[derive(Clone, Debug, Serialize)]
pub struct TargetReport {
    pub addr: String,
    /// Requests answered 200 within the measured slots.
    pub requests: u64,
    /// Requests answered otherwise, or lost with their connection.
    pub errors: u64,
    /// The slots this target had.
    pub slots: usize,
    /// The time its slots took, seconds (each slot ends when its last request is answered).
    pub active_s: f64,
    /// `requests / active_s`.
    pub rps: f64,
    pub latency_us: Latency,
    /// The target process's CPU time (all threads) over its slots, per request answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_us_per_request: Option<f64>,
    /// Each of its turns, in cycle order (the `i`-th turn of every target is in cycle `i`).
    pub turns: Vec<Turn>,
}

/// One target's measurements over one turn (slot).
#[derive(Clone, Debug, Serialize)]
pub struct Turn {
    /// Requests answered 200 in this turn.
    pub requests: u64,
    /// Requests answered otherwise, or lost with their connection, in this turn.
    pub errors: u64,
    /// The time the turn took, seconds.
    pub active_s: f64,
    /// `requests / active_s`.
    pub rps: f64,
    /// Median latency over the turn, microseconds (0 when nothing was answered).
    pub p50_us: u64,
    /// The target process's CPU time over the turn, per request answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_us_per_request: Option<f64>,
}

/// A histogram of latencies in microseconds, up to a minute at 3 significant digits.
fn latency_histogram() -> Result<Histogram<u64>> {
    Ok(Histogram::new_with_bounds(1, 60_000_000, 3)?)
}

/// `requests / seconds`, 0 for no time.
fn per_second(requests: u64, seconds: f64) -> f64 {
    if seconds > 0.0 {
        requests as f64 / seconds
    } else {
        0.0
    }
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub connections: usize,
    pub slot_ms: f64,
    pub duration_s: f64,
    pub body_bytes: usize,
    pub targets: Vec<TargetReport>,
}

/// The order of the targets in cycle `cycle`: the rows of a Williams design, a Latin square
/// balanced for what came just before. Over one period (`n` cycles for an even number of targets,
/// `2n` for an odd one) every target takes every position equally often, follows every other
/// target equally often within a cycle, and no target ever has two turns in a row, not even
/// across the end of one cycle and the start of the next.
///
/// Why it matters: a gateway that has just been idle for the others' turns starts its own a
/// little slower (cold caches, sleeping threads). An order that reversed every cycle (A B C,
/// C B A, ...) gave the two end targets a back-to-back turn at every cycle boundary, half of
/// their turns warm: two byte-identical builds of the filter then read 93.8% of each other's
/// requests/s (95% interval 89.8-98.3%) when one of them sat at an end (run 26, 2026-12-03), and
/// plain Envoy, the baseline, sat at the other end.
pub fn slot_order(targets: usize, cycle: usize) -> Vec<usize> {
    let n = targets;
    if n <= 2 {
        // one order; with two targets A B A B ... already alternates and balances
        return (0..n).collect();
    }
    // first row 0, 1, n-1, 2, n-2, 3, ...; row r adds r to every entry (mod n); with an odd
    // number of targets the next n rows are the first n reversed, taken with the shifts
    // 0, n-1, ..., 1 (ascending, three targets would repeat one across a cycle boundary)
    let row_index = cycle % order_period(n);
    let reversed = row_index >= n;
    let shift = if reversed {
        (2 * n - row_index) % n
    } else {
        row_index
    };
    let mut row: Vec<usize> = (0..n)
        .map(|j| {
            let first = if j == 0 {
                0
            } else if j % 2 == 1 {
                j.div_ceil(2)
            } else {
                n - j / 2
            };
            (first + shift) % n
        })
        .collect();
    if reversed {
        row.reverse();
    }
    row
}

/// The number of cycles after which `slot_order` repeats: 1 for one or two targets, `n` for an
/// even number, `2n` for an odd one.
pub fn order_period(targets: usize) -> usize {
    match targets {
        0..=2 => 1,
        n if n % 2 == 0 => n,
        n => 2 * n,
    }
}

/// Slots per target: enough for `duration` (at least one); with one target, one. When that is
/// at least one period of `slot_order`, it is rounded up to whole periods (the slots then get
/// shorter, see `slot_length`), so every order of the design runs equally often: 16 quarter-second
/// turns for 6 targets would run four of the six orders three times and two of them twice.
pub fn slots_per_target(targets: usize, duration: Duration, slot: Duration) -> usize {
    if targets <= 1 || slot.is_zero() {
        return 1;
    }
    let slots = (duration.as_secs_f64() / slot.as_secs_f64())
        .ceil()
        .max(1.0) as usize;
    let period = order_period(targets);
    if slots >= period {
        slots.div_ceil(period) * period
    } else {
        slots
    }
}

/// The length of one slot, so that `slots` of them make `duration`.
fn slot_length(duration: Duration, slots: usize) -> Duration {
    duration / slots.max(1) as u32
}

/// The first field of a `/proc/<pid>/task/<tid>/schedstat` line: time on the CPU, nanoseconds.
pub fn parse_schedstat(line: &str) -> Option<u64> {
    line.split_whitespace().next()?.parse().ok()
}

/// CPU time of every thread of process `pid` so far, nanoseconds (threads that ended are not
/// counted: a gateway's threads live as long as it does). Linux only.
pub fn process_cpu_ns(pid: u32) -> Result<u64> {
    let dir = format!("/proc/{pid}/task");
    let mut total = 0u64;
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let path = entry?.path().join("schedstat");
        // A thread may end between the listing and the read.
        if let Ok(text) = std::fs::read_to_string(&path) {
            total +=
                parse_schedstat(&text).with_context(|| format!("parsing {}", path.display()))?;
        }
    }
    Ok(total)
}

/// The pre-built request.
pub fn request_bytes(addr: &str, path: &str, body: &[u8]) -> Vec<u8> {
    let mut req = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    req
}

/// Reads one HTTP/1.1 response with a content-length body; returns its status.
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

async fn connect(addr: &str) -> Result<TcpStream> {
    let s = TcpStream::connect(addr)
        .await
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_nodelay(true)?;
    Ok(s)
}

/// One keep-alive connection and what it measured.
struct Conn {
    addr: String,
    stream: TcpStream,
    buf: Vec<u8>,
    /// The current turn's latencies of 200 answers (emptied when the turn is summed).
    turn: Histogram<u64>,
    /// The current turn's other answers and lost requests.
    turn_errors: u64,
}

impl Conn {
    async fn open(addr: &str) -> Result<Self> {
        Ok(Self {
            addr: addr.to_string(),
            stream: connect(addr).await?,
            buf: Vec::with_capacity(4096),
            turn: latency_histogram()?,
            turn_errors: 0,
        })
    }

    async fn warm(mut self, req: Arc<Vec<u8>>, n: usize) -> Result<Self> {
        for _ in 0..n {
            self.stream.write_all(&req).await?;
            read_response(&mut self.stream, &mut self.buf).await?;
        }
        Ok(self)
    }

    /// Sends back to back until `until`; a request started before it is finished and counted.
    async fn slot(mut self, req: Arc<Vec<u8>>, until: Instant) -> Result<Self> {
        while Instant::now() < until {
            let t = Instant::now();
            let sent = self.stream.write_all(&req).await;
            let answer = match sent {
                Ok(()) => read_response(&mut self.stream, &mut self.buf).await,
                Err(e) => Err(e.into()),
            };
            match answer {
                Ok(200) => self.turn.saturating_record(t.elapsed().as_micros() as u64),
                Ok(_) => self.turn_errors += 1,
                Err(_) => {
                    // The connection is gone (the gateway closed it, say): count the request
                    // and carry on with a new one.
                    self.turn_errors += 1;
                    self.stream = connect(&self.addr).await?;
                }
            }
        }
        Ok(self)
    }
}

async fn join_all(tasks: Vec<tokio::task::JoinHandle<Result<Conn>>>) -> Result<Vec<Conn>> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.context("a connection task failed")??);
    }
    Ok(out)
}

/// Runs `plan`: warms every connection, then gives the targets their slots in turn.
pub async fn run(plan: &Plan) -> Result<Report> {
    if plan.targets.is_empty() || plan.connections == 0 {
        bail!("nothing to load: no target or no connection");
    }
    let n = plan.targets.len();
    let slots = slots_per_target(n, plan.duration, plan.slot);
    // one target: one slot, the whole duration
    let slot = slot_length(plan.duration, slots);
    let reqs: Vec<Arc<Vec<u8>>> = plan
        .targets
        .iter()
        .map(|t| Arc::new(request_bytes(&t.addr, &plan.path, &plan.body)))
        .collect();

    // Every connection of every target, warm before any slot starts.
    let mut conns: Vec<Vec<Conn>> = Vec::with_capacity(n);
    for (t, req) in plan.targets.iter().zip(&reqs) {
        let mut tasks = Vec::with_capacity(plan.connections);
        for _ in 0..plan.connections {
            let (addr, req, warmup) = (t.addr.clone(), req.clone(), plan.warmup);
            tasks.push(tokio::spawn(async move {
                Conn::open(&addr).await?.warm(req, warmup).await
            }));
        }
        conns.push(join_all(tasks).await?);
    }

    // per target: its turns, and its latencies, errors, time and CPU over all of them
    let mut turns: Vec<Vec<Turn>> = vec![Vec::with_capacity(slots); n];
    let mut hists = (0..n)
        .map(|_| latency_histogram())
        .collect::<Result<Vec<_>>>()?;
    let mut errors = vec![0u64; n];
    let mut active = vec![Duration::ZERO; n];
    let mut cpu_ns = vec![0u64; n];
    let mut turn_hist = latency_histogram()?;
    for cycle in 0..slots {
        for i in slot_order(n, cycle) {
            let pid = plan.targets[i].pid;
            let cpu0 = pid.map(process_cpu_ns).transpose()?;
            let start = Instant::now();
            let until = start + slot;
            let tasks = std::mem::take(&mut conns[i])
                .into_iter()
                .map(|c| tokio::spawn(c.slot(reqs[i].clone(), until)))
                .collect();
            conns[i] = join_all(tasks).await?;
            let took = start.elapsed();
            active[i] += took;
            let turn_cpu_ns = match (pid, cpu0) {
                (Some(pid), Some(cpu0)) => Some(process_cpu_ns(pid)?.saturating_sub(cpu0)),
                _ => None,
            };
            cpu_ns[i] += turn_cpu_ns.unwrap_or(0);

            turn_hist.reset();
            let mut turn_errors = 0;
            for c in &mut conns[i] {
                turn_hist.add(&c.turn)?;
                c.turn.reset();
                turn_errors += std::mem::take(&mut c.turn_errors);
            }
            hists[i].add(&turn_hist)?;
            errors[i] += turn_errors;
            let ok = turn_hist.len();
            turns[i].push(Turn {
                requests: ok,
                errors: turn_errors,
                active_s: took.as_secs_f64(),
                rps: per_second(ok, took.as_secs_f64()),
                p50_us: if ok > 0 {
                    turn_hist.value_at_quantile(0.50)
                } else {
                    0
                },
                cpu_us_per_request: turn_cpu_ns.map(|ns| ns as f64 / 1e3 / ok.max(1) as f64),
            });
        }
    }

    let mut targets = Vec::with_capacity(n);
    for (i, ((t, turns), hist)) in plan.targets.iter().zip(turns).zip(hists).enumerate() {
        let ok = hist.len();
        let active_s = active[i].as_secs_f64();
        targets.push(TargetReport {
            addr: t.addr.clone(),
            requests: ok,
            errors: errors[i],
            slots,
            active_s,
            rps: per_second(ok, active_s),
            latency_us: Latency {
                p50: hist.value_at_quantile(0.50),
                p90: hist.value_at_quantile(0.90),
                p99: hist.value_at_quantile(0.99),
                mean: hist.mean(),
            },
            cpu_us_per_request: t.pid.map(|_| cpu_ns[i] as f64 / 1e3 / ok.max(1) as f64),
            turns,
        });
    }
    Ok(Report {
        connections: plan.connections,
        slot_ms: slot.as_secs_f64() * 1e3,
        duration_s: plan.duration.as_secs_f64(),
        body_bytes: plan.body.len(),
        targets,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_is_a_balanced_latin_square() {
        assert_eq!(slot_order(1, 1), vec![0]);
        assert_eq!(slot_order(2, 0), vec![0, 1]);
        assert_eq!(slot_order(2, 1), vec![0, 1]);
        assert_eq!(slot_order(4, 0), vec![0, 1, 3, 2]);
        assert_eq!(slot_order(4, 1), vec![1, 2, 0, 3]);
        assert_eq!(slot_order(3, 3), vec![2, 1, 0]);
        for n in 2..=9usize {
            let period = order_period(n);
            let mut at = vec![vec![0usize; n]; n]; // at[target][position]
            let mut after = vec![vec![0usize; n]; n]; // after[a][b]: b right after a in a cycle
            let mut sequence = Vec::new();
            for cycle in 0..period {
                let row = slot_order(n, cycle);
                let mut sorted = row.clone();
                sorted.sort_unstable();
                assert_eq!(
                    sorted,
                    (0..n).collect::<Vec<_>>(),
                    "n {n} cycle {cycle}: {row:?}"
                );
                for (pos, &t) in row.iter().enumerate() {
                    at[t][pos] += 1;
                }
                for w in row.windows(2) {
                    after[w[0]][w[1]] += 1;
                }
                sequence.extend(row);
            }
            // the period repeats: its end meets its start too
            sequence.push(sequence[0]);
            assert!(
                sequence.windows(2).all(|w| w[0] != w[1]),
                "n {n}: a target has two turns in a row"
            );
            if n == 2 {
                continue; // one order, A B A B
            }
            let per_position = period / n;
            assert!(
                at.iter().flatten().all(|&c| c == per_position),
                "n {n}: {at:?}"
            );
            let per_pair = (period * (n - 1)) / (n * (n - 1));
            for (a, row) in after.iter().enumerate() {
                for (b, &c) in row.iter().enumerate() {
                    assert_eq!(c, if a == b { 0 } else { per_pair }, "n {n}: {a} then {b}");
                }
            }
        }
    }

    #[test]
    fn slots_cover_the_duration() {
        let ms = Duration::from_millis;
        assert_eq!(slots_per_target(1, ms(4000), ms(250)), 1);
        // two targets: one order, so exactly the slots asked
        assert_eq!(slots_per_target(2, ms(4000), ms(250)), 16);
        assert_eq!(slots_per_target(2, ms(4100), ms(250)), 17);
        // 16 slots rounded up to whole periods of the order: 6 targets 18, 5 targets 20
        assert_eq!(order_period(6), 6);
        assert_eq!(order_period(5), 10);
        assert_eq!(slots_per_target(6, ms(4000), ms(250)), 18);
        assert_eq!(slots_per_target(5, ms(4000), ms(250)), 20);
        assert_eq!(slots_per_target(4, ms(4000), ms(250)), 16);
        // fewer slots than one period: as asked
        assert_eq!(slots_per_target(5, ms(1000), ms(250)), 4);
        assert_eq!(slots_per_target(5, ms(100), ms(250)), 1);
        assert_eq!(slots_per_target(5, ms(4000), Duration::ZERO), 1);
        assert_eq!(slot_length(ms(4100), 17), Duration::from_nanos(241_176_470));
        assert_eq!(slot_length(ms(4000), 16), ms(250));
    }

    #[test]
    fn schedstat_gives_nanoseconds_on_the_cpu() {
        assert_eq!(parse_schedstat("123456789 2000 17\n"), Some(123_456_789));
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
    }

    #[test]
    fn this_process_has_cpu_time() {
        let spent = process_cpu_ns(std::process::id()).unwrap_or(0);
        assert!(spent > 0);
        assert!(process_cpu_ns(u32::MAX).is_err());
    }

    #[test]
    fn the_request_is_http_1_1_with_a_content_length() {
        let r = request_bytes("127.0.0.1:1", "/v1/chat/completions", b"{}");
        assert_eq!(
            r,
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:1\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        );
    }
}
