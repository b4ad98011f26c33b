//! Endpoint picking: candidates -> saturation filter -> weighted scorers -> best first.
//!
//! Inputs are plain values (the decoded pool, the shared in-flight table, the request's
//! features, the snapshot's age, an RNG), so a decision is reproducible from them.
//!
//! Every scorer returns 0..1 (higher is better); the total is the weighted mean over the scorers
//! that apply to the request (LoRA only for adapter requests, prefix only for prompts of at least
//! one block). Load is normalised by each pod's `capacity`, so a pod three times faster is
//! expected to hold three times the queue at equal score: traffic follows serving speed.
//! Ties go to a random candidate drawn in proportion to capacity, which also spreads traffic by
//! speed on an idle fleet.

use crate::config::{ScoringConfig, Weights};
use crate::fleet::{PodState, PoolState};
use crate::load::PodLoad;
use crate::prefix::{hrw_weight, weighted_hrw, PodMatch};
use crate::rng::SplitMix64;
use std::fmt::Write as _;

/// What the picker knows about a request.
#[derive(Debug, Clone, Default)]
pub struct RequestFeatures<'a> {
    /// [`crate::fleet::adapter_key`] of the LoRA adapter, for adapter requests.
    pub adapter: Option<u64>,
    /// Estimated prompt tokens (KV blocks the request will take).
    pub prompt_tokens: u32,
    /// Recent mean prompt tokens per request (this worker's moving average): the unit in which
    /// queued prefill work is counted. 0 = unknown (every request counts as one unit).
    pub avg_prompt_tokens: f64,
    /// Prompt blocks considered for prefix affinity (0 = prefix scorer off).
    pub prefix_blocks: u32,
    /// Tokens per prefix block (block characters / 4): converts a matched depth into cached
    /// tokens the pod does not have to prefill.
    pub block_tokens: u32,
    /// Hash that picks the rendezvous home ([`crate::prefix::home_key`]).
    pub home_key: Option<u64>,
    /// Share of the home's bonus (`scoring.prefix_home_score`) withheld because the pool's
    /// prompts are seldom found reused ([`crate::engine::home_fade`]); 0 = all of it.
    pub home_fade: f64,
    /// Pods known to hold part of the prompt ([`crate::prefix::PrefixIndex::lookup`]).
    pub matches: &'a [PodMatch],
    /// For conversations: the pods that served an earlier turn. A match on a pod outside this
    /// list covers only what conversations share (a system prompt), which every pod caches soon
    /// enough; it counts at [`SHARED_PREFIX_DISCOUNT`] so it does not pile conversations onto
    /// whichever pod saw the system prompt first.
    pub conversation_pods: Option<&'a [u64]>,
    /// For adapter requests: the pod this gateway last sent the adapter to. Engines report only
    /// adapters of running requests, but an adapter stays loaded after its requests finish
    /// until its slot is needed, so that pod most likely still holds it.
    pub adapter_recent: Option<u64>,
    /// For adapter requests: the adapter's home pod ([`crate::adapters::partition`]).
    pub adapter_home: Option<u64>,
    /// `x-gateway-priority` < 0: may be rejected when the pool is saturated.
    pub sheddable: bool,
    /// May be held at the gateway while the pool is saturated (`hold`).
    pub holdable: bool,
    /// With `holdable`: may also be held while the pod that caches its prompt (for an adapter
    /// request: that holds its adapter) is saturated and others are not
    /// (`hold.affinity_wait_ms`, not yet run out).
    pub affinity_hold: bool,
    /// The pool (configuration index) that takes the request while every candidate is
    /// saturated (`pools[].overflow`: the pool's first failover pool with room), before it is
    /// shed, held or sent to a saturated pod ([`Decision::Overflow`]).
    pub overflow_to: Option<usize>,
    /// Pods out of the picks for their server errors ([`crate::outlier::Outliers::ejected`]):
    /// candidates only when no other pod is.
    pub ejected: &'a [u64],
}

impl RequestFeatures<'_> {
    /// The prompt's matched depth on the pod `key` (leading blocks it is known to hold).
    pub fn depth_on(&self, key: u64) -> u32 {
        self.matches
            .iter()
            .find(|m| m.pod == key)
            .map_or(0, |m| m.depth)
    }

    /// For a conversation, whether the pod `key` served it (None: not a conversation).
    fn served_by(&self, key: u64) -> Option<bool> {
        self.conversation_pods.map(|p| p.contains(&key))
    }

    /// The share of the prompt a pod is credited with holding, from its matched `depth`: for a
    /// conversation, at least [`CONVERSATION_FLOOR`] on a pod that `served` it, and the depth
    /// discounted by [`SHARED_PREFIX_DISCOUNT`] on the others.
    fn prefix_credit(&self, depth: u32, served: Option<bool>) -> f64 {
        let learned = f64::from(depth) / f64::from(self.prefix_blocks);
        match served {
            Some(true) => fmax(learned, CONVERSATION_FLOOR),
            Some(false) => learned * SHARED_PREFIX_DISCOUNT,
            None => learned,
        }
    }
}

/// Share of the prompt a saturated pod must be credited with (its matched depth, with the
/// conversation rules of [`Picker::pick`]) before a request waits for it (`affinity_hold`); and
/// the most a pod with room may hold, as a share of that, for the wait to be worth it.
pub const PREFIX_HOLD_MIN: f64 = 0.5;

/// Weight of a prefix match that does not include the conversation itself (see
/// [`RequestFeatures::conversation_pods`]).
pub const SHARED_PREFIX_DISCOUNT: f64 = 0.25;

/// Lowest prefix match credited to a pod that served an earlier turn of the conversation: it
/// holds that turn's whole prompt, and a follow-up adds one exchange, usually a small part of
/// the history. (The learned depth alone is quantised to the anchor grid and can undercount.)
pub const CONVERSATION_FLOOR: f64 = 0.75;

/// Why the filter left the choice to Envoy's own load balancing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOpen {
    /// No snapshot was ever received (or it was unreadable).
    NoSnapshot,
    /// The snapshot has no entry for the pool.
    UnknownPool,
    /// Every pod is unhealthy or its data is older than `stale_after_ms`.
    NoFreshPod,
    /// `pick_endpoints` is off.
    Disabled,
    /// The request needs its model's pool, not a pod's capacity (`/v1/messages/count_tokens`):
    /// routed by model, the pod left to Envoy, nothing counted in flight.
    ModelOnly,
}

impl FailOpen {
    /// Left to Envoy by design (`Disabled`, `ModelOnly`), not for want of data: the shells count
    /// it as `routed`, not as a fail-open.
    pub fn by_design(self) -> bool {
        matches!(self, FailOpen::Disabled | FailOpen::ModelOnly)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FailOpen::NoSnapshot => "no_snapshot",
            FailOpen::UnknownPool => "unknown_pool",
            FailOpen::NoFreshPod => "no_fresh_pod",
            FailOpen::Disabled => "disabled",
            FailOpen::ModelOnly => "model_only",
        }
    }
}

/// Result of a pick.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Pod indices into the pool, best first (then fallbacks).
    Picked(Vec<usize>),
    FailOpen(FailOpen),
    /// Sheddable request, every candidate saturated.
    Shed,
    /// The request may wait at the gateway (`hold`): decide again when a pod may have room.
    Hold(HoldReason),
    /// Every candidate is saturated and the request goes to this pool instead (its
    /// configuration index, [`RequestFeatures::overflow_to`]): decide again there.
    Overflow(usize),
}

/// Why a request is held ([`Decision::Hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// Every candidate is saturated: no request of the pool can go until one has room.
    Saturated,
    /// The pod that caches its prompt, or for an adapter request holds its adapter (its key,
    /// `pod`), is saturated and others are not ([`RequestFeatures::affinity_hold`]): other
    /// requests of the pool may go, and only that pod's room is this request's.
    Affinity { pod: u64 },
}

impl HoldReason {
    /// The pod the request waits for: the one that caches its prompt or holds its adapter, when
    /// that is why it is held.
    pub fn awaited_pod(self) -> Option<u64> {
        match self {
            HoldReason::Affinity { pod } => Some(pod),
            HoldReason::Saturated => None,
        }
    }
}

/// One candidate's score breakdown, for the debug header and tests.
#[derive(Debug, Clone, PartialEq)]
pub struct Breakdown {
    pub pod: usize,
    pub total: f64,
    pub queue: f64,
    pub kv: f64,
    pub running: f64,
    pub lora: Option<f64>,
    pub prefix: Option<f64>,
    pub saturated: bool,
}

/// Why a pod of the pool was not scored for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeftOut {
    /// The snapshot says it is not healthy.
    Unhealthy,
    /// Its metrics are older than `stale_after_ms`.
    Stale,
    /// Ramping up after coming back, and not admitted this time (probability = its weight).
    Ramping,
    /// Over the queue or KV-cache threshold while another candidate was not.
    Saturated,
    /// An adapter request, and other pods hold the adapter (running it, or its home).
    AdapterElsewhere,
    /// Out of the picks for its server errors ([`crate::outlier`]) while another pod was not.
    Ejected,
}

impl LeftOut {
    pub fn as_str(self) -> &'static str {
        match self {
            LeftOut::Unhealthy => "unhealthy",
            LeftOut::Stale => "stale",
            LeftOut::Ramping => "ramping",
            LeftOut::Saturated => "saturated",
            LeftOut::AdapterElsewhere => "adapter-elsewhere",
            LeftOut::Ejected => "ejected",
        }
    }
}

/// A decision explained, for the debug header and tests: every scored candidate's breakdown,
/// and every other pod of the pool with the reason it was not scored.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Explain {
    pub scored: Vec<Breakdown>,
    /// (pod index, reason), in the order the filters ran.
    pub left_out: Vec<(usize, LeftOut)>,
}

/// Scoring parameters, fixed per configuration.
#[derive(Debug, Clone)]
pub struct Picker {
    pub weights: Weights,
    pub scoring: ScoringConfig,
    pub fallbacks: usize,
}

/// Effective load of a candidate: snapshot values adjusted by what this gateway sent or saw
/// finish since.
#[derive(Debug, Clone, Copy)]
struct Load {
    /// Prefill work queued ahead of a new request, in average requests.
    work: f64,
    waiting: f64,
    /// Requests waiting for their first token: the snapshot's queue with what was sent since,
    /// or this gateway's own not yet answered, whichever says more.
    pending: f64,
    running: f64,
    kv: Option<f64>,
    /// Free KV-cache tokens, when the pod reports its cache geometry.
    free_tokens: Option<f64>,
    capacity: f64,
}

