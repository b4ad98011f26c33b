//! Small helpers shared by the modules: a log rate limiter, an error's causes and the wall
//! clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::time::Instant;

/// Lets one message through per `period` and counts the ones it held back, so a condition that
/// repeats every 100 ms (Envoy down, a dead pod) logs once in a while with a count instead of
/// flooding the log.
#[derive(Debug)]
pub struct LogGate {
    period: Duration,
    last: Option<Instant>,
    suppressed: u64,
}

impl LogGate {
    /// A gate that opens at most once per `period`.
    pub fn new(period: Duration) -> LogGate {
        LogGate {
            period,
            last: None,
            suppressed: 0,
        }
    }

    /// `Some(n)` when a message may be logged now (`n` = messages held back since the last
    /// one); `None` when it must be suppressed.
    pub fn allow(&mut self, now: Instant) -> Option<u64> {
        match self.last {
            Some(t) if now.saturating_duration_since(t) < self.period => {
                self.suppressed += 1;
                None
            }
            _ => {
                self.last = Some(now);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }

    /// Forgets history (the condition cleared), so the next occurrence logs at once.
    pub fn reset(&mut self) {
        self.last = None;
        self.suppressed = 0;
    }
}

/// Wall-clock milliseconds derived from a monotonic clock: `base_ms` at `base`, plus the
/// monotonic time since. Timestamps in one run are then consistent with each other even if the
/// system clock is stepped, and follow tokio's paused clock in tests.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    base_ms: u64,
    base: Instant,
}

impl WallClock {
    /// Anchors the clock to the system time now.
    pub fn system() -> WallClock {
        let base_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        WallClock {
            base_ms,
            base: Instant::now(),
        }
    }

    /// Unix milliseconds at monotonic instant `at`.
    pub fn ms_at(&self, at: Instant) -> u64 {
        self.base_ms + at.saturating_duration_since(self.base).as_millis() as u64
    }
}

/// `e` and each of its causes, as "outer: inner: ...", a message that repeats its cause's
/// text left out. kube's and hyper's own messages name only their layer ("client error
/// (SendRequest)" for a read timeout); the cause says what happened.
pub fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut last = out.clone();
    let mut cur = e.source();
    while let Some(c) = cur {
        let text = c.to_string();
        if !text.is_empty() && !last.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        last = text;
        cur = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|l| l as _)
        }
    }

    #[test]
    fn an_error_is_written_with_its_causes_once_each() {
        let e = Layer(
            "client error (SendRequest)",
            Some(Box::new(Layer(
                "operation timed out",
                Some(Box::new(Layer("operation timed out", None))),
            ))),
        );
        assert_eq!(
            with_causes(&e),
            "client error (SendRequest): operation timed out"
        );
        // A message that already names its cause is not repeated.
        let e = Layer(
            "HyperError: refused",
            Some(Box::new(Layer("refused", None))),
        );
        assert_eq!(with_causes(&e), "HyperError: refused");
        assert_eq!(with_causes(&Layer("alone", None)), "alone");
    }

    #[tokio::test(start_paused = true)]
    async fn gate_opens_once_per_period_and_counts_the_rest() {
        let mut g = LogGate::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(g.allow(t0), Some(0));
        assert_eq!(g.allow(t0 + Duration::from_secs(1)), None);
        assert_eq!(g.allow(t0 + Duration::from_secs(9)), None);
        assert_eq!(g.allow(t0 + Duration::from_secs(10)), Some(2));
        g.reset();
        assert_eq!(g.allow(t0 + Duration::from_secs(11)), Some(0));
    }

    #[tokio::test(start_paused = true)]
    async fn wall_clock_follows_the_monotonic_clock() {
        let c = WallClock::system();
        let t0 = Instant::now();
        let a = c.ms_at(t0);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(c.ms_at(Instant::now()), a + 250);
    }
}

#[cfg(test)]
pub(crate) use test_logs::Logs;

#[cfg(test)]
mod test_logs {
    use std::sync::Arc;

    /// What is logged on this thread while it is held (tests): a `#[tokio::test]` runs the tasks
    /// it spawns on its own thread, so their lines are here.
    #[derive(Clone, Default)]
    pub(crate) struct Logs(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Logs {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Logs {
        pub(crate) fn capture() -> (Logs, tracing::subscriber::DefaultGuard) {
            let logs = Logs::default();
            let writer = logs.clone();
            let guard = tracing::subscriber::set_default(
                tracing_subscriber::fmt()
                    .with_writer(move || writer.clone())
                    .with_ansi(false)
                    .finish(),
            );
            (logs, guard)
        }
        pub(crate) fn count(&self, what: &str) -> usize {
            String::from_utf8_lossy(&self.0.lock().unwrap())
                .matches(what)
                .count()
        }
    }
}
