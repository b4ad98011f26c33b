//! End-to-end tests of the simulated fleet over HTTP on 127.0.0.1: the vLLM streaming and
//! non-streaming formats, errors, `/v1/models`, `/metrics` names (vLLM and SGLang), prefix-cache
//! accounting across two requests, the admin API's failure modes, and the ports file.

// test helpers outside #[test] functions may fail loudly too
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fleet_sim::{Fleet, FleetFile, Overrides};
use serde_json::Value;

const LLAMA: &str = "meta-llama/Llama-3.1-8B-Instruct";

async fn start(time_scale: f64) -> Fleet {
    let file = FleetFile::parse(&format!(
        r#"{{"seed": 7, "time_scale": {time_scale}, "pods": [
            {{"name": "fast", "pool": "llama-8b", "model": "{LLAMA}", "gpu": "h100",
              "adapters": ["sql-lora", "chat-lora"], "max_loras": 1}},
            {{"name": "sg", "pool": "qwen-7b", "model": "Qwen/Qwen2.5-7B-Instruct", "gpu": "l40s",
              "engine": "sglang"}}]}}"#
    ))
    .unwrap();
    let cfg = file.resolve(Overrides::default()).unwrap();
    Fleet::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap()
}

fn addr(fleet: &Fleet, name: &str) -> SocketAddr {
    fleet.pods.iter().find(|p| p.cfg.name == name).unwrap().addr
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// The `data:` payloads of an SSE body, in order.
fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            assert!(e.starts_with("data: "), "not an SSE data event: {e:?}");
            e["data: ".len()..].to_string()
        })
        .collect()
}

fn word_count(s: &str) -> usize {
    // every filler token is one word with a leading space
    s.split(' ').filter(|w| !w.is_empty()).count()
}

