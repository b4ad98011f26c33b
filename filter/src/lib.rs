//! gpuroute proxy-wasm filter (placeholder; see issue 2).
