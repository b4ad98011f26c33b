//! Decision cost, natively: the whole per-request pipeline the filter runs (parse the body,
//! resolve the model, hash the prompt, look up the prefix index, score every pod, pick, record),
//! for a 64-pod pool with a 4 KB chat prompt and for a 1,000-pod pool.
//!
//! Targets (issue 2): <= 20 us for 64 pods, <= 200 us for 1,000 pods.
//! Run: `cargo bench -p gpuroute-core --bench decision`

// A benchmark, like a test, may stop loudly on broken setup.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use gpuroute_core::adapters::{partition, SlotPod};
use gpuroute_core::config::FilterConfig;
use gpuroute_core::engine::{DecideOptions, Engine, Prepared, Reader, RequestContext};
use gpuroute_core::fleet::{adapter_key, FleetState};
use gpuroute_core::ingest::{self, StoredHeader};
use gpuroute_core::load::LoadTable;
use gpuroute_core::picker::Decision;
use gpuroute_core::request::Endpoint;
use gpuroute_core::rng::SplitMix64;
use gpuroute_core::snapshot::{LoraState, PodSnapshot, PoolSnapshot, Snapshot, SNAPSHOT_SCHEMA};
use std::sync::{Arc, Mutex};
use std::time::Instant;

const NOW: u64 = 1_700_000_000_000;

fn fleet(pods: usize) -> FleetState {
    FleetState::new(snapshot(pods), NOW - 10)
}

/// A snapshot of one pool of `pods` busy pods, as sidecar-metrics publishes it.
fn snapshot(pods: usize) -> Snapshot {
    let mut rng = SplitMix64::new(7);
    let pods = (0..pods)
        .map(|i| {
            let mut p = PodSnapshot::new(
                format!("10.{}.{}.{}:8000", i / 65536, (i / 256) % 256, i % 256),
                NOW - 40,
            );
            p.waiting = (rng.next_u64() % 4) as u32;
            p.running = (rng.next_u64() % 64) as u32;
            p.kv_cache_usage = Some(rng.next_f64() * 0.7);
            p.block_size = Some(16);
            p.num_blocks = Some(20_000);
            p.prefix_cache_hit_rate = Some(rng.next_f64());
            p.lora = Some(LoraState {
                max_loras: 4,
                running: vec![format!("adapter-{}", i % 16)],
                waiting: vec![],
            });
            p
        })
        .collect();
    Snapshot {
        schema: SNAPSHOT_SCHEMA,
        version: 1,
        source: "bench".into(),
        generated_at_ms: NOW - 20,
        pools: vec![PoolSnapshot {
            name: "llama".into(),
            pods,
        }],
    }
}

/// A realistic 4 KB chat body: system prompt, a few turns, the new question.
fn chat_body(variant: usize) -> Vec<u8> {
    let system = "You are a meticulous assistant for a logistics company. Answer with numbered steps, cite the policy section you rely on, and never invent tracking numbers. ".repeat(3);
    let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
    let mut size = system.len();
    let mut turn = 0;
    while size < 3_800 {
        let q = format!("Turn {turn} of conversation {variant}: the shipment left the Rotterdam hub on Tuesday and has not been scanned since; what should I check next?");
        let a = "First, check the carrier's manifest for the last handoff scan; second, open a trace with the line-haul partner; third, notify the customer with the policy 4.2 template.";
        size += q.len() + a.len();
        messages.push(serde_json::json!({"role": "user", "content": q}));
        messages.push(serde_json::json!({"role": "assistant", "content": a}));
        turn += 1;
    }
    messages.push(serde_json::json!({"role": "user", "content": "And if the hub says it was never received?"}));
    serde_json::to_vec(&serde_json::json!({"model": "llama-3-8b", "stream": true, "max_tokens": 256, "messages": messages}))
        .unwrap_or_default()
}