async fn metric(c: &reqwest::Client, a: SocketAddr, line_prefix: &str) -> f64 {
    let text = c
        .get(format!("http://{a}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = text
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .unwrap_or_else(|| panic!("no line starting with {line_prefix}"));
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

#[tokio::test]
async fn streaming_chat_is_vllm_sse_with_content_in_the_first_write() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let prompt = "Tell me about the sea. ".repeat(10);
    let body = serde_json::json!({
        "model": LLAMA, "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 30, "stream": true, "stream_options": {"include_usage": true}
    });
    let mut resp = client()
        .post(format!("http://{a}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-served-by"], "fast");
    assert_eq!(
        resp.headers()["x-served-by-address"],
        a.to_string().as_str()
    );
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let first = resp.chunk().await.unwrap().unwrap();
    let first = String::from_utf8(first.to_vec()).unwrap();
    let mut all = first.clone();
    while let Some(c) = resp.chunk().await.unwrap() {
        all.push_str(std::str::from_utf8(&c).unwrap());
    }
    // vLLM sends the role chunk and the first content together, at the first token
    let first_events = sse_events(&first);
    assert!(first_events.len() >= 2, "{first:?}");
    let role: Value = serde_json::from_str(&first_events[0]).unwrap();
    assert_eq!(role["choices"][0]["delta"]["role"], "assistant");
    let content: Value = serde_json::from_str(&first_events[1]).unwrap();
    assert!(!content["choices"][0]["delta"]["content"]
        .as_str()
        .unwrap()
        .is_empty());

    let events = sse_events(&all);
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["model"], LLAMA);
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(chunks.last().unwrap()["choices"], Value::Array(vec![]));
    assert_eq!(usage["prompt_tokens"], prompt.len().div_ceil(4));
    assert_eq!(usage["completion_tokens"], 30);
    assert_eq!(usage["total_tokens"], prompt.len().div_ceil(4) + 30);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(word_count(&text), 30);
    let finish = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(finish["finish_reason"], "length");
    // coalescing: fewer content chunks than tokens (20 ms wall = 200 ms simulated per chunk)
    assert!(chunks.len() < 30, "{} chunks", chunks.len());
}

#[tokio::test]
async fn client_sees_the_first_token_when_the_prefill_step_ends() {
    let fleet = start(1.0).await;
    let a = addr(&fleet, "fast");
    let prompt = "y".repeat(16_000); // 4000 tokens, one prefill step on an idle pod
    let pod = &fleet.pods[0];
    let mut work = fleet_sim::cost::StepWork::default();
    work.add_chunk(0, 4000);
    let expected = fleet_sim::cost::step_seconds(
        pod.cfg.engine.gpu,
        pod.cfg.engine.model,
        &work,
        pod.cfg.engine.speed,
    );
    let start = Instant::now();
    let mut resp = client()
        .post(format!("http://{a}/v1/completions"))
        .json(
            &serde_json::json!({"model": LLAMA, "prompt": prompt, "max_tokens": 3, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let first = resp.chunk().await.unwrap().unwrap();
    let ttft = start.elapsed().as_secs_f64();
    assert!(std::str::from_utf8(&first)
        .unwrap()
        .contains("\"text\":\" the\""));
    // never before the step ends; a little after (timer granularity, HTTP, a busy machine)
    assert!(ttft >= expected, "{ttft} < {expected}");
    assert!(ttft < expected + 0.1, "{ttft} vs {expected}");
    while resp.chunk().await.unwrap().is_some() {}
}

#[tokio::test]
async fn non_streaming_responses_carry_usage() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    let resp: Value = c
        .post(format!("http://{a}/v1/chat/completions"))
        .json(&serde_json::json!({
            "model": "sql-lora",
            "messages": [{"role": "system", "content": "abcdefgh"}, {"role": "user", "content": [{"type": "text", "text": "ijkl"}]}],
            "max_completion_tokens": 7
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(resp["object"], "chat.completion");
    assert_eq!(resp["model"], "sql-lora");
    assert_eq!(resp["usage"]["prompt_tokens"], 3); // 12 bytes of content
    assert_eq!(resp["usage"]["completion_tokens"], 7);
    assert_eq!(resp["choices"][0]["finish_reason"], "length");
    assert_eq!(
        word_count(resp["choices"][0]["message"]["content"].as_str().unwrap()),
        7
    );

    // no max_tokens: a drawn length, finish_reason stop, same length for the same request
    let ask = || async {
        let v: Value = c
            .post(format!("http://{a}/v1/completions"))
            .json(&serde_json::json!({"model": LLAMA, "prompt": "once upon a time"}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v
    };
    let (x, y) = (ask().await, ask().await);
    assert_eq!(x["object"], "text_completion");
    assert_eq!(x["choices"][0]["finish_reason"], "stop");
    let n = x["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n >= 1);
    assert_eq!(y["usage"]["completion_tokens"], n);
    assert_eq!(
        word_count(x["choices"][0]["text"].as_str().unwrap()) as u64,
        n
    );
}

#[tokio::test]
async fn unknown_model_is_a_vllm_404_and_errors_name_the_pod() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let resp = client()
        .post(format!("http://{a}/v1/chat/completions"))
        .json(
            &serde_json::json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);
    assert_eq!(resp.headers()["x-served-by"], "fast");
    let body = resp.text().await.unwrap();
    assert_eq!(
        body,
        r#"{"error":{"message":"The model `gpt-4` does not exist.","type":"NotFoundError","param":null,"code":404}}"#
    );
    // too long for the context: 400
    let resp = client()
        .post(format!("http://{a}/v1/completions"))
        .json(&serde_json::json!({"model": LLAMA, "prompt": "x", "max_tokens": 10_000_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("maximum context length"));
    // invalid JSON: 400
    let resp = client()
        .post(format!("http://{a}/v1/chat/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
}

#[tokio::test]
async fn models_lists_base_and_adapters() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let v: Value = client()
        .get(format!("http://{a}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let data = v["data"].as_array().unwrap();
    let ids: Vec<_> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, [LLAMA, "sql-lora", "chat-lora"]);
    assert_eq!(data[0]["root"], LLAMA);
    assert!(data[0]["parent"].is_null());
    assert_eq!(data[1]["parent"], LLAMA);
    assert_eq!(data[1]["owned_by"], "vllm");
}

#[tokio::test]
async fn metrics_use_exact_engine_names() {
    let fleet = start(10.0).await;
    let c = client();
    let text = c
        .get(format!("http://{}/metrics", addr(&fleet, "fast")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let labels = format!(r#"{{engine="0",model_name="{LLAMA}"}}"#);
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ] {
        assert!(
            text.contains(&format!("\n{name}{labels} ")),
            "missing {name}"
        );
    }
    assert!(text.contains(r#"vllm:request_success_total{engine="0",finished_reason="length","#));
    assert!(text.contains(r#"vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001","#));
    assert!(text.contains(r#"vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} "#));
    assert!(text.contains(r#"vllm:cache_config_info{block_size="16","#));
    assert!(text.contains("fleet_sim:lora_adapter_loads_total{"));
    assert!(text.contains("\nfleet_sim:time_scale 10.0\n"));
    // every sample line is `name{labels} value` with a float value, under a TYPE line
    let mut typed = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            typed.insert(rest.split(' ').next().unwrap().to_string());
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').unwrap();
        assert!(value.parse::<f64>().is_ok() || value == "+Inf", "{line}");
        let name = series.split('{').next().unwrap();
        let family = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "{name} has no TYPE line");
    }

    let sg = c
        .get(format!("http://{}/metrics", addr(&fleet, "sg")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for name in [
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "sglang:token_usage",
        "sglang:cache_hit_rate",
        "sglang:gen_throughput",
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:time_to_first_token_seconds_sum",
    ] {
        assert!(
            sg.contains(&format!(
                "\n{name}{{model_name=\"Qwen/Qwen2.5-7B-Instruct\"}} "
            )),
            "missing {name}"
        );
    }
    assert!(!sg.contains("vllm:"));

    // `?name[]=...`: the vLLM pod answers only those samples, with their families' comments,
    // as prometheus_client does; the SGLang pod nothing, as its multiprocess registry does.
    let q = "name%5B%5D=vllm%3Anum_requests_waiting&name%5B%5D=vllm%3Ainter_token_latency_seconds_sum&name%5B%5D=sglang%3Anum_queue_reqs";
    let get = |pod: &str| {
        let url = format!("http://{}/metrics?{q}", addr(&fleet, pod));
        let c = c.clone();
        async move { c.get(url).send().await.unwrap().text().await.unwrap() }
    };
    let samples = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(['{', ' ']).next().unwrap().to_string())
            .collect()
    };
    let v = get("fast").await;
    assert_eq!(
        samples(&v),
        [
            "vllm:num_requests_waiting",
            "vllm:inter_token_latency_seconds_sum"
        ]
    );
    assert!(v.starts_with("# HELP vllm:num_requests_waiting "));
    assert_eq!(get("sg").await, "");
}

#[tokio::test]
async fn prefix_sharing_pair_shows_in_prefix_cache_hits() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    let shared = "You are a careful assistant for the fleet. ".repeat(24); // 1032 bytes
    let ask = |suffix: &'static str| {
        let c = c.clone();
        let prompt = format!("{shared}{suffix}");
        async move {
            let r = c
                .post(format!("http://{a}/v1/completions"))
                .json(&serde_json::json!({"model": LLAMA, "prompt": prompt, "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    let before = metric(&c, a, "vllm:prefix_cache_hits_total{").await;
    let first = ask("What is the first question about?").await;
    let second = ask("Now a different question entirely.").await;
    let after = metric(&c, a, "vllm:prefix_cache_hits_total{").await;
    // blocks are 16 tokens x 4 bytes = 64 bytes; the shared text covers this many full blocks
    let expected = (shared.len() / 64 * 16) as f64;
    assert_eq!(after - before, expected);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        expected as u64
    );
    let queries = metric(&c, a, "vllm:prefix_cache_queries_total{").await;
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(queries, tokens(&first) + tokens(&second));
}

#[tokio::test]
async fn admin_modes_down_error_and_back() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let admin = fleet.admin;
    let c = client();
    let set = |mode: &'static str| {
        let c = c.clone();
        async move {
            let r = c
                .post(format!("http://{admin}/pods/fast/mode"))
                .json(&serde_json::json!({ "mode": mode }))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    set("down").await;
    // the listener closes asynchronously; connections must be refused soon after
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let fresh = reqwest::Client::new();
        match fresh.get(format!("http://{a}/health")).send().await {
            Err(e) if e.is_connect() => break,
            _ if Instant::now() > deadline => panic!("pod still accepts connections"),
            _ => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    set("error").await;
    let deadline = Instant::now() + Duration::from_secs(2);
    let resp = loop {
        if let Ok(r) = reqwest::Client::new()
            .get(format!("http://{a}/metrics"))
            .send()
            .await
        {
            break r;
        }
        assert!(Instant::now() < deadline, "pod did not come back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(resp.status(), 500);
    assert_eq!(resp.headers()["x-served-by"], "fast");
    set("hang").await;
    let hung = reqwest::Client::new()
        .get(format!("http://{a}/health"))
        .timeout(Duration::from_millis(300))
        .send()
        .await;
    assert!(hung.unwrap_err().is_timeout());
    set("ok").await;
    let r = c.get(format!("http://{a}/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);

    let pods: Value = c
        .get(format!("http://{admin}/pods"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let fast = &pods["pods"][0];
    assert_eq!(fast["name"], "fast");
    assert_eq!(fast["mode"], "ok");
    assert_eq!(fast["max_loras"], 1);
    let r = c
        .post(format!("http://{admin}/pods/nobody/mode"))
        .json(&serde_json::json!({"mode": "ok"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn client_disconnect_aborts_the_request() {
    let fleet = start(1.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    let mut resp = c
        .post(format!("http://{a}/v1/completions"))
        .json(&serde_json::json!({"model": LLAMA, "prompt": "go", "max_tokens": 100_000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    drop(resp);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let pods: Value = c
            .get(format!("http://{}/pods/fast", fleet.admin))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if pods["counters"]["aborted"] == 1 && pods["running"] == 0 {
            assert_eq!(pods["kv_usage"], 0.0);
            break;
        }
        assert!(Instant::now() < deadline, "request was not aborted: {pods}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn ports_file_is_written_whole() {
    let fleet = start(10.0).await;
    let dir = std::env::temp_dir().join(format!("fleet-sim-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ports.json");
    fleet.write_ports_file(&path).unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert_eq!(v["admin"], fleet.admin.to_string());
    let pods = v["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 2);
    assert_eq!(pods[0]["name"], "fast");
    assert_eq!(pods[0]["adapters"][0], "sql-lora");
    assert_eq!(pods[1]["engine"], "sglang");
    let a = pods[0]["address"].as_str().unwrap();
    assert_eq!(pods[0]["metrics_url"], format!("http://{a}/metrics"));
    // no temporary file left behind
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// POSTs `body` as JSON to `path` on `a`: the status and the response body's text.
async fn post(c: &reqwest::Client, a: SocketAddr, path: &str, body: Value) -> (u16, String) {
    let r = c
        .post(format!("http://{a}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

/// [`post`], for a JSON answer.
async fn post_json(c: &reqwest::Client, a: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, text) = post(c, a, path, body).await;
    (status, serde_json::from_str(&text).unwrap())
}

/// The named events of an Anthropic SSE body, in order: `(event name, data)`.
fn named_events(body: &str) -> Vec<(String, Value)> {
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named SSE event: {e:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn messages_api_answers_in_anthropics_shapes() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    let (status, resp) = post_json(
        &c,
        a,
        "/v1/messages",
        serde_json::json!({
            "model": "sql-lora", "max_tokens": 7,
            "system": [{"type": "text", "text": "abcdefgh"}],
            "messages": [{"role": "user", "content": "ijkl"}]
        }),
    )
    .await;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["type"], "message");
    assert_eq!(
        (&resp["role"], &resp["model"]),
        (&"assistant".into(), &"sql-lora".into())
    );
    assert_eq!(resp["stop_reason"], "max_tokens");
    assert_eq!(resp["usage"]["input_tokens"], 3); // 12 bytes: the system prompt and the message
    assert_eq!(resp["usage"]["output_tokens"], 7);
    assert_eq!(resp["content"][0]["type"], "text");
    assert_eq!(word_count(resp["content"][0]["text"].as_str().unwrap()), 7);

    let (status, body) = post(
        &c,
        a,
        "/v1/messages",
        serde_json::json!({
            "model": LLAMA, "max_tokens": 5, "stream": true,
            "messages": [{"role": "user", "content": "hello there"}]
        }),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let events = named_events(&body);
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names[..2],
        ["message_start", "content_block_start"],
        "{names:?}"
    );
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"],
        "{names:?}"
    );
    let deltas = &names[2..names.len() - 3];
    assert!(!deltas.is_empty() && deltas.iter().all(|n| *n == "content_block_delta"));
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str());
    }
    assert_eq!(events[0].1["message"]["usage"]["output_tokens"], 0);
    let text: String = events
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(word_count(&text), 5);
    let end = &events[events.len() - 2].1;
    assert_eq!(end["delta"]["stop_reason"], "max_tokens");
    assert_eq!(end["usage"]["output_tokens"], 5);

    // count_tokens: what the same conversation's message counted as input.
    let (status, counted) = post_json(
        &c,
        a,
        "/v1/messages/count_tokens",
        serde_json::json!({
            "model": "sql-lora",
            "system": [{"type": "text", "text": "abcdefgh"}],
            "messages": [{"role": "user", "content": "ijkl"}]
        }),
    )
    .await;
    assert_eq!(
        (status, counted),
        (200, serde_json::json!({"input_tokens": 3}))
    );

    // Errors in Anthropic's shape.
    let error = |path: &'static str, body: Value| {
        let c = c.clone();
        async move {
            let (status, v) = post_json(&c, a, path, body).await;
            assert_eq!(v["type"], "error", "{v}");
            (status, v["error"]["type"].as_str().unwrap().to_string())
        }
    };
    let hi = serde_json::json!([{"role": "user", "content": "hi"}]);
    let not_found = (404, "not_found_error".to_string());
    let unknown = serde_json::json!({"model": "gpt-4", "max_tokens": 4, "messages": hi});
    assert_eq!(error("/v1/messages", unknown.clone()).await, not_found);
    assert_eq!(error("/v1/messages/count_tokens", unknown).await, not_found);
    // `max_tokens` is required by the Messages API.
    assert_eq!(
        error(
            "/v1/messages",
            serde_json::json!({"model": LLAMA, "messages": hi})
        )
        .await,
        (400, "invalid_request_error".to_string())
    );
}

#[tokio::test]
async fn a_conversation_shares_its_cached_prefix_across_chat_and_messages() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    let system = "You are a careful assistant for the fleet. ".repeat(24);
    let first = "Where is parcel 1042? It left the hub on Tuesday.";
    let (status, r) = post_json(
        &c,
        a,
        "/v1/chat/completions",
        serde_json::json!({
            "model": LLAMA, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": first}]
        }),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let (status, r) = post_json(
        &c,
        a,
        "/v1/messages",
        serde_json::json!({
            "model": LLAMA, "max_tokens": 2, "system": system,
            "messages": [{"role": "user", "content": first},
                         {"role": "assistant", "content": "At the depot."},
                         {"role": "user", "content": "When will it arrive?"}]
        }),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    // Every full 64-byte block of the shared system prompt and first turn was cached.
    let shared = ((system.len() + first.len()) / 64 * 16) as u64;
    assert_eq!(r["usage"]["cache_read_input_tokens"], shared);
    let total = (system.len() + first.len() + "At the depot.When will it arrive?".len()) as u64;
    assert_eq!(
        r["usage"]["input_tokens"].as_u64().unwrap() + shared,
        total.div_ceil(4)
    );
}

/// A multipart/form-data body of text fields and one file, fields first.
fn form(fields: &[(&str, &str)], file: Option<&[u8]>) -> (Vec<u8>, String) {
    let b = "simboundary42";
    let mut out = Vec::new();
    for (k, v) in fields {
        out.extend_from_slice(
            format!("--{b}\r\ncontent-disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n")
                .as_bytes(),
        );
    }
    if let Some(f) = file {
        out.extend_from_slice(
            format!("--{b}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\ncontent-type: audio/wav\r\n\r\n").as_bytes(),
        );
        out.extend_from_slice(f);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{b}--\r\n").as_bytes());
    (out, format!("multipart/form-data; boundary={b}"))
}

#[tokio::test]
async fn an_audio_upload_runs_its_frames_and_text_through_the_engine() {
    let file = FleetFile::parse(
        r#"{"seed": 7, "time_scale": 10, "pods": [
            {"name": "asr", "pool": "whisper", "model": "openai/whisper-large-v3", "gpu": "l40s"}]}"#,
    )
    .unwrap();
    let cfg = file.resolve(Overrides::default()).unwrap();
    let fleet = Fleet::start(cfg, "127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let a = addr(&fleet, "asr");
    let c = client();
    let post = |path: &'static str, (body, ctype): (Vec<u8>, String)| {
        c.post(format!("http://{a}{path}"))
            .header("content-type", ctype)
            .body(body)
            .send()
    };
    let prompt_before = metric(&c, a, "vllm:prompt_tokens_total").await;
    // 10 s of 16 kHz 16-bit audio: one 30 s window of frames, ~33 text tokens.
    let audio = vec![7u8; 320_000];
    for path in ["/v1/audio/transcriptions", "/v1/audio/translations"] {
        let r = post(
            path,
            form(
                &[("model", "openai/whisper-large-v3"), ("language", "en")],
                Some(&audio),
            ),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 200);
        let v: Value = r.json().await.unwrap();
        assert_eq!(word_count(v["text"].as_str().unwrap()), 33, "{v}");
        assert_eq!(v["usage"]["seconds"], 10.0);
    }
    assert_eq!(
        metric(&c, a, "vllm:prompt_tokens_total").await - prompt_before,
        3000.0
    );
    // The server's answers to what it cannot serve.
    let cases = [
        (form(&[("model", "whisper-tiny")], Some(&audio)), 404),
        (form(&[("model", "openai/whisper-large-v3")], None), 400),
        (
            form(
                &[("model", "openai/whisper-large-v3"), ("stream", "true")],
                Some(&audio),
            ),
            400,
        ),
        (
            (
                b"not a form".to_vec(),
                "multipart/form-data; boundary=x".into(),
            ),
            400,
        ),
    ];
    for (body, status) in cases {
        let r = post("/v1/audio/transcriptions", body).await.unwrap();
        assert_eq!(r.status(), status);
    }
}

/// The pod's running and waiting sequences once the streamed completion `ask` has sent its
/// first chunk (the request is aborted when this returns).
async fn sequences_while_streaming(c: &reqwest::Client, a: SocketAddr, ask: &Value) -> f64 {
    let mut resp = c
        .post(format!("http://{a}/v1/completions"))
        .json(ask)
        .send()
        .await
        .unwrap();
    assert!(resp.chunk().await.unwrap().is_some());
    metric(c, a, "vllm:num_requests_running{").await
        + metric(c, a, "vllm:num_requests_waiting{").await
}

#[tokio::test]
async fn a_request_for_n_choices_runs_as_n_sequences() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    let chat = serde_json::json!({
        "model": LLAMA,
        "messages": [{"role": "user", "content": "abcdefgh"}],
        "max_tokens": 5,
        "n": 3
    });
    let (s, v) = post_json(&c, a, "/v1/chat/completions", chat.clone()).await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(ch["finish_reason"], "length");
        assert_eq!(word_count(ch["message"]["content"].as_str().unwrap()), 5);
    }
    // The prompt counted once, the choices' tokens together (as vLLM reports them).
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(v["usage"]["completion_tokens"], 15);

    // The choices after the first find the prompt's blocks cached.
    let hits = metric(&c, a, "vllm:prefix_cache_hits_total{").await;
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(30);
    let ask = serde_json::json!({"model": LLAMA, "prompt": long, "max_tokens": 2, "n": 4});
    let (s, v) = post_json(&c, a, "/v1/completions", ask).await;
    assert_eq!(s, 200, "{v}");
    let reused = metric(&c, a, "vllm:prefix_cache_hits_total{").await - hits;
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(
        reused >= 3.0 * (prompt - 16.0),
        "{reused} of {prompt} tokens reused"
    );

    // Streamed: each choice's chunks carry its index and end with its finish reason; one usage
    // chunk and one [DONE] close the stream.
    let mut ask = serde_json::json!({"model": LLAMA, "prompt": "once upon a time", "max_tokens": 4,
        "n": 2, "stream": true, "stream_options": {"include_usage": true}});
    let (s, body) = post(&c, a, "/v1/completions", ask.clone()).await;
    assert_eq!(s, 200, "{body}");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut words = [0usize; 2];
    let mut finished = [0usize; 2];
    for ch in chunks
        .iter()
        .filter(|c| !c["choices"].as_array().unwrap().is_empty())
    {
        let choice = &ch["choices"][0];
        let i = choice["index"].as_u64().unwrap() as usize;
        words[i] += word_count(choice["text"].as_str().unwrap());
        finished[i] += usize::from(choice["finish_reason"] == "length");
    }
    assert_eq!((words, finished), ([4, 4], [1, 1]), "{body}");
    let usage: Vec<&Value> = chunks.iter().filter(|c| !c["usage"].is_null()).collect();
    assert_eq!(usage.len(), 1, "{body}");
    assert_eq!(usage[0]["usage"]["completion_tokens"], 8);

    // Each choice is a sequence of the engine: the gauges count all of them.
    ask["max_tokens"] = serde_json::json!(100_000);
    ask["n"] = serde_json::json!(4);
    assert_eq!(sequences_while_streaming(&c, a, &ask).await, 4.0);

    for (n, want) in [
        (0, "n must be at least 1, got 0."),
        (257, "at most 256 choices"),
    ] {
        let (s, v) = post_json(
            &c,
            a,
            "/v1/chat/completions",
            serde_json::json!({
            "model": LLAMA, "messages": [{"role": "user", "content": "hi"}], "n": n}),
        )
        .await;
        assert_eq!(s, 400, "{v}");
        let message = v["message"]
            .as_str()
            .or(v["error"]["message"].as_str())
            .unwrap();
        assert!(message.contains(want), "{v}");
    }
}

#[tokio::test]
async fn a_batch_of_prompts_runs_each_prompt_as_its_requests() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    // Two prompts of 2 and 4 tokens, 2 choices each: 4 choices, prompt by prompt.
    let ask = serde_json::json!({"model": LLAMA, "prompt": ["abcdefgh", "abcdefghijklmnop"],
        "max_tokens": 3, "n": 2});
    let (s, v) = post_json(&c, a, "/v1/completions", ask).await;
    assert_eq!(s, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{v}");
    for (i, ch) in choices.iter().enumerate() {
        assert_eq!(ch["index"], i);
        assert_eq!(word_count(ch["text"].as_str().unwrap()), 3);
    }
    assert_eq!(v["usage"]["prompt_tokens"], 6, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 12, "{v}");

    // A batch of token-id lists: each list is a prompt (3 and 2 ids: 5 prompt tokens).
    let ask =
        serde_json::json!({"model": LLAMA, "prompt": [[11, 12, 13], [14, 15]], "max_tokens": 1});
    let (s, v) = post_json(&c, a, "/v1/completions", ask).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 5, "{v}");

    // Streamed: each choice's chunks carry its index in the batch.
    let ask = serde_json::json!({"model": LLAMA, "prompt": ["once", "upon", "a time"],
        "max_tokens": 2, "n": 2, "stream": true, "stream_options": {"include_usage": true}});
    let (s, body) = post(&c, a, "/v1/completions", ask).await;
    assert_eq!(s, 200, "{body}");
    let events = sse_events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let mut words = [0usize; 6];
    let mut usage = Vec::new();
    for e in &events[..events.len() - 1] {
        let chunk: Value = serde_json::from_str(e).unwrap();
        if let Some(choice) = chunk["choices"].as_array().unwrap().first() {
            words[choice["index"].as_u64().unwrap() as usize] +=
                word_count(choice["text"].as_str().unwrap());
        }
        if !chunk["usage"].is_null() {
            usage.push(chunk["usage"]["completion_tokens"].clone());
        }
    }
    assert_eq!(
        (words, usage),
        ([2; 6], vec![serde_json::json!(12)]),
        "{body}"
    );

    // Every prompt's every choice is a sequence of the engine.
    let ask = serde_json::json!({"model": LLAMA, "prompt": ["a", "b", "c"], "n": 2,
        "max_tokens": 100_000, "stream": true});
    assert_eq!(sequences_while_streaming(&c, a, &ask).await, 6.0);

    let many: Vec<String> = (0..1025).map(|i| format!("p{i}")).collect();
    for (prompt, n, want) in [
        (serde_json::json!([]), 1, "non-empty list"),
        (serde_json::json!([1, "a"]), 1, "non-empty list"),
        (serde_json::json!([[1], []]), 1, "non-empty list"),
        (serde_json::json!([[1], "a"]), 1, "non-empty list"),
        (serde_json::json!(7), 1, "non-empty list"),
        (serde_json::json!(many), 1, "at most 1024 prompts"),
        (
            serde_json::json!(vec!["a"; 17]),
            256,
            "at most 4096 sequences",
        ),
    ] {
        let ask = serde_json::json!({"model": LLAMA, "prompt": prompt, "n": n});
        let (s, v) = post_json(&c, a, "/v1/completions", ask).await;
        assert_eq!(s, 400, "{v}");
        let message = v["message"]
            .as_str()
            .or(v["error"]["message"].as_str())
            .unwrap();
        assert!(message.contains(want), "{want}: {v}");
    }
}

#[tokio::test]
async fn tokenize_and_detokenize_answer_as_vllm_does() {
    let fleet = start(10.0).await;
    let a = addr(&fleet, "fast");
    let c = client();
    // 12 bytes: 3 tokens, as the engine counts a prompt.
    let (s, v) = post_json(
        &c,
        a,
        "/tokenize",
        serde_json::json!({"model": LLAMA, "prompt": "abcdefghijkl"}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["count"], 3);
    assert_eq!(v["tokens"].as_array().unwrap().len(), 3);
    assert!(v["max_model_len"].as_u64().unwrap() > 0);
    let chat = serde_json::json!({"model": "sql-lora", "messages": [{"role": "user", "content": "abcdefghijkl"}]});
    let (s, w) = post_json(&c, a, "/tokenize", chat).await;
    assert_eq!((s, &w["tokens"]), (200, &v["tokens"]), "{w}");
    let (s, d) = post_json(
        &c,
        a,
        "/detokenize",
        serde_json::json!({"model": LLAMA, "tokens": v["tokens"]}),
    )
    .await;
    assert_eq!(s, 200, "{d}");
    assert_eq!(word_count(d["prompt"].as_str().unwrap()), 3);
    let (s, e) = post_json(
        &c,
        a,
        "/tokenize",
        serde_json::json!({"model": "gpt-9", "prompt": "x"}),
    )
    .await;
    assert_eq!((s, e["error"]["code"].as_u64()), (404, Some(404)), "{e}");
    let (s, _) = post_json(&c, a, "/tokenize", serde_json::json!({"model": LLAMA})).await;
    assert_eq!(s, 400);
}
