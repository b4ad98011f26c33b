//! Model -> pool resolution (body-based routing) and the gateway's own `/v1/models` answers.
//!
//! The table is built once from the configuration; a lookup is one hash-map probe.
//!
//! `/v1/models` is shared by OpenAI's and Anthropic's APIs, and the gateway answers both with
//! one body: each model object carries OpenAI's fields (`object`, `created`, `owned_by`, and
//! vLLM's `root`/`parent`) and Anthropic's (`type`, `display_name`, `created_at`), the list
//! OpenAI's `object` and Anthropic's page fields (`has_more`, `first_id`, `last_id`). Each SDK
//! reads its own fields and ignores the others.

use crate::config::FilterConfig;
use crate::error::{ApiError, ErrorStyle};
use crate::idmap::NameMap;
use crate::prefix;
use serde::Serialize;
use std::borrow::Cow;
use std::sync::Arc;
use xxhash_rust::xxh64::xxh64;

/// Where a model name leads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Index of the pool in the configuration.
    pub pool: usize,
    /// The model name the pods know (an alias resolves to its target).
    pub model: String,
    /// The pool's base model (differs from `model` for adapters).
    pub base_model: String,
    /// Set for LoRA adapters.
    pub adapter: Option<String>,
    /// The client used an alias or a split: the body's `model` must be rewritten to `model`.
    pub rewrite: bool,
    /// The name this target is served under (what a split's target names: a model, an alias or
    /// an adapter).
    pub requested: String,
}

impl Target {
    /// The same target served by pool `pool` (a failover pool: its pods serve the pool's models
    /// and adapters under the same names).
    pub fn in_pool(&self, pool: usize) -> Arc<Target> {
        Arc::new(Target {
            pool,
            ..self.clone()
        })
    }
}

/// A weighted traffic split (`splits` in the configuration): one public name, several targets.
#[derive(Debug, Clone)]
pub struct Split {
    pub name: String,
    /// Seeds the key hash, so two splits divide the same conversations independently.
    seed: u64,
    /// The targets (each rewrites the body's `model`), each with its weight and its rendezvous
    /// identity (a hash of its served name).
    targets: Vec<SplitTarget>,
}

#[derive(Debug, Clone)]
struct SplitTarget {
    target: Arc<Target>,
    weight: u32,
    /// Hashed from the served name, not the position: reordering the configuration moves no
    /// conversation.
    id: u64,
}

impl Split {
    /// The target for a request whose split key ([`Split::key`]) is `key`: weighted rendezvous
    /// over the targets with a weight (each scores `weight / -ln(u)`, `u` the key's uniform hash
    /// with the target's identity; the highest wins, [`prefix::weighted_hrw`]). So each target
    /// takes a share of the keys proportional to its weight, a key always gets the same target
    /// while the weights stay the same, and, for any number of targets, changing one target's
    /// weight moves keys only to or from that target (adding a target only takes keys to it,
    /// removing one moves only its own). None only for a split without a weighted target,
    /// which `RoutingTable::new` never builds.
    pub fn pick(&self, key: u64) -> Option<(usize, &Arc<Target>)> {
        self.best(key, |_, _| true)
    }

    /// [`Split::pick`], unless its target cannot serve (`serving` says no: its pool has no
    /// healthy pod with fresh metrics) while another target with a weight can: then the key
    /// goes to its best-scoring target among those, which spreads the moved keys over them in
    /// proportion to their weights. A key whose own target serves keeps it, so only the
    /// conversations of the target that is down move, and they come back when it serves again.
    /// The flag says the key was moved.
    pub fn pick_serving(
        &self,
        key: u64,
        serving: impl Fn(&Target) -> bool,
    ) -> Option<(usize, &Arc<Target>, bool)> {
        let (i, first) = self.pick(key)?;
        if serving(first) {
            return Some((i, first, false));
        }
        let moved = self.best(key, |j, t| j != i && serving(t));
        // No other target serves: the key keeps its own (Envoy's balancing takes it there).
        Some(match moved {
            Some((j, t)) => (j, t, true),
            None => (i, first, false),
        })
    }

