//! Renders a pod's `/metrics` page in the flavour of its engine. vLLM v1 names, HELP texts,
//! label order (`engine`, [`finished_reason` | `le`], `model_name`), series order and
//! `_created` gauges follow `shared/metrics-samples/vllm-v1-0.11-hardware-aware-router-idle.txt`;
//! `lora_requests_info` follows vLLM PR #13303 (one series per label combination, value = unix
//! time it was last current). SGLang names and order follow the SGLang production-metrics docs.

use crate::config::PodConfig;
use crate::engine::EngineKind;
use crate::lora::AdapterId;
use crate::metrics::{escape_label, Exposition, Histogram};
use crate::pod::{MetricsView, Pod, SimClock};

/// The page for a pod.
pub fn render(pod: &Pod) -> String {
    render_view(&pod.cfg, &pod.clock, &pod.metrics_view())
}

/// The page of a pod of configuration `cfg` whose engine shows `view`, on `clock`: what
/// [`render`] serves, for an engine driven without a server (the benchmark's offline replay).
pub fn render_view(cfg: &PodConfig, clock: &SimClock, view: &MetricsView) -> String {
    let pod = Page { cfg, clock };
    let mut e = Exposition::new();
    match cfg.engine.kind {
        EngineKind::Vllm => vllm(&pod, view, &mut e),
        EngineKind::Sglang => sglang(&pod, view, &mut e),
    }
    fleet_sim(&pod, view, &mut e);
    e.finish()
}

/// What a page is rendered from besides the engine's figures.
struct Page<'a> {
    cfg: &'a PodConfig,
    clock: &'a SimClock,
}

impl Page<'_> {
    /// Adapter names for ids, comma-joined (vLLM's `lora_requests_info` label format).
    fn adapter_list(&self, ids: &[AdapterId]) -> String {
        crate::pod::adapter_names(self.cfg, ids).join(",")
    }
}

fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

fn vllm(pod: &Page, v: &MetricsView, e: &mut Exposition) {
    let model = escape_label(&pod.cfg.model);
    let labels = format!("engine=\"0\",model_name=\"{model}\"");
    let created = pod.clock.unix_epoch();
    let s = &v.stats;
    let g = &v.gauges;

    let gauge = |e: &mut Exposition, name: &str, help: &str, value: f64| {
        e.family(name, help, "gauge");
        e.sample(name, &labels, value);
    };
    gauge(
        e,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        g.running as f64,
    );
    gauge(
        e,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        g.waiting as f64,
    );
    gauge(
        e,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        g.kv_usage,
    );

    let counter = |e: &mut Exposition, base: &str, help: &str, value: f64| {
        let total = format!("vllm:{base}_total");
        e.family(&total, help, "counter");
        e.sample(&total, &labels, value);
        let c = format!("vllm:{base}_created");
        e.family(&c, help, "gauge");
        e.sample(&c, &labels, created);
    };
    counter(
        e,
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        s.prefix_queries as f64,
    );
    counter(
        e,
        "prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        s.prefix_hits as f64,
    );
    counter(
        e,
        "num_preemptions",
        "Cumulative number of preemption from the engine.",
        s.preemptions as f64,
    );
    counter(
        e,
        "prompt_tokens",
        "Number of prefill tokens processed.",
        s.prompt_tokens as f64,
    );
    counter(
        e,
        "generation_tokens",
        "Number of generation tokens processed.",
        s.generation_tokens as f64,
    );

    let help = "Count of successfully processed requests.";
    let reasons = [
        ("stop", s.finished_stop),
        ("length", s.finished_length),
        ("abort", s.finished_abort),
    ];
    e.family("vllm:request_success_total", help, "counter");
    for (r, n) in reasons {
        let l = format!("engine=\"0\",finished_reason=\"{r}\",model_name=\"{model}\"");
        e.sample("vllm:request_success_total", &l, n as f64);
    }
    e.family("vllm:request_success_created", help, "gauge");
    for (r, _) in reasons {
        let l = format!("engine=\"0\",finished_reason=\"{r}\",model_name=\"{model}\"");
        e.sample("vllm:request_success_created", &l, created);
    }

    let hist = |e: &mut Exposition, name: &str, help: &str, h: &Histogram| {
        e.family(name, help, "histogram");
        e.histogram(
            name,
            "engine=\"0\"",
            &format!("model_name=\"{model}\""),
            h,
            false,
        );
        let c = format!("{name}_created");
        e.family(&c, help, "gauge");
        e.sample(&c, &labels, created);
    };
    hist(
        e,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &s.ttft,
    );
    hist(
        e,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &s.itl,
    );
    hist(
        e,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        &s.e2e,
    );

    let cfg = &pod.cfg.engine;
    if cfg.max_loras > 0 {
        e.family(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            "gauge",
        );
        let max_lora = cfg.max_loras;
        let line = |e: &mut Exposition, running: &str, waiting: &str, ts: f64| {
            let l = format!(
                "max_lora=\"{max_lora}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"",
                escape_label(running),
                escape_label(waiting)
            );
            e.sample("vllm:lora_requests_info", &l, ts);
        };
        if s.lora_info.is_empty() {
            line(e, "", "", created);
        }
        for (running, waiting, t) in &s.lora_info {
            line(
                e,
                &pod.adapter_list(running),
                &pod.adapter_list(waiting),
                pod.clock.unix_at(*t),
            );
        }
    }

    e.family(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        "gauge",
    );
    let l = format!(
        "block_size=\"{}\",cache_dtype=\"auto\",calculate_kv_scales=\"False\",\
         cpu_kvcache_space_bytes=\"None\",cpu_offload_gb=\"0.0\",enable_prefix_caching=\"{}\",\
         engine=\"0\",gpu_memory_utilization=\"{}\",is_attention_free=\"False\",\
         kv_cache_memory_bytes=\"None\",kv_sharing_fast_prefill=\"False\",\
         mamba_cache_dtype=\"auto\",mamba_page_size_padded=\"None\",\
         mamba_ssm_cache_dtype=\"auto\",num_cpu_blocks=\"None\",num_gpu_blocks=\"{}\",\
         num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",\
         sliding_window=\"None\",swap_space=\"4.0\",swap_space_bytes=\"4294967296.0\"",
        cfg.block_size,
        py_bool(cfg.enable_prefix_caching),
        crate::metrics::go_float(pod.cfg.gpu_memory_utilization),
        cfg.num_gpu_blocks,
    );
    e.sample("vllm:cache_config_info", &l, 1.0);
}

