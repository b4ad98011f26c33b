//! The per-request pipeline, in three steps around the one thing only the host can do (read and
//! update the shared in-flight table):
//!
//! 1. [`Engine::prepare`]: parse the body, resolve the model to its pool, hash the prompt
//!    ([`Reader::read`], which needs none of the engine's changing state), then look up the
//!    learned prefix index ([`Engine::prepare_read`]);
//! 2. [`Engine::decide`]: score the pool's candidates with the shared load table;
//! 3. [`Engine::commit`]: remember where the prompt went (prefix index, sync log for the other
//!    workers).
//!
//! The filter, the native tests and the criterion benchmark all run exactly this code.

use crate::adapters::{partition, SlotPod};
use crate::config::{FilterConfig, PrefixConfig, ScoringConfig};
use crate::error::ApiError;
use crate::fleet::{adapter_key, FleetState, PoolState};
use crate::form;
use crate::headers;
use crate::load::{InFlight, PodLoad};
use crate::outlier::{self, Ejection, Outliers};
use crate::picker::{format_breakdown, Decision, Explain, FailOpen, Picker, RequestFeatures};
use crate::picker::{has_room_by_snapshot, uncached_tokens};
use crate::prefix::{self, Anchor, PodMatch, PrefixIndex, SyncLog, SyncRecord};
use crate::request::{self, Endpoint, InferenceRequest};
use crate::responses::{is_response_key, ResponseTable};
use crate::rng::{mix64, SplitMix64};
use crate::routing::{failover_stat, overflow_stat, Resolved, RoutingTable, Split, Target};
use std::collections::HashMap;
use std::sync::Arc;

/// Records kept in a worker's outgoing sync ring: at the default 20 ms tick this covers 25,600
/// requests/s per worker before a slow reader can miss any (a miss only costs affinity).
pub const SYNC_RING: usize = 512;

/// Seed domain of adapter keys in the index.
const ADAPTER_DOMAIN: u64 = 0x6c6f_7261_6164_6170;

pub use crate::responses::response_key;

/// Slots of the table of learned responses that the workers of one Envoy share (proxy-wasm
/// shared data, one key per slot): a worker that misses a response in its own index looks there
/// before its tick brings the other workers' records. A newer response takes an older one's
/// slot; the records between workers still carry every one.
pub const RESPONSE_SLOTS: u64 = 4096;

/// The shared-data key of `key`'s slot.
pub fn response_slot_key(key: u64) -> String {
    format!("gpuroute.resp.{}", key % RESPONSE_SLOTS)
}

/// The shared-data key of `key`'s slot, and the slot's value for `key` at `pod`.
pub fn response_slot(key: u64, pod: u64) -> (String, [u8; 16]) {
    let mut value = [0u8; 16];
    value[..8].copy_from_slice(&key.to_le_bytes());
    value[8..].copy_from_slice(&pod.to_le_bytes());
    (response_slot_key(key), value)
}

/// The pod a slot's value holds for `key` (`None`: another response's, or not a slot value).
pub fn response_slot_pod(key: u64, value: &[u8]) -> Option<u64> {
    let (k, pod) = value.split_first_chunk::<8>()?;
    let pod: [u8; 8] = pod.try_into().ok()?;
    (u64::from_le_bytes(*k) == key).then_some(u64::from_le_bytes(pod))
}

/// What a shell knows of a request besides its path and body.
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestContext<'a> {
    /// The worker's snapshot (None before the first one): a split passes over a target whose
    /// pool it shows without a healthy pod with fresh metrics.
    pub fleet: Option<&'a FleetState>,
    /// Envoy's clock, unix ms.
    pub now_ms: u64,
    /// `x-gateway-split-key`: keys a split instead of the conversation.
    pub split_key: Option<&'a str>,
    /// A split's target already chosen, by its index: the one holding the stored response a
    /// turn continues ([`Engine::follow_response`]).
    pub split_target: Option<usize>,
}

/// The target a request to a split took.
#[derive(Debug, Clone)]
pub struct SplitTaken {
    pub split: Arc<Split>,
    /// Index of the target in the split.
    pub target: usize,
    /// Moved off the target its key names, whose pool could not serve.
    pub rerouted: bool,
    /// The target whose pool holds the stored response the turn continues, whatever its key
    /// names ([`Engine::follow_response`]).
    pub response: bool,
}

impl SplitTaken {
    /// The split's name and the served name of the target taken.
    pub fn names(&self) -> (&str, &str) {
        (
            self.split.name.as_str(),
            self.split.target_name(self.target),
        )
    }
}

/// A request moved off its pool to one of the pool's failover pools (`pools[].failover`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedOver {
    /// The pool the request was for.
    pub from: Arc<str>,
    /// Its configuration index: whose failover list a further move follows.
    pub origin: usize,
    /// Moved (last) because every pod of the pool it was in was saturated (`pools[].overflow`):
    /// `from`, or after a failover the failover pool. False: moved only because none of
    /// `from`'s pods could take it.
    pub overflow: bool,
}

impl FailedOver {
    /// Its counter, for the pool `to` it went to: `gpuroute.failover.<from>.to.<to>`, or
    /// `gpuroute.overflow.<from>.to.<to>`.
    pub fn stat(&self, to: &str) -> String {
        match self.overflow {
            false => failover_stat(&self.from, to),
            true => overflow_stat(&self.from, to),
        }
    }
}

/// A request after step 1.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub target: Arc<Target>,
    /// Pool name (what `x-gateway-pool` carries).
    pub pool: Arc<str>,
    pub stream: bool,
    pub prompt_tokens: u32,
    /// What the request counts as in its pod's in-flight table: its `n`, times a completions
    /// batch's prompts ([`crate::request::InferenceRequest::sequences`]).
    pub sequences: u32,
    /// The request needs its model's pool, not a pod's capacity (`/v1/messages/count_tokens`,
    /// `/tokenize`, `/detokenize`):
    /// [`Engine::decide`] leaves the pod to Envoy ([`FailOpen::ModelOnly`]).
    pub model_only: bool,
    /// How the body's `model` changes on its way to the pod, when an alias or a split named it.
    pub rewrite: Option<BodyRewrite>,
    /// For a request to a split: which target it took.
    pub split: Option<SplitTaken>,
    /// Set when the request went to a failover pool (`pool` names that one) instead of its own.
    pub failed_over: Option<FailedOver>,
    anchors: Vec<Anchor>,
    prefix_blocks: u32,
    home_key: Option<u64>,
    /// Set for conversations: the rendezvous key is then the conversation's key, and it is
    /// recorded in the index too, so the pods that served earlier turns are known.
    conversation: Option<u64>,
    /// For conversations: the key of the whole prompt as read ([`prefix::turn_keys`]), recorded
    /// in the index so the next turn finds the pods that hold it; and the key of the previous
    /// turn's prompt, looked up. `turn_cut`: the prompt reached the limit after the
    /// conversation key, so a previous turn that reached it too has the same `turn` key.
    turn: Option<u64>,
    history: Option<u64>,
    turn_cut: bool,
    /// The pods credited as holding the conversation: those that served its previous turn
    /// (`history`) when known, else those that served any turn with its conversation key (all
    /// that open alike: the same system prompt and first user message).
    conversation_pods: Vec<u64>,
    /// For adapter requests: the index key of the adapter, and the pod it was last sent to
    /// (likely still loaded there even when no request of it is running).
    adapter_anchor: Option<u64>,
    adapter_recent: Option<u64>,
    matches: Vec<PodMatch>,
    /// A Responses API request: the shell learns its answer's id and pod
    /// ([`Engine::learn_response`]).
    pub learns_response: bool,
    /// The key of the stored response a Responses API turn continues (`previous_response_id`),
    /// and the pod that made it, when this engine knows.
    response_key: Option<u64>,
    response_pod: Option<u64>,
}

impl Prepared {
    /// The headers that steer Envoy's route to the pool (name, value), in the order the shells
    /// add them: pool and model, and for an adapter its base model and the adapter.
    pub fn routing_headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        let t = &self.target;
        [
            Some((headers::POOL, &*self.pool)),
            Some((headers::MODEL, t.model.as_str())),
            t.adapter
                .as_ref()
                .map(|_| (headers::BASE_MODEL, t.base_model.as_str())),
            t.adapter.as_deref().map(|a| (headers::ADAPTER, a)),
        ]
        .into_iter()
        .flatten()
    }

    /// The in-flight record of this request once it is counted against `pod_key`.
    pub fn in_flight(&self, pod_key: u64, prefill_tokens: u32) -> InFlight {
        InFlight {
            pool: Arc::clone(&self.pool),
            pod_key,
            sequences: self.sequences,
            tokens: self.prompt_tokens,
            prefill_tokens,
            in_prefill: self.stream,
        }
    }

    /// The key of the stored response a Responses API turn continues when this engine does not
    /// know its pod (yet): a worker may look in the shared slots ([`response_slot`]) and tell
    /// it with [`Engine::note_response`], then look again ([`Engine::look_up_response`]).
    pub fn missed_response(&self) -> Option<u64> {
        self.response_key.filter(|_| self.response_pod.is_none())
    }

    /// A turn sent to a split that continues a stored response whose pod is known: one that
    /// [`Engine::follow_response`] may read again.
    #[inline]
    pub fn may_follow_response(&self) -> bool {
        self.split.is_some() && self.response_pod.is_some()
    }

    /// The least prefill a pod is known to leave this request: its prompt tokens less the
    /// deepest match on a pod (for a conversation, only on a pod that served it, as the picker
    /// credits them), with `block_tokens` tokens a matched block. What `hold.order: shortest`
    /// orders by.
    pub fn least_prefill(&self, block_tokens: u32) -> u32 {
        let credited =
            |m: &&PodMatch| self.conversation.is_none() || self.conversation_pods.contains(&m.pod);
        let depth = self.matches.iter().filter(credited).map(|m| m.depth).max();
        uncached_tokens(self.prompt_tokens, depth.unwrap_or(0), block_tokens)
    }

    /// A Responses API turn that names a stored response (`previous_response_id`).
    pub fn continues_response(&self) -> bool {
        self.response_key.is_some()
    }

    /// Hashes recorded in the index: the anchors, plus the conversation, turn and adapter keys.
    /// `out` is cleared first.
    pub fn anchor_hashes(&self, out: &mut Vec<u64>) {
        out.clear();
        out.extend(self.anchors.iter().map(|a| a.hash));
        out.extend(self.conversation);
        out.extend(self.turn);
        out.extend(self.adapter_anchor);
    }
}

/// The outcome of step 2.
#[derive(Debug, Clone, PartialEq)]
pub struct Choice {
    pub decision: Decision,
    /// `ip:port[,ip:port...]`, best first, when pods were picked.
    pub destination: Option<String>,
    /// Key of the best pod (for the load table and the prefix index).
    pub picked_key: Option<u64>,
    /// Index of the best pod in the pool.
    pub picked_index: Option<usize>,
    /// Prompt tokens the best pod must prefill (those it is not known to hold in its cache).
    pub prefill_tokens: u32,
    /// Score breakdown for the debug header, when asked for.
    pub debug: Option<String>,
    /// The request continues a stored response ([`Prepared::continues_response`]), and went
    /// to the pod that holds it.
    pub pinned_response: bool,
}

/// Per-request inputs of [`Engine::decide`] besides the pool state.
#[derive(Debug, Clone, Copy, Default)]
pub struct DecideOptions {
    /// Envoy's clock, unix ms.
    pub now_ms: u64,
    /// `x-gateway-priority` < 0.
    pub sheddable: bool,
    /// May be held while the pool is saturated (`hold` is on, the request is whole, its wait
    /// has not run out and the worker has room to hold it).
    pub holdable: bool,
    /// With `holdable`: may also wait for the saturated pod that caches its prompt
    /// (`hold.affinity_wait_ms` is on and has not run out for the request).
    pub affinity_hold: bool,
    /// Produce the score breakdown for the debug header.
    pub debug: bool,
}

/// The debug header (`debug_header`) of a request that was held (`hold`) for `waited_ms`
/// before its decision `debug`: `held=<ms>ms; ` in front.
pub fn held_debug(waited_ms: u64, debug: &str) -> String {
    format!("held={waited_ms}ms; {debug}")
}

/// Step 1's first half, from the configuration alone: parse the body, resolve the model, hash
/// the prompt. A clone can read requests apart from the engine: the dynamic module, whose one
/// engine serves every worker behind a lock, reads outside it and locks only for the rest.
#[derive(Clone)]
pub struct Reader {
    pub routes: RoutingTable,
    prefix: PrefixConfig,
    /// Per pool, its scoring (a split and a pool's failover pass over a pool that cannot serve,
    /// by its `stale_after_ms`; `overflow` by its thresholds).
    scoring: Vec<ScoringConfig>,
}

/// A request read by [`Reader::read`], not yet looked up in the prefix index: only
/// [`Engine::prepare_read`] makes a [`Prepared`] of it.
#[derive(Debug)]
pub struct Read(Prepared);

/// Per-worker routing state.
pub struct Engine {
    pub config: FilterConfig,
    reader: Reader,
    /// One per pool (its scoring: the top-level one with the pool's changes).
    pickers: Vec<Picker>,
    prefix: PrefixIndex,
    /// Where each learned stored response lives ([`crate::responses`]).
    responses: ResponseTable,
    /// `None` when one engine serves every worker (the dynamic module): nobody reads it.
    sync: Option<SyncLog>,
    /// Moving average of prompt tokens per request (the unit of queued work).
    avg_prompt_tokens: f64,
    /// Per pool (configuration order): moving share of requests whose prompt was found, in
    /// part, on a pod (or whose conversation was): how much a new prompt's rendezvous home is
    /// worth there ([`home_fade`]).
    prompt_reuse: Vec<f64>,
    /// Scratch for [`Engine::commit`].
    recorded: Vec<u64>,
    /// Adapter homes per pool (configuration order), with what they were computed from.
    adapter_homes: Vec<AdapterHomes>,
    /// The pods' answers: which are out of the picks for their server errors.
    pub outliers: Outliers,
}

/// Weight of the newest request in the prompt-size moving average: ~64 requests of memory,
/// long enough to be stable, short enough to follow a change of workload within seconds.
const AVG_ALPHA: f64 = 1.0 / 64.0;

