//! `Engine::prepare` (parse, resolve, hash, index lookup) N times over one body, for profilers:
//! `valgrind --tool=callgrind target/release/examples/prepare_loop BODY.json 10000` splits a
//! request's parse by function natively (build with `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only`
//! for source lines). With `decide` after N, the filter's whole decision instead: `prepare`, the
//! in-flight view, `Engine::decide` over 8 equally loaded pods (the pool of
//! `scripts/wasm_profile.mjs`) and `Engine::commit`. `make profile-wasm` writes the benchmark's
//! body to `target/bench/wasm-profile/chat.json`.

// A profiling aid: stops loudly on bad input.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpuroute_core::config::FilterConfig;
use gpuroute_core::engine::{DecideOptions, Engine};
use gpuroute_core::fleet::FleetState;
use gpuroute_core::load::{LoadTable, SparseTable};
use gpuroute_core::rng::SplitMix64;
use gpuroute_core::snapshot::{PodSnapshot, PoolSnapshot, Snapshot, SNAPSHOT_SCHEMA};

const NOW: u64 = 1_700_000_000_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .expect("usage: prepare_loop BODY.json [N] [decide]");
    let n: usize = args
        .next()
        .map_or(10_000, |s| s.parse().expect("N is a count"));
    let decide = args.next().is_some_and(|a| a == "decide");
    let body = std::fs::read(&path).expect("readable body file");
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"]}]}"#;
    let mut engine = Engine::new(FilterConfig::from_json(cfg).expect("valid configuration"));
    let fleet = eight_pods();
    let keys = fleet.pool("llama").expect("the pool").keys.clone();
    // Each request counted in flight and finished again, as the filter's requests are: the
    // tables stay as they start.
    let own = LoadTable::zeroed(fleet.version, &keys);
    // The other workers' tables, summed: nothing in flight (as the filter's `PeerTables::sum`).
    let others = SparseTable {
        version: fleet.version,
        entries: Vec::new(),
    };
    let mut rng = SplitMix64::new(1);
    let (mut tokens, mut picked) = (0u64, 0u64);
    for _ in 0..n {
        let p = engine
            .prepare("/v1/chat/completions", &body)
            .unwrap_or_else(|e| panic!("{}", e.message));
        tokens += u64::from(p.prompt_tokens);
        if !decide {
            continue;
        }
        let mut view = own.clone();
        view.add_sparse(&others);
        let opts = DecideOptions {
            now_ms: NOW,
            ..Default::default()
        };
        let choice = engine.decide(&p, Some(&fleet), &view.pods, opts, &mut rng);
        if let Some(key) = choice.picked_key {
            engine.commit(&p, key);
            picked += 1;
        }
    }
    println!("{n} bodies, {tokens} prompt tokens, {picked} picked");
}

/// One pool of 8 pods with equal load, fresh at `NOW`.
fn eight_pods() -> FleetState {
    let pods = (0..8)
        .map(|i| {
            let mut p = PodSnapshot::new(format!("127.0.0.1:{}", 9000 + i), NOW);
            p.running = 4;
            p.kv_cache_usage = Some(0.3);
            p
        })
        .collect();
    FleetState::new(
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
    )
}
