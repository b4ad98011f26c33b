//! Hot path of scraping: parsing and reading a real vLLM V1 scrape (45 KB, 503 lines). At 1,000
//! pods every 100 ms this runs 10,000 times a second.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use sidecar_metrics::{engine, prom};

fn sample() -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/metrics/vllm-v1-0.11-hardware-aware-router-idle.txt"
    );
    std::fs::read_to_string(path).unwrap_or_default()
}

fn bench(c: &mut Criterion) {
    let text = sample();
    let mut g = c.benchmark_group("vllm_v1_45kb");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("parse", |b| {
        b.iter(|| prom::parse(black_box(&text)).filter(|s| s.is_ok()).count())
    });
    g.bench_function("read", |b| {
        b.iter(|| engine::read(black_box(&text), None, false).map(|r| r.waiting))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