// Inlined into the pick's loop: out of line it cost ~580 instructions a request in V8.
#[inline(always)]
fn effective_load(pod: &PodState, load: Option<&PodLoad>, avg_tokens: f64) -> Load {
    let s = &pod.snap;
    let (mut waiting, mut running) = (f64::from(s.waiting), f64::from(s.running));
    let mut work = waiting;
    let mut kv = s.kv_cache_usage;
    let mut backlog = 0.0;
    let mut unanswered = 0.0;
    if let Some(l) = load {
        unanswered = f64::from(l.prefill);
        backlog = if avg_tokens > 0.0 {
            f64::from(l.prefill_tokens) / avg_tokens
        } else {
            f64::from(l.prefill)
        };
        let d = l.delta() as f64;
        if d > 0.0 {
            // Not yet reported by the pod: as far as we know its prefill is still ahead of a new
            // request, so it counts by its size (a long prompt is more work than a short one).
            waiting += d;
            work += if avg_tokens > 0.0 {
                fmax(l.delta_tokens().max(0) as f64 / avg_tokens, d * 0.25)
            } else {
                d
            };
        } else {
            // Finished since the snapshot: it left the running batch.
            running = fmax(running + d, 0.0);
        }
        if let (Some(k), Some(cap)) = (kv, kv_tokens(s)) {
            kv = Some((k + l.delta_tokens() as f64 / cap).clamp(0.0, 1.0));
        }
    }
    let free_tokens = match (kv, kv_tokens(s)) {
        (Some(k), Some(cap)) => Some((1.0 - k) * cap),
        _ => None,
    };
    Load {
        // The snapshot's view (other gateways' requests, queues) or this gateway's own prefill
        // backlog (which the snapshot hides inside "running"), whichever says more.
        work: fmax(work, backlog),
        waiting,
        pending: fmax(waiting, unanswered),
        running,
        kv,
        free_tokens,
        capacity: pod.speed,
    }
}

/// A pod's capacity rounded to a step of sqrt(2) (..., 0.71, 1, 1.41, 2, 2.83, ...). Estimates
/// of identical GPUs differ by some tens of percent with the batch each happens to run, and
/// acting on that noise would feed back into it (more traffic, bigger batch, lower estimate);
/// real generation gaps (2-3x) survive the rounding. Kept within 2^-10..2^10 of the reference
/// pod: the snapshot allows any capacity over 0, and one of 1e-300 made every wait over it
/// infinite or so large that the other pods' queues no longer told them apart (an audit: a
/// pod with 3 waiting took as many requests as an idle one, and a score came out NaN).
pub fn speed_class(capacity: f64) -> f64 {
    if !(capacity.is_finite() && capacity > 0.0) {
        return 1.0;
    }
    let log2 = capacity
        .log2()
        .clamp(-SPEED_CLASS_LOG2_RANGE, SPEED_CLASS_LOG2_RANGE);
    2f64.powf((log2 * 2.0).round() / 2.0)
}

/// [`speed_class`]'s range, in powers of two either side of capacity 1.
const SPEED_CLASS_LOG2_RANGE: f64 = 10.0;

/// KV-cache capacity in tokens, when the pod reports its block size and count.
fn kv_tokens(s: &crate::snapshot::PodSnapshot) -> Option<f64> {
    let cap = f64::from(s.block_size?) * s.num_blocks? as f64;
    (cap > 0.0).then_some(cap)
}

/// A candidate in [`Picker::pick`].
struct Cand {
    /// The pod's index in the pool.
    i: usize,
    load: Load,
    saturated: bool,
    /// Expected wait, in time on a capacity-1 pod.
    wait: f64,
    /// The prompt's matched depth on the pod.
    depth: u32,
    /// Whether the pod served the conversation (None: no conversation).
    served: Option<bool>,
    /// What the request would hold up the requests waiting there (`pending_cost`).
    held_up: f64,
}

/// Pod `i` of `pool` as a candidate, its load from the snapshot and `load` (this gateway's
/// in-flight counts of it). Inlined: a call per pod cost ~900 instructions a request in V8.
#[inline(always)]
fn candidate(
    pool: &PoolState,
    load: Option<&PodLoad>,
    i: usize,
    req: &RequestFeatures<'_>,
    sc: &ScoringConfig,
) -> Cand {
    let l = effective_load(&pool.pods[i], load, req.avg_prompt_tokens);
    let saturated = over(&l, sc.queue_threshold, sc.kv_threshold);
    Cand {
        i,
        load: l,
        saturated,
        wait: 0.0,
        depth: 0,
        served: None,
        held_up: 0.0,
    }
}

/// [`candidate`] out of line, for the rare pick among ejected pods only: inlined at a second
/// place, it took `effective_load` out of line for every pick.
#[cold]
#[inline(never)]
fn candidate_cold(
    pool: &PoolState,
    load: Option<&PodLoad>,
    i: usize,
    req: &RequestFeatures<'_>,
    sc: &ScoringConfig,
) -> Cand {
    candidate(pool, load, i, req, sc)
}

impl Picker {
    pub fn new(scoring: ScoringConfig, fallbacks: usize) -> Picker {
        Picker {
            weights: scoring.effective_weights(),
            scoring,
            fallbacks,
        }
    }

