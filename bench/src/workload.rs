//! Workloads: lists of timed requests, built from a trace file or a synthetic scenario.
//!
//! A workload is what the load generator replays open-loop: at time `at_s` after the
//! start, send a chat or completions request for model M with prompt P and
//! `max_tokens` N. The same [`WorkloadConfig`] and seed always build the same list, so
//! every router configuration of a benchmark sees identical traffic.
//!
//! Prompt text is not stored: a [`PromptSpec`] says how to make it (unique filler, or
//! hash blocks), and the runner expands it just before the request is due. A full
//! Mooncake replay would otherwise hold ~250 MB of text.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::rng::{SplitMix64, Zipf};
use crate::text::{self, CHARS_PER_TOKEN};
use crate::trace::{self, Trace, TraceError, TraceFormat, MOONCAKE_BLOCK_TOKENS};

/// The model requests go to when a workload names none: the 8B pool of the default fleet.
pub const DEFAULT_MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// The OpenAI endpoint a request uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `POST /v1/chat/completions` with one user message.
    #[default]
    Chat,
    /// `POST /v1/completions` with a `prompt`.
    Completions,
}

impl Api {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
        }
    }
}

/// Which models requests name, and how often each.
///
/// Weights win over `zipf_s`; with neither, the choice is uniform. With `zipf_s = s`, the
/// k-th name is chosen with probability proportional to 1/k^s (adapter popularity).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelMix {
    /// Model (or LoRA adapter) names, most popular first for Zipf.
    pub names: Vec<String>,
    /// Zipf exponent over the names' ranks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zipf_s: Option<f64>,
    /// Explicit relative weights, one per name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<Vec<f64>>,
}

impl Default for ModelMix {
    fn default() -> Self {
        Self {
            names: vec![DEFAULT_MODEL.to_string()],
            zipf_s: None,
            weights: None,
        }
    }
}

impl ModelMix {
    fn chooser(&self) -> Result<Zipf, WorkloadError> {
        if self.names.is_empty() {
            return Err(WorkloadError::Invalid("models.names is empty".into()));
        }
        match &self.weights {
            Some(w) if w.len() != self.names.len() => Err(WorkloadError::Invalid(format!(
                "models.weights has {} entries for {} names",
                w.len(),
                self.names.len()
            ))),
            Some(w) => Ok(Zipf::weighted(w.iter().copied())),
            None => Ok(Zipf::new(self.names.len(), self.zipf_s.unwrap_or(0.0))),
        }
    }
}

/// A distribution of token counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "snake_case", deny_unknown_fields)]
pub enum LengthDist {
    /// Always `value`.
    Fixed {
        /// Token count.
        value: u64,
    },
    /// Uniform on `min..=max`.
    Uniform {
        /// Smallest count.
        min: u64,
        /// Largest count.
        max: u64,
    },
    /// Log-normal with the given median and log-space sigma, clamped to `min..=max`
    /// (prompt and output lengths of production traces are roughly log-normal).
    Lognormal {
        /// Median token count.
        median: f64,
        /// Standard deviation of ln(count).
        sigma: f64,
        /// Lower clamp.
        min: u64,
        /// Upper clamp.
        max: u64,
    },
}

impl LengthDist {
    /// One draw.
    pub fn sample(&self, rng: &mut SplitMix64) -> u64 {
        match *self {
            LengthDist::Fixed { value } => value,
            LengthDist::Uniform { min, max } => {
                let (lo, hi) = (min.min(max), min.max(max));
                lo + rng.below(hi - lo + 1)
            }
            LengthDist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                let v = (median.max(1.0).ln() + sigma * rng.standard_normal()).exp();
                (v.round() as u64).clamp(min.min(max), max.max(min))
            }
        }
    }
}

/// A shared system prompt for synthetic workloads: each request starts with one of
/// `groups` prompts of `tokens` tokens (chosen with Zipf exponent `zipf_s`), followed by
/// its own unique text. Models llm-d's "shared system prompt" benchmark.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedPrefix {
    /// Number of distinct shared prompts.
    pub groups: u64,
    /// Length of each shared prompt in tokens.
    pub tokens: u64,
    /// Zipf exponent of group popularity (0 = uniform).
    #[serde(default)]
    pub zipf_s: f64,
}

/// Replay of a trace file (Azure CSV or Mooncake JSONL, auto-detected).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceWorkload {
    /// The trace file; a relative path is looked up from the current directory, then from
    /// the scenario file's directory and its parents.
    pub file: PathBuf,
    /// Name for the report (defaults to the file name).
    #[serde(default)]
    pub name: Option<String>,
    /// Models requests name.
    #[serde(default)]
    pub models: ModelMix,
    /// Endpoint used.
    #[serde(default)]
    pub api: Api,
    /// Seed for model choice and filler text.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Replay speed: trace seconds per wall second. Default: from `rate_per_s`, else fit
    /// the slice into `duration_s`, else 1 (real time).
    #[serde(default)]
    pub speedup: Option<f64>,
    /// Without `speedup`: replay at the speed that makes the slice's mean arrival rate
    /// this many requests per wall second (the trace's burstiness is kept around it).
    /// The natural knob for "load the fleet to X% of its capacity".
    #[serde(default)]
    pub rate_per_s: Option<f64>,
    /// Trace time (seconds after its first request) to start replaying from.
    #[serde(default)]
    pub start_s: f64,
    /// Wall seconds of sending; requests due later are cut.
    #[serde(default)]
    pub duration_s: Option<f64>,
    /// At most this many requests.
    #[serde(default)]
    pub max_requests: Option<usize>,
    /// Prompt tokens are multiplied by this (so long prompts fit the machine).
    #[serde(default = "one")]
    pub token_scale: f64,
    /// Output tokens are multiplied by this.
    #[serde(default = "one")]
    pub output_scale: f64,
    /// Cap on max_tokens after scaling.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// Cap on prompt tokens after scaling (Azure only; Mooncake prompts keep their blocks).
    #[serde(default)]
    pub max_prompt_tokens: Option<u64>,
}

