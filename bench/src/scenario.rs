//! Benchmark scenarios and the workload SPEC the load generator accepts.
//!
//! A scenario file (`bench/scenarios/<name>.json`) drives one benchmark: its `fleet` part
//! is fleet-sim's fleet file, passed through untouched; its `workload` part is a
//! [`WorkloadConfig`]; `quick` shortens it for `make bench-quick`; `targets` are the
//! figures the issue asks to reach, checked by the report.
//!
//! A SPEC (`loadgen --workload SPEC`) is one of:
//! - a scenario name (`mixed-gpu`, looked up in `bench/scenarios/`) or scenario file;
//! - a JSON file holding a [`WorkloadConfig`], or the JSON itself (starting with `{`);
//! - a trace file (Azure CSV or Mooncake JSONL, auto-detected);
//! - `poisson:rate=R,duration=D[,prompt=N][,output=N][,models=a|b|c][,zipf=S][,seed=N]`.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::workload::{
    LengthDist, ModelMix, Overrides, PoissonWorkload, TraceWorkload, WorkloadConfig,
};

/// Where scenario files live, relative to the repository root.
pub const SCENARIO_DIR: &str = "bench/scenarios";

/// A benchmark scenario: a fleet and a workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// Scenario name (the file's stem).
    pub name: String,
    /// What it shows and why it is set up this way.
    #[serde(default)]
    pub description: String,
    /// fleet-sim's fleet file (`{"seed":..,"time_scale":..,"engine":..,"pods":[..]}`).
    pub fleet: serde_json::Value,
    /// The traffic.
    pub workload: WorkloadConfig,
    /// Settings that replace the workload's for the quick variant.
    #[serde(default)]
    pub quick: Option<QuickOverrides>,
    /// The figures to reach, as (config / baseline) ratios.
    #[serde(default)]
    pub targets: Vec<Target>,
    /// Settings of the fleet's pools in the filter's configuration (`pools[]`), by pool name,
    /// over what the fleet gives each (its name, models and adapters): `failover` and
    /// `overflow`, `scoring`, or `"models": []` for a standby pool that only a failover list
    /// reaches. The benchmark's stack (`scripts/stack.py`) and the offline replay both apply
    /// them, the baselines' body-based routing included.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub pools: serde_json::Map<String, serde_json::Value>,
}

/// The quick variant's replacements.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuickOverrides {
    /// Sending duration (wall seconds).
    #[serde(default)]
    pub duration_s: Option<f64>,
    /// Request cap.
    #[serde(default)]
    pub max_requests: Option<usize>,
    /// Drain limit for the quick run (loadgen's `--max-drain-s` when not given): a quick
    /// run proves the pipeline, it need not wait for an overloaded baseline's queue.
    #[serde(default)]
    pub max_drain_s: Option<f64>,
}

/// A figure to reach: `metric` of `config` divided by the same metric of `baseline`
/// (or by the workload's ideal prefix reuse when `baseline` is `ideal_prefix_reuse`)
/// must lie within [`min_ratio`, `max_ratio`].
///
/// [`min_ratio`]: Target::min_ratio
/// [`max_ratio`]: Target::max_ratio
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// The figure as the issue states it.
    pub figure: String,
    /// `ttft_ms.p50|p90|p95|p99`, `e2e_ms.*`, `output_tokens_per_s`, `prefix_hit_rate`,
    /// `adapter_loads`, `errors`.
    pub metric: String,
    /// The configuration measured (usually `filter`).
    pub config: String,
    /// The configuration compared with, or `ideal_prefix_reuse`.
    pub baseline: String,
    /// Largest allowed ratio.
    #[serde(default)]
    pub max_ratio: Option<f64>,
    /// Smallest allowed ratio.
    #[serde(default)]
    pub min_ratio: Option<f64>,
}

/// Why a SPEC or scenario could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// File path.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// A JSON file or inline JSON is not a scenario or workload.
    #[error("{what}: {source}")]
    Json {
        /// What was being read.
        what: String,
        /// Underlying error.
        source: serde_json::Error,
    },
    /// A `poisson:` shorthand is malformed.
    #[error("bad poisson spec: {0}")]
    Shorthand(String),
    /// Nothing matches the SPEC.
    #[error("workload spec {0:?} is neither a scenario name, a JSON file, a trace file nor a poisson: spec")]
    NotFound(String),
}

/// A SPEC resolved to a workload.
#[derive(Debug, Clone)]
pub struct ResolvedSpec {
    /// The workload to build.
    pub config: WorkloadConfig,
    /// Directory relative trace paths are also resolved from.
    pub base_dir: Option<PathBuf>,
    /// The scenario, when the SPEC named one.
    pub scenario: Option<Scenario>,
}