    /// The highest-scoring target with a weight among those `admit` takes (the first on a tie).
    fn best(
        &self,
        key: u64,
        admit: impl Fn(usize, &Target) -> bool,
    ) -> Option<(usize, &Arc<Target>)> {
        let mut best: Option<(f64, usize, &Arc<Target>)> = None;
        for (j, t) in self.targets.iter().enumerate() {
            if t.weight == 0 || !admit(j, &t.target) {
                continue;
            }
            let score = prefix::weighted_hrw(key, t.id, f64::from(t.weight));
            if best.is_none_or(|(b, _, _)| score > b) {
                best = Some((score, j, &t.target));
            }
        }
        best.map(|(_, j, t)| (j, t))
    }

    /// The split key of a request whose identifying text is `text` (a conversation's leading
    /// part, or the prompt): the same on every worker and gateway replica.
    pub fn key(&self, text: &[u8]) -> u64 {
        xxh64(text, self.seed)
    }

    /// Each target and its weight, in configuration order.
    pub fn targets(&self) -> impl Iterator<Item = (&Target, u64)> + '_ {
        self.targets
            .iter()
            .map(|t| (t.target.as_ref(), u64::from(t.weight)))
    }

    /// Target `i`, in configuration order.
    pub fn target(&self, i: usize) -> Option<&Arc<Target>> {
        self.targets.get(i).map(|t| &t.target)
    }

    /// The served name of target `i`, as configured.
    pub fn target_name(&self, i: usize) -> &str {
        self.targets
            .get(i)
            .map_or("", |t| t.target.requested.as_str())
    }
}

/// What a model name resolves to.
#[derive(Debug, Clone, Copy)]
pub enum Resolved<'a> {
    Target(&'a Arc<Target>),
    /// A split: the request's key picks the target ([`Split::pick`]).
    Split(&'a Arc<Split>),
}

/// The counter of requests for `split` that took `target`:
/// `gpuroute.split.<split>.to.<target>` (both shells).
pub fn split_stat(split: &str, target: &str) -> String {
    to_stat("split", split, target)
}

/// `gpuroute.<family>.<from>.to.<to>`, each name as a stat segment: the counters of what went
/// from a split or a pool to a target or another pool.
fn to_stat(family: &str, from: &str, to: &str) -> String {
    format!(
        "gpuroute.{family}.{}.to.{}",
        crate::fleet::stat_segment(from),
        crate::fleet::stat_segment(to)
    )
}

/// The counter of requests for `split` moved off a target that could not serve them:
/// `gpuroute.split.<split>.rerouted` (both shells).
pub fn split_rerouted_stat(split: &str) -> String {
    format!(
        "gpuroute.split.{}.rerouted",
        crate::fleet::stat_segment(split)
    )
}

/// The counter of requests for pool `from` sent to its failover pool `to`:
/// `gpuroute.failover.<from>.to.<to>` (both shells).
pub fn failover_stat(from: &str, to: &str) -> String {
    to_stat("failover", from, to)
}

/// The counter of requests for pool `from` sent to its failover pool `to` while every pod of
/// `from` was saturated (`pools[].overflow`): `gpuroute.overflow.<from>.to.<to>` (both shells).
pub fn overflow_stat(from: &str, to: &str) -> String {
    to_stat("overflow", from, to)
}

/// Seed domain of split keys.
const SPLIT_SEED: u64 = 0x7370_6c69_7473_6565;
/// Seeds a split target's rendezvous identity ([`SplitTarget::id`]).
const SPLIT_TARGET_SEED: u64 = 0x7370_6c69_745f_7467;

/// Every name the gateway serves.
#[derive(Debug, Clone)]
pub struct RoutingTable {
    /// Shared, so a request takes its target without copying its strings.
    by_name: NameMap<String, Arc<Target>>,
    /// Split names, apart from `by_name`: a request for one needs its prompt to pick a target.
    splits: NameMap<String, Arc<Split>>,
    /// Shared with every request's [`crate::engine::Prepared`] and in-flight record: a clone
    /// is a count, not an allocation.
    pool_names: Vec<Arc<str>>,
    default_target: Option<Arc<Target>>,
    /// Per pool, its `failover` pools' indices, in order.
    failover: Vec<Vec<usize>>,
    /// Per pool, its `overflow`.
    overflow: Vec<bool>,
    models_json: String,
    /// One model's object by its id (`GET /v1/models/{id}`).
    model_json: NameMap<String, String>,
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: &'a [ModelCard<'a>],
    /// Anthropic's page: everything is on the one page.
    has_more: bool,
    first_id: Option<&'a str>,
    last_id: Option<&'a str>,
}