fn sglang(pod: &Page, v: &MetricsView, e: &mut Exposition) {
    let labels = format!("model_name=\"{}\"", escape_label(&pod.cfg.model));
    let s = &v.stats;
    let g = &v.gauges;
    let one = |e: &mut Exposition, name: &str, help: &str, kind: &str, value: f64| {
        e.family(name, help, kind);
        e.sample(name, &labels, value);
    };
    one(
        e,
        "sglang:prompt_tokens_total",
        "Number of prefill tokens processed.",
        "counter",
        s.prompt_tokens as f64,
    );
    one(
        e,
        "sglang:generation_tokens_total",
        "Number of generation tokens processed.",
        "counter",
        s.generation_tokens as f64,
    );
    // SGLang rounds token_usage to 2 decimals (scheduler log_prefill_stats)
    one(
        e,
        "sglang:token_usage",
        "The token usage",
        "gauge",
        (g.kv_usage * 100.0).round() / 100.0,
    );
    one(
        e,
        "sglang:cache_hit_rate",
        "The cache hit rate",
        "gauge",
        s.last_prefill_hit_rate,
    );
    let hist = |e: &mut Exposition, name: &str, help: &str, h: &Histogram| {
        e.family(name, help, "histogram");
        e.histogram(name, "", &labels, h, true);
    };
    hist(
        e,
        "sglang:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &s.ttft,
    );
    hist(
        e,
        "sglang:e2e_request_latency_seconds",
        "Histogram of End-to-end request latency in seconds",
        &s.e2e,
    );
    hist(
        e,
        "sglang:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        &s.tpot,
    );
    one(
        e,
        "sglang:num_running_reqs",
        "The number of running requests",
        "gauge",
        g.running as f64,
    );
    let page = pod.cfg.engine.block_size;
    one(
        e,
        "sglang:num_used_tokens",
        "The number of used tokens",
        "gauge",
        f64::from(g.used_blocks) * f64::from(page),
    );
    one(
        e,
        "sglang:gen_throughput",
        "The generate throughput (token/s)",
        "gauge",
        s.gen_throughput,
    );
    one(
        e,
        "sglang:num_queue_reqs",
        "The number of requests in the waiting queue",
        "gauge",
        g.waiting as f64,
    );
    e.family(
        "sglang:cache_config_info",
        "Information of the KV cache configuration",
        "gauge",
    );
    let l = format!(
        "{labels},num_pages=\"{}\",page_size=\"{page}\"",
        g.total_blocks
    );
    e.sample("sglang:cache_config_info", &l, 1.0);
}

fn fleet_sim(pod: &Page, v: &MetricsView, e: &mut Exposition) {
    let labels = format!(
        "model_name=\"{}\",pod=\"{}\"",
        escape_label(&pod.cfg.model),
        escape_label(&pod.cfg.name)
    );
    e.family(
        "fleet_sim:time_scale",
        "Simulated seconds per wall second; latency histograms are in wall seconds.",
        "gauge",
    );
    e.sample("fleet_sim:time_scale", "", pod.clock.scale());
    e.family(
        "fleet_sim:lora_adapter_loads_total",
        "LoRA adapters loaded into GPU slots (simulator-only; vLLM does not export this).",
        "counter",
    );
    e.sample(
        "fleet_sim:lora_adapter_loads_total",
        &labels,
        v.stats.lora_loads as f64,
    );
    e.family(
        "fleet_sim:preemptions_total",
        "Sequences preempted by recompute when the KV cache ran out.",
        "counter",
    );
    e.sample(
        "fleet_sim:preemptions_total",
        &labels,
        v.stats.preemptions as f64,
    );
    e.family(
        "fleet_sim:pod_info",
        "Static description of the simulated pod.",
        "gauge",
    );
    let info = format!(
        "engine=\"{}\",gpu=\"{}\",pod=\"{}\",pool=\"{}\",speed=\"{}\"",
        match pod.cfg.engine.kind {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        },
        escape_label(&pod.cfg.gpu_key),
        escape_label(&pod.cfg.name),
        escape_label(&pod.cfg.pool),
        crate::metrics::go_float(pod.cfg.engine.speed),
    );
    e.sample("fleet_sim:pod_info", &info, 1.0);
}
