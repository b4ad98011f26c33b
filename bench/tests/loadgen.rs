//! End-to-end tests of the open-loop runner against the local stub server: TTFT and
//! token measurement, open-loop sends under a slow server, error classification, and
//! the pods' counters scraped around a run. Servers bind 127.0.0.1:0.

// test helpers are not #[test] functions, which clippy's allow-unwrap-in-tests covers;
// a failing setup must fail the test
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use gpuroute_bench::metrics::{scrape_all, MetricsDelta, PodEntry};
use gpuroute_bench::results::{ErrorKind, Summary};
use gpuroute_bench::runner::{build_client, run, RunConfig, RunOutput};
use gpuroute_bench::stub::{spawn, StubConfig};
use gpuroute_bench::workload::{Api, PromptSpec, TimedRequest, Workload, WorkloadInfo};

fn workload(times: &[f64], api: Api, max_tokens: u64) -> Arc<Workload> {
    let requests = times
        .iter()
        .enumerate()
        .map(|(i, &at_s)| TimedRequest {
            at_s,
            api,
            model: "m".into(),
            prompt: PromptSpec::Filler {
                seed: 1,
                id: i as u64,
                chars: 2000,
            },
            max_tokens,
            n: 1,
        })
        .collect();
    Arc::new(Workload {
        requests,
        info: WorkloadInfo::default(),
    })
}