/// How much of a new prompt's home bonus is withheld when a share `reuse` of the pool's recent
/// requests had their prompt found on a pod: none at `full` (`scoring.prefix_home_reuse`) and
/// above, or when `full` is 0; all of it when none was. The home exists so that a prompt's next
/// request finds the pod that has it; where prompts are not reused it only moves requests off the
/// pod the load picks (the offline replay over eight workloads: mixed-gpu's mean TTFT 6-7% lower
/// with it faded, the other scenarios unchanged; bench/README.md, "Offline replay").
pub fn home_fade(reuse: f64, full: f64) -> f64 {
    if full > 0.0 {
        (1.0 - reuse / full).clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// How a body is written: what a split keys on without a client key, and how an alias is
/// rewritten.
#[derive(Clone, Copy)]
enum Format<'a> {
    /// JSON, read past this many bytes at the start of the body the host holds (a UTF-8
    /// byte-order mark, which the rewritten body leaves out).
    Json(usize),
    /// `multipart/form-data` with this boundary.
    Form(&'a str),
}

impl Format<'_> {
    /// The rewrite of `body` whose `model` value (at `span`) becomes `model`, written as this
    /// format writes a value (a JSON string quoted, a form field as it is).
    fn rewrite_model(self, body: &[u8], span: std::ops::Range<usize>, model: &str) -> BodyRewrite {
        let before = body.get(..span.start).unwrap_or_default();
        let mut with = Vec::with_capacity(before.len() + model.len() + 2);
        with.extend_from_slice(before);
        match self {
            Format::Json(_) => json_string(&mut with, model),
            Format::Form(_) => with.extend_from_slice(model.as_bytes()),
        }
        let skipped = match self {
            Format::Json(n) => n,
            Format::Form(_) => 0,
        };
        BodyRewrite {
            replaced: skipped + span.end,
            with,
        }
    }
}

impl Reader {
    /// Whether pool `i` has a healthy pod with fresh metrics in the snapshot `fleet`, and with
    /// `room`, one of those that is not saturated ([`has_room_by_snapshot`]). None: no
    /// snapshot, or the snapshot does not list the pool.
    fn serving(
        &self,
        fleet: Option<&FleetState>,
        now_ms: u64,
        i: usize,
        room: bool,
    ) -> Option<bool> {
        let fleet = fleet?;
        let scoring = self.scoring.get(i)?;
        let pool = fleet.pool(self.routes.pool_name(i))?;
        let age = fleet.age_ms(now_ms);
        Some(match room {
            false => pool.serving(age, scoring.stale_after_ms),
            true => has_room_by_snapshot(pool, age, scoring),
        })
    }

    /// Where a request goes when the pick finds every pod of its pool saturated: with
    /// `overflow` on the pool it was for, the first of that pool's failover pools after the one
    /// it is in (if it moved already) that the snapshot shows with room
    /// ([`has_room_by_snapshot`]). Each move goes further down the list, so a request moves at
    /// most once per failover pool.
    fn overflow_target(
        &self,
        fleet: Option<&FleetState>,
        now_ms: u64,
        prep: &Prepared,
    ) -> Option<usize> {
        let (origin, now_in) = match &prep.failed_over {
            None => (prep.target.pool, None),
            Some(f) => (f.origin, Some(prep.target.pool)),
        };
        if !self.routes.overflows(origin) {
            return None;
        }
        let list = self.routes.failover(origin);
        let rest = match now_in {
            None => list,
            Some(i) => list
                .iter()
                .position(|&j| j == i)
                .and_then(|k| list.get(k + 1..))
                .unwrap_or_default(),
        };
        let room = |j: usize| self.serving(fleet, now_ms, j, true) == Some(true);
        rest.iter().copied().find(|&j| room(j))
    }

    /// Parses the body, resolves the model to its target and hashes the prompt. Errors are the
    /// API's answers to send.
    pub fn read(&self, path: &str, body: &[u8], ctx: RequestContext<'_>) -> Result<Read, ApiError> {
        // A UTF-8 byte-order mark before the JSON, as some Windows tools write files: vLLM and
        // SGLang accept it (Python's json.loads on bytes does), so the gateway does too. A
        // rewritten body leaves it out.
        let (skipped, body) = match body.strip_prefix(UTF8_BOM) {
            Some(rest) => (UTF8_BOM.len(), rest),
            None => (0, body),
        };
        let p = &self.prefix;
        let limit = p.block_chars.saturating_mul(p.max_blocks);
        let home_chars = p.block_chars.saturating_mul(p.home_blocks);
        let endpoint = Endpoint::from_path(path);
        let req = request::parse(body, endpoint, limit, home_chars)?;
        self.resolve(req, body, endpoint, Format::Json(skipped), ctx)
    }

    /// [`Reader::read`] for a `multipart/form-data` body with `boundary` (the audio endpoints;
    /// [`form`]). `complete`: the body is whole. `Ok(None)`: the fields routing needs have not
    /// arrived yet; with `complete`, never.
    pub fn read_form(
        &self,
        path: &str,
        body: &[u8],
        boundary: &str,
        complete: bool,
        ctx: RequestContext<'_>,
    ) -> Result<Option<Read>, ApiError> {
        match form::scan(body, boundary, complete)? {
            form::Scan::More => Ok(None),
            form::Scan::Ready(req) => {
                let endpoint = Endpoint::from_path(path);
                self.resolve(req, body, endpoint, Format::Form(boundary), ctx)
                    .map(Some)
            }
        }
    }

    /// Resolves a read request's model to its target and hashes its prompt. Inlined: the JSON
    /// path is the hot one, and a call here moved the request and the result through memory.
    #[inline(always)]
    fn resolve(
        &self,
        req: InferenceRequest<'_>,
        body: &[u8],
        endpoint: Endpoint,
        format: Format<'_>,
        ctx: RequestContext<'_>,
    ) -> Result<Read, ApiError> {
        let RequestContext {
            fleet,
            now_ms,
            split_key,
            split_target,
        } = ctx;
        let p = &self.prefix;
        let model_only = matches!(endpoint, Endpoint::CountTokens | Endpoint::Tokenize);
        let (mut target, split) = match self.routes.resolve(req.model.as_deref())? {
            Resolved::Target(t) => (t.clone(), None),
            Resolved::Split(s) => {
                // The client's split key when it sent one; else the conversation's identity
                // when there is one (every turn repeats it), else the prompt text the filter
                // read: the same target on every worker and replica.
                let text = req.prompt.as_bytes();
                let text = match (split_key, format) {
                    (Some(k), _) => k.as_bytes(),
                    // A form has no prompt: its boundary, which clients draw at random for each
                    // request, spreads uploads over the targets by their weights.
                    (None, Format::Form(boundary)) => boundary.as_bytes(),
                    (None, Format::Json(_)) => req.conversation_key_text().unwrap_or(text),
                };
                // A target whose pool the snapshot shows unable to serve is passed over; with
                // no snapshot, or a pool it does not list, nothing is known against it.
                let serving =
                    |t: &Target| self.serving(fleet, now_ms, t.pool, false).unwrap_or(true);
                let chosen = match split_target.and_then(|j| Some((j, s.target(j)?))) {
                    Some((j, t)) => Some((j, t, false)),
                    None => s.pick_serving(s.key(text), serving),
                };
                let Some((target, t, rerouted)) = chosen else {
                    return Err(ApiError::model_not_found(&s.name));
                };
                let taken = SplitTaken {
                    split: s.clone(),
                    target,
                    rerouted,
                    response: split_target.is_some(),
                };
                (t.clone(), Some(taken))
            }
        };
        // A pool the snapshot shows unable to serve hands the request to the first of its
        // failover pools that the snapshot shows able to. Nothing known either way (no snapshot,
        // a pool it does not list): the request stays. (`overflow`, a pool whose pods are all
        // saturated, is the picker's to find: [`Engine::decide`].)
        let mut failed_over = None;
        let failover = self.routes.failover(target.pool);
        if !failover.is_empty() && self.serving(fleet, now_ms, target.pool, false) == Some(false) {
            let takes = |j: usize| self.serving(fleet, now_ms, j, false) == Some(true);
            if let Some(&j) = failover.iter().find(|&&j| takes(j)) {
                failed_over = Some(FailedOver {
                    from: self.routes.pool_name_shared(target.pool),
                    origin: target.pool,
                    overflow: false,
                });
                target = target.in_pool(j);
            }
        }
        let rewrite = match (&req.model_span, target.rewrite) {
            (Some(span), true) => Some(format.rewrite_model(body, span.clone(), &target.model)),
            _ => None,
        };
        // Adapters have their own KV (engines key cached blocks by adapter too).
        let seed = prefix::model_seed(&target.model);
        // A request that no pod is picked for (`model_only`) needs no prompt hashes.
        let mut anchors = Vec::new();
        let blocks = if model_only {
            0
        } else {
            prefix::prompt_anchors(
                req.prompt.as_bytes(),
                seed,
                p.block_chars,
                p.max_blocks,
                &mut anchors,
            )
        };
        // A conversation's identity: stable across its turns, distinct between conversations
        // that only share a system prompt (however long).
        let conversation = req
            .conversation_key_text()
            .filter(|_| !model_only)
            .map(|k| prefix::conversation_key(k, seed));
        // And where it stands: what this turn leaves on its pod, and what the previous turn did.
        let (history, turn) = match conversation {
            Some(c) => {
                let (h, t) = prefix::turn_keys(req.prompt.as_bytes(), req.history_len(), c);
                (h, Some(t))
            }
            None => (None, None),
        };
        // A cut past the key only: a cut within it (a system prompt past the limit) is the same
        // for every conversation with that system prompt.
        let turn_cut = req.prompt_cut(p.block_chars.saturating_mul(p.max_blocks));
        let home_key = conversation.or_else(|| prefix::home_key(&anchors, p.home_blocks));
        // Where this adapter went lately: the same index, under a key no prompt hash can take
        // by accident (its own seed domain).
        let adapter_anchor = target
            .adapter
            .as_deref()
            .map(|a| prefix::conversation_key(a.as_bytes(), ADAPTER_DOMAIN));
        let response_key = req.previous_response.as_deref().map(response_key);
        Ok(Read(Prepared {
            learns_response: endpoint == Endpoint::Responses,
            response_key,
            response_pod: None,
            pool: self.routes.pool_name_shared(target.pool),
            stream: req.stream,
            prompt_tokens: req.estimated_prompt_tokens(),
            sequences: req.sequences,
            model_only,
            rewrite,
            split,
            failed_over,
            prefix_blocks: blocks as u32,
            home_key,
            conversation,
            turn,
            history,
            turn_cut,
            conversation_pods: Vec::new(),
            adapter_anchor,
            adapter_recent: None,
            matches: Vec::new(),
            anchors,
            target,
        }))
    }
}

/// One pool's adapter homes ([`crate::adapters::partition`]) and what they were computed from.
///
/// Keyed by the partition's inputs, not by snapshot version: snapshots come every ~100 ms and
/// almost never change a pod's key, slots or speed class, and the partition of 5,000 adapters
/// over 64 pods took ~21 ms natively (28 ms for the first request after each snapshot in the
/// .wasm, against 1.7 ms for the next; an audit).
struct AdapterHomes {
    /// The pool's configured adapters' keys ([`adapter_key`]), once.
    adapters: Vec<u64>,
    /// The snapshot version last checked: the same version, the same inputs.
    version: Option<u64>,
    /// [`AdapterHomes::inputs`] of the pods `homes` was computed over.
    inputs: u64,
    homes: HashMap<u64, u64>,
}

impl AdapterHomes {
    fn new(adapters: &[String]) -> AdapterHomes {
        AdapterHomes {
            adapters: adapters.iter().map(|a| adapter_key(a)).collect(),
            version: None,
            inputs: 0,
            homes: HashMap::new(),
        }
    }

    /// What the partition reads of the pool's pods: each healthy pod's key, adapter slots and
    /// speed class, in the snapshot's order (another order only costs a recomputation).
    fn inputs(pool: &PoolState) -> u64 {
        pool.pods
            .iter()
            .filter(|p| p.snap.healthy)
            .fold(0x6164_6170_7465_7273, |h, p| {
                let slots = p.snap.lora.as_ref().map_or(0, |l| l.max_loras);
                let h = mix64(h ^ p.key);
                let h = mix64(h ^ u64::from(slots));
                mix64(h ^ p.speed.to_bits())
            })
    }

    /// Brings `homes` up to the pool of snapshot `version`.
    fn refresh(&mut self, version: u64, pool: &PoolState) {
        if self.adapters.is_empty() || self.version == Some(version) {
            return;
        }
        let inputs = AdapterHomes::inputs(pool);
        if self.version.is_none() || inputs != self.inputs {
            let pods: Vec<SlotPod> = pool
                .pods
                .iter()
                .filter(|p| p.snap.healthy)
                .map(|p| SlotPod {
                    key: p.key,
                    weight: p.speed,
                    slots: p.snap.lora.as_ref().map_or(0, |l| l.max_loras),
                })
                .collect();
            self.homes = partition(&self.adapters, &pods);
            self.inputs = inputs;
        }
        self.version = Some(version);
    }
}

impl Engine {
    pub fn new(config: FilterConfig) -> Engine {
        let routes = RoutingTable::new(&config);
        let pickers: Vec<Picker> = (0..config.pools.len())
            .map(|i| Picker::new(config.pool_scoring(i), config.fallback_endpoints))
            .collect();
        let prefix = PrefixIndex::new(config.prefix.index_entries);
        let responses = ResponseTable::new(config.response_entries);
        let reader = Reader {
            routes,
            prefix: config.prefix.clone(),
            scoring: pickers.iter().map(|p| p.scoring.clone()).collect(),
        };
        Engine {
            reader,
            pickers,
            prefix,
            responses,
            sync: Some(SyncLog::new(SYNC_RING)),
            avg_prompt_tokens: 0.0,
            // Until requests say otherwise, prompts are taken as reused (the whole home bonus).
            prompt_reuse: vec![1.0; config.pools.len()],
            recorded: Vec::new(),
            adapter_homes: config
                .pools
                .iter()
                .map(|p| AdapterHomes::new(&p.adapters))
                .collect(),
            outliers: Outliers::new(config.outlier_detection.clone()),
            config,
        }
    }

    /// Step 1: parse, resolve, hash. Errors are the OpenAI-style answers to send. Without the
    /// context, a split's targets all count as serving and no split key was sent
    /// ([`Engine::prepare_in`]).
    pub fn prepare(&mut self, path: &str, body: &[u8]) -> Result<Prepared, ApiError> {
        self.prepare_in(path, body, RequestContext::default())
    }

    /// [`Engine::prepare`] with what the shell knows besides the body ([`RequestContext`]).
    pub fn prepare_in(
        &mut self,
        path: &str,
        body: &[u8],
        ctx: RequestContext<'_>,
    ) -> Result<Prepared, ApiError> {
        // Taken apart and looked up in place: moving the request through `prepare_read`'s
        // argument and result cost two copies of it in the proxy-wasm build (each a
        // `memory.copy`, a call out of V8's code).
        let Read(mut prep) = self.reader.read(path, body, ctx)?;
        self.look_up(&mut prep);
        Ok(prep)
    }

    /// [`Engine::prepare_in`] for a `multipart/form-data` body ([`Reader::read_form`]):
    /// `Ok(None)` until the fields routing needs have arrived. Out of line: rare, and kept out
    /// of the JSON path's code.
    #[cold]
    #[inline(never)]
    pub fn prepare_form(
        &mut self,
        path: &str,
        body: &[u8],
        boundary: &str,
        complete: bool,
        ctx: RequestContext<'_>,
    ) -> Result<Option<Prepared>, ApiError> {
        let read = self.reader.read_form(path, body, boundary, complete, ctx)?;
        Ok(read.map(|r| self.prepare_read(r)))
    }

    /// The engine's half of step 1 for a request [`Reader::read`] read: look it up in the
    /// learned prefix index, and count its prompt in the typical prompt size.
    pub fn prepare_read(&mut self, read: Read) -> Prepared {
        let Read(mut prep) = read;
        self.look_up(&mut prep);
        prep
    }

    /// [`Engine::prepare_read`]'s work on the request read: [`Engine::find`], and the request
    /// counted in the typical prompt size and its pool's share of reused prompts.
    fn look_up(&mut self, prep: &mut Prepared) {
        // The typical prefill the pods see: a token count is no prefill (a client counting a
        // long document before sending it would otherwise make every real prompt look short).
        // Nor is a request without prompt text (an audio form).
        if !prep.model_only && prep.prompt_tokens > 0 {
            let tokens = f64::from(prep.prompt_tokens);
            self.avg_prompt_tokens = if self.avg_prompt_tokens == 0.0 {
                tokens
            } else {
                self.avg_prompt_tokens + AVG_ALPHA * (tokens - self.avg_prompt_tokens)
            };
        }
        self.find(prep);
        // Requests with a prompt to match count towards their pool's share of reused prompts.
        if let Some(r) = self.prompt_reuse.get_mut(prep.target.pool) {
            if !prep.model_only && prep.prefix_blocks > 0 {
                let found = !prep.matches.is_empty() || !prep.conversation_pods.is_empty();
                *r += AVG_ALPHA * (f64::from(u8::from(found)) - *r);
            }
        }
    }

    /// Where the request's prompt, conversation, adapter and stored response were sent before.
    fn find(&mut self, prep: &mut Prepared) {
        self.prefix.lookup(&prep.anchors, &mut prep.matches);
        prep.conversation_pods = self.conversation_pods(prep);
        prep.adapter_recent = prep
            .adapter_anchor
            .and_then(|k| self.prefix.latest_pod_of(k));
        self.look_up_response(prep);
    }

    /// The pods credited as holding a conversation ([`Prepared::conversation_pods`]). Those
    /// that served its previous turn are the evidence: conversations that open alike (a common
    /// greeting, a fixed task template) share the conversation key, and the pods recorded under
    /// it (at most four) may be theirs, not this one's. When the prompt reached the limit, a
    /// previous turn that did too left the same text; one that did not ended at the last
    /// assistant message. Without either on record (the first turn, a record lost or not yet
    /// exchanged, an older gateway's record), the pods recorded under the conversation key.
    fn conversation_pods(&self, prep: &Prepared) -> Vec<u64> {
        if prep.conversation.is_none() {
            return Vec::new();
        }
        let cut = prep.turn.filter(|_| prep.turn_cut);
        for key in [cut, prep.history, prep.conversation].into_iter().flatten() {
            let pods = self.prefix.pods_of(key);
            if !pods.is_empty() {
                return pods;
            }
        }
        Vec::new()
    }

    /// Looks up the pod holding the stored response a turn continues (done by
    /// [`Engine::prepare_read`]; again after reading other workers' records). A response found
    /// is kept with the newest: its conversation is in use.
    pub fn look_up_response(&mut self, prep: &mut Prepared) {
        prep.response_pod = prep
            .response_key
            .and_then(|k| self.responses.get_and_keep(k));
    }

    /// A turn that continues a stored response (`previous_response_id`), sent to a split, goes
    /// to the split's target whose pool holds the response's pod, whatever its own key names:
    /// the request is read again with that target when it took another. A split keys a
    /// conversation by its first user message, which such a turn does not repeat (the pod
    /// holds the history), so its key is its new input's, and the target that names may have
    /// no pod holding the response: vLLM answers 404 there. Only such turns are read twice,
    /// and only when their own key named another target. A target of weight 0 is followed too:
    /// the response is nowhere else. The shells call it for the turns
    /// [`Prepared::may_follow_response`] names, so that the plain path makes no call.
    #[cold]
    #[inline(never)]
    pub fn follow_response(
        &mut self,
        prep: &mut Prepared,
        path: &str,
        body: &[u8],
        ctx: RequestContext<'_>,
    ) -> Result<(), ApiError> {
        let Some(j) = self.response_target(prep, ctx.fleet) else {
            return Ok(());
        };
        let ctx = RequestContext {
            split_target: Some(j),
            ..ctx
        };
        let Read(mut again) = self.reader.read(path, body, ctx)?;
        // Counted once: the first read already sampled its prompt in the typical size and the
        // share of reused prompts.
        self.find(&mut again);
        *prep = again;
        Ok(())
    }

    /// The split target to read a turn again with ([`Engine::follow_response`]): the first
    /// whose pool the snapshot shows holding the turn's stored response on a healthy pod, when
    /// the target taken does not.
    fn response_target(&self, prep: &Prepared, fleet: Option<&FleetState>) -> Option<usize> {
        let (taken, pod, fleet) = (prep.split.as_ref()?, prep.response_pod?, fleet?);
        let holds = |t: &Target| {
            fleet
                .pool(self.reader.routes.pool_name(t.pool))
                .and_then(|p| p.healthy_pod(pod))
                .is_some()
        };
        if taken.response || holds(&prep.target) {
            return None;
        }
        taken.split.targets().position(|(t, _)| holds(t))
    }

    /// What reads requests for this engine; a clone reads them apart from it.
    pub fn reader(&self) -> &Reader {
        &self.reader
    }

    /// The model table: `/v1/models`' answers.
    pub fn routes(&self) -> &RoutingTable {
        &self.reader.routes
    }

    /// Brings a held request that moved to a failover pool (it overflowed, or its pool had no
    /// pod) back to the pool it was for, once the snapshot shows that pool with room again
    /// ([`has_room_by_snapshot`]), before it is decided again: held where it moved to, it would
    /// otherwise wait there (and go to a saturated pod when its wait ran out) while its own
    /// pool had room and later requests went there. Whether it moved.
    pub fn homeward(&self, fleet: Option<&FleetState>, now_ms: u64, prep: &mut Prepared) -> bool {
        let Some(origin) = prep.failed_over.as_ref().map(|f| f.origin) else {
            return false;
        };
        if self.reader.serving(fleet, now_ms, origin, true) != Some(true) {
            return false;
        }
        prep.failed_over = None;
        prep.pool = self.reader.routes.pool_name_shared(origin);
        prep.target = prep.target.in_pool(origin);
        true
    }

    /// Moves a request that [`Engine::decide`] found its pool saturated for to the pool `to`
    /// ([`Decision::Overflow`]): the shell then decides again, with that pool's in-flight table.
    /// Step 1's work stands (the same model, body and prompt hashes; the prefix index knows pods,
    /// not pools). A request that moved already keeps the pool it was for.
    pub fn overflow(&self, prep: &mut Prepared, to: usize) {
        let (from, origin) = match prep.failed_over.take() {
            Some(f) => (f.from, f.origin),
            None => (Arc::clone(&prep.pool), prep.target.pool),
        };
        prep.failed_over = Some(FailedOver {
            from,
            origin,
            overflow: true,
        });
        prep.pool = self.reader.routes.pool_name_shared(to);
        prep.target = prep.target.in_pool(to);
    }

    /// Step 2: pick pods of the request's pool. `fleet` is the worker's decoded snapshot (None
    /// before the first one), `loads` the shared in-flight table aligned with the pool.
    pub fn decide(
        &mut self,
        prep: &Prepared,
        fleet: Option<&FleetState>,
        loads: &[PodLoad],
        opts: DecideOptions,
        rng: &mut SplitMix64,
    ) -> Choice {
        let DecideOptions {
            now_ms,
            sheddable,
            holdable,
            affinity_hold,
            debug,
        } = opts;
        let none = |d: Decision| Choice {
            decision: d,
            destination: None,
            picked_key: None,
            picked_index: None,
            prefill_tokens: prep.prompt_tokens,
            debug: None,
            pinned_response: false,
        };
        if !self.config.pick_endpoints {
            return none(Decision::FailOpen(FailOpen::Disabled));
        }
        if prep.model_only {
            return none(Decision::FailOpen(FailOpen::ModelOnly));
        }
        let Some(fleet) = fleet else {
            return none(Decision::FailOpen(FailOpen::NoSnapshot));
        };
        let Some(pool) = fleet.pool(&prep.pool) else {
            return none(Decision::FailOpen(FailOpen::UnknownPool));
        };
        let adapter_home = match &prep.target.adapter {
            Some(a) => self.adapter_home(fleet.version, prep.target.pool, pool, adapter_key(a)),
            None => None,
        };
        let Some(picker) = self.pickers.get(prep.target.pool) else {
            return none(Decision::FailOpen(FailOpen::UnknownPool));
        };
        self.outliers.refresh(now_ms);
        // A turn continuing a stored response that a pod of this pool holds: that pod, alone
        // able to answer it (vLLM answers 404 elsewhere).
        let response_at = prep.response_pod.and_then(|k| pool.healthy_pod(k));
        let features = RequestFeatures {
            adapter: prep.target.adapter.as_deref().map(adapter_key),
            prompt_tokens: prep.prompt_tokens,
            avg_prompt_tokens: self.avg_prompt_tokens,
            prefix_blocks: prep.prefix_blocks,
            block_tokens: self.config.prefix.block_tokens(),
            home_key: prep.home_key,
            // An adapter request's home is its adapter's ([`Picker::pick`]), worth the same
            // whether prompts are reused or not.
            home_fade: match (
                &prep.target.adapter,
                self.prompt_reuse.get(prep.target.pool),
            ) {
                (None, Some(&reuse)) => home_fade(reuse, picker.scoring.prefix_home_reuse),
                _ => 0.0,
            },
            matches: &prep.matches,
            conversation_pods: prep.conversation.map(|_| prep.conversation_pods.as_slice()),
            adapter_recent: prep.adapter_recent,
            adapter_home,
            sheddable,
            holdable,
            affinity_hold,
            // Not such a turn: no other pool's pod has its response.
            overflow_to: match response_at {
                Some(_) => None,
                None => self.reader.overflow_target(Some(fleet), now_ms, prep),
            },
            ejected: self.outliers.ejected(),
        };
        let mut explain = Explain::default();
        let decision = picker.pick(
            pool,
            loads,
            &features,
            fleet.age_ms(now_ms),
            rng,
            debug.then_some(&mut explain),
        );
        // Nor when the pool has no pod with fresh metrics (the aggregator down, its snapshot
        // past stale_after_ms): failing open, Envoy's balancer would send the turn to any pod,
        // and every other one answers 404. The snapshot's address is the pod's last known.
        let decision = match (decision, response_at) {
            (Decision::FailOpen(FailOpen::NoFreshPod), Some(i)) => Decision::Picked(vec![i]),
            (d, _) => d,
        };
        let mut choice = none(decision);
        // A turn that continues a stored response goes to the pod that holds it: no other can
        // answer it.
        let pinned = match (&mut choice.decision, response_at) {
            (Decision::Picked(ranked), Some(i)) => {
                // First, the others after it as fallbacks, as many in all as before.
                let n = ranked.len();
                ranked.retain(|r| *r != i);
                ranked.insert(0, i);
                ranked.truncate(n);
                true
            }
            _ => false,
        };
        choice.pinned_response = pinned;
        if let Decision::Picked(ranked) = &choice.decision {
            choice.destination = Some(destination(pool, ranked));
            choice.picked_index = ranked.first().copied();
            choice.picked_key = ranked
                .first()
                .and_then(|i| pool.pods.get(*i))
                .map(|p| p.key);
            if let Some(k) = choice.picked_key {
                let depth = features.depth_on(k);
                choice.prefill_tokens =
                    uncached_tokens(prep.prompt_tokens, depth, self.config.prefix.block_tokens());
            }
        }
        if debug {
            let mut d = format_breakdown(pool, choice.picked_index, &explain);
            if pinned {
                d = format!("previous-response; {d}");
            }
            if let Some(f) = &prep.failed_over {
                let why = if f.overflow { "overflow" } else { "failover" };
                d = format!("{why}={}->{}; {d}", f.from, prep.pool);
            }
            if let Some(taken) = &prep.split {
                let (split, target) = taken.names();
                let why = match (taken.rerouted, taken.response) {
                    (true, _) => " (rerouted)",
                    (_, true) => " (response)",
                    _ => "",
                };
                d = format!("split={split}->{target}{why}; {d}");
            }
            choice.debug = Some(d);
        }
        choice
    }

    /// The home pod of an adapter: the pool's configured adapters partitioned over its healthy
    /// pods, recomputed only when what the partition reads changes ([`AdapterHomes`]).
    fn adapter_home(
        &mut self,
        version: u64,
        pool_idx: usize,
        pool: &PoolState,
        adapter: u64,
    ) -> Option<u64> {
        let homes = self.adapter_homes.get_mut(pool_idx)?;
        homes.refresh(version, pool);
        homes.homes.get(&adapter).copied()
    }

    /// An answer from `pod_key` to a request routed to `pool`, by its `:status`: a server error
    /// counts toward ejecting the pod, any other answer ends its run ([`crate::outlier`]).
    /// Returns the ejection it caused.
    pub fn answered(
        &mut self,
        pool: &str,
        pod_key: u64,
        status: Option<&[u8]>,
        fleet: Option<&FleetState>,
        now_ms: u64,
    ) -> Option<Ejection> {
        if !status.is_some_and(outlier::is_server_error) {
            self.outliers.success(pod_key, now_ms);
            return None;
        }
        let pods = fleet.and_then(|f| f.pool(pool)).map_or(0, |p| p.pods.len());
        self.outliers
            .server_error(pod_key, outlier::pool_key(pool), pods, now_ms)
    }

    /// A request judged [`Verdict::Lost`](crate::outlier::Verdict::Lost): its pod took it and
    /// does not serve it, which counts in the pod's run as a server error does. Returns the
    /// ejection it caused.
    pub fn unanswered(
        &mut self,
        request: &outlier::Unanswered,
        fleet: Option<&FleetState>,
        now_ms: u64,
    ) -> Option<Ejection> {
        let pods = fleet
            .and_then(|f| f.pool(&request.pool))
            .map_or(0, |p| p.pods.len());
        self.outliers
            .server_error(request.pod, outlier::pool_key(&request.pool), pods, now_ms)
    }

    /// Step 3: remember that the prompt went to `pod_key`, locally and for the other workers.
    pub fn commit(&mut self, prep: &Prepared, pod_key: u64) {
        if prep.anchors.is_empty() && prep.conversation.is_none() && prep.adapter_anchor.is_none() {
            return;
        }
        // A buffer kept between requests: no allocation per commit.
        let mut hashes = std::mem::take(&mut self.recorded);
        prep.anchor_hashes(&mut hashes);
        self.prefix.record(&hashes, pod_key);
        if let Some(sync) = &mut self.sync {
            sync.push(pod_key, &hashes);
        }
        self.recorded = hashes;
    }

    /// A Responses API answer from `pod_key` carries the id `id` (the first chunk of its body,
    /// [`crate::request::response_id`]): a later turn naming it as its `previous_response_id`
    /// goes to that pod. Recorded like a routing decision, so the other workers and gateway
    /// replicas learn it too.
    pub fn learn_response(&mut self, id: &str, pod_key: u64) {
        let key = response_key(id);
        self.responses.insert(key, pod_key);
        if let Some(sync) = &mut self.sync {
            sync.push(pod_key, &[key]);
        }
    }

    /// A stored response's pod another worker of this Envoy learned (its shared slot): in this
    /// engine's table of stored responses, not sent on (that worker's records carry it to the
    /// others).
    pub fn note_response(&mut self, key: u64, pod_key: u64) {
        self.responses.insert(key, pod_key);
    }

    /// Where a stored response's own calls go (`GET`/`DELETE /v1/responses/{id}`, its `cancel`):
    /// the pool and address of the pod whose answer carried `id`, when this engine learned it
    /// and the snapshot shows that pod healthy. These calls carry no model: the pod is their
    /// only route.
    pub fn stored_response_pod<'f>(
        &self,
        id: &str,
        fleet: &'f FleetState,
    ) -> Option<(&'f str, &'f str)> {
        let pod = self.responses.get(response_key(id))?;
        fleet.pools.iter().find_map(|pool| {
            let p = &pool.pods[pool.healthy_pod(pod)?];
            Some((pool.name.as_str(), p.snap.address.as_str()))
        })
    }

    /// The newest sequence of this worker's outgoing sync ring (0 without one): what a reader
    /// compares to decide whether to read the ring.
    pub fn sync_seq(&self) -> u64 {
        self.sync.as_ref().map_or(0, SyncLog::last_seq)
    }

    /// This worker's outgoing sync records newer than `after`, encoded for shared data (empty
    /// without a sync log). Encode them when [`Engine::sync_seq`] moved: a full ring is ~50 KB.
    pub fn sync_payload(&self, after: u64) -> Vec<u8> {
        self.sync
            .as_ref()
            .map(|s| s.encode_after(after))
            .unwrap_or_default()
    }

    /// Numbers the outgoing sync records after `base` (see `SyncLog::start_after`).
    pub fn sync_start_after(&mut self, base: u64) {
        if let Some(sync) = &mut self.sync {
            sync.start_after(base);
        }
    }

    /// For an engine shared by every worker (behind a lock): no outgoing sync log is kept.
    pub fn without_sync_log(mut self) -> Engine {
        self.sync = None;
        self
    }

    /// Starts keeping an outgoing sync log if there is none (an engine shared by every worker
    /// keeps one only for the exchange between gateway replicas, once it is asked for).
    pub fn enable_sync_log(&mut self) {
        if self.sync.is_none() {
            self.sync = Some(SyncLog::new(SYNC_RING));
        }
    }

    /// The outgoing sync log, if kept.
    pub fn sync_log(&self) -> Option<&SyncLog> {
        self.sync.as_ref()
    }

    /// Applies another worker's (or gateway replica's) records: its routing decisions to the
    /// local prefix index, the responses it learned ([`Engine::learn_response`]: one key, a
    /// response's) to the table of stored responses.
    pub fn apply_sync(&mut self, records: &[SyncRecord]) {
        for r in records {
            match r.anchors[..] {
                [key] if is_response_key(key) => self.responses.insert(key, r.pod),
                _ => self.prefix.record(&r.anchors, r.pod),
            }
        }
    }

    /// Entries in the learned prefix index.
    pub fn prefix_entries(&self) -> usize {
        self.prefix.len()
    }

    /// Stored responses whose pod this engine knows.
    pub fn response_entries(&self) -> usize {
        self.responses.len()
    }

    /// Picks uniformly among a pool's healthy pods, ignoring freshness: the ORIGINAL_DST data
    /// plane's fail-open, which has no load balancer of its own to fall back on.
    pub fn any_pod(pool: &PoolState, rng: &mut SplitMix64) -> Option<String> {
        let healthy: Vec<&str> = pool
            .pods
            .iter()
            .filter(|p| p.snap.healthy)
            .map(|p| p.snap.address.as_str())
            .collect();
        let list = if healthy.is_empty() {
            pool.pods.iter().map(|p| p.snap.address.as_str()).collect()
        } else {
            healthy
        };
        if list.is_empty() {
            return None;
        }
        let i = (rng.next_u64() % list.len() as u64) as usize;
        list.get(i).map(|s| s.to_string())
    }
}