    /// Picks pods of `pool` for a request.
    ///
    /// `loads` is the shared in-flight table aligned with the pool (ignored unless its length
    /// matches); `snapshot_age_ms` is the time since the snapshot was accepted. With
    /// `explain`, every scored candidate's breakdown, and every pod left out with its reason,
    /// are appended to it (the pick is the same with or without).
    pub fn pick(
        &self,
        pool: &PoolState,
        loads: &[PodLoad],
        req: &RequestFeatures<'_>,
        snapshot_age_ms: u64,
        rng: &mut SplitMix64,
        mut explain: Option<&mut Explain>,
    ) -> Decision {
        let sc = &self.scoring;
        let loads_ok = loads.len() == pool.pods.len();
        let adapter = req.adapter.filter(|_| self.weights.lora > 0.0);

        // Candidates: healthy, fresh, and (for ramping pods) admitted with probability = weight.
        // (pod index, load, saturated, then, once the candidates are known: expected wait, the
        // prompt's matched depth on the pod, and whether the pod served the conversation).
        let mut cands: Vec<Cand> = Vec::with_capacity(pool.pods.len());
        // Fresh pods out for their server errors: candidates only if no other pod is.
        let mut ejected: Vec<usize> = Vec::new();
        // Fresh pods ramp-up held back this time: candidates if no other pod is. Ramp-up sets a
        // returning pod's share beside pods at full weight; with none beside it (a one-pod pool
        // whose pod restarted, a fleet back from an outage, a rolling update's new pods), failing
        // open hands the request to Envoy's balancer, which sends it there anyway (or to a pod
        // the snapshot shows down), blind to load: 9 requests in 10 at a weight of 0.1.
        let mut ramping: Vec<usize> = Vec::new();
        for (i, pod) in pool.pods.iter().enumerate() {
            if !pod.fresh(snapshot_age_ms, sc.stale_after_ms) {
                if let Some(e) = explain.as_deref_mut() {
                    let why = if pod.snap.healthy {
                        LeftOut::Stale
                    } else {
                        LeftOut::Unhealthy
                    };
                    e.left_out.push((i, why));
                }
                continue;
            }
            if !req.ejected.is_empty() && req.ejected.contains(&pod.key) {
                ejected.push(i);
                continue;
            }
            let w = pod.snap.ramp_weight;
            if w < 1.0 && rng.next_f64() >= w {
                ramping.push(i);
                continue;
            }
            cands.push(candidate(pool, loads_ok.then(|| &loads[i]), i, req, sc));
        }
        if cands.is_empty() {
            // A weight of 0 takes nothing, even alone.
            for &i in ramping
                .iter()
                .filter(|&&i| pool.pods[i].snap.ramp_weight > 0.0)
            {
                cands.push(candidate(pool, loads_ok.then(|| &loads[i]), i, req, sc));
            }
            ramping.retain(|&i| pool.pods[i].snap.ramp_weight <= 0.0);
        }
        if let Some(e) = explain.as_deref_mut() {
            e.left_out
                .extend(ramping.iter().map(|&i| (i, LeftOut::Ramping)));
        }
        if cands.is_empty() {
            cands.extend(
                ejected
                    .drain(..)
                    .map(|i| candidate_cold(pool, loads_ok.then(|| &loads[i]), i, req, sc)),
            );
        } else if let Some(e) = explain.as_deref_mut() {
            e.left_out
                .extend(ejected.iter().map(|&i| (i, LeftOut::Ejected)));
        }
        if cands.is_empty() {
            return Decision::FailOpen(FailOpen::NoFreshPod);
        }
        // An adapter request keeps to the pods that hold its adapter (it runs there, or it is the
        // adapter's home) while any of them is under `lora_queue_threshold`, saturated or not:
        // copying an adapter to another pod takes a slot that pod's own adapters rely on and
        // starts a cascade of loads. That threshold is the escape valve, apart from the
        // saturation one, so that a low `queue_threshold` (for `hold`) does not scatter adapters.
        // (The GIE endpoint picker has the same filter stage, behind its own queue threshold.)
        // Where an overflow last sent it does not count here: once the home has room again,
        // traffic goes back instead of keeping a second copy that evicts that pod's own adapters.
        let keeps = |c: &Cand| {
            adapter.is_some_and(|a| holds_adapter(&pool.pods[c.i], a, req))
                && !over(&c.load, sc.lora_queue_threshold, sc.kv_threshold)
        };
        let all_saturated = cands.iter().all(|c| c.saturated);
        if all_saturated {
            // Not while one of its adapter's pods keeps it (`keeps`): the failover pool would
            // load the adapter, evicting one of its own, for a request that pod takes under
            // `lora_queue_threshold` (with `queue_threshold: 1`, four of four requests for an
            // adapter its pod ran with one waiting went to the burst pool, an audit). It then
            // stays, as in a pool without overflow: shed, held or picked below.
            if let Some(to) = req.overflow_to.filter(|_| !cands.iter().any(keeps)) {
                return Decision::Overflow(to);
            }
            if req.sheddable {
                return Decision::Shed;
            }
            if req.holdable {
                return Decision::Hold(HoldReason::Saturated);
            }
        }
        if !all_saturated {
            // With `hold`, a request for a saturated pod's prompt or adapter may wait for it.
            if let Some(pod) = self.awaited_pod_for(pool, req, adapter, &cands) {
                return Decision::Hold(HoldReason::Affinity { pod });
            }
            let room = |c: &Cand| !c.saturated || keeps(c);
            if let Some(e) = explain.as_deref_mut() {
                left_out(e, &cands, room, LeftOut::Saturated);
            }
            cands.retain(room);
        }
        if adapter.is_some() && cands.iter().any(keeps) {
            if let Some(e) = explain.as_deref_mut() {
                left_out(e, &cands, keeps, LeftOut::AdapterElsewhere);
            }
            cands.retain(keeps);
        }

        // Rendezvous homes over the surviving candidates, so all gateways agree on them.
        let prefix_on = req.prefix_blocks > 0 && self.weights.prefix > 0.0;
        // Weighted by capacity, so a pod three times faster is home to three times the
        // conversations (and adapters). The speed class (not the raw estimate) keeps the
        // estimate's jitter between snapshots from moving homes around.
        let hrw = |k: u64, c: &Cand| {
            let w = c.load.capacity;
            (weighted_hrw(k, pool.pods[c.i].key, w), c.i)
        };
        let home = match (prefix_on, adapter, req.home_key) {
            // An adapter request's prompt is homed with its adapter: on the adapter's home pod,
            // or, when that pod is not a candidate (saturated), on the adapter's own rendezvous
            // pod among the rest. So the prefix signal agrees with the LoRA one instead of
            // scattering a busy adapter's overflow (and its loads) over every pod; the overflow
            // goes to one pod, where the adapter then stays loaded. That pod is picked in plain
            // rendezvous order, as the homes are (crate::adapters): a capacity-weighted order
            // would move it whenever a pod's estimated speed class flips with load.
            (true, Some(a), _) => cands
                .iter()
                .find(|c| req.adapter_home == Some(pool.pods[c.i].key))
                .or_else(|| {
                    cands
                        .iter()
                        .max_by_key(|c| hrw_weight(a, pool.pods[c.i].key))
                })
                .map(|c| c.i),
            // Equal capacities (the usual case): `w / -ln(u)` orders the pods as `u` does, and
            // `u` as the hash's top 53 bits; no logarithm.
            (true, None, Some(k))
                if cands
                    .windows(2)
                    .all(|p| p[0].load.capacity == p[1].load.capacity) =>
            {
                cands
                    .iter()
                    .max_by_key(|c| hrw_weight(k, pool.pods[c.i].key) >> 11)
                    .map(|c| c.i)
            }
            // One weight per candidate (a logarithm each), not two per comparison.
            (true, None, Some(k)) => cands
                .iter()
                .map(|c| hrw(k, c))
                .max_by(|a, b| a.0.total_cmp(&b.0))
                .map(|(_, i)| i),
            _ => None,
        };
        let kv_on = cands.iter().any(|c| c.load.kv.is_some());
        // This request's own prefill on a pod, in the same unit as the queued work: only what
        // the pod does not already hold in its prefix cache needs computing.
        // For a conversation, only pods that served it get the credit: what conversations merely
        // share (a system prompt) is soon cached on every pod, and crediting the first pod that
        // computed it would pile conversations onto it and make gateways, which each know only
        // their own decisions, disagree.
        let own = |depth: u32, served: Option<bool>| {
            let depth = if served == Some(false) { 0 } else { depth };
            let uncached = uncached_tokens(req.prompt_tokens, depth, req.block_tokens);
            if req.avg_prompt_tokens > 0.0 {
                (f64::from(uncached) / req.avg_prompt_tokens).clamp(0.02, 16.0)
            } else {
                1.0
            }
        };

        let w = &self.weights;
        let mut wsum = w.queue + w.running;
        if kv_on {
            wsum += w.kv_cache;
        }
        if adapter.is_some() {
            wsum += w.lora;
        }
        if prefix_on {
            wsum += w.prefix;
        }
        if wsum <= 0.0 {
            wsum = 1.0;
        }

        // Expected wait per candidate: prefill work ahead of this request plus its own, in time
        // on a capacity-1 pod. A slower pod costs more even with an empty queue, because its
        // prefill of this very request takes longer, and the more so the longer the prompt.
        // A pod whose free KV cache cannot hold the prompt makes it wait until running requests
        // finish (or preempts one): count that as a full horizon of extra wait.
        let prompt_tokens = f64::from(req.prompt_tokens);
        // What this request's prefill would cost the requests waiting for their first token on
        // the pod (`pending_cost`): each gets it only when the step that prefills this one too is
        // done. That cost never moves a request to a slower pod: a pod slower than the fastest
        // candidates is charged at least the least they would charge. Else a long prompt would
        // leave busy fast pods for an idle slow one, lowering the mean TTFT and raising its own.
        let held_up = |l: &Load, own: f64| sc.pending_cost * l.pending * own / l.capacity;
        let mut fastest = (0.0f64, f64::INFINITY);
        let (mut w_min, mut w_max) = (f64::INFINITY, 0.0f64);
        for c in &mut cands {
            // Looked up once per candidate: the wait and the prefix score both use them.
            let key = pool.pods[c.i].key;
            c.depth = req.depth_on(key);
            c.served = req.served_by(key);
            let l = &c.load;
            let no_room = l.free_tokens.is_some_and(|f| f < prompt_tokens);
            let own = own(c.depth, c.served);
            c.wait = (l.work + own) / l.capacity + if no_room { sc.queue_horizon } else { 0.0 };
            c.held_up = held_up(l, own);
            if l.capacity > fastest.0 {
                fastest = (l.capacity, c.held_up);
            } else if l.capacity == fastest.0 {
                fastest.1 = fmin(fastest.1, c.held_up);
            }
        }
        for c in &mut cands {
            c.wait += if c.load.capacity < fastest.0 {
                fmax(c.held_up, fastest.1)
            } else {
                c.held_up
            };
            w_min = fmin(w_min, c.wait);
            w_max = fmax(w_max, c.wait);
        }
        // Linear in the extra wait over the best candidate, so pods are separated in proportion
        // to the time a request would lose; if the spread exceeds the horizon (overload), it is
        // compressed to fit, so the least-loaded pod still stands out.
        let span = fmax(sc.queue_horizon, w_max - w_min);

        let mut scored: Vec<(usize, f64, f64, f64)> = Vec::with_capacity(cands.len());
        for Cand {
            i,
            load: l,
            saturated,
            wait,
            depth,
            served,
            ..
        } in &cands
        {
            let pod = &pool.pods[*i];
            let queue = 1.0 - (wait - w_min) / span;
            let running = 1.0 / (1.0 + (l.running / l.capacity) / sc.running_scale);
            let kv = l.kv.map_or(0.5, |k| 1.0 - k.clamp(0.0, 1.0));
            let lora = adapter.map(|a| lora_score(pod, a, likely_loaded(pod, req)));
            let prefix = prefix_on.then(|| {
                let learned = req.prefix_credit(*depth, *served);
                let homed = if home == Some(*i) {
                    sc.prefix_home_score * (1.0 - req.home_fade)
                } else {
                    0.0
                };
                let hit = pod.snap.prefix_cache_hit_rate.unwrap_or(0.0);
                0.9 * fmin(fmax(learned, homed), 1.0) + 0.1 * hit
            });
            let mut total = w.queue * queue + w.running * running;
            if kv_on {
                total += w.kv_cache * kv;
            }
            if let Some(s) = lora {
                total += w.lora * s;
            }
            if let Some(s) = prefix {
                total += w.prefix * s;
            }
            total /= wsum;
            // Random tie-break key, weighted by capacity (Efraimidis-Spirakis: u^(1/w)); see
            // `tie_break`. Drawn for every candidate, so the pick depends only on the seed.
            let u = fmax(rng.next_f64(), f64::MIN_POSITIVE);
            scored.push((*i, total, u, l.capacity));
            if let Some(e) = explain.as_deref_mut() {
                e.scored.push(Breakdown {
                    pod: *i,
                    total,
                    queue,
                    kv,
                    running,
                    lora,
                    prefix,
                    saturated: *saturated,
                });
            }
        }
        // Best first; equal totals (within float noise) by the weighted random key.
        let better = |a: &(usize, f64, f64, f64), b: &(usize, f64, f64, f64)| {
            if (a.1 - b.1).abs() > 1e-9 {
                a.1 > b.1
            } else {
                tie_break((a.2, a.3), (b.2, b.3))
            }
        };
        let k = (1 + self.fallbacks).min(scored.len());
        // Partial selection: k is tiny, the pool may be large.
        for slot in 0..k {
            let mut best = slot;
            for j in slot + 1..scored.len() {
                if better(&scored[j], &scored[best]) {
                    best = j;
                }
            }
            scored.swap(slot, best);
        }
        Decision::Picked(scored[..k].iter().map(|s| s.0).collect())
    }

    /// The saturated candidate the request is better held for than sent to one with room
    /// ([`RequestFeatures::affinity_hold`]), by key. For an adapter request, a pod that holds
    /// its adapter (runs it, or is its home with a free slot; one running it first) when no
    /// pod with room does: any other pod would load it. For others, one credited with at least
    /// [`PREFIX_HOLD_MIN`] of the prompt, the most of the saturated, where no pod with room
    /// holds half as much (credited as by the prefix scorer,
    /// [`RequestFeatures::prefix_credit`]).
    /// `adapter`: the request's adapter, when the LoRA scorer is on.
    fn awaited_pod_for(
        &self,
        pool: &PoolState,
        req: &RequestFeatures<'_>,
        adapter: Option<u64>,
        cands: &[Cand],
    ) -> Option<u64> {
        if !(req.holdable && req.affinity_hold) {
            return None;
        }
        if let Some(a) = adapter {
            if cands
                .iter()
                .any(|c| !c.saturated && holds_adapter(&pool.pods[c.i], a, req))
            {
                return None;
            }
            let running = |c: &&Cand| pool.pods[c.i].lora_running.contains(&a);
            let home = |c: &&Cand| home_with_slot(&pool.pods[c.i], req);
            let pod = cands
                .iter()
                .find(running)
                .or_else(|| cands.iter().find(home));
            return pod.map(|c| pool.pods[c.i].key);
        }
        if req.prefix_blocks == 0 || self.weights.prefix <= 0.0 {
            return None;
        }
        let (mut busy, mut free, mut pod) = (0.0f64, 0.0f64, None);
        for c in cands {
            let key = pool.pods[c.i].key;
            let credit = req.prefix_credit(req.depth_on(key), req.served_by(key));
            if !c.saturated {
                free = fmax(free, credit);
            } else if credit > busy {
                (busy, pod) = (credit, Some(key));
            }
        }
        pod.filter(|_| busy >= PREFIX_HOLD_MIN && free < busy * PREFIX_HOLD_MIN)
    }
}