#[derive(Serialize)]
struct ModelCard<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    /// vLLM's fields: `root` is the base model, `parent` the base of an adapter.
    root: &'a str,
    parent: Option<&'a str>,
    /// Anthropic's fields.
    #[serde(rename = "type")]
    kind: &'static str,
    display_name: &'a str,
    /// `created` (0: the gateway does not know when a model was made) as RFC 3339.
    created_at: &'static str,
}

/// What a `GET` under the models path asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelsQuery {
    /// `GET /v1/models` (or with a trailing `/`).
    List,
    /// `GET /v1/models/{id}`, the id percent-decoded (a model name's `/` arrives as is or as
    /// `%2F`, depending on the client).
    One(String),
}

impl ModelsQuery {
    /// `path` (without its query) under `models_path`, or None for any other path, or when
    /// answering models is disabled (`models_path` empty).
    pub fn of(path: &str, models_path: &str) -> Option<ModelsQuery> {
        if models_path.is_empty() {
            return None;
        }
        let rest = path.strip_prefix(models_path)?;
        if rest.is_empty() || rest == "/" {
            return Some(ModelsQuery::List);
        }
        rest.strip_prefix('/')
            .map(|id| ModelsQuery::One(percent_decoded(id)))
    }
}

/// `%XX` escapes decoded; anything else (a malformed escape, a result that is not UTF-8) kept
/// as it came, which then names no model.
fn percent_decoded(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |j: usize| b.get(j).and_then(|c| char::from(*c).to_digit(16));
        match (b[i], hex(i + 1), hex(i + 2)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

impl RoutingTable {
    /// Builds the table from a validated configuration.
    pub fn new(cfg: &FilterConfig) -> RoutingTable {
        let mut by_name = NameMap::default();
        let mut cards = Vec::new();
        for (pi, pool) in cfg.pools.iter().enumerate() {
            let base = pool.models.first().cloned().unwrap_or_default();
            for m in &pool.models {
                by_name.insert(
                    m.clone(),
                    Arc::new(Target {
                        pool: pi,
                        model: m.clone(),
                        base_model: m.clone(),
                        adapter: None,
                        rewrite: false,
                        requested: m.clone(),
                    }),
                );
            }
            for (alias, target) in &pool.aliases {
                by_name.insert(
                    alias.clone(),
                    Arc::new(Target {
                        pool: pi,
                        model: target.clone(),
                        base_model: target.clone(),
                        adapter: None,
                        rewrite: true,
                        requested: alias.clone(),
                    }),
                );
            }
            for a in &pool.adapters {
                by_name.insert(
                    a.clone(),
                    Arc::new(Target {
                        pool: pi,
                        model: a.clone(),
                        base_model: base.clone(),
                        adapter: Some(a.clone()),
                        rewrite: false,
                        requested: a.clone(),
                    }),
                );
            }
        }
        // Listed in configuration order: models, aliases, adapters, pool by pool.
        for pool in &cfg.pools {
            let base = pool.models.first().map(String::as_str).unwrap_or("");
            for m in &pool.models {
                cards.push(card(m, m, None));
            }
            for (alias, target) in &pool.aliases {
                cards.push(card(alias, target, None));
            }
            for a in &pool.adapters {
                cards.push(card(a, base, Some(base)));
            }
        }
        let mut splits = NameMap::default();
        for (name, targets) in &cfg.splits {
            // A split is listed as a model of its first target's base (what vLLM's `root`
            // means: the weights it runs on).
            if let Some(first) = targets.first().and_then(|t| by_name.get(&t.model)) {
                cards.push(card(name, first.base_model.as_str(), None));
            }
            let targets: Vec<SplitTarget> = targets
                .iter()
                .filter_map(|t| {
                    let served = by_name.get(&t.model)?;
                    let rewritten = Target {
                        rewrite: true,
                        ..Target::clone(served)
                    };
                    Some(SplitTarget {
                        target: Arc::new(rewritten),
                        weight: t.weight,
                        id: xxh64(t.model.as_bytes(), SPLIT_TARGET_SEED),
                    })
                })
                .collect();
            // Validation guarantees a target with a positive weight; a split without one is
            // left out (its name then answers 404), so `pick` always has a target to return.
            if targets.iter().all(|t| t.weight == 0) {
                continue;
            }
            let split = Split {
                name: name.clone(),
                seed: xxh64(name.as_bytes(), SPLIT_SEED),
                targets,
            };
            splits.insert(name.clone(), Arc::new(split));
        }
        let models_json = serde_json::to_string(&ModelList {
            object: "list",
            data: &cards,
            has_more: false,
            first_id: cards.first().map(|c| c.id),
            last_id: cards.last().map(|c| c.id),
        })
        .unwrap_or_else(|_| r#"{"object":"list","data":[],"has_more":false}"#.to_string());
        let mut model_json = NameMap::default();
        for c in &cards {
            if let Ok(j) = serde_json::to_string(c) {
                model_json.insert(c.id.to_string(), j);
            }
        }
        let default_target = cfg.default_pool.as_ref().and_then(|d| {
            let pi = cfg.pools.iter().position(|p| &p.name == d)?;
            let m = cfg.pools[pi].models.first()?.clone();
            Some(Arc::new(Target {
                pool: pi,
                model: m.clone(),
                base_model: m.clone(),
                adapter: None,
                rewrite: false,
                requested: m,
            }))
        });
        RoutingTable {
            by_name,
            splits,
            pool_names: cfg
                .pools
                .iter()
                .map(|p| Arc::from(p.name.as_str()))
                .collect(),
            default_target,
            failover: cfg
                .pools
                .iter()
                .map(|p| {
                    let index = |name: &String| cfg.pools.iter().position(|q| &q.name == name);
                    p.failover.iter().filter_map(index).collect()
                })
                .collect(),
            overflow: cfg.pools.iter().map(|p| p.overflow).collect(),
            models_json,
            model_json,
        }
    }

    /// Resolves the body's `model` (None when absent) to its pool, or to a split.
    pub fn resolve(&self, model: Option<&str>) -> Result<Resolved<'_>, ApiError> {
        match model {
            Some(m) => match self.by_name.get(m) {
                Some(t) => Ok(Resolved::Target(t)),
                None => self
                    .splits
                    .get(m)
                    .map(Resolved::Split)
                    .ok_or_else(|| ApiError::model_not_found(m)),
            },
            None => self
                .default_target
                .as_ref()
                .map(Resolved::Target)
                .ok_or_else(ApiError::missing_model),
        }
    }

    /// Name of pool `i`.
    pub fn pool_name(&self, i: usize) -> &str {
        self.pool_names.get(i).map_or("", |n| n)
    }

    /// The failover pools of pool `i` (`pools[].failover`), in order.
    pub fn failover(&self, i: usize) -> &[usize] {
        self.failover.get(i).map_or(&[], Vec::as_slice)
    }

    /// Whether pool `i` also overflows to its failover pools (`pools[].overflow`).
    pub fn overflows(&self, i: usize) -> bool {
        self.overflow.get(i).copied().unwrap_or(false)
    }

    /// Name of pool `i`, shared (empty when there is no such pool).
    pub fn pool_name_shared(&self, i: usize) -> Arc<str> {
        self.pool_names
            .get(i)
            .cloned()
            .unwrap_or_else(|| Arc::from(""))
    }

    /// The `/v1/models` body: OpenAI's list format with vLLM's `root`/`parent` fields, and
    /// Anthropic's fields (module docs).
    pub fn models_json(&self) -> &str {
        &self.models_json
    }

    /// The `/v1/models/{id}` body for a served model, adapter or alias.
    pub fn model_json(&self, id: &str) -> Option<&str> {
        self.model_json.get(id).map(String::as_str)
    }

    /// The answer to a `GET` under the models path: status and JSON body. An unknown model is
    /// 404 `model_not_found`, in the shape of the API whose client asked (`anthropic_version`:
    /// the request carries `anthropic-version`).
    pub fn models_answer(&self, q: &ModelsQuery, anthropic_version: bool) -> (u16, Cow<'_, str>) {
        match q {
            ModelsQuery::List => (200, Cow::Borrowed(self.models_json())),
            ModelsQuery::One(id) => match self.model_json(id) {
                Some(j) => (200, Cow::Borrowed(j)),
                None => {
                    let e = ApiError::model_not_found(id);
                    (
                        e.status,
                        Cow::Owned(e.body(ErrorStyle::for_shared_path(anthropic_version))),
                    )
                }
            },
        }
    }
}

fn card<'a>(id: &'a str, root: &'a str, parent: Option<&'a str>) -> ModelCard<'a> {
    ModelCard {
        id,
        object: "model",
        created: 0,
        owned_by: "gpuroute",
        root,
        parent,
        kind: "model",
        display_name: id,
        created_at: "1970-01-01T00:00:00Z",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(json: &str) -> RoutingTable {
        RoutingTable::new(&FilterConfig::from_json(json.as_bytes()).unwrap())
    }

    /// The ids `/v1/models` lists, in order.
    fn listed_ids(t: &RoutingTable) -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(t.models_json()).unwrap();
        v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap().to_string())
            .collect()
    }

    fn target<'a>(t: &'a RoutingTable, model: Option<&str>) -> &'a Arc<Target> {
        match t.resolve(model).unwrap() {
            Resolved::Target(t) => t,
            Resolved::Split(s) => panic!("{model:?} is the split {:?}", s.name),
        }
    }

    /// [`every_build_picks_the_same_targets`]: the chat split's picks of 10,000 keys, folded.
    const DIGEST: u64 = 0xf1b0_52f8_23d7_35ee;

    const SPLIT_CFG: &str = r#"{"pools":[
        {"name":"llama","models":["llama-3-8b"],"adapters":["sql-v1","sql-v2"]},
        {"name":"llama-next","models":["llama-3.1-8b"]}],
        "splits":{"sql":[{"model":"sql-v1","weight":90},{"model":"sql-v2","weight":10}],
                  "chat":[{"model":"llama-3-8b","weight":1},{"model":"llama-3.1-8b","weight":3},
                          {"model":"sql-v2","weight":0}]}}"#;

    fn split<'a>(t: &'a RoutingTable, name: &str) -> &'a Arc<Split> {
        match t.resolve(Some(name)).unwrap() {
            Resolved::Split(s) => s,
            Resolved::Target(_) => panic!("{name} is not a split"),
        }
    }

    #[test]
    fn a_split_divides_keys_by_weight_and_rewrites_to_its_targets() {
        let t = table(SPLIT_CFG);
        let chat = split(&t, "chat");
        let mut counts = [0usize; 3];
        let n = 40_000;
        for i in 0..n {
            let key = chat.key(format!("conversation {i}").as_bytes());
            let (ti, target) = chat.pick(key).unwrap();
            counts[ti] += 1;
            assert!(target.rewrite);
            // The same key always gets the same target.
            assert_eq!(chat.pick(key).unwrap().0, ti);
        }
        // Weights 1 : 3 : 0; a binomial share of 1/4 over 40,000 has a standard deviation of
        // ~0.0022, so 0.24-0.26 is ~4.6 of them.
        let share = counts[0] as f64 / n as f64;
        assert!((0.24..0.26).contains(&share), "{counts:?}");
        assert_eq!(counts[2], 0, "a weight of 0 drains its target");
        // The first key that takes target `i`.
        let taking = |s: &Split, i: usize| {
            (0..1_000u64)
                .map(|k| s.pick(k).unwrap())
                .find(|(j, _)| *j == i)
                .map(|(_, t)| Arc::clone(t))
                .unwrap()
        };
        let first = taking(chat, 0);
        assert_eq!((first.pool, first.model.as_str()), (0, "llama-3-8b"));
        let second = taking(chat, 1);
        assert_eq!((second.pool, second.model.as_str()), (1, "llama-3.1-8b"));
        // Adapters keep their base model and pool.
        let sql = split(&t, "sql");
        let v2 = taking(sql, 1);
        assert_eq!(sql.target_name(1), "sql-v2");
        assert_eq!(
            (v2.adapter.as_deref(), v2.base_model.as_str(), v2.rewrite),
            (Some("sql-v2"), "llama-3-8b", true)
        );
        // The served names themselves are not rewritten.
        assert!(!target(&t, Some("sql-v2")).rewrite);
        // Two splits divide the same texts independently (their own seeds).
        assert_ne!(sql.key(b"same text"), chat.key(b"same text"));
    }

    /// Split `s` over `targets` (served name, weight), each a model of one pool.
    fn split_of(targets: &[(&str, u32)]) -> Split {
        let models: Vec<String> = targets.iter().map(|(m, _)| format!("{m:?}")).collect();
        let list: Vec<String> = targets
            .iter()
            .map(|(m, w)| format!(r#"{{"model":"{m}","weight":{w}}}"#))
            .collect();
        let cfg = format!(
            r#"{{"pools":[{{"name":"p","models":[{}]}}],"splits":{{"s":[{}]}}}}"#,
            models.join(","),
            list.join(",")
        );
        let t = table(&cfg);
        Split::clone(split(&t, "s"))
    }

    #[test]
    fn changing_two_weights_moves_only_the_share_that_changed_hands() {
        let (before, after) = (
            split_of(&[("v1", 95), ("v2", 5)]),
            split_of(&[("v1", 90), ("v2", 10)]),
        );
        let mut moved = 0;
        for i in 0..20_000 {
            let key = before.key(format!("c{i}").as_bytes());
            let (was, now) = (before.pick(key).unwrap().0, after.pick(key).unwrap().0);
            if was != now {
                assert_eq!((was, now), (0, 1), "only v1 -> v2 moves");
                moved += 1;
            }
        }
        // A twentieth (1,000 expected; a standard deviation of ~31).
        assert!((850..1150).contains(&moved), "{moved}");
    }

    /// With three targets and more: a weight change moves keys only to or from the target whose
    /// weight changed; a new target only takes keys; the order of the targets does not matter.
    #[test]
    fn with_any_number_of_targets_only_the_changed_target_gains_or_loses_keys() {
        let name = |s: &Split, key: u64| s.target_name(s.pick(key).unwrap().0).to_string();
        let base = split_of(&[("a", 50), ("b", 30), ("c", 20)]);
        let cases: [(&[(&str, u32)], &str); 4] = [
            // c from 20 to 40: keys only move a -> c and b -> c.
            (&[("a", 50), ("b", 30), ("c", 40)], "c"),
            // a from 50 to 10: keys only leave a.
            (&[("a", 10), ("b", 30), ("c", 20)], "a"),
            // d added: keys only go to d.
            (&[("a", 50), ("b", 30), ("c", 20), ("d", 25)], "d"),
            // The same weights in another order: nothing moves (no target changed).
            (&[("c", 20), ("a", 50), ("b", 30)], ""),
        ];
        let n = 20_000;
        for (targets, changed) in cases {
            let after = split_of(targets);
            let mut moved = 0usize;
            for i in 0..n {
                let key = base.key(format!("c{i}").as_bytes());
                let (was, now) = (name(&base, key), name(&after, key));
                if was != now {
                    assert!(
                        was == changed || now == changed,
                        "{targets:?}: {was} -> {now} does not involve {changed:?}"
                    );
                    moved += 1;
                }
            }
            // The shares that changed hands: c 20/100 -> 40/120 (a third of the keys minus a
            // fifth: 2,667 expected), a 50/100 -> 10/60 (6,667), d 0 -> 25/125 (4,000).
            let expected: usize = match changed {
                "c" => 2_667,
                "a" => 6_667,
                "d" => 4_000,
                _ => 0,
            };
            let tolerance = if expected == 0 { 0 } else { 400 };
            assert!(
                moved.abs_diff(expected) <= tolerance,
                "{targets:?}: {moved} moved, {expected} expected"
            );
        }
    }

    /// The picks depend only on the key and the configuration, in every build: the filter
    /// (wasm32, its `ln` from wasi-libc) and the dynamic module (native, the system's) must send
    /// a conversation to the same version. The digest was taken natively; `make wasm-test` runs
    /// this compiled to wasm32.
    #[test]
    fn every_build_picks_the_same_targets() {
        let t = table(SPLIT_CFG);
        let chat = split(&t, "chat");
        let mut digest = 0u64;
        for i in 0..10_000u64 {
            let key = chat.key(format!("conversation {i}").as_bytes());
            let (j, _) = chat.pick(key).unwrap();
            digest = xxh64(&[j as u8], digest);
        }
        assert_eq!(digest, DIGEST, "{digest:#x}");
    }

    #[test]
    fn a_target_that_cannot_serve_passes_its_keys_to_the_others_by_weight() {
        let t = table(
            r#"{"pools":[{"name":"p","models":["a","b","c","d"]}],
                "splits":{"s":[{"model":"a","weight":1},{"model":"b","weight":2},
                               {"model":"c","weight":1},{"model":"d","weight":0}]}}"#,
        );
        let s = split(&t, "s");
        let n = 20_000;
        let mut moved_to = [0usize; 4];
        for i in 0..n {
            let key = s.key(format!("c{i}").as_bytes());
            let (own, _) = s.pick(key).unwrap();
            // Everything serving: the plain pick, nothing moved.
            let (j, _, rerouted) = s.pick_serving(key, |_| true).unwrap();
            assert_eq!((j, rerouted), (own, false));
            // b is down: its keys move to a or c (never to d, weight 0); the others stay.
            let (j, target, rerouted) = s.pick_serving(key, |t| t.model != "b").unwrap();
            if own == 1 {
                assert!(rerouted && target.model != "b" && j != 3, "{j}");
                moved_to[j] += 1;
            } else {
                assert_eq!((j, rerouted), (own, false));
            }
            // Nothing else serves either: the key keeps its own target (fail open there).
            let (j, _, rerouted) = s.pick_serving(key, |_| false).unwrap();
            assert_eq!((j, rerouted), (own, false));
        }
        // b held half the keys; a and c (weights 1 : 1) take about half of them each.
        let moved = moved_to[0] + moved_to[2];
        assert!((9_500..10_500).contains(&moved), "{moved_to:?}");
        let share = moved_to[0] as f64 / moved as f64;
        assert!((0.46..0.54).contains(&share), "{moved_to:?}");
    }

    #[test]
    fn splits_are_listed_as_models_of_their_first_targets_base() {
        let t = table(SPLIT_CFG);
        let one: serde_json::Value = serde_json::from_str(t.model_json("sql").unwrap()).unwrap();
        assert_eq!(
            (&one["id"], &one["root"]),
            (&serde_json::json!("sql"), &serde_json::json!("llama-3-8b"))
        );
        let ids = listed_ids(&t);
        assert_eq!(
            ids,
            [
                "llama-3-8b",
                "sql-v1",
                "sql-v2",
                "llama-3.1-8b",
                "chat",
                "sql"
            ]
        );
    }

    const CFG: &str = r#"{"pools":[
        {"name":"llama","models":["llama-3-8b"],"aliases":{"llama":"llama-3-8b"},"adapters":["sql-lora"]},
        {"name":"qwen","models":["qwen-7b","qwen-7b-instruct"]}],
        "default_pool":"qwen"}"#;

    #[test]
    fn resolves_models_aliases_and_adapters() {
        let t = table(CFG);
        let m = target(&t, Some("llama-3-8b"));
        assert_eq!((m.pool, m.rewrite, m.adapter.as_deref()), (0, false, None));
        let a = target(&t, Some("llama"));
        assert_eq!(
            (a.pool, a.model.as_str(), a.rewrite),
            (0, "llama-3-8b", true)
        );
        let l = target(&t, Some("sql-lora"));
        assert_eq!(l.pool, 0);
        assert_eq!(l.base_model, "llama-3-8b");
        assert_eq!(l.adapter.as_deref(), Some("sql-lora"));
        assert_eq!(target(&t, Some("qwen-7b-instruct")).pool, 1);
        assert_eq!(t.pool_name(1), "qwen");
    }

    #[test]
    fn unknown_model_is_404_and_missing_model_uses_default_pool() {
        let t = table(CFG);
        assert_eq!(t.resolve(Some("gpt-4")).unwrap_err().status, 404);
        assert_eq!(target(&t, None).pool, 1);
        let no_default = table(r#"{"pools":[{"name":"p","models":["m"]}]}"#);
        let err = no_default.resolve(None).unwrap_err();
        assert_eq!((err.status, err.param), (400, Some("model")));
    }

    #[test]
    fn model_list_names_every_served_model() {
        let t = table(CFG);
        let v: serde_json::Value = serde_json::from_str(t.models_json()).unwrap();
        assert_eq!(v["object"], "list");
        let ids = listed_ids(&t);
        assert_eq!(
            ids,
            [
                "llama-3-8b",
                "llama",
                "sql-lora",
                "qwen-7b",
                "qwen-7b-instruct"
            ]
        );
        let lora = &v["data"][2];
        assert_eq!(lora["parent"], "llama-3-8b");
        assert_eq!(lora["object"], "model");
        // Anthropic's fields, on the list and on each model.
        assert_eq!(
            (&v["has_more"], &v["first_id"], &v["last_id"]),
            (
                &serde_json::json!(false),
                &serde_json::json!("llama-3-8b"),
                &serde_json::json!("qwen-7b-instruct")
            )
        );
        assert_eq!(
            (&lora["type"], &lora["display_name"], &lora["created_at"]),
            (
                &serde_json::json!("model"),
                &serde_json::json!("sql-lora"),
                &serde_json::json!("1970-01-01T00:00:00Z")
            )
        );
        // Each model alone is the list's object for it.
        for card in v["data"].as_array().unwrap() {
            let one: serde_json::Value =
                serde_json::from_str(t.model_json(card["id"].as_str().unwrap()).unwrap()).unwrap();
            assert_eq!(&one, card);
        }
        assert_eq!(t.model_json("gpt-4"), None);
        let empty = table(r#"{"pools":[]}"#);
        let v: serde_json::Value = serde_json::from_str(empty.models_json()).unwrap();
        assert_eq!(
            (v["data"].as_array().unwrap().len(), &v["first_id"]),
            (0, &serde_json::Value::Null)
        );
    }

    #[test]
    fn models_paths_list_or_name_one_model() {
        use ModelsQuery::{List, One};
        let q = |p| ModelsQuery::of(p, "/v1/models");
        assert_eq!(q("/v1/models"), Some(List));
        assert_eq!(q("/v1/models/"), Some(List));
        assert_eq!(q("/v1/models/llama"), Some(One("llama".into())));
        // A model name with a slash, as sent raw and percent-encoded.
        let name = "meta-llama/Llama-3.1-8B-Instruct";
        assert_eq!(
            q("/v1/models/meta-llama/Llama-3.1-8B-Instruct"),
            Some(One(name.into()))
        );
        assert_eq!(
            q("/v1/models/meta-llama%2FLlama-3.1-8B-Instruct"),
            Some(One(name.into()))
        );
        assert_eq!(q("/v1/models/a%2fb"), Some(One("a/b".into())));
        // Malformed escapes and non-UTF-8 results are kept as they came.
        assert_eq!(q("/v1/models/a%2"), Some(One("a%2".into())));
        assert_eq!(q("/v1/models/a%zz%"), Some(One("a%zz%".into())));
        assert_eq!(q("/v1/models/%ff"), Some(One("%ff".into())));
        assert_eq!(q("/v1/modelsx"), None);
        assert_eq!(q("/v1/chat/completions"), None);
        assert_eq!(ModelsQuery::of("/v1/models", ""), None);
    }

    #[test]
    fn an_unknown_model_is_404_in_the_asking_apis_shape() {
        let t = table(CFG);
        let (status, body) = t.models_answer(&ModelsQuery::One("sql-lora".into()), false);
        assert_eq!(
            (status, body.as_ref()),
            (200, t.model_json("sql-lora").unwrap())
        );
        let (status, body) = t.models_answer(&ModelsQuery::One("gpt-4".into()), false);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (status, &v["error"]["code"]),
            (404, &serde_json::json!("model_not_found"))
        );
        let (status, body) = t.models_answer(&ModelsQuery::One("gpt-4".into()), true);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            (status, &v["type"], &v["error"]["type"]),
            (
                404,
                &serde_json::json!("error"),
                &serde_json::json!("not_found_error")
            )
        );
        assert_eq!(t.models_answer(&ModelsQuery::List, true).1, t.models_json());
    }
}
