//! The engine model of one pod: a discrete-event imitation of vLLM v1's scheduler.
//!
//! Each step the scheduler (1) gives every running sequence its next tokens (one decode token,
//! or the next chunk of a prefill) within the step's token budget, preempting the most recently
//! admitted sequence by recompute when the KV cache cannot grow; then (2) admits waiting
//! sequences first come, first served while sequence slots, token budget and KV blocks last,
//! reusing cached prefix blocks and skipping (not blocking on) requests whose LoRA adapter would
//! exceed `max_loras` in the batch. The step's duration comes from [`crate::cost`] plus one
//! `lora_load` per adapter loaded. Tokens produced by the step are emitted at its end.
//!
//! The engine is pure and synchronous: time is passed in ([`SimNs`], simulated nanoseconds), so
//! tests drive it without a runtime and the same inputs always give the same outputs.

use std::collections::VecDeque;

use crate::cost::{step_seconds, StepWork};
use crate::kv::{BlockId, BlockPool};
use crate::lora::{AdapterId, LoraSlots};
use crate::metrics::{
    Histogram, SGLANG_E2E_BUCKETS, SGLANG_TPOT_BUCKETS, SGLANG_TTFT_BUCKETS, VLLM_E2E_BUCKETS,
    VLLM_ITL_BUCKETS, VLLM_TTFT_BUCKETS,
};
use crate::profiles::{GpuProfile, ModelProfile};

/// Simulated time in nanoseconds since the pod started.
pub type SimNs = u64;

/// Identifier of a request inside one engine.
pub type SeqId = u64;

/// SGLang logs decode statistics (and so updates `gen_throughput`) every this many decode steps
/// (`--decode-log-interval` default 40, SGLang server arguments).
const SGLANG_DECODE_LOG_INTERVAL: u64 = 40;

/// At most this many `lora_requests_info` label combinations are remembered; vLLM keeps every
/// combination it ever saw (one series each), which is unbounded with many adapters.
const MAX_LORA_INFO_SERIES: usize = 32;

/// Which server's metric names and histogram buckets the pod imitates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    /// vLLM v1.
    Vllm,
    /// SGLang.
    Sglang,
}

/// Why a request finished (vLLM's `finished_reason` label values).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// The model stopped by itself (the output length was drawn, not requested).
    Stop,
    /// `max_tokens` was reached.
    Length,
    /// The client went away.
    Abort,
}

impl FinishReason {
    /// The OpenAI / vLLM string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Static configuration of an engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The GPU.
    pub gpu: &'static GpuProfile,
    /// The model architecture.
    pub model: &'static ModelProfile,
    /// Speed multiplier on top of the GPU profile (2.0 = steps take half as long).
    pub speed: f64,
    /// Simulated seconds per wall second; histograms report wall seconds.
    pub time_scale: f64,
    /// Tokens per KV block (vLLM default 16).
    pub block_size: u32,
    /// KV blocks on the GPU.
    pub num_gpu_blocks: u32,
    /// Maximum running sequences (vLLM `max_num_seqs`, default 256).
    pub max_num_seqs: usize,
    /// Token budget of one step (vLLM `max_num_batched_tokens`, default 8192, chunked prefill).
    pub max_num_batched_tokens: u32,
    /// LoRA slots on the GPU (vLLM `max_loras`).
    pub max_loras: usize,
    /// Simulated nanoseconds to load one adapter into a slot.
    pub lora_load_ns: SimNs,
    /// Whether prompt blocks are cached and reused (vLLM v1 default: on).
    pub enable_prefix_caching: bool,
    /// Streaming sequences emit accumulated tokens no more often than this (simulated ns),
    /// except the first token and the last, which are emitted at the step that makes them.
    pub stream_interval_ns: SimNs,
    /// Metric flavour (chooses histogram buckets).
    pub kind: EngineKind,
}

/// A request handed to the engine.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Exactly this many tokens are generated (at least 1).
    pub output_tokens: u32,
    /// Finish reason reported when `output_tokens` are done.
    pub finish: FinishReason,
    /// Content hashes of the prompt's full blocks, chained (see [`crate::text::block_hashes`]).
    pub block_hashes: Vec<u64>,
    /// LoRA adapter, if the request names one.
    pub adapter: Option<AdapterId>,
    /// Streaming requests get intermediate emissions; others only the final one.
    pub stream: bool,
}