/// Poisson arrivals at a fixed rate with drawn lengths and a model mix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoissonWorkload {
    /// Name for the report.
    #[serde(default)]
    pub name: Option<String>,
    /// Mean arrivals per wall second.
    pub rate_per_s: f64,
    /// Wall seconds of sending.
    pub duration_s: f64,
    /// At most this many requests.
    #[serde(default)]
    pub max_requests: Option<usize>,
    /// Seed of arrivals, lengths, models and text.
    #[serde(default = "default_seed")]
    pub seed: u64,
    /// Endpoint used.
    #[serde(default)]
    pub api: Api,
    /// Models requests name.
    #[serde(default)]
    pub models: ModelMix,
    /// Prompt length in tokens (before `token_scale`); required without
    /// `lengths_from_trace`.
    #[serde(default)]
    pub prompt_tokens: Option<LengthDist>,
    /// max_tokens; required without `lengths_from_trace`.
    #[serde(default)]
    pub output_tokens: Option<LengthDist>,
    /// Draw each request's (prompt, output) lengths together from a random row of this
    /// trace file, keeping the trace's joint length distribution (replaces the two
    /// distributions above).
    #[serde(default)]
    pub lengths_from_trace: Option<PathBuf>,
    /// Cap on max_tokens.
    #[serde(default)]
    pub max_output_tokens: Option<u64>,
    /// Prompt tokens are multiplied by this.
    #[serde(default = "one")]
    pub token_scale: f64,
    /// Optional shared system prompts.
    #[serde(default)]
    pub shared_prefix: Option<SharedPrefix>,
    /// The choices (`n`) each request asks for, drawn from this mix; absent: one.
    #[serde(default)]
    pub choices: Option<ChoiceMix>,
    /// Bursts on top of the Poisson arrivals.
    #[serde(default)]
    pub bursts: Option<Bursts>,
}

/// How many choices (`n`) requests ask for: `values[i]` with relative weight `weights[i]`
/// (an evaluation mixing greedy answers with pass@k sampling, an RL rollout's group size).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChoiceMix {
    pub values: Vec<u32>,
    pub weights: Vec<f64>,
}

impl ChoiceMix {
    fn chooser(&self) -> Result<Zipf, WorkloadError> {
        if self.values.is_empty() || self.values.len() != self.weights.len() {
            return Err(WorkloadError::Invalid(
                "choices: values and weights must be non-empty and as many".into(),
            ));
        }
        if self.values.contains(&0) || !self.weights.iter().all(|w| w.is_finite() && *w >= 0.0) {
            return Err(WorkloadError::Invalid(
                "choices: values must be at least 1, weights finite and not negative".into(),
            ));
        }
        Ok(Zipf::weighted(self.weights.iter().copied()))
    }
}

/// Requests that arrive together: every `every_s` wall seconds (the first at `every_s`),
/// `size` of them at once, drawn as the Poisson arrivals are (a batch job's fan-out).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bursts {
    pub every_s: f64,
    pub size: usize,
}

fn one() -> f64 {
    1.0
}

fn default_seed() -> u64 {
    1
}

/// What to replay: a trace or a synthetic scenario (`"kind"` selects).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadConfig {
    /// A trace file.
    Trace(TraceWorkload),
    /// Poisson arrivals.
    Poisson(PoissonWorkload),
}

/// Command-line overrides of a workload's settings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Overrides {
    /// Replaces the seed.
    pub seed: Option<u64>,
    /// Trace: replay speed. Poisson: multiplies the rate.
    pub speedup: Option<f64>,
    /// Replaces the sending duration (wall seconds).
    pub duration_s: Option<f64>,
    /// Replaces the prompt token scale.
    pub token_scale: Option<f64>,
    /// Replaces the request cap.
    pub max_requests: Option<usize>,
    /// Trace: mean arrival rate to replay at (used when no speedup is given).
    /// Poisson: replaces the rate.
    pub rate_per_s: Option<f64>,
}

impl WorkloadConfig {
    /// This config with the overrides applied.
    pub fn with_overrides(mut self, o: &Overrides) -> Self {
        match &mut self {
            WorkloadConfig::Trace(t) => {
                if let Some(s) = o.seed {
                    t.seed = s;
                }
                if o.speedup.is_some() {
                    t.speedup = o.speedup;
                }
                if o.duration_s.is_some() {
                    t.duration_s = o.duration_s;
                }
                if let Some(s) = o.token_scale {
                    t.token_scale = s;
                }
                if o.max_requests.is_some() {
                    t.max_requests = o.max_requests;
                }
                if o.rate_per_s.is_some() {
                    t.rate_per_s = o.rate_per_s;
                    // an explicit rate replaces the config's own speedup, unless the
                    // command line also gives one
                    t.speedup = o.speedup;
                }
            }
            WorkloadConfig::Poisson(p) => {
                if let Some(s) = o.seed {
                    p.seed = s;
                }
                if let Some(r) = o.rate_per_s {
                    p.rate_per_s = r;
                }
                if let Some(s) = o.speedup {
                    p.rate_per_s *= s;
                }
                if let Some(d) = o.duration_s {
                    p.duration_s = d;
                }
                if let Some(s) = o.token_scale {
                    p.token_scale = s;
                }
                if o.max_requests.is_some() {
                    p.max_requests = o.max_requests;
                }
            }
        }
        self
    }

