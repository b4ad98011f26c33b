//! Model -> pool resolution (body-based routing) and the gateway's own `/v1/models` answer.
//!
//! The table is built once from the configuration; a lookup is one hash-map probe.

use crate::config::FilterConfig;
use crate::error::ApiError;
use crate::idmap::NameMap;
use serde::Serialize;
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
}

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: Vec<ModelCard<'a>>,
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
            data: cards,
        })
        .unwrap_or_else(|_| r#"{"object":"list","data":[]}"#.to_string());
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

    /// The `/v1/models` body, OpenAI's list format with vLLM's `root`/`parent` fields.
    pub fn models_json(&self) -> &str {
        &self.models_json
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
    }
}