/// `ip:port[,ip:port...]` for the ranked pods.
fn destination(pool: &PoolState, ranked: &[usize]) -> String {
    let addresses = || ranked.iter().filter_map(|i| pool.pods.get(*i));
    // One allocation, and the addresses copied by `append` (no `memory.copy` on wasm32).
    let mut s = String::with_capacity(addresses().map(|p| p.snap.address.len() + 1).sum());
    for p in addresses() {
        if !s.is_empty() {
            s.push(',');
        }
        crate::bytes::append(&mut s, &p.snap.address);
    }
    s
}

const UTF8_BOM: &[u8] = b"\xEF\xBB\xBF";

/// The `content-length` to give a request whose buffered body of `old` bytes was rewritten to
/// `new`: the new body's when it is `complete`; else (a form routed before its upload ended) the
/// declared length changed by the difference, and none when there is no declared length (the
/// body goes on chunked).
pub fn rewritten_length(
    complete: bool,
    declared: Option<usize>,
    old: usize,
    new: usize,
) -> Option<usize> {
    if complete {
        return Some(new);
    }
    declared?.checked_sub(old)?.checked_add(new)
}

/// `s` as a JSON string, quotes included, appended to `out`.
fn json_string(out: &mut Vec<u8>, s: &str) {
    match serde_json::to_writer(&mut *out, s) {
        Ok(()) => {}
        Err(_) => out.extend_from_slice(b"\"\""),
    }
}

