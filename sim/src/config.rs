//! The fleet file (`FLEET.json`), the built-in `demo` preset, and their resolution into
//! per-pod engine configurations. The file format is a contract other tools depend on: field
//! names are stable, unknown fields are rejected with their name, and every optional field has a
//! documented default.

use std::collections::HashSet;
use std::path::Path;

use serde::Deserialize;

use crate::engine::{EngineConfig, EngineKind};
use crate::error::ConfigError;
use crate::profiles::{self, GpuProfile, ModelProfile, GPU_MEMORY_UTILIZATION};

/// vLLM's default `max_num_seqs`.
pub const DEFAULT_MAX_NUM_SEQS: u32 = 256;
/// vLLM v1's default `max_num_batched_tokens` for the OpenAI server with chunked prefill.
pub const DEFAULT_MAX_NUM_BATCHED_TOKENS: u32 = 8192;
/// vLLM's default KV block size in tokens.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;
/// vLLM's default `max_loras` when LoRA is enabled.
pub const DEFAULT_MAX_LORAS: u32 = 1;
/// Time to load one LoRA adapter into a GPU slot, milliseconds. Public measurements of
/// adapter loads span tens of milliseconds for a warm local file (Hugging Face PEFT issue #981:
/// 24-70 ms per `load_adapter`) to 0.5-1 s for an unoptimised per-layer copy (LoRAX issue #433);
/// 25 ms takes the low end, the case of a server with adapters on local disk.
pub const DEFAULT_LORA_LOAD_MS: f64 = 25.0;
/// Wall milliseconds between SSE chunks of one stream after its first token.
pub const DEFAULT_STREAM_INTERVAL_MS: f64 = 20.0;

/// The top level of a fleet file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetFile {
    /// Seed of every random choice (default 1).
    #[serde(default)]
    pub seed: Option<u64>,
    /// Simulated seconds per wall second (default 1).
    #[serde(default)]
    pub time_scale: Option<f64>,
    /// Default engine flavour of pods (default `vllm`).
    #[serde(default)]
    pub engine: Option<EngineKind>,
    /// Wall milliseconds between coalesced SSE chunks (default 20).
    #[serde(default)]
    pub stream_interval_ms: Option<f64>,
    /// Pod groups.
    pub pods: Vec<PodSpec>,
}

/// One pod group in a fleet file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodSpec {
    /// Pod name; with `count`, pods are named `name-0`, `name-1`, ...
    pub name: String,
    /// Number of identical pods (absent: one pod named exactly `name`).
    #[serde(default)]
    pub count: Option<u32>,
    /// Pool (routing group) the pods belong to.
    pub pool: String,
    /// Served base model name.
    pub model: String,
    /// GPU profile key (`h100`, `a100`, `l40s`, `a10g`).
    pub gpu: String,
    /// LoRA adapters served on top of the base model (default none).
    #[serde(default)]
    pub adapters: Vec<String>,
    /// LoRA GPU slots (default 1 when there are adapters, vLLM's default).
    #[serde(default)]
    pub max_loras: Option<u32>,
    /// Maximum running sequences (default 256).
    #[serde(default)]
    pub max_num_seqs: Option<u32>,
    /// Token budget per step (default 8192).
    #[serde(default)]
    pub max_num_batched_tokens: Option<u32>,
    /// KV block size in tokens (default 16).
    #[serde(default)]
    pub block_size: Option<u32>,
    /// Fraction of GPU memory vLLM may use (default 0.9).
    #[serde(default)]
    pub gpu_memory_utilization: Option<f64>,
    /// Fixed KV-cache size in blocks, like vLLM's `num_gpu_blocks_override` (default: derived
    /// from the GPU and model).
    #[serde(default)]
    pub num_gpu_blocks: Option<u32>,
    /// Port on 127.0.0.1 (default 0 = any free port; with `count`, pod i gets `port + i`).
    #[serde(default)]
    pub port: Option<u16>,
    /// Engine flavour (default: the file's `engine`).
    #[serde(default)]
    pub engine: Option<EngineKind>,
    /// Speed multiplier on the GPU profile (default 1.0; 2.0 = twice as fast).
    #[serde(default)]
    pub speed: Option<f64>,
    /// Adapter load time in milliseconds of simulated time (default 25).
    #[serde(default)]
    pub lora_load_ms: Option<f64>,
    /// Architecture profile key, when the model name does not identify one.
    #[serde(default)]
    pub arch: Option<String>,
    /// Prefix caching (default true, vLLM v1's default).
    #[serde(default)]
    pub enable_prefix_caching: Option<bool>,
}

