//! The filter's whole per-request decision natively, N times over one body: `Engine::prepare`,
//! the in-flight view, `Engine::decide` over 8 equally loaded pods (the pool of
//! `scripts/wasm_profile.mjs`), `Engine::commit`. For profilers, as `prepare_loop`:
//! `valgrind --tool=callgrind target/release/examples/route_loop BODY.json 10000`.

// A profiling aid: stops loudly on bad input.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpuroute_core::config::FilterConfig;
use gpuroute_core::engine::{DecideOptions, Engine};
use gpuroute_core::fleet::FleetState;
use gpuroute_core::load::LoadTable;
use gpuroute_core::rng::SplitMix64;
use gpuroute_core::snapshot::{PodSnapshot, PoolSnapshot, Snapshot, SNAPSHOT_SCHEMA};

const NOW: u64 = 1_700_000_000_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: route_loop BODY.json [N]");
    let n: usize = args
        .next()
        .map_or(10_000, |s| s.parse().expect("N is a count"));
    let body = std::fs::read(&path).expect("readable body file");
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"]}]}"#;
    let mut engine = Engine::new(FilterConfig::from_json(cfg).expect("valid configuration"));
    let pods = (0..8)
        .map(|i| {
            let mut p = PodSnapshot::new(format!("127.0.0.1:{}", 9000 + i), NOW);
            p.running = 4;
            p.kv_cache_usage = Some(0.3);
            p
        })
        .collect();
    let fleet = FleetState::new(
        Snapshot {
            schema: SNAPSHOT_SCHEMA,
            version: 1,
            source: "profile".into(),
            generated_at_ms: NOW,
            pools: vec![PoolSnapshot {
                name: "llama".into(),
                pods,
            }],
        },
        NOW,
    );
    let keys = fleet.pool("llama").expect("the pool").keys.clone();
    let own = LoadTable::zeroed(fleet.version, &keys);
    let others = LoadTable::zeroed(fleet.version, &keys);
    let mut rng = SplitMix64::new(1);
    let mut picked = 0u64;
    for _ in 0..n {
        let p = engine
            .prepare("/v1/chat/completions", &body)
            .unwrap_or_else(|e| panic!("{}", e.message));
        let mut view = own.clone();
        view.add_table(&others, None);
        let opts = DecideOptions {
            now_ms: NOW,
            ..Default::default()
        };
        let choice = engine.decide(&p, Some(&fleet), &view.pods, opts, &mut rng);
        // Each request counted in flight and finished again, as the filter's requests are.
        if let Some(key) = choice.picked_key {
            engine.commit(&p, key);
            picked += 1;
        }
    }
    println!("{n} bodies, {picked} picked");
}