/// How a request's body changes on its way to the pod: an alias or a split's target in place
/// of the `model` the client sent. The body's first `replaced` bytes (up to the end of the
/// `model` value) give way to `with` (the bytes before the value, then the new one), and the
/// rest stays. A shell hands the host only that where it can (Envoy's proxy-wasm body write
/// drains a body's first bytes and puts others before the rest): a body whose `model` comes
/// first changes by a few dozen bytes instead of being copied whole; where `model` comes last
/// (OpenAI's Python SDK writes `messages` first), `with` is nearly all of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BodyRewrite {
    /// Bytes from the body's start that the rewrite replaces.
    pub replaced: usize,
    /// What replaces them.
    pub with: Vec<u8>,
}

impl BodyRewrite {
    /// The whole new body of `body`.
    pub fn apply(&self, body: &[u8]) -> Vec<u8> {
        let rest = body.get(self.replaced..).unwrap_or_default();
        let mut out = Vec::with_capacity(self.with.len() + rest.len());
        out.extend_from_slice(&self.with);
        out.extend_from_slice(rest);
        out
    }

    /// The body's length after the rewrite, for `len` bytes before it.
    pub fn new_len(&self, len: usize) -> usize {
        len.saturating_sub(self.replaced)
            .saturating_add(self.with.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadTable;
    use crate::snapshot::{PodSnapshot, PoolSnapshot, Snapshot, SNAPSHOT_SCHEMA};

    const CFG: &str = r#"{"pools":[{"name":"llama","models":["llama-3"],"aliases":{"llama":"llama-3"},"adapters":["sql"]}]}"#;

    fn engine() -> Engine {
        Engine::new(FilterConfig::from_json(CFG.as_bytes()).unwrap())
    }

    fn fleet(n: u32) -> FleetState {
        fleet_where(n, |_| {})
    }

    /// `n` idle pods, each changed by `change` first.
    fn fleet_where(n: u32, change: impl Fn(&mut PodSnapshot)) -> FleetState {
        let pods = (1..=n)
            .map(|i| {
                let mut p = PodSnapshot::new(format!("10.0.0.{i}:8000"), 1_000);
                p.kv_cache_usage = Some(0.1);
                change(&mut p);
                p
            })
            .collect();
        FleetState::new(Snapshot::of_pool("llama", pods), 1_000)
    }

    fn ctx(fleet: &FleetState, now_ms: u64) -> RequestContext<'_> {
        RequestContext {
            fleet: Some(fleet),
            now_ms,
            ..RequestContext::default()
        }
    }

    fn chat(model: &str, text: &str) -> Vec<u8> {
        serde_json::json!({"model": model, "messages": [{"role": "user", "content": text}]})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn adapter_homes_are_recomputed_only_when_what_the_partition_reads_changes() {
        let names: Vec<String> = (0..40).map(|i| format!("lora-{i}")).collect();
        let slots = |n: u32| {
            move |p: &mut PodSnapshot| {
                p.lora = Some(crate::snapshot::LoraState {
                    max_loras: n,
                    running: Vec::new(),
                    waiting: Vec::new(),
                })
            }
        };
        let mut h = AdapterHomes::new(&names);
        h.refresh(1, &fleet_where(4, slots(4)).pools[0]);
        assert_eq!(h.homes.len(), 40);
        let first = h.homes.clone();
        // A marker: emptied, and left empty by every refresh that reuses the partition.
        h.homes.clear();
        // New snapshot versions, the same pods, slots and speed classes (loads differ): reused.
        h.refresh(2, &fleet_where(4, slots(4)).pools[0]);
        let busier = fleet_where(4, |p| {
            slots(4)(p);
            p.waiting = 3;
        });
        h.refresh(3, &busier.pools[0]);
        assert!(h.homes.is_empty());
        // The pods' slots change: recomputed (to the same homes: 10 a pod either way).
        h.refresh(4, &fleet_where(4, slots(8)).pools[0]);
        assert_eq!(h.homes, first);
        // A pod leaves: recomputed, over the three left.
        h.homes.clear();
        h.refresh(5, &fleet_where(3, slots(8)).pools[0]);
        assert_eq!(h.homes.len(), 40);
        assert!(!h
            .homes
            .values()
            .any(|k| *k == prefix::pod_key("10.0.0.4:8000")));
        // A pool without adapters computes nothing.
        let mut none = AdapterHomes::new(&[]);
        none.refresh(1, &fleet(4).pools[0]);
        assert!(none.homes.is_empty());
    }

    #[test]
    fn alias_is_rewritten_in_the_body() {
        let mut e = engine();
        let sent = chat("llama", "hi");
        let p = e.prepare("/v1/chat/completions", &sent).unwrap();
        let rewrite = p.rewrite.unwrap();
        let body = rewrite.apply(&sent);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["model"], "llama-3");
        assert_eq!(v["messages"][0]["content"], "hi");
        assert_eq!(rewrite.new_len(sent.len()), body.len());
        assert!(e
            .prepare("/v1/chat/completions", &chat("llama-3", "hi"))
            .unwrap()
            .rewrite
            .is_none());
        // Only what lies up to the model's value changes: where `model` comes first, a few
        // bytes, the rest of the body untouched; an escaped name is written as JSON.
        let first = br#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#;
        let rewrite = rewrite_of(&mut e, first);
        assert_eq!(rewrite.replaced, br#"{"model":"llama""#.len());
        assert_eq!(rewrite.with, br#"{"model":"llama-3""#.to_vec());
        let escaped = br#"{"model":"ll\u0061ma","messages":[{"role":"user","content":"hi"}]}"#;
        let rewrite = rewrite_of(&mut e, escaped);
        assert_eq!(rewrite.apply(escaped), chat_first("llama-3", "hi"));
    }

    /// The rewrite of a chat `body` (one is due).
    fn rewrite_of(e: &mut Engine, body: &[u8]) -> BodyRewrite {
        e.prepare("/v1/chat/completions", body)
            .unwrap()
            .rewrite
            .unwrap()
    }

    /// A chat body with `model` first, as curl users and OpenAI's Node SDK write it.
    fn chat_first(model: &str, text: &str) -> Vec<u8> {
        format!(
            r#"{{"model":{},"messages":[{{"role":"user","content":{}}}]}}"#,
            serde_json::to_string(model).unwrap(),
            serde_json::to_string(text).unwrap()
        )
        .into_bytes()
    }

    #[test]
    fn an_audio_form_is_routed_by_its_model_field_and_its_alias_rewritten() {
        let cfg = r#"{"pools":[{"name":"llama","models":["llama-3"]},
            {"name":"asr","models":["whisper-v3"],"aliases":{"whisper":"whisper-v3"}}],
            "splits":{"stt":[{"model":"llama-3","weight":1},{"model":"whisper-v3","weight":1}]}}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let form = |boundary: &str, model: &str| {
            format!(
                "--{boundary}\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\n{model}\r\n\
                 --{boundary}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\n\
                 RIFF....\r\n--{boundary}--\r\n"
            )
            .into_bytes()
        };
        let path = "/v1/audio/transcriptions";
        let ctx = RequestContext::default;
        let body = form("b1", "whisper");
        // Routed at the file's head, before any audio arrived.
        let head = body.len() - "RIFF....\r\n--b1--\r\n".len();
        assert!(e
            .prepare_form(path, &body[..head - 1], "b1", false, ctx())
            .unwrap()
            .is_none());
        let p = e
            .prepare_form(path, &body[..head], "b1", false, ctx())
            .unwrap()
            .unwrap();
        assert_eq!(&*p.pool, "asr");
        assert_eq!(p.prompt_tokens, 0);
        let rewritten = p.rewrite.unwrap().apply(&body[..head]);
        assert_eq!(rewritten, form("b1", "whisper-v3")[..head + 3].to_vec());
        // No prompt: the typical prompt size the scorers use is left alone.
        assert_eq!(e.avg_prompt_tokens, 0.0);
        // Errors are the JSON path's.
        let unknown = e.prepare_form(path, &form("b1", "gpt-9"), "b1", true, ctx());
        assert_eq!(unknown.unwrap_err().status, 404);
        // A split takes each upload by its boundary, drawn at random by clients: both targets.
        let pools: std::collections::HashSet<String> = (0..32)
            .map(|i| {
                let b = format!("boundary{i}");
                let p = e
                    .prepare_form(path, &form(&b, "stt"), &b, true, ctx())
                    .unwrap()
                    .unwrap();
                p.pool.to_string()
            })
            .collect();
        assert_eq!(pools.len(), 2, "{pools:?}");
    }

    #[test]
    fn a_split_keeps_each_conversation_on_one_target_and_rewrites_the_body() {
        let cfg = r#"{"pools":[{"name":"old","models":["m-v1"]},{"name":"new","models":["m-v2"],"adapters":["a"]}],
            "splits":{"m":[{"model":"m-v1","weight":1},{"model":"m-v2","weight":1}]}}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let turns = |i: usize, n: usize| {
            let mut messages = vec![
                serde_json::json!({"role": "system", "content": "You are terse."}),
                serde_json::json!({"role": "user", "content": format!("question {i}")}),
            ];
            for t in 1..n {
                messages.push(
                    serde_json::json!({"role": "assistant", "content": format!("answer {t}")}),
                );
                messages
                    .push(serde_json::json!({"role": "user", "content": format!("follow-up {t}")}));
            }
            serde_json::json!({"model": "m", "messages": messages})
                .to_string()
                .into_bytes()
        };
        let mut by_target = [0, 0];
        for i in 0..200 {
            let asked = turns(i, 1);
            let first = e.prepare("/v1/chat/completions", &asked).unwrap();
            let (pool, model) = (first.pool.clone(), first.target.model.clone());
            by_target[usize::from(&*pool == "new")] += 1;
            assert_eq!(
                Some(("m", model.as_str())),
                first.split.as_ref().map(SplitTaken::names)
            );
            let sent = first.rewrite.as_ref().unwrap().apply(&asked);
            let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
            assert_eq!(sent["model"], model.as_str());
            assert_eq!(sent["messages"][1]["content"], format!("question {i}"));
            // Later turns of the same conversation: the same target, whatever was added.
            for n in [2, 5] {
                let later = e.prepare("/v1/chat/completions", &turns(i, n)).unwrap();
                assert_eq!(
                    (later.pool.as_ref(), later.target.model.as_str()),
                    (pool.as_ref(), model.as_str())
                );
            }
        }
        // 1 : 1 over 200 conversations (a standard deviation of ~7).
        assert!(
            by_target.iter().all(|n| (65..=135).contains(n)),
            "{by_target:?}"
        );
        // A served name bypasses the split; a prompt without conversation structure is keyed by
        // its text.
        let direct = e
            .prepare("/v1/chat/completions", &chat("m-v2", "hi"))
            .unwrap();
        assert!(direct.split.is_none() && direct.rewrite.is_none());
        let completion = |p: &str| {
            serde_json::json!({"model": "m", "prompt": p})
                .to_string()
                .into_bytes()
        };
        let a = e
            .prepare("/v1/completions", &completion("the same prompt"))
            .unwrap();
        let b = e
            .prepare("/v1/completions", &completion("the same prompt"))
            .unwrap();
        assert_eq!(a.target.model, b.target.model);
        // A split key keys the split instead: one key, one target, whatever the conversation;
        // different keys spread over the targets.
        let mut by_key = std::collections::HashMap::new();
        for user in 0..100 {
            let key = format!("user-{user}");
            let keyed = RequestContext {
                split_key: Some(&key),
                ..RequestContext::default()
            };
            for i in 0..3 {
                let p = e
                    .prepare_in(
                        "/v1/chat/completions",
                        &turns(1000 + user * 3 + i, 1),
                        keyed,
                    )
                    .unwrap();
                let seen = by_key.entry(user).or_insert_with(|| p.target.model.clone());
                assert_eq!(*seen, p.target.model, "user {user}");
            }
        }
        let on_v2 = by_key.values().filter(|m| *m == "m-v2").count();
        assert!((30..=70).contains(&on_v2), "{on_v2} of 100 keys on m-v2");
    }