async fn run_against(stub: StubConfig, wl: Arc<Workload>, timeout: Duration) -> RunOutput {
    let addr = spawn("127.0.0.1:0", stub).await.unwrap();
    let cfg = RunConfig {
        target: format!("http://{addr}"),
        request_timeout: timeout,
        start_delay: Duration::from_millis(50),
        ..RunConfig::default()
    };
    let client = build_client(&cfg).unwrap();
    run(wl, client, &cfg).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttft_is_the_first_content_chunk_and_tokens_come_from_usage() {
    let stub = StubConfig {
        pod_names: vec!["pod-a".into(), "pod-b".into()],
        first_token_delay: Duration::from_millis(150),
        token_interval: Duration::from_millis(20),
        max_tokens_cap: 100,
        ..StubConfig::default()
    };
    for api in [Api::Chat, Api::Completions] {
        let out = run_against(
            stub.clone(),
            workload(&[0.0, 0.01, 0.02, 0.03], api, 6),
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(out.records.len(), 4);
        for r in &out.records {
            assert!(r.ok(), "{r:?}");
            let ttft = r.ttft_ms.unwrap();
            // no 40 ms Nagle/delayed-ACK stall either
            assert!((150.0..185.0).contains(&ttft), "ttft {ttft}");
            // headers leave before the first token: TTFT is not time-to-headers
            assert!(r.headers_ms.unwrap() < 100.0, "headers {:?}", r.headers_ms);
            // 5 more tokens 20 ms apart
            let e2e = r.e2e_ms.unwrap();
            assert!(
                e2e >= ttft + 95.0 && e2e < ttft + 250.0,
                "e2e {e2e} ttft {ttft}"
            );
            assert_eq!(r.output_tokens, 6);
            assert!(r.usage_reported);
            assert_eq!(r.prompt_chars, 2000);
        }
        let s = Summary::of(&out.records, out.max_in_flight);
        assert_eq!(s.served_by.len(), 2, "{:?}", s.served_by);
        assert_eq!(s.served_by.values().sum::<u64>(), 4);
        // decode: 5 tokens in ~100 ms -> ~50 tokens/s per request
        assert!(
            (25.0..55.0).contains(&s.decode_tokens_per_s.p50),
            "{:?}",
            s.decode_tokens_per_s
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_immediate_answer_is_measured_without_a_tcp_stall() {
    // Nagle + delayed ACK on either side would add ~40 ms to back-to-back small writes
    let times: Vec<f64> = (0..20).map(|i| f64::from(i) * 0.01).collect();
    let out = run_against(
        StubConfig::default(),
        workload(&times, Api::Chat, 8),
        Duration::from_secs(5),
    )
    .await;
    let s = Summary::of(&out.records, out.max_in_flight);
    assert_eq!(s.ok, 20);
    assert!(s.ttft_ms.p50 < 20.0, "ttft {:?}", s.ttft_ms);
    assert!(s.e2e_ms.p50 < 20.0, "e2e {:?}", s.e2e_ms);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_server_does_not_delay_later_sends() {
    // every answer takes 1.5 s to start; 40 sends are due over ~1 s
    let stub = StubConfig {
        first_token_delay: Duration::from_millis(1500),
        max_tokens_cap: 2,
        ..StubConfig::default()
    };
    let times: Vec<f64> = (0..40).map(|i| f64::from(i) * 0.025).collect();
    let out = run_against(
        stub,
        workload(&times, Api::Chat, 2),
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(out.records.len(), 40);
    assert!(out.records.iter().all(|r| r.ok()));
    let s = Summary::of(&out.records, out.max_in_flight);
    // a closed loop would send the second request only after 1.5 s
    let last = &out.records[39];
    assert!(last.sent_ms < 1100.0, "last send at {} ms", last.sent_ms);
    assert!(s.send_lag.p99_ms < 30.0, "send lag {:?}", s.send_lag);
    assert!(s.max_in_flight >= 35, "in flight {}", s.max_in_flight);
    assert!(s.ttft_ms.p50 >= 1500.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_are_counted_by_kind_without_ending_the_run() {
    let wl = workload(&[0.0, 0.01, 0.02], Api::Chat, 3);

    let out = run_against(
        StubConfig {
            fail_status: Some(503),
            ..StubConfig::default()
        },
        Arc::clone(&wl),
        Duration::from_secs(5),
    )
    .await;
    assert!(out
        .records
        .iter()
        .all(|r| r.error == Some(ErrorKind::HttpStatus) && r.status == Some(503)));
    let s = Summary::of(&out.records, out.max_in_flight);
    assert_eq!(s.errors_by_status["503"], 3);

    let out = run_against(
        StubConfig {
            omit_done: true,
            ..StubConfig::default()
        },
        Arc::clone(&wl),
        Duration::from_secs(5),
    )
    .await;
    assert!(out
        .records
        .iter()
        .all(|r| r.error == Some(ErrorKind::BadStream)));
    // the content that did arrive is still measured
    assert!(out.records.iter().all(|r| r.ttft_ms.is_some()));

    let out = run_against(
        StubConfig {
            first_token_delay: Duration::from_secs(3),
            ..StubConfig::default()
        },
        Arc::clone(&wl),
        Duration::from_millis(300),
    )
    .await;
    assert!(
        out.records
            .iter()
            .all(|r| r.error == Some(ErrorKind::Timeout)),
        "{:?}",
        out.records
    );

    // nothing listens on a port just released
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = RunConfig {
        target: format!("http://127.0.0.1:{port}"),
        request_timeout: Duration::from_secs(5),
        start_delay: Duration::from_millis(10),
        ..RunConfig::default()
    };
    let out = run(Arc::clone(&wl), build_client(&cfg).unwrap(), &cfg).await;
    assert!(
        out.records
            .iter()
            .all(|r| r.error == Some(ErrorKind::Connection)),
        "{:?}",
        out.records
    );
    let s = Summary::of(&out.records, out.max_in_flight);
    assert_eq!(s.errors_by_kind["connection"], 3);
    assert_eq!(s.ok, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_time_cuts_requests_still_running_after_the_last_send() {
    let addr = spawn(
        "127.0.0.1:0",
        StubConfig {
            first_token_delay: Duration::from_millis(50),
            token_interval: Duration::from_millis(100),
            max_tokens_cap: 100,
            ..StubConfig::default()
        },
    )
    .await
    .unwrap();
    // one short request and one that would stream for ~2 s
    let mut wl = (*workload(&[0.0, 0.1], Api::Chat, 2)).clone();
    wl.requests[1].max_tokens = 20;
    let cfg = RunConfig {
        target: format!("http://{addr}"),
        request_timeout: Duration::from_secs(10),
        start_delay: Duration::from_millis(10),
        max_drain: Some(Duration::from_millis(400)),
        ..RunConfig::default()
    };
    let started = std::time::Instant::now();
    let out = run(Arc::new(wl), build_client(&cfg).unwrap(), &cfg).await;
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert!(out.records[0].ok());
    let cut = &out.records[1];
    assert_eq!(cut.error, Some(ErrorKind::Timeout));
    assert!(cut.error_detail.as_deref().unwrap_or("").contains("cut"));
    // what it had streamed before the cut is still measured
    assert!(cut.ttft_ms.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_counters_are_scraped_around_a_run() {
    let addr = spawn("127.0.0.1:0", StubConfig::default()).await.unwrap();
    let pods = vec![
        PodEntry {
            name: "stub".into(),
            pool: None,
            model: None,
            adapters: vec![],
            address: Some(addr.to_string()),
            metrics_url: None,
            engine: None,
            gpu: None,
        },
        PodEntry {
            name: "gone".into(),
            pool: None,
            model: None,
            adapters: vec![],
            address: None,
            metrics_url: Some("http://127.0.0.1:1/metrics".into()),
            engine: None,
            gpu: None,
        },
    ];
    let cfg = RunConfig {
        target: format!("http://{addr}"),
        start_delay: Duration::from_millis(10),
        ..RunConfig::default()
    };
    let client = build_client(&cfg).unwrap();
    let wanted = [
        "vllm:request_success_total",
        "fleet_sim:lora_adapter_loads_total",
    ];
    let (before, e1) = scrape_all(&client, &pods, &wanted).await;
    let out = run(
        workload(&[0.0, 0.0, 0.01, 0.02, 0.03], Api::Chat, 4),
        client.clone(),
        &cfg,
    )
    .await;
    assert!(out.records.iter().all(|r| r.ok()));
    let (after, e2) = scrape_all(&client, &pods, &wanted).await;
    assert_eq!(
        (e1.len(), e2.len()),
        (1, 1),
        "the pod without a server is reported"
    );
    let d = MetricsDelta::between(before, after, e1);
    assert_eq!(d.total_delta["vllm:request_success_total"], 5.0);
    assert_eq!(d.adapter_loads(), Some(0.0));
}

/// Several targets, comma-separated (gateway replicas behind a Service), take the requests in
/// turn: request k goes to target k mod n.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_targets_take_the_requests_in_turn() {
    let stub = |name: &str| StubConfig {
        pod_names: vec![name.into()],
        ..StubConfig::default()
    };
    let a = spawn("127.0.0.1:0", stub("gateway-a")).await.unwrap();
    let b = spawn("127.0.0.1:0", stub("gateway-b")).await.unwrap();
    let cfg = RunConfig {
        target: format!("http://{a}/, http://{b}"),
        start_delay: Duration::from_millis(50),
        ..RunConfig::default()
    };
    let client = build_client(&cfg).unwrap();
    let times: Vec<f64> = (0..6).map(|i| f64::from(i) * 0.01).collect();
    let out = run(workload(&times, Api::Chat, 4), client, &cfg).await;
    let served: Vec<Option<&str>> = out.records.iter().map(|r| r.served_by.as_deref()).collect();
    assert_eq!(
        served,
        [Some("gateway-a"), Some("gateway-b")].repeat(3),
        "{:?}",
        out.records
    );
}