impl Scenario {
    /// Reads a scenario file.
    pub fn load(path: &Path) -> Result<Self, SpecError> {
        let text = read(path)?;
        serde_json::from_str(&text).map_err(|source| SpecError::Json {
            what: path.display().to_string(),
            source,
        })
    }

    /// The workload, with the quick variant's replacements when `quick`.
    pub fn workload_config(&self, quick: bool) -> WorkloadConfig {
        match (&self.quick, quick) {
            (Some(q), true) => self.workload.clone().with_overrides(&Overrides {
                duration_s: q.duration_s,
                max_requests: q.max_requests,
                ..Overrides::default()
            }),
            _ => self.workload.clone(),
        }
    }

    /// The drain limit of the quick variant, when `quick`.
    pub fn max_drain_s(&self, quick: bool) -> Option<f64> {
        self.quick
            .as_ref()
            .filter(|_| quick)
            .and_then(|q| q.max_drain_s)
    }

    /// The fleet's time-scale factor, if it sets one.
    pub fn time_scale(&self) -> Option<f64> {
        self.fleet
            .get("time_scale")
            .and_then(serde_json::Value::as_f64)
    }

    /// Every model and adapter name the fleet serves.
    pub fn fleet_models(&self) -> Vec<String> {
        let mut names = Vec::new();
        for pod in self
            .fleet
            .get("pods")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
        {
            if let Some(m) = pod.get("model").and_then(serde_json::Value::as_str) {
                names.push(m.to_string());
            }
            for a in pod
                .get("adapters")
                .and_then(serde_json::Value::as_array)
                .into_iter()
                .flatten()
            {
                if let Some(a) = a.as_str() {
                    names.push(a.to_string());
                }
            }
        }
        names.sort();
        names.dedup();
        names
    }

    /// One line describing the fleet: `2x h100 (llama-8b) + 2x a100 (llama-8b)`.
    pub fn fleet_summary(&self) -> String {
        fleet_summary(&self.fleet)
    }
}

/// One line describing a fleet-sim fleet file.
pub fn fleet_summary(fleet: &serde_json::Value) -> String {
    let parts: Vec<String> = fleet
        .get("pods")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .map(|p| {
            let s = |k: &str| p.get(k).and_then(serde_json::Value::as_str).unwrap_or("?");
            let count = p
                .get("count")
                .and_then(serde_json::Value::as_u64)
                .unwrap_or(1);
            let adapters = p
                .get("adapters")
                .and_then(serde_json::Value::as_array)
                .map_or(0, Vec::len);
            let mut d = format!("{count}x {} ({}", s("gpu"), s("pool"));
            if adapters > 0 {
                let slots = p.get("max_loras").and_then(serde_json::Value::as_u64);
                d.push_str(&format!(", {adapters} adapters"));
                if let Some(slots) = slots {
                    d.push_str(&format!(", {slots} slots"));
                }
            }
            d.push(')');
            d
        })
        .collect();
    parts.join(" + ")
}

fn read(path: &Path) -> Result<String, SpecError> {
    std::fs::read_to_string(path).map_err(|source| SpecError::Io {
        path: path.display().to_string(),
        source,
    })
}

/// Candidate locations of scenario `name`: the current directory's `bench/scenarios`
/// and `scenarios`, then this crate's own `scenarios` directory.
pub fn scenario_candidates(name: &str) -> Vec<PathBuf> {
    let file = format!("{name}.json");
    vec![
        Path::new(SCENARIO_DIR).join(&file),
        Path::new("scenarios").join(&file),
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("scenarios")
            .join(&file),
    ]
}