/// Tokens made available to a request's client.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The request.
    pub seq: SeqId,
    /// Tokens produced since the previous emission.
    pub new_tokens: u32,
    /// Set on the last emission.
    pub finish: Option<FinishReason>,
    /// Simulated time of the step end that produced these tokens.
    pub at: SimNs,
    /// Prompt tokens served from the prefix cache (known from admission on).
    pub cached_tokens: u32,
}

/// Counters and histograms the pod's `/metrics` exposes.
#[derive(Debug, Clone)]
pub struct EngineStats {
    /// Prompt tokens of requests that produced their first token (vLLM `prompt_tokens_total`).
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Finished requests by reason: stop, length, abort.
    pub finished_stop: u64,
    /// See `finished_stop`.
    pub finished_length: u64,
    /// See `finished_stop`.
    pub finished_abort: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: u64,
    /// Sequences preempted (KV cache freed, recomputed later).
    pub preemptions: u64,
    /// Adapter loads into GPU slots.
    pub lora_loads: u64,
    /// Engine steps run.
    pub steps: u64,
    /// Time to first token, wall seconds.
    pub ttft: Histogram,
    /// Gap between consecutive tokens of a request, wall seconds.
    pub itl: Histogram,
    /// Arrival to last token, wall seconds.
    pub e2e: Histogram,
    /// Per-request mean time per output token, wall seconds (SGLang's histogram).
    pub tpot: Histogram,
    /// Hit rate of the last step that admitted requests (SGLang `cache_hit_rate`).
    pub last_prefill_hit_rate: f64,
    /// Generated tokens per wall second over the last decode-log interval (SGLang).
    pub gen_throughput: f64,
    /// `lora_requests_info` label combinations `(running, waiting)` with the simulated time
    /// they were last current, most recent last.
    pub lora_info: Vec<(Vec<AdapterId>, Vec<AdapterId>, SimNs)>,
    gen_window_tokens: u64,
    gen_window_steps: u64,
    gen_window_start: SimNs,
}

impl EngineStats {
    fn new(kind: EngineKind) -> Self {
        let (ttft, e2e) = match kind {
            EngineKind::Vllm => (VLLM_TTFT_BUCKETS, VLLM_E2E_BUCKETS),
            EngineKind::Sglang => (SGLANG_TTFT_BUCKETS, SGLANG_E2E_BUCKETS),
        };
        EngineStats {
            prompt_tokens: 0,
            generation_tokens: 0,
            finished_stop: 0,
            finished_length: 0,
            finished_abort: 0,
            prefix_queries: 0,
            prefix_hits: 0,
            preemptions: 0,
            lora_loads: 0,
            steps: 0,
            ttft: Histogram::new(ttft),
            itl: Histogram::new(VLLM_ITL_BUCKETS),
            e2e: Histogram::new(e2e),
            tpot: Histogram::new(SGLANG_TPOT_BUCKETS),
            last_prefill_hit_rate: 0.0,
            gen_throughput: 0.0,
            lora_info: Vec::new(),
            gen_window_tokens: 0,
            gen_window_steps: 0,
            gen_window_start: 0,
        }
    }

    fn count_finish(&mut self, r: FinishReason) {
        match r {
            FinishReason::Stop => self.finished_stop += 1,
            FinishReason::Length => self.finished_length += 1,
            FinishReason::Abort => self.finished_abort += 1,
        }
    }
}

/// Live gauges of an engine.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EngineGauges {
    /// Sequences in the running batch.
    pub running: usize,
    /// Sequences queued (including arrivals not yet seen by a step).
    pub waiting: usize,
    /// KV-cache usage 0..1 (referenced blocks / total).
    pub kv_usage: f64,
    /// Referenced KV blocks.
    pub used_blocks: u32,
    /// Total KV blocks.
    pub total_blocks: u32,
    /// Blocks holding a cached prefix hash.
    pub cached_blocks: usize,
    /// Adapters loaded in GPU slots, most recently used first.
    pub resident_adapters: Vec<AdapterId>,
    /// Adapters of running sequences, in order of first appearance.
    pub running_adapters: Vec<AdapterId>,
    /// Adapters of queued sequences, in queue order, without repeats.
    pub waiting_adapters: Vec<AdapterId>,
}

