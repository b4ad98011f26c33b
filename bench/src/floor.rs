//! The TTFT floor of a workload on a fleet: the best time to first token any router could give
//! each request, so a target can be read against what is physically possible.
//!
//! A request's floor is its TTFT on an **idle** pod that already holds, in its prefix cache,
//! every leading block of the prompt that **any earlier request** of the workload sent (an
//! infinite cache shared by the whole fleet), on the fastest pod that serves its model, with its
//! LoRA adapter (if any) already resident. No router can beat it: a real pod is never better
//! than idle, its cache holds at most what was sent before, and routing cannot make a pod
//! faster. What it leaves out (queueing, evictions, adapter loads, the proxy) only adds time.
//!
//! The time comes from fleet-sim's own engine, not from a formula beside it: for each request
//! and each distinct pod profile, a fresh engine first computes the cached prefix (so the
//! blocks sit in its cache exactly as the simulated pod would hold them), then the request
//! arrives and the first token's step end is read. The integration test
//! `floor_matches_an_idle_simulated_pod` holds this to the TTFT a real simulated pod measures.

use std::collections::{HashMap, HashSet};

use fleet_sim::config::{FleetConfig, PodConfig};
use fleet_sim::engine::{Engine, EngineConfig, FinishReason, NewRequest, Output, SimNs};
use fleet_sim::text as sim_text;

use crate::results::{Percentiles, TtftReferences};
use crate::scenario::Scenario;
use crate::workload::{TimedRequest, Workload};

/// Each request's floor in wall milliseconds, in workload order; `None` where no pod of the
/// fleet serves the request's model or the request does not fit the model's context (the pod
/// answers those with an error, whatever the router). A request for `n` choices gets the floor
/// of one: its other choices can only delay its first token.
pub fn ttft_floor_ms(requests: &[TimedRequest], fleet: &FleetConfig) -> Vec<Option<f64>> {
    let profiles = distinct_profiles(fleet);
    // Block hashes each profile's block size has seen so far (the hash chain starts from the
    // model name, so one set serves every model).
    let mut seen: HashMap<u32, HashSet<u64>> = HashMap::new();
    requests
        .iter()
        .map(|req| {
            let mut sim = SimPrompt::new(req);
            let mut best: Option<f64> = None;
            for p in profiles.iter().filter(|p| serves(p, &req.model)) {
                let e = &p.engine;
                let set = seen.entry(e.block_size).or_default();
                let (tokens, output) = (sim.tokens, sim.output);
                let hashes = sim.hashes(e);
                let cached = hashes.iter().take_while(|h| set.contains(h)).count();
                if let Some(ms) = idle_ttft_ms(e, tokens, output, hashes, cached) {
                    best = Some(best.map_or(ms, |b: f64| b.min(ms)));
                }
            }
            // Only a request some pod accepts leaves its blocks in a cache.
            if best.is_some() {
                for (bs, hashes) in sim.hashed {
                    seen.entry(bs).or_default().extend(hashes);
                }
            }
            best
        })
        .collect()
}