    #[test]
    fn a_split_passes_over_a_pool_the_snapshot_shows_unable_to_serve() {
        let cfg = r#"{"pools":[{"name":"old","models":["m-v1"]},{"name":"new","models":["m-v2"]}],
            "splits":{"m":[{"model":"m-v1","weight":1},{"model":"m-v2","weight":1}]}}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let fleet_with = |new_healthy: bool, scraped_at: u64| {
            fleet_of(
                &[
                    ("old", &[("10.0.0.1:8000", true)]),
                    (
                        "new",
                        &[("10.0.1.1:8000", new_healthy), ("10.0.1.2:8000", false)],
                    ),
                ],
                scraped_at,
            )
        };
        let (down, up) = (fleet_with(false, 1_000), fleet_with(true, 1_000));
        let mut on_new = 0;
        for i in 0..100 {
            let body = chat("m", &format!("conversation {i}"));
            let own = e.prepare("/v1/chat/completions", &body).unwrap();
            let healthy = e
                .prepare_in("/v1/chat/completions", &body, ctx(&up, 1_100))
                .unwrap();
            assert_eq!(healthy.pool, own.pool);
            let p = e
                .prepare_in("/v1/chat/completions", &body, ctx(&down, 1_100))
                .unwrap();
            let taken = p.split.as_ref().unwrap();
            assert_eq!(&*p.pool, "old");
            assert_eq!(taken.rerouted, &*own.pool == "new");
            let sent = p.rewrite.as_ref().unwrap().apply(&body);
            let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
            assert_eq!(sent["model"], "m-v1");
            // Metrics past stale_after_ms say nothing either way: every pool is equally unknown,
            // and the key keeps its own target.
            let stale = e
                .prepare_in("/v1/chat/completions", &body, ctx(&down, 1_000 + 5_000))
                .unwrap();
            assert_eq!(stale.pool, own.pool);
            on_new += usize::from(&*own.pool == "new");
        }
        assert!(
            on_new > 20,
            "{on_new} of 100 conversations hash to the new pool"
        );
        // The debug header says which version a request took, and whether it was moved.
        let body = (0..100)
            .map(|i| chat("m", &format!("conversation {i}")))
            .find(|b| &*e.prepare("/v1/chat/completions", b).unwrap().pool == "new")
            .unwrap();
        let opts = DecideOptions {
            now_ms: 1_100,
            debug: true,
            ..DecideOptions::default()
        };
        let mut rng = SplitMix64::new(1);
        for (fleet, want) in [
            (&up, "split=m->m-v2; pool=new"),
            (&down, "split=m->m-v1 (rerouted); pool=old"),
        ] {
            let p = e
                .prepare_in("/v1/chat/completions", &body, ctx(fleet, 1_100))
                .unwrap();
            let c = e.decide(&p, Some(fleet), &[], opts, &mut rng);
            let d = c.debug.unwrap();
            assert!(d.starts_with(want), "{d}");
        }
    }

    /// A split turn read again for its stored response counts once in the typical prompt size
    /// and the share of reused prompts, as a turn read once does (it counted twice before).
    #[test]
    fn a_split_turn_read_again_for_its_response_counts_its_prompt_once() {
        let cfg = r#"{"pools":[{"name":"old","models":["m-v1"]},{"name":"new","models":["m-v2"]}],
            "splits":{"m":[{"model":"m-v1","weight":1},{"model":"m-v2","weight":1}]}}"#;
        let fleet = fleet_of(
            &[
                ("old", &[("10.0.0.1:8000", true)]),
                ("new", &[("10.0.1.1:8000", true)]),
            ],
            1_000,
        );
        let path = "/v1/responses";
        let (mut followed, mut once) = (0, 0);
        for i in 0..40 {
            let body = serde_json::to_vec(&serde_json::json!({"model": "m",
                "previous_response_id": "resp_1", "input": "x".repeat(400 + 40 * i)}))
            .unwrap();
            let engine = || {
                let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
                e.learn_response("resp_1", fleet.pool("old").unwrap().pods[0].key);
                // A typical prompt of 50 tokens first, so a second sample would move it.
                let warm = chat("m-v1", &"w".repeat(200));
                let _ = e.prepare_in("/v1/chat/completions", &warm, ctx(&fleet, 1_100));
                e
            };
            let (mut a, mut b) = (engine(), engine());
            let mut p = a.prepare_in(path, &body, ctx(&fleet, 1_100)).unwrap();
            let read_again = &*p.pool == "new";
            a.follow_response(&mut p, path, &body, ctx(&fleet, 1_100))
                .unwrap();
            assert_eq!(&*p.pool, "old");
            // The same turn read once, by an engine where it takes the target holding it.
            let q = b.prepare_in(path, &body, ctx(&fleet, 1_100)).unwrap();
            followed += usize::from(read_again);
            if read_again {
                assert_eq!(a.avg_prompt_tokens, b.avg_prompt_tokens, "turn {i}");
                assert_ne!(&*q.pool, "old");
            } else {
                once += 1;
            }
        }
        assert!(
            followed > 5 && once > 5,
            "{followed} read again, {once} once"
        );
    }

    /// A Responses turn continuing a stored response, sent to a split, goes to the target whose
    /// pool holds the response: its own key (its new input's) names either target, and vLLM on
    /// the other target's pods answers 404. Before, half such turns took the other target.
    #[test]
    fn a_split_turn_continuing_a_stored_response_takes_the_target_holding_it() {
        let cfg = r#"{"pools":[{"name":"old","models":["m-v1"]},{"name":"new","models":["m-v2"]}],
            "splits":{"m":[{"model":"m-v1","weight":1},{"model":"m-v2","weight":1}]}}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let fleet = fleet_of(
            &[
                ("old", &[("10.0.0.1:8000", true), ("10.0.0.2:8000", true)]),
                ("new", &[("10.0.1.1:8000", true), ("10.0.1.2:8000", true)]),
            ],
            1_000,
        );
        let key_of = |pool: &str, i: usize| fleet.pool(pool).unwrap().pods[i].key;
        e.learn_response("resp_old", key_of("old", 1));
        e.learn_response("resp_new", key_of("new", 0));
        let turn = |previous: &str, i: usize| {
            serde_json::to_vec(&serde_json::json!(
                {"model": "m", "previous_response_id": previous, "input": format!("and {i}?")}
            ))
            .unwrap()
        };
        let opts = DecideOptions {
            now_ms: 1_100,
            debug: true,
            ..DecideOptions::default()
        };
        let prepare = |e: &mut Engine, body: &[u8]| {
            let path = "/v1/responses";
            let mut p = e.prepare_in(path, body, ctx(&fleet, 1_100)).unwrap();
            e.follow_response(&mut p, path, body, ctx(&fleet, 1_100))
                .unwrap();
            p
        };
        let mut own_key_elsewhere = 0;
        for i in 0..40 {
            for (previous, pool, held) in [
                ("resp_old", "old", key_of("old", 1)),
                ("resp_new", "new", key_of("new", 0)),
            ] {
                let body = turn(previous, i);
                // What the turn's own key names (an unknown response: nothing to follow).
                let own = prepare(&mut e, &turn("resp_unknown", i));
                own_key_elsewhere += usize::from(&*own.pool != pool);
                let p = prepare(&mut e, &body);
                assert_eq!(&*p.pool, pool, "{previous} {i}");
                let sent = p.rewrite.as_ref().unwrap().apply(&body);
                let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
                assert_eq!(sent["model"], if pool == "old" { "m-v1" } else { "m-v2" });
                let c = e.decide(&p, Some(&fleet), &[], opts, &mut SplitMix64::new(1));
                assert_eq!(c.picked_key, Some(held));
                assert!(c.pinned_response);
                let d = c.debug.unwrap();
                let why = if &*own.pool != pool {
                    " (response)"
                } else {
                    ""
                };
                assert!(
                    d.starts_with(&format!(
                        "split=m->m-v{}{why}; ",
                        1 + usize::from(pool == "new")
                    )),
                    "{d}"
                );
            }
        }
        // The keys alone sent about half the turns to the other target.
        assert!(
            (20..=60).contains(&own_key_elsewhere),
            "{own_key_elsewhere}"
        );
        // A response whose pod is gone from the snapshot (or unhealthy) is not followed: the
        // turn's own key decides, as for an unknown one.
        e.learn_response("resp_gone", 12345);
        for i in 0..10 {
            let gone = prepare(&mut e, &turn("resp_gone", i));
            let own = prepare(&mut e, &turn("resp_unknown", i));
            assert_eq!(gone.pool, own.pool);
            assert!(!gone.split.unwrap().response);
        }
    }

    /// A snapshot of pools (name, [(address, healthy)]) scraped at `scraped_at`.
    fn fleet_of(pools: &[(&str, &[(&str, bool)])], scraped_at: u64) -> FleetState {
        let pods = |pods: &[(&str, bool)]| {
            pods.iter()
                .map(|(addr, healthy)| {
                    let mut p = PodSnapshot::new(*addr, scraped_at);
                    p.healthy = *healthy;
                    p
                })
                .collect()
        };
        let pools = pools.iter().map(|(name, p)| (*name, pods(p))).collect();
        fleet_of_pods(pools, scraped_at)
    }

    /// A snapshot of pools (name, their pods) generated at `at`.
    fn fleet_of_pods(pools: Vec<(&str, Vec<PodSnapshot>)>, at: u64) -> FleetState {
        let snap = Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: 1,
            source: "test".into(),
            generated_at_ms: at,
            pools: pools
                .into_iter()
                .map(|(name, pods)| PoolSnapshot {
                    name: name.into(),
                    pods,
                })
                .collect(),
        };
        FleetState::new(snap, at)
    }

    #[test]
    fn a_pool_that_cannot_serve_hands_its_requests_to_its_first_failover_pool_that_can() {
        let cfg = r#"{"pools":[
            {"name":"llama","models":["llama-3"],"aliases":{"llama":"llama-3"},"adapters":["sql"],
             "failover":["dr-a","dr-b"]},
            {"name":"dr-a","models":[]},
            {"name":"dr-b","models":[]},
            {"name":"qwen","models":["qwen"]}]}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let state = |llama: bool, a: bool, b: bool| {
            fleet_of(
                &[
                    (
                        "llama",
                        &[("10.0.0.1:8000", llama), ("10.0.0.2:8000", false)],
                    ),
                    ("dr-a", &[("10.1.0.1:8000", a)]),
                    ("dr-b", &[("10.2.0.1:8000", b)]),
                    ("qwen", &[("10.3.0.1:8000", false)]),
                ],
                1_000,
            )
        };
        let pool_for = |e: &mut Engine, model: &str, fleet: &FleetState, now: u64| {
            let p = e
                .prepare_in("/v1/chat/completions", &chat(model, "hi"), ctx(fleet, now))
                .unwrap();
            (
                p.pool.to_string(),
                p.failed_over.map(|f| f.from.to_string()),
            )
        };
        let stays = ("llama".to_string(), None);
        let to = |pool: &str| (pool.to_string(), Some("llama".to_string()));
        // One healthy pod is enough to keep the requests.
        assert_eq!(
            pool_for(&mut e, "llama-3", &state(true, true, true), 1_100),
            stays
        );
        // Without one, the first failover pool that has one takes them, in the listed order.
        assert_eq!(
            pool_for(&mut e, "llama-3", &state(false, true, true), 1_100),
            to("dr-a")
        );
        assert_eq!(
            pool_for(&mut e, "llama-3", &state(false, false, true), 1_100),
            to("dr-b")
        );
        // None can: the request stays, and fails open there as before.
        assert_eq!(
            pool_for(&mut e, "llama-3", &state(false, false, false), 1_100),
            stays
        );
        // Metrics past stale_after_ms say nothing of any pool: nothing moves.
        assert_eq!(
            pool_for(&mut e, "llama-3", &state(false, true, true), 7_000),
            stays
        );
        // A pool without failover keeps its requests whatever the snapshot says.
        assert_eq!(
            pool_for(&mut e, "qwen", &state(false, true, true), 1_100).0,
            "qwen"
        );
        // No snapshot, or one without the pool: nothing known against it.
        let none = e
            .prepare("/v1/chat/completions", &chat("llama-3", "hi"))
            .unwrap();
        assert_eq!((&*none.pool, none.failed_over.is_none()), ("llama", true));
        let without = fleet_of(&[("dr-a", &[("10.1.0.1:8000", true)])], 1_000);
        assert_eq!(pool_for(&mut e, "llama-3", &without, 1_100), stays);
        // A failover pool the snapshot does not list is not sent to.
        let no_dr = fleet_of(&[("llama", &[("10.0.0.1:8000", false)])], 1_000);
        assert_eq!(pool_for(&mut e, "llama-3", &no_dr, 1_100), stays);

        // The request goes as it would have: an alias rewritten to the model, an adapter with its
        // base model, the same headers but the pool's.
        let down = state(false, true, true);
        let asked = chat("llama", "hi");
        let p = e
            .prepare_in("/v1/chat/completions", &asked, ctx(&down, 1_100))
            .unwrap();
        let sent = p.rewrite.as_ref().unwrap().apply(&asked);
        let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
        assert_eq!(sent["model"], "llama-3");
        let p = e
            .prepare_in(
                "/v1/chat/completions",
                &chat("sql", "hi"),
                ctx(&down, 1_100),
            )
            .unwrap();
        let headers: Vec<_> = p.routing_headers().collect();
        assert_eq!(
            headers,
            [
                (headers::POOL, "dr-a"),
                (headers::MODEL, "sql"),
                (headers::BASE_MODEL, "llama-3"),
                (headers::ADAPTER, "sql"),
            ]
        );
        // The pod is picked from the failover pool, and the debug header says why.
        let opts = DecideOptions {
            now_ms: 1_100,
            debug: true,
            ..DecideOptions::default()
        };
        let c = e.decide(&p, Some(&down), &[], opts, &mut SplitMix64::new(1));
        assert_eq!(c.destination.as_deref(), Some("10.1.0.1:8000"));
        let d = c.debug.unwrap();
        assert!(d.starts_with("failover=llama->dr-a; pool=dr-a"), "{d}");
    }

    #[test]
    fn a_split_target_whose_pool_is_down_fails_over_when_no_other_target_serves() {
        let cfg = r#"{"pools":[{"name":"old","models":["m-v1"],"failover":["dr"]},
                               {"name":"new","models":["m-v2"]},{"name":"dr","models":[]}],
            "splits":{"m":[{"model":"m-v1","weight":1},{"model":"m-v2","weight":1}]}}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let fleet = |new: bool| {
            fleet_of(
                &[
                    ("old", &[("10.0.0.1:8000", false)]),
                    ("new", &[("10.0.1.1:8000", new)]),
                    ("dr", &[("10.0.2.1:8000", true)]),
                ],
                1_000,
            )
        };
        for i in 0..20 {
            let body = chat("m", &format!("conversation {i}"));
            // The split moves the old version's conversations to the new one first.
            let p = e
                .prepare_in("/v1/chat/completions", &body, ctx(&fleet(true), 1_100))
                .unwrap();
            assert_eq!((&*p.pool, p.failed_over.is_none()), ("new", true));
            // With no version serving, each keeps its own target, and old's go to its failover.
            let p = e
                .prepare_in("/v1/chat/completions", &body, ctx(&fleet(false), 1_100))
                .unwrap();
            let target = p.split.as_ref().unwrap().names().1.to_string();
            let want = if target == "m-v1" {
                ("dr", Some("old"))
            } else {
                ("new", None)
            };
            assert_eq!((&*p.pool, p.failed_over.as_ref().map(|f| &*f.from)), want);
        }
    }

    #[test]
    fn with_overflow_a_pool_whose_pods_are_all_saturated_hands_requests_to_a_pool_with_room() {
        let cfg = r#"{"pools":[
            {"name":"llama","models":["llama-3"],"failover":["dr","burst"],"overflow":true},
            {"name":"dr","models":[]},{"name":"burst","models":[]},
            {"name":"qwen","models":["qwen"],"failover":["dr"]}],
            "scoring":{"queue_threshold":5,"kv_threshold":0.8}, "debug_header":true}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        // Each pod: (address, waiting, KV use); all healthy.
        let pods = |list: &[(&str, u32, f64)]| {
            list.iter()
                .map(|(addr, waiting, kv)| {
                    let mut p = PodSnapshot::new(*addr, 1_000);
                    p.waiting = *waiting;
                    p.kv_cache_usage = Some(*kv);
                    p
                })
                .collect::<Vec<_>>()
        };
        let state = |llama: &[(&str, u32, f64)], dr: &[(&str, u32, f64)]| {
            fleet_of_pods(
                vec![
                    ("llama", pods(llama)),
                    ("dr", pods(dr)),
                    ("burst", pods(&[("10.2.0.1:8000", 0, 0.1)])),
                    ("qwen", pods(&[("10.3.0.1:8000", 9, 0.9)])),
                ],
                1_000,
            )
        };
        let (busy, queued, full, idle) = (
            ("10.0.0.1:8000", 9, 0.5),
            ("10.0.0.2:8000", 5, 0.1),
            ("10.0.0.3:8000", 0, 0.8),
            ("10.0.0.4:8000", 4, 0.79),
        );
        let dr_idle = [("10.1.0.1:8000", 0, 0.1)];
        // Step 1, then the pick; a request the pick sends on is moved and picked for again, each
        // time further down the failover list.
        let opts = DecideOptions {
            now_ms: 1_100,
            debug: true,
            ..DecideOptions::default()
        };
        let decided = |e: &mut Engine, model: &str, fleet: &FleetState| {
            let mut p = e
                .prepare_in(
                    "/v1/chat/completions",
                    &chat(model, "hi"),
                    ctx(fleet, 1_100),
                )
                .unwrap();
            let mut moves = 0;
            loop {
                let c = e.decide(&p, Some(fleet), &[], opts, &mut SplitMix64::new(1));
                let Decision::Overflow(to) = c.decision else {
                    return (p, c);
                };
                e.overflow(&mut p, to);
                moves += 1;
                assert!(moves <= 2, "moved {moves} times");
            }
        };
        let where_to = |e: &mut Engine, model: &str, fleet: &FleetState| {
            let p = decided(e, model, fleet).0;
            (p.pool.to_string(), p.failed_over)
        };
        // One pod under both thresholds is room enough: the request stays.
        let (pool, moved) = where_to(
            &mut e,
            "llama-3",
            &state(&[busy, queued, full, idle], &dr_idle),
        );
        assert_eq!((pool.as_str(), moved), ("llama", None));
        // Every pod at a threshold (queue 5 or more, or KV 0.8 or more): to the first failover
        // pool with room, counted as overflow.
        let (pool, moved) = where_to(&mut e, "llama-3", &state(&[busy, queued, full], &dr_idle));
        assert_eq!(pool, "dr");
        assert_eq!(
            moved,
            Some(FailedOver {
                from: "llama".into(),
                origin: 0,
                overflow: true
            })
        );
        // A failover pool without room is passed over; if none has room, the request stays (and
        // the picker holds, sheds or picks among the saturated pods as before).
        let dr_busy = [("10.1.0.1:8000", 7, 0.1)];
        assert_eq!(
            where_to(&mut e, "llama-3", &state(&[busy], &dr_busy)).0,
            "burst"
        );
        let no_room = fleet_of_pods(
            vec![
                ("llama", pods(&[busy])),
                ("dr", pods(&dr_busy)),
                ("burst", pods(&[("10.2.0.1:8000", 0, 0.95)])),
            ],
            1_000,
        );
        assert_eq!(
            where_to(&mut e, "llama-3", &no_room),
            ("llama".to_string(), None)
        );
        // A pool that fails over but does not overflow keeps its requests when saturated...
        assert_eq!(
            where_to(&mut e, "qwen", &state(&[busy], &dr_idle)).0,
            "qwen"
        );
        // ... and an overflowing pool with no pod at all fails over as before, to the first
        // pool that serves; that one saturated, on to the next with room, as an overflow of the
        // pool the request was for.
        let (pool, moved) = where_to(&mut e, "llama-3", &state(&[], &dr_busy));
        assert_eq!(pool, "burst");
        assert_eq!(
            moved,
            Some(FailedOver {
                from: "llama".into(),
                origin: 0,
                overflow: true
            })
        );
        let p = e
            .prepare_in(
                "/v1/chat/completions",
                &chat("llama-3", "hi"),
                ctx(&state(&[], &dr_busy), 1_100),
            )
            .unwrap();
        assert_eq!(
            (&*p.pool, p.failed_over.map(|f| f.overflow)),
            ("dr", Some(false))
        );
        // The debug header and the counter say which it was.
        let (p, c) = decided(&mut e, "llama-3", &state(&[busy, full], &dr_idle));
        let d = c.debug.unwrap();
        assert!(d.starts_with("overflow=llama->dr; pool=dr"), "{d}");
        assert_eq!(
            p.failed_over.unwrap().stat(&p.pool),
            "gpuroute.overflow.llama.to.dr"
        );
        // Held where it overflowed to, a request goes home once the snapshot shows its pool
        // with room, and not before; so does one that failed over (its pool had no pod).
        let (mut p, _) = decided(&mut e, "llama-3", &state(&[busy, full], &dr_idle));
        assert_eq!(&*p.pool, "dr");
        assert!(!e.homeward(Some(&state(&[busy, full], &dr_idle)), 1_100, &mut p));
        assert_eq!(&*p.pool, "dr");
        assert!(e.homeward(Some(&state(&[busy, idle], &dr_idle)), 1_100, &mut p));
        assert_eq!(
            (&*p.pool, p.target.pool, p.failed_over.as_ref()),
            ("llama", 0, None)
        );
        assert!(!e.homeward(Some(&state(&[busy, idle], &dr_idle)), 1_100, &mut p));
        let mut failed_over = e
            .prepare_in(
                "/v1/chat/completions",
                &chat("llama-3", "hi"),
                ctx(&state(&[], &dr_busy), 1_100),
            )
            .unwrap();
        assert_eq!(&*failed_over.pool, "dr");
        assert!(!e.homeward(Some(&state(&[], &dr_idle)), 1_100, &mut failed_over));
        assert!(e.homeward(Some(&state(&[idle], &dr_idle)), 1_100, &mut failed_over));
        assert_eq!(&*failed_over.pool, "llama");
        // Saturated by what was sent since the snapshot: the pick sends it on as soon as the
        // in-flight table says so (one pod with room in the snapshot, 4 waiting: one more sent
        // to it fills its queue).
        let fleet = state(&[busy, idle], &dr_idle);
        let p = e
            .prepare_in(
                "/v1/chat/completions",
                &chat("llama-3", "hi"),
                ctx(&fleet, 1_100),
            )
            .unwrap();
        assert_eq!(&*p.pool, "llama");
        let mut table = LoadTable::default();
        let keys = &fleet.pool("llama").unwrap().keys;
        table.rebase(fleet.version, keys);
        let mut decision = |t: &LoadTable| {
            e.decide(&p, Some(&fleet), &t.pods, opts, &mut SplitMix64::new(1))
                .decision
        };
        assert!(matches!(decision(&table), Decision::Picked(_)));
        table.add(1, 1, 100, Some(100));
        assert_eq!(decision(&table), Decision::Overflow(1));
        // A turn continuing a stored response that a pod of the pool holds stays there: no
        // other pool's pod has the response (vLLM answers 404). It overflowed with the rest.
        let held = fleet.pool("llama").unwrap().pods[1].key;
        e.learn_response("resp_held", held);
        let turn = br#"{"model":"llama-3","previous_response_id":"resp_held","input":"and?"}"#;
        let cont = e
            .prepare_in("/v1/responses", turn, ctx(&fleet, 1_100))
            .unwrap();
        let c = e.decide(
            &cont,
            Some(&fleet),
            &table.pods,
            opts,
            &mut SplitMix64::new(1),
        );
        assert!(c.pinned_response, "{:?}", c.decision);
        assert_eq!(c.picked_key, Some(held));
        // Moved to dr, whose snapshot showed room, and dr full too by what was sent it since:
        // on down the list, to burst, as llama's overflow; at the end of the list, no further.
        let mut p = p.clone();
        e.overflow(&mut p, 1);
        let mut dr_table = LoadTable::default();
        let dr = &fleet.pool("dr").unwrap().keys;
        dr_table.rebase(fleet.version, dr);
        let decision = |e: &mut Engine, p: &Prepared, t: &LoadTable| {
            e.decide(p, Some(&fleet), &t.pods, opts, &mut SplitMix64::new(1))
                .decision
        };
        assert!(matches!(
            decision(&mut e, &p, &dr_table),
            Decision::Picked(_)
        ));
        for _ in 0..5 {
            dr_table.add(0, 1, 100, Some(100));
        }
        assert_eq!(decision(&mut e, &p, &dr_table), Decision::Overflow(2));
        e.overflow(&mut p, 2);
        let moved = p.failed_over.clone().unwrap();
        assert_eq!(
            (&*p.pool, &*moved.from, moved.origin),
            ("burst", "llama", 0)
        );
        let mut burst_table = LoadTable::default();
        burst_table.rebase(fleet.version, &fleet.pool("burst").unwrap().keys);
        for _ in 0..5 {
            burst_table.add(0, 1, 100, Some(100));
        }
        assert!(matches!(
            decision(&mut e, &p, &burst_table),
            Decision::Picked(_)
        ));
    }

    #[test]
    fn a_byte_order_mark_before_the_json_is_read_past() {
        let mut e = engine();
        let plain = e
            .prepare("/v1/chat/completions", &chat("llama-3", "hi"))
            .unwrap();
        let marked = [UTF8_BOM, &chat("llama-3", "hi")].concat();
        let p = e.prepare("/v1/chat/completions", &marked).unwrap();
        assert_eq!(
            (p.pool.as_ref(), p.anchors.len()),
            ("llama", plain.anchors.len())
        );
        assert!(p.rewrite.is_none());
        // An alias is rewritten as without the mark, into a body without it: the mark is among
        // the bytes replaced.
        let body = [UTF8_BOM, &chat("llama", "hi")].concat();
        let rewrite = rewrite_of(&mut e, &body);
        assert_eq!(rewrite.apply(&body), chat("llama-3", "hi"));
        let body = [UTF8_BOM, &chat_first("llama", "hi")].concat();
        let rewrite = rewrite_of(&mut e, &body);
        assert_eq!(
            rewrite.replaced,
            UTF8_BOM.len() + br#"{"model":"llama""#.len()
        );
        assert_eq!(rewrite.apply(&body), chat_first("llama-3", "hi"));
        // Only at the start, and only the whole mark.
        assert!(e
            .prepare(
                "/v1/chat/completions",
                &[&b"\xEF\xBB"[..], &chat("llama-3", "hi")].concat()
            )
            .is_err());
        assert!(e
            .prepare(
                "/v1/chat/completions",
                &[UTF8_BOM, UTF8_BOM, &chat("llama-3", "hi")].concat()
            )
            .is_err());
    }

    #[test]
    fn a_reader_apart_from_the_engine_prepares_what_the_engine_does() {
        // The dynamic module reads with a clone of the reader, outside the engine's lock.
        let (mut a, mut b) = (engine(), engine());
        let reader = b.reader().clone();
        let f = fleet(3);
        let opts = DecideOptions {
            now_ms: 1_000,
            ..DecideOptions::default()
        };
        let (mut ra, mut rb) = (SplitMix64::new(5), SplitMix64::new(5));
        let long = |i: usize| {
            let text = format!("{}turn {i}", "a long shared system prompt. ".repeat(40));
            chat("llama", &text)
        };
        for i in 0..40 {
            let body = long(i % 7);
            let pa = a.prepare("/v1/chat/completions", &body).unwrap();
            let read = reader
                .read("/v1/chat/completions", &body, RequestContext::default())
                .unwrap();
            let pb = b.prepare_read(read);
            assert_eq!(format!("{pa:?}"), format!("{pb:?}"));
            let (ca, cb) = (
                a.decide(&pa, Some(&f), &[], opts, &mut ra),
                b.decide(&pb, Some(&f), &[], opts, &mut rb),
            );
            assert_eq!(ca, cb);
            if let (Some(ka), Some(kb)) = (ca.picked_key, cb.picked_key) {
                a.commit(&pa, ka);
                b.commit(&pb, kb);
            }
        }
        // Past the first requests the index has matches to look up, in both.
        let body = long(3);
        assert!(!a
            .prepare("/v1/chat/completions", &body)
            .unwrap()
            .matches
            .is_empty());
        assert_eq!(a.avg_prompt_tokens, b.avg_prompt_tokens);
        // A request the reader refuses is not counted in the typical prompt.
        let before = b.avg_prompt_tokens;
        assert!(b
            .prepare("/v1/chat/completions", &chat("no-such-model", "hi"))
            .is_err());
        assert_eq!(b.avg_prompt_tokens, before);
    }

    #[test]
    fn counting_and_tokenizing_need_the_pool_not_a_pod() {
        let mut e = engine();
        let f = fleet(3);
        let opts = DecideOptions {
            now_ms: 1_000,
            ..DecideOptions::default()
        };
        let mut rng = SplitMix64::new(1);
        let body = chat("llama", "hi");
        e.prepare("/v1/messages", &body).unwrap();
        let typical = e.avg_prompt_tokens;
        // A long document counted is no prefill: the pods' typical prompt stays as it was.
        let long = chat("llama", &"word ".repeat(20_000));
        assert!(
            e.prepare("/v1/messages/count_tokens", &long)
                .unwrap()
                .model_only
        );
        assert_eq!(e.avg_prompt_tokens, typical);
        let p = e.prepare("/v1/messages/count_tokens", &body).unwrap();
        assert!(p.model_only);
        assert_eq!(&*p.pool, "llama");
        // Routed by model (an alias rewritten as for any request), the pod left to Envoy.
        assert!(p.rewrite.is_some());
        let c = e.decide(&p, Some(&f), &[], opts, &mut rng);
        assert_eq!(c.decision, Decision::FailOpen(FailOpen::ModelOnly));
        assert!(c.destination.is_none() && c.picked_key.is_none());
        assert!(FailOpen::ModelOnly.by_design() && !FailOpen::NoFreshPod.by_design());
        // Sent for real, the long document is prefill.
        e.prepare("/v1/messages", &long).unwrap();
        assert!(e.avg_prompt_tokens > typical);
        // The same body on /v1/messages is picked.
        let p = e.prepare("/v1/messages", &body).unwrap();
        assert!(!p.model_only);
        let c = e.decide(&p, Some(&f), &[], opts, &mut rng);
        assert!(
            matches!(c.decision, Decision::Picked(_)),
            "{:?}",
            c.decision
        );
        // `/tokenize` and `/detokenize` likewise.
        let typical = e.avg_prompt_tokens;
        let body = chat("llama", &"word ".repeat(2_000));
        let ids = br#"{"model":"llama","tokens":[1,2,3]}"#;
        for (path, body) in [("/tokenize", &body[..]), ("/detokenize", &ids[..])] {
            let p = e.prepare(path, body).unwrap();
            assert!(p.model_only, "{path}");
            assert_eq!((&*p.pool, p.prompt_tokens), ("llama", 0), "{path}");
            // The alias is rewritten as for any request; the pod is left to Envoy.
            assert!(p.rewrite.is_some(), "{path}");
            let c = e.decide(&p, Some(&f), &[], opts, &mut rng);
            assert_eq!(
                c.decision,
                Decision::FailOpen(FailOpen::ModelOnly),
                "{path}"
            );
            assert!(c.destination.is_none(), "{path}");
        }
        assert_eq!(e.avg_prompt_tokens, typical);
        // A text tokenized is not a prefix any pod caches: the same text sent for real finds
        // nothing learned from it.
        let text = chat("llama", &"tokenized once, never sent. ".repeat(40));
        for _ in 0..3 {
            let p = e.prepare("/tokenize", &text).unwrap();
            let _ = e.decide(&p, Some(&f), &[], opts, &mut rng);
        }
        assert!(e
            .prepare("/v1/chat/completions", &text)
            .unwrap()
            .matches
            .is_empty());
        let e404 = e
            .prepare("/tokenize", &chat("no-such-model", "hi"))
            .unwrap_err();
        assert_eq!(e404.status, 404);
    }

    #[test]
    fn each_pool_picks_with_its_own_scoring() {
        // Two pools of the same pods; the second takes metrics up to 10 s old.
        let cfg = r#"{"pools":[{"name":"llama","models":["llama-3"]},
            {"name":"slow-metrics","models":["m"],"scoring":{"stale_after_ms":10000}}]}"#;
        let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
        let mut f = fleet(2);
        let mut other = f.pools[0].clone();
        other.name = "slow-metrics".into();
        f.pools.push(other);
        let f = FleetState::new(
            Snapshot {
                schema: SNAPSHOT_SCHEMA,
                version: 1,
                source: String::new(),
                generated_at_ms: 1_000,
                pools: f
                    .pools
                    .iter()
                    .map(|p| PoolSnapshot {
                        name: p.name.clone(),
                        pods: p.pods.iter().map(|d| d.snap.clone()).collect(),
                    })
                    .collect(),
            },
            1_000,
        );
        let mut rng = SplitMix64::new(1);
        // 5 s after the scrape: stale for the first pool (1 s), fresh for the second.
        let opts = DecideOptions {
            now_ms: 6_000,
            ..DecideOptions::default()
        };
        let p = e
            .prepare("/v1/chat/completions", &chat("llama-3", "hi"))
            .unwrap();
        let c = e.decide(&p, Some(&f), &[], opts, &mut rng);
        assert_eq!(c.decision, Decision::FailOpen(FailOpen::NoFreshPod));
        let p = e.prepare("/v1/chat/completions", &chat("m", "hi")).unwrap();
        let c = e.decide(&p, Some(&f), &[], opts, &mut rng);
        assert!(
            matches!(c.decision, Decision::Picked(_)),
            "{:?}",
            c.decision
        );
    }

    #[test]
    fn no_snapshot_or_unknown_pool_fails_open() {
        let mut e = engine();
        let p = e
            .prepare("/v1/chat/completions", &chat("llama-3", "hi"))
            .unwrap();
        let mut rng = SplitMix64::new(1);
        let c = e.decide(
            &p,
            None,
            &[],
            DecideOptions {
                now_ms: 1_000,
                sheddable: false,
                holdable: false,
                affinity_hold: false,
                debug: false,
            },
            &mut rng,
        );
        assert_eq!(c.decision, Decision::FailOpen(FailOpen::NoSnapshot));
        assert!(c.destination.is_none());
        let mut f = fleet(2);
        f.pools[0].name = "other".into();
        let f = FleetState::new(
            Snapshot {
                schema: SNAPSHOT_SCHEMA,
                version: 2,
                source: String::new(),
                generated_at_ms: 1_000,
                pools: vec![],
            },
            1_000,
        );
        let c = e.decide(
            &p,
            Some(&f),
            &[],
            DecideOptions {
                now_ms: 1_000,
                sheddable: false,
                holdable: false,
                affinity_hold: false,
                debug: false,
            },
            &mut rng,
        );
        assert_eq!(c.decision, Decision::FailOpen(FailOpen::UnknownPool));
    }

    #[test]
    fn destination_lists_fallbacks_and_debug_explains() {
        let mut e = engine();
        let f = fleet(4);
        let p = e
            .prepare("/v1/chat/completions", &chat("llama-3", "hello"))
            .unwrap();
        let c = e.decide(
            &p,
            Some(&f),
            &[],
            DecideOptions {
                now_ms: 1_010,
                sheddable: false,
                holdable: false,
                affinity_hold: false,
                debug: true,
            },
            &mut SplitMix64::new(3),
        );
        let dest = c.destination.unwrap();
        assert_eq!(dest.split(',').count(), 3);
        assert!(c.debug.unwrap().contains("picked="));
    }

    #[test]
    fn conversation_turns_stick_to_one_pod() {
        let mut e = engine();
        let f = fleet(8);
        let pool = f.pool("llama").unwrap();
        let mut table = LoadTable::default();
        table.rebase(1, &pool.keys);
        let mut rng = SplitMix64::new(11);
        let history = "You are a helpful assistant. ".repeat(4);
        let mut pods = Vec::new();
        let mut convo = history.clone();
        for turn in 0..6 {
            convo.push_str(&format!(
                "Question number {turn}: tell me more about routing. "
            ));
            let p = e
                .prepare(
                    "/v1/completions",
                    &serde_json::to_vec(&serde_json::json!({"model":"llama-3","prompt":convo}))
                        .unwrap(),
                )
                .unwrap();
            let c = e.decide(
                &p,
                Some(&f),
                &table.pods,
                DecideOptions {
                    now_ms: 1_010,
                    sheddable: false,
                    holdable: false,
                    affinity_hold: false,
                    debug: false,
                },
                &mut rng,
            );
            let idx = c.picked_index.unwrap();
            e.commit(&p, c.picked_key.unwrap());
            // The request finished before the next turn.
            pods.push(idx);
        }
        assert!(pods.iter().all(|x| *x == pods[0]), "{pods:?}");
    }

    /// A chat body of `messages` for the test model.
    fn chat_of(messages: &serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"model": "llama-3", "messages": messages})).unwrap()
    }

    /// Picks for `body` on the idle `fleet` (which pod, and its key).
    fn pick(e: &mut Engine, f: &FleetState, body: &[u8]) -> (Prepared, usize, u64) {
        let p = e.prepare("/v1/chat/completions", body).unwrap();
        let opts = DecideOptions {
            now_ms: 1_010,
            ..Default::default()
        };
        let c = e.decide(&p, Some(f), &[], opts, &mut SplitMix64::new(7));
        (p, c.picked_index.unwrap(), c.picked_key.unwrap())
    }

    /// Audit finding: a system prompt longer than the prompt limit (256 blocks x 64 B = 16 KiB;
    /// an agent's rules and tools) left the first user message past the cut, so every
    /// conversation with it had the same key: a follow-up went to the pods of other
    /// conversations (16 of 16 trials at 17,000 and 40,000 B). Five conversations, each placed
    /// on its own pod by load; the follow-up of one goes back to its pod.
    #[test]
    fn a_system_prompt_longer_than_the_limit_still_tells_conversations_apart() {
        let f = fleet(8);
        let keys = f.pool("llama").unwrap().keys.clone();
        for len in [8_000usize, 17_000, 40_000] {
            let system: String = "Rule: always check the repository state before editing files. "
                .chars()
                .cycle()
                .take(len)
                .collect();
            for trial in 0..8usize {
                let mut e = engine();
                let task = |c: usize| format!("Task {c}-{trial}: fix bug #{c} in module m{c}");
                for c in 0..5 {
                    let first = serde_json::json!([{"role": "system", "content": system},
                        {"role": "user", "content": task(c)}]);
                    let p = e.prepare("/v1/chat/completions", &chat_of(&first)).unwrap();
                    e.commit(&p, keys[(trial + c) % 8]);
                }
                let follow_up = serde_json::json!([{"role": "system", "content": system},
                    {"role": "user", "content": task(0)},
                    {"role": "assistant", "content": "I found the bug in module m0. ".repeat(20)},
                    {"role": "user", "content": "Now add a test."}]);
                let (_, i, _) = pick(&mut e, &f, &chat_of(&follow_up));
                assert_eq!(i, trial % 8, "system prompt of {len} B, trial {trial}");
            }
        }
    }

    /// Audit finding: conversations that open alike (the same system prompt and first user
    /// message: "Hi", a fixed task template) share the conversation key, and the pods that
    /// served any of them (at most four on record) were credited with the conversation, while
    /// the pod holding this one's history was not once four others came after it (20 of 20
    /// third turns left it). The credit now goes to the pods that served its previous turn.
    #[test]
    fn conversations_that_open_alike_keep_their_own_pods() {
        let f = fleet(8);
        let keys = f.pool("llama").unwrap().keys.clone();
        let system = "You are a helpful assistant for ACME Corp. Answer concisely. ".repeat(6);
        for opening in [
            "Hi",
            "Hello! I have a question about my long-running invoice dispute",
        ] {
            for trial in 0..16usize {
                let mut e = engine();
                let open = serde_json::json!([{"role": "system", "content": system},
                    {"role": "user", "content": opening}]);
                // Conversation A's first turn, placed on a pod by load, then its second.
                let (p, _, _) = pick(&mut e, &f, &chat_of(&open));
                let home = trial % 8;
                e.commit(&p, keys[home]);
                let answer = format!("Hello! (conversation A, trial {trial}) ").repeat(30);
                let mut a = open.as_array().unwrap().clone();
                a.push(serde_json::json!({"role": "assistant", "content": answer}));
                a.push(serde_json::json!({"role": "user", "content": "Tell me about order 1234."}));
                let (p, i, k) = pick(&mut e, &f, &chat_of(&a.clone().into()));
                assert_eq!(i, home, "second turn, trial {trial}");
                e.commit(&p, k);
                // Four other users open alike; load puts them on four other pods.
                for u in 1..=4 {
                    let p = e.prepare("/v1/chat/completions", &chat_of(&open)).unwrap();
                    e.commit(&p, keys[(home + u) % 8]);
                }
                a.push(
                    serde_json::json!({"role": "assistant", "content": "It shipped. ".repeat(10)}),
                );
                a.push(serde_json::json!({"role": "user", "content": "When will it arrive?"}));
                let (_, i, _) = pick(&mut e, &f, &chat_of(&a.into()));
                assert_eq!(i, home, "third turn, opening {opening:?}, trial {trial}");
            }
        }
    }

    /// The previous turn's pods are exchanged like the rest of a decision: a worker that did not
    /// make it credits them too, and a record without the turn key (an older build's) leaves
    /// the pods under the conversation key credited, as before.
    #[test]
    fn the_previous_turn_is_learned_through_the_sync_log() {
        let f = fleet(8);
        let keys = f.pool("llama").unwrap().keys.clone();
        let turn1 = serde_json::json!([{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}]);
        let turn2 = serde_json::json!([{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Order 7?"}]);
        let turn3 = serde_json::json!([{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Order 7?"}, {"role": "assistant", "content": "Shipped."},
            {"role": "user", "content": "When?"}]);
        let mut a = engine();
        let p1 = a.prepare("/v1/chat/completions", &chat_of(&turn1)).unwrap();
        a.commit(&p1, keys[1]);
        let p2 = a.prepare("/v1/chat/completions", &chat_of(&turn2)).unwrap();
        assert_eq!(p2.conversation_pods, [keys[1]]);
        a.commit(&p2, keys[5]);
        let mut recs = Vec::new();
        SyncLog::decode_after(&a.sync_payload(0), 0, &mut recs);
        let mut b = engine();
        b.apply_sync(&recs);
        let p3 = b.prepare("/v1/chat/completions", &chat_of(&turn3)).unwrap();
        assert_eq!(p3.conversation_pods, [keys[5]]);
        // The same records as an older build sent them: anchors and conversation key only.
        let mut old = engine();
        for (r, p) in recs.iter_mut().zip([&p1, &p2]) {
            let turn = p.turn.unwrap();
            r.anchors.retain(|h| *h != turn);
        }
        old.apply_sync(&recs);
        let p3 = old
            .prepare("/v1/chat/completions", &chat_of(&turn3))
            .unwrap();
        let mut pods = p3.conversation_pods.clone();
        pods.sort_unstable();
        let mut both = vec![keys[1], keys[5]];
        both.sort_unstable();
        assert_eq!(pods, both);
    }

    #[test]
    fn workers_agree_through_the_sync_log() {
        let f = fleet(8);
        let mut a = engine();
        let mut b = engine();
        let text = "shared prefix text ".repeat(20);
        let pa = a
            .prepare(
                "/v1/completions",
                &serde_json::to_vec(&serde_json::json!({"model":"llama-3","prompt":text})).unwrap(),
            )
            .unwrap();
        // Worker A was forced elsewhere than the home by load: pick the last-ranked pod.
        let pool = f.pool("llama").unwrap();
        let forced = pool.pods[7].key;
        a.commit(&pa, forced);
        let payload = a.sync_payload(0);
        let mut recs = Vec::new();
        SyncLog::decode_after(&payload, 0, &mut recs);
        b.apply_sync(&recs);
        let longer = format!("{text} and a follow-up question");
        let pb = b
            .prepare(
                "/v1/completions",
                &serde_json::to_vec(&serde_json::json!({"model":"llama-3","prompt":longer}))
                    .unwrap(),
            )
            .unwrap();
        let c = b.decide(
            &pb,
            Some(&f),
            &[],
            DecideOptions {
                now_ms: 1_010,
                sheddable: false,
                holdable: false,
                affinity_hold: false,
                debug: false,
            },
            &mut SplitMix64::new(5),
        );
        assert_eq!(c.picked_key, Some(forced));
    }

    #[test]
    fn home_fade_is_none_from_the_configured_share_and_all_at_none() {
        assert_eq!(home_fade(1.0, 0.25), 0.0);
        assert_eq!(home_fade(0.25, 0.25), 0.0);
        assert_eq!(home_fade(0.125, 0.25), 0.5);
        assert_eq!(home_fade(0.0, 0.25), 1.0);
        // 0: the whole bonus, whatever the reuse.
        assert_eq!(home_fade(0.0, 0.0), 0.0);
    }

    #[test]
    fn a_new_prompts_home_bonus_fades_while_prompts_are_not_reused() {
        let f = fleet(4);
        let mut e = engine();
        let opts = DecideOptions {
            now_ms: 1_010,
            debug: true,
            ..DecideOptions::default()
        };
        // The largest prefix score in a decision's breakdown: the home's, where nothing matches.
        let best_prefix = |e: &mut Engine, body: &[u8]| {
            let p = e.prepare("/v1/chat/completions", body).unwrap();
            let c = e.decide(&p, Some(&f), &[], opts, &mut SplitMix64::new(1));
            c.debug
                .unwrap()
                .split("prefix=")
                .skip(1)
                .map(|t| t[..5].parse::<f64>().unwrap())
                .fold(0.0, f64::max)
        };
        // Prompts of a few blocks, each its own from the first block on.
        let prompt =
            |m: &str, tag: &str| chat(m, &format!("{tag}: {}", "summarise this. ".repeat(16)));
        // A new gateway takes prompts as reused: the home has its bonus (0.9 x 0.3).
        assert_eq!(best_prefix(&mut e, &prompt("llama-3", "first")), 0.27);
        // Prompts never seen before (none committed, so none is found). After 100 the share
        // found has fallen to (63/64)^101 = 0.20, under the 0.25 that keeps the whole bonus, and
        // the bonus to 0.20 / 0.25 of it (0.22); after 400 more, to nearly nothing.
        let one_offs = |e: &mut Engine, model: &str, n: std::ops::Range<u32>| {
            for i in n {
                let body = prompt(model, &format!("one-off {i}"));
                e.prepare("/v1/chat/completions", &body).unwrap();
            }
        };
        one_offs(&mut e, "llama-3", 0..100);
        let faded = best_prefix(&mut e, &prompt("llama-3", "second"));
        assert!(faded > 0.2 && faded < 0.24, "{faded}");
        one_offs(&mut e, "llama-3", 100..500);
        let gone = best_prefix(&mut e, &prompt("llama-3", "second"));
        assert!(gone < 0.005, "{gone}");
        // An adapter request keeps its adapter's home bonus whatever the reuse.
        assert_eq!(best_prefix(&mut e, &prompt("sql", "third")), 0.27);
        // Prompts found again bring it back.
        let again = chat(
            "llama-3",
            &"a shared system prompt, then a question ".repeat(8),
        );
        let p = e.prepare("/v1/chat/completions", &again).unwrap();
        e.commit(&p, f.pool("llama").unwrap().pods[0].key);
        for _ in 0..100 {
            e.prepare("/v1/chat/completions", &again).unwrap();
        }
        assert_eq!(best_prefix(&mut e, &prompt("llama-3", "fourth")), 0.27);

        // Per pool: one-off prompts to another pool leave this one's bonus whole; and
        // `prefix_home_reuse: 0` keeps it whole whatever the reuse.
        let two = r#"{"pools":[{"name":"llama","models":["llama-3"]},
            {"name":"qwen","models":["qwen-3"]}]}"#;
        let mut e = Engine::new(FilterConfig::from_json(two.as_bytes()).unwrap());
        one_offs(&mut e, "qwen-3", 0..500);
        assert_eq!(best_prefix(&mut e, &prompt("llama-3", "fifth")), 0.27);
        let whole = r#"{"pools":[{"name":"llama","models":["llama-3"],
            "scoring":{"prefix_home_reuse":0}}]}"#;
        let mut e = Engine::new(FilterConfig::from_json(whole.as_bytes()).unwrap());
        one_offs(&mut e, "llama-3", 0..500);
        assert_eq!(best_prefix(&mut e, &prompt("llama-3", "sixth")), 0.27);
    }

    #[test]
    fn least_prefill_is_the_prompt_less_what_the_best_pod_caches() {
        let f = fleet(4);
        let key = f.pool("llama").unwrap().pods[1].key;
        let mut e = engine();
        let block = e.config.prefix.block_tokens();
        let text = "a long shared document ".repeat(40);
        let body = |t: &str| {
            serde_json::to_vec(&serde_json::json!({"model":"llama-3","prompt":t})).unwrap()
        };
        let first = e.prepare("/v1/completions", &body(&text)).unwrap();
        // Nothing cached anywhere yet: the whole prompt.
        assert_eq!(first.least_prefill(block), first.prompt_tokens);
        e.commit(&first, key);
        let next = e
            .prepare("/v1/completions", &body(&format!("{text} and a question")))
            .unwrap();
        let depth = next.matches.iter().map(|m| m.depth).max().unwrap();
        assert!(depth > 0);
        assert_eq!(
            next.least_prefill(block),
            next.prompt_tokens - depth * block
        );
        assert!(next.least_prefill(block) < next.prompt_tokens / 4);
        // A conversation credits only the pods that served it.
        let mut convo = next.clone();
        convo.conversation = Some(7);
        convo.conversation_pods = vec![];
        assert_eq!(convo.least_prefill(block), convo.prompt_tokens);
        convo.conversation_pods = vec![key];
        assert_eq!(convo.least_prefill(block), next.least_prefill(block));
    }

    /// A Responses API turn that continues a stored response goes to the pod that made it,
    /// however loaded, while it is healthy; another worker learns it through the sync log.
    #[test]
    fn a_turn_continuing_a_stored_response_goes_to_the_pod_that_holds_it() {
        let mut f = fleet(4);
        let pool = f.pool("llama").unwrap();
        let (held, keys) = (pool.pods[2].key, pool.keys.clone());
        let mut table = LoadTable::default();
        table.rebase(1, &keys);
        // The pod holding the response is the busiest by far.
        for _ in 0..6 {
            table.add(2, 1, 500, Some(500));
        }
        let opts = DecideOptions {
            now_ms: 1_010,
            sheddable: false,
            holdable: false,
            affinity_hold: false,
            debug: true,
        };
        let turn = |previous: &str| {
            serde_json::to_vec(&serde_json::json!(
                {"model": "llama-3", "previous_response_id": previous, "input": "and then?"}
            ))
            .unwrap()
        };
        let first = |e: &mut Engine, f: &FleetState, body: &[u8]| {
            let p = e.prepare("/v1/responses", body).unwrap();
            assert!(p.learns_response);
            e.decide(&p, Some(f), &table.pods, opts, &mut SplitMix64::new(1))
        };
        let mut a = engine();
        let unknown = first(&mut a, &f, &turn("resp_1"));
        assert_ne!(
            unknown.picked_key,
            Some(held),
            "load decides for an unknown id"
        );
        assert!(!unknown.pinned_response);
        a.learn_response("resp_1", held);
        let c = first(&mut a, &f, &turn("resp_1"));
        assert_eq!(c.picked_key, Some(held));
        assert!(c.pinned_response);
        let dest = c.destination.unwrap();
        assert_eq!(dest.split(',').count(), 3, "{dest}");
        assert!(dest.starts_with(&f.pool("llama").unwrap().pods[2].snap.address));
        assert!(c
            .debug
            .unwrap()
            .starts_with("previous-response; pool=llama"));
        assert_ne!(first(&mut a, &f, &turn("resp_2")).picked_key, Some(held));
        // Every pod's metrics stale (the aggregator down): the turn still goes to its pod, alone,
        // where an unknown one fails open (before, both failed open: any pod, 404 on three of
        // four).
        let stale = DecideOptions {
            now_ms: 60_000,
            ..opts
        };
        let p = a.prepare("/v1/responses", &turn("resp_1")).unwrap();
        let c = a.decide(&p, Some(&f), &table.pods, stale, &mut SplitMix64::new(1));
        assert!(c.pinned_response, "{:?}", c.decision);
        assert_eq!(c.decision, Decision::Picked(vec![2]));
        let p = a.prepare("/v1/responses", &turn("resp_2")).unwrap();
        let c = a.decide(&p, Some(&f), &table.pods, stale, &mut SplitMix64::new(1));
        assert_eq!(c.decision, Decision::FailOpen(FailOpen::NoFreshPod));

        // Another worker learns it from the first one's sync records.
        let mut b = engine();
        let mut recs = Vec::new();
        SyncLog::decode_after(&a.sync_payload(0), 0, &mut recs);
        b.apply_sync(&recs);
        assert_eq!(first(&mut b, &f, &turn("resp_1")).picked_key, Some(held));

        // A pod that failed has lost what it held: load decides again.
        f = fleet_where(4, |p| p.healthy = p.address != "10.0.0.3:8000");
        let after = first(&mut a, &f, &turn("resp_1"));
        assert_ne!(after.picked_key, Some(held));
        assert!(!after.pinned_response);
        assert_eq!(
            a.stored_response_pod("resp_1", &f),
            None,
            "an unhealthy pod"
        );
    }

    #[test]
    fn a_response_slot_holds_its_response_and_no_other() {
        let (a, b) = (response_key("resp_a"), response_key("resp_b"));
        let (slot, value) = response_slot(a, 77);
        assert!(slot.starts_with("gpuroute.resp."));
        assert_eq!(response_slot_pod(a, &value), Some(77));
        assert_eq!(response_slot_pod(b, &value), None);
        assert_eq!(response_slot_pod(a, &value[..15]), None);
        assert_eq!(response_slot_pod(a, b""), None);
        // What a worker notes from a slot, its index knows.
        let f = fleet(2);
        let mut e = engine();
        let pod = f.pool("llama").unwrap().pods[1].key;
        e.note_response(a, pod);
        assert_eq!(
            e.stored_response_pod("resp_a", &f),
            Some(("llama", "10.0.0.2:8000"))
        );
        assert!(e.sync_payload(0).len() <= 8, "noted, not sent on");
    }

    /// Routed prompts do not push a stored response out, on the worker that learned it nor on
    /// one that has it from the records (another worker, another gateway replica): when its key
    /// lived in the prefix index, a few thousand unique prompts (a dozen anchors each) did.
    /// Only newer responses do, and a response a turn continues is kept with the newest.
    #[test]
    fn a_stored_response_outlives_any_number_of_prompts() {
        let f = fleet(4);
        let (held, other) = {
            let pool = f.pool("llama").unwrap();
            (pool.pods[1].key, pool.pods[3].key)
        };
        let small = r#"{"pools":[{"name":"llama","models":["llama-3"]}],
            "prefix":{"index_entries":64},"response_entries":64}"#;
        let mut a = Engine::new(FilterConfig::from_json(small.as_bytes()).unwrap());
        let mut b = Engine::new(FilterConfig::from_json(small.as_bytes()).unwrap());
        a.learn_response("resp_kept", held);
        let mut recs = Vec::new();
        SyncLog::decode_after(&a.sync_payload(0), 0, &mut recs);
        b.apply_sync(&recs);
        assert_eq!(b.response_entries(), 1);
        assert_eq!(b.prefix_entries(), 0, "a response is not a prompt");
        // 500 unique prompts routed by each, six anchors or more each: 3,000 entries or more
        // against an index of 64.
        for i in 0..500 {
            let text = format!("question {i}: ").repeat(60);
            let body = serde_json::to_vec(&serde_json::json!({"model": "llama-3", "prompt": text}))
                .unwrap();
            for e in [&mut a, &mut b] {
                let p = e.prepare("/v1/completions", &body).unwrap();
                assert!(p.anchors.len() >= 6);
                e.commit(&p, other);
            }
        }
        assert!(a.prefix_entries() <= 64);
        let turn = br#"{"model": "llama-3", "previous_response_id": "resp_kept", "input": "and?"}"#;
        for e in [&mut a, &mut b] {
            assert_eq!(
                e.stored_response_pod("resp_kept", &f),
                Some(("llama", "10.0.0.2:8000"))
            );
            assert_eq!(
                e.prepare("/v1/responses", turn).unwrap().response_pod,
                Some(held)
            );
        }
        // Newer responses do push it out, the table's capacity bounding what it holds; one a
        // turn continues stays.
        a.learn_response("resp_continued", held);
        for i in 0..40 {
            a.learn_response(&format!("resp_{i}"), other);
        }
        let continued =
            br#"{"model": "llama-3", "previous_response_id": "resp_continued", "input": "?"}"#;
        assert_eq!(
            a.prepare("/v1/responses", continued).unwrap().response_pod,
            Some(held)
        );
        for i in 40..80 {
            a.learn_response(&format!("resp_{i}"), other);
        }
        assert!(a.response_entries() <= 64);
        assert_eq!(a.stored_response_pod("resp_kept", &f), None);
        assert_eq!(
            a.prepare("/v1/responses", continued).unwrap().response_pod,
            Some(held)
        );
    }

    #[test]
    fn a_stored_responses_own_calls_go_to_the_pod_that_holds_it() {
        let f = fleet(4);
        let mut e = engine();
        assert_eq!(e.stored_response_pod("resp_1", &f), None);
        e.learn_response("resp_1", f.pool("llama").unwrap().pods[1].key);
        assert_eq!(
            e.stored_response_pod("resp_1", &f),
            Some(("llama", "10.0.0.2:8000"))
        );
        assert_eq!(e.stored_response_pod("resp_2", &f), None);
    }

    #[test]
    fn every_gateway_sends_an_adapter_to_the_same_home() {
        let cfg = r#"{"pools":[{"name":"llama","models":["llama-3"],"adapters":["a0","a1","a2","a3","a4","a5","a6","a7"]}]}"#;
        let mut f = fleet(4);
        for p in &mut f.pools[0].pods {
            p.snap.lora = Some(crate::snapshot::LoraState {
                max_loras: 2,
                running: vec![],
                waiting: vec![],
            });
        }
        let mut homes = std::collections::HashMap::new();
        for seed in 0..6 {
            let mut e = Engine::new(FilterConfig::from_json(cfg.as_bytes()).unwrap());
            for a in 0..8 {
                let p = e
                    .prepare("/v1/chat/completions", &chat(&format!("a{a}"), "hi"))
                    .unwrap();
                let opts = DecideOptions {
                    now_ms: 1_010,
                    ..Default::default()
                };
                let c = e.decide(&p, Some(&f), &[], opts, &mut SplitMix64::new(seed));
                let first = *homes.entry(a).or_insert(c.picked_index.unwrap());
                assert_eq!(
                    first,
                    c.picked_index.unwrap(),
                    "adapter a{a}, gateway seed {seed}"
                );
            }
        }
        // Eight adapters, eight slots: two per pod.
        let mut per_pod = [0; 4];
        for i in homes.values() {
            per_pod[*i] += 1;
        }
        assert_eq!(per_pod, [2, 2, 2, 2]);
    }

    #[test]
    fn any_pod_prefers_healthy() {
        let mut f = fleet(3);
        f.pools[0].pods[0].snap.healthy = false;
        f.pools[0].pods[1].snap.healthy = false;
        let mut rng = SplitMix64::new(1);
        for _ in 0..10 {
            assert_eq!(
                Engine::any_pod(&f.pools[0], &mut rng).as_deref(),
                Some("10.0.0.3:8000")
            );
        }
    }
}