#[derive(Debug, Clone)]
struct Seq {
    id: SeqId,
    arrival: SimNs,
    prompt_tokens: u32,
    output_target: u32,
    finish_kind: FinishReason,
    generated: u32,
    computed: u32,
    blocks: Vec<BlockId>,
    hashes: Vec<u64>,
    adapter: Option<AdapterId>,
    stream: bool,
    first_token_at: Option<SimNs>,
    last_token_at: SimNs,
    unflushed: u32,
    last_flush: SimNs,
    cached_tokens: u32,
    admitted_once: bool,
    aborted: bool,
    done: bool,
}

impl Seq {
    fn num_tokens(&self) -> u32 {
        self.prompt_tokens + self.generated
    }
}

#[derive(Debug, Clone)]
struct Step {
    end: SimNs,
    // (index into `running`, tokens computed); `running` does not change while a step runs
    scheduled: Vec<(usize, u32)>,
}

/// One pod's engine. `Clone` lets a caller play a copy forward to see what a request would
/// meet (the benchmark's oracle router does), leaving the original untouched.
#[derive(Debug, Clone)]
pub struct Engine {
    cfg: EngineConfig,
    pool: BlockPool,
    lora: LoraSlots,
    pending: VecDeque<Seq>,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    clock: SimNs,
    current: Option<Step>,
    next_id: SeqId,
    stats: EngineStats,
}