/// Each request's TTFT (wall ms, workload order) under the **greedy oracle router**: every
/// request goes to the pod where, given the exact state of every engine when it arrives (queues,
/// batches, caches, adapters), its first token would come soonest, found by playing a copy of
/// each candidate engine forward. It knows everything a router could know about the present and
/// nothing about later arrivals, as a real router; unlike one, it reads the engines directly
/// instead of metrics a scrape old. The TTFT reported is what the request then gets in the
/// simulation of the whole workload (later arrivals batched beside it can delay it). Not a
/// lower bound (other choices can help later requests), but the reference for what routing on
/// perfect information reaches. `None` where no pod serves the model or the request does not
/// fit its context.
pub fn oracle_ttft_ms(requests: &[TimedRequest], fleet: &FleetConfig) -> Vec<Option<f64>> {
    let mut oracle = Oracle {
        engines: fleet
            .pods
            .iter()
            .map(|p| Engine::new(p.engine.clone()))
            .collect(),
        waiting: HashMap::new(),
        ttft: vec![None; requests.len()],
        out: Vec::new(),
    };
    for (r, req) in requests.iter().enumerate() {
        let mut sim = SimPrompt::new(req);
        // (wall ns of the first token, pod, request, arrival)
        let mut best: Option<(f64, usize, NewRequest, SimNs)> = None;
        for (i, pod) in fleet.pods.iter().enumerate() {
            if !serves(pod, &req.model) {
                continue;
            }
            let cfg = &pod.engine;
            let now = (req.at_s.max(0.0) * cfg.time_scale * 1e9) as SimNs;
            oracle.advance(i, now);
            let engine = &oracle.engines[i];
            if !sim.fits(engine) {
                continue;
            }
            let new = sim.engine_request(pod);
            // A request for n choices is n requests of the engine (as vLLM runs them); its
            // first token is the first of any.
            let mut probe = engine.clone();
            let ids: Vec<u64> = (0..req.n.max(1))
                .map(|_| probe.submit(new.clone(), now))
                .collect();
            let mut scratch = Vec::new();
            let Some(first) = run_until(&mut probe, &mut scratch, |o| {
                ids.contains(&o.seq) && o.new_tokens > 0
            }) else {
                continue;
            };
            // in wall time, so pods of different time scales compare
            let wall = first.saturating_sub(now) as f64 / cfg.time_scale;
            if best.as_ref().is_none_or(|b| wall < b.0) {
                best = Some((wall, i, new, now));
            }
        }
        if let Some((_, i, new, now)) = best {
            for _ in 0..req.n.max(1) {
                let id = oracle.engines[i].submit(new.clone(), now);
                oracle.waiting.insert((i, id), (r, now));
            }
        }
    }
    oracle.drain(&fleet.pods);
    oracle.ttft
}

/// The oracle's simulation: one engine per pod, and the requests waiting for a first token.
struct Oracle {
    engines: Vec<Engine>,
    /// (pod, sequence) -> (request, arrival).
    waiting: HashMap<(usize, u64), (usize, SimNs)>,
    ttft: Vec<Option<f64>>,
    out: Vec<Output>,
}

impl Oracle {
    /// Runs pod `i`'s engine to `now`, recording first tokens.
    fn advance(&mut self, i: usize, now: SimNs) {
        self.engines[i].advance(now, &mut self.out);
        for o in self.out.drain(..) {
            if o.new_tokens == 0 {
                continue;
            }
            if let Some((r, at)) = self.waiting.remove(&(i, o.seq)) {
                // A request's first token is its first choice's.
                if self.ttft[r].is_none() {
                    let scale = self.engines[i].config().time_scale;
                    self.ttft[r] = Some(o.at.saturating_sub(at) as f64 / scale / 1e6);
                }
            }
        }
    }

    /// Runs every engine until each of its requests has its first token.
    fn drain(&mut self, pods: &[PodConfig]) {
        for i in 0..pods.len() {
            for _ in 0..10_000_000 {
                if !self.waiting.keys().any(|k| k.0 == i) {
                    break;
                }
                let Some(t) = self.engines[i].next_wakeup() else {
                    break;
                };
                self.advance(i, t);
            }
        }
    }
}

/// A scenario file's workload (its quick variant with `quick`) and its resolved fleet: the
/// inputs of [`ttft_floor_ms`] and [`oracle_ttft_ms`].
pub fn scenario_parts(
    scenario: &Scenario,
    path: &std::path::Path,
    quick: bool,
) -> Result<(Workload, FleetConfig), String> {
    let fleet: fleet_sim::FleetFile = serde_json::from_value(scenario.fleet.clone())
        .map_err(|e| format!("{}: fleet is not a fleet-sim file: {e}", scenario.name))?;
    let fleet = fleet
        .resolve(fleet_sim::Overrides::default())
        .map_err(|e| format!("{}: {e}", scenario.name))?;
    let workload = Workload::build(&scenario.workload_config(quick), path.parent())
        .map_err(|e| format!("{}: {e}", scenario.name))?;
    Ok((workload, fleet))
}

