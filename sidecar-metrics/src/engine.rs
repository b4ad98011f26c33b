//! Engine normalisation: turns one pod's `/metrics` text into a [`Reading`], the engine-neutral
//! values the aggregator needs (queue, batch, KV-cache use, LoRA, prefix-cache and speed
//! counters, cache geometry).
//!
//! The metric names per engine are the ones in `shared/DESIGN.md` ("Model-server metrics"). The
//! engine is taken from the configuration when set, else detected from the first metric name
//! with a known engine prefix (`vllm:`, `sglang:`, `trtllm_`, `nv_trt_llm_`/`nv_inference_`,
//! `tgi_`). Counters stay raw here: rates need the previous scrape, which the aggregator keeps.
//!
//! When a family has several series (vLLM data parallelism labels each engine core with
//! `engine="N"`), counts and counters are summed and fractions averaged, so a pod is described
//! as a whole.

use crate::prom::{self, ParseError, Sample};
use gpuroute_core::snapshot::{Engine, LoraState, MAX_ADAPTERS_PER_POD, MAX_NAME_LEN};
use std::cell::Cell;
use thiserror::Error;
use url::Url;

/// What one successful scrape says about a pod, before deltas against the previous scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reading {
    /// The engine the values were read as (configured, or detected).
    pub engine: Engine,
    /// Requests queued, not yet scheduled.
    pub waiting: Option<f64>,
    /// Requests in the running batch.
    pub running: Option<f64>,
    /// KV-cache use, 0..1.
    pub kv_cache_usage: Option<f64>,
    /// LoRA adapters (vLLM `lora_requests_info`, newest series).
    pub lora: Option<LoraState>,
    /// Prefix-cache hits, a counter (vLLM V1, tokens).
    pub prefix_hits: Option<f64>,
    /// Prefix-cache queries, a counter (vLLM V1, tokens).
    pub prefix_queries: Option<f64>,
    /// Prefix-cache hit rate reported directly as a gauge (SGLang; vLLM V0 when not -1).
    pub prefix_hit_rate: Option<f64>,
    /// Tokens per KV-cache block.
    pub block_size: Option<u32>,
    /// KV-cache capacity in blocks.
    pub num_blocks: Option<u64>,
    /// Sum of the inter-token-latency histogram (seconds), a counter.
    pub itl_sum: Option<f64>,
    /// Count of the inter-token-latency histogram (tokens), a counter.
    pub itl_count: Option<f64>,
    /// The raw samples each value came from (`name{labels} value`), kept only on request
    /// (`scrape-once`), so operators can see exactly what was read.
    pub used: Vec<String>,
}