/// Resolves a SPEC (see the module docs). `model` replaces the default model of a bare
/// trace file or `poisson:` spec; `quick` selects a scenario's quick variant.
pub fn resolve_spec(
    spec: &str,
    model: Option<&str>,
    quick: bool,
) -> Result<ResolvedSpec, SpecError> {
    let spec = spec.trim();
    if spec.starts_with('{') {
        let config = serde_json::from_str(spec).map_err(|source| SpecError::Json {
            what: "inline workload".into(),
            source,
        })?;
        return Ok(ResolvedSpec {
            config,
            base_dir: None,
            scenario: None,
        });
    }
    if let Some(rest) = spec.strip_prefix("poisson:") {
        return Ok(ResolvedSpec {
            config: WorkloadConfig::Poisson(parse_poisson(rest, model)?),
            base_dir: None,
            scenario: None,
        });
    }
    let path = Path::new(spec);
    let path = if path.exists() {
        path.to_path_buf()
    } else {
        scenario_candidates(spec)
            .into_iter()
            .find(|p| p.exists())
            .ok_or_else(|| SpecError::NotFound(spec.to_string()))?
    };
    let base_dir = path.parent().map(Path::to_path_buf);
    if path.extension().is_some_and(|e| e == "json") {
        let text = read(&path)?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|source| SpecError::Json {
                what: path.display().to_string(),
                source,
            })?;
        let what = path.display().to_string();
        if value.get("workload").is_some() {
            let scenario: Scenario =
                serde_json::from_value(value).map_err(|source| SpecError::Json { what, source })?;
            return Ok(ResolvedSpec {
                config: scenario.workload_config(quick),
                base_dir,
                scenario: Some(scenario),
            });
        }
        let config =
            serde_json::from_value(value).map_err(|source| SpecError::Json { what, source })?;
        return Ok(ResolvedSpec {
            config,
            base_dir,
            scenario: None,
        });
    }
    // anything else is a trace file, format detected when it is read
    let mut models = ModelMix::default();
    if let Some(m) = model {
        models.names = vec![m.to_string()];
    }
    Ok(ResolvedSpec {
        config: WorkloadConfig::Trace(TraceWorkload {
            file: path,
            name: None,
            models,
            api: Default::default(),
            seed: 1,
            speedup: None,
            rate_per_s: None,
            start_s: 0.0,
            duration_s: None,
            max_requests: None,
            token_scale: 1.0,
            output_scale: 1.0,
            max_output_tokens: None,
            max_prompt_tokens: None,
        }),
        base_dir: None,
        scenario: None,
    })
}