/// Whether the candidate with random draw `u` and capacity `w` wins a tie against the other:
/// the larger Efraimidis-Spirakis key u^(1/w), compared as ln(u)/w (one `ln` each, not a
/// `powf`), and only when the two capacities differ: at equal capacity the key orders as `u`.
fn tie_break((ua, wa): (f64, f64), (ub, wb): (f64, f64)) -> bool {
    if wa == wb {
        ua > ub
    } else {
        ua.ln() / wa > ub.ln() / wb
    }
}

/// `a.max(b)` as two compares and a select. `f64::max` is a call to libm's `fmax` on wasm32
/// (wasm's own `f64.max` returns NaN for a NaN operand, where Rust promises the other operand),
/// and the picker takes ~50 maxima and minima per request of 8 pods. The same result as
/// `f64::max`, NaN operands included.
#[inline(always)]
fn fmax(a: f64, b: f64) -> f64 {
    if a > b || b.is_nan() {
        a
    } else {
        b
    }
}

/// `a.min(b)`, as [`fmax`].
#[inline(always)]
fn fmin(a: f64, b: f64) -> f64 {
    if a < b || b.is_nan() {
        a
    } else {
        b
    }
}

/// Prompt tokens a pod must prefill when it holds `depth` leading blocks of the prompt.
pub fn uncached_tokens(prompt_tokens: u32, depth: u32, block_tokens: u32) -> u32 {
    prompt_tokens.saturating_sub(depth.saturating_mul(block_tokens))
}

/// Whether a pod with load `l` is over either threshold: waiting requests per unit of speed,
/// or KV-cache use.
/// Whether pool `pool` has a pod that could take a request and is not saturated, by the
/// snapshot alone (its queue and KV use as last scraped; not what was sent since): what a pool's
/// `overflow` is judged by, once per request, where the picker's saturation also counts the
/// in-flight table.
pub fn has_room_by_snapshot(
    pool: &PoolState,
    snapshot_age_ms: u64,
    scoring: &ScoringConfig,
) -> bool {
    pool.pods.iter().any(|p| {
        p.fresh(snapshot_age_ms, scoring.stale_after_ms)
            && !over(
                &effective_load(p, None, 0.0),
                scoring.queue_threshold,
                scoring.kv_threshold,
            )
    })
}

fn over(l: &Load, queue_threshold: f64, kv_threshold: f64) -> bool {
    l.waiting / l.capacity >= queue_threshold || l.kv.is_some_and(|k| k >= kv_threshold)
}

/// Whether the pod holds the request's adapter `adapter`: runs it, or is its home with a slot
/// free ([`home_with_slot`]). Where else it goes, the adapter must be loaded.
fn holds_adapter(pod: &PodState, adapter: u64, req: &RequestFeatures<'_>) -> bool {
    pod.lora_running.contains(&adapter) || home_with_slot(pod, req)
}

/// Whether the pod is the request's adapter's home and has a slot that no running or queued
/// adapter claims (so the adapter, idle there, was not evicted; or can load at once).
fn home_with_slot(pod: &PodState, req: &RequestFeatures<'_>) -> bool {
    req.adapter_home == Some(pod.key) && pod.free_lora_slots().is_none_or(|f| f > 0)
}

/// Whether the request's adapter is most likely loaded (idle) on this pod: it is the adapter's
/// home or where it was last sent, and the pod has a slot that no running or queued adapter
/// claims (if every slot ran other adapters, ours was evicted).
fn likely_loaded(pod: &PodState, req: &RequestFeatures<'_>) -> bool {
    (req.adapter_home == Some(pod.key) || req.adapter_recent == Some(pod.key))
        && pod.free_lora_slots().is_none_or(|f| f > 0)
}

/// LoRA affinity, from what the pod reports and what the gateway knows:
/// - the adapter is in the running batch: 1.0 (nothing to load);
/// - the adapter's home ([`crate::adapters::partition`]) or the pod it was last sent to: 0.85.
///   Engines report only adapters of running requests, but an idle adapter stays in its slot
///   until the slot is needed, and the partition gives every adapter a slot of its own while
///   they fit, so these pods most likely hold it;
/// - a free slot: 0.2, up to 0.3 the more slots are free (a load: it starts at once, but it
///   takes a slot another adapter's home relies on, and evicting that one starts a cascade of
///   loads, so a copy is made only when the adapter's own pods are clearly busier: about three
///   average requests of extra wait at the default weights);
/// - the adapter is queued behind a load here: 0.1 (no extra load, but it waits for a slot);
/// - otherwise 0 (a load that must first wait for a slot to drain).
fn lora_score(pod: &PodState, adapter: u64, likely_loaded: bool) -> f64 {
    if pod.lora_running.contains(&adapter) {
        return 1.0;
    }
    if likely_loaded {
        return 0.85;
    }
    match (pod.free_lora_slots(), pod.snap.lora.as_ref()) {
        (Some(f), Some(l)) if f > 0 && l.max_loras > 0 => {
            0.2 + 0.1 * f64::from(f) / f64::from(l.max_loras)
        }
        _ if pod.lora_waiting.contains(&adapter) => 0.1,
        _ => 0.0,
    }
}

/// Records the candidates that `keep` drops, before the filter drops them.
fn left_out(e: &mut Explain, cands: &[Cand], keep: impl Fn(&Cand) -> bool, why: LeftOut) {
    e.left_out
        .extend(cands.iter().filter(|c| !keep(c)).map(|c| (c.i, why)));
}

/// The longest `x-gateway-debug` value [`format_breakdown`] writes: room for ~90 scored pods.
/// Clients and proxies limit response headers (Python's `http.client` a header line to 64 KiB,
/// many servers and proxies the whole block to 8-16 KiB); a 1,000-pod pool's whole breakdown is
/// ~75 KiB.
pub const DEBUG_HEADER_MAX: usize = 8 * 1024;