fn engine() -> Engine {
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"],"adapters":["adapter-3"]}]}"#;
    Engine::new(FilterConfig::from_json(cfg).unwrap_or_else(|e| panic!("{e}")))
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("decision");
    for pods in [64usize, 1_000] {
        let fleet = fleet(pods);
        let pool = &fleet.pools[0];
        let mut table = LoadTable::default();
        table.rebase(fleet.version, &pool.keys);
        let bodies: Vec<Vec<u8>> = (0..64).map(chat_body).collect();
        assert!(
            bodies[0].len() >= 4_000,
            "body is {} bytes",
            bodies[0].len()
        );
        let mut e = engine();
        // Warm the prefix index as a running gateway would have it.
        let mut rng = SplitMix64::new(1);
        for b in &bodies {
            if let Ok(p) = e.prepare("/v1/chat/completions", b) {
                let opts = DecideOptions {
                    now_ms: NOW,
                    ..Default::default()
                };
                let ch = e.decide(&p, Some(&fleet), &table.pods, opts, &mut rng);
                if let Some(k) = ch.picked_key {
                    e.commit(&p, k);
                }
            }
        }
        let mut i = 0usize;
        group.bench_with_input(BenchmarkId::new("chat_4kb", pods), &pods, |b, _| {
            b.iter(|| {
                i = (i + 1) % bodies.len();
                let p = e
                    .prepare("/v1/chat/completions", &bodies[i])
                    .unwrap_or_else(|e| panic!("{}", e.message));
                let opts = DecideOptions {
                    now_ms: NOW,
                    ..Default::default()
                };
                let ch = e.decide(&p, Some(&fleet), &table.pods, opts, &mut rng);
                if let Some(k) = ch.picked_key {
                    e.commit(&p, k);
                }
                black_box(ch.destination)
            })
        });
    }
    group.finish();

    // The parts, to see where the time goes.
    let body = chat_body(1);
    let mut parts = c.benchmark_group("parts");
    // Parsing one body on one endpoint (the prompt text kept for hashing: 16 KB).
    let mut parse = |name: &str, body: &[u8], endpoint: Endpoint| {
        parts.bench_function(name, |b| {
            b.iter(|| {
                black_box(
                    gpuroute_core::request::parse(body, endpoint, 16_384, 1_024)
                        .map(|r| r.prompt.len()),
                )
            })
        });
    };
    parse("parse_4kb", &body, Endpoint::Chat);
    // The same conversation as an Anthropic Messages API body (`system` at the top level).
    let mut as_messages: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let system = as_messages["messages"].as_array_mut().unwrap().remove(0);
    as_messages["system"] = system["content"].clone();
    parse(
        "parse_4kb_messages_api",
        &serde_json::to_vec(&as_messages).unwrap(),
        Endpoint::Messages,
    );
    // The same again with every content as a list of text blocks, and the system prompt as a
    // block with `cache_control`: what Anthropic's SDKs and the agents built on them send.
    let blocks = |body: &mut serde_json::Value| {
        for m in body["messages"].as_array_mut().unwrap() {
            m["content"] = serde_json::json!([{"type": "text", "text": m["content"]}]);
        }
    };
    let mut as_blocks = as_messages.clone();
    as_blocks["system"] = serde_json::json!([{"type": "text", "text": as_blocks["system"],
        "cache_control": {"type": "ephemeral"}}]);
    blocks(&mut as_blocks);
    parse(
        "parse_4kb_messages_api_blocks",
        &serde_json::to_vec(&as_blocks).unwrap(),
        Endpoint::Messages,
    );
    // And the chat body with OpenAI's content parts.
    let mut as_parts: serde_json::Value = serde_json::from_slice(&body).unwrap();
    blocks(&mut as_parts);
    parse(
        "parse_4kb_content_parts",
        &serde_json::to_vec(&as_parts).unwrap(),
        Endpoint::Chat,
    );
    let text =
        gpuroute_core::request::parse(&body, gpuroute_core::request::Endpoint::Chat, 16_384, 1_024)
            .map(|r| r.prompt)
            .unwrap_or_default();
    let mut anchors = Vec::new();
    parts.bench_function("hash_4kb", |b| {
        b.iter(|| {
            gpuroute_core::prefix::prompt_anchors(text.as_bytes(), 7, 64, 256, &mut anchors);
            black_box(anchors.len())
        })
    });
    let mut e = engine();
    parts.bench_function("prepare_4kb", |b| {
        b.iter(|| {
            black_box(
                e.prepare("/v1/chat/completions", &body)
                    .map(|p| p.prompt_tokens),
            )
        })
    });
    // The same body for a split (95 / 5 between two names the pool serves): the key hash, the
    // serving check against the snapshot and the body rewrite on top of the plain prepare.
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b","llama-3-8b-canary"]}],
        "splits":{"llama":[{"model":"llama-3-8b","weight":95},{"model":"llama-3-8b-canary","weight":5}]}}"#;
    let mut e = Engine::new(FilterConfig::from_json(cfg).unwrap_or_else(|e| panic!("{e}")));
    let split_body = String::from_utf8(body.clone())
        .unwrap()
        .replacen(r#""model":"llama-3-8b""#, r#""model":"llama""#, 1)
        .into_bytes();
    let split_fleet = fleet(64);
    let split_ctx = RequestContext {
        fleet: Some(&split_fleet),
        now_ms: NOW,
        ..RequestContext::default()
    };
    assert!(e
        .prepare_in("/v1/chat/completions", &split_body, split_ctx)
        .unwrap()
        .split
        .is_some());
    parts.bench_function("prepare_4kb_split", |b| {
        b.iter(|| {
            black_box(
                e.prepare_in("/v1/chat/completions", &split_body, split_ctx)
                    .map(|p| p.prompt_tokens),
            )
        })
    });
    // A pool with a failover pool: the plain prepare with a snapshot at hand (the baseline), the
    // same with the check that the pool serves (its first pod is fresh), and the pool with
    // every pod down, its request handed to the standby pool.
    let with_standby = |llama: fn(&mut PodSnapshot)| {
        let mut snap = snapshot(64);
        let mut standby = snap.pools[0].clone();
        standby.name = "standby".into();
        for p in &mut snap.pools[0].pods {
            llama(p);
        }
        snap.pools.push(standby);
        FleetState::new(snap, NOW - 10)
    };
    let up = with_standby(|_| {});
    let down = with_standby(|p| p.healthy = false);
    let saturated = with_standby(|p| p.waiting = 9);
    let at = |fleet| RequestContext {
        fleet: Some(fleet),
        now_ms: NOW,
        ..RequestContext::default()
    };
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"]},{"name":"standby","models":["s"]}]}"#;
    let plain = Engine::new(FilterConfig::from_json(cfg).unwrap_or_else(|e| panic!("{e}")));
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"],"failover":["standby"]},
        {"name":"standby","models":[]}]}"#;
    let with_failover = Engine::new(FilterConfig::from_json(cfg).unwrap_or_else(|e| panic!("{e}")));
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"],"failover":["standby"],"overflow":true},
        {"name":"standby","models":[]}]}"#;
    let with_overflow = Engine::new(FilterConfig::from_json(cfg).unwrap_or_else(|e| panic!("{e}")));
    let mut engines = [plain, with_failover, with_overflow];
    for (name, i, fleet, failed_over) in [
        ("prepare_4kb_with_snapshot", 0, &up, false),
        ("prepare_4kb_failover_serving", 1, &up, false),
        ("prepare_4kb_failed_over", 1, &down, true),
    ] {
        let engine = &mut engines[i];
        let p = engine.prepare_in("/v1/chat/completions", &body, at(fleet));
        assert_eq!(p.unwrap().failed_over.is_some(), failed_over, "{name}");
        parts.bench_function(name, |b| {
            b.iter(|| {
                black_box(
                    engine
                        .prepare_in("/v1/chat/completions", &body, at(fleet))
                        .map(|p| p.prompt_tokens),
                )
            })
        });
    }
    // `overflow` is the pick's: the 64-pod decision without it (the baseline), with it while the
    // pool has room (the look for a failover pool with room: its first pod), and with every
    // pod saturated (the pick finds none, the request moves, the standby's 64 pods are picked
    // from). Each from a clone of the prepared request, as the move changes it.
    for (name, i, fleet, moved) in [
        ("decide_64_plain", 0, &up, false),
        ("decide_64_overflow_room", 2, &up, false),
        ("decide_64_overflowed", 2, &saturated, true),
    ] {
        let engine = &mut engines[i];
        let prep = engine
            .prepare_in("/v1/chat/completions", &body, at(fleet))
            .unwrap_or_else(|e| panic!("{}", e.message));
        let opts = DecideOptions {
            now_ms: NOW,
            ..Default::default()
        };
        let mut rng = SplitMix64::new(1);
        let mut decide = |engine: &mut Engine| {
            let mut p = prep.clone();
            let mut c = engine.decide(&p, Some(fleet), &[], opts, &mut rng);
            if let Decision::Overflow(to) = c.decision {
                engine.overflow(&mut p, to);
                c = engine.decide(&p, Some(fleet), &[], opts, &mut rng);
            }
            (p.failed_over.is_some(), c.picked_key)
        };
        let (was_moved, picked) = decide(engine);
        assert_eq!((was_moved, picked.is_some()), (moved, true), "{name}");
        parts.bench_function(name, |b| b.iter(|| black_box(decide(engine))));
    }
    parts.finish();

    // Audio uploads (`gpuroute_core::form`): what the shells read of a form. The head OpenAI's
    // Python SDK sends before the file (routed there), and a 4 MiB file-first body
    // (`max_body_bytes`' default), read whole for a `model` after the file: the search for the
    // boundary across the file is the most a form costs.
    let mut forms = c.benchmark_group("form");
    let boundary = "0b4e5d2c8a7f41e39c0d6b1a2f3e4d5c";
    let part = |name: &str, file: bool| {
        let filename = if file {
            "; filename=\"clip.wav\"\r\ncontent-type: audio/wav"
        } else {
            ""
        };
        format!("--{boundary}\r\ncontent-disposition: form-data; name=\"{name}\"{filename}\r\n\r\n")
    };
    let mut head = Vec::new();
    for (k, v) in [
        ("model", "whisper"),
        ("response_format", "json"),
        ("language", "en"),
    ] {
        head.extend_from_slice(part(k, false).as_bytes());
        head.extend_from_slice(format!("{v}\r\n").as_bytes());
    }
    head.extend_from_slice(part("file", true).as_bytes());
    head.extend_from_slice(&[0x52; 1000]);
    // Pseudo-random audio bytes (CR and LF among them), a fixed seed.
    let mut x = 0x9e37_79b9_7f4a_7c15_u64;
    let audio: Vec<u8> = (0..4 * 1024 * 1024 - 1024)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let mut file_first = part("file", true).into_bytes();
    file_first.extend_from_slice(&audio);
    file_first.extend_from_slice(b"\r\n");
    file_first.extend_from_slice(part("model", false).as_bytes());
    file_first.extend_from_slice(format!("whisper\r\n--{boundary}--\r\n").as_bytes());
    for (name, body, complete) in [
        ("sdk_head", &head, false),
        ("file_first_4mb", &file_first, true),
    ] {
        let scan = gpuroute_core::form::scan(body, boundary, complete);
        assert!(
            matches!(scan, Ok(gpuroute_core::form::Scan::Ready(_))),
            "{name}"
        );
        forms.bench_function(name, |b| {
            b.iter(|| {
                black_box(gpuroute_core::form::scan(black_box(body), boundary, complete).is_ok())
            })
        });
    }
    forms.finish();
}

