//! The binary as a harness starts it: a bad config exits non-zero naming the field, and
//! `--listen 127.0.0.1:0` logs the bound address, serves, and stops cleanly on SIGTERM.

// Test helpers outside #[test] functions: a failed setup should fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::{vllm_body, FakePod};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_sidecar-metrics");

#[test]
fn bad_config_exits_with_status_2_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.yaml");
    std::fs::write(
        &path,
        "push: { token: t }\npools:\n  - name: a\n    pods: [{ address: 127.0.0.1:1, capacity: fast }]\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("pools[0].pods[0].capacity"), "{stderr}");

    let out = Command::new(BIN)
        .args(["run", "--pool", "a=not-an-address", "--token", "t"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("pools[0].pods[0].address"), "{stderr}");
}

/// The JSON a command printed, once it is known to have succeeded (its stderr otherwise).
fn succeeded_json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[tokio::test]
async fn starts_on_port_zero_logs_the_address_and_stops_on_sigterm() {
    let pod = FakePod::start(&vllm_body(6)).await;
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--listen",
            "127.0.0.1:0",
            "--interval-ms",
            "50",
            "--ingest-url",
            "http://127.0.0.1:9/x",
        ])
        .arg("--pool")
        .arg(format!("llama={}", pod.addr))
        .env("GPUROUTE_INGEST_TOKEN", "t")
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let listen = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("a log line with the listen address");
        if let Some(rest) = line.split("listen=").nth(1) {
            break rest.split_whitespace().next().unwrap().to_string();
        }
    };
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    assert_eq!(
        http.get(format!("http://{listen}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let snap = loop {
        let r = http
            .get(format!("http://{listen}/debug/snapshot"))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            break r.json::<serde_json::Value>().await.unwrap();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(snap["pools"][0]["name"], "llama");
    let page = http
        .get(format!("http://{listen}/"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        page.contains("http-equiv=\"refresh\"") && page.contains(&pod.addr.to_string()),
        "{page}"
    );

    let kill = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no exit after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn scrape_once_prints_the_normalised_pod() {
    let pod = FakePod::start(&vllm_body(7)).await;
    let out = tokio::process::Command::new(BIN)
        .args([
            "scrape-once",
            &format!("http://{}/metrics", pod.addr),
            "--delta-ms",
            "0",
            "--json",
        ])
        .output()
        .await
        .unwrap();
    let v = succeeded_json(&out);
    assert_eq!(v["pod"]["waiting"], 7);
    assert_eq!(v["pod"]["engine"], "vllm");
    assert_eq!(v["raw"].as_array().unwrap().len(), 3);

    pod.set_body("not metrics at all\n");
    let out = tokio::process::Command::new(BIN)
        .args([
            "scrape-once",
            &format!("http://{}/metrics", pod.addr),
            "--delta-ms",
            "0",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // Text that is not an exposition of any known engine: nothing to route on.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("(no_metrics)"), "{stderr}");

    pod.set_body("vllm:num_requests_waiting{model=\"m\" 1\n");
    let out = tokio::process::Command::new(BIN)
        .args([
            "scrape-once",
            &format!("http://{}/metrics", pod.addr),
            "--delta-ms",
            "0",
        ])
        .output()
        .await
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("(parse)") && stderr.contains("line 1"),
        "{stderr}"
    );
}

#[path = "common/tls_pod.rs"]
mod tls_pod;

#[tokio::test]
async fn scrape_once_reads_a_pod_serving_https_with_the_configs_scrape_tls() {
    let (addr, _) = tls_pod::serve(Some(tls_pod::server_config("pod", true)), vllm_body(5)).await;
    let url = format!("https://{addr}/metrics");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sidecar.yaml");
    let tls = |name: &str| tls_pod::file(name).display().to_string();
    std::fs::write(
        &config,
        format!(
            "scrape_tls: {{ ca_file: {}, cert_file: {}, key_file: {} }}\n",
            tls("ca.pem"),
            tls("client.pem"),
            tls("client.key")
        ),
    )
    .unwrap();
    let run = |with_config: bool| {
        let mut c = tokio::process::Command::new(BIN);
        c.args(["scrape-once", &url, "--delta-ms", "0", "--json"]);
        if with_config {
            c.arg("--config").arg(&config);
        }
        c.output()
    };
    let out = run(true).await.unwrap();
    let v = succeeded_json(&out);
    assert_eq!(v["pod"]["waiting"], 5);
    // Without it: the system's authorities, which do not know the test one (or, on a machine
    // with none installed, none at all).
    let out = run(false).await.unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("UnknownIssuer") || stderr.contains("no certificate authority found"),
        "{stderr}"
    );
}