/// Formats an explained decision for the `x-gateway-debug` response header: the pool, the
/// pick, each scored candidate's breakdown best first (the pick first), then the pods left out
/// and why (`; left-out=10.0.0.3:8000 stale,10.0.0.4:8000 adapter-elsewhere`). At most
/// [`DEBUG_HEADER_MAX`] bytes: what does not fit is counted at the end
/// (`; omitted=12 scored,300 left-out`).
pub fn format_breakdown(pool: &PoolState, picked: Option<usize>, e: &Explain) -> String {
    // Room kept for the omitted note (~40 bytes) and for the split prefix the engine puts in
    // front (two configured names).
    const BUDGET: usize = DEBUG_HEADER_MAX - 512;
    let mut s = String::new();
    let _ = write!(s, "pool={}", pool.name);
    if let Some(p) = picked.and_then(|i| pool.pods.get(i)) {
        let _ = write!(s, "; picked={}", p.snap.address);
    }
    let mut order: Vec<&Breakdown> = e.scored.iter().collect();
    order.sort_by(|a, b| {
        let (pa, pb) = (Some(a.pod) == picked, Some(b.pod) == picked);
        pb.cmp(&pa).then(b.total.total_cmp(&a.total))
    });
    let mut entry = String::new();
    let mut omitted = (0usize, 0usize);
    for c in order {
        let Some(p) = pool.pods.get(c.pod) else {
            continue;
        };
        if omitted.0 > 0 {
            omitted.0 += 1;
            continue;
        }
        entry.clear();
        let _ = write!(
            entry,
            "; {} total={:.3} queue={:.3} kv={:.3} running={:.3}",
            p.snap.address, c.total, c.queue, c.kv, c.running
        );
        if let Some(l) = c.lora {
            let _ = write!(entry, " lora={l:.3}");
        }
        if let Some(x) = c.prefix {
            let _ = write!(entry, " prefix={x:.3}");
        }
        if c.saturated {
            entry.push_str(" saturated");
        }
        if s.len() + entry.len() > BUDGET {
            omitted.0 += 1;
            continue;
        }
        s.push_str(&entry);
    }
    let mut sep = "; left-out=";
    for (i, why) in &e.left_out {
        let Some(p) = pool.pods.get(*i) else {
            continue;
        };
        if omitted != (0, 0) {
            omitted.1 += 1;
            continue;
        }
        entry.clear();
        let _ = write!(entry, "{sep}{} {}", p.snap.address, why.as_str());
        if s.len() + entry.len() > BUDGET {
            omitted.1 += 1;
            continue;
        }
        s.push_str(&entry);
        sep = ",";
    }
    if omitted != (0, 0) {
        let _ = write!(s, "; omitted={} scored,{} left-out", omitted.0, omitted.1);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ScoringConfig;
    use crate::fleet::{adapter_key, FleetState};
    use crate::load::LoadTable;
    use crate::prefix::{pod_key, PodMatch};
    use crate::snapshot::{LoraState, PodSnapshot, PoolSnapshot, Snapshot, SNAPSHOT_SCHEMA};
    use proptest::prelude::*;

    fn pool(pods: Vec<PodSnapshot>) -> PoolState {
        let snap = Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: 1,
            source: String::new(),
            generated_at_ms: 5_000,
            pools: vec![PoolSnapshot {
                name: "p".into(),
                pods,
            }],
        };
        FleetState::new(snap, 5_000).pools.remove(0)
    }

    fn pod(i: u32, waiting: u32, running: u32, kv: f64) -> PodSnapshot {
        let mut p = PodSnapshot::new(format!("10.0.0.{i}:8000"), 5_000);
        p.waiting = waiting;
        p.running = running;
        p.kv_cache_usage = Some(kv);
        p
    }

    fn picker() -> Picker {
        Picker::new(ScoringConfig::default(), 2)
    }

    fn best(d: &Decision) -> usize {
        match d {
            Decision::Picked(v) => v[0],
            other => panic!("expected a pick, got {other:?}"),
        }
    }

    fn pick(p: &PoolState, req: &RequestFeatures<'_>) -> Decision {
        picker().pick(p, &[], req, 0, &mut SplitMix64::new(1), None)
    }

    /// [`pick`] with its explanation, from a given seed.
    fn explained(p: &PoolState, req: &RequestFeatures<'_>, seed: u64) -> (Decision, Explain) {
        let mut e = Explain::default();
        let d = picker().pick(p, &[], req, 0, &mut SplitMix64::new(seed), Some(&mut e));
        (d, e)
    }

    #[test]
    fn least_loaded_pod_wins_with_fallbacks() {
        let p = pool(vec![
            pod(1, 4, 20, 0.7),
            pod(2, 0, 3, 0.1),
            pod(3, 1, 10, 0.4),
        ]);
        assert_eq!(
            pick(&p, &RequestFeatures::default()),
            Decision::Picked(vec![1, 2, 0])
        );
    }

    #[test]
    fn stale_and_unhealthy_pods_are_not_candidates() {
        let mut stale = pod(1, 0, 0, 0.0);
        stale.last_scrape_ms = 1_000; // 4 s old when the snapshot was assembled
        let mut sick = pod(2, 0, 0, 0.0);
        sick.healthy = false;
        let p = pool(vec![stale, sick, pod(3, 3, 30, 0.6)]);
        assert_eq!(best(&pick(&p, &RequestFeatures::default())), 2);
        // The snapshot itself has aged past stale_after_ms: nothing is fresh.
        let d = picker().pick(
            &p,
            &[],
            &RequestFeatures::default(),
            2_000,
            &mut SplitMix64::new(1),
            None,
        );
        assert_eq!(d, Decision::FailOpen(FailOpen::NoFreshPod));
    }

    #[test]
    fn ejected_pods_are_candidates_only_when_no_other_pod_is() {
        // Pod 0 is the idlest, and out for its server errors.
        let p = pool(vec![
            pod(1, 0, 0, 0.1),
            pod(2, 3, 8, 0.5),
            pod(3, 4, 8, 0.5),
        ]);
        let out = [p.pods[0].key];
        let req = RequestFeatures {
            ejected: &out,
            ..Default::default()
        };
        assert_eq!(best(&pick(&p, &RequestFeatures::default())), 0);
        for seed in 0..20 {
            let (d, e) = explained(&p, &req, seed);
            let Decision::Picked(ranked) = d else {
                panic!("{d:?}")
            };
            assert!(!ranked.contains(&0), "{ranked:?}");
            assert!(e.left_out.contains(&(0, LeftOut::Ejected)), "{e:?}");
        }
        // The others unhealthy or stale: the ejected pod is picked rather than failing open.
        let mut alone = pool(vec![
            pod(1, 0, 0, 0.1),
            pod(2, 0, 0, 0.1),
            pod(3, 0, 0, 0.1),
        ]);
        alone.pods[1].snap.healthy = false;
        alone.pods[2].age_at_generation_ms = 60_000;
        let out = [alone.pods[0].key];
        let req = RequestFeatures {
            ejected: &out,
            ..Default::default()
        };
        assert_eq!(pick(&alone, &req), Decision::Picked(vec![0]));
    }

    #[test]
    fn saturated_pods_are_avoided_unless_all_are_saturated() {
        // Pod 0 scores better on running but its KV is past the threshold.
        let p = pool(vec![pod(1, 0, 0, 0.95), pod(2, 2, 40, 0.5)]);
        assert_eq!(best(&pick(&p, &RequestFeatures::default())), 1);
        let all = pool(vec![pod(1, 9, 0, 0.5), pod(2, 0, 0, 0.9)]);
        assert!(matches!(
            pick(&all, &RequestFeatures::default()),
            Decision::Picked(_)
        ));
        let shed = RequestFeatures {
            sheddable: true,
            ..Default::default()
        };
        assert_eq!(pick(&all, &shed), Decision::Shed);
    }

    #[test]
    fn a_holdable_request_is_held_only_while_every_pod_is_saturated() {
        let hold = RequestFeatures {
            holdable: true,
            ..Default::default()
        };
        let all = pool(vec![pod(1, 9, 0, 0.5), pod(2, 0, 0, 0.9)]);
        assert_eq!(pick(&all, &hold), Decision::Hold(HoldReason::Saturated));
        // One pod with room: it is picked, held or not.
        let one_free = pool(vec![pod(1, 9, 0, 0.5), pod(2, 0, 0, 0.5)]);
        assert_eq!(best(&pick(&one_free, &hold)), 1);
        // Sheddable requests are still shed rather than held.
        let both = RequestFeatures {
            sheddable: true,
            ..hold
        };
        assert_eq!(pick(&all, &both), Decision::Shed);
        // With no fresh pod there is nothing to wait for: fail open.
        let d = picker().pick(&all, &[], &hold, 2_000, &mut SplitMix64::new(1), None);
        assert_eq!(d, Decision::FailOpen(FailOpen::NoFreshPod));
        // Requests this gateway sent since the snapshot fill a pod's queue: an idle pod that
        // was just sent a burst is saturated as far as the gateway knows.
        let idle = pool(vec![pod(1, 0, 0, 0.1)]);
        let mut table = LoadTable::default();
        table.rebase(1, &idle.keys);
        let held = |table: &LoadTable| {
            picker().pick(&idle, &table.pods, &hold, 0, &mut SplitMix64::new(1), None)
        };
        let mut sent = 0;
        while held(&table) != Decision::Hold(HoldReason::Saturated) {
            table.add(0, 1, 100, Some(100));
            sent += 1;
            assert!(sent <= 16, "never saturated");
        }
        assert_eq!(
            f64::from(sent),
            ScoringConfig::default().queue_threshold.ceil()
        );
    }

    #[test]
    fn with_a_pool_to_overflow_to_a_request_goes_there_only_while_every_pod_is_saturated() {
        let over = RequestFeatures {
            overflow_to: Some(3),
            ..Default::default()
        };
        let all = pool(vec![pod(1, 9, 0, 0.5), pod(2, 0, 0, 0.9)]);
        assert_eq!(pick(&all, &over), Decision::Overflow(3));
        // Before it would be shed or held.
        for (sheddable, holdable) in [(true, false), (false, true), (true, true)] {
            let req = RequestFeatures {
                sheddable,
                holdable,
                ..over.clone()
            };
            assert_eq!(pick(&all, &req), Decision::Overflow(3));
        }
        // One pod with room: it is picked.
        let one_free = pool(vec![pod(1, 9, 0, 0.5), pod(2, 0, 0, 0.5)]);
        assert_eq!(best(&pick(&one_free, &over)), 1);
        // No fresh pod is not a saturated pool: fail open (a pool without one fails over
        // before the pick).
        let d = picker().pick(&all, &[], &over, 2_000, &mut SplitMix64::new(1), None);
        assert_eq!(d, Decision::FailOpen(FailOpen::NoFreshPod));
        // Saturated by what this gateway sent since the snapshot: an idle pod that was just
        // sent a burst overflows at the request that fills its queue, not at the next snapshot.
        let idle = pool(vec![pod(1, 0, 0, 0.1)]);
        let mut table = LoadTable::default();
        table.rebase(1, &idle.keys);
        let mut sent = 0;
        loop {
            let d = picker().pick(&idle, &table.pods, &over, 0, &mut SplitMix64::new(1), None);
            if d == Decision::Overflow(3) {
                break;
            }
            assert!(matches!(d, Decision::Picked(_)), "{d:?}");
            table.add(0, 1, 100, Some(100));
            sent += 1;
            assert!(sent <= 16, "never overflowed");
        }
        assert_eq!(
            f64::from(sent),
            ScoringConfig::default().queue_threshold.ceil()
        );
    }

    #[test]
    fn a_request_waits_for_the_saturated_pod_caching_its_prompt_or_adapter_only_when_worth_it() {
        // Pod 0 is saturated (9 waiting) and holds 6 of the prompt's 8 blocks; pod 1 has room.
        let p = pool(vec![pod(1, 9, 0, 0.5), pod(2, 0, 0, 0.5)]);
        let (k0, k1) = (p.pods[0].key, p.pods[1].key);
        let deep = [PodMatch { pod: k0, depth: 6 }];
        let req = |matches, holdable, affinity_hold| RequestFeatures {
            prompt_tokens: 2_000,
            prefix_blocks: 8,
            block_tokens: 64,
            matches,
            holdable,
            affinity_hold,
            ..Default::default()
        };
        assert_eq!(
            pick(&p, &req(&deep, true, true)),
            Decision::Hold(HoldReason::Affinity { pod: k0 })
        );
        // Not allowed (hold off, or its prefix wait ran out): it goes to the pod with room.
        assert_eq!(best(&pick(&p, &req(&deep, false, true))), 1);
        assert_eq!(best(&pick(&p, &req(&deep, true, false))), 1);
        // Not worth it: the saturated pod holds less than half the prompt, or the pod with room
        // holds half as much as it does.
        let shallow = [PodMatch { pod: k0, depth: 3 }];
        assert_eq!(best(&pick(&p, &req(&shallow, true, true))), 1);
        let both = [
            PodMatch { pod: k0, depth: 6 },
            PodMatch { pod: k1, depth: 3 },
        ];
        assert_eq!(best(&pick(&p, &req(&both, true, true))), 1);
        // No prompt blocks: no wait.
        let mut r = req(&deep, true, true);
        r.prefix_blocks = 0;
        assert_eq!(best(&pick(&p, &r)), 1);
        // An adapter request waits for its adapter's pod, whatever its prompt: for the pod
        // running it, or else its home with a free slot; not when a pod with room has it, nor
        // when no pod has it (any pod loads it then).
        let a = adapter_key("a");
        let mut running = pool(vec![
            pod(1, 9, 0, 0.5),
            pod(2, 0, 0, 0.5),
            pod(3, 9, 0, 0.5),
        ]);
        running.pods[2].lora_running = vec![a];
        let k2 = running.pods[2].key;
        let mut r = req(&[], true, true);
        r.adapter = Some(a);
        r.adapter_home = Some(running.pods[0].key);
        assert_eq!(
            pick(&running, &r),
            Decision::Hold(HoldReason::Affinity { pod: k2 })
        );
        r.adapter_home = None;
        assert_eq!(
            pick(&running, &r),
            Decision::Hold(HoldReason::Affinity { pod: k2 })
        );
        r.adapter_home = Some(k0);
        assert_eq!(
            pick(&p, &r),
            Decision::Hold(HoldReason::Affinity { pod: k0 })
        );
        r.adapter_home = Some(k1);
        assert_eq!(best(&pick(&p, &r)), 1);
        r.adapter_home = None;
        assert!(matches!(pick(&p, &r), Decision::Picked(_)));
        r.affinity_hold = false;
        r.adapter_home = Some(k0);
        assert!(matches!(pick(&p, &r), Decision::Picked(_)));
        // A conversation waits for a pod that served it, whatever depth was learned, and not
        // for one that only shares its system prompt.
        let mut r = req(&[], true, true);
        let served = [k0];
        r.conversation_pods = Some(&served);
        assert_eq!(
            pick(&p, &r),
            Decision::Hold(HoldReason::Affinity { pod: k0 })
        );
        let mut r = req(&deep, true, true);
        let elsewhere = [pod_key("10.0.0.9:8000")];
        r.conversation_pods = Some(&elsewhere);
        assert_eq!(best(&pick(&p, &r)), 1);
        // Of two saturated pods, it waits for the one that caches more of the prompt.
        let two = pool(vec![
            pod(1, 9, 0, 0.5),
            pod(2, 9, 0, 0.5),
            pod(3, 0, 0, 0.5),
        ]);
        let (t0, t1) = (two.pods[0].key, two.pods[1].key);
        let both = [
            PodMatch { pod: t0, depth: 5 },
            PodMatch { pod: t1, depth: 7 },
        ];
        assert_eq!(
            pick(&two, &req(&both, true, true)),
            Decision::Hold(HoldReason::Affinity { pod: t1 })
        );
        // Every pod saturated: held for that, whatever its prefix.
        let all = pool(vec![pod(1, 9, 0, 0.5), pod(2, 9, 0, 0.5)]);
        assert_eq!(
            pick(&all, &req(&deep, true, true)),
            Decision::Hold(HoldReason::Saturated)
        );
    }

    #[test]
    fn inflight_since_the_snapshot_spreads_a_burst() {
        // Identical idle pods; a burst of 30 requests within one snapshot interval.
        let p = pool((1..=3).map(|i| pod(i, 0, 0, 0.1)).collect());
        let mut table = LoadTable::default();
        table.rebase(1, &p.keys);
        let mut rng = SplitMix64::new(9);
        let mut counts = [0usize; 3];
        for _ in 0..30 {
            let d = picker().pick(
                &p,
                &table.pods,
                &RequestFeatures::default(),
                10,
                &mut rng,
                None,
            );
            let i = best(&d);
            counts[i] += 1;
            table.add(i, 1, 100, Some(100));
        }
        assert!(counts.iter().all(|c| (9..=11).contains(c)), "{counts:?}");
    }

    /// With `pending_cost`, a long prompt goes where it holds up the fewest requests waiting
    /// for their first token (an engine that batches the waiting prefills into one step gives
    /// each its first token only when the step is done), though another pod has less work
    /// queued; a short prompt, which holds up nobody for long, still goes where the least work
    /// is queued.
    #[test]
    fn a_long_prompt_avoids_the_pod_where_it_would_hold_up_many_short_ones() {
        let p = pool(vec![pod(1, 0, 0, 0.1), pod(2, 0, 0, 0.1)]);
        let mut table = LoadTable::default();
        table.rebase(1, &p.keys);
        // Pod 0: four short prompts waiting, 400 tokens in all. Pod 1: one long one, 1,500.
        for _ in 0..4 {
            table.add(0, 1, 100, Some(100));
        }
        table.add(1, 1, 1_500, Some(1_500));
        let req = |tokens| RequestFeatures {
            prompt_tokens: tokens,
            avg_prompt_tokens: 500.0,
            ..Default::default()
        };
        let go = |cost, tokens| {
            let sc = ScoringConfig {
                pending_cost: cost,
                ..ScoringConfig::default()
            };
            let d = Picker::new(sc, 0).pick(
                &p,
                &table.pods,
                &req(tokens),
                10,
                &mut SplitMix64::new(1),
                None,
            );
            best(&d)
        };
        // Without the cost both go to pod 0: 1 average request of work queued against 3.
        assert_eq!((go(0.0, 4_000), go(0.0, 50)), (0, 0));
        // With it the long prompt (8 average requests) would hold up four there, one on pod 1.
        assert_eq!((go(1.0, 4_000), go(1.0, 50)), (1, 0));
        assert_eq!(go(0.25, 4_000), 1);

        // It never moves a request to a slower pod: an idle pod at a third of the speed would
        // hold up nobody, but the long prompt's own prefill there takes 8 against 3 here.
        let mut fast = pod(1, 0, 0, 0.1);
        fast.capacity = 3.0;
        let p = pool(vec![fast, pod(2, 0, 0, 0.1)]);
        let mut table = LoadTable::default();
        table.rebase(1, &p.keys);
        for _ in 0..4 {
            table.add(0, 1, 100, Some(100));
        }
        let sc = ScoringConfig {
            pending_cost: 1.0,
            ..ScoringConfig::default()
        };
        let d = Picker::new(sc, 0).pick(
            &p,
            &table.pods,
            &req(4_000),
            10,
            &mut SplitMix64::new(1),
            None,
        );
        assert_eq!(best(&d), 0);
    }

    #[test]
    fn a_pod_of_any_capacity_leaves_the_others_queues_telling_them_apart() {
        for cap in [1e-3, 1e-6, 1e-300, 5e-324] {
            let mut slow = pod(1, 0, 0, 0.1);
            slow.capacity = cap;
            // Pod 1 has 3 waiting, pod 2 nothing: pod 2 every time, whatever the seed.
            let p = pool(vec![slow, pod(2, 3, 0, 0.1), pod(3, 0, 0, 0.1)]);
            for seed in 0..50 {
                let (d, e) = explained(&p, &RequestFeatures::default(), seed);
                assert_eq!(best(&d), 2, "capacity {cap}, seed {seed}");
                assert!(
                    e.scored
                        .iter()
                        .all(|b| b.total.is_finite() && b.queue.is_finite()),
                    "capacity {cap}: {:?}",
                    e.scored
                );
            }
        }
        assert_eq!(speed_class(5e-324), 2f64.powi(-10));
        assert_eq!(speed_class(1e300), 2f64.powi(10));
    }

    #[test]
    fn faster_pods_get_proportionally_more_of_a_burst() {
        let mut fast = pod(1, 0, 0, 0.1);
        fast.capacity = 3.0;
        let p = pool(vec![fast, pod(2, 0, 0, 0.1)]);
        let mut table = LoadTable::default();
        table.rebase(1, &p.keys);
        let mut rng = SplitMix64::new(3);
        let mut counts = [0usize; 2];
        for _ in 0..400 {
            let i = best(&picker().pick(
                &p,
                &table.pods,
                &RequestFeatures::default(),
                10,
                &mut rng,
                None,
            ));
            counts[i] += 1;
            table.add(i, 1, 0, Some(0));
        }
        let ratio = counts[0] as f64 / counts[1] as f64;
        assert!((2.5..=3.5).contains(&ratio), "{counts:?}");
    }

    #[test]
    fn speed_classes_ignore_noise_and_keep_generations_apart() {
        assert_eq!(speed_class(1.0), 1.0);
        assert_eq!(speed_class(1.15), 1.0);
        assert_eq!(speed_class(0.86), 1.0);
        assert!((speed_class(1.9) - 2.0).abs() < 1e-9);
        assert!((speed_class(0.65) - 0.5f64.sqrt()).abs() < 1e-9);
        assert!(speed_class(3.0) / speed_class(0.33) > 6.0);
        assert_eq!(speed_class(f64::NAN), 1.0);
    }

    #[test]
    fn an_idle_faster_pod_wins_and_equal_pods_share() {
        let mut fast = pod(1, 0, 0, 0.0);
        fast.capacity = 3.0;
        let p = pool(vec![fast, pod(2, 0, 0, 0.0)]);
        let mut rng = SplitMix64::new(5);
        for _ in 0..50 {
            assert_eq!(
                best(&picker().pick(&p, &[], &RequestFeatures::default(), 0, &mut rng, None)),
                0
            );
        }
        // Identical idle pods: a fair coin.
        let same = pool(vec![pod(1, 0, 0, 0.0), pod(2, 0, 0, 0.0)]);
        let n = 2_000;
        let first = (0..n)
            .filter(|_| {
                best(&picker().pick(&same, &[], &RequestFeatures::default(), 0, &mut rng, None))
                    == 0
            })
            .count();
        let share = first as f64 / n as f64;
        assert!((0.45..=0.55).contains(&share), "{share}");
    }

    fn lora_pod(i: u32, running: &[&str], waiting: &[&str], max: u32) -> PodSnapshot {
        let mut p = pod(i, 0, 2, 0.2);
        p.lora = Some(LoraState {
            max_loras: max,
            running: running.iter().map(|s| s.to_string()).collect(),
            waiting: waiting.iter().map(|s| s.to_string()).collect(),
        });
        p
    }

    #[test]
    fn lora_resident_beats_free_slot_beats_waiting() {
        let p = pool(vec![
            lora_pod(1, &["x", "y"], &["sql"], 2),
            lora_pod(2, &["x"], &[], 2),
            lora_pod(3, &["sql", "y"], &[], 2),
            lora_pod(4, &["x", "y"], &[], 2),
        ]);
        let sql = adapter_key("sql");
        let score = |i: usize, loaded: bool| lora_score(&p.pods[i], sql, loaded);
        assert_eq!(score(2, false), 1.0);
        assert!(score(1, false) > score(0, false), "free slot > waiting");
        assert!(score(0, false) > score(3, false), "waiting > nothing");
        assert_eq!(score(3, false), 0.0);
        // Home or last pod: likely loaded, above any free slot, below running.
        assert!(score(3, true) > score(1, false) && score(3, true) < 1.0);
        assert_eq!(score(2, true), 1.0);
        // End to end: the resident pod wins.
        let req = RequestFeatures {
            adapter: Some(sql),
            ..Default::default()
        };
        assert_eq!(best(&pick(&p, &req)), 2);
    }

    #[test]
    fn the_adapter_home_beats_a_free_slot_elsewhere() {
        let p = pool((1..=6).map(|i| lora_pod(i, &[], &[], 4)).collect());
        let req = RequestFeatures {
            adapter: Some(adapter_key("brand-new")),
            adapter_home: Some(p.pods[4].key),
            ..Default::default()
        };
        for seed in 0..20 {
            assert_eq!(
                best(&picker().pick(&p, &[], &req, 0, &mut SplitMix64::new(seed), None)),
                4
            );
        }
    }

    /// Pod 0 running the adapters `running` with `waiting` queued requests (an adapter's home,
    /// in the tests), then `idle` idle pods with four free slots each.
    fn busy_and_idle(running: &[&str], waiting: u32, idle: u32) -> PoolState {
        let mut busy = lora_pod(1, running, &[], 4);
        busy.waiting = waiting;
        let idle = (2..2 + idle).map(|i| lora_pod(i, &[], &[], 4));
        pool(std::iter::once(busy).chain(idle).collect())
    }

    #[test]
    fn adapter_requests_stay_on_their_pods_until_those_saturate() {
        // The adapter's home (pod 0) with `waiting` queued requests, two idle pods with free slots.
        let setup = |waiting| {
            let p = busy_and_idle(&["x"], waiting, 2);
            let req = RequestFeatures {
                adapter: Some(adapter_key("sql")),
                adapter_home: Some(p.pods[0].key),
                ..Default::default()
            };
            (p, req)
        };
        // Busier, but it holds the adapter: no copy is made elsewhere.
        let (p, req) = setup(3);
        assert_eq!(pick(&p, &req), Decision::Picked(vec![0]));
        // Saturated: the escape valve opens and a free slot elsewhere takes it.
        let (p, req) = setup(9);
        assert_ne!(best(&pick(&p, &req)), 0);
    }

    #[test]
    fn an_adapter_request_leaves_its_adapters_pods_at_lora_queue_threshold() {
        // The adapter's home (pod 0) with 3 queued requests, two idle pods with free slots.
        let p = busy_and_idle(&["x"], 3, 2);
        let with = |queue: f64, lora: Option<f64>| {
            let mut sc = ScoringConfig {
                queue_threshold: queue,
                ..Default::default()
            };
            if let Some(l) = lora {
                sc.lora_queue_threshold = l;
            }
            Picker::new(sc, 2)
        };
        let adapter = RequestFeatures {
            adapter: Some(adapter_key("sql")),
            adapter_home: Some(p.pods[0].key),
            ..Default::default()
        };
        let go = |pk: &Picker, r: &RequestFeatures<'_>| {
            pk.pick(&p, &[], r, 0, &mut SplitMix64::new(1), None)
        };
        // A low queue threshold saturates pod 0: a base-model request goes elsewhere, the
        // adapter's stays (under `lora_queue_threshold`, 5).
        let low = with(1.0, None);
        assert_ne!(best(&go(&low, &RequestFeatures::default())), 0);
        assert_eq!(go(&low, &adapter), Decision::Picked(vec![0]));
        // With `hold`, it waits at the gateway for pod 0 as long as it may (as a request for a
        // saturated pod's prompt does), then goes to pod 0, not to a free slot elsewhere.
        let holding = RequestFeatures {
            holdable: true,
            affinity_hold: true,
            ..adapter.clone()
        };
        let waited = RequestFeatures {
            affinity_hold: false,
            ..holding.clone()
        };
        let awaited = Decision::Hold(HoldReason::Affinity { pod: p.pods[0].key });
        assert_eq!(go(&low, &holding), awaited);
        assert_eq!(go(&low, &waited), Decision::Picked(vec![0]));
        // The adapter's own threshold is the escape: at 3, it leaves pod 0 for a free slot
        // (having waited for pod 0 first, with `hold`).
        let escape = with(1.0, Some(3.0));
        assert_ne!(best(&go(&escape, &adapter)), 0);
        assert_eq!(go(&escape, &holding), awaited);
        assert_ne!(best(&go(&escape, &waited)), 0);
        // Only the pods that hold the adapter: another adapter's request treats pod 0 as any.
        let other = RequestFeatures {
            adapter: Some(adapter_key("chat")),
            adapter_home: Some(p.pods[1].key),
            ..Default::default()
        };
        assert_eq!(best(&go(&low, &other)), 1);
        let mut away = p.clone();
        away.pods[1].snap.waiting = 3;
        let on = |pk: &Picker| best(&pk.pick(&away, &[], &other, 0, &mut SplitMix64::new(1), None));
        assert_eq!(on(&low), 1);
        assert_ne!(on(&escape), 1);
        // The explanation: a saturated adapter pod kept for its adapter is scored, not left out.
        let mut e = Explain::default();
        let d = low.pick(&p, &[], &adapter, 0, &mut SplitMix64::new(1), Some(&mut e));
        assert_eq!(d, Decision::Picked(vec![0]));
        assert_eq!(
            e.left_out,
            vec![
                (1, LeftOut::AdapterElsewhere),
                (2, LeftOut::AdapterElsewhere)
            ]
        );
    }

    #[test]
    fn an_adapter_request_its_pod_keeps_does_not_overflow() {
        // Both pods have one waiting (saturated at `queue_threshold: 1`, under
        // `lora_queue_threshold`, 5); pod 0 runs the adapter.
        let mut p = busy_and_idle(&["sql"], 1, 1);
        p.pods[1].snap.waiting = 1;
        let low = Picker::new(
            ScoringConfig {
                queue_threshold: 1.0,
                ..Default::default()
            },
            2,
        );
        let go = |p: &PoolState, r: &RequestFeatures<'_>| {
            low.pick(p, &[], r, 0, &mut SplitMix64::new(1), None)
        };
        let base = RequestFeatures {
            overflow_to: Some(3),
            ..Default::default()
        };
        let sql = RequestFeatures {
            adapter: Some(adapter_key("sql")),
            ..base.clone()
        };
        // A base-model request goes over; the adapter's request stays on the pod running it.
        assert_eq!(go(&p, &base), Decision::Overflow(3));
        assert_eq!(go(&p, &sql), Decision::Picked(vec![0]));
        // Its home with a free slot keeps it too (nothing runs it yet).
        let mut homed = p.clone();
        homed.pods[0].lora_running.clear();
        let home = RequestFeatures {
            adapter_home: Some(homed.pods[0].key),
            ..sql.clone()
        };
        assert_eq!(go(&homed, &home), Decision::Picked(vec![0]));
        // It stays as in a pool without overflow: shed or held as the README says a request
        // is while every pod is saturated.
        let shed = RequestFeatures {
            sheddable: true,
            ..sql.clone()
        };
        assert_eq!(go(&p, &shed), Decision::Shed);
        let hold = RequestFeatures {
            holdable: true,
            ..sql.clone()
        };
        assert_eq!(go(&p, &hold), Decision::Hold(HoldReason::Saturated));
        // At `lora_queue_threshold` its pod no longer keeps it: it goes over.
        let mut full = p.clone();
        full.pods[0].snap.waiting = 5;
        assert_eq!(go(&full, &sql), Decision::Overflow(3));
        // So does an adapter no pod holds.
        let other = RequestFeatures {
            adapter: Some(adapter_key("chat")),
            ..base.clone()
        };
        assert_eq!(go(&p, &other), Decision::Overflow(3));
    }

    #[test]
    fn a_saturated_adapter_home_overflows_to_one_pod_whatever_the_prompt() {
        // Pod 0 is the adapter's home and saturated; three idle pods with free slots. Prompts
        // differ (each its own prefix home key): the overflow still goes to one pod, so the
        // adapter is loaded once more, not once per pod.
        let p = busy_and_idle(&["sql"], 9, 3);
        let picks: std::collections::HashSet<usize> = (0..40u64)
            .map(|prompt| {
                let req = RequestFeatures {
                    adapter: Some(adapter_key("sql")),
                    adapter_home: Some(p.pods[0].key),
                    prefix_blocks: 8,
                    home_key: Some(prompt.wrapping_mul(0x9E37_79B9_7F4A_7C15)),
                    ..Default::default()
                };
                best(&picker().pick(&p, &[], &req, 0, &mut SplitMix64::new(prompt), None))
            })
            .collect();
        assert_eq!(picks.len(), 1, "{picks:?}");
        assert!(!picks.contains(&0));
    }

    #[test]
    fn prefix_match_attracts_and_home_is_seed_independent() {
        let p = pool((1..=4).map(|i| pod(i, 0, 5, 0.3)).collect());
        let matches = [PodMatch {
            pod: pod_key("10.0.0.3:8000"),
            depth: 30,
        }];
        let req = RequestFeatures {
            prefix_blocks: 32,
            home_key: Some(77),
            matches: &matches,
            ..Default::default()
        };
        assert_eq!(best(&pick(&p, &req)), 2);
        let fresh = RequestFeatures {
            prefix_blocks: 32,
            home_key: Some(77),
            ..Default::default()
        };
        let homes: Vec<usize> = (0..20)
            .map(|seed| best(&picker().pick(&p, &[], &fresh, 0, &mut SplitMix64::new(seed), None)))
            .collect();
        assert!(homes.iter().all(|h| *h == homes[0]), "{homes:?}");
    }

    #[test]
    fn a_prompt_that_does_not_fit_in_free_kv_goes_elsewhere() {
        // 1,000 blocks of 16 tokens: pod 0 has 4,000 tokens free, pod 1 has 8,000 and a bit
        // more load.
        let mut a = pod(1, 0, 2, 0.75);
        let mut b = pod(2, 1, 6, 0.5);
        for p in [&mut a, &mut b] {
            p.block_size = Some(16);
            p.num_blocks = Some(1_000);
        }
        let p = pool(vec![a, b]);
        let big = RequestFeatures {
            prompt_tokens: 6_000,
            avg_prompt_tokens: 2_000.0,
            ..Default::default()
        };
        assert_eq!(best(&pick(&p, &big)), 1);
        let small = RequestFeatures {
            prompt_tokens: 500,
            avg_prompt_tokens: 2_000.0,
            ..Default::default()
        };
        assert_eq!(best(&pick(&p, &small)), 0);
    }

    #[test]
    fn load_outweighs_a_short_prefix_match() {
        let p = pool(vec![pod(1, 6, 40, 0.75), pod(2, 0, 2, 0.1)]);
        let matches = [PodMatch {
            pod: pod_key("10.0.0.1:8000"),
            depth: 2,
        }];
        let req = RequestFeatures {
            prefix_blocks: 32,
            matches: &matches,
            ..Default::default()
        };
        assert_eq!(best(&pick(&p, &req)), 1);
    }

    #[test]
    fn pods_ramp_up_held_back_are_picked_when_no_other_pod_can_be() {
        let ramping = |n: u32, w: f64| {
            let mut p = pod(n, 0, 0, 0.1);
            p.ramp_weight = w;
            p
        };
        let pick_seeded = |p: &PoolState, seed: u64| {
            let req = RequestFeatures::default();
            picker().pick(p, &[], &req, 0, &mut SplitMix64::new(seed), None)
        };
        // A one-pod pool whose pod came back, and a pool whose every pod came back: picked every
        // time (before, 9 of 10 requests at 0.1 failed open to Envoy's balancer).
        for pods in [
            vec![ramping(1, 0.1)],
            vec![ramping(1, 0.1), ramping(2, 0.3)],
        ] {
            let p = pool(pods);
            for seed in 0..200 {
                let d = pick_seeded(&p, seed);
                assert!(matches!(d, Decision::Picked(_)), "seed {seed}: {d:?}");
            }
        }
        // Beside a pod at full weight the returning one keeps to its share.
        let p = pool(vec![ramping(1, 0.1), pod(2, 0, 0, 0.1)]);
        let first = (0..2_000)
            .filter(|&seed| best(&pick_seeded(&p, seed)) == 0)
            .count();
        assert!((100..=300).contains(&first), "{first} of 2000");
        // A weight of 0 takes nothing, alone or not.
        let p = pool(vec![ramping(1, 0.0)]);
        let (d, e) = explained(&p, &RequestFeatures::default(), 3);
        assert_eq!(d, Decision::FailOpen(FailOpen::NoFreshPod));
        assert_eq!(e.left_out, vec![(0, LeftOut::Ramping)]);
    }

    #[test]
    fn breakdown_lists_every_candidate() {
        let p = pool(vec![pod(1, 0, 0, 0.0), pod(2, 1, 1, 0.5)]);
        let (d, e) = explained(&p, &RequestFeatures::default(), 1);
        assert_eq!(e.scored.len(), 2);
        assert!(e.left_out.is_empty());
        let s = format_breakdown(&p, Some(best(&d)), &e);
        assert!(s.starts_with("pool=p; picked=10.0.0.1:8000"), "{s}");
        assert!(s.contains("10.0.0.2:8000 total="));
        assert!(!s.contains("left-out"), "{s}");
    }

    #[test]
    fn the_explanation_names_every_pod_left_out_and_why() {
        let mut unhealthy = lora_pod(1, &["sql"], &[], 2);
        unhealthy.healthy = false;
        let stale = {
            let mut p = lora_pod(2, &["sql"], &[], 2);
            p.last_scrape_ms = 0; // 5 s before the snapshot; stale after 1 s
            p
        };
        let ramping = {
            let mut p = lora_pod(3, &["sql"], &[], 2);
            p.ramp_weight = 0.0;
            p
        };
        let saturated = {
            let mut p = lora_pod(4, &["sql"], &[], 2);
            p.kv_cache_usage = Some(0.99);
            p
        };
        let p = pool(vec![
            unhealthy,
            stale,
            ramping,
            saturated,
            lora_pod(5, &["x"], &[], 2),   // does not hold the adapter
            lora_pod(6, &["sql"], &[], 2), // runs it
        ]);
        let req = RequestFeatures {
            adapter: Some(adapter_key("sql")),
            ..Default::default()
        };
        let (d, e) = explained(&p, &req, 7);
        // Explaining does not change the pick.
        let plain = picker().pick(&p, &[], &req, 0, &mut SplitMix64::new(7), None);
        assert_eq!(d, plain);
        assert_eq!(best(&d), 5);
        assert_eq!(
            e.left_out,
            vec![
                (0, LeftOut::Unhealthy),
                (1, LeftOut::Stale),
                (2, LeftOut::Ramping),
                (3, LeftOut::Saturated),
                (4, LeftOut::AdapterElsewhere),
            ]
        );
        assert_eq!(e.scored.iter().map(|b| b.pod).collect::<Vec<_>>(), vec![5]);
        let s = format_breakdown(&p, Some(5), &e);
        assert!(
            s.ends_with(
                "; left-out=10.0.0.1:8000 unhealthy,10.0.0.2:8000 stale,10.0.0.3:8000 ramping,\
                 10.0.0.4:8000 saturated,10.0.0.5:8000 adapter-elsewhere"
            ),
            "{s}"
        );
    }

    #[test]
    fn the_breakdown_lists_the_pick_first_then_best_first() {
        let p = pool(vec![
            pod(1, 3, 20, 0.6),
            pod(2, 0, 1, 0.1),
            pod(3, 1, 8, 0.3),
        ]);
        let (d, e) = explained(&p, &RequestFeatures::default(), 1);
        assert_eq!(best(&d), 1);
        let s = format_breakdown(&p, Some(1), &e);
        let listed: Vec<&str> = s
            .split("; ")
            .skip(2)
            .map(|part| part.split(' ').next().unwrap_or(""))
            .collect();
        assert_eq!(
            listed,
            ["10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8000"],
            "{s}"
        );
        // The pick comes first even when another pod scored as well (a tie broken at random).
        let s = format_breakdown(&p, Some(2), &e);
        assert!(
            s.starts_with("pool=p; picked=10.0.0.3:8000; 10.0.0.3:8000 total="),
            "{s}"
        );
    }

    #[test]
    fn a_large_pools_breakdown_is_capped_and_counts_what_it_leaves_out() {
        // 1,000 pods: 600 fresh (scored), 400 stale (left out). The whole breakdown would be
        // ~55 KiB.
        let pods = (0..1_000)
            .map(|i| {
                let mut p = PodSnapshot::new(format!("10.1.{}.{}:8000", i / 250, i % 250), 5_000);
                p.waiting = i % 4;
                p.running = i % 17;
                p.kv_cache_usage = Some(f64::from(i % 10) / 20.0);
                if i >= 600 {
                    p.last_scrape_ms = 0;
                }
                p
            })
            .collect();
        let p = pool(pods);
        let (d, e) = explained(&p, &RequestFeatures::default(), 3);
        assert_eq!((e.scored.len(), e.left_out.len()), (600, 400));
        let s = format_breakdown(&p, Some(best(&d)), &e);
        assert!(s.len() <= DEBUG_HEADER_MAX, "{}", s.len());
        let picked = &p.pods[best(&d)].snap.address;
        assert!(
            s.starts_with(&format!("pool=p; picked={picked}; {picked} total=")),
            "{s}"
        );
        let listed = s.matches(" total=").count();
        assert!(listed >= 80, "{listed}");
        assert!(
            !s.contains("left-out="),
            "the scored pods fill the header first"
        );
        assert!(
            s.ends_with(&format!("; omitted={} scored,400 left-out", 600 - listed)),
            "{}",
            &s[s.len() - 80..]
        );
        // A pool whose left-out list alone overflows: the list is cut and counted.
        let mut e = Explain::default();
        for i in 0..1_000 {
            e.left_out.push((i, LeftOut::Stale));
        }
        let s = format_breakdown(&p, None, &e);
        assert!(s.len() <= DEBUG_HEADER_MAX, "{}", s.len());
        let listed = s.matches(" stale").count();
        assert!(listed >= 200, "{listed}");
        assert!(
            s.ends_with(&format!("; omitted=0 scored,{} left-out", 1_000 - listed)),
            "{s}"
        );
    }

    #[test]
    fn saturated_pods_are_scored_not_left_out_when_every_pod_is() {
        let p = pool(vec![pod(1, 0, 0, 0.99), pod(2, 0, 0, 0.98)]);
        let (d, e) = explained(&p, &RequestFeatures::default(), 1);
        assert!(matches!(d, Decision::Picked(_)));
        assert!(e.left_out.is_empty());
        assert!(e.scored.iter().all(|b| b.saturated));
    }

    fn arb_pod() -> impl Strategy<Value = PodSnapshot> {
        (
            0u32..50,
            0u32..300,
            proptest::option::of(0.0f64..1.0),
            any::<bool>(),
            0u64..3_000,
            0.1f64..5.0,
            0.0f64..=1.0,
        )
            .prop_map(|(w, r, kv, healthy, age, cap, ramp)| {
                let mut p = PodSnapshot::new("0.0.0.0:1", 5_000 - age);
                p.waiting = w;
                p.running = r;
                p.kv_cache_usage = kv;
                p.healthy = healthy;
                p.capacity = cap;
                p.ramp_weight = ramp;
                p
            })
    }

    #[test]
    fn fmax_and_fmin_equal_std_including_nan() {
        let values = [
            f64::NAN,
            f64::NEG_INFINITY,
            -2.5,
            -0.0,
            0.0,
            f64::MIN_POSITIVE,
            1.0,
            3.5,
            f64::INFINITY,
        ];
        for a in values {
            for b in values {
                // Bit for bit, except which zero a tie of 0.0 and -0.0 gives (std leaves it open).
                let same = |x: f64, y: f64| x.to_bits() == y.to_bits() || (x == 0.0 && y == 0.0);
                assert!(same(fmax(a, b), a.max(b)), "max({a}, {b})");
                assert!(same(fmin(a, b), a.min(b)), "min({a}, {b})");
            }
        }
    }

    proptest! {
        #[test]
        fn pick_is_always_a_fresh_healthy_candidate(pods in proptest::collection::vec(arb_pod(), 1..20), seed in any::<u64>(), age in 0u64..1_500) {
            let pods: Vec<PodSnapshot> = pods.into_iter().enumerate().map(|(i, mut p)| { p.address = format!("10.1.0.{i}:80"); p }).collect();
            let pl = pool(pods);
            let d = picker().pick(&pl, &[], &RequestFeatures::default(), age, &mut SplitMix64::new(seed), None);
            let eligible = |i: usize| {
                let p = &pl.pods[i];
                p.snap.healthy && age + p.age_at_generation_ms <= 1_000
            };
            match d {
                Decision::Picked(v) => {
                    prop_assert!(!v.is_empty());
                    let mut seen = std::collections::HashSet::new();
                    for i in &v {
                        prop_assert!(eligible(*i));
                        prop_assert!(seen.insert(*i));
                    }
                }
                Decision::FailOpen(FailOpen::NoFreshPod) => {
                    // Only when no pod is eligible, or every eligible one has a ramp-up weight of 0:
                    // pods ramp-up held back are candidates when no other pod is.
                    prop_assert!((0..pl.pods.len()).all(|i| !eligible(i) || pl.pods[i].snap.ramp_weight == 0.0));
                }
                other => prop_assert!(false, "unexpected {:?}", other),
            }
        }

        #[test]
        fn same_seed_same_pick(pods in proptest::collection::vec(arb_pod(), 1..20), seed in any::<u64>()) {
            let pods: Vec<PodSnapshot> = pods.into_iter().enumerate().map(|(i, mut p)| { p.address = format!("10.1.0.{i}:80"); p }).collect();
            let pl = pool(pods);
            let a = picker().pick(&pl, &[], &RequestFeatures::default(), 0, &mut SplitMix64::new(seed), None);
            let b = picker().pick(&pl, &[], &RequestFeatures::default(), 0, &mut SplitMix64::new(seed), None);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn the_explanation_changes_nothing_and_accounts_for_every_pod(pods in proptest::collection::vec(arb_pod(), 1..20), seed in any::<u64>(), age in 0u64..1_500) {
            let pods: Vec<PodSnapshot> = pods.into_iter().enumerate().map(|(i, mut p)| { p.address = format!("10.1.0.{i}:80"); p }).collect();
            let pl = pool(pods);
            let mut e = Explain::default();
            let a = picker().pick(&pl, &[], &RequestFeatures::default(), age, &mut SplitMix64::new(seed), Some(&mut e));
            let b = picker().pick(&pl, &[], &RequestFeatures::default(), age, &mut SplitMix64::new(seed), None);
            prop_assert_eq!(&a, &b);
            let mut seen: Vec<usize> = e.scored.iter().map(|x| x.pod).chain(e.left_out.iter().map(|x| x.0)).collect();
            seen.sort_unstable();
            match a {
                // Every pod either scored or left out, once.
                Decision::Picked(_) => prop_assert_eq!(seen, (0..pl.pods.len()).collect::<Vec<_>>()),
                // Nothing scored; every pod left out as unhealthy, stale or ramping.
                _ => {
                    prop_assert!(e.scored.is_empty());
                    prop_assert_eq!(seen, (0..pl.pods.len()).collect::<Vec<_>>());
                }
            }
        }
    }
}