    /// The `k`-th other workload of the same kind, for measuring over many workloads: a
    /// Poisson workload with its seed plus `k` (`None` for `k < 0`); a trace replayed from `k`
    /// windows later, or earlier for `k < 0` (each window the trace time one run replays:
    /// `duration_s` at its `speedup`, 1 without one), with its seed plus `|k|` for its model
    /// choice and filler text;
    /// `None` where that window would start before the trace. A trace that ends within the
    /// window gives fewer requests, or none. `k = 0` is this workload.
    pub fn other(self, k: i64) -> Option<Self> {
        if k == 0 {
            return Some(self);
        }
        match self {
            WorkloadConfig::Trace(mut t) => {
                let window = t.duration_s.unwrap_or(0.0) * t.speedup.unwrap_or(1.0);
                t.start_s += k as f64 * window;
                t.seed = t.seed.wrapping_add(k.unsigned_abs());
                (t.start_s >= 0.0).then_some(WorkloadConfig::Trace(t))
            }
            WorkloadConfig::Poisson(mut p) => {
                p.seed = p.seed.wrapping_add(u64::try_from(k).ok()?);
                Some(WorkloadConfig::Poisson(p))
            }
        }
    }

    /// The models requests of this workload name.
    pub fn models(&self) -> &ModelMix {
        match self {
            WorkloadConfig::Trace(t) => &t.models,
            WorkloadConfig::Poisson(p) => &p.models,
        }
    }
}

/// Why a workload could not be built.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The trace file could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The trace file was not found.
    #[error("trace file {0} not found")]
    NotFound(String),
    /// A setting is out of range.
    #[error("invalid workload: {0}")]
    Invalid(String),
}

/// How to make a request's prompt text.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSpec {
    /// Unique filler text.
    Filler {
        /// Run seed.
        seed: u64,
        /// Request id (unique within the workload).
        id: u64,
        /// Length in characters.
        chars: usize,
    },
    /// Hash blocks expanded with [`text::expand_hash_ids`].
    Blocks {
        /// Block ids.
        ids: Vec<u64>,
        /// Characters of every block but the last.
        block_chars: usize,
        /// Characters of the last block.
        last_chars: usize,
    },
    /// A shared prefix block followed by unique filler.
    Prefixed {
        /// The shared prompt's block id.
        group: u64,
        /// Its length in characters.
        prefix_chars: usize,
        /// Run seed.
        seed: u64,
        /// Request id.
        id: u64,
        /// Length of the unique part in characters.
        chars: usize,
    },
}

impl PromptSpec {
    /// The prompt text.
    pub fn text(&self) -> String {
        match self {
            PromptSpec::Filler { seed, id, chars } => text::filler(*seed, *id, *chars),
            PromptSpec::Blocks {
                ids,
                block_chars,
                last_chars,
            } => text::expand_hash_ids(ids, *block_chars, *last_chars),
            PromptSpec::Prefixed {
                group,
                prefix_chars,
                seed,
                id,
                chars,
            } => {
                // the group id space is offset so shared prompts never equal trace blocks
                let mut s = text::block_text(group | (1 << 63), *prefix_chars);
                s.push_str(&text::filler(*seed, *id, *chars));
                s
            }
        }
    }

    /// Length of the text in characters.
    pub fn chars(&self) -> usize {
        match self {
            PromptSpec::Filler { chars, .. } => *chars,
            PromptSpec::Blocks {
                ids,
                block_chars,
                last_chars,
            } => block_chars * ids.len().saturating_sub(1) + last_chars,
            PromptSpec::Prefixed {
                prefix_chars,
                chars,
                ..
            } => prefix_chars + chars,
        }
    }
}

/// One request of a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct TimedRequest {
    /// Seconds after the run's start at which it must be sent.
    pub at_s: f64,
    /// Endpoint.
    pub api: Api,
    /// `model` field.
    pub model: String,
    /// Prompt.
    pub prompt: PromptSpec,
    /// `max_tokens`.
    pub max_tokens: u64,
    /// `n`: the choices asked for (sent when above one).
    pub n: u32,
}

impl TimedRequest {
    /// The streaming request body (OpenAI format, with vLLM's `ignore_eos` so a real
    /// server generates exactly `max_tokens` tokens, as the trace says it did).
    pub fn body(&self) -> Vec<u8> {
        let prompt = self.prompt.text();
        let mut v = serde_json::json!({
            "model": self.model,
            "max_tokens": self.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": 0.0,
            "ignore_eos": true,
        });
        match self.api {
            Api::Chat => {
                v["messages"] = serde_json::json!([{"role": "user", "content": prompt}]);
            }
            Api::Completions => v["prompt"] = serde_json::Value::String(prompt),
        }
        if self.n > 1 {
            v["n"] = self.n.into();
        }
        // serialising a Value of plain strings and numbers cannot fail
        serde_json::to_vec(&v).unwrap_or_default()
    }
}