/// A resolved pod.
#[derive(Debug, Clone)]
pub struct PodConfig {
    /// Pod name.
    pub name: String,
    /// Pool.
    pub pool: String,
    /// Served base model name.
    pub model: String,
    /// GPU profile key.
    pub gpu_key: String,
    /// Adapters.
    pub adapters: Vec<String>,
    /// Port (0 = any).
    pub port: u16,
    /// `gpu_memory_utilization` (reported in `cache_config_info`).
    pub gpu_memory_utilization: f64,
    /// The engine's configuration.
    pub engine: EngineConfig,
}

/// A resolved fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    /// Seed of random choices.
    pub seed: u64,
    /// Simulated seconds per wall second.
    pub time_scale: f64,
    /// Pods, in file order.
    pub pods: Vec<PodConfig>,
}

/// Command-line overrides of file values.
#[derive(Debug, Clone, Copy, Default)]
pub struct Overrides {
    /// `--seed`.
    pub seed: Option<u64>,
    /// `--time-scale`.
    pub time_scale: Option<f64>,
}

impl FleetFile {
    /// Reads and parses a fleet file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text)
    }

    /// Parses fleet JSON.
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        Ok(serde_json::from_str(text)?)
    }

    /// A built-in fleet by name.
    pub fn preset(name: &str) -> Result<Self, ConfigError> {
        match name {
            "demo" => Self::parse(DEMO_PRESET),
            other => Err(ConfigError::UnknownPreset(other.to_string())),
        }
    }

    /// Resolves defaults, profiles and capacities.
    pub fn resolve(&self, ov: Overrides) -> Result<FleetConfig, ConfigError> {
        let invalid = |pod: &str, message: String| ConfigError::Invalid {
            pod: pod.to_string(),
            message,
        };
        let seed = ov.seed.or(self.seed).unwrap_or(1);
        let time_scale = ov.time_scale.or(self.time_scale).unwrap_or(1.0);
        if !(time_scale.is_finite() && time_scale > 0.0) {
            return Err(invalid(
                "fleet",
                format!("time_scale must be > 0, got {time_scale}"),
            ));
        }
        let stream_ms = self
            .stream_interval_ms
            .unwrap_or(DEFAULT_STREAM_INTERVAL_MS);
        if !(stream_ms.is_finite() && stream_ms >= 0.0) {
            return Err(invalid(
                "fleet",
                format!("stream_interval_ms must be >= 0, got {stream_ms}"),
            ));
        }
        if self.pods.is_empty() {
            return Err(invalid("fleet", "no pods".to_string()));
        }
        let mut pods = Vec::new();
        let mut names = HashSet::new();
        for spec in &self.pods {
            let gpu = profiles::gpu(&spec.gpu)?;
            let arch = profiles::model(&spec.model, spec.arch.as_deref())?;
            let n = spec.count.unwrap_or(1);
            if n == 0 {
                return Err(invalid(&spec.name, "count must be >= 1".to_string()));
            }
            for i in 0..n {
                let name = match spec.count {
                    Some(_) => format!("{}-{i}", spec.name),
                    None => spec.name.clone(),
                };
                if !names.insert(name.clone()) {
                    return Err(invalid(&name, "duplicate pod name".to_string()));
                }
                let port = match spec.port.unwrap_or(0) {
                    0 => 0,
                    p => u16::try_from(u32::from(p) + i)
                        .map_err(|_| invalid(&name, format!("port {p} + {i} is out of range")))?,
                };
                let engine = resolve_engine(spec, &name, gpu, arch, self, time_scale, stream_ms)?;
                pods.push(PodConfig {
                    name,
                    pool: spec.pool.clone(),
                    model: spec.model.clone(),
                    gpu_key: gpu.name.to_string(),
                    adapters: spec.adapters.clone(),
                    port,
                    gpu_memory_utilization: spec
                        .gpu_memory_utilization
                        .unwrap_or(GPU_MEMORY_UTILIZATION),
                    engine,
                });
            }
        }
        Ok(FleetConfig {
            seed,
            time_scale,
            pods,
        })
    }
}

