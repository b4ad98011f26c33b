//! A running pod: its engine behind a mutex, the scheduler task that advances the engine in
//! step with the wall clock, per-request output channels, and the failure mode set through the
//! admin API. One scheduler task per pod sleeps until the end of the current step (tokio's timer
//! has 1 ms granularity, so steps shorter than that are processed in small batches, each at its
//! exact simulated time); there is no timer per sequence.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, watch, Notify};

use crate::config::PodConfig;
use crate::engine::{Engine, EngineGauges, EngineStats, NewRequest, Output, SeqId, SimNs};
use crate::lora::AdapterId;

/// The fleet's clock: simulated time runs `scale` times faster than wall time from `epoch`.
#[derive(Debug, Clone, Copy)]
pub struct SimClock {
    epoch: Instant,
    unix_epoch: f64,
    scale: f64,
}

impl SimClock {
    /// A clock starting now.
    pub fn new(scale: f64) -> Self {
        let unix_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        SimClock {
            epoch: Instant::now(),
            unix_epoch,
            scale,
        }
    }

    /// Simulated seconds per wall second.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Simulated now.
    pub fn now(&self) -> SimNs {
        (self.epoch.elapsed().as_nanos() as f64 * self.scale) as SimNs
    }

    /// The wall instant at which simulated time `t` is reached (rounded up).
    pub fn instant_at(&self, t: SimNs) -> Instant {
        self.epoch + Duration::from_nanos((t as f64 / self.scale).ceil() as u64)
    }

    /// Unix seconds at simulated time `t`.
    pub fn unix_at(&self, t: SimNs) -> f64 {
        self.unix_epoch + t as f64 / 1e9 / self.scale
    }

    /// Unix seconds when the clock started.
    pub fn unix_epoch(&self) -> f64 {
        self.unix_epoch
    }
}

/// What a pod does with traffic (set through the admin API).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Serve normally.
    Ok,
    /// Refuse connections (the listener is closed and open connections are dropped).
    Down,
    /// Accept connections and requests but never answer.
    Hang,
    /// Answer every request with HTTP 500.
    Error,
}

struct Core {
    engine: Engine,
    sinks: HashMap<SeqId, mpsc::UnboundedSender<Output>>,
}

/// A pod of the fleet.
pub struct Pod {
    /// Resolved configuration.
    pub cfg: PodConfig,
    /// Address the pod listens on.
    pub addr: SocketAddr,
    /// Fleet seed.
    pub seed: u64,
    /// The fleet clock.
    pub clock: SimClock,
    core: Mutex<Core>,
    wake: Notify,
    mode: watch::Sender<Mode>,
    requests: AtomicU64,
}

impl std::fmt::Debug for Pod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pod")
            .field("name", &self.cfg.name)
            .field("addr", &self.addr)
            .finish()
    }
}

/// Aborts the request in the engine if its client goes away before it finishes.
#[derive(Debug)]
pub struct RequestGuard {
    pod: Arc<Pod>,
    seq: SeqId,
    done: bool,
}

impl RequestGuard {
    /// Marks the request finished (no abort on drop).
    pub fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if !self.done {
            self.pod.abort(self.seq);
        }
    }
}

/// A pod's live state, for the admin API.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PodState {
    /// Pod name.
    pub name: String,
    /// Pool.
    pub pool: String,
    /// Base model.
    pub model: String,
    /// Address.
    pub address: String,
    /// GPU profile key.
    pub gpu: String,
    /// Engine flavour.
    pub engine: crate::engine::EngineKind,
    /// Failure mode.
    pub mode: Mode,
    /// Speed multiplier.
    pub speed: f64,
    /// Running sequences.
    pub running: usize,
    /// Queued sequences.
    pub waiting: usize,
    /// KV-cache usage 0..1.
    pub kv_usage: f64,
    /// Total KV blocks.
    pub num_gpu_blocks: u32,
    /// Blocks holding cached prefixes.
    pub cached_blocks: usize,
    /// Largest prompt + output accepted.
    pub max_model_len: u32,
    /// `max_loras`.
    pub max_loras: usize,
    /// Adapters loaded on the GPU, most recently used first.
    pub resident_adapters: Vec<String>,
    /// Adapters of running requests.
    pub running_adapters: Vec<String>,
    /// Adapters of queued requests.
    pub waiting_adapters: Vec<String>,
    /// Counters.
    pub counters: PodCounters,
}

/// Cumulative counters of a pod.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PodCounters {
    /// Requests received.
    pub requests: u64,
    /// Requests finished normally.
    pub finished: u64,
    /// Requests aborted by their clients.
    pub aborted: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Prefix-cache queries (tokens).
    pub prefix_cache_queries: u64,
    /// Prefix-cache hits (tokens).
    pub prefix_cache_hits: u64,
    /// Adapter loads.
    pub lora_adapter_loads: u64,
    /// Preemptions.
    pub preemptions: u64,
    /// Engine steps.
    pub steps: u64,
}

/// A consistent copy of what `/metrics` needs.
#[derive(Debug, Clone)]
pub struct MetricsView {
    /// Gauges.
    pub gauges: EngineGauges,
    /// Counters and histograms.
    pub stats: EngineStats,
}