/// The dynamic module's pattern: one engine for every Envoy worker, behind a mutex. Each thread
/// routes the 4 KB chat body to a 64-pod pool as the module's `route` does: the body read, then
/// under the lock the prefix lookups, the pick and the commit. Three ways, by `Lock`:
/// - `std_read_in_lock`: the module before 2026-12-04: `std::sync::Mutex`, the body read under
///   it too (`Engine::prepare_in`);
/// - `std_read_outside`: the body read before the lock (`Reader::read` on a clone of the
///   reader, then `Engine::prepare_read` under it);
/// - `parking_lot`: the same with `parking_lot::Mutex`, which spins a little before it parks a
///   waiting thread (the module now).
///
/// One iteration is one request on each thread at once, so with no contention the time stays
/// the single-threaded request's, and with the lock held throughout it grows with the threads.
/// On this 2-core machine: 1 and 2 threads.
fn shared_engine(c: &mut Criterion) {
    if cfg!(target_os = "wasi") {
        return; // No threads in a wasm32-wasip1 VM (the module runs natively anyway).
    }
    let fleet = Arc::new(fleet(64));
    let bodies: Arc<Vec<Vec<u8>>> = Arc::new((0..64).map(chat_body).collect());
    let mut group = c.benchmark_group("shared_engine");
    for threads in [1usize, 2] {
        for lock in [Lock::StdReadInside, Lock::StdReadOutside, Lock::ParkingLot] {
            let id = BenchmarkId::new(lock.name(), threads);
            group.bench_with_input(id, &threads, |b, &threads| {
                let e = engine();
                let shared = Shared {
                    reader: e.reader().clone(),
                    parking_lot: parking_lot::Mutex::new(engine()),
                    std: Mutex::new(e),
                };
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    std::thread::scope(|scope| {
                        for t in 0..threads {
                            let (shared, fleet, bodies) = (&shared, &fleet, &bodies);
                            scope.spawn(move || {
                                let mut rng = SplitMix64::new(t as u64);
                                for i in 0..iters as usize {
                                    let body = &bodies[(i * 7 + t) % bodies.len()];
                                    black_box(shared.route(lock, fleet, body, &mut rng));
                                }
                            });
                        }
                    });
                    start.elapsed()
                })
            });
        }
    }
    group.finish();
}