/// Both references of `requests` on `fleet`, as percentiles; `None` when no request has one.
pub fn references(requests: &[TimedRequest], fleet: &FleetConfig) -> Option<TtftReferences> {
    Some(TtftReferences {
        floor_ms: present_percentiles(&ttft_floor_ms(requests, fleet))?,
        oracle_ms: present_percentiles(&oracle_ttft_ms(requests, fleet))?,
    })
}

/// Percentiles of the values that exist (`None` when none does).
pub fn present_percentiles(floors: &[Option<f64>]) -> Option<Percentiles> {
    let p = Percentiles::of(floors.iter().flatten().copied());
    (p.count > 0).then_some(p)
}

/// A request as a simulated pod reads it: prompt and output tokens, and the prompt's block
/// hashes per block size, computed once (empty where the pod does not cache prefixes, as the
/// pod's HTTP layer passes them).
pub(crate) struct SimPrompt<'a> {
    req: &'a TimedRequest,
    text: String,
    pub(crate) tokens: u32,
    pub(crate) output: u32,
    hashed: HashMap<u32, Vec<u64>>,
}

impl<'a> SimPrompt<'a> {
    pub(crate) fn new(req: &'a TimedRequest) -> Self {
        let text = req.prompt.text();
        SimPrompt {
            req,
            tokens: sim_text::prompt_tokens(&text),
            output: u32::try_from(req.max_tokens.max(1)).unwrap_or(u32::MAX),
            text,
            hashed: HashMap::new(),
        }
    }

    pub(crate) fn hashes(&mut self, cfg: &EngineConfig) -> &[u64] {
        if !cfg.enable_prefix_caching {
            return &[];
        }
        let (text, model) = (&self.text, &self.req.model);
        self.hashed
            .entry(cfg.block_size)
            .or_insert_with(|| sim_text::block_hashes(text, cfg.block_size, model))
    }

    /// The request as pod `pod` submits it to its engine: its blocks at the pod's block size,
    /// its adapter's slot in the pod's list when it names one.
    pub(crate) fn engine_request(&mut self, pod: &PodConfig) -> NewRequest {
        let mut new = request(self.tokens, self.output, self.hashes(&pod.engine).to_vec());
        new.adapter = pod
            .adapters
            .iter()
            .position(|a| *a == self.req.model)
            .and_then(|a| u16::try_from(a).ok());
        new
    }

    pub(crate) fn fits(&self, engine: &Engine) -> bool {
        fits(self.tokens, self.output, engine)
    }
}

/// Prompt plus output fit the model's context on `engine` (the pod refuses them otherwise).
fn fits(tokens: u32, output: u32, engine: &Engine) -> bool {
    u64::from(tokens) + u64::from(output) <= u64::from(engine.max_model_len())
}

pub(crate) fn serves(pod: &PodConfig, model: &str) -> bool {
    pod.model == model || pod.adapters.iter().any(|a| a == model)
}

/// One pod per distinct engine profile (GPU, model, speed and engine settings); pods of the same
/// profile have the same floor.
fn distinct_profiles(fleet: &FleetConfig) -> Vec<PodConfig> {
    let mut out: Vec<PodConfig> = Vec::new();
    for pod in &fleet.pods {
        let key = |p: &PodConfig| {
            let e = &p.engine;
            (
                p.model.clone(),
                p.adapters.clone(),
                e.gpu.name,
                e.model.key,
                e.speed.to_bits(),
                e.time_scale.to_bits(),
                (e.block_size, e.num_gpu_blocks, e.max_num_batched_tokens),
                e.enable_prefix_caching,
            )
        };
        if !out.iter().any(|o| key(o) == key(pod)) {
            out.push(pod.clone());
        }
    }
    out
}