/// Why a scrape body could not be turned into a [`Reading`].
#[derive(Debug, Clone, PartialEq, Error)]
pub enum ReadError {
    #[error("malformed exposition: {0}")]
    Parse(#[from] ParseError),
    #[error("no recognised {engine} metrics in the exposition (is metrics_url right?)")]
    NoMetrics { engine: &'static str },
    /// Every series of the pod's queue or batch is NaN: its load is unknown, so the scrape
    /// fails (the pod is left out of routing) rather than reading as idle.
    #[error("the {what} is NaN")]
    NotANumber { what: &'static str },
}

/// Running mean/sum over the series of one family.
#[derive(Default, Clone, Copy)]
struct Acc {
    sum: f64,
    n: u32,
    nan: u32,
}

impl Acc {
    /// Non-finite values are left out: a counter or a rate that is not a number says nothing.
    fn add(&mut self, v: f64) {
        if v.is_finite() {
            self.sum += v;
            self.n += 1;
        }
    }
    /// A load value (a queue, a batch, a KV-cache fraction): +Inf counts, as the most loaded a
    /// pod can read (clamped when published), not as nothing, which would read as idle; -Inf
    /// as the least. NaN is left out, but counted: a family of nothing else fails the scrape
    /// ([`ReadError::NotANumber`]) where it is the queue or the batch.
    fn add_load(&mut self, v: f64) {
        if v.is_nan() {
            self.nan += 1;
        } else {
            self.sum += v;
            self.n += 1;
        }
    }
    /// Only NaN was seen.
    fn only_nan(self) -> bool {
        self.n == 0 && self.nan > 0
    }
    fn sum(self) -> Option<f64> {
        (self.n > 0).then_some(self.sum)
    }
    fn mean(self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / f64::from(self.n))
    }
}

#[derive(Default)]
struct Accs {
    waiting: Acc,
    waiting_fallback: Acc,
    running: Acc,
    kv: Acc,
    kv_fallback: Acc,
    kv_used: Acc,
    kv_max: Acc,
    hits: Acc,
    queries: Acc,
    hit_rate: Acc,
    itl_sum: Acc,
    itl_count: Acc,
    itl_sum_fallback: Acc,
    itl_count_fallback: Acc,
    block_size: Option<u32>,
    num_blocks: Option<u64>,
    lora: Option<(f64, LoraState)>,
    matched: usize,
}

/// Detects the engine from a metric name prefix.
pub fn engine_of(name: &str) -> Option<Engine> {
    if name.starts_with("vllm:") {
        Some(Engine::Vllm)
    } else if name.starts_with("sglang:") {
        Some(Engine::Sglang)
    } else if name.starts_with("trtllm_") {
        Some(Engine::Trtllm)
    } else if name.starts_with("nv_trt_llm_") || name.starts_with("nv_inference_") {
        Some(Engine::Triton)
    } else if name.starts_with("tgi_") {
        Some(Engine::Tgi)
    } else {
        None
    }
}

/// Parses `text` and reads it as `hint` (or as the detected engine when `hint` is `None` or
/// [`Engine::Unknown`]). `keep_raw` fills [`Reading::used`].
pub fn read(text: &str, hint: Option<Engine>, keep_raw: bool) -> Result<Reading, ReadError> {
    let detected = Cell::new(hint.filter(|e| *e != Engine::Unknown));
    let mut acc = Accs::default();
    let mut used = Vec::new();
    // Only the lines the engine's table names are parsed in full; the rest (most of a real
    // scrape: histograms, process and HTTP metrics) are checked for a valid metric name and
    // skipped. Each line of the format stands alone, so a broken line we do not read cannot
    // change the ones we do; a body with nothing we read is still a failed scrape.
    let wanted = |name: &str| match detected.get() {
        Some(e) => slot(e, name).is_some(),
        None => engine_of(name).is_some_and(|e| slot(e, name).is_some()),
    };
    for sample in prom::parse_filtered(text, wanted) {
        let s = sample?;
        let e = match detected.get() {
            Some(e) => e,
            None => match engine_of(s.name) {
                Some(e) => {
                    detected.set(Some(e));
                    e
                }
                None => continue,
            },
        };
        let Some(sl) = slot(e, s.name) else { continue };
        if take(sl, &s, &mut acc) {
            acc.matched += 1;
            if keep_raw {
                used.push(format!("{}{{{}}} {}", s.name, s.raw_labels(), s.value));
            }
        }
    }
    let engine = detected.get().unwrap_or(Engine::Unknown);
    if acc.matched == 0 {
        return Err(ReadError::NoMetrics {
            engine: if engine == Engine::Unknown {
                "model-server"
            } else {
                engine.as_str()
            },
        });
    }
    if acc.waiting.only_nan() && acc.waiting_fallback.n == 0 {
        return Err(ReadError::NotANumber {
            what: "queue (requests waiting)",
        });
    }
    if acc.running.only_nan() {
        return Err(ReadError::NotANumber {
            what: "batch (requests running)",
        });
    }
    let kv = acc.kv.mean().or(acc.kv_fallback.mean()).or_else(|| {
        // Triton without the "fraction" series: derive it from used/max blocks (none when
        // their sums overflow: inf / inf is not a fraction).
        match (acc.kv_used.sum(), acc.kv_max.sum()) {
            (Some(u), Some(m)) if m > 0.0 => Some(u / m).filter(|f| !f.is_nan()),
            _ => None,
        }
    });
    let (itl_sum, itl_count) = match (acc.itl_sum.sum(), acc.itl_count.sum()) {
        (Some(s), Some(c)) => (Some(s), Some(c)),
        _ => (acc.itl_sum_fallback.sum(), acc.itl_count_fallback.sum()),
    };
    Ok(Reading {
        engine,
        waiting: acc
            .waiting
            .sum()
            .or(acc.waiting_fallback.sum())
            .map(non_neg),
        running: acc.running.sum().map(non_neg),
        kv_cache_usage: kv.map(|v| v.clamp(0.0, 1.0)),
        lora: acc.lora.map(|(_, l)| l),
        prefix_hits: acc.hits.sum(),
        prefix_queries: acc.queries.sum(),
        prefix_hit_rate: acc
            .hit_rate
            .mean()
            // vLLM V0 reports -1 before the first query: no data, not a rate.
            .filter(|r| (0.0..=1.0).contains(r)),
        block_size: acc.block_size.filter(|b| *b > 0),
        num_blocks: acc.num_blocks.or(acc.kv_max.sum().map(|m| m as u64)),
        itl_sum,
        itl_count,
        used,
    })
}

fn non_neg(v: f64) -> f64 {
    v.max(0.0)
}

/// What a metric is used for; [`slot`] maps engine and name to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slot {
    Waiting,
    Running,
    Kv,
    KvFallback,
    Hits,
    Queries,
    HitRate,
    VllmCacheConfig,
    SglangCacheConfig,
    BlockSize,
    MaxBlocks,
    Lora,
    ItlSum,
    ItlCount,
    ItlSumFallback,
    ItlCountFallback,
    TritonRequests,
    TritonKvBlocks,
    TritonPending,
}

/// The one table of metric names per engine (see `shared/DESIGN.md`): what [`read`] takes from
/// an exposition, and, as [`filter_query`], all a pod is asked for.
const SLOTS: &[(Engine, &str, Slot)] = &[
    (Engine::Vllm, "vllm:num_requests_waiting", Slot::Waiting),
    (Engine::Sglang, "sglang:num_queue_reqs", Slot::Waiting),
    (Engine::Trtllm, "trtllm_num_requests_waiting", Slot::Waiting),
    (Engine::Tgi, "tgi_queue_size", Slot::Waiting),
    (Engine::Vllm, "vllm:num_requests_running", Slot::Running),
    (Engine::Sglang, "sglang:num_running_reqs", Slot::Running),
    (Engine::Trtllm, "trtllm_num_requests_running", Slot::Running),
    (Engine::Tgi, "tgi_batch_current_size", Slot::Running),
    (Engine::Vllm, "vllm:kv_cache_usage_perc", Slot::Kv),
    (Engine::Sglang, "sglang:token_usage", Slot::Kv),
    (Engine::Trtllm, "trtllm_kv_cache_utilization", Slot::Kv),
    // vLLM V0 and V1 before 0.10 name it this way.
    (Engine::Vllm, "vllm:gpu_cache_usage_perc", Slot::KvFallback),
    (Engine::Vllm, "vllm:prefix_cache_hits_total", Slot::Hits),
    (
        Engine::Vllm,
        "vllm:prefix_cache_queries_total",
        Slot::Queries,
    ),
    (
        Engine::Vllm,
        "vllm:gpu_prefix_cache_hit_rate",
        Slot::HitRate,
    ),
    (Engine::Sglang, "sglang:cache_hit_rate", Slot::HitRate),
    (
        Engine::Vllm,
        "vllm:cache_config_info",
        Slot::VllmCacheConfig,
    ),
    (
        Engine::Sglang,
        "sglang:cache_config_info",
        Slot::SglangCacheConfig,
    ),
    (
        Engine::Trtllm,
        "trtllm_kv_cache_tokens_per_block",
        Slot::BlockSize,
    ),
    (
        Engine::Trtllm,
        "trtllm_kv_cache_max_blocks",
        Slot::MaxBlocks,
    ),
    (Engine::Vllm, "vllm:lora_requests_info", Slot::Lora),
    (
        Engine::Vllm,
        "vllm:inter_token_latency_seconds_sum",
        Slot::ItlSum,
    ),
    (
        Engine::Sglang,
        "sglang:inter_token_latency_seconds_sum",
        Slot::ItlSum,
    ),
    (
        Engine::Tgi,
        "tgi_request_mean_time_per_token_duration_sum",
        Slot::ItlSum,
    ),
    (
        Engine::Vllm,
        "vllm:inter_token_latency_seconds_count",
        Slot::ItlCount,
    ),
    (
        Engine::Sglang,
        "sglang:inter_token_latency_seconds_count",
        Slot::ItlCount,
    ),
    (
        Engine::Tgi,
        "tgi_request_mean_time_per_token_duration_count",
        Slot::ItlCount,
    ),
    // Older names of the same histogram (vLLM before 0.11; SGLang's per-request TPOT).
    (
        Engine::Vllm,
        "vllm:time_per_output_token_seconds_sum",
        Slot::ItlSumFallback,
    ),
    (
        Engine::Sglang,
        "sglang:time_per_output_token_seconds_sum",
        Slot::ItlSumFallback,
    ),
    (
        Engine::Vllm,
        "vllm:time_per_output_token_seconds_count",
        Slot::ItlCountFallback,
    ),
    (
        Engine::Sglang,
        "sglang:time_per_output_token_seconds_count",
        Slot::ItlCountFallback,
    ),
    (
        Engine::Triton,
        "nv_trt_llm_request_metrics",
        Slot::TritonRequests,
    ),
    (
        Engine::Triton,
        "nv_trt_llm_kv_cache_block_metrics",
        Slot::TritonKvBlocks,
    ),
    // Triton core: requests accepted but not yet executing, for any backend.
    (
        Engine::Triton,
        "nv_inference_pending_request_count",
        Slot::TritonPending,
    ),
];

/// The query that asks a pod of `engine` for only the samples it is read for in [`SLOTS`]
/// (every engine's when the engine is detected, `None`): `name[]=vllm%3Anum_requests_waiting&
/// name[]=...`. prometheus_client, which vLLM serves its metrics with, then renders just those
/// (its `restricted_registry`, by sample name: ~2 KB of vLLM's ~45 KB). A multiprocess registry
/// (SGLang's, vLLM's with `PROMETHEUS_MULTIPROC_DIR`) cannot restrict and answers nothing, which
/// makes the aggregator scrape that pod whole; servers that do not read the parameter (TGI,
/// Triton) ignore it and serve everything.
pub fn filter_query(engine: Option<Engine>) -> String {
    SLOTS
        .iter()
        .filter(|(e, _, _)| engine.is_none_or(|want| want == *e))
        .map(|(_, n, _)| format!("name%5B%5D={}", n.replace(':', "%3A")))
        .collect::<Vec<_>>()
        .join("&")
}

/// `url` with [`filter_query`] for `engine` added to its query.
pub fn filtered_url(url: &Url, engine: Option<Engine>) -> Url {
    let mut filtered = url.clone();
    let ask = filter_query(engine);
    match url.query() {
        Some(q) if !q.is_empty() => filtered.set_query(Some(&format!("{q}&{ask}"))),
        _ => filtered.set_query(Some(&ask)),
    }
    filtered
}

fn slot(engine: Engine, name: &str) -> Option<Slot> {
    SLOTS
        .iter()
        .find(|(e, n, _)| *e == engine && *n == name)
        .map(|&(_, _, s)| s)
}

/// Folds one sample into the accumulators; returns whether it was used.
fn take(slot: Slot, s: &Sample<'_>, a: &mut Accs) -> bool {
    let v = s.value;
    match slot {
        Slot::Waiting => a.waiting.add_load(v),
        Slot::Running => a.running.add_load(v),
        Slot::Kv => a.kv.add_load(v),
        Slot::KvFallback => a.kv_fallback.add_load(v),
        Slot::Hits => a.hits.add(v),
        Slot::Queries => a.queries.add(v),
        Slot::HitRate => a.hit_rate.add(v),
        Slot::VllmCacheConfig => cache_geometry(s, "block_size", "num_gpu_blocks", a),
        Slot::SglangCacheConfig => cache_geometry(s, "page_size", "num_pages", a),
        Slot::BlockSize => a.block_size = to_u32(v),
        Slot::MaxBlocks => a.kv_max.add(v),
        Slot::Lora => lora(s, a),
        Slot::ItlSum => a.itl_sum.add(v),
        Slot::ItlCount => a.itl_count.add(v),
        Slot::ItlSumFallback => a.itl_sum_fallback.add(v),
        Slot::ItlCountFallback => a.itl_count_fallback.add(v),
        Slot::TritonRequests => match s.label("request_type").as_deref() {
            Some("waiting") => a.waiting.add_load(v),
            Some("scheduled") => a.running.add_load(v),
            _ => return false,
        },
        Slot::TritonKvBlocks => match s.label("kv_cache_block_type").as_deref() {
            Some("fraction") => a.kv.add_load(v),
            Some("used") => a.kv_used.add(v),
            Some("max") => a.kv_max.add(v),
            Some("tokens_per") => a.block_size = to_u32(v),
            _ => return false,
        },
        Slot::TritonPending => a.waiting_fallback.add_load(v),
    }
    true
}

fn to_u32(v: f64) -> Option<u32> {
    (v.is_finite() && v >= 1.0 && v <= f64::from(u32::MAX)).then_some(v as u32)
}

fn cache_geometry(s: &Sample<'_>, block_key: &str, blocks_key: &str, a: &mut Accs) {
    // Label values are Python reprs ("16", "2452", "None", "4294967296.0").
    let num = |k: &str| s.label(k).and_then(|v| v.parse::<f64>().ok());
    if a.block_size.is_none() {
        a.block_size = num(block_key).and_then(to_u32);
    }
    if let Some(b) = num(blocks_key).filter(|b| b.is_finite() && *b >= 0.0) {
        // One series per engine core under data parallelism: the pod holds them all.
        a.num_blocks = Some(a.num_blocks.unwrap_or(0).saturating_add(b as u64));
    }
}

/// The most bytes of adapter names kept in one list of a pod (running, or waiting): 128 names
/// of 64 bytes. vLLM runs at most `max_loras` adapters at once (a few to a few dozen); a pod
/// listing more is broken or hostile, and what is cut is the end of its list.
pub const ADAPTER_BYTES: usize = 8 * 1024;

/// `vllm:lora_requests_info` has one series per distinct adapter state; its value is the time of
/// the last update, so the newest series is the current state.
fn lora(s: &Sample<'_>, a: &mut Accs) {
    if !s.value.is_finite() || a.lora.as_ref().is_some_and(|(t, _)| *t >= s.value) {
        return;
    }
    let list = |k: &str| -> Vec<String> {
        s.label(k)
            .map(|v| {
                v.split(',')
                    .map(str::trim)
                    // The snapshot refuses empty or over-long names: drop them here so one odd
                    // adapter name cannot get the whole snapshot rejected.
                    .filter(|n| !n.is_empty() && n.len() <= MAX_NAME_LEN)
                    .take(MAX_ADAPTERS_PER_POD)
                    // And at most ADAPTER_BYTES of names a list: within the counts allowed, a
                    // few pods with long lists of long names would otherwise take the snapshot
                    // past what the filter takes in (every pool's pushes refused, 413).
                    .scan(0usize, |bytes, n| {
                        *bytes += n.len();
                        (*bytes <= ADAPTER_BYTES).then_some(n)
                    })
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let max_loras = s
        .label("max_lora")
        .and_then(|v| v.parse::<f64>().ok())
        .and_then(|v| (v.is_finite() && v >= 0.0).then_some(v.min(f64::from(u32::MAX)) as u32))
        .unwrap_or(0);
    a.lora = Some((
        s.value,
        LoraState {
            max_loras,
            running: list("running_lora_adapters"),
            waiting: list("waiting_lora_adapters"),
        },
    ));
}

impl Reading {
    /// LoRA state worth publishing: none when the engine runs without LoRA (`max_lora="0"` and
    /// no adapters), so the filter does not mistake "LoRA disabled" for "no free slot".
    pub fn lora_for_snapshot(&self) -> Option<LoraState> {
        self.lora
            .as_ref()
            .filter(|l| l.max_loras > 0 || !l.running.is_empty() || !l.waiting.is_empty())
            .cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(name: &str) -> String {
        let path = format!("{}/../testdata/metrics/{name}", env!("CARGO_MANIFEST_DIR"));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn read_file(name: &str) -> Result<Reading, ReadError> {
        read(&sample(name), None, false)
    }

    #[test]
    fn vllm_v1_idle_scrape() {
        let r = read_file("vllm-v1-0.11-hardware-aware-router-idle.txt").unwrap();
        assert_eq!(r.engine, Engine::Vllm);
        assert_eq!(r.waiting, Some(0.0));
        assert_eq!(r.running, Some(0.0));
        assert_eq!(r.kv_cache_usage, Some(0.0));
        assert_eq!(r.block_size, Some(16));
        assert_eq!(r.num_blocks, Some(2452));
        assert_eq!(r.prefix_hits, Some(0.0));
        assert_eq!(r.prefix_queries, Some(0.0));
        // The new histogram name wins over the deprecated one; both are present and idle.
        assert_eq!((r.itl_sum, r.itl_count), (Some(0.0), Some(0.0)));
        assert_eq!(r.lora, None);
        assert_eq!(r.prefix_hit_rate, None);
    }

    #[test]
    fn vllm_v0_uses_the_old_kv_name_and_ignores_the_minus_one_sentinel() {
        let r = read_file("vllm-v0-0.7-aibrix-runtime-doc.txt").unwrap();
        assert_eq!(r.engine, Engine::Vllm);
        assert_eq!(r.kv_cache_usage, Some(0.0));
        assert_eq!(r.block_size, Some(16));
        assert_eq!(r.num_blocks, Some(81767));
        assert_eq!(r.prefix_hit_rate, None, "-1.0 means no data");
        let lora = r.lora.clone().unwrap();
        assert_eq!(lora.max_loras, 0);
        assert_eq!(r.lora_for_snapshot(), None, "max_lora=0 is LoRA disabled");
    }

    #[test]
    fn vllm_lora_takes_the_newest_series_not_the_last_line() {
        let r = read_file("vllm-lora-requests-info-vllm-pr13303.txt").unwrap();
        let lora = r.lora_for_snapshot().unwrap();
        assert_eq!(lora.max_loras, 1);
        assert_eq!(lora.running, vec!["test-lora".to_string()]);
        assert!(
            lora.waiting.is_empty(),
            "the newest series has no waiting adapter"
        );
    }

    #[test]
    fn lora_lists_are_comma_joined() {
        let text = "vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"a,b, c\",\
                    waiting_lora_adapters=\"d\"} 10\n\
                    vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"\",\
                    waiting_lora_adapters=\"\"} 9\n";
        let lora = read(text, None, false).unwrap().lora.unwrap();
        assert_eq!(lora.running, vec!["a", "b", "c"]);
        assert_eq!(lora.waiting, vec!["d"]);
    }

    #[test]
    fn sglang_docs_scrape() {
        let r = read_file("sglang-docs-production-metrics.txt").unwrap();
        assert_eq!(r.engine, Engine::Sglang);
        assert_eq!(r.waiting, Some(2826.0));
        assert_eq!(r.running, Some(162.0));
        assert_eq!(r.kv_cache_usage, Some(0.28));
        assert_eq!(r.prefix_hit_rate, Some(0.007507552643049313));
        // Only the per-request TPOT histogram exists in this version.
        assert_eq!(r.itl_sum, Some(866964.5791549598));
        assert_eq!(r.itl_count, Some(7.400757e6));
    }

    #[test]
    fn sglang_engine_type_labels() {
        let r = read_file("sglang-engine-type-gauges-sglang-pr4412-fragment.txt").unwrap();
        assert_eq!(r.engine, Engine::Sglang);
        assert_eq!(r.running, Some(0.0));
        assert_eq!(r.kv_cache_usage, Some(0.0));
        assert_eq!(r.waiting, None, "the fragment stops before num_queue_reqs");
    }

    #[test]
    fn triton_trtllm_backend() {
        let r = read_file("triton-trtllm-backend-readme-inflight-batcher.txt").unwrap();
        assert_eq!(r.engine, Engine::Triton);
        assert_eq!(r.waiting, Some(1.0));
        assert_eq!(r.running, Some(1.0));
        assert_eq!(r.kv_cache_usage, Some(0.4875));
        assert_eq!(r.block_size, Some(64));
        assert_eq!(r.num_blocks, Some(6239));
    }

    #[test]
    fn triton_core_metrics_only() {
        let r = read_file("triton-base-nv-inference-readme.txt").unwrap();
        assert_eq!(r.engine, Engine::Triton);
        assert_eq!(r.waiting, Some(0.0));
        assert_eq!(r.kv_cache_usage, None);
    }

    #[test]
    fn trtllm_serve_fragment_has_nothing_to_route_on() {
        // Unprefixed names and only a latency histogram: not detectable, and even when the
        // engine is configured there is no load metric in it.
        let text = sample("trtllm-serve-prometheus-aibrix-issue2004-fragment.txt");
        assert!(matches!(
            read(&text, None, false),
            Err(ReadError::NoMetrics {
                engine: "model-server"
            })
        ));
        assert!(matches!(
            read(&text, Some(Engine::Trtllm), false),
            Err(ReadError::NoMetrics { engine: "trtllm" })
        ));
    }

    #[test]
    fn every_sample_file_has_an_expectation() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/metrics");
        let covered = [
            "vllm-v1-0.11-hardware-aware-router-idle.txt",
            "vllm-v0-0.7-aibrix-runtime-doc.txt",
            "vllm-lora-requests-info-vllm-pr13303.txt",
            "sglang-docs-production-metrics.txt",
            "sglang-engine-type-gauges-sglang-pr4412-fragment.txt",
            "triton-trtllm-backend-readme-inflight-batcher.txt",
            "triton-base-nv-inference-readme.txt",
            "trtllm-serve-prometheus-aibrix-issue2004-fragment.txt",
        ];
        for entry in std::fs::read_dir(dir).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".txt") {
                assert!(covered.contains(&name.as_str()), "{name} has no test");
            }
        }
    }

    #[test]
    fn trtllm_serve_and_tgi_names() {
        let text = "trtllm_num_requests_waiting 3\ntrtllm_num_requests_running 5\n\
                    trtllm_kv_cache_utilization 0.5\ntrtllm_kv_cache_tokens_per_block 32\n\
                    trtllm_kv_cache_max_blocks 1000\n";
        let r = read(text, None, false).unwrap();
        assert_eq!(r.engine, Engine::Trtllm);
        assert_eq!(
            (
                r.waiting,
                r.running,
                r.kv_cache_usage,
                r.block_size,
                r.num_blocks
            ),
            (Some(3.0), Some(5.0), Some(0.5), Some(32), Some(1000))
        );
        let r = read("tgi_queue_size 2\ntgi_batch_current_size 7\n", None, false).unwrap();
        assert_eq!(r.engine, Engine::Tgi);
        assert_eq!(
            (r.waiting, r.running, r.kv_cache_usage),
            (Some(2.0), Some(7.0), None)
        );
    }

    #[test]
    fn a_queue_or_batch_of_only_nan_fails_the_scrape_and_inf_reads_as_full() {
        // One engine core's NaN among others' values is left out (above); a queue that is all
        // NaN is unknown, not empty: before, it read as 0 and the pod as idle.
        let e = read(
            "vllm:num_requests_waiting NaN\nvllm:num_requests_running 1\n",
            None,
            false,
        );
        assert!(matches!(e, Err(ReadError::NotANumber { .. })), "{e:?}");
        let e = read(
            "vllm:num_requests_waiting 1\nvllm:num_requests_running NaN\n",
            None,
            false,
        );
        assert!(matches!(e, Err(ReadError::NotANumber { .. })), "{e:?}");
        let text = "vllm:num_requests_waiting +Inf\nvllm:num_requests_running -Inf\nvllm:kv_cache_usage_perc +Inf\n";
        let r = read(text, None, false).unwrap();
        assert_eq!(
            (r.waiting, r.running, r.kv_cache_usage),
            (Some(f64::INFINITY), Some(0.0), Some(1.0))
        );
        // Cache geometry that overflows saturates instead of wrapping.
        let text = "vllm:num_requests_waiting 0\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1e30\",engine=\"0\"} 1\n\
                    vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1e30\",engine=\"1\"} 1\n";
        assert_eq!(read(text, None, false).unwrap().num_blocks, Some(u64::MAX));
    }

    #[test]
    fn a_pods_adapter_lists_are_cut_at_their_byte_budget() {
        let names: Vec<String> = (0..1000).map(|i| format!("{i:0>200}")).collect();
        let text = format!(
            "vllm:lora_requests_info{{max_lora=\"4\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"a,b\"}} 1\n",
            names.join(",")
        );
        let lora = read(&text, None, false).unwrap().lora.unwrap();
        assert_eq!(lora.running.len(), ADAPTER_BYTES / 200);
        assert_eq!(lora.running[..], names[..ADAPTER_BYTES / 200]);
        assert_eq!(lora.waiting, vec!["a", "b"]);
    }

    #[test]
    fn data_parallel_series_are_summed_and_fractions_averaged() {
        let text = "vllm:num_requests_waiting{engine=\"0\"} 2\n\
                    vllm:num_requests_waiting{engine=\"1\"} 3\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.2\n\
                    vllm:kv_cache_usage_perc{engine=\"1\"} 0.6\n\
                    vllm:kv_cache_usage_perc{engine=\"2\"} NaN\n";
        let r = read(text, None, false).unwrap();
        assert_eq!(r.waiting, Some(5.0));
        assert!((r.kv_cache_usage.unwrap() - 0.4).abs() < 1e-12);
    }

    #[test]
    fn configured_engine_skips_detection_and_raw_values_are_kept() {
        let text = "python_info 1\nvllm:num_requests_running 4\nsglang:num_running_reqs 9\n";
        let r = read(text, Some(Engine::Sglang), true).unwrap();
        assert_eq!(r.engine, Engine::Sglang);
        assert_eq!(r.running, Some(9.0));
        assert_eq!(r.used, vec!["sglang:num_running_reqs{} 9".to_string()]);
    }

    #[test]
    fn malformed_text_is_a_parse_error() {
        let err = read("vllm:num_requests_running 1\n{{{\n", None, false).unwrap_err();
        assert!(matches!(err, ReadError::Parse(ParseError { line: 2, .. })));
    }

    proptest::proptest! {
        #[test]
        fn garbage_is_an_error_or_a_sane_reading(text in "\\PC{0,300}") {
            if let Ok(r) = read(&text, None, false) {
                proptest::prop_assert!(r.kv_cache_usage.is_none_or(|k| (0.0..=1.0).contains(&k)));
                proptest::prop_assert!(r.waiting.is_none_or(|w| w >= 0.0));
            }
        }
    }
}