impl Pod {
    /// A pod with an idle engine (call [`Pod::spawn_scheduler`] to run it).
    pub fn new(cfg: PodConfig, addr: SocketAddr, seed: u64, clock: SimClock) -> Arc<Self> {
        let engine = Engine::new(cfg.engine.clone());
        let (mode, _) = watch::channel(Mode::Ok);
        Arc::new(Pod {
            cfg,
            addr,
            seed,
            clock,
            core: Mutex::new(Core {
                engine,
                sinks: HashMap::new(),
            }),
            wake: Notify::new(),
            mode,
            requests: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        // a panic while holding the lock cannot leave the engine half-updated in a way that
        // matters more than stopping the pod would, so keep serving
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Current failure mode.
    pub fn mode(&self) -> Mode {
        *self.mode.borrow()
    }

    /// Sets the failure mode.
    pub fn set_mode(&self, m: Mode) {
        self.mode.send_replace(m);
    }

    /// Watches the failure mode.
    pub fn watch_mode(&self) -> watch::Receiver<Mode> {
        self.mode.subscribe()
    }

    /// Largest prompt + output the pod accepts.
    pub fn max_model_len(&self) -> u32 {
        self.lock().engine.max_model_len()
    }

    /// Index of an adapter name.
    pub fn adapter_id(&self, name: &str) -> Option<AdapterId> {
        self.cfg
            .adapters
            .iter()
            .position(|a| a == name)
            .and_then(|i| AdapterId::try_from(i).ok())
    }

    /// Next request number (for response ids).
    pub fn next_request_number(&self) -> u64 {
        self.requests.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Requests received so far.
    pub fn requests_received(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Hands a request to the engine; outputs arrive on the returned channel.
    pub fn submit(
        self: &Arc<Self>,
        req: NewRequest,
    ) -> (mpsc::UnboundedReceiver<Output>, RequestGuard) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (seq, was_busy) = {
            let mut core = self.lock();
            let now = self.clock.now();
            let busy = core.engine.is_busy();
            let seq = core.engine.submit(req, now);
            core.sinks.insert(seq, tx);
            (seq, busy)
        };
        if !was_busy {
            self.wake.notify_one();
        }
        let guard = RequestGuard {
            pod: Arc::clone(self),
            seq,
            done: false,
        };
        (rx, guard)
    }

    fn abort(&self, seq: SeqId) {
        let busy = {
            let mut core = self.lock();
            core.sinks.remove(&seq);
            core.engine.abort(seq);
            core.engine.is_busy()
        };
        if !busy {
            self.wake.notify_one();
        }
    }

    /// Runs the scheduler until the process ends.
    pub fn spawn_scheduler(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let pod = Arc::clone(self);
        tokio::spawn(async move { pod.scheduler().await })
    }

    async fn scheduler(self: Arc<Self>) {
        let mut out = Vec::new();
        loop {
            let next = {
                let mut core = self.lock();
                let now = self.clock.now();
                core.engine.advance(now, &mut out);
                for o in out.drain(..) {
                    let (seq, last) = (o.seq, o.finish.is_some());
                    if let Some(tx) = core.sinks.get(&seq) {
                        // a closed receiver means the client left; its guard aborts the request
                        let _ = tx.send(o);
                    }
                    if last {
                        core.sinks.remove(&seq);
                    }
                }
                core.engine.next_wakeup()
            };
            match next {
                Some(t) => {
                    let deadline = tokio::time::Instant::from_std(self.clock.instant_at(t));
                    tokio::select! {
                        _ = tokio::time::sleep_until(deadline) => {}
                        _ = self.wake.notified() => {}
                    }
                }
                None => self.wake.notified().await,
            }
        }
    }

    /// A copy of gauges and statistics.
    pub fn metrics_view(&self) -> MetricsView {
        let core = self.lock();
        MetricsView {
            gauges: core.engine.gauges(),
            stats: core.engine.stats().clone(),
        }
    }

    /// Live state for the admin API.
    pub fn state(&self) -> PodState {
        let (g, s, max_len) = {
            let core = self.lock();
            (
                core.engine.gauges(),
                core.engine.stats().clone(),
                core.engine.max_model_len(),
            )
        };
        PodState {
            name: self.cfg.name.clone(),
            pool: self.cfg.pool.clone(),
            model: self.cfg.model.clone(),
            address: self.addr.to_string(),
            gpu: self.cfg.gpu_key.clone(),
            engine: self.cfg.engine.kind,
            mode: self.mode(),
            speed: self.cfg.engine.speed,
            running: g.running,
            waiting: g.waiting,
            kv_usage: g.kv_usage,
            num_gpu_blocks: g.total_blocks,
            cached_blocks: g.cached_blocks,
            max_model_len: max_len,
            max_loras: self.cfg.engine.max_loras,
            resident_adapters: adapter_names(&self.cfg, &g.resident_adapters),
            running_adapters: adapter_names(&self.cfg, &g.running_adapters),
            waiting_adapters: adapter_names(&self.cfg, &g.waiting_adapters),
            counters: PodCounters {
                requests: self.requests_received(),
                finished: s.finished_stop + s.finished_length,
                aborted: s.finished_abort,
                prompt_tokens: s.prompt_tokens,
                generation_tokens: s.generation_tokens,
                prefix_cache_queries: s.prefix_queries,
                prefix_cache_hits: s.prefix_hits,
                lora_adapter_loads: s.lora_loads,
                preemptions: s.preemptions,
                steps: s.steps,
            },
        }
    }
}

/// The names of adapters `ids` of a pod of configuration `cfg`, in order (unknown ids left out).
pub fn adapter_names(cfg: &PodConfig, ids: &[AdapterId]) -> Vec<String> {
    ids.iter()
        .filter_map(|&i| cfg.adapters.get(usize::from(i)).cloned())
        .collect()
}