fn parse_poisson(rest: &str, model: Option<&str>) -> Result<PoissonWorkload, SpecError> {
    let mut p = PoissonWorkload {
        name: None,
        rate_per_s: 0.0,
        duration_s: 10.0,
        max_requests: None,
        seed: 1,
        api: Default::default(),
        models: ModelMix::default(),
        prompt_tokens: Some(LengthDist::Fixed { value: 256 }),
        output_tokens: Some(LengthDist::Fixed { value: 64 }),
        lengths_from_trace: None,
        max_output_tokens: None,
        token_scale: 1.0,
        shared_prefix: None,
        choices: None,
        bursts: None,
    };
    if let Some(m) = model {
        p.models.names = vec![m.to_string()];
    }
    let num = |k: &str, v: &str| -> Result<f64, SpecError> {
        v.parse::<f64>()
            .map_err(|_| SpecError::Shorthand(format!("{k}={v} is not a number")))
    };
    for kv in rest.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| SpecError::Shorthand(format!("{kv:?} is not key=value")))?;
        match k.trim() {
            "rate" => p.rate_per_s = num(k, v)?,
            "duration" => p.duration_s = num(k, v)?,
            "prompt" => {
                p.prompt_tokens = Some(LengthDist::Fixed {
                    value: num(k, v)? as u64,
                })
            }
            "output" => {
                p.output_tokens = Some(LengthDist::Fixed {
                    value: num(k, v)? as u64,
                })
            }
            "seed" => p.seed = num(k, v)? as u64,
            "max" => p.max_requests = Some(num(k, v)? as usize),
            "zipf" => p.models.zipf_s = Some(num(k, v)?),
            "models" => p.models.names = v.split('|').map(str::to_string).collect(),
            "api" => {
                p.api = serde_json::from_value(serde_json::Value::String(v.to_string()))
                    .map_err(|_| SpecError::Shorthand(format!("api={v}: chat or completions")))?
            }
            other => return Err(SpecError::Shorthand(format!("unknown key {other}"))),
        }
    }
    if p.rate_per_s <= 0.0 {
        return Err(SpecError::Shorthand("rate=R (> 0) is required".into()));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::Workload;

    fn scenario_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
    }

    fn all_scenarios() -> Vec<(PathBuf, Scenario)> {
        scenarios_in(&scenario_dir())
    }

    fn scenarios_in(dir: &Path) -> Vec<(PathBuf, Scenario)> {
        let mut v: Vec<(PathBuf, Scenario)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|e| e == "json"))
            .map(|p| {
                let s = Scenario::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
                (p, s)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    #[test]
    fn the_scenarios_exist_and_are_consistent() {
        let scenarios = all_scenarios();
        let names: Vec<&str> = scenarios.iter().map(|(_, s)| s.name.as_str()).collect();
        for want in [
            "burst-pool",
            "bursty",
            "mixed-gpu",
            "multi-lora",
            "shared-prefix",
            "uniform-steady",
        ] {
            assert!(names.contains(&want), "missing scenario {want}");
        }
        for (path, s) in &scenarios {
            consistent(path, s);
            assert!(!s.targets.is_empty(), "{}: targets", s.name);
        }
    }

    /// The experiments (`bench/experiments`) hold to the same rules, without targets.
    #[test]
    fn the_experiments_are_consistent() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("experiments");
        let experiments = scenarios_in(&dir);
        assert!(!experiments.is_empty());
        for (path, s) in &experiments {
            consistent(path, s);
        }
    }

    fn consistent(path: &Path, s: &Scenario) {
        assert_eq!(
            path.file_stem().unwrap().to_str().unwrap(),
            s.name,
            "file name = scenario name"
        );
        let served = s.fleet_models();
        for quick in [false, true] {
            let cfg = s.workload_config(quick);
            let w = Workload::build(&cfg, path.parent()).unwrap();
            assert!(!w.requests.is_empty(), "{} builds no requests", s.name);
            // about 40 s per configuration; quick well under that
            let limit = if quick { 15.0 } else { 60.0 };
            assert!(
                w.info.schedule_span_s <= limit,
                "{}: {}",
                s.name,
                w.info.schedule_span_s
            );
            for r in &w.requests {
                assert!(
                    served.contains(&r.model),
                    "{}: {} not served",
                    s.name,
                    r.model
                );
            }
        }
        assert!(
            s.time_scale().is_some(),
            "{}: fleet sets time_scale",
            s.name
        );
        // Its pools' settings name pools of the fleet, and make a configuration the filter
        // accepts.
        let (_, fleet) = crate::floor::scenario_parts(s, path, true).unwrap();
        if let Err(e) = crate::replay::filter_config(&fleet, &s.pools, &serde_json::Value::Null) {
            panic!("{}: {e}", s.name);
        }
    }

    #[test]
    fn spec_forms_resolve() {
        let r = resolve_spec(
            "poisson:rate=5,duration=2,prompt=100,models=a|b,zipf=1",
            None,
            false,
        )
        .unwrap();
        match r.config {
            WorkloadConfig::Poisson(p) => {
                assert_eq!(p.rate_per_s, 5.0);
                assert_eq!(p.models.names, vec!["a", "b"]);
                assert_eq!(p.prompt_tokens, Some(LengthDist::Fixed { value: 100 }));
            }
            other => panic!("{other:?}"),
        }
        assert!(resolve_spec("poisson:duration=2", None, false).is_err());
        assert!(resolve_spec("poisson:rate=1,bogus=2", None, false).is_err());

        let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/traces/azure-llm-2023-conv.csv");
        let r = resolve_spec(trace.to_str().unwrap(), Some("m"), false).unwrap();
        assert!(matches!(r.config, WorkloadConfig::Trace(ref t) if t.models.names == vec!["m"]));

        let inline = r#"{"kind":"poisson","rate_per_s":1,"duration_s":1,
            "prompt_tokens":{"dist":"fixed","value":1},"output_tokens":{"dist":"fixed","value":1}}"#;
        assert!(matches!(
            resolve_spec(inline, None, false).unwrap().config,
            WorkloadConfig::Poisson(_)
        ));
        assert!(matches!(
            resolve_spec("no-such-thing", None, false),
            Err(SpecError::NotFound(_))
        ));

        let sc = scenario_dir().join("mixed-gpu.json");
        let full = resolve_spec(sc.to_str().unwrap(), None, false).unwrap();
        let quick = resolve_spec(sc.to_str().unwrap(), None, true).unwrap();
        assert!(full.scenario.is_some());
        assert_ne!(full.config, quick.config);
    }

    #[test]
    fn unknown_scenario_fields_are_rejected() {
        let text = r#"{"name":"x","fleet":{},"workload":{"kind":"poisson","rate_per_s":1,"duration_s":1,
            "prompt_tokens":{"dist":"fixed","value":1},"output_tokens":{"dist":"fixed","value":1}},"typo":1}"#;
        assert!(serde_json::from_str::<Scenario>(text).is_err());
    }

    #[test]
    fn fleet_summary_names_counts_gpus_and_pools() {
        let fleet = serde_json::json!({"pods": [
            {"name":"h","count":2,"pool":"p","gpu":"h100"},
            {"name":"a","count":1,"pool":"p","gpu":"a10g","adapters":["x","y"],"max_loras":1}]});
        assert_eq!(
            fleet_summary(&fleet),
            "2x h100 (p) + 1x a10g (p, 2 adapters, 1 slots)"
        );
    }
}