/// TTFT (wall ms) of a request of `tokens` prompt tokens arriving at an idle engine of `cfg`
/// whose cache holds the first `cached` of its full blocks.
fn idle_ttft_ms(
    cfg: &EngineConfig,
    tokens: u32,
    output: u32,
    hashes: &[u64],
    cached: usize,
) -> Option<f64> {
    let mut engine = Engine::new(cfg.clone());
    if !fits(tokens, output, &engine) {
        return None;
    }
    let mut out = Vec::new();
    let mut now: SimNs = 0;
    if cached > 0 {
        let warm_tokens = u32::try_from(cached).ok()?.checked_mul(cfg.block_size)?;
        engine.submit(request(warm_tokens, 1, hashes.get(..cached)?.to_vec()), 0);
        now = run_until(&mut engine, &mut out, |_| false)?;
        out.clear();
    }
    let id = engine.submit(request(tokens, output.min(2), hashes.to_vec()), now);
    let first = run_until(&mut engine, &mut out, |o| o.seq == id && o.new_tokens > 0)?;
    Some(first.saturating_sub(now) as f64 / cfg.time_scale / 1e6)
}

fn request(prompt_tokens: u32, output_tokens: u32, block_hashes: Vec<u64>) -> NewRequest {
    NewRequest {
        prompt_tokens,
        output_tokens,
        finish: FinishReason::Length,
        block_hashes,
        adapter: None,
        stream: true,
    }
}

