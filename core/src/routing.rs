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
use serde::Serialize;
use std::borrow::Cow;
use std::sync::Arc;

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
    /// The client used an alias: the body's `model` must be rewritten to `model`.
    pub rewrite: bool,
}

/// Every name the gateway serves.
#[derive(Debug, Clone)]
pub struct RoutingTable {
    /// Shared, so a request takes its target without copying its strings.
    by_name: NameMap<String, Arc<Target>>,
    pool_names: Vec<String>,
    default_target: Option<Arc<Target>>,
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
                base_model: m,
                adapter: None,
                rewrite: false,
            }))
        });
        RoutingTable {
            by_name,
            pool_names: cfg.pools.iter().map(|p| p.name.clone()).collect(),
            default_target,
            models_json,
            model_json,
        }
    }

    /// Resolves the body's `model` (None when absent) to its pool.
    pub fn resolve(&self, model: Option<&str>) -> Result<&Arc<Target>, ApiError> {
        match model {
            Some(m) => self
                .by_name
                .get(m)
                .ok_or_else(|| ApiError::model_not_found(m)),
            None => self
                .default_target
                .as_ref()
                .ok_or_else(ApiError::missing_model),
        }
    }

    /// Name of pool `i`.
    pub fn pool_name(&self, i: usize) -> &str {
        self.pool_names.get(i).map(String::as_str).unwrap_or("")
    }

    /// Pool names in configuration order.
    pub fn pool_names(&self) -> &[String] {
        &self.pool_names
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

    const CFG: &str = r#"{"pools":[
        {"name":"llama","models":["llama-3-8b"],"aliases":{"llama":"llama-3-8b"},"adapters":["sql-lora"]},
        {"name":"qwen","models":["qwen-7b","qwen-7b-instruct"]}],
        "default_pool":"qwen"}"#;

    #[test]
    fn resolves_models_aliases_and_adapters() {
        let t = table(CFG);
        let m = t.resolve(Some("llama-3-8b")).unwrap();
        assert_eq!((m.pool, m.rewrite, m.adapter.as_deref()), (0, false, None));
        let a = t.resolve(Some("llama")).unwrap();
        assert_eq!(
            (a.pool, a.model.as_str(), a.rewrite),
            (0, "llama-3-8b", true)
        );
        let l = t.resolve(Some("sql-lora")).unwrap();
        assert_eq!(l.pool, 0);
        assert_eq!(l.base_model, "llama-3-8b");
        assert_eq!(l.adapter.as_deref(), Some("sql-lora"));
        assert_eq!(t.resolve(Some("qwen-7b-instruct")).unwrap().pool, 1);
        assert_eq!(t.pool_name(1), "qwen");
    }

    #[test]
    fn unknown_model_is_404_and_missing_model_uses_default_pool() {
        let t = table(CFG);
        assert_eq!(t.resolve(Some("gpt-4")).unwrap_err().status, 404);
        assert_eq!(t.resolve(None).unwrap().pool, 1);
        let no_default = table(r#"{"pools":[{"name":"p","models":["m"]}]}"#);
        let err = no_default.resolve(None).unwrap_err();
        assert_eq!((err.status, err.param.as_deref()), (400, Some("model")));
    }

    #[test]
    fn model_list_names_every_served_model() {
        let t = table(CFG);
        let v: serde_json::Value = serde_json::from_str(t.models_json()).unwrap();
        assert_eq!(v["object"], "list");
        let ids: Vec<_> = v["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["id"].as_str().unwrap())
            .collect();
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