#[derive(Clone, Copy)]
enum Lock {
    StdReadInside,
    StdReadOutside,
    ParkingLot,
}

impl Lock {
    fn name(self) -> &'static str {
        match self {
            Lock::StdReadInside => "std_read_in_lock",
            Lock::StdReadOutside => "std_read_outside",
            Lock::ParkingLot => "parking_lot",
        }
    }
}

struct Shared {
    reader: Reader,
    std: Mutex<Engine>,
    parking_lot: parking_lot::Mutex<Engine>,
}

impl Shared {
    fn route(
        &self,
        lock: Lock,
        fleet: &FleetState,
        body: &[u8],
        rng: &mut SplitMix64,
    ) -> Option<String> {
        let path = "/v1/chat/completions";
        let ctx = RequestContext {
            fleet: Some(fleet),
            now_ms: NOW,
            ..RequestContext::default()
        };
        let decide = |e: &mut Engine, p: Prepared, rng: &mut SplitMix64| {
            let opts = DecideOptions {
                now_ms: NOW,
                ..Default::default()
            };
            let ch = e.decide(&p, Some(fleet), &[], opts, rng);
            if let Some(k) = ch.picked_key {
                e.commit(&p, k);
            }
            ch.destination
        };
        match lock {
            Lock::StdReadInside => {
                let mut e = self.std.lock().unwrap();
                let p = e.prepare_in(path, body, ctx).unwrap();
                decide(&mut e, p, rng)
            }
            Lock::StdReadOutside => {
                let read = self.reader.read(path, body, ctx).unwrap();
                let mut e = self.std.lock().unwrap();
                let p = e.prepare_read(read);
                decide(&mut e, p, rng)
            }
            Lock::ParkingLot => {
                let read = self.reader.read(path, body, ctx).unwrap();
                let mut e = self.parking_lot.lock();
                let p = e.prepare_read(read);
                decide(&mut e, p, rng)
            }
        }
    }
}