impl Engine {
    /// An idle engine with an empty cache.
    pub fn new(cfg: EngineConfig) -> Self {
        Engine {
            pool: BlockPool::new(cfg.num_gpu_blocks),
            lora: LoraSlots::new(cfg.max_loras),
            stats: EngineStats::new(cfg.kind),
            cfg,
            pending: VecDeque::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            clock: 0,
            current: None,
            next_id: 1,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Counters and histograms.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Largest prompt + output a request may have: the model's context or the whole KV cache,
    /// whichever is smaller (vLLM refuses to start when `max_model_len` does not fit; the
    /// simulator clips instead).
    pub fn max_model_len(&self) -> u32 {
        let cache = u64::from(self.cfg.num_gpu_blocks) * u64::from(self.cfg.block_size);
        let cache = u32::try_from(cache).unwrap_or(u32::MAX);
        self.cfg.model.max_position.min(cache)
    }

    /// Queues a request that arrived at `now` (which must not be earlier than earlier
    /// arrivals). It joins the batch at the first step that starts at or after `now`.
    pub fn submit(&mut self, req: NewRequest, now: SimNs) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        let arrival = self.pending.back().map_or(now, |p| now.max(p.arrival));
        self.pending.push_back(Seq {
            id,
            arrival,
            prompt_tokens: req.prompt_tokens,
            output_target: req.output_tokens.max(1),
            finish_kind: req.finish,
            generated: 0,
            computed: 0,
            blocks: Vec::new(),
            hashes: req.block_hashes,
            adapter: req.adapter,
            stream: req.stream,
            first_token_at: None,
            last_token_at: arrival,
            unflushed: 0,
            last_flush: arrival,
            cached_tokens: 0,
            admitted_once: false,
            aborted: false,
            done: false,
        });
        id
    }

    /// Drops a request whose client went away. Running sequences leave at the end of the
    /// current step (their work in it is already committed); queued ones leave now.
    pub fn abort(&mut self, id: SeqId) {
        for q in [&mut self.pending, &mut self.waiting] {
            if let Some(pos) = q.iter().position(|s| s.id == id) {
                if let Some(s) = q.remove(pos) {
                    self.pool.free(s.blocks.iter().rev().copied());
                    self.stats.count_finish(FinishReason::Abort);
                }
                return;
            }
        }
        if let Some(s) = self.running.iter_mut().find(|s| s.id == id) {
            s.aborted = true;
        }
        if self.current.is_none() {
            self.remove_done_and_aborted(self.clock);
        }
    }

    /// True while a step is in progress (new arrivals will be picked up at its end).
    pub fn is_busy(&self) -> bool {
        self.current.is_some()
    }

    /// When the engine next needs to run: the end of the current step, or the first queued
    /// arrival if idle. `None` when there is nothing to do.
    pub fn next_wakeup(&self) -> Option<SimNs> {
        match &self.current {
            Some(step) => Some(step.end),
            None => self.pending.front().map(|p| p.arrival.max(self.clock)),
        }
    }

    /// Runs every step that ends at or before `now`, appending emissions to `out`, and starts
    /// the next step if there is work.
    pub fn advance(&mut self, now: SimNs, out: &mut Vec<Output>) {
        loop {
            if let Some(step) = self.current.take() {
                if step.end > now {
                    self.current = Some(step);
                    return;
                }
                self.finish_step(step, out);
            }
            let start = if self.running.is_empty() && self.waiting.is_empty() {
                match self.pending.front() {
                    Some(p) => p.arrival.max(self.clock),
                    None => return,
                }
            } else {
                self.clock
            };
            if start > now || !self.start_step(start) {
                return;
            }
        }
    }

    /// Current gauges.
    pub fn gauges(&self) -> EngineGauges {
        let mut running_adapters: Vec<AdapterId> = Vec::new();
        for a in self.running.iter().filter_map(|s| s.adapter) {
            if !running_adapters.contains(&a) {
                running_adapters.push(a);
            }
        }
        let mut waiting_adapters: Vec<AdapterId> = Vec::new();
        for a in self
            .waiting
            .iter()
            .chain(self.pending.iter())
            .filter_map(|s| s.adapter)
        {
            if !waiting_adapters.contains(&a) {
                waiting_adapters.push(a);
            }
        }
        EngineGauges {
            running: self.running.len(),
            waiting: self.waiting.len() + self.pending.len(),
            kv_usage: self.pool.usage(),
            used_blocks: self.pool.num_blocks() - self.pool.num_free(),
            total_blocks: self.pool.num_blocks(),
            cached_blocks: self.pool.num_cached(),
            resident_adapters: self.lora.resident(),
            running_adapters,
            waiting_adapters,
        }
    }

    fn blocks_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.cfg.block_size) as usize
    }

    /// Registers the hashes of prompt blocks that become full when tokens `[from, upto)` are
    /// computed (vLLM v1 caches blocks when it allocates them for a step). Earlier blocks were
    /// registered by earlier steps, so a long prompt costs nothing per decode step.
    fn cache_full_blocks(pool: &mut BlockPool, seq: &Seq, from: u32, upto: u32, block_size: u32) {
        let first = (from / block_size) as usize;
        let full = ((upto / block_size) as usize)
            .min(seq.hashes.len())
            .min(seq.blocks.len());
        for j in first..full {
            pool.set_hash(seq.blocks[j], seq.hashes[j]);
        }
    }

    fn preempt_last(&mut self) -> Option<Seq> {
        let mut victim = self.running.pop()?;
        self.pool.free(victim.blocks.drain(..).rev());
        victim.computed = 0;
        self.stats.preemptions += 1;
        Some(victim)
    }

    fn start_step(&mut self, t: SimNs) -> bool {
        self.clock = self.clock.max(t);
        while self.pending.front().is_some_and(|p| p.arrival <= t) {
            if let Some(s) = self.pending.pop_front() {
                self.waiting.push_back(s);
            }
        }
        let bs = self.cfg.block_size;
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut scheduled: Vec<(usize, u32)> = Vec::with_capacity(self.running.len() + 8);
        let mut work = StepWork::default();
        let mut preempted: Vec<Seq> = Vec::new();

        // 1. running sequences, in admission order
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let (computed, remaining, have) = {
                let s = &self.running[i];
                (s.computed, s.num_tokens() - s.computed, s.blocks.len())
            };
            let n = remaining.min(budget);
            let need = self.blocks_for(computed + n).saturating_sub(have);
            let mut fits = true;
            while need as u32 > self.pool.num_free() {
                let last = self.running.len() - 1;
                match self.preempt_last() {
                    Some(v) => preempted.push(v),
                    None => break,
                }
                if last == i {
                    fits = false;
                    break;
                }
            }
            if !fits {
                break;
            }
            for _ in 0..need {
                match self.pool.allocate() {
                    Some(b) => self.running[i].blocks.push(b),
                    None => break,
                }
            }
            Self::cache_full_blocks(&mut self.pool, &self.running[i], computed, computed + n, bs);
            work.add_chunk(u64::from(computed), u64::from(computed + n));
            scheduled.push((i, n));
            budget -= n;
            i += 1;
        }
        let any_preempted = !preempted.is_empty();
        // preempted sequences go back to the head of the queue, earliest admitted first
        for v in preempted {
            self.waiting.push_front(v);
        }

        // 2. waiting sequences, first come first served; none after a preemption (vLLM v1)
        let mut hit_tokens_step: u64 = 0;
        let mut query_tokens_step: u64 = 0;
        if !any_preempted {
            let mut running_loras: Vec<AdapterId> = Vec::new();
            for a in self.running.iter().filter_map(|s| s.adapter) {
                if !running_loras.contains(&a) {
                    running_loras.push(a);
                }
            }
            let mut skipped: VecDeque<Seq> = VecDeque::new();
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(seq) = self.waiting.front() else {
                    break;
                };
                if let Some(a) = seq.adapter {
                    if !running_loras.contains(&a) && running_loras.len() >= self.cfg.max_loras {
                        if let Some(s) = self.waiting.pop_front() {
                            skipped.push_back(s);
                        }
                        continue;
                    }
                }
                let num_tokens = seq.num_tokens();
                let hits: Vec<BlockId> = if self.cfg.enable_prefix_caching && seq.computed == 0 {
                    // vLLM v1 always recomputes the last prompt token
                    let max_hit = ((num_tokens.saturating_sub(1)) / bs) as usize;
                    let n = max_hit.min(seq.hashes.len());
                    self.pool.lookup_prefix(&seq.hashes[..n])
                } else {
                    Vec::new()
                };
                let computed = hits.len() as u32 * bs;
                let n = (num_tokens - computed).min(budget);
                let need = self.blocks_for(computed + n).saturating_sub(hits.len());
                let available = self.pool.num_free() - self.pool.count_unreferenced(&hits);
                if need as u32 > available {
                    break;
                }
                let Some(mut seq) = self.waiting.pop_front() else {
                    break;
                };
                for &b in &hits {
                    self.pool.touch(b);
                }
                seq.blocks = hits;
                for _ in 0..need {
                    match self.pool.allocate() {
                        Some(b) => seq.blocks.push(b),
                        None => break,
                    }
                }
                seq.computed = computed;
                if !seq.admitted_once {
                    seq.admitted_once = true;
                    seq.cached_tokens = computed;
                    self.stats.prefix_queries += u64::from(num_tokens);
                    self.stats.prefix_hits += u64::from(computed);
                }
                query_tokens_step += u64::from(num_tokens);
                hit_tokens_step += u64::from(computed);
                Self::cache_full_blocks(&mut self.pool, &seq, computed, computed + n, bs);
                work.add_chunk(u64::from(computed), u64::from(computed + n));
                if let Some(a) = seq.adapter {
                    if !running_loras.contains(&a) {
                        running_loras.push(a);
                    }
                }
                self.running.push(seq);
                scheduled.push((self.running.len() - 1, n));
                budget -= n;
            }
            while let Some(s) = skipped.pop_back() {
                self.waiting.push_front(s);
            }
        }
        if query_tokens_step > 0 {
            self.stats.last_prefill_hit_rate = hit_tokens_step as f64 / query_tokens_step as f64;
        }
        if scheduled.is_empty() {
            return false;
        }

        // 3. adapters of the batch must be resident; each load stalls the step
        let mut batch_loras: Vec<AdapterId> = Vec::new();
        for &(idx, _) in &scheduled {
            if let Some(a) = self.running[idx].adapter {
                if !batch_loras.contains(&a) {
                    batch_loras.push(a);
                }
            }
        }
        let loads = if batch_loras.is_empty() {
            0
        } else {
            self.lora.activate(&batch_loras)
        };
        self.stats.lora_loads = self.lora.loads();

        let secs = step_seconds(self.cfg.gpu, self.cfg.model, &work, self.cfg.speed);
        let dur = (secs * 1e9).ceil() as SimNs + u64::from(loads) * self.cfg.lora_load_ns;
        self.current = Some(Step {
            end: t + dur.max(1),
            scheduled,
        });
        self.stats.steps += 1;
        true
    }

    fn wall_secs(&self, ns: SimNs) -> f64 {
        ns as f64 / 1e9 / self.cfg.time_scale
    }

    fn finish_step(&mut self, step: Step, out: &mut Vec<Output>) {
        let end = step.end;
        self.clock = end;
        // inter-token gaps, grouped: most sequences of a decode step share the previous step end
        let mut gaps: Vec<(SimNs, u64)> = Vec::new();
        let mut produced: u64 = 0;
        for &(idx, n) in &step.scheduled {
            let interval = self.cfg.stream_interval_ns;
            let Some(seq) = self.running.get_mut(idx) else {
                continue;
            };
            seq.computed += n;
            if seq.aborted || seq.computed < seq.num_tokens() {
                continue;
            }
            seq.generated += 1;
            produced += 1;
            let first = seq.first_token_at.is_none();
            if first {
                seq.first_token_at = Some(end);
                self.stats.prompt_tokens += u64::from(seq.prompt_tokens);
                let ttft = (end - seq.arrival) as f64 / 1e9 / self.cfg.time_scale;
                self.stats.ttft.observe(ttft);
            } else {
                let gap = end - seq.last_token_at;
                match gaps.iter_mut().find(|(g, _)| *g == gap) {
                    Some(entry) => entry.1 += 1,
                    None => gaps.push((gap, 1)),
                }
            }
            seq.last_token_at = end;
            seq.unflushed += 1;
            let done = seq.generated >= seq.output_target;
            let due = seq.stream && (first || end.saturating_sub(seq.last_flush) >= interval);
            if done || due {
                out.push(Output {
                    seq: seq.id,
                    new_tokens: seq.unflushed,
                    finish: done.then_some(seq.finish_kind),
                    at: end,
                    cached_tokens: seq.cached_tokens,
                });
                seq.unflushed = 0;
                seq.last_flush = end;
            }
            seq.done = done;
        }
        for (gap, count) in gaps {
            let v = self.wall_secs(gap);
            self.stats.itl.observe_n(v, count);
        }
        self.stats.generation_tokens += produced;
        self.stats.gen_window_tokens += produced;
        self.stats.gen_window_steps += 1;
        if self.stats.gen_window_steps >= SGLANG_DECODE_LOG_INTERVAL {
            let span = self.wall_secs(end.saturating_sub(self.stats.gen_window_start));
            if span > 0.0 {
                self.stats.gen_throughput = self.stats.gen_window_tokens as f64 / span;
            }
            self.stats.gen_window_tokens = 0;
            self.stats.gen_window_steps = 0;
            self.stats.gen_window_start = end;
        }
        self.remove_done_and_aborted(end);
        if self.cfg.max_loras > 0 {
            self.record_lora_info(end);
        }
    }

    fn remove_done_and_aborted(&mut self, now: SimNs) {
        if !self.running.iter().any(|s| s.done || s.aborted) {
            return;
        }
        let running = std::mem::take(&mut self.running);
        for mut s in running {
            if s.done || s.aborted {
                self.pool.free(s.blocks.drain(..).rev());
                if s.aborted {
                    self.stats.count_finish(FinishReason::Abort);
                    continue;
                }
                self.stats.count_finish(s.finish_kind);
                let e2e = self.wall_secs(now - s.arrival);
                self.stats.e2e.observe(e2e);
                if let (Some(first), true) = (s.first_token_at, s.generated > 1) {
                    let per = self.wall_secs(now - first) / f64::from(s.generated - 1);
                    self.stats.tpot.observe(per);
                }
            } else {
                self.running.push(s);
            }
        }
    }

    fn record_lora_info(&mut self, now: SimNs) {
        let g = self.gauges();
        let key = (g.running_adapters, g.waiting_adapters);
        let info = &mut self.stats.lora_info;
        if let Some(pos) = info.iter().position(|(r, w, _)| *r == key.0 && *w == key.1) {
            let mut e = info.remove(pos);
            e.2 = now;
            info.push(e);
        } else {
            info.push((key.0, key.1, now));
            if info.len() > MAX_LORA_INFO_SERIES {
                info.remove(0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profiles::{gpu, model};

    const MS: SimNs = 1_000_000;

    fn cfg(blocks: u32) -> EngineConfig {
        EngineConfig {
            gpu: gpu("h100").unwrap(),
            model: model("meta-llama/Llama-3.1-8B-Instruct", None).unwrap(),
            speed: 1.0,
            time_scale: 1.0,
            block_size: 16,
            num_gpu_blocks: blocks,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_loras: 2,
            lora_load_ns: 25 * MS,
            enable_prefix_caching: true,
            stream_interval_ns: 0,
            kind: EngineKind::Vllm,
        }
    }

    fn req(prompt_tokens: u32, out: u32, hashes: Vec<u64>) -> NewRequest {
        NewRequest {
            prompt_tokens,
            output_tokens: out,
            finish: FinishReason::Length,
            block_hashes: hashes,
            adapter: None,
            stream: true,
        }
    }

    /// Runs until idle; returns every emission.
    fn run(e: &mut Engine) -> Vec<Output> {
        let mut out = Vec::new();
        let mut guard = 0;
        while let Some(t) = e.next_wakeup() {
            e.advance(t, &mut out);
            guard += 1;
            assert!(guard < 1_000_000, "engine does not settle");
        }
        out
    }

    fn first_token_time(out: &[Output], id: SeqId) -> SimNs {
        out.iter().find(|o| o.seq == id).unwrap().at
    }

    #[test]
    fn generates_exactly_the_requested_tokens() {
        let mut e = Engine::new(cfg(10_000));
        let id = e.submit(req(100, 7, vec![]), 0);
        let out = run(&mut e);
        let mine: Vec<_> = out.iter().filter(|o| o.seq == id).collect();
        assert_eq!(mine.iter().map(|o| o.new_tokens).sum::<u32>(), 7);
        assert_eq!(mine.last().unwrap().finish, Some(FinishReason::Length));
        assert_eq!(e.stats().generation_tokens, 7);
        assert_eq!(e.stats().finished_length, 1);
        assert_eq!(e.gauges().kv_usage, 0.0);
    }

    #[test]
    fn prefix_hit_skips_prefill() {
        let hashes: Vec<u64> = (1..=125).collect(); // 2000 tokens = 125 full blocks
        let mut cold = Engine::new(cfg(10_000));
        let a = cold.submit(req(2000, 1, hashes.clone()), 0);
        let out = run(&mut cold);
        let cold_ttft = first_token_time(&out, a);

        // the second request shares all blocks: only the last block is recomputed
        let b = cold.submit(req(2000, 1, hashes.clone()), cold.clock + 1000 * MS);
        let start = cold.clock + 1000 * MS;
        let out = run(&mut cold);
        let warm_ttft = first_token_time(&out, b) - start;
        assert!(
            warm_ttft * 5 < cold_ttft,
            "warm {warm_ttft} cold {cold_ttft}"
        );
        assert_eq!(cold.stats().prefix_queries, 4000);
        assert_eq!(cold.stats().prefix_hits, 124 * 16);
    }

    #[test]
    fn requests_queue_when_blocks_run_out() {
        // 20 blocks = 320 tokens: two 200-token prompts cannot both be resident
        let mut e = Engine::new(cfg(20));
        let a = e.submit(req(200, 50, vec![]), 0);
        let b = e.submit(req(200, 50, vec![]), 0);
        let mut out = Vec::new();
        e.advance(0, &mut out);
        let g = e.gauges();
        assert_eq!((g.running, g.waiting), (1, 1));
        let out = run(&mut e);
        let a_done = out
            .iter()
            .find(|o| o.seq == a && o.finish.is_some())
            .unwrap()
            .at;
        let b_first = first_token_time(&out, b);
        assert!(b_first > a_done, "b started before a freed its blocks");
    }

    #[test]
    fn decode_growth_preempts_the_newest_sequence() {
        // 16 blocks; two sequences of 100 prompt tokens (7 blocks each) growing by 60 tokens
        let mut e = Engine::new(cfg(16));
        let a = e.submit(req(100, 60, vec![]), 0);
        let b = e.submit(req(100, 60, vec![]), 0);
        let out = run(&mut e);
        assert!(e.stats().preemptions >= 1);
        for id in [a, b] {
            let n: u32 = out
                .iter()
                .filter(|o| o.seq == id)
                .map(|o| o.new_tokens)
                .sum();
            assert_eq!(n, 60);
        }
        // the older sequence is never the victim, so it finishes first
        let done = |id| {
            out.iter()
                .find(|o| o.seq == id && o.finish.is_some())
                .unwrap()
                .at
        };
        assert!(done(a) < done(b));
    }

    #[test]
    fn lora_slots_load_evict_and_wait() {
        let mut e = Engine::new(cfg(10_000));
        let mk = |adapter| NewRequest {
            adapter: Some(adapter),
            ..req(64, 20, vec![])
        };
        let a = e.submit(mk(0), 0);
        let b = e.submit(mk(1), 0);
        let c = e.submit(mk(2), 0); // both slots pinned by running a and b: must wait
        let mut out = Vec::new();
        e.advance(0, &mut out);
        let g = e.gauges();
        assert_eq!((g.running, g.waiting), (2, 1));
        assert_eq!(e.stats().lora_loads, 2);
        let out = run(&mut e);
        let a_done = out
            .iter()
            .find(|o| o.seq == a && o.finish.is_some())
            .unwrap()
            .at;
        assert!(first_token_time(&out, c) > a_done);
        assert!(first_token_time(&out, b) < a_done);
        assert_eq!(e.stats().lora_loads, 3);
        // the adapter used most recently stays; 2 evicted one of 0/1
        let resident = e.gauges().resident_adapters;
        assert_eq!(resident.len(), 2);
        assert_eq!(resident[0], 2);
        // loading costs time: a cold adapter's TTFT exceeds a warm one's by the load time
        let warm = e.submit(mk(2), e.clock + 100 * MS);
        let t0 = e.clock + 100 * MS;
        let out = run(&mut e);
        let warm_ttft = first_token_time(&out, warm) - t0;
        let cold_ttft = first_token_time(&out_first(&mut Engine::new(cfg(10_000)), mk(2)), 1);
        assert!(cold_ttft >= warm_ttft + 25 * MS, "{cold_ttft} {warm_ttft}");
    }

    fn out_first(e: &mut Engine, r: NewRequest) -> Vec<Output> {
        e.submit(r, 0);
        run(e)
    }

    #[test]
    fn same_inputs_same_outputs() {
        let go = || {
            let mut e = Engine::new(cfg(200));
            for i in 0..30u64 {
                let hashes: Vec<u64> = (0..(i % 5)).map(|j| j + 100 * (i % 3)).collect();
                e.submit(
                    req(50 + (i as u32 * 37) % 300, 5 + (i as u32 * 13) % 40, hashes),
                    i * 3 * MS,
                );
            }
            (run(&mut e), e.stats().prefix_hits, e.stats().preemptions)
        };
        assert_eq!(go(), go());
    }

    #[test]
    fn time_scale_compresses_wall_durations_only() {
        let measure = |scale: f64| {
            let mut c = cfg(10_000);
            c.time_scale = scale;
            let mut e = Engine::new(c);
            let id = e.submit(req(500, 10, vec![]), 0);
            let out = run(&mut e);
            (first_token_time(&out, id), e.stats().ttft.sum())
        };
        let (sim1, wall1) = measure(1.0);
        let (sim10, wall10) = measure(10.0);
        assert_eq!(sim1, sim10, "simulated time must not depend on the scale");
        assert!((wall1 / wall10 - 10.0).abs() < 1e-9, "{wall1} {wall10}");
    }

    #[test]
    fn streaming_emissions_are_coalesced_by_interval() {
        let mut c = cfg(10_000);
        c.stream_interval_ns = 50 * MS; // a decode step is ~7 ms: ~7 tokens per emission
        let mut e = Engine::new(c);
        let id = e.submit(req(100, 100, vec![]), 0);
        let out = run(&mut e);
        let mine: Vec<_> = out.iter().filter(|o| o.seq == id).collect();
        assert_eq!(
            mine[0].new_tokens, 1,
            "first token is emitted alone, at once"
        );
        assert!(mine.len() < 25, "{} emissions", mine.len());
        assert_eq!(mine.iter().map(|o| o.new_tokens).sum::<u32>(), 100);
    }

    #[test]
    fn l40s_pod_serves_a_conversation_batch_about_three_times_slower() {
        // 32 requests shaped like the Azure conversation trace means (1155 in, 211 out)
        let makespan = |g: &str| {
            let mut c = cfg(100_000);
            c.gpu = gpu(g).unwrap();
            let mut e = Engine::new(c);
            for i in 0..32 {
                e.submit(req(1155, 211, vec![]), i * 50 * MS);
            }
            run(&mut e);
            e.clock
        };
        let ratio = makespan("l40s") as f64 / makespan("h100") as f64;
        println!("l40s/h100 makespan ratio {ratio:.2}");
        // bounded by the datasheet compute (2.73x) and bandwidth (3.88x) ratios
        assert!(ratio > 2.7 && ratio < 3.9, "{ratio}");
    }

    #[test]
    fn abort_frees_blocks() {
        let mut e = Engine::new(cfg(1000));
        let id = e.submit(req(300, 1000, vec![]), 0);
        let mut out = Vec::new();
        e.advance(0, &mut out);
        e.advance(50 * MS, &mut out);
        assert!(e.gauges().kv_usage > 0.0);
        e.abort(id);
        run(&mut e);
        assert_eq!(e.gauges().kv_usage, 0.0);
        assert_eq!(e.stats().finished_abort, 1);
        assert_eq!(e.next_wakeup(), None);
    }
}