fn resolve_engine(
    spec: &PodSpec,
    name: &str,
    gpu: &'static GpuProfile,
    arch: &'static ModelProfile,
    file: &FleetFile,
    time_scale: f64,
    stream_ms: f64,
) -> Result<EngineConfig, ConfigError> {
    let invalid = |message: String| ConfigError::Invalid {
        pod: name.to_string(),
        message,
    };
    let mut seen = HashSet::new();
    for a in &spec.adapters {
        if a.is_empty() || a == &spec.model || !seen.insert(a.as_str()) {
            return Err(invalid(format!(
                "adapter name `{a}` is empty, repeated or the base model"
            )));
        }
    }
    if spec.adapters.len() > usize::from(u16::MAX) {
        return Err(invalid("too many adapters".to_string()));
    }
    let max_loras = if spec.adapters.is_empty() {
        0
    } else {
        let m = spec.max_loras.unwrap_or(DEFAULT_MAX_LORAS);
        if m == 0 {
            return Err(invalid(
                "max_loras must be >= 1 when adapters are served".to_string(),
            ));
        }
        m
    };
    let speed = spec.speed.unwrap_or(1.0);
    if !(speed.is_finite() && speed > 0.0) {
        return Err(invalid(format!("speed must be > 0, got {speed}")));
    }
    let util = spec
        .gpu_memory_utilization
        .unwrap_or(GPU_MEMORY_UTILIZATION);
    if !(util > 0.0 && util <= 1.0) {
        return Err(invalid(format!(
            "gpu_memory_utilization must be in (0, 1], got {util}"
        )));
    }
    let block_size = spec.block_size.unwrap_or(DEFAULT_BLOCK_SIZE);
    if block_size == 0 {
        return Err(invalid("block_size must be >= 1".to_string()));
    }
    let max_num_seqs = spec.max_num_seqs.unwrap_or(DEFAULT_MAX_NUM_SEQS);
    let max_batched = spec
        .max_num_batched_tokens
        .unwrap_or(DEFAULT_MAX_NUM_BATCHED_TOKENS);
    if max_num_seqs == 0 || max_batched == 0 {
        return Err(invalid(
            "max_num_seqs and max_num_batched_tokens must be >= 1".to_string(),
        ));
    }
    let lora_ms = spec.lora_load_ms.unwrap_or(DEFAULT_LORA_LOAD_MS);
    if !(lora_ms.is_finite() && lora_ms >= 0.0) {
        return Err(invalid(format!("lora_load_ms must be >= 0, got {lora_ms}")));
    }
    let num_gpu_blocks = match spec.num_gpu_blocks {
        Some(b) => b,
        None => profiles::num_gpu_blocks(gpu, arch, util, block_size),
    };
    if num_gpu_blocks == 0 {
        return Err(ConfigError::DoesNotFit {
            pod: name.to_string(),
            model: spec.model.clone(),
            gpu: gpu.name.to_string(),
        });
    }
    Ok(EngineConfig {
        gpu,
        model: arch,
        speed,
        time_scale,
        block_size,
        num_gpu_blocks,
        max_num_seqs: max_num_seqs as usize,
        max_num_batched_tokens: max_batched,
        max_loras: max_loras as usize,
        lora_load_ns: (lora_ms * 1e6).round() as u64,
        enable_prefix_caching: spec.enable_prefix_caching.unwrap_or(true),
        // wall interval -> simulated interval
        stream_interval_ns: (stream_ms * 1e6 * time_scale).round() as u64,
        kind: spec.engine.or(file.engine).unwrap_or(EngineKind::Vllm),
    })
}

/// The `demo` preset used by `make run`: two LLM pools, fast and slow pods, three adapters; and a
/// Whisper pool for audio uploads.
/// H100 and L40S differ by 2.7x in compute and 3.9x in memory bandwidth (datasheets), about 3x
/// overall.
pub const DEMO_PRESET: &str = r#"{
  "seed": 1, "time_scale": 1, "engine": "vllm",
  "pods": [
    {"name": "llama-h100", "count": 2, "pool": "llama-8b", "model": "meta-llama/Llama-3.1-8B-Instruct",
     "gpu": "h100", "adapters": ["sql-lora", "chat-lora", "summarize-lora"], "max_loras": 2, "port": 18001},
    {"name": "llama-l40s", "count": 2, "pool": "llama-8b", "model": "meta-llama/Llama-3.1-8B-Instruct",
     "gpu": "l40s", "adapters": ["sql-lora", "chat-lora", "summarize-lora"], "max_loras": 2, "port": 18003},
    {"name": "qwen-h100", "count": 1, "pool": "qwen-7b", "model": "Qwen/Qwen2.5-7B-Instruct",
     "gpu": "h100", "port": 18005},
    {"name": "qwen-l40s", "count": 1, "pool": "qwen-7b", "model": "Qwen/Qwen2.5-7B-Instruct",
     "gpu": "l40s", "port": 18006},
    {"name": "whisper-l40s", "count": 2, "pool": "whisper", "model": "openai/whisper-large-v3",
     "gpu": "l40s", "port": 18007}
  ]
}"#;

