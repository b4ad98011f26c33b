//! `Engine::prepare` (parse, resolve, hash, index lookup) N times over one body, for profilers:
//! `valgrind --tool=callgrind target/release/examples/prepare_loop BODY.json 10000` splits a
//! request's parse by function natively (build with `CARGO_PROFILE_RELEASE_DEBUG=line-tables-only`
//! for source lines). `make profile-wasm` writes the benchmark's body to
//! `target/bench/wasm-profile/chat.json`.

// A profiling aid: stops loudly on bad input.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use gpuroute_core::config::FilterConfig;
use gpuroute_core::engine::Engine;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: prepare_loop BODY.json [N]");
    let n: usize = args
        .next()
        .map_or(10_000, |s| s.parse().expect("N is a count"));
    let body = std::fs::read(&path).expect("readable body file");
    let cfg = br#"{"pools":[{"name":"llama","models":["llama-3-8b"]}]}"#;
    let mut engine = Engine::new(FilterConfig::from_json(cfg).expect("valid configuration"));
    let mut tokens = 0u64;
    for _ in 0..n {
        let p = engine
            .prepare("/v1/chat/completions", &body)
            .unwrap_or_else(|e| panic!("{}", e.message));
        tokens += u64::from(p.prompt_tokens);
    }
    println!("{n} bodies, {tokens} prompt tokens");
}