/// What a built workload is, for the results and the report.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkloadInfo {
    /// Workload name.
    pub name: String,
    /// `trace` or `poisson`.
    pub kind: String,
    /// Trace file name replayed (Poisson: the file lengths are drawn from), if any.
    pub source: Option<String>,
    /// Trace format, if any.
    pub format: Option<TraceFormat>,
    /// Seed.
    pub seed: u64,
    /// Trace seconds per wall second (Poisson: 1).
    pub speedup: f64,
    /// Prompt token scale.
    pub token_scale: f64,
    /// Output token scale.
    pub output_scale: f64,
    /// Wall seconds from the first to the last scheduled send.
    pub schedule_span_s: f64,
    /// Requested sending duration (wall seconds), if any.
    pub duration_s: Option<f64>,
    /// Requests scheduled.
    pub request_count: usize,
    /// Requests per wall second offered (count / schedule span).
    pub offered_rate_per_s: f64,
    /// Rows in the whole trace.
    pub trace_rows: Option<usize>,
    /// Trace time where the replayed slice starts.
    pub trace_start_s: Option<f64>,
    /// Trace seconds the replayed slice covers.
    pub trace_slice_span_s: Option<f64>,
    /// Ideal prefix reuse of the whole trace (share of repeated blocks).
    pub ideal_prefix_reuse_full: Option<f64>,
    /// Ideal prefix reuse of the replayed slice.
    pub ideal_prefix_reuse_slice: Option<f64>,
    /// Mean prompt length sent, in tokens (characters / 4).
    pub mean_prompt_tokens: f64,
    /// Mean max_tokens sent.
    pub mean_output_tokens: f64,
    /// Models named.
    pub models: Vec<String>,
}

/// A list of timed requests plus its description.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Requests, sorted by `at_s`.
    pub requests: Vec<TimedRequest>,
    /// Description.
    pub info: WorkloadInfo,
}