/// The demo preset's admin address.
pub const DEMO_ADMIN: &str = "127.0.0.1:18000";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn count_expands_names_and_ports() {
        let f = FleetFile::parse(
            r#"{"seed": 3, "time_scale": 10, "pods": [
                {"name": "h100", "count": 2, "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct",
                 "gpu": "h100", "adapters": ["sql-lora"], "max_loras": 2, "port": 0, "engine": "sglang", "speed": 1.5},
                {"name": "solo", "pool": "p", "model": "Qwen/Qwen2.5-7B-Instruct", "gpu": "a100", "port": 9100}]}"#,
        )
        .unwrap();
        let c = f.resolve(Overrides::default()).unwrap();
        let names: Vec<_> = c.pods.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["h100-0", "h100-1", "solo"]);
        assert_eq!(c.seed, 3);
        assert_eq!(c.pods[0].engine.kind, EngineKind::Sglang);
        assert_eq!(c.pods[0].engine.max_loras, 2);
        assert_eq!(c.pods[2].engine.max_loras, 0);
        assert_eq!(c.pods[2].port, 9100);
        assert_eq!(c.pods[0].engine.stream_interval_ns, 200_000_000);
        let c = f
            .resolve(Overrides {
                seed: Some(9),
                time_scale: Some(2.0),
            })
            .unwrap();
        assert_eq!((c.seed, c.time_scale), (9, 2.0));
    }

    #[test]
    fn unknown_fields_are_named() {
        let err = FleetFile::parse(
            r#"{"pods": [{"name": "a", "pool": "p", "model": "m", "gpu": "h100", "gpus": 2}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("gpus"), "{err}");
        let err = FleetFile::parse(r#"{"pods": [], "sed": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("sed"), "{err}");
    }

    #[test]
    fn bad_values_are_rejected() {
        let bad = |pods: &str| {
            FleetFile::parse(&format!(r#"{{"pods": [{pods}]}}"#))
                .unwrap()
                .resolve(Overrides::default())
                .unwrap_err()
                .to_string()
        };
        let base = r#""name": "a", "pool": "p", "model": "meta-llama/Llama-3.1-8B-Instruct""#;
        assert!(bad(&format!(r#"{{{base}, "gpu": "v100"}}"#)).contains("v100"));
        assert!(bad(&format!(r#"{{{base}, "gpu": "h100", "speed": 0}}"#)).contains("speed"));
        assert!(bad(&format!(
            r#"{{{base}, "gpu": "h100", "adapters": ["x"], "max_loras": 0}}"#
        ))
        .contains("max_loras"));
        assert!(bad(&format!(
            r#"{{{base}, "gpu": "h100"}}, {{{base}, "gpu": "h100"}}"#
        ))
        .contains("duplicate"));
        let big = r#"{"name": "a", "pool": "p", "model": "Qwen/Qwen3-32B", "gpu": "a10g"}"#;
        assert!(bad(big).contains("no KV-cache memory"));
    }

    #[test]
    fn shipped_fleet_files_resolve() {
        for (file, pods) in [
            (include_str!("../fleets/example.json"), 2),
            (include_str!("../fleets/mixed-gpu.json"), 4),
            (include_str!("../fleets/multi-lora.json"), 4),
            (include_str!("../fleets/sglang.json"), 2),
        ] {
            let c = FleetFile::parse(file)
                .unwrap()
                .resolve(Overrides::default())
                .unwrap();
            assert_eq!(c.pods.len(), pods);
        }
    }

    #[test]
    fn demo_preset_has_eight_pods_on_fixed_ports() {
        let c = FleetFile::preset("demo")
            .unwrap()
            .resolve(Overrides::default())
            .unwrap();
        let ports: Vec<_> = c.pods.iter().map(|p| p.port).collect();
        assert_eq!(
            ports,
            [18001, 18002, 18003, 18004, 18005, 18006, 18007, 18008]
        );
        assert_eq!(c.pods.iter().filter(|p| p.pool == "whisper").count(), 2);
        assert_eq!(c.pods.iter().filter(|p| p.pool == "llama-8b").count(), 4);
        assert!(c.pods[0].adapters.contains(&"summarize-lora".to_string()));
        assert!(FleetFile::preset("nope").is_err());
    }
}