/// What a new snapshot costs the filter: the ingest listener's validation of the pushed JSON
/// and its encoding of the binary form (once per push), and each worker's decode of the binary
/// form and building of its pools' state from it (once per push on every worker that routes;
/// `install_json`: the same from the JSON, as before the binary form).
fn snapshot_install(c: &mut Criterion) {
    let mut group = c.benchmark_group("snapshot");
    for pods in [64usize, 1_000, 10_000] {
        let json = serde_json::to_vec(&snapshot(pods)).unwrap_or_default();
        let header = StoredHeader {
            received_at_ms: NOW - 10,
            version: 1,
        };
        let stored = ingest::encode_stored(header, &json);
        group.bench_with_input(BenchmarkId::new("accept", pods), &pods, |b, _| {
            b.iter(|| black_box(ingest::accept(&json, 8 << 20, None).is_ok()))
        });
        group.bench_with_input(BenchmarkId::new("install_json", pods), &pods, |b, _| {
            b.iter(|| {
                let (h, snap) = ingest::decode_stored(&stored).unwrap_or_else(|| panic!("stored"));
                black_box(FleetState::new(snap, h.received_at_ms))
            })
        });
        let accepted = ingest::accept(&json, 8 << 20, None).unwrap_or_else(|e| panic!("{e:?}"));
        group.bench_with_input(BenchmarkId::new("encode_binary", pods), &pods, |b, _| {
            b.iter(|| black_box(ingest::encode_stored_binary(header, &accepted)))
        });
        let binary = ingest::encode_stored_binary(header, &accepted);
        group.bench_with_input(BenchmarkId::new("install", pods), &pods, |b, _| {
            b.iter(|| {
                let snap = ingest::decode_stored_binary(&binary, header)
                    .unwrap_or_else(|| panic!("binary"));
                black_box(FleetState::new(snap, header.received_at_ms))
            })
        });
        // Each worker's in-flight table of the pool, aligned with the new version (the same
        // pods in the same places, as a push of the same fleet brings).
        let keys: Vec<u64> = (0..pods as u64).map(|k| k * 7919 + 1).collect();
        let mut table = gpuroute_core::load::LoadTable::default();
        let mut version = 0;
        group.bench_with_input(BenchmarkId::new("rebase", pods), &pods, |b, _| {
            b.iter(|| {
                version += 1;
                black_box(table.rebase(version, &keys))
            })
        });
        eprintln!(
            "snapshot of {pods} pods: {} bytes of JSON, {} in binary",
            json.len(),
            binary.len()
        );
    }
    group.finish();
}

/// The adapter partition ([`partition`]): recomputed only when a pool's pods, slots or speed
/// classes change, but then on the request path.
fn adapter_partition(c: &mut Criterion) {
    let mut group = c.benchmark_group("adapter_partition");
    for (adapters, pods) in [(16usize, 4u64), (1_000, 32), (5_000, 64)] {
        let keys: Vec<u64> = (0..adapters)
            .map(|i| adapter_key(&format!("lora-{i}")))
            .collect();
        let ps: Vec<SlotPod> = (1..=pods)
            .map(|k| SlotPod {
                key: k.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                weight: 1.0,
                slots: 4,
            })
            .collect();
        let id = format!("{adapters}x{pods}");
        group.bench_function(BenchmarkId::new("partition", id), |b| {
            b.iter(|| black_box(partition(&keys, &ps).len()))
        });
    }
    group.finish();
}

criterion_group!(
    benches,
    bench,
    shared_engine,
    snapshot_install,
    adapter_partition
);
criterion_main!(benches);