/// Steps the engine until an emission satisfies `done` (returns its time) or, with a `done`
/// that never holds, until the engine is idle (returns the last step's end). A bounded loop: a
/// request of a few hundred thousand tokens takes a few dozen steps.
fn run_until(
    engine: &mut Engine,
    out: &mut Vec<Output>,
    done: impl Fn(&Output) -> bool,
) -> Option<SimNs> {
    let mut last = 0;
    for _ in 0..1_000_000 {
        let Some(t) = engine.next_wakeup() else {
            return Some(last);
        };
        engine.advance(t, out);
        last = t;
        if let Some(o) = out.iter().find(|o| done(o)) {
            return Some(o.at);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::workload::{Api, PromptSpec};
    use fleet_sim::{FleetFile, Overrides};

    fn fleet(json: &str) -> FleetConfig {
        FleetFile::parse(json)
            .unwrap()
            .resolve(Overrides::default())
            .unwrap()
    }

    const MIXED: &str = r#"{"pods": [
        {"name": "fast", "count": 2, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "h100"},
        {"name": "slow", "count": 2, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "l40s"}
    ]}"#;

    fn req(group: u64, id: u64, prefix_chars: usize, chars: usize) -> TimedRequest {
        TimedRequest {
            at_s: id as f64,
            api: Api::Chat,
            model: "meta-llama/Llama-3.1-8B-Instruct".into(),
            prompt: PromptSpec::Prefixed {
                group,
                prefix_chars,
                seed: 7,
                id,
                chars,
            },
            max_tokens: 16,
            n: 1,
        }
    }

    #[test]
    fn a_prefix_sent_before_lowers_the_floor_and_a_new_one_does_not() {
        let f = fleet(MIXED);
        // three requests of the same length: the second shares the first's 16,000-character
        // prefix, the third has a prefix of its own
        let floors = ttft_floor_ms(
            &[
                req(1, 1, 16_000, 400),
                req(1, 2, 16_000, 400),
                req(2, 3, 16_000, 400),
            ],
            &f,
        );
        let [a, b, c] = [floors[0].unwrap(), floors[1].unwrap(), floors[2].unwrap()];
        assert!(b < a / 4.0, "cached prefix: {b} vs {a}");
        assert!(
            (c - a).abs() < 1e-9,
            "unseen prefix costs the same: {c} vs {a}"
        );
    }

    #[test]
    fn the_floor_is_the_fastest_pod_and_grows_with_the_prompt() {
        let mixed = fleet(MIXED);
        let slow_only = fleet(
            r#"{"pods": [{"name": "slow", "count": 2, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "l40s"}]}"#,
        );
        let short = [req(1, 1, 0, 2_000)];
        let long = [req(2, 1, 0, 20_000)];
        let (m_short, m_long) = (
            ttft_floor_ms(&short, &mixed)[0].unwrap(),
            ttft_floor_ms(&long, &mixed)[0].unwrap(),
        );
        let s_long = ttft_floor_ms(&long, &slow_only)[0].unwrap();
        assert!(m_long > 5.0 * m_short, "{m_long} vs {m_short}");
        // prefill is compute-bound: L40S / H100 = 989 / 362 TFLOPS = 2.7x
        let r = s_long / m_long;
        assert!((2.4..3.0).contains(&r), "{r}");
    }

    #[test]
    fn the_oracle_spreads_simultaneous_prompts_and_follows_the_cache() {
        let two = fleet(
            r#"{"pods": [{"name": "a", "count": 2, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "a100"}]}"#,
        );
        let one = fleet(
            r#"{"pods": [{"name": "a", "count": 1, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "a100"}]}"#,
        );
        // two different long prompts at the same instant, then the first's prefix again once
        // both are done
        let mut reqs = vec![
            req(1, 1, 16_000, 400),
            req(2, 2, 16_000, 400),
            req(1, 3, 16_000, 400),
        ];
        reqs[0].at_s = 0.0;
        reqs[1].at_s = 0.0;
        reqs[2].at_s = 5.0;
        let floors = ttft_floor_ms(&reqs, &two);
        let spread = oracle_ttft_ms(&reqs, &two);
        let queued = oracle_ttft_ms(&reqs, &one);
        for i in 0..3 {
            // two pods: nobody waits, and the repeat finds its prefix
            let (o, f) = (spread[i].unwrap(), floors[i].unwrap());
            assert!(
                (o - f).abs() < 0.01 * f + 0.5,
                "request {i}: oracle {o} vs floor {f}"
            );
        }
        // one pod: the second prompt waits for (most of) the first one's prefill, and the
        // repeat still hits the cache
        let (q0, q1) = (queued[0].unwrap(), queued[1].unwrap());
        assert!(q1 > 1.5 * q0, "{q0} {q1}");
        assert!(queued[2].unwrap() < q0 / 4.0, "{queued:?}");
    }

    #[test]
    fn the_oracle_runs_each_choice_as_a_request() {
        let one = fleet(
            r#"{"pods": [{"name": "a", "count": 1, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct", "gpu": "a100"}]}"#,
        );
        // A long prompt, then a short one just after it on the same pod: the first's choices
        // are in the batch the second joins.
        let ttft_after = |n: u32| {
            let mut first = req(1, 1, 0, 40_000);
            first.at_s = 0.0;
            first.n = n;
            first.max_tokens = 500;
            let mut second = req(2, 2, 0, 400);
            second.at_s = 0.5;
            let t = oracle_ttft_ms(&[first, second], &one);
            (t[0].unwrap(), t[1].unwrap())
        };
        let (single, after_single) = ttft_after(1);
        let (sampled, after_sampled) = ttft_after(32);
        // The first token of a request for 32 choices comes with the first choice's (its
        // prefill, shared once cached); the request after it meets 32 decoding sequences.
        assert!(sampled < 1.5 * single, "{single} {sampled}");
        assert!(
            after_sampled > after_single,
            "{after_single} {after_sampled}"
        );
    }

    #[test]
    fn unserved_models_and_oversized_prompts_have_no_floor() {
        let f = fleet(MIXED);
        let mut other = req(1, 1, 0, 100);
        other.model = "unknown".into();
        // 131,072-token context: a 600,000-character prompt is ~150,000 tokens
        let huge = req(2, 2, 0, 600_000);
        let reqs = [other, huge, req(3, 3, 0, 100)];
        let floors = ttft_floor_ms(&reqs, &f);
        assert_eq!(floors[0], None);
        assert_eq!(floors[1], None);
        assert!(floors[2].is_some());
        let oracle = oracle_ttft_ms(&reqs, &f);
        assert_eq!(&oracle[..2], &[None, None]);
        assert!(oracle[2].is_some());
        let p = present_percentiles(&floors).unwrap();
        assert_eq!(p.count, 1);
        assert_eq!(present_percentiles(&[None]), None);
        // both references, as percentiles of the requests that have them
        let refs = references(&reqs, &f).unwrap();
        assert_eq!((refs.floor_ms.count, refs.oracle_ms.count), (1, 1));
        assert!(refs.oracle_ms.p50 >= refs.floor_ms.p50 - 1e-6);
        assert_eq!(references(&reqs[..2], &f), None);
    }
}