/// Finds a relative trace path from the current directory or from `base` and its parents.
pub fn resolve_path(file: &Path, base: Option<&Path>) -> Option<PathBuf> {
    if file.is_absolute() || file.exists() {
        return file.exists().then(|| file.to_path_buf());
    }
    let mut dir = base.map(Path::to_path_buf);
    while let Some(d) = dir {
        let candidate = d.join(file);
        if candidate.exists() {
            return Some(candidate);
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    None
}

impl Workload {
    /// Builds the workload. `base` is the directory relative trace paths are also looked
    /// up from (the scenario file's).
    pub fn build(config: &WorkloadConfig, base: Option<&Path>) -> Result<Self, WorkloadError> {
        match config {
            WorkloadConfig::Trace(t) => build_trace(t, base),
            WorkloadConfig::Poisson(p) => build_poisson(p, base),
        }
    }
}

fn positive(name: &str, v: f64) -> Result<f64, WorkloadError> {
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(WorkloadError::Invalid(format!(
            "{name} must be > 0, got {v}"
        )))
    }
}

/// Scales a token count, keeping at least one token.
fn scale_tokens(tokens: u64, scale: f64) -> u64 {
    ((tokens as f64 * scale).round() as u64).max(1)
}

fn build_trace(t: &TraceWorkload, base: Option<&Path>) -> Result<Workload, WorkloadError> {
    let path = resolve_path(&t.file, base)
        .ok_or_else(|| WorkloadError::NotFound(t.file.display().to_string()))?;
    let trace = Trace::load(&path)?;
    let token_scale = positive("token_scale", t.token_scale)?;
    let output_scale = positive("output_scale", t.output_scale)?;
    let chooser = t.models.chooser()?;

    let start = trace.rows.partition_point(|r| r.offset_s < t.start_s);
    let mut slice = &trace.rows[start..];
    if let Some(m) = t.max_requests {
        slice = &slice[..m.min(slice.len())];
    }
    let speedup = match (t.speedup, t.rate_per_s, t.duration_s) {
        (Some(s), _, _) => positive("speedup", s)?,
        (None, Some(rate), _) => {
            // the slice's own mean arrival rate, scaled to the requested one
            let span = trace::span_s(slice);
            if span > 0.0 && slice.len() > 1 {
                positive("rate_per_s", rate)? * span / (slice.len() - 1) as f64
            } else {
                1.0
            }
        }
        (None, None, Some(d)) => {
            let span = trace::span_s(slice);
            if span > 0.0 {
                span / positive("duration_s", d)?
            } else {
                1.0
            }
        }
        (None, None, None) => 1.0,
    };
    let first = slice.first().map_or(0.0, |r| r.offset_s);
    let cut = slice
        .iter()
        .position(|r| {
            t.duration_s
                .is_some_and(|d| (r.offset_s - first) / speedup > d)
        })
        .unwrap_or(slice.len());
    let slice = &slice[..cut];

    let mut model_rng = SplitMix64::derive(t.seed, 3);
    let block_tokens = scale_tokens(MOONCAKE_BLOCK_TOKENS, token_scale);
    let mut requests = Vec::with_capacity(slice.len());
    for (i, row) in slice.iter().enumerate() {
        let id = (start + i) as u64;
        let prompt = if row.hash_ids.is_empty() {
            let mut tokens = scale_tokens(row.input_tokens, token_scale);
            if let Some(cap) = t.max_prompt_tokens {
                tokens = tokens.min(cap.max(1));
            }
            PromptSpec::Filler {
                seed: t.seed,
                id,
                chars: tokens as usize * CHARS_PER_TOKEN,
            }
        } else {
            let n = row.hash_ids.len() as u64;
            let last = row
                .input_tokens
                .saturating_sub((n - 1) * MOONCAKE_BLOCK_TOKENS)
                .clamp(1, MOONCAKE_BLOCK_TOKENS);
            PromptSpec::Blocks {
                ids: row.hash_ids.clone(),
                block_chars: block_tokens as usize * CHARS_PER_TOKEN,
                last_chars: scale_tokens(last, token_scale).min(block_tokens) as usize
                    * CHARS_PER_TOKEN,
            }
        };
        let mut max_tokens = scale_tokens(row.output_tokens, output_scale);
        if let Some(cap) = t.max_output_tokens {
            max_tokens = max_tokens.min(cap.max(1));
        }
        requests.push(TimedRequest {
            at_s: (row.offset_s - first) / speedup,
            api: t.api,
            model: t.models.names[chooser.sample(&mut model_rng)].clone(),
            prompt,
            max_tokens,
            n: 1,
        });
    }
    let source = path.file_name().map(|f| f.to_string_lossy().into_owned());
    let name = t
        .name
        .clone()
        .or_else(|| source.clone())
        .unwrap_or_else(|| "trace".into());
    let info = WorkloadInfo {
        name,
        kind: "trace".into(),
        source,
        format: Some(trace.format),
        seed: t.seed,
        speedup,
        token_scale,
        output_scale,
        duration_s: t.duration_s,
        trace_rows: Some(trace.rows.len()),
        trace_start_s: Some(first),
        trace_slice_span_s: Some(trace::span_s(slice)),
        ideal_prefix_reuse_full: trace::ideal_prefix_reuse(&trace.rows),
        ideal_prefix_reuse_slice: trace::ideal_prefix_reuse(slice),
        models: t.models.names.clone(),
        ..WorkloadInfo::default()
    };
    Ok(finish(requests, info))
}

/// Where a Poisson workload's lengths come from.
enum Lengths {
    Dists(LengthDist, LengthDist),
    Rows(Vec<(u64, u64)>),
}

impl Lengths {
    fn sample(&self, rng: &mut SplitMix64) -> (u64, u64) {
        match self {
            Lengths::Dists(p, o) => (p.sample(rng), o.sample(rng)),
            Lengths::Rows(rows) => {
                let i = rng.below(rows.len() as u64) as usize;
                rows.get(i).copied().unwrap_or((1, 1))
            }
        }
    }
}

fn build_poisson(p: &PoissonWorkload, base: Option<&Path>) -> Result<Workload, WorkloadError> {
    let rate = positive("rate_per_s", p.rate_per_s)?;
    let duration = positive("duration_s", p.duration_s)?;
    let token_scale = positive("token_scale", p.token_scale)?;
    let chooser = p.models.chooser()?;
    let (length_source, length_model) =
        match (&p.lengths_from_trace, &p.prompt_tokens, &p.output_tokens) {
            (Some(file), _, _) => {
                let path = resolve_path(file, base)
                    .ok_or_else(|| WorkloadError::NotFound(file.display().to_string()))?;
                let trace = Trace::load(&path)?;
                let rows = trace
                    .rows
                    .iter()
                    .map(|r| (r.input_tokens, r.output_tokens))
                    .collect();
                let name = path.file_name().map(|f| f.to_string_lossy().into_owned());
                (Lengths::Rows(rows), name)
            }
            (None, Some(pd), Some(od)) => (Lengths::Dists(pd.clone(), od.clone()), None),
            _ => {
                return Err(WorkloadError::Invalid(
                    "poisson needs prompt_tokens and output_tokens, or lengths_from_trace".into(),
                ))
            }
        };
    // separate streams, so changing a length distribution does not move the arrivals
    let mut arrivals = SplitMix64::derive(p.seed, 1);
    let mut lengths = SplitMix64::derive(p.seed, 2);
    let mut models = SplitMix64::derive(p.seed, 3);
    let mut groups = SplitMix64::derive(p.seed, 4);
    let mut choices = SplitMix64::derive(p.seed, 5);
    let group_choice = p
        .shared_prefix
        .as_ref()
        .map(|s| Zipf::new(s.groups.max(1) as usize, s.zipf_s));
    let choice_mix = p.choices.as_ref().map(ChoiceMix::chooser).transpose()?;
    let max = p.max_requests.unwrap_or(usize::MAX);
    // The arrival times: Poisson, then the bursts among them.
    let mut times = Vec::new();
    let mut t = arrivals.exponential(rate);
    while t <= duration {
        times.push(t);
        t += arrivals.exponential(rate);
    }
    if let Some(b) = &p.bursts {
        let every = positive("bursts.every_s", b.every_s)?;
        let mut at = every;
        while at <= duration {
            times.extend(std::iter::repeat_n(at, b.size));
            at += every;
        }
        times.sort_by(f64::total_cmp);
    }
    let mut requests = Vec::new();
    for t in times.into_iter().take(max) {
        let id = requests.len() as u64;
        let (prompt_tokens, output_tokens) = length_source.sample(&mut lengths);
        let tokens = scale_tokens(prompt_tokens, token_scale);
        let mut max_tokens = output_tokens.max(1);
        if let Some(cap) = p.max_output_tokens {
            max_tokens = max_tokens.min(cap.max(1));
        }
        let chars = tokens as usize * CHARS_PER_TOKEN;
        let prompt = match (&p.shared_prefix, &group_choice) {
            (Some(s), Some(z)) => PromptSpec::Prefixed {
                group: z.sample(&mut groups) as u64,
                prefix_chars: scale_tokens(s.tokens, token_scale) as usize * CHARS_PER_TOKEN,
                seed: p.seed,
                id,
                chars,
            },
            _ => PromptSpec::Filler {
                seed: p.seed,
                id,
                chars,
            },
        };
        let n = match (&p.choices, &choice_mix) {
            (Some(mix), Some(z)) => mix.values[z.sample(&mut choices)],
            _ => 1,
        };
        requests.push(TimedRequest {
            at_s: t,
            api: p.api,
            model: p.models.names[chooser.sample(&mut models)].clone(),
            prompt,
            max_tokens,
            n,
        });
    }
    let info = WorkloadInfo {
        name: p
            .name
            .clone()
            .unwrap_or_else(|| format!("poisson-{rate}rps")),
        kind: "poisson".into(),
        source: length_model,
        seed: p.seed,
        speedup: 1.0,
        token_scale,
        output_scale: 1.0,
        duration_s: Some(duration),
        models: p.models.names.clone(),
        ..WorkloadInfo::default()
    };
    Ok(finish(requests, info))
}

/// Fills in the summary figures every workload reports.
fn finish(requests: Vec<TimedRequest>, mut info: WorkloadInfo) -> Workload {
    let n = requests.len();
    info.request_count = n;
    info.schedule_span_s = requests.last().map_or(0.0, |r| r.at_s);
    let span = info.duration_s.unwrap_or(info.schedule_span_s);
    info.offered_rate_per_s = if span > 0.0 { n as f64 / span } else { 0.0 };
    if n > 0 {
        info.mean_prompt_tokens = requests
            .iter()
            .map(|r| r.prompt.chars() as f64 / CHARS_PER_TOKEN as f64)
            .sum::<f64>()
            / n as f64;
        info.mean_output_tokens =
            requests.iter().map(|r| r.max_tokens as f64).sum::<f64>() / n as f64;
    }
    Workload { requests, info }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn testdata(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../testdata/traces")
            .join(name)
    }

    fn trace_cfg(file: &str) -> TraceWorkload {
        TraceWorkload {
            file: testdata(file),
            name: None,
            models: ModelMix::default(),
            api: Api::Chat,
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
        }
    }

    #[test]
    fn azure_replay_scales_time_and_fits_the_duration() {
        let mut c = trace_cfg("azure-llm-2023-conv.csv");
        c.max_requests = Some(200);
        c.duration_s = Some(10.0);
        let w = Workload::build(&WorkloadConfig::Trace(c.clone()), None).unwrap();
        assert_eq!(w.requests.len(), 200);
        // the speedup is chosen so the slice ends exactly at the duration
        assert!((w.info.schedule_span_s - 10.0).abs() < 1e-9);
        assert!(w.info.speedup > 1.0);
        assert!(w.requests.windows(2).all(|p| p[1].at_s >= p[0].at_s));
        // prompt = ContextTokens x 4 chars; max_tokens = GeneratedTokens
        assert_eq!(w.requests[0].prompt.chars(), 374 * 4);
        assert_eq!(w.requests[0].max_tokens, 44);
        assert_eq!(w.requests[0].prompt.text().len(), 374 * 4);

        // with an explicit speedup the duration cuts instead
        // (the trace starts sparse: 200 requests span ~60 s; at 2x, 10 s of wall time covers 20 s)
        c.speedup = Some(2.0);
        let w2 = Workload::build(&WorkloadConfig::Trace(c), None).unwrap();
        assert!(w2.info.schedule_span_s <= 10.0);
        assert!(
            w2.requests.len() < 200 && w2.requests.len() > 20,
            "{}",
            w2.requests.len()
        );
        assert!((w2.requests[1].at_s - 4.314579 / 2.0).abs() < 1e-6);
    }

    #[test]
    fn a_target_rate_sets_the_speedup_from_the_slice() {
        let mut c = trace_cfg("azure-llm-2023-conv.csv");
        c.start_s = 2750.0;
        c.rate_per_s = Some(20.0);
        c.duration_s = Some(30.0);
        let w = Workload::build(&WorkloadConfig::Trace(c), None).unwrap();
        // the remaining trace averages ~4.6 req/s: about 4.3x; the 30 s slice keeps the
        // trace's burstiness, so its own rate is near, not exactly, 20
        assert!(
            w.info.speedup > 3.0 && w.info.speedup < 6.0,
            "{}",
            w.info.speedup
        );
        assert!(
            (w.info.offered_rate_per_s - 20.0).abs() < 6.0,
            "{}",
            w.info.offered_rate_per_s
        );
        let o = Overrides {
            rate_per_s: Some(40.0),
            ..Overrides::default()
        };
        let mut c2 = trace_cfg("azure-llm-2023-conv.csv");
        c2.start_s = 2750.0;
        c2.speedup = Some(1.0);
        c2.duration_s = Some(30.0);
        let w2 = Workload::build(&WorkloadConfig::Trace(c2).with_overrides(&o), None).unwrap();
        assert!((w2.info.speedup / w.info.speedup - 2.0).abs() < 1e-9);
    }

    #[test]
    fn azure_prompts_share_no_prefix() {
        let mut c = trace_cfg("azure-llm-2023-conv.csv");
        c.max_requests = Some(20);
        let w = Workload::build(&WorkloadConfig::Trace(c), None).unwrap();
        let texts: Vec<String> = w.requests.iter().map(|r| r.prompt.text()).collect();
        for (i, a) in texts.iter().enumerate() {
            for b in &texts[i + 1..] {
                let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
                assert!(common < 64, "requests share {common} leading chars");
            }
        }
    }

    #[test]
    fn mooncake_replay_expands_blocks_with_the_token_scale() {
        let mut c = trace_cfg("mooncake-fast25-synthetic.jsonl");
        c.token_scale = 0.125;
        c.max_requests = Some(300);
        let w = Workload::build(&WorkloadConfig::Trace(c), None).unwrap();
        assert_eq!(w.requests.len(), 300);
        // first row: 79 blocks, 40160 tokens -> 78 full blocks of 64 tokens + 224/8 = 28
        let r0 = &w.requests[0];
        assert_eq!(r0.prompt.chars(), (78 * 64 + 28) * 4);
        assert_eq!(r0.prompt.text().len(), r0.prompt.chars());
        let slice = w.info.ideal_prefix_reuse_slice.unwrap();
        let full = w.info.ideal_prefix_reuse_full.unwrap();
        assert!((full - 0.64).abs() < 0.01);
        assert!(slice > 0.0 && slice < 1.0);
    }

    #[test]
    fn mooncake_requests_with_shared_ids_share_leading_text() {
        let c = WorkloadConfig::Trace(TraceWorkload {
            token_scale: 1.0 / 32.0,
            max_requests: Some(400),
            ..trace_cfg("mooncake-fast25-synthetic.jsonl")
        });
        let w = Workload::build(&c, None).unwrap();
        let trace = Trace::load(&testdata("mooncake-fast25-synthetic.jsonl")).unwrap();
        let block_chars = 16 * 4;
        let mut checked = 0;
        'outer: for (i, a) in trace.rows[..400].iter().enumerate() {
            for (j, b) in trace.rows[..i].iter().enumerate() {
                let shared = a
                    .hash_ids
                    .iter()
                    .zip(&b.hash_ids)
                    .take_while(|(x, y)| x == y)
                    .count();
                if shared >= 2 && shared < a.hash_ids.len().min(b.hash_ids.len()) {
                    let ta = w.requests[i].prompt.text();
                    let tb = w.requests[j].prompt.text();
                    let common = ta
                        .bytes()
                        .zip(tb.bytes())
                        .take_while(|(x, y)| x == y)
                        .count();
                    assert!(common >= shared * block_chars, "{common} < {shared} blocks");
                    assert!(common < (shared + 1) * block_chars);
                    checked += 1;
                    if checked > 20 {
                        break 'outer;
                    }
                }
            }
        }
        assert!(checked > 0, "the slice must contain shared prefixes");
    }

    #[test]
    fn poisson_is_deterministic_and_has_the_requested_rate() {
        let cfg: WorkloadConfig = serde_json::from_value(serde_json::json!({
            "kind": "poisson", "rate_per_s": 50.0, "duration_s": 40.0, "seed": 7,
            "prompt_tokens": {"dist": "lognormal", "median": 500.0, "sigma": 0.5, "min": 10, "max": 4000},
            "output_tokens": {"dist": "uniform", "min": 10, "max": 20},
            "models": {"names": ["a", "b", "c", "d"], "zipf_s": 1.2}
        }))
        .unwrap();
        let a = Workload::build(&cfg, None).unwrap();
        let b = Workload::build(&cfg, None).unwrap();
        assert_eq!(a.requests, b.requests);
        let n = a.requests.len() as f64;
        // 2000 expected; Poisson sd ~45
        assert!((n - 2000.0).abs() < 200.0, "n {n}");
        assert!(a.requests.iter().all(|r| (10..=20).contains(&r.max_tokens)));
        let count = |m: &str| a.requests.iter().filter(|r| r.model == m).count();
        assert!(count("a") > count("b") && count("b") > count("d"));
        let other = cfg.with_overrides(&Overrides {
            seed: Some(8),
            ..Overrides::default()
        });
        assert_ne!(Workload::build(&other, None).unwrap().requests, a.requests);
    }

    #[test]
    fn poisson_choices_and_bursts() {
        let base = serde_json::json!({
            "kind": "poisson", "rate_per_s": 5.0, "duration_s": 20.0, "seed": 7,
            "prompt_tokens": {"dist": "fixed", "value": 100},
            "output_tokens": {"dist": "fixed", "value": 10}
        });
        let mut with = base.clone();
        with["choices"] = serde_json::json!({"values": [1, 16], "weights": [3, 1]});
        with["bursts"] = serde_json::json!({"every_s": 5.0, "size": 6});
        let build = |v: &serde_json::Value| {
            let cfg: WorkloadConfig = serde_json::from_value(v.clone()).unwrap();
            Workload::build(&cfg, None).unwrap().requests
        };
        let (plain, mixed) = (build(&base), build(&with));
        assert!(plain.iter().all(|r| r.n == 1));
        // As many Poisson arrivals with the options as without; 4 bursts of 6 join them.
        assert_eq!(mixed.len(), plain.len() + 24);
        assert!(mixed.windows(2).all(|w| w[0].at_s <= w[1].at_s));
        for at in [5.0, 10.0, 15.0, 20.0] {
            assert!(
                mixed.iter().filter(|r| r.at_s == at).count() >= 6,
                "burst at {at}"
            );
        }
        let sampled = mixed.iter().filter(|r| r.n == 16).count() as f64;
        let share = sampled / mixed.len() as f64;
        assert!((0.15..0.35).contains(&share), "share of n = 16: {share}");
        assert!(mixed.iter().all(|r| r.n == 1 || r.n == 16));
        let bad = |choices: serde_json::Value| {
            let mut v = base.clone();
            v["choices"] = choices;
            let cfg: WorkloadConfig = serde_json::from_value(v).unwrap();
            Workload::build(&cfg, None).is_err()
        };
        assert!(bad(serde_json::json!({"values": [0], "weights": [1]})));
        assert!(bad(serde_json::json!({"values": [1, 2], "weights": [1]})));
        assert!(bad(serde_json::json!({"values": [], "weights": []})));
    }

    #[test]
    fn poisson_lengths_can_come_from_a_trace_jointly() {
        let cfg: WorkloadConfig = serde_json::from_value(serde_json::json!({
            "kind": "poisson", "rate_per_s": 100.0, "duration_s": 20.0,
            "lengths_from_trace": testdata("azure-llm-2023-conv.csv"),
            "max_output_tokens": 500
        }))
        .unwrap();
        let w = Workload::build(&cfg, None).unwrap();
        let trace = Trace::load(&testdata("azure-llm-2023-conv.csv")).unwrap();
        let pairs: std::collections::HashSet<(u64, u64)> = trace
            .rows
            .iter()
            .map(|r| (r.input_tokens, r.output_tokens.min(500)))
            .collect();
        // every request is one of the trace's (input, output) rows
        for r in &w.requests {
            let input = (r.prompt.chars() / CHARS_PER_TOKEN) as u64;
            assert!(
                pairs.contains(&(input, r.max_tokens)),
                "{input} {}",
                r.max_tokens
            );
        }
        // the sample mean is near the trace's (1,155 tokens)
        assert!(
            (w.info.mean_prompt_tokens - 1155.0).abs() < 60.0,
            "{}",
            w.info.mean_prompt_tokens
        );
        let missing: WorkloadConfig = serde_json::from_value(serde_json::json!({
            "kind": "poisson", "rate_per_s": 1.0, "duration_s": 1.0
        }))
        .unwrap();
        assert!(matches!(
            Workload::build(&missing, None),
            Err(WorkloadError::Invalid(_))
        ));
    }

    #[test]
    fn shared_prefix_groups_share_their_system_prompt() {
        let cfg: WorkloadConfig = serde_json::from_value(serde_json::json!({
            "kind": "poisson", "rate_per_s": 20.0, "duration_s": 5.0,
            "prompt_tokens": {"dist": "fixed", "value": 50},
            "output_tokens": {"dist": "fixed", "value": 5},
            "shared_prefix": {"groups": 2, "tokens": 100}
        }))
        .unwrap();
        let w = Workload::build(&cfg, None).unwrap();
        let texts: Vec<String> = w.requests.iter().map(|r| r.prompt.text()).collect();
        assert!(texts.iter().all(|t| t.len() == 600));
        let distinct: std::collections::HashSet<&str> = texts.iter().map(|t| &t[..400]).collect();
        assert_eq!(distinct.len(), 2);
    }

    #[test]
    fn body_is_streaming_openai_json() {
        let r = TimedRequest {
            at_s: 0.0,
            api: Api::Completions,
            model: "m".into(),
            prompt: PromptSpec::Filler {
                seed: 1,
                id: 2,
                chars: 40,
            },
            max_tokens: 9,
            n: 1,
        };
        let v: serde_json::Value = serde_json::from_slice(&r.body()).unwrap();
        assert_eq!(v["stream"], true);
        assert_eq!(v["stream_options"]["include_usage"], true);
        assert_eq!(v["max_tokens"], 9);
        assert_eq!(v["prompt"].as_str().unwrap().len(), 40);
        let chat = TimedRequest {
            api: Api::Chat,
            ..r
        };
        let v: serde_json::Value = serde_json::from_slice(&chat.body()).unwrap();
        assert_eq!(v["messages"][0]["role"], "user");
        assert!(v.get("n").is_none(), "one choice: no n sent");
        let sampled = TimedRequest { n: 8, ..chat };
        let v: serde_json::Value = serde_json::from_slice(&sampled.body()).unwrap();
        assert_eq!(v["n"], 8);
    }

    #[test]
    fn bad_settings_are_rejected() {
        let mut c = trace_cfg("azure-llm-2023-conv.csv");
        c.speedup = Some(0.0);
        assert!(matches!(
            Workload::build(&WorkloadConfig::Trace(c), None),
            Err(WorkloadError::Invalid(_))
        ));
        let missing = trace_cfg("no-such-file.csv");
        assert!(matches!(
            Workload::build(&WorkloadConfig::Trace(missing), None),
            Err(WorkloadError::NotFound(_))
        ));
    }
}
